"""The progress vocabulary: the phases a job goes through and one progress report, as
the wrapper, the store and the manager report them (no wire of its own: the store imports
it without the wrapper's protocol)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Required, TypedDict

#: Every phase a job goes through, as the wrapper, the store and the manager report it and
#: the REST API and the panel show it (labextension/src/tokens.ts spells the same list),
#: in the order a job goes through them: a job's phase only moves forward in this list, and
#: is "done" once, when the job has ended (jupyter_ext/manager/jobs.py). "uploading" puts
#: a snapshot into an S3 store, "storing" into a local one; "comparing" finds what the
#: kernel's memory changed since its last snapshot (core/memtrack/digests.py).
Phase = Literal[
    "queued",
    "releasing-gpu-caches",
    "gpu-checkpoint",
    "comparing",
    "dumping",
    "hashing",
    "uploading",
    "storing",
    "committing",
    "checking-cache",
    "downloading",
    "verifying",
    "saving-kernel",
    "restoring",
    "transferring",
    "serialising",
    "loading",
    "checking",
    "reading-data",
    "pruning",
    "done",
]


class ProgressEvent(TypedDict, total=False):
    """One progress report: the phase, and for phases that move bytes, how many."""

    phase: Required[Phase]
    done_bytes: int
    total_bytes: int
    bytes: int
    """Bytes of the finished snapshot (with phase "done")."""
    processes: int
    """CUDA processes checkpointed (with phase "gpu-checkpoint")."""


ProgressCallback = Callable[[ProgressEvent], None]
