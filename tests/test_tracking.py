"""Snapshots cost what changed (issue 43): a kernel's later snapshots copy only the memory
it wrote since its previous one (jupyter_ext/core/memtrack/, kernel_wrapper/memory.py),
and nothing written is ever missed.

A missed write is silent corruption, so :func:`test_no_write_is_missed` tries every way
memory gets written between two snapshots (the kernel's own code, syscalls into its
buffers, a child, another process, after fork, mremap, madvise, mprotect, huge pages, a
new thread), takes an incremental snapshot, kills the kernel and compares every restored
byte with what the kernel held at the snapshot. A writer thread runs through both
snapshots (and the first one's pre-copy) and checks its own pages against its journal.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_ext.core.criu import Criu
from jupyter_ext.core.errors import DumpError
from jupyter_ext.core.memtrack import plan as memplan
from jupyter_ext.core.memtrack import uffd
from jupyter_ext.core.memtrack.digests import READ_BYTES, PageDigests, page_digests
from jupyter_ext.core.memtrack.tracker import MemoryTracker
from testkit.processes import KernelProcess

Factory = Callable[..., KernelProcess]

#: Run in the kernel: buffers of every kind, filled, and the writer thread started.
SETUP = r"""
import ctypes, hashlib, mmap, os, socket, threading, time, struct
import numpy as np
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
]
libc.mremap.restype = ctypes.c_void_p
libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PAGE, MB = mmap.PAGESIZE, 1 << 20
rng = np.random.default_rng(7)
W = {}

def anon(size, align=PAGE):
    addr = libc.mmap(None, size + align, 3, 0x22, -1, 0)  # PROT_RW, MAP_PRIVATE|ANON
    assert addr not in (None, ctypes.c_void_p(-1).value)
    return (addr + align - 1) // align * align

def view(addr, size):
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(addr))

def fill(name, addr, size):
    W[name] = (addr, size)
    view(addr, size)[:] = rng.integers(0, 256, size, dtype=np.uint8)

def digest(name):
    addr, size = W[name]
    return hashlib.sha256(bytes(view(addr, size))).hexdigest()

fill("own", anon(4 * MB), 4 * MB)
fill("scatter", anon(8 * MB), 8 * MB)
fill("read", anon(MB), MB)
fill("recv", anon(MB), MB)
fill("odirect", anon(MB), MB)
fill("io_uring", anon(MB), MB)
fill("remote", anon(MB), MB)
fill("after_fork", anon(MB), MB)
fill("mremap", anon(2 * MB), 2 * MB)
fill("dontneed", anon(MB), MB)
fill("mprotect", anon(MB), MB)
thp = anon(8 * MB, align=2 * MB)
libc.madvise(thp, 8 * MB, 14)  # MADV_HUGEPAGE
fill("thp", thp, 8 * MB)
libc.madvise(thp, 8 * MB, 25)  # MADV_COLLAPSE (where the kernel has it)
shared = mmap.mmap(-1, MB)  # MAP_SHARED | MAP_ANONYMOUS
shared[:] = os.urandom(MB)

