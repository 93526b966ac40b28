#!/usr/bin/env bash
# The container stage of CI: deploy/Dockerfile built and its Zero to JupyterHub user pod run
# in a real container runtime (rootful podman from Debian), then tests/test_container.py:
# doctor in the pod, a kernel's state across pods through S3, the culled pod's snapshot,
# the misconfigured pods' errors, and the agent-mode tests (named "baseline": user pods at
# Pod Security baseline and the node agent of deploy/agent/agent.yaml, docs/agent.md; one
# of them runs ui-tests/tests/agent.spec.ts in Chromium against the pod's JupyterLab).
# Run as root after the set-up (scripts/dev.sh test or setup); arguments go to pytest:
#
#   sudo scripts/container-tests.sh [PYTEST ARGS...]
#   sudo scripts/container-tests.sh -k baseline      # only the agent-mode tests
#   sudo scripts/container-tests.sh --prepare        # the packages, base images and image only
#
# scripts/dev.sh runs --prepare beside the pytest stage, in a mount namespace of its own: no
# mount of the build (mmdebstrap's /proc, podman's overlays) is seen, and copied, by the
# kernels the tests start meanwhile; the build uses the host's network (no bridge, no
# firewall rules made beside the tests'). JKS_CONTAINER_PREPARED=1 then skips it here.
#
# No registry is needed: the base images the Dockerfile's FROM lines name are made here with
# mmdebstrap (Debian's own Python with the official images' interface: python and pip on
# PATH, pip installs allowed; the host's CA bundle and PIP_CERT, so builds reach PyPI, npm
# and Debian as the host does) and tagged with those names. podman's state (base images,
# build layers) lives in .container-tests/ under the work tree (gitignored): a second run
# reuses the base images and the unchanged layers. JKS_CONTAINER_REBUILD=1 makes the base
# images again.
#
# The image takes the wheel built here (the Dockerfile's WHEEL=prebuilt, by the same build
# backend, the panel as the UI stage built it): its Node.js stage (trixie, its base image,
# 1,000 npm packages and a production build of the panel: 124 s of wall time and 152 s of
# CPU here, beside the system tests) is the same `pip wheel` users' builds run.
# JKS_CONTAINER_WHEEL=built builds the image as `docker build` does by default. Cost
# (2-core VM shared with other work, 2026-12-01, the wheel built in the image): from scratch
# 8 min 49 s (base images 60 + 87 s, image build 266 s, tests 79 s); with the base images
# cached about 4 min (build 139 s, tests 50 s).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
. scripts/common.sh

[ "$(id -u)" = 0 ] || { echo "container-tests: run as root (rootful podman)" >&2; exit 1; }
if [ "${1:-}" = --prepare ] && [ "${JKS_PRIVATE_MOUNTS:-0}" != 1 ]; then
  JKS_PRIVATE_MOUNTS=1 exec unshare --mount --propagation private "$0" "$@"
fi
STATE="$ROOT/.container-tests"
IMAGE="localhost/jks-singleuser:ci"
PYTHON_VERSION=$(sed -n 's/^ARG PYTHON_VERSION=//p' deploy/Dockerfile)
WHEEL="${JKS_CONTAINER_WHEEL:-prebuilt}"
WHEEL_DIR=deploy/prebuilt-wheels
BASES=("python:${PYTHON_VERSION}-slim-bookworm bookworm")
[ "$WHEEL" = prebuilt ] || BASES+=("python:${PYTHON_VERSION}-slim-trixie trixie")

