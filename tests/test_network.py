"""Kernels that hold network connections: snapshotted while connected, restored (into a new
kernel beside the running one, after a node failure, in place, after an idle suspend, from
a server's shutdown snapshot) and used again.

Real clients against real servers on 127.0.0.1 and ::1: requests and urllib3 against an
HTTP/1.1 keep-alive server, boto3 against moto, psycopg against Debian's PostgreSQL, a
child process with its own connection. A restored kernel's connections come back closed
(docs/network.md): pools reconnect by themselves, single connections in restore hooks.
"""

from __future__ import annotations

import http.server
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import kernel_snapshots
from jupyter_ext.core.errors import DumpError, IncompatibleSnapshotError
from jupyter_ext.core.store import LocalStore
from testkit.processes import KernelProcess, MotoServer, free_port

Factory = Callable[..., KernelProcess]


# ---------------------------------------------------------------------------- servers


class _Handler(http.server.BaseHTTPRequestHandler):
    """Keep-alive HTTP/1.1; answers with the client's port, so a test sees which
    connection a request came on."""

    protocol_version = "HTTP/1.1"
    server: HttpServer

    def setup(self) -> None:
        super().setup()
        with self.server.lock:
            self.server.connections.append(self.client_address[1])

    def do_GET(self) -> None:
        body = str(self.client_address[1]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class HttpServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.lock = threading.Lock()
        self.connections: list[int] = []
        """The client port of every connection accepted, in order."""
        super().__init__((host, 0), _Handler)
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{self.server_port}/"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def accepted(self) -> int:
        with self.lock:
            return len(self.connections)


@pytest.fixture(params=["127.0.0.1", "::1"], ids=["ipv4", "ipv6"])
def http_server(request: pytest.FixtureRequest) -> Iterator[HttpServer]:
    server = HttpServer(request.param)
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def http4() -> Iterator[HttpServer]:
    server = HttpServer("127.0.0.1")
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    """A private PostgreSQL cluster on 127.0.0.1 (Debian's server, run as ``nobody``: it
    refuses root); yields a psycopg connection string."""
    initdbs = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if not initdbs:
        pytest.fail("no PostgreSQL server: 'scripts/dev.sh test' installs Debian's postgresql")
    bindir = initdbs[-1].parent
    nobody = pwd.getpwnam("nobody")
    base = Path(tempfile.mkdtemp(prefix="jks-postgres-"))
    os.chown(base, nobody.pw_uid, nobody.pw_gid)
    port = free_port()
    as_nobody: dict[str, Any] = {
        "user": nobody.pw_uid,
        "group": nobody.pw_gid,
        "extra_groups": [],
        "cwd": base,
        "check": True,
        "capture_output": True,
    }
    try:
        subprocess.run(
            [bindir / "initdb", "-D", base / "data", "-U", "postgres", "--auth=trust"],
            **as_nobody,
        )
        options = f"-c listen_addresses=127.0.0.1 -p {port} -k {base}"
        pg_ctl = [bindir / "pg_ctl", "-D", base / "data", "-l", base / "log", "-o", options]
        subprocess.run([*pg_ctl, "-w", "start"], **as_nobody)
    except subprocess.CalledProcessError as exc:
        shutil.rmtree(base, ignore_errors=True)
        pytest.fail(f"PostgreSQL did not start: {exc.stderr.decode(errors='replace')}")
    try:
        yield f"host=127.0.0.1 port={port} user=postgres dbname=postgres connect_timeout=30"
    finally:
        subprocess.run(
            [bindir / "pg_ctl", "-D", base / "data", "-m", "immediate", "stop"],
            **{**as_nobody, "check": False},
        )
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------------------- helpers


def run_cell(kernel: KernelProcess, code: str) -> tuple[str, str]:
    """Run ``code``; its stdout and stderr. Fails with the output if the cell failed."""
    out: list[str] = []
    err: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            (out if msg["content"]["name"] == "stdout" else err).append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            err.append("\n".join(msg["content"]["traceback"]))

    reply = kernel.client.execute_interactive(code, timeout=120, output_hook=hook)
    assert reply["content"]["status"] == "ok", f"cell failed: {''.join(err)}"
    return "".join(out), "".join(err)


HTTP_SETUP = r"""
import requests, urllib3, kernel_snapshots
session = requests.Session()
pool = urllib3.PoolManager()
def ports():
    # The client port each pool's request went out on (the server answers with it).
    return (int(session.get(URL, timeout=60).text),
            int(pool.request("GET", URL, timeout=60).data))
restores = []
kernel_snapshots.on_restore(restores.append)
before = ports()
print(before)
"""

#: In a restored kernel: both pools work again (on new connections: the tests count them at
#: the server), and the hook ran once, before this cell.
HTTP_CHECK = r"""
assert len(restores) == 1, restores
after = ports()
assert ports() == after, "the pools keep their new connections"
print(json.dumps(dataclasses.asdict(restores[0]) | {"same_host": restores[0].same_host}))
"""


def http_check(kernel: KernelProcess) -> dict[str, Any]:
    info: dict[str, Any] = json.loads(
        kernel.execute("import json, dataclasses\n" + HTTP_CHECK).strip()
    )
    return info


# ---------------------------------------------------------------------------- tests


def test_http_pools_reconnect_in_a_kernel_restored_beside_the_running_one(
    kernel_factory: Factory, http_server: HttpServer, tmp_path: Path
) -> None:
    """The running kernel's connections survive its snapshot untouched; a kernel restored
    from it on the same machine, while the server still holds those connections, finds its
    copies closed and its pools reconnect."""
    kernel = kernel_factory()
    kernel.execute(f"URL = {http_server.url!r}\n" + HTTP_SETUP)
    assert http_server.accepted() == 2
    manifest = kernel.snapshot(tmp_path / "snap")
    # The dump left the kernel's connections alone: same ones, nothing new accepted.
    assert kernel.execute("print(ports() == before)").strip() == "True"
    assert http_server.accepted() == 2

    restored = kernel_factory(restore_from=tmp_path / "snap")
    info = http_check(restored)
    assert http_server.accepted() == 4
    assert info["snapshot_id"] == manifest["id"]
    assert info["same_host"] is True
    assert (info["in_place"], info["resumed"]) == (False, False)
    # The original goes on with its own connections, undisturbed by its copy.
    assert kernel.execute("print(ports() == before, restores)").strip() == "True []"
    assert http_server.accepted() == 4
    # A restored kernel is snapshotted and restored again, connections and all.
    restored.snapshot(tmp_path / "again")
    restored.kill_all()
    third = kernel_factory(restore_from=tmp_path / "again")
    assert third.execute("r = ports(); print(len(restores), r == ports())").strip() == "2 True"
    assert http_server.accepted() == 6


def test_restore_in_place_runs_hooks_before_the_next_cell(
    kernel_factory: Factory, http4: HttpServer, tmp_path: Path
) -> None:
    """Hooks run once, before the first cell after the restore, in the order they were
    added; one that fails shows its traceback in that cell and stops nothing."""
    kernel = kernel_factory()
    kernel.execute(
        f"URL = {http4.url!r}\n"
        + HTTP_SETUP
        + r"""
@kernel_snapshots.on_restore
def announce(info):
    print("restored from", info.snapshot_id, "in place:", info.in_place)
@kernel_snapshots.on_restore
def broken(info):
    raise RuntimeError("credentials expired")
kernel_snapshots.on_restore(lambda info: print("third hook ran"))
assert kernel_snapshots.last_restore() is None
"""
    )
    manifest = kernel.snapshot(tmp_path / "snap")
    kernel.execute("x = 'changed after the snapshot'")
    kernel.restore(tmp_path / "snap")
    out, err = run_cell(kernel, "print('cell ran', 'x' in globals())")
    assert out.splitlines() == [
        f"restored from {manifest['id']} in place: True",
        "third hook ran",
        "cell ran False",
    ]
    assert "the restore hook broken failed (the kernel carries on)" in err
    assert "RuntimeError: credentials expired" in err
    assert run_cell(kernel, "print(len(restores))") == ("1\n", "")  # once per restore
    info = json.loads(kernel.execute("import json\n" + "print(json.dumps(restores[0].token))"))
    assert kernel.execute("print(kernel_snapshots.last_restore().token)").strip() == info
    assert kernel.execute("a = ports(); print(ports() == a)").strip() == "True"
    assert http4.accepted() == 4  # both pools reconnected, once


#: How a test brings a snapshot back: into a new kernel after the old one died with its node
#: (kill -9 of every process), or in place of the running kernel (same notebook session).
RESTORE_WAYS = ["new-kernel", "in-place"]


def bring_back(
    kernel: KernelProcess, snap: Path, how: str, kernel_factory: Factory
) -> KernelProcess:
    if how == "in-place":
        kernel.restore(snap)
        return kernel
    kernel.kill_all()
    return kernel_factory(restore_from=snap)


@pytest.mark.parametrize("how", RESTORE_WAYS)
def test_boto3_client_works_again(
    kernel_factory: Factory, moto: MotoServer, tmp_path: Path, how: str
) -> None:
    bucket = moto.ensure_bucket(f"network-kernels-{how}")
    kernel = kernel_factory()
    kernel.execute(
        "import boto3\n"
        f"s3 = boto3.client('s3', endpoint_url={moto.url!r}, region_name='us-east-1')\n"
        f"s3.put_object(Bucket={bucket!r}, Key='before', Body=b'1')\n"
    )
    kernel.snapshot(tmp_path / "snap")
    restored = bring_back(kernel, tmp_path / "snap", how, kernel_factory)
    restored.execute(f"s3.put_object(Bucket={bucket!r}, Key='after', Body=b'2')")
    keys = restored.execute(
        f"print(sorted(o['Key'] for o in s3.list_objects_v2(Bucket={bucket!r})['Contents']))"
    )
    assert keys.strip() == "['after', 'before']"


@pytest.mark.parametrize("how", RESTORE_WAYS)
def test_postgres_connection_reopened_by_a_restore_hook(
    kernel_factory: Factory, postgres: str, tmp_path: Path, how: str
) -> None:
    """A single database connection does not reconnect by itself: after a restore it
    raises; a restore hook opens a new one before the first cell."""
    table = f"notes_{how.replace('-', '_')}"
    kernel = kernel_factory()
    kernel.execute(
        "import psycopg, kernel_snapshots\n"
        f"DSN = {postgres!r}\n"
        "db = psycopg.connect(DSN, autocommit=True)\n"
        f"db.execute('DROP TABLE IF EXISTS {table}')\n"
        f"db.execute('CREATE TABLE {table} (n int)')\n"
        f"db.execute('INSERT INTO {table} VALUES (1)')\n"
        "old = db\n"
        "@kernel_snapshots.on_restore\n"
        "def reconnect(info):\n"
        "    global db\n"
        "    db = psycopg.connect(DSN, autocommit=True)\n"
    )
    kernel.snapshot(tmp_path / "snap")
    # The snapshot did not disturb the connection: the kernel goes on using it.
    kernel.execute(f"db.execute('INSERT INTO {table} VALUES (2)')")
    restored = bring_back(kernel, tmp_path / "snap", how, kernel_factory)
    total = restored.execute(
        f"print(db is not old, db.execute('SELECT sum(n) FROM {table}').fetchone()[0])"
    )
    assert total.strip() == "True 3"
    # The old connection came back closed: the client says so, clearly.
    out = restored.execute(
        "try:\n    old.execute('SELECT 1')\nexcept psycopg.OperationalError as exc:\n"
        "    print('closed:', type(exc).__name__)\n"
    )
    assert out.strip() == "closed: OperationalError"
    restored.execute(f"db.execute('DROP TABLE {table}')")


@pytest.mark.parametrize("how", RESTORE_WAYS)
def test_child_process_connection_reconnects(
    kernel_factory: Factory, http4: HttpServer, tmp_path: Path, how: str
) -> None:
    """A connection held by a child of the kernel is saved and closed like the kernel's."""
    kernel = kernel_factory()
    kernel.execute(
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-u', '-c', '''\n"
        "import sys, requests\n"
        "s = requests.Session()\n"
        "for line in sys.stdin:\n"
        f"    print(s.get({http4.url!r}, timeout=60).text, flush=True)\n"
        "'''], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)\n"
        "def ask():\n"
        "    child.stdin.write('go\\n'); child.stdin.flush()\n"
        "    return int(child.stdout.readline())\n"
        "first = ask()\n"
    )
    assert http4.accepted() == 1
    kernel.snapshot(tmp_path / "snap")
    assert kernel.execute("print(ask() == first)").strip() == "True"
    restored = bring_back(kernel, tmp_path / "snap", how, kernel_factory)
    assert restored.execute("a = ask(); print(ask() == a)").strip() == "True"
    assert http4.accepted() == 2


def test_idle_suspend_and_resume_with_connections(
    kernel_factory: Factory, http4: HttpServer, tmp_path: Path
) -> None:
    """The suspend path (dump, then the process ends: the server sees its connections
    close) and the resume the next cell triggers; the hooks know it was a resume."""
    kernel = kernel_factory()
    kernel.execute(f"URL = {http4.url!r}\n" + HTTP_SETUP)
    kernel.control.request_sync("suspend", {"dest": str(tmp_path / "suspended")}, timeout=300)
    assert kernel.status()["state"] == "suspended"
    assert http4.accepted() == 2
    info = http_check(kernel)  # this cell resumed the kernel
    assert (info["in_place"], info["resumed"]) == (True, True)
    assert http4.accepted() == 4
    assert kernel.status()["state"] == "running"


def test_shutdown_snapshot_of_a_connected_kernel_restores(
    tmp_path: Path, snapshot_kernelspec: str, http4: HttpServer, kernel_factory: Factory
) -> None:
    """A server asked to stop snapshots a kernel holding connections (before-shutdown);
    restored, the kernel reconnects."""
    from testkit.processes import ServerProcess, run_keys

    from .support.jupyter_api import server_config
    from .support.servers import ws_execute

    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    config = server_config(tmp_path, snapshot_before_shutdown=True)
    server = ServerProcess(tmp_path / "server", notebooks, config)
    kernel_id = server.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
    ws_execute(server, kernel_id, f"URL = {http4.url!r}\n" + HTTP_SETUP)
    assert http4.accepted() == 2
    assert server.stop(signal.SIGTERM) == 0
    store = LocalStore(tmp_path / "store" / "users" / _owner(), keys=run_keys())
    try:
        (stored,) = store.snapshots()
        assert stored.manifest.trigger == "before-shutdown"
        snap = store.fetch(stored.manifest.id, tmp_path / "fetched")
    finally:
        store.close()
    restored = kernel_factory(restore_from=snap)
    info = http_check(restored)
    assert info["snapshot_id"] == stored.manifest.id
    assert http4.accepted() == 4


def test_listening_and_udp_sockets_work_after_restore(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    """Listening TCP and bound UDP sockets come back as they were; a connection not yet
    accepted at the snapshot does not fail it. A restore needing ports someone else holds
    is refused, saying so."""
    tcp_port, udp_port = free_port(), free_port()
    kernel = kernel_factory()
    kernel.execute(
        "import socket\n"
        f"listener = socket.create_server(('127.0.0.1', {tcp_port}))\n"
        "udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        f"udp.bind(('127.0.0.1', {udp_port}))\n"
        "def serve_one():\n"
        "    conn, _ = listener.accept()\n"
        "    with conn:\n"
        "        conn.sendall(conn.recv(100).upper())\n"
    )
    waiting = socket.create_connection(("127.0.0.1", tcp_port))  # never accepted
    try:
        kernel.snapshot(tmp_path / "snap")
    finally:
        waiting.close()
    with pytest.raises(IncompatibleSnapshotError, match="port"):
        kernel_factory().restore(tmp_path / "snap")
    kernel.kill_all()
    restored = kernel_factory(restore_from=tmp_path / "snap")
    restored.client.execute("serve_one(); data, peer = udp.recvfrom(100); print(data)")
    with socket.create_connection(("127.0.0.1", tcp_port)) as conn:
        conn.sendall(b"hello")
        assert conn.recv(100) == b"HELLO"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.sendto(b"datagram", ("127.0.0.1", udp_port))
    reply = restored.client.get_shell_msg(timeout=60)
    assert reply["content"]["status"] == "ok"


def test_corked_udp_socket_fails_the_dump_clearly(kernel_factory: Factory, tmp_path: Path) -> None:
    kernel = kernel_factory()
    kernel.execute(
        "import socket\n"
        "udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "udp.setsockopt(socket.IPPROTO_UDP, 1, 1)  # UDP_CORK\n"
        "udp.sendto(b'x', ('127.0.0.1', 9))\n"
    )
    with pytest.raises(DumpError, match="UDP_CORK") as info:
        kernel.snapshot(tmp_path / "s")
    assert "corked" in info.value.log_excerpt
    kernel.execute("udp.setsockopt(socket.IPPROTO_UDP, 1, 0)")
    kernel.snapshot(tmp_path / "s")


# ---------------------------------------------------------------------------- hooks API


@pytest.fixture
def fresh_hooks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """kernel_snapshots as in a kernel started in ``tmp_path`` (its runtime directory)."""
    monkeypatch.setattr(kernel_snapshots, "_hooks", [])
    for name in ("_seen_token", "_seen_stat", "_last"):
        monkeypatch.setattr(kernel_snapshots, name, None)
    monkeypatch.setattr(kernel_snapshots, "_pending", False)
    monkeypatch.setattr(kernel_snapshots, "_runtime_dir", None)
    kernel_snapshots._install(tmp_path)
    return tmp_path


def record(runtime_dir: Path, **overrides: Any) -> kernel_snapshots.RestoreInfo:
    args: dict[str, Any] = {
        "snapshot_id": "a" * 32,
        "snapshot_created": "2026-11-30T20:00:00+00:00",
        "snapshot_host": socket.gethostname(),
        "in_place": False,
        "resumed": False,
    }
    return kernel_snapshots.write_restore_info(runtime_dir, **{**args, **overrides})


def test_hooks_run_once_per_restore_and_failures_are_reported(
    fresh_hooks: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[str] = []

    def failing(info: kernel_snapshots.RestoreInfo) -> None:
        raise SystemExit("not fatal either")

    kernel_snapshots.on_restore(lambda info: calls.append(info.snapshot_id))
    assert kernel_snapshots.on_restore(failing) is failing
    kernel_snapshots.on_restore(failing)  # once only
    kernel_snapshots.run_pending_hooks()
    assert calls == []  # no restore yet
    assert kernel_snapshots.last_restore() is None

    first = record(fresh_hooks)
    assert kernel_snapshots.last_restore() == first  # asking does not use up the hooks
    kernel_snapshots.run_pending_hooks()
    kernel_snapshots.run_pending_hooks()
    assert calls == ["a" * 32]
    err = capsys.readouterr().err
    assert err.count("the restore hook test_hooks_run_once") == 1
    assert "SystemExit: not fatal either" in err

    assert kernel_snapshots.remove_restore_hook(failing)
    assert not kernel_snapshots.remove_restore_hook(failing)
    second = record(fresh_hooks, snapshot_id="b" * 32, snapshot_host="elsewhere")
    kernel_snapshots.run_pending_hooks()
    assert calls == ["a" * 32, "b" * 32]
    assert kernel_snapshots.last_restore() == second
    assert not second.same_host
    assert first.same_host
    with pytest.raises(TypeError, match="callable"):
        kernel_snapshots.on_restore("not a function")  # type: ignore[type-var]


def test_a_restore_recorded_before_the_kernel_started_is_not_its_own(fresh_hooks: Path) -> None:
    record(fresh_hooks)
    kernel_snapshots._install(fresh_hooks)
    assert kernel_snapshots.last_restore() is None


def test_outside_a_snapshot_kernel_nothing_happens() -> None:
    assert kernel_snapshots._runtime_dir is None
    assert kernel_snapshots.last_restore() is None
    kernel_snapshots.run_pending_hooks()


def _owner() -> str:
    import getpass

    return os.environ.get("JUPYTERHUB_USER") or getpass.getuser()


def test_restore_on_another_node_reconnects(tmp_path: Path, snapshot_kernelspec: str) -> None:
    """A kernel connected from node A (its own network namespace) comes back on node B,
    where its connection's address does not exist, and reconnects from there."""
    from testkit.processes import ServerProcess

    from .support.servers import HOST_ADDRESS, Network, follow, ws_execute

    net = Network()
    server = HttpServer(HOST_ADDRESS)  # on the bridge: reachable from every node
    nodes: list[ServerProcess] = []
    try:
        notebooks = tmp_path / "notebooks"
        notebooks.mkdir()
        config = {
            "SnapshotExtensionApp": {
                "store": "local",
                "local_store_dir": str(tmp_path / "shared-store"),
                "owner": "alice",
                "idle_suspend_after": 0,
                "snapshot_before_shutdown": False,
            }
        }
        for index in (1, 2):
            netns, address = net.add_node()
            home = tmp_path / f"node-{index}"
            nodes.append(ServerProcess(home, notebooks, config, netns=netns, address=address))
        node_a, node_b = nodes
        kernel_a = node_a.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
        ws_execute(node_a, kernel_a, f"URL = {server.url!r}\n" + HTTP_SETUP)
        assert server.accepted() == 2
        job = node_a.client.call("POST", "", body={"kernel_id": kernel_a})["job"]
        snapshot = follow(node_a, job)["result"]
        assert snapshot["status"] == "complete"
        node_a.kill_node()

        answer = node_b.client.call("POST", f"{snapshot['id']}/restore", body={})
        result = follow(node_b, answer["job"])["result"]
        kernel_b = result["kernel_id"]
        assert any(p.startswith("criu restore") for p in result["phases"]), result  # its time
        # What could not come back is said: the two pools' connections, by process and address.
        closed = result["closed_connections"]
        assert [c["remote"] for c in closed] == [f"{HOST_ADDRESS}:{server.server_port}"] * 2
        assert all(c["local"].startswith(node_a.address + ":") for c in closed)
        assert node_b.client.call("GET", f"kernels/{kernel_b}")["closed_on_restore"] == closed
        info = json.loads(ws_execute(node_b, kernel_b, "import json, dataclasses\n" + HTTP_CHECK))
        assert info["snapshot_id"] == snapshot["id"]
        assert info["in_place"] is False
        assert server.accepted() == 4
        node_b.stop()
    finally:
        for node in nodes:
            if node.process.poll() is None:
                node.kill_node()
        server.shutdown()
        server.server_close()
        net.close()


def test_doctor_says_how_connections_are_handled(criu: Any) -> None:
    from jupyter_ext.core.doctor import check_tcp_connections

    check = check_tcp_connections(criu)
    assert check.ok is (os.geteuid() == 0)
    assert "--tcp-close" in check.detail
    assert "no network lock" in check.detail
    assert ("are kept" if os.geteuid() == 0 else "come back closed too") in check.detail
    missing = check_tcp_connections(None)
    assert not missing.ok
    assert not missing.required
