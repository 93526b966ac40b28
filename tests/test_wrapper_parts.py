"""The wrapper's parts on their own: control server, supervisor, relay and stand-in, each
on real sockets and processes (the whole wrapper is tested with real kernels elsewhere)."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio
from jupyter_client.session import DELIM, Session

from jupyter_ext.core.agent.client import AgentCriu
from jupyter_ext.core.agent.protocol import Hello
from jupyter_ext.core.death import Death
from jupyter_ext.core.errors import SnapshotBusyError, SnapshotError
from jupyter_ext.core.lazypages import LazySettings
from jupyter_ext.core.protocol.control import SnapshotArgs, StatusArgs, WrapperClient
from jupyter_ext.core.protocol.inner import INNER_PORTS
from jupyter_ext.core.protocol.progress import ProgressCallback
from kernel_wrapper.channels import INNER_ROUTING_ID, InnerChannels, ServerChannels
from kernel_wrapper.control import ControlServer
from kernel_wrapper.lazyrestore import LazyRestore
from kernel_wrapper.relay import Relay
from kernel_wrapper.standin import DEAD_TEXT, StandIn
from kernel_wrapper.supervisor import Supervisor
from testkit.processes import free_port, wait_until

KEY = b"test-key"

# -- control server --------------------------------------------------------------------


def test_control_server_parses_streams_and_reports(tmp_path: Path) -> None:
    asyncio.run(_control_server(tmp_path))


async def _control_server(tmp_path: Path) -> None:
    seen: list[Any] = []

    async def snapshot(progress: ProgressCallback, args: SnapshotArgs) -> dict[str, Any]:
        seen.append(args)
        progress({"phase": "dumping"})
        progress({"phase": "done", "bytes": 42})
        return {"id": "x", "dest": args.dest}

    async def status(progress: ProgressCallback, args: StatusArgs) -> dict[str, Any]:
        if args.gpu:
            raise SnapshotBusyError("busy now", hint="wait")
        raise RuntimeError("a bug")

    server = ControlServer(tmp_path / "control", {"snapshot": snapshot, "status": status})
    await server.start()
    try:
        assert stat.S_IMODE(os.stat(tmp_path / "control").st_mode) == 0o600
        client = WrapperClient(tmp_path / "control")
        events: list[dict[str, Any]] = []
        result = await client.snapshot(SnapshotArgs("/d", trigger="manual"), events.append)
        assert result == {"id": "x", "dest": "/d"}
        assert events == [{"phase": "dumping"}, {"phase": "done", "bytes": 42}]
        assert seen == [SnapshotArgs("/d", trigger="manual")]  # parsed into its dataclass
        # Errors come back as the error raised, with its hint; others as internal errors.
        with pytest.raises(SnapshotBusyError, match="busy now"):
            await client.status()
        with pytest.raises(SnapshotError, match="Internal error: RuntimeError"):
            await client.status(StatusArgs(gpu=False))
        with pytest.raises(SnapshotError, match=r"Bad control request.*frobnicate"):
            await client.request("snapshot", {"dest": "/d", "frobnicate": 1})
        with pytest.raises(SnapshotError, match=r"Bad control request.*dest"):
            await client.request("snapshot", {})
        with pytest.raises(SnapshotError, match="Unknown control operation 'suspend'"):
            await client.request("suspend", {"dest": "/d"})
        assert len(seen) == 1
    finally:
        server.close()


def test_control_server_serves_only_protocol_operations(tmp_path: Path) -> None:
    async def anything(progress: ProgressCallback, args: Any) -> None:
        return None

    with pytest.raises(ValueError, match="frobnicate"):
        ControlServer(tmp_path / "control", {"frobnicate": anything})


# -- supervisor ------------------------------------------------------------------------


class Watched:
    """A supervisor and what it reported."""

    def __init__(self) -> None:
        self.deaths: list[int | None] = []
        self.reasons: list[str] = []
        self.pids: list[int | None] = []
        self.process = Supervisor(on_death=self.died, on_pid=self.pid_changed)

    def died(self, death: Death) -> None:
        self.deaths.append(death.exit_code)
        self.reasons.append(death.reason)

    def pid_changed(self) -> None:
        self.pids.append(self.process.pid)

    async def until(self, condition: Any, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.01)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_supervisor_tells_a_death_from_an_end() -> None:
    asyncio.run(_supervisor())


async def _supervisor() -> None:
    w = Watched()
    env = dict(os.environ)
    # A kernel that dies on its own is a death, with its exit code.
    await w.process.launch(python("print('hello', flush=True); raise SystemExit(3)"), env, ())
    first = w.process.pid
    assert first is not None
    await w.until(lambda: w.deaths)
    assert w.deaths == [3]
    assert w.reasons == ["exited with status 3"]
    assert w.process.pid is None
    assert w.pids == [first, None]
    assert b"hello" in os.read(w.process.stdio_r, 1000)  # its output comes through the pipe
    # One the supervisor kills is not.
    await w.process.launch(python("import time; time.sleep(60)"), env, ())
    assert w.process.pid is not None
    await w.process.kill()
    assert w.process.pid is None
    assert w.deaths == [3]
    # An end announced by ending() is not a death either...
    await w.process.launch(python("import time; time.sleep(0.2)"), env, ())
    async with w.process.ending():
        pass  # waits until it is gone
    assert w.process.pid is None
    assert w.deaths == [3]
    # ...but a block left by an error takes the announcement back.
    await w.process.launch(python("import time; time.sleep(0.5)"), env, ())
    with pytest.raises(RuntimeError):
        async with w.process.ending():
            raise RuntimeError("the dump failed")
    await w.until(lambda: len(w.deaths) == 2)
    assert w.deaths == [3, 0]
    w.process.close()


# -- relay and stand-in ----------------------------------------------------------------


class Client:
    """jupyter_server's side: a shell DEALER and an iopub SUB, signing with the key."""

    def __init__(self, context: zmq.asyncio.Context, connection: dict[str, Any]) -> None:
        self.session = Session(key=KEY)
        self.shell = context.socket(zmq.DEALER)
        self.shell.connect(f"tcp://127.0.0.1:{connection['shell_port']}")
        self.iopub = context.socket(zmq.SUB)
        self.iopub.setsockopt(zmq.SUBSCRIBE, b"")
        self.iopub.connect(f"tcp://127.0.0.1:{connection['iopub_port']}")

    def send(self, msg_type: str, content: dict[str, Any] | None = None) -> dict[str, Any]:
        msg = self.session.msg(msg_type, content or {})
        self.session.send(self.shell, msg)
        return msg

    async def reply(self, timeout: float = 10) -> dict[str, Any]:
        frames = await asyncio.wait_for(self.shell.recv_multipart(), timeout)
        _, parts = self.session.feed_identities(frames)
        return self.session.deserialize(parts)  # checks the signature

    async def nothing(self, wait: float = 0.3) -> bool:
        return not await self.shell.poll(wait * 1000)


