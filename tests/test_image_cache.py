"""The local image cache (issue 16.3): the newest snapshot of each kernel stays unpacked in
the work directory, and a restore on the same machine is served from it, checked with a
stat per file, without reading the store. Real jupyter_server, kernels and CRIU."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest

from jupyter_ext.core.imagecache import RECORD_NAME, ImageCache, stamp_tree
from jupyter_ext.core.manifest import MANIFEST_NAME, Manifest, seal
from jupyter_ext.manager import SnapshotManager

from .support.jupyter_api import Fetch, call, manager_of, server_config, snapshot, wait_job

pytestmark = pytest.mark.usefixtures("criu", "snapshot_kernelspec")

STATE = "import numpy as np; st = np.arange({n}); st_sum = int(st.sum())"
CHECK = "print(int(st.sum()) == st_sum, len(st))"


@pytest.fixture
def jp_server_config(tmp_path: Path) -> dict[str, Any]:
    return server_config(tmp_path, image_cache_max_bytes=-1)


def cached_ids(manager: SnapshotManager) -> list[str]:
    return sorted(e.snapshot_id for e in manager.image_cache.entries())


def pages_file(entry: Path) -> Path:
    """The largest image of an entry: the kernel's memory (a first snapshot copies it
    while the kernel runs: its level is under images/parent, core/criu/chain.py)."""
    return max((entry / "images").rglob("pages-*.img"), key=lambda p: p.stat().st_size)


async def unused(manager: SnapshotManager, snapshot_id: str, timeout: float = 120) -> bool:
    """Whether no restore holds the entry any more (a lazily restored kernel holds it
    until its memory has arrived), waiting without blocking the server's loop."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not manager.image_cache.wait_unused(snapshot_id, timeout=0):
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def restore(jp_fetch: Fetch, snapshot_id: str, **body: str) -> dict[str, Any]:
    answer = await call(jp_fetch, "POST", snapshot_id, "restore", body=body)
    job = await wait_job(jp_fetch, answer["job"])
    assert job["status"] == "done", job
    result: dict[str, Any] = job["result"]
    return result


async def run_in(start_kernel: Any, kernel_id: str, code: str) -> str:
    kernel = await start_kernel(kernel_id)
    out: str = await kernel.run(code)
    return out.strip()


async def test_restore_is_served_from_the_cache_without_the_store(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any, tmp_path: Path
) -> None:
    manager = manager_of(jp_serverapp)
    kernel = await start_kernel()
    await kernel.run(STATE.format(n=2_000_000))
    snap = (await snapshot(jp_fetch, kernel.id))["result"]
    assert snap["status"] == "complete"
    entry = manager.image_cache_dir / snap["id"]
    assert cached_ids(manager) == [snap["id"]]
    assert Manifest.read(entry).id == snap["id"]
    assert not pages_file(entry).stat().st_mode & 0o222, "cached files are read-only"
    assert not list(manager.staging_dir.iterdir()), "the dump moved into the cache"

    # The store is gone while the restore runs: only the cache can serve it.
    (tmp_path / "store").rename(tmp_path / "store-away")
    try:
        result = await restore(jp_fetch, snap["id"])
    finally:
        (tmp_path / "store-away").rename(tmp_path / "store")
    assert result["source"] == "cache"
    assert result["kernel_id"] != kernel.id
    assert await run_in(start_kernel, result["kernel_id"], CHECK) == "True 2000000"

    # In place too; the entry is still there and intact afterwards.
    await kernel.run("st = None")
    result = await restore(jp_fetch, snap["id"], kernel_id=kernel.id)
    assert result["source"] == "cache"
    assert (await kernel.run(CHECK)).strip() == "True 2000000"
    assert await unused(manager, snap["id"])
    assert cached_ids(manager) == [snap["id"]]


