"""A snapshot's kernel in place of the one there is: CRIU restore, then CUDA restore.

The snapshot is read and checked first, before anything is ended: its files (unless the
caller has just verified them), its compatibility with this machine, and the ports it
needs. Then the kernel there is ends, CRIU restores the snapshot's tree as our child, and
the CUDA restore (:mod:`kernel_wrapper.gpusteps`) gives its processes their GPU memory.
A snapshot with kept connections (between its own processes) whose ports (listening, or
of those connections) another process holds here (a copy beside a running kernel of the
same snapshot) is restored, as root, into a network namespace of its own
(:mod:`jupyter_ext.core.isolation.netns`); other snapshots whose ports are taken are refused.
A port taken after that check (CRIU cannot bind it, or binds it beside another process's
``SO_REUSEPORT`` listener) sends such a restore into a namespace of its own as well.

With lazy restore (:mod:`kernel_wrapper.lazyrestore`) the kernel runs as soon as CRIU has
rebuilt it, its memory served page by page: from ``pages_from`` when given (an images
directory, or ``unix:PATH`` of a lazypages.RangeServer lending the store), filling in the
sparse ``pages-*.img`` of the snapshot; else from the snapshot's own images.

A restore that fails leaves nothing of its own behind (files, directories, processes). A
running kernel it replaced is saved first and put back (:mod:`kernel_wrapper.rollback`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from jupyter_ext.core import proctree
from jupyter_ext.core.carried import (
    appended,
    filelocks,
    netports,
    shmfiles,
    sockdiag,
    tcpconns,
    timewait,
)
from jupyter_ext.core.compat import check_compatible
from jupyter_ext.core.criu import Criu, port_taken, unprivileged
from jupyter_ext.core.errors import IncompatibleSnapshotError, PortTakenError, RestoreError
from jupyter_ext.core.isolation import netns, privatetmp
from jupyter_ext.core.isolation.privatetmp import PrivateTemp
from jupyter_ext.core.lazypages import DirectoryPages, PageSource, page_source, stage_pages_files
from jupyter_ext.core.lazypages.chain import flatten, is_chain
from jupyter_ext.core.manifest import IMAGES_DIR, Manifest, verify
from jupyter_ext.core.phases import Phases
from jupyter_ext.core.protocol.progress import ProgressCallback
from kernel_snapshots import write_restore_info

from .channels import InnerChannels
from .lifecycle import State
from .parts import KernelParts
from .supervisor import Supervisor

log = logging.getLogger("kernel_wrapper")


class Restorer:
    """Restores snapshots as the kernel of ``kernel``; it keeps what the last restore did
    (``last_gpu_restore``, ``closed_on_restore``)."""

    def __init__(self, kernel: KernelParts) -> None:
        self.kernel = kernel
        self.last_gpu_restore: dict[str, Any] = {}
        """Timings of the CUDA restore of the last restore (empty without CUDA)."""
        self.closed_on_restore: list[dict[str, Any]] = []
        self.phases = Phases()
        """Where the last restore's time went (its caller starts it: the check and the
        save before come first)."""
        """Connections to outside peers that the last restore gave back closed."""
        self.private_shm: list[dict[str, Any]] = []
        """The /dev/shm names the last restore found held by a live process here (``name``,
        ``held_by``): the kernel has private copies, a new attach by name reaches the
        other process's file (core/carried/shmfiles.py)."""
        self._replaced = timewait.Own(set())
        """The connections and listening ports of the kernel the restore ended (its
        TIME_WAIT entries are its own)."""

    async def checked(self, source: Path, progress: ProgressCallback, verified: bool) -> Manifest:
        """The manifest of the snapshot in ``source``, refused before anything is ended if
        a file does not match it or it cannot run here. ``verified`` skips re-hashing files
        the caller has just checked (the server extension verifies every download); the
        manifest and compatibility are still read."""
        progress({"phase": "verifying"})
        if verified:
            manifest = Manifest.read(source)
        else:
            manifest = await asyncio.to_thread(verify, source)
        check_compatible(manifest)
        self._check_same_kernel(manifest)
        _check_appended(manifest, source)
        self._check_ports_free(manifest)
        self._check_locks_free(manifest, source)
        return manifest

    def _check_same_kernel(self, manifest: Manifest) -> None:
        """Refuse to put a snapshot of another kind of kernel (R, xeus-python, ipykernel:
        language and implementation of its kernel_info) in place of the one this wrapper
        runs: the notebook would change language under its user, and the wrapper's
        agent (kernel_wrapper.agents) would not fit it. A wrapper without a kernel yet
        (a restore into a new kernel, started from the snapshot's kernelspec) takes any."""
        ours, theirs = self.kernel.tracker.kernel_info, manifest.kernel_info
        if not ours or not theirs:
            return
        if kernel_kind(ours) != kernel_kind(theirs):
            raise IncompatibleSnapshotError(
                f"The snapshot is of a {kernel_kind(theirs)} kernel and this kernel runs "
                f"{kernel_kind(ours)}: it cannot take its place.",
                hint="Restore it into a new kernel (it starts the snapshot's own kernelspec).",
            )

    def _check_locks_free(self, manifest: Manifest, source: Path) -> None:
        """Refuse a snapshot whose file locks another process holds here (core/carried/filelocks.py:
        CRIU would wait for them for ever), unless they all lie in the kernel's temporary
        directory, of which such a copy gets a private view (core/isolation/privatetmp.py); the
        kernel being replaced does not count."""
        pid = self.kernel.process.pid
        locked = _locked_elsewhere(manifest, source, proctree.descendants(pid) if pid else [])
        if not locked or self._private_temp_covers(manifest, locked):
            return
        raise IncompatibleSnapshotError(
            "The snapshot's kernel held locks on files that another process holds locked "
            f"here: {', '.join(f'{path} (locked by process {holder})' for path, holder in locked)}."
            " The restore would wait for them.",
            hint="End that process (another copy of this kernel?), then restore again.",
        )

    @staticmethod
    def _private_temp_covers(manifest: Manifest, locked: list[tuple[str, int]]) -> bool:
        """Whether a private view of the snapshot's temporary directory frees every one of
        the ``locked`` files (root, overlayfs, and the kernel had bound the directory)."""
        temp = manifest.temp_dir
        return (
            bool(temp)
            and not unprivileged()
            and all(path.startswith(temp.rstrip("/") + "/") for path, _ in locked)
            and privatetmp.overlay_supported()
        )

    def _private_temp_for(self, manifest: Manifest, source: Path) -> PrivateTemp | None:
        """A private view of the temporary directory for a restored tree whose file locks
        there another process holds now (a copy beside a running kernel of the snapshot),
        else None (the server's directory)."""
        locked = _locked_elsewhere(manifest, source)
        if not locked or not self._private_temp_covers(manifest, locked):
            return None
        log.info(
            "files the snapshot locks are locked here (%s): restoring it with a private view of %s",
            ", ".join(path for path, _ in locked),
            manifest.temp_dir,
        )
        return PrivateTemp.create(manifest.temp_dir, self.kernel.runtime.path)

    def _check_ports_free(self, manifest: Manifest) -> None:
        """Refuse, before anything is ended, a snapshot whose listening or bound ports
        another process holds here (the kernel being replaced does not count), naming
        it, unless it keeps connections and can have a network namespace of its own (root,
        slirp4netns); a listener without them (a web app) keeps today's refusal: in a
        namespace of its own nobody outside the copy would reach it. Ports held only by
        TIME_WAIT entries are not taken: no process holds them, and the restore clears
        them (core/carried/timewait.py)."""
        ports = [netports.BoundPort.from_dict(p) for p in manifest.bound_ports]
        if not ports:
            return
        pid = self.kernel.process.pid
        own = sockdiag.tree_socket_inodes(proctree.descendants(pid)) if pid else set()
        taken = netports.taken_ports(ports, ignore=own)
        if not taken:
            return
        own_network = manifest.tcp_kept and not unprivileged()
        if not own_network or netns.slirp_path() is None:
            raise IncompatibleSnapshotError(
                "The snapshot's kernel had network ports open that another process holds "
                f"here: {'; '.join(taken)}.",
                hint="Stop the process that holds them, or restore "
                "on a machine where they are free"
                + (", or install slirp4netns (docs/network.md)." if own_network else "."),
            )
        log.info(
            "ports of the snapshot are taken here (%s): restoring it into a network "
            "namespace of its own",
            ", ".join(taken),
        )

    def _running_kernel(self) -> timewait.Own:
        """The connections and listening ports of the running kernel (none: empty)."""
        pid = self.kernel.process.pid
        if pid is None:
            return timewait.Own(set())
        pids = proctree.descendants(pid)
        sockets = sockdiag.TreeSockets.of(pids)
        connections = tcpconns.tree_connections(pids, sockets)
        listening = netports.bound_ports(sockets, pid)
        return timewait.Own(
            timewait.connection_pairs(
                c.to_dict() for c in connections.inside + connections.outside
            ),
            tuple(listening),
        )

    @staticmethod
    def _network_for(manifest: Manifest, apart: bool = False) -> netns.OwnNetwork | None:
        """A network namespace of its own for a restored tree with kept connections if its
        ports (listening, or those connections' local ones) are taken here now, or
        ``apart``, else None (the server's). The addresses its sockets are bound to are on
        its loopback there."""
        if not _may_go_apart(manifest):
            return None
        ports = [netports.BoundPort.from_dict(p) for p in manifest.bound_ports]
        kept = [str(c["local"]) for c in manifest.kept_connections]
        if not apart and not netports.taken_ports(ports) + netports.taken_endpoints(kept):
            return None
        addresses = [p.address for p in ports] + [netports.endpoint_address(e) for e in kept]
        return netns.OwnNetwork.create(addresses)

    async def restore(
        self, source: Path, manifest: Manifest, criu: Criu, *, lazy: bool, pages_from: str | None
    ) -> None:
        """The snapshot in ``source`` as the kernel (see replace_inner), which then goes on
        from it: its next snapshot follows this one."""

        def restored() -> None:
            self.kernel.record.restored(manifest)
            self.kernel.agent.restored(self.kernel.record.cells_through)
            self.kernel.tracker.snapshot_taken()

        await self.replace_inner(source, manifest, criu, restored, lazy=lazy, pages_from=pages_from)

    async def replace_inner(
        self,
        source: Path,
        manifest: Manifest,
        criu: Criu,
        before_running: Callable[[], None],
        *,
        lazy: bool = False,
        pages_from: str | None = None,
    ) -> None:
        """CRIU (and CUDA) restore of ``source`` as the inner kernel, after ending the one
        there is; ``before_running`` updates the kernel's records just before requests flow
        again (held requests then count as new work). On failure the state says what is
        left: SUSPENDED if the kernel was suspended, else DEAD."""
        previous = self.kernel.lifecycle.state
        self.kernel.lifecycle.enter(State.RESTORING)
        phase = self.phases.phase
        try:
            self._replaced = self._running_kernel()
            with phase("end the kernel there was"):
                await self.kernel.process.kill()
                # Still being filled in lazily (an undo right after another): those pages
                # are not wanted any more, and the kernel saved before that restore must
                # not come back once its transfer ends (seen: the undo undone again).
                self.kernel.lazy.give_up()
                await self.kernel.relay.close_inner()
            self.kernel.relay.connect_inner(InnerChannels(self.kernel.runtime.path))
            # The restored kernel reads this before its next cell and runs its restore
            # hooks (its TCP connections come back closed; kernel_snapshots).
            write_restore_info(
                self.kernel.runtime.path,
                snapshot_id=manifest.id,
                snapshot_created=manifest.created,
                snapshot_host=manifest.host,
                in_place=previous != State.STARTING,
                resumed=self.kernel.record.suspended_snapshot == source,
                closed_connections=manifest.closed_connections,
            )
            try:
                pid, own = await self._criu_tree(source, manifest, criu, lazy, pages_from)
            except IncompatibleSnapshotError as exc:
                if not (_may_go_apart(manifest) and netns.slirp_path() and port_taken(exc)):
                    raise
                # Free when checked, taken by the time CRIU bound it (a port the replaced
                # kernel had just let go of, given to another process's connection).
                log.warning(
                    "a port of the snapshot was taken during its restore: restoring it into "
                    "a network namespace of its own"
                )
                # A tree CRIU restored may have run (a shared port is found after): its
                # channels go with it, and the next one gets fresh ones.
                await self.kernel.relay.close_inner()
                self.kernel.relay.connect_inner(InnerChannels(self.kernel.runtime.path))
                pid, own = await self._criu_tree(
                    source, manifest, criu, lazy, pages_from, apart=True
                )
            try:
                with phase("CUDA restore"):
                    await self._cuda_restore(manifest, pid)
            except BaseException:
                own.close()
                raise
        except BaseException:
            if self.kernel.process.pid is None:
                await self.kernel.relay.close_inner()
            self.kernel.lifecycle.enter(
                State.SUSPENDED
                if previous == State.SUSPENDED
                else State.DEAD
                if self.kernel.process.pid is None
                else State.RUNNING
            )
            raise
        self._running(pid, own, manifest, before_running)

    def _running(
        self,
        pid: int,
        own: OwnParts,
        manifest: Manifest,
        before_running: Callable[[], None],
    ) -> None:
        """The restored kernel ``pid`` (with what it has of its own) takes over: requests
        flow to it again."""
        self.kernel.process.adopt(pid, own.network, own.private_temp)
        self.kernel.record.lineage = manifest.lineage
        self.kernel.tracker.kernel_info = manifest.kernel_info or self.kernel.tracker.kernel_info
        # A restore is activity: a kernel resumed for a cell must not look idle since
        # before its suspend and be suspended again before that cell even starts.
        self.kernel.tracker.last_activity = time.time()
        before_running()
        self.kernel.tracker.resume_request(manifest.running_request)
        self.kernel.lifecycle.enter(State.RUNNING)

    async def _cuda_restore(self, manifest: Manifest, pid: int) -> None:
        """After ``criu restore`` of the tree ``pid``: the CUDA restore. On failure the
        tree (and the transfer of a lazy restore) is gone again."""
        self.closed_on_restore = manifest.closed_connections
        try:
            self.last_gpu_restore = await self.kernel.gpu.restore(manifest, pid)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            if self.kernel.lazy.transfer is not None:
                self.kernel.lazy.drop(self.kernel.lazy.transfer)
            raise

    async def _criu_tree(
        self,
        source: Path,
        manifest: Manifest,
        criu: Criu,
        lazy: bool,
        pages_from: str | None,
        apart: bool = False,
    ) -> tuple[int, OwnParts]:
        """``criu restore`` of the tree (lazily: ``lazy.transfer`` is then the transfer),
        with the files it needs made here first, in a network namespace of its own if its
        ports are taken here (or ``apart``), with a private view of its temporary directory
        if its file locks there are; returns the kernel's pid and what it has of its own. On
        failure those files, what it had of its own, and whatever CRIU restored, are gone
        again."""
        phase = self.phases.phase
        with phase("files and ports"):
            made, shm = await _make_files(manifest, source)
        work_dir = Path(tempfile.mkdtemp(prefix="restore-", dir=self.kernel.runtime.path))
        before = set(proctree.children(os.getpid()))
        inherit_fds = [
            (self.kernel.process.stdio_w, manifest.stdio_pipe),
            (self.kernel.runtime.fd, manifest.runtime_dir_key),
            *shm.inherit,
        ]
        own = OwnParts()
        try:
            own.network = network = await asyncio.to_thread(self._network_for, manifest, apart)
            if network is not None:
                before.add(network.helper.pid)  # ends with close(), not as a leftover
            own.private_temp = private_temp = await asyncio.to_thread(
                self._private_temp_for, manifest, source
            )
            mount_sources = own.mount_sources()
            images = source / IMAGES_DIR
            if lazy and is_chain(images) and pages_from and not _has_pages(images):
                # A chain whose memory is all elsewhere: staged whole here, as the level
                # files the images must end with, then restored as it is.
                lazy = False
            with phase("memory laid out"):
                if lazy and is_chain(images):  # CRIU reads a chain's parents eagerly: flat
                    images, pages, kept_here = await _flat(images, pages_from, work_dir)
                else:
                    pages, kept_here = await _pages(images, pages_from, lazy)
            if network is None:  # the ports it binds are this namespace's
                with phase("files and ports"):
                    await timewait.clear(
                        [netports.BoundPort.from_dict(p) for p in manifest.bound_ports],
                        _own_entries(manifest) | self._replaced,
                    )
            if not lazy:
                with phase("criu restore"):
                    pid = await criu.restore(
                        images,
                        work_dir,
                        inherit_fds=inherit_fds,
                        keep_tcp=manifest.tcp_kept,
                        mounts=manifest.mounts,
                        mount_sources=mount_sources,
                        netns=network,
                    )
            else:
                self.kernel.lazy.starting()
                with phase("criu restore (lazy)"):
                    pid, self.kernel.lazy.transfer = await criu.restore_lazy(
                        images,
                        work_dir,
                        pages,
                        write_through=kept_here,
                        kill_tree=lambda daemon: Supervisor.kill_children_except(before | {daemon}),
                        inherit_fds=inherit_fds,
                        keep_tcp=manifest.tcp_kept,
                        mounts=manifest.mounts,
                        mount_sources=mount_sources,
                        netns=network,
                    )
            if network is None:
                await asyncio.to_thread(_check_ports_alone, manifest, pid)
            if private_temp is not None:
                private_temp.detach()  # the copy's mount namespace holds it now
            self.private_shm = shm.private
            return pid, own
        except BaseException as exc:
            shm.undo()
            _remove_made(made)
            # CRIU restores the tree as our child: one it gave up on (or that died with
            # it) must not stay behind, half-restored.
            Supervisor.kill_children_except(before)
            own.close()  # after the tree: no process of it may see its network go
            if lazy:
                if self.kernel.lazy.transfer is not None:  # its kernel was found wanting
                    self.kernel.lazy.drop(self.kernel.lazy.transfer)
                self.kernel.lazy.failed(exc)
            raise
        finally:
            shm.close_fds()
            if self.kernel.lazy.transfer is None:
                shutil.rmtree(work_dir, ignore_errors=True)


