"""Every way a kernel ends keeps its state (issue 34): jupyter_server's own kernel culler,
run for real at short timeouts, suspends an idle snapshot kernel instead of shutting it
down (a busy one is snapshotted, then shut down); the kernel stays listed with its
session, an open tab's next cell (on the same websocket) or the notebook opened again
brings it back with its state. So does a shutdown asked by someone other than the
server's owner, with admin_shutdown_action (the same on JupyterHub:
tests/test_jupyterhub.py). A shutdown the user asks for still shuts down, and no way a
kernel or its server ends leaves a dump behind. The decisions alone:
tests/test_policy_decisions.py."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from jupyter_server.auth.identity import IdentityProvider, User
from tornado.httpclient import HTTPClientError

from jupyter_ext.core.leftovers import DumpLock
from testkit.processes import ServerProcess, execute_request, ws_close

from .support.jupyter_api import Fetch, call, events_of, manager_of, server_config, until, wait_job
from .support.servers import follow, ws_execute, ws_run

pytestmark = pytest.mark.usefixtures("criu", "snapshot_kernelspec", "running_extensions")

#: jupyter_server's culler at short timeouts: idle for 3 s, looked at every second. The
#: server starts with a long timeout (the culler runs from the first kernel on), made
#: short once a kernel ran its first cell: a kernel still starting on a loaded machine
#: would be culled before it has anything to keep.
CULL_IDLE_TIMEOUT = 3
CULL_INTERVAL = 1
STATE = "import numpy as np; x = 42; big = np.ones(50 << 17); print('set')"
CHECK = "print(x, big.sum() == 50 << 17)"


def culling_config(
    tmp_path: Path, *, connected: bool, action: str = "suspend", busy: bool = False, **more: Any
) -> dict[str, Any]:
    config = server_config(tmp_path, cull_action=action, **more)
    config["MappingKernelManager"] = {
        "cull_idle_timeout": 3600,
        "cull_interval": CULL_INTERVAL,
        "cull_connected": connected,
        "cull_busy": busy,
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


async def cull_passes(jp_serverapp: Any, count: int = 3) -> None:
    """The culler's pass, ``count`` times now: what it does every CULL_INTERVAL, driven
    directly, so that "it looked and left the kernel" needs no sleep."""
    for _ in range(count):
        await jp_serverapp.kernel_manager.cull_kernels()


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


async def suspend(jp_fetch: Fetch, kernel_id: str) -> dict[str, Any]:
    """Suspend the kernel through the API (the panel's "Suspend now"); its snapshot."""
    job = await wait_job(
        jp_fetch, (await call(jp_fetch, "POST", "kernels", kernel_id, "suspend"))["job"]
    )
    assert job["status"] == "done", job
    assert await state(jp_fetch, kernel_id) == "suspended"
    result: dict[str, Any] = job["result"]
    return result


async def culled_away(jp_serverapp: Any, kernel_id: str) -> None:
    """Let the culler take kernels now, and wait until it has shut this one down and
    removed the dump it may have released (the kernel leaves jupyter_client's list first)."""
    km = jp_serverapp.kernel_manager
    culling = jp_serverapp.extension_manager.extension_points["jupyter_ext"].app.culling
    cull_soon(jp_serverapp)

    async def gone() -> bool:
        return kernel_id not in km and kernel_id not in culling.ending_now

    await until(gone, timeout=120)


async def culled_into_suspend(jp_fetch: Fetch, jp_serverapp: Any, kernel_id: str) -> dict[str, Any]:
    """Wait until the culler suspended the kernel; then let it look again, more than once:
    the suspended kernel stays (it is not culled into loss)."""

    async def suspended() -> bool:
        return await state(jp_fetch, kernel_id) == "suspended"

    await until(suspended, timeout=120)
    await no_job_on(jp_serverapp, kernel_id)  # the suspend's snapshot is stored
    await cull_passes(jp_serverapp)
    assert await state(jp_fetch, kernel_id) == "suspended"
    assert kernel_id in [k["id"] for k in await listed(jp_fetch, "kernels")]
    [snapshot] = (await call(jp_fetch, "GET", trigger="cull"))["snapshots"]
    assert snapshot["kernel_id"] == kernel_id
    return snapshot


class TestTabOpen:
    """``cull_connected = True``: the culler takes kernels whose notebook is open. Also
    ``admin_shutdown_action = "suspend"``, with jupyter_server's own token login: it tells
    nobody from the owner, so every shutdown through the API is the user's."""

    @pytest.fixture
    def jp_server_config(self, tmp_path: Path) -> dict[str, Any]:
        return culling_config(tmp_path, connected=True, admin_shutdown_action="suspend")

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
            await culled_into_suspend(jp_fetch, jp_serverapp, kernel_id)
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
        """The culler runs (every second, at a 3 s timeout), but this shutdown is the
        user's. The kernel is busy in a cell, which the culler never takes (cull_busy is
        off): it looks, and leaves it. An idle one it takes once idle 3 s, rightly, and on
        a loaded machine that came before the DELETE (the flake of issue 46 item 6: a
        suspend, its snapshot and events)."""
        session = await open_notebook(jp_fetch, "asked.ipynb")
        kernel_id = session["kernel"]["id"]
        ws = await jp_ws_fetch("api", "kernels", kernel_id, "channels")
        try:
            assert (await ws_run(ws, STATE)).strip() == "set"
            ws.write_message(execute_request("import time; time.sleep(3600)")[1])
            kernel = jp_serverapp.kernel_manager.get_kernel(kernel_id)

            async def busy() -> bool:
                return bool(kernel.execution_state == "busy")

            await until(busy)
            cull_soon(jp_serverapp)
            events = events_of(jp_serverapp)
            await cull_passes(jp_serverapp)  # the culler looks, three times
            await jp_fetch("api", "kernels", kernel_id, method="DELETE")
        finally:
            await ws_close(ws)
        assert kernel_id not in jp_serverapp.kernel_manager
        assert (await call(jp_fetch, "GET"))["snapshots"] == []
        assert [e["action"] for e in events] == []  # no suspend, no snapshot
        assert leftovers(tmp_path) == []

    async def test_a_shutdown_asked_during_the_culler_s_suspend_just_shuts_down(
        self,
        jp_fetch: Fetch,
        jp_ws_fetch: Any,
        jp_serverapp: Any,
        tmp_path: Path,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """The culler was first (its suspend runs) and the user's DELETE comes: the
        kernel is shut down once, nothing is left, and no "unsaved" event blames the
        culler for a shutdown the user asked for."""
        manager = manager_of(jp_serverapp)
        kernel_id = (await open_notebook(jp_fetch, "raced.ipynb"))["kernel"]["id"]
        assert await run_in_new_tab(jp_ws_fetch, kernel_id, STATE) == "set"
        caplog.set_level(logging.INFO)
        events = events_of(jp_serverapp)
        cull_soon(jp_serverapp, seconds=0)
        culling = asyncio.ensure_future(jp_serverapp.kernel_manager.cull_kernel_if_idle(kernel_id))

        async def suspending() -> bool:
            job = manager.jobs.on(kernel_id)
            return job is not None and job.kind == "suspend"

        await until(suspending)
        cull_soon(jp_serverapp, 3600)  # the culler's periodic turns leave it now
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")
        await culling
        shutdowns = [r for r in caplog.records if r.getMessage() == f"Kernel shutdown: {kernel_id}"]
        assert len(shutdowns) == 1
        assert kernel_id not in jp_serverapp.kernel_manager
        assert "unsaved" not in [e["action"] for e in events]
        assert leftovers(tmp_path) == []

    async def test_a_suspended_kernel_restarted_leaves_no_dump(
        self, jp_fetch: Fetch, jp_ws_fetch: Any, jp_serverapp: Any, tmp_path: Path
    ) -> None:
        """Restart Kernel on a suspended kernel: jupyter_server ends its wrapper and
        starts a new one (not through the kernel manager's shutdown_kernel); the dump the
        old one held goes, and the kernel starts afresh, as a restart does."""
        session = await open_notebook(jp_fetch, "restarted.ipynb")
        kernel_id = session["kernel"]["id"]
        assert await run_in_new_tab(jp_ws_fetch, kernel_id, STATE) == "set"
        await suspend(jp_fetch, kernel_id)
        assert len(leftovers(tmp_path)) == 1
        await jp_fetch("api", "kernels", kernel_id, "restart", method="POST", body="{}")
        assert leftovers(tmp_path) == []
        fresh = "print('x' in dir())"
        assert await run_in_new_tab(jp_ws_fetch, kernel_id, fresh) == "False"
        await jp_fetch("api", "sessions", session["id"], method="DELETE")


class TestBusy:
    """``cull_busy = True``: the culler also takes a kernel running a cell that has said
    nothing for ``cull_idle_timeout``. It cannot be suspended (its cell runs): it is
    snapshotted, then shut down; if that snapshot fails, it is named in an event."""

    @pytest.fixture
    def jp_server_config(self, tmp_path: Path) -> dict[str, Any]:
        return culling_config(tmp_path, connected=True, busy=True)

    async def cull_while_busy(
        self, jp_fetch: Fetch, jp_ws_fetch: Any, jp_serverapp: Any, setup: str
    ) -> str:
        """A kernel that ran ``setup`` and is then culled while it sleeps in a cell (its
        tab open); returns its id once it is gone."""
        session = await open_notebook(jp_fetch, "busy.ipynb")
        kernel_id = session["kernel"]["id"]
        ws = await jp_ws_fetch("api", "kernels", kernel_id, "channels")
        try:
            assert (await ws_run(ws, setup)).strip() == "set"
            ws.write_message(execute_request("import time; time.sleep(3600)")[1])

            async def busy() -> bool:
                status = await call(jp_fetch, "GET", "kernels", kernel_id)
                return bool(status["execution_state"] == "busy")

            await until(busy)
            await culled_away(jp_serverapp, kernel_id)
        finally:
            await ws_close(ws)
        assert await listed(jp_fetch, "sessions") == []
        return kernel_id

    async def test_a_busy_kernel_is_snapshotted_then_shut_down(
        self, jp_fetch: Fetch, jp_ws_fetch: Any, jp_serverapp: Any, tmp_path: Path
    ) -> None:
        events = events_of(jp_serverapp)
        kernel_id = await self.cull_while_busy(jp_fetch, jp_ws_fetch, jp_serverapp, STATE)
        [snapshot] = (await call(jp_fetch, "GET", trigger="cull"))["snapshots"]
        assert snapshot["kernel_id"] == kernel_id
        assert snapshot["status"] == "complete"
        assert [e["action"] for e in events if e["action"] in ("suspended", "unsaved")] == []
        assert leftovers(tmp_path) == []

    async def test_a_busy_kernel_that_cannot_be_snapshotted_is_named(
        self,
        jp_fetch: Fetch,
        jp_ws_fetch: Any,
        jp_serverapp: Any,
        tmp_path: Path,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """The kernel holds a connection to a process outside it, which CRIU refuses to
        dump: it is shut down all the same (the culler's word), said in the log and an
        "unsaved" event with the cause."""
        events = events_of(jp_serverapp)
        path = tmp_path / "outside.sock"
        setup = (
            f"import socket; c = socket.socket(socket.AF_UNIX); c.connect({str(path)!r}); "
            "print('set')"
        )
        peers: list[asyncio.StreamWriter] = []

        async def accept(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peers.append(writer)

        outside = await asyncio.start_unix_server(accept, str(path))
        try:
            with caplog.at_level(logging.WARNING, logger="jupyter_ext"):
                kernel_id = await self.cull_while_busy(jp_fetch, jp_ws_fetch, jp_serverapp, setup)
            assert len(peers) == 1
        finally:
            for peer in peers:
                peer.close()
            outside.close()
            await outside.wait_closed()
        assert (await call(jp_fetch, "GET"))["snapshots"] == []
        [unsaved] = [e for e in events if e["action"] == "unsaved"]
        assert unsaved["kernel_id"] == kernel_id
        assert unsaved["trigger"] == "cull"
        assert "could not be suspended (it was running a cell)" in unsaved["message"]
        assert "connect" in unsaved["message"]
        assert f"kernel {kernel_id} (culled) is shut down without a snapshot" in caplog.text
        assert leftovers(tmp_path) == []


OWNER = "alice"
ADMIN_TOKEN = "admin-" + os.urandom(8).hex()


class TwoIdentities(IdentityProvider):
    """jupyter_server's token login, whose token is alice's (the server's owner), and a
    second token that is an admin's: two identities, as JupyterHub has them."""

    async def get_user_token(self, handler: Any) -> User | None:
        if handler.request.headers.get("Authorization") == f"token {ADMIN_TOKEN}":
            return User("admin")
        user = await super().get_user_token(handler)
        return None if user is None else User(OWNER)


AS_ADMIN = {"Authorization": f"token {ADMIN_TOKEN}"}


class TestAdminShutdown:
    """``admin_shutdown_action = "suspend"``: a shutdown through the API by someone other
    than the owner (an admin) suspends the kernel; the owner's own shuts down."""

    @pytest.fixture
    def jp_server_config(self, tmp_path: Path) -> dict[str, Any]:
        config = server_config(tmp_path, admin_shutdown_action="suspend", owner=OWNER)
        config["ServerApp"]["identity_provider_class"] = TwoIdentities
        return config

    async def test_an_admins_shutdown_suspends_the_owners_shuts_down(
        self, jp_fetch: Fetch, jp_ws_fetch: Any, jp_serverapp: Any, tmp_path: Path
    ) -> None:
        session = await open_notebook(jp_fetch, "admin.ipynb")
        kernel_id = session["kernel"]["id"]
        ws = await jp_ws_fetch("api", "kernels", kernel_id, "channels")
        try:
            assert (await ws_run(ws, STATE)).strip() == "set"
            await jp_fetch("api", "kernels", kernel_id, method="DELETE", headers=AS_ADMIN)
            assert await state(jp_fetch, kernel_id) == "suspended"
            assert [s["id"] for s in await listed(jp_fetch, "sessions")] == [session["id"]]
            [snapshot] = (await call(jp_fetch, "GET", trigger="admin-shutdown"))["snapshots"]
            assert snapshot["kernel_id"] == kernel_id
            # An admin's shutdown of the suspended kernel leaves it so.
            await jp_fetch("api", "kernels", kernel_id, method="DELETE", headers=AS_ADMIN)
            assert await state(jp_fetch, kernel_id) == "suspended"
            # The owner's next cell, in the tab left open, has the state.
            assert (await ws_run(ws, CHECK)).strip() == "42 True"
        finally:
            await ws_close(ws)
        await no_job_on(jp_serverapp, kernel_id)
        # Closing the notebook with its kernel, by the admin: the session stays too.
        await jp_fetch("api", "sessions", session["id"], method="DELETE", headers=AS_ADMIN)
        assert await state(jp_fetch, kernel_id) == "suspended"
        assert [s["id"] for s in await listed(jp_fetch, "sessions")] == [session["id"]]
        assert await run_in_new_tab(jp_ws_fetch, kernel_id, CHECK) == "42 True"
        await no_job_on(jp_serverapp, kernel_id)
        # The owner's own shutdown just shuts down, and leaves nothing behind.
        await jp_fetch("api", "sessions", session["id"], method="DELETE")
        assert await listed(jp_fetch, "kernels") == []
        assert leftovers(tmp_path) == []
        # A request the admin may not make is refused as before (no kernel: 404).
        with pytest.raises(HTTPClientError) as info:
            await jp_fetch("api", "kernels", kernel_id, method="DELETE", headers=AS_ADMIN)
        assert info.value.code == 404


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
        await culled_into_suspend(jp_fetch, jp_serverapp, kernel_id)
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

    async def test_the_culler_leaves_a_kernel_whose_shutdown_runs(
        self,
        jp_fetch: Fetch,
        jp_serverapp: Any,
        tmp_path: Path,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """A DELETE's shutdown under way: the culler, which cannot read the status of a
        wrapper that is ending (it would decide "shutdown"), does not shut the kernel down
        a second time beside it. Two at once made jupyter_client take the kernel for gone
        before its wrapper had ended, and the suspended dump the wrapper held stayed."""
        session = await open_notebook(jp_fetch, "ending.ipynb")
        kernel_id = session["kernel"]["id"]
        culling = jp_serverapp.extension_manager.extension_points["jupyter_ext"].app.culling
        caplog.set_level(logging.INFO)
        deleting = asyncio.ensure_future(jp_fetch("api", "kernels", kernel_id, method="DELETE"))

        async def ending() -> bool:
            return kernel_id in culling.ending_now

        await until(ending, timeout=60)
        cull_soon(jp_serverapp, seconds=0)  # idle long enough for the culler now
        await jp_serverapp.kernel_manager.cull_kernel_if_idle(kernel_id)  # the culler's turn
        await deleting
        shutdowns = [r for r in caplog.records if r.getMessage() == f"Kernel shutdown: {kernel_id}"]
        assert len(shutdowns) == 1
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
        await culled_into_suspend(jp_fetch, jp_serverapp, kernel_id)
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
        # jupyter_client's restarter starts the dead kernel again; a server stopping while
        # it does fails on the start's unfinished future (jupyter_client's race, not ours):
        # the test ends once the restarted kernel is up.
        kernel = jp_serverapp.kernel_manager.get_kernel(kernel_id)

        async def restarted() -> bool:
            model = await call(jp_fetch, "GET", "kernels", kernel_id)
            return model.get("wrapper_pid") not in (None, wrapper) and kernel.ready.done()

        await until(restarted, timeout=60)


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
        await culled_away(jp_serverapp, kernel_id)
        assert await listed(jp_fetch, "sessions") == []
        assert (await call(jp_fetch, "GET"))["snapshots"] == []
        assert leftovers(tmp_path) == []

    async def test_a_suspended_kernel_culled_leaves_no_dump(
        self, jp_fetch: Fetch, jp_ws_fetch: Any, jp_serverapp: Any, tmp_path: Path
    ) -> None:
        kernel_id = (await open_notebook(jp_fetch, "suspended.ipynb"))["kernel"]["id"]
        assert await run_in_new_tab(jp_ws_fetch, kernel_id, STATE) == "set"
        await suspend(jp_fetch, kernel_id)
        assert len(leftovers(tmp_path)) == 1
        await culled_away(jp_serverapp, kernel_id)
        assert leftovers(tmp_path) == []
        # Its snapshot (taken when it was suspended) stays in the store.
        assert [s["kernel_id"] for s in (await call(jp_fetch, "GET"))["snapshots"]] == [kernel_id]


def test_no_dump_outlives_its_server(tmp_path: Path, snapshot_kernelspec: str) -> None:
    """A server stopped with a suspended kernel removes its dump as it shuts its kernels
    down; one killed with its kernels (a node's crash) leaves it, and the next server on
    the same work directory removes it when it starts. The snapshots stay."""
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    config = server_config(tmp_path)
    servers: list[ServerProcess] = []
    try:
        for ending in ("stopped", "killed"):
            server = ServerProcess(tmp_path / ending, notebooks, config)
            servers.append(server)
            kernel = server.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
            assert ws_execute(server, kernel, STATE).strip() == "set"
            follow(server, server.client.call("POST", f"kernels/{kernel}/suspend")["job"])
            assert len(leftovers(tmp_path)) == 1
            if ending == "stopped":
                assert server.stop(signal.SIGTERM) == 0
                assert leftovers(tmp_path) == []
            else:
                server.kill_node()
                assert len(leftovers(tmp_path)) == 1
        server = ServerProcess(tmp_path / "next", notebooks, config)
        servers.append(server)
        assert leftovers(tmp_path) == []
        assert len(server.client.call("GET", "")["snapshots"]) == 2
    finally:
        for server in servers:
            server.stop()
