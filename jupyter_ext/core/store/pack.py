"""Pack files: many chunks in one store object, so that a snapshot is a few dozen requests.

A pack is the chunks' stored bytes back to back, then a trailer that lists them, so a pack
describes itself (restic's pack format is the model)::

    blob 0 | blob 1 | ... | blob n-1 | trailer | u32 trailer length (LE) | b"JKSPACK1"

The trailer is zstd-compressed JSON: ``[[sha256, size, offset, length, codec], ...]``.
In an encrypted store (sealing.py) each blob is sealed after compression (codecs
``zstd+aes``, ``raw+aes``), the trailer is sealed too, and the magic is ``JKSPACK2``.
Snapshot records locate each chunk directly (pack, offset, length), so reading a snapshot
never needs a trailer; trailers are read only to find chunks that a repack moved.

A blob is the chunk zstd-compressed, or raw when compressing saves too little: memory of
random floats shrinks by ~6 % at zstd level 1 (807 MB/s to compress, 476 MB/s to
decompress a core here), which costs more time on both ends than the bytes it saves
(measured 2026-11-30, see ``docs/storage.md``).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import struct
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, TypeVar

import zstandard

from .sealing import Sealer, chunk_context, trailer_context

PACK_MAGIC = b"JKSPACK1"
SEALED_PACK_MAGIC = b"JKSPACK2"
_FOOTER = struct.Struct("<I")
FOOTER_SIZE = _FOOTER.size + len(PACK_MAGIC)
DEFAULT_PACK_BYTES = 16 * 1024 * 1024
"""Packs of about 16 MiB: past AWS's advice of 8-16 MiB for ranged GETs, and few enough
objects (64 a GiB) that a snapshot costs well under 100 requests a GiB."""
ZSTD_LEVEL = 1
"""zstd level 1: ~800 MB/s a core on memory images; level 3 is 25-50 % slower for ~1 % less."""
RAW_ABOVE = 7 / 8
"""A chunk is stored raw when compressing leaves more than this share of it."""
PROBE_EVERY = 8
"""After a raw chunk, only every this-many-th chunk is tried with zstd until one compresses."""
COALESCE_GAP = 1024 * 1024
"""Ranges of one pack closer than this are read in one request (the gap is read too)."""
MAX_READ = 32 * 1024 * 1024

Codec = Literal["zstd", "raw", "zstd+aes", "raw+aes"]
CODECS: tuple[Codec, ...] = ("zstd", "raw", "zstd+aes", "raw+aes")
SEALED_CODECS = frozenset({"zstd+aes", "raw+aes"})
"""Blobs sealed with the store's master key after compression (sealing.py)."""
PACK_NAME_RE = re.compile(r"^packs/([0-9a-f]{2})/\1[0-9a-f]{62}$")
LEGACY_NAME_RE = re.compile(r"^chunks/([0-9a-f]{2})/\1[0-9a-f]{62}$")
"""Objects of record format 1: one zstd-compressed chunk each, named by its sha256."""
IMAGE_PACK_NAME_RE = re.compile(r"^packs/([0-9a-f]{2})/\1[0-9a-f]{62}\.img$")
"""A local store's *image pack*: a memory image adopted whole, as a hard link of the
snapshot's own file (no copy), its chunks raw where they are in the file. It has no
trailer: the record that adopted it locates its chunks, and a repack moves them into
packs that have one."""


def new_pack_name() -> str:
    """A fresh random pack name: known when the pack starts, so chunks are located at once."""
    pack_id = secrets.token_hex(32)
    return f"packs/{pack_id[:2]}/{pack_id}"


def new_image_pack_name() -> str:
    return new_pack_name() + ".img"


def is_pack_name(name: str) -> bool:
    """A pack or an image pack (what a repack may rewrite)."""
    return bool(PACK_NAME_RE.match(name) or IMAGE_PACK_NAME_RE.match(name))


def legacy_chunk_name(digest: str) -> str:
    return f"chunks/{digest[:2]}/{digest}"


