"""The snapshot directory and its manifest.

A snapshot is a directory holding CRIU's images under ``images/`` and ``manifest.json``,
which names every file with its size and sha256. The directory is built under a hidden
staging name and renamed into place only once the manifest is written, so a snapshot is
complete or absent. Hashes are checked before CRIU ever reads a file.

**Hashed once.** The kernel's memory (``pages-*.img``, nearly all of a snapshot) is cut
into content-defined chunks and each chunk hashed while CRIU writes it, beside the dump
(``growinghash.py``). Such a file's entry lists its chunks (sha256 and size), and its
``sha256`` is the sha256 of that list (:func:`chunk_list_digest`): as strong a check as a
hash of the whole file, and one that several cores can check at once, chunk by chunk.
The store keeps the file by exactly those chunks, so it never hashes them again: the seal
makes every file read-only and *stamps* it (``sealed.json``: inode, size, mtime and ctime,
as git's index does), and a put on this machine trusts the chunks of a file whose stamp
is unchanged (any write, chmod or link changes its ctime, which no user can set); any
other file is hashed again, chunk by chunk, against its entry.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import platform
import re
import shutil
import socket
import stat
import sys
import uuid
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from . import private
from .errors import BadIdError, SnapshotCorruptError

FORMAT_VERSION = 3
"""3: memory files list their chunks; 2: the manifest carries its own checksum. Formats 1
(no checksum) and 2 are still read."""
CHAIN_FORMAT_VERSION = 4
"""4: the memory is a chain of levels under ``images/parent/`` (incremental dumps:
core/criu/chain.py); given to such snapshots only, so that an older version refuses them
plainly instead of misreading them."""
READABLE_FORMATS = (1, 2, 3, 4)
MANIFEST_NAME = "manifest.json"
SEAL_STAMPS_NAME = "sealed.json"
"""Each file's stamp when it was sealed: what a put on this machine trusts the chunks by."""
IMAGES_DIR = "images"
SNAPSHOT_ID_RE = re.compile(r"^[0-9a-f]{32}$")


def safe_relpath(path: str) -> PurePosixPath:
    """A manifest's file path as a relative path that stays inside the snapshot
    directory; ValueError for any other (absolute, "..", empty parts, backslashes)."""
    pure = PurePosixPath(path)
    if (
        not path
        or pure.is_absolute()
        or any(part in ("", ".", "..") for part in path.split("/"))
        or "\\" in path
        or path == MANIFEST_NAME
    ):
        raise ValueError(f"file path {path!r} is not allowed in a snapshot")
    return pure


def check_snapshot_id(value: object) -> str:
    """``value`` if it is a snapshot id (it names files and objects: nothing else may pass)."""
    if not isinstance(value, str) or not SNAPSHOT_ID_RE.match(value):
        raise BadIdError(
            f"{value!r} is not a snapshot id (32 lowercase hex digits).",
            hint="Use an id as 'jupyter snapshot list' or GET /api/snapshots shows it.",
        )
    return value


TRIGGERS = (
    "manual",
    "periodic",
    "long-cell",
    "idle-suspend",
    "cull",
    "admin-shutdown",
    "before-shutdown",
    "before-restore",
)
"""What took a snapshot; "before-restore" saves a kernel a restore in place replaces;
the cell checkpoints' kinds (core/checkpoints/timeline.py KINDS) are the triggers of theirs,
which stay on the machine (never in a store's listing);
"long-cell" follows a cell that ran longer than the server's threshold; "cull" and
"admin-shutdown" are shutdowns the user did not ask for, jupyter_server's kernel culler's
and (with admin_shutdown_action) another's, an admin's: the kernel suspended instead, or
snapshotted first."""


def new_snapshot_id() -> str:
    return uuid.uuid4().hex


def cpu_flags() -> list[str]:
    """The CPU feature flags of this machine (first processor in /proc/cpuinfo)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(line.split(":", 1)[1].split())
    except OSError:
        pass
    return []


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


Chunks = list[tuple[str, int]]
"""A file's chunks in order: (sha256, size) each."""
Stamps = dict[str, list[int]]
"""Relative path -> [inode, size, mtime_ns, ctime_ns] of files of a snapshot directory."""


