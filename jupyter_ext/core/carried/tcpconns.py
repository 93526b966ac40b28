"""TCP connections inside a kernel's process tree: kept established across restores.

A connection whose two ends are both sockets of the dumped tree (the kernel and its
multiprocessing manager, a Dask scheduler and its workers) has no peer outside the
snapshot: CRIU can save its state (``--tcp-established``, TCP repair mode) and rebuild both
ends together, anywhere. A connection to a peer outside the tree cannot come back (the
peer's idea of it moved on, or it is on another machine): it is restored closed, as
before (docs/network.md).

CRIU has one switch for all connections, so a dump that keeps connections saves every one
of them, and :func:`close_outside_connections` then rewrites the images so that those with
an outside peer restore as a closed socket: exactly what ``criu restore --tcp-close`` makes
of them (a socket shut down both ways: reads see end-of-file, writes ``EPIPE``).

TCP repair needs CAP_NET_ADMIN: without root every connection is restored closed.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import proctree
from ..criu.images import (
    FD_TYPE_INETSK,
    FE_ISK,
    FE_TYPE,
    Field,
    decode,
    ints,
    read_entries,
    rewrite_files_img,
    sub_message,
    with_sub_message,
)
from . import netports, sockdiag
from .netports import endpoint_text as _endpoint
from .netports import proc_net_address

_TCP_ESTABLISHED = 0x01
_TCP_CLOSE = 7
_SHUTDOWN_BOTH = 3


@dataclass(frozen=True)
class Connection:
    """One end of an established TCP connection held by a process of the kernel's tree."""

    pid: int
    """As the kernel's processes see it (``os.getpid()`` inside the kernel's namespace)."""
    process: str
    local: str
    remote: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _established(pid: int) -> dict[int, tuple[str, str]]:
    """Established TCP sockets of ``pid``'s network namespace: inode -> (local, remote)."""
    found: dict[int, tuple[str, str]] = {}
    for fields in netports.proc_net_rows(pid, ("tcp", "tcp6")):
        if int(fields[3], 16) != _TCP_ESTABLISHED:
            continue
        inode = int(fields[9])
        if inode == 0:
            continue  # not accepted yet: --skip-in-flight leaves it out
        (local_addr, local_port), (remote_addr, remote_port) = (
            field.split(":") for field in fields[1:3]
        )
        found[inode] = (
            _endpoint(proc_net_address(local_addr), int(local_port, 16)),
            _endpoint(proc_net_address(remote_addr), int(remote_port, 16)),
        )
    return found


@dataclass(frozen=True)
class TreeConnections:
    """The tree's established TCP connections, split by where their peer is."""

    inside: list[Connection]
    """Both ends in the tree (each end listed)."""
    outside: list[Connection]
    """The peer is outside the tree."""


def tree_connections(pids: list[int], sockets: sockdiag.TreeSockets) -> TreeConnections:
    """Classify the established TCP connections of the processes ``pids`` (one tree, one
    network namespace: that of its first process; ``sockets``: the sockets they hold)."""
    if not pids or "tcp" not in sockets.inet:
        return TreeConnections([], [])
    table = _established(pids[0])
    owners: dict[int, int] = {}
    for inode, pid in sockdiag.socket_owners(pids):
        owners.setdefault(inode, pid)
    ours = {inode: table[inode] for inode in owners if inode in table}
    ends = set(ours.values())
    inside: list[Connection] = []
    outside: list[Connection] = []
    for inode, (local, remote) in sorted(ours.items()):
        pid = owners[inode]
        try:
            seen_as = proctree.ns_pid(pid)
        except OSError:
            seen_as = pid
        conn = Connection(seen_as, proctree.process_name(pid), local, remote)
        (inside if (remote, local) in ends else outside).append(conn)
    return TreeConnections(inside, outside)


# ------------------------------------------------------------------ CRIU image rewriting
_ISK_INO, _ISK_FAMILY, _ISK_PROTO, _ISK_STATE = 2, 3, 5, 6
_ISK_SRC_PORT, _ISK_DST_PORT, _ISK_SRC_ADDR, _ISK_DST_ADDR, _ISK_SHUTDOWN = 7, 8, 11, 12, 19


def _address_text(family: int, words: list[int], port: int) -> str:
    raw = b"".join(struct.pack("<I", word) for word in words)
    raw = raw[:4] if family == socket.AF_INET else raw[:16]
    return _endpoint(socket.inet_ntop(family, raw), port)


def _connection(entry: list[Field]) -> tuple[int, str, str] | None:
    """(inode, local, remote) of a TCP connection's FileEntry; None for anything else."""
    if ints(entry, FE_TYPE) != [FD_TYPE_INETSK]:
        return None
    isk = sub_message(entry, FE_ISK)
    if isk is None or ints(isk, _ISK_PROTO) != [socket.IPPROTO_TCP]:
        return None
    dst_port = ints(isk, _ISK_DST_PORT)
    if not dst_port or not dst_port[0]:
        return None
    family = ints(isk, _ISK_FAMILY)[0]
    local = _address_text(family, ints(isk, _ISK_SRC_ADDR), ints(isk, _ISK_SRC_PORT)[0])
    remote = _address_text(family, ints(isk, _ISK_DST_ADDR), dst_port[0])
    return ints(isk, _ISK_INO)[0], local, remote


def close_outside_connections(images_dir: Path) -> tuple[int, int]:
    """Rewrite a dump made with ``--tcp-established`` so that only connections with both
    ends in the images restore established; the others restore closed (as ``--tcp-close``
    makes them: an unbound socket shut down both ways) and their saved queues are deleted.
    Returns (connections kept, connections closed), counting sockets."""
    _, entries = read_entries(images_dir / "files.img")
    sockets: dict[int, tuple[str, str]] = {}
    for raw in entries:
        found = _connection(decode(raw))
        if found is not None:
            sockets[found[0]] = found[1], found[2]
    ends = set(sockets.values())
    outside = {ino for ino, (local, remote) in sockets.items() if (remote, local) not in ends}

    def change(entry: list[Field]) -> list[Field] | None:
        found = _connection(entry)
        if found is None or found[0] not in outside:
            return None
        return with_sub_message(entry, FE_ISK, _closed(sub_message(entry, FE_ISK) or []))

    if outside:
        rewrite_files_img(images_dir, change)
    for ino in outside:
        with contextlib.suppress(FileNotFoundError):
            (images_dir / f"tcp-stream-{ino:x}.img").unlink()
    return len(sockets) - len(outside), len(outside)


def _closed(isk: list[Field]) -> list[Field]:
    """An InetSkEntry of a connection, made into that of a closed, unbound socket that a
    restore shuts down both ways (no port is bound, no address needed on this machine)."""
    replaced = {_ISK_STATE: _TCP_CLOSE, _ISK_SRC_PORT: 0, _ISK_DST_PORT: 0}
    fields: list[Field] = [(n, w, replaced.get(n, v)) for n, w, v in isk if n != _ISK_SHUTDOWN]
    fields.append((_ISK_SHUTDOWN, 0, _SHUTDOWN_BOTH))
    return fields
