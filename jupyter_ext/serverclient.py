"""The REST API of a running Jupyter server with the extension, as the CLI and the tests
call it (token auth, blocking), and a job's progress on one terminal line."""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from .core.errors import SnapshotError
from .core.humanize import human_bytes
from .core.protocol.progress import ProgressEvent


class ServerClient:
    """The REST API of a running Jupyter server (token auth), with blocking calls."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url.rstrip("/") + "/"
        self.token = token

    @classmethod
    def find(cls, url: str = "", token: str = "") -> ServerClient:
        """The server at ``url``, or the one running server this user has."""
        if url:
            return cls(url, token)
        from jupyter_server.serverapp import list_running_servers

        servers = list(list_running_servers())
        if not servers:
            raise SnapshotError(
                "No running Jupyter server was found.",
                hint="Start one (jupyter lab), or pass --url and --token, or use --store-dir "
                "/ --s3-bucket to work on a store directly.",
            )
        if len(servers) > 1:
            urls = ", ".join(str(s["url"]) for s in servers)
            raise SnapshotError(
                f"Several Jupyter servers are running ({urls}).", hint="Choose one with --url."
            )
        return cls(str(servers[0]["url"]), token or str(servers[0].get("token", "")))

    def call(self, method: str, resource: str, body: Any = None, **params: str) -> Any:
        """``METHOD /api/snapshots/<resource>?params``; errors come back as SnapshotError."""
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v})
        target = self.url + "api/snapshots" + (f"/{resource}" if resource else "")
        request = urllib.request.Request(
            target + (f"?{query}" if query else ""),
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                data = response.read()
        except urllib.error.HTTPError as exc:
            with exc:  # the error response holds the connection until closed
                try:
                    error = json.loads(exc.read())
                except ValueError:
                    error = {"message": str(exc)}
            raise SnapshotError.from_dict(error) from None
        except OSError as exc:
            raise SnapshotError(
                f"The Jupyter server at {self.url} does not answer ({exc}).",
                hint="Check the URL, or that the server runs.",
            ) from exc
        return json.loads(data) if data else None

    def follow(self, job: dict[str, Any]) -> dict[str, Any]:
        """Poll a job to its end, showing its progress on one terminal line."""
        with ProgressLine(job["kind"]) as line:
            while job["status"] == "running":
                line.show(job["phase"], job.get("done_bytes", 0), job.get("total_bytes", 0))
                time.sleep(0.2)
                job = self.call("GET", f"jobs/{job['id']}")
        if job["status"] == "failed":
            raise SnapshotError.from_dict(job["error"] or {})
        return job


class ProgressLine:
    """A job's progress on one line of the terminal (stderr), rewritten as it changes."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.shown = ""

    def __enter__(self) -> ProgressLine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.shown:
            print(file=sys.stderr)

    def show(self, phase: str, done: int = 0, total: int = 0) -> None:
        line = f"  {self.kind}: {phase}"
        if total:
            line += f" {human_bytes(done)} / {human_bytes(total)} ({done * 100 // total}%)"
        if line != self.shown:
            print(f"\r{line:<72}", end="", file=sys.stderr, flush=True)
            self.shown = line

    def event(self, event: ProgressEvent) -> None:
        """As a store's progress callback."""
        self.show(event["phase"], event.get("done_bytes", 0), event.get("total_bytes", 0))
