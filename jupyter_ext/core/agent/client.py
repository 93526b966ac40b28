"""CRIU through the node agent: what a kernel wrapper uses in a pod at baseline.

The wrapper's dumps and restores call :class:`AgentCriu` exactly as they call
:class:`~jupyter_ext.core.criu.Criu`; it asks the node agent instead of running CRIU.
A dump's images come back as descriptors of the agent's files and are copied into the
snapshot's images directory, with the agent's seals beside them (:data:`SEAL_FILE`: the
seal of the whole set, and each file's own); a restore hands the agent those files and
the seal, and the descriptors the restored kernel inherits (its output pipe, its runtime
directory, its /dev/shm files).

Memory tracking goes through the agent too (core/agent/protocol.py, "Chains"): a tracked
dump or a pre-copy round (``pre_dump``) sends the stub of the images it builds on, each
file with its own seal (the seals file travels with a level: core/criu/chain.py), and a
restore of a chain sends every level's files by their paths below the images, each with
its seal. The kernel's tracker is the wrapper's (kernel_wrapper/memory.py), as in-pod. Copies
made while the tree is frozen (its /dev/shm files, its logs) are made here, when the
agent says the tree is frozen. What the agent does not do for a pod (lazy restore, a
network or mount namespace of its own: docs/agent.md) is refused here, saying so, before
anything starts.

The agent never ends a kernel: a suspend's dump (``leave_running`` false) leaves it
stopped (from the freeze on), and it is ended here once its images are held (resumed if
they are not), so an agent that dies during a dump loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import os
import select
import signal
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import proctree
from ..criu import UNPRIVILEGED_NO_LAZY, Criu, FrozenCopy, LazyTransfer, parse_version
from ..criu.chain import PARENT, SEAL_FILE, is_level_file
from ..errors import DumpError, RestoreError, SnapshotError
from ..protocol.environment import ENV_AGENT_SOCKET
from .protocol import (
    DEFAULT_SOCKET_DIR,
    MAX_LEVELS,
    AgentIncompatibleError,
    AgentRequestError,
    AgentRestoreRequest,
    AgentUnavailableError,
    DumpRequest,
    Hello,
    HelloRequest,
    PreDumpRequest,
    _Request,
    check_reply_version,
    encode_request,
    receive,
    receive_more,
    send,
)

if TYPE_CHECKING:
    from ..isolation.netns import OwnNetwork

#: In a dump's work directory: what the agent said of its CRIU run (it ran elsewhere).
RUN_FILE = "agent-run.json"
#: How often an ended kernel's processes are looked at until their parents reaped them.
REAP_POLL = 0.005
#: How long one request to the agent may take (a dump of a large kernel, its copy).
REQUEST_TIMEOUT = 1800.0


def _not_through_agent(what: str, error: type[SnapshotError]) -> SnapshotError:
    return error(
        f"This kernel needs {what}, which the node agent does not do.",
        hint="Run the user pods in in-pod mode (deploy/z2jh/inpod.yaml) for such kernels "
        "(docs/agent.md, 'What agent mode does not do').",
    )


def call(
    socket_path: Path,
    request: _Request,
    fds: Sequence[int] = (),
    on_frozen: Callable[[], bool] | None = None,
) -> tuple[Any, list[int]]:
    """One request to the agent: its result and the descriptors that came with it.
    ``on_frozen`` copies while the agent holds a dumped tree frozen (a dump's
    ``frozen_copy``): whether it succeeded."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(REQUEST_TIMEOUT)
    try:
        try:
            sock.connect(str(socket_path))
        except OSError as exc:
            raise unreachable(socket_path, exc) from exc
        message = json.loads(encode_request(request))
        message.pop("v")
        # Refused at once (the agent's limits), the refusal waits to be read. Had the agent
        # closed with this request unread, Linux reports that reset before the refusal
        # it queued (a read after it gets the refusal, or nothing).
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            send(sock, message, fds)
        try:
            data, received = receive(sock)
        except ConnectionResetError:
            data, received = receive(sock)
        while on_frozen is not None and data and json.loads(data).get("frozen") is True:
            send(sock, {"copied": on_frozen()})
            on_frozen = None  # once per dump
            data, received = receive(sock)
        if not data:
            raise AgentUnavailableError(
                "The node agent closed the connection without an answer (it was stopped or "
                "restarted during the request).",
                hint="Retry once the agent runs again; the kernel was left as it was.",
            )
        reply = json.loads(data)
        if not reply.get("ok"):
            for fd in received:
                os.close(fd)
            raise SnapshotError.from_dict(reply.get("error", {}))
        try:
            check_reply_version(reply)
        except AgentIncompatibleError:
            for fd in received:
                os.close(fd)
            raise
        result = reply.get("result", {})
        count = len(result.get("files", [])) if isinstance(result, dict) else 0
        received += receive_more(sock, count - len(received))
        return result, received
    except (TimeoutError, ConnectionError) as exc:
        raise AgentUnavailableError(
            f"The node agent went away during the request ({exc}).",
            hint="Retry once the agent runs again; the kernel was left as it was.",
        ) from exc
    finally:
        sock.close()


