"""Pacing: a kernel's cell checkpoints stall it for at most a share of its wall time
(``cell_checkpoint_max_pause_share``), also when one is to copy far more than the last.

A checkpoint stalls the kernel while it holds its requests (the dump's freeze) and while
each pre-copy round freezes it. After one that stalled it S seconds, the next starts no
sooner than S / share - S later, and no sooner than E / share - E, where E is what the
next is expected to stall: a cell that made 1 GiB of new memory gets a checkpoint that
copies all of it, and waits for a budget of its own size rather than the last one's
(seen: one such checkpoint was 3 % of a 12 s burst of cells). E is learned from the
kernel's own checkpoints: the stall per byte copied of the last large one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GIB = 1 << 30
#: What a checkpoint is expected to stall the kernel per GiB it copies, until one of the
#: kernel's own checkpoints has copied LEARN_MIN_BYTES: the worst seen (2 vCPUs), a full
#: copy of a 1 GiB kernel pre-copied while it ran a burst of cells, 0.33 s; pre-copied while
#: it was quiet, 0.14 s (bench/RESULTS.md).
STALL_PER_GIB = 0.33
#: A checkpoint that copied at least this much teaches the kernel's own stall per byte
#: (below it, the fixed cost of a freeze dominates).
LEARN_MIN_BYTES = 256 << 20


def spacing(share: float, stall: float) -> float:
    """How long after a checkpoint that stalled the kernel ``stall`` seconds the next may
    start, to keep the stalls within ``share`` of the wall time (0: at once)."""
    return stall * (1 / share - 1) if 0 < share < 1 else 0.0


def stall_of(pause_seconds: float, memory: dict[str, Any]) -> float:
    """How long a checkpoint stalled the kernel: ``pause_seconds`` (requests held), and
    the freezes of its pre-copy rounds (the manifest's ``memory.precopy``)."""
    rounds = memory.get("precopy") or []
    return pause_seconds + sum(float(level.get("frozen_seconds", 0.0)) for level in rounds)


@dataclass
class Pacing:
    """When a kernel's next checkpoint may start (times on one monotonic clock)."""

    share: float
    ended: float | None = None
    """When the last checkpoint ended (None: none yet)."""
    stall: float = 0.0
    """How long the last checkpoint stalled the kernel."""
    stall_per_byte: float = STALL_PER_GIB / GIB

    def expected(self, copies: int) -> float:
        """What a checkpoint copying ``copies`` bytes is expected to stall the kernel: at
        least what the last one did."""
        return max(self.stall, copies * self.stall_per_byte)

    def not_before(self, copies: int | None = None) -> float:
        """When the next checkpoint may start; with ``copies`` (the bytes it would copy,
        once known) also by what it is expected to stall."""
        if self.ended is None:
            return 0.0
        stall = self.stall if copies is None else self.expected(copies)
        return self.ended + spacing(self.share, stall)

    def taken(self, stall: float, copied: int, ended: float) -> None:
        """A checkpoint that copied ``copied`` bytes and stalled the kernel ``stall``
        seconds ended at ``ended``."""
        self.ended = ended
        self.stall = stall
        if copied >= LEARN_MIN_BYTES:
            self.stall_per_byte = stall / copied
