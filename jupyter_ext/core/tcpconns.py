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
import ipaddress
import os
import socket
import struct
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .netports import _address

_TCP_ESTABLISHED = 0x01
_TCP_CLOSE = 7
_SHUTDOWN_BOTH = 3
_FD_TYPE_INETSK = 4


@dataclass(frozen=True)
class Connection:
    """One end of an established TCP connection held by a process of the kernel's tree."""

    pid: int
    process: str
    local: str
    remote: str

    def describe(self) -> str:
        return f"{self.process} (pid {self.pid}) {self.local} -> {self.remote}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _endpoint(address: str, port: int) -> str:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def _established(pid: int) -> dict[int, tuple[str, str]]:
    """Established TCP sockets of ``pid``'s network namespace: inode -> (local, remote)."""
    found: dict[int, tuple[str, str]] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or int(fields[3], 16) != _TCP_ESTABLISHED:
                continue
            inode = int(fields[9])
            if inode == 0:
                continue  # not accepted yet: --skip-in-flight leaves it out
            (local_addr, local_port), (remote_addr, remote_port) = (
                field.split(":") for field in fields[1:3]
            )
            found[inode] = (
                _endpoint(_address(local_addr), int(local_port, 16)),
                _endpoint(_address(remote_addr), int(remote_port, 16)),
            )
    return found


def _socket_owners(pids: Iterable[int]) -> Iterator[tuple[int, int]]:
    """(socket inode, pid) for every socket fd of these processes."""
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    yield int(target[8:-1]), pid


def _process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


@dataclass(frozen=True)
class TreeConnections:
    """The tree's established TCP connections, split by where their peer is."""

    inside: list[Connection]
    """Both ends in the tree (each end listed)."""
    outside: list[Connection]
    """The peer is outside the tree."""


def tree_connections(pids: list[int]) -> TreeConnections:
    """Classify the established TCP connections of the processes ``pids`` (one tree, one
    network namespace: that of its first process)."""
    if not pids:
        return TreeConnections([], [])
    table = _established(pids[0])
    owners: dict[int, int] = {}
    for inode, pid in _socket_owners(pids):
        owners.setdefault(inode, pid)
    ours = {inode: table[inode] for inode in owners if inode in table}
    ends = set(ours.values())
    inside: list[Connection] = []
    outside: list[Connection] = []
    for inode, (local, remote) in sorted(ours.items()):
        pid = owners[inode]
        conn = Connection(pid, _process_name(pid), local, remote)
        (inside if (remote, local) in ends else outside).append(conn)
    return TreeConnections(inside, outside)


# ------------------------------------------------------------------ CRIU image rewriting
# CRIU images are a magic header and then length-prefixed protobuf messages. files.img holds
# one FileEntry per file (criu/images/fdinfo.proto); an inet socket's InetSkEntry
# (sk-inet.proto) is its field 4. Only the few fields read here are decoded.

_FE_TYPE, _FE_ISK = 1, 4
_ISK_INO, _ISK_FAMILY, _ISK_PROTO, _ISK_STATE = 2, 3, 5, 6
_ISK_SRC_PORT, _ISK_DST_PORT, _ISK_SRC_ADDR, _ISK_DST_ADDR, _ISK_SHUTDOWN = 7, 8, 11, 12, 19
_HEADER = 8  # two u32 magics

Field = tuple[int, int, "int | bytes"]


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _put_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _decode(data: bytes) -> list[Field]:
    fields: list[Field] = []
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos : pos + length], pos + length
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, pos = data[pos : pos + size], pos + size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        fields.append((number, wire, value))
    return fields


def _encode(fields: list[Field]) -> bytes:
    out = bytearray()
    for number, wire, value in fields:
        out += _put_varint(number << 3 | wire)
        if wire == 0:
            assert isinstance(value, int)
            out += _put_varint(value)
        elif wire == 2:
            assert isinstance(value, bytes)
            out += _put_varint(len(value)) + value
        else:
            assert isinstance(value, bytes)
            out += value
    return bytes(out)


def _ints(fields: list[Field], number: int) -> list[int]:
    values: list[int] = []
    for n, wire, value in fields:
        if n != number:
            continue
        if wire == 2 and isinstance(value, bytes):  # packed
            pos = 0
            while pos < len(value):
                item, pos = _varint(value, pos)
                values.append(item)
        elif isinstance(value, int):
            values.append(value)
    return values


