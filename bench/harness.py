"""What the benchmarks share: real servers, cells, jobs, and bare CRIU for the baselines.

- ``Server``: ``jupyter server`` as a separate process in its own Jupyter directories, the
  one the tests start (``testkit.processes.ServerProcess``), with the REST calls a
  benchmark makes: notebook sessions and kernels, jobs followed with their phases
  (``run_job``), cells run through a kernel's websocket as JupyterLab runs them
  (``execute``: their output, and when it came), and a stop that ends the kernels first.
  ``extension_config`` is its config with the snapshot extension on.
- ``BareKernel``, ``criu_dump`` and ``criu_restore``: a plain ipykernel (no server, no
  wrapper) in its own PID and time namespaces, dumped and restored by bare CRIU, as a
  CRIU script would run it: the ceilings ours is measured against.

A snapshot kernel driven directly through its wrapper, without a server, is
``testkit.processes.KernelProcess`` (bench_snapshot, bench_network, stress_channels).
Errors a benchmark reports (a refused request, a failed job or cell) are ``BenchError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from jupyter_ext.core.criu import Criu  # noqa: E402
from testkit.processes import (  # noqa: E402
    MotoServer,
    ServerProcess,
    execute_request,
    free_port,
    ws_close,
    ws_connect,
)

__all__ = [
    "MIB",
    "QUIET",
    "BareKernel",
    "BenchError",
    "Deadline",
    "JobRun",
    "MotoServer",
    "Server",
    "criu_dump",
    "criu_restore",
    "extension_config",
    "free_port",
]

MIB = 1 << 20

#: Nothing automatic (idle suspend, periodic snapshots, retention, a snapshot before a
#: shutdown): a server does only what the benchmark asks of it.
QUIET: dict[str, Any] = {
    "idle_suspend_after": 0,
    "snapshot_before_shutdown": False,
    "keep_last": 0,
    "periodic_interval": 0,
}


class BenchError(Exception):
    """A request, a job or a cell failed; the message is what the server or kernel said."""


class Deadline:
    """The time a step of a benchmark may take; ``left()`` raises once it is over."""

    def __init__(self, seconds: float, option: str = "") -> None:
        self.seconds = seconds
        self.option = option  # the option that set it, named in the error
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            option = f" ({self.option})" if self.option else ""
            raise TimeoutError(f"took more than {self.seconds:.0f} s{option}")
        return left


def extension_config(work_dir: Path, **traits: Any) -> dict[str, Any]:
    """A server config with the snapshot extension on, its work directory (which holds the
    image cache) at ``work_dir``, and these ``SnapshotExtensionApp`` traits."""
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_ext": True}},
        "SnapshotExtensionApp": {"work_dir": str(work_dir), **traits},
    }


@dataclass
class JobRun:
    """A job followed from its POST until it was seen done."""

    job: dict[str, Any]
    #: Seconds from the POST until the job was seen done.
    seconds: float
    #: Each phase as polled: seconds after the POST at which it was first seen.
    first_seen: dict[str, float] = field(default_factory=dict)

    @property
    def result(self) -> dict[str, Any]:
        result: dict[str, Any] = self.job["result"]
        return result

    @property
    def phases(self) -> dict[str, float]:
        """Seconds spent in each phase (as polled: until the next one was seen)."""
        marks = [*sorted(self.first_seen.items(), key=lambda kv: kv[1]), ("end", self.seconds)]
        return {name: round(marks[i + 1][1] - at, 3) for i, (name, at) in enumerate(marks[:-1])}


class Server(ServerProcess):
    """``jupyter server`` as the tests start it (``ServerProcess``: a free port, a token,
    its own data, runtime and config directories under ``home``, its log in
    ``home/server.log``), ready once ``GET ready`` answers (a server without the
    extension: ``api/status``)."""

    def __init__(
        self,
        home: Path,
        root_dir: Path,
        config: dict[str, Any],
        *,
        env: dict[str, str] | None = None,
        ready: str = "api/snapshots/policy",
    ) -> None:
        self._ready = ready
        root_dir.mkdir(parents=True, exist_ok=True)
        super().__init__(home, root_dir, config, env=env)

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.log()[-3000:]}")
            try:
                self.api("GET", self._ready, timeout=5)
                return
            except (OSError, BenchError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server did not start: {self.log()[-3000:]}") from None
                time.sleep(0.2)

    def api(self, method: str, path: str, body: Any = None, timeout: float = 600) -> Any:
        """``METHOD /path`` with a JSON body; the JSON answered. An error status raises
        BenchError with what the server said."""
        request = urllib.request.Request(
            self.url + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                data = response.read()
        except urllib.error.HTTPError as exc:
            with exc:
                raise BenchError(f"{method} {path}: {exc.code} {exc.read()[:500]!r}") from None
        return json.loads(data) if data else None

    def start_kernel(self, name: str = "python3-snapshot") -> str:
        """A kernel without a notebook; its id."""
        return str(self.api("POST", "api/kernels", {"name": name})["id"])

    def start_session(self, path: str, kernel: str = "python3-snapshot") -> str:
        """A notebook session as JupyterLab opens it; its kernel's id."""
        body = {"path": path, "name": path, "type": "notebook", "kernel": {"name": kernel}}
        return str(self.api("POST", "api/sessions", body)["kernel"]["id"])

    def end_sessions(self) -> None:
        """Close every session and shut down every kernel."""
        for session in self.api("GET", "api/sessions"):
            with contextlib.suppress(BenchError, OSError):
                self.api("DELETE", f"api/sessions/{session['id']}")
        for kernel in self.api("GET", "api/kernels"):
            with contextlib.suppress(BenchError, OSError):
                self.api("DELETE", f"api/kernels/{kernel['id']}")

    def run_job(
        self,
        path: str,
        body: dict[str, Any] | None = None,
        deadline: Deadline | None = None,
        interval: float = 0.01,
    ) -> JobRun:
        """``POST path`` (an endpoint answering a job: a snapshot, a restore...), then the
        job polled every ``interval`` seconds until it ends; it must succeed."""
        started = time.monotonic()
        job = self.api("POST", path, body or {})["job"]
        first_seen: dict[str, float] = {}
        while job["status"] == "running":
            first_seen.setdefault(job.get("phase") or "?", time.monotonic() - started)
            if deadline is not None:
                deadline.left()
            time.sleep(interval)
            job = self.api("GET", f"api/snapshots/jobs/{job['id']}")
        seconds = time.monotonic() - started
        if job["status"] != "done":
            error = job.get("error") or {}
            raise BenchError(f"{error.get('code')}: {error.get('message')}")
        return JobRun(job, seconds, first_seen)

    def execute(self, kernel_id: str, code: str, timeout: float = 120) -> dict[str, Any]:
        """Run a cell through the kernel's websocket, as JupyterLab does: ``out`` (its
        stdout), ``first_output`` (seconds from sending it to its first output, None if
        none) and ``elapsed`` (to its reply and idle). An error in the cell raises
        BenchError with its last line."""

        async def go() -> dict[str, Any]:
            deadline = time.monotonic() + timeout
            ws = None
            while ws is None:  # a kernel just restored may not take a websocket yet
                try:
                    ws = await ws_connect(self, kernel_id)
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.05)
            msg_id, message = execute_request(code)
            started = time.monotonic()
            ws.write_message(message)
            out: list[str] = []
            first: float | None = None
            reply: dict[str, Any] | None = None
            idle = False
            try:
                while reply is None or not idle:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"the cell did not finish in {timeout:.0f} s")
                    raw = await asyncio.wait_for(ws.read_message(), left)
                    if raw is None:
                        raise BenchError("the kernel's websocket closed (the kernel died?)")
                    msg = json.loads(raw)
                    if msg.get("parent_header", {}).get("msg_id") != msg_id:
                        continue
                    kind = msg["msg_type"]
                    if kind in ("stream", "error") and first is None:
                        first = time.monotonic() - started
                    if kind == "stream" and msg["content"]["name"] == "stdout":
                        out.append(msg["content"]["text"])
                    elif kind == "error":
                        out.append(f"{msg['content']['ename']}: {msg['content']['evalue']}")
                    elif kind == "execute_reply":
                        reply = msg["content"]
                    elif kind == "status" and msg["content"]["execution_state"] == "idle":
                        idle = True
            finally:
                await ws_close(ws)
            elapsed = time.monotonic() - started
            text = "".join(out)
            if reply["status"] != "ok":
                raise BenchError(text.strip().splitlines()[-1] if text.strip() else str(reply))
            return {"out": text, "first_output": first, "elapsed": elapsed}

        return asyncio.run(go())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120) -> int:
        """End the kernels, then the server (kill -9 of all it started after ``timeout``)."""
        if self.process.poll() is None:
            with contextlib.suppress(BenchError, OSError):
                self.end_sessions()
        return super().stop(sig, timeout)


