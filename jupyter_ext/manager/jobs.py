"""Jobs: long work (snapshot, restore, suspend, resume) that reports progress, so that the
REST API can return at once; and the manager's background tasks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from .. import memory
from ..core.errors import JobNotFoundError, SnapshotBusyError, SnapshotError
from ..core.protocol.progress import Phase, ProgressCallback, ProgressEvent
from .shared import EmitEvent

log = logging.getLogger("jupyter_ext")

#: Byte progress goes out as events at most this often (seconds) per job.
PROGRESS_EVENT_INTERVAL = 0.25
#: The phases in the order a job goes through them (protocol.Phase).
PHASE_ORDER: dict[str, int] = {name: rank for rank, name in enumerate(get_args(Phase))}


#: What a job does (the REST contract's ``Job.kind`` and the panel's ``JobKind`` spell the
#: same list: a test checks).
JobKind = Literal[
    "snapshot", "restore", "suspend", "resume", "variables", "check", "prune", "undo", "redo"
]


@dataclass
class Job:
    """Work on a kernel (or the store) in progress, or done: its ``kind`` says what."""

    id: str
    kind: JobKind
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


class Jobs:
    """Every job of this server, at most one running per kernel, and their progress."""

    def __init__(self, emit: EmitEvent) -> None:
        self.emit = emit
        self.jobs: dict[str, Job] = {}
        self._kernel_jobs: dict[str, Job] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``work`` in the background, referenced until it ends (the loop does not
        keep tasks alive)."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def start(self, kind: JobKind, kernel_id: str | None, work: Callable[[Job], Any]) -> Job:
        """A job running ``work(job)``; a failure is recorded on it and told as "failed"."""
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
                self._failed(job, exc, exc.message, exc.hint)
                job.exception = exc
                log.warning("%s of kernel %s failed: %s", kind, kernel_id, exc)
            except Exception as exc:
                self._failed(job, SnapshotError(f"Internal error: {exc!r}"), repr(exc), "")
                log.exception("%s of kernel %s failed", kind, kernel_id)
            finally:
                job.finished = time.time()
                job.done.set()
                if kernel_id is not None and self._kernel_jobs.get(kernel_id) is job:
                    del self._kernel_jobs[kernel_id]
                self._forget_old()
                if not any(j.status == "running" for j in self.jobs.values()):
                    self.spawn(asyncio.to_thread(memory.give_back))

        self.spawn(run())
        return job

    def _failed(self, job: Job, error: SnapshotError, message: str, hint: str) -> None:
        """Record a failure on the job and tell listeners ("failed")."""
        job.status = "failed"
        job.error = error.to_dict()
        self.emit(
            "failed",
            {
                "job_id": job.id,
                "kind": job.kind,
                "kernel_id": job.kernel_id,
                "message": message,
                "hint": hint,
            },
        )

    def _forget_old(self, keep: int = 200) -> None:
        done = [j for j in self.jobs.values() if j.finished is not None]
        for job in sorted(done, key=lambda j: j.finished or 0)[:-keep]:
            self.jobs.pop(job.id, None)

    def job(self, job_id: str) -> Job:
        if not re.fullmatch(r"[0-9a-f]{16}", job_id) or job_id not in self.jobs:
            raise JobNotFoundError(f"There is no job {job_id!r}.")
        return self.jobs[job_id]

    def on(self, kernel_id: str) -> Job | None:
        """The job that runs on the kernel now, if any."""
        return self._kernel_jobs.get(kernel_id)

    def has_job(self, kernel_id: str) -> bool:
        """Whether a job (snapshot, restore, suspend, resume) runs on the kernel now."""
        return kernel_id in self._kernel_jobs

    def check_not_busy(self, kernel_id: str) -> None:
        """SnapshotBusyError if a job runs on the kernel: one at a time per kernel."""
        running = self._kernel_jobs.get(kernel_id)
        if running is not None and running.status == "running":
            raise SnapshotBusyError(
                f"A {running.kind} of kernel {kernel_id} is already in progress "
                f"(job {running.id}).",
                hint="Wait for it to finish; its progress is at /api/snapshots/jobs/" + running.id,
            )

    @staticmethod
    async def wait(job: Job, timeout: float | None = None) -> Job:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(job.done.wait(), timeout)
        return job

    @staticmethod
    async def wait_checked(job: Job) -> None:
        """Wait until a restore has checked its snapshot; raise its error if that failed."""
        checked = asyncio.ensure_future(job.checked.wait())
        done = asyncio.ensure_future(job.done.wait())
        await asyncio.wait([checked, done], return_when=asyncio.FIRST_COMPLETED)
        checked.cancel()
        done.cancel()
        if job.exception is not None:
            raise job.exception

    def progress(
        self,
        job: Job,
        phase: Phase | None = None,
        done_bytes: int | None = None,
        total_bytes: int | None = None,
    ) -> None:
        """Record a job's progress and tell listeners with a "progress" event: at once for
        a new phase or the last byte, else at most every PROGRESS_EVENT_INTERVAL.

        One story: a job's phase only moves forward (protocol.Phase's order; a part that
        reports a phase the job is past, as a wrapper repeating "verifying" after the
        server verified, is not heard), "done" only when the job has ended (a wrapper's
        "done" is the end of its part), and a new phase counts its own bytes."""
        if job.status != "running":
            return
        if phase is not None and phase != job.phase:
            if phase == "done" or PHASE_ORDER[phase] < PHASE_ORDER[job.phase]:
                return
            job.phase = phase
            job.done_bytes = job.total_bytes = 0
            new_phase = True
        else:
            new_phase = False
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

    def wrapper_progress(self, job: Job) -> ProgressCallback:
        """A progress callback for a wrapper request: its events name the phase."""
        return lambda event: self.progress(job, event["phase"])

    def threaded_progress(
        self, job: Job | None, renamed: dict[str, Phase] | None = None
    ) -> ProgressCallback:
        """A progress callback for store work running in a thread: it hands each report
        to the event loop (events are emitted there only), its phase ``renamed`` where
        that says (the store's "uploading" is "storing" for a local store)."""
        loop = asyncio.get_running_loop()
        names = renamed or {}

        def on_progress(event: ProgressEvent) -> None:
            if job is not None:
                loop.call_soon_threadsafe(
                    self.progress,
                    job,
                    names.get(event["phase"], event["phase"]),
                    event.get("done_bytes"),
                    event.get("total_bytes"),
                )

        return on_progress
