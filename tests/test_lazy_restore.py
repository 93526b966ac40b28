"""Lazy restore (issue 16.4): the restored kernel runs while its memory is served page by
page by the product's page server (jupyter_ext/core/lazypages/) to CRIU's lazy-pages
daemon; real CRIU, real kernels. A page that cannot be read kills the half-restored
kernel and puts the one it replaced back.

The snapshots here are taken with ``track_memory=False``: one level of images, whose
files these tests copy, cut and compare; a chain of levels (an incremental snapshot, or
one copied while the kernel ran) is restored lazily through its flat form, tested in
tests/test_tracking.py."""

from __future__ import annotations

import asyncio
import filecmp
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from jupyter_ext.core import proctree
from jupyter_ext.core.criu import Criu, check_asked
from jupyter_ext.core.doctor import check_lazy_pages
from jupyter_ext.core.errors import RestoreError, SnapshotCorruptError
from jupyter_ext.core.lazypages import (
    LAZY_MIN_BYTES,
    PAGE_SIZE,
    READ_ATTEMPTS,
    DirectoryPages,
    PageFetchError,
    PageServer,
    PageSource,
    PrefixedPages,
    RangeServer,
    parse_pagemap,
    read_pagemaps,
    restore_order,
    stage_pages_files,
)
from jupyter_ext.core.manifest import IMAGES_DIR, verify
from jupyter_ext.core.protocol.environment import ENV_LAZY_RESTORE, ENV_LAZY_RESTORE_MIN_BYTES
from jupyter_ext.core.store import LocalStore
from testkit.processes import KernelProcess, wait_until

from .support.tmpfs import small_disk

Factory = Callable[..., KernelProcess]

#: A kernel holding 64 MiB of numbers it can check after the restore.
STATE = (
    "import numpy as np; lazy_a = np.random.default_rng(7).random(8 << 20); "
    "lazy_sum = float(lazy_a.sum())"
)
CHECK = "print(float(lazy_a.sum()) == lazy_sum, lazy_a.nbytes)"
PAGES = re.compile(rf"{IMAGES_DIR}/pages-\d+\.img")


@pytest.fixture(autouse=True)
def _lazy_pages_here(criu: Criu) -> None:
    if not criu.supports_lazy_pages()[0]:
        pytest.skip("lazy pages are not supported on this machine")


def restore(kernel: KernelProcess, source: Path, **args: Any) -> dict[str, Any]:
    """A restore asked of the wrapper as the server asks it, lazily unless ``args`` say
    ``lazy=False`` (whether is the requester's decision: tests/test_lazy_plan.py)."""
    result: dict[str, Any] = kernel.control.request_sync(
        "restore", {"source": str(source), "lazy": True, **args}, timeout=300
    )
    return result


def lazy_state(kernel: KernelProcess) -> dict[str, Any]:
    state: dict[str, Any] = kernel.status()["lazy_restore"]
    return state


def settled(kernel: KernelProcess) -> dict[str, Any]:
    """The lazy restore's outcome, once every page is in or it failed."""
    wait_until(lambda: lazy_state(kernel).get("state") != "transferring", 120, "lazy pages")
    return lazy_state(kernel)


def only_the_kernel_left(kernel: KernelProcess) -> None:
    """No lazy-pages daemon, no CRIU, no half-restored tree: the wrapper's only child is
    its kernel."""
    status = kernel.status()
    assert proctree.children(kernel.process.pid) == [status["inner_pid"]]


