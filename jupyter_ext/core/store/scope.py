"""One user's part of an S3 bucket, and the signing of requests that stay inside it.

Under a hub no user's server holds bucket credentials: the product's hub service
(``jupyter_ext.hubservice``) holds them and signs (AWS SigV4, header form) each S3 request
a server sends it, after :meth:`UserScope.check` found that the request reaches only that
user's prefix. The signature covers the method, host, path, query, every header that
matters and the payload's hash, so a signed request cannot be turned into another one
where the S3 server checks all of that; S3 refuses it after about 15 minutes (its
clock-skew window).

Only what the store does is signed: reading, writing (optionally ``If-None-Match``),
deleting one object (the key in the signed path), listing under the prefix. Nothing whose
effect depends on a body is signed (DeleteObjects names its keys in a body, which some S3
servers do not hash against the signature: tests/test_hub_redteam.py), and every body is
bound by its SHA-256 (no ``UNSIGNED-PAYLOAD``). Copying (``x-amz-copy-source``), ACLs,
multipart uploads, versions and every bucket-level request are refused, so is any
``x-amz-*`` header not on the list. Where the S3 server acts on ``x-amz-*`` headers added
*unsigned* beside a signed request (found by the service's probe, core/store/probe.py),
every PUT is signed with :data:`LAX_SERVER_GUARDS`, which turn the known cross-user uses of
such headers into refusals.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from .api import StoreError

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
LAX_SERVER_GUARDS = {
    "x-amz-copy-source-if-match": '"jks-guard-matches-no-object"',
    "x-amz-meta-snowball-auto-extract": "false",
}
"""Signed into every PUT where the S3 server acts on unsigned ``x-amz-*`` headers: an
``x-amz-copy-source`` added unsigned (a PUT into the user's prefix turned into a copy of
another user's object) meets a copy condition no object's ETag matches, and a
``X-Amz-Meta-Snowball-Auto-Extract: true`` added unsigned (MinIO's tar extraction, which
writes the archive's entries anywhere in the bucket) makes a second value of a signed
header, which breaks the signature. Whether they hold is probed (core/store/probe.py)."""

_SIGNED_HEADERS = {
    "content-type",
    "content-length",
    "content-md5",
    "range",
    "if-none-match",
    "if-match",
    "x-amz-content-sha256",
    "x-amz-server-side-encryption",
    "x-amz-server-side-encryption-aws-kms-key-id",
    "x-amz-sdk-checksum-algorithm",
    "x-amz-checksum-mode",
    "x-amz-checksum-crc32",
    "x-amz-checksum-crc32c",
    "x-amz-checksum-crc64nvme",
    "x-amz-checksum-sha1",
    "x-amz-checksum-sha256",
}
"""Headers the service signs; any other x-amz-* header is refused (copy sources, ACL
grants, tagging, ...), other headers (user agent, SDK ids) are left unsigned."""
_REPLACED_HEADERS = {"x-amz-date", "authorization", "x-amz-security-token"}
"""Headers the service itself sets."""
_LIST_QUERY = {
    "list-type",
    "prefix",
    "start-after",
    "continuation-token",
    "max-keys",
    "encoding-type",
    "delimiter",
}
_OBJECT_IDS = {
    "GET": "GetObject",
    "HEAD": "HeadObject",
    "PUT": "PutObject",
    "DELETE": "DeleteObject",
}


SAFE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""User names that are their own part of a store's path: letters, digits, ``.``, ``_``,
``-``, beginning with a letter or digit (so never ``.``, ``..`` or a name that begins with
the escape marker ``_``)."""
MAX_NAME_CHARS = 100
"""The longest part a user's name becomes (well under a file name's 255 bytes)."""
_KEPT = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789.-")


def user_part(username: str) -> str:
    """A user's own name in the store: one path segment, different for every name.

    A safe name (:data:`SAFE_NAME_RE`, at most :data:`MAX_NAME_CHARS`) is itself. Any
    other name is ``_`` followed by its UTF-8 bytes, every byte but letters, digits, ``.``
    and ``-`` written ``_xx`` (hex): ``a@b.c`` is ``_a_40b.c``, ``a_b`` stays ``a_b``, the
    empty name is ``_``. Safe names never begin with ``_`` and the escapes decode one way
    only, so no two names meet. Where that form would be longer than MAX_NAME_CHARS, the
    name's sha256 (hex), ``_`` and the escaped form, cut to MAX_NAME_CHARS + 1 characters:
    the only forms of that length, and two of them meet only if sha256 does."""
    if len(username) <= MAX_NAME_CHARS and SAFE_NAME_RE.fullmatch(username):
        return username
    escaped = "_" + "".join(
        chr(b) if b in _KEPT else f"_{b:02x}" for b in username.encode("utf-8", "surrogatepass")
    )
    if len(escaped) <= MAX_NAME_CHARS:
        return escaped
    digest = hashlib.sha256(username.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{digest}_{escaped}"[: MAX_NAME_CHARS + 1]


def user_prefix(username: str) -> str:
    """The store prefix of a user (``users/<part>``, :func:`user_part`): from the server's
    identity, safe as a path and an S3 key, and never another user's."""
    return f"users/{user_part(username)}"


@dataclass(frozen=True)
class SignRequest:
    """What a user's server asks the service to sign: the request as it will be sent."""

    method: str
    url: str
    headers: dict[str, str]
    payload_sha256: str

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SignRequest:
        try:
            method, url = str(data["method"]).upper(), str(data["url"])
            headers = {str(k): str(v) for k, v in dict(data["headers"]).items()}
            payload = str(data["payload_sha256"])
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreError(
                f"A malformed signing request: {exc!r}.",
                hint="Send method, url, headers and payload_sha256 (the hub service's client "
                "in jupyter_ext.core.store.hubclient does).",
            ) from exc
        return cls(method, url, headers, payload)

    def to_dict(self) -> dict[str, Any]:
        """What :meth:`from_dict` reads (the service's ``POST sign`` body)."""
        return {
            "method": self.method,
            "url": self.url,
            "headers": self.headers,
            "payload_sha256": self.payload_sha256,
        }


@dataclass(frozen=True)
class UserScope:
    """``s3://bucket/<base>/users/<name>/`` behind ``endpoint_url`` (empty: AWS)."""

    bucket: str
    base: str
    user: str
    endpoint_url: str = ""
    region: str = "us-east-1"

    @property
    def prefix(self) -> str:
        return "/".join(p for p in (self.base.strip("/"), user_prefix(self.user)) if p) + "/"

    def hosts(self) -> tuple[set[str], set[str]]:
        """The hosts of path-style URLs (``/bucket/key``) and of virtual-host ones."""
        if self.endpoint_url:
            path_hosts = {urlsplit(self.endpoint_url).netloc.lower()}
        else:
            path_hosts = {"s3.amazonaws.com", f"s3.{self.region}.amazonaws.com"}
        return path_hosts, {f"{self.bucket}.{host}".lower() for host in path_hosts}

    def _refuse(self, request: SignRequest, why: str, target: str = "") -> StoreError:
        """The refusal, naming what was asked once: ``target`` (``s3://bucket/key``, the
        key decoded) where the URL was read that far, else the URL as sent."""
        return StoreError(
            f"Refused to sign {request.method} {target or request.url} for {self.user}: {why}.",
            hint=f"A server of {self.user} may only reach s3://{self.bucket}/{self.prefix}.",
        )

    def check(self, request: SignRequest) -> None:
        """Raise StoreError unless ``request`` is one the store makes, inside the prefix."""
        url = urlsplit(request.url)
        path_hosts, virtual_hosts = self.hosts()
        host = url.netloc.lower()
        raw_path = url.path
        if host in path_hosts:
            bucket, _, raw_key = raw_path.lstrip("/").partition("/")
            bucket = unquote(bucket)
        elif host in virtual_hosts:
            bucket, raw_key = self.bucket, raw_path.lstrip("/")
        else:
            raise self._refuse(request, f"the host {url.netloc} is not the store's endpoint")
        key = unquote(raw_key)
        target = f"s3://{bucket}/{key}" + (f"?{unquote(url.query)}" if url.query else "")
        if bucket != self.bucket:
            raise self._refuse(request, "that bucket is not the store's", target)
        query = parse_qsl(url.query, keep_blank_values=True)
        names = [name for name, _ in query]
        if len(set(names)) != len(names):
            raise self._refuse(request, "a query parameter is repeated", target)
        params = dict(query)
        for name in request.headers:
            lower = name.lower()
            if lower.startswith("x-amz-") and lower not in _SIGNED_HEADERS | _REPLACED_HEADERS:
                raise self._refuse(request, f"the header {name} is not one the store sends", target)
        if not re.fullmatch(r"[0-9a-f]{64}", request.payload_sha256):
            raise self._refuse(
                request,
                "payload_sha256 is not a SHA-256 hex digest (the body is always bound by its "
                "hash, never UNSIGNED-PAYLOAD)",
                target,
            )
        if request.method == "GET" and not raw_key and params.get("list-type") == "2":
            if unknown := sorted(set(params) - _LIST_QUERY):
                raise self._refuse(request, f"listing parameters {unknown}", target)
            if not params.get("prefix", "").startswith(self.prefix):
                raise self._refuse(request, "a listing outside the user's prefix", target)
            return
        if request.method == "POST" and not raw_key and "delete" in params:
            raise self._refuse(
                request,
                "DeleteObjects names its keys in the body, which not every S3 server checks "
                "against the signature; the store deletes one object at a time",
                target,
            )
        if request.method not in _OBJECT_IDS:
            raise self._refuse(request, f"the method {request.method}", target)
        if (
            set(params) - {"x-id"}
            or params.get("x-id", _OBJECT_IDS[request.method]) != (_OBJECT_IDS[request.method])
        ):
            raise self._refuse(request, f"query parameters {sorted(params)}", target)
        if not key.startswith(self.prefix) or len(key) == len(self.prefix):
            raise self._refuse(request, "that key is outside the user's prefix", target)
        parts = key.split("/")
        if any(part in ("", ".", "..") for part in parts) or any(ord(c) < 32 for c in key):
            raise self._refuse(request, "that key is not a plain path", target)


def sign(
    request: SignRequest,
    credentials: Any,
    region: str,
    *,
    extra: Mapping[str, str] | None = None,
    when: datetime | None = None,
) -> dict[str, str]:
    """The headers that make ``request`` a signed S3 request (SigV4, header form):
    Authorization, X-Amz-Date, X-Amz-Content-SHA256, with temporary credentials
    X-Amz-Security-Token, and ``extra`` (headers the service adds and signs: the guards of
    a lax server). ``credentials`` are botocore's (frozen) credentials; ``when``: the
    signature's time (now; the probe signs one in the past to see if the server takes it)."""
    from botocore.auth import SIGV4_TIMESTAMP, S3SigV4Auth
    from botocore.awsrequest import AWSRequest

    class ClientPayload(S3SigV4Auth):  # type: ignore[misc]  # botocore has no types
        """Signs the payload hash the client computed (the service never sees a body)."""

        def payload(self, request: AWSRequest) -> str:
            return str(request.context["payload_sha256"])

        def canonical_request(self, request: AWSRequest) -> str:
            """A signature made at ``when``: its date set before anything is hashed."""
            if when is not None:
                request.context["timestamp"] = when.strftime(SIGV4_TIMESTAMP)
                del request.headers["X-Amz-Date"]
                request.headers["X-Amz-Date"] = request.context["timestamp"]
            return str(super().canonical_request(request))

    signed = _SIGNED_HEADERS - {"x-amz-content-sha256"}
    headers = {k: v for k, v in request.headers.items() if k.lower() in signed}
    headers.update(extra or {})
    aws = AWSRequest(method=request.method, url=request.url, headers=headers)
    aws.context["payload_sha256"] = request.payload_sha256
    ClientPayload(credentials, "s3", region).add_auth(aws)
    wanted = ["Authorization", "X-Amz-Date", "X-Amz-Content-SHA256", "X-Amz-Security-Token"]
    return {
        name: str(aws.headers[name]) for name in [*wanted, *(extra or {})] if name in aws.headers
    }
