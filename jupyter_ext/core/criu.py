"""Finding and running CRIU.

CRIU is looked for, in this order: an explicit path (a config trait), the
``JUPYTER_SNAPSHOT_CRIU`` environment variable, the private prefix that
``scripts/install-criu.sh`` fills (``/opt/jupyter-kernel-snapshots/criu``, or
``JUPYTER_SNAPSHOT_CRIU_PREFIX``), then ``PATH``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import random
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import mountns, proctree
from .confinement import Confinement, explain_denied
from .criulog import frozen_seconds as frozen_seconds
from .criulog import log_excerpt as log_excerpt
from .errors import (
    CriuError,
    CriuNotFoundError,
    CriuNotPermittedError,
    DumpError,
    IncompatibleSnapshotError,
    RestoreError,
)
from .humanize import human_bytes
from .lazypages import PageServer, PageSource
from .protocol import ENV_CRIU, ENV_CRIU_PREFIX

if TYPE_CHECKING:
    from .netns import OwnNetwork

log = logging.getLogger(__name__)

MIN_VERSION = (4, 2)
DEFAULT_PREFIX = Path("/opt/jupyter-kernel-snapshots/criu")
INSTALL_HINT = (
    "Install CRIU >= 4.2 with 'sudo scripts/install-criu.sh' from the jupyter-kernel-snapshots "
    "source tree (it uses a private prefix and leaves the system's packages alone), or point "
    f"{ENV_CRIU} at a criu binary."
)


def _parse_version(text: str) -> tuple[int, ...] | None:
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


#: File capabilities with which an ordinary user runs the product's CRIU copy
#: (docs/nonroot.md, measured): CAP_CHECKPOINT_RESTORE opens /proc/PID/map_files and picks
#: the restored PIDs (clone3 set_tid); CAP_SETPCAP lets a restore trim the bounding set to
#: the image's. No CAP_SYS_PTRACE: the kernels are the user's own, ptrace needs none.
UNPRIVILEGED_CAPS = "cap_checkpoint_restore,cap_setpcap+ep"


def unprivileged() -> bool:
    """Whether CRIU runs without root: then with ``--unprivileged`` on its file
    capabilities, and kernels have no PID or time namespace of their own (CRIU 4.2 cannot
    dump a task in another PID namespace without CAP_SYS_ADMIN; docs/nonroot.md)."""
    return os.geteuid() != 0


def mode_args() -> list[str]:
    """CRIU options for this process's privileges."""
    return ["--unprivileged"] if unprivileged() else []


