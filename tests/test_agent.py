"""The node agent (jupyter_ext.nodeagent) on this machine, with real CRIU: its protocol
refuses every malformed request (and a fuzzer finds nothing else), it names its callers
by the kernel, dumps and restores a caller's own process, and refuses other pods'
processes and other users' or altered images. Its callers are stand-in pods
(testkit/agentpods.py: a container's cgroup, UTS/PID/mount namespaces, user nobody); the
same agent with real pods at Pod Security baseline in podman: tests/test_container.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubespawner.slugs import safe_slug

from jupyter_ext.core import proctree
from jupyter_ext.core.agent import peers
from jupyter_ext.core.agent import protocol as agentproto
from jupyter_ext.core.agent.client import AgentCriu
from jupyter_ext.core.agent.protocol import AgentRequestError, parse_request
from jupyter_ext.core.criu import Criu
from jupyter_ext.core.criu.chain import SEAL_FILE
from jupyter_ext.core.memtrack import uffd
from jupyter_ext.core.protocol.environment import ENV_AGENT_SOCKET
from jupyter_ext.nodeagent import privileges
from jupyter_ext.nodeagent.podcriu import RESTORE_CAPS, PodCriu, cgroup_procs_files
from testkit.agentpods import (
    HERE,
    NOBODY,
    NODE_PATH,
    ROOT,
    FakePod,
    RunningAgent,
    cgroup_root,
)
from testkit.processes import KernelProcess

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the node agent runs as root")

#: A "kernel": holds x, writes it to the file it was given when told to stop (SIGTERM).
TARGET = (
    "import os, signal, sys, time\n"
    "os.setsid()\n"
    "x = 6 * 7\n"
    "def stop(*_):\n"
    "    open(sys.argv[1], 'w').write(str(x))\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "while True:\n"
    "    time.sleep(0.05)\n"
)


def valid_messages() -> list[dict[str, Any]]:
    return [
        {"v": 2, "op": "hello", "args": {}},
        {
            "v": 2,
            "op": "dump",
            "args": {"pid": 4100, "leave_running": True, "externals": [], "ghost_limit": 0},
        },
        {
            "v": 2,
            "op": "dump",
            "args": {
                "pid": 77,
                "leave_running": False,
                "externals": ["file[1a:2b]"],
                "ghost_limit": 5 << 30,
            },
        },
        {
            "v": 2,
            "op": "restore",
            "args": {
                "files": ["core-1.img", "pages-1.img"],
                "sizes": [10, 4096],
                "seal": "a" * 64,
                "inherit": [],
            },
        },
        {
            "v": 2,
            "op": "restore",
            "args": {
                "files": ["pages-7.img"],
                "sizes": [0],
                "seal": "0" * 64,
                "inherit": ["pipe:[4711]", "file[3f:1a2b]"],
            },
        },
        {
            "v": 2,
            "op": "dump",
            "args": {
                "pid": 4100,
                "leave_running": True,
                "externals": ["file[1a:2b]", "file[1a:3c]"],
                "ghost_limit": 0,
                "open_by_fd": ["file[1a:3c]"],
                "frozen_copy": True,
                "keep_tcp": True,
            },
        },
        {
            "v": 2,
            "op": "restore",
            "args": {
                "files": ["core-1.img"],
                "sizes": [512],
                "seal": "b" * 64,
                "inherit": ["file[1a:3c]"],
                "keep_tcp": True,
            },
        },
        {
            "v": 2,
            "op": "dump",
            "args": {
                "pid": 4100,
                "leave_running": True,
                "externals": [],
                "ghost_limit": 0,
                "track_mem": True,
                "prev": ["inventory.img", "pagemap-4100.img"],
                "prev_sizes": [90, 4200],
                "prev_seals": ["c" * 64, "d" * 64],
            },
        },
        {"v": 2, "op": "pre_dump", "args": {"pid": 4100}},
        {
            "v": 2,
            "op": "pre_dump",
            "args": {
                "pid": 4100,
                "prev": ["inventory.img"],
                "prev_sizes": [90],
                "prev_seals": ["e" * 64],
            },
        },
        {
            "v": 2,
            "op": "restore",
            "args": {
                "files": ["core-1.img", "parent/pages-1.img", "parent/parent/pagemap-7.img"],
                "sizes": [512, 4096, 80],
                "seal": "b" * 64,
                "inherit": [],
                "level_seals": ["1" * 64, "2" * 64],
            },
        },
    ]


def _dump(args: bytes) -> bytes:
    """A dump request's datagram with ``args`` (the inside of its args object)."""
    return b'{"v": 2, "op": "dump", "args": {' + args + b"}}"


def _restore(args: bytes, seal: bytes = b"a" * 64, inherit: bytes = b"") -> bytes:
    """A restore request's datagram with ``args`` (files and sizes), ``seal``, ``inherit``."""
    return (
        b'{"v": 2, "op": "restore", "args": {' + args + b', "seal": "' + seal + b'", '
        b'"inherit": [' + inherit + b"]}}"
    )


def _nfds(message: dict[str, Any]) -> int:
    args = message.get("args", {})
    if message.get("op") == "restore":
        return len(args["files"]) + len(args["inherit"])
    return len(args.get("prev", []))


def _tracked(args: bytes, prev: bytes = b'["inventory.img"]') -> bytes:
    """A tracked dump's datagram: ``args`` after its pid, ``prev`` for its stub."""
    return _dump(
        b'"pid": 7, "leave_running": true, "externals": [], "ghost_limit": 0, '
        b'"prev": ' + prev + b", " + args
    )


