"""The snapshot stores, local and S3 (moto's real server on 127.0.0.1), with one suite.

Snapshot directories are built here without CRIU: random page-aligned "memory" and a
few small files, sealed with ``manifest.seal`` like the wrapper does.
"""

from __future__ import annotations

import errno
import gc
import hashlib
import io
import json
import os
import random
import shutil
import subprocess
import threading
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from jupyter_ext.core import chunking
from jupyter_ext.core import manifest as manifest_mod
from jupyter_ext.core.chunking import PAGE_SIZE, ChunkParams, auto_chunk_kib, iter_chunks
from jupyter_ext.core.errors import BadIdError, SnapshotCorruptError, SnapshotNotFoundError
from jupyter_ext.core.manifest import Manifest
from jupyter_ext.core.store import LocalStore, S3Store, StoredSnapshot, StoreError
from jupyter_ext.core.store import pack as packs
from jupyter_ext.core.store.api import ChunkRef
from jupyter_ext.core.store.backend import Handle, Kind, ObjectStat, local
from jupyter_ext.core.store.index import Catalog
from jupyter_ext.core.store.pack import Location
from jupyter_ext.core.store.record import DIGEST, ChunkTable
from testkit.processes import MotoServer, free_port

from .support.s3server import CuttableProxy
from .support.stores import (
    BUCKET,
    SMALL_CHUNKS,
    Store,
    damage,
    delete_object,
    make_snapshot,
    mutate,
    packs_of,
    random_pages,
    refs_of,
    reseal,
    tree,
    write_object,
)
from .support.tmpfs import small_disk as tmpfs_disk

