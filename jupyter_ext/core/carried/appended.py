"""Files the kernel's processes append to (logs), carried in the snapshot as they were.

Ray's raylet, GCS and workers, a logging ``FileHandler``, a ``print(file=open(.., "a"))``
keep log files open with ``O_APPEND`` and write to them after the snapshot. CRIU records
no size for a file open write-only with ``O_APPEND``, but it does for every other open
file, and Ray's log monitor holds the same logs open for reading: a restore then fails
("has bad size"), and on another node the logs do not exist at all. A read-only file the
kernel never wrote that changed is another matter: that refusal stays (core/compat.py).

So a file that a process of the tree holds open for appending is carried in the snapshot:

- **At the dump** the tree is looked at before CRIU freezes it, and its descriptors again
  while it is frozen: a file opened for appending since (Ray starts workers as it likes,
  and a worker opens its log once it runs) is carried too. A file's size is recorded
  while CRIU holds the tree frozen (the size CRIU records), and its bytes up to that size
  are copied once the tree runs again: appends only add past it, so the freeze does not
  grow with the file. A file that a process of the tree also writes in place (without
  ``O_APPEND``) is copied while frozen, its start may change. A file larger than
  :data:`CARRY_MAX` is not carried (said in the wrapper's log): it must then be here at
  restore, as any other open file.
- **At a restore** a file that is missing (another node) is made again from the copy, with
  its directories. A file that is here stays as it is where CRIU records no size for it
  (every descriptor write-only with ``O_APPEND``: a logger's): what was written since the
  snapshot, by the kernel or by others, is kept, and the restored kernel appends after it.
  Where CRIU records its size (a descriptor reads it or writes it in place: Ray's log
  monitor) it is made as it was at the snapshot, lines written since cut, provided it is
  still the kernel's file (it and the copy agree as far as both go); else the restore is
  refused, naming it, before anything is ended.

What a restore made it removes again if it fails; lines it cut are not put back.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import proctree
from ..errors import IncompatibleSnapshotError, SnapshotError
from ..humanize import human_bytes
from .netports import make_missing_dirs
from .shmfiles import copy_fd

log = logging.getLogger(__name__)

#: Where the copies go inside a snapshot directory.
SNAPSHOT_DIR_NAME = "appended"

#: The largest file the kernel appends to that a snapshot carries: 1 GiB. (Copied after
#: the freeze, and stored in chunks that later snapshots share; a data file that large is
#: the user's to keep, not the snapshot's.)
CARRY_MAX = 1 << 30

#: The keys of a ``needed_files`` entry that are for the dump only.
DUMP_ONLY_KEYS = ("openers", "size_checked", "rewritten")


def appended(needed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries of ``proctree.needed_files`` that the tree appends to."""
    return [entry for entry in needed if entry.get("appended")]


@dataclass(frozen=True)
class LookedAt:
    """The tree as the dump looked at it, before the freeze."""

    root: int
    elsewhere: frozenset[str]
    """Paths the snapshot carries another way (the /dev/shm files the tree holds)."""


