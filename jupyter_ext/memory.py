"""The server process's memory under snapshot load: glibc's malloc tuned at start, and what
it holds free given back when the server's jobs are done (bench/bench_soak.py measures
both; bench/RESULTS.md has the numbers). Both are no-ops where the C library has neither
``mallopt`` nor ``malloc_trim`` (musl), and off with ``JUPYTER_SNAPSHOT_MALLOC_TUNING=0``
(glibc's defaults: the soak benchmark's baseline)."""

from __future__ import annotations

import contextlib
import ctypes
import os

from .core.protocol.environment import ENV_TUNING

#: glibc's ``mallopt`` parameters: the size from which a buffer gets its own mapping, and
#: how many arenas the threads share.
M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8
MMAP_THRESHOLD_BYTES, ARENA_MAX = 256 << 10, 2


def _ours() -> bool:
    return os.environ.get(ENV_TUNING) != "0"


def tune() -> None:
    """Chunk buffers (read, compressed, sealed: hundreds of KiB to MiB, made in the upload
    and download threads) get their own mappings and go back to the system when freed.
    glibc raises its mmap threshold after the first such buffer is freed, so later ones
    came from per-thread arenas (up to 8 per core, one per thread that allocates at once),
    which kept them: the server's RSS rose from 128 to ~260 MiB under snapshot load and
    stayed there with every kernel gone. A fixed threshold keeps them out of the arenas,
    and two arenas are enough for threads that spend their time in zstd and AES, not in
    malloc. Skipped where malloc is tuned in the environment already (``MALLOC_ARENA_MAX``,
    ``MALLOC_MMAP_THRESHOLD_``, ...)."""
    if not _ours():
        return
    keep_allocator_to_the_server()
    if any(name.startswith("MALLOC_") for name in os.environ):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        libc.mallopt(M_ARENA_MAX, ARENA_MAX)


#: How the product's launchers start the server (scripts/dev.sh lab, deploy/Dockerfile):
#: CPython's small objects from malloc, not from its own allocator (pymalloc).
SERVER_ALLOCATOR = ("PYTHONMALLOC", "malloc")


def keep_allocator_to_the_server() -> None:
    """Take ``PYTHONMALLOC=malloc`` out of the environment the kernels inherit: it is
    the server's own (read when the process started), not theirs.

    pymalloc frees an arena (1 MiB) only when every object in it is gone, and a few
    objects that outlive a snapshot (a job's record, a cached manifest) keep many
    arenas alive: after 40 minutes under load the server held 57 more arenas than at its
    start, 44 MiB of them free blocks, and gave back nothing when the kernels ended
    (1.51x its warmed start). From malloc, what the jobs freed is returned by
    :func:`give_back`: 1.39x, 39 MiB given back (bench/RESULTS.md). Kernels keep
    CPython's default (faster for their small objects, and smaller snapshots); a
    kernelspec's ``env`` gives one a PYTHONMALLOC of its own."""
    name, value = SERVER_ALLOCATOR
    if os.environ.get(name) == value:
        del os.environ[name]


def give_back() -> None:
    """Return the free pages inside malloc's heaps to the system (``malloc_trim``). A put
    or fetch frees its small buffers (chunks of 16 KiB sealed or compressed, a record's
    JSON) between longer-lived allocations, so the heaps keep them as free space that
    RSS still counts: 25 MiB of the 60 MiB a quick soak left (bench/RESULTS.md). glibc
    trims only a heap's free top by itself. A few milliseconds; called when the server's
    last job ends."""
    if not _ours():
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
