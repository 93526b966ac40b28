"""The snapshot engine of one wrapper: dumps, restores, suspends and resumes its kernel.

A dump goes like this:

1. stop forwarding requests from the server (they wait in the server-facing sockets);
2. drop every connection to the kernel without losing a message (``Relay.disconnect``);
   the kernel never stops running;
3. checkpoint its CUDA state, if any, into host memory;
4. ``criu dump --leave-running`` (the kernel is frozen only while CRIU seizes it and
   copies its memory), its memory hashed as CRIU writes it;
5. bind the inner channels again: the kernel reconnects and delivers what it queued;
6. write the manifest, while the kernel runs.

A restore replaces the kernel by a snapshot's; a running kernel is saved first, and put
back if the restore fails, so it is never lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import os
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from jupyter_ext import __version__
from jupyter_ext.core import criuimages, mountns, netports, proctree, shmfiles, sockdiag, tcpconns
from jupyter_ext.core.chunking import ChunkParams, auto_chunk_kib
from jupyter_ext.core.compat import check_compatible
from jupyter_ext.core.criu import Criu, LazyTransfer, external_file_key, unprivileged
from jupyter_ext.core.errors import (
    IncompatibleSnapshotError,
    KernelNotRunningError,
    RestoreError,
    SnapshotBusyError,
    SnapshotError,
)
from jupyter_ext.core.gpu import (
    GpuCheckpoint,
    GpuCheckpointer,
    find_cuda_processes,
    gpu_record,
    open_backend,
    plan_gpu_pairs,
)
from jupyter_ext.core.growinghash import GrowingFileChunker
from jupyter_ext.core.lazypages import (
    LAZY_MIN_BYTES,
    UNIX_PREFIX,
    DirectoryPages,
    page_source,
    pages_bytes,
    stage_pages_files,
    worth_lazy,
)
from jupyter_ext.core.manifest import (
    IMAGES_DIR,
    Manifest,
    new_snapshot_id,
    remove_tree,
    seal,
    utc_now,
    verify,
)
from jupyter_ext.core.protocol import (
    ProgressCallback,
    Restored,
    RestoreRequest,
    ResumeArgs,
    SnapshotArgs,
    SuspendArgs,
)
from kernel_snapshots import write_restore_info

from .channels import InnerChannels
from .lifecycle import Lifecycle, State
from .relay import Relay
from .runtime import RuntimeDir
from .supervisor import Supervisor

log = logging.getLogger("kernel_wrapper")

#: How long the kernel's snapshot agent gets to release GPU caches before a checkpoint.
AGENT_TIMEOUT = 10.0
#: How long it gets to say what the snapshot holds (it takes ~50 ms at most; more only
#: while the kernel's code holds the interpreter lock in C).
SUMMARY_TIMEOUT = 1.0


def _with_fate(exc: SnapshotError, inner_pid: int) -> SnapshotError:
    """A failed dump's error, saying what became of the kernel: only what is true."""
    if proctree.is_alive(inner_pid):
        fate = "The kernel keeps running unharmed."
    else:
        fate = (
            "The kernel's process ended during the snapshot: what it held since its last "
            "snapshot is gone; restore that snapshot, or restart the kernel."
        )
    return type(exc)(f"{exc.message} {fate}", hint=exc.hint, log_excerpt=exc.log_excerpt)


@dataclasses.dataclass
class _SavedKernel:
    """A running kernel dumped before a restore in place replaces it (see restore)."""

    directory: Path
    sequence: int
    parent_snapshot: str | None
    executions_since_snapshot: int


