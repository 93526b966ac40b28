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
from ..core.errors import KernelNotFoundError, SnapshotError, WrapperUnavailableError
from ..core.imagecache import ImageCache, stamp_tree
from ..core.lazypages import PAGES_FILE_RE, restore_order
from ..core.manifest import IMAGES_DIR, verify
from ..core.store import SnapshotStore
from .jobs import Jobs
from .kernels import Kernels
from .pages import LentPages
from .shared import EmitEvent

log = logging.getLogger("jupyter_ext")


class LazyLending:
    """Lend a stored snapshot's pages to a lazily restored kernel, and wrap up after it."""

    def __init__(
        self,
        store: SnapshotStore,
        image_cache: ImageCache,
        kernels: Kernels,
        jobs: Jobs,
        emit: EmitEvent,
    ) -> None:
        self.store = store
        self.image_cache = image_cache
        self.kernels = kernels
        self.jobs = jobs
        self.emit = emit
        #: Stored snapshots whose pages lazily restored kernels still read.
        self.lent: set[LentPages] = set()
        self._watchers: set[asyncio.Task[None]] = set()
        self._settling: set[str] = set()
        """Kernels restored lazily whose restore this server has not wrapped up yet."""
        self._lazy_pages: bool | None = None

    def settling(self, kernel_id: str) -> bool:
        """Whether this server has yet to wrap up the kernel's lazy restore (its pages
        are all in, what they were read from is not given back yet)."""
        return kernel_id in self._settling

    def after_lazy(
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
            closed = False
            try:
                outcome = await self._transferred(kernel_id, timeout)
            except GeneratorExit:  # closed unfinished as its loop ended: nothing may wait
                closed = True
                raise
            finally:
                try:
                    if not closed:
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
        task = self.jobs.spawn(wait())
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _transferred(self, kernel_id: str, timeout: float | None) -> dict[str, Any]:
        """The kernel's ``lazy_restore`` status once it is no longer "transferring", as its
        wrapper tells when that happens; empty when the kernel went away or ``timeout``
        passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return {}
            try:
                wrapper = self.kernels.wrapper(kernel_id)
                return await asyncio.wait_for(wrapper.lazy_restore_end(), left)
            except (WrapperUnavailableError, KernelNotFoundError):
                return {}  # the kernel is gone (or going): give back at once
            except TimeoutError:
                return {}
            except SnapshotError as exc:
                if not await self.kernels.alive(kernel_id):
                    return {}
                # A failed answer: a live kernel keeps what it reads from; asked again.
                log.warning("lazy restore of kernel %s: %r", kernel_id, exc)
                await asyncio.sleep(1)

    async def settled(self) -> None:
        """Wait until every lazily restored kernel has its memory, and what it was read
        from is given back (cached or removed)."""
        while self._watchers:
            await asyncio.wait(list(self._watchers))

    async def lazy_pages_here(self) -> bool:
        """Whether kernels here restore lazily (as their wrappers find out: root and a
        CRIU whose lazy pages work); if not, restores from the store download first."""
        if self._lazy_pages is None:
            try:
                criu = await asyncio.to_thread(Criu.locate)
                self._lazy_pages = (await asyncio.to_thread(criu.supports_lazy_pages))[0]
            except SnapshotError:
                self._lazy_pages = False
        return self._lazy_pages

    async def lend(self, snapshot_id: str, directory: Path) -> LentPages:
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
            await self.give_back(lent)
            raise
        return lent

    async def give_back(self, lent: LentPages) -> None:
        """Stop lending (the download stops; its reads in flight end first)."""
        try:
            await asyncio.shield(asyncio.to_thread(lent.close))
        finally:
            self.lent.discard(lent)

    def is_lent(self, snapshot_id: str) -> bool:
        return any(lent.snapshot_id == snapshot_id for lent in list(self.lent))

    def download_done(
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
                await self.give_back(lent)
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
