"""Snapshots in the store: listing, uploads (and their recovery after a crash), retention
and deletion."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from ..core.contents import short_contents
from ..core.errors import SnapshotError
from ..core.imagecache import stamp_checked
from ..core.leftovers import lock_directory, remove_orphaned_dumps, remove_unlocked
from ..core.manifest import MANIFEST_NAME, SNAPSHOT_ID_RE, Manifest, check_snapshot_id, remove_tree
from ..core.retention import Retained, RetentionPolicy, plan_retention
from ..core.store import StoredSnapshot, StoreError
from .base import Job, PendingUpload
from .lazy import LazyLending

log = logging.getLogger("jupyter_ext")


#: A dump or download directory nothing was written to for this long was left by a crash
#: (an active one writes its files within seconds).
STALE_WORK_SECONDS = 3600.0


def _untouched_for(path: Path, seconds: float) -> bool:
    """Whether nothing in ``path`` (a file or a tree) changed in the last ``seconds``."""
    newest = 0.0
    with contextlib.suppress(OSError):
        newest = path.lstat().st_mtime
        for sub in path.rglob("*") if path.is_dir() else []:
            with contextlib.suppress(OSError):
                newest = max(newest, sub.lstat().st_mtime)
    return time.time() - newest > seconds


class StoredSnapshots(LazyLending):
    """List, upload, retain and delete snapshots; a lent one is kept until given back."""

    async def list_snapshots(self, **filters: str | None) -> dict[str, Any]:
        """Complete snapshots in the store, plus local ones waiting for upload.

        An unreachable store still lists the local ones, with ``store_error`` saying why
        the others are missing. Store calls run in a thread: a slow or unreachable S3
        endpoint must never block the server's event loop.
        """
        store_error = ""
        try:
            stored = await asyncio.to_thread(self.store.snapshots)
            # One stored but not wrapped up yet is listed once, as uploading (below).
            entries = [
                self._describe(s, "complete") for s in stored if s.manifest.id not in self.pending
            ]
        except StoreError as exc:
            entries, store_error = [], str(exc)
        for pending in self.pending.values():
            status = "upload-failed" if pending.error else "uploading"
            entries.append(self._describe_manifest(pending.manifest, status, pending.error))
        kernel_id = filters.get("kernel_id")
        path = filters.get("path")
        trigger = filters.get("trigger")
        if kernel_id:
            entries = [e for e in entries if e.get("kernel_id") == kernel_id]
        if path:
            entries = [e for e in entries if e.get("notebook_path") == path]
        if trigger:
            entries = [e for e in entries if e.get("trigger") == trigger]
        entries.sort(key=lambda e: (e["created"], e["sequence"]), reverse=True)
        return {"snapshots": entries, "store_error": store_error}

    async def get(self, snapshot_id: str) -> dict[str, Any]:
        check_snapshot_id(snapshot_id)
        pending = self.pending.get(snapshot_id)
        if pending is not None:
            status = "upload-failed" if pending.error else "uploading"
            return self._describe_manifest(pending.manifest, status, pending.error, full=True)
        stored = await asyncio.to_thread(self.store.get, snapshot_id)
        return self._describe(stored, "complete", full=True)

    @staticmethod
    def _describe_manifest(
        manifest: Manifest, status: str, error: str = "", full: bool = False
    ) -> dict[str, Any]:
        """The API's form of a snapshot: a listing carries the short form of what it holds
        (core.contents.short_contents), a single snapshot (``full``) the whole record."""
        data = manifest.to_dict()
        if not full:
            data["contents"] = short_contents(manifest.contents)
        data.pop("files", None)
        data.pop("needed_files", None)
        data.pop("bound_ports", None)
        data.pop("cpu_flags", None)
        data.update(
            status=status,
            error=error,
            kernel_id=manifest.kernel_spec.get("kernel_id"),
            gpu_bytes=int(manifest.gpu.get("total_bytes", 0)) if manifest.gpu else 0,
        )
        return data

    def _describe(self, stored: StoredSnapshot, status: str, full: bool = False) -> dict[str, Any]:
        data = self._describe_manifest(stored.manifest, status, full=full)
        data.update(stored_bytes=stored.stored_bytes, new_bytes=stored.new_bytes)
        return data

    async def _upload(
        self, job: Job | None, manifest: Manifest, directory: Path
    ) -> dict[str, Any] | None:
        """Put a sealed snapshot into the store; keep it locally (pending) if that fails."""
        store = self.store
        pending = self.pending.setdefault(manifest.id, PendingUpload(manifest, directory))
        if pending.in_flight:  # a retry while the previous attempt still runs
            return None
        pending.attempts += 1
        pending.in_flight = True

        if job is not None:
            self._progress(job, "uploading")
        try:
            stored = await asyncio.to_thread(store.put, directory, self._progress_callback(job))
        except SnapshotError as exc:
            pending.error = exc.message
            pending.in_flight = False
            log.warning("upload of snapshot %s failed (kept locally): %s", manifest.id, exc)
            return None
        # Stored. Still listed as uploading (this entry, in flight) until it is wrapped up,
        # so that no listing shows it complete beside a snapshot its own retention pass is
        # about to delete.
        pending.error = ""
        try:
            # A restore that reads the directory meanwhile (restorable there while its
            # upload failed) holds it shared: it is moved or removed only after that.
            held = await asyncio.to_thread(lock_directory, directory)
            try:
                if self.image_cache.enabled:  # kept for restores on this machine, as checked
                    stamps = await asyncio.to_thread(stamp_checked, directory)
                    if stamps is not None:
                        await asyncio.to_thread(self.image_cache.admit, directory, stamps)
                shutil.rmtree(directory, ignore_errors=True)  # not admitted
            finally:
                os.close(held)
            try:  # the snapshot is durable: the job succeeded whatever retention does
                await asyncio.to_thread(self.apply_retention, stored.manifest)
            except SnapshotError as exc:
                log.warning("retention after snapshot %s failed: %s", manifest.id, exc)
        finally:
            self.pending.pop(manifest.id, None)
        return self._describe(stored, "complete")

    async def retry_uploads(self) -> None:
        """Try failed uploads again (called periodically by the extension)."""
        for pending in list(self.pending.values()):
            if pending.in_flight:
                continue  # uploading, or stored and being wrapped up
            if not (pending.directory / MANIFEST_NAME).exists():
                # Uploaded and removed by another server sharing this work directory.
                del self.pending[pending.manifest.id]
            elif pending.error:  # stays "upload-failed" until an attempt succeeds
                await self._upload(None, pending.manifest, pending.directory)

    def recover_staged(self, stale_after: float = STALE_WORK_SECONDS) -> list[str]:
        """After a restart: take up the snapshots sealed here whose upload never succeeded
        (the store was down when the server stopped, say), and remove what dumps and
        downloads cut short by a crash left behind. Returns the ids taken up; their
        upload is retried like any failed one, and they are listed meanwhile."""
        recovered = []
        suspended_dir = self.work_dir / "suspended"
        for directory in (self.staging_dir, suspended_dir):
            if directory.is_dir():  # dumps of a server that died: at once, not in an hour
                for path in remove_orphaned_dumps(directory):
                    log.info("Removed %s, left by a dump whose server ended", path)
        for path in remove_unlocked(self.cache_dir):  # likewise its downloads
            log.info("Removed %s, left by a restore whose server ended", path)
        for path in self.image_cache.recover():
            log.info("Removed %s from the image cache (broken, or left by a crash)", path)
        for entry in sorted(self.staging_dir.iterdir()):
            if SNAPSHOT_ID_RE.match(entry.name) and (entry / MANIFEST_NAME).is_file():
                try:
                    manifest = Manifest.read(entry)
                except SnapshotError as exc:
                    log.warning("Removing %s, not a snapshot: %s", entry, exc)
                    remove_tree(entry)
                    continue
                if manifest.id in self.pending:
                    continue
                self.pending[manifest.id] = PendingUpload(
                    manifest, entry, error="Not stored yet (found when the server started)."
                )
                recovered.append(manifest.id)
            elif _untouched_for(entry, stale_after):
                log.info("Removing %s, left by an interrupted snapshot", entry)
                remove_tree(entry)
        for entry in self.cache_dir.iterdir():
            if _untouched_for(entry, stale_after):
                log.info("Removing %s, left by an interrupted restore", entry)
                remove_tree(entry)
        if suspended_dir.is_dir():  # sealed ones belong to suspended kernels: never removed
            for entry in suspended_dir.glob(".*.partial-*"):
                if _untouched_for(entry, stale_after):
                    log.info("Removing %s, left by an interrupted suspend", entry)
                    remove_tree(entry)
        return recovered

    _retention_pass = threading.Lock()
    """Retention runs one pass at a time in this process (jobs finishing together each
    apply it): concurrent passes planned over the same listing and deleted twice."""

    def apply_retention(self, newest: Manifest) -> list[str]:
        """Keep the last N per notebook and a total byte budget; never the newest of any
        (the choice is :func:`~.core.retention.plan_retention`'s)."""
        with self._retention_pass:
            return self._retention_pass_once(newest)

    def _retention_pass_once(self, newest: Manifest) -> list[str]:
        store = self.store
        plan = plan_retention(
            (Retained.of(s.manifest) for s in store.snapshots()),
            Retained.of(newest),
            RetentionPolicy(
                keep_last=self.keep_last,
                max_bytes=self.max_bytes,
                keep_hourly_hours=self.keep_hourly_hours,
                keep_daily_days=self.keep_daily_days,
            ),
        )
        removed: list[str] = []
        for snapshot_id in plan.by_count:
            if self._is_lent(snapshot_id):  # a kernel still reads its pages: next time
                continue
            store.delete(snapshot_id, missing_ok=True)  # another server's pass may be first
            removed.append(snapshot_id)
        for snapshot_id in plan.over_budget:
            # Chunks are shared between snapshots: what a deletion frees is what the store
            # says it holds afterwards, not the sum of the snapshots' sizes.
            if store.stats().stored_bytes <= self.max_bytes:
                break
            if self._is_lent(snapshot_id):
                continue
            store.delete(snapshot_id, missing_ok=True)
            removed.append(snapshot_id)
        for snapshot_id in removed:
            self.image_cache.discard(snapshot_id)
            self.emit("deleted", {"snapshot_id": snapshot_id, "reason": "retention"})
        return removed

    async def delete(self, snapshot_id: str) -> None:
        check_snapshot_id(snapshot_id)
        pending = self.pending.get(snapshot_id)
        if pending is not None:
            del self.pending[snapshot_id]
            shutil.rmtree(pending.directory, ignore_errors=True)
        else:
            # A kernel restored lazily from it reads its pages yet: deleted once they are in.
            while self._is_lent(snapshot_id):
                await asyncio.sleep(0.1)
            await asyncio.to_thread(self.store.delete, snapshot_id)
            await asyncio.to_thread(self.image_cache.discard, snapshot_id)
        self.emit("deleted", {"snapshot_id": snapshot_id, "reason": "request"})