class Snapshotter:
    """Snapshots of the kernel that ``process`` runs and ``relay`` connects, one operation
    at a time; it keeps the kernel's lineage (``lineage``, ``sequence``, the parent of its
    next snapshot) and the state of the last lazy restore."""

    def __init__(
        self,
        *,
        lifecycle: Lifecycle,
        relay: Relay,
        process: Supervisor,
        runtime: RuntimeDir,
        criu_path: str | None,
        lazy_restore: bool,
        lazy_min_bytes: int = LAZY_MIN_BYTES,
    ) -> None:
        self.lifecycle = lifecycle
        self.relay = relay
        self.process = process
        self.runtime = runtime
        self.criu_path = criu_path
        self.lazy_restore = lazy_restore
        """Restore with CRIU's lazy pages where the machine supports it..."""
        self.lazy_min_bytes = lazy_min_bytes
        """...from local images, for kernels with at least this much memory."""
        self.lineage = secrets.token_hex(8)
        self.sequence = 0
        self.parent_snapshot: str | None = None
        self.chunk_kib: int | None = None
        """The chunk size of the kernel's last snapshot: the next keeps it if it can."""
        self.suspended_snapshot: Path | None = None
        """The snapshot a suspended kernel comes back from."""
        self.last_gpu_restore: dict[str, Any] = {}
        """Timings of the CUDA restore of the last restore (empty without CUDA)."""
        self.lazy_status: dict[str, Any] = {}
        """The last lazy restore: state (transferring/complete/failed), bytes, error."""
        self.closed_on_restore: list[dict[str, Any]] = []
        """Connections to outside peers that the last restore gave back closed."""
        self.cells_through = 0
        """The kernel's last cell (kernel_wrapper.contents.CellLog seq) that a snapshot
        recorded: the next one lists the cells after it."""
        self._discard_after_resume = False
        self._lock = asyncio.Lock()
        self._criu: Criu | None = None
        self._gpu_checkpointer: GpuCheckpointer | None = None
        self._lazy_supported: bool | None = None
        self._lazy: LazyTransfer | None = None
        self._lazy_task: asyncio.Task[None] | None = None

    @property
    def busy(self) -> bool:
        """Whether a snapshot or restore runs."""
        return self._lock.locked()

    def _refuse_if_busy(self) -> None:
        """One snapshot or restore at a time: a second one is refused, not queued."""
        if self._lock.locked():
            raise SnapshotBusyError(
                "A snapshot or restore of this kernel is already in progress.",
                hint="Wait for it to finish, then try again.",
            )

    def _criu_binary(self) -> Criu:
        if self._criu is None:
            self._criu = Criu.locate(self.criu_path)
        return self._criu

    def _gpu(self) -> GpuCheckpointer:
        if self._gpu_checkpointer is None:
            self._gpu_checkpointer = GpuCheckpointer(open_backend())
        return self._gpu_checkpointer

    # ------------------------------------------------------------------ operations

    async def snapshot(self, progress: ProgressCallback, args: SnapshotArgs) -> dict[str, Any]:
        self._refuse_if_busy()
        async with self._lock:
            manifest = await self._dump(
                Path(args.dest),
                args.trigger,
                args.leave_running,
                args.metadata,
                args.sequence,
                progress,
                release_gpu_caches=args.release_gpu_caches,
                chunk_kib=args.chunk_kib,
                write_back=args.write_back,
            )
            result: dict[str, Any] = json.loads(manifest.to_json())
            return result

    async def suspend(self, progress: ProgressCallback, args: SuspendArgs) -> dict[str, Any]:
        """Snapshot the kernel and end its process; the next request brings it back."""
        if self.relay.execution_state == "busy":
            raise SnapshotBusyError(
                "The kernel is running a cell; a busy kernel is never suspended.",
                hint="Wait until the cell finishes, or interrupt it.",
            )
        result = await self.snapshot(
            progress,
            SnapshotArgs(
                args.dest,
                trigger=args.trigger,
                leave_running=False,
                metadata=args.metadata,
                release_gpu_caches=args.release_gpu_caches,
                chunk_kib=args.chunk_kib,
                write_back=args.write_back,
            ),
        )
        self.suspended_snapshot = Path(args.dest)
        self._discard_after_resume = args.discard_after_resume
        return result

    async def resume(self, progress: ProgressCallback, args: ResumeArgs) -> Restored:
        if self.lifecycle.state != State.SUSPENDED or self.suspended_snapshot is None:
            raise KernelNotRunningError(
                f"The kernel is not suspended (it is {self.lifecycle.state.value}).",
                hint="Only suspended kernels can be resumed.",
            )
        return await self.restore(progress, RestoreRequest(self.suspended_snapshot))

    async def wake(self) -> None:
        """Bring a suspended kernel back for a request that needs it (idle GPU suspend)."""
        if self.lifecycle.state != State.SUSPENDED or self._lock.locked():
            return
        if self.suspended_snapshot is not None:
            try:
                await self._restore(self.suspended_snapshot, lambda _: None)
            except SnapshotError as exc:
                log.error("resuming the suspended kernel failed: %s", exc)

    async def restore(self, progress: ProgressCallback, args: RestoreRequest) -> Restored:
        self._refuse_if_busy()
        manifest = await self._restore(
            args.source,
            progress,
            verified=args.verified,
            save_to=args.save_to,
            pages_from=args.pages_from,
        )
        return {
            "inner_pid": self.process.pid,
            "id": manifest.id,
            "lineage": manifest.lineage,
            "gpu": self.last_gpu_restore,
            "closed_connections": manifest.closed_connections,
        }

    # ------------------------------------------------------------------ dump

    async def _dump(
        self,
        dest: Path,
        trigger: str,
        leave_running: bool,
        metadata: dict[str, Any],
        sequence: int | None,
        progress: ProgressCallback,
        *,
        release_gpu_caches: bool = True,
        chunk_kib: int | None = None,
        write_back: bool = False,
    ) -> Manifest:
        if not self.lifecycle.is_(State.RUNNING) or self.process.pid is None:
            raise KernelNotRunningError(
                "There is no running kernel process to snapshot "
                f"(the kernel is {self.lifecycle.state.value}).",
                hint="Start or restore the kernel first.",
            )
        if dest.exists():
            raise SnapshotError(f"The snapshot directory {dest} already exists.")
        await self._lazy_settled()
        if not self.lifecycle.is_(State.RUNNING) or self.process.pid is None:
            state = self.lifecycle.state.value
            raise KernelNotRunningError(
                f"The kernel did not come back from its lazy restore ({state}).",
                hint="See the kernel's status (lazy_restore) for why.",
            )
        criu = self._criu_binary()
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = dest.parent / f".{dest.name}.partial-{secrets.token_hex(4)}"
        (staging / IMAGES_DIR).mkdir(parents=True)
        # CRIU's log goes to our runtime directory, not beside the images: on a disk that
        # fills up it would be cut, and the error could no longer say why.
        work_dir = Path(tempfile.mkdtemp(prefix="dump-", dir=self.runtime.path))
        inner_pid = self.process.pid
        runtime_dir_key = external_file_key(self.runtime.fd)
        mounts = mountns.external_mounts(inner_pid) if inner_pid is not None else []
        contents = await self._contents()
        self.lifecycle.enter(State.SNAPSHOTTING)
        await asyncio.sleep(0)  # let the cancelled pumps let go of their sockets
        gpu_info: dict[str, Any] = {}
        gpu_checkpoint: GpuCheckpoint | None = None
        try:
            gpu_info, gpu_checkpoint = await self._gpu_checkpoint(
                inner_pid, progress, release_gpu_caches
            )
        except BaseException:
            remove_tree(staging)
            remove_tree(work_dir)
            self.lifecycle.enter(State.RUNNING)
            raise
        progress({"phase": "dumping"})
        started = time.monotonic()
        held = shmfiles.HeldFiles()
        try:
            await self.relay.disconnect(inner_pid)
            disconnected_seconds = time.monotonic() - started
            tree = proctree.descendants(inner_pid)
            held = shmfiles.hold_tree_files(tree)
            needed = [f for f in proctree.needed_files(tree) if f["path"] not in held.paths]
            inodes = _socket_inodes(tree)
            ports = netports.bound_ports(inodes)
            socket_dirs = netports.unix_socket_dirs(inner_pid, inodes)
            connections = tcpconns.tree_connections(tree)
            # Connections inside the tree keep their state (needs TCP repair: root).
            keep_tcp = bool(connections.inside) and not unprivileged()
            copier = (
                shmfiles.FrozenCopy(held, staging / shmfiles.SNAPSHOT_DIR_NAME, work_dir)
                if held.files
                else None
            )
            if chunk_kib is None:
                memory = proctree.private_memory_bytes(tree)
                chunk_kib = auto_chunk_kib(memory, self.chunk_kib)
            dump_started = time.monotonic()
            # The memory is cut and hashed as it is written: the only time it is hashed.
            params = ChunkParams.of_kib(chunk_kib)
            hasher = GrowingFileChunker(
                staging, staging / IMAGES_DIR, params, write_back=write_back
            )
            # Without --leave-running CRIU ends the kernel: no death, and it is reaped here.
            async with contextlib.nullcontext() if leave_running else self.process.ending():
                try:
                    frozen = await criu.dump(
                        inner_pid,
                        staging / IMAGES_DIR,
                        work_dir,
                        leave_running=leave_running,
                        externals=[runtime_dir_key, *held.keys, *mountns.dump_keys(mounts)],
                        keep_tcp=keep_tcp,
                        action_script=copier.action_script if copier else None,
                    )
                except BaseException as exc:
                    hasher.cancel()
                    if copier is not None and copier.error is not None:
                        raise SnapshotError(
                            f"The kernel's shared memory files could not be copied into the "
                            f"snapshot: {copier.error}.",
                            hint="Free space on the disk of the work directory if it is "
                            "full; else read the error, fix what it names and retry.",
                        ) from exc
                    raise
                finally:
                    if copier is not None:
                        copier.finish()
                dump_seconds = time.monotonic() - dump_started
                if keep_tcp:
                    await asyncio.to_thread(
                        tcpconns.close_outside_connections, staging / IMAGES_DIR
                    )
                if held.files:
                    await asyncio.to_thread(
                        criuimages.open_external_files_by_fd, staging / IMAGES_DIR, set(held.keys)
                    )
                shm_records = copier.records if copier is not None else []
                if not leave_running:
                    shmfiles.remove_names(shm_records, held)
        except BaseException as exc:
            held.close()
            remove_tree(staging)
            remove_tree(work_dir)
            if gpu_checkpoint is not None:
                await asyncio.to_thread(self._gpu().abort, gpu_checkpoint)
            if isinstance(exc, SnapshotError):
                raise _with_fate(exc, inner_pid) from exc
            raise
        finally:
            if self.process.pid is not None and self.lifecycle.is_(State.SNAPSHOTTING):
                self.relay.connect_inner(self.relay.inner or InnerChannels(self.runtime.path))
                self.lifecycle.enter(State.RUNNING)
        if gpu_checkpoint is not None:
            if leave_running:
                await asyncio.to_thread(self._gpu().resume, gpu_checkpoint)
            gpu_info["checkpoint"] = gpu_checkpoint.to_dict()
        held.close()
        pause_seconds = time.monotonic() - started
        if not leave_running:
            self.lifecycle.enter(State.SUSPENDED)
        self.sequence = sequence if sequence is not None else self.sequence + 1
        manifest = Manifest(
            id=new_snapshot_id(),
            lineage=self.lineage,
            sequence=self.sequence,
            created=utc_now(),
            trigger=trigger,
            runtime_dir=str(self.runtime.path),
            runtime_dir_key=runtime_dir_key,
            mounts=mounts,
            stdio_pipe=self.process.stdio_pipe,
            kernel_spec=metadata.get("kernel_spec", {}),
            notebook_path=metadata.get("notebook_path"),
            kernel_info=self.relay.kernel_info,
            parent_id=self.parent_snapshot,
            product_version=__version__,
            criu_version=criu.version_text,
            needed_files=needed,
            bound_ports=[port.to_dict() for port in ports],
            shm_files=shm_records,
            unix_socket_dirs=socket_dirs,
            tcp_kept=keep_tcp,
            kept_connections=[c.to_dict() for c in connections.inside] if keep_tcp else [],
            closed_connections=[
                c.to_dict() for c in connections.outside + ([] if keep_tcp else connections.inside)
            ],
            running_request=self.relay.running_request(),
            gpu=gpu_info,
            disconnect_seconds=round(disconnected_seconds, 4),
            dump_seconds=round(dump_seconds, 4),
            frozen_seconds=round(frozen, 4),
            shm_copy_seconds=round(copier.seconds, 4) if copier is not None else 0.0,
            pause_seconds=round(pause_seconds, 4),
            chunk_kib=chunk_kib,
            contents=contents,
        )
        progress({"phase": "hashing"})
        shutil.rmtree(work_dir, ignore_errors=True)
        try:
            hashed = await asyncio.to_thread(hasher.finish)
            manifest = await asyncio.to_thread(seal, staging, manifest, dest, hashed)
        except BaseException:
            remove_tree(staging)
            raise
        self.parent_snapshot = manifest.id
        self.chunk_kib = manifest.chunk_kib
        self.cells_through = int(contents.get("cells_through", self.cells_through))
        self.relay.snapshot_taken()
        progress({"phase": "done", "bytes": manifest.total_bytes})
        return manifest

    async def _contents(self) -> dict[str, Any]:
        """What the kernel's agent says the snapshot holds (kernel_wrapper.contents), while
        the kernel still runs; without an answer the snapshot goes on, its record partial."""
        if self.relay.inner is None:
            return {"partial": True, "partial_reason": "the kernel is not connected"}
        answer = await self.relay.inner.ask_agent(
            "summary", SUMMARY_TIMEOUT, since=self.cells_through
        )
        answer.pop("id", None)
        if answer.get("error"):
            return {"partial": True, "partial_reason": str(answer["error"])}
        cells = answer.get("cells")
        running = self.relay.running_request()
        if cells and isinstance(cells[-1], dict) and cells[-1].get("running") and running:
            cells[-1]["execution_count"] = running.get("execution_count")
        return answer

    async def _gpu_checkpoint(
        self,
        inner_pid: int,
        progress: ProgressCallback,
        release_caches: bool,
    ) -> tuple[dict[str, Any], GpuCheckpoint | None]:
        """Lock and checkpoint every CUDA process of the kernel: device memory moves into
        host memory (so CRIU saves it) and the GPU is released. First, if asked, the
        kernel releases what its frameworks cache but do not use (kernel_wrapper.agent)."""
        pids = proctree.descendants(inner_pid)
        cuda_pids = await asyncio.to_thread(find_cuda_processes, pids)
        if not cuda_pids:
            return {}, None
        released: dict[str, Any] = {}
        if release_caches and self.relay.inner is not None:
            progress({"phase": "releasing-gpu-caches"})
            released = await self.relay.inner.ask_agent("release_gpu_caches", AGENT_TIMEOUT)
            released.pop("id", None)
            if released.get("error") or released.get("errors"):
                log.warning("releasing GPU caches: %s", released)
        progress({"phase": "gpu-checkpoint", "processes": len(cuda_pids)})
        record = await asyncio.to_thread(gpu_record, cuda_pids)
        if released:
            record["released_caches"] = released
        record["ns_pids"] = [proctree.ns_pid(pid) for pid in cuda_pids]
        record["total_bytes"] = record.get("needed_bytes", 0)
        checkpoint = await asyncio.to_thread(self._gpu().checkpoint, cuda_pids)
        return record, checkpoint

    # ------------------------------------------------------------------ restore

    async def _restore(
        self,
        source: Path,
        progress: ProgressCallback,
        verified: bool = False,
        save_to: Path | None = None,
        pages_from: str | None = None,
    ) -> Manifest:
        """Replace the inner kernel (if any) by the snapshot in ``source``.

        With lazy restore the kernel runs as soon as CRIU has rebuilt it, its memory
        served page by page (from ``pages_from`` when given: an images directory, or
        ``unix:PATH`` of a lazypages.RangeServer lending the store; filling in the sparse
        ``pages-*.img`` of ``source``; else from ``source``) while the rest arrives in the
        background; a kernel saved before the restore is kept until every page is in.

        ``verified`` skips re-hashing files the caller has just checked (the server
        extension verifies every download); the manifest and compatibility are still read.

        A running kernel is never lost to a failed restore: it is first saved as a suspend
        does (into the new directory ``save_to``, default a new one beside ``source``),
        which also frees its memory, GPU and ports for the restored one; if CRIU or the
        CUDA restore then fails, the saved kernel is put back as it was, and the error says
        so.
        """
        async with self._lock:
            progress({"phase": "verifying"})
            if verified:
                manifest = Manifest.read(source)
            else:
                manifest = await asyncio.to_thread(verify, source)
            check_compatible(manifest)
            self._check_ports_free(manifest)
            criu = self._criu_binary()
            lazy = self._lazy_wanted(manifest, criu, local=not _from_server(pages_from))
            saved: _SavedKernel | None = None
            if self.lifecycle.is_(State.RUNNING) and self.process.pid is not None:
                saved = await self._save_before_restore(
                    save_to or source.parent / new_snapshot_id(), progress
                )
            progress({"phase": "restoring"})

            def restored() -> None:
                self.sequence = max(self.sequence, manifest.sequence)
                self.parent_snapshot = manifest.id
                self.chunk_kib = manifest.chunk_kib
                self.cells_through = int(manifest.contents.get("cells_through", 0))
                self.relay.snapshot_taken()

            try:
                await self._replace_inner(
                    source, manifest, criu, restored, lazy=lazy, pages_from=pages_from
                )
            except SnapshotError as exc:
                if saved is None:
                    raise
                await self._put_back(saved, exc, criu)
            if self._lazy is not None:
                self._lazy_task = asyncio.create_task(self._complete_lazy(self._lazy, saved, criu))
            elif saved is not None:
                remove_tree(saved.directory)
            if self.suspended_snapshot is not None:
                if self._discard_after_resume and self.suspended_snapshot == source:
                    shutil.rmtree(source, ignore_errors=True)
                self.suspended_snapshot = None
            progress({"phase": "done"})
            return manifest

    def _check_ports_free(self, manifest: Manifest) -> None:
        """Refuse, before anything is ended, a snapshot whose listening or bound ports
        another process holds here (the kernel being replaced does not count)."""
        ports = [netports.BoundPort.from_dict(p) for p in manifest.bound_ports]
        if not ports:
            return
        pid = self.process.pid
        own = _socket_inodes(proctree.descendants(pid)) if pid else set()
        taken = netports.taken_ports(ports, ignore=own)
        if taken:
            raise IncompatibleSnapshotError(
                "The snapshot's kernel had network ports open that another process holds "
                f"here: {', '.join(taken)}.",
                hint="Stop the process that holds them ('ss -tulpn' names it), or restore "
                "on a machine where they are free.",
            )

    async def _save_before_restore(
        self, directory: Path, progress: ProgressCallback
    ) -> _SavedKernel:
        """Dump the running kernel and end it (a suspend), so that a failed restore can
        bring it back. A kernel that cannot be dumped keeps running; the restore is refused."""
        saved = _SavedKernel(
            directory=directory,
            sequence=self.sequence,
            parent_snapshot=self.parent_snapshot,
            executions_since_snapshot=self.relay.executions_since_snapshot,
        )
        progress({"phase": "saving-kernel"})
        try:
            await self._dump(
                saved.directory,
                "before-restore",
                leave_running=False,
                metadata={},
                sequence=self.sequence,
                progress=lambda _: None,
            )
        except SnapshotError as exc:
            raise type(exc)(
                "Nothing was restored: the running kernel could not be saved first, and a "
                f"restore in place would have lost it. {exc.message}",
                hint="Restore into a new kernel instead ('jupyter snapshot restore ID --path "
                "NOTEBOOK'), or shut this kernel down and restore then. " + exc.hint,
                log_excerpt=exc.log_excerpt,
            ) from exc
        return saved

    async def _put_back(self, saved: _SavedKernel, failure: SnapshotError, criu: Criu) -> NoReturn:
        """After a failed restore: bring back the kernel saved before it, then raise."""
        log.warning("restore failed (%s); putting the kernel back", failure.message)

        def put_back() -> None:
            self.sequence = saved.sequence
            self.parent_snapshot = saved.parent_snapshot
            self.relay.executions_since_snapshot = saved.executions_since_snapshot

        try:
            await self._replace_inner(
                saved.directory, Manifest.read(saved.directory), criu, put_back
            )
        except SnapshotError as again:
            # Still nothing lost: it stays suspended on the saved images, and the next
            # request tries again to bring it back.
            self.suspended_snapshot = saved.directory
            self._discard_after_resume = True
            raise type(failure)(
                f"{failure.message} Putting the running kernel back failed too "
                f"({again.message}); its state is kept in {saved.directory}, and it comes "
                "back from there on the next cell.",
                hint=failure.hint,
                log_excerpt=failure.log_excerpt,
            ) from failure
        remove_tree(saved.directory)
        raise type(failure)(
            f"{failure.message} The kernel was put back as it was before the restore; "
            "nothing in it was lost.",
            hint=failure.hint,
            log_excerpt=failure.log_excerpt,
        ) from failure

    def _lazy_wanted(self, manifest: Manifest, criu: Criu, *, local: bool) -> bool:
        """Lazy restore unless turned off, unsupported here, the kernel had CUDA state
        (the CUDA restore reads all of its memory at once: nothing to gain), or its memory
        is ``local`` and small (a full restore is faster then)."""
        if not self.lazy_restore or not worth_lazy(manifest.gpu):
            return False
        if local and pages_bytes(manifest.files) < self.lazy_min_bytes:
            return False
        if self._lazy_supported is None:
            self._lazy_supported, said = criu.supports_lazy_pages()
            if not self._lazy_supported:
                log.warning("lazy restore is not supported here (%s); restoring in full", said)
        return self._lazy_supported

    async def _complete_lazy(
        self, transfer: LazyTransfer, saved: _SavedKernel | None, criu: Criu
    ) -> None:
        """Wait for the rest of a lazily restored kernel's memory. If a page cannot be
        had, the kernel (frozen at its first missing page) is killed: no half-restored
        kernel stays; one saved before a restore in place is put back."""
        pid = self.process.pid
        try:
            await transfer.wait()
            filled = await asyncio.to_thread(transfer.server.fill_gaps)
        except SnapshotError as exc:
            log.error("lazy restore failed: %s", exc)
            error = exc
            async with self._lock:
                if self.process.pid == pid:
                    await self.process.kill()
                self._lazy = None
                transfer.close()
                shutil.rmtree(transfer.work_dir, ignore_errors=True)
                if saved is None:
                    self.lifecycle.enter(State.DEAD)
                else:
                    try:
                        await self._put_back(saved, exc, criu)
                    except SnapshotError as final:
                        error = final  # says whether the kernel is back
                # Reported once settled: what the status shows then is the outcome.
                self.lazy_status = {"state": "failed", "error": error.to_dict()}
            return
        local_copy_error = transfer.server.local_copy_error  # known until it is closed
        self._lazy = None
        transfer.close()
        shutil.rmtree(transfer.work_dir, ignore_errors=True)
        self.lazy_status = {
            "state": "complete",
            "bytes": transfer.server.bytes_served + filled,
            "seconds": round((transfer.finished or time.monotonic()) - transfer.started, 3),
        }
        if local_copy_error:  # the kernel has all of its memory; the local images do not
            self.lazy_status["local_copy_error"] = local_copy_error
        log.info("lazy restore complete: %s", self.lazy_status)
        if saved is not None:
            remove_tree(saved.directory)

    async def _lazy_settled(self) -> None:
        """Before a dump: wait until a lazily restored kernel has all of its memory."""
        task = self._lazy_task
        if task is not None and not task.done():
            await asyncio.shield(asyncio.wait([task]))

    async def _replace_inner(
        self,
        source: Path,
        manifest: Manifest,
        criu: Criu,
        before_running: Callable[[], None],
        *,
        lazy: bool = False,
        pages_from: str | None = None,
    ) -> None:
        """CRIU (and CUDA) restore of ``source`` as the inner kernel, after ending the one
        there is; ``before_running`` updates the kernel's records just before requests flow
        again (held requests then count as new work). On failure the state says what is
        left: SUSPENDED if the kernel was suspended, else DEAD."""
        previous = self.lifecycle.state
        self.lifecycle.enter(State.RESTORING)
        try:
            await self.process.kill()
            await self.relay.close_inner()
            self.relay.connect_inner(InnerChannels(self.runtime.path))
            # The restored kernel reads this before its next cell and runs its restore
            # hooks (its TCP connections come back closed; kernel_snapshots).
            write_restore_info(
                self.runtime.path,
                snapshot_id=manifest.id,
                snapshot_created=manifest.created,
                snapshot_host=manifest.host,
                in_place=previous != State.STARTING,
                resumed=self.suspended_snapshot == source,
                closed_connections=manifest.closed_connections,
            )
            pid = await self._criu_restore(source, manifest, criu, lazy, pages_from)
        except BaseException:
            if self.process.pid is None:
                await self.relay.close_inner()
            self.lifecycle.enter(
                State.SUSPENDED
                if previous == State.SUSPENDED
                else State.DEAD
                if self.process.pid is None
                else State.RUNNING
            )
            raise
        self.process.adopt(pid)
        self.lineage = manifest.lineage
        self.relay.kernel_info = manifest.kernel_info or self.relay.kernel_info
        # A restore is activity: a kernel resumed for a cell must not look idle since
        # before its suspend and be suspended again before that cell even starts.
        self.relay.last_activity = time.time()
        before_running()
        self.relay.resume_request(manifest.running_request)
        self.lifecycle.enter(State.RUNNING)

    async def _criu_restore(
        self,
        source: Path,
        manifest: Manifest,
        criu: Criu,
        lazy: bool,
        pages_from: str | None,
    ) -> int:
        """``criu restore`` (lazily: ``self._lazy`` is then the transfer) and the CUDA
        restore; returns the kernel's pid. Nothing it restored stays behind on failure."""
        # A multiprocessing manager's socket lives in a /tmp/pymp-* another node lacks.
        made_dirs = netports.make_missing_dirs(manifest.unix_socket_dirs)
        try:
            shm = await asyncio.to_thread(shmfiles.recreate, manifest.shm_files, source)
        except BaseException:
            _remove_dirs(made_dirs)
            raise
        work_dir = Path(tempfile.mkdtemp(prefix="restore-", dir=self.runtime.path))
        before = set(proctree.children(os.getpid()))
        images = source / IMAGES_DIR
        if shm.private:
            log.warning(
                "restoring with private copies of /dev/shm files whose names another "
                "process holds here (another copy of this snapshot?): %s",
                ", ".join(shm.private),
            )
        inherit_fds = [
            (self.process.stdio_w, manifest.stdio_pipe),
            (self.runtime.fd, manifest.runtime_dir_key),
            *shm.inherit,
        ]
        try:
            pages = page_source(pages_from) if pages_from else DirectoryPages(images)
            # Pages files already there are kept by the source (the server downloads
            # them as the kernel runs); else this wrapper makes and completes them.
            kept_here = pages_from is not None and not any(images.glob("pages-*.img"))
            if pages_from is not None and (kept_here or not lazy):
                # What criu restore reads from the files itself (not lazy: every page).
                await self._stage(images, pages, lazy)
            if lazy:
                self.lazy_status = {"state": "transferring"}
                pid, self._lazy = await criu.restore_lazy(
                    images,
                    work_dir,
                    pages,
                    write_through=kept_here,
                    kill_tree=lambda daemon: Supervisor.kill_children_except(before | {daemon}),
                    inherit_fds=inherit_fds,
                    keep_tcp=manifest.tcp_kept,
                    mounts=manifest.mounts,
                )
            else:
                pid = await criu.restore(
                    images,
                    work_dir,
                    inherit_fds=inherit_fds,
                    keep_tcp=manifest.tcp_kept,
                    mounts=manifest.mounts,
                )
        except BaseException as exc:
            shm.undo()
            _remove_dirs(made_dirs)
            # CRIU restores the tree as our child: one it gave up on (or that died with
            # it) must not stay behind, half-restored.
            Supervisor.kill_children_except(before)
            if lazy:
                self.lazy_status = {"state": "failed"}
                if isinstance(exc, SnapshotError):
                    self.lazy_status["error"] = exc.to_dict()
            raise
        finally:
            shm.close_fds()
            if self._lazy is None:
                shutil.rmtree(work_dir, ignore_errors=True)
        self.closed_on_restore = manifest.closed_connections
        try:
            self.last_gpu_restore = await self._gpu_restore(manifest, pid)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            if self._lazy is not None:
                self._lazy.close()
                self._lazy = None
                shutil.rmtree(work_dir, ignore_errors=True)
            raise
        return pid

    @staticmethod
    async def _stage(images: Path, pages: Any, lazy: bool) -> None:
        """Write into the images' pages files what ``criu restore`` reads from them itself."""
        try:
            await asyncio.to_thread(stage_pages_files, images, pages, lazy_too=not lazy)
        except OSError as exc:
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            raise RestoreError(
                f"The kernel's memory could not be staged in {images}: {exc.strerror or exc}.",
                hint="Free space on that disk (or set work_dir to one with room for the "
                "kernel's memory), then restore again."
                if full
                else "Make sure the store is reachable, then restore again.",
            ) from exc

    async def _gpu_restore(self, manifest: Manifest, root: int) -> dict[str, Any]:
        """After CRIU restored the tree: CUDA restore and unlock of its CUDA processes.
        Returns the step timings (empty without CUDA processes)."""
        ns_pids = manifest.gpu.get("ns_pids") or []
        if not ns_pids:
            return {}
        by_ns = proctree.host_pids_by_ns_pid(root)
        missing = [p for p in ns_pids if p not in by_ns]
        if missing:
            raise IncompatibleSnapshotError(
                f"The restored kernel lacks the CUDA processes {missing} the snapshot recorded."
            )
        pairs = plan_gpu_pairs(manifest.gpu) if manifest.gpu.get("available") else None
        done = await asyncio.to_thread(self._gpu().restore, [by_ns[p] for p in ns_pids], pairs)
        return done.to_dict()


def _from_server(pages_from: str | None) -> bool:
    """Whether a restore's memory comes from a server lending the store (``unix:PATH``),
    not from images on this machine."""
    return pages_from is not None and pages_from.startswith(UNIX_PREFIX)


def _remove_dirs(made: list[Path]) -> None:
    """Remove directories a failed restore made (innermost first), if still empty."""
    for path in reversed(made):
        with contextlib.suppress(OSError):
            path.rmdir()


def _socket_inodes(pids: list[int]) -> set[int]:
    inodes: set[int] = set()
    for pid in pids:
        inodes |= sockdiag.socket_inodes(pid)
    return inodes
