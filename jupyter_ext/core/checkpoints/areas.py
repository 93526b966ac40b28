"""Where cell checkpoints lie: one area per kernel wrapper under the server's
``<work_dir>/checkpoints``, gone with the wrapper.

Layout::

    <root>/<name>.lock        flock held by the wrapper for its whole life
    <root>/<name>/            its area
        <hex>/                a sealed checkpoint (a snapshot directory; the wrapper
                              knows which snapshot id each holds)
        .<hex>.partial-<hex>/ a dump under way (kernel_wrapper/dump.py's staging)

A wrapper makes its lock file first and holds it, then its area; it removes the area,
then the lock file, when it ends. One killed leaves both: the server removes every area
whose lock file it can lock, or that has none (:meth:`CheckpointAreas.sweep`, at start
and every policy tick), so a killed kernel's checkpoints do not outlive it. A take-back
of variables reads a checkpoint under a shared flock on its directory
(:meth:`CheckpointAreas.hold`), which the wrapper's removal of old checkpoints respects.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from pathlib import Path

from .. import private
from ..fileio import try_lock_directory
from ..leftovers import remove_now

LOCK_SUFFIX = ".lock"


class Area:
    """A wrapper's checkpoint area, held while it is open."""

    def __init__(self, path: Path, lock_fd: int) -> None:
        self.path = path
        self._lock_fd = lock_fd

    def new_dir(self) -> Path:
        """A name for a new checkpoint's directory (not made: the dump makes it)."""
        return self.path / secrets.token_hex(16)

    def remove(self, directory: Path) -> bool:
        """Remove a checkpoint's directory unless a take-back holds it (False then)."""
        fd = try_lock_directory(directory)
        if fd is None:
            return not directory.exists()
        try:
            return remove_now(directory)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Remove the area, then its lock file (the wrapper ends)."""
        if self._lock_fd < 0:
            return
        try:
            remove_now(self.path)
            self.path.with_name(self.path.name + LOCK_SUFFIX).unlink(missing_ok=True)
        finally:
            os.close(self._lock_fd)
            self._lock_fd = -1


class CheckpointAreas:
    """The areas under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def create(self, name: str) -> Area:
        """A new area for a wrapper (``name`` says whose: the kernel id, with a random
        suffix), its lock held."""
        private.make_dirs(self.root)
        for _attempt in range(10):
            unique = f"{name}-{secrets.token_hex(3)}"
            lock_path = self.root / (unique + LOCK_SUFFIX)
            fd = os.open(lock_path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            # A sweep that locked it first has removed it: try another name.
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(fd), os.stat(lock_path)):
                    path = self.root / unique
                    private.make_dirs(path)
                    return Area(path, fd)
            os.close(fd)
        raise OSError(f"no checkpoint area could be made in {self.root}")

    def sweep(self) -> list[Path]:
        """Remove the areas whose wrapper is gone; what was removed."""
        if not self.root.is_dir():
            return []
        removed: list[Path] = []
        for entry in sorted(self.root.iterdir()):
            if entry.name.endswith(LOCK_SUFFIX) and entry.is_file():
                area = entry.with_name(entry.name[: -len(LOCK_SUFFIX)])
                if self._remove_if_free(entry, area):
                    removed.append(area)
            elif (
                entry.is_dir()
                and not entry.with_name(entry.name + LOCK_SUFFIX).exists()
                and remove_now(entry)  # its lock file is gone: a removal cut short
            ):
                removed.append(entry)
        return removed

    @staticmethod
    def _remove_if_free(lock_path: Path, area: Path) -> bool:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # its wrapper lives
            remove_now(area)
            lock_path.unlink(missing_ok=True)
            return True
        finally:
            os.close(fd)

    def inside(self, directory: Path) -> bool:
        """Whether ``directory`` is a checkpoint of an area here (as a wrapper names it)."""
        try:
            rel = directory.resolve().relative_to(self.root.resolve())
        except (OSError, ValueError):
            return False
        return len(rel.parts) == 2 and not rel.parts[1].startswith(".")

    def hold(self, directory: Path) -> int | None:
        """A shared flock on a checkpoint's directory (its wrapper does not remove it
        while held): the fd to close once done, or None if it is gone or being removed."""
        if not self.inside(directory):
            return None
        return try_lock_directory(directory, shared=True)
