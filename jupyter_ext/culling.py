"""jupyter_server's kernel culler, made to keep a snapshot kernel's state.

The culler (``MappingKernelManager.cull_kernels``, every ``cull_interval`` seconds) calls
``cull_kernel_if_idle`` for each kernel, which judges idleness by jupyter_server's own
rules (``cull_idle_timeout``, ``cull_connected``, ``cull_busy``, the kernelspec's
metadata) and then calls ``shutdown_kernel``. Both are wrapped on the kernel manager
here: a shutdown is the culler's only while its ``cull_kernel_if_idle`` runs (a context
variable, set in the culler's own task), so a shutdown the user asks for through the REST
API, in another request, is never mistaken for one. The culler's shutdown of a running
snapshot kernel becomes a suspend (``cull_action = "suspend"``); a suspended kernel is
not culled again (it holds no process and costs next to nothing). After every shutdown,
the dumps of suspended kernels that no wrapper holds any more are removed.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .core.errors import SnapshotError
from .manager import Job, SnapshotManager

log = logging.getLogger("jupyter_ext")

#: Set while jupyter_server's culler judges (and may shut down) a kernel.
_CULLING: contextvars.ContextVar[bool] = contextvars.ContextVar("culling", default=False)


#: Wrapper states in which the culler leaves a snapshot kernel alone.
LEFT_ALONE = ("suspended", "snapshotting", "restoring", "starting")


class CullingPolicy:
    """What the culler does to snapshot kernels (``action``: "suspend" or "shutdown")."""

    def __init__(self, kernel_manager: Any, manager: SnapshotManager, action: str) -> None:
        self.kernel_manager = kernel_manager
        self.manager = manager
        self.action = action

    def install(self) -> None:
        """Wrap the kernel manager's ``cull_kernel_if_idle`` and ``shutdown_kernel`` (the
        culler and the REST handlers look both up on the instance)."""
        km = self.kernel_manager
        cull: Callable[[str], Awaitable[None]] = km.cull_kernel_if_idle
        shutdown: Callable[..., Awaitable[None]] = km.shutdown_kernel

        async def cull_kernel_if_idle(kernel_id: str) -> None:
            if self.action == "suspend" and await self._left_alone(kernel_id):
                return
            token = _CULLING.set(True)
            try:
                await cull(kernel_id)
            finally:
                _CULLING.reset(token)

        async def shutdown_kernel(kernel_id: str, now: bool = False, restart: bool = False) -> None:
            culled = _CULLING.get() and not restart and self.action == "suspend"
            if culled and await self._kept(kernel_id):
                return
            try:
                await shutdown(kernel_id, now=now, restart=restart)
            finally:
                await self.manager.remove_released_suspends()

        km.cull_kernel_if_idle = cull_kernel_if_idle
        km.shutdown_kernel = shutdown_kernel

    async def _state(self, kernel_id: str) -> str | None:
        """The snapshot kernel's state as its wrapper says (None: not a snapshot kernel)."""
        status = await self.manager.schedules.kernel_status(kernel_id)
        return str(status["state"]) if status.get("snapshots") else None

    async def _left_alone(self, kernel_id: str) -> bool:
        """Whether the culler leaves the kernel alone this time: a suspended one (already
        saved and freed: culling it would only lose it), and one a job or its wrapper
        works on (a snapshot, a restore still bringing it in: idle only to the culler)."""
        if self.manager.jobs.has_job(kernel_id):
            return True
        return await self._state(kernel_id) in LEFT_ALONE

    async def _kept(self, kernel_id: str) -> bool:
        """The culler is about to shut the kernel down: suspend it instead (True: it
        stays), or, if it cannot be suspended (busy, with ``cull_busy``), snapshot it
        first (False: it is shut down). One left without a snapshot is said in the log
        and an "unsaved" event, as at a server's stop."""
        status = await self.manager.schedules.kernel_status(kernel_id)
        if not status.get("snapshots") or status.get("state") != "running":
            return False  # not a snapshot kernel, or a dead one: nothing to keep
        reason = "it was running a cell"
        if status.get("execution_state") != "busy":
            failed = await self._job(kernel_id, self.manager.dumps.suspend)
            if failed is None or await self._state(kernel_id) == "suspended":
                # Suspended (if its upload failed, its dump stays and is retried).
                log.info("culled kernel %s is suspended; its next cell brings it back", kernel_id)
                return True
            reason = failed
        failed = await self._job(kernel_id, self.manager.dumps.create)
        if failed is None:
            log.info(
                "culled kernel %s (not suspended: %s) snapshotted, shut down", kernel_id, reason
            )
            return False
        reason = f"it could not be suspended ({reason}) nor snapshotted ({failed})"
        log.warning("culled kernel %s is shut down without a snapshot: %s", kernel_id, reason)
        self.manager.emit("unsaved", {"kernel_id": kernel_id, "trigger": "cull", "message": reason})
        return False

    async def _job(self, kernel_id: str, start: Callable[..., Job]) -> str | None:
        """Run a suspend or snapshot of the kernel (after any job running on it); None
        once it is done, else why not."""
        running = self.manager.jobs.on(kernel_id)
        if running is not None:
            await self.manager.jobs.wait(running)
        try:
            job = await self.manager.jobs.wait(start(kernel_id, trigger="cull"))
        except SnapshotError as exc:
            return exc.message
        if job.status == "done":
            return None
        return str((job.error or {}).get("message", "it did not finish"))
