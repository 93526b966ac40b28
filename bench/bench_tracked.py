"""Snapshots cost what changed (issue 43 item 6): the freeze and the job of a kernel's
first and later snapshots, beside a bare ``criu dump`` of the same memory, in one run.

For each size, a server (local store, everything automatic off) runs a notebook kernel
holding that much random float64 and a thread that ticks every millisecond; the longest
gap between its ticks is the freeze *as the kernel sees it*. Its first snapshot, then,
for each share rewritten (a contiguous slice, fresh random numbers), a second one, each
through the REST API: the job's time is a click until durable. With ``--writing`` the
kernel also writes 100 MB/s (random pages) during each snapshot. Then the same memory in
a bare ipykernel (no server, no wrapper), dumped with a plain ``criu dump
--leave-running`` (the ceiling: what CRIU alone costs), frozen as its own ticker sees it.

Tracking's cost to the running kernel: two cells, timed inside the kernel right after a
snapshot in a tracked kernel (nothing is protected between snapshots: what changed is
found by content at the next one) and in one whose server has
``track_memory = False``: one rewrites all of its memory once, one a random 1 % a
thousand times.

Before each size the machine's memory is warmed (twice the size touched and freed):
these VMs back memory on first touch (DESIGN.md), which would otherwise be measured.

    .venv/bin/python bench/bench_tracked.py [--sizes 1024,4096,8192] [--changes 0,2,20]
        [--repeat 3] [--writing] [--s3] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import MIB, QUIET, BareKernel, MotoServer, Server, criu_dump, extension_config

from jupyter_ext.core.criu import Criu, frozen_seconds
from jupyter_ext.core.criu.log import copied_bytes
from jupyter_ext.core.humanize import human_bytes
from jupyter_ext.core.memtrack.uffd import written_ranges
from testkit.processes import wait_until

STATE = """
import numpy as np, threading, time
rng = np.random.default_rng(11)
data = rng.random({mib} * 1024 * 1024 // 8)
_ticks = {{"last": time.monotonic(), "max_gap": 0.0}}
def _tick():
    while True:
        time.sleep(0.001)
        now = time.monotonic()
        _ticks["max_gap"] = max(_ticks["max_gap"], now - _ticks["last"])
        _ticks["last"] = now
threading.Thread(target=_tick, daemon=True).start()
_writing = threading.Event()
def _writer(rate=100 << 20):
    pick = np.random.default_rng(5)
    rows = data.reshape(-1, 512)
    per_ms = max(1, rate // 1000 // 4096)
    while True:
        _writing.wait()
        rows[pick.integers(0, len(rows), per_ms)] += 1.0
        time.sleep(0.001)
threading.Thread(target=_writer, daemon=True).start()
"""
GAP = 'print(_ticks["max_gap"]); _ticks["max_gap"] = 0.0'
REPORTER = """
import signal
def _report(signum, frame):
    with open({path!r}, "w") as fh:
        fh.write(str(_ticks["max_gap"]))
    _ticks["max_gap"] = 0.0
signal.signal(signal.SIGUSR1, _report)
open({path!r} + ".ready", "w").close()
"""
#: The cells of the tracking-cost measure (timed inside the kernel).
WRITE_ALL = "t = time.perf_counter(); data *= 1.0000001; print(time.perf_counter() - t)"
WRITE_RANDOM = (
    "t = time.perf_counter(); pick = np.random.default_rng(2); k = data.size // 100\n"
    "for _ in range(1000):\n    data[pick.integers(0, data.size, k)] += 1.0\n"
    "print(time.perf_counter() - t)"
)


def warm(mib: int) -> None:
    """Touch and free twice ``mib`` of memory (the host backs it on first touch)."""
    size = 2 * mib * MIB
    subprocess.run(
        [sys.executable, "-c", f"b = bytearray({size}); b[::4096] = b'x' * len(b[::4096])"],
        check=True,
    )


def huge_page_bytes() -> int:
    """The notebook kernel's memory in transparent huge pages (a snapshot's protection
    makes Linux split those the kernel writes meanwhile; its agent collapses them after)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{kernel_pid()}/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


def snapshot(server: Server, kernel: str) -> dict[str, Any]:
    server.execute(kernel, GAP)
    huge = huge_page_bytes()
    run = server.run_job("api/snapshots", {"kernel_id": kernel})
    gap = float(server.execute(kernel, GAP)["out"])
    memory = run.result.get("memory") or {}
    return {
        "job_seconds": round(run.seconds, 3),
        "kernel_frozen": round(gap, 4),
        "frozen_seconds": run.result.get("frozen_seconds"),
        "frozen_total_seconds": memory.get("frozen_total_seconds"),
        "frozen_bytes": memory.get("frozen_bytes"),
        "copied_bytes": memory.get("copied_bytes"),
        "new_bytes": run.result.get("new_bytes"),
        "mode": memory.get("mode"),
        "precopy_rounds": len(memory.get("precopy") or []),
        "precopy": memory.get("precopy") or [],
        "precopy_stopped": memory.get("precopy_stopped", ""),
        "compared": memory.get("compared") or {},
        "huge_page_bytes_before": huge,
        "phases": run.phases,
        "id": run.result["id"],
    }


def kernel_pid() -> int:
    """The host pid of the notebook kernel (the largest in memory of the wrapped ones)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            rss = int((entry / "statm").read_text().split()[1])
        except (OSError, ValueError):
            continue
        if b"kernel_wrapper.inkernel" in cmdline:
            found.append((rss, int(entry.name)))
    return max(found)[1]


def walk_seconds(pid: int, times: int = 5) -> float:
    """How long one ``PAGEMAP_SCAN`` of the kernel's whole address space takes (what a
    tracked dump walks while the kernel is frozen), the median of ``times``."""
    seconds = []
    for _ in range(times):
        start = time.perf_counter()
        written_ranges(pid)
        seconds.append(time.perf_counter() - start)
    return round(statistics.median(seconds), 5)


def ours(
    mib: int, changes: list[int], work: Path, writing: bool, s3: MotoServer | None
) -> dict[str, Any]:
    traits: dict[str, Any] = {**QUIET}
    if s3 is not None:
        # A bucket of its own: each run's kernel holds the same numbers, which a shared
        # bucket would have already (nothing new to upload after the first run).
        traits |= {
            "store": "s3",
            "s3_bucket": s3.ensure_bucket(f"bench-tracked-{time.monotonic_ns()}"),
            "s3_endpoint_url": s3.url,
        }
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"} if s3 else None
    server = Server(work / "home", work / "nb", extension_config(work / "work", **traits), env=env)
    try:
        kernel = server.start_session("bench.ipynb")
        server.execute(kernel, STATE.format(mib=mib), timeout=600)
        time.sleep(0.5)
        if writing:
            server.execute(kernel, "_writing.set()")
        first = snapshot(server, kernel)
        later = {}
        for change in changes:
            server.execute(kernel, "_writing.clear()")
            if change:
                server.execute(
                    kernel,
                    f"k = data.size * {change} // 100; s = (data.size - k) // 2\n"
                    "data[s:s + k] = rng.random(k)",
                    timeout=600,
                )
            if writing:
                server.execute(kernel, "_writing.set()")
            later[change] = snapshot(server, kernel)
            if not change and not writing:  # nothing written since: the walk alone
                later[change]["walk_seconds"] = walk_seconds(kernel_pid())
        server.execute(kernel, "_writing.clear()")
        return {"first": first, "later": later}
    finally:
        server.stop()


def cell_cost(mib: int, work: Path, tracked: bool) -> dict[str, float]:
    """The two cells' seconds right after a snapshot, in a tracked or untracked kernel."""
    server = Server(
        work / "home", work / "nb", extension_config(work / "work", **QUIET, track_memory=tracked)
    )
    try:
        kernel = server.start_session("cost.ipynb")
        server.execute(kernel, STATE.format(mib=mib), timeout=600)
        out = {}
        for name, cell in (("write_all", WRITE_ALL), ("write_random_1pct_x1000", WRITE_RANDOM)):
            server.run_job("api/snapshots", {"kernel_id": kernel})
            out[name] = float(server.execute(kernel, cell, timeout=1200)["out"])
        return out
    finally:
        server.stop()


