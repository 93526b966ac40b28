"""The kernel's memory between snapshots: tracked, so that a dump copies only what the
kernel wrote since its previous snapshot, and copied while it runs before the freeze.

This part holds the kernel process's tracker (jupyter_ext/core/memtrack/: the kernel's
userfaultfd, opened by its agent on request and held here, outside the dumped tree),
knows since which snapshot the memory has been tracked, gathers what the plan
(core/memtrack/plan.py) decides on, and runs the pre-copy rounds. The dump
(kernel_wrapper/dump.py) then freezes the kernel for what is left and assembles the
chain of levels (core/criu/chain.py).

The tracker and the page digests need numpy: they are imported at a kernel's first
snapshot, not when each wrapper starts (0.1-0.2 s of CPU that most kernels' starts
would pay for nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jupyter_ext.core import proctree
from jupyter_ext.core.chunking import ChunkParams
from jupyter_ext.core.criu import Criu
from jupyter_ext.core.criu.chain import (
    PARENT,
    ChainStats,
    attach,
    chain_stats,
    chain_stats_of,
    keep_level_files,
    level_files_of,
    link_parent,
    parent_entries,
)
from jupyter_ext.core.errors import SnapshotError
from jupyter_ext.core.gpu import find_cuda_processes
from jupyter_ext.core.growinghash import GrowingFileChunker
from jupyter_ext.core.manifest import IMAGES_DIR, FileEntry, Manifest
from jupyter_ext.core.memtrack import TrackingUnavailable
from jupyter_ext.core.memtrack.plan import (
    AFTER_RESTORE,
    FIRST,
    NO_DIGESTS,
    OFF,
    DumpPlan,
    Situation,
    plan_dump,
    precopy_stop,
)
from jupyter_ext.core.memtrack.writeback import unthrottled_bytes
from jupyter_ext.core.protocol.environment import ENV_AGENT_SOCKET
from jupyter_ext.core.protocol.progress import ProgressCallback

from .dumptree import KernelTree
from .relay import Relay

if TYPE_CHECKING:
    from jupyter_ext.core.memtrack.digests import PageDigests
    from jupyter_ext.core.memtrack.tracker import MemoryTracker

log = logging.getLogger("kernel_wrapper")

#: How long the kernel's agent gets to open a tracker (a syscall and an ioctl).
AGENT_TIMEOUT = 2.0
#: Blocks one "collapse" request names, and how long the agent gets for them (copying
#: 512 pages into a huge page: ~0.2 ms a block here).
COLLAPSE_BATCH = 256
COLLAPSE_TIMEOUT = 10.0
#: Why a dump copies everything after a CRIU run on soft-dirty bits whose dump was not
#: sealed: that run cleared the bits of pages no image holds.
PROTECTED = "its previous snapshot failed"


#: Why a dump copied everything, frozen, after a pre-copy round failed.
PRECOPY_FAILED = (
    "a pre-copy round failed (later snapshots of this kernel are not pre-copied): {error}"
)


class PrecopyFailed(Exception):
    """A pre-copy round failed (:meth:`KernelMemory.copy_ahead`): the dump copies
    everything, for the reason this carries."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Parent:
    """The kernel's previous snapshot, as the server found it on this machine."""

    directory: Path
    manifest: Manifest
    chain: ChainStats

    @classmethod
    def read(cls, directory: str | None) -> Parent | None:
        if directory is None:
            return None
        try:
            manifest = Manifest.read(Path(directory))
        except (OSError, SnapshotError) as exc:
            log.warning("the previous snapshot at %s cannot be used: %s", directory, exc)
            return None
        return cls(Path(directory), manifest, chain_stats(manifest))


@dataclass
class Level:
    """A pre-copy round's images: a level of the chain below the dump's own."""

    directory: Path
    entries: dict[str, FileEntry]
    """Its pages files' entries (cut and hashed as CRIU wrote them), by path relative to
    the staging directory at the time."""
    frozen_seconds: float
    copied_bytes: int
    seconds: float
    synced: bool = False
    """Its files are on disk (:func:`_make_room`)."""

    def record(self) -> dict[str, Any]:
        return {
            "frozen_seconds": round(self.frozen_seconds, 4),
            "copied_bytes": self.copied_bytes,
            "seconds": round(self.seconds, 4),
        }


