"""The local image cache: the newest snapshot of each kernel stays unpacked in the work
directory, so that a restore on the same machine is about a bare ``criu restore``.

Layout, under ``<work_dir>/image-cache``::

    .lock                       flock: one admission, eviction or look-up at a time
    <snapshot id>/              the snapshot directory as the store rebuilds it
        manifest.json, images/  read-only files, never changed once admitted
        cache-entry.json        the record: group, size and each file's stamp
    .<id>.admitting-<hex>/      an admission under way (locked), or left by a crash
    .<id>.trash-<hex>/          an entry being removed

**Verified without reading anything.** Hashing 600 MB of images costs ~0.4 s here, about
what CRIU's restore takes. So an entry's files are made read-only and *stamped* (inode,
size, mtime_ns, ctime_ns, as git's index does) once they were checked against the
manifest's sha256 (a new snapshot's memory is hashed while CRIU writes it, and the seal
stamps it; the store's put trusts or checks it, manifest.py), and the stamps are checked
unchanged after the put: the bytes that were hashed are the bytes stamped. A download is stamped
as soon as the store has written it (checking each file as it wrote it). A restore then
checks one ``stat`` per file (~0.05 ms for 41 files). Any write, chmod, rename over or
re-link of a file changes its ctime, which no user can set. An entry
whose stamps changed is hashed again locally (a suspend's hard links going away changes
ctimes), and dropped if a byte differs: the restore then falls back to the store.

**What stays.** Per group (the kernel that took the snapshot: lineage and kernel id) only
the newest snapshot, by sequence. Past the byte budget, or when the disk's free space
falls below the reserve (10 % of the disk but at most 2 GiB, and never less than the
newest entry, so that the next dump of that kernel finds room), the oldest entries go
first.

**Never changed under CRIU.** A restore holds a shared flock on its entry's directory for
as long as CRIU and the wrapper read it (a lease); removal needs the exclusive lock and
skips entries in use. Entries are never written to once admitted, and CRIU's restore only
reads its image directory (it writes its log and stats to ``-W``): two restores of one
entry side by side read the same files, with no copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import private
from .errors import SnapshotError
from .fileio import lock_directory, try_lock_directory
from .manifest import (
    MANIFEST_NAME,
    SEAL_STAMPS_NAME,
    SNAPSHOT_ID_RE,
    Manifest,
    Stamps,
    sealed_stamps,
    stamp,
    stamp_files,
    verify,
)

log = logging.getLogger(__name__)

RECORD_NAME = "cache-entry.json"
RECORD_VERSION = 1
#: The default budget (max_bytes < 0): this fraction of the work directory's disk.
DEFAULT_DISK_FRACTION = 0.25
#: Never fill the disk: at least this fraction of it stays free, up to RESERVE_CAP_BYTES
#: (10 % of a 250 GB disk would keep 25 GB from the cache), and the newest entry's size.
RESERVE_FRACTION = 0.10
RESERVE_CAP_BYTES = 2 << 30


def _files(directory: Path) -> list[str]:
    """Every file of a snapshot directory that the cache answers for: all but the cache's
    own record (an extra image would be read by CRIU)."""
    found = []
    for root, _dirs, names in os.walk(directory):
        for name in names:
            rel = (Path(root) / name).relative_to(directory).as_posix()
            if rel not in (RECORD_NAME, f".{RECORD_NAME}.tmp"):
                found.append(rel)
    return sorted(found)


def stamp_tree(directory: Path) -> Stamps:
    """Make every file read-only, then stamp it. Call this *before* the files are read
    and checked against their sha256 (put, verify), and :meth:`ImageCache.admit` after."""
    return stamp_files(directory, _files(directory))


def stamp_checked(directory: Path) -> Stamps | None:
    """Stamp a snapshot directory the store's put has just stored: its stamps if every
    image is still as the put checked (or trusted) it, by the seal's stamps it left
    (manifest.py), else None (not to be cached)."""
    try:
        manifest = Manifest.read(directory)
        stamps = stamp_tree(directory)
    except (OSError, SnapshotError):
        return None
    sealed = sealed_stamps(directory)
    if all(sealed.get(f.path, []) == stamps.get(f.path) for f in manifest.files):
        return stamps
    log.warning("not caching snapshot %s: its files changed after they were checked", manifest.id)
    return None


def _same_stamps(directory: Path, stamps: Stamps) -> bool:
    try:
        if _files(directory) != sorted(stamps):
            return False
        return all(stamp(directory / rel) == value for rel, value in stamps.items())
    except OSError:
        return False


def lock_shared(path: Path) -> int:
    """An fd of the directory ``path`` holding a shared flock: a download in use, which a
    clean-up after crashes leaves alone (it needs the exclusive lock), and which the cache
    can lease once it is admitted."""
    return lock_directory(path, shared=True)


def group_of(manifest: Manifest) -> str:
    """The kernel that took the snapshot: its lineage and (jupyter) kernel id. Kernels
    restored from one snapshot share a lineage but each has its own newest snapshot."""
    return f"{manifest.lineage}/{manifest.kernel_spec.get('kernel_id') or ''}"


@dataclass
class Entry:
    """A cached snapshot, as its record says."""

    snapshot_id: str
    group: str
    sequence: int
    created: str
    bytes: int
    stamps: Stamps = field(repr=False)
    path: Path

    @property
    def order(self) -> tuple[str, int]:
        return (self.created, self.sequence)

    @classmethod
    def read(cls, path: Path) -> Entry:
        data = json.loads((path / RECORD_NAME).read_text())
        if data.get("version") != RECORD_VERSION or data.get("snapshot_id") != path.name:
            raise ValueError(f"{RECORD_NAME} is not a record of this entry")
        return cls(
            snapshot_id=str(data["snapshot_id"]),
            group=str(data["group"]),
            sequence=int(data["sequence"]),
            created=str(data["created"]),
            bytes=int(data["bytes"]),
            stamps={str(k): [int(x) for x in v] for k, v in data["stamps"].items()},
            path=path,
        )

    def write(self, directory: Path) -> None:
        data: dict[str, Any] = {
            "version": RECORD_VERSION,
            "snapshot_id": self.snapshot_id,
            "group": self.group,
            "sequence": self.sequence,
            "created": self.created,
            "bytes": self.bytes,
            "stamps": self.stamps,
        }
        tmp = directory / f".{RECORD_NAME}.tmp"
        private.write_file(tmp, json.dumps(data))
        tmp.rename(directory / RECORD_NAME)


def _unique_bytes(entries: list[Entry]) -> int:
    """The bytes the entries take on disk: a file two entries share (hard links of a
    chain, core/criu/chain.py) counts once."""
    sizes: dict[int, int] = {}
    for entry in entries:
        for value in entry.stamps.values():
            sizes[value[0]] = value[1]
    return sum(sizes.values())


class CacheLease:
    """A cache entry a restore reads: held (shared flock) until :meth:`release`, so that
    nothing removes it meanwhile. ``fresh`` says its stamps matched; a stale one must be
    :meth:`reverify`-ed (hashed locally) before CRIU may read it."""

    def __init__(self, cache: ImageCache, entry: Entry, fd: int, manifest: Manifest) -> None:
        self.cache = cache
        self.entry = entry
        self.path = entry.path
        self.manifest = manifest
        self.fresh = _same_stamps(entry.path, entry.stamps)
        self._fd = fd

    def reverify(self) -> bool:
        """Hash every file against the manifest; on success stamp the entry anew. On a
        mismatch the entry is dropped (and this lease released): False."""
        try:
            stamps = stamp_tree(self.path)
            verify(self.path)
        except (SnapshotError, OSError) as exc:
            log.warning("dropping cached snapshot %s: %s", self.entry.snapshot_id, exc)
            self.drop()
            return False
        if not _same_stamps(self.path, stamps):
            log.warning("dropping cached snapshot %s: it changed while hashed", self.path.name)
            self.drop()
            return False
        self.entry.stamps = stamps
        self.entry.write(self.path)
        self.fresh = True
        return True

    def restamp_links(self) -> None:
        """After this process hard-linked the entry's files elsewhere (a dump added a
        level to it: core/criu/chain.py): stamp anew the files whose inode, size and mtime
        are as recorded (a link changes only the ctime). A fresh entry stays fresh."""
        if self.fresh:
            self.cache.restamp(self.entry)

    def drop(self) -> None:
        """Remove the entry (it failed its check); other leases on it keep it until done."""
        self.release()
        self.cache.discard(self.entry.snapshot_id)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class ImageCache:
    """The newest snapshot of each kernel, unpacked, within a byte budget."""

    def __init__(self, root: Path, max_bytes: int = -1) -> None:
        self.root = root
        self.max_bytes = max_bytes
        """Budget in bytes; < 0: DEFAULT_DISK_FRACTION of the disk; 0: the cache is off."""

    @property
    def enabled(self) -> bool:
        return self.max_bytes != 0

    def budget(self) -> int:
        if self.max_bytes >= 0:
            return self.max_bytes
        private.make_dirs(self.root)
        return int(shutil.disk_usage(self.root).total * DEFAULT_DISK_FRACTION)

    # -- locking ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The cache-wide lock (also between servers sharing the work directory)."""
        private.make_dirs(self.root)
        fd = os.open(self.root / ".lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # -- entries ---------------------------------------------------------------------

    def entries(self) -> list[Entry]:
        """The complete entries (with a readable record), oldest first."""
        found = []
        if not self.root.is_dir():
            return []
        for path in self.root.iterdir():
            if SNAPSHOT_ID_RE.match(path.name) and path.is_dir():
                with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                    found.append(Entry.read(path))
        return sorted(found, key=lambda e: e.order)

    def total_bytes(self) -> int:
        return _unique_bytes(self.entries())

    def _remove(self, path: Path, wait: bool = True) -> bool:
        """Remove an entry unless a restore holds it: renamed away first, so a look-up
        never sees half of it. Without ``wait`` its files are deleted on a thread of their
        own (unlinking a 300 MB image took 0.07 s here; a crash leaves the renamed
        directory to :meth:`recover`)."""
        fd = try_lock_directory(path)
        if fd is None:
            return False
        try:
            trash = self.root / f".{path.name}.trash-{secrets.token_hex(4)}"
            path.rename(trash)
        except FileNotFoundError:
            return False
        finally:
            os.close(fd)
        if wait:
            shutil.rmtree(trash, ignore_errors=True)
        else:
            threading.Thread(
                target=shutil.rmtree, args=(trash, True), name="cache-removal", daemon=True
            ).start()
        return True

    def discard(self, snapshot_id: str) -> bool:
        """Remove a snapshot's entry (deleted from the store, or failed its check). An
        entry in use is renamed away once its restores are done."""
        with self._locked():
            path = self.root / snapshot_id
            if not path.is_dir():
                return False
            if self._remove(path):
                return True
            # In use: no longer served; removed once free (sweep, or the next start).
            (path / RECORD_NAME).unlink(missing_ok=True)
            return False

    def admit(self, directory: Path, stamps: Stamps, *, lease: bool = False) -> CacheLease | None:
        """Move the sealed snapshot ``directory`` (on the cache's disk) into the cache.

        ``stamps`` come from :func:`stamp_checked` after a put, or :func:`stamp_tree`
        once a download is written and checked; they must still match, else nothing is
        admitted. Not
        admitted either: a snapshot its kernel has a newer one of, one already cached, one
        larger than the budget. Returns a lease on the new entry when ``lease`` (the
        restore that downloaded it reads it next), else None; ``directory`` is left where
        it was when nothing was admitted.
        """
        if not self.enabled:
            return None
        try:
            manifest = Manifest.read(directory)
        except SnapshotError:
            return None
        if not _same_stamps(directory, stamps):
            log.warning(
                "not caching snapshot %s: its files changed after they were checked", manifest.id
            )
            return None
        size = sum(value[1] for value in stamps.values())
        entry = Entry(
            snapshot_id=manifest.id,
            group=group_of(manifest),
            sequence=manifest.sequence,
            created=manifest.created,
            bytes=size,
            stamps=stamps,
            path=self.root / manifest.id,
        )
        with self._locked():
            if size > self.budget() or entry.path.exists():
                return None
            if any(
                e.group == entry.group and (e.sequence, e.created) > (entry.sequence, entry.created)
                for e in self.entries()
            ):
                return None
            staging = self.root / f".{manifest.id}.admitting-{secrets.token_hex(4)}"
            try:
                directory.rename(staging)
            except OSError as exc:  # another disk than the work directory's, say
                log.warning("not caching snapshot %s: %s", manifest.id, exc)
                return None
            entry.write(staging)
            staging.rename(entry.path)
            held = None
            if lease:
                fd = try_lock_directory(entry.path, shared=True)
                held = CacheLease(self, entry, fd, manifest) if fd is not None else None
            self._sweep(newest=entry, wait=False)  # not while the snapshot's job waits
            return held

    def lease_newest(self, kernel_id: str) -> CacheLease | None:
        """The newest cached snapshot of the (jupyter) kernel ``kernel_id``, held, or
        None."""
        if not self.enabled:
            return None
        ours = [e for e in self.entries() if e.group.endswith(f"/{kernel_id}")]
        return self.lease(ours[-1].snapshot_id) if ours else None

    @contextlib.contextmanager
    def hold_parent(self, kernel_id: str) -> Iterator[CacheLease | None]:
        """The kernel's newest entry, held for a dump that may add a level to it
        (kernel_wrapper/memory.py decides), if it is there unchanged (its stamps match, so
        its files need no hashing); else None. The dump hard-links its files, which
        changes only their ctime: the entry is stamped anew afterwards."""
        lease = self.lease_newest(kernel_id)
        if lease is not None and not lease.fresh:
            lease.release()
            lease = None
        try:
            yield lease
        finally:
            if lease is not None:
                lease.restamp_links()
                lease.release()

    def restamp(self, entry: Entry) -> None:
        """Stamp anew ``entry``'s files whose inode, size and mtime are as recorded: only
        after this process linked or unlinked them (which changes ctimes alone)."""
        with self._locked():
            self._restamp_unlocked(entry)

    @staticmethod
    def _restamp_unlocked(entry: Entry) -> None:
        changed = False
        for rel, old in entry.stamps.items():
            try:
                new = stamp(entry.path / rel)
            except OSError:
                continue
            if new[:3] == old[:3] and new != old:
                entry.stamps[rel] = new
                changed = True
        if changed:
            entry.write(entry.path)

    def lease(self, snapshot_id: str) -> CacheLease | None:
        """The cached entry of a snapshot, held for a restore, or None when there is none
        (or it is broken: then it is removed). See :attr:`CacheLease.fresh`."""
        if not self.enabled or not SNAPSHOT_ID_RE.match(snapshot_id):
            return None
        with self._locked():
            path = self.root / snapshot_id
            if not path.is_dir():
                return None
            fd = try_lock_directory(path, shared=True)
            if fd is None:
                return None  # being removed
            try:
                entry = Entry.read(path)
                manifest = Manifest.read(path)
                if manifest.id != snapshot_id:
                    raise ValueError("the manifest names another snapshot")
            except (OSError, ValueError, KeyError, TypeError, SnapshotError) as exc:
                os.close(fd)
                log.warning("dropping cached snapshot %s: %s", snapshot_id, exc)
                self._remove(path)
                return None
            return CacheLease(self, entry, fd, manifest)

    def _sweep(self, newest: Entry | None = None, wait: bool = True) -> list[str]:
        """Remove superseded entries (not their kernel's newest), then the oldest ones past
        the budget or the disk's reserve. Entries in use stay. Call under the lock."""
        removed: list[str] = []
        for path in self.root.iterdir():  # dropped while in use: removed once free
            orphan = SNAPSHOT_ID_RE.match(path.name) and not (path / RECORD_NAME).exists()
            if orphan and path.is_dir() and self._remove(path):
                removed.append(path.name)
        entries = self.entries()
        best: dict[str, Entry] = {}
        for e in entries:
            if e.group not in best or (e.sequence, e.created) > (
                best[e.group].sequence,
                best[e.group].created,
            ):
                best[e.group] = e
        for e in entries:
            if best[e.group] is not e and self._remove_entry(e, entries, wait):
                removed.append(e.snapshot_id)
        entries = [e for e in entries if e.snapshot_id not in removed]
        budget = self.budget()
        usage = shutil.disk_usage(self.root)
        reserve = max(
            min(int(usage.total * RESERVE_FRACTION), RESERVE_CAP_BYTES),
            newest.bytes if newest else 0,
        )
        total = _unique_bytes(entries)
        free = usage.free
        for e in list(entries):  # oldest first
            if total <= budget and free >= reserve:
                break
            if self._remove_entry(e, entries, wait):
                removed.append(e.snapshot_id)
                entries.remove(e)
                freed = total - _unique_bytes(entries)
                total -= freed
                free += freed
        for snapshot_id in removed:
            log.info("image cache: removed snapshot %s", snapshot_id)
        return removed

    def _remove_entry(self, entry: Entry, entries: list[Entry], wait: bool) -> bool:
        """Remove ``entry`` (see :meth:`_remove`). Another entry whose chain shares files
        with it (hard links: core/criu/chain.py) sees their ctimes change: if it was
        fresh, it is stamped anew once the links are gone (waited for)."""
        inodes = {value[0] for value in entry.stamps.values()}
        sharing = [
            e
            for e in entries
            if e is not entry
            and inodes & {value[0] for value in e.stamps.values()}
            and _same_stamps(e.path, e.stamps)
        ]
        if not self._remove(entry.path, wait or bool(sharing)):
            return False
        for other in sharing:
            self._restamp_unlocked(other)
        return True

    def sweep(self) -> list[str]:
        with self._locked():
            return self._sweep()

    def recover(self) -> list[Path]:
        """After a restart: remove what crashes left (admissions, removals cut short) and
        entries that are broken (no record or manifest, files missing or resized), then
        keep to the budget. Entries whose stamps merely changed stay: a restore hashes
        them again. Returns what was removed."""
        removed: list[Path] = []
        if not self.root.is_dir():
            return removed
        with self._locked():
            for path in sorted(self.root.iterdir()):
                if path.name == ".lock" or not path.is_dir():
                    continue
                if not SNAPSHOT_ID_RE.match(path.name):
                    fd = try_lock_directory(path)
                    if fd is not None:  # not an admission under way elsewhere
                        os.close(fd)
                        shutil.rmtree(path, ignore_errors=True)
                        removed.append(path)
                    continue
                if self._broken(path) and self._remove(path):
                    removed.append(path)
            removed += [self.root / s for s in self._sweep()]
        return removed

    @staticmethod
    def _broken(path: Path) -> str:
        """Why an entry cannot be served at all, or "" (a cheap check: no hashing)."""
        try:
            entry = Entry.read(path)
            manifest = Manifest.read(path)
        except (OSError, ValueError, KeyError, TypeError, SnapshotError) as exc:
            return str(exc)
        expected = {MANIFEST_NAME, *(f.path for f in manifest.files)}
        if set(entry.stamps) - {SEAL_STAMPS_NAME} != expected:
            return "its record does not list the manifest's files"
        for f in manifest.files:
            try:
                if (path / f.path).stat().st_size != f.size:
                    return f"{f.path} has another size"
            except OSError:
                return f"{f.path} is missing"
        return ""

    def wait_unused(self, snapshot_id: str, timeout: float = 10.0) -> bool:
        """Whether no restore holds the entry (for tests and tools), waiting a little."""
        deadline = time.monotonic() + timeout
        while True:
            fd = try_lock_directory(self.root / snapshot_id)
            if fd is not None:
                os.close(fd)
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
