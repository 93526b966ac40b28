"""A fetch as a pipeline (restic's restorer): a pool reads coalesced ranges of packs,
decodes and checks each chunk and writes it where it belongs; a thread hashes each file
not listed by its chunks as its written prefix grows. :class:`Reader` is what a fetch
and a lazy restore read chunks with."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import manifest as manifest_mod
from .. import private
from ..errors import SnapshotCorruptError
from ..fileio import fsync_dir, lock_directory, pwrite_all
from ..private import PRIVATE
from ..protocol.progress import ProgressCallback
from . import pack
from .api import ChunkRef, StoreError, corrupt, os_hint, report
from .backend import layout
from .index import Catalog, Index
from .record import Record
from .workers import Bounded


def fetch_into(
    index: Index,
    max_workers: int,
    record: Record,
    dest_dir: Path,
    progress: ProgressCallback | None = None,
    skip: Callable[[str], bool] | None = None,
) -> Path:
    """Rebuild the snapshot directory at ``dest_dir`` (which must not exist), verified.

    Everything is written to a hidden sibling and renamed into place, so ``dest_dir``
    is complete or absent. Files for which ``skip(path)`` is true are left out (a lazy
    restore serves them from :class:`~.images.SnapshotImages` instead).
    """
    dest_dir = Path(dest_dir)
    if dest_dir.exists():
        raise StoreError(
            f"Cannot fetch snapshot {record.manifest.id} to {dest_dir}: it already exists.",
            hint="Remove it or choose another destination.",
        )
    staging = dest_dir.parent / f".{dest_dir.name}.fetching-{uuid.uuid4().hex[:8]}"
    written = staging  # what a failure removes: the hidden sibling, or after the rename
    lock = -1
    try:
        private.make_dirs(staging.parent)
        staging.mkdir(mode=PRIVATE.directory)
        # Locked while it is written (also across the rename, the same directory), so
        # that a clean-up after crashes tells it from one a dead process left.
        lock = lock_directory(staging)
        Download(index, max_workers, record, staging, progress, skip).run()
        with os.fdopen(private.create(staging / manifest_mod.MANIFEST_NAME), "w") as fh:
            fh.write(manifest_mod.manifest_json(record.raw_manifest))
            fh.flush()
            os.fsync(fh.fileno())
        for directory in {staging, *(p.parent for p in staging.rglob("*") if p.is_file())}:
            fsync_dir(directory)
        staging.rename(dest_dir)
        written = dest_dir
        fsync_dir(dest_dir.parent)
    except OSError as exc:
        manifest_mod.remove_tree(written)
        raise StoreError(
            f"Cannot write snapshot {record.manifest.id} to {dest_dir}: {exc}",
            hint=os_hint(exc),
        ) from exc
    except BaseException:
        manifest_mod.remove_tree(written)
        raise
    finally:
        if lock >= 0:
            os.close(lock)
    report(progress, "done", record.manifest.total_bytes, record.manifest.total_bytes)
    return dest_dir


class OrderedHasher:
    """Hashes each file in order as its written prefix grows, on its own thread, so that
    the files' sha256 are ready when the last chunk lands (chunks land out of order)."""

    def __init__(self, fds: list[int], sizes: list[int]) -> None:
        self.fds = fds
        self.sizes = sizes
        self._buffer = bytearray(8 << 20)
        """Read into one buffer, again and again: no fresh memory per read. Not a mapping:
        a mapping of a file on a full tmpfs kills the process with SIGBUS."""
        self._view = memoryview(self._buffer)
        self.digests = [hashlib.sha256() for _ in fds]
        self._ends: list[dict[int, int]] = [{} for _ in fds]
        self._contiguous = [0] * len(fds)
        self._cond = threading.Condition()
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fetch-hasher", daemon=True)
        self._thread.start()

    def written(self, index: int, offset: int, size: int) -> None:
        with self._cond:
            ends = self._ends[index]
            ends[offset] = offset + size
            end = self._contiguous[index]
            while end in ends:
                end = ends.pop(end)
            if end != self._contiguous[index]:
                self._contiguous[index] = end
                self._cond.notify()

    def _run(self) -> None:
        try:
            for index in range(len(self.fds)):
                hashed = 0
                while hashed < self.sizes[index]:
                    with self._cond:
                        while not self._stopped and self._contiguous[index] <= hashed:
                            self._cond.wait()
                        if self._stopped:
                            return
                        end = self._contiguous[index]
                    while hashed < end:
                        step = min(len(self._buffer), end - hashed)
                        got = os.preadv(self.fds[index], [self._view[:step]], hashed)
                        if got <= 0:
                            raise OSError(errno.EIO, "a file being fetched is shorter")
                        self.digests[index].update(self._view[:got])
                        hashed += got
        except OSError as exc:  # raised on the calling thread by result()
            self._error = exc

    def result(self) -> list[str]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return [d.hexdigest() for d in self.digests]

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join()