@pytest.mark.parametrize(
    ("message", "named"),
    [
        (b"\xff\xfe", "not a JSON object"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"v": 1, "op": "hello", "args": {}}', "protocol version 1; this agent speaks version 2"),
        (b'{"v": true, "op": "hello", "args": {}}', "protocol version True"),
        (b'{"v": 2, "op": "shell", "args": {}}', "unknown operation 'shell'"),
        (b'{"v": 2, "op": "hello", "args": {}, "as": "root"}', "unknown field 'as'"),
        (_dump(b'"pid": 1, "leave_running": true, "externals": [], "ghost_limit": 0'), "pid must"),
        (
            _dump(b'"pid": "7", "leave_running": true, "externals": [], "ghost_limit": 0'),
            "pid must",
        ),
        (
            _dump(b'"pid": 7, "leave_running": 1, "externals": [], "ghost_limit": 0'),
            "leave_running must be true or false",
        ),
        (_dump(b'"pid": 7, "leave_running": true'), "missing field 'externals'"),
        (
            _dump(
                b'"pid": 7, "leave_running": true, "externals": ["--action-script=/tmp/x"], '
                b'"ghost_limit": 0'
            ),
            "externals has",
        ),
        (
            _dump(b'"pid": 7, "leave_running": true, "externals": [], "ghost_limit": -1'),
            "ghost_limit must be an integer",
        ),
        (
            _dump(b'"pid": 7, "leave_running": true, "externals": [], "ghost_limit": 1.5'),
            "ghost_limit must be an integer",
        ),
        (
            _dump(
                b'"pid": 7, "leave_running": true, "externals": [], "ghost_limit": 1099511627777'
            ),
            "ghost_limit must be an integer",
        ),
        (_restore(b'"files": ["../../etc/shadow"], "sizes": [1]'), "files has"),
        (_restore(b'"files": ["a.img", "a.img"], "sizes": [1, 1]'), "names an entry twice"),
        (_restore(b'"files": ["a.img"], "sizes": [1]', seal=b"xyz"), "seal must be 64 hex"),
        (
            _dump(
                b'"pid": 7, "leave_running": true, "externals": ["file[1:2]"], "ghost_limit": 0, '
                b'"open_by_fd": ["file[1:3]"]'
            ),
            "open_by_fd names a file that is not among externals",
        ),
        (
            _dump(
                b'"pid": 7, "leave_running": true, "externals": [], "ghost_limit": 0, '
                b'"frozen_copy": 1'
            ),
            "frozen_copy must be true or false",
        ),
        (
            _dump(
                b'"pid": 7, "leave_running": true, "externals": [], "ghost_limit": 0, '
                b'"keep_tcp": "yes"'
            ),
            "keep_tcp must be true or false",
        ),
        (
            _restore(b'"files": ["a.img"], "sizes": [1]', inherit=b'"fd[3]:/etc"'),
            "inherit has",
        ),
        (
            _restore(b'"files": ["a.img"], "sizes": [1], "keep_tcp": 0'),
            "keep_tcp must be true or false",
        ),
        (_restore(b'"files": ["a.img"]'), "missing field 'sizes'"),
        (_restore(b'"files": ["a.img", "b.img"], "sizes": [1]'), "sizes must be a list of 2"),
        (_restore(b'"files": ["a.img"], "sizes": [-1]'), "sizes must be"),
        (_restore(b'"files": ["a.img"], "sizes": [1.0]'), "sizes must be"),
        (_restore(b'"files": ["a.img"], "sizes": [true]'), "sizes must be"),
        (_restore(b'"files": ["a.img"], "sizes": [1099511627777]'), "sizes must be"),
        (
            _tracked(b'"prev_sizes": [1], "prev_seals": ["' + b"a" * 64 + b'"]'),
            "prev needs track_mem",
        ),
        (
            _tracked(b'"track_mem": true, "prev_sizes": [1], "prev_seals": []'),
            "prev_seals must be a list of 1 seals",
        ),
        (
            _tracked(b'"track_mem": true, "prev_sizes": [], "prev_seals": []'),
            "prev_sizes must be a list of 1",
        ),
        (_tracked(b'"track_mem": true', prev=b'["core-7.img"]'), "prev has 'core-7.img'"),
        (_tracked(b'"track_mem": true', prev=b'["pagemap-7.img"]'), "prev has no inventory"),
        (_tracked(b'"track_mem": true', prev=b'["../inventory.img"]'), "prev has"),
        (b'{"v": 2, "op": "pre_dump", "args": {"pid": 1}}', "pid must"),
        (
            b'{"v": 2, "op": "pre_dump", "args": {"pid": 7, "leave_running": true}}',
            "unknown field 'leave_running'",
        ),
        (_restore(b'"files": ["parent/../core-1.img"], "sizes": [1]'), "files has"),
        (_restore(b'"files": ["parent"], "sizes": [1]'), "files names 'parent'"),
        (_restore(b'"files": ["parent/core-1.img"], "sizes": [1]'), "files has"),
        (_restore(b'"files": ["/parent/pages-1.img"], "sizes": [1]'), "files has"),
        (
            _restore(b'"files": ["a.img", "parent/pages-1.img"], "sizes": [1, 1]'),
            "level_seals must be a list of 1 seals",
        ),
        (
            _restore(b'"files": ["' + b"parent/" * 33 + b'pages-1.img"], "sizes": [1]'),
            "files has",
        ),
    ],
)
def test_agent_protocol_refuses_and_names_malformed_requests(message: bytes, named: str) -> None:
    with pytest.raises(AgentRequestError) as refused:
        parse_request(message, 1 if b'"restore"' in message else 0)
    assert named in refused.value.message


def test_agent_protocol_answer_at_the_freeze_is_checked() -> None:
    """A dump's caller answers "frozen" with whether it copied; anything else is refused
    (the agent then fails the dump: the tree runs on)."""
    assert agentproto.parse_copied(b'{"v": 2, "copied": true}') is True
    assert agentproto.parse_copied(b'{"v": 2, "copied": false}') is False
    for wrong in (
        b"",
        b"\xff",
        b'{"v": 2, "copied": 1}',
        b'{"v": 1, "copied": true}',
        b'{"v": 2, "copied": true, "more": 1}',
        b'{"copied": true}',
        b"[true]",
    ):
        with pytest.raises(AgentRequestError, match="the answer to"):
            agentproto.parse_copied(wrong)


HELLO = {
    "version": 2,
    "criu_version": "4.2.1",
    "owner": "alice",
    "pod_name": "jupyter-alice",
    "pod": "pod0d1e",
    "container": "c" * 64,
}


@pytest.mark.parametrize(
    ("reply", "named"),
    [
        ({**HELLO, "version": 3}, "it speaks protocol version 3"),
        ({**HELLO, "version": "2"}, "version is of type str, not int"),
        ({**HELLO, "criu_version": "4.2; rm -rf /"}, "criu_version '4.2; rm -rf /'"),
        ({**HELLO, "owner": None}, "owner is of type NoneType, not str"),
        ({k: v for k, v in HELLO.items() if k != "pod_name"}, "not the fields"),
        ({**HELLO, "root": True}, "not the fields"),
        ({**HELLO, "dirty_tracking": "magic"}, "dirty_tracking 'magic'"),
        ({**HELLO, "dirty_tracking": None}, "dirty_tracking is of type NoneType"),
        ([HELLO], "its hello has list"),
    ],
)
def test_agent_protocol_hello_reply_is_checked(reply: Any, named: str) -> None:
    """The agent's hello (doctor's check, every wrapper's first call) is read only if
    every field is this version's: another release of the agent is named as such. An
    agent of before memory tracking sends no dirty_tracking: read as None."""
    assert agentproto.Hello.parse(HELLO).pod_name == "jupyter-alice"
    assert agentproto.Hello.parse(HELLO).dirty_tracking is None
    tracking = agentproto.Hello.parse({**HELLO, "dirty_tracking": "userfaultfd"})
    assert tracking.dirty_tracking == "userfaultfd"
    with pytest.raises(agentproto.AgentIncompatibleError) as refused:
        agentproto.Hello.parse(reply)
    assert named in refused.value.message
    assert "not of protocol version 2" in refused.value.message
    assert "same jupyter-kernel-snapshots release" in refused.value.hint


def test_agent_protocol_replies_of_another_version_are_not_read() -> None:
    agentproto.check_reply_version({"v": 2, "ok": True, "result": {}})
    for wrong in ({"v": 3, "ok": True}, {"ok": True}, {"v": True, "ok": True}, [2]):
        with pytest.raises(agentproto.AgentIncompatibleError, match="answered in protocol"):
            agentproto.check_reply_version(wrong)


def test_agent_protocol_optional_fields_have_defaults_and_are_sent_only_when_set() -> None:
    """A dump that needs none of open_by_fd, frozen_copy and keep_tcp need not name them,
    and is sent without them."""
    old = {"pid": 7, "leave_running": True, "externals": [], "ghost_limit": 0}
    request = agentproto.DumpRequest.parse(old)
    assert (request.open_by_fd, request.frozen_copy, request.keep_tcp) == ([], False, False)
    assert json.loads(agentproto.encode_request(request))["args"] == old


def test_agent_protocol_refuses_the_wrong_number_of_descriptors() -> None:
    message = json.dumps(valid_messages()[3]).encode()
    assert parse_request(message, 2).op == "restore"
    for wrong in (0, 1, 3):
        with pytest.raises(AgentRequestError, match="descriptors sent"):
            parse_request(message, wrong)


def test_a_refusal_sent_before_the_request_arrived_is_read(tmp_path: Path) -> None:
    """The agent refuses a connection at once (its limits) and closes it; the request the
    client sent meanwhile lies unread, so Linux tells the client "connection reset" before
    the refusal it queued: the client reads on and raises the refusal (a busy CI machine
    saw "the node agent went away" instead)."""
    from jupyter_ext.core.agent.client import call
    from jupyter_ext.core.errors import SnapshotError

    path = tmp_path / "agent.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(1)
    refusal = AgentRequestError("The node agent is serving as many connections (--max).")

    def refuse() -> None:
        conn, _ = listener.accept()
        agentproto.send(conn, {"ok": False, "error": refusal.to_dict()})
        select.select([conn], [], [], 30)  # the client's request arrives, left unread
        conn.close()

    agent = threading.Thread(target=refuse)
    agent.start()
    try:
        with pytest.raises(SnapshotError, match=r"--max\)") as refused:
            call(path, agentproto.HelloRequest())
        assert refused.value.code == refusal.code
    finally:
        agent.join(30)
        listener.close()


