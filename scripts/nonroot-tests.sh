#!/usr/bin/env bash
# Run the tests of non-root mode (docs/nonroot.md) as an ordinary user, after the set-up
# (scripts/dev.sh test or setup). Run as root: it creates the user, checks that the user
# can reach the clone, the virtualenv and the product's CRIU copy, then runs as that user
# the kernel, server, restore-in-place, policy (idle suspend, snapshot before shutdown),
# memory tracking and JupyterHub tests and an R kernel's restore, and, as root (network
# namespaces need it), the other-node test with the nodes' servers running as that user.
#
#   sudo scripts/nonroot-tests.sh [PYTEST ARGS...]   user: JKS_TEST_USER (jks-tester)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
. scripts/common.sh

TEST_USER="${JKS_TEST_USER:-jks-tester}"
GROUP=jupyter-snapshots
FILES=(tests/test_nonroot.py tests/test_private.py tests/test_confinement.py
  tests/test_kernel_snapshots.py tests/test_server_extension.py tests/test_restore_in_place.py
  tests/test_policies.py tests/test_jupyterhub.py tests/test_parallel.py tests/test_tracking.py
  tests/test_kernels.py::test_an_r_kernel_restored_into_a_new_wrapper)

die() { echo "nonroot-tests: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "run as root (it creates the test user): sudo $0"
getent group "$GROUP" >/dev/null || die "no group $GROUP: run scripts/install-criu.sh first"
if ! id "$TEST_USER" >/dev/null 2>&1; then
  log "user $TEST_USER"
  useradd --create-home --shell /bin/bash "$TEST_USER"
fi
usermod -aG "$GROUP" "$TEST_USER"
home="$(getent passwd "$TEST_USER" | cut -d: -f6)"
as_user() {
  runuser -u "$TEST_USER" -- env -i PATH=/usr/local/bin:/usr/bin:/bin HOME="$home" \
    USER="$TEST_USER" LOGNAME="$TEST_USER" LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1 "$@"
}

# A fresh clone must be readable by the user: a clone directory made with mode 0700
# (mktemp -d) is opened up; a private directory above it (/root) is not ours to change.
chmod go+rx "$ROOT"
as_user test -r "$ROOT/pyproject.toml" \
  || die "$TEST_USER cannot read $ROOT: a directory above it is private (e.g. /root); clone the repository where other users can read it (/tmp, /srv)"
runs_for_others "$VENV/bin/python" \
  || die "other users cannot run $VENV/bin/python (made from a Python in a private directory): remove $VENV and run the set-up again"

log "jupyter snapshot doctor as $TEST_USER"
as_user "$VENV/bin/python" -m jupyter_ext.cli doctor \
  || die "non-root mode does not work for $TEST_USER (see above)"

log "tests as $TEST_USER: ${FILES[*]}"
cd "$ROOT"
# Not again as the user (they run as root in the pytest stage; nothing in them depends on
# who runs the servers, and they are the stage's slowest): the hub's idle culler stopping a
# server, and the unsafe shared-Secret mode.
SKIP=(--deselect tests/test_jupyterhub.py::test_idle_culler_stops_a_server_whose_kernel_comes_back
  --deselect tests/test_jupyterhub.py::test_shared_secret_mode_lets_alice_reach_bobs_snapshots)
# Two workers, a file whole on one, a short base directory (scripts/dev.sh says why).
as_user "$VENV/bin/python" -m pytest -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder \
  --basetemp "$home/t" "${FILES[@]}" "${SKIP[@]}" "$@"

log "the other-node test: nodes' servers as $TEST_USER"
JKS_NODE_USER="$TEST_USER" PYTHONDONTWRITEBYTECODE=1 \
  "$VENV/bin/python" -m pytest -p no:cacheprovider tests/test_nodes.py "$@"
