#!/usr/bin/env bash
# Install the CRIU that jupyter-kernel-snapshots runs: CRIU 4.2.1 built from its upstream
# source with the project's patches (scripts/criu-patches/), in a private prefix.
#
# Why a build of our own: Debian 12's criu (3.17) cannot run on recent kernels, and no
# packaged CRIU tracks memory on kernels built without soft-dirty bits (arm64, and the VM
# kernels of this project's machines). The patch 0001 lets CRIU take dirty bits from the
# write-protect bits of asynchronous userfaultfds (Linux >= 6.7), which is what makes a
# kernel's second snapshot cost what changed (docs/storage.md, "Snapshots cost what
# changed"). The patch 0002 lets CRIU keep what it probes of the kernel between runs where
# /run is no tmpfs (~30 ms each run here): used without root (see RUNDIR below). The
# patch 0003 makes a dump with nothing written cost the same at any size, and 0004 lets an
# ordinary user pre-copy a big kernel (one pipe, not one per run of pages), 0005 writes a
# buf of scattered pages to the image in one splice (not one per page, while frozen), and
# 0006 keeps a lazy restore going when the process unmaps memory it just threw away,
# 0007 reads only the parent's pagemap in a dump, 0008 saves no probes of the kernel
# that this CRIU's own limits refused, and 0009 keeps a dump's memory lazy when a thread's
# stack pointer is at the start of a page.
# The patches are small and written to go upstream (scripts/criu-patches/README.md).
#
# Steps (idempotent; nothing is done when PREFIX already holds this build):
#   - Debian's build dependencies with apt (bookworm's; the binary links them);
#   - the upstream tarball of CRIU 4.2.1 as Debian ships it (checked against its sha256);
#   - the patches applied, `make criu`, the binary installed as PREFIX/bin/criu with
#     PREFIX/BUILD_ID naming the version and patches.
# The system's apt sources, packages and libraries are otherwise left alone.
#
# Usage: scripts/install-criu.sh [PREFIX]   (default /opt/jupyter-kernel-snapshots/criu)
# Afterwards PREFIX/bin/criu is what `jupyter snapshot doctor` finds.
#
# Non-root use (docs/nonroot.md): PREFIX/bin/criu is the product's own copy (never the
# system's binary) and gets the file capabilities cap_checkpoint_restore,cap_setpcap+ep,
# with which an ordinary user dumps and restores their own kernels. Who may run it:
# JKS_CRIU_GROUP (default jupyter-snapshots; created if missing) owns it, mode 0750, so
# only members (and root) can; JKS_CRIU_GROUP=- leaves it 0755 for everyone (a container
# with one user). JKS_CRIU_CAPS=0 leaves it without capabilities (root only).
set -euo pipefail

PREFIX="${1:-${JUPYTER_SNAPSHOT_CRIU_PREFIX:-/opt/jupyter-kernel-snapshots/criu}}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PATCH_DIR="$HERE/criu-patches"
CRIU_VERSION=4.2.1
CRIU_TARBALL="criu_${CRIU_VERSION}.orig.tar.xz"
CRIU_TARBALL_SHA256=29ec0ee09e296479fe7048c80980e8ef1d0684d0b0204c2b101dfea19f6725b9
CRIU_TARBALL_URL="${JKS_CRIU_TARBALL_URL:-http://deb.debian.org/debian/pool/main/c/criu/$CRIU_TARBALL}"
# What `make criu` needs on Debian/Ubuntu (the runtime libraries come with the -dev ones).
BUILD_DEPS=(build-essential pkg-config curl xz-utils patch libprotobuf-dev libprotobuf-c-dev
  protobuf-c-compiler protobuf-compiler python3-protobuf libnl-3-dev libnl-route-3-dev
  libcap-dev libnet1-dev libbsd-dev libaio-dev libgnutls28-dev libnftables-dev uuid-dev)

