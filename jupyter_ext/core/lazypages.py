"""Lazy restore: the restored kernel runs while its memory arrives.

CRIU's ``lazy-pages`` daemon registers the kernel's anonymous memory with userfaultfd;
a page the kernel touches, and then all the others in the background, are asked of a
*page server* (``--page-server --ps-socket FD``). This module is that page server: it
answers CRIU's page-server requests (criu/page-xfer.c: ``PS_IOV_GET`` for a process,
an address and a page count; the answer is a ``PS_IOV_ADD_F`` header and the raw pages)
from a :class:`PageSource` (a local images directory, or the store's packs), so a restore
needs every image *except* ``pages-*.img`` before it starts, and the first cell runs
after a fraction of a second whatever the kernel's size.

Pages that arrive are also written into the local ``pages-N.img`` (a sparse file of the
right size, made by :func:`stage_pages_files`), so the restore ends with complete images
on this machine. A page that cannot be read is retried; then the server stops answering
and reports the error, and the caller kills the half-restored tree (a process whose
userfaultfd goes away would read zeros instead of its memory).
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from . import private
from .criuimages import varint
from .errors import RestoreError, SnapshotCorruptError, SnapshotError
from .manifest import IMAGES_DIR, FileEntry

log = logging.getLogger(__name__)

PAGE_SIZE = mmap.PAGESIZE
IMG_COMMON_MAGIC = 0x54564319
PAGEMAP_MAGIC = 0x56084025
#: pagemap_entry.flags (criu/include/pagemap.h)
PE_PARENT = 1 << 0
PE_LAZY = 1 << 1
PE_PRESENT = 1 << 2

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
FAULT_QUIET = 0.05
#: Largest read when filling gaps after CRIU is done (CRIU itself asks at most 4 MiB).
FILL_CHUNK = 8 << 20


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


# -- a page source in another process -------------------------------------------------
#
# The store is open in the server process; CRIU runs under the kernel's wrapper. The
# server lends the wrapper its source over a unix socket: a request is (path length,
# offset, length) and the path; an answer is (status, size) and the bytes, or the error:
# a SnapshotError as its JSON (status 2, rebuilt on the other side), else its text.

_RANGE_REQUEST = struct.Struct("<HQI")
_RANGE_REPLY = struct.Struct("<BI")
#: ``pages_from`` of a wrapper restore naming a :class:`RangeServer`.
UNIX_PREFIX = "unix:"


class RangeServer:
    """Serves ``source`` on the unix socket ``path`` (one thread per connection) until
    :meth:`close`: to this user only (mode 0600 in a private directory, and each
    connection's SO_PEERCRED: another user's is closed unanswered)."""

    def __init__(self, source: PageSource, path: Path) -> None:
        self.source = source
        self.path = path
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        os.chmod(path, 0o600)
        self._listener.listen()
        self._closed = False
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, name="range-server", daemon=True).start()

    @property
    def address(self) -> str:
        return UNIX_PREFIX + str(self.path)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if not private.trusted_peer(conn):
                log.warning("refused a page request connection from another user")
                conn.close()
                continue
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    head = _recv_exact(conn, _RANGE_REQUEST.size)
                    if head is None:
                        return
                    size, offset, length = _RANGE_REQUEST.unpack(head)
                    name = _recv_exact(conn, size)
                    if name is None:
                        return
                except OSError:
                    return
                try:
                    data = self.source.read(name.decode(), offset, length)
                    status = 0
                except SnapshotError as exc:  # e.g. a damaged chunk: said as it is
                    data, status = json.dumps(exc.to_dict()).encode(), 2
                except Exception as exc:  # noqa: BLE001 -- sent to the reader, which retries
                    data, status = f"{type(exc).__name__}: {exc}".encode(), 1
                try:
                    conn.sendall(_RANGE_REPLY.pack(status, len(data)) + data)
                except OSError:
                    return

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class RemotePages:
    """A :class:`PageSource` served by a :class:`RangeServer` in another process; one
    connection per thread, so prefetching and the kernel's faults go side by side."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()

    def read(self, path: str, offset: int, length: int) -> bytes:
        name = path.encode()
        sock: socket.socket | None = getattr(self._local, "sock", None)
        try:
            if sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._local.sock = sock
                sock.connect(str(self.path))
            sock.sendall(_RANGE_REQUEST.pack(len(name), offset, length) + name)
            head = _recv_exact(sock, _RANGE_REPLY.size)
            if head is None:
                raise OSError("the page source closed the connection")
            status, size = _RANGE_REPLY.unpack(head)
            data = _recv_exact(sock, size) if size else b""
            if data is None:
                raise OSError("the page source closed the connection")
        except OSError:
            if sock is not None:
                sock.close()
            self._local.sock = None  # the next try connects again
            raise
        if status == 2:
            raise SnapshotError.from_dict(json.loads(data))
        if status != 0:
            raise OSError(data.decode(errors="replace"))
        return data


