"""Server-side policies with a real server and kernels: one policy tick, long cells, idle
GPU suspend, retention, snapshot before shutdown, events, and uploads that fail and are
retried. The policies' decisions themselves: tests/test_policy_decisions.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest

from jupyter_ext.autosnap import PolicyTick
from jupyter_ext.core.policies.tick import PolicySettings
from jupyter_ext.core.protocol.control import StatusArgs, WrapperClient
from jupyter_ext.core.store import LocalStore
from testkit.processes import MotoServer, ServerProcess, run_keys, wait_until

from .support.jupyter_api import (
    Fetch,
    call,
    error_of,
    events_of,
    manager_of,
    server_config,
    snapshot,
    until,
    wait_job,
)
from .support.s3server import CuttableProxy
from .support.servers import ws_execute

pytestmark = pytest.mark.usefixtures("criu", "snapshot_kernelspec")

BUCKET = "kernel-snapshots-policies"


def base_config(tmp_path: Path, **extension: Any) -> dict[str, Any]:
    return server_config(tmp_path, **extension)


class TestOneTick:
    """One policy tick against real kernels, called directly (no policy loop runs)."""

    @pytest.fixture
    def jp_server_config(self, tmp_path: Path) -> dict[str, Any]:
        return base_config(tmp_path)

    async def test_reads_each_kernel_once_and_starts_what_is_due(
        self,
        jp_fetch: Fetch,
        jp_serverapp: Any,
        start_kernel: Any,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Periodic, long-cell and idle suspend all on: each kernel's wrapper is asked for
        its status once a tick (it used to be up to three times), with its GPU accounting
        since idle suspend of GPU kernels needs it. Of three kernels, the one that ran a
        cell gets a periodic snapshot; the one that did not, and the one the panel's
        switch turned off, get none."""
        manager = manager_of(jp_serverapp)
        asked: list[tuple[str, bool]] = []
        real_status = WrapperClient.status

        async def counted(client: WrapperClient, args: StatusArgs | None = None, **kw: Any) -> Any:
            args = args or StatusArgs()
            asked.append((str(client.control), args.gpu))
            return await real_status(client, args, **kw)

        monkeypatch.setattr(WrapperClient, "status", counted)
        ran, opted_out = await start_kernel(), await start_kernel()
        await start_kernel()  # ran nothing
        await ran.run("x = 1")
        await opted_out.run("y = 2")
        await call(jp_fetch, "PATCH", "kernels", opted_out.id, body={"periodic": False})
        settings = PolicySettings(
            periodic_interval=60, long_cell_seconds=600, idle_suspend_after=3600
        )
        policy = PolicyTick(manager, settings)
        policy.memory.last_periodic -= 60  # the interval has passed: a periodic round
        asked.clear()

        jobs = await policy.tick()

        assert len(asked) == 3, asked
        assert len(set(asked)) == 3, asked  # three kernels, each once
        assert all(gpu for _, gpu in asked)
        assert [(job.kernel_id, job.kind) for job in jobs] == [(ran.id, "snapshot")]
        done = await manager.jobs.wait(jobs[0], 300)
        assert done.status == "done", done.error
        assert done.result is not None
        assert done.result["trigger"] == "periodic"
        # The next tick is no periodic round: nothing is due, each kernel is asked once.
        asked.clear()
        assert await policy.tick() == []
        assert len(asked) == 3, asked
        # Without idle suspend no decision needs the GPU (NVML), nor the status of the
        # kernel the panel's switch turned off: two kernels asked, without GPU accounting.
        policy.settings = PolicySettings(long_cell_seconds=600)
        asked.clear()
        assert await policy.tick() == []
        assert [gpu for _, gpu in asked] == [False, False], asked


@pytest.mark.usefixtures("running_extensions")
class TestLongCell:
    @pytest.fixture
    def jp_server_config(self, tmp_path: Path) -> dict[str, Any]:
        return base_config(tmp_path, long_cell_seconds=1.5, long_cell_min_interval=0)

    async def test_a_long_cell_triggers_a_snapshot_a_short_one_does_not(
        self, jp_fetch: Fetch, start_kernel: Any
    ) -> None:
        kernel = await start_kernel()
        await kernel.run("short = 1")
        await kernel.run("import time\ntime.sleep(2.5)\nlong = 2")

        async def long_cell() -> list[dict[str, Any]]:
            return (await call(jp_fetch, "GET", trigger="long-cell"))["snapshots"]

        async def taken() -> bool:
            return len(await long_cell()) > 0

        await until(taken)
        # One snapshot, after the long cell, holding both cells: the short one, ticks of
        # the policy before the long one ended, had not triggered one of its own.
        [first] = await long_cell()
        cells = [c["first_line"] for c in first["contents"]["cells"]]
        assert cells == ["short = 1", "import time"]
        assert first["contents"]["cells"][1]["seconds"] >= 2.5


