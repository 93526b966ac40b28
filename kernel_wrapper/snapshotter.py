"""The snapshot engine of one wrapper: dumps, restores, suspends and resumes its kernel,
one operation at a time.

Its parts, each with its own module:

- :class:`~kernel_wrapper.dump.Dumper`: a snapshot, as named steps (how a dump goes is
  told there);
- :class:`~kernel_wrapper.restore.Restorer`: a snapshot's kernel in place of the one there
  is;
- :class:`~kernel_wrapper.rollback.Rollback`: a running kernel is saved before a restore
  replaces it, and put back if the restore fails, so it is never lost;
- :class:`~kernel_wrapper.lazyrestore.LazyRestore`: whether this wrapper's own restores go
  lazily, and the transfer of the memory of a kernel restored so;
- :class:`~kernel_wrapper.gpusteps.GpuSteps`: the CUDA steps of dumps and restores;
- :class:`~kernel_wrapper.record.KernelRecord`: the kernel's lineage, and the snapshot a
  suspended kernel comes back from;
- :class:`~kernel_wrapper.checkpointarea.KernelCheckpoints`: the kernel's cell checkpoint
  area, which its dumps build on (the checkpoints themselves: kernel_wrapper/checkpoints.py).

A cell checkpoint is one of these operations too (:meth:`Snapshotter.exclusive`): a
request from the server that finds one under way waits for it (about the freeze) instead
of being refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from jupyter_ext.core import proctree
from jupyter_ext.core.agent.client import AgentCriu
from jupyter_ext.core.checkpoints import CheckpointSettings
from jupyter_ext.core.criu import Criu, LazyTransfer, check_asked
from jupyter_ext.core.errors import KernelNotRunningError, SnapshotBusyError, SnapshotError
from jupyter_ext.core.lazypages import LazySettings
from jupyter_ext.core.manifest import Manifest, new_snapshot_id, remove_tree
from jupyter_ext.core.memtrack.plan import AFTER_RESTORE
from jupyter_ext.core.phases import Phases
from jupyter_ext.core.protocol.control import (
    Restored,
    RestoreRequest,
    ResumeArgs,
    SnapshotArgs,
    SuspendArgs,
)
from jupyter_ext.core.protocol.environment import ENV_AGENT_SOCKET
from jupyter_ext.core.protocol.progress import ProgressCallback

from .agents import KernelAgent
from .checkpointarea import KernelCheckpoints
from .dump import Dumper
from .gpusteps import GpuSteps
from .lazyrestore import LazyRestore
from .lifecycle import Lifecycle, State
from .memory import KernelMemory
from .parts import KernelParts
from .record import KernelRecord
from .relay import Relay
from .restore import Restorer
from .rollback import Rollback, SavedKernel
from .runtime import RuntimeDir
from .supervisor import Supervisor

log = logging.getLogger("kernel_wrapper")


class Snapshotter:
    """Snapshots of the kernel that ``process`` runs and ``relay`` connects, one operation
    at a time; ``record`` keeps the kernel's lineage, ``lazy`` the state of the last lazy
    restore, ``restorer`` what the last restore did."""

    def __init__(
        self,
        *,
        lifecycle: Lifecycle,
        relay: Relay,
        process: Supervisor,
        runtime: RuntimeDir,
        criu_path: str | None,
        lazy: LazySettings,
        agent: KernelAgent,
        checkpoints: KernelCheckpoints | None = None,
    ) -> None:
        """``lazy``: the settings of this wrapper's own restores (the server decides
        for those it asks)."""
        self.lifecycle = lifecycle
        self.relay = relay
        self.process = process
        self.criu_path = criu_path
        self._lock = asyncio.Lock()
        self._checkpointing = False
        """The operation that holds the lock is a cell checkpoint."""
        self._next_waits = False
        """An operation waits for that checkpoint (a second one is refused)."""
        self._criu: Criu | None = None
        self.kernel = KernelParts(
            lifecycle=lifecycle,
            relay=relay,
            process=process,
            runtime=runtime,
            gpu=GpuSteps(agent),
            lazy=LazyRestore(lazy),
            record=KernelRecord(),
            memory=KernelMemory(relay),
            agent=agent,
            checkpoints=checkpoints or KernelCheckpoints(CheckpointSettings()),
            criu=self._criu_binary,
        )
        self.record = self.kernel.record
        self.lazy = self.kernel.lazy
        self.dumper = Dumper(self.kernel)
        self.restorer = Restorer(self.kernel)
        self.rollback = Rollback(self.kernel, self.dumper, self.restorer)

    @property
    def busy(self) -> bool:
        """Whether a snapshot or restore runs (a cell checkpoint too)."""
        return self._lock.locked()

    @property
    def checkpointing(self) -> bool:
        """Whether the operation under way is a cell checkpoint."""
        return self._lock.locked() and self._checkpointing

    @contextlib.asynccontextmanager
    async def exclusive(self, *, checkpoint: bool = False) -> AsyncIterator[None]:
        """One snapshot or restore at a time: a second one is refused, not queued, except
        that one finding a cell checkpoint under way waits for it, ahead of any other."""
        waits = self._lock.locked()
        if waits and (self._next_waits or not self._checkpointing):
            raise SnapshotBusyError(
                "A snapshot or restore of this kernel is already in progress.",
                hint="Wait for it to finish, then try again.",
            )
        self._next_waits = self._next_waits or waits
        try:
            await self._lock.acquire()
        finally:
            if waits:
                self._next_waits = False
        self._checkpointing = checkpoint
        try:
            yield
        finally:
            self._checkpointing = False
            self._lock.release()

    def _criu_binary(self) -> Criu:
        """The local CRIU, or the node agent where the pod names one (agent mode: the pod
        runs at Pod Security baseline and cannot run CRIU itself; docs/agent.md)."""
        if self._criu is None:
            agent = os.environ.get(ENV_AGENT_SOCKET)
            self._criu = AgentCriu.connect(Path(agent)) if agent else Criu.locate(self.criu_path)
        return self._criu

    # ------------------------------------------------------------------ operations

    async def snapshot(self, progress: ProgressCallback, args: SnapshotArgs) -> dict[str, Any]:
        async with self.exclusive():
            manifest = await self.dumper.dump(args, progress)
            result: dict[str, Any] = json.loads(manifest.to_json())
            return result

    async def suspend(self, progress: ProgressCallback, args: SuspendArgs) -> dict[str, Any]:
        """Snapshot the kernel and end its process; the next request brings it back."""
        if self.relay.tracker.execution_state == "busy":
            raise SnapshotBusyError(
                "The kernel is running a cell; a busy kernel is never suspended.",
                hint="Wait until the cell finishes, or interrupt it.",
            )
        result = await self.snapshot(progress, args.snapshot_args())
        self.record.suspended(Path(args.dest), args.discard_after_resume)
        return result

    async def resume(self, progress: ProgressCallback, args: ResumeArgs) -> Restored:
        suspended = self.record.suspended_snapshot
        if self.lifecycle.state != State.SUSPENDED or suspended is None:
            raise KernelNotRunningError(
                f"The kernel is not suspended (it is {self.lifecycle.state.value}).",
                hint="Only suspended kernels can be resumed.",
            )
        return await self.restore(progress, await self._own_request(suspended))

    async def wake(self) -> None:
        """Bring a suspended kernel back for a request that needs it (idle GPU suspend)."""
        if self.lifecycle.state != State.SUSPENDED or self.busy:
            return
        if self.record.suspended_snapshot is not None:
            try:
                request = await self._own_request(self.record.suspended_snapshot)
                await self._restore(request, lambda _: None)
            except SnapshotError as exc:
                log.error("resuming the suspended kernel failed: %s", exc)

    async def _own_request(self, source: Path) -> RestoreRequest:
        """A restore no one asked of this wrapper (its suspended kernel coming back), lazy
        as this wrapper's settings say (core.lazypages.lazy_plan, as the server decides
        for the restores it asks)."""
        manifest = await asyncio.to_thread(Manifest.read, source)
        return RestoreRequest(source, lazy=self.lazy.own(manifest))

    async def restore(self, progress: ProgressCallback, args: RestoreRequest) -> Restored:
        manifest = await self._restore(args, progress)
        return {
            "inner_pid": self.process.pid,
            "id": manifest.id,
            "lineage": manifest.lineage,
            "gpu": self.restorer.last_gpu_restore,
            "closed_connections": manifest.closed_connections,
            "private_shm": self.restorer.private_shm,
            "phases": self.restorer.phases.to_dict(),
        }

    # ------------------------------------------------------------------ restore

    async def _restore(self, args: RestoreRequest, progress: ProgressCallback) -> Manifest:
        """:meth:`restore_now`, as the one operation under way."""
        async with self.exclusive():
            return await self.restore_now(args, progress)

    async def restore_now(
        self,
        args: RestoreRequest,
        progress: ProgressCallback,
        *,
        saved: SavedKernel | None = None,
        save_trigger: str = "before-restore",
    ) -> Manifest:
        """Replace the inner kernel (if any) by the snapshot in ``args.source``
        (kernel_wrapper.restore), lazily if ``args.lazy`` says so and this CRIU can
        (kernel_wrapper.lazyrestore): a kernel saved before the restore is then kept
        until every page is in. The caller holds :meth:`exclusive`.

        A running kernel is first saved into the new directory ``args.save_to`` (default
        a new one beside the source) and put back if the restore fails
        (kernel_wrapper.rollback), unless ``saved`` is given: what to put back instead (an
        undo from a kernel that is a checkpoint's images). A saved kernel whose ``keep``
        is set is a cell checkpoint: it stays. After a restore that is neither a resume nor
        an undo (``save_trigger`` "before-undo"/"before-redo"), the kernel's cell
        checkpoints no longer lead to its state (core/checkpoints/timeline.py)."""
        source = args.source
        self.restorer.phases = phases = Phases()
        with phases.phase("check"):
            manifest = await self.restorer.checked(source, progress, args.verified)
        criu = self._criu_binary()
        lazy = self.lazy.told(args.lazy, criu)
        if saved is None and self.lifecycle.is_(State.RUNNING) and self.process.pid is not None:
            directory = args.save_to or source.parent / new_snapshot_id()
            with phases.phase("save the kernel there was"):
                saved = await self.rollback.save(
                    directory, progress, args.save_parent, save_trigger
                )
            saved.keep = save_trigger != "before-restore"
        progress({"phase": "restoring"})
        try:
            await self.restorer.restore(
                source, manifest, criu, lazy=lazy, pages_from=args.pages_from
            )
        except SnapshotError as exc:
            if saved is None:
                raise
            await self.rollback.put_back(saved, exc, criu)
        finally:
            # Whatever runs now is a process restored from images: untracked.
            self.kernel.memory.forget(AFTER_RESTORE)
        if self.lazy.transfer is not None:
            completion = self._complete_lazy(self.lazy.transfer, saved, criu)
            self.lazy.follow(completion, puts_back=saved is not None)
        elif saved is not None and not saved.keep:
            remove_tree(saved.directory)
        if not self._resumed_from(source) and save_trigger == "before-restore":
            self.kernel.checkpoints.timeline.forget()
        progress({"phase": "done"})
        return manifest

    def _resumed_from(self, source: Path) -> bool:
        """After a restore: the kernel is no longer suspended (its suspend's snapshot is
        deleted if it was to be, and restored from). Whether it was a resume."""
        discard = self.record.discard_after_resume
        resumed = self.record.resumed() == source
        if resumed and discard:
            shutil.rmtree(source, ignore_errors=True)
        return resumed

    async def _complete_lazy(
        self, transfer: LazyTransfer, saved: SavedKernel | None, criu: Criu
    ) -> None:
        """Wait for the rest of a lazily restored kernel's memory. If a page cannot be
        had, the kernel (frozen at its first missing page) is killed: no half-restored
        kernel stays; one saved before a restore in place is put back, also where the
        kernel died meanwhile (wrapper._on_inner_death leaves that to here)."""
        pid = self.process.pid
        try:
            await transfer.wait()
            if transfer.given_up:
                return
            if self._shut_down_on_purpose():
                # CRIU's daemon ended as the kernel's memory went away: the pages it did
                # not send are not wanted any more (nothing to fill in).
                self._lazy_ended(transfer, "its kernel ended")
                return
            if pid is None or self.process.pid != pid or not proctree.is_alive(pid):
                # CRIU's daemon ended because the kernel died: the transfer is no success.
                raise SnapshotError(
                    "The kernel ended while its memory was being restored lazily "
                    f"({transfer.server.bytes_served} bytes of it were in).",
                    hint="The kernel's log (the server's) says how it ended.",
                )
            check_asked(transfer.server, transfer.work_dir)
            filled = await asyncio.to_thread(transfer.server.fill_gaps)
        except SnapshotError as exc:
            if self._shut_down_on_purpose():
                self._lazy_ended(transfer, exc.message)
                return
            # Serialized with other operations, unless one holds the lock waiting for
            # this very end (a dump's _prepare): it goes on once this is done.
            holder_waits = self.lazy.awaited_by_lock_holder
            async with contextlib.nullcontext() if holder_waits else self._lock:
                if transfer.given_up:  # its kernel was replaced meanwhile, on purpose
                    return
                log.error("lazy restore failed: %s", exc)
                if self.process.pid == pid:
                    await self.process.kill()
                self.lazy.drop(transfer)
                error = await self._after_lazy_failure(exc, saved, criu)
                # Reported once settled: what the status shows then is the outcome.
                self.lazy.status = {"state": "failed", "error": error.to_dict()}
            return
        self.lazy.completed(transfer, filled)
        if saved is not None and not saved.keep:
            remove_tree(saved.directory)

    def _shut_down_on_purpose(self) -> bool:
        return self.relay.tracker.shutdown_requested or self.lifecycle.is_(State.STOPPING)

    def _lazy_ended(self, transfer: LazyTransfer, why: str) -> None:
        """The kernel, and with it the transfer, ended on purpose: not a failure."""
        log.info("lazy restore ended with the kernel's shutdown (%s)", why)
        self.lazy.drop(transfer)
        self.lazy.status = {"state": "ended"}

    async def _after_lazy_failure(
        self, exc: SnapshotError, saved: SavedKernel | None, criu: Criu
    ) -> SnapshotError:
        """The kernel of a failed lazy restore is gone: the one saved before it comes
        back, if any. The error to report, which says whether the kernel is back."""
        if saved is None:
            self.lifecycle.enter(State.DEAD)
            return exc
        try:
            await self.rollback.put_back(saved, exc, criu)
        except SnapshotError as final:
            # Back, or suspended on the saved images (back at the next cell): either way
            # the kernel is what was saved.
            told, self.lazy.after_put_back = self.lazy.after_put_back, None
            if told is not None:
                told()
            return final
        return exc  # put_back always raises
