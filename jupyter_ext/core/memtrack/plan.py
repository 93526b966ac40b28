"""How a kernel's next dump copies its memory: only what changed since its previous
snapshot, or everything (and why), and whether it is copied while the kernel runs first.

Pure decisions on what the wrapper knows (:class:`Situation`), unit-tested without
processes; kernel_wrapper/memory.py gathers the facts and carries the plan out.

- **Incremental**: the kernel's memory has been tracked since its previous snapshot,
  which is still on this machine (its chain is linked, core/criu/chain.py): CRIU copies
  the pages written since.
- **Full**: everything is copied, for one of the reasons of :data:`REASONS`; it starts a
  new chain, tracked from then on where tracking works.
- **Pre-copy** (either way, where tracking works): while more than
  :data:`PRECOPY_MIN_BYTES` would be copied (after a round: :data:`PRECOPY_AGAIN_BYTES`),
  ``criu pre-dump`` copies it while the kernel runs (frozen only to read and protect its
  page tables), at most :data:`MAX_PRECOPY_ROUNDS` times and only while each round leaves
  at most :data:`PRECOPY_CONVERGING` of what it started from; then the dump copies,
  frozen, only what was written meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..criu.chain import ChainStats
from ..humanize import human_bytes

#: Below this many bytes to copy, a freeze copies them at once (about 30 ms here).
PRECOPY_MIN_BYTES = 64 << 20
#: After a round, another one while more than this is left (and the rounds converge):
#: what a kernel writes during a round is scattered pages, which cost a freeze several
#: times more per byte than a contiguous run (a writing 1 GiB kernel, 50 MiB: ~100 ms).
PRECOPY_AGAIN_BYTES = 16 << 20
#: Another round only while the last one left at most this share of what it started
#: from. A kernel writing 100 MB/s at random leaves each round a quarter to a half of
#: what it copied, and less once rounds are short (scattered pages copy at ~10 us each
#: here, and every round costs ~0.2 s besides): three rounds that had to halve often
#: left its freeze 40-49 MiB, up to five 21-25 MiB (bench/RESULTS.md, 2026-12-07).
PRECOPY_CONVERGING = 0.75
#: Rounds after the first copy at most this share of the kernel's memory again, in all:
#: they re-copy what the kernel wrote meanwhile, and the snapshot's chain keeps every
#: copy (a restore downloads them). Without it, a kernel rewriting much of its memory
#: fast made one snapshot's chain pass :data:`MAX_CHAIN_GROWTH`, so that its next
#: snapshot copied everything again.
PRECOPY_AGAIN_SHARE = 0.5
#: Rounds of pre-copy at most; a kernel that writes faster than they copy is then frozen
#: for what is left (the snapshot's ``memory`` record says so).
MAX_PRECOPY_ROUNDS = 5
#: A chain longer than this starts anew (each level is a file a restore reads).
MAX_CHAIN_LEVELS = 16
#: A chain whose levels hold more than this many times the kernel's memory (pages later
#: levels replaced) starts anew: a restore from a store downloads every level.
MAX_CHAIN_GROWTH = 2.0

OFF = "memory tracking is off (track_memory = False)"
"""Reasons a dump copies everything (shown in the job's result and the panel's card)."""
FIRST = "the kernel's first snapshot (a new kernel process, or one started again)"
AFTER_RESTORE = "the first snapshot since the kernel was restored (a new process)"
PARENT_GONE = "its previous snapshot is no longer on this machine"
NO_DIGESTS = "what its previous snapshot holds could not be read back from its images"
CHANGES_UNKNOWN = "what changed since its previous snapshot could not be found: {error}"
GPU = (
    "the kernel uses the GPU: the device may write its host memory without the "
    "processor's page tables knowing (and GPU memory is copied whole anyway)"
)
PINNED = (
    "{pinned} of the kernel's memory is pinned for a device or io_uring, which may write "
    "it without the processor's page tables knowing"
)


@dataclass(frozen=True)
class Situation:
    """What the wrapper knows before a dump."""

    tracking: str | None
    """"userfaultfd" or "soft-dirty" when the kernel's memory can be tracked, else None."""
    unavailable: str = ""
    """Why it cannot be (when ``tracking`` is None)."""
    untracked_reason: str = ""
    """Why the kernel's memory was not tracked since a snapshot (FIRST, AFTER_RESTORE, a
    failed snapshot), when :attr:`tracked_since` is None."""
    tracked_since: str | None = None
    """The kernel's last snapshot since which its memory has been tracked, if any."""
    parent_id: str | None = None
    """The kernel's previous snapshot as found on this machine (offered by the server)."""
    parent_chain: ChainStats | None = None
    memory_bytes: int = 0
    """The kernel's private memory now."""
    gpu: bool = False
    pinned_bytes: int = 0
    keeps_running: bool = True
    """The kernel runs on after the dump (not a suspend): only then is a pre-copy worth
    its second pass, and tracking worth keeping."""
    precopy_possible: bool = True
    """Whether CRIU can pre-copy here: as root, through the node agent, or with the
    project's CRIU (CRIU 4.2's pre-dump holds a pipe per run of pages, which an ordinary
    user's limits cut short on a big kernel: core/criu/tracking.py); and no pre-copy round
    of this kernel failed."""


