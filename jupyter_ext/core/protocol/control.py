"""The wrapper's private control protocol: JSON lines over a unix socket.

A request is one line ``{"op": ..., "args": {...}}``. The wrapper answers with any number
of ``{"event": "progress", ...}`` lines, then one final line: ``{"ok": true, "result": ...}``
or ``{"ok": false, "error": {...}}`` (a serialized :class:`SnapshotError`).

The socket lives in a directory only the kernel's user can enter; its path is written
to ``snapshot-wrapper-<connection file name>`` next to the kernel's connection file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Self, TypedDict

from .. import private
from ..errors import KernelNotRunningError, SnapshotError, WrapperUnavailableError
from .environment import ENV_AWAIT_RESTORE
from .progress import ProgressCallback

INFO_PREFIX = "snapshot-wrapper-"
JOURNAL_PREFIX = "snapshot-journal-"
#: How long a new wrapper waits for a ``restore`` once started with the marker of
#: ENV_AWAIT_RESTORE (environment.py).
AWAIT_RESTORE_SECONDS = 120.0
#: How long a new wrapper gets to come up (bind its channels, open its control socket).
WRAPPER_START_SECONDS = 60.0
#: The wrapper's exit status when a port of its connection file is taken (EADDRINUSE's
#: number): jupyter_client picks free ports and closes them, and another process may take
#: one before the wrapper binds it. Its restarter then starts the kernel again on new
#: ports; a kernel started to restore into is started again by the server.
EXIT_PORT_IN_USE = 98
#: How many kernels a restore into a new kernel starts at most, each whose wrapper found
#: a port taken (EXIT_PORT_IN_USE) started again on new ports.
PORT_ATTEMPTS = 3


@contextlib.contextmanager
def socket_path(path: Path) -> Iterator[str]:
    """``path`` as a unix socket address can hold it (108 bytes): a long one is reached
    through an fd of its folder, ``/proc/self/fd/N/NAME`` (runtime directories under a
    deep temporary folder are longer)."""
    if len(os.fsencode(path)) < 100:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def take_await_marker(environ: dict[str, str]) -> bool:
    """Whether this wrapper waits for a restore: it removed the marker named by
    :data:`ENV_AWAIT_RESTORE` (only the first wrapper started with it can)."""
    marker = environ.get(ENV_AWAIT_RESTORE)
    if not marker:
        return False
    try:
        os.unlink(marker)
    except FileNotFoundError:
        return False
    return True


def info_path(connection_file: Path) -> Path:
    """Where the wrapper of the kernel with ``connection_file`` describes itself."""
    return connection_file.with_name(INFO_PREFIX + connection_file.name)


class KernelJournal(TypedDict):
    """What the server needs to offer a kernel back after it died, kept by its wrapper in
    a file beside the connection file (:func:`journal_path`) as it changes: a wrapper
    killed with its kernel leaves it as it was; one whose kernel died adds ``death``
    before it exits. The server reads (and removes) it when jupyter_client restarts the
    kernel."""

    lineage: str
    snapshot_id: str | None
    """The snapshot the kernel's state was last saved in or restored from."""
    cells_since: list[dict[str, Any]]
    """The cells run since then: ``execution_count``, ``first_line``."""
    inner_pid: int | None
    death: dict[str, Any] | None
    """How the kernel died (:class:`jupyter_ext.core.death.Death`'s JSON), if it did."""


def journal_path(connection_file: Path) -> Path:
    """Where the wrapper of the kernel with ``connection_file`` keeps its journal."""
    return connection_file.with_name(JOURNAL_PREFIX + connection_file.name)


def write_journal(connection_file: Path, journal: KernelJournal) -> None:
    path = journal_path(connection_file)
    tmp = path.with_name(path.name + ".tmp")
    private.write_file(tmp, json.dumps(journal))
    os.replace(tmp, path)


def take_journal(connection_file: Path) -> KernelJournal | None:
    """The journal a wrapper left, removed (None if there is none, or it is unreadable)."""
    path = journal_path(connection_file)
    try:
        journal: KernelJournal = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    finally:
        path.unlink(missing_ok=True)
    return journal if isinstance(journal, dict) else None


