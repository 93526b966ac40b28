"""The node agent (jupyter_ext.nodeagent) on this machine, with real CRIU: its protocol
refuses every malformed request (and a fuzzer finds nothing else), it names its callers
by the kernel, dumps and restores a caller's own process, and refuses other pods'
processes and other users' or altered images. Its callers are stand-in pods
(tests/agentpods.py: a container's cgroup, UTS/PID/mount namespaces, user nobody); the
same agent with real pods at Pod Security baseline in podman: tests/test_container.py.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_ext.core.agent import peers
from jupyter_ext.core.agent import protocol as agentproto
from jupyter_ext.core.agent.protocol import AgentRequestError, parse_request
from jupyter_ext.nodeagent.podcriu import cgroup_procs_files

from .agentpods import FakePod, RunningAgent, cgroup_root

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
        {"v": 1, "op": "hello", "args": {}},
        {
            "v": 1,
            "op": "dump",
            "args": {"pid": 4100, "leave_running": True, "externals": [], "ghost_limit": 0},
        },
        {
            "v": 1,
            "op": "dump",
            "args": {
                "pid": 77,
                "leave_running": False,
                "externals": ["file[1a:2b]"],
                "ghost_limit": 5 << 30,
            },
        },
        {
            "v": 1,
            "op": "restore",
            "args": {"files": ["core-1.img", "pages-1.img"], "seal": "a" * 64, "inherit": []},
        },
    ]


def _dump(args: bytes) -> bytes:
    """A dump request's datagram with ``args`` (the inside of its args object)."""
    return b'{"v": 1, "op": "dump", "args": {' + args + b"}}"


def _nfds(message: dict[str, Any]) -> int:
    args = message.get("args", {})
    if message.get("op") == "restore":
        return len(args["files"]) + len(args["inherit"])
    return 0


@pytest.mark.parametrize(
    ("message", "named"),
    [
        (b"\xff\xfe", "not a JSON object"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"v": 2, "op": "hello", "args": {}}', "protocol version 2"),
        (b'{"v": true, "op": "hello", "args": {}}', "protocol version True"),
        (b'{"v": 1, "op": "shell", "args": {}}', "unknown operation 'shell'"),
        (b'{"v": 1, "op": "hello", "args": {}, "as": "root"}', "unknown field 'as'"),
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
        (
            b'{"v": 1, "op": "restore", "args": {"files": ["../../etc/shadow"], "seal": "'
            + b"a" * 64
            + b'", "inherit": []}}',
            "files has",
        ),
        (
            b'{"v": 1, "op": "restore", "args": {"files": ["a.img", "a.img"], "seal": "'
            + b"a" * 64
            + b'", "inherit": []}}',
            "names an entry twice",
        ),
        (
            b'{"v": 1, "op": "restore", "args": {"files": ["a.img"], "seal": "xyz", '
            b'"inherit": []}}',
            "seal must be 64 hex digits",
        ),
        (
            b'{"v": 1, "op": "restore", "args": {"files": ["a.img"], "seal": "'
            + b"a" * 64
            + b'", "inherit": ["fd[3]:/etc"]}}',
            "inherit has",
        ),
    ],
)
def test_agent_protocol_refuses_and_names_malformed_requests(message: bytes, named: str) -> None:
    with pytest.raises(AgentRequestError) as refused:
        parse_request(message, 1 if b'"restore"' in message else 0)
    assert named in refused.value.message


def test_agent_protocol_refuses_the_wrong_number_of_descriptors() -> None:
    message = json.dumps(valid_messages()[3]).encode()
    assert parse_request(message, 2).op == "restore"
    for wrong in (0, 1, 3):
        with pytest.raises(AgentRequestError, match="descriptors sent"):
            parse_request(message, wrong)


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
        for value in request.to_json().values():
            if isinstance(value, list):
                assert all(isinstance(item, str) and "/" not in item for item in value)
        if isinstance(request, agentproto.DumpRequest):
            assert type(request.pid) is int
            assert 1 < request.pid <= agentproto.PID_MAX
    assert accepted > 100
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

    def make(name: str, seccomp: bool = False) -> FakePod:
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
    dumped = pod.client(str(agent.socket), "dump", str(pid), str(images), "--end")
    assert dumped["ok"] is True, dumped
    with pytest.raises(LookupError):
        pod.host_pid(pid)  # the dump without leave_running ended it
    restored = pod.client(str(agent.socket), "restore", str(images))
    assert restored == {"ok": True, "pid": pid}
    host_pid = pod.host_pid(pid)
    assert peers.status_fields(host_pid)["Uid"].split()[0] == "65534"
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
    assert "not sealed for 'bob'" in str(refused["error"])
    # Alice's own images, altered: the seal no longer matches.
    core = sorted(images.glob("core-*.img"))[0]
    data = bytearray(core.read_bytes())
    data[-1] ^= 1
    core.write_bytes(bytes(data))
    refused = alice.client(str(agent.socket), "restore", str(images))
    assert refused["ok"] is False
    assert "not sealed for 'alice'" in str(refused["error"])


@needs_root
def test_agent_answers_malformed_requests_with_their_cause(
    agent: RunningAgent, make_pod: Callable[[str], FakePod]
) -> None:
    pod = make_pod("jupyter-alice")
    answer = pod.client(str(agent.socket), "raw", '{"v": 1, "op": "dump", "args": {"pid": -1}}')
    assert answer["ok"] is False
    assert "unknown" not in answer["error"]["message"]
    assert "missing field" in answer["error"]["message"] or "pid" in answer["error"]["message"]
    # The agent serves on after it.
    assert pod.client(str(agent.socket), "hello")["ok"] is True