#: What to do when a pod cannot reach its node's agent.
AGENT_HINT = (
    "Check that the node agent's DaemonSet (deploy/agent/agent.yaml) runs on this node: "
    "'kubectl -n kernel-snapshots-agent get pods -o wide', and its log: 'kubectl -n "
    "kernel-snapshots-agent logs POD -c agent' (it restarts by itself after a crash); and "
    "that the user pod mounts the agent's CSI volume (driver "
    f"agent.kernel-snapshots.jupyter.org) at {DEFAULT_SOCKET_DIR}, as "
    "deploy/z2jh/config.yaml does (docs/agent.md)."
)


def unreachable(socket_path: Path, exc: OSError) -> AgentUnavailableError:
    """Why ``socket_path`` did not take a connection, in the pod's terms."""
    if exc.errno == errno.ECONNREFUSED:
        why = (
            "nothing listens on it (connection refused): the node agent on this node is not "
            "running (stopped, crashed or restarting)"
        )
    elif exc.errno == errno.ENOENT and not socket_path.parent.is_dir():
        why = (
            f"{socket_path.parent} does not exist: the pod does not mount the node agent's "
            "socket volume"
        )
    elif exc.errno == errno.ENOENT:
        why = (
            "it does not exist: the agent's socket volume is mounted, but no node agent has "
            "started on this node"
        )
    else:
        why = f"{exc.strerror or exc}"
    return AgentUnavailableError(
        f"The node agent's socket {socket_path} (${ENV_AGENT_SOCKET}) does not answer: {why}.",
        hint=AGENT_HINT,
    )


