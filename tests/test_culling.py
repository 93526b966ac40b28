"""Every way a kernel ends keeps its state (issue 34): jupyter_server's own kernel culler,
run for real at short timeouts, suspends an idle snapshot kernel instead of shutting it
down; the kernel stays listed with its session, an open tab's next cell (on the same
websocket) or the notebook opened again brings it back with its state. A shutdown the
user asks for still shuts down, and leaves no dump behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from jupyter_ext.core.leftovers import DumpLock
from jupyter_ext.testing import ws_close

from .jupyter_api import Fetch, call, events_of, manager_of, server_config, until
from .servers import ws_run

pytestmark = pytest.mark.usefixtures("criu", "snapshot_kernelspec", "running_extensions")

#: jupyter_server's culler at short timeouts: idle for 3 s, looked at every second. The
#: server starts with a long timeout (the culler runs from the first kernel on), made
#: short once a kernel ran its first cell: a kernel still starting on a loaded machine
#: would be culled before it has anything to keep.
CULL_IDLE_TIMEOUT = 3
CULL_INTERVAL = 1
STATE = "import numpy as np; x = 42; big = np.ones(50 << 17); print('set')"
CHECK = "print(x, big.sum() == 50 << 17)"


def culling_config(tmp_path: Path, *, connected: bool, action: str = "suspend") -> dict[str, Any]:
    config = server_config(tmp_path, cull_action=action)
    config["MappingKernelManager"] = {
        "cull_idle_timeout": 3600,
        "cull_interval": CULL_INTERVAL,
        "cull_connected": connected,
    }
    return config


def leftovers(tmp_path: Path) -> list[str]:
    """What suspends left in the work directory: dumps, partial dumps, locks."""
    work = tmp_path / "work"
    return sorted(
        str(entry.relative_to(work))
        for folder in (work / "suspended", work / "staging")
        if folder.is_dir()
        for entry in folder.iterdir()
    )


def cull_soon(jp_serverapp: Any, seconds: int = CULL_IDLE_TIMEOUT) -> None:
    """From now on the culler takes kernels idle for ``seconds``."""
    jp_serverapp.kernel_manager.cull_idle_timeout = seconds


async def no_job_on(jp_serverapp: Any, kernel_id: str) -> None:
    """Wait until no job runs on the kernel (a suspend's upload is over)."""
    manager = manager_of(jp_serverapp)

    async def idle() -> bool:
        return not manager.jobs.has_job(kernel_id)

    await until(idle, timeout=120)


async def run_in_new_tab(jp_ws_fetch: Any, kernel_id: str, code: str) -> str:
    """Run a cell through a websocket of its own, closed after it (a tab opened, closed)."""
    ws = await jp_ws_fetch("api", "kernels", kernel_id, "channels")
    try:
        return (await ws_run(ws, code)).strip()
    finally:
        await ws_close(ws)


async def open_notebook(jp_fetch: Fetch, path: str) -> dict[str, Any]:
    """A notebook's session with a new snapshot kernel, as JupyterLab makes it."""
    body = {"path": path, "name": path, "type": "notebook", "kernel": {"name": "python3-snapshot"}}
    response = await jp_fetch("api", "sessions", method="POST", body=json.dumps(body))
    session: dict[str, Any] = json.loads(response.body)
    return session


async def listed(jp_fetch: Fetch, what: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = json.loads((await jp_fetch("api", what)).body)
    return items


async def state(jp_fetch: Fetch, kernel_id: str) -> str:
    return str((await call(jp_fetch, "GET", "kernels", kernel_id)).get("state"))


async def culled_into_suspend(jp_fetch: Fetch, kernel_id: str) -> dict[str, Any]:
    """Wait until the culler suspended the kernel; then let it look again, more than once:
    the suspended kernel stays (it is not culled into loss)."""

    async def suspended() -> bool:
        return await state(jp_fetch, kernel_id) == "suspended"

    await until(suspended, timeout=120)
    await asyncio.sleep(3 * CULL_INTERVAL + 0.5)  # three more passes of the culler
    assert await state(jp_fetch, kernel_id) == "suspended"
    assert kernel_id in [k["id"] for k in await listed(jp_fetch, "kernels")]
    [snapshot] = (await call(jp_fetch, "GET", trigger="cull"))["snapshots"]
    assert snapshot["kernel_id"] == kernel_id
    return snapshot


class TestTabOpen:
    """``cull_connected = True``: the culler takes kernels whose notebook is open."""

    @pytest.fixture
    def jp_server_config(self, tmp_path: Path) -> dict[str, Any]:
        return culling_config(tmp_path, connected=True)

    async def test_the_next_cell_on_the_open_websocket_runs_with_its_output(
        self, jp_fetch: Fetch, jp_ws_fetch: Any, jp_serverapp: Any, tmp_path: Path
    ) -> None:
        session = await open_notebook(jp_fetch, "open.ipynb")
        kernel_id = session["kernel"]["id"]
        ws = await jp_ws_fetch("api", "kernels", kernel_id, "channels")
        try:
            assert (await ws_run(ws, STATE)).strip() == "set"
            cull_soon(jp_serverapp)
            inner = (await call(jp_fetch, "GET", "kernels", kernel_id))["inner_pid"]
            await culled_into_suspend(jp_fetch, kernel_id)
            assert not Path(f"/proc/{inner}").exists()  # its memory is freed
            assert [s["id"] for s in await listed(jp_fetch, "sessions")] == [session["id"]]
            assert len(leftovers(tmp_path)) == 1  # the suspended kernel's dump
            # The same websocket, as the open tab has it: the cell runs, with its output.
            assert (await ws_run(ws, CHECK)).strip() == "42 True"
        finally:
            await ws_close(ws)
        cull_soon(jp_serverapp, 3600)
        await no_job_on(jp_serverapp, kernel_id)
        # The user shuts the notebook's kernel down: it ends (suspended again by now, or
        # not), and leaves nothing behind.
        await jp_fetch("api", "sessions", session["id"], method="DELETE")
        assert await listed(jp_fetch, "kernels") == []
        assert leftovers(tmp_path) == []

    async def test_a_shutdown_the_user_asks_for_just_shuts_down(
        self, jp_fetch: Fetch, jp_ws_fetch: Any, jp_serverapp: Any, tmp_path: Path
    ) -> None:
        session = await open_notebook(jp_fetch, "asked.ipynb")
        kernel_id = session["kernel"]["id"]
        assert await run_in_new_tab(jp_ws_fetch, kernel_id, STATE) == "set"
        cull_soon(jp_serverapp)  # the culler runs, but this shutdown is the user's
        events = events_of(jp_serverapp)
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")
        assert kernel_id not in jp_serverapp.kernel_manager
        assert (await call(jp_fetch, "GET"))["snapshots"] == []
        assert [e["action"] for e in events] == []  # no suspend, no snapshot
        assert leftovers(tmp_path) == []


class TestTabClosed:
    """``cull_connected = False`` (jupyter_server's default): the notebook was closed."""

    @pytest.fixture
    def jp_server_config(self, tmp_path: Path) -> dict[str, Any]:
        return culling_config(tmp_path, connected=False)

    async def test_the_notebook_opened_again_has_its_state(
        self, jp_fetch: Fetch, jp_ws_fetch: Any, jp_serverapp: Any, tmp_path: Path
    ) -> None:
        session = await open_notebook(jp_fetch, "closed.ipynb")
        kernel_id = session["kernel"]["id"]
        # The tab is closed after the cell, its kernel left running.
        assert await run_in_new_tab(jp_ws_fetch, kernel_id, STATE) == "set"
        cull_soon(jp_serverapp)
        await culled_into_suspend(jp_fetch, kernel_id)
        [kept] = await listed(jp_fetch, "sessions")
        assert kept["id"] == session["id"]
        assert kept["kernel"]["id"] == kernel_id
        # Opened again: JupyterLab connects to the session's kernel.
        assert await run_in_new_tab(jp_ws_fetch, kernel_id, CHECK) == "42 True"

        # Culled again once idle, then shut down by the user while suspended.
        async def suspended() -> bool:
            return await state(jp_fetch, kernel_id) == "suspended"

        await until(suspended, timeout=120)
        await no_job_on(jp_serverapp, kernel_id)
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")
        assert await listed(jp_fetch, "sessions") == []
        assert leftovers(tmp_path) == []

    async def test_a_dump_no_kernel_holds_goes_when_the_server_starts(
        self, jp_fetch: Fetch, jp_ws_fetch: Any, jp_serverapp: Any, tmp_path: Path
    ) -> None:
        """The suspended kernel's wrapper holds its dump; one that was killed (or a server
        that died with its kernels) leaves it unheld: a server start removes it."""
        manager = manager_of(jp_serverapp)
        kernel_id = (await open_notebook(jp_fetch, "killed.ipynb"))["kernel"]["id"]
        assert await run_in_new_tab(jp_ws_fetch, kernel_id, STATE) == "set"
        cull_soon(jp_serverapp)
        await culled_into_suspend(jp_fetch, kernel_id)
        cull_soon(jp_serverapp, 3600)  # the kernel restarted below is not culled
        [dump] = leftovers(tmp_path)
        manager.uploads.recover_staged()  # what a server start does: the held dump stays
        assert leftovers(tmp_path) == [dump]
        # A dump being written (its server's DumpLock held) is not removed either.
        writing = tmp_path / "work" / "suspended" / ("0" * 32)
        writing.mkdir()
        lock = DumpLock(writing)
        manager.uploads.recover_staged()
        assert writing.is_dir()
        lock.release()
        wrapper = (await call(jp_fetch, "GET", "kernels", kernel_id))["wrapper_pid"]
        os.kill(wrapper, signal.SIGKILL)

        async def gone() -> bool:
            return not Path(f"/proc/{wrapper}").exists()

        await until(gone)
        manager.uploads.recover_staged()
        assert leftovers(tmp_path) == []


class TestCullShutsDown:
    """``cull_action = "shutdown"``: jupyter_server's own behaviour, the state lost."""

    @pytest.fixture
    def jp_server_config(self, tmp_path: Path) -> dict[str, Any]:
        return culling_config(tmp_path, connected=True, action="shutdown")

    async def test_the_culled_kernel_is_shut_down(
        self, jp_fetch: Fetch, jp_ws_fetch: Any, jp_serverapp: Any, tmp_path: Path
    ) -> None:
        kernel_id = (await open_notebook(jp_fetch, "gone.ipynb"))["kernel"]["id"]
        assert await run_in_new_tab(jp_ws_fetch, kernel_id, STATE) == "set"
        km = jp_serverapp.kernel_manager
        cull_soon(jp_serverapp)

        async def culled() -> bool:
            return kernel_id not in km

        await until(culled, timeout=120)
        assert await listed(jp_fetch, "sessions") == []
        assert (await call(jp_fetch, "GET"))["snapshots"] == []
        assert leftovers(tmp_path) == []