@dataclass(frozen=True)
class WrapperInfo:
    control: Path
    pid: int
    inner_pid: int | None = None
    """The kernel process (rewritten as it changes): the server reaps it once it is
    orphaned (without root: jupyter_ext/manager/reaping.py)."""

    @classmethod
    def for_connection_file(cls, connection_file: Path) -> WrapperInfo:
        path = info_path(connection_file)
        try:
            data = json.loads(path.read_text())
            inner = data.get("inner_pid")
            return cls(Path(data["control"]), int(data["pid"]), int(inner) if inner else None)
        except (OSError, ValueError, KeyError) as exc:
            raise WrapperUnavailableError(
                f"The kernel with connection file {connection_file} is not a snapshot kernel "
                "(it was not started through kernel_wrapper).",
                hint="Start the notebook's kernel with the 'Python 3 (snapshots)' kernel.",
            ) from exc

    def write(self, connection_file: Path) -> None:
        path = info_path(connection_file)
        tmp = path.with_name(path.name + ".tmp")
        info = {"control": str(self.control), "pid": self.pid, "inner_pid": self.inner_pid}
        private.write_file(tmp, json.dumps(info))
        os.replace(tmp, path)


# -- the operations: one dataclass of arguments each, sent as a JSON object ---------------


@dataclass(frozen=True)
class _Args:
    """Arguments of a control operation: a JSON object of the dataclass's fields (an
    unknown or missing one is a TypeError, which the wrapper answers as a bad request)."""

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Self:
        return cls(**data)


@dataclass(frozen=True)
class StatusArgs(_Args):
    gpu: bool = True
    """Add the kernel's GPU accounting (NVML; skipped by the policies' frequent polls)."""


@dataclass(frozen=True)
class SnapshotArgs(_Args):
    dest: str
    """Where the sealed snapshot directory goes (must not exist)."""
    trigger: str = "manual"
    leave_running: bool = True
    metadata: dict[str, Any] = field(default_factory=dict)
    """Manifest fields the server knows: kernel_spec, notebook_path."""
    sequence: int | None = None
    release_gpu_caches: bool = True
    chunk_kib: int | None = None
    """The chunk size to cut the memory with (the store's, if fixed); None: chosen from the
    kernel's memory and its previous snapshot's (chunking.auto_chunk_kib)."""
    write_back: bool = False
    """Start writing the memory images to disk as they are hashed (the store adopts them:
    SnapshotStore.adopts_images)."""
    track_memory: bool = True
    """Track the kernel's memory (the server's track_memory; kernel_wrapper/memory.py)."""
    parent: str | None = None
    """The kernel's previous snapshot's directory on this machine, held unchanged by the
    server for the request (its image cache entry): the dump copies only what changed
    since, where the kernel's memory was tracked since then (kernel_wrapper/memory.py)."""


@dataclass(frozen=True)
class SuspendArgs(_Args):
    """A snapshot that ends the kernel's process; the next request brings it back."""

    dest: str
    trigger: str = "idle-suspend"
    metadata: dict[str, Any] = field(default_factory=dict)
    discard_after_resume: bool = True
    release_gpu_caches: bool = True
    chunk_kib: int | None = None
    write_back: bool = False
    track_memory: bool = True
    parent: str | None = None

    def snapshot_args(self) -> SnapshotArgs:
        """The snapshot a suspend takes: every field the two share, the kernel not left
        running."""
        shared = {f.name for f in fields(SnapshotArgs)} & {f.name for f in fields(self)}
        return SnapshotArgs(**{name: getattr(self, name) for name in shared}, leave_running=False)


@dataclass(frozen=True)
class ResumeArgs(_Args):
    """Bring a suspended kernel back from its snapshot."""


@dataclass(frozen=True)
class LazyRestoreEndArgs(_Args):
    """Answer once the kernel's lazy restore is no longer transferring (at once if it is
    not): its ``lazy_restore`` status. What the server waits on to give back what the
    kernel's pages were read from, pushed by the wrapper instead of polled."""


@dataclass(frozen=True)
class CheckpointsArgs(_Args):
    """The kernel's cell checkpoints, its position among them and the notebook's marks."""


@dataclass(frozen=True)
class UndoArgs(_Args):
    """Go back to a cell checkpoint (kernel_wrapper/checkpoints.py): ``to`` one, or the
    one before the cell ``before_cell``, or (neither) the one before the last cell; with
    ``redo``, back to where the last undo started. ``preview``: only say what it would do
    (which checkpoint, the cells it undoes, the files changed since)."""

    to: str | None = None
    before_cell: str | None = None
    redo: bool = False
    preview: bool = False


