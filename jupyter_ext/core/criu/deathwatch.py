"""A dump whose process tree dies under it is ended, not waited for.

CRIU can wait for ever on a tree that dies while it seizes it. The kernel is the init of
its own PID namespace; when it is killed, its last thread to end waits in the kernel until
every task of the namespace is reaped (``zap_pid_ns_processes``), the threads CRIU traces
among them, which only CRIU can reap; CRIU meanwhile waits for that thread to stop
(``wait4`` after ``PTRACE_INTERRUPT`` in its seize), which it never does. Seen when a
kernel was killed (SIGKILL, as the out-of-memory killer sends) during a cell checkpoint:
the dump, the news of the kernel's death, and every dump waiting for a working directory
the kernel shared hung until the server killed the wrapper.

:class:`TreeDeathWatch` kills such a CRIU a moment after the tree's root has ended, unless
CRIU has written the dump's inventory (the last image, written before CRIU ends a
suspended tree itself, so a dump that ends its tree is never cut short). Killing it harms
nothing: the tree is dead, so no parasite is left in a process that runs on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from .. import proctree
from ..errors import DumpError

#: How often the watch looks at the tree's root.
WATCH_SECONDS = 0.05
#: How long CRIU gets to fail by itself once the root has ended (it does in well under a
#: second when it is not stuck).
DEATH_GRACE_SECONDS = 2.0
#: The image CRIU writes last in a dump or pre-dump (criu/cr-dump.c).
INVENTORY = "inventory.img"


def stopped_error(log_excerpt: str) -> DumpError:
    """The error of a dump whose CRIU the watch killed."""
    return DumpError(
        "CRIU was stopped: the processes it was dumping ended under it, and it waited on "
        "them (core/criu/deathwatch.py).",
        hint="Nothing was saved; the kernel's status says how it ended.",
        log_excerpt=log_excerpt,
    )


class TreeDeathWatch:
    """While in the ``with`` block: call ``kill`` (once) if the tree at ``root`` has ended
    for :data:`DEATH_GRACE_SECONDS` and ``images_dir`` holds no inventory yet."""

    def __init__(self, root: int, images_dir: Path, kill: Callable[[], None]) -> None:
        self.root = root
        self.inventory = images_dir / INVENTORY
        self.kill = kill
        self.killed = False
        """Whether the watch killed CRIU (the dump's error then says why)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="criu-death-watch", daemon=True)

    def __enter__(self) -> TreeDeathWatch:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        ended_at: float | None = None
        while not self._stop.wait(WATCH_SECONDS):
            if not proctree.has_ended(self.root) or self.inventory.exists():
                ended_at = None
                continue
            now = time.monotonic()
            ended_at = ended_at or now
            if now - ended_at >= DEATH_GRACE_SECONDS:
                self.killed = True
                self.kill()
                return
