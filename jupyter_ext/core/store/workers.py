"""Small pieces the put and fetch pipelines share: a bounded pool in order, a file read as
slices of a mapping."""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO, TypeVar

_T = TypeVar("_T")


class Bounded:
    """Runs tasks on a pool with at most ``limit`` in flight; results come back in order.

    The bound keeps memory at a few chunks (or packs) a worker; taking results in order
    lets the calling thread alone place chunks and report progress.
    """

    def __init__(self, pool: ThreadPoolExecutor, limit: int) -> None:
        self._pool = pool
        self._limit = limit
        self._pending: deque[Future[Any]] = deque()

    def submit(self, fn: Callable[..., _T], *args: Any) -> list[_T]:
        """Queue a task; return the results of the oldest tasks that had to finish first."""
        self._pending.append(self._pool.submit(fn, *args))
        done = []
        while len(self._pending) > self._limit:
            done.append(self._pending.popleft().result())
        return done

    def drain(self) -> Iterator[Any]:
        while self._pending:
            yield self._pending.popleft().result()

    def cancel(self) -> None:
        for future in self._pending:
            future.cancel()
        for future in self._pending:  # let running ones end before their files go
            with contextlib.suppress(BaseException):
                future.exception()
        self._pending.clear()


def sha256_hex(data: memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


class MappedFile:
    """A file read as slices of a read-only mapping: no fresh memory for each block read
    (first-touch page faults cost ~3 ms a MB on these VMs), and the chunks handed on are
    views of the page cache. The mapping lives as long as any view of it."""

    def __init__(self, fh: BinaryIO) -> None:
        size = os.fstat(fh.fileno()).st_size
        self.view = memoryview(b"")
        if size:
            mapped = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
            mapped.madvise(mmap.MADV_SEQUENTIAL)
            self.view = memoryview(mapped)
        self._pos = 0

    def read(self, size: int) -> memoryview:
        piece = self.view[self._pos : self._pos + size]
        self._pos += len(piece)
        return piece
