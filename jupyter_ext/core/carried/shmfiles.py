"""POSIX shared memory and named semaphores (``/dev/shm``) carried in the snapshot.

``sem_open`` (multiprocessing locks of the spawn and forkserver start methods, joblib's
loky, Dask's process workers) creates ``/dev/shm/sem.XXXXXX``, maps it, links it to its
final name and unlinks the first one: the kernel maps a file whose mapped path is gone
while the file still has a name. CRIU then wants ``--link-remap``, which only works on the
machine of the dump and only while the remap link lives; on another node the file does
not exist at all. ``shm_open`` (``multiprocessing.shared_memory``) files hold the data
itself, in a file no other node has.

So every ``/dev/shm`` file that has a name and that the tree maps or holds open is a CRIU
*external* file (unlinked ones CRIU saves itself, as before: a fork context's semaphores,
PyTorch's shared tensors, up to CRIU's ghost-file limit): the dump does not look at its
path, and :class:`ShmCopy` copies its bytes into the snapshot while CRIU holds the tree
frozen (core/criu/frozen.py), so the copy matches the memory image (a lock held is held,
counts are kept). A restore recreates each file (:func:`recreate`), under its name when
that is free, else (another restored copy of the snapshot runs here) as a private
unlinked file that nothing else sees, and hands it to ``criu restore --inherit-fd``. Such
a private file lies on the server's ``/dev/shm`` mount, which a kernel with a mount
namespace of its own does not have: its next dump takes it over too, like a named file
(CRIU could not save it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import proctree
from ..criu import external_file_key

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
#: Where the copies go inside a snapshot directory.
SNAPSHOT_DIR_NAME = "shm"


@dataclass
class HeldFile:
    """A ``/dev/shm`` file of the tree, open here (``fd``) so it can be copied later."""

    fd: int
    key: str
    """CRIU's external key, ``file[MNT_ID:INODE]``."""
    names: list[str]
    """Its names in ``/dev/shm`` at the dump (none: it was unlinked)."""
    mode: int

    def record(self, content: str) -> dict[str, Any]:
        size = os.fstat(self.fd).st_size
        return {
            "key": self.key,
            "names": self.names,
            "mode": self.mode,
            "size": size,
            "content": content,
        }


@dataclass
class HeldFiles:
    files: list[HeldFile] = field(default_factory=list)

    @property
    def keys(self) -> list[str]:
        return [held.key for held in self.files]

    @property
    def paths(self) -> set[str]:
        return {str(SHM_DIR / name) for held in self.files for name in held.names}

    def close(self) -> None:
        for held in self.files:
            with contextlib.suppress(OSError):
                os.close(held.fd)
        self.files = []


def _dev_text(st_dev: int) -> str:
    return f"{os.major(st_dev):02x}:{os.minor(st_dev):02x}"


def hold_tree_files(pids: Iterable[int], directory: Path = SHM_DIR) -> HeldFiles:
    """Open every regular file in ``directory`` that has a name there and that these
    processes map or hold open (by that name, else through the process's fd or, with root,
    its ``map_files`` entry). Unlinked files, and files that cannot be opened, are left to
    CRIU, as before, unless CRIU cannot reach them (see below)."""
    pids = list(pids)
    try:
        shm_dev = os.stat(directory).st_dev
    except OSError:
        return HeldFiles()
    dev_text = _dev_text(shm_dev)
    openers: dict[int, list[str]] = {}  # inode -> /proc paths that open it
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd_name in os.listdir(f"/proc/{pid}/fd"):
                path = f"/proc/{pid}/fd/{fd_name}"
                with contextlib.suppress(OSError):
                    st = os.stat(path)
                    if st.st_dev == shm_dev and stat.S_ISREG(st.st_mode):
                        openers.setdefault(st.st_ino, []).append(path)
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[3] == dev_text and parts[5].startswith(str(directory)):
                    opener = f"/proc/{pid}/map_files/{parts[0]}"
                    openers.setdefault(int(parts[4]), []).append(opener)
    if not openers:
        return HeldFiles()
    names: dict[int, list[str]] = {}
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                if st.st_ino in openers and stat.S_ISREG(st.st_mode):
                    names.setdefault(st.st_ino, []).append(entry.name)
    held = HeldFiles()
    tree_mounts = _mount_ids(pids)
    for inode, paths in sorted(openers.items()):
        file_names = sorted(names.get(inode, []))
        # The tree's own fd or mapping first: CRIU's key names the mount the tree reaches
        # the file through, which is another (with the same inode) when the kernel has a
        # mount namespace of its own (core/isolation/mountns.py).
        fd = _open_same(paths + [str(directory / name) for name in file_names], shm_dev, inode)
        if fd is None:
            continue
        if not file_names and _fd_mount_id(fd) in tree_mounts:
            # Unlinked (a fork context's semaphores, PyTorch's shared tensors): CRIU saves
            # such a file's content itself, as before; taking it over would only lengthen
            # the freeze by the copy. Unless the tree reaches it through a mount its own
            # mount namespace lacks (a restore's private copy, recreate()): CRIU cannot.
            os.close(fd)
            continue
        mode = os.fstat(fd).st_mode & 0o7777
        held.files.append(HeldFile(fd, external_file_key(fd), file_names, mode))
    return held


