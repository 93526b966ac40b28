"""Every output arrives: numbered messages from a kernel while it is snapshotted, suspended
and resumed, or restored in place, again and again; each number must reach the client
once, in order (issue 46 item 1).

A thread in the kernel prints numbered lines (one stream message each, flushed) and shows
every tenth number as a display message too, so the kernel is idle for the wrapper (a
busy kernel is never suspended) while it sends without pause (~3,000 messages a second
here). In CI each run does a few operations and then tells the kernel to stop (a file:
it outlives a restore in place), so every operation comes while it prints however slow
the machine; well under a minute. By hand, the issue's size, an operation every second
until the kernel has printed all:

    KSNAP_OUTPUT_MESSAGES=200000 KSNAP_OUTPUT_ROUNDS=0 \
        .venv/bin/python -m pytest tests/test_output_delivery.py
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from jupyter_client.session import Session

from testkit.processes import KernelProcess

Factory = Callable[..., KernelProcess]

#: Numbered lines the kernel prints per run at most (KSNAP_OUTPUT_MESSAGES overrides).
MESSAGES = int(os.environ.get("KSNAP_OUTPUT_MESSAGES", "1000000"))
#: Seconds between two operations on the kernel while it prints.
INTERVAL = float(os.environ.get("KSNAP_OUTPUT_INTERVAL", "1.0"))
#: Operations per run, after which the kernel stops printing (0: an operation every
#: INTERVAL until it has printed all MESSAGES). A restore in place sends the kernel back
#: to its snapshot: only the interval's output is progress.
ROUNDS = int(os.environ.get("KSNAP_OUTPUT_ROUNDS", "5"))

NUMBERED = """
import os
from IPython.display import display
def _numbered(count, stop):
    i = 0
    while i < count and (i % 100 or not os.path.exists(stop)):
        print(i, flush=True)
        if i % 10 == 0:
            display({"text/plain": f"d{i}"}, raw=True)
        i += 1
    print(f"end:{i}", flush=True)
