"""Stand-ins for user pods on this machine, for the node agent's tests (tests/test_agent.py)
and its benchmark (bench/bench_agent.py), beside :mod:`testkit.processes`, so that both
use one harness.

A "pod" here has what the agent looks at, made with the same kernel features a container
runtime uses: a cgroup named as a container's (``.../pod-NAME/<64 hex>``, in the v1
``pids`` hierarchy, or v2 where there is no v1), its own UTS namespace whose hostname is
the pod's name (``jupyter-<user>``), its own PID and mount namespaces with a /proc and a
/dev/shm of its own, a PID 1 that reaps orphans, and processes of an ordinary user
(nobody) without capabilities. The real pods, in
podman at Pod Security baseline, are tests/test_container.py's.

What runs in a pod is this module too: its ``client`` (the product's own agent client,
core/agent/client.py, one operation per run, its answer as one JSON line) and its
``seccomp`` runner (no_new_privs and a seccomp filter, then exec, as a runtime starts a
container's process with RuntimeDefault)::

    python -m testkit.agentpods client SOCKET hello
    python -m testkit.agentpods client SOCKET dump PID IMAGES_DIR [--end] [--ghost-limit=B]
        [--carry]
    python -m testkit.agentpods client SOCKET restore IMAGES_DIR
    python -m testkit.agentpods client SOCKET raw JSON   (a request as given, for refusals)
    python -m testkit.agentpods client SOCKET odd IMAGES_DIR (restores, odd descriptors)
    python -m testkit.agentpods client SOCKET crowd N   (N silent connections, then hello)
    python -m testkit.agentpods seccomp [--other|--no-userfaultfd] COMMAND...

``--carry`` dumps as the kernel wrapper does (kernel_wrapper/dump.py): the tree's /dev/shm
files and the logs it appends to copied while the agent holds it frozen, into
``IMAGES_DIR/../carried`` with their records, its connections inside kept; a restore of
such images (``carried.json`` beside them) makes those files again first and hands the
/dev/shm ones over, as kernel_wrapper/restore.py does.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jupyter_ext.core.agent import protocol as agentproto
from jupyter_ext.core.errors import SnapshotError
from jupyter_ext.core.memtrack.uffd import NR_USERFAULTFD

if TYPE_CHECKING:
    from jupyter_ext.core.agent.client import AgentCriu

ROOT = Path(__file__).resolve().parent.parent
"""The repository, where a pod's client runs."""
HERE = [sys.executable, "-m", "testkit.agentpods"]
"""This module run in a pod. Entering the pod's mount namespace moves a process to its
``/``, so testkit is found through the venv's path, where the editable install
(scripts/common.sh) puts the repository root, not through the working directory."""
#: The pod's PID 1: it reaps what is orphaned in the pod, as a container's init does (the
#: resource tracker of a kernel that a dump ended).
INIT = (
    "import os, time  # jks stand-in pod init\n"
    "while True:\n"
    "    try:\n"
    "        os.wait()\n"
    "    except ChildProcessError:\n"
    "        time.sleep(0.1)\n"
)
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"]


def cgroup_root() -> Path:
    v1 = Path("/sys/fs/cgroup/pids")
    return v1 if v1.is_dir() else Path("/sys/fs/cgroup")


