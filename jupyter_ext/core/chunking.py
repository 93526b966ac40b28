"""Page-aligned content-defined chunking of CRIU images.

CRIU's ``pages-N.img`` hold page-aligned memory. Between two snapshots of one kernel whole
pages appear and disappear, so fixed offsets shift and fixed-size chunks stop matching.
Here a chunk may only end at a page boundary, and it ends where the page's crc32 has its
low bits zero: the cut points move with the content, and a change only touches the chunks
around it. crc32 is cheap (zlib runs it without the GIL held) and needs nothing outside
the standard library.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

PAGE_SIZE = 4096


@dataclass(frozen=True)
class ChunkParams:
    """Chunk sizes, in bytes: all multiples of the page size.

    A page ends a chunk once the chunk holds ``min_size``, when its crc32 is 0 modulo
    ``normal_size / PAGE_SIZE`` (a power of two), and always at ``max_size``. Chunks then
    average about ``min_size + normal_size``; the defaults give ~1.25 MiB.
    """

    min_size: int = 256 * 1024
    normal_size: int = 1024 * 1024
    max_size: int = 4 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("min_size", "normal_size", "max_size"):
            value = getattr(self, name)
            if value <= 0 or value % PAGE_SIZE:
                raise ValueError(f"{name} must be a positive multiple of {PAGE_SIZE}, not {value}")
        pages = self.normal_size // PAGE_SIZE
        if pages & (pages - 1):
            raise ValueError(f"normal_size must be a power-of-two number of pages, not {pages}")
        if not self.min_size <= self.max_size:
            raise ValueError("min_size must not exceed max_size")


def iter_chunks(fh: BinaryIO, params: ChunkParams) -> Iterator[bytes | memoryview]:
    """Split a file into chunks; most come back as zero-copy views of the read blocks.

    Reading ``4 * max_size`` at a time keeps the per-page Python loop the only per-page
    cost; pages below ``min_size`` are skipped without hashing.
    """
    mask = params.normal_size // PAGE_SIZE - 1
    min_pages = params.min_size // PAGE_SIZE
    max_pages = params.max_size // PAGE_SIZE
    parts: list[memoryview] = []  # the current chunk's pieces, from earlier blocks
    pages = 0  # pages in the current chunk so far
    while block := fh.read(4 * params.max_size):
        view = memoryview(block)
        start = offset = 0
        while offset < len(view):
            if pages < min_pages - 1:
                skip = min(min_pages - 1 - pages, -(-(len(view) - offset) // PAGE_SIZE))
                pages += skip
                offset += skip * PAGE_SIZE
                continue
            end = offset + PAGE_SIZE
            pages += 1
            if pages >= max_pages or not zlib.crc32(view[offset:end]) & mask:
                parts.append(view[start:end])
                yield _join(parts)
                parts, pages, start = [], 0, end
            offset = end
        if start < len(view):
            parts.append(view[start:])
    if parts:
        yield _join(parts)


def _join(parts: list[memoryview]) -> bytes | memoryview:
    return parts[0] if len(parts) == 1 else b"".join(parts)
