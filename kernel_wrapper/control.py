"""The wrapper's private control socket: the server's side of :mod:`jupyter_ext.core.protocol`.

One request per connection, a JSON line ``{"op", "args"}``; the answer is zero or more
progress events, then ``{"ok": true, "result"}`` or ``{"ok": false, "error"}``, each a
JSON line. Arguments are parsed into the operation's dataclass before its handler runs,
so a handler never sees an unknown or missing field.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from jupyter_ext.core import private
from jupyter_ext.core.errors import SnapshotError
from jupyter_ext.core.protocol.control import OPERATIONS, socket_path
from jupyter_ext.core.protocol.progress import ProgressCallback, ProgressEvent

log = logging.getLogger("kernel_wrapper")

Handler = Callable[[ProgressCallback, Any], Awaitable[Any]]
"""An operation: called with a progress callback and the parsed arguments."""


class ControlServer:
    """Serves ``handlers`` (operation name to handler) on a unix socket at ``path``, which
    only this user may open (mode 0600); a connection from another user (a looser mode,
    a copied path) is closed unanswered (its SO_PEERCRED)."""

    def __init__(self, path: Path, handlers: Mapping[str, Handler]) -> None:
        unknown = set(handlers) - set(OPERATIONS)
        if unknown:
            raise ValueError(f"operations the protocol does not define: {sorted(unknown)}")
        self.path = path
        self.handlers = dict(handlers)
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        with socket_path(self.path) as address:
            self._server = await asyncio.start_unix_server(self._serve, path=address)
        os.chmod(self.path, 0o600)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        def send(message: dict[str, Any]) -> None:
            writer.write(json.dumps(message).encode() + b"\n")

        sock = writer.get_extra_info("socket")
        if sock is None or not private.trusted_peer(sock):
            log.warning("refused a control connection from another user")
            writer.close()
            return

        try:
            request = json.loads(await reader.readline())
            if not isinstance(request, dict):
                raise ValueError("a request is a JSON object")
            op = request.get("op")
            if op not in self.handlers:
                raise SnapshotError(f"Unknown control operation {op!r}.")
            args = OPERATIONS[op].from_json(request.get("args") or {})

            def progress(event: ProgressEvent) -> None:
                send({"event": "progress", **event})

            result = await self.handlers[op](progress, args)
            send({"ok": True, "result": result})
        except SnapshotError as exc:
            send({"ok": False, "error": exc.to_dict()})
        except (ValueError, TypeError) as exc:
            send({"ok": False, "error": SnapshotError(f"Bad control request: {exc}").to_dict()})
        except Exception as exc:
            log.exception("control request failed")
            send({"ok": False, "error": SnapshotError(f"Internal error: {exc!r}").to_dict()})
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()
