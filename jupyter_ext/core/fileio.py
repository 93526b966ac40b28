"""File I/O the store and the page server share (low: the store's layers and the
manager's both use it, and it uses nothing of theirs)."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """pwrite until all is written: a short write (a disk filling up) is followed by one
    that raises the error, rather than counted as done."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def fsync_dir(path: Path) -> None:
    """Make the names in directory ``path`` durable (a rename or link into it)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def lock_directory(path: Path, *, shared: bool = False) -> int:
    """An fd of the directory ``path`` holding its flock: a download or restore copy in
    use stays locked, so a clean-up can tell it from one a dead process left
    (:func:`~.leftovers.remove_unlocked`). ``shared``: a copy in use that others may use
    too (a restore reading it, the image cache leasing it); a clean-up needs it exclusive."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


def try_lock_directory(path: Path, *, shared: bool = False) -> int | None:
    """Like :func:`lock_directory`, or None at once if another process holds the lock
    (or the directory is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd
