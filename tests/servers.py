"""Real Jupyter servers as separate processes, optionally on their own "node".

A node is a network namespace of ours, attached to a bridge in the test's namespace, so
servers on different nodes share nothing but the network (and what a test points at both,
like an S3 server or the notebooks' directory). Traffic stays on addresses we create.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jupyter_ext.cli import ServerClient
from jupyter_ext.core.store.keys import ENV_KEY

if TYPE_CHECKING:
    from tornado.websocket import WebSocketClientConnection

BRIDGE = "jksbr0"
SUBNET = "10.213.7"
HOST_ADDRESS = f"{SUBNET}.1"


def run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


class Network:
    """A bridge with our address, and nodes (network namespaces) plugged into it."""

    def __init__(self) -> None:
        self.nodes: list[str] = []
        self._tag = uuid.uuid4().hex[:6]
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, check=False)
        run("ip", "link", "add", BRIDGE, "type", "bridge")
        run("ip", "addr", "add", f"{HOST_ADDRESS}/24", "dev", BRIDGE)
        run("ip", "link", "set", BRIDGE, "up")

    def add_node(self, index: int) -> tuple[str, str]:
        """A new node: (namespace name, its address)."""
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
        for name in self.nodes:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, check=False)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect (to a login page, say) is an answer to check, not one to follow."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_opener = urllib.request.build_opener(_NoRedirect)


class Endpoint:
    """A Jupyter server's REST API at a base URL with a token: a server of ours, or a
    user's server behind JupyterHub's proxy (``.../user/<name>/``). An empty token sends
    none."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url.rstrip("/") + "/"
        self.token = token
        self.client = ServerClient(self.url, token)

    def api(self, method: str, path: str, body: Any = None) -> Any:
        """Any endpoint of the server (not only /api/snapshots); an error status raises
        ``urllib.error.HTTPError``, a redirect too."""
        request = urllib.request.Request(
            self.url + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {self.token}"} if self.token else {},
        )
        try:
            with _opener.open(request, timeout=120) as response:
                data = response.read()
        except urllib.error.HTTPError as exc:
            exc.close()  # it holds the connection open until closed
            raise
        return json.loads(data) if data else None


def give_to(user: str, *paths: Path) -> None:
    """Make ``paths`` the ordinary ``user``'s (recursively), and let them through every
    directory above (pytest's own temporary directory is root's alone, mode 0700)."""
    for path in paths:
        subprocess.run(["chown", "-R", f"{user}:", str(path)], check=True)
        for parent in path.resolve().parents:
            mode = parent.stat().st_mode
            if not mode & 0o001:
                parent.chmod(mode | 0o001)


RUN_KEY = base64.b64encode(os.urandom(32)).decode()
"""The key-encryption key of every server of a test run whose config names no key source:
servers on other homes (another node, a restart) share a user's store, as a spawner that
sets one user's key on every node ("env") would make them; a key file in each home would
not be the same key."""


class ServerProcess(Endpoint):
    """``jupyter server`` with the snapshot extension, in its own data and runtime dirs."""

    def __init__(
        self,
        home: Path,
        root_dir: Path,
        config: dict[str, Any],
        *,
        netns: str | None = None,
        address: str = "127.0.0.1",
        env: dict[str, str] | None = None,
        user: str | None = None,
        pod: bool = False,
        umask: int | None = None,
    ) -> None:
        """``user``: run the server (and so its kernels and CRIU) as this ordinary user,
        from a root test run (non-root mode on other nodes, docs/nonroot.md). ``pod``: in
        a PID namespace of its own, with its own /proc, as in a container: process ids
        start at 1 and everything in it dies with its first process."""
        from .s3server import free_port

        home.mkdir(parents=True, exist_ok=True)
        self.home = home
        self.port = free_port()
        self.address = address
        super().__init__(f"http://{address}:{self.port}/", uuid.uuid4().hex)
        app = config.get("SnapshotExtensionApp", {})
        if "encryption_key_source" not in app:
            config = {**config, "SnapshotExtensionApp": {**app, "encryption_key_source": "env"}}
            env = {ENV_KEY: RUN_KEY, **(env or {})}
        config_file = home / "config.json"
        config_file.write_text(json.dumps(config))
        self.env = {
            **os.environ,
            "JUPYTER_DATA_DIR": str(home / "data"),
            "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
            "JUPYTER_CONFIG_DIR": str(home / "config"),
            "JUPYTER_SNAPSHOT_RUNTIME_DIR": str(home / "kernels"),
            **(env or {}),
        }
        argv = [
            sys.executable,
            "-m",
            "jupyter_server",
            "--allow-root",
            "--no-browser",
            f"--ServerApp.ip={address}",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={root_dir}",
            f"--config={config_file}",
        ]
        if user is not None:
            self.env.update(HOME=str(home), USER=user, LOGNAME=user, PYTHONDONTWRITEBYTECODE="1")
            give_to(user, home, root_dir)
            argv = ["runuser", "-u", user, "--", *argv]
        self.pod = pod
        if pod:
            argv = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *argv]
        if netns is not None:
            argv = ["ip", "netns", "exec", netns, *argv]
        self.log_path = home / "server.log"
        self._log = self.log_path.open("wb")
        # Not our stdin: the server's children inherit it, and a Node.js one (JupyterLab
        # runs `npm prefix`) makes it non-blocking, which a helper reading commands from
        # the same stdin (tests/nodes_for_ui.py) took for its end, and stopped.
        self.process = subprocess.Popen(
            argv,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            umask=-1 if umask is None else umask,
        )
        self.wait_ready()

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.log()}")
            try:
                self.client.call("GET", "policy")
                return
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.2)
        raise TimeoutError(f"server did not start: {self.log()}")

    def _server_pid(self) -> int:
        """The Jupyter server's own process (below unshare and runuser)."""
        from jupyter_ext.core import proctree

        for pid in proctree.descendants(self.process.pid):  # parents first
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if argv[:3] == [sys.executable.encode(), b"-m", b"jupyter_server"]:
                    return pid
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kernel_processes(self) -> list[int]:
        """The server's process group: the server, its kernels' wrappers and inner kernels."""
        out = subprocess.run(
            ["ps", "-e", "-o", "pid=,sid="], capture_output=True, text=True, check=True
        ).stdout
        session = os.getsid(self.process.pid)
        pids = [int(p) for p, s in (line.split() for line in out.splitlines()) if int(s) == session]
        return pids

    def kill_node(self) -> None:
        """kill -9 the server and every process it started, as a node failure would."""
        from jupyter_ext.core import proctree

        pids = set(self.kernel_processes())
        for pid in list(pids):
            pids.update(proctree.descendants(pid))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(10)
        self._log.close()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120) -> int:
        if self.process.poll() is None:
            if self.pod:  # unshare ignores the signal (its child, the pod, would have to end)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._server_pid(), sig)
            else:
                self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill_node()
        self._log.close()
        return self.process.returncode