def is_object_name(name: str) -> bool:
    return is_pack_name(name) or bool(LEGACY_NAME_RE.match(name))


class Location(NamedTuple):
    """Where a chunk's stored bytes are: a range of an object. A tuple of plain values:
    the collector stops tracking it (a snapshot's record holds ten thousands of them, and
    tracked ones made a put pause 0.1 s for a full collection of the server)."""

    obj: str
    offset: int
    length: int
    codec: Codec


class PackEntry(NamedTuple):
    """One chunk as a pack's trailer lists it."""

    hash: str
    size: int
    where: Location


class _Codec(threading.local):
    """zstd (de)compressor objects are not thread-safe: one pair per worker thread."""

    def __init__(self) -> None:
        self.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        self.decompressor = zstandard.ZstdDecompressor()


_codec = _Codec()


def encode(
    data: bytes | memoryview,
    try_zstd: bool = True,
    sealer: Sealer | None = None,
    digest: str = "",
) -> tuple[bytes | memoryview, Codec]:
    """The blob to store for a chunk, and its codec (raw when zstd saves too little);
    with ``sealer``, sealed after compression and bound to ``digest``."""
    blob: bytes | memoryview = data
    codec: Codec = "raw"
    if try_zstd:
        compressed = _codec.compressor.compress(data)
        if len(compressed) <= len(data) * RAW_ABOVE:
            blob, codec = compressed, "zstd"
    if sealer is None:
        return blob, codec
    sealed: Codec = "zstd+aes" if codec == "zstd" else "raw+aes"
    return sealer.seal(blob, chunk_context(digest, codec, len(data))), sealed


