"""What NVML tells about the GPUs and the processes on them (pynvml, optional).

Every query degrades to "no answer" without a driver, so callers never need a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any


class _NvmlUnavailable(Exception):
    pass


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


@contextlib.contextmanager
def _nvml_session(nvml: Any | None) -> Iterator[Any]:
    if nvml is None:
        try:
            import pynvml as nvml_module
        except ImportError as exc:
            raise _NvmlUnavailable(
                f"the pynvml module (nvidia-ml-py) is not installed: {exc}"
            ) from exc
        nvml = nvml_module
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError has many subclasses
        raise _NvmlUnavailable(
            f"NVML cannot be initialised ({exc}); is an NVIDIA driver installed?"
        ) from exc
    try:
        yield nvml
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _optional(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - an NVML query a GPU does not support
        return None


def gpu_inventory(*, nvml: Any | None = None) -> dict[str, Any]:
    """The GPUs here, for the manifest and for compatibility checks.

    ``{"available": True, "driver_version": "580.95.05", "cuda_driver_version": 13000,
    "gpus": [{"index", "name", "uuid", "memory_total", "memory_used", "memory_free",
    "persistence_mode", "mig_enabled", "compute_capability"}]}``, or
    ``{"available": False, "reason": ...}`` where NVML does not answer.
    """
    try:
        with _nvml_session(nvml) as lib:
            gpus = []
            for index in range(int(lib.nvmlDeviceGetCount())):
                handle = lib.nvmlDeviceGetHandleByIndex(index)
                memory = lib.nvmlDeviceGetMemoryInfo(handle)
                mig = _optional(partial(lib.nvmlDeviceGetMigMode, handle))
                capability = _optional(partial(lib.nvmlDeviceGetCudaComputeCapability, handle))
                persistence = _optional(partial(lib.nvmlDeviceGetPersistenceMode, handle))
                gpus.append(
                    {
                        "index": index,
                        "name": _text(lib.nvmlDeviceGetName(handle)),
                        "uuid": _text(lib.nvmlDeviceGetUUID(handle)),
                        "memory_total": int(memory.total),
                        "memory_used": int(memory.used),
                        "memory_free": int(memory.free),
                        "persistence_mode": None if persistence is None else bool(persistence),
                        "mig_enabled": None if mig is None else bool(mig[0]),
                        "compute_capability": (
                            None if capability is None else f"{capability[0]}.{capability[1]}"
                        ),
                    }
                )
            cuda = _optional(lib.nvmlSystemGetCudaDriverVersion)
            return {
                "available": True,
                "driver_version": _text(lib.nvmlSystemGetDriverVersion()),
                "cuda_driver_version": None if cuda is None else int(cuda),
                "gpus": gpus,
            }
    except _NvmlUnavailable as exc:
        return {"available": False, "reason": str(exc), "gpus": []}
    except Exception as exc:  # noqa: BLE001 - any NVML failure means "no inventory"
        return {"available": False, "reason": f"NVML query failed: {exc}", "gpus": []}


_NVML_VALUE_NOT_AVAILABLE = (1 << 64) - 1


def nvml_process_usage(pids: set[int], nvml: Any | None) -> dict[int, dict[str, int]] | None:
    try:
        with _nvml_session(nvml) as lib:
            usage: dict[int, dict[str, int]] = {pid: {} for pid in pids}
            for index in range(int(lib.nvmlDeviceGetCount())):
                handle = lib.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(lib.nvmlDeviceGetUUID(handle))
                for proc in lib.nvmlDeviceGetComputeRunningProcesses(handle):
                    pid = int(proc.pid)
                    if pid not in usage:
                        continue
                    used = proc.usedGpuMemory
                    value = 0 if used in (None, _NVML_VALUE_NOT_AVAILABLE) else int(used)
                    usage[pid][uuid] = usage[pid].get(uuid, 0) + value
            return usage
    except _NvmlUnavailable:
        return None
    except Exception:  # noqa: BLE001 - a failed NVML query: no answer
        return None


def process_gpu_utilization(pids: Iterable[int], *, nvml: Any | None = None) -> dict[int, int]:
    """Recent SM utilization (percent) of each process that NVML has samples for."""
    wanted = set(pids)
    result: dict[int, int] = {}
    try:
        with _nvml_session(nvml) as lib:
            for index in range(int(lib.nvmlDeviceGetCount())):
                handle = lib.nvmlDeviceGetHandleByIndex(index)
                with contextlib.suppress(Exception):  # no samples yet: NVMLError_NotFound
                    for sample in lib.nvmlDeviceGetProcessUtilization(handle, 0):
                        if int(sample.pid) in wanted:
                            pid = int(sample.pid)
                            result[pid] = max(result.get(pid, 0), int(sample.smUtil))
    except _NvmlUnavailable:
        return {}
    return result


def process_gpu_usage(pids: Iterable[int], *, nvml: Any | None = None) -> dict[int, dict[str, int]]:
    """GPU memory each process holds, per GPU UUID; empty when NVML does not answer."""
    return nvml_process_usage(set(pids), nvml) or {}


def process_gpu_memory(pids: Iterable[int], *, nvml: Any | None = None) -> dict[int, int]:
    """Bytes of GPU memory each process holds (all GPUs); empty when NVML does not answer.

    Read it before the CUDA checkpoint: a checkpointed process holds no GPU memory.
    """
    usage = process_gpu_usage(pids, nvml=nvml)
    return {pid: sum(per_gpu.values()) for pid, per_gpu in usage.items()}


def gpu_record(pids: Iterable[int], *, nvml: Any | None = None) -> dict[str, Any]:
    """What a manifest keeps about the GPUs: :func:`gpu_inventory`, plus the UUIDs the
    processes use (``used_gpus``), their memory per pid (``process_memory``, string keys)
    and its sum (``needed_bytes``). Take it before the CUDA checkpoint."""
    record = gpu_inventory(nvml=nvml)
    usage = process_gpu_usage(pids, nvml=nvml) if record.get("available") else {}
    used = sorted({uuid for per_gpu in usage.values() for uuid in per_gpu})
    memory = {str(pid): sum(per_gpu.values()) for pid, per_gpu in usage.items()}
    record["used_gpus"] = used
    record["process_memory"] = memory
    record["needed_bytes"] = sum(memory.values())
    return record
