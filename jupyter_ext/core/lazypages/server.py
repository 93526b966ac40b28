"""The page server: answers CRIU's ``lazy-pages --page-server`` requests (criu/page-xfer.c:
``PS_IOV_GET`` for a process, an address and a page count; the answer is a
``PS_IOV_ADD_F`` header and the raw pages) from a page source, writing what arrives
through to the local sparse ``pages-N.img`` files."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import SnapshotCorruptError, SnapshotError
from ..fileio import pwrite_all
from .pagemap import (
    PAGE_SIZE,
    PE_PRESENT,
    Pagemap,
    chain_levels,
    lazy_ranges,
    read_flat_pagemaps,
    read_pagemaps,
    total_lazy_bytes,
)
from .policy import Faults
from .rangeipc import recv_exact
from .sources import DirectoryPages, PageFetchError, PageSource

log = logging.getLogger(__name__)

#: struct page_server_iov { u32 cmd; u64 nr_pages; u64 vaddr; u64 dst_id; } (natural alignment)
_PSI = struct.Struct("<I4xQQQ")
PS_IOV_ADD_F = 6
PS_IOV_GET = 7
PS_IOV_CLOSE = 0x1023
PS_IOV_FORCE_CLOSE = 0x1024
PS_CMD_BITS = 16
PS_CMD_MASK = (1 << PS_CMD_BITS) - 1

#: How many times a failed page read is tried, and the pause before each retry.
READ_ATTEMPTS = 4
RETRY_DELAY = 0.25
#: What a page fault fetches from a remote source: the aligned block around the page.
READ_BLOCK = 1 << 20
#: Threads reading ahead of CRIU from a remote source (the store decompresses and
#: hashes outside the GIL).
PREFETCH_WORKERS = 2
#: Requests of at most this many pages are the kernel's faults (CRIU's background
#: transfer starts at 64 KiB); prefetching pauses until none came for FAULT_QUIET s.
FAULT_PAGES = 8
#: Largest read when filling gaps after CRIU is done (CRIU itself asks at most 4 MiB).
FILL_CHUNK = 8 << 20


def stage_pages_files(images_dir: Path, source: PageSource, *, lazy_too: bool = False) -> int:
    """Make each ``pages-N.img`` in ``images_dir`` a sparse file of its full size holding
    only the pages ``criu restore`` reads itself (not lazy: stacks, shared or file
    memory); the lazy ones arrive through :class:`PageServer`. With ``lazy_too`` (a
    restore that cannot be lazy) every page is read here, of every level of a chain
    (core/criu/chain.py: a chain is restored lazily only once flattened). Returns the
    bytes read."""
    read = 0
    for prefix, level in chain_levels(images_dir):
        pagemaps = read_pagemaps(level) if lazy_too else read_flat_pagemaps(level)
        for pagemap in pagemaps.values():
            read += _stage_file(level, prefix + pagemap.pages_file, pagemap, source, lazy_too)
    return read


def _stage_file(
    level: Path, name: str, pagemap: Pagemap, source: PageSource, lazy_too: bool
) -> int:
    # Never truncated: a source that keeps these files (the server's download) may be
    # writing them already.
    read = 0
    path = level / pagemap.pages_file
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    with open(fd, "r+b") as fh:
        fh.truncate(pagemap.size)
        for entry in pagemap.entries:
            if entry.offset < 0 or (entry.lazy and not lazy_too):
                continue
            end = entry.offset + entry.nr_pages * PAGE_SIZE
            for offset in range(entry.offset, end, FILL_CHUNK):
                length = min(FILL_CHUNK, end - offset)
                data = source.read(name, offset, length)
                if len(data) != length:
                    raise SnapshotCorruptError(
                        f"{name} ends before offset {offset + length}.",
                        hint="The snapshot is damaged; pick another one.",
                    )
                pwrite_all(fh.fileno(), data, offset)
                read += length
    return read


class _Landed:
    """Which pages of one local pages file hold their real contents already."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size
        self.pages = bytearray(size // PAGE_SIZE)
        self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        self.failed: OSError | None = None
        """Why the local copy was given up (a full disk, say), if it was."""

    def has(self, offset: int, length: int) -> bool:
        first = offset // PAGE_SIZE
        return all(self.pages[first : first + length // PAGE_SIZE])

    def put(self, offset: int, data: bytes) -> None:
        """Keep ``data`` in the local copy. One that cannot be written is given up: the
        kernel still gets every page from the source; only the local images stay
        incomplete (the restore's status says so)."""
        if self.failed is not None:
            return
        try:
            pwrite_all(self.fd, data, offset)
        except OSError as exc:
            self.failed = exc
            log.warning("stopped keeping %s locally: %s", self.path.name, exc)
            return
        first = offset // PAGE_SIZE
        self.pages[first : first + len(data) // PAGE_SIZE] = b"\1" * (len(data) // PAGE_SIZE)


class PageServer:
    """Answers CRIU's ``lazy-pages --page-server`` on one connected socket.

    ``images_dir`` holds the pagemaps (and, with ``write_through``, the sparse pages files
    from :func:`stage_pages_files`, filled in as pages arrive). ``source`` gives the bytes.
    """

    def __init__(
        self,
        images_dir: Path,
        source: PageSource,
        *,
        write_through: bool,
        attempts: int = READ_ATTEMPTS,
        retry_delay: float = RETRY_DELAY,
    ) -> None:
        self.images_dir = images_dir
        self.source = source
        self.pagemaps = read_flat_pagemaps(images_dir)
        self.attempts = attempts
        self.retry_delay = retry_delay
        self.error: SnapshotError | None = None
        self.pages_served = 0
        self.bytes_served = 0
        self.first_request_at: float | None = None
        self._lock = threading.Lock()
        self._landed: dict[str, _Landed] = {}
        self._source_fds: dict[str, int] = {}
        self._stopping = threading.Event()
        self._faults = Faults()
        self._prefetchers: list[threading.Thread] = []
        if isinstance(source, DirectoryPages) and not write_through:
            # Opened now: the directory may be removed while the kernel still reads from it
            # (a download the restore job cleans up); open files stay readable.
            for pagemap in self.pagemaps.values():
                with contextlib.suppress(OSError):  # read() retries and reports it
                    self._source_fds[pagemap.pages_file] = os.open(
                        source.root / pagemap.pages_file, os.O_RDONLY | os.O_CLOEXEC
                    )
        if write_through:
            for pagemap in self.pagemaps.values():
                landed = _Landed(images_dir / pagemap.pages_file, pagemap.size)
                for entry in pagemap.entries:  # criu restore's own pages: staged already
                    if entry.offset >= 0 and not entry.lazy:
                        first = entry.offset // PAGE_SIZE
                        landed.pages[first : first + entry.nr_pages] = b"\1" * entry.nr_pages
                self._landed[pagemap.pages_file] = landed

    @property
    def lazy_bytes(self) -> int:
        """The bytes of the tree's memory that were to come lazily."""
        return total_lazy_bytes(self.pagemaps.values())

    @property
    def local_copy_error(self) -> str:
        """Why the local images stay incomplete ("" when they are complete or not kept)."""
        return "; ".join(
            f"{name}: {landed.failed.strerror or landed.failed}"
            for name, landed in self._landed.items()
            if landed.failed is not None
        )

    def close(self) -> None:
        self._stopping.set()
        for thread in self._prefetchers:
            thread.join(timeout=30)
        for landed in self._landed.values():
            os.close(landed.fd)
        self._landed.clear()
        for fd in self._source_fds.values():
            os.close(fd)
        self._source_fds.clear()

    def read(self, pages_file: str, offset: int, length: int) -> bytes:
        """Bytes of a pages file: from the local copy when it has them, else from the
        source (retried), written through to the local copy."""
        landed = self._landed.get(pages_file)
        if landed is None:
            return self._fetch(pages_file, offset, length)
        with self._lock:
            if landed.has(offset, length):
                return os.pread(landed.fd, length, offset)
        # A fault asks for one page; the store reads (and checks) whole chunks anyway, and
        # its neighbours are likely next: fetch the aligned block around it, keep it all.
        start = offset - offset % READ_BLOCK
        end = max(offset + length, min(start + READ_BLOCK, landed.size))
        block = self._fetch(pages_file, start, end - start)
        with self._lock:
            landed.put(start, block)
        return block[offset - start : offset - start + length]

    def _local_fd(self, pages_file: str, offset: int, length: int) -> int | None:
        """An fd holding these bytes on this machine: the local copy once they landed,
        or the source's own file when it is a directory here."""
        landed = self._landed.get(pages_file)
        if landed is not None:
            with self._lock:
                return landed.fd if landed.has(offset, length) else None
        fd = self._source_fds.get(pages_file)
        if fd is not None and os.fstat(fd).st_size >= offset + length:
            return fd
        return None

    def _fetch(self, pages_file: str, offset: int, length: int) -> bytes:
        last: BaseException | None = None
        for attempt in range(self.attempts):
            if attempt:
                time.sleep(self.retry_delay * attempt)
            try:
                data = self.source.read(pages_file, offset, length)
            except SnapshotCorruptError as exc:  # no retry brings a damaged chunk back
                raise SnapshotCorruptError(
                    f"The kernel's memory could not be read: {exc.message} "
                    "The half-restored kernel was stopped.",
                    hint=exc.hint,
                ) from exc
            except Exception as exc:  # noqa: BLE001 -- any failure of a source is retried, then reported
                last = exc
                log.warning(
                    "reading %s at %d failed (try %d): %s", pages_file, offset, attempt + 1, exc
                )
                continue
            if len(data) == length:
                return data
            last = OSError(f"got {len(data)} of {length} bytes")
        raise PageFetchError(
            f"The kernel's memory could not be read from the snapshot's source "
            f"({pages_file}, {length} bytes at offset {offset}; tried {self.attempts} times: "
            f"{last}). The half-restored kernel was stopped.",
            hint="Make sure the store is reachable, then restore again; or set "
            "SnapshotExtensionApp.lazy_restore = False so restores copy every file first.",
        )

    def serve(self, sock: socket.socket) -> None:
        """Answer requests until CRIU closes; on a read failure record it and return
        without answering (CRIU keeps the faulting kernel waiting until it is killed)."""
        try:
            while True:
                header = recv_exact(sock, _PSI.size)
                if header is None:
                    return
                cmd, nr_pages, vaddr, dst_id = _PSI.unpack(header)
                op = cmd & PS_CMD_MASK
                if op in (PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE):
                    sock.sendall(struct.pack("<i", 0))
                    return
                if op != PS_IOV_GET:
                    raise PageFetchError(
                        f"CRIU sent an unknown page-server command {cmd:#x}.",
                        hint="Use the CRIU that 'jupyter snapshot doctor' finds (>= 4.2).",
                    )
                if self.first_request_at is None:
                    self.first_request_at = time.monotonic()
                if nr_pages <= FAULT_PAGES:  # a fault; CRIU's background asks from 16 up
                    self._faults.saw()
                pagemap = self.pagemaps.get(dst_id)
                if pagemap is None:
                    raise PageFetchError(
                        f"CRIU asked for pages of process {dst_id}, not in the snapshot."
                    )
                try:
                    offset, count = pagemap.locate(vaddr, nr_pages)
                except KeyError:
                    raise PageFetchError(
                        f"CRIU asked for pages at {vaddr:#x} of process {dst_id}, "
                        "not in the snapshot."
                    ) from None
                length = count * PAGE_SIZE
                reply = _PSI.pack(PS_IOV_ADD_F | (PE_PRESENT << PS_CMD_BITS), count, vaddr, dst_id)
                local = self._local_fd(pagemap.pages_file, offset, length)
                if local is not None:  # in place already: straight from the file, no copy
                    sock.sendall(reply)
                    _sendfile_all(sock, local, offset, length)
                else:
                    data = self.read(pagemap.pages_file, offset, length)
                    sent = sock.sendmsg([reply, data])
                    if sent < len(reply) + len(data):  # interrupted part-way: send the rest
                        sock.sendall((reply + data)[sent:])
                self.pages_served += count
                self.bytes_served += length
        except SnapshotError as exc:
            self.error = exc
        except OSError as exc:
            self.error = PageFetchError(
                f"The connection to CRIU's lazy-pages daemon failed: {exc}."
            )

    def start_prefetch(self, workers: int = PREFETCH_WORKERS) -> None:
        """Read the pages ahead of CRIU, in large blocks from several threads, into the
        local copies (write-through only): CRIU's own background requests (one of at most
        4 MiB at a time) then find them here. Failures are left to the requests that
        need the pages (retried, then reported)."""
        if not self._landed:
            return
        blocks = [
            (pagemap.pages_file, offset, min(FILL_CHUNK, start + length - offset))
            for pagemap in self.pagemaps.values()
            for start, length in lazy_ranges(pagemap)
            for offset in range(start, start + length, FILL_CHUNK)
        ]
        todo = iter(blocks)
        lock = threading.Lock()

        def work() -> None:
            while not self._stopping.is_set():
                # The kernel's page faults come first: stand back while they arrive.
                wait = self._faults.quiet_left()
                if wait > 0:
                    time.sleep(wait)
                    continue
                with lock:
                    item = next(todo, None)
                if item is None:
                    return
                pages_file, offset, size = item
                landed = self._landed.get(pages_file)
                if landed is None:
                    return
                with self._lock:
                    if landed.has(offset, size):
                        continue
                try:
                    data = self.source.read(pages_file, offset, size)
                except Exception as exc:  # noqa: BLE001 -- the demand path retries and reports
                    log.info("prefetch of %s at %d failed: %s", pages_file, offset, exc)
                    continue
                if len(data) == size and not self._stopping.is_set():
                    with self._lock:
                        landed.put(offset, data)

        for _ in range(workers):
            thread = threading.Thread(target=work, name="lazy-prefetch", daemon=True)
            thread.start()
            self._prefetchers.append(thread)

    def fill_gaps(self, progress: Callable[[int], None] | None = None) -> int:
        """Read every page the local copies still lack (pages CRIU never asked for, e.g.
        memory the kernel freed meanwhile), so the images directory ends up complete."""
        filled = 0
        for pages_file, landed in list(self._landed.items()):
            if landed.failed is not None:
                continue
            pagemap = next(p for p in self.pagemaps.values() if p.pages_file == pages_file)
            for start, length in lazy_ranges(pagemap):
                for offset in range(start, start + length, FILL_CHUNK):
                    size = min(FILL_CHUNK, start + length - offset)
                    if landed.has(offset, size):
                        continue
                    self.read(pages_file, offset, size)
                    filled += size
                    if progress is not None:
                        progress(filled)
        return filled


def _sendfile_all(sock: socket.socket, fd: int, offset: int, length: int) -> None:
    end = offset + length
    while offset < end:
        sent = os.sendfile(sock.fileno(), fd, offset, end - offset)
        if sent == 0:
            raise OSError(f"the pages file ends before {end}")
        offset += sent
