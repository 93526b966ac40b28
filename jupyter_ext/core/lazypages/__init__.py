"""Lazy restore: the restored kernel runs while its memory arrives.

CRIU's ``lazy-pages`` daemon registers the kernel's anonymous memory with userfaultfd;
a page the kernel touches, and then all the others in the background, are asked of a
*page server* (``--page-server --ps-socket FD``). This module is that page server: it
answers CRIU's page-server requests (criu/page-xfer.c: ``PS_IOV_GET`` for a process,
an address and a page count; the answer is a ``PS_IOV_ADD_F`` header and the raw pages)
from a :class:`PageSource` (a local images directory, or the store's packs), so a restore
needs every image *except* ``pages-*.img`` before it starts, and the first cell runs
after a fraction of a second whatever the kernel's size.

Pages that arrive are also written into the local ``pages-N.img`` (a sparse file of the
right size, made by :func:`stage_pages_files`), so the restore ends with complete images
on this machine. A page that cannot be read is retried; then the server stops answering
and reports the error, and the caller kills the half-restored tree (a process whose
userfaultfd goes away would read zeros instead of its memory).

The parts: ``sources.py`` (page sources), ``rangeipc.py`` (a source lent to another
process over a unix socket), ``pagemap.py`` (CRIU's pagemap images), ``policy.py`` (whether
and what is restored lazily, in which order, and the back-off while the kernel faults) and
``server.py`` (CRIU's page-server protocol, the local write-through copy).
"""

from .pagemap import PAGE_SIZE, Pagemap, PagemapEntry, parse_pagemap, read_pagemaps
from .policy import (
    FAULT_QUIET,
    LAZY_MIN_BYTES,
    PAGES_FILE_RE,
    Faults,
    Into,
    LazyPlan,
    LazySettings,
    lazy_plan,
    restore_order,
)
from .rangeipc import UNIX_PREFIX, RangeServer, RemotePages, page_source
from .server import READ_ATTEMPTS, PageServer, stage_pages_files
from .sources import DirectoryPages, PageFetchError, PageSource, PrefixedPages, Range

__all__ = [
    "FAULT_QUIET",
    "LAZY_MIN_BYTES",
    "PAGES_FILE_RE",
    "PAGE_SIZE",
    "READ_ATTEMPTS",
    "UNIX_PREFIX",
    "DirectoryPages",
    "Faults",
    "Into",
    "LazyPlan",
    "LazySettings",
    "PageFetchError",
    "PageServer",
    "PageSource",
    "Pagemap",
    "PagemapEntry",
    "PrefixedPages",
    "Range",
    "RangeServer",
    "RemotePages",
    "lazy_plan",
    "page_source",
    "parse_pagemap",
    "read_pagemaps",
    "restore_order",
    "stage_pages_files",
]
