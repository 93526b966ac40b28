"""Kernels that died: how (core/death), and the snapshot offered back, for as long as the
offer stands.

Two deaths reach the server. The inner kernel dies and its wrapper, which saw how, says
so in its journal (core/protocol.KernelJournal) and exits (or waits, with
``--on-inner-death=wait``: its status then says it); or the wrapper dies with it (a
SIGKILL of the tree, the OOM killer), leaving its journal as it last wrote it. Either
way jupyter_client's restarter starts a new kernel under the same id and calls the
restart callbacks first: there the journal is taken, the death told (the wrapper's exit
status and the OOM killer's traces, when the wrapper died too), and the snapshot to offer
found: the one the kernel's state was last saved in or restored from, else the newest of
its lineage or kernel. The offer stands until a restore into the kernel succeeds, it is
dismissed, another death replaces it, or the kernel is shut down. With
``restore_on_death`` the offered snapshot is restored into the kernel at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.death import Death, Witness
from ..core.errors import SnapshotError
from ..core.protocol.control import (
    KernelJournal,
    WrapperClient,
    WrapperInfo,
    info_path,
    take_journal,
)
from .jobs import Job, Jobs
from .kernels import Kernels
from .shared import EmitEvent, ManagerSettings
from .stored import StoredSnapshots

log = logging.getLogger("jupyter_ext")

#: How long an automatic restore waits for the restarted kernel's wrapper.
RESTART_WAIT_SECONDS = 60.0

Restore = Callable[[str, str], Job]
"""Start a restore of a snapshot (first argument) in place of a kernel (second)."""


@dataclass
class DeathRecord:
    """One kernel's last death and what is offered back."""

    kernel_id: str
    death: Death
    journal: KernelJournal | None
    offer: dict[str, Any] | None = None
    """The snapshot offered: ``id``, ``created``, ``trigger``, ``notebook_path``."""
    restore_job: Job | None = None
    automatic: bool = False
    resolved: asyncio.Event = field(default_factory=asyncio.Event)
    restarted: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the kernel has a process again (jupyter_client started it anew)."""

    def to_dict(self) -> dict[str, Any]:
        """The API's ``death`` of a kernel status (openapi.yaml, KernelDeath)."""
        offer = self.offer or {}
        journal: dict[str, Any] = dict(self.journal or {})
        job = self.restore_job
        same = offer.get("id") is not None and offer.get("id") == journal.get("snapshot_id")
        return {
            **self.death.to_dict(),
            "snapshot_id": offer.get("id"),
            "snapshot_created": offer.get("created"),
            "snapshot_trigger": offer.get("trigger"),
            # The cells run since the kernel's last snapshot: since the offered one when
            # it is that one, else at least these (an older one is offered).
            "cells_since": list(journal.get("cells_since") or []),
            "cells_since_exact": same or not journal.get("snapshot_id"),
            "restore": (
                {"job_id": job.id, "status": job.status, "automatic": self.automatic}
                if job is not None
                else None
            ),
        }


