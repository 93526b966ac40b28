"""Kernel pause and restore time: our snapshot kernel vs bare CRIU on an identical process.

For each size, a snapshot kernel (``python -m kernel_wrapper``) and a bare ipykernel
(the same kernel, started directly in its own PID and time namespaces, with no wrapper)
allocate the same memory and run the same 1 ms ticker thread. Each is dumped with
``--leave-running`` (ours through the wrapper's control socket, the baseline with a plain
``criu dump``), and the longest gap the ticker saw is the *pause*. Then each is killed
and restored (ours through the wrapper, the baseline with a plain ``criu restore``).
Times are medians of ``--repeat`` runs, ours and bare interleaved in alternating order;
the table shows ratios, since these machines are noisy.

    .venv/bin/python bench/bench_snapshot.py [--sizes 256,1024,2048] [--repeat 5]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path

from harness import BareKernel, criu_dump, criu_restore

from jupyter_ext.core.criu import Criu, frozen_seconds
from jupyter_ext.core.humanize import human_bytes
from testkit.processes import KernelProcess, wait_until

STATE = """
import numpy as np, threading, time
data = np.ones({mib} * 1024 * 1024 // 8)
_ticks = {{"last": time.monotonic(), "max_gap": 0.0}}
def _tick():
    while True:
        time.sleep(0.001)
        now = time.monotonic()
        _ticks["max_gap"] = max(_ticks["max_gap"], now - _ticks["last"])
        _ticks["last"] = now
threading.Thread(target=_tick, daemon=True).start()
"""

REPORTER = """
import signal, sys
def _report(signum, frame):
    with open({path!r}, "w") as fh:
        fh.write(str(_ticks["max_gap"]))
    _ticks["max_gap"] = 0.0
signal.signal(signal.SIGUSR1, _report)
open({path!r} + ".ready", "w").close()
"""


def max_gap(kernel: KernelProcess) -> float:
    return float(kernel.execute('print(_ticks["max_gap"]); _ticks["max_gap"] = 0.0').strip())


def bench_ours(mib: int, work: Path, criu: Criu) -> dict[str, float]:
    kernel = KernelProcess(work / "kernels")
    try:
        kernel.execute(STATE.format(mib=mib))
        time.sleep(0.3)
        max_gap(kernel)
        snap = work / "ours"
        started = time.monotonic()
        manifest = kernel.snapshot(snap)
        total = time.monotonic() - started
        pause = max_gap(kernel)
        kernel.kill_inner()
        started = time.monotonic()
        restore_args = {"source": str(snap), "verified": True, "lazy": kernel.lazily(snap)}
        kernel.control.request_sync("restore", restore_args)
        restore = time.monotonic() - started
        kernel.kill_inner()
        started = time.monotonic()
        kernel.restore(snap)
        restore_verified = time.monotonic() - started
        kernel.execute("1")
        return {
            "pause": pause,
            "dump": manifest["dump_seconds"],
            "frozen": manifest["frozen_seconds"],
            "snapshot_total": total,
            "restore": restore,
            "restore_with_sha256": restore_verified,
            "image_bytes": manifest["total_bytes"],
        }
    finally:
        kernel.kill_all()
        shutil.rmtree(work / "ours", ignore_errors=True)


def bench_bare(mib: int, work: Path, criu: Criu) -> dict[str, float]:
    """The same ipykernel, started directly (no wrapper, no client), dumped by bare CRIU."""
    report = work / "gap"
    startup = work / "startup.py"
    startup.write_text(STATE.format(mib=mib) + REPORTER.format(path=str(report)))
    args = ["--IPKernelApp.parent_handle=1", f"--IPKernelApp.file_to_run={startup}"]
    kernel = BareKernel(work, args, connect=False)
    images = work / "bare"
    images.mkdir()
    try:
        wait_until(lambda: Path(f"{report}.ready").exists(), timeout=60, what="bare kernel")
        pid = kernel.pid
        time.sleep(0.3)
        os.kill(pid, signal.SIGUSR1)
        time.sleep(0.05)
        started = time.monotonic()
        criu_dump(criu, pid, images)
        dump = time.monotonic() - started
        frozen = frozen_seconds(images / "dump.log")
        time.sleep(0.05)
        report.unlink(missing_ok=True)
        os.kill(pid, signal.SIGUSR1)
        wait_until(report.exists, what="gap report")
        time.sleep(0.05)
        pause = float(report.read_text())
        kernel.kill()
        started = time.monotonic()
        restored = criu_restore(criu, images, work / "restored.pid")
        restore = time.monotonic() - started
        os.kill(restored, signal.SIGKILL)
        image_bytes = sum(p.stat().st_size for p in images.glob("*.img"))
        return {
            "pause": pause,
            "dump": dump,
            "frozen": frozen,
            "restore": restore,
            "image_bytes": image_bytes,
        }
    finally:
        kernel.kill()
        shutil.rmtree(images, ignore_errors=True)
        for p in (report, Path(f"{report}.ready"), work / "restored.pid", startup):
            p.unlink(missing_ok=True)


def settle_page_cache() -> None:
    """Write back dirty pages and drop the clean ones (as root), so that every run starts
    with the same page cache."""
    os.sync()
    with contextlib.suppress(OSError):
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,1024,2048", help="MiB per kernel")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    criu = Criu.locate()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        for mib in (int(s) for s in args.sizes.split(",")):
            ours, bare = [], []
            for run in range(args.repeat):
                # Interleaved, in alternating order, each from the same state of the page
                # cache (synced and dropped): a dump's pause is mostly writing its pages.
                pair = [(ours, bench_ours), (bare, bench_bare)]
                for results, bench in pair if run % 2 == 0 else pair[::-1]:
                    settle_page_cache()
                    results.append(bench(mib, work, criu))

            def med(runs: list[dict[str, float]], key: str) -> float:
                return statistics.median(r[key] for r in runs)

            rows.append(
                {
                    "mib": mib,
                    "ours": {k: med(ours, k) for k in ours[0]},
                    "bare": {k: med(bare, k) for k in bare[0]},
                    "runs": {"ours": ours, "bare": bare},
                }
            )
    print(f"criu {criu.version_text}, {os.cpu_count()} CPUs, median of {args.repeat} runs\n")
    header = (
        f"{'kernel':>8} {'image':>9} | {'pause ours':>10} {'bare':>7} {'ratio':>6} | "
        f"{'frozen ours':>11} {'bare':>7} {'ratio':>6} | "
        f"{'restore ours':>12} {'bare':>7} {'ratio':>6} | {'+sha256':>8} {'ratio':>6} | "
        f"{'snapshot total':>14}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        o, b = row["ours"], row["bare"]
        pause = (
            f"{o['pause'] * 1000:>8.0f}ms {b['pause'] * 1000:>5.0f}ms "
            f"{o['pause'] / b['pause']:>5.2f}x"
        )
        frozen = (
            f"{o['frozen'] * 1000:>9.0f}ms {b['frozen'] * 1000:>5.0f}ms "
            f"{o['frozen'] / b['frozen']:>5.2f}x"
        )
        restore = (
            f"{o['restore'] * 1000:>10.0f}ms {b['restore'] * 1000:>5.0f}ms "
            f"{o['restore'] / b['restore']:>5.2f}x"
        )
        hashed = (
            f"{o['restore_with_sha256'] * 1000:>6.0f}ms "
            f"{o['restore_with_sha256'] / b['restore']:>5.2f}x"
        )
        print(
            f"{row['mib']:>5} MiB {human_bytes(o['image_bytes']):>9} | {pause} | {frozen} | "
            f"{restore} | "
            f"{hashed} | {o['snapshot_total'] * 1000:>12.0f}ms"
        )
    print(
        "\npause: longest gap of a 1 ms ticker thread in the kernel during the snapshot "
        "(goal: ours <= 1.1x bare criu dump)\nfrozen: CRIU's own log, from seizing the "
        "tasks to unfreezing them (the part of the pause CRIU accounts for)\n"
        "restore: kill -9, then until the kernel runs again (goal: ours <= 1.2x bare criu "
        "restore); '+sha256' re-hashes every image "
        "first, as a restore of an unverified directory does\nsnapshot total: dump + "
        "hashing + manifest, while the kernel already runs again"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
