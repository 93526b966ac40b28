"""The network ports a kernel holds, and whether they are free where it is restored.

CRIU restores a listening TCP socket or a bound UDP socket by binding its address and
port again; if another process holds that port the restore fails ("Address already in
use"). The wrapper records the kernel's ports in the manifest and checks them before a
restore starts, so the error names the port, and a running kernel is never ended for a
restore that cannot succeed (or, as root, restores a copy whose ports are taken into a
network namespace of its own: core/isolation/netns.py). Facts come from /proc/net of this network
namespace, or of a kernel's (``/proc/PID/net``: a copy in its own namespace).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import proctree
from . import sockdiag

_TCP_LISTEN = 0x0A
_WILDCARDS = ("0.0.0.0", "::")


@dataclass(frozen=True)
class BoundPort:
    """A listening TCP socket or a bound UDP socket: what a restore binds again."""

    proto: str
    """"tcp" or "udp"."""
    address: str
    port: int

    def describe(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        kind = "TCP port" if self.proto == "tcp" else "UDP port"
        what = " (listening)" if self.proto == "tcp" else ""
        return f"{kind} {host}:{self.port}{what}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BoundPort:
        return cls(str(data["proto"]), str(data["address"]), int(data["port"]))

    def collides_with(self, other: BoundPort) -> bool:
        return (
            self.proto == other.proto
            and self.port == other.port
            and (
                self.address == other.address
                or self.address in _WILDCARDS
                or other.address in _WILDCARDS
            )
        )


@dataclass(frozen=True)
class _Entry:
    port: BoundPort
    state: int
    inode: int
    uid: int


def proc_net_address(hex_address: str) -> str:
    """/proc/net's hex address (host-order 32-bit words) as text."""
    raw = bytes.fromhex(hex_address)
    words = struct.unpack(f"<{len(raw) // 4}I", raw)
    packed = struct.pack(f">{len(words)}I", *words)
    family = socket.AF_INET if len(packed) == 4 else socket.AF_INET6
    return str(ipaddress.ip_address(socket.inet_ntop(family, packed)))


def proc_net_rows(pid: int | str, tables: tuple[str, ...]) -> Iterator[list[str]]:
    """The rows of ``/proc/PID/net/<table>`` (``pid``'s network namespace) for each table,
    split into fields; short rows and tables that cannot be read are left out."""
    for table in tables:
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) >= 10:
                yield fields


def _entries(pid: int | str = "self", protos: Collection[str] = ("tcp", "udp")) -> list[_Entry]:
    """Every socket of ``protos`` ("tcp", "udp") in ``pid``'s network namespace with a
    local port."""
    found: list[_Entry] = []
    for proto in sorted(protos):
        for fields in proc_net_rows(pid, (proto, proto + "6")):
            hex_address, hex_port = fields[1].split(":")
            port = int(hex_port, 16)
            if port == 0:
                continue
            found.append(
                _Entry(
                    BoundPort(proto, proc_net_address(hex_address), port),
                    int(fields[3], 16),
                    int(fields[9]),
                    int(fields[7]),
                )
            )
    return found


def _binds(entry: _Entry) -> bool:
    """Whether the socket holds its port the way a restore needs it (TCP listening, or
    any UDP socket)."""
    return entry.port.proto == "udp" or entry.state == _TCP_LISTEN


def bound_ports(sockets: sockdiag.TreeSockets, pid: int | str = "self") -> list[BoundPort]:
    """The ports a kernel's sockets hold (``pid`` is one of its processes)."""
    ports = {
        entry.port
        for entry in _entries(pid, sockets.inet)
        if entry.inode in sockets.inodes and _binds(entry)
    }
    return sorted(ports, key=lambda p: (p.proto, p.port, p.address))


def taken_ports(ports: list[BoundPort], ignore: Collection[int] = ()) -> list[str]:
    """Which of ``ports`` a socket here holds (except sockets in ``ignore``, e.g. those of
    the kernel a restore replaces), in words, each with the process that holds it. (The
    TIME_WAIT entries of ended connections hold no socket: core/carried/timewait.py.)"""
    others = [e for e in _entries() if e.inode not in ignore and _binds(e)]
    taken = {port: [o for o in others if port.collides_with(o.port)] for port in ports}
    wanted = {o.inode for holding in taken.values() for o in holding}
    owners = dict(sockdiag.socket_owners(proctree.all_pids())) if wanted else {}
    return [
        f"{port.describe()}, held by {', '.join(sorted({_holder(o, owners) for o in holding}))}"
        for port, holding in taken.items()
        if holding
    ]


def _holder(entry: _Entry, owners: dict[int, int]) -> str:
    """The process that holds a socket, in words (without root, another user's processes
    cannot be looked into: then its user)."""
    pid = owners.get(entry.inode)
    if pid is None:
        return f"a process of user {entry.uid} ('ss -tulpn' as root names it)"
    return f"process {pid} ({proctree.process_name(pid)})"


def taken_endpoints(endpoints: list[str]) -> list[str]:
    """Which local endpoints (``ADDR:PORT``, ``[ADDR]:PORT``) of a snapshot's kept TCP
    connections a socket here holds (any state but TIME_WAIT's, which holds no socket)."""
    held = {
        endpoint_text(e.port.address, e.port.port)
        for e in _entries()
        if e.port.proto == "tcp" and e.inode != 0
    }
    return sorted(f"TCP {endpoint} (a kept connection's)" for endpoint in set(endpoints) & held)


def endpoint_text(address: str, port: int) -> str:
    """``ADDR:PORT`` (``[ADDR]:PORT`` for IPv6; an IPv4-mapped address as IPv4)."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def endpoint_address(endpoint: str) -> str:
    """The address of ``ADDR:PORT`` or ``[ADDR]:PORT`` (:func:`endpoint_text`)."""
    return endpoint.rpartition(":")[0].strip("[]")


def unix_socket_dirs(pid: int, inodes: set[int]) -> list[str]:
    """The directories of the file-system unix sockets that the sockets with these inodes
    are bound to (``/proc/PID/net/unix``), e.g. the ``/tmp/pymp-*`` of a multiprocessing
    manager: CRIU binds them again on restore, and on another node the directory is
    missing. A socket whose file is gone (the endpoints of a kernel behind the bridge,
    kernel_wrapper.inkernel.bridge) CRIU binds in a directory it makes and removes again
    itself: its directory, which may be a runtime directory long gone, is not listed."""
    found: set[str] = set()
    try:
        lines = Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]
    except OSError:
        return []
    for line in lines:
        fields = line.split(None, 7)
        if (
            len(fields) == 8
            and int(fields[6]) in inodes
            and fields[7].startswith("/")
            and os.path.lexists(f"/proc/{pid}/root{fields[7]}")  # as the kernel sees it
        ):
            found.add(str(Path(fields[7]).parent))
    return sorted(found)


def make_missing_dirs(directories: list[str]) -> list[Path]:
    """Create the directories that are missing (mode 0700, for our sockets only); returns
    those made, outermost first, so that a failed restore can remove them again."""
    made: list[Path] = []
    for directory in directories:
        path = Path(directory)
        missing = [p for p in [path, *path.parents] if not p.exists()]
        for p in reversed(missing):
            p.mkdir(mode=0o700)
            made.append(p)
    return made
