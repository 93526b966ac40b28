"""Where snapshots are kept: a local directory or an S3 bucket, in one format.

Layout under a store's root (a directory, or ``<bucket>/<prefix>``)::

    packs/<hh>/<name>       chunks of image files back to back, each zstd-compressed or raw,
                            with a trailer listing them (``packs.py``); about 16 MiB each
    packs/<hh>/<name>.img   a local store's image pack: a memory image adopted whole (a
                            hard link of the sealed file, no copy), raw, no trailer
    snapshots/<id>.json     the snapshot's record: its manifest, and where each chunk of
                            each file is (pack, offset, length, codec, sha256)
    puts/<token>.json       a claim: a put in progress, listing the packs it relies on
    puts/<token>.cleaning   a clean-up in progress (who runs it: host, pid, start time)
    chunks/<hh>/<sha256>    record format 1 only (one object per chunk): still read

Images are cut with page-aligned content-defined chunking (``chunking.py``), so successive
snapshots of one kernel share most chunks; a chunk the store already holds is not stored
again. The memory images come cut and hashed (the wrapper did it during the dump, and
their manifest entries list the chunks: manifest.py) and are stored by exactly those
chunks. A put cuts, hashes, compresses, packs and uploads in one pipeline and writes the
record last, without overwriting (S3: ``If-None-Match: *``; locally: a hard link), so a
snapshot is listed complete or not at all. A fetch reads each pack's needed ranges in
one request, coalesced, and checks every chunk's sha256 and every file's.

Clean-up (restic's prune, with claims for its locks): a put keeps a claim listing the
packs it wrote or reuses, rewritten every ``claim_refresh_seconds``; a clean-up first
writes its own marker, then reads the claims, then the records, and spares every pack a
live claim lists. A put publishes its whole list before it commits, waits while any
clean-up marker is fresh, and only then checks that all its packs still exist; a chunk
whose pack a clean-up removed after all is found where a repack moved it, or uploaded
again. A failed put removes at once the packs nothing else needs; packs of a claim nobody
refreshed for ``claim_stale_seconds`` (a killed put) go the same way at the next put or
delete. A delete also removes unreferenced packs past the grace period, and repacks packs
that are mostly garbage (only while no other clean-up runs): their live chunks are copied
into new packs, then they are deleted. Records are never rewritten: a reader whose pack
is gone finds the chunk through the trailers of the packs no record names.
"""

from __future__ import annotations

import abc
import bisect
import builtins
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import mmap
import os
import re
import shutil
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple, NoReturn, Protocol, TypeVar

from . import manifest as manifest_mod
from . import packs, private, proctree
from .chunking import ChunkParams, auto_chunk_kib, iter_chunks
from .errors import SnapshotCorruptError, SnapshotError, SnapshotNotFoundError
from .growinghash import start_writeback
from .humanize import human_bytes
from .manifest import Manifest
from .packs import Location
from .private import PRIVATE, Exposed, Modes
from .protocol import Phase, ProgressCallback

logger = logging.getLogger(__name__)

RECORD_FORMAT = 2
"""Records that locate chunks in packs. Format 1 (a chunk an object) is still read."""
DEFAULT_GRACE_SECONDS = 3600.0
REPACK_BELOW = 0.5
"""A pack older than the grace period is rewritten once less than this share of it is
still needed (restic's prune repacks on a similar share of unused bytes)."""
COALESCE_GAP = 1024 * 1024
"""Ranges of one pack closer than this are read in one request (the gap is read too)."""
MAX_READ = 32 * 1024 * 1024
CLAIM_REFRESH_SECONDS = 30.0
"""How often a put rewrites its claim, and a clean-up its marker (heartbeats)."""
CLAIM_STALE_SECONDS = 600.0
"""A claim not rewritten for this long belongs to a put that was killed."""
MARKER_REFRESH_SECONDS = 5.0
"""How often a clean-up rewrites its marker."""
MARKER_STALE_SECONDS = 6 * MARKER_REFRESH_SECONDS
"""A clean-up marker not rewritten for this long belongs to a clean-up that was killed (a
clean-up stops deleting once its own heartbeat is half this old). Puts wait while a
marker is fresh; one whose process is gone from this host is ignored at once."""
ADOPT_NEW_SHARE = 0.75
"""A local store adopts a memory image whole (an image pack) when at least this share of
its bytes is new to the store (a kernel's first snapshot), and compressing it would save
less than ADOPT_MAX_SAVING: then nothing is copied (0.1 s for 300 MB here) and the dump's
own writeback makes it durable, for at most that much more disk. A mostly known image has
its few new chunks copied into packs, a compressible one is compressed."""
ADOPT_MAX_SAVING = 1 / 3
"""Kernels of numbers save 15-25 % (random floats ~8 %, their Python heap much more):
adopted; heap-dominated small kernels save more than half: compressed."""
ADOPT_SAMPLES = 64
"""Chunks compressed to tell how well an image compresses (spread over the file)."""
PUTS_DIR = "puts"
BATCH_BYTES = 1 << 20
"""Chunks go to the hashing workers in batches of about this many bytes."""
REPORT_EVERY = 4 << 20
"""Progress is reported every this many bytes (or every 0.5 %, whichever is more)."""
REUPLOAD_ROUNDS = 3
#: Reads of at most this many bytes are a lazily restored kernel's page faults (CRIU asks
#: a page at a time): while they come, downloading stands back (CPU and bandwidth go to
#: the kernel's first cell), for at most MAX_STAND_BACK s before each pack read; it goes
#: on once none came for FAULT_QUIET s.
FAULT_BYTES = 32 << 10
FAULT_QUIET = 0.05
MAX_STAND_BACK = 2.0
#: A larger read that misses (CRIU's background transfer, in file order) also reads the
#: missing chunks of this many bytes after it.
READ_AHEAD = 8 << 20
"""A put uploads again the chunks a concurrent clean-up removed, this many times at most."""

_HASH_RE = re.compile(r"^[0-9a-f]{64}$")
_T = TypeVar("_T")
_Piece = tuple[bytes | memoryview, str | None, bool]
"""A chunk to store: its bytes, the sha256 its manifest entry gives (if any), and whether
that is trusted (the file is as it was sealed)."""
_Prepared = tuple[str, int, bytes | memoryview | None, packs.Codec]
"""A chunk ready to place: sha256, size, the blob to store (None: the store has it), codec."""


class StoreError(SnapshotError):
    """The store could not be read or written (network, permissions, disk, bucket)."""

    code = "store-error"


class ChunkRef(NamedTuple):
    """One chunk of a file, in file order, and where its put stored it (a tuple of plain
    values, as :class:`packs.Location`)."""

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


class SnapshotStore(Protocol):
    """What the snapshot manager needs from a store."""

    adopts_images: bool
    """Whether a put may adopt a sealed memory image as it is (an image pack): the dump
    should then start writing its images to disk as soon as they are hashed."""

    def put(
        self, snapshot_dir: Path, progress: ProgressCallback | None = None
    ) -> StoredSnapshot: ...

    def list(self) -> builtins.list[StoredSnapshot]: ...

    def get(self, snapshot_id: str) -> StoredSnapshot: ...

    def fetch(
        self,
        snapshot_id: str,
        dest_dir: Path,
        progress: ProgressCallback | None = None,
        skip: Callable[[str], bool] | None = None,
    ) -> Path: ...

    def open_images(self, snapshot_id: str) -> SnapshotImages: ...

    def delete(self, snapshot_id: str, *, missing_ok: bool = False) -> None: ...

    def stats(self) -> StoreStats: ...

    def close(self) -> None: ...

    def tighten(self) -> builtins.list[Exposed]:
        """Take from what the store keeps on this machine the access others have (an
        older version's files); what was changed. Nothing for a remote store."""
        ...


class _ObjectStat(NamedTuple):
    size: int
    mtime: float
    """Seconds since the epoch; the store's clock (S3's LastModified)."""


