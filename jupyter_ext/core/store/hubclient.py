"""A user server's side of the product's hub service (jupyter_ext/hubservice): its S3
requests signed by the service, and its user's key-encryption key. Both authenticate
with the server's own hub token (``JUPYTERHUB_API_TOKEN``), which reaches only that user's
prefix and key."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from typing import Any

from .api import StoreError
from .scope import EMPTY_SHA256

TOKEN_ENV = "JUPYTERHUB_API_TOKEN"
"""The server's own hub token, which JupyterHub sets in its environment."""

_HINT = (
    "Check that the hub service {url} runs (c.JupyterHub.services, docs/jupyterhub.md) and "
    "that this server's token may use it (the hub's server role needs "
    "access:services!service=<its name>)."
)


class HubClient:
    """Requests to the service, over a pool of kept-alive connections."""

    def __init__(self, service_url: str, token: str, timeout: float = 15) -> None:
        import urllib3

        if not token:
            raise StoreError(
                "No hub token: the hub service authenticates this server by its token.",
                hint="Run the server under JupyterHub (which sets JUPYTERHUB_API_TOKEN), or "
                "clear hub_service_url to use boto3's own credentials.",
            )
        self.url = service_url.rstrip("/") + "/"
        self._token = token
        retries = urllib3.Retry(total=3, backoff_factor=0.2, allowed_methods=None)
        self._pool = urllib3.PoolManager(maxsize=16, retries=retries, timeout=timeout)

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        import urllib3

        headers = {"Authorization": f"token {self._token}", "Content-Type": "application/json"}
        data = json.dumps(body).encode() if body is not None else None
        try:
            response = self._pool.request(method, self.url + path, body=data, headers=headers)
        except urllib3.exceptions.HTTPError as exc:
            raise StoreError(
                f"The hub service {self.url} did not answer: {exc}",
                hint=_HINT.format(url=self.url),
            ) from exc
        try:
            answer = json.loads(response.data)
        except ValueError:
            answer = {"message": response.data[:200].decode(errors="replace")}
        if response.status != 200:
            raise StoreError(
                f"The hub service {self.url} refused {path} ({response.status}): "
                f"{answer.get('message', '')}",
                hint=_HINT.format(url=self.url),
            )
        return answer


def _body_bytes(body: Any) -> bytes:
    """The bytes a request will send: botocore wraps a bytes body in a seekable stream,
    read here and rewound."""
    if body is None:
        return b""
    if isinstance(body, bytes | bytearray | memoryview):
        return bytes(body)
    if hasattr(body, "seek") and hasattr(body, "tell"):
        start = body.tell()
        data: bytes = body.read()
        body.seek(start)
        return data
    raise StoreError(
        f"An S3 request body of type {type(body).__name__} cannot be signed by the hub service.",
        hint="Report this: the store sends every body as bytes.",
    )


class HubSigner:
    """botocore's ``before-sign`` hook for a client made with ``signature_version=UNSIGNED``:
    asks the service to sign each request as it goes out (botocore re-signs each retry)."""

    def __init__(self, client: HubClient) -> None:
        self.client = client

    def __call__(self, request: Any, **_: Any) -> None:
        body = _body_bytes(request.body)
        ask: dict[str, Any] = {
            "method": request.method,
            "url": request.url,
            "headers": {
                k: v if isinstance(v, str) else v.decode() for k, v in request.headers.items()
            },
            "payload_sha256": hashlib.sha256(body).hexdigest() if body else EMPTY_SHA256,
        }
        signed = self.client.call("POST", "sign", ask)["headers"]
        for name, value in signed.items():
            if name in request.headers:
                del request.headers[name]
            request.headers[name] = value


def signing_client(
    service_url: str,
    token: str,
    endpoint_url: str | None,
    region: str | None,
    max_workers: int,
) -> Any:
    """An S3 client that holds no credentials: the hub service signs each request."""
    import boto3
    import botocore
    from botocore.config import Config

    client = boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=region or "us-east-1",
        config=Config(
            signature_version=botocore.UNSIGNED,
            # No default CRC checksums: on HTTPS botocore would stream them as a trailer,
            # a body the service could not hash.
            request_checksum_calculation="when_required",
            max_pool_connections=max_workers + 4,
            retries={"mode": "standard", "max_attempts": 3},
            connect_timeout=10,
            read_timeout=60,
        ),
    )
    client.meta.events.register("before-sign.s3", HubSigner(HubClient(service_url, token)))
    return client


class HubKeySource:
    """The user's key-encryption key from the hub service (a ``KeySource``): derived there
    from the hub's secret and the user's name; older keys, still accepted to unwrap, after
    the hub's admin rotated the secret. Asked once, then again after ``max_age`` seconds."""

    def __init__(self, client: HubClient, max_age: float = 300) -> None:
        self.client = client
        self.max_age = max_age
        self._lock = threading.Lock()
        self._keys: tuple[float, tuple[str, bytes], list[tuple[str, bytes]]] | None = None

    def __str__(self) -> str:
        return f"the hub service {self.client.url}"

    def _fetch(self) -> tuple[tuple[str, bytes], list[tuple[str, bytes]]]:
        with self._lock:
            if self._keys is None or time.monotonic() - self._keys[0] > self.max_age:
                current, previous = keys_of(self.client.call("GET", "key"))
                self._keys = (time.monotonic(), current, previous)
            return self._keys[1], self._keys[2]

    def current(self) -> tuple[str, bytes]:
        return self._fetch()[0]

    def previous(self) -> list[tuple[str, bytes]]:
        return self._fetch()[1]


def keys_of(answer: dict[str, Any]) -> tuple[tuple[str, bytes], list[tuple[str, bytes]]]:
    """The current and previous keys of the service's ``GET key`` answer."""

    def decode(entry: dict[str, str]) -> tuple[str, bytes]:
        return entry["id"], base64.b64decode(entry["key"])

    return decode(answer["current"]), [decode(e) for e in answer["previous"]]
