"""The snapshot manager: takes, lists, restores and deletes snapshots for one server.

It joins the core (wrapper control client, store) to jupyter_server's kernel and session
managers. Long work runs as :class:`Job` objects that report progress, so the REST API
can return at once. Handlers never touch kernels or stores directly.

:class:`SnapshotManager` makes the parts and holds them; its callers call the part that
does the work (``manager.kernel_jobs.snapshot``, ``manager.jobs.wait``). Each part is given what
it uses when it is made (a part uses only those above it; none reaches into another's
state)::

    shared.py     what the parts share: settings, folders, ids, the API form of a snapshot
    jobs.py       Jobs: the job registry, progress, background tasks
    reaping.py    Reaper: orphaned kernel processes reaped (without root)
    kernels.py    Kernels (reaper): lookup, wrappers, the guarded dump, kernels to restore into
    paths.py      NotebookPaths: the renames and moves of notebooks, where one is now
    sessions.py   Sessions: notebook of a kernel, a restored kernel attached to its notebook
    pages.py      LentPages: a stored snapshot's memory lent to a lazy restore
    lazy.py       LazyLending (store, image cache, kernels, jobs): pages lent, given back
    retention.py  Retention (store, settings, lending, image cache): what goes after a put
    uploads.py    Uploads (store, image cache, jobs, retention): puts, pending, recovery
    stored.py     StoredSnapshots (store, uploads, lending, image cache): list, get, delete
    restore.py    Restores (kernels, sessions, jobs, uploads, stored, lending, ...): restores
    kernel_jobs.py  KernelJobs (kernels, sessions, jobs, uploads, stored): a running kernel
                  snapshotted, suspended (snapshot, process ended) or resumed
    deaths.py     Deaths (kernels, snapshots, jobs; restores' restore): kernels that died,
                  how, and the snapshot offered back
    schedules.py  Schedules (kernels, jobs, lending, kernel jobs, deaths): kernel status, automatic
                  snapshots on or off, snapshots of all before a stop
    upkeep.py     StoreUpkeep (store, jobs): the store's check and prune, as jobs
    checkpoints.py ServerCheckpoints (kernels, jobs, lending): cell checkpoints listed, undo
                  and redo, one restored for a take-back, areas of gone wrappers removed

The snapshot policies (periodic, long cells, idle suspend) are decided in core/policies/tick.py
on each kernel's status, read once a tick by jupyter_ext/autosnap.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Generic, TypeVar

from ..core import private
from ..core.imagecache import ImageCache
from ..core.store import SnapshotStore
from ..core.store.scope import user_prefix
from .checkpoints import ServerCheckpoints
from .deaths import Deaths
from .jobs import PROGRESS_EVENT_INTERVAL, Job, Jobs
from .kernel_jobs import KernelJobs
from .kernels import Kernels
from .lazy import LazyLending
from .pages import LentPages
from .paths import NotebookPaths
from .reaping import Reaper
from .restore import LAZY_HOLD_SECONDS, Restores
from .retention import Retention
from .schedules import Schedules
from .sessions import Sessions
from .shared import (
    KERNEL_ID_RE,
    EmitEvent,
    ManagerSettings,
    Workspace,
    check_kernel_id,
    validate_notebook_path,
)
from .stored import StoredSnapshots
from .upkeep import StoreUpkeep
from .uploads import STALE_WORK_SECONDS, PendingUpload, Uploads, remove_released_suspends

__all__ = [
    "KERNEL_ID_RE",
    "LAZY_HOLD_SECONDS",
    "PROGRESS_EVENT_INTERVAL",
    "STALE_WORK_SECONDS",
    "EmitEvent",
    "Job",
    "LentPages",
    "ManagerSettings",
    "PendingUpload",
    "SnapshotManager",
    "check_kernel_id",
    "user_prefix",
    "validate_notebook_path",
]

T = TypeVar("T")


class _Setting(Generic[T]):
    """A manager attribute that is its shared :class:`ManagerSettings`' field (set on the
    manager, it changes for every part)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, manager: SnapshotManager, owner: type | None = None) -> T:
        value: T = getattr(manager.settings, self.name)
        return value

    def __set__(self, manager: SnapshotManager, value: T) -> None:
        setattr(manager.settings, self.name, value)


