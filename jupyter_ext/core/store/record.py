"""A snapshot's record (``snapshots/<id>.json``): its manifest, and where each chunk of each
file is (pack, offset, length, codec, sha256). Written last, never rewritten: it makes the
snapshot visible. Parsed as tampered input: everything that becomes a path or a key is
checked."""

from __future__ import annotations

import dataclasses
import json
import re
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import manifest as manifest_mod
from ..errors import SnapshotCorruptError
from ..manifest import FileEntry, Manifest
from . import pack, sealing
from .api import ChunkRef
from .pack import Location

RECORD_FORMAT = 2
"""Records that locate chunks in packs. Format 1 (a chunk an object) is still read."""
HASH_RE = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Record:
    raw_manifest: dict[str, Any]
    """As read from manifest.json: written back unchanged by fetch."""
    manifest: Manifest
    chunks: dict[str, list[ChunkRef]]
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

    @property
    def chunk_count(self) -> int:
        return len(self.distinct())

    def summary(self) -> Summary:
        """What the index keeps of this record between reads."""
        files = [FileEntry(e.path, e.size, e.sha256) for e in self.manifest.files]
        return Summary(
            dataclasses.replace(self.manifest, files=files),
            self.stored_bytes,
            self.new_bytes,
            self.chunk_kib,
            ChunkTable(self.distinct().values()),
        )

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
    def parse(cls, snapshot_id: str, data: bytes) -> Record:
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


DIGEST = np.dtype((np.void, 32))
"""A sha256 digest as one numpy value (compared and sorted bytewise)."""


class ChunkTable:
    """Chunks and where each is stored, as numpy columns: sha256 digests, the index of
    their object in ``objects``, numbers. About 60 bytes a chunk where ChunkRefs took ~400
    (a hex digest, a Location, its ints and codec name as objects of their own), and a
    catalog of many tables is made without an object per chunk (index.Catalog)."""

    __slots__ = ("codecs", "digests", "lengths", "objects", "offsets", "sizes", "where")

    def __init__(self, refs: Iterable[ChunkRef]) -> None:
        objects: dict[str, int] = {}
        digests = bytearray()
        sizes, offsets, lengths = array("Q"), array("Q"), array("Q")
        where, codecs = array("I"), array("B")
        for ref in refs:
            digests += bytes.fromhex(ref.hash)
            sizes.append(ref.size)
            where.append(objects.setdefault(ref.where.obj, len(objects)))
            offsets.append(ref.where.offset)
            lengths.append(ref.where.length)
            codecs.append(pack.CODECS.index(ref.where.codec))
        self.objects = tuple(objects)
        self.digests: npt.NDArray[np.void] = np.frombuffer(bytes(digests), dtype=DIGEST)
        self.sizes: npt.NDArray[np.uint64] = np.frombuffer(sizes, dtype=np.uint64)
        self.where: npt.NDArray[np.uint32] = np.frombuffer(where, dtype=np.uint32)
        """Each chunk's object, as its index in ``objects``."""
        self.offsets: npt.NDArray[np.uint64] = np.frombuffer(offsets, dtype=np.uint64)
        self.lengths: npt.NDArray[np.uint64] = np.frombuffer(lengths, dtype=np.uint64)
        self.codecs: npt.NDArray[np.uint8] = np.frombuffer(codecs, dtype=np.uint8)
        """Each chunk's codec, as its index in pack.CODECS."""

    def __len__(self) -> int:
        return len(self.sizes)

    def __iter__(self) -> Iterator[ChunkRef]:
        """The chunks as ChunkRefs, made as they are asked for."""
        hexes = self.digests.tobytes().hex()
        objects, codecs = self.objects, pack.CODECS
        columns = (self.sizes, self.where, self.offsets, self.lengths, self.codecs)
        rows = zip(range(0, len(hexes), 64), *(c.tolist() for c in columns), strict=True)
        for at, size, obj, offset, length, codec in rows:
            where = Location(objects[obj], offset, length, codecs[codec])
            yield ChunkRef(hexes[at : at + 64], size, where)


@dataclass(frozen=True)
class Summary:
    """A record as the store's index keeps it between reads: what listing snapshots, the
    catalog of where chunks are and clean-ups need. A parsed :class:`Record` holds its
    manifest twice and every chunk three times as objects (~700 bytes a chunk, ~11 MB
    for a 256 MiB kernel's snapshot); a server keeps every retained snapshot's, so it grew by
    tens of MiB under load and kept them (bench/RESULTS.md). A whole record is parsed
    afresh where one is read for itself (a restore, a fetch)."""

    manifest: Manifest
    """Its file entries without their chunk lists (``chunks`` None)."""
    stored_bytes: int
    new_bytes: int
    chunk_kib: int | None
    chunks: ChunkTable
    """The first ref of each distinct chunk, in file order."""

    def objects(self) -> set[str]:
        return set(self.chunks.objects)

    def distinct(self) -> dict[str, ChunkRef]:
        """hash -> the first ref of each distinct chunk."""
        return {ref.hash: ref for ref in self.chunks}

    @property
    def chunk_count(self) -> int:
        return len(self.chunks)


def _parse_chunks(doc: dict[str, Any]) -> dict[str, list[ChunkRef]]:
    objects = [str(name) for name in doc["objects"]]
    if not all(pack.is_object_name(name) for name in objects):
        raise ValueError("it names an object outside the store's layout")
    chunks = {}
    for path, rows in doc["chunks"].items():
        refs = []
        for digest, size, obj, offset, length, codec in rows:
            if codec not in pack.CODECS or isinstance(obj, bool) or int(obj) < 0:
                raise ValueError(f"a chunk of {path} is malformed")
            where = Location(objects[int(obj)], int(offset), int(length), codec)
            refs.append(ChunkRef(str(digest), int(size), where))
        chunks[str(path)] = refs
    return chunks


def _parse_format_1_chunks(doc: dict[str, Any]) -> dict[str, list[ChunkRef]]:
    """Format 1: each chunk is its own zstd object ``chunks/<hh>/<sha256>``."""
    return {
        str(path): [
            ChunkRef(
                str(c["hash"]),
                int(c["size"]),
                Location(pack.legacy_chunk_name(str(c["hash"])), 0, int(c["stored_size"]), "zstd"),
            )
            for c in refs
        ]
        for path, refs in doc["chunks"].items()
    }


def _check_chunk_map(manifest: Manifest, chunks: dict[str, list[ChunkRef]]) -> None:
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
                not HASH_RE.match(ref.hash)
                or ref.size <= 0
                or where.offset < 0
                or where.length <= 0
                or not pack.is_object_name(where.obj)
                or (where.codec == "raw" and where.length != ref.size)
                or (where.codec == "raw+aes" and where.length != ref.size + sealing.OVERHEAD)
            ):
                raise ValueError(f"a chunk of {path} is malformed")
