"""Socket facts from the kernel's sock_diag netlink interface.

CRIU refuses to dump a unix stream socket that is connected to a process outside the
dumped tree. Before a dump the wrapper drops its connections to the inner kernel and
uses these facts to know when that has happened and when no bytes are left unread.
Before a restore, the TIME_WAIT entries of the kernel's own ended TCP connections are
found (and, with CAP_NET_ADMIN, destroyed) here: core/carried/timewait.py.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_SOCK_DESTROY = 21
_NLM_F_REQUEST = 0x1
_NLM_F_ACK = 0x4
_NLM_F_DUMP = 0x300
_NLMSG_ERROR = 2
_NLMSG_DONE = 3
_UDIAG_SHOW_PEER = 0x4
_UDIAG_SHOW_RQLEN = 0x10
_UNIX_DIAG_PEER = 2
_UNIX_DIAG_RQLEN = 4
_TCP_TIME_WAIT = 6
_NLMSG_HDR = struct.Struct("=IHHII")
_UNIX_DIAG_REQ = struct.Struct("=BBHIIIII")
_UNIX_DIAG_MSG = struct.Struct("=BBBBIII")
#: inet_diag_req_v2: family, protocol, ext, pad, states; then the inet_diag_sockid.
_INET_DIAG_REQ = struct.Struct("=BBBBI")
#: inet_diag_sockid: ports and addresses in network order, interface and cookie not.
_SOCKID_NET = struct.Struct(">HH16s16s")
_SOCKID_HOST = struct.Struct("=III")
#: inet_diag_msg: family, state, timer, retrans; the sockid; expires (ms), rqueue, wqueue,
#: uid, inode.
_INET_DIAG_MSG_HEAD = struct.Struct("=BBBB")
_INET_DIAG_MSG_TAIL = struct.Struct("=IIIII")


def _netlink(msg_type: int, flags: int, payload: bytes) -> Iterator[bytes]:
    """Send one sock_diag request; yield the body of each answer up to NLMSG_DONE (a dump)
    or the acknowledgement (a request with NLM_F_ACK). A negative answer raises OSError."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as nl:
        hdr = _NLMSG_HDR.pack(_NLMSG_HDR.size + len(payload), msg_type, flags, 1, 0)
        nl.send(hdr + payload)
        while True:
            data = nl.recv(1 << 20)
            offset = 0
            while offset < len(data):
                length, answer_type, _, _, _ = _NLMSG_HDR.unpack_from(data, offset)
                if answer_type == _NLMSG_DONE:
                    return
                if answer_type == _NLMSG_ERROR:
                    (err,) = struct.unpack_from("=i", data, offset + _NLMSG_HDR.size)
                    if err:
                        raise OSError(-err, os.strerror(-err))
                    return  # the acknowledgement
                yield data[offset + _NLMSG_HDR.size : offset + length]
                offset += (length + 3) & ~3


@dataclass(frozen=True)
class UnixSocket:
    inode: int
    peer: int | None
    """Inode of the peer; 0 when the peer was closed; None when never connected."""
    recv_queue: int
    """Bytes waiting to be read (for listening sockets: pending connections)."""


def unix_sockets() -> dict[int, UnixSocket]:
    """All unix sockets of this network namespace, by inode."""
    result: dict[int, UnixSocket] = {}
    req = _UNIX_DIAG_REQ.pack(
        socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, _UDIAG_SHOW_PEER | _UDIAG_SHOW_RQLEN, 0, 0
    )
    for body in _netlink(_SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, req):
        _, _, _, _, inode, _, _ = _UNIX_DIAG_MSG.unpack_from(body)
        peer: int | None = None
        rqlen = 0
        attr = _UNIX_DIAG_MSG.size
        while attr + 4 <= len(body):
            attr_len, attr_type = struct.unpack_from("=HH", body, attr)
            if attr_len < 4:
                break
            if attr_type == _UNIX_DIAG_PEER:
                (peer,) = struct.unpack_from("=I", body, attr + 4)
            elif attr_type == _UNIX_DIAG_RQLEN:
                (rqlen,) = struct.unpack_from("=I", body, attr + 4)
            attr += (attr_len + 3) & ~3
        result[inode] = UnixSocket(inode, peer, rqlen)
    return result


@dataclass(frozen=True)
class TimeWaitEntry:
    """A TCP connection's TIME_WAIT entry: no socket, no process, but its local port is
    bound until it expires (unless the bind reuses addresses, and so did its socket)."""

    family: int
    local: tuple[str, int]
    remote: tuple[str, int]
    expires_ms: int
    """How long it has left."""
    cookie: tuple[int, int]
    """The kernel's id of the entry: a destroy reaches this entry and no other."""


def _packed(family: int, address: str) -> bytes:
    return ipaddress.ip_address(address).packed.ljust(16, b"\0") if address else bytes(16)


def _address(family: int, raw: bytes) -> str:
    size = 4 if family == socket.AF_INET else 16
    return socket.inet_ntop(family, raw[:size])


