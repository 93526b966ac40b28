"""A kernel that dies is told, and its snapshot offered back (issue 44 item 1): its inner
kernel killed or crashed (the wrapper sees how), its wrapper killed with it (jupyter_client
starts it again and the server remembers), and a real out-of-memory kill under a memory
cgroup; the offer in the REST API until it is taken or dismissed, and restore_on_death."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_ext.core import proctree
from jupyter_ext.core.criu import Criu
from jupyter_ext.core.criu.deathwatch import (
    DEATH_GRACE_SECONDS,
    INVENTORY,
    WATCH_SECONDS,
    TreeDeathWatch,
)
from jupyter_ext.core.death import Death, MemoryCgroup, Witness
from jupyter_ext.core.errors import DumpError
from jupyter_ext.core.protocol.control import journal_path
from testkit.processes import KernelProcess, ServerProcess, wait_until

from .support.jupyter_api import Fetch, call, manager_of, restore, server_config, snapshot, until

pytestmark = pytest.mark.usefixtures("criu")


# ---------------------------------------------------------------- the wrapper


def test_the_wrapper_tells_how_its_kernel_died(kernel_factory: Any, tmp_path: Path) -> None:
    """Killed: the signal, the snapshot its state was last in, the cells run since."""
    kernel: KernelProcess = kernel_factory()
    kernel.execute("x = 42")
    manifest = kernel.snapshot(tmp_path / "snap")
    kernel.execute("y = x + 1\nprint(y)")
    kernel.execute("\n\nz = [y] * 3  # the third")
    kernel.kill_inner()
    status = kernel.status()
    assert status["state"] == "dead"
    assert status["death"]["cause"] == "signal"
    assert status["death"]["reason"] == "killed by SIGKILL"
    assert status["snapshot_id"] == manifest["id"]
    lines = [c["first_line"] for c in status["cells_since_snapshot"]]
    assert lines == ["y = x + 1", "z = [y] * 3  # the third"]
    journal = json.loads(journal_path(kernel.connection_file).read_text())
    assert journal["death"]["reason"] == "killed by SIGKILL"
    assert journal["snapshot_id"] == manifest["id"]


def test_a_crash_is_named_and_the_journal_stays_for_the_server(kernel_factory: Any) -> None:
    """A segmentation fault in the kernel (exit mode: the wrapper exits after telling it)."""
    kernel: KernelProcess = kernel_factory(on_inner_death="exit")
    kernel.execute("x = 1")
    kernel.client.execute("import ctypes; ctypes.string_at(0)")
    assert kernel.process.wait(30) == 1
    journal = json.loads(journal_path(kernel.connection_file).read_text())
    assert journal["death"]["cause"] == "crash", journal
    assert journal["death"]["reason"] == "crashed: a segmentation fault (SIGSEGV)"
    assert [c["first_line"] for c in journal["cells_since"]][-1].startswith("import ctypes")


# ---------------------------------------------------------------- a real OOM kill


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A memory cgroup of 400 MiB under this process's own (v1, or v2 where the memory
    controller is handed down), removed after the test."""
    own = MemoryCgroup.of(os.getpid())
    if own is None:
        pytest.skip("no memory cgroup is readable here")
    if own.v2 and "memory" not in (own.path / "cgroup.subtree_control").read_text().split():
        pytest.skip("cgroup v2 without the memory controller for child cgroups here")
    path = own.path / f"kernel-snapshots-oom-{os.getpid()}"
    try:
        path.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup here: {exc}")
    (path / ("memory.max" if own.v2 else "memory.limit_in_bytes")).write_text(str(400 << 20))
    yield path
    for pid in (path / "cgroup.procs").read_text().split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    wait_until(lambda: not (path / "cgroup.procs").read_text().split(), what="cgroup empty")
    path.rmdir()


def test_the_witness_tells_a_real_oom_kill(memory_cgroup: Path) -> None:
    """A process allocating past its cgroup's limit: the OOM killer's, with its memory."""
    child = subprocess.Popen(
        [
            "sh",
            "-c",
            f'echo $$ > {memory_cgroup}/cgroup.procs && exec "$@"',
            "sh",
            "python3",
            "-c",
            "import sys; sys.stdin.read(); b = bytearray(600 << 20)",
        ],
        stdin=subprocess.PIPE,
    )
    wait_until(lambda: str(child.pid) in (memory_cgroup / "cgroup.procs").read_text().split())
    witness = Witness(child.pid)
    assert witness.cgroup is not None
    assert witness.cgroup.path == memory_cgroup
    assert child.stdin is not None
    child.stdin.close()
    death = witness.death(child.wait(30))
    assert death.oom, death
    assert death.memory_limit == 400 << 20
    if os.geteuid() == 0:  # the kernel log names it, with its memory
        assert death.memory_bytes is not None
        assert 300 << 20 < death.memory_bytes <= 410 << 20
        assert death.reason.startswith("killed by the out-of-memory killer at ")