class AppendedCopy:
    """The appended files (``needed_files`` entries, each with the ``openers`` to read it
    by: opened here, before the freeze) copied into ``dest``: their sizes recorded while
    the tree is frozen (:meth:`copy`, a step of core/criu/frozen.py), their bytes up to
    those sizes once it runs again (:meth:`copy_after`); :attr:`records` for the manifest.

    A file whose every descriptor was closed since the tree was looked at (a Ray worker
    that ended, a handler closed) is no longer one the tree appends to: CRIU will not find
    it open, so it is left out. With ``looked_at``, the tree's descriptors are looked at
    again while it is frozen, and the files opened for appending since (by a Ray worker
    started since, or one that was starting) are added: else a restore where they are
    missing (another node) fails."""

    def __init__(
        self, files: list[dict[str, Any]], dest: Path, looked_at: LookedAt | None = None
    ) -> None:
        self.files: list[dict[str, Any]] = []
        self.dest = dest
        self.looked_at = looked_at
        self.records: list[dict[str, Any]] = []
        self._fds: list[int] = []
        for entry in files:
            try:
                fd = _open_any(entry)
            except OSError as exc:
                self.close()
                raise SnapshotError(
                    f"The file {entry['path']}, which the kernel appends to, cannot be read "
                    f"for the snapshot: {exc.strerror}.",
                    hint="Let this user read it (or close it in the kernel), then retry.",
                ) from exc
            if fd is None:
                log.info("%s is no longer open in the kernel: not carried", entry["path"])
                continue
            self.files.append(entry)
            self._fds.append(fd)

    def copy(self) -> None:
        """While CRIU holds the tree frozen: each file's size, and the bytes of those a
        process of the tree writes in place."""
        self._add_files_opened_since()
        self.dest.mkdir(parents=True, exist_ok=True)
        for index, (entry, fd) in enumerate(zip(self.files, self._fds, strict=True)):
            st = os.fstat(fd)
            carried = st.st_size <= CARRY_MAX
            record = {
                "path": entry["path"],
                "size": st.st_size,
                "mode": st.st_mode & 0o7777,
                "content": f"{self.dest.name}/{index}" if carried else None,
                "size_checked": bool(entry.get("size_checked", True)),
            }
            if carried and entry.get("rewritten"):
                self._copy(fd, record)
            self.records.append(record)

    def copy_after(self) -> None:
        """Once the tree runs again: the bytes up to each recorded size of the files only
        appended to. A file cut meanwhile (rotated by truncation) fails the snapshot."""
        for entry, fd, record in zip(self.files, self._fds, self.records, strict=True):
            if record["content"] is None:
                log.warning(
                    "%s, which the kernel appends to, is not carried in the snapshot (%s, "
                    "more than %s): a restore needs it here",
                    record["path"],
                    human_bytes(record["size"]),
                    human_bytes(CARRY_MAX),
                )
            elif not entry.get("rewritten"):
                self._copy(fd, record)
                if os.fstat(fd).st_size < record["size"]:
                    raise SnapshotError(
                        f"{record['path']}, which the kernel appends to, was cut while the "
                        "snapshot copied it.",
                        hint="Take the snapshot again.",
                    )

    def _add_files_opened_since(self) -> None:
        """While frozen: the files the tree appends to that it did not when it was looked
        at, each with the flags of every descriptor of the tree on it (a reader such as
        Ray's log monitor included). Only the descriptors are read again, and only a path
        not known then is looked at further: the freeze grows by a listing of each
        process's descriptors."""
        if self.looked_at is None:
            return
        known = {entry["path"] for entry in self.files} | self.looked_at.elsewhere
        pids = proctree.descendants(self.looked_at.root)
        for entry in appended(proctree.needed_files(pids, mapped=False, known=known)):
            fd = _open_any(entry)
            if fd is not None:
                log.info("%s: opened for appending since the look: carried", entry["path"])
                self.files.append(entry)
                self._fds.append(fd)

    def _copy(self, fd: int, record: dict[str, Any]) -> None:
        with open(self.dest.parent / str(record["content"]), "wb") as out:
            copy_fd(fd, out.fileno(), int(record["size"]))

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def _open_any(entry: dict[str, Any]) -> int | None:
    """The file, read through the first of its descriptors still open (None: none is).
    Through the descriptor, not the path: it is the file the kernel holds, even renamed."""
    for opener in entry["openers"]:
        try:
            return os.open(str(opener), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # the descriptor was closed, or its process ended
    return None


def problems(records: list[dict[str, Any]], snapshot_dir: Path) -> list[str]:
    """Why the appended files cannot be put back here, in words (empty: they can)."""
    return [problem for record in records if (problem := _problem(record, snapshot_dir))]


def _problem(record: dict[str, Any], snapshot_dir: Path) -> str:
    path, size, content = Path(str(record["path"])), int(record["size"]), record.get("content")
    try:
        here = os.stat(path).st_size
    except FileNotFoundError:
        if content is None:
            return (
                f"{path} does not exist (the kernel appended to it; at {human_bytes(size)} it "
                f"was not carried in the snapshot, which carries such files up to "
                f"{human_bytes(CARRY_MAX)})"
            )
        return ""
    if not record.get("size_checked", True):
        return ""  # left as it is
    if content is None:
        if here == size:
            return ""
        return (
            f"{path} has {here} bytes, expected {size} (the kernel appended to it and read it; "
            "it was too large to carry in the snapshot)"
        )
    if not _same_start(path, snapshot_dir / str(content), min(here, size)):
        return (
            f"{path} is not the file the kernel appended to: its start differs from the snapshot's"
        )
    return ""


def _same_start(path: Path, copy: Path, size: int) -> bool:
    """Whether the first ``size`` bytes of the two files are the same."""
    with open(path, "rb") as a, open(copy, "rb") as b:
        while size > 0:
            block = min(size, 1 << 20)
            if a.read(block) != b.read(block):
                return False
            size -= block
    return True


def put_back(records: list[dict[str, Any]], snapshot_dir: Path, made: list[Path]) -> None:
    """Make each appended file as the restore needs it (see the module's docstring): made
    again from the snapshot where missing (with its directories), cut or completed to its
    size at the snapshot where CRIU checks that size, else left as it is. What it makes is
    added to ``made`` (outermost first), for a failed restore to remove."""
    for record in records:
        problem = _problem(record, snapshot_dir)
        if problem:  # checked before, but the kernel a restore replaces ran on since
            raise IncompatibleSnapshotError(
                f"A file the kernel appended to cannot be put back: {problem}.",
                hint="Move that file aside (or put the kernel's back), then restore again.",
            )
        path, size = Path(str(record["path"])), int(record["size"])
        mode = int(record["mode"])
        try:
            here: int | None = os.stat(path).st_size
        except FileNotFoundError:
            here = None
        if here is not None and (not record.get("size_checked", True) or here == size):
            continue  # as it is
        made += make_missing_dirs([str(path.parent)])
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
            made.append(path)
            os.fchmod(fd, mode)  # not narrowed by the umask; CRIU checks it
        except FileExistsError:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            if here is None or here < size:
                with open(snapshot_dir / str(record["content"]), "rb") as src:
                    copy_fd(src.fileno(), fd, size)
            else:
                log.warning(
                    "%s: %d bytes written since the snapshot cut (CRIU needs its size then)",
                    path,
                    here - size,
                )
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
