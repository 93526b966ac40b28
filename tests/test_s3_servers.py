"""The store where several servers write one prefix at once, on two real S3 servers: moto,
which honours ``If-None-Match: *``, and the juicefs gateway (MinIO's code), which ignores
it and overwrites, as many S3-compatible stores do (issue 46). There the store creates
records and the master key under lock objects (core/store/backend/s3.py): two servers
putting the same snapshot, a record written twice, servers creating the key at once,
retention passes and a put at once: nothing another relies on is overwritten, nothing is
lost."""

from __future__ import annotations

import base64
import os
import random
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from jupyter_ext.core.manifest import Manifest
from jupyter_ext.core.store import EnvKeySource, S3Store
from jupyter_ext.core.store.backend import Kind, layout
from testkit.processes import MotoServer

from .support.s3server import JuicefsGateway
from .support.stores import SMALL_CHUNKS, make_snapshot, mutate, random_pages, tree

BUCKET = "shared-prefix"
MakeStore = Callable[..., S3Store]


@pytest.fixture(params=["moto", "juicefs"])
def servers(request: pytest.FixtureRequest) -> Iterator[MakeStore]:
    """Stores on one prefix of one S3 server, as servers of one user on several nodes: each
    call is another server (its own client, index and claims)."""
    s3: MotoServer | JuicefsGateway = request.getfixturevalue(str(request.param))
    bucket, prefix = s3.ensure_bucket(BUCKET), f"users/{uuid.uuid4().hex[:8]}"
    made: list[S3Store] = []

    def make(**kwargs: Any) -> S3Store:
        kwargs.setdefault("chunking", SMALL_CHUNKS)
        store = S3Store(bucket, prefix, endpoint_url=s3.url, region="us-east-1", **kwargs)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def at_once(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run ``calls`` on threads released together; their results in order."""
    start = threading.Barrier(len(calls))

    def run(call: Callable[[], Any]) -> Any:
        start.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


def fetched(store: S3Store, snapshot_id: str, where: Path) -> dict[str, bytes]:
    target = where / uuid.uuid4().hex
    store.fetch(snapshot_id, target)
    try:
        return tree(target)
    finally:
        shutil.rmtree(target)


def test_servers_creating_the_store_key_at_once_make_one(
    servers: MakeStore, tmp_path: Path
) -> None:
    """Four servers of one user, each the first to encrypt the store: one master key is
    made (another written over it would leave the snapshots sealed with it unreadable),
    and every snapshot reads from a fresh server."""
    text = base64.b64encode(os.urandom(32)).decode()
    stores = [servers(keys=EnvKeySource({"JUPYTER_SNAPSHOT_KEY": text})) for _ in range(4)]
    dirs = [make_snapshot(tmp_path, random_pages(random.Random(i), 32)) for i in range(4)]
    stored = at_once([lambda s=s, d=d: s.put(d) for s, d in zip(stores, dirs, strict=True)])

    assert len(stores[0].backend.names(Kind.KEY)) == 1
    fresh = servers(keys=EnvKeySource({"JUPYTER_SNAPSHOT_KEY": text}))
    for directory, snapshot in zip(dirs, stored, strict=True):
        assert fetched(fresh, snapshot.manifest.id, tmp_path) == tree(directory)


def test_two_servers_putting_the_same_snapshot_store_it_once(
    servers: MakeStore, tmp_path: Path
) -> None:
    """Both puts succeed with the same snapshot; one record stays, the one whose packs are
    there; after both servers clean up, it still restores whole and no claim is left."""
    one, other = servers(grace_seconds=0), servers(grace_seconds=0)
    directory = make_snapshot(tmp_path, random_pages(random.Random(5), 96))
    first, second = at_once([lambda: one.put(directory), lambda: other.put(directory)])

    assert first.manifest == second.manifest
    assert one.backend.names(Kind.RECORD) == [first.manifest.id]
    at_once([one.prune, other.prune])
    assert fetched(servers(), first.manifest.id, tmp_path) == tree(directory)
    assert one.backend.names(Kind.PUT) == []


def test_a_record_written_twice_keeps_the_first(servers: MakeStore, tmp_path: Path) -> None:
    store = servers()
    directory = make_snapshot(tmp_path, random_pages(random.Random(6), 32))
    stored = store.put(directory)
    handle = layout.record(stored.manifest.id)
    written = store.backend.load(handle)

    assert store.put(directory) == stored
    assert not store.backend.save_if_absent(handle, b"a second record")
    assert store.backend.load(handle) == written
    assert fetched(servers(), stored.manifest.id, tmp_path) == tree(directory)


def test_retention_passes_and_a_put_at_once_lose_nothing_kept(
    servers: MakeStore, tmp_path: Path
) -> None:
    """Two servers' retention passes delete the same three old snapshots (and sweep, no
    grace period) while a third server puts a new one that shares most chunks with the
    kept ones: the kept and the new snapshots restore whole, the old ones are gone."""
    writer = servers(grace_seconds=0)
    rng = random.Random(7)
    pages = random_pages(rng, 96)
    dirs = []
    for sequence in range(1, 7):
        pages = mutate(pages, rng, inserts=1, changes=4)
        dirs.append(make_snapshot(tmp_path, pages, lineage="a" * 32, sequence=sequence))
    ids = [writer.put(d).manifest.id for d in dirs]
    newest = make_snapshot(tmp_path, mutate(pages, rng, inserts=1, changes=4), sequence=7)
    old = ids[:3]

    def retention(store: S3Store) -> None:
        for snapshot_id in old:
            store.delete(snapshot_id, missing_ok=True)

    passes = [servers(grace_seconds=0), servers(grace_seconds=0)]
    put = servers(grace_seconds=0)
    results = at_once(
        [lambda: retention(passes[0]), lambda: retention(passes[1]), lambda: put.put(newest)]
    )

    new_id = Manifest.read(newest).id
    assert results[2].manifest.id == new_id
    reader = servers()
    assert sorted(s.manifest.id for s in reader.snapshots()) == sorted([*ids[3:], new_id])
    for snapshot_id, directory in [*zip(ids[3:], dirs[3:], strict=True), (new_id, newest)]:
        assert fetched(reader, snapshot_id, tmp_path) == tree(directory)
    assert reader.backend.names(Kind.PUT) == []


@pytest.mark.parametrize(("server", "said"), [("moto", "honours"), ("juicefs", "ignores")])
def test_doctor_says_whether_the_store_s_server_honours_if_none_match(
    server: str, said: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`jupyter snapshot doctor`'s "store server" check of a server's own S3 store (no
    hub): its probe, in a scratch prefix it removes after."""
    from jupyter_ext.core.doctor import check_store_server
    from jupyter_ext.settings import SnapshotSettings

    s3: MotoServer | JuicefsGateway = request.getfixturevalue(server)
    settings = {
        **SnapshotSettings().option_values(),
        "store": "s3",
        "s3_bucket": s3.ensure_bucket("doctor"),
        "s3_endpoint_url": s3.url,
        "owner": "dora",
    }
    check = check_store_server(settings, {})

    assert check.ok, check
    assert f"{said} If-None-Match" in check.detail
    store = S3Store("doctor", "", endpoint_url=s3.url)
    try:
        assert store.client.list_objects_v2(Bucket="doctor").get("Contents", []) == []
    finally:
        store.close()