def bare(mib: int, work: Path, criu: Criu) -> dict[str, float]:
    """A bare ipykernel with the same memory, dumped by a plain ``criu dump``."""
    report = work / "gap"
    startup = work / "startup.py"
    startup.write_text(STATE.format(mib=mib) + REPORTER.format(path=str(report)))
    args = ["--IPKernelApp.parent_handle=1", f"--IPKernelApp.file_to_run={startup}"]
    kernel = BareKernel(work, args, connect=False)
    images = work / "bare"
    try:
        wait_until(lambda: Path(f"{report}.ready").exists(), timeout=600, what="bare kernel")
        time.sleep(0.5)
        os.kill(kernel.pid, signal.SIGUSR1)
        time.sleep(0.05)
        started = time.monotonic()
        criu_dump(criu, kernel.pid, images)
        seconds = time.monotonic() - started
        report.unlink(missing_ok=True)
        os.kill(kernel.pid, signal.SIGUSR1)
        wait_until(report.exists, what="gap report")
        time.sleep(0.05)
        return {
            "kernel_frozen": round(float(report.read_text()), 4),
            "frozen_seconds": round(frozen_seconds(images / "dump.log"), 4),
            "dump_seconds": round(seconds, 3),
            "copied_bytes": copied_bytes(images / "dump.log"),
        }
    finally:
        kernel.kill()
        shutil.rmtree(images, ignore_errors=True)
        for p in (report, Path(f"{report}.ready"), startup):
            p.unlink(missing_ok=True)


