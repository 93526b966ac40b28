"""What every part of the manager shares: its settings and state, the server's kernels and
wrappers, and jobs (long work that reports progress, so that the REST API can return at
once)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core import private, proctree
from ..core.errors import (
    BadIdError,
    SnapshotBusyError,
    SnapshotError,
    SnapshotNotFoundError,
    WrapperUnavailableError,
)
from ..core.imagecache import ImageCache
from ..core.leftovers import DumpLock, after_failed_dump
from ..core.manifest import Manifest
from ..core.protocol import Phase, ProgressCallback, ProgressEvent, WrapperClient, WrapperInfo
from ..core.store import SnapshotStore
from .pages import LentPages

log = logging.getLogger("jupyter_ext")


KERNEL_ID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


#: Byte progress goes out as events at most this often (seconds) per job.
PROGRESS_EVENT_INTERVAL = 0.25


EmitEvent = Callable[[str, dict[str, Any]], None]


def check_kernel_id(kernel_id: str) -> str:
    if not KERNEL_ID_RE.match(kernel_id):
        raise BadIdError(
            f"{kernel_id!r} is not a kernel id (a UUID).",
            hint="Use a kernel id as GET /api/snapshots/kernels shows it.",
        )
    return kernel_id


def validate_notebook_path(path: str) -> str:
    """A notebook path relative to the server root, with no way out of it."""
    parts = [p for p in path.replace("\\", "/").split("/") if p not in ("", ".")]
    if path.startswith("/") or any(p == ".." for p in parts) or "\x00" in path:
        raise ValueError(f"{path!r} is not a notebook path relative to the server root.")
    return "/".join(parts)


def user_prefix(username: str) -> str:
    """The store prefix of a user: from the server's identity, safe as a path and S3 key."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", username) or "anonymous"
    return f"users/{safe}"


@dataclass
class Job:
    """A snapshot, restore, suspend or resume in progress (or done)."""

    id: str
    kind: str
    kernel_id: str | None
    status: str = "running"  # running | done | failed
    phase: Phase = "queued"
    done_bytes: int = 0
    total_bytes: int = 0
    started: float = field(default_factory=time.time)
    finished: float | None = None
    result: dict[str, Any] | None = None
    error: dict[str, str] | None = None
    checked: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    """Set once a restore has checked, from its manifest, that the snapshot exists and can
    run here (the request waits for this much; the download and hashes come after)."""
    done: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    exception: SnapshotError | None = field(default=None, repr=False)
    last_event: float = field(default=0.0, repr=False)
    """When the last progress event went out (monotonic), to pace byte progress."""

    def to_dict(self) -> dict[str, Any]:
        return {
            name: getattr(self, name)
            for name in (
                "id",
                "kind",
                "kernel_id",
                "status",
                "phase",
                "done_bytes",
                "total_bytes",
                "started",
                "finished",
                "result",
                "error",
            )
        }


@dataclass
class PendingUpload:
    """A snapshot dumped and sealed locally whose upload to the store has not succeeded."""

    manifest: Manifest
    directory: Path
    error: str = ""
    attempts: int = 0
    in_flight: bool = False


@dataclass
class Dumped:
    """What a wrapper request that dumps the kernel into a folder left (see
    :meth:`ManagerBase._guarded_dump`)."""

    answer: Any = None
    """The wrapper's answer, when the request succeeded."""
    sealed: Manifest | None = None
    """Else the snapshot the wrapper sealed there before it died (the kernel's state)."""
    error: SnapshotError | None = None
    """Why the request failed, when ``sealed`` is set."""

    @property
    def manifest(self) -> Manifest:
        """The snapshot dumped: sealed, or as a snapshot or suspend request answered."""
        return self.sealed if self.sealed is not None else Manifest.from_dict(self.answer)


