"""How long the agent's summary of a namespace takes (kernel_wrapper.inkernel.contents), the part of
each snapshot that runs inside the kernel: at most about 50 ms, even for 100 000 objects.

Namespaces of N variables of mixed kinds (floats, short strings, small lists and dicts,
NumPy arrays; a few large lists and a pandas frame), summarised with the product's
defaults (budget of units and 50 ms deadline) and once without the deadline to see the
whole cost. Times are medians and maxima of ``--repeat`` runs.

    .venv/bin/python bench/bench_contents.py [--sizes 1000,10000,100000,300000] [--repeat 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from kernel_wrapper.inkernel.contents import summarize_namespace


def namespace(n: int) -> dict[str, Any]:
    """N variables of mixed kinds, as a long-running notebook accumulates them."""
    kinds = [
        lambda i: float(i),
        lambda i: f"text {i}",
        lambda i: [i, i + 1, i + 2],
        lambda i: {"a": i, "b": [i]},
        lambda i: np.zeros(16),
    ]
    ns: dict[str, Any] = {f"v{i}": kinds[i % len(kinds)](i) for i in range(n)}
    ns["big_list"] = list(range(2_000_000))
    ns["big_dict"] = {i: str(i) for i in range(200_000)}
    ns["matrix"] = np.ones((2048, 2048))
    try:
        import pandas as pd

        ns["frame"] = pd.DataFrame({f"c{i}": np.arange(10_000) for i in range(50)})
    except ImportError:
        pass
    return ns


def measure(n: int, repeat: int) -> dict[str, Any]:
    ns = namespace(n)
    bounded, whole, partial = [], [], 0
    for _ in range(repeat):
        started = time.perf_counter()
        summary = summarize_namespace(ns)
        bounded.append(time.perf_counter() - started)
        partial += bool(summary["partial"])
        started = time.perf_counter()
        full = summarize_namespace(ns, seconds=3600)
        whole.append(time.perf_counter() - started)
    return {
        "variables": n + 4,
        "default_ms_median": round(statistics.median(bounded) * 1000, 2),
        "default_ms_max": round(max(bounded) * 1000, 2),
        "partial_runs": partial,
        "examined_when_partial": summary["examined"],
        "unbounded_ms_median": round(statistics.median(whole) * 1000, 2),
        "unbounded_partial": full["partial"],
        "largest": [v["name"] for v in full["variables"][:4]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000,300000")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    rows = [measure(int(n), args.repeat) for n in args.sizes.split(",")]
    print(
        f"{'VARIABLES':>10} {'DEFAULT ms (median/max)':>24} {'PARTIAL':>8} {'NO DEADLINE ms':>15}"
    )
    for row in rows:
        print(
            f"{row['variables']:>10} {row['default_ms_median']:>11} / {row['default_ms_max']:<10} "
            f"{row['partial_runs']:>5}/{args.repeat:<2} {row['unbounded_ms_median']:>15}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
