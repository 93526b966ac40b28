"""Reaping orphaned kernels (without root): their zombies keep the process ids a restored
copy needs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

from ..core import proctree


class Reaper:
    """Without root a restored kernel needs the process ids it had. A kernel whose wrapper
    was killed ends within a second, but its zombie keeps its id until its new parent reaps
    it: PID 1 may take long (or, in a container, never). So this server adopts orphans (a
    child subreaper) and reaps the kernel processes it has seen as they end (SIGCHLD)."""

    def __init__(self, enabled: bool | None = None) -> None:
        #: Adopt and reap orphaned kernels (default: without root).
        self.enabled = os.geteuid() != 0 if enabled is None else enabled
        self._on: asyncio.AbstractEventLoop | None = None
        self._kernel_pids: dict[int, str] = {}
        """Kernel processes seen, with their start times: reaped once their wrapper is
        gone."""

    def watch(self, pid: int) -> None:
        """Reap this kernel process once it is orphaned and ends."""
        if self.enabled and pid:
            self._kernel_pids.setdefault(pid, proctree.start_time(pid))

    def start(self) -> None:
        """From now until :meth:`stop`. Called when the server starts, and before a
        restore into a new kernel."""
        if not self.enabled:
            return
        loop = asyncio.get_running_loop()
        if self._on is not loop:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                if proctree.set_subreaper(True):
                    loop.add_signal_handler(signal.SIGCHLD, self.reap_now)
                    self._on = loop
        self.reap_now()

    def stop(self) -> None:
        """Orphans go to PID 1 again (nothing here would reap them once the loop ends)."""
        loop, self._on = self._on, None
        if loop is None:
            return
        proctree.set_subreaper(False)
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(signal.SIGCHLD)
        self.reap_now()

    def reap_now(self) -> None:
        self._kernel_pids = {  # still those processes (a pid may be reused)
            pid: start
            for pid, start in self._kernel_pids.items()
            if start and proctree.start_time(pid) == start
        }
        for pid in proctree.reap_adopted(self._kernel_pids):
            self._kernel_pids.pop(pid, None)
