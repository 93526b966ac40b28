"""Lazy restores: the restored kernel runs as soon as CRIU has rebuilt it, its memory
served page by page (``criu lazy-pages``) while the rest arrives in the background.

Whether a restore goes lazily is its requester's decision (core.lazypages.lazy_plan: the
server's, said in ``RestoreRequest.lazy``); this wrapper decides, by the same rule, only
for the restores no one asks of it (a suspended kernel coming back, an undo to a cell
checkpoint). Here are kept the
transfer under way and the status of the last one (the kernel's status shows it).
Completing a transfer, or putting back the kernel a failed one replaced, is the
snapshotter's (it holds the lock).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable, Coroutine
from typing import Any

from jupyter_ext.core.criu import Criu, LazyTransfer
from jupyter_ext.core.errors import SnapshotError
from jupyter_ext.core.lazypages import Into, LazySettings, lazy_plan
from jupyter_ext.core.manifest import Manifest

log = logging.getLogger("kernel_wrapper")


class LazyRestore:
    """The lazy restores of one kernel."""

    def __init__(self, settings: LazySettings) -> None:
        self.settings = settings
        """For this wrapper's own restores (from the server's settings, in its environment)."""
        self._status: dict[str, Any] = {}
        self._not_transferring = asyncio.Event()
        self._not_transferring.set()
        self.transfer: LazyTransfer | None = None
        """The pages of the kernel on their way, until they are all in."""
        self._supported: bool | None = None
        self._task: asyncio.Task[None] | None = None
        self._puts_back = False
        self.awaited_by_lock_holder = False
        """A dump that holds the snapshotter's lock waits for the transfer's end: its
        failure (the kernel killed, the saved one put back) goes on without that lock."""
        self.after_put_back: Callable[[], None] | None = None
        """Told once the kernel saved before a failed transfer is back (an undo's timeline
        goes back with it)."""

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

    def own(self, manifest: Manifest) -> bool:
        """Whether a restore no one asked of this wrapper (from images on this machine,
        in place: a suspended kernel coming back, an undo) is to go lazily. Whether this CRIU can
        is asked of every restore as it runs (:meth:`told`), and only of those."""
        plan = lazy_plan(
            self.settings, manifest, into=Into.IN_PLACE, in_store=False, supported=True
        )
        return plan.lazy

    def told(self, lazy: bool, criu: Criu) -> bool:
        """Whether a restore said to go ``lazy`` (by its requester, or :meth:`own`) does:
        in full where this CRIU has no lazy pages, which the requester could not know."""
        return lazy and self.supported(criu)

    def supported(self, criu: Criu) -> bool:
        """Whether ``criu`` restores with lazy pages here (asked once; said once if not)."""
        if self._supported is None:
            self._supported, said = criu.supports_lazy_pages()
            if not self._supported:
                log.warning("lazy restore is not supported here (%s); restoring in full", said)
        return self._supported

    def follow(self, completion: Coroutine[Any, Any, None], puts_back: bool) -> None:
        """Run ``completion``, which waits for the rest of the transfer, in the background;
        ``puts_back``: if the transfer fails, it brings back the kernel saved before."""
        self._puts_back = puts_back
        self.after_put_back = None
        self._task = asyncio.create_task(completion)

    @property
    def puts_back(self) -> bool:
        """A transfer is under way whose failure (its kernel's death included) brings back
        the kernel saved before the restore (snapshotter._complete_lazy)."""
        return self.transfer is not None and self._puts_back

    async def settled(self, *, holding_lock: bool = False) -> None:
        """Before a dump: wait until a lazily restored kernel has all of its memory.
        ``holding_lock``: the caller holds the snapshotter's lock, which the transfer's
        failure would otherwise wait for (each waiting for the other)."""
        task = self._task
        if task is not None and not task.done():
            self.awaited_by_lock_holder = holding_lock
            try:
                await asyncio.shield(asyncio.wait([task]))
            finally:
                self.awaited_by_lock_holder = False

    def starting(self) -> None:
        """A lazy restore begins (``transfer`` is set once CRIU has rebuilt the kernel)."""
        self.status = {"state": "transferring"}

    def failed(self, exc: BaseException) -> None:
        """The lazy restore failed before its kernel ran."""
        self.status = {"state": "failed"}
        if isinstance(exc, SnapshotError):
            self.status["error"] = exc.to_dict()

    def give_up(self) -> None:
        """The kernel being filled in is gone on purpose, replaced by an undo that saved
        nothing (the kernel was its checkpoint's images): the transfer under way, if any,
        ends, and its end is no failure (nothing is put back, no status changes)."""
        if self.transfer is not None:
            self.transfer.given_up = True
            self.drop(self.transfer)

    def drop(self, transfer: LazyTransfer) -> None:
        """``transfer`` is over, or its kernel gone: close it, remove its work directory."""
        if self.transfer is transfer:
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
        log.info(
            "lazy restore complete: %s (%d pages asked for, %d bytes were to come lazily)",
            self.status,
            transfer.server.pages_served,
            transfer.server.lazy_bytes,
        )
