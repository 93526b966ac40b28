"""A kernel's own ``/proc``: the mount namespace a kernel with its own PID namespace needs.

With root a kernel runs as PID 1 of its own PID namespace (restored copies of one
snapshot keep their process ids side by side). A ``/proc`` mounted for the host's PID
namespace then lies to it: ``/proc/<pid>`` names the host's process of that number, or
none. psutil (Dask's nanny, loky, ``import dask``) looks itself and its children up by
those numbers and fails by chance ("Nanny failed to start worker process"). So the kernel
gets a mount namespace of its own, a private copy of the server's, with a ``/proc`` of
its PID namespace (:func:`mount_own_proc`, run by the kernel as it starts).

CRIU then dumps that mount namespace. Every mount in it except the kernel's ``/proc`` is
the server's own, bind-mounted again on restore from the same path on the restoring
machine (``--external mnt[PATH]:PATH``, :func:`dump_keys`, :func:`restore_options`);
CRIU mounts a new ``/proc`` for the restored PID namespace itself. Namespace-file mounts
(``ip netns``'s ``/run/netns/*``) are detached in the kernel's copy first: they name
namespaces another node lacks, and CRIU cannot dump them. Files the kernel holds open
from the server's mount namespace (its runtime directory) are external files that CRIU
hands back with ``--inherit-fd``; its standard input is opened again inside.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

#: Filesystem types detached from a kernel's mount namespace (see the module docstring).
DETACHED_TYPES = frozenset({"nsfs"})
#: The filesystem type CRIU mounts anew on restore, for the restored PID namespace.
PROC_TYPE = "proc"

MNT_DETACH = 2
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_BIND = 0x1000
MS_REC = 0x4000


class MountPoint(NamedTuple):
    """One line of ``/proc/PID/mountinfo``: where, and what kind of filesystem."""

    path: str
    fstype: str


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_points(pid: int | str = "self") -> list[MountPoint]:
    """The mounts of ``pid``'s mount namespace, in mount order."""
    found = []
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        separator = fields.index("-")
        found.append(MountPoint(_unescape(fields[4]), fields[separator + 1]))
    return found


def own_mount_namespace(pid: int) -> bool:
    """Whether ``pid`` lives in a mount namespace other than ours."""
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino != os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return False


def external_mounts(pid: int) -> list[str]:
    """The mount points CRIU is to take as the server's own when it dumps ``pid``'s
    mount namespace: all but the kernel's ``/proc`` (CRIU mounts that anew). Each path
    once, in mount order; empty when ``pid`` shares our mount namespace."""
    if not own_mount_namespace(pid):
        return []
    paths: list[str] = []
    for mount in mount_points(pid):
        if mount.path == "/" or mount.path in paths:
            continue
        if mount.fstype == PROC_TYPE and (mount.path + "/").startswith("/proc/"):
            continue
        paths.append(mount.path)
    return paths


def dump_keys(paths: list[str]) -> list[str]:
    """``criu dump --external`` keys naming each mount point in ``paths`` external (the
    key is the path: the restore binds it from the same path)."""
    return [f"mnt[{path}]:{path}" for path in paths]


def restore_options(
    paths: list[str], substitute: Path, sources: Mapping[str, str] | None = None
) -> tuple[list[str], list[str]]:
    """``criu restore`` options binding each external mount point of the snapshot from
    the same path here, or from ``sources[path]`` where given (a copy's private view,
    core/isolation/privatetmp.py), and the paths this machine lacks: those are given
    ``substitute``, an empty directory (a kernel that holds files there fails to restore,
    naming them). Empty when the snapshot has no mount namespace of its own."""
    if not paths:
        return [], []
    sources = sources or {}
    options = ["--root", "/"]
    missing = []
    for path in paths:
        source = sources.get(path, path)
        if not os.path.exists(source):
            missing.append(path)
            substitute.mkdir(mode=0o700, exist_ok=True)
            source = str(substitute)
        options += ["--external", f"mnt[{path}]:{source}"]
    return options, missing


def make_mount_points(paths: list[str]) -> list[Path]:
    """Make the directories of the snapshot's mount points this machine lacks (a container
    that was running when the kernel started and is gone now, a drive unplugged) and
    return them, outermost first. CRIU mounts each one on its path under the restored
    tree's root, the host's ``/``, so the path must exist there; what is mounted on it is
    :func:`restore_options`' empty directory. :func:`remove_mount_points` takes them away
    once CRIU is done."""
    made: list[Path] = []
    for path in paths:
        chain = []
        point = Path(path)
        while not os.path.lexists(point):
            chain.append(point)
            point = point.parent
        if not point.is_dir() or point.is_symlink():
            continue  # not ours to make: CRIU names it
        for directory in reversed(chain):
            directory.mkdir(mode=0o700)
            made.append(directory)
    return made


def remove_mount_points(made: list[Path]) -> None:
    """Remove what :func:`make_mount_points` made, innermost first. A directory still
    mounted on in the restored kernel's namespace goes too: the kernel's (empty) mount
    there is then detached, which it did not use."""
    for directory in reversed(made):
        with contextlib.suppress(OSError):
            directory.rmdir()


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    """mount(2); OSError naming both paths."""
    result = _libc().mount(
        source.encode(),
        target.encode(),
        fstype.encode() if fstype else None,
        flags,
        data.encode() if data else None,
    )
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def detach(target: str) -> None:
    """Lazily unmount ``target`` (``umount -l``); OSError if it cannot be."""
    if _libc().umount2(target.encode(), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount {target}: {os.strerror(err)}")


def detach_below(directory: Path) -> None:
    """Detach whatever is mounted at or below ``directory`` in our mount namespace (what a
    killed process left), deepest first."""
    prefix = str(directory).rstrip("/") + "/"
    for point in reversed(mount_points()):
        if (point.path + "/").startswith(prefix):
            with contextlib.suppress(OSError):
                detach(point.path)


def mount_own_proc() -> None:
    """Make this process's (private) mount namespace ready for CRIU, with a ``/proc`` of
    its PID namespace. Called by the kernel as PID 1, before it opens anything."""
    # Deepest first: a namespace file mounted below another is detached before it.
    for point in reversed(mount_points()):
        if point.fstype in DETACHED_TYPES:
            with contextlib.suppress(OSError):
                detach(point.path)
    # The server's /proc (with whatever is mounted below it) goes; ours takes its place.
    detach("/proc")
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    # Standard input was opened in the server's mount namespace: CRIU could not name it.
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
