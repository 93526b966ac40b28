"""Cell checkpoints of the kernel, and undo (jupyter_ext/core/checkpoints/ decides what;
docs/undo.md says what it costs).

When a cell has finished and the kernel is idle (its tracker sees the reply and the idle
status), a checkpoint is taken as one of the snapshotter's operations: first the plan of
the dump (core/memtrack/plan.py), which says whether this kernel gets checkpoints at all
(core/checkpoints/settings.py: in "auto" only where its memory is tracked), and what it
would copy (the pages written since the previous one) against the budget; then a tracked
dump into the kernel's area, building on the previous checkpoint. The user never waits
for it: requests wait only while it freezes the kernel, and one that may change the
kernel (a cell, a widget's message) sent before the freeze cuts the checkpoint short; the
next idle takes it then. A kernel gets a "start" checkpoint on its first idle too, so
that its first cell can be undone.

Undo and redo restore the kernel in place from a checkpoint's images (lazily where it is
large, kernel_wrapper/lazyrestore.py): the running kernel is first saved as a checkpoint
("before-undo": where redo goes back to), unless it is a checkpoint's images already (a
second undo in a row: nothing to save), and put back if the restore fails. The restored
kernel's execution count is then raised to where the notebook's was, so that counting
goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jupyter_ext.core import proctree
from jupyter_ext.core.checkpoints import CellRun, Checkpoint, UndoPlan, off_reason, to_remove
from jupyter_ext.core.checkpoints.keep import Files
from jupyter_ext.core.checkpoints.pacing import Pacing, stall_of
from jupyter_ext.core.checkpoints.settings import skip_reason
from jupyter_ext.core.checkpoints.timeline import Point
from jupyter_ext.core.errors import NothingToUndoError, SnapshotBusyError, SnapshotError
from jupyter_ext.core.manifest import MANIFEST_NAME, Manifest, utc_now
from jupyter_ext.core.memtrack import TrackingUnavailable
from jupyter_ext.core.memtrack.plan import DumpPlan
from jupyter_ext.core.phases import Phases
from jupyter_ext.core.protocol.control import RestoreRequest, SnapshotArgs, UndoArgs
from jupyter_ext.core.protocol.progress import ProgressCallback

from .dump import CellCheckpoint, CheckpointInterrupted
from .lifecycle import State
from .memory import KernelMemory, Parent
from .rollback import SavedKernel

if TYPE_CHECKING:
    from .snapshotter import Snapshotter

log = logging.getLogger("kernel_wrapper")

#: Said once by every undo: what it does not bring back.
OUTSIDE_WORLD = (
    "Undo brings back the kernel's memory and processes as they were, not the world "
    "outside it: files the cells wrote, rows they inserted, messages they sent stay as "
    "they are now."
)
#: Records of checkpoints no longer kept, remembered for the path (the cells they saw).
MAX_RECORDS = 1000
#: How long the restored kernel's agent gets to come back and take its execution count.
COUNT_SECONDS = 5.0
#: How often a checkpoint that waits for another operation looks again (seconds).
WAIT_POLL = 0.05
#: A checkpoint the pause budget held back is taken at the first idle after it allows,
#: or after the kernel was this quiet (seconds) since its last idle: a freeze at a random
#: moment would meet the next cell more often than one right after a cell.
PACED_QUIET_SECONDS = 5.0


def _files(directory: Path) -> Files:
    """A checkpoint's files: size by inode (hard links of its chain are shared)."""
    found: dict[int, int] = {}
    for root, _dirs, names in os.walk(directory):
        for name in names:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(root, name))
                found[st.st_ino] = st.st_size
    return found


def _memory_summary(memory: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "mode",
        "reason",
        "copied_bytes",
        "frozen_bytes",
        "frozen_total_seconds",
        "precopy_stopped",
    )
    summary = {key: memory[key] for key in keys if key in memory}
    if "precopy" in memory:
        summary["precopy_frozen_seconds"] = round(stall_of(0.0, memory), 4)
    return summary


