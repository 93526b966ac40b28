"""A way to break the network to the tests' real S3 endpoint.

The endpoint is ``jupyter_ext.testing.MotoServer``, moto's standalone server as a child
process on 127.0.0.1 (it keeps objects in memory and implements conditional writes; the
benchmarks use it too). ``CuttableProxy`` forwards TCP to it; ``cut()`` drops every
connection and refuses new ones, as a failed network would, while the server keeps its
objects so a test can look at what was left behind; ``stall()`` accepts connections and
never answers, as an overloaded endpoint would.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class CuttableProxy:
    """A TCP forwarder to ``127.0.0.1:target_port`` whose connections a test can cut."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._cut = threading.Event()
        self._stall = threading.Event()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self.stalled: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        """Drop every open connection and refuse new ones until ``restore()``."""
        self._cut.set()
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            _close(sock)

    def stall(self) -> None:
        """Accept new connections but never forward them (``stalled`` holds them)."""
        self._stall.set()

    def restore(self) -> None:
        """Forward again; stalled connections are dropped (clients retry)."""
        self._cut.clear()
        self._stall.clear()
        with self._lock:
            stalled, self.stalled = self.stalled, []
        for sock in stalled:
            _close(sock)

    def close(self) -> None:
        self.cut()
        _close(self._listener)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # the listener was closed
            if self._cut.is_set():
                _close(client)
                continue
            if self._stall.is_set():
                with self._lock:
                    self.stalled.append(client)
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._sockets.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                _close(sock)
            with self._lock:
                self._sockets.difference_update((src, dst))


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
