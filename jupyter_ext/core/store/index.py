"""The store's index, with one owner (the repository; restic's ``internal/index``): the
records read so far (as compact :class:`~.record.Summary`), the trailers of packs read so
far, and where every needed chunk is now (:class:`Catalog`). Records and packs never
change, so both caches only forget: a record deleted, a pack gone from the listing. A
record is read fresh to tell whether it still exists."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from .. import manifest as manifest_mod
from ..errors import SnapshotCorruptError
from . import pack
from .api import ChunkRef, StoreError
from .backend import Backend, Kind, ObjectStat, layout
from .keys import Keyring
from .pack import Location
from .record import DIGEST, ChunkTable, Record, Summary

logger = logging.getLogger(__name__)


class Index:
    """Records, trailers and object listings of one store, cached where they cannot change."""

    def __init__(self, backend: Backend, max_workers: int, keyring: Keyring | None) -> None:
        self.backend = backend
        """Records and claims through it are sealed and opened (keys.SealedBackend)."""
        self.max_workers = max_workers
        self.keyring = keyring
        """The store's master key (None: a store without encryption)."""
        self._cache: dict[str, Summary] = {}
        self._cache_lock = threading.Lock()
        self._trailers: dict[str, Trailer] = {}
        """Trailers read so far, of packs that were there at the last listing."""
        self._legacy_objects: bool | None = None
        """Whether the store holds objects of format-1 records (``chunks/``), listed then
        with the packs; found out by the first listing, or a format-1 record."""

    def record_ids(self) -> list[str]:
        """Ids of all records (names that are not snapshot ids are ignored)."""
        ids = self.backend.names(Kind.RECORD)
        return sorted(i for i in ids if manifest_mod.SNAPSHOT_ID_RE.match(i))

    def load(self, snapshot_id: str) -> Record | None:
        """The whole record, read and parsed fresh (it may have been deleted elsewhere),
        or None."""
        data = self._read(snapshot_id)
        if data is None:
            return None
        record = Record.parse(snapshot_id, data)
        self.remember(record)
        return record

    def summary(self, snapshot_id: str) -> Summary | None:
        """The record's summary (parsed once), if the record still exists (read fresh)."""
        data = self._read(snapshot_id)
        if data is None:
            return None
        with self._cache_lock:
            cached = self._cache.get(snapshot_id)
        return cached or self.remember(Record.parse(snapshot_id, data))

    def try_summary(self, snapshot_id: str) -> Summary | SnapshotCorruptError | None:
        try:
            return self.summary(snapshot_id)
        except SnapshotCorruptError as exc:
            return exc

    def _read(self, snapshot_id: str) -> bytes | None:
        data = self.backend.load(layout.record(snapshot_id))
        if data is None:
            self.forget(snapshot_id)
            return None
        return bytes(data)

    def remember(self, record: Record) -> Summary:
        """A record this process wrote (or read): its summary, kept."""
        with self._cache_lock:
            cached = self._cache.get(record.manifest.id)
        if cached is not None:
            return cached
        summary = record.summary()
        if any(pack.LEGACY_NAME_RE.match(name) for name in summary.objects()):
            self._legacy_objects = True
        with self._cache_lock:
            return self._cache.setdefault(record.manifest.id, summary)

    def held(self) -> tuple[set[str], set[str]]:
        """What the index holds now: the ids of the records it keeps summaries of, and the
        names of the packs whose trailers it keeps."""
        with self._cache_lock:
            return set(self._cache), set(self._trailers)

    def forget(self, snapshot_id: str) -> None:
        with self._cache_lock:
            self._cache.pop(snapshot_id, None)

    def records(self, *, strict: bool) -> dict[str, Summary]:
        """Every record's summary; a damaged record raises (``strict``) or is logged and
        skipped."""
        ids = self.record_ids()
        with self._cache_lock:
            self._cache = {i: r for i, r in self._cache.items() if i in ids}
            missing = [i for i in ids if i not in self._cache]
            records = {i: self._cache[i] for i in ids if i in self._cache}
        with ThreadPoolExecutor(max_workers=self.max_workers) as pool:
            loaded = pool.map(self.try_summary, missing)
            for snapshot_id, result in zip(missing, loaded, strict=True):
                if isinstance(result, Summary):
                    records[snapshot_id] = result
                elif isinstance(result, SnapshotCorruptError):
                    if strict:
                        raise result
                    logger.warning("Skipping snapshot %s: %s", snapshot_id, result)
        return records

    def objects(self) -> dict[str, ObjectStat]:
        """Every pack (and chunk object of format-1 records) with its size and age. The
        trailers of packs not listed any more are forgotten."""
        objects = dict(self.backend.entries(Kind.PACK))
        if self._legacy_objects is not False:  # None: not known yet
            legacy = dict(self.backend.entries(Kind.LEGACY))
            self._legacy_objects = self._legacy_objects or bool(legacy)
            objects.update(legacy)
        for name in self._trailers.keys() - objects.keys():
            self._trailers.pop(name, None)
        return objects

    def trailer(self, name: str, size: int) -> Trailer:
        """The chunks a pack lists (read once: packs never change); none if unreadable."""
        cached = self._trailers.get(name)
        if cached is not None:
            return cached
        entries: list[pack.PackEntry] = []
        try:
            entries = self.read_trailer(name, size)
        except ValueError as exc:
            logger.warning("The trailer of pack %s cannot be read: %s", name, exc)
        trailer = self._trailers[name] = Trailer.of(name, entries)
        return trailer

    def read_trailer(self, name: str, size: int) -> list[pack.PackEntry]:
        """The chunks a pack of ``size`` bytes lists, read now; ValueError saying why not."""
        handle = layout.object_handle(name)
        if size < pack.FOOTER_SIZE:
            raise ValueError("it is shorter than a pack's footer")
        tail = min(size, 256 * 1024)
        read = self.backend.load(handle, size - tail, tail)
        if read is None:
            raise ValueError("it is gone")
        try:
            data = bytes(read)
            footer = data[-pack.FOOTER_SIZE :]
            length = pack.trailer_length(footer)
            sealer = None
            if pack.is_sealed_pack(footer):
                if self.keyring is None:
                    raise ValueError("it is encrypted, and this store has no key")
                sealer = self.keyring.sealer()
            start = len(data) - pack.FOOTER_SIZE - length
            if start < 0:
                more = self.backend.load(handle, size - pack.FOOTER_SIZE - length, -start)
                data = bytes(more or b"") + data
                start = 0
            return pack.parse_trailer(name, data[start : start + length], size, sealer)
        except IndexError as exc:
            raise ValueError(f"its trailer is malformed ({exc})") from exc

    def catalog(
        self,
        records: Iterable[Summary],
        objects: dict[str, ObjectStat] | None = None,
        wanted: Iterable[str] = (),
    ) -> Catalog:
        """Where the chunks of ``records`` (and the ``wanted`` ones) are now."""
        return Catalog(self, records, self.objects() if objects is None else objects, wanted)

    def locate_all(
        self,
        objects: dict[str, ObjectStat] | None = None,
        wanted: Iterable[str] = (),
        also: Summary | None = None,
    ) -> Catalog:
        """The catalog of every readable record (and ``also``, one being read)."""
        records = self.records(strict=False)
        if also is not None:
            records[also.manifest.id] = also
        return self.catalog(records.values(), objects, wanted)


