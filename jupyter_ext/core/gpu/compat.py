"""Can a snapshot's GPU memory be restored here, and onto which GPUs.

Works on the :func:`~.nvml.gpu_inventory` mappings a manifest stores.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..errors import IncompatibleSnapshotError
from .errors import MIN_CUDA_DRIVER_VERSION, cuda_version_text
from .nvml import gpu_inventory


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text))


def _gib(value: int) -> str:
    return f"{value / 2**30:.1f} GiB"


def _used_gpus(recorded: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The recorded GPUs the kernel used: those named in ``used_gpus``, else the first one."""
    gpus: list[dict[str, Any]] = list(recorded.get("gpus") or [])
    used = set(recorded.get("used_gpus") or [])
    chosen = [gpu for gpu in gpus if gpu.get("uuid") in used]
    return chosen or gpus[:1]


def check_restore_compatible(
    recorded: Mapping[str, Any],
    needed_bytes: int,
    *,
    current: Mapping[str, Any] | None = None,
) -> None:
    """Refuse, with the reason, a GPU restore that cannot work on this machine.

    ``recorded`` is the :func:`gpu_inventory` stored with the snapshot, optionally with
    ``"used_gpus"`` (the UUIDs the kernel used); ``needed_bytes`` the GPU memory the kernel
    held. ``current`` defaults to this machine's inventory. Raises IncompatibleSnapshotError
    when there is no GPU, no GPU of the recorded model, an older driver, or too little free
    GPU memory.
    """
    if current is None:
        current = gpu_inventory()
    used = _used_gpus(recorded)
    models = sorted({str(gpu.get("name")) for gpu in used if gpu.get("name")})
    model_text = " and ".join(models) if models else "NVIDIA"
    here: list[dict[str, Any]] = list(current.get("gpus") or [])
    if not current.get("available") or not here:
        reason = current.get("reason") or "NVML lists no GPU"
        raise IncompatibleSnapshotError(
            f"The snapshot holds {_gib(needed_bytes)} of GPU memory, but this machine has no "
            f"usable NVIDIA GPU ({reason}).",
            hint=f"Restore it on a machine with a {model_text} GPU.",
        )
    for gpu in here:
        if gpu.get("mig_enabled"):
            raise IncompatibleSnapshotError(
                f"GPU {gpu.get('index')} ({gpu.get('name')}) is in MIG mode, which CUDA "
                "checkpoints do not support.",
                hint="Disable MIG ('nvidia-smi -mig 0') or restore on another machine.",
            )
    candidates = here
    if models:
        for model in models:
            wanted = sum(1 for gpu in used if gpu.get("name") == model)
            matching = [gpu for gpu in here if gpu.get("name") == model]
            if len(matching) < wanted:
                names = ", ".join(sorted({str(gpu.get("name")) for gpu in here}))
                raise IncompatibleSnapshotError(
                    f"The snapshot was taken on {wanted} x {model}; this machine has "
                    f"{len(matching)} of them (its GPUs: {names}). CUDA restores only onto "
                    "the same GPU model.",
                    hint=f"Restore it on a machine with {wanted} x {model}.",
                )
        candidates = [gpu for gpu in here if gpu.get("name") in models]
    recorded_driver = str(recorded.get("driver_version") or "")
    current_driver = str(current.get("driver_version") or "")
    if (
        recorded_driver
        and current_driver
        and _version_tuple(current_driver) < _version_tuple(recorded_driver)
    ):
        raise IncompatibleSnapshotError(
            f"The snapshot was taken with NVIDIA driver {recorded_driver}; this machine "
            f"has the older {current_driver}.",
            hint=f"Update the NVIDIA driver here to {recorded_driver} or newer.",
        )
    recorded_cuda = recorded.get("cuda_driver_version")
    current_cuda = current.get("cuda_driver_version")
    if (
        isinstance(recorded_cuda, int)
        and isinstance(current_cuda, int)
        and current_cuda < recorded_cuda
    ):
        raise IncompatibleSnapshotError(
            f"The snapshot was taken with a driver for CUDA "
            f"{cuda_version_text(recorded_cuda)}; this machine's supports only "
            f"{cuda_version_text(current_cuda)}.",
            hint="Update the NVIDIA driver here.",
        )
    if isinstance(current_cuda, int) and current_cuda < MIN_CUDA_DRIVER_VERSION:
        raise IncompatibleSnapshotError(
            f"This machine's NVIDIA driver (CUDA {cuda_version_text(current_cuda)}) has no "
            "CUDA checkpoint API.",
            hint="Update the NVIDIA driver to 570 or newer.",
        )
    frees = sorted((int(gpu.get("memory_free") or 0) for gpu in candidates), reverse=True)
    count = max(1, len(used))
    available = sum(frees[:count])
    if needed_bytes > available:
        where = "the best GPU" if count == 1 else f"the best {count} GPUs"
        raise IncompatibleSnapshotError(
            f"The snapshot needs {_gib(needed_bytes)} of GPU memory; {where} of model "
            f"{model_text} here have only {_gib(available)} free.",
            hint="Stop other GPU processes (see 'nvidia-smi') and restore again.",
        )


def plan_gpu_pairs(
    recorded: Mapping[str, Any], current: Mapping[str, Any] | None = None
) -> dict[str, str]:
    """Recorded GPU UUID -> GPU UUID here, for a restore onto other GPUs (driver 580+).

    Empty when every GPU the snapshot used is present here (no remapping needed).
    Otherwise it maps every used GPU (the driver wants all of them), each onto a GPU of the
    same model, preferring the same UUID, then the most free memory.
    """
    if current is None:
        current = gpu_inventory()
    used = _used_gpus(recorded)
    here: list[dict[str, Any]] = list(current.get("gpus") or [])
    here_uuids = {gpu.get("uuid") for gpu in here}
    if all(gpu.get("uuid") in here_uuids for gpu in used):
        return {}
    pairs: dict[str, str] = {}
    taken: set[str] = set()
    for gpu in used:
        if gpu.get("uuid") in here_uuids:
            pairs[str(gpu["uuid"])] = str(gpu["uuid"])
            taken.add(str(gpu["uuid"]))
    for gpu in used:
        old = str(gpu.get("uuid"))
        if old in pairs:
            continue
        options = [
            other
            for other in here
            if other.get("name") == gpu.get("name") and str(other.get("uuid")) not in taken
        ]
        if not options:
            raise IncompatibleSnapshotError(
                f"No free {gpu.get('name')} GPU here to restore GPU {old} onto.",
                hint=f"Restore it on a machine with enough {gpu.get('name')} GPUs.",
            )
        best = max(options, key=lambda other: int(other.get("memory_free") or 0))
        pairs[old] = str(best["uuid"])
        taken.add(str(best["uuid"]))
    return pairs
