"""Who is calling the node agent, as the kernel says: never as the request says.

A caller is the process at the other end of the agent's unix socket. ``SO_PEERPIDFD`` gives
a pidfd of the process that connected, taken by the kernel at ``connect()``: it names that
process and no other, even once its pid number is free again and another process has it.
Everything the agent learns of the caller is read from ``/proc/PID`` and then confirmed
against the pidfd (:meth:`Caller.ensure_alive`: the process still runs, so its pid was not
reused in between); a caller whose process has ended is refused, whatever its socket says
later (a pod could connect, hand the socket to a child and exit, so that a process of
another pod gets the pid). ``SO_PEERCRED`` gives its uid and gid as of ``connect()``.

Its container is its cgroup (``/proc/PID/cgroup``: every hierarchy's path, compared
whole), whose last component carries the container id (64 hex digits, as Kubernetes'
runtimes and podman name them) and whose parent is the pod (``pod<UID>``,
``kubepods-...-pod<UID>.slice``, podman's pod id). Its pod's name is the hostname of its
UTS namespace, which Kubernetes sets to the pod's name and which a process in the pod
cannot change without ``CAP_SYS_ADMIN`` (baseline adds none): images are sealed for that
name (KubeSpawner's pod names are unique per user and server, and the same for the next
pod of that server); the user's name, for messages, is read from it with a pattern.

A process a request names is looked up in the caller's own PID namespace and must be in
the caller's very cgroup, with the caller's uid: the agent never touches another pod's
(or another container's) processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import select
import signal
import socket
import struct
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from .protocol import AgentRequestError

PROC = Path("/proc")
#: ``SO_PEERPIDFD`` (Linux >= 6.5; include/uapi/asm-generic/socket.h: 77 on x86_64 and
#: arm64); Python's socket module has it from 3.14 on.
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)
_CONTAINER_ID = re.compile(r"[0-9a-f]{64}")
#: KubeSpawner's default pod name template ``jupyter-{username}`` (named servers add
#: ``--{servername}``); the named group ``owner`` is the user, as shown in messages.
DEFAULT_OWNER_PATTERN = r"jupyter-(?P<owner>[a-z0-9](?:[a-z0-9-]*?[a-z0-9])?)(?:--[a-z0-9-]+)?"
#: The longest hostname Kubernetes gives a pod: a longer pod name is cut to it, so a
#: hostname this long may be one of several pods' names (not unique: refused).
HOSTNAME_MAX = 63
#: The namespaces CRIU enters (/proc/PID/ns/NAME) with nsenter's option for each.
NAMESPACES = {
    "pid": "--pid",
    "mnt": "--mount",
    "net": "--net",
    "ipc": "--ipc",
    "uts": "--uts",
    "cgroup": "--cgroup",
}
ENDED = "the calling process ended before its request was served"


def _refused(message: str, hint: str = "") -> AgentRequestError:
    return AgentRequestError(
        f"The node agent refused the request: {message}.",
        hint=hint or "Only a user pod's own processes and its own snapshots can be used.",
    )


@dataclass(frozen=True)
class Caller:
    """The process at the other end of a connection, as the kernel identifies it."""

    pid: int
    """In the node's PID namespace; valid while :meth:`ensure_alive` passes."""
    uid: int
    gid: int
    pidfd: int
    cgroup: str
    """``/proc/PID/cgroup`` whole: equal for the processes of one container."""
    pod: str
    """The pod's cgroup name (its UID): what the agent counts connections by."""
    container: str
    pid_ns: int
    """The inode of its PID namespace."""
    pod_name: str = ""
    """The pod's name (its hostname): whose snapshots it may restore (:func:`named`)."""
    owner: str = ""
    """The user, read from the pod's name: for messages."""

    def alive(self) -> bool:
        """Whether the process that connected still runs: not exiting (what /proc shows
        of an exiting process is being torn down: its cgroup is the root's already), not
        ended (its pidfd is readable once it has)."""
        return _running(self.pid, self.pidfd)

    def ensure_alive(self) -> None:
        """Raise unless the process that connected still runs: what was read of
        ``/proc/PID`` before this was then the caller's, its pid not reused."""
        if not self.alive():
            raise _refused(ENDED, hint="Ask again from a process that waits for the answer.")

    def read(self, name: str) -> str:
        """``/proc/PID/NAME`` of the caller (confirmed to be the caller's)."""
        try:
            text = (PROC / str(self.pid) / name).read_text()
        except OSError as exc:
            self.ensure_alive()
            raise _refused(f"the caller's {name} cannot be read ({exc.strerror})") from exc
        self.ensure_alive()
        return text

    def status(self) -> dict[str, str]:
        """The caller's ``/proc/PID/status`` as a mapping."""
        return _parse_status(self.read("status"))

    @contextlib.contextmanager
    def namespaces(self) -> Iterator[dict[str, int]]:
        """Descriptors of the caller's namespaces (:data:`NAMESPACES`), opened while its
        process is proven alive: entering them enters the caller's pod, even if the
        process ends and its pid is reused meanwhile; closed afterwards."""
        fds: dict[str, int] = {}
        try:
            for name in NAMESPACES:
                try:
                    fds[name] = os.open(PROC / str(self.pid) / "ns" / name, os.O_RDONLY)
                except OSError as exc:
                    self.ensure_alive()
                    raise _refused(f"the caller's {name} namespace cannot be opened") from exc
            self.ensure_alive()
            yield fds
        finally:
            for fd in fds.values():
                os.close(fd)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.pidfd)

    def describe(self) -> str:
        name = f"pod {self.pod_name} ({self.pod})" if self.pod_name else f"pod {self.pod}"
        return f"{name} container {self.container[:12]} (pid {self.pid})"