class FakePod:
    """One stand-in pod named ``jupyter-<user>[--suffix]``; ``close()`` ends it."""

    def __init__(self, name: str, group: Path, seccomp: bool | str = False) -> None:
        """``seccomp``: every process of the pod under no_new_privs and a seccomp filter,
        as RuntimeDefault runs a container (:func:`under_seccomp`; a name: that program
        of :data:`PROGRAMS`)."""
        self.name = name
        self.seccomp = seccomp
        self.container = secrets.token_hex(32)
        self.cgroup = group / f"pod-{name}-{secrets.token_hex(4)}" / self.container
        self.cgroup.mkdir(parents=True)
        self.init = subprocess.Popen(
            [
                "unshare",
                "--uts",
                "--pid",
                "--fork",
                "--mount",
                "--mount-proc",
                "sh",
                "-c",
                f"hostname {name} && mount -t tmpfs -o mode=1777 shm /dev/shm "
                f'&& exec {sys.executable} -c "$0"',
                INIT,
            ],
            preexec_fn=self._enter,
        )
        self.init_pid = self._wait_child(self.init.pid)
        self.processes: list[subprocess.Popen[bytes]] = []

    def _enter(self) -> None:
        (self.cgroup / "cgroup.procs").write_text("0")

    @staticmethod
    def _wait_child(pid: int) -> int:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
                if kids and _cmdline(int(kids[0]))[-1:] == [INIT]:
                    return int(kids[0])
            time.sleep(0.01)
        raise RuntimeError("the stand-in pod did not start")

    def argv(self, command: Sequence[str], groups: Sequence[int] = ()) -> list[str]:
        """``command`` as a process of the pod's user (also in ``groups``), in the pod."""
        enter = ["nsenter", f"--target={self.init_pid}", "--uts", "--pid", "--mount", "--"]
        user = [a for a in NOBODY if a != "--clear-groups"]
        user.append(f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups")
        program = [f"--{self.seccomp}"] if isinstance(self.seccomp, str) else []
        filtered = [*HERE, "seccomp", *program]
        return [*enter, *user, "--", *(filtered if self.seccomp else []), *command]

    def start(self, command: Sequence[str]) -> int:
        """Start ``command`` in the pod, a child of its init; its pid in the pod's PID
        namespace."""
        # Its standard files opened inside the pod (its mount namespace), as a container's;
        # orphaned at once, so its parent is the pod's init, as a container's processes
        # have theirs in the pod (nsenter, its parent else, stops when it is stopped).
        inside = ["sh", "-c", '"$@" </dev/null >/dev/null 2>&1 &', "-", *command]
        process = subprocess.Popen(
            self.argv(inside),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=self._enter,
        )
        self.processes.append(process)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for pid in self.host_pids():
                if pid != self.init_pid and _cmdline(pid)[: len(command)] == list(command):
                    return self.pod_pid(pid)
            time.sleep(0.01)
        raise RuntimeError(f"{command} did not start in the pod")

    def client(self, *args: str) -> dict[str, object]:
        """:func:`client` ``ARGS`` in the pod: its JSON answer (an error too)."""
        return self.run_json([*HERE, "client", *args])

    def run_json(self, command: Sequence[str], groups: Sequence[int] = ()) -> dict[str, object]:
        """Run ``command`` in the pod as its user; the JSON object its last line prints."""
        out = subprocess.run(
            self.argv(command, groups),
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
            preexec_fn=self._enter,
            check=False,
        )
        if not out.stdout.strip():
            raise RuntimeError(f"{command[:2]} in the pod said nothing: {out.stderr[-3000:]}")
        answer: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
        return answer

    def host_pids(self) -> list[int]:
        return [int(p) for p in (self.cgroup / "cgroup.procs").read_text().split()]

    @staticmethod
    def pod_pid(host_pid: int) -> int:
        for line in Path(f"/proc/{host_pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
        raise RuntimeError(f"no NSpid for {host_pid}")

    def host_pid(self, pod_pid: int) -> int:
        for pid in self.host_pids():
            with contextlib.suppress(OSError, RuntimeError):
                if self.pod_pid(pid) == pod_pid:
                    return pid
        raise LookupError(pod_pid)

    def close(self) -> None:
        """End the pod's processes and remove its cgroup (once: again does nothing)."""
        if not self.cgroup.exists():
            return
        for pid in self.host_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.init.kill()
        self.init.wait()
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(5)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                self.cgroup.rmdir()
                self.cgroup.parent.rmdir()
                return
            time.sleep(0.05)


#: A node's usual PATH, the agent's (a test looks for a program of a pod's on it).
NODE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class RunningAgent:
    """``python -m jupyter_ext.nodeagent`` on this machine, its directories in ``top``,
    with the options ``options``; :meth:`restart` starts it again (as its DaemonSet)."""

    def __init__(self, top: Path, options: Sequence[str] = (), key: Path | None = None) -> None:
        """``key``: another agent's seal key file (another node's: every node's agent mounts
        the same Secret); else ``top``'s own, made by the agent."""
        top.mkdir(exist_ok=True)
        self.top = top
        self.options = list(options)
        self.socket_dir = top / "socket"
        self.socket = self.socket_dir / agentproto.SOCKET_NAME
        self.key = key or top / "key" / "seal.key"
        self.log = (top / "agent.log").open("ab")
        self.process = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        top = self.top
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyter_ext.nodeagent",
                "--socket-dir",
                str(self.socket_dir),
                "--state-dir",
                str(top / "state"),
                "--key-file",
                str(self.key),
                *self.options,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PATH": NODE_PATH},
        )
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((top / "agent.log").read_text())
            time.sleep(0.05)
        return process

    def restart(self) -> None:
        """SIGKILL the agent (what it started runs on) and start it again."""
        self.process.kill()
        self.process.wait()
        self.process = self._start()

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        self.log.close()


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    except OSError:
        return []


# -- what runs in a pod -----------------------------------------------------------------


def client(argv: list[str]) -> dict[str, Any]:
    """One operation through the node agent, as a pod's kernel wrapper asks it."""
    from jupyter_ext.core.agent.client import AgentCriu  # not for the seccomp runner

    path, op, *rest = argv
    if op == "odd":
        return odd_restores(path, Path(rest[0]))
    if op == "crowd":
        return crowd(path, int(rest[0]))
    if op == "raw":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(path)
        sock.sendall(rest[0].encode())
        data, _ = agentproto.receive(sock)
        answer: dict[str, Any] = json.loads(data)
        return answer
    try:
        criu = AgentCriu.connect(Path(path))
        if op == "hello":
            return {"ok": True, "source": criu.source, "version": criu.version_text}
        if op == "dump":
            images = Path(rest[1])
            images.mkdir()
            started = time.monotonic()
            frozen = _dump(criu, int(rest[0]), images, rest[2:])
            return {"ok": True, "frozen_seconds": frozen, "seconds": time.monotonic() - started}
        if op == "restore":
            return {"ok": True, "pid": _restore(criu, Path(rest[0]))}
    except SnapshotError as exc:
        return {"ok": False, "error": exc.to_dict()}
    raise SystemExit(f"unknown operation {op}")


CARRIED = "carried.json"


def _dump(criu: AgentCriu, pid: int, images: Path, rest: list[str]) -> float:
    """A dump of ``pid`` into ``images``: with ``--carry``, its files as the wrapper does."""
    from jupyter_ext.core.carried import appended, shmfiles
    from jupyter_ext.core.criu import FrozenCopy
    from kernel_wrapper.dumptree import KernelTree

    ghost = [int(a.split("=")[1]) for a in rest if a.startswith("--ghost-limit=")]
    leave_running = "--end" not in rest
    if "--carry" not in rest:
        return asyncio.run(
            criu.dump(
                pid,
                images,
                images,
                leave_running=leave_running,
                ghost_limit=ghost[0] if ghost else 0,
            )
        )
    tree = KernelTree.inspect(pid, criu.keeps_tcp())
    carried = images.parent / "carried"
    shm = shmfiles.ShmCopy(tree.held, carried / shmfiles.SNAPSHOT_DIR_NAME)
    logs = appended.AppendedCopy(tree.appended_files, carried / appended.SNAPSHOT_DIR_NAME)
    frozen = FrozenCopy([shm, logs])
    try:
        seconds = asyncio.run(
            criu.dump(
                pid,
                images,
                images,
                leave_running=leave_running,
                externals=tree.held.keys,
                keep_tcp=tree.keep_tcp,
                open_by_fd=tree.held.keys,
                frozen=frozen,
            )
        )
        if not leave_running:
            shmfiles.remove_names(shm.records, tree.held)
        logs.copy_after()
    finally:
        tree.held.close()
        logs.close()
    record = {
        "shm": shm.records,
        "appended": logs.records,
        "copied": frozen.copied,
        "tcp_kept": tree.keep_tcp,
    }
    (images / CARRIED).write_text(json.dumps(record))
    return seconds


def _restore(criu: AgentCriu, images: Path) -> int:
    """A restore of ``images``, with the files a ``--carry`` dump carried made first."""
    from jupyter_ext.core.carried import appended, shmfiles

    try:
        record = json.loads((images / CARRIED).read_text())
    except FileNotFoundError:
        return asyncio.run(criu.restore(images, images))
    carried = images.parent / "carried"
    appended.put_back(record["appended"], carried, [])
    shm = shmfiles.recreate(record["shm"], carried)
    try:
        restoring = criu.restore(
            images, images, inherit_fds=shm.inherit, keep_tcp=record["tcp_kept"]
        )
        return asyncio.run(restoring)
    finally:
        shm.close_fds()


#: How long a case of :func:`odd_restores` waits for the agent's answer: none by then is
#: the case's failure.
ANSWER_TIMEOUT = 60.0


def _ask(path: str, data: bytes | None, fds: list[int]) -> dict[str, Any]:
    """One datagram with ``fds`` on a new connection (none if ``data`` is None); the
    agent's answer, or what happened instead (a case passes only with an answer)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(ANSWER_TIMEOUT)
    try:
        sock.connect(path)
        with contextlib.suppress(BrokenPipeError):
            if fds:
                socket.send_fds(sock, [data or b""], fds)
            elif data is not None:
                sock.sendall(data)
        answer, _ = agentproto.receive(sock)
    except TimeoutError:
        return {"ok": None, "error": {"message": "no answer"}}
    finally:
        sock.close()
    result: dict[str, Any] = json.loads(answer) if answer else {"ok": None, "closed": True}
    return result


def odd_restores(path: str, images: Path) -> dict[str, Any]:
    """Restore requests for the sealed ``images`` with odd descriptors, counts and sizes;
    each case's answer, then whether the agent still answers a hello."""
    from jupyter_ext.core.criu.chain import SEAL_FILE

    seal = json.loads((images / SEAL_FILE).read_text())
    names: list[str] = seal["files"]
    sizes = [(images / name).stat().st_size for name in names]

    def request(declared: list[int]) -> bytes:
        args = {"files": names, "sizes": declared, "seal": seal["seal"], "inherit": []}
        return json.dumps({"v": agentproto.VERSION, "op": "restore", "args": args}).encode()

    @contextlib.contextmanager
    def files(first: Callable[[], int] | None = None) -> Iterator[list[int]]:
        fds = [os.open(images / name, os.O_RDONLY) for name in names]
        if first is not None:
            os.close(fds[0])
            fds[0] = first()
        try:
            yield fds
        finally:
            for fd in fds:
                os.close(fd)

    def pipe() -> int:
        read, write = os.pipe()  # the writer stays open (leaked on purpose): no end
        os.write(write, b"x" * 100)
        return read

    def sock() -> int:
        a, b = socket.socketpair()
        b.detach()
        return a.detach()

    cases: dict[str, tuple[Callable[[], int] | None, list[int]]] = {
        "pipe": (pipe, sizes),
        "zero": (lambda: os.open("/dev/zero", os.O_RDONLY), sizes),
        "directory": (lambda: os.open(images, os.O_RDONLY | os.O_DIRECTORY), sizes),
        "socket": (sock, sizes),
        "shorter": (None, [sizes[0] - 1, *sizes[1:]]),
        "longer": (None, [sizes[0] + 1, *sizes[1:]]),
        "huge": (None, [1 << 40, *sizes[1:]]),
    }
    answers: dict[str, Any] = {}
    for case, (first, declared) in cases.items():
        with files(first) as fds:
            answers[case] = _ask(path, request(declared), fds)
    with files() as fds:
        answers["none"] = _ask(path, request(sizes), [])
        extra = [os.open("/dev/null", os.O_RDONLY) for _ in range(250 - len(fds))]
        answers["too many"] = _ask(path, request(sizes), [*fds, *extra])
        for fd in extra:
            os.close(fd)
    answers["silent"] = _ask(path, None, [])  # the agent's --receive-timeout ends it
    answers["hello after"] = _hello(path)
    return answers


def crowd(path: str, count: int) -> dict[str, Any]:
    """``count`` connections that send nothing, held open while a hello is asked; then
    they are closed and a hello is asked again."""
    silent = []
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(path)
        silent.append(sock)
    crowded = _hello(path)
    for sock in silent:
        sock.close()
    # The agent lets go of their slots as it notices them closed: ask until it has.
    deadline = time.monotonic() + ANSWER_TIMEOUT
    after = _hello(path)
    while "--max-connections-per-pod" in str(after) and time.monotonic() < deadline:
        time.sleep(0.05)
        after = _hello(path)
    return {"crowded": crowded, "after": after}


def _hello(path: str) -> dict[str, Any]:
    from jupyter_ext.core.agent.client import call

    try:
        result, _ = call(Path(path), agentproto.HelloRequest())
    except SnapshotError as exc:
        return {"ok": False, "error": exc.to_dict()}
    return {"ok": True, "result": result}


PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2
ALLOW = (0x06, 0, 0, 0x7FFF0000)
"""BPF_RET | BPF_K, SECCOMP_RET_ALLOW: a filter that allows every call (the kernel treats
every filter alike)."""
LOAD_NR = (0x20, 0, 0, 0)
"""BPF_LD | BPF_W | BPF_ABS of offset 0 (the call's number)."""
#: The filter programs a pod's processes may run under (``FakePod(seccomp=NAME)``), as
#: (code, jt, jf, k): "" allows every call; "other" too, as another profile would (the
#: node agent compares the programs); "no-userfaultfd" refuses ``userfaultfd`` with EPERM,
#: as the RuntimeDefault profiles of container runtimes do (docs/agent.md), and allows the
#: rest.
PROGRAMS: dict[str, list[tuple[int, int, int, int]]] = {
    "": [ALLOW],
    "other": [LOAD_NR, ALLOW],
    "no-userfaultfd": [
        LOAD_NR,
        (0x15, 0, 1, NR_USERFAULTFD),  # BPF_JMP | BPF_JEQ | BPF_K
        (0x06, 0, 0, 0x00050000 | errno.EPERM),  # SECCOMP_RET_ERRNO
        ALLOW,
    ],
}


class Insn(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_ushort),
        ("jt", ctypes.c_ubyte),
        ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint),
    ]


class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]


def install_filter(program: str = "") -> None:
    """no_new_privs and the filter :data:`PROGRAMS` names ``program`` on this thread."""
    libc = ctypes.CDLL(None, use_errno=True)
    insns = (Insn * len(PROGRAMS[program]))(*(Insn(*insn) for insn in PROGRAMS[program]))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    prog = Prog(len(insns), insns)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")


def under_seccomp(argv: list[str]) -> None:
    """Exec ``argv`` under no_new_privs and a seccomp filter (``--NAME`` first: the
    program :data:`PROGRAMS` names so)."""
    program = argv[0][2:] if argv[0].startswith("--") else ""
    install_filter(program)
    command = argv[1:] if program else argv
    os.execvp(command[0], command)


if __name__ == "__main__":
    what, *arguments = sys.argv[1:]
    if what == "client":
        print(json.dumps(client(arguments)))
    elif what == "seccomp":
        under_seccomp(arguments)
    else:
        raise SystemExit(f"unknown command {what!r}: client or seccomp")
