"""A network namespace of its own for a restored copy whose ports are taken here.

Kernels run in the server's network namespace. A copy of a snapshot restored beside a
running kernel of the same snapshot needs the ports its kept connections (a Dask cluster,
a multiprocessing manager on ``127.0.0.1``) and its listeners had, and the running kernel
holds them. Such a copy, and only such a copy, is restored into a fresh network namespace
(:class:`OwnNetwork`): its own loopback (up), where its connections come back on their
addresses and ports, and a way out through slirp4netns (user-mode networking: a tap device
in the namespace, no host firewall rules): the internet and the server's network as the
server reaches them, the server's own loopback at :data:`HOST_ADDRESS`. The server's own
addresses that the copy's sockets are bound to (Ray binds its raylet and workers to the
node's address, not to ``127.0.0.1``) are the copy's own there too, on its loopback
(:func:`own_addresses`): CRIU binds each socket back on its address.

CRIU runs inside that namespace (``setns`` before it starts, :meth:`OwnNetwork.enter`)
both to restore the copy and to dump it later: the copy's namespace is then CRIU's own,
which CRIU neither dumps (its contents, the tap device included) nor makes again. A
restore of the copy's snapshot decides anew where it goes, by the same rule. The helper
process ends with the namespace (:meth:`OwnNetwork.close`), with the wrapper (parent-death
signal, and its exit pipe closes), and with a failed restore.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import select
import shutil
import subprocess
from collections.abc import Iterable

from .. import proctree
from ..errors import RestoreError

CLONE_NEWNET = 0x40000000
#: What slirp4netns gives the server's own loopback in the namespace (10.0.2.2 by default).
HOST_ADDRESS = "10.0.2.2"
#: The network slirp4netns gives the namespace (its tap device is 10.0.2.100 there).
SLIRP_NETWORK = ipaddress.ip_network("10.0.2.0/24")
#: The name of the tap device slirp4netns makes in the namespace.
TAP_DEVICE = "tap0"
#: How long slirp4netns gets to configure the namespace.
READY_TIMEOUT = 10.0

_libc = ctypes.CDLL(None, use_errno=True)


def slirp_path() -> str | None:
    """slirp4netns on the PATH (Debian: ``apt-get install slirp4netns``), or None."""
    return shutil.which("slirp4netns")


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def own_addresses(addresses: Iterable[str]) -> list[str]:
    """Of the addresses a snapshot's sockets are bound to, those a fresh namespace lacks
    (neither a wildcard, nor loopback, nor slirp4netns' own network), each once, as
    ``ADDR/32`` or ``ADDR/128``; an IPv4-mapped address as IPv4."""
    wanted: dict[str, None] = {}
    for text in addresses:
        ip = ipaddress.ip_address(text)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if ip.is_unspecified or ip.is_loopback or ip.is_link_local or ip in SLIRP_NETWORK:
            continue
        wanted[f"{ip}/{ip.max_prefixlen}"] = None
    return list(wanted)


def _fresh_namespace(addresses: list[str]) -> int:
    """A new network namespace with its loopback up and ``addresses`` on it, as an open
    descriptor."""
    script = (
        "ip link set lo up || exit 1\n"
        # nodad: an IPv6 address is usable at once (no duplicate detection).
        'for address; do case "$address" in *:*) nodad=nodad;; *) nodad=;; esac\n'
        'ip addr add "$address" dev lo $nodad || exit 1; done\n'
        "echo up && exec sleep 60"
    )
    holder = subprocess.Popen(
        ["unshare", "--net", "--", "sh", "-c", script, "sh", *addresses],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=proctree.die_with_parent,
    )
    try:
        assert holder.stdout is not None
        if holder.stdout.readline() != b"up\n":
            holder.kill()
            _, err = holder.communicate()
            raise RestoreError(
                "A network namespace for the restored copy could not be made: "
                f"{err.decode(errors='replace').strip() or 'unshare failed'}.",
                hint="This needs root, unshare (util-linux) and ip (iproute2).",
            )
        return os.open(f"/proc/{holder.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        with contextlib.suppress(ProcessLookupError):
            holder.kill()
        holder.communicate()


class OwnNetwork:
    """A fresh network namespace held by ``fd``, reaching out through a slirp4netns
    ``helper``; ends with :meth:`close`."""

    def __init__(self, fd: int, helper: subprocess.Popen[bytes], exit_w: int) -> None:
        self.fd = fd
        self.helper = helper
        self._exit_w = exit_w

    @classmethod
    def create(cls, addresses: Iterable[str] = ()) -> OwnNetwork:
        """A new namespace with its loopback up, the server's ``addresses`` among those
        the copy's sockets are bound to on it (:func:`own_addresses`), and slirp4netns
        serving it (blocking)."""
        slirp = slirp_path()
        if slirp is None:
            raise RestoreError(
                "slirp4netns is not installed: the copy's own network namespace would "
                "reach nothing outside it.",
                hint="Install it (Debian: apt-get install slirp4netns).",
            )
        fd = _fresh_namespace(own_addresses(addresses))
        exit_r, exit_w = os.pipe()
        ready_r, ready_w = os.pipe()
        try:
            helper = subprocess.Popen(
                [
                    slirp,
                    "--configure",
                    "--mtu=65520",
                    f"--exit-fd={exit_r}",
                    f"--ready-fd={ready_w}",
                    "--netns-type=path",
                    f"/proc/self/fd/{fd}",
                    TAP_DEVICE,
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(fd, exit_r, ready_w),
                preexec_fn=proctree.die_with_parent,
                # Not in the kernel's process group, which jupyter_client signals (an
                # interrupt would end the copy's network): it ends with its exit pipe.
                process_group=0,
            )
        except BaseException:
            for each in (fd, exit_w):
                os.close(each)
            raise
        finally:
            os.close(exit_r)
            os.close(ready_w)
        network = cls(fd, helper, exit_w)
        try:
            ready, _, _ = select.select([ready_r], [], [], READY_TIMEOUT)
            if not ready or os.read(ready_r, 1) != b"1":
                raise RestoreError(
                    "slirp4netns did not set up the restored copy's network namespace "
                    f"(exit status {helper.poll()}).",
                    hint="Run 'jupyter snapshot doctor'; see the server log.",
                )
        except BaseException:
            network.close()
            raise
        finally:
            os.close(ready_r)
        return network

    def enter(self) -> None:
        """Move the calling process into the namespace (a child's ``preexec_fn``)."""
        _setns(self.fd)

    def close(self) -> None:
        """End the helper and let the namespace go (it lives on while processes are in
        it). Idempotent."""
        if self._exit_w < 0:
            return
        os.close(self._exit_w)
        self._exit_w = -1
        try:
            self.helper.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.helper.kill()
            self.helper.wait()
        os.close(self.fd)
