"""Lazy restores: the restored kernel runs as soon as CRIU has rebuilt it, its memory
served page by page (``criu lazy-pages``) while the rest arrives in the background.

Here is decided whether a restore goes lazily, and kept the transfer under way and the
status of the last one (the kernel's status shows it). Completing a transfer, or putting
back the kernel a failed one replaced, is the snapshotter's (it holds the lock).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Coroutine
from typing import Any

from jupyter_ext.core.criu import Criu, LazyTransfer
from jupyter_ext.core.errors import SnapshotError
from jupyter_ext.core.lazypages import LAZY_MIN_BYTES, pages_bytes, worth_lazy
from jupyter_ext.core.manifest import Manifest

log = logging.getLogger("kernel_wrapper")


class LazyRestore:
    """The lazy restores of one kernel."""

    def __init__(self, enabled: bool, min_bytes: int = LAZY_MIN_BYTES) -> None:
        self.enabled = enabled
        """Restore with CRIU's lazy pages where the machine supports it..."""
        self.min_bytes = min_bytes
        """...from local images, for kernels with at least this much memory."""
        self._status: dict[str, Any] = {}
        self._not_transferring = asyncio.Event()
        self._not_transferring.set()
        self.transfer: LazyTransfer | None = None
        """The pages of the kernel on their way, until they are all in."""
        self._supported: bool | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def status(self) -> dict[str, Any]:
        """The last lazy restore: state (transferring/complete/failed, or ended: the
        kernel was shut down before every page was in), bytes, error."""
        return self._status

    @status.setter
    def status(self, status: dict[str, Any]) -> None:
        self._status = status
        if status.get("state") == "transferring":
            self._not_transferring.clear()
        else:
            self._not_transferring.set()

    async def end(self) -> dict[str, Any]:
        """The status once the kernel's memory is no longer transferring (the server's
        ``lazy-restore-end`` request)."""
        await self._not_transferring.wait()
        return self.status

    def wanted(self, manifest: Manifest, criu: Criu, *, local: bool) -> bool:
        """Lazy restore unless turned off, unsupported here, the kernel had CUDA state
        (the CUDA restore reads all of its memory at once: nothing to gain), or its memory
        is ``local`` and small (a full restore is faster then)."""
        if not self.enabled or not worth_lazy(manifest.gpu):
            return False
        if local and pages_bytes(manifest.files) < self.min_bytes:
            return False
        if self._supported is None:
            self._supported, said = criu.supports_lazy_pages()
            if not self._supported:
                log.warning("lazy restore is not supported here (%s); restoring in full", said)
        return self._supported

    def follow(self, completion: Coroutine[Any, Any, None]) -> None:
        """Run ``completion``, which waits for the rest of the transfer, in the background."""
        self._task = asyncio.create_task(completion)

    async def settled(self) -> None:
        """Before a dump: wait until a lazily restored kernel has all of its memory."""
        task = self._task
        if task is not None and not task.done():
            await asyncio.shield(asyncio.wait([task]))

    def starting(self) -> None:
        """A lazy restore begins (``transfer`` is set once CRIU has rebuilt the kernel)."""
        self.status = {"state": "transferring"}

    def failed(self, exc: BaseException) -> None:
        """The lazy restore failed before its kernel ran."""
        self.status = {"state": "failed"}
        if isinstance(exc, SnapshotError):
            self.status["error"] = exc.to_dict()

    def drop(self, transfer: LazyTransfer) -> None:
        """``transfer`` is over, or its kernel gone: close it, remove its work directory."""
        self.transfer = None
        transfer.close()
        shutil.rmtree(transfer.work_dir, ignore_errors=True)

    def completed(self, transfer: LazyTransfer, filled: int) -> None:
        """Every page is in (``filled`` bytes of them filled in after the transfer)."""
        local_copy_error = transfer.server.local_copy_error  # known until it is closed
        self.drop(transfer)
        self.status = {
            "state": "complete",
            "bytes": transfer.server.bytes_served + filled,
            "seconds": round((transfer.finished or time.monotonic()) - transfer.started, 3),
        }
        if local_copy_error:  # the kernel has all of its memory; the local images do not
            self.status["local_copy_error"] = local_copy_error
        log.info("lazy restore complete: %s", self.status)
