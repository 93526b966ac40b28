"""The wrapper's ZMQ sockets: the server-facing channels it keeps for its whole life, the
channels to the inner kernel that come and go with it, and the few socket calls that are
safe between asyncio and libzmq."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from jupyter_ext.core.errors import SnapshotError
from jupyter_ext.core.protocol.inner import AGENT_PORT, INNER_PORTS

#: The routing id of the wrapper's sockets toward the inner kernel, the same forever,
#: so replies the kernel routes after a restore still reach us.
INNER_ROUTING_ID = b"kernel-snapshot-wrapper"
#: The Jupyter channels the wrapper relays (the heartbeat it answers itself).
REQUEST_CHANNELS = ("shell", "stdin", "control")
#: How many messages the server-facing IOPub socket queues for each subscriber before it
#: drops what that one cannot take (ZeroMQ's PUB behaviour; its default is 1,000). The
#: relay forwards what the kernel sent in bursts (all that waits at once, more after a
#: snapshot, while the wrapper also hashes), which must not overflow a queue that its own
#: I/O thread has not emptied yet: only a subscriber this far behind loses output.
SERVER_IOPUB_HWM = 100_000

Route = tuple[str, str]
"""("server" or "inner", channel name): where a message goes."""

_TWINS: weakref.WeakKeyDictionary[zmq.asyncio.Socket, zmq.Socket[bytes]] = (
    weakref.WeakKeyDictionary()
)


def sync_socket(sock: zmq.asyncio.Socket) -> zmq.Socket[bytes]:
    """The blocking twin of an asyncio socket (same libzmq socket), for calls that must not
    be interrupted by a cancellation."""
    twin = _TWINS.get(sock)
    if twin is None:
        twin = _TWINS[sock] = zmq.Socket.shadow(sock.underlying)
    return twin


def send_now(sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
    """Send at once or raise zmq.Again, through the blocking twin (no cancellation can cut
    a message in half).

    libzmq wakes asyncio through an edge-triggered descriptor, and any call on the socket,
    this send too, may consume the wake-up of a message that arrived meanwhile: a task
    waiting to receive on the same socket would then sleep forever beside a waiting
    message (a kernel's reply never forwarded). Asking the asyncio socket for its events
    afterwards schedules that task again, as pyzmq's own send does.
    """
    try:
        sync_socket(sock).send_multipart(frames, zmq.NOBLOCK)
    finally:
        sock.get(zmq.EVENTS)


def take_all(sock: zmq.asyncio.Socket) -> list[list[bytes]]:
    """Every message waiting on ``sock``, without waiting."""
    sync = sync_socket(sock)
    batch: list[list[bytes]] = []
    while True:
        try:
            batch.append(sync.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return batch


async def receive_ready(sock: zmq.asyncio.Socket) -> list[list[bytes]]:
    """Wait until ``sock`` has messages, then take them all without awaiting again.

    A task cancelled while it waits loses nothing (the messages stay in the socket); once
    messages are taken, the caller handles them without an await, so a cancellation can
    never fall between taking a message and passing it on.
    """
    await sock.poll()  # POLLIN
    return take_all(sock)


class PortInUseError(SnapshotError):
    """A port of the connection file is taken: jupyter_client picks free ports and closes
    them, and another process may take one (an outgoing connection's local port) before
    the kernel binds it. Its restarter starts a kernel that never came up again on new
    ports, as it does for ipykernel."""

    code = "port-in-use"


class ServerChannels:
    """The channels jupyter_server connects to, bound from the connection file: shell,
    stdin and control (ROUTER), iopub (XPUB), and the heartbeat, which echoes in a thread
    of its own whatever the kernel does."""

    def __init__(self, connection: dict[str, Any]) -> None:
        self.connection = connection
        self.context = zmq.asyncio.Context()
        url = f"{connection.get('transport', 'tcp')}://{connection['ip']}"
        self.sockets: dict[str, zmq.asyncio.Socket] = {}
        for name, kind in (
            ("shell", zmq.ROUTER),
            ("stdin", zmq.ROUTER),
            ("control", zmq.ROUTER),
            ("iopub", zmq.XPUB),
        ):
            sock = self.context.socket(kind)
            sock.setsockopt(zmq.LINGER, 1000)
            self._apply_curve(sock)
            if kind == zmq.XPUB:
                sock.setsockopt(zmq.XPUB_VERBOSE, 1)
                sock.setsockopt(zmq.SNDHWM, SERVER_IOPUB_HWM)
            else:
                sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            if url.startswith("ipc://"):
                only_this_user(sock)
            self._bind(sock, url, name)
            self.sockets[name] = sock
        hb_context = zmq.Context()
        hb = hb_context.socket(zmq.ROUTER)
        hb.setsockopt(zmq.LINGER, 0)
        self._apply_curve(hb)
        if url.startswith("ipc://"):
            only_this_user(hb)
        self._bind(hb, url, "hb")
        threading.Thread(target=self._heartbeat, args=(hb,), daemon=True, name="hb").start()

    def __getitem__(self, name: str) -> zmq.asyncio.Socket:
        return self.sockets[name]

    def _apply_curve(self, sock: zmq.Socket[Any]) -> None:
        """CurveZMQ on the server-facing channels when the server provisioned keys."""
        secret = self.connection.get("curve_secretkey")
        if secret:
            sock.curve_secretkey = secret.encode("ascii")
            sock.curve_publickey = self.connection["curve_publickey"].encode("ascii")
            sock.curve_server = True

    def _bind(self, sock: zmq.Socket[Any], url: str, name: str) -> None:
        port = self.connection[f"{name}_port"]
        try:
            sock.bind(self._endpoint(url, port))
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise PortInUseError(
                f"The kernel's {name} port, {url}:{port} (from the connection file), is in "
                "use by another process.",
                hint="The server starts the kernel again on new ports; if it does not, "
                "restart the kernel.",
            ) from exc

    @staticmethod
    def _endpoint(url: str, port: int) -> str:
        return f"{url}-{port}" if url.startswith("ipc://") else f"{url}:{port}"

    @staticmethod
    def _heartbeat(sock: zmq.Socket[bytes]) -> None:
        with contextlib.suppress(zmq.ContextTerminated):
            zmq.proxy(sock, sock)


def only_this_user(sock: zmq.Socket[Any]) -> None:
    """Accept ipc connections from this user's processes only: libzmq checks each one's
    SO_PEERCRED (ZMQ_IPC_FILTER_UID), whatever the endpoint's mode would let in."""
    sock.setsockopt(zmq.IPC_FILTER_UID, os.geteuid())


class InnerChannels:
    """The wrapper's ends of the channels to the inner kernel, bound in the runtime dir;
    ``received`` holds (epoch, number) of the last numbered message received on each
    channel (kernel_wrapper.inkernel.gate)."""

    def __init__(self, runtime_dir: Path) -> None:
        self.context = zmq.asyncio.Context()
        self.received: dict[str, tuple[int, int]] = {}
        self.sockets: dict[str, zmq.asyncio.Socket] = {}
        for name in REQUEST_CHANNELS:
            sock = self.context.socket(zmq.DEALER)
            sock.setsockopt(zmq.ROUTING_ID, INNER_ROUTING_ID)
            self.sockets[name] = sock
        iopub = self.context.socket(zmq.XSUB)
        self.sockets["iopub"] = iopub
        # Output of forked subprocesses: [pipe uuid, *iopub message]
        # (kernel_wrapper.inkernel.inner).
        self.sockets["fork_pipe"] = self.context.socket(zmq.PULL)
        self.paths: list[Path] = []
        for name, sock in self.sockets.items():
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, 0)  # never block the wrapper's loop on a send
            path = runtime_dir / f"ch-{INNER_PORTS[name]}"
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            only_this_user(sock)
            sock.bind(f"ipc://{path}")
            self.paths.append(path)
        iopub.send(b"\x01")  # subscribe to everything the kernel publishes
        # The kernel's snapshot agent (kernel_wrapper.inkernel.agent): not a Jupyter channel.
        self.agent = self.context.socket(zmq.DEALER)
        self.agent.setsockopt(zmq.LINGER, 0)
        agent_path = runtime_dir / f"ch-{AGENT_PORT}"
        with contextlib.suppress(FileNotFoundError):
            agent_path.unlink()
        only_this_user(self.agent)
        self.agent.bind(f"ipc://{agent_path}")
        self.paths.append(agent_path)
        self._agent_requests = 0
        self._agent_lock = asyncio.Lock()

    async def ask_agent(self, op: str, timeout: float, **args: Any) -> dict[str, Any]:
        """One request to the kernel's snapshot agent (one at a time: each waits for its
        own answer), once the agent is connected; an answer with "error" if it does not
        connect or answer in time."""
        deadline = time.monotonic() + timeout
        async with self._agent_lock:
            self._agent_requests += 1
            request_id = self._agent_requests
            # A bound DEALER takes a message once a peer is connected: the agent of a kernel
            # just started or restored connects within its reconnect interval.
            left = max(0.0, deadline - time.monotonic())
            # (pyzmq's stub lacks the flags argument its asyncio poll takes.)
            if not await self.agent.poll(left * 1000, zmq.POLLOUT):  # type: ignore[call-arg]
                # The kernel's agent connects within its reconnect interval (<= 0.2 s),
                # whatever its code does: one that does not in that time is not there.
                return {
                    "error": f"the kernel's snapshot agent did not connect in {timeout:g} s",
                    "absent": True,
                }
            await self.agent.send_json({**args, "id": request_id, "op": op}, zmq.NOBLOCK)
            while (left := deadline - time.monotonic()) > 0:
                if not await self.agent.poll(left * 1000):
                    break
                reply = await self.agent.recv_json()
                if isinstance(reply, dict) and reply.get("id") == request_id:
                    return reply  # earlier answers that came too late are dropped
            return {"error": f"the kernel's snapshot agent did not answer within {timeout:g} s"}

    def unlink_endpoints(self) -> None:
        """Make the endpoints unreachable (a unix socket is found by its path) while the
        sockets, and the connections already made, stay."""
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def close(self) -> None:
        """Close every socket and wait until libzmq has really closed their descriptors."""
        for sock in [*self.sockets.values(), self.agent]:
            sock.close()
        self.context.term()
