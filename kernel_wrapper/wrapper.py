"""The kernel wrapper: one stable kernel for jupyter_server, a dumpable kernel inside.

jupyter_server starts the wrapper with the kernel's connection file. The wrapper binds the
five server-facing channels and keeps them for its whole life, while the process that
really computes (the *inner* kernel, see :mod:`kernel_wrapper.inner`) runs in its own PID
and time namespaces and is dumped, killed and restored underneath. Messages pass through
unchanged in both directions, so their signatures stay valid.

Snapshots and restores are asked for over a private control socket
(:mod:`jupyter_ext.core.protocol`). A dump goes like this:

1. stop forwarding requests from the server (they wait in the server-facing sockets);
2. unlink the inner endpoints and half-close the wrapper's end of every connection: the
   kernel reads what we sent, sees EOF and closes its end, while we read everything it
   sent; its sockets go back to reconnecting, keeping new messages queued inside it
   (see ``_disconnect_inner``); the kernel never stops running;
3. ``criu dump --leave-running`` (the kernel is frozen only while CRIU seizes it and
   copies its memory);
4. bind the inner channels again: the kernel reconnects and delivers what it queued;
5. hash the images and write the manifest, while the kernel runs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import enum
import errno
import hmac
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, NoReturn

import zmq
import zmq.asyncio
from jupyter_client.session import DELIM, Session

from jupyter_ext import __version__
from jupyter_ext.core import netports, proctree, sockdiag
from jupyter_ext.core.compat import check_compatible
from jupyter_ext.core.criu import Criu, LazyTransfer, external_file_key, unprivileged
from jupyter_ext.core.errors import (
    IncompatibleSnapshotError,
    KernelNotRunningError,
    RestoreError,
    SnapshotBusyError,
    SnapshotError,
)
from jupyter_ext.core.gpu import (
    GpuCheckpoint,
    GpuCheckpointer,
    find_cuda_processes,
    gpu_record,
    kernel_gpu_status,
    open_backend,
    plan_gpu_pairs,
)
from jupyter_ext.core.growinghash import GrowingFileHasher
from jupyter_ext.core.lazypages import (
    DirectoryPages,
    page_source,
    stage_pages_files,
    worth_lazy,
)
from jupyter_ext.core.manifest import (
    IMAGES_DIR,
    Manifest,
    new_snapshot_id,
    remove_tree,
    seal,
    utc_now,
    verify,
)
from jupyter_ext.core.protocol import (
    AGENT_PORT,
    DEFAULT_RUNTIME_ROOT,
    ENV_INNER_DIR,
    ENV_LAZY_RESTORE,
    INNER_PORTS,
    OPERATIONS,
    KernelStatus,
    ProgressCallback,
    ProgressEvent,
    Restored,
    RestoreRequest,
    ResumeArgs,
    SnapshotArgs,
    StatusArgs,
    SuspendArgs,
    WrapperInfo,
    info_path,
    socket_path,
)
from kernel_snapshots import write_restore_info

log = logging.getLogger("kernel_wrapper")

#: Inner channel "ports": the inner kernel connects to ``ipc://<runtime dir>/ch-<port>``.
#: How long the kernel's snapshot agent gets to release GPU caches before a checkpoint.
AGENT_TIMEOUT = 10.0
#: The routing id of the wrapper's sockets toward the inner kernel, the same forever,
#: so replies the kernel routes after a restore still reach us.
INNER_ROUTING_ID = b"kernel-snapshot-wrapper"
#: How long the wrapper waits for the inner kernel to drop its connections before a dump.
DISCONNECT_TIMEOUT = 5.0
#: How long the last forwarded requests get to leave our sockets before we half-close.
DISCONNECT_FLUSH = 0.002


class State(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    SNAPSHOTTING = "snapshotting"
    RESTORING = "restoring"
    DEAD = "dead"
    """The inner kernel died; the wrapper waits for a restore (``--on-inner-death=wait``)."""
    SUSPENDED = "suspended"
    """The inner kernel was dumped and stopped; it comes back on the next request."""
    STOPPING = "stopping"


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


class InnerChannels:
    """The wrapper's ends of the channels to the inner kernel, bound in the runtime dir."""

    def __init__(self, runtime_dir: Path) -> None:
        self.context = zmq.asyncio.Context()
        self.sockets: dict[str, zmq.asyncio.Socket] = {}
        for name in ("shell", "stdin", "control"):
            sock = self.context.socket(zmq.DEALER)
            sock.setsockopt(zmq.ROUTING_ID, INNER_ROUTING_ID)
            self.sockets[name] = sock
        iopub = self.context.socket(zmq.XSUB)
        self.sockets["iopub"] = iopub
        # Output of forked subprocesses: [pipe uuid, *iopub message] (kernel_wrapper.inner).
        self.sockets["fork_pipe"] = self.context.socket(zmq.PULL)
        self.paths: list[Path] = []
        for name, sock in self.sockets.items():
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, 0)  # never block the wrapper's loop on a send
            path = runtime_dir / f"ch-{INNER_PORTS[name]}"
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            sock.bind(f"ipc://{path}")
            self.paths.append(path)
        iopub.send(b"\x01")  # subscribe to everything the kernel publishes
        # The kernel's snapshot agent (kernel_wrapper.agent): not a Jupyter channel.
        self.agent = self.context.socket(zmq.DEALER)
        self.agent.setsockopt(zmq.LINGER, 0)
        agent_path = runtime_dir / f"ch-{AGENT_PORT}"
        with contextlib.suppress(FileNotFoundError):
            agent_path.unlink()
        self.agent.bind(f"ipc://{agent_path}")
        self.paths.append(agent_path)
        self._agent_requests = 0

    async def ask_agent(self, op: str, timeout: float) -> dict[str, Any]:
        """One request to the kernel's snapshot agent; an answer with "error" if it is not
        there (a kernel restored from an older snapshot) or does not answer in time."""
        self._agent_requests += 1
        request_id = self._agent_requests
        try:
            await self.agent.send_json({"id": request_id, "op": op}, zmq.NOBLOCK)
        except zmq.Again:
            return {"error": "the kernel has no snapshot agent connected"}
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not await self.agent.poll(left * 1000):
                break
            reply = await self.agent.recv_json()
            if isinstance(reply, dict) and reply.get("id") == request_id:
                return reply  # earlier answers that came too late are dropped
        return {"error": f"the kernel's snapshot agent did not answer within {timeout:.0f} s"}

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


def _with_fate(exc: SnapshotError, inner_pid: int) -> SnapshotError:
    """A failed dump's error, saying what became of the kernel: only what is true."""
    if proctree.is_alive(inner_pid):
        fate = "The kernel keeps running unharmed."
    else:
        fate = (
            "The kernel's process ended during the snapshot: what it held since its last "
            "snapshot is gone; restore that snapshot, or restart the kernel."
        )
    return type(exc)(f"{exc.message} {fate}", hint=exc.hint, log_excerpt=exc.log_excerpt)


@dataclasses.dataclass
class _SavedKernel:
    """A running kernel dumped before a restore in place replaces it (see _restore)."""

    directory: Path
    sequence: int
    parent_snapshot: str | None
    executions_since_snapshot: int


#: A runtime directory without ``wrapper.pid`` this old (seconds) was left by a wrapper
#: that died while making it; a younger one is being made right now.
STALE_UNNAMED_SECONDS = 3600.0