@dataclass(frozen=True)
class AgentCriu(Criu):
    """CRIU as the node agent on ``path`` (its socket) runs it."""

    hello: Hello
    """What the agent answered when connected: its versions, the caller's pod name."""

    @classmethod
    def connect(cls, socket_path: Path) -> AgentCriu:
        """The agent on ``socket_path``, once it answered a hello in this protocol version
        (its CRIU's version, who it takes the caller for, how it tracks memory)."""
        try:
            result, _ = call(socket_path, HelloRequest(tracking=True))
        except AgentRequestError:  # of before memory tracking, or refusing this pod
            result, _ = call(socket_path, HelloRequest())
        hello = Hello.parse(result)
        version = parse_version(f"Version: {hello.criu_version}") or (0,)
        return cls(socket_path, version, f"node agent (owner {hello.owner})", hello)

    def keeps_tcp(self) -> bool:
        return True  # the agent's CRIU has CAP_NET_ADMIN for a dump that keeps them

    def dirty_tracking(self) -> tuple[str | None, str]:
        kind = self.hello.dirty_tracking
        if kind is None:
            return None, (
                "the node agent is of an older release, which copies the whole memory at "
                "every snapshot (upgrade its DaemonSet, deploy/agent/agent.yaml)"
            )
        if not kind:
            return None, (
                "the node agent's CRIU cannot track memory on this node (no soft-dirty bits, "
                "no userfaultfd write-protection: Linux >= 6.7 and the CRIU of the agent's "
                "image are needed)"
            )
        return kind, f"the node agent's CRIU, with the {kind} bits of the kernel's memory"

    def copied_bytes(self, work_dir: Path) -> int:
        try:
            return int(json.loads((work_dir / RUN_FILE).read_text())["copied_bytes"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def supports_lazy_pages(self) -> tuple[bool, str]:
        return False, (
            "the node agent runs CRIU as this pod's user, and "
            f"{UNPRIVILEGED_NO_LAZY} (docs/agent.md)"
        )

    async def dump(
        self,
        pid: int,
        images_dir: Path,
        work_dir: Path,
        *,
        leave_running: bool,
        externals: Sequence[str] = (),
        keep_tcp: bool = False,
        ghost_limit: int = 0,
        open_by_fd: Sequence[str] = (),
        frozen: FrozenCopy | None = None,
        netns: OwnNetwork | None = None,
        track_mem: bool = False,
        prev_images: Path | None = None,
    ) -> float:
        if netns is not None:
            raise _not_through_agent("a network namespace of its own", DumpError)
        prev = _Stub.of(prev_images)
        request = DumpRequest(
            pid=pid,
            leave_running=leave_running,
            externals=list(externals),
            ghost_limit=ghost_limit,
            open_by_fd=list(open_by_fd),
            frozen_copy=frozen is not None,
            keep_tcp=keep_tcp,
            track_mem=track_mem or prev_images is not None,
            prev=prev.names,
            prev_sizes=prev.sizes,
            prev_seals=prev.seals,
        )
        on_frozen = frozen.run if frozen is not None else None
        try:
            result = await self._dumped(request, prev, images_dir, work_dir, on_frozen)
        except BaseException:
            if not leave_running:
                # The agent may have stopped the tree before it went away: it runs on.
                _signal_tree(pid, signal.SIGCONT)
            raise
        if not leave_running:
            await asyncio.to_thread(_end_tree, pid)
        return float(result["frozen_seconds"])

    async def pre_dump(
        self,
        pid: int,
        images_dir: Path,
        work_dir: Path,
        *,
        prev_images: Path | None = None,
        netns: OwnNetwork | None = None,
    ) -> float:
        if netns is not None:
            raise _not_through_agent("a network namespace of its own", DumpError)
        prev = _Stub.of(prev_images)
        request = PreDumpRequest(
            pid=pid, prev=prev.names, prev_sizes=prev.sizes, prev_seals=prev.seals
        )
        result = await self._dumped(request, prev, images_dir, work_dir, None)
        return float(result["frozen_seconds"])

    async def _dumped(
        self,
        request: DumpRequest | PreDumpRequest,
        prev: _Stub,
        images_dir: Path,
        work_dir: Path,
        on_frozen: Callable[[], bool] | None,
    ) -> dict[str, Any]:
        """Ask the agent for ``request``, its images copied into ``images_dir`` with their
        seals, what it said of its CRIU run into ``work_dir``; the agent's result."""
        try:
            result, fds = await asyncio.to_thread(call, self.path, request, prev.fds, on_frozen)
        finally:
            prev.close()
        try:
            await asyncio.to_thread(_copy_out, fds, result["files"], images_dir)
        finally:
            for fd in fds:
                os.close(fd)
        seals = result.get("seals") or []
        record = {
            "seal": result["seal"],
            "files": result["files"],
            "seals": dict(zip(result["files"], seals, strict=True)) if seals else {},
        }
        (images_dir / SEAL_FILE).write_text(json.dumps(record))
        run = {"copied_bytes": int(result.get("copied_bytes", 0))}
        (work_dir / RUN_FILE).write_text(json.dumps(run))
        return dict(result)

    async def restore(
        self,
        images_dir: Path,
        work_dir: Path,
        *,
        inherit_fds: Sequence[tuple[int, str]] = (),
        keep_tcp: bool = False,
        mounts: Sequence[str] = (),
        mount_sources: Mapping[str, str] | None = None,
        netns: OwnNetwork | None = None,
    ) -> int:
        if netns is not None:
            raise _not_through_agent("a network namespace of its own", RestoreError)
        if mounts:
            raise _not_through_agent("a mount namespace of its own", RestoreError)
        try:
            seal = json.loads((images_dir / SEAL_FILE).read_text())
        except (OSError, ValueError) as exc:
            raise RestoreError(
                "This snapshot was not taken through the node agent (it has no seal), and "
                "the agent restores only images it sealed.",
                hint="Restore it in a pod in in-pod mode (deploy/z2jh/inpod.yaml).",
            ) from exc
        files: list[str] = seal["files"]
        levels = _sealed_levels(images_dir)
        if levels and self.hello.dirty_tracking is None:
            raise RestoreError(
                "This snapshot builds on earlier ones (a chain of memory levels), which the "
                "node agent, of an older release, cannot restore.",
                hint="Upgrade the node agent's DaemonSet (deploy/agent/agent.yaml) to this "
                "release, or restore the snapshot in in-pod mode.",
            )
        request = AgentRestoreRequest(
            files=[*files, *(path for path, _ in levels)],
            sizes=[],
            seal=seal["seal"],
            inherit=[resource for _, resource in inherit_fds],
            keep_tcp=keep_tcp,
            level_seals=[level_seal for _, level_seal in levels],
        )
        fds: list[int] = []
        try:
            for name in request.files:
                fds.append(os.open(images_dir / name, os.O_RDONLY | os.O_NOFOLLOW))
            request = dataclasses.replace(request, sizes=[os.fstat(fd).st_size for fd in fds])
            result, _ = await asyncio.to_thread(
                call, self.path, request, [*fds, *(fd for fd, _ in inherit_fds)]
            )
        finally:
            for fd in fds:
                os.close(fd)
        return int(result["pid"])

    async def restore_lazy(self, *args: Any, **kwargs: Any) -> tuple[int, LazyTransfer]:
        """Refused whatever it is asked (:meth:`Criu.restore_lazy` has the arguments)."""
        raise _not_through_agent("a lazy restore", RestoreError)


@dataclass
class _Stub:
    """What a tracked dump sends of the images it builds on (``prev``): their inventory
    and pagemaps, opened, each with its size and the agent's seal of it."""

    names: list[str] = dataclasses.field(default_factory=list)
    sizes: list[int] = dataclasses.field(default_factory=list)
    seals: list[str] = dataclasses.field(default_factory=list)
    fds: list[int] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, images: Path | None) -> _Stub:
        """The stub of ``images`` (a dump's or pre-dump's directory, or a stub of one,
        core/criu/chain.py: with the agent's seals), or an empty one for None."""
        stub = cls()
        if images is None:
            return stub
        seals = _seals_of(images, DumpError)
        try:
            for path in sorted(images.iterdir()):
                if not is_level_file(path.name) or path.name.startswith(("pages-", SEAL_FILE)):
                    continue  # CRIU reads only the inventory and pagemaps of a dump's parent
                if path.name not in seals:
                    raise _unsealed(path, DumpError)
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                stub.fds.append(fd)
                stub.names.append(path.name)
                stub.sizes.append(os.fstat(fd).st_size)
                stub.seals.append(seals[path.name])
        except BaseException:
            stub.close()
            raise
        return stub

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


#: What to do when images a dump builds on, or a level of a snapshot, have no seal.
_UNSEALED_HINTS: dict[type[SnapshotError], str] = {
    DumpError: "Take a new snapshot: the kernel's next one copies its whole memory.",
    RestoreError: "Restore another snapshot of the kernel, or this one in in-pod mode.",
}


def _seals_of(level: Path, error: type[SnapshotError]) -> dict[str, str]:
    """The agent's seal of each file of ``level`` (its :data:`SEAL_FILE`)."""
    try:
        seals = json.loads((level / SEAL_FILE).read_text())["seals"]
        if not isinstance(seals, dict):
            raise TypeError(type(seals).__name__)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise error(
            f"The memory images in {level} have no seals of the node agent's: a snapshot "
            "builds through the agent only on images the agent sealed file by file (an "
            "agent of an older release did not).",
            hint=_UNSEALED_HINTS[error],
        ) from exc
    return {str(name): str(seal) for name, seal in seals.items()}


def _unsealed(path: Path, error: type[SnapshotError]) -> SnapshotError:
    return error(
        f"The memory image {path} has no seal of the node agent's.", hint=_UNSEALED_HINTS[error]
    )


def _sealed_levels(images_dir: Path) -> list[tuple[str, str]]:
    """The files of the levels below ``images_dir`` (``parent/...``, the kernel's earlier
    dumps: core/criu/chain.py) that a restore reads, by path, each with its seal."""
    found: list[tuple[str, str]] = []
    level, rel = images_dir / PARENT, PARENT
    depth = 0
    while level.is_dir():
        depth += 1
        if depth > MAX_LEVELS:
            raise RestoreError(
                f"This snapshot's chain of memory levels is deeper than {MAX_LEVELS}, the "
                "most the node agent restores.",
                hint="Take a new snapshot of the kernel and restore that one.",
            )
        seals = _seals_of(level, RestoreError)
        for path in sorted(level.iterdir()):
            if path.name == SEAL_FILE or not is_level_file(path.name) or path.is_symlink():
                continue
            if path.name not in seals:
                raise _unsealed(path, RestoreError)
            found.append((f"{rel}/{path.name}", seals[path.name]))
        level, rel = level / PARENT, f"{rel}/{PARENT}"
    return found


def _copy_out(fds: Sequence[int], names: Sequence[str], images_dir: Path) -> None:
    """The agent's image files into the snapshot's images directory."""
    if len(fds) != len(names):
        raise AgentUnavailableError(
            f"The node agent sent {len(fds)} image files for {len(names)} names.",
            hint="Retry; if it happens again, see the agent's log.",
        )
    for fd, name in zip(fds, names, strict=True):
        if "/" in name or name.startswith("."):
            raise AgentUnavailableError(f"The node agent named an image {name!r}.")
        out = os.open(images_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            size = os.fstat(fd).st_size
            offset = 0
            while offset < size:
                sent = os.copy_file_range(fd, out, size - offset, offset, offset)
                if sent == 0:
                    break
                offset += sent
        finally:
            os.close(out)
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _signal_tree(pid: int, signum: int) -> list[int]:
    """Send ``signum`` to every process of the tree under ``pid`` (stopped by the agent:
    it starts none meanwhile); pidfds of those signalled."""
    pidfds: list[int] = []
    for task in proctree.descendants(pid):
        try:
            pidfd = os.pidfd_open(task)
        except OSError:
            continue
        pidfds.append(pidfd)
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signum)
    if signum != signal.SIGKILL:
        for pidfd in pidfds:
            os.close(pidfd)
        return []
    return pidfds


def _end_tree(pid: int, timeout: float = 30.0) -> None:
    """End the tree under ``pid`` once its images are held, as CRIU ends a tree it dumped
    without ``--leave-running``, and wait until its parents have reaped each process (at
    most ``timeout``): a restore right after needs their ids free."""
    pidfds = _signal_tree(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    try:
        for pidfd in pidfds:
            while time.monotonic() < deadline:
                try:
                    signal.pidfd_send_signal(pidfd, 0)
                except ProcessLookupError:
                    break  # reaped
                select.select([], [], [], REAP_POLL)
    finally:
        for pidfd in pidfds:
            os.close(pidfd)
