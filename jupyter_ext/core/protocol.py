"""The wrapper's private control protocol: JSON lines over a unix socket.

A request is one line ``{"op": ..., "args": {...}}``. The wrapper answers with any number
of ``{"event": "progress", ...}`` lines, then one final line: ``{"ok": true, "result": ...}``
or ``{"ok": false, "error": {...}}`` (a serialized :class:`SnapshotError`).

The socket lives in a directory only the kernel's user can enter; its path is written
to ``snapshot-wrapper-<connection file name>`` next to the kernel's connection file.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import SnapshotError, WrapperUnavailableError

INFO_PREFIX = "snapshot-wrapper-"
#: Where wrappers make their private directories (JUPYTER_SNAPSHOT_RUNTIME_DIR overrides).
DEFAULT_RUNTIME_ROOT = Path(
    os.environ.get("JUPYTER_SNAPSHOT_RUNTIME_DIR")
    or (
        "/run/jupyter-kernel-snapshots"
        if os.geteuid() == 0
        else f"/tmp/jupyter-kernel-snapshots-{os.geteuid()}"
    )
)
ProgressCallback = Callable[[dict[str, Any]], None]


def info_path(connection_file: Path) -> Path:
    """Where the wrapper of the kernel with ``connection_file`` describes itself."""
    return connection_file.with_name(INFO_PREFIX + connection_file.name)


@dataclass(frozen=True)
class WrapperInfo:
    control: Path
    pid: int

    @classmethod
    def for_connection_file(cls, connection_file: Path) -> WrapperInfo:
        path = info_path(connection_file)
        try:
            data = json.loads(path.read_text())
            return cls(Path(data["control"]), int(data["pid"]))
        except (OSError, ValueError, KeyError) as exc:
            raise WrapperUnavailableError(
                f"The kernel with connection file {connection_file} is not a snapshot kernel "
                "(it was not started through kernel_wrapper).",
                hint="Start the notebook's kernel with the 'Python 3 (snapshots)' kernel.",
            ) from exc

    def write(self, connection_file: Path) -> None:
        path = info_path(connection_file)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"control": str(self.control), "pid": self.pid}))
        os.replace(tmp, path)


class WrapperClient:
    """Talks to one kernel wrapper over its control socket."""

    def __init__(self, control: Path) -> None:
        self.control = control

    async def request(
        self,
        op: str,
        args: dict[str, Any] | None = None,
        on_progress: ProgressCallback | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Send one request; call ``on_progress`` for each progress event; return the result."""
        try:
            reader, writer = await asyncio.open_unix_connection(str(self.control), limit=1 << 24)
        except OSError as exc:
            raise WrapperUnavailableError(
                f"The kernel wrapper's control socket {self.control} does not answer ({exc}).",
                hint="The kernel has stopped; restart it or restore a snapshot into a new one.",
            ) from exc
        try:
            writer.write(json.dumps({"op": op, "args": args or {}}).encode() + b"\n")
            await writer.drain()
            return await asyncio.wait_for(self._read_answer(reader, on_progress), timeout)
        finally:
            writer.close()

    @staticmethod
    async def _read_answer(
        reader: asyncio.StreamReader, on_progress: ProgressCallback | None
    ) -> Any:
        while True:
            line = await reader.readline()
            if not line:
                raise WrapperUnavailableError(
                    "The kernel wrapper closed the control connection without an answer.",
                    hint="The kernel may have died; check the server log.",
                )
            message = json.loads(line)
            if "event" in message:
                if on_progress is not None:
                    on_progress(message)
                continue
            if message.get("ok"):
                return message.get("result")
            raise SnapshotError.from_dict(message.get("error", {}))

    def request_sync(
        self,
        op: str,
        args: dict[str, Any] | None = None,
        on_progress: ProgressCallback | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Blocking form of :meth:`request`, for the CLI and tests."""
        return asyncio.run(self.request(op, args, on_progress, timeout))