def _mutate(value: Any, rng: random.Random, depth: int = 0) -> Any:
    """A random change of a JSON value: another type, a boundary, a key added/dropped."""
    choice = rng.randrange(12)
    if isinstance(value, dict) and value and choice < 6:
        mutated = dict(value)
        key = rng.choice(sorted(mutated))
        if choice == 0:
            del mutated[key]
        elif choice == 1:
            mutated[rng.choice(["x", "pid", "op", "v", "args", "files", key + "_"])] = 1
        else:
            mutated[key] = _mutate(mutated[key], rng, depth + 1)
        return mutated
    if isinstance(value, list) and value and choice < 6:
        mutated_list = list(value)
        index = rng.randrange(len(mutated_list))
        mutated_list[index] = _mutate(mutated_list[index], rng, depth + 1)
        if choice == 0:
            mutated_list.append(mutated_list[index])
        return mutated_list
    return rng.choice(
        [
            None,
            True,
            False,
            0,
            1,
            -1,
            2**31,
            2**63,
            4 * 1024 * 1024 + 1,
            1.5,
            float("nan"),
            "",
            "a" * 65,
            "../x",
            "file[1:2]\n",
            "pipe:[1]",
            "\x00",
            "é",
            [],
            {},
            [value],
            {"k": value},
            "hello",
            "restore",
        ]
    )


def test_agent_protocol_fuzzed_requests_are_parsed_or_refused_never_crash() -> None:
    """20 000 mutated requests and random datagrams: each is either a request whose every
    field is valid, or an AgentRequestError; no other exception (a bug here would be a
    crash of the root agent, or a field passed to CRIU unchecked)."""
    rng = random.Random(35)
    accepted = refused = 0
    for _ in range(20_000):
        base = rng.choice(valid_messages())
        message = _mutate(base, rng)
        for _ in range(rng.randrange(3)):
            message = _mutate(message, rng)
        data = json.dumps(message).encode() if rng.random() < 0.95 else rng.randbytes(40)
        nfds = _nfds(base) if rng.random() < 0.8 else rng.randrange(300)
        try:
            request = parse_request(data, nfds)
        except AgentRequestError:
            refused += 1
            continue
        accepted += 1
        request.check()  # what was accepted passes the checks again
        for name, value in request.to_json().items():
            if name in ("sizes", "prev_sizes"):
                assert all(type(n) is int and 0 <= n <= agentproto.IMAGE_SIZE_MAX for n in value)
            elif name == "files":  # a chain's levels below the images: parent/.../NAME
                for item in value:
                    *levels, last = item.split("/")
                    assert set(levels) <= {"parent"}
                    assert last not in ("", ".", "..")
            elif isinstance(value, list):
                assert all(isinstance(item, str) and "/" not in item for item in value)
        if isinstance(request, agentproto.DumpRequest):
            assert type(request.pid) is int
            assert 1 < request.pid <= agentproto.PID_MAX
    assert accepted > 25  # every request is mutated at least once: few stay valid
    assert refused > 10_000


def test_pod_and_container_from_cgroups_of_runtimes() -> None:
    """Kubernetes (containerd, systemd and cgroupfs drivers) and podman name the pod and
    the container in the cgroup path; a process outside any container is refused."""
    cid = "a" * 64
    cases = {
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice/"
        f"cri-containerd-{cid}.scope\n": "kubepods-burstable-pod1234.slice",
        f"12:memory:/kubepods/besteffort/pod5678/{cid}\n0::/\n": "pod5678",
        f"4:memory:/libpod_parent/{'b' * 64}/libpod-{cid}\n0::/\n": "b" * 64,
    }
    for cgroup, pod in cases.items():
        assert peers.pod_and_container(cgroup) == (pod, cid)
    with pytest.raises(AgentRequestError, match="not in a container"):
        peers.pod_and_container("0::/user.slice/session-1.scope\n")


