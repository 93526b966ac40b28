"""The kernel wrapper: one stable kernel for jupyter_server, a dumpable kernel inside.

jupyter_server starts the wrapper with the kernel's connection file. The wrapper binds the
five server-facing channels and keeps them for its whole life, while the process that
really computes (the *inner* kernel, see :mod:`kernel_wrapper.inkernel.inner`) runs in its own PID
and time namespaces and is dumped, killed and restored underneath. Messages pass through
unchanged in both directions, so their signatures stay valid.

The wrapper is composed of parts, each with its own state:

- :class:`~kernel_wrapper.channels.ServerChannels`: the sockets jupyter_server connects to;
- :class:`~kernel_wrapper.runtime.RuntimeDir`: the private directory of the inner channels;
- :class:`~kernel_wrapper.supervisor.Supervisor`: the inner kernel's process;
- :class:`~kernel_wrapper.relay.Relay`: messages between the two sides, and what they
  tell of the kernel (:class:`~kernel_wrapper.tracker.KernelTracker`);
- :class:`~kernel_wrapper.standin.StandIn`: answers while there is no kernel process;
- :class:`~kernel_wrapper.lifecycle.Lifecycle`: the state, which switches relay and stand-in;
- :class:`~kernel_wrapper.snapshotter.Snapshotter`: dumps and restores;
- :class:`~kernel_wrapper.checkpoints.CellCheckpoints`: a checkpoint after each cell, and
  undo;
- :class:`~kernel_wrapper.control.ControlServer`: the private control socket
  (:mod:`jupyter_ext.core.protocol`) through which the server asks for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from jupyter_client.session import Session

from jupyter_ext.core import proctree
from jupyter_ext.core.checkpoints import CheckpointSettings
from jupyter_ext.core.death import Death
from jupyter_ext.core.errors import SnapshotError
from jupyter_ext.core.gpu import kernel_gpu_status
from jupyter_ext.core.isolation.pidspace import PID_FLOOR
from jupyter_ext.core.lazypages import LazySettings
from jupyter_ext.core.protocol.control import (
    AWAIT_RESTORE_SECONDS,
    CheckpointsArgs,
    KernelJournal,
    KernelStatus,
    LazyRestoreEndArgs,
    StatusArgs,
    WrapperInfo,
    info_path,
    journal_path,
    write_journal,
)
from jupyter_ext.core.protocol.environment import (
    DEFAULT_RUNTIME_ROOT,
    ENV_CELL_CHECKPOINTS,
    ENV_INNER_DIR,
    ENV_PID_FLOOR,
)
from jupyter_ext.core.protocol.inner import REFUSED_FILE
from jupyter_ext.core.protocol.progress import ProgressCallback

from .agents import BridgedAgent, IPythonAgent
from .channels import InnerChannels, ServerChannels
from .checkpointarea import KernelCheckpoints, area_name
from .checkpoints import CellCheckpoints
from .control import ControlServer
from .lifecycle import Lifecycle, State
from .relay import Relay
from .runtime import RuntimeDir
from .snapshotter import Snapshotter
from .standin import StandIn
from .supervisor import Supervisor

log = logging.getLogger("kernel_wrapper")

__all__ = ["KernelWrapper", "State"]

#: How long an ending wrapper waits for a lazy restore under way to end with its kernel.
LAZY_END_SECONDS = 5.0


class KernelWrapper:
    """One kernel for jupyter_server, from ``connection_file`` until it is shut down.

    ``on_inner_death``: "exit" like ipykernel (the server restarts the kernel), or "wait"
    for a restore, the stand-in answering meanwhile. ``await_restore``: start without a
    kernel and wait for a ``restore`` operation (a restore into a new kernel) instead of
    launching a fresh one. ``kernel_args`` go to the inner ipykernel; ``kernel_argv``, if
    given, is another kernel's command line (its kernelspec's argv, the connection file
    in it as jupyter_client put it there), run behind a bridge instead
    (:mod:`kernel_wrapper.inkernel.bridge`).
    """

    #: How often the wrapper looks whether the server that started it is still there.
    PARENT_POLL_SECONDS = 1.0

    def __init__(
        self,
        connection_file: Path,
        *,
        runtime_root: Path = DEFAULT_RUNTIME_ROOT,
        on_inner_death: str = "exit",
        criu_path: str | None = None,
        await_restore: bool = False,
        kernel_args: list[str] | None = None,
        kernel_argv: list[str] | None = None,
        kernel_umask: int | None = None,
    ) -> None:
        """``kernel_umask``: the user's umask, for the kernel (the wrapper's own files,
        CRIU's images among them, are the user's alone: see ``__main__``)."""
        self.connection_file = connection_file.resolve()
        self.connection = json.loads(connection_file.read_text())
        self.session = Session(
            key=self.connection["key"].encode(),
            signature_scheme=self.connection.get("signature_scheme", "hmac-sha256"),
        )
        self.on_inner_death = on_inner_death
        self.await_restore = await_restore
        self.kernel_args = kernel_args or []
        self.kernel_argv = kernel_argv or []
        if self.kernel_argv and not any(
            str(named) in arg
            for arg in self.kernel_argv
            for named in (connection_file, self.connection_file)
        ):
            raise SnapshotError(
                f"The kernel's command line ({' '.join(self.kernel_argv)}) does not name its "
                "connection file, so the kernel could not be given the endpoints it needs.",
                hint="Its kernelspec's argv must hold {connection_file}, as every Jupyter "
                "kernel's does; install it again with 'jupyter snapshot install-kernelspec "
                "--wrap NAME'.",
            )
        self._named_connection_file = connection_file
        self.runtime = RuntimeDir(runtime_root)
        self._control_path = self.runtime.path / "control"
        self._announced = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self.process = Supervisor(
            on_death=self._on_inner_death,
            on_pid=self._announce,
            pid_floor=int(os.environ.get(ENV_PID_FLOOR) or PID_FLOOR),
            kernel_umask=kernel_umask,
        )
        self.server: ServerChannels
        self.relay: Relay
        self.lifecycle: Lifecycle
        self.snapshotter: Snapshotter
        self.checkpoints: CellCheckpoints
        self._criu_path = criu_path
        self.death: Death | None = None
        """How the inner kernel last died (the server offers its snapshot back)."""

    def _compose(self) -> None:
        """Bind the server's channels and build the parts on them (in the running loop)."""
        self.server = ServerChannels(self.connection)
        self.relay = Relay(self.session, self.server)
        self.relay.gated = not self.kernel_argv
        stand_in = StandIn(
            self.session,
            self.server,
            kernel_info=lambda: self.relay.tracker.kernel_info,
            hold=self.relay.hold,
            wake=lambda: self._background(self.snapshotter.wake()),
            shutdown=lambda: self.lifecycle.end(0),
        )
        self.lifecycle = Lifecycle(self.relay, stand_in)
        self.relay.tracker.changed = self._write_journal
        self.snapshotter = Snapshotter(
            lifecycle=self.lifecycle,
            relay=self.relay,
            process=self.process,
            runtime=self.runtime,
            criu_path=self._criu_path,
            lazy=LazySettings.from_env(os.environ),
            agent=BridgedAgent(self.relay) if self.kernel_argv else IPythonAgent(self.relay),
            checkpoints=KernelCheckpoints(
                CheckpointSettings.from_json(os.environ.get(ENV_CELL_CHECKPOINTS)),
                area_name(self.connection_file),
            ),
        )
        self.checkpoints = CellCheckpoints(self.snapshotter)

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        """Serve until the kernel is shut down; returns the process exit code."""
        loop = asyncio.get_running_loop()
        try:
            self._compose()
        except BaseException:
            self.runtime.remove()  # a port taken: nothing ran yet
            raise
        loop.add_reader(self.process.stdio_r, self.process.forward_stdio)
        loop.add_signal_handler(signal.SIGINT, self._interrupt)
        loop.add_signal_handler(signal.SIGTERM, lambda: self.lifecycle.end(0))
        loop.add_signal_handler(signal.SIGUSR1, self._log_state)
        control = ControlServer(
            self._control_path,
            {
                "status": self.status,
                "snapshot": self.snapshotter.snapshot,
                "restore": self.snapshotter.restore,
                "suspend": self.snapshotter.suspend,
                "resume": self.snapshotter.resume,
                "lazy-restore-end": self._lazy_restore_end,
                "checkpoints": self._checkpoints,
                "undo": self.checkpoints.undo,
            },
        )
        await control.start()
        self._announced = True
        self._announce()
        self._background(self.relay.forward_subscriptions())
        self._watch_parent()
        try:
            if self.await_restore:
                loop.call_later(AWAIT_RESTORE_SECONDS, self._no_restore_came)
            else:
                await self._launch_inner()
            await self.lifecycle.done.wait()
        finally:
            control.close()
            await self._shutdown_inner()
            # A lazy restore still under way ends with its kernel: let it say so (and give
            # back what it read from) before the wrapper is gone.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.snapshotter.lazy.settled(), LAZY_END_SECONDS)
            with contextlib.suppress(OSError):
                info_path(self.connection_file).unlink()
            if self._journal_death() is None:  # a death's journal is the server's to read
                journal_path(self.connection_file).unlink(missing_ok=True)
            self.checkpoints.close()
            self.process.close()
            self.runtime.remove()
        return self.lifecycle.exit_code or 0

    async def _launch_inner(self) -> None:
        """Start a fresh inner kernel."""
        self.relay.connect_inner(InnerChannels(self.runtime.path))
        env = dict(os.environ)
        env.pop("JPY_PARENT_PID", None)  # ipykernel would exit when its parent changes
        env[ENV_INNER_DIR] = self.runtime.inner_path
        await self.process.launch(self._inner_argv(), env, pass_fds=(self.runtime.fd,))
        self.lifecycle.enter(State.RUNNING)
        self._write_journal()

    def _inner_argv(self) -> list[str]:
        """Our ipykernel, or the bridge with another kernel behind it, whose command line
        names its own connection file where it named the server's."""
        if not self.kernel_argv:
            connection_file = self.runtime.inner_connection_file(self.connection)
            argv = [
                sys.executable,
                "-m",
                "kernel_wrapper.inkernel.inner",
                "-f",
                str(connection_file),
            ]
            return [*argv, *self.kernel_args]
        kernel_file = str(self.runtime.kernel_connection_file(self.connection))
        # The longer name first: a relative one may be the end of the absolute one.
        named = sorted({str(self._named_connection_file), str(self.connection_file)}, key=len)
        argv = []
        for arg in self.kernel_argv:
            for path in reversed(named):
                arg = arg.replace(path, kernel_file)
            argv.append(arg)
        return [sys.executable, "-m", "kernel_wrapper.inkernel.bridge", kernel_file, "--", *argv]

    def _no_restore_came(self) -> None:
        """A wrapper started for a restore that never came (its server went away)."""
        if self.lifecycle.is_(State.STARTING) and not self.snapshotter.busy:
            log.error("no restore came within %.0f s; the kernel ends", AWAIT_RESTORE_SECONDS)
            self.lifecycle.end(2)

    def _on_inner_death(self, death: Death) -> None:
        """The kernel process ended without the wrapper ending it: on a shutdown request,
        the wrapper ends too; else it died, which the journal says before the wrapper
        exits (the server restarts the kernel and offers its snapshot back) or waits."""
        refused = self.runtime.path / REFUSED_FILE
        if refused.exists():
            # A kernel that cannot run as a snapshot kernel: every cell says why (a
            # restart by the server would only fail again).
            reason = refused.read_text(errors="replace")
            refused.unlink()
            log.error("the kernel cannot run as a snapshot kernel: %s", reason)
            self.lifecycle.stand_in.dead_text = reason
            self.lifecycle.enter(State.DEAD)
            return
        if self.lifecycle.is_(State.STOPPING) or self.relay.tracker.shutdown_requested:
            log.info("inner kernel ended (%s); the wrapper exits too", death.reason)
            self.lifecycle.end(0)
            return
        self.death = death
        if self.snapshotter.lazy.puts_back:
            # Died while restored lazily in place (an undo, a restore into this kernel):
            # the transfer's end puts back the kernel saved before (seen: CRIU's lazy-pages
            # daemon crashed, the kernel with it, and its wrapper exited with the saved one).
            log.warning(
                "inner kernel %s during a lazy restore; the kernel saved before it comes back",
                death.reason,
            )
            return
        self._write_journal(death)
        if self.on_inner_death == "exit" or death.exit_code == 0:
            log.info("inner kernel %s; the wrapper exits too", death.reason)
            self.lifecycle.end(0 if death.exit_code == 0 else 1)
            return
        log.warning("inner kernel %s; waiting for a restore", death.reason)
        self.lifecycle.enter(State.DEAD)

    def _journal_death(self) -> Death | None:
        """The death the journal tells: the last one, while the kernel has not come back."""
        state = self.lifecycle.state
        return self.death if state in (State.DEAD, State.STOPPING) else None

    def _write_journal(self, death: Death | None = None) -> None:
        """What the server needs to offer the kernel back if it dies (KernelJournal)."""
        death = death or self._journal_death()
        journal: KernelJournal = {
            "lineage": self.snapshotter.record.lineage,
            "snapshot_id": self.snapshotter.record.parent_snapshot,
            "cells_since": self.relay.tracker.cells_since(),
            "inner_pid": self.process.pid,
            "death": death.to_dict() if death else None,
        }
        try:
            write_journal(self.connection_file, journal)
        except OSError as exc:
            log.warning("cannot write the kernel's journal: %s", exc)

    async def _shutdown_inner(self) -> None:
        self.relay.stop()
        await self.process.kill()
        await self.relay.close_inner()

    def _log_state(self) -> None:
        """SIGUSR1: say in the log what every part holds (a kernel that seems stuck)."""
        log.warning(
            "state %s, snapshot job %s, kernel %s (%s), relay: %s",
            self.lifecycle.state.value,
            "running" if self.snapshotter.busy else "none",
            self.process.pid,
            self.relay.tracker.execution_state,
            self.relay.describe(),
        )
        for task in asyncio.all_tasks():
            log.warning("task %s waits at %s", task.get_name(), _awaiting(task.get_coro()))

    def _interrupt(self) -> None:
        """SIGINT from the server: interrupt the inner kernel's process group."""
        if self.lifecycle.is_(State.RUNNING):
            self.process.interrupt()

    def _watch_parent(self) -> None:
        """End with the server that started the kernel (jupyter_client names it in
        JPY_PARENT_PID), as ipykernel does: a server killed with SIGKILL (or OOM) must not
        leave its kernels running, unreachable, for ever."""
        parent = os.environ.get("JPY_PARENT_PID", "")
        if not parent.isdigit() or int(parent) <= 1:
            return
        loop = asyncio.get_running_loop()

        def look() -> None:
            if self.lifecycle.done.is_set():
                return
            if os.getppid() != int(parent):
                log.warning("the server (pid %s) is gone; the kernel ends", parent)
                self.lifecycle.end(0)
                return
            loop.call_later(self.PARENT_POLL_SECONDS, look)

        look()

    def _announce(self) -> None:
        """Where the server finds this wrapper, and its kernel's process."""
        if self._announced:
            WrapperInfo(self._control_path, os.getpid(), self.process.pid).write(
                self.connection_file
            )

    def _background(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ control

    async def _lazy_restore_end(
        self, progress: ProgressCallback, args: LazyRestoreEndArgs
    ) -> dict[str, Any]:
        return await self.snapshotter.lazy.end()

    async def _checkpoints(self, progress: ProgressCallback, args: CheckpointsArgs) -> Any:
        return self.checkpoints.listing()

    async def status(self, progress: ProgressCallback, args: StatusArgs) -> KernelStatus:
        """What the server shows and its policies decide on."""
        gpu_status: dict[str, Any] = {"processes": 0, "bytes": 0, "utilization": 0}
        pid = self.process.pid
        if args.gpu and pid is not None:
            gpu_status = await asyncio.to_thread(kernel_gpu_status, proctree.descendants(pid))
        tracker, snapshotter = self.relay.tracker, self.snapshotter
        return {
            "gpu": gpu_status,
            # A cell checkpoint's freeze is no snapshot the user asked for (tens of ms):
            # the kernel shows as running (its checkpoints say one is being taken).
            "state": State.RUNNING.value
            if snapshotter.checkpointing and self.lifecycle.is_(State.SNAPSHOTTING)
            else self.lifecycle.state.value,
            "inner_pid": pid,
            "wrapper_pid": os.getpid(),
            "lineage": snapshotter.record.lineage,
            "runtime_dir": str(self.runtime.path),
            "execution_state": tracker.execution_state,
            "last_activity": tracker.last_activity,
            "executions_since_snapshot": tracker.executions_since_snapshot,
            "longest_cell_since_snapshot": round(tracker.longest_cell_since_snapshot, 3),
            "sequence": snapshotter.record.sequence,
            "busy": snapshotter.busy,
            "resumed_request": tracker.resumed_request,
            "running_request": tracker.running_request(),
            "lazy_restore": snapshotter.lazy.status,
            "memory": snapshotter.kernel.memory.status(),
            "closed_on_restore": snapshotter.restorer.closed_on_restore,
            # A copy restored beside another kernel of its snapshot: its own network
            # namespace, reached out of through slirp4netns (core/isolation/netns.py).
            "own_network": self.process.network is not None,
            # ...and its own view of the temporary directory (core/isolation/privatetmp.py).
            "private_temp": private.lower if (private := self.process.private_temp) else None,
            # ...and private copies of /dev/shm files whose names a live process holds.
            "private_shm": snapshotter.restorer.private_shm,
            "snapshot_id": snapshotter.record.parent_snapshot,
            "cells_since_snapshot": tracker.cells_since(),
            "death": death.to_dict() if (death := self._journal_death()) else None,
            "checkpoints": self.checkpoints.status(),
        }


def _awaiting(coro: Any) -> str:
    """Where a suspended coroutine waits: each frame of its await chain, outermost first."""
    where = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            where.append(
                f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}"
            )
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " > ".join(where) or "(running or done)"
