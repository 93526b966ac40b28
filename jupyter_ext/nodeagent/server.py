"""The node agent's server: one connection, one request, one reply.

Each connection's caller is identified by the kernel first (core/agent/peers.py); its request
is parsed and checked (core/agent/protocol.py); only then is anything done, and only to the
caller's own processes (``dump``) or with images sealed for the caller's owner
(``restore``, nodeagent/seal.py). Every refusal is answered with an error that names why
and is logged with the pod it came from.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jupyter_ext.core import proctree
from jupyter_ext.core.agent import peers
from jupyter_ext.core.agent.protocol import (
    SOCKET_NAME,
    VERSION,
    AgentRequestError,
    DumpRequest,
    HelloRequest,
    RestoreRequest,
    parse_request,
    receive,
    receive_more,
    send,
)
from jupyter_ext.core.criu import DEFAULT_GHOST_LIMIT, TCP_DUMP_OPTIONS, Criu
from jupyter_ext.core.criu.log import explain_failure, frozen_seconds, log_excerpt
from jupyter_ext.core.errors import (
    DumpError,
    IncompatibleSnapshotError,
    RestoreError,
    SnapshotError,
)

from .podcriu import PodCriu, cgroup_procs_files
from .seal import Sealer, copy_in, hash_file

log = logging.getLogger("jupyter_ext.nodeagent")

#: What a restored process must share with the pod that asked for it (/proc/PID/status):
#: its credentials, capabilities, no_new_privs and seccomp filter (CRIU restores them from
#: the images; a mismatch means images of another kind of pod).
MATCHING_STATUS = (
    "Uid",
    "Gid",
    "Groups",
    "CapInh",
    "CapPrm",
    "CapEff",
    "CapBnd",
    "CapAmb",
    "NoNewPrivs",
    "Seccomp",
    "Seccomp_filters",
)


class Agent:
    """Serves dumps and restores on ``socket_dir``/agent.sock; keeps its work under
    ``state_dir`` (root's alone)."""

    def __init__(
        self,
        socket_dir: Path,
        state_dir: Path,
        sealer: Sealer,
        criu: Criu,
        owner_pattern: str = peers.DEFAULT_OWNER_PATTERN,
    ) -> None:
        self.socket_path = socket_dir / SOCKET_NAME
        self.state_dir = state_dir
        self.sealer = sealer
        self.criu = criu
        self.pod_criu = PodCriu(criu.path, state_dir / "bin")
        self.owner_pattern = owner_pattern
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(state_dir, 0o700)
        for leftover in state_dir.glob("*-*"):
            # What an agent that was killed during a request left (its caller got an error).
            shutil.rmtree(leftover, ignore_errors=True)
        socket_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(socket_dir, 0o755)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(str(self.socket_path))
        # Anyone on the node may connect: who may do what is decided per caller.
        os.chmod(self.socket_path, 0o666)
        self.sock.listen(64)
        proctree.set_subreaper(True)

    def serve_forever(self) -> None:
        log.info("node agent listening on %s (protocol %d)", self.socket_path, VERSION)
        while True:
            conn, _ = self.sock.accept()
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        caller: peers.Caller | None = None
        fds: list[int] = []
        try:
            # Read before answering anything: a reply to a caller whose request is unread
            # would be lost to a reset connection.
            data, fds = receive(conn)
            caller = peers.identify(conn, self.owner_pattern)
            request = parse_request(data, len(fds))
            fds += receive_more(conn, request.expected_fds() - len(fds))
            result, out_fds = self._dispatch(caller, request, fds)
            try:
                send(conn, {"ok": True, "result": result}, out_fds)
            finally:
                for fd in out_fds:
                    os.close(fd)
            log.info("%s: %s done", caller.describe(), request.op)
        except SnapshotError as exc:
            who = caller.describe() if caller else "unidentified caller"
            log.warning("%s: %s", who, exc.message)
            with contextlib.suppress(OSError):
                send(conn, {"ok": False, "error": exc.to_dict()})
        except Exception:
            log.exception("request failed")
            with contextlib.suppress(OSError):
                error = SnapshotError(
                    "The node agent failed on this request.", hint="See the agent's log."
                )
                send(conn, {"ok": False, "error": error.to_dict()})
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            if caller is not None:
                caller.close()
            conn.close()

    def _dispatch(
        self, caller: peers.Caller, request: Any, fds: list[int]
    ) -> tuple[dict[str, Any], list[int]]:
        if isinstance(request, HelloRequest):
            return self.hello(caller), []
        if isinstance(request, DumpRequest):
            return self.dump(caller, request)
        if isinstance(request, RestoreRequest):
            return self.restore(caller, request, fds), []
        raise AgentRequestError(f"The node agent refused the request: no {request.op}.")

    # ------------------------------------------------------------------ operations

    def hello(self, caller: peers.Caller) -> dict[str, Any]:
        return {
            "version": VERSION,
            "criu_version": self.criu.version_text,
            "owner": caller.owner,
            "pod": caller.pod,
            "container": caller.container,
        }

    @contextlib.contextmanager
    def _private_dir(self, kind: str, caller: peers.Caller) -> Iterator[tuple[Path, int, int]]:
        """A new directory of the agent's with ``images`` and ``work``, as descriptors
        CRIU reaches from inside a pod (it runs as the caller's user: they are the
        user's, inside the agent's directory, which no pod can reach); removed
        afterwards."""
        top = self.state_dir / f"{kind}-{secrets.token_hex(8)}"
        (top / "images").mkdir(parents=True, mode=0o700)
        (top / "work").mkdir(mode=0o700)
        for sub in ("images", "work"):
            os.chown(top / sub, caller.uid, caller.gid)
        images = os.open(top / "images", os.O_PATH | os.O_DIRECTORY)
        work = os.open(top / "work", os.O_PATH | os.O_DIRECTORY)
        try:
            yield top, images, work
        finally:
            os.close(images)
            os.close(work)
            shutil.rmtree(top, ignore_errors=True)

    def dump(self, caller: peers.Caller, request: DumpRequest) -> tuple[dict[str, Any], list[int]]:
        """Dump the caller's process ``request.pid``; the images are handed back as
        descriptors with their seal, and nothing of them stays here."""
        peers.in_caller_namespace(caller, request.pid)
        with self._private_dir("dump", caller) as (top, images, work):
            args = ["dump", "-t", str(request.pid), "-D", _fd_path(images)]
            args += ["-W", _fd_path(work), "-o", "dump.log", "-v4", "--file-locks"]
            args += [*TCP_DUMP_OPTIONS]
            args += ["--ghost-limit", str(max(request.ghost_limit, DEFAULT_GHOST_LIMIT))]
            for key in request.externals:
                args += ["--external", key]
            if request.leave_running:
                args.append("--leave-running")
            procs = cgroup_procs_files(caller.cgroup)
            rc, output = self.pod_criu.run(
                caller.pid, (caller.uid, caller.gid), procs, args, [images, work]
            )
            dump_log = top / "work" / "dump.log"
            if rc != 0:
                excerpt = log_excerpt(dump_log, output)
                message, hint = explain_failure(excerpt, restoring=False)
                raise DumpError(message, hint=hint, log_excerpt=excerpt)
            files = [hash_file(path) for path in sorted((top / "images").iterdir())]
            seal = self.sealer.seal(caller.owner, files)
            out_fds = [os.open(top / "images" / f.name, os.O_RDONLY) for f in files]
            return {
                "files": [f.name for f in files],
                "seal": seal,
                "frozen_seconds": frozen_seconds(dump_log),
                "criu_version": self.criu.version_text,
            }, out_fds

    def restore(
        self, caller: peers.Caller, request: RestoreRequest, fds: list[int]
    ) -> dict[str, Any]:
        """Restore images sealed for the caller's owner into the caller's pod; the restored
        process must match the caller's credentials and seccomp filter."""
        files_fds, inherit_fds = fds[: len(request.files)], fds[len(request.files) :]
        with self._private_dir("restore", caller) as (top, images, work):
            copied = [
                copy_in(fd, top / "images" / name, (caller.uid, caller.gid))
                for fd, name in zip(files_fds, request.files, strict=True)
            ]
            self.sealer.check(caller.owner, copied, request.seal)
            args = ["restore", "-D", _fd_path(images), "-W", _fd_path(work)]
            args += ["-o", "restore.log", "-v4", "--file-locks", "--restore-detached"]
            args += ["--tcp-close", "--restore-sibling", "--manage-cgroups=ignore"]
            args += ["--pidfile", f"{_fd_path(work)}/restored.pid"]
            for fd, resource in zip(inherit_fds, request.inherit, strict=True):
                args += ["--inherit-fd", f"fd[{fd}]:{resource}"]
            procs = cgroup_procs_files(caller.cgroup)
            rc, output = self.pod_criu.run(
                caller.pid, (caller.uid, caller.gid), procs, args, [images, work, *inherit_fds]
            )
            if rc != 0:
                excerpt = log_excerpt(top / "work" / "restore.log", output)
                message, hint = explain_failure(excerpt, restoring=True)
                error_cls = (
                    IncompatibleSnapshotError if hint.startswith("incompatible:") else RestoreError
                )
                raise error_cls(
                    message, hint=hint.removeprefix("incompatible:"), log_excerpt=excerpt
                )
            pid = int((top / "work" / "restored.pid").read_text().strip())
        try:
            host_pid = peers.in_caller_namespace(caller, pid)
            self._check_matches(caller, host_pid)
        except BaseException:
            _kill_restored(caller, pid)
            raise
        self._adopt(host_pid)
        return {"pid": pid}

    @staticmethod
    def _check_matches(caller: peers.Caller, host_pid: int) -> None:
        mine = peers.status_fields(caller.pid)
        theirs = peers.status_fields(host_pid)
        for key in MATCHING_STATUS:
            if mine.get(key) != theirs.get(key):
                raise AgentRequestError(
                    f"The node agent undid the restore: the restored kernel's {key} "
                    f"({theirs.get(key)}) is not its pod's ({mine.get(key)}).",
                    hint="Restore snapshots into pods configured as the one that took them.",
                )

    @staticmethod
    def _adopt(host_pid: int) -> None:
        """Reap the restored tree's root when it ends (the agent is its parent now)."""
        if peers.status_fields(host_pid).get("PPid") != str(os.getpid()):
            log.warning("restored process %d is not the agent's child: not reaped here", host_pid)
            return

        def reap() -> None:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(host_pid, 0)

        threading.Thread(target=reap, name=f"reap-{host_pid}", daemon=True).start()


def _fd_path(fd: int) -> str:
    """A descriptor of the agent's as CRIU, inside the pod, reaches it."""
    return f"/proc/self/fd/{fd}"


def _kill_restored(caller: peers.Caller, pid: int) -> None:
    """SIGKILL a tree just restored into the caller's PID namespace as ``pid``."""
    host_pid = peers.find_in_namespace(caller.pid_ns, pid)
    if host_pid is None:
        return
    for task in proctree.descendants(host_pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(task, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(host_pid, 0)
