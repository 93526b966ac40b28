"""Snapshots on a schedule: periodic, of idle kernels (suspend), and of all before the
server stops."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ..core.errors import SnapshotError
from .base import Job
from .dumps import Dumps

log = logging.getLogger("jupyter_ext")


def _reason(outcome: Job | SnapshotError) -> str:
    """Why a snapshot is missing: a failed or unfinished job, or a refused start."""
    if isinstance(outcome, SnapshotError):
        return outcome.message
    if outcome.status == "running":
        return f"it did not finish in time (it was {outcome.phase})"
    return str((outcome.error or {}).get("message", "it failed"))


class Schedules(Dumps):
    """Periodic snapshots, idle suspends, and the snapshots before a stop."""

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
