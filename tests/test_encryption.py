"""Client-side encryption of the store (issue 33 item 1): whoever reads the store's
directory or the whole bucket without the key reads nothing of a snapshot; a damaged,
forged or swapped object is refused and named; a wrong key says which key and where; a
new key-encryption key rewraps without rewriting packs; an unencrypted store is migrated.
Real stores (a directory, moto's S3 server), real jupyter_server, kernels and CRIU."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import re
import stat
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import zstandard
from traitlets.config import Config

from jupyter_ext import cli, storecli
from jupyter_ext.app import SnapshotExtensionApp
from jupyter_ext.core.errors import SnapshotCorruptError, SnapshotNotFoundError
from jupyter_ext.core.protocol.environment import ENV_KEY, ENV_PREVIOUS_KEYS
from jupyter_ext.core.store import (
    EnvKeySource,
    FileKeySource,
    KeySource,
    LocalStore,
    S3Store,
    StoreError,
    StoreSpec,
)
from jupyter_ext.core.store.backend import Handle, Kind
from jupyter_ext.core.store.hubclient import keys_of
from jupyter_ext.core.store.keys import parse_key
from jupyter_ext.core.store.sealing import NONCE_BYTES, NONCES_AT_ONCE, Sealer
from jupyter_ext.core.store.userkey import derive_user_key
from jupyter_ext.hubservice.app import key_answer, read_secrets
from jupyter_ext.settings import SnapshotSettings
from testkit.processes import MotoServer

from .support.jupyter_api import Fetch, call, manager_of, restore, server_config, snapshot
from .support.stores import (
    BUCKET,
    SMALL_CHUNKS,
    Store,
    damage,
    make_snapshot,
    random_pages,
    read_object,
    refs_of,
    tree,
    write_object,
)

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def env_key() -> tuple[str, EnvKeySource]:
    text = base64.b64encode(os.urandom(32)).decode()
    return text, EnvKeySource({"JUPYTER_SNAPSHOT_KEY": text})


def readable(blob: bytes) -> Iterator[bytes]:
    """What a reader of the bucket gets from an object without a key: its bytes, and every
    zstd frame in it decompressed (packs hold chunks as frames, trailers are frames)."""
    yield blob
    at = blob.find(ZSTD_MAGIC)
    while at >= 0:
        with contextlib.suppress(zstandard.ZstdError):
            yield zstandard.ZstdDecompressor().decompressobj().decompress(blob[at:])
        at = blob.find(ZSTD_MAGIC, at + 1)


def everything_in(where: Path | tuple[MotoServer, str]) -> dict[str, bytes]:
    """Every object: every file under a directory, or every key of a bucket."""
    if isinstance(where, Path):
        return {str(p): p.read_bytes() for p in where.rglob("*") if p.is_file()}
    import boto3

    server, bucket = where
    client = boto3.client("s3", endpoint_url=server.url)
    found = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            found[obj["Key"]] = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
    client.close()
    return found


def holding(objects: dict[str, bytes], needle: bytes) -> list[str]:
    return [name for name, blob in objects.items() if any(needle in b for b in readable(blob))]


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def open_store(request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> Iterator[Any]:
    """Open a store (the same one each call) with the given key source."""
    made: list[Store] = []
    prefix = f"users/{uuid.uuid4().hex[:8]}"

    def make(keys: KeySource | None, **kwargs: Any) -> Store:
        store: Store
        kwargs.setdefault("chunking", SMALL_CHUNKS)
        if backend == "local":
            store = LocalStore(tmp_path / "store", keys=keys, **kwargs)
        else:
            server: MotoServer = request.getfixturevalue("moto")
            bucket = server.ensure_bucket(BUCKET)
            store = S3Store(
                bucket, prefix, endpoint_url=server.url, region="us-east-1", keys=keys, **kwargs
            )
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def stored_objects(store: Store) -> dict[str, bytes]:
    """Every object of the store, by its name in the layout."""
    if isinstance(store, LocalStore):
        return {
            p.relative_to(store.root).as_posix(): p.read_bytes()
            for p in store.root.rglob("*")
            if p.is_file()
        }
    found = {}
    for page in store.client.get_paginator("list_objects_v2").paginate(
        Bucket=BUCKET, Prefix=store.backend.prefix + "/"
    ):
        for obj in page.get("Contents", []):
            name = obj["Key"].removeprefix(store.backend.prefix + "/")
            found[name] = read_object(store, name)
    return found


def pack_tags(store: Store) -> dict[str, str]:
    """Each pack's identity as the store sees it: the ETag on S3, inode and mtime locally."""
    if isinstance(store, S3Store):
        listed = store.client.list_objects_v2(Bucket=BUCKET, Prefix=store.backend.prefix + "/packs")
        return {obj["Key"]: obj["ETag"] for obj in listed.get("Contents", [])}
    return {
        str(p): f"{p.stat().st_ino}:{p.stat().st_mtime_ns}"
        for p in (store.root / "packs").rglob("*")
    }


