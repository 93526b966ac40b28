"""A cell running at the snapshot goes on after a restore into a new kernel (another
node, or the same server after the old kernel died), and what it sends reaches the new
kernel's clients: stream output, status, and its execute_reply."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from jupyter_client import BlockingKernelClient

from jupyter_ext.core import proctree
from jupyter_ext.core.manifest import Manifest
from testkit.processes import (
    Endpoint,
    KernelProcess,
    ServerProcess,
    execute_request,
    kernel_message,
    ws_close,
    ws_connect,
)

from .support.jupyter_api import server_config
from .support.servers import follow

Factory = Callable[..., KernelProcess]
STEPS_OF_SERVER_LOOP = 60

#: Prints "step i" every 0.25 s: long enough that a client of the restored kernel connects
#: while it still runs (steps seen after the restore prove the output reached it).
LOOP = "import time\nfor i in range(STEPS):\n    print('step', i, flush=True)\n    time.sleep(0.25)"


def test_resumed_cell_reaches_a_new_client_of_a_new_wrapper(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    steps = 40
    a = kernel_factory()
    a.execute("x = 1")
    content = {"code": LOOP.replace("STEPS", str(steps)), "silent": False, "store_history": True}
    request = a.client.session.msg(
        "execute_request",
        {**content, "user_expressions": {}, "allow_stdin": False},
        metadata={"cellId": "cell-7"},  # as JupyterLab sends it
    )
    a.client.shell_channel.send(request)
    msg_id = request["header"]["msg_id"]
    wait_for_step(a, msg_id, 3)
    a.snapshot(tmp_path / "s")
    printed = printed_steps(a, msg_id)  # what A printed before it died
    a.kill_all()
    manifest = Manifest.read(tmp_path / "s")
    assert manifest.running_request is not None
    assert manifest.running_request["header"]["msg_id"] == msg_id
    assert manifest.running_request["cell_id"] == "cell-7"
    assert manifest.running_request["execution_count"] == 2

    b = kernel_factory(restore_from=tmp_path / "s")
    resumed = b.status()["resumed_request"]
    assert resumed is not None
    assert resumed["header"]["msg_id"] == msg_id
    time.sleep(1)  # a client that comes late, as a notebook opened after the restore does
    late = BlockingKernelClient(connection_file=str(b.connection_file))
    late.load_connection_file()
    late.start_channels()
    try:
        late.kernel_info()  # what JupyterLab asks first: answered while the cell runs
        seen: list[int] = []
        while True:
            msg = late.get_iopub_msg(timeout=60)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                seen += [int(w) for w in msg["content"]["text"].split() if w.isdigit()]
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        # Every line since the snapshot, also those printed before this client came.
        assert seen
        assert min(seen) <= max(printed) + 1
        assert sorted(set(seen)) == list(range(min(seen), steps))
        replies = [late.get_shell_msg(timeout=30) for _ in range(2)]
        reply = next(r for r in replies if r["msg_type"] == "execute_reply")
        assert reply["parent_header"]["msg_id"] == msg_id  # the cell's own client is gone
        assert reply["content"]["status"] == "ok"
        assert reply["content"]["execution_count"] == 2
    finally:
        late.stop_channels()
    assert b.status()["resumed_request"] is None
    assert b.execute("print(x + 1)").strip() == "2"


#: /dev/shm memory the kernel holds: the freeze copies it, so the kernel's requests are held
#: long enough for a cell to be sent into the pause; and a log it appends to, copied once
#: the kernel runs again, before the snapshot's record is written.
HOLD_SHM_AND_LOG = """
import mmap, os
shm_path = f"/dev/shm/jks-pause-{os.getpid()}"
shm_file = open(shm_path, "w+b")
shm_file.truncate(256 << 20)
shm = mmap.mmap(shm_file.fileno(), 256 << 20)
shm.write(os.urandom(1 << 20) * 256)
log = open(LOG, "a")
log.write("line\\n" * (64 << 20))
log.flush()
"""


def test_a_cell_sent_during_the_freeze_is_not_in_the_snapshot(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    """A cell that arrives while a snapshot holds the kernel's requests runs after the
    freeze: the snapshot records no running cell. (Read after the dump, it recorded that
    cell: a restore then waited for ever for a cell its kernel never got, and the kernel
    took no cell checkpoint again.)"""
    kernel = kernel_factory()
    kernel.execute(HOLD_SHM_AND_LOG.replace("LOG", repr(str(tmp_path / "kernel.log"))))
    sent: list[str] = []

    def send_a_cell(event: dict[str, Any]) -> None:
        if event.get("phase") == "dumping" and not sent:  # its requests held from now on
            request = kernel.client.session.msg(
                "execute_request",
                {"code": "import time; time.sleep(3)", "silent": False, "user_expressions": {}},
                metadata={"cellId": "cell-late"},
            )
            kernel.client.shell_channel.send(request)
            sent.append(request["header"]["msg_id"])

    manifest = kernel.control.request_sync(
        "snapshot", {"dest": str(tmp_path / "s")}, on_progress=send_a_cell, timeout=300
    )
    assert sent, "the snapshot said no 'dumping' phase"
    assert manifest["running_request"] is None, manifest["running_request"]
    # The cell ran after the freeze, in the running kernel.
    assert kernel.status()["running_request"]["header"]["msg_id"] == sent[0]
    kernel.execute("shm.close(); shm_file.close(); os.unlink(shm_path); log.close()")


def printed_steps(kernel: KernelProcess, msg_id: str) -> list[int]:
    """The steps the kernel's client got so far (it waits for the stream to pause)."""
    steps: list[int] = []
    with contextlib.suppress(queue.Empty):
        while True:
            msg = kernel.client.get_iopub_msg(timeout=1)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
                steps += [int(w) for w in msg["content"]["text"].split() if w.isdigit()]
    return steps or [3]


