"""The TIME_WAIT entries of a kernel's own ended connections, cleared before a restore.

A killed kernel's TCP connections end, and the side that closed first keeps a TIME_WAIT
entry for 60 s: no socket, no process, but its local port stays bound. When that side is a
listening socket's accepted connection, the listening port is held, and binding it again
fails with "Address already in use" unless both the new socket and the ended one had
``SO_REUSEADDR`` (the entry keeps its socket's setting). CRIU sets ``SO_REUSEADDR`` while it
restores a listening socket and puts the kernel's value back after, which is not enough
for a child's server that did not set it (measured: docs/network.md). A restore right
after a kill would fail in about one run of two (whichever side closed first).

So before ``criu restore`` the entries that are the kernel's own (their two ends those of a
connection the snapshot recorded, or of the kernel the restore replaces) are destroyed
(``SOCK_DESTROY``, by the entry's cookie: needs CAP_NET_ADMIN, so root), or, without root,
waited for until they expire. Entries of other connections on the kernel's ports are not
the kernel's to remove: where they hold the port (a bind with ``SO_REUSEADDR``, as CRIU's,
fails) the restore is refused, saying so and when they end, which is another error than
that of a port a live process holds (core/carried/netports.py names it); where they do not (their
socket had ``SO_REUSEADDR`` too), the restore goes on.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
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


@dataclass
class Blocking:
    """The TIME_WAIT entries on a snapshot's listening ports, the kernel's own or not."""

    own: list[sockdiag.TimeWaitEntry]
    foreign: list[sockdiag.TimeWaitEntry]
    also_own: list[sockdiag.TimeWaitEntry]
    """The kernel's own entries on other ports (a kept connection's, which CRIU rebuilds
    with the same ends): destroyed too where that can be done."""

    def foreign_text(self) -> str:
        seconds = max(e.expires_ms for e in self.foreign) / 1000
        return (
            ", ".join(_describe(e) for e in self.foreign[:5])
            + f" (TIME_WAIT entries of ended connections that are not the kernel's, the "
            f"last gone in {seconds:.0f} s)"
        )


@dataclass(frozen=True)
class Own:
    """What makes a TIME_WAIT entry the kernel's: its ends are those of a connection of the
    kernel (``pairs``), or its local port one the kernel listens on (``ports``: those of
    the running kernel a restore replaces, whose accepted connections end with it)."""

    pairs: Pairs
    ports: tuple[BoundPort, ...] = ()

    def __or__(self, other: Own) -> Own:
        return Own(self.pairs | other.pairs, self.ports + other.ports)

    def holds(self, entry: sockdiag.TimeWaitEntry) -> bool:
        local = BoundPort("tcp", entry.local[0], entry.local[1])
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
    """The TIME_WAIT entries here that hold one of the listening TCP ``ports`` (split by
    whether they are the kernel's; another's only where it really holds the port: see
    :func:`binds_with_reuse`), and the kernel's other entries."""
    listening = [p for p in ports if p.proto == "tcp"]
    found = Blocking([], [], [])
    held: dict[BoundPort, bool] = {}
    for entry in sockdiag.tcp_time_waits():
        local = BoundPort("tcp", entry.local[0], entry.local[1])
        mine = own.holds(entry)
        port = next((p for p in listening if p.collides_with(local)), None)
        if port is None:
            if mine:
                found.also_own.append(entry)
        elif mine:
            found.own.append(entry)
        else:
            if port not in held:
                held[port] = not binds_with_reuse(port)
            if held[port]:
                found.foreign.append(entry)
    return found


#: How often a restore without root looks whether the entries it waits for expired.
POLL_SECONDS = 0.2


async def clear_own(ports: Iterable[BoundPort], own: Own) -> int:
    """Free the listening ``ports`` of the kernel's own TIME_WAIT entries before a restore:
    destroy them, or, without CAP_NET_ADMIN, wait until they expire (60 s at most).
    Returns how many entries held a port. Foreign entries are left alone (the check
    before the restore refused them)."""
    ports = list(ports)
    found = blocking(ports, own)
    try:
        for entry in found.own + found.also_own:
            sockdiag.destroy(entry)
    except PermissionError:
        pass  # without CAP_NET_ADMIN: wait for those that hold a port
    else:
        if found.own:
            log.info(
                "destroyed %d TIME_WAIT entries of the kernel's own connections", len(found.own)
            )
        return len(found.own)
    deadline = time.monotonic() + max([e.expires_ms for e in found.own], default=0) / 1000 + 2
    if found.own:
        log.info(
            "waiting %.0f s for TIME_WAIT entries of the kernel's own connections to expire: %s",
            deadline - time.monotonic(),
            ", ".join(_describe(e) for e in found.own[:5]),
        )
    while blocking(ports, own).own and time.monotonic() < deadline:
        await asyncio.sleep(POLL_SECONDS)
    return len(found.own)
