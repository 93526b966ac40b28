"""The kernel's pause with and without open TCP connections (docs/network.md).

One snapshot kernel opens N keep-alive HTTP connections (a ``requests.Session`` each) to a
local server, then is snapshotted ``--repeat`` times with ``--leave-running``; the table
shows the medians of the manifest's ``frozen_seconds`` (CRIU's seize to unfreeze),
``dump_seconds`` and ``pause_seconds`` (requests held) for each N. After every snapshot the
kernel must still use its own connections (the server accepts no new one).

    .venv/bin/python bench/bench_network.py [--connections 0,1,64] [--repeat 9] [--parallel]
    .venv/bin/python bench/bench_network.py --side-by-side [--repeat 9]
    .venv/bin/python bench/bench_network.py --dask [--repeat 9]

``--parallel``: the kernel also runs a spawn ``Pool(2)`` (named semaphores in /dev/shm,
copied while frozen) and a ``SyncManager`` child with a dict proxy (a connection inside the
kernel's tree: saved with its state, ``--tcp-established``, with root).

``--side-by-side`` (root): three kernels in one run, snapshotted in turn: (a) a plain
kernel, (b) a kernel with a ``SyncManager`` child (a kept connection) in the server's
network namespace, (c) a copy of (b)'s snapshot restored beside it, so in a network
namespace of its own (core/isolation/netns.py); also the restore of (c) and of the same snapshot
into the server's namespace (after (b) and (c) ended), until the kernel answers.

``--dask`` (root): a Dask ``LocalCluster`` kernel; copies of its snapshot restored beside
it (a private view of ``/tmp`` and a network namespace of their own: core/isolation/privatetmp.py,
core/isolation/netns.py) against the same snapshot restored alone after it ended, each until the
cluster computed in a cell; and the freeze of the copy against the original's.
"""

from __future__ import annotations

import argparse
import http.server
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testkit.processes import KernelProcess


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    accepted = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        self.accepted += 1
        super().process_request(request, client_address)


PARALLEL = """
import multiprocessing as mp
from multiprocessing.managers import SyncManager
pool = mp.get_context("spawn").Pool(2)
pool.map(abs, range(4))
manager = SyncManager(address=("127.0.0.1", 0), ctx=mp.get_context("spawn"))
manager.start()
shared = manager.dict()
shared["a"] = 1
"""


MANAGER = """
import multiprocessing as mp
from multiprocessing.managers import SyncManager
manager = SyncManager(address=("127.0.0.1", 0), ctx=mp.get_context("fork"))
manager.start()
shared = manager.dict()
shared["a"] = 1
"""


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "frozen_ms": round(statistics.median(r["frozen_seconds"] for r in runs) * 1000, 1),
        "frozen_ms_each": [round(r["frozen_seconds"] * 1000) for r in runs],
        "dump_ms": round(statistics.median(r["dump_seconds"] for r in runs) * 1000, 1),
        "pause_ms": round(statistics.median(r["pause_seconds"] for r in runs) * 1000, 1),
    }


def side_by_side(repeat: int, work: Path) -> None:
    """(a) plain, (b) kept connection, host namespace, (c) its copy in its own namespace."""
    plain = KernelProcess(work / "kernels")
    kept = KernelProcess(work / "kernels")
    kernels: dict[str, KernelProcess] = {"a plain": plain, "b kept, host netns": kept}
    restores: dict[str, float] = {}
    try:
        kept.execute(MANAGER)
        kept.snapshot(work / "origin")
        started = time.monotonic()
        copy = KernelProcess(work / "kernels", restore_from=work / "origin")
        copy.execute("shared['a'] += 1")
        restores["copy beside it (own netns)"] = time.monotonic() - started
        kernels["c kept, own netns"] = copy
        assert copy.status()["own_network"]
        assert not kept.status()["own_network"]
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in kernels}
        for n in range(repeat):
            for name, kernel in kernels.items():
                dest = work / f"snap-{n}"
                runs[name].append(kernel.snapshot(dest))
                shutil.rmtree(dest)
                kernel.execute("shared['a'] += 1" if name != "a plain" else "pass")
        for kernel in (kept, copy):
            kernel.shutdown()
        started = time.monotonic()
        again = KernelProcess(work / "kernels", restore_from=work / "origin")
        again.execute("shared['a'] += 1")
        restores["same snapshot alone (server's netns)"] = time.monotonic() - started
        again.shutdown()
    finally:
        for kernel in kernels.values():
            if kernel.process.poll() is None:
                kernel.shutdown()
    for name, each in runs.items():
        row = _medians(each)
        print(json.dumps({"kernel": name, **row}), flush=True)
    for name, seconds in restores.items():
        print(json.dumps({"restore": name, "seconds": round(seconds, 3)}), flush=True)


