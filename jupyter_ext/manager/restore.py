"""Restores: from the image cache, a local copy or the store (lazily), in place or into a
new kernel."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.compat import check_compatible
from ..core.errors import WrapperUnavailableError
from ..core.imagecache import CacheLease, ImageCache, lock_shared, stamp_tree
from ..core.lazypages import PAGES_FILE_RE, Into, LazyPlan, lazy_plan
from ..core.manifest import (
    Manifest,
    Stamps,
    check_snapshot_id,
    new_snapshot_id,
    remove_tree,
    verify,
)
from ..core.protocol.control import Restored, RestoreRequest
from ..core.store import SnapshotStore
from ..kernelspecs import KERNEL_NAME
from .jobs import Job, Jobs
from .kernels import Kernels
from .lazy import LazyLending
from .pages import LentPages
from .sessions import Sessions
from .shared import EmitEvent, ManagerSettings, Workspace, validate_notebook_path
from .stored import StoredSnapshots
from .uploads import PendingUpload, Uploads

log = logging.getLogger("jupyter_ext")


#: The longest a cache entry stays held for a kernel's lazy restore after its job ended.
LAZY_HOLD_SECONDS = 3600.0


@dataclass(frozen=True)
class Target:
    """The notebook a restore into a new kernel is for: its path (None: the snapshot's,
    where it is now), and its session, which follows the restored kernel."""

    path: str | None = None
    session_id: str | None = None


def _into(kernel_id: str | None, target: Target | None) -> Into:
    """Where a restore goes: in place of ``kernel_id``, else into a new kernel for
    ``target``'s notebook, else (no target) a side kernel."""
    if kernel_id is not None:
        return Into.IN_PLACE
    return Into.NEW_KERNEL if target is not None else Into.SIDE_KERNEL


def _released(lease: CacheLease) -> Callable[[dict[str, Any]], Awaitable[None]]:
    async def release(_outcome: dict[str, Any]) -> None:
        lease.release()

    return release


def _hold_shared(directory: Path) -> int:
    """A shared lock on ``directory`` if it is still there (the same directory once
    locked), else -1."""
    try:
        fd = lock_shared(directory)
    except FileNotFoundError:
        return -1
    try:
        if os.path.samestat(os.fstat(fd), os.stat(directory)):
            return fd
    except FileNotFoundError:
        pass
    os.close(fd)
    return -1


