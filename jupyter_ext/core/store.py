"""Where snapshots are kept: a local directory or an S3 bucket, in one format.

Layout under a store's root (a directory, or ``<bucket>/<prefix>``)::

    chunks/<hh>/<sha256>    one piece of an image file, zstd-compressed; keyed by the sha256
                            of its uncompressed bytes, so equal pieces are stored once
    snapshots/<id>.json     the snapshot's record: its manifest and the chunks of each file
    puts/<token>.json       a claim: a put in progress, listing the chunks it relies on
    puts/<token>.cleaning   a clean-up in progress (who runs it: host, pid, start time)

Images are cut with page-aligned content-defined chunking (``chunking.py``), so successive
snapshots of one kernel share most chunks. A put uploads the chunks first and writes the
record last, without overwriting (S3: ``If-None-Match: *``; locally: a hard link), so a
snapshot is listed complete or not at all. Chunks no longer referenced are swept after a
grace period; a put refreshes the timestamp of old chunks it reuses, so a concurrent sweep
leaves them alone.

A put that fails removes at once the chunks it wrote or reused that no record references
and no other put claims (restic's prune, with claims for its locks). Each put keeps a
claim listing its chunks, rewritten every ``claim_refresh_seconds``; a clean-up first
writes its own marker, then reads the claims, then the records, and spares every chunk a
live claim lists. A put publishes its whole list before it commits, waits while any
clean-up marker is fresh, and only then checks that all its chunks exist: so a chunk
either is spared, or its deletion is seen and the put fails rather than record it. The
chunks of a claim nobody refreshed for ``claim_stale_seconds`` (a killed put) are removed
the same way by the next put or delete.
"""

from __future__ import annotations

import abc
import builtins
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
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
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, NamedTuple, NoReturn, Protocol, TypeVar

import zstandard

from . import manifest as manifest_mod
from .chunking import ChunkParams, auto_chunk_kib, iter_chunks
from .errors import SnapshotCorruptError, SnapshotError, SnapshotNotFoundError
from .humanize import human_bytes
from .manifest import Manifest

logger = logging.getLogger(__name__)

RECORD_FORMAT = 1
DEFAULT_GRACE_SECONDS = 3600.0
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
PUTS_DIR = "puts"
ZSTD_LEVEL = 1
"""zstd level 1: ~500 MB/s a core on memory images; level 3 is 25-50 % slower for ~1 % less."""

Progress = Callable[[dict[str, Any]], None]
_HASH_RE = re.compile(r"^[0-9a-f]{64}$")
_T = TypeVar("_T")


class StoreError(SnapshotError):
    """The store could not be read or written (network, permissions, disk, bucket)."""

    code = "store-error"


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a file, in file order."""

    hash: str
    """sha256 of the uncompressed bytes."""
    size: int
    stored_size: int


@dataclass
class StoredSnapshot:
    """A complete snapshot in a store."""

    manifest: Manifest
    stored_bytes: int
    """Compressed bytes of its distinct chunks (shared ones included)."""
    new_bytes: int
    """Compressed bytes the put that stored it actually added."""
    chunk_count: int
    """Distinct chunks."""
    location: str
    """Where its record is: a path or an ``s3://`` URL."""


@dataclass(frozen=True)
class StoreStats:
    snapshot_count: int
    chunk_count: int
    stored_bytes: int
    """Compressed bytes of all chunks, unreferenced ones not yet swept included."""


class SnapshotStore(Protocol):
    """What the snapshot manager needs from a store."""

    def put(self, snapshot_dir: Path, progress: Progress | None = None) -> StoredSnapshot: ...

    def list(self) -> builtins.list[StoredSnapshot]: ...

    def get(self, snapshot_id: str) -> StoredSnapshot: ...

    def fetch(self, snapshot_id: str, dest_dir: Path, progress: Progress | None = None) -> Path: ...

    def delete(self, snapshot_id: str) -> None: ...

    def stats(self) -> StoreStats: ...

    def close(self) -> None: ...


