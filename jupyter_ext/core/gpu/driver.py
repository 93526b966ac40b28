"""NVIDIA's libcuda checkpoint API (driver >= 570) through ctypes: :class:`CudaDriver`.

Hand-written ctypes rather than ``cuda.bindings``: see the package docstring.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import threading
from collections.abc import Mapping
from typing import Any

from ..protocol.environment import ENV_LIBCUDA
from .errors import (
    CUDA_ERROR_NAMES,
    CUDA_ERROR_NOT_INITIALIZED,
    CUDA_SUCCESS,
    DEFAULT_LIBCUDA,
    GPU_REMAP_CUDA_DRIVER_VERSION,
    GpuCheckpointError,
    GpuUnavailableError,
    ProcessState,
    cuda_version_text,
    step_failed,
)

_CHECKPOINT_SYMBOLS = (
    "cuCheckpointProcessGetRestoreThreadId",
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
)


class _LockArgs(ctypes.Structure):
    _fields_ = [
        ("timeoutMs", ctypes.c_uint),
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_uint64 * 7),
    ]


class _CheckpointArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class _UnlockArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class _GpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", ctypes.c_ubyte * 16), ("newUuid", ctypes.c_ubyte * 16)]


class _RestoreArgs(ctypes.Structure):
    # CUDA 13.0 / driver 580 (docs.nvidia.com, struct CUcheckpointRestoreArgs):
    #   CUcheckpointGpuPair *gpuPairs; unsigned int gpuPairsCount;
    #   char reserved[52 - sizeof(CUcheckpointGpuPair *)]; cuuint64_t reserved1;
    # i.e. 64 bytes: pointer at 0, count at 8, zeros after. Later headers carve new fields
    # out of the reserved bytes without moving these two.
    _fields_ = [
        ("gpuPairs", ctypes.POINTER(_GpuPair)),
        ("gpuPairsCount", ctypes.c_uint),
        ("reserved", ctypes.c_ubyte * 52),
    ]


for _struct in (_LockArgs, _CheckpointArgs, _UnlockArgs, _RestoreArgs):
    assert ctypes.sizeof(_struct) == 64, _struct
assert ctypes.sizeof(_GpuPair) == 32


def uuid_bytes(uuid: str) -> bytes:
    """The 16 bytes of a GPU UUID as NVML and nvidia-smi print it (``GPU-xxxxxxxx-...``)."""
    text = uuid.strip()
    for prefix in ("GPU-", "MIG-"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    digits = text.replace("-", "")
    if not re.fullmatch(r"[0-9a-fA-F]{32}", digits):
        raise ValueError(f"not a GPU UUID: {uuid!r}")
    return bytes.fromhex(digits)


def _cuda_error(
    step: str,
    pid: int,
    code: int,
    name: str,
    text: str,
    state: ProcessState | None = None,
) -> GpuCheckpointError:
    what = f"{name} ({text})" if text else name
    return step_failed(
        f"CUDA {step} of process {pid} failed: {what}",
        step=step,
        pid=pid,
        code=code,
        name=name,
        text=text,
        state=state,
    )


class CudaDriver:
    """NVIDIA's libcuda (driver >= 570) through ctypes.

    ``path`` is the library to load; ``$JUPYTER_SNAPSHOT_LIBCUDA`` overrides the default
    ``libcuda.so.1``. Like NVIDIA's ``cuda-checkpoint`` utility, the controller calls
    ``cuInit(0)`` for itself once, before its first checkpoint call: the driver documents that
    a restore needs persistence mode or cuInit in the caller. A failing cuInit is remembered
    and named in later errors rather than raised, since lock, checkpoint and state queries
    work without it (NVIDIA's own sample never initialises CUDA in the controller).
    """

    name = "libcuda"
    toggle_only = False

    def __init__(self, path: str | None = None) -> None:
        self.path = path or os.environ.get(ENV_LIBCUDA) or DEFAULT_LIBCUDA
        try:
            lib = ctypes.CDLL(self.path)
        except OSError as exc:
            raise GpuUnavailableError(
                f"The NVIDIA driver library {self.path} cannot be loaded: {exc}",
                hint=(
                    "Install the NVIDIA driver (>= 570), or point "
                    f"${ENV_LIBCUDA} at its libcuda.so.1."
                ),
            ) from exc
        missing = [symbol for symbol in _CHECKPOINT_SYMBOLS if not hasattr(lib, symbol)]
        if missing:
            raise GpuUnavailableError(
                f"{self.path} has no CUDA checkpoint API (missing {', '.join(missing)}): the "
                "NVIDIA driver is older than 570.",
                hint="Update the NVIDIA driver to 570 or newer (580 or newer to move GPUs).",
            )
        self._lib = lib
        self._init_lock = threading.Lock()
        self._init_result: int | None = None
        int_p = ctypes.POINTER(ctypes.c_int)
        self._bind("cuInit", [ctypes.c_uint])
        self._bind("cuDriverGetVersion", [int_p])
        self._bind("cuGetErrorName", [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)], True)
        self._bind("cuGetErrorString", [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)], True)
        self._bind("cuCheckpointProcessGetRestoreThreadId", [ctypes.c_int, int_p])
        self._bind("cuCheckpointProcessGetState", [ctypes.c_int, int_p])
        self._bind("cuCheckpointProcessLock", [ctypes.c_int, ctypes.POINTER(_LockArgs)])
        self._bind("cuCheckpointProcessCheckpoint", [ctypes.c_int, ctypes.POINTER(_CheckpointArgs)])
        self._bind("cuCheckpointProcessRestore", [ctypes.c_int, ctypes.POINTER(_RestoreArgs)])
        self._bind("cuCheckpointProcessUnlock", [ctypes.c_int, ctypes.POINTER(_UnlockArgs)])

    def _bind(self, symbol: str, argtypes: list[Any], optional: bool = False) -> None:
        try:
            fn = getattr(self._lib, symbol)
        except AttributeError:
            if optional:
                return
            raise GpuUnavailableError(
                f"{self.path} has no {symbol}; it is not a usable NVIDIA driver library.",
                hint=f"Point ${ENV_LIBCUDA} at the NVIDIA driver's libcuda.so.1.",
            ) from None
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int

    def _call(self, symbol: str, *args: Any) -> int:
        return int(getattr(self._lib, symbol)(*args))

    # -- plumbing

    def error_name(self, code: int) -> str:
        """``cuGetErrorName``, or this module's table when the driver does not know it."""
        out = ctypes.c_char_p()
        known = hasattr(self._lib, "cuGetErrorName")
        if known and self._call("cuGetErrorName", code, ctypes.byref(out)) == 0 and out.value:
            return out.value.decode(errors="replace")
        return CUDA_ERROR_NAMES.get(code, f"CUDA error {code}")

    def error_string(self, code: int) -> str:
        out = ctypes.c_char_p()
        known = hasattr(self._lib, "cuGetErrorString")
        if known and self._call("cuGetErrorString", code, ctypes.byref(out)) == 0 and out.value:
            return out.value.decode(errors="replace")
        return ""

    def init(self) -> int:
        """Call ``cuInit(0)`` once for the controller; returns its CUresult (0 = success)."""
        with self._init_lock:
            if self._init_result is None:
                self._init_result = self._call("cuInit", 0)
            return self._init_result

    def driver_version(self) -> int:
        """``cuDriverGetVersion``: the CUDA version the driver supports, e.g. 12080 for 12.8."""
        version = ctypes.c_int()
        code = self._call("cuDriverGetVersion", ctypes.byref(version))
        if code != CUDA_SUCCESS:
            raise GpuCheckpointError(
                f"The NVIDIA driver does not report its version: {self.error_name(code)}.",
                hint="Check the NVIDIA driver installation ('nvidia-smi').",
                step="driver-version",
                cuda_error=code,
                cuda_error_name=self.error_name(code),
            )
        return int(version.value)

    def describe(self) -> str:
        try:
            version = f"CUDA {cuda_version_text(self.driver_version())}"
        except GpuCheckpointError:
            version = "version unknown"
        return f"libcuda {self.path} ({version})"

    def _check(self, step: str, pid: int, code: int) -> None:
        if code == CUDA_SUCCESS:
            return
        state: ProcessState | None = None
        if step != "get-state":
            with contextlib.suppress(GpuCheckpointError):
                state = self.get_state(pid)
        error = _cuda_error(step, pid, code, self.error_name(code), self.error_string(code), state)
        if code == CUDA_ERROR_NOT_INITIALIZED and self._init_result not in (None, 0):
            init = self._init_result or 0
            error.message += f" The controller's cuInit(0) failed with {self.error_name(init)}."
        raise error

    # -- the checkpoint API

    def get_state(self, pid: int) -> ProcessState:
        self.init()
        value = ctypes.c_int(-1)
        self._check(
            "get-state", pid, self._call("cuCheckpointProcessGetState", pid, ctypes.byref(value))
        )
        try:
            return ProcessState(value.value)
        except ValueError:
            raise GpuCheckpointError(
                f"The NVIDIA driver reports an unknown CUDA state {value.value} for process {pid}.",
                hint="Update jupyter-kernel-snapshots to a version that knows this driver.",
                pid=pid,
                step="get-state",
            ) from None

    def restore_thread_id(self, pid: int) -> int:
        self.init()
        tid = ctypes.c_int(0)
        code = self._call("cuCheckpointProcessGetRestoreThreadId", pid, ctypes.byref(tid))
        self._check("get-restore-thread", pid, code)
        return int(tid.value)

    def lock(self, pid: int, timeout_ms: int = 0) -> None:
        if timeout_ms < 0:
            raise ValueError("timeout_ms must be >= 0")
        self.init()
        args = _LockArgs()
        args.timeoutMs = timeout_ms
        self._check("lock", pid, self._call("cuCheckpointProcessLock", pid, ctypes.byref(args)))

    def checkpoint(self, pid: int) -> None:
        self.init()
        self._check("checkpoint", pid, self._call("cuCheckpointProcessCheckpoint", pid, None))

    def restore(self, pid: int, gpu_pairs: Mapping[str, str] | None = None) -> None:
        """Restore device memory; ``gpu_pairs`` maps recorded GPU UUIDs to GPUs here (580+)."""
        self.init()
        if not gpu_pairs:
            code = self._call("cuCheckpointProcessRestore", pid, None)
            self._check("restore", pid, code)
            return
        version = self.driver_version()
        if version < GPU_REMAP_CUDA_DRIVER_VERSION:
            raise GpuCheckpointError(
                f"Restoring process {pid} onto other GPUs needs NVIDIA driver 580 (CUDA 13.0) "
                f"or newer; this driver supports CUDA {cuda_version_text(version)}.",
                hint="Restore on a machine with the same GPUs, or update the NVIDIA driver.",
                pid=pid,
                step="restore",
            )
        pairs = (_GpuPair * len(gpu_pairs))()
        for slot, (old, new) in zip(pairs, gpu_pairs.items(), strict=True):
            ctypes.memmove(slot.oldUuid, uuid_bytes(old), 16)
            ctypes.memmove(slot.newUuid, uuid_bytes(new), 16)
        args = _RestoreArgs()
        args.gpuPairs = ctypes.cast(pairs, ctypes.POINTER(_GpuPair))
        args.gpuPairsCount = len(gpu_pairs)
        code = self._call("cuCheckpointProcessRestore", pid, ctypes.byref(args))
        self._check("restore", pid, code)

    def unlock(self, pid: int) -> None:
        self.init()
        self._check("unlock", pid, self._call("cuCheckpointProcessUnlock", pid, None))
