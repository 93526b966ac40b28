"""Lazy restores from the store: pages lent to the restoring wrapper, given back once the
kernel has its memory."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ..core.criu import Criu
from ..core.errors import SnapshotError, SnapshotNotFoundError, WrapperUnavailableError
from ..core.imagecache import stamp_tree
from ..core.lazypages import PAGES_FILE_RE, restore_order
from ..core.manifest import IMAGES_DIR, verify
from .base import ManagerBase
from .pages import LentPages

log = logging.getLogger("jupyter_ext")


class LazyLending(ManagerBase):
    """Lend a stored snapshot's pages to a lazily restored kernel, and wrap up after it."""

    def _after_lazy(
        self,
        kernel_id: str,
        then: Callable[[dict[str, Any]], Awaitable[None]],
        timeout: float | None = None,
    ) -> None:
        """Once a lazily restored kernel has all of its memory ("transferring" no longer
        in its status), or is gone, or after ``timeout``: ``then(outcome)``, the status's
        ``lazy_restore`` (empty when the kernel is gone or still transferring). Until then
        what its pages are read from stays (a cache entry no eviction removes, a download
        and the store lent to its wrapper)."""

        async def wait() -> None:
            outcome: dict[str, Any] = {}
            try:
                deadline = None if timeout is None else time.monotonic() + timeout
                while deadline is None or time.monotonic() < deadline:
                    try:
                        status = await self.wrapper(kernel_id).status()
                    except (WrapperUnavailableError, SnapshotNotFoundError):
                        break  # the kernel is gone (or going): give back at once
                    except (SnapshotError, TimeoutError) as exc:
                        if not await self._kernel_alive(kernel_id):
                            break
                        # A slow or failed answer: a live kernel keeps what it reads from.
                        log.warning("status of lazily restored kernel %s: %r", kernel_id, exc)
                        await asyncio.sleep(0.2)
                        continue
                    lazy = status.get("lazy_restore") or {}
                    if lazy.get("state") != "transferring":
                        outcome = lazy
                        break
                    await asyncio.sleep(0.2)
            finally:
                try:
                    await then(outcome)
                finally:
                    self._settling.discard(kernel_id)
            if outcome.get("state") == "failed":  # after the job said "done": say it now
                error = outcome.get("error") or {}
                log.warning("lazy restore of kernel %s failed: %s", kernel_id, error)
                self.emit(
                    "failed",
                    {
                        "kind": "restore",
                        "kernel_id": kernel_id,
                        "phase": "transferring",
                        "message": error.get("message", "the kernel's memory did not arrive"),
                        "hint": error.get("hint", ""),
                    },
                )

        self._settling.add(kernel_id)
        task = asyncio.ensure_future(wait())
        self._tasks.add(task)
        self._lazy_watchers.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(self._lazy_watchers.discard)

    async def lazy_restores_settled(self) -> None:
        """Wait until every lazily restored kernel has its memory, and what it was read
        from is given back (cached or removed)."""
        while self._lazy_watchers:
            await asyncio.wait(list(self._lazy_watchers))

    async def _lazy_pages_here(self) -> bool:
        """Whether kernels here restore lazily (as their wrappers find out: root and a
        CRIU whose lazy pages work); if not, restores from the store download first."""
        if self._lazy_pages is None:
            try:
                criu = await asyncio.to_thread(Criu.locate)
                self._lazy_pages = (await asyncio.to_thread(criu.supports_lazy_pages))[0]
            except SnapshotError:
                self._lazy_pages = False
        return self._lazy_pages

    async def _lend(self, snapshot_id: str, directory: Path) -> LentPages:
        """Lend a stored snapshot's pages to a lazy restore (it is not deleted meanwhile),
        and download them into ``directory`` as the kernel runs: what ``criu restore``
        reads from the files before this returns, then the smallest memory areas first."""
        images = await asyncio.to_thread(self.store.open_images, snapshot_id)
        lent = LentPages(snapshot_id, images)
        self.lent.add(lent)
        try:
            now, first = await asyncio.to_thread(restore_order, directory / IMAGES_DIR)
            prefix = f"{IMAGES_DIR}/"
            await asyncio.to_thread(
                images.download_into,
                directory,
                [f.path for f in images.manifest.files if PAGES_FILE_RE.fullmatch(f.path)],
                now=[(prefix + name, offset, length) for name, offset, length in now],
                first=[(prefix + name, offset, length) for name, offset, length in first],
            )
        except BaseException:
            await self._give_back(lent)
            raise
        return lent

    async def _give_back(self, lent: LentPages) -> None:
        """Stop lending (the download stops; its reads in flight end first)."""
        try:
            await asyncio.shield(asyncio.to_thread(lent.close))
        finally:
            self.lent.discard(lent)

    def _is_lent(self, snapshot_id: str) -> bool:
        return any(lent.snapshot_id == snapshot_id for lent in list(self.lent))

    async def _kernel_alive(self, kernel_id: str) -> bool:
        """Whether the kernel is still this server's and its process runs."""
        if kernel_id not in self.kernel_manager:
            return False
        try:
            return bool(await self.kernel(kernel_id).is_alive())
        except SnapshotError:
            return False

    def _lazy_download_done(
        self, directory: Path, lent: LentPages, download: contextlib.ExitStack
    ) -> Callable[[dict[str, Any]], Awaitable[None]]:
        """After a lazy restore from the store: stop lending its pages; the download, now
        complete, is checked file by file and kept in the image cache, or removed. Closing
        ``download`` (the restore's, handed over) removes the folder and unlocks it."""

        async def done(outcome: dict[str, Any]) -> None:
            complete = outcome.get("state") == "complete"
            try:
                if complete:  # the kernel has its memory; the download goes on to the end
                    complete = await asyncio.to_thread(lent.images.wait_downloaded)
            finally:
                await self._give_back(lent)
            try:
                if complete and self.image_cache.enabled:
                    stamps = await asyncio.to_thread(stamp_tree, directory)
                    await asyncio.to_thread(verify, directory)  # every byte, as for a put
                    await asyncio.to_thread(self.image_cache.admit, directory, stamps)
            except (SnapshotError, OSError) as exc:
                log.warning("not caching the lazily restored %s: %s", directory.name, exc)
            finally:
                download.close()  # the folder removed unless admitted, then unlocked

        return done