MakeStore = Callable[..., Store]


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_store(request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> Iterator[MakeStore]:
    """Make stores of one backend; each call gets a root (or prefix) of its own. They are
    closed after the test."""
    made: list[Store] = []

    def make(**kwargs: Any) -> Store:
        name = uuid.uuid4().hex[:8]
        store: Store
        if backend == "local":
            store = LocalStore(tmp_path / "stores" / name, **kwargs)
        else:
            server: MotoServer = request.getfixturevalue("moto")
            kwargs.setdefault("endpoint_url", server.url)
            bucket = server.ensure_bucket(BUCKET)
            store = S3Store(bucket, f"users/{name}", region="us-east-1", **kwargs)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


@pytest.fixture
def store(make_store: MakeStore) -> Store:
    return make_store(grace_seconds=0)


# -- tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, (3 << 20) + 123, 9 << 20])
@pytest.mark.parametrize("params", [SMALL_CHUNKS, ChunkParams()], ids=["small", "default"])
def test_chunks_are_page_aligned_and_bounded(size: int, params: ChunkParams) -> None:
    data = random.Random(size).randbytes(size)
    chunks = [bytes(c) for c in iter_chunks(io.BytesIO(data), params)]
    assert b"".join(chunks) == data
    assert all(len(c) % PAGE_SIZE == 0 for c in chunks[:-1])
    assert all(params.min_size <= len(c) <= params.max_size for c in chunks[:-1])
    assert all(0 < len(c) <= params.max_size for c in chunks)


def test_chunk_boundaries_follow_inserted_pages() -> None:
    data = random.Random(20).randbytes(16 << 20)
    shifted = data[: 5 << 20] + bytes(PAGE_SIZE) + data[5 << 20 :]
    before = {bytes(c) for c in iter_chunks(io.BytesIO(data), SMALL_CHUNKS)}
    after = [bytes(c) for c in iter_chunks(io.BytesIO(shifted), SMALL_CHUNKS)]
    new = sum(len(c) for c in after if c not in before)
    assert 0 < new <= 2 * SMALL_CHUNKS.max_size


def test_cut_points_do_not_depend_on_how_the_file_is_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pages are hashed a block at a time; a chunk that spans blocks is cut where it would
    be had the file been read whole."""
    rng = random.Random(21)
    data = rng.randbytes(5 << 20) + bytes(3 << 20) + rng.randbytes((2 << 20) + 100)
    whole = [bytes(c) for c in iter_chunks(io.BytesIO(data), SMALL_CHUNKS)]
    monkeypatch.setattr(chunking, "BLOCK_BYTES", PAGE_SIZE)  # read 4 * max_size at a time
    in_blocks = [bytes(c) for c in iter_chunks(io.BytesIO(data), SMALL_CHUNKS)]
    assert in_blocks == whole
    zeros = [len(c) for c in whole if not any(c)]
    assert zeros
    assert set(zeros) == {SMALL_CHUNKS.max_size}  # a run of equal pages never cuts


def test_cut_points_never_change() -> None:
    """Where chunks end is part of every store: other cut points (another page hash, other
    weights, another numpy) would make the next snapshot of every kernel share nothing
    with the ones before it."""
    data = random.Random(28).randbytes(4 << 20)
    lengths = [len(c) for c in iter_chunks(io.BytesIO(data), SMALL_CHUNKS)]
    assert lengths[:8] == [200704, 45056, 81920, 110592, 16384, 61440, 258048, 143360]


@pytest.mark.parametrize("sizes", [(1000, 4096, 8192), (4096, 12288, 8192), (16384, 8192, 8192)])
def test_chunk_params_are_checked(sizes: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError, match="must"):
        ChunkParams(*sizes)


@pytest.mark.parametrize(
    ("mib", "kib"),
    [(0, 16), (96, 16), (256, 16), (512, 32), (2048, 128), (16384, 1024), (65536, 1024)],
)
def test_automatic_chunks_grow_with_the_snapshot(mib: int, kib: int) -> None:
    assert auto_chunk_kib(mib << 20) == kib
    assert (mib << 20) // (kib << 10) <= 16384 or kib == 1024  # objects per snapshot bounded


def test_automatic_chunks_keep_the_previous_size_within_a_factor_two() -> None:
    assert auto_chunk_kib(600 << 20, previous_kib=32) == 32  # ideal 64: keep 32
    assert auto_chunk_kib(600 << 20, previous_kib=128) == 128
    assert auto_chunk_kib(600 << 20, previous_kib=16) == 64  # too far from the ideal
    assert auto_chunk_kib(600 << 20, previous_kib=256) == 64
    assert auto_chunk_kib(600 << 20, previous_kib=48) == 48  # any size the store wrote
    assert auto_chunk_kib(1 << 20, previous_kib=4) == 16  # never below the minimum


def test_a_child_snapshot_keeps_its_parents_chunk_size(store: Store, tmp_path: Path) -> None:
    """Automatic chunking (the default) follows the parent's record across a boundary."""
    pages = random_pages(random.Random(11), 1024)
    store.chunking = ChunkParams.of_kib(32)  # as if the parent had been a bigger kernel
    parent = store.put(make_snapshot(tmp_path, pages, sequence=1))
    store.chunking = None
    child = store.put(make_snapshot(tmp_path, pages, sequence=2, parent_id=parent.manifest.id))
    assert store.index.load(child.manifest.id).chunk_kib == 32  # type: ignore[union-attr]
    assert child.new_bytes == 0  # the same cut: every chunk is shared
    orphan = store.put(make_snapshot(tmp_path, pages, sequence=3))
    assert store.index.load(orphan.manifest.id).chunk_kib == 16  # type: ignore[union-attr]
    assert orphan.new_bytes > 0  # another cut of the same pages


def test_round_trip_is_byte_identical(store: Store, tmp_path: Path) -> None:
    source = make_snapshot(tmp_path, random_pages(random.Random(1), 2048))
    events: list[dict[str, Any]] = []

    stored = store.put(source, progress=events.append)

    manifest = manifest_mod.Manifest.read(source)
    assert stored.manifest == manifest
    assert stored.new_bytes == stored.stored_bytes > 0
    assert stored.chunk_count > 1
    assert stored.location.endswith(f"snapshots/{manifest.id}.json")
    assert [s.manifest.id for s in store.snapshots()] == [manifest.id]
    assert store.get(manifest.id) == stored
    uploading = [e["done_bytes"] for e in events if e["phase"] == "uploading"]
    assert uploading == sorted(uploading)
    assert uploading[-1] == manifest.total_bytes
    assert events[-1] == {
        "phase": "done",
        "done_bytes": manifest.total_bytes,
        "total_bytes": manifest.total_bytes,
    }

    events.clear()
    dest = store.fetch(manifest.id, tmp_path / "restored" / "snap", progress=events.append)

    assert dest == tmp_path / "restored" / "snap"
    assert tree(dest) == tree(source)
    assert manifest_mod.verify(dest) == manifest
    assert os.listdir(dest.parent) == ["snap"]
    assert {e["phase"] for e in events} == {"downloading", "done"}
    stats = store.stats()
    assert (stats.snapshot_count, stats.object_count) == (1, len(packs_of(store, stored)))
    trailers = stats.stored_bytes - stored.stored_bytes  # each pack's own index
    assert 0 < trailers < stats.object_count * (stored.chunk_count * 100 + 100)


def test_a_link_made_and_removed_during_a_put_is_not_a_change(store: Store, tmp_path: Path) -> None:
    """A resumed kernel deletes its suspended dump while the suspend's upload reads it: the
    files share inodes, so their ctime moves; their bytes are hashed again, not refused."""
    source = make_snapshot(tmp_path, random_pages(random.Random(2), 512))
    images = source / manifest_mod.IMAGES_DIR
    linked = tmp_path / "suspended-dump"
    linked.mkdir()

    def churn(event: dict[str, Any]) -> None:
        if event["phase"] == "uploading":
            for image in images.iterdir():
                os.link(image, linked / image.name)
                os.unlink(linked / image.name)

    stored = store.put(source, progress=churn)

    dest = store.fetch(stored.manifest.id, tmp_path / "restored")
    assert tree(dest) == tree(source)


def test_bytes_changed_during_a_put_are_refused_even_with_their_mtime_put_back(
    store: Store, tmp_path: Path
) -> None:
    source = make_snapshot(tmp_path, random_pages(random.Random(3), 512))
    pages = source / manifest_mod.IMAGES_DIR / "pages-1.img"
    before = pages.stat()

    def tamper(event: dict[str, Any]) -> None:
        if event["phase"] == "uploading":
            pages.chmod(0o600)
            with pages.open("r+b") as fh:
                fh.seek(100)
                fh.write(b"\xff" if fh.read(1) != b"\xff" else b"\x00")
            pages.chmod(0o400)
            os.utime(pages, ns=(before.st_atime_ns, before.st_mtime_ns))

    with pytest.raises(SnapshotCorruptError, match=r"damaged: images/pages-1\.img"):
        store.put(source, progress=tamper)
    assert store.snapshots() == []


def test_put_again_returns_the_stored_snapshot(store: Store, tmp_path: Path) -> None:
    source = make_snapshot(tmp_path, random_pages(random.Random(2), 256))
    first = store.put(source)
    assert store.put(source) == first
    assert len(store.snapshots()) == 1


def test_a_put_given_the_manifest_does_not_read_it_back(store: Store, tmp_path: Path) -> None:
    """The server holds the manifest the wrapper answered with: the put takes it as it is
    (the directory's copy is not read again), and still checks every file against it."""
    source = make_snapshot(tmp_path, random_pages(random.Random(4), 256))
    manifest = Manifest.read(source)
    (source / manifest_mod.MANIFEST_NAME).chmod(0o600)
    (source / manifest_mod.MANIFEST_NAME).write_text("not read")
    stored = store.put(source, manifest=manifest)
    assert stored.manifest == manifest
    assert store.get(manifest.id).manifest == manifest
    # A manifest that does not match the files is refused all the same.
    other = make_snapshot(tmp_path, random_pages(random.Random(5), 256), sequence=2)
    lying = Manifest.read(other)
    with pytest.raises(SnapshotCorruptError):
        store.put(source, manifest=lying)


def test_identical_second_snapshot_adds_no_chunks(store: Store, tmp_path: Path) -> None:
    pages = random_pages(random.Random(3), 2048)
    first = store.put(make_snapshot(tmp_path, pages, sequence=1))
    second = store.put(make_snapshot(tmp_path, pages, sequence=2))
    assert second.new_bytes == 0
    assert second.stored_bytes == first.stored_bytes
    assert store.stats().object_count == len(packs_of(store, first))


@pytest.mark.slow
def test_changed_kernel_stores_under_two_percent(make_store: MakeStore, tmp_path: Path) -> None:
    """Pages inserted (shifting all later offsets) and changed: only nearby chunks are new."""
    store = make_store(chunking=SMALL_CHUNKS)
    rng = random.Random(4)
    pages = rng.randbytes(48 << 20)  # random, so compression cannot hide anything
    first = store.put(make_snapshot(tmp_path, pages, sequence=1))
    changed = mutate(pages, rng, inserts=3, changes=3)
    second = store.put(make_snapshot(tmp_path, changed, sequence=2))

    ratio = second.new_bytes / second.stored_bytes
    print(f"new bytes after 3 inserted + 3 changed pages: {ratio:.2%}")
    assert ratio <= 0.02
    assert [s.manifest.sequence for s in store.snapshots()] == [1, 2]
    assert first.new_bytes == first.stored_bytes
    dest = store.fetch(second.manifest.id, tmp_path / "second")
    assert (dest / "images/pages-1.img").read_bytes() == changed


@pytest.mark.parametrize("kind", ["flip-byte", "other-content"])
def test_corrupt_chunk_fails_fetch_and_leaves_nothing(
    store: Store, tmp_path: Path, kind: str
) -> None:
    """A damaged pack range fails the fetch before anything is handed on: a flipped bit
    (zstd or raw), or other bytes of the same length in a raw chunk (only the sha256
    check can tell)."""
    pages = random.Random(5).randbytes(4 << 20)  # random: every chunk is stored raw
    stored = store.put(make_snapshot(tmp_path, pages))
    ref = refs_of(store, stored)[1]
    assert ref.where.codec == "raw"
    damage(store, ref.where, None if kind == "flip-byte" else bytes(ref.where.length))
    dest = tmp_path / "out" / "snap"

    with pytest.raises(SnapshotCorruptError) as caught:
        store.fetch(stored.manifest.id, dest)

    assert "images/pages-1.img" in str(caught.value)
    assert ref.hash[:12] in str(caught.value)
    assert not dest.exists()
    assert os.listdir(dest.parent) == []
    with pytest.raises(SnapshotCorruptError):
        store.open_images(stored.manifest.id).read("images/pages-1.img", 0, len(pages))


def test_compressible_chunks_are_compressed_and_random_ones_stored_raw(
    store: Store, tmp_path: Path
) -> None:
    """Zero pages are compressed; random bytes are stored raw (compressing them would save
    too little to pay for the time). After a run of raw chunks a file is probed now and
    then, not compressed chunk by chunk."""
    rng = random.Random(29)
    zeros, noise = bytes(2 << 20), rng.randbytes(2 << 20)
    stored = store.put(make_snapshot(tmp_path, zeros + noise))
    refs = refs_of(store, stored)
    assert refs[0].where.codec == "zstd"
    assert {ref.where.codec for ref in refs[-8:]} == {"raw"}
    assert (2 << 20) < stored.stored_bytes < (2 << 20) + (256 << 10)
    out = store.fetch(stored.manifest.id, tmp_path / "out")
    assert (out / "images/pages-1.img").read_bytes() == zeros + noise


def test_after_a_raw_chunk_only_every_eighth_is_tried() -> None:
    """Within a batch: the first chunk is tried; after one stays raw, every PROBE_EVERY-th,
    until the content compresses again (here from chunk 20 on: found at 24)."""
    compressibility = packs.Compressibility()
    tried = []
    for index in range(30):
        if compressibility.worth_trying():
            tried.append(index)
            compressibility.saw("zstd" if index >= 20 else "raw")
        else:
            compressibility.saw("raw")
    assert tried == [0, 8, 16, 24, 25, 26, 27, 28, 29]


def test_missing_pack_fails_fetch(store: Store, tmp_path: Path) -> None:
    stored = store.put(make_snapshot(tmp_path, random_pages(random.Random(6), 512)))
    delete_object(store, refs_of(store, stored)[0].where.obj)
    with pytest.raises(SnapshotCorruptError, match="missing from the store"):
        store.fetch(stored.manifest.id, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_open_images_reads_any_range(make_store: MakeStore, tmp_path: Path) -> None:
    """What a lazy restore serves pages from: any range of a file, from the packs."""
    store = make_store(pack_bytes=64 << 10)
    source = make_snapshot(tmp_path, random_pages(random.Random(30), 512))
    stored = store.put(source)
    data = (source / "images/pages-1.img").read_bytes()
    images = store.open_images(stored.manifest.id)
    rng = random.Random(31)
    for offset, length in [(0, 1), (0, len(data)), (len(data) - 5, 100), (4096, 4096)] + [
        (rng.randrange(len(data)), rng.randrange(1, 300_000)) for _ in range(20)
    ]:
        assert images.read("images/pages-1.img", offset, length) == data[offset : offset + length]
    core = (source / "images/core-1.img").read_bytes()
    assert images.read("images/core-1.img", 10, 20) == core[10:30]
    with pytest.raises(SnapshotCorruptError, match="no file"):
        images.read("images/nope.img", 0, 1)


def test_images_downloaded_while_read(make_store: MakeStore, tmp_path: Path) -> None:
    """A lazy restore from the store: the pages file is downloaded into a local
    directory in the background, the ranges asked for ``now`` before anything else, while
    reads of any range (landed or not) give the snapshot's bytes; the download ends with
    the whole file, identical, and a deduplicated chunk is written wherever it goes."""
    store = make_store(pack_bytes=64 << 10)
    rng = random.Random(32)
    twice = random_pages(rng, 256)
    data = twice + random_pages(rng, 256) + twice  # the same chunks in two places
    stored = store.put(make_snapshot(tmp_path, data))
    refs = refs_of(store, stored)
    assert len({r.hash for r in refs}) < len(refs)
    images = store.open_images(stored.manifest.id)
    local = tmp_path / "local"
    path = "images/pages-1.img"
    images.download_into(local, [path], now=[(path, 8192, 4096)], first=[(path, 1 << 20, 9000)])
    try:
        now = os.pread(os.open(local / path, os.O_RDONLY), 4096, 8192)
        assert now == data[8192 : 8192 + 4096]  # written before download_into returned
        for _ in range(30):
            offset, length = rng.randrange(len(data)), rng.randrange(1, 200_000)
            assert images.read(path, offset, length) == data[offset : offset + length]
        assert images.wait_downloaded()
    finally:
        images.close()
    assert (local / path).read_bytes() == data
    assert not (local / "images/core-1.img").exists()  # only the files asked for


def test_a_disk_too_full_for_the_download_still_serves_every_range(
    store: Store, tmp_path: Path
) -> None:
    """The local copy cannot be written (no room): it is given up, said so, and every
    read still comes whole from the store."""
    data = random.Random(34).randbytes(24 << 20)
    stored = store.put(make_snapshot(tmp_path, data))
    images = store.open_images(stored.manifest.id)
    path = "images/pages-1.img"
    with tmpfs_disk(tmp_path / "disk", "8m") as disk:
        images.download_into(disk, [path], now=[(path, 0, 4096)])
        try:
            for offset in range(0, len(data), 3 << 20):
                assert images.read(path, offset, 1 << 20) == data[offset : offset + (1 << 20)]
            assert not images.wait_downloaded()
            error = images.local_copy_error
            assert error is not None
            assert error.errno == errno.ENOSPC
        finally:
            images.close()


def test_a_damaged_chunk_is_never_read_from_the_download(store: Store, tmp_path: Path) -> None:
    """The background download skips a chunk that fails its check (nothing of it lands
    in the local file); a read that needs it says which chunk is damaged, the others
    read fine, and the download does not count as complete."""
    data = random.Random(35).randbytes(4 << 20)
    stored = store.put(make_snapshot(tmp_path, data))
    refs = refs_of(store, stored)
    damage(store, refs[2].where)
    images = store.open_images(stored.manifest.id)
    path = "images/pages-1.img"
    images.download_into(tmp_path / "local", [path])
    try:
        assert not images.wait_downloaded()
        start = sum(r.size for r in refs[:2])
        with pytest.raises(SnapshotCorruptError, match=refs[2].hash[:12]):
            images.read(path, start, 1)
        assert images.read(path, 0, start) == data[:start]
        assert (tmp_path / "local" / path).read_bytes()[start : start + refs[2].size] == bytes(
            refs[2].size
        )
    finally:
        images.close()


def test_delete_removes_only_unreferenced_packs(make_store: MakeStore, tmp_path: Path) -> None:
    """Deleting a snapshot removes the packs nothing else needs; deleting the last one
    empties the store."""
    store = make_store(grace_seconds=0, pack_bytes=128 << 10, repack_below=0)
    rng = random.Random(7)
    pages = random_pages(rng, 2048)
    first = store.put(make_snapshot(tmp_path, pages, sequence=1))
    second = store.put(make_snapshot(tmp_path, pages[: 1 << 20] + random_pages(rng, 1024)))
    only_first = packs_of(store, first) - packs_of(store, second)
    assert only_first
    assert packs_of(store, first) & packs_of(store, second)
    before = store.stats().object_count

    store.delete(first.manifest.id)

    assert [s.manifest.id for s in store.snapshots()] == [second.manifest.id]
    with pytest.raises(SnapshotNotFoundError):
        store.get(first.manifest.id)
    with pytest.raises(SnapshotNotFoundError):
        store.delete(first.manifest.id)
    assert store.stats().object_count == before - len(only_first)
    dest = store.fetch(second.manifest.id, tmp_path / "second")
    assert manifest_mod.verify(dest).id == second.manifest.id

    store.delete(second.manifest.id)
    assert store.stats() == type(store.stats())(0, 0, 0)


def test_mostly_unused_packs_are_repacked(make_store: MakeStore, tmp_path: Path) -> None:
    """After a delete, packs of which less than half is still needed are rewritten: the
    store shrinks to about what the remaining snapshot needs, its record (never
    rewritten) still names the old packs, and a fresh reader finds every chunk through
    the new packs' trailers."""
    store = make_store(grace_seconds=0, pack_bytes=2 << 20)
    rng = random.Random(32)
    shared = rng.randbytes(256 << 10)  # an eighth of the first pack
    first = store.put(
        make_snapshot(tmp_path, rng.randbytes(1 << 20) + shared + rng.randbytes(1 << 20))
    )
    source = make_snapshot(tmp_path, shared + rng.randbytes(1 << 20), sequence=2)
    second = store.put(source)
    assert 0 < second.new_bytes < second.stored_bytes
    old_packs = packs_of(store, first)

    store.delete(first.manifest.id)

    objects = store.index.objects()
    assert not old_packs & set(objects)  # every old pack rewritten or gone
    assert packs_of(store, second) - set(objects)  # the record names a repacked one
    assert sum(stat.size for stat in objects.values()) < second.stored_bytes * 1.05
    fresh = type(store)(**reopen_args(store))
    out = fresh.fetch(second.manifest.id, tmp_path / "after-repack")
    assert tree(out) == tree(source)
    data = (source / "images/pages-1.img").read_bytes()
    assert fresh.open_images(second.manifest.id).read("images/pages-1.img", 0, 99) == data[:99]
    third = fresh.put(make_snapshot(tmp_path, shared + rng.randbytes(4096), sequence=3))
    # The moved chunks are found and shared: new is the chunk (16 KiB chunks, at most 64
    # KiB) that ends the shared bytes, where the new page joins it.
    assert third.new_bytes <= (64 << 10) + 4096


def test_the_index_forgets_the_trailers_of_packs_gone(
    make_store: MakeStore, tmp_path: Path
) -> None:
    """The trailers a reader read to find chunks a repack moved are forgotten once their
    packs are gone from the store's listing: a long-lived server does not keep every
    trailer it ever read."""
    store = make_store(grace_seconds=0, pack_bytes=2 << 20)
    rng = random.Random(34)
    shared = rng.randbytes(256 << 10)
    first = store.put(make_snapshot(tmp_path, rng.randbytes(1 << 20) + shared))
    second = store.put(make_snapshot(tmp_path, shared + rng.randbytes(1 << 20), sequence=2))
    store.delete(first.manifest.id)  # repacks the shared chunks: found through trailers
    fresh = type(store)(**reopen_args(store), grace_seconds=0)
    fresh.fetch(second.manifest.id, tmp_path / "out")
    records, trailers = fresh.index.held()
    assert records == {second.manifest.id}
    assert trailers
    assert trailers <= set(fresh.index.objects())

    fresh.delete(second.manifest.id)  # every pack goes (no grace period)

    assert fresh.index.objects() == {}
    assert fresh.index.held() == (set(), set())


def test_the_index_keeps_each_trailer_it_read_compactly(tmp_path: Path) -> None:
    """Once a repack has moved chunks, a long-lived server looks for them in the trailers
    of the packs no record names, the clean-up's garbage of its grace period (an hour)
    among them, and keeps each trailer it read: as columns, under 64 bytes a chunk (as
    tuples of strings and ints it was ~390, and the server grew by 200 MiB an hour into
    the soak, bench/RESULTS.md)."""
    store = LocalStore(tmp_path / "store", grace_seconds=0)
    builder = packs.PackBuilder()
    digests = [hashlib.sha256(b"%d" % i).hexdigest() for i in range(5000)]
    for digest in digests:
        builder.add(digest, 1, b"x", "raw")
    store.backend.save(Handle(Kind.PACK, builder.name), builder.finish())
    size = store.index.objects()[builder.name].size
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        trailer = store.index.trailer(builder.name, size)
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(trailer) == len(digests)
    assert kept / len(digests) < 64, f"{kept / len(digests):.0f} bytes a chunk"
    assert store.index.trailer(builder.name, size) is trailer  # read once
    wanted = np.array([bytes.fromhex(d) for d in (digests[7], "00" * 32)], DIGEST)
    assert trailer.find(wanted) == {digests[7]: Location(builder.name, 7, 1, "raw")}


def test_the_index_keeps_a_compact_summary_of_each_record(store: Store, tmp_path: Path) -> None:
    """The index keeps each record it read between puts (a long-lived server: every
    retained snapshot's) as a summary of well under 150 bytes a chunk; parsed records took
    ~700 (their manifest twice, each chunk's place as objects): a server's RSS grew by tens
    of MiB under snapshot load and kept them (bench/RESULTS.md). A listing's manifests
    have no chunk lists; a snapshot read for itself is whole."""
    source = make_snapshot(tmp_path, random.Random(40).randbytes(16 << 20), chunk_kib=16)
    stored = store.put(source)
    assert stored.chunk_count > 900
    fresh = type(store)(**reopen_args(store))
    fresh.snapshots()  # the client's own first allocations (a listing, a read) come before
    fresh.index.forget(stored.manifest.id)
    gc.collect()
    tracemalloc.start()
    try:
        listed = fresh.snapshots()
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held / stored.chunk_count < 150, f"{held} bytes held for {stored.chunk_count} chunks"
    assert fresh.index.held()[0] == {stored.manifest.id}
    assert [(s.manifest.id, s.chunk_count) for s in listed] == [
        (stored.manifest.id, stored.chunk_count)
    ]
    assert all(entry.chunks is None for entry in listed[0].manifest.files)
    assert fresh.get(stored.manifest.id).manifest == Manifest.read(source)


def test_a_catalog_of_chunk_tables(store: Store) -> None:
    """A summary's columns give back the chunks they were made of; a catalog of several
    finds each chunk where the first record that has its pack says, and says what each
    pack is needed for, or that a chunk is nowhere."""
    names = [f"packs/{i:02x}/{i:02x}{'0' * 62}" for i in range(3)]
    refs = [
        ChunkRef(
            hashlib.sha256(bytes([i])).hexdigest(),
            16384 + i,
            Location(names[i % 3], i << 40, 100 + i, codec),
        )
        for i, codec in enumerate(packs.CODECS * 2)
    ]
    table = ChunkTable(refs)
    assert list(table) == refs
    assert len(table) == len(refs)
    assert set(table.objects) == set(names)
    # A later record has the first chunk in another pack, and one of its own.
    other = Location(names[2], 7, 100, "raw")
    extra = ChunkRef("ab" * 32, 5, Location(names[1], 0, 5, "raw"))
    moved = ChunkRef(refs[0].hash, refs[0].size, other)
    later = ChunkTable([moved, extra])
    objects = {name: ObjectStat(1 << 50, 0.0) for name in names}
    catalog = Catalog(store.index, [summary("a", table), summary("b", later)], objects)
    assert [catalog.find(ref.hash) for ref in refs] == [ref.where for ref in refs]
    assert catalog.find(extra.hash) == extra.where
    assert catalog.find("cd" * 32) is None
    everything = [*refs, moved, extra]  # each record needs its own places
    assert catalog.needs().bytes == {
        name: sum(r.where.length for r in everything if r.where.obj == name) for name in names
    }
    assert catalog.needs().chunks(names[2]) == {
        r.hash: (r.size, r.where) for r in everything if r.where.obj == names[2]
    }

    del objects[names[0]]  # its chunks are found where the later record has them, or nowhere
    catalog = Catalog(store.index, [summary("a", table), summary("b", later)], objects)
    assert catalog.find(refs[0].hash) == other
    assert catalog.find(refs[3].hash) is None
    with pytest.raises(StoreError, match=f"Snapshot a needs chunk {refs[3].hash[:12]}"):
        catalog.needs()


def summary(snapshot_id: str, table: ChunkTable) -> Any:
    """A record's summary as a catalog reads it."""
    return SimpleNamespace(manifest=SimpleNamespace(id=snapshot_id), chunks=table)


def test_a_put_finds_chunks_a_concurrent_repack_moved(
    make_store: MakeStore, tmp_path: Path
) -> None:
    """Another server repacks the pack a put reuses chunks of while the put uploads (its
    claim does not list them yet; another snapshot needs them, so they are moved): the
    put finds them in the new pack and records that."""
    store = make_store(grace_seconds=0, pack_bytes=2 << 20)
    other = type(store)(**reopen_args(store), grace_seconds=0, pack_bytes=2 << 20)
    rng = random.Random(33)
    shared = rng.randbytes(256 << 10)
    first = store.put(
        make_snapshot(tmp_path, rng.randbytes(1 << 20) + shared + rng.randbytes(1 << 20))
    )
    old_packs = packs_of(store, first)
    kept = store.put(make_snapshot(tmp_path, shared + rng.randbytes(4096), sequence=2))
    assert old_packs & packs_of(store, kept)  # it needs the shared chunks: they move
    source = make_snapshot(tmp_path, shared + rng.randbytes(512 << 10), sequence=3)
    total = manifest_mod.Manifest.read(source).total_bytes

    def repack_now(event: dict[str, Any]) -> None:
        if event["phase"] == "uploading" and event["done_bytes"] == total:
            other.delete(first.manifest.id)

    try:
        second = store.put(source, progress=repack_now)
    finally:
        other.close()
    assert not old_packs & stored_objects(store)  # repacked while the put ran
    assert not old_packs & packs_of(store, second)
    assert second.new_bytes < second.stored_bytes  # the moved chunks were not stored again
    assert tree(store.fetch(second.manifest.id, tmp_path / "out")) == tree(source)


def reopen_args(store: Store) -> dict[str, Any]:
    """How to open the same store again, as another process would."""
    if isinstance(store, S3Store):
        return {
            "bucket": store.backend.bucket,
            "prefix": store.backend.prefix,
            "endpoint_url": store.client.meta.endpoint_url,
            "region": "us-east-1",
        }
    return {"root": store.root}


def test_delete_keeps_packs_within_the_grace_period(make_store: MakeStore, tmp_path: Path) -> None:
    store = make_store()  # default grace: one hour
    stored = store.put(make_snapshot(tmp_path, random_pages(random.Random(8), 256)))
    kept = packs_of(store, stored)
    store.delete(stored.manifest.id)
    assert store.snapshots() == []
    assert stored_objects(store) == kept


def test_sweep_removes_stale_temporary_files(tmp_path: Path) -> None:
    """A put killed half-way leaves temporary files in a local store; a sweep removes them."""
    store = LocalStore(tmp_path / "store", grace_seconds=60)
    stored = store.put(make_snapshot(tmp_path, random_pages(random.Random(18), 16)))
    stale = [tmp_path / "store/packs/ab/.x.tmp", tmp_path / "store/snapshots/.y.tmp"]
    fresh = tmp_path / "store/packs/ab/.z.tmp"
    for path in [*stale, fresh]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"partial")
    for path in stale:
        os.utime(path, (time.time() - 120, time.time() - 120))
    store.delete(stored.manifest.id)
    assert [p.exists() for p in [*stale, fresh]] == [False, False, True]


def test_pack_removed_during_put_is_uploaded_again(store: Store, tmp_path: Path) -> None:
    """A clean-up removes a pack the put reuses chunks of, just before it commits: the put
    finds the chunks gone, uploads them again from the snapshot, and records them there."""
    pages = random_pages(random.Random(10), 512)
    first = store.put(make_snapshot(tmp_path, pages))
    victim = refs_of(store, first)[0].where.obj
    second = make_snapshot(tmp_path, pages, sequence=2)

    def sweep_now(event: dict[str, Any]) -> None:
        if event["phase"] == "committing" and victim in store.index.objects():
            delete_object(store, victim)

    stored = store.put(second, progress=sweep_now)
    assert victim not in packs_of(store, stored)
    assert 0 < stored.new_bytes <= stored.stored_bytes
    assert tree(store.fetch(stored.manifest.id, tmp_path / "out")) == tree(second)


def test_damaged_source_is_refused(store: Store, tmp_path: Path) -> None:
    source = make_snapshot(tmp_path, random_pages(random.Random(11), 256))
    image = source / "images/pages-1.img"
    data = bytearray(image.read_bytes())
    data[100] ^= 0xFF
    image.chmod(0o600)  # sealed read-only
    image.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorruptError, match="differs from its manifest"):
        store.put(source)
    assert store.snapshots() == []


