"""Side by side with the alternatives: ours, bare CRIU, Kishu, dill and re-running.

One run builds the same notebook sessions (bench/peer_sessions.py: a pandas/scikit-learn
analysis, a numpy simulation, a session with what pickling cannot save) at each size and
saves and restores them with every peer:

- ours: the REST API of a real jupyter_server with this extension (``POST
  /api/snapshots``, ``POST /api/snapshots/<id>/restore`` into a new kernel of the notebook);
- criu: bare ``criu dump --leave-running`` / ``criu restore`` of a plain ipykernel (in its
  own PID and time namespaces, as a CRIU script would run it; the second dump is
  incremental, ``--track-mem`` / ``--prev-images-dir``);
- kishu: PyPI ``kishu`` attached with ``kishu init`` to the notebook's kernel on a real
  jupyter_server; it checkpoints after every cell; restore is ``kishu checkout`` of the
  newest commit into the restarted kernel;
- dill: ``dill.dump_session`` in the kernel, ``dill.load_session`` in the restarted one;
- rerun: a new kernel runs the notebook from the top.

Per peer: the time the kernel is paused by a snapshot, the time until it is durable, the
stored bytes, the new bytes of a second snapshot after 5 % of the memory changed, the time
from "restore" to the first output of a cell, the peak extra memory while snapshotting
(RSS of every process involved, sampled every 20 ms), and whether the restored state is
correct (the session's fingerprint cell prints what it printed before). Ratios are ours
over each peer, from the same run.

    sudo nice -n 10 .venv/bin/python bench/bench_peers.py --sizes 256,1024 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import (
    MIB,
    QUIET,
    BareKernel,
    BenchError,
    Deadline,
    Server,
    criu_dump,
    criu_restore,
    extension_config,
)
from peer_sessions import SESSIONS, Session

from jupyter_ext.core.criu import Criu, frozen_seconds

PEERS = ("ours", "criu", "kishu", "dill", "rerun")


class MemorySampler:
    """Peak RSS of process trees (every 20 ms) over what they used before, for the peak
    extra memory while a snapshot runs."""

    def __init__(self, roots: Callable[[], list[int]]) -> None:
        self.roots = roots
        self.base = self.total()
        self.peak = self.base
        self.series: list[tuple[float, int]] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def total(self) -> int:
        import psutil

        seen: set[int] = set()
        total = 0
        for root in self.roots():
            try:
                procs = [psutil.Process(root)]
                procs += procs[0].children(recursive=True)
            except psutil.Error:
                continue
            for proc in procs:
                if proc.pid in seen:
                    continue
                seen.add(proc.pid)
                with contextlib.suppress(psutil.Error):
                    total += proc.memory_info().rss
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            total = self.total()
            self.peak = max(self.peak, total)
            if self.series is not None:
                self.series.append((time.time(), total))

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.total())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def write_notebook(path: Path, session: Session) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in [*session.cells, session.mutate]]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nbformat.write(nb, str(path))


def du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# --- ours ---------------------------------------------------------------------------


def run_ours(ctx: Context, session: Session, deadline: Deadline) -> dict[str, Any]:
    server = ctx.ours_server
    assert server is not None
    nb = f"ours-{session.name}.ipynb"
    write_notebook(ctx.root / nb, session)
    kernel = server.start_session(nb, "python3-snapshot")
    for cell in session.cells:
        server.execute(kernel, cell, deadline.left())

    def snapshot() -> tuple[dict[str, Any], float, int]:
        with MemorySampler(lambda: [server.process.pid]) as mem:
            run = server.run_job("api/snapshots", {"kernel_id": kernel}, deadline)
        return run.result, run.seconds, mem.extra

    first, durable, peak = snapshot()
    server.execute(kernel, session.mutate, deadline.left())
    before = server.execute(kernel, session.check, deadline.left())["out"]
    second, durable2, _ = snapshot()
    started = time.monotonic()
    path = f"api/snapshots/{second['id']}/restore"
    restored = server.run_job(path, {"path": nb}, deadline).result
    new_kernel = restored["kernel_id"] if "kernel_id" in restored else restored["kernel"]["id"]
    ready = server.execute(new_kernel, "print('ready')", deadline.left())
    restore = time.monotonic() - started - ready["elapsed"] + ready["first_output"]
    after = server.execute(new_kernel, session.check, deadline.left())["out"]
    return {
        "pause": first["pause_seconds"],
        "frozen": first["frozen_seconds"],
        "durable": durable,
        "stored_bytes": first["stored_bytes"],
        "second_pause": second["pause_seconds"],
        "second_durable": durable2,
        "second_new_bytes": second["new_bytes"],
        "restore_to_output": restore,
        "peak_extra_memory": peak,
        "correct": before == after,
        "fingerprint": [before, after],
    }


# --- bare CRIU ------------------------------------------------------------------------


def tracks_memory(criu: Criu) -> bool:
    """Whether this kernel has soft-dirty bits, which incremental dumps need."""
    check = [str(criu.path), "check", "--feature", "mem_dirty_track"]
    return subprocess.run(check, capture_output=True, check=False).returncode == 0


def run_criu(ctx: Context, session: Session, deadline: Deadline) -> dict[str, Any]:
    work = ctx.work / f"criu-{session.name}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    kernel = BareKernel(work)
    restored_pid = None
    try:
        for cell in session.cells:
            kernel.run(cell, deadline.left())
        kernel.disconnect()
        one = work / "d1"
        incremental = tracks_memory(ctx.criu)
        with MemorySampler(lambda: [kernel.launcher.pid, os.getpid()]) as mem:
            started = time.monotonic()
            criu_dump(ctx.criu, kernel.pid, one, "" if incremental else None, deadline)
            durable = time.monotonic() - started
        kernel.connect()
        kernel.run(session.mutate, deadline.left())
        before = kernel.run(session.check, deadline.left())["out"]
        kernel.disconnect()
        two = work / "d2"
        started = time.monotonic()
        criu_dump(ctx.criu, kernel.pid, two, "../d1" if incremental else None, deadline)
        durable2 = time.monotonic() - started
        kernel.kill()
        started = time.monotonic()
        restored_pid = criu_restore(ctx.criu, two, work / "restored.pid", deadline)
        kernel.connect()
        sent = time.monotonic()
        ready = kernel.run("print('ready')", deadline.left())
        restore = sent - started + ready["first_output"]
        after = kernel.run(session.check, deadline.left())["out"]
        return {
            "pause": frozen_seconds(one / "dump.log"),
            "durable": durable,
            "stored_bytes": du(one),
            "second_pause": frozen_seconds(two / "dump.log"),
            "second_durable": durable2,
            "second_new_bytes": du(two),
            "incremental": incremental,
            "restore_to_output": restore,
            "peak_extra_memory": mem.extra,
            "correct": before == after,
            "fingerprint": [before, after],
        }
    finally:
        kernel.kill()
        if restored_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(restored_pid, signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)


# --- Kishu ----------------------------------------------------------------------------

# Timestamps around Kishu's own cell hooks: ``outer`` hooks are registered before
# ``kishu init`` (IPython calls them first), ``inner`` ones after it. Kishu's work on a
# cell (tracking before it, the checkpoint after it) is the time between them. They live
# in a module, not in the notebook's namespace, so Kishu does not save them.
HOOKS = """
import sys, time, types
_m = sys.modules.setdefault('_bench_hooks', types.ModuleType('_bench_hooks'))
if not hasattr(_m, 'marks'):
    _m.marks = []
