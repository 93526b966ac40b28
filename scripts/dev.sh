#!/usr/bin/env bash
# One entry point for a fresh Debian/Ubuntu machine (run as root: CRIU needs it).
#
#   scripts/dev.sh lab    set everything up, then start JupyterLab with snapshots working
#                         (local snapshot store under the Jupyter data directory)
#   scripts/dev.sh test   set everything up, then run the whole test suite (what CI runs):
#                         ruff, mypy, pytest, then the UI tests (scripts/ui-tests.sh)
#
# Set-up is idempotent: system packages (apt, Node.js if missing), CRIU >= 4.2 in a
# private prefix (scripts/install-criu.sh), a virtualenv in .venv with the package
# installed editable (which builds the JupyterLab extension).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV="$ROOT/.venv"
PYTHON="${PYTHON:-python3}"

log() { printf '\n== %s\n' "$*" >&2; }

apt_install() {
  local missing=()
  for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
  if [ ${#missing[@]} -gt 0 ]; then
    log "apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

setup() {
  [ "$(id -u)" = 0 ] || { echo "run as root (CRIU needs it): sudo $0 $*" >&2; exit 1; }
  apt_install util-linux iproute2 patchelf python3-venv ca-certificates gcc
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    apt_install nodejs npm
  fi
  log "CRIU"
  "$ROOT/scripts/install-criu.sh"
  if [ ! -x "$VENV/bin/python" ]; then
    log "virtualenv $VENV"
    "$PYTHON" -m venv "$VENV"
  fi
  log "Python packages"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q -e ".[$1]"
}

case "${1:-}" in
  lab)
    shift
    setup dev
    log "JupyterLab (kernel: 'Python 3 (snapshots)')"
    "$VENV/bin/jupyter" snapshot doctor || true
    exec "$VENV/bin/jupyter" lab --allow-root "$@"
    ;;
  test)
    shift
    setup test,dev
    log "lint and types"
    "$VENV/bin/ruff" check .
    "$VENV/bin/ruff" format --check .
    "$VENV/bin/mypy"
    log "tests"
    "$VENV/bin/python" -m pytest "$@"
    log "UI tests"
    exec scripts/ui-tests.sh
    ;;
  *)
    echo "usage: $0 lab|test [args...]" >&2
    exit 2
    ;;
esac
