"""The relay: messages between jupyter_server's channels and the inner kernel's.

Requests from the server are checked against the connection's key and passed on unsigned
(the kernel holds no secret); what the kernel sends is signed and passed out. Nothing
blocks the wrapper's loop: a message that cannot go now waits, in order, in a backlog. On
the way the relay shows every message to its tracker (:mod:`kernel_wrapper.tracker`),
which keeps what the wrapper must know without asking the kernel (activity, execution
state, kernel info, the cell running), and after a restore carries the cell the kernel
resumes to clients that connect later.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import logging
import time
from typing import Any

import zmq
import zmq.asyncio
from jupyter_client.session import DELIM, Session

from jupyter_ext.core import proctree
from jupyter_ext.core.carried import sockdiag
from jupyter_ext.core.errors import SnapshotError
from jupyter_ext.core.protocol.inner import read_number

from .channels import (
    REQUEST_CHANNELS,
    InnerChannels,
    Route,
    ServerChannels,
    receive_ready,
    send_now,
    sync_socket,
    take_all,
)
from .ownrequests import OwnRequests
from .tracker import KernelTracker

log = logging.getLogger("kernel_wrapper")

#: How long the wrapper waits for the inner kernel to drop its connections before a dump.
DISCONNECT_TIMEOUT = 5.0
#: How long the kernel's agent gets to hold its output gate, or to release it (it answers
#: in a few ms; more only while the kernel's code holds the interpreter lock in C).
GATE_TIMEOUT = 10.0
#: How long what the kernel sent before its gate was held gets to arrive.
RECEIVE_TIMEOUT = 30.0


class Relay:
    """Pumps between ``server`` and ``inner`` (the inner channels, None while no kernel is
    connected), started and stopped by the wrapper's state (see ``start``); ``tracker``
    sees every message that passes."""

    def __init__(self, session: Session, server: ServerChannels) -> None:
        self.session = session
        self.server = server
        self.inner: InnerChannels | None = None
        self.tracker = KernelTracker(session, self.send)
        self.own = OwnRequests(session)
        """The wrapper's own requests to the kernel, whose answers are not passed on."""
        self._open = False
        """Whether requests go to the kernel now (else they wait in the backlog)."""
        self._pumps: list[asyncio.Task[None]] = []
        self._held: dict[str, list[list[bytes]]] = {name: [] for name in REQUEST_CHANNELS}
        self._backlog: dict[Route, collections.deque[list[bytes]]] = {}
        self._flushers: dict[Route, asyncio.Task[None]] = {}
        self._release: asyncio.Task[None] | None = None
        """Releases the output gate of a kernel just connected (kernel_wrapper.inkernel.gate)."""
        self.gated = True
        """Whether the kernel has an output gate: ipykernel's snapshot agent does; a kernel
        behind the bridge (kernel_wrapper.inkernel.bridge) has no agent to ask."""

    # ------------------------------------------------------------------ pumps

    def start(self, requests: bool) -> None:
        """Forward what the kernel sends; with ``requests`` also what the server sends,
        after the requests held while the kernel was away, in order."""
        self.stop()
        assert self.inner is not None
        inner = self.inner.sockets
        self._open = requests
        if requests:
            for name, held in self._held.items():
                for frames in held:
                    checked = self.unsign(name, frames)
                    if checked is not None and not self.tracker.answer_kernel_info(name, checked):
                        self.tracker.observe(name, checked, False)
                        self.send(("inner", name), checked)
                held.clear()
        pumps = [(name, inner[name], self.server[name], True) for name in REQUEST_CHANNELS]
        pumps.append(("iopub", inner["iopub"], self.server["iopub"], True))
        pumps.append(("fork_pipe", inner["fork_pipe"], self.server["iopub"], True))
        if requests:
            pumps += [(name, self.server[name], inner[name], False) for name in REQUEST_CHANNELS]
        for name, source, sink, outward in pumps:
            pump = self._pump(name, source, sink, outward)
            direction = "out" if outward else "in"
            self._pumps.append(asyncio.create_task(pump, name=f"{name}-{direction}"))

    def stop(self) -> None:
        """Forward nothing more: requests wait in the server-facing sockets."""
        self._open = False
        for task in self._pumps:
            task.cancel()
        self._pumps.clear()

    def hold(self, name: str, frames: list[bytes]) -> None:
        """Keep a request (as it came, signed) for the kernel, which is away."""
        self._held[name].append(frames)

    async def _pump(
        self,
        name: str,
        source: zmq.asyncio.Socket,
        sink: zmq.asyncio.Socket,
        outward: bool,
    ) -> None:
        route = ("server", "iopub" if name == "fork_pipe" else name) if outward else ("inner", name)
        with contextlib.suppress(asyncio.CancelledError, zmq.ContextTerminated):
            while True:
                try:
                    batch = await receive_ready(source)
                except zmq.ZMQError as exc:  # a pump must never die silently: say it, go on
                    log.error("receiving on %s failed: %s", name, exc)
                    await asyncio.sleep(0.01)
                    continue
                for frames in batch:
                    if outward:
                        frames = self._unnumber(name, frames)
                    checked = self.sign(frames) if outward else self.unsign(name, frames)
                    if checked is None or (outward and self.own.take(checked)):
                        continue
                    if outward:
                        self.tracker.kernel_sent(name, checked)
                    elif self.tracker.answer_kernel_info(name, checked):
                        continue
                    self.tracker.observe(name, checked, outward)
                    self.send(route, checked)

    def _sink(self, route: Route) -> zmq.asyncio.Socket | None:
        """Where a route's messages go now; None while the kernel must not get any (it is
        away, or being disconnected for a dump)."""
        side, name = route
        if side == "server":
            return self.server[name]
        if self.inner is None or not self._open:
            return None
        return self.inner.sockets[name]

    def send(self, route: Route, frames: list[bytes]) -> None:
        """Send without ever blocking the loop or awaiting: a message that cannot go now
        (no peer yet, or the kernel away during a snapshot) waits, in order, in a backlog
        that a flusher task sends as soon as it can, also to the channels of a kernel that
        reconnects after a restore."""
        backlog = self._backlog.setdefault(route, collections.deque())
        sink = self._sink(route)
        if not backlog and sink is not None:
            try:
                send_now(sink, frames)
                return
            except zmq.Again:
                pass
            except zmq.ZMQError as exc:
                log.warning("sending on %s failed (%s); will retry", route, exc)
        backlog.append(frames)
        if route not in self._flushers:
            self._flushers[route] = asyncio.create_task(self._flush(route))

    async def _flush(self, route: Route) -> None:
        backlog = self._backlog[route]
        try:
            while backlog:
                sink = self._sink(route)
                try:
                    if sink is None:
                        raise zmq.Again()
                    send_now(sink, backlog[0])
                    backlog.popleft()
                except zmq.Again:
                    await asyncio.sleep(0.002)
                except zmq.ZMQError as exc:  # a socket closed under us: retry on the next
                    log.debug("send on %s failed (%s); retrying", route, exc)
                    await asyncio.sleep(0.002)
        finally:
            del self._flushers[route]

    async def forward_subscriptions(self) -> None:
        """Pass iopub subscriptions to the kernel, for the wrapper's whole life; a new
        subscriber also learns what a resumed cell runs, and what it printed so far."""
        with contextlib.suppress(asyncio.CancelledError, zmq.ContextTerminated):
            while True:
                for frames in await receive_ready(self.server["iopub"]):
                    if self.inner is not None:
                        self.send(("inner", "iopub"), frames)
                    if frames and frames[0][:1] == b"\x01" and self.tracker.resumed_request:
                        self.tracker.announce_resumed()
                        for replay in self.tracker.replays():
                            self.send(("server", "iopub"), self.sign(replay))

    async def execute_own(self, code: str, timeout: float) -> list[dict[str, Any]] | None:
        """Run ``code`` silently in the kernel for the wrapper itself
        (:mod:`kernel_wrapper.ownrequests`): what the kernel sent for it, None without
        an answer within ``timeout``."""
        msg_id, frames = self.own.execute_request(code)
        self.send(("inner", "shell"), frames)
        return await self.own.answers(msg_id, timeout)

    def describe(self) -> str:
        """What each part of the relay holds now, for a log line when messages seem stuck
        (SIGUSR1 to the wrapper: see wrapper.KernelWrapper.run)."""
        sockets = {f"server.{n}": s for n, s in self.server.sockets.items()}
        if self.inner is not None:
            sockets.update({f"inner.{n}": s for n, s in self.inner.sockets.items()})
        events = []
        for name, sock in sockets.items():
            # What libzmq holds (a waiting pump beside "in" would be a lost wake-up), then
            # the asyncio socket's look, which wakes any task waiting on what is there.
            ready = int(sync_socket(sock).get(zmq.EVENTS))
            sock.get(zmq.EVENTS)
            flags = "in" if ready & zmq.POLLIN else ""
            flags += "+out" if ready & zmq.POLLOUT else ""
            events.append(f"{name}={flags or '-'}")
        pumps = [task.get_name() for task in self._pumps if not task.done()]
        ended = [task.get_name() for task in self._pumps if task.done()]
        backlog = {f"{a}.{b}": len(q) for (a, b), q in self._backlog.items() if q}
        held = {name: len(frames) for name, frames in self._held.items() if frames}
        return (
            f"open={self._open} inner={'yes' if self.inner is not None else 'no'} "
            f"pumps={pumps} ended={ended} backlog={backlog} held={held} "
            f"sockets: {' '.join(events)}"
        )

    # ------------------------------------------------------------------ signatures

    def unsign(self, name: str, frames: list[bytes]) -> list[bytes] | None:
        """Check a server message's signature and strip it for the inner kernel.

        The inner kernel runs with an empty key: it never holds the connection's secret,
        so snapshot images do not contain it, and a kernel restored under a new connection
        file (new server, new key) keeps working. The wrapper checks every request.
        """
        try:
            at = frames.index(DELIM)
        except ValueError:
            return None
        signature = frames[at + 1] if len(frames) > at + 1 else b""
        if self.session.auth is not None and not hmac.compare_digest(
            signature, self.session.sign(frames[at + 2 : at + 6])
        ):
            log.warning("dropping a %s message with an invalid signature", name)
            return None
        return [*frames[: at + 1], b"", *frames[at + 2 :]]

    def sign(self, frames: list[bytes]) -> list[bytes]:
        """Sign a message from the inner kernel with the connection's key."""
        try:
            at = frames.index(DELIM)
        except ValueError:
            return frames
        if self.session.auth is None:
            return frames
        return [*frames[: at + 1], self.session.sign(frames[at + 2 : at + 6]), *frames[at + 2 :]]

    # ------------------------------------------------------------------ the inner channels

    def _unnumber(self, name: str, frames: list[bytes]) -> list[bytes]:
        """A message from the kernel without its number frame (noted in the channels'
        ``received``), or a forked child's without its pipe uuid."""
        if name == "fork_pipe":
            return frames[1:]
        number = read_number(frames[0]) if frames else None
        if number is None:
            return frames  # a kernel started before numbering
        if self.inner is not None:
            last = self.inner.received.get(name, (number[0], 0) if number[1] == 1 else None)
            if last is not None and last[0] == number[0] and number[1] != last[1] + 1:
                log.error("the kernel's %s message %d came after %d", name, number[1], last[1])
            self.inner.received[name] = number
        return frames[1:]

    def connect_inner(self, inner: InnerChannels) -> None:
        """Use ``inner``, and release the output gate of the kernel that connects to it
        (held by the dump it comes from, if any: a fresh kernel's is not)."""
        self.inner = inner
        if self._release is not None:
            self._release.cancel()
            self._release = None
        if self.gated:
            self._release = asyncio.create_task(self._release_gate(inner), name="release-gate")

    async def _release_gate(self, inner: InnerChannels) -> None:
        """Ask the kernel's agent to release its gate until it answers, for as long as
        ``inner`` is connected (a kernel being restored connects once it runs): a kernel
        whose gate stays held sends nothing more. An agent of an older version answers
        that it knows no gate."""
        said = False
        with contextlib.suppress(zmq.ZMQError):  # the channels closed under it
            while self.inner is inner:
                answer = await inner.ask_agent("release", GATE_TIMEOUT)
                error = str(answer.get("error", ""))
                if not error:
                    return
                if error.startswith("unknown operation"):
                    log.warning("the kernel has no output gate (an older version's)")
                    return
                if not said:
                    log.warning("releasing the kernel's output gate: %s; asking on", error)
                    said = True

    async def close_inner(self) -> None:
        """Close the inner channels (a kernel that is gone, or about to be replaced)."""
        if self._release is not None:
            self._release.cancel()
            self._release = None
        if self.inner is not None:
            inner, self.inner = self.inner, None
            await asyncio.to_thread(inner.close)

    async def disconnect(self, inner_pid: int) -> None:
        """Drop every connection between the wrapper and the kernel, losing no message.

        CRIU cannot dump a unix socket connected to a process outside the dumped tree, and
        a connection that ends while libzmq writes a message loses it
        (kernel_wrapper.inkernel.gate). The kernel keeps running while this happens:

        1. no requests are forwarded any more (they wait in the server-facing sockets);
        2. our endpoints are unlinked: nothing connects again before the dump;
        3. the kernel's agent holds its output gate and says the last message it sent on
           each channel; we wait until that one has arrived: nothing is in flight from it;
        4. forked children's connections end by themselves once they delivered;
        5. we forward the rest and close our sockets, which first send what we still
           hold (linger); the kernel reads it, sees the end of each connection and closes
           its own end.

        A failure before step 5 leaves the channels connected (nothing lost; the gate is
        released when the dump connects them again: ``connect_inner``).
        """
        inner = self.inner
        assert inner is not None
        inner.unlink_endpoints()
        await self._hold(inner)
        await self._children_done(inner_pid)
        self.stop()
        await asyncio.sleep(0)  # let the cancelled pumps let go of their sockets
        for name, sock in inner.sockets.items():
            for frames in take_all(sock):
                frames = self.sign(self._unnumber(name, frames))
                if self.own.take(frames):
                    continue
                self.tracker.observe(name, frames, reply=True)
                self.send(("server", "iopub" if name == "fork_pipe" else name), frames)
        await self.close_inner()
        await self._wait_disconnected(inner_pid)

    async def _hold(self, inner: InnerChannels) -> None:
        """Steps 3: hold the kernel's output gate, then wait for what it sent before. The
        release still being asked for stops first: the agent answers in order, so no
        release can come after this hold (one never sent leaves the gate held since the
        last dump: nothing was sent since)."""
        if self._release is not None:
            self._release.cancel()
            await asyncio.gather(self._release, return_exceptions=True)
            self._release = None
        if not self.gated:
            return
        answer = await inner.ask_agent("hold", GATE_TIMEOUT)
        if answer.get("absent") or str(answer.get("error", "")).startswith("unknown operation"):
            log.warning("the kernel has no output gate: output sent during the dump may be lost")
            return
        if answer.get("error"):
            raise SnapshotError(
                f"The kernel did not pause its output within {GATE_TIMEOUT:g} s "
                f"({answer['error']}), so it cannot be snapshotted without risking its output.",
                hint="The kernel may be busy in code that holds Python's interpreter lock; "
                "retry the snapshot later.",
            )
        if answer.get("was_held"):
            return
        epoch = int(answer["epoch"])
        due = {name: (epoch, int(n)) for name, n in answer["sent"].items() if n}
        deadline = time.monotonic() + RECEIVE_TIMEOUT
        while any(inner.received.get(name, (-1, 0)) != last for name, last in due.items()):
            if time.monotonic() > deadline:
                missing = {n: last for n, last in due.items() if inner.received.get(n) != last}
                raise SnapshotError(
                    f"Messages the kernel sent did not arrive within {RECEIVE_TIMEOUT:g} s "
                    f"(last numbers due: {missing}, received: {inner.received}).",
                    hint="Retry the snapshot; if it fails again, restart the kernel and "
                    "report the wrapper's log.",
                )
            await asyncio.sleep(0.0005)

    @staticmethod
    async def _children_done(inner_pid: int) -> None:
        """Step 4: wait until no forked child of the kernel is connected to us (each ends
        its connection once its output is delivered; none can connect any more). One that
        stays past the timeout is cut off by step 5."""
        deadline = time.monotonic() + DISCONNECT_TIMEOUT
        while True:
            pids = proctree.descendants(inner_pid)
            ours = sockdiag.socket_inodes("self")
            table = sockdiag.unix_sockets()
            children = sockdiag.tree_socket_inodes(pids[1:]) - sockdiag.tree_socket_inodes(pids[:1])
            if not any(i in table and table[i].peer in ours for i in children):
                return
            if time.monotonic() > deadline:
                log.warning("a child of the kernel stays connected; its output may be cut")
                return
            await asyncio.sleep(0.0005)

    @staticmethod
    async def _wait_disconnected(inner_pid: int) -> None:
        """Wait until no socket of the kernel's tree is connected to a process outside it."""
        deadline = time.monotonic() + DISCONNECT_TIMEOUT
        while True:
            held = sockdiag.tree_socket_inodes(proctree.descendants(inner_pid))
            table = sockdiag.unix_sockets()
            outside = [
                i for i in held if i in table and table[i].peer and table[i].peer not in held
            ]
            if not outside:
                return
            if time.monotonic() > deadline:
                raise SnapshotError(
                    "The kernel still holds connections to processes outside it "
                    f"(unix sockets {sorted(outside)[:5]}), so CRIU cannot dump it.",
                    hint="Close connections to outside processes in the kernel and retry.",
                )
            await asyncio.sleep(0.0005)