def runtime_dir_in_use(directory: Path) -> bool:
    """Whether a live wrapper owns a runtime directory, by its ``wrapper.pid`` ("PID DIRFD").

    Live means: process PID runs ``kernel_wrapper`` and holds this very directory open at
    DIRFD (that survives PID reuse, also by another wrapper). Anything that cannot be
    proven dead (unreadable, no permission) counts as in use.
    """
    try:
        pid_text, fd_text = (directory / "wrapper.pid").read_text().split()
        pid, fd = int(pid_text), int(fd_text)
    except FileNotFoundError:
        try:
            age = time.time() - directory.stat().st_mtime
        except FileNotFoundError:
            return True  # gone already
        return age < STALE_UNNAMED_SECONDS
    except (OSError, ValueError):
        return True
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False  # no such process
    except OSError:
        return True
    if b"kernel_wrapper" not in cmdline:
        return False  # the PID is another program's now (or a zombie's)
    try:
        theirs = os.stat(f"/proc/{pid}/fd/{fd}")
        ours = os.stat(directory)
    except FileNotFoundError:
        return False  # that wrapper does not hold it (any more)
    except OSError:
        return True
    return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)


def remove_stale_runtime_dirs(root: Path) -> list[Path]:
    """Remove the runtime directories of wrappers that died without removing their own
    (kill -9, a node's processes killed, an OOM kill); they would stay forever. Called by
    every wrapper that starts; live wrappers' directories are never touched."""
    removed: list[Path] = []
    for directory in root.iterdir():
        if directory.is_symlink() or not directory.is_dir():
            continue
        if not runtime_dir_in_use(directory):
            log.info("removing the runtime directory of a dead wrapper: %s", directory)
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed


