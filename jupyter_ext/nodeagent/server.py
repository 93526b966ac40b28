"""The node agent's server: one connection, one request, one reply (a dump's caller may be
asked once between them, when its tree is frozen: core/agent/protocol.py).

Each connection's caller is identified by the kernel first (core/agent/peers.py), and
counted against the agent's limits (:class:`Limits`: connections in all and per pod, a
time to send the request in); its request is parsed and checked
(core/agent/protocol.py); only then is anything done, and only to the caller's own
processes (``dump``, ``pre_dump``) or with images sealed for the caller's pod
(``restore``, and the images a tracked dump builds on: nodeagent/seal.py), within the
agent's disk budget. Every refusal is answered with an error that names why and is
logged with the pod it came from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import shutil
import signal
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from jupyter_ext.core import proctree
from jupyter_ext.core.agent import peers
from jupyter_ext.core.agent.protocol import (
    FROZEN_COPY_SECONDS,
    SOCKET_NAME,
    VERSION,
    AgentRequestError,
    AgentRestoreRequest,
    DumpRequest,
    Hello,
    HelloRequest,
    PreDumpRequest,
    parse_copied,
    parse_request,
    receive,
    receive_more,
    send,
)
from jupyter_ext.core.carried.restorable import fix_for_restore
from jupyter_ext.core.criu import DEFAULT_GHOST_LIMIT, TCP_DUMP_OPTIONS, Criu
from jupyter_ext.core.criu.chain import PARENT
from jupyter_ext.core.criu.log import copied_bytes, explain_failure, frozen_seconds, log_excerpt
from jupyter_ext.core.criu.options import TCP_KEEP_DUMP_OPTIONS, TCP_KEEP_RESTORE_OPTIONS
from jupyter_ext.core.errors import (
    DumpError,
    IncompatibleSnapshotError,
    RestoreError,
    SnapshotError,
)
from jupyter_ext.core.lazypages.pagemap import parse_pagemap

from . import criurpc
from .podcriu import RUN_SECONDS, PodCriu, cgroup_procs_files, finish
from .privileges import check_restored
from .seal import ImageFile, ImageSetSealer, copy_in, hash_file

log = logging.getLogger("jupyter_ext.nodeagent")

#: What the agent keeps free on its state directory's file system by default: a restore
#: whose images would take more of it is refused (``--max-request-bytes``).
KEEP_FREE_FRACTION = 0.1


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one caller may take of the agent (``jupyter-snapshot-agent --help``)."""

    max_connections: int = 64
    """Connections served at once, from all pods (one thread each)."""
    max_connections_per_pod: int = 8
    """Connections served at once for one pod (a wrapper asks one at a time per kernel)."""
    receive_timeout: float = 30.0
    """Seconds a caller has to send its request (and its descriptors) once connected."""
    max_request_bytes: int = -1
    """The most image bytes one restore may bring; below 0: what the state directory's
    file system has free beyond :data:`KEEP_FREE_FRACTION` of its size. Either way never
    more than it has free, less what restores under way hold."""