def test_memory_is_stored_by_the_chunks_its_seal_lists(store: Store, tmp_path: Path) -> None:
    """The wrapper cuts and hashes the memory during the dump; the store keeps it by
    exactly those chunks (no cutting, no hashing again), and a fetch checks each chunk."""
    pages = random_pages(random.Random(31), 2048)
    source = make_snapshot(tmp_path, pages, chunk_kib=16)
    entry = {e.path: e for e in manifest_mod.Manifest.read(source).files}["images/pages-1.img"]
    assert entry.chunks is not None
    assert len(entry.chunks) > 100

    stored = store.put(source)

    record = store.index.load(stored.manifest.id)
    assert record is not None
    assert record.chunk_kib == 16
    assert [(r.hash, r.size) for r in record.chunks[entry.path]] == entry.chunks
    dest = store.fetch(stored.manifest.id, tmp_path / "out" / "snap")
    assert tree(dest) == tree(source)
    assert manifest_mod.verify(dest).id == stored.manifest.id


def test_a_put_trusts_the_seal_and_a_fetch_still_catches_a_lie(
    store: Store, tmp_path: Path
) -> None:
    """A file as it was sealed is stored by its listed chunks unread: even a lie (here
    forged into the seal) is stored. Each chunk is checked when it is read back, so the
    lie fails the fetch, naming the chunk, and leaves nothing; a restore never runs it."""
    rng = random.Random(32)
    pages = random_pages(rng, 512)
    lie = rng.randbytes(len(pages))
    stored = store.put(make_snapshot(tmp_path, pages, chunk_kib=16, chunked_as=lie))
    with pytest.raises(SnapshotCorruptError, match=r"chunk .* of images/pages-1\.img"):
        store.fetch(stored.manifest.id, tmp_path / "out" / "snap")
    assert not (tmp_path / "out" / "snap").exists()