def test_cgroup_procs_files_follow_the_hierarchies_mounted(tmp_path: Path) -> None:
    for name in ("unified", "memory", "cpu"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cgroup.procs").touch()
    mountinfo = (
        f"30 25 0:26 / {tmp_path}/unified rw - cgroup2 cgroup2 rw\n"
        f"31 25 0:27 / {tmp_path}/memory rw - cgroup cgroup rw,memory\n"
        f"32 25 0:28 / {tmp_path}/cpu rw - cgroup cgroup rw,cpu,cpuacct\n"
        f"33 25 0:29 /sub {tmp_path}/cpu rw - cgroup cgroup rw,cpu,cpuacct\n"
    )
    with pytest.raises(AgentRequestError, match="cannot join"):
        cgroup_procs_files("4:memory:/no/such/cgroup\n", mountinfo)
    assert cgroup_procs_files("2:cpu,cpuacct:/\n0::/\n9:pids:/x\n", mountinfo) == [
        tmp_path / "cpu" / "cgroup.procs",
        tmp_path / "unified" / "cgroup.procs",
    ]


def _bpf(*instructions: tuple[int, int, int, int]) -> bytes:
    return b"".join(struct.pack("=HBBI", *insn) for insn in instructions)


def test_seccomp_programs_that_differ_only_in_runcs_leading_block_are_the_same() -> None:
    """runc prepends a block (ENOSYS for calls newer than the profile) whose architectures
    come in Go's random map order: two processes of one container can have programs that
    differ there and decide alike. They count as the same; a block that decides otherwise,
    or that reads more than the call's number and architecture, does not."""
    x86_64, i386, enosys, allow = 0xC000003E, 0x40000003, 0x50026, 0x7FFF0000

    def program(first: int, second: int, limit: int = 448, load: int = 0) -> bytes:
        return _bpf(
            (0x20, 0, 0, 4),  # ld arch
            (0x15, 1, 0, first),  # jeq first: 3
            (0x15, 0, 2, second),  # jeq second: 3, else 5
            (0x20, 0, 0, load),  # ld nr (or an argument)
            (0x25, 0, 1, limit),  # jgt limit: 5, else 6
            (0x06, 0, 0, enosys),  # the profile's own program from here: the same
            (0x06, 0, 0, allow),
        )

    same = program(x86_64, i386)
    assert privileges.same_filter(same, program(i386, x86_64))
    assert not privileges.same_filter(same, program(x86_64, i386, limit=447))
    assert not privileges.same_filter(same, program(x86_64, 0x40000028))
    # Differing where they read a call's argument: not looked into, so not the same.
    reading_arguments = program(x86_64, i386, load=16), program(x86_64, i386, load=24)
    assert not privileges.same_filter(*reading_arguments)
    assert not privileges.same_filter(same, same + _bpf((0x06, 0, 0, allow)))


# -- the agent itself, on this machine --------------------------------------------------


@pytest.fixture
def top() -> Iterator[Path]:
    """A directory every user may enter (pods run as nobody); removed afterwards."""
    path = Path(f"/tmp/jks-agent-test-{secrets.token_hex(4)}")
    path.mkdir(mode=0o755)
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def agent(top: Path) -> Iterator[RunningAgent]:
    running = RunningAgent(top)
    yield running
    running.close()


@pytest.fixture
def make_pod(top: Path) -> Iterator[Callable[..., FakePod]]:
    group = cgroup_root() / f"jks-agent-test-{secrets.token_hex(4)}"
    group.mkdir()
    pods: list[FakePod] = []

    def make(name: str, seccomp: bool | str = False) -> FakePod:
        pod = FakePod(name, group, seccomp)
        pods.append(pod)
        return pod

    yield make
    for pod in pods:
        pod.close()
    group.rmdir()


def _shared_dir(top: Path, name: str) -> Path:
    path = top / name
    path.mkdir()
    path.chmod(0o777)
    return path


def _start_target(pod: FakePod, out: Path) -> int:
    return pod.start([sys.executable, "-c", TARGET, str(out)])


def _stop_and_read(pod: FakePod, pid: int, out: Path) -> str:
    os.kill(pod.host_pid(pid), 15)
    deadline = time.monotonic() + 20
    while not (out.exists() and out.read_text()):
        assert time.monotonic() < deadline, "the restored process did not answer"
        time.sleep(0.05)
    return out.read_text()


@needs_root
def test_agent_names_its_caller_by_the_kernel(
    agent: RunningAgent, make_pod: Callable[[str], FakePod]
) -> None:
    pod = make_pod("jupyter-alice")
    hello = pod.client(str(agent.socket), "hello")
    assert hello == {"ok": True, "source": "node agent (owner alice)", "version": hello["version"]}
    # A pod whose name names no user is refused, whatever it asks.
    stranger = make_pod("build-runner")
    refused = stranger.client(str(agent.socket), "hello")
    assert refused["ok"] is False
    assert "names no owner" in str(refused["error"])


@needs_root
def test_agent_dumps_and_restores_its_callers_own_process(
    agent: RunningAgent, make_pod: Callable[[str], FakePod], top: Path
) -> None:
    pod = make_pod("jupyter-alice")
    shared = _shared_dir(top, "alice")
    pid = _start_target(pod, shared / "x")
    images = shared / "images"
    dumped: Any = pod.client(str(agent.socket), "dump", str(pid), str(images), "--end")
    assert dumped["ok"] is True, dumped
    assert dumped["frozen_seconds"] > 0  # read from CRIU's log before it is removed
    with pytest.raises(LookupError):
        pod.host_pid(pid)  # the dump without leave_running ended it
    restored = pod.client(str(agent.socket), "restore", str(images))
    assert restored == {"ok": True, "pid": pid}
    host_pid = pod.host_pid(pid)
    assert peers.status_fields(host_pid)["Uid"].split()[0] == "65534"
    # The restored process holds none of the agent's descriptors (CRIU held its program
    # directory and the images): only its own files.
    for link in Path(f"/proc/{host_pid}/fd").iterdir():
        target = os.readlink(link)
        assert not target.startswith(str(top)), target
        assert not Path(target).is_dir(), target
    assert _stop_and_read(pod, pid, shared / "x") == "42"
    # Nothing of the images stays with the agent (only its CRIU copy).
    assert [p.name for p in (top / "state").iterdir()] == ["bin"]


@needs_root
def test_agent_restores_a_process_under_seccomp_with_its_filter(
    agent: RunningAgent, make_pod: Callable[[str], FakePod], top: Path
) -> None:
    """A pod's processes run under a seccomp filter with no_new_privs (RuntimeDefault):
    the agent dumps one and restores it with its filter and no_new_privs, as the pod's."""
    pod = make_pod("jupyter-alice", seccomp=True)
    shared = _shared_dir(top, "alice")
    pid = _start_target(pod, shared / "x")
    before = peers.status_fields(pod.host_pid(pid))
    assert (before["Seccomp"], before["NoNewPrivs"]) == ("2", "1")
    images = shared / "images"
    dumped = pod.client(str(agent.socket), "dump", str(pid), str(images), "--end")
    assert dumped["ok"] is True, dumped
    restored = pod.client(str(agent.socket), "restore", str(images))
    assert restored == {"ok": True, "pid": pid}, restored
    after = peers.status_fields(pod.host_pid(pid))
    for field in ("Seccomp", "Seccomp_filters", "NoNewPrivs", "Uid", "Gid", "CapEff", "CapBnd"):
        assert after[field] == before[field], field
    assert _stop_and_read(pod, pid, shared / "x") == "42"


@needs_root
def test_agent_dumps_a_deleted_file_up_to_the_ghost_limit_asked(
    agent: RunningAgent, make_pod: Callable[[str], FakePod], top: Path
) -> None:
    """A process holding a deleted 3 MiB file (as Ray's object store does): CRIU's default
    limit (1 MiB) refuses it, the limit the request names lets the agent dump it."""
    pod = make_pod("jupyter-alice")
    shared = _shared_dir(top, "alice")
    holder = (
        "import os\n"
        f"f = open({str(shared / 'store')!r}, 'wb')\n"
        "f.write(b'x' * (3 << 20))\n"
        "f.flush()\n"
        f"os.unlink({str(shared / 'store')!r})\n" + TARGET
    )
    pid = pod.start([sys.executable, "-c", holder, str(shared / "x")])
    deadline = time.monotonic() + 20
    while (shared / "store").exists():
        assert time.monotonic() < deadline, "the file was not deleted"
        time.sleep(0.05)
    refused = pod.client(str(agent.socket), "dump", str(pid), str(shared / "small"))
    assert refused["ok"] is False
    assert "larger than the limit" in str(refused["error"]), refused
    dumped = pod.client(
        str(agent.socket), "dump", str(pid), str(shared / "images"), f"--ghost-limit={4 << 20}"
    )
    assert dumped["ok"] is True, dumped
    assert _stop_and_read(pod, pid, shared / "x") == "42"


@needs_root
def test_agent_refuses_another_pods_processes(
    agent: RunningAgent, make_pod: Callable[[str], FakePod], top: Path
) -> None:
    alice = make_pod("jupyter-alice")
    bob = make_pod("jupyter-bob")
    shared = _shared_dir(top, "shared")
    victim = _start_target(alice, shared / "x")
    host_victim = alice.host_pid(victim)
    # Bob names Alice's kernel by its node pid (not a process in his pod) ...
    refused = bob.client(str(agent.socket), "dump", str(host_victim), str(shared / "a"))
    assert refused["ok"] is False
    assert "no process" in str(refused["error"])
    # ... and by the pid it has in her pod: in his pod that number is his own client
    # (the caller itself) or nothing.
    refused = bob.client(str(agent.socket), "dump", str(victim), str(shared / "b"))
    assert refused["ok"] is False
    # A second container of Alice's pod (its own cgroup) is not hers either: the agent
    # asks for the very cgroup. Her own process in another container's cgroup is refused.
    other = alice.start(["sleep", "601"])
    host_other = alice.host_pid(other)
    side = alice.cgroup.parent / ("f" * 64)
    side.mkdir()
    try:
        (side / "cgroup.procs").write_text(str(host_other))
        refused = alice.client(str(agent.socket), "dump", str(other), str(shared / "c"))
        assert refused["ok"] is False
        assert "not in the caller's container" in str(refused["error"])
    finally:
        (alice.cgroup / "cgroup.procs").write_text(str(host_other))
        side.rmdir()
    assert alice.host_pid(victim) == host_victim  # untouched


@needs_root
def test_agent_of_another_node_restores_what_this_one_sealed(
    agent: RunningAgent, make_pod: Callable[[str], FakePod], top: Path
) -> None:
    """Every node's agent holds the cluster's seal key (one Secret): images one agent
    sealed restore through another; an agent with another key refuses them."""
    pod = make_pod("jupyter-alice")
    shared = _shared_dir(top, "alice")
    pid = _start_target(pod, shared / "x")
    images = shared / "images"
    assert pod.client(str(agent.socket), "dump", str(pid), str(images), "--end")["ok"] is True
    stranger = RunningAgent(top / "other-cluster")
    other_node = RunningAgent(top / "other-node", key=agent.key)
    try:
        refused = pod.client(str(stranger.socket), "restore", str(images))
        assert refused["ok"] is False
        assert "not sealed for the pod 'jupyter-alice'" in str(refused["error"])
        restored = pod.client(str(other_node.socket), "restore", str(images))
        assert restored == {"ok": True, "pid": pid}, restored
    finally:
        stranger.close()
        other_node.close()
    assert _stop_and_read(pod, pid, shared / "x") == "42"


@needs_root
def test_agent_refuses_another_users_and_altered_images(
    agent: RunningAgent, make_pod: Callable[[str], FakePod], top: Path
) -> None:
    alice = make_pod("jupyter-alice")
    shared = _shared_dir(top, "shared")
    pid = _start_target(alice, shared / "x")
    images = shared / "images"
    assert alice.client(str(agent.socket), "dump", str(pid), str(images))["ok"] is True
    bob = make_pod("jupyter-bob")
    refused = bob.client(str(agent.socket), "restore", str(images))
    assert refused["ok"] is False
    assert "not sealed for the pod 'jupyter-bob'" in str(refused["error"])
    # Alice's own images, altered: the seal no longer matches.
    core = sorted(images.glob("core-*.img"))[0]
    data = bytearray(core.read_bytes())
    data[-1] ^= 1
    core.write_bytes(bytes(data))
    refused = alice.client(str(agent.socket), "restore", str(images))
    assert refused["ok"] is False
    assert "not sealed for the pod 'jupyter-alice'" in str(refused["error"])


@needs_root
def test_agent_answers_malformed_requests_with_their_cause(
    agent: RunningAgent, make_pod: Callable[[str], FakePod]
) -> None:
    pod = make_pod("jupyter-alice")
    answer = pod.client(str(agent.socket), "raw", '{"v": 2, "op": "dump", "args": {"pid": -1}}')
    assert answer["ok"] is False
    assert "unknown" not in answer["error"]["message"]
    assert "missing field" in answer["error"]["message"] or "pid" in answer["error"]["message"]
    # The agent serves on after it.
    assert pod.client(str(agent.socket), "hello")["ok"] is True


#: A "kernel" holding what only the snapshot can carry: a spawn context's semaphore (a
#: named POSIX semaphore: glibc links its name after sem_open, the mapped path is gone),
#: a shared_memory segment, and a log it appends to. Stopped, it writes the segment's
#: first bytes and the semaphore's value, and appends a line to its log.
CARRYING_TARGET = (
    "import multiprocessing, os, signal, sys, time\n"
    "from multiprocessing import shared_memory\n"
    "os.setsid()\n"
    "sem = multiprocessing.get_context('spawn').Semaphore(3)\n"
    "sem.acquire()\n"
    "shm = shared_memory.SharedMemory(name='jks-agent-test', create=True, size=8192)\n"
    "shm.buf[:5] = b'hello'\n"
    "log = open(sys.argv[2], 'a')\n"
    "log.write('before\\n')\n"
    "log.flush()\n"
    "open(sys.argv[1] + '.ready', 'w').close()\n"
    "def stop(*_):\n"
    "    log.write('after\\n')\n"
    "    log.flush()\n"
    "    open(sys.argv[1], 'w').write(f'{bytes(shm.buf[:5]).decode()} {sem.get_value()}')\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "while True:\n"
    "    time.sleep(0.05)\n"
)


def _pod_shm(pod: FakePod) -> set[str]:
    """The names in the pod's own /dev/shm."""
    return {p.name for p in Path(f"/proc/{pod.init_pid}/root/dev/shm").iterdir()}


@needs_root
def test_agent_carries_dev_shm_files_and_appended_logs_copied_at_the_freeze(
    agent: RunningAgent, make_pod: Callable[[str], FakePod], top: Path
) -> None:
    """A process with a named semaphore, a shared_memory segment and an appended log is
    dumped through the agent, the client copying them while the agent holds the tree
    frozen (as the wrapper does), ended, its files gone (as on another node), and
    restored through the agent into its pod: the segment's content, the semaphore's
    count and the log as they were, put back in the pod's own /dev/shm."""
    pod = make_pod("jupyter-alice")
    shared = _shared_dir(top, "alice")
    out, log = shared / "x", shared / "logs" / "run.log"
    log.parent.mkdir(mode=0o777)
    log.parent.chmod(0o777)
    pid = pod.start([sys.executable, "-c", CARRYING_TARGET, str(out), str(log)])
    deadline = time.monotonic() + 30
    while not Path(f"{out}.ready").exists():
        assert time.monotonic() < deadline, "the process did not make its files"
        time.sleep(0.05)
    held = _pod_shm(pod)
    assert "jks-agent-test" in held
    assert any(name.startswith("sem.mp-") for name in held), held
    assert not Path("/dev/shm/jks-agent-test").exists()  # the pod's, not the node's
    images = shared / "images"
    dumped = pod.client(str(agent.socket), "dump", str(pid), str(images), "--end", "--carry")
    assert dumped["ok"] is True, dumped
    record = json.loads((images / "carried.json").read_text())
    assert record["copied"] is True
    assert len(record["shm"]) == 2
    assert [entry["path"] for entry in record["appended"]] == [str(log)]
    # The dump ended it and took the names (a suspend); its log goes too (another node).
    assert _pod_shm(pod) == set()
    shutil.rmtree(log.parent)
    restored = pod.client(str(agent.socket), "restore", str(images))
    assert restored == {"ok": True, "pid": pid}, restored
    assert _pod_shm(pod) == held
    assert _stop_and_read(pod, pid, out) == "hello 2"
    assert log.read_text() == "before\nafter\n"
    assert [p.name for p in (top / "state").iterdir()] == ["bin"]


@needs_root
def test_agent_runs_no_program_of_the_pods(
    agent: RunningAgent, make_pod: Callable[[str], FakePod], top: Path
) -> None:
    """CRIU, run by the agent in the pod's mount namespace with capabilities the pod's user
    lacks, starts helpers by name (``sh -c "iptables -n -w -L"`` while it probes the
    kernel): none may be a file of the pod's. The pod puts an ``sh`` in a directory of the
    node's PATH (a root pod could replace /bin/sh itself); a dump and a restore run
    without it."""
    pod = make_pod("jupyter-alice")
    shared = _shared_dir(top, "alice")
    pid = _start_target(pod, shared / "x")
    marker = shared / "ran"
    planted = Path(NODE_PATH.split(":")[0])
    mount = ["mount", "-t", "tmpfs", "pod", str(planted)]
    subprocess.run(["nsenter", f"--target={pod.init_pid}", "--mount", "--", *mount], check=True)
    sh = Path(f"/proc/{pod.init_pid}/root{planted}/sh")
    sh.write_text(f'#!/bin/sh\ngrep Cap /proc/self/status >> {marker}\nexec /bin/sh "$@"\n')
    sh.chmod(0o755)
    images = shared / "images"
    assert pod.client(str(agent.socket), "dump", str(pid), str(images), "--end")["ok"] is True
    assert pod.client(str(agent.socket), "restore", str(images))["ok"] is True
    assert not marker.exists(), marker.read_text()
    assert _stop_and_read(pod, pid, shared / "x") == "42"


#: A "kernel" and its child joined by a TCP connection on loopback (a multiprocessing
#: manager, Dask's scheduler and workers). Stopped, it asks its child over the connection
#: and writes the answer.
CONNECTED_TARGET = (
    "import os, signal, socket, sys, time\n"
    "os.setsid()\n"
    "server = socket.create_server(('127.0.0.1', 0))\n"
    "if os.fork() == 0:\n"
    "    peer = socket.create_connection(server.getsockname())\n"
    "    while True:\n"
    "        peer.sendall(peer.recv(100).upper())\n"
    "conn, _ = server.accept()\n"
    "def stop(*_):\n"
    "    conn.sendall(b'pong')\n"
    "    open(sys.argv[1], 'w').write(conn.recv(100).decode())\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "while True:\n"
    "    time.sleep(0.05)\n"
)


@needs_root
def test_agent_keeps_the_connections_inside_the_tree(
    agent: RunningAgent, make_pod: Callable[[str], FakePod], top: Path
) -> None:
    """A connection between two processes of the tree (both ends dumped) comes back
    established through the agent (TCP repair: the caller, in its pod as an ordinary
    user, could not), as in-pod mode as root brings it back."""
    pod = make_pod("jupyter-alice")
    shared = _shared_dir(top, "alice")
    pid = pod.start([sys.executable, "-c", CONNECTED_TARGET, str(shared / "x")])
    deadline = time.monotonic() + 20
    while len(proctree.descendants(pod.host_pid(pid))) < 2:
        assert time.monotonic() < deadline, "the child did not start"
        time.sleep(0.05)
    images = shared / "images"
    dumped = pod.client(str(agent.socket), "dump", str(pid), str(images), "--end", "--carry")
    assert dumped["ok"] is True, dumped
    assert json.loads((images / "carried.json").read_text())["tcp_kept"] is True
    restored = pod.client(str(agent.socket), "restore", str(images))
    assert restored == {"ok": True, "pid": pid}, restored
    assert _stop_and_read(pod, pid, shared / "x") == "PONG"


# -- the holes an audit found (issue 35): each test fails without its fix ----------------


def _take_pid(pid: int, argv: list[str], preexec: Callable[[], None]) -> subprocess.Popen[bytes]:
    """Start ``argv`` as the node's process ``pid`` (free again), as the kernel may hand a
    pid out again: ``ns_last_pid`` set just before the fork, tried until it lands."""
    for _ in range(500):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        process = subprocess.Popen(argv, preexec_fn=preexec)
        if process.pid == pid:
            return process
        process.kill()
        process.wait()
    pytest.fail(f"process id {pid} could not be taken again (other processes took it)")


@needs_root
def test_agent_refuses_a_caller_whose_connecting_process_ended(
    agent: RunningAgent, make_pod: Callable[[str], FakePod]
) -> None:
    """A process of Alice's pod connects and ends; the socket stays with her (passed on),
    and a process of Bob's pod gets the ended process's id. Her request must be refused
    (the agent took callers by the pid SO_PEERCRED gives: it named Bob)."""
    alice = make_pod("jupyter-alice")
    bob = make_pod("jupyter-bob")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connect = f"import socket, sys\nsocket.socket(fileno={sock.fileno()}).connect(sys.argv[1])\n"
    with sock:
        connector = subprocess.Popen(
            [sys.executable, "-c", connect, str(agent.socket)],
            pass_fds=[sock.fileno()],
            preexec_fn=alice._enter,
        )
        assert connector.wait() == 0
        impostor = _take_pid(
            connector.pid,
            ["nsenter", f"--target={bob.init_pid}", "--uts", "--", *NOBODY, "--", "sleep", "600"],
            bob._enter,
        )
        answer = _ask_as_impostor(sock, impostor)
    assert answer["ok"] is False, answer
    assert "the calling process ended before its request was served" in answer["error"]["message"]


def _ask_as_impostor(sock: socket.socket, impostor: subprocess.Popen[bytes]) -> dict[str, Any]:
    """Hello over ``sock`` once ``impostor`` runs (as the pid the socket's connector had)."""
    try:
        deadline = time.monotonic() + 20
        while Path(f"/proc/{impostor.pid}/comm").read_text().strip() != "sleep":
            assert time.monotonic() < deadline, "the impostor did not start"
            time.sleep(0.01)
        with contextlib.suppress(BrokenPipeError):  # refused at accept: the answer waits
            sock.sendall(agentproto.encode_request(agentproto.HelloRequest()))
        data, _ = agentproto.receive(sock)
        answer: dict[str, Any] = json.loads(data)
        return answer
    finally:
        impostor.kill()
        impostor.wait()


@pytest.fixture
def strict_agent(top: Path) -> Iterator[RunningAgent]:
    running = RunningAgent(top, ["--max-connections-per-pod", "3", "--receive-timeout", "2"])
    yield running
    running.close()


@needs_root
def test_agent_refuses_odd_descriptors_sizes_and_crowds_and_serves_on(
    strict_agent: RunningAgent, make_pod: Callable[[str], FakePod], top: Path
) -> None:
    """Restores through the live socket with a pipe that never ends, /dev/zero, a directory
    or a socket for an image, sizes that are not the files', a size past the disk, no
    descriptors or too many, a connection that sends nothing, and more connections from
    one pod than the agent takes: each is refused with its cause, and the agent serves on.
    (It read every descriptor to its end, into the node's disk, before it looked at it.)"""
    pod = make_pod("jupyter-alice")
    shared = _shared_dir(top, "alice")
    pid = _start_target(pod, shared / "x")
    images = shared / "images"
    assert pod.client(str(strict_agent.socket), "dump", str(pid), str(images))["ok"] is True
    answers: Any = pod.client(str(strict_agent.socket), "odd", str(images))
    expected = {
        "pipe": "was not given as a regular file",
        "zero": "was not given as a regular file",
        "directory": "was not given as a regular file",
        "socket": "was not given as a regular file",
        "shorter": "declared",
        "longer": "declared",
        "huge": "--max-request-bytes",
        "none": "0 descriptors sent",
        "too many": "cut short",
        "silent": "--receive-timeout",
    }
    for case, named in expected.items():
        answer: Any = answers[case]
        assert answer["ok"] is False, (case, answer)
        assert named in answer["error"]["message"], (case, answer)
    assert answers["hello after"]["ok"] is True, answers
    crowd: Any = pod.client(str(strict_agent.socket), "crowd", "3")
    assert crowd["crowded"]["ok"] is False, crowd
    assert "--max-connections-per-pod" in crowd["crowded"]["error"]["message"], crowd
    assert crowd["after"]["ok"] is True, crowd
    assert [p.name for p in (top / "state").iterdir()] == ["bin"]  # no copy stays
    assert _stop_and_read(pod, pid, shared / "x") == "42"


def _wait_for_dump(agent: RunningAgent) -> int:
    """The agent's child that runs CRIU's dump (nsenter of ``criu swrk``, once it has
    started)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for task in Path(f"/proc/{agent.process.pid}/task").iterdir():
            with contextlib.suppress(OSError):
                for child in (task / "children").read_text().split():
                    argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
                    if argv[0].endswith(b"nsenter") and b"swrk" in argv:
                        return int(child)
        time.sleep(0.005)
    raise AssertionError("the agent started no dump")


@needs_root
def test_agent_killed_during_a_suspends_dump_loses_nothing(
    agent: RunningAgent, make_pod: Callable[[str], FakePod], top: Path
) -> None:
    """The agent dies (SIGKILL) while CRIU dumps a kernel being suspended: CRIU, in the
    pod's cgroup, runs on and leaves the kernel running (it ended it, and the restarted
    agent deleted the images); the restarted agent suspends it again, and it is restored
    with its state."""
    pod = make_pod("jupyter-alice")
    shared = _shared_dir(top, "alice")
    pid = _start_target(pod, shared / "x")
    images = shared / "images"
    client = subprocess.Popen(
        pod.argv([*HERE, "client", str(agent.socket), "dump", str(pid), str(images), "--end"]),
        stdout=subprocess.PIPE,
        cwd=ROOT,
        preexec_fn=pod._enter,
    )
    # The agent cannot answer while its CRIU's nsenter is stopped: it dies mid-dump.
    dumping = _wait_for_dump(agent)
    pidfd = os.pidfd_open(dumping)
    try:
        os.kill(dumping, signal.SIGSTOP)
        agent.process.kill()
        agent.process.wait()
        os.kill(dumping, signal.SIGCONT)
        out, _ = client.communicate(timeout=120)
        assert select.select([pidfd], [], [], 120)[0], "the orphaned CRIU did not end"
    finally:
        os.close(pidfd)
    answer = json.loads(out.strip().splitlines()[-1])
    assert answer["ok"] is False, answer
    assert answer["error"]["code"] == "agent-unavailable", answer
    host_pid = pod.host_pid(pid)  # still there ...
    assert peers.status_fields(host_pid)["State"][0] in "RS"  # ... and running
    agent.restart()
    shutil.rmtree(images)
    dumped = pod.client(str(agent.socket), "dump", str(pid), str(images), "--end")
    assert dumped["ok"] is True, dumped
    restored = pod.client(str(agent.socket), "restore", str(images))
    assert restored == {"ok": True, "pid": pid}, restored
    assert _stop_and_read(pod, pid, shared / "x") == "42"


#: A "kernel" that counts, appending each number to its log (O_APPEND: each line one
#: write) as it goes.
COUNTING_TARGET = (
    "import os, sys, time\n"
    "os.setsid()\n"
    "log = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)\n"
    "n = 0\n"
    "while True:\n"
    "    n += 1\n"
    "    os.write(log, f'{n}\\n'.encode())\n"
    "    time.sleep(0.001)\n"
)


@needs_root
def test_agent_suspend_never_lets_the_kernel_run_past_its_images(
    agent: RunningAgent, make_pod: Callable[[str], FakePod], top: Path
) -> None:
    """A suspend's kernel is stopped while CRIU still holds it frozen (at its post-dump
    step), so it does nothing its images do not hold before its client ends it: the
    restored kernel counts on right after the last number in its log. (Stopped after the
    dump instead, it ran on between CRIU letting go and the stop: its log went past its
    images, and the restored one wrote those numbers again.)"""
    pod = make_pod("jupyter-alice")
    shared = _shared_dir(top, "alice")
    log = shared / "count.log"
    pid = pod.start([sys.executable, "-c", COUNTING_TARGET, str(log)])
    deadline = time.monotonic() + 20
    while len(log.read_bytes().splitlines() if log.exists() else []) < 50:
        assert time.monotonic() < deadline, "the kernel did not count"
        time.sleep(0.01)
    images = shared / "images"
    dumped = pod.client(str(agent.socket), "dump", str(pid), str(images), "--end")
    assert dumped["ok"] is True, dumped
    with pytest.raises(LookupError):
        pod.host_pid(pid)  # ended by its client once it held the images
    last = int(log.read_bytes().splitlines()[-1])
    restored = pod.client(str(agent.socket), "restore", str(images))
    assert restored == {"ok": True, "pid": pid}, restored
    deadline = time.monotonic() + 20
    while len(log.read_bytes().splitlines()) < last + 1:
        assert time.monotonic() < deadline, "the restored kernel did not count"
        time.sleep(0.01)
    os.kill(pod.host_pid(pid), signal.SIGKILL)
    after = [int(line) for line in log.read_bytes().splitlines()[last:]]
    assert after[0] == last + 1, (last, after[:5])


def _pad_pids(pod: FakePod) -> None:
    """Processes in ``pod``, so that what it starts next has ids past those another pod's
    client and CRIU take (a restore there then finds them free)."""
    for _ in range(8):
        pod.start(["sleep", "600"])


@needs_root
def test_agent_seals_for_the_whole_pod_name(
    agent: RunningAgent, make_pod: Callable[[str], FakePod], top: Path
) -> None:
    """KubeSpawner's safe slugs give the users 'bob-x' and 'Bob.X' the pods jupyter-bob-x
    and jupyter-bob-x---2dbe2379: the user both names read is 'bob-x', but neither pod may
    restore the other's images (they were sealed for 'bob-x'). A pod name Kubernetes may
    have cut for the hostname (63 characters) is refused."""
    first = make_pod("jupyter-" + safe_slug("bob-x", max_length=48))
    second = make_pod("jupyter-" + safe_slug("Bob.X", max_length=48))
    assert second.name == "jupyter-bob-x---2dbe2379"
    for pod in (first, second):
        hello = pod.client(str(agent.socket), "hello")
        assert hello["source"] == "node agent (owner bob-x)", hello
    shared = _shared_dir(top, "bob")
    _pad_pids(first)
    pid = _start_target(first, shared / "x")
    images = shared / "images"
    assert first.client(str(agent.socket), "dump", str(pid), str(images), "--end")["ok"]
    refused = second.client(str(agent.socket), "restore", str(images))
    assert refused["ok"] is False
    assert "not sealed for the pod 'jupyter-bob-x---2dbe2379'" in str(refused["error"])
    assert first.client(str(agent.socket), "restore", str(images)) == {"ok": True, "pid": pid}
    assert _stop_and_read(first, pid, shared / "x") == "42"
    cut = make_pod("jupyter-" + "a" * 55)
    refused = cut.client(str(agent.socket), "hello")
    assert refused["ok"] is False, refused
    assert "63 characters long" in str(refused["error"]), refused


#: TARGET, but its root installs a seccomp filter on itself after it started a child,
#: which runs without one (with no_new_privs, as the pod's processes).
FILTERED_ROOT = (
    "import ctypes, os, sys, time\n"
    f"sys.path.insert(0, {str(ROOT)!r})\n"
    "from testkit.agentpods import PR_SET_NO_NEW_PRIVS, install_filter\n"
    "os.setsid()\n"
    "ctypes.CDLL(None).prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)\n"
    "if os.fork() == 0:\n"
    "    while True:\n"
    "        time.sleep(0.05)\n"
    "install_filter()\n" + TARGET.replace("os.setsid()\n", "")
)


@needs_root
@pytest.mark.parametrize(
    ("program", "dumped_in", "restored_in", "named"),
    [
        # Another filter program than the pod's, as many filters: the agent compared
        # only the mode and the number of filters.
        (TARGET, True, "other", "runs under other seccomp filters"),
        # The root under the pod's filter, its child without one: the agent looked only
        # at the root.
        (FILTERED_ROOT, False, True, "has seccomp mode 0, its pod 2"),
    ],
    ids=["other-filter", "child-without-filter"],
)
def test_agent_undoes_a_restore_that_holds_more_than_its_pod(
    agent: RunningAgent,
    make_pod: Callable[..., FakePod],
    top: Path,
    program: str,
    dumped_in: bool | str,
    restored_in: bool | str,
    named: str,
) -> None:
    """Images of a pod of the same name but other seccomp settings, restored: every
    restored task is compared with the caller (the filter programs themselves), and the
    tree is killed and the restore refused, saying which task and why."""
    shared = _shared_dir(top, "alice")
    first = make_pod("jupyter-alice", seccomp=dumped_in)
    _pad_pids(first)
    pid = first.start([sys.executable, "-c", program, str(shared / "x")])
    images = shared / "images"
    dumped = first.client(str(agent.socket), "dump", str(pid), str(images), "--end")
    assert dumped["ok"] is True, dumped
    first.close()
    second = make_pod("jupyter-alice", seccomp=restored_in)
    refused = second.client(str(agent.socket), "restore", str(images))
    assert refused["ok"] is False, refused
    assert "undid the restore" in str(refused["error"])
    assert named in str(refused["error"])
    for host_pid in second.host_pids():  # nothing restored is left (SIGKILLed at once)
        with contextlib.suppress(OSError):
            assert program not in Path(f"/proc/{host_pid}/cmdline").read_bytes().decode()


#: userfaultfd(2)'s system call number, by machine.
USERFAULTFD_CALL = {"x86_64": 323, "aarch64": 282}
#: Opens a userfaultfd as the user it runs as; prints the descriptor, or -errno.
OPEN_USERFAULTFD = (
    "import ctypes, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "fd = libc.syscall(int(sys.argv[1]), 0)\n"
    "print(fd if fd >= 0 else -ctypes.get_errno())\n"
)


@needs_root
def test_criu_as_the_agent_runs_it_has_no_lazy_pages(criu: Criu, tmp_path: Path) -> None:
    """Why restores through the agent copy every page first (docs/agent.md, 'Lazy
    restore'). The agent's own CRIU copy, run as the pod's user (nobody here) with the
    agent's restore capabilities, says it has no userfaultfd. The same user with the same
    capabilities opens one, and root's CRIU has lazy pages on this kernel, so CRIU's
    unprivileged mode is the cause. Fails once a CRIU has unprivileged lazy pages: lazy
    restores through the agent can then be built."""
    call = USERFAULTFD_CALL.get(os.uname().machine)
    if call is None:
        pytest.skip(f"no userfaultfd call number known for {os.uname().machine}")
    if not criu.supports_lazy_pages()[0]:
        pytest.skip(
            "this kernel has no userfaultfd with fork and remove events: nothing to compare"
        )
    pod_criu = PodCriu(criu.path, tmp_path / "bin")
    returncode, output = pod_criu.check(RESTORE_CAPS, "uffd-noncoop")
    changed = (
        "CRIU as the node agent runs it may have lazy pages now: build lazy restores "
        f"through the agent (docs/agent.md) and drop UNPRIVILEGED_NO_LAZY.\n{output}"
    )
    assert returncode != 0, changed
    assert "UFFD is not supported" in output, changed
    keep = ",".join(f"+cap_{cap}" for cap in RESTORE_CAPS)
    opened = subprocess.run(
        [
            *pod_criu.program("setpriv"),
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            f"--inh-caps={keep}",
            f"--ambient-caps={keep}",
            "--",
            os.path.realpath(sys.executable),
            "-c",
            OPEN_USERFAULTFD,
            str(call),
        ],
        pass_fds=[pod_criu.bin_fd],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert int(opened.stdout) >= 0, f"userfaultfd as nobody with {keep}: {opened.stdout}"


# -- memory tracking through the agent ---------------------------------------------------


@pytest.fixture
def pod_kernels(agent: RunningAgent) -> Iterator[Callable[..., KernelProcess]]:
    """Start snapshot kernels (the real wrapper and ipykernel) in a stand-in pod, as its
    user, dumping and restoring through ``agent`` as in a user pod at baseline; each is
    killed after the test."""
    started: list[KernelProcess] = []

    def start(pod: FakePod, work: Path, **kwargs: Any) -> KernelProcess:
        env = {ENV_AGENT_SOCKET: str(agent.socket), "HOME": str(work)}
        (work / "kernels").mkdir(exist_ok=True)
        os.chown(work / "kernels", *NOBODY_IDS)

        def enter() -> None:
            """In the wrapper's process, still root: into the pod's cgroup, its connection
            file (the test's, 0600) made the pod user's."""
            pod._enter()
            for connection_file in (work / "kernels").glob("kernel-*.json"):
                os.chown(connection_file, *NOBODY_IDS)

        kernel = KernelProcess(
            work / "kernels", env=env, prefix=pod.argv([]), preexec_fn=enter, **kwargs
        )
        started.append(kernel)
        return kernel

    yield start
    for kernel in started:
        kernel.end()


def _pod_copy(images: Path, dest: Path) -> Path:
    """A copy of ``images`` (its chain's levels too) that the pod's user may read."""
    shutil.copytree(images, dest, symlinks=True)
    for path in [dest, *dest.rglob("*")]:
        os.chown(path, *NOBODY_IDS, follow_symlinks=False)
    return dest


#: The pod's user (agentpods.NOBODY).
NOBODY_IDS = (65534, 65534)
#: A kernel of 96 MiB of random floats (more than a pre-copy round's threshold).
BIG = "import hashlib, numpy as np\na = np.random.default_rng(5).random(12 << 20)"
DIGEST = "print(hashlib.sha256(a.tobytes()).hexdigest())"


@needs_root
def test_agent_snapshots_cost_what_changed(
    agent: RunningAgent,
    make_pod: Callable[[str], FakePod],
    pod_kernels: Callable[..., KernelProcess],
    top: Path,
) -> None:
    """Through the agent a kernel's memory is tracked as in-pod (docs/agent.md, 'Memory
    tracking'): its first snapshot is copied while it runs (pre-copy rounds, each an agent
    pre-dump), its second copies, frozen, only what it wrote since (a dump on the stub of
    the first, sealed file by file), and the chain restores exactly. A level altered, or
    another pod's level (with its own, valid seal) in its place, is refused before CRIU
    reads a byte."""
    assert agent_hello(make_pod("jupyter-carol"), agent)["dirty_tracking"] == "userfaultfd"
    alice = make_pod("jupyter-alice")
    work = _shared_dir(top, "alice")
    kernel = pod_kernels(alice, work)
    kernel.execute(BIG)
    first = kernel.snapshot(work / "s1")
    assert first["memory"]["mode"] == "full", first["memory"]
    assert first["memory"]["precopy"], "a 96 MiB kernel is copied while it runs first"
    assert first["memory"]["frozen_bytes"] < first["memory"]["copied_bytes"] // 4
    kernel.execute("a[:50_000] = 1.0")  # 400 kB of 96 MiB
    second = kernel.snapshot(work / "s2", parent=str(work / "s1"))
    assert second["memory"]["mode"] == "incremental", second["memory"]["reason"]
    assert second["memory"]["frozen_bytes"] < first["memory"]["copied_bytes"] // 5, second
    assert second["memory"]["chain"]["levels"] >= 2, second["memory"]
    expected = kernel.execute(DIGEST)
    kernel.kill_all()

    images = work / "s2" / "images"
    forged = _pod_copy(images, work / "forged")
    level = next(p for p in (forged / "parent").rglob("pages-*.img") if p.stat().st_size)
    with level.open("r+b") as f:
        f.seek(4096)
        f.write(b"\xff" * 8)
    refused = alice.client(str(agent.socket), "restore", str(forged))
    assert refused["ok"] is False, refused
    named = f"the image {level.relative_to(forged)} is not sealed for the pod 'jupyter-alice'"
    assert named in str(refused["error"]), refused
    # Bob's pages file, sealed for Bob, in Alice's chain with its seal.
    bob = make_pod("jupyter-bob")
    bob_work = _shared_dir(top, "bob")
    pid = _start_target(bob, bob_work / "x")
    assert bob.client(str(agent.socket), "dump", str(pid), str(bob_work / "images"))["ok"]
    bob_seals = json.loads((bob_work / "images" / SEAL_FILE).read_text())["seals"]
    bob_pages = next(n for n in bob_seals if n.startswith("pages-"))
    foreign = _pod_copy(images, work / "foreign")
    level = next(p for p in (foreign / "parent").rglob("pages-*.img"))
    shutil.copyfile(bob_work / "images" / bob_pages, level)
    seals = json.loads((level.parent / SEAL_FILE).read_text())
    seals["seals"][level.name] = bob_seals[bob_pages]
    (level.parent / SEAL_FILE).write_text(json.dumps(seals))
    refused = alice.client(str(agent.socket), "restore", str(foreign))
    assert refused["ok"] is False, refused
    assert "is not sealed for the pod 'jupyter-alice'" in str(refused["error"]), refused

    shutil.rmtree(work / "s1")  # the second snapshot needs nothing of the first
    restored = pod_kernels(alice, work, restore_from=work / "s2")
    assert restored.execute(DIGEST) == expected


def agent_hello(pod: FakePod, agent: RunningAgent) -> dict[str, Any]:
    """The agent's hello to ``pod``, as the wrapper reads it."""
    result: dict[str, Any] = pod.client(str(agent.socket), "raw", _HELLO)["result"]  # type: ignore[assignment]
    return result


_HELLO = json.dumps({"v": agentproto.VERSION, "op": "hello", "args": {"tracking": True}})


#: In a pod: doctor's memory-tracking check in agent mode, as a JSON line.
DOCTOR_TRACKING = (
    "import json, sys\n"
    "from pathlib import Path\n"
    "from jupyter_ext.core.agent.client import AgentCriu\n"
    "from jupyter_ext.core.doctor import check_memory_tracking\n"
    "check = check_memory_tracking(AgentCriu.connect(Path(sys.argv[1])), agent_mode=True)\n"
    "print(json.dumps(check.to_dict()))\n"
)


@needs_root
def test_agent_under_runtime_default_says_why_every_snapshot_is_full(
    agent: RunningAgent,
    make_pod: Callable[..., FakePod],
    pod_kernels: Callable[..., KernelProcess],
    top: Path,
) -> None:
    """The RuntimeDefault profiles of container runtimes refuse userfaultfd, so a kernel
    in such a pod cannot be tracked: each of its snapshots through the agent copies the
    whole memory, and the snapshot's record and doctor say why (docs/agent.md)."""
    pod = make_pod("jupyter-alice", seccomp="no-userfaultfd")
    work = _shared_dir(top, "alice")
    kernel = pod_kernels(pod, work)
    kernel.execute("x = 1")
    full = ("full", f"the kernel cannot open a userfaultfd: {uffd.SECCOMP_REFUSES}")
    first = kernel.snapshot(work / "s1")
    assert (first["memory"]["mode"], first["memory"]["reason"]) == full
    second = kernel.snapshot(work / "s2", parent=str(work / "s1"))
    assert (second["memory"]["mode"], second["memory"]["reason"]) == full
    check = pod.run_json([sys.executable, "-c", DOCTOR_TRACKING, str(agent.socket)])
    assert check["ok"] is False
    said = f"this process cannot open a userfaultfd: {uffd.SECCOMP_REFUSES}"
    assert check["detail"] == f"every snapshot copies the whole memory, frozen: {said}"
    assert "seccomp profile that allows userfaultfd" in str(check["fix"])


@needs_root
def test_agent_hello_says_how_it_tracks_only_when_asked(
    agent: RunningAgent, make_pod: Callable[[str], FakePod]
) -> None:
    """A caller of before memory tracking, which asks a plain hello and reads every field
    of it, gets the fields it knows; one that asks gets dirty_tracking too."""
    pod = make_pod("jupyter-alice")
    plain = pod.client(str(agent.socket), "raw", json.dumps({"v": 2, "op": "hello", "args": {}}))
    assert sorted(plain["result"]) == sorted(HELLO)  # type: ignore[call-overload]
    assert agent_hello(pod, agent)["dirty_tracking"] in ("userfaultfd", "soft-dirty")


def test_agent_client_of_an_agent_before_tracking_copies_whole(tmp_path: Path) -> None:
    """An agent of before memory tracking refuses a hello that asks for it (an unknown
    field): the client asks again without, and its snapshots are full copies, saying why."""
    path = tmp_path / "agent.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(str(path))
    server.listen(2)
    asked: list[dict[str, Any]] = []

    def old_agent() -> None:
        for _ in range(2):
            conn, _ = server.accept()
            with conn:
                asked.append(json.loads(conn.recv(agentproto.MAX_MESSAGE))["args"])
                if asked[-1]:
                    field = sorted(asked[-1])[0]
                    refused = AgentRequestError(f"hello: unknown field {field!r}")
                    agentproto.send(conn, {"ok": False, "error": refused.to_dict()})
                else:
                    agentproto.send(conn, {"ok": True, "result": HELLO})

    thread = threading.Thread(target=old_agent, daemon=True)
    thread.start()
    criu = AgentCriu.connect(path)
    thread.join(10)
    server.close()
    assert asked == [{"tracking": True}, {}]
    kind, why = criu.dirty_tracking()
    assert kind is None
    assert "the node agent is of an older release" in why
