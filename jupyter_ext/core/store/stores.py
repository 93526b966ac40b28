"""The stores, and how one is opened from settings: a repository over a local directory,
one over an S3 bucket, one in memory. The policies that depend on where the bytes are
live here, not in the backends: a local store adopts images, says how full its disk is,
and sweeps its backend's temporaries."""

from __future__ import annotations

import errno
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Unpack

from ..chunking import ChunkParams
from ..humanize import human_bytes
from ..manifest import Manifest
from ..private import PRIVATE, Modes
from .api import StoreError
from .backend import Options, Settings
from .backend.local import LocalBackend, LocalOptions
from .backend.memory import MemoryOptions
from .backend.s3 import S3Backend, S3Encryption, S3Options
from .keys import KeySettings, make_key_source
from .prune import PruneReport
from .repository import Repository, Tuning
from .scope import user_prefix


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

    def prune(self) -> PruneReport:
        """Also remove temporary files that a killed put left behind."""
        done = super().prune()
        self.backend.remove_temporaries(older_than=time.time() - self.grace_seconds)
        return done


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

    outlives_the_machine = True
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
        options = S3Options(
            bucket, prefix, endpoint_url or "", region or "", encryption or S3Encryption()
        )
        super().__init__(options.open(max_workers, {}, client), max_workers=max_workers, **tuning)

    @property
    def client(self) -> Any:
        return self.backend.client


@dataclass(frozen=True)
class StoreKind:
    """A kind of store: its backend's options (how it is opened from settings) and the
    repository class over it (its policies; :class:`Repository`: none of its own)."""

    options: type[Options]
    store: type[Repository] = Repository


STORE_KINDS: dict[str, StoreKind] = {
    "local": StoreKind(LocalOptions, LocalStore),
    "s3": StoreKind(S3Options, S3Store),
    "memory": StoreKind(MemoryOptions),
}
"""Every kind of store, by the ``store`` option: a new backend is one file under backend/
and one line here (docs/storage.md, "Adding a backend")."""


def store_kind(name: str) -> StoreKind:
    """The kind ``name`` names (the ``store`` option), else a StoreError naming the kinds."""
    kind = STORE_KINDS.get(name)
    if kind is None:
        raise StoreError(
            f"Unknown store kind {name!r}; the known kinds are {', '.join(sorted(STORE_KINDS))}.",
            hint="Set the store to one of those (SnapshotExtensionApp.store).",
        )
    return kind


@dataclass(frozen=True)
class StoreSpec:
    """Everything a store is made from. The server and the CLI both make it from the
    server's settings (:meth:`from_settings`; the CLI overrides what its command line
    names), and :func:`open_store` makes the store, so a store is configured once."""

    kind: str
    """A name in :data:`STORE_KINDS`."""
    options: Options
    """That kind's backend options."""
    key_source: str
    """A name in keys.KEY_SOURCES, or "none" (no encryption)."""
    keys: KeySettings
    chunk_kib: int = 0
    """0: automatic."""
    pack_mib: int = 16

    @classmethod
    def from_settings(cls, settings: Settings, place: str | None = None) -> StoreSpec:
        """The store ``settings`` describe (by SnapshotExtensionApp's option names).
        ``place``: the user's own part of the configured place; by default
        ``users/<owner>``, from the server's identity, never from a request."""
        kind = str(settings["store"])
        if place is None:
            place = user_prefix(settings["owner"])
        return cls(
            kind,
            store_kind(kind).options.from_settings(settings, place),
            key_source=settings["encryption_key_source"],
            keys=KeySettings(
                Path(settings["encryption_key_file"]),
                hub_service_url=settings["hub_service_url"],
            ),
            chunk_kib=settings["chunk_kib"],
            pack_mib=settings["pack_mib"],
        )

    def location(self) -> str:
        return self.options.location()


def open_store(spec: StoreSpec, max_workers: int = 8) -> Repository:
    """The store ``spec`` describes (nothing is read or written yet): its kind's backend
    opened from its options, under its kind's repository class."""
    tuning: Tuning = {
        "chunking": ChunkParams.of_kib(spec.chunk_kib) if spec.chunk_kib else None,
        "pack_bytes": spec.pack_mib << 20,
        "keys": make_key_source(spec.key_source, spec.keys),
    }
    backend = spec.options.open(max_workers, spec.keys.environ)
    return store_kind(spec.kind).store.over(backend, max_workers=max_workers, **tuning)