class Reader:
    """Reads chunks of one record: coalesced ranges, each chunk decoded and checked; a
    chunk whose pack is gone is looked up where a repack put it."""

    def __init__(self, index: Index, record: Record) -> None:
        self.index = index
        self.backend = index.backend
        self.record = record
        self.sealer = None if index.keyring is None else index.keyring.sealer()
        self._catalog: Catalog | None = None
        self._lock = threading.Lock()

    def plan(self, refs: Iterable[ChunkRef]) -> list[list[ChunkRef]]:
        """The reads that serve ``refs`` (given in the order they are wanted), in that order."""
        by_object: dict[str, dict[str, ChunkRef]] = {}
        order: dict[str, int] = {}
        for i, ref in enumerate(refs):
            by_object.setdefault(ref.where.obj, {}).setdefault(ref.hash, ref)
            order.setdefault(ref.hash, i)
        reads = [
            [ref for ref, _ in group]
            for chunks in by_object.values()
            for group in pack.coalesce(
                sorted(((r, r.where) for r in chunks.values()), key=lambda c: c[1].offset)
            )
        ]
        return sorted(reads, key=lambda group: min(order[r.hash] for r in group))

    def read(
        self, group: list[ChunkRef], check: bool = True
    ) -> Iterator[tuple[ChunkRef, bytes | memoryview]]:
        """Each chunk of a planned read with its bytes, decoded; checked (by its tag if
        sealed, else its sha256) unless ``check`` is false (a fetch checks whole files
        instead)."""
        obj = group[0].where.obj
        start = min(r.where.offset for r in group)
        end = max(r.where.offset + r.where.length for r in group)
        data = self.backend.load(layout.object_handle(obj), start, end - start)
        if data is None:
            yield from self._moved(group, check)
            return
        if len(data) != end - start:
            raise self.damaged(group[0], f"{obj} is shorter than its record says")
        view = memoryview(data)
        for ref in group:
            offset = ref.where.offset - start
            yield ref, self._decoded(ref, view[offset : offset + ref.where.length], check)

    def _moved(
        self, group: list[ChunkRef], check: bool
    ) -> Iterator[tuple[ChunkRef, bytes | memoryview]]:
        with self._lock:
            if self._catalog is None or group[0].where.obj in self._catalog.objects:
                self._catalog = self.index.locate_all(also=self.record.summary())
            catalog = self._catalog
        moved = []
        for ref in group:
            where = catalog.resolve(ref)
            if where is None or where.obj == ref.where.obj:
                raise self.damaged(ref, "is missing from the store")
            moved.append(ChunkRef(ref.hash, ref.size, where))
        for read in self.plan(moved):
            yield from self.read(read, check)

    def _decoded(self, ref: ChunkRef, blob: memoryview, check: bool) -> bytes | memoryview:
        try:
            decoder = pack.decode_checked if check else pack.decode
            data = decoder(blob, ref.where.codec, ref.size, ref.hash, self.sealer)
        except ValueError as exc:
            raise self.damaged(ref, str(exc)) from exc
        return data

    def damaged(self, ref: ChunkRef, what: str) -> SnapshotCorruptError:
        path = next(
            (p for p, refs in self.record.chunks.items() if any(r.hash == ref.hash for r in refs)),
            "?",
        )
        return corrupt(self.record.manifest.id, f"chunk {ref.hash[:12]}… of {path} {what}")


