"""Retention: which stored snapshots go after a new one (the choice is
:func:`~..core.policies.retention.plan_retention`'s), never one a lazy restore still reads."""

from __future__ import annotations

import threading

from ..core.imagecache import ImageCache
from ..core.manifest import Manifest
from ..core.policies.retention import Retained, RetentionPolicy, plan_retention
from ..core.store import SnapshotStore
from .lazy import LazyLending
from .shared import EmitEvent, ManagerSettings


class Retention:
    """Keep the last N per notebook and a total byte budget; never the newest of any."""

    _pass = threading.Lock()
    """Retention runs one pass at a time in this process (jobs finishing together each
    apply it): concurrent passes planned over the same listing and deleted twice."""

    def __init__(
        self,
        store: SnapshotStore,
        settings: ManagerSettings,
        lending: LazyLending,
        image_cache: ImageCache,
        emit: EmitEvent,
    ) -> None:
        self.store = store
        self.settings = settings
        self.lending = lending
        self.image_cache = image_cache
        self.emit = emit

    def apply(self, newest: Manifest) -> list[str]:
        """One pass after ``newest`` was stored; the ids deleted."""
        with self._pass:
            return self._pass_once(newest)

    def _pass_once(self, newest: Manifest) -> list[str]:
        store, settings = self.store, self.settings
        plan = plan_retention(
            (Retained.of(s.manifest) for s in store.snapshots()),
            Retained.of(newest),
            RetentionPolicy(
                keep_last=settings.keep_last,
                max_bytes=settings.max_bytes,
                keep_hourly_hours=settings.keep_hourly_hours,
                keep_daily_days=settings.keep_daily_days,
            ),
        )
        removed: list[str] = []
        for snapshot_id in plan.by_count:
            if self.lending.is_lent(snapshot_id):  # a kernel still reads its pages: next time
                continue
            store.delete(snapshot_id, missing_ok=True)  # another server's pass may be first
            removed.append(snapshot_id)
        for snapshot_id in plan.over_budget:
            # Chunks are shared between snapshots: what a deletion frees is what the store
            # says it holds afterwards, not the sum of the snapshots' sizes.
            if store.stats().stored_bytes <= settings.max_bytes:
                break
            if self.lending.is_lent(snapshot_id):
                continue
            store.delete(snapshot_id, missing_ok=True)
            removed.append(snapshot_id)
        for snapshot_id in removed:
            self.image_cache.discard(snapshot_id)
            self.emit("deleted", {"snapshot_id": snapshot_id, "reason": "retention"})
        return removed
