"""The one interface both backends offer, and the choice between them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from .driver import CudaDriver
from .errors import GpuUnavailableError, ProcessState
from .tool import CudaCheckpointTool


class CheckpointBackend(Protocol):
    """What :class:`GpuCheckpointer` needs from the driver, whichever way it is reached."""

    name: str
    toggle_only: bool
    """True when lock+checkpoint and restore+unlock can only happen as one step each."""

    def describe(self) -> str: ...

    def get_state(self, pid: int) -> ProcessState: ...

    def restore_thread_id(self, pid: int) -> int: ...

    def lock(self, pid: int, timeout_ms: int = 0) -> None: ...

    def checkpoint(self, pid: int) -> None: ...

    def restore(self, pid: int, gpu_pairs: Mapping[str, str] | None = None) -> None: ...

    def unlock(self, pid: int) -> None: ...


def open_backend(libcuda: str | None = None, tool: str | None = None) -> CheckpointBackend:
    """libcuda's checkpoint API where the driver has it, else the cuda-checkpoint utility."""
    try:
        return CudaDriver(libcuda)
    except GpuUnavailableError as driver_error:
        try:
            return CudaCheckpointTool(tool)
        except GpuUnavailableError as tool_error:
            raise GpuUnavailableError(
                f"No CUDA checkpoint support on this machine. {driver_error.message} "
                f"{tool_error.message}",
                hint=driver_error.hint,
            ) from tool_error
