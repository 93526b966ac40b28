"""What is restored lazily, in which order, and how background reads give way to the
kernel's page faults (the one definition of that back-off: the page server's prefetch and
the store's background download both use :class:`Faults`).

Whether a restore goes lazily is decided once, by :func:`lazy_plan`: by the server for
every restore it asks of a wrapper (``RestoreRequest.lazy`` says it), by the wrapper for
its own (a suspended kernel coming back, an undo to a cell checkpoint)."""

from __future__ import annotations

import enum
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..manifest import IMAGES_DIR, FileEntry, Manifest
from ..protocol.environment import ENV_LAZY_RESTORE, ENV_LAZY_RESTORE_MIN_BYTES
from .chain import resolve
from .pagemap import PAGE_SIZE
from .sources import Range

FAULT_QUIET = 0.05
"""Background reads wait until no page fault came for this long (seconds)."""


class Faults:
    """When the kernel last faulted a page in: background reads stand back while faults
    come, so the kernel's first cell gets the CPU and the bandwidth."""

    def __init__(self) -> None:
        self.last = 0.0
        """time.monotonic() of the last fault (a float: read and written whole)."""

    def saw(self) -> None:
        """A fault came now."""
        self.last = time.monotonic()

    def quiet_left(self) -> float:
        """How long to wait until faults have been quiet for FAULT_QUIET (0: now)."""
        return max(0.0, FAULT_QUIET - (time.monotonic() - self.last))

    def stand_back(self, most: float) -> None:
        """Wait while faults come, in steps of half the quiet time, at most ``most`` s."""
        stood = 0.0
        while stood < most and self.quiet_left() > 0:
            time.sleep(FAULT_QUIET / 2)
            stood += FAULT_QUIET / 2


PAGES_FILE_RE = re.compile(rf"{IMAGES_DIR}/(?:parent/)*pages-\d+\.img")
"""A snapshot file that holds the kernel's memory (relative to the snapshot directory),
of any level of its chain (core/criu/chain.py)."""
LAZY_MIN_BYTES = 768 << 20
"""Below this much memory a kernel restored from local images (the image cache, the work
directory, a suspended kernel) is restored in full: reading its pages files from the page
cache costs less than setting up lazy pages (first output through the REST API, 2 vCPUs,
2026-12-01: 256 MiB 0.40-0.44 s in full against 0.52-0.61 s lazily; 512 MiB 0.49-0.50
against 0.52-0.59; 1 GiB 0.70-0.71 against 0.59-0.62)."""


def pages_bytes(files: Iterable[FileEntry]) -> int:
    """The bytes of memory a snapshot holds: its ``pages-*.img`` files."""
    return sum(entry.size for entry in files if PAGES_FILE_RE.fullmatch(entry.path))


def worth_lazy(gpu: dict[str, object]) -> bool:
    """Whether a kernel is restored lazily at all (given the manifest's ``gpu``): not one
    with CUDA state, whose restore reads all of its memory at once."""
    return not gpu.get("ns_pids")


class Into(enum.Enum):
    """Where a restore goes."""

    NEW_KERNEL = "new-kernel"
    """A new kernel, for a notebook."""
    IN_PLACE = "in-place"
    """In place of a running (or suspended) kernel."""
    SIDE_KERNEL = "side-kernel"
    """A new kernel for no notebook (variables.py), read from and ended."""


class LazyPlan(enum.Enum):
    """How a restore gets the kernel's memory."""

    FULL = "full"
    """Every page read before the kernel runs."""
    LOCAL = "local"
    """Lazily, from images on this machine."""
    FROM_STORE = "from-store"
    """Lazily, the store's pages lent to the wrapper while they download."""

    @property
    def lazy(self) -> bool:
        return self is not LazyPlan.FULL


@dataclass(frozen=True)
class LazySettings:
    """The lazy-restore settings (SnapshotExtensionApp's ``lazy_restore``,
    ``lazy_restore_min_bytes``, ``lazy_restore_from_store``)."""

    enabled: bool
    min_bytes: int = LAZY_MIN_BYTES
    from_store: bool = True

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> LazySettings:
        """As the server passes them to the wrappers it starts (in their environment:
        for their own restores, a suspended kernel coming back)."""
        return cls(
            enabled=environ.get(ENV_LAZY_RESTORE, "1") != "0",
            min_bytes=int(environ.get(ENV_LAZY_RESTORE_MIN_BYTES) or LAZY_MIN_BYTES),
        )

    def to_env(self) -> dict[str, str]:
        """What :meth:`from_env` reads (the server sets it for each snapshot kernel)."""
        return {
            ENV_LAZY_RESTORE: "1" if self.enabled else "0",
            ENV_LAZY_RESTORE_MIN_BYTES: str(self.min_bytes),
        }


def lazy_plan(
    settings: LazySettings, manifest: Manifest, *, into: Into, in_store: bool, supported: bool
) -> LazyPlan:
    """How the restore of ``manifest`` (its source the store when ``in_store``, else
    images on this machine) gets its memory, where lazy pages are ``supported``.

    Never lazily when turned off, unsupported, or for a kernel with CUDA state (its CUDA
    restore reads all of its memory at once: nothing to gain). From the store only into a
    new kernel: in place, a damaged chunk must fail the restore before the running kernel
    is touched, and a side kernel would end midway at one. A restore from the store that
    does not go lazily downloads every file first, and is then one from local images:
    lazy from ``settings.min_bytes`` of memory on (below, reading the pages files costs
    less than setting up lazy pages)."""
    if not (settings.enabled and supported and worth_lazy(manifest.gpu)):
        return LazyPlan.FULL
    if in_store and settings.from_store and into is Into.NEW_KERNEL:
        return LazyPlan.FROM_STORE
    if pages_bytes(manifest.files) >= settings.min_bytes:
        return LazyPlan.LOCAL
    return LazyPlan.FULL


def restore_order(images_dir: Path) -> tuple[list[Range], list[Range]]:
    """What a restore from ``images_dir`` reads of its pages files, as (file name, offset,
    length): first the ranges ``criu restore`` reads from the files itself (needed before
    it starts), then the lazy ones, the smallest memory areas first (the interpreter's
    heap and stacks, which the first cell touches, before the big arrays)."""
    now: list[Range] = []
    lazy: list[tuple[int, Range]] = []
    for pieces in resolve(images_dir).values():  # the level holding each run, in a chain
        for piece in pieces:
            span = (piece.file, piece.offset, piece.nr_pages * PAGE_SIZE)
            if piece.lazy:
                lazy.append((piece.nr_pages, span))
            else:
                now.append(span)
    lazy.sort(key=lambda item: item[0])
    return now, [span for _, span in lazy]
