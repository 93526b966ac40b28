"""The output gate: the inner kernel stops sending while the wrapper lets go of it.

Before a dump the wrapper must drop its connections to the kernel (CRIU cannot dump a unix
socket connected outside the dumped tree). A connection that ends while the kernel's
libzmq is writing a message loses that message: libzmq takes messages from the socket's
queue into its engine, and an engine that meets the end of its connection is destroyed
with what it held (stream_engine_base.cpp ``error``; session_base.cpp ``clean_pipes``
drops the rest of a message half taken). However rare, that is a lost output.

So nothing may be in flight when a connection ends. The kernel's channels toward the
wrapper are :class:`NumberedSocket`\\ s: each message gets a number frame (epoch, number;
:func:`jupyter_ext.core.protocol.number_frame`), and every send passes the gate. Before a
dump the wrapper asks the snapshot agent to *hold* the gate: sends in progress finish,
new ones wait (the thread sending blocks; IOPub output queues in ipykernel's IOPub thread,
unbounded), and the answer says the epoch and the last number sent on each channel. Once
the wrapper has received those, no message is left in the kernel's libzmq, and ending the
connections loses nothing. After the dump (or a restore of it, here or on another node)
the wrapper asks the agent to *release* the gate; a new epoch starts, numbered from 1.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Iterator
from typing import Any

import zmq

from jupyter_ext.core.protocol.inner import number_frame


def _new_epoch() -> int:
    return secrets.randbits(32)


class OutputGate:
    """The gate every :class:`NumberedSocket` of the kernel passes to send."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = False
        self._sending = 0
        self.epoch = _new_epoch()
        self.sockets: dict[str, NumberedSocket] = {}

    def number(self, name: str, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` (channel ``name``, toward the wrapper) number what it sends. The
        sockets are made by ipykernel; only their class changes (same layout)."""
        sock.__class__ = NumberedSocket
        assert isinstance(sock, NumberedSocket)
        sock.gate = self
        sock.numbered = 0
        self.sockets[name] = sock

    @contextlib.contextmanager
    def passage(self) -> Iterator[int]:
        """One send: waits while the gate is held; yields the epoch."""
        with self._cond:
            self._cond.wait_for(lambda: not self._held)
            self._sending += 1
            epoch = self.epoch
        try:
            yield epoch
        finally:
            with self._cond:
                self._sending -= 1
                self._cond.notify_all()

    def hold(self) -> dict[str, Any]:
        """Stop every send (those under way finish first); the epoch, the last number
        sent on each channel, and whether the gate was held already (not released since
        the dump this kernel was restored from: it sent nothing since)."""
        with self._cond:
            was_held, self._held = self._held, True
            self._cond.wait_for(lambda: self._sending == 0)
            return {
                "epoch": self.epoch,
                "sent": {name: sock.numbered for name, sock in self.sockets.items()},
                "was_held": was_held,
            }

    def release(self) -> dict[str, Any]:
        """Let sends go on, in a new epoch; a gate not held stays as it is (a release asked
        again after one that was answered late)."""
        with self._cond:
            if not self._held:
                return {"released": False}
            self.epoch = _new_epoch()
            for sock in self.sockets.values():
                sock.numbered = 0
            self._held = False
            self._cond.notify_all()
            return {"released": True}


class NumberedSocket(zmq.Socket[bytes]):
    """A channel toward the wrapper: each message passes the gate and is numbered. The
    number frame goes first (an XPUB's topic follows it: the wrapper subscribes to all),
    after the routing id on a ROUTER."""

    gate: OutputGate
    numbered: int = 0
    """The number of the last message sent in the gate's epoch."""

    def send_multipart(self, msg_parts: Any, *args: Any, **kwargs: Any) -> Any:
        with self.gate.passage() as epoch:
            number = self.numbered + 1
            frames = list(msg_parts)
            frames.insert(1 if self.type == zmq.ROUTER else 0, number_frame(epoch, number))
            result = super().send_multipart(frames, *args, **kwargs)
            self.numbered = number
            return result