def test_pagemap_decodes_to_the_pages_file(kernel_factory: Factory, tmp_path: Path) -> None:
    """The hand decoder agrees with CRIU: the present pages of every pagemap add up to
    its pages file, in order and apart; the heap is lazy, the stack is not. (One level:
    without tracking nothing is copied ahead; chains are tests/test_tracking.py's.)"""
    kernel = kernel_factory()
    kernel.execute(STATE)
    kernel.snapshot(tmp_path / "snap", track_memory=False)
    images = tmp_path / "snap" / IMAGES_DIR
    pagemaps = read_pagemaps(images)
    assert pagemaps
    for pagemap in pagemaps.values():
        assert pagemap.size == (images / pagemap.pages_file).stat().st_size
        ends = [e.end for e in pagemap.entries]
        starts = [e.vaddr for e in pagemap.entries]
        assert all(end <= start for end, start in zip(ends, starts[1:], strict=False))
        assert any(not e.lazy for e in pagemap.entries)  # the stack
        biggest = max(pagemap.entries, key=lambda e: e.nr_pages)
        if biggest.nr_pages > 13:
            offset, count = pagemap.locate(biggest.vaddr + 3 * PAGE_SIZE, 10)
            assert (offset, count) == (biggest.offset + 3 * PAGE_SIZE, 10)
            offset, count = pagemap.locate(biggest.vaddr + 3 * PAGE_SIZE, 1 << 30)
            assert count == biggest.nr_pages - 3  # never past its entry
    kernel_map = pagemaps[1]  # the kernel: PID 1 of its namespace, holding the array
    lazy = sum(e.nr_pages for e in kernel_map.entries if e.lazy) * PAGE_SIZE
    assert 64 << 20 <= lazy <= kernel_map.size
    damaged = (images / "pagemap-1.img").read_bytes()[:-3]
    with pytest.raises(SnapshotCorruptError, match=r"pagemap-1\.img cannot be read"):
        parse_pagemap(damaged, "pagemap-1.img")


