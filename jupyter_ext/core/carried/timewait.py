"""The TIME_WAIT entries on a kernel's listening ports, cleared before a restore.

A killed kernel's TCP connections end, and the side that closed first keeps a TIME_WAIT
entry for 60 s: no socket, no process, but its local port stays bound. When that side is a
listening socket's accepted connection, the listening port is held, and binding it again
fails with "Address already in use" unless both the new socket and the ended one had
``SO_REUSEADDR`` (the entry keeps its socket's setting). CRIU sets ``SO_REUSEADDR`` while it
restores a listening socket and puts the kernel's value back after, which is not enough
for a child's server that did not set it (measured: docs/network.md). A restore right
after a kill would fail in about one run of two (whichever side closed first).

A TIME_WAIT entry has no owner: only a live socket is a real conflict, and the check
before the restore refuses a port a live process holds, naming it
(core/carried/netports.py). So every entry on a port the snapshot's kernel listened on
counts as the kernel's, whichever connection it ended (one the snapshot recorded, one the
kernel opened after the snapshot and lost in the kill, or another process's), and is
cleared before ``criu restore``: destroyed (``SOCK_DESTROY``, by the entry's cookie: needs
CAP_NET_ADMIN, so root), or, without root, ended from its other side (:func:`end_from_peer`)
and, where that cannot be done, waited for until it expires. As root the kernel's own
entries on other ports (a kept connection's ends, which CRIU rebuilds) are destroyed too.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass

from . import sockdiag
from .netports import BoundPort, endpoint_text

log = logging.getLogger(__name__)

#: Pairs of endpoints (``ADDR:PORT``) of connections, either way round.
Pairs = set[frozenset[str]]


def connection_pairs(connections: Iterable[dict[str, object]]) -> Pairs:
    """The endpoint pairs of recorded connections (``local``/``remote``, as the manifest
    keeps them)."""
    return {frozenset((str(c["local"]), str(c["remote"]))) for c in connections}


def _pair(entry: sockdiag.TimeWaitEntry) -> frozenset[str]:
    return frozenset((endpoint_text(*entry.local), endpoint_text(*entry.remote)))


def _describe(entry: sockdiag.TimeWaitEntry) -> str:
    return f"{endpoint_text(*entry.local)} <-> {endpoint_text(*entry.remote)}"


def _local(entry: sockdiag.TimeWaitEntry) -> BoundPort:
    return BoundPort("tcp", entry.local[0], entry.local[1])


@dataclass
class Blocking:
    """The TIME_WAIT entries a restore clears."""

    on_ports: list[sockdiag.TimeWaitEntry]
    """Those on the snapshot's listening ports, whichever connection they ended."""
    also_own: list[sockdiag.TimeWaitEntry]
    """The kernel's own entries on other ports (a kept connection's, which CRIU rebuilds
    with the same ends): destroyed too where that can be done."""


@dataclass(frozen=True)
class Own:
    """What makes an entry on another port the kernel's: its ends are those of a connection
    of the kernel (``pairs``), or its local port one the kernel listens on (``ports``: those
    of the running kernel a restore replaces, whose accepted connections end with it)."""

    pairs: Pairs
    ports: tuple[BoundPort, ...] = ()

    def __or__(self, other: Own) -> Own:
        return Own(self.pairs | other.pairs, self.ports + other.ports)

    def holds(self, entry: sockdiag.TimeWaitEntry) -> bool:
        local = _local(entry)
        return _pair(entry) in self.pairs or any(p.collides_with(local) for p in self.ports)


def binds_with_reuse(port: BoundPort) -> bool:
    """Whether ``port`` can be bound here now with ``SO_REUSEADDR``, as CRIU binds a
    listening socket it restores: TIME_WAIT entries whose socket had it too (the accepted
    connections of a listener that set it, as most servers do) do not hold the port then.
    An address this machine lacks is not this check's to judge (True)."""
    family = socket.AF_INET6 if ":" in port.address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((port.address, port.port))
        except OSError as exc:
            return exc.errno != errno.EADDRINUSE
    return True


