"""The checkpointer: the CUDA side of a snapshot or restore for all of a kernel's
processes, with rollback so a failed snapshot leaves the kernel running on its GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from .backend import CheckpointBackend
from .errors import (
    CUDA_ERROR_ILLEGAL_STATE,
    DEFAULT_LOCK_TIMEOUT_MS,
    GpuCheckpointError,
    ProcessState,
    hint_for,
)


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
                hint=hint_for(step, CUDA_ERROR_ILLEGAL_STATE, pid, state),
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
                    hint=hint_for("restore", CUDA_ERROR_ILLEGAL_STATE, pid, state),
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
