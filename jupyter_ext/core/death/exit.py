"""A process's exit status, also of one that is not our child.

The inner kernel with root is the first child of ``unshare --pid --fork`` (its
namespace's init), not the wrapper's: ``waitpid`` cannot see how it ended, and unshare
2.38 does not pass a child's signal on (it exits 1: "sigprocmask unblock failed"). Linux
>= 6.15 keeps a reaped task's exit status for whoever holds a pidfd of it
(``PIDFD_GET_INFO`` with ``PIDFD_INFO_EXIT``); elsewhere the status is unknown here and
the caller falls back on what it has (the launcher's exit code, the kernel log).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct

#: include/uapi/linux/pidfd.h: the first published struct pidfd_info (64 bytes).
PIDFD_INFO_SIZE = 64
PIDFD_INFO_EXIT = 1 << 3
PIDFD_GET_INFO = (3 << 30) | (PIDFD_INFO_SIZE << 16) | (0xFF << 8) | 11
#: The offset of ``exit_code`` (a wait status) in struct pidfd_info.
_EXIT_CODE_OFFSET = 60


def exit_status_of(pidfd: int) -> int | None:
    """The exit code of the reaped process ``pidfd`` refers to, as :class:`subprocess.Popen`
    gives it (the exit status, or minus the signal that ended it); None if the kernel
    keeps none (Linux < 6.15) or the process has not ended and been reaped yet."""
    buf = bytearray(PIDFD_INFO_SIZE)
    struct.pack_into("Q", buf, 0, PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(pidfd, PIDFD_GET_INFO, buf)
    except OSError:  # ENOTTY (older kernel), ESRCH (not reaped yet)
        return None
    (mask,) = struct.unpack_from("Q", buf, 0)
    if not mask & PIDFD_INFO_EXIT:
        return None
    (status,) = struct.unpack_from("i", buf, _EXIT_CODE_OFFSET)
    return os.waitstatus_to_exitcode(status)


class ExitWatch:
    """A pidfd held on a process from its start, to learn how it ended once it has."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: int | None = None
        with contextlib.suppress(OSError):
            self._fd = os.pidfd_open(pid)

    def exit_code(self) -> int | None:
        """As :func:`exit_status_of`; None without a pidfd."""
        return None if self._fd is None else exit_status_of(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
