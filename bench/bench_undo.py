"""Undo a cell (issue 49 item 4): what cell checkpoints cost a session, and undo, beside
Kishu and bare CRIU, in one run.

1. **Sessions**: Kishu's test notebooks (``--kishu-notebooks``: a checkout's
   ``kishu/tests/notebooks``; those whose cells all run here) and a synthetic 1 GiB kernel
   changing 1 % per cell, each cell sent after ``--think`` seconds, through a real server's
   websocket as JupyterLab sends it: with cell checkpoints (ours, the defaults), without
   (the baseline), and with Kishu attached (it checkpoints after every cell too). Per
   session: its wall time, the time the kernel was paused by checkpoints (ours: each
   checkpoint's ``pause_seconds``, the time requests were held, and its stall, which adds
   the freezes of its pre-copy rounds; Kishu: its time in its cell hooks, which the next
   cell waits for), those shares of the wall time (ours: of every checkpoint the session
   asked for, the one after its last cell included, which begins after its wall time;
   and of those begun within it), how many cells got a checkpoint of
   their own, the next cell's start delay (send to ``execute_input``, less the baseline's
   for the same cell), and undo of the last cell until a cell's first output (ours; Kishu's
   ``undo``).
2. **Delay, worst case**: the 1 GiB kernel, each next cell sent at a random offset in
   [0, ``--offset-max``] after the previous cell's idle (the same seeded offsets with and
   without checkpoints): cells that land on a checkpoint.
3. **Undo at 4 GiB** (``--undo-mib``): a DataFrame notebook, cells changing 1 % each; undo
   of the last cell until a cell runs again (ours: the first undo saves the kernel first;
   the second, right after, restores from a checkpoint's images without a save), beside
   bare ``criu restore`` of the same memory in a plain ipykernel (dumped bare), and
   Kishu's undo on the same notebook (``--kishu-timeout``).

The machine's memory is warmed (touched and freed) before each part: these VMs back memory
on first touch (DESIGN.md).

    .venv/bin/python bench/bench_undo.py --kishu-notebooks ~/kishu/kishu/tests/notebooks \\
        [--cells 30] [--think 2] [--undo-mib 4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench_peers import HOOKS, READ_MARKS, Context, du, kishu_command, kishu_intervals
from harness import MIB, QUIET, BareKernel, BenchError, Server, criu_dump, criu_restore

from jupyter_ext.core.criu import Criu
from testkit.processes import execute_request, ws_close, ws_connect

SYNTHETIC = [
    "import numpy as np\nrng = np.random.default_rng(3)",
    "data = rng.random({mib} * 2**20 // 8)\nstep = len(data) // 100",
]
#: Cell ``i`` of the synthetic session after its set-up: rewrites its 1 % of the memory.
CHANGE = "data[{i} % 100 * step:({i} % 100 + 1) * step] = rng.random(step)"
DATAFRAME = [
    "import numpy as np, pandas as pd\nrng = np.random.default_rng(5)",
    "n = {mib} * 2**20 // 64\narr = np.empty((n, 8))\n"
    "for lo in range(0, n, 2**22):\n    arr[lo:lo + 2**22] = rng.random((min(2**22, n - lo), 8))\n"
    "df = pd.DataFrame(arr, columns=list('abcdefgh'), copy=False)\nstep = n // 100",
]
DF_CHANGE = "arr[{i} * step:({i} + 1) * step] *= 1.01\ntotal = float(df['a'].sum())"


def warm(mib: int) -> None:
    """Touch and free ``mib`` MiB (twice the kernel's size is asked for)."""
    import numpy as np

    block = np.ones(mib * MIB // 8)
    del block


# --- a session over one websocket ------------------------------------------------------


async def run_cells(
    server: Server, kernel: str, cells: list[str], waits: list[float], timeout: float = 900
) -> list[dict[str, float]]:
    """Run ``cells`` in order on one websocket, each sent ``waits[i]`` seconds after the
    previous one's idle: per cell, when it was sent, when its execute_input came, and
    when it was idle again (monotonic seconds)."""
    ws = await ws_connect(server, kernel)
    times: list[dict[str, float]] = []
    try:
        for index, (code, wait) in enumerate(zip(cells, waits, strict=True)):
            await asyncio.sleep(wait)
            msg_id, message = execute_request(code, f"cell-{index}")
            sent = time.monotonic()
            ws.write_message(message)
            started = idle = replied = 0.0
            error = ""
            while not (idle and replied):
                raw = await asyncio.wait_for(ws.read_message(), timeout)
                if raw is None:
                    raise BenchError("the kernel's websocket closed")
                msg = json.loads(raw)
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind = msg["msg_type"]
                if kind == "execute_input":
                    started = time.monotonic()
                elif kind == "error":
                    error = f"{msg['content']['ename']}: {msg['content']['evalue']}"
                elif kind == "execute_reply":
                    replied = time.monotonic()
                elif kind == "status" and msg["content"]["execution_state"] == "idle":
                    idle = time.monotonic()
            if error:
                raise BenchError(f"cell {index} failed: {error}")
            times.append({"sent": sent, "started": started or replied, "idle": idle})
    finally:
        await ws_close(ws)
    return times


def checkpoints(server: Server, kernel: str) -> dict[str, Any]:
    listing: dict[str, Any] = server.api("GET", f"api/snapshots/kernels/{kernel}/checkpoints")
    return listing


def settled(server: Server, kernel: str, timeout: float = 600) -> dict[str, Any]:
    """The kernel's checkpoints once none is being taken and every cell run has one (or
    the last was skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        listing = checkpoints(server, kernel)
        if not listing["taking"] and (not listing["cells_since"] or listing["skipped"]):
            return listing
        if time.monotonic() > deadline:
            raise BenchError(f"checkpoints did not settle: {listing}")
        time.sleep(0.05)


def opened(server: Server, notebook: str) -> str:
    """A notebook session as JupyterLab opens it, its kernel once idle (its "start"
    checkpoint taken where checkpoints are on)."""
    kernel = server.start_session(notebook, "python3-snapshot")
    server.execute(kernel, "pass")
    return kernel


def undo_to_output(
    server: Server, kernel: str, redo: bool = False, then_run: bool = True
) -> dict[str, Any]:
    """Undo (redo) the last cell through REST, then (``then_run``) a cell: seconds from
    the request to that cell's first output, and the undo's own result."""
    started = time.monotonic()
    run = server.run_job(f"api/snapshots/kernels/{kernel}/{'redo' if redo else 'undo'}", {})
    result = {
        "job": round(run.seconds, 4),
        "wrapper": run.result.get("seconds"),
        "lazy": run.result.get("lazy"),
        "saved_first": run.result.get("save"),
        "phases": run.result.get("phases"),
    }
    if then_run:
        sent = time.monotonic()
        ready = server.execute(kernel, "print('ready')")
        result["to_output"] = round(sent - started + ready["first_output"], 4)
    return result


def undo_series(server: Server, kernel: str) -> dict[str, Any]:
    """Undo the last cell and run a cell (what a user does); then undo that cell and at
    once undo again (the second from a checkpoint's images, nothing saved) and run a
    cell; then redo and run a cell."""
    first = undo_to_output(server, kernel)
    settled(server, kernel)
    undo_to_output(server, kernel, then_run=False)
    again = undo_to_output(server, kernel)
    redo = undo_to_output(server, kernel, redo=True)
    return {"first": first, "again": again, "redo": redo}


def ours(server: Server, name: str, cells: list[str], waits: list[float]) -> dict[str, Any]:
    """A session with cell checkpoints: per-cell times, the pause, coverage, undo."""
    kernel = opened(server, f"{name}.ipynb")
    settled(server, kernel)
    began_wall, began = time.time(), time.monotonic()
    times = asyncio.run(run_cells(server, kernel, cells, waits))
    wall = times[-1]["idle"] - began
    listing = settled(server, kernel)
    taken = [
        c
        for c in listing["checkpoints"]
        if datetime.fromisoformat(c["created"]).timestamp() >= began_wall
    ]
    own = sum(1 for c in taken if len(c["cells"]) == 1)
    # Undo, undo again, redo: three checkpoints at least (paced, a burst of cells may
    # share one).
    undo = (
        undo_series(server, kernel)
        if len(listing["checkpoints"]) >= 3
        else {"skipped": f"{len(listing['checkpoints'])} checkpoints"}
    )
    server.api("DELETE", f"api/kernels/{kernel}")
    pauses = [c.get("pause_seconds", 0.0) for c in taken]
    # What stalled the kernel: requests held, and the pre-copy rounds' freezes.
    stalls = [
        c.get("pause_seconds", 0.0) + (c.get("memory") or {}).get("precopy_frozen_seconds", 0.0)
        for c in taken
    ]
    frozen = [(c.get("memory") or {}).get("frozen_total_seconds", 0.0) for c in taken]
    # When each began, in seconds from the session's start: the one after its last cell
    # (which the session's cells asked for) begins after its wall time.
    began_at = [datetime.fromisoformat(c["created"]).timestamp() - began_wall for c in taken]
    within = [stall for stall, at in zip(stalls, began_at, strict=True) if at < wall]
    return {
        "times": times,
        "wall": wall,
        "pause": sum(pauses),
        "frozen": sum(frozen),
        "pause_share": sum(pauses) / wall,
        "stall": sum(stalls),
        "stall_share": sum(stalls) / wall,
        "stall_share_within": sum(within) / wall,
        "checkpoints": len(taken),
        "own_checkpoint_cells": own,
        "cells": len(cells),
        "pause_p95": percentile(pauses, 95),
        "own_bytes": sum(c.get("own_bytes", 0) for c in taken),
        "full_copies": sum(1 for c in taken if (c.get("memory") or {}).get("mode") == "full"),
        "skipped": listing.get("skipped"),
        "taken": [
            {
                "began": round(at, 3),
                "cells": len(c["cells"]),
                "pause_seconds": c.get("pause_seconds"),
                **c["memory"],
            }
            for c, at in zip(taken, began_at, strict=True)
        ],
        "undo": undo,
    }


def baseline(server: Server, name: str, cells: list[str], waits: list[float]) -> dict[str, Any]:
    kernel = opened(server, f"{name}-off.ipynb")
    times = asyncio.run(run_cells(server, kernel, cells, waits))
    server.api("DELETE", f"api/kernels/{kernel}")
    return {"times": times}


def kishu(ctx: Context, name: str, cells: list[str], waits: list[float]) -> dict[str, Any]:
    """The same session with Kishu attached: its time in its hooks, its undo."""
    import nbformat

    server = ctx.peer_server
    assert server is not None
    path = ctx.root / f"kishu-{name}.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nbformat.write(nb, str(path))
    kernel = server.start_session(path.name, "python3")
    try:
        server.execute(kernel, HOOKS.format("outer"))
        kishu_command(ctx, "init", str(path))
        server.execute(kernel, HOOKS.format("inner"))
        server.execute(kernel, READ_MARKS)
        began = time.monotonic()
        times = asyncio.run(run_cells(server, kernel, cells, waits))
        wall = times[-1]["idle"] - began
        marks = json.loads(server.execute(kernel, READ_MARKS)["out"])
        spans = kishu_intervals([(n, t) for n, t in marks])
        paused = sum(end - start for start, end in spans)
        started = time.monotonic()
        kishu_command(ctx, "undo", str(path))
        sent = time.monotonic()
        ready = server.execute(kernel, "print('ready')")
        stored = sum(du(p) for p in ctx.root.glob(f"{path.stem}*kishudb*"))
        return {
            "wall": wall,
            "pause": paused,
            "pause_share": paused / wall,
            "undo": {"to_output": sent - started + ready["first_output"]},
            "stored_bytes": stored,
        }
    finally:
        server.end_sessions()
        for leftover in ctx.root.glob("*.kishudb*"):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)


def percentile(values: list[float], pct: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


def delays(ours_times: list[dict[str, float]], base_times: list[dict[str, float]]) -> list[float]:
    """Each cell's start delay: send to execute_input, less the baseline's."""
    return [
        max(0.0, (a["started"] - a["sent"]) - (b["started"] - b["sent"]))
        for a, b in zip(ours_times, base_times, strict=True)
    ]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(percentile(values, 50), 4),
        "p95": round(percentile(values, 95), 4),
        "max": round(max(values, default=0.0), 4),
    }


# --- the notebooks ---------------------------------------------------------------------


def kishu_notebooks(directory: Path | None) -> dict[str, list[str]]:
    """Kishu's test notebooks' code cells (those that do not attach Kishu themselves)."""
    import nbformat

    found: dict[str, list[str]] = {}
    for path in sorted(directory.glob("*.ipynb")) if directory else []:
        nb = nbformat.read(str(path), as_version=4)
        cells = [c.source for c in nb.cells if c.cell_type == "code" and c.source.strip()]
        if cells and not any("kishu" in c for c in cells):
            found[path.stem] = cells
    return found


def runs_here(server: Server, name: str, cells: list[str]) -> str:
    """Why the notebook's cells cannot all run here ("" when they can)."""
    kernel = server.start_session(f"probe-{name}.ipynb", "python3-snapshot")
    try:
        for code in cells:
            server.execute(kernel, code, timeout=300)
    except (BenchError, TimeoutError) as exc:
        return str(exc)[:200]
    finally:
        server.api("DELETE", f"api/kernels/{kernel}")
    return ""


# --- bare CRIU at the undo size ---------------------------------------------------------


def bare_restore(work: Path, cells: list[str], criu: Criu) -> dict[str, float]:
    """The same memory in a plain ipykernel, dumped by bare CRIU, killed, restored: from
    ``criu restore`` to a cell's first output (the images in page cache)."""
    bare_dir = work / "bare"
    shutil.rmtree(bare_dir, ignore_errors=True)
    bare_dir.mkdir()
    kernel = BareKernel(bare_dir)
    restored = None
    try:
        for code in cells:
            kernel.run(code, 900)
        kernel.disconnect()
        criu_dump(criu, kernel.pid, bare_dir / "images")
        kernel.kill()
        started = time.monotonic()
        restored = criu_restore(criu, bare_dir / "images", bare_dir / "pid", verbose=False)
        criu_seconds = time.monotonic() - started
        kernel.connect()
        sent = time.monotonic()
        ready = kernel.run("print('ready')", 300)
        return {
            "criu_restore": criu_seconds,
            "to_output": sent - started + (ready["first_output"] or 0.0),
            "images_bytes": du(bare_dir / "images"),
        }
    finally:
        kernel.kill()
        if restored:
            with contextlib.suppress(ProcessLookupError):
                os.kill(restored, signal.SIGKILL)
        shutil.rmtree(bare_dir, ignore_errors=True)


# --- main ------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kishu-notebooks", type=Path, default=None)
    parser.add_argument("--mib", type=int, default=1024, help="the synthetic kernel (1 GiB)")
    parser.add_argument("--cells", type=int, default=30, help="changing cells per session")
    parser.add_argument("--think", type=float, default=2.0, help="seconds before each cell")
    parser.add_argument("--offset-max", type=float, default=1.0)
    parser.add_argument("--undo-mib", type=int, default=4096)
    parser.add_argument("--kishu-timeout", type=float, default=1800.0)
    parser.add_argument("--skip", default="", help="parts to skip: sessions,delay,undo,kishu")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-undo-"))
    work.mkdir(parents=True, exist_ok=True)
    criu = Criu.locate()
    short = Path(tempfile.mkdtemp(prefix="bu-", dir="/tmp"))
    env = {"JUPYTER_SNAPSHOT_RUNTIME_DIR": str(short)}
    notebooks = work / "notebooks"
    servers: dict[str, Server] = {}
    report: dict[str, Any] = {
        "when": datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "memory_gib": round(
                os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1
            ),
        },
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    try:
        for mode in ("auto", "off"):
            config = {
                "ServerApp": {"jpserver_extensions": {"jupyter_ext": True}},
                "SnapshotExtensionApp": {
                    "work_dir": str(work / f"snapwork-{mode}"),
                    "local_store_dir": str(work / "store"),
                    "cell_checkpoints": mode,
                    "long_cell_seconds": 0,
                    **QUIET,
                },
            }
            servers[mode] = Server(work / f"server-{mode}", notebooks, config, env=env)
        ctx = Context(work / "kishu", ["kishu"]) if "kishu" not in skip else None

        # 1. Sessions.
        sessions: dict[str, list[str]] = {}
        if "sessions" not in skip:
            for name, cells in kishu_notebooks(args.kishu_notebooks).items():
                why = runs_here(servers["off"], name, cells)
                if why:
                    report.setdefault("kishu_notebooks_skipped", {})[name] = why
                else:
                    sessions[f"kishu/{name}"] = cells
            synthetic = [c.format(mib=args.mib) for c in SYNTHETIC]
            synthetic += [CHANGE.format(i=i) for i in range(args.cells)]
            sessions[f"synthetic-{args.mib}m-1pct"] = synthetic
        results: dict[str, Any] = {}
        for name, cells in sessions.items():
            print(f"session {name}: {len(cells)} cells", file=sys.stderr, flush=True)
            warm(2 * args.mib if "synthetic" in name else 512)
            waits = [args.think] * len(cells)
            slug = name.replace("/", "-")
            row: dict[str, Any] = {"ours": ours(servers["auto"], slug, cells, waits)}
            row["baseline"] = baseline(servers["off"], slug, cells, waits)
            row["delay"] = summary(delays(row["ours"]["times"], row["baseline"]["times"]))
            if ctx is not None:
                try:
                    row["kishu"] = kishu(ctx, slug, cells, waits)
                except Exception as exc:  # noqa: BLE001 - said in the report
                    row["kishu"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            for peer in ("ours", "baseline"):
                row[peer].pop("times", None)
            results[name] = row
            print(f"  {json.dumps(row)[:600]}", file=sys.stderr, flush=True)
        report["sessions"] = results

        # 2. Delay, worst case: cells landing on checkpoints.
        if "delay" not in skip:
            warm(2 * args.mib)
            rng = random.Random(49)
            cells = [c.format(mib=args.mib) for c in SYNTHETIC]
            cells += [CHANGE.format(i=i) for i in range(args.cells)]
            waits = [args.think] * 2 + [rng.uniform(0, args.offset_max) for _ in range(args.cells)]
            mine = ours(servers["auto"], "delay", cells, waits)
            base = baseline(servers["off"], "delay", cells, waits)
            worst = delays(mine["times"][2:], base["times"][2:])
            mine.pop("times")
            report["delay_worst_case"] = {"ours": mine, "delay": summary(worst)}

        # 3. Undo at the undo size.
        if "undo" not in skip:
            warm(2 * args.undo_mib)
            cells = [c.format(mib=args.undo_mib) for c in DATAFRAME]
            cells += [DF_CHANGE.format(i=i) for i in range(3)]
            server = servers["auto"]
            kernel = opened(server, "dataframe.ipynb")
            settled(server, kernel)
            for code in cells:
                server.execute(kernel, code, timeout=1800)
                listing = settled(server, kernel, timeout=1800)
            series = undo_series(server, kernel)
            server.api("DELETE", f"api/kernels/{kernel}")
            undo: dict[str, Any] = {
                "ours": series,
                "checkpoints": [
                    {k: c.get(k) for k in ("kind", "own_bytes", "pause_seconds", "memory")}
                    for c in listing["checkpoints"]
                ],
            }
            warm(2 * args.undo_mib)
            undo["bare_criu"] = bare_restore(work, cells, criu)
            if ctx is not None:
                warm(2 * args.undo_mib)
                try:
                    undo["kishu"] = kishu(ctx, "dataframe", cells, [0.5] * len(cells))
                except Exception as exc:  # noqa: BLE001 - said in the report
                    undo["kishu"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            report["undo"] = undo
    except BaseException as exc:
        # What was measured before the failure is kept, with the failure.
        report["failed"] = f"{type(exc).__name__}: {exc}"[:1000]
        raise
    finally:
        for server in servers.values():
            server.stop()
        if "ctx" in locals() and ctx is not None:
            ctx.close()
        shutil.rmtree(short, ignore_errors=True)
        text = json.dumps(report, indent=1)
        if args.json:
            args.json.write_text(text)
        print(text)


if __name__ == "__main__":
    main()