"""
#: In a thread: the kernel is idle (a busy kernel is never suspended) while it prints.
PRINTER = NUMBERED + (
    "import threading\nthreading.Thread(target=_numbered, args=(COUNT, STOP)).start()"
)
#: In the cell: the kernel is busy, its status says so before the first number and idle
#: after the last.
CELL = NUMBERED + "_numbered(COUNT, STOP)"


class Received:
    """What a subscriber receives on IOPub for the printing cell, collected in a thread.

    The subscriber queues without limit, as a client that keeps up does: one left more
    than 1,000 messages behind loses output with any kernel (ZeroMQ drops what a PUB
    socket cannot queue for it), snapshots or not."""

    def __init__(self, kernel: KernelProcess, stop: Path) -> None:
        self.kernel = kernel
        self.stop_file = stop
        """Made once the test's operations are done: the kernel stops printing."""
        # A session of its own: one checks each signature once (the client's own saw
        # the same messages).
        self.session = Session(key=kernel.client.session.key)
        info = kernel.client.get_connection_info()
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(f"{info['transport']}://{info['ip']}:{info['iopub_port']}")
        # Subscribed once a message of a cell run now comes through.
        while not self.socket.poll(200):
            kernel.execute("1")
        self.numbers: list[int] = []
        self.shown: list[int] = []
        self.states: list[tuple[str, int]] = []
        """Each status of the cell, with how many numbers had come before it."""
        self.ended = threading.Event()
        self.count = 0
        """How many numbers the kernel printed, as its "end" line says."""
        self.parent: str | None = None
        self.resumed = (0, 0)
        """How many numbers and shown numbers had come when the last operation was done."""
        self.code = PRINTER
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._collect, daemon=True)

    def start(self, code: str) -> None:
        """Run ``code`` (PRINTER or CELL) and collect what it sends."""
        self.code = code
        code = code.replace("COUNT", str(MESSAGES)).replace("STOP", repr(str(self.stop_file)))
        self.parent = self.kernel.client.execute(code)
        self._thread.start()

    def _collect(self) -> None:
        while not self._stop.is_set():
            if not self.socket.poll(200):
                continue
            _, frames = self.session.feed_identities(self.socket.recv_multipart())
            try:
                msg = self.session.deserialize(frames)
            except ValueError as exc:
                # A kernel restored in place sends again what its snapshot held, ready
                # to go, and it had sent since: a client refuses such a replay.
                if "Duplicate Signature" in str(exc):
                    continue
                raise
            if msg["parent_header"].get("msg_id") != self.parent:
                continue
            if msg["msg_type"] == "stream":
                # Words: the stream may split a line between messages, not a word (each
                # is one write).
                for word in msg["content"]["text"].split():
                    if word.startswith("end:"):
                        self.count = int(word.removeprefix("end:"))
                        self.ended.set()
                    else:  # a kernel restored in place after "end" prints again
                        self.ended.clear()
                        self.numbers.append(int(word))
            elif msg["msg_type"] == "display_data":
                self.shown.append(int(msg["content"]["data"]["text/plain"][1:]))
            elif msg["msg_type"] == "status":
                self.states.append((msg["content"]["execution_state"], len(self.numbers)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self.socket.close(linger=0)
        self.context.term()


def gaps(
    numbers: list[int], count: int, step: int = 1, rewinds: bool = False, resumed: int = 0
) -> list[str]:
    """What is wrong with ``numbers`` (0, step, 2*step ... below ``count``, in order): a
    number missing or out of place. With ``rewinds`` a run may start again from an
    earlier number (a restore in place goes back to its snapshot) but never skip one;
    ``resumed`` is how many had come when the last restore was done. If the restored
    kernel sent none, its snapshot was taken past the last of them (say between
    ``print(34695)`` and the stop check at 34700): the run before may have gone beyond
    ``count`` and was rewound to a point that sends no more."""
    wrong: list[str] = []
    expected = 0
    for n in numbers:
        if n == expected or (rewinds and n % step == 0 and n < expected):
            expected = n + step
            continue
        wrong.append(f"got {n} where {expected} was due")
        expected = n + step
    due = (count + step - 1) // step * step
    restored_past_the_last = rewinds and len(numbers) == resumed and expected > due
    if expected != due and not restored_past_the_last:
        wrong.append(f"ended before {count} (next due: {expected})")
    return wrong


@pytest.fixture
def printing(
    kernel_factory: Factory, request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[KernelProcess, Received]]:
    kernel = kernel_factory()
    received = Received(kernel, tmp_path / "stop")
    try:
        received.start(getattr(request, "param", PRINTER))
        yield kernel, received
    finally:
        received.stop()


def run_until_printed(received: Received, operation: Callable[[int], Any]) -> int:
    """Call ``operation(n)`` every INTERVAL seconds while the kernel prints (ROUNDS times,
    then tell it to stop), then wait until it has printed all; the number of operations
    done."""
    done = 0
    while not received.ended.is_set() and (ROUNDS == 0 or done < ROUNDS):
        time.sleep(INTERVAL)
        if received.ended.is_set():
            break
        operation(done)
        received.resumed = (len(received.numbers), len(received.shown))
        done += 1
    received.stop_file.touch()
    print(
        f"{done} operations while the kernel printed"
    )  # Until "end" comes, or nothing more for a long while (what was lost shows in check).
    seen = -1
    while not received.ended.wait(30) and len(received.numbers) != seen:
        seen = len(received.numbers)
    return done


def check(received: Received, rewinds: bool = False) -> None:
    """Every number once, in order ("end" came after the last one); else what the
    wrapper logged."""
    numbers_resumed, shown_resumed = received.resumed
    wrong = gaps(received.numbers, received.count, rewinds=rewinds, resumed=numbers_resumed)
    wrong += gaps(received.shown, received.count, 10, rewinds, shown_resumed)
    if rewinds and len(received.shown) == shown_resumed:
        # Nothing shown after the last restore: neither may a number it printed ask for it.
        after = received.numbers[numbers_resumed:]
        wrong += [f"{n} printed after the last restore, not shown" for n in after if n % 10 == 0]
    assert wrong == [], "\n".join([*wrong, received.kernel.log()[-5000:]])


@pytest.mark.parametrize("printing", [PRINTER, CELL], ids=["thread", "cell"], indirect=True)
def test_every_output_arrives_across_snapshots(
    printing: tuple[KernelProcess, Received], tmp_path: Path
) -> None:
    kernel, received = printing
    done = run_until_printed(received, lambda n: kernel.snapshot(tmp_path / f"s{n}"))
    assert done >= 2
    check(received)
    if received.code == CELL:  # busy before the first number, idle after the last
        while not received.states or received.states[-1][0] != "idle":
            time.sleep(0.1)
        assert received.states == [("busy", 0), ("idle", received.count)]


def test_every_output_arrives_across_suspend_and_resume(
    printing: tuple[KernelProcess, Received], tmp_path: Path
) -> None:
    kernel, received = printing

    def suspend_and_resume(n: int) -> None:
        kernel.control.request_sync("suspend", {"dest": str(tmp_path / f"s{n}")}, timeout=300)
        assert kernel.status()["state"] == "suspended"
        kernel.control.request_sync("resume", {}, timeout=300)

    assert run_until_printed(received, suspend_and_resume) >= 2
    check(received)


def test_every_output_arrives_across_restores_in_place(
    printing: tuple[KernelProcess, Received], tmp_path: Path
) -> None:
    """Each round snapshots the kernel and restores that snapshot in place at once: the
    kernel goes back to the snapshot, so the numbers printed between the two come again
    (a rewind), and none is skipped."""
    kernel, received = printing

    def snapshot_and_restore(n: int) -> None:
        kernel.snapshot(tmp_path / f"s{n}")
        kernel.restore(tmp_path / f"s{n}")

    assert run_until_printed(received, snapshot_and_restore) >= 2
    check(received, rewinds=True)
