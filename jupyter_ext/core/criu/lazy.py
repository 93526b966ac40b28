"""A lazy restore's pages on their way: CRIU's lazy-pages daemon and the page server that
answers it, from the daemon's start to the last page (``Criu.restore_lazy`` starts it)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import RestoreError
from ..humanize import human_bytes
from .log import log_excerpt

if TYPE_CHECKING:
    from ..lazypages import PageServer

#: How long CRIU's lazy-pages daemon may take to listen before a lazy restore gives up.
LAZY_DAEMON_START_SECONDS = 10.0
#: The lines of CRIU's lazy-pages log an error shows where the daemon said nothing wrong.
LOG_TAIL_LINES = 40
#: Why CRIU run as an ordinary user restores in full (in-pod mode without root, and the node
#: agent, which runs CRIU as the pod's user): its ``--unprivileged`` mode never probes
#: userfaultfd, so ``criu lazy-pages`` exits and ``criu check --feature uffd-noncoop``
#: fails, even with the ``CAP_SYS_PTRACE`` that lets the user open one (CRIU 4.2 and its
#: development branch of November 2025; tests/test_agent.py fails once a CRIU differs).
UNPRIVILEGED_NO_LAZY = (
    "CRIU has no lazy pages when it runs as an ordinary user (--unprivileged: it never "
    "probes userfaultfd, criu/kerndat.c kerndat_uffd)"
)


class LazyTransfer:
    """The pages of a lazily restored tree on their way: CRIU's lazy-pages daemon, and
    the :class:`PageServer` thread that answers it."""

    def __init__(
        self,
        server: PageServer,
        daemon: asyncio.subprocess.Process,
        sock: socket.socket,
        work_dir: Path,
    ) -> None:
        self.server = server
        self.daemon = daemon
        self.work_dir = work_dir
        self.started = time.monotonic()
        self.finished: float | None = None
        self.given_up = False
        """Ended on purpose before every page was in: the tree it filled in was replaced
        (its end, whatever the daemon says, is no failure)."""
        self._sock = sock
        loop = asyncio.get_running_loop()
        self.served: asyncio.Future[None] = loop.create_future()

        def serve() -> None:
            try:
                server.serve(sock)
            finally:
                loop.call_soon_threadsafe(self._set_served)

        self._thread = threading.Thread(target=serve, name="lazy-pages", daemon=True)
        self._thread.start()

    def _set_served(self) -> None:
        if not self.served.done():
            self.served.set_result(None)

    async def listening(self) -> None:
        """Wait until the daemon listens for ``criu restore --lazy-pages``."""
        socket_path = self.work_dir / "lazy-pages.socket"
        deadline = time.monotonic() + LAZY_DAEMON_START_SECONDS
        while not socket_path.exists():
            if self.daemon.returncode is not None or time.monotonic() > deadline:
                raise RestoreError(
                    "CRIU's lazy-pages daemon did not start.",
                    hint="Check 'jupyter snapshot doctor' (lazy restore), or set "
                    "SnapshotExtensionApp.lazy_restore = False.",
                    log_excerpt=log_excerpt(self.work_dir / "lazy-pages.log", ""),
                )
            await asyncio.sleep(0.005)

    async def wait(self) -> None:
        """Until every page is in place; raises (leaving the daemon waiting, so the tree
        stays frozen at its next missing page) when a page could not be served."""
        await asyncio.shield(self.served)
        if self.server.error is not None:
            raise self.server.error
        rc = await self.daemon.wait()
        self.finished = time.monotonic()
        if rc != 0:
            excerpt = log_excerpt(self.work_dir / "lazy-pages.log", "")
            raise RestoreError(
                f"CRIU's lazy-pages daemon failed (exit status {rc}) before every page of "
                "the kernel was in place.",
                hint="Read the CRIU log lines below; restore again, or set "
                "SnapshotExtensionApp.lazy_restore = False.",
                log_excerpt=excerpt,
            )

    def close(self) -> None:
        """End the transfer: the daemon ends when its page server goes away."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=10)
        self._sock.close()
        if self.daemon.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.daemon.kill()
        self.server.close()


def check_asked(server: PageServer, work_dir: Path) -> None:
    """Once CRIU's lazy-pages daemon (its log in ``work_dir``) ended well and the tree
    still runs: it asked ``server`` for a page, where the tree had memory to come. No
    restored kernel runs without touching its heap; a daemon that ended without asking
    would leave that memory as zeros (seen once on a loaded machine, not reproduced
    since): refused, with the end of CRIU's log."""
    expected = server.lazy_bytes
    if server.pages_served or not expected:
        return
    try:
        tail = (work_dir / "lazy-pages.log").read_text(errors="replace")
    except OSError as exc:
        tail = f"(no log: {exc.strerror})"
    raise RestoreError(
        "CRIU's lazy-pages daemon ended without asking for any of the kernel's memory "
        f"({human_bytes(expected)} of it was to come): the kernel would run on without it.",
        hint="Restore again; if this repeats, set SnapshotExtensionApp.lazy_restore = "
        "False and report the CRIU log below.",
        log_excerpt="\n".join(tail.splitlines()[-LOG_TAIL_LINES:]),
    )