mkdir -p "$STATE/storage"
# cgroupfs and file logs: no systemd on CI machines. The ulimits are those root may set
# here (root lacks CAP_SYS_RESOURCE in some VMs: podman's defaults fail at start).
cat >"$STATE/containers.conf" <<EOF
[containers]
log_driver = "k8s-file"
default_ulimits = ["nofile=$(ulimit -Hn):$(ulimit -Hn)", "nproc=4096:4096"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
cat >"$STATE/storage.conf" <<EOF
[storage]
driver = "overlay"
graphroot = "$STATE/storage"
runroot = "/run/jks-container-tests"
EOF
export CONTAINERS_CONF="$STATE/containers.conf" CONTAINERS_STORAGE_CONF="$STATE/storage.conf"

# make_base TAG SUITE: a stand-in for the official python:TAG image (no registry here).
make_base() {
  local tag="$1" suite="$2" hook="$STATE/base-hook.sh"
  cat >"$hook" <<'EOF'
#!/bin/sh
# mmdebstrap customize hook: $1 is the new root file system.
set -e
mkdir -p "$1/usr/local/share/ca-certificates" "$1/usr/local/bin"
# What the host trusts (a CI network may intercept TLS with its own CA): kept by every
# update-ca-certificates the image runs later.
cp /etc/ssl/certs/ca-certificates.crt "$1/usr/local/share/ca-certificates/host-trust.crt"
chroot "$1" update-ca-certificates >/dev/null 2>&1
rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED
ln -sf /usr/bin/python3 "$1/usr/local/bin/python"
printf '#!/bin/sh\nexec python3 -m pip "$@"\n' >"$1/usr/local/bin/pip"
chmod 755 "$1/usr/local/bin/pip"
EOF
  chmod 755 "$hook"
  log "base image $tag (mmdebstrap $suite)"
  local start=$SECONDS
  mmdebstrap --quiet --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
    --customize-hook="$hook \"\$1\"" "$suite" - http://deb.debian.org/debian \
    | podman import --quiet --change 'ENV LANG=C.UTF-8' \
      --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
      --change 'CMD ["python3"]' - "docker.io/library/$tag" >/dev/null
  log "base image $tag: $((SECONDS - start)) s"
}

# prepare: the packages, the base images and the image (see --prepare above).
prepare() {
  log "podman, runc, mmdebstrap, chromium"
  # runc, not crun: crun 1.8 refuses this kind of VM's hybrid cgroup hierarchy.
  apt_install podman runc catatonit mmdebstrap containernetworking-plugins iptables libcap2-bin \
    chromium
  # The browser test of agent mode (ui-tests/tests/agent.spec.ts): its packages, as
  # scripts/ui-tests.sh installs them, where that stage has not run.
  if [ ! -d ui-tests/node_modules/@playwright/test ]; then
    log "npm ci (ui-tests)"
    (cd ui-tests && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --no-audit --no-fund --loglevel=error)
  fi

  for base in "${BASES[@]}"; do
    read -r tag suite <<<"$base"
    if [ "${JKS_CONTAINER_REBUILD:-0}" = 1 ] || ! podman image exists "docker.io/library/$tag"; then
      make_base "$tag" "$suite"
    fi
  done

  if [ "$WHEEL" = prebuilt ]; then
    log "the wheel (pip wheel, for the image)"
    rm -rf "$WHEEL_DIR"
    "$VENV/bin/pip" wheel --quiet --no-deps --wheel-dir "$WHEEL_DIR" .
  fi
  log "podman build -f deploy/Dockerfile (WHEEL=$WHEEL)"
  start=$SECONDS
  podman build --pull=never --network=host --build-arg "WHEEL=$WHEEL" -f deploy/Dockerfile \
    -t "$IMAGE" . >"$STATE/build.log" 2>&1 \
    || { tail -40 "$STATE/build.log" >&2; echo "container-tests: the image build failed" >&2; exit 1; }
  rm -rf "$WHEEL_DIR"
  log "image built in $((SECONDS - start)) s ($STATE/build.log)"
  # Layers of earlier builds that no tag names any more.
  podman image prune --force >/dev/null
}
if [ "${1:-}" = --prepare ]; then
  prepare
  exit 0
fi
[ "${JKS_CONTAINER_PREPARED:-0}" = 1 ] || prepare

# Pods and agents of the tests (tests/support/pods.py names them jks-ct-*): those an interrupted run
# left, and at the end all of them, so that no container keeps its overlay mounted (kernels
# started later copy the host's mounts into their own mount namespaces).
remove_test_pods() {
  for pod in $(podman pod ls --quiet --filter name=jks-ct-); do podman pod rm --force "$pod" >/dev/null; done
  for agent in $(podman ps --all --quiet --filter name=jks-ct-agent-); do podman rm --force "$agent" >/dev/null; done
}
remove_test_pods
on_exit() {
  local rc=$?
  remove_test_pods || echo "container-tests: could not remove the test pods" >&2
  exit "$rc"
}
trap on_exit EXIT

# KubeSpawner renders the pod (tests/support/pods.py) with a client configuration that points
# nowhere: it never calls an API to render a manifest.
cat >"$STATE/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: none, cluster: {server: "https://127.0.0.1:9"}}]
users: [{name: none, user: {}}]
contexts: [{name: none, context: {cluster: none, user: none}}]
current-context: none
EOF

log "tests/test_container.py"
KUBECONFIG="$STATE/kubeconfig" JKS_CONTAINER_IMAGE="$IMAGE" "$VENV/bin/python" -m pytest -p no:cacheprovider \
  tests/test_container.py "$@"