DASK = """
from dask.distributed import Client, LocalCluster
cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                       dashboard_address=None, host="127.0.0.1")
client = Client(cluster)
"""
DASK_CELL = "print(client.submit(sum, [1, 2]).result())"


def _restore_until_output(work: Path, snapshot: Path) -> tuple[KernelProcess, float]:
    started = time.monotonic()
    kernel = KernelProcess(work / "kernels", restore_from=snapshot)
    assert kernel.execute(DASK_CELL, timeout=120).strip() == "3"
    return kernel, time.monotonic() - started


def dask_copies(repeat: int, work: Path) -> None:
    """Dask copies beside the original (private /tmp, own network) against alone."""
    original = KernelProcess(work / "kernels")
    beside: list[float] = []
    frozen: dict[str, list[dict[str, Any]]] = {"original": [], "copy beside it": []}
    try:
        original.execute(DASK, timeout=300)
        original.snapshot(work / "origin")
        for n in range(repeat):
            copy, seconds = _restore_until_output(work, work / "origin")
            assert copy.status()["private_temp"], copy.status()
            beside.append(seconds)
            for name, kernel in (("original", original), ("copy beside it", copy)):
                frozen[name].append(kernel.snapshot(work / f"snap-{n}"))
                shutil.rmtree(work / f"snap-{n}")
            copy.shutdown()
    finally:
        original.shutdown()
    alone: list[float] = []
    for _ in range(repeat):
        kernel, seconds = _restore_until_output(work, work / "origin")
        assert kernel.status()["private_temp"] is None
        alone.append(seconds)
        kernel.shutdown()
    for name, runs in frozen.items():
        print(json.dumps({"kernel": name, **_medians(runs)}), flush=True)
    beside_s, alone_s = statistics.median(beside), statistics.median(alone)
    row = {
        "beside_s": round(beside_s, 3),
        "alone_s": round(alone_s, 3),
        "ratio": round(beside_s / alone_s, 2),
        "beside_each": [round(x, 2) for x in beside],
        "alone_each": [round(x, 2) for x in alone],
    }
    print(json.dumps({"restore until the cluster computed": row}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", default="0,1,64")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--parallel", action="store_true")
    parser.add_argument("--side-by-side", action="store_true")
    parser.add_argument("--dask", action="store_true")
    args = parser.parse_args()
    if args.side_by_side or args.dask:
        work = Path(tempfile.mkdtemp(prefix="bench-network-"))
        try:
            (dask_copies if args.dask else side_by_side)(args.repeat, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    server = _Server(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/"
    work = Path(tempfile.mkdtemp(prefix="bench-network-"))
    rows = []
    try:
        for count in (int(n) for n in args.connections.split(",")):
            kernel = KernelProcess(work / "kernels")
            try:
                if args.parallel:
                    kernel.execute(PARALLEL)
                kernel.execute(
                    "import requests\n"
                    f"sessions = [requests.Session() for _ in range({count})]\n"
                    f"for s in sessions: s.get({url!r}).raise_for_status()\n"
                )
                opened = server.accepted
                runs = []
                for n in range(args.repeat):
                    dest = work / f"snap-{count}-{n}"
                    runs.append(kernel.snapshot(dest))
                    shutil.rmtree(dest)
                    kernel.execute(f"for s in sessions: s.get({url!r}).raise_for_status()")
                    if args.parallel:
                        kernel.execute("shared['a'] += 1; pool.map(abs, range(4))")
                    assert server.accepted == opened, "a snapshot disturbed a connection"
            finally:
                kernel.shutdown()
            row: dict[str, Any] = {"connections": count, "parallel": args.parallel}
            for key in ("frozen_seconds", "shm_copy_seconds", "dump_seconds", "pause_seconds"):
                row[key] = round(statistics.median(r[key] for r in runs), 4)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        server.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    print("\nconnections  frozen ms  dump ms  pause ms")
    for row in rows:
        print(
            f"{row['connections']:>11}  {row['frozen_seconds'] * 1000:>9.1f}  "
            f"{row['dump_seconds'] * 1000:>7.1f}  {row['pause_seconds'] * 1000:>8.1f}"
        )


if __name__ == "__main__":
    main()