@dataclass
class MemoryCopy:
    """How one dump copied the kernel's memory: its plan, its pre-copy levels (oldest
    first) and why they stopped; once the dump is over, its chain (:meth:`link_chain`)
    and the manifest's record of it (:meth:`record`)."""

    plan: DumpPlan
    levels: list[Level]
    precopy_stopped: str = ""
    compared: dict[str, Any] = field(default_factory=dict)
    """What the comparison with the parent's pages read, found changed and took
    (:meth:`KernelMemory.protect`)."""
    frozen_bytes: int = 0
    """The memory CRIU copied while the kernel was frozen."""
    entries: dict[str, FileEntry] = field(default_factory=dict)
    """Entries of the chain's files hashed before the seal (levels and parent), by path."""
    chain: ChainStats | None = None

    def link_chain(self, staging: Path, parent: Parent | None) -> None:
        """The kernel running again: make the dump's images self-contained. The pre-copy
        levels go under ``images/parent`` (the newest first), the parent snapshot's level
        files are hard-linked below them (core/criu/chain.py), and the entries of every
        file hashed already are noted for the seal."""
        if not self.plan.track:
            return
        images = staging / IMAGES_DIR
        depth = len(self.levels)
        if self.plan.parent_id and parent is not None:
            bottom = self.levels[0].directory if self.levels else images
            link_parent(bottom, parent.directory / IMAGES_DIR, level_files_of(parent.manifest))
            under = "/".join([IMAGES_DIR, *[PARENT] * (depth + 1)])
            self.entries.update(parent_entries(parent.manifest, under))
        for index, level in enumerate(self.levels):
            keep_level_files(level.directory)
            if index:
                attach(level.directory, self.levels[index - 1].directory)
            here = "/".join([IMAGES_DIR, *[PARENT] * (depth - index)])
            for rel, entry in level.entries.items():
                path = f"{here}/{rel.rsplit('/', 1)[-1]}"
                self.entries[path] = FileEntry(path, entry.size, entry.sha256, entry.chunks)
        if self.levels:
            attach(images, self.levels[-1].directory)
        self.chain = chain_stats_of(staging)

    def record(self, frozen_seconds: float, tree: KernelTree) -> dict[str, Any]:
        """The manifest's ``memory`` (the dump itself froze the kernel ``frozen_seconds``)."""
        plan = self.plan
        return {
            "chain": dataclasses.asdict(self.chain) if self.chain else None,
            "mode": plan.mode,
            "reason": plan.reason,
            "tracked": plan.track,
            "parent": plan.parent_id,
            "precopy": [level.record() for level in self.levels],
            "precopy_stopped": self.precopy_stopped,
            "compared": self.compared,
            "frozen_bytes": self.frozen_bytes,
            "copied_bytes": self.frozen_bytes + sum(lvl.copied_bytes for lvl in self.levels),
            "frozen_total_seconds": round(
                frozen_seconds + sum(lvl.frozen_seconds for lvl in self.levels), 4
            ),
            "untracked_processes": _untracked_processes(tree) if plan.track else [],
        }


def _untracked_processes(tree: KernelTree) -> list[dict[str, Any]]:
    """The kernel's children, which are copied whole every time (only the kernel's own
    process holds a tracker). One that ended since the dump (a Ray worker, a pool's task:
    it is in the snapshot still) is left out: its figures cannot be read any more."""
    listed = []
    for pid in tree.pids:
        if pid == tree.root:
            continue
        try:
            listed.append(
                {
                    "pid": proctree.ns_pid(pid),
                    "name": proctree.process_name(pid),
                    "bytes": proctree.private_memory_bytes([pid]),
                }
            )
        except OSError:
            continue
    return listed


@dataclass
class _Tracked:
    """Since which snapshot the kernel process's memory has been tracked, and what each
    page of that snapshot holds (core/memtrack/digests.py; None where CRIU's soft-dirty
    bits track it)."""

    pid: int
    started: str
    snapshot_id: str
    digests: PageDigests | None


