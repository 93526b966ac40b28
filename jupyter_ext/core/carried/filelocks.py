"""File locks a restore would wait for: a snapshot's ``flock``/``fcntl`` locks held here.

CRIU takes a restored process's file locks again (``--file-locks``), blocking: if another
process holds a lock on the same file, ``criu restore`` waits for ever. A copy of a
snapshot restored beside a running kernel of the same snapshot meets exactly that when the
kernel locks files (Dask's workers lock their directories under ``dask-scratch-space``).
The restore checks first: locks in the kernel's temporary directory are the copy's own
in a private view of it (core/isolation/privatetmp.py); others it refuses, naming the file and the
process that holds it.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path

from ..manifest import IMAGES_DIR

#: CRIU's image of the tree's file locks (two magic words when there are none).
LOCKS_IMAGE = "filelocks.img"
_EMPTY_IMAGE = 8


def snapshot_locks_files(source: Path) -> bool:
    """Whether the snapshot in ``source`` holds any file lock."""
    try:
        return (source / IMAGES_DIR / LOCKS_IMAGE).stat().st_size > _EMPTY_IMAGE
    except OSError:
        return False


def _locks_here() -> dict[tuple[int, int, int], int]:
    """(major, minor, inode) -> pid of a process holding a lock on it, from /proc/locks."""
    held: dict[tuple[int, int, int], int] = {}
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return held
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->":
            continue  # "->": a process waiting for the lock, not holding it
        major, minor, inode = fields[5].split(":")
        held.setdefault((int(major, 16), int(minor, 16), int(inode)), int(fields[4]))
    return held


def locked_elsewhere(paths: Collection[str], ignore: Collection[int] = ()) -> list[tuple[str, int]]:
    """Which of ``paths`` a process here (not in ``ignore``) holds a lock on, and that
    process."""
    held = _locks_here()
    found: list[tuple[str, int]] = []
    for path in sorted(set(paths)):
        try:
            st = os.stat(path)
        except OSError:
            continue
        pid = held.get((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino))
        if pid is not None and pid not in ignore:
            found.append((path, pid))
    return found