def _open_same(candidates: list[str], dev: int, inode: int) -> int | None:
    """The first of ``candidates`` that opens and is still the file (``dev``, ``inode``),
    open; None if none is (its name went to another file meanwhile)."""
    for path in candidates:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == (dev, inode):
            return fd
        os.close(fd)
    return None


def _mount_ids(pids: Iterable[int]) -> set[int]:
    """The ids of the mounts of the tree's mount namespace (its first process's)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            lines = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
            return {int(line.split(None, 1)[0]) for line in lines}
    return set()


def _fd_mount_id(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    return None


class ShmCopy:
    """The held ``/dev/shm`` files, copied into ``dest``; :attr:`records` for the manifest."""

    def __init__(self, held: HeldFiles, dest: Path) -> None:
        self.held = held
        self.dest = dest
        self.records: list[dict[str, Any]] = []

    def copy(self) -> None:
        self.dest.mkdir(parents=True, exist_ok=True)
        for index, held in enumerate(self.held.files):
            rel = f"{self.dest.name}/{index}"
            target = self.dest / str(index)
            size = os.fstat(held.fd).st_size
            with open(target, "wb") as out:
                copy_fd(held.fd, out.fileno(), size)
            self.records.append(held.record(rel))


def copy_fd(src: int, dst: int, size: int) -> None:
    """Copy ``size`` bytes from offset 0 to offset 0 in the kernel (tmpfs to disk and back:
    ``sendfile``, as ``copy_file_range`` refuses to cross file systems)."""
    os.lseek(dst, 0, os.SEEK_SET)
    offset = 0
    while offset < size:
        sent = os.sendfile(dst, src, offset, size - offset)
        if sent == 0:
            break
        offset += sent


@dataclass
class Recreated:
    """The files a restore made: fds to hand to CRIU, and names to remove if it fails."""

    inherit: list[tuple[int, str]] = field(default_factory=list)
    created: list[Path] = field(default_factory=list)
    private: list[dict[str, Any]] = field(default_factory=list)
    """Names a live process holds here (another copy of the snapshot runs), each with
    those processes (``name``, ``held_by``): the kernel's files are then private copies,
    unlinked, and a new attach by such a name reaches the other process's file."""

    def close_fds(self) -> None:
        for fd, _ in self.inherit:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.inherit = []

    def undo(self) -> None:
        """A failed restore leaves no file of its own behind."""
        self.close_fds()
        for path in self.created:
            with contextlib.suppress(OSError):
                path.unlink()
        self.created = []