class Deaths:
    """Deaths of this server's snapshot kernels, told and offered back."""

    def __init__(
        self,
        *,
        settings: ManagerSettings,
        kernel_manager: Any,
        kernels: Kernels,
        snapshots: StoredSnapshots,
        jobs: Jobs,
        emit: EmitEvent,
    ) -> None:
        self.settings = settings
        self.kernel_manager = kernel_manager
        self.kernels = kernels
        self.snapshots = snapshots
        self.jobs = jobs
        self.emit = emit
        self.restore: Restore | None = None
        """Set by the manager (restores are made after this part)."""
        self.records: dict[str, DeathRecord] = {}
        self._witnesses: dict[str, Witness] = {}
        self._watched: set[str] = set()

    # ------------------------------------------------------------------ the kernel manager

    def install(self) -> None:
        """Watch every kernel the server starts (restart callbacks, a witness of its
        process), and forget a kernel once it is shut down: its ``start_kernel`` and
        ``shutdown_kernel`` are wrapped on the instance."""
        km = self.kernel_manager
        start: Callable[..., Awaitable[str]] = km.start_kernel
        shutdown: Callable[..., Awaitable[None]] = km.shutdown_kernel

        async def start_kernel(*args: Any, **kwargs: Any) -> str:
            kernel_id = await start(*args, **kwargs)
            self.watch(kernel_id)
            return kernel_id

        async def shutdown_kernel(kernel_id: str, *args: Any, **kwargs: Any) -> None:
            try:
                await shutdown(kernel_id, *args, **kwargs)
            finally:
                self.forget(kernel_id)

        km.start_kernel = start_kernel
        km.shutdown_kernel = shutdown_kernel

    def watch(self, kernel_id: str) -> None:
        """Hear of a snapshot kernel's deaths (once per kernel) and witness its process now."""
        try:
            spec = self.kernel_manager.get_kernel(kernel_id).kernel_spec
        except Exception:  # noqa: BLE001 - gone, or its kernelspec is gone
            return
        if "kernel_snapshots" not in (getattr(spec, "metadata", None) or {}):
            return
        if kernel_id not in self._watched:
            self._watched.add(kernel_id)
            self.kernel_manager.add_restart_callback(
                kernel_id, lambda: self._restarting(kernel_id), "restart"
            )
        self._witness(kernel_id)

    def forget(self, kernel_id: str) -> None:
        self.records.pop(kernel_id, None)
        self._witnesses.pop(kernel_id, None)
        self._watched.discard(kernel_id)

    def _provisioner(self, kernel_id: str) -> Any:
        with contextlib.suppress(Exception):
            return self.kernel_manager.get_kernel(kernel_id).provisioner
        return None

    def _witness(self, kernel_id: str) -> Witness | None:
        """The witness of the kernel's wrapper process now (a new one for a new process)."""
        pid = getattr(self._provisioner(kernel_id), "pid", None)
        if not isinstance(pid, int):
            return None
        witness = self._witnesses.get(kernel_id)
        if witness is None or pid not in witness.pids:
            witness = self._witnesses[kernel_id] = Witness(pid)
        return witness

    # ------------------------------------------------------------------ deaths

    def _restarting(self, kernel_id: str) -> None:
        """jupyter_client's restarter found the kernel's process gone and is about to start
        a new one (called before it does): tell the death while its traces are there."""
        try:
            km = self.kernel_manager.get_kernel(kernel_id)
            connection_file = Path(km.connection_file)
        except Exception:  # noqa: BLE001 - gone meanwhile: nothing to tell
            return
        journal = take_journal(connection_file)
        told = journal["death"] if journal else None
        if told:
            death = Death.from_dict(told)
        else:
            # The wrapper died too: its exit status (our child's), and whether the OOM
            # killer named it or its kernel.
            witness = self._witnesses.get(kernel_id)
            process = getattr(self._provisioner(kernel_id), "process", None)
            code = getattr(process, "returncode", None)
            with contextlib.suppress(SnapshotError):
                inner = WrapperInfo.for_connection_file(connection_file).inner_pid
                if witness is not None and inner:
                    witness.pids.add(inner)
            if witness is not None and journal and journal.get("inner_pid"):
                witness.pids.add(int(journal["inner_pid"] or 0))
            exit_code = code if isinstance(code, int) else None
            death = (
                witness.death(exit_code, wrapper=True)
                if witness is not None
                else Death(exit_code, wrapper=True)
            )
        # The dead wrapper's description points at a socket nobody answers any more: the
        # new wrapper writes its own once it is up (an automatic restore waits for it).
        info_path(connection_file).unlink(missing_ok=True)
        log.warning("kernel %s %s; jupyter_client restarts it", kernel_id, death.reason)
        record = self._died(kernel_id, death, journal)
        self.jobs.spawn(self._restarted(record, getattr(self._provisioner(kernel_id), "pid", None)))

    async def _restarted(self, record: DeathRecord, old: int | None) -> None:
        """Once jupyter_client has started the kernel's new process (not ``old``): witness it."""
        kernel_id = record.kernel_id
        deadline = time.monotonic() + RESTART_WAIT_SECONDS
        while time.monotonic() < deadline and kernel_id in self._watched:
            pid = getattr(self._provisioner(kernel_id), "pid", None)
            if isinstance(pid, int) and pid != old:
                self._witness(kernel_id)
                record.restarted.set()
                return
            await asyncio.sleep(0.1)

    def dead_wrapper(self, kernel_id: str, status: dict[str, Any]) -> None:
        """A wrapper that waits for a restore (``--on-inner-death=wait``) said its kernel
        died: the same death as one jupyter_client restarts, told once."""
        told = status.get("death")
        record = self.records.get(kernel_id)
        if not told or (record is not None and record.death.at == told.get("at")):
            return
        journal: KernelJournal = {
            "lineage": str(status.get("lineage") or ""),
            "snapshot_id": status.get("snapshot_id"),
            "cells_since": list(status.get("cells_since_snapshot") or []),
            "inner_pid": None,
            "death": told,
        }
        self._died(kernel_id, Death.from_dict(told), journal).restarted.set()

    def _died(self, kernel_id: str, death: Death, journal: KernelJournal | None) -> DeathRecord:
        record = DeathRecord(kernel_id, death, journal)
        self.records[kernel_id] = record
        self.jobs.spawn(self._resolve(record))
        return record

    async def _resolve(self, record: DeathRecord) -> None:
        """Find the snapshot to offer, say the death, and restore it if the settings say so."""
        try:
            record.offer = await self._offer(record)
        except SnapshotError as exc:
            log.warning("no snapshot to offer for kernel %s: %s", record.kernel_id, exc)
        finally:
            record.resolved.set()
        offer = record.offer or {}
        self.emit(
            "died",
            {
                "kernel_id": record.kernel_id,
                "snapshot_id": offer.get("id"),
                "message": record.death.reason,
                "reason": record.death.cause,
            },
        )
        if (
            offer
            and self.settings.restore_on_death
            and self.records.get(record.kernel_id) is record
        ):
            await self._restore_automatically(record)

    async def _offer(self, record: DeathRecord) -> dict[str, Any] | None:
        """The snapshot the kernel's state was last in, else the newest of its lineage,
        else the newest of its kernel id; None if it has none."""
        journal: dict[str, Any] = dict(record.journal or {})
        listing = (await self.snapshots.list_snapshots())["snapshots"]
        wanted = journal.get("snapshot_id")
        lineage = journal.get("lineage")
        chosen = (
            next((s for s in listing if s["id"] == wanted), None)
            or next((s for s in listing if lineage and s["lineage"] == lineage), None)
            or next((s for s in listing if s.get("kernel_id") == record.kernel_id), None)
        )
        if chosen is None:
            return None
        return {k: chosen.get(k) for k in ("id", "created", "trigger", "notebook_path")}

    async def _restore_automatically(self, record: DeathRecord) -> None:
        """restore_on_death: once the kernel's new wrapper is up, restore the offer into it."""
        assert record.offer is not None
        assert self.restore is not None
        kernel_id = record.kernel_id
        try:
            await asyncio.wait_for(record.restarted.wait(), RESTART_WAIT_SECONDS)
            km = self.kernels.kernel(kernel_id)
            await WrapperClient.when_up(Path(km.connection_file), km.is_alive)
            record.restore_job = self.restore(record.offer["id"], kernel_id)
            record.automatic = True
        except (SnapshotError, TimeoutError) as exc:
            log.warning("kernel %s: automatic restore not started: %s", kernel_id, exc)
            return
        log.info("kernel %s: restoring snapshot %s automatically", kernel_id, record.offer["id"])

    # ------------------------------------------------------------------ the API

    async def status(self, kernel_id: str, status: dict[str, Any] | None) -> dict[str, Any] | None:
        """The API's ``death`` of a kernel (None: it has none, or the offer ended), given
        the wrapper's status if it answered."""
        if status is not None:
            self.watch(kernel_id)
            if status.get("state") == "dead":
                self.dead_wrapper(kernel_id, status)
        record = self.records.get(kernel_id)
        if record is None:
            return None
        with contextlib.suppress(TimeoutError):  # the offer is a store listing away
            await asyncio.wait_for(record.resolved.wait(), 10)
        return record.to_dict()

    def restored(self, kernel_id: str, job: Job) -> None:
        """A restore into the kernel succeeded: the offer is taken. One the server made by
        itself stays told (the notebook says it once) until dismissed."""
        record = self.records.get(kernel_id)
        if record is None:
            return
        if record.automatic and record.restore_job is job:
            return
        self.records.pop(kernel_id, None)

    def dismiss(self, kernel_id: str) -> None:
        """The user took note (or chose the new kernel): no more offer."""
        self.records.pop(kernel_id, None)