def follow(server: Endpoint, job: dict[str, Any]) -> dict[str, Any]:
    """Wait for a job of the server's to end; it must have succeeded."""
    done = server.client.follow(job)
    assert done["status"] == "done", done
    return done


def kernel_message(
    msg_type: str, content: dict[str, Any], metadata: dict[str, Any] | None = None
) -> tuple[str, str]:
    """A request for a kernel's websocket, as JupyterLab sends it: (its msg_id, its JSON)."""
    msg_id = uuid.uuid4().hex
    header = {
        "msg_id": msg_id,
        "msg_type": msg_type,
        "session": uuid.uuid4().hex,
        "username": "test",
        "date": "2026-01-01T00:00:00Z",
        "version": "5.3",
    }
    message = {
        "header": header,
        "parent_header": {},
        "metadata": metadata or {},
        "content": content,
        "channel": "shell",
        "buffers": [],
    }
    return msg_id, json.dumps(message)


def execute_request(code: str, cell_id: str | None = None) -> tuple[str, str]:
    """An execute_request (from the cell ``cell_id``, as JupyterLab names it)."""
    content = {
        "code": code,
        "silent": False,
        "store_history": True,
        "user_expressions": {},
        "allow_stdin": False,
    }
    return kernel_message("execute_request", content, {"cellId": cell_id} if cell_id else None)


async def ws_connect(server: Endpoint, kernel_id: str) -> WebSocketClientConnection:
    """A websocket to a kernel's channels, as JupyterLab opens it."""
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    url = "ws" + server.url.removeprefix("http") + f"api/kernels/{kernel_id}/channels"
    # jupyter_server answers the handshake once the kernel answered kernel_info, or after
    # its kernel_info_timeout (60 s) without it; tornado's own default (20 s) would give
    # up first, and hide what the server says then.
    request = HTTPRequest(
        url,
        headers={"Authorization": f"token {server.token}"},
        connect_timeout=90,
        request_timeout=90,
    )
    return await websocket_connect(request)


async def ws_close(ws: WebSocketClientConnection) -> None:
    """Close, and wait until the socket is shut: the loop must not end with it open (it
    would be left to the garbage collector); after 1 s it is dropped."""
    import asyncio

    # close() forgets the protocol; its stream says when the socket is shut.
    stream = ws.protocol.stream if ws.protocol is not None else None
    ws.close()
    for _ in range(100):
        if stream is None or stream.closed():
            break
        await asyncio.sleep(0.01)
    if stream is not None and not stream.closed():
        stream.close()


def ws_execute(server: Endpoint, kernel_id: str, code: str, timeout: float = 120) -> str:
    """Run ``code`` in a kernel through the server's websocket, as JupyterLab does; return
    its stdout, or raise with the error."""
    import asyncio

    async def execute(ws: WebSocketClientConnection) -> str:
        msg_id, message = execute_request(code)
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

    async def go() -> str:
        ws = await ws_connect(server, kernel_id)
        try:
            return await execute(ws)
        finally:
            await ws_close(ws)

    return asyncio.run(go())
