"""Variables taken back from a snapshot into a running kernel (jupyter_ext.variables), with
a real server, real kernels and real CRIU: the snapshot comes back as a side kernel, the
variables are pickled there and loaded into the target; failures leave the target as it was."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from .support.jupyter_api import (
    Fetch,
    call,
    damage_chunk,
    error_of,
    manager_of,
    server_config,
    snapshot,
    until,
    wait_job,
)

pytestmark = pytest.mark.usefixtures("criu", "snapshot_kernelspec")


@pytest.fixture
def jp_server_config(tmp_path: Path) -> dict[str, Any]:
    return server_config(tmp_path)


async def take(jp_fetch: Fetch, snapshot_id: str, **body: Any) -> dict[str, Any]:
    """Take variables back, replacing those the kernel has (unless ``overwrite`` says)."""
    body.setdefault("overwrite", True)
    started = await call(jp_fetch, "POST", snapshot_id, "variables", body=body)
    return await wait_job(jp_fetch, started["job"])


async def test_a_variable_the_kernel_has_is_replaced_only_when_asked(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any
) -> None:
    kernel = await start_kernel()
    await kernel.run("x = 42\ny = 1")
    taken = await snapshot(jp_fetch, kernel.id)
    await kernel.run("x = 'new work'")
    code, error = await error_of(
        jp_fetch, "POST", taken["result"]["id"], "variables",
        body={"kernel_id": kernel.id, "names": ["x", "y"], "rename": {"y": "y_back"}},
    )  # fmt: skip
    assert code == 409
    assert error["code"] == "variables-exist"
    assert error["message"].startswith("The kernel already has x:")
    assert "overwrite" in error["hint"]
    assert (await kernel.run("print(x, 'y_back' in globals())")).strip() == "new work False"
    assert list(jp_serverapp.kernel_manager.list_kernel_ids()) == [kernel.id]

    job = await take(
        jp_fetch, taken["result"]["id"], kernel_id=kernel.id, names=["y"],
        rename={"y": "y_back"}, overwrite=False,
    )  # fmt: skip
    assert job["status"] == "done", job
    job = await take(jp_fetch, taken["result"]["id"], kernel_id=kernel.id, names=["x"])
    assert job["status"] == "done", job
    assert (await kernel.run("print(x, y_back)")).strip() == "42 1"


async def test_variables_come_back_into_the_running_kernel(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any
) -> None:
    kernel = await start_kernel()
    await kernel.run(
        "import numpy as np\n"
        "arr = np.arange(1_000_000, dtype=np.float64)\n"
        "table = {'a': [1, 2], 'b': 'text'}\n"
        "square = lambda x: x * x\n"  # plain pickle refuses a lambda: cloudpickle takes it
    )
    taken = await snapshot(jp_fetch, kernel.id)
    await kernel.run("arr = None\ntable = 'overwritten'\nkept = 7")

    job = await take(
        jp_fetch,
        taken["result"]["id"],
        kernel_id=kernel.id,
        names=["arr", "table", "square"],
        rename={"table": "table_before"},
    )
    assert job["status"] == "done", job
    assert job["kind"] == "variables"
    how = {v["name"]: v["how"] for v in job["result"]["variables"]}
    assert how == {"arr": "pickle", "table": "pickle", "square": "cloudpickle"}
    out = await kernel.run("print(arr.sum(), table_before, table, square(9), kept)")
    assert out.split() == ["499999500000.0", "{'a':", "[1,", "2],", "'b':", "'text'}",
                           "overwritten", "81", "7"]  # fmt: skip
    # The side kernel is gone; the target is the only kernel, attached to nothing new.
    assert list(jp_serverapp.kernel_manager.list_kernel_ids()) == [kernel.id]
    assert await jp_serverapp.session_manager.list_sessions() == []
    assert not list((Path(manager_of(jp_serverapp).work_dir) / "variables").iterdir())


async def test_an_unpicklable_variable_is_named_and_the_target_untouched(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any
) -> None:
    kernel = await start_kernel()
    await kernel.run("numbers = (i for i in range(3))\nfine = 1")
    taken = await snapshot(jp_fetch, kernel.id)
    await kernel.run("fine = 5")
    job = await take(
        jp_fetch, taken["result"]["id"], kernel_id=kernel.id, names=["fine", "numbers"]
    )
    assert job["status"] == "failed"
    assert job["error"]["code"] == "variable-not-transferable"
    message = job["error"]["message"]
    assert "numbers: pickle: TypeError: cannot pickle 'generator' object" in message
    assert "fine" not in message.split("snapshot")[1]  # only the failing one is named
    assert "Nothing was loaded" in message
    assert (await kernel.run("print(fine)")).strip() == "5"
    assert list(jp_serverapp.kernel_manager.list_kernel_ids()) == [kernel.id]

    missing = await take(jp_fetch, taken["result"]["id"], kernel_id=kernel.id, names=["nothere"])
    assert (
        "nothere: the snapshot's kernel has no variable of that name"
        in (missing["error"]["message"])
    )


async def test_a_busy_target_is_refused(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any
) -> None:
    kernel = await start_kernel()
    await kernel.run("x = 1")
    taken = await snapshot(jp_fetch, kernel.id)
    kernel.client.execute("import time\nwhile True: time.sleep(0.1)")
    km = jp_serverapp.kernel_manager.get_kernel(kernel.id)

    async def busy() -> bool:
        return bool(km.execution_state == "busy")

    await until(busy)
    code, error = await error_of(
        jp_fetch, "POST", taken["result"]["id"], "variables",
        body={"kernel_id": kernel.id, "names": ["x"], "overwrite": True},
    )  # fmt: skip
    assert code == 409
    assert error["code"] == "kernel-busy"
    assert "running a cell" in error["message"]
    assert "interrupt" in error["hint"]
    await km.interrupt_kernel()

    async def idle() -> bool:
        return bool(km.execution_state == "idle")

    await until(idle)
    # The server's own execution_state follows an iopub subscription of its own, which may
    # get a status after a client did: it does not decide, the kernel's wrapper does.
    km.execution_state = "busy"
    job = await take(jp_fetch, taken["result"]["id"], kernel_id=kernel.id, names=["x"])
    assert job["status"] == "done", job


async def test_a_corrupt_snapshot_fails_before_any_kernel_is_touched(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any
) -> None:
    kernel = await start_kernel()
    await kernel.run("x = 1")
    taken = await snapshot(jp_fetch, kernel.id)
    damage_chunk(manager_of(jp_serverapp), taken["result"]["id"], "images/pages-")
    await kernel.run("x = 2")
    job = await take(jp_fetch, taken["result"]["id"], kernel_id=kernel.id, names=["x"])
    assert job["status"] == "failed"
    assert job["error"]["code"] == "snapshot-corrupt"
    assert (await kernel.run("print(x)")).strip() == "2"
    assert list(jp_serverapp.kernel_manager.list_kernel_ids()) == [kernel.id]


@pytest.mark.parametrize(
    ("body", "wanted"),
    [
        ({"names": ["x"]}, "kernel_id"),
        ({"kernel_id": "k", "names": []}, "names must be a list"),
        ({"kernel_id": "k", "names": ["not a name"]}, "is not a Python variable name"),
        ({"kernel_id": "k", "names": ["x"], "rename": {"x": "class"}}, "'class' is not"),
        ({"kernel_id": "k", "names": ["x", "y"], "rename": {"x": "y"}}, "same name"),
    ],
)
async def test_bad_requests_say_what_to_send(
    jp_fetch: Fetch, body: dict[str, Any], wanted: str
) -> None:
    code, error = await error_of(jp_fetch, "POST", "0" * 32, "variables", body=body)
    assert code == 400
    assert wanted in error["message"]
    assert "names" in error["hint"]


async def test_unknown_snapshot_or_kernel_is_404(jp_fetch: Fetch, start_kernel: Any) -> None:
    kernel = await start_kernel()
    code, _ = await error_of(
        jp_fetch, "POST", "0" * 32, "variables", body={"kernel_id": kernel.id, "names": ["x"]}
    )
    assert code == 404
    code, _ = await error_of(
        jp_fetch, "POST", "0" * 32, "variables",
        body={"kernel_id": "00000000-0000-0000-0000-000000000000", "names": ["x"]},
    )  # fmt: skip
    assert code == 404


async def test_the_cli_takes_variables(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any
) -> None:
    import sys

    kernel = await start_kernel()
    await kernel.run("model = {'epoch': 30}")
    taken = await snapshot(jp_fetch, kernel.id)
    await kernel.run("model = {'epoch': 31}")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "jupyter_ext.cli", "take", taken["result"]["id"],
        "model=model_epoch30", f"--kernel-id={kernel.id}", "--overwrite",
        f"--url={jp_serverapp.connection_url}", f"--token={jp_serverapp.identity_provider.token}",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    assert out.decode().startswith("model as model_epoch30: ")
    assert (await kernel.run("print(model_epoch30, model)")).strip() == (
        "{'epoch': 30} {'epoch': 31}"
    )


async def test_a_snapshot_taken_during_a_cell_gives_its_variables(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any, tmp_path: Path
) -> None:
    """The side kernel resumes the cell that was running at the snapshot (here one that
    would wait forever): it is interrupted, and the variables are taken."""
    kernel = await start_kernel()
    await kernel.run(f"import os, time\nflag = {str(tmp_path / 'never')!r}\nready = 'yes'")
    kernel.client.execute("while not os.path.exists(flag): time.sleep(0.05)")
    km = jp_serverapp.kernel_manager.get_kernel(kernel.id)

    async def busy() -> bool:
        return bool(km.execution_state == "busy")

    await until(busy)
    taken = await snapshot(jp_fetch, kernel.id)
    assert taken["result"]["running_request"] is not None
    (tmp_path / "never").touch()  # the kernel itself finishes its cell

    async def idle() -> bool:
        return bool(km.execution_state == "idle")

    await until(idle)
    (tmp_path / "never").unlink()  # in the side kernel, the cell would wait forever
    await kernel.run("ready = 'overwritten'")
    job = await take(
        jp_fetch, taken["result"]["id"], kernel_id=kernel.id, names=["ready"],
        rename={"ready": "ready_then"},
    )  # fmt: skip
    assert job["status"] == "done", job
    assert (await kernel.run("print(ready_then, ready)")).strip() == "yes overwritten"
    assert list(jp_serverapp.kernel_manager.list_kernel_ids()) == [kernel.id]


async def test_a_variable_whose_gpu_the_target_lacks_is_named_with_the_way_out(
    jp_fetch: Fetch, start_kernel: Any
) -> None:
    """A GPU tensor taken into a kernel without that GPU: its unpickling raises the
    framework's error (here PyTorch's own words, raised by the object's pickle recipe,
    since no GPU is needed to take that path), the job names the variable and says where
    it can go, and the target is untouched."""
    kernel = await start_kernel()
    await kernel.run(
        "class OnDevice:\n"
        "    def __reduce__(self):\n"
        '        return (eval, ("(_ for _ in ()).throw(RuntimeError(\'Attempting to "\n'
        '                       "deserialize object on a CUDA device but "\n'
        '                       "torch.cuda.is_available() is False\'))",))\n'
        "weights = OnDevice()\n"
        "other = 1\n"
    )
    taken = await snapshot(jp_fetch, kernel.id)
    await kernel.run("other = 2")
    job = await take(
        jp_fetch, taken["result"]["id"], kernel_id=kernel.id, names=["weights", "other"]
    )
    assert job["status"] == "failed", job
    assert "Variable 'weights' could not be loaded" in job["error"]["message"]
    assert "CUDA device" in job["error"]["message"]
    assert "lives on a GPU that kernel" in job["error"]["hint"]
    assert (await kernel.run("print(other)")).strip() == "2"


@pytest.mark.gpu
async def test_a_gpu_tensor_comes_back_on_the_targets_gpu(
    jp_fetch: Fetch, start_kernel: Any
) -> None:
    if not Path("/dev/nvidiactl").exists():
        pytest.skip("no NVIDIA GPU here: /dev/nvidiactl does not exist")
    pytest.importorskip("torch", reason="PyTorch is not installed in this environment")
    kernel = await start_kernel()
    await kernel.run("import torch\nt = torch.arange(6, device='cuda').reshape(2, 3)")
    taken = await snapshot(jp_fetch, kernel.id)
    await kernel.run("del t")
    job = await take(jp_fetch, taken["result"]["id"], kernel_id=kernel.id, names=["t"])
    assert job["status"] == "done", job
    out = await kernel.run("print(t.device.type, t.sum().item())")
    assert out.split() == ["cuda", "15"]
