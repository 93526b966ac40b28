"""The stores: a repository over a local directory, one over an S3 bucket, one in memory. The
policies that depend on where the bytes are live here, not in the backends: a local
store adopts images, says how full its disk is, and sweeps its backend's temporaries."""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, Unpack

from ..chunking import ChunkParams
from ..humanize import human_bytes
from ..manifest import Manifest
from ..private import GROUP_SHARED, PRIVATE, Modes
from .api import StoreError
from .backend.local import LocalBackend
from .backend.memory import MemoryBackend
from .backend.s3 import S3Backend, S3Encryption, connect
from .hubclient import signing_client
from .keys import KeySettings, KeySource, make_key_source
from .repository import Repository


class Tuning(TypedDict, total=False):
    """The repository's settings a store passes on (:class:`Repository` has the defaults)."""

    grace_seconds: float
    chunking: ChunkParams | None
    pack_bytes: int
    repack_below: float
    keys: KeySource | None


class LocalStore(Repository):
    """A store in a local directory (or any mounted file system), owner-only unless
    ``modes`` shares it with a group (core/private.py). Every file in it is read-only:
    records, packs and claims are written once and replaced or removed whole."""

    adopts_images = True
    backend: LocalBackend

    def __init__(
        self,
        root: Path,
        *,
        max_workers: int = 8,
        modes: Modes = PRIVATE,
        **tuning: Unpack[Tuning],
    ) -> None:
        backend = LocalBackend(root, max_workers=max_workers, modes=modes)
        super().__init__(backend, max_workers=max_workers, **tuning)

    @property
    def root(self) -> Path:
        return self.backend.root

    def explain_failure(self, manifest: Manifest, exc: BaseException) -> StoreError | None:
        """Say that the disk is full, where, and how much was needed against what is free
        (measured after the failed put removed what it wrote)."""
        if not is_disk_full(exc):
            return None
        usage = self.backend.disk_usage()
        if usage is None:
            return None
        _, free, total = usage
        return StoreError(
            f"The disk of the snapshot store {self.root} is full (no space left on device): "
            f"snapshot {manifest.id} needs up to {human_bytes(manifest.total_bytes)} there "
            "(its size before compression and deduplication), and "
            f"{human_bytes(free)} of {human_bytes(total)} are free.",
            hint="Free space on that disk (delete old snapshots, or set keep_last or "
            "max_bytes), or move the store to a larger disk; then retry.",
        )

    def sweep(self) -> None:
        """Also remove temporary files that a killed put left behind."""
        super().sweep()
        self.backend.remove_temporaries(older_than=time.time() - self.grace_seconds)


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` or what caused it is ENOSPC or EDQUOT."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


class S3Store(Repository):
    """A store in an S3 bucket under a prefix (one prefix per user keeps users apart).

    Credentials come from boto3's standard chain, unless ``client`` is given (under a hub,
    one whose requests the hub service signs: core/store/hubclient.py). Packs are a single
    PUT each (16 MiB by default); reads are ranged GETs of the chunks a restore needs,
    coalesced. Every object is written private (no ACL grants) and with ``encryption`` if
    it is set.
    """

    backend: S3Backend

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        client: Any = None,
        max_workers: int = 8,
        *,
        encryption: S3Encryption | None = None,
        **tuning: Unpack[Tuning],
    ) -> None:
        if client is None:
            client = connect(endpoint_url, region, max_workers)
        backend = S3Backend(bucket, prefix, client, max_workers, encryption or S3Encryption())
        super().__init__(backend, max_workers=max_workers, **tuning)

    @property
    def client(self) -> Any:
        return self.backend.client


@dataclass(frozen=True)
class StoreSpec:
    """Everything a store is made from: the server's options and the CLI's both become
    one of these, and :func:`open_store` makes the store, so a store is configured once."""

    kind: str
    """A name in :data:`STORE_KINDS`."""
    key_source: str
    """A name in keys.KEY_SOURCES, or "none" (no encryption)."""
    keys: KeySettings
    local_dir: Path | None = None
    """The user's own store directory (local)."""
    group_access: bool = False
    s3_bucket: str = ""
    s3_prefix: str = ""
    """The user's own prefix in the bucket, whole."""
    s3_endpoint_url: str = ""
    s3_region: str = ""
    s3_encryption: S3Encryption = field(default_factory=S3Encryption)
    chunk_kib: int = 0
    """0: automatic."""
    pack_mib: int = 16

    def location(self) -> str:
        if self.kind == "s3":
            return f"s3://{self.s3_bucket}/{self.s3_prefix}"
        return str(self.local_dir)


Opener = Callable[[StoreSpec, Tuning], Repository]
"""Makes the store of a spec from the repository's settings (nothing read or written)."""


def open_store(spec: StoreSpec) -> Repository:
    """The store ``spec`` describes (nothing is read or written yet), by its kind's opener
    in :data:`STORE_KINDS`."""
    opener = STORE_KINDS.get(spec.kind)
    if opener is None:
        raise StoreError(
            f"Unknown store kind {spec.kind!r}; the known kinds are "
            f"{', '.join(sorted(STORE_KINDS))}.",
            hint="Set the store to one of those (SnapshotExtensionApp.store).",
        )
    tuning: Tuning = {
        "chunking": ChunkParams.of_kib(spec.chunk_kib) if spec.chunk_kib else None,
        "pack_bytes": spec.pack_mib << 20,
        "keys": make_key_source(spec.key_source, spec.keys),
    }
    return opener(spec, tuning)


def open_s3(spec: StoreSpec, tuning: Tuning) -> S3Store:
    if not spec.s3_bucket:
        raise StoreError("The s3 store needs a bucket.", hint="Set SnapshotExtensionApp.s3_bucket.")
    client = None
    if spec.keys.hub_service_url:
        client = signing_client(
            spec.keys.hub_service_url,
            spec.keys.hub_token,
            spec.s3_endpoint_url or None,
            spec.s3_region or None,
            max_workers=8,
        )
    return S3Store(
        spec.s3_bucket,
        spec.s3_prefix,
        endpoint_url=spec.s3_endpoint_url or None,
        region=spec.s3_region or None,
        client=client,
        encryption=spec.s3_encryption,
        **tuning,
    )


def open_local(spec: StoreSpec, tuning: Tuning) -> LocalStore:
    if spec.local_dir is None:
        raise StoreError("The local store needs a directory.", hint="Set local_store_dir.")
    key_file = spec.keys.key_file.resolve()
    if spec.key_source == "file" and key_file.is_relative_to(spec.local_dir.resolve()):
        raise StoreError(
            f"The encryption key file {key_file} is inside the store {spec.local_dir}: "
            "whoever reads the store would read the key.",
            hint="Set encryption_key_file to a path outside the store.",
        )
    return LocalStore(
        spec.local_dir, modes=GROUP_SHARED if spec.group_access else PRIVATE, **tuning
    )


def open_memory(spec: StoreSpec, tuning: Tuning) -> Repository:
    """In this process alone, gone with it (tests; the contract's reference backend)."""
    return Repository(MemoryBackend(), max_workers=8, **tuning)


STORE_KINDS: dict[str, Opener] = {
    "local": open_local,
    "s3": open_s3,
    "memory": open_memory,
}
"""Every kind of store, by ``StoreSpec.kind``: a new backend is one file under backend/
and one line here (docs/storage.md, "Adding a backend")."""
