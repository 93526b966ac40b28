"""Kernel shutdowns the user did not ask for, made to keep a snapshot kernel's state.

jupyter_server's culler (``MappingKernelManager.cull_kernels``, every ``cull_interval``
seconds) calls ``cull_kernel_if_idle`` for each kernel, which judges idleness by
jupyter_server's own rules (``cull_idle_timeout``, ``cull_connected``, ``cull_busy``, the
kernelspec's metadata) and then calls ``shutdown_kernel``. A shutdown through the REST
API (``DELETE /api/kernels/ID``, ``DELETE /api/sessions/ID``) runs in its request, whose
handler jupyter_server's ``CallContext`` holds, with the requester as its
``current_user``. The kernel manager's ``cull_kernel_if_idle`` and ``shutdown_kernel``
and the session manager's ``delete_session`` are wrapped here (the culler and the REST
handlers look them up on the instances):

* a shutdown is the culler's only while its ``cull_kernel_if_idle`` runs (a context
  variable, set in the culler's own task), so a shutdown the user asks for, in another
  request, is never mistaken for one; with ``cull_action`` "suspend" it is decided by
  :func:`.core.policies.tick.culled` on the kernel's status, read once before the
  culler judges;
* with ``admin_shutdown_action`` "suspend", a DELETE request of someone other than the
  server's owner is decided the same way (a session so deleted stays, with its kernel).

The decision is carried out here: the kernel suspended instead, or snapshotted and then
shut down. After every shutdown, restart and the shutdown of all kernels (a server's
stop), the dumps of suspended kernels that no wrapper holds any more are removed.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from jupyter_server.auth.identity import (
    IdentityProvider,
    LegacyIdentityProvider,
    PasswordIdentityProvider,
    User,
)
from jupyter_server.base.call_context import CallContext

from .core.errors import SnapshotError
from .core.policies.tick import EndAction, Kernel, culled
from .manager import Job, SnapshotManager

log = logging.getLogger("jupyter_ext")

#: jupyter_server's own logins: every user is an anonymous holder of the server's token
#: or password, so no requester can be told from the server's owner.
#: How long a server's stop waits for kernels jupyter_client is starting again.
RESTART_WAIT_SECONDS = 30.0
ANONYMOUS_LOGINS = (IdentityProvider, PasswordIdentityProvider, LegacyIdentityProvider)


@dataclass(frozen=True)
class Ending:
    """A shutdown the user did not ask for, decided: what it becomes, why it came (for the
    log: "culled", "shut down by NAME"), and the trigger of its snapshot (manifest.TRIGGERS:
    "cull" for the culler's, "admin-shutdown" for another's)."""

    action: EndAction
    why: str
    trigger: str


#: Set while a decided shutdown runs: in the culler's ``cull_kernel_if_idle`` (before it
#: judges), in another's ``delete_session`` (the kernel's shutdown within it is decided).
_ENDING: contextvars.ContextVar[Ending | None] = contextvars.ContextVar("ending", default=None)


def is_owner(user: User, owner: str) -> bool:
    """Whether a requester is the server's owner: its user name is ``owner``, and on
    JupyterHub it is a user (a service of the same name is not)."""
    hub_user: dict[str, Any] = getattr(user, "hub_user", None) or {}
    return user.username == owner and hub_user.get("kind", "user") == "user"


class CullingPolicy:
    """What shutdowns the user did not ask for do to snapshot kernels: ``cull_action``
    for the culler's, ``admin_shutdown_action`` for those of someone other than
    ``owner`` ("suspend" or "shutdown" each)."""

    def __init__(
        self,
        server: Any,
        manager: SnapshotManager,
        *,
        cull_action: str,
        admin_shutdown_action: str,
        owner: str,
    ) -> None:
        self.kernel_manager = server.kernel_manager
        self.session_manager = server.session_manager
        self.manager = manager
        self.cull_action = cull_action
        self.admin_shutdown_action = admin_shutdown_action
        self.owner = owner
        self.names_users = type(server.identity_provider) not in ANONYMOUS_LOGINS
        #: Kernels whose shutdown (or restart) runs now, until the dumps it released are
        #: removed: the culler leaves them alone.
        #: Its status read fails while the wrapper ends, which would decide "shutdown",
        #: and a second shutdown beside the first makes jupyter_client take the kernel
        #: for gone before its wrapper has ended (and released its suspended dump).
        self.ending_now: Counter[str] = Counter()
        if admin_shutdown_action == "suspend" and not self.names_users:
            log.warning(
                "kernel snapshots: admin_shutdown_action 'suspend' has no effect: this "
                "server's login (%s, jupyter_server's token or password login) does not tell "
                "users apart, so every shutdown counts as its owner's. It is meant for "
                "JupyterHub, or an identity provider that names users.",
                type(server.identity_provider).__name__,
            )

    def install(self) -> None:
        """Wrap the kernel manager's ``cull_kernel_if_idle``, ``shutdown_kernel``,
        ``restart_kernel`` and ``shutdown_all``, and the session manager's
        ``delete_session``, on the instances."""
        km, sm = self.kernel_manager, self.session_manager
        cull: Callable[[str], Awaitable[None]] = km.cull_kernel_if_idle
        shutdown: Callable[..., Awaitable[None]] = km.shutdown_kernel
        restart: Callable[..., Awaitable[Any]] = km.restart_kernel
        shutdown_all: Callable[..., Awaitable[None]] = km.shutdown_all
        delete_session: Callable[[str], Awaitable[None]] = sm.delete_session

        async def cull_kernel_if_idle(kernel_id: str) -> None:
            if kernel_id in self.ending_now:
                return
            if self.cull_action != "suspend":
                await cull(kernel_id)
                return
            action = culled(await self._kernel(kernel_id), "culler")
            if action == "leave":
                return
            token = _ENDING.set(Ending(action, "culled", "cull"))
            try:
                await cull(kernel_id)
            finally:
                _ENDING.reset(token)

        async def shutdown_kernel(kernel_id: str, now: bool = False, restart: bool = False) -> None:
            ending = _ENDING.get()
            if ending is not None and ending.trigger == "cull" and kernel_id in self.ending_now:
                return  # shut down meanwhile, while the culler read its status
            requester = None if restart or ending is not None else self._other_requester()
            if requester is not None:
                ending = await self._decide(kernel_id, requester)
            if ending is not None and not restart and await self._kept(kernel_id, ending):
                return
            if ending is not None and kernel_id in self.ending_now:
                return  # a shutdown asked meanwhile (while the suspend ran) ends it: once
            self.ending_now[kernel_id] += 1
            try:
                await shutdown(kernel_id, now=now, restart=restart)
            finally:
                try:
                    await self.manager.remove_released_suspends()
                finally:
                    self.ending_now -= Counter([kernel_id])

        async def restart_kernel(kernel_id: str, now: bool = False) -> Any:
            # The old wrapper ends (a suspended one let go of its dump), a new one starts.
            self.ending_now[kernel_id] += 1
            try:
                return await restart(kernel_id, now=now)
            finally:
                try:
                    await self.manager.remove_released_suspends()
                finally:
                    self.ending_now -= Counter([kernel_id])

        async def shutdown_all_kernels(now: bool = False) -> None:
            # A kernel jupyter_client is starting again (after a death) has a pending
            # ``ready``, which its shutdown_all reads (InvalidStateError): let it start first.
            starting = [
                ready
                for kernel_id in km.list_kernel_ids()
                if isinstance(
                    ready := getattr(km.get_kernel(kernel_id), "ready", None), asyncio.Future
                )
                and not ready.done()
            ]
            if starting:
                await asyncio.wait(starting, timeout=RESTART_WAIT_SECONDS)
            try:
                await shutdown_all(now=now)
            finally:
                await self.manager.remove_released_suspends()

        async def delete_session_kept(session_id: str) -> None:
            token = None
            requester = None if _ENDING.get() is not None else self._other_requester()
            if requester is not None:
                kernel_id = (await sm.get_session(session_id=session_id))["kernel"]["id"]
                ending = await self._decide(kernel_id, requester)
                if await self._kept(kernel_id, ending):
                    return  # the session stays, with its kernel
                # Decided: the kernel's shutdown within the deletion just shuts it down.
                token = _ENDING.set(Ending("shutdown", ending.why, ending.trigger))
            try:
                await delete_session(session_id)
            finally:
                if token is not None:
                    _ENDING.reset(token)

        km.cull_kernel_if_idle = cull_kernel_if_idle
        km.shutdown_kernel = shutdown_kernel
        km.restart_kernel = restart_kernel
        km.shutdown_all = shutdown_all_kernels
        sm.delete_session = delete_session_kept

    def _other_requester(self) -> str | None:
        """The name of who asks, in a DELETE request, to end a kernel, if that is someone
        other than the server's owner and ``admin_shutdown_action`` is "suspend"; else
        None. (The request's method tells a kernel's or session's DELETE from a server's
        stop, a restart, a kernel changed in a session.)"""
        if self.admin_shutdown_action != "suspend" or not self.names_users:
            return None
        handler = CallContext.get(CallContext.JUPYTER_HANDLER)
        if handler is None or handler.request.method != "DELETE":
            return None
        user = handler.current_user
        if not isinstance(user, User) or is_owner(user, self.owner):
            return None
        return user.username

    async def _decide(self, kernel_id: str, requester: str) -> Ending:
        """The shutdown of the kernel that ``requester`` (not its owner) asks for, decided."""
        action = culled(await self._kernel(kernel_id), "other")
        return Ending(action, f"shut down by {requester}", "admin-shutdown")

    async def _kernel(self, kernel_id: str) -> Kernel:
        """What a decision knows of the kernel: its status, read once (without its GPU
        accounting), and whether a job of this server runs on it."""
        status = await self.manager.server_kernels.status(kernel_id)
        return Kernel(kernel_id, status, has_job=self.manager.jobs.has_job(kernel_id))

    async def _kept(self, kernel_id: str, ending: Ending) -> bool:
        """Carry out a decided shutdown; whether the kernel stays (True: suspended, or
        left as it is) or is to be shut down now. A kernel that cannot be suspended (busy)
        is snapshotted first; one left without a snapshot is said in the log and an
        "unsaved" event, as at a server's stop, unless a shutdown someone asked for ends it
        meanwhile (the suspend failed because of it)."""
        if ending.action in ("leave", "shutdown"):
            return ending.action == "leave"
        reason = "it was running a cell"
        if ending.action == "suspend":
            failed = await self._job(kernel_id, self.manager.kernel_jobs.suspend, ending.trigger)
            if failed is None or await self._suspended_nonetheless(kernel_id):
                # Suspended (if its upload failed, its dump stays and is retried).
                log.info(
                    "kernel %s (%s) is suspended; its next cell brings it back",
                    kernel_id,
                    ending.why,
                )
                return True
            reason = failed
        if kernel_id in self.ending_now:
            log.info(
                "kernel %s (%s) is shut down as asked meanwhile (not suspended: %s)",
                kernel_id,
                ending.why,
                reason,
            )
            return False
        failed = await self._job(kernel_id, self.manager.kernel_jobs.snapshot, ending.trigger)
        if failed is None:
            log.info(
                "kernel %s (%s; not suspended: %s) snapshotted, shut down",
                kernel_id,
                ending.why,
                reason,
            )
            return False
        reason = f"it could not be suspended ({reason}) nor snapshotted ({failed})"
        log.warning(
            "kernel %s (%s) is shut down without a snapshot: %s", kernel_id, ending.why, reason
        )
        self.manager.emit(
            "unsaved", {"kernel_id": kernel_id, "trigger": ending.trigger, "message": reason}
        )
        return False

    async def _suspended_nonetheless(self, kernel_id: str) -> bool:
        """After a failed suspend: whether the kernel is suspended all the same (its dump
        made, what came after failed), the only case in which its status is read again."""
        status = (await self._kernel(kernel_id)).status
        return status is not None and status["state"] == "suspended"

    async def _job(self, kernel_id: str, start: Callable[..., Job], trigger: str) -> str | None:
        """Run a suspend or snapshot of the kernel (after any job running on it); None
        once it is done, else why not."""
        running = self.manager.jobs.on(kernel_id)
        if running is not None:
            await self.manager.jobs.wait(running)
        try:
            job = await self.manager.jobs.wait(start(kernel_id, trigger=trigger))
        except SnapshotError as exc:
            return exc.message
        if job.status == "done":
            return None
        return str((job.error or {}).get("message", "it did not finish"))
