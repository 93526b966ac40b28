#!/usr/bin/env bash
# Install a working CRIU >= 4.2 for jupyter-kernel-snapshots.
#
# Where the distribution packages CRIU >= 4.2, that package is installed with apt.
# Otherwise (Debian 12, whose criu 3.17 cannot run on recent kernels) Debian sid's
# criu and the libraries it links are downloaded with a *private* apt configuration
# and unpacked into PREFIX; the binary is patched (patchelf) to use that prefix's
# glibc and libraries. The system's apt sources, lists and libraries stay untouched.
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
MIN_VERSION="4.2"
SID_PACKAGES=(criu libcompel1 libbsd0 libc6 libgnutls30t64 libnet9 libnftables1 libnl-3-200
  libprotobuf-c1 libuuid1 libmd0 libffi8 libgcc-s1 libgmp10 libhogweed6t64 libidn2-0
  libjansson4 libmnl0 libnettle8t64 libnftnl11 libp11-kit0 libtasn1-6 libunistring5 libxtables12)

log() { printf 'install-criu: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (apt-get and CRIU itself need it)"
command -v apt-get >/dev/null || die "this script supports Debian/Ubuntu (apt-get not found)"

# grant_user_caps: let JKS_CRIU_GROUP's members run PREFIX/bin/criu as non-root.
grant_user_caps() {
  local criu="$PREFIX/bin/criu" group="${JKS_CRIU_GROUP:-jupyter-snapshots}"
  [ "${JKS_CRIU_CAPS:-1}" = 0 ] && return 0
  # An older install linked the system's criu: capabilities go on a copy of our own.
  if [ -L "$criu" ]; then cp --remove-destination "$(readlink -f "$criu")" "$criu"; fi
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

version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }

criu_version() { "$1" --version 2>/dev/null | sed -n 's/^Version: *//p' | head -n1; }

if [ -x "$PREFIX/bin/criu" ] && v=$(criu_version "$PREFIX/bin/criu") && [ -n "$v" ] \
    && version_ge "$v" "$MIN_VERSION"; then
  log "CRIU $v already installed at $PREFIX/bin/criu"
  grant_user_caps
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
# patchelf and iproute2 are needed either way (iproute2 for network namespaces in tests).
need=()
for tool in patchelf; do command -v "$tool" >/dev/null || need+=("$tool"); done
if [ ${#need[@]} -gt 0 ] || ! apt-cache policy criu >/dev/null 2>&1; then
  apt-get update -qq
fi
[ ${#need[@]} -eq 0 ] || apt-get install -y -qq "${need[@]}" >/dev/null

candidate=$(apt-cache policy criu 2>/dev/null | sed -n 's/^ *Candidate: *//p' | sed 's/^[0-9]*://; s/[-+~].*//')
if [ -n "$candidate" ] && [ "$candidate" != "(none)" ] && version_ge "$candidate" "$MIN_VERSION"; then
  log "installing the distribution's criu $candidate"
  apt-get install -y -qq criu >/dev/null
  mkdir -p "$PREFIX/bin"
  # A copy, not a link: the capabilities below go on the product's copy only.
  cp "$(command -v criu)" "$PREFIX/bin/criu.new"
  mv -f "$PREFIX/bin/criu.new" "$PREFIX/bin/criu"
  grant_user_caps
  exit 0
fi

log "the distribution's criu (${candidate:-none}) is older than $MIN_VERSION: using Debian sid's in $PREFIX"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs"
echo "deb [trusted=yes] http://deb.debian.org/debian sid main" >"$work/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o "Dir::Etc::SourceParts=-"
  -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache"
  -o "Acquire::Check-Valid-Until=false" -o "APT::Architecture=amd64"
  -o "APT::Sandbox::User=root" -o "Debug::NoLocking=1")
apt-get "${apt_opts[@]}" update -qq
(cd "$work/debs" && apt-get "${apt_opts[@]}" download "${SID_PACKAGES[@]}" >/dev/null)

stage="$PREFIX.new"
rm -rf "$stage"
mkdir -p "$stage/root" "$stage/bin"
for deb in "$work"/debs/*.deb; do dpkg -x "$deb" "$stage/root"; done
libdir="$PREFIX/root/usr/lib/x86_64-linux-gnu"
cp "$stage/root/usr/sbin/criu" "$stage/bin/criu"
patchelf --set-interpreter "$libdir/ld-linux-x86-64.so.2" --force-rpath --set-rpath "$libdir" \
  "$stage/bin/criu"
rm -rf "$PREFIX"
mv "$stage" "$PREFIX"

v=$(criu_version "$PREFIX/bin/criu") || die "the installed criu does not start; run $PREFIX/bin/criu --version"
version_ge "$v" "$MIN_VERSION" || die "installed criu $v is older than $MIN_VERSION"
log "CRIU $v installed at $PREFIX/bin/criu"
grant_user_caps
"$PREFIX/bin/criu" check >/dev/null 2>&1 && log "criu check: looks good" \
  || log "warning: 'criu check' reports problems; run '$PREFIX/bin/criu check' to see them"
