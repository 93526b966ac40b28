"""Stress the kernel's channels: snapshots, failed dumps and restores on several kernels at
once, and every request must be answered.

Each worker owns a snapshot kernel and loops over random operations (snapshot while idle,
snapshot during a cell, a dump that fails on a corked UDP socket, a kernel restored
beside the running one, kill and restore in place), then runs a cell that must answer
with the expected counter. On the first request left unanswered it prints every thread of
the wrapper and the kernel (py-spy stacks where installed) and the wrapper's log, and
exits 1. Not a test (it runs minutes and loads the machine); run it after touching the
wrapper's channels:

    sudo .venv/bin/python bench/stress_channels.py --rounds 300 --workers 6
"""

from __future__ import annotations

import argparse
import collections
import queue
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jupyter_ext.core import proctree
from jupyter_ext.core.errors import DumpError
from testkit.processes import KernelProcess, describe_threads

OPERATIONS = ("snapshot", "snapshot_busy", "failed_dump", "restore_beside", "restore_in_place")
ANSWER_TIMEOUT = 30.0


class Stress:
    def __init__(self, root: Path, rounds: int) -> None:
        self.root = root
        self.rounds = rounds
        self.failed = threading.Event()
        self.counts: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()

    def expect(self, kernel: KernelProcess, code: str, expected: int, what: str) -> None:
        try:
            out = kernel.execute(code, timeout=ANSWER_TIMEOUT).strip()
        except Exception as exc:
            self.unanswered(kernel, what, repr(exc))
            raise
        if out != str(expected):
            self.failed.set()
            raise AssertionError(f"{what}: printed {out!r}, expected {expected}")

    def await_reply(self, kernel: KernelProcess, msg_id: str, what: str) -> None:
        deadline = time.monotonic() + ANSWER_TIMEOUT
        try:
            while True:
                left = max(0.1, deadline - time.monotonic())
                reply = kernel.client.get_shell_msg(timeout=left)
                if reply["parent_header"].get("msg_id") == msg_id:
                    return
        except queue.Empty:
            self.unanswered(kernel, what, "no execute_reply")
            raise

    def unanswered(self, kernel: KernelProcess, what: str, why: str) -> None:
        self.failed.set()
        pids = [kernel.process.pid, *proctree.descendants(kernel.process.pid)]
        print(f"\nUNANSWERED {what}: {why}\n{describe_threads(pids)}")
        print(f"--- wrapper log:\n{kernel.log()[-4000:]}", flush=True)

    def worker(self, index: int) -> None:
        base = self.root / f"worker-{index}"
        kernel = KernelProcess(base / "kernels")
        n = 0
        kernel.execute("n = 0")
        try:
            for round_ in range(self.rounds):
                if self.failed.is_set():
                    return
                op = random.choice(OPERATIONS)
                with self.lock:
                    self.counts[op] += 1
                dest = base / f"snapshot-{round_}"
                what = f"worker {index} round {round_} after {op}"
                if op == "snapshot":
                    kernel.snapshot(dest)
                elif op == "snapshot_busy":
                    msg_id = kernel.client.execute("import time; time.sleep(0.3); n += 1")
                    kernel.snapshot(dest)
                    n += 1
                    self.await_reply(kernel, msg_id, what + " (the cell during it)")
                elif op == "failed_dump":
                    # A UDP socket with corked data: CRIU cannot dump it (TCP it can).
                    kernel.execute(
                        "import socket; udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                        "udp.setsockopt(socket.IPPROTO_UDP, 1, 1)  # UDP_CORK\n"
                        "udp.sendto(b'x', ('127.0.0.1', 9))"
                    )
                    try:
                        kernel.snapshot(dest)
                    except DumpError:
                        pass
                    else:
                        raise AssertionError(f"{what}: the dump should have failed")
                    n += 1
                    self.expect(kernel, "n += 1; print(n)", n, what)
                    kernel.execute("udp.close()")
                elif op == "restore_beside":
                    kernel.snapshot(dest)
                    other = KernelProcess(base / "kernels", restore_from=dest)
                    self.expect(other, "n += 100; print(n)", n + 100, what + " (restored)")
                    other.shutdown()
                else:
                    kernel.snapshot(dest)
                    kernel.kill_inner()
                    kernel.restore(dest)
                n += 1
                self.expect(kernel, "n += 1; print(n)", n, what)
                shutil.rmtree(dest, ignore_errors=True)
        except BaseException:
            self.failed.set()  # the others stop; the thread prints the traceback
            raise
        finally:
            if self.failed.is_set():
                kernel.kill_all()
            else:
                kernel.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100, help="operations per worker")
    parser.add_argument("--workers", type=int, default=4, help="kernels at once")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="stress-channels-") as tmp:
        stress = Stress(Path(tmp), args.rounds)
        started = time.monotonic()
        threads = [threading.Thread(target=stress.worker, args=(i,)) for i in range(args.workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        total = sum(stress.counts.values())
        verdict = "FAILED" if stress.failed.is_set() else "every request answered"
        print(
            f"{total} operations in {time.monotonic() - started:.0f} s "
            f"({dict(stress.counts)}): {verdict}"
        )
        return 1 if stress.failed.is_set() else 0


if __name__ == "__main__":
    sys.exit(main())
