"""Where snapshots are kept: a local directory or an S3 bucket, in one format.

The store is a repository over a backend, as restic's is (docs/storage.md has the
picture)::

    stores.py      LocalStore, S3Store: a Repository over that backend, with its policies;
                   STORE_KINDS, StoreSpec.from_settings and open_store: a store from settings
    repository.py  put, snapshots, get, fetch, open_images, delete, stats, prune, check
      put.py         the upload pipeline (Upload, Packer), image adoption
      fetch.py       Reader, the download pipeline; images.py: SnapshotImages
      prune.py       survey -> plan_cleanup (pure) -> execute; repack.py
      check.py       is the store whole: Checker, CheckReport (``store check``)
      claims.py      claims, clean-up markers, heartbeats
      keys.py        key sources, the master key (keys/<id>), records and claims sealed
      sealing.py     AES-256-GCM pieces bound to what they are
      index.py       records and trailers read so far, Catalog (one owner: the repository)
      record.py      the record format;  pack.py: the pack format, range coalescing
    backend/       base.py (the protocols), layout.py (the one path layout), local.py, s3.py,
                   memory.py: each a backend and its Options (its settings, how it is
                   opened); a new one is one file and one line in stores.STORE_KINDS
    api.py         public types and error shapes

Images are cut with page-aligned content-defined chunking (``chunking.py``), so successive
snapshots of one kernel share most chunks; a chunk the store already holds is not stored
again. A put cuts, hashes, compresses, packs and uploads in one pipeline and writes the
record last, without overwriting (S3: ``If-None-Match: *``; locally: a hard link), so a
snapshot is listed complete or not at all. A fetch reads each pack's needed ranges in
one request, coalesced, and checks every chunk's sha256 and every file's. Clean-ups are
restic's prune with claims for its locks (``claims.py``, ``prune.py``).
"""

from .api import ChunkRef, SnapshotStore, StoredImages, StoredSnapshot, StoreError, StoreStats
from .backend.s3 import S3Encryption
from .images import SnapshotImages
from .keys import KEY_SOURCES, EnvKeySource, FileKeySource, KeySettings, KeySource
from .repository import DEFAULT_GRACE_SECONDS, REPACK_BELOW, Repository
from .stores import STORE_KINDS, LocalStore, S3Store, StoreKind, StoreSpec, open_store, store_kind

__all__ = [
    "DEFAULT_GRACE_SECONDS",
    "KEY_SOURCES",
    "REPACK_BELOW",
    "STORE_KINDS",
    "ChunkRef",
    "EnvKeySource",
    "FileKeySource",
    "KeySettings",
    "KeySource",
    "LocalStore",
    "Repository",
    "S3Encryption",
    "S3Store",
    "SnapshotImages",
    "SnapshotStore",
    "StoreError",
    "StoreKind",
    "StoreSpec",
    "StoreStats",
    "StoredImages",
    "StoredSnapshot",
    "open_store",
    "store_kind",
]
