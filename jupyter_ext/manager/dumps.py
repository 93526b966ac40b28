"""Snapshots of running kernels, and suspend / resume."""

from __future__ import annotations

import asyncio
import os
import shutil
from typing import Any

from ..core import private
from ..core.manifest import new_snapshot_id
from ..core.protocol import SnapshotArgs, SuspendArgs
from .base import Job
from .stored import StoredSnapshots


class Dumps(StoredSnapshots):
    """Snapshot a kernel, or suspend it (snapshot and end its process) and resume it."""

    def create(self, kernel_id: str, trigger: str = "manual") -> Job:
        """Snapshot a running kernel; the kernel is frozen only while CRIU dumps."""
        self.kernel(kernel_id)
        self._busy(kernel_id)
        return self._start_job(
            "snapshot", kernel_id, lambda job: self._snapshot(job, kernel_id, trigger)
        )

    async def _snapshot(
        self, job: Job, kernel_id: str, trigger: str, leave_running: bool = True
    ) -> dict[str, Any]:
        km = self.kernel(kernel_id)
        path = await self.notebook_path(kernel_id)
        dest = self.staging_dir / new_snapshot_id()
        self.emit("started", {"kernel_id": kernel_id, "trigger": trigger, "job_id": job.id})

        args = SnapshotArgs(
            str(dest),
            trigger=trigger,
            leave_running=leave_running,
            **self._dump_settings(km, kernel_id, path),
        )
        # A killed wrapper leaves its partial dump (the kernel's size): removed then.
        dumped = await self._guarded_dump(
            kernel_id, dest, lambda wrapper: wrapper.snapshot(args, self._wrapper_progress(job))
        )
        manifest = dumped.manifest
        stored = await self._upload(job, manifest, dest)
        result = stored if stored is not None else await self.get(manifest.id)
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

    def _dump_settings(self, km: Any, kernel_id: str, path: str | None) -> dict[str, Any]:
        """What a snapshot and a suspend request both carry: the manifest fields this
        server knows and its dump settings."""
        return {
            "metadata": {
                "kernel_spec": {"name": km.kernel_name, "kernel_id": kernel_id},
                "notebook_path": path,
            },
            "release_gpu_caches": self.release_gpu_caches,
            "chunk_kib": self.chunk_kib,
            "write_back": self.store.adopts_images,
        }

    def suspend(self, kernel_id: str, trigger: str = "idle-suspend") -> Job:
        """Snapshot the kernel and end its process (its GPU memory is freed)."""
        self.kernel(kernel_id)
        self._busy(kernel_id)
        return self._start_job(
            "suspend", kernel_id, lambda job: self._suspend(job, kernel_id, trigger)
        )

    async def _suspend(self, job: Job, kernel_id: str, trigger: str) -> dict[str, Any]:
        km = self.kernel(kernel_id)
        path = await self.notebook_path(kernel_id)
        suspended_dir = self.work_dir / "suspended"
        private.make_dirs(suspended_dir)
        dest = suspended_dir / new_snapshot_id()
        self._progress(job, "dumping")
        args = SuspendArgs(str(dest), trigger=trigger, **self._dump_settings(km, kernel_id, path))
        # Sealed before the wrapper died: the kernel's only copy, kept and stored.
        dumped = await self._guarded_dump(
            kernel_id, dest, lambda wrapper: wrapper.suspend(args, self._wrapper_progress(job))
        )
        manifest = dumped.manifest
        wrapper_gone = dumped.sealed is not None
        self.emit("suspended", {"kernel_id": kernel_id, "snapshot_id": manifest.id})
        # The wrapper resumes from `dest` and then deletes it; the store gets its own copy
        # (hard links: no extra space, independent lifetimes). No wrapper: it is moved.
        upload_dir = self.staging_dir / manifest.id
        if wrapper_gone:
            await asyncio.to_thread(dest.rename, upload_dir)
        else:
            await asyncio.to_thread(shutil.copytree, dest, upload_dir, copy_function=os.link)
        stored = await self._upload(job, manifest, upload_dir)
        return stored if stored is not None else await self.get(manifest.id)

    def resume(self, kernel_id: str) -> Job:
        self.kernel(kernel_id)
        self._busy(kernel_id)

        async def work(job: Job) -> dict[str, Any]:
            self._progress(job, "restoring")
            result = await self.wrapper(kernel_id).resume(self._wrapper_progress(job))
            self.emit("resumed", {"kernel_id": kernel_id, "snapshot_id": result["id"]})
            return dict(result)

        return self._start_job("resume", kernel_id, work)