class _ChunkStat(NamedTuple):
    stored_size: int
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

    def distinct(self) -> dict[str, int]:
        """hash -> stored size of each distinct chunk."""
        return {ref.hash: ref.stored_size for refs in self.chunks.values() for ref in refs}

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "format": RECORD_FORMAT,
                "manifest": self.raw_manifest,
                "chunks": {
                    path: [
                        {"hash": r.hash, "size": r.size, "stored_size": r.stored_size} for r in refs
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
            if doc.get("format") != RECORD_FORMAT:
                raise ValueError(f"record format {doc.get('format')!r}, expected {RECORD_FORMAT}")
            manifest = Manifest.from_dict(doc["manifest"])
            if manifest.id != snapshot_id:
                raise ValueError(f"it holds the manifest of {manifest.id}")
            chunks = {
                path: [
                    ChunkRef(str(c["hash"]), int(c["size"]), int(c["stored_size"])) for c in refs
                ]
                for path, refs in doc["chunks"].items()
            }
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
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SnapshotCorruptError(
                f"The store's record of snapshot {snapshot_id} is damaged: {exc}",
                hint="Delete this snapshot and pick another one.",
            ) from exc


def _check_chunk_map(manifest: Manifest, chunks: dict[str, builtins.list[ChunkRef]]) -> None:
    expected = {entry.path: entry.size for entry in manifest.files}
    if set(chunks) != set(expected) or len(expected) != len(manifest.files):
        raise ValueError("its chunk lists do not match the manifest's files")
    for path, refs in chunks.items():
        _safe_relpath(path)
        if sum(r.size for r in refs) != expected[path]:
            raise ValueError(f"the chunks of {path} do not add up to its size")
        for ref in refs:
            if not _HASH_RE.match(ref.hash) or ref.size <= 0 or ref.stored_size <= 0:
                raise ValueError(f"a chunk of {path} is malformed")


def _safe_relpath(path: str) -> PurePosixPath:
    """A manifest path as a relative path that stays inside the snapshot directory."""
    pure = PurePosixPath(path)
    if (
        not path
        or pure.is_absolute()
        or any(part in ("", ".", "..") for part in path.split("/"))
        or "\\" in path
        or path == manifest_mod.MANIFEST_NAME
    ):
        raise ValueError(f"file path {path!r} is not allowed in a snapshot")
    return pure


def _check_id(snapshot_id: str) -> None:
    if not isinstance(snapshot_id, str) or not manifest_mod.SNAPSHOT_ID_RE.match(snapshot_id):
        raise SnapshotNotFoundError(
            f"{snapshot_id!r} is not a snapshot id (32 lowercase hex digits).",
            hint="Use an id as listed by the store.",
        )


def _sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


class _Codec(threading.local):
    """zstd (de)compressor objects are not thread-safe: one pair per worker thread."""

    def __init__(self) -> None:
        self.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        self.decompressor = zstandard.ZstdDecompressor()


class _Bounded:
    """Runs tasks on a pool with at most ``limit`` in flight; results come back in order.

    The bound keeps memory at a few chunks a worker; taking results in order lets the
    calling thread alone report progress.
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
        self._pending.clear()


class _ChunkStore(abc.ABC):
    """The format and the algorithms; subclasses only move bytes (``_``-methods below)."""

    def __init__(
        self,
        *,
        max_workers: int,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        chunking: ChunkParams | None = None,
    ) -> None:
        self.max_workers = max_workers
        self.grace_seconds = grace_seconds
        self.chunking = chunking
        """Fixed chunk sizes; None picks them per snapshot (:func:`auto_chunk_kib`)."""
        self._codec = _Codec()
        self._cache: dict[str, _Record] = {}
        self._cache_lock = threading.Lock()
        self.claim_refresh_seconds = CLAIM_REFRESH_SECONDS
        self.marker_refresh_seconds = MARKER_REFRESH_SECONDS
        self.claim_stale_seconds = CLAIM_STALE_SECONDS
        self.marker_stale_seconds = MARKER_STALE_SECONDS
        self._leftovers: dict[str, set[str]] = {}
        """Failed puts whose clean-up failed too (store unreachable): claim token -> the
        chunks to remove; tried again after the next put and by every delete."""
        self._leftover_markers: set[str] = set()
        """Clean-up markers that could not be removed (tried again first thing)."""
        self._leftovers_lock = threading.Lock()

    # -- the backend -----------------------------------------------------------------

    @abc.abstractmethod
    def _location(self, snapshot_id: str) -> str: ...

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
    def _stat_chunk(self, digest: str) -> _ChunkStat | None: ...

    @abc.abstractmethod
    def _write_chunk(self, digest: str, data: bytes) -> None:
        """Store a chunk; overwriting an equal one is harmless."""

    @abc.abstractmethod
    def _sync_chunks(self) -> None:
        """Make the chunks written so far durable, before a record names them."""

    @abc.abstractmethod
    def _read_chunk(self, digest: str) -> bytes | None: ...

    @abc.abstractmethod
    def _touch_chunk(self, digest: str) -> None:
        """Make the chunk's timestamp now, so that a sweep leaves it alone for a while."""

    @abc.abstractmethod
    def _list_chunks(self) -> Iterator[tuple[str, _ChunkStat]]: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Let go of connections (the store is not used afterwards)."""

    def _chunk_index(self) -> dict[str, _ChunkStat] | None:
        """Every chunk at once, where one listing is cheaper than a question per chunk;
        None to ask per chunk (``_stat_chunk``)."""
        return None

    @abc.abstractmethod
    def _delete_chunk(self, digest: str, older_than: float) -> None:
        """Delete the chunk if its timestamp (read again now) is still before ``older_than``."""

    @abc.abstractmethod
    def _delete_chunks(self, digests: builtins.list[str]) -> None:
        """Delete these chunks (missing ones are fine)."""

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

    # -- the API ---------------------------------------------------------------------

    def put(self, snapshot_dir: Path, progress: Progress | None = None) -> StoredSnapshot:
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
            # The claim exists before the put relies on any chunk, and lists them as it goes.
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
        chunks, new_bytes = upload.run()
        self._write_claim(token, manifest.id, upload.relied_on())
        _report(upload.progress, "committing", manifest.total_bytes, manifest.total_bytes)
        self._wait_for_cleanups()
        upload.recheck()
        distinct = {ref.hash: ref.stored_size for refs in chunks.values() for ref in refs}
        record = _Record(
            raw, manifest, chunks, sum(distinct.values()), new_bytes, upload.params.kib
        )
        self._sync_chunks()
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

    def _write_claim(self, token: str, snapshot_id: str, chunks: set[str]) -> None:
        claim = {
            "snapshot_id": snapshot_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "chunks": sorted(chunks),
        }
        self._write_put(f"{token}.json", json.dumps(claim).encode())

    def _after_failed_put(
        self, token: str, manifest: Manifest, upload: _Upload, exc: BaseException
    ) -> BaseException:
        """Remove what the failed put wrote (unless others rely on it); the error to raise."""
        candidates = upload.relied_on()
        try:
            self._collect(candidates, own={token})
        except SnapshotError as cleanup_exc:
            logger.warning(
                "The failed put of snapshot %s is cleaned up later (%d chunks): %s",
                manifest.id,
                len(candidates),
                cleanup_exc,
            )
            with self._leftovers_lock:
                self._leftovers[token] = candidates
        return self._disk_full(manifest, exc) or exc

    def _chunking_for(self, manifest: Manifest) -> ChunkParams:
        """The configured chunk sizes, or automatic ones that follow the parent snapshot's."""
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

    def fetch(self, snapshot_id: str, dest_dir: Path, progress: Progress | None = None) -> Path:
        """Rebuild the snapshot directory at ``dest_dir`` (which must not exist), verified.

        Everything is written to a hidden sibling and renamed into place, so ``dest_dir``
        is complete or absent.
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
            staging.mkdir(parents=True)
            # Locked while it is written (also across the rename, the same directory), so
            # that a clean-up after crashes tells it from one a dead process left.
            lock = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            fcntl.flock(lock, fcntl.LOCK_EX)
            _Download(self, record, staging, progress).run()
            with (staging / manifest_mod.MANIFEST_NAME).open("x") as fh:
                fh.write(json.dumps(record.raw_manifest, indent=1, sort_keys=True))
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

    def delete(self, snapshot_id: str) -> None:
        """Remove the record, then sweep chunks nothing references (past the grace period)."""
        self._require(snapshot_id)
        self._delete_record(snapshot_id)
        with self._cache_lock:
            self._cache.pop(snapshot_id, None)
        try:
            self._sweep()
        except SnapshotError as exc:
            logger.warning(
                "Snapshot %s deleted, but its chunks were not swept: %s", snapshot_id, exc
            )

    def stats(self) -> StoreStats:
        chunks = builtins.list(self._list_chunks())
        return StoreStats(
            snapshot_count=len(self._record_ids()),
            chunk_count=len(chunks),
            stored_bytes=sum(stat.stored_size for _, stat in chunks),
        )

    # -- internals -------------------------------------------------------------------

    def _sweep(self) -> None:
        """Delete unreferenced chunks older than the grace period, and what failed or
        killed puts left (see :meth:`_collect`)."""
        with self._leftovers_lock:
            leftovers = {token: set(chunks) for token, chunks in self._leftovers.items()}
        self._collect(set().union(*leftovers.values()), own=set(leftovers), sweep=True)
        with self._leftovers_lock:
            for token in leftovers:
                self._leftovers.pop(token, None)

    def _collect_leftovers(self) -> None:
        """After a put: clean up what earlier failed puts here (store unreachable then)
        and killed puts anywhere (stale claims) left, if there is any."""
        with self._leftovers_lock:
            leftovers = {token: set(chunks) for token, chunks in self._leftovers.items()}
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
        """Delete the ``candidates`` (and the chunks of stale claims) that no record
        references and no live claim lists; with ``sweep``, also unreferenced chunks older
        than the grace period. The claims ``own`` (of failed puts) are removed at the end.

        The marker is written first, then the claims are read, then the records: a put
        that publishes its claim after that reading sees the marker (or its clean-up
        done) before it checks its chunks. Chunks are listed before records for the sweep:
        a put that reuses a listed chunk refreshes its timestamp before writing its
        record, and ``_delete_chunk`` reads the timestamp again.
        """
        marker = f"{uuid.uuid4().hex}.cleaning"
        last_beat = [time.monotonic()]
        owner = json.dumps(_process_identity()).encode()

        def beat() -> None:
            self._write_put(marker, owner)
            last_beat[0] = time.monotonic()

        beat()
        try:
            with _Heartbeat(self.marker_refresh_seconds, beat):
                candidates = set(candidates)
                live: set[str] = set()
                finished: builtins.list[str] = []
                now = time.time()
                for name, mtime in self._list_puts():
                    token, _, kind = name.partition(".")
                    stale = mtime <= now - self._stale_after(name)
                    if name == marker or kind not in ("json", "cleaning"):
                        continue
                    if kind == "cleaning" or token in own:
                        if kind == "json" or stale:
                            finished.append(name)
                        continue
                    claimed = self._claimed_chunks(name, stale)
                    if stale:
                        candidates |= claimed
                        finished.append(name)
                    else:
                        live |= claimed
                listed = builtins.list(self._list_chunks()) if sweep else []
                referenced: set[str] = set()
                for record in self._all_records(strict=True).values():
                    referenced.update(record.distinct())
                doomed = sorted(candidates - referenced - live)
                cutoff = time.time() - self.grace_seconds
                old = {
                    digest
                    for digest, stat in listed
                    if digest not in referenced and digest not in live and stat.mtime <= cutoff
                }
                self._check_lease(last_beat[0])
                self._delete_chunks(doomed)
                for digest in sorted(old - set(doomed)):
                    self._check_lease(last_beat[0])
                    self._delete_chunk(digest, cutoff)
                for name in finished:
                    self._delete_put(name)
                if doomed:
                    logger.info("Removed %d chunks that failed puts left", len(doomed))
        finally:
            try:
                self._delete_put(marker)
            except SnapshotError:
                with self._leftovers_lock:
                    self._leftover_markers.add(marker)
                raise

    def _claimed_chunks(self, name: str, stale: bool) -> set[str]:
        """The chunks a claim lists; a live claim that cannot be read stops the clean-up."""
        data = self._read_put(name)
        try:
            if data is None:
                return set()  # its put ended meanwhile
            chunks = json.loads(data)["chunks"]
            if not all(isinstance(c, str) and _HASH_RE.match(c) for c in chunks):
                raise ValueError("not a list of chunk hashes")
            return set(chunks)
        except (ValueError, KeyError, TypeError) as exc:
            if stale:
                return set()
            raise StoreError(
                f"The claim {self._location_of_put(name)} of a put in progress cannot be "
                f"read ({exc}), so no chunk is removed now.",
                hint="Remove that file if no put is running, then retry.",
            ) from exc

    def _check_lease(self, last_beat: float) -> None:
        """Stop deleting once the marker may look stale to others (its heartbeat failed)."""
        if time.monotonic() - last_beat > self.marker_stale_seconds / 2:
            raise StoreError(
                "A clean-up of the store stopped: its marker could not be kept fresh.",
                hint="Check that the store is reachable; the clean-up is tried again later.",
            )

    def _wait_for_cleanups(self) -> None:
        """Wait while a clean-up that may not have seen this put's claim is deleting. The
        marker of a clean-up whose process is gone from this host (a server killed during
        it) is removed at once, not waited out."""
        while True:
            now = time.time()
            fresh = [
                name
                for name, mtime in self._list_puts()
                if name.endswith(".cleaning") and mtime > now - self.marker_stale_seconds
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
        with self._cache_lock:
            self._cache[snapshot_id] = record
        return record

    def _require(self, snapshot_id: str) -> _Record:
        _check_id(snapshot_id)
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

    def _compress_and_write(self, digest: str, data: bytes | memoryview) -> int:
        compressed = self._codec.compressor.compress(data)
        self._write_chunk(digest, compressed)
        return len(compressed)

    def _decompress(self, data: bytes, size: int) -> bytes:
        """Refuse a frame that claims another size before allocating for it."""
        if zstandard.frame_content_size(data) != size:
            raise ValueError("the compressed frame holds another size")
        return self._codec.decompressor.decompress(data, max_output_size=size)


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


class _Upload:
    """One put: chunk, hash and check each file; upload new chunks on a pool."""

    def __init__(
        self,
        store: _ChunkStore,
        root: Path,
        manifest: Manifest,
        params: ChunkParams,
        progress: Progress | None,
    ) -> None:
        self.store = store
        self.root = root
        self.manifest = manifest
        self.params = params
        self.progress = progress
        self.claimed: set[str] = set()
        """Chunks this put has already handled (or is handling)."""
        self.lock = threading.Lock()
        self.index: dict[str, _ChunkStat] | None = None
        """The store's chunks listed at the start, where the store lists them."""
        self.new_bytes = 0
        self.done_bytes = 0

    def run(self) -> tuple[dict[str, builtins.list[ChunkRef]], int]:
        chunks: dict[str, builtins.list[ChunkRef]] = {}
        total = self.manifest.total_bytes
        _report(self.progress, "uploading", 0, total)
        self.index = self.store._chunk_index()
        with ThreadPoolExecutor(max_workers=self.store.max_workers) as pool:
            tasks = _Bounded(pool, 2 * self.store.max_workers)
            try:
                for entry in self.manifest.files:
                    refs = chunks[entry.path] = []
                    for data in self._read_checked(entry):
                        self._done(refs, tasks.submit(self._chunk, data))
                    self._done(refs, tasks.drain())
            except BaseException:
                tasks.cancel()
                raise
        sizes = {
            ref.hash: ref.stored_size for refs in chunks.values() for ref in refs if ref.stored_size
        }
        for path, refs in chunks.items():
            chunks[path] = [ChunkRef(r.hash, r.size, sizes[r.hash]) for r in refs]
        return chunks, self.new_bytes

    def _done(self, refs: builtins.list[ChunkRef], done: Iterable[ChunkRef]) -> None:
        for ref in done:
            refs.append(ref)
            self.done_bytes += ref.size
            _report(self.progress, "uploading", self.done_bytes, self.manifest.total_bytes)

    def _read_checked(self, entry: manifest_mod.FileEntry) -> Iterator[bytes | memoryview]:
        """The file's chunks; raises at the end if its size or sha256 is not the manifest's."""
        try:
            path = self.root / _safe_relpath(entry.path)
        except ValueError as exc:
            raise _corrupt(self.manifest.id, str(exc)) from exc
        try:
            with path.open("rb") as fh:
                digest = hashlib.sha256()
                size = 0
                for data in iter_chunks(fh, self.params):
                    digest.update(data)
                    size += len(data)
                    yield data
        except FileNotFoundError as exc:
            raise _corrupt(self.manifest.id, f"{entry.path} is missing") from exc
        except OSError as exc:
            raise StoreError(f"Cannot read {path}: {exc}", hint=_os_hint(exc)) from exc
        if size != entry.size or digest.hexdigest() != entry.sha256:
            raise _corrupt(self.manifest.id, f"{entry.path} differs from its manifest entry")

    def _chunk(self, data: bytes | memoryview) -> ChunkRef:
        """Upload one chunk unless the store (or this put) has it; stored_size 0 = not known yet."""
        digest = _sha256(data)
        with self.lock:
            first = digest not in self.claimed
            self.claimed.add(digest)
        if not first:
            return ChunkRef(digest, len(data), 0)
        stat = self.index.get(digest) if self.index is not None else self.store._stat_chunk(digest)
        if stat is not None:
            if stat.mtime < time.time() - self.store.grace_seconds / 2:
                self.store._touch_chunk(digest)
            return ChunkRef(digest, len(data), stat.stored_size)
        stored = self.store._compress_and_write(digest, data)
        with self.lock:
            self.new_bytes += stored
        return ChunkRef(digest, len(data), stored)

    def relied_on(self) -> set[str]:
        """Every chunk this put has written, reused or is handling so far."""
        with self.lock:
            return set(self.claimed)

    def recheck(self) -> None:
        """Fail rather than record a chunk that a concurrent sweep or clean-up removed
        after all (reused ones, and written ones another failed put also wrote)."""
        relied = sorted(self.relied_on())
        index = self.store._chunk_index() if self.index is not None else None
        if index is not None:
            stats: Iterable[_ChunkStat | None] = [index.get(d) for d in relied]
        else:
            with ThreadPoolExecutor(max_workers=self.store.max_workers) as pool:
                stats = builtins.list(pool.map(self.store._stat_chunk, relied))
        for digest, stat in zip(relied, stats, strict=True):
            if stat is None:
                raise StoreError(
                    f"Chunk {digest[:12]}… of snapshot {self.manifest.id} was deleted while it "
                    "was being stored (a concurrent delete or clean-up removed it).",
                    hint="Store the snapshot again.",
                )


class _Download:
    """One fetch: GET and check chunks on a pool; write each file in order, hashing it.

    The calling thread writes and hashes each file sequentially as the chunks come back,
    so every file's size and sha256 are checked against the manifest without reading it
    again (the result passes ``manifest.verify``).
    """

    def __init__(
        self, store: _ChunkStore, record: _Record, staging: Path, progress: Progress | None
    ) -> None:
        self.store = store
        self.record = record
        self.staging = staging
        self.progress = progress
        self.done_bytes = 0

    def run(self) -> None:
        _report(self.progress, "downloading", 0, self.record.manifest.total_bytes)
        with ThreadPoolExecutor(max_workers=self.store.max_workers) as pool:
            tasks = _Bounded(pool, 2 * self.store.max_workers)
            try:
                for entry in self.record.manifest.files:
                    target = self.staging / _safe_relpath(entry.path)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    digest = hashlib.sha256()
                    with target.open("xb") as fh:
                        for ref in self.record.chunks[entry.path]:
                            self._write(fh, digest, tasks.submit(self._chunk, entry.path, ref))
                        self._write(fh, digest, tasks.drain())
                        fh.flush()
                        os.fsync(fh.fileno())
                    if digest.hexdigest() != entry.sha256:
                        raise _corrupt(
                            self.record.manifest.id, f"{entry.path} differs from its manifest entry"
                        )
            except BaseException:
                tasks.cancel()
                raise

    def _write(self, fh: BinaryIO, digest: hashlib._Hash, pieces: Iterable[bytes]) -> None:
        for data in pieces:
            fh.write(data)
            digest.update(data)
            self.done_bytes += len(data)
            _report(self.progress, "downloading", self.done_bytes, self.record.manifest.total_bytes)

    def _chunk(self, path: str, ref: ChunkRef) -> bytes:
        data = self.store._read_chunk(ref.hash)
        where = f"chunk {ref.hash[:12]}… of {path}"
        if data is None:
            raise _corrupt(self.record.manifest.id, f"{where} is missing from the store")
        try:
            raw = self.store._decompress(data, ref.size)
        except (zstandard.ZstdError, ValueError) as exc:
            raise _corrupt(self.record.manifest.id, f"{where} cannot be decompressed") from exc
        if len(raw) != ref.size or _sha256(raw) != ref.hash:
            raise _corrupt(self.record.manifest.id, f"{where} has the wrong sha256")
        return raw


def _process_identity(pid: int | None = None) -> dict[str, Any]:
    """Host, pid and start time of a process (this one by default): a pid reused by a
    later process has another start time. Empty start for a process that is gone."""
    pid = os.getpid() if pid is None else pid
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        start = stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        start = ""
    return {"host": socket.gethostname(), "pid": pid, "start": start}


def _corrupt(snapshot_id: str, what: str) -> SnapshotCorruptError:
    return SnapshotCorruptError(
        f"Snapshot {snapshot_id} is damaged: {what}.",
        hint="Pick another snapshot; this one cannot be restored.",
    )


def _report(progress: Progress | None, phase: str, done: int, total: int) -> None:
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(_ChunkStore):
    """A store in a local directory (or any mounted file system)."""

    def __init__(
        self,
        root: Path,
        *,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        chunking: ChunkParams | None = None,
        max_workers: int = 8,
    ) -> None:
        super().__init__(
            max_workers=max_workers,
            grace_seconds=grace_seconds,
            chunking=chunking,
        )
        self.root = Path(root)
        self._unsynced: set[Path] = set()
        """Chunk directories with renames not yet made durable (one fsync each per put)."""
        self._unsynced_lock = threading.Lock()

    def _chunk_path(self, digest: str) -> Path:
        return self.root / "chunks" / digest[:2] / digest

    def _record_path(self, snapshot_id: str) -> Path:
        return self.root / "snapshots" / f"{snapshot_id}.json"

    def _error(self, what: str, exc: OSError) -> StoreError:
        return StoreError(
            f"The snapshot store {self.root} cannot {what}: {exc.strerror or exc}",
            hint=_os_hint(exc),
        )

    def _write_new(self, path: Path, data: bytes) -> Path:
        """Write a uniquely named temporary file next to ``path``, durably."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with tmp.open("wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
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

    def _stat_chunk(self, digest: str) -> _ChunkStat | None:
        try:
            st = self._chunk_path(digest).stat()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._error(f"look up chunk {digest}", exc) from exc
        return _ChunkStat(st.st_size, st.st_mtime)

    def _write_chunk(self, digest: str, data: bytes) -> None:
        path = self._chunk_path(digest)
        try:
            os.replace(self._write_new(path, data), path)
        except OSError as exc:
            raise self._error(f"write chunk {digest}", exc) from exc
        with self._unsynced_lock:
            self._unsynced.add(path.parent)

    def _sync_chunks(self) -> None:
        with self._unsynced_lock:
            directories = set(self._unsynced)
        try:
            for directory in directories:
                _fsync_dir(directory)
        except OSError as exc:
            raise self._error(f"sync {directory}", exc) from exc
        with self._unsynced_lock:  # only now: a concurrent put may be relying on them
            self._unsynced -= directories

    def _read_chunk(self, digest: str) -> bytes | None:
        try:
            return self._chunk_path(digest).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._error(f"read chunk {digest}", exc) from exc

    def _touch_chunk(self, digest: str) -> None:
        try:
            os.utime(self._chunk_path(digest))
        except OSError as exc:
            raise self._error(f"touch chunk {digest}", exc) from exc

    def close(self) -> None:
        """Nothing to let go: files are opened per call."""

    def _list_chunks(self) -> Iterator[tuple[str, _ChunkStat]]:
        try:
            for sub in _scandir(self.root / "chunks"):
                for entry in _scandir(Path(sub.path)):
                    if _HASH_RE.match(entry.name):
                        st = entry.stat()
                        yield entry.name, _ChunkStat(st.st_size, st.st_mtime)
        except OSError as exc:
            raise self._error("list its chunks", exc) from exc

    def _delete_chunk(self, digest: str, older_than: float) -> None:
        path = self._chunk_path(digest)
        try:
            if path.stat().st_mtime <= older_than:
                path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._error(f"delete chunk {digest}", exc) from exc

    def _delete_chunks(self, digests: builtins.list[str]) -> None:
        """On a pool: an unlink of a freshly written file costs ~1 ms on ext4 here."""

        def delete(digest: str) -> None:
            try:
                self._chunk_path(digest).unlink(missing_ok=True)
            except OSError as exc:
                raise self._error(f"delete chunk {digest}", exc) from exc

        with ThreadPoolExecutor(max_workers=self.max_workers) as pool:
            builtins.list(pool.map(delete, digests))

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
        for tmp in [*self.root.glob("chunks/*/.*.tmp"), *self.root.glob("snapshots/.*.tmp")]:
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


class S3Store(_ChunkStore):
    """A store in an S3 bucket under a prefix (one prefix per user keeps users apart).

    Credentials come from boto3's standard chain. Chunks are at most
    ``ChunkParams.max_size`` (4 MiB), so every object is a single PUT: no multipart
    uploads, whose ETags are not content hashes (none are used as one here anyway).
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
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        chunking: ChunkParams | None = None,
    ) -> None:
        super().__init__(max_workers=max_workers, grace_seconds=grace_seconds, chunking=chunking)
        self.bucket = bucket
        self.prefix = prefix.strip("/")
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

    def _chunk_key(self, digest: str) -> str:
        return self._key("chunks", digest[:2], digest)

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

    def _read(self, key: str) -> bytes | None:
        from botocore.exceptions import BotoCoreError

        response = self._call("get_object", key, missing_ok=True)
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

    def _chunk_objects(self) -> Iterator[dict[str, Any]]:
        """Every chunk object: one request for a small store; past one page, the rest is
        listed per chunk directory (chunks/00 to chunks/ff) in parallel, since a store of a
        million chunks is a thousand pages, seconds when listed one after another."""
        pages = self._pages("chunks")
        first = next(pages, {})
        contents = first.get("Contents", [])
        yield from contents
        if not first.get("IsTruncated"):
            return
        last = contents[-1]["Key"]
        directory = last.removeprefix(self._key("chunks") + "/").split("/")[0]
        if not re.fullmatch(r"[0-9a-f]{2}", directory):  # not our layout: go on in order
            for page in pages:
                yield from page.get("Contents", [])
            return
        first_dir = int(directory, 16)
        with ThreadPoolExecutor(max_workers=self.max_workers) as pool:
            listings = pool.map(
                lambda d: builtins.list(
                    self._list(f"chunks/{d:02x}", last if d == first_dir else "")
                ),
                range(first_dir, 256),
            )
            for objects in listings:
                yield from objects

    def _head(self, digest: str) -> _ChunkStat | None:
        response = self._call("head_object", self._chunk_key(digest), missing_ok=True)
        if response is None:
            return None
        return _ChunkStat(int(response["ContentLength"]), response["LastModified"].timestamp())

    def _location(self, snapshot_id: str) -> str:
        return f"s3://{self.bucket}/{self._record_key(snapshot_id)}"

    def _record_ids(self) -> builtins.list[str]:
        names = (obj["Key"].rsplit("/", 1)[-1] for obj in self._list("snapshots"))
        ids = (name.removesuffix(".json") for name in names if name.endswith(".json"))
        return sorted(i for i in ids if manifest_mod.SNAPSHOT_ID_RE.match(i))

    def _read_record(self, snapshot_id: str) -> bytes | None:
        return self._read(self._record_key(snapshot_id))

    def _create_record(self, snapshot_id: str, data: bytes) -> bool:
        response = self._call(
            "put_object",
            self._record_key(snapshot_id),
            exists_ok=True,
            Body=data,
            IfNoneMatch="*",
            ContentType="application/json",
        )
        return response is not None

    def _delete_record(self, snapshot_id: str) -> None:
        self._call("delete_object", self._record_key(snapshot_id))

    def _stat_chunk(self, digest: str) -> _ChunkStat | None:
        return self._head(digest)

    def close(self) -> None:
        self.client.close()

    def _chunk_index(self) -> dict[str, _ChunkStat]:
        """One listing (1000 keys per request) instead of a HEAD per chunk: a snapshot has
        thousands of chunks, and a put asks for each twice (before and after)."""
        return dict(self._list_chunks())

    def _write_chunk(self, digest: str, data: bytes) -> None:
        self._call("put_object", self._chunk_key(digest), Body=data)

    def _sync_chunks(self) -> None:
        """Nothing to do: S3 acknowledges a PUT only once the object is durable."""

    def _read_chunk(self, digest: str) -> bytes | None:
        return self._read(self._chunk_key(digest))

    def _touch_chunk(self, digest: str) -> None:
        key = self._chunk_key(digest)
        self._call(
            "copy_object",
            key,
            CopySource={"Bucket": self.bucket, "Key": key},
            MetadataDirective="REPLACE",
            Metadata={"touched": str(int(time.time()))},
        )

    def _list_chunks(self) -> Iterator[tuple[str, _ChunkStat]]:
        for obj in self._chunk_objects():
            digest = obj["Key"].rsplit("/", 1)[-1]
            if _HASH_RE.match(digest):
                yield digest, _ChunkStat(int(obj["Size"]), obj["LastModified"].timestamp())

    def _delete_chunk(self, digest: str, older_than: float) -> None:
        stat = self._head(digest)
        if stat is not None and stat.mtime <= older_than:
            self._call("delete_object", self._chunk_key(digest))

    def _delete_chunks(self, digests: builtins.list[str]) -> None:
        """DeleteObjects, 1000 keys a request (S3's most)."""
        from botocore.exceptions import BotoCoreError, ClientError

        for start in range(0, len(digests), 1000):
            keys = [{"Key": self._chunk_key(d)} for d in digests[start : start + 1000]]
            try:
                response = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True}
                )
            except (BotoCoreError, ClientError) as exc:
                self._raise("delete_objects", self._key("chunks"), exc)
            errors = response.get("Errors") or []
            if errors:
                first = errors[0]
                raise StoreError(
                    f"S3 delete_objects in s3://{self.bucket}/{self._key('chunks')} failed for "
                    f"{len(errors)} chunks, e.g. {first.get('Key')}: {first.get('Code')} "
                    f"{first.get('Message')}",
                    hint=_CREDENTIALS_HINT.format(bucket=self.bucket, prefix=self.prefix),
                )

    def _list_puts(self) -> builtins.list[tuple[str, float]]:
        return [
            (obj["Key"].rsplit("/", 1)[-1], obj["LastModified"].timestamp())
            for obj in self._list(PUTS_DIR)
        ]

    def _write_put(self, name: str, data: bytes) -> None:
        self._call("put_object", self._key(PUTS_DIR, name), Body=data)

    def _read_put(self, name: str) -> bytes | None:
        return self._read(self._key(PUTS_DIR, name))

    def _delete_put(self, name: str) -> None:
        self._call("delete_object", self._key(PUTS_DIR, name))

    def _location_of_put(self, name: str) -> str:
        return f"s3://{self.bucket}/{self._key(PUTS_DIR, name)}"