class TestRetention:
    @pytest.fixture
    def jp_server_config(self, tmp_path: Path) -> dict[str, Any]:
        return base_config(tmp_path, keep_last=2)

    async def test_keep_last_per_notebook(self, jp_fetch: Fetch, start_kernel: Any) -> None:
        kernel = await start_kernel()
        ids = []
        for n in range(4):
            await kernel.run(f"n = {n}")
            job = await wait_job(
                jp_fetch, (await call(jp_fetch, "POST", body={"kernel_id": kernel.id}))["job"]
            )
            ids.append(job["result"]["id"])
        listed = [s["id"] for s in (await call(jp_fetch, "GET"))["snapshots"]]
        assert listed == [ids[3], ids[2]]


class TestByteBudget:
    @pytest.fixture
    def jp_server_config(self, tmp_path: Path) -> dict[str, Any]:
        return base_config(tmp_path, max_store_bytes=1)

    async def test_never_deletes_the_newest(self, jp_fetch: Fetch, start_kernel: Any) -> None:
        kernel = await start_kernel()
        for n in range(3):
            await kernel.run(f"import numpy as np; a{n} = np.random.random(2**20)")
            job = await wait_job(
                jp_fetch, (await call(jp_fetch, "POST", body={"kernel_id": kernel.id}))["job"]
            )
        listed = (await call(jp_fetch, "GET"))["snapshots"]
        assert [s["id"] for s in listed] == [job["result"]["id"]]


class TestEvents:
    @pytest.fixture
    def jp_server_config(self, tmp_path: Path) -> dict[str, Any]:
        return base_config(tmp_path)

    async def test_snapshot_restore_delete_events(
        self, jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any
    ) -> None:
        seen = events_of(jp_serverapp)
        kernel = await start_kernel()
        await kernel.run("y = 3")
        job = await wait_job(
            jp_fetch, (await call(jp_fetch, "POST", body={"kernel_id": kernel.id}))["job"]
        )
        snapshot_job = job["id"]
        snapshot_id = job["result"]["id"]
        job = await wait_job(
            jp_fetch,
            (await call(jp_fetch, "POST", snapshot_id, "restore", body={"kernel_id": kernel.id}))[
                "job"
            ],
        )
        await call(jp_fetch, "DELETE", snapshot_id)
        await asyncio.sleep(0.2)
        actions = [e["action"] for e in seen]
        assert actions[0] == "started"
        assert "progress" in actions
        assert actions.index("created") < actions.index("restored") < actions.index("deleted")
        created = next(e for e in seen if e["action"] == "created")
        assert created["snapshot_id"] == snapshot_id
        assert created["kernel_id"] == kernel.id
        # Progress events name the job's kind and carry its bytes (the store's last report).
        progress = [e for e in seen if e["action"] == "progress"]
        assert {e["kind"] for e in progress} == {"snapshot", "restore"}
        stored = [e for e in progress if e["job_id"] == snapshot_job and e["total_bytes"]]
        assert stored[-1]["done_bytes"] == stored[-1]["total_bytes"] > 0


class GatedPuts:
    """A put of the server's store that waits at ``gate`` once it has stored (the test
    decides when the upload goes on)."""

    def __init__(self, store: Any, gate: threading.Event, stored: threading.Event) -> None:
        self._put = store.put
        self._gate = gate
        self._stored = stored

    def put(self, *args: Any, **kwargs: Any) -> Any:
        result = self._put(*args, **kwargs)
        self._stored.set()
        assert self._gate.wait(300), "the test never opened the gate"
        return result


