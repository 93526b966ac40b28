# Set-up steps shared by scripts/dev.sh and scripts/ui-tests.sh (sourced, not run).
# Every step is idempotent: on a machine that has everything, they only check.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PYTHON="${PYTHON:-python3}"

log() { printf '\n== %s\n' "$*" >&2; }

# runs_for_others PYTHON: whether an ordinary user (nobody) can run PYTHON. A virtualenv
# links to the Python it was made from; one under a private directory (/root/.pyenv) is
# root's alone, and non-root use (docs/nonroot.md) needs one every user can run.
runs_for_others() {
  runuser -u nobody -- "$1" -c 'import ssl' >/dev/null 2>&1
}

# base_python: $PYTHON if other users can run it, else Debian's /usr/bin/python3.
base_python() {
  local py
  py="$(command -v "$PYTHON" || true)"
  if [ -n "$py" ] && { [ "$(id -u)" != 0 ] || runs_for_others "$py"; }; then
    echo "$py"
  elif [ -x /usr/bin/python3 ] && runs_for_others /usr/bin/python3; then
    log "$PYTHON ($py) cannot be run by other users: the virtualenv uses /usr/bin/python3"
    echo /usr/bin/python3
  else
    echo "${py:-$PYTHON}"
  fi
}

# apt_install PKG...: install the packages that are missing.
apt_install() {
  local missing=()
  for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
  if [ ${#missing[@]} -gt 0 ]; then
    log "apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

# apt_install_lean PKG...: the same without recommended packages (R's r-base-core would
# bring a compiler tool chain, TeX fonts and more that nothing here uses).
apt_install_lean() {
  local missing=()
  for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
  if [ ${#missing[@]} -gt 0 ]; then
    log "apt-get install --no-install-recommends ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null
  fi
}

# The kernels other than ipykernel that the tests run behind the wrapper's bridge
# (tests/test_kernels.py, ui-tests/tests/kernels.spec.ts; docs/kernels.md): IRkernel on
# Debian's R (31 packages, 65 MB installed); xeus-python comes from PyPI (the test extra).
R_KERNEL_PACKAGES=(r-base-core r-cran-irkernel)

# setup_machine EXTRAS [PKG...]: as root on Debian/Ubuntu, system packages (and PKG...),
# Node.js >= 18, CRIU >= 4.2 (scripts/install-criu.sh), and .venv with this package
# installed editable with EXTRAS (which builds the JupyterLab extension); with the "test"
# extra also tests/chp's configurable-http-proxy (the JupyterHub tests' proxy). Skipped in a
# child of a set-up that already ran (JKS_SETUP_DONE=1).
setup_machine() {
  local extras="$1"
  shift
  [ "${JKS_SETUP_DONE:-}" = 1 ] && return 0
  if [ "$(id -u)" != 0 ]; then
    echo "run as root (CRIU needs it): sudo $0" >&2
    return 1
  fi
  command -v apt-get >/dev/null || { echo "this needs Debian/Ubuntu (no apt-get)" >&2; return 1; }
  # slirp4netns: a way out for a copy restored into a network namespace of its own.
  apt_install util-linux iproute2 slirp4netns patchelf python3-venv ca-certificates gcc curl "$@"
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    apt_install nodejs npm
  fi
  local node_major
  node_major=$(node -p 'process.versions.node.split(".")[0]')
  if [ "$node_major" -lt 18 ]; then
    echo "Node.js >= 18 is needed to build the extension (found $(node -v))" >&2
    return 1
  fi
  log "CRIU"
  "$ROOT/scripts/install-criu.sh"
  if [ ! -x "$VENV/bin/python" ]; then
    log "virtualenv $VENV"
    "$(base_python)" -m venv "$VENV"
  elif ! runs_for_others "$VENV/bin/python"; then
    log "warning: other users cannot run $VENV/bin/python (made from a Python in a private" \
      "directory); for non-root use remove $VENV and run the set-up again (docs/nonroot.md)"
  fi
  log "Python packages"
  "$VENV/bin/pip" install -q --upgrade pip
  # Tests run bench/bench_peers.py at its smallest size (tests/test_bench_peers.py).
  if [[ ",$extras," == *",test,"* ]]; then extras="$extras,bench"; fi
  "$VENV/bin/pip" install -q -e ".[$extras]"
  if [[ ",$extras," == *",test,"* ]]; then
    apt_install_lean "${R_KERNEL_PACKAGES[@]}"
    # strace: tests/test_tracking.py counts the syscalls CRIU makes (its patch 0005).
    apt_install strace
    log "configurable-http-proxy for the JupyterHub tests (npm ci in tests/chp)"
    npm ci --prefix "$ROOT/tests/chp" --no-audit --no-fund --loglevel=error
  fi
  export JKS_SETUP_DONE=1
}