def _changed_files(manifest: Manifest, pid: int | None) -> list[dict[str, Any]]:
    """Regular files the kernel holds open now or held at the checkpoint that were
    written (or removed) since it."""
    since = datetime.fromisoformat(manifest.created).timestamp()
    then = {str(f["path"]): f for f in manifest.needed_files if f.get("kind") == "open"}
    now = proctree.needed_files(proctree.descendants(pid)) if pid else []
    paths = dict.fromkeys([*(str(f["path"]) for f in now if f["kind"] == "open"), *then])
    changed: list[dict[str, Any]] = []
    for path in paths:
        was = then.get(path, {}).get("size")
        try:
            st = os.stat(path)
        except OSError:
            changed.append({"path": path, "size": None, "was": was, "change": "removed"})
            continue
        if st.st_mtime > since or (was is not None and was != st.st_size):
            changed.append({"path": path, "size": st.st_size, "was": was, "change": "written"})
    return changed


class CellCheckpoints:
    """The cell checkpoints of the kernel that ``snapshotter`` dumps, and undo."""

    def __init__(self, snapshotter: Snapshotter) -> None:
        self.snapshotter = snapshotter
        self.kernel = snapshotter.kernel
        self.store = self.kernel.checkpoints
        self.timeline = self.store.timeline
        self.off = ""
        """Why this kernel gets no checkpoints now ("" when it does), as last decided."""
        self.skipped: dict[str, Any] | None = None
        """The last checkpoint skipped since the last one taken: why, when, after which
        cells."""
        self.last_count: int | None = None
        """The execution count of the kernel's last cell."""
        self._task: asyncio.Task[None] | None = None
        self._pacing = Pacing(self.store.settings.max_pause_share)
        self._not_before = 0.0
        """When the pause budget lets the next checkpoint start (the loop's clock): after
        the last one, or, once known, by what the next would copy."""
        self._paced: asyncio.TimerHandle | None = None
        self._tried: tuple[str | None, int] | None = None
        self._exact_at = 0
        tracker = self.kernel.tracker
        tracker.on_cell = self._cell_ran
        tracker.on_idle = self._idle

    # ------------------------------------------------------------------ taking them

    def _cell_ran(self, cell_id: str | None, count: int | None) -> None:
        self.timeline.cell_ran(CellRun(cell_id, count))
        if count is not None:
            self.last_count = count

    def _idle(self) -> None:
        """The kernel is idle: a checkpoint if a cell ran since the last one (or the
        kernel has none to start from), once per such state."""
        timeline = self.timeline
        if not self.store.enabled or not self.kernel.lifecycle.is_(State.RUNNING):
            return
        tracker = self.kernel.tracker
        if tracker.execution_state != "idle":  # its idle status calls again
            return
        if tracker.running_request() is not None:  # got, not begun yet: its idle calls again
            return
        if timeline.position is not None and not timeline.cells_since:
            return
        # Once per state: the position and the last cell run since (runs are numbered;
        # after an undo the same position comes back with other cells).
        key = (timeline.position, timeline.cells_since[-1].seq if timeline.cells_since else 0)
        if key == self._tried or (self._task is not None and not self._task.done()):
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self._not_before:
            # The pause budget: taken at the first idle it allows (right after a cell, when
            # the next is least likely to come), or once the kernel has been quiet a while;
            # the cells run meanwhile share it.
            if self._paced is not None:
                self._paced.cancel()
            when = max(self._not_before, loop.time() + PACED_QUIET_SECONDS)
            self._paced = loop.call_at(when, self._budget_allows)
            return
        self._tried = key
        # What may change the kernel from this idle on cuts it short (also while it waits).
        marker = tracker.changing_requests
        self._task = asyncio.create_task(self._take(marker), name="cell-checkpoint")

    def _budget_allows(self) -> None:
        self._paced = None
        self._idle()

    async def _take(self, marker: int) -> None:
        snapshotter = self.snapshotter
        try:
            while snapshotter.busy:  # a snapshot the server asked for: after it
                await asyncio.sleep(WAIT_POLL)
            if not self.kernel.lifecycle.is_(State.RUNNING):
                return
            async with snapshotter.exclusive(checkpoint=True):
                await self._checkpoint(marker)
        except SnapshotBusyError:
            self._tried = None  # another operation came first: the next idle tries again
        except CheckpointInterrupted as exc:
            # Said, and tried again at the next idle: a request that is no cell (the
            # kernel_info of a page that connects, a completion) leaves the state as it
            # was, and the "start" checkpoint would otherwise never come.
            self._skip(exc.message)
            self._tried = None
        except SnapshotError as exc:
            log.warning("cell checkpoint failed: %s", exc)
            self._skip(f"it failed: {exc.message}")
        except OSError as exc:  # the area cannot be made or read (a full disk, say)
            log.warning("cell checkpoint failed: %s", exc)
            self._skip(f"it failed: {exc}")
        finally:
            # Cells that finished meanwhile get theirs (no idle status may come again).
            asyncio.get_running_loop().call_soon(self._idle)

    def _skip(self, reason: str) -> None:
        log.info("cell checkpoint skipped: %s", reason)
        self.skipped = {
            "reason": reason,
            "at": utc_now(),
            "cells": [cell.to_dict() for cell in self.timeline.cells_since],
        }

    async def _checkpoint(self, marker: int) -> None:
        """One checkpoint (the caller holds the snapshotter): decided, then dumped; cut
        short where a request that may change the kernel came since ``marker``."""
        kernel, settings = self.kernel, self.store.settings
        pid = kernel.process.pid
        if pid is None or not kernel.lifecycle.is_(State.RUNNING):
            return
        parent = Parent.read(self.store.parent_dir(kernel.memory))
        plan = await kernel.memory.plan(
            kernel.criu(), pid, parent, enabled=settings.track_memory, keeps_running=True
        )
        self.off = off_reason(settings, plan)
        if self.off:
            return
        dumping = False
        try:
            if plan.parent_id:  # what changed is found by content (the dump keeps it)
                with contextlib.suppress(TrackingUnavailable, OSError):
                    await kernel.memory.protect()
            pending = await asyncio.to_thread(_pending, kernel.memory, pid, plan)
            area = await asyncio.to_thread(self.store.open_area)
            usage = await asyncio.to_thread(shutil.disk_usage, area.path)
            budget = settings.budget(usage.total)
            why = skip_reason(settings, pending, usage.free, usage.total, budget)
            if why:
                self._skip(why)
                return
            loop = asyncio.get_running_loop()
            not_before = self._pacing.not_before(pending)
            if loop.time() < not_before:
                # It would stall the kernel longer than the last one did (a cell made much
                # new memory): it waits for a budget of its own size (the next idle arms
                # the timer).
                self._not_before = not_before
                self._tried = None
                return
            dumping = True
        finally:
            if not dumping:  # the dump releases the memory itself
                await kernel.memory.release()
        dest = area.new_dir()
        frozen_at: list[Point] = []

        def interrupted() -> str:
            if kernel.tracker.changing_requests != marker:
                return "a cell (or a widget's message) came before the kernel was frozen"
            if kernel.tracker.execution_state != "idle":
                return "the kernel was busy"
            frozen_at.append(self.timeline.point())
            return ""

        kind = "cell" if self.timeline.cells_since else "start"
        args = SnapshotArgs(
            str(dest),
            trigger=kind,
            metadata={"kernel_spec": {"kernel_id": self.store.name}},
            sequence=kernel.record.sequence,
            track_memory=settings.track_memory,
            chunk_kib=settings.chunk_kib,
        )
        manifest = await self.snapshotter.dumper.dump(
            args,
            lambda _event: None,
            checkpoint=CellCheckpoint(self.store.cells_through, interrupted),
        )
        stall = stall_of(manifest.pause_seconds, manifest.memory)
        copied = int(manifest.memory.get("copied_bytes", 0))
        self._pacing.taken(stall, copied, loop.time())
        self._not_before = self._pacing.not_before()
        record = self._record(manifest, kind, dest)
        self.timeline.taken(record, frozen_at[0] if frozen_at else None)
        self.store.cells_through = int(
            manifest.contents.get("cells_through", self.store.cells_through)
        )
        self.skipped = None
        await self._prune(record)

    def _record(self, manifest: Manifest, kind: str, directory: Path) -> Checkpoint:
        self.store.added(manifest.id, directory)
        return Checkpoint(
            id=manifest.id,
            kind=kind,
            created=manifest.created,
            directory=str(directory),
            total_bytes=manifest.total_bytes,
            memory=_memory_summary(manifest.memory),
            pause_seconds=manifest.pause_seconds,
            execution_count=self.last_count,
        )

    async def _prune(self, newest: Checkpoint) -> None:
        """The last ``keep`` within the byte budget stay (core/checkpoints/keep.py); the
        anchors nothing builds on go."""
        kept = self.timeline.kept()
        files = await asyncio.to_thread(
            lambda: {record.id: _files(Path(record.directory)) for record in kept}
        )
        older: set[int] = set()
        for record in kept:
            if record.id != newest.id:
                older.update(files[record.id])
        newest.own_bytes = sum(size for ino, size in files[newest.id].items() if ino not in older)
        tracked = self.kernel.memory.status()["tracked_since"]
        protected = {c for c in (self.timeline.position, self.timeline.redo, tracked) if c}
        settings = self.store.settings
        total = (await asyncio.to_thread(shutil.disk_usage, Path(newest.directory))).total
        for checkpoint_id in to_remove(
            [record.id for record in kept],
            files,
            keep=settings.keep,
            budget=settings.budget(total),
            protected=protected,
        ):
            if await asyncio.to_thread(self.store.remove, checkpoint_id):
                self.timeline.removed(checkpoint_id)
        await asyncio.to_thread(self.store.drop_anchors, tracked)
        self.timeline.prune_records(MAX_RECORDS)

    # ------------------------------------------------------------------ undo, redo

    def _sync_exact(self) -> None:
        """A request that may change the kernel since it was restored from a checkpoint
        makes it no longer that checkpoint's images."""
        if self.kernel.tracker.changing_requests != self._exact_at:
            self.timeline.touched()

    def _plan(self, args: UndoArgs) -> UndoPlan:
        if not self.store.enabled:
            raise NothingToUndoError(
                f"This kernel has no cell checkpoints: {self.store.settings.disabled_reason()}.",
                hint="Cell checkpoints are set by the server (cell_checkpoints, docs/undo.md).",
            )
        self._sync_exact()
        if args.redo:
            return self.timeline.plan_redo()
        return self.timeline.plan_undo(args.to, args.before_cell)

    async def undo(self, progress: ProgressCallback, args: UndoArgs) -> dict[str, Any]:
        """Go back (or, with ``args.redo``, forward) to a checkpoint; with
        ``args.preview`` only say what that would do."""
        plan = self._plan(args)
        if args.preview:
            return await asyncio.to_thread(self._preview, plan)
        tracker = self.kernel.tracker
        if tracker.running_request() is not None:
            raise SnapshotBusyError(
                "The kernel is running a cell; undo goes back to a state between cells.",
                hint="Wait until the cell finishes, or interrupt it, then undo.",
            )
        async with self.snapshotter.exclusive():
            return await self._go(self._plan(args), progress, redo=args.redo)

    async def _go(
        self, plan: UndoPlan, progress: ProgressCallback, *, redo: bool
    ) -> dict[str, Any]:
        started = time.monotonic()
        kernel, timeline = self.kernel, self.timeline
        target = timeline.records[plan.target]
        reading = Phases()
        with reading.phase("execution count read"):
            count = await self._next_count()
        trigger = "before-redo" if redo else "before-undo"
        point = timeline.point()
        save_dir: Path | None = None
        saved: SavedKernel | None = None
        if plan.save:
            save_dir = self.store.open_area().new_dir()
        else:  # the kernel is its position's images: put back from there if need be
            position = self.store.directory(timeline.position) if timeline.position else None
            if position is None:
                raise NothingToUndoError("The kernel's own checkpoint is gone.")
            saved = SavedKernel(
                position,
                kernel.record.sequence,
                kernel.record.parent_snapshot,
                kernel.tracker.executions_since_snapshot,
                keep=True,
            )
        # This wrapper's own restore: lazily as its settings say (core.lazypages.lazy_plan,
        # in place from images here: when the kernel's memory is large).
        manifest = await asyncio.to_thread(Manifest.read, Path(target.directory))
        request = RestoreRequest(
            Path(target.directory), verified=True, lazy=kernel.lazy.own(manifest), save_to=save_dir
        )
        try:
            await self.snapshotter.restore_now(request, progress, saved=saved, save_trigger=trigger)
        except SnapshotError:
            if self._saved(save_dir, trigger, point) is not None:
                timeline.exact = True  # put back from that save: it is its images
                self._exact_at = kernel.tracker.changing_requests
            raise
        # Read at once: a small kernel's transfer may end before the count is set (seen:
        # an undo said to be in full, its 57 MB served lazily in 0.4 s meanwhile).
        lazy = kernel.lazy.transfer is not None
        saved_id = self._saved(save_dir, trigger, point)
        before, redo_before = timeline.position, timeline.redo
        timeline.moved_to(plan, redo=None if redo else (saved_id or timeline.redo))
        if kernel.lazy.puts_back and before is not None:
            # Should the kernel die before all of its memory is in, the one saved before
            # comes back (snapshotter._complete_lazy), and the timeline with it.
            kernel.lazy.after_put_back = lambda: timeline.put_back(before, redo_before)
        self._exact_at = kernel.tracker.changing_requests
        phases = self.snapshotter.restorer.phases
        with phases.phase("execution count set"):
            count = await self._set_count(count)
        return {
            **plan.to_dict(),
            "phases": reading.to_dict() | phases.to_dict(),
            "saved": saved_id,
            "redo": timeline.redo,
            "execution_count": count,
            "lazy": lazy,
            "seconds": round(time.monotonic() - started, 3),
            "outside_world": OUTSIDE_WORLD,
        }

    def _saved(self, save_dir: Path | None, trigger: str, point: Point) -> str | None:
        """The kernel saved before the restore into ``save_dir``, recorded as a
        checkpoint (once), if it was sealed."""
        if save_dir is None or not (save_dir / MANIFEST_NAME).is_file():
            return None
        manifest = Manifest.read(save_dir)
        if manifest.id not in self.timeline.records:
            self.timeline.taken(self._record(manifest, trigger, save_dir), point)
        return manifest.id

    async def _next_count(self) -> int | None:
        """The execution count the notebook's next cell should get: the running kernel's
        (its agent), else one past the last cell the wrapper saw."""
        count = await self.kernel.agent.execution_count(None, 1.0)
        if count is not None:
            return count
        return self.last_count + 1 if self.last_count is not None else None

    async def _set_count(self, count: int | None) -> int | None:
        """Raise the restored kernel's execution count to ``count`` once its agent is back
        (it reconnects by itself); its count, or None if it did not answer."""
        now = await self.kernel.agent.execution_count(count, COUNT_SECONDS)
        if now is None:
            log.warning("the restored kernel's execution count could not be set to %s", count)
        return now

    def _preview(self, plan: UndoPlan) -> dict[str, Any]:
        """What the undo would do: the plan, the files the kernel holds open (now, or at
        the checkpoint) that changed since, and what would stop the restore."""
        target = self.timeline.records[plan.target]
        manifest = Manifest.read(Path(target.directory))
        return {
            **plan.to_dict(),
            "preview": True,
            "checkpoint": target.to_dict(),
            "changed_files": _changed_files(manifest, self.kernel.process.pid),
            "problems": proctree.missing_files(manifest.needed_files, made_in=manifest.temp_dir),
            "outside_world": OUTSIDE_WORLD,
        }

    # ------------------------------------------------------------------ listing

    def status(self) -> dict[str, Any]:
        """For the kernel's status: whether it gets checkpoints, and the marks."""
        settings = self.store.settings
        return {
            "enabled": settings.enabled and not self.off,
            "reason": self.off or settings.disabled_reason(),
            "mode": settings.mode,
            "position": self.timeline.position,
            "redo": self.timeline.redo,
            "not_in_state": self.timeline.not_in_state,
            "skipped": self.skipped,
            "taking": self.snapshotter.checkpointing,
            "paced_seconds": self._paced_seconds(),
        }

    def _paced_seconds(self) -> float | None:
        """While the pause budget holds back a checkpoint for cells already run: how long
        until it is taken (if the kernel is idle then)."""
        if self._paced is None:
            return None
        return round(max(0.0, self._paced.when() - asyncio.get_running_loop().time()), 3)

    def listing(self) -> dict[str, Any]:
        """The ``checkpoints`` operation's reply (each checkpoint with its directory, which
        the server reads a take-back of variables from)."""
        listed = self.timeline.to_dict()
        for entry, record in zip(listed["checkpoints"], self.timeline.kept(), strict=True):
            entry["directory"] = record.directory
        return {**listed, **self.status(), "outside_world": OUTSIDE_WORLD}

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._paced is not None:
            self._paced.cancel()
        self.store.close()


def _pending(memory: KernelMemory, pid: int, plan: DumpPlan) -> int:
    """What a checkpoint would copy: the kernel's memory changed since the previous one
    (found by content: KernelMemory.protect; all of it for a full copy), and its
    children's whole (never tracked)."""
    pids = proctree.descendants(pid)
    children = proctree.private_memory_bytes([p for p in pids if p != pid])
    written = memory.pending_bytes(pid) if plan.parent_id else None
    if written is None:
        return proctree.private_memory_bytes(pids)
    return written + children