def _address_text(family: int, words: list[int], port: int) -> str:
    raw = b"".join(struct.pack("<I", word) for word in words)
    raw = raw[:4] if family == socket.AF_INET else raw[:16]
    return _endpoint(socket.inet_ntop(family, raw), port)


def _entries(path: Path) -> tuple[bytes, list[bytes]]:
    data = path.read_bytes()
    header, pos, entries = data[:_HEADER], _HEADER, []
    while pos < len(data):
        (size,) = struct.unpack_from("<I", data, pos)
        entries.append(data[pos + 4 : pos + 4 + size])
        pos += 4 + size
    return header, entries


def close_outside_connections(images_dir: Path) -> tuple[int, int]:
    """Rewrite a dump made with ``--tcp-established`` so that only connections with both
    ends in the images restore established; the others restore closed (as ``--tcp-close``
    makes them: an unbound socket shut down both ways) and their saved queues are deleted.
    Returns (connections kept, connections closed), counting sockets."""
    path = images_dir / "files.img"
    header, entries = _entries(path)
    decoded: list[tuple[list[Field], list[Field] | None]] = []
    sockets: dict[int, tuple[str, str]] = {}
    for raw in entries:
        entry = _decode(raw)
        isk: list[Field] | None = None
        if _ints(entry, _FE_TYPE) == [_FD_TYPE_INETSK]:
            blob = next((v for n, _, v in entry if n == _FE_ISK and isinstance(v, bytes)), None)
            if blob is not None:
                isk = _decode(blob)
                if _ints(isk, _ISK_PROTO) == [socket.IPPROTO_TCP] and _ints(isk, _ISK_DST_PORT)[0]:
                    family = _ints(isk, _ISK_FAMILY)[0]
                    local = _address_text(
                        family, _ints(isk, _ISK_SRC_ADDR), _ints(isk, _ISK_SRC_PORT)[0]
                    )
                    remote = _address_text(
                        family, _ints(isk, _ISK_DST_ADDR), _ints(isk, _ISK_DST_PORT)[0]
                    )
                    sockets[_ints(isk, _ISK_INO)[0]] = (local, remote)
        decoded.append((entry, isk))
    ends = set(sockets.values())
    outside = {ino for ino, (local, remote) in sockets.items() if (remote, local) not in ends}
    if not outside:
        return len(sockets), 0
    out = bytearray(header)
    for entry, isk in decoded:
        if isk is not None and _ints(isk, _ISK_INO)[0] in outside:
            isk = _closed(isk)
            entry = [(n, w, _encode(isk) if n == _FE_ISK else v) for n, w, v in entry]
        raw = _encode(entry)
        out += struct.pack("<I", len(raw)) + raw
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(bytes(out))
    tmp.replace(path)
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


_FE_REG = 3
_REG_FLAGS, _REG_NAME, _REG_EXT = 2, 6, 9
_FD_TYPE_REG = 1


def open_external_files_by_fd(images_dir: Path, keys: set[str]) -> int:
    """Let a restore open the external files ``keys`` through the fds it inherits.

    CRIU reopens an external file as ``/proc/self/fd/N`` with the flags it was opened
    with; ``shm_open`` adds ``O_NOFOLLOW``, which refuses that magic link ("Too many levels
    of symbolic links"). The flag only matters when a path is opened: it is dropped from
    those entries. Returns how many entries changed."""
    path = images_dir / "files.img"
    header, entries = _entries(path)
    out = bytearray(header)
    changed = 0
    for raw in entries:
        entry = _decode(raw)
        if _ints(entry, _FE_TYPE) == [_FD_TYPE_REG]:
            blob = next((v for n, _, v in entry if n == _FE_REG and isinstance(v, bytes)), None)
            reg = _decode(blob) if blob is not None else []
            name = next((v for n, _, v in reg if n == _REG_NAME and isinstance(v, bytes)), b"")
            flags = _ints(reg, _REG_FLAGS)
            if name.decode(errors="replace") in keys and flags and flags[0] & os.O_NOFOLLOW:
                reg = [
                    (n, w, v & ~os.O_NOFOLLOW if n == _REG_FLAGS and isinstance(v, int) else v)
                    for n, w, v in reg
                ]
                entry = [(n, w, _encode(reg) if n == _FE_REG else v) for n, w, v in entry]
                raw = _encode(entry)
                changed += 1
        out += struct.pack("<I", len(raw)) + raw
    if changed:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(bytes(out))
        tmp.replace(path)
    return changed