def _digest_array(digests: Iterable[str]) -> npt.NDArray[np.void]:
    return np.array([bytes.fromhex(d) for d in digests], DIGEST)


@dataclass(frozen=True)
class Trailer:
    """The chunks a pack's trailer lists, as the index keeps it: columns, ~50 bytes a
    chunk. Once a repack has moved chunks, every catalog looks for them in the trailers
    of the packs no record names, the clean-up's garbage of the last hour (its grace
    period) among them; kept as PackEntry tuples (~340 bytes a chunk), those trailers
    grew the server by 200 MiB an hour into the soak, for good (bench/RESULTS.md)."""

    name: str
    digests: npt.NDArray[np.void]
    """Sorted (with the other columns in the same order)."""
    offsets: npt.NDArray[np.uint64]
    lengths: npt.NDArray[np.uint64]
    codecs: npt.NDArray[np.uint8]

    @classmethod
    def of(cls, name: str, entries: list[pack.PackEntry]) -> Trailer:
        digests = _digest_array(e.hash for e in entries)
        order = np.argsort(digests, kind="stable")  # a digest listed twice: its first place
        return cls(
            name,
            digests[order],
            np.array([e.where.offset for e in entries], np.uint64)[order],
            np.array([e.where.length for e in entries], np.uint64)[order],
            np.array([pack.CODECS.index(e.where.codec) for e in entries], np.uint8)[order],
        )

    def __len__(self) -> int:
        return len(self.digests)

    def find(self, wanted: npt.NDArray[np.void]) -> dict[str, Location]:
        """Where this pack holds any of the ``wanted`` digests (sha256 hex -> place)."""
        if not len(self.digests) or not len(wanted):
            return {}
        at = np.searchsorted(self.digests, wanted)
        hit = at < len(self.digests)
        hit[hit] = self.digests[at[hit]] == wanted[hit]
        return {
            wanted[i].tobytes().hex(): Location(
                self.name,
                int(self.offsets[row]),
                int(self.lengths[row]),
                pack.CODECS[int(self.codecs[row])],
            )
            for i, row in zip(np.flatnonzero(hit).tolist(), at[hit].tolist(), strict=True)
        }