@pytest.mark.needs_root("reads the kernel log; a server in a memory cgroup")
def test_an_oom_killed_kernel_offers_its_snapshot(tmp_path: Path, memory_cgroup: Path) -> None:
    """The whole server in a memory cgroup (as a container or a systemd unit would run
    it); the kernel allocates past the limit; the REST API says it died of it."""
    server = ServerProcess(
        tmp_path / "home", _root(tmp_path), server_config(tmp_path), cgroup=memory_cgroup
    )
    try:
        kernel_id = server.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
        wait_until(lambda: _status(server, kernel_id).get("state") == "running", 60)
        _run(server, kernel_id, "x = 42")
        job = server.api("POST", "api/snapshots", {"kernel_id": kernel_id})["job"]
        wait_until(lambda: _job(server, job)["status"] != "running", 120)
        assert _job(server, job)["status"] == "done"
        _run(server, kernel_id, "big = bytearray(600 << 20)", wait=False)
        wait_until(lambda: _status(server, kernel_id).get("death") is not None, 90)
        death = _status(server, kernel_id)["death"]
        assert death["cause"] == "oom", death
        assert death["reason"].startswith("killed by the out-of-memory killer at "), death
        assert death["wrapper"] is False
        assert death["snapshot_id"] == _job(server, job)["result"]["id"]
        assert [c["first_line"] for c in death["cells_since"]] == ["big = bytearray(600 << 20)"]
    finally:
        server.stop()


def _root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)
    return root


def _status(server: ServerProcess, kernel_id: str) -> dict[str, Any]:
    result: dict[str, Any] = server.api("GET", f"api/snapshots/kernels/{kernel_id}")
    return result