@dataclass
class FileEntry:
    path: str
    """Relative to the snapshot directory, '/'-separated."""
    size: int
    sha256: str
    """The file's sha256, or for a file with ``chunks`` the sha256 of its chunk list."""
    chunks: Chunks | None = None
    """The chunks the store keeps the file by, cut and hashed during the dump; None for a
    file the store cuts itself (the small ones)."""

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"path": self.path, "size": self.size, "sha256": self.sha256}
        if self.chunks is not None:
            data["chunks"] = self.chunks
        return data

    def check_chunks(self) -> None:
        """ValueError unless the chunks are well formed, add up to the size and make the
        digest (a manifest read from anywhere may be forged). One pass of each check over
        the whole list: ten thousand chunks a snapshot, read several times a restore."""
        if self.chunks is None:
            return
        digests = [digest for digest, _ in self.chunks]
        sizes = [size for _, size in self.chunks]
        if not all(type(size) is int and size > 0 for size in sizes) or not all(
            type(digest) is str and len(digest) == 64 for digest in digests
        ):
            raise ValueError(f"a chunk of {self.path} is malformed")
        if not _HEX.fullmatch("".join(digests)):
            raise ValueError(f"a chunk of {self.path} is malformed")
        if sum(sizes) != self.size:
            raise ValueError(f"the chunks of {self.path} do not add up to its size")
        if chunk_list_digest(self.chunks) != self.sha256:
            raise ValueError(f"the chunks of {self.path} do not match its sha256")


_HEX = re.compile(r"[0-9a-f]*")


def chunk_list_digest(chunks: Chunks) -> str:
    """The sha256 of a chunked file: of its chunks' sha256 and sizes, in order."""
    listing = "".join(f"{digest} {size}\n" for digest, size in chunks)
    return hashlib.sha256(b"jupyter-kernel-snapshots chunks 1\n" + listing.encode()).hexdigest()