# The writer: random rows of a 96 MiB table, each row's sequence number also in a
# journal (row first, then journal); at any freeze every row matches its journal, but
# for the one being written.
ROWS = 96 * MB // PAGE
table = np.zeros((ROWS, PAGE // 8), np.uint64)
journal = np.zeros(ROWS, np.uint64)
table[:] = 1
journal[:] = 1
writing = threading.Event()
writing.set()
def writer():
    seq, pick = 1, np.random.default_rng(1)
    while writing.is_set():
        for row in pick.integers(0, ROWS, 256):
            seq += 1
            table[row, :] = seq
            journal[row] = seq
        time.sleep(0.001)
threading.Thread(target=writer, daemon=True).start()
"""

#: Run in the kernel between the two snapshots: every kind of write.
CHANGE = r"""
def put(name, offset, data):
    addr, _ = W[name]
    ctypes.memmove(addr + offset, data, len(data))

a, n = W["own"]; view(a, n)[100_000:300_000] = 7                      # the kernel's own code
a, n = W["scatter"]; view(a, n)[::32 * 1024] += 1                      # scattered pages
with open(DATA, "rb") as f:                                            # read(2)
    a, n = W["read"]; f.readinto(memoryview(view(a, n))[4096:4096 + 65536])
s1, s2 = socket.socketpair()                                            # recv(2)
s1.sendall(b"r" * 50_000); a, n = W["recv"]
got = s2.recv_into(memoryview(view(a, n))[8192:], 50_000); s1.close(); s2.close()
assert got == 50_000
fd = os.open(DATA, os.O_RDONLY | os.O_DIRECT)                          # pread, O_DIRECT
a, n = W["odirect"]
assert os.preadv(fd, [memoryview(view(a, n))[PAGE:PAGE + 256 * 1024]], 0) == 256 * 1024
os.close(fd)
uring_read(DATA, W["io_uring"][0] + 3 * PAGE, 128 * 1024)              # io_uring
pid = os.fork()                                                         # a child, shared memory
if pid == 0:
    shared[1000:5000] = b"c" * 4000
    os._exit(0)
os.waitpid(pid, 0)
sleeper = os.fork()                                                     # after fork (COW)
if sleeper == 0:
    time.sleep(3600); os._exit(0)
a, n = W["after_fork"]; view(a, n)[:PAGE * 3] = 9
os.kill(sleeper, 9); os.waitpid(sleeper, 0)  # a child lives on: copied whole, see below
a, n = W["mremap"]                                                      # mremap, moved
moved = libc.mremap(a, n, 4 * MB, 1)                                   # MREMAP_MAYMOVE
W["mremap"] = (moved, 4 * MB)
view(moved, 4 * MB)[n:] = 5
view(moved, 4 * MB)[:PAGE] = 6
a, n = W["dontneed"]                                                    # madvise + refault
libc.madvise(a, 256 * 1024, 4)                                         # MADV_DONTNEED
view(a, n)[PAGE * 8:PAGE * 9] = 3                                       # written again
_ = int(view(a, n)[PAGE * 20])                                          # read again (zero)
a, n = W["mprotect"]                                                    # mprotect round trips
libc.mprotect(a, n, 1); libc.mprotect(a, n, 3)
view(a, n)[PAGE * 4] = 1
libc.mprotect(a, n // 2, 1); libc.mprotect(a, n // 2, 3)
a, n = W["thp"]; view(a, n)[3 * MB + 17] ^= 0xFF                        # a huge page split
libc.madvise(a, n, 25)
thread_result = []                                                      # a new thread's stack
thread_go = threading.Event()
def deep(k):
    return k if k == 0 else deep(k - 1) + 1
def thread_job():
    local = [deep(200) + i for i in range(10)]
    thread_go.wait()
    thread_result.append(sum(local) + deep(300))
threading.Thread(target=thread_job, daemon=True).start()
"""

#: Makes an io_uring read into a buffer (raw syscalls; closed again before the snapshot:
#: CRIU cannot save an io_uring).
URING = r"""
def uring_read(path, addr, length):
    params = bytearray(120)
    fd = libc.syscall(425, 4, (ctypes.c_char * 120).from_buffer(params))  # io_uring_setup
    assert fd >= 0, os.strerror(ctypes.get_errno())
    sq_entries, cq_entries = struct.unpack_from("<II", params, 0)
    sq_head, sq_tail, sq_mask, _, _, _, sq_array = struct.unpack_from("<7I", params, 40)
    cq_head, cq_tail, cq_mask, _, _, cqes = struct.unpack_from("<6I", params, 80)
    ring_size = max(sq_array + sq_entries * 4, cqes + cq_entries * 16)
    ring = mmap.mmap(fd, ring_size, offset=0)
    sqes = mmap.mmap(fd, sq_entries * 64, offset=0x10000000)
    src = os.open(path, os.O_RDONLY)
    sqe = struct.pack("<BBHiQQIIQ", 22, 0, 0, src, 0, addr, length, 0, 42).ljust(64, b"\0")
    sqes[0:64] = sqe
    tail = struct.unpack_from("<I", ring, sq_tail)[0]
    struct.pack_into("<I", ring, sq_array + 4 * (tail & sq_mask), 0)
    struct.pack_into("<I", ring, sq_tail, tail + 1)
    done = libc.syscall(426, fd, 1, 1, 1, None, 0)  # io_uring_enter, GETEVENTS
    assert done == 1, os.strerror(ctypes.get_errno())
    head = struct.unpack_from("<I", ring, cq_head)[0]
    user, res = struct.unpack_from("<Qi", ring, cqes + 16 * (head & cq_mask))
    assert user == 42 and res == length, (user, res)
    ring.close(); sqes.close(); os.close(src); os.close(fd)
"""

#: Digests of every kind's memory (the writer stopped first for its own check).
CHECK = r"""
writing.clear(); time.sleep(0.05)
rows = table[:, 0]
torn = int((table != rows[:, None]).any(axis=1).sum())
behind = int((rows < journal).sum())
print("writer", torn <= 1 and behind == 0, torn, behind)
for name in sorted(W):
    print(name, digest(name))
print("shared", hashlib.sha256(shared[:]).hexdigest())
"""


def snapshot(kernel: KernelProcess, dest: Path, parent: Path | None = None) -> dict[str, Any]:
    return kernel.snapshot(dest, parent=str(parent) if parent else None)


def test_no_write_is_missed(kernel_factory: Factory, tmp_path: Path) -> None:
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(1 << 20))
    kernel = kernel_factory()
    kernel.execute(SETUP + URING + f"DATA = {str(data)!r}")
    first = snapshot(kernel, tmp_path / "s1")
    assert first["memory"]["mode"] == "full"
    assert first["memory"]["reason"] == memplan.FIRST
    assert first["memory"]["precopy"], "a 100 MiB kernel is pre-copied, with root or without"
    kernel.execute(CHANGE)
    pid = kernel.status()["inner_pid"]
    address, size = kernel.execute("print(*W['remote'])").split()
    remote = os.urandom(int(size) // 2)  # process_vm_writev, from another process
    assert process_vm_writev(pid, int(address) + 4096, remote) == len(remote)

    second = snapshot(kernel, tmp_path / "s2", parent=tmp_path / "s1")
    assert second["memory"]["mode"] == "incremental", second["memory"]["reason"]
    assert second["memory"]["parent"] == first["id"]
    # Pre-copied while it runs: frozen for less than half of the full copy.
    assert second["memory"]["frozen_bytes"] < first["memory"]["copied_bytes"] // 2
    expected = kernel.execute(CHECK)
    assert "writer True" in expected, expected
    kernel.kill_all()
    shutil.rmtree(tmp_path / "s1")  # the second needs nothing of the first
    restored = kernel_factory(restore_from=tmp_path / "s2")
    restored.execute("thread_go.set(); time.sleep(0.2)")
    assert restored.execute(CHECK).splitlines() == expected.splitlines()
    assert (
        restored.execute("print(thread_result)").strip()
        == f"[{sum(200 + i for i in range(10)) + 300}]"
    )


#: Run in a child: memory it wrote, and its tracking descriptor for the parent to take;
#: on a line from the parent, a new mapping over the first half of that memory.
REMAPPER = r"""
import ctypes, mmap, sys
from jupyter_ext.core.memtrack import uffd
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
]
SIZE = 64 * mmap.PAGESIZE
addr = libc.mmap(None, SIZE, 3, 0x22, -1, 0)  # PROT_RW, MAP_PRIVATE|MAP_ANONYMOUS
ctypes.memset(addr, 1, SIZE)
print(addr, SIZE, uffd.open_tracking_fd(), flush=True)
sys.stdin.readline()
assert libc.mmap(addr, SIZE // 2, 3, 0x32, -1, 0) == addr  # ... | MAP_FIXED
ctypes.memset(addr, 2, SIZE // 2)
print("remapped", flush=True)
sys.stdin.readline()
"""


@contextlib.contextmanager
def tracked_child(
    script: str,
) -> Iterator[tuple[int, int, int, MemoryTracker, Callable[[str], str]]]:
    """A child running ``script``, which prints the address and size of its memory and
    its tracking descriptor: its pid, that memory, its tracker (taken, registered), and
    ``say`` (a line to it; its answer)."""
    with subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    ) as child:
        stdin, stdout = child.stdin, child.stdout
        assert stdin is not None
        assert stdout is not None

        def say(line: str) -> str:
            stdin.write(line + "\n")
            stdin.flush()
            return stdout.readline().strip()

        addr, size, fd = map(int, stdout.readline().split())
        tracker = MemoryTracker.take(child.pid, fd)
        try:
            tracker.register_new()
            yield child.pid, addr, size, tracker, say
        finally:
            tracker.close()
            child.kill()


def test_a_change_the_kernel_remaps_while_compared_is_still_copied() -> None:
    """The kernel runs while its memory is compared: where it replaced a part of a changed
    run with a new mapping (not registered: Linux refuses the whole range), the rest of
    the run is still unprotected, so a dump copies it; never left protected (a lost
    write)."""
    with tracked_child(REMAPPER) as (pid, addr, size, tracker, say):
        for start, end in tracker.ranges:
            uffd.protect(tracker.fd, start, end - start)
        assert [r[:2] for r in uffd.protected_ranges(pid, addr, addr + size)] == [
            (addr, addr + size)
        ]
        assert say("") == "remapped"
        with pytest.raises(uffd.TrackingUnavailable) as refused:
            uffd.unprotect(tracker.fd, addr, size)  # the case: the whole run is refused
        assert refused.value.errno == errno.ENOENT
        assert [r[:2] for r in uffd.protected_ranges(pid, addr, addr + size)] == [
            (addr + size // 2, addr + size)
        ]
        tracker.unprotect(addr, addr + size)
        assert uffd.protected_ranges(pid, addr, addr + size) == []
        assert uffd.written_ranges(pid, addr, addr + size) == [(addr, addr + size)]
    with pytest.raises(uffd.TrackingUnavailable) as gone:  # a comparison cannot be made
        uffd.read_memory(pid, addr, memoryview(bytearray(uffd.PAGE_SIZE)))
    assert gone.value.errno == errno.ESRCH


#: Run in a child: 100 MiB in small pages, written, and its tracking descriptor; on a
#: line of page numbers from the parent, those pages rewritten.
REWRITER = r"""
import ctypes, mmap, sys
from jupyter_ext.core.memtrack import uffd
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
SIZE = 100 << 20
addr = libc.mmap(None, SIZE, 3, 0x22, -1, 0)
libc.madvise(addr, SIZE, 15)  # MADV_NOHUGEPAGE: pages change one by one
for page in range(SIZE // mmap.PAGESIZE):
    ctypes.memset(addr + page * mmap.PAGESIZE, page % 251 + 1, mmap.PAGESIZE)
print(addr, SIZE, uffd.open_tracking_fd(), flush=True)
for page in map(int, sys.stdin.readline().split()):
    ctypes.memset(addr + page * mmap.PAGESIZE + 100, 0, 1)
print("written", flush=True)
sys.stdin.readline()
"""


def test_the_comparison_finds_exactly_the_pages_that_changed() -> None:
    """The comparison reads the memory in pieces, several at once
    (digests.changed_runs): the pages it finds changed are exactly those rewritten, in
    every piece, at their edges and across them; the others stay protected."""
    with tracked_child(REWRITER) as (pid, addr, size, tracker, say):
        data = memoryview(bytearray(size))
        assert uffd.read_memory(pid, addr, data) == size
        digests = PageDigests.of([(addr, page_digests(data))])
        per_piece = READ_BYTES // uffd.PAGE_SIZE
        rewritten = {0, 1, 2, 700, per_piece - 1, per_piece, 2 * per_piece + 5}
        rewritten |= {size // uffd.PAGE_SIZE - 1, *range(10_000, 10_040)}
        assert say(" ".join(map(str, sorted(rewritten)))) == "written"
        changes = tracker.protect(digests)
        found = {
            (at - addr) // uffd.PAGE_SIZE
            for start, end in changes.runs
            for at in range(max(start, addr), min(end, addr + size), uffd.PAGE_SIZE)
        }
        assert found == rewritten
        protected = sum(
            min(end, addr + size) - max(start, addr)
            for start, end, _ in uffd.protected_ranges(pid, addr, addr + size)
        )
        assert protected == size - len(rewritten) * uffd.PAGE_SIZE
        tracker.release()


def test_memory_written_back_as_it_was_is_not_copied(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    """What changed is found by content (core/memtrack/digests.py): a 32 MiB array the
    kernel rewrote whole with what it held (``* 2`` then ``/ 2`` is exact) is not copied
    again, and the one value moved to its next float in between is, and restores."""
    kernel = kernel_factory()
    kernel.execute("import numpy as np, hashlib\na = np.random.default_rng(5).random(4 << 20)")
    snapshot(kernel, tmp_path / "s1")
    kernel.execute("a *= 2.0\na /= 2.0\na[300_000] = np.nextafter(a[300_000], 2.0)")
    second = snapshot(kernel, tmp_path / "s2", parent=tmp_path / "s1")
    assert second["memory"]["mode"] == "incremental", second["memory"]["reason"]
    assert second["memory"]["copied_bytes"] < 12 << 20, second["memory"]
    # Most of the array's blocks were found unchanged by one digest each (the first
    # snapshot's images gave them), the one holding the moved value page by page.
    assert second["memory"]["compared"]["whole_block_bytes"] >= 16 << 20, second["memory"]
    code = "print(hashlib.sha256(a.tobytes()).hexdigest(), a[300_000].hex())"
    expected = kernel.execute(code)
    kernel.kill_all()
    shutil.rmtree(tmp_path / "s1")
    assert kernel_factory(restore_from=tmp_path / "s2").execute(code) == expected


def process_vm_writev(pid: int, address: int, data: bytes) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(data, len(data))

    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    local = IoVec(ctypes.cast(buf, ctypes.c_void_p), len(data))
    remote = IoVec(address, len(data))
    result: int = libc.process_vm_writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return result


def test_a_chain_restores_from_any_of_its_snapshots(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    """Five snapshots, each adding a level; any one restores on its own, with the older
    ones' directories deleted, to exactly what the kernel held then."""
    kernel = kernel_factory()
    kernel.execute(
        "import numpy as np, hashlib\nrng = np.random.default_rng(3)\na = rng.random(1 << 21)"
    )
    digests = []
    previous = None
    for n in range(5):
        kernel.execute(
            f"a[{n * 40000}:{n * 40000 + 30000}] = rng.random(30000)\nb{n} = bytes(100 * {n})"
        )
        result = snapshot(kernel, tmp_path / f"s{n}", previous)
        assert result["memory"]["mode"] == ("full" if n == 0 else "incremental")
        digests.append(kernel.execute("print(hashlib.sha256(a.tobytes()).hexdigest())"))
        previous = tmp_path / f"s{n}"
    assert result["memory"]["chain"]["levels"] == 5
    kernel.kill_all()
    for n in (0, 1, 3, 4):
        shutil.rmtree(tmp_path / f"s{n}")
    restored = kernel_factory(restore_from=tmp_path / "s2")
    assert restored.execute("print(hashlib.sha256(a.tobytes()).hexdigest())") == digests[2]
    assert restored.execute("print(len(b2), 'b3' in dir())").split() == ["200", "False"]


def test_a_failed_dump_costs_the_next_one_nothing(
    kernel_factory: Factory, tmp_path: Path, criu: Criu
) -> None:
    """A tracked CRIU run protects the pages it copied; when its snapshot is then lost (the
    dump failed after CRIU had reset the tracking), the writes before it are in no image.
    The next snapshot still builds on the parent: it compares the memory with the
    parent's pages by content (core/memtrack/digests.py), so those writes are copied."""
    fail = tmp_path / "fail"
    fake = tmp_path / "criu"
    fake.write_text(
        "#!/bin/sh\n"
        f'"{criu.path}" "$@"; rc=$?\n'
        f'[ "$1" = dump ] && [ -e "{fail}" ] && exit 1\n'
        "exit $rc\n"
    )
    fake.chmod(0o755)
    kernel = kernel_factory(extra_args=["--criu", str(fake)])
    kernel.execute("import numpy as np, hashlib\na = np.zeros(1 << 20)")
    snapshot(kernel, tmp_path / "s1")
    kernel.execute("a[:1000] = 1")
    fail.touch()
    with pytest.raises(DumpError):
        snapshot(kernel, tmp_path / "lost", parent=tmp_path / "s1")
    fail.unlink()
    kernel.execute("a[5000:6000] = 2")
    third = snapshot(kernel, tmp_path / "s3", parent=tmp_path / "s1")
    assert third["memory"]["mode"] == "incremental", third["memory"]["reason"]
    # As the store keeps it: whole on its own.
    assert_array_restored(kernel, kernel_factory, tmp_path / "s3", without=tmp_path / "s1")


def test_a_big_kernel_is_pre_copied_within_an_ordinary_users_limits(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    """CRIU 4.2's read-mode pre-dump held a pipe per run of pages, and past the user's
    pipe pages (fs.pipe-user-pages-soft: 64 MiB) each new pipe holds two: a 384 MiB kernel
    needed ~45,000 descriptors, and an ordinary user's pre-copy failed ("Too many open
    files"). The project's CRIU (scripts/criu-patches/0004) holds one pipe: the kernel,
    started with a limit of 1,024 descriptors, is pre-copied as root and without, its
    second snapshot builds on the first, and the restore has every byte."""

    def few_descriptors() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    kernel = kernel_factory(preexec_fn=few_descriptors)
    kernel.execute(
        "import numpy as np, hashlib\nrng = np.random.default_rng(5)\n"
        "a = rng.random(48 << 20)  # 384 MiB"
    )
    first = snapshot(kernel, tmp_path / "s1")
    assert first["memory"]["precopy"], first["memory"]
    assert first["memory"]["frozen_bytes"] < first["memory"]["copied_bytes"] // 4
    kernel.execute("a[: 1 << 20] = rng.random(1 << 20)")
    second = snapshot(kernel, tmp_path / "s2", parent=tmp_path / "s1")
    assert second["memory"]["mode"] == "incremental", second["memory"]["reason"]
    assert_array_restored(kernel, kernel_factory, tmp_path / "s2", without=tmp_path / "s1")


ARRAY = "import numpy as np, hashlib\nrng = np.random.default_rng({seed})\na = rng.random({floats})"


def criu_shim(tmp_path: Path, criu: Criu, first_line: str) -> Path:
    """A ``criu`` that runs ``first_line`` (sh), then ``criu``."""
    shim = tmp_path / "criu"
    shim.write_text(f'#!/bin/sh\n{first_line}\nexec "{criu.path}" "$@"\n')
    shim.chmod(0o755)
    return shim


def test_a_failed_pre_copy_copies_everything_frozen(
    kernel_factory: Factory, tmp_path: Path, criu: Criu
) -> None:
    """A pre-copy round that fails may have protected pages it did not save: the snapshot
    is not lost, it copies everything while the kernel is frozen and says why; later
    snapshots of the kernel are not pre-copied (and build on it); the restore is exact."""
    fake = criu_shim(tmp_path, criu, f'[ "$1" = pre-dump ] && {{ "{criu.path}" "$@"; exit 1; }}')
    kernel = kernel_factory(extra_args=["--criu", str(fake)])
    kernel.execute(ARRAY.format(seed=7, floats="12 << 20"))
    first = snapshot(kernel, tmp_path / "s1")
    memory = first["memory"]
    assert (memory["mode"], memory["precopy"]) == ("full", []), memory
    assert memory["reason"].startswith("a pre-copy round failed"), memory
    assert not [p for p in (tmp_path / "s1").rglob("*") if "precopy" in p.name]
    kernel.execute("a[:1000] = 1")
    second = snapshot(kernel, tmp_path / "s2", parent=tmp_path / "s1")
    assert (second["memory"]["mode"], second["memory"]["precopy"]) == ("incremental", [])
    assert_array_restored(kernel, kernel_factory, tmp_path / "s2")


#: Tests that trace CRIU run as root only (they run as root in the system stage).
strace_of_criu = pytest.mark.skipif(
    os.geteuid() != 0, reason="strace drops the file capabilities an ordinary user's CRIU runs with"
)


@strace_of_criu
def test_scattered_pages_are_written_a_buf_at_a_time(
    kernel_factory: Factory, tmp_path: Path, criu: Criu
) -> None:
    """Patch 0005: a dump wrote each run of pages to the image with a splice of its own,
    one syscall per page where a kernel's writes were scattered, while the kernel was
    frozen. The dump of 1,024 scattered pages now splices a page-pipe buf at a time (a
    handful of calls, counted with strace), and the restore has every byte. (An eighth of
    a huge page's 512 or more changed would copy its block whole: core/memtrack/digests.py.)"""
    kernel, calls = kernel_with_dumps_traced(kernel_factory, tmp_path, criu, "splice")
    kernel.execute(ARRAY.format(seed=9, floats="8 << 20"))  # 64 MiB
    snapshot(kernel, tmp_path / "s1")
    kernel.execute("a.reshape(-1, 512)[::16, 0] += 1.0  # every 16th page: 1,024")
    second = snapshot(kernel, tmp_path / "s2", parent=tmp_path / "s1")
    assert second["memory"]["mode"] == "incremental", second["memory"]["reason"]
    assert second["memory"]["precopy"] == [], "4 MiB is copied frozen, no pre-copy"
    splices = [line for line in calls.read_text().splitlines() if "splice(" in line]
    assert 0 < len(splices) < 100, f"{len(splices)} splices for 1,024 scattered pages"
    assert_array_restored(kernel, kernel_factory, tmp_path / "s2")


@strace_of_criu
def test_a_dump_reads_only_its_parents_pagemap(
    kernel_factory: Factory, tmp_path: Path, criu: Criu
) -> None:
    """Patch 0007: a dump read the pagemap of every level of its chain while the kernel
    was frozen (a pre-copy level of a kernel that writes at random holds tens of thousands
    of entries), although it only checks its holes against its parent's. An incremental
    snapshot whose changes are pre-copied dumps on a chain of two, its pre-copy level and
    the previous snapshot: the dump now reads one pagemap, its parent's (counted with
    strace; two without the patch), and the restore has every byte."""
    kernel, calls = kernel_with_dumps_traced(kernel_factory, tmp_path, criu, "openat")
    kernel.execute(ARRAY.format(seed=5, floats="12 << 20"))  # 96 MiB
    snapshot(kernel, tmp_path / "s1")
    kernel.execute("a += 1.0  # all of it: more than a freeze copies, so it is pre-copied")
    calls.unlink()
    second = snapshot(kernel, tmp_path / "s2", parent=tmp_path / "s1")
    memory = second["memory"]
    assert (memory["mode"], len(memory["precopy"])) == ("incremental", 1), memory
    read = [
        line
        for line in calls.read_text().splitlines()
        if re.search(r'"pagemap-\d+\.img", O_RDONLY', line)
    ]
    assert len(read) == 1, "\n".join(read)
    assert_array_restored(kernel, kernel_factory, tmp_path / "s2")


#: Address families by number (linux/socket.h), for an strace that leaves sock diag raw.
_FAMILIES = {1: "AF_UNIX", 2: "AF_INET", 10: "AF_INET6", 16: "AF_NETLINK", 17: "AF_PACKET"}


def sock_diag_requests(calls: Path) -> list[str]:
    """The address family of each sock diag request (``SOCK_DIAG_BY_FAMILY``) in an strace
    of a dump's ``sendmsg`` calls, decoded by strace or read from its first byte."""
    families = []
    for line in calls.read_text().splitlines():
        if not re.search(r"nlmsg_type=(SOCK_DIAG_BY_FAMILY|0x14)\b", line):
            continue
        decoded = re.search(r"sdiag_family=(AF_\w+)", line)
        if decoded:
            families.append(decoded.group(1))
            continue
        raw = re.search(r'\}, "(\\x[0-9a-f]{2}|\\[0-7]{1,3}|\\[a-z]|[^\\])', line)
        assert raw, line
        families.append(_FAMILIES[_c_byte(raw.group(1))])
    return families


def _c_byte(escaped: str) -> int:
    """One byte as strace prints it in a string: ``\\x02``, ``\\2``, ``\\n`` or itself."""
    if escaped.startswith("\\x"):
        return int(escaped[2:], 16)
    if escaped[1:].isdigit():
        return int(escaped[1:], 8)
    if escaped.startswith("\\"):
        return {"n": 10, "t": 9, "v": 11, "f": 12, "r": 13}[escaped[1]]
    return ord(escaped)


@strace_of_criu
def test_a_dump_asks_for_no_inet_sockets_a_kernel_does_not_hold(
    kernel_factory: Factory, tmp_path: Path, criu: Criu
) -> None:
    """Patch 0010: each inet sock diag request (eight of them) walks the whole machine's
    table of its protocol while the kernel is frozen, although a kernel holds unix sockets
    only. Its dump now asks for unix sockets and none of the inet ones."""
    kernel, calls = kernel_with_dumps_traced(kernel_factory, tmp_path, criu, "sendmsg")
    kernel.execute("x = 1")
    snapshot(kernel, tmp_path / "s1")
    asked = sock_diag_requests(calls)
    assert asked.count("AF_UNIX") == 1, asked
    assert [family for family in asked if family.startswith("AF_INET")] == [], asked


SOCKETS = """
import socket
srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
srv.bind(("127.0.0.1", 0))
srv.listen()
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.bind(("127.0.0.1", 0))
"""
USE_SOCKETS = """
c = socket.create_connection(srv.getsockname(), timeout=10)
conn, _ = srv.accept()
c.sendall(b"tcp")
udp.sendto(b"udp", udp.getsockname())
udp.settimeout(10)
print(conn.recv(3).decode(), udp.recv(3).decode())
c.close(); conn.close()
"""


@strace_of_criu
def test_a_kernels_inet_sockets_are_dumped_and_restored(
    kernel_factory: Factory, tmp_path: Path, criu: Criu
) -> None:
    """Patch 0010: a kernel holding a listening TCP socket and a UDP socket has them
    collected when the dump finds them (one request each, none for the protocols it does
    not use), and the restored kernel accepts a connection and gets a datagram on them."""
    kernel, calls = kernel_with_dumps_traced(kernel_factory, tmp_path, criu, "sendmsg")
    kernel.execute(SOCKETS)
    snapshot(kernel, tmp_path / "s1")
    asked = sock_diag_requests(calls)
    assert [family for family in asked if family.startswith("AF_INET")] == ["AF_INET"] * 2, asked
    kernel.restore(tmp_path / "s1")
    assert kernel.execute(USE_SOCKETS).split() == ["tcp", "udp"]


def kernel_with_dumps_traced(
    kernel_factory: Factory, tmp_path: Path, criu: Criu, syscall: str
) -> tuple[KernelProcess, Path]:
    """A kernel whose wrapper runs each ``criu dump`` under strace, tracing ``syscall``
    into the file returned."""
    if shutil.which("strace") is None:
        pytest.fail("strace is missing: scripts/common.sh installs it with the test extras")
    calls = tmp_path / f"{syscall}-calls"
    shim = criu_shim(
        tmp_path,
        criu,
        f'[ "$1" = dump ] && exec strace -qq -e trace={syscall} -o "{calls}" "{criu.path}" "$@"',
    )
    return kernel_factory(extra_args=["--criu", str(shim)]), calls


def assert_array_restored(
    kernel: KernelProcess, kernel_factory: Factory, source: Path, without: Path | None = None
) -> None:
    """The kernel's array ``a`` is restored from ``source`` byte for byte (with the
    snapshot ``without`` deleted first)."""
    expected = kernel.execute("print(hashlib.sha256(a.tobytes()).hexdigest())")
    kernel.kill_all()
    if without is not None:
        shutil.rmtree(without)
    restored = kernel_factory(restore_from=source)
    assert restored.execute("print(hashlib.sha256(a.tobytes()).hexdigest())") == expected


def test_each_full_copy_says_why(kernel_factory: Factory, tmp_path: Path) -> None:
    """The first snapshot, one after a restore, one whose parent is not offered, one with
    tracking off: each copies everything and names the reason."""
    kernel = kernel_factory()
    kernel.execute("x = 1")
    first = snapshot(kernel, tmp_path / "s1")
    assert (first["memory"]["mode"], first["memory"]["reason"]) == ("full", memplan.FIRST)
    gone = snapshot(kernel, tmp_path / "s2")  # no parent offered: as if evicted
    assert (gone["memory"]["mode"], gone["memory"]["reason"]) == ("full", memplan.PARENT_GONE)
    off = kernel.snapshot(tmp_path / "s3", parent=str(tmp_path / "s2"), track_memory=False)
    assert (off["memory"]["mode"], off["memory"]["reason"]) == ("full", memplan.OFF)
    kernel.restore(tmp_path / "s1")
    after = snapshot(kernel, tmp_path / "s4", parent=tmp_path / "s1")
    assert (after["memory"]["mode"], after["memory"]["reason"]) == ("full", memplan.AFTER_RESTORE)
    again = snapshot(kernel, tmp_path / "s5", parent=tmp_path / "s4")
    assert again["memory"]["mode"] == "incremental"


def test_criu_tracks_memory_here(criu: Criu) -> None:
    """The CRIU scripts/install-criu.sh builds tracks memory on this machine's kernel
    (soft-dirty bits, or the write-protect bits of its patch)."""
    kind, said = criu.dirty_tracking()
    assert kind in ("soft-dirty", "userfaultfd"), said
    out = subprocess.run([str(criu.path), "--version"], capture_output=True, text=True).stdout
    assert "GitID: jks-" in out, out


def test_the_products_criu_keeps_its_probes_of_the_kernel_between_runs(
    criu: Criu, tmp_path: Path
) -> None:
    """Patch 0002 where the product runs CRIU: a dump after another loads what the first
    probed of the kernel (kdat: as root in the prefix's run/, without root in the
    product's runtime directory) instead of probing again (~30 ms before it seizes the
    kernel)."""
    import asyncio

    def dump_log(name: str) -> str:
        images, work = tmp_path / name, tmp_path / f"{name}-work"
        images.mkdir()
        work.mkdir()
        asyncio.run(criu.dump(sleeper.pid, images, work, leave_running=True))
        return (work / "dump.log").read_text()

    with subprocess.Popen(
        ["sleep", "600"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    ) as sleeper:
        try:
            dump_log("first")
            second = dump_log("second")
        finally:
            sleeper.kill()
    assert re.search(r"Loaded kdat cache from /", second), second[:3000]


#: How a root CRIU is refused userfaultfd: a pod's RuntimeDefault-like seccomp filter, or
#: a bounding set without CAP_SYS_PTRACE where vm.unprivileged_userfaultfd is 0.
REFUSALS = {
    "seccomp": [sys.executable, "-m", "testkit.agentpods", "seccomp", "--no-userfaultfd"],
    "capabilities": ["setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace", "--"],
}

KDAT_REFUSED = r"""
set -u
rundir=$1 criu=$2; shift 2
mount -t tmpfs jks-kdat "$rundir"
"$@" "$criu" check --feature uffd-noncoop >/dev/null 2>&1; echo "refused: $?"
echo "kept: $(ls -A "$rundir")"
"$criu" check --feature uffd-noncoop >/dev/null 2>&1; echo "privileged: $?"
echo "kept: $(ls -A "$rundir")"
"$criu" check --feature uffd-noncoop -v4 -o "$rundir/third.log" >/dev/null 2>&1
echo "third: $? $(grep -c 'Loaded kdat cache' "$rundir/third.log")"
"""


@pytest.mark.skipif(
    os.geteuid() != 0,
    reason="root's CRIU keeps its probes in its prefix's run/ (an ordinary user's in "
    "$XDG_RUNTIME_DIR: test_criu_refuses_probes_of_another_boot)",
)
@pytest.mark.parametrize("refusal", sorted(REFUSALS))
def test_a_criu_refused_userfaultfd_keeps_no_probes(criu: Criu, refusal: str) -> None:
    """Patch 0008: a root CRIU refused userfaultfd finds lazy pages missing for itself but
    saves no cache; the next CRIU, with every privilege, finds them, saves its probes, and
    a third loads those. Without it the refused run's cache made every later lazy restore
    a full one (seen once in a full test run: a pod's filter). In a mount namespace of
    its own, a tmpfs over the prefix's run/, so that other tests' CRIU runs are apart."""
    rundir = criu.path.parent.parent / "run"
    assert rundir.is_dir(), "scripts/install-criu.sh makes PREFIX/run for root's kdat cache"
    sysctl = Path("/proc/sys/vm/unprivileged_userfaultfd").read_text().strip()
    if refusal == "capabilities" and sysctl != "0":
        pytest.skip(f"vm.unprivileged_userfaultfd is {sysctl}: userfaultfd needs no capability")
    in_namespace = ["unshare", "--mount", "--propagation", "private", "bash", "-c"]
    out = subprocess.run(
        [*in_namespace, KDAT_REFUSED, "-", str(rundir), str(criu.path), *REFUSALS[refusal]],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
    )
    assert out.stdout.splitlines() == [
        "refused: 1",
        "kept: ",
        "privileged: 0",
        "kept: criu.kdat",
        "third: 0 1",
    ], out.stdout + out.stderr


def test_criu_refuses_probes_of_another_boot(criu: Criu, tmp_path: Path) -> None:
    """Patch 0002: a cache kept off tmpfs carries the boot's id; one of another boot is
    stale, probed again and replaced; no temporary file stays. (A cache of this test's
    own: ``--unprivileged`` keeps it in $XDG_RUNTIME_DIR, so that other tests' CRIU runs
    cannot meddle.)"""
    if _fs_type(tmp_path) == "tmpfs":  # a cache on tmpfs carries no boot id: go to disk
        tmp_path = Path(tempfile.mkdtemp(dir=Path.home()))
    try:
        _check_a_cache_of_another_boot(criu, tmp_path)
    finally:
        if tmp_path.parent == Path.home():
            shutil.rmtree(tmp_path)


def _fs_type(path: Path) -> str:
    out = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True)
    return out.stdout.strip()


def _check_a_cache_of_another_boot(criu: Criu, tmp_path: Path) -> None:
    cache = tmp_path / "criu.kdat"

    def check_log(name: str) -> str:
        log = tmp_path / f"{name}.log"
        subprocess.run(
            [str(criu.path), "check", "--unprivileged", "-v4", "-o", str(log)],
            env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)},
            capture_output=True,
            timeout=60,
        )
        return log.read_text()

    check_log("first")
    assert f"Loaded kdat cache from {cache}" in check_log("second")
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_bytes()
    data = cache.read_bytes()
    assert boot_id in data
    other = boot_id.replace(boot_id[:1], b"1" if boot_id[:1] == b"0" else b"0", 1)
    cache.write_bytes(data.replace(boot_id, other))
    assert f"Stale {cache} file" in check_log("third")
    assert boot_id in cache.read_bytes()
    assert f"Loaded kdat cache from {cache}" in check_log("fourth")
    assert not cache.with_name(cache.name + ".tmp").exists()


def huge_kib(kernel: KernelProcess) -> int:
    """The kernel process's memory in transparent huge pages (KiB)."""
    pid = kernel.status()["inner_pid"]
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_huge_pages_stay_whole_between_snapshots(kernel_factory: Factory, tmp_path: Path) -> None:
    """Nothing is protected between snapshots (core/memtrack/digests.py): a cell that
    writes all of an array in huge pages keeps them (a write to a protected huge page
    makes Linux split it; random access then ran up to 2.7x slower here), a snapshot
    leaves them whole (a changed page in one is copied with its block), and what the
    kernel holds still restores exactly."""
    kernel = kernel_factory()
    # numpy asks for huge pages for large arrays (madvise MADV_HUGEPAGE).
    kernel.execute("import numpy as np, hashlib\na = np.random.default_rng(1).random(8 << 20)")
    before = huge_kib(kernel)
    assert before >= 48 << 10, f"no huge pages to begin with ({before} KiB)"
    snapshot(kernel, tmp_path / "s1")
    assert huge_kib(kernel) >= before - (8 << 10), "the snapshot split huge pages"
    kernel.execute("a *= 2.0")
    assert huge_kib(kernel) >= before - (8 << 10), "the cell's writes split huge pages"
    second = snapshot(kernel, tmp_path / "s2", parent=tmp_path / "s1")
    assert second["memory"]["mode"] == "incremental"
    assert second["memory"]["copied_bytes"] >= 64 << 20, "the array's change was missed"
    assert huge_kib(kernel) >= before - (8 << 10), "the second snapshot split huge pages"
    code = "print(hashlib.sha256(a.tobytes()).hexdigest())"
    expected = kernel.execute(code)
    kernel.kill_all()
    assert kernel_factory(restore_from=tmp_path / "s2").execute(code) == expected
