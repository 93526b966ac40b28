"""A page source in another process.

The store is open in the server process; CRIU runs under the kernel's wrapper. The
server lends the wrapper its source over a unix socket: a request is (path length,
offset, length) and the path; an answer is (status, size) and the bytes, or the error:
a SnapshotError as its JSON (status 2, rebuilt on the other side), else its text."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import threading
from pathlib import Path

from .. import private
from ..errors import SnapshotError
from .sources import DirectoryPages, PageSource

log = logging.getLogger(__name__)

_RANGE_REQUEST = struct.Struct("<HQI")
_RANGE_REPLY = struct.Struct("<BI")
#: ``pages_from`` of a wrapper restore naming a :class:`RangeServer`.
UNIX_PREFIX = "unix:"


class RangeServer:
    """Serves ``source`` on the unix socket ``path`` (one thread per connection) until
    :meth:`close`: to this user only (mode 0600 in a private directory, and each
    connection's SO_PEERCRED: another user's is closed unanswered)."""

    def __init__(self, source: PageSource, path: Path) -> None:
        self.source = source
        self.path = path
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        os.chmod(path, 0o600)
        self._listener.listen()
        self._closed = False
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, name="range-server", daemon=True).start()

    @property
    def address(self) -> str:
        return UNIX_PREFIX + str(self.path)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if not private.trusted_peer(conn):
                log.warning("refused a page request connection from another user")
                conn.close()
                continue
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    head = recv_exact(conn, _RANGE_REQUEST.size)
                    if head is None:
                        return
                    size, offset, length = _RANGE_REQUEST.unpack(head)
                    name = recv_exact(conn, size)
                    if name is None:
                        return
                except OSError:
                    return
                try:
                    data = self.source.read(name.decode(), offset, length)
                    status = 0
                except SnapshotError as exc:  # e.g. a damaged chunk: said as it is
                    data, status = json.dumps(exc.to_dict()).encode(), 2
                except Exception as exc:  # noqa: BLE001 -- sent to the reader, which retries
                    data, status = f"{type(exc).__name__}: {exc}".encode(), 1
                try:
                    conn.sendall(_RANGE_REPLY.pack(status, len(data)) + data)
                except OSError:
                    return

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class RemotePages:
    """A :class:`PageSource` served by a :class:`RangeServer` in another process; one
    connection per thread, so prefetching and the kernel's faults go side by side."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()

    def read(self, path: str, offset: int, length: int) -> bytes:
        name = path.encode()
        sock: socket.socket | None = getattr(self._local, "sock", None)
        try:
            if sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._local.sock = sock
                sock.connect(str(self.path))
            sock.sendall(_RANGE_REQUEST.pack(len(name), offset, length) + name)
            head = recv_exact(sock, _RANGE_REPLY.size)
            if head is None:
                raise OSError("the page source closed the connection")
            status, size = _RANGE_REPLY.unpack(head)
            data = recv_exact(sock, size) if size else b""
            if data is None:
                raise OSError("the page source closed the connection")
        except OSError:
            if sock is not None:
                sock.close()
            self._local.sock = None  # the next try connects again
            raise
        if status == 2:
            raise SnapshotError.from_dict(json.loads(data))
        if status != 0:
            raise OSError(data.decode(errors="replace"))
        return data


def page_source(spec: str) -> PageSource:
    """The source a wrapper restore's ``pages_from`` names: ``unix:PATH`` (a
    :class:`RangeServer`) or an images directory."""
    if spec.startswith(UNIX_PREFIX):
        return RemotePages(Path(spec[len(UNIX_PREFIX) :]))
    return DirectoryPages(Path(spec))


def recv_exact(sock: socket.socket, size: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            if buf:
                raise OSError("CRIU closed the connection mid-request")
            return None
        buf += chunk
    return bytes(buf)
