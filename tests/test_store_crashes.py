"""A process killed with SIGKILL at any point of a put or a repack leaves every listed
snapshot complete and restorable; ``store check --read-data`` finds no damage and lists
what the kills left, which ``store prune`` removes.

``tests/support/store_worker.py`` stores (and, for repacks, deletes) snapshots in a loop and is
killed after a random delay (``random.Random(FAULT_SEED)``); ``FAULT_ITERATIONS`` makes
the loop longer by hand. Both backends: a local directory and S3 (moto), each unencrypted
and encrypted.
"""

from __future__ import annotations

import base64
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from jupyter_ext.core import manifest as manifest_mod
from jupyter_ext.core.protocol.environment import ENV_KEY
from jupyter_ext.core.store.backend import layout
from jupyter_ext.core.store.sealing import FILE_MAGIC
from testkit.processes import MotoServer

from .support.faults import FAULT_ITERATIONS, FAULT_SEED
from .support.store_worker import PACK_BYTES, open_store

ROOT = Path(__file__).resolve().parent.parent
KILLS = 2 * FAULT_ITERATIONS  # per variant: 16 kills in CI over the 8, more by hand


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "store")
    moto: MotoServer = request.getfixturevalue("moto")
    return f"s3://{moto.url}|{moto.ensure_bucket('crashes')}|{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=["unencrypted", "encrypted"])
def encrypted(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Encrypted: the worker and the checks open the store with a key of the test's."""
    if request.param == "encrypted":
        monkeypatch.setenv(ENV_KEY, base64.b64encode(os.urandom(32)).decode())
    return bool(request.param == "encrypted")


def run_until_killed(mode: str, where: str, seed: int, delay: float, work_dir: Path) -> list[str]:
    """Start the worker (making its snapshots in ``work_dir``), SIGKILL it after ``delay``
    seconds of work; its finished steps."""
    log = work_dir.with_suffix(".log")
    with log.open("w") as out:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.store_worker",
                mode,
                where,
                str(seed),
                str(work_dir),
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        deadline = time.monotonic() + 120
        while "ready" not in log.read_text() and worker.poll() is None:
            assert time.monotonic() < deadline, "the store worker did not start"
            time.sleep(0.05)
        time.sleep(delay)
        worker.send_signal(signal.SIGKILL)
        worker.wait(30)
    return [line for line in log.read_text().splitlines() if line != "ready"]


def check_store(where: str, tmp_path: Path) -> int:
    """Every listed snapshot is complete and restorable; returns how many there are."""
    store = open_store(where, grace_seconds=0, pack_bytes=PACK_BYTES)
    try:
        listed = store.snapshots()
        for snapshot in listed:
            out = store.fetch(snapshot.manifest.id, tmp_path / uuid.uuid4().hex)
            assert manifest_mod.verify(out).id == snapshot.manifest.id
        return len(listed)
    finally:
        store.close()


def check_cleaned_up(where: str, tmp_path: Path) -> None:
    """The store's own check finds no damage after the kills, and lists what they left
    (packs no record names, claims gone stale); its prune removes that: every object in
    the store is then one a snapshot needs, and no claim or marker is left."""
    store = open_store(where, grace_seconds=0, pack_bytes=PACK_BYTES)
    try:
        store.claims.claim_stale_seconds = 0
        found = store.check(read_data=True)
        assert found.ok, found.lines()
        left = {u.name for u in found.unneeded}
        assert all(u.prunable for u in found.unneeded), found.unneeded
        pruned = store.prune()
        assert {name for name, _ in pruned.removed} == left
        assert set(pruned.claims) == set(found.stale_claims)
        after = store.check(read_data=True)
        assert after.ok, after.lines()
        assert (after.unneeded, after.stale_claims, store.claims.listing()) == ([], [], [])
        assert after.chunks == found.chunks
    finally:
        store.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["put", "repack"])
def test_a_killed_store_process_loses_nothing(
    where: str, mode: str, encrypted: bool, tmp_path: Path
) -> None:
    rng = random.Random(f"{FAULT_SEED}-{mode}")
    steps = 0
    for kill in range(KILLS):
        done = run_until_killed(
            mode, where, rng.randrange(1 << 30), rng.uniform(1.0, 3.0), tmp_path / f"worker-{kill}"
        )
        steps += len(done)
        listed = check_store(where, tmp_path)
        assert listed >= 1 or not any(line.startswith("put") for line in done), done
    assert steps >= KILLS  # the kills landed after some work, not only before any
    check_cleaned_up(where, tmp_path)
    if encrypted:  # what the worker stored is sealed
        store = open_store(where)
        try:
            records = [store.backend.load(layout.record(i)) for i in store.index.record_ids()]
            assert records
            assert all(bytes(r).startswith(FILE_MAGIC) for r in records if r is not None)
        finally:
            store.close()
