"""Restored kernels: started, attached to their notebook's session, and reaped once
orphaned."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
from pathlib import Path
from typing import Any

from ..core import private, proctree
from ..core.manifest import Manifest
from ..core.protocol import ENV_AWAIT_RESTORE, RestoreRequest, WrapperClient
from .base import Job, ManagerBase

log = logging.getLogger("jupyter_ext")


class RestoredKernels(ManagerBase):
    """Start a kernel that waits for a restore, attach it, and reap orphaned kernels."""

    def start_reaping(self) -> None:
        """Without root a restored kernel needs the process ids it had. A kernel whose
        wrapper was killed ends within a second, but its zombie keeps its id until its
        new parent reaps it: PID 1 may take long (or, in a container, never). So this
        server adopts orphans (a child subreaper) and reaps them as they end (SIGCHLD),
        from now until :meth:`stop_reaping`. Called when the server starts, and before a
        restore into a new kernel."""
        if not self.reaps_orphans:
            return
        loop = asyncio.get_running_loop()
        if self._reaping_on is not loop:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                if proctree.set_subreaper(True):
                    loop.add_signal_handler(signal.SIGCHLD, self._reap_now)
                    self._reaping_on = loop
        self._reap_now()

    def stop_reaping(self) -> None:
        """Orphans go to PID 1 again (nothing here would reap them once the loop ends)."""
        loop, self._reaping_on = self._reaping_on, None
        if loop is None:
            return
        proctree.set_subreaper(False)
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(signal.SIGCHLD)
        self._reap_now()

    def _reap_now(self) -> None:
        self._kernel_pids = {  # still those processes (a pid may be reused)
            pid: start
            for pid, start in self._kernel_pids.items()
            if start and proctree.start_time(pid) == start
        }
        for pid in proctree.reap_adopted(self._kernel_pids):
            self._kernel_pids.pop(pid, None)

    async def _start_restored_kernel(
        self, job: Job, manifest: Manifest, directory: Path, pages_from: str | None = None
    ) -> str:
        """Start a new kernel whose wrapper waits for a restore, and restore ``directory``
        into it over its control socket, like any other operation."""
        self.start_reaping()
        marker = self.work_dir / f"await-restore-{secrets.token_hex(8)}"
        private.write_file(marker, b"")
        notebook_dir = None
        if manifest.notebook_path:
            notebook_dir = str(Path(manifest.notebook_path).parent)
        env = {**os.environ, ENV_AWAIT_RESTORE: str(marker)}
        kernel_name = manifest.kernel_spec.get("name") or self.kernel_name
        try:
            kernel_id: str = await self.kernel_manager.start_kernel(
                kernel_name=kernel_name, path=notebook_dir, env=env
            )
            km = self.kernel(kernel_id)
            try:
                wrapper = await WrapperClient.when_up(Path(km.connection_file), km.is_alive)
                request = RestoreRequest(directory, verified=True, pages_from=pages_from)
                await wrapper.restore(request, self._wrapper_progress(job))
            except BaseException:
                with contextlib.suppress(Exception):
                    await self.kernel_manager.shutdown_kernel(kernel_id, now=True)
                raise
        finally:
            marker.unlink(missing_ok=True)  # the wrapper took it, unless it never came up
        self.wrapper(kernel_id)  # the server reaps the restored kernel once orphaned
        return kernel_id

    async def _attach(self, kernel_id: str, path: str) -> dict[str, Any]:
        """Point the notebook's session at the kernel (create the session if needed).

        The kernel the session had is shut down unless another session uses it: after a
        kernel died, jupyter_server restarted an empty one under its id, which nothing
        would ever use or stop again.
        """
        sm = self.session_manager
        sessions = await sm.list_sessions()
        for session in sessions:
            if session.get("path") == path:
                old = (session.get("kernel") or {}).get("id")
                await sm.update_session(session["id"], kernel_id=kernel_id)
                updated: dict[str, Any] = await sm.get_session(session_id=session["id"])
                others = [s for s in sessions if s["id"] != session["id"]]
                if old and old != kernel_id:
                    await self._shutdown_unused(old, others)
                return updated
        created: dict[str, Any] = await sm.create_session(
            path=path, name=Path(path).name, type="notebook", kernel_id=kernel_id
        )
        return created

    async def _shutdown_unused(self, kernel_id: str, sessions: list[dict[str, Any]]) -> None:
        """Shut a kernel down that no session in ``sessions`` uses any more."""
        if any((s.get("kernel") or {}).get("id") == kernel_id for s in sessions):
            return
        if kernel_id not in self.kernel_manager:
            return
        log.info("shutting down kernel %s: its notebook has the restored kernel now", kernel_id)
        try:
            await self.kernel_manager.shutdown_kernel(kernel_id)
        except Exception:  # the restore itself succeeded: say so, go on
            log.warning("could not shut down the replaced kernel %s", kernel_id, exc_info=True)