def _mark(name, marks=_m.marks):
    return lambda *args: marks.append((name, time.time()))
get_ipython().events.register('pre_run_cell', _mark('pre_{0}'))
get_ipython().events.register('post_run_cell', _mark('post_{0}'))
del _m, _mark
"""
READ_MARKS = (
    "import sys, json; print(json.dumps(sys.modules['_bench_hooks'].marks));"
    " sys.modules['_bench_hooks'].marks.clear()"
)


def kishu_intervals(marks: list[tuple[str, float]]) -> list[tuple[float, float]]:
    """Kishu's intervals (before and after each cell) from the hooks' timestamps."""
    found, last = [], dict[str, float]()
    for name, at in marks:
        last[name] = at
        if name == "pre_inner" and "pre_outer" in last:
            found.append((last["pre_outer"], at))
        if name == "post_inner" and "post_outer" in last:
            found.append((last["post_outer"], at))
    return found


def kishu_command(ctx: Context, command: str, *args: str) -> None:
    """``kishu <command> <args>`` as Kishu's JupyterLab extension runs it: KishuCommand in
    a process that finds the server in its Jupyter runtime directory (the CLI would add
    4-6 s of start-up here)."""
    from kishu.commands import KishuCommand

    saved = os.environ.get("JUPYTER_RUNTIME_DIR")
    assert ctx.peer_server is not None
    os.environ["JUPYTER_RUNTIME_DIR"] = ctx.peer_server.env["JUPYTER_RUNTIME_DIR"]
    try:
        result = getattr(KishuCommand, command)(Path(args[0]), *args[1:])
    finally:
        if saved is None:
            del os.environ["JUPYTER_RUNTIME_DIR"]
        else:
            os.environ["JUPYTER_RUNTIME_DIR"] = saved
    status = getattr(result, "status", "ok")
    if status != "ok":
        raise BenchError(f"kishu {command}: {status}: {getattr(result, 'message', result)}")


def run_kishu(ctx: Context, session: Session, deadline: Deadline) -> dict[str, Any]:
    from kishu.storage.branch import KishuBranch

    server = ctx.peer_server
    assert server is not None
    nb = ctx.root / f"kishu-{session.name}.ipynb"
    write_notebook(nb, session)
    kernel = server.start_session(nb.name, "python3")
    server.execute(kernel, HOOKS.format("outer"), deadline.left())
    kishu_command(ctx, "init", str(nb))
    server.execute(kernel, HOOKS.format("inner"), deadline.left())
    server.execute(kernel, READ_MARKS, deadline.left())
    series: list[tuple[float, int]] = []

    def db_bytes() -> int:
        return sum(du(p) for p in ctx.root.glob(f"{nb.stem}*kishudb*"))

    def cells(codes: list[str]) -> tuple[float, int]:
        """Kishu's time on these cells (with their commits) and its peak extra memory."""
        series.clear()
        with MemorySampler(lambda: [server.process.pid]) as mem:
            mem.series = series
            for code in codes:
                server.execute(kernel, code, deadline.left())
        marks = json.loads(server.execute(kernel, READ_MARKS, deadline.left())["out"])
        spans = kishu_intervals([(n, t) for n, t in marks])
        total = sum(end - start for start, end in spans)
        peak = 0
        for start, end in spans:
            inside = [rss for at, rss in series if start <= at <= end + 0.02]
            base = [rss for at, rss in series if at <= start]
            if inside and base:
                peak = max(peak, max(inside) - base[-1])
        return total, peak

    pause, peak = cells(session.cells)
    stored = db_bytes()
    pause2, _ = cells([session.mutate])
    new2 = db_bytes() - stored
    before = server.execute(kernel, session.check, deadline.left())["out"]
    head = KishuBranch(str(next(ctx.root.glob(f"{nb.stem}*.kishudb")))).get_head().commit_id
    started = time.monotonic()
    server.api("POST", f"api/kernels/{kernel}/restart", {})
    restart = time.monotonic() - started
    # Re-attaching to the new kernel waits about 9 s here for a JupyterLab frontend to
    # answer (ipylab), which a headless run has not: not counted, as a user with a
    # browser would not wait for it.
    started = time.monotonic()
    kishu_command(ctx, "init", str(nb))
    reattach = time.monotonic() - started
    started = time.monotonic()
    kishu_command(ctx, "checkout", str(nb), str(head))
    checkout = time.monotonic() - started
    sent = time.monotonic()
    ready = server.execute(kernel, "print('ready')", deadline.left())
    restore = restart + sent - started + ready["first_output"]
    after = server.execute(kernel, session.check, deadline.left())["out"]
    return {
        "pause": pause,
        "durable": pause,
        "stored_bytes": stored,
        "second_pause": pause2,
        "second_durable": pause2,
        "second_new_bytes": new2,
        "restore_to_output": restore,
        "reattach_not_counted": reattach,
        "restart": restart,
        "checkout": checkout,
        "peak_extra_memory": peak,
        "correct": before == after,
        "fingerprint": [before, after],
    }