#: The flag of an exiting task in /proc/PID/stat (include/linux/sched.h).
PF_EXITING = 0x4


def _running(pid: int, pidfd: int) -> bool:
    """Whether the process ``pidfd`` names (as ``pid``) runs and is not exiting. Its flags
    are read first, then its pidfd: if it has not ended by then, they were its own (its
    pid cannot have been reused)."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
        flags = int(stat.rsplit(")", 1)[1].split()[6])
    except (OSError, IndexError, ValueError):
        return False
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return not poller.poll(0) and not flags & PF_EXITING


def peer_credentials(conn: socket.socket) -> tuple[int, int]:
    """uid, gid of the peer (SO_PEERCRED: taken by the kernel at connect)."""
    data = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, gid = struct.unpack("3i", data)
    return uid, gid


def peer_pidfd(conn: socket.socket) -> int:
    """A pidfd of the process that connected (SO_PEERPIDFD), or AgentRequestError."""
    try:
        data = conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD, struct.calcsize("i"))
    except OSError as exc:
        raise _refused(f"{ENDED} ({exc.strerror})") from exc
    (pidfd,) = struct.unpack("i", data)
    return int(pidfd)


def pidfd_pid(pidfd: int) -> int:
    """The pid (in this process's PID namespace) a pidfd names: -1 once it was reaped, 0
    if it is not visible here."""
    for line in Path(f"/proc/self/fdinfo/{pidfd}").read_text().splitlines():
        if line.startswith("Pid:"):
            return int(line.split()[1])
    raise OSError(f"descriptor {pidfd} is not a pidfd")


def identify(conn: socket.socket) -> Caller:
    """The caller on ``conn`` with its pod (cheap: /proc only, no subprocess), or
    AgentRequestError if its process ended or is not a container's."""
    pidfd = peer_pidfd(conn)
    try:
        pid = pidfd_pid(pidfd)
        if pid == 0:
            raise _refused("the caller's process is not visible from the node")
        if pid < 0:
            raise _refused(ENDED)
        uid, gid = peer_credentials(conn)
        partial = Caller(pid, uid, gid, pidfd, "", "", "", 0)
        cgroup = partial.read("cgroup")
        pod, container = pod_and_container(cgroup)
        pid_ns = os.stat(PROC / str(pid) / "ns" / "pid").st_ino
        partial.ensure_alive()
        return dataclasses.replace(
            partial, cgroup=cgroup, pod=pod, container=container, pid_ns=pid_ns
        )
    except OSError as exc:
        os.close(pidfd)
        raise _refused(f"the calling process cannot be looked at ({exc})") from exc
    except BaseException:
        os.close(pidfd)
        raise


def named(caller: Caller, pattern: str = DEFAULT_OWNER_PATTERN) -> Caller:
    """``caller`` with its pod's name and user, or AgentRequestError if the name is not a
    user pod's (``pattern``, with a group ``owner``) or may not be unique."""
    hostname = pod_hostname(caller)
    match = re.fullmatch(pattern, hostname)
    if match is None or not match.group("owner"):
        raise _refused(
            f"the caller's pod name {hostname!r} names no owner (pattern {pattern})",
            hint="Name user pods as the agent's --owner-pattern expects (KubeSpawner's "
            "default 'jupyter-{username}').",
        )
    if len(hostname) >= HOSTNAME_MAX:
        raise _refused(
            f"the caller's pod name {hostname!r} is {len(hostname)} characters long: "
            f"Kubernetes cuts longer pod names to {HOSTNAME_MAX} for the hostname, so it "
            "may be another pod's too",
            hint="Use KubeSpawner's 'safe' slug scheme (its default), whose pod names are shorter.",
        )
    return dataclasses.replace(caller, pod_name=hostname, owner=match.group("owner"))


def pod_hostname(caller: Caller) -> str:
    """The hostname of the caller's UTS namespace (its pod's name): read by the agent's
    ``uname`` inside it, entered by a descriptor opened while the caller was alive."""
    with caller.namespaces() as fds:
        uts = fds["uts"]
        out = subprocess.run(
            ["nsenter", f"--uts=/proc/self/fd/{uts}", "--", "uname", "-n"],
            capture_output=True,
            text=True,
            timeout=10,
            pass_fds=[uts],
            check=False,
        )
    if out.returncode != 0:
        raise _refused(f"the caller's pod name cannot be read ({out.stderr.strip()})")
    return out.stdout.strip()


def _parse_status(text: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def status_fields(pid: int, task: int | None = None) -> dict[str, str]:
    """``/proc/PID/status`` (or a thread's, ``/proc/PID/task/TASK/status``) as a mapping."""
    path = PROC / str(pid) / ("status" if task is None else f"task/{task}/status")
    return _parse_status(path.read_text())


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


class CallerTask:
    """A process of the caller's container, pinned by a pidfd (its pid may be used only
    while :meth:`ensure_alive` passes)."""

    def __init__(self, host_pid: int, shown: int) -> None:
        self.pid = host_pid
        self.shown = shown
        try:
            self.pidfd = os.pidfd_open(host_pid)
        except OSError as exc:
            raise _refused(f"process {shown} is gone") from exc

    def alive(self) -> bool:
        return _running(self.pid, self.pidfd)

    def ensure_alive(self) -> None:
        if not self.alive():
            raise _refused(f"process {self.shown} ended during the request")

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.pidfd, signum)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.pidfd)


