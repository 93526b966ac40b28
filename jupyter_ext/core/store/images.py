"""What a lazy restore serves a kernel's memory from: ranges of a stored snapshot's files,
read from the store on demand while a background download completes a local copy."""

from __future__ import annotations

import bisect
import logging
import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import manifest as manifest_mod
from .. import private
from ..fileio import pwrite_all
from ..lazypages.policy import Faults
from .api import ChunkRef, StoreError, corrupt, os_hint
from .fetch import Reader
from .workers import Bounded

logger = logging.getLogger(__name__)

#: Reads of at most this many bytes are a lazily restored kernel's page faults (CRIU asks
#: a page at a time): while they come, downloading stands back (CPU and bandwidth go to
#: the kernel's first cell), for at most MAX_STAND_BACK s before each pack read; it goes
#: on once none came for lazypages.FAULT_QUIET s (lazypages.Faults).
FAULT_BYTES = 32 << 10
MAX_STAND_BACK = 2.0
#: A larger read that misses (CRIU's background transfer, in file order) also reads the
#: missing chunks of this many bytes after it.
READ_AHEAD = 8 << 20


class SnapshotImages:
    """Ranges of a stored snapshot's files, every chunk checked against its sha256: what a
    lazy restore serves the kernel's memory from. Thread-safe.

    Read from the store when asked. After :meth:`download_into`, the files are also kept
    in a local directory that a background download completes, whole packs at a time and
    in the order given (a kernel's small memory areas before its big arrays): a range is
    then read from the local file once its chunks are there, and from the store at once
    (and kept) when they are not yet, so the kernel's page faults never queue behind the
    download, and the restore ends with a complete local copy.
    """

    def __init__(self, reader: Reader, max_workers: int) -> None:
        record = reader.record
        self.manifest = record.manifest
        self._max_workers = max_workers
        self._reader = reader
        self._starts: dict[str, list[int]] = {}
        self._refs = record.chunks
        for path, refs in record.chunks.items():
            starts, offset = [], 0
            for ref in refs:
                starts.append(offset)
                offset += ref.size
            self._starts[path] = starts
        self._lock = threading.Lock()
        self._local: dict[str, tuple[int, bytearray]] = {}
        """Downloaded files: path -> (fd, which of its chunks are in it)."""
        self._targets: dict[str, list[tuple[str, int]]] = {}
        """sha256 -> every (path, chunk index) of a downloaded file it goes to."""
        self._in_use = threading.Condition()
        self._readers = 0
        self._stopping = threading.Event()
        self._faults = Faults()
        self._thread: threading.Thread | None = None
        self.local_copy_error: OSError | None = None
        """Why the local copy was given up (a full disk, say): reads go to the store."""

    def read(self, path: str, offset: int, length: int) -> bytes:
        """``length`` bytes of file ``path`` from ``offset`` (fewer at its end)."""
        with self._in_use:
            self._readers += 1
        try:
            return self._read(path, offset, length)
        finally:
            with self._in_use:
                self._readers -= 1
                self._in_use.notify_all()

    def _read(self, path: str, offset: int, length: int) -> bytes:
        if path not in self._refs:
            raise corrupt(self.manifest.id, f"it has no file {path!r}")
        if length <= FAULT_BYTES:
            self._faults.saw()
        starts, refs = self._starts[path], self._refs[path]
        first = max(bisect.bisect_right(starts, offset) - 1, 0)
        last = bisect.bisect_left(starts, offset + length)
        local = self._local.get(path)
        if local is not None:
            fd, landed = local
            with self._lock:
                missing = [refs[i] for i in range(first, last) if not landed[i]]
                if missing and length > FAULT_BYTES:
                    # A read in file order (CRIU's own background transfer): the next
                    # ones are likely next; read them too, in the same request.
                    ahead, end = last, starts[last - 1] + READ_AHEAD
                    while ahead < len(refs) and starts[ahead] < end:
                        if not landed[ahead]:
                            missing.append(refs[ahead])
                        ahead += 1
            if not missing:  # all in the local file already: one read, no copies
                return os.pread(fd, min(length, self._size(path) - offset), offset)
        else:
            missing = refs[first:last]
        found: dict[str, bytes | memoryview] = {}
        for group in self._reader.plan(missing):
            for ref, data in self._reader.read(group):
                found[ref.hash] = data
                self._keep(ref, data)
        parts: list[bytes | memoryview] = []
        for index in range(first, last):
            ref = refs[index]
            if ref.hash in found:
                parts.append(found[ref.hash])
            elif local is not None:  # in the local file before this read began
                parts.append(os.pread(local[0], ref.size, starts[index]))
        joined = b"".join(parts)
        skip = offset - starts[first] if last > first else 0
        return joined[skip : skip + length]

    def _size(self, path: str) -> int:
        refs = self._refs[path]
        return self._starts[path][-1] + refs[-1].size if refs else 0

    def download_into(
        self,
        directory: Path,
        paths: Iterable[str],
        *,
        now: Iterable[tuple[str, int, int]] = (),
        first: Iterable[tuple[str, int, int]] = (),
    ) -> None:
        """Create ``paths`` under ``directory`` (sparse, at their full size), write the
        ranges ``now`` lists ((path, offset, length): what is read from the files before
        anything asks) before returning, and download the rest in the background: the
        chunks of the ranges ``first`` lists, in that order, then all the others."""
        for path in paths:
            target = directory / manifest_mod.safe_relpath(path)
            private.make_dirs(target.parent)
            fd = private.create(target, os.O_RDWR)
            self._local[path] = (fd, bytearray(len(self._refs[path])))
            os.ftruncate(fd, self._size(path))
            for index, ref in enumerate(self._refs[path]):
                self._targets.setdefault(ref.hash, []).append((path, index))
        for path, offset, length in now:
            self.read(path, offset, length)
        if self.local_copy_error is not None:
            exc = self.local_copy_error
            raise StoreError(
                f"Cannot write snapshot {self.manifest.id} to {directory}: {exc}",
                hint=os_hint(exc),
            )
        wanted: list[ChunkRef] = []
        for path, offset, length in first:
            if path in self._local:
                starts = self._starts[path]
                lo = max(bisect.bisect_right(starts, offset) - 1, 0)
                wanted += self._refs[path][lo : bisect.bisect_left(starts, offset + length)]
        for path in self._local:
            wanted += self._refs[path]
        self._thread = threading.Thread(
            target=self._download, args=(wanted,), name="images-download", daemon=True
        )
        self._thread.start()

    def _keep(self, ref: ChunkRef, data: bytes | memoryview) -> None:
        """Write a checked chunk wherever a downloaded file has it."""
        for path, index in self._targets.get(ref.hash, ()):
            with self._lock:
                if path not in self._local:  # closed meanwhile
                    return
                fd, landed = self._local[path]
                if landed[index] or self.local_copy_error is not None:
                    continue
            try:
                pwrite_all(fd, data, self._starts[path][index])
            except OSError as exc:
                with self._lock:
                    if self.local_copy_error is None:
                        logger.warning("stopped keeping %s locally: %s", path, exc)
                        self.local_copy_error = exc
                return
            with self._lock:
                landed[index] = 1

    def _download(self, wanted: list[ChunkRef]) -> None:
        def fetch(group: list[ChunkRef]) -> None:
            # The kernel's page faults first: while they come, stand back (a while).
            self._faults.stand_back(MAX_STAND_BACK)
            with self._lock:
                group = [r for r in group if not self._landed_everywhere(r)]
            if not group or self._stopping.is_set() or self.local_copy_error is not None:
                return
            try:
                for ref, data in self._reader.read(group):
                    self._keep(ref, data)
            except Exception as exc:  # noqa: BLE001 -- the reads that need those chunks retry
                logger.info("background download of %s: %s", self.manifest.id, exc)

        with ThreadPoolExecutor(self._max_workers) as pool:
            tasks = Bounded(pool, self._max_workers)
            try:
                for group in self._reader.plan(wanted):
                    if self._stopping.is_set():
                        break
                    tasks.submit(fetch, group)
                for _ in tasks.drain():
                    pass
            finally:
                tasks.cancel()

    def _landed_everywhere(self, ref: ChunkRef) -> bool:
        return all(self._local[p][1][i] for p, i in self._targets.get(ref.hash, ()))

    @property
    def downloaded(self) -> bool:
        """Whether every downloaded file is complete (and nothing was given up)."""
        with self._lock:
            return self.local_copy_error is None and all(
                all(landed) for _, landed in self._local.values()
            )

    def wait_downloaded(self) -> bool:
        """Wait for the background download; :attr:`downloaded` after it."""
        if self._thread is not None:
            self._thread.join()
        return self.downloaded

    def close(self) -> None:
        """Stop the background download and let go of the local files (they stay)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            local, self._local, self._targets = self._local, {}, {}
        with self._in_use:  # reads that began before use the fds until they end
            self._in_use.wait_for(lambda: self._readers == 0, timeout=60)
        for fd, _ in local.values():
            os.close(fd)
