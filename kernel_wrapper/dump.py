"""A snapshot of the running kernel, as named steps.

A dump goes like this:

0. decide how the kernel's memory is copied (kernel_wrapper/memory.py): only what it
   wrote since its previous snapshot where that was tracked, and first, while it runs,
   pre-copy rounds (``criu pre-dump``) where much is to be copied;
1. stop forwarding requests from the server (they wait in the server-facing sockets);
2. drop every connection to the kernel without losing a message (``Relay.disconnect``);
   the kernel never stops running;
3. checkpoint its CUDA state, if any, into host memory;
4. ``criu dump --leave-running`` (the kernel is frozen only while CRIU seizes it and
   copies its memory: what the pre-copy left), its memory hashed as CRIU writes it;
5. bind the inner channels again: the kernel reconnects and delivers what it queued;
6. link the chain of memory levels (core/criu/chain.py) and write the manifest, while the
   kernel runs.

In :meth:`Dumper.dump` these are the steps *prepare* (the checks), *freeze and dump*
(0-5), *manifest* and *seal* (6). A cell checkpoint (kernel_wrapper/checkpoints.py) is
the same dump into the kernel's checkpoint area, which leaves the kernel's record and
counters as they are, and is cut short before the freeze if a cell came meanwhile; every
tracked dump builds on the kernel's newest one, checkpoint or snapshot
(kernel_wrapper/checkpointarea.py). The images are written into a staging directory beside
the snapshot's, which sealing renames into place; a dump that fails at any step removes it
(:func:`_staging`, the one place that does), so a snapshot is complete or absent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from jupyter_ext import __version__
from jupyter_ext.core import proctree
from jupyter_ext.core.carried import appended, shmfiles
from jupyter_ext.core.chunking import ChunkParams, auto_chunk_kib
from jupyter_ext.core.criu import Criu, FrozenCopy, FrozenStep, external_file_key
from jupyter_ext.core.criu.chain import (
    make_stub,
)
from jupyter_ext.core.errors import KernelNotRunningError, SnapshotError
from jupyter_ext.core.gpu import GpuCheckpoint
from jupyter_ext.core.growinghash import GrowingFileChunker
from jupyter_ext.core.isolation import mountns, privatetmp
from jupyter_ext.core.leftovers import remove_now
from jupyter_ext.core.manifest import (
    IMAGES_DIR,
    FileEntry,
    Manifest,
    new_snapshot_id,
    remove_tree,
    seal,
    utc_now,
)
from jupyter_ext.core.memtrack import TrackingUnavailable
from jupyter_ext.core.memtrack.plan import CHANGES_UNKNOWN, DumpPlan
from jupyter_ext.core.protocol.control import SnapshotArgs
from jupyter_ext.core.protocol.progress import ProgressCallback

from .channels import InnerChannels
from .dumptree import KernelTree
from .lifecycle import State
from .memory import Level, MemoryCopy, Parent, PrecopyFailed
from .parts import KernelParts
from .runtime import RuntimeDir

log = logging.getLogger("kernel_wrapper")


def with_fate(exc: SnapshotError, inner_pid: int) -> SnapshotError:
    """A failed dump's error, saying what became of the kernel: only what is true. A kernel
    that died is the news, and CRIU's failure its consequence: CRIU's hint (a privilege it
    lacked, say, for a task that could no longer be stopped) would send the user astray."""
    if proctree.is_alive(inner_pid):
        fate = "The kernel keeps running unharmed."
        return type(exc)(f"{exc.message} {fate}", hint=exc.hint, log_excerpt=exc.log_excerpt)
    return type(exc)(
        "The kernel's process ended during the snapshot: what it held since its last "
        f"snapshot is gone. (CRIU then said: {exc.message})",
        hint="Restore the kernel's last snapshot, or restart it; its status says how it ended.",
        log_excerpt=exc.log_excerpt,
    )


@contextlib.contextmanager
def _staging(dest: Path) -> Iterator[Path]:
    """A new staging directory beside ``dest`` (with its images directory), removed if the
    dump fails; sealing renames it to ``dest``. A cancelled dump (its kernel died) comes
    here once its CRIU has ended (``Criu._run``); the folder is removed until it is gone
    all the same (a fault test once found the files CRIU writes last in it)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = dest.parent / f".{dest.name}.partial-{secrets.token_hex(4)}"
    (staging / IMAGES_DIR).mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        remove_now(staging)
        raise


