"""The store's public types: what the manager, the CLI and the wrapper see of a store, and
the error shapes every part of the store raises."""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from ..errors import SnapshotCorruptError, SnapshotError
from ..manifest import Manifest
from ..private import Exposed
from ..protocol.progress import Phase, ProgressCallback
from .pack import Location

Progress = ProgressCallback | None
Skip = Callable[[str], bool] | None
"""Which files a fetch leaves out (a lazy restore serves them from ``open_images``)."""


class StoreError(SnapshotError):
    """The store could not be read or written (network, permissions, disk, bucket)."""

    code = "store-error"


class ChunkRef(NamedTuple):
    """One chunk of a file, in file order, and where its put stored it (a tuple of plain
    values, as :class:`pack.Location`)."""

    hash: str
    """sha256 of the uncompressed bytes."""
    size: int
    where: Location


@dataclass
class StoredSnapshot:
    """A complete snapshot in a store."""

    manifest: Manifest
    stored_bytes: int
    """Stored bytes of its distinct chunks (shared ones included)."""
    new_bytes: int
    """Stored bytes the put that stored it actually added."""
    chunk_count: int
    """Distinct chunks."""
    location: str
    """Where its record is: a path or an ``s3://`` URL."""


@dataclass(frozen=True)
class StoreStats:
    snapshot_count: int
    object_count: int
    """Packs (and chunk objects of format-1 records)."""
    stored_bytes: int
    """Bytes of all objects, garbage not yet swept or repacked included."""


Ranges = Iterable[tuple[str, int, int]]
"""(path, offset, length) of a snapshot's files."""


class StoredImages(Protocol):
    """A stored snapshot's files read by range, checked (what a lazy restore serves the
    kernel's memory from). Defined here, low, and implemented by ``images.SnapshotImages``
    above, so that this module names nothing above it."""

    manifest: Manifest

    def read(self, path: str, offset: int, length: int) -> bytes:
        """``length`` bytes of file ``path`` from ``offset`` (fewer at its end)."""
        ...

    def download_into(
        self, directory: Path, paths: Iterable[str], *, now: Ranges = (), first: Ranges = ()
    ) -> None:
        """Keep ``paths`` in ``directory`` too, downloaded in the background."""
        ...

    def wait_downloaded(self) -> bool:
        """Wait for the background download; whether every file is complete."""
        ...

    def close(self) -> None:
        """Stop the download and let go of the local files."""
        ...


class StoreReport(Protocol):
    """What a store check or prune found or did (check.CheckReport, prune.PruneReport)."""

    def to_dict(self) -> dict[str, Any]: ...

    def lines(self) -> list[str]:
        """As a person reads it."""
        ...


class SnapshotStore(Protocol):
    """What the snapshot manager needs from a store."""

    adopts_images: bool
    """Whether a put may adopt a sealed memory image as it is (an image pack): the dump
    should then start writing its images to disk as soon as they are hashed."""

    def put(
        self,
        snapshot_dir: Path,
        progress: ProgressCallback | None = None,
        manifest: Manifest | None = None,
    ) -> StoredSnapshot: ...

    def snapshots(self) -> list[StoredSnapshot]: ...

    def get(self, snapshot_id: str) -> StoredSnapshot: ...

    def fetch(
        self, snapshot_id: str, dest_dir: Path, progress: Progress = None, skip: Skip = None
    ) -> Path: ...

    def open_images(self, snapshot_id: str) -> StoredImages: ...

    def delete(self, snapshot_id: str, *, missing_ok: bool = False) -> None: ...

    def stats(self) -> StoreStats: ...

    def check(self, read_data: bool = False, progress: Progress = None) -> StoreReport:
        """Whether the store is whole (``read_data``: every chunk read and checked too)."""
        ...

    def prune(self) -> StoreReport:
        """Remove what nothing needs; what was removed."""
        ...

    def key_notice(self) -> str:
        """What to tell the user while the store's key would be lost with this machine
        ("" if it would not)."""
        ...

    def close(self) -> None: ...

    def tighten(self) -> list[Exposed]:
        """Take from what the store keeps on this machine the access others have (an
        older version's files); what was changed. Nothing for a remote store."""
        ...


def corrupt(snapshot_id: str, what: str) -> SnapshotCorruptError:
    """The one shape of "this snapshot is damaged" that every part of the store raises."""
    return SnapshotCorruptError(
        f"Snapshot {snapshot_id} is damaged: {what}.",
        hint="Pick another snapshot; this one cannot be restored.",
    )


def report(progress: ProgressCallback | None, phase: Phase, done: int, total: int) -> None:
    if progress is not None:
        progress({"phase": phase, "done_bytes": done, "total_bytes": total})


def os_hint(exc: OSError) -> str:
    """What to do about a failed read or write of a local file."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "Free some disk space (or delete old snapshots), then retry."
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "Check that this user may write there, then retry."
    return "Check the directory and retry."
