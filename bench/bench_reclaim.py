"""Before a reclaim (issue 43 item 7): from SIGTERM to the server until the snapshot it
takes of its kernel before stopping is durable in S3, tracked against untracked.

A server with an S3 store (moto on 127.0.0.1) and ``snapshot_before_shutdown`` runs one
kernel of ``--mib`` random float64. A snapshot is taken (the last periodic one), then a
share of the memory is rewritten, then the server gets SIGTERM (as a spot instance's
shutdown, or a pod's deletion, sends it). The clock runs from the signal until the
server has exited, which it does once the snapshot's record is in the store (checked
after). The same with ``track_memory = False``, interleaved, the order flipped each repeat;
the machine's memory warmed before each run (DESIGN.md).

    .venv/bin/python bench/bench_reclaim.py [--mib 4096] [--changes 2,20] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import boto3
from harness import MIB, QUIET, MotoServer, Server, extension_config

from jupyter_ext.core.humanize import human_bytes

BUCKET = "bench-reclaim"
ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}


def warm(mib: int) -> None:
    size = 2 * mib * MIB
    subprocess.run(
        [sys.executable, "-c", f"b = bytearray({size}); b[::4096] = b'x' * len(b[::4096])"],
        check=True,
    )


def records(moto: MotoServer) -> int:
    client = boto3.client("s3", endpoint_url=moto.url)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
    return sum(1 for page in pages for o in page.get("Contents", []) if "/snapshots/" in o["Key"])


def one(mib: int, change: int, tracked: bool, moto: MotoServer, work: Path) -> dict[str, Any]:
    traits = {
        **QUIET,
        "snapshot_before_shutdown": True,
        "store": "s3",
        "s3_bucket": BUCKET,
        "s3_endpoint_url": moto.url,
        "s3_prefix": f"run-{time.monotonic_ns()}",
        "track_memory": tracked,
    }
    server = Server(work / "home", work / "nb", extension_config(work / "work", **traits), env=ENV)
    kernel = server.start_session("reclaim.ipynb")
    server.execute(
        kernel,
        "import numpy as np\nrng = np.random.default_rng(3)\n"
        f"data = rng.random({mib} * {MIB} // 8)",
        timeout=900,
    )
    before = records(moto)
    periodic = server.run_job("api/snapshots", {"kernel_id": kernel})
    k = f"data.size * {change} // 100"
    server.execute(kernel, f"k = {k}; s = (data.size - k) // 2; data[s:s + k] = rng.random(k)")
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    server.process.wait(1800)
    seconds = time.monotonic() - started
    stored = records(moto) - before
    return {
        "seconds": round(seconds, 3),
        "records": stored,
        "periodic_job": round(periodic.seconds, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=4096)
    parser.add_argument("--changes", default="2,20")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.update(ENV, AWS_DEFAULT_REGION="us-east-1")
    moto = MotoServer(Path(tempfile.mkdtemp()) / "moto.log")
    moto.ensure_bucket(BUCKET)
    out: dict[str, Any] = {"mib": args.mib, "runs": {}}
    try:
        for change in (int(c) for c in args.changes.split(",")):
            runs: dict[str, list[dict[str, Any]]] = {"tracked": [], "untracked": []}
            for repeat in range(args.repeat):
                order = (True, False) if repeat % 2 == 0 else (False, True)
                for tracked in order:
                    warm(args.mib)
                    with tempfile.TemporaryDirectory(prefix="bench-", dir="/var/tmp") as tmp:
                        run = one(args.mib, change, tracked, moto, Path(tmp))
                    if run["records"] != 2:
                        raise SystemExit(f"the snapshot before the stop is not stored: {run}")
                    runs["tracked" if tracked else "untracked"].append(run)
            out["runs"][change] = runs
            t = statistics.median(r["seconds"] for r in runs["tracked"])
            u = statistics.median(r["seconds"] for r in runs["untracked"])
            print(
                f"{human_bytes(args.mib * MIB)} kernel, {change} % changed since its last "
                f"snapshot: SIGTERM to durable in S3 tracked {t:.1f} s, untracked {u:.1f} s "
                f"({t / u:.2f}x); runs tracked "
                f"{', '.join(str(r['seconds']) for r in runs['tracked'])}, untracked "
                f"{', '.join(str(r['seconds']) for r in runs['untracked'])}"
            )
    finally:
        moto.stop()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