class KernelStatus(TypedDict):
    """The ``status`` operation's reply (the server adds its own fields for the API)."""

    gpu: dict[str, Any]
    state: str
    inner_pid: int | None
    wrapper_pid: int
    lineage: str
    runtime_dir: str
    execution_state: str
    last_activity: float
    executions_since_snapshot: int
    longest_cell_since_snapshot: float
    sequence: int
    busy: bool
    resumed_request: dict[str, Any] | None
    running_request: dict[str, Any] | None
    """The execute_request the kernel got and has not answered yet (the oldest), if any."""
    lazy_restore: dict[str, Any]
    memory: dict[str, Any]
    """Since which snapshot the kernel's memory is tracked (kernel_wrapper/memory.py)."""
    closed_on_restore: list[dict[str, Any]]
    """Connections to outside peers the last restore gave back closed (pid, process,
    local, remote)."""
    own_network: bool
    """The kernel runs in a network namespace of its own (a copy restored beside a kernel
    holding its ports; it reaches out through slirp4netns): docs/network.md."""
    private_temp: str | None
    """The temporary directory of which the kernel has a private view (a copy restored
    beside a kernel holding its file locks there: Dask's workers), else None."""
    private_shm: list[dict[str, Any]]
    """The /dev/shm names that a live process held when the kernel was last restored
    (``name``, ``held_by``: pid and process): the kernel has private copies of those
    files, and a new attach by such a name reaches the other process's file."""
    snapshot_id: str | None
    """The snapshot the kernel's state was last saved in or restored from (None before
    its first): the cells since are counted from it."""
    cells_since_snapshot: list[dict[str, Any]]
    """The cells run since then (``execution_count``, ``first_line``; the last 50)."""
    death: dict[str, Any] | None
    """How the kernel died, while it is dead (``--on-inner-death=wait``)."""
    checkpoints: dict[str, Any]
    """Its cell checkpoints (kernel_wrapper/checkpoints.py): whether it gets them (and why
    not), its position, the redo point, the cells marked "not in the kernel's state",
    the last one skipped and why."""


class Restored(TypedDict):
    """The ``restore`` and ``resume`` operations' reply."""

    inner_pid: int | None
    id: str
    lineage: str
    gpu: dict[str, Any] | None
    closed_connections: list[dict[str, Any]]
    """Connections to peers outside the kernel that the restore gave back closed."""
    private_shm: list[dict[str, Any]]
    """As :attr:`KernelStatus.private_shm`, for this restore."""
    phases: dict[str, float]
    """Where the restore's time went: seconds per phase, in order (core/phases.py)."""


@dataclass(frozen=True)
class RestoreRequest:
    """The ``restore`` operation's arguments: in place of the running kernel, or into a
    new kernel whose wrapper waits for it (:data:`ENV_AWAIT_RESTORE`)."""

    source: Path
    """The snapshot directory (its ``pages-*.img`` may be missing: see ``pages_from``)."""
    verified: bool = False
    """The requester checked every file against its sha256 already."""
    pages_from: str | None = None
    """Where the kernel's memory comes from when not from ``source``: an images
    directory, or ``unix:PATH`` of a server lending the store (lazy restore). With
    ``source``'s pages files missing the wrapper makes them and fills them in; present,
    they are the lender's (the server downloads them as the kernel runs)."""
    lazy: bool = False
    """Restore with lazy pages: the requester decided (core.lazypages.lazy_plan); the
    wrapper follows, in full only where its CRIU has no lazy pages."""

    save_to: Path | None = None
    """A restore in place first saves the running kernel here (put back on failure)."""
    save_parent: Path | None = None
    """The running kernel's previous snapshot on this machine: the save copies only what
    changed since (as :attr:`SnapshotArgs.parent`)."""

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"source": str(self.source), "verified": self.verified}
        if self.pages_from:
            data["pages_from"] = self.pages_from
        if self.lazy:
            data["lazy"] = True
        if self.save_to:
            data["save_to"] = str(self.save_to)
        if self.save_parent:
            data["save_parent"] = str(self.save_parent)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RestoreRequest:
        unknown = set(data) - {"source", "verified", "pages_from", "lazy", "save_to", "save_parent"}
        if unknown or not isinstance(data.get("source"), str):
            raise TypeError(f"a restore needs a source and takes no {sorted(unknown)}")
        return cls(
            Path(data["source"]),
            bool(data.get("verified")),
            data.get("pages_from") or None,
            bool(data.get("lazy")),
            Path(data["save_to"]) if data.get("save_to") else None,
            Path(data["save_parent"]) if data.get("save_parent") else None,
        )


#: Every operation, by name, with its arguments.
OPERATIONS: dict[str, type[_Args] | type[RestoreRequest]] = {
    "status": StatusArgs,
    "snapshot": SnapshotArgs,
    "suspend": SuspendArgs,
    "resume": ResumeArgs,
    "restore": RestoreRequest,
    "lazy-restore-end": LazyRestoreEndArgs,
    "checkpoints": CheckpointsArgs,
    "undo": UndoArgs,
}


