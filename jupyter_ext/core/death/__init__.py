"""Why a kernel process died, in words: its exit status, and whether the out-of-memory
killer chose it (the kernel log where it is readable, the memory cgroup's ``oom_kill``
counter). No Jupyter imports: the wrapper tells its inner kernel's death with it, the
server a wrapper that died too.

- :mod:`.exit`: a process's exit status, also of one that is not our child (pidfd);
- :mod:`.oom`: the memory cgroup's kill counter and limit, the kernel log's kills;
- :mod:`.record`: :class:`Death`, what is known of one death, and its reason.
"""

from .exit import ExitWatch, exit_status_of
from .oom import KernelLogKill, MemoryCgroup, kernel_log_kills
from .record import Death, Witness

__all__ = [
    "Death",
    "ExitWatch",
    "KernelLogKill",
    "MemoryCgroup",
    "Witness",
    "exit_status_of",
    "kernel_log_kills",
]
