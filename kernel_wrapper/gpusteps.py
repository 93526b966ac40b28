"""The CUDA steps of a snapshot and of a restore, through the driver's checkpoint API
(:mod:`jupyter_ext.core.gpu`).

For a snapshot: lock and checkpoint every CUDA process of the kernel before the CRIU dump
(device memory moves into host memory, so CRIU saves it, and the GPU is released), then
resume them if the kernel keeps running, or abort if the dump failed. For a restore:
after CRIU has restored the tree, the CUDA restore and unlock of the processes the
snapshot recorded. A kernel without CUDA processes makes every step a no-op; the
checkpointer is opened only when one is needed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from jupyter_ext.core import proctree
from jupyter_ext.core.errors import IncompatibleSnapshotError
from jupyter_ext.core.gpu import (
    GpuCheckpoint,
    GpuCheckpointer,
    find_cuda_processes,
    gpu_record,
    open_backend,
    plan_gpu_pairs,
)
from jupyter_ext.core.manifest import Manifest
from jupyter_ext.core.protocol.progress import ProgressCallback

from .agents import KernelAgent

log = logging.getLogger("kernel_wrapper")


class GpuSteps:
    """The CUDA steps for the kernel whose own code ``agent`` reaches (asked to release
    the GPU caches of its frameworks)."""

    def __init__(self, agent: KernelAgent) -> None:
        self.agent = agent
        self._checkpointer: GpuCheckpointer | None = None

    def _gpu(self) -> GpuCheckpointer:
        if self._checkpointer is None:
            self._checkpointer = GpuCheckpointer(open_backend())
        return self._checkpointer

    async def checkpoint(
        self,
        inner_pid: int,
        progress: ProgressCallback,
        release_caches: bool,
    ) -> tuple[dict[str, Any], GpuCheckpoint | None]:
        """Lock and checkpoint every CUDA process of the kernel: device memory moves into
        host memory (so CRIU saves it) and the GPU is released. First, if asked, the
        kernel releases what its frameworks cache but do not use (kernel_wrapper.inkernel.agent).
        Returns the manifest's GPU record and the checkpoint ({} and None without CUDA)."""
        pids = proctree.descendants(inner_pid)
        cuda_pids = await asyncio.to_thread(find_cuda_processes, pids)
        if not cuda_pids:
            return {}, None
        released = await self._release_caches(progress) if release_caches else {}
        progress({"phase": "gpu-checkpoint", "processes": len(cuda_pids)})
        record = await asyncio.to_thread(gpu_record, cuda_pids)
        if released:
            record["released_caches"] = released
        record["ns_pids"] = [proctree.ns_pid(pid) for pid in cuda_pids]
        record["total_bytes"] = record.get("needed_bytes", 0)
        checkpoint = await asyncio.to_thread(self._gpu().checkpoint, cuda_pids)
        return record, checkpoint

    async def _release_caches(self, progress: ProgressCallback) -> dict[str, Any]:
        """Ask the kernel's agent to release its frameworks' GPU caches; what it says."""
        progress({"phase": "releasing-gpu-caches"})
        released = await self.agent.release_gpu_caches()
        if released.get("error") or released.get("errors"):
            log.warning("releasing GPU caches: %s", released)
        return released

    async def resume(self, checkpoint: GpuCheckpoint) -> None:
        """After a dump that leaves the kernel running: its CUDA processes go on."""
        await asyncio.to_thread(self._gpu().resume, checkpoint)

    async def abort(self, checkpoint: GpuCheckpoint) -> None:
        """After a failed dump: the CUDA processes go on as before the checkpoint."""
        await asyncio.to_thread(self._gpu().abort, checkpoint)

    async def restore(self, manifest: Manifest, root: int) -> dict[str, Any]:
        """After CRIU restored the tree under ``root``: CUDA restore and unlock of its CUDA
        processes. Returns the step timings (empty without CUDA processes)."""
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