# --- bare CRIU ------------------------------------------------------------------------

# Plain ipykernel, except that its debugger's loopback TCP connection to its own shell
# socket is dropped (as the snapshot kernel does): CRIU cannot dump established TCP
# connections without iptables.
BARE_KERNEL = """
import zmq
from ipykernel.kernelapp import IPKernelApp
class App(IPKernelApp):
    def init_control(self, context):
        super().init_control(context)
        self.debug_shell_socket.close(linger=0)
        self.debug_shell_socket = context.socket(zmq.DEALER)
App.launch_instance()
"""


class BareKernel:
    """A plain ipykernel in its own PID and time namespaces, no server, driven over ZMQ;
    ``args`` go to IPKernelApp. ``connect``: wait for it and connect a client now."""

    def __init__(self, work: Path, args: list[str] | None = None, connect: bool = True) -> None:
        from jupyter_client.connect import write_connection_file

        self.work = work
        self.connection_file = write_connection_file(str(work / "bare-kernel.json"))[0]
        env = {k: v for k, v in os.environ.items() if k != "JPY_PARENT_PID"}
        argv = ["unshare", "--pid", "--fork", "--time", "setsid", sys.executable, "-c"]
        argv += [BARE_KERNEL, "-f", self.connection_file, "--HistoryManager.hist_file=:memory:"]
        self.launcher = subprocess.Popen(
            [*argv, *(args or [])],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=work,
        )
        self.client: Any = None
        self._pid: int | None = None
        if connect:
            self.connect()

    @property
    def pid(self) -> int:
        """The kernel's process (the child of ``unshare``, its namespace's init)."""
        if self._pid is None:
            children = Path(f"/proc/{self.launcher.pid}/task/{self.launcher.pid}/children")
            for _ in range(500):
                found = children.read_text().split()
                if found:
                    self._pid = int(found[0])
                    break
                time.sleep(0.01)
            else:
                raise RuntimeError("the bare kernel did not start")
        return self._pid

    def connect(self, timeout: float = 60) -> None:
        from jupyter_client.blocking.client import BlockingKernelClient

        self.client = BlockingKernelClient(connection_file=self.connection_file)
        self.client.load_connection_file()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=timeout)

    def disconnect(self) -> None:
        self.client.stop_channels()
        self.client = None

    def run(self, code: str, timeout: float) -> dict[str, Any]:
        """Run a cell: ``out`` (its stdout) and ``first_output`` (seconds to it)."""
        out: list[str] = []
        first: list[float] = []
        started = time.monotonic()

        def hook(msg: dict[str, Any]) -> None:
            if msg["msg_type"] in ("stream", "error") and not first:
                first.append(time.monotonic() - started)
            if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                out.append(f"{msg['content']['ename']}: {msg['content']['evalue']}")

        reply = self.client.execute_interactive(code, timeout=timeout, output_hook=hook)
        if reply["content"]["status"] != "ok":
            raise BenchError("".join(out).strip() or str(reply["content"]))
        return {"out": "".join(out), "first_output": first[0] if first else None}

    def kill(self) -> None:
        """kill -9 the kernel (and so its namespace) and wait until it is gone."""
        if self.client is not None:
            self.disconnect()
        pid = self._pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.launcher.kill()
        self.launcher.wait()
        for _ in range(500):
            if pid is None or not Path(f"/proc/{pid}").exists():
                return
            time.sleep(0.01)


