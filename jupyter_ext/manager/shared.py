"""What the manager's parts share and hold no state in: its settings, its folders, ids and
paths checked, and the API's form of a snapshot."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.contents import short_contents
from ..core.errors import BadIdError
from ..core.lazypages import LazySettings
from ..core.manifest import Manifest
from ..core.store import StoredSnapshot
from ..settings import SnapshotSettings

KERNEL_ID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


EmitEvent = Callable[[str, dict[str, Any]], None]


@dataclass
class ManagerSettings:
    """SnapshotExtensionApp's traits of the same names (there documented; ``max_bytes`` is
    its ``max_store_bytes``, ``lazy_min_bytes`` its ``lazy_restore_min_bytes``,
    ``lazy_from_store`` its ``lazy_restore_from_store``). One
    object the parts share: a change (tests make some) reaches every part. No defaults of
    its own: :meth:`from_traits` reads them where they are declared, once."""

    keep_last: int
    keep_hourly_hours: int
    keep_daily_days: int
    max_bytes: int
    image_cache_max_bytes: int
    release_gpu_caches: bool
    lazy_restore: bool
    lazy_min_bytes: int
    lazy_from_store: bool
    chunk_kib: int | None
    track_memory: bool
    restore_on_death: bool

    @classmethod
    def from_traits(cls, app: SnapshotSettings | None = None) -> ManagerSettings:
        """The settings of ``app`` (the running extension), or without one the traits'
        defaults: a manager made apart (a test, a tool) behaves as a server would."""
        source: Any = app if app is not None else _TraitDefaults()
        return cls(
            keep_last=source.keep_last,
            keep_hourly_hours=source.keep_hourly_hours,
            keep_daily_days=source.keep_daily_days,
            max_bytes=source.max_store_bytes,
            image_cache_max_bytes=source.image_cache_max_bytes,
            release_gpu_caches=source.release_gpu_caches,
            lazy_restore=source.lazy_restore,
            lazy_min_bytes=source.lazy_restore_min_bytes,
            lazy_from_store=source.lazy_restore_from_store,
            chunk_kib=source.chunk_kib or None,
            track_memory=source.track_memory,
            restore_on_death=source.restore_on_death,
        )

    @property
    def lazy(self) -> LazySettings:
        """The lazy-restore settings, as core.lazypages.lazy_plan reads them."""
        return LazySettings(self.lazy_restore, self.lazy_min_bytes, self.lazy_from_store)


class _TraitDefaults:
    """SnapshotSettings' defaults, read as attributes (without making the app)."""

    def __getattr__(self, name: str) -> Any:
        return SnapshotSettings.class_traits()[name].default()


@dataclass(frozen=True)
class Workspace:
    """The manager's folders under its work directory."""

    work_dir: Path

    @property
    def staging_dir(self) -> Path:
        """Dumps on their way into the store (and those whose upload failed)."""
        return self.work_dir / "staging"

    @property
    def suspended_dir(self) -> Path:
        """Suspended kernels' dumps, which their wrappers resume from."""
        return self.work_dir / "suspended"

    @property
    def cache_dir(self) -> Path:
        """Downloads for restores."""
        return self.work_dir / "cache"

    @property
    def image_cache_dir(self) -> Path:
        """The newest snapshot of each kernel, unpacked."""
        return self.work_dir / "image-cache"

    @property
    def checkpoints_dir(self) -> Path:
        """The kernels' cell checkpoint areas (core/checkpoints/areas.py)."""
        return self.work_dir / "checkpoints"


def check_kernel_id(kernel_id: str) -> str:
    if not KERNEL_ID_RE.match(kernel_id):
        raise BadIdError(
            f"{kernel_id!r} is not a kernel id (a UUID).",
            hint="Use a kernel id as GET /api/snapshots/kernels shows it.",
        )
    return kernel_id


def validate_notebook_path(path: str) -> str:
    """A notebook path relative to the server root, with no way out of it."""
    parts = [p for p in path.replace("\\", "/").split("/") if p not in ("", ".")]
    if path.startswith("/") or any(p == ".." for p in parts) or "\x00" in path:
        raise ValueError(f"{path!r} is not a notebook path relative to the server root.")
    return "/".join(parts)


def describe_manifest(
    manifest: Manifest, status: str, error: str = "", full: bool = False
) -> dict[str, Any]:
    """The API's form of a snapshot: a listing carries the short form of what it holds
    (core.contents.short_contents), a single snapshot (``full``) the whole record."""
    data = manifest.to_dict()
    if not full:
        data["contents"] = short_contents(manifest.contents)
    data.pop("files", None)
    data.pop("needed_files", None)
    data.pop("bound_ports", None)
    data.pop("cpu_flags", None)
    data.update(
        status=status,
        error=error,
        kernel_id=manifest.kernel_spec.get("kernel_id"),
        gpu_bytes=int(manifest.gpu.get("total_bytes", 0)) if manifest.gpu else 0,
    )
    return data


def describe(stored: StoredSnapshot, status: str, full: bool = False) -> dict[str, Any]:
    """A stored snapshot in the API's form, with what it takes in the store."""
    data = describe_manifest(stored.manifest, status, full=full)
    data.update(stored_bytes=stored.stored_bytes, new_bytes=stored.new_bytes)
    return data