def _inet_request(family: int, states: int, entry: TimeWaitEntry | None = None) -> bytes:
    req = _INET_DIAG_REQ.pack(family, socket.IPPROTO_TCP, 0, 0, states)
    if entry is None:
        return req + _SOCKID_NET.pack(0, 0, bytes(16), bytes(16)) + _SOCKID_HOST.pack(0, 0, 0)
    return (
        req
        + _SOCKID_NET.pack(
            entry.local[1],
            entry.remote[1],
            _packed(family, entry.local[0]),
            _packed(family, entry.remote[0]),
        )
        + _SOCKID_HOST.pack(0, *entry.cookie)
    )


def tcp_time_waits() -> list[TimeWaitEntry]:
    """The TIME_WAIT entries of this network namespace (IPv4 and IPv6)."""
    found: list[TimeWaitEntry] = []
    for family in (socket.AF_INET, socket.AF_INET6):
        request = _inet_request(family, 1 << _TCP_TIME_WAIT)
        for body in _netlink(_SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, request):
            msg_family, state, _, _ = _INET_DIAG_MSG_HEAD.unpack_from(body)
            if state != _TCP_TIME_WAIT:
                continue
            at = _INET_DIAG_MSG_HEAD.size
            sport, dport, src, dst = _SOCKID_NET.unpack_from(body, at)
            _, cookie0, cookie1 = _SOCKID_HOST.unpack_from(body, at + _SOCKID_NET.size)
            expires, *_ = _INET_DIAG_MSG_TAIL.unpack_from(
                body, at + _SOCKID_NET.size + _SOCKID_HOST.size
            )
            found.append(
                TimeWaitEntry(
                    msg_family,
                    (_address(msg_family, src), sport),
                    (_address(msg_family, dst), dport),
                    expires,
                    (cookie0, cookie1),
                )
            )
    return found


def destroy(entry: TimeWaitEntry) -> bool:
    """Destroy one TIME_WAIT entry (SOCK_DESTROY, by its cookie: never another socket on
    the same ports); False if it was gone already. Needs CAP_NET_ADMIN (PermissionError)."""
    request = _inet_request(entry.family, 1 << _TCP_TIME_WAIT, entry)
    try:
        for _ in _netlink(_SOCK_DESTROY, _NLM_F_REQUEST | _NLM_F_ACK, request):
            pass
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ESTALE):
            return False
        raise
    return True


def socket_fds(pid: int | str) -> dict[int, int]:
    """The sockets process ``pid`` ("self" for this one) holds open: fd -> inode."""
    fds: dict[int, int] = {}
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        entries = list(fd_dir.iterdir())
    except OSError:
        return fds
    for entry in entries:
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        if target.startswith("socket:["):
            fds[int(entry.name)] = int(target[8:-1])
    return fds


def socket_inodes(pid: int | str) -> set[int]:
    """Inodes of the sockets that process ``pid`` ("self" for this one) holds open."""
    return set(socket_fds(pid).values())


def tree_socket_inodes(pids: Iterable[int]) -> set[int]:
    """Inodes of the sockets that any of ``pids`` (a process tree) holds open."""
    inodes: set[int] = set()
    for pid in pids:
        inodes |= socket_inodes(pid)
    return inodes


#: What each kind of socket is listed in, by the start of its protocol's name (the
#: socket's ``system.sockprotoname``: "TCP", "TCPv6", "UDPv6", "UNIX-STREAM", ...).
_LISTED_IN = {"TCP": "tcp", "MPTCP": "tcp", "UDP": "udp", "UNIX": "", "NETLINK": "", "PACKET": ""}


def _inet_table(pid: int, fd: int) -> set[str]:
    """The /proc/net tables ("tcp", "udp") that can list the socket ``fd`` of ``pid``:
    none for a unix or netlink socket, both where its protocol cannot be read."""
    try:
        name = os.getxattr(f"/proc/{pid}/fd/{fd}", "system.sockprotoname")
    except OSError:
        return {"tcp", "udp"}
    for start, table in _LISTED_IN.items():
        if name.startswith(start.encode()):
            return {table} - {""}
    return {"tcp", "udp"}


@dataclass(frozen=True)
class TreeSockets:
    """The sockets a process tree holds open, and which /proc/net tables can list any of
    them: a kernel with no TCP or UDP socket (its channels are unix sockets) needs none of
    those tables read, which cost milliseconds each on a machine with many connections
    (the kernel walks its whole hash table for every read), while the kernel waits."""

    inodes: set[int]
    inet: frozenset[str]
    """Of "tcp" and "udp", the tables to read."""

    @classmethod
    def of(cls, pids: Iterable[int]) -> TreeSockets:
        inodes: set[int] = set()
        inet: set[str] = set()
        for pid in pids:
            for fd, inode in socket_fds(pid).items():
                if inode not in inodes:
                    inodes.add(inode)
                    inet |= _inet_table(pid, fd)
        return cls(inodes, frozenset(inet))


def socket_owners(pids: Iterable[int]) -> Iterator[tuple[int, int]]:
    """(socket inode, pid) for every socket fd of these processes."""
    for pid in pids:
        for inode in socket_inodes(pid):
            yield inode, pid
