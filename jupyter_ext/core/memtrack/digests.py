"""Which pages changed since the last snapshot, found by their content.

Write-protecting a kernel's memory between snapshots makes it pay a fault on each
page's first write, and Linux splits its transparent huge pages to take those faults
(a cell that rewrote all of a 1 GiB array ran 6.5x as long: bench/RESULTS.md). So the
memory is protected only while a snapshot runs. Between snapshots the wrapper keeps
a 16-byte digest (xxh3-128) of each page the last snapshot holds (:class:`PageDigests`,
4 MiB per GiB, taken from the snapshot's own images: :func:`digests_of_dump`). At the next
snapshot the tracker write-protects everything first, then reads the kernel's memory from
outside and unprotects each page whose digest differs (:func:`changed_runs`): CRIU copies
those, and whatever the kernel writes from the protection on. A page is taken from the
parent snapshot only if it was not written since the protection and holds what the
parent holds, however it was written before (the kernel's code, a syscall, a device).
"""

from __future__ import annotations

import bisect
import os
import queue
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from ..criu.images import decode, ints, read_entries
from ..lazypages.pagemap import PE_PARENT, PagemapEntry, parse_pagemap
from . import uffd

PAGE_SIZE = uffd.PAGE_SIZE
DIGEST_SIZE = 16
#: A transparent huge page (unprotecting part of one makes Linux split it).
HUGE_PAGE = 2 << 20
#: Changed pages (of 512) that make a huge-page block copied whole: a dump then copies at
#: most 8 times what changed there, and the kernel keeps its huge page.
DENSE_PAGES = 64
#: How much of the kernel's memory one read copies.
READ_BYTES = 32 << 20
#: Threads reading the kernel's memory at once (each with a buffer of READ_BYTES): half
#: the CPUs this process may use, 2 to 4.
READERS = min(4, max(2, len(os.sched_getaffinity(0)) // 2))

_hash = xxhash.xxh3_128_digest


def page_digests(data: memoryview) -> np.ndarray:
    """The digest of each page of ``data`` (whole pages), as a (pages, 16) uint8 array."""
    joined = b"".join([_hash(data[at : at + PAGE_SIZE]) for at in range(0, len(data), PAGE_SIZE)])
    return np.frombuffer(joined, np.uint8).reshape(-1, DIGEST_SIZE)


@dataclass
class PageDigests:
    """The digest of each page of a snapshot's memory, as runs of consecutive pages."""

    starts: list[int] = field(default_factory=list)
    """Each run's first address, ascending."""
    runs: list[np.ndarray] = field(default_factory=list)
    """Each run's digests, a (pages, 16) uint8 array."""
    blocks: dict[int, bytes] = field(default_factory=dict)
    """The digest of each 2 MiB block (aligned) whose whole content is known: a block that
    still has it is compared in one hash, not 512."""

    @classmethod
    def of(
        cls, pieces: Iterable[tuple[int, np.ndarray]], blocks: dict[int, bytes] | None = None
    ) -> PageDigests:
        """From (address, digests) pieces that do not overlap, in any order (touching
        ones are joined), and the digests of whole blocks."""
        digests = cls(blocks=dict(blocks or {}))
        group: list[np.ndarray] = []
        end = -1
        for start, run in sorted(pieces, key=lambda piece: piece[0]):
            if not len(run):
                continue
            if start != end and group:
                digests.runs.append(np.concatenate(group))
                group = []
            if not group:
                digests.starts.append(start)
            group.append(run)
            end = start + len(run) * PAGE_SIZE
        if group:
            digests.runs.append(np.concatenate(group))
        return digests

    def end_of(self, index: int) -> int:
        return self.starts[index] + len(self.runs[index]) * PAGE_SIZE

    @property
    def pages(self) -> int:
        return sum(len(run) for run in self.runs)

    @property
    def nbytes(self) -> int:
        return self.pages * DIGEST_SIZE

    def pieces(self, start: int, end: int) -> Iterator[tuple[int, np.ndarray]]:
        """The (address, digests) pieces of the runs within [start, end)."""
        index = max(bisect.bisect_right(self.starts, start) - 1, 0)
        while index < len(self.starts) and self.starts[index] < end:
            run_start, run_end = self.starts[index], self.end_of(index)
            low, high = max(start, run_start), min(end, run_end)
            if low < high:
                first = (low - run_start) // PAGE_SIZE
                yield low, self.runs[index][first : first + (high - low) // PAGE_SIZE]
            index += 1

    def unchanged(self, start: int, digests: np.ndarray) -> np.ndarray:
        """Which of the pages from ``start`` on, whose digests now are ``digests``, hold
        what they held in the snapshot (a page the snapshot lacks changed)."""
        same = np.zeros(len(digests), bool)
        for at, old in self.pieces(start, start + len(digests) * PAGE_SIZE):
            first = (at - start) // PAGE_SIZE
            now = digests[first : first + len(old)]
            same[first : first + len(old)] = (now == old).all(axis=1)
        return same


@dataclass
class Changes:
    """What :func:`changed_runs` found."""

    runs: list[tuple[int, int]] = field(default_factory=list)
    """The (start, end) runs of pages to unprotect: copied by the dump."""
    split: set[int] = field(default_factory=set)
    """Huge-page blocks that held a few changed pages: unprotecting those splits the huge
    page (collapsed again after the snapshot)."""
    whole: set[int] = field(default_factory=set)
    """Huge-page blocks unprotected whole (they stay huge pages)."""
    blocks: dict[int, bytes] = field(default_factory=dict)
    """The digests of the 2 MiB blocks found unchanged whole, as read: the snapshot holds
    the same where its dump copies none of their pages (:func:`digests_of_dump`)."""
    read: int = 0
    """Bytes read from the process."""
    unread: int = 0
    """Bytes unprotected without reading: swapped out, or not populated."""

    @property
    def changed(self) -> int:
        """Bytes of populated memory found changed (or that could not be read)."""
        return sum(end - start for start, end in self.runs) - self.unread


def changed_runs(pid: int, digests: PageDigests) -> Changes:
    """After the tracker protected ``pid``'s memory: the protected pages whose content is
    not what ``digests`` says (or that could not be read). Where a huge page maps a block
    of which at least :data:`DENSE_PAGES` pages changed, the block is unprotected whole
    (copied whole, the huge page kept); with fewer, only those pages (the dump copies
    little; Linux splits the huge page to protect the rest). Swapped pages count as
    changed. The process runs meanwhile: what it writes now is no longer protected, so it
    is copied whatever this finds.

    Reading is what costs (``process_vm_readv`` pins and copies page by page, ~2 GB/s
    on one core, against ~12 GB/s for hashing): :data:`READERS` threads read and compare
    pieces of :data:`READ_BYTES` at once (the reads leave Python's lock)."""
    changes = Changes()
    pieces: list[tuple[int, int, bool]] = []
    for start, end, categories in uffd.protected_ranges(pid):
        if categories & uffd.PAGE_IS_SWAPPED:
            # Not read (that would bring it in, or map zero pages where none are): a page
            # not populated is not dumped either way, a swapped one is copied again.
            changes.runs.append((start, end))
            changes.unread += end - start
            continue
        huge = bool(categories & uffd.PAGE_IS_HUGE)
        pieces.extend((at, min(end - at, READ_BYTES), huge) for at in range(start, end, READ_BYTES))
    buffers: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
    for _ in range(min(READERS, len(pieces))):
        buffers.put(memoryview(bytearray(READ_BYTES)))

    def compared(piece: tuple[int, int, bool]) -> tuple[int, np.ndarray, dict[int, bytes]]:
        at, length, _ = piece
        view = buffers.get()
        try:
            got = uffd.read_memory(pid, at, view[:length]) // PAGE_SIZE * PAGE_SIZE
            same = np.zeros(length // PAGE_SIZE, bool)
            blocks: dict[int, bytes] = {}
            same[: got // PAGE_SIZE] = compare(digests, at, view[:got], blocks)
            return got, same, blocks
        finally:
            buffers.put(view)

    pool = ThreadPoolExecutor(READERS, thread_name_prefix="compare")
    try:
        results = pool.map(compared, pieces)
        for (at, _, huge), (got, same, blocks) in zip(pieces, results, strict=True):
            changes.read += got
            changes.blocks.update(blocks)
            if huge:
                _add_huge(changes, at, ~same)
            else:
                changes.runs.extend(_runs_of(at, ~same))
    finally:  # where a read failed, the pieces not read yet are not
        pool.shutdown(cancel_futures=True)
    changes.runs = _joined(changes.runs)
    return changes


def compare(
    digests: PageDigests, start: int, data: memoryview, unchanged: dict[int, bytes]
) -> np.ndarray:
    """Which pages of ``data`` (read from ``start``) hold what the snapshot holds: each
    whole 2 MiB block first in one hash against the snapshot's block digest, the pages of
    the others one by one. Blocks found unchanged whole go into ``unchanged``."""
    same = np.zeros(len(data) // PAGE_SIZE, bool)
    end = start + len(data)
    at = start
    while at < end:
        block = at + -at % HUGE_PAGE if at % HUGE_PAGE else at
        if block > at or block + HUGE_PAGE > end:  # a part of a block: page by page
            stop = min(end, block) if block > at else end
            first = (at - start) // PAGE_SIZE
            part = data[at - start : stop - start]
            same[first : first + len(part) // PAGE_SIZE] = digests.unchanged(at, page_digests(part))
            at = stop
            continue
        first = (block - start) // PAGE_SIZE
        part = data[block - start : block - start + HUGE_PAGE]
        whole = _hash(part)
        if digests.blocks.get(block) == whole:
            same[first : first + HUGE_PAGE // PAGE_SIZE] = True
        else:
            same[first : first + HUGE_PAGE // PAGE_SIZE] = digests.unchanged(
                block, page_digests(part)
            )
        if same[first : first + HUGE_PAGE // PAGE_SIZE].all():
            unchanged[block] = whole
        at = block + HUGE_PAGE
    return same


def _add_huge(changes: Changes, start: int, flags: np.ndarray) -> None:
    """The changed pages of huge-page blocks from ``start`` (a block's first page on)."""
    per_block = HUGE_PAGE // PAGE_SIZE
    for first in range(0, len(flags), per_block):
        block = flags[first : first + per_block]
        count = int(block.sum())
        address = start + first * PAGE_SIZE
        if count >= DENSE_PAGES:
            changes.runs.append((address, address + len(block) * PAGE_SIZE))
            changes.whole.add(address)
        elif count:
            changes.runs.extend(_runs_of(address, block))
            changes.split.add(address - address % HUGE_PAGE)


def _runs_of(start: int, flags: np.ndarray) -> Iterator[tuple[int, int]]:
    """The runs of pages set in ``flags`` from ``start`` on."""
    if not flags.any():
        return
    edges = np.flatnonzero(np.diff(np.concatenate([[False], flags, [False]]).astype(np.int8)))
    for first, last in zip(edges[::2], edges[1::2], strict=True):
        yield start + int(first) * PAGE_SIZE, start + int(last) * PAGE_SIZE


def _joined(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    joined: list[tuple[int, int]] = []
    for start, end in sorted(runs):
        if joined and start <= joined[-1][1]:
            joined[-1] = (joined[-1][0], max(joined[-1][1], end))
        else:
            joined.append((start, end))
    return joined


# ---------------------------------------------------------------------- from the images


def root_pid(images: Path) -> int:
    """The pid the dumped tree's root has in ``images`` (pstree.img's first entry)."""
    _, entries = read_entries(images / "pstree.img")
    return ints(decode(entries[0]), 1)[0]


def digests_of_dump(
    levels: list[Path],
    pid: int,
    before: PageDigests | None,
    unchanged: dict[int, bytes] | None = None,
) -> PageDigests | None:
    """The digests of the memory of process ``pid`` (its pid in the images) that a dump
    left in ``levels`` (its images directories, the dump's own first, then its pre-copy
    rounds', newest first): each page from the newest level whose pages file holds it,
    pages left to the parent snapshot from ``before`` (its digests). None where a page
    left to the parent has no digest there (the next dump then copies everything).
    Block digests: those of the blocks read whole from one pages file, and of the blocks
    the comparison found ``unchanged`` of which the dump copied no page."""
    maps = []
    for level in levels:
        path = level / f"pagemap-{pid}.img"
        pagemap = parse_pagemap(path.read_bytes(), path.name)
        pagemap.entries = _merged(sorted(pagemap.entries, key=lambda entry: entry.vaddr))
        maps.append(_Level(level / pagemap.pages_file, pagemap.entries))
    taken = _Taken()
    try:
        if not _digests_of(maps, 0, 0, uffd.TASK_SIZE + PAGE_SIZE, before, taken):
            return None
    finally:
        for opened in maps:
            opened.close()
    digests = PageDigests.of(taken.pieces, taken.blocks)
    copied = sorted(taken.copied)
    for block, digest in (unchanged or {}).items():
        index = bisect.bisect_right(copied, (block + HUGE_PAGE,))
        if index and copied[index - 1][1] > block:
            continue  # the dump copied one of its pages: what it holds is in the images
        pieces = digests.pieces(block, block + HUGE_PAGE)
        if sum(len(run) for _, run in pieces) == HUGE_PAGE // PAGE_SIZE:
            digests.blocks.setdefault(block, digest)
    return digests


def _merged(entries: list[PagemapEntry]) -> list[PagemapEntry]:
    """Neighbouring entries of the same kind as one (CRIU writes at most 1 MiB in each):
    a 2 MiB block is then hashed from one read."""
    merged: list[PagemapEntry] = []
    for entry in entries:
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.end == entry.vaddr
            and (last.offset >= 0) == (entry.offset >= 0)
            and (last.offset < 0 or last.offset + last.nr_pages * PAGE_SIZE == entry.offset)
            and (last.offset >= 0 or last.flags & PE_PARENT == entry.flags & PE_PARENT)
        ):
            merged[-1] = PagemapEntry(
                last.vaddr, last.nr_pages + entry.nr_pages, last.flags, last.offset
            )
        else:
            merged.append(entry)
    return merged


@dataclass
class _Level:
    """One level of a dump: its pagemap's entries (by address) and its pages file, opened
    once on first use (a pre-copy level of a kernel that writes all the time has tens of
    thousands of scattered entries)."""

    pages_path: Path
    entries: list[PagemapEntry]
    starts: list[int] = field(init=False)
    fd: int = -1

    def __post_init__(self) -> None:
        self.starts = [entry.vaddr for entry in self.entries]

    def pages_fd(self) -> int:
        if self.fd < 0:
            self.fd = os.open(self.pages_path, os.O_RDONLY | os.O_CLOEXEC)
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class _Taken:
    """What :func:`_digests_of` gathers."""

    pieces: list[tuple[int, np.ndarray]] = field(default_factory=list)
    blocks: dict[int, bytes] = field(default_factory=dict)
    copied: list[tuple[int, int]] = field(default_factory=list)
    """The (start, end) runs the dump's own levels hold."""


def _digests_of(
    maps: list[_Level],
    depth: int,
    start: int,
    end: int,
    before: PageDigests | None,
    taken: _Taken,
) -> bool:
    """Gather the digests of what level ``depth`` holds of [start, end) into ``taken``:
    each page from the newest level whose pages file holds it (from ``before`` below the
    last level). False where a page has no digest."""
    if depth == len(maps):
        if before is None:
            return False
        pieces = list(before.pieces(start, end))
        if sum(len(run) for _, run in pieces) != (end - start) // PAGE_SIZE:
            return False
        taken.pieces.extend(pieces)
        return True
    level = maps[depth]
    entries = level.entries
    # By index from the entry that holds ``start``: called once per hole of the level
    # above, so a scan from the first entry would make the walk quadratic.
    for index in range(max(bisect.bisect_right(level.starts, start) - 1, 0), len(entries)):
        entry = entries[index]
        if entry.vaddr >= end:
            break
        low, high = max(start, entry.vaddr), min(end, entry.end)
        if low >= high:
            continue
        if entry.offset >= 0:  # in this level's pages file
            offset = entry.offset + (low - entry.vaddr)
            digests = _file_digests(level, offset, low, high, taken.blocks)
            taken.pieces.append((low, digests))
            taken.copied.append((low, high))
        elif entry.flags & PE_PARENT and not _digests_of(maps, depth + 1, low, high, before, taken):
            return False
    return True


def _file_digests(
    level: _Level, offset: int, start: int, end: int, blocks: dict[int, bytes]
) -> np.ndarray:
    """The digests of the pages of [start, end), at ``offset`` of the level's pages file;
    the digests of the whole blocks among them go into ``blocks``."""
    parts = []
    fd = level.pages_fd()
    at = start
    while at < end:
        # Reads end at block boundaries, so that every whole block is in one read.
        size = min(end - at, READ_BYTES - at % HUGE_PAGE)
        data = os.pread(fd, size, offset + (at - start))
        if len(data) != size:
            raise OSError(f"{level.pages_path} is shorter than its pagemap says")
        view = memoryview(data)
        parts.append(page_digests(view))
        block = at + -at % HUGE_PAGE
        while block + HUGE_PAGE <= at + size:
            blocks[block] = _hash(view[block - at : block - at + HUGE_PAGE])
            block += HUGE_PAGE
        at += size
    return np.concatenate(parts)
