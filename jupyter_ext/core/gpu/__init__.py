"""GPU memory in snapshots: NVIDIA's CUDA checkpoint API, driven from another process.

A kernel's GPU memory is saved by the NVIDIA driver itself: the controller (the kernel
wrapper, never the kernel) asks the driver to *lock* the kernel's CUDA calls, then to
*checkpoint* it, which copies device memory into the kernel's own host memory and releases
the GPU. CRIU then dumps the process like any other. Afterwards the controller either
*restores* (host memory back onto the GPU) and *unlocks* it, so the kernel keeps running,
or lets it exit. A restored image starts out CHECKPOINTED; restore + unlock bring its GPU
back::

    snapshot:  lock -> checkpoint -> [CRIU dump] -> (leave running: restore -> unlock)
    restore:   [CRIU restore] -> restore -> unlock

Every failure rolls back so the kernel keeps running on its GPU.

The modules, each usable alone (plain Python, ctypes and optional pynvml; no Jupyter):

- :mod:`.errors`: CUresult codes, :class:`ProcessState`, :class:`GpuCheckpointError` and
  the hints it carries;
- :mod:`.driver`: :class:`CudaDriver`, libcuda's ``cuCheckpointProcess*`` (driver >= 570);
- :mod:`.tool`: :class:`CudaCheckpointTool`, NVIDIA's ``cuda-checkpoint`` utility;
- :mod:`.backend`: :class:`CheckpointBackend`, the interface both offer, and
  :func:`open_backend`, which picks one;
- :mod:`.processes`: :func:`find_cuda_processes`, which processes use CUDA;
- :mod:`.nvml`: :func:`gpu_inventory` and per-process GPU memory for the manifest;
- :mod:`.compat`: :func:`check_restore_compatible` refuses restores that cannot work here,
  :func:`plan_gpu_pairs` maps recorded GPUs onto GPUs here;
- :mod:`.checkpointer`: :class:`GpuCheckpointer`, the four operations with rollback.

Why ctypes and not NVIDIA's ``cuda.bindings``: the driver part is six functions and four
64-byte structs, while the maintained binding is an 8.4 MB wheel (31 MB installed, plus
``cuda-pathfinder``) published per CUDA major release (12.x and 13.x), so one release of
this product could not serve both driver 570 (CUDA 12.8, the oldest with the API) and 580
(CUDA 13, GPU remapping). It also loads the system's ``libcuda.so.1`` by itself, which
would take away ``$JUPYTER_SNAPSHOT_LIBCUDA`` and the stand-in libcuda that tests every
error path on machines without a GPU (``tests/support/fakecuda``). The struct layouts are pinned
by size assertions in :mod:`.driver`; the ``gpu``-marked tests in ``tests/test_gpu.py``
run lock, checkpoint, restore and unlock against the real driver.
"""

from ..protocol.environment import ENV_CUDA_CHECKPOINT, ENV_LIBCUDA
from .backend import CheckpointBackend, open_backend
from .checkpointer import GpuCheckpoint, GpuCheckpointer, StepTimings
from .compat import check_restore_compatible, plan_gpu_pairs
from .driver import CudaDriver, uuid_bytes
from .errors import (
    GpuCheckpointError,
    GpuUnavailableError,
    ProcessState,
    cuda_version_text,
)
from .nvml import (
    gpu_inventory,
    gpu_record,
    process_gpu_memory,
    process_gpu_usage,
    process_gpu_utilization,
)
from .processes import find_cuda_processes, kernel_gpu_status
from .tool import CudaCheckpointTool

__all__ = [
    "ENV_CUDA_CHECKPOINT",
    "ENV_LIBCUDA",
    "CheckpointBackend",
    "CudaCheckpointTool",
    "CudaDriver",
    "GpuCheckpoint",
    "GpuCheckpointError",
    "GpuCheckpointer",
    "GpuUnavailableError",
    "ProcessState",
    "StepTimings",
    "check_restore_compatible",
    "cuda_version_text",
    "find_cuda_processes",
    "gpu_inventory",
    "gpu_record",
    "kernel_gpu_status",
    "open_backend",
    "plan_gpu_pairs",
    "process_gpu_memory",
    "process_gpu_usage",
    "process_gpu_utilization",
    "uuid_bytes",
]
