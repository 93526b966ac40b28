"""The two stores: a repository over a local directory, and one over an S3 bucket. The
policies that depend on where the bytes are live here, not in the backends: a local
store adopts images, says how full its disk is, and sweeps its backend's temporaries."""

from __future__ import annotations

import errno
import time
from pathlib import Path
from typing import Any, TypedDict, Unpack

from ..chunking import ChunkParams
from ..humanize import human_bytes
from ..manifest import Manifest
from ..private import PRIVATE, Modes
from .api import StoreError
from .backend.local import LocalBackend
from .backend.s3 import S3Backend, S3Encryption, connect
from .repository import Repository


class Tuning(TypedDict, total=False):
    """The repository's settings a store passes on (:class:`Repository` has the defaults)."""

    grace_seconds: float
    chunking: ChunkParams | None
    pack_bytes: int
    repack_below: float


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

    Credentials come from boto3's standard chain. Packs are a single PUT each (16 MiB by
    default); reads are ranged GETs of the chunks a restore needs, coalesced. Every object
    is written private (no ACL grants) and with ``encryption`` if it is set.
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
