#!/usr/bin/env bash
# UI tests of the JupyterLab extension (Galata/Playwright in a real browser, real kernels).
#
# On a fresh Debian/Ubuntu machine, as root (CRIU needs it), this installs what the tests
# need, idempotently:
#   - what scripts/dev.sh sets up (scripts/common.sh: apt packages, Node.js, CRIU, .venv);
#   - apt: chromium (Playwright never downloads a browser here);
#   - `npm ci` in labextension/ and ui-tests/ (from the committed package-lock.json files);
#   - in labextension/: `npm run lint:check` (prettier, eslint) and `npm test` (jest: unit
#     tests of the model against a stubbed server connection);
#   - the extension build (labextension -> jupyter_ext/labextension), linked into the venv
#     like `jupyter labextension develop` does;
# then runs the Playwright tests. It exits non-zero if a test fails, and its last line
# says "N passed, N failed".
#
#   scripts/ui-tests.sh [playwright test args...]     e.g. scripts/ui-tests.sh -g restore
#   scripts/ui-tests.sh --prepare                     everything but the browser tests
#
# The tests run against a real `jupyter lab` (ui-tests/jupyter_server_test_config.py) and,
# for tests/jupyterhub.spec.ts, a real JupyterHub (tests/support/hub_for_ui.py: a user logs in,
# snapshots a kernel, the hub stops and restarts the server, the panel restores it).
#
# Environment: UI_TESTS_PORT (JupyterLab; default: 8888, or a free port if that one is
# taken), UI_TESTS_HUB_PORT (JupyterHub; default: 8000, or a free port if taken),
# CHROMIUM_PATH (default /usr/bin/chromium), PYTHON (to create the venv, default python3),
# UI_TESTS_TRACE (Playwright's trace mode, default off: retain-on-failure keeps a failing
# test's trace in ui-tests/test-results/, to open with `npx playwright show-trace`).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
. scripts/common.sh
EXT_NAME=jupyter-kernel-snapshots
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1
export npm_config_fund=false npm_config_audit=false npm_config_update_notifier=false

die() { printf 'ui-tests: error: %s\n' "$*" >&2; echo "0 passed, 1 failed"; exit 1; }

# prepare: everything before the browser runs (Node packages, lint, jest, the build). Run
# apart with --prepare (scripts/dev.sh does, beside the pytest stage: no kernel, no mount,
# no port); UI_TESTS_PREPARED=1 then skips it here.
prepare() {
  # --- system packages, CRIU and the Python environment ---------------------------------
  setup_machine dev
  apt_install chromium
  apt_install_lean "${R_KERNEL_PACKAGES[@]}"  # ui-tests/tests/kernels.spec.ts

  # --- the extension ---------------------------------------------------------------------
  log "npm ci (labextension)"
  (cd labextension && npm ci --no-audit --no-fund --loglevel=error)
  log "lint (prettier, eslint) and unit tests of the model (jest)"
  (cd labextension && npm run lint:check && npm test) || die "lint or unit tests of the extension failed"
  log "build the extension"
  (cd labextension && npm run build)
  [ -f jupyter_ext/labextension/static/style.js ] || die "the extension build produced nothing"

  # Like `jupyter labextension develop --overwrite`: JupyterLab loads the build output itself.
  labext_dir="$VENV/share/jupyter/labextensions"
  mkdir -p "$labext_dir"
  if [ "$(readlink -f "$labext_dir/$EXT_NAME" 2>/dev/null)" != "$ROOT/jupyter_ext/labextension" ]; then
    rm -rf "${labext_dir:?}/$EXT_NAME"
    ln -s "$ROOT/jupyter_ext/labextension" "$labext_dir/$EXT_NAME"
  fi
  "$VENV/bin/jupyter" labextension list 2>&1 | grep -E "$EXT_NAME .*enabled.*OK" >/dev/null \
    || { "$VENV/bin/jupyter" labextension list >&2 || true; die "the extension is not enabled and OK"; }

  # --- the tests -------------------------------------------------------------------------
  log "npm ci (ui-tests)"
  (cd ui-tests && npm ci --no-audit --no-fund --loglevel=error)
}
if [ "${1:-}" = --prepare ]; then
  prepare
  exit 0
fi
[ "${UI_TESTS_PREPARED:-0}" = 1 ] || prepare
CHROMIUM_PATH="${CHROMIUM_PATH:-/usr/bin/chromium}"
[ -x "$CHROMIUM_PATH" ] || die "no Chromium at $CHROMIUM_PATH"
export CHROMIUM_PATH

# A port for each server: the given one (or the default), else a free one if it is taken.
pick_port() { # VARIABLE DEFAULT
  local port="${!1:-$2}"
  if "$VENV/bin/python" - "$port" <<'EOF'
import socket, sys
s = socket.socket()
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(0)  # taken
sys.exit(1)
EOF
  then
    local taken="$port"
    port=$("$VENV/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    log "port $taken ($1) is taken: using $port"
  fi
  echo "$port"
}
UI_TESTS_PORT=$(pick_port UI_TESTS_PORT 8888)
UI_TESTS_HUB_PORT=$(pick_port UI_TESTS_HUB_PORT 8000)
export UI_TESTS_PORT UI_TESTS_HUB_PORT
# The test server's notebooks, store and work directory (jupyter_server_test_config.py).
UI_TESTS_TMP=$(mktemp -d -t kernel-snapshots-ui-XXXXXX)
trap 'rm -rf "$UI_TESTS_TMP"' EXIT
export UI_TESTS_TMP
# "R (snapshots)" (IRkernel's ir wrapped) for ui-tests/tests/kernels.spec.ts, in a Jupyter
# path of this run's own: the servers the tests start find it, the venv stays as it was.
export JUPYTER_PATH="$UI_TESTS_TMP/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}"
"$VENV/bin/jupyter" snapshot install-kernelspec --wrap ir --prefix "$UI_TESTS_TMP" >/dev/null

log "Playwright tests (Chromium $("$CHROMIUM_PATH" --version 2>/dev/null | head -n1 | awk '{print $2}'))"
report="$ROOT/ui-tests/test-results.json"
rm -f "$report"
set +e
(
  cd ui-tests
  PATH="$VENV/bin:$PATH" PLAYWRIGHT_JSON_OUTPUT_NAME="$report" \
    npx playwright test --reporter=list,json "$@"
)
status=$?
set -e

# The closing line: "N passed, N failed" (a failure outside the tests counts as one).
node -e '
  const fs = require("fs");
  const status = Number(process.argv[2]);
  let passed = 0;
  let failed = 0;
  try {
    const s = JSON.parse(fs.readFileSync(process.argv[1], "utf8")).stats;
    passed = s.expected + s.flaky;
    failed = s.unexpected;
  } catch (e) {
    /* no report: Playwright did not run */
  }
  if (status !== 0 && failed === 0) {
    failed = 1;
  }
  console.log(`${passed} passed, ${failed} failed`);
' "$report" "$status"
exit "$status"