@contextlib.contextmanager
def _work_dir(runtime: RuntimeDir) -> Iterator[Path]:
    """CRIU's work directory, removed after the dump. CRIU's log goes to our runtime
    directory, not beside the images: on a disk that fills up it would be cut, and the
    error could no longer say why."""
    work_dir = Path(tempfile.mkdtemp(prefix="dump-", dir=runtime.path))
    try:
        yield work_dir
    finally:
        remove_tree(work_dir)


class CheckpointInterrupted(SnapshotError):
    """A cell checkpoint cut short before the freeze (a cell came): the kernel runs on,
    nothing of the checkpoint is left."""

    code = "checkpoint-interrupted"


@dataclasses.dataclass(frozen=True)
class CellCheckpoint:
    """A dump taken as a cell checkpoint: what its contents record starts from
    (``since``, the agent's cell seq), and what says it must not freeze the kernel now
    (``interrupted``: why, or "")."""

    since: int
    interrupted: Callable[[], str]


@dataclasses.dataclass
class _Dumped:
    """What freeze-and-dump leaves for the manifest."""

    contents: dict[str, Any]
    runtime_dir_key: str
    mounts: list[str]
    """The external mount points of the kernel's own mount namespace (mountns)."""
    tree: KernelTree
    chunk_kib: int
    gpu: dict[str, Any] = dataclasses.field(default_factory=dict)
    shm_files: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    appended_files: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    appended: appended.AppendedCopy | None = None
    """The appended files' copy, to finish once the kernel runs again (its files open)."""
    disconnect_seconds: float = 0.0
    dump_seconds: float = 0.0
    frozen_seconds: float = 0.0
    shm_copy_seconds: float = 0.0
    pause_seconds: float = 0.0
    running_request: dict[str, Any] | None = None
    """The cell the kernel was running when it was frozen (read before its requests flow
    again: a cell sent meanwhile runs after the freeze, and is not in the snapshot)."""
    copy: MemoryCopy | None = None
    """How the memory was copied: plan, pre-copy levels, the chain (kernel_wrapper/memory.py)."""