def _check_ports_alone(manifest: Manifest, pid: int) -> None:
    """Raise PortTakenError if another process listens on a port the restored tree ``pid``
    does. CRIU binds every socket it restores with ``SO_REUSEPORT`` (several of the tree's
    may share a port), so a port another process took with it since the check before the
    restore (gRPC servers set it) is shared, each getting some of the other's connections,
    and CRIU does not fail."""
    ports = [netports.BoundPort.from_dict(p) for p in manifest.bound_ports]
    if not ports:
        return
    own = sockdiag.tree_socket_inodes(proctree.descendants(pid))
    if not own:  # its sockets out of our sight: every listener would look another's
        log.info("the restored kernel's sockets cannot be read: its ports not looked at again")
        return
    taken = netports.taken_ports(ports, ignore=own)
    if taken:
        raise PortTakenError(
            "The snapshot's kernel listens on network ports another process took here "
            f"during the restore: {'; '.join(taken)}.",
            hint="Stop the process that holds them and restore again.",
        )


def _may_go_apart(manifest: Manifest) -> bool:
    """Whether a restored tree may go into a network namespace of its own: as root, with
    its connections kept (their ports are then taken together with their ends)."""
    return not unprivileged() and manifest.tcp_kept


@dataclasses.dataclass
class OwnParts:
    """What a restored copy has of its own, not the server's; all of it ends with it."""

    network: netns.OwnNetwork | None = None
    private_temp: PrivateTemp | None = None

    def mount_sources(self) -> dict[str, str]:
        """Where the restore binds the copy's mount points from, where not the same path."""
        if self.private_temp is None:
            return {}
        return {self.private_temp.lower: str(self.private_temp.source)}

    def close(self) -> None:
        if self.network is not None:
            self.network.close()
        if self.private_temp is not None:
            self.private_temp.close()