log() { printf 'install-criu: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (apt-get and CRIU itself need it)"
command -v apt-get >/dev/null || die "this script supports Debian/Ubuntu (apt-get not found)"
[ -d "$PATCH_DIR" ] || die "no patches at $PATCH_DIR (run the script from the source tree)"

# Where this build's CRIU keeps its probes of the kernel (criu.kdat) as root, made with
# the prefix (patch 0002 keeps it off tmpfs with the boot's id; patch 0008 keeps a root
# CRIU that was refused userfaultfd from saving a cache that says lazy pages are missing).
# An ordinary user's CRIU keeps its own in $XDG_RUNTIME_DIR (engine.py).
RUNDIR="$PREFIX/run"
# BUILD_ID: the version, the build's options and the patches; a prefix holding another
# build is rebuilt.
build_id() {
  { echo "$CRIU_VERSION RUNDIR=$RUNDIR"; cat "$PATCH_DIR"/*.patch; } | sha256sum | cut -c1-12
}
BUILD_ID="jks-$(build_id)"

# grant_user_caps: let JKS_CRIU_GROUP's members run PREFIX/bin/criu as non-root.
grant_user_caps() {
  local criu="$PREFIX/bin/criu" group="${JKS_CRIU_GROUP:-jupyter-snapshots}"
  [ "${JKS_CRIU_CAPS:-1}" = 0 ] && return 0
  if ! command -v setcap >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libcap2-bin >/dev/null
  fi
  if [ "$group" = - ]; then
    chown root:root "$criu"
    chmod 0755 "$criu"
  else
    getent group "$group" >/dev/null || groupadd --system "$group"
    chown "root:$group" "$criu"
    chmod 0750 "$criu"
  fi
  # After chown/chmod: changing the owner clears file capabilities.
  setcap cap_checkpoint_restore,cap_setpcap+ep "$criu" \
    || die "setcap failed on $criu (a file system without extended attributes?)"
  log "file capabilities $(getcap "$criu" | cut -d' ' -f2-) on $criu (run by: ${group/#-/everyone})"
}

if [ -x "$PREFIX/bin/criu" ] && [ "$(cat "$PREFIX/BUILD_ID" 2>/dev/null)" = "$BUILD_ID" ] \
    && "$PREFIX/bin/criu" --version >/dev/null 2>&1; then
  log "CRIU $CRIU_VERSION ($BUILD_ID) already installed at $PREFIX/bin/criu"
  grant_user_caps
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
missing=()
for pkg in "${BUILD_DEPS[@]}"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
if [ ${#missing[@]} -gt 0 ]; then
  log "build dependencies: ${missing[*]}"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
log "downloading $CRIU_TARBALL_URL"
curl -sSfL --retry 3 -o "$work/$CRIU_TARBALL" "$CRIU_TARBALL_URL" \
  || die "could not download $CRIU_TARBALL_URL (set JKS_CRIU_TARBALL_URL to a copy)"
echo "$CRIU_TARBALL_SHA256  $work/$CRIU_TARBALL" | sha256sum -c --quiet - \
  || die "$CRIU_TARBALL does not have the expected sha256 $CRIU_TARBALL_SHA256"
tar -xJf "$work/$CRIU_TARBALL" -C "$work"
src="$work/criu-$CRIU_VERSION"
for p in "$PATCH_DIR"/*.patch; do
  log "applying $(basename "$p")"
  patch -d "$src" -p1 --quiet --forward <"$p" || die "$(basename "$p") does not apply"
done
log "building CRIU $CRIU_VERSION ($BUILD_ID)"
make -C "$src" -j"$(nproc)" criu GITID="$BUILD_ID" RUNDIR="$RUNDIR" >"$work/build.log" 2>&1 \
  || { tail -30 "$work/build.log" >&2; die "the build failed (log above)"; }

stage="$PREFIX.new"
rm -rf "$stage"
mkdir -p "$stage/bin" "$stage/run"
cp "$src/criu/criu" "$stage/bin/criu"
echo "$BUILD_ID" >"$stage/BUILD_ID"
"$stage/bin/criu" --version >/dev/null || die "the built criu does not start"
rm -rf "$PREFIX"
mv "$stage" "$PREFIX"
log "CRIU $CRIU_VERSION ($BUILD_ID) installed at $PREFIX/bin/criu"
grant_user_caps
"$PREFIX/bin/criu" check >/dev/null 2>&1 && log "criu check: looks good" \
  || log "warning: 'criu check' reports problems; run '$PREFIX/bin/criu check' to see them"
# What that check probed is this machine's and this sandbox's (an image build's container
# lacks capabilities the image's runs may have): the first real run probes for itself.
rm -f "$RUNDIR/criu.kdat"
