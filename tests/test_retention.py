"""Retention: which stored snapshots go (the pure planner), and the manager applying it to
a real local store (no kernels: snapshot directories are built as in test_store.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC
from pathlib import Path
from typing import Any

import pytest

from jupyter_ext.core.errors import SnapshotNotFoundError
from jupyter_ext.core.manifest import Manifest
from jupyter_ext.core.policies.retention import Retained, RetentionPolicy, plan_retention
from jupyter_ext.core.store import LocalStore
from jupyter_ext.manager import ManagerSettings, SnapshotManager
from jupyter_ext.settings import SnapshotSettings

from .support.stores import make_snapshot

A, B, C = "a" * 32, "b" * 32, "c" * 32


def snap(
    ident: str,
    sequence: int,
    *,
    lineage: str = A,
    notebook: str | None = "nb.ipynb",
    created: str = "",
) -> Retained:
    return Retained(
        id=ident,
        lineage=lineage,
        sequence=sequence,
        created=created or f"2026-12-01T00:00:{sequence:02d}.000+00:00",
        notebook_path=notebook,
    )


def plan(
    snapshots: list[Retained], newest: Retained, keep_last: int = 0, max_bytes: int = 0
) -> tuple[list[str], list[str]]:
    result = plan_retention(snapshots, newest, RetentionPolicy(keep_last, max_bytes))
    return result.by_count, result.over_budget


# -- the planner ---------------------------------------------------------------------------


def test_nothing_listed_nothing_planned() -> None:
    newest = snap("n", 1)
    assert plan([], newest, keep_last=1, max_bytes=1) == ([], [])


def test_no_policy_deletes_nothing() -> None:
    listed = [snap(f"s{i}", i) for i in range(1, 6)]
    assert plan(listed, listed[-1]) == ([], [])


def test_keep_last_per_notebook_oldest_first() -> None:
    one = [snap(f"one{i}", i, notebook="one.ipynb") for i in range(1, 5)]
    two = [snap(f"two{i}", i, lineage=B, notebook="two.ipynb") for i in range(1, 3)]
    by_count, over_budget = plan(one + two, one[-1], keep_last=2)
    assert by_count == ["one1", "one2"]
    assert over_budget == []  # no byte budget


def test_beyond_keep_last_one_per_hour_for_a_day_then_one_per_day_for_a_week() -> None:
    """restic's --keep-within-hourly 24h --keep-within-daily 7d after the last 2: a
    snapshot every 20 minutes over 10 days."""
    from datetime import datetime, timedelta

    start = datetime(2026, 11, 22, 0, 0, tzinfo=UTC)
    listed = [
        snap(f"s{i}", i + 1, created=(start + timedelta(minutes=20 * i)).isoformat())
        for i in range(10 * 24 * 3)
    ]
    newest = listed[-1]
    policy = RetentionPolicy(keep_last=2, keep_hourly_hours=24, keep_daily_days=7)
    deleted = set(plan_retention(listed, newest, policy).by_count)
    kept = [s for s in listed if s.id not in deleted]
    now = datetime.fromisoformat(newest.created)
    ages = [now - datetime.fromisoformat(s.created) for s in kept]
    # The last two, then the last of each hour of the last 24 hours, then of each day.
    assert [s.id for s in kept[-2:]] == [listed[-2].id, listed[-1].id]
    hourly = [age for age in ages if age <= timedelta(hours=24)]
    daily = [age for age in ages if age > timedelta(hours=24)]
    # 25 hour buckets touch the window (it ends at 23:40, starts at 23:40 the day before),
    # and the last two (23:20, 23:40) share one.
    assert len(hourly) == 25 + 1
    assert len(daily) == 6  # the days before the last 24 hours within the week
    assert max(ages) <= timedelta(days=7)
    # Each kept daily snapshot is its day's last one.
    for s in kept:
        age = now - datetime.fromisoformat(s.created)
        if age > timedelta(hours=24):
            assert datetime.fromisoformat(s.created).strftime("%H:%M") == "23:40"
    # Without the thinning rules only the last two stay.
    assert len(plan_retention(listed, newest, RetentionPolicy(keep_last=2)).by_count) == (
        len(listed) - 2
    )
    # The byte budget still may take the thinned ones (never the newest).
    budget = plan_retention(listed, newest, dataclasses.replace(policy, max_bytes=1))
    assert newest.id not in budget.over_budget
    assert set(budget.over_budget) >= {s.id for s in kept} - {newest.id}


def test_kernels_without_notebook_group_by_lineage() -> None:
    a = [snap(f"a{i}", i, notebook=None) for i in range(1, 4)]
    b = [snap(f"b{i}", i, lineage=B, notebook=None) for i in range(1, 4)]
    by_count, _ = plan(a + b, a[-1], keep_last=1)
    assert by_count == ["a1", "a2", "b1", "b2"]


def test_the_newest_lineage_counts_as_the_most_recent() -> None:
    """A kernel restored from an old snapshot starts a new lineage at sequence 1: its
    snapshots are the notebook's newest, whatever the old lineage's sequence numbers."""
    old = [snap(f"old{i}", i, lineage=B) for i in range(1, 6)]
    new = [snap("new1", 1, lineage=C, created="2026-12-01T00:00:00.000+00:00")]
    by_count, _ = plan(old + new, new[0], keep_last=2)
    assert by_count == ["old1", "old2", "old3", "old4"]


def test_the_snapshot_just_stored_is_never_deleted() -> None:
    """An upload retried after later snapshots were stored: it is not the last of its
    notebook, but retention after it keeps it, and the notebook then keeps one more."""
    listed = [snap(f"s{i}", i) for i in range(1, 4)]
    late = listed[1]
    by_count, over_budget = plan(listed, late, keep_last=1, max_bytes=1)
    assert by_count == ["s1"]
    assert over_budget == []  # s2 just stored, s3 the last of the notebook


def test_the_last_of_every_notebook_survives_any_budget() -> None:
    one = [snap(f"one{i}", i, notebook="one.ipynb") for i in range(1, 3)]
    two = [snap("two1", 1, lineage=B, notebook="two.ipynb")]
    three = [snap("three1", 1, lineage=C, notebook="three.ipynb")]
    _, over_budget = plan(one + two + three, three[0], max_bytes=1)
    assert over_budget == ["one1"]


def test_budget_order_largest_notebook_first_then_lowest_sequence() -> None:
    big = [snap(f"big{i}", i, notebook="big.ipynb") for i in range(1, 5)]
    small = [snap(f"small{i}", i, lineage=B, notebook="small.ipynb") for i in range(1, 3)]
    mid = [snap(f"mid{i}", i + 10, lineage=C, notebook="mid.ipynb") for i in range(1, 4)]
    newest = snap("other", 1, lineage="d" * 32, notebook="other.ipynb")
    _, over_budget = plan(small + mid + big + [newest], newest, max_bytes=10)
    assert over_budget == ["big1", "big2", "big3", "mid1", "mid2", "small1"]


def test_budget_ties_follow_lineage_then_id() -> None:
    """Equal group sizes and sequences: the store's listing order (lineage, sequence, id)
    decides, whatever order the snapshots come in."""
    x = [snap("x2", 1, lineage=B, notebook="x.ipynb"), snap("x9", 2, lineage=B, notebook="x.ipynb")]
    y = [snap("y1", 1, lineage=A, notebook="y.ipynb"), snap("y5", 2, lineage=A, notebook="y.ipynb")]
    newest = snap("z", 1, lineage=C, notebook="z.ipynb")
    listed = [*x, *y, newest]
    expected = ["y1", "x2"]
    for seed in range(6):
        random.Random(seed).shuffle(listed)
        assert plan(listed, newest, max_bytes=1)[1] == expected


def test_sequence_ties_within_a_notebook_go_by_creation_time() -> None:
    """Two kernels of one lineage (restored twice from one snapshot) both at sequence 3."""
    listed = [
        snap("early", 3, created="2026-12-01T00:00:01.000+00:00"),
        snap("late", 3, created="2026-12-01T00:00:09.000+00:00"),
        snap("first", 2),
    ]
    assert plan(listed, listed[1], keep_last=1)[0] == ["first", "early"]


def test_count_deletions_are_not_planned_again_for_the_budget() -> None:
    listed = [snap(f"s{i}", i) for i in range(1, 6)]
    by_count, over_budget = plan(listed, listed[-1], keep_last=3, max_bytes=1)
    assert by_count == ["s1", "s2"]
    assert over_budget == ["s3", "s4"]


def test_retained_reads_a_manifest(tmp_path: Path) -> None:
    manifest = Manifest.read(make_snapshot(tmp_path, b"", lineage=B, sequence=7))
    retained = Retained.of(manifest)
    assert retained == Retained(manifest.id, B, 7, manifest.created, "work/analysis.ipynb")
    assert retained.group == "work/analysis.ipynb"
    without_notebook = Retained.of(dataclasses.replace(manifest, notebook_path=None))
    assert without_notebook.group == f"lineage:{B}"


# -- the manager with a real store ---------------------------------------------------------


Events = list[tuple[str, dict[str, Any]]]


@pytest.fixture
def events() -> Events:
    return []


@pytest.fixture
def manager(tmp_path: Path, events: Events) -> Iterator[SnapshotManager]:
    """A manager without kernels (none are needed to apply retention), on a local store
    that deletes unreferenced packs at once (grace 0)."""
    store = LocalStore(tmp_path / "store", grace_seconds=0)
    yield SnapshotManager(
        kernel_manager=None,
        session_manager=None,
        store=store,
        work_dir=tmp_path / "work",
        emit=lambda name, data: events.append((name, data)),
    )
    store.close()


def test_a_manager_made_apart_has_the_servers_defaults(manager: SnapshotManager) -> None:
    """Every default of the manager's settings is the extension's trait's, read where the
    trait is declared: retention is on for a manager made without the app too."""
    defaults = {name: trait.default() for name, trait in SnapshotSettings.class_traits().items()}
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(ManagerSettings))
    assert manager.settings == ManagerSettings.from_traits(SnapshotSettings())
    assert (manager.keep_last, manager.keep_hourly_hours, manager.keep_daily_days) == (
        defaults["keep_last"],
        defaults["keep_hourly_hours"],
        defaults["keep_daily_days"],
    )
    assert manager.keep_last > 0
    assert manager.settings.lazy_from_store == defaults["lazy_restore_from_store"]
    assert manager.settings.lazy_min_bytes == defaults["lazy_restore_min_bytes"]
    assert manager.settings.image_cache_max_bytes == defaults["image_cache_max_bytes"]


def put_snapshots(manager: SnapshotManager, root: Path, count: int) -> list[Manifest]:
    """``count`` snapshots of one notebook, no pages shared (each frees its own packs)."""
    rng = random.Random(count)
    stored = []
    for sequence in range(1, count + 1):
        directory = make_snapshot(root, rng.randbytes(64 * 4096), lineage=A, sequence=sequence)
        stored.append(manager.store.put(directory).manifest)
    return stored


def test_manager_deletes_along_the_budget_until_the_store_fits(
    manager: SnapshotManager, events: Events, tmp_path: Path
) -> None:
    s1, s2, s3, s4 = put_snapshots(manager, tmp_path / "dirs", 4)
    before = manager.store.stats().stored_bytes
    manager.max_bytes = before - 1  # one deletion is enough
    assert manager.retention.apply(s4) == [s1.id]
    assert manager.store.stats().stored_bytes <= manager.max_bytes
    assert events == [("deleted", {"snapshot_id": s1.id, "reason": "retention"})]

    manager.max_bytes = 1  # cannot be met: everything but the notebook's newest goes
    assert manager.retention.apply(s4) == [s2.id, s3.id]
    assert [s.manifest.id for s in manager.store.snapshots()] == [s4.id]


def test_manager_keep_last_and_budget_together(manager: SnapshotManager, tmp_path: Path) -> None:
    s1, s2, s3, s4 = put_snapshots(manager, tmp_path / "dirs", 4)
    manager.keep_last = 3
    manager.max_bytes = manager.store.stats().stored_bytes  # met once s1 is gone
    assert manager.retention.apply(s4) == [s1.id]
    assert [s.manifest.id for s in manager.store.snapshots()] == [s2.id, s3.id, s4.id]


# -- the module layout ---------------------------------------------------------------------


def test_manifest_and_retention_are_leaves() -> None:
    """The snapshot format and the planner load no GPU, store or host-check code (only the
    owner-only file helpers, themselves a leaf)."""
    code = (
        "import json, sys, jupyter_ext.core.manifest, jupyter_ext.core.policies.retention\n"
        "print(json.dumps([m for m in sys.modules if m.startswith('jupyter_ext')]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    loaded = set(json.loads(out))
    assert loaded == {
        "jupyter_ext",
        "jupyter_ext.core",
        "jupyter_ext.core.errors",
        "jupyter_ext.core.manifest",
        "jupyter_ext.core.private",  # file modes (issue 29): stdlib only, a leaf too
        "jupyter_ext.core.policies",  # the package: a docstring alone
        "jupyter_ext.core.policies.retention",
    }


def test_concurrent_retention_passes_delete_each_snapshot_once(
    manager: SnapshotManager, events: Events, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three jobs finishing at once each apply retention (issue 27 item 6): their passes
    must not delete the same old snapshot twice, and none fails for it. Each pass waits,
    after listing, until the others listed too (or a while): without one pass at a time,
    all three plan the same deletions."""
    stored = put_snapshots(manager, tmp_path / "dirs", 6)
    manager.keep_last = 2
    listed = [0]
    lock = threading.Lock()
    snapshots = manager.store.snapshots

    def listing_together() -> list[Any]:
        found = snapshots()
        with lock:
            listed[0] += 1
        deadline = time.monotonic() + 1.0
        while listed[0] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        return found

    monkeypatch.setattr(manager.store, "snapshots", listing_together)
    with ThreadPoolExecutor(3) as pool:
        passes = [pool.submit(manager.retention.apply, stored[-1]) for _ in range(3)]
        removed = [future.result() for future in passes]  # none raises
    assert sorted(i for ids in removed for i in ids) == sorted(m.id for m in stored[:4])
    assert [s.manifest.id for s in manager.store.snapshots()] == [m.id for m in stored[4:]]
    deleted = [data["snapshot_id"] for name, data in events if name == "deleted"]
    assert sorted(deleted) == sorted(m.id for m in stored[:4])  # each reported once


def test_deleting_what_is_gone_is_not_an_error(manager: SnapshotManager, tmp_path: Path) -> None:
    """Another server's retention may delete a snapshot this one planned to delete."""
    (only,) = put_snapshots(manager, tmp_path / "dirs", 1)
    manager.store.delete(only.id)
    with pytest.raises(SnapshotNotFoundError):
        manager.store.delete(only.id)
    manager.store.delete(only.id, missing_ok=True)


def test_an_upload_does_not_fail_on_retention(
    manager: SnapshotManager, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job never fails after its snapshot is durable: a failed retention pass is logged."""
    rng = random.Random(7)
    directory = make_snapshot(tmp_path / "dirs", rng.randbytes(16 * 4096), lineage=A, sequence=1)
    manifest = Manifest.read(directory)

    def fail(newest: Manifest) -> list[str]:
        raise SnapshotNotFoundError("There is no snapshot x.", hint="")

    monkeypatch.setattr(manager.uploads, "retain", fail)
    described = asyncio.run(manager.uploads.upload(None, manifest, directory))
    assert described is not None
    assert described["status"] == "complete"
    assert [s.manifest.id for s in manager.store.snapshots()] == [manifest.id]
