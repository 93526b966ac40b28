"""Snapshots and stores for the store's tests (tests/test_store.py and the suites beside it:
check, encryption, backends, S3 servers, retention, crashes): sealed snapshot directories
built without CRIU (random page-aligned "memory" and a few small files, sealed with
``manifest.seal`` as the wrapper does), and the stored objects read, written and damaged
under the store."""

from __future__ import annotations

import hashlib
import io
import random
from pathlib import Path
from typing import Any

from jupyter_ext.core import manifest as manifest_mod
from jupyter_ext.core.chunking import PAGE_SIZE, ChunkParams, iter_chunks
from jupyter_ext.core.manifest import Manifest
from jupyter_ext.core.store import LocalStore, S3Store, StoredSnapshot
from jupyter_ext.core.store.pack import Location

BUCKET = "snapshots"
SMALL_CHUNKS = ChunkParams(min_size=16 * 1024, normal_size=64 * 1024, max_size=256 * 1024)
"""Scaled down so that test-sized images hold hundreds of chunks."""

Store = LocalStore | S3Store


def random_pages(rng: random.Random, pages: int) -> bytes:
    """Page-aligned 'memory': mostly random pages, some zero and some repetitive ones."""
    out = []
    for _ in range(pages):
        kind = rng.random()
        if kind < 0.1:
            out.append(bytes(PAGE_SIZE))
        elif kind < 0.3:
            out.append(rng.randbytes(16) * (PAGE_SIZE // 16))
        else:
            out.append(rng.randbytes(PAGE_SIZE))
    return b"".join(out)


def make_snapshot(
    root: Path,
    pages: bytes,
    *,
    lineage: str = "0" * 32,
    sequence: int = 1,
    extra: dict[str, bytes] | None = None,
    parent_id: str | None = None,
    chunk_kib: int | None = None,
    chunked_as: bytes | None = None,
) -> Path:
    """A sealed snapshot directory, as the kernel wrapper leaves it. With ``chunk_kib``
    its memory is listed by its chunks, as the wrapper cuts it during the dump (those of
    ``chunked_as``, of the same size, to forge a lie the seal believes)."""
    snapshot_id = manifest_mod.new_snapshot_id()
    staging = root / f".{snapshot_id}.staging"
    images = staging / manifest_mod.IMAGES_DIR
    images.mkdir(parents=True)
    files = {"pages-1.img": pages, "core-1.img": b"core" * 300, "inventory.img": b""}
    for name, data in {**files, **(extra or {})}.items():
        (images / name).write_bytes(data)
    manifest = Manifest(
        id=snapshot_id,
        lineage=lineage,
        sequence=sequence,
        created=manifest_mod.utc_now(),
        trigger="manual",
        runtime_dir="/run/dummy",
        runtime_dir_key="dummy",
        stdio_pipe="pipe:[1]",
        notebook_path="work/analysis.ipynb",
        parent_id=parent_id,
        chunk_kib=chunk_kib,
    )
    hashed = {}
    if chunk_kib is not None:
        cut = iter_chunks(io.BytesIO(chunked_as or pages), ChunkParams.of_kib(chunk_kib))
        chunks = [(hashlib.sha256(c).hexdigest(), len(c)) for c in cut]
        path = f"{manifest_mod.IMAGES_DIR}/pages-1.img"
        digest = manifest_mod.chunk_list_digest(chunks)
        hashed[path] = manifest_mod.FileEntry(path, len(pages), digest, chunks)
    final = root / snapshot_id
    manifest_mod.seal(staging, manifest, final, hashed)
    return final


def reseal(raw: dict[str, Any]) -> dict[str, Any]:
    """A manifest changed on purpose, its checksum (manifests that carry one) made to match
    again: the test is about the checks behind it."""
    checksum = getattr(manifest_mod, "manifest_checksum", None)
    if checksum is not None and "checksum" in raw:
        raw["checksum"] = checksum(raw)
    return raw


def tree(path: Path) -> dict[str, bytes]:
    """A snapshot directory's files (not the seal's stamps: facts of this machine's copy)."""
    return {
        p.relative_to(path).as_posix(): p.read_bytes()
        for p in path.rglob("*")
        if p.is_file() and p.name != manifest_mod.SEAL_STAMPS_NAME
    }


def object_key(store: Store, name: str) -> str:
    return store.backend.key(name) if isinstance(store, S3Store) else name


def read_object(store: Store, name: str) -> bytes:
    if isinstance(store, S3Store):
        body: bytes = store.client.get_object(Bucket=BUCKET, Key=object_key(store, name))[
            "Body"
        ].read()
        return body
    return (store.root / name).read_bytes()


def write_object(store: Store, name: str, data: bytes) -> None:
    if isinstance(store, S3Store):
        store.client.put_object(Bucket=BUCKET, Key=object_key(store, name), Body=data)
    else:
        (store.root / name).parent.mkdir(parents=True, exist_ok=True)
        (store.root / name).write_bytes(data)


def delete_object(store: Store, name: str) -> None:
    if isinstance(store, S3Store):
        store.client.delete_object(Bucket=BUCKET, Key=object_key(store, name))
    else:
        (store.root / name).unlink()


def damage(store: Store, where: Location, replacement: bytes | None = None) -> None:
    """Flip a byte in the middle of a stored chunk, or put other bytes in its place."""
    data = bytearray(read_object(store, where.obj))
    if replacement is None:
        data[where.offset + where.length // 2] ^= 0x01
    else:
        assert len(replacement) == where.length
        data[where.offset : where.offset + where.length] = replacement
    write_object(store, where.obj, bytes(data))


def refs_of(store: Store, stored: StoredSnapshot, path: str = "images/pages-1.img") -> list[Any]:
    record = store.index.load(stored.manifest.id)
    assert record is not None
    return record.chunks[path]


def packs_of(store: Store, stored: StoredSnapshot) -> set[str]:
    record = store.index.load(stored.manifest.id)
    assert record is not None
    return {ref.where.obj for refs in record.chunks.values() for ref in refs}


def mutate(pages: bytes, rng: random.Random, *, inserts: int, changes: int) -> bytes:
    """Insert single random pages and overwrite others, as a kernel between snapshots."""
    data = bytearray(pages)
    count = len(data) // PAGE_SIZE
    for _ in range(inserts):
        at = rng.randrange(1, count) * PAGE_SIZE
        data[at:at] = rng.randbytes(PAGE_SIZE)
        count += 1
    for _ in range(changes):
        at = rng.randrange(count) * PAGE_SIZE
        data[at : at + PAGE_SIZE] = rng.randbytes(PAGE_SIZE)
    return bytes(data)
