"""Soak: an hour under load, nothing lost, and a server that stays lean (issues 34 item 4
and 46 item 4).

A real ``jupyter server`` with the extension on an encrypted S3 store (moto on 127.0.0.1),
retention on (``keep_last``), periodic snapshots (``--periodic``), jupyter_server's
kernel culler at a short timeout (``--cull-timeout``, culled kernels suspended), and
``--kernels`` snapshot kernels in notebook sessions, each holding ``--mib`` MiB:

- a third of them print numbered lines all along (``--print-rate`` a second each), which a
  websocket of JupyterLab's protocol receives and checks: each number once, in order (a
  restore in place sends a kernel back: a rewind, never a skip);
- one is idle between its cells (each once the culler has had time to suspend it: the
  idle timeout and two of its intervals), the cell brings it back, its state kept;
- the others change part of their memory every round;
- every round, all but the idle one are snapshotted on demand (REST jobs, at once; one
  refused because a periodic snapshot of that kernel runs is counted apart); every
  ``--restore-every`` rounds one is restored in place from its newest snapshot, and a
  worker must then hold what it held when the snapshot was taken.

Until ``--minutes`` are over. Then ``store check --read-data`` runs on what retention kept,
every kernel is shut down and the server left idle for ``--settle`` seconds. Reported:
failed jobs (ours, and the periodic ones from the server's log, under load; those of the
shutdown at the end apart: a culler's suspend cut short by it), the server's errors,
restores exact, kernels culled and resumed, numbered lines received and lost, the store
check, and the server's RSS (``/proc/PID/status``) cold, after a warm-up (one snapshot and
restore of a small kernel: one-time loads), its peak under load and after all kernels are
gone: the goal is at most 1.5x the warmed start. Exit status 0 when every goal is met.

``--tracemalloc DIR`` runs the server with Python's tracemalloc on and writes where the
memory the server still holds after the soak was allocated since the start
(``DIR/top.txt``); ``--diagnose DIR`` writes its smaps, malloc statistics, objects and
threads per phase: the tools that found what the server held (bench/RESULTS.md).

    .venv/bin/python bench/bench_soak.py --quick                   # ~3 minutes
    nice -n 5 .venv/bin/python bench/bench_soak.py --minutes 60 --json /tmp/soak.json
    .venv/bin/python bench/bench_soak.py --quick --baseline 2      # beside glibc's defaults
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from harness import QUIET, BenchError, MotoServer, Server, extension_config

BUCKET = "kernel-snapshots-soak"

#: Loaded into the server process only (``sys.orig_argv`` names jupyter_server; kernels and
#: their wrappers are other interpreters). With ``JKS_SOAK_TRACE``: the first SIGUSR2 starts
#: tracemalloc (traced from the server's start, it started 5x slower here, past the ready
#: timeout; what grows comes later anyway), each one dumps a snapshot. With
#: ``JKS_SOAK_DIAG``: each SIGRTMIN+1 (jupyter_server has SIGUSR1) writes pymalloc's
#: statistics (``sys._debugmallocstats``), glibc's ``malloc_info``, the commonest object
#: types (after a full collection) and the threads to a new directory.
SERVER_HOOK = """
import sys
if "jupyter_server" in sys.orig_argv:
    import os, signal
    def _dump(signum, frame):
        import tracemalloc
        if not tracemalloc.is_tracing():
            tracemalloc.start(8)
        path = os.environ["JKS_SOAK_TRACE"] + f"/{int(os.times().elapsed * 1000)}.trace"
        tracemalloc.take_snapshot().dump(path)
    def _diagnose(signum, frame):
        import collections, ctypes, gc, threading
        directory = os.environ["JKS_SOAK_DIAG"] + f"/{int(os.times().elapsed * 1000)}"
        os.makedirs(directory + ".tmp")
        fd = os.open(directory + ".tmp/pymalloc.txt", os.O_WRONLY | os.O_CREAT)
        saved = os.dup(2)
        os.dup2(fd, 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(fd)
        libc = ctypes.CDLL(None)
        libc.fopen.restype = ctypes.c_void_p
        libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        stream = libc.fopen((directory + ".tmp/malloc_info.xml").encode(), b"w")
        libc.malloc_info(0, stream)
        libc.fclose(stream)
        unreachable = gc.collect()  # what is left is held
        objects = gc.get_objects()
        counts = collections.Counter(type(o).__qualname__ for o in objects)
        with open(directory + ".tmp/objects.txt", "w") as out:
            out.write(f"gc-tracked objects: {len(objects)} ({gc.get_freeze_count()} frozen, ")
            out.write(f"{unreachable} unreachable collected first)\\n")
            out.writelines(f"{n} {name}\\n" for name, n in counts.most_common(40))
            out.write("threads:\\n")
            out.writelines(f"  {t.name}\\n" for t in threading.enumerate())
        os.rename(directory + ".tmp", directory)
    if os.environ.get("JKS_SOAK_TRACE"):
        signal.signal(signal.SIGUSR2, _dump)
    if os.environ.get("JKS_SOAK_DIAG"):
        signal.signal(signal.SIGRTMIN + 1, _diagnose)
"""


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def memory(pid: int) -> dict[str, int]:
    """The server's RSS, split as ``smaps_rollup`` splits it (anonymous: malloc's heap and
    arenas, Python's; file: mapped libraries and files), and its thread count."""
    found = {"rss": rss_bytes(pid)}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("Anonymous", "Pss_File"):
            found[name.lower()] = int(rest.split()[0]) * 1024
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            found["threads"] = int(line.split()[1])
    return found


def mib(value: int) -> str:
    return f"{value / (1 << 20):.0f} MiB"


class ServerHook:
    """What the server runs at start (SERVER_HOOK): tracemalloc snapshots (``trace``) and
    memory diagnostics (``diagnose``) taken on demand, written under the given folders."""

    def __init__(self, trace: Path | None, diagnose: Path | None) -> None:
        self.trace, self.diagnose = trace, diagnose
        for directory in (trace, diagnose):
            if directory is not None:
                directory.mkdir(parents=True, exist_ok=True)
        self.hook = Path(tempfile.mkdtemp(prefix="jks-soak-hook-"))
        (self.hook / "sitecustomize.py").write_text(textwrap.dedent(SERVER_HOOK))

    def env(self) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(self.hook), os.environ.get("PYTHONPATH")) if p)
        env = {"PYTHONPATH": path}
        if self.trace is not None:
            env["JKS_SOAK_TRACE"] = str(self.trace)
        if self.diagnose is not None:
            env["JKS_SOAK_DIAG"] = str(self.diagnose)
        return env

    def take_trace(self, pid: int) -> Path | None:
        if self.trace is None:
            return None
        before = set(self.trace.glob("*.trace"))
        os.kill(pid, signal.SIGUSR2)
        for _ in range(600):
            made = set(self.trace.glob("*.trace")) - before
            if made:
                [path] = made
                size = -1
                while size != path.stat().st_size:  # written out
                    size = path.stat().st_size
                    time.sleep(0.5)
                return path
            time.sleep(0.1)
        raise TimeoutError("the server wrote no tracemalloc snapshot")

    def compare(self, first: Path, last: Path, top: int = 30) -> str:
        import tracemalloc

        old = tracemalloc.Snapshot.load(str(first))
        new = tracemalloc.Snapshot.load(str(last))
        lines = [f"total traced: {mib(sum(s.size for s in new.statistics('filename')))}"]
        for stat in new.compare_to(old, "traceback")[:top]:
            lines.append(f"{stat.size_diff / 1024:+.0f} KiB in {stat.count_diff:+d} blocks")
            lines.extend(f"    {line}" for line in stat.traceback.format()[-8:])
        return "\n".join(lines)

    def take_diagnostics(self, pid: int, label: str) -> None:
        """``diagnose/label/``: the hook's files and the server's ``/proc/PID/smaps``."""
        if self.diagnose is None:
            return
        before = {p for p in self.diagnose.iterdir() if p.name[0].isdigit()}
        smaps = Path(f"/proc/{pid}/smaps").read_text()
        os.kill(pid, signal.SIGRTMIN + 1)
        for _ in range(600):
            made = {p for p in self.diagnose.iterdir() if p.name[0].isdigit()} - before
            made = {p for p in made if not p.name.endswith(".tmp")}
            if made:
                [path] = made
                (path / "smaps.txt").write_text(smaps)
                path.rename(self.diagnose / label)
                return
            time.sleep(0.1)
        raise TimeoutError("the server wrote no diagnostics")