def recreate(
    records: list[dict[str, Any]], snapshot_dir: Path, directory: Path = SHM_DIR
) -> Recreated:
    """Make the snapshot's ``/dev/shm`` files again for a restore, each with its content.

    A name that is there already is taken back when no live process maps it or holds it
    open (:func:`holders`: a killed kernel's file, whose resource tracker died with it);
    only a name a live process holds leaves the restored kernel a private copy."""
    done = Recreated()
    try:
        for record in records:
            names = [str(name) for name in record.get("names", [])]
            mode = int(record["mode"])
            fd = -1
            if names:
                fd, held_by = _create(directory / names[0], mode)
                if fd >= 0:
                    done.created.append(directory / names[0])
                    for extra in names[1:]:
                        if not _take_back(directory / extra):
                            with contextlib.suppress(FileExistsError):
                                os.link(directory / names[0], directory / extra)
                                done.created.append(directory / extra)
                else:
                    who = [{"pid": pid, "process": proctree.process_name(pid)} for pid in held_by]
                    done.private += [{"name": name, "held_by": who} for name in names]
            if fd < 0:
                private = directory / f".jks-restore-{secrets.token_hex(8)}"
                fd = os.open(private, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
                private.unlink()
            done.inherit.append((fd, str(record["key"])))
            os.fchmod(fd, mode)  # not narrowed by the umask
            content = snapshot_dir / str(record["content"])
            with open(content, "rb") as src:
                copy_fd(src.fileno(), fd, int(record["size"]))
            os.ftruncate(fd, int(record["size"]))
            os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        done.undo()
        raise
    return done


def _create(path: Path, mode: int) -> tuple[int, list[int]]:
    """``path`` made anew and open, after taking its name back if stale; else -1 and the
    live processes that hold the file under that name."""
    held_by: list[int] = []
    for _ in range(2):
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode), []
        except FileExistsError:
            held_by = _take_back(path)
            if held_by:
                break
    return -1, held_by


def _take_back(path: Path) -> list[int]:
    """Remove ``path`` unless a live process holds its file: those processes (none: the
    name is free now)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return []
    held_by = holders(st.st_dev, st.st_ino)
    if not held_by:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            log.info("took back %s: no live process holds it (a killed kernel's)", path)
    return held_by


def holders(dev: int, inode: int, pids: Iterable[int] | None = None) -> list[int]:
    """The live processes (of ``pids``, default all) that map the file (``dev``,
    ``inode``) or hold it open. Without root only one's own processes can be looked into:
    another user's process cannot reach a user's ``/dev/shm`` file of mode 0600 (what
    ``shm_open`` and ``sem_open`` of multiprocessing make) unless it is root's."""
    dev_text = _dev_text(dev)
    found: list[int] = []
    for pid in proctree.all_pids() if pids is None else pids:
        if _maps(pid, dev_text, inode) or _holds_open(pid, dev, inode):
            found.append(pid)
    return [pid for pid in found if not _dying(pid)]


#: SIGKILL's bit in /proc/PID/status's pending-signal masks.
_SIGKILL_BIT = 1 << 8


def _dying(pid: int) -> bool:
    """Gone, a zombie, or killed and not yet out (the tree a restore in place ended, whose
    processes without a PID namespace of their own are not waited for one by one)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return True
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    if fields.get("State", "").split()[:1] in (["Z"], ["X"]):
        return True
    return any(int(fields.get(k, "0"), 16) & _SIGKILL_BIT for k in ("SigPnd", "ShdPnd"))


def _maps(pid: int, dev_text: str, inode: int) -> bool:
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) >= 5 and parts[3] == dev_text and parts[4] == str(inode):
            return True
    return False


def _holds_open(pid: int, dev: int, inode: int) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            st = os.stat(f"/proc/{pid}/fd/{fd}")
            if (st.st_dev, st.st_ino) == (dev, inode):
                return True
    return False


def remove_names(records: list[dict[str, Any]], held: HeldFiles, directory: Path = SHM_DIR) -> None:
    """After a dump that ended the tree (a suspend, a kernel saved before a restore in
    place): remove the names of its files, now carried in the snapshot, if they still name
    the same files, so that the restore that follows gets them back under those names.
    A name whose file a live process outside the tree holds too stays: it is that
    process's (the restore then gives the kernel a private copy, and says so)."""
    inodes = {os.fstat(h.fd).st_ino for h in held.files}
    for record in records:
        for name in record.get("names", []):
            path = directory / str(name)
            with contextlib.suppress(OSError):
                st = path.stat()
                if st.st_ino not in inodes:
                    continue
                others = [p for p in holders(st.st_dev, st.st_ino) if p != os.getpid()]
                if others:
                    log.info("kept %s: process(es) %s hold it too", path, others)
                    continue
                path.unlink()
