"""The relay: messages between jupyter_server's channels and the inner kernel's.

Requests from the server are checked against the connection's key and passed on unsigned
(the kernel holds no secret); what the kernel sends is signed and passed out. Nothing
blocks the wrapper's loop: a message that cannot go now waits, in order, in a backlog. On
the way the relay keeps what the wrapper must know without asking the kernel (activity,
execution state, kernel info, the cell running), and after a restore it carries the cell
the kernel resumes to clients that connect later.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import logging
import os
import secrets
import socket
import time
from typing import Any

import zmq
import zmq.asyncio
from jupyter_client.session import DELIM, Session

from jupyter_ext.core import proctree, sockdiag
from jupyter_ext.core.errors import SnapshotError

from .channels import (
    REQUEST_CHANNELS,
    InnerChannels,
    ServerChannels,
    receive_ready,
    send_now,
    take_all,
)

log = logging.getLogger("kernel_wrapper")

#: How long the wrapper waits for the inner kernel to drop its connections before a dump.
DISCONNECT_TIMEOUT = 5.0
#: How long the last forwarded requests get to leave our sockets before we half-close.
DISCONNECT_FLUSH = 0.002

Route = tuple[str, str]
"""("server" or "inner", channel name): where a message goes."""


class Relay:
    """Pumps between ``server`` and ``inner`` (the inner channels, None while no kernel is
    connected), started and stopped by the wrapper's state (see ``start``)."""

    #: execute_requests remembered without a reply (replies lost with a killed kernel).
    MAX_EXECUTING = 1000
    #: Shell clients remembered (routing ids of recent requests), for a resumed reply.
    MAX_SHELL_PEERS = 64
    #: Messages of a resumed request kept for clients that subscribe later.
    MAX_RESUMED_OUTPUT = 10_000
    #: Metadata key of a message published again for a later subscriber: the original
    #: message's id (a replay has its own id, since clients refuse a repeated signature).
    REPLAY_OF = "kernel_snapshots_replay_of"

    def __init__(self, session: Session, server: ServerChannels) -> None:
        self.session = session
        self.server = server
        self.inner: InnerChannels | None = None
        self.kernel_info: dict[str, Any] = {}
        self.execution_state = "starting"
        self.last_activity = time.time()
        self.executions_since_snapshot = 0
        self.longest_cell_since_snapshot = 0.0
        """Seconds of the longest cell that finished since the last snapshot: the server's
        long-cell policy snapshots after one past its threshold."""
        self.resumed_request: dict[str, Any] | None = None
        """The request a restored kernel was running at its snapshot, while it still runs."""
        self._open = False
        """Whether requests go to the kernel now (else they wait in the backlog)."""
        self._pumps: list[asyncio.Task[None]] = []
        self._held: dict[str, list[list[bytes]]] = {name: [] for name in REQUEST_CHANNELS}
        self._backlog: dict[Route, collections.deque[list[bytes]]] = {}
        self._flushers: dict[Route, asyncio.Task[None]] = {}
        self._executing: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        """execute_requests the kernel got and has not answered, oldest (running) first:
        {"header", "cell_id", "execution_count"} by msg_id."""
        self._resumed_output: collections.deque[list[bytes]] = collections.deque(
            maxlen=self.MAX_RESUMED_OUTPUT
        )
        """What the resumed request published since the restore, for clients yet to come."""
        self._shell_peers: collections.OrderedDict[tuple[bytes, ...], None] = (
            collections.OrderedDict()
        )
        """Routing ids of recent shell clients, newest last."""

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
                    if checked is not None and not self._answer_kernel_info(name, checked):
                        self._observe(name, checked, False)
                        self.send(("inner", name), checked)
                held.clear()
        pumps = [(name, inner[name], self.server[name], True) for name in REQUEST_CHANNELS]
        pumps.append(("iopub", inner["iopub"], self.server["iopub"], True))
        pumps.append(("fork_pipe", inner["fork_pipe"], self.server["iopub"], True))
        if requests:
            pumps += [(name, self.server[name], inner[name], False) for name in REQUEST_CHANNELS]
        for name, source, sink, outward in pumps:
            self._pumps.append(asyncio.create_task(self._pump(name, source, sink, outward)))

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
                    if name == "fork_pipe":
                        frames = frames[1:]  # the kernel's pipe uuid
                    checked = self.sign(frames) if outward else self.unsign(name, frames)
                    if checked is None or (not outward and self._answer_kernel_info(name, checked)):
                        continue
                    if outward and self.resumed_request is not None:
                        if name == "shell":
                            self._copy_resumed_reply(checked)
                        elif name in ("iopub", "fork_pipe"):
                            self._keep_resumed_output(checked)
                    self._observe(name, checked, outward)
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
                    if frames and frames[0][:1] == b"\x01" and self.resumed_request:
                        self._announce_resumed()
                        for kept in self._resumed_output:
                            self.send(("server", "iopub"), self._replay(kept))

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

    # ------------------------------------------------------------------ what passes

    def _observe(self, name: str, frames: list[bytes], reply: bool) -> None:
        """Keep what the wrapper must know without the kernel: activity, state, kernel info."""
        try:
            header_at = frames.index(DELIM)
        except ValueError:
            return
        header = frames[header_at + 2] if len(frames) > header_at + 2 else b""
        if name == "shell" and not reply and b'"execute_request"' in header:
            self.last_activity = time.time()
            self.executions_since_snapshot += 1
            with contextlib.suppress(ValueError, IndexError, KeyError, TypeError):
                self._track_execute(frames[header_at + 2], frames[header_at + 4])
        elif name == "shell" and reply and b'"execute_reply"' in header:
            with contextlib.suppress(ValueError, IndexError, KeyError, TypeError):
                done = json.loads(frames[header_at + 3])["msg_id"]
                finished = self._executing.pop(done, None)
                if finished is not None and "started" in finished:
                    seconds = time.monotonic() - finished.pop("started")
                    self.longest_cell_since_snapshot = max(
                        self.longest_cell_since_snapshot, seconds
                    )
                if self.resumed_request and self.resumed_request["header"]["msg_id"] == done:
                    self.resumed_request = None
                    self._resumed_output.clear()
        elif name == "iopub" and b'"execute_input"' in header:
            with contextlib.suppress(ValueError, IndexError, KeyError, TypeError):
                running = self._executing.get(json.loads(frames[header_at + 3])["msg_id"])
                if running is not None:
                    content = json.loads(frames[header_at + 5])
                    running["execution_count"] = content.get("execution_count")
                    running["started"] = time.monotonic()  # queued cells wait before it
        elif name == "iopub" and b'"status"' in header:
            with contextlib.suppress(ValueError, IndexError, KeyError):
                content = json.loads(frames[header_at + 5])
                self.execution_state = content["execution_state"]
                self.last_activity = time.time()
        elif reply and b'"kernel_info_reply"' in header:
            with contextlib.suppress(ValueError, IndexError):
                self.kernel_info = json.loads(frames[header_at + 5])

    def _track_execute(self, header: bytes, metadata: bytes) -> None:
        """Remember an execute_request the kernel got, for the snapshot's record of the
        running cell (and the cell a restored kernel resumes)."""
        parsed = json.loads(header)
        cell_id = json.loads(metadata).get("cellId") if metadata else None
        self._executing[parsed["msg_id"]] = {
            "header": parsed,
            "cell_id": cell_id if isinstance(cell_id, str) else None,
            "execution_count": None,
        }
        while len(self._executing) > self.MAX_EXECUTING:
            self._executing.popitem(last=False)

    def running_request(self) -> dict[str, Any] | None:
        """The execute_request the kernel is running (the oldest without a reply)."""
        if not self._executing:
            return None
        running = dict(next(iter(self._executing.values())))
        running.pop("started", None)
        return running

    def snapshot_taken(self) -> None:
        """A snapshot (or a restore) holds everything up to now."""
        self.executions_since_snapshot = 0
        self.longest_cell_since_snapshot = 0.0

    # ------------------------------------------------------------------ a resumed cell

    def resume_request(self, running: dict[str, Any] | None) -> None:
        """After a restore: the request the kernel was running at its snapshot goes on.

        Its client may be gone (another node, a new server): a new one must learn that the
        kernel is busy with it, and must not wait for the kernel_info_reply that jupyter_server
        asks for on the shell channel before it opens a websocket (the kernel answers shell
        only once the cell ends). So, while that request runs, the wrapper answers
        kernel_info itself and announces "busy" for it to every new subscriber.
        """
        self._executing.clear()
        self._resumed_output.clear()
        self.resumed_request = running
        if running is not None:
            self._executing[running["header"]["msg_id"]] = running
            self._announce_resumed()

    def _announce_resumed(self) -> None:
        """Publish a "busy" status whose parent is the resumed request."""
        if self.resumed_request is None:
            return
        msg = self.session.msg(
            "status", {"execution_state": "busy"}, parent={"header": self.resumed_request["header"]}
        )
        frames = self.session.serialize(msg)
        self.execution_state = "busy"
        self.send(("server", "iopub"), frames)

    def _replay(self, frames: list[bytes]) -> list[bytes]:
        """A kept message of the resumed request as a new message (own id and signature)
        that names the original in its metadata, so a client shows it once."""
        at = frames.index(DELIM)
        header = json.loads(frames[at + 2])
        metadata = json.loads(frames[at + 4]) if frames[at + 4] else {}
        metadata[self.REPLAY_OF] = header["msg_id"]
        header["msg_id"] = secrets.token_hex(16)
        fresh = [*frames[: at + 2], json.dumps(header).encode(), frames[at + 3]]
        fresh += [json.dumps(metadata).encode(), *frames[at + 5 :]]
        return self.sign(fresh)

    def _keep_resumed_output(self, frames: list[bytes]) -> None:
        """Keep what the resumed request publishes: a client of the restored kernel
        subscribes only after the restore (the notebook connects once the restore job is
        done, on another node too), and an XPUB drops what it published before; each new
        subscriber gets it again (see _replay)."""
        assert self.resumed_request is not None
        with contextlib.suppress(ValueError, IndexError, KeyError, TypeError):
            at = frames.index(DELIM)
            parent = json.loads(frames[at + 3])
            if parent.get("msg_id") == self.resumed_request["header"]["msg_id"]:
                self._resumed_output.append(frames)

    def _copy_resumed_reply(self, frames: list[bytes]) -> None:
        """The reply of a resumed request goes to its own client, which is gone after a
        restore elsewhere: copy it to every shell client that asked something since."""
        assert self.resumed_request is not None
        at = frames.index(DELIM)
        with contextlib.suppress(ValueError, IndexError, KeyError, TypeError):
            parent = json.loads(frames[at + 3])
            if parent["msg_id"] != self.resumed_request["header"]["msg_id"]:
                return
            for peer in self._shell_peers:
                if list(peer) != frames[:at]:
                    self.send(("server", "shell"), [*peer, *frames[at:]])

    def _answer_kernel_info(self, name: str, frames: list[bytes]) -> bool:
        """For each request from a client: remember who asks on shell, and answer a shell
        kernel_info_request from the recorded kernel info while a resumed cell runs (see
        resume_request). False: the kernel gets the request."""
        if name != "shell":
            return False
        at = frames.index(DELIM)
        peer = tuple(frames[:at])
        self._shell_peers[peer] = None
        self._shell_peers.move_to_end(peer)
        while len(self._shell_peers) > self.MAX_SHELL_PEERS:
            self._shell_peers.popitem(last=False)
        if self.resumed_request is None or not self.kernel_info:
            return False
        if b'"kernel_info_request"' not in frames[at + 2]:
            return False
        with contextlib.suppress(ValueError):
            parent = {"header": json.loads(frames[at + 2])}
            reply = self.session.msg("kernel_info_reply", self.kernel_info, parent=parent)
            self.send(("server", "shell"), self.session.serialize(reply, ident=frames[:at]))
            return True
        return False

    # ------------------------------------------------------------------ the inner channels

    def connect_inner(self, inner: InnerChannels) -> None:
        self.inner = inner

    async def close_inner(self) -> None:
        """Close the inner channels (a kernel that is gone, or about to be replaced)."""
        if self.inner is not None:
            inner, self.inner = self.inner, None
            await asyncio.to_thread(inner.close)

    async def disconnect(self, inner_pid: int) -> None:
        """Drop every connection between the wrapper and the kernel, losing no message.

        CRIU cannot dump a unix socket connected to a process outside the dumped tree. The
        kernel's sockets connect to ours and keep their own queues while disconnected, so
        the kernel keeps running while this happens:

        1. no requests are forwarded any more (they wait in the server-facing sockets),
           and our last ones get a moment to leave;
        2. our endpoints are unlinked, so the kernel cannot reconnect before the dump;
        3. our end of each connection is half-closed (SHUT_WR): the kernel reads what we
           sent, sees EOF and closes its end, while we still read what it sends;
        4. once the kernel has closed every connection, our side has received all of it:
           forward the rest and close our sockets.
        """
        assert self.inner is not None
        await asyncio.sleep(DISCONNECT_FLUSH)
        self.inner.unlink_endpoints()
        inner_sockets: set[int] = set()
        for pid in proctree.descendants(inner_pid):
            inner_sockets |= sockdiag.socket_inodes(pid)
        table = sockdiag.unix_sockets()
        ours = {i for i in sockdiag.socket_inodes("self") if i in table}
        connections = {i for i in ours if table[i].peer in inner_sockets}
        for fd, inode in sockdiag.socket_fds("self").items():
            if inode in connections:
                # A duplicate of libzmq's descriptor: shutdown acts on the shared socket.
                with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as half:
                    half.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + DISCONNECT_TIMEOUT
        while connections & sockdiag.socket_inodes("self"):
            if time.monotonic() > deadline:
                log.warning("the kernel did not close its connections; closing ours")
                break
            await asyncio.sleep(0.0005)
        self.stop()
        await asyncio.sleep(0)  # let the cancelled pumps let go of their sockets
        for name, sock in self.inner.sockets.items():
            for frames in take_all(sock):
                if name == "fork_pipe":
                    frames = frames[1:]
                frames = self.sign(frames)
                self._observe(name, frames, reply=True)
                self.send(("server", "iopub" if name == "fork_pipe" else name), frames)
        await self.close_inner()
        await self._wait_disconnected(inner_pid)

    @staticmethod
    async def _wait_disconnected(inner_pid: int) -> None:
        """Wait until no socket of the kernel's tree is connected to a process outside it."""
        deadline = time.monotonic() + DISCONNECT_TIMEOUT
        while True:
            held: set[int] = set()
            for pid in proctree.descendants(inner_pid):
                held |= sockdiag.socket_inodes(pid)
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