def test_a_memory_file_changed_after_its_seal_is_hashed_again(store: Store, tmp_path: Path) -> None:
    """Any change to a sealed file changes its ctime: the put then checks each chunk
    against its listed sha256, refuses a changed byte, and stores an unchanged file."""
    pages = random_pages(random.Random(33), 512)
    source = make_snapshot(tmp_path, pages, chunk_kib=16)
    image = source / "images/pages-1.img"
    image.chmod(0o600)
    image.write_bytes(pages[:100] + bytes([pages[100] ^ 0xFF]) + pages[101:])
    with pytest.raises(SnapshotCorruptError, match="a chunk differs from its manifest"):
        store.put(source)
    assert store.snapshots() == []

    image.write_bytes(pages)  # as it was, but no longer as sealed: hashed, and stored
    sealed = manifest_mod.sealed_stamps(source)["images/pages-1.img"]
    assert manifest_mod.stamp(image) != sealed
    stored = store.put(source)
    dest = store.fetch(stored.manifest.id, tmp_path / "out" / "snap")
    assert (dest / "images/pages-1.img").read_bytes() == pages


def image_packs(store: Store) -> list[str]:
    return sorted(n for n in store.index.objects() if packs.IMAGE_PACK_NAME_RE.match(n))


def test_a_new_incompressible_memory_image_is_adopted_not_copied(
    make_store: MakeStore, backend: str, tmp_path: Path
) -> None:
    """A local store keeps a kernel's first snapshot of random floats by linking its
    sealed memory image as an image pack: one inode, no copy; the record locates its
    chunks there, the seal's stamps follow the link (the image cache admits it as checked)
    and the snapshot round-trips. S3 copies into packs."""
    from jupyter_ext.core.imagecache import stamp_checked

    store = make_store(pack_bytes=1 << 20)
    pages = random.Random(36).randbytes(2048 * PAGE_SIZE)
    source = make_snapshot(tmp_path, pages, chunk_kib=16)
    stored = store.put(source)

    image = source / "images/pages-1.img"
    adopted = image_packs(store)
    if backend == "s3":
        assert adopted == []
        return
    assert len(adopted) == 1
    assert os.stat(store.root / adopted[0]).st_ino == image.stat().st_ino
    record = store.index.load(stored.manifest.id)
    assert record is not None
    assert {r.where.obj for r in record.chunks["images/pages-1.img"]} == set(adopted)
    assert stored.new_bytes >= len(pages)
    assert stamp_checked(source) is not None
    dest = store.fetch(stored.manifest.id, tmp_path / "out" / "snap")
    assert tree(dest) == tree(source)