def _job(server: ServerProcess, job: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = server.api("GET", f"api/snapshots/jobs/{job['id']}")
    return result


def _run(server: ServerProcess, kernel_id: str, code: str, wait: bool = True) -> None:
    """Run a cell through a jupyter_client of the server's kernel (its connection file)."""
    from jupyter_client.blocking.client import BlockingKernelClient

    runtime = Path(server.env["JUPYTER_RUNTIME_DIR"])
    client = BlockingKernelClient(connection_file=str(runtime / f"kernel-{kernel_id}.json"))
    client.load_connection_file()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        if wait:
            reply = client.execute_interactive(code, timeout=60)
            assert reply["content"]["status"] == "ok", reply["content"]
        else:
            client.execute(code)
            client.get_iopub_msg(timeout=30)  # sent: the kernel took it (busy)
    finally:
        client.stop_channels()


# ---------------------------------------------------------------- the server


@pytest.fixture
def jp_server_config(tmp_path: Path) -> dict[str, Any]:
    return server_config(tmp_path)


async def _died(jp_fetch: Fetch, kernel_id: str) -> dict[str, Any]:
    """The kernel's death, once the server knows it (jupyter_client restarts it)."""

    async def known() -> bool:
        return (await call(jp_fetch, "GET", "kernels", kernel_id)).get("death") is not None

    await until(known, timeout=60)
    death: dict[str, Any] = (await call(jp_fetch, "GET", "kernels", kernel_id))["death"]
    return death


async def _running(jp_fetch: Fetch, kernel_id: str) -> None:
    async def up() -> bool:
        return (await call(jp_fetch, "GET", "kernels", kernel_id)).get("state") == "running"

    await until(up, timeout=60)


@pytest.mark.usefixtures("snapshot_kernelspec")
async def test_a_killed_kernel_offers_its_snapshot_until_dismissed(
    jp_fetch: Fetch, start_kernel: Any
) -> None:
    kernel = await start_kernel()
    await kernel.run("x = 42")
    taken = (await snapshot(jp_fetch, kernel.id))["result"]
    await kernel.run("y = x + 1")
    status = await call(jp_fetch, "GET", "kernels", kernel.id)
    assert status["death"] is None
    assert status["snapshot_id"] == taken["id"]
    os.kill(status["inner_pid"], signal.SIGKILL)

    death = await _died(jp_fetch, kernel.id)
    assert death["reason"] == "killed by SIGKILL"
    assert death["wrapper"] is False
    assert death["snapshot_id"] == taken["id"]
    assert death["snapshot_created"] == taken["created"]
    assert [c["first_line"] for c in death["cells_since"]] == ["y = x + 1"]
    assert death["cells_since_exact"] is True
    await _running(jp_fetch, kernel.id)  # jupyter_client started a new kernel meanwhile
    still = await call(jp_fetch, "GET", "kernels", kernel.id)
    assert still["death"]["snapshot_id"] == taken["id"], "the offer stands"

    await call(jp_fetch, "PATCH", "kernels", kernel.id, body={"dismiss_death": True})
    assert (await call(jp_fetch, "GET", "kernels", kernel.id))["death"] is None


@pytest.mark.usefixtures("snapshot_kernelspec")
async def test_a_killed_wrapper_is_remembered_and_the_restore_takes_the_offer(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any
) -> None:
    kernel = await start_kernel()
    await kernel.run("x = 42")
    taken = (await snapshot(jp_fetch, kernel.id))["result"]
    status = await call(jp_fetch, "GET", "kernels", kernel.id)
    for pid in (status["wrapper_pid"], status["inner_pid"]):
        os.kill(pid, signal.SIGKILL)

    death = await _died(jp_fetch, kernel.id)
    assert death["wrapper"] is True
    assert death["reason"] == "killed by SIGKILL"
    assert death["snapshot_id"] == taken["id"]
    assert death["cells_since"] == []
    await _running(jp_fetch, kernel.id)

    job = await restore(jp_fetch, taken["id"], kernel_id=kernel.id)
    assert job["status"] == "done", job
    assert (await call(jp_fetch, "GET", "kernels", kernel.id))["death"] is None
    fresh = await start_kernel(kernel.id)
    assert (await fresh.run("print(x)")).strip() == "42"


@pytest.mark.usefixtures("snapshot_kernelspec")
async def test_a_kernel_without_a_snapshot_says_so(jp_fetch: Fetch, start_kernel: Any) -> None:
    kernel = await start_kernel()
    await kernel.run("x = 1")
    status = await call(jp_fetch, "GET", "kernels", kernel.id)
    os.kill(status["inner_pid"], signal.SIGKILL)
    death = await _died(jp_fetch, kernel.id)
    assert death["snapshot_id"] is None
    assert [c["first_line"] for c in death["cells_since"]] == ["x = 1"]
    await _running(jp_fetch, kernel.id)  # restarted before the server stops


@pytest.mark.usefixtures("snapshot_kernelspec")
async def test_restore_on_death_brings_the_snapshot_back(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any
) -> None:
    manager_of(jp_serverapp).restore_on_death = True
    kernel = await start_kernel()
    await kernel.run("x = 42")
    taken = (await snapshot(jp_fetch, kernel.id))["result"]
    await kernel.run("y = 1")
    status = await call(jp_fetch, "GET", "kernels", kernel.id)
    os.kill(status["inner_pid"], signal.SIGKILL)

    async def restored() -> bool:
        death = (await call(jp_fetch, "GET", "kernels", kernel.id))["death"]
        return bool(death and (death["restore"] or {}).get("status") == "done")

    await until(restored, timeout=120)
    death = (await call(jp_fetch, "GET", "kernels", kernel.id))["death"]
    assert death["restore"]["automatic"] is True
    assert death["snapshot_id"] == taken["id"]
    assert [c["first_line"] for c in death["cells_since"]] == ["y = 1"]
    fresh = await start_kernel(kernel.id)
    assert (await fresh.run("print(x)")).strip() == "42"
    await call(jp_fetch, "PATCH", "kernels", kernel.id, body={"dismiss_death": True})
    assert (await call(jp_fetch, "GET", "kernels", kernel.id))["death"] is None


def test_death_reasons_in_words() -> None:
    assert Death(-9, oom=True, memory_bytes=int(14.2 * 2**30)).reason == (
        "killed by the out-of-memory killer at 14.2 GiB"
    )
    assert Death(-9, oom=True, memory_limit=512 << 20).reason == (
        "killed by the out-of-memory killer (memory limit 512.0 MiB)"
    )
    assert Death(-15).reason == "ended by SIGTERM"
    assert Death(-6).reason == "crashed: it aborted (SIGABRT)"
    assert Death(3).reason == "exited with status 3"
    assert Death(0).reason == "exited by itself"
    assert Death(None).reason == "ended; how is not known on this machine"
    death = Death(-9, oom=True, memory_bytes=1 << 30, wrapper=True)
    assert Death.from_dict(death.to_dict()) == death


# ---------------------------------------------------------------- during a dump

#: A kernel-like tree for CRIU to seize: the init of its own PID namespace (as a kernel
#: is, kernel_wrapper/supervisor.py), with enough threads that seizing them takes a while.
SEIZED_TREE = """
import os, sys, threading
os.setsid()
stop = threading.Event()
for _ in range(200):
    threading.Thread(target=stop.wait, daemon=True).start()
print("ready", flush=True)
stop.wait()
"""


def test_a_dump_ends_when_its_kernel_dies_while_criu_seizes_it(criu: Criu, tmp_path: Path) -> None:
    """Killed while CRIU seizes its threads, a kernel (the init of its PID namespace)
    cannot finish dying until CRIU reaps the threads it traces, while CRIU waits for
    another of them to stop: without core/criu/deathwatch.py both wait for ever (a cell
    checkpoint's dump hung so in a fault test, and every dump behind it). The dump must
    end with an error that says why, CRIU gone, the kernel reaped. The kill is sent when
    CRIU's log says it seizes threads; a few tries, until one lands there (CRIU fails by
    itself on a kill that lands elsewhere)."""
    stopped = []
    for attempt in range(8):
        top = tmp_path / str(attempt)
        images, work = top / "images", top / "work"
        for path in (images, work):
            path.mkdir(parents=True)
        launcher = subprocess.Popen(
            ["unshare", "--pid", "--fork", sys.executable, "-c", SEIZED_TREE],
            cwd=top,  # where CRIU's parasite mounts its /proc
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert launcher.stdout is not None
            assert launcher.stdout.readline() == "ready\n"
            (root,) = proctree.children(launcher.pid)
            log = work / "dump.log"

            def kill_at_seize(root: int = root, log: Path = log) -> None:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    with contextlib.suppress(OSError):
                        if b"Seizing" in log.read_bytes():
                            break
                    time.sleep(0.0005)
                os.kill(root, signal.SIGKILL)

            killer = threading.Thread(target=kill_at_seize, daemon=True)
            killer.start()
            with pytest.raises(DumpError) as failed:
                # A bound for the test alone: the dump ends in about two seconds.
                asyncio.run(
                    asyncio.wait_for(criu.dump(root, images, work, leave_running=True), 120)
                )
            killer.join()
            launcher.wait(timeout=60)  # the kernel is reaped: the namespace emptied
            assert not [p for p in proctree.all_pids() if _dumps_into(p, images)]
            if "CRIU was stopped" in failed.value.message:
                stopped.append(attempt)
                break
        finally:
            launcher.kill()
            launcher.wait()
            launcher.stdout.close()
    assert stopped, "no kill landed while CRIU seized the threads in 8 tries"


def test_the_death_watch_kills_only_a_dump_whose_tree_ended(tmp_path: Path) -> None:
    """The watch of core/criu/deathwatch.py on real processes (a stand-in for CRIU):
    nothing while the tree lives; once its root ended, the stand-in killed, and said; not
    once CRIU has written the inventory (a suspend's CRIU ends the tree itself after it)."""
    for written in (False, True):
        images = tmp_path / str(written)
        images.mkdir()
        root = subprocess.Popen(["sleep", "600"])
        stand_in = subprocess.Popen(["sleep", "600"])
        try:
            with TreeDeathWatch(root.pid, images, stand_in.kill) as watch:
                time.sleep(10 * WATCH_SECONDS)
                assert stand_in.poll() is None  # the tree lives
                if written:
                    (images / INVENTORY).write_bytes(b"")
                root.kill()
                root.wait()
                # Killed after the grace (waited for long); else not within it and more.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    stand_in.wait(timeout=DEATH_GRACE_SECONDS + (1 if written else 60))
            assert watch.killed is (not written)
            assert (stand_in.poll() is not None) is (not written)
        finally:
            for process in (root, stand_in):
                process.kill()
                process.wait()


def _dumps_into(pid: int, images: Path) -> bool:
    with contextlib.suppress(OSError):
        return str(images).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    return False
