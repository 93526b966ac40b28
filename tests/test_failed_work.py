"""Failed work cleans up after itself at once (issue 9): a dump whose wrapper was killed,
a dump cancelled while CRIU writes, and a dump into a full work directory, through a real
jupyter_server, real kernels and real CRIU. (Failed puts and downloads of the stores:
tests/test_store.py.)"""

from __future__ import annotations

import asyncio
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_ext.core import proctree
from jupyter_ext.core.criu.engine import Criu
from jupyter_ext.core.leftovers import lock_path, remove_orphaned_dumps, remove_unlocked

from .support.jupyter_api import Fetch, call, server_config, wait_job
from .support.tmpfs import small_disk

pytestmark = pytest.mark.usefixtures("criu", "snapshot_kernelspec")

BIG_STATE = "import os; blob = os.urandom({mib} << 20); marker = 'kept'"


@pytest.fixture
def small_work_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB work directory: too small for a kernel holding 160 MiB."""
    with small_disk(tmp_path / "small", "64m") as path:
        yield path


@pytest.fixture
def jp_server_config(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    config = server_config(tmp_path)
    if "small_work_disk" in request.fixturenames:
        work = request.getfixturevalue("small_work_disk") / "work"
        config["SnapshotExtensionApp"]["work_dir"] = str(work)
    return config


async def start_job(jp_fetch: Fetch, kind: str, kernel_id: str) -> dict[str, Any]:
    if kind == "snapshot":
        started = await call(jp_fetch, "POST", body={"kernel_id": kernel_id})
    else:
        started = await call(jp_fetch, "POST", "kernels", kernel_id, "suspend")
    job: dict[str, Any] = started["job"]
    return job


@pytest.mark.parametrize("kind", ["snapshot", "suspend"])
async def test_a_killed_wrapper_leaves_no_partial_dump(
    jp_fetch: Fetch, start_kernel: Any, tmp_path: Path, kind: str
) -> None:
    """SIGKILL of the wrapper while CRIU writes the images: the request fails with
    wrapper-unavailable, and its partial dump (the kernel's size) is gone at once."""
    kernel = await start_kernel()
    await kernel.run(BIG_STATE.format(mib=300))
    wrapper_pid = int((await call(jp_fetch, "GET", "kernels", kernel.id))["wrapper_pid"])
    where = tmp_path / "work" / ("staging" if kind == "snapshot" else "suspended")
    job = await start_job(jp_fetch, kind, kernel.id)
    writing: list[Path] = []
    while not writing:
        writing = list(where.glob(".*.partial-*/images/pages-*.img"))
        assert (await call(jp_fetch, "GET", "jobs", job["id"]))["status"] == "running"
        await asyncio.sleep(0.005)
    os.kill(wrapper_pid, signal.SIGKILL)

    job = await wait_job(jp_fetch, job)
    assert job["status"] == "failed", job
    assert job["error"]["code"] == "wrapper-unavailable", job
    assert list(where.iterdir()) == []
    assert list((tmp_path / "work" / "staging").iterdir()) == []
    assert (await call(jp_fetch, "GET"))["snapshots"] == []


def test_a_cancelled_dump_returns_once_its_criu_has_ended(criu: Criu, tmp_path: Path) -> None:
    """A dump cancelled while CRIU writes the images (its kernel died, its wrapper ends)
    returns once CRIU has ended, not killed: the folder its caller then removes stays
    gone (a fault test found CRIU's last files in one), and the process dumped runs on,
    neither stopped nor traced."""
    images, work = tmp_path / "images", tmp_path / "work"
    images.mkdir()
    work.mkdir()

    async def cancel_while_writing(pid: int) -> list[int]:
        dump = asyncio.create_task(criu.dump(pid, images, work, leave_running=True))
        while not list(images.glob("pages-*.img")):
            assert not dump.done(), "the dump ended before it wrote pages"
            await asyncio.sleep(0.002)
        dump.cancel()
        with pytest.raises(asyncio.CancelledError):
            await dump
        return [
            pid for pid in proctree.descendants(os.getpid()) if proctree.process_name(pid) == "criu"
        ]

    with subprocess.Popen(
        [sys.executable, "-c", BIG_STATE.format(mib=300) + "; print(marker, flush=True); input()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as holder:
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline() == "kept\n"
            running = asyncio.run(cancel_while_writing(holder.pid))
            assert not running, f"CRIU still runs after its dump was cancelled: {running}"
            shutil.rmtree(images)
            time.sleep(0.5)
            assert not images.exists()
            status = Path(f"/proc/{holder.pid}/status").read_text()
            assert re.search(r"^State:\s+S", status, re.M), status
            assert re.search(r"^TracerPid:\s+0$", status, re.M), status
            assert holder.poll() is None
        finally:
            holder.kill()


@pytest.mark.usefixtures("small_work_disk")
async def test_a_dump_into_a_full_work_directory_says_so(
    jp_fetch: Fetch, start_kernel: Any, small_work_disk: Path
) -> None:
    """CRIU fails with ENOSPC: the message says the disk is full, where, and the kernel's
    memory against the free space; nothing is left there, and the kernel runs on."""
    kernel = await start_kernel()
    await kernel.run(BIG_STATE.format(mib=160))
    job = await wait_job(
        jp_fetch, (await call(jp_fetch, "POST", body={"kernel_id": kernel.id}))["job"]
    )
    assert job["status"] == "failed", job
    error = job["error"]
    message = error["message"]
    staging = small_work_disk / "work" / "staging"
    assert error["code"] == "dump-failed", error
    assert f"The disk of the work directory {staging} is full" in message, message
    needed = re.search(r"the dump needs about ([\d.]+) MiB \(the kernel's memory\)", message)
    assert needed, message
    assert float(needed[1]) >= 160, message  # the 160 MiB it holds, and the interpreter
    assert "MiB of 64.0 MiB are free" in message, message
    assert "No space left on device" in error["log_excerpt"], error
    assert list(staging.iterdir()) == []
    assert (await kernel.run("print(marker, len(blob) >> 20)")).split() == ["kept", "160"]


def test_dumps_of_a_server_that_died_are_removed_at_its_next_start(tmp_path: Path) -> None:
    """A server SIGKILLed mid-dump cannot clean up: its lock beside the dump is free
    afterwards, so the next start removes that dump's partial folders at once; a dump
    whose lock another live server process holds is left alone."""
    staging = tmp_path / "staging"
    dead, live = staging / ("d" * 32), staging / ("e" * 32)
    for dest in (dead, live):
        (staging / f".{dest.name}.partial-0123abcd" / "images").mkdir(parents=True)
        (staging / f".{dest.name}.partial-0123abcd" / "images" / "pages-1.img").write_bytes(b"x")
        lock_path(dest).touch()
    holder = subprocess.Popen(["flock", str(lock_path(live)), "sleep", "600"])
    try:
        while not _locked(lock_path(live)):
            assert holder.poll() is None
        removed = remove_orphaned_dumps(staging)
    finally:
        holder.kill()
        holder.wait()
    assert removed == [staging / f".{dead.name}.partial-0123abcd"]
    assert sorted(p.name for p in staging.iterdir()) == [
        f".{live.name}.lock",
        f".{live.name}.partial-0123abcd",
    ]


def _locked(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_downloads_of_a_server_that_died_are_removed_at_its_next_start(tmp_path: Path) -> None:
    """Restore copies and downloads stay locked while in use (the store while it
    downloads, the manager until the restore removed the copy): a start removes the
    unlocked ones at once and leaves one another live process holds."""
    cache = tmp_path / "cache"
    dead, fetching, live = cache / "a-1", cache / ".b-2.fetching-0123abcd", cache / "c-3"
    for path in (dead, fetching, live):
        (path / "images").mkdir(parents=True)
        (path / "images" / "pages-1.img").write_bytes(b"x")
    holder = subprocess.Popen(["flock", str(live), "sleep", "600"])
    try:
        while not _locked(live):
            assert holder.poll() is None
        removed = remove_unlocked(cache)
    finally:
        holder.kill()
        holder.wait()
    assert removed == [fetching, dead]
    assert list(cache.iterdir()) == [live]