def _own_entries(manifest: Manifest) -> timewait.Own:
    """What makes a TIME_WAIT entry one of the snapshot's kernel: a connection it recorded."""
    return timewait.Own(
        timewait.connection_pairs(manifest.kept_connections + manifest.closed_connections)
    )


def _check_appended(manifest: Manifest, source: Path) -> None:
    """Refuse, before anything is ended, a snapshot whose appended files cannot be put back
    here (core/carried/appended.py): not the kernel's any more, or not carried and gone."""
    problems = appended.problems(manifest.appended_files, source)
    if problems:
        raise IncompatibleSnapshotError(
            "Files the kernel appended to are missing or changed here: " + "; ".join(problems[:5]),
            hint="Put those files back (or move the ones there aside), then restore again.",
        )


def kernel_kind(kernel_info: dict[str, Any]) -> str:
    """A kernel's language and implementation, from its kernel_info ("R (IRkernel)")."""
    language = str((kernel_info.get("language_info") or {}).get("name") or "?")
    return f"{language} ({kernel_info.get('implementation') or '?'})"


def _locked_elsewhere(
    manifest: Manifest, source: Path, ignore: Collection[int] = ()
) -> list[tuple[str, int]]:
    """The files the snapshot's kernel held open and locked that a process here (not in
    ``ignore``) holds a lock on, with that process."""
    if not filelocks.snapshot_locks_files(source):
        return []
    paths = [str(f["path"]) for f in manifest.needed_files if f["kind"] == "open"]
    return filelocks.locked_elsewhere(paths, ignore)