def decode(
    blob: bytes | memoryview,
    codec: Codec,
    size: int,
    digest: str = "",
    sealer: Sealer | None = None,
) -> bytes | memoryview:
    """A chunk's bytes from its blob; raises ValueError if the blob is not what it claims
    (a sealed one that does not open as the chunk ``digest``, too)."""
    if codec in SEALED_CODECS:
        if sealer is None:
            raise ValueError("it is encrypted, and this store has no key")
        codec = "zstd" if codec == "zstd+aes" else "raw"
        blob = sealer.open(blob, chunk_context(digest, codec, size))
    if codec == "raw":
        if len(blob) != size:
            raise ValueError("the raw blob has another size")
        return blob
    if zstandard.frame_content_size(blob) != size:  # before allocating for it
        raise ValueError("the compressed frame holds another size")
    try:
        return _codec.decompressor.decompress(blob, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise ValueError(f"it cannot be decompressed ({exc})") from exc


def decode_checked(
    blob: bytes | memoryview,
    codec: Codec,
    size: int,
    digest: str,
    sealer: Sealer | None = None,
) -> bytes | memoryview:
    """A chunk's bytes from its blob, checked to be the chunk ``digest`` (ValueError if
    not): a sealed one by its tag, whose associated data holds the digest and size (only
    the key's holder can seal bytes for a digest, so hashing them again adds nothing but
    a pass over the bytes: 0.17 s per 256 MiB, more than opening them), another by its
    sha256."""
    data = decode(blob, codec, size, digest, sealer)
    if codec not in SEALED_CODECS:
        check_chunk(data, size, digest)
    return data


def check_chunk(data: bytes | memoryview, size: int, digest: str) -> None:
    if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
        raise ValueError("it has the wrong sha256")


class Compressibility:
    """Whether to try zstd on the next chunk of a run of chunks taken in order (a batch, on
    one worker): the first is tried; after a raw one (random floats) only every
    PROBE_EVERY-th, in case the content changes, until one compresses. Each batch has its
    own, so what is tried does not depend on which worker runs first."""

    def __init__(self) -> None:
        self._raw_run = 0

    def worth_trying(self) -> bool:
        if self._raw_run == 0:
            return True
        self._raw_run += 1
        return self._raw_run % PROBE_EVERY == 1

    def saw(self, codec: Codec) -> None:
        self._raw_run = max(self._raw_run, 1) if codec in ("raw", "raw+aes") else 0


@dataclass(frozen=True)
class FileSlice:
    """A raw blob that is a range of a file the put holds open: a store on a local disk
    copies it file to file inside the kernel (copy_file_range: 0.1 s for 300 MB here,
    against 0.9 s through a mapping and write), others send ``view``, the same bytes."""

    fd: int
    offset: int
    view: memoryview

    def __len__(self) -> int:
        return len(self.view)


Blob = bytes | memoryview | FileSlice


def blob_bytes(blob: Blob) -> bytes | memoryview:
    return blob.view if isinstance(blob, FileSlice) else blob


class PackBuilder:
    """Collects blobs into one pack; ``finish`` gives its bytes, trailer included."""

    def __init__(self, sealer: Sealer | None = None) -> None:
        self.name = new_pack_name()
        self.sealer = sealer
        self._parts: list[Blob] = []
        self._entries: list[list[object]] = []
        self.size = 0

    def add(self, digest: str, size: int, blob: Blob, codec: Codec) -> Location:
        where = Location(self.name, self.size, len(blob), codec)
        self._parts.append(blob)
        self._entries.append([digest, size, where.offset, where.length, codec])
        self.size += len(blob)
        return where

    def __len__(self) -> int:
        return len(self._entries)

    def finish(self) -> Parts:
        """The pack as its parts, in order: joined only where a store needs one buffer."""
        trailer = _codec.compressor.compress(json.dumps(self._entries).encode())
        magic = PACK_MAGIC
        if self.sealer is not None:
            trailer, magic = (
                self.sealer.seal(trailer, trailer_context(self.name)),
                SEALED_PACK_MAGIC,
            )
        footer = _FOOTER.pack(len(trailer)) + magic
        return [*self._parts, trailer, footer]


Parts = Sequence[Blob]
"""An object's bytes as pieces, in order."""


def trailer_length(footer: bytes) -> int:
    """The trailer's length from a pack's last FOOTER_SIZE bytes."""
    if len(footer) != FOOTER_SIZE or not footer.endswith((PACK_MAGIC, SEALED_PACK_MAGIC)):
        raise ValueError("it does not end like a pack")
    (length,) = _FOOTER.unpack(footer[: _FOOTER.size])
    return int(length)


def is_sealed_pack(footer: bytes) -> bool:
    """Whether a pack's last FOOTER_SIZE bytes say it is an encrypted store's."""
    return footer.endswith(SEALED_PACK_MAGIC)


def parse_trailer(
    name: str, trailer: bytes, pack_size: int, sealer: Sealer | None = None
) -> list[PackEntry]:
    """The chunks a pack lists; checks every range lies within its blobs. ``sealer``: the
    trailer is sealed (the pack ends with SEALED_PACK_MAGIC)."""
    body_end = pack_size - FOOTER_SIZE - len(trailer)
    try:
        if sealer is not None:
            trailer = sealer.open(trailer, trailer_context(name))
        raw = zstandard.ZstdDecompressor().decompress(trailer, max_output_size=64 << 20)
        rows = json.loads(raw)
        entries = []
        for digest, size, offset, length, codec in rows:
            if (
                not isinstance(digest, str)
                or not re.fullmatch(r"[0-9a-f]{64}", digest)
                or codec not in CODECS
                or not (isinstance(offset, int) and isinstance(length, int) and size > 0)
                or offset < 0
                or length <= 0
                or offset + length > body_end
            ):
                raise ValueError(f"entry {digest!r} is malformed")
            entries.append(PackEntry(digest, int(size), Location(name, offset, length, codec)))
        return entries
    except (zstandard.ZstdError, TypeError) as exc:
        raise ValueError(f"its trailer cannot be read ({exc})") from exc


_T = TypeVar("_T")


def coalesce(chunks: Iterable[tuple[_T, Location]]) -> Iterator[list[tuple[_T, Location]]]:
    """Chunks of one object, sorted by offset, in groups that one ranged read serves."""
    group: list[tuple[_T, Location]] = []
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
