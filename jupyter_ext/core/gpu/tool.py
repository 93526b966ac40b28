"""NVIDIA's ``cuda-checkpoint`` utility as a backend: :class:`CudaCheckpointTool`.

For drivers whose libcuda lacks the checkpoint API, and as a second opinion in tests.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import Mapping

from ..protocol.environment import ENV_CUDA_CHECKPOINT
from .errors import (
    CUDA_ERROR_ILLEGAL_STATE,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NAMES,
    CUDA_ERROR_NOT_INITIALIZED,
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_ERROR_TIMEOUT,
    GpuCheckpointError,
    GpuUnavailableError,
    ProcessState,
    step_failed,
)

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
        found = executable or os.environ.get(ENV_CUDA_CHECKPOINT) or shutil.which("cuda-checkpoint")
        if not found:
            raise GpuUnavailableError(
                "NVIDIA's cuda-checkpoint utility is not installed (not on PATH).",
                hint=(
                    "Install it from https://github.com/NVIDIA/cuda-checkpoint, or set "
                    f"${ENV_CUDA_CHECKPOINT} to its path."
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
                hint=f"Check the cuda-checkpoint installation, or set ${ENV_CUDA_CHECKPOINT}.",
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
                hint=f"Check the cuda-checkpoint installation, or set ${ENV_CUDA_CHECKPOINT}.",
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
            name = CUDA_ERROR_NAMES.get(code, "") if code is not None else ""
            raise step_failed(
                f"cuda-checkpoint {step} of process {pid} failed (exit {done.returncode}): "
                f"{output or 'no output'}",
                step=step,
                pid=pid,
                code=code,
                name=name,
                text=output,
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
    for code, name in CUDA_ERROR_NAMES.items():
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