#: How a dump treats the kernel's TCP connections. ``--tcp-close`` records them without
#: their state and leaves them alone: no repair mode, no network lock (so neither iptables
#: nor nftables nor CAP_NET_ADMIN), no packet dropped, the running kernel's connections
#: untouched; a restore (always ``--tcp-close``) gives them back closed, and clients
#: reconnect. Saving their state (``--tcp-established``) would need a lock and could only
#: bring a connection back where its peer still has it in the same state, never after the
#: kernel ran on. ``--skip-in-flight``: connections a listening socket has not accepted yet
#: are left out (the running kernel still accepts them), instead of failing the dump.
TCP_DUMP_OPTIONS = ("--tcp-close", "--skip-in-flight")
#: How a dump of a tree with connections between its own processes saves them (with root:
#: TCP repair needs CAP_NET_ADMIN): with their state, to come back established (the ones
#: with an outside peer are made closed in the images afterwards: core/tcpconns.py). No
#: network lock: both ends of a kept connection are frozen, and what an outside peer sends
#: meanwhile reaches the running kernel (TCP repair mode loses no data); the copy of such a
#: connection in the snapshot is restored closed anyway. Measured: docs/network.md.
TCP_KEEP_DUMP_OPTIONS = ("--tcp-established", "--network-lock", "skip", "--skip-in-flight")
TCP_KEEP_RESTORE_OPTIONS = ("--tcp-established", "--network-lock", "skip")

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
            version = _parse_version(out.stdout)
            if out.returncode != 0 or version is None:
                tried.append(f"{path} ({source}): does not start: {out.stderr.strip()[:200]}")
                continue
            if version < MIN_VERSION:
                tried.append(f"{path} ({source}): version {'.'.join(map(str, version))} < 4.2")
                continue
            return cls(path, version, source)
        raise CriuNotFoundError(
            "No usable CRIU >= 4.2 was found (tried: " + "; ".join(tried) + ").",
            hint=INSTALL_HINT,
        )

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
        action_script: str | None = None,
        netns: OwnNetwork | None = None,
    ) -> float:
        """Dump the process tree rooted at ``pid`` into ``images_dir``.

        ``externals`` are CRIU external-resource keys (``file[MNT:INODE]``) that the
        restore will hand over with ``--inherit-fd`` instead of reopening them.
        ``keep_tcp`` saves TCP connections with their state (:data:`TCP_KEEP_DUMP_OPTIONS`);
        ``ghost_limit``: the largest deleted file the tree holds (CRIU saves those in the
        images; its default limit is 1 MiB, Ray's object store is one of them).
        ``action_script`` runs at CRIU's steps (post-dump: still frozen). Returns how long
        the tree was frozen (see :func:`frozen_seconds`). ``netns``: the tree's own network
        namespace, where CRIU then runs (core/netns.py: not dumped itself).
        """
        tcp = TCP_KEEP_DUMP_OPTIONS if keep_tcp else TCP_DUMP_OPTIONS
        args = ["dump", "-t", str(pid), "-D", str(images_dir), "-W", str(work_dir)]
        args += ["-o", "dump.log", "-v4", "--file-locks", *tcp, *mode_args()]
        args += ["--ghost-limit", str(max(ghost_limit, DEFAULT_GHOST_LIMIT))]
        for key in externals:
            args += ["--external", key]
        if action_script is not None:
            args += ["--action-script", action_script]
        if leave_running:
            args.append("--leave-running")
        for attempt in range(KERNDAT_ATTEMPTS):
            async with working_directories_locked(pid):
                rc, output = await self._run(args, netns=netns)
            if rc == 0 or not _kerndat_failed(work_dir / "dump.log", output):
                break
            # CRIU failed in its start-up probes, before it touched the kernel: without a
            # kerndat cache (no tmpfs /run) every CRIU probes, and dumps started at the
            # same moment raced in its TCP-repair probe ("Connection refused"). Again.
            await asyncio.sleep(0.05 + random.random() * 0.2 * (attempt + 1))
        if rc != 0:
            excerpt = log_excerpt(work_dir / "dump.log", output)
            message, hint = explain_failure(excerpt, restoring=False)
            raise DumpError(message, hint=hint, log_excerpt=excerpt)
        return frozen_seconds(work_dir / "dump.log")

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
        from the same paths here, or from ``mount_sources[path]`` (:mod:`.mountns`).
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
        # nothing else to a tracer without CAP_SYS_PTRACE (core/confinement.py); we adopt
        # the tree when CRIU exits (a child subreaper for the restore's duration).
        sibling = not unprivileged()
        if sibling:
            args.append("--restore-sibling")
        if lazy:
            args.append("--lazy-pages")
        for fd, resource in inherit_fds:
            args += ["--inherit-fd", f"fd[{fd}]:{resource}"]
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
        with adopting:
            rc, output = await self._run(args, [fd for fd, _ in inherit_fds], netns)
            deadline = time.monotonic() + PID_FREE_WAIT_SECONDS
            while rc != 0 and time.monotonic() < deadline and pid_being_freed(work_dir):
                await asyncio.sleep(0.05)
                rc, output = await self._run(args, [fd for fd, _ in inherit_fds], netns)
        if rc != 0:
            excerpt = log_excerpt(work_dir / "restore.log", output)
            message, hint = explain_failure(excerpt, restoring=True)
            error_cls = (
                IncompatibleSnapshotError if hint.startswith("incompatible:") else RestoreError
            )
            raise error_cls(message, hint=hint.removeprefix("incompatible:"), log_excerpt=excerpt)
        return int(pidfile.read_text().strip())

    def supports_lazy_pages(self) -> tuple[bool, str]:
        """Whether this kernel and CRIU can restore with lazy pages (userfaultfd with
        fork and remove events), and what ``criu check`` said."""
        if os.geteuid() != 0:
            # The restored kernel makes its own userfaultfd: without root that needs
            # vm.unprivileged_userfaultfd = 1 and CRIU's --unprivileged lazy mode, untested.
            return False, "lazy pages need root"
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
            if netns is not None:
                netns.enter()

        try:
            return await asyncio.create_subprocess_exec(
                str(self.path),
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                pass_fds=pass_fds,
                preexec_fn=prepare,
            )
        except OSError as exc:
            raise CriuError(f"Could not start {self.path}: {exc}", hint=INSTALL_HINT) from exc

    async def _run(
        self, args: list[str], pass_fds: Sequence[int] = (), netns: OwnNetwork | None = None
    ) -> tuple[int, str]:
        proc = await self._start(args, pass_fds, netns)
        out, _ = await proc.communicate()
        return proc.returncode or 0, out.decode(errors="replace")


