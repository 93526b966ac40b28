"""Cut and hash CRIU's memory images while CRIU writes them.

A dump writes each ``pages-N.img`` once, front to back (``splice`` at the file's position,
criu/page-xfer.c), so every byte below a file's current size is final. Cutting those
bytes into the store's content-defined chunks and hashing each chunk as they arrive, on
threads beside CRIU (which uses one core), is the only time a snapshot's memory is ever
hashed: the seal lists the chunks in the manifest, and the store keeps the file by
exactly those chunks without reading them again (manifest.py, "Hashed once"). Before,
the wrapper hashed each file whole and the store hashed it twice more (each chunk, and
the file against the manifest): 1.0 s of a 256 MiB snapshot's 1.03 s (measured
2026-12-01, bench/RESULTS.md).
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .chunking import ChunkParams, iter_chunks
from .manifest import Chunks, FileEntry, chunk_list_digest

#: How often a file that has not grown enough is looked at again (seconds).
POLL_SECONDS = 0.005
#: Chunks go to the hashing threads in batches of about this many bytes.
BATCH_BYTES = 1 << 20


SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int = 0, length: int = 0) -> None:
    """Start writing a file's dirty pages in this range (0: to its end) to disk without
    waiting (sync_file_range), so that a later fsync has little left to wait for."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sync_file_range(fd, ctypes.c_int64(offset), ctypes.c_int64(length), SYNC_FILE_RANGE_WRITE)


class _GrowingFile:
    """A file another process is writing, read in blocks of the size asked for: a read
    waits until that much is there, or returns what is left once the writer is done. A
    block is a mapping of the file's pages (no copy, nothing to reuse): it lives as long
    as views of it are being hashed."""

    def __init__(self, fd: int, done: threading.Event) -> None:
        self.fd = fd
        self.done = done
        self.position = 0

    def read(self, size: int) -> memoryview:
        while True:
            writer_done = self.done.is_set()  # read before the size: nothing comes after
            available = os.fstat(self.fd).st_size - self.position
            if available >= size or writer_done:
                break
            self.done.wait(POLL_SECONDS)
        size = min(size, max(available, 0))
        if not size:
            return memoryview(b"")
        # Blocks are whole pages (chunking.py): each starts where a mapping can.
        block = mmap.mmap(self.fd, size, prot=mmap.PROT_READ, offset=self.position)
        self.position += size
        return memoryview(block)


class _Slots:
    """How many batches may be hashed at once: one while CRIU writes (the other core is
    CRIU's: more hashing threads made the kernel's freeze 0.19 s -> 0.28 s at 256 MiB),
    every core once it is done."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._limit = 1
        self._busy = 0

    def open_all(self) -> None:
        with self._cond:
            self._limit = os.cpu_count() or 2
            self._cond.notify_all()

    def hash_all(self, batch: list[bytes | memoryview]) -> list[tuple[str, int]]:
        with self._cond:
            self._cond.wait_for(lambda: self._busy < self._limit)
            self._busy += 1
        try:
            return [(hashlib.sha256(data).hexdigest(), len(data)) for data in batch]
        finally:
            with self._cond:
                self._busy -= 1
                self._cond.notify()


class GrowingFileChunker:
    """Cuts and hashes the files matching ``pattern`` in ``directory`` as they grow (a
    thread each), until :meth:`finish` (called once the writer is done) returns their
    manifest entries, with paths relative to ``root``. With ``write_back``, the files
    start going to disk as soon as the writer is done (a local store adopts the images as
    they are: their fsync then finds little left to write)."""

    def __init__(
        self,
        root: Path,
        directory: Path,
        params: ChunkParams,
        pattern: str = "pages-*.img",
        *,
        write_back: bool = False,
    ) -> None:
        self.root = root
        self.write_back = write_back
        self.directory = directory
        self.params = params
        self.pattern = pattern
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._files: dict[str, tuple[int, threading.Thread]] = {}
        self._chunks: dict[str, Chunks] = {}
        self._errors: dict[str, BaseException] = {}
        self._pool = ThreadPoolExecutor(os.cpu_count() or 2, thread_name_prefix="chunk-hash")
        """Hashes the chunks: one thread cuts a file, the pool hashes its chunks."""
        self._slots = _Slots()
        self._watcher = threading.Thread(target=self._watch, name="chunker-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while True:
            writer_done = self._done.is_set()  # read before the last look
            try:
                for path in self.directory.glob(self.pattern):
                    if path.name not in self._files:
                        self._start(path)
            except OSError as exc:  # the seal hashes what was not cut here
                self._errors[""] = exc
                return
            if writer_done:
                return
            self._done.wait(POLL_SECONDS)

    def _start(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        thread = threading.Thread(
            target=self._cut, args=(path.name, fd), name=f"chunker-{path.name}", daemon=True
        )
        self._files[path.name] = (fd, thread)
        thread.start()

    def _cut(self, name: str, fd: int) -> None:
        batches: list[Future[list[tuple[str, int]]]] = []
        batch: list[bytes | memoryview] = []
        batch_bytes = 0
        try:
            for data in iter_chunks(_GrowingFile(fd, self._done), self.params):
                batch.append(data)
                batch_bytes += len(data)
                if batch_bytes >= BATCH_BYTES:
                    batches.append(self._pool.submit(self._slots.hash_all, batch))
                    batch, batch_bytes = [], 0
            if batch:
                batches.append(self._pool.submit(self._slots.hash_all, batch))
            chunks: Chunks = [chunk for done in batches for chunk in done.result()]
        except (OSError, ValueError) as exc:
            with self._lock:
                self._errors[name] = exc
            return
        with self._lock:
            self._chunks[name] = chunks

    def finish(self) -> dict[str, FileEntry]:
        """Once the writer is done: the entry of each file cut to its end, by its path (a
        file that could not be cut is left out: the seal hashes it whole)."""
        self._done.set()
        self._slots.open_all()
        self._watcher.join()
        if self.write_back:  # not before: beside CRIU it made the kernel's freeze 55 % longer
            for fd, _ in self._files.values():
                start_writeback(fd)
        out: dict[str, FileEntry] = {}
        for name, (fd, thread) in self._files.items():
            thread.join()
            chunks = self._chunks.get(name)
            size = os.fstat(fd).st_size
            os.close(fd)
            if chunks is not None and sum(n for _, n in chunks) == size:
                rel = (self.directory / name).relative_to(self.root).as_posix()
                out[rel] = FileEntry(rel, size, chunk_list_digest(chunks), chunks)
        self._files.clear()
        self._pool.shutdown()
        return out

    def cancel(self) -> None:
        """Stop without entries (the dump failed)."""
        self.finish()
