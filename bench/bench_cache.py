"""Same-machine restore from the local image cache vs bare ``criu restore`` of the same images.

A real ``jupyter server`` with the extension (local store, image cache on) runs a snapshot
kernel holding ``--mib`` MiB of random floats; one snapshot of it is taken through the
REST API, so its images sit in the image cache. Then, ``--repeat`` times, interleaved:

- *in place*: the kernel is restarted (as jupyter_server does after a crash: a fresh,
  empty kernel) and the snapshot restored into it, POST until the job is done, and until
  the first output of a cell (``print('ok')``) run on it through the kernel's websocket
  (the fresh kernel is saved first: a restore in place never loses the kernel it
  replaces); then the kernel checks its memory (``x.sum() == s``, not timed);
- *new kernel*: the snapshot restored into a new kernel (server restarted, notebook
  reopened), POST until done and until first output;
- *bare*: ``criu restore`` of the very same image directory with the options and
  inherited fds our wrapper gives it (the ceiling: no server, no wrapper, no checks);
- *store*: the cache entry removed first, so the restore (new kernel) downloads from the
  local store, as every restore did before the cache (and caches it again).

The server restores eagerly, as bare CRIU does; ``--lazy`` turns its lazy restore on.

Goal (issue 16): a restore served from the cache within 1.3x of the bare restore.

    nice -n 10 .venv/bin/python bench/bench_cache.py --mib 600 --repeat 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jupyter_ext.core.criu import Criu
from jupyter_ext.core.humanize import human_bytes
from jupyter_ext.core.manifest import IMAGES_DIR, Manifest

STATE = "import numpy as np; x = np.random.default_rng(1).random({mib} * 131072); s = x.sum()"


class Server:
    """``jupyter server`` with the extension, in its own directories under ``home``."""

    def __init__(self, home: Path, lazy: bool = False) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/"
        self.token = secrets.token_hex(16)
        (home / "notebooks").mkdir(parents=True)
        config = {
            "ServerApp": {"jpserver_extensions": {"jupyter_ext": True}},
            "SnapshotExtensionApp": {
                "local_store_dir": str(home / "store"),
                "work_dir": str(home / "work"),
                "idle_suspend_after": 0,
                "snapshot_before_shutdown": False,
                "keep_last": 0,
                # CRIU restores the whole memory before the kernel runs, as bare CRIU does.
                "lazy_restore": lazy,
            },
        }
        (home / "config.json").write_text(json.dumps(config))
        env = {
            **os.environ,
            "JUPYTER_DATA_DIR": str(home / "data"),
            "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
            "JUPYTER_CONFIG_DIR": str(home / "config"),
        }
        self.log = (home / "server.log").open("wb")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyter_server",
                "--allow-root",
                "--no-browser",
                "--ServerApp.ip=127.0.0.1",
                f"--ServerApp.port={self.port}",
                "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={home / 'notebooks'}",
                f"--config={home / 'config.json'}",
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                self.api("GET", "api/snapshots/policy")
                return
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError("the server did not start") from None
                time.sleep(0.2)

    def api(self, method: str, path: str, body: Any = None) -> Any:
        request = urllib.request.Request(
            self.url + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {self.token}"},
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            data = response.read()
        return json.loads(data) if data else None

    def job(self, job: dict[str, Any]) -> dict[str, Any]:
        """Poll a job every 5 ms until it ends; it must succeed. Adds "phases": seconds
        from the job's start at which each phase was first seen."""
        phases: dict[str, float] = {}
        while job["status"] == "running":
            phases.setdefault(job["phase"], round(time.time() - job["started"], 3))
            time.sleep(0.005)
            job = self.api("GET", f"api/snapshots/jobs/{job['id']}")
        if job["status"] != "done":
            raise RuntimeError(f"job failed: {job}")
        return {**job, "phases": phases}

    def execute(self, kernel_id: str, code: str) -> str:
        """Run a cell through the kernel's websocket, as JupyterLab does; its stdout."""
        from tornado.httpclient import HTTPRequest
        from tornado.websocket import websocket_connect

        async def run() -> str:
            url = f"ws://127.0.0.1:{self.port}/api/kernels/{kernel_id}/channels"
            headers = {"Authorization": f"token {self.token}"}
            ws = await websocket_connect(HTTPRequest(url, headers=headers))
            msg_id = uuid.uuid4().hex
            header = {
                "msg_id": msg_id,
                "msg_type": "execute_request",
                "session": uuid.uuid4().hex,
                "username": "bench",
                "date": "2026-01-01T00:00:00Z",
                "version": "5.3",
            }
            content = {"code": code, "silent": False, "store_history": False}
            content.update(user_expressions={}, allow_stdin=False)
            message = {"header": header, "parent_header": {}, "metadata": {}}
            message.update(content=content, channel="shell", buffers=[])
            ws.write_message(json.dumps(message))
            try:
                while True:
                    raw = await asyncio.wait_for(ws.read_message(), 120)
                    if raw is None:
                        raise RuntimeError("the kernel's websocket closed")
                    msg = json.loads(raw)
                    if msg.get("parent_header", {}).get("msg_id") != msg_id:
                        continue
                    if msg["msg_type"] == "stream":
                        return str(msg["content"]["text"])
                    if msg["msg_type"] == "error":
                        raise RuntimeError("\n".join(msg["content"]["traceback"]))
            finally:
                ws.close()

        return asyncio.run(run())

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()


