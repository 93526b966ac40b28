"""Automatic snapshots after long cells: the work of a cell that ran for minutes is worth
keeping, and a kernel that just finished one is the cheapest moment to take it.

The wrapper measures each cell from its ``execute_input`` to its ``execute_reply`` (queued
cells do not count their wait) and reports the longest since the last snapshot
(``longest_cell_since_snapshot``). Each policy tick, a kernel whose longest cell reached
``threshold`` seconds is snapshotted ("long-cell"), at most once per ``min_interval``
seconds per kernel (any snapshot of the kernel counts: it resets the wrapper's record).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .core.errors import SnapshotError


def long_cell_due(
    status: dict[str, Any], threshold: float, last: float | None, now: float, min_interval: float
) -> bool:
    """Whether a kernel (its wrapper's ``status``) is due for a long-cell snapshot."""
    if threshold <= 0 or not status.get("snapshots") or status.get("state") != "running":
        return False
    if float(status.get("longest_cell_since_snapshot") or 0) < threshold:
        return False
    return last is None or now - last >= min_interval


@dataclass
class LongCellPolicy:
    """Snapshots after long cells, for one server's SnapshotManager."""

    manager: Any
    threshold: float
    """Seconds a cell must run (SnapshotExtensionApp.long_cell_seconds; 0: off)."""
    min_interval: float
    """Seconds between two such snapshots of one kernel."""
    last: dict[str, float] = field(default_factory=dict)
    """When each kernel's last long-cell snapshot started (time.monotonic())."""

    async def tick(self) -> list[Any]:
        """Start the snapshots that are due; the jobs started."""
        if self.threshold <= 0:
            return []
        jobs = []
        now = time.monotonic()
        manager = self.manager
        kernel_ids = list(manager.kernel_manager.list_kernel_ids())
        for gone in set(self.last) - set(kernel_ids):
            del self.last[gone]
        for kernel_id in kernel_ids:
            if manager.jobs.has_job(kernel_id) or kernel_id in manager.schedules.periodic_opt_out:
                continue  # the panel's per-kernel switch turns all automatic ones off
            status = await manager.schedules.kernel_status(kernel_id)
            if not long_cell_due(
                status, self.threshold, self.last.get(kernel_id), now, self.min_interval
            ):
                continue
            try:
                jobs.append(manager.dumps.create(kernel_id, trigger="long-cell"))
            except SnapshotError:
                continue  # another job just started on it: the next tick looks again
            self.last[kernel_id] = now
        return jobs
