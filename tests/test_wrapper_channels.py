"""The wrapper's message pumps, on real ZMQ sockets."""

from __future__ import annotations

import asyncio
import select

import zmq
import zmq.asyncio

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
