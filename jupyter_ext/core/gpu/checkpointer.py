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

Two backends speak to the driver, with one interface (:class:`CheckpointBackend`):
:class:`CudaDriver` calls libcuda's ``cuCheckpointProcess*`` functions (driver >= 570)
through ctypes, and :class:`CudaCheckpointTool` runs NVIDIA's ``cuda-checkpoint`` utility.
:func:`find_cuda_processes` tells which processes use CUDA, :func:`gpu_inventory` describes
the GPUs for the manifest, and :func:`check_restore_compatible` refuses restores that
cannot work here. Plain Python and ctypes; no Jupyter imports.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from ..errors import IncompatibleSnapshotError, SnapshotError

LIBCUDA_ENV = "JUPYTER_SNAPSHOT_LIBCUDA"
"""Environment variable naming the libcuda to load (default ``libcuda.so.1``)."""
CUDA_CHECKPOINT_ENV = "JUPYTER_SNAPSHOT_CUDA_CHECKPOINT"
"""Environment variable naming the ``cuda-checkpoint`` executable (default: from PATH)."""
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

_CUDA_ERROR_NAMES: dict[int, str] = {
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

_CHECKPOINT_SYMBOLS = (
    "cuCheckpointProcessGetRestoreThreadId",
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
)


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


# --------------------------------------------------------------------------- errors


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


class GpuUnavailableError(GpuCheckpointError):
    """No usable CUDA checkpoint support: libcuda or cuda-checkpoint missing or too old."""

    code = "gpu-unavailable"


# ------------------------------------------------------------------------ backends


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


def cuda_version_text(version: int) -> str:
    """12080 -> '12.8'."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def _hint_for(step: str, code: int | None, pid: int, state: ProcessState | None) -> str:
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


def _cuda_error(
    step: str,
    pid: int,
    code: int,
    name: str,
    text: str,
    state: ProcessState | None = None,
) -> GpuCheckpointError:
    what = f"{name} ({text})" if text else name
    where = f" It is {state.label}." if state is not None else ""
    return GpuCheckpointError(
        f"CUDA {step} of process {pid} failed: {what}.{where}",
        hint=_hint_for(step, code, pid, state),
        pid=pid,
        step=step,
        cuda_error=code,
        cuda_error_name=name,
        cuda_error_string=text,
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
        self.path = path or os.environ.get(LIBCUDA_ENV) or DEFAULT_LIBCUDA
        try:
            lib = ctypes.CDLL(self.path)
        except OSError as exc:
            raise GpuUnavailableError(
                f"The NVIDIA driver library {self.path} cannot be loaded: {exc}",
                hint=(
                    "Install the NVIDIA driver (>= 570), or point "
                    f"${LIBCUDA_ENV} at its libcuda.so.1."
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
                hint=f"Point ${LIBCUDA_ENV} at the NVIDIA driver's libcuda.so.1.",
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
        return _CUDA_ERROR_NAMES.get(code, f"CUDA error {code}")

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


_STATE_WORDS = {state.label: state for state in ProcessState}


class CudaCheckpointTool:
    """NVIDIA's ``cuda-checkpoint`` utility, for drivers whose libcuda lacks the API.

    ``--action lock|checkpoint|restore|unlock --pid P [--timeout MS]``, ``--get-state`` and
    ``--get-restore-tid`` where the utility has them (570+; CRIU's CUDA plugin checks the
    help text for ``--action`` the same way). Older ones only ``--toggle``: lock+checkpoint
    is then one toggle, restore+unlock the other, and :attr:`toggle_only` is True.
    """

    name = "cuda-checkpoint"

    def __init__(self, executable: str | None = None, *, timeout_s: float = 600.0) -> None:
        found = executable or os.environ.get(CUDA_CHECKPOINT_ENV) or shutil.which("cuda-checkpoint")
        if not found:
            raise GpuUnavailableError(
                "NVIDIA's cuda-checkpoint utility is not installed (not on PATH).",
                hint=(
                    "Install it from https://github.com/NVIDIA/cuda-checkpoint, or set "
                    f"${CUDA_CHECKPOINT_ENV} to its path."
                ),
            )
        self.executable = found
        self.timeout_s = timeout_s
        try:
            done = subprocess.run(
                [found, "--help"], capture_output=True, text=True, timeout=30, check=False
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise GpuUnavailableError(
                f"{found} cannot be run: {exc}",
                hint=f"Check the cuda-checkpoint installation, or set ${CUDA_CHECKPOINT_ENV}.",
            ) from exc
        self.help_text = done.stdout + done.stderr
        self.supports_action = "--action" in self.help_text
        self.toggle_only = not self.supports_action
        match = re.search(r"Version\s+(\d+(?:\.\d+)*)", self.help_text)
        self.version = match.group(1) if match else ""

    def describe(self) -> str:
        version = f" {self.version}" if self.version else ""
        mode = "" if self.supports_action else ", toggle only"
        return f"cuda-checkpoint{version} ({self.executable}{mode})"

    def _run(self, step: str, pid: int, args: list[str], timeout_s: float | None = None) -> str:
        argv = [self.executable, *args]
        try:
            done = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=timeout_s or self.timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise GpuCheckpointError(
                f"cuda-checkpoint {step} of process {pid} did not finish within "
                f"{exc.timeout:.0f} s.",
                hint=(
                    f"Process {pid} may be left locked, with its CUDA calls hanging: check it "
                    f"with 'cuda-checkpoint --get-state --pid {pid}', restart the kernel if "
                    "it stays locked."
                ),
                pid=pid,
                step=step,
            ) from exc
        except OSError as exc:
            raise GpuUnavailableError(
                f"{self.executable} cannot be run: {exc}",
                hint=f"Check the cuda-checkpoint installation, or set ${CUDA_CHECKPOINT_ENV}.",
                pid=pid,
                step=step,
            ) from exc
        output = (done.stdout + done.stderr).strip()
        if done.returncode != 0:
            state: ProcessState | None = None
            if step != "get-state":
                with contextlib.suppress(GpuCheckpointError):
                    state = self.get_state(pid)
            code = _code_from_text(output)
            name = _CUDA_ERROR_NAMES.get(code, "") if code is not None else ""
            where = f" It is {state.label}." if state is not None else ""
            raise GpuCheckpointError(
                f"cuda-checkpoint {step} of process {pid} failed (exit {done.returncode}): "
                f"{output or 'no output'}.{where}",
                hint=_hint_for(step, code, pid, state),
                pid=pid,
                step=step,
                cuda_error=code,
                cuda_error_name=name,
                cuda_error_string=output,
                state=state,
            )
        return output

    def get_state(self, pid: int) -> ProcessState:
        output = self._run("get-state", pid, ["--get-state", "--pid", str(pid)], 60)
        word = output.split()[0].lower() if output.split() else ""
        if word not in _STATE_WORDS:
            raise GpuCheckpointError(
                f"cuda-checkpoint reports an unknown CUDA state for process {pid}: {output!r}.",
                hint="Update jupyter-kernel-snapshots to a version that knows this driver.",
                pid=pid,
                step="get-state",
            )
        return _STATE_WORDS[word]

    def restore_thread_id(self, pid: int) -> int:
        output = self._run("get-restore-thread", pid, ["--get-restore-tid", "--pid", str(pid)])
        try:
            return int(output.split()[0])
        except (IndexError, ValueError):
            raise GpuCheckpointError(
                f"cuda-checkpoint printed no restore thread id for process {pid}: {output!r}.",
                hint="Update cuda-checkpoint (driver 570 or newer).",
                pid=pid,
                step="get-restore-thread",
            ) from None

    def _action(self, action: str, pid: int, extra: list[str], timeout_s: float | None) -> None:
        self._run(action, pid, ["--action", action, "--pid", str(pid), *extra], timeout_s)

    def lock(self, pid: int, timeout_ms: int = 0) -> None:
        if not self.supports_action:
            return  # the toggle in checkpoint() locks and checkpoints in one step
        extra = ["--timeout", str(timeout_ms)] if timeout_ms > 0 else []
        limit = timeout_ms / 1000 + 60 if timeout_ms > 0 else None
        self._action("lock", pid, extra, limit)

    def checkpoint(self, pid: int) -> None:
        if self.supports_action:
            self._action("checkpoint", pid, [], None)
        else:
            self._run("checkpoint", pid, ["--toggle", "--pid", str(pid)])

    def restore(self, pid: int, gpu_pairs: Mapping[str, str] | None = None) -> None:
        if gpu_pairs:
            raise GpuCheckpointError(
                f"Restoring process {pid} onto other GPUs is not available through "
                "cuda-checkpoint here.",
                hint="Use the libcuda backend (NVIDIA driver 580 or newer) to move GPUs.",
                pid=pid,
                step="restore",
            )
        if self.supports_action:
            self._action("restore", pid, [], None)
        else:
            self._run("restore", pid, ["--toggle", "--pid", str(pid)])

    def unlock(self, pid: int) -> None:
        if self.supports_action:
            self._action("unlock", pid, [], None)


def _code_from_text(output: str) -> int | None:
    """The CUresult that cuda-checkpoint's message names, where it names one."""
    for code, name in _CUDA_ERROR_NAMES.items():
        if name in output:
            return code
    lowered = output.lower()
    table = (
        ("timed out", CUDA_ERROR_TIMEOUT),
        ("timeout", CUDA_ERROR_TIMEOUT),
        ("out of memory", CUDA_ERROR_OUT_OF_MEMORY),
        ("present state", CUDA_ERROR_ILLEGAL_STATE),
        ("initialization error", CUDA_ERROR_NOT_INITIALIZED),
        ("not supported", CUDA_ERROR_NOT_SUPPORTED),
        ("invalid argument", CUDA_ERROR_INVALID_VALUE),
    )
    for words, code in table:
        if words in lowered:
            return code
    return None


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


# ------------------------------------------------------------- finding CUDA processes


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
    usage = _nvml_process_usage(set(wanted), nvml) if use_nvml else None
    if usage is not None:
        found.update(pid for pid, per_gpu in usage.items() if per_gpu)
    return [pid for pid in wanted if pid in found]


# --------------------------------------------------------------------------- NVML


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


def _nvml_process_usage(pids: set[int], nvml: Any | None) -> dict[int, dict[str, int]] | None:
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


def kernel_gpu_status(pids: Iterable[int], *, nvml: Any | None = None) -> dict[str, Any]:
    """GPU accounting for one kernel's processes: how many use CUDA, the GPU memory they
    hold and their utilization (both None where NVML cannot tell, e.g. without a driver)."""
    cuda_pids = find_cuda_processes(list(pids), nvml=nvml)
    if not cuda_pids:
        return {"processes": 0, "bytes": 0, "utilization": 0}
    usage = _nvml_process_usage(set(cuda_pids), nvml)
    if usage is None:
        return {"processes": len(cuda_pids), "bytes": None, "utilization": None}
    utilization = process_gpu_utilization(cuda_pids, nvml=nvml)
    return {
        "processes": len(cuda_pids),
        "bytes": sum(sum(per_gpu.values()) for per_gpu in usage.values()),
        "utilization": max(utilization.values(), default=0),
    }


def process_gpu_usage(pids: Iterable[int], *, nvml: Any | None = None) -> dict[int, dict[str, int]]:
    """GPU memory each process holds, per GPU UUID; empty when NVML does not answer."""
    return _nvml_process_usage(set(pids), nvml) or {}


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


# ------------------------------------------------------------- restore compatibility


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


# ----------------------------------------------------------------- the checkpointer


@dataclass
class StepTimings:
    """Seconds spent in each CUDA step for one process."""

    lock_s: float = 0.0
    checkpoint_s: float = 0.0
    restore_s: float = 0.0
    unlock_s: float = 0.0


@dataclass
class GpuCheckpoint:
    """The CUDA side of one snapshot (or restore): which processes, and how long each step took.

    ``status``: "checkpointed" (GPU released, ready for the dump), "resumed" (back on the
    GPU after the dump), "aborted" (back on the GPU after a failed dump) or "restored".
    """

    pids: list[int]
    backend: str
    status: str = "checkpointed"
    timings: dict[int, StepTimings] = field(default_factory=dict)

    def totals(self) -> StepTimings:
        total = StepTimings()
        for step in self.timings.values():
            total.lock_s += step.lock_s
            total.checkpoint_s += step.checkpoint_s
            total.restore_s += step.restore_s
            total.unlock_s += step.unlock_s
        return total

    def to_dict(self) -> dict[str, Any]:
        """For the manifest: JSON-friendly (pids as string keys)."""
        return {
            "pids": list(self.pids),
            "backend": self.backend,
            "status": self.status,
            "timings": {str(pid): asdict(step) for pid, step in self.timings.items()},
            "totals": asdict(self.totals()),
        }


def _thread_state(pid: int, tid: int) -> str:
    """A thread's one-letter state from /proc ('' when it cannot be read)."""
    try:
        text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    except OSError:
        return ""
    after = text.rpartition(")")[2].split()
    return after[0] if after else ""


class GpuCheckpointer:
    """Checkpoints and restores the GPU side of a kernel's processes, rolling back on failure.

    Locks all processes before checkpointing any, and restores all before unlocking any (a
    process that talks to a still-locked sibling would otherwise block). The driver does the
    checkpoint and restore work on a "restore thread" inside each target, which must be
    running: a target stopped with SIGSTOP or ptrace is refused with a clear error instead
    of hanging (``refuse_stopped=False`` turns the check off).
    """

    def __init__(
        self,
        backend: CheckpointBackend,
        *,
        lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS,
        refuse_stopped: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.lock_timeout_ms = lock_timeout_ms
        self.refuse_stopped = refuse_stopped
        self._clock = clock

    # -- helpers

    def _timed(self, timings: StepTimings, step: str, action: Callable[[], None]) -> None:
        start = self._clock()
        try:
            action()
        finally:
            name = f"{step}_s"
            setattr(timings, name, getattr(timings, name) + self._clock() - start)

    def _check_not_stopped(self, pids: Sequence[int], what: str) -> None:
        if not self.refuse_stopped:
            return
        for pid in pids:
            try:
                tid = self.backend.restore_thread_id(pid)
            except GpuCheckpointError:
                continue  # the step itself will report what is wrong with this pid
            state = _thread_state(pid, tid) if tid > 0 else ""
            if state in ("T", "t"):
                raise GpuCheckpointError(
                    f"Cannot {what} the GPU of process {pid}: its CUDA restore thread {tid} "
                    "is stopped (SIGSTOP or a tracer), and the driver needs it running.",
                    hint=(
                        f"Resume the process (SIGCONT, or restore with CRIU without leaving "
                        f"tasks stopped: its CUDA calls stay blocked until unlock) before "
                        f"the CUDA {what}."
                    ),
                    pid=pid,
                    step=what,
                )

    def _state_or_none(self, pid: int) -> ProcessState | None:
        try:
            return self.backend.get_state(pid)
        except GpuCheckpointError:
            return None

    def _expect(self, pid: int, step: str, wanted: set[ProcessState]) -> None:
        state = self.backend.get_state(pid)
        if state not in wanted:
            expected = " or ".join(sorted(s.label for s in wanted))
            raise GpuCheckpointError(
                f"After the CUDA {step} process {pid} is {state.label}, not {expected}.",
                hint=_hint_for(step, CUDA_ERROR_ILLEGAL_STATE, pid, state),
                pid=pid,
                step=step,
                state=state,
            )

    def _back_to_running(
        self, pids: Sequence[int], cp: GpuCheckpoint, touched: Iterable[int] | None = None
    ) -> list[str]:
        """Restore + unlock whatever is checkpointed or locked; the problems left, as text.

        A process whose state cannot be read is a problem only if it is in ``touched``
        (default: all), i.e. known to have been locked.
        """
        problems: list[str] = []
        states: dict[int, ProcessState] = {}
        must_read = set(pids if touched is None else touched)
        for pid in pids:
            state = self._state_or_none(pid)
            if state is None:
                if pid in must_read:
                    problems.append(f"process {pid}: its CUDA state cannot be read")
            elif state == ProcessState.FAILED:
                problems.append(
                    f"process {pid} is in the FAILED state: its GPU memory is lost; restart "
                    "the kernel"
                )
            else:
                states[pid] = state
        for pid, state in states.items():
            if state == ProcessState.CHECKPOINTED:
                timings = cp.timings.setdefault(pid, StepTimings())
                try:
                    self._timed(timings, "restore", partial(self.backend.restore, pid))
                    states[pid] = ProcessState.LOCKED
                except GpuCheckpointError as exc:
                    problems.append(exc.message)
        for pid, state in states.items():
            if state == ProcessState.LOCKED and not self.backend.toggle_only:
                timings = cp.timings.setdefault(pid, StepTimings())
                try:
                    self._timed(timings, "unlock", partial(self.backend.unlock, pid))
                except GpuCheckpointError as exc:
                    problems.append(exc.message)
        return problems

    @staticmethod
    def _with_rollback(exc: GpuCheckpointError, problems: list[str]) -> GpuCheckpointError:
        if problems:
            tail = " Rolling back left problems: " + "; ".join(problems) + "."
            hint = exc.hint + " Processes left locked or checkpointed hang on their next CUDA "
            hint += "call: restart the kernel."
        else:
            tail = " Every process was rolled back and keeps running on its GPU."
            hint = exc.hint
        return type(exc)(
            exc.message + tail,
            hint=hint.strip(),
            log_excerpt=exc.log_excerpt,
            pid=exc.pid,
            step=exc.step,
            cuda_error=exc.cuda_error,
            cuda_error_name=exc.cuda_error_name,
            cuda_error_string=exc.cuda_error_string,
            state=exc.state,
        )

    # -- the four operations

    def checkpoint(self, pids: Sequence[int]) -> GpuCheckpoint:
        """Lock, then checkpoint, every process: their GPU memory moves into host memory.

        On any failure the processes already touched are restored and unlocked again and the
        error is raised with what the rollback did.
        """
        cp = GpuCheckpoint(pids=list(pids), backend=self.backend.describe())
        cp.timings = {pid: StepTimings() for pid in cp.pids}
        self._check_not_stopped(cp.pids, "checkpoint")
        locked: list[int] = []
        try:
            for pid in cp.pids:
                lock = partial(self.backend.lock, pid, self.lock_timeout_ms)
                self._timed(cp.timings[pid], "lock", lock)
                locked.append(pid)
            for pid in cp.pids:
                self._timed(cp.timings[pid], "checkpoint", partial(self.backend.checkpoint, pid))
        except GpuCheckpointError as exc:
            problems = self._back_to_running(cp.pids, cp, touched=locked)
            cp.status = "aborted"
            raise self._with_rollback(exc, problems) from exc
        return cp

    def _resume(self, cp: GpuCheckpoint, status: str, context: str) -> GpuCheckpoint:
        self._check_not_stopped(cp.pids, "restore")
        problems = self._back_to_running(cp.pids, cp)
        for pid in cp.pids:
            state = self._state_or_none(pid)
            if state is not None and state != ProcessState.RUNNING:
                problems.append(f"process {pid} is still {state.label}")
        if problems:
            first = cp.pids[0] if len(cp.pids) == 1 else None
            raise GpuCheckpointError(
                f"The GPU of the kernel could not be given back {context}: "
                + "; ".join(dict.fromkeys(problems))
                + ".",
                hint=(
                    "A process left locked or checkpointed hangs on its next CUDA call: "
                    "restart the kernel (the snapshot, if it was written, can be restored)."
                ),
                pid=first,
                step="restore",
            )
        cp.status = status
        return cp

    def resume(self, cp: GpuCheckpoint) -> GpuCheckpoint:
        """After the dump, for a kernel that keeps running: restore then unlock everything."""
        return self._resume(cp, "resumed", "after the snapshot")

    def abort(self, cp: GpuCheckpoint) -> GpuCheckpoint:
        """After a failed dump: put every process back on its GPU (same steps as resume)."""
        return self._resume(cp, "aborted", "after the failed snapshot")

    def restore(
        self, pids: Sequence[int], gpu_pairs: Mapping[str, str] | None = None
    ) -> GpuCheckpoint:
        """After a CRIU restore: restore then unlock every process, checking each state.

        Each process must be CHECKPOINTED (or LOCKED: then it is only unlocked). The states
        are read before and after each step; the first that is wrong stops the restore with
        an error naming the process and its state.
        """
        cp = GpuCheckpoint(pids=list(pids), backend=self.backend.describe(), status="restored")
        cp.timings = {pid: StepTimings() for pid in cp.pids}
        before = {pid: self.backend.get_state(pid) for pid in cp.pids}
        for pid, state in before.items():
            if state not in (ProcessState.CHECKPOINTED, ProcessState.LOCKED):
                raise GpuCheckpointError(
                    f"Process {pid} is {state.label}, not checkpointed: the snapshot's GPU "
                    "memory cannot be restored into it.",
                    hint=_hint_for("restore", CUDA_ERROR_ILLEGAL_STATE, pid, state),
                    pid=pid,
                    step="restore",
                    state=state,
                )
        self._check_not_stopped(cp.pids, "restore")
        after_restore = {ProcessState.LOCKED}
        if self.backend.toggle_only:
            after_restore.add(ProcessState.RUNNING)
        for pid in cp.pids:
            if before[pid] == ProcessState.CHECKPOINTED:
                restore = partial(self.backend.restore, pid, gpu_pairs)
                self._timed(cp.timings[pid], "restore", restore)
                self._expect(pid, "restore", after_restore)
        for pid in cp.pids:
            if not self.backend.toggle_only:
                self._timed(cp.timings[pid], "unlock", partial(self.backend.unlock, pid))
            self._expect(pid, "unlock", {ProcessState.RUNNING})
        return cp