class SnapshotManager:
    """One per server: jobs and the store of its user. It makes the parts (see the
    module's docstring) and gives each what it needs; callers use the parts."""

    keep_last = _Setting[int]()
    keep_hourly_hours = _Setting[int]()
    keep_daily_days = _Setting[int]()
    max_bytes = _Setting[int]()
    release_gpu_caches = _Setting[bool]()
    lazy_restore = _Setting[bool]()
    lazy_min_bytes = _Setting[int]()
    lazy_from_store = _Setting[bool]()
    chunk_kib = _Setting[int | None]()
    track_memory = _Setting[bool]()
    restore_on_death = _Setting[bool]()

    def __init__(
        self,
        *,
        kernel_manager: Any,
        session_manager: Any,
        store: SnapshotStore,
        work_dir: Path,
        emit: EmitEvent,
        settings: ManagerSettings | None = None,
    ) -> None:
        """``settings``: the extension's (:meth:`ManagerSettings.from_traits`); by default
        its traits' defaults."""
        self.settings = settings = settings or ManagerSettings.from_traits()
        self.kernel_manager = kernel_manager
        self.session_manager = session_manager
        self.store = store
        self.emit = emit
        self.workspace = ws = Workspace(work_dir)
        private.make_dirs(ws.staging_dir)
        private.make_dirs(ws.cache_dir)
        #: The newest snapshot of each kernel, unpacked.
        self.image_cache = cache = ImageCache(ws.image_cache_dir, settings.image_cache_max_bytes)

        # The parts: the app, the handlers, variables.py, autosnap.py and the tests call
        # the one that does the work (manager.kernel_jobs.snapshot, manager.jobs.wait, ...).
        self.jobs = jobs = Jobs(emit)
        self.reaper = Reaper()
        self.server_kernels = kernels = Kernels(kernel_manager, self.reaper, work_dir)
        self.sessions = sessions = Sessions(session_manager, kernel_manager)
        self.paths = paths = NotebookPaths(ws.work_dir / "notebook-paths.json")
        self.lending = lending = LazyLending(store, cache, kernels, jobs, emit)
        self.retention = Retention(store, settings, lending, cache, emit)
        self.uploads = uploads = Uploads(store, ws, cache, jobs, self.retention.apply)
        self.snapshots = snapshots = StoredSnapshots(store, uploads, lending, cache, emit, paths)
        common: dict[str, Any] = dict(
            settings=settings,
            workspace=ws,
            store=store,
            jobs=jobs,
            kernels=kernels,
            sessions=sessions,
            snapshots=snapshots,
            uploads=uploads,
            emit=emit,
        )
        self.restores = restores = Restores(**common, image_cache=cache, lending=lending)
        self.kernel_jobs = kernel_jobs = KernelJobs(**common, image_cache=cache)
        self.deaths = deaths = Deaths(
            settings=settings,
            kernel_manager=kernel_manager,
            kernels=kernels,
            snapshots=snapshots,
            jobs=jobs,
            emit=emit,
        )
        deaths.restore = lambda snapshot_id, kernel_id: restores.restore(
            snapshot_id, kernel_id=kernel_id
        )
        restores.on_restored = deaths.restored
        self.schedules = Schedules(kernels, jobs, lending, kernel_jobs, deaths, emit)
        self.upkeep = StoreUpkeep(store, jobs)
        self.checkpoints = ServerCheckpoints(settings, kernels, jobs, lending, ws, emit)

    @property
    def work_dir(self) -> Path:
        return self.workspace.work_dir

    @property
    def staging_dir(self) -> Path:
        return self.workspace.staging_dir

    @property
    def cache_dir(self) -> Path:
        return self.workspace.cache_dir

    @property
    def image_cache_dir(self) -> Path:
        return self.workspace.image_cache_dir

    async def remove_released_suspends(self) -> list[Path]:
        """Remove the dumps of suspended kernels that have ended (uploads.py)."""
        return await asyncio.to_thread(remove_released_suspends, self.workspace)

    def tighten(self) -> list[private.Exposed]:
        """Take from the store's files on this machine and the work directory the access
        others have (an older version's, another umask's); what was changed."""
        return [*self.store.tighten(), *private.tighten(self.work_dir)]
