"""CUDA result codes, process states, the GPU errors and the hints they carry.

Shared by both backends and the checkpointer: one table of CUresult names, one place
that says what to do about each failure.
"""

from __future__ import annotations

import enum

from ..errors import SnapshotError

DEFAULT_LIBCUDA = "libcuda.so.1"
DEFAULT_LOCK_TIMEOUT_MS = 10_000
MIN_CUDA_DRIVER_VERSION = 12080
"""CUDA 12.8, i.e. display driver 570: the first with ``cuCheckpointProcess*`` in libcuda."""
GPU_REMAP_CUDA_DRIVER_VERSION = 13000
"""CUDA 13.0, i.e. display driver 580: restore onto another GPU through UUID pairs."""

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_OPERATING_SYSTEM = 304
CUDA_ERROR_ILLEGAL_STATE = 401
CUDA_ERROR_NOT_FOUND = 500
CUDA_ERROR_NOT_PERMITTED = 800
CUDA_ERROR_NOT_SUPPORTED = 801
CUDA_ERROR_TIMEOUT = 909

CUDA_ERROR_NAMES: dict[int, str] = {
    0: "CUDA_SUCCESS",
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    4: "CUDA_ERROR_DEINITIALIZED",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    201: "CUDA_ERROR_INVALID_CONTEXT",
    304: "CUDA_ERROR_OPERATING_SYSTEM",
    401: "CUDA_ERROR_ILLEGAL_STATE",
    500: "CUDA_ERROR_NOT_FOUND",
    600: "CUDA_ERROR_NOT_READY",
    800: "CUDA_ERROR_NOT_PERMITTED",
    801: "CUDA_ERROR_NOT_SUPPORTED",
    909: "CUDA_ERROR_TIMEOUT",
    999: "CUDA_ERROR_UNKNOWN",
}


class ProcessState(enum.IntEnum):
    """``CUprocessState``: where a process is in the checkpoint cycle."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3
    CHECKPOINTING = 4
    RESTORING = 5

    @property
    def label(self) -> str:
        return self.name.lower()


class GpuCheckpointError(SnapshotError):
    """A CUDA checkpoint step failed; says for which process, in which state, and what to do."""

    code = "gpu-checkpoint-failed"

    def __init__(
        self,
        message: str,
        *,
        hint: str = "",
        log_excerpt: str = "",
        pid: int | None = None,
        step: str = "",
        cuda_error: int | None = None,
        cuda_error_name: str = "",
        cuda_error_string: str = "",
        state: ProcessState | None = None,
    ) -> None:
        super().__init__(message, hint=hint, log_excerpt=log_excerpt)
        self.pid = pid
        self.step = step
        self.cuda_error = cuda_error
        self.cuda_error_name = cuda_error_name
        self.cuda_error_string = cuda_error_string
        self.state = state


def step_failed(
    failure: str,
    *,
    step: str,
    pid: int,
    code: int | None,
    name: str,
    text: str,
    state: ProcessState | None,
) -> GpuCheckpointError:
    """The error of a CUDA ``step`` of ``pid`` that failed with ``code`` (``name``,
    ``text``), as either backend reports it: ``failure`` says what failed and how, the
    process's ``state`` (if known) and what to do are added."""
    where = f" It is {state.label}." if state is not None else ""
    return GpuCheckpointError(
        f"{failure}.{where}",
        hint=hint_for(step, code, pid, state),
        pid=pid,
        step=step,
        cuda_error=code,
        cuda_error_name=name,
        cuda_error_string=text,
        state=state,
    )


class GpuUnavailableError(GpuCheckpointError):
    """No usable CUDA checkpoint support: libcuda or cuda-checkpoint missing or too old."""

    code = "gpu-unavailable"


def cuda_version_text(version: int) -> str:
    """12080 -> '12.8'."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def hint_for(step: str, code: int | None, pid: int, state: ProcessState | None) -> str:
    """What to do after CUDA ``step`` of ``pid`` failed with ``code``: one text for both
    backends and the checkpointer's own state checks."""
    if code == CUDA_ERROR_TIMEOUT and step == "lock":
        return (
            "A CUDA call in the kernel did not finish in time (for example a long-running GPU "
            "kernel or a synchronisation). Wait for the running cell to finish, or raise the "
            "GPU lock timeout, and take the snapshot again."
        )
    if code == CUDA_ERROR_INVALID_VALUE:
        return (
            f"Check that process {pid} still exists, uses CUDA, and is visible to the "
            "controller in /proc (same PID namespace)."
        )
    if code == CUDA_ERROR_NOT_INITIALIZED:
        return (
            "Enable persistence mode ('nvidia-smi -pm 1') or make sure the controller can "
            "initialise CUDA (cuInit): a CUDA restore needs one of them."
        )
    if code == CUDA_ERROR_OUT_OF_MEMORY and step == "restore":
        return (
            "Free GPU memory (stop other GPU processes), then restore the snapshot again into "
            "a fresh kernel; the driver may refuse a second restore attempt on the same process."
        )
    if code == CUDA_ERROR_OUT_OF_MEMORY:
        return "Free host memory: the checkpoint copies all device memory into the kernel's RAM."
    if code in (CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_OPERATING_SYSTEM, CUDA_ERROR_NOT_FOUND):
        return (
            "The driver cannot checkpoint this process: CUDA checkpoints do not support "
            "unified memory (UVM / managed memory), CUDA IPC, MIG or NCCL. Snapshot kernels "
            "that do not use them, or update the NVIDIA driver."
        )
    if code == CUDA_ERROR_NOT_PERMITTED:
        return "Run the controller as root (or with CAP_SYS_PTRACE over the kernel)."
    if code == CUDA_ERROR_ILLEGAL_STATE:
        where = state.label if state is not None else "another state"
        return (
            f"Process {pid} is {where}, not where '{step}' can start. If it stays locked or "
            "checkpointed its CUDA calls hang: restart the kernel, or restore a snapshot."
        )
    return "See the NVIDIA driver's log (dmesg) and try again; restart the kernel if it hangs."
