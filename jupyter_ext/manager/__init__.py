"""The snapshot manager: takes, lists, restores and deletes snapshots for one server.

It joins the core (wrapper control client, store) to jupyter_server's kernel and session
managers. Long work runs as :class:`Job` objects that report progress, so the REST API
can return at once. Handlers never touch kernels or stores directly.

The parts, each a module (a part uses only those above it)::

    base.py       settings and state, the server's kernels and wrappers, jobs
    pages.py      LentPages: a stored snapshot's memory lent to a lazy restore
    lazy.py       lending pages to a lazy restore, wrapping up after it
    stored.py     listing, uploads and their recovery, retention, deletion
    kernels.py    restored kernels: started, attached to a session, reaped
    restore.py    restores (cache, local copy, store; in place or a new kernel)
    dumps.py      snapshots of running kernels, suspend and resume
    schedules.py  periodic snapshots, idle suspends, snapshots before a stop
"""

from __future__ import annotations

from .base import (
    KERNEL_ID_RE,
    PROGRESS_EVENT_INTERVAL,
    EmitEvent,
    Job,
    PendingUpload,
    check_kernel_id,
    user_prefix,
    validate_notebook_path,
)
from .pages import LentPages
from .restore import LAZY_HOLD_SECONDS, Restores
from .schedules import Schedules
from .stored import STALE_WORK_SECONDS

__all__ = [
    "KERNEL_ID_RE",
    "LAZY_HOLD_SECONDS",
    "PROGRESS_EVENT_INTERVAL",
    "STALE_WORK_SECONDS",
    "EmitEvent",
    "Job",
    "LentPages",
    "PendingUpload",
    "SnapshotManager",
    "check_kernel_id",
    "user_prefix",
    "validate_notebook_path",
]


class SnapshotManager(Schedules, Restores):
    """One per server: jobs, policies and the store of each user. Its parts are the
    classes it is made of (see the module's docstring); what handlers, the app,
    variables.py and autosnap.py use is public on it."""
