"""A private temporary directory for a copy restored beside a running kernel.

As root a kernel binds its temporary directory (``/tmp``, or ``$TMPDIR``) onto itself as
it starts (:func:`bind_temp_dir`): the directory is then a mount point of its own in the
kernel's mount namespace, recorded in its snapshots (``Manifest.temp_dir``) and bound again
from the same path on restore (core/isolation/mountns.py), so the kernel sees the server's files
there as before.

A copy of a snapshot restored beside a running kernel of the same snapshot would share
that directory with it. Dask's workers lock their directories under
``dask-scratch-space``: CRIU's restore of those locks would wait for ever for the
original's, and both kernels' workers would spill into the same files. Such a copy, and
only such a copy, gets a :class:`PrivateTemp` there instead: an overlay whose lower layer
is the server's directory (every file in it stays visible to the copy, as it was at the
snapshot and as it changes), and whose upper layer, in the wrapper's runtime directory,
takes what the copy writes. An overlay's file is an inode of its own: the copy locks its
workers' directories apart from the original's, and what it writes there or deletes
never reaches the original. The overlay lives as long as the copy's mount namespace; the
upper layer is removed when the copy ends.

Empty files the kernel held open in its temporary directory (those lock files) that a
restore does not find (the cluster's shutdown removed them; another node never had them)
are made again, empty, as the kernel had them (:func:`make_missing_empty_files`), where
any other missing file refuses the restore (core/compat.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path

from .. import proctree
from ..errors import RestoreError
from .mountns import MS_BIND, MS_REC, detach, mount


def temp_dir() -> str:
    """The temporary directory of kernels started here (the wrapper's environment is
    theirs), its real path."""
    return os.path.realpath(tempfile.gettempdir())


def bound_temp_dir(mounts: list[str]) -> str:
    """The temporary directory if a kernel bound it onto itself (it is one of the
    ``mounts`` of its namespace), else ``""``."""
    temp = temp_dir()
    return temp if temp in mounts else ""


def bind_temp_dir() -> str | None:
    """Make the temporary directory a mount point of this (private) mount namespace: the
    same directory, bound onto itself. Called by the kernel as it starts, after
    mountns.mount_own_proc; the directory, or None if it cannot be (not a directory of
    its own)."""
    temp = temp_dir()
    if temp == "/" or not os.path.isdir(temp):
        return None
    try:
        mount(temp, temp, None, MS_BIND | MS_REC, None)
    except OSError:
        return None
    return temp


def overlay_supported() -> bool:
    """Whether this kernel mounts overlayfs (``/proc/filesystems``; a module not loaded
    yet is loaded by the first mount, so its presence counts too)."""
    try:
        if "\toverlay\n" in Path("/proc/filesystems").read_text():
            return True
    except OSError:
        return False
    release = os.uname().release
    return any(Path(f"/lib/modules/{release}/kernel/fs/overlayfs").glob("overlay.ko*"))


#: Dask's workers lock ``<dir>.dirlock`` for their directory ``<dir>`` (distributed's
#: ``WorkSpace``): a lock file made again gets its directory back too.
DIRLOCK_SUFFIX = ".dirlock"


def make_missing_empty_files(entries: list[dict[str, object]], directory: str) -> list[Path]:
    """Make the empty files the tree held open in its temporary ``directory`` that are
    absent here (a Dask cluster's lock files after its shutdown removed them, or on
    another node), with their parent directories and, for a Dask worker's lock, its
    (empty) directory; returns what was made, outermost first, so that a failed restore
    can remove it."""
    made: list[Path] = []
    for entry in entries:
        path = Path(str(entry["path"]))
        if not proctree.empty_open_file_in(entry, directory) or path.exists():
            continue
        for parent in reversed([p for p in path.parents if not p.exists()]):
            parent.mkdir(mode=0o700)
            made.append(parent)
        mode = entry.get("mode")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        made.append(path)
        os.fchmod(fd, mode if isinstance(mode, int) else 0o644)  # as it was; not the umask's
        os.close(fd)
        if path.name.endswith(DIRLOCK_SUFFIX):
            workdir = path.with_name(path.name.removesuffix(DIRLOCK_SUFFIX))
            if not workdir.exists():
                workdir.mkdir(mode=0o700)
                made.append(workdir)
    return made


class PrivateTemp:
    """An overlay of the server's ``lower`` directory for one copy (see the module
    docstring), in ``base``: ``source`` is what the copy's restore binds at ``lower``."""

    def __init__(self, lower: str, base: Path) -> None:
        self.lower = lower
        self.base = base
        self.source = base / "view"
        self._mounted = False

    @classmethod
    def create(cls, lower: str, parent: Path) -> PrivateTemp:
        """Mount the overlay in a new directory under ``parent`` (the wrapper's runtime
        directory). Where ``parent``'s file system cannot hold an overlay's upper layer (an
        overlay itself: a container's), the upper layer goes on a tmpfs mounted there."""
        view = cls(lower, Path(tempfile.mkdtemp(prefix="private-tmp-", dir=parent)))
        try:
            view.mount_overlay()
        except BaseException:
            view.close()
            raise
        return view

    def mount_overlay(self) -> None:
        """Mount the overlay at ``source``, its layers in ``base/layers`` (see create)."""
        layers = self.base / "layers"
        for attempt in ("in place", "on a tmpfs"):
            if attempt == "on a tmpfs":
                mount("tmpfs", str(layers), "tmpfs", 0, "mode=0700")
            upper, work = layers / "upper", layers / "work"
            for directory in (upper, work, self.source):
                directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            try:
                mount(
                    "overlay",
                    str(self.source),
                    "overlay",
                    0,
                    f"lowerdir={self.lower},upperdir={upper},workdir={work}",
                )
            except OSError as exc:
                if attempt == "in place" and exc.errno == errno.EINVAL:  # upper on overlayfs
                    shutil.rmtree(layers, ignore_errors=True)
                    layers.mkdir(mode=0o700)
                    continue
                raise RestoreError(
                    f"A private view of {self.lower} for the restored copy could not be "
                    f"made: {exc}.",
                    hint="This needs root and overlayfs (modprobe overlay); or end the "
                    "kernel the copy would run beside, then restore again.",
                ) from exc
            self._mounted = True
            return

    def detach(self) -> None:
        """Once the copy's restore has bound it: its mount namespace keeps the overlay,
        the server's needs it no longer."""
        if self._mounted:
            with contextlib.suppress(OSError):
                detach(str(self.source))
            self._mounted = False

    def close(self) -> None:
        """The copy ended (or never ran): the overlay and what the copy wrote go."""
        self.detach()
        with contextlib.suppress(OSError):  # its tmpfs, if it has one
            detach(str(self.base / "layers"))
        shutil.rmtree(self.base, ignore_errors=True)