def raw_puts(s3: MotoServer, runs: list[dict[str, Any]], changes: list[int]) -> dict[int, float]:
    """The ceiling of a later snapshot's S3 durable time: a raw PUT of as many random
    bytes as it copied (what changed), to the same S3 server (the median of 3), beside
    its job's time."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3.url)
    bucket = s3.ensure_bucket("bench-tracked-raw")
    out = {}
    for change in changes:
        later = [r["later"][change] for r in runs]
        size = int(median_of(later, "copied_bytes"))
        data = os.urandom(size)
        seconds = []
        for _ in range(3):
            started = time.monotonic()
            client.put_object(Bucket=bucket, Key=f"raw-{change}", Body=data)
            seconds.append(time.monotonic() - started)
        out[change] = statistics.median(seconds)
        job = median_of(later, "job_seconds")
        print(
            f"  S3, {change} % changed: durable in {job:.2f} s, a raw PUT of the "
            f"{human_bytes(size)} copied {out[change]:.2f} s: {job / out[change]:.2f}x"
        )
    return out


def ms(runs: list[dict[str, Any]], key: str = "kernel_frozen") -> str:
    """Each run's freeze, in milliseconds."""
    return ", ".join(f"{r[key] * 1000:.0f}" for r in runs)


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key]) for r in runs if r.get(key) is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,4096,8192", help="MiB per kernel")
    parser.add_argument("--changes", default="0,2,20", help="percent rewritten")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--writing", action="store_true", help="kernel writes 100 MB/s")
    parser.add_argument("--s3", action="store_true", help="moto's S3 instead of a local store")
    parser.add_argument("--no-cost", action="store_true", help="skip the tracking-cost cells")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    criu = Criu.locate()
    changes = [int(c) for c in args.changes.split(",")]
    report: dict[str, Any] = {
        "machine": f"{os.cpu_count()} CPUs, {platform.release()}",
        "criu": criu.version_text,
        "tracking": criu.dirty_tracking()[0],
        "writing": args.writing,
        "store": "s3 (moto, 127.0.0.1)" if args.s3 else "local",
        "sizes": {},
    }
    if args.s3:  # the servers' credentials, and this process's (its raw PUT)
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    s3 = MotoServer(Path(tempfile.mkdtemp()) / "moto.log") if args.s3 else None
    try:
        for mib in (int(s) for s in args.sizes.split(",")):
            runs, bares, costs = [], [], {"tracked": [], "untracked": []}
            for run in range(args.repeat):
                # Interleaved, the order flipped each repeat; the memory warmed before each.
                steps = ["ours", "bare"] if run % 2 == 0 else ["bare", "ours"]
                for step in steps:
                    warm(mib)
                    with tempfile.TemporaryDirectory(prefix="bench-", dir="/var/tmp") as tmp:
                        if step == "ours":
                            runs.append(ours(mib, changes, Path(tmp), args.writing, s3))
                        else:
                            bares.append(bare(mib, Path(tmp), criu))
                if not args.no_cost:
                    for tracked in (True, False) if run % 2 == 0 else (False, True):
                        warm(mib)
                        with tempfile.TemporaryDirectory(prefix="bench-", dir="/var/tmp") as tmp:
                            key = "tracked" if tracked else "untracked"
                            costs[key].append(cell_cost(mib, Path(tmp), tracked))
            report["sizes"][mib] = {"ours": runs, "bare": bares, "cost": costs}
            print_size(mib, runs, bares, costs, changes)
            if s3 is not None:
                report["sizes"][mib]["raw_put"] = raw_puts(s3, runs, changes)
    finally:
        if s3 is not None:
            s3.stop()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


