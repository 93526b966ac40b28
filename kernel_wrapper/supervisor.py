"""The inner kernel's process: started, or adopted after a restore, watched, ended.

Its exit is reported once: an end the wrapper caused (a kill, a dump that ends it) is
expected and silent; any other is a death, told (exit status, the out-of-memory killer:
:mod:`jupyter_ext.core.death`) and handed to ``on_death``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

from jupyter_ext.core import proctree
from jupyter_ext.core.criu import unprivileged
from jupyter_ext.core.death import Death, ExitWatch, Witness
from jupyter_ext.core.errors import KernelNotRunningError
from jupyter_ext.core.isolation import pidspace
from jupyter_ext.core.isolation.netns import OwnNetwork
from jupyter_ext.core.isolation.privatetmp import PrivateTemp
from jupyter_ext.core.protocol.environment import ENV_OWN_PROC

log = logging.getLogger("kernel_wrapper")

#: How long an ended kernel gets to be reaped.
REAP_TIMEOUT = 10.0
#: The exit status reported for a kernel that is not the wrapper's child (node agent).
UNKNOWN_EXIT = -255


class Supervisor:
    """One inner kernel process at a time (``pid``: None while none runs).

    ``on_death(death)`` is called when the process ends without the wrapper ending it;
    ``on_pid`` whenever ``pid`` changes. The kernel's stdout and stderr go to a pipe whose
    read end the wrapper copies to its own stderr; the same pipe is handed to a restored
    kernel, so its output arrives the same way.
    """

    def __init__(
        self,
        on_death: Callable[[Death], None],
        on_pid: Callable[[], None],
        pid_floor: int = pidspace.PID_FLOOR,
        kernel_umask: int | None = None,
    ) -> None:
        self._on_death = on_death
        self._kernel_umask = -1 if kernel_umask is None else kernel_umask
        self._pid_floor = pid_floor
        self._on_pid = on_pid
        self._pid: int | None = None
        self._launcher: subprocess.Popen[bytes] | None = None
        self._pidfd: int | None = None
        self._expected_exit = False
        self._exit_watch: ExitWatch | None = None
        self._witness: Witness | None = None
        self.network: OwnNetwork | None = None
        """The kernel's own network namespace (a copy restored beside another:
        core/isolation/netns.py), None while it runs in the server's; it ends with the
        kernel."""
        self.private_temp: PrivateTemp | None = None
        """The kernel's private view of the temporary directory (a copy restored beside
        another: core/isolation/privatetmp.py), None while it sees the server's; it ends with the
        kernel."""
        self.stdio_r, self.stdio_w = os.pipe()
        os.set_blocking(self.stdio_r, False)

    @property
    def pid(self) -> int | None:
        """The kernel process (the namespace's launcher with root), None while none runs."""
        return self._pid

    def _set_pid(self, pid: int | None) -> None:
        self._pid = pid
        self._on_pid()

    @property
    def stdio_pipe(self) -> str:
        """The pipe as CRIU names it in a dump (``pipe:[INODE]``), to hand it back on restore."""
        return f"pipe:[{os.fstat(self.stdio_r).st_ino}]"

    def forward_stdio(self) -> None:
        """Copy what the kernel printed to the wrapper's stderr (the server's log)."""
        with contextlib.suppress(BlockingIOError):
            data = os.read(self.stdio_r, 65536)
            if data:
                sys.stderr.buffer.write(data)
                sys.stderr.buffer.flush()

    async def launch(
        self, argv: Sequence[str], env: dict[str, str], pass_fds: Sequence[int]
    ) -> None:
        """Start a fresh kernel: in new PID, mount and time namespaces with root; without root
        (CRIU --unprivileged cannot dump a task in another PID namespace) as our child,
        which makes itself a session leader, and without a parent-death signal (a restored
        one would fire at once), and with ids a fresh pod leaves free (core/isolation/pidspace.py).
        docs/nonroot.md"""
        if unprivileged():
            skipped = await asyncio.to_thread(pidspace.skip_low_pids, self._pid_floor)
            if skipped:
                log.info("skipped %d process ids: kernels get ids a fresh pod leaves free", skipped)
            launcher = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=self.stdio_w,
                stderr=self.stdio_w,
                env=env,
                pass_fds=pass_fds,
                umask=self._kernel_umask,
            )
            self._launcher = launcher
            self._set_pid(launcher.pid)
            self._watch(launcher.pid)
            self._witness = Witness(launcher.pid)
            return
        # A private mount namespace too, where the kernel mounts a /proc of its own PID
        # namespace (core/isolation/mountns.py): psutil finds its processes by their ids there.
        ns = ["unshare", "--pid", "--fork", "--mount", "--propagation", "private"]
        if Path("/proc/self/ns/time").exists():
            ns.append("--time")  # monotonic clocks continue across restores elsewhere
        launcher = subprocess.Popen(
            [*ns, *argv],
            stdin=subprocess.DEVNULL,
            stdout=self.stdio_w,
            stderr=self.stdio_w,
            env={**env, ENV_OWN_PROC: "1"},
            pass_fds=pass_fds,
            preexec_fn=proctree.die_with_parent,
            umask=self._kernel_umask,
        )
        self._launcher = launcher
        kernel = await self._first_child(launcher.pid)
        # The kernel is unshare's child: how it ended is read through a pidfd of it.
        self._exit_watch = ExitWatch(kernel)
        self._witness = Witness(kernel)
        self._set_pid(kernel)
        self._watch(launcher.pid)

    def adopt(
        self,
        pid: int,
        network: OwnNetwork | None = None,
        private_temp: PrivateTemp | None = None,
    ) -> None:
        """Supervise a kernel CRIU restored as our child, or that the node agent restored
        (then the agent's child: watched through a pidfd all the same), into ``network``,
        with ``private_temp``, if given: both end with it."""
        self._launcher = None
        self.network = network
        self.private_temp = private_temp
        self._exit_watch = ExitWatch(pid)
        self._witness = Witness(pid)
        self._set_pid(pid)
        self._watch(pid)

    @staticmethod
    async def _first_child(pid: int, timeout: float = 10.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            kids = proctree.children(pid)
            if kids:
                return kids[0]
            if not proctree.is_alive(pid):
                break
            await asyncio.sleep(0.005)
        raise KernelNotRunningError(
            "The inner kernel did not start.", hint="See the kernel's output in the server log."
        )

    def _watch(self, pid: int) -> None:
        """Notice when ``pid`` (our child) exits, through a pidfd."""
        loop = asyncio.get_running_loop()
        self._unwatch()
        self._pidfd = os.pidfd_open(pid)
        watched = self._pidfd

        def ready() -> None:
            if self._pidfd != watched:
                return
            self._unwatch()
            if self._launcher is not None and self._launcher.pid == pid:
                code = self._launcher.wait()
            else:
                try:
                    _, status = os.waitpid(pid, 0)
                    code = os.waitstatus_to_exitcode(status)
                except ChildProcessError:
                    # Restored by the node agent, whose child it is (the agent reaps it):
                    # its exit status is not ours to know.
                    code = UNKNOWN_EXIT
            self._exited(code)

        loop.add_reader(watched, ready)

    def _unwatch(self) -> None:
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def _exited(self, code: int) -> None:
        through_unshare = self._launcher is not None and self._exit_watch is not None
        watch, witness = self._exit_watch, self._witness
        self._exit_watch = self._witness = None
        self._launcher = None
        self._set_pid(None)
        self.end_own()
        exit_code = watch.exit_code() if watch is not None else None
        if watch is not None:
            watch.close()
        if self._expected_exit:
            self._expected_exit = False
            return
        certain = exit_code is not None
        if not certain:
            # The launcher's code: unshare gives its child's exit status, but 1 for a
            # signal it could not pass on; the node agent's child is not ours to know.
            certain = code != UNKNOWN_EXIT and not (through_unshare and code == 1)
            exit_code = None if code == UNKNOWN_EXIT else code
        death = (
            witness.death(exit_code, certain=certain)
            if witness is not None
            else Death(exit_code if certain else None)
        )
        log.warning("the inner kernel %s", death.reason)
        self._on_death(death)

    @contextlib.asynccontextmanager
    async def ending(self) -> AsyncIterator[None]:
        """The kernel ends inside this block on purpose (killed, or dumped by CRIU without
        ``--leave-running``): its exit is no death. Leaving the block normally waits until
        it has been reaped; leaving it by an error makes a later exit a death again."""
        self._expected_exit = True
        try:
            yield
            await self.gone()
        finally:
            self._expected_exit = False

    async def gone(self, timeout: float = REAP_TIMEOUT) -> None:
        """Wait until no kernel process runs (at most ``timeout``)."""
        deadline = time.monotonic() + timeout
        while self._pid is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    async def kill(self) -> None:
        """SIGKILL the kernel's tree (with root its namespace dies with its init) and reap it."""
        pid = self._pid
        if pid is None:
            return
        async with self.ending():
            # Without a PID namespace (non-root) the kernel's own children do not die with it.
            for task in proctree.descendants(pid) if unprivileged() else [pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(task, signal.SIGKILL)
            if self._launcher is not None:
                with contextlib.suppress(ProcessLookupError):
                    self._launcher.kill()

    def interrupt(self) -> None:
        """SIGINT to the kernel's process group (the server's interrupt)."""
        if self._pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._pid, signal.SIGINT)

    @staticmethod
    def kill_children_except(keep: set[int]) -> None:
        """SIGKILL and reap every child process of the wrapper not in ``keep`` (what a
        failed restore left: CRIU restores the tree as our child)."""
        for pid in set(proctree.children(os.getpid())) - keep:
            log.warning("removing process %d left by a failed restore", pid)
            # Without a PID namespace (non-root) its restored children would live on,
            # holding process ids the next restore needs.
            for task in proctree.descendants(pid) if unprivileged() else [pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(task, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)

    def end_own(self) -> None:
        """End the kernel's own network namespace and its helper, and its private
        temporary directory, if it has them."""
        if self.network is not None:
            self.network.close()
            self.network = None
        if self.private_temp is not None:
            self.private_temp.close()
            self.private_temp = None

    def close(self) -> None:
        self._unwatch()
        if self._exit_watch is not None:
            self._exit_watch.close()
            self._exit_watch = None
        self.end_own()
