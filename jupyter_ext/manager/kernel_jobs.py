"""KernelJobs: a running kernel snapshotted, suspended (snapshot, process ended) and resumed."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from ..core import private
from ..core.imagecache import CacheLease, ImageCache
from ..core.manifest import new_snapshot_id
from ..core.protocol.control import SnapshotArgs, SuspendArgs
from ..core.store import SnapshotStore
from .jobs import Job, Jobs
from .kernels import KernelHandle, Kernels
from .sessions import Sessions
from .shared import EmitEvent, ManagerSettings, Workspace
from .stored import StoredSnapshots
from .uploads import Uploads


class KernelJobs:
    """The jobs on a running kernel, through its wrapper: snapshot it, suspend it (snapshot
    and end its process) and resume it."""

    def __init__(
        self,
        *,
        settings: ManagerSettings,
        workspace: Workspace,
        store: SnapshotStore,
        jobs: Jobs,
        kernels: Kernels,
        sessions: Sessions,
        snapshots: StoredSnapshots,
        uploads: Uploads,
        emit: EmitEvent,
        image_cache: ImageCache,
    ) -> None:
        self.settings = settings
        self.image_cache = image_cache
        self.workspace = workspace
        self.store = store
        self.jobs = jobs
        self.kernels = kernels
        self.sessions = sessions
        self.snapshots = snapshots
        self.uploads = uploads
        self.emit = emit

    def snapshot(self, kernel_id: str, trigger: str = "manual") -> Job:
        """Snapshot a running kernel; the kernel is frozen only while CRIU dumps."""
        self._check(kernel_id)
        return self.jobs.start(
            "snapshot", kernel_id, lambda job: self._snapshot(job, kernel_id, trigger)
        )

    async def _snapshot(
        self, job: Job, kernel_id: str, trigger: str, leave_running: bool = True
    ) -> dict[str, Any]:
        kernel = self.kernels.handle(kernel_id)
        path = await self.sessions.notebook_path(kernel_id)
        dest = self.workspace.staging_dir / new_snapshot_id()
        self.emit("started", {"kernel_id": kernel_id, "trigger": trigger, "job_id": job.id})

        with self._parent(kernel_id) as parent:
            args = SnapshotArgs(
                str(dest),
                trigger=trigger,
                leave_running=leave_running,
                **self._dump_settings(kernel, path, parent),
            )
            # A killed wrapper leaves its partial dump (the kernel's size): removed then.
            dumped = await self.kernels.request_dumping_into(
                kernel,
                dest,
                lambda wrapper: wrapper.snapshot(args, self.jobs.wrapper_progress(job)),
            )
        manifest = dumped.manifest
        stored = await self.uploads.upload(job, manifest, dest)
        result = stored if stored is not None else await self.snapshots.get(manifest.id)
        self.emit(
            "created",
            {
                "kernel_id": kernel_id,
                "snapshot_id": manifest.id,
                "trigger": trigger,
                "bytes": manifest.total_bytes,
                "status": result["status"],
            },
        )
        return result

    def _dump_settings(
        self, kernel: KernelHandle, path: str | None, parent: CacheLease | None
    ) -> dict[str, Any]:
        """What a snapshot and a suspend request both carry: the manifest fields this
        server knows, its dump settings, and the kernel's previous snapshot here."""
        return {
            "metadata": {
                "kernel_spec": {"name": kernel.name, "kernel_id": kernel.id},
                "notebook_path": path,
            },
            "release_gpu_caches": self.settings.release_gpu_caches,
            "chunk_kib": self.settings.chunk_kib,
            "write_back": self.store.adopts_images,
            "track_memory": self.settings.track_memory,
            "parent": str(parent.path) if parent is not None else None,
        }

    def _parent(self, kernel_id: str) -> contextlib.AbstractContextManager[CacheLease | None]:
        """The kernel's previous snapshot in the image cache, held for the dump."""
        if not self.settings.track_memory:
            return contextlib.nullcontext()
        return self.image_cache.hold_parent(kernel_id)

    def suspend(self, kernel_id: str, trigger: str = "idle-suspend") -> Job:
        """Snapshot the kernel and end its process (its GPU memory is freed)."""
        self._check(kernel_id)
        return self.jobs.start(
            "suspend", kernel_id, lambda job: self._suspend(job, kernel_id, trigger)
        )

    async def _suspend(self, job: Job, kernel_id: str, trigger: str) -> dict[str, Any]:
        kernel = self.kernels.handle(kernel_id)
        path = await self.sessions.notebook_path(kernel_id)
        private.make_dirs(self.workspace.suspended_dir)
        dest = self.workspace.suspended_dir / new_snapshot_id()
        with self._parent(kernel_id) as parent:
            args = SuspendArgs(
                str(dest), trigger=trigger, **self._dump_settings(kernel, path, parent)
            )
            # Sealed before the wrapper died: the kernel's only copy, kept and stored.
            dumped = await self.kernels.request_dumping_into(
                kernel,
                dest,
                lambda wrapper: wrapper.suspend(args, self.jobs.wrapper_progress(job)),
            )
        manifest = dumped.manifest
        wrapper_gone = dumped.sealed is not None
        self.emit("suspended", {"kernel_id": kernel_id, "snapshot_id": manifest.id})
        # The wrapper resumes from `dest` and then deletes it; the store gets its own copy
        # (hard links: no extra space, independent lifetimes). No wrapper: it is moved.
        upload_dir = self.workspace.staging_dir / manifest.id
        if wrapper_gone:
            await asyncio.to_thread(dest.rename, upload_dir)
        else:
            await asyncio.to_thread(private.link_tree, dest, upload_dir)
        stored = await self.uploads.upload(job, manifest, upload_dir)
        return stored if stored is not None else await self.snapshots.get(manifest.id)

    def resume(self, kernel_id: str) -> Job:
        self._check(kernel_id)

        async def work(job: Job) -> dict[str, Any]:
            result = await self.kernels.wrapper(kernel_id).resume(self.jobs.wrapper_progress(job))
            self.emit("resumed", {"kernel_id": kernel_id, "snapshot_id": result["id"]})
            return dict(result)

        return self.jobs.start("resume", kernel_id, work)

    def _check(self, kernel_id: str) -> None:
        """The kernel is this server's and no job runs on it (else the request fails)."""
        self.kernels.kernel(kernel_id)
        self.jobs.check_not_busy(kernel_id)
