"""A design probe for issue 43's tracking cost: what finding a kernel's changed pages by
their content would cost, instead of write-protecting its memory between snapshots.

Write-protection (asynchronous userfaultfd) makes the kernel pay a fault per 4 KiB page
on its first write after a snapshot, and Linux splits its transparent huge pages to do
it: a cell that rewrites all of a 1 GiB array once took 6.5x as long tracked
(bench/RESULTS.md). The alternative probed here costs the kernel nothing between
snapshots: at a snapshot, read all of its memory from outside (``process_vm_readv``)
and hash each page (xxh3-128), comparing the digests with the last snapshot's. What it
costs moves to the snapshot, while the kernel runs.

For each size, one run: a plain Python process holding that much random float64; inside
it, the cell that rewrites all of it once (``data *= 1.0000001``, the kernel's own cost,
untracked); from outside, reading all of it (the ceiling: the copy alone), hashing it
(a page at a time), and both. Memory warmed before each size (DESIGN.md).

    .venv/bin/python bench/bench_content_scan.py [--sizes 1024,4096] [--repeat 3]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
import xxhash

MIB = 1 << 20
PAGE = 4096
#: What each read from the other process copies at once.
READ_BYTES = 64 * MIB

HOLDER = """
import sys, time
import numpy as np
data = np.random.default_rng(1).random({size} // 8)
print(data.ctypes.data, flush=True)
for line in sys.stdin:
    t = time.perf_counter(); data *= 1.0000001; print(time.perf_counter() - t, flush=True)
"""


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


LIBC = ctypes.CDLL(None, use_errno=True)


def read_remote(pid: int, address: int, into: np.ndarray, length: int) -> None:
    local, remote = IoVec(into.ctypes.data, length), IoVec(address, length)
    got = LIBC.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if got != length:
        raise OSError(ctypes.get_errno(), f"process_vm_readv read {got} of {length}")


def scan(pid: int, address: int, size: int, buf: np.ndarray, *, read: bool, hashing: bool) -> float:
    """Seconds to read (and/or hash, a page at a time) ``size`` bytes of ``pid`` through
    ``buf`` (touched beforehand)."""
    digests = bytearray(16 * (size // PAGE))
    view = memoryview(buf)
    start = time.perf_counter()
    for offset in range(0, size, READ_BYTES):
        length = min(READ_BYTES, size - offset)
        if read:
            read_remote(pid, address + offset, buf, length)
        if hashing:
            first = offset // PAGE * 16
            for page in range(0, length, PAGE):
                at = first + page // PAGE * 16
                digests[at : at + 16] = xxhash.xxh3_128_digest(view[page : page + PAGE])
    return time.perf_counter() - start


def warm(mib: int) -> None:
    size = 2 * mib * MIB
    subprocess.run(
        [sys.executable, "-c", f"b = bytearray({size}); b[::4096] = b'x' * len(b[::4096])"],
        check=True,
    )


def measure(mib: int) -> dict[str, float]:
    size = mib * MIB
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER.format(size=size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin
    assert holder.stdout
    try:
        address = int(holder.stdout.readline())
        holder.stdin.write("go\n")
        holder.stdin.flush()
        write_all = float(holder.stdout.readline())
        buf = np.ones(READ_BYTES, dtype=np.uint8)
        return {
            "write_all": write_all,
            "read": scan(holder.pid, address, size, buf, read=True, hashing=False),
            "hash": scan(holder.pid, address, size, buf, read=False, hashing=True),
            "read_and_hash": scan(holder.pid, address, size, buf, read=True, hashing=True),
        }
    finally:
        holder.kill()
        holder.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1024,4096", help="MiB, comma-separated")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="write every run here")
    args = parser.parse_args()
    report: dict[str, object] = {"machine": platform.uname()._asdict(), "sizes": {}}
    print(
        "| kernel | write-all cell (kernel's own) | read all | hash all | read + hash | "
        "read + hash per GiB | x the write-all cell |"
    )
    print("|---|---|---|---|---|---|---|")
    for mib in (int(s) for s in args.sizes.split(",")):
        warm(mib)
        runs = [measure(mib) for _ in range(args.repeat)]
        report["sizes"][mib] = runs  # type: ignore[index]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}

        def cell(k: str, runs: list[dict[str, float]] = runs) -> str:
            values = [r[k] for r in runs]
            return f"{statistics.median(values):.3f} s ({min(values):.3f}-{max(values):.3f})"

        print(
            f"| {mib} MiB | {cell('write_all')} | {cell('read')} | {cell('hash')} | "
            f"{cell('read_and_hash')} | {med['read_and_hash'] / (mib / 1024):.3f} s | "
            f"{med['read_and_hash'] / med['write_all']:.1f}x |"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)


if __name__ == "__main__":
    main()