class Catalog:
    """Where the chunks of the given records are now, in the objects that exist.

    A record's own location wins while its object exists; a chunk whose object is gone
    (a repack moved it) is looked up in the trailers of the packs no record names.

    Kept as numpy columns of the records' summaries, sorted by digest: every put and
    clean-up makes one over every retained snapshot's chunks (100 000 for six kernels of
    64 MiB). As a dict of Locations it made ~250 bytes of small objects a chunk each
    time; after the load the server's allocator kept the arenas they came from, ~60 MiB
    (bench/RESULTS.md). A Location is made when one is asked for.
    """

    def __init__(
        self,
        index: Index,
        records: Iterable[Summary],
        objects: dict[str, ObjectStat],
        wanted: Iterable[str] = (),
    ) -> None:
        """``wanted``: more chunks to look for (a put's, whose pack went meanwhile)."""
        self.objects = objects
        records = list(records)
        self._ids = [record.manifest.id for record in records]
        tables = [record.chunks for record in records]
        self._rows, self._names = _Rows.of(tables)
        """Every chunk of every record, in record order, where the record says; and every
        object the records name (then those trailers named), by number."""
        self._record = np.repeat(np.arange(len(tables)), [len(t) for t in tables])
        self._here = np.array([n in objects for n in self._names], bool)[self._rows.obj]
        """Whether each row's object exists."""
        here = np.flatnonzero(self._here)
        self._digests, first = np.unique(self._rows.digests[here], return_index=True)
        self._located = self._rows.take(here[first])
        """The first place of each digest whose object exists, sorted by digest."""
        gone = self._rows.digests[~self._here]
        lost = {v.tobytes().hex() for v in np.unique(gone[~np.isin(gone, self._digests)])}
        lost |= {digest for digest in wanted if self._row(digest) is None}
        self._moved: dict[str, Location] = {}
        """Chunks found in trailers."""
        # Packs no record names are where repacks put chunks; a later put may have reused
        # some chunks of such a pack (and named it) but not others: those are looked for
        # in the named packs too, last.
        looking = _digest_array(lost)
        named = set(self._names)
        unnamed = sorted(set(self.objects) - named)
        for name in [*unnamed, *sorted(set(self.objects) & named)]:
            if not lost:
                break
            if pack.PACK_NAME_RE.match(name):
                found = index.trailer(name, self.objects[name].size).find(looking)
                if found:
                    self._moved.update(found)
                    lost -= found.keys()
                    looking = _digest_array(lost)

    def _row(self, digest: str) -> int | None:
        key = np.void(bytes.fromhex(digest))
        row = int(np.searchsorted(self._digests, key))
        return row if row < len(self._digests) and self._digests[row] == key else None

    def find(self, digest: str) -> Location | None:
        """Where the chunk is now, if it is anywhere."""
        row = self._row(digest)
        if row is None:
            return self._moved.get(digest)
        return self._located.location(row, self._names)

    def find_all(self, digests: list[str]) -> list[Location | None]:
        """:meth:`find` of each digest, looked up together (a chunk at a time costs ~20 us
        of numpy calls: a later snapshot's lower levels, which the store has, are most of
        its chunks)."""
        if not digests:
            return []
        keys = _digest_array(digests)
        rows = np.searchsorted(self._digests, keys)
        inside = rows < len(self._digests)
        hit = np.zeros(len(keys), bool)
        hit[inside] = self._digests[rows[inside]] == keys[inside]
        return [
            self._located.location(int(row), self._names) if found else self._moved.get(digest)
            for digest, row, found in zip(digests, rows.tolist(), hit.tolist(), strict=True)
        ]

    def resolve(self, ref: ChunkRef) -> Location | None:
        if ref.where.obj in self.objects:
            return ref.where
        return self.find(ref.hash)

    def needs(self) -> Needs:
        """What the records need of each object, where their chunks are now. Raises
        StoreError if a chunk is nowhere: deleting by a wrong picture of the store could
        lose more."""
        rows = self._rows.take(np.arange(len(self._rows.obj)))  # a copy, to resolve
        away = np.flatnonzero(~self._here)
        at = np.searchsorted(self._digests, rows.digests[away])
        found = at < len(self._digests)
        found[found] = self._digests[at[found]] == rows.digests[away[found]]
        rows.put(away[found], self._located.take(at[found]))
        names = list(self._names)
        numbers = {name: number for number, name in enumerate(names)}
        for row in away[~found].tolist():
            digest = rows.digests[row].tobytes().hex()
            where = self._moved.get(digest)
            if where is None:
                raise StoreError(
                    f"Snapshot {self._ids[self._record[row]]} needs chunk {digest[:12]}…, "
                    "which is in no pack of the store, so nothing is removed now.",
                    hint="Delete that snapshot (it cannot be restored), then "
                    "the clean-up runs again.",
                )
            rows.obj[row] = numbers.setdefault(where.obj, len(names))
            if len(names) < len(numbers):
                names.append(where.obj)
            rows.offsets[row], rows.lengths[row] = where.offset, where.length
            rows.codecs[row] = pack.CODECS.index(where.codec)
        # Each chunk once per object that holds it.
        keys = np.empty((len(rows.obj), 36), np.uint8)
        keys[:, :4] = rows.obj.view(np.uint8).reshape(-1, 4)
        keys[:, 4:] = rows.digests.view(np.uint8).reshape(-1, 32)
        _, first = np.unique(keys.view(np.dtype((np.void, 36))).ravel(), return_index=True)
        return Needs(rows.take(first), names)


