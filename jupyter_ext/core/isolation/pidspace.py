"""Process ids for kernels without a PID namespace, taken where a fresh pod leaves them free.

Without root a kernel has no PID namespace of its own (docs/nonroot.md): CRIU restores it
with the process and thread ids it had, and they must be free where it is restored. A
container (a Zero to JupyterHub pod) numbers its processes from 1, and its start takes the
same low ids every time: the server and its threads, the kernel's wrapper, CRIU. A kernel
that got its ids while its pod was young finds them taken in the fresh pod it is restored
into after a node loss.

So before a wrapper starts a kernel in a PID namespace whose counter is still below
``floor``, it moves the counter past ``floor`` plus a random gap (kernels started in
different pods' youth then spread out): it starts and joins short-lived threads, each of
which takes the next id (about 70 us each here; 4096 + up to 4096 of them: 0.3-0.6 s,
once per pod). A restore in the fresh pod finds the ids from there up free: the fresh
pod's counter is still low. Machines whose counter has long passed ``floor`` (a host, an
old pod) are left alone.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

LAST_PID = Path("/proc/sys/kernel/ns_last_pid")
PID_MAX = Path("/proc/sys/kernel/pid_max")
PID_FLOOR = 4096
"""Above what a fresh pod's own start takes (a few hundred ids at most)."""
PID_SPREAD = 4096
"""The random gap above the floor."""


def last_pid() -> int | None:
    """The id this PID namespace handed out last; None where /proc does not say."""
    try:
        return int(LAST_PID.read_text())
    except (OSError, ValueError):
        return None


def skip_low_pids(
    floor: int = PID_FLOOR, spread: int = PID_SPREAD, rng: random.Random | None = None
) -> int:
    """Move this PID namespace's counter past ``floor`` plus a random gap below ``spread``
    if it is below ``floor``; returns how many ids were taken (0: nothing to do)."""
    start = last_pid()
    if start is None or floor <= 0 or start >= floor:
        return 0
    try:
        pid_max = int(PID_MAX.read_text())
    except (OSError, ValueError):
        return 0
    target = floor + (rng or random.SystemRandom()).randrange(max(spread, 1))
    target = min(target, pid_max // 2)  # never near the wrap-around
    current = start
    while current < target:
        for _ in range(min(target - current, 256)):
            thread = threading.Thread(target=int, name="skip-low-pids")
            thread.start()
            thread.join()
        now = last_pid()
        if now is None or now < current:  # wrapped around, or /proc went away
            break
        current = now
    return current - start