class Restores:
    """Restore a snapshot into a running kernel or a new one."""

    def __init__(
        self,
        *,
        settings: ManagerSettings,
        workspace: Workspace,
        store: SnapshotStore,
        image_cache: ImageCache,
        jobs: Jobs,
        kernels: Kernels,
        sessions: Sessions,
        snapshots: StoredSnapshots,
        uploads: Uploads,
        lending: LazyLending,
        emit: EmitEvent,
    ) -> None:
        self.settings = settings
        self.workspace = workspace
        self.store = store
        self.image_cache = image_cache
        self.jobs = jobs
        self.kernels = kernels
        self.sessions = sessions
        self.snapshots = snapshots
        self.uploads = uploads
        self.lending = lending
        self.emit = emit
        self.on_restored: Callable[[str, Job], None] = lambda kernel_id, job: None
        """Called when a restore in place of a kernel succeeded (deaths.py: the offer of a
        dead kernel's snapshot is taken)."""

    def restore(
        self,
        snapshot_id: str,
        *,
        kernel_id: str | None = None,
        path: str | None = None,
        session_id: str | None = None,
    ) -> Job:
        """Restore into the running kernel ``kernel_id`` (in place), or into a new kernel.

        A new kernel is attached to the notebook ``path`` (its session ``session_id``,
        which then takes that path, if given); without one, to the snapshot's notebook
        where it is now: the session of the kernel that took it if that kernel still runs
        (a renamed notebook's session follows it), else the path it was taken at, or
        where the notebook was renamed or moved to since (paths.py).
        """
        check_snapshot_id(snapshot_id)
        if path is not None:
            path = validate_notebook_path(path)
        if kernel_id is not None:
            self.kernels.kernel(kernel_id)
            self.jobs.check_not_busy(kernel_id)
        target = Target(path, session_id)
        return self.jobs.start(
            "restore",
            kernel_id,
            lambda job: self._restore(job, snapshot_id, kernel_id, target),
        )

    async def restore_side_kernel(self, job: Job, snapshot_id: str) -> dict[str, Any]:
        """Restore a snapshot into a new kernel attached to no notebook (variables.py)."""
        return await self._restore(job, snapshot_id, None, None)

    async def _local_copy(
        self,
        job: Job,
        snapshot_id: str,
        waiting: PendingUpload | None,
        *,
        without_pages: bool = False,
    ) -> tuple[Path, int, bool]:
        """A local directory of the snapshot, the fd that holds its lock, which the caller
        closes once done with it, and whether it is a temporary copy (a download, removed
        or admitted into the image cache after the restore). A snapshot waiting for its
        upload is read where it is, held shared so that an upload succeeding meanwhile
        leaves it until then. ``without_pages`` leaves the kernel's memory in the store
        (a lazy restore reads it from there)."""
        if waiting is not None:
            held = await asyncio.to_thread(_hold_shared, waiting.directory)
            if held >= 0:
                return waiting.directory, held, False
            # Stored meanwhile (moved into the image cache or removed): from the store.
        dest = self.workspace.cache_dir / f"{snapshot_id}-{secrets.token_hex(4)}"
        self.jobs.progress(job, "downloading")
        try:
            await asyncio.to_thread(
                self.store.fetch,
                snapshot_id,
                dest,
                self.jobs.threaded_progress(job),
                skip=(lambda path: PAGES_FILE_RE.fullmatch(path) is not None)
                if without_pages
                else None,
            )
            # Locked until the restore removed the copy (the store locks it while it
            # downloads): after a crash of this server, its next start removes it at once.
            # Shared: the image cache's lease on it, once admitted, is shared too.
            fd = lock_shared(dest)
        except BaseException:
            remove_tree(dest)  # the store removes its partial download; this is the rest
            raise
        return dest, fd, True

    async def _cached(self, job: Job, snapshot_id: str) -> CacheLease | None:
        """The snapshot's entry in the image cache, held for the restore, or None. Its
        manifest is checked (its own checksum); its files by :meth:`_intact`."""
        if not self.image_cache.enabled:
            return None
        lease = await asyncio.to_thread(self.image_cache.lease, snapshot_id)
        if lease is not None:
            self.jobs.progress(job, "checking-cache")
        return lease

    async def _intact(self, job: Job, lease: CacheLease) -> CacheLease | None:
        """The lease if its files are as stamped; else they are hashed again here, locally
        (after the request was answered), and the entry is dropped if a byte differs."""
        if lease.fresh:
            return lease
        self.jobs.progress(job, "verifying", 0, lease.entry.bytes)
        if await asyncio.to_thread(lease.reverify):
            return lease
        log.warning("cached snapshot %s failed its check: restoring from the store", lease.path)
        return None

    async def _restore(
        self,
        job: Job,
        snapshot_id: str,
        kernel_id: str | None,
        target: Target | None,
    ) -> dict[str, Any]:
        """Restore into ``kernel_id``, else a new kernel attached to ``target`` (None: to
        no notebook, a side kernel).

        What the restore holds is on exit stacks, released when it ends in the reverse
        order of these: a cache lease, the lock on the local copy, the download's folder,
        the pages lent. A lazily restored kernel still reads its pages after the job: what
        it reads from is taken off the stacks (``pop_all``) and handed to
        :meth:`LazyLending.after_lazy`.
        """
        async with contextlib.AsyncExitStack() as held:
            leases = held.enter_context(contextlib.ExitStack())
            locked = held.enter_context(contextlib.ExitStack())
            downloaded = held.enter_context(contextlib.ExitStack())
            lending = await held.enter_async_context(contextlib.AsyncExitStack())
            # Asked once: a snapshot sealed here whose upload has not succeeded is read
            # where it is. Else served from the image cache when it holds the snapshot
            # intact: no store request.
            waiting = self.uploads.waiting(snapshot_id)
            lease = await self._cached(job, snapshot_id) if waiting is None else None
            if lease is not None:
                leases.callback(lease.release)
            lent: LentPages | None = None
            # Refused before any download (the request answers 404 or 422): a snapshot that
            # is not there, or that cannot run on this machine, as its manifest says.
            if lease is not None:
                manifest = lease.manifest
            elif waiting is not None:
                manifest = waiting.manifest
            else:
                manifest = await self.snapshots.stored_manifest(snapshot_id)
            check_compatible(manifest)
            job.checked.set()
            if lease is not None:
                lease = await self._intact(job, lease)
            # Decided once, here, for the wrapper too (RestoreRequest.lazy): from the store
            # into a new kernel, all but the kernel's memory first and the kernel runs while
            # its pages come (each chunk checked); from images here, lazily if it is big.
            plan = lazy_plan(
                self.settings.lazy,
                manifest,
                into=_into(kernel_id, target),
                in_store=lease is None and waiting is None,
                supported=await self.lending.lazy_pages_here(),
            )
            if lease is not None:
                directory, manifest, source = lease.path, lease.manifest, "cache"
            else:
                lazily = plan is LazyPlan.FROM_STORE
                directory, download_lock, temporary = await self._local_copy(
                    job, snapshot_id, waiting, without_pages=lazily
                )
                locked.callback(os.close, download_lock)  # removed, or admitted: the lease's
                if temporary:
                    downloaded.callback(shutil.rmtree, directory, ignore_errors=True)
                source = "store" if temporary else "work-directory"
                if lazily:
                    lent = await self.lending.lend(snapshot_id, directory)
                    lending.push_async_callback(self.lending.give_back, lent)
                stamps: Stamps | None = None
                if temporary and self.image_cache.enabled and not lazily:  # as soon as written
                    with contextlib.suppress(OSError):
                        stamps = await asyncio.to_thread(stamp_tree, directory)
                # Every file against its sha256 before CRIU starts: a corrupt snapshot fails
                # the job here, and a kernel restored in place keeps running untouched. A
                # download from the store checked each file as it wrote it.
                if temporary:
                    manifest = await asyncio.to_thread(Manifest.read, directory)
                else:
                    self.jobs.progress(job, "verifying")
                    manifest = await asyncio.to_thread(verify, directory)
                if stamps is not None:  # kept for the next restore on this machine
                    lease = await asyncio.to_thread(
                        self.image_cache.admit, directory, stamps, lease=True
                    )
                    if lease is not None:
                        leases.callback(lease.release)
                        downloaded.pop_all()  # the folder is the cache's now
                        directory = lease.path
            pages_from = lent.address if lent is not None else None
            if kernel_id is not None:  # never lazily from the store (lazy_plan)
                # The wrapper says what it does (saving the running kernel, restoring).
                restored = await self._restore_in_place(job, kernel_id, directory, plan.lazy)
                self.on_restored(kernel_id, job)
            else:
                self.jobs.progress(job, "restoring")
                request = RestoreRequest(
                    directory, verified=True, pages_from=pages_from, lazy=plan.lazy
                )
                kernel_id, restored = await self.kernels.start_restored(
                    manifest.kernel_spec.get("name") or KERNEL_NAME,
                    manifest.notebook_path,
                    request,
                    self.jobs.wrapper_progress(job),
                )
            if lease is not None:  # a lazily restored kernel still reads its pages there
                leases.pop_all()
                self.lending.after_lazy(kernel_id, _released(lease), LAZY_HOLD_SECONDS)
            if lent is not None:  # lent until every page is in, then cached
                lending.pop_all()
                download = contextlib.ExitStack()  # closed: removed (unless admitted), unlocked
                download.enter_context(locked.pop_all())
                download.enter_context(downloaded.pop_all())
                then = self.lending.download_done(directory, lent, download)
                self.lending.after_lazy(kernel_id, then)
            target_path = await self._notebook_of(manifest, target) if target else None
            session = None
            if target is not None and target_path:
                session = await self.sessions.attach(kernel_id, target_path, target.session_id)
        self.emit(
            "restored", {"snapshot_id": snapshot_id, "kernel_id": kernel_id, "path": target_path}
        )
        return {
            "kernel_id": kernel_id,
            "snapshot_id": snapshot_id,
            "session": session,
            "running_request": manifest.running_request,
            "source": source,
            # Connections to peers outside the kernel came back closed (docs/network.md).
            "closed_connections": manifest.closed_connections,
            # Names a live process held here: the kernel has private copies
            # (core/carried/shmfiles.py). As the wrapper's reply to the restore says.
            "private_shm": restored["private_shm"],
            # Where the wrapper's time went (seconds per phase: the check, CRIU, ...).
            "phases": restored.get("phases", {}),
        }

    async def _notebook_of(self, manifest: Manifest, target: Target) -> str | None:
        """The notebook a restore into a new kernel is for (see :meth:`restore`)."""
        if target.path:
            return target.path
        taken_by = manifest.kernel_spec.get("kernel_id")
        now = await self.sessions.notebook_path(taken_by) if taken_by else None
        return now or self.snapshots.paths.now(manifest.notebook_path)

    async def _restore_in_place(
        self, job: Job, kernel_id: str, directory: Path, lazy: bool
    ) -> Restored:
        """Restore ``directory`` into the running kernel (``lazy``: with lazy pages, from
        ``directory``'s own images). The wrapper first saves that
        kernel into staging (a failed restore puts it back). If the wrapper dies meanwhile,
        what it saved is stored like any snapshot when it was sealed (the kernel's state,
        restorable), and removed at once when it was not."""
        save_to = self.workspace.staging_dir / new_snapshot_id()
        holding = (
            self.image_cache.hold_parent(kernel_id)
            if self.settings.track_memory
            else contextlib.nullcontext()
        )
        with holding as parent:
            request = RestoreRequest(
                directory,
                verified=True,
                lazy=lazy,
                save_to=save_to,
                save_parent=parent.path if parent is not None else None,
            )
            dumped = await self.kernels.request_dumping_into(
                self.kernels.handle(kernel_id),
                save_to,
                lambda wrapper: wrapper.restore(request, self.jobs.wrapper_progress(job)),
                catch=WrapperUnavailableError,
                keep_error=True,
            )
        if dumped.error is not None:  # the kernel as saved, sealed before the wrapper died
            log.warning("the kernel saved before a restore (%s) is stored", dumped.manifest.id)
            await self.uploads.upload(None, dumped.manifest, save_to)
            raise dumped.error
        restored: Restored = dumped.answer
        return restored