def test_lazy_restore_in_place_keeps_the_kernel_state(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    kernel = kernel_factory()
    kernel.execute(STATE)
    kernel.snapshot(tmp_path / "snap", track_memory=False)
    kernel.execute("lazy_a[:] = 0")
    restore(kernel, tmp_path / "snap")
    assert kernel.execute(CHECK).strip() == "True 67108864"
    done = settled(kernel)
    assert done["state"] == "complete", done
    assert done["bytes"] >= 64 << 20
    only_the_kernel_left(kernel)
    # It is a kernel like any other: snapshotted again and restored again.
    kernel.snapshot(tmp_path / "again")
    kernel.execute("lazy_a[:] = 1")
    restore(kernel, tmp_path / "again")
    assert kernel.execute(CHECK).strip() == "True 67108864"
    assert settled(kernel)["state"] == "complete"


def test_pages_from_elsewhere_complete_the_local_images(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    """The store's way: every image but pages-*.img is here, pages come from a source;
    the restore ends with complete images (the snapshot verifies again)."""
    kernel = kernel_factory()
    kernel.execute(STATE)
    kernel.snapshot(tmp_path / "snap", track_memory=False)
    local = tmp_path / "local"
    shutil.copytree(tmp_path / "snap", local, ignore=shutil.ignore_patterns("pages-*.img"))
    assert not list((local / IMAGES_DIR).glob("pages-*.img"))
    kernel.execute("lazy_a[:] = 0")
    restore(kernel, local, verified=True, pages_from=str(tmp_path / "snap" / IMAGES_DIR))
    assert kernel.execute(CHECK).strip() == "True 67108864"
    assert settled(kernel)["state"] == "complete"
    for original in (tmp_path / "snap" / IMAGES_DIR).glob("pages-*.img"):
        assert filecmp.cmp(original, local / IMAGES_DIR / original.name, shallow=False)
    verify(local)
    only_the_kernel_left(kernel)


def test_a_disk_too_full_for_the_pages_gives_up_the_local_copy_not_the_kernel(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    """The local images sit on a disk with room for all but the kernel's memory: the
    kernel still gets every page from its source; only the local copy stays incomplete,
    and the status says why (so the server does not cache it)."""
    kernel = kernel_factory()
    kernel.execute(STATE)
    kernel.snapshot(tmp_path / "snap", track_memory=False)
    with small_disk(tmp_path / "small", "16m") as disk:
        local = disk / "local"
        shutil.copytree(tmp_path / "snap", local, ignore=shutil.ignore_patterns("pages-*.img"))
        kernel.execute("lazy_a[:] = 0")
        restore(
            kernel,
            local,
            verified=True,
            pages_from=str(tmp_path / "snap" / IMAGES_DIR),
            save_to=str(tmp_path / "saved"),  # the kernel it replaces: on the big disk
        )
        assert kernel.execute(CHECK).strip() == "True 67108864"
        done = settled(kernel)
        assert done["state"] == "complete", done
        assert "No space left" in done["local_copy_error"], done
        only_the_kernel_left(kernel)


def test_restore_straight_from_the_store(kernel_factory: Factory, tmp_path: Path) -> None:
    """Every file but pages-*.img comes from the store; the server process lends the
    wrapper the store's verified ranges (RangeServer); the kernel runs and the local
    images end up complete and intact."""
    kernel = kernel_factory()
    kernel.execute(STATE)
    kernel.snapshot(tmp_path / "snap", track_memory=False)
    store = LocalStore(tmp_path / "store")
    stored = store.put(tmp_path / "snap")
    local = tmp_path / "local"
    store.fetch(stored.manifest.id, local, skip=lambda path: PAGES.fullmatch(path) is not None)
    assert not list((local / IMAGES_DIR).glob("pages-*.img"))
    server = RangeServer(
        PrefixedPages(store.open_images(stored.manifest.id), f"{IMAGES_DIR}/"),
        tmp_path / "pages.sock",
    )
    try:
        kernel.execute("lazy_a[:] = 0")
        restore(kernel, local, verified=True, pages_from=server.address)
        assert kernel.execute(CHECK).strip() == "True 67108864"
        assert settled(kernel)["state"] == "complete"
    finally:
        server.close()
        store.close()
    verify(local)  # every pages file complete, each byte as the snapshot had it
    only_the_kernel_left(kernel)


def test_store_gone_mid_restore_puts_the_kernel_back(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    """The source ends half-way through the pages: each read is retried, then the
    restored kernel (frozen at its first missing page) is killed and the kernel that was
    running is back, its state intact, the error saying what happened."""
    kernel = kernel_factory()
    kernel.execute(STATE)
    kernel.snapshot(tmp_path / "snap", track_memory=False)
    kernel.execute("before_restore = 42")
    before = kernel.status()
    original = tmp_path / "snap" / IMAGES_DIR
    local = tmp_path / "local"
    shutil.copytree(tmp_path / "snap", local, ignore=shutil.ignore_patterns("pages-*.img"))
    stage_pages_files(local / IMAGES_DIR, DirectoryPages(original))  # what a store restore does
    gone = tmp_path / "gone"
    gone.mkdir()
    for pages in original.glob("pages-*.img"):
        with (gone / pages.name).open("wb") as fh:
            fh.write(pages.read_bytes()[: pages.stat().st_size // 2])
    restored_pid = None
    try:
        # CRIU's restorer touches lazy memory itself (TLS): the restore fails at once.
        restore(kernel, local, verified=True, pages_from=str(gone))
    except RestoreError as exc:
        error = exc.to_dict()
        assert lazy_state(kernel)["state"] == "failed"
    else:  # or, were the first pages in the first half, once the kernel runs
        restored_pid = kernel.status()["inner_pid"]
        outcome = settled(kernel)
        assert outcome["state"] == "failed", (
            f"{outcome}; the wrapper's log:\n{kernel.log()[-6000:]}"
        )
        error = outcome["error"]
    message = error["message"]
    assert "could not be read" in message
    assert "half-restored kernel was stopped" in message
    assert "put back" in message
    assert "lazy_restore" in error["hint"]
    wait_until(lambda: kernel.status()["state"] == "running", 60, "the kernel put back")
    after = kernel.status()
    assert after["inner_pid"] not in (before["inner_pid"], restored_pid)
    if restored_pid is not None:
        assert not Path(f"/proc/{restored_pid}").exists()
    assert kernel.execute("print(before_restore)").strip() == "42"
    assert kernel.execute(CHECK).strip() == "True 67108864"
    only_the_kernel_left(kernel)


def test_a_daemon_that_asked_for_no_page_is_refused(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    """Once, on a loaded machine, CRIU's lazy-pages daemon ended well without asking for
    any page while the restored kernel ran: its memory would have been zeros. Such an end
    is refused (the wrapper then kills that kernel and puts the one before back, as for
    any failed transfer), the end of CRIU's log in the error; every lazy restore of this
    suite passes the same check after asking for pages, so it refuses no good one. The
    daemon's misbehaviour cannot be made on purpose: the check is given the page server
    of a real snapshot's images that served nothing."""
    kernel = kernel_factory()
    kernel.execute(STATE)
    kernel.snapshot(tmp_path / "snap", track_memory=False)
    images = tmp_path / "snap" / IMAGES_DIR
    server = PageServer(images, DirectoryPages(images), write_through=False)
    work = tmp_path / "work"
    work.mkdir()
    (work / "lazy-pages.log").write_text("(00.01) the daemon's last words\n")
    try:
        with pytest.raises(RestoreError) as refused:
            check_asked(server, work)
    finally:
        server.close()
    assert server.lazy_bytes >= 64 << 20  # the kernel's numbers, at least
    assert "ended without asking for any of the kernel's memory" in refused.value.message
    assert "the daemon's last words" in refused.value.to_dict()["log_excerpt"]
    assert "lazy_restore = False" in refused.value.hint


class FailingPages:
    """A page source that is gone for one range of offsets (the store dropped mid-way)."""

    def __init__(self, inner: PageSource, bad: range) -> None:
        self.inner = inner
        self.bad = bad
        self.failures = 0

    def read(self, path: str, offset: int, length: int) -> bytes:
        if offset < self.bad.stop and offset + length > self.bad.start:
            self.failures += 1
            raise OSError("the store is gone")
        return self.inner.read(path, offset, length)


def dumped(criu: Criu, program: str, tmp_path: Path) -> tuple[Path, Path]:
    """``program`` run as the first process of a PID namespace, in ``tmp_path``; once it
    has written ``ready`` there, dumped (and gone). The images and CRIU's work directory."""
    launcher = subprocess.Popen(
        ["unshare", "--pid", "--fork", sys.executable, "-c", program],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    wait_until((tmp_path / "ready").exists, 60, "the process to hold its memory")
    (process,) = proctree.children(launcher.pid)
    images, work = tmp_path / "images", tmp_path / "work"
    images.mkdir()
    work.mkdir()
    asyncio.run(criu.dump(process, images, work, leave_running=False))
    launcher.wait(30)
    return images, work


HOLDER = """
import os, time
os.setsid()
held = bytearray(os.urandom(32 << 20))
with open("ready", "w") as out:
    out.write("ready")
while True:
    time.sleep(0.01)
    total = sum(held[:: 1 << 16])  # touches the whole array, again and again
"""


def test_a_page_that_cannot_be_read_is_retried_then_the_tree_stops(
    criu: Criu, tmp_path: Path
) -> None:
    """Once the restored process runs: reads of the missing range are retried, then the
    transfer fails with an error that names the file and range; the tree, frozen at the
    missing page, is killed before the daemon goes (never running on with zeros)."""
    images, work = dumped(criu, HOLDER, tmp_path)
    pagemap = read_pagemaps(images)[1]
    held = max(pagemap.entries, key=lambda e: e.nr_pages)
    assert held.lazy
    source = FailingPages(
        DirectoryPages(images), range(held.offset, held.offset + held.nr_pages * PAGE_SIZE)
    )

    async def run() -> tuple[int, str, int]:
        spared: list[int] = []
        pid, transfer = await criu.restore_lazy(
            images, work, source, write_through=False, kill_tree=spared.append
        )
        assert spared == []  # the restore itself succeeded
        with pytest.raises(PageFetchError) as info:
            await transfer.wait()
        assert Path(f"/proc/{pid}").exists()  # frozen at the missing page, not running on
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        transfer.close()
        rc = await transfer.daemon.wait()
        return pid, info.value.message, rc

    pid, message, rc = asyncio.run(run())
    assert source.failures == READ_ATTEMPTS
    assert f"tried {READ_ATTEMPTS} times" in message
    assert "the store is gone" in message
    assert f"{pagemap.pages_file}" in message
    assert rc != 0
    assert not Path(f"/proc/{pid}").exists()


CHURNER = """
import ctypes, hashlib, os, time
os.setsid()
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
CHUNK, CHUNKS = 64 << 10, 1024
# 64 MiB of private anonymous memory (lazy once restored), every page written.
base = libc.mmap(None, CHUNK * CHUNKS, 3, 0x22, -1, 0)
ctypes.memset(base, 0x5A, CHUNK * CHUNKS)
kept = bytearray(os.urandom(8 << 20))
digest = hashlib.sha256(kept).hexdigest()
with open("ready", "w") as out:
    out.write("ready")
while not os.path.exists("go"):
    time.sleep(0.01)
# Restored: as glibc does with a dead thread's stack, throw each chunk's pages away
# (MADV_DONTNEED: CRIU's daemon gets a REMOVE event) and unmap it at once.
for i in range(CHUNKS):
    chunk = base + i * CHUNK
    if libc.madvise(chunk, CHUNK, 4) or libc.munmap(chunk, CHUNK):
        raise OSError(ctypes.get_errno(), "madvise/munmap")
with open("done", "w") as out:
    out.write("ok" if hashlib.sha256(kept).hexdigest() == digest else "damaged")
while True:
    time.sleep(0.1)
"""


class SlowPages:
    """A page source that takes a while for each read: the daemon is still at work
    while the restored process runs."""

    def __init__(self, inner: PageSource, seconds: float) -> None:
        self.inner = inner
        self.seconds = seconds

    def read(self, path: str, offset: int, length: int) -> bytes:
        time.sleep(self.seconds)
        return self.inner.read(path, offset, length)


def test_memory_thrown_away_and_unmapped_at_once_while_pages_come(
    criu: Criu, tmp_path: Path
) -> None:
    """A restored process that throws memory away and unmaps it at once (glibc does
    with the stacks of ended threads; a Ray kernel died of it): CRIU's lazy-pages
    daemon, told of the first, found the range gone when it came to unregister it and
    failed, leaving the process without its pages. The CRIU the product builds takes
    the range as gone (scripts/criu-patches/0006): every page the process kept is
    intact."""
    images, work = dumped(criu, CHURNER, tmp_path)
    (tmp_path / "go").write_text("go")
    done = tmp_path / "done"

    async def run() -> None:
        pid, transfer = await criu.restore_lazy(
            images,
            work,
            SlowPages(DirectoryPages(images), 0.002),
            write_through=False,
            kill_tree=lambda _pid: None,
        )
        try:
            await transfer.wait()
            await asyncio.to_thread(wait_until, done.exists, 120, "the process to churn")
        finally:
            os.kill(pid, signal.SIGKILL)
            transfer.close()

    asyncio.run(run())
    assert done.read_text() == "ok"


def test_store_gone_while_the_kernel_runs_puts_the_kernel_back(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    """The restore succeeds and the kernel runs; then the source fails for the inside of
    its big array (never touched by CRIU's restorer): the background transfer retries,
    gives up, the restored kernel is killed and the one it replaced comes back."""
    kernel = kernel_factory()
    kernel.execute(STATE)
    address = int(kernel.execute("print(lazy_a.__array_interface__['data'][0])"))
    kernel.snapshot(tmp_path / "snap", track_memory=False)
    kernel.execute("before_restore = 43")
    before = kernel.status()
    local = tmp_path / "local"
    shutil.copytree(tmp_path / "snap", local, ignore=shutil.ignore_patterns("pages-*.img"))
    pagemap = read_pagemaps(local / IMAGES_DIR)[1]
    margin = 2 << 20  # whole 1 MiB blocks of the array only: the restore itself succeeds
    first, _ = pagemap.locate(address - address % PAGE_SIZE + margin, 1)
    last, _ = pagemap.locate(address - address % PAGE_SIZE + (64 << 20) - margin, 1)
    source = FailingPages(
        PrefixedPages(DirectoryPages(tmp_path / "snap"), f"{IMAGES_DIR}/"), range(first, last)
    )
    server = RangeServer(source, tmp_path / "pages.sock")
    try:
        restore(kernel, local, verified=True, pages_from=server.address)
        restored_pid = kernel.status()["inner_pid"]
        outcome = settled(kernel)
    finally:
        server.close()
    assert outcome["state"] == "failed"
    assert source.failures >= READ_ATTEMPTS
    message = outcome["error"]["message"]
    assert "the store is gone" in message
    assert "put back" in message
    wait_until(lambda: kernel.status()["state"] == "running", 60, "the kernel put back")
    assert kernel.status()["inner_pid"] not in (before["inner_pid"], restored_pid)
    assert not Path(f"/proc/{restored_pid}").exists()
    assert kernel.execute("print(before_restore)").strip() == "43"
    assert kernel.execute(CHECK).strip() == "True 67108864"
    only_the_kernel_left(kernel)


def test_a_suspended_kernel_comes_back_as_its_wrappers_settings_say(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    """No one asks the wrapper to resume its suspended kernel (a resume request, or a
    request that wakes it): the wrapper decides, by the rule the server decides by for
    the restores it asks (core.lazypages.lazy_plan), with the settings the server gave it
    (its environment): lazily from lazy_restore_min_bytes on, in full below it or with
    lazy_restore off."""
    settings = {
        "lazy": {ENV_LAZY_RESTORE_MIN_BYTES: "0"},
        "small": {ENV_LAZY_RESTORE_MIN_BYTES: str(LAZY_MIN_BYTES)},
        "off": {ENV_LAZY_RESTORE: "0", ENV_LAZY_RESTORE_MIN_BYTES: "0"},
    }
    for name, env in settings.items():
        kernel = kernel_factory(env=env)
        kernel.execute(STATE)
        for came_back in (1, 2):
            suspend = {"dest": str(tmp_path / f"{name}-{came_back}"), "track_memory": False}
            kernel.control.request_sync("suspend", suspend, timeout=120)
            if came_back == 1:
                kernel.control.request_sync("resume", timeout=300)  # asked, but not how
            assert kernel.execute(CHECK).strip() == "True 67108864", name  # (else woken)
            settled(kernel)
            lazily = kernel.log().count("lazy restore complete")
            assert lazily == (came_back if name == "lazy" else 0), (name, kernel.log()[-3000:])


def test_a_restore_not_said_lazy_reads_every_page_first(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    """The wrapper follows the request: not lazy (lazy_restore off, a small kernel from
    local images, a GPU kernel: the server's decision), every page is in before the
    kernel runs, from its own images or from elsewhere."""
    kernel = kernel_factory(env={ENV_LAZY_RESTORE_MIN_BYTES: "0"})  # its own rule: lazy
    kernel.execute(STATE)
    kernel.snapshot(tmp_path / "snap", track_memory=False)
    restore(kernel, tmp_path / "snap", lazy=False)
    assert lazy_state(kernel) == {}
    assert kernel.execute(CHECK).strip() == "True 67108864"
    # Pages from elsewhere (the store's way) without lazy restore: all read first.
    local = tmp_path / "local"
    shutil.copytree(tmp_path / "snap", local, ignore=shutil.ignore_patterns("pages-*.img"))
    kernel.execute("lazy_a[:] = 0")
    restore(
        kernel, local, verified=True, pages_from=str(tmp_path / "snap" / IMAGES_DIR), lazy=False
    )
    assert lazy_state(kernel) == {}
    assert kernel.execute(CHECK).strip() == "True 67108864"
    verify(local)
    # Pages files the source keeps (the server downloading them, only the stacks in so
    # far): every page is read through the source before CRIU starts, none left a hole.
    store = LocalStore(tmp_path / "store")
    stored = store.put(tmp_path / "snap")
    kept = tmp_path / "kept"
    store.fetch(stored.manifest.id, kept, skip=lambda path: PAGES.fullmatch(path) is not None)
    images = store.open_images(stored.manifest.id)
    now, lazy = restore_order(kept / IMAGES_DIR)
    pages = sorted({f"{IMAGES_DIR}/{name}" for name, _, _ in now + lazy})
    images.download_into(kept, pages, now=[(f"{IMAGES_DIR}/{n}", o, s) for n, o, s in now])
    images.close()  # the download stops; reads now go to the store
    for name, offset, length in lazy:  # and none of the kernel's memory is there
        with (kept / IMAGES_DIR / name).open("r+b") as fh:
            fh.seek(offset)
            fh.write(bytes(length))
    server = RangeServer(PrefixedPages(images, f"{IMAGES_DIR}/"), tmp_path / "pages.sock")
    try:
        kernel.execute("lazy_a[:] = 0")
        restore(kernel, kept, verified=True, pages_from=server.address, lazy=False)
    finally:
        server.close()
        store.close()
    assert lazy_state(kernel) == {}
    assert kernel.execute(CHECK).strip() == "True 67108864"
    verify(kept)


def test_doctor_says_whether_lazy_restore_works(criu: Criu) -> None:
    check = check_lazy_pages(criu)
    assert check.ok
    assert "uffd-noncoop is supported" in check.detail
    assert not check.required
    assert os.geteuid() == 0  # the fixture skipped the module otherwise


#: A process whose only thread waits with its stack pointer at the start of a page (the
#: top of a stack of its own), holding 64 MiB of anonymous memory.
STACK_AT_A_PAGE_START = r"""
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>

int main(void)
{
    size_t size = 64 << 20, stack = 1 << 20;
    char *memory = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char *top = mmap(NULL, stack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

    if (memory == MAP_FAILED || top == MAP_FAILED)
        return 1;
    memset(memory, 1, size);
    memset(top, 1, stack);
    printf("ready\n");
    fflush(stdout);
    top += stack;
    __asm__ volatile("mov %0, %%rsp\n1:\tmov %1, %%eax\n\tsyscall\n\tjmp 1b"
             : : "r"(top), "i"(SYS_pause) : "memory");
    return 0;
}
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the program sets rsp (x86-64)")
def test_a_stack_pointer_at_a_page_start_leaves_the_memory_lazy(criu: Criu, tmp_path: Path) -> None:
    """CRIU patch 0009: the page a thread's stack pointer is in is restored before the
    process runs, the rest of its anonymous memory lazily. CRIU compared the pointer's
    offset within its page instead of its page, so a thread waiting with a page-aligned
    stack pointer (about one kernel in 256, as Linux places its stack) made every page of
    the process not lazy, and a lazy restore read all of its memory first (seen as a lazy
    restore from the store that waited, in a full test run)."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    assert gcc, "gcc is needed (scripts/install-criu.sh installs build-essential)"
    source, program = tmp_path / "stack.c", tmp_path / "stack"
    source.write_text(STACK_AT_A_PAGE_START)
    subprocess.run([gcc, "-O1", "-o", str(program), str(source)], check=True)
    with subprocess.Popen(
        [str(program)], stdout=subprocess.PIPE, text=True, start_new_session=True
    ) as waiting:
        try:
            assert waiting.stdout is not None
            assert waiting.stdout.readline() == "ready\n"
            images, work = tmp_path / "images", tmp_path / "work"
            images.mkdir()
            work.mkdir()
            asyncio.run(criu.dump(waiting.pid, images, work, leave_running=True))
        finally:
            waiting.kill()
    (pagemap,) = read_pagemaps(images).values()
    lazy = sum(e.nr_pages for e in pagemap.entries if e.lazy) * PAGE_SIZE
    assert lazy >= 64 << 20, pagemap.entries