def secret_snapshot(tmp_path: Path, secret: bytes, sequence: int = 1, seed: int = 1) -> Path:
    pages = random_pages(random.Random(seed), 512)
    marked = pages[:40960] + secret * 64 + pages[40960 + 64 * len(secret) :]
    return make_snapshot(tmp_path, marked, sequence=sequence)


# -- a real kernel through the server ------------------------------------------------------


@pytest.fixture(params=["local", "s3", "local-unencrypted", "s3-unencrypted"])
def variant(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def jp_server_config(
    request: pytest.FixtureRequest, variant: str, tmp_path: Path
) -> dict[str, Any]:
    extra: dict[str, Any] = {"encryption_key_file": str(tmp_path / "keys" / "store.key")}
    if variant.endswith("unencrypted"):
        extra["encryption_key_source"] = "none"
    if variant.endswith("-env"):  # as a spawner sets it, in the server's environment
        extra["encryption_key_source"] = "env"
        monkeypatch: pytest.MonkeyPatch = request.getfixturevalue("monkeypatch")
        monkeypatch.setenv(ENV_KEY, request.getfixturevalue("env_key_text"))
        monkeypatch.setenv(ENV_PREVIOUS_KEYS, base64.b64encode(os.urandom(32)).decode())
    if variant.startswith("s3"):
        server: MotoServer = request.getfixturevalue("moto")
        bucket = f"enc-{uuid.uuid4().hex[:12]}"
        extra.update(store="s3", s3_bucket=server.ensure_bucket(bucket), s3_endpoint_url=server.url)
    return server_config(tmp_path, **extra)


@pytest.mark.usefixtures("criu", "snapshot_kernelspec")
async def test_nothing_of_a_snapshot_is_in_any_stored_object(
    jp_fetch: Fetch,
    start_kernel: Any,
    jp_serverapp: Any,
    variant: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """A secret in a kernel variable and in the cell that made it: in no object of the
    store (every file of the directory, every key of the bucket, zstd frames unpacked),
    nor the key; the snapshot restores. Unencrypted (the control): the secret is found."""
    manager = manager_of(jp_serverapp)
    secret = f"jks-secret-{uuid.uuid4().hex}"
    kernel = await start_kernel()
    await kernel.run(f"hidden = '{secret}'.upper().lower(); keep = [hidden] * 3")
    snap = (await snapshot(jp_fetch, kernel.id))["result"]
    assert snap["status"] == "complete", snap
    store = manager.store
    if isinstance(store, S3Store):
        objects = everything_in((request.getfixturevalue("moto"), store.backend.bucket))
    else:
        objects = everything_in(tmp_path / "store")
    assert objects
    found = holding(objects, secret.encode())
    if variant.endswith("unencrypted"):
        assert found, "the control: unencrypted, the secret is in the store"
        assert (await call(jp_fetch, "GET", "policy"))["encryption"] is False
        return
    assert found == []
    assert (await call(jp_fetch, "GET", "policy"))["encryption"] is True
    key_file = tmp_path / "keys" / "store.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    kek = base64.b64decode(key_file.read_text())
    assert holding(objects, kek) == []
    assert holding(objects, key_file.read_text().strip().encode()) == []
    # It restores, into a new kernel (lazily from the store where the server can).
    job = await restore(jp_fetch, snap["id"])
    assert job["status"] == "done", job
    restored = await start_kernel(job["result"]["kernel_id"])
    assert (await restored.run("print(hidden == keep[2], len(hidden))")).strip() == (
        f"True {len(secret)}"
    )


@pytest.fixture
def env_key_text() -> str:
    return env_key()[0]


@pytest.mark.parametrize("variant", ["local-env"])
@pytest.mark.usefixtures("criu", "snapshot_kernelspec", "jp_serverapp")
async def test_kernels_do_not_inherit_the_env_key(
    jp_fetch: Fetch, start_kernel: Any, env_key_text: str, tmp_path: Path
) -> None:
    """Key source "env": the server reads $JUPYTER_SNAPSHOT_KEY (and the previous keys)
    and takes them out of its environment, so a kernel it starts, whose user code could
    print them, has neither; the store is encrypted with that key all the same."""
    assert ENV_KEY not in os.environ
    assert ENV_PREVIOUS_KEYS not in os.environ
    kernel = await start_kernel()
    code = (
        "import glob, os\n"
        "start = [open(p, 'rb').read() for p in glob.glob('/proc/[0-9]*/environ')]\n"
        "print(sorted(k for k in os.environ if 'SNAPSHOT_KEY' in k), len(start) > 0, "
        f"any({env_key_text.encode()!r} in e or b'SNAPSHOT_KEY' in e for e in start))"
    )  # its environment now, and the ones it and what it sees started with
    assert (await kernel.run(code)).strip() == "[] True False"
    snap = (await snapshot(jp_fetch, kernel.id))["result"]
    assert snap["status"] == "complete", snap
    kek_id = parse_key(env_key_text, "the test")[0]
    assert [p.name for p in (tmp_path / "store").rglob("keys/*")] == [kek_id]


# -- the store's own checks ----------------------------------------------------------------


def test_nothing_of_the_secret_in_any_object_and_restores(open_store: Any, tmp_path: Path) -> None:
    secret = b"jks-store-secret-" + uuid.uuid4().hex.encode()
    _, keys = env_key()
    store = open_store(keys)
    source = secret_snapshot(tmp_path, secret)
    stored = store.put(source)
    objects = stored_objects(store)
    assert {name.split("/")[0] for name in objects} == {"keys", "packs", "snapshots"}
    assert holding(objects, secret) == []
    assert holding(objects, b"work/analysis.ipynb") == []  # the manifest is in the record
    refs = refs_of(store, stored)
    for ref in refs[:: max(1, len(refs) // 16)]:  # no chunk id either (records, trailers)
        assert holding(objects, ref.hash.encode()) == []
    # A claim (a put in progress) names packs: sealed too.
    store.claims.write("c" * 32, stored.manifest.id, {refs[0].where.obj})
    claim = read_object(store, f"puts/{'c' * 32}.json")
    assert claim.startswith(b"JKSSEAL1")
    assert refs[0].where.obj.encode() not in claim
    assert store.claims.claimed_objects(f"{'c' * 32}.json", stale=False) == {refs[0].where.obj}
    assert tree(store.fetch(stored.manifest.id, tmp_path / "out")) == tree(source)
    # Without a key the same bytes would be found (the search sees zstd frames).
    plain = LocalStore(tmp_path / "plain", chunking=SMALL_CHUNKS)
    plain.put(secret_snapshot(tmp_path, secret, seed=1))
    assert holding(everything_in(tmp_path / "plain"), secret)


def test_a_flipped_byte_in_a_chunk_is_refused_naming_it(open_store: Any, tmp_path: Path) -> None:
    store = open_store(env_key()[1])
    stored = store.put(secret_snapshot(tmp_path, b"x" * 64))
    ref = refs_of(store, stored)[3]
    assert ref.where.codec in ("raw+aes", "zstd+aes")
    damage(store, ref.where)
    with pytest.raises(SnapshotCorruptError, match=f"chunk {ref.hash[:12]}… of images/pages-1"):
        store.fetch(stored.manifest.id, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    offset = sum(r.size for r in refs_of(store, stored)[:3])
    with pytest.raises(SnapshotCorruptError, match="does not authenticate"):
        store.open_images(stored.manifest.id).read("images/pages-1.img", offset, 4096)


def test_a_flipped_byte_in_a_record_is_refused_naming_it(open_store: Any, tmp_path: Path) -> None:
    keys = env_key()[1]
    store = open_store(keys)
    stored = store.put(secret_snapshot(tmp_path, b"y" * 64))
    name = f"snapshots/{stored.manifest.id}.json"
    data = bytearray(read_object(store, name))
    data[len(data) // 2] ^= 0x01
    write_object(store, name, bytes(data))
    fresh = open_store(keys)
    with pytest.raises(SnapshotCorruptError, match=rf"{stored.manifest.id}\.json cannot be opened"):
        fresh.get(stored.manifest.id)
    assert fresh.snapshots() == []  # a listing skips it (and logs why)


def test_swapped_records_and_packs_are_refused(open_store: Any, tmp_path: Path) -> None:
    """Two valid objects exchanged: each is bound to its name, so neither opens."""
    keys = env_key()[1]
    store = open_store(keys, pack_bytes=64 << 10)
    first = store.put(secret_snapshot(tmp_path, b"a" * 64, seed=1))
    second = store.put(secret_snapshot(tmp_path, b"b" * 64, sequence=2, seed=2))
    names = [f"snapshots/{s.manifest.id}.json" for s in (first, second)]
    records = [read_object(store, n) for n in names]
    write_object(store, names[0], records[1])
    write_object(store, names[1], records[0])
    fresh = open_store(keys)
    for stored in (first, second):
        with pytest.raises(SnapshotCorruptError, match=rf"{stored.manifest.id}\.json cannot be"):
            fresh.get(stored.manifest.id)
    write_object(store, names[0], records[0])
    write_object(store, names[1], records[1])
    # Two chunks of one size exchanged in their pack: each is bound to its own id.
    by_length: dict[tuple[str, int], Any] = {}
    pair = None
    for ref in refs_of(store, first):
        other = by_length.setdefault((ref.where.obj, ref.where.length), ref)
        if other.hash != ref.hash:
            pair = (other, ref)
            break
    assert pair is not None
    blobs = [
        read_object(store, pair[0].where.obj)[r.where.offset :][: r.where.length] for r in pair
    ]
    damage(store, pair[0].where, blobs[1])
    damage(store, pair[1].where, blobs[0])
    with pytest.raises(SnapshotCorruptError, match="does not authenticate"):
        open_store(keys).fetch(first.manifest.id, tmp_path / "chunks-swapped")
    damage(store, pair[0].where, blobs[0])
    damage(store, pair[1].where, blobs[1])
    # Two packs exchanged: the chunks a record locates in one are the other's.
    packs = sorted({r.where.obj for r in refs_of(store, first)})
    assert len(packs) >= 2
    blobs = [read_object(store, p) for p in packs[:2]]
    write_object(store, packs[0], blobs[1])
    write_object(store, packs[1], blobs[0])
    with pytest.raises(SnapshotCorruptError, match="is damaged: chunk"):
        open_store(keys).fetch(first.manifest.id, tmp_path / "swapped")


def test_a_planted_unencrypted_record_is_refused(open_store: Any, tmp_path: Path) -> None:
    """Records and packs written in the clear into a prefix before its first key object
    (by the bucket's admin after deleting the user's objects, keys/ too; by another user
    while the bucket's credentials were shared): the first open with a key refuses each,
    naming it and the migration, as it does after encryption began; it can be deleted."""
    plain = open_store(None)
    planted = [plain.put(secret_snapshot(tmp_path, b"f" * 64, n, seed=n)) for n in (1, 2)]
    first, second = (s.manifest.id for s in planted)
    keys = env_key()[1]
    store = open_store(keys)
    for refused in (
        lambda: store.get(first),
        lambda: store.fetch(first, tmp_path / "out"),
        lambda: store.open_images(first),
    ):
        with pytest.raises(SnapshotCorruptError, match=rf"{first}\.json is not encrypted") as info:
            refused()
        assert "jupyter snapshot store encrypt" in info.value.hint
        assert f"jupyter snapshot rm {first}" in info.value.hint
    assert not (tmp_path / "out").exists()
    assert store.snapshots() == []
    new = store.put(secret_snapshot(tmp_path, b"g" * 64, 3, seed=4))  # the key object now
    assert [s.manifest.id for s in open_store(keys).snapshots()] == [new.manifest.id]
    with pytest.raises(SnapshotCorruptError, match="is not encrypted"):
        store.get(second)
    store.delete(second)  # what the hint says, for one that is not the user's
    with pytest.raises(SnapshotNotFoundError):
        store.get(second)


def test_a_wrong_or_lost_key_says_which_key_and_where(open_store: Any, tmp_path: Path) -> None:
    key_file = tmp_path / "home" / "store.key"
    store = open_store(FileKeySource(key_file))
    stored = store.put(secret_snapshot(tmp_path, b"k" * 64))
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    with pytest.raises(StoreError, match=r"encrypted with another key than the one in \$JUPYTER"):
        open_store(env_key()[1]).get(stored.manifest.id)
    key_file.unlink()  # lost: a new key file is made, which opens nothing
    with pytest.raises(StoreError, match=f"the key file {key_file}"):
        open_store(FileKeySource(key_file)).snapshots()
    with pytest.raises(StoreError, match=r"\$JUPYTER_SNAPSHOT_KEY is not set"):
        open_store(EnvKeySource({})).snapshots()
    with pytest.raises(StoreError, match="is encrypted, and encryption is off"):
        open_store(None).get(stored.manifest.id)


def test_a_new_key_encryption_key_rewraps_without_rewriting_packs(
    open_store: Any, tmp_path: Path
) -> None:
    old_text, old = env_key()
    store = open_store(old)
    source = secret_snapshot(tmp_path, b"r" * 64)
    stored = store.put(source)
    packs_before = pack_tags(store)
    keys_before = {n for n in stored_objects(store) if n.startswith("keys/")}
    new_text = base64.b64encode(os.urandom(32)).decode()
    rotated = EnvKeySource(
        {"JUPYTER_SNAPSHOT_KEY": new_text, "JUPYTER_SNAPSHOT_KEY_PREVIOUS": old_text}
    )
    fresh = open_store(rotated)
    assert tree(fresh.fetch(stored.manifest.id, tmp_path / "out")) == tree(source)
    assert pack_tags(fresh) == packs_before, "no pack was rewritten"
    keys_after = {n for n in stored_objects(fresh) if n.startswith("keys/")}
    assert len(keys_after) == 1
    assert keys_after != keys_before
    with pytest.raises(StoreError, match="another key"):  # the old key opens nothing now
        open_store(old).get(stored.manifest.id)
    only_new = EnvKeySource({"JUPYTER_SNAPSHOT_KEY": new_text})
    second = open_store(only_new).put(secret_snapshot(tmp_path, b"s" * 64, sequence=2, seed=9))
    assert open_store(only_new).get(second.manifest.id).manifest.id == second.manifest.id


def test_a_changed_key_object_is_refused_naming_it(open_store: Any, tmp_path: Path) -> None:
    """The wrapped master key (``keys/<id>``) changed, replaced or swapped for another
    store's wrapped by the same key: refused, the key object named (or, for the swap,
    every record it would open)."""
    keys = env_key()[1]
    store = open_store(keys)
    stored = store.put(secret_snapshot(tmp_path, b"t" * 64))
    name = next(n for n in stored_objects(store) if n.startswith("keys/"))
    original = read_object(store, name)
    doc = json.loads(original)
    sealed = bytearray(base64.b64decode(doc["sealed"]))
    sealed[len(sealed) // 2] ^= 0x01
    changed = {
        "a flipped byte": {**doc, "sealed": base64.b64encode(bytes(sealed)).decode()},
        "another key's name": {**doc, "kek": "0" * 16},
        "another format": {**doc, "format": 99},
    }
    for why, replacement in changed.items():
        write_object(store, name, json.dumps(replacement).encode())
        with pytest.raises(StoreError, match=rf"{re.escape(name)} cannot be unwrapped") as info:
            open_store(keys).get(stored.manifest.id)
        assert "does not authenticate" in str(info.value) or why != "a flipped byte"
    write_object(store, name, b"{not json")
    with pytest.raises(StoreError, match=rf"{re.escape(name)} cannot be unwrapped"):
        open_store(keys).snapshots()
    other = LocalStore(tmp_path / "other", keys=keys, chunking=SMALL_CHUNKS)
    other.put(secret_snapshot(tmp_path, b"u" * 64, seed=7))
    write_object(store, name, (other.root / name).read_bytes())
    with pytest.raises(SnapshotCorruptError, match=rf"{stored.manifest.id}\.json cannot be opened"):
        open_store(keys).get(stored.manifest.id)
    write_object(store, name, original)
    assert open_store(keys).get(stored.manifest.id).manifest.id == stored.manifest.id


class ServiceKeys:
    """A user's keys as the hub service hands them out (its key secrets file read as it
    reads it at start, its ``GET key`` answer as JSON) and as a server takes them from that
    answer (``hubclient.keys_of``): all but the HTTP between the two, which
    tests/test_jupyterhub.py runs."""

    def __init__(self, secrets_file: Path, user: str) -> None:
        answer = json.loads(json.dumps(key_answer(read_secrets(secrets_file), user)))
        self._current, self._previous = keys_of(answer)

    def __str__(self) -> str:
        return "the hub service"

    def current(self) -> tuple[str, bytes]:
        return self._current

    def previous(self) -> list[tuple[str, bytes]]:
        return self._previous


def test_a_rotation_of_the_hub_secret_rewraps_without_rewriting_anything(
    open_store: Any, tmp_path: Path
) -> None:
    """The hub's admin rotates the key secret as docs/jupyterhub.md says: the new secret
    on the first line, the old one below it, the service restarted. The next open
    restores, and rewraps the master key to the new secret's key: one key object
    replaced, no pack or record rewritten; with the old line dropped the store opens."""
    secrets_file = tmp_path / "key-secrets"
    old, new = os.urandom(32).hex(), os.urandom(32).hex()

    def service(*secrets: str) -> ServiceKeys:
        secrets_file.write_text("\n".join(secrets) + "\n")
        return ServiceKeys(secrets_file, "alice")

    def kept(store: Store) -> dict[str, bytes]:
        return {n: b for n, b in stored_objects(store).items() if not n.startswith("keys/")}

    old_id, new_id = (derive_user_key(bytes.fromhex(s), "alice")[0] for s in (old, new))
    store = open_store(service(old))
    source = secret_snapshot(tmp_path, b"h" * 64)
    stored = store.put(source)
    assert [n for n in stored_objects(store) if n.startswith("keys/")] == [f"keys/{old_id}"]
    packs, objects = pack_tags(store), kept(store)

    rotated = open_store(service(new, old))
    assert tree(rotated.fetch(stored.manifest.id, tmp_path / "rotated")) == tree(source)
    assert [n for n in stored_objects(rotated) if n.startswith("keys/")] == [f"keys/{new_id}"]
    assert pack_tags(rotated) == packs, "no pack was rewritten"
    assert kept(rotated) == objects

    only_new = open_store(service(new))
    assert tree(only_new.fetch(stored.manifest.id, tmp_path / "only-new")) == tree(source)
    later = only_new.put(secret_snapshot(tmp_path, b"i" * 64, sequence=2, seed=8))
    assert open_store(service(new)).get(later.manifest.id).manifest.id == later.manifest.id
    with pytest.raises(StoreError, match="another key"):
        open_store(service(old)).get(stored.manifest.id)


def test_dedup_and_repack_work_encrypted(open_store: Any, tmp_path: Path) -> None:
    keys = env_key()[1]
    store = open_store(keys, grace_seconds=0, pack_bytes=256 << 10)
    pages = random_pages(random.Random(5), 1024)
    first = store.put(make_snapshot(tmp_path, pages, sequence=1))
    changed = pages[: 200 << 12] + random.Random(6).randbytes(8 << 12) + pages[208 << 12 :]
    second_source = make_snapshot(tmp_path, changed, sequence=2)
    second = store.put(second_source)
    assert 0 < second.new_bytes < first.new_bytes / 4, "the shared chunks are not stored again"
    before = set(pack_tags(store))
    store.delete(first.manifest.id)  # most of the first's packs are still needed: repacked
    assert set(pack_tags(store)) != before
    assert tree(open_store(keys).fetch(second.manifest.id, tmp_path / "out")) == tree(second_source)


def test_an_unencrypted_store_is_read_only_after_the_user_migrates_it(
    open_store: Any, tmp_path: Path
) -> None:
    """A store from before encryption (or records planted in the clear in a fresh
    prefix): an encrypted store reads none of its snapshots, and writes new ones
    encrypted; `jupyter snapshot store encrypt`, run by the user, stores them again
    encrypted and removes every unencrypted pack; an old record put back is refused."""
    secret = b"jks-old-secret-" + uuid.uuid4().hex.encode()
    plain = open_store(None)
    sources = [secret_snapshot(tmp_path, secret, sequence=n, seed=n) for n in (1, 2)]
    old = [plain.put(s) for s in sources]
    old_record = read_object(plain, f"snapshots/{old[0].manifest.id}.json")
    assert holding(stored_objects(plain), secret)
    key_file = tmp_path / "keys" / "store.key"
    store = open_store(FileKeySource(key_file))
    assert store.snapshots() == []
    with pytest.raises(SnapshotCorruptError, match="is not encrypted"):
        store.get(old[0].manifest.id)
    new = store.put(secret_snapshot(tmp_path, secret, sequence=3, seed=3))
    assert holding({"new": read_object(store, f"snapshots/{new.manifest.id}.json")}, secret) == []

    if isinstance(store, LocalStore):
        where = ["--store-dir", str(store.root)]
    else:
        where = [
            "--s3-bucket", BUCKET, "--s3-prefix", store.backend.prefix,
            "--s3-endpoint-url", store.client.meta.endpoint_url,
        ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "jupyter_ext.cli", "store", "encrypt", *where,
         "--key-file", str(key_file), "--work-dir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "2 snapshot(s) encrypted" in done.stdout
    assert "no snapshot in the store can be read" in done.stdout  # the lost-key warning
    objects = stored_objects(store)
    assert holding(objects, secret) == []
    fresh = open_store(FileKeySource(key_file))
    ids = sorted(s.manifest.id for s in fresh.snapshots())
    assert ids == sorted([*(s.manifest.id for s in old), new.manifest.id])
    for stored, source in zip(old, sources, strict=True):
        out = tmp_path / f"out-{stored.manifest.id}"
        assert tree(fresh.fetch(stored.manifest.id, out)) == tree(source)
    # The old record, put back by someone who kept it, is not accepted any more.
    fresh.backend.remove(Handle(Kind.RECORD, old[0].manifest.id))
    write_object(fresh, f"snapshots/{old[0].manifest.id}.json", old_record)
    with pytest.raises(SnapshotCorruptError, match="is not encrypted"):
        open_store(FileKeySource(key_file)).get(old[0].manifest.id)


def test_rotate_key_and_doctor_from_the_command_line(tmp_path: Path) -> None:
    key_file = tmp_path / "keys" / "store.key"
    store_dir = tmp_path / "store"
    store = LocalStore(store_dir, keys=FileKeySource(key_file), chunking=SMALL_CHUNKS)
    source = secret_snapshot(tmp_path, b"d" * 64)
    stored = store.put(source)
    old_key = key_file.read_text()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "jupyter_ext.cli", *args, "--key-file", str(key_file)],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip

    packs = pack_tags(store)
    rotated = cli("store", "rotate-key", "--store-dir", str(store_dir))
    assert rotated.returncode == 0, rotated.stderr
    assert key_file.read_text() != old_key
    assert (key_file.parent / "store.key.previous").read_text().split() == [old_key.strip()]
    assert pack_tags(store) == packs
    with pytest.raises(StoreError, match="another key"):
        LocalStore(store_dir, keys=EnvKeySource({"JUPYTER_SNAPSHOT_KEY": old_key})).snapshots()
    fresh = LocalStore(store_dir, keys=FileKeySource(key_file))
    assert tree(fresh.fetch(stored.manifest.id, tmp_path / "out")) == tree(source)

    doctor = cli("doctor")
    line = next(x for x in doctor.stdout.splitlines() if "store encryption" in x)
    assert f"key file {key_file} (0600)" in line
    assert "Without this key no snapshot in the store can be read" in line
    key_file.chmod(0o644)
    line = next(x for x in cli("doctor").stdout.splitlines() if "store encryption" in x)
    assert "readable by others" in line
    # The server's own option, from its config files, is what doctor reports.
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    (config_dir / "jupyter_server_config.json").write_text(
        '{"SnapshotExtensionApp": {"encryption_key_source": "none"}}'
    )
    off = subprocess.run(
        [sys.executable, "-m", "jupyter_ext.cli", "doctor"],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "JUPYTER_CONFIG_DIR": str(config_dir)},
    )  # fmt: skip
    line = next(x for x in off.stdout.splitlines() if "store encryption" in x)
    assert line.startswith("[warn]")
    assert "reads every snapshot" in line


def test_the_key_file_is_never_inside_the_local_store(tmp_path: Path) -> None:
    settings = SnapshotSettings(
        owner="alice",
        local_store_dir=str(tmp_path / "store"),
        encryption_key_file=str(tmp_path / "store" / "users" / "alice" / "key"),
    )
    with pytest.raises(StoreError, match="is inside the store"):
        settings.store_spec()
    settings.encryption_key_file = str(tmp_path / "store.key")
    assert settings.store_spec().location() == str(tmp_path / "store" / "users" / "alice")


def test_the_cli_makes_the_store_the_server_makes_from_its_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``jupyter snapshot store encrypt --s3-bucket B`` stores again with the server's
    chunk and pack sizes, key and bucket settings: one spec from one config."""
    options: dict[str, Any] = {
        "owner": "alice",
        "store": "s3",
        "s3_bucket": "team",
        "s3_prefix": "/snaps/",
        "s3_endpoint_url": "http://127.0.0.1:9",
        "s3_region": "eu-west-1",
        "s3_server_side_encryption": "aws:kms",
        "s3_sse_kms_key_id": "alias/snaps",
        "hub_service_url": "http://127.0.0.1:8/services/snapshots/",
        "encryption_key_source": "env",
        "chunk_kib": 64,
        "pack_mib": 8,
        "local_store_dir": str(tmp_path / "store"),
        "local_store_group_access": True,
    }
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    (config_dir / "jupyter_server_config.json").write_text(
        json.dumps({"SnapshotExtensionApp": options})
    )
    monkeypatch.setenv("JUPYTER_CONFIG_DIR", str(config_dir))
    server = SnapshotExtensionApp(config=Config({"SnapshotExtensionApp": options}))

    def from_cli(*argv: str) -> StoreSpec | None:
        app = storecli.EncryptStoreApp()
        app.initialize(list(argv))
        return app.store_spec()

    cli.server_settings.cache_clear()
    try:
        assert from_cli("--s3-bucket", "team") == server.store_spec()
        assert server.store_spec().location() == "s3://team/snaps/users/alice"
        named = from_cli("--s3-bucket", "other", "--s3-prefix", "p/q", "--key-source", "none")
        assert named == replace(
            server.store_spec(),
            options=replace(server.store_spec().options, bucket="other", prefix="p/q"),
            key_source="none",
        )
        server.store = "local"
        own = tmp_path / "store" / "users" / "alice"
        assert from_cli("--store-dir", str(own)) == server.store_spec()
        assert from_cli() is None  # through the running server
    finally:
        cli.server_settings.cache_clear()


def test_every_sealed_piece_has_a_nonce_of_its_own() -> None:
    """Nonces are drawn in bulk (sealing._Nonces): never one twice, across threads and
    batches, nor in a forked child, which inherits the parent's unused ones (a nonce used
    twice with one key breaks AES-GCM)."""
    sealer = Sealer(os.urandom(32))
    nonces: list[bytes] = []
    lock = threading.Lock()

    def seal_many() -> None:
        mine = [sealer.seal(b"x", b"ctx")[:NONCE_BYTES] for _ in range(2 * NONCES_AT_ONCE)]
        with lock:
            nonces.extend(mine)

    threads = [threading.Thread(target=seal_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(nonces)) == len(nonces) == 8 * NONCES_AT_ONCE
    sealer.seal(b"x", b"ctx")  # this thread's batch now has unused nonces
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child)
        os.write(write, sealer.seal(b"x", b"ctx")[:NONCE_BYTES])
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    childs = os.read(read, NONCE_BYTES)
    os.close(read)
    assert childs != sealer.seal(b"x", b"ctx")[:NONCE_BYTES]