@dataclass(frozen=True)
class _Record:
    raw_manifest: dict[str, Any]
    """As read from manifest.json: written back unchanged by fetch."""
    manifest: Manifest
    chunks: dict[str, builtins.list[ChunkRef]]
    stored_bytes: int
    new_bytes: int
    chunk_kib: int | None = None
    """The chunk size the snapshot was cut with (None in records from before it was kept)."""

    def objects(self) -> set[str]:
        return {ref.where.obj for refs in self.chunks.values() for ref in refs}

    def distinct(self) -> dict[str, ChunkRef]:
        """hash -> the first ref of each distinct chunk."""
        found: dict[str, ChunkRef] = {}
        for refs in self.chunks.values():
            for ref in refs:
                found.setdefault(ref.hash, ref)
        return found

    def to_json(self) -> bytes:
        objects = sorted(self.objects())
        index = {name: i for i, name in enumerate(objects)}
        return json.dumps(
            {
                "format": RECORD_FORMAT,
                "manifest": self.raw_manifest,
                "objects": objects,
                "chunks": {
                    path: [
                        (
                            r.hash,
                            r.size,
                            index[r.where.obj],
                            r.where.offset,
                            r.where.length,
                            r.where.codec,
                        )
                        for r in refs
                    ]
                    for path, refs in self.chunks.items()
                },
                "stored_bytes": self.stored_bytes,
                "new_bytes": self.new_bytes,
                "chunk_kib": self.chunk_kib,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def parse(cls, snapshot_id: str, data: bytes) -> _Record:
        """Check everything that later becomes a path or a key: records may be tampered with."""
        try:
            doc = json.loads(data)
            version = doc.get("format")
            if isinstance(version, int) and version > RECORD_FORMAT:
                raise SnapshotCorruptError(
                    f"Snapshot {snapshot_id} was stored by a newer version of "
                    f"jupyter-kernel-snapshots (record format {version}; this one reads "
                    f"formats 1 and {RECORD_FORMAT}).",
                    hint="Upgrade jupyter-kernel-snapshots on this server to restore it.",
                )
            manifest = Manifest.from_dict(doc["manifest"])
            if manifest.id != snapshot_id:
                raise ValueError(f"it holds the manifest of {manifest.id}")
            if version == RECORD_FORMAT:
                chunks = _parse_chunks(doc)
            elif version == 1:
                chunks = _parse_format_1_chunks(doc)
            else:
                raise ValueError(f"record format {version!r}")
            _check_chunk_map(manifest, chunks)
            chunk_kib = doc.get("chunk_kib")
            return cls(
                doc["manifest"],
                manifest,
                chunks,
                int(doc["stored_bytes"]),
                int(doc["new_bytes"]),
                None if chunk_kib is None else int(chunk_kib),
            )
        except SnapshotCorruptError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            raise SnapshotCorruptError(
                f"The store's record of snapshot {snapshot_id} is damaged: {exc}",
                hint="Delete this snapshot and pick another one.",
            ) from exc


def _parse_chunks(doc: dict[str, Any]) -> dict[str, builtins.list[ChunkRef]]:
    objects = [str(name) for name in doc["objects"]]
    if not all(packs.is_object_name(name) for name in objects):
        raise ValueError("it names an object outside the store's layout")
    chunks = {}
    for path, rows in doc["chunks"].items():
        refs = []
        for digest, size, obj, offset, length, codec in rows:
            if codec not in packs.CODECS or isinstance(obj, bool) or int(obj) < 0:
                raise ValueError(f"a chunk of {path} is malformed")
            where = Location(objects[int(obj)], int(offset), int(length), codec)
            refs.append(ChunkRef(str(digest), int(size), where))
        chunks[str(path)] = refs
    return chunks


def _parse_format_1_chunks(doc: dict[str, Any]) -> dict[str, builtins.list[ChunkRef]]:
    """Format 1: each chunk is its own zstd object ``chunks/<hh>/<sha256>``."""
    return {
        str(path): [
            ChunkRef(
                str(c["hash"]),
                int(c["size"]),
                Location(packs.legacy_chunk_name(str(c["hash"])), 0, int(c["stored_size"]), "zstd"),
            )
            for c in refs
        ]
        for path, refs in doc["chunks"].items()
    }


def _check_chunk_map(manifest: Manifest, chunks: dict[str, builtins.list[ChunkRef]]) -> None:
    """A file whose manifest entry lists its chunks is stored by exactly those: each chunk
    checked as it is read then checks the file."""
    expected = {entry.path: entry for entry in manifest.files}
    if set(chunks) != set(expected) or len(expected) != len(manifest.files):
        raise ValueError("its chunk lists do not match the manifest's files")
    for path, refs in chunks.items():
        manifest_mod.safe_relpath(path)
        if sum(r.size for r in refs) != expected[path].size:
            raise ValueError(f"the chunks of {path} do not add up to its size")
        listed = expected[path].chunks
        if listed is not None and [(r.hash, r.size) for r in refs] != listed:
            raise ValueError(f"the chunks of {path} are not those of its manifest entry")
        for ref in refs:
            where = ref.where
            if (
                not _HASH_RE.match(ref.hash)
                or ref.size <= 0
                or where.offset < 0
                or where.length <= 0
                or not packs.is_object_name(where.obj)
                or (where.codec == "raw" and where.length != ref.size)
            ):
                raise ValueError(f"a chunk of {path} is malformed")


class _Catalog:
    """Where the chunks of the given records are now, in the objects that exist.

    A record's own location wins while its object exists; a chunk whose object is gone
    (a repack moved it) is looked up in the trailers of the packs no record names.
    """

    def __init__(
        self,
        store: _ChunkStore,
        records: Iterable[_Record],
        objects: dict[str, _ObjectStat] | None = None,
        wanted: Iterable[str] = (),
    ) -> None:
        """``wanted``: more chunks to look for (a put's, whose pack went meanwhile)."""
        self.objects = store._list_all_objects() if objects is None else objects
        self.located: dict[str, Location] = {}
        named: set[str] = set()
        lost: set[str] = set()
        for record in records:
            for refs in record.chunks.values():
                for ref in refs:
                    named.add(ref.where.obj)
                    if ref.where.obj in self.objects:
                        self.located.setdefault(ref.hash, ref.where)
                    else:
                        lost.add(ref.hash)
        lost = (lost | set(wanted)) - self.located.keys()
        # Packs no record names are where repacks put chunks; a later put may have reused
        # some chunks of such a pack (and named it) but not others: those are looked for
        # in the named packs too, last.
        unnamed = sorted(set(self.objects) - named)
        for name in [*unnamed, *sorted(set(self.objects) & named)]:
            if not lost:
                break
            if packs.PACK_NAME_RE.match(name):
                for entry in store._trailer(name, self.objects[name].size):
                    if entry.hash in lost:
                        self.located[entry.hash] = entry.where
                        lost.discard(entry.hash)

    def resolve(self, ref: ChunkRef) -> Location | None:
        if ref.where.obj in self.objects:
            return ref.where
        return self.located.get(ref.hash)


class _Bounded:
    """Runs tasks on a pool with at most ``limit`` in flight; results come back in order.

    The bound keeps memory at a few chunks (or packs) a worker; taking results in order
    lets the calling thread alone place chunks and report progress.
    """

    def __init__(self, pool: ThreadPoolExecutor, limit: int) -> None:
        self._pool = pool
        self._limit = limit
        self._pending: deque[Future[Any]] = deque()

    def submit(self, fn: Callable[..., _T], *args: Any) -> builtins.list[_T]:
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


class _ChunkStore(abc.ABC):
    """The format and the algorithms; subclasses only move bytes (``_``-methods below)."""

    adopts_images = False

    def __init__(
        self,
        *,
        max_workers: int,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        chunking: ChunkParams | None = None,
        pack_bytes: int = packs.DEFAULT_PACK_BYTES,
        repack_below: float = REPACK_BELOW,
    ) -> None:
        self.max_workers = max_workers
        self.grace_seconds = grace_seconds
        self.chunking = chunking
        """Fixed chunk sizes; None picks them per snapshot (:func:`auto_chunk_kib`)."""
        self.pack_bytes = pack_bytes
        self.repack_below = repack_below
        self._cache: dict[str, _Record] = {}
        self._cache_lock = threading.Lock()
        self._trailers: dict[str, builtins.list[packs.PackEntry]] = {}
        """Trailers read so far (packs never change)."""
        self._legacy_objects: bool | None = None
        """Whether the store holds objects of format-1 records (``chunks/``), listed then
        with the packs; found out by the first listing, or a format-1 record."""
        self.claim_refresh_seconds = CLAIM_REFRESH_SECONDS
        self.marker_refresh_seconds = MARKER_REFRESH_SECONDS
        self.claim_stale_seconds = CLAIM_STALE_SECONDS
        self.marker_stale_seconds = MARKER_STALE_SECONDS
        self._leftovers: dict[str, set[str]] = {}
        """Failed puts whose clean-up failed too (store unreachable): claim token -> the
        objects to remove; tried again after the next put and by every delete."""
        self._leftover_markers: set[str] = set()
        """Clean-up markers that could not be removed (tried again first thing)."""
        self._leftovers_lock = threading.Lock()

    # -- the backend -----------------------------------------------------------------

    @abc.abstractmethod
    def _location(self, snapshot_id: str) -> str: ...

    def _adopt_file(self, name: str, source: Path) -> bool:
        """Make the file ``source`` the object ``name`` without copying it (made durable
        by :meth:`_sync_objects`); False where the store cannot."""
        return False

    @abc.abstractmethod
    def _record_ids(self) -> builtins.list[str]:
        """Ids of all records (names that are not snapshot ids are ignored)."""

    @abc.abstractmethod
    def _read_record(self, snapshot_id: str) -> bytes | None: ...

    @abc.abstractmethod
    def _create_record(self, snapshot_id: str, data: bytes) -> bool:
        """Write a record durably unless one exists; False if one did."""

    @abc.abstractmethod
    def _delete_record(self, snapshot_id: str) -> None: ...

    @abc.abstractmethod
    def _write_object(self, name: str, data: packs.Parts) -> None:
        """Store a pack (``packs/<hh>/<name>``) whole, from its parts."""

    @abc.abstractmethod
    def _sync_objects(self) -> None:
        """Make the objects written so far durable, before a record names them."""

    @abc.abstractmethod
    def _read_object(self, name: str, offset: int, length: int) -> bytes | memoryview | None:
        """``length`` bytes of an object from ``offset`` (fewer past its end); None if the
        object is missing."""

    @abc.abstractmethod
    def _list_objects(self, directory: str) -> Iterator[tuple[str, _ObjectStat]]:
        """Every object under ``packs`` or ``chunks``, by full name."""

    @abc.abstractmethod
    def _delete_objects(self, names: builtins.list[str]) -> None:
        """Delete these objects (missing ones are fine)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Let go of connections (the store is not used afterwards)."""

    def tighten(self) -> builtins.list[Exposed]:
        """Nothing on this machine to tighten (a local store overrides it)."""
        return []

    @abc.abstractmethod
    def _list_puts(self) -> builtins.list[tuple[str, float]]:
        """Names under ``puts/`` with their timestamps (the store's clock)."""

    @abc.abstractmethod
    def _write_put(self, name: str, data: bytes) -> None:
        """Write (or replace) ``puts/<name>`` whole; its timestamp becomes now."""

    @abc.abstractmethod
    def _read_put(self, name: str) -> bytes | None: ...

    @abc.abstractmethod
    def _delete_put(self, name: str) -> None:
        """Remove ``puts/<name>`` (a missing one is fine)."""

    def _disk_full(self, manifest: Manifest, exc: BaseException) -> StoreError | None:
        """The error to raise instead of ``exc`` when it says the store's disk is full."""
        return None

    def _list_all_objects(self) -> dict[str, _ObjectStat]:
        objects = dict(self._list_objects("packs"))
        if self._legacy_objects is not False:  # None: not known yet
            legacy = dict(self._list_objects("chunks"))
            self._legacy_objects = self._legacy_objects or bool(legacy)
            objects.update(legacy)
        return objects

    def _trailer(self, name: str, size: int) -> builtins.list[packs.PackEntry]:
        """The chunks a pack lists (read once: packs never change); [] if unreadable."""
        if name in self._trailers:
            return self._trailers[name]
        entries: builtins.list[packs.PackEntry] = []
        tail = min(size, 256 * 1024)
        read = self._read_object(name, size - tail, tail) if size >= packs.FOOTER_SIZE else None
        try:
            if read is None:
                return []
            data = bytes(read)
            length = packs.trailer_length(data[-packs.FOOTER_SIZE :])
            start = len(data) - packs.FOOTER_SIZE - length
            if start < 0:
                more = self._read_object(name, size - packs.FOOTER_SIZE - length, -start)
                data = bytes(more or b"") + data
                start = 0
            entries = packs.parse_trailer(name, data[start : start + length], size)
        except (ValueError, IndexError) as exc:
            logger.warning("The trailer of pack %s cannot be read: %s", name, exc)
        self._trailers[name] = entries
        return entries

    # -- the API ---------------------------------------------------------------------

    def put(self, snapshot_dir: Path, progress: ProgressCallback | None = None) -> StoredSnapshot:
        """Store a sealed snapshot directory; checks every file against its manifest.

        Putting a snapshot that is already stored returns it as it is.
        """
        raw = _read_manifest(snapshot_dir)
        try:
            manifest = Manifest.from_dict(raw)
        except (TypeError, ValueError) as exc:
            raise SnapshotCorruptError(
                f"The manifest of {snapshot_dir} is incomplete: {exc}",
                hint="The snapshot is damaged; take a new one.",
            ) from exc
        if not manifest_mod.SNAPSHOT_ID_RE.match(str(manifest.id)):
            raise SnapshotCorruptError(
                f"{snapshot_dir} has an invalid snapshot id {manifest.id!r}.",
                hint="Take a new snapshot.",
            )
        existing = self._load(manifest.id)
        if existing is not None:
            return self._same_or_conflict(existing, raw)
        self._remove_leftover_markers()
        upload = _Upload(self, snapshot_dir, manifest, self._chunking_for(manifest), progress)
        token = uuid.uuid4().hex
        try:
            # The claim exists before the put relies on any pack, and lists them as it goes.
            self._write_claim(token, manifest.id, set())
            with _Heartbeat(
                self.claim_refresh_seconds,
                lambda: self._write_claim(token, manifest.id, upload.relied_on()),
            ):
                stored = self._commit(upload, token, raw)
        except BaseException as exc:
            replacement = self._after_failed_put(token, manifest, upload, exc)
            if replacement is exc:
                raise
            raise replacement from exc
        self._delete_put(f"{token}.json")
        try:
            self._collect_leftovers()
        except SnapshotError as exc:  # the put succeeded; the next one tries again
            logger.warning("Could not clean up after earlier failed puts: %s", exc)
        return stored

    def _commit(self, upload: _Upload, token: str, raw: dict[str, Any]) -> StoredSnapshot:
        """Upload, then publish the claim, wait out clean-ups, check, and write the record."""
        manifest = upload.manifest
        upload.run()
        for _ in range(REUPLOAD_ROUNDS):
            self._write_claim(token, manifest.id, upload.relied_on())
            _report(upload.progress, "committing", manifest.total_bytes, manifest.total_bytes)
            self._wait_for_cleanups()
            missing = upload.recheck()
            if not missing:
                break
            logger.info(
                "A clean-up removed %d chunks snapshot %s relies on: uploading them again",
                len(missing),
                manifest.id,
            )
            upload.upload_again(missing)
        else:
            raise StoreError(
                f"Snapshot {manifest.id} could not be stored: concurrent clean-ups kept "
                "removing chunks it relies on.",
                hint="Store the snapshot again.",
            )
        chunks = upload.refs()
        distinct = {ref.hash: ref.where.length for refs in chunks.values() for ref in refs}
        record = _Record(
            raw, manifest, chunks, sum(distinct.values()), upload.new_bytes, upload.params.kib
        )
        self._sync_objects()
        upload.check_unchanged()
        if not self._create_record(manifest.id, record.to_json()):
            raced = self._load(manifest.id)
            if raced is None:
                raise StoreError(
                    f"Snapshot {manifest.id} was deleted while it was being stored again.",
                    hint="Store it again if it is still wanted.",
                )
            return self._same_or_conflict(raced, raw)
        with self._cache_lock:
            self._cache[manifest.id] = record
        _report(upload.progress, "done", manifest.total_bytes, manifest.total_bytes)
        return self._stored(record)

    def _write_claim(self, token: str, snapshot_id: str, objects: set[str]) -> None:
        claim = {
            "snapshot_id": snapshot_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "objects": sorted(objects),
        }
        self._write_put(f"{token}.json", json.dumps(claim).encode())

    def _after_failed_put(
        self, token: str, manifest: Manifest, upload: _Upload, exc: BaseException
    ) -> BaseException:
        """Remove what the failed put wrote (unless others rely on it); the error to raise."""
        candidates = upload.written()
        try:
            self._collect(candidates, own={token})
        except SnapshotError as cleanup_exc:
            logger.warning(
                "The failed put of snapshot %s is cleaned up later (%d packs): %s",
                manifest.id,
                len(candidates),
                cleanup_exc,
            )
            with self._leftovers_lock:
                self._leftovers[token] = candidates
        return self._disk_full(manifest, exc) or exc

    def _chunking_for(self, manifest: Manifest) -> ChunkParams:
        """The chunk sizes the snapshot's memory was cut with (as the server asked: the
        configured ones, or automatic ones that follow the parent snapshot's); for a
        snapshot from before that was kept, chosen here the same way."""
        if manifest.chunk_kib is not None:
            try:
                return ChunkParams.of_kib(manifest.chunk_kib)
            except ValueError as exc:
                raise _corrupt(manifest.id, f"its chunk size cannot be: {exc}") from exc
        if self.chunking is not None:
            return self.chunking
        previous = None
        if manifest.parent_id and manifest_mod.SNAPSHOT_ID_RE.match(manifest.parent_id):
            parent = self._try_load(manifest.parent_id)
            if isinstance(parent, _Record):
                previous = parent.chunk_kib
        return ChunkParams.of_kib(auto_chunk_kib(manifest.total_bytes, previous))

    def list(self) -> builtins.list[StoredSnapshot]:
        """Complete snapshots, by (lineage, sequence); unreadable records are logged, skipped."""
        records = self._all_records(strict=False)
        return sorted(
            (self._stored(r) for r in records.values()),
            key=lambda s: (s.manifest.lineage, s.manifest.sequence, s.manifest.id),
        )

    def get(self, snapshot_id: str) -> StoredSnapshot:
        return self._stored(self._require(snapshot_id))

    def fetch(
        self,
        snapshot_id: str,
        dest_dir: Path,
        progress: ProgressCallback | None = None,
        skip: Callable[[str], bool] | None = None,
    ) -> Path:
        """Rebuild the snapshot directory at ``dest_dir`` (which must not exist), verified.

        Everything is written to a hidden sibling and renamed into place, so ``dest_dir``
        is complete or absent. Files for which ``skip(path)`` is true are left out (a lazy
        restore serves them from :meth:`open_images` instead).
        """
        record = self._require(snapshot_id)
        dest_dir = Path(dest_dir)
        if dest_dir.exists():
            raise StoreError(
                f"Cannot fetch snapshot {snapshot_id} to {dest_dir}: it already exists.",
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
            lock = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            fcntl.flock(lock, fcntl.LOCK_EX)
            _Download(self, record, staging, progress, skip).run()
            with os.fdopen(private.create(staging / manifest_mod.MANIFEST_NAME), "w") as fh:
                fh.write(manifest_mod.manifest_json(record.raw_manifest))
                fh.flush()
                os.fsync(fh.fileno())
            for directory in {staging, *(p.parent for p in staging.rglob("*") if p.is_file())}:
                _fsync_dir(directory)
            staging.rename(dest_dir)
            written = dest_dir
            _fsync_dir(dest_dir.parent)
        except OSError as exc:
            manifest_mod.remove_tree(written)
            raise StoreError(
                f"Cannot write snapshot {snapshot_id} to {dest_dir}: {exc}",
                hint=_os_hint(exc),
            ) from exc
        except BaseException:
            manifest_mod.remove_tree(written)
            raise
        finally:
            if lock >= 0:
                os.close(lock)
        _report(progress, "done", record.manifest.total_bytes, record.manifest.total_bytes)
        return dest_dir

    def open_images(self, snapshot_id: str) -> SnapshotImages:
        """Byte ranges of the snapshot's files, read from the store on demand (verified)."""
        return SnapshotImages(self, self._require(snapshot_id))

    def delete(self, snapshot_id: str, *, missing_ok: bool = False) -> None:
        """Remove the record, then sweep and repack what nothing needs any more.

        ``missing_ok``: a snapshot already gone (another retention pass, another server
        deleted it) is not an error: retention deletes what it planned, once."""
        manifest_mod.check_snapshot_id(snapshot_id)
        if self._load(snapshot_id) is None:
            if missing_ok:
                return
            self._require(snapshot_id)
        self._delete_record(snapshot_id)
        with self._cache_lock:
            self._cache.pop(snapshot_id, None)
        try:
            self._sweep()
        except SnapshotError as exc:
            logger.warning(
                "Snapshot %s deleted, but the store was not cleaned up: %s", snapshot_id, exc
            )

    def stats(self) -> StoreStats:
        objects = self._list_all_objects()
        return StoreStats(
            snapshot_count=len(self._record_ids()),
            object_count=len(objects),
            stored_bytes=sum(stat.size for stat in objects.values()),
        )

    # -- clean-up --------------------------------------------------------------------

    def _sweep(self) -> None:
        """Delete unreferenced objects older than the grace period, repack mostly unused
        packs, and remove what failed or killed puts left (see :meth:`_collect`)."""
        with self._leftovers_lock:
            leftovers = {token: set(objects) for token, objects in self._leftovers.items()}
        self._collect(set().union(*leftovers.values()), own=set(leftovers), sweep=True)
        with self._leftovers_lock:
            for token in leftovers:
                self._leftovers.pop(token, None)

    def _collect_leftovers(self) -> None:
        """After a put: clean up what earlier failed puts here (store unreachable then)
        and killed puts anywhere (stale claims) left, if there is any."""
        with self._leftovers_lock:
            leftovers = {token: set(objects) for token, objects in self._leftovers.items()}
        if not leftovers:
            now = time.time()
            if not any(mtime <= now - self._stale_after(name) for name, mtime in self._list_puts()):
                return
        self._collect(set().union(*leftovers.values()), own=set(leftovers))
        with self._leftovers_lock:
            for token in leftovers:
                self._leftovers.pop(token, None)

    def _stale_after(self, name: str) -> float:
        return self.marker_stale_seconds if name.endswith(".cleaning") else self.claim_stale_seconds

    def _collect(self, candidates: set[str], *, own: set[str], sweep: bool = False) -> None:
        """Delete the ``candidates`` (and the objects of stale claims) that no record
        needs and no live claim lists; with ``sweep``, also unneeded objects older than
        the grace period, and repack old packs that are mostly unneeded if no other
        clean-up runs. The claims ``own`` (of failed puts) are removed at the end.

        The marker is written first, then the claims are read, then the records: a put
        that publishes its claim after that reading sees the marker (or its clean-up
        done) before it checks its packs.
        """
        marker = f"{uuid.uuid4().hex}.cleaning"
        last_beat = [time.monotonic()]
        owner = json.dumps(_process_identity()).encode()

        def beat() -> None:
            self._write_put(marker, owner)
            last_beat[0] = time.monotonic()

        def check_lease() -> None:
            self._check_lease(last_beat[0])

        beat()
        try:
            with _Heartbeat(self.marker_refresh_seconds, beat):
                candidates = set(candidates)
                live: set[str] = set()
                finished: builtins.list[str] = []
                alone = True
                now = time.time()
                for name, mtime in self._list_puts():
                    token, _, kind = name.partition(".")
                    stale = mtime <= now - self._stale_after(name)
                    if name == marker or kind not in ("json", "cleaning"):
                        continue
                    if kind == "cleaning" or token in own:
                        if kind == "cleaning" and not stale:
                            alone = alone and self._marker_owner_gone(name)
                        if kind == "json" or stale:
                            finished.append(name)
                        continue
                    claimed = self._claimed_objects(name, stale)
                    if stale:
                        candidates |= claimed
                        finished.append(name)
                    else:
                        live |= claimed
                objects = self._list_all_objects()
                records = self._all_records(strict=True)
                catalog = _Catalog(self, records.values(), objects)
                needed: dict[str, dict[str, tuple[int, Location]]] = {}
                for record in records.values():
                    for ref in record.distinct().values():
                        where = catalog.resolve(ref)
                        if where is None:
                            # Deleting by a wrong picture of the store could lose more.
                            raise StoreError(
                                f"Snapshot {record.manifest.id} needs chunk {ref.hash[:12]}…, "
                                "which is in no pack of the store, so nothing is removed now.",
                                hint="Delete that snapshot (it cannot be restored), then "
                                "the clean-up runs again.",
                            )
                        needed.setdefault(where.obj, {})[ref.hash] = (ref.size, where)
                doomed = sorted((candidates & objects.keys()) - needed.keys() - live)
                cutoff = time.time() - self.grace_seconds
                old = {
                    name
                    for name, stat in objects.items()
                    if sweep and name not in needed and name not in live and stat.mtime <= cutoff
                }
                check_lease()
                self._delete_objects(sorted(set(doomed) | old))
                if sweep and alone:
                    worn = [
                        name
                        for name, stat in sorted(objects.items())
                        if name in needed
                        and name not in live
                        and packs.is_pack_name(name)
                        and stat.mtime <= cutoff
                        and sum(w.length for _, w in needed[name].values())
                        < self.repack_below * stat.size
                    ]
                    if worn:
                        self._repack(worn, needed, check_lease, marker)
                for name in finished:
                    self._delete_put(name)
                if doomed:
                    logger.info("Removed %d packs that failed puts left", len(doomed))
        finally:
            try:
                self._delete_put(marker)
            except SnapshotError:
                with self._leftovers_lock:
                    self._leftover_markers.add(marker)
                raise

    def _repack(
        self,
        worn: builtins.list[str],
        needed: dict[str, dict[str, tuple[int, Location]]],
        check_lease: Callable[[], None],
        marker: str,
    ) -> None:
        """Copy the needed chunks of ``worn`` packs into new packs, then delete them.

        Every chunk is checked before it is copied; a pack with a damaged chunk is left
        as it is. The new packs are claimed like a put's before they are written, and
        the old ones deleted only once other clean-ups are over and the new ones are
        there. Readers find the moved chunks through the new packs' trailers.
        """
        token = uuid.uuid4().hex
        written: set[str] = set()
        builder: packs.PackBuilder | None = None
        done: builtins.list[str] = []
        kept = 0

        def flush() -> None:
            nonlocal builder
            if builder is not None and len(builder):
                written.add(builder.name)
                self._write_claim(token, "repack", written)
                self._write_object(builder.name, builder.finish())
            builder = None

        try:
            for name in worn:
                check_lease()
                copied = self._checked_chunks(name, needed[name])
                if copied is None:
                    continue
                for digest, size, blob, codec in copied:
                    builder = builder or packs.PackBuilder()
                    builder.add(digest, size, blob, codec)
                done.append(name)
                kept += sum(w.length for _, w in needed[name].values())
                if builder is not None and builder.size >= self.pack_bytes:
                    flush()
            flush()
            if not done:
                return
            self._sync_objects()
            self._wait_for_cleanups(besides=marker)
            missing = written - self._list_all_objects().keys()
            if missing:
                logger.warning("A repack stopped: %d new packs were removed", len(missing))
                return
            check_lease()
            self._delete_objects(done)
            logger.info("Repacked %d packs (%s still needed)", len(done), human_bytes(kept))
        finally:
            with contextlib.suppress(SnapshotError):
                self._delete_put(f"{token}.json")

    def _checked_chunks(
        self, name: str, chunks: dict[str, tuple[int, Location]]
    ) -> builtins.list[tuple[str, int, bytes | memoryview, packs.Codec]] | None:
        """The chunks of a pack, each read and checked; None if one is damaged or gone."""
        copied: builtins.list[tuple[str, int, bytes | memoryview, packs.Codec]] = []
        ordered = sorted(chunks.items(), key=lambda item: item[1][1].offset)
        try:
            for group in _coalesce([(digest, where) for digest, (_, where) in ordered]):
                start = group[0][1].offset
                end = max(w.offset + w.length for _, w in group)
                data = self._read_object(name, start, end - start)
                if data is None:
                    raise ValueError("is gone")
                for digest, where in group:
                    blob = data[where.offset - start : where.offset - start + where.length]
                    size = chunks[digest][0]
                    packs.check_chunk(packs.decode(blob, where.codec, size), size, digest)
                    copied.append((digest, size, blob, where.codec))
        except ValueError as exc:
            logger.warning("Pack %s is not repacked: a chunk %s", name, exc)
            return None
        return copied

    def _claimed_objects(self, name: str, stale: bool) -> set[str]:
        """The objects a claim lists; a live claim that cannot be read stops the clean-up."""
        data = self._read_put(name)
        try:
            if data is None:
                return set()  # its put ended meanwhile
            claim = json.loads(data)
            objects = claim["objects"]
            if not all(isinstance(o, str) and packs.is_object_name(o) for o in objects):
                raise ValueError("not a list of pack names")
            return set(objects)
        except (ValueError, KeyError, TypeError) as exc:
            if stale:
                return set()
            raise StoreError(
                f"The claim {self._location_of_put(name)} of a put in progress cannot be "
                f"read ({exc}), so nothing is removed now.",
                hint="Remove that file if no put is running, then retry.",
            ) from exc

    def _check_lease(self, last_beat: float) -> None:
        """Stop deleting once the marker may look stale to others (its heartbeat failed)."""
        if time.monotonic() - last_beat > self.marker_stale_seconds / 2:
            raise StoreError(
                "A clean-up of the store stopped: its marker could not be kept fresh.",
                hint="Check that the store is reachable; the clean-up is tried again later.",
            )

    def _wait_for_cleanups(self, besides: str = "") -> None:
        """Wait while a clean-up (other than ``besides``) that may not have seen this
        put's claim is deleting. The marker of a clean-up whose process is gone from this
        host (a server killed during it) is removed at once, not waited out."""
        while True:
            now = time.time()
            fresh = [
                name
                for name, mtime in self._list_puts()
                if name.endswith(".cleaning")
                and name != besides
                and mtime > now - self.marker_stale_seconds
            ]
            live = [name for name in fresh if not self._marker_owner_gone(name)]
            for name in set(fresh) - set(live):
                logger.info("removing the marker of a clean-up whose process ended: %s", name)
                with contextlib.suppress(SnapshotError):
                    self._delete_put(name)
            if not live:
                return
            time.sleep(0.05)

    def _marker_owner_gone(self, name: str) -> bool:
        """Whether a clean-up marker names a process of this host that no longer runs."""
        with contextlib.suppress(SnapshotError, ValueError, KeyError, TypeError):
            data = self._read_put(name)
            if data is None:
                return True  # removed meanwhile
            owner = json.loads(data)
            if owner["host"] == socket.gethostname():
                return bool(_process_identity(int(owner["pid"])) != owner)
        return False  # another host's, or unreadable: only its age tells

    def _remove_leftover_markers(self) -> None:
        with self._leftovers_lock:
            markers = set(self._leftover_markers)
        for marker in markers:
            with contextlib.suppress(SnapshotError):
                self._delete_put(marker)
                with self._leftovers_lock:
                    self._leftover_markers.discard(marker)

    def _location_of_put(self, name: str) -> str:
        return f"{PUTS_DIR}/{name}"

    def _all_records(self, *, strict: bool) -> dict[str, _Record]:
        ids = self._record_ids()
        with self._cache_lock:
            self._cache = {i: r for i, r in self._cache.items() if i in ids}
            missing = [i for i in ids if i not in self._cache]
            records = {i: self._cache[i] for i in ids if i in self._cache}
        with ThreadPoolExecutor(max_workers=self.max_workers) as pool:
            loaded = pool.map(self._try_load, missing)
            for snapshot_id, result in zip(missing, loaded, strict=True):
                if isinstance(result, _Record):
                    records[snapshot_id] = result
                elif isinstance(result, SnapshotCorruptError):
                    if strict:
                        raise result
                    logger.warning("Skipping snapshot %s: %s", snapshot_id, result)
        return records

    def _try_load(self, snapshot_id: str) -> _Record | SnapshotCorruptError | None:
        try:
            return self._load(snapshot_id)
        except SnapshotCorruptError as exc:
            return exc

    def _load(self, snapshot_id: str) -> _Record | None:
        """The record, read fresh (it may have been deleted elsewhere), or None."""
        data = self._read_record(snapshot_id)
        if data is None:
            with self._cache_lock:
                self._cache.pop(snapshot_id, None)
            return None
        with self._cache_lock:
            cached = self._cache.get(snapshot_id)
        if cached is not None:
            return cached
        record = _Record.parse(snapshot_id, data)
        if any(packs.LEGACY_NAME_RE.match(name) for name in record.objects()):
            self._legacy_objects = True
        with self._cache_lock:
            self._cache[snapshot_id] = record
        return record

    def _require(self, snapshot_id: str) -> _Record:
        manifest_mod.check_snapshot_id(snapshot_id)
        record = self._load(snapshot_id)
        if record is None:
            raise SnapshotNotFoundError(
                f"There is no snapshot {snapshot_id} in {self._location(snapshot_id)}.",
                hint="List the snapshots to see which exist.",
            )
        return record

    def _same_or_conflict(self, record: _Record, raw: dict[str, Any]) -> StoredSnapshot:
        if record.raw_manifest != raw:
            raise StoreError(
                f"A different snapshot with id {record.manifest.id} is already stored.",
                hint="Snapshot ids must be unique; take a new snapshot.",
            )
        return self._stored(record)

    def _stored(self, record: _Record) -> StoredSnapshot:
        return StoredSnapshot(
            manifest=record.manifest,
            stored_bytes=record.stored_bytes,
            new_bytes=record.new_bytes,
            chunk_count=len(record.distinct()),
            location=self._location(record.manifest.id),
        )


class _Heartbeat:
    """Calls ``beat`` every ``interval`` seconds on a thread until the block ends; a failed
    beat is logged (the next one may work)."""

    def __init__(self, interval: float, beat: Callable[[], None]) -> None:
        self._interval = interval
        self._beat = beat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-heartbeat", daemon=True)

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._beat()
            except SnapshotError as exc:
                logger.warning("Store heartbeat failed: %s", exc)


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """pwrite until all is written: a short write (a disk filling up) is followed by one
    that raises the error, rather than counted as done."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _sha256_hex(data: memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def _coalesce(
    chunks: Iterable[tuple[_T, Location]],
) -> Iterator[builtins.list[tuple[_T, Location]]]:
    """Chunks of one object, sorted by offset, in groups that one ranged read serves."""
    group: builtins.list[tuple[_T, Location]] = []
    start = end = 0
    for item in chunks:
        where = item[1]
        if group and (
            where.offset - end > COALESCE_GAP or where.offset + where.length - start > MAX_READ
        ):
            yield group
            group = []
        if not group:
            start = where.offset
        group.append(item)
        end = max(end if len(group) > 1 else 0, where.offset + where.length)
    if group:
        yield group


class _MappedFile:
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


class _Upload:
    """One put, as a pipeline: the calling thread cuts each file into chunks; a pool
    hashes and compresses them; the calling thread places them, in order, into packs;
    another pool uploads the packs. Chunks the store already has are not stored again."""

    def __init__(
        self,
        store: _ChunkStore,
        root: Path,
        manifest: Manifest,
        params: ChunkParams,
        progress: ProgressCallback | None,
    ) -> None:
        self.store = store
        self.root = root
        self.manifest = manifest
        self.params = params
        self.progress = progress
        self.files: dict[str, builtins.list[tuple[str, int]]] = {}
        """Each file's chunks (sha256, size), in order."""
        self.locations: dict[str, Location] = {}
        """Where each distinct chunk is: in a pack of this put, or one it reuses."""
        self.sources: dict[str, tuple[str, int, int]] = {}
        """Where each distinct chunk is in the snapshot: file, offset, size."""
        self.known: dict[str, Location] = {}
        """The chunks the store has (listed at the start)."""
        self.lock = threading.Lock()
        self._relied: set[str] = set()
        self._written: set[str] = set()
        self.new_bytes = 0
        self.done_bytes = 0
        self.file_offset = 0
        """Where the next chunk starts in the file being cut."""
        self.file_fd = -1
        """The file being cut, open until the put ends (its packs are written later)."""
        self._fds: builtins.list[int] = []
        self._next_report = 0
        self.sealed: manifest_mod.Stamps = {}
        """Each file's stamp when it was sealed (or last checked): where a file still has
        it, its chunks' digests are trusted."""
        self.stamps: manifest_mod.Stamps = {}
        """Each file's stamp as this put found it (after its own link, if it adopted it):
        it must still have it when the record is written."""

    def relied_on(self) -> set[str]:
        """Every pack this put has written, is writing, or reuses chunks of."""
        with self.lock:
            return self._relied | self._written

    def written(self) -> set[str]:
        with self.lock:
            return set(self._written)

    def refs(self) -> dict[str, builtins.list[ChunkRef]]:
        return {
            path: [ChunkRef(digest, size, self.locations[digest]) for digest, size in chunks]
            for path, chunks in self.files.items()
        }

    def run(self) -> None:
        total = self.manifest.total_bytes
        _report(self.progress, "uploading", 0, total)
        records = self.store._all_records(strict=False)
        self.known = _Catalog(self.store, records.values()).located
        self.sealed = manifest_mod.sealed_stamps(self.root)
        try:
            with _Packer(self) as packer, ThreadPoolExecutor(self.store.max_workers) as pool:
                tasks = _Bounded(pool, 2 * self.store.max_workers)
                try:
                    for entry in self.manifest.files:
                        chunks = self.files[entry.path] = []
                        self.file_offset = 0
                        if self._adopted(entry, chunks):
                            continue
                        for batch in self._read_checked(entry):
                            for done in tasks.submit(self._prepare_all, batch):
                                for prepared in done:
                                    self._place(packer, entry.path, chunks, prepared)
                        for done in tasks.drain():
                            for prepared in done:
                                self._place(packer, entry.path, chunks, prepared)
                except BaseException:
                    tasks.cancel()
                    raise
        finally:
            for fd in self._fds:
                os.close(fd)

    def _prepare_all(self, batch: builtins.list[_Piece]) -> builtins.list[_Prepared]:
        """On a worker: a batch of chunks (a task per chunk cost more than hashing one)."""
        compressibility = packs.Compressibility()
        return [self._prepare(piece, compressibility) for piece in batch]

    def _prepare(self, piece: _Piece, compressibility: packs.Compressibility) -> _Prepared:
        """On a worker: hash the chunk, unless its sealed digest is trusted (or check it
        against that digest); compress it unless the store has it (a chunk this put has
        twice is compressed twice: which comes first is known only in order)."""
        data, expected, trusted = piece
        if expected is not None and trusted:
            digest = expected
        else:
            digest = hashlib.sha256(data).hexdigest()
            if expected is not None and digest != expected:
                raise _corrupt(self.manifest.id, "a chunk differs from its manifest entry")
        if digest in self.known:
            return digest, len(data), None, "raw"
        blob, codec = packs.encode(data, compressibility.worth_trying())
        compressibility.saw(codec)
        return digest, len(data), blob, codec

    def _place(
        self,
        packer: _Packer,
        path: str,
        chunks: builtins.list[tuple[str, int]],
        prepared: _Prepared,
    ) -> None:
        """On the calling thread, in file order: reuse or pack one chunk."""
        digest, size, blob, codec = prepared
        if digest not in self.locations:
            self.sources[digest] = (path, self.file_offset, size)
            if blob is None:
                where = self.known[digest]
                with self.lock:
                    self._relied.add(where.obj)
            else:
                stored: packs.Blob = blob
                if codec == "raw":  # copied from the file where the store can
                    stored = packs.FileSlice(self.file_fd, self.file_offset, memoryview(blob))
                where = packer.add(digest, size, stored, codec)
                self.new_bytes += where.length
            self.locations[digest] = where
        chunks.append((digest, size))
        self.file_offset += size
        self._advance(size)

    def _advance(self, size: int) -> None:
        self.done_bytes += size
        total = self.manifest.total_bytes
        if self.done_bytes >= self._next_report or self.done_bytes == total:
            self._next_report = self.done_bytes + max(REPORT_EVERY, total // 200)
            _report(self.progress, "uploading", self.done_bytes, total)

    def _read_checked(self, entry: manifest_mod.FileEntry) -> Iterator[builtins.list[_Piece]]:
        """The file's chunks, in batches of about BATCH_BYTES. A file with chunks in its
        entry is cut there, each chunk checked against its sha256 unless the file is as it
        was sealed; another is cut here and hashed whole on a thread of its own, beside the
        chunk workers, and checked at the end. Raises if the file is not as its entry says."""
        path = self._path(entry.path)
        size = 0
        trusted = self._trusted(entry)
        try:
            with path.open("rb") as fh, ThreadPoolExecutor(1) as hasher:
                self.file_fd = os.dup(fh.fileno())
                self._fds.append(self.file_fd)
                mapped = _MappedFile(fh)
                if len(mapped.view) != entry.size:
                    raise _corrupt(self.manifest.id, f"{entry.path} has changed in size")
                digest = None
                if entry.chunks is None:
                    digest = hasher.submit(_sha256_hex, mapped.view)
                    pieces: Iterator[_Piece] = (
                        (data, None, False) for data in iter_chunks(mapped, self.params)
                    )
                else:
                    pieces = ((mapped.read(n), expected, trusted) for expected, n in entry.chunks)
                batch: builtins.list[_Piece] = []
                batch_bytes = 0
                for piece in pieces:
                    batch.append(piece)
                    batch_bytes += len(piece[0])
                    size += len(piece[0])
                    if batch_bytes >= BATCH_BYTES:
                        yield batch
                        batch, batch_bytes = [], 0
                if batch:
                    yield batch
                file_hash = digest.result() if digest else entry.sha256
        except FileNotFoundError as exc:
            raise _corrupt(self.manifest.id, f"{entry.path} is missing") from exc
        except OSError as exc:
            raise StoreError(f"Cannot read {path}: {exc}", hint=_os_hint(exc)) from exc
        if size != entry.size or file_hash != entry.sha256:
            raise _corrupt(self.manifest.id, f"{entry.path} differs from its manifest entry")

    def _trusted(self, entry: manifest_mod.FileEntry) -> bool:
        """Stamp the file as this put finds it; whether it is as it was sealed."""
        try:
            now = manifest_mod.stamp(self._path(entry.path))
        except OSError:
            return False  # reading it says why
        self.stamps[entry.path] = now
        return entry.path in self.sealed and self.sealed[entry.path] == now

    def _adopted(
        self, entry: manifest_mod.FileEntry, chunks: builtins.list[tuple[str, int]]
    ) -> bool:
        """Adopt a memory image as an image pack, if the store can and it is worth it
        (ADOPT_NEW_SHARE); its chunks are then located in it, in file order."""
        if (
            not self.store.adopts_images
            or entry.chunks is None
            or entry.size < self.store.pack_bytes
            or not self._trusted(entry)
        ):
            return False
        firsts: dict[str, int] = {}
        for digest, size in entry.chunks:
            firsts.setdefault(digest, size)
        new = sum(n for d, n in firsts.items() if d not in self.known and d not in self.locations)
        if new < ADOPT_NEW_SHARE * entry.size or self._saving(entry) >= ADOPT_MAX_SAVING:
            return False
        path = self._path(entry.path)
        name = packs.new_image_pack_name()
        with self.lock:  # claimed before it exists
            self._written.add(name)
        if not self.store._adopt_file(name, path):
            with self.lock:
                self._written.discard(name)
            return False
        self.stamps[entry.path] = manifest_mod.stamp(path)  # the link changed its ctime
        offset = 0
        for digest, size in entry.chunks:
            if digest not in self.locations:
                self.sources[digest] = (entry.path, offset, size)
                where = self.known.get(digest)
                if where is None:
                    where = Location(name, offset, size, "raw")
                    self.new_bytes += size
                else:
                    with self.lock:
                        self._relied.add(where.obj)
                self.locations[digest] = where
            chunks.append((digest, size))
            offset += size
            self._advance(size)
        return True

    def _saving(self, entry: manifest_mod.FileEntry) -> float:
        """The share of its bytes that zstd would save on the image (from a sample)."""
        assert entry.chunks is not None
        starts, offset = [], 0
        for _, size in entry.chunks:
            starts.append(offset)
            offset += size
        step = max(1, len(starts) // ADOPT_SAMPLES)
        raw = stored = 0
        with self._path(entry.path).open("rb") as fh:
            for index in range(0, len(starts), step):
                data = os.pread(fh.fileno(), entry.chunks[index][1], starts[index])
                blob, _ = packs.encode(data)
                raw += len(data)
                stored += len(blob)
        return 1 - stored / raw if raw else 0.0

    def check_unchanged(self) -> None:
        """Before the record is written: every file is still as this put found it (the
        bytes stored are the bytes hashed); those stamps become the seal's (what the image
        cache admits the directory by)."""
        changed = []
        for rel, value in self.stamps.items():
            try:
                if manifest_mod.stamp(self._path(rel)) != value:
                    changed.append(rel)
            except OSError:
                changed.append(rel)
        if changed:
            raise _corrupt(self.manifest.id, f"{sorted(changed)[0]} changed while it was stored")
        try:
            manifest_mod.write_sealed_stamps(self.root, self.stamps)
        except OSError as exc:  # only the image cache needs them
            logger.warning("Could not update the stamps of %s: %s", self.root, exc)

    def _path(self, relpath: str) -> Path:
        try:
            return self.root / manifest_mod.safe_relpath(relpath)
        except ValueError as exc:
            raise _corrupt(self.manifest.id, str(exc)) from exc

    def recheck(self) -> builtins.list[str]:
        """After the claim is published and clean-ups are waited out: find chunks whose pack
        a concurrent clean-up removed (moved ones get their new place); the lost ones."""
        objects = self.store._list_all_objects()
        gone = [digest for digest, where in self.locations.items() if where.obj not in objects]
        if not gone:
            return []
        records = self.store._all_records(strict=False)
        located = _Catalog(self.store, records.values(), objects, gone).located
        lost = []
        for digest in gone:
            if digest in located:
                self.locations[digest] = located[digest]
                with self.lock:
                    self._relied.add(located[digest].obj)
            else:
                lost.append(digest)
        return lost

    def upload_again(self, digests: builtins.list[str]) -> None:
        """Pack the lost chunks again, read from the snapshot's files."""
        with _Packer(self) as packer:
            for digest in digests:
                relpath, offset, size = self.sources[digest]
                path = self._path(relpath)
                try:
                    with path.open("rb") as fh:
                        data = os.pread(fh.fileno(), size, offset)
                except OSError as exc:
                    raise StoreError(f"Cannot read {path}: {exc}", hint=_os_hint(exc)) from exc
                try:
                    packs.check_chunk(data, size, digest)
                except ValueError as exc:
                    raise _corrupt(self.manifest.id, f"{relpath} changed while stored") from exc
                blob, codec = packs.encode(data)
                where = self.locations[digest] = packer.add(digest, size, blob, codec)
                self.new_bytes += where.length


class _Packer:
    """Fills packs on the calling thread and uploads full ones on a pool (a few in flight)."""

    def __init__(self, upload: _Upload) -> None:
        self.upload = upload
        self.store = upload.store
        self.builder: packs.PackBuilder | None = None
        self.pool = ThreadPoolExecutor(self.store.max_workers, thread_name_prefix="pack-upload")
        self.sending = _Bounded(self.pool, self.store.max_workers)

    def __enter__(self) -> _Packer:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        try:
            if exc_type is None:
                self._send()
                builtins.list(self.sending.drain())
            else:
                self.sending.cancel()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def add(self, digest: str, size: int, blob: packs.Blob, codec: packs.Codec) -> Location:
        if self.builder is None:
            self.builder = packs.PackBuilder()
            with self.upload.lock:  # claimed before it exists
                self.upload._written.add(self.builder.name)
        where = self.builder.add(digest, size, blob, codec)
        if self.builder.size >= self.store.pack_bytes:
            self._send()
        return where

    def _send(self) -> None:
        if self.builder is None:
            return
        name, data = self.builder.name, self.builder.finish()
        self.builder = None
        self.sending.submit(self.store._write_object, name, data)


class _OrderedHasher:
    """Hashes each file in order as its written prefix grows, on its own thread, so that
    the files' sha256 are ready when the last chunk lands (chunks land out of order)."""

    def __init__(self, fds: builtins.list[int], sizes: builtins.list[int]) -> None:
        self.fds = fds
        self.sizes = sizes
        self._buffer = bytearray(8 << 20)
        """Read into one buffer, again and again: no fresh memory per read. Not a mapping:
        a mapping of a file on a full tmpfs kills the process with SIGBUS."""
        self._view = memoryview(self._buffer)
        self.digests = [hashlib.sha256() for _ in fds]
        self._ends: builtins.list[dict[int, int]] = [{} for _ in fds]
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

    def result(self) -> builtins.list[str]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return [d.hexdigest() for d in self.digests]

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join()


class _Reader:
    """Reads chunks of one record: coalesced ranges, each chunk decoded and checked; a
    chunk whose pack is gone is looked up where a repack put it."""

    def __init__(self, store: _ChunkStore, record: _Record) -> None:
        self.store = store
        self.record = record
        self._catalog: _Catalog | None = None
        self._lock = threading.Lock()

    def plan(self, refs: Iterable[ChunkRef]) -> builtins.list[builtins.list[ChunkRef]]:
        """The reads that serve ``refs`` (given in the order they are wanted), in that order."""
        by_object: dict[str, dict[str, ChunkRef]] = {}
        order: dict[str, int] = {}
        for i, ref in enumerate(refs):
            by_object.setdefault(ref.where.obj, {}).setdefault(ref.hash, ref)
            order.setdefault(ref.hash, i)
        reads = [
            [ref for ref, _ in group]
            for chunks in by_object.values()
            for group in _coalesce(
                sorted(((r, r.where) for r in chunks.values()), key=lambda c: c[1].offset)
            )
        ]
        return sorted(reads, key=lambda group: min(order[r.hash] for r in group))

    def read(
        self, group: builtins.list[ChunkRef], check: bool = True
    ) -> Iterator[tuple[ChunkRef, bytes | memoryview]]:
        """Each chunk of a planned read with its bytes, decoded; checked against its sha256
        unless ``check`` is false (a fetch checks whole files instead)."""
        obj = group[0].where.obj
        start = min(r.where.offset for r in group)
        end = max(r.where.offset + r.where.length for r in group)
        data = self.store._read_object(obj, start, end - start)
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
        self, group: builtins.list[ChunkRef], check: bool
    ) -> Iterator[tuple[ChunkRef, bytes | memoryview]]:
        with self._lock:
            if self._catalog is None or group[0].where.obj in self._catalog.objects:
                records = self.store._all_records(strict=False)
                records[self.record.manifest.id] = self.record
                self._catalog = _Catalog(self.store, records.values())
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
            data = packs.decode(blob, ref.where.codec, ref.size)
            if check:
                packs.check_chunk(data, ref.size, ref.hash)
        except ValueError as exc:
            raise self.damaged(ref, str(exc)) from exc
        return data

    def damaged(self, ref: ChunkRef, what: str) -> SnapshotCorruptError:
        path = next(
            (p for p, refs in self.record.chunks.items() if any(r.hash == ref.hash for r in refs)),
            "?",
        )
        return _corrupt(self.record.manifest.id, f"chunk {ref.hash[:12]}… of {path} {what}")


class _Download:
    """One fetch in one concurrent pass: a pool reads coalesced ranges of packs, decodes
    and checks each chunk and writes it where it belongs; a thread hashes each file not
    listed by its chunks as its written prefix grows, so every file is checked against
    the manifest at the end."""

    def __init__(
        self,
        store: _ChunkStore,
        record: _Record,
        staging: Path,
        progress: ProgressCallback | None,
        skip: Callable[[str], bool] | None = None,
    ) -> None:
        self.store = store
        self.record = record
        self.staging = staging
        self.progress = progress
        self.entries = [e for e in record.manifest.files if skip is None or not skip(e.path)]
        self.total = sum(e.size for e in self.entries)
        self.done_bytes = 0
        self._lock = threading.Lock()
        self.targets: dict[str, builtins.list[tuple[int, int]]] = {}
        """sha256 -> every (file index, offset) the chunk goes to."""
        self.hashed: dict[int, int] = {}
        """The files hashed whole as they are written: file index -> the hasher's index."""

    def run(self) -> None:
        _report(self.progress, "downloading", 0, self.total)
        wanted: builtins.list[ChunkRef] = []
        for index, entry in enumerate(self.entries):
            offset = 0
            for ref in self.record.chunks[entry.path]:
                self.targets.setdefault(ref.hash, []).append((index, offset))
                wanted.append(ref)
                offset += ref.size
        fds: builtins.list[int] = []
        hasher = None
        reader = _Reader(self.store, self.record)
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
            hasher = _OrderedHasher([fds[i] for i in whole], [self.entries[i].size for i in whole])
            with ThreadPoolExecutor(self.store.max_workers) as pool:
                tasks = _Bounded(pool, self.store.max_workers)
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
        reader: _Reader,
        hasher: _OrderedHasher,
        fds: builtins.list[int],
        group: builtins.list[ChunkRef],
    ) -> int:
        written = 0
        check = any(e.chunks is not None for e in self.entries)
        for ref, data in reader.read(group, check=check):
            for index, offset in self.targets[ref.hash]:
                _pwrite_all(fds[index], data, offset)
                if index in self.hashed:
                    hasher.written(self.hashed[index], offset, ref.size)
                written += ref.size
        return written

    def _culprit(
        self, reader: _Reader, entry: manifest_mod.FileEntry, fd: int
    ) -> SnapshotCorruptError:
        """The error for a file whose sha256 is wrong: it names the damaged chunk."""
        offset = 0
        for ref in self.record.chunks[entry.path]:
            data = os.pread(fd, ref.size, offset)
            if hashlib.sha256(data).hexdigest() != ref.hash:
                return reader.damaged(ref, "has the wrong sha256")
            offset += ref.size
        return _corrupt(self.record.manifest.id, f"{entry.path} differs from its manifest entry")

    def _progress(self, written: int) -> None:
        self.done_bytes += written
        _report(self.progress, "downloading", self.done_bytes, self.total)


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

    def __init__(self, store: _ChunkStore, record: _Record) -> None:
        self.manifest = record.manifest
        self._store = store
        self._reader = _Reader(store, record)
        self._starts: dict[str, builtins.list[int]] = {}
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
        self._targets: dict[str, builtins.list[tuple[str, int]]] = {}
        """sha256 -> every (path, chunk index) of a downloaded file it goes to."""
        self._in_use = threading.Condition()
        self._readers = 0
        self._stopping = threading.Event()
        self._last_fault = 0.0
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
            raise _corrupt(self.manifest.id, f"it has no file {path!r}")
        if length <= FAULT_BYTES:
            self._last_fault = time.monotonic()
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
        parts: builtins.list[bytes | memoryview] = []
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
                hint=_os_hint(exc),
            )
        wanted: builtins.list[ChunkRef] = []
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
                _pwrite_all(fd, data, self._starts[path][index])
            except OSError as exc:
                with self._lock:
                    if self.local_copy_error is None:
                        logger.warning("stopped keeping %s locally: %s", path, exc)
                        self.local_copy_error = exc
                return
            with self._lock:
                landed[index] = 1

    def _download(self, wanted: builtins.list[ChunkRef]) -> None:
        def fetch(group: builtins.list[ChunkRef]) -> None:
            # The kernel's page faults first: while they come, stand back (a while).
            stood = 0.0
            while stood < MAX_STAND_BACK and time.monotonic() - self._last_fault < FAULT_QUIET:
                time.sleep(FAULT_QUIET / 2)
                stood += FAULT_QUIET / 2
            with self._lock:
                group = [r for r in group if not self._landed_everywhere(r)]
            if not group or self._stopping.is_set() or self.local_copy_error is not None:
                return
            try:
                for ref, data in self._reader.read(group):
                    self._keep(ref, data)
            except Exception as exc:  # noqa: BLE001 -- the reads that need those chunks retry
                logger.info("background download of %s: %s", self.manifest.id, exc)

        with ThreadPoolExecutor(self._store.max_workers) as pool:
            tasks = _Bounded(pool, self._store.max_workers)
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


def _process_identity(pid: int | None = None) -> dict[str, Any]:
    """Host, pid and start time of a process (this one by default): a pid reused by a
    later process has another start time. Empty start for a process that is gone."""
    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "pid": pid, "start": proctree.start_time(pid)}


def _corrupt(snapshot_id: str, what: str) -> SnapshotCorruptError:
    return SnapshotCorruptError(
        f"Snapshot {snapshot_id} is damaged: {what}.",
        hint="Pick another snapshot; this one cannot be restored.",
    )


def _report(progress: ProgressCallback | None, phase: Phase, done: int, total: int) -> None:
    if progress is not None:
        progress({"phase": phase, "done_bytes": done, "total_bytes": total})


def _read_manifest(snapshot_dir: Path) -> dict[str, Any]:
    try:
        raw = json.loads((snapshot_dir / manifest_mod.MANIFEST_NAME).read_text())
    except FileNotFoundError as exc:
        raise SnapshotCorruptError(
            f"{snapshot_dir} is not a complete snapshot: it has no manifest.",
            hint="Only sealed snapshot directories can be stored.",
        ) from exc
    except (OSError, ValueError) as exc:
        raise SnapshotCorruptError(
            f"The manifest of {snapshot_dir} cannot be read: {exc}",
            hint="The snapshot is damaged; take a new one.",
        ) from exc
    if not isinstance(raw, dict):
        raise SnapshotCorruptError(
            f"The manifest of {snapshot_dir} is not a JSON object.",
            hint="The snapshot is damaged; take a new one.",
        )
    return raw


def _os_hint(exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "Free some disk space (or delete old snapshots), then retry."
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "Check that this user may write there, then retry."
    return "Check the directory and retry."


def _runs(parts: Iterable[packs.Blob]) -> Iterator[builtins.list[packs.Blob]]:
    """The parts in runs: slices that follow each other in one file make one run (copied
    by one call: a call per 32 KiB chunk cost 0.1 s per 300 MB), any other part its own."""
    run: builtins.list[packs.Blob] = []
    end: tuple[int, int] | None = None
    for part in parts:
        if isinstance(part, packs.FileSlice) and end == (part.fd, part.offset):
            run.append(part)
        else:
            if run:
                yield run
            run = [part]
        end = (part.fd, part.offset + len(part)) if isinstance(part, packs.FileSlice) else None
    if run:
        yield run


def _copy_range(fd: int, start: int, length: int, out: int) -> bool:
    """Append ``length`` bytes of file ``fd`` from ``start`` to ``out`` inside the kernel;
    False (nothing written) where the kernel cannot copy between these files (another
    file system, say)."""
    offset, left = start, length
    while left:
        try:
            copied = os.copy_file_range(fd, out, left, offset)
        except OSError as exc:
            if offset == start and exc.errno in (
                errno.EXDEV,
                errno.EINVAL,
                errno.ENOSYS,
                errno.EOPNOTSUPP,
            ):
                return False
            raise
        if not copied:  # the file is shorter than it was when it was cut
            raise OSError(errno.EIO, "the snapshot's file shrank while it was stored")
        offset += copied
        left -= copied
    return True


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(_ChunkStore):
    """A store in a local directory (or any mounted file system), owner-only unless
    ``modes`` shares it with a group (core/private.py). Every file in it is read-only:
    records, packs and claims are written once and replaced or removed whole."""

    adopts_images = True

    def __init__(
        self,
        root: Path,
        *,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        chunking: ChunkParams | None = None,
        max_workers: int = 8,
        pack_bytes: int = packs.DEFAULT_PACK_BYTES,
        repack_below: float = REPACK_BELOW,
        modes: Modes = PRIVATE,
    ) -> None:
        super().__init__(
            max_workers=max_workers,
            grace_seconds=grace_seconds,
            chunking=chunking,
            pack_bytes=pack_bytes,
            repack_below=repack_below,
        )
        self.root = Path(root)
        self.modes = modes
        self._unsynced: set[Path] = set()
        """Pack directories with renames not yet made durable (one fsync each per put)."""
        self._unsynced_lock = threading.Lock()

    def _object_path(self, name: str) -> Path:
        return self.root / name

    def _record_path(self, snapshot_id: str) -> Path:
        return self.root / "snapshots" / f"{snapshot_id}.json"

    def _error(self, what: str, exc: OSError) -> StoreError:
        return StoreError(
            f"The snapshot store {self.root} cannot {what}: {exc.strerror or exc}",
            hint=_os_hint(exc),
        )

    def _write_new(self, path: Path, data: bytes | packs.Parts, durably: bool = True) -> Path:
        """Write a uniquely named temporary file next to ``path`` (and sync it)."""
        private.make_dirs(path.parent, self.modes)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            fd = private.create(tmp, mode=self.modes.read_only)
            with os.fdopen(fd, "wb", buffering=0) as fh:
                for run in _runs([data] if isinstance(data, bytes) else data):
                    first = run[0]
                    if isinstance(first, packs.FileSlice) and _copy_range(
                        first.fd, first.offset, sum(map(len, run)), fh.fileno()
                    ):
                        continue
                    for part in run:
                        view = memoryview(packs.blob_bytes(part))
                        while view:
                            written = fh.write(view)
                            if not written:
                                raise OSError(errno.EIO, f"could not write {tmp}")
                            view = view[written:]
                if durably:
                    os.fsync(fh.fileno())
                else:
                    start_writeback(fh.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def _location(self, snapshot_id: str) -> str:
        return str(self._record_path(snapshot_id))

    def _record_ids(self) -> builtins.list[str]:
        try:
            names = os.listdir(self.root / "snapshots")
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise self._error("list its snapshots", exc) from exc
        ids = (name.removesuffix(".json") for name in names if name.endswith(".json"))
        return sorted(i for i in ids if manifest_mod.SNAPSHOT_ID_RE.match(i))

    def _read_record(self, snapshot_id: str) -> bytes | None:
        try:
            return self._record_path(snapshot_id).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._error(f"read the record of {snapshot_id}", exc) from exc

    def _create_record(self, snapshot_id: str, data: bytes) -> bool:
        path = self._record_path(snapshot_id)
        try:
            tmp = self._write_new(path, data)
            try:
                os.link(tmp, path)  # unlike rename, never replaces an existing record
            except FileExistsError:
                return False
            finally:
                tmp.unlink()
            _fsync_dir(path.parent)
        except OSError as exc:
            raise self._error(f"write the record of {snapshot_id}", exc) from exc
        return True

    def _delete_record(self, snapshot_id: str) -> None:
        path = self._record_path(snapshot_id)
        try:
            path.unlink(missing_ok=True)
            _fsync_dir(path.parent)
        except OSError as exc:
            raise self._error(f"delete the record of {snapshot_id}", exc) from exc

    def _adopt_file(self, name: str, source: Path) -> bool:
        """A hard link: the snapshot's file and the object are one inode, which neither
        ever changes (both are read-only), and each can be removed without the other."""
        path = self._object_path(name)
        try:
            private.make_dirs(path.parent, self.modes)
            os.link(source, path)
        except OSError as exc:
            if exc.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP):
                return False  # another file system, or a file this user may not link
            raise self._error(f"write {name}", exc) from exc
        with contextlib.suppress(OSError):  # one inode: the image's mode is the pack's
            if os.stat(path).st_mode & 0o777 != self.modes.read_only:
                os.chmod(path, self.modes.read_only)
        with contextlib.suppress(OSError):
            os.utime(path)  # a new object, as far as the clean-up's grace period goes
        with self._unsynced_lock:
            self._unsynced.update((path, path.parent))
        return True

    def _write_object(self, name: str, data: packs.Parts) -> None:
        """Written whole under a temporary name, renamed into place, its writeback
        started; made durable by :meth:`_sync_objects` before a record names it. One
        fsync a pack as it is written took 0.67 s for 300 MB here; all of them at the end,
        0.28 s. The parts are written one by one, never joined (fresh memory costs ~3 ms
        a MB here)."""
        path = self._object_path(name)
        try:
            os.replace(self._write_new(path, data, durably=False), path)
        except OSError as exc:
            raise self._error(f"write {name}", exc) from exc
        with self._unsynced_lock:
            self._unsynced.update((path, path.parent))

    def _sync_objects(self) -> None:
        with self._unsynced_lock:
            paths = set(self._unsynced)

        def sync(path: Path) -> None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                return  # removed meanwhile (a failed put's clean-up): nothing names it
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        directories = {p for p in paths if p.is_dir()}
        try:
            with ThreadPoolExecutor(max_workers=self.max_workers) as pool:
                builtins.list(pool.map(sync, paths - directories))  # the data, all at once
            for directory in directories:  # then the names
                sync(directory)
        except OSError as exc:
            raise self._error("sync its packs", exc) from exc
        with self._unsynced_lock:  # only now: a concurrent put may be relying on them
            self._unsynced -= paths

    def _read_object(self, name: str, offset: int, length: int) -> bytes | memoryview | None:
        """A view of the mapped file: no copy until the bytes land in an image file."""
        try:
            with self._object_path(name).open("rb") as fh:
                if os.fstat(fh.fileno()).st_size == 0:
                    return b""
                mapped = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
                return memoryview(mapped)[offset : offset + length]
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._error(f"read {name}", exc) from exc

    def close(self) -> None:
        """Nothing to let go: files are opened per call."""

    def tighten(self) -> builtins.list[Exposed]:
        """Make the store's directory and take from everything in it the access ``modes``
        gives nobody else."""
        try:
            private.make_dirs(self.root, self.modes)
        except OSError as exc:
            raise self._error("be created", exc) from exc
        return private.tighten(self.root, self.modes)

    def _list_objects(self, directory: str) -> Iterator[tuple[str, _ObjectStat]]:
        try:
            for sub in _scandir(self.root / directory):
                for entry in _scandir(Path(sub.path)):
                    name = f"{directory}/{sub.name}/{entry.name}"
                    if packs.is_object_name(name):
                        with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                            st = entry.stat()
                            yield name, _ObjectStat(st.st_size, st.st_mtime)
        except OSError as exc:
            raise self._error(f"list its {directory}", exc) from exc

    def _delete_objects(self, names: builtins.list[str]) -> None:
        """On a pool: an unlink of a freshly written file costs ~1 ms on ext4 here."""

        def delete(name: str) -> None:
            try:
                self._object_path(name).unlink(missing_ok=True)
            except OSError as exc:
                raise self._error(f"delete {name}", exc) from exc

        with ThreadPoolExecutor(max_workers=self.max_workers) as pool:
            builtins.list(pool.map(delete, names))

    def _list_puts(self) -> builtins.list[tuple[str, float]]:
        found = []
        try:
            for entry in _scandir(self.root / PUTS_DIR):
                if not entry.name.startswith("."):
                    with contextlib.suppress(FileNotFoundError):  # ended since the listing
                        found.append((entry.name, entry.stat().st_mtime))
        except OSError as exc:
            raise self._error("list the puts in progress", exc) from exc
        return found

    def _write_put(self, name: str, data: bytes) -> None:
        path = self.root / PUTS_DIR / name
        try:
            os.replace(self._write_new(path, data), path)
        except OSError as exc:
            raise self._error(f"write {PUTS_DIR}/{name}", exc) from exc

    def _read_put(self, name: str) -> bytes | None:
        try:
            return (self.root / PUTS_DIR / name).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._error(f"read {PUTS_DIR}/{name}", exc) from exc

    def _delete_put(self, name: str) -> None:
        try:
            (self.root / PUTS_DIR / name).unlink(missing_ok=True)
        except OSError as exc:
            raise self._error(f"remove {PUTS_DIR}/{name}", exc) from exc

    def _location_of_put(self, name: str) -> str:
        return str(self.root / PUTS_DIR / name)

    def _disk_full(self, manifest: Manifest, exc: BaseException) -> StoreError | None:
        """Say that the disk is full, where, and how much was needed against what is free
        (measured after the failed put removed what it wrote)."""
        if not _is_disk_full(exc):
            return None
        where = self.root
        while not where.exists() and where != where.parent:
            where = where.parent
        try:
            usage = shutil.disk_usage(where)
        except OSError:
            return None
        return StoreError(
            f"The disk of the snapshot store {self.root} is full (no space left on device): "
            f"snapshot {manifest.id} needs up to {human_bytes(manifest.total_bytes)} there "
            "(its size before compression and deduplication), and "
            f"{human_bytes(usage.free)} of {human_bytes(usage.total)} are free.",
            hint="Free space on that disk (delete old snapshots, or set keep_last or "
            "max_bytes), or move the store to a larger disk; then retry.",
        )

    def _sweep(self) -> None:
        """Also remove temporary files that a killed put left behind."""
        super()._sweep()
        cutoff = time.time() - self.grace_seconds
        for tmp in [
            *self.root.glob("packs/*/.*.tmp"),
            *self.root.glob("chunks/*/.*.tmp"),
            *self.root.glob("snapshots/.*.tmp"),
        ]:
            with contextlib.suppress(FileNotFoundError):
                if tmp.stat().st_mtime <= cutoff:
                    tmp.unlink()


def _is_disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` or what caused it is ENOSPC or EDQUOT."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def _scandir(path: Path) -> builtins.list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as entries:
            return builtins.list(entries)
    except FileNotFoundError:
        return []


_NETWORK_HINT = "Check that {endpoint} is reachable from this machine, then retry."
_CREDENTIALS_HINT = (
    "Check the AWS credentials (environment variables, ~/.aws/credentials or the instance "
    "role) and that they may list, read, write and delete under s3://{bucket}/{prefix}."
)
_CREDENTIAL_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
}


class S3Encryption(NamedTuple):
    """Server-side encryption of the objects an S3 store writes (SSE-S3 or SSE-KMS)."""

    mode: str = ""
    """"" (the bucket's default), "AES256" (SSE-S3) or "aws:kms" (SSE-KMS)."""
    kms_key_id: str = ""
    """With "aws:kms": the key (id, ARN or alias); "" for the account's aws/s3 key."""

    def put_args(self) -> dict[str, str]:
        """The PutObject arguments that ask for it."""
        if self.mode not in ("", "AES256", "aws:kms"):
            raise StoreError(
                f"Unknown S3 server-side encryption {self.mode!r}.",
                hint='Set s3_server_side_encryption to "AES256" (SSE-S3), "aws:kms" (SSE-KMS) '
                'or "" (the bucket\'s default).',
            )
        if self.kms_key_id and self.mode != "aws:kms":
            raise StoreError(
                "An S3 KMS key id is set, but server-side encryption is not aws:kms.",
                hint='Set s3_server_side_encryption to "aws:kms", or clear s3_sse_kms_key_id.',
            )
        args = {"ServerSideEncryption": self.mode} if self.mode else {}
        if self.kms_key_id:
            args["SSEKMSKeyId"] = self.kms_key_id
        return args


class S3Store(_ChunkStore):
    """A store in an S3 bucket under a prefix (one prefix per user keeps users apart).

    Credentials come from boto3's standard chain. Packs are a single PUT each (16 MiB by
    default); reads are ranged GETs of the chunks a restore needs, coalesced. Every object
    is written private (no ACL grants) and with ``encryption`` if it is set.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        client: Any = None,
        max_workers: int = 8,
        *,
        encryption: S3Encryption | None = None,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        chunking: ChunkParams | None = None,
        pack_bytes: int = packs.DEFAULT_PACK_BYTES,
        repack_below: float = REPACK_BELOW,
    ) -> None:
        super().__init__(
            max_workers=max_workers,
            grace_seconds=grace_seconds,
            chunking=chunking,
            pack_bytes=pack_bytes,
            repack_below=repack_below,
        )
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._put_args: dict[str, Any] = (encryption or S3Encryption()).put_args()
        self.list_page_size = 1000
        """Keys per listing request (S3's most)."""
        if client is None:
            import boto3
            from botocore.config import Config

            client = boto3.session.Session().client(
                "s3",
                endpoint_url=endpoint_url,
                region_name=region,
                config=Config(
                    max_pool_connections=max_workers + 4,
                    retries={"mode": "standard", "max_attempts": 3},
                    connect_timeout=10,
                    read_timeout=60,
                ),
            )
        self.client = client
        put_object = client.meta.service_model.operation_model("PutObject")
        if "IfNoneMatch" not in put_object.input_shape.members:
            raise StoreError(
                "This boto3 cannot write S3 objects conditionally (If-None-Match), which the "
                "store needs so that a snapshot is complete or absent.",
                hint="Upgrade boto3 and botocore to 1.35 or newer.",
            )

    def _key(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts) if self.prefix else parts)

    def _record_key(self, snapshot_id: str) -> str:
        return self._key("snapshots", f"{snapshot_id}.json")

    def _call(
        self, op: str, key: str, *, missing_ok: bool = False, exists_ok: bool = False, **kw: Any
    ) -> Any:
        """One S3 request; None for an expected 404 (missing_ok) or 412 (exists_ok)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self.client, op)(Bucket=self.bucket, Key=key, **kw)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if missing_ok and code in ("404", "NoSuchKey", "NotFound"):
                return None
            if exists_ok and code in ("412", "PreconditionFailed"):
                return None
            self._raise(op, key, exc)
        except BotoCoreError as exc:
            self._raise(op, key, exc)

    def _put(self, key: str, body: bytes, *, exists_ok: bool = False, **kw: Any) -> Any:
        """Every write: encrypted as configured, and private: no ACL is sent, so the object
        gets S3's default, the owner alone (a canned ACL, even "private", is refused by
        buckets whose ACLs are disabled, AWS's default since 2023)."""
        return self._call("put_object", key, exists_ok=exists_ok, Body=body, **self._put_args, **kw)

    def _raise(self, op: str, key: str, exc: Exception) -> NoReturn:
        from botocore.exceptions import (
            ClientError,
            ConnectionError,
            HTTPClientError,
            NoCredentialsError,
            PartialCredentialsError,
        )

        code = exc.response.get("Error", {}).get("Code", "") if isinstance(exc, ClientError) else ""
        if isinstance(exc, ConnectionError | HTTPClientError):
            hint = _NETWORK_HINT.format(endpoint=self.client.meta.endpoint_url)
        elif isinstance(exc, NoCredentialsError | PartialCredentialsError) or (
            code in _CREDENTIAL_CODES
        ):
            hint = _CREDENTIALS_HINT.format(bucket=self.bucket, prefix=self.prefix)
        elif code == "NoSuchBucket":
            hint = f"Create the bucket {self.bucket!r}, or correct the bucket name."
        else:
            hint = "Retry; if it keeps failing, check the S3 service and this store's settings."
        raise StoreError(f"S3 {op} of s3://{self.bucket}/{key} failed: {exc}", hint=hint) from exc

    def _read(self, key: str, **kw: Any) -> bytes | None:
        from botocore.exceptions import BotoCoreError

        response = self._call("get_object", key, missing_ok=True, **kw)
        if response is None:
            return None
        try:
            data: bytes = response["Body"].read()
        except BotoCoreError as exc:
            self._raise("get_object", key, exc)
        return data

    def _pages(self, under: str, start_after: str = "") -> Iterator[dict[str, Any]]:
        """Listing pages (up to ``list_page_size`` keys each) of the keys under ``under/``."""
        from botocore.exceptions import BotoCoreError, ClientError

        prefix = self._key(under) + "/"
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket,
            Prefix=prefix,
            StartAfter=start_after,
            PaginationConfig={"PageSize": self.list_page_size},
        )
        try:
            yield from pages
        except (BotoCoreError, ClientError) as exc:
            self._raise("list_objects_v2", prefix, exc)

    def _list(self, under: str, start_after: str = "") -> Iterator[dict[str, Any]]:
        for page in self._pages(under, start_after):
            yield from page.get("Contents", [])

    def _objects_under(self, directory: str) -> Iterator[dict[str, Any]]:
        """Every object under ``directory``: one request for a small store; past one page,
        the rest is listed per subdirectory (00 to ff) in parallel, since a million
        objects are a thousand pages, seconds when listed one after another."""
        pages = self._pages(directory)
        first = next(pages, {})
        contents = first.get("Contents", [])
        yield from contents
        if not first.get("IsTruncated"):
            return
        last = contents[-1]["Key"]
        sub = last.removeprefix(self._key(directory) + "/").split("/")[0]
        if not re.fullmatch(r"[0-9a-f]{2}", sub):  # not our layout: go on in order
            for page in pages:
                yield from page.get("Contents", [])
            return
        first_sub = int(sub, 16)
        with ThreadPoolExecutor(max_workers=self.max_workers) as pool:
            listings = pool.map(
                lambda d: builtins.list(
                    self._list(f"{directory}/{d:02x}", last if d == first_sub else "")
                ),
                range(first_sub, 256),
            )
            for objects in listings:
                yield from objects

    def _location(self, snapshot_id: str) -> str:
        return f"s3://{self.bucket}/{self._record_key(snapshot_id)}"

    def _record_ids(self) -> builtins.list[str]:
        names = (obj["Key"].rsplit("/", 1)[-1] for obj in self._list("snapshots"))
        ids = (name.removesuffix(".json") for name in names if name.endswith(".json"))
        return sorted(i for i in ids if manifest_mod.SNAPSHOT_ID_RE.match(i))

    def _read_record(self, snapshot_id: str) -> bytes | None:
        return self._read(self._record_key(snapshot_id))

    def _create_record(self, snapshot_id: str, data: bytes) -> bool:
        response = self._put(
            self._record_key(snapshot_id),
            data,
            exists_ok=True,
            IfNoneMatch="*",
            ContentType="application/json",
        )
        return response is not None

    def _delete_record(self, snapshot_id: str) -> None:
        self._call("delete_object", self._record_key(snapshot_id))

    def close(self) -> None:
        self.client.close()

    def _write_object(self, name: str, data: packs.Parts) -> None:
        body = b"".join(packs.blob_bytes(part) for part in data)
        self._put(self._key(name), body)

    def _sync_objects(self) -> None:
        """Nothing to do: S3 acknowledges a PUT only once the object is durable."""

    def _read_object(self, name: str, offset: int, length: int) -> bytes | None:
        return self._read(self._key(name), Range=f"bytes={offset}-{offset + length - 1}")

    def _list_objects(self, directory: str) -> Iterator[tuple[str, _ObjectStat]]:
        root = self._key() + "/" if self.prefix else ""
        for obj in self._objects_under(directory):
            name = obj["Key"].removeprefix(root)
            if packs.is_object_name(name):
                yield name, _ObjectStat(int(obj["Size"]), obj["LastModified"].timestamp())

    def _delete_objects(self, names: builtins.list[str]) -> None:
        """DeleteObjects, 1000 keys a request (S3's most)."""
        from botocore.exceptions import BotoCoreError, ClientError

        for start in range(0, len(names), 1000):
            keys = [{"Key": self._key(name)} for name in names[start : start + 1000]]
            try:
                response = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True}
                )
            except (BotoCoreError, ClientError) as exc:
                self._raise("delete_objects", self._key("packs"), exc)
            errors = response.get("Errors") or []
            if errors:
                first = errors[0]
                raise StoreError(
                    f"S3 delete_objects in s3://{self.bucket}/{self._key()} failed for "
                    f"{len(errors)} objects, e.g. {first.get('Key')}: {first.get('Code')} "
                    f"{first.get('Message')}",
                    hint=_CREDENTIALS_HINT.format(bucket=self.bucket, prefix=self.prefix),
                )

    def _list_puts(self) -> builtins.list[tuple[str, float]]:
        return [
            (obj["Key"].rsplit("/", 1)[-1], obj["LastModified"].timestamp())
            for obj in self._list(PUTS_DIR)
        ]

    def _write_put(self, name: str, data: bytes) -> None:
        self._put(self._key(PUTS_DIR, name), data)

    def _read_put(self, name: str) -> bytes | None:
        return self._read(self._key(PUTS_DIR, name))

    def _delete_put(self, name: str) -> None:
        self._call("delete_object", self._key(PUTS_DIR, name))

    def _location_of_put(self, name: str) -> str:
        return f"s3://{self.bucket}/{self._key(PUTS_DIR, name)}"