CREDENTIALS = {"AWS_ACCESS_KEY_ID": "soak", "AWS_SECRET_ACCESS_KEY": "soak"}
WARM_UP_MIB = 8
V1 = "v1.kernel.websocket.jupyter.org"
#: A printer kernel's thread: numbered lines, one stream message each, for ever.
PRINTER = """
import threading, time
def _soak_print(rate):
    i = 0
    while True:
        print(f"soak {i}", flush=True)
        i += 1
        time.sleep(1 / rate)
threading.Thread(target=_soak_print, args=(%g,), daemon=True).start()
"""
#: A worker's cell: a few MiB of its memory changed, and what a restore must give back.
WORK = "n += 1; a[(n * 65536) % a.size:][:393216] = n; print(n, int(a[::4096].sum()))"
STATE = "print(n, int(a[::4096].sum()))"


class Printer:
    """A printer kernel's numbered output, as JupyterLab receives it (a websocket of the
    v1 protocol, open all along), checked: each number once and in order; a restore in
    place may send the kernel back (a rewind), never skip one."""

    def __init__(self, server: Server, kernel_id: str) -> None:
        self.server, self.kernel_id = server, kernel_id
        self.received = 0
        self.lost = 0
        self.rewinds = 0
        self.last = -1
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        if not self._connected.wait(120):
            raise BenchError(f"no websocket to printer {kernel_id}")

    async def _run(self) -> None:
        from jupyter_server.services.kernels.connection.base import deserialize_msg_from_ws_v1
        from tornado.httpclient import HTTPRequest
        from tornado.websocket import websocket_connect

        url = "ws" + self.server.url.removeprefix("http") + f"api/kernels/{self.kernel_id}/channels"
        request = HTTPRequest(url, headers={"Authorization": f"token {self.server.token}"})
        ws = await websocket_connect(request, subprotocols=[V1])
        self._connected.set()
        try:
            while not self._stop.is_set():
                try:
                    raw = await asyncio.wait_for(ws.read_message(), 0.5)
                except TimeoutError:
                    continue
                if raw is None:
                    self.errors.append("the websocket closed")
                    return
                if not isinstance(raw, bytes):
                    continue
                channel, parts = deserialize_msg_from_ws_v1(raw)
                if channel != "iopub" or b'"stream"' not in parts[0]:
                    continue
                for line in json.loads(parts[3]).get("text", "").splitlines():
                    if line.startswith("soak "):
                        self.saw(int(line.split()[1]))
        finally:
            ws.close()

    def saw(self, number: int) -> None:
        self.received += 1
        if number > self.last + 1:
            self.lost += number - self.last - 1
            self.errors.append(f"{number} after {self.last}")
        elif number <= self.last:
            self.rewinds += 1
        self.last = number

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def cull_interval(args: argparse.Namespace) -> int:
    """How often the kernel culler looks (s), for its idle timeout."""
    return max(1, int(args.cull_timeout) // 6)


class Load:
    """The soak's load on ``kernels``: the first ``printers`` print numbered lines all
    along, one is the culler's (idle between its cells), the others work every round;
    every kernel is snapshotted on demand each round it runs (and periodically by the
    server), and now and then one is restored in place from its newest snapshot."""

    def __init__(self, server: Server, kernels: list[str], args: argparse.Namespace) -> None:
        self.server, self.args = server, args
        count = max(1, len(kernels) // 3)
        self.printer_ids, self.sleeper = kernels[:count], kernels[count]
        self.workers = kernels[count + 1 :]
        self.printers = [Printer(server, k) for k in self.printer_ids]
        for kernel in self.printer_ids:
            server.execute(kernel, PRINTER % args.print_rate)
        self.expected: dict[str, dict[str, str]] = {k: {} for k in kernels}
        """Kernel -> its snapshots taken here -> what STATE printed when it was taken."""
        self.tally = {
            "snapshots": 0,
            "failed": 0,
            "restores": 0,
            "from_store": 0,
            "exact": 0,
            "culled": 0,
            "busy": 0,
        }
        self.failures: list[str] = []
        self.sleeper_n = 0
        #: The sleeper's cell comes once the culler has had time to suspend it.
        self.sleeper_idle = args.cull_timeout + 2 * cull_interval(args) + 1
        self.sleeper_woken = time.monotonic()

    def job(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        try:
            return self.server.run_job(path, body).result
        except (BenchError, OSError) as exc:
            if "kernel-busy" in str(exc):  # a periodic snapshot of it runs: refused, rightly
                self.tally["busy"] += 1
                return None
            self.tally["failed"] += 1
            self.failures.append(f"{path}: {exc}")
            return None

    def snapshot(self, kernel: str, state: str) -> None:
        made = self.job("api/snapshots", {"kernel_id": kernel})
        if made is not None:
            self.tally["snapshots"] += 1
            self.expected[kernel][made["id"]] = state

    def work(self, kernel: str) -> None:
        self.snapshot(kernel, self.server.execute(kernel, WORK)["out"].strip())

    def restore(self, kernel: str, oldest: bool) -> None:
        """In place, from its newest snapshot (the local image cache holds it), or its
        oldest one retention kept (read from the store, lazily through the server); a
        worker must then hold what it held when the snapshot was taken."""
        listed = self.server.api("GET", f"api/snapshots?kernel_id={kernel}")["snapshots"]
        known = [s["id"] for s in listed if s["id"] in self.expected[kernel]]  # newest first
        if not known:
            return
        snapshot = known[-1] if oldest else known[0]
        state = self.expected[kernel][snapshot]
        result = self.job(f"api/snapshots/{snapshot}/restore", {"kernel_id": kernel})
        if result is None:
            return  # failed (a failure), or refused while a periodic snapshot of it ran
        self.tally["restores"] += 1
        self.tally["from_store"] += result.get("source") == "store"
        if kernel in self.printer_ids or self.server.execute(kernel, STATE)["out"].strip() == state:
            self.tally["exact"] += 1
        else:
            self.failures.append(f"restore of {snapshot} into {kernel}: not its state")

    def wake_sleeper(self) -> None:
        """The culler suspends the sleeper between its cells; a cell brings it back."""
        status = self.server.api("GET", f"api/snapshots/kernels/{self.sleeper}")
        if status.get("state") == "suspended":
            self.tally["culled"] += 1
        out = self.server.execute(
            self.sleeper, "sleeper = globals().get('sleeper', 0) + 1; print(sleeper)"
        )
        self.sleeper_n += 1
        self.sleeper_woken = time.monotonic()
        if out["out"].strip() != str(self.sleeper_n):
            self.failures.append(f"the sleeper printed {out['out']!r}, not {self.sleeper_n}")

    def round(self, number: int, pool: ThreadPoolExecutor) -> None:
        tasks = [pool.submit(self.work, k) for k in self.workers]
        tasks += [pool.submit(self.snapshot, k, "") for k in self.printer_ids]
        if time.monotonic() - self.sleeper_woken >= self.sleeper_idle:
            tasks.append(pool.submit(self.wake_sleeper))
        for task in tasks:
            task.result()
        if number % self.args.restore_every == 0:
            kernels = [*self.workers, *self.printer_ids]
            turn = number // self.args.restore_every
            self.restore(kernels[turn % len(kernels)], oldest=turn % 2 == 0)

    def output(self) -> dict[str, Any]:
        for printer in self.printers:
            printer.stop()
        return {
            "received": sum(p.received for p in self.printers),
            "lost": sum(p.lost for p in self.printers),
            "rewinds": sum(p.rewinds for p in self.printers),
            "errors": [e for p in self.printers for e in p.errors][:20],
        }


def server_log_problems(log: str) -> dict[str, Any]:
    """What the server's log says went wrong: failed jobs (periodic ones too) and errors."""
    failed = [line for line in log.splitlines() if re.search(r" of kernel \S+ failed", line)]
    errors = [
        line
        for line in log.splitlines()
        if re.match(r"\[[EC] ", line) and "received signal 15, stopping" not in line
    ]
    tracebacks = log.count("Traceback (most recent call last)")
    return {
        "failed_jobs": len(failed),
        "errors": len(errors),
        "tracebacks": tracebacks,
        "examples": (failed + errors)[:10],
    }


def soak(
    args: argparse.Namespace, work: Path, run: int = 1, glibc_defaults: bool = False
) -> dict[str, Any]:
    """One soak (the ``run``-th); ``glibc_defaults``: the server without the product's malloc tuning
    (``jupyter_ext.memory``), the baseline."""
    for name, value in CREDENTIALS.items():  # moto takes any; boto3 wants some
        os.environ.setdefault(name, value)
    moto = MotoServer(work / "moto.log")
    way = "glibc-defaults" if glibc_defaults else "ours"
    diagnose = Path(args.diagnose) / f"{run}-{way}" if args.diagnose else None
    hook = ServerHook(Path(args.tracemalloc) if args.tracemalloc else None, diagnose)
    try:
        moto.ensure_bucket(BUCKET)
        config = extension_config(
            work / "snapwork",
            **{
                **QUIET,
                "keep_last": args.keep_last,
                "keep_hourly_hours": 0,
                "keep_daily_days": 0,
                "periodic_interval": args.periodic,
            },
            store="s3",
            s3_bucket=BUCKET,
            s3_endpoint_url=moto.url,
            s3_region="us-east-1",
        )
        config["MappingKernelManager"] = {
            "cull_idle_timeout": args.cull_timeout,
            "cull_interval": cull_interval(args),
            "cull_connected": False,
        }
        env = dict(CREDENTIALS)
        if not args.pymalloc:  # as the product's launchers start it (jupyter_ext/memory.py)
            env["PYTHONMALLOC"] = "malloc"
        if glibc_defaults:
            env["JUPYTER_SNAPSHOT_MALLOC_TUNING"] = "0"
        env.update(hook.env())
        server = Server(work / "server", work / "notebooks", config, env=env)
        pid = server.process.pid
        phases: dict[str, dict[str, int]] = {}

        def phase(label: str) -> None:
            phases[label] = memory(pid)
            hook.take_diagnostics(pid, label)

        try:
            time.sleep(2)  # the start-up's last allocations
            phase("cold")
            # Warm-up: one small kernel snapshotted, restored in place and shut down, so
            # that what the first snapshot and restore load once (boto3's service models,
            # the S3 client, the kernelspec, nbformat's validators...) is not counted as
            # what load leaves.
            warm = server.start_session("warm-up.ipynb")
            server.execute(warm, f"import numpy as np; w = np.ones({WARM_UP_MIB << 17})")
            first = server.run_job("api/snapshots", {"kernel_id": warm}).result["id"]
            server.run_job(f"api/snapshots/{first}/restore", {"kernel_id": warm})
            server.end_sessions()
            time.sleep(args.settle)
            phase("warm")
            first_trace = hook.take_trace(pid)
            kernels = [server.start_session(f"soak-{i}.ipynb") for i in range(args.kernels)]
            elements = args.mib << 17  # float64s
            for kernel in kernels:
                server.execute(kernel, f"import numpy as np; a = np.ones({elements}); n = 0")
            load = Load(server, kernels, args)
            peak = rss_bytes(pid)
            rounds = 0
            deadline = time.monotonic() + args.minutes * 60
            with ThreadPoolExecutor(args.kernels + 1) as pool:
                while time.monotonic() < deadline:
                    rounds += 1
                    load.round(rounds, pool)
                    now = rss_bytes(pid)
                    peak = max(peak, now)
                    print(f"round {rounds}: {load.tally}, RSS {mib(now)}", flush=True)
            output = load.output()
            phase("loaded")
            checked = server.run_job("api/snapshots/store/check", {"read_data": True}).result
            listed = len(server.api("GET", "api/snapshots")["snapshots"])
            loaded_log = len(server.log())
            server.end_sessions()
            time.sleep(args.settle)
            phase("after")
            trace = None
            if first_trace is not None:
                last_trace = hook.take_trace(pid)
                assert last_trace is not None
                report = hook.compare(first_trace, last_trace)
                (Path(args.tracemalloc) / "top.txt").write_text(report + "\n")
                trace = str(Path(args.tracemalloc) / "top.txt")
        finally:
            server.stop()
        log = server.log()
        problems = server_log_problems(log[:loaded_log])
        teardown = server_log_problems(log[loaded_log:])
    finally:
        moto.stop()
        shutil.rmtree(hook.hook, ignore_errors=True)
    return {
        "kernels": args.kernels,
        "mib": args.mib,
        "minutes": args.minutes,
        "rounds": rounds,
        **load.tally,
        "failures": load.failures[:20],
        "output": output,
        "server_log": problems,
        "server_log_teardown": teardown,
        "kept": listed,
        "store_check": {
            k: checked[k] for k in ("ok", "snapshots", "chunks", "read_bytes", "broken", "seconds")
        },
        "rss_cold": phases["cold"]["rss"],
        "rss_start": phases["warm"]["rss"],
        "rss_peak": peak,
        "rss_loaded": phases["loaded"]["rss"],
        "rss_after": phases["after"]["rss"],
        "after_vs_start": round(phases["after"]["rss"] / phases["warm"]["rss"], 2),
        "after_vs_cold": round(phases["after"]["rss"] / phases["cold"]["rss"], 2),
        "phases": phases,
        "tracemalloc": trace,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=6)
    parser.add_argument("--mib", type=int, default=64, help="memory of each kernel")
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--keep-last", type=int, default=3, help="retention per notebook")
    parser.add_argument("--periodic", type=float, default=60.0, help="periodic_interval (s)")
    parser.add_argument(
        "--cull-timeout", type=int, default=30, help="the kernel culler's idle timeout (s)"
    )
    parser.add_argument(
        "--restore-every", type=int, default=4, help="a restore in place every N rounds"
    )
    parser.add_argument(
        "--print-rate", type=float, default=20.0, help="numbered lines a second per printer"
    )
    parser.add_argument("--settle", type=float, default=30.0, help="idle seconds at the end")
    parser.add_argument("--quick", action="store_true", help="3 kernels of 32 MiB, 1.5 minutes")
    parser.add_argument("--tracemalloc", metavar="DIR", help="trace the server's memory")
    parser.add_argument(
        "--diagnose",
        metavar="DIR",
        help="write the server's smaps, malloc statistics, objects and threads per phase",
    )
    parser.add_argument("--json", metavar="PATH", help="write the result here too")
    parser.add_argument(
        "--pymalloc",
        action="store_true",
        help="the server with CPython's own small-object allocator (before 2026-12-05)",
    )
    parser.add_argument(
        "--baseline",
        type=int,
        default=0,
        metavar="N",
        help="N rounds of (glibc's malloc defaults, ours), interleaved: side by side",
    )
    args = parser.parse_args()
    if args.quick:
        args.kernels, args.mib, args.minutes = 3, 32, 1.5
        args.restore_every, args.cull_timeout = 2, 8
    ways = [True, False] * args.baseline or [False]
    results = []
    for run, glibc_defaults in enumerate(ways, 1):
        with tempfile.TemporaryDirectory(prefix="jks-soak-") as tmp:
            result = soak(args, Path(tmp), run, glibc_defaults)
        result["malloc"] = "glibc defaults" if glibc_defaults else "ours"
        result["allocator"] = "pymalloc" if args.pymalloc else "malloc"
        results.append(result)
        print(json.dumps(result, indent=2))
        print(
            f"{result['malloc']}: RSS cold start {mib(result['rss_cold'])}, after the warm-up "
            f"{mib(result['rss_start'])}, peak under load {mib(result['rss_peak'])}, after all "
            f"kernels are gone {mib(result['rss_after'])} ({result['after_vs_start']}x the "
            f"warmed start, goal <= 1.5x; {result['after_vs_cold']}x the cold start); "
            f"{result['snapshots']} snapshots, {result['failed']} failed jobs (the server's "
            f"log: {result['server_log']['failed_jobs']} failed, "
            f"{result['server_log']['errors']} errors), {result['exact']} of "
            f"{result['restores']} restores exact ({result['from_store']} from the store), "
            f"{result['culled']} culled and resumed, {result['busy']} refused while a "
            "periodic snapshot of the kernel ran, "
            f"{result['output']['received']} numbered lines, {result['output']['lost']} lost; "
            f"store check --read-data of {result['store_check']['snapshots']} kept: "
            f"{'ok' if result['store_check']['ok'] else 'DAMAGED'}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(met(r) for r in results if r["malloc"] == "ours") else 1


def met(result: dict[str, Any]) -> bool:
    """The goals of issue 46 item 4."""
    log = result["server_log"]
    return (
        result["after_vs_start"] <= 1.5
        and result["failed"] == 0
        and log["failed_jobs"] == log["errors"] == 0
        and result["output"]["lost"] == 0
        and result["exact"] == result["restores"]
        and result["culled"] > 0
        and not result["failures"]
        and result["store_check"]["ok"]
    )


if __name__ == "__main__":
    sys.exit(main())