class KernelWrapper:
    def __init__(
        self,
        connection_file: Path,
        *,
        runtime_root: Path = DEFAULT_RUNTIME_ROOT,
        on_inner_death: str = "exit",
        criu_path: str | None = None,
        restore: RestoreRequest | None = None,
        kernel_args: list[str] | None = None,
    ) -> None:
        self.connection_file = connection_file.resolve()
        self.connection = json.loads(connection_file.read_text())
        self.session = Session(
            key=self.connection["key"].encode(),
            signature_scheme=self.connection.get("signature_scheme", "hmac-sha256"),
        )
        self.runtime_root = runtime_root
        self.on_inner_death = on_inner_death
        self.criu_path = criu_path
        self.restore = restore
        """Start by restoring this instead of launching a fresh kernel."""
        self.kernel_args = kernel_args or []
        self.state = State.STARTING
        self.lineage = secrets.token_hex(8)
        self.runtime_dir = runtime_root / secrets.token_hex(8)
        self._dir_fd = self._make_runtime_dir()
        self.sequence = 0
        self.parent_snapshot: str | None = None
        self._announced = False
        self._inner_pid: int | None = None
        self.launcher: subprocess.Popen[bytes] | None = None
        self.kernel_info: dict[str, Any] = {}
        self.execution_state = "starting"
        self.last_activity = time.time()
        self.executions_since_snapshot = 0
        self.exit_code: int | None = None
        self._expected_exit = False
        self._op_lock = asyncio.Lock()
        self._inner: InnerChannels | None = None
        self._pumps: list[asyncio.Task[None]] = []
        self._stand_in: list[asyncio.Task[None]] = []
        self._held: dict[str, list[list[bytes]]] = {"shell": [], "stdin": [], "control": []}
        self._backlog: dict[tuple[str, str], collections.deque[list[bytes]]] = {}
        self._flushers: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._done = asyncio.Event()
        self._pidfd: int | None = None
        self._stdio_r, self._stdio_w = os.pipe()
        os.set_blocking(self._stdio_r, False)
        self._criu: Criu | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._gpu_checkpointer: GpuCheckpointer | None = None
        self.last_gpu_restore: dict[str, Any] = {}
        """Timings of the CUDA restore of the last restore (empty without CUDA)."""
        self.suspended_snapshot: Path | None = None
        """The snapshot a suspended kernel comes back from."""
        self._discard_after_resume = False
        self.lazy_restore = os.environ.get(ENV_LAZY_RESTORE, "1") != "0"
        """Restore with CRIU's lazy pages where the machine supports it (the server's
        SnapshotExtensionApp.lazy_restore trait, through the environment)."""
        self._lazy_supported: bool | None = None
        self._lazy: LazyTransfer | None = None
        self._lazy_task: asyncio.Task[None] | None = None
        self.lazy_status: dict[str, Any] = {}
        """The last lazy restore: state (transferring/complete/failed), bytes, error."""
        self._control_path = self.runtime_dir / "control"
        self._executing: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        """execute_requests the kernel got and has not answered, oldest (running) first:
        {"header", "cell_id", "execution_count"} by msg_id."""
        self.resumed_request: dict[str, Any] | None = None
        """The request a restored kernel was running at its snapshot, while it still runs."""
        self._resumed_output: collections.deque[list[bytes]] = collections.deque(
            maxlen=self.MAX_RESUMED_OUTPUT
        )
        """What the resumed request published since the restore, for clients yet to come."""
        self._shell_peers: collections.OrderedDict[tuple[bytes, ...], None] = (
            collections.OrderedDict()
        )
        """The request a restored kernel was running at its snapshot, while it still runs."""

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        """Serve until the kernel is shut down; returns the process exit code."""
        loop = asyncio.get_running_loop()
        self._bind_server_channels()
        loop.add_reader(self._stdio_r, self._forward_stdio)
        loop.add_signal_handler(signal.SIGINT, self._interrupt)
        loop.add_signal_handler(signal.SIGTERM, self._terminate)
        with socket_path(self._control_path) as address:
            server = await asyncio.start_unix_server(self._handle_control, path=address)
        os.chmod(self._control_path, 0o600)
        self._announced = True
        self._announce()
        self._subscription_task = asyncio.create_task(self._forward_subscriptions())
        self._watch_parent()
        try:
            if self.restore is not None:
                await self._restore(
                    self.restore.source,
                    lambda _: None,
                    verified=self.restore.verified,
                    pages_from=self.restore.pages_from,
                )
            else:
                await self._launch_inner()
            await self._done.wait()
        finally:
            server.close()
            await self._shutdown_inner()
            with contextlib.suppress(OSError):
                info_path(self.connection_file).unlink()
            self._remove_runtime_dir()
        return self.exit_code or 0

    def _bind_server_channels(self) -> None:
        c = self.connection
        self.context = zmq.asyncio.Context()
        url = f"{c.get('transport', 'tcp')}://{c['ip']}"
        self.server: dict[str, zmq.asyncio.Socket] = {}
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
            else:
                sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            sock.bind(self._endpoint(url, c[f"{name}_port"]))
            self.server[name] = sock
        # The heartbeat echoes in its own thread and context, whatever the kernel does.
        hb_context = zmq.Context()
        hb = hb_context.socket(zmq.ROUTER)
        hb.setsockopt(zmq.LINGER, 0)
        self._apply_curve(hb)
        hb.bind(self._endpoint(url, c["hb_port"]))
        threading.Thread(target=self._heartbeat, args=(hb,), daemon=True, name="hb").start()

    def _apply_curve(self, sock: zmq.Socket[Any]) -> None:
        """CurveZMQ on the server-facing channels when the server provisioned keys."""
        secret = self.connection.get("curve_secretkey")
        if secret:
            sock.curve_secretkey = secret.encode("ascii")
            sock.curve_publickey = self.connection["curve_publickey"].encode("ascii")
            sock.curve_server = True

    @staticmethod
    def _endpoint(url: str, port: int) -> str:
        return f"{url}-{port}" if url.startswith("ipc://") else f"{url}:{port}"

    @staticmethod
    def _heartbeat(sock: zmq.Socket[bytes]) -> None:
        with contextlib.suppress(zmq.ContextTerminated):
            zmq.proxy(sock, sock)

    def _make_runtime_dir(self) -> int:
        """Create this wrapper's private directory for the inner channels.

        The inner kernel reaches it only through an inherited directory descriptor
        (``/proc/self/fd/N``), never by its path: on restore CRIU hands the restored
        kernel this wrapper's descriptor in place of the old one, so any number of kernels
        restored from one snapshot can run side by side, on any machine.
        """
        self.runtime_root.mkdir(mode=0o711, parents=True, exist_ok=True)
        self.runtime_dir.mkdir(mode=0o700)
        dir_fd = os.open(self.runtime_dir, os.O_RDONLY | os.O_DIRECTORY)
        tmp = self.runtime_dir / "wrapper.pid.tmp"
        tmp.write_text(f"{os.getpid()} {dir_fd}\n")
        os.replace(tmp, self.runtime_dir / "wrapper.pid")
        try:
            remove_stale_runtime_dirs(self.runtime_root)
        except OSError as exc:  # never a reason not to start
            log.warning("could not look for stale runtime directories: %s", exc)
        return dir_fd

    def _remove_runtime_dir(self) -> None:
        os.close(self._dir_fd)
        shutil.rmtree(self.runtime_dir, ignore_errors=True)

    @property
    def _inner_dir(self) -> str:
        """The runtime directory as the inner kernel names it."""
        return f"/proc/self/fd/{self._dir_fd}"

    def _inner_connection_file(self) -> Path:
        path = self.runtime_dir / "inner.json"
        info = {
            "transport": "ipc",
            "ip": f"{self._inner_dir}/ch",
            "key": "",  # the wrapper checks and signs every message; see _unsign
            "signature_scheme": self.connection.get("signature_scheme", "hmac-sha256"),
            "kernel_name": self.connection.get("kernel_name", ""),
        }
        info.update({f"{name}_port": port for name, port in INNER_PORTS.items()})
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(info, fh)
        return path

    async def _launch_inner(self) -> None:
        """Start a fresh inner kernel in new PID and time namespaces."""
        self._inner = InnerChannels(self.runtime_dir)
        env = dict(os.environ)
        env.pop("JPY_PARENT_PID", None)  # ipykernel would exit when its parent changes
        env[ENV_INNER_DIR] = self._inner_dir
        argv = [sys.executable, "-m", "kernel_wrapper.inner"]
        argv += ["-f", str(self._inner_connection_file()), *self.kernel_args]
        if unprivileged():
            # Without root: no namespaces (CRIU --unprivileged cannot dump a task in another
            # PID namespace), the kernel is our child (it makes itself a session leader),
            # and no parent-death signal (a restored one would fire at once). docs/nonroot.md
            self.launcher = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=self._stdio_w,
                stderr=self._stdio_w,
                env=env,
                pass_fds=(self._dir_fd,),
            )
            self.inner_pid = self.launcher.pid
            self._watch(self.launcher.pid)
            self._set_state(State.RUNNING)
            return
        ns = ["unshare", "--pid", "--fork"]
        if Path("/proc/self/ns/time").exists():
            ns.append("--time")  # monotonic clocks continue across restores elsewhere
        self.launcher = subprocess.Popen(
            ns + argv,
            stdin=subprocess.DEVNULL,
            stdout=self._stdio_w,
            stderr=self._stdio_w,
            env=env,
            pass_fds=(self._dir_fd,),
            preexec_fn=proctree.die_with_parent,
        )
        inner = await self._wait_for_child(self.launcher.pid)
        self.inner_pid = inner
        self._watch(self.launcher.pid)
        self._set_state(State.RUNNING)

    @staticmethod
    async def _wait_for_child(pid: int, timeout: float = 10.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            kids = proctree.children(pid)
            if kids:
                return kids[0]
            if not proctree.is_alive(pid):
                break
            await asyncio.sleep(0.005)
        raise KernelNotRunningError(
            "The inner kernel did not start.", hint="See the kernel's output in the server log."
        )

    def _watch(self, pid: int) -> None:
        """Call :meth:`_on_inner_exit` when ``pid`` (our child) exits."""
        loop = asyncio.get_running_loop()
        self._unwatch()
        self._pidfd = os.pidfd_open(pid)
        watched = self._pidfd

        def ready() -> None:
            if self._pidfd != watched:
                return
            self._unwatch()
            if self.launcher is not None and self.launcher.pid == pid:
                code = self.launcher.wait()
            else:
                _, status = os.waitpid(pid, 0)
                code = os.waitstatus_to_exitcode(status)
            self._on_inner_exit(code)

        loop.add_reader(watched, ready)

    def _unwatch(self) -> None:
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def _on_inner_exit(self, code: int) -> None:
        self.inner_pid = None
        self.launcher = None
        if self._expected_exit:
            self._expected_exit = False
            return
        if code == 0 or self.state == State.STOPPING or self.on_inner_death == "exit":
            log.info("inner kernel exited with %s; the wrapper exits too", code)
            self.exit_code = 0 if code == 0 else 1
            self._set_state(State.STOPPING)
            self._done.set()
            return
        log.warning("inner kernel died (%s); waiting for a restore", code)
        self._set_state(State.DEAD)

    async def _shutdown_inner(self) -> None:
        self._stop_pumps()
        if self.inner_pid is not None:
            self._expected_exit = True
            await self._kill_inner()
        if self._inner is not None:
            await asyncio.to_thread(self._inner.close)
            self._inner = None

    async def _kill_inner(self) -> None:
        """SIGKILL the inner tree (its namespace dies with its init) and reap it."""
        pid = self.inner_pid
        if pid is None:
            return
        self._expected_exit = True
        # Without a PID namespace (non-root) the kernel's own children do not die with it.
        tree = proctree.descendants(pid) if unprivileged() else [pid]
        for task in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(task, signal.SIGKILL)
        if self.launcher is not None:
            with contextlib.suppress(ProcessLookupError):
                self.launcher.kill()
        deadline = time.monotonic() + 10
        while self.inner_pid is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        self._expected_exit = False

    @staticmethod
    def _kill_children_except(keep: set[int]) -> None:
        """SIGKILL and reap every child process of the wrapper not in ``keep``."""
        for pid in set(proctree.children(os.getpid())) - keep:
            log.warning("removing process %d left by a failed restore", pid)
            # Without a PID namespace (non-root) its restored children would live on,
            # holding process ids the next restore needs.
            for task in proctree.descendants(pid) if unprivileged() else [pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(task, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)

    def _interrupt(self) -> None:
        """SIGINT from the server: interrupt the inner kernel's process group."""
        if self.inner_pid is not None and self.state == State.RUNNING:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.inner_pid, signal.SIGINT)

    #: How often the wrapper looks whether the server that started it is still there.
    PARENT_POLL_SECONDS = 1.0

    def _watch_parent(self) -> None:
        """End with the server that started the kernel (jupyter_client names it in
        JPY_PARENT_PID), as ipykernel does: a server killed with SIGKILL (or OOM) must not
        leave its kernels running, unreachable, for ever."""
        parent = os.environ.get("JPY_PARENT_PID", "")
        if not parent.isdigit() or int(parent) <= 1:
            return
        loop = asyncio.get_running_loop()

        def look() -> None:
            if self._done.is_set():
                return
            if os.getppid() != int(parent):
                log.warning("the server (pid %s) is gone; the kernel ends", parent)
                self._terminate()
                return
            loop.call_later(self.PARENT_POLL_SECONDS, look)

        look()

    def _terminate(self) -> None:
        self.exit_code = 0
        self._set_state(State.STOPPING)
        self._done.set()

    def _forward_stdio(self) -> None:
        with contextlib.suppress(BlockingIOError):
            data = os.read(self._stdio_r, 65536)
            if data:
                sys.stderr.buffer.write(data)
                sys.stderr.buffer.flush()

    # ------------------------------------------------------------------ forwarding

    def _set_state(self, state: State) -> None:
        """Enter ``state``: RUNNING forwards both ways; SNAPSHOTTING only what the kernel
        sends (requests wait in the server-facing sockets); DEAD and SUSPENDED answer for
        the kernel; the others forward nothing."""
        self.state = state
        self._stop_pumps()
        if state in (State.RUNNING, State.SNAPSHOTTING) and self._inner is not None:
            self._start_pumps(requests=state == State.RUNNING)
        elif state in (State.DEAD, State.SUSPENDED):
            self._start_stand_in()

    def _still(self, state: State) -> bool:
        """Whether the state is still ``state`` (it changes under awaits; mypy can't see it)."""
        return self.state == state

    def _start_pumps(self, requests: bool = True) -> None:
        assert self._inner is not None
        inner = self._inner.sockets
        if requests:
            # Requests held while the kernel was away go first, in order.
            for name, held in self._held.items():
                for frames in held:
                    checked = self._unsign(name, frames)
                    if checked is not None and not self._answer_kernel_info(name, checked):
                        self._observe(name, checked, False)
                        self._send(("inner", name), checked)
                held.clear()
        for name in ("shell", "stdin", "control"):
            if requests:
                self._pumps.append(
                    asyncio.create_task(self._pump(name, self.server[name], inner[name], False))
                )
            self._pumps.append(
                asyncio.create_task(self._pump(name, inner[name], self.server[name], True))
            )
        self._pumps.append(
            asyncio.create_task(self._pump("iopub", inner["iopub"], self.server["iopub"], True))
        )
        self._pumps.append(
            asyncio.create_task(
                self._pump("fork_pipe", inner["fork_pipe"], self.server["iopub"], True)
            )
        )

    def _stop_pumps(self) -> None:
        for task in self._pumps + self._stand_in:
            task.cancel()
        self._pumps.clear()
        self._stand_in.clear()

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
                    checked = self._sign(frames) if outward else self._unsign(name, frames)
                    if checked is None or (not outward and self._answer_kernel_info(name, checked)):
                        continue
                    if outward and self.resumed_request is not None:
                        if name == "shell":
                            self._copy_resumed_reply(checked)
                        elif name in ("iopub", "fork_pipe"):
                            self._keep_resumed_output(checked)
                    self._observe(name, checked, outward)
                    self._send(route, checked)

    def _sink(self, route: tuple[str, str]) -> zmq.asyncio.Socket | None:
        """Where a route's messages go now; None while the kernel must not get any (it is
        away, or being disconnected for a dump)."""
        side, name = route
        if side == "server":
            return self.server[name]
        if self._inner is None or self.state != State.RUNNING:
            return None
        return self._inner.sockets[name]

    def _send(self, route: tuple[str, str], frames: list[bytes]) -> None:
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

    async def _flush(self, route: tuple[str, str]) -> None:
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

    def _unsign(self, name: str, frames: list[bytes]) -> list[bytes] | None:
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

    def _sign(self, frames: list[bytes]) -> list[bytes]:
        """Sign a message from the inner kernel with the connection's key."""
        try:
            at = frames.index(DELIM)
        except ValueError:
            return frames
        if self.session.auth is None:
            return frames
        return [*frames[: at + 1], self.session.sign(frames[at + 2 : at + 6]), *frames[at + 2 :]]

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
                self._executing.pop(done, None)
                if self.resumed_request and self.resumed_request["header"]["msg_id"] == done:
                    self.resumed_request = None
                    self._resumed_output.clear()
        elif name == "iopub" and b'"execute_input"' in header:
            with contextlib.suppress(ValueError, IndexError, KeyError, TypeError):
                running = self._executing.get(json.loads(frames[header_at + 3])["msg_id"])
                if running is not None:
                    content = json.loads(frames[header_at + 5])
                    running["execution_count"] = content.get("execution_count")
        elif name == "iopub" and b'"status"' in header:
            with contextlib.suppress(ValueError, IndexError, KeyError):
                content = json.loads(frames[header_at + 5])
                self.execution_state = content["execution_state"]
                self.last_activity = time.time()
        elif reply and b'"kernel_info_reply"' in header:
            with contextlib.suppress(ValueError, IndexError):
                self.kernel_info = json.loads(frames[header_at + 5])

    #: execute_requests remembered without a reply (replies lost with a killed kernel).
    MAX_EXECUTING = 1000
    #: Shell clients remembered (routing ids of recent requests), for a resumed reply.
    MAX_SHELL_PEERS = 64
    #: Messages of a resumed request kept for clients that subscribe later.
    MAX_RESUMED_OUTPUT = 10_000

    #: Metadata key of a message published again for a later subscriber: the original
    #: message's id (a replay has its own id, since clients refuse a repeated signature).
    REPLAY_OF = "kernel_snapshots_replay_of"

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
        return self._sign(fresh)

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
                    self._send(("server", "shell"), [*peer, *frames[at:]])

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

    def _running_request(self) -> dict[str, Any] | None:
        """The execute_request the kernel is running (the oldest without a reply)."""
        return dict(next(iter(self._executing.values()))) if self._executing else None

    def _resume_request(self, running: dict[str, Any] | None) -> None:
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
        self._send(("server", "iopub"), frames)

    def _answer_kernel_info(self, name: str, frames: list[bytes]) -> bool:
        """For each request from a client: remember who asks on shell, and answer a shell
        kernel_info_request from the recorded kernel info while a resumed cell runs (see
        _resume_request). False: the kernel gets the request."""
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
            self._send(("server", "shell"), self.session.serialize(reply, ident=frames[:at]))
            return True
        return False

    async def _forward_subscriptions(self) -> None:
        with contextlib.suppress(asyncio.CancelledError, zmq.ContextTerminated):
            while True:
                for frames in await receive_ready(self.server["iopub"]):
                    if self._inner is not None:
                        self._send(("inner", "iopub"), frames)
                    if frames and frames[0][:1] == b"\x01" and self.resumed_request:
                        # A new subscriber learns what runs, and what it printed so far.
                        self._announce_resumed()
                        for kept in self._resumed_output:
                            self._send(("server", "iopub"), self._replay(kept))

    async def _disconnect_inner(self, inner_pid: int) -> None:
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
        assert self._inner is not None
        await asyncio.sleep(DISCONNECT_FLUSH)
        self._inner.unlink_endpoints()
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
        self._stop_pumps()
        await asyncio.sleep(0)  # let the cancelled pumps let go of their sockets
        for name, sock in self._inner.sockets.items():
            for frames in take_all(sock):
                if name == "fork_pipe":
                    frames = frames[1:]
                frames = self._sign(frames)
                self._observe(name, frames, reply=True)
                self._send(("server", "iopub" if name == "fork_pipe" else name), frames)
        await asyncio.to_thread(self._inner.close)
        self._inner = None
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

    # ------------------------------------------------------------------ stand-in

    def _start_stand_in(self) -> None:
        for name in ("shell", "control", "stdin"):
            self._stand_in.append(asyncio.create_task(self._answer_for_kernel(name)))

    async def _answer_for_kernel(self, name: str) -> None:
        """Answer requests while there is no inner kernel (dead or suspended)."""
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
                    self._stand_in_reply(name, sock, idents, msg, frames)

    def _stand_in_reply(
        self,
        name: str,
        sock: zmq.asyncio.Socket,
        idents: list[bytes],
        msg: dict[str, Any],
        frames: list[bytes],
    ) -> None:
        msg_type = msg["header"]["msg_type"]
        if self.state == State.SUSPENDED and msg_type not in (
            "kernel_info_request",
            "shutdown_request",
        ):
            # Keep it for the kernel; a request that needs the kernel brings it back.
            self._held[name].append(frames)
            if msg_type in ("execute_request", "complete_request", "inspect_request"):
                self._background(self._resume_for_request())
            return
        iopub = self.server["iopub"]
        self.session.send(iopub, "status", {"execution_state": "busy"}, parent=msg)
        reply_type = msg_type.replace("_request", "_reply")
        if msg_type == "kernel_info_request":
            content = dict(self.kernel_info) or {
                "status": "ok",
                "protocol_version": "5.3",
                "implementation": "kernel_wrapper",
                "implementation_version": __version__,
                "language_info": {"name": "python"},
                "banner": "",
            }
        elif msg_type == "shutdown_request":
            content = {"status": "ok", "restart": msg["content"].get("restart", False)}
        elif msg_type == "interrupt_request":
            content = {"status": "ok"}
        else:
            text = (
                "The kernel process died. Restore a snapshot (Kernel Snapshots panel or "
                "'jupyter snapshot restore') or restart the kernel."
            )
            if msg_type == "execute_request":
                self.session.send(
                    iopub, "stream", {"name": "stderr", "text": text + "\n"}, parent=msg
                )
            content = {
                "status": "error",
                "ename": "KernelDied",
                "evalue": text,
                "traceback": [],
                "execution_count": 0,
            }
        self.session.send(sock, reply_type, content, parent=msg, ident=idents)
        self.session.send(iopub, "status", {"execution_state": "idle"}, parent=msg)
        if msg_type == "shutdown_request":
            self.exit_code = 0
            self._set_state(State.STOPPING)
            self._done.set()

    async def _resume_for_request(self) -> None:
        """Bring a suspended kernel back (issue: idle GPU suspend)."""
        if self.state != State.SUSPENDED or self._op_lock.locked():
            return
        if self.suspended_snapshot is not None:
            try:
                await self._restore(self.suspended_snapshot, lambda _: None)
            except SnapshotError as exc:
                log.error("resuming the suspended kernel failed: %s", exc)

    def _background(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ control socket

    async def _handle_control(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        def send(message: dict[str, Any]) -> None:
            writer.write(json.dumps(message).encode() + b"\n")

        try:
            line = await reader.readline()
            request = json.loads(line)
            op = request.get("op")
            handlers: dict[str, Callable[[ProgressCallback, Any], Awaitable[Any]]] = {
                "status": self._op_status,
                "snapshot": self._op_snapshot,
                "restore": self._op_restore,
                "suspend": self._op_suspend,
                "resume": self._op_resume,
            }
            if op not in handlers:
                raise SnapshotError(f"Unknown control operation {op!r}.")
            args = OPERATIONS[op].from_json(request.get("args") or {})

            def progress(event: ProgressEvent) -> None:
                send({"event": "progress", **event})

            result = await handlers[op](progress, args)
            send({"ok": True, "result": result})
        except SnapshotError as exc:
            send({"ok": False, "error": exc.to_dict()})
        except (ValueError, TypeError) as exc:
            send({"ok": False, "error": SnapshotError(f"Bad control request: {exc}").to_dict()})
        except Exception as exc:
            log.exception("control request failed")
            send({"ok": False, "error": SnapshotError(f"Internal error: {exc!r}").to_dict()})
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    async def _op_status(self, progress: ProgressCallback, args: StatusArgs) -> KernelStatus:
        """What the server shows and its policies decide on."""
        gpu_status: dict[str, Any] = {"processes": 0, "bytes": 0, "utilization": 0}
        if args.gpu and self.inner_pid is not None:
            pids = proctree.descendants(self.inner_pid)
            gpu_status = await asyncio.to_thread(kernel_gpu_status, pids)
        return {
            "gpu": gpu_status,
            "state": self.state.value,
            "inner_pid": self.inner_pid,
            "wrapper_pid": os.getpid(),
            "lineage": self.lineage,
            "runtime_dir": str(self.runtime_dir),
            "execution_state": self.execution_state,
            "last_activity": self.last_activity,
            "executions_since_snapshot": self.executions_since_snapshot,
            "sequence": self.sequence,
            "busy": self._op_lock.locked(),
            "resumed_request": self.resumed_request,
            "lazy_restore": self.lazy_status,
        }

    @property
    def inner_pid(self) -> int | None:
        """The kernel process (the namespace's launcher with root), None while none runs."""
        return self._inner_pid

    @inner_pid.setter
    def inner_pid(self, pid: int | None) -> None:
        self._inner_pid = pid
        if self._announced:
            self._announce()

    def _announce(self) -> None:
        """Where the server finds this wrapper, and its kernel's process."""
        WrapperInfo(self._control_path, os.getpid(), self.inner_pid).write(self.connection_file)

    def _criu_binary(self) -> Criu:
        if self._criu is None:
            self._criu = Criu.locate(self.criu_path)
        return self._criu

    def _refuse_if_busy(self) -> None:
        """One snapshot or restore at a time: a second one is refused, not queued."""
        if self._op_lock.locked():
            raise SnapshotBusyError(
                "A snapshot or restore of this kernel is already in progress.",
                hint="Wait for it to finish, then try again.",
            )

    async def _op_snapshot(self, progress: ProgressCallback, args: SnapshotArgs) -> dict[str, Any]:
        self._refuse_if_busy()
        async with self._op_lock:
            manifest = await self._snapshot(
                Path(args.dest),
                args.trigger,
                args.leave_running,
                args.metadata,
                args.sequence,
                progress,
                release_gpu_caches=args.release_gpu_caches,
            )
            result: dict[str, Any] = json.loads(manifest.to_json())
            return result

    async def _snapshot(
        self,
        dest: Path,
        trigger: str,
        leave_running: bool,
        metadata: dict[str, Any],
        sequence: int | None,
        progress: ProgressCallback,
        *,
        release_gpu_caches: bool = True,
    ) -> Manifest:
        if self.state != State.RUNNING or self.inner_pid is None or self._inner is None:
            raise KernelNotRunningError(
                "There is no running kernel process to snapshot "
                f"(the kernel is {self.state.value}).",
                hint="Start or restore the kernel first.",
            )
        if dest.exists():
            raise SnapshotError(f"The snapshot directory {dest} already exists.")
        await self._lazy_settled()
        if self.state != State.RUNNING or self.inner_pid is None:
            raise KernelNotRunningError(
                f"The kernel did not come back from its lazy restore ({self.state.value}).",
                hint="See the kernel's status (lazy_restore) for why.",
            )
        criu = self._criu_binary()
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = dest.parent / f".{dest.name}.partial-{secrets.token_hex(4)}"
        (staging / IMAGES_DIR).mkdir(parents=True)
        # CRIU's log goes to our runtime directory, not beside the images: on a disk that
        # fills up it would be cut, and the error could no longer say why.
        work_dir = Path(tempfile.mkdtemp(prefix="dump-", dir=self.runtime_dir))
        inner_pid = self.inner_pid
        stdio_pipe = f"pipe:[{os.fstat(self._stdio_r).st_ino}]"
        runtime_dir_key = external_file_key(self._dir_fd)
        self._set_state(State.SNAPSHOTTING)
        await asyncio.sleep(0)  # let the cancelled pumps let go of their sockets
        gpu_info: dict[str, Any] = {}
        gpu_checkpoint: GpuCheckpoint | None = None
        try:
            gpu_info, gpu_checkpoint = await self._gpu_checkpoint(
                inner_pid, progress, release_gpu_caches
            )
        except BaseException:
            remove_tree(staging)
            remove_tree(work_dir)
            self._set_state(State.RUNNING)
            raise
        progress({"phase": "dumping"})
        started = time.monotonic()
        try:
            await self._disconnect_inner(inner_pid)
            disconnected_seconds = time.monotonic() - started
            tree = proctree.descendants(inner_pid)
            needed = proctree.needed_files(tree)
            ports = netports.bound_ports(self._socket_inodes(tree))
            if not leave_running:
                self._expected_exit = True
            dump_started = time.monotonic()
            hasher = GrowingFileHasher(staging / IMAGES_DIR)  # the memory, as it is written
            try:
                frozen = await criu.dump(
                    inner_pid,
                    staging / IMAGES_DIR,
                    work_dir,
                    leave_running=leave_running,
                    externals=[runtime_dir_key],
                )
            except BaseException:
                hasher.cancel()
                raise
            dump_seconds = time.monotonic() - dump_started
        except BaseException as exc:
            self._expected_exit = False
            remove_tree(staging)
            remove_tree(work_dir)
            if gpu_checkpoint is not None:
                await asyncio.to_thread(self._gpu().abort, gpu_checkpoint)
            if isinstance(exc, SnapshotError):
                raise _with_fate(exc, inner_pid) from exc
            raise
        finally:
            if self.inner_pid is not None and self._still(State.SNAPSHOTTING):
                self._inner = self._inner or InnerChannels(self.runtime_dir)
                self._set_state(State.RUNNING)
        if gpu_checkpoint is not None:
            if leave_running:
                await asyncio.to_thread(self._gpu().resume, gpu_checkpoint)
            gpu_info["checkpoint"] = gpu_checkpoint.to_dict()
        pause_seconds = time.monotonic() - started
        if not leave_running:
            while self.inner_pid is not None:
                await asyncio.sleep(0.005)
            self._set_state(State.SUSPENDED)
        self.sequence = sequence if sequence is not None else self.sequence + 1
        manifest = Manifest(
            id=new_snapshot_id(),
            lineage=self.lineage,
            sequence=self.sequence,
            created=utc_now(),
            trigger=trigger,
            runtime_dir=str(self.runtime_dir),
            runtime_dir_key=runtime_dir_key,
            stdio_pipe=stdio_pipe,
            kernel_spec=metadata.get("kernel_spec", {}),
            notebook_path=metadata.get("notebook_path"),
            kernel_info=self.kernel_info,
            parent_id=self.parent_snapshot,
            product_version=__version__,
            criu_version=criu.version_text,
            needed_files=needed,
            bound_ports=[port.to_dict() for port in ports],
            running_request=self._running_request(),
            gpu=gpu_info,
            disconnect_seconds=round(disconnected_seconds, 4),
            dump_seconds=round(dump_seconds, 4),
            frozen_seconds=round(frozen, 4),
            pause_seconds=round(pause_seconds, 4),
        )
        progress({"phase": "hashing"})
        shutil.rmtree(work_dir, ignore_errors=True)
        try:
            hashed = await asyncio.to_thread(hasher.finish)
            manifest = await asyncio.to_thread(
                seal,
                staging,
                manifest,
                dest,
                {f"{IMAGES_DIR}/{name}": entry for name, entry in hashed.items()},
            )
        except BaseException:
            remove_tree(staging)
            raise
        self.parent_snapshot = manifest.id
        self.executions_since_snapshot = 0
        progress({"phase": "done", "bytes": manifest.total_bytes})
        return manifest

    def _gpu(self) -> GpuCheckpointer:
        if self._gpu_checkpointer is None:
            self._gpu_checkpointer = GpuCheckpointer(open_backend())
        return self._gpu_checkpointer

    async def _gpu_checkpoint(
        self,
        inner_pid: int,
        progress: ProgressCallback,
        release_caches: bool,
    ) -> tuple[dict[str, Any], GpuCheckpoint | None]:
        """Lock and checkpoint every CUDA process of the kernel: device memory moves into
        host memory (so CRIU saves it) and the GPU is released. First, if asked, the
        kernel releases what its frameworks cache but do not use (kernel_wrapper.agent)."""
        pids = proctree.descendants(inner_pid)
        cuda_pids = await asyncio.to_thread(find_cuda_processes, pids)
        if not cuda_pids:
            return {}, None
        released: dict[str, Any] = {}
        if release_caches and self._inner is not None:
            progress({"phase": "releasing-gpu-caches"})
            released = await self._inner.ask_agent("release_gpu_caches", AGENT_TIMEOUT)
            released.pop("id", None)
            if released.get("error") or released.get("errors"):
                log.warning("releasing GPU caches: %s", released)
        progress({"phase": "gpu-checkpoint", "processes": len(cuda_pids)})
        record = await asyncio.to_thread(gpu_record, cuda_pids)
        if released:
            record["released_caches"] = released
        record["ns_pids"] = [proctree.ns_pid(pid) for pid in cuda_pids]
        record["total_bytes"] = record.get("needed_bytes", 0)
        checkpoint = await asyncio.to_thread(self._gpu().checkpoint, cuda_pids)
        return record, checkpoint

    async def _gpu_restore(self, manifest: Manifest, root: int) -> dict[str, Any]:
        """After CRIU restored the tree: CUDA restore and unlock of its CUDA processes.
        Returns the step timings (empty without CUDA processes)."""
        ns_pids = manifest.gpu.get("ns_pids") or []
        if not ns_pids:
            return {}
        by_ns = proctree.host_pids_by_ns_pid(root)
        missing = [p for p in ns_pids if p not in by_ns]
        if missing:
            raise IncompatibleSnapshotError(
                f"The restored kernel lacks the CUDA processes {missing} the snapshot recorded."
            )
        pairs = plan_gpu_pairs(manifest.gpu) if manifest.gpu.get("available") else None
        done = await asyncio.to_thread(self._gpu().restore, [by_ns[p] for p in ns_pids], pairs)
        return done.to_dict()

    async def _op_suspend(self, progress: ProgressCallback, args: SuspendArgs) -> dict[str, Any]:
        """Snapshot the kernel and end its process; the next request brings it back."""
        if self.execution_state == "busy":
            raise SnapshotBusyError(
                "The kernel is running a cell; a busy kernel is never suspended.",
                hint="Wait until the cell finishes, or interrupt it.",
            )
        result = await self._op_snapshot(
            progress,
            SnapshotArgs(
                args.dest,
                trigger=args.trigger,
                leave_running=False,
                metadata=args.metadata,
                release_gpu_caches=args.release_gpu_caches,
            ),
        )
        self.suspended_snapshot = Path(args.dest)
        self._discard_after_resume = args.discard_after_resume
        return result

    async def _op_resume(self, progress: ProgressCallback, args: ResumeArgs) -> Restored:
        if self.state != State.SUSPENDED or self.suspended_snapshot is None:
            raise KernelNotRunningError(
                f"The kernel is not suspended (it is {self.state.value}).",
                hint="Only suspended kernels can be resumed.",
            )
        return await self._op_restore(progress, RestoreRequest(self.suspended_snapshot))

    async def _op_restore(self, progress: ProgressCallback, args: RestoreRequest) -> Restored:
        self._refuse_if_busy()
        manifest = await self._restore(
            args.source,
            progress,
            verified=args.verified,
            save_to=args.save_to,
            pages_from=args.pages_from,
        )
        return {
            "inner_pid": self.inner_pid,
            "id": manifest.id,
            "lineage": manifest.lineage,
            "gpu": self.last_gpu_restore,
        }

    async def _restore(
        self,
        source: Path,
        progress: ProgressCallback,
        verified: bool = False,
        save_to: Path | None = None,
        pages_from: str | None = None,
    ) -> Manifest:
        """Replace the inner kernel (if any) by the snapshot in ``source``.

        With lazy restore the kernel runs as soon as CRIU has rebuilt it, its memory
        served page by page (from ``pages_from`` when given: an images directory, or
        ``unix:PATH`` of a lazypages.RangeServer lending the store; filling in the sparse
        ``pages-*.img`` of ``source``; else from ``source``) while the rest arrives in the
        background; a kernel saved before the restore is kept until every page is in.

        ``verified`` skips re-hashing files the caller has just checked (the server
        extension verifies every download); the manifest and compatibility are still read.

        A running kernel is never lost to a failed restore: it is first saved as a suspend
        does (into the new directory ``save_to``, default a new one beside ``source``),
        which also frees its memory, GPU and ports for the restored one; if CRIU or the
        CUDA restore then fails, the saved kernel is put back as it was, and the error says
        so.
        """
        async with self._op_lock:
            progress({"phase": "verifying"})
            if verified:
                manifest = Manifest.read(source)
            else:
                manifest = await asyncio.to_thread(verify, source)
            check_compatible(manifest)
            self._check_ports_free(manifest)
            criu = self._criu_binary()
            lazy = self._lazy_wanted(manifest, criu)
            saved: _SavedKernel | None = None
            if self.state == State.RUNNING and self.inner_pid is not None:
                saved = await self._save_before_restore(
                    save_to or source.parent / new_snapshot_id(), progress
                )
            progress({"phase": "restoring"})

            def restored() -> None:
                self.sequence = max(self.sequence, manifest.sequence)
                self.parent_snapshot = manifest.id
                self.executions_since_snapshot = 0

            try:
                await self._replace_inner(
                    source, manifest, criu, restored, lazy=lazy, pages_from=pages_from
                )
            except SnapshotError as exc:
                if saved is None:
                    raise
                await self._put_back(saved, exc, criu)
            if self._lazy is not None:
                self._lazy_task = asyncio.create_task(self._complete_lazy(self._lazy, saved, criu))
            elif saved is not None:
                remove_tree(saved.directory)
            if self.suspended_snapshot is not None:
                if self._discard_after_resume and self.suspended_snapshot == source:
                    shutil.rmtree(source, ignore_errors=True)
                self.suspended_snapshot = None
            progress({"phase": "done"})
            return manifest

    @staticmethod
    def _socket_inodes(pids: list[int]) -> set[int]:
        inodes: set[int] = set()
        for pid in pids:
            inodes |= sockdiag.socket_inodes(pid)
        return inodes

    def _check_ports_free(self, manifest: Manifest) -> None:
        """Refuse, before anything is ended, a snapshot whose listening or bound ports
        another process holds here (the kernel being replaced does not count)."""
        ports = [netports.BoundPort.from_dict(p) for p in manifest.bound_ports]
        if not ports:
            return
        own = self._socket_inodes(proctree.descendants(self.inner_pid)) if self.inner_pid else set()
        taken = netports.taken_ports(ports, ignore=own)
        if taken:
            raise IncompatibleSnapshotError(
                "The snapshot's kernel had network ports open that another process holds "
                f"here: {', '.join(taken)}.",
                hint="Stop the process that holds them ('ss -tulpn' names it), or restore "
                "on a machine where they are free.",
            )

    async def _save_before_restore(
        self, directory: Path, progress: ProgressCallback
    ) -> _SavedKernel:
        """Dump the running kernel and end it (a suspend), so that a failed restore can
        bring it back. A kernel that cannot be dumped keeps running; the restore is refused."""
        saved = _SavedKernel(
            directory=directory,
            sequence=self.sequence,
            parent_snapshot=self.parent_snapshot,
            executions_since_snapshot=self.executions_since_snapshot,
        )
        progress({"phase": "saving-kernel"})
        try:
            await self._snapshot(
                saved.directory,
                "before-restore",
                leave_running=False,
                metadata={},
                sequence=self.sequence,
                progress=lambda _: None,
            )
        except SnapshotError as exc:
            raise type(exc)(
                "Nothing was restored: the running kernel could not be saved first, and a "
                f"restore in place would have lost it. {exc.message}",
                hint="Restore into a new kernel instead ('jupyter snapshot restore ID --path "
                "NOTEBOOK'), or shut this kernel down and restore then. " + exc.hint,
                log_excerpt=exc.log_excerpt,
            ) from exc
        return saved

    async def _put_back(self, saved: _SavedKernel, failure: SnapshotError, criu: Criu) -> NoReturn:
        """After a failed restore: bring back the kernel saved before it, then raise."""
        log.warning("restore failed (%s); putting the kernel back", failure.message)

        def put_back() -> None:
            self.sequence = saved.sequence
            self.parent_snapshot = saved.parent_snapshot
            self.executions_since_snapshot = saved.executions_since_snapshot

        try:
            await self._replace_inner(
                saved.directory, Manifest.read(saved.directory), criu, put_back
            )
        except SnapshotError as again:
            # Still nothing lost: it stays suspended on the saved images, and the next
            # request tries again to bring it back.
            self.suspended_snapshot = saved.directory
            self._discard_after_resume = True
            raise type(failure)(
                f"{failure.message} Putting the running kernel back failed too "
                f"({again.message}); its state is kept in {saved.directory}, and it comes "
                "back from there on the next cell.",
                hint=failure.hint,
                log_excerpt=failure.log_excerpt,
            ) from failure
        remove_tree(saved.directory)
        raise type(failure)(
            f"{failure.message} The kernel was put back as it was before the restore; "
            "nothing in it was lost.",
            hint=failure.hint,
            log_excerpt=failure.log_excerpt,
        ) from failure

    def _lazy_wanted(self, manifest: Manifest, criu: Criu) -> bool:
        """Lazy restore unless turned off, unsupported here, or the kernel had CUDA state
        (the CUDA restore reads all of its memory at once: nothing to gain)."""
        if not self.lazy_restore or not worth_lazy(manifest.gpu):
            return False
        if self._lazy_supported is None:
            self._lazy_supported, said = criu.supports_lazy_pages()
            if not self._lazy_supported:
                log.warning("lazy restore is not supported here (%s); restoring in full", said)
        return self._lazy_supported

    async def _complete_lazy(
        self, transfer: LazyTransfer, saved: _SavedKernel | None, criu: Criu
    ) -> None:
        """Wait for the rest of a lazily restored kernel's memory. If a page cannot be
        had, the kernel (frozen at its first missing page) is killed: no half-restored
        kernel stays; one saved before a restore in place is put back."""
        pid = self.inner_pid
        try:
            await transfer.wait()
            filled = await asyncio.to_thread(transfer.server.fill_gaps)
        except SnapshotError as exc:
            log.error("lazy restore failed: %s", exc)
            error = exc
            async with self._op_lock:
                if self.inner_pid == pid:
                    await self._kill_inner()
                self._lazy = None
                transfer.close()
                shutil.rmtree(transfer.work_dir, ignore_errors=True)
                if saved is None:
                    self._stop_pumps()
                    self._set_state(State.DEAD)
                else:
                    try:
                        await self._put_back(saved, exc, criu)
                    except SnapshotError as final:
                        error = final  # says whether the kernel is back
                # Reported once settled: what the status shows then is the outcome.
                self.lazy_status = {"state": "failed", "error": error.to_dict()}
            return
        local_copy_error = transfer.server.local_copy_error  # known until it is closed
        self._lazy = None
        transfer.close()
        shutil.rmtree(transfer.work_dir, ignore_errors=True)
        self.lazy_status = {
            "state": "complete",
            "bytes": transfer.server.bytes_served + filled,
            "seconds": round((transfer.finished or time.monotonic()) - transfer.started, 3),
        }
        if local_copy_error:  # the kernel has all of its memory; the local images do not
            self.lazy_status["local_copy_error"] = local_copy_error
        log.info("lazy restore complete: %s", self.lazy_status)
        if saved is not None:
            remove_tree(saved.directory)

    async def _lazy_settled(self) -> None:
        """Before a dump: wait until a lazily restored kernel has all of its memory."""
        task = self._lazy_task
        if task is not None and not task.done():
            await asyncio.shield(asyncio.wait([task]))

    async def _replace_inner(
        self,
        source: Path,
        manifest: Manifest,
        criu: Criu,
        before_running: Callable[[], None],
        *,
        lazy: bool = False,
        pages_from: str | None = None,
    ) -> None:
        """CRIU (and CUDA) restore of ``source`` as the inner kernel, after ending the one
        there is; ``before_running`` updates the kernel's records just before requests flow
        again (held requests then count as new work). On failure the state says what is
        left: SUSPENDED if the kernel was suspended, else DEAD."""
        previous = self.state
        self._set_state(State.RESTORING)
        try:
            await self._kill_inner()
            if self._inner is not None:
                await asyncio.to_thread(self._inner.close)
                self._inner = None
            self._inner = InnerChannels(self.runtime_dir)
            # The restored kernel reads this before its next cell and runs its restore
            # hooks (its TCP connections come back closed; kernel_snapshots).
            write_restore_info(
                self.runtime_dir,
                snapshot_id=manifest.id,
                snapshot_created=manifest.created,
                snapshot_host=manifest.host,
                in_place=previous != State.STARTING,
                resumed=self.suspended_snapshot == source,
            )
            work_dir = Path(tempfile.mkdtemp(prefix="restore-", dir=self.runtime_dir))
            before = set(proctree.children(os.getpid()))
            images = source / IMAGES_DIR
            inherit_fds = [
                (self._stdio_w, manifest.stdio_pipe),
                (self._dir_fd, manifest.runtime_dir_key),
            ]
            try:
                pages = page_source(pages_from) if pages_from else DirectoryPages(images)
                # Pages files already there are kept by the source (the server downloads
                # them as the kernel runs); else this wrapper makes and completes them.
                kept_here = pages_from is not None and not any(images.glob("pages-*.img"))
                if pages_from is not None and (kept_here or not lazy):
                    # What criu restore reads from the files itself (not lazy: every page).
                    try:
                        await asyncio.to_thread(stage_pages_files, images, pages, lazy_too=not lazy)
                    except OSError as exc:
                        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
                        raise RestoreError(
                            f"The kernel's memory could not be staged in {images}: "
                            f"{exc.strerror or exc}.",
                            hint="Free space on that disk (or set work_dir to one with room "
                            "for the kernel's memory), then restore again."
                            if full
                            else "Make sure the store is reachable, then restore again.",
                        ) from exc
                if lazy:
                    self.lazy_status = {"state": "transferring"}
                    pid, self._lazy = await criu.restore_lazy(
                        images,
                        work_dir,
                        pages,
                        write_through=kept_here,
                        kill_tree=lambda daemon: self._kill_children_except(before | {daemon}),
                        inherit_fds=inherit_fds,
                    )
                else:
                    pid = await criu.restore(images, work_dir, inherit_fds=inherit_fds)
            except BaseException as exc:
                # CRIU restores the tree as our child: one it gave up on (or that died with
                # it) must not stay behind, half-restored.
                self._kill_children_except(before)
                if lazy:
                    self.lazy_status = {"state": "failed"}
                    if isinstance(exc, SnapshotError):
                        self.lazy_status["error"] = exc.to_dict()
                raise
            finally:
                if self._lazy is None:
                    shutil.rmtree(work_dir, ignore_errors=True)
            try:
                self.last_gpu_restore = await self._gpu_restore(manifest, pid)
            except BaseException:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
                if self._lazy is not None:
                    self._lazy.close()
                    self._lazy = None
                    shutil.rmtree(work_dir, ignore_errors=True)
                raise
        except BaseException:
            if self._inner is not None and self.inner_pid is None:
                await asyncio.to_thread(self._inner.close)
                self._inner = None
            self._set_state(
                State.SUSPENDED
                if previous == State.SUSPENDED
                else State.DEAD
                if self.inner_pid is None
                else State.RUNNING
            )
            raise
        self.inner_pid = pid
        self.launcher = None
        self.lineage = manifest.lineage
        self._watch(pid)
        self.kernel_info = manifest.kernel_info or self.kernel_info
        # A restore is activity: a kernel resumed for a cell must not look idle since
        # before its suspend and be suspended again before that cell even starts.
        self.last_activity = time.time()
        before_running()
        self._resume_request(manifest.running_request)
        self._set_state(State.RUNNING)
