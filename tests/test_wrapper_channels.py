"""The wrapper's channels: its message pumps on real ZMQ sockets, its bound ports."""

from __future__ import annotations

import asyncio
import select
import socket
import subprocess
import sys
from pathlib import Path

import zmq
import zmq.asyncio
from jupyter_client.connect import write_connection_file

from jupyter_ext.core.protocol.control import EXIT_PORT_IN_USE
from kernel_wrapper.channels import receive_ready, send_now


def test_a_send_never_hides_a_message_waiting_to_be_received() -> None:
    asyncio.run(_send_while_a_reply_waits())


async def _send_while_a_reply_waits() -> None:
    """A pump waits to receive on a socket that the wrapper also sends on (the kernel's
    shell: requests in, replies out). A reply arriving just before a request is sent must
    still wake the pump: libzmq's wake-up descriptor is edge-triggered and the send
    consumes the edge (a kernel whose reply was never forwarded, seen after snapshots)."""
    context = zmq.asyncio.Context()
    wrapper_end = context.socket(zmq.DEALER)
    kernel_end = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        wrapper_end.setsockopt(zmq.ROUTING_ID, b"wrapper")
        port = wrapper_end.bind_to_random_port("tcp://127.0.0.1")
        kernel_end.connect(f"tcp://127.0.0.1:{port}")
        while True:  # until the kernel's end has connected
            try:
                send_now(wrapper_end, [b"request 1"])
                break
            except zmq.Again:
                await asyncio.sleep(0.01)
        assert kernel_end.recv_multipart() == [b"wrapper", b"request 1"]

        pump = asyncio.ensure_future(receive_ready(wrapper_end))
        await asyncio.sleep(0.05)  # the pump now waits on the descriptor
        assert not pump.done()
        kernel_end.send_multipart([b"wrapper", b"reply 1"])
        # The reply's wake-up reaches the descriptor; send before the loop looks at it.
        assert select.select([wrapper_end.FD], [], [], 5)[0], "the reply never arrived"
        send_now(wrapper_end, [b"request 2"])
        assert await asyncio.wait_for(pump, 5) == [[b"reply 1"]]
    finally:
        wrapper_end.close(linger=0)
        kernel_end.close(linger=0)
        context.term()


def test_a_port_taken_before_the_wrapper_binds_it_is_said_with_its_own_exit_status(
    tmp_path: Path,
) -> None:
    """jupyter_client picks free ports and closes them; before the wrapper binds them,
    another process's outgoing connection can take one as its local port (seen on CI: the
    kernel died before replying). The wrapper says which port, and exits with the status
    that tells the harness (and a reader of the server's log) to start again on new ports,
    as the server's restarter does for a kernel that never came up."""
    listener = socket.create_server(("127.0.0.1", 0))
    outgoing = socket.create_connection(listener.getsockname())
    try:
        taken = outgoing.getsockname()[1]
        connection_file = tmp_path / "kernel.json"
        write_connection_file(str(connection_file), shell_port=taken, key=b"k")
        argv = ["-f", str(connection_file), "--runtime-dir", str(tmp_path / "runtime")]
        ran = subprocess.run(
            [sys.executable, "-m", "kernel_wrapper", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
    finally:
        outgoing.close()
        listener.close()
    assert ran.returncode == EXIT_PORT_IN_USE, ran.stderr
    assert f"The kernel's shell port, tcp://127.0.0.1:{taken}" in ran.stderr
    assert "in use by another process" in ran.stderr
    assert "Traceback" not in ran.stderr
    assert not any((tmp_path / "runtime").iterdir())  # its runtime directory removed