def page_source(spec: str) -> PageSource:
    """The source a wrapper restore's ``pages_from`` names: ``unix:PATH`` (a
    :class:`RangeServer`) or an images directory."""
    if spec.startswith(UNIX_PREFIX):
        return RemotePages(Path(spec[len(UNIX_PREFIX) :]))
    return DirectoryPages(Path(spec))


# -- pagemap-N.img ------------------------------------------------------------------


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
            if flags & PE_PARENT:
                raise ValueError(
                    "pages kept in a parent image (incremental dumps) are not supported"
                )
            present = bool(flags & PE_PRESENT)
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


def stage_pages_files(images_dir: Path, source: PageSource, *, lazy_too: bool = False) -> int:
    """Make each ``pages-N.img`` in ``images_dir`` a sparse file of its full size holding
    only the pages ``criu restore`` reads itself (not lazy: stacks, shared or file
    memory); the lazy ones arrive through :class:`PageServer`. With ``lazy_too`` (a
    restore that cannot be lazy) every page is read here. Returns the bytes read."""
    read = 0
    for pagemap in read_pagemaps(images_dir).values():
        # Never truncated: a source that keeps these files (the server's download) may
        # be writing them already.
        fd = os.open(images_dir / pagemap.pages_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        with open(fd, "r+b") as fh:
            fh.truncate(pagemap.size)
            for entry in pagemap.entries:
                if entry.offset < 0 or (entry.lazy and not lazy_too):
                    continue
                end = entry.offset + entry.nr_pages * PAGE_SIZE
                for offset in range(entry.offset, end, FILL_CHUNK):
                    length = min(FILL_CHUNK, end - offset)
                    data = source.read(pagemap.pages_file, offset, length)
                    if len(data) != length:
                        raise SnapshotCorruptError(
                            f"{pagemap.pages_file} ends before offset {offset + length}.",
                            hint="The snapshot is damaged; pick another one.",
                        )
                    _pwrite_all(fh.fileno(), data, offset)
                    read += length
    return read


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


PAGES_FILE_RE = re.compile(rf"{IMAGES_DIR}/pages-\d+\.img")
"""A snapshot file that holds the kernel's memory (relative to the snapshot directory)."""
LAZY_MIN_BYTES = 768 << 20
"""Below this much memory a kernel restored from local images (the image cache, the work
directory, a suspended kernel) is restored in full: reading its pages files from the page
cache costs less than setting up lazy pages (first output through the REST API, 2 vCPUs,
2026-12-01: 256 MiB 0.40-0.44 s in full against 0.52-0.61 s lazily; 512 MiB 0.49-0.50
against 0.52-0.59; 1 GiB 0.70-0.71 against 0.59-0.62)."""


def pages_bytes(files: Iterable[FileEntry]) -> int:
    """The bytes of memory a snapshot holds: its ``pages-*.img`` files."""
    return sum(entry.size for entry in files if PAGES_FILE_RE.fullmatch(entry.path))


def worth_lazy(gpu: dict[str, object]) -> bool:
    """Whether a kernel is restored lazily at all (given the manifest's ``gpu``): not one
    with CUDA state, whose restore reads all of its memory at once."""
    return not gpu.get("ns_pids")


def restore_order(images_dir: Path) -> tuple[list[Range], list[Range]]:
    """What a restore from ``images_dir`` reads of its pages files, as (file name, offset,
    length): first the ranges ``criu restore`` reads from the files itself (needed before
    it starts), then the lazy ones, the smallest memory areas first (the interpreter's
    heap and stacks, which the first cell touches, before the big arrays)."""
    now: list[Range] = []
    lazy: list[tuple[int, Range]] = []
    for pagemap in read_pagemaps(images_dir).values():
        for entry in pagemap.entries:
            if entry.offset < 0:
                continue
            span = (pagemap.pages_file, entry.offset, entry.nr_pages * PAGE_SIZE)
            if entry.lazy:
                lazy.append((entry.nr_pages, span))
            else:
                now.append(span)
    lazy.sort(key=lambda item: item[0])
    return now, [span for _, span in lazy]


def lazy_ranges(pagemap: Pagemap) -> Iterator[tuple[int, int]]:
    """(offset, length) of the lazy pages of one pages file, as stored."""
    for entry in pagemap.entries:
        if entry.offset >= 0 and entry.lazy:
            yield entry.offset, entry.nr_pages * PAGE_SIZE


# -- the page server ------------------------------------------------------------------


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
            _pwrite_all(self.fd, data, offset)
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
        self.pagemaps = read_pagemaps(images_dir)
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
        self._last_fault = 0.0
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
                header = _recv_exact(sock, _PSI.size)
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
                    self._last_fault = time.monotonic()
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
                quiet = time.monotonic() - self._last_fault
                if quiet < FAULT_QUIET:
                    time.sleep(FAULT_QUIET - quiet)
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


def _recv_exact(sock: socket.socket, size: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            if buf:
                raise OSError("CRIU closed the connection mid-request")
            return None
        buf += chunk
    return bytes(buf)


def total_lazy_bytes(pagemaps: Iterable[Pagemap]) -> int:
    return sum(length for p in pagemaps for _, length in lazy_ranges(p))