class Kernel:
    """The inner kernel's side, unsigned, connected to the wrapper's inner endpoints."""

    def __init__(self, runtime: Path) -> None:
        self.session = Session(key=b"")
        self.context = context = zmq.asyncio.Context()
        self.shell = context.socket(zmq.ROUTER)
        self.shell.connect(f"ipc://{runtime}/ch-{INNER_PORTS['shell']}")
        self.iopub = context.socket(zmq.PUB)
        self.iopub.connect(f"ipc://{runtime}/ch-{INNER_PORTS['iopub']}")

    async def request(self, timeout: float = 10) -> list[bytes]:
        return await asyncio.wait_for(self.shell.recv_multipart(), timeout)

    def answer(self, request: list[bytes], msg_type: str, content: dict[str, Any]) -> None:
        idents, parts = self.session.feed_identities(request)
        parent = self.session.deserialize(parts)
        self.session.send(self.iopub, "status", {"execution_state": "idle"}, parent=parent)
        self.session.send(self.shell, msg_type, content, parent=parent, ident=idents)

    def close(self) -> None:
        self.context.destroy(linger=0)


@asynccontextmanager
async def wrapper_sockets(tmp_path: Path) -> AsyncIterator[tuple[ServerChannels, Client]]:
    ports = {f"{name}_port": free_port() for name in ("shell", "stdin", "control", "iopub", "hb")}
    connection = {"ip": "127.0.0.1", "transport": "tcp", "key": KEY.decode(), **ports}
    server = ServerChannels(connection)
    context = zmq.asyncio.Context()
    try:
        yield server, Client(context, connection)
    finally:
        context.destroy(linger=0)
        server.context.destroy(linger=0)


def test_relay_checks_forwards_and_observes(tmp_path: Path) -> None:
    asyncio.run(_relay(tmp_path))


