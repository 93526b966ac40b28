"""A restore into a new kernel for a notebook leaves nothing running behind: the kernel the
notebook had (often an empty one jupyter_server restarted after the old one was killed) is
shut down unless another notebook uses it; a killed wrapper's runtime directory goes too."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from tornado.httpclient import HTTPClientError

from jupyter_ext.core import proctree

from .support.jupyter_api import Fetch, call, restore, server_config, snapshot, until

pytestmark = pytest.mark.usefixtures("criu", "snapshot_kernelspec")


@pytest.fixture
def jp_server_config(tmp_path: Path) -> dict[str, Any]:
    return server_config(tmp_path)


async def _session(jp_fetch: Fetch, path: str, kernel: dict[str, str]) -> dict[str, Any]:
    body = {"path": path, "type": "notebook", "kernel": kernel}
    response = await jp_fetch("api", "sessions", method="POST", body=json.dumps(body))
    session: dict[str, Any] = json.loads(response.body)
    return session


async def test_restore_into_a_notebook_shuts_its_replaced_kernel_down(
    jp_fetch: Fetch,
    start_kernel: Any,
    jp_serverapp: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("JUPYTER_SNAPSHOT_RUNTIME_DIR", str(tmp_path / "runtime"))
    km = jp_serverapp.kernel_manager
    old_id = (await _session(jp_fetch, "a.ipynb", {"name": "python3-snapshot"}))["kernel"]["id"]
    old = await start_kernel(old_id)
    await old.run("value = 'kept'")
    snapshot_id = (await snapshot(jp_fetch, old_id))["result"]["id"]
    await _session(jp_fetch, "b.ipynb", {"id": old_id})  # b.ipynb shares the kernel

    # a.ipynb gets a restored kernel; b.ipynb still uses the old one: it keeps running.
    job = await restore(jp_fetch, snapshot_id, path="a.ipynb")
    assert job["status"] == "done", job
    new_a = job["result"]["kernel_id"]
    assert old_id in km.list_kernel_ids()

    # The old kernel is killed: jupyter_server restarts an empty one under its id, whose
    # wrapper removes the dead wrapper's runtime directory.
    before = await call(jp_fetch, "GET", "kernels", old_id)
    for pid in (before["wrapper_pid"], before["inner_pid"]):
        os.kill(pid, signal.SIGKILL)

    async def restarted() -> bool:
        try:
            now = await call(jp_fetch, "GET", "kernels", old_id)
        except HTTPClientError:
            return False
        return now.get("state") == "running" and now["wrapper_pid"] != before["wrapper_pid"]

    await until(restarted, timeout=120)
    empty = await call(jp_fetch, "GET", "kernels", old_id)
    assert not Path(before["runtime_dir"]).exists()
    assert Path(empty["runtime_dir"]).is_dir()

    # b.ipynb gets a restored kernel too: nothing uses the restarted one, it is shut down.
    job = await restore(jp_fetch, snapshot_id, path="b.ipynb")
    assert job["status"] == "done", job
    new_b = job["result"]["kernel_id"]
    assert old_id not in km.list_kernel_ids()
    assert sorted(km.list_kernel_ids()) == sorted([new_a, new_b])

    async def gone() -> bool:
        return (
            not proctree.is_alive(empty["wrapper_pid"]) and not Path(empty["runtime_dir"]).exists()
        )

    await until(gone, timeout=30)
    sessions = json.loads((await jp_fetch("api", "sessions")).body)
    assert {s["path"]: s["kernel"]["id"] for s in sessions} == {
        "a.ipynb": new_a,
        "b.ipynb": new_b,
    }
    restored = await start_kernel(new_b)
    assert (await restored.run("print(value)")).strip() == "kept"
