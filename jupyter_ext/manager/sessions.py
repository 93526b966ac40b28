"""Notebook sessions: which notebook a kernel runs for, and a restored kernel attached to
its notebook."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("jupyter_ext")


class Sessions:
    """The server's session manager, and the kernel manager to stop replaced kernels."""

    def __init__(self, session_manager: Any, kernel_manager: Any) -> None:
        self.session_manager = session_manager
        self.kernel_manager = kernel_manager

    async def notebook_path(self, kernel_id: str) -> str | None:
        with contextlib.suppress(Exception):
            for session in await self.session_manager.list_sessions():
                if session.get("kernel", {}).get("id") == kernel_id:
                    return str(session.get("path"))
        return None

    async def attach(
        self, kernel_id: str, path: str, session_id: str | None = None
    ) -> dict[str, Any]:
        """Point the notebook's session at the kernel: the session ``session_id`` (which
        takes ``path``), else the session at ``path``, else a new one.

        The kernel the session had is shut down unless another session uses it: after a
        kernel died, jupyter_server restarted an empty one under its id, which nothing
        would ever use or stop again.
        """
        sm = self.session_manager
        sessions = await sm.list_sessions()
        for session in sessions:
            if session["id"] == session_id or (session_id is None and session.get("path") == path):
                old = (session.get("kernel") or {}).get("id")
                await sm.update_session(session["id"], kernel_id=kernel_id, path=path)
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