def bare_restore(criu: Criu, snapshot_dir: Path) -> float:
    """``criu restore`` of the snapshot's images with our wrapper's options and inherited
    fds (a pipe for its output, a directory for its channels); the restored tree is
    killed afterwards. Returns the seconds CRIU ran."""
    manifest = Manifest.read(snapshot_dir)
    work = Path(tempfile.mkdtemp(prefix="bare-restore-"))
    channels = Path(tempfile.mkdtemp(prefix="bare-channels-"))
    read_end, write_end = os.pipe()
    dir_fd = os.open(channels, os.O_RDONLY | os.O_DIRECTORY)
    pidfile = work / "restored.pid"
    args = [str(criu.path), "restore", "-D", str(snapshot_dir / IMAGES_DIR), "-W", str(work)]
    args += ["-o", "restore.log", "-v4", "--file-locks", "--restore-detached"]
    args += ["--restore-sibling", "--tcp-close", "--pidfile", str(pidfile)]
    args += ["--inherit-fd", f"fd[{write_end}]:{manifest.stdio_pipe}"]
    args += ["--inherit-fd", f"fd[{dir_fd}]:{manifest.runtime_dir_key}"]
    try:
        started = time.monotonic()
        subprocess.run(args, check=True, pass_fds=(write_end, dir_fd), stdin=subprocess.DEVNULL)
        seconds = time.monotonic() - started
        pid = int(pidfile.read_text())
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return seconds
    finally:
        for fd in (read_end, write_end, dir_fd):
            os.close(fd)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(channels, ignore_errors=True)


def restore_in_place(server: Server, kernel_id: str, snapshot_id: str) -> dict[str, Any]:
    """The kernel restarted (what jupyter_server does after a crash: a fresh, empty
    kernel), then the snapshot restored into it (its fresh state is saved first)."""
    server.api("POST", f"api/kernels/{kernel_id}/restart", {})
    while server.api("GET", f"api/snapshots/kernels/{kernel_id}").get("state") != "running":
        time.sleep(0.05)
    server.execute(kernel_id, "print(1)")
    started = time.monotonic()
    body = {"kernel_id": kernel_id}
    job = server.job(server.api("POST", f"api/snapshots/{snapshot_id}/restore", body)["job"])
    done = time.monotonic() - started
    assert server.execute(kernel_id, "print('ok')").strip() == "ok"
    output = time.monotonic() - started
    assert server.execute(kernel_id, "print(x.sum() == s)").strip() == "True"
    return {"done": done, "output": output, "source": job["result"]["source"], **job["phases"]}