class _Slots:
    """Connections served now, in all and per pod."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.lock = threading.Lock()
        self.pods: Counter[str] = Counter()

    def take(self, pod: str) -> None:
        with self.lock:
            if sum(self.pods.values()) >= self.limits.max_connections:
                raise AgentRequestError(
                    "The node agent is serving as many connections as it takes "
                    f"({self.limits.max_connections}, --max-connections).",
                    hint="Retry in a moment.",
                )
            if self.pods[pod] >= self.limits.max_connections_per_pod:
                raise AgentRequestError(
                    "The node agent is serving as many connections from this pod as it "
                    f"takes ({self.limits.max_connections_per_pod}, "
                    "--max-connections-per-pod).",
                    hint="Retry once this pod's other snapshots or restores are done.",
                )
            self.pods[pod] += 1

    def give(self, pod: str) -> None:
        with self.lock:
            self.pods[pod] -= 1
            if self.pods[pod] <= 0:
                del self.pods[pod]


class _DiskBudget:
    """The bytes restores may copy into ``state_dir`` (:attr:`Limits.max_request_bytes`)."""

    def __init__(self, state_dir: Path, max_request_bytes: int) -> None:
        self.state_dir = state_dir
        self.max_request_bytes = max_request_bytes
        self.lock = threading.Lock()
        self.held = 0

    @contextlib.contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        """Reserve ``nbytes`` for one restore's images, or AgentRequestError naming the
        limit that refuses them."""
        with self.lock:
            usage = shutil.disk_usage(self.state_dir)
            free = usage.free - self.held
            if self.max_request_bytes < 0:
                limit = free - int(usage.total * KEEP_FREE_FRACTION)
                source = (
                    f"what its disk has free beyond {KEEP_FREE_FRACTION:.0%} of its size "
                    "(the default of --max-request-bytes)"
                )
            else:
                limit = min(self.max_request_bytes, free)
                source = f"--max-request-bytes {self.max_request_bytes} (or its disk's free space)"
            if nbytes > limit:
                raise AgentRequestError(
                    f"The node agent refused the restore: its images take {nbytes} bytes, "
                    f"more than the {max(limit, 0)} it takes now: {source}.",
                    hint="Restore a smaller snapshot, free space on the node, or raise the "
                    "agent's --max-request-bytes.",
                )
            self.held += nbytes
        try:
            yield
        finally:
            with self.lock:
                self.held -= nbytes


@dataclasses.dataclass
class _Reply:
    result: dict[str, Any]
    fds: list[int] = dataclasses.field(default_factory=list)
    stopped: list[peers.CallerTask] = dataclasses.field(default_factory=list)
    """A tree left stopped for the caller to end: resumed if the reply cannot be sent."""


class Agent:
    """Serves dumps and restores on ``socket_dir``/agent.sock; keeps its work under
    ``state_dir`` (root's alone)."""

    def __init__(
        self,
        socket_dir: Path,
        state_dir: Path,
        sealer: ImageSetSealer,
        criu: Criu,
        owner_pattern: str = peers.DEFAULT_OWNER_PATTERN,
        limits: Limits | None = None,
    ) -> None:
        self.socket_path = socket_dir / SOCKET_NAME
        self.state_dir = state_dir
        self.sealer = sealer
        self.criu = criu
        self.owner_pattern = owner_pattern
        self.limits = limits or Limits()
        self.slots = _Slots(self.limits)
        self.budget = _DiskBudget(state_dir, self.limits.max_request_bytes)
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(state_dir, 0o700)
        self.pod_criu = PodCriu(criu.path, state_dir / "bin")
        self.dirty_tracking = self.pod_criu.dirty_tracking()[0] or ""
        for leftover in state_dir.glob("*-*"):
            # What an agent that was killed during a request left (its caller got an error;
            # the kernel of a dump runs on: CRIU always leaves it running).
            shutil.rmtree(leftover, ignore_errors=True)
        socket_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(socket_dir, 0o755)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(str(self.socket_path))
        # Anyone on the node may connect: who may do what is decided per caller.
        os.chmod(self.socket_path, 0o666)
        self.sock.listen(64)
        proctree.set_subreaper(True)

    def serve_forever(self) -> None:
        log.info("node agent listening on %s (protocol %d)", self.socket_path, VERSION)
        while True:
            conn, _ = self.sock.accept()
            # Identified and counted here, in the order callers connected: /proc only.
            try:
                caller = peers.identify(conn)
            except SnapshotError as exc:
                _refuse_now(conn, exc, "unidentified caller")
                continue
            try:
                self.slots.take(caller.pod)
            except SnapshotError as exc:
                _refuse_now(conn, exc, caller.describe())
                caller.close()
                continue
            threading.Thread(target=self._serve, args=(conn, caller), daemon=True).start()

    def _serve(self, conn: socket.socket, caller: peers.Caller) -> None:
        fds: list[int] = []
        pod = caller.pod
        try:
            conn.settimeout(self.limits.receive_timeout)
            # Read before answering anything: a reply to a caller whose request is unread
            # would be lost to a reset connection.
            data, fds = receive(conn)
            if not data:
                return  # closed without a request
            caller.ensure_alive()
            caller = peers.named(caller, self.owner_pattern)
            request = parse_request(data, len(fds))
            fds += receive_more(conn, request.expected_fds() - len(fds))
            reply = self._dispatch(caller, request, fds, conn)
            try:
                send(conn, {"ok": True, "result": reply.result}, reply.fds)
            except BaseException:
                _resume(reply.stopped)
                raise
            finally:
                for fd in reply.fds:
                    os.close(fd)
                for task in reply.stopped:
                    task.close()
            log.info("%s: %s done", caller.describe(), request.op)
        except TimeoutError:
            waited = self.limits.receive_timeout
            log.warning("%s: no request within %g s", caller.describe(), waited)
            with contextlib.suppress(OSError):
                late = AgentRequestError(
                    "The node agent closed the connection: no whole request came within "
                    f"{waited:g} s (--receive-timeout).",
                    hint="Send the request, with its descriptors, at once after connecting.",
                )
                send(conn, {"ok": False, "error": late.to_dict()})
        except SnapshotError as exc:
            log.warning("%s: %s", caller.describe(), exc.message)
            with contextlib.suppress(OSError):
                send(conn, {"ok": False, "error": exc.to_dict()})
        except Exception:
            log.exception("request failed")
            with contextlib.suppress(OSError):
                error = SnapshotError(
                    "The node agent failed on this request.", hint="See the agent's log."
                )
                send(conn, {"ok": False, "error": error.to_dict()})
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self.slots.give(pod)
            caller.close()
            conn.close()

    def _dispatch(
        self, caller: peers.Caller, request: Any, fds: list[int], conn: socket.socket
    ) -> _Reply:
        if isinstance(request, HelloRequest):
            return _Reply(self.hello(caller, request))
        if isinstance(request, DumpRequest):
            return self.dump(caller, request, fds, conn)
        if isinstance(request, PreDumpRequest):
            return self.pre_dump(caller, request, fds)
        if isinstance(request, AgentRestoreRequest):
            return _Reply(self.restore(caller, request, fds))
        raise AgentRequestError(f"The node agent refused the request: no {request.op}.")

    # ------------------------------------------------------------------ operations

    def hello(self, caller: peers.Caller, request: HelloRequest) -> dict[str, Any]:
        hello = Hello(
            version=VERSION,
            criu_version=self.criu.version_text,
            owner=caller.owner,
            pod_name=caller.pod_name,
            pod=caller.pod,
            container=caller.container,
            dirty_tracking=self.dirty_tracking if request.tracking else None,
        )
        return {k: v for k, v in dataclasses.asdict(hello).items() if v is not None}

    @contextlib.contextmanager
    def _private_dir(self, kind: str, caller: peers.Caller) -> Iterator[tuple[Path, int, int]]:
        """A new directory of the agent's with ``images`` and ``work``, as descriptors
        CRIU reaches from inside a pod (it runs as the caller's user: they are the
        user's, inside the agent's directory, which no pod can reach); removed
        afterwards."""
        top = self.state_dir / f"{kind}-{secrets.token_hex(8)}"
        top.mkdir(mode=0o711)
        os.chmod(top, 0o711)  # CRIU, as the caller, goes from images to a dump's ../prev
        (top / "images").mkdir(mode=0o700)
        (top / "work").mkdir(mode=0o700)
        for sub in ("images", "work"):
            os.chown(top / sub, caller.uid, caller.gid)
        images = os.open(top / "images", os.O_PATH | os.O_DIRECTORY)
        work = os.open(top / "work", os.O_PATH | os.O_DIRECTORY)
        try:
            yield top, images, work
        finally:
            os.close(images)
            os.close(work)
            shutil.rmtree(top, ignore_errors=True)

    def dump(
        self,
        caller: peers.Caller,
        request: DumpRequest,
        fds: list[int],
        conn: socket.socket,
    ) -> _Reply:
        """Dump the caller's process ``request.pid`` through CRIU's RPC, which asks at the
        freeze (nodeagent/criurpc.py): then the caller copies if it asked to, and a
        suspend's tree (``leave_running`` false) is stopped. The images, fixed for a
        restore, are handed back as descriptors with their seals, and nothing of them
        stays here. The kernel is never ended here: CRIU leaves it running (an agent
        killed during the dump loses nothing), and a suspend's tree stays stopped for the
        caller to end once it holds the images. A tracked dump builds on the stub of
        earlier images it was given (``fds``), each file checked against its seal first."""
        task = peers.in_caller_namespace(caller, request.pid)
        stopped: list[peers.CallerTask] = []

        def at_freeze() -> bool:
            """At CRIU's post-dump step (the tree dumped, still frozen): whether the dump
            may go on. A suspend's tree is stopped now, so that it never runs after the
            state its images hold (it stays stopped when CRIU lets go of it)."""
            if not task.alive() or not caller.alive():
                log.warning("%s: the kernel or the caller ended during the dump", caller.describe())
                return False
            if request.frozen_copy and not _frozen_copy(conn, caller):
                return False
            if not request.leave_running:
                try:
                    stopped.extend(_stop_tree(task))
                except AgentRequestError as exc:
                    log.warning("%s: %s", caller.describe(), exc.message)
                    return False
            return True

        try:
            with (
                self.budget.hold(sum(request.prev_sizes)),
                self._private_dir("dump", caller) as dirs,
            ):
                top, images, work = dirs
                tcp = TCP_KEEP_DUMP_OPTIONS if request.keep_tcp else TCP_DUMP_OPTIONS
                args = ["-W", _fd_path(work), "--file-locks", *tcp, "--leave-running"]
                args += ["--ghost-limit", str(max(request.ghost_limit, DEFAULT_GHOST_LIMIT))]
                for key in request.externals:
                    args += ["--external", key]
                args += ["--track-mem"] if request.track_mem else []
                args += _copy_prev(self.sealer, caller, request, fds, top)
                rpc = criurpc.dump_request(request.pid, _fd_path(images), "dump.log")
                self._run_criu(caller, dirs, args, rpc, at_freeze)
                caller.ensure_alive()
                task.ensure_alive()
                fix_for_restore(top / "images", request.open_by_fd, request.keep_tcp)
                result, out_fds = self._hand_back(caller, top)
        except BaseException:
            _resume(stopped)
            raise
        finally:
            task.close()
        result["stopped"] = bool(stopped)
        return _Reply(result, out_fds, stopped)

    def pre_dump(self, caller: peers.Caller, request: PreDumpRequest, fds: list[int]) -> _Reply:
        """Copy the memory of the caller's process ``request.pid`` while it runs (CRIU's
        SINGLE_PRE_DUMP, read mode, tracked), on the stub of earlier images given as for
        a dump; the images handed back with their seals, as a dump's."""
        task = peers.in_caller_namespace(caller, request.pid)
        try:
            with (
                self.budget.hold(sum(request.prev_sizes)),
                self._private_dir("pre-dump", caller) as dirs,
            ):
                top, images, work = dirs
                args = ["-W", _fd_path(work), "--track-mem", "--pre-dump-mode", "read"]
                args += _copy_prev(self.sealer, caller, request, fds, top)
                rpc = criurpc.dump_request(request.pid, _fd_path(images), "dump.log", pre_dump=True)
                self._run_criu(caller, dirs, args, rpc, lambda: True)
                caller.ensure_alive()
                task.ensure_alive()
                result, out_fds = self._hand_back(caller, top)
        finally:
            task.close()
        return _Reply(result, out_fds)

    def _run_criu(
        self,
        caller: peers.Caller,
        dirs: tuple[Path, int, int],
        args: list[str],
        rpc: bytes,
        at_freeze: Callable[[], bool],
    ) -> None:
        """``criu ARGS swrk`` in the caller's pod for the RPC request ``rpc``
        (nodeagent/criurpc.py) on ``dirs`` (:meth:`_private_dir`), answering its
        post-dump step with ``at_freeze``; DumpError with CRIU's words if it failed."""
        top, images, work = dirs
        procs = cgroup_procs_files(caller.cgroup)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with ours:
            with theirs, caller.namespaces() as namespaces:
                process = self.pod_criu.start(
                    namespaces,
                    (caller.uid, caller.gid),
                    procs,
                    [*args, "swrk", str(theirs.fileno())],
                    [images, work, theirs.fileno()],
                )
            try:
                ours.settimeout(RUN_SECONDS)
                error = criurpc.converse(ours, rpc, at_freeze)
            finally:
                # Closed first: a CRIU still waiting for an answer fails the dump, and the
                # tree it froze runs on.
                ours.close()
                rc, output = finish(process)
        if error is not None or rc != 0:
            excerpt = log_excerpt(top / "work" / "dump.log", output + (error or ""))
            message, hint = explain_failure(excerpt, restoring=False)
            raise DumpError(message, hint=hint, log_excerpt=excerpt)

    def _hand_back(self, caller: peers.Caller, top: Path) -> tuple[dict[str, Any], list[int]]:
        """The images of a dump or pre-dump, hashed and sealed (the set, and each file on
        its own), opened for the caller; what its CRIU run copied, from its log."""
        files = [
            hash_file(path)
            for path in sorted((top / "images").iterdir())
            if path.is_file() and not path.is_symlink()
        ]
        pod = caller.pod_name
        dump_log = top / "work" / "dump.log"
        result = {
            "files": [f.name for f in files],
            "seal": self.sealer.seal(pod, files),
            "seals": [self.sealer.seal_file(pod, f) for f in files],
            "frozen_seconds": frozen_seconds(dump_log),
            "copied_bytes": copied_bytes(dump_log),
            "criu_version": self.criu.version_text,
        }
        return result, [os.open(top / "images" / f.name, os.O_RDONLY) for f in files]

    def restore(
        self, caller: peers.Caller, request: AgentRestoreRequest, fds: list[int]
    ) -> dict[str, Any]:
        """Restore images sealed for the caller's pod into the caller's pod; every restored
        task must hold no more than the caller (nodeagent/privileges.py)."""
        files_fds, inherit_fds = fds[: len(request.files)], fds[len(request.files) :]
        budget = self.budget.hold(sum(request.sizes))
        with budget, self._private_dir("restore", caller) as (top, images, work):
            owner = (caller.uid, caller.gid)
            copied: dict[str, ImageFile] = {}
            for fd, size, name in zip(files_fds, request.sizes, request.files, strict=True):
                _make_levels(top / "images", name, owner)
                copied[name] = copy_in(fd, size, top / "images" / name, owner)
            own = [copied[name] for name in request.files if "/" not in name]
            self.sealer.check(caller.pod_name, own, request.seal)
            levels = zip(request.levels(), request.level_seals, strict=True)
            self.sealer.check_files(caller.pod_name, [(n, copied[n], s) for n, s in levels])
            tcp = TCP_KEEP_RESTORE_OPTIONS if request.keep_tcp else ("--tcp-close",)
            args = ["restore", "-D", _fd_path(images), "-W", _fd_path(work)]
            args += ["-o", "restore.log", "-v4", "--file-locks", "--restore-detached"]
            args += [*tcp, "--restore-sibling", "--manage-cgroups=ignore"]
            # Stopped until every task is checked (check_restored resumes them).
            args += ["--leave-stopped", "--pidfile", f"{_fd_path(work)}/restored.pid"]
            for fd, resource in zip(inherit_fds, request.inherit, strict=True):
                args += ["--inherit-fd", f"fd[{fd}]:{resource}"]
            procs = cgroup_procs_files(caller.cgroup)
            with caller.namespaces() as namespaces:
                process = self.pod_criu.start(
                    namespaces,
                    (caller.uid, caller.gid),
                    procs,
                    args,
                    [images, work, *inherit_fds],
                )
            rc, output = finish(process)
            if rc != 0:
                excerpt = log_excerpt(top / "work" / "restore.log", output)
                message, hint = explain_failure(excerpt, restoring=True)
                error_cls = (
                    IncompatibleSnapshotError if hint.startswith("incompatible:") else RestoreError
                )
                raise error_cls(
                    message, hint=hint.removeprefix("incompatible:"), log_excerpt=excerpt
                )
            pid = int((top / "work" / "restored.pid").read_text().strip())
        try:
            caller.ensure_alive()
            root = peers.in_caller_namespace(caller, pid)
            try:
                check_restored(caller, root.pid)
            finally:
                root.close()
        except BaseException:
            _kill_restored(caller, pid)
            raise
        self._adopt(root.pid)
        return {"pid": pid}

    @staticmethod
    def _adopt(host_pid: int) -> None:
        """Reap the restored tree's root when it ends (the agent is its parent now)."""
        if peers.status_fields(host_pid).get("PPid") != str(os.getpid()):
            log.warning("restored process %d is not the agent's child: not reaped here", host_pid)
            return

        def reap() -> None:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(host_pid, 0)

        threading.Thread(target=reap, name=f"reap-{host_pid}", daemon=True).start()


def _copy_prev(
    sealer: ImageSetSealer,
    caller: peers.Caller,
    request: DumpRequest | PreDumpRequest,
    fds: list[int],
    top: Path,
) -> list[str]:
    """The stub of the images a tracked dump builds on, copied beside its images as
    ``prev`` (each file checked against its own seal; the empty pages files its
    pagemaps name made here), and CRIU's options for it; none without a stub."""
    if not request.prev:
        return []
    owner = (caller.uid, caller.gid)
    prev = top / "prev"
    prev.mkdir(mode=0o700)
    os.chown(prev, *owner)
    copied = [
        (name, copy_in(fd, size, prev / name, owner), seal)
        for fd, size, name, seal in zip(
            fds, request.prev_sizes, request.prev, request.prev_seals, strict=True
        )
    ]
    sealer.check_files(caller.pod_name, copied)
    for name in request.prev:
        if name.startswith("pagemap-"):
            pages = prev / parse_pagemap((prev / name).read_bytes(), name).pages_file
            os.close(os.open(pages, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
            os.chown(pages, *owner)
    # Relative: CRIU resolves it from the images directory's real place, and keeps it
    # as the images' "parent" link (not handed back: only regular files are).
    return ["--prev-images-dir", "../prev"]


def _frozen_copy(conn: socket.socket, caller: peers.Caller) -> bool:
    """At CRIU's post-dump step (the tree dumped and frozen): the caller copies its files
    now (core/agent/protocol.py, ``frozen_copy``); whether it did, within
    FROZEN_COPY_SECONDS (not the connection's --receive-timeout: a large /dev/shm file
    takes longer). A caller that does not answer, answers anything else, or whose process
    ended meanwhile fails the dump: its tree runs on."""
    timeout = conn.gettimeout()
    try:
        send(conn, {"frozen": True})
        conn.settimeout(FROZEN_COPY_SECONDS)
        data, fds = receive(conn)
    except (OSError, AgentRequestError) as exc:
        log.warning("%s: no answer at the freeze: %s", caller.describe(), exc)
        return False
    finally:
        conn.settimeout(timeout)
    for fd in fds:
        os.close(fd)
    if not data:
        return False
    try:
        copied = parse_copied(data)
    except AgentRequestError as exc:
        log.warning("%s: %s", caller.describe(), exc.message)
        return False
    if not caller.alive():
        log.warning("%s: %s", caller.describe(), peers.ENDED)
        return False
    return copied


def _make_levels(images: Path, name: str, owner: tuple[int, int]) -> None:
    """The directories of the chain's levels that ``name`` (``parent/.../pages-1.img``,
    checked by the protocol) is in, below ``images``, as the caller's (CRIU reads them)."""
    level = images
    for _ in range(name.count("/")):
        level = level / PARENT
        if not level.is_dir():
            level.mkdir(mode=0o700)
            os.chown(level, *owner)


def _fd_path(fd: int) -> str:
    """A descriptor of the agent's as CRIU, inside the pod, reaches it."""
    return f"/proc/self/fd/{fd}"


def _stop_tree(task: peers.CallerTask) -> list[peers.CallerTask]:
    """At CRIU's post-dump step, while CRIU holds every process of the tree under
    ``task`` (none can start another): SIGSTOP each, through a pidfd. The signal waits
    until CRIU lets go of them, and they stop instead of running on (as CRIU keeps a task
    itself keeps stopped a task it found stopped); the pinned processes."""
    stopped = [peers.CallerTask(task.pid, task.shown)]
    try:
        stopped += [peers.CallerTask(pid, pid) for pid in proctree.descendants(task.pid)[1:]]
        for pinned in stopped:
            pinned.signal(signal.SIGSTOP)
    except BaseException:
        _resume(stopped)
        raise
    return stopped


def _resume(tasks: list[peers.CallerTask]) -> None:
    """SIGCONT and let go of processes :func:`_stop_tree` stopped."""
    for task in tasks:
        task.signal(signal.SIGCONT)
        task.close()
    tasks.clear()


def _refuse_now(conn: socket.socket, exc: SnapshotError, who: str) -> None:
    """Refuse a connection at once (the accept loop must not wait for it): what it sent
    already is read first, so that the refusal reaches it."""
    log.warning("%s: %s", who, exc.message)
    conn.setblocking(False)
    with contextlib.suppress(OSError, SnapshotError):
        _, fds = receive(conn)
        for fd in fds:
            os.close(fd)
    with contextlib.suppress(OSError):
        send(conn, {"ok": False, "error": exc.to_dict()})
    conn.close()


def _kill_restored(caller: peers.Caller, pid: int) -> None:
    """SIGKILL a tree just restored into the caller's PID namespace as ``pid``."""
    host_pid = peers.find_in_namespace(caller.pid_ns, pid)
    if host_pid is None:
        return
    for task in proctree.descendants(host_pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(task, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(host_pid, 0)