def test_compressible_or_known_memory_is_packed_not_adopted(tmp_path: Path) -> None:
    """Memory that compresses well is compressed into packs; an image whose chunks the
    store mostly has (a kernel's next snapshot) has its few new chunks packed; an image
    changed since its seal is checked and packed."""
    store = LocalStore(tmp_path / "store", pack_bytes=1 << 20)
    rng = random.Random(37)
    text = b"".join(b"%08d some python heap " % i for i in range(400_000))[: 2048 * PAGE_SIZE]
    compressible = store.put(make_snapshot(tmp_path, text, chunk_kib=16))
    assert image_packs(store) == []
    assert compressible.stored_bytes < len(text) / 2

    pages = rng.randbytes(2048 * PAGE_SIZE)
    store.put(make_snapshot(tmp_path, pages, chunk_kib=16))
    first = image_packs(store)
    assert len(first) == 1
    changed = pages[:PAGE_SIZE] + rng.randbytes(PAGE_SIZE) + pages[2 * PAGE_SIZE :]
    second = store.put(make_snapshot(tmp_path, changed, chunk_kib=16, sequence=2))
    assert image_packs(store) == first
    assert second.new_bytes < len(pages) / 20

    other = rng.randbytes(2048 * PAGE_SIZE)
    source = make_snapshot(tmp_path, other, chunk_kib=16, sequence=3)
    (source / "images/pages-1.img").chmod(0o400)  # as sealed, but its ctime changed
    store.put(source)
    assert image_packs(store) == first


def test_an_image_pack_outlives_its_snapshot_directory_and_is_repacked(tmp_path: Path) -> None:
    """The image pack and the snapshot's file are two names of one read-only inode: the
    directory goes (the image cache evicts it) and the store still reads it; once the
    snapshot that adopted it is deleted and less than half of it is needed, its needed
    chunks are repacked into a pack with a trailer and it is deleted, while the other
    snapshot still restores."""
    store = LocalStore(tmp_path / "store", grace_seconds=0, pack_bytes=1 << 20)
    rng = random.Random(38)
    pages = rng.randbytes(2048 * PAGE_SIZE)
    first_dir = make_snapshot(tmp_path, pages, chunk_kib=16)
    first = store.put(first_dir)
    (adopted,) = image_packs(store)
    shutil.rmtree(first_dir)
    kept = pages[: 512 * PAGE_SIZE] + rng.randbytes(1536 * PAGE_SIZE)
    source = make_snapshot(tmp_path, kept, chunk_kib=16, sequence=2)
    second = store.put(source)
    assert adopted in packs_of(store, second)

    store.delete(first.manifest.id)

    assert adopted not in store.index.objects()
    fresh = type(store)(**reopen_args(store))
    out = fresh.fetch(second.manifest.id, tmp_path / "after-repack")
    assert (out / "images/pages-1.img").read_bytes() == kept


