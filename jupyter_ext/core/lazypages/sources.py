"""Where a lazily restored kernel's pages come from: a :class:`PageSource` gives ranges of
its ``pages-N.img`` files (an images directory here, the store's packs, or another
process's source through :mod:`.rangeipc`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..errors import RestoreError

#: (file name, offset, length) of part of an image file.
Range = tuple[str, int, int]


class PageSource(Protocol):
    """Where page contents come from."""

    def read(self, path: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` of the image file ``path`` (e.g. "pages-1.img"),
        verified; raises on any failure (a short read is a failure too)."""
        ...


class PageFetchError(RestoreError):
    """Pages of a lazily restored kernel could not be read from their source."""


@dataclass(frozen=True)
class DirectoryPages:
    """Pages read from a complete images directory on this machine."""

    root: Path

    def read(self, path: str, offset: int, length: int) -> bytes:
        with open(self.root / path, "rb") as fh:
            data = os.pread(fh.fileno(), length, offset)
        if len(data) != length:
            raise OSError(f"{self.root / path}: short read at {offset} ({len(data)} of {length})")
        return data


@dataclass(frozen=True)
class PrefixedPages:
    """A source whose files sit under a folder: the store names them ``images/pages-1.img``."""

    inner: PageSource
    prefix: str

    def read(self, path: str, offset: int, length: int) -> bytes:
        return self.inner.read(self.prefix + path, offset, length)
