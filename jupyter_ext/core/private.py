"""Owner-only files and directories, whatever the umask.

A snapshot is a kernel's whole memory: every secret, token and dataset the notebook
touched. So every directory the product makes (store, work directory, staging, image
cache, downloads, suspended kernels) is 0700 and every file 0600, or 0400 once read-only
(packs, sealed images), as jupyter_core's ``secure_write`` does for connection files.
Modes are given at creation (``mkdir``/``open`` with the mode: a umask only takes bits
away), never loosened afterwards, and :func:`tighten` mends what an older version left
open. A local store shared by a group is an explicit option (:data:`GROUP_SHARED`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple


@dataclass(frozen=True)
class Modes:
    """The permission bits of what the product creates in one tree."""

    directory: int
    file: int

    @property
    def read_only(self) -> int:
        return self.file & ~0o222

    @property
    def foreign(self) -> int:
        """The bits nobody but the owner (and, where shared, the group) may hold."""
        return 0o077 & ~self.directory


PRIVATE = Modes(directory=0o700, file=0o600)
"""The default: the owner alone (and root) can list, read or open anything."""
GROUP_SHARED = Modes(directory=0o2770, file=0o660)
"""A local store shared by the members of its directory's group (setgid directories keep
the group); others get nothing. Chosen with ``local_store_group_access``."""


def make_dirs(path: Path, modes: Modes = PRIVATE) -> Path:
    """``mkdir -p`` where every directory made gets ``modes.directory`` exactly (the
    ones that exist are left as they are: :func:`tighten` is for those)."""
    missing: list[Path] = []
    here = path
    while not here.is_dir():
        missing.append(here)
        if here.parent == here:
            break
        here = here.parent
    for directory in reversed(missing):
        try:
            # Never more open than the mode (a umask only takes bits away), so the chmod
            # after it (setgid, owner bits an odd umask took) opens no window.
            directory.mkdir(mode=modes.directory & 0o777)
        except FileExistsError:
            continue  # made meanwhile by another thread or process: theirs to set
        os.chmod(directory, modes.directory)
    return path


def link_tree(source: Path, dest: Path, modes: Modes = PRIVATE) -> Path:
    """A copy of ``source`` at ``dest`` made of hard links (no extra space, independent
    lifetimes), every directory made with ``modes.directory`` from the start:
    ``shutil.copytree`` makes them under the umask and sets their modes only at the end."""
    make_dirs(dest.parent, modes)
    for here, dirs, files in os.walk(source):
        target = dest / os.path.relpath(here, source)
        target.mkdir(mode=modes.directory & 0o777)
        os.chmod(target, modes.directory)
        links = [name for name in dirs if os.path.islink(os.path.join(here, name))]
        for name in [*files, *links]:  # a link is linked, never followed
            os.link(os.path.join(here, name), target / name, follow_symlinks=False)
    return dest


def create(path: Path, flags: int = os.O_WRONLY | os.O_EXCL, mode: int = PRIVATE.file) -> int:
    """Open a new file that only its owner can read (``O_CREAT`` with ``mode``); its fd."""
    return os.open(path, flags | os.O_CREAT | os.O_CLOEXEC, mode)


def write_file(path: Path, data: bytes | str, mode: int = PRIVATE.file) -> None:
    """Write ``path`` anew (truncating one that exists) with ``mode`` if it is created."""
    fd = create(path, os.O_WRONLY | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)


class Exposed(NamedTuple):
    """A path whose mode lets others in: what :func:`tighten` changed, or would."""

    path: Path
    mode: int
    tightened: int

    def describe(self) -> str:
        return f"{self.path} ({self.mode:04o} -> {self.tightened:04o})"


def exposed(root: Path, modes: Modes = PRIVATE, *, recursive: bool = True) -> Iterator[Exposed]:
    """Everything under ``root`` (itself included, links not followed) whose mode gives
    others more than ``modes`` allows; unreadable parts are skipped."""
    if not root.exists():
        return
    stack = [root]
    while stack:
        path = stack.pop()
        try:
            st = path.lstat()
        except OSError:
            continue
        if stat.S_ISLNK(st.st_mode):
            continue
        mode = stat.S_IMODE(st.st_mode)
        if mode & modes.foreign:
            yield Exposed(path, mode, mode & ~modes.foreign)
        if recursive and stat.S_ISDIR(st.st_mode):
            with contextlib.suppress(OSError):
                stack.extend(path / name for name in os.listdir(path))


def tighten(root: Path, modes: Modes = PRIVATE, *, recursive: bool = True) -> list[Exposed]:
    """Take from everything under ``root`` (or ``root`` alone) the bits ``modes`` gives
    nobody else (an older version's store, a cache made under another umask); what was
    changed. Paths this user does not own are left (and stay in :func:`exposed`)."""
    changed = []
    for found in exposed(root, modes, recursive=recursive):
        try:
            os.chmod(found.path, found.tightened, follow_symlinks=False)
        except (NotImplementedError, OSError):
            continue
        changed.append(found)
    return changed


def others_can_replace(directory: Path) -> Path | None:
    """The first directory above ``directory`` that others may write to without the
    sticky bit (they could rename the product's directory away and put theirs there);
    None if there is none."""
    for parent in directory.resolve().parents:
        try:
            st = parent.stat()
        except OSError:
            continue
        if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
            return parent
    return None


_UCRED = struct.Struct("3i")  # pid, uid, gid


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected unix socket (the kernel
    says it: SO_PEERCRED, whatever the socket file's mode allowed)."""
    _pid, uid, _gid = _UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    )
    return int(uid)


def trusted_peer(sock: socket.socket) -> bool:
    """Whether the peer is this user (or root, who could read our memory anyway)."""
    return peer_uid(sock) in (os.geteuid(), 0)
