"""What automatic snapshots cost a notebook session with the product's defaults.

A real server (local store, defaults: a snapshot after each cell of 60 s or more, at most
one per kernel every 5 minutes, retention keep_last 10 + hourly/daily thinning) and one
snapshot kernel that runs a session of 100 cells: most take a few seconds, every tenth
runs 80 s ("training"); each adds 2 MiB of fresh random data to the state and the long
ones rewrite a 32 MiB "model". Time is scaled down by ``--scale`` (default 10: cells,
threshold, interval and policy tick all 10x shorter, so the run takes minutes); what a
snapshot costs (the kernel's pause, the store's growth) does not scale, so the real-time
ratio is the measured pause over ``scale`` x the measured cell time.

    .venv/bin/python bench/bench_autosnap.py [--scale 10] [--cells 100] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import Server, extension_config

from jupyter_ext.core.humanize import human_bytes

SETUP = "import numpy as np, time\nrng = np.random.default_rng(0)\nstate = {}\nmodel = None"
CELL = "time.sleep({seconds})\nstate[{i}] = rng.random(2 * 131072)\n{extra}"
LONG_EXTRA = "model = rng.random(32 * 131072)\n"


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=10.0)
    parser.add_argument("--cells", type=int, default=100)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    scale = args.scale
    home = Path(tempfile.mkdtemp(prefix="i24-bench-autosnap-"))
    store = home / "store"
    config = extension_config(
        home / "work",
        local_store_dir=str(store),
        # The defaults, scaled in time.
        long_cell_seconds=60.0 / scale,
        long_cell_min_interval=300.0 / scale,
        policy_tick=10.0 / scale,
        snapshot_before_shutdown=False,
    )
    server = Server(home / "server", home / "notebooks", config)
    rng = random.Random(1)
    try:
        kernel = server.start_kernel()
        server.execute(kernel, SETUP)
        store_before = directory_bytes(store) if store.exists() else 0
        cell_seconds = 0.0
        long_cells = 0
        for i in range(args.cells):
            long = i % 10 == 5
            long_cells += long
            real = 80.0 if long else rng.uniform(1.0, 15.0)
            code = CELL.format(seconds=real / scale, i=i, extra=LONG_EXTRA if long else "")
            started = time.monotonic()
            server.execute(kernel, code, timeout=600)
            cell_seconds += time.monotonic() - started
        # The last long cell's snapshot comes within a tick.
        time.sleep(2 * 10.0 / scale + 2)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status = server.api("GET", f"api/snapshots/kernels/{kernel}")
            if not status.get("job"):
                break
            time.sleep(0.5)
        snapshots = [
            server.api("GET", f"api/snapshots/{s['id']}")
            for s in server.api("GET", "api/snapshots")["snapshots"]
        ]
    finally:
        server.stop()
    automatic = [s for s in snapshots if s["trigger"] == "long-cell"]
    pause = sum(s.get("pause_seconds", 0) for s in automatic)
    frozen = sum(s.get("frozen_seconds", 0) for s in automatic)
    store_bytes = directory_bytes(store) - store_before
    result: dict[str, Any] = {
        "scale": scale,
        "cells": args.cells,
        "long_cells": long_cells,
        "cell_seconds_measured": round(cell_seconds, 1),
        "cell_seconds_real": round(cell_seconds * scale, 1),
        "snapshots": len(automatic),
        "snapshots_kept": len(snapshots),
        "pause_seconds_total": round(pause, 3),
        "frozen_seconds_total": round(frozen, 3),
        "pause_share_measured": round(pause / cell_seconds, 5),
        "pause_share_real": round(pause / (cell_seconds * scale), 6),
        "store_bytes": store_bytes,
        "summary_ms": [
            round(1000 * float((s.get("contents") or {}).get("seconds", 0) or 0), 2)
            for s in automatic
        ],
    }
    print(
        f"{args.cells} cells ({long_cells} long), {result['cell_seconds_real']:.0f} s of cells "
        f"at real scale; {len(automatic)} automatic snapshots ({len(snapshots)} kept): kernel "
        f"paused {pause:.2f} s in total ({100 * result['pause_share_real']:.3f} % of the cell "
        f"time; frozen {frozen:.2f} s); store grew {human_bytes(store_bytes)}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