@dataclass
class Manifest:
    """Everything known about one snapshot; ``manifest.json`` is its JSON form."""

    id: str
    lineage: str
    """The kernel this snapshot descends from (stable across restores)."""
    sequence: int
    created: str
    trigger: str
    runtime_dir: str
    """The wrapper's directory the inner kernel's channels lived in (for the record)."""
    runtime_dir_key: str
    """CRIU's external key for that directory: a restore hands over its own instead."""
    stdio_pipe: str
    """The ``pipe:[INODE]`` the kernel writes its stdout/stderr to (re-attached on restore)."""
    kernel_spec: dict[str, Any] = field(default_factory=dict)
    notebook_path: str | None = None
    kernel_info: dict[str, Any] = field(default_factory=dict)
    parent_id: str | None = None
    product_version: str = ""
    criu_version: str = ""
    kernel_release: str = field(default_factory=platform.release)
    host: str = field(default_factory=socket.gethostname)
    cpu_model: str = field(default_factory=cpu_model)
    cpu_flags: list[str] = field(default_factory=cpu_flags)
    machine: str = field(default_factory=platform.machine)
    python_version: str = field(default_factory=lambda: sys.version.split()[0])
    needed_files: list[dict[str, Any]] = field(default_factory=list)
    """Regular files the kernel had open or mapped: a restore needs them unchanged."""
    bound_ports: list[dict[str, Any]] = field(default_factory=list)
    """Listening TCP and bound UDP ports (netports.BoundPort): a restore binds them again."""
    shm_files: list[dict[str, Any]] = field(default_factory=list)
    """``/dev/shm`` files the tree mapped or held open (semaphores, shared memory), copied
    into the snapshot while it was frozen; a restore makes them again (core/carried/shmfiles.py)."""
    appended_files: list[dict[str, Any]] = field(default_factory=list)
    """Files the tree held open for appending (logs): ``path``, ``size`` (at the snapshot:
    recorded while it was frozen), ``mode``, ``content`` (the bytes up to that size, copied
    once it ran again; None for a file too large to carry) and ``size_checked`` (CRIU
    checks its size: a restore makes it that size); a restore puts them back as
    core/carried/appended.py says. Their ``needed_files`` entries are marked ``appended``."""
    unix_socket_dirs: list[str] = field(default_factory=list)
    """Directories of the file-system unix sockets the tree had bound (a multiprocessing
    manager's ``/tmp/pymp-*``): a restore makes those that are missing."""
    mounts: list[str] = field(default_factory=list)
    """Mount points of the kernel's own mount namespace that were the server's (all but
    its /proc): a restore binds each from the same path (core/isolation/mountns.py). Empty for a
    kernel that shared the server's mount namespace (non-root mode, older snapshots)."""
    temp_dir: str = ""
    """The kernel's temporary directory when it is one of ``mounts`` (the kernel bound it
    onto itself): a copy restored beside a running kernel of the snapshot, whose file locks
    there the running one holds, gets a private view of it (core/isolation/privatetmp.py)."""
    tcp_kept: bool = False
    """TCP connections were saved with their state: those between two processes of the
    tree come back established (core/carried/tcpconns.py)."""
    kept_connections: list[dict[str, Any]] = field(default_factory=list)
    """Connections between processes of the tree that a restore brings back (each end)."""
    closed_connections: list[dict[str, Any]] = field(default_factory=list)
    """Connections a restore gives back closed: pid, process, local and remote address."""
    running_request: dict[str, Any] | None = None
    """The execute_request the kernel was running at the snapshot, if any: its "header",
    the frontend's "cell_id" and its "execution_count". It goes on after a restore."""
    disconnect_seconds: float = 0.0
    """Draining and dropping the kernel's channels before CRIU starts (the kernel runs)."""
    dump_seconds: float = 0.0
    """How long ``criu dump`` ran."""
    frozen_seconds: float = 0.0
    """How long the kernel's processes were frozen (CRIU's log, seize to unfreeze)."""
    shm_copy_seconds: float = 0.0
    """Of ``frozen_seconds``, how long copying the ``/dev/shm`` files (and the appended
    files the tree also writes in place; the others are copied after) took."""
    pause_seconds: float = 0.0
    """How long requests to the kernel were held: disconnect, dump and reconnect."""
    total_bytes: int = 0
    chunk_kib: int | None = None
    """The chunk size (chunking.ChunkParams.of_kib) the memory files were cut with."""
    files: list[FileEntry] = field(default_factory=list)
    gpu: dict[str, Any] = field(default_factory=dict)
    contents: dict[str, Any] = field(default_factory=dict)
    """What the snapshot holds, as the kernel's agent said just before the dump
    (kernel_wrapper.inkernel.contents): "cells" run since the previous snapshot, the largest
    "variables" and their totals, "partial" with a reason. Empty in snapshots taken before
    it existed (read as they are: an added field with a default needs no new format)."""
    memory: dict[str, Any] = field(default_factory=dict)
    """How the kernel's memory was copied (kernel_wrapper/memory.py): "mode" ("full" or
    "incremental"), "reason" (why full), "parent" (the snapshot an incremental one adds a
    level to), "precopy" (each round copied while the kernel ran), "frozen_bytes" (copied
    while it was frozen), "copied_bytes", "frozen_total_seconds" and "chain" (levels and
    their bytes). Empty in snapshots taken before it existed."""
    format_version: int = FORMAT_VERSION
    checksum: str = ""
    """sha256 of every other field (:func:`manifest_checksum`), set when it is sealed: a
    manifest changed afterwards, in a store or on disk, is refused as corrupt."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON form as a dict: its nested values are the manifest's own, not copies
        (``dataclasses.asdict`` deep-copied every chunk: 0.07 s for a 300 MB snapshot)."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["files"] = [entry.to_dict() for entry in self.files]
        return data

    def to_json(self) -> str:
        return manifest_json(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        if data.get("format_version") not in READABLE_FORMATS:
            raise SnapshotCorruptError(
                f"Snapshot format {data.get('format_version')!r} is not supported "
                f"(this version reads formats {', '.join(map(str, READABLE_FORMATS))}).",
                hint="Restore it with the version of jupyter-kernel-snapshots that took it.",
            )
        if data.get("format_version") != 1 and data.get("checksum") != manifest_checksum(data):
            raise SnapshotCorruptError(
                f"The manifest of snapshot {data.get('id')!r} does not match its checksum: "
                "it was changed after the snapshot was taken.",
                hint="Pick another snapshot; this one cannot be trusted to restore.",
            )
        known = {f for f in cls.__dataclass_fields__}
        values = {k: v for k, v in data.items() if k in known}
        try:
            values["files"] = [_file_entry(entry) for entry in data.get("files", [])]
            kib = values.get("chunk_kib")
            if kib is not None and (not isinstance(kib, int) or kib <= 0):
                raise ValueError(f"chunk_kib {kib!r} is not a size")
        except ValueError as exc:
            raise SnapshotCorruptError(
                f"The manifest of snapshot {data.get('id')!r} is damaged: {exc}.",
                hint="Pick another snapshot; this one cannot be trusted to restore.",
            ) from exc
        return cls(**values)

    @classmethod
    def read(cls, snapshot_dir: Path) -> Manifest:
        data = read_raw(snapshot_dir)
        try:
            return cls.from_dict(data)
        except (TypeError, KeyError, AttributeError) as exc:
            raise SnapshotCorruptError(
                f"The manifest of {snapshot_dir} lacks fields or has wrong ones: {exc}",
                hint="The snapshot is damaged; pick another one.",
            ) from exc


def read_raw(
    snapshot_dir: Path,
    missing_hint: str = "Pick another snapshot; incomplete ones are never listed.",
    damaged_hint: str = "The snapshot is damaged; pick another one.",
) -> dict[str, Any]:
    """A snapshot directory's manifest as the JSON object it holds (fields not checked:
    :meth:`Manifest.from_dict` does); the hints say what to do where the caller is."""
    try:
        data = json.loads((snapshot_dir / MANIFEST_NAME).read_text())
    except FileNotFoundError as exc:
        raise SnapshotCorruptError(
            f"{snapshot_dir} is not a complete snapshot: it has no {MANIFEST_NAME}.",
            hint=missing_hint,
        ) from exc
    except (OSError, ValueError) as exc:
        raise SnapshotCorruptError(
            f"The manifest of {snapshot_dir} cannot be read: {exc}", hint=damaged_hint
        ) from exc
    if not isinstance(data, dict):
        raise SnapshotCorruptError(
            f"The manifest of {snapshot_dir} is not a JSON object.", hint=damaged_hint
        )
    return data


def _file_entry(data: dict[str, Any]) -> FileEntry:
    chunks = data.get("chunks")
    entry = FileEntry(
        path=str(data["path"]),
        size=int(data["size"]),
        sha256=str(data["sha256"]),
        chunks=None if chunks is None else [(str(d), int(n)) for d, n in chunks],
    )
    entry.check_chunks()
    return entry


def manifest_json(data: dict[str, Any]) -> str:
    """A manifest's text, compact: an indented manifest of 10 000 chunks took 0.1 s to
    write (Python's encoder instead of the C one)."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def manifest_checksum(data: dict[str, Any]) -> str:
    """The checksum of a manifest's JSON form: sha256 of its canonical JSON without the
    checksum itself (floats and ints round-trip exactly through JSON)."""
    rest = {key: value for key, value in data.items() if key != "checksum"}
    canonical = json.dumps(rest, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2))


