"""Clean-up (restic's prune, with claims for its locks): :func:`survey` reads the store in
the order that keeps puts safe (marker first, then claims, then objects and records),
:func:`plan_cleanup` decides from that alone (pure, as retention's planner is), and
:func:`collect` runs both and executes the plan: deletions, then a repack of packs that
are mostly garbage."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..humanize import human_bytes
from . import pack
from .backend import ObjectStat
from .claims import Claims, CleanupLease
from .index import Catalog, Index, Needs
from .repack import Repack

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PutFile:
    """A claim or marker under ``puts/`` as the clean-up found it."""

    name: str
    stale: bool
    objects: frozenset[str] = frozenset()
    """What a claim lists (read for claims of others only)."""


@dataclass(frozen=True)
class Survey:
    """What a clean-up read, in the order it read it."""

    marker: str
    puts: list[PutFile]
    objects: dict[str, ObjectStat]
    catalog: Catalog
    """Of every record."""


@dataclass
class CleanupPlan:
    delete: list[str]
    """Objects to delete now: ``doomed`` and unneeded ones past the grace period."""
    doomed: list[str]
    """The candidates (of failed or killed puts) among them."""
    repack: list[str]
    """Old packs mostly unneeded, to rewrite (only when no other clean-up runs)."""
    needed: Needs
    finished: list[str] = field(default_factory=list)
    """Claims and markers to remove at the end (failed puts', killed ones')."""


def survey(claims: Claims, index: Index, marker: str, own: set[str]) -> Survey:
    """Read the claims (their objects, unless ``own``: those of failed puts here), then
    the objects and records: a put that publishes its claim after this sees the marker
    (or this clean-up done) before it checks its packs."""
    puts = []
    now = time.time()
    for name, mtime in claims.listing():
        token, _, kind = name.partition(".")
        if name == marker or kind not in ("json", "cleaning"):
            continue
        stale = claims.is_stale(name, mtime, now)
        if kind == "cleaning" or token in own:
            puts.append(PutFile(name, stale))
        else:
            puts.append(PutFile(name, stale, frozenset(claims.claimed_objects(name, stale))))
    objects = index.objects()
    records = index.records(strict=True)
    return Survey(marker, puts, objects, index.catalog(records.values(), objects))


def plan_cleanup(
    found: Survey,
    candidates: set[str],
    own: set[str],
    *,
    sweep: bool,
    cutoff: float,
    repack_below: float,
) -> CleanupPlan:
    """Delete the ``candidates`` (and the objects of stale claims) that no record needs
    and no live claim lists; with ``sweep``, also unneeded objects last changed before
    ``cutoff``, and repack old packs that are mostly unneeded if no other clean-up runs.
    The claims ``own`` (of failed puts) are finished."""
    candidates = set(candidates)
    live: set[str] = set()
    finished: list[str] = []
    alone = True
    for put in found.puts:
        token, _, kind = put.name.partition(".")
        if kind == "cleaning" or token in own:
            if kind == "cleaning" and not put.stale:
                alone = False
            if kind == "json" or put.stale:
                finished.append(put.name)
        elif put.stale:
            candidates |= put.objects
            finished.append(put.name)
        else:
            live |= put.objects
    needed = found.catalog.needs()
    objects = found.objects
    doomed = sorted((candidates & objects.keys()) - needed.bytes.keys() - live)
    old = {
        name
        for name, stat in objects.items()
        if sweep and name not in needed.bytes and name not in live and stat.mtime <= cutoff
    }
    worn = []
    if sweep and alone:
        worn = [
            name
            for name, stat in sorted(objects.items())
            if name in needed.bytes
            and name not in live
            and pack.is_pack_name(name)
            and stat.mtime <= cutoff
            and needed.bytes[name] < repack_below * stat.size
        ]
    return CleanupPlan(sorted(set(doomed) | old), doomed, worn, needed, finished)


@dataclass
class PruneReport:
    """What a clean-up removed and rewrote (``store prune`` says it)."""

    removed: list[tuple[str, int]] = field(default_factory=list)
    """Objects deleted, with their sizes."""
    repacked: list[tuple[str, int]] = field(default_factory=list)
    """Packs rewritten, with their sizes."""
    kept_bytes: int = 0
    """What of them was still needed, copied into new packs."""
    claims: list[str] = field(default_factory=list)
    """Claims and markers removed (of killed puts and clean-ups, of failed puts here)."""

    @property
    def freed_bytes(self) -> int:
        removed = sum(size for _, size in [*self.removed, *self.repacked])
        return max(0, removed - self.kept_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "freed_bytes": self.freed_bytes}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PruneReport:
        """A report as :meth:`to_dict` gave it (a prune job's result)."""
        return cls(
            [(str(n), int(s)) for n, s in data["removed"]],
            [(str(n), int(s)) for n, s in data["repacked"]],
            int(data["kept_bytes"]),
            list(data["claims"]),
        )

    def lines(self) -> list[str]:
        return [
            f"Removed {len(self.removed)} pack(s) no snapshot needed "
            f"({human_bytes(sum(size for _, size in self.removed))}), rewrote "
            f"{len(self.repacked)} mostly unneeded pack(s) ({human_bytes(self.kept_bytes)} "
            f"kept), removed {len(self.claims)} claim(s) of ended puts: "
            f"{human_bytes(self.freed_bytes)} freed."
        ]


@dataclass(frozen=True)
class Cleaner:
    """Runs clean-ups of one store (its settings as the repository has them now)."""

    claims: Claims
    index: Index
    grace_seconds: float
    repack_below: float
    pack_bytes: int

    def collect(self, candidates: set[str], *, own: set[str], sweep: bool = False) -> PruneReport:
        """Survey, plan and execute one clean-up under a fresh marker; what it did."""
        with self.claims.cleaning() as lease:
            found = survey(self.claims, self.index, lease.marker, own)
            plan = plan_cleanup(
                found,
                candidates,
                own,
                sweep=sweep,
                cutoff=time.time() - self.grace_seconds,
                repack_below=self.repack_below,
            )
            return self._execute(plan, found.objects, lease)

    def _execute(
        self, plan: CleanupPlan, objects: dict[str, ObjectStat], lease: CleanupLease
    ) -> PruneReport:
        lease.check()
        self.index.backend.remove_all(plan.delete)
        done = PruneReport(removed=[(name, objects[name].size) for name in plan.delete])
        if plan.repack:
            repack = Repack(self.claims, self.index, self.pack_bytes, lease)
            rewritten, done.kept_bytes = repack.run(plan.repack, plan.needed)
            done.repacked = [(name, objects[name].size) for name in rewritten]
        for name in plan.finished:
            self.claims.remove(name)
        done.claims = list(plan.finished)
        if plan.doomed:
            logger.info("Removed %d packs that failed puts left", len(plan.doomed))
        return done