def restore_new(server: Server, snapshot_id: str) -> dict[str, Any]:
    started = time.monotonic()
    job = server.job(server.api("POST", f"api/snapshots/{snapshot_id}/restore", {})["job"])
    done = time.monotonic() - started
    kernel_id = job["result"]["kernel_id"]
    assert server.execute(kernel_id, "print('ok')").strip() == "ok"
    output = time.monotonic() - started
    assert server.execute(kernel_id, "print(x.sum() == s)").strip() == "True"
    server.api("DELETE", f"api/kernels/{kernel_id}")
    return {"done": done, "output": output, "source": job["result"]["source"], **job["phases"]}


def bench_cache(mib: int, repeat: int, home: Path, lazy: bool = False) -> dict[str, Any]:
    """Restores from the image cache against bare ``criu restore`` of the same images:
    every run and the medians (seconds). ``lazy``: the server restores with lazy pages."""
    criu = Criu.locate()
    server = Server(home, lazy)
    try:
        kernel_id = server.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
        server.execute(kernel_id, STATE.format(mib=mib) + "; print('ready')")
        snap = server.job(server.api("POST", "api/snapshots", {"kernel_id": kernel_id})["job"])
        snapshot_id = snap["result"]["id"]
        entry = home / "work" / "image-cache" / snapshot_id
        assert entry.is_dir(), "the snapshot is not in the image cache"
        runs: dict[str, list[Any]] = {"in_place": [], "new_kernel": [], "bare": [], "store": []}
        for i in range(repeat):
            order = ["in_place", "new_kernel", "bare", "store"]
            for kind in order[i % 4 :] + order[: i % 4]:
                if kind == "bare":
                    runs["bare"].append(bare_restore(criu, entry))
                elif kind == "in_place":
                    runs["in_place"].append(restore_in_place(server, kernel_id, snapshot_id))
                elif kind == "store":  # the entry gone: downloaded (and cached again)
                    shutil.rmtree(entry)
                    runs["store"].append(restore_new(server, snapshot_id))
                    assert entry.is_dir(), "the download was not cached"
                else:
                    runs["new_kernel"].append(restore_new(server, snapshot_id))
        sources = {r["source"] for kind in ("in_place", "new_kernel") for r in runs[kind]}
        assert sources == {"cache"}, sources
        assert {r["source"] for r in runs["store"]} == {"store"}
        bare = statistics.median(runs["bare"])
        result: dict[str, Any] = {
            "mib": mib,
            "image_bytes": snap["result"]["total_bytes"],
            "criu": criu.version_text,
            "cpus": os.cpu_count(),
            "repeat": repeat,
            "lazy_restore": lazy,
            "bare_restore": bare,
            "runs": runs,
        }
        for kind in ("in_place", "new_kernel", "store"):
            for what in ("done", "output"):
                values = [r[what] for r in runs[kind]]
                result[f"{kind}_{what}"] = statistics.median(values)
                result[f"{kind}_{what}_ratio"] = statistics.median(values) / bare
                # Ours against the bare restore of the same round (the machine is shared).
                paired = [v / b for v, b in zip(values, runs["bare"], strict=True)]
                result[f"{kind}_{what}_paired"] = statistics.median(paired)
        return result
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=600)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write every run here")
    parser.add_argument("--lazy", action="store_true", help="the server restores lazily")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    try:
        result = bench_cache(args.mib, args.repeat, home, args.lazy)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    print(
        f"{result['criu']}, {result['cpus']} CPUs, {args.mib} MiB kernel "
        f"({human_bytes(result['image_bytes'])} of images), median of {args.repeat} runs, "
        f"lazy restore {'on' if args.lazy else 'off'}"
    )
    print(f"{'bare criu restore:':<48}{result['bare_restore']:.3f} s")
    kinds = [("in_place", "cache, in place after a restart"), ("new_kernel", "cache, new kernel")]
    for kind, label in [*kinds, ("store", "store (local), new kernel")]:
        for what, words in (("done", "job done"), ("output", "first output")):
            value, ratio = result[f"{kind}_{what}"], result[f"{kind}_{what}_ratio"]
            paired = result[f"{kind}_{what}_paired"]
            print(
                f"{label + ', ' + words + ':':<48}{value:.3f} s  ({ratio:.2f}x bare; "
                f"{paired:.2f}x in each round)"
            )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
