"""The store's index, with one owner (the repository; restic's ``internal/index``): the
records read so far, the trailers of packs read so far, and where every needed chunk is
now (:class:`Catalog`). Records and packs never change, so both caches only grow or
forget; a record is read fresh to tell whether it still exists."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from .. import manifest as manifest_mod
from ..errors import SnapshotCorruptError
from . import pack
from .api import ChunkRef
from .backend import Backend, Kind, ObjectStat, layout
from .keys import Keyring
from .pack import Location
from .record import Record

logger = logging.getLogger(__name__)


class Index:
    """Records, trailers and object listings of one store, cached where they cannot change."""

    def __init__(self, backend: Backend, max_workers: int, keyring: Keyring | None) -> None:
        self.backend = backend
        """Records and claims through it are sealed and opened (keys.SealedBackend)."""
        self.max_workers = max_workers
        self.keyring = keyring
        """The store's master key (None: a store without encryption)."""
        self._cache: dict[str, Record] = {}
        self._cache_lock = threading.Lock()
        self._trailers: dict[str, list[pack.PackEntry]] = {}
        """Trailers read so far (packs never change)."""
        self._legacy_objects: bool | None = None
        """Whether the store holds objects of format-1 records (``chunks/``), listed then
        with the packs; found out by the first listing, or a format-1 record."""

    def record_ids(self) -> list[str]:
        """Ids of all records (names that are not snapshot ids are ignored)."""
        ids = self.backend.names(Kind.RECORD)
        return sorted(i for i in ids if manifest_mod.SNAPSHOT_ID_RE.match(i))

    def load(self, snapshot_id: str) -> Record | None:
        """The record, read fresh (it may have been deleted elsewhere), or None."""
        data = self.backend.load(layout.record(snapshot_id))
        if data is None:
            self.forget(snapshot_id)
            return None
        with self._cache_lock:
            cached = self._cache.get(snapshot_id)
        if cached is not None:
            return cached
        record = Record.parse(snapshot_id, bytes(data))
        if any(pack.LEGACY_NAME_RE.match(name) for name in record.objects()):
            self._legacy_objects = True
        self.remember(record)
        return record

    def try_load(self, snapshot_id: str) -> Record | SnapshotCorruptError | None:
        try:
            return self.load(snapshot_id)
        except SnapshotCorruptError as exc:
            return exc

    def remember(self, record: Record) -> None:
        """A record this process wrote (or read)."""
        with self._cache_lock:
            self._cache[record.manifest.id] = record

    def forget(self, snapshot_id: str) -> None:
        with self._cache_lock:
            self._cache.pop(snapshot_id, None)

    def records(self, *, strict: bool) -> dict[str, Record]:
        """Every record; a damaged one raises (``strict``) or is logged and skipped."""
        ids = self.record_ids()
        with self._cache_lock:
            self._cache = {i: r for i, r in self._cache.items() if i in ids}
            missing = [i for i in ids if i not in self._cache]
            records = {i: self._cache[i] for i in ids if i in self._cache}
        with ThreadPoolExecutor(max_workers=self.max_workers) as pool:
            loaded = pool.map(self.try_load, missing)
            for snapshot_id, result in zip(missing, loaded, strict=True):
                if isinstance(result, Record):
                    records[snapshot_id] = result
                elif isinstance(result, SnapshotCorruptError):
                    if strict:
                        raise result
                    logger.warning("Skipping snapshot %s: %s", snapshot_id, result)
        return records

    def objects(self) -> dict[str, ObjectStat]:
        """Every pack (and chunk object of format-1 records) with its size and age."""
        objects = dict(self.backend.entries(Kind.PACK))
        if self._legacy_objects is not False:  # None: not known yet
            legacy = dict(self.backend.entries(Kind.LEGACY))
            self._legacy_objects = self._legacy_objects or bool(legacy)
            objects.update(legacy)
        return objects

    def trailer(self, name: str, size: int) -> list[pack.PackEntry]:
        """The chunks a pack lists (read once: packs never change); [] if unreadable."""
        if name in self._trailers:
            return self._trailers[name]
        entries: list[pack.PackEntry] = []
        handle = layout.object_handle(name)
        tail = min(size, 256 * 1024)
        read = self.backend.load(handle, size - tail, tail) if size >= pack.FOOTER_SIZE else None
        try:
            if read is None:
                return []
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
            entries = pack.parse_trailer(name, data[start : start + length], size, sealer)
        except (ValueError, IndexError) as exc:
            logger.warning("The trailer of pack %s cannot be read: %s", name, exc)
        self._trailers[name] = entries
        return entries

    def catalog(
        self,
        records: Iterable[Record],
        objects: dict[str, ObjectStat] | None = None,
        wanted: Iterable[str] = (),
    ) -> Catalog:
        """Where the chunks of ``records`` (and the ``wanted`` ones) are now."""
        return Catalog(self, records, self.objects() if objects is None else objects, wanted)

    def locate_all(
        self,
        objects: dict[str, ObjectStat] | None = None,
        wanted: Iterable[str] = (),
        also: Record | None = None,
    ) -> Catalog:
        """The catalog of every readable record (and ``also``, one being read)."""
        records = self.records(strict=False)
        if also is not None:
            records[also.manifest.id] = also
        return self.catalog(records.values(), objects, wanted)


class Catalog:
    """Where the chunks of the given records are now, in the objects that exist.

    A record's own location wins while its object exists; a chunk whose object is gone
    (a repack moved it) is looked up in the trailers of the packs no record names.
    """

    def __init__(
        self,
        index: Index,
        records: Iterable[Record],
        objects: dict[str, ObjectStat],
        wanted: Iterable[str] = (),
    ) -> None:
        """``wanted``: more chunks to look for (a put's, whose pack went meanwhile)."""
        self.objects = objects
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
            if pack.PACK_NAME_RE.match(name):
                for entry in index.trailer(name, self.objects[name].size):
                    if entry.hash in lost:
                        self.located[entry.hash] = entry.where
                        lost.discard(entry.hash)

    def resolve(self, ref: ChunkRef) -> Location | None:
        if ref.where.obj in self.objects:
            return ref.where
        return self.located.get(ref.hash)
