"""Pre-copy without root (issue 43 item 2): a kernel's first snapshot, taken by an ordinary
user, with the CRIU the product builds (patch 0004: its read-mode pre-dump holds one
pipe) beside CRIU 4.2.1 without that patch (its pre-copy fails past the user's pipe
limits, and the snapshot copies everything frozen), interleaved, in one run.

Each run starts a kernel wrapper (no server: the wrapper's own snapshot request, the
clock from the request to its answer, the snapshot written to a local directory) whose
kernel holds N MiB of random float64 and a thread that ticks every millisecond: its
longest gap during the snapshot is the freeze as the kernel sees it. Run it as the
ordinary user (a member of jupyter-snapshots, so that it may run the CRIU copies):

    runuser -u jks-tester -- .venv/bin/python bench/bench_precopy_user.py \\
        --criu /opt/jupyter-kernel-snapshots/criu/bin/criu --criu OTHER [--mib 1024]
        [--repeat 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testkit.processes import KernelProcess

STATE = """
import threading, time, numpy as np
a = np.random.default_rng(1).random({mib} << 17)
gap = [0.0]
def tick():
    last = time.monotonic()
    while True:
        time.sleep(0.001)
        now = time.monotonic()
        gap[0] = max(gap[0], now - last)
        last = now
threading.Thread(target=tick, daemon=True).start()
"""


def one(criu: str, mib: int, work: Path) -> dict[str, Any]:
    """The first snapshot of a fresh kernel of ``mib`` MiB with ``criu``."""
    kernel = KernelProcess(work / "kernels", env={"JUPYTER_SNAPSHOT_CRIU": criu})
    try:
        kernel.execute(STATE.format(mib=mib), timeout=300)
        time.sleep(0.5)
        kernel.execute("gap[0] = 0.0")
        started = time.monotonic()
        result = kernel.snapshot(work / "snap")
        seconds = time.monotonic() - started
        gap = float(kernel.execute("print(gap[0])"))
        memory = result["memory"]
        return {
            "kernel_frozen": round(gap, 4),
            "snapshot_seconds": round(seconds, 3),
            "precopy_rounds": len(memory["precopy"]),
            "frozen_bytes": memory["frozen_bytes"],
            "copied_bytes": memory["copied_bytes"],
            "reason": memory["reason"],
        }
    finally:
        kernel.end()
        shutil.rmtree(work / "snap", ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--criu", action="append", required=True, help="a CRIU binary")
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if os.geteuid() == 0:
        parser.error("run it as an ordinary user: root's pre-copy needs no patch")
    runs: dict[str, list[dict[str, Any]]] = {criu: [] for criu in args.criu}
    with tempfile.TemporaryDirectory(prefix="jks-bench-") as tmp:
        for n in range(args.repeat):
            for criu in args.criu:
                run = one(criu, args.mib, Path(tmp))
                runs[criu].append(run)
                print(f"run {n + 1}, {criu}: {json.dumps(run)}", flush=True)
    print(f"\n{args.mib} MiB kernel, first snapshot, as uid {os.geteuid()}:")
    print("| CRIU | kernel frozen (median; runs) | snapshot request | pre-copy rounds |")
    print("|---|---|---|---|")
    for criu, done in runs.items():
        frozen = [r["kernel_frozen"] for r in done]
        request = [r["snapshot_seconds"] for r in done]
        print(
            f"| {criu} | {statistics.median(frozen) * 1000:.0f} ms "
            f"({', '.join(f'{f * 1000:.0f}' for f in frozen)}) | "
            f"{statistics.median(request):.2f} s | {done[0]['precopy_rounds']} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"mib": args.mib, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