def test_chunk_lists_must_add_up_and_match_their_digest(tmp_path: Path) -> None:
    """A manifest's chunk list is checked as it is read: the sizes add up to the file,
    the digest is the list's, each chunk is well formed."""
    source = make_snapshot(tmp_path, random_pages(random.Random(34), 64), chunk_kib=16)
    raw = json.loads((source / "manifest.json").read_text())
    pages_entry = next(f for f in raw["files"] if f.get("chunks"))

    def damaged(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        copy = json.loads(json.dumps(raw))
        change(next(f for f in copy["files"] if f["path"] == pages_entry["path"]))
        return reseal(copy)

    def other_digest(entry: dict[str, Any]) -> None:
        entry["chunks"][0][0] = "0" * 64

    def short(entry: dict[str, Any]) -> None:
        entry["chunks"].pop()

    def malformed(entry: dict[str, Any]) -> None:
        entry["chunks"][0] = ["../x", -1]

    for change, message in ((other_digest, "sha256"), (short, "add up"), (malformed, "malformed")):
        with pytest.raises(SnapshotCorruptError, match=message):
            Manifest.from_dict(damaged(change))


def test_a_record_must_store_a_file_by_its_listed_chunks(store: Store, tmp_path: Path) -> None:
    """A record that lists other chunks for a chunked file than its manifest is damaged
    (each chunk read would check out, the file would not)."""
    stored = store.put(make_snapshot(tmp_path, random_pages(random.Random(35), 512), chunk_kib=16))
    record = json.loads(store.backend.load(Handle(Kind.RECORD, stored.manifest.id)) or b"")
    rows = record["chunks"]["images/pages-1.img"]
    rows[0], rows[1] = rows[1], rows[0]
    fresh_id = record["manifest"]["id"] = uuid.uuid4().hex
    reseal(record["manifest"])
    assert store.backend.save_if_absent(Handle(Kind.RECORD, fresh_id), json.dumps(record).encode())
    with pytest.raises(SnapshotCorruptError, match="not those of its manifest entry"):
        store.get(fresh_id)


def test_invalid_manifests_are_refused(store: Store, tmp_path: Path) -> None:
    source = make_snapshot(tmp_path, random_pages(random.Random(19), 16))
    raw = json.loads((source / "manifest.json").read_text())
    for damaged in ({**raw, "id": "../x"}, {k: v for k, v in raw.items() if k != "lineage"}):
        (source / "manifest.json").write_text(json.dumps(damaged))
        with pytest.raises(SnapshotCorruptError):
            store.put(source)
    assert store.snapshots() == []


@pytest.mark.parametrize("bad_path", ["../outside.img", "/etc/hostname", "images//core.img"])
def test_traversal_paths_in_a_manifest_are_refused(
    store: Store, tmp_path: Path, bad_path: str
) -> None:
    """By the store's put and by a local check alike (one rule, manifest.safe_relpath)."""
    source = make_snapshot(tmp_path, random_pages(random.Random(12), 16))
    raw = json.loads((source / "manifest.json").read_text())
    raw["files"][0]["path"] = bad_path
    (source / "manifest.json").write_text(json.dumps(reseal(raw)))
    with pytest.raises(SnapshotCorruptError, match="not allowed"):
        store.put(source)
    assert store.snapshots() == []
    with pytest.raises(SnapshotCorruptError, match="not allowed"):
        manifest_mod.verify(source)


@pytest.mark.parametrize(
    "bad_id",
    ["../x", "..", "", "a" * 31, "a" * 33, "A" * 32, "g" * 32, "../" + "a" * 29, "a" * 31 + "/"],
)
def test_invalid_ids_are_rejected(store: Store, tmp_path: Path, bad_id: str) -> None:
    with pytest.raises(BadIdError, match="not a snapshot id"):
        store.get(bad_id)
    with pytest.raises(BadIdError):
        store.fetch(bad_id, tmp_path / "out")
    with pytest.raises(BadIdError):
        store.delete(bad_id)
    assert not (tmp_path / "out").exists()


def test_unknown_id_is_not_found(store: Store, tmp_path: Path) -> None:
    unknown = uuid.uuid4().hex
    with pytest.raises(SnapshotNotFoundError, match=unknown):
        store.get(unknown)
    with pytest.raises(SnapshotNotFoundError):
        store.fetch(unknown, tmp_path / "out")


def test_users_with_different_prefixes_are_apart(make_store: MakeStore, tmp_path: Path) -> None:
    alice, bob = make_store(grace_seconds=0), make_store(grace_seconds=0)
    pages = random_pages(random.Random(13), 256)
    mine = alice.put(make_snapshot(tmp_path, pages))
    theirs = bob.put(make_snapshot(tmp_path, pages))
    assert theirs.new_bytes == theirs.stored_bytes  # nothing shared across prefixes
    assert [s.manifest.id for s in alice.snapshots()] == [mine.manifest.id]
    assert [s.manifest.id for s in bob.snapshots()] == [theirs.manifest.id]
    with pytest.raises(SnapshotNotFoundError):
        bob.get(mine.manifest.id)
    alice.delete(mine.manifest.id)
    assert bob.fetch(theirs.manifest.id, tmp_path / "bob").is_dir()


def test_list_is_sorted_by_lineage_and_sequence(store: Store, tmp_path: Path) -> None:
    pages = random_pages(random.Random(14), 16)
    for lineage, sequence in [("b" * 32, 2), ("a" * 32, 3), ("b" * 32, 1), ("a" * 32, 10)]:
        store.put(make_snapshot(tmp_path, pages, lineage=lineage, sequence=sequence))
    listed = [(s.manifest.lineage[0], s.manifest.sequence) for s in store.snapshots()]
    assert listed == [("a", 3), ("a", 10), ("b", 1), ("b", 2)]


def test_tampered_record_cannot_write_outside(store: Store, tmp_path: Path) -> None:
    stored = store.put(make_snapshot(tmp_path, random_pages(random.Random(15), 16)))
    record = json.loads(store.backend.load(Handle(Kind.RECORD, stored.manifest.id)) or b"")
    entry = record["manifest"]["files"][-1]
    record["chunks"]["../../evil"] = record["chunks"].pop(entry["path"])
    entry["path"] = "../../evil"
    fresh_id = record["manifest"]["id"] = uuid.uuid4().hex
    reseal(record["manifest"])
    assert store.backend.save_if_absent(Handle(Kind.RECORD, fresh_id), json.dumps(record).encode())
    with pytest.raises(SnapshotCorruptError, match="not allowed"):
        store.fetch(fresh_id, tmp_path / "out" / "snap")
    assert not (tmp_path / "evil").exists()
    assert [s.manifest.id for s in store.snapshots()] == [stored.manifest.id]  # logged, skipped


def test_unavailable_store_raises_store_error(
    make_store: MakeStore, backend: str, tmp_path: Path
) -> None:
    if backend == "s3":
        broken = make_store(endpoint_url=f"http://127.0.0.1:{free_port()}")
    else:  # a store directory that cannot exist: it would be under a regular file
        (tmp_path / "file").write_text("")
        broken = LocalStore(tmp_path / "file" / "store")
    source = make_snapshot(tmp_path, random_pages(random.Random(16), 64))

    with pytest.raises(StoreError) as caught:
        broken.put(source)
    assert caught.value.hint
    with pytest.raises(StoreError):
        broken.snapshots()


def test_network_cut_mid_upload_leaves_no_record(
    moto: MotoServer, proxy: CuttableProxy, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    store = S3Store(
        moto.ensure_bucket(BUCKET),
        f"users/{uuid.uuid4().hex[:8]}",
        endpoint_url=proxy.url,
        max_workers=4,
        pack_bytes=256 << 10,
    )
    request.addfinalizer(store.close)
    source = make_snapshot(tmp_path, random_pages(random.Random(17), 4096))

    def cut_after_some_packs(event: dict[str, Any]) -> None:
        if event["phase"] == "uploading" and event["done_bytes"] > 4 << 20:
            proxy.cut()

    with pytest.raises(StoreError) as caught:
        store.put(source, progress=cut_after_some_packs)
    assert proxy.url in caught.value.hint

    proxy.restore()
    assert store.snapshots() == []
    stored = store.put(source)  # a retry after the network is back completes
    assert [s.manifest.id for s in store.snapshots()] == [stored.manifest.id]
    assert stored_objects(store) == referenced_objects(store)  # and removes the first try's


def count_requests(store: S3Store) -> list[str]:
    calls: list[str] = []
    store.client.meta.events.register(
        "before-call.s3.*", lambda model, **_: calls.append(model.name)
    )
    return calls


def test_s3_requests_grow_with_packs_not_chunks(
    moto: MotoServer, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Many chunks, a request per pack: a put and a fetch of 8 MiB in packs of 512 KiB
    (the ratio of 16 MiB packs to a 256 MiB kernel) cost one PUT or ranged GET per pack
    and a handful of others; a second, identical snapshot writes no pack."""
    store = S3Store(
        moto.ensure_bucket(BUCKET),
        f"users/{uuid.uuid4().hex[:8]}",
        moto.url,
        pack_bytes=512 << 10,
        chunking=SMALL_CHUNKS,
    )
    request.addfinalizer(store.close)
    pages = random.Random(12).randbytes(8 << 20)
    calls = count_requests(store)
    first = store.put(make_snapshot(tmp_path, pages, sequence=1))
    pack_count = len(packs_of(store, first))
    assert first.chunk_count > 4 * pack_count
    assert calls.count("PutObject") <= pack_count + 4  # + claims and the record
    assert len(calls) <= pack_count + 12, " ".join(calls)
    assert "HeadObject" not in calls

    calls.clear()
    second = store.put(make_snapshot(tmp_path, pages, sequence=2))
    assert second.new_bytes == 0
    assert len(calls) <= 12, calls

    calls.clear()
    store.fetch(second.manifest.id, tmp_path / "out")
    assert calls.count("GetObject") <= pack_count + 2
    assert len(calls) <= pack_count + 4, calls


def test_s3_listing_past_one_page_goes_per_directory(
    moto: MotoServer, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A small store is listed in one request; a big one (here: a page of 20 keys) goes on
    per pack directory in parallel after the first page, and finds every pack once."""
    store = S3Store(
        moto.ensure_bucket(BUCKET), f"users/{uuid.uuid4().hex[:8]}", moto.url, pack_bytes=8192
    )
    request.addfinalizer(store.close)
    store.put(make_snapshot(tmp_path, random_pages(random.Random(13), 256), sequence=1))
    store.backend.list_page_size = 1000
    one_page = dict(store.backend.entries(Kind.PACK))
    assert 20 < len(one_page) < 1000
    prefixes: list[str] = []
    store.client.meta.events.register(
        "before-parameter-build.s3.ListObjectsV2",
        lambda params, **_: prefixes.append(params["Prefix"].removeprefix(store.backend.prefix)),
    )
    store.backend.list_page_size = 20
    listed = list(store.backend.entries(Kind.PACK))
    assert dict(listed) == one_page
    assert len(listed) == len(one_page)  # nothing twice
    last_of_first_page = sorted(one_page)[19].split("/")[1]
    assert prefixes[0] == "/packs/"
    per_directory = prefixes[1:]
    expected = [f"/packs/{d:02x}/" for d in range(int(last_of_first_page, 16), 256)]
    assert sorted(per_directory) == expected  # each once, in parallel


# -- failed puts clean up after themselves --------------------------------------------------


def stored_objects(store: Store) -> set[str]:
    return set(store.index.objects())


def referenced_objects(store: Store) -> set[str]:
    return {
        ref.where.obj
        for r in store.index.records(strict=True).values()
        for ref in r.distinct().values()
    }


def claims_and_markers(store: Store) -> list[str]:
    return [name for name, _ in store.claims.listing()]


def test_failed_put_removes_its_packs_but_not_shared_ones(store: Store, tmp_path: Path) -> None:
    """A put that fails after uploading (its last file differs from the manifest) removes
    at once the packs it wrote; those an earlier snapshot references stay."""
    rng = random.Random(20)
    pages = random_pages(rng, 1024)
    first = store.put(make_snapshot(tmp_path, pages, sequence=1))
    kept = stored_objects(store)
    source = make_snapshot(
        tmp_path, mutate(pages, rng, inserts=8, changes=64), sequence=2, extra={"z.img": b"z" * 9}
    )
    (source / "images/z.img").write_bytes(b"y" * 9)  # found only after the pages are uploaded
    uploaded: list[int] = []

    def watch(event: dict[str, Any]) -> None:
        uploaded.append(event["done_bytes"])

    with pytest.raises(SnapshotCorruptError, match="differs from its manifest"):
        store.put(source, progress=watch)
    assert max(uploaded) > len(pages)  # the new chunks were written before it failed
    assert stored_objects(store) == kept == referenced_objects(store)
    assert claims_and_markers(store) == []
    assert manifest_mod.verify(store.fetch(first.manifest.id, tmp_path / "out")).id == (
        first.manifest.id
    )


def test_a_live_claim_protects_its_packs_until_it_is_stale(store: Store, tmp_path: Path) -> None:
    """A put killed mid-way leaves packs and its claim: sweeps spare the packs while the
    claim is fresh (the put may be alive), and remove both once it is stale."""
    builder = packs.PackBuilder()
    orphan = random_pages(random.Random(21), 64)
    builder.add(hashlib.sha256(orphan).hexdigest(), len(orphan), orphan, "raw")
    digest = builder.name
    store.backend.save(Handle(Kind.PACK, digest), builder.finish())
    store.claims.write("f" * 32, "e" * 32, {digest})
    other = store.put(make_snapshot(tmp_path, random_pages(random.Random(22), 64)))
    store.delete(other.manifest.id)  # a sweep with no grace period
    assert stored_objects(store) == {digest}
    assert claims_and_markers(store) == ["f" * 32 + ".json"]

    store.claims.claim_stale_seconds = 0
    store.put(make_snapshot(tmp_path, random_pages(random.Random(23), 64)))  # it collects
    assert digest not in stored_objects(store)
    assert stored_objects(store) == referenced_objects(store)
    assert claims_and_markers(store) == []


def test_a_put_waits_out_a_cleanup_and_sees_its_deletions(store: Store, tmp_path: Path) -> None:
    """A clean-up that read the claims before this put published its packs deletes one
    of them: the put, committing meanwhile, waits while the clean-up's marker is there,
    then finds the pack gone and stores its chunks again instead of recording it."""
    pages = random_pages(random.Random(24), 512)
    first = store.put(make_snapshot(tmp_path, pages))
    victim = refs_of(store, first)[0].where.obj
    store.backend.save(Handle(Kind.PUT, "c" * 32 + ".cleaning"), b"")
    second = make_snapshot(tmp_path, pages, sequence=2)
    committing = threading.Event()
    outcome: list[Exception | StoredSnapshot] = []

    def put() -> None:
        try:
            outcome.append(
                store.put(second, progress=lambda e: e["phase"] != "committing" or committing.set())
            )
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            outcome.append(exc)

    thread = threading.Thread(target=put)
    thread.start()
    assert committing.wait(60)
    delete_object(store, victim)
    store.backend.remove(Handle(Kind.PUT, "c" * 32 + ".cleaning"))
    thread.join()
    [result] = outcome
    assert isinstance(result, StoredSnapshot), result
    assert victim not in packs_of(store, result)
    assert tree(store.fetch(result.manifest.id, tmp_path / "out")) == tree(second)


def test_a_put_does_not_wait_for_the_marker_of_a_killed_cleanup(
    store: Store, tmp_path: Path
) -> None:
    """A server killed during a clean-up leaves its marker; on its host, the next put
    sees that its process is gone and goes on at once (it does not wait for the marker
    to age), and removes it."""
    from jupyter_ext.core.store.claims import process_identity

    gone = subprocess.Popen(["true"])
    owner = process_identity(gone.pid)
    gone.wait()
    store.backend.save(Handle(Kind.PUT, "d" * 32 + ".cleaning"), json.dumps(owner).encode())
    store.claims.marker_stale_seconds = 3600  # waiting it out would outlast the test's timeout
    stored = store.put(make_snapshot(tmp_path, random_pages(random.Random(25), 64)))
    assert [s.manifest.id for s in store.snapshots()] == [stored.manifest.id]
    assert claims_and_markers(store) == []


def test_raw_chunks_are_copied_inside_the_kernel_where_it_can(tmp_path: Path) -> None:
    """A local store copies a raw chunk file to file (copy_file_range) on one file system;
    from a file it cannot copy from (here a pipe) it writes the chunk's bytes instead; a
    file that shrank since it was cut is an error, not a short pack."""
    data = random.Random(26).randbytes(3 * PAGE_SIZE)
    source = tmp_path / "pages.img"
    source.write_bytes(data)
    with source.open("rb") as src, (tmp_path / "out").open("wb") as out:
        assert local.copy_range(src.fileno(), PAGE_SIZE, 2 * PAGE_SIZE, out.fileno())
        with pytest.raises(OSError, match="shrank"):
            local.copy_range(src.fileno(), 2 * PAGE_SIZE, 3 * PAGE_SIZE, out.fileno())
    assert (tmp_path / "out").read_bytes()[: 2 * PAGE_SIZE] == data[PAGE_SIZE:]
    read_end, write_end = os.pipe()
    try:
        with (tmp_path / "out2").open("wb") as out:
            assert not local.copy_range(read_end, 0, len(data), out.fileno())
        assert (tmp_path / "out2").read_bytes() == b""
    finally:
        os.close(read_end)
        os.close(write_end)


def test_slices_that_follow_each_other_in_a_file_are_copied_as_one_run() -> None:
    """Packs copy runs of chunks, not chunk by chunk; a gap, another file or bytes in
    memory start a new run."""
    view = memoryview(bytes(4 * PAGE_SIZE))

    def piece(fd: int, page: int) -> packs.FileSlice:
        return packs.FileSlice(fd, page * PAGE_SIZE, view[:PAGE_SIZE])

    parts: list[packs.Blob] = [piece(3, 0), piece(3, 1), piece(3, 2), piece(4, 3)]
    parts += [b"trailer", piece(4, 4), piece(4, 6)]
    runs = list(local.runs(parts))
    assert [len(run) for run in runs] == [3, 1, 1, 1, 1]
    assert runs[0] == parts[:3]
    assert runs[2] == [b"trailer"]


def test_a_snapshot_on_another_file_system_is_stored_whole(tmp_path: Path) -> None:
    """Staged on tmpfs, stored on this disk: the kernel cannot copy between them, the put
    writes the bytes, and the snapshot comes back the same."""
    with tmpfs_disk(tmp_path / "disk", "64m") as staging:
        store = LocalStore(tmp_path / "store", grace_seconds=0, chunking=SMALL_CHUNKS)
        source = make_snapshot(staging, random.Random(27).randbytes(8 << 20))
        stored = store.put(source)
        out = store.fetch(stored.manifest.id, tmp_path / "back")
        assert tree(out) == tree(source)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with tmpfs_disk(tmp_path / "disk", "20m") as path:
        yield path


def test_full_local_store_says_so_and_keeps_nothing(small_disk: Path, tmp_path: Path) -> None:
    """A 40 MiB snapshot does not fit a 20 MiB store: the error says the disk is full,
    where, and how much against what is free; the put removes what it wrote (the store
    holds no unreferenced pack and is as empty as before); a concurrent put of a snapshot
    sharing chunks with it is not harmed, and a smaller snapshot fits afterwards."""
    store = LocalStore(small_disk / "store", grace_seconds=0, chunking=SMALL_CHUNKS)
    rng = random.Random(25)
    big_pages = rng.randbytes(40 << 20)  # incompressible
    big = make_snapshot(tmp_path, big_pages)
    shared = make_snapshot(tmp_path, big_pages[: 2 << 20], sequence=2)
    free_before = shutil.disk_usage(small_disk).free

    committing = threading.Event()
    go_on = threading.Event()
    outcome: list[Exception | StoredSnapshot] = []

    def hold_at_commit(event: dict[str, Any]) -> None:
        if event["phase"] == "committing":
            committing.set()
            assert go_on.wait(120)

    def put_shared() -> None:
        try:
            outcome.append(store.put(shared, progress=hold_at_commit))
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            outcome.append(exc)

    thread = threading.Thread(target=put_shared)
    thread.start()
    try:
        assert committing.wait(120)  # its chunks are written and claimed; not committed yet
        with pytest.raises(StoreError) as caught:
            store.put(big)
    finally:
        go_on.set()
        thread.join()
    message = caught.value.message
    assert "is full" in message, message
    assert str(store.root) in message, message
    assert "needs up to 40.0 MiB" in message, message
    assert "MiB of 20.0 MiB are free" in message, message
    [survivor] = outcome
    assert isinstance(survivor, StoredSnapshot), survivor
    assert manifest_mod.verify(store.fetch(survivor.manifest.id, tmp_path / "shared")).id == (
        survivor.manifest.id
    )
    assert stored_objects(store) == referenced_objects(store)  # nothing of the failed put
    assert claims_and_markers(store) == []
    assert not list(store.root.glob("**/.*.tmp"))
    assert shutil.disk_usage(small_disk).free >= free_before - survivor.stored_bytes - (1 << 20)

    smaller = store.put(make_snapshot(tmp_path, rng.randbytes(8 << 20), sequence=3))
    assert {s.manifest.id for s in store.snapshots()} == {survivor.manifest.id, smaller.manifest.id}
    assert stored_objects(store) == referenced_objects(store)


def test_s3_upload_cut_mid_way_leaves_no_unreferenced_packs(
    moto: MotoServer, proxy: CuttableProxy, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The network fails mid-upload, so the failed put cannot remove its packs at once:
    the next put through the same store does, once S3 answers again."""
    store = S3Store(
        moto.ensure_bucket(BUCKET),
        f"users/{uuid.uuid4().hex[:8]}",
        endpoint_url=proxy.url,
        max_workers=4,
        pack_bytes=256 << 10,
    )
    request.addfinalizer(store.close)
    source = make_snapshot(tmp_path, random_pages(random.Random(26), 4096))

    def cut_after_some_packs(event: dict[str, Any]) -> None:
        if event["phase"] == "uploading" and event["done_bytes"] > 4 << 20:
            proxy.cut()

    with pytest.raises(StoreError):
        store.put(source, progress=cut_after_some_packs)
    proxy.restore()
    left = stored_objects(store)
    assert left  # S3 was gone: nothing could be removed
    assert not referenced_objects(store)

    other = store.put(make_snapshot(tmp_path, random_pages(random.Random(27), 64)))
    assert stored_objects(store) == referenced_objects(store) == packs_of(store, other)
    assert claims_and_markers(store) == []


def test_s3_download_cut_mid_way_leaves_nothing(
    moto: MotoServer, proxy: CuttableProxy, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A fetch that fails mid-download removes what it wrote at once."""
    store = S3Store(
        moto.ensure_bucket(BUCKET),
        f"users/{uuid.uuid4().hex[:8]}",
        endpoint_url=proxy.url,
        max_workers=4,
        pack_bytes=256 << 10,
    )
    request.addfinalizer(store.close)
    stored = store.put(make_snapshot(tmp_path, random_pages(random.Random(28), 2048)))

    def cut_after_first_chunk(event: dict[str, Any]) -> None:
        if event["phase"] == "downloading" and event["done_bytes"] > 0:
            proxy.cut()

    (tmp_path / "cache").mkdir()
    with pytest.raises(StoreError):
        store.fetch(stored.manifest.id, tmp_path / "cache" / "out", cut_after_first_chunk)
    assert list((tmp_path / "cache").iterdir()) == []


# -- formats --------------------------------------------------------------------------------


def test_a_format_1_store_is_still_read_and_cleaned(store: Store, tmp_path: Path) -> None:
    """Stores written before pack files (a chunk an object, record format 1) are read:
    listed, fetched, deleted (with their chunk objects); new snapshots go into packs."""
    import zstandard

    source = make_snapshot(tmp_path, random_pages(random.Random(40), 256))
    raw = json.loads((source / "manifest.json").read_text())
    chunks: dict[str, list[dict[str, Any]]] = {}
    for entry in raw["files"]:
        data = (source / entry["path"]).read_bytes()
        refs = chunks[entry["path"]] = []
        for start in range(0, len(data), 64 << 10):
            piece = data[start : start + (64 << 10)]
            digest = hashlib.sha256(piece).hexdigest()
            blob = zstandard.ZstdCompressor().compress(piece)
            write_object(store, packs.legacy_chunk_name(digest), blob)
            refs.append({"hash": digest, "size": len(piece), "stored_size": len(blob)})
    record = {"format": 1, "manifest": raw, "chunks": chunks, "stored_bytes": 1, "new_bytes": 1}
    assert store.backend.save_if_absent(Handle(Kind.RECORD, raw["id"]), json.dumps(record).encode())

    assert [s.manifest.id for s in store.snapshots()] == [raw["id"]]
    assert tree(store.fetch(raw["id"], tmp_path / "old")) == tree(source)
    newer = store.put(make_snapshot(tmp_path, random_pages(random.Random(41), 64), sequence=2))
    assert any(packs.PACK_NAME_RE.match(name) for name in packs_of(store, newer))
    store.delete(raw["id"])
    assert stored_objects(store) == packs_of(store, newer)


def test_a_record_of_a_newer_format_says_to_upgrade(store: Store, tmp_path: Path) -> None:
    stored = store.put(make_snapshot(tmp_path, random_pages(random.Random(42), 16)))
    record = json.loads(store.backend.load(Handle(Kind.RECORD, stored.manifest.id)) or b"")
    record["format"] = 99
    record["manifest"]["id"] = fresh_id = uuid.uuid4().hex
    reseal(record["manifest"])
    assert store.backend.save_if_absent(Handle(Kind.RECORD, fresh_id), json.dumps(record).encode())
    with pytest.raises(SnapshotCorruptError, match="newer version") as caught:
        store.get(fresh_id)
    assert "Upgrade" in caught.value.hint
    assert [s.manifest.id for s in store.snapshots()] == [stored.manifest.id]  # logged, skipped


@pytest.mark.parametrize("kib", [8, 48, 100])
def test_a_chunk_size_no_chunking_can_use_is_refused_when_configured(kib: int) -> None:
    """The server's chunk_kib goes to every snapshot request: a size that cannot cut pages
    (not a power of two of at least 16 KiB) is refused at start-up, naming the option."""
    from traitlets import TraitError

    from jupyter_ext.app import SnapshotExtensionApp

    with pytest.raises(TraitError, match=r"chunk_kib must be 0 \(automatic\) or a power of two"):
        SnapshotExtensionApp(chunk_kib=kib)
    assert SnapshotExtensionApp(chunk_kib=64).chunk_kib == 64
