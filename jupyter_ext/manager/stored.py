"""The snapshots a user has: listed (stored ones and those waiting for their upload), one
described, one deleted."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from ..core.imagecache import ImageCache
from ..core.manifest import Manifest, check_snapshot_id
from ..core.store import SnapshotStore, StoreError
from .lazy import LazyLending
from .paths import NotebookPaths
from .shared import EmitEvent, describe, describe_manifest
from .uploads import PendingUpload, Uploads


def _describe_pending(pending: PendingUpload, full: bool = False) -> dict[str, Any]:
    status = "upload-failed" if pending.error else "uploading"
    return describe_manifest(pending.manifest, status, pending.error, full=full)


class StoredSnapshots:
    """List, describe and delete snapshots; a lent one is deleted once given back."""

    def __init__(
        self,
        store: SnapshotStore,
        uploads: Uploads,
        lending: LazyLending,
        image_cache: ImageCache,
        emit: EmitEvent,
        paths: NotebookPaths,
    ) -> None:
        self.store = store
        self.uploads = uploads
        self.lending = lending
        self.image_cache = image_cache
        self.emit = emit
        self.paths = paths
        self._key_notice = ""
        self._key_notice_read: asyncio.Future[str] | None = None

    async def list_snapshots(self, **filters: str | None) -> dict[str, Any]:
        """Complete snapshots in the store, plus local ones waiting for upload.

        An unreachable store still lists the local ones, with ``store_error`` saying why
        the others are missing. Store calls run in a thread: a slow or unreachable S3
        endpoint must never block the server's event loop.
        """
        store_error = ""
        pending = self.uploads.all_waiting()
        waiting = {p.manifest.id for p in pending}
        try:
            stored = await asyncio.to_thread(self.store.snapshots)
            # One stored but not wrapped up yet is listed once, as uploading (below).
            entries = [describe(s, "complete") for s in stored if s.manifest.id not in waiting]
        except StoreError as exc:
            entries, store_error = [], str(exc)
        entries.extend(_describe_pending(p) for p in pending)
        # A notebook's snapshots: those taken at any path it had (paths.py).
        for entry in entries:
            entry["notebook_path_now"] = self.paths.now(entry.get("notebook_path"))
        fields = (
            ("kernel_id",) * 2,
            ("path", "notebook_path_now"),
            ("trigger",) * 2,
            ("lineage",) * 2,
        )
        for key, field in fields:
            if wanted := filters.get(key):
                entries = [e for e in entries if e.get(field) == wanted]
        entries.sort(key=lambda e: (e["created"], e["sequence"]), reverse=True)
        return {"snapshots": entries, "store_error": store_error}

    def key_notice(self) -> str:
        """What to tell the user while the store's key would be lost with this machine
        (core/store/keys.py), as last read; "" if not, or not known (the store cannot be
        reached: said elsewhere). Each call reads it again in the background: a stalled
        store never holds up the answer."""
        if self._key_notice_read is None or self._key_notice_read.done():
            self._key_notice_read = asyncio.ensure_future(self.read_key_notice())
        return self._key_notice

    async def read_key_notice(self) -> str:
        """Read the key notice from the store now (and keep it for :meth:`key_notice`)."""
        with contextlib.suppress(StoreError):
            self._key_notice = await asyncio.to_thread(self.store.key_notice)
        return self._key_notice

    async def get(self, snapshot_id: str) -> dict[str, Any]:
        check_snapshot_id(snapshot_id)
        pending = self.uploads.waiting(snapshot_id)
        if pending is not None:
            found = _describe_pending(pending, full=True)
        else:
            stored = await asyncio.to_thread(self.store.get, snapshot_id)
            found = describe(stored, "complete", full=True)
        found["notebook_path_now"] = self.paths.now(found.get("notebook_path"))
        return found

    async def manifest(self, snapshot_id: str) -> Manifest:
        """The manifest of a snapshot, stored or waiting for its upload (404 if neither)."""
        pending = self.uploads.waiting(snapshot_id)
        if pending is not None:
            return pending.manifest
        return await self.stored_manifest(snapshot_id)

    async def stored_manifest(self, snapshot_id: str) -> Manifest:
        """The manifest of a snapshot in the store (404 if it is not there)."""
        stored = await asyncio.to_thread(self.store.get, snapshot_id)
        return stored.manifest

    async def delete(self, snapshot_id: str) -> None:
        check_snapshot_id(snapshot_id)
        if not self.uploads.discard(snapshot_id):
            # A kernel restored lazily from it reads its pages yet: deleted once they are in.
            while self.lending.is_lent(snapshot_id):
                await asyncio.sleep(0.1)
            await asyncio.to_thread(self.store.delete, snapshot_id)
            await asyncio.to_thread(self.image_cache.discard, snapshot_id)
        self.emit("deleted", {"snapshot_id": snapshot_id, "reason": "request"})
