"""A backend in a local directory (or any mounted file system): files written whole under a
temporary name and renamed (or linked) into place, read-only, with the owner-only (or
group) modes of ``core/private.py``."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ... import private
from ...fileio import fsync_dir
from ...growinghash import start_writeback
from ...private import GROUP_SHARED, PRIVATE, Exposed, Modes
from .. import pack
from ..api import StoreError, os_hint
from . import layout
from .base import Handle, Kind, ObjectStat, Settings, beyond_end


@dataclass(frozen=True)
class LocalOptions:
    """``local_store_dir`` (the user's own directory under it) and
    ``local_store_group_access``."""

    root: Path
    modes: Modes = PRIVATE

    @classmethod
    def from_settings(cls, settings: Settings, place: str) -> LocalOptions:
        """Refuses an encryption key file inside the store: whoever reads the store would
        read the key."""
        if not settings["local_store_dir"]:
            raise StoreError("The local store needs a directory.", hint="Set local_store_dir.")
        root = Path(settings["local_store_dir"]) / place
        key_file = Path(settings["encryption_key_file"]).resolve()
        if settings["encryption_key_source"] == "file" and key_file.is_relative_to(root.resolve()):
            raise StoreError(
                f"The encryption key file {key_file} is inside the store {root}: "
                "whoever reads the store would read the key.",
                hint="Set encryption_key_file to a path outside the store.",
            )
        return cls(root, GROUP_SHARED if settings["local_store_group_access"] else PRIVATE)

    def location(self) -> str:
        return str(self.root)

    def open(self, max_workers: int, environ: Mapping[str, str]) -> LocalBackend:
        return LocalBackend(self.root, max_workers=max_workers, modes=self.modes)


class LocalBackend:
    """Every file is read-only: records, packs and claims are written once and replaced or
    removed whole."""

    def __init__(self, root: Path, *, max_workers: int = 8, modes: Modes = PRIVATE) -> None:
        self.root = Path(root)
        self.modes = modes
        self.max_workers = max_workers
        self._unsynced: set[Path] = set()
        """Pack directories with renames not yet made durable (one fsync each per put)."""
        self._unsynced_lock = threading.Lock()

    def path(self, handle: Handle) -> Path:
        return self.root / layout.path(handle)

    def location(self, handle: Handle) -> str:
        return str(self.path(handle))

    def _error(self, what: str, exc: OSError) -> StoreError:
        return StoreError(
            f"The snapshot store {self.root} cannot {what}: {exc.strerror or exc}",
            hint=os_hint(exc),
        )

    def _write_new(self, path: Path, data: bytes | pack.Parts, durably: bool = True) -> Path:
        """Write a uniquely named temporary file next to ``path`` (and sync it)."""
        private.make_dirs(path.parent, self.modes)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            fd = private.create(tmp, mode=self.modes.read_only)
            with os.fdopen(fd, "wb", buffering=0) as fh:
                for run in runs([data] if isinstance(data, bytes) else data):
                    first = run[0]
                    if isinstance(first, pack.FileSlice) and copy_range(
                        first.fd, first.offset, sum(map(len, run)), fh.fileno()
                    ):
                        continue
                    for part in run:
                        view = memoryview(pack.blob_bytes(part))
                        while view:
                            written = fh.write(view)
                            if not written:
                                raise OSError(errno.EIO, f"could not write {tmp}")
                            view = view[written:]
                if durably:
                    os.fsync(fh.fileno())
                else:
                    start_writeback(fh.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def save(self, handle: Handle, data: bytes | pack.Parts) -> None:
        """Packs are written whole under a temporary name, renamed into place, their
        writeback started; made durable by :meth:`sync` before a record names them. One
        fsync a pack as it is written took 0.67 s for 300 MB here; all of them at the end,
        0.28 s. The parts are written one by one, never joined (fresh memory costs ~3 ms
        a MB here). Other files are synced before the rename."""
        path = self.path(handle)
        packed = handle.kind is Kind.PACK
        try:
            os.replace(self._write_new(path, data, durably=not packed), path)
        except OSError as exc:
            raise self._error(f"write {_describe(handle)}", exc) from exc
        if packed:
            with self._unsynced_lock:
                self._unsynced.update((path, path.parent))

    def save_if_absent(self, handle: Handle, data: bytes) -> bool:
        path = self.path(handle)
        try:
            tmp = self._write_new(path, data)
            try:
                os.link(tmp, path)  # unlike rename, never replaces an existing file
            except FileExistsError:
                return False
            finally:
                tmp.unlink()
            fsync_dir(path.parent)
        except OSError as exc:
            raise self._error(f"write {_describe(handle)}", exc) from exc
        return True

    def adopt(self, handle: Handle, source: Path) -> bool:
        """A hard link: the snapshot's file and the object are one inode, which neither
        ever changes (both are read-only), and each can be removed without the other."""
        path = self.path(handle)
        try:
            private.make_dirs(path.parent, self.modes)
            os.link(source, path)
        except OSError as exc:
            if exc.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP):
                return False  # another file system, or a file this user may not link
            raise self._error(f"write {handle.name}", exc) from exc
        with contextlib.suppress(OSError):  # one inode: the image's mode is the pack's
            if os.stat(path).st_mode & 0o777 != self.modes.read_only:
                os.chmod(path, self.modes.read_only)
        with contextlib.suppress(OSError):
            os.utime(path)  # a new object, as far as the clean-up's grace period goes
        with self._unsynced_lock:
            self._unsynced.update((path, path.parent))
        return True

    def load(
        self, handle: Handle, offset: int = 0, length: int | None = None
    ) -> bytes | memoryview | None:
        """A range is a view of the mapped file: no copy until the bytes land in an image
        file."""
        path = self.path(handle)
        try:
            if length is None:
                return path.read_bytes()
            with path.open("rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if offset >= size:
                    raise beyond_end(str(path), offset, size)
                mapped = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
                return memoryview(mapped)[offset : offset + length]
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._error(f"read {_describe(handle)}", exc) from exc

    def names(self, kind: Kind) -> list[str]:
        if kind is not Kind.RECORD:
            return [name for name, _ in self.entries(kind)]
        try:
            found = os.listdir(self.root / layout.RECORDS_DIR)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise self._error("list its snapshots", exc) from exc
        return [i for i in map(layout.record_id, found) if i is not None]

    def entries(self, kind: Kind) -> Iterator[tuple[str, ObjectStat]]:
        directory = layout.directory(kind)
        if kind in layout.FLAT:
            yield from self._flat(kind)
            return
        try:
            for sub in scandir(self.root / directory):
                for entry in scandir(Path(sub.path)):
                    name = f"{directory}/{sub.name}/{entry.name}"
                    if pack.is_object_name(name):
                        with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                            st = entry.stat()
                            yield name, ObjectStat(st.st_size, st.st_mtime)
        except OSError as exc:
            raise self._error(f"list its {directory}", exc) from exc

    def _flat(self, kind: Kind) -> list[tuple[str, ObjectStat]]:
        found = []
        try:
            for entry in scandir(self.root / layout.directory(kind)):
                if not entry.name.startswith("."):
                    with contextlib.suppress(FileNotFoundError):  # ended since the listing
                        st = entry.stat()
                        found.append((entry.name, ObjectStat(st.st_size, st.st_mtime)))
        except OSError as exc:
            raise self._error(f"list its {layout.directory(kind)}", exc) from exc
        return found

    def remove(self, handle: Handle) -> None:
        path = self.path(handle)
        verb = "remove" if handle.kind is Kind.PUT else "delete"
        try:
            path.unlink(missing_ok=True)
            if handle.kind in (Kind.RECORD, Kind.KEY):
                with contextlib.suppress(FileNotFoundError):  # no directory: nothing removed
                    fsync_dir(path.parent)
        except OSError as exc:
            raise self._error(f"{verb} {_describe(handle)}", exc) from exc

    def remove_all(self, names: list[str]) -> None:
        """On a pool: an unlink of a freshly written file costs ~1 ms on ext4 here."""
        with ThreadPoolExecutor(max_workers=self.max_workers) as pool:
            list(pool.map(lambda name: self.remove(layout.object_handle(name)), names))

    def sync(self) -> None:
        with self._unsynced_lock:
            paths = set(self._unsynced)

        def sync(path: Path) -> None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                return  # removed meanwhile (a failed put's clean-up): nothing names it
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        directories = {p for p in paths if p.is_dir()}
        try:
            with ThreadPoolExecutor(max_workers=self.max_workers) as pool:
                list(pool.map(sync, paths - directories))  # the data, all at once
            for directory in directories:  # then the names
                sync(directory)
        except OSError as exc:
            raise self._error("sync its packs", exc) from exc
        with self._unsynced_lock:  # only now: a concurrent put may be relying on them
            self._unsynced -= paths

    def close(self) -> None:
        """Nothing to let go: files are opened per call."""

    def tighten(self) -> list[Exposed]:
        """Make the store's directory and take from everything in it the access ``modes``
        gives nobody else."""
        try:
            private.make_dirs(self.root, self.modes)
        except OSError as exc:
            raise self._error("be created", exc) from exc
        return private.tighten(self.root, self.modes)

    def remove_temporaries(self, older_than: float) -> None:
        """Remove the temporary files (of saves a killed process cut short) last changed
        before ``older_than`` (seconds since the epoch)."""
        for tmp in [
            *self.root.glob("packs/*/.*.tmp"),
            *self.root.glob("chunks/*/.*.tmp"),
            *self.root.glob("snapshots/.*.tmp"),
        ]:
            with contextlib.suppress(FileNotFoundError):
                if tmp.stat().st_mtime <= older_than:
                    tmp.unlink()

    def disk_usage(self) -> tuple[Path, int, int] | None:
        """The nearest existing directory of the store, its disk's free and total bytes."""
        where = self.root
        while not where.exists() and where != where.parent:
            where = where.parent
        try:
            usage = shutil.disk_usage(where)
        except OSError:
            return None
        return where, usage.free, usage.total


def _describe(handle: Handle) -> str:
    """How messages name a file (as before the backend had handles)."""
    if handle.kind is Kind.RECORD:
        return f"the record of {handle.name}"
    return layout.path(handle)


def runs(parts: Iterable[pack.Blob]) -> Iterator[list[pack.Blob]]:
    """The parts in runs: slices that follow each other in one file make one run (copied
    by one call: a call per 32 KiB chunk cost 0.1 s per 300 MB), any other part its own."""
    run: list[pack.Blob] = []
    end: tuple[int, int] | None = None
    for part in parts:
        if isinstance(part, pack.FileSlice) and end == (part.fd, part.offset):
            run.append(part)
        else:
            if run:
                yield run
            run = [part]
        end = (part.fd, part.offset + len(part)) if isinstance(part, pack.FileSlice) else None
    if run:
        yield run


def copy_range(fd: int, start: int, length: int, out: int) -> bool:
    """Append ``length`` bytes of file ``fd`` from ``start`` to ``out`` inside the kernel;
    False (nothing written) where the kernel cannot copy between these files (another
    file system, say)."""
    offset, left = start, length
    while left:
        try:
            copied = os.copy_file_range(fd, out, left, offset)
        except OSError as exc:
            if offset == start and exc.errno in (
                errno.EXDEV,
                errno.EINVAL,
                errno.ENOSYS,
                errno.EOPNOTSUPP,
            ):
                return False
            raise
        if not copied:  # the file is shorter than it was when it was cut
            raise OSError(errno.EIO, "the snapshot's file shrank while it was stored")
        offset += copied
        left -= copied
    return True


def scandir(path: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except FileNotFoundError:
        return []
