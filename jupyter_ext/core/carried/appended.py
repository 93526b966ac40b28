"""Files the kernel's processes append to (logs), carried in the snapshot as they were.

Ray's raylet, GCS and workers, a logging ``FileHandler``, a ``print(file=open(.., "a"))``
keep log files open with ``O_APPEND`` and write to them after the snapshot. CRIU records
no size for a file open write-only with ``O_APPEND``, but it does for every other open
file, and Ray's log monitor holds the same logs open for reading: a restore then fails
("has bad size"), and on another node the logs do not exist at all. A read-only file the
kernel never wrote that changed is another matter: that refusal stays (core/compat.py).

So a file that a process of the tree holds open for appending is carried in the snapshot:
its bytes up to its size at the snapshot, copied while CRIU holds the tree frozen (the size
is CRIU's), and a restore puts it back as it was, on this node (lines written after the
snapshot are cut: the restored readers' offsets expect that size) or on another (the file
and its directories are made). What a restore made it removes again if it fails; lines it
cut are not put back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .netports import make_missing_dirs
from .shmfiles import copy_fd

#: Where the copies go inside a snapshot directory.
SNAPSHOT_DIR_NAME = "appended"


def appended(needed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries of ``proctree.needed_files`` that the tree appends to."""
    return [entry for entry in needed if entry.get("appended")]


@dataclass
class AppendedCopy:
    """Copies the appended files into ``dest`` (a :class:`shmfiles.FrozenStep`: the tree
    is frozen, so the sizes are those CRIU records); :attr:`records` for the manifest."""

    files: list[dict[str, Any]]
    """``needed_files`` entries, with the ``opener`` (``/proc/PID/fd/N``) to read each by."""
    dest: Path

    def __post_init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def copy(self) -> None:
        self.dest.mkdir(parents=True, exist_ok=True)
        for index, entry in enumerate(self.files):
            rel = f"{self.dest.name}/{index}"
            fd = os.open(str(entry["opener"]), os.O_RDONLY | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                with open(self.dest / str(index), "wb") as out:
                    copy_fd(fd, out.fileno(), st.st_size)
            finally:
                os.close(fd)
            self.records.append(
                {
                    "path": entry["path"],
                    "size": st.st_size,
                    "mode": st.st_mode & 0o7777,
                    "content": rel,
                }
            )


def put_back(records: list[dict[str, Any]], snapshot_dir: Path, made: list[Path]) -> None:
    """Make each appended file as it was at the snapshot: its directories where missing,
    its content, its size. What it makes is added to ``made`` (outermost first), for a
    failed restore to remove."""
    for record in records:
        path = Path(str(record["path"]))
        made += make_missing_dirs([str(path.parent)])
        mode = int(record["mode"])
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
            made.append(path)
        except FileExistsError:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.fchmod(fd, mode)  # not narrowed by the umask; CRIU checks it
            with open(snapshot_dir / str(record["content"]), "rb") as src:
                copy_fd(src.fileno(), fd, int(record["size"]))
            os.ftruncate(fd, int(record["size"]))
        finally:
            os.close(fd)
