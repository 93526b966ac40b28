"""A chain of memory levels (core/criu/chain.py) as one flat images directory, for lazy
restores.

A full restore reads a chain as it is: ``criu restore`` follows ``images/parent`` itself.
A lazy one cannot: CRIU reads the pages an incremental dump left to the parent
(``PE_PARENT``) at once, from the parent's files, which a lazy restore from a store has
not downloaded yet. So a lazy restore of a chained snapshot gives CRIU a *flat* directory:
the top level's images, and per process a pagemap in which every run is present (lazy as
its level said) and a sparse pages file holding only what CRIU reads itself; every page
is served, through :class:`ChainPages`, from the level that holds it.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from ..criu.chain import PARENT
from ..criu.images import put_varint
from ..errors import SnapshotCorruptError
from .pagemap import (
    IMG_COMMON_MAGIC,
    PAGE_SIZE,
    PAGEMAP_MAGIC,
    PE_LAZY,
    PE_PARENT,
    PE_PRESENT,
    Pagemap,
    PagemapEntry,
    chain_levels,
    read_pagemaps,
)
from .sources import PageSource


@dataclass(frozen=True)
class Piece:
    """A run of a process's pages and where its data is: ``file`` (relative to the
    chain's top images directory, e.g. ``parent/pages-1.img``) at ``offset``."""

    vaddr: int
    nr_pages: int
    lazy: bool
    file: str
    offset: int

    @property
    def end(self) -> int:
        return self.vaddr + self.nr_pages * PAGE_SIZE


def is_chain(images: Path) -> bool:
    return (images / PARENT).is_dir()


@dataclass(frozen=True)
class _Level:
    """One level of a chain: its pagemaps, and the end of each of their entries (sorted,
    as CRIU writes them: searched, not scanned, for the entries under a parent's)."""

    prefix: str
    pagemaps: dict[int, Pagemap]
    ends: dict[int, list[int]]

    @classmethod
    def read(cls, prefix: str, images: Path) -> _Level:
        pagemaps = read_pagemaps(images)
        ends = {pid: [e.end for e in pagemap.entries] for pid, pagemap in pagemaps.items()}
        return cls(prefix, pagemaps, ends)


def resolve(images: Path) -> dict[int, list[Piece]]:
    """Each process's pages (by the pagemap's id) and the level holding each run."""
    levels = [_Level.read(prefix, here) for prefix, here in chain_levels(images)]
    return {
        pid: [piece for entry in top.entries for piece in _locate(levels, 0, pid, entry)]
        for pid, top in levels[0].pagemaps.items()
    }


def _locate(levels: list[_Level], depth: int, pid: int, entry: PagemapEntry) -> list[Piece]:
    level = levels[depth]
    if not entry.flags & PE_PARENT:
        if entry.offset < 0:
            return []
        pages_file = level.prefix + level.pagemaps[pid].pages_file
        return [Piece(entry.vaddr, entry.nr_pages, entry.lazy, pages_file, entry.offset)]
    if depth + 1 >= len(levels) or pid not in levels[depth + 1].pagemaps:
        raise _missing(entry.vaddr, level.prefix)
    pieces: list[Piece] = []
    start, end = entry.vaddr, entry.end
    under = levels[depth + 1].pagemaps[pid].entries
    first = bisect.bisect_right(levels[depth + 1].ends[pid], start)  # the first ending past
    for index in range(first, len(under)):
        below = under[index]
        if below.vaddr >= end:
            break
        lo, hi = max(start, below.vaddr), min(end, below.end)
        skip = (lo - below.vaddr) // PAGE_SIZE
        part = PagemapEntry(
            lo,
            (hi - lo) // PAGE_SIZE,
            below.flags,
            below.offset + skip * PAGE_SIZE if below.offset >= 0 else -1,
        )
        pieces += _locate(levels, depth + 1, pid, part)
    if sum(p.nr_pages for p in pieces) != entry.nr_pages:
        raise _missing(entry.vaddr, level.prefix)
    return pieces


def _missing(vaddr: int, prefix: str) -> SnapshotCorruptError:
    return SnapshotCorruptError(
        f"The snapshot's memory chain lacks the pages at {vaddr:#x} that its level "
        f"'{prefix or '.'}' leaves to its parent.",
        hint="The snapshot is damaged; restore another one.",
    )


