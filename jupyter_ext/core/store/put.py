"""A put as a pipeline (restic's archiver and packer, in one pass): the calling thread cuts
each file into chunks; a pool hashes and compresses them; the calling thread places them,
in order, into packs; another pool uploads the packs. Chunks the store already has are
not stored again; a local store adopts a new, incompressible memory image whole."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from .. import manifest as manifest_mod
from ..chunking import ChunkParams, iter_chunks
from ..manifest import Manifest
from ..protocol.progress import ProgressCallback
from . import pack
from .api import ChunkRef, StoreError, corrupt, os_hint, report
from .backend import Handle, Kind
from .index import Catalog, Index
from .pack import Location
from .sealing import Sealer
from .workers import Bounded, MappedFile, sha256_hex

logger = logging.getLogger(__name__)

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
BATCH_BYTES = 1 << 20
"""Chunks go to the hashing workers in batches of about this many bytes."""
REPORT_EVERY = 4 << 20
"""Progress is reported every this many bytes (or every 0.5 %, whichever is more)."""

_Piece = tuple[bytes | memoryview, str | None, bool]
"""A chunk to store: its bytes, the sha256 its manifest entry gives (if any), and whether
that is trusted (the file is as it was sealed)."""
_Prepared = tuple[str, int, bytes | memoryview | None, pack.Codec, Location | None]
"""A chunk ready to place: sha256, size, the blob to store (None: the store has it), codec,
and where the store has it (if it does)."""


class PutSettings(NamedTuple):
    max_workers: int
    pack_bytes: int
    adopts_images: bool


class Upload:
    """One put, as a pipeline: the calling thread cuts each file into chunks; a pool
    hashes and compresses them; the calling thread places them, in order, into packs;
    another pool uploads the pack. Chunks the store already has are not stored again."""

    def __init__(
        self,
        index: Index,
        settings: PutSettings,
        root: Path,
        manifest: Manifest,
        params: ChunkParams,
        progress: ProgressCallback | None,
    ) -> None:
        self.index = index
        self.backend = index.backend
        self.settings = settings
        self.root = root
        self.manifest = manifest
        self.params = params
        self.progress = progress
        self.files: dict[str, list[tuple[str, int]]] = {}
        """Each file's chunks (sha256, size), in order."""
        self.locations: dict[str, Location] = {}
        """Where each distinct chunk is: in a pack of this put, or one it reuses."""
        self.sources: dict[str, tuple[str, int, int]] = {}
        """Where each distinct chunk is in the snapshot: file, offset, size."""
        self.catalog: Catalog | None = None
        """Where the chunks the store has are (listed at the start)."""
        self.sealer: Sealer | None = None
        """The store's master key (None: not encrypted), from the start of the put."""
        self.lock = threading.Lock()
        self._relied: set[str] = set()
        self._written: set[str] = set()
        self.new_bytes = 0
        self.done_bytes = 0
        self.file_offset = 0
        """Where the next chunk starts in the file being cut."""
        self.file_fd = -1
        """The file being cut, open until the put ends (its packs are written later)."""
        self._fds: list[int] = []
        self._next_report = 0
        self.sealed: manifest_mod.Stamps = {}
        """Each file's stamp when it was sealed (or last checked): where a file still has
        it, its chunks' digests are trusted."""
        self.stamps: manifest_mod.Stamps = {}
        """Each file's stamp as this put found it (after its own link, if it adopted it):
        it must still have it when the record is written."""

    def known(self, digests: list[str]) -> list[Location | None]:
        """Where the store has each chunk, if this put may reuse it: an encrypted put reuses
        only sealed chunks (an unencrypted one, of a store from before its encryption,
        would stay readable to whoever reads the store). Looked up together: one at a time
        costs more than hashing them for a later snapshot, whose lower levels are most of
        its chunks."""
        if self.catalog is None:
            return [None] * len(digests)
        sealed = self.sealer is not None
        return [
            where if where is not None and (where.codec in pack.SEALED_CODECS) == sealed else None
            for where in self.catalog.find_all(digests)
        ]

    def relied_on(self) -> set[str]:
        """Every pack this put has written, is writing, or reuses chunks of."""
        with self.lock:
            return self._relied | self._written

    def written(self) -> set[str]:
        with self.lock:
            return set(self._written)

    def claim(self, name: str, *, drop: bool = False) -> None:
        """A pack this put writes (before it exists); ``drop``: one it did not write."""
        with self.lock:
            if drop:
                self._written.discard(name)
            else:
                self._written.add(name)

    def refs(self) -> dict[str, list[ChunkRef]]:
        return {
            path: [ChunkRef(digest, size, self.locations[digest]) for digest, size in chunks]
            for path, chunks in self.files.items()
        }

    def run(self) -> None:
        total = self.manifest.total_bytes
        report(self.progress, "uploading", 0, total)
        keyring = self.index.keyring
        self.sealer = None if keyring is None else keyring.sealer()
        self.catalog = self.index.locate_all()
        self.sealed = manifest_mod.sealed_stamps(self.root)
        try:
            with Packer(self) as packer, ThreadPoolExecutor(self.settings.max_workers) as pool:
                tasks = Bounded(pool, 2 * self.settings.max_workers)
                try:
                    for entry in self.manifest.files:
                        chunks = self.files[entry.path] = []
                        self.file_offset = 0
                        if self._reused(entry, chunks) or self._adopted(entry, chunks):
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

    def _prepare_all(self, batch: list[_Piece]) -> list[_Prepared]:
        """On a worker: a batch of chunks (a task per chunk cost more than hashing one):
        each hashed, unless its sealed digest is trusted (or checked against that digest),
        and compressed unless the store has it (a chunk this put has twice is compressed
        twice: which comes first is known only in order)."""
        digests = [self._digest(piece) for piece in batch]
        compressibility = pack.Compressibility()
        prepared: list[_Prepared] = []
        for (data, _, _), digest, where in zip(batch, digests, self.known(digests), strict=True):
            if where is not None:
                prepared.append((digest, len(data), None, "raw", where))
                continue
            blob, codec = pack.encode(data, compressibility.worth_trying(), self.sealer, digest)
            compressibility.saw(codec)
            prepared.append((digest, len(data), blob, codec, None))
        return prepared

    def _digest(self, piece: _Piece) -> str:
        data, expected, trusted = piece
        if expected is not None and trusted:
            return expected
        digest = hashlib.sha256(data).hexdigest()
        if expected is not None and digest != expected:
            raise corrupt(self.manifest.id, "a chunk differs from its manifest entry")
        return digest

    def _place(
        self,
        packer: Packer,
        path: str,
        chunks: list[tuple[str, int]],
        prepared: _Prepared,
    ) -> None:
        """On the calling thread, in file order: reuse or pack one chunk."""
        digest, size, blob, codec, known = prepared
        if digest not in self.locations:
            self.sources[digest] = (path, self.file_offset, size)
            if known is not None:
                where = known
                with self.lock:
                    self._relied.add(where.obj)
            else:
                assert blob is not None
                stored: pack.Blob = blob
                if codec == "raw":  # copied from the file where the store can
                    stored = pack.FileSlice(self.file_fd, self.file_offset, memoryview(blob))
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
            report(self.progress, "uploading", self.done_bytes, total)

    def _read_checked(self, entry: manifest_mod.FileEntry) -> Iterator[list[_Piece]]:
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
                mapped = MappedFile(fh)
                if len(mapped.view) != entry.size:
                    raise corrupt(self.manifest.id, f"{entry.path} has changed in size")
                digest = None
                if entry.chunks is None:
                    digest = hasher.submit(sha256_hex, mapped.view)
                    pieces: Iterator[_Piece] = (
                        (data, None, False) for data in iter_chunks(mapped, self.params)
                    )
                else:
                    pieces = ((mapped.read(n), expected, trusted) for expected, n in entry.chunks)
                batch: list[_Piece] = []
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
            raise corrupt(self.manifest.id, f"{entry.path} is missing") from exc
        except OSError as exc:
            raise StoreError(f"Cannot read {path}: {exc}", hint=os_hint(exc)) from exc
        if size != entry.size or file_hash != entry.sha256:
            raise corrupt(self.manifest.id, f"{entry.path} differs from its manifest entry")

    def _trusted(self, entry: manifest_mod.FileEntry) -> bool:
        """Stamp the file as this put finds it; whether it is as it was sealed."""
        try:
            now = manifest_mod.stamp(self._path(entry.path))
        except OSError:
            return False  # reading it says why
        self.stamps[entry.path] = now
        return entry.path in self.sealed and self.sealed[entry.path] == now

    def _adopted(self, entry: manifest_mod.FileEntry, chunks: list[tuple[str, int]]) -> bool:
        """Adopt a memory image as an image pack, if the store can and it is worth it
        (ADOPT_NEW_SHARE); its chunks are then located in it, in file order."""
        if (
            not self.settings.adopts_images
            or entry.chunks is None
            or entry.size < self.settings.pack_bytes
            or not self._trusted(entry)
        ):
            return False
        firsts: dict[str, int] = {}
        for digest, size in entry.chunks:
            firsts.setdefault(digest, size)
        places = dict(zip(firsts, self.known(list(firsts)), strict=True))
        new = sum(n for d, n in firsts.items() if d not in self.locations and not places[d])
        if new < ADOPT_NEW_SHARE * entry.size or self._saving(entry) >= ADOPT_MAX_SAVING:
            return False
        path = self._path(entry.path)
        name = pack.new_image_pack_name()
        self.claim(name)  # claimed before it exists
        if not self.backend.adopt(Handle(Kind.PACK, name), path):
            self.claim(name, drop=True)
            return False
        self.stamps[entry.path] = manifest_mod.stamp(path)  # the link changed its ctime
        offset = 0
        for digest, size in entry.chunks:
            if digest not in self.locations:
                self.sources[digest] = (entry.path, offset, size)
                where = places[digest]
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

    def _reused(self, entry: manifest_mod.FileEntry, chunks: list[tuple[str, int]]) -> bool:
        """A file as it was sealed whose every chunk the store has (a lower level of a
        tracked snapshot's chain, stored with the snapshot before): its chunks are located,
        nothing is read, hashed or handed to the workers."""
        if entry.chunks is None or not self._trusted(entry):
            return False
        digests = [digest for digest, _ in entry.chunks]
        places = self.known(digests)
        if any(
            where is None and digest not in self.locations
            for digest, where in zip(digests, places, strict=True)
        ):
            return False
        offset = 0
        for (digest, size), where in zip(entry.chunks, places, strict=True):
            if digest not in self.locations:
                assert where is not None
                self.sources[digest] = (entry.path, offset, size)
                self.locations[digest] = where
                with self.lock:
                    self._relied.add(where.obj)
            chunks.append((digest, size))
            offset += size
        self._advance(entry.size)
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
                blob, _ = pack.encode(data)
                raw += len(data)
                stored += len(blob)
        return 1 - stored / raw if raw else 0.0

    def check_unchanged(self) -> None:
        """Before the record is written: every file is still as this put found it (the
        bytes stored are the bytes hashed); those stamps become the seal's (what the image
        cache admits the directory by). A file whose ctime alone moved had a link made or
        removed meanwhile (a resumed kernel deletes its suspended dump, which shares the
        inodes): its bytes are hashed again instead."""
        entries = {entry.path: entry for entry in self.manifest.files}
        changed = []
        for rel, value in self.stamps.items():
            path = self._path(rel)
            try:
                now = manifest_mod.stamp(path)
            except OSError:
                changed.append(rel)
                continue
            if now == value:
                continue
            if now[:3] == value[:3] and rel in entries and manifest_mod.holds(path, entries[rel]):
                self.stamps[rel] = now
                continue
            changed.append(rel)
        if changed:
            raise corrupt(self.manifest.id, f"{sorted(changed)[0]} changed while it was stored")
        try:
            manifest_mod.write_sealed_stamps(self.root, self.stamps)
        except OSError as exc:  # only the image cache needs them
            logger.warning("Could not update the stamps of %s: %s", self.root, exc)

    def _path(self, relpath: str) -> Path:
        try:
            return self.root / manifest_mod.safe_relpath(relpath)
        except ValueError as exc:
            raise corrupt(self.manifest.id, str(exc)) from exc

    def recheck(self) -> list[str]:
        """After the claim is published and clean-ups are waited out: find chunks whose pack
        a concurrent clean-up removed (moved ones get their new place); the lost ones."""
        objects = self.index.objects()
        gone = [digest for digest, where in self.locations.items() if where.obj not in objects]
        if not gone:
            return []
        catalog = self.index.locate_all(objects, gone)
        lost = []
        for digest in gone:
            where = catalog.find(digest)
            if where is not None:
                self.locations[digest] = where
                with self.lock:
                    self._relied.add(where.obj)
            else:
                lost.append(digest)
        return lost

    def upload_again(self, digests: list[str]) -> None:
        """Pack the lost chunks again, read from the snapshot's files."""
        with Packer(self) as packer:
            for digest in digests:
                relpath, offset, size = self.sources[digest]
                path = self._path(relpath)
                try:
                    with path.open("rb") as fh:
                        data = os.pread(fh.fileno(), size, offset)
                except OSError as exc:
                    raise StoreError(f"Cannot read {path}: {exc}", hint=os_hint(exc)) from exc
                try:
                    pack.check_chunk(data, size, digest)
                except ValueError as exc:
                    raise corrupt(self.manifest.id, f"{relpath} changed while stored") from exc
                blob, codec = pack.encode(data, sealer=self.sealer, digest=digest)
                where = self.locations[digest] = packer.add(digest, size, blob, codec)
                self.new_bytes += where.length


class Packer:
    """Fills packs on the calling thread and uploads full ones on a pool (a few in flight)."""

    def __init__(self, upload: Upload) -> None:
        self.upload = upload
        self.backend = upload.backend
        self.settings = upload.settings
        self.builder: pack.PackBuilder | None = None
        workers = self.settings.max_workers
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="pack-upload")
        self.sending = Bounded(self.pool, workers)

    def __enter__(self) -> Packer:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        try:
            if exc_type is None:
                self._send()
                list(self.sending.drain())
            else:
                self.sending.cancel()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def add(self, digest: str, size: int, blob: pack.Blob, codec: pack.Codec) -> Location:
        if self.builder is None:
            self.builder = pack.PackBuilder(self.upload.sealer)
            self.upload.claim(self.builder.name)  # claimed before it exists
        where = self.builder.add(digest, size, blob, codec)
        if self.builder.size >= self.settings.pack_bytes:
            self._send()
        return where

    def _send(self) -> None:
        if self.builder is None:
            return
        name, data = self.builder.name, self.builder.finish()
        self.builder = None
        self.sending.submit(self.backend.save, Handle(Kind.PACK, name), data)
