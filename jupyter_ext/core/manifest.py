"""The snapshot directory and its manifest.

A snapshot is a directory holding CRIU's images under ``images/`` and ``manifest.json``,
which names every file with its size and sha256. The directory is built under a hidden
staging name and renamed into place only once the manifest is written, so a snapshot is
complete or absent. Hashes are checked before CRIU ever reads a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import socket
import sys
import uuid
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any

from .errors import BadIdError, SnapshotCorruptError

FORMAT_VERSION = 2
"""2: the manifest carries its own checksum. Format 1 (no checksum) is still read."""
READABLE_FORMATS = (1, 2)
MANIFEST_NAME = "manifest.json"
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


TRIGGERS = ("manual", "periodic", "idle-suspend", "before-shutdown", "before-restore")
"""What took a snapshot; "before-restore" saves a kernel a restore in place replaces."""


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


@dataclass
class FileEntry:
    path: str
    """Relative to the snapshot directory, '/'-separated."""
    size: int
    sha256: str


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
    running_request: dict[str, Any] | None = None
    """The execute_request the kernel was running at the snapshot, if any: its "header",
    the frontend's "cell_id" and its "execution_count". It goes on after a restore."""
    disconnect_seconds: float = 0.0
    """Draining and dropping the kernel's channels before CRIU starts (the kernel runs)."""
    dump_seconds: float = 0.0
    """How long ``criu dump`` ran."""
    frozen_seconds: float = 0.0
    """How long the kernel's processes were frozen (CRIU's log, seize to unfreeze)."""
    pause_seconds: float = 0.0
    """How long requests to the kernel were held: disconnect, dump and reconnect."""
    total_bytes: int = 0
    files: list[FileEntry] = field(default_factory=list)
    gpu: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    checksum: str = ""
    """sha256 of every other field (:func:`manifest_checksum`), set when it is sealed: a
    manifest changed afterwards, in a store or on disk, is refused as corrupt."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

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
        values["files"] = [FileEntry(**entry) for entry in data.get("files", [])]
        return cls(**values)

    @classmethod
    def read(cls, snapshot_dir: Path) -> Manifest:
        path = snapshot_dir / MANIFEST_NAME
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise SnapshotCorruptError(
                f"{snapshot_dir} is not a complete snapshot: it has no {MANIFEST_NAME}.",
                hint="Pick another snapshot; incomplete ones are never listed.",
            ) from exc
        except (OSError, ValueError) as exc:
            raise SnapshotCorruptError(
                f"The manifest of {snapshot_dir} cannot be read: {exc}",
                hint="The snapshot is damaged; pick another one.",
            ) from exc
        try:
            return cls.from_dict(data)
        except (TypeError, KeyError, AttributeError) as exc:
            raise SnapshotCorruptError(
                f"The manifest of {snapshot_dir} lacks fields or has wrong ones: {exc}",
                hint="The snapshot is damaged; pick another one.",
            ) from exc


def manifest_checksum(data: dict[str, Any]) -> str:
    """The checksum of a manifest's JSON form: sha256 of its canonical JSON without the
    checksum itself (floats and ints round-trip exactly through JSON)."""
    rest = {key: value for key, value in data.items() if key != "checksum"}
    canonical = json.dumps(rest, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def hash_files(root: Path, paths: Iterable[Path]) -> list[FileEntry]:
    """Size and sha256 of each file, hashed in parallel (hashlib releases the GIL)."""
    paths = sorted(paths)
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        digests = list(pool.map(_sha256, paths))
    return [
        FileEntry(p.relative_to(root).as_posix(), p.stat().st_size, digest)
        for p, digest in zip(paths, digests, strict=True)
    ]


def seal(
    staging: Path,
    manifest: Manifest,
    final: Path,
    hashed: Mapping[str, tuple[int, str]] | None = None,
) -> Manifest:
    """Hash every file in ``staging``, write the manifest last, and rename into place.
    ``hashed`` gives (size, sha256) of files hashed already, by relative path (used for a
    file of that size; the others are hashed here)."""
    hashed = hashed or {}
    files = [p for p in staging.rglob("*") if p.is_file() and p.name != MANIFEST_NAME]
    known = []
    for path in files:
        rel = path.relative_to(staging).as_posix()
        if rel in hashed and hashed[rel][0] == path.stat().st_size:
            known.append(FileEntry(rel, *hashed[rel]))
    done = {entry.path for entry in known}
    rest = [p for p in files if p.relative_to(staging).as_posix() not in done]
    manifest.files = sorted(known + hash_files(staging, rest), key=lambda e: e.path)
    manifest.total_bytes = sum(entry.size for entry in manifest.files)
    manifest.format_version = FORMAT_VERSION
    manifest.checksum = manifest_checksum(asdict(manifest))
    tmp = staging / (MANIFEST_NAME + ".tmp")
    with tmp.open("w") as fh:
        fh.write(manifest.to_json())
        fh.flush()
        os.fsync(fh.fileno())
    tmp.rename(staging / MANIFEST_NAME)
    staging.rename(final)
    return manifest


def verify(snapshot_dir: Path) -> Manifest:
    """Read the manifest and check every file's size and sha256 against it.

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
    actual = hash_files(snapshot_dir, [snapshot_dir / e.path for e in manifest.files])
    expected = {entry.path: entry.sha256 for entry in manifest.files}
    for entry in actual:
        if expected[entry.path] != entry.sha256:
            raise SnapshotCorruptError(
                f"Snapshot {manifest.id} is damaged: the sha256 of {entry.path} is "
                f"{entry.sha256[:12]}…, the manifest says {expected[entry.path][:12]}….",
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
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")
