"""Which cell checkpoints stay: the last ``keep`` within a byte budget.

A checkpoint's images hold hard links to the files of the checkpoints its chain builds
on (core/criu/chain.py): removing an old checkpoint frees only the files no newer one
links. So the bytes are counted per file (inode), once, and a removal is judged by what
it really frees. The oldest go first; never the kernel's position, the redo point, the
chain's newest level (the next dump builds on it), or one held (a take-back reading it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Files = Mapping[int, int]
"""A checkpoint's files: size by inode."""


def unique_bytes(files: Sequence[Files]) -> int:
    """What these checkpoints take on disk, a file they share counted once."""
    sizes: dict[int, int] = {}
    for group in files:
        sizes.update(group)
    return sum(sizes.values())


def to_remove(
    order: Sequence[str],
    files: Mapping[str, Files],
    *,
    keep: int,
    budget: int,
    protected: set[str],
) -> list[str]:
    """The checkpoints to remove, oldest first: ``order`` lists them oldest first,
    ``files`` gives each one's files; past ``keep`` of them, or past ``budget`` bytes
    together, the oldest unprotected go until both hold (or only protected ones are
    left)."""
    kept = list(order)
    removed: list[str] = []
    for candidate in list(order):
        over_count = len(kept) > keep
        over_budget = unique_bytes([files[c] for c in kept]) > budget
        if not (over_count or over_budget):
            break
        if candidate in protected:
            continue
        kept.remove(candidate)
        removed.append(candidate)
    return removed
