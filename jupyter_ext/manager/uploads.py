"""Uploads: sealed dumps put into the store, kept locally (pending) while that fails, and
taken up again after a restart."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import SnapshotError
from ..core.fileio import lock_directory
from ..core.imagecache import ImageCache, stamp_checked
from ..core.leftovers import remove_orphaned_dumps, remove_unlocked
from ..core.manifest import MANIFEST_NAME, SNAPSHOT_ID_RE, Manifest, remove_tree
from ..core.protocol.progress import Phase
from ..core.store import S3Store, SnapshotStore
from .jobs import Job, Jobs
from .shared import Workspace, describe

log = logging.getLogger("jupyter_ext")

#: A dump or download directory nothing was written to for this long was left by a crash
#: (an active one writes its files within seconds).
STALE_WORK_SECONDS = 3600.0


@dataclass
class PendingUpload:
    """A snapshot dumped and sealed locally whose upload to the store has not succeeded."""

    manifest: Manifest
    directory: Path
    error: str = ""
    attempts: int = 0
    in_flight: bool = False


def _untouched_for(path: Path, seconds: float) -> bool:
    """Whether nothing in ``path`` (a file or a tree) changed in the last ``seconds``."""
    newest = 0.0
    with contextlib.suppress(OSError):
        newest = path.lstat().st_mtime
        for sub in path.rglob("*") if path.is_dir() else []:
            with contextlib.suppress(OSError):
                newest = max(newest, sub.lstat().st_mtime)
    return time.time() - newest > seconds


class Uploads:
    """Put sealed snapshots into the store; what failed stays pending and is retried.
    ``retain`` runs after each stored snapshot (retention)."""

    def __init__(
        self,
        store: SnapshotStore,
        workspace: Workspace,
        image_cache: ImageCache,
        jobs: Jobs,
        retain: Callable[[Manifest], Any],
    ) -> None:
        self.store = store
        self.workspace = workspace
        self.image_cache = image_cache
        self.jobs = jobs
        self.retain = retain
        #: Snapshots sealed here and not stored yet, by id: asked through the methods
        #: below, changed only here.
        self._pending: dict[str, PendingUpload] = {}

    def waiting(self, snapshot_id: str) -> PendingUpload | None:
        """The local copy of a snapshot not stored yet (its manifest and directory)."""
        return self._pending.get(snapshot_id)

    def all_waiting(self) -> list[PendingUpload]:
        """Every snapshot sealed here and not stored yet."""
        return list(self._pending.values())

    def discard(self, snapshot_id: str) -> bool:
        """Delete a snapshot that waits for its upload (its local copy); False if none."""
        pending = self._pending.pop(snapshot_id, None)
        if pending is None:
            return False
        shutil.rmtree(pending.directory, ignore_errors=True)
        return True

    async def upload(
        self, job: Job | None, manifest: Manifest, directory: Path
    ) -> dict[str, Any] | None:
        """Put a sealed snapshot into the store; keep it locally (pending) if that fails."""
        pending = self._pending.setdefault(manifest.id, PendingUpload(manifest, directory))
        if pending.in_flight:  # a retry while the previous attempt still runs
            return None
        pending.attempts += 1
        pending.in_flight = True

        # Into S3 it is an upload; into a local store it is not (the panel says so).
        phase: Phase = "uploading" if isinstance(self.store, S3Store) else "storing"
        if job is not None:
            self.jobs.progress(job, phase)
        try:
            stored = await asyncio.to_thread(
                self.store.put,
                directory,
                self.jobs.threaded_progress(job, {"uploading": phase}),
                manifest,  # as the wrapper answered: not read back from the directory
            )
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
                await asyncio.to_thread(self.retain, stored.manifest)
            except SnapshotError as exc:
                log.warning("retention after snapshot %s failed: %s", manifest.id, exc)
        finally:
            self._pending.pop(manifest.id, None)
        return describe(stored, "complete")

    async def retry(self) -> None:
        """Try failed uploads again (called periodically by the extension)."""
        for pending in self.all_waiting():
            if pending.in_flight:
                continue  # uploading, or stored and being wrapped up
            if not (pending.directory / MANIFEST_NAME).exists():
                # Uploaded and removed by another server sharing this work directory.
                del self._pending[pending.manifest.id]
            elif pending.error:  # stays "upload-failed" until an attempt succeeds
                await self.upload(None, pending.manifest, pending.directory)

    def recover_staged(self, stale_after: float = STALE_WORK_SECONDS) -> list[str]:
        """After a restart: take up the snapshots sealed here whose upload never succeeded
        (the store was down when the server stopped, say), and remove what dumps and
        downloads cut short by a crash left behind. Returns the ids taken up; their
        upload is retried like any failed one, and they are listed meanwhile."""
        recovered = []
        ws = self.workspace
        for directory in (ws.staging_dir, ws.suspended_dir):
            if directory.is_dir():  # dumps of a server that died: at once, not in an hour
                for path in remove_orphaned_dumps(directory):
                    log.info("Removed %s, left by a dump whose server ended", path)
        remove_released_suspends(ws)
        for path in remove_unlocked(ws.cache_dir):  # likewise its downloads
            log.info("Removed %s, left by a restore whose server ended", path)
        for path in self.image_cache.recover():
            log.info("Removed %s from the image cache (broken, or left by a crash)", path)
        for entry in sorted(ws.staging_dir.iterdir()):
            if SNAPSHOT_ID_RE.match(entry.name) and (entry / MANIFEST_NAME).is_file():
                try:
                    manifest = Manifest.read(entry)
                except SnapshotError as exc:
                    log.warning("Removing %s, not a snapshot: %s", entry, exc)
                    remove_tree(entry)
                    continue
                if manifest.id in self._pending:
                    continue
                self._pending[manifest.id] = PendingUpload(
                    manifest, entry, error="Not stored yet (found when the server started)."
                )
                recovered.append(manifest.id)
            elif _untouched_for(entry, stale_after):
                log.info("Removing %s, left by an interrupted snapshot", entry)
                remove_tree(entry)
        for entry in ws.cache_dir.iterdir():
            if _untouched_for(entry, stale_after):
                log.info("Removing %s, left by an interrupted restore", entry)
                remove_tree(entry)
        if ws.suspended_dir.is_dir():  # sealed ones: removed once their kernel ends (above)
            for entry in ws.suspended_dir.glob(".*.partial-*"):
                if _untouched_for(entry, stale_after):
                    log.info("Removing %s, left by an interrupted suspend", entry)
                    remove_tree(entry)
        return recovered


def remove_released_suspends(workspace: Workspace) -> list[Path]:
    """Remove the dumps of suspended kernels that have ended (shut down, culled, killed,
    or gone with a server that died): each wrapper holds its kernel's dump locked while it
    is suspended on it. Their snapshot stays in the store (and the image cache)."""
    if not workspace.suspended_dir.is_dir():
        return []
    removed = remove_unlocked(workspace.suspended_dir, sealed_only=True)
    for path in removed:
        log.info("Removed %s, the dump of a suspended kernel that ended", path)
    return removed