class Dumper:
    """Dumps ``kernel`` into sealed snapshot directories, keeping its record."""

    def __init__(self, kernel: KernelParts) -> None:
        self.kernel = kernel

    async def dump(
        self,
        args: SnapshotArgs,
        progress: ProgressCallback,
        *,
        checkpoint: CellCheckpoint | None = None,
    ) -> Manifest:
        """Snapshot the kernel into ``args.dest`` (its process ends unless
        ``args.leave_running``); the sealed manifest. ``checkpoint``: as a cell
        checkpoint (see the module)."""
        dest = Path(args.dest)
        try:
            await self._prepare(dest)
        except BaseException:
            await self.kernel.memory.release()  # a checkpoint may have protected it
            raise
        criu = self.kernel.criu()
        inner_pid = self.kernel.process.pid
        assert inner_pid is not None  # checked by _prepare
        checkpoints = self.kernel.checkpoints
        parent = Parent.read(checkpoints.parent_dir(self.kernel.memory) or args.parent)
        with checkpoints.anchor() as anchor:  # removed unless the snapshot is sealed
            with _staging(dest) as staging:
                with _work_dir(self.kernel.runtime) as work_dir:
                    try:
                        dumped, hasher = await self._freeze_and_dump(
                            criu, staging, work_dir, args, progress, parent, cell=checkpoint
                        )
                    finally:
                        await self.kernel.memory.release()
                digests = None
                if dumped.copy is not None and args.leave_running:
                    digests = await self.kernel.memory.digests_after(staging, dumped.copy)
                await self._copy_appended(dumped, hasher)
                if dumped.copy is not None:
                    await asyncio.to_thread(dumped.copy.link_chain, staging, parent)
                manifest = self._manifest(criu, dumped, args)
                chained = dumped.copy is not None and dumped.copy.chain is not None
                if checkpoint is None and args.leave_running and chained:
                    await asyncio.to_thread(anchor.link, staging)  # before the seal's stamps
                progress({"phase": "hashing"})
                chain = dumped.copy.entries if dumped.copy else {}
                manifest = await self._seal(staging, manifest, dest, hasher, chain)
            anchor.sealed(dest, manifest.id)
        if checkpoint is None:
            self.kernel.record.dumped(manifest)
            self.kernel.tracker.snapshot_taken()
        self.kernel.memory.dumped(
            manifest.id,
            inner_pid,
            tracked=dumped.copy is not None and dumped.copy.plan.track,
            ended=not args.leave_running,
            digests=digests,
        )
        progress({"phase": "done", "bytes": manifest.total_bytes})
        return manifest

    # ------------------------------------------------------------------ prepare

    async def _prepare(self, dest: Path) -> None:
        """Refuse a dump without a running kernel, or into a directory that exists; wait
        until a lazily restored kernel has all of its memory."""
        if not self.kernel.lifecycle.is_(State.RUNNING) or self.kernel.process.pid is None:
            raise KernelNotRunningError(
                "There is no running kernel process to snapshot "
                f"(the kernel is {self.kernel.lifecycle.state.value}).",
                hint="Start or restore the kernel first.",
            )
        if dest.exists():
            raise SnapshotError(f"The snapshot directory {dest} already exists.")
        await self.kernel.lazy.settled(holding_lock=True)  # the caller holds exclusive()
        if not self.kernel.lifecycle.is_(State.RUNNING) or self.kernel.process.pid is None:
            state = self.kernel.lifecycle.state.value
            raise KernelNotRunningError(
                f"The kernel did not come back from its lazy restore ({state}).",
                hint="See the kernel's status (lazy_restore) for why.",
            )

    async def _contents(self, since: int) -> dict[str, Any]:
        """What the kernel's own code says the snapshot holds (kernel_wrapper.agents), with
        the cells after ``since``, while the kernel still runs; without an answer the
        snapshot goes on, its record partial."""
        return await self.kernel.agent.summary(since)

    # ------------------------------------------------------------------ freeze and dump

    async def _freeze_and_dump(
        self,
        criu: Criu,
        staging: Path,
        work_dir: Path,
        args: SnapshotArgs,
        progress: ProgressCallback,
        parent: Parent | None,
        *,
        cell: CellCheckpoint | None,
    ) -> tuple[_Dumped, GrowingFileChunker]:
        """Steps 0-5: the memory's plan and pre-copy, the kernel's CUDA state
        checkpointed, its connections dropped, its tree dumped into ``staging``, its
        connections back (if it keeps running). Returns what the manifest needs, and the
        hasher of the memory images."""
        inner_pid = self.kernel.process.pid
        assert inner_pid is not None  # checked by _prepare
        runtime_dir_key = external_file_key(self.kernel.runtime.fd)
        mounts = mountns.external_mounts(inner_pid)
        contents = await self._contents(cell.since if cell else self.kernel.record.cells_through)
        chunk_kib = self._chunk_kib(args, proctree.descendants(inner_pid))
        plan, prev, levels, stopped, compared = await self._copy_ahead(
            criu, inner_pid, staging, work_dir, parent, args, progress
        )
        self.kernel.lifecycle.enter(State.SNAPSHOTTING)
        await asyncio.sleep(0)  # let the cancelled pumps let go of their sockets
        if cell is not None and (why := cell.interrupted()):
            self.kernel.lifecycle.enter(State.RUNNING)
            raise CheckpointInterrupted(f"The cell checkpoint was cut short: {why}.")
        gpu_info, checkpoint = await self._gpu_checkpoint(inner_pid, args, progress)
        progress({"phase": "dumping"})
        started = time.monotonic()
        tree: KernelTree | None = None
        dumped: _Dumped | None = None
        try:
            await self.kernel.relay.disconnect(inner_pid)
            disconnect_seconds = time.monotonic() - started
            tree = KernelTree.inspect(inner_pid, criu.keeps_tcp())
            dumped = _Dumped(
                contents=contents,
                runtime_dir_key=runtime_dir_key,
                mounts=mounts,
                tree=tree,
                chunk_kib=chunk_kib,
                gpu=gpu_info,
                disconnect_seconds=disconnect_seconds,
                copy=MemoryCopy(plan, levels, stopped, compared),
            )
            hasher = await self._criu_dump(criu, staging, work_dir, args, dumped, prev)
            dumped.running_request = self.kernel.tracker.running_request()
        except BaseException as exc:
            if tree is not None:
                tree.held.close()
            if dumped is not None and dumped.appended is not None:
                dumped.appended.close()
            if checkpoint is not None:
                await self.kernel.gpu.abort(checkpoint)
            if isinstance(exc, SnapshotError):
                raise with_fate(exc, inner_pid) from exc
            raise
        finally:
            self._reconnect()
        if checkpoint is not None:
            if args.leave_running:
                await self.kernel.gpu.resume(checkpoint)
            gpu_info["checkpoint"] = checkpoint.to_dict()
        tree.held.close()
        dumped.pause_seconds = time.monotonic() - started
        if not args.leave_running:
            self.kernel.lifecycle.enter(State.SUSPENDED)
        return dumped, hasher

    @staticmethod
    async def _copy_appended(dumped: _Dumped, hasher: GrowingFileChunker) -> None:
        """After the dump, the kernel running and connected again: the files it appends to,
        up to their sizes at the freeze (appends only add past them: the freeze does not
        grow with a large log)."""
        try:
            if dumped.appended is not None:
                await asyncio.to_thread(dumped.appended.copy_after)
        except BaseException:
            hasher.cancel()
            raise
        finally:
            if dumped.appended is not None:
                dumped.appended.close()

    def _chunk_kib(self, args: SnapshotArgs, pids: list[int]) -> int:
        """The chunk size asked for, else one for the kernel's memory (the previous
        snapshot's if it still fits: chunking.auto_chunk_kib)."""
        if args.chunk_kib is not None:
            return args.chunk_kib
        memory = proctree.private_memory_bytes(pids)
        return auto_chunk_kib(memory, self.kernel.record.chunk_kib)

    async def _copy_ahead(
        self,
        criu: Criu,
        inner_pid: int,
        staging: Path,
        work_dir: Path,
        parent: Parent | None,
        args: SnapshotArgs,
        progress: ProgressCallback,
    ) -> tuple[DumpPlan, Path | None, list[Level], str, dict[str, Any]]:
        """Step 0, the kernel running and connected: the memory's plan, the parent's stub
        for CRIU, and the pre-copy rounds. Returns the plan, the images the dump builds on
        (the last round's, or the parent's stub), the rounds' levels, why they stopped and
        what the comparison with the parent's pages found (KernelMemory.protect: where it
        fails, the dump copies everything)."""
        plan = await self.kernel.memory.plan(
            criu,
            inner_pid,
            parent,
            enabled=args.track_memory,
            keeps_running=args.leave_running,
        )
        prev: Path | None = None
        if plan.parent_id and parent is not None:
            prev = work_dir / "parent-stub"
            await asyncio.to_thread(make_stub, parent.directory / IMAGES_DIR, prev)
        if not plan.track:
            return plan, None, [], "", {}
        compared: dict[str, Any] = {}
        if plan.parent_id:
            progress({"phase": "comparing"})
            try:
                compared = await self.kernel.memory.protect()
            except (TrackingUnavailable, OSError) as exc:  # everything is copied
                log.warning("finding what changed since %s failed: %s", plan.parent_id, exc)
                reason = CHANGES_UNKNOWN.format(error=exc)
                plan = DumpPlan(None, reason, track=True, precopy=plan.precopy)
                prev = None
        levels: list[Level] = []
        stopped = ""
        if plan.precopy:
            try:
                levels, stopped = await self.kernel.memory.copy_ahead(
                    criu,
                    inner_pid,
                    staging,
                    work_dir,
                    prev,
                    ChunkParams.of_kib(self._chunk_kib(args, proctree.descendants(inner_pid))),
                    progress,
                )
            except PrecopyFailed as failed:  # everything is copied, frozen
                plan = DumpPlan(None, failed.reason, track=True, precopy=False)
                prev, levels, stopped = None, [], failed.reason
        self.kernel.memory.register()
        return plan, (levels[-1].directory if levels else prev), levels, stopped, compared

    async def _gpu_checkpoint(
        self, inner_pid: int, args: SnapshotArgs, progress: ProgressCallback
    ) -> tuple[dict[str, Any], GpuCheckpoint | None]:
        """Step 3, before the connections are dropped: a kernel whose CUDA state cannot
        be checkpointed runs on as before."""
        try:
            return await self.kernel.gpu.checkpoint(inner_pid, progress, args.release_gpu_caches)
        except BaseException:
            self.kernel.lifecycle.enter(State.RUNNING)
            raise

    async def _criu_dump(
        self,
        criu: Criu,
        staging: Path,
        work_dir: Path,
        args: SnapshotArgs,
        dumped: _Dumped,
        prev: Path | None,
    ) -> GrowingFileChunker:
        """Step 4: ``criu dump`` of the disconnected tree, the /dev/shm files it holds
        copied while it is frozen, the memory cut and hashed as CRIU writes it (the only
        time it is hashed), the images fixed for a restore elsewhere. Returns the hasher,
        to finish once the dump is over."""
        tree = dumped.tree
        shm = shmfiles.ShmCopy(tree.held, staging / shmfiles.SNAPSHOT_DIR_NAME)
        logs = appended.AppendedCopy(
            tree.appended_files,
            staging / appended.SNAPSHOT_DIR_NAME,
            appended.LookedAt(tree.root, frozenset(tree.held.paths)),
        )
        # A tree of one process that appends to nothing is not looked at again while
        # frozen (it saves the freeze CRIU's action script): a child it starts meanwhile
        # is the rare case, a Ray worker the common one.
        dumped.appended = logs if tree.appended_files or len(tree.pids) > 1 else None
        steps: list[FrozenStep] = [
            *([shm] if tree.held.files else []),
            *([logs] if dumped.appended is not None else []),
        ]
        copier = FrozenCopy(steps) if steps else None
        dump_started = time.monotonic()
        params = ChunkParams.of_kib(dumped.chunk_kib)
        hasher = GrowingFileChunker(
            staging, staging / IMAGES_DIR, params, write_back=args.write_back
        )
        if dumped.copy is not None and dumped.copy.plan.track:
            self.kernel.memory.tracked_run()
        # Without --leave-running CRIU ends the kernel: no death, and it is reaped here.
        async with contextlib.nullcontext() if args.leave_running else self.kernel.process.ending():
            try:
                dumped.frozen_seconds = await criu.dump(
                    tree.root,
                    staging / IMAGES_DIR,
                    work_dir,
                    leave_running=args.leave_running,
                    externals=[
                        dumped.runtime_dir_key,
                        *tree.held.keys,
                        *mountns.dump_keys(dumped.mounts),
                    ],
                    keep_tcp=tree.keep_tcp,
                    ghost_limit=tree.ghost_bytes,
                    open_by_fd=tree.held.keys,
                    frozen=copier,
                    netns=self.kernel.process.network,
                    track_mem=dumped.copy is not None and dumped.copy.plan.track,
                    prev_images=prev,
                )
            except BaseException as exc:
                hasher.cancel()
                if copier is not None and copier.error is not None:
                    raise SnapshotError(
                        "The kernel's shared memory files or logs could not be copied into "
                        f"the snapshot: {copier.error}.",
                        hint="Free space on the disk of the work directory if it is "
                        "full; else read the error, fix what it names and retry.",
                    ) from exc
                raise
            dumped.dump_seconds = time.monotonic() - dump_started
            if dumped.copy is not None:
                dumped.copy.frozen_bytes = criu.copied_bytes(work_dir)
            if copier is not None:
                dumped.shm_files = shm.records
                dumped.appended_files = logs.records
                dumped.shm_copy_seconds = copier.seconds
            if not args.leave_running:
                shmfiles.remove_names(dumped.shm_files, tree.held)
        return hasher

    def _reconnect(self) -> None:
        """Step 5, after the dump, failed or not: bind the inner channels again (the
        kernel reconnects and delivers what it queued), unless the kernel is gone."""
        if self.kernel.process.pid is not None and self.kernel.lifecycle.is_(State.SNAPSHOTTING):
            self.kernel.relay.connect_inner(
                self.kernel.relay.inner or InnerChannels(self.kernel.runtime.path)
            )
            self.kernel.lifecycle.enter(State.RUNNING)

    # ------------------------------------------------------------------ manifest and seal

    def _manifest(self, criu: Criu, dumped: _Dumped, args: SnapshotArgs) -> Manifest:
        """The snapshot's record, before the files are hashed: the kernel, its lineage,
        what the dump found and how long each part took."""
        tree = dumped.tree
        return Manifest(
            id=new_snapshot_id(),
            lineage=self.kernel.record.lineage,
            sequence=self.kernel.record.next_sequence(args.sequence),
            created=utc_now(),
            trigger=args.trigger,
            runtime_dir=str(self.kernel.runtime.path),
            runtime_dir_key=dumped.runtime_dir_key,
            mounts=dumped.mounts,
            temp_dir=privatetmp.bound_temp_dir(dumped.mounts),
            stdio_pipe=self.kernel.process.stdio_pipe,
            kernel_spec=args.metadata.get("kernel_spec", {}),
            notebook_path=args.metadata.get("notebook_path"),
            kernel_info=self.kernel.tracker.kernel_info,
            parent_id=self.kernel.record.parent_snapshot,
            product_version=__version__,
            criu_version=criu.version_text,
            needed_files=tree.needed,
            bound_ports=[port.to_dict() for port in tree.ports],
            shm_files=dumped.shm_files,
            appended_files=dumped.appended_files,
            unix_socket_dirs=tree.socket_dirs,
            tcp_kept=tree.keep_tcp,
            kept_connections=[c.to_dict() for c in tree.kept_connections()],
            closed_connections=[c.to_dict() for c in tree.closed_connections()],
            running_request=dumped.running_request,
            gpu=dumped.gpu,
            disconnect_seconds=round(dumped.disconnect_seconds, 4),
            dump_seconds=round(dumped.dump_seconds, 4),
            frozen_seconds=round(dumped.frozen_seconds, 4),
            shm_copy_seconds=round(dumped.shm_copy_seconds, 4),
            pause_seconds=round(dumped.pause_seconds, 4),
            chunk_kib=dumped.chunk_kib,
            contents=dumped.contents,
            memory=dumped.copy.record(dumped.frozen_seconds, tree) if dumped.copy else {},
        )

    @staticmethod
    async def _seal(
        staging: Path,
        manifest: Manifest,
        dest: Path,
        hasher: GrowingFileChunker,
        chain: dict[str, FileEntry],
    ) -> Manifest:
        """Step 6: the files hashed (the memory images as CRIU wrote them; the chain's
        levels as their pre-copies did, the parent's by its own manifest), the manifest
        written last and the staging directory renamed to ``dest``."""
        hashed = {**chain, **await asyncio.to_thread(hasher.finish)}
        manifest = await asyncio.to_thread(seal, staging, manifest, dest, hashed)
        return manifest