@dataclass
class KernelMemory:
    """The memory tracking of the kernel that ``relay`` connects (see the module)."""

    relay: Relay
    tracker: MemoryTracker | None = None
    untracked_reason: str = FIRST
    precopy_failed: str = ""
    """Why a pre-copy round of this wrapper failed (its snapshot was then copied whole,
    frozen): later ones are not tried."""
    _tracked: _Tracked | None = field(default=None, repr=False)
    _compared: tuple[str, dict[str, Any]] | None = field(default=None, repr=False)
    """The snapshot the memory was compared with since it was protected, and what that
    found (:meth:`protect`, until :meth:`release`)."""
    _collapsing: asyncio.Future[None] | None = field(default=None, repr=False)
    """The kernel's agent collapsing the huge pages split in the last snapshot."""
    _unchanged: tuple[str, dict[int, bytes]] | None = field(default=None, repr=False)
    """The snapshot the last comparison was with, and the digests of the 2 MiB blocks it
    found unchanged whole (for :meth:`digests_after`)."""

    # ------------------------------------------------------------------ planning

    async def plan(
        self,
        criu: Criu,
        inner_pid: int,
        parent: Parent | None,
        *,
        enabled: bool,
        keeps_running: bool,
    ) -> DumpPlan:
        """What the next dump of ``inner_pid`` copies (core/memtrack/plan.py), with the
        tracker it needs ready; ``enabled``: the server's track_memory; ``keeps_running``:
        not a suspend."""
        if enabled:
            kind, why = await asyncio.to_thread(criu.dirty_tracking)
        else:
            kind, why = None, OFF
        if kind == "userfaultfd":
            why = await self._ensure_tracker(inner_pid)
            if why:
                kind = None
        pids = proctree.descendants(inner_pid)
        cuda = await asyncio.to_thread(find_cuda_processes, pids)
        tracked = self._tracked if self._same_process(inner_pid) else None
        situation = Situation(
            tracking=kind,
            unavailable=why,
            untracked_reason=self.untracked_reason,
            tracked_since=tracked.snapshot_id if tracked else None,
            parent_id=parent.manifest.id if parent else None,
            parent_chain=parent.chain if parent else None,
            memory_bytes=proctree.private_memory_bytes(pids),
            gpu=bool(cuda),
            pinned_bytes=proctree.pinned_memory_bytes(pids),
            keeps_running=keeps_running,
            precopy_possible=not self.precopy_failed
            and (
                os.geteuid() == 0
                or bool(os.environ.get(ENV_AGENT_SOCKET))
                or await asyncio.to_thread(criu.precopies_unprivileged)
            ),
        )
        return plan_dump(situation)

    def _same_process(self, pid: int) -> bool:
        tracked = self._tracked
        if tracked is None or tracked.pid != pid:
            return False
        return bool(tracked.started) and proctree.start_time(pid) == tracked.started

    async def _ensure_tracker(self, inner_pid: int) -> str:
        """A tracker of ``inner_pid`` held here (asked of its agent if there is none);
        why there can be none, or ""."""
        tracker = self.tracker
        if tracker is not None and tracker.pid == inner_pid and tracker.same_process():
            return ""
        self._drop_tracker()
        if self.relay.inner is None:
            return "the kernel is not connected"
        answer = await self.relay.inner.ask_agent("open_tracker", AGENT_TIMEOUT)
        fd = answer.get("fd")
        if type(fd) is not int:
            return str(answer.get("error") or "the kernel's agent opened no memory tracker")
        from jupyter_ext.core.memtrack.tracker import MemoryTracker  # numpy

        try:
            self.tracker = await asyncio.to_thread(MemoryTracker.take, inner_pid, fd)
        except (TrackingUnavailable, OSError) as exc:
            return f"the wrapper cannot take the kernel's memory tracker: {exc}"
        finally:
            await self.relay.inner.ask_agent("close_tracker", AGENT_TIMEOUT, fd=fd)
        return ""

    def register(self) -> None:
        """Before each tracked dump or pre-copy: the kernel's new mappings are tracked
        from now on (with soft-dirty bits, CRIU tracks everything itself)."""
        if self.tracker is not None:
            self.tracker.register_new()

    async def protect(self) -> dict[str, Any]:
        """At the start of an incremental dump: protect the kernel's memory and unprotect
        what differs from the parent snapshot (MemoryTracker.protect). Returns what it
        read, found changed and took, for the snapshot's record ({} with soft-dirty bits:
        CRIU knows what was written). Raises TrackingUnavailable or OSError where that
        fails: the dump then copies everything."""
        tracked, tracker = self._tracked, self.tracker
        if tracker is None:
            return {}
        if tracked is None or tracked.digests is None:
            raise TrackingUnavailable(0, "no digests of the previous snapshot's pages")
        if self._compared is not None and self._compared[0] == tracked.snapshot_id:
            return self._compared[1]  # a checkpoint compared before deciding on itself
        from jupyter_ext.core.memtrack.digests import HUGE_PAGE  # numpy

        self.register()
        started = time.monotonic()
        self._compared = None
        changes = await asyncio.to_thread(tracker.protect, tracked.digests)
        compared = {
            "read_bytes": changes.read,
            "changed_bytes": changes.changed,
            "whole_block_bytes": HUGE_PAGE
            * sum(tracked.digests.blocks.get(block) == d for block, d in changes.blocks.items()),
            "seconds": round(time.monotonic() - started, 4),
        }
        self._compared = (tracked.snapshot_id, compared)
        self._unchanged = (tracked.snapshot_id, changes.blocks)
        return compared

    async def release(self) -> None:
        """A dump over (sealed or not), the kernel running again: its memory unprotected
        until the next one, and the huge pages its writes made Linux split meanwhile
        collapsed again by its agent."""
        self._compared = None
        tracker = self.tracker
        if tracker is None or not tracker.same_process():
            return
        try:
            blocks = await asyncio.to_thread(tracker.release)
        except (TrackingUnavailable, OSError) as exc:
            log.debug("releasing the kernel's memory: %s", exc)
            return
        if blocks and (self._collapsing is None or self._collapsing.done()):
            # After the snapshot, not in it: the job does not wait for the kernel's agent.
            self._collapsing = asyncio.ensure_future(self._collapse(blocks))

    async def _collapse(self, blocks: list[int]) -> None:
        for start in range(0, len(blocks), COLLAPSE_BATCH):
            if self.relay.inner is None:
                return
            await self.relay.inner.ask_agent(
                "collapse", COLLAPSE_TIMEOUT, blocks=blocks[start : start + COLLAPSE_BATCH]
            )

    async def digests_after(self, staging: Path, copy: MemoryCopy) -> PageDigests | None:
        """What each page of the kernel's memory holds in the tracked dump ``copy`` just
        made into ``staging``, for the next one to compare the memory with: taken from
        the images (the kernel ran on meanwhile), what they leave to the parent snapshot
        from its digests. None without a tracker (soft-dirty bits), or where the images
        cannot be read (the next dump then copies everything)."""
        if self.tracker is None or not copy.plan.track:
            return None
        from jupyter_ext.core.memtrack.digests import digests_of_dump, root_pid  # numpy

        tracked = self._tracked if copy.plan.parent_id else None
        unchanged, self._unchanged = self._unchanged, None
        images = staging / IMAGES_DIR
        try:
            return await asyncio.to_thread(
                digests_of_dump,
                [images, *(level.directory for level in reversed(copy.levels))],
                root_pid(images),
                tracked.digests if tracked is not None else None,
                unchanged[1] if unchanged and unchanged[0] == copy.plan.parent_id else None,
            )
        except (OSError, SnapshotError, IndexError) as exc:
            log.warning("the digests of the snapshot's pages cannot be taken: %s", exc)
            return None

    def pending_bytes(self, inner_pid: int) -> int | None:
        """What a tracked dump would copy now (None where the count cannot be had: CRIU
        then copies whatever it finds, and there is no pre-copy round)."""
        with contextlib.suppress(TrackingUnavailable, OSError):
            if self.tracker is not None:
                return self.tracker.pending_bytes()
        return None

    # ------------------------------------------------------------------ pre-copy

    async def copy_ahead(
        self,
        criu: Criu,
        inner_pid: int,
        staging: Path,
        work_dir: Path,
        prev: Path | None,
        params: ChunkParams,
        progress: ProgressCallback,
    ) -> tuple[list[Level], str]:
        """Pre-copy rounds while the kernel runs (plan.precopy_stop decides): each a
        ``criu pre-dump`` into a new level under ``staging``, on ``prev`` (the last
        round's, or the parent's stub). The levels, oldest first, and why the rounds
        stopped. Before each round and before the freeze, the levels' files are written
        to disk where what they left dirty would make Linux throttle the next writes
        (:func:`_make_room`): the freeze then never waits on the disk.

        A round that fails raises :class:`PrecopyFailed`, its levels removed: it may have
        protected pages it did not save, so the dump must copy everything (and later
        snapshots of this wrapper are not pre-copied)."""
        levels: list[Level] = []
        previous: int | None = None
        memory = proctree.private_memory_bytes([inner_pid])
        while True:
            self.register()
            pending = self.pending_bytes(inner_pid)
            if pending is None:
                return levels, "what is left to copy cannot be counted here"
            await asyncio.to_thread(_make_room, levels, pending)
            again = sum(level.copied_bytes for level in levels[1:])
            stop = precopy_stop(len(levels), pending, previous, again, memory)
            if stop:
                return levels, stop
            previous = pending
            level_dir = staging / f"precopy-{len(levels) + 1}"
            level_dir.mkdir(mode=0o700)
            round_work = work_dir / level_dir.name
            round_work.mkdir(mode=0o700)
            progress({"phase": "dumping", "total_bytes": pending})
            self.tracked_run()
            hasher = GrowingFileChunker(staging, level_dir, params)
            started = time.monotonic()
            try:
                frozen = await criu.pre_dump(inner_pid, level_dir, round_work, prev_images=prev)
            except SnapshotError as exc:
                hasher.cancel()
                for directory in [*(level.directory for level in levels), level_dir]:
                    await asyncio.to_thread(shutil.rmtree, directory, True)
                self.precopy_failed = _first_error(exc)
                log.warning("a pre-copy round failed; copying the memory frozen: %s", exc)
                raise PrecopyFailed(PRECOPY_FAILED.format(error=self.precopy_failed)) from exc
            except BaseException:
                hasher.cancel()
                raise
            entries = await asyncio.to_thread(hasher.finish)
            levels.append(
                Level(
                    level_dir,
                    entries,
                    frozen,
                    criu.copied_bytes(round_work),
                    time.monotonic() - started,
                )
            )
            prev = level_dir

    # ------------------------------------------------------------------ after a dump

    def dumped(
        self,
        snapshot_id: str,
        inner_pid: int,
        *,
        tracked: bool,
        ended: bool,
        digests: PageDigests | None = None,
    ) -> None:
        """A dump of ``inner_pid`` was sealed as ``snapshot_id``: with ``tracked``, the
        kernel's memory is tracked since then (unless its process ``ended``), its pages'
        ``digests`` those of the dump (:meth:`digests_after`)."""
        if ended or not tracked:
            self.forget(AFTER_RESTORE if ended else FIRST)
            return
        if self.tracker is not None and digests is None:
            self.invalidate(NO_DIGESTS)
            return
        started = proctree.start_time(inner_pid)
        if started:
            self._tracked = _Tracked(inner_pid, started, snapshot_id, digests)

    def tracked_run(self) -> None:
        """A tracked CRIU run starts. With soft-dirty bits it clears the bits of what it
        copies: until this dump is sealed, what the kernel wrote is in no sealed image, so
        its next dump copies everything. With a tracker nothing is lost: each dump
        compares the memory with its parent's digests (:meth:`protect`)."""
        if self.tracker is None:
            self.invalidate(PROTECTED)
        else:
            self.tracker.criu_runs()

    def invalidate(self, reason: str) -> None:
        """What the kernel wrote is no longer known since any snapshot on this machine (a
        tracked CRIU run protected pages whose dump may not be sealed): its next dump
        copies everything, for ``reason``. The tracker stays."""
        self._tracked = None
        self.untracked_reason = reason

    def forget(self, reason: str) -> None:
        """The kernel process is gone or replaced (restored, resumed, ended): as
        :meth:`invalidate`, and its tracker is let go."""
        self.invalidate(reason)
        self._drop_tracker()

    def _drop_tracker(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None

    def status(self) -> dict[str, Any]:
        """For the kernel's status: whether its next snapshot can be incremental."""
        return {
            "tracked_since": self._tracked.snapshot_id if self._tracked else None,
            "untracked_reason": "" if self._tracked else self.untracked_reason,
        }


def _first_error(exc: SnapshotError) -> str:
    """The error, with CRIU's first error line where its log has one (the generic
    message alone does not say why)."""
    for line in exc.log_excerpt.splitlines():
        said = re.search(r"Error \([^)]*\):\s*(.+)", line)
        if said:
            return f"{exc.message} ({said.group(1).strip()})"
    return exc.message


def _make_room(levels: list[Level], upcoming: int) -> None:
    """Before a pre-copy round or the freeze that write about ``upcoming`` bytes: where
    that would bring the page cache's dirty pages past what Linux lets a writer dirty
    without waiting (core/memtrack/writeback.py), write the levels' files to disk first. Syncing
    unconditionally made every round longer (a third of a 1 GiB kernel's round), and the
    kernel wrote more meanwhile, which the freeze then copied."""
    unsynced = [level for level in levels if not level.synced]
    if not unsynced or unthrottled_bytes() >= upcoming:
        return
    for level in unsynced:
        for path in level.directory.iterdir():
            if path.is_file() and not path.is_symlink():
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fdatasync(fd)
                finally:
                    os.close(fd)
        level.synced = True
