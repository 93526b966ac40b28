"""Is my store whole? (issue 46 item 2): ``store check [--read-data]`` names every damaged or
missing piece with the snapshots it breaks, and what nothing needs; ``store prune`` removes
that and says what it freed. Real stores: a directory and moto's S3 server, unencrypted
and encrypted; the damage the fault suite and the store's own tests make (flipped bytes,
a pack gone or cut short, a record or trailer damaged, a wrong key, what killed puts
leave: tests/test_store_crashes.py runs the check after its kills)."""

from __future__ import annotations

import base64
import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_ext.core.doctor import check_store
from jupyter_ext.core.store import EnvKeySource, KeySource, LocalStore, S3Store, StoredSnapshot
from jupyter_ext.core.store.backend import layout
from jupyter_ext.core.store.check import CheckReport
from jupyter_ext.core.store.pack import PackBuilder
from testkit.processes import MotoServer

from .support.jupyter_api import Fetch, call, error_of, manager_of, server_config, wait_job
from .support.stores import (
    BUCKET,
    SMALL_CHUNKS,
    Store,
    damage,
    delete_object,
    make_snapshot,
    random_pages,
    read_object,
    refs_of,
    write_object,
)

Open = Callable[..., Store]


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=["plain", "encrypted"])
def keys(request: pytest.FixtureRequest) -> KeySource | None:
    if request.param == "plain":
        return None
    return EnvKeySource({"JUPYTER_SNAPSHOT_KEY": base64.b64encode(os.urandom(32)).decode()})


