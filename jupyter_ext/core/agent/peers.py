"""Who is calling the node agent, as the kernel says: never as the request says.

A caller is the process at the other end of the agent's unix socket: ``SO_PEERCRED``
gives its pid (in the agent's PID namespace, the node's) and its uid; a pidfd taken at
once pins that process. Its container is its cgroup (``/proc/PID/cgroup``: every
hierarchy's path, compared whole), whose last component carries the container id
(64 hex digits, as Kubernetes' runtimes and podman name them) and whose parent is the
pod (``pod<UID>``, ``kubepods-...-pod<UID>.slice``, podman's pod id). Its owner (the
JupyterHub user the snapshots belong to) comes from the pod's hostname, which Kubernetes
sets to the pod's name (KubeSpawner's ``jupyter-{username}``) and which a process in the
pod cannot change without ``CAP_SYS_ADMIN`` (baseline adds none).

A process a request names is looked up in the caller's own PID namespace and must be in
the caller's very cgroup, with the caller's uid: the agent never touches another pod's
(or another container's) processes.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .protocol import AgentRequestError

PROC = Path("/proc")
_CONTAINER_ID = re.compile(r"[0-9a-f]{64}")
#: KubeSpawner's default pod name template ``jupyter-{username}`` (named servers add
#: ``--{servername}``); the named group ``owner`` is the user.
DEFAULT_OWNER_PATTERN = r"jupyter-(?P<owner>[a-z0-9](?:[a-z0-9-]*?[a-z0-9])?)(?:--[a-z0-9-]+)?"


def _refused(message: str, hint: str = "") -> AgentRequestError:
    return AgentRequestError(
        f"The node agent refused the request: {message}.",
        hint=hint or "Only a user pod's own processes and its own snapshots can be used.",
    )


@dataclass(frozen=True)
class Caller:
    """The process at the other end of a connection, as the kernel identifies it."""

    pid: int
    """In the node's PID namespace."""
    uid: int
    gid: int
    pidfd: int
    cgroup: str
    """``/proc/PID/cgroup`` whole: equal for the processes of one container."""
    pod: str
    container: str
    pid_ns: int
    """The inode of its PID namespace."""
    owner: str

    def alive(self) -> bool:
        """Whether the process that connected still runs (its pid not reused)."""
        try:
            signal.pidfd_send_signal(self.pidfd, 0)
        except OSError:
            return False
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.pidfd)

    def describe(self) -> str:
        return (
            f"pod {self.pod} container {self.container[:12]} (owner {self.owner}, pid {self.pid})"
        )


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """pid, uid, gid of the peer (SO_PEERCRED: taken by the kernel at connect)."""
    data = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", data)
    return pid, uid, gid


def identify(conn: socket.socket, owner_pattern: str = DEFAULT_OWNER_PATTERN) -> Caller:
    """The caller on ``conn``, or AgentRequestError if it is not a container's process or
    its pod's name gives no owner."""
    pid, uid, gid = peer_credentials(conn)
    if pid <= 0:
        raise _refused("the caller's process is not visible from the node")
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as exc:
        raise _refused(f"the calling process {pid} is gone ({exc.strerror})") from exc
    try:
        cgroup = read_cgroup(pid)
        pod, container = pod_and_container(cgroup)
        pid_ns = os.stat(PROC / str(pid) / "ns" / "pid").st_ino
        owner = owner_of(pid, owner_pattern)
        caller = Caller(pid, uid, gid, pidfd, cgroup, pod, container, pid_ns, owner)
        if not caller.alive():
            raise _refused("the calling process ended while it was identified")
    except OSError as exc:
        os.close(pidfd)
        raise _refused(f"the calling process {pid} cannot be looked at ({exc})") from exc
    except BaseException:
        os.close(pidfd)
        raise
    return caller


def read_cgroup(pid: int) -> str:
    try:
        return (PROC / str(pid) / "cgroup").read_text()
    except OSError as exc:
        raise _refused(f"the cgroup of process {pid} cannot be read ({exc.strerror})") from exc


def pod_and_container(cgroup: str) -> tuple[str, str]:
    """The pod (the parent cgroup's name) and container id of a ``/proc/PID/cgroup``: the
    longest path names them (v1 hierarchies and v2 agree where set)."""
    paths = [line.split(":", 2)[2] for line in cgroup.splitlines() if line.count(":") >= 2]
    path = max(paths, key=len, default="/")
    parts = [part for part in path.split("/") if part]
    for index in range(len(parts) - 1, 0, -1):
        found = _CONTAINER_ID.search(parts[index])
        if found:
            return parts[index - 1], found.group(0)
    raise _refused(
        f"the caller is not in a container of a pod (its cgroup is {path})",
        hint="The agent serves only processes of user pods.",
    )


def owner_of(pid: int, pattern: str) -> str:
    """The owner named by the pod's hostname (its UTS namespace, which the pod cannot
    change at baseline), matched against ``pattern``."""
    out = subprocess.run(
        ["nsenter", f"--target={pid}", "--uts", "--", "uname", "-n"],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    hostname = out.stdout.strip()
    match = re.fullmatch(pattern, hostname)
    if out.returncode != 0 or match is None or not match.group("owner"):
        raise _refused(
            f"the caller's pod name {hostname!r} names no owner (pattern {pattern})",
            hint="Name user pods as the agent's --owner-pattern expects (KubeSpawner's "
            "default 'jupyter-{username}').",
        )
    return match.group("owner")


def status_fields(pid: int) -> dict[str, str]:
    """``/proc/PID/status`` as a mapping."""
    fields: dict[str, str] = {}
    for line in (PROC / str(pid) / "status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def find_in_namespace(pid_ns: int, pid: int) -> int | None:
    """The node's pid of the process that is ``pid`` in the PID namespace ``pid_ns``."""
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.stat(entry / "ns" / "pid").st_ino != pid_ns:
                continue
            ns_pids = status_fields(int(entry.name)).get("NSpid", "").split()
        except (OSError, ValueError):
            continue
        if ns_pids and ns_pids[-1] == str(pid):
            return int(entry.name)
    return None


def in_caller_namespace(caller: Caller, pid: int) -> int:
    """The node's pid of the process that is ``pid`` in the caller's PID namespace, or
    AgentRequestError if there is none or it is not in the caller's container."""
    host_pid = find_in_namespace(caller.pid_ns, pid)
    if host_pid is None:
        raise _refused(f"there is no process {pid} in the caller's pod")
    check_same_container(caller, host_pid, pid)
    return host_pid


def check_same_container(caller: Caller, host_pid: int, shown: int) -> None:
    """Refuse a process outside the caller's cgroup, of another uid, or the caller."""
    if host_pid == caller.pid:
        raise _refused("a caller cannot dump itself")
    try:
        cgroup = read_cgroup(host_pid)
        uids = status_fields(host_pid).get("Uid", "").split()
    except (OSError, AgentRequestError) as exc:
        raise _refused(f"process {shown} is gone") from exc
    if cgroup != caller.cgroup:
        raise _refused(f"process {shown} is not in the caller's container")
    if not uids or any(int(u) != caller.uid for u in uids):
        raise _refused(f"process {shown} does not run as the caller's user")