def print_size(
    mib: int,
    runs: list[dict[str, Any]],
    bares: list[dict[str, Any]],
    costs: dict[str, list[dict[str, float]]],
    changes: list[int],
) -> None:
    # CRIU's own log (seize to unfreeze) for the bare kernel: a signal to its idle main
    # thread, which reads its ticker, may be handled only after the dump.
    bare_frozen = median_of(bares, "frozen_seconds")
    first = [r["first"] for r in runs]
    print(f"\n{human_bytes(mib * MIB)} kernel, medians of {len(runs)} runs")
    print(
        f"  bare criu dump: kernel frozen {bare_frozen * 1000:.0f} ms "
        f"(runs: {ms(bares, 'frozen_seconds')} ms), "
        f"dump {median_of(bares, 'dump_seconds'):.2f} s"
    )
    f_frozen, f_job = median_of(first, "kernel_frozen"), median_of(first, "job_seconds")
    print(
        f"  first snapshot: kernel frozen {f_frozen * 1000:.0f} ms (dump's own "
        f"{median_of(first, 'frozen_seconds') * 1000:.0f} ms) = "
        f"{f_frozen / bare_frozen:.2f}x bare; job {f_job:.2f} s; "
        f"{first[0]['precopy_rounds']} pre-copy round(s)"
    )
    for change in changes:
        later = [r["later"][change] for r in runs]
        frozen, job = median_of(later, "kernel_frozen"), median_of(later, "job_seconds")
        print(
            f"  {change:>2} % changed: {later[0]['mode']}, kernel frozen {frozen * 1000:.0f} ms "
            f"= {frozen / bare_frozen:.3f}x bare (runs "
            f"{ms(later)} ms); job "
            f"{job:.2f} s = {job / f_job:.2f}x the first; copied while frozen "
            f"{human_bytes(median_of(later, 'frozen_bytes'))}, new in store "
            f"{human_bytes(median_of(later, 'new_bytes'))}"
        )
    walked = [r["later"][0] for r in runs if "walk_seconds" in r["later"].get(0, {})]
    if walked:
        frozen, walk = median_of(walked, "kernel_frozen"), median_of(walked, "walk_seconds")
        print(
            f"  nothing changed: frozen {frozen * 1000:.0f} ms, of which the page-table walk "
            f"{walk * 1000:.1f} ms (PAGEMAP_SCAN of the whole kernel, from outside): "
            f"{(frozen - walk) * 1000:.0f} ms besides it (goal <= 50 ms)"
        )
    for name in costs["tracked"][0] if costs["tracked"] else []:
        tracked = statistics.median(c[name] for c in costs["tracked"])
        untracked = statistics.median(c[name] for c in costs["untracked"])
        print(
            f"  cell {name}: tracked {tracked:.3f} s, untracked {untracked:.3f} s, "
            f"{tracked / untracked:.3f}x"
        )


if __name__ == "__main__":
    main()