@pytest.fixture
def open_store(
    request: pytest.FixtureRequest, backend: str, keys: KeySource | None, tmp_path: Path
) -> Iterator[Open]:
    """Open the test's store (the same one each call), with its key unless told another."""
    made: list[Store] = []
    prefix = f"users/{uuid.uuid4().hex[:8]}"

    def make(**kwargs: Any) -> Store:
        kwargs.setdefault("keys", keys)
        kwargs.setdefault("chunking", SMALL_CHUNKS)
        kwargs.setdefault("grace_seconds", 3600)
        store: Store
        if backend == "local":
            store = LocalStore(tmp_path / "store", **kwargs)
        else:
            server: MotoServer = request.getfixturevalue("moto")
            bucket = server.ensure_bucket(BUCKET)
            store = S3Store(bucket, prefix, endpoint_url=server.url, region="us-east-1", **kwargs)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def two_snapshots(store: Store, tmp_path: Path) -> tuple[StoredSnapshot, StoredSnapshot]:
    """Two snapshots of one kernel that share the first half of their memory."""
    pages = random_pages(random.Random(1), 256)
    first = store.put(make_snapshot(tmp_path, pages))
    second = store.put(
        make_snapshot(tmp_path, pages[: len(pages) // 2] + random_pages(random.Random(2), 128))
    )
    return first, second


def ids(*snapshots: StoredSnapshot) -> tuple[str, ...]:
    return tuple(sorted(s.manifest.id for s in snapshots))


def damage_of(found: CheckReport) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(d.kind, d.problem, d.breaks) for d in found.damage]


def test_a_whole_store_checks_out(open_store: Open, tmp_path: Path) -> None:
    store = open_store()
    first, second = two_snapshots(store, tmp_path)
    events: list[dict[str, Any]] = []
    found = store.check(read_data=True, progress=events.append)
    assert found.ok, found.lines()
    assert (found.snapshots, found.unneeded, found.stale_claims) == (2, [], [])
    records = [store.index.load(s.manifest.id) for s in (first, second)]
    assert found.chunks == len({r.hash for rec in records if rec for r in rec.distinct().values()})
    assert found.read_bytes == found.pack_bytes - sum(
        size for size in trailer_sizes(store)
    )  # every needed chunk once: all but the trailers
    phases = [e["phase"] for e in events]
    assert phases[0] == "checking"
    assert "reading-data" in phases
    assert phases[-1] == "done"
    read = [e for e in events if e["phase"] == "reading-data"]
    assert read[-1]["done_bytes"] == read[-1]["total_bytes"] == found.read_bytes
    assert "No damage found." in found.lines()[1]


def trailer_sizes(store: Store) -> Iterator[int]:
    """What of each pack is not a chunk: its trailer and footer."""
    for name, stat in store.index.objects().items():
        entries = store.index.read_trailer(name, stat.size)
        yield stat.size - max(e.where.offset + e.where.length for e in entries)


def test_a_flipped_byte_is_found_by_reading_the_data_with_the_snapshots_it_breaks(
    open_store: Open, tmp_path: Path
) -> None:
    """A chunk the two snapshots share is damaged: the quick check cannot see it (the
    pack's size and trailer are right), --read-data names the chunk, its pack and both
    snapshots; prune then removes nothing (a clean-up by a wrong picture of the store)."""
    store = open_store()
    first, second = two_snapshots(store, tmp_path)
    shared = refs_of(store, first)[1]
    assert shared.hash in {r.hash for r in refs_of(store, second)}
    damage(store, shared.where)

    assert store.check().ok
    found = store.check(read_data=True)
    assert not found.ok
    [(kind, problem, breaks)] = damage_of(found)
    assert kind == "chunk"
    assert ("wrong sha256" in problem) or ("does not authenticate" in problem)
    assert breaks == ids(first, second)
    assert found.broken() == list(ids(first, second))
    assert found.damage[0].name == f"{shared.hash[:12]}… in {shared.where.obj}"
    assert "Prune removes nothing now" in "\n".join(found.lines())


def test_a_missing_pack_breaks_the_snapshots_that_need_it(open_store: Open, tmp_path: Path) -> None:
    store = open_store()
    first, second = two_snapshots(store, tmp_path)
    only_second = next(
        r.where.obj
        for r in refs_of(store, second)
        if r.where.obj not in {f.where.obj for f in refs_of(store, first)}
    )
    delete_object(store, only_second)
    found = store.check()
    [(kind, problem, breaks)] = damage_of(found)
    assert (kind, found.damage[0].name, breaks) == ("pack", only_second, ids(second))
    assert problem.startswith("is missing from the store")
    # doctor says so too (without reading the data), with the snapshot and what to do
    integrity, _ = check_store(open_store)
    assert (integrity.name, integrity.ok) == ("store integrity", False)
    assert only_second in integrity.detail
    assert second.manifest.id in integrity.detail
    assert "store check --read-data" in integrity.fix


def test_a_pack_cut_short_and_a_damaged_trailer_are_found_without_reading_the_data(
    open_store: Open, tmp_path: Path
) -> None:
    store = open_store()
    first, second = two_snapshots(store, tmp_path)
    packs = sorted({r.where.obj for s in (first, second) for r in refs_of(store, s)})
    assert len(packs) == 2
    cut, trailer = packs
    data = read_object(store, cut)
    write_object(store, cut, data[: len(data) // 2])
    data = bytearray(read_object(store, trailer))
    data[-20] ^= 0xFF  # in the trailer, before the footer
    write_object(store, trailer, bytes(data))
    found = store.check()
    problems = {d.name: d.problem for d in found.damage}
    assert problems[cut].startswith("is shorter")
    assert "its records read" in problems[cut]
    assert problems[trailer].startswith("its trailer cannot be read")
    assert found.broken() == list(ids(first, second))


def test_a_damaged_record_is_named(open_store: Open, tmp_path: Path) -> None:
    store = open_store()
    first, _ = two_snapshots(store, tmp_path)
    handle = layout.record(first.manifest.id)
    data = bytearray(store.backend.load(handle) or b"")
    data[len(data) // 2] ^= 0x01
    store.backend.save(handle, bytes(data))
    found = open_store().check()  # a new reader: nothing cached
    [(kind, problem, breaks)] = damage_of(found)
    assert (kind, breaks) == ("record", ids(first))
    assert first.manifest.id in problem or "cannot be opened" in problem


@pytest.mark.parametrize("keys", ["encrypted"], indirect=True)
def test_a_wrong_key_breaks_every_snapshot(open_store: Open, tmp_path: Path) -> None:
    store = open_store()
    first, second = two_snapshots(store, tmp_path)
    other = EnvKeySource({"JUPYTER_SNAPSHOT_KEY": base64.b64encode(os.urandom(32)).decode()})
    found = open_store(keys=other).check(read_data=True)
    [(kind, problem, breaks)] = damage_of(found)
    assert kind == "key"
    assert "encrypted with another key" in problem
    assert breaks == ids(first, second)
    assert found.prune_blocked


def orphan_pack(store: Store) -> str:
    """A pack as a killed put leaves it: written, named by no record."""
    builder = PackBuilder(None if store.keyring is None else store.keyring.sealer())
    builder.add("ab" * 32, 4096, os.urandom(4096), "raw")
    store.backend.save(layout.object_handle(builder.name), b"".join(builder.finish()))
    return builder.name


def test_what_killed_puts_leave_is_listed_then_pruned(open_store: Open, tmp_path: Path) -> None:
    """A killed put leaves a pack no record names and its claim, which goes stale (here at
    once: no grace period). The check lists both; prune removes them and says how much it
    freed; the check is then clean."""
    store = open_store(grace_seconds=0)
    store.claims.claim_stale_seconds = 0
    first, _ = two_snapshots(store, tmp_path)
    orphan = orphan_pack(store)
    store.claims.write("killed", first.manifest.id, {orphan})

    found = store.check()
    assert found.ok
    assert [(u.name, u.prunable) for u in found.unneeded] == [(orphan, True)]
    assert found.stale_claims == ["killed.json"]
    text = "\n".join(found.lines())
    assert "1 pack(s) no snapshot needs: 1" in text
    assert "1 stale claim(s)" in text

    pruned = store.prune()
    assert [name for name, _ in pruned.removed] == [orphan]
    assert pruned.claims == ["killed.json"]
    assert pruned.freed_bytes > 4096
    assert "freed" in pruned.lines()[0]
    after = store.check(read_data=True)
    assert after.ok
    assert (after.unneeded, after.stale_claims) == ([], [])


def test_a_pack_younger_than_the_grace_period_is_kept(tmp_path: Path) -> None:
    """It may be a running put's (its claim lists it only at its next heartbeat)."""
    store = LocalStore(tmp_path / "store", chunking=SMALL_CHUNKS, grace_seconds=3600)
    try:
        two_snapshots(store, tmp_path)
        old, young = orphan_pack(store), orphan_pack(store)
        then = time.time() - 7200
        os.utime(store.root / old, (then, then))
        found = store.check()
        assert sorted((u.name, u.prunable) for u in found.unneeded) == sorted(
            [(old, True), (young, False)]
        )
        assert "1 kept (younger than the grace period" in "\n".join(found.lines())
        assert [name for name, _ in store.prune().removed] == [old]
    finally:
        store.close()


# -- REST and CLI --------------------------------------------------------------------------


@pytest.fixture
def jp_server_config(tmp_path: Path) -> dict[str, Any]:
    return server_config(tmp_path)


async def test_check_and_prune_through_the_rest_api(
    jp_fetch: Fetch, jp_serverapp: Any, tmp_path: Path
) -> None:
    """As the panel or the CLI asks a server: jobs, with progress and the report."""
    store = manager_of(jp_serverapp).store
    assert isinstance(store, LocalStore)
    first, second = two_snapshots(store, tmp_path)
    job = await call(jp_fetch, "POST", "store", "check", body={"read_data": True})
    done = await wait_job(jp_fetch, job["job"])
    assert (done["kind"], done["status"], done["phase"]) == ("check", "done", "done")
    assert done["result"]["ok"]
    assert done["result"]["read_bytes"] == done["done_bytes"] == done["total_bytes"] > 0
    damage(store, refs_of(store, first)[1].where)
    done = await wait_job(
        jp_fetch, (await call(jp_fetch, "POST", "store", "check", body={"read_data": True}))["job"]
    )
    assert not done["result"]["ok"]
    assert done["result"]["broken"] == list(ids(first, second))
    assert any(line.startswith("DAMAGED") for line in CheckReport.from_dict(done["result"]).lines())
    code, error = await error_of(jp_fetch, "POST", "store", "check", body={"read_data": "yes"})
    assert (code, error["code"]) == (400, "bad-request")
    pruned = await wait_job(jp_fetch, (await call(jp_fetch, "POST", "store", "prune"))["job"])
    assert (pruned["kind"], pruned["status"], pruned["result"]["freed_bytes"]) == (
        "prune",
        "done",
        0,
    )
    # A pack gone: prune goes by the records, and removes nothing by a wrong picture.
    delete_object(store, refs_of(store, second)[-1].where.obj)
    pruned = await wait_job(jp_fetch, (await call(jp_fetch, "POST", "store", "prune"))["job"])
    assert pruned["status"] == "failed"
    assert "nothing is removed now" in pruned["error"]["message"]


def test_the_cli_checks_and_prunes_a_store_it_names(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store", chunking=SMALL_CHUNKS, grace_seconds=0)
    try:
        first, second = two_snapshots(store, tmp_path)
        orphan = orphan_pack(store)
        store.claims.write("killed", first.manifest.id, {orphan})
        then = time.time() - 7200  # past the grace period and stale
        for left in (orphan, layout.path(layout.put("killed.json"))):
            os.utime(store.root / left, (then, then))
    finally:
        store.close()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "jupyter_ext.cli",
                "store",
                *args,
                "--store-dir",
                str(tmp_path / "store"),
                "--key-source",
                "none",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )

    checked = cli("check", "--read-data")
    assert checked.returncode == 0, checked.stderr
    assert "No damage found." in checked.stdout
    assert "1 pack(s) no snapshot needs" in checked.stdout
    assert "check: reading-data" in checked.stderr  # progress
    as_json = json.loads(cli("check", "--json").stdout)
    assert as_json["ok"] is True
    assert len(as_json["unneeded"]) == 1
    pruned = cli("prune")
    assert pruned.returncode == 0, pruned.stderr
    assert "Removed 1 pack(s)" in pruned.stdout
    assert "removed 1 claim(s)" in pruned.stdout
    assert "freed" in pruned.stdout
    store = LocalStore(tmp_path / "store", grace_seconds=0)
    try:
        delete_object(store, refs_of(store, second)[-1].where.obj)
    finally:
        store.close()
    broken = cli("check")
    assert broken.returncode == 1
    assert f"breaks 1 snapshot(s): {second.manifest.id}" in broken.stdout
