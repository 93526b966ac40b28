"""The server extension against a real jupyter_server, real kernels and real CRIU."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from tornado.httpclient import HTTPClientError

from jupyter_ext.core import proctree
from jupyter_ext.core.protocol.control import EXIT_PORT_IN_USE

from .support.jupyter_api import (
    Fetch,
    call,
    damage_chunk,
    error_of,
    events_of,
    manager_of,
    middle_chunk,
    restore,
    server_config,
    snapshot,
    until,
    wait_job,
)

pytestmark = pytest.mark.usefixtures("criu", "snapshot_kernelspec")


@pytest.fixture
def jp_server_config(tmp_path: Path) -> dict[str, Any]:
    return server_config(tmp_path)


async def test_create_list_restore_in_place_delete(jp_fetch: Fetch, start_kernel: Any) -> None:
    kernel = await start_kernel()
    await kernel.run("state = {'answer': 42}")
    started = await call(jp_fetch, "POST", body={"kernel_id": kernel.id})
    job = await wait_job(jp_fetch, started["job"])
    assert job["status"] == "done", job
    snapshot = job["result"]
    assert snapshot["status"] == "complete"
    assert snapshot["trigger"] == "manual"
    assert snapshot["stored_bytes"] > 0

    listed = (await call(jp_fetch, "GET"))["snapshots"]
    assert [s["id"] for s in listed] == [snapshot["id"]]
    assert (await call(jp_fetch, "GET", kernel_id=kernel.id))["snapshots"][0]["id"] == snapshot[
        "id"
    ]
    assert (await call(jp_fetch, "GET", trigger="periodic"))["snapshots"] == []
    assert (await call(jp_fetch, "GET", snapshot["id"]))["lineage"] == snapshot["lineage"]

    await kernel.run("state['answer'] = 0")
    restored = await call(
        jp_fetch, "POST", snapshot["id"], "restore", body={"kernel_id": kernel.id}
    )
    job = await wait_job(jp_fetch, restored["job"])
    assert job["status"] == "done", job
    assert (await kernel.run("print(state['answer'])")).strip() == "42"

    await call(jp_fetch, "DELETE", snapshot["id"])
    assert (await call(jp_fetch, "GET"))["snapshots"] == []
    code, _error = await error_of(jp_fetch, "GET", snapshot["id"])
    assert code == 404


async def test_restore_into_new_kernel_attached_to_notebook(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any, jp_root_dir: Path
) -> None:
    (jp_root_dir / "work").mkdir()
    response = await jp_fetch(
        "api",
        "sessions",
        method="POST",
        body=json.dumps(
            {"path": "work/a.ipynb", "type": "notebook", "kernel": {"name": "python3-snapshot"}}
        ),
    )
    session = json.loads(response.body)
    kernel = await start_kernel(session["kernel"]["id"])
    await kernel.run("import os; where = os.getcwd(); value = 'kept'")
    job = await wait_job(
        jp_fetch, (await call(jp_fetch, "POST", body={"kernel_id": kernel.id}))["job"]
    )
    snapshot = job["result"]
    assert snapshot["notebook_path"] == "work/a.ipynb"
    assert (await call(jp_fetch, "GET", path="work/a.ipynb"))["snapshots"][0]["id"] == snapshot[
        "id"
    ]

    await jp_serverapp.kernel_manager.shutdown_kernel(kernel.id, now=True)
    job = await wait_job(jp_fetch, (await call(jp_fetch, "POST", snapshot["id"], "restore"))["job"])
    assert job["status"] == "done", job
    new_kernel_id = job["result"]["kernel_id"]
    assert new_kernel_id != kernel.id
    assert job["result"]["session"]["path"] == "work/a.ipynb"
    sessions = json.loads((await jp_fetch("api", "sessions")).body)
    assert [s["kernel"]["id"] for s in sessions if s["path"] == "work/a.ipynb"] == [new_kernel_id]
    restored = await start_kernel(new_kernel_id)
    assert (await restored.run("print(value, where == os.getcwd())")).strip() == "kept True"
    # Restarted, it starts fresh as any kernel does: its first wrapper took the server's
    # one-shot request to wait for the restore.
    await jp_fetch("api", "kernels", new_kernel_id, "restart", method="POST", body="{}")
    restarted = await start_kernel(new_kernel_id)
    assert (await restarted.run("print('value' in globals())")).strip() == "False"


async def test_a_restore_whose_new_kernel_found_a_port_taken_starts_another(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any, snapshot_kernelspec: str, tmp_path: Path
) -> None:
    """jupyter_client picks free ports and closes them; another process may take one
    before the new wrapper binds it, and the wrapper exits with EXIT_PORT_IN_USE (CI:
    another test's kernel connected from it). A restore into a new kernel then starts
    another on new ports, as jupyter_client's restarter does for any kernel, instead of
    failing with "the new kernel's wrapper exited". Here the kernelspec's command exits
    so once, as the wrapper does, when the test arms it."""
    kernel = await start_kernel()
    await kernel.run("value = 'kept'")
    job = await snapshot(jp_fetch, kernel.id)
    assert job["status"] == "done", job
    spec_file = Path(snapshot_kernelspec) / "kernel.json"  # installed for this test
    spec = json.loads(spec_file.read_text())
    armed = tmp_path / "port-taken-once"
    armed.touch()
    shim = f'if rm "$0" 2>/dev/null; then exit {EXIT_PORT_IN_USE}; fi; exec "$@"'
    spec["argv"] = ["sh", "-c", shim, str(armed), *spec["argv"]]
    spec_file.write_text(json.dumps(spec))
    # Without root a restored kernel keeps its process ids: the original must end first.
    await jp_serverapp.kernel_manager.shutdown_kernel(kernel.id, now=True)
    before = set(jp_serverapp.kernel_manager.list_kernel_ids())

    job = await restore(jp_fetch, job["result"]["id"])
    assert job["status"] == "done", job
    assert not armed.exists(), "the first new kernel did not find its port taken"
    new_kernel_id = job["result"]["kernel_id"]
    assert set(jp_serverapp.kernel_manager.list_kernel_ids()) - before == {new_kernel_id}
    restored = await start_kernel(new_kernel_id)
    assert (await restored.run("print(value)")).strip() == "kept"


async def test_a_restore_says_which_shared_memory_names_another_process_holds(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any
) -> None:
    """A /dev/shm name of the snapshot that a live process holds here (this test maps the
    killed kernel's segment) gives the restored kernel a private copy: the restore's job
    result names the file and the process (REST), and so does ``jupyter snapshot restore``
    (here in place of the restored kernel)."""
    import mmap
    import signal
    import sys

    from jupyter_ext.core.carried.shmfiles import SHM_DIR

    kernel = await start_kernel()
    code = "from multiprocessing import shared_memory\n"
    code += "block = shared_memory.SharedMemory(create=True, size=1 << 20)\nprint(block.name)"
    name = (await kernel.run(code)).strip()
    snapshot_id = (await snapshot(jp_fetch, kernel.id))["result"]["id"]
    wrapper = (await call(jp_fetch, "GET", "kernels", kernel.id))["wrapper_pid"]
    tree = [wrapper, *proctree.descendants(wrapper)]
    for sig in (signal.SIGSTOP, signal.SIGKILL):  # none of it (its resource tracker)
        for pid in tree:  # may see another end and clean up: the name stays behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    await until(lambda: _all_dead(tree))
    me = {"pid": os.getpid(), "process": Path("/proc/self/comm").read_text().strip()}
    try:
        with open(SHM_DIR / name, "r+b") as held, mmap.mmap(held.fileno(), 0):
            job = await restore(jp_fetch, snapshot_id)
            assert job["status"] == "done", job
            (private,) = job["result"]["private_shm"]
            assert private["name"] == name
            assert me in private["held_by"]
            cli = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "jupyter_ext.cli", "restore", snapshot_id,
                f"--kernel-id={job['result']['kernel_id']}",
                f"--url={jp_serverapp.connection_url}",
                f"--token={jp_serverapp.identity_provider.token}",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            out, err = await cli.communicate()
            assert cli.returncode == 0, err.decode()
        holder = f"{me['process']} (pid {me['pid']})"
        assert f"/dev/shm/{name}: private copy (the name is {holder}'s here: " in out.decode()
    finally:
        (SHM_DIR / name).unlink(missing_ok=True)


async def test_a_restore_in_place_leaves_a_shared_memory_name_another_process_holds(
    jp_fetch: Fetch, start_kernel: Any
) -> None:
    """The kernel saved before a restore in place (a dump that ends it) gives up the
    /dev/shm names its snapshot carries, except one a live process outside it holds too:
    that name stays that process's, and the restored kernel gets a private copy, said in
    the result (before: the name was removed under the other process, and the restore made
    it again, so later attaches reached the kernel's copy, not the segment it shared)."""
    import mmap

    from jupyter_ext.core.carried.shmfiles import SHM_DIR

    kernel = await start_kernel()
    code = "from multiprocessing import shared_memory\n"
    code += "block = shared_memory.SharedMemory(create=True, size=1 << 20)\n"
    code += "block.buf[:5] = b'first'\nprint(block.name)"
    name = (await kernel.run(code)).strip()
    snapshot_id = (await snapshot(jp_fetch, kernel.id))["result"]["id"]
    try:
        with open(SHM_DIR / name, "r+b") as held, mmap.mmap(held.fileno(), 0) as shared:
            job = await restore(jp_fetch, snapshot_id, kernel_id=kernel.id)
            assert job["status"] == "done", job
            assert (SHM_DIR / name).stat().st_ino == os.fstat(held.fileno()).st_ino
            (private,) = job["result"]["private_shm"]
            assert private["name"] == name
            assert os.getpid() in [each["pid"] for each in private["held_by"]]
            shared[:5] = b"other"  # the restored kernel's copy is its own
        after = "print(bytes(block.buf[:5]))"
        assert (await kernel.run(after)).strip() == "b'first'"
    finally:
        (SHM_DIR / name).unlink(missing_ok=True)


async def _all_dead(pids: list[int]) -> bool:
    return not any(proctree.is_alive(pid) for pid in pids)


async def test_bad_requests_get_clear_errors(jp_fetch: Fetch, start_kernel: Any) -> None:
    kernel = await start_kernel()
    code, error = await error_of(jp_fetch, "GET", "0" * 32)
    assert code == 404
    code, error = await error_of(jp_fetch, "GET", "not-an-id")
    assert code == 400
    assert "not a snapshot id" in error["message"]
    code, error = await error_of(jp_fetch, "POST", body={"kernel_id": "../../etc"})
    assert code == 400
    code, error = await error_of(
        jp_fetch, "POST", body={"kernel_id": "0" * 8 + "-0000-0000-0000-" + "0" * 12}
    )
    assert code == 404
    code, error = await error_of(jp_fetch, "POST", body=["not", "an", "object"])
    assert code == 400
    code, _ = await error_of(jp_fetch, "GET", "jobs", "nope")
    assert code == 404
    with pytest.raises(HTTPClientError) as info:
        await call(jp_fetch, "GET", path="../secret.ipynb")
    assert info.value.code == 400
    with pytest.raises(HTTPClientError) as info:
        await call(jp_fetch, "GET", path="/etc/passwd")
    assert info.value.code == 400

    # A second create on a busy kernel: 409 while the first runs.
    await kernel.run("import numpy as np; a = np.random.random(64 * 1024 * 1024 // 8)")
    first = await call(jp_fetch, "POST", body={"kernel_id": kernel.id})
    code, error = await error_of(jp_fetch, "POST", body={"kernel_id": kernel.id})
    assert code == 409
    assert first["job"]["id"] in error["hint"]
    assert (await wait_job(jp_fetch, first["job"]))["status"] == "done"


@pytest.mark.parametrize("damaged", ["images/pages-", "images/core-"])
async def test_corrupt_snapshot_fails_its_restore_before_criu(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any, tmp_path: Path, damaged: str
) -> None:
    """The request is answered once the manifest is checked; the download's hash check
    fails the job, and the kernel that was to be replaced runs on untouched. A restore in
    place is never lazy: the kernel's memory is downloaded and checked first too."""
    kernel = await start_kernel()
    await kernel.run("x = 1")
    job = await wait_job(
        jp_fetch, (await call(jp_fetch, "POST", body={"kernel_id": kernel.id}))["job"]
    )
    damage_chunk(manager_of(jp_serverapp), job["result"]["id"], damaged)
    restore = await call(
        jp_fetch, "POST", job["result"]["id"], "restore", body={"kernel_id": kernel.id}
    )
    failed = await wait_job(jp_fetch, restore["job"])
    assert failed["status"] == "failed"
    assert failed["error"]["code"] == "snapshot-corrupt"
    assert failed["phase"] == "downloading"
    assert (await kernel.run("print(x)")).strip() == "1"
    assert not list((tmp_path / "work" / "cache").iterdir())
    assert not manager_of(jp_serverapp).lending.lent


@contextlib.contextmanager
def memory_held(manager: Any, snapshot_id: str) -> Iterator[threading.Event]:
    """Lazy restores of ``snapshot_id`` started meanwhile get all of the kernel's memory
    but the :func:`middle_chunk` of its largest array, which waits until the event
    yielded is set (at the latest when the block ends): the restored kernel runs, and is
    "transferring" until then, however fast or slow the machine."""
    store = manager.store
    real_open = store.open_images
    released = threading.Event()
    _path, held = middle_chunk(manager, snapshot_id, "images/pages-")

    def open_held(snapshot_id: str) -> Any:
        images = real_open(snapshot_id)
        reader = images._reader
        real_read = reader.read

        def read(group: list[Any], check: bool = True) -> Any:
            # The read that brings the held chunk, not one whose range merely spans it:
            # two chunks either side of it, read in one request (pack.coalesce), are
            # what criu restore itself needs, and holding them stalled the restore.
            if any(ref.hash == held.hash for ref in group):
                assert released.wait(300), "the test never released the held chunk"
            return real_read(group, check)

        reader.read = read
        return images

    store.open_images = open_held
    try:
        yield released
    finally:
        released.set()
        store.open_images = real_open


@pytest.mark.needs_root("lazy restore, and a copy of a running kernel beside it")
async def test_damaged_memory_stops_a_lazily_restored_kernel(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any, tmp_path: Path
) -> None:
    """A restore into a new kernel is lazy: it runs while its memory is read from the
    store, each chunk checked against its sha256. A damaged one never reaches the kernel:
    the new kernel is stopped, its status and a "failed" event say why, and what it read
    from is given back. The kernel the snapshot was taken of is not touched."""
    events = events_of(jp_serverapp)
    manager = manager_of(jp_serverapp)
    manager.lazy_from_store = True
    kernel = await start_kernel()
    # Random floats: every chunk of the array is its own (none shared with a stack page
    # that criu restore reads before the kernel runs).
    await kernel.run("import numpy as np; a = np.random.default_rng(1).random(16 << 20); x = 1")
    snapshot_id = (await snapshot(jp_fetch, kernel.id))["result"]["id"]
    damaged = damage_chunk(manager, snapshot_id, "images/pages-")
    with memory_held(manager, snapshot_id):  # the damage is read after the kernel runs
        restore = await call(jp_fetch, "POST", snapshot_id, "restore")
        job = await wait_job(jp_fetch, restore["job"])
        assert job["status"] == "done", job
    new_kernel = job["result"]["kernel_id"]
    deadline = time.monotonic() + 120
    while (lazy := (await call(jp_fetch, "GET", "kernels", new_kernel))["lazy_restore"]).get(
        "state"
    ) == "transferring":
        assert time.monotonic() < deadline, lazy
        await asyncio.sleep(0.2)
    assert lazy["state"] == "failed", lazy
    error = lazy["error"]
    assert error["code"] == "snapshot-corrupt", error
    assert "is damaged" in error["message"], error
    assert damaged in error["message"], error
    assert (await call(jp_fetch, "GET", "kernels", new_kernel))["state"] == "dead"
    while not any(e["action"] == "failed" and e.get("kernel_id") == new_kernel for e in events):
        assert time.monotonic() < deadline, events
        await asyncio.sleep(0.1)
    assert (
        await kernel.run("print(x, a.sum() == np.random.default_rng(1).random(16 << 20).sum())")
    ).strip() == "1 True"
    await manager.lending.settled()
    assert not manager.lending.lent
    assert not list((tmp_path / "work" / "cache").iterdir())


@pytest.mark.needs_root("lazy restore, and a copy of a running kernel beside it")
async def test_a_snapshot_a_kernel_still_reads_is_deleted_once_its_pages_are_in(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any, tmp_path: Path
) -> None:
    """A kernel restored lazily from the store reads its memory from the snapshot as it
    runs: deleting the snapshot meanwhile (or retention) must not take it away."""
    manager = manager_of(jp_serverapp)
    manager.lazy_from_store = True
    kernel = await start_kernel()
    # Random floats: 64 MiB that neither compress nor deduplicate.
    await kernel.run("import numpy as np; a = np.random.default_rng(5).random(8 << 20)")
    snapshot_id = (await snapshot(jp_fetch, kernel.id))["result"]["id"]
    store = manager.store
    # A chunk of the array waits until the retention below has run (pages slowed down
    # instead once all came in before the test acted, on a loaded machine).
    with memory_held(manager, snapshot_id) as released:
        restore = await call(jp_fetch, "POST", snapshot_id, "restore")
        restored = await wait_job(jp_fetch, restore["job"])
        assert restored["status"] == "done", restored
        new_kernel = restored["result"]["kernel_id"]
        status = await call(jp_fetch, "GET", "kernels", new_kernel)
        assert status["lazy_restore"]["state"] == "transferring", status["lazy_restore"]
        assert [lent.snapshot_id for lent in manager.lending.lent] == [snapshot_id]
        manager.keep_last = 1  # the next snapshot of that kernel would retire this one
        await snapshot(jp_fetch, kernel.id)
        assert store.get(snapshot_id), "retention passed it over"
        released.set()

    # Waits for the rest of the pages (longer than a default request on a slow machine).
    await jp_fetch("api", "snapshots", snapshot_id, method="DELETE", request_timeout=300)
    assert not manager.lending.lent
    status = await call(jp_fetch, "GET", "kernels", new_kernel)
    assert status["lazy_restore"]["state"] == "complete", status["lazy_restore"]
    code, _error = await error_of(jp_fetch, "GET", snapshot_id)
    assert code == 404
    restored_kernel = await start_kernel(new_kernel)
    same = "print(a.sum() == np.random.default_rng(5).random(8 << 20).sum())"
    assert (await restored_kernel.run(same)).strip() == "True"


@contextlib.asynccontextmanager
async def restored_lazily(
    jp_fetch: Fetch, start_kernel: Any, manager: Any, seed: int
) -> AsyncIterator[tuple[dict[str, Any], threading.Event]]:
    """A kernel holding ``a`` (128 MiB of ``default_rng(seed)``), snapshotted and restored
    lazily from the store into a new kernel whose memory is held back (one chunk) until
    ``released`` is set: its status (transferring) and ``released``."""
    manager.lazy_from_store = True
    kernel = await start_kernel()
    await kernel.run(f"import numpy as np; a = np.random.default_rng({seed}).random(16 << 20)")
    snapshot_id = (await snapshot(jp_fetch, kernel.id))["result"]["id"]
    with memory_held(manager, snapshot_id) as released:
        restore = await call(jp_fetch, "POST", snapshot_id, "restore")
        restored = await wait_job(jp_fetch, restore["job"])
        assert restored["status"] == "done", restored
        new_kernel = restored["result"]["kernel_id"]
        status = await call(jp_fetch, "GET", "kernels", new_kernel)
        assert status["lazy_restore"]["state"] == "transferring", status["lazy_restore"]
        yield {**status, "id": new_kernel}, released


@pytest.mark.needs_root("lazy restore")
async def test_a_lazy_restore_its_kernel_ends_on_purpose_has_not_failed(
    jp_fetch: Fetch,
    start_kernel: Any,
    jp_serverapp: Any,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A kernel shut down (on purpose: DELETE /api/kernels) while its memory still comes
    in lazily ends its lazy restore with it: no "failed" event, no error in the log, and
    what it read from is given back (issue 34 item 3)."""
    events = events_of(jp_serverapp)
    manager = manager_of(jp_serverapp)
    async with restored_lazily(jp_fetch, start_kernel, manager, seed=3) as (status, released):
        new_kernel = status["id"]
        capfd.readouterr()
        shutdown = asyncio.ensure_future(
            jp_fetch("api", "kernels", new_kernel, method="DELETE", request_timeout=120)
        )
        # jupyter_client interrupts the kernel's process group, then asks it to shut down;
        # the kernel's exit may wait for a page still held here, and jupyter_client then
        # ends the wrapper (SIGTERM) after half its shutdown_wait_time. Either way the
        # kernel process ends, and its lazy-pages daemon hangs up on the wrapper.
        inner = status["inner_pid"]
        while Path(f"/proc/{inner}").exists():
            await asyncio.sleep(0.05)
        released.set()
        await shutdown
    await manager.lending.settled()
    assert not manager.lending.lent
    assert not [e for e in events if e["action"] == "failed"], events
    log = capfd.readouterr().err
    assert "lazy restore ended with the kernel's shutdown" in log
    assert "[kernel_wrapper ERROR]" not in log, log[-3000:]


@pytest.mark.needs_root("lazy restore")
async def test_an_interrupt_during_a_lazy_restore_leaves_its_memory_coming(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    """jupyter_client interrupts a kernel with SIGINT to its whole process group (and ends
    one slow to shut down with SIGTERM to it). CRIU runs in a group of its own: the
    lazy-pages daemon serving a restored kernel its memory is not killed by the Stop
    button (before: the restore failed and the kernel, with its state, was gone)."""
    events = events_of(jp_serverapp)
    manager = manager_of(jp_serverapp)
    async with restored_lazily(jp_fetch, start_kernel, manager, seed=4) as (status, released):
        new_kernel = status["id"]
        wrapper = status["wrapper_pid"]
        daemons = [
            pid
            for pid in proctree.children(wrapper)
            if b"lazy-pages" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        assert daemons, "no lazy-pages daemon while the memory comes in"
        # The Stop button signals the wrapper's group, and the wrapper the kernel's.
        groups = {os.getpgid(wrapper), os.getpgid(status["inner_pid"])}
        assert not groups & {os.getpgid(pid) for pid in daemons}
        capfd.readouterr()
        await jp_fetch("api", "kernels", new_kernel, "interrupt", method="POST", body=b"")
        status = await call(jp_fetch, "GET", "kernels", new_kernel)
        assert status["lazy_restore"]["state"] == "transferring", status["lazy_restore"]
        released.set()
        for _ in range(600):
            status = await call(jp_fetch, "GET", "kernels", new_kernel)
            if status["lazy_restore"]["state"] != "transferring":
                break
            await asyncio.sleep(0.1)
    assert status["lazy_restore"]["state"] == "complete", status["lazy_restore"]
    assert not [e for e in events if e["action"] == "failed"], events
    assert "[kernel_wrapper ERROR]" not in capfd.readouterr().err
    restored_kernel = await start_kernel(new_kernel)
    same = "print(a.sum() == np.random.default_rng(4).random(16 << 20).sum())"
    assert (await restored_kernel.run(same)).strip() == "True"


async def test_incompatible_snapshot_is_422_before_any_download(
    jp_fetch: Fetch, start_kernel: Any, tmp_path: Path
) -> None:
    """A snapshot whose kernel had a file open that is gone here is refused by the request
    itself, from the stored manifest: before any download (which would also have found
    the damaged pack below)."""
    data = tmp_path / "data.txt"
    data.write_text("kept open\n")
    kernel = await start_kernel()
    await kernel.run(f"fh = open({str(data)!r})")
    job = await wait_job(
        jp_fetch, (await call(jp_fetch, "POST", body={"kernel_id": kernel.id}))["job"]
    )
    data.unlink()
    pack = max((tmp_path / "store").rglob("packs/*/*"), key=lambda p: p.stat().st_size)
    pack.chmod(0o600)  # packs are read-only (0400); root would not notice
    pack.write_bytes(bytes(pack.stat().st_size))
    code, error = await error_of(
        jp_fetch, "POST", job["result"]["id"], "restore", body={"kernel_id": kernel.id}
    )
    assert code == 422
    assert error["code"] == "snapshot-incompatible"
    assert str(data) in error["message"]
    assert (await kernel.run("print(fh.read())")).strip() == "kept open"


def test_gpu_errors_have_their_http_status() -> None:
    """A machine without CUDA checkpoint support is a 503 (as one without CRIU), a CUDA
    step that refused the kernel now a 409 (as a failed dump), also as the wrapper sends
    them over its control socket; an unfit GPU is a 422 (check_restore_compatible raises
    IncompatibleSnapshotError: test above). They used to be 500s."""
    from jupyter_ext.core.errors import SnapshotError
    from jupyter_ext.core.gpu import GpuCheckpointError, GpuUnavailableError
    from jupyter_ext.handlers import status_of

    unavailable = GpuUnavailableError("libcuda.so.1 not found", hint="Install the driver.")
    failed = GpuCheckpointError("cuCheckpointProcessLock failed", step="lock", pid=7)
    assert status_of(unavailable) == 503
    assert status_of(failed) == 409
    for error in (unavailable, failed):
        sent = SnapshotError.from_dict(error.to_dict())  # across the control socket
        assert status_of(sent) == status_of(error)


async def test_every_endpoint_needs_authentication(jp_fetch: Fetch) -> None:
    kernel = "00000000-0000-0000-0000-000000000000"
    for method, path in [
        ("GET", ""),
        ("POST", ""),
        ("GET", "/policy"),
        ("GET", "/kernels"),
        ("GET", f"/kernels/{kernel}"),
        ("PATCH", f"/kernels/{kernel}"),
        ("POST", f"/kernels/{kernel}/suspend"),
        ("POST", f"/kernels/{kernel}/resume"),
        ("GET", "/jobs/0123456789abcdef"),
        ("GET", "/" + "0" * 32),
        ("DELETE", "/" + "0" * 32),
        ("POST", "/" + "0" * 32 + "/restore"),
        ("POST", "/" + "0" * 32 + "/variables"),
    ]:
        body = "{}" if method in ("POST", "PATCH") else None
        with pytest.raises(HTTPClientError) as info:
            await jp_fetch(
                "api/snapshots" + path, method=method, body=body, headers={"Authorization": ""}
            )
        assert info.value.code == 403, (method, path, info.value.code)


async def test_policy_and_kernel_status(jp_fetch: Fetch, start_kernel: Any) -> None:
    policy = await call(jp_fetch, "GET", "policy")
    assert policy["store"] == "local"
    assert policy["idle_suspend_after"] == 0
    kernel = await start_kernel()
    status = await call(jp_fetch, "GET", "kernels", kernel.id)
    assert status["snapshots"] is True
    assert status["state"] == "running"
    assert status["periodic"] is True
    status = await call(jp_fetch, "PATCH", "kernels", kernel.id, body={"periodic": False})
    assert status["periodic"] is False
    kernels = (await call(jp_fetch, "GET", "kernels"))["kernels"]
    assert [k["kernel_id"] for k in kernels] == [kernel.id]


async def test_restart_and_shutdown_through_the_server(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any
) -> None:
    from jupyter_ext.core import proctree

    kernel = await start_kernel()
    await kernel.run("x = 1")
    before = await call(jp_fetch, "GET", "kernels", kernel.id)
    old = [before["wrapper_pid"], *proctree.descendants(before["wrapper_pid"])]
    await jp_fetch("api", "kernels", kernel.id, "restart", method="POST", body="{}")
    restarted = await start_kernel(kernel.id)
    assert (await restarted.run("print('x' in globals())")).strip() == "False"
    after = await call(jp_fetch, "GET", "kernels", kernel.id)
    assert after["wrapper_pid"] != before["wrapper_pid"]
    assert not any(proctree.is_alive(pid) for pid in old)
    await jp_fetch("api", "kernels", kernel.id, method="DELETE")
    now = [after["wrapper_pid"], *proctree.descendants(after["wrapper_pid"])]
    import asyncio

    for _ in range(100):
        if not any(proctree.is_alive(pid) for pid in now):
            break
        await asyncio.sleep(0.1)
    assert not any(proctree.is_alive(pid) for pid in now)


async def test_second_snapshot_of_an_idle_kernel_stores_little(
    jp_fetch: Fetch, start_kernel: Any
) -> None:
    import asyncio

    kernel = await start_kernel()
    # An idle kernel still dirties about 1-2 MB per snapshot (ZMQ reconnects, threads
    # waking up): 2 % of a kernel of a realistic size, a quarter GiB.
    await kernel.run(
        "import numpy as np; a = np.random.random(256 * 1024 * 1024 // 8)\n"
        "d = {i: str(i) for i in range(100000)}"
    )
    first = (await snapshot(jp_fetch, kernel.id))["result"]
    await asyncio.sleep(1)
    second = (await snapshot(jp_fetch, kernel.id))["result"]
    assert first["new_bytes"] == first["stored_bytes"]
    share = second["new_bytes"] / second["stored_bytes"]
    assert share <= 0.02, f"{share:.2%} new: {second}"


async def test_the_wrappers_settings_reach_snapshot_kernels_not_the_server(
    jp_fetch: Fetch, jp_serverapp: Any, start_kernel: Any
) -> None:
    """What a kernel wrapper reads of the extension's settings is in the environment of the
    snapshot kernels the server starts, not in the server's own (nor so in other kernels)."""
    from jupyter_ext.core.protocol.environment import ENV_LAZY_RESTORE, ENV_PID_FLOOR

    (app,) = jp_serverapp.extension_manager.extension_apps["jupyter_ext"]
    code = (
        f"import os; print(os.environ.get({ENV_LAZY_RESTORE!r}), os.environ.get({ENV_PID_FLOOR!r}))"
    )
    snapshot_kernel = await start_kernel()
    assert (await snapshot_kernel.run(code)).split() == ["1", str(app.kernel_pid_floor)]
    assert ENV_LAZY_RESTORE not in os.environ
    assert ENV_PID_FLOOR not in os.environ
    response = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": "python3"}))
    plain_kernel = await start_kernel(json.loads(response.body)["id"])
    assert (await plain_kernel.run(code)).split() == ["None", "None"]