def in_caller_namespace(caller: Caller, pid: int) -> CallerTask:
    """The process that is ``pid`` in the caller's PID namespace, pinned, or
    AgentRequestError if there is none or it is not in the caller's container."""
    host_pid = find_in_namespace(caller.pid_ns, pid)
    if host_pid is None:
        raise _refused(f"there is no process {pid} in the caller's pod")
    task = CallerTask(host_pid, pid)
    try:
        check_same_container(caller, task)
    except BaseException:
        task.close()
        raise
    return task


def check_same_container(caller: Caller, task: CallerTask) -> None:
    """Refuse a process outside the caller's cgroup, of another uid, or the caller."""
    if task.pid == caller.pid:
        raise _refused("a caller cannot dump itself")
    try:
        cgroup = read_cgroup(task.pid)
        status = status_fields(task.pid)
        pid_ns = os.stat(PROC / str(task.pid) / "ns" / "pid").st_ino
    except (OSError, AgentRequestError) as exc:
        raise _refused(f"process {task.shown} is gone") from exc
    task.ensure_alive()  # what was read is that process's, its pid not reused
    uids = status.get("Uid", "").split()
    if pid_ns != caller.pid_ns or status.get("NSpid", "").split()[-1:] != [str(task.shown)]:
        raise _refused(f"process {task.shown} ended during the request")
    if cgroup != caller.cgroup:
        raise _refused(f"process {task.shown} is not in the caller's container")
    if not uids or any(int(u) != caller.uid for u in uids):
        raise _refused(f"process {task.shown} does not run as the caller's user")


def nsenter_options(fds: Mapping[str, int]) -> list[str]:
    """nsenter's options that enter the namespaces whose descriptors ``fds`` holds (as
    :meth:`Caller.namespaces` opened them; passed to nsenter as ``/proc/self/fd/N``)."""
    return [f"{NAMESPACES[name]}=/proc/self/fd/{fd}" for name, fd in fds.items()]
