"""Which stored snapshots retention deletes: a pure planner, no store or server.

The policy (``keep_last`` per notebook, thinned beyond it, ``max_bytes`` for the whole store)
runs after each upload. Beyond the last ``keep_last`` of a notebook, snapshots are thinned as
restic's ``forget --keep-within-hourly/--keep-within-daily`` do: of the last
``keep_hourly_hours`` hours, the newest of each hour stays; of the last ``keep_daily_days``
days, the newest of each day; the rest go. Time is the snapshots' creation time (UTC),
measured back from the newest snapshot's. Snapshots group by notebook path, or by lineage
for kernels without a notebook. The newest of every group and the snapshot just stored are
never deleted, so each notebook keeps something to restore whatever the budget says.

What a deletion frees cannot be computed from the snapshots: chunks and packs are shared,
and the store counts whole packs. So the plan gives the count deletions outright, and for
the byte budget an order: the caller deletes along it while the store still holds more
than ``max_bytes`` (see :meth:`RetentionPlan.over_budget`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from ..manifest import Manifest


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int = 0
    """Snapshots kept per notebook (0: no limit)."""
    max_bytes: int = 0
    """Bytes the store may hold (0: no limit)."""
    keep_hourly_hours: int = 0
    """Beyond ``keep_last``: the newest of each hour of the last this many hours."""
    keep_daily_days: int = 0
    """Beyond those: the newest of each day of the last this many days."""


def _created(s: Retained) -> datetime | None:
    try:
        return datetime.fromisoformat(s.created.replace("Z", "+00:00"))
    except ValueError:
        return None


def thinned_keep(items: list[Retained], now: datetime, policy: RetentionPolicy) -> set[str]:
    """Ids of ``items`` (one group) kept by the hourly and daily rules: the newest of each
    hour (day) bucket within ``keep_hourly_hours`` (``keep_daily_days``) before ``now``."""
    kept: set[str] = set()
    rules = (
        (policy.keep_hourly_hours, timedelta(hours=policy.keep_hourly_hours), "%Y-%m-%dT%H"),
        (policy.keep_daily_days, timedelta(days=policy.keep_daily_days), "%Y-%m-%d"),
    )
    dated = [(when, s) for s in items if (when := _created(s)) is not None]
    for count, window, bucket_format in rules:
        if count <= 0:
            continue
        newest: dict[str, tuple[datetime, Retained]] = {}
        for when, s in dated:
            if now - when > window:
                continue
            bucket = when.strftime(bucket_format)
            if bucket not in newest or when >= newest[bucket][0]:
                newest[bucket] = (when, s)
        kept.update(s.id for _, s in newest.values())
    return kept


@dataclass(frozen=True)
class Retained:
    """What retention reads of one stored snapshot (its manifest's identity and place)."""

    id: str
    lineage: str
    sequence: int
    created: str
    notebook_path: str | None = None

    @classmethod
    def of(cls, manifest: Manifest) -> Retained:
        return cls(
            manifest.id,
            manifest.lineage,
            manifest.sequence,
            manifest.created,
            manifest.notebook_path,
        )

    @property
    def group(self) -> str:
        """The notebook it belongs to, or its kernel's lineage when it has no notebook."""
        return self.notebook_path or f"lineage:{self.lineage}"


@dataclass(frozen=True)
class RetentionPlan:
    by_count: list[str] = field(default_factory=list)
    """Ids to delete now: beyond ``keep_last`` in their group and not kept by the hourly
    and daily rules, oldest first."""
    over_budget: list[str] = field(default_factory=list)
    """Ids to delete one by one, in this order, while the store holds more than
    ``max_bytes``: those of the largest groups first, lowest sequence first within."""


def plan_retention(
    snapshots: Iterable[Retained], newest: Retained, policy: RetentionPolicy
) -> RetentionPlan:
    """Which of ``snapshots`` (the store's listing, ``newest`` among them once stored) go.

    Within a group, snapshots of ``newest``'s lineage count as the most recent, then by
    sequence and creation time; ties keep the listing's order (lineage, sequence, id).
    The last of every group and ``newest`` itself are protected: a group may so keep more
    than ``keep_last``.
    """
    listed = sorted(snapshots, key=lambda s: (s.lineage, s.sequence, s.id))
    groups: dict[str, list[Retained]] = {}
    for s in listed:
        groups.setdefault(s.group, []).append(s)
    for items in groups.values():
        items.sort(key=lambda s: (s.lineage == newest.lineage, s.sequence, s.created))
    protected = {items[-1].id for items in groups.values()} | {newest.id}

    by_count: list[str] = []
    if policy.keep_last > 0:
        now = _created(newest) or max(
            (when for s in listed if (when := _created(s)) is not None), default=None
        )
        for items in groups.values():
            excess = items[: max(0, len(items) - policy.keep_last)]
            thinned = thinned_keep(items, now, policy) if now is not None else set()
            by_count.extend(s.id for s in excess if s.id not in protected | thinned)

    over_budget: list[str] = []
    if policy.max_bytes > 0:
        spared = protected | set(by_count)
        candidates = sorted(
            (s for s in listed if s.id not in spared),
            key=lambda s: (-len(groups[s.group]), s.sequence),
        )
        over_budget = [s.id for s in candidates]
    return RetentionPlan(by_count, over_budget)
