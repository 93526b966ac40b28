"""Stand-ins for user pods on this machine, for the node agent's tests (tests/test_agent.py).

A "pod" here has what the agent looks at, made with the same kernel features a container
runtime uses: a cgroup named as a container's (``.../pod-NAME/<64 hex>``, in the v1
``pids`` hierarchy, or v2 where there is no v1), its own UTS namespace whose hostname is
the pod's name (``jupyter-<user>``), its own PID and mount namespaces with a /proc of its
own, and processes of an ordinary user (nobody) without capabilities. The real pods, in
podman at Pod Security baseline, are tests/test_container.py's.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from jupyter_ext.core.agent import protocol as agentproto

ROOT = Path(__file__).resolve().parent.parent
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"]


def cgroup_root() -> Path:
    v1 = Path("/sys/fs/cgroup/pids")
    return v1 if v1.is_dir() else Path("/sys/fs/cgroup")


class FakePod:
    """One stand-in pod named ``jupyter-<user>[--suffix]``; ``close()`` ends it."""

    def __init__(self, name: str, group: Path, seccomp: bool = False) -> None:
        """``seccomp``: every process of the pod under no_new_privs and a seccomp filter,
        as RuntimeDefault runs a container (tests/under_seccomp.py)."""
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
                f"hostname {name} && exec sleep infinity",
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
                if kids and Path(f"/proc/{kids[0]}/comm").read_text().strip() == "sleep":
                    return int(kids[0])
            time.sleep(0.01)
        raise RuntimeError("the stand-in pod did not start")

    def argv(self, command: Sequence[str], groups: Sequence[int] = ()) -> list[str]:
        """``command`` as a process of the pod's user (also in ``groups``), in the pod."""
        enter = ["nsenter", f"--target={self.init_pid}", "--uts", "--pid", "--mount", "--"]
        user = [a for a in NOBODY if a != "--clear-groups"]
        user.append(f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups")
        filtered = [sys.executable, str(ROOT / "tests" / "under_seccomp.py")]
        return [*enter, *user, "--", *(filtered if self.seccomp else []), *command]

    def start(self, command: Sequence[str]) -> int:
        """Start ``command`` in the pod; its pid in the pod's PID namespace."""
        # Its standard files opened inside the pod (its mount namespace), as a container's.
        inside = ["sh", "-c", 'exec "$@" </dev/null >/dev/null 2>&1', "-", *command]
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
        """``tests/agent_client.py ARGS`` in the pod: its JSON answer (an error too)."""
        return self.run_json([sys.executable, "-m", "tests.agent_client", *args])

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


class RunningAgent:
    """``python -m jupyter_ext.nodeagent`` on this machine, its directories in ``top``."""

    def __init__(self, top: Path) -> None:
        self.socket_dir = top / "socket"
        self.log = (top / "agent.log").open("wb")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyter_ext.nodeagent",
                "--socket-dir",
                str(self.socket_dir),
                "--state-dir",
                str(top / "state"),
                "--key-file",
                str(top / "key" / "seal.key"),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.socket = self.socket_dir / agentproto.SOCKET_NAME
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((top / "agent.log").read_text())
            time.sleep(0.05)

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        self.log.close()


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    except OSError:
        return []