@pytest.mark.needs_root("lazy restore")
async def test_the_server_decides_whether_a_cached_kernel_restores_lazily(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any
) -> None:
    """From the cache (images on this machine) a kernel is restored lazily from
    lazy_restore_min_bytes of memory on, into a new kernel and in place: the server
    decides (core.lazypages.lazy_plan) and tells the wrapper, whose own settings (in its
    environment: the default minimum, far above this kernel) are only for its own
    restores."""
    manager = manager_of(jp_serverapp)
    if not await manager.lending.lazy_pages_here():
        pytest.skip("lazy pages are not supported on this machine")
    kernel = await start_kernel()
    await kernel.run(STATE.format(n=2_000_000))
    snapshot_id = (await snapshot(jp_fetch, kernel.id))["result"]["id"]

    async def lazy_state(kernel_id: str) -> dict[str, Any]:
        await manager.lending.settled()  # the kernel has all of its memory
        status = await call(jp_fetch, "GET", "kernels", kernel_id)
        state: dict[str, Any] = status["lazy_restore"]
        return state

    manager.lazy_min_bytes = 0
    result = await restore(jp_fetch, snapshot_id)
    assert result["source"] == "cache"
    assert (await lazy_state(result["kernel_id"])).get("state") == "complete"
    assert await run_in(start_kernel, result["kernel_id"], CHECK) == "True 2000000"
    await kernel.run("st = None")
    assert (await restore(jp_fetch, snapshot_id, kernel_id=kernel.id))["source"] == "cache"
    assert (await lazy_state(kernel.id)).get("state") == "complete"
    assert (await kernel.run(CHECK)).strip() == "True 2000000"

    manager.lazy_min_bytes = 1 << 40  # the same kernel, in full
    result = await restore(jp_fetch, snapshot_id)
    assert await lazy_state(result["kernel_id"]) == {}
    assert await run_in(start_kernel, result["kernel_id"], CHECK) == "True 2000000"


class TestUnencrypted:
    @pytest.fixture
    def jp_server_config(self, tmp_path: Path) -> dict[str, Any]:
        return server_config(tmp_path, image_cache_max_bytes=-1, encryption_key_source="none")

    async def test_a_first_snapshot_is_one_inode_in_the_store_and_the_cache(
        self, jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any, tmp_path: Path
    ) -> None:
        """A kernel's first snapshot of random floats in an unencrypted local store: the
        store adopts the sealed memory image (an image pack) and the image cache keeps the
        same file, stamped as the put left it: a restore finds it fresh (nothing hashed
        again) and serves it."""
        manager = manager_of(jp_serverapp)
        snap = await first_snapshot_of_floats(jp_fetch, start_kernel)
        entry = manager.image_cache_dir / snap["id"]
        adopted = list((tmp_path / "store").rglob("*.img"))
        assert len(adopted) == 1
        assert adopted[0].stat().st_ino == pages_file(entry).stat().st_ino
        await restored_from_a_fresh_entry(jp_fetch, start_kernel, manager, snap["id"])


async def test_an_encrypted_store_copies_the_first_snapshot_and_the_cache_serves_it(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any, tmp_path: Path
) -> None:
    """Encrypted (the default), the store never adopts an image (it would be the kernel's
    memory in the clear): the memory is sealed into packs, and the image cache keeps the
    dump's files, fresh, and serves the restore."""
    manager = manager_of(jp_serverapp)
    snap = await first_snapshot_of_floats(jp_fetch, start_kernel)
    assert not list((tmp_path / "store").rglob("*.img"))
    assert list((tmp_path / "store").rglob("keys/*"))
    await restored_from_a_fresh_entry(jp_fetch, start_kernel, manager, snap["id"])


async def first_snapshot_of_floats(jp_fetch: Fetch, start_kernel: Any) -> dict[str, Any]:
    kernel = await start_kernel()
    await kernel.run("import numpy as np; st = np.random.default_rng(5).random(24_000_000)")
    await kernel.run("st_sum = float(st.sum())")
    snap: dict[str, Any] = (await snapshot(jp_fetch, kernel.id))["result"]
    return snap


async def restored_from_a_fresh_entry(
    jp_fetch: Fetch, start_kernel: Any, manager: SnapshotManager, snapshot_id: str
) -> None:
    lease = manager.image_cache.lease(snapshot_id)
    assert lease is not None
    assert lease.fresh, "the stamps the put left are the cached files' stamps"
    lease.release()
    result = await restore(jp_fetch, snapshot_id)
    assert result["source"] == "cache"
    out = await run_in(start_kernel, result["kernel_id"], "print(float(st.sum()) == st_sum)")
    assert out == "True"


