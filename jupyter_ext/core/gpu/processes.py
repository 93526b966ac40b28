"""Which processes use CUDA, and the GPU accounting of one kernel's processes."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from .nvml import nvml_process_usage, process_gpu_utilization


def _maps_libcuda(pid: int) -> bool | None:
    """Does /proc/PID/maps map a libcuda.so*? None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                parts = line.split(None, 5)
                if len(parts) < 6:
                    continue
                path = parts[5].strip()
                path = path.removesuffix(" (deleted)")
                if os.path.basename(path).startswith("libcuda.so"):
                    return True
    except OSError:
        return None
    return False


def find_cuda_processes(
    pids: Iterable[int], *, use_nvml: bool = True, nvml: Any | None = None
) -> list[int]:
    """Which of ``pids`` use CUDA, in the order given: a libcuda mapped in /proc/PID/maps,
    or, where NVML answers, a compute context on a GPU (which also covers maps that cannot
    be read). NVML sees host PIDs; ``use_nvml=False`` skips it (nvmlInit can be slow
    without persistence mode)."""
    wanted = list(dict.fromkeys(pids))
    found = {pid for pid in wanted if _maps_libcuda(pid)}
    usage = nvml_process_usage(set(wanted), nvml) if use_nvml else None
    if usage is not None:
        found.update(pid for pid, per_gpu in usage.items() if per_gpu)
    return [pid for pid in wanted if pid in found]


def kernel_gpu_status(pids: Iterable[int], *, nvml: Any | None = None) -> dict[str, Any]:
    """GPU accounting for one kernel's processes: how many use CUDA, the GPU memory they
    hold and their utilization (both None where NVML cannot tell, e.g. without a driver)."""
    cuda_pids = find_cuda_processes(list(pids), nvml=nvml)
    if not cuda_pids:
        return {"processes": 0, "bytes": 0, "utilization": 0}
    usage = nvml_process_usage(set(cuda_pids), nvml)
    if usage is None:
        return {"processes": len(cuda_pids), "bytes": None, "utilization": None}
    utilization = process_gpu_utilization(cuda_pids, nvml=nvml)
    return {
        "processes": len(cuda_pids),
        "bytes": sum(sum(per_gpu.values()) for per_gpu in usage.values()),
        "utilization": max(utilization.values(), default=0),
    }
