"""What the tests add to the servers they start (testkit.processes.ServerProcess, which
the benchmarks share): "nodes" to run them on, a job followed, a cell run.

A node is a network namespace of ours, attached to a bridge in the test's namespace, so
servers on different nodes share nothing but the network (and what a test points at both,
like an S3 server or the notebooks' directory). Traffic stays on addresses we create.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from testkit.processes import Endpoint, ServerProcess, execute_request, ws_close, ws_connect

if TYPE_CHECKING:
    from tornado.websocket import WebSocketClientConnection

#: One bridge and subnet per pytest-xdist worker (``gw0``, ``gw1``...; none: the first),
#: so that two workers' nodes never meet.
WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
BRIDGE = f"jksbr{WORKER}"
SUBNET = f"10.213.{7 + WORKER}"
HOST_ADDRESS = f"{SUBNET}.1"
#: The bucket of the nodes' S3 server (the ``s3_url`` fixture, tests/conftest.py).
BUCKET = "kernel-snapshots-nodes"
#: Run the nodes' servers (their kernels and CRIU) as this ordinary user: the other-node test
#: of non-root mode (scripts/nonroot-tests.sh sets it; the network still needs root).
NODE_USER = os.environ.get("JKS_NODE_USER") or None
CREDENTIALS = {
    "aws_access_key_id": "testing",
    "aws_secret_access_key": "testing",
    "region_name": "us-east-1",
}
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


class Network:
    """A bridge with our address, and nodes (network namespaces) plugged into it."""

    def __init__(self) -> None:
        self.nodes: list[str] = []
        #: The servers started on the nodes: what a failed test left running is killed at close.
        self.servers: list[ServerProcess] = []
        self._tag = uuid.uuid4().hex[:6]
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, check=False)
        run("ip", "link", "add", BRIDGE, "type", "bridge")
        run("ip", "addr", "add", f"{HOST_ADDRESS}/24", "dev", BRIDGE)
        run("ip", "link", "set", BRIDGE, "up")

    def add_node(self) -> tuple[str, str]:
        """A new node: (namespace name, its address). Each gets the next number, so tests
        sharing a network never reuse one."""
        index = len(self.nodes) + 1
        name = f"jks-{self._tag}-{index}"
        host_end, node_end = f"jksh{self._tag}{index}", f"jksn{self._tag}{index}"
        address = f"{SUBNET}.{10 + index}"
        run("ip", "netns", "add", name)
        self.nodes.append(name)
        run("ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end)
        run("ip", "link", "set", node_end, "netns", name)
        run("ip", "link", "set", host_end, "master", BRIDGE)
        run("ip", "link", "set", host_end, "up")
        run("ip", "netns", "exec", name, "ip", "addr", "add", f"{address}/24", "dev", node_end)
        run("ip", "netns", "exec", name, "ip", "link", "set", node_end, "up")
        run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        return name, address

    def close(self) -> None:
        for server in self.servers:
            if server.process.poll() is None:
                server.kill_node()
        for name in self.nodes:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, check=False)


def node_server(
    network: Network,
    home: Path,
    notebooks: Path,
    s3_url: str,
    owner: str,
    env: dict[str, str] = S3_ENV,
) -> ServerProcess:
    """A server on a new node (a pod: its own PID namespace and /proc) with the nodes' S3
    store (its credentials in ``env``), as ``owner``; as JKS_NODE_USER where that is set."""
    netns, address = network.add_node()
    config: dict[str, Any] = {
        "SnapshotExtensionApp": {
            "store": "s3",
            "s3_bucket": BUCKET,
            "s3_endpoint_url": s3_url,
            "owner": owner,
            "idle_suspend_after": 0,
            "snapshot_before_shutdown": False,
        }
    }
    server = ServerProcess(
        home,
        notebooks,
        config,
        netns=netns,
        address=address,
        env=env,
        user=NODE_USER,
        pod=True,
    )
    network.servers.append(server)
    return server


def follow(server: Endpoint, job: dict[str, Any]) -> dict[str, Any]:
    """Wait for a job of the server's to end; it must have succeeded."""
    done = server.client.follow(job)
    assert done["status"] == "done", done
    return done


async def ws_run(
    ws: WebSocketClientConnection, code: str, timeout: float = 120, cell_id: str | None = None
) -> str:
    """Run ``code`` on an open kernel websocket, as JupyterLab does (from the cell
    ``cell_id``); return its stdout once the kernel is idle again, or raise with the error."""
    import asyncio

    msg_id, message = execute_request(code, cell_id)
    ws.write_message(message)
    out: list[str] = []
    reply: dict[str, Any] | None = None
    idle = False
    deadline = time.monotonic() + timeout
    while (reply is None or not idle) and time.monotonic() < deadline:
        raw = await asyncio.wait_for(ws.read_message(), deadline - time.monotonic())
        if raw is None:
            raise RuntimeError("the kernel's websocket closed")
        msg = json.loads(raw)
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out.append("\n".join(msg["content"]["traceback"]))
        elif msg["msg_type"] == "execute_reply":
            reply = msg["content"]
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            idle = True
    if reply is None:
        raise TimeoutError(f"no execute_reply for {code!r}")
    if reply["status"] != "ok":
        raise AssertionError(f"cell failed: {''.join(out)}")
    return "".join(out)


def ws_execute(
    server: Endpoint, kernel_id: str, code: str, timeout: float = 120, cell_id: str | None = None
) -> str:
    """Run ``code`` in a kernel through the server's websocket (:func:`ws_run`)."""
    import asyncio

    async def go() -> str:
        ws = await ws_connect(server, kernel_id)
        try:
            return await ws_run(ws, code, timeout, cell_id)
        finally:
            await ws_close(ws)

    return asyncio.run(go())
