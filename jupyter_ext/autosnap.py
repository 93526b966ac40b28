"""The policy tick: the snapshots the server takes by itself (periodic, after long cells,
idle suspend), decided in :mod:`.core.policies` on each kernel's status, read once.

Here only what needs the server: the kernels and their wrappers, the jobs it starts.
"""

from __future__ import annotations

import asyncio
import logging
import time

from .core.errors import SnapshotError
from .core.policies.tick import (
    Kernel,
    PolicyMemory,
    PolicySettings,
    decide,
    needs_status,
    periodic_round,
)
from .core.protocol.control import KernelStatus
from .manager import Job, SnapshotManager

log = logging.getLogger("jupyter_ext")


class PolicyTick:
    """The policies of one server's :class:`SnapshotManager`, one :meth:`tick` at a time."""

    def __init__(self, manager: SnapshotManager, settings: PolicySettings) -> None:
        self.manager = manager
        self.settings = settings
        self.memory = PolicyMemory(last_periodic=time.monotonic())

    async def tick(self) -> list[Job]:
        """Read the status of each kernel a policy could act on (once, with its GPU
        accounting only if a decision needs it), decide, start the jobs; the jobs started.
        A start refused (another job just began on the kernel) is left to the next tick."""
        manager = self.manager
        now = time.monotonic()
        kernel_ids = manager.server_kernels.ids()
        self.memory.forget_others(kernel_ids)
        is_round = periodic_round(self.settings, self.memory, now)
        kernels = await asyncio.gather(*(self._kernel(k, is_round) for k in kernel_ids))
        plan = decide(kernels, self.settings, self.memory, now, time.time())
        if plan.periodic_round:
            self.memory.last_periodic = now
        jobs = []
        for decision in plan.decisions:
            kernel_id, trigger = decision.kernel_id, decision.trigger
            try:
                if decision.suspends:
                    jobs.append(manager.kernel_jobs.suspend(kernel_id, trigger=trigger))
                else:
                    jobs.append(manager.kernel_jobs.snapshot(kernel_id, trigger=trigger))
            except SnapshotError as exc:
                log.info("no %s snapshot of kernel %s now: %s", trigger, kernel_id, exc.message)
                continue
            self.memory.started(decision, now)
        return jobs

    async def _kernel(self, kernel_id: str, is_round: bool) -> Kernel:
        """What this tick knows of a kernel (its status only if a policy could use it)."""
        manager = self.manager
        has_job = manager.jobs.has_job(kernel_id)
        automatic = kernel_id not in manager.schedules.periodic_opt_out
        status: KernelStatus | None = None
        if needs_status(self.settings, is_round, has_job, automatic):
            status = await manager.server_kernels.status(kernel_id, gpu=self.settings.needs_gpu)
        return Kernel(kernel_id, status, has_job=has_job, automatic=automatic)
