"""Each kernel's status as the API shows it, the per-kernel switch of automatic
snapshots, and the snapshots of all kernels before the server stops. What the policies
start each tick is decided in core/policies/tick.py (jupyter_ext/autosnap.py reads them)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ..core.errors import KernelNotFoundError, SnapshotError, WrapperUnavailableError
from .deaths import Deaths
from .jobs import Job, Jobs
from .kernel_jobs import KernelJobs
from .kernels import Kernels
from .lazy import LazyLending
from .shared import EmitEvent

log = logging.getLogger("jupyter_ext")


def _reason(outcome: Job | SnapshotError) -> str:
    """Why a snapshot is missing: a failed or unfinished job, or a refused start."""
    if isinstance(outcome, SnapshotError):
        return outcome.message
    if outcome.status == "running":
        return f"it did not finish in time (it was {outcome.phase})"
    return str((outcome.error or {}).get("message", "it failed"))


class Schedules:
    """Kernel statuses, the periodic switch, and the snapshots before a stop."""

    def __init__(
        self,
        kernels: Kernels,
        jobs: Jobs,
        lending: LazyLending,
        kernel_jobs: KernelJobs,
        deaths: Deaths,
        emit: EmitEvent,
    ) -> None:
        self.kernels = kernels
        self.jobs = jobs
        self.lending = lending
        self.kernel_jobs = kernel_jobs
        self.deaths = deaths
        self.emit = emit
        #: Kernels whose periodic snapshots are off.
        self.periodic_opt_out: set[str] = set()

    def set_periodic(self, kernel_id: str, on: bool) -> None:
        """Periodic snapshots of this kernel on (the default) or off."""
        if on:
            self.periodic_opt_out.discard(kernel_id)
        else:
            self.periodic_opt_out.add(kernel_id)

    async def kernel_status(self, kernel_id: str) -> dict[str, Any]:
        """The wrapper's view of a kernel: state, activity, whether a job runs on it, and
        its last death while the offer of its snapshot stands (deaths.py). A lazy restore
        is "transferring" until this server is done with it too (what the pages were read
        from given back: the download cached or removed)."""
        try:
            status: dict[str, Any] = dict(await self.kernels.wrapper(kernel_id).status())
        except (WrapperUnavailableError, KernelNotFoundError) as exc:
            # Not a snapshot kernel, one that went away since it was listed, or one whose
            # wrapper jupyter_client is starting again after a death.
            return {
                "kernel_id": kernel_id,
                "snapshots": False,
                "reason": exc.message,
                "death": await self.deaths.status(kernel_id, None),
            }
        lazy = status.get("lazy_restore") or {}
        if self.lending.settling(kernel_id) and lazy.get("state") == "complete":
            status["lazy_restore"] = {**lazy, "state": "transferring"}
        job = self.jobs.on(kernel_id)
        status.update(
            kernel_id=kernel_id,
            snapshots=True,
            job=job.to_dict() if job else None,
            periodic=kernel_id not in self.periodic_opt_out,
            death=await self.deaths.status(kernel_id, status),
        )
        return status

    async def kernels_status(self) -> list[dict[str, Any]]:
        """Every kernel's status, its wrapper asked for all kernels at once."""
        return list(await asyncio.gather(*(self.kernel_status(k) for k in self.kernels.ids())))

    async def snapshot_all(self, trigger: str, timeout: float) -> list[Job]:
        """Snapshot every running snapshot kernel at once, bounded in time (server shutdown).

        A snapshot that fails is tried once more. A kernel left without one is named in the
        log and in an "unsaved" event: it is about to be stopped, and what it holds is lost.
        """
        deadline = time.monotonic() + timeout
        kernel_ids = []
        for kernel_id in self.kernels.ids():
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
                await self.jobs.wait(job, max(0.0, deadline - time.monotonic()))
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
        running = self.jobs.on(kernel_id)
        if running is not None and running.status == "running":
            await self.jobs.wait(running, max(0.0, deadline - time.monotonic()))
        try:
            return self.kernel_jobs.snapshot(kernel_id, trigger=trigger)
        except SnapshotError as exc:
            return exc