@pytest.mark.usefixtures("running_extensions")
class TestUploadFailure:
    @pytest.fixture
    def jp_server_config(
        self, tmp_path: Path, moto: MotoServer, proxy: CuttableProxy
    ) -> dict[str, Any]:
        return base_config(
            tmp_path,
            store="s3",
            s3_bucket=moto.ensure_bucket(BUCKET),
            s3_endpoint_url=proxy.url,
            # A prefix per test: each test's server makes its own key file, and a store
            # keyed by an earlier test's key is refused (rightly) as another key's.
            s3_prefix=f"kernel-snapshots-{uuid.uuid4().hex[:8]}",
            upload_retry_interval=0.5,
        )

    async def test_kept_locally_marked_and_retried(
        self, jp_fetch: Fetch, start_kernel: Any, proxy: CuttableProxy
    ) -> None:
        kernel = await start_kernel()
        await kernel.run("z = 'kept'")
        proxy.cut()
        job = await wait_job(
            jp_fetch, (await call(jp_fetch, "POST", body={"kernel_id": kernel.id}))["job"], 300
        )
        assert job["status"] == "done"
        snapshot = job["result"]
        assert snapshot["status"] == "upload-failed"
        assert snapshot["error"]
        listed = (await call(jp_fetch, "GET"))["snapshots"]
        assert [(s["id"], s["status"]) for s in listed] == [(snapshot["id"], "upload-failed")]
        # No record in the bucket: nothing there looks like a complete snapshot.
        direct = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{proxy.target_port}")
        keys = [o["Key"] for o in direct.list_objects_v2(Bucket=BUCKET).get("Contents", [])]
        direct.close()
        assert not [key for key in keys if "/snapshots/" in key]
        # The local copy restores even while the store is unreachable.
        await kernel.run("z = 'changed'")
        restored = await wait_job(
            jp_fetch,
            (
                await call(
                    jp_fetch, "POST", snapshot["id"], "restore", body={"kernel_id": kernel.id}
                )
            )["job"],
        )
        assert restored["status"] == "done", restored
        assert (await kernel.run("print(z)")).strip() == "kept"

        proxy.restore()

        async def complete() -> bool:
            listed = (await call(jp_fetch, "GET"))["snapshots"]
            return [s["status"] for s in listed] == ["complete"]

        await until(complete, timeout=120)

    async def test_a_snapshot_waiting_for_its_upload_can_be_deleted(
        self,
        jp_fetch: Fetch,
        jp_serverapp: Any,
        start_kernel: Any,
        proxy: CuttableProxy,
        tmp_path: Path,
    ) -> None:
        """Deleted while the store is unreachable: its local copy goes, it is listed no more,
        and the store, reachable again, never gets it."""
        kernel = await start_kernel()
        proxy.cut()
        job = await wait_job(
            jp_fetch, (await call(jp_fetch, "POST", body={"kernel_id": kernel.id}))["job"], 300
        )
        snapshot_id = job["result"]["id"]
        uploads = manager_of(jp_serverapp).uploads
        waiting = uploads.waiting(snapshot_id)
        assert waiting is not None
        assert waiting.directory.is_relative_to(tmp_path / "work" / "staging")
        assert waiting.directory.is_dir()
        await jp_fetch("api", "snapshots", snapshot_id, method="DELETE")
        assert not waiting.directory.exists()
        assert (await call(jp_fetch, "GET"))["snapshots"] == []
        proxy.restore()
        await uploads.retry()  # the retry pass, driven directly
        code, _error = await error_of(jp_fetch, "GET", snapshot_id)
        assert code == 404
        listed = await call(jp_fetch, "GET")
        assert listed == {"snapshots": [], "store_error": ""}

    async def test_an_upload_that_succeeds_during_a_restore_waits_for_it(
        self,
        jp_fetch: Fetch,
        jp_serverapp: Any,
        start_kernel: Any,
        proxy: CuttableProxy,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """A snapshot the store refused is restored from the work directory into a new
        kernel while its retried upload succeeds: the upload moves the directory into the
        image cache only after the restore has read it (it used to move it away under the
        restore: "staging/<id> is not a complete snapshot")."""
        manager = manager_of(jp_serverapp)
        # The put that stores it waits at the gate before the upload goes on (every put
        # goes through it: one already in flight when the store comes back too).
        gate, stored_once = threading.Event(), threading.Event()
        # The store's own put replaced: the manager's parts share that store.
        monkeypatch.setattr(manager.store, "put", GatedPuts(manager.store, gate, stored_once).put)
        kernel = await start_kernel()
        await kernel.run("z = 'kept'")
        proxy.cut()
        job = await call(jp_fetch, "POST", body={"kernel_id": kernel.id})
        snapshot = (await wait_job(jp_fetch, job["job"], 300))["result"]
        assert snapshot["status"] == "upload-failed"
        # The kernel is lost (without root its copy could not run beside it: same ids).
        await jp_serverapp.kernel_manager.shutdown_kernel(kernel.id, now=True)
        proxy.restore()
        assert await asyncio.to_thread(stored_once.wait, 120)
        restore = (await call(jp_fetch, "POST", snapshot["id"], "restore", body={}))["job"]

        async def restoring() -> bool:
            state = await call(jp_fetch, "GET", "jobs", restore["id"])
            assert state["status"] == "running", state
            return bool(state["phase"] == "restoring")

        await until(restoring, timeout=120)
        gate.set()  # the upload moves the directory now, while the new kernel starts
        restored = await wait_job(jp_fetch, restore, 300)
        assert restored["status"] == "done", restored
        assert restored["result"]["source"] == "work-directory"

        async def stored() -> bool:
            listed = (await call(jp_fetch, "GET"))["snapshots"]
            return [s["status"] for s in listed if s["id"] == snapshot["id"]] == ["complete"]

        await until(stored, timeout=120)
        new_kernel = await start_kernel(restored["result"]["kernel_id"])
        assert (await new_kernel.run("print(z)")).strip() == "kept"

    async def test_a_stalled_store_never_blocks_the_server(
        self, jp_fetch: Fetch, proxy: CuttableProxy
    ) -> None:
        proxy.stall()
        listing = asyncio.ensure_future(call(jp_fetch, "GET"))

        async def store_reached() -> bool:
            return bool(proxy.stalled)

        await until(store_reached, timeout=30)
        # The listing waits on S3; the server still answers everything else meanwhile.
        assert (await call(jp_fetch, "GET", "policy"))["store"] == "s3"
        assert (await call(jp_fetch, "GET", "kernels"))["kernels"] == []
        assert not listing.done()
        proxy.restore()  # the stalled connection drops; boto3 retries and gets its answer
        assert (await listing)["store_error"] == ""


def test_snapshot_before_shutdown(tmp_path: Path, snapshot_kernelspec: str) -> None:
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    config = base_config(tmp_path, snapshot_before_shutdown=True)
    server = ServerProcess(tmp_path / "server", notebooks, config)
    kernel = server.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
    ws_execute(server, kernel, "import numpy as np; w = np.ones(2**22)")
    assert server.stop(signal.SIGTERM) == 0
    stored = LocalStore(tmp_path / "store" / "users" / _owner(), keys=run_keys()).snapshots()
    assert [s.manifest.trigger for s in stored] == ["before-shutdown"]
    assert stored[0].manifest.kernel_spec["kernel_id"] == kernel


def test_every_kernel_is_snapshotted_before_shutdown(
    tmp_path: Path, snapshot_kernelspec: str
) -> None:
    """Three kernels of one notebook folder, stopped together, twice: every one of them is
    stored (their dumps used to collide in the shared directory: 2 of 4 stops lost one)."""
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    config = base_config(tmp_path, snapshot_before_shutdown=True)
    store = LocalStore(tmp_path / "store" / "users" / _owner(), keys=run_keys())
    expected: set[str] = set()
    for round_ in range(2):
        server = ServerProcess(tmp_path / f"server{round_}", notebooks, config)
        for i in range(3):
            kernel = server.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
            ws_execute(server, kernel, f"import numpy as np; w = np.full(2**20, {i})")
            expected.add(kernel)
        assert server.stop(signal.SIGTERM) == 0
        stored = store.snapshots()
        assert {s.manifest.kernel_spec["kernel_id"] for s in stored} == expected
        assert {s.manifest.trigger for s in stored} == {"before-shutdown"}
        assert "without a snapshot" not in server.log()


class TestShutdownSnapshots:
    @pytest.fixture
    def jp_server_config(self, tmp_path: Path) -> dict[str, Any]:
        return base_config(tmp_path)

    async def test_a_kernel_left_without_a_snapshot_is_named(
        self, jp_serverapp: Any, start_kernel: Any, tmp_path: Path, caplog: Any
    ) -> None:
        """A kernel whose snapshot fails (here it holds a connection to a process outside
        it) is tried once more, then named in the log and in an "unsaved" event."""
        import logging
        import socket

        seen = events_of(jp_serverapp)
        good = await start_kernel()
        bad = await start_kernel()
        await good.run("x = 1")
        path = tmp_path / "outside.sock"
        manager = jp_serverapp.extension_manager.extension_points["jupyter_ext"].app.manager
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as outside:
            outside.bind(str(path))
            outside.listen()
            await bad.run(
                f"import socket; c = socket.socket(socket.AF_UNIX); c.connect({str(path)!r})"
            )
            accepted, _ = outside.accept()
            with accepted, caplog.at_level(logging.WARNING, logger="jupyter_ext"):
                jobs = await manager.schedules.snapshot_all("before-shutdown", 120)
        await asyncio.sleep(0.2)
        assert [j.status for j in jobs if j.kernel_id == good.id] == ["done"]
        assert [j.status for j in jobs if j.kernel_id == bad.id] == ["failed", "failed"]
        assert f"snapshot of kernel {bad.id} before the stop failed" in caplog.text
        assert f"kernel {bad.id} is stopped without a snapshot" in caplog.text
        assert f"kernel {good.id} is stopped without" not in caplog.text
        unsaved = [e for e in seen if e["action"] == "unsaved"]
        assert [e["kernel_id"] for e in unsaved] == [bad.id]
        assert "connect" in unsaved[0]["message"]


def test_kernels_end_with_a_server_killed_with_sigkill(
    tmp_path: Path, snapshot_kernelspec: str
) -> None:
    """As with ipykernel: a server that dies without stopping its kernels (SIGKILL, the
    OOM killer) leaves none running, unreachable, for ever."""
    from jupyter_ext.core import proctree

    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    server = ServerProcess(tmp_path / "server", notebooks, base_config(tmp_path))
    kernel = server.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
    ws_execute(server, kernel, "x = 1")
    kernel_pids = proctree.descendants(server.process.pid)[1:]
    assert kernel_pids
    server.process.kill()
    server.process.wait(10)
    try:
        wait_until(
            lambda: not any(proctree.is_alive(pid) for pid in kernel_pids),
            timeout=60,
            what="the kernel's processes to end with their server",
        )
    finally:
        for pid in kernel_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        server.stop()


def test_a_second_stop_signal_waits_for_the_shutdown_snapshots(
    tmp_path: Path, snapshot_kernelspec: str
) -> None:
    """A spawner that sends SIGTERM after its SIGINT (or an impatient operator) must not
    cut the snapshots the first signal started: the second stop waits for the same work."""
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    server = ServerProcess(
        tmp_path / "server", notebooks, base_config(tmp_path, snapshot_before_shutdown=True)
    )
    kernel = server.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
    # Random bytes: nothing to compress, so storing takes a while.
    ws_execute(server, kernel, "import os; w = os.urandom(384 * 2**20)")
    server.process.send_signal(signal.SIGTERM)
    staging = tmp_path / "work" / "staging"
    wait_until(lambda: staging.is_dir() and any(staging.iterdir()), what="a shutdown snapshot")
    assert server.stop(signal.SIGTERM) == 0
    stored = LocalStore(tmp_path / "store" / "users" / _owner(), keys=run_keys()).snapshots()
    assert [s.manifest.trigger for s in stored] == ["before-shutdown"]


def test_snapshots_the_store_refused_are_uploaded_when_the_server_starts_again(
    tmp_path: Path, snapshot_kernelspec: str, moto: MotoServer, proxy: CuttableProxy
) -> None:
    """The store is down while a server stops (a cull during an S3 outage): the shutdown
    snapshot is kept in the work directory, and the next start of the server stores it;
    what a crash left half-written there is removed."""
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    config = base_config(
        tmp_path,
        snapshot_before_shutdown=True,
        store="s3",
        s3_bucket=moto.ensure_bucket("recovered"),
        s3_endpoint_url=proxy.url,
        s3_prefix=tmp_path.name,
    )
    first = ServerProcess(tmp_path / "first", notebooks, config)
    kernel = first.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
    ws_execute(first, kernel, "x = 41")
    proxy.cut()
    assert first.stop(signal.SIGTERM) == 0
    staging = tmp_path / "work" / "staging"
    [kept_dir] = staging.iterdir()
    kept = json.loads((kept_dir / "manifest.json").read_text())["id"]
    crashed_dump = staging / f".{kept_dir.name}.partial-0123abcd"
    crashed_download = tmp_path / "work" / "cache" / f"{kept}-0123abcd"
    for leftover in (crashed_dump, crashed_download):
        (leftover / "images").mkdir(parents=True)
        (leftover / "images" / "pages-1.img").write_bytes(b"half")
        for path in (leftover / "images" / "pages-1.img", leftover / "images", leftover):
            os.utime(path, (time.time() - 7200, time.time() - 7200))

    proxy.restore()
    second = ServerProcess(tmp_path / "second", notebooks, config)
    try:
        # Listed as uploading until the upload is wrapped up (retention included), after
        # its staged directory is gone: wait for the listing, then check the directory.
        seen: list[dict[str, Any]] = []

        def stored() -> bool:
            seen[:] = second.client.call("GET", "")["snapshots"]
            return [s["status"] for s in seen] == ["complete"]

        wait_until(stored, 60, "the upload")
        [listed] = seen
        assert listed["id"] == kept
        assert not staging.exists() or not any(staging.iterdir())
        assert listed["trigger"] == "before-shutdown"
        assert not crashed_download.exists()
    finally:
        second.stop()


def _owner() -> str:
    import getpass
    import os

    return os.environ.get("JUPYTERHUB_USER") or getpass.getuser()


def with_fake_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Kernels started by the server load the stand-in libcuda; returns its path."""
    from .support.fakecuda.build import build_fakecuda

    libcuda = build_fakecuda(tmp_path / "fakecuda")
    (tmp_path / "fakecuda-state").mkdir()
    monkeypatch.setenv("JUPYTER_SNAPSHOT_LIBCUDA", str(libcuda))
    monkeypatch.setenv("FAKECUDA_STATE_DIR", str(tmp_path / "fakecuda-state"))
    return libcuda


@pytest.mark.usefixtures("running_extensions")
class TestGpuCacheRelease:
    @pytest.fixture
    def jp_server_config(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
        self.libcuda = with_fake_gpu(tmp_path, monkeypatch)
        self.calls = tmp_path / "fakecuda-state" / "calls.log"
        return base_config(tmp_path, release_gpu_caches=False)

    async def test_trait_off_keeps_framework_caches(
        self, jp_fetch: Fetch, start_kernel: Any
    ) -> None:
        from .support.fakecuda.programs import CACHED_BLOCK, USE_GPU

        kernel = await start_kernel()
        await kernel.run(USE_GPU.format(lib=str(self.libcuda)))
        await kernel.run(CACHED_BLOCK.format(calls=str(self.calls)))
        job = await snapshot(jp_fetch, kernel.id)
        assert job["status"] == "done", job
        snap = await call(jp_fetch, "GET", job["result"]["id"])
        # PID 1 of its namespace as root; without root it has none (docs/nonroot.md).
        assert len(snap["gpu"]["ns_pids"]) == 1
        assert os.geteuid() != 0 or snap["gpu"]["ns_pids"] == [1]
        assert "released_caches" not in snap["gpu"]
        assert (await kernel.run("print(bool(cached.value))")).strip() == "True"


@pytest.mark.usefixtures("running_extensions")
class TestIdleGpuSuspend:
    @pytest.fixture
    def jp_server_config(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
        self.libcuda = with_fake_gpu(tmp_path, monkeypatch)
        return base_config(tmp_path, idle_suspend_after=1.5)

    async def test_idle_gpu_kernel_suspends_and_next_cell_resumes(
        self, jp_fetch: Fetch, start_kernel: Any
    ) -> None:
        from .support.fakecuda.programs import USE_GPU

        gpu_kernel = await start_kernel()
        cpu_kernel = await start_kernel()
        assert (await gpu_kernel.run(USE_GPU.format(lib=str(self.libcuda)))).strip() == "True"
        await cpu_kernel.run("x = 1")
        status = await call(jp_fetch, "GET", "kernels", gpu_kernel.id)
        assert status["gpu"]["processes"] == 1
        inner = status["inner_pid"]

        async def suspended() -> bool:
            state = (await call(jp_fetch, "GET", "kernels", gpu_kernel.id))["state"]
            return state == "suspended"

        await until(suspended, timeout=60)
        assert not Path(f"/proc/{inner}").exists()  # the process ended: its GPU is free

        async def suspend_stored() -> list[dict[str, Any]]:
            return (await call(jp_fetch, "GET", trigger="idle-suspend"))["snapshots"]

        async def stored() -> bool:
            return bool(await suspend_stored())

        await until(stored)  # the suspend's snapshot is listed once it is in the store
        # CPU kernels are left alone by default (test_policy_decisions.py: idle suspend).
        assert [s["kernel_id"] for s in await suspend_stored()] == [gpu_kernel.id]

        # The next cell brings the kernel back by itself, with its GPU state.
        assert (await gpu_kernel.run("print(device_ok())")).strip() == "True"
        status = await call(jp_fetch, "GET", "kernels", gpu_kernel.id)
        assert status["state"] == "running"
