"""Finding and running CRIU: ``criu check``, dump, restore and lazy restore.

CRIU is looked for, in this order: an explicit path (a config trait), the
``JUPYTER_SNAPSHOT_CRIU`` environment variable, the private prefix that
``scripts/install-criu.sh`` fills (``/opt/jupyter-kernel-snapshots/criu``, or
``JUPYTER_SNAPSHOT_CRIU_PREFIX``), then ``PATH``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import private, proctree
from ..carried.restorable import fix_for_restore
from ..errors import (
    CriuError,
    CriuNotFoundError,
    CriuNotPermittedError,
    DumpError,
    IncompatibleSnapshotError,
    RestoreError,
)
from ..isolation import mountns
from ..isolation.confinement import Confinement
from ..protocol.environment import DEFAULT_RUNTIME_ROOT, ENV_CRIU, ENV_CRIU_PREFIX
from .deathwatch import TreeDeathWatch, stopped_error
from .frozen import FrozenCopy
from .lazy import UNPRIVILEGED_NO_LAZY, LazyTransfer
from .log import DUMP_LOG_LEVEL, copied_bytes, explain_failure, frozen_seconds, log_excerpt
from .options import (
    DEFAULT_GHOST_LIMIT,
    TCP_DUMP_OPTIONS,
    TCP_KEEP_DUMP_OPTIONS,
    TCP_KEEP_RESTORE_OPTIONS,
    mode_args,
    unprivileged,
)
from .tracking import dirty_tracking, precopies_unprivileged, tracking_args
from .workdirs import working_directories_locked

if TYPE_CHECKING:
    from ..isolation.netns import OwnNetwork
    from ..lazypages import PageSource

log = logging.getLogger(__name__)

MIN_VERSION = (4, 2)
DEFAULT_PREFIX = Path("/opt/jupyter-kernel-snapshots/criu")
INSTALL_HINT = (
    "Install CRIU >= 4.2 with 'sudo scripts/install-criu.sh' from the jupyter-kernel-snapshots "
    "source tree (it uses a private prefix and leaves the system's packages alone), or point "
    f"{ENV_CRIU} at a criu binary."
)


def parse_version(text: str) -> tuple[int, ...] | None:
    """The version in ``criu --version``'s output (also the node agent's hello)."""
    match = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        return None
    return tuple(int(part) for part in match.groups() if part is not None)


def criu_candidates(configured: str | os.PathLike[str] | None = None) -> list[tuple[str, Path]]:
    """Where CRIU may be, in the order it is looked for, each with where the idea came from."""
    found: list[tuple[str, Path]] = []
    if configured:
        found.append(("configuration", Path(configured)))
    if os.environ.get(ENV_CRIU):
        found.append((f"${ENV_CRIU}", Path(os.environ[ENV_CRIU])))
    prefix = Path(os.environ.get(ENV_CRIU_PREFIX) or DEFAULT_PREFIX)
    found.append(("private prefix", prefix / "bin" / "criu"))
    on_path = shutil.which("criu")
    if on_path:
        found.append(("PATH", Path(on_path)))
    return found


#: The kernel features a kernel's dump and restore use (``criu check --feature``):
#: mount ids of open files, epoll targets (kcmp), file locks (``--file-locks``), and
#: process ids restored with ``clone3(set_tid)`` (containers mount /proc/sys read-only, so
#: ``ns_last_pid`` is no way out there).
REQUIRED_FEATURES = ("mnt_id", "kcmp_epoll", "fdinfo_lock", "clone3_set_tid")


@dataclass(frozen=True)
class Criu:
    """A CRIU binary known to start, with its version."""

    path: Path
    version: tuple[int, ...]
    source: str

    @property
    def version_text(self) -> str:
        return ".".join(str(part) for part in self.version)

    @classmethod
    def locate(cls, configured: str | os.PathLike[str] | None = None) -> Criu:
        """The first usable CRIU >= 4.2; raises CriuNotFoundError naming what was tried."""
        return cls(*_locate(configured))

    def check_features(self) -> list[tuple[str, bool, str]]:
        """``criu check --feature`` for each of :data:`REQUIRED_FEATURES`: name, whether
        it is supported, and what CRIU said."""
        results = []
        for feature in REQUIRED_FEATURES:
            try:
                out = subprocess.run(
                    [str(self.path), "check", "--feature", feature, *mode_args()],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                results.append((feature, False, str(exc)))
                continue
            text = (out.stdout + out.stderr).strip()
            said = text.splitlines()[-1] if text else f"exit status {out.returncode}"
            results.append((feature, out.returncode == 0 and "is supported" in text, said))
        return results

    def check(self) -> tuple[bool, str]:
        """Run ``criu check``: whether it passed, and what it printed."""
        out = subprocess.run(
            [str(self.path), "check", *mode_args()], capture_output=True, text=True, timeout=60
        )
        text = (out.stdout + out.stderr).strip()
        return out.returncode == 0 and "Looks good" in text, text

    async def dump(
        self,
        pid: int,
        images_dir: Path,
        work_dir: Path,
        *,
        leave_running: bool,
        externals: Sequence[str] = (),
        keep_tcp: bool = False,
        ghost_limit: int = 0,
        open_by_fd: Sequence[str] = (),
        frozen: FrozenCopy | None = None,
        netns: OwnNetwork | None = None,
        track_mem: bool = False,
        prev_images: Path | None = None,
    ) -> float:
        """Dump the process tree rooted at ``pid`` into ``images_dir``, fixed for a
        restore elsewhere (:func:`..carried.restorable.fix_for_restore`).

        ``track_mem``: protect the pages copied, so that a later dump can copy only those
        written since (:meth:`dirty_tracking`); ``prev_images``: the images (or a stub of
        them, :func:`.chain.make_stub`) of the tree's previous tracked dump or pre-dump:
        the pages not written since are left to them (``images_dir/parent``).

        ``externals`` are CRIU external-resource keys (``file[MNT:INODE]``) that the
        restore will hand over with ``--inherit-fd`` instead of reopening them; of them,
        ``open_by_fd`` are files the restore reopens through that descriptor (/dev/shm).
        ``keep_tcp`` saves the connections inside the tree with their state
        (:data:`TCP_KEEP_DUMP_OPTIONS`), the others closed;
        ``ghost_limit``: the largest deleted file the tree holds (CRIU saves those in the
        images; its default limit is 1 MiB, Ray's object store is one of them).
        ``frozen`` copies while CRIU holds the tree frozen (:mod:`.frozen`). Returns how
        long the tree was frozen (see :func:`frozen_seconds`). ``netns``: the tree's own
        network namespace, where CRIU then runs (core/isolation/netns.py: not dumped itself).
        """
        tcp = TCP_KEEP_DUMP_OPTIONS if keep_tcp else TCP_DUMP_OPTIONS
        args = ["dump", "-t", str(pid), "-D", str(images_dir), "-W", str(work_dir)]
        args += ["-o", "dump.log", f"-v{DUMP_LOG_LEVEL}", "--file-locks", *tcp, *mode_args()]
        args += ["--ghost-limit", str(max(ghost_limit, DEFAULT_GHOST_LIMIT))]
        for key in externals:
            args += ["--external", key]
        if frozen is not None:
            args += ["--action-script", frozen.action_script(work_dir)]
        if leave_running:
            args.append("--leave-running")
        args += tracking_args(track_mem, prev_images)
        try:
            await self._dump_run(pid, args, work_dir, netns)
        finally:
            if frozen is not None:
                frozen.finish()
        await asyncio.to_thread(fix_for_restore, images_dir, open_by_fd, keep_tcp)
        return frozen_seconds(work_dir / "dump.log")

    async def pre_dump(
        self,
        pid: int,
        images_dir: Path,
        work_dir: Path,
        *,
        prev_images: Path | None = None,
        netns: OwnNetwork | None = None,
    ) -> float:
        """Copy the tree's memory into ``images_dir`` while it runs (``criu pre-dump
        --pre-dump-mode read``): frozen only to read its page tables and protect its
        pages, which CRIU then reads with ``process_vm_readv``; a later dump with
        ``prev_images=images_dir`` copies what was written meanwhile. ``prev_images`` as
        for :meth:`dump`. Returns how long the tree was frozen."""
        args = ["pre-dump", "-t", str(pid), "-D", str(images_dir), "-W", str(work_dir)]
        args += ["-o", "dump.log", f"-v{DUMP_LOG_LEVEL}", "--pre-dump-mode", "read", *mode_args()]
        args += tracking_args(True, prev_images)
        await self._dump_run(pid, args, work_dir, netns)
        return frozen_seconds(work_dir / "dump.log")

    async def _dump_run(
        self, pid: int, args: list[str], work_dir: Path, netns: OwnNetwork | None
    ) -> None:
        """Run a dump or pre-dump of ``pid`` (its log in ``work_dir``), watched
        (:mod:`.deathwatch`); DumpError with CRIU's words if it failed."""
        images_dir = Path(args[args.index("-D") + 1])
        for attempt in range(KERNDAT_ATTEMPTS):
            async with working_directories_locked(pid):
                proc = await self._start(args, netns=netns)
                rc, output, stopped = await _watched(proc, pid, images_dir)
            if stopped:
                raise stopped_error(log_excerpt(work_dir / "dump.log", output))
            if rc == 0 or not _kerndat_failed(work_dir / "dump.log", output):
                break
            # CRIU failed in its start-up probes, before it touched the kernel: without a
            # kerndat cache (no tmpfs /run) every CRIU probes, and dumps started at the
            # same moment raced in its TCP-repair probe ("Connection refused").
            await asyncio.sleep(0.05 + random.random() * 0.2 * (attempt + 1))
        if rc != 0:
            excerpt = log_excerpt(work_dir / "dump.log", output)
            message, hint = explain_failure(excerpt, restoring=False, unprivileged=unprivileged())
            raise DumpError(message, hint=hint, log_excerpt=excerpt)

    def dirty_tracking(self) -> tuple[str | None, str]:
        """How this CRIU tracks a process's memory between dumps here (.tracking)."""
        return dirty_tracking(self.path)

    def precopies_unprivileged(self) -> bool:
        """Whether this CRIU pre-copies a big kernel without root (.tracking)."""
        return precopies_unprivileged(self.path)

    def copied_bytes(self, work_dir: Path) -> int:
        """The memory the dump or pre-dump whose work directory is ``work_dir`` copied
        (:func:`.log.copied_bytes` of its log)."""
        return copied_bytes(work_dir / "dump.log")

    async def restore(
        self,
        images_dir: Path,
        work_dir: Path,
        *,
        inherit_fds: Sequence[tuple[int, str]] = (),
        keep_tcp: bool = False,
        mounts: Sequence[str] = (),
        mount_sources: Mapping[str, str] | None = None,
        netns: OwnNetwork | None = None,
    ) -> int:
        """Restore the tree in ``images_dir`` as a sibling of this process; returns its pid.

        ``inherit_fds`` pairs an fd of this process with the resource it replaces in the
        image (``pipe:[INODE]``, or an external ``file[MNT:INODE]``), so the restored
        kernel uses our pipes and directories, not those of the process that was dumped.
        ``keep_tcp``: the images were dumped with ``keep_tcp`` (connections with state).
        ``netns``: the network namespace to restore the tree into (CRIU runs there).
        ``mounts``: the external mount points of the tree's own mount namespace, bound
        from the same paths here, or from ``mount_sources[path]`` (:mod:`..isolation.mountns`).
        """
        return await self._restore(
            images_dir,
            work_dir,
            inherit_fds,
            lazy=False,
            keep_tcp=keep_tcp,
            mounts=mounts,
            mount_sources=mount_sources,
            netns=netns,
        )

    async def restore_lazy(
        self,
        images_dir: Path,
        work_dir: Path,
        source: PageSource,
        *,
        write_through: bool,
        kill_tree: Callable[[int], None],
        inherit_fds: Sequence[tuple[int, str]] = (),
        keep_tcp: bool = False,
        mounts: Sequence[str] = (),
        mount_sources: Mapping[str, str] | None = None,
        netns: OwnNetwork | None = None,
    ) -> tuple[int, LazyTransfer]:
        """Restore as :meth:`restore` does, but with lazy pages: the tree runs at once and
        its memory is read from ``source`` as it touches it, the rest in the background.

        ``images_dir`` needs every image; ``pages-*.img`` may be the sparse files of
        :func:`lazypages.stage_pages_files` (then ``write_through`` fills them in). The
        returned :class:`LazyTransfer` must be awaited; if it fails, kill the tree before
        closing it (a tree left alone without its pages would read zeros). ``work_dir``
        must stay until then. If the restore fails, ``kill_tree`` is called to kill
        every process it made except the lazy-pages daemon (whose pid it gets).
        """
        # Imported here: lazypages reads CRIU's images (criu/images.py), so importing it
        # while this package is set up would go round in a circle.
        from ..lazypages import PageServer

        server = PageServer(images_dir, source, write_through=write_through)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lazy_args = ["lazy-pages", "-D", str(images_dir), "-W", str(work_dir)]
            lazy_args += [
                "-o",
                "lazy-pages.log",
                "--page-server",
                "--ps-socket",
                str(theirs.fileno()),
            ]
            daemon = await self._start(
                lazy_args,
                pass_fds=[theirs.fileno()],
            )
        except BaseException:
            ours.close()
            server.close()
            raise
        finally:
            theirs.close()
        transfer = LazyTransfer(server, daemon, ours, work_dir)
        try:
            await transfer.listening()
            restoring = asyncio.ensure_future(
                self._restore(
                    images_dir,
                    work_dir,
                    inherit_fds,
                    lazy=True,
                    keep_tcp=keep_tcp,
                    mounts=mounts,
                    mount_sources=mount_sources,
                    netns=netns,
                )
            )
            # CRIU's restorer itself touches lazy memory (rseq, TLS): a page that cannot
            # be had leaves `criu restore` waiting for ever, so watch the server too.
            either: list[asyncio.Future[Any]] = [restoring, transfer.served]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not restoring.done() and server.error is not None:
                restoring.cancel()
                with contextlib.suppress(asyncio.CancelledError, CriuError):
                    await restoring
                raise server.error
            pid = await restoring
            server.start_prefetch()
        except BaseException:
            # First the tree (stuck at a missing page), then the daemon: a tree that lost
            # its userfaultfd would run on with zeros for memory.
            kill_tree(daemon.pid)
            transfer.close()
            raise
        return pid, transfer

    async def _restore(
        self,
        images_dir: Path,
        work_dir: Path,
        inherit_fds: Sequence[tuple[int, str]],
        *,
        lazy: bool,
        keep_tcp: bool = False,
        mounts: Sequence[str] = (),
        mount_sources: Mapping[str, str] | None = None,
        netns: OwnNetwork | None = None,
    ) -> int:
        pidfile = work_dir / "restored.pid"
        tcp = TCP_KEEP_RESTORE_OPTIONS if keep_tcp else ("--tcp-close",)
        args = ["restore", "-D", str(images_dir), "-W", str(work_dir), "-o", "restore.log"]
        args += ["-v4", "--file-locks", "--restore-detached", *tcp]
        args += ["--pidfile", str(pidfile), *mode_args()]
        # The restored tree must end up our child. As root CRIU makes it its sibling
        # (--restore-sibling). Without root it stays CRIU's child, so that CRIU, which
        # seizes every task it restored, is their ancestor: Yama's ptrace_scope 1 allows
        # nothing else to a tracer without CAP_SYS_PTRACE (core/isolation/confinement.py); we adopt
        # the tree when CRIU exits (a child subreaper for the restore's duration).
        sibling = not unprivileged()
        if sibling:
            args.append("--restore-sibling")
        if lazy:
            args.append("--lazy-pages")
        for fd, inherited in inherit_fds:
            args += ["--inherit-fd", f"fd[{fd}]:{inherited}"]
        mount_options, missing = mountns.restore_options(
            list(mounts), work_dir / "no-mount", mount_sources
        )
        if missing:
            log.warning(
                "mount points of the snapshot this machine lacks (empty here): %s",
                ", ".join(missing),
            )
        args += mount_options
        adopting = contextlib.nullcontext() if sibling else proctree.subreaper_while()
        made = mountns.make_mount_points(list(mounts))
        try:
            with adopting:
                rc, output = await self._run(args, [fd for fd, _ in inherit_fds], netns)
                deadline = time.monotonic() + PID_FREE_WAIT_SECONDS
                # Again: a process id on its way to be free, or CRIU failed in its start-up
                # probes, before it restored anything (see :meth:`dump`; seen in CI as the
                # TCP-repair probe's "Connection refused").
                while (
                    rc != 0
                    and time.monotonic() < deadline
                    and (
                        pid_being_freed(work_dir)
                        or _kerndat_failed(work_dir / "restore.log", output)
                    )
                ):
                    await asyncio.sleep(0.05 + random.random() * 0.2)
                    rc, output = await self._run(args, [fd for fd, _ in inherit_fds], netns)
        finally:
            mountns.remove_mount_points(made)
        if rc != 0:
            excerpt = log_excerpt(work_dir / "restore.log", output)
            message, hint = explain_failure(excerpt, restoring=True, unprivileged=unprivileged())
            error_cls = (
                IncompatibleSnapshotError if hint.startswith("incompatible:") else RestoreError
            )
            raise error_cls(message, hint=hint.removeprefix("incompatible:"), log_excerpt=excerpt)
        return int(pidfile.read_text().strip())

    def keeps_tcp(self) -> bool:
        """Whether a dump can keep connections with their state (TCP repair needs
        CAP_NET_ADMIN: root)."""
        return not unprivileged()

    def supports_lazy_pages(self) -> tuple[bool, str]:
        """Whether this kernel and CRIU can restore with lazy pages (userfaultfd with
        fork and remove events), and what ``criu check`` said."""
        if os.geteuid() != 0:
            return False, f"lazy pages need root: {UNPRIVILEGED_NO_LAZY}"
        try:
            out = subprocess.run(
                [str(self.path), "check", "--feature", "uffd-noncoop"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return False, str(exc)
        text = (out.stdout + out.stderr).strip()
        return out.returncode == 0 and "is supported" in text, text

    async def _start(
        self, args: list[str], pass_fds: Sequence[int] = (), netns: OwnNetwork | None = None
    ) -> asyncio.subprocess.Process:
        def prepare() -> None:
            # A dump must not go on (holding the kernel seized) after its wrapper died.
            proctree.die_with_parent()
            # CRIU opens a pipe per run of pages (a pre-copy of a big kernel: hundreds);
            # as root it lifts its own limit, an ordinary user's soft limit (often 1024)
            # stays: take the hard one ("Too many open files" otherwise).
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            if soft < hard:
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            if netns is not None:
                netns.enter()

        try:
            return await asyncio.create_subprocess_exec(
                str(self.path),
                *args,
                env=kdat_environment(),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                pass_fds=pass_fds,
                preexec_fn=prepare,
                # A process group of its own: jupyter_client signals the kernel's whole
                # group (SIGINT to interrupt, SIGTERM to end a kernel slow to shut down),
                # which would kill a dump, a restore or the lazy-pages daemon serving a
                # running kernel its memory. The wrapper ends CRIU itself.
                process_group=0,
            )
        except OSError as exc:
            raise CriuError(f"Could not start {self.path}: {exc}", hint=INSTALL_HINT) from exc

    async def _run(
        self, args: list[str], pass_fds: Sequence[int] = (), netns: OwnNetwork | None = None
    ) -> tuple[int, str]:
        return await _finished(await self._start(args, pass_fds, netns))


async def _finished(proc: asyncio.subprocess.Process) -> tuple[int, str]:
    """The exit status and output of a CRIU :meth:`Criu._start` started, once it ended
    (a cancelled caller waits: :func:`_outlive`)."""
    run = asyncio.ensure_future(proc.communicate())
    try:
        out, _ = await asyncio.shield(run)
    except asyncio.CancelledError:
        await _outlive(proc, run)
        raise
    return proc.returncode or 0, out.decode(errors="replace")


async def _watched(
    proc: asyncio.subprocess.Process, root: int, images_dir: Path
) -> tuple[int, str, bool]:
    """:func:`_finished` of a dump's CRIU, which is killed if the tree at ``root`` died
    under it (:mod:`.deathwatch`); and whether it was."""
    with TreeDeathWatch(root, images_dir, functools.partial(_kill_group, proc.pid)) as watch:
        rc, output = await _finished(proc)
    return rc, output, watch.killed


def _kill_group(pid: int) -> None:
    """SIGKILL the process group of a CRIU :meth:`Criu._start` started."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


#: How long a cancelled caller waits for its CRIU to end by itself before killing it.
CANCELLED_CRIU_SECONDS = 60.0


async def _outlive(proc: asyncio.subprocess.Process, run: asyncio.Future[Any]) -> None:
    """Wait for the CRIU of a cancelled caller (a dump whose kernel died, a wrapper
    ending) to end. Killed, it could leave its parasite in a kernel that runs on; left
    running, it would write into folders its caller removes as it unwinds. Another
    cancellation does not cut this short; a CRIU that outlasts
    :data:`CANCELLED_CRIU_SECONDS` is killed."""
    deadline = time.monotonic() + CANCELLED_CRIU_SECONDS
    while not run.done():
        left = deadline - time.monotonic()
        if left <= 0:
            _kill_group(proc.pid)
            left = 5.0
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(asyncio.shield(run), left)
    if not run.cancelled():
        run.exception()  # retrieved: the caller's cancellation is what it hears


def kdat_environment() -> dict[str, str] | None:
    """CRIU's environment: this one, where CRIU keeps what it probes of the kernel
    between runs (as root in its build's RUNDIR, scripts/install-criu.sh); an ordinary user's
    CRIU keeps it in ``$XDG_RUNTIME_DIR``, which is then, if unset, the product's own
    runtime directory (only this user's: another's cache would steer this CRIU). Without
    it every run probes again, ~30 ms before it seizes the kernel."""
    if not unprivileged() or os.environ.get("XDG_RUNTIME_DIR"):
        return None
    try:
        info = private.make_dirs(DEFAULT_RUNTIME_ROOT).stat()
    except OSError:
        return None
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        return None
    return {**os.environ, "XDG_RUNTIME_DIR": str(DEFAULT_RUNTIME_ROOT)}


def _locate(configured: str | os.PathLike[str] | None) -> tuple[Path, tuple[int, ...], str]:
    """Where :meth:`Criu.locate` finds CRIU: path, version and where the idea came from."""
    tried: list[str] = []
    for source, path in criu_candidates(configured):
        if not os.access(path, os.X_OK):
            tried.append(f"{path} ({source}): not found")
            if source in ("configuration", f"${ENV_CRIU}"):
                break
            continue
        try:
            out = subprocess.run(
                [str(path), "--version"], capture_output=True, text=True, timeout=10
            )
        except PermissionError as exc:
            blockers = Confinement.read().blockers(unprivileged=unprivileged())
            if blockers and os.access(path, os.X_OK):
                # execve refused a binary we may run: its file capabilities cannot be
                # had here (a container's bounding set, no_new_privs), not a bad install.
                raise CriuNotPermittedError(
                    f"{path} does not start ({exc}): {blockers[0].message}",
                    hint=blockers[0].fix,
                ) from exc
            tried.append(f"{path} ({source}): does not start: {exc}")
            continue
        except OSError as exc:
            tried.append(f"{path} ({source}): does not start: {exc}")
            continue
        version = parse_version(out.stdout)
        if out.returncode != 0 or version is None:
            tried.append(f"{path} ({source}): does not start: {out.stderr.strip()[:200]}")
            continue
        if version < MIN_VERSION:
            tried.append(f"{path} ({source}): version {'.'.join(map(str, version))} < 4.2")
            continue
        return path, version, source
    raise CriuNotFoundError(
        "No usable CRIU >= 4.2 was found (tried: " + "; ".join(tried) + ").",
        hint=INSTALL_HINT,
    )


#: Tries of a dump whose CRIU failed in its own start-up probes (see :meth:`Criu.dump`).
KERNDAT_ATTEMPTS = 3


def _kerndat_failed(log: Path, output: str) -> bool:
    """Whether CRIU stopped while detecting the kernel's features (nothing was dumped)."""
    return "Could not initialize kernel features detection" in log_excerpt(log, output)


#: How long a restore without a PID namespace waits for a process id of the snapshot that
#: another process holds: a killed one (SIGKILL pending, or a zombie not reaped yet), or
#: the kernel of a killed wrapper, which notices within about a second and exits.
PID_FREE_WAIT_SECONDS = 5.0
_PID_TAKEN = re.compile(r"Can't fork for (\d+): File exists")


def pid_being_freed(work_dir: Path) -> bool:
    """Whether a failed restore only lacked a process id that is on its way to be free.

    Without root the kernel keeps its PIDs (docs/nonroot.md). The kernel that was ended
    for a restore in place may still be a zombie for a moment; the kernel of a wrapper
    that was killed is an orphan (its parent PID 1, or this wrapper's parent, the server,
    which adopts orphans), which notices within about a second and exits. A kernel with
    a live wrapper is another copy of the snapshot: no use waiting.
    """
    try:
        text = (work_dir / "restore.log").read_text(errors="replace")
    except OSError:
        return False
    match = _PID_TAKEN.search(text)
    if match is None:
        return False
    pid = int(match[1])
    return not proctree.is_alive(pid) or proctree.parent(pid) in (1, os.getppid())