@dataclass
class _Rows:
    """Chunks as columns (ChunkTable's, with objects numbered across records)."""

    NUMBERS: ClassVar = (
        ("sizes", np.uint64),
        ("offsets", np.uint64),
        ("lengths", np.uint64),
        ("codecs", np.uint8),
    )
    digests: npt.NDArray[np.void]
    obj: npt.NDArray[np.uint32]
    sizes: npt.NDArray[np.uint64]
    offsets: npt.NDArray[np.uint64]
    lengths: npt.NDArray[np.uint64]
    codecs: npt.NDArray[np.uint8]

    @classmethod
    def of(cls, tables: list[ChunkTable]) -> tuple[_Rows, list[str]]:
        """The tables' chunks one after the other, and the objects they name, numbered."""
        numbers: dict[str, int] = {}
        obj = [
            np.array([numbers.setdefault(n, len(numbers)) for n in t.objects], np.uint32)[t.where]
            for t in tables
        ]

        def joined(arrays: list[npt.NDArray[Any]], dtype: npt.DTypeLike) -> npt.NDArray[Any]:
            return np.concatenate(arrays) if arrays else np.empty(0, dtype)

        rows = cls(
            joined([t.digests for t in tables], DIGEST),
            joined(obj, np.uint32),
            *(joined([getattr(t, name) for t in tables], dtype) for name, dtype in cls.NUMBERS),
        )
        return rows, list(numbers)

    def take(self, rows: npt.NDArray[np.intp]) -> _Rows:
        return _Rows(*(getattr(self, f.name)[rows] for f in fields(self)))

    def put(self, rows: npt.NDArray[np.intp], values: _Rows) -> None:
        """Set the places of ``rows`` (not their digests and sizes) to ``values``'."""
        for name in ("obj", "offsets", "lengths", "codecs"):
            getattr(self, name)[rows] = getattr(values, name)

    def location(self, row: int, names: list[str]) -> Location:
        codec = pack.CODECS[int(self.codecs[row])]
        return Location(names[self.obj[row]], int(self.offsets[row]), int(self.lengths[row]), codec)


class Needs:
    """What the records need of each object: its bytes still needed, and for a repack the
    chunks themselves (made for the few packs rewritten, not for all)."""

    def __init__(self, rows: _Rows, names: list[str]) -> None:
        self._rows, self._names = rows, names
        totals = np.zeros(len(names), np.uint64)
        np.add.at(totals, rows.obj, rows.lengths)
        self.bytes = {names[n]: int(totals[n]) for n in np.unique(rows.obj).tolist()}
        """Object -> bytes of it the records need."""

    def chunks(self, name: str) -> dict[str, tuple[int, Location]]:
        """sha256 -> (size, where) of every chunk the records need of object ``name``."""
        rows = np.flatnonzero(self._rows.obj == self._names.index(name))
        return {
            self._rows.digests[row].tobytes().hex(): (
                int(self._rows.sizes[row]),
                self._rows.location(row, self._names),
            )
            for row in rows.tolist()
        }