def criu_dump(
    criu: Criu, pid: int, images: Path, prev: str | None = None, deadline: Deadline | None = None
) -> None:
    """``criu dump --leave-running`` of ``pid`` into ``images``; with ``prev`` not None,
    tracking memory for incremental dumps, on the images in ``prev`` when not empty."""
    argv = [str(criu.path), "dump", "-t", str(pid), "-D", str(images), "-o", "dump.log"]
    argv += ["-v4", "--file-locks", "--leave-running"]
    if prev is not None:
        argv += ["--track-mem"] + (["--prev-images-dir", prev] if prev else [])
    # A client's TCP connections close a moment after it stops; CRIU refuses established
    # ones, so a dump is tried again while they linger.
    for attempt in range(50):
        shutil.rmtree(images, ignore_errors=True)
        images.mkdir()
        timeout = deadline.left() if deadline is not None else None
        result = subprocess.run(argv, capture_output=True, timeout=timeout, check=False)
        if result.returncode == 0:
            return
        log = (images / "dump.log").read_text(errors="replace")
        if "established" not in log.lower() or attempt == 49:
            errors = [line for line in log.splitlines() if "Error" in line][-3:]
            raise BenchError(f"criu dump failed: {' | '.join(errors)}")
        time.sleep(0.05)


def criu_restore(
    criu: Criu,
    images: Path,
    pidfile: Path,
    deadline: Deadline | None = None,
    verbose: bool = True,
) -> int:
    """``criu restore --restore-detached`` of ``images``; the restored process's id.
    ``verbose``: CRIU's full log (-v4) in ``images/restore.log``."""
    pidfile.unlink(missing_ok=True)
    argv = [str(criu.path), "restore", "-D", str(images), "-o", "restore.log"]
    argv += ["-v4"] if verbose else []
    argv += ["--file-locks", "--restore-detached", "--pidfile", str(pidfile)]
    timeout = deadline.left() if deadline is not None else None
    result = subprocess.run(argv, capture_output=True, timeout=timeout, check=False)
    if result.returncode != 0:
        log = (images / "restore.log").read_text(errors="replace").splitlines()
        errors = [line for line in log if "Error" in line][-3:]
        raise BenchError(f"criu restore failed: {errors or log[-3:]}")
    return int(pidfile.read_text())
