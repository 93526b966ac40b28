"""One death of a kernel process, and the witness that tells it: taken when the process
starts, asked when it has ended."""

from __future__ import annotations

import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..humanize import human_bytes
from .oom import MemoryCgroup, kernel_log_kills

#: Signals that mean the process crashed (its own fault), with what they are.
CRASHES = {
    "SIGSEGV": "a segmentation fault",
    "SIGBUS": "a bus error",
    "SIGABRT": "it aborted",
    "SIGFPE": "an arithmetic error",
    "SIGILL": "an illegal instruction",
}


@dataclass(frozen=True)
class Death:
    """How a kernel process ended, as far as this machine tells it."""

    exit_code: int | None
    """As :class:`subprocess.Popen` gives it (minus the signal that ended it); None if it
    cannot be known here."""
    oom: bool = False
    """The out-of-memory killer chose it."""
    memory_bytes: int | None = None
    """Its resident memory when the OOM killer killed it (the kernel log's)."""
    memory_limit: int | None = None
    """The limit of its memory cgroup, when the OOM killer killed it."""
    wrapper: bool = False
    """The wrapper died too (jupyter_client started a new one under the same kernel id)."""
    at: float = field(default_factory=time.time)

    @property
    def signal(self) -> str | None:
        """The signal that ended it ("SIGKILL"), if one did."""
        if self.exit_code is None or self.exit_code >= 0:
            return None
        try:
            return signal.Signals(-self.exit_code).name
        except ValueError:
            return f"signal {-self.exit_code}"

    @property
    def cause(self) -> str:
        """oom, crash, signal, exit or unknown."""
        if self.oom:
            return "oom"
        if self.signal in CRASHES:
            return "crash"
        if self.signal:
            return "signal"
        return "unknown" if self.exit_code is None else "exit"

    @property
    def reason(self) -> str:
        """What happened, in words: "killed by the out-of-memory killer at 14.2 GiB"."""
        cause, sig = self.cause, self.signal
        if cause == "oom":
            if self.memory_bytes:
                return f"killed by the out-of-memory killer at {human_bytes(self.memory_bytes)}"
            if self.memory_limit:
                limit = human_bytes(self.memory_limit)
                return f"killed by the out-of-memory killer (memory limit {limit})"
            return "killed by the out-of-memory killer"
        if cause == "crash" and sig is not None:
            return f"crashed: {CRASHES[sig]} ({sig})"
        if cause == "signal":
            return f"killed by {sig}" if sig == "SIGKILL" else f"ended by {sig}"
        if cause == "exit":
            return (
                "exited by itself"
                if self.exit_code == 0
                else f"exited with status {self.exit_code}"
            )
        return "ended; how is not known on this machine"

    def to_dict(self) -> dict[str, Any]:
        """Its JSON form, with what it is in words (``cause``, ``signal``, ``reason``)."""
        return {**asdict(self), "cause": self.cause, "signal": self.signal, "reason": self.reason}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Death:
        names = {"exit_code", "oom", "memory_bytes", "memory_limit", "wrapper", "at"}
        return cls(**{k: v for k, v in data.items() if k in names})


class Witness:
    """Taken when a process starts: its memory cgroup's OOM kill count then, so that a
    death can be told as the OOM killer's (the count rose) or not. ``pids``: the
    processes whose kill the kernel log may name (the kernel, its wrapper)."""

    def __init__(self, *pids: int) -> None:
        self.pids = set(pids)
        self.since = time.monotonic()
        self.cgroup = MemoryCgroup.of(pids[0]) if pids else None
        self._kills = self.cgroup.oom_kills() if self.cgroup else None

    def death(self, exit_code: int | None, *, certain: bool = True, wrapper: bool = False) -> Death:
        """How the process ended with ``exit_code``: the OOM killer's when the kernel log
        names one of ``pids``, or when its cgroup counted a kill and the process was
        killed (SIGKILL) or its exit code is not ``certain`` (a launcher's)."""
        logged = [k for k in kernel_log_kills(self.since - 1.0) or [] if k.pid in self.pids]
        kills = self.cgroup.oom_kills() if self.cgroup else None
        counted = kills is not None and self._kills is not None and kills > self._kills
        killed = exit_code == -signal.SIGKILL or not certain or exit_code is None
        oom = bool(logged) or (counted and killed)
        if oom and not certain:
            exit_code = -signal.SIGKILL  # what the OOM killer sends
        return Death(
            exit_code=exit_code if certain or oom else None,
            oom=oom,
            memory_bytes=logged[-1].rss_bytes if logged else None,
            memory_limit=self.cgroup.limit() if oom and self.cgroup else None,
            wrapper=wrapper,
        )