# --- dill and re-running ----------------------------------------------------------------


def run_dill_and_rerun(
    ctx: Context, session: Session, deadline: Deadline
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One kernel runs the notebook from the top (the re-running peer's restore), and
    dill saves it in between: (dill's result or error, rerun's result)."""
    server = ctx.peer_server
    assert server is not None
    nb = f"dill-{session.name}.ipynb"
    write_notebook(ctx.root / nb, session)
    pickle = ctx.work / f"dill-{session.name}.pkl"
    started = time.monotonic()
    kernel = server.start_session(nb, "python3")
    rerun = time.monotonic() - started
    for cell in session.cells:
        rerun += server.execute(kernel, cell, deadline.left())["elapsed"]

    def dump() -> tuple[float, int, int]:
        code = f"import dill\ndill.dump_session({str(pickle)!r})"
        with MemorySampler(lambda: [server.process.pid]) as mem:
            took = server.execute(kernel, code, deadline.left())["elapsed"]
        return took, pickle.stat().st_size, mem.extra

    dill_result: dict[str, Any]
    try:
        first = dump()
    except BenchError as exc:
        first = None
        dill_result = {"error": f"dill.dump_session: {exc}"}
    rerun += server.execute(kernel, session.mutate, deadline.left())["elapsed"]
    ready = server.execute(kernel, "print('ready')", deadline.left())
    rerun += ready["first_output"]
    before = server.execute(kernel, session.check, deadline.left())["out"]
    rerun_result = {"restore_to_output": rerun, "correct": True, "fingerprint": [before, before]}
    if first is None:
        return dill_result, rerun_result
    try:
        second = dump()
        started = time.monotonic()
        server.api("POST", f"api/kernels/{kernel}/restart", {})
        code = f"import dill\ndill.load_session({str(pickle)!r})"
        server.execute(kernel, code, deadline.left())
        sent = time.monotonic()
        ready = server.execute(kernel, "print('ready')", deadline.left())
        restore = sent - started + ready["first_output"]
        after = server.execute(kernel, session.check, deadline.left())["out"]
    except BenchError as exc:
        return {"error": f"dill.load_session: {exc}"}, rerun_result
    finally:
        pickle.unlink(missing_ok=True)
    return {
        "pause": first[0],
        "durable": first[0],
        "stored_bytes": first[1],
        "second_pause": second[0],
        "second_durable": second[0],
        "second_new_bytes": second[1],
        "restore_to_output": restore,
        "peak_extra_memory": first[2],
        "correct": before == after,
        "fingerprint": [before, after],
    }, rerun_result


# --- the run ------------------------------------------------------------------------------


class Context:
    """What one run shares: a server with the extension (ours), a plain one (Kishu, dill,
    re-running), CRIU, and the directories."""

    def __init__(self, work: Path, peers: list[str]) -> None:
        self.work = work
        self.root = work / "notebooks"
        self.root.mkdir(parents=True, exist_ok=True)
        self.criu = Criu.locate()
        # Kernel wrappers bind unix sockets in their runtime directory, whose paths may not
        # exceed 107 bytes: a short directory, whatever --work is.
        self.short = Path(tempfile.mkdtemp(prefix="bp-", dir="/tmp"))
        self.ours_server: Server | None = None
        self.peer_server: Server | None = None
        if "ours" in peers:
            config = extension_config(
                work / "snapwork", local_store_dir=str(work / "store"), **QUIET
            )
            env = {"JUPYTER_SNAPSHOT_RUNTIME_DIR": str(self.short)}
            self.ours_server = Server(work / "ours-server", self.root, config, env=env)
        if {"kishu", "dill", "rerun"} & set(peers):
            # A plain server, as Kishu's users run it (the extension is not enabled).
            config = {"ServerApp": {"jpserver_extensions": {"jupyter_ext": False}}}
            env = {"KISHU_PATH_ROOT": str(work / "kishu-home")}
            os.environ.update(env)  # for KishuCommand in this process (read on import)
            # Kishu's switch for running without a browser: it then no longer waits
            # (5 s a checkout) for JupyterLab to save and reload the notebook.
            (work / "kishu-home" / ".kishu").mkdir(parents=True, exist_ok=True)
            (work / "kishu-home" / ".kishu" / "config.ini").write_text(
                "[JUPYTERINT]\ntest_mode = True\n"
            )
            self.peer_server = Server(
                work / "peer-server", self.root, config, env=env, ready="api/status"
            )

    def close(self) -> None:
        for server in (self.ours_server, self.peer_server):
            if server is not None:
                server.stop()
        shutil.rmtree(self.short, ignore_errors=True)


def run_session(
    ctx: Context, session: Session, peers: list[str], timeout: float
) -> dict[str, dict[str, Any]]:
    """Every peer on one session; a peer that fails has {"error": ...}."""
    results: dict[str, dict[str, Any]] = {}
    runners: dict[str, Callable[[Context, Session, Deadline], dict[str, Any]]] = {
        "ours": run_ours,
        "criu": run_criu,
        "kishu": run_kishu,
    }
    order = [p for p in PEERS if p in peers]
    for peer in order:
        if peer == "rerun" or (peer == "dill" and "rerun" in results):
            continue
        print(f"  {session.name}: {peer} ...", file=sys.stderr, flush=True)
        started = time.monotonic()
        try:
            if peer == "dill":
                dill, rerun = run_dill_and_rerun(ctx, session, Deadline(timeout, "--peer-timeout"))
                results["dill"], results["rerun"] = dill, rerun
            else:
                results[peer] = runners[peer](ctx, session, Deadline(timeout, "--peer-timeout"))
        except (BenchError, TimeoutError, subprocess.TimeoutExpired) as exc:
            results[peer] = {"error": f"{type(exc).__name__}: {exc}"}
        except Exception as exc:  # noqa: BLE001 - the run goes on, the error is reported
            results[peer] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            server = ctx.ours_server if peer == "ours" else ctx.peer_server
            if server is not None:
                with contextlib.suppress(Exception):
                    server.end_sessions()
            if peer == "ours" and server is not None:
                # The next sessions need the disk: 4 GiB kernels make 4 GiB snapshots.
                with contextlib.suppress(Exception):
                    for snap in server.api("GET", "api/snapshots")["snapshots"]:
                        server.api("DELETE", f"api/snapshots/{snap['id']}")
            for leftover in ctx.root.glob("*.kishudb*"):
                if leftover.is_dir():
                    shutil.rmtree(leftover, ignore_errors=True)
                else:
                    leftover.unlink(missing_ok=True)
        took = time.monotonic() - started
        for name in ("dill", "rerun") if peer == "dill" else (peer,):
            if name in results:
                results[name]["wall_seconds"] = took
                state = results[name].get("error") or "ok"
                print(f"    {name}: {state[:300]} ({took:.0f} s)", file=sys.stderr, flush=True)
    if "rerun" in peers and "rerun" not in results:
        results["rerun"] = {"error": "measured with dill, which was not run"}
    if "rerun" in results and "ours" in results and "fingerprint" in results["ours"]:
        reference = results["ours"]["fingerprint"][0]
        if "fingerprint" in results["rerun"]:
            results["rerun"]["correct"] = results["rerun"]["fingerprint"][0] == reference
    return results


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("jupyter-kernel-snapshots", "kishu", "dill", "ipykernel", "jupyter_server"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    for name in ("numpy", "pandas", "scikit-learn"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    found["criu"] = Criu.locate().version_text
    head = subprocess.run(
        ["git", "-C", str(Path(__file__).resolve().parent), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
    )
    found["commit"] = head.stdout.strip() or "unknown"
    found["python"] = sys.version.split()[0]
    return found


def machine() -> dict[str, Any]:
    mem = Path("/proc/meminfo").read_text().split("\n")[0].split()[1]
    return {
        "nproc": os.cpu_count(),
        "ram_gib": round(int(mem) / 1024 / 1024, 1),
        "kernel": os.uname().release,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


# Metrics: key, title, whether it is a time.
METRICS = [
    ("pause", "paused", True),
    ("durable", "durable", True),
    ("stored_bytes", "stored", False),
    ("second_new_bytes", "2nd new", False),
    ("restore_to_output", "restore->output", True),
    ("peak_extra_memory", "peak mem", False),
]


def fmt(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key in ("stored_bytes", "second_new_bytes", "peak_extra_memory"):
        return f"{value / MIB:.0f} MiB" if value >= MIB else f"{value / 1024:.0f} KiB"
    return f"{value:.2f} s"


def ratio(ours: Any, peer: Any) -> str:
    if not isinstance(ours, (int, float)) or not isinstance(peer, (int, float)) or not peer:
        return "-"
    return f"{ours / peer:.2f}x"


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table of every size, session and peer, with ratios ours / peer."""
    lines = [
        "| size | session | peer | " + " | ".join(t for _, t, _ in METRICS) + " | correct |",
        "|---|---|---|" + "---:|" * len(METRICS) + "---|",
    ]
    for row in rows:
        ours = row["peers"].get("ours", {})
        for peer, result in row["peers"].items():
            head = f"| {row['mib']} MiB | {row['session']} | {peer} |"
            if "error" in result:
                lines.append(f"{head} fails: {result['error'][:160]} |" + " |" * len(METRICS))
                continue
            cells = []
            for key, _, _ in METRICS:
                value = result.get(key)
                cell = fmt(key, value)
                if peer != "ours" and value is not None and ours and "error" not in ours:
                    cell += f" ({ratio(ours.get(key), value)})"
                cells.append(cell)
            lines.append(f"{head} " + " | ".join(cells) + f" | {result.get('correct', '-')} |")
    return "\n".join(lines)


def goals(rows: list[dict[str, Any]]) -> list[str]:
    """Each goal of issue 13, met or not, with the numbers."""
    out = []
    for row in rows:
        peers, where = row["peers"], f"{row['mib']} MiB {row['session']}"
        ours, kishu, rerun = peers.get("ours"), peers.get("kishu"), peers.get("rerun")
        if ours is None:
            continue
        if "error" in ours:
            out.append(f"NOT MET {where}: ours failed ({ours['error'][:200]})")
            continue
        if kishu is not None:
            if "error" not in kishu and kishu.get("correct"):
                for key, what in (
                    ("pause", "snapshot pause"),
                    ("durable", "snapshot until durable"),
                    ("restore_to_output", "restore"),
                ):
                    r = ours[key] / kishu[key]
                    state = "met" if r <= 0.5 else "NOT MET"
                    out.append(f"{state} {where}: {what} ours/kishu = {r:.2f} (goal <= 0.5)")
            else:
                why = kishu.get("error") or "Kishu's restored state differs"
                state = "met" if ours.get("correct") else "NOT MET"
                out.append(
                    f"{state} {where}: Kishu cannot save it ({why[:160]}); ours correct:"
                    f" {ours.get('correct')}"
                )
        if rerun is not None and row["mib"] >= 1024 and "error" not in rerun:
            r = rerun["restore_to_output"] / ours["restore_to_output"]
            state = "met" if r >= 10 else "NOT MET"
            out.append(f"{state} {where}: restore {r:.1f}x faster than re-running (goal >= 10x)")
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Snapshot (until durable) and restore time against kernel size, per session."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sessions = sorted({r["session"] for r in rows}, key=list(SESSIONS).index)
    fig, axes = plt.subplots(2, len(sessions), figsize=(5 * len(sessions), 8), squeeze=False)
    for col, name in enumerate(sessions):
        for line, (key, title) in enumerate(
            (("durable", "snapshot until durable"), ("restore_to_output", "restore to output"))
        ):
            ax = axes[line][col]
            for peer in PEERS:
                points = [
                    (r["mib"], r["peers"][peer][key])
                    for r in rows
                    if r["session"] == name
                    and peer in r["peers"]
                    and r["peers"][peer].get(key) is not None
                ]
                wrong = any(
                    r["peers"][peer].get("correct") is False
                    for r in rows
                    if r["session"] == name and peer in r["peers"]
                )
                if points:
                    ax.plot(
                        *zip(*sorted(points), strict=True),
                        marker="x" if wrong else "o",
                        linestyle=":" if wrong else "-",
                        color=f"C{PEERS.index(peer)}",
                        label=f"{peer} (restored state wrong)" if wrong else peer,
                    )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{name}: {title}")
            ax.set_xlabel("kernel memory (MiB)")
            ax.set_ylabel("seconds")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,1024,4096", help="MiB of kernel memory")
    parser.add_argument("--sessions", default=",".join(SESSIONS))
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument(
        "--peer-timeout", type=float, default=1800, help="seconds one peer may take on a session"
    )
    parser.add_argument("--json", type=Path, help="write every result here")
    parser.add_argument("--plot", type=Path, help="write the plot (PNG) here")
    parser.add_argument("--markdown", type=Path, help="write the table (Markdown) here")
    parser.add_argument("--work", type=Path, default=Path("/var/tmp"))
    parser.add_argument(
        "--include",
        type=Path,
        action="append",
        default=[],
        help="also show the rows of an earlier run's --json (a size run on its own); with "
        "--sizes '' nothing new is run",
    )
    args = parser.parse_args(argv)
    peers = [p for p in args.peers.split(",") if p]
    unknown = set(peers) - set(PEERS) | set(args.sessions.split(",")) - set(SESSIONS)
    if unknown:
        parser.error(f"unknown peers or sessions: {sorted(unknown)}; known: {PEERS}, {SESSIONS}")
    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {"machine": machine(), "versions": versions(), "rows": rows}
    sizes = [int(s) for s in args.sizes.split(",") if s]
    with tempfile.TemporaryDirectory(prefix="bench-peers-", dir=args.work) as tmp:
        ctx = Context(Path(tmp), peers if sizes else [])
        try:
            for mib in sizes:
                for name in args.sessions.split(","):
                    print(f"{mib} MiB {name}", file=sys.stderr, flush=True)
                    session = SESSIONS[name](mib, str(ctx.root))
                    peers_result = run_session(ctx, session, peers, args.peer_timeout)
                    rows.append({"mib": mib, "session": name, "peers": peers_result})
                    if args.json:
                        report["goals"] = goals(rows)
                        args.json.write_text(json.dumps(report, indent=1))
        finally:
            ctx.close()
    for earlier in args.include:
        included = json.loads(earlier.read_text())
        rows.extend(included["rows"])
        report.setdefault("included", []).append(
            {"file": str(earlier), "machine": included["machine"]}
        )
    rows.sort(key=lambda r: (r["mib"], list(SESSIONS).index(r["session"])))
    report["goals"] = goals(rows)
    table = markdown(rows)
    print(json.dumps(report["machine"]), json.dumps(report["versions"]), sep="\n")
    print(table)
    print("\n".join(report["goals"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if args.markdown:
        args.markdown.write_text(table + "\n\n" + "\n".join(f"- {g}" for g in report["goals"]))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