async def _make_files(manifest: Manifest, source: Path) -> tuple[list[Path], shmfiles.Recreated]:
    """What the restored tree needs here besides its images: the directories of its unix
    sockets, the empty files it held open in its temporary directory, the files it
    appended to (as they were at the snapshot), its /dev/shm files.
    Nothing stays behind if this fails."""
    made: list[Path] = []
    try:
        # A multiprocessing manager's socket lives in a /tmp/pymp-* another node lacks;
        # Dask's workers lock empty files in /tmp/dask-scratch-space, which the cluster's
        # shutdown removed (and another node never had).
        made += netports.make_missing_dirs(manifest.unix_socket_dirs)
        made += privatetmp.make_missing_empty_files(manifest.needed_files, manifest.temp_dir)
        await asyncio.to_thread(appended.put_back, manifest.appended_files, source, made)
        shm = await asyncio.to_thread(shmfiles.recreate, manifest.shm_files, source)
    except BaseException:
        _remove_made(made)
        raise
    if shm.private:
        log.warning(
            "restoring with private copies of /dev/shm files whose names a live process "
            "holds here (another copy of this snapshot?): %s",
            "; ".join(f"{p['name']} (held by {p['held_by']})" for p in shm.private),
        )
    return made, shm


async def _pages(images: Path, pages_from: str | None, lazy: bool) -> tuple[PageSource, bool]:
    """Where the kernel's memory comes from, and whether the pages files in ``images``
    are kept by that source (the server downloads them as the kernel runs; else this
    wrapper makes and completes them)."""
    pages = page_source(pages_from) if pages_from else DirectoryPages(images)
    kept_here = pages_from is not None and not any(images.glob("pages-*.img"))
    if pages_from is not None and (kept_here or not lazy):
        # What criu restore reads from the files itself (not lazy: every page).
        await _stage(images, pages, lazy)
    return pages, kept_here


