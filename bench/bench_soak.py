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
#: their wrappers are other interpreters): the first SIGUSR2 starts tracemalloc (traced from
#: the server's start, it started 5x slower here, past the ready timeout; what grows comes
#: later anyway), each one dumps a snapshot.
TRACE_HOOK = """
import sys
if "jupyter_server" in sys.orig_argv:
    import os, signal, tracemalloc
    def _dump(signum, frame):
        if not tracemalloc.is_tracing():
            tracemalloc.start(8)
        path = os.environ["JKS_SOAK_TRACE"] + f"/{int(os.times().elapsed * 1000)}.trace"
        tracemalloc.take_snapshot().dump(path)
    signal.signal(signal.SIGUSR2, _dump)
"""


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def mib(value: int) -> str:
    return f"{value / (1 << 20):.0f} MiB"


class Tracer:
    """tracemalloc snapshots of the server, taken on demand (SIGUSR2)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.hook = Path(tempfile.mkdtemp(prefix="jks-soak-hook-"))
        (self.hook / "sitecustomize.py").write_text(textwrap.dedent(TRACE_HOOK))

    def env(self) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(self.hook), os.environ.get("PYTHONPATH")) if p)
        return {"PYTHONPATH": path, "JKS_SOAK_TRACE": str(self.directory)}

    def take(self, pid: int) -> Path:
        before = set(self.directory.glob("*.trace"))
        os.kill(pid, signal.SIGUSR2)
        for _ in range(600):
            made = set(self.directory.glob("*.trace")) - before
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


CREDENTIALS = {"AWS_ACCESS_KEY_ID": "soak", "AWS_SECRET_ACCESS_KEY": "soak"}


def soak(args: argparse.Namespace, work: Path, glibc_defaults: bool = False) -> dict[str, Any]:
    """One soak; ``glibc_defaults``: the server without the product's malloc tuning
    (``jupyter_ext.app._return_chunk_buffers_to_the_system``), the baseline."""
    for name, value in CREDENTIALS.items():  # moto takes any; boto3 wants some
        os.environ.setdefault(name, value)
    moto = MotoServer(work / "moto.log")
    tracer = Tracer(Path(args.tracemalloc)) if args.tracemalloc else None
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
        if tracer is not None:
            env.update(tracer.env())
        server = Server(work / "server", work / "notebooks", config, env=env)
        pid = server.process.pid
        try:
            time.sleep(2)  # the start-up's last allocations
            start = rss_bytes(pid)
            first_trace = tracer.take(pid) if tracer else None
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
                    peak = max(peak, rss_bytes(pid))
                    print(f"round {rounds}: {snapshots} snapshots, RSS {mib(rss_bytes(pid))}")
            loaded = rss_bytes(pid)
            server.end_sessions()
            time.sleep(args.settle)
            after = rss_bytes(pid)
            trace = None
            if tracer is not None and first_trace is not None:
                report = tracer.compare(first_trace, tracer.take(pid))
                (Path(args.tracemalloc) / "top.txt").write_text(report + "\n")
                trace = str(Path(args.tracemalloc) / "top.txt")
            listed = len(server.api("GET", "api/snapshots")["snapshots"])
        finally:
            server.stop()
    finally:
        moto.stop()
    return {
        "kernels": args.kernels,
        "mib": args.mib,
        "minutes": args.minutes,
        "rounds": rounds,
        "snapshots": snapshots,
        "kept": listed,
        "rss_start": start,
        "rss_peak": peak,
        "rss_loaded": loaded,
        "rss_after": after,
        "after_vs_start": round(after / start, 2),
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
    for glibc_defaults in ways:
        with tempfile.TemporaryDirectory(prefix="jks-soak-") as tmp:
            result = soak(args, Path(tmp), glibc_defaults)
        result["malloc"] = "glibc defaults" if glibc_defaults else "ours"
        results.append(result)
        print(json.dumps(result, indent=2))
        print(
            f"{result['malloc']}: RSS start {mib(result['rss_start'])}, peak under load "
            f"{mib(result['rss_peak'])}, after all kernels are gone {mib(result['rss_after'])} "
            f"({result['after_vs_start']}x the start; goal < 1.5x), "
            f"{result['snapshots']} snapshots",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r["after_vs_start"] < 1.5 for r in results if r["malloc"] == "ours") else 1


if __name__ == "__main__":
    sys.exit(main())