@dataclass(frozen=True)
class DumpPlan:
    parent_id: str | None
    """The snapshot this dump adds a level to; None: a full copy."""
    reason: str
    """Why the copy is full ("" when incremental)."""
    track: bool
    """Dump with tracking (protect what was copied: the next dump can be incremental)."""
    precopy: bool
    """Copy while the kernel runs before the freeze (:data:`PRECOPY_MIN_BYTES`)."""

    @property
    def mode(self) -> str:
        return "incremental" if self.parent_id else "full"


def plan_dump(s: Situation) -> DumpPlan:
    """The plan for the next dump (see the module's docstring)."""
    if s.tracking is None:
        return DumpPlan(None, s.unavailable, track=False, precopy=False)
    if s.gpu:
        return DumpPlan(None, GPU, track=False, precopy=False)
    if s.pinned_bytes:
        return DumpPlan(
            None, PINNED.format(pinned=human_bytes(s.pinned_bytes)), track=False, precopy=False
        )
    ahead = s.keeps_running
    precopy = ahead and s.precopy_possible
    if s.tracked_since is None:
        return DumpPlan(None, s.untracked_reason or FIRST, track=ahead, precopy=precopy)
    if s.parent_id != s.tracked_since or s.parent_chain is None:
        return DumpPlan(None, PARENT_GONE, track=ahead, precopy=precopy)
    chain = s.parent_chain
    if chain.levels >= MAX_CHAIN_LEVELS:
        return DumpPlan(
            None,
            f"its chain of {chain.levels} levels starts anew (at most {MAX_CHAIN_LEVELS})",
            track=ahead,
            precopy=precopy,
        )
    if s.memory_bytes and chain.pages_bytes > MAX_CHAIN_GROWTH * s.memory_bytes:
        return DumpPlan(
            None,
            f"its chain holds {human_bytes(chain.pages_bytes)} for "
            f"{human_bytes(s.memory_bytes)} of memory: it starts anew",
            track=ahead,
            precopy=precopy,
        )
    return DumpPlan(s.parent_id, "", track=True, precopy=precopy)


def another_round(
    done: int, pending: int, previous: int | None, again: int = 0, memory: int = 0
) -> bool:
    """Whether to pre-copy once more (:func:`precopy_stop`)."""
    return not precopy_stop(done, pending, previous, again, memory)


def precopy_stop(
    done: int, pending: int, previous: int | None, again: int = 0, memory: int = 0
) -> str:
    """Why pre-copy stops here ("" while it goes on), for the snapshot's record: little
    is left, the kernel writes faster than the rounds copy (it is then frozen for what
    is left), or the rounds would copy too much again. ``done`` rounds made, ``pending``
    bytes to copy now, ``previous`` what the last round started from (None before the
    first), ``again`` what the rounds after the first copied, ``memory`` the kernel's
    (0: unknown)."""
    if pending <= (PRECOPY_MIN_BYTES if not done else PRECOPY_AGAIN_BYTES):
        return f"{human_bytes(pending)} left to copy while frozen"
    if done >= MAX_PRECOPY_ROUNDS:
        return (
            f"the kernel writes faster than {MAX_PRECOPY_ROUNDS} rounds copy: "
            f"{human_bytes(pending)} left to copy while frozen"
        )
    if previous is not None and pending > previous * PRECOPY_CONVERGING:
        return (
            f"the kernel writes about as fast as a round copies: {human_bytes(pending)} "
            "left to copy while frozen"
        )
    if done and memory and again + pending > PRECOPY_AGAIN_SHARE * memory:
        return (
            f"another round would copy more than {PRECOPY_AGAIN_SHARE:.0%} of the kernel's "
            f"{human_bytes(memory)} again: {human_bytes(pending)} left to copy while frozen"
        )
    return ""
