"""What a failed dump leaves in the work directory, removed as soon as it has failed.

The wrapper dumps into ``<dest's folder>/.<dest name>.partial-<hex>`` and renames that to
``dest`` once sealed; when the dump fails it removes the partial folder itself. A wrapper
killed mid-dump removes nothing, and its folder held the kernel's size in images: the
manager, which chose ``dest``, removes it when the request fails (:func:`after_failed_dump`).
The names are unique to one request, so this never touches another dump. A full disk is
said as such, with where and how much the dump needed against what is free.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import time
from pathlib import Path

from . import proctree
from .errors import DumpError, SnapshotError, WrapperUnavailableError
from .fileio import try_lock_directory
from .humanize import human_bytes
from .manifest import MANIFEST_NAME, Manifest

log = logging.getLogger(__name__)

#: How CRIU (and strerror) word ENOSPC and EDQUOT in a log line.
DISK_FULL_WORDS = ("No space left", "Disk quota exceeded")
#: A wrapper that dropped the connection and still runs after this is alive, not dying.
WRAPPER_EXIT_SECONDS = 5.0


def partial_dirs(dest: Path) -> list[Path]:
    """The wrapper's unfinished dump folders for ``dest``."""
    return sorted(dest.parent.glob(f".{dest.name}.partial-*"))


def remove_now(path: Path, attempts: int = 100) -> bool:
    """Remove a folder that a CRIU left running by a killed wrapper may still be writing
    to: once the folder is gone, nothing can be created in it any more."""
    for _ in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            return True
    log.warning("could not remove %s: something keeps writing to it", path)
    return False


class DumpLock:
    """A lock file beside a dump's destination, held (flock) by this server process while
    its wrapper dumps there. After a crash of the server, the next start finds it unlocked
    and removes that dump's partial folders at once (:func:`remove_orphaned_dumps`); a
    server sharing the work directory holds its own, which are left alone."""

    def __init__(self, dest: Path) -> None:
        self.path = lock_path(dest)
        self._fd = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def release(self) -> None:
        if self._fd < 0:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = -1


def lock_path(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.lock"


def remove_orphaned_dumps(directory: Path) -> list[Path]:
    """Remove what dumps left in ``directory`` whose server process died (their lock is
    free): partial folders, and the lock. Returns what was removed."""
    removed: list[Path] = []
    for lock in sorted(directory.glob(".*.lock")):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # released meanwhile
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    continue  # a live server's dump
                raise
            dest = directory / lock.name[1 : -len(".lock")]
            leftovers = partial_dirs(dest)
            if dest.is_dir() and not (dest / MANIFEST_NAME).is_file():
                leftovers.append(dest)
            for path in leftovers:
                if remove_now(path):
                    removed.append(path)
            lock.unlink(missing_ok=True)
        finally:
            os.close(fd)
    return removed


def remove_unlocked(directory: Path, *, sealed_only: bool = False) -> list[Path]:
    """Remove the folders in ``directory`` that no live process holds locked (downloads
    and restore copies of a server that died; with ``sealed_only`` the sealed dumps of
    suspended kernels whose wrapper ended, never a dump still being written: its partial
    folder, or its :class:`DumpLock` held). Returns what was removed."""
    removed = []
    for entry in sorted(directory.iterdir()):
        if not entry.is_dir() or entry.is_symlink():
            continue
        if sealed_only and entry.name.startswith("."):
            continue
        try:
            fd = try_lock_directory(entry)
        except FileNotFoundError:
            continue
        if fd is None:
            continue  # in use
        try:
            if sealed_only and _dump_locked(entry):
                continue  # sealed a moment ago: its wrapper takes it next
            if remove_now(entry):
                removed.append(entry)
        finally:
            os.close(fd)
    return removed


def _dump_locked(dest: Path) -> bool:
    """Whether a live server's :class:`DumpLock` on ``dest`` is held (its request runs)."""
    try:
        fd = os.open(lock_path(dest), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)
    return False


def after_failed_dump(exc: SnapshotError, dest: Path, wrapper_pid: int | None) -> Manifest:
    """Clean up after a snapshot or suspend request to the wrapper that failed with ``exc``.

    Returns the snapshot at ``dest`` when the wrapper sealed it before it died (it is the
    kernel's only copy after a suspend); otherwise removes what the dump wrote and raises
    the error, said more plainly for a full disk. While a wrapper that dropped the
    connection still runs, its dump may still write: it cleans up itself then.
    """
    leftovers = partial_dirs(dest)
    if isinstance(exc, WrapperUnavailableError):
        if wrapper_pid is not None and not _ends(wrapper_pid):
            raise exc
        if (dest / MANIFEST_NAME).is_file():
            try:
                manifest = Manifest.read(dest)
            except SnapshotError as unreadable:
                log.warning("removing %s, its manifest is unusable: %s", dest, unreadable)
                leftovers.append(dest)
            else:
                log.warning("the wrapper ended after sealing snapshot %s: kept", manifest.id)
                return manifest
    if not (dest / MANIFEST_NAME).is_file():
        leftovers.append(dest)
    for path in leftovers:
        if os.path.lexists(path) and remove_now(path):
            log.info("removed %s, left by the failed dump", path)
    raise disk_full_dump_error(exc, dest.parent, wrapper_pid) or exc


def _ends(pid: int, within: float = WRAPPER_EXIT_SECONDS) -> bool:
    """Whether ``pid`` is gone or goes within a few seconds: a killed process closes its
    sockets (the manager sees the connection end) a moment before it is a zombie."""
    deadline = time.monotonic() + within
    while proctree.is_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def is_disk_full(exc: SnapshotError) -> bool:
    text = f"{exc.message}\n{exc.log_excerpt}"
    return any(words.lower() in text.lower() for words in DISK_FULL_WORDS)


def kernel_memory_bytes(wrapper_pid: int) -> int:
    """Resident memory of the processes below the wrapper (the kernel): about what a dump
    of it writes, before the store compresses it."""
    total = 0
    for pid in proctree.descendants(wrapper_pid)[1:]:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def disk_full_dump_error(
    exc: SnapshotError, where: Path, wrapper_pid: int | None
) -> DumpError | None:
    """``exc`` said plainly when its CRIU log says the disk was full, else None."""
    if not isinstance(exc, DumpError) or not is_disk_full(exc):
        return None
    try:
        usage = shutil.disk_usage(where)
        free = f"{human_bytes(usage.free)} of {human_bytes(usage.total)} are free"
    except OSError:
        free = "its free space could not be read"
    needed = kernel_memory_bytes(wrapper_pid) if wrapper_pid is not None else 0
    need = (
        f"the dump needs about {human_bytes(needed)} (the kernel's memory)"
        if needed
        else "the dump needs about as much as the kernel's memory"
    )
    return DumpError(
        f"The disk of the work directory {where} is full (no space left on device): "
        f"{need}, and {free}. {exc.message}",
        hint="Free space on that disk, or set the work directory (work_dir) to a disk with "
        "room for the kernel's memory; then retry.",
        log_excerpt=exc.log_excerpt,
    )
