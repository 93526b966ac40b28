"""A process that stores and deletes snapshots without end, to be killed at any point.

``python -m tests.support.store_worker (put|repack) <root-or-s3-url> <seed> <work-dir>``: ``put``
stores new snapshots of a slowly changing kernel (every fifth of a new one); ``repack``
also deletes the oldest each time (with no grace period, so every delete sweeps and
repacks). Each finished step prints a line. Its snapshots are made in ``work-dir`` (the
test's: a killed worker cleans nothing).
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

from jupyter_ext.core.chunking import PAGE_SIZE
from jupyter_ext.core.protocol.environment import ENV_KEY
from jupyter_ext.core.store import EnvKeySource, LocalStore, S3Store

from .stores import make_snapshot, mutate, random_pages

PACK_BYTES = 256 << 10
"""Small packs: a put of 4 MiB writes many, so a kill lands between them."""


def open_store(where: str, **kwargs: object) -> LocalStore | S3Store:
    """The store at ``where``, encrypted when $JUPYTER_SNAPSHOT_KEY is set."""
    if os.environ.get(ENV_KEY):
        kwargs["keys"] = EnvKeySource(os.environ)
    if where.startswith("s3://"):
        endpoint, bucket, prefix = where.removeprefix("s3://").split("|")
        return S3Store(bucket, prefix, endpoint_url=endpoint, region="us-east-1", **kwargs)  # type: ignore[arg-type]
    return LocalStore(Path(where), **kwargs)  # type: ignore[arg-type]


def main() -> None:
    mode, where, seed, work_dir = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    rng = random.Random(seed)
    store = open_store(where, grace_seconds=0, pack_bytes=PACK_BYTES, repack_below=0.9)
    pages = random_pages(rng, 1024)
    work_dir.mkdir(parents=True, exist_ok=True)
    print("ready", flush=True)  # the kill's delay counts from here, not from its imports
    for sequence in range(1, 1000):
        if sequence % 5:
            pages = mutate(pages, rng, inserts=4, changes=64)
        else:  # a new kernel of random floats: a local store adopts its memory image whole
            pages = rng.randbytes(len(pages) // PAGE_SIZE * PAGE_SIZE)
        # Odd ones list their memory's chunks, as the wrapper's seal does; even ones do
        # not, as snapshots of earlier versions.
        chunk_kib = 16 if sequence % 2 else None
        stored = store.put(make_snapshot(work_dir, pages, sequence=sequence, chunk_kib=chunk_kib))
        print("put", stored.manifest.id, flush=True)
        snapshots = store.snapshots()
        if mode == "repack" and len(snapshots) > 2:
            store.delete(snapshots[0].manifest.id)
            print("deleted", snapshots[0].manifest.id, flush=True)


if __name__ == "__main__":
    main()
