"""A real S3 endpoint for tests, and a way to break the network to it.

``MotoServer`` runs moto's standalone server as a child process on 127.0.0.1 (it keeps
objects in memory and implements conditional writes). ``CuttableProxy`` forwards TCP to
it; ``cut()`` drops every connection and refuses new ones, as a failed network would,
while the server keeps its objects so a test can look at what was left behind; ``stall()``
accepts connections and never answers, as an overloaded endpoint would.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class MotoServer:
    """``moto_server -H 127.0.0.1 -p PORT``, started and waited for; ``stop()`` ends it."""

    def __init__(self, log_path: Path, timeout: float = 30.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log_path.open("wb")
        moto_server = Path(sys.executable).with_name("moto_server")
        self.process = subprocess.Popen(
            [str(moto_server), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"moto_server did not start: {log_path.read_text()}")
            time.sleep(0.1)

    def ensure_bucket(self, name: str) -> str:
        """Create the bucket ``name`` unless it exists; returns the name."""
        import boto3

        client = boto3.client("s3", endpoint_url=self.url)
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        finally:
            client.close()
        return name

    def enforce_credentials(self, user: str = "store-admin") -> tuple[str, str]:
        """Turn on moto's IAM enforcement: from now on only requests signed with a key of
        an IAM user (or role) whose policy allows them are served; others get 403
        (InvalidAccessKeyId, SignatureDoesNotMatch, AccessDenied). Returns the access key
        of ``user``, made first, with every S3 action on every resource. Make buckets before
        (``ensure_bucket``), or with this key after. moto checks header signatures and the
        users' policies; it does not evaluate STS session policies or presigned URLs, and
        accepts unsigned ``x-amz-*`` headers (AWS refuses them: "HeadersNotSigned")."""
        import json

        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id="before-enforcement",  # any key is accepted until then
            aws_secret_access_key="before-enforcement",
        )
        try:
            iam.create_user(UserName=user)
            policy = {
                "Version": "2012-10-17",
                "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
            }
            iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps(policy))
            key = iam.create_access_key(UserName=user)["AccessKey"]
        finally:
            iam.close()
        request = urllib.request.Request(
            self.url + "/moto-api/reset-auth",
            data=b"0",  # requests served without credentials from now on
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        with urllib.request.urlopen(request, timeout=10):
            pass
        return key["AccessKeyId"], key["SecretAccessKey"]

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/moto-api/", timeout=1):
                return True
        except urllib.error.HTTPError:
            return True  # any HTTP answer means it is serving
        except OSError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
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