class Download:
    """One fetch in one concurrent pass: a pool reads coalesced ranges of packs, decodes
    and checks each chunk and writes it where it belongs; a thread hashes each file not
    listed by its chunks as its written prefix grows, so every file is checked against
    the manifest at the end."""

    def __init__(
        self,
        index: Index,
        max_workers: int,
        record: Record,
        staging: Path,
        progress: ProgressCallback | None,
        skip: Callable[[str], bool] | None = None,
    ) -> None:
        self.index = index
        self.record = record
        self.entries = [e for e in record.manifest.files if skip is None or not skip(e.path)]
        self.total = sum(e.size for e in self.entries)
        self.staging, self.progress, self.max_workers = staging, progress, max_workers
        self.done_bytes = 0
        self._lock = threading.Lock()
        self.targets: dict[str, list[tuple[int, int]]] = {}
        """sha256 -> every (file index, offset) the chunk goes to."""
        self.hashed: dict[int, int] = {}
        """The files hashed whole as they are written: file index -> the hasher's index."""

    def run(self) -> None:
        report(self.progress, "downloading", 0, self.total)
        wanted: list[ChunkRef] = []
        for index, entry in enumerate(self.entries):
            offset = 0
            for ref in self.record.chunks[entry.path]:
                self.targets.setdefault(ref.hash, []).append((index, offset))
                wanted.append(ref)
                offset += ref.size
        fds: list[int] = []
        hasher = None
        reader = Reader(self.index, self.record)
        try:
            for entry in self.entries:
                target = self.staging / manifest_mod.safe_relpath(entry.path)
                private.make_dirs(target.parent)
                fd = private.create(target, os.O_RDWR | os.O_EXCL)
                fds.append(fd)
                os.ftruncate(fd, entry.size)
            # A file listed by its chunks is checked chunk by chunk as they are read (the
            # record holds exactly those); another is hashed whole as it is written.
            whole = [i for i, e in enumerate(self.entries) if e.chunks is None]
            self.hashed = {index: n for n, index in enumerate(whole)}
            hasher = OrderedHasher([fds[i] for i in whole], [self.entries[i].size for i in whole])
            with ThreadPoolExecutor(self.max_workers) as pool:
                tasks = Bounded(pool, self.max_workers)
                try:
                    for group in reader.plan(wanted):
                        for written in tasks.submit(self._fetch, reader, hasher, fds, group):
                            self._progress(written)
                    for written in tasks.drain():
                        self._progress(written)
                except BaseException:
                    tasks.cancel()
                    raise
            digests = hasher.result()
            for index, digest in zip(whole, digests, strict=True):
                if digest != self.entries[index].sha256:
                    raise self._culprit(reader, self.entries[index], fds[index])
            for fd in fds:
                os.fsync(fd)
        finally:
            if hasher is not None:
                hasher.stop()
            for fd in fds:
                os.close(fd)

    def _fetch(
        self,
        reader: Reader,
        hasher: OrderedHasher,
        fds: list[int],
        group: list[ChunkRef],
    ) -> int:
        written = 0
        check = any(e.chunks is not None for e in self.entries)
        for ref, data in reader.read(group, check=check):
            for index, offset in self.targets[ref.hash]:
                pwrite_all(fds[index], data, offset)
                if index in self.hashed:
                    hasher.written(self.hashed[index], offset, ref.size)
                written += ref.size
        return written

    def _culprit(
        self, reader: Reader, entry: manifest_mod.FileEntry, fd: int
    ) -> SnapshotCorruptError:
        """The error for a file whose sha256 is wrong: it names the damaged chunk."""
        offset = 0
        for ref in self.record.chunks[entry.path]:
            data = os.pread(fd, ref.size, offset)
            if hashlib.sha256(data).hexdigest() != ref.hash:
                return reader.damaged(ref, "has the wrong sha256")
            offset += ref.size
        return corrupt(self.record.manifest.id, f"{entry.path} differs from its manifest entry")

    def _progress(self, written: int) -> None:
        self.done_bytes += written
        report(self.progress, "downloading", self.done_bytes, self.total)