def hash_files(root: Path, paths: Iterable[Path]) -> list[FileEntry]:
    """Size and sha256 of each file, hashed in parallel (hashlib releases the GIL)."""
    paths = sorted(paths)
    with _pool() as pool:
        digests = list(pool.map(_sha256, paths))
    return [
        FileEntry(p.relative_to(root).as_posix(), p.stat().st_size, digest)
        for p, digest in zip(paths, digests, strict=True)
    ]


def first_bad_chunk(path: Path, chunks: Chunks) -> int | None:
    """The offset of the first chunk of ``path`` whose bytes do not have its sha256 (the
    chunks hashed in parallel), or None if all do."""
    with path.open("rb") as fh, _pool() as pool:
        size = os.fstat(fh.fileno()).st_size
        if size != sum(n for _, n in chunks):
            return 0
        offsets, offset = [], 0
        for _, n in chunks:
            offsets.append(offset)
            offset += n
        if not size:
            return None
        with mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as mapped:

            def good(index: int) -> bool:
                start, (digest, n) = offsets[index], chunks[index]
                with memoryview(mapped)[start : start + n] as piece:
                    return hashlib.sha256(piece).hexdigest() == digest

            results = list(pool.map(good, range(len(chunks)), chunksize=64))
        for index, ok in enumerate(results):
            if not ok:
                return offsets[index]
    return None


def holds(path: Path, entry: FileEntry) -> bool:
    """Whether the file's bytes are still those ``entry`` lists (its size and sha256, a
    chunked file chunk by chunk)."""
    try:
        if path.stat().st_size != entry.size:
            return False
        if entry.chunks is not None:
            return first_bad_chunk(path, entry.chunks) is None
        return _sha256(path) == entry.sha256
    except OSError:
        return False


def stamp(path: Path) -> list[int]:
    """A regular file's [inode, size, mtime_ns, ctime_ns]: any change to its bytes, mode
    or links changes its ctime, which no user can set back."""
    st = path.lstat()
    if not stat.S_ISREG(st.st_mode):
        raise FileNotFoundError(errno.ENOENT, "not a regular file", str(path))
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def stamp_files(root: Path, relpaths: Iterable[str]) -> Stamps:
    """Make the files read-only, then stamp them."""
    stamps: Stamps = {}
    for rel in relpaths:
        path = root / rel
        mode = path.lstat().st_mode
        if mode & 0o222:
            path.chmod(stat.S_IMODE(mode) & ~0o222)
        stamps[rel] = stamp(path)
    return stamps


