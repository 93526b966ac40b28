"""The dumped tree's working directories, locked while CRIU's parasite works in them."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import logging
import os
from collections.abc import AsyncIterator

from .. import proctree

log = logging.getLogger(__name__)

#: What CRIU's parasite creates, and mounts a private /proc on, in the working directory of
#: each dumped task whose /proc belongs to another PID namespace (criu/pie/parasite.c).
PARASITE_PROC_DIR = "proc.crtools"


#: How often a dump waiting for another one to leave a shared directory looks again.
LOCK_POLL_SECONDS = 0.01


MNT_DETACH = 2


@contextlib.asynccontextmanager
async def working_directories_locked(pid: int) -> AsyncIterator[None]:
    """Hold an exclusive lock on every working directory of the tree at ``pid`` while it is
    dumped, and clear what an interrupted dump left in them.

    The kernel lives in its own PID namespace, so /proc is not its own: CRIU's parasite
    then makes ``proc.crtools`` in the task's working directory to mount a private /proc
    there. Two dumps of kernels sharing a directory (a notebook folder) collide on that
    name ("Can't create a directory (-17)", "can't get /proc fd") and one fails. Every dump
    of this product takes the directory's lock (flock on the directory itself, so also
    between servers and users sharing it); the others wait a moment, unfrozen. A
    ``proc.crtools`` found while the lock is held was left by a dump that was killed.
    """
    held: list[int] = []
    seen: set[tuple[int, int]] = set()
    try:
        for task in proctree.descendants(pid):
            try:
                fd = os.open(f"/proc/{task}/cwd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                continue  # gone, or not ours to open: CRIU reports what it cannot do
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) in seen:
                os.close(fd)
                continue
            seen.add((st.st_dev, st.st_ino))
            held.append(fd)
        # One order for every dumper, so two trees sharing two directories cannot deadlock.
        held.sort(key=lambda fd: (os.fstat(fd).st_dev, os.fstat(fd).st_ino))
        for fd in held:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await asyncio.sleep(LOCK_POLL_SECONDS)
            _remove_stale_parasite_dir(fd)
        yield
    finally:
        for fd in held:
            os.close(fd)  # closing releases the lock


def _remove_stale_parasite_dir(dir_fd: int) -> None:
    """Remove the ``proc.crtools`` a killed dump left in a directory we hold locked."""
    try:
        os.rmdir(PARASITE_PROC_DIR, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            log.warning("cannot remove a stale %s: %s", PARASITE_PROC_DIR, exc)
            return
        # Still a mount point (the dump died between mount and unmount): detach it first.
        target = f"/proc/self/fd/{dir_fd}/{PARASITE_PROC_DIR}".encode()
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.umount2(target, MNT_DETACH) != 0:
            log.warning("cannot unmount a stale %s: errno %d", target, ctypes.get_errno())
            return
        with contextlib.suppress(OSError):
            os.rmdir(PARASITE_PROC_DIR, dir_fd=dir_fd)
    log.info("removed a %s left by an interrupted dump", PARASITE_PROC_DIR)
