"""Real snapshot kernels for the tests and the benchmarks (shipped, so both use one
harness): a wrapper process (`python -m kernel_wrapper`) and a jupyter_client."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.connect import write_connection_file

from jupyter_ext.core import proctree
from jupyter_ext.core.errors import SnapshotError
from jupyter_ext.core.protocol import (
    ENV_AWAIT_RESTORE,
    ProgressCallback,
    RestoreRequest,
    WrapperClient,
    WrapperInfo,
)

#: Seconds without a heartbeat echo before the test client calls the kernel dead.
HEARTBEAT_GRACE = 10.0
#: Starts tried when the ports chosen for a kernel were taken meanwhile.
PORT_ATTEMPTS = 3


class KernelProcess:
    """One snapshot kernel (``python -m kernel_wrapper``) and a client connected to it."""

    def __init__(
        self,
        workdir: Path,
        *,
        restore_from: Path | None = None,
        on_inner_death: str = "wait",
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "kernel_wrapper", "--on-inner-death", on_inner_death]
        argv += extra_args or []
        for attempt in range(PORT_ATTEMPTS):
            try:
                self._start(workdir, argv, env, restore_from)
                break
            except RuntimeError as exc:
                # The free ports jupyter_client picked can be taken before the wrapper
                # binds them (many kernels start and stop on a loaded test machine).
                if "Address already in use" not in str(exc) or attempt == PORT_ATTEMPTS - 1:
                    raise
        self.control = WrapperClient(WrapperInfo.for_connection_file(self.connection_file).control)

    def _start(
        self,
        workdir: Path,
        argv: list[str],
        env: dict[str, str] | None,
        restore_from: Path | None,
    ) -> None:
        self.connection_file = Path(
            write_connection_file(
                str(workdir / f"kernel-{uuid.uuid4()}.json"), key=uuid.uuid4().hex.encode()
            )[0]
        )
        self.log_path = workdir / f"{self.connection_file.stem}.log"
        self._log = self.log_path.open("wb")
        environ = {**os.environ, **(env or {})}
        marker = workdir / f"await-restore-{uuid.uuid4().hex}"
        if restore_from is not None:  # as the server restores into a new kernel
            marker.touch()
            environ[ENV_AWAIT_RESTORE] = str(marker)
        self.process = subprocess.Popen(
            [*argv, "-f", str(self.connection_file)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=environ,
            cwd=workdir,
        )
        if restore_from is not None:
            try:
                asyncio.run(self._restore(restore_from))
            except SnapshotError as exc:
                self.process.kill()
                self.process.wait(10)
                log = self.log()
                self._log.close()
                raise RuntimeError(f"kernel did not start: {exc}\n{log}") from exc
            finally:
                marker.unlink(missing_ok=True)
        self.client = BlockingKernelClient(connection_file=str(self.connection_file))
        self.client.load_connection_file()
        # jupyter_client calls a kernel dead after one second without a heartbeat echo:
        # on a loaded test machine the client's own threads can be that late.
        self.client.hb_channel.time_to_dead = HEARTBEAT_GRACE
        self.client.start_channels()
        try:
            self.client.wait_for_ready(timeout=60)
        except RuntimeError as exc:
            log = self.log()
            if self.process.poll() is None:
                log += "\n" + describe_threads(proctree.descendants(self.process.pid))
                self.process.kill()
            self.process.wait(10)
            self.close()
            raise RuntimeError(f"kernel did not start: {log}") from exc
        # wait_for_ready asks kernel_info again every second without a reply (and when IOPub
        # is quiet): on a loaded machine the extra replies arrive later and a test's next
        # get_shell_msg took one for its own reply. The kernel answers in order, so once one
        # more request is answered, nothing stale is left.
        last = self.client.kernel_info()
        while self.client.get_shell_msg(timeout=60)["parent_header"].get("msg_id") != last:
            pass
        self.control = WrapperClient(WrapperInfo.for_connection_file(self.connection_file).control)

    async def _restore(self, source: Path) -> None:
        async def alive() -> bool:
            return self.process.poll() is None

        wrapper = await WrapperClient.when_up(self.connection_file, alive)
        await wrapper.restore(RestoreRequest(source))

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def execute(self, code: str, timeout: float = 120) -> str:
        """Run ``code``; return its stdout; raise with the traceback if it failed."""
        out: list[str] = []
        errors: list[str] = []

        def hook(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "stream":
                (out if msg["content"]["name"] == "stdout" else errors).append(
                    msg["content"]["text"]
                )
            elif msg["msg_type"] == "error":
                errors.append("\n".join(msg["content"]["traceback"]))

        reply = self.client.execute_interactive(code, timeout=timeout, output_hook=hook)
        if reply["content"]["status"] != "ok":
            raise AssertionError(f"cell failed: {''.join(errors)}\n{reply['content']}")
        return "".join(out)

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = self.control.request_sync("status", timeout=30)
        return result

    def snapshot(self, dest: Path, **args: Any) -> dict[str, Any]:
        result: dict[str, Any] = self.control.request_sync(
            "snapshot", {"dest": str(dest), **args}, timeout=300
        )
        return result

    def restore(self, source: Path, on_progress: ProgressCallback | None = None) -> dict[str, Any]:
        result: dict[str, Any] = self.control.request_sync(
            "restore", {"source": str(source)}, on_progress=on_progress, timeout=300
        )
        return result

    def inner_pids(self) -> list[int]:
        pid = self.status()["inner_pid"]
        return proctree.descendants(pid) if pid else []

    def wait_exit(self, pids: list[int], timeout: float = 30) -> int:
        """Wait for the wrapper to exit; on a timeout, fail saying what every thread of the
        wrapper and of ``pids`` was doing (a Python stack too where py-spy is installed)."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the kernel did not exit within {timeout} s:\n"
                + describe_threads([self.process.pid, *pids])
            ) from None

    def kill_inner(self) -> None:
        """kill -9 the inner kernel (the whole tree dies with its namespace's init)."""
        pid = self.status()["inner_pid"]
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: self.status()["state"] == "dead", what="inner kernel to die")

    def kill_all(self) -> None:
        """kill -9 the wrapper and every process of the kernel, as a node failure would."""
        pids = [self.process.pid, *proctree.descendants(self.process.pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(10)
        wait_until(lambda: not any(proctree.is_alive(p) for p in pids), what="kernel to die")
        self.close()

    def shutdown(self) -> None:
        if self.process.poll() is None:
            try:
                self.client.shutdown()
                self.process.wait(15)
            except (subprocess.TimeoutExpired, RuntimeError):
                self.process.kill()
                self.process.wait(10)
        self.close()

    def close(self) -> None:
        """Let go of the client and the log (safe to call more than once)."""
        self.client.stop_channels()
        self._log.close()


def wait_until(condition: Callable[[], bool], timeout: float = 30, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise TimeoutError(f"timed out waiting for {what}")


def describe_threads(pids: list[int]) -> str:
    """Each thread's name, state and kernel wait channel; py-spy's dump if available."""
    lines = []
    for pid in pids:
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            lines.append(f"{pid}: {cmdline.decode(errors='replace')[:200]}")
        for tid in sorted(os.listdir(f"/proc/{pid}/task")) if os.path.isdir(f"/proc/{pid}") else []:
            base = f"/proc/{pid}/task/{tid}"
            with contextlib.suppress(OSError):
                comm = Path(f"{base}/comm").read_text().strip()
                wchan = Path(f"{base}/wchan").read_text().strip()
                state = Path(f"{base}/stat").read_text().rsplit(")", 1)[1].split()[0]
                lines.append(f"{pid}/{tid} {comm} {state} {wchan}")
        spy = shutil.which("py-spy")
        if spy and os.path.isdir(f"/proc/{pid}"):
            dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True)
            lines.append(dump.stdout)
    return "\n".join(lines)
