"""What a snapshot holds: the agent's summary of cells and variables
(kernel_wrapper.inkernel.contents), in process and through a real server, kernel and CRIU;
its short form, comparison and CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from jupyter_ext.core.contents import CellLog, compare_contents, short_contents
from jupyter_ext.core.manifest import Manifest
from kernel_wrapper.inkernel.contents import summarize_namespace

from .support.jupyter_api import Fetch, call, manager_of, server_config, snapshot, until

# ---------------------------------------------------------------- user code is never run

TRAP_CODE = '''
calls = []


class TrapMeta(type):
    """A metaclass whose comparison, hash and instance checks are user code too."""

    def __eq__(cls, other):
        calls.append("meta __eq__")
        raise RuntimeError("meta __eq__ ran")

    def __hash__(cls):
        calls.append("meta __hash__")
        raise RuntimeError("meta __hash__ ran")

    def __instancecheck__(cls, obj):
        calls.append("meta __instancecheck__")
        raise RuntimeError("meta __instancecheck__ ran")


class Trap(metaclass=TrapMeta):
    """Every hook that a careless summary would call records itself and fails."""

    def __repr__(self):
        calls.append("__repr__")
        raise RuntimeError("__repr__ ran")

    def __len__(self):
        calls.append("__len__")
        raise RuntimeError("__len__ ran")

    def __sizeof__(self):
        calls.append("__sizeof__")
        raise RuntimeError("__sizeof__ ran")

    def __getattr__(self, name):
        calls.append(f"__getattr__ {name}")
        raise RuntimeError("__getattr__ ran")

    @property
    def __class__(self):
        calls.append("__class__")
        raise RuntimeError("__class__ ran")

    @property
    def shape(self):
        calls.append("shape")
        raise RuntimeError("shape ran")

    @property
    def nbytes(self):
        calls.append("nbytes")
        raise RuntimeError("nbytes ran")


class TrapList(list):
    def __len__(self):
        calls.append("TrapList.__len__")
        raise RuntimeError("__len__ ran")

    def __iter__(self):
        calls.append("TrapList.__iter__")
        raise RuntimeError("__iter__ ran")

    def __getitem__(self, index):
        calls.append("TrapList.__getitem__")
        raise RuntimeError("__getitem__ ran")

    def __sizeof__(self):
        calls.append("TrapList.__sizeof__")
        raise RuntimeError("__sizeof__ ran")


class TrapArray(np.ndarray):
    @property
    def shape(self):
        calls.append("TrapArray.shape")
        raise RuntimeError("shape ran")

    @property
    def nbytes(self):
        calls.append("TrapArray.nbytes")
        raise RuntimeError("nbytes ran")


trap = Trap()
trap_list = TrapList([1, 2, 3])
trap_array = np.zeros((10, 20)).view(TrapArray)
'''


def _trap_namespace() -> dict[str, Any]:
    namespace: dict[str, Any] = {"np": np}
    exec(TRAP_CODE, namespace)
    return namespace


def test_no_user_code_runs_while_a_namespace_is_summarised() -> None:
    namespace = _trap_namespace()
    namespace["matrix"] = np.ones((100, 50), dtype=np.float32)
    summary = summarize_namespace(namespace, units=10_000, seconds=3600)
    assert namespace["calls"] == []
    by_name = {v["name"]: v for v in summary["variables"]}
    assert by_name["trap"]["type"].endswith("Trap")
    assert by_name["trap"]["size"] > 0
    assert by_name["trap_list"] == {
        "name": "trap_list",
        "type": "TrapList",
        "length": 3,
        "size": by_name["trap_list"]["size"],
    }
    assert by_name["trap_array"]["shape"] == [10, 20]
    assert by_name["trap_array"]["size"] == 10 * 20 * 8
    assert by_name["matrix"] == {
        "name": "matrix",
        "type": "numpy.ndarray",
        "shape": [100, 50],
        "dtype": "float32",
        "size": 100 * 50 * 4,
    }
    # Classes, functions and modules are not data; "_"-names are IPython's or private.
    assert "Trap" not in by_name
    assert "np" not in by_name
    assert "TrapMeta" not in by_name
    assert summary["partial"] is False


def test_largest_variables_first_with_their_total() -> None:
    namespace: dict[str, Any] = {
        "small": 1,
        "text": "x" * 10_000,
        "big": np.zeros(10_000_000, dtype=np.uint8),
        "numbers": list(range(100_000)),
        "table": {i: str(i) for i in range(1000)},
        "_hidden": np.zeros(100_000_000, dtype=np.uint8),
        "In": ["ipython's"],
    }
    summary = summarize_namespace(namespace, {"In"}, seconds=3600)
    names = [v["name"] for v in summary["variables"]]
    assert names == ["big", "numbers", "table", "text", "small"]
    numbers = summary["variables"][1]
    assert numbers["length"] == 100_000
    assert numbers["estimated"] is True
    # The list's own 800 kB plus about 28 bytes per int.
    assert 3_000_000 < numbers["size"] < 4_000_000
    assert summary["variable_count"] == 5
    assert summary["variables_bytes"] == sum(v["size"] for v in summary["variables"])


def test_the_largest_fifty_of_many_in_any_order() -> None:
    import random

    rng = random.Random(7)
    sizes = rng.sample(range(1, 1_000_000), 5000)
    namespace = {f"b{i}": bytes(size) for i, size in enumerate(sizes)}
    summary = summarize_namespace(namespace, seconds=3600)
    wanted = sorted(namespace, key=lambda name: len(namespace[name]), reverse=True)[:50]
    assert [v["name"] for v in summary["variables"]] == wanted
    assert summary["variables_bytes"] == sum(sys.getsizeof(b) for b in namespace.values())


def test_frames_with_shape_and_size_and_nothing_imported() -> None:
    import pandas as pd

    frame = pd.DataFrame({"a": np.arange(1000, dtype=np.int64), "b": np.ones(1000)})
    series = pd.Series(np.arange(10, dtype=np.int32), name="s")
    before = set(sys.modules)
    summary = summarize_namespace({"frame": frame, "series": series}, seconds=3600)
    assert set(sys.modules) == before  # no framework is ever imported by the summary
    by_name = {v["name"]: v for v in summary["variables"]}
    assert by_name["frame"]["type"] == "pandas.DataFrame"
    assert by_name["frame"]["shape"] == [1000, 2]
    assert by_name["frame"]["size"] == int(frame.memory_usage(index=True, deep=False).sum())
    assert by_name["series"]["shape"] == [10]
    assert by_name["series"]["dtype"] == "int32"


def test_a_kernel_without_frameworks_gets_none_imported() -> None:
    code = (
        "import sys\n"
        "from kernel_wrapper.inkernel.contents import summarize_namespace\n"
        "summarize_namespace({'a': [1, 2], 'b': 'text'})\n"
        "print(sorted(m for m in ('numpy', 'pandas', 'polars', 'torch', 'cupy', 'jax') "
        "if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_namespace_past_the_budget_is_summarised_partially() -> None:
    """100 000 variables against a budget of 10 000 units: the work stops at the budget
    (counted, not timed), and the summary says it is partial and why."""
    namespace = {f"v{i}": float(i) for i in range(100_000)}
    summary = summarize_namespace(namespace, units=10_000, seconds=3600)
    assert summary["partial"] is True
    assert "budget" in summary["partial_reason"]
    assert summary["examined"] <= 10_000
    assert summary["budget_spent"] <= 10_001
    assert len(summary["variables"]) == 50
    # With the default budget the same namespace is summarised whole.
    whole = summarize_namespace(namespace, seconds=3600)
    assert whole["partial"] is False
    assert whole["variable_count"] == 100_000


def test_container_sampling_is_bounded_by_the_budget() -> None:
    """A large list costs its sample, not its length."""
    namespace = {"huge": list(range(5_000_000))}
    summary = summarize_namespace(namespace, units=100, seconds=3600)
    assert summary["partial"] is False
    assert summary["budget_spent"] <= 1 + 16


def test_cells_since_a_snapshot_and_the_running_one() -> None:
    class Info:
        def __init__(self, code: str) -> None:
            self.raw_cell = code

    class Result:
        def __init__(self, count: int) -> None:
            self.execution_count = count
            self.success = True

    log = CellLog()
    log.pre_run_cell(Info("a = 1\nb = 2"))
    log.post_run_cell(Result(1))
    log.pre_run_cell(Info("x" * 5000))
    log.post_run_cell(Result(2))
    log.pre_run_cell(Info("train()"))
    first = log.since(0, execution_count=3)
    assert [c["execution_count"] for c in first["cells"]] == [1, 2, 3]
    assert first["cells"][1]["trimmed"] is True
    assert len(first["cells"][1]["code"]) == 2000
    assert first["cells"][2]["running"] is True
    assert first["running_cell"] is True
    assert first["cells_through"] == 2
    log.post_run_cell(Result(3))
    second = log.since(first["cells_through"])
    assert [c["code"] for c in second["cells"]] == ["train()"]
    assert "running" not in second["cells"][0]
    assert second["running_cell"] is False


def test_short_form_and_comparison() -> None:
    older = {
        "cells": [{"code": "\nimport numpy", "execution_count": 1, "seconds": 0.1}],
        "variables": [
            {"name": "df", "type": "pandas.DataFrame", "size": 100},
            {"name": "gone", "type": "int", "size": 28},
        ],
        "variable_count": 2,
        "variables_bytes": 128,
    }
    newer = {
        "cells": [{"code": "df = df.head(2)\nnew = 1", "execution_count": 2, "seconds": 61}],
        "variables": [
            {"name": "df", "type": "pandas.DataFrame", "size": 20},
            {"name": "new", "type": "int", "size": 28},
        ],
        "partial": True,
        "partial_reason": "the namespace was not summarised within 50 ms",
    }
    short = short_contents(older)
    assert short["cells"] == [{"execution_count": 1, "first_line": "import numpy", "seconds": 0.1}]
    assert short["variable_names"] == ["df", "gone"]
    assert short_contents({}) == {}
    diff = compare_contents(older, newer)
    assert [v["name"] for v in diff["added"]] == ["new"]
    assert [v["name"] for v in diff["removed"]] == ["gone"]
    assert diff["changed"][0]["name"] == "df"
    assert diff["changed"][0]["fields"] == ["size"]
    assert diff["cells"] == newer["cells"]
    assert diff["partial"] is True


def test_manifests_without_contents_are_still_read(tmp_path: Path) -> None:
    manifest = Manifest(
        id="0" * 32, lineage="l", sequence=1, created="2026-12-01T00:00:00Z", trigger="manual",
        runtime_dir="/r", runtime_dir_key="k", stdio_pipe="pipe:[1]",
    )  # fmt: skip
    data = manifest.to_dict()
    del data["contents"]
    from jupyter_ext.core.manifest import manifest_checksum

    data["checksum"] = manifest_checksum(data)
    assert Manifest.from_dict(data).contents == {}


# ---------------------------------------------------------------- through a real kernel


def _cli(store: Path, *args: str) -> str:
    """``jupyter snapshot ARGS`` on a store directory; its output."""
    done = subprocess.run(
        [sys.executable, "-m", "jupyter_ext.cli", *args, f"--store-dir={store}"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def jp_server_config(tmp_path: Path) -> dict[str, Any]:
    return server_config(tmp_path)


@pytest.mark.usefixtures("criu", "snapshot_kernelspec")
async def test_snapshots_record_cells_and_variables(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any
) -> None:
    kernel = await start_kernel()
    await kernel.run(TRAP_CODE.replace("class TrapArray", "import numpy as np\nclass TrapArray"))
    await kernel.run("import numpy as np\nweights = np.ones((256, 1024), dtype=np.float64)")
    first = await snapshot(jp_fetch, kernel.id)
    assert first["status"] == "done", first
    full = await call(jp_fetch, "GET", first["result"]["id"])
    contents = full["contents"]
    assert contents["partial"] is False, contents
    codes = [c["code"] for c in contents["cells"]]
    assert codes[-1].startswith("import numpy as np\nweights")
    assert [c["execution_count"] for c in contents["cells"]] == [1, 2]
    assert all(c["seconds"] >= 0 and c["started"] > 0 for c in contents["cells"])
    weights = contents["variables"][0]
    assert weights == {
        "name": "weights",
        "type": "numpy.ndarray",
        "shape": [256, 1024],
        "dtype": "float64",
        "size": 256 * 1024 * 8,
    }
    assert {"trap", "trap_list", "trap_array"} <= {v["name"] for v in contents["variables"]}
    # The kernel's traps never fired: the summary ran none of their code.
    assert (await kernel.run("print(calls)")).strip() == "[]"

    await kernel.run("del weights\nresult = list(range(1000))")
    second = await snapshot(jp_fetch, kernel.id)
    listed = (await call(jp_fetch, "GET"))["snapshots"]
    short = next(s for s in listed if s["id"] == second["result"]["id"])["contents"]
    # Only the cells since the first snapshot (print(calls) and this one).
    assert [c["first_line"] for c in short["cells"]] == ["print(calls)", "del weights"]
    assert "weights" not in short["variable_names"]
    assert "result" in short["variable_names"]
    assert len(short["variables"]) <= 5

    # The CLI shows and compares the same records, straight from the store.
    store = manager_of(jp_serverapp).store.root  # type: ignore[attr-defined]
    shown = _cli(store, "show", first["result"]["id"])
    assert "weights" in shown
    assert "numpy.ndarray" in shown
    assert "256x1024" in shown
    diff = json.loads(_cli(store, "show", first["result"]["id"], second["result"]["id"], "--json"))
    assert [v["name"] for v in diff["removed"]] == ["weights"]
    listing = _cli(store, "list")
    assert "[4] del weights" in listing
    assert "result" in listing.split("[4] del weights")[1].splitlines()[0]
    assert "result" in [v["name"] for v in diff["added"]]


@pytest.mark.usefixtures("criu", "snapshot_kernelspec")
async def test_a_running_cell_is_recorded_and_a_failed_summary_still_snapshots(
    jp_fetch: Fetch, start_kernel: Any, tmp_path: Path
) -> None:
    kernel = await start_kernel()
    flag = tmp_path / "go"
    await kernel.run(f"import os, time\nflag = {str(flag)!r}")
    # A cell that runs until the test lets it go: the snapshot is taken while it runs.
    kernel.client.execute("while not os.path.exists(flag): time.sleep(0.05)\nafter = 1")
    status: dict[str, Any] = {}

    async def running() -> bool:
        status.update(await call(jp_fetch, "GET", "kernels", kernel.id))
        return status.get("execution_state") == "busy"

    await until(running)
    taken = await snapshot(jp_fetch, kernel.id)
    contents = (await call(jp_fetch, "GET", taken["result"]["id"]))["contents"]
    assert contents["running_cell"] is True
    assert contents["cells"][-1]["running"] is True
    assert contents["cells"][-1]["code"].startswith("while not os.path.exists(flag)")
    assert contents["cells"][-1]["execution_count"] == 2
    assert contents["cells_through"] == 1  # the next snapshot lists it again, done

    # A summary that fails in the kernel: the snapshot is still taken, marked partial.
    flag.touch()
    await until(_idle(jp_fetch, kernel.id))
    await kernel.run(
        "import threading\n"
        "agent = next(t for t in threading.enumerate() if t.name == 'snapshot-agent')\n"
        "def broken(request):\n"
        "    raise RuntimeError('summary broke')\n"
        "agent.operations['summary'] = broken"
    )
    second = await snapshot(jp_fetch, kernel.id)
    assert second["status"] == "done", second
    contents = (await call(jp_fetch, "GET", second["result"]["id"]))["contents"]
    assert contents["partial"] is True
    assert "RuntimeError: summary broke" in contents["partial_reason"]


def _idle(jp_fetch: Fetch, kernel_id: str) -> Any:
    async def idle() -> bool:
        status = await call(jp_fetch, "GET", "kernels", kernel_id)
        return bool(status.get("execution_state") == "idle")

    return idle