class WrapperClient:
    """Talks to one kernel wrapper over its control socket: a typed method per operation,
    over :meth:`request` (the transport, also for the CLI and tests)."""

    def __init__(self, control: Path) -> None:
        self.control = control

    @classmethod
    async def when_up(
        cls,
        connection_file: Path,
        alive: Callable[[], Awaitable[bool]],
        timeout: float = WRAPPER_START_SECONDS,
    ) -> WrapperClient:
        """The client of a wrapper just started for ``connection_file``, once it has
        announced itself (its control socket listens then); an error if its process ended
        (``alive``) or it did not come up within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(WrapperUnavailableError):
                return cls(WrapperInfo.for_connection_file(connection_file).control)
            if not await alive():
                raise KernelNotRunningError(
                    "The new kernel's wrapper exited before it could restore the snapshot.",
                    hint="See the server log for the kernel's output.",
                )
            if time.monotonic() > deadline:
                raise KernelNotRunningError(
                    f"The new kernel's wrapper did not come up within {timeout:.0f} s.",
                    hint="The machine may be overloaded; see the server log, then retry.",
                )
            await asyncio.sleep(0.02)

    async def status(self, args: StatusArgs = StatusArgs(), timeout: float = 10) -> KernelStatus:
        status: KernelStatus = await self.request("status", args.to_json(), timeout=timeout)
        return status

    async def snapshot(
        self, args: SnapshotArgs, on_progress: ProgressCallback | None = None
    ) -> dict[str, Any]:
        """The sealed snapshot's manifest, as JSON."""
        manifest: dict[str, Any] = await self.request("snapshot", args.to_json(), on_progress)
        return manifest

    async def suspend(
        self, args: SuspendArgs, on_progress: ProgressCallback | None = None
    ) -> dict[str, Any]:
        manifest: dict[str, Any] = await self.request("suspend", args.to_json(), on_progress)
        return manifest

    async def resume(self, on_progress: ProgressCallback | None = None) -> Restored:
        restored: Restored = await self.request("resume", None, on_progress)
        return restored

    async def restore(
        self, args: RestoreRequest, on_progress: ProgressCallback | None = None
    ) -> Restored:
        restored: Restored = await self.request("restore", args.to_json(), on_progress)
        return restored

    async def lazy_restore_end(self) -> dict[str, Any]:
        """The kernel's ``lazy_restore`` status once it is not "transferring" any more
        (the wrapper answers when that happens; an error if the wrapper goes away)."""
        ended: dict[str, Any] = await self.request("lazy-restore-end")
        return ended

    async def checkpoints(self) -> dict[str, Any]:
        """The kernel's cell checkpoints (kernel_wrapper/checkpoints.py's listing)."""
        listing: dict[str, Any] = await self.request("checkpoints", None, timeout=30)
        return listing

    async def undo(
        self, args: UndoArgs, on_progress: ProgressCallback | None = None
    ) -> dict[str, Any]:
        """What the undo (or redo) did, or would do with ``preview``."""
        result: dict[str, Any] = await self.request("undo", args.to_json(), on_progress)
        return result

    async def request(
        self,
        op: str,
        args: dict[str, Any] | None = None,
        on_progress: ProgressCallback | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Send one request; call ``on_progress`` for each progress event; return the result."""
        try:
            with socket_path(self.control) as address:
                reader, writer = await asyncio.open_unix_connection(address, limit=1 << 24)
        except OSError as exc:
            raise WrapperUnavailableError(
                f"The kernel wrapper's control socket {self.control} does not answer ({exc}).",
                hint="The kernel has stopped; restart it or restore a snapshot into a new one.",
            ) from exc
        try:
            writer.write(json.dumps({"op": op, "args": args or {}}).encode() + b"\n")
            await writer.drain()
            return await asyncio.wait_for(self._read_answer(reader, on_progress), timeout)
        except ConnectionError as exc:  # the wrapper died while it answered
            raise WrapperUnavailableError(
                f"The kernel wrapper's control connection broke ({exc}).",
                hint="The kernel may have died; check the server log.",
            ) from exc
        finally:
            writer.close()

    @staticmethod
    async def _read_answer(
        reader: asyncio.StreamReader, on_progress: ProgressCallback | None
    ) -> Any:
        while True:
            line = await reader.readline()
            if not line:
                raise WrapperUnavailableError(
                    "The kernel wrapper closed the control connection without an answer.",
                    hint="The kernel may have died; check the server log.",
                )
            message = json.loads(line)
            if message.pop("event", None) is not None:
                if on_progress is not None:
                    on_progress(message)
                continue
            if message.get("ok"):
                return message.get("result")
            raise SnapshotError.from_dict(message.get("error", {}))

    def request_sync(self, op: str, *args: Any, **kwargs: Any) -> Any:
        """Blocking form of :meth:`request` (same arguments), for the CLI and tests."""
        return asyncio.run(self.request(op, *args, **kwargs))