async def _relay(tmp_path: Path) -> None:
    async with wrapper_sockets(tmp_path) as (server, client):
        relay = Relay(Session(key=KEY), server)
        relay.connect_inner(InnerChannels(tmp_path))
        kernel = Kernel(tmp_path)
        # Stopped (a dump): requests wait; started, they reach the kernel, unsigned.
        relay.stop()
        request = client.send("execute_request", {"code": "1"})
        # It reached the wrapper's shell socket, which the stopped relay leaves unread.
        assert await server["shell"].poll(20_000), "the request never reached the wrapper"
        assert not await kernel.shell.poll(100)
        assert "open=False" in relay.describe()
        assert "pumps=[]" in relay.describe()
        relay.start(requests=True)
        frames = await kernel.request()
        assert frames[0] == INNER_ROUTING_ID
        # What a stuck kernel's log says (SIGUSR1): every pump, each socket's events.
        state = relay.describe()
        assert "open=True" in state
        assert "'shell-in'" in state
        assert "'iopub-out'" in state
        assert "server.shell=" in state, state
        assert "inner.iopub=" in state, state
        at = frames.index(DELIM)
        assert frames[at + 1] == b"", "the kernel holds no key: messages reach it unsigned"
        assert relay.tracker.executions_since_snapshot == 1
        running = relay.tracker.running_request()
        assert running is not None
        assert running["header"]["msg_id"] == request["header"]["msg_id"]
        # Its reply goes out signed by the wrapper (Client.reply checks the signature).
        kernel.answer(frames, "execute_reply", {"status": "ok", "execution_count": 1})
        reply = await client.reply()
        assert reply["parent_header"]["msg_id"] == request["header"]["msg_id"]
        # The relay observes a message before it sends it on: no wait.
        assert relay.tracker.running_request() is None
        assert relay.tracker.execution_state == "idle"
        # A request signed with another key never reaches the kernel.
        forged = Session(key=b"another key")
        forged.send(client.shell, forged.msg("execute_request", {"code": "2"}))
        assert not await kernel.shell.poll(500)
        assert relay.tracker.executions_since_snapshot == 1
        relay.stop()
        await relay.close_inner()
        kernel.close()


def test_stand_in_answers_for_a_dead_or_suspended_kernel(tmp_path: Path) -> None:
    asyncio.run(_stand_in(tmp_path))


async def _stand_in(tmp_path: Path) -> None:
    async with wrapper_sockets(tmp_path) as (server, client):
        held: list[tuple[str, list[bytes]]] = []
        woken: list[bool] = []
        ended: list[bool] = []
        stand_in = StandIn(
            Session(key=KEY),
            server,
            kernel_info=lambda: {},
            hold=lambda name, frames: held.append((name, frames)),
            wake=lambda: woken.append(True),
            shutdown=lambda: ended.append(True),
        )
        # Dead: a cell gets an error that says what to do; kernel_info is answered.
        stand_in.start(suspended=False)
        client.send("execute_request", {"code": "1"})
        reply = await client.reply()
        assert reply["content"]["status"] == "error"
        assert reply["content"]["evalue"] == DEAD_TEXT
        client.send("kernel_info_request")
        info = await client.reply()
        assert info["msg_type"] == "kernel_info_reply"
        assert info["content"]["implementation"] == "kernel_wrapper"
        # Suspended: a cell is kept for the kernel and wakes it; nothing answers it here.
        stand_in.start(suspended=True)
        client.send("execute_request", {"code": "2"})
        assert await client.nothing()
        assert [name for name, _ in held] == ["shell"]
        assert woken == [True]
        # A shutdown is answered, then the wrapper is told.
        client.send("shutdown_request", {"restart": False})
        assert (await client.reply())["msg_type"] == "shutdown_reply"
        assert ended == [True]
        stand_in.stop()


def test_a_wrapper_says_what_its_relay_holds_on_sigusr1(kernel_factory: Any) -> None:
    """The harness signals a kernel that does not answer and puts its log in the failure:
    the log must then say the state, the relay's pumps and each socket's events, and the
    kernel must go on working."""
    kernel = kernel_factory()
    kernel.process.send_signal(signal.SIGUSR1)
    wait_until(lambda: "relay: open=True" in kernel.log(), what="the relay's state in the log")
    line = next(x for x in kernel.log().splitlines() if "relay:" in x)
    assert "] state running, snapshot job none" in line, line
    assert line.startswith("[kernel_wrapper WARNING "), line
    assert "'shell-in'" in line
    assert "server.iopub=" in line
    # And where each of its tasks waits (a stuck snapshot shows its step).
    wait_until(lambda: "waits at wrapper.py:" in kernel.log(), what="the tasks in the log")
    assert kernel.execute("print(6 * 7)") == "42\n"


def test_the_end_of_a_lazy_restore_is_told_when_it_happens() -> None:
    """The server's ``lazy-restore-end`` request waits on the status itself: answered the
    moment it leaves "transferring" (complete, failed, or ended with the kernel), at once
    when no transfer runs."""

    async def scenario() -> None:
        lazy = LazyRestore(LazySettings(enabled=True))
        assert await lazy.end() == {}  # none ever ran
        lazy.starting()
        waiting = asyncio.ensure_future(lazy.end())
        await asyncio.sleep(0)  # it runs up to its wait
        assert not waiting.done()
        lazy.status = {"state": "ended"}
        assert await waiting == {"state": "ended"}
        lazy.starting()
        waiting = asyncio.ensure_future(lazy.end())
        await asyncio.sleep(0)
        assert not waiting.done()
        lazy.failed(SnapshotError("the store went away"))
        assert (await waiting)["state"] == "failed"

    asyncio.run(scenario())


