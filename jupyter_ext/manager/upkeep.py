"""The store's upkeep, as jobs: a check (is the store whole?) and a prune (remove what
nothing needs), asked through the REST API; each runs once at a time."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from ..core.errors import SnapshotBusyError
from ..core.store import SnapshotStore
from .jobs import Job, Jobs


class StoreUpkeep:
    """Checks and prunes of the user's store (core/store/check.py, prune.py)."""

    def __init__(self, store: SnapshotStore, jobs: Jobs) -> None:
        self.store = store
        self.jobs = jobs
        self._running: dict[str, Job] = {}

    def check(self, read_data: bool) -> Job:
        """A check job; its result is the report (openapi.yaml's StoreCheck)."""

        async def work(job: Job) -> dict[str, Any]:
            progress = self.jobs.threaded_progress(job)
            found = await asyncio.to_thread(self.store.check, read_data, progress)
            return found.to_dict()

        return self._start("check", work)

    def prune(self) -> Job:
        """A prune job; its result says what was removed (openapi.yaml's StorePrune)."""

        async def work(job: Job) -> dict[str, Any]:
            self.jobs.progress(job, "pruning")
            done = await asyncio.to_thread(self.store.prune)
            return done.to_dict()

        return self._start("prune", work)

    def _start(self, kind: Literal["check", "prune"], work: Any) -> Job:
        running = self._running.get(kind)
        if running is not None and running.status == "running":
            raise SnapshotBusyError(
                f"A store {kind} is already running (job {running.id}).",
                hint=f"Wait for it: /api/snapshots/jobs/{running.id}",
            )
        job = self._running[kind] = self.jobs.start(kind, None, work)
        return job