async def test_a_changed_entry_is_hashed_again_and_a_tampered_one_falls_back_to_the_store(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any
) -> None:
    manager = manager_of(jp_serverapp)
    kernel = await start_kernel()
    await kernel.run(STATE.format(n=1_000_000))
    snap = (await snapshot(jp_fetch, kernel.id))["result"]
    entry = manager.image_cache_dir / snap["id"]
    pages = pages_file(entry)

    # Only its ctime changes (a chmod, as when a hard link goes away): hashed again, kept.
    pages.chmod(0o644)
    pages.chmod(0o444)
    result = await restore(jp_fetch, snap["id"])
    assert result["source"] == "cache"
    assert await run_in(start_kernel, result["kernel_id"], CHECK) == "True 1000000"

    # One byte of the kernel's memory changed, size and mtime put back: dropped, and the
    # restore comes from the store (and leaves the good copy cached).
    good = pages.read_bytes()
    before = pages.stat()
    pages.chmod(0o644)
    with pages.open("r+b") as fh:
        fh.seek(len(good) // 2)
        fh.write(bytes([good[len(good) // 2] ^ 0xFF]))
    os.utime(pages, ns=(before.st_atime_ns, before.st_mtime_ns))
    pages.chmod(0o444)
    await kernel.run("st = None")
    result = await restore(jp_fetch, snap["id"], kernel_id=kernel.id)
    assert result["source"] == "store"
    assert (await kernel.run(CHECK)).strip() == "True 1000000"
    await manager.lending.settled()  # all pages in: the download is checked, cached
    assert cached_ids(manager) == [snap["id"]]
    assert pages_file(entry).read_bytes() == good
    assert (await restore(jp_fetch, snap["id"], kernel_id=kernel.id))["source"] == "cache"


async def test_newest_per_kernel_stays_oldest_goes_past_the_budget_not_one_in_use(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any
) -> None:
    manager = manager_of(jp_serverapp)
    cache = manager.image_cache
    a, b, c = [await start_kernel() for _ in range(3)]
    for kernel in (a, b, c):
        await kernel.run(STATE.format(n=1_000_000))

    first = (await snapshot(jp_fetch, a.id))["result"]["id"]
    newer = (await snapshot(jp_fetch, a.id))["result"]["id"]
    assert cached_ids(manager) == [newer], "a kernel's older snapshot leaves the cache"

    size = cache.entries()[0].bytes
    cache.max_bytes = int(size * 2.5)  # room for two
    b_snap = (await snapshot(jp_fetch, b.id))["result"]["id"]
    assert cached_ids(manager) == sorted([newer, b_snap])
    held = cache.lease(newer)  # a restore reading a's snapshot: it must stay
    assert held is not None
    assert held.fresh
    try:
        c_snap = (await snapshot(jp_fetch, c.id))["result"]["id"]
        assert cached_ids(manager) == sorted([newer, c_snap]), "b's went, not a's in use"
    finally:
        held.release()
    d_snap = (await snapshot(jp_fetch, b.id))["result"]["id"]
    assert cached_ids(manager) == sorted([c_snap, d_snap]), "now the oldest, a's, goes"
    assert first not in cached_ids(manager)

    # Deleting a snapshot removes its entry; a restore of an uncached one downloads it.
    await call(jp_fetch, "DELETE", c_snap)
    assert cached_ids(manager) == [d_snap]
    result = await restore(jp_fetch, newer)
    assert result["source"] == "store"
    assert await run_in(start_kernel, result["kernel_id"], CHECK) == "True 1000000"


async def test_an_incremental_snapshot_links_its_parents_memory_and_stays_fresh(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any
) -> None:
    """A kernel's second snapshot builds on its first, cached here: its chain hard-links
    the first's memory (no copy), the first's entry goes once the second is admitted,
    and the entry left is still fresh (the links that came and went changed ctimes only):
    a restore reads it at once, hashing nothing. The cache counts shared files once."""
    manager = manager_of(jp_serverapp)
    kernel = await start_kernel()
    await kernel.run(STATE.format(n=4_000_000))
    first = (await snapshot(jp_fetch, kernel.id))["result"]
    big = pages_file(manager.image_cache_dir / first["id"])
    inode = big.stat().st_ino
    await kernel.run("st[:1000] = 1; st_sum = int(st.sum())")
    second = (await snapshot(jp_fetch, kernel.id))["result"]
    assert second["memory"]["mode"] == "incremental", second["memory"]["reason"]
    assert cached_ids(manager) == [second["id"]]
    entry = manager.image_cache_dir / second["id"]
    linked = [p for p in (entry / "images" / "parent").rglob("*") if p.stat().st_ino == inode]
    assert linked, "the first snapshot's memory is linked, not copied"
    lease = manager.image_cache.lease(second["id"])
    assert lease is not None
    assert lease.fresh, "unlinking the first's entry changed only ctimes: stamped anew"
    lease.release()
    on_disk = {p.stat().st_ino: p.stat().st_size for p in entry.rglob("*") if p.is_file()}
    assert manager.image_cache.total_bytes() <= sum(on_disk.values())
    result = await restore(jp_fetch, second["id"])
    assert result["source"] == "cache"
    assert await run_in(start_kernel, result["kernel_id"], CHECK) == "True 4000000"


async def test_a_budget_of_zero_turns_the_cache_off(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any
) -> None:
    manager = manager_of(jp_serverapp)
    manager.image_cache.max_bytes = 0
    kernel = await start_kernel()
    await kernel.run(STATE.format(n=1_000_000))
    snap = (await snapshot(jp_fetch, kernel.id))["result"]
    assert cached_ids(manager) == []
    assert not list(manager.staging_dir.iterdir()), "the stored dump is removed"
    result = await restore(jp_fetch, snap["id"])
    assert result["source"] == "store"
    assert await run_in(start_kernel, result["kernel_id"], CHECK) == "True 1000000"
    await manager.lending.settled()
    assert cached_ids(manager) == []
    assert not list(manager.cache_dir.iterdir()), "the download is removed"


async def test_one_cached_snapshot_restored_twice_side_by_side(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any
) -> None:
    manager = manager_of(jp_serverapp)
    kernel = await start_kernel()
    await kernel.run(STATE.format(n=3_000_000))
    snap = (await snapshot(jp_fetch, kernel.id))["result"]
    pages = pages_file(manager.image_cache_dir / snap["id"])
    before = pages.stat()
    started = [
        (await call(jp_fetch, "POST", snap["id"], "restore", body={}))["job"] for _ in range(2)
    ]
    jobs = await asyncio.gather(*(wait_job(jp_fetch, job) for job in started))
    assert [job["status"] for job in jobs] == ["done", "done"], jobs
    assert [job["result"]["source"] for job in jobs] == ["cache", "cache"]
    kernel_ids = {job["result"]["kernel_id"] for job in jobs}
    assert len(kernel_ids) == 2
    assert kernel.id not in kernel_ids
    for kernel_id in kernel_ids:
        assert await run_in(start_kernel, kernel_id, CHECK) == "True 3000000"
        await run_in(start_kernel, kernel_id, "st[:] = 0")  # each its own memory
    after = pages.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_ctime_ns) == (
        before.st_ino,
        before.st_mtime_ns,
        before.st_ctime_ns,
    ), "CRIU never wrote to the cached images"
    assert (await kernel.run(CHECK)).strip() == "True 3000000"


async def test_a_suspended_kernels_snapshot_is_cached_and_restores_after_its_resume(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any
) -> None:
    """The store's copy of a suspend shares its files (hard links) with the wrapper's,
    which the wrapper removes once it resumed: a link count changes each ctime, so the
    entry is hashed again locally, and served from the cache."""
    manager = manager_of(jp_serverapp)
    kernel = await start_kernel()
    await kernel.run(STATE.format(n=1_000_000))
    job = await call(jp_fetch, "POST", "kernels", kernel.id, "suspend")
    suspended = await wait_job(jp_fetch, job["job"])
    assert suspended["status"] == "done", suspended
    snapshot_id = suspended["result"]["id"]
    assert cached_ids(manager) == [snapshot_id]
    resumed = await wait_job(
        jp_fetch, (await call(jp_fetch, "POST", "kernels", kernel.id, "resume"))["job"]
    )
    assert resumed["status"] == "done", resumed
    assert (await kernel.run(CHECK)).strip() == "True 1000000"
    lease = manager.image_cache.lease(snapshot_id)
    assert lease is not None
    fresh = lease.fresh
    lease.release()
    assert not fresh, "the wrapper's links are gone: the stamps changed"
    result = await restore(jp_fetch, snapshot_id)
    assert result["source"] == "cache"
    assert await run_in(start_kernel, result["kernel_id"], CHECK) == "True 1000000"
    lease = manager.image_cache.lease(snapshot_id)
    assert lease is not None
    assert lease.fresh, "stamped anew after the local hash"
    lease.release()


def test_a_file_changed_after_its_check_is_not_admitted(tmp_path: Path) -> None:
    """Stamps are taken before the bytes are checked; a write after that check (same size,
    mtime put back) shows in the ctime, and the directory is not admitted."""
    manifest = Manifest(
        id="f" * 32,
        lineage="l",
        sequence=1,
        created="2026-01-01T00:00:00.000+00:00",
        trigger="manual",
        runtime_dir="/r",
        runtime_dir_key="k",
        stdio_pipe="pipe:[1]",
    )
    staging = tmp_path / ".staging"
    staging.mkdir()
    (staging / "images").mkdir()
    (staging / "images" / "pages-1.img").write_bytes(b"a" * 4096)
    sealed = tmp_path / "sealed"
    seal(staging, manifest, sealed)
    cache = ImageCache(tmp_path / "cache", max_bytes=1 << 30)
    stamps = stamp_tree(sealed)
    pages = sealed / "images" / "pages-1.img"
    assert not stat.S_IMODE(pages.stat().st_mode) & 0o222
    before = pages.stat()
    pages.chmod(0o644)
    pages.write_bytes(b"b" * 4096)
    os.utime(pages, ns=(before.st_atime_ns, before.st_mtime_ns))
    pages.chmod(0o444)
    assert cache.admit(sealed, stamps) is None
    assert sealed.is_dir()
    assert cache.entries() == []
    stamps = stamp_tree(sealed)  # checked again (here: unchanged since), then admitted
    cache.admit(sealed, stamps)
    assert not sealed.exists()
    assert [e.snapshot_id for e in cache.entries()] == [manifest.id]
    assert (cache.root / manifest.id / RECORD_NAME).is_file()
    assert (cache.root / manifest.id / MANIFEST_NAME).is_file()


def test_the_cache_survives_a_restart_and_broken_entries_are_removed(tmp_path: Path) -> None:
    from testkit.processes import ServerProcess

    from .support.servers import follow, ws_execute

    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    config = server_config(tmp_path, image_cache_max_bytes=-1)
    server = ServerProcess(tmp_path / "server", notebooks, config)
    try:
        kernel_id = server.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
        ws_execute(server, kernel_id, STATE.format(n=1_000_000))
        job = server.client.call("POST", "", body={"kernel_id": kernel_id})["job"]
        snap = follow(server, job)["result"]["id"]
    finally:
        assert server.stop() == 0
    cache_dir = tmp_path / "work" / "image-cache"
    assert (cache_dir / snap / RECORD_NAME).is_file()
    # What crashes and damage leave: an admission cut short, an entry without its record,
    # and one that lost an image.
    (cache_dir / f".{'a' * 32}.admitting-0123abcd" / "images").mkdir(parents=True)
    (cache_dir / ("b" * 32) / "images").mkdir(parents=True)
    broken = cache_dir / ("c" * 32)
    shutil.copytree(cache_dir / snap, broken)
    record = (broken / RECORD_NAME).read_text().replace(snap, "c" * 32)
    (broken / RECORD_NAME).write_text(record)
    pages_file(broken).unlink()

    server = ServerProcess(tmp_path / "server2", notebooks, config)
    try:
        assert sorted(p.name for p in cache_dir.iterdir()) == [".lock", snap]
        job = server.client.call("POST", f"{snap}/restore", body={})["job"]
        result = follow(server, job)["result"]
        assert result["source"] == "cache"
        assert ws_execute(server, result["kernel_id"], CHECK).strip() == "True 1000000"
    finally:
        server.stop()
