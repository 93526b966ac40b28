"""The snapshot manager: takes, lists, restores and deletes snapshots for one server.

It joins the core (wrapper control client, store) to jupyter_server's kernel and session
managers. Long work runs as :class:`Job` objects that report progress, so the REST API
can return at once. Handlers never touch kernels or stores directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .core import private, proctree
from .core.compat import check_compatible
from .core.contents import short_contents
from .core.criu import Criu
from .core.errors import (
    BadIdError,
    SnapshotBusyError,
    SnapshotError,
    SnapshotNotFoundError,
    WrapperUnavailableError,
)
from .core.imagecache import ImageCache, Lease, lock_shared, stamp_checked, stamp_tree
from .core.lazypages import PAGES_FILE_RE, PrefixedPages, RangeServer, restore_order, worth_lazy
from .core.leftovers import (
    DumpLock,
    after_failed_dump,
    lock_directory,
    remove_orphaned_dumps,
    remove_unlocked,
)
from .core.manifest import (
    IMAGES_DIR,
    MANIFEST_NAME,
    SNAPSHOT_ID_RE,
    Manifest,
    Stamps,
    check_snapshot_id,
    new_snapshot_id,
    remove_tree,
    verify,
)
from .core.protocol import (
    ENV_AWAIT_RESTORE,
    Phase,
    ProgressCallback,
    ProgressEvent,
    RestoreRequest,
    SnapshotArgs,
    SuspendArgs,
    WrapperClient,
    WrapperInfo,
)
from .core.retention import Retained, RetentionPolicy, plan_retention
from .core.store import SnapshotImages, SnapshotStore, StoredSnapshot, StoreError

log = logging.getLogger("jupyter_ext")

KERNEL_ID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
#: Byte progress goes out as events at most this often (seconds) per job.
PROGRESS_EVENT_INTERVAL = 0.25

EmitEvent = Callable[[str, dict[str, Any]], None]


#: The longest a cache entry stays held for a kernel's lazy restore after its job ended.
LAZY_HOLD_SECONDS = 3600.0
#: The images a lazy restore from the store does not download first: the kernel's memory.


def _released(lease: Lease) -> Callable[[dict[str, Any]], Awaitable[None]]:
    async def release(_outcome: dict[str, Any]) -> None:
        lease.release()

    return release


class LentPages:
    """A stored snapshot's memory lent to the wrapper that restores it lazily: the
    store's verified ranges, served on a unix socket in a private folder (the wrapper is
    another process; socket paths must stay short)."""

    def __init__(self, snapshot_id: str, images: SnapshotImages) -> None:
        self.snapshot_id = snapshot_id
        self.images = images
        self.folder = Path(tempfile.mkdtemp(prefix="jks-pages-"))
        try:
            self.server = RangeServer(
                PrefixedPages(images, f"{IMAGES_DIR}/"), self.folder / "pages.sock"
            )
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise

    @property
    def address(self) -> str:
        return self.server.address

    def close(self) -> None:
        self.server.close()
        self.images.close()
        shutil.rmtree(self.folder, ignore_errors=True)


#: A dump or download directory nothing was written to for this long was left by a crash
#: (an active one writes its files within seconds).
STALE_WORK_SECONDS = 3600.0


def _untouched_for(path: Path, seconds: float) -> bool:
    """Whether nothing in ``path`` (a file or a tree) changed in the last ``seconds``."""
    newest = 0.0
    with contextlib.suppress(OSError):
        newest = path.lstat().st_mtime
        for sub in path.rglob("*") if path.is_dir() else []:
            with contextlib.suppress(OSError):
                newest = max(newest, sub.lstat().st_mtime)
    return time.time() - newest > seconds


def _reason(outcome: Job | SnapshotError) -> str:
    """Why a snapshot is missing: a failed or unfinished job, or a refused start."""
    if isinstance(outcome, SnapshotError):
        return outcome.message
    if outcome.status == "running":
        return f"it did not finish in time (it was {outcome.phase})"
    return str((outcome.error or {}).get("message", "it failed"))


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


def _hold_shared(directory: Path) -> int:
    """A shared lock on ``directory`` if it is still there (the same directory once
    locked), else -1."""
    try:
        fd = lock_shared(directory)
    except FileNotFoundError:
        return -1
    try:
        if os.path.samestat(os.fstat(fd), os.stat(directory)):
            return fd
    except FileNotFoundError:
        pass
    os.close(fd)
    return -1


@dataclass
class PendingUpload:
    """A snapshot dumped and sealed locally whose upload to the store has not succeeded."""

    manifest: Manifest
    directory: Path
    error: str = ""
    attempts: int = 0
    in_flight: bool = False


class SnapshotManager:
    """One per server: jobs, policies and the store of each user."""

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

    # ---------------------------------------------------------------- kernels

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

    # ---------------------------------------------------------------- listing

    async def list_snapshots(self, **filters: str | None) -> dict[str, Any]:
        """Complete snapshots in the store, plus local ones waiting for upload.

        An unreachable store still lists the local ones, with ``store_error`` saying why
        the others are missing. Store calls run in a thread: a slow or unreachable S3
        endpoint must never block the server's event loop.
        """
        store_error = ""
        try:
            stored = await asyncio.to_thread(self.store.snapshots)
            entries = [self._describe(s, "complete") for s in stored]
        except StoreError as exc:
            entries, store_error = [], str(exc)
        for pending in self.pending.values():
            status = "upload-failed" if pending.error else "uploading"
            entries.append(self._describe_manifest(pending.manifest, status, pending.error))
        kernel_id = filters.get("kernel_id")
        path = filters.get("path")
        trigger = filters.get("trigger")
        if kernel_id:
            entries = [e for e in entries if e.get("kernel_id") == kernel_id]
        if path:
            entries = [e for e in entries if e.get("notebook_path") == path]
        if trigger:
            entries = [e for e in entries if e.get("trigger") == trigger]
        entries.sort(key=lambda e: (e["created"], e["sequence"]), reverse=True)
        return {"snapshots": entries, "store_error": store_error}

    async def get(self, snapshot_id: str) -> dict[str, Any]:
        check_snapshot_id(snapshot_id)
        pending = self.pending.get(snapshot_id)
        if pending is not None:
            status = "upload-failed" if pending.error else "uploading"
            return self._describe_manifest(pending.manifest, status, pending.error, full=True)
        stored = await asyncio.to_thread(self.store.get, snapshot_id)
        return self._describe(stored, "complete", full=True)

    @staticmethod
    def _describe_manifest(
        manifest: Manifest, status: str, error: str = "", full: bool = False
    ) -> dict[str, Any]:
        """The API's form of a snapshot: a listing carries the short form of what it holds
        (core.contents.short_contents), a single snapshot (``full``) the whole record."""
        data = manifest.to_dict()
        if not full:
            data["contents"] = short_contents(manifest.contents)
        data.pop("files", None)
        data.pop("needed_files", None)
        data.pop("bound_ports", None)
        data.pop("cpu_flags", None)
        data.update(
            status=status,
            error=error,
            kernel_id=manifest.kernel_spec.get("kernel_id"),
            gpu_bytes=int(manifest.gpu.get("total_bytes", 0)) if manifest.gpu else 0,
        )
        return data

    def _describe(self, stored: StoredSnapshot, status: str, full: bool = False) -> dict[str, Any]:
        data = self._describe_manifest(stored.manifest, status, full=full)
        data.update(stored_bytes=stored.stored_bytes, new_bytes=stored.new_bytes)
        return data

    # ---------------------------------------------------------------- jobs

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

    # ---------------------------------------------------------------- create

    # Used by jupyter_ext.variables (a job of its own kind, beside restores).
    check_not_busy = _busy
    start_job = _start_job
    progress = _progress

    async def restore_side_kernel(self, job: Job, snapshot_id: str) -> dict[str, Any]:
        """Restore a snapshot into a new kernel attached to no notebook (variables.py)."""
        return await self._restore(job, snapshot_id, None, None, attach=False)

    def has_job(self, kernel_id: str) -> bool:
        """Whether a job (snapshot, restore, suspend, resume) runs on the kernel now."""
        return kernel_id in self._kernel_jobs

    def create(self, kernel_id: str, trigger: str = "manual") -> Job:
        """Snapshot a running kernel; the kernel is frozen only while CRIU dumps."""
        self.kernel(kernel_id)
        self._busy(kernel_id)
        return self._start_job(
            "snapshot", kernel_id, lambda job: self._snapshot(job, kernel_id, trigger)
        )

    async def _snapshot(
        self, job: Job, kernel_id: str, trigger: str, leave_running: bool = True
    ) -> dict[str, Any]:
        km = self.kernel(kernel_id)
        path = await self.notebook_path(kernel_id)
        dest = self.staging_dir / new_snapshot_id()
        self.emit("started", {"kernel_id": kernel_id, "trigger": trigger, "job_id": job.id})

        spec = {"name": km.kernel_name, "kernel_id": kernel_id}
        wrapper_pid = None
        with contextlib.suppress(SnapshotError):
            wrapper_pid = WrapperInfo.for_connection_file(Path(km.connection_file)).pid
        lock = DumpLock(dest)  # if this server dies meanwhile, its next start cleans up
        try:
            data = await self.wrapper(kernel_id).snapshot(
                SnapshotArgs(
                    str(dest),
                    trigger=trigger,
                    leave_running=leave_running,
                    metadata={"kernel_spec": spec, "notebook_path": path},
                    release_gpu_caches=self.release_gpu_caches,
                    chunk_kib=self.chunk_kib,
                    write_back=self.store.adopts_images,
                ),
                self._wrapper_progress(job),
            )
        except SnapshotError as exc:
            # A killed wrapper leaves its partial dump (the kernel's size): removed now.
            manifest = await asyncio.to_thread(after_failed_dump, exc, dest, wrapper_pid)
        else:
            manifest = Manifest.from_dict(data)
        finally:
            lock.release()
        stored = await self._upload(job, manifest, dest)
        result = stored if stored is not None else await self.get(manifest.id)
        self.emit(
            "created",
            {
                "kernel_id": kernel_id,
                "snapshot_id": manifest.id,
                "trigger": trigger,
                "bytes": manifest.total_bytes,
                "status": result["status"],
            },
        )
        return result

    async def _upload(
        self, job: Job | None, manifest: Manifest, directory: Path
    ) -> dict[str, Any] | None:
        """Put a sealed snapshot into the store; keep it locally (pending) if that fails."""
        store = self.store
        pending = self.pending.setdefault(manifest.id, PendingUpload(manifest, directory))
        if pending.in_flight:  # a retry while the previous attempt still runs
            return None
        pending.attempts += 1
        pending.in_flight = True

        if job is not None:
            self._progress(job, "uploading")
        try:
            stored = await asyncio.to_thread(store.put, directory, self._progress_callback(job))
        except SnapshotError as exc:
            pending.error = exc.message
            log.warning("upload of snapshot %s failed (kept locally): %s", manifest.id, exc)
            return None
        finally:
            pending.in_flight = False
        del self.pending[manifest.id]
        # A restore that reads the directory meanwhile (restorable there while its upload
        # failed) holds it shared: it is moved or removed only after that restore.
        held = await asyncio.to_thread(lock_directory, directory)
        try:
            if self.image_cache.enabled:  # kept for restores on this machine, as checked
                stamps = await asyncio.to_thread(stamp_checked, directory)
                if stamps is not None:
                    await asyncio.to_thread(self.image_cache.admit, directory, stamps)
            shutil.rmtree(directory, ignore_errors=True)  # not admitted
        finally:
            os.close(held)
        try:  # the snapshot is durable: the job succeeded whatever retention does
            await asyncio.to_thread(self.apply_retention, stored.manifest)
        except SnapshotError as exc:
            log.warning("retention after snapshot %s failed: %s", manifest.id, exc)
        return self._describe(stored, "complete")

    async def retry_uploads(self) -> None:
        """Try failed uploads again (called periodically by the extension)."""
        for pending in list(self.pending.values()):
            if not (pending.directory / MANIFEST_NAME).exists():
                # Uploaded and removed by another server sharing this work directory.
                del self.pending[pending.manifest.id]
            elif pending.error:  # stays "upload-failed" until an attempt succeeds
                await self._upload(None, pending.manifest, pending.directory)

    def recover_staged(self, stale_after: float = STALE_WORK_SECONDS) -> list[str]:
        """After a restart: take up the snapshots sealed here whose upload never succeeded
        (the store was down when the server stopped, say), and remove what dumps and
        downloads cut short by a crash left behind. Returns the ids taken up; their
        upload is retried like any failed one, and they are listed meanwhile."""
        recovered = []
        suspended_dir = self.work_dir / "suspended"
        for directory in (self.staging_dir, suspended_dir):
            if directory.is_dir():  # dumps of a server that died: at once, not in an hour
                for path in remove_orphaned_dumps(directory):
                    log.info("Removed %s, left by a dump whose server ended", path)
        for path in remove_unlocked(self.cache_dir):  # likewise its downloads
            log.info("Removed %s, left by a restore whose server ended", path)
        for path in self.image_cache.recover():
            log.info("Removed %s from the image cache (broken, or left by a crash)", path)
        for entry in sorted(self.staging_dir.iterdir()):
            if SNAPSHOT_ID_RE.match(entry.name) and (entry / MANIFEST_NAME).is_file():
                try:
                    manifest = Manifest.read(entry)
                except SnapshotError as exc:
                    log.warning("Removing %s, not a snapshot: %s", entry, exc)
                    remove_tree(entry)
                    continue
                if manifest.id in self.pending:
                    continue
                self.pending[manifest.id] = PendingUpload(
                    manifest, entry, error="Not stored yet (found when the server started)."
                )
                recovered.append(manifest.id)
            elif _untouched_for(entry, stale_after):
                log.info("Removing %s, left by an interrupted snapshot", entry)
                remove_tree(entry)
        for entry in self.cache_dir.iterdir():
            if _untouched_for(entry, stale_after):
                log.info("Removing %s, left by an interrupted restore", entry)
                remove_tree(entry)
        if suspended_dir.is_dir():  # sealed ones belong to suspended kernels: never removed
            for entry in suspended_dir.glob(".*.partial-*"):
                if _untouched_for(entry, stale_after):
                    log.info("Removing %s, left by an interrupted suspend", entry)
                    remove_tree(entry)
        return recovered

    # ---------------------------------------------------------------- retention

    _retention_pass = threading.Lock()
    """Retention runs one pass at a time in this process (jobs finishing together each
    apply it): concurrent passes planned over the same listing and deleted twice."""

    def apply_retention(self, newest: Manifest) -> list[str]:
        """Keep the last N per notebook and a total byte budget; never the newest of any
        (the choice is :func:`~.core.retention.plan_retention`'s)."""
        with self._retention_pass:
            return self._retention_pass_once(newest)

    def _retention_pass_once(self, newest: Manifest) -> list[str]:
        store = self.store
        plan = plan_retention(
            (Retained.of(s.manifest) for s in store.snapshots()),
            Retained.of(newest),
            RetentionPolicy(
                keep_last=self.keep_last,
                max_bytes=self.max_bytes,
                keep_hourly_hours=self.keep_hourly_hours,
                keep_daily_days=self.keep_daily_days,
            ),
        )
        removed: list[str] = []
        for snapshot_id in plan.by_count:
            if self._is_lent(snapshot_id):  # a kernel still reads its pages: next time
                continue
            store.delete(snapshot_id, missing_ok=True)  # another server's pass may be first
            removed.append(snapshot_id)
        for snapshot_id in plan.over_budget:
            # Chunks are shared between snapshots: what a deletion frees is what the store
            # says it holds afterwards, not the sum of the snapshots' sizes.
            if store.stats().stored_bytes <= self.max_bytes:
                break
            if self._is_lent(snapshot_id):
                continue
            store.delete(snapshot_id, missing_ok=True)
            removed.append(snapshot_id)
        for snapshot_id in removed:
            self.image_cache.discard(snapshot_id)
            self.emit("deleted", {"snapshot_id": snapshot_id, "reason": "retention"})
        return removed

    # ---------------------------------------------------------------- restore

    def restore(
        self,
        snapshot_id: str,
        *,
        kernel_id: str | None = None,
        path: str | None = None,
    ) -> Job:
        """Restore into the running kernel ``kernel_id`` (in place), or into a new kernel.

        A new kernel is attached to the notebook ``path`` (default: the snapshot's own).
        """
        check_snapshot_id(snapshot_id)
        if path is not None:
            path = validate_notebook_path(path)
        if kernel_id is not None:
            self.kernel(kernel_id)
            self._busy(kernel_id)
        return self._start_job(
            "restore",
            kernel_id,
            lambda job: self._restore(job, snapshot_id, kernel_id, path),
        )

    async def _manifest_of(self, snapshot_id: str) -> Manifest:
        """The manifest of a snapshot, stored or waiting for its upload (404 if neither)."""
        pending = self.pending.get(snapshot_id)
        if pending is not None:
            return pending.manifest
        stored = await asyncio.to_thread(self.store.get, snapshot_id)
        return stored.manifest

    async def _local_copy(
        self, job: Job, snapshot_id: str, *, without_pages: bool = False
    ) -> tuple[Path, int, bool]:
        """A local directory of the snapshot, the fd that holds its lock, which the caller
        closes once done with it, and whether it is a temporary copy (a download, removed
        or admitted into the image cache after the restore). A snapshot waiting for its
        upload is read where it is, held shared so that an upload succeeding meanwhile
        leaves it until then. ``without_pages`` leaves the kernel's memory in the store
        (a lazy restore reads it from there)."""
        pending = self.pending.get(snapshot_id)
        if pending is not None:
            held = await asyncio.to_thread(_hold_shared, pending.directory)
            if held >= 0:
                return pending.directory, held, False
            # Stored meanwhile (moved into the image cache or removed): from the store.
        dest = self.cache_dir / f"{snapshot_id}-{secrets.token_hex(4)}"
        self._progress(job, "downloading")
        try:
            await asyncio.to_thread(
                self.store.fetch,
                snapshot_id,
                dest,
                self._progress_callback(job),
                skip=(lambda path: PAGES_FILE_RE.fullmatch(path) is not None)
                if without_pages
                else None,
            )
            # Locked until the restore removed the copy (the store locks it while it
            # downloads): after a crash of this server, its next start removes it at once.
            # Shared: the image cache's lease on it, once admitted, is shared too.
            fd = lock_shared(dest)
        except BaseException:
            remove_tree(dest)  # the store removes its partial download; this is the rest
            raise
        return dest, fd, True

    async def _cached(self, job: Job, snapshot_id: str) -> Lease | None:
        """The snapshot's entry in the image cache, held for the restore, or None. Its
        manifest is checked (its own checksum); its files by :meth:`_intact`."""
        if snapshot_id in self.pending or not self.image_cache.enabled:
            return None
        lease = await asyncio.to_thread(self.image_cache.lease, snapshot_id)
        if lease is not None:
            self._progress(job, "checking-cache")
        return lease

    async def _intact(self, job: Job, lease: Lease) -> Lease | None:
        """The lease if its files are as stamped; else they are hashed again here, locally
        (after the request was answered), and the entry is dropped if a byte differs."""
        if lease.fresh:
            return lease
        self._progress(job, "verifying", 0, lease.entry.bytes)
        if await asyncio.to_thread(lease.reverify):
            return lease
        log.warning("cached snapshot %s failed its check: restoring from the store", lease.path)
        return None

    async def _restore(
        self,
        job: Job,
        snapshot_id: str,
        kernel_id: str | None,
        path: str | None,
        attach: bool = True,
    ) -> dict[str, Any]:
        # Served from the image cache when it holds the snapshot intact: no store request.
        lease = await self._cached(job, snapshot_id)
        temporary = False
        download_lock = -1
        lent: LentPages | None = None
        try:
            # Refused before any download (the request answers 404 or 422): a snapshot that
            # is not there, or that cannot run on this machine, as its manifest says.
            manifest = lease.manifest if lease else await self._manifest_of(snapshot_id)
            check_compatible(manifest)
            job.checked.set()
            if lease is not None:
                lease = await self._intact(job, lease)
            if lease is not None:
                directory, manifest, source = lease.path, lease.manifest, "cache"
            else:
                # Into a new kernel, lazily: all but the kernel's memory first; the kernel
                # runs while its pages come (each chunk checked). Not in place: there a
                # damaged chunk must fail the restore before the running kernel is touched.
                # Never a side kernel (variables.py): a damaged page would end it midway.
                lazily = (
                    self.lazy_restore
                    and self.lazy_from_store
                    and kernel_id is None
                    and attach
                    and snapshot_id not in self.pending
                    and worth_lazy(manifest.gpu)
                    and await self._lazy_pages_here()
                )
                directory, download_lock, temporary = await self._local_copy(
                    job, snapshot_id, without_pages=lazily
                )
                source = "store" if temporary else "work-directory"
                if lazily:
                    lent = await self._lend(snapshot_id, directory)
                stamps: Stamps | None = None
                if temporary and self.image_cache.enabled and not lazily:  # as soon as written
                    with contextlib.suppress(OSError):
                        stamps = await asyncio.to_thread(stamp_tree, directory)
                # Every file against its sha256 before CRIU starts: a corrupt snapshot fails
                # the job here, and a kernel restored in place keeps running untouched. A
                # download from the store checked each file as it wrote it.
                if temporary:
                    manifest = await asyncio.to_thread(Manifest.read, directory)
                else:
                    self._progress(job, "verifying")
                    manifest = await asyncio.to_thread(verify, directory)
                if stamps is not None:  # kept for the next restore on this machine
                    lease = await asyncio.to_thread(
                        self.image_cache.admit, directory, stamps, lease=True
                    )
                    if lease is not None:
                        directory, temporary = lease.path, False
            self._progress(job, "restoring")
            pages_from = lent.address if lent is not None else None
            if kernel_id is not None:  # never lazily from the store (see above)
                await self._restore_in_place(job, kernel_id, directory)
            else:
                kernel_id = await self._start_restored_kernel(job, manifest, directory, pages_from)
            if lease is not None:  # a lazily restored kernel still reads its pages there
                self._after_lazy(kernel_id, _released(lease), LAZY_HOLD_SECONDS)
                lease = None
            if lent is not None:  # lent until every page is in, then cached
                self._after_lazy(
                    kernel_id, self._lazy_download_done(directory, download_lock, lent)
                )
                lent, temporary, download_lock = None, False, -1
            target_path = (path or manifest.notebook_path) if attach else None
            session = await self._attach(kernel_id, target_path) if target_path else None
        finally:
            if lent is not None:
                await self._give_back(lent)
            if temporary:
                shutil.rmtree(directory, ignore_errors=True)
            if download_lock >= 0:  # removed, or admitted (the lease holds it now)
                os.close(download_lock)
            if lease is not None:
                lease.release()
        self.emit(
            "restored", {"snapshot_id": snapshot_id, "kernel_id": kernel_id, "path": target_path}
        )
        return {
            "kernel_id": kernel_id,
            "snapshot_id": snapshot_id,
            "session": session,
            "running_request": manifest.running_request,
            "source": source,
            # Connections to peers outside the kernel came back closed (docs/network.md).
            "closed_connections": manifest.closed_connections,
        }

    def _after_lazy(
        self,
        kernel_id: str,
        then: Callable[[dict[str, Any]], Awaitable[None]],
        timeout: float | None = None,
    ) -> None:
        """Once a lazily restored kernel has all of its memory ("transferring" no longer
        in its status), or is gone, or after ``timeout``: ``then(outcome)``, the status's
        ``lazy_restore`` (empty when the kernel is gone or still transferring). Until then
        what its pages are read from stays (a cache entry no eviction removes, a download
        and the store lent to its wrapper)."""

        async def wait() -> None:
            outcome: dict[str, Any] = {}
            try:
                deadline = None if timeout is None else time.monotonic() + timeout
                while deadline is None or time.monotonic() < deadline:
                    try:
                        status = await self.wrapper(kernel_id).status()
                    except (WrapperUnavailableError, SnapshotNotFoundError):
                        break  # the kernel is gone (or going): give back at once
                    except (SnapshotError, TimeoutError) as exc:
                        if not await self._kernel_alive(kernel_id):
                            break
                        # A slow or failed answer: a live kernel keeps what it reads from.
                        log.warning("status of lazily restored kernel %s: %r", kernel_id, exc)
                        await asyncio.sleep(0.2)
                        continue
                    lazy = status.get("lazy_restore") or {}
                    if lazy.get("state") != "transferring":
                        outcome = lazy
                        break
                    await asyncio.sleep(0.2)
            finally:
                try:
                    await then(outcome)
                finally:
                    self._settling.discard(kernel_id)
            if outcome.get("state") == "failed":  # after the job said "done": say it now
                error = outcome.get("error") or {}
                log.warning("lazy restore of kernel %s failed: %s", kernel_id, error)
                self.emit(
                    "failed",
                    {
                        "kind": "restore",
                        "kernel_id": kernel_id,
                        "phase": "transferring",
                        "message": error.get("message", "the kernel's memory did not arrive"),
                        "hint": error.get("hint", ""),
                    },
                )

        self._settling.add(kernel_id)
        task = asyncio.ensure_future(wait())
        self._tasks.add(task)
        self._lazy_watchers.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(self._lazy_watchers.discard)

    async def lazy_restores_settled(self) -> None:
        """Wait until every lazily restored kernel has its memory, and what it was read
        from is given back (cached or removed)."""
        while self._lazy_watchers:
            await asyncio.wait(list(self._lazy_watchers))

    async def _lazy_pages_here(self) -> bool:
        """Whether kernels here restore lazily (as their wrappers find out: root and a
        CRIU whose lazy pages work); if not, restores from the store download first."""
        if self._lazy_pages is None:
            try:
                criu = await asyncio.to_thread(Criu.locate)
                self._lazy_pages = (await asyncio.to_thread(criu.supports_lazy_pages))[0]
            except SnapshotError:
                self._lazy_pages = False
        return self._lazy_pages

    async def _lend(self, snapshot_id: str, directory: Path) -> LentPages:
        """Lend a stored snapshot's pages to a lazy restore (it is not deleted meanwhile),
        and download them into ``directory`` as the kernel runs: what ``criu restore``
        reads from the files before this returns, then the smallest memory areas first."""
        images = await asyncio.to_thread(self.store.open_images, snapshot_id)
        lent = LentPages(snapshot_id, images)
        self.lent.add(lent)
        try:
            now, first = await asyncio.to_thread(restore_order, directory / IMAGES_DIR)
            prefix = f"{IMAGES_DIR}/"
            await asyncio.to_thread(
                images.download_into,
                directory,
                [f.path for f in images.manifest.files if PAGES_FILE_RE.fullmatch(f.path)],
                now=[(prefix + name, offset, length) for name, offset, length in now],
                first=[(prefix + name, offset, length) for name, offset, length in first],
            )
        except BaseException:
            await self._give_back(lent)
            raise
        return lent

    async def _give_back(self, lent: LentPages) -> None:
        """Stop lending (the download stops; its reads in flight end first)."""
        try:
            await asyncio.shield(asyncio.to_thread(lent.close))
        finally:
            self.lent.discard(lent)

    def _is_lent(self, snapshot_id: str) -> bool:
        return any(lent.snapshot_id == snapshot_id for lent in list(self.lent))

    async def _kernel_alive(self, kernel_id: str) -> bool:
        """Whether the kernel is still this server's and its process runs."""
        if kernel_id not in self.kernel_manager:
            return False
        try:
            return bool(await self.kernel(kernel_id).is_alive())
        except SnapshotError:
            return False

    def _lazy_download_done(
        self, directory: Path, download_lock: int, lent: LentPages
    ) -> Callable[[dict[str, Any]], Awaitable[None]]:
        """After a lazy restore from the store: stop lending its pages; the download, now
        complete, is checked file by file and kept in the image cache, or removed."""

        async def done(outcome: dict[str, Any]) -> None:
            complete = outcome.get("state") == "complete"
            try:
                if complete:  # the kernel has its memory; the download goes on to the end
                    complete = await asyncio.to_thread(lent.images.wait_downloaded)
            finally:
                await self._give_back(lent)
            try:
                if complete and self.image_cache.enabled:
                    stamps = await asyncio.to_thread(stamp_tree, directory)
                    await asyncio.to_thread(verify, directory)  # every byte, as for a put
                    await asyncio.to_thread(self.image_cache.admit, directory, stamps)
            except (SnapshotError, OSError) as exc:
                log.warning("not caching the lazily restored %s: %s", directory.name, exc)
            finally:
                shutil.rmtree(directory, ignore_errors=True)  # unless admitted
                os.close(download_lock)

        return done

    async def _restore_in_place(self, job: Job, kernel_id: str, directory: Path) -> None:
        """Restore ``directory`` into the running kernel. The wrapper first saves that
        kernel into staging (a failed restore puts it back). If the wrapper dies meanwhile,
        what it saved is stored like any snapshot when it was sealed (the kernel's state,
        restorable), and removed at once when it was not."""
        save_to = self.staging_dir / new_snapshot_id()
        wrapper_pid = None
        with contextlib.suppress(SnapshotError):
            km = self.kernel(kernel_id)
            wrapper_pid = WrapperInfo.for_connection_file(Path(km.connection_file)).pid
        lock = DumpLock(save_to)  # if this server dies meanwhile, its next start cleans up
        try:
            await self.wrapper(kernel_id).restore(
                RestoreRequest(directory, verified=True, save_to=save_to),
                self._wrapper_progress(job),
            )
        except WrapperUnavailableError as exc:
            try:
                saved = await asyncio.to_thread(after_failed_dump, exc, save_to, wrapper_pid)
            except SnapshotError:
                raise exc from None
            log.warning("the kernel saved before a restore (%s) is stored", saved.id)
            await self._upload(None, saved, save_to)
            raise
        finally:
            lock.release()

    def start_reaping(self) -> None:
        """Without root a restored kernel needs the process ids it had. A kernel whose
        wrapper was killed ends within a second, but its zombie keeps its id until its
        new parent reaps it: PID 1 may take long (or, in a container, never). So this
        server adopts orphans (a child subreaper) and reaps them as they end (SIGCHLD),
        from now until :meth:`stop_reaping`. Called when the server starts, and before a
        restore into a new kernel."""
        if not self.reaps_orphans:
            return
        loop = asyncio.get_running_loop()
        if self._reaping_on is not loop:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                if proctree.set_subreaper(True):
                    loop.add_signal_handler(signal.SIGCHLD, self._reap_now)
                    self._reaping_on = loop
        self._reap_now()

    def stop_reaping(self) -> None:
        """Orphans go to PID 1 again (nothing here would reap them once the loop ends)."""
        loop, self._reaping_on = self._reaping_on, None
        if loop is None:
            return
        proctree.set_subreaper(False)
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(signal.SIGCHLD)
        self._reap_now()

    def _reap_now(self) -> None:
        self._kernel_pids = {  # still those processes (a pid may be reused)
            pid: start
            for pid, start in self._kernel_pids.items()
            if start and proctree.start_time(pid) == start
        }
        for pid in proctree.reap_adopted(self._kernel_pids):
            self._kernel_pids.pop(pid, None)

    async def _start_restored_kernel(
        self, job: Job, manifest: Manifest, directory: Path, pages_from: str | None = None
    ) -> str:
        """Start a new kernel whose wrapper waits for a restore, and restore ``directory``
        into it over its control socket, like any other operation."""
        self.start_reaping()
        marker = self.work_dir / f"await-restore-{secrets.token_hex(8)}"
        private.write_file(marker, b"")
        notebook_dir = None
        if manifest.notebook_path:
            notebook_dir = str(Path(manifest.notebook_path).parent)
        env = {**os.environ, ENV_AWAIT_RESTORE: str(marker)}
        kernel_name = manifest.kernel_spec.get("name") or self.kernel_name
        try:
            kernel_id: str = await self.kernel_manager.start_kernel(
                kernel_name=kernel_name, path=notebook_dir, env=env
            )
            km = self.kernel(kernel_id)
            try:
                wrapper = await WrapperClient.when_up(Path(km.connection_file), km.is_alive)
                request = RestoreRequest(directory, verified=True, pages_from=pages_from)
                await wrapper.restore(request, self._wrapper_progress(job))
            except BaseException:
                with contextlib.suppress(Exception):
                    await self.kernel_manager.shutdown_kernel(kernel_id, now=True)
                raise
        finally:
            marker.unlink(missing_ok=True)  # the wrapper took it, unless it never came up
        self.wrapper(kernel_id)  # the server reaps the restored kernel once orphaned
        return kernel_id

    async def _attach(self, kernel_id: str, path: str) -> dict[str, Any]:
        """Point the notebook's session at the kernel (create the session if needed).

        The kernel the session had is shut down unless another session uses it: after a
        kernel died, jupyter_server restarted an empty one under its id, which nothing
        would ever use or stop again.
        """
        sm = self.session_manager
        sessions = await sm.list_sessions()
        for session in sessions:
            if session.get("path") == path:
                old = (session.get("kernel") or {}).get("id")
                await sm.update_session(session["id"], kernel_id=kernel_id)
                updated: dict[str, Any] = await sm.get_session(session_id=session["id"])
                others = [s for s in sessions if s["id"] != session["id"]]
                if old and old != kernel_id:
                    await self._shutdown_unused(old, others)
                return updated
        created: dict[str, Any] = await sm.create_session(
            path=path, name=Path(path).name, type="notebook", kernel_id=kernel_id
        )
        return created

    async def _shutdown_unused(self, kernel_id: str, sessions: list[dict[str, Any]]) -> None:
        """Shut a kernel down that no session in ``sessions`` uses any more."""
        if any((s.get("kernel") or {}).get("id") == kernel_id for s in sessions):
            return
        if kernel_id not in self.kernel_manager:
            return
        log.info("shutting down kernel %s: its notebook has the restored kernel now", kernel_id)
        try:
            await self.kernel_manager.shutdown_kernel(kernel_id)
        except Exception:  # the restore itself succeeded: say so, go on
            log.warning("could not shut down the replaced kernel %s", kernel_id, exc_info=True)

    # ---------------------------------------------------------------- delete

    async def delete(self, snapshot_id: str) -> None:
        check_snapshot_id(snapshot_id)
        pending = self.pending.get(snapshot_id)
        if pending is not None:
            del self.pending[snapshot_id]
            shutil.rmtree(pending.directory, ignore_errors=True)
        else:
            # A kernel restored lazily from it reads its pages yet: deleted once they are in.
            while self._is_lent(snapshot_id):
                await asyncio.sleep(0.1)
            await asyncio.to_thread(self.store.delete, snapshot_id)
            await asyncio.to_thread(self.image_cache.discard, snapshot_id)
        self.emit("deleted", {"snapshot_id": snapshot_id, "reason": "request"})

    # ---------------------------------------------------------------- suspend

    def suspend(self, kernel_id: str, trigger: str = "idle-suspend") -> Job:
        """Snapshot the kernel and end its process (its GPU memory is freed)."""
        self.kernel(kernel_id)
        self._busy(kernel_id)
        return self._start_job(
            "suspend", kernel_id, lambda job: self._suspend(job, kernel_id, trigger)
        )

    async def _suspend(self, job: Job, kernel_id: str, trigger: str) -> dict[str, Any]:
        km = self.kernel(kernel_id)
        path = await self.notebook_path(kernel_id)
        suspended_dir = self.work_dir / "suspended"
        private.make_dirs(suspended_dir)
        dest = suspended_dir / new_snapshot_id()
        self._progress(job, "dumping")
        wrapper_pid = None
        with contextlib.suppress(SnapshotError):
            wrapper_pid = WrapperInfo.for_connection_file(Path(km.connection_file)).pid
        wrapper_gone = False
        lock = DumpLock(dest)
        try:
            data = await self.wrapper(kernel_id).suspend(
                SuspendArgs(
                    str(dest),
                    trigger=trigger,
                    metadata={
                        "kernel_spec": {"name": km.kernel_name, "kernel_id": kernel_id},
                        "notebook_path": path,
                    },
                    release_gpu_caches=self.release_gpu_caches,
                    chunk_kib=self.chunk_kib,
                    write_back=self.store.adopts_images,
                ),
                self._wrapper_progress(job),
            )
        except SnapshotError as exc:
            # Sealed before the wrapper died: the kernel's only copy, kept and stored.
            manifest = await asyncio.to_thread(after_failed_dump, exc, dest, wrapper_pid)
            wrapper_gone = True
        else:
            manifest = Manifest.from_dict(data)
        finally:
            lock.release()
        self.emit("suspended", {"kernel_id": kernel_id, "snapshot_id": manifest.id})
        # The wrapper resumes from `dest` and then deletes it; the store gets its own copy
        # (hard links: no extra space, independent lifetimes). No wrapper: it is moved.
        upload_dir = self.staging_dir / manifest.id
        if wrapper_gone:
            await asyncio.to_thread(dest.rename, upload_dir)
        else:
            await asyncio.to_thread(shutil.copytree, dest, upload_dir, copy_function=os.link)
        stored = await self._upload(job, manifest, upload_dir)
        return stored if stored is not None else await self.get(manifest.id)

    def resume(self, kernel_id: str) -> Job:
        self.kernel(kernel_id)
        self._busy(kernel_id)

        async def work(job: Job) -> dict[str, Any]:
            self._progress(job, "restoring")
            result = await self.wrapper(kernel_id).resume(self._wrapper_progress(job))
            self.emit("resumed", {"kernel_id": kernel_id, "snapshot_id": result["id"]})
            return dict(result)

        return self._start_job("resume", kernel_id, work)

    async def suspend_idle(
        self, idle_seconds: float, gpu_only: bool, gpu_kernels: Callable[[dict[str, Any]], bool]
    ) -> list[Job]:
        """Suspend kernels idle for longer than ``idle_seconds`` (never busy ones)."""
        jobs: list[Job] = []
        now = time.time()
        for kernel_id in list(self.kernel_manager.list_kernel_ids()):
            if kernel_id in self._kernel_jobs:
                continue
            status = await self.kernel_status(kernel_id)
            if not status.get("snapshots") or status.get("state") != "running":
                continue
            if status.get("execution_state") != "idle":
                continue
            if now - float(status.get("last_activity", now)) < idle_seconds:
                continue
            if gpu_only and not gpu_kernels(status):
                continue
            jobs.append(self.suspend(kernel_id))
        return jobs

    # ---------------------------------------------------------------- periodic

    async def periodic_pass(self) -> list[Job]:
        """Snapshot every snapshot kernel that ran something since its last snapshot."""
        jobs: list[Job] = []
        for kernel_id in list(self.kernel_manager.list_kernel_ids()):
            if kernel_id in self.periodic_opt_out or kernel_id in self._kernel_jobs:
                continue
            status = await self.kernel_status(kernel_id)
            if not status.get("snapshots") or status.get("state") != "running":
                continue
            if status.get("executions_since_snapshot", 0) <= 0:
                continue
            jobs.append(self.create(kernel_id, trigger="periodic"))
        return jobs

    async def snapshot_all(self, trigger: str, timeout: float) -> list[Job]:
        """Snapshot every running snapshot kernel at once, bounded in time (server shutdown).

        A snapshot that fails is tried once more. A kernel left without one is named in the
        log and in an "unsaved" event: it is about to be stopped, and what it holds is lost.
        """
        deadline = time.monotonic() + timeout
        kernel_ids = []
        for kernel_id in list(self.kernel_manager.list_kernel_ids()):
            status = await self.kernel_status(kernel_id)
            if status.get("snapshots") and status.get("state") == "running":
                kernel_ids.append(kernel_id)
        jobs: list[Job] = []
        last: dict[str, Job | SnapshotError] = {}
        for _attempt in ("first", "retry"):
            for kernel_id in kernel_ids:
                previous = last.get(kernel_id)
                if isinstance(previous, Job) and previous.status == "done":
                    continue
                if previous is not None:
                    log.warning(
                        "snapshot of kernel %s before the stop failed (%s); trying again",
                        kernel_id,
                        _reason(previous),
                    )
                last[kernel_id] = await self._start_snapshot(kernel_id, trigger, deadline)
            started = [job for job in last.values() if isinstance(job, Job)]
            jobs.extend(job for job in started if job not in jobs)
            for job in started:
                await self.wait(job, max(0.0, deadline - time.monotonic()))
            if time.monotonic() >= deadline:
                break
        for kernel_id, outcome in last.items():
            if isinstance(outcome, Job) and outcome.status == "done":
                continue
            reason = _reason(outcome)
            log.warning("kernel %s is stopped without a snapshot: %s", kernel_id, reason)
            self.emit("unsaved", {"kernel_id": kernel_id, "trigger": trigger, "message": reason})
        return jobs

    async def _start_snapshot(
        self, kernel_id: str, trigger: str, deadline: float
    ) -> Job | SnapshotError:
        """A snapshot job for the kernel, after any job already running on it."""
        running = self._kernel_jobs.get(kernel_id)
        if running is not None and running.status == "running":
            await self.wait(running, max(0.0, deadline - time.monotonic()))
        try:
            return self.create(kernel_id, trigger=trigger)
        except SnapshotError as exc:
            return exc
