"""CRIU through the node agent: what a kernel wrapper uses in a pod at baseline.

The wrapper's dumps and restores call :class:`AgentCriu` exactly as they call
:class:`~jupyter_ext.core.criu.Criu`; it asks the node agent instead of running CRIU.
A dump's images come back as descriptors of the agent's files and are copied into the
snapshot's images directory, with the agent's seal beside them (:data:`SEAL_FILE`); a
restore hands the agent those files and the seal, and the descriptors the restored
kernel inherits (its output pipe, its runtime directory). What the agent cannot do for
a pod (lazy restore, a network namespace of its own, connections kept with TCP repair,
/dev/shm files copied while frozen) is refused here, saying so, before anything starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..criu import Criu, LazyTransfer, parse_version
from ..errors import DumpError, RestoreError, SnapshotError
from ..lazypages import PageSource
from .protocol import (
    AgentUnavailableError,
    DumpRequest,
    HelloRequest,
    RestoreRequest,
    _Request,
    encode_request,
    receive,
    receive_more,
    send,
)

if TYPE_CHECKING:
    from ..isolation.netns import OwnNetwork

#: In a snapshot's images directory: the agent's seal and the files it covers.
SEAL_FILE = "agent-seal.json"
#: How long one request to the agent may take (a dump of a large kernel, its copy).
REQUEST_TIMEOUT = 1800.0


def _not_through_agent(what: str, error: type[SnapshotError]) -> SnapshotError:
    return error(
        f"This kernel needs {what}, which the node agent does not do.",
        hint="Run the user pods in in-pod mode (deploy/z2jh/inpod.yaml) for such kernels "
        "(docs/agent.md, 'What agent mode does not do').",
    )


def call(socket_path: Path, request: _Request, fds: Sequence[int] = ()) -> tuple[Any, list[int]]:
    """One request to the agent: its result and the descriptors that came with it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(REQUEST_TIMEOUT)
    try:
        try:
            sock.connect(str(socket_path))
        except OSError as exc:
            raise AgentUnavailableError(
                f"The node agent's socket {socket_path} does not answer ({exc.strerror}).",
                hint="Check that the agent's DaemonSet runs on this node and the pod mounts "
                "its CSI volume (docs/agent.md).",
            ) from exc
        message = json.loads(encode_request(request))
        message.pop("v")
        send(sock, message, fds)
        data, received = receive(sock)
        if not data:
            raise AgentUnavailableError(
                "The node agent closed the connection without an answer (it was stopped or "
                "restarted during the request).",
                hint="Retry once the agent runs again; the kernel was left as it was.",
            )
        reply = json.loads(data)
        if not reply.get("ok"):
            for fd in received:
                os.close(fd)
            raise SnapshotError.from_dict(reply.get("error", {}))
        result = reply.get("result", {})
        count = len(result.get("files", [])) if isinstance(result, dict) else 0
        if isinstance(request, DumpRequest):
            received += receive_more(sock, count - len(received))
        return result, received
    except (TimeoutError, ConnectionError) as exc:
        raise AgentUnavailableError(
            f"The node agent went away during the request ({exc}).",
            hint="Retry once the agent runs again; the kernel was left as it was.",
        ) from exc
    finally:
        sock.close()


class AgentCriu(Criu):
    """CRIU as the node agent on ``path`` (its socket) runs it."""

    @classmethod
    def connect(cls, socket_path: Path) -> AgentCriu:
        """The agent on ``socket_path``, once it answered (its CRIU's version)."""
        hello, _ = call(socket_path, HelloRequest())
        version = parse_version(f"Version: {hello['criu_version']}") or (0,)
        return cls(socket_path, version, f"node agent (owner {hello['owner']})")

    def supports_lazy_pages(self) -> tuple[bool, str]:
        return False, "lazy restore does not go through the node agent"

    async def dump(
        self,
        pid: int,
        images_dir: Path,
        work_dir: Path,
        *,
        leave_running: bool,
        externals: Sequence[str] = (),
        keep_tcp: bool = False,
        ghost_limit: int = 0,
        action_script: str | None = None,
        netns: OwnNetwork | None = None,
    ) -> float:
        if keep_tcp or netns is not None:
            raise _not_through_agent("connections kept with their state", DumpError)
        if action_script is not None:
            raise _not_through_agent("its /dev/shm files or logs copied while frozen", DumpError)
        request = DumpRequest(
            pid=pid, leave_running=leave_running, externals=list(externals), ghost_limit=ghost_limit
        )
        result, fds = await asyncio.to_thread(call, self.path, request)
        try:
            await asyncio.to_thread(_copy_out, fds, result["files"], images_dir)
        finally:
            for fd in fds:
                os.close(fd)
        seal = {"seal": result["seal"], "files": result["files"]}
        (images_dir / SEAL_FILE).write_text(json.dumps(seal))
        return float(result["frozen_seconds"])

    async def restore(
        self,
        images_dir: Path,
        work_dir: Path,
        *,
        inherit_fds: Sequence[tuple[int, str]] = (),
        keep_tcp: bool = False,
        mounts: Sequence[str] = (),
        mount_sources: Mapping[str, str] | None = None,
        netns: OwnNetwork | None = None,
    ) -> int:
        if keep_tcp or netns is not None:
            raise _not_through_agent("connections kept with their state", RestoreError)
        if mounts:
            raise _not_through_agent("a mount namespace of its own", RestoreError)
        try:
            seal = json.loads((images_dir / SEAL_FILE).read_text())
        except (OSError, ValueError) as exc:
            raise RestoreError(
                "This snapshot was not taken through the node agent (it has no seal), and "
                "the agent restores only images it sealed.",
                hint="Restore it in a pod in in-pod mode (deploy/z2jh/inpod.yaml).",
            ) from exc
        files: list[str] = seal["files"]
        request = RestoreRequest(
            files=files, seal=seal["seal"], inherit=[resource for _, resource in inherit_fds]
        )
        fds: list[int] = []
        try:
            for name in files:
                fds.append(os.open(images_dir / name, os.O_RDONLY | os.O_NOFOLLOW))
            result, _ = await asyncio.to_thread(
                call, self.path, request, [*fds, *(fd for fd, _ in inherit_fds)]
            )
        finally:
            for fd in fds:
                os.close(fd)
        return int(result["pid"])

    async def restore_lazy(
        self,
        images_dir: Path,
        work_dir: Path,
        source: PageSource,
        *,
        write_through: bool,
        kill_tree: Callable[[int], None],
        inherit_fds: Sequence[tuple[int, str]] = (),
        keep_tcp: bool = False,
        mounts: Sequence[str] = (),
        mount_sources: Mapping[str, str] | None = None,
        netns: OwnNetwork | None = None,
    ) -> tuple[int, LazyTransfer]:
        raise _not_through_agent("a lazy restore", RestoreError)


def _copy_out(fds: Sequence[int], names: Sequence[str], images_dir: Path) -> None:
    """The agent's image files into the snapshot's images directory."""
    if len(fds) != len(names):
        raise AgentUnavailableError(
            f"The node agent sent {len(fds)} image files for {len(names)} names.",
            hint="Retry; if it happens again, see the agent's log.",
        )
    for fd, name in zip(fds, names, strict=True):
        if "/" in name or name.startswith("."):
            raise AgentUnavailableError(f"The node agent named an image {name!r}.")
        out = os.open(images_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            size = os.fstat(fd).st_size
            offset = 0
            while offset < size:
                sent = os.copy_file_range(fd, out, size - offset, offset, offset)
                if sent == 0:
                    break
                offset += sent
        finally:
            os.close(out)
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
