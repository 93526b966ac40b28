"""Memory tracking between snapshots: a kernel's later snapshots copy only the pages it
wrote since the previous one.

CRIU's own tracking (``--track-mem``, ``pre-dump``, ``--prev-images-dir``) reads
soft-dirty bits, which many kernels lack (``CONFIG_MEM_SOFT_DIRTY`` is off on arm64 and on
these machines' VM kernels). Linux 6.7 has the replacement: an asynchronous write-protect
userfaultfd and ``PAGEMAP_SCAN`` (:mod:`.uffd`). The kernel process opens the descriptor
(its in-kernel agent, on the wrapper's request), the wrapper takes it and holds it
(:mod:`.tracker`), and the CRIU the product builds (scripts/criu-patches/0001) takes
its dirty bits from it. The memory is protected only during a snapshot: between
snapshots the wrapper keeps a digest of each page the last one holds, and what changed
is found by content when the next one starts (:mod:`.digests`). Where the kernel has
soft-dirty bits, CRIU uses those and no descriptor is needed.

How a kernel's dumps use it, and when they copy everything instead (and say why), is
:mod:`.plan`; the chain of images a tracked dump leaves is :mod:`..criu.chain`.
"""

# Not the tracker here: it needs numpy (the digests), which the kernel's agent, which
# imports this package, must not load into every kernel, and the wrapper not at its start.
from .uffd import TrackingUnavailable, open_tracking_fd, why_unavailable

__all__ = ["TrackingUnavailable", "open_tracking_fd", "why_unavailable"]