def _has_pages(images: Path) -> bool:
    return any(images.rglob("pages-*.img"))


async def _flat(
    images: Path, pages_from: str | None, work_dir: Path
) -> tuple[Path, PageSource, bool]:
    """For a lazy restore of a chained snapshot: the flat images CRIU restores from
    (core/lazypages/chain.py), in ``work_dir``, with what CRIU reads itself staged, and
    the source of their pages (every level of the chain, read where it is)."""
    chain = page_source(pages_from) if pages_from else DirectoryPages(images)
    flat = work_dir / "flat-images"
    try:
        pages = await asyncio.to_thread(flatten, images, flat, chain)
    except OSError as exc:
        raise RestoreError(
            f"The snapshot's memory chain could not be laid out in {flat}: {exc}.",
            hint="Free space on that disk, then restore again.",
        ) from exc
    await _stage(flat, pages, lazy=True)
    return flat, pages, False


async def _stage(images: Path, pages: PageSource, lazy: bool) -> None:
    """Write into the images' pages files what ``criu restore`` reads from them itself."""
    try:
        await asyncio.to_thread(stage_pages_files, images, pages, lazy_too=not lazy)
    except OSError as exc:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        raise RestoreError(
            f"The kernel's memory could not be staged in {images}: {exc.strerror or exc}.",
            hint="Free space on that disk (or set work_dir to one with room for the "
            "kernel's memory), then restore again."
            if full
            else "Make sure the store is reachable, then restore again.",
        ) from exc


def _remove_made(made: list[Path]) -> None:
    """Remove the files and directories a failed restore made (innermost first), the
    directories if still empty."""
    for path in reversed(made):
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            else:
                path.unlink()
