"""Unix-socket facts from the kernel's sock_diag netlink interface.

CRIU refuses to dump a unix stream socket that is connected to a process outside the
dumped tree. Before a dump the wrapper drops its connections to the inner kernel and
uses these facts to know when that has happened and when no bytes are left unread.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 0x1
_NLM_F_DUMP = 0x300
_NLMSG_ERROR = 2
_NLMSG_DONE = 3
_UDIAG_SHOW_PEER = 0x4
_UDIAG_SHOW_RQLEN = 0x10
_UNIX_DIAG_PEER = 2
_UNIX_DIAG_RQLEN = 4
_NLMSG_HDR = struct.Struct("=IHHII")
_UNIX_DIAG_REQ = struct.Struct("=BBHIIIII")
_UNIX_DIAG_MSG = struct.Struct("=BBBBIII")


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
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as nl:
        req = _UNIX_DIAG_REQ.pack(
            socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, _UDIAG_SHOW_PEER | _UDIAG_SHOW_RQLEN, 0, 0
        )
        hdr = _NLMSG_HDR.pack(
            _NLMSG_HDR.size + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0
        )
        nl.send(hdr + req)
        while True:
            data = nl.recv(1 << 20)
            offset = 0
            while offset < len(data):
                length, msg_type, _, _, _ = _NLMSG_HDR.unpack_from(data, offset)
                if msg_type == _NLMSG_DONE:
                    return result
                if msg_type == _NLMSG_ERROR:
                    (err,) = struct.unpack_from("=i", data, offset + _NLMSG_HDR.size)
                    raise OSError(-err, os.strerror(-err))
                body = offset + _NLMSG_HDR.size
                _, _, _, _, inode, _, _ = _UNIX_DIAG_MSG.unpack_from(data, body)
                peer: int | None = None
                rqlen = 0
                attr = body + _UNIX_DIAG_MSG.size
                end = offset + length
                while attr + 4 <= end:
                    attr_len, attr_type = struct.unpack_from("=HH", data, attr)
                    if attr_len < 4:
                        break
                    if attr_type == _UNIX_DIAG_PEER:
                        (peer,) = struct.unpack_from("=I", data, attr + 4)
                    elif attr_type == _UNIX_DIAG_RQLEN:
                        (rqlen,) = struct.unpack_from("=I", data, attr + 4)
                    attr += (attr_len + 3) & ~3
                result[inode] = UnixSocket(inode, peer, rqlen)
                offset += (length + 3) & ~3


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