def test_a_restore_said_lazy_goes_in_full_where_the_criu_has_no_lazy_pages(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The requester decides (core.lazypages.lazy_plan); a wrapper whose CRIU cannot (the
    node agent's: unprivileged) restores in full instead of failing, and says so once."""
    hello = Hello(1, "4.0", "alice", "jupyter-alice", "pod", "container")
    agent = AgentCriu(Path("/nonexistent/agent.sock"), (4, 0), "node agent", hello)
    lazy = LazyRestore(LazySettings(enabled=True, min_bytes=0))
    with caplog.at_level("WARNING", logger="kernel_wrapper"):
        assert not lazy.told(True, agent)
        assert not lazy.told(True, agent)
    assert caplog.text.count("lazy restore is not supported here") == 1
    assert "node agent runs CRIU as this pod's user" in caplog.text
    assert not lazy.told(False, agent)


# -- the sockets a dump looks at -------------------------------------------------------
HOLD_SOCKETS = """
import socket, sys
kinds = {"unix": (socket.AF_UNIX, socket.SOCK_STREAM), "tcp": (socket.AF_INET, socket.SOCK_STREAM),
         "udp6": (socket.AF_INET6, socket.SOCK_DGRAM)}
held = [socket.socket(*kinds[k]) for k in sys.argv[1:]]
for s in held:
    if s.family != socket.AF_UNIX:
        s.bind(("127.0.0.1" if s.family == socket.AF_INET else "::1", 0))
        if s.type == socket.SOCK_STREAM:
            s.listen()
print(" ".join(str(s.getsockname()[1]) for s in held if s.family != socket.AF_UNIX), flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize(
    ("kinds", "tables"),
    [
        (["unix"], set()),
        (["unix", "tcp"], {"tcp"}),
        (["udp6"], {"udp"}),
        (["tcp", "udp6"], {"tcp", "udp"}),
    ],
)
def test_a_dump_reads_only_the_proc_net_tables_that_list_the_kernels_sockets(
    kinds: list[str], tables: set[str]
) -> None:
    """Each socket's protocol (``system.sockprotoname``) says which /proc/net tables can
    list it: a kernel of unix sockets needs none read (each read walks the machine's whole
    table while the kernel waits), and the ports of those it has are all found."""
    import subprocess

    from jupyter_ext.core.carried import netports, sockdiag, tcpconns

    with subprocess.Popen(
        [sys.executable, "-c", HOLD_SOCKETS, *kinds],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            assert child.stdout is not None
            ports = sorted(int(p) for p in child.stdout.readline().split())
            sockets = sockdiag.TreeSockets.of([child.pid])
            assert len(sockets.inodes) == len(kinds)
            assert sockets.inet == tables
            assert sorted(p.port for p in netports.bound_ports(sockets, child.pid)) == ports
            none = tcpconns.TreeConnections([], [])
            assert tcpconns.tree_connections([child.pid], sockets) == none
        finally:
            child.kill()


#: Files opened while :data:`_OPENS_WATCHED` is set (sys.addaudithook cannot be undone:
#: it is added once, and records only then).
_OPENED: list[str] = []
_OPENS_WATCHED = False


def _record_open(event: str, args: tuple[Any, ...]) -> None:
    if _OPENS_WATCHED and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


def test_the_wrapper_watch_opens_no_file_of_the_runtime_directory(tmp_path: Path) -> None:
    """The kernel's thread that watches for a restore (every 0.5 s, without root) opens no
    file: a dump that froze it with one open needed that file at restore, and a restore
    into a new wrapper failed ("Can't open file ... wrapper.pid on restore") once the old
    wrapper's runtime directory was gone. A new pid file (a restore) still changes the
    marker, and so does a new restore record."""
    global _OPENS_WATCHED
    import kernel_snapshots
    from kernel_wrapper.inkernel import lifeline

    (tmp_path / "wrapper.pid").write_text("123 4")
    sys.addaudithook(_record_open)
    _OPENS_WATCHED = True
    try:
        before = lifeline._restore_marker(tmp_path)
    finally:
        _OPENS_WATCHED = False
    assert [path for path in _OPENED if path.startswith(str(tmp_path))] == []
    replaced = tmp_path / "wrapper.pid.tmp"
    replaced.write_text("456 4")
    os.replace(replaced, tmp_path / "wrapper.pid")
    after_new_wrapper = lifeline._restore_marker(tmp_path)
    assert after_new_wrapper != before
    (tmp_path / kernel_snapshots.RESTORE_FILE).write_text("{}")
    assert lifeline._restore_marker(tmp_path) != after_new_wrapper
