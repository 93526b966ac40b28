#!/usr/bin/env bash
# One entry point for a fresh Debian/Ubuntu machine (run as root: CRIU needs it).
#
#   scripts/dev.sh lab    set everything up, then start JupyterLab with snapshots working
#                         (local snapshot store under the Jupyter data directory)
#   scripts/dev.sh test   set everything up, then run the whole test suite (what CI runs):
#                         ruff, mypy, pytest, the UI tests (scripts/ui-tests.sh), the
#                         non-root stage (scripts/nonroot-tests.sh) and the container stage
#                         (scripts/container-tests.sh); PYTEST ARGS go to the first pytest stage
#   scripts/dev.sh setup  set everything up only; then members of the group
#                         jupyter-snapshots can run .venv/bin/jupyter as themselves
#                         (non-root mode, docs/nonroot.md)
#
# Set-up is idempotent: system packages (apt, Node.js if missing), CRIU >= 4.2 in a
# private prefix (scripts/install-criu.sh), a virtualenv in .venv with the package
# installed editable (which builds the JupyterLab extension).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
. scripts/common.sh

case "${1:-}" in
  lab)
    shift
    setup_machine dev
    log "JupyterLab (kernel: 'Python 3 (snapshots)')"
    "$VENV/bin/jupyter" snapshot doctor || true
    # The server's small objects from malloc, which gives back what its jobs freed
    # (jupyter_ext/memory.py: kernels do not inherit it).
    PYTHONMALLOC=malloc exec "$VENV/bin/jupyter" lab --allow-root "$@"
    ;;
  setup)
    setup_machine dev
    "$VENV/bin/jupyter" snapshot doctor || true
    log "non-root use: sudo usermod -aG jupyter-snapshots USER, then as USER: $VENV/bin/jupyter lab"
    ;;
  test)
    shift
    # Where the time went, said last (also when a stage fails): each stage's end, in seconds
    # since the start (CI shows the end of this output). stage_done NAME [END].
    stage_ends=()
    stage_done() { stage_ends+=("$1 ${2:-$SECONDS} s,"); }
    trap 'log "stage ends, since the start: ${stage_ends[*]} now $SECONDS s"' EXIT
    # postgresql: a real database server for tests/test_network.py (psycopg is its client).
    setup_machine test,dev postgresql
    stage_done set-up
    log "lint and types"
    "$VENV/bin/ruff" check .
    "$VENV/bin/ruff" format --check .
    "$VENV/bin/mypy"
    # Beside the tests: what the UI and container stages need before they run (Node
    # packages, lint, jest, the extension's build; podman, the base images, the image).
    # Neither starts a kernel or a server, nor makes a mount the kernels would see.
    prepared="$ROOT/.prepare-stages.log"
    log "preparing the UI and container stages beside the tests ($prepared)"
    (scripts/ui-tests.sh --prepare && scripts/container-tests.sh --prepare \
      && echo "prepared at $SECONDS") >"$prepared" 2>&1 &
    preparing=$!
    # pytest twice, the whole suite between them: the quick tests first, where a test that
    # starts a process without the "system" marker fails (tests/conftest.py), then the rest.
    # Exit status 5 (nothing selected: PYTEST ARGS named tests of one kind only) is fine.
    # The quick tests on one worker: on two, beside the UI and container stages' set-up, they
    # took longer (76 s against 67 s).
    pytest_part() { "$VENV/bin/python" -m pytest "$@" || [ $? = 5 ]; }
    log "quick tests (set-up took ${SECONDS} s)"
    pytest_part -m "not system" "$@"
    stage_done quick
    log "system tests (${SECONDS} s since the start)"
    # On two workers (pytest-xdist), a test file whole on one, the costliest files first
    # (tests/conftest.py, tests/system-seconds.json; xdist would send the files with the
    # most tests first): much of a system test's time is spent waiting on processes. A short base directory: the kernels' unix sockets
    # live below it (108 bytes at most). The 25 slowest in the log: where CI's time goes
    # (issue 47 item 6).
    pytest_part -m system -n 2 --dist loadfile --no-loadscope-reorder --basetemp "$(mktemp -d /tmp/jks-XXXX)" \
      --durations=25 "$@"
    stage_done system
    log "UI and container stages prepared? (${SECONDS} s since the start)"
    wait "$preparing" || { cat "$prepared"; log "preparing the UI or container stage failed"; exit 1; }
    cat "$prepared"
    stage_done prepared "$(sed -n 's/^prepared at //p' "$prepared")"
    export UI_TESTS_PREPARED=1 JKS_CONTAINER_PREPARED=1
    # Non-root mode (kernel, server, policy, JupyterHub and other-node tests again, as an
    # ordinary user: docs/nonroot.md) beside the UI tests: both mostly wait on processes,
    # and neither uses the other's ports, users, bridges or directories. Its log after.
    nonroot_log="$ROOT/.nonroot-stage.log"
    log "non-root stage beside the UI tests (${SECONDS} s since the start; $nonroot_log)"
    (status=0; scripts/nonroot-tests.sh || status=$?; echo "non-root ended at $SECONDS"; exit "$status") \
      >"$nonroot_log" 2>&1 &
    nonroot=$!
    log "UI tests (${SECONDS} s since the start)"
    ui_status=0
    scripts/ui-tests.sh || ui_status=$?
    stage_done UI
    log "UI tests done; the non-root stage's end (${SECONDS} s since the start)"
    nonroot_status=0
    wait "$nonroot" || nonroot_status=$?
    stage_done non-root "$(sed -n 's/^non-root ended at //p' "$nonroot_log")"
    cat "$nonroot_log"
    log "non-root stage done (${SECONDS} s since the start)"
    [ "$ui_status" = 0 ] || { log "the UI tests failed (exit $ui_status)"; exit 1; }
    [ "$nonroot_status" = 0 ] || { log "the non-root stage failed (exit $nonroot_status)"; exit 1; }
    # deploy/Dockerfile built and its Zero to JupyterHub user pod run in podman
    # (docs/jupyterhub.md, "What is tested").
    log "container stage (${SECONDS} s since the start)"
    scripts/container-tests.sh
    stage_done container
    ;;
  *)
    echo "usage: $0 lab|test|setup [args...]" >&2
    exit 2
    ;;
esac
