"""The stand-in kernel: answers jupyter_server while there is no kernel process.

A *dead* kernel (``--on-inner-death=wait``) answers every request with an error that says
how to get it back, so a notebook never hangs. A *suspended* kernel keeps requests for
the kernel, and one that needs it (a cell, a completion, an inspection) brings it back.
Both answer kernel_info and shutdown themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio
from jupyter_client.session import Session

from jupyter_ext import __version__

from .channels import REQUEST_CHANNELS, ServerChannels, receive_ready

log = logging.getLogger("kernel_wrapper")

#: Requests that bring a suspended kernel back (others wait for it, or are answered here).
WAKING_REQUESTS = ("execute_request", "complete_request", "inspect_request")
#: The kernel_info a stand-in gives before the kernel ever answered one.
DEFAULT_KERNEL_INFO: dict[str, Any] = {
    "status": "ok",
    "protocol_version": "5.3",
    "implementation": "kernel_wrapper",
    "implementation_version": __version__,
    "language_info": {"name": "python"},
    "banner": "",
}
DEAD_TEXT = (
    "The kernel process died. Restore a snapshot (Kernel Snapshots panel or "
    "'jupyter snapshot restore') or restart the kernel."
)


class StandIn:
    """Answers on the server's shell, control and stdin channels while started.

    ``kernel_info()`` gives the last kernel info the kernel sent; ``hold(name, frames)``
    keeps a request for the kernel; ``wake()`` is called when a suspended kernel is
    needed; ``shutdown()`` after a shutdown_request was answered.
    """

    def __init__(
        self,
        session: Session,
        server: ServerChannels,
        *,
        kernel_info: Callable[[], dict[str, Any]],
        hold: Callable[[str, list[bytes]], None],
        wake: Callable[[], None],
        shutdown: Callable[[], None],
    ) -> None:
        self.session = session
        self.server = server
        self._kernel_info = kernel_info
        self._hold = hold
        self._wake = wake
        self._shutdown = shutdown
        self.suspended = False
        self.dead_text = DEAD_TEXT
        """What a dead kernel answers every cell (a kernel the bridge refused says why)."""
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, suspended: bool) -> None:
        """Answer for a kernel that is suspended (``suspended``) or dead."""
        self.stop()
        self.suspended = suspended
        for name in REQUEST_CHANNELS:
            self._tasks.append(asyncio.create_task(self._answer(name)))

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()

    async def _answer(self, name: str) -> None:
        sock = self.server[name]
        with contextlib.suppress(asyncio.CancelledError, zmq.ContextTerminated):
            while True:
                for frames in await receive_ready(sock):
                    idents, msg_list = self.session.feed_identities(frames)
                    try:
                        msg = self.session.deserialize(msg_list)
                    except ValueError:
                        log.warning("dropping a message with a bad signature on %s", name)
                        continue
                    self._reply(name, sock, idents, msg, frames)

    def _reply(
        self,
        name: str,
        sock: zmq.asyncio.Socket,
        idents: list[bytes],
        msg: dict[str, Any],
        frames: list[bytes],
    ) -> None:
        msg_type = msg["header"]["msg_type"]
        if self.suspended and msg_type not in ("kernel_info_request", "shutdown_request"):
            self._hold(name, frames)
            if msg_type in WAKING_REQUESTS:
                self._wake()
            return
        iopub = self.server["iopub"]
        self.session.send(iopub, "status", {"execution_state": "busy"}, parent=msg)
        reply_type = msg_type.replace("_request", "_reply")
        if msg_type == "kernel_info_request":
            content = dict(self._kernel_info()) or dict(DEFAULT_KERNEL_INFO)
        elif msg_type == "shutdown_request":
            content = {"status": "ok", "restart": msg["content"].get("restart", False)}
        elif msg_type == "interrupt_request":
            content = {"status": "ok"}
        else:
            if msg_type == "execute_request":
                self.session.send(
                    iopub, "stream", {"name": "stderr", "text": self.dead_text + "\n"}, parent=msg
                )
            content = {
                "status": "error",
                "ename": "KernelDied",
                "evalue": self.dead_text,
                "traceback": [],
                "execution_count": 0,
            }
        self.session.send(sock, reply_type, content, parent=msg, ident=idents)
        self.session.send(iopub, "status", {"execution_state": "idle"}, parent=msg)
        if msg_type == "shutdown_request":
            self._shutdown()
