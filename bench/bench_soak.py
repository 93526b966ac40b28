"""Soak: does a long-lived server stay lean under snapshot load? (issue 34 item 4)

A real ``jupyter server`` with the extension on an S3 store (moto on 127.0.0.1), retention
on (``keep_last``), and ``--kernels`` snapshot kernels in notebook sessions, each holding
``--mib`` MiB. Round after round until ``--minutes`` are over, every kernel runs a cell
that changes part of its memory and is snapshotted through the REST API (several jobs at
once, as periodic snapshots of many kernels go). Then every kernel is shut down and the
server left idle for ``--settle`` seconds. The server's RSS (``/proc/PID/status``) is
reported at start (ready, no kernel), its highest under load, and after all kernels are
gone: the goal is under 1.5x the start then.

``--tracemalloc DIR`` runs the server with Python's tracemalloc on and writes where the
memory the server still holds after the soak was allocated since the start
(``DIR/top.txt``): the tool that found what the server held (bench/RESULTS.md).

    .venv/bin/python bench/bench_soak.py --quick                 # 1-2 minutes
    nice -n 5 .venv/bin/python bench/bench_soak.py --minutes 15  # the soak, 6 kernels
    .venv/bin/python bench/bench_soak.py --quick --baseline 2    # beside glibc's defaults
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from harness import QUIET, MotoServer, Server, extension_config

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
            **{**QUIET, "keep_last": args.keep_last, "keep_hourly_hours": 0, "keep_daily_days": 0},
            store="s3",
            s3_bucket=BUCKET,
            s3_endpoint_url=moto.url,
            s3_region="us-east-1",
        )
        env = dict(CREDENTIALS)
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
            # Warm-up: one small kernel snapshotted once and shut down, so that what the
            # first snapshot loads once (boto3's service models, the S3 client, the
            # kernelspec, nbformat's validators...) is not counted as what load leaves.
            warm = server.start_session("warm-up.ipynb")
            server.execute(warm, f"import numpy as np; w = np.ones({WARM_UP_MIB << 17})")
            server.run_job("api/snapshots", {"kernel_id": warm})
            server.end_sessions()
            time.sleep(args.settle)
            phase("warm")
            first_trace = hook.take_trace(pid)
            kernels = [server.start_session(f"soak-{i}.ipynb") for i in range(args.kernels)]
            elements = args.mib << 17  # float64s
            for kernel in kernels:
                server.execute(kernel, f"import numpy as np; a = np.ones({elements}); n = 0")
            peak = rss_bytes(pid)
            snapshots = rounds = 0
            deadline = time.monotonic() + args.minutes * 60
            with ThreadPoolExecutor(args.kernels) as pool:
                while time.monotonic() < deadline:
                    rounds += 1

                    def one(kernel: str) -> None:
                        # A few MiB changed: each snapshot adds new chunks, retention
                        # deletes old snapshots, packs are cleaned up.
                        server.execute(kernel, "n += 1; a[(n * 65536) % a.size:][:393216] = n")
                        server.run_job("api/snapshots", {"kernel_id": kernel})

                    list(pool.map(one, kernels))
                    snapshots += len(kernels)
                    now = rss_bytes(pid)
                    peak = max(peak, now)
                    print(f"round {rounds}: {snapshots} snapshots, RSS {mib(now)}", flush=True)
            phase("loaded")
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
            listed = len(server.api("GET", "api/snapshots")["snapshots"])
        finally:
            server.stop()
    finally:
        moto.stop()
        shutil.rmtree(hook.hook, ignore_errors=True)
    return {
        "kernels": args.kernels,
        "mib": args.mib,
        "minutes": args.minutes,
        "rounds": rounds,
        "snapshots": snapshots,
        "kept": listed,
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
    parser.add_argument("--settle", type=float, default=10.0, help="idle seconds at the end")
    parser.add_argument("--quick", action="store_true", help="3 kernels of 32 MiB, 1 minute")
    parser.add_argument("--tracemalloc", metavar="DIR", help="trace the server's memory")
    parser.add_argument(
        "--diagnose",
        metavar="DIR",
        help="write the server's smaps, malloc statistics, objects and threads per phase",
    )
    parser.add_argument("--json", metavar="PATH", help="write the result here too")
    parser.add_argument(
        "--baseline",
        type=int,
        default=0,
        metavar="N",
        help="N rounds of (glibc's malloc defaults, ours), interleaved: side by side",
    )
    args = parser.parse_args()
    if args.quick:
        args.kernels, args.mib, args.minutes = 3, 32, 1.0
    ways = [True, False] * args.baseline or [False]
    results = []
    for run, glibc_defaults in enumerate(ways, 1):
        with tempfile.TemporaryDirectory(prefix="jks-soak-") as tmp:
            result = soak(args, Path(tmp), run, glibc_defaults)
        result["malloc"] = "glibc defaults" if glibc_defaults else "ours"
        results.append(result)
        print(json.dumps(result, indent=2))
        print(
            f"{result['malloc']}: RSS cold start {mib(result['rss_cold'])}, after the warm-up "
            f"{mib(result['rss_start'])}, peak under load {mib(result['rss_peak'])}, after all "
            f"kernels are gone {mib(result['rss_after'])} ({result['after_vs_start']}x the "
            f"warmed start, goal < 1.5x; {result['after_vs_cold']}x the cold start), "
            f"{result['snapshots']} snapshots",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r["after_vs_start"] < 1.5 for r in results if r["malloc"] == "ours") else 1


if __name__ == "__main__":
    sys.exit(main())
