"""The store's clean-up planner on its own: ``plan_cleanup`` decides from what a clean-up
read (a :class:`Survey`) alone, so each rule is checked without a store (the store's
clean-ups end to end: tests/test_store.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from jupyter_ext.core.store.api import ChunkRef, StoreError
from jupyter_ext.core.store.backend import ObjectStat
from jupyter_ext.core.store.index import Catalog, Trailer
from jupyter_ext.core.store.pack import Location
from jupyter_ext.core.store.prune import PutFile, Survey, plan_cleanup
from jupyter_ext.core.store.record import ChunkTable

OLD, NEW, CUTOFF = 100.0, 300.0, 200.0


def pack_name(letter: str) -> str:
    return f"packs/{letter * 2}/{letter * 64}"


A, B, C, D, E, F = (pack_name(x) for x in "abcdef")


class NoTrailers:
    """An index whose packs list no chunks (no repack moved any)."""

    def trailer(self, name: str, size: int) -> Trailer:
        return Trailer.of(name, [])


def record(snapshot_id: str, *refs: ChunkRef) -> Any:
    return SimpleNamespace(manifest=SimpleNamespace(id=snapshot_id), chunks=ChunkTable(refs))


def survey(puts: list[PutFile], objects: dict[str, ObjectStat], *records: Any) -> Survey:
    catalog = Catalog(NoTrailers(), records, objects)  # type: ignore[arg-type]
    return Survey("m.cleaning", puts, objects, catalog)


def chunk(pack: str, offset: int = 0, length: int = 10) -> ChunkRef:
    return ChunkRef(f"{offset:064x}", length, Location(pack, offset, length, "raw"))


def test_what_goes_what_stays() -> None:
    objects = {
        A: ObjectStat(1000, OLD),  # needed (repack candidate: 10 of 1000 bytes used)
        B: ObjectStat(100, OLD),  # unneeded, past the grace period
        C: ObjectStat(100, NEW),  # unneeded, too fresh
        D: ObjectStat(100, NEW),  # what our failed put wrote
        E: ObjectStat(100, OLD),  # a live claim lists it
        F: ObjectStat(100, NEW),  # a killed put's (stale claim) pack
    }
    puts = [
        PutFile("own.json", stale=False),
        PutFile("live.json", stale=False, objects=frozenset({E})),
        PutFile("dead.json", stale=True, objects=frozenset({F})),
    ]
    plan = plan_cleanup(
        survey(puts, objects, record("s1", chunk(A))),
        {D},
        {"own"},
        sweep=True,
        cutoff=CUTOFF,
        repack_below=0.5,
    )
    assert plan.doomed == sorted({D, F})
    assert plan.delete == sorted({B, D, F})
    assert plan.repack == [A]  # alone: no other clean-up runs
    assert sorted(plan.finished) == ["dead.json", "own.json"]
    assert plan.needed.bytes == {A: 10}


def test_no_repack_while_another_clean_up_runs() -> None:
    objects = {A: ObjectStat(1000, OLD)}
    others = [
        PutFile("x.cleaning", stale=False),
        PutFile("y.cleaning", stale=True),  # old, or its process ended: removed, ignored
    ]
    found = survey(others, objects, record("s1", chunk(A)))
    plan = plan_cleanup(found, set(), set(), sweep=True, cutoff=CUTOFF, repack_below=0.5)
    assert plan.repack == []
    alone = survey(others[1:], objects, record("s1", chunk(A)))
    plan = plan_cleanup(alone, set(), set(), sweep=True, cutoff=CUTOFF, repack_below=0.5)
    assert plan.repack == [A]
    assert plan.finished == ["y.cleaning"]


def test_without_sweep_only_candidates_go() -> None:
    objects = {B: ObjectStat(100, OLD), D: ObjectStat(100, OLD)}
    plan = plan_cleanup(
        survey([], objects), {D}, set(), sweep=False, cutoff=CUTOFF, repack_below=0.5
    )
    assert plan.delete == [D]
    assert plan.repack == []


def test_a_chunk_in_no_pack_stops_everything() -> None:
    """Deleting by a wrong picture of the store could lose more."""
    with pytest.raises(StoreError, match="in no pack"):
        plan_cleanup(
            survey([], {B: ObjectStat(100, OLD)}, record("s1", chunk(A))),
            set(),
            set(),
            sweep=True,
            cutoff=CUTOFF,
            repack_below=0.5,
        )
