"""CRIU's ``pagemap-N.img``: which runs of a process's pages are where in ``pages-N.img``,
and which of them CRIU leaves to the lazy-pages daemon."""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..criu.images import varint
from ..errors import SnapshotCorruptError

PAGE_SIZE = mmap.PAGESIZE
IMG_COMMON_MAGIC = 0x54564319
PAGEMAP_MAGIC = 0x56084025
#: pagemap_entry.flags (criu/include/pagemap.h)
PE_PARENT = 1 << 0
PE_LAZY = 1 << 1
PE_PRESENT = 1 << 2


@dataclass(frozen=True)
class PagemapEntry:
    """A run of pages of one process: where it is mapped, and where in pages-N.img."""

    vaddr: int
    nr_pages: int
    flags: int
    offset: int  # in the pages file; -1 when the pages are not in it

    @property
    def end(self) -> int:
        return self.vaddr + self.nr_pages * PAGE_SIZE

    @property
    def lazy(self) -> bool:
        return bool(self.flags & PE_LAZY)


@dataclass
class Pagemap:
    """A decoded ``pagemap-N.img``."""

    pages_id: int
    entries: list[PagemapEntry] = field(default_factory=list)

    @property
    def pages_file(self) -> str:
        return f"pages-{self.pages_id}.img"

    @property
    def size(self) -> int:
        """The size of the pages file this pagemap describes."""
        return sum(e.nr_pages for e in self.entries if e.offset >= 0) * PAGE_SIZE

    @property
    def in_parent(self) -> bool:
        """Whether some runs are left to a parent level (an incremental dump's: a lazy
        restore flattens the chain first, core/lazypages/chain.py)."""
        return any(e.flags & PE_PARENT for e in self.entries)

    def locate(self, vaddr: int, nr_pages: int) -> tuple[int, int]:
        """(offset in the pages file, pages available there) for a run starting at
        ``vaddr``: at most ``nr_pages``, never past the entry it starts in."""
        for entry in self.entries:
            if entry.vaddr <= vaddr < entry.end and entry.offset >= 0:
                skip = (vaddr - entry.vaddr) // PAGE_SIZE
                return entry.offset + skip * PAGE_SIZE, min(nr_pages, entry.nr_pages - skip)
        raise KeyError(vaddr)


def _fields(message: bytes) -> dict[int, int]:
    """The varint fields of a protobuf message (all pagemap fields are varints)."""
    out: dict[int, int] = {}
    pos = 0
    while pos < len(message):
        key, pos = varint(message, pos)
        if key & 7 != 0:
            raise ValueError(f"unexpected wire type {key & 7} in a pagemap entry")
        out[key >> 3], pos = varint(message, pos)
    return out


def parse_pagemap(data: bytes, name: str = "pagemap") -> Pagemap:
    """Decode a pagemap image: magic, then length-prefixed protobuf messages, the first a
    ``pagemap_head`` (pages_id), the others ``pagemap_entry`` (images/pagemap.proto)."""
    try:
        magic, kind = struct.unpack_from("<II", data, 0)
        if magic != IMG_COMMON_MAGIC or kind != PAGEMAP_MAGIC:
            raise ValueError("not a CRIU pagemap image")
        messages: list[bytes] = []
        pos = 8
        while pos < len(data):
            (size,) = struct.unpack_from("<I", data, pos)
            pos += 4
            if pos + size > len(data):
                raise ValueError("truncated entry")
            messages.append(data[pos : pos + size])
            pos += size
        if not messages:
            raise ValueError("no pagemap head")
        pagemap = Pagemap(pages_id=_fields(messages[0]).get(1, 0))
        offset = 0
        for message in messages[1:]:
            f = _fields(message)
            nr_pages = f.get(5, f.get(2, 0))
            flags = f.get(4, PE_PARENT if f.get(3) else PE_PRESENT)
            present = bool(flags & PE_PRESENT) and not flags & PE_PARENT
            pagemap.entries.append(
                PagemapEntry(f.get(1, 0), nr_pages, flags, offset if present else -1)
            )
            if present:
                offset += nr_pages * PAGE_SIZE
    except (ValueError, struct.error, IndexError) as exc:
        raise SnapshotCorruptError(
            f"The snapshot's {name} cannot be read: {exc}.",
            hint="The snapshot is damaged or was not written by CRIU; restore another one.",
        ) from exc
    return pagemap


def read_pagemaps(images_dir: Path) -> dict[int, Pagemap]:
    """Every process's pagemap in ``images_dir``, by the process id CRIU asks with."""
    maps: dict[int, Pagemap] = {}
    for path in images_dir.glob("pagemap-*.img"):
        suffix = path.name[len("pagemap-") : -len(".img")]
        if suffix.isdigit():
            maps[int(suffix)] = parse_pagemap(path.read_bytes(), path.name)
    return maps


def chain_levels(images_dir: Path) -> list[tuple[str, Path]]:
    """The levels of an images directory (one, unless it is a chain: core/criu/chain.py),
    newest first: each its path prefix relative to ``images_dir`` and its directory."""
    levels = [("", images_dir)]
    while (levels[-1][1] / "parent").is_dir():
        prefix, here = levels[-1]
        levels.append((f"{prefix}parent/", here / "parent"))
    return levels


def read_flat_pagemaps(images_dir: Path) -> dict[int, Pagemap]:
    """:func:`read_pagemaps` of a directory whose pages are all its own: refused, naming
    the cause, for a level of a chain (those are flattened first)."""
    maps = read_pagemaps(images_dir)
    if any(p.in_parent for p in maps.values()):
        raise SnapshotCorruptError(
            f"{images_dir} leaves pages to a parent level: it must be flattened "
            "(core/lazypages/chain.py) before its pages are served.",
            hint="This is a bug of jupyter-kernel-snapshots; restore without lazy_restore.",
        )
    return maps


def lazy_ranges(pagemap: Pagemap) -> Iterator[tuple[int, int]]:
    """(offset, length) of the lazy pages of one pages file, as stored."""
    for entry in pagemap.entries:
        if entry.offset >= 0 and entry.lazy:
            yield entry.offset, entry.nr_pages * PAGE_SIZE


def total_lazy_bytes(pagemaps: Iterable[Pagemap]) -> int:
    return sum(length for p in pagemaps for _, length in lazy_ranges(p))