class ManagerBase:
    """The state the manager's parts share, its kernels and its jobs."""

    def __init__(
        self,
        *,
        kernel_manager: Any,
        session_manager: Any,
        store: SnapshotStore,
        work_dir: Path,
        emit: EmitEvent,
        kernel_name: str = "python3-snapshot",
        keep_last: int = 0,
        keep_hourly_hours: int = 0,
        keep_daily_days: int = 0,
        max_bytes: int = 0,
        image_cache_max_bytes: int = -1,
        release_gpu_caches: bool = True,
        lazy_restore: bool = True,
        lazy_restore_from_store: bool = True,
        chunk_kib: int | None = None,
    ) -> None:
        """The settings are SnapshotExtensionApp's traits of the same names (there
        documented); ``max_bytes`` is its ``max_store_bytes``."""
        self.kernel_manager = kernel_manager
        self.session_manager = session_manager
        self.store = store
        self.work_dir = work_dir
        self.emit = emit
        self.kernel_name = kernel_name
        self.jobs: dict[str, Job] = {}
        self._kernel_jobs: dict[str, Job] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._lazy_watchers: set[asyncio.Task[Any]] = set()
        self._settling: set[str] = set()
        """Kernels restored lazily whose restore this server has not wrapped up yet."""
        self.pending: dict[str, PendingUpload] = {}
        self.periodic_opt_out: set[str] = set()
        self.keep_last = keep_last
        self.keep_hourly_hours = keep_hourly_hours
        self.keep_daily_days = keep_daily_days
        self.max_bytes = max_bytes
        self.release_gpu_caches = release_gpu_caches
        self.lazy_restore = lazy_restore
        self.lazy_from_store = lazy_restore_from_store
        self.chunk_kib = chunk_kib
        self._lazy_pages: bool | None = None
        #: Stored snapshots whose pages lazily restored kernels still read.
        self.lent: set[LentPages] = set()
        #: Adopt and reap orphaned kernels (non-root; see :meth:`start_reaping`).
        self.reaps_orphans = os.geteuid() != 0
        self._reaping_on: asyncio.AbstractEventLoop | None = None
        self._kernel_pids: dict[int, str] = {}
        """Kernel processes seen (non-root), with their start times: reaped once their
        wrapper is gone."""
        private.make_dirs(self.staging_dir)
        private.make_dirs(self.cache_dir)
        #: The newest snapshot of each kernel, unpacked.
        self.image_cache = ImageCache(self.image_cache_dir, image_cache_max_bytes)

    def tighten(self) -> list[private.Exposed]:
        """Take from the store's files on this machine and the work directory the access
        others have (an older version's, another umask's); what was changed."""
        return [*self.store.tighten(), *private.tighten(self.work_dir)]

    @property
    def staging_dir(self) -> Path:
        return self.work_dir / "staging"

    @property
    def cache_dir(self) -> Path:
        return self.work_dir / "cache"

    @property
    def image_cache_dir(self) -> Path:
        return self.work_dir / "image-cache"

    def kernel(self, kernel_id: str) -> Any:
        """The server's kernel ``kernel_id``; SnapshotNotFoundError if there is none."""
        check_kernel_id(kernel_id)
        if kernel_id not in self.kernel_manager:
            raise SnapshotNotFoundError(f"There is no kernel {kernel_id} on this server.")
        return self.kernel_manager.get_kernel(kernel_id)

    def set_periodic(self, kernel_id: str, on: bool) -> None:
        """Periodic snapshots of this kernel on (the default) or off."""
        if on:
            self.periodic_opt_out.discard(kernel_id)
        else:
            self.periodic_opt_out.add(kernel_id)

    def wrapper(self, kernel_id: str) -> WrapperClient:
        km = self.kernel(kernel_id)
        info = WrapperInfo.for_connection_file(Path(km.connection_file))
        if self.reaps_orphans and info.inner_pid:
            self._kernel_pids.setdefault(info.inner_pid, proctree.start_time(info.inner_pid))
        return WrapperClient(info.control)

    async def _guarded_dump(
        self,
        kernel_id: str,
        dest: Path,
        request: Callable[[WrapperClient], Awaitable[Any]],
        *,
        catch: type[SnapshotError] = SnapshotError,
        keep_error: bool = False,
    ) -> Dumped:
        """Run ``request`` on the kernel's wrapper, which dumps the kernel into ``dest``,
        under a :class:`DumpLock` (if this server dies meanwhile, its next start cleans
        up). If it fails with ``catch``, :func:`after_failed_dump` decides: what the
        wrapper sealed before it died is kept and returned, with the error; anything else
        is removed and the error raised (with ``keep_error`` the request's own, else as
        after_failed_dump puts it, plainer for a full disk)."""
        wrapper_pid = None
        with contextlib.suppress(SnapshotError):
            km = self.kernel(kernel_id)
            wrapper_pid = WrapperInfo.for_connection_file(Path(km.connection_file)).pid
        lock = DumpLock(dest)
        try:
            return Dumped(answer=await request(self.wrapper(kernel_id)))
        except catch as exc:
            try:
                sealed = await asyncio.to_thread(after_failed_dump, exc, dest, wrapper_pid)
            except SnapshotError:
                if keep_error:
                    raise exc from None
                raise
            return Dumped(sealed=sealed, error=exc)
        finally:
            lock.release()

    async def notebook_path(self, kernel_id: str) -> str | None:
        with contextlib.suppress(Exception):
            for session in await self.session_manager.list_sessions():
                if session.get("kernel", {}).get("id") == kernel_id:
                    return str(session.get("path"))
        return None

    async def kernel_status(self, kernel_id: str) -> dict[str, Any]:
        """The wrapper's view of a kernel: state, activity, whether a job runs on it. A
        lazy restore is "transferring" until this server is done with it too (what the
        pages were read from given back: the download cached or removed)."""
        try:
            status: dict[str, Any] = dict(await self.wrapper(kernel_id).status())
        except (WrapperUnavailableError, SnapshotNotFoundError) as exc:
            # Not a snapshot kernel, or one that went away since it was listed.
            return {"kernel_id": kernel_id, "snapshots": False, "reason": exc.message}
        lazy = status.get("lazy_restore") or {}
        if kernel_id in self._settling and lazy.get("state") == "complete":
            status["lazy_restore"] = {**lazy, "state": "transferring"}
        job = self._kernel_jobs.get(kernel_id)
        status.update(
            kernel_id=kernel_id,
            snapshots=True,
            job=job.to_dict() if job else None,
            periodic=kernel_id not in self.periodic_opt_out,
        )
        return status

    async def kernels(self) -> list[dict[str, Any]]:
        """Every kernel's status, its wrapper asked for all kernels at once."""
        kernel_ids = list(self.kernel_manager.list_kernel_ids())
        return list(await asyncio.gather(*(self.kernel_status(kid) for kid in kernel_ids)))

    def _progress(
        self,
        job: Job,
        phase: Phase | None = None,
        done_bytes: int | None = None,
        total_bytes: int | None = None,
    ) -> None:
        """Record a job's progress and tell listeners with a "progress" event: at once for
        a new phase or the last byte, else at most every PROGRESS_EVENT_INTERVAL."""
        new_phase = phase is not None and phase != job.phase
        if phase is not None:
            job.phase = phase
        if done_bytes is not None:
            job.done_bytes = int(done_bytes)
        if total_bytes is not None:
            job.total_bytes = int(total_bytes)
        now = time.monotonic()
        finished = job.total_bytes > 0 and job.done_bytes >= job.total_bytes
        if not (new_phase or finished) and now - job.last_event < PROGRESS_EVENT_INTERVAL:
            return
        job.last_event = now
        self.emit(
            "progress",
            {
                "job_id": job.id,
                "kernel_id": job.kernel_id,
                "kind": job.kind,
                "phase": job.phase,
                "done_bytes": job.done_bytes,
                "total_bytes": job.total_bytes,
            },
        )

    def _wrapper_progress(self, job: Job) -> ProgressCallback:
        """A progress callback for a wrapper request: its events name the phase."""
        return lambda event: self._progress(job, event["phase"])

    def _progress_callback(self, job: Job | None) -> ProgressCallback:
        """A progress callback for store work running in a thread: it hands each report
        to the event loop (events are emitted there only)."""
        loop = asyncio.get_running_loop()

        def on_progress(event: ProgressEvent) -> None:
            if job is not None:
                loop.call_soon_threadsafe(
                    self._progress,
                    job,
                    event["phase"],
                    event.get("done_bytes"),
                    event.get("total_bytes"),
                )

        return on_progress

    def _start_job(self, kind: str, kernel_id: str | None, work: Callable[[Job], Any]) -> Job:
        job = Job(id=secrets.token_hex(8), kind=kind, kernel_id=kernel_id)
        self.jobs[job.id] = job
        if kernel_id is not None:
            self._kernel_jobs[kernel_id] = job

        async def run() -> None:
            try:
                job.result = await work(job)
                job.status = "done"
                job.phase = "done"
            except SnapshotError as exc:
                job.status = "failed"
                job.error = exc.to_dict()
                job.exception = exc
                self.emit(
                    "failed",
                    {
                        "job_id": job.id,
                        "kind": kind,
                        "kernel_id": kernel_id,
                        "message": exc.message,
                        "hint": exc.hint,
                    },
                )
                log.warning("%s of kernel %s failed: %s", kind, kernel_id, exc)
            except Exception as exc:
                job.status = "failed"
                job.error = SnapshotError(f"Internal error: {exc!r}").to_dict()
                self.emit(
                    "failed",
                    {
                        "job_id": job.id,
                        "kind": kind,
                        "kernel_id": kernel_id,
                        "message": repr(exc),
                        "hint": "",
                    },
                )
                log.exception("%s of kernel %s failed", kind, kernel_id)
            finally:
                job.finished = time.time()
                job.done.set()
                if kernel_id is not None and self._kernel_jobs.get(kernel_id) is job:
                    del self._kernel_jobs[kernel_id]
                self._forget_old_jobs()

        task = asyncio.ensure_future(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    def _forget_old_jobs(self, keep: int = 200) -> None:
        done = [j for j in self.jobs.values() if j.finished is not None]
        for job in sorted(done, key=lambda j: j.finished or 0)[:-keep]:
            self.jobs.pop(job.id, None)

    def job(self, job_id: str) -> Job:
        if not re.fullmatch(r"[0-9a-f]{16}", job_id) or job_id not in self.jobs:
            raise SnapshotNotFoundError(f"There is no job {job_id!r}.")
        return self.jobs[job_id]

    async def wait(self, job: Job, timeout: float | None = None) -> Job:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(job.done.wait(), timeout)
        return job

    async def wait_checked(self, job: Job) -> None:
        """Wait until a restore has checked its snapshot; raise its error if that failed."""
        checked = asyncio.ensure_future(job.checked.wait())
        done = asyncio.ensure_future(job.done.wait())
        await asyncio.wait([checked, done], return_when=asyncio.FIRST_COMPLETED)
        checked.cancel()
        done.cancel()
        if job.exception is not None:
            raise job.exception

    def _busy(self, kernel_id: str) -> None:
        running = self._kernel_jobs.get(kernel_id)
        if running is not None and running.status == "running":
            raise SnapshotBusyError(
                f"A {running.kind} of kernel {kernel_id} is already in progress "
                f"(job {running.id}).",
                hint="Wait for it to finish; its progress is at /api/snapshots/jobs/" + running.id,
            )

    # Used by jupyter_ext.variables (a job of its own kind, beside restores).
    check_not_busy = _busy
    start_job = _start_job
    progress = _progress

    def has_job(self, kernel_id: str) -> bool:
        """Whether a job (snapshot, restore, suspend, resume) runs on the kernel now."""
        return kernel_id in self._kernel_jobs