def wait_for_step(kernel: KernelProcess, msg_id: str, step: int) -> None:
    while True:
        msg = kernel.client.get_iopub_msg(timeout=60)
        if (
            msg["parent_header"].get("msg_id") == msg_id
            and msg["msg_type"] == "stream"
            and f"step {step}" in msg["content"]["text"]
        ):
            return


async def start_loop(server: ServerProcess, kernel_id: str, steps: int) -> str:
    """Start the loop in a kernel through a websocket; return once step 3 was printed."""
    ws = await ws_connect(server, kernel_id)
    msg_id, message = execute_request(LOOP.replace("STEPS", str(steps)), "cell-1")
    ws.write_message(message)
    while True:
        data = json.loads(await asyncio.wait_for(ws.read_message(), 60))
        if (
            data["parent_header"].get("msg_id") == msg_id
            and data["msg_type"] == "stream"
            and "step 3" in data["content"]["text"]
        ):
            await ws_close(ws)
            return msg_id


async def follow_resumed(server: Endpoint, kernel_id: str, msg_id: str) -> dict[str, Any]:
    """What a websocket client of the restored kernel sees of the resumed cell. Like
    JupyterLab, it asks for kernel_info first: the answer comes at once, although the
    kernel runs a cell."""
    ws = await ws_connect(server, kernel_id)
    info_id, info = kernel_message("kernel_info_request", {})
    ws.write_message(info)
    steps: list[int] = []
    reply: dict[str, Any] | None = None
    states: list[str] = []
    info_before_reply = False
    while reply is None:
        data = json.loads(await asyncio.wait_for(ws.read_message(), 60))
        if data["msg_type"] == "kernel_info_reply" and data["parent_header"]["msg_id"] == info_id:
            info_before_reply = not steps or steps[-1] < STEPS_OF_SERVER_LOOP - 1
        if data["parent_header"].get("msg_id") != msg_id:
            continue
        if data["msg_type"] == "stream":
            steps += [int(w) for w in data["content"]["text"].split() if w.isdigit()]
        elif data["msg_type"] == "status":
            states.append(data["content"]["execution_state"])
        elif data["msg_type"] == "execute_reply":
            reply = data["content"]
    await ws_close(ws)
    return {"steps": steps, "reply": reply, "states": states, "info": info_before_reply}


@pytest.mark.parametrize("where", ["same-server", "other-server"])
def test_resumed_cell_reaches_websocket_clients_after_a_restore_into_a_new_kernel(
    tmp_path: Path, snapshot_kernelspec: str, where: str
) -> None:
    """Server A runs the loop and is snapshotted mid-loop; its kernel dies (SIGKILL of the
    kernel's processes, or of all of server A); a new kernel restored from the snapshot, on
    A or on a server B sharing the store, goes on with the loop, and a websocket client of
    the new kernel gets the loop's lines, its status and its execute_reply."""
    steps = STEPS_OF_SERVER_LOOP
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    config = server_config(tmp_path)
    a = ServerProcess(tmp_path / "a", notebooks, config)
    b = ServerProcess(tmp_path / "b", notebooks, config) if where == "other-server" else a
    try:
        kernel = a.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
        msg_id = asyncio.run(start_loop(a, kernel, steps))
        snapshot = follow(a, a.client.call("POST", "", body={"kernel_id": kernel})["job"])
        assert snapshot["status"] == "done", snapshot
        running = snapshot["result"]["running_request"]
        assert (running["header"]["msg_id"], running["cell_id"]) == (msg_id, "cell-1")
        if where == "other-server":
            a.kill_node()
        else:
            # The kernel dies (wrapper and kernel, SIGKILL); the server runs on.
            for pid in proctree.descendants(a.process.pid)[1:]:
                signal_kill(pid)
        job = b.client.call("POST", f"{snapshot['result']['id']}/restore", body={})["job"]
        restored = follow(b, job)
        assert restored["status"] == "done", restored
        assert restored["result"]["running_request"]["header"]["msg_id"] == msg_id
        seen = asyncio.run(follow_resumed(b, restored["result"]["kernel_id"], msg_id))
    finally:
        for server in {a, b}:
            if server.process.poll() is None:
                server.stop()
    assert seen["steps"]
    assert seen["steps"][-1] == steps - 1
    # Every line since the snapshot (early in the loop), also those printed before the
    # client connected.
    assert seen["steps"][0] < steps // 2, seen
    assert sorted(set(seen["steps"])) == list(range(seen["steps"][0], steps)), seen
    assert "busy" in seen["states"]
    assert seen["info"]  # kernel_info answered while the cell ran
    assert seen["reply"]["status"] == "ok"
    assert seen["reply"]["execution_count"] == 1


def signal_kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