@dataclass(frozen=True)
class _Run:
    """A run of a flat pages file and where its bytes are in the chain."""

    flat_offset: int
    length: int
    file: str
    offset: int


class ChainPages:
    """A page source for a flat directory's pages files, reading their bytes from the
    chain's levels through ``inner`` (a source of the chain's top images directory)."""

    def __init__(self, inner: PageSource, runs: dict[str, list[_Run]]) -> None:
        self.inner = inner
        self.runs = runs
        self._ends = {path: [r.flat_offset + r.length for r in rs] for path, rs in runs.items()}

    def read(self, path: str, offset: int, length: int) -> bytes:
        runs = self.runs.get(path)
        if runs is None:
            raise OSError(f"{path} is not a pages file of the flat images")
        out = bytearray()
        position, end = offset, offset + length
        # The first run that ends past ``offset`` (searched: a read of every page of a
        # large kernel would scan the runs before it each time).
        for index in range(bisect.bisect_right(self._ends[path], position), len(runs)):
            run = runs[index]
            if run.flat_offset > position or position >= end:
                break
            skip = position - run.flat_offset
            take = min(run.length - skip, end - position)
            out += self.inner.read(run.file, run.offset + skip, take)
            position += take
        if position != end:
            raise OSError(f"{path}: nothing in the chain at {position} ({length} at {offset})")
        return bytes(out)


def flatten(images: Path, flat: Path, inner: PageSource) -> ChainPages:
    """Make ``flat`` (a new directory) the flat form of the chain ``images``: its other
    images linked (or copied), each pagemap merged, each pages file sparse at its full
    size. Returns the source of those pages files (their bytes come from the chain
    through ``inner``)."""
    flat.mkdir(mode=0o700)
    pieces = resolve(images)
    for path in images.iterdir():
        if path.name == PARENT or not path.is_file():
            continue
        if path.name.startswith(("pagemap-", "pages-")):
            continue
        try:
            os.link(path, flat / path.name)
        except OSError:
            shutil.copyfile(path, flat / path.name)
    runs: dict[str, list[_Run]] = {}
    top = read_pagemaps(images)
    for pid, pagemap in top.items():
        name = pagemap.pages_file
        file_runs: list[_Run] = []
        offset = 0
        for piece in pieces[pid]:
            length = piece.nr_pages * PAGE_SIZE
            file_runs.append(_Run(offset, length, piece.file, piece.offset))
            offset += length
        runs[name] = file_runs
        (flat / f"pagemap-{pid}.img").write_bytes(encode_pagemap(pagemap.pages_id, pieces[pid]))
        fd = os.open(flat / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, offset)
        finally:
            os.close(fd)
    return ChainPages(inner, runs)


def encode_pagemap(pages_id: int, pieces: list[Piece]) -> bytes:
    """A ``pagemap-N.img`` listing ``pieces`` as present runs (lazy as they are), in
    order, neighbours of the same kind merged."""
    merged: list[tuple[int, int, bool]] = []
    for piece in pieces:
        if merged and merged[-1][2] == piece.lazy:
            vaddr, pages, lazy = merged[-1]
            if vaddr + pages * PAGE_SIZE == piece.vaddr:
                merged[-1] = (vaddr, pages + piece.nr_pages, lazy)
                continue
        merged.append((piece.vaddr, piece.nr_pages, piece.lazy))
    out = bytearray(struct.pack("<II", IMG_COMMON_MAGIC, PAGEMAP_MAGIC))
    out += _message([(1, pages_id)])
    for vaddr, pages, lazy in merged:
        flags = PE_PRESENT | (PE_LAZY if lazy else 0)
        out += _message([(1, vaddr), (2, min(pages, 0xFFFFFFFF)), (4, flags), (5, pages)])
    return bytes(out)


def _message(fields: list[tuple[int, int]]) -> bytes:
    body = b"".join(put_varint(number << 3) + put_varint(value) for number, value in fields)
    return struct.pack("<I", len(body)) + body


def remove_flat(flat: Path) -> None:
    with contextlib.suppress(OSError):
        shutil.rmtree(flat)