def sealed_stamps(snapshot_dir: Path) -> Stamps:
    """The stamps of a snapshot directory's images when they were sealed, or last checked
    against the manifest by a put (``sealed.json``); {} if missing or unreadable."""
    try:
        data = json.loads((snapshot_dir / SEAL_STAMPS_NAME).read_text())
        return {str(rel): [int(x) for x in value] for rel, value in data.items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def write_sealed_stamps(snapshot_dir: Path, stamps: Stamps) -> None:
    """Record the images' stamps once they are checked against the manifest."""
    _write_durably(snapshot_dir / SEAL_STAMPS_NAME, json.dumps(stamps))


def seal(
    staging: Path,
    manifest: Manifest,
    final: Path,
    hashed: Mapping[str, FileEntry] | None = None,
) -> Manifest:
    """Hash every file in ``staging``, stamp the files, write the manifest last, and rename
    into place. ``hashed`` gives the entries of files hashed already, by relative path
    (used for a file of that size; the others are hashed here)."""
    hashed = hashed or {}
    own = {MANIFEST_NAME, SEAL_STAMPS_NAME}  # the seal's own files, written below
    files = [p for p in staging.rglob("*") if p.is_file()]
    files = [p for p in files if p.relative_to(staging).as_posix() not in own]
    known = []
    for path in files:
        rel = path.relative_to(staging).as_posix()
        if rel in hashed and hashed[rel].size == path.stat().st_size:
            known.append(hashed[rel])
    done = {entry.path for entry in known}
    rest = [p for p in files if p.relative_to(staging).as_posix() not in done]
    manifest.files = sorted(known + hash_files(staging, rest), key=lambda e: e.path)
    manifest.total_bytes = sum(entry.size for entry in manifest.files)
    chained = any(entry.path.startswith(f"{IMAGES_DIR}/parent/") for entry in manifest.files)
    manifest.format_version = CHAIN_FORMAT_VERSION if chained else FORMAT_VERSION
    manifest.checksum = manifest_checksum(manifest.to_dict())
    write_sealed_stamps(staging, stamp_files(staging, [entry.path for entry in manifest.files]))
    _write_durably(staging / MANIFEST_NAME, manifest.to_json())
    staging.rename(final)
    return manifest


def _write_durably(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with os.fdopen(private.create(tmp, os.O_WRONLY | os.O_TRUNC), "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.rename(path)


def verify(snapshot_dir: Path) -> Manifest:
    """Read the manifest and check every file's size and sha256 against it (a chunked
    file chunk by chunk).

    Raises SnapshotCorruptError naming the first file that is missing, changed, or extra.
    """
    manifest = Manifest.read(snapshot_dir)
    listed = {entry.path for entry in manifest.files}
    for entry in manifest.files:
        try:
            path = snapshot_dir / safe_relpath(entry.path)
        except ValueError as exc:
            raise SnapshotCorruptError(
                f"Snapshot {manifest.id} is damaged: {exc}.",
                hint="Pick another snapshot; this one cannot be restored.",
            ) from None
        if not path.is_file():
            raise SnapshotCorruptError(
                f"Snapshot {manifest.id} is damaged: its file {entry.path} is missing.",
                hint="Pick another snapshot; this one cannot be restored.",
            )
        if path.stat().st_size != entry.size:
            raise SnapshotCorruptError(
                f"Snapshot {manifest.id} is damaged: {entry.path} has "
                f"{path.stat().st_size} bytes, the manifest says {entry.size}.",
                hint="Pick another snapshot; this one cannot be restored.",
            )
    whole = [e for e in manifest.files if e.chunks is None]
    actual = hash_files(snapshot_dir, [snapshot_dir / e.path for e in whole])
    expected = {entry.path: entry.sha256 for entry in whole}
    for entry in actual:
        if expected[entry.path] != entry.sha256:
            raise SnapshotCorruptError(
                f"Snapshot {manifest.id} is damaged: the sha256 of {entry.path} is "
                f"{entry.sha256[:12]}…, the manifest says {expected[entry.path][:12]}….",
                hint="Pick another snapshot; this one cannot be restored.",
            )
    for entry in manifest.files:
        if entry.chunks is not None:
            bad = first_bad_chunk(snapshot_dir / entry.path, entry.chunks)
            if bad is not None:
                raise SnapshotCorruptError(
                    f"Snapshot {manifest.id} is damaged: the chunk of {entry.path} at "
                    f"byte {bad} does not have the sha256 its manifest gives.",
                    hint="Pick another snapshot; this one cannot be restored.",
                )
    images = snapshot_dir / IMAGES_DIR
    for path in images.rglob("*") if images.is_dir() else []:
        if path.is_file() and path.relative_to(snapshot_dir).as_posix() not in listed:
            raise SnapshotCorruptError(
                f"Snapshot {manifest.id} is damaged: {path.name} is not in its manifest.",
                hint="Pick another snapshot; this one cannot be restored.",
            )
    return manifest


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")