#: CRIU's own ghost-file limit, the least a dump passes.
DEFAULT_GHOST_LIMIT = 1 << 20

#: Tries of a dump whose CRIU failed in its own start-up probes (see :meth:`Criu.dump`).
KERNDAT_ATTEMPTS = 3


def _kerndat_failed(log: Path, output: str) -> bool:
    """Whether CRIU stopped while detecting the kernel's features (nothing was dumped)."""
    return "Could not initialize kernel features detection" in log_excerpt(log, output)


#: How long CRIU's lazy-pages daemon may take to listen before a lazy restore gives up.
LAZY_DAEMON_START_SECONDS = 10.0


class LazyTransfer:
    """The pages of a lazily restored tree on their way: CRIU's lazy-pages daemon, and
    the :class:`PageServer` thread that answers it."""

    def __init__(
        self,
        server: PageServer,
        daemon: asyncio.subprocess.Process,
        sock: socket.socket,
        work_dir: Path,
    ) -> None:
        self.server = server
        self.daemon = daemon
        self.work_dir = work_dir
        self.started = time.monotonic()
        self.finished: float | None = None
        self._sock = sock
        loop = asyncio.get_running_loop()
        self.served: asyncio.Future[None] = loop.create_future()

        def serve() -> None:
            try:
                server.serve(sock)
            finally:
                loop.call_soon_threadsafe(self._set_served)

        self._thread = threading.Thread(target=serve, name="lazy-pages", daemon=True)
        self._thread.start()

    def _set_served(self) -> None:
        if not self.served.done():
            self.served.set_result(None)

    async def listening(self) -> None:
        """Wait until the daemon listens for ``criu restore --lazy-pages``."""
        socket_path = self.work_dir / "lazy-pages.socket"
        deadline = time.monotonic() + LAZY_DAEMON_START_SECONDS
        while not socket_path.exists():
            if self.daemon.returncode is not None or time.monotonic() > deadline:
                raise RestoreError(
                    "CRIU's lazy-pages daemon did not start.",
                    hint="Check 'jupyter snapshot doctor' (lazy restore), or set "
                    "SnapshotExtensionApp.lazy_restore = False.",
                    log_excerpt=log_excerpt(self.work_dir / "lazy-pages.log", ""),
                )
            await asyncio.sleep(0.005)

    async def wait(self) -> None:
        """Until every page is in place; raises (leaving the daemon waiting, so the tree
        stays frozen at its next missing page) when a page could not be served."""
        await asyncio.shield(self.served)
        if self.server.error is not None:
            raise self.server.error
        rc = await self.daemon.wait()
        self.finished = time.monotonic()
        if rc != 0:
            excerpt = log_excerpt(self.work_dir / "lazy-pages.log", "")
            raise RestoreError(
                f"CRIU's lazy-pages daemon failed (exit status {rc}) before every page of "
                "the kernel was in place.",
                hint="Read the CRIU log lines below; restore again, or set "
                "SnapshotExtensionApp.lazy_restore = False.",
                log_excerpt=excerpt,
            )

    def close(self) -> None:
        """End the transfer: the daemon ends when its page server goes away."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=10)
        self._sock.close()
        if self.daemon.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.daemon.kill()
        self.server.close()


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


#: What CRIU's parasite creates, and mounts a private /proc on, in the working directory of
#: each dumped task whose /proc belongs to another PID namespace (criu/pie/parasite.c).
PARASITE_PROC_DIR = "proc.crtools"
#: How often a dump waiting for another one to leave a shared directory looks again.
LOCK_POLL_SECONDS = 0.01
MNT_DETACH = 2


@contextlib.asynccontextmanager
async def working_directories_locked(pid: int) -> AsyncIterator[None]:
    """Hold an exclusive lock on every working directory of the tree at ``pid`` while it is
    dumped, and clear what an interrupted dump left in them.

    The kernel lives in its own PID namespace, so /proc is not its own: CRIU's parasite
    then makes ``proc.crtools`` in the task's working directory to mount a private /proc
    there. Two dumps of kernels sharing a directory (a notebook folder) collide on that
    name ("Can't create a directory (-17)", "can't get /proc fd") and one fails. Every dump
    of this product takes the directory's lock (flock on the directory itself, so also
    between servers and users sharing it); the others wait a moment, unfrozen. A
    ``proc.crtools`` found while the lock is held was left by a dump that was killed.
    """
    held: list[int] = []
    seen: set[tuple[int, int]] = set()
    try:
        for task in proctree.descendants(pid):
            try:
                fd = os.open(f"/proc/{task}/cwd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                continue  # gone, or not ours to open: CRIU reports what it cannot do
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) in seen:
                os.close(fd)
                continue
            seen.add((st.st_dev, st.st_ino))
            held.append(fd)
        # One order for every dumper, so two trees sharing two directories cannot deadlock.
        held.sort(key=lambda fd: (os.fstat(fd).st_dev, os.fstat(fd).st_ino))
        for fd in held:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await asyncio.sleep(LOCK_POLL_SECONDS)
            _remove_stale_parasite_dir(fd)
        yield
    finally:
        for fd in held:
            os.close(fd)  # closing releases the lock


def _remove_stale_parasite_dir(dir_fd: int) -> None:
    """Remove the ``proc.crtools`` a killed dump left in a directory we hold locked."""
    try:
        os.rmdir(PARASITE_PROC_DIR, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            log.warning("cannot remove a stale %s: %s", PARASITE_PROC_DIR, exc)
            return
        # Still a mount point (the dump died between mount and unmount): detach it first.
        target = f"/proc/self/fd/{dir_fd}/{PARASITE_PROC_DIR}".encode()
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.umount2(target, MNT_DETACH) != 0:
            log.warning("cannot unmount a stale %s: errno %d", target, ctypes.get_errno())
            return
        with contextlib.suppress(OSError):
            os.rmdir(PARASITE_PROC_DIR, dir_fd=dir_fd)
    log.info("removed a %s left by an interrupted dump", PARASITE_PROC_DIR)


# (pattern in the log, message, hint). A hint starting with "incompatible:" marks
# restore failures that come from the snapshot not fitting this machine.
_KNOWN_FAILURES: list[tuple[str, str, str]] = [
    (
        r"No space left|Disk quota exceeded",
        "CRIU could not write the dump: the disk is full (no space left on device).",
        "Free space on the disk of the work directory (work_dir), or move it to a larger disk.",
    ),
    (
        r"has bad size|bad mode|size mismatch",
        "A file the kernel had open has changed since the snapshot.",
        "incompatible:Restore the file to the state it had when the snapshot was taken, or "
        "take snapshots of kernels that do not keep growing files open.",
    ),
    (
        r"Can't open (?:file|vma|mapping|fd).*No such file|No such file or directory",
        "A file the kernel had open at the snapshot is missing on this machine.",
        "incompatible:Make the file named in the log available at the same path, then restore.",
    ),
    (
        r"cpu(?:info)?.*(?:mismatch|not supported|compat)|CPU feature",
        "This machine's CPU lacks features the snapshot's CPU had.",
        "incompatible:Restore on a machine with the same (or a newer) CPU model.",
    ),
    (
        r"Connected TCP socket|In-flight connection|--tcp-close",
        "CRIU refused a TCP connection of the kernel; connections are saved closed (clients "
        "reconnect after a restore), which this CRIU did not do.",
        "Use the CRIU that 'jupyter snapshot doctor' finds (>= 4.2), which supports "
        "--tcp-close; restore snapshots with this product, not with a bare 'criu restore'.",
    ),
    (
        r"corked dgram socket",
        "The kernel holds a UDP socket with corked data not sent yet (UDP_CORK), which "
        "cannot be saved.",
        "Uncork the socket (setsockopt UDP_CORK 0) or close it, then retry.",
    ),
    (
        r"half of stream unix|unix.*external|External socket",
        "The kernel holds a unix socket connected to a process outside it.",
        "Close connections to outside processes (for example a connection to a local "
        "database server) before taking a snapshot.",
    ),
    (
        r"Can't dump.*device|Unsupported .* device|can't dump.*chrdev|Unsupported chr",
        "The kernel holds a device file CRIU cannot save.",
        "Close the device (for example a GPU opened without CUDA checkpoint support).",
    ),
    (
        r"Can't create a directory|can't get /proc fd",
        "CRIU could not make its private /proc (proc.crtools) in the kernel's working directory.",
        "Make sure the kernel's working directory is writable and holds no 'proc.crtools' "
        "left by another tool, then retry.",
    ),
    (
        r"Address already in use",
        "A network port the kernel had bound (a listening TCP socket or a UDP socket) is "
        "taken on this machine.",
        "incompatible:Stop the process that uses the port (the CRIU log names the socket), "
        "or close listening sockets in the kernel before taking snapshots.",
    ),
    (
        r"Can't .*pid.*busy|PID .* is busy|pid .* is in use",
        "A process id the snapshot needs is taken on this machine.",
        "Retry; restores run in a fresh PID namespace, so this points to a CRIU problem.",
    ),
    (
        r"needs to have the CAP_SYS_ADMIN or the CAP_CHECKPOINT_RESTORE|Effective capability "
        r"\d+ missing",
        "CRIU runs without the privileges it needs: not as root, and its binary lacks the "
        "file capabilities of non-root mode.",
        f"As root: setcap {UNPRIVILEGED_CAPS} on the product's CRIU copy "
        "(scripts/install-criu.sh does it, for the group jupyter-snapshots), or run Jupyter "
        "as root; 'jupyter snapshot doctor' names what is missing (docs/nonroot.md).",
    ),
    (
        r"Can't fork for \d+: File exists",
        "A process id the snapshot's kernel had is in use on this machine. Without root a "
        "restored kernel keeps its process ids (it has no PID namespace of its own), so "
        "two kernels restored from one snapshot cannot run side by side, and on another "
        "machine or pod another process may hold one of them.",
        "Shut down the kernel that holds the id (the kernel this snapshot was taken from, "
        "or another copy of it) and retry; elsewhere, retry once the process holding it "
        "has ended (restore into a fresh pod before starting new kernels there); or run "
        "Jupyter as root, where every restored kernel gets its own PID namespace "
        "(docs/nonroot.md).",
    ),
    (
        r"Operation not permitted|EPERM|Permission denied",
        "CRIU lacked a privilege it needs.",
        "Run 'jupyter snapshot doctor': without root, CRIU needs the file capabilities "
        f"{UNPRIVILEGED_CAPS} on the product's CRIU copy (sudo scripts/install-criu.sh), "
        "and a snapshot taken by root (in a PID namespace) restores only as root.",
    ),
]


#: CRIU's refusal of a deleted file larger than ``--ghost-limit``: its path and size.
_GHOST_TOO_BIG = re.compile(r"Can't dump ghost file (\S+) of (\d+) size")

#: Error lines CRIU prints on success too; they explain nothing.
_HARMLESS = re.compile(r"RLIMIT_NOFILE|Can't keep kdat cache|location for kerndat file")


#: Log lines of a CRIU that the kernel refused something: the confinement of this process
#: (seccomp, no_new_privs, bounding set, Yama) is then the first suspect.
_DENIED = re.compile(
    r"Operation not permitted|EPERM|Permission denied|suspending seccomp|Can't attach|"
    r"Unable to interrupt|needs to have the CAP_SYS_ADMIN or the CAP_CHECKPOINT_RESTORE"
)


def explain_failure(excerpt: str, *, restoring: bool) -> tuple[str, str]:
    """A plain message and hint for a failed dump or restore, from its log excerpt."""
    meaningful = "\n".join(line for line in excerpt.splitlines() if not _HARMLESS.search(line))
    ghost = _GHOST_TOO_BIG.search(meaningful)
    if ghost:
        return (
            f"The kernel holds a deleted file ({ghost[1]}, {human_bytes(int(ghost[2]))}) "
            "larger than the limit for such files the dump gave CRIU (--ghost-limit, the "
            "largest deleted file the kernel held just before the dump: this one grew).",
            "Take the snapshot again once the kernel's files stop growing.",
        )
    if _DENIED.search(meaningful):
        denied = explain_denied(meaningful, unprivileged=unprivileged(), restoring=restoring)
        if denied is not None:
            return denied
    for pattern, message, hint in _KNOWN_FAILURES:
        if re.search(pattern, meaningful, re.IGNORECASE):
            return message, hint
    if restoring:
        return (
            "CRIU could not restore the snapshot.",
            "Read the CRIU log lines below; 'jupyter snapshot doctor' checks this machine.",
        )
    return (
        "CRIU could not dump the kernel.",
        "Read the CRIU log lines below; 'jupyter snapshot doctor' checks this machine.",
    )


def external_file_key(fd: int) -> str:
    """CRIU's key for the file open at ``fd`` of this process: ``file[MNT_ID:INODE]``."""
    mnt_id = -1
    for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("mnt_id:"):
            mnt_id = int(line.split()[1])
    return f"file[{mnt_id:x}:{os.fstat(fd).st_ino:x}]"