def blocking(ports: Iterable[BoundPort], own: Own) -> Blocking:
    """The TIME_WAIT entries here on the listening TCP ``ports``, and the kernel's own
    entries on other ports."""
    listening = [p for p in ports if p.proto == "tcp"]
    found = Blocking([], [])
    for entry in sockdiag.tcp_time_waits():
        if any(p.collides_with(_local(entry)) for p in listening):
            found.on_ports.append(entry)
        elif own.holds(entry):
            found.also_own.append(entry)
    return found


#: Linux's socket options (linux/in.h) to leave the port to connect() and choose it there.
IP_BIND_ADDRESS_NO_PORT = 24
IP_LOCAL_PORT_RANGE = 51


def end_from_peer(entry: sockdiag.TimeWaitEntry) -> None:
    """End a TIME_WAIT entry without privileges, from its other end: a socket from the
    entry's remote address and port connects to its local one. The entry answers the SYN
    with an ACK of its own sequence, which the connecting socket refuses with a RST in the
    entry's window, and Linux drops an entry on such a RST (RFC 1337's "TIME-WAIT
    assassination"; not with ``net.ipv4.tcp_rfc1337`` set). The next SYN finds no listener
    and is refused. The port is chosen by connect() from a range of one port (Linux 6.3),
    not bound: a bind fails where another ended connection of that port (to another peer)
    is in TIME_WAIT, a connect does not. Nothing happens where that end cannot be had
    (another host's address, a port in use)."""
    address, port = entry.remote
    with socket.socket(entry.family, socket.SOCK_STREAM) as peer:
        peer.settimeout(3)
        with contextlib.suppress(OSError):
            try:
                only = struct.pack("=I", port | port << 16)
                peer.setsockopt(socket.IPPROTO_IP, IP_LOCAL_PORT_RANGE, only)
                peer.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
                peer.bind((address, 0))
            except OSError as exc:  # an older kernel: bound, which another entry may refuse
                if exc.errno != errno.ENOPROTOOPT:
                    raise
                peer.bind((address, port))
            peer.connect(entry.local)  # refused once the entry is gone (no one listens)


#: How often a restore without root looks whether the entries it waits for expired.
POLL_SECONDS = 0.2


async def clear(ports: Iterable[BoundPort], own: Own) -> int:
    """Free the listening ``ports`` of TIME_WAIT entries before a restore (a live socket on
    them was refused before): destroy them, or, without CAP_NET_ADMIN, end those that hold
    a port from their other end and wait for any left until they expire (60 s at most).
    Returns how many entries were on the ports."""
    ports = [p for p in ports if p.proto == "tcp"]
    found = blocking(ports, own)
    try:
        for entry in found.on_ports + found.also_own:
            sockdiag.destroy(entry)
    except PermissionError:
        pass  # without CAP_NET_ADMIN
    else:
        if found.on_ports:
            log.info("destroyed %d TIME_WAIT entries on the kernel's ports", len(found.on_ports))
        return len(found.on_ports)
    held = [p for p in ports if not binds_with_reuse(p)]

    def holding() -> list[sockdiag.TimeWaitEntry]:
        return [
            e for e in sockdiag.tcp_time_waits() if any(p.collides_with(_local(e)) for p in held)
        ]

    left = holding() if held else []
    for entry in left:
        await asyncio.to_thread(end_from_peer, entry)
    left = holding() if left else []
    deadline = time.monotonic() + max([e.expires_ms for e in left], default=0) / 1000 + 2
    if left:
        log.info(
            "waiting %.0f s for TIME_WAIT entries on the kernel's ports to expire: %s",
            deadline - time.monotonic(),
            ", ".join(_describe(e) for e in left[:5]),
        )
    while left and time.monotonic() < deadline:
        await asyncio.sleep(POLL_SECONDS)
        left = holding()
    return len(found.on_ports)
