"""A backend in an S3 bucket: one PUT a file, ranged GETs, conditional writes
(``If-None-Match: *``) for what must never be replaced, where the server honours them,
else a lock of objects (:meth:`S3Backend.save_if_absent`)."""

from __future__ import annotations

import logging
import random
import re
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

from ...private import Exposed
from .. import pack
from ..api import StoreError
from ..hubclient import TOKEN_ENV, signing_client
from . import layout
from .base import Handle, Kind, ObjectStat, Settings, beyond_end

logger = logging.getLogger(__name__)

LOCK_STALE_SECONDS = 60.0
"""A lock object older than this (by the server's clock) belongs to a writer that died: a
creation under a lock is one small PUT."""
_CONDITIONAL_WRITES: dict[tuple[str, str], bool] = {}
"""Whether the S3 server at (endpoint, bucket) honours ``If-None-Match: *``: probed once a
process (:meth:`S3Backend.conditional_writes`)."""
_CONDITIONAL_LOCK = threading.Lock()

_NETWORK_HINT = "Check that {endpoint} is reachable from this machine, then retry."
_CREDENTIALS_HINT = (
    "Check the AWS credentials (environment variables, ~/.aws/credentials or the instance "
    "role) and that they may list, read, write and delete under s3://{bucket}/{prefix}."
)
_CREDENTIAL_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
}


class S3Encryption(NamedTuple):
    """Server-side encryption of the objects an S3 store writes (SSE-S3 or SSE-KMS)."""

    mode: str = ""
    """"" (the bucket's default), "AES256" (SSE-S3) or "aws:kms" (SSE-KMS)."""
    kms_key_id: str = ""
    """With "aws:kms": the key (id, ARN or alias); "" for the account's aws/s3 key."""

    def put_args(self) -> dict[str, str]:
        """The PutObject arguments that ask for it."""
        if self.mode not in ("", "AES256", "aws:kms"):
            raise StoreError(
                f"Unknown S3 server-side encryption {self.mode!r}.",
                hint='Set s3_server_side_encryption to "AES256" (SSE-S3), "aws:kms" (SSE-KMS) '
                'or "" (the bucket\'s default).',
            )
        if self.kms_key_id and self.mode != "aws:kms":
            raise StoreError(
                "An S3 KMS key id is set, but server-side encryption is not aws:kms.",
                hint='Set s3_server_side_encryption to "aws:kms", or clear s3_sse_kms_key_id.',
            )
        args = {"ServerSideEncryption": self.mode} if self.mode else {}
        if self.kms_key_id:
            args["SSEKMSKeyId"] = self.kms_key_id
        return args


@dataclass(frozen=True)
class S3Options:
    """The ``s3_*`` options (the user's own prefix whole) and ``hub_service_url``."""

    bucket: str
    prefix: str = ""
    endpoint_url: str = ""
    region: str = ""
    encryption: S3Encryption = field(default_factory=S3Encryption)
    hub_service_url: str = ""
    """The product's hub service, which then signs each request: the server holds no
    bucket credentials (core/store/hubclient.py)."""

    @classmethod
    def from_settings(cls, settings: Settings, place: str) -> S3Options:
        if not settings["s3_bucket"]:
            raise StoreError(
                "The s3 store needs a bucket.", hint="Set SnapshotExtensionApp.s3_bucket."
            )
        return cls(
            settings["s3_bucket"],
            f"{settings['s3_prefix'].strip('/')}/{place}".strip("/"),
            settings["s3_endpoint_url"],
            settings["s3_region"],
            S3Encryption(settings["s3_server_side_encryption"], settings["s3_sse_kms_key_id"]),
            settings["hub_service_url"],
        )

    def location(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def open(self, max_workers: int, environ: Mapping[str, str], client: Any = None) -> S3Backend:
        """``client``: an S3 client of its own (else one from the hub service, with the
        server's hub token from ``environ``, or from boto3's standard chain)."""
        endpoint_url, region = self.endpoint_url or None, self.region or None
        if client is None and self.hub_service_url:
            token = environ.get(TOKEN_ENV, "")
            client = signing_client(self.hub_service_url, token, endpoint_url, region, max_workers)
        if client is None:
            client = connect(endpoint_url, region, max_workers)
        return S3Backend(self.bucket, self.prefix, client, max_workers, self.encryption)


def connect(endpoint_url: str | None, region: str | None, max_workers: int) -> Any:
    """An S3 client from boto3's standard credential chain, with a connection a worker."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=region,
        config=Config(
            max_pool_connections=max_workers + 4,
            retries={"mode": "standard", "max_attempts": 3},
            connect_timeout=10,
            read_timeout=60,
        ),
    )


PUT_ATTEMPTS = 5
"""Sends of a PUT answered NoSuchKey (its parent directory removed meanwhile, see _call)."""


class S3Backend:
    """Files in an S3 bucket under a prefix (one prefix per user keeps users apart).

    Credentials come from boto3's standard chain. Every file is a single PUT; reads of
    packs are ranged GETs. Every object is written private (no ACL grants) and with
    ``encryption`` if it is set.
    """

    def __init__(
        self, bucket: str, prefix: str, client: Any, max_workers: int, encryption: S3Encryption
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._put_args: dict[str, Any] = encryption.put_args()
        self.list_page_size = 1000
        """Keys per listing request (S3's most)."""
        self.max_workers = max_workers
        self.client = client
        put_object = client.meta.service_model.operation_model("PutObject")
        if "IfNoneMatch" not in put_object.input_shape.members:
            raise StoreError(
                "This boto3 cannot write S3 objects conditionally (If-None-Match), which the "
                "store needs so that a snapshot is complete or absent.",
                hint="Upgrade boto3 and botocore to 1.35 or newer.",
            )

    def key(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts) if self.prefix else parts)

    def _call(
        self, op: str, key: str, *, missing_ok: bool = False, exists_ok: bool = False, **kw: Any
    ) -> Any:
        """One S3 request; None for an expected 404 (missing_ok) or 412 (exists_ok).

        A PUT answered NoSuchKey is sent again: gateways that keep objects as files (the
        juicefs gateway, MinIO's file mode) remove a directory with its last object, and a
        PUT into it at that moment finds no parent (two servers' lock objects, a pack beside
        a retention pass)."""
        from botocore.exceptions import BotoCoreError, ClientError

        attempt = 1
        while True:
            try:
                return getattr(self.client, op)(Bucket=self.bucket, Key=key, **kw)
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code", "")
                if op == "put_object" and code == "NoSuchKey" and attempt < PUT_ATTEMPTS:
                    time.sleep(0.01 * 2**attempt)
                    attempt += 1
                    continue
                if missing_ok and code in ("404", "NoSuchKey", "NotFound"):
                    return None
                if exists_ok and code in ("412", "PreconditionFailed"):
                    return None
                if code == "InvalidRange":
                    start = int(str(kw.get("Range", "bytes=0-")).split("=")[1].split("-")[0])
                    raise beyond_end(f"s3://{self.bucket}/{key}", start) from exc
                self._raise(op, key, exc)
            except BotoCoreError as exc:
                self._raise(op, key, exc)

    def _put(self, key: str, body: bytes, *, exists_ok: bool = False, **kw: Any) -> Any:
        """Every write: encrypted as configured, and private: no ACL is sent, so the object
        gets S3's default, the owner alone (a canned ACL, even "private", is refused by
        buckets whose ACLs are disabled, AWS's default since 2023)."""
        return self._call("put_object", key, exists_ok=exists_ok, Body=body, **self._put_args, **kw)

    def _raise(self, op: str, key: str, exc: Exception) -> NoReturn:
        from botocore.exceptions import (
            ClientError,
            ConnectionError,
            HTTPClientError,
            NoCredentialsError,
            PartialCredentialsError,
        )

        code = exc.response.get("Error", {}).get("Code", "") if isinstance(exc, ClientError) else ""
        if isinstance(exc, ConnectionError | HTTPClientError):
            hint = _NETWORK_HINT.format(endpoint=self.client.meta.endpoint_url)
        elif isinstance(exc, NoCredentialsError | PartialCredentialsError) or (
            code in _CREDENTIAL_CODES
        ):
            hint = _CREDENTIALS_HINT.format(bucket=self.bucket, prefix=self.prefix)
        elif code == "NoSuchBucket":
            hint = f"Create the bucket {self.bucket!r}, or correct the bucket name."
        else:
            hint = "Retry; if it keeps failing, check the S3 service and this store's settings."
        raise StoreError(f"S3 {op} of s3://{self.bucket}/{key} failed: {exc}", hint=hint) from exc

    def _read(self, key: str, **kw: Any) -> bytes | None:
        from botocore.exceptions import BotoCoreError

        response = self._call("get_object", key, missing_ok=True, **kw)
        if response is None:
            return None
        try:
            data: bytes = response["Body"].read()
        except BotoCoreError as exc:
            self._raise("get_object", key, exc)
        return data

    def _pages(self, under: str, start_after: str = "") -> Iterator[dict[str, Any]]:
        """Listing pages (up to ``list_page_size`` keys each) of the keys under ``under/``."""
        from botocore.exceptions import BotoCoreError, ClientError

        prefix = self.key(under) + "/"
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket,
            Prefix=prefix,
            StartAfter=start_after,
            PaginationConfig={"PageSize": self.list_page_size},
        )
        try:
            yield from pages
        except (BotoCoreError, ClientError) as exc:
            self._raise("list_objects_v2", prefix, exc)

    def _list(self, under: str, start_after: str = "") -> Iterator[dict[str, Any]]:
        for page in self._pages(under, start_after):
            yield from page.get("Contents", [])

    def _objects_under(self, directory: str) -> Iterator[dict[str, Any]]:
        """Every object under ``directory``: one request for a small store; past one page,
        the rest is listed per subdirectory (00 to ff) in parallel, since a million
        objects are a thousand pages, seconds when listed one after another."""
        pages = self._pages(directory)
        first = next(pages, {})
        contents = first.get("Contents", [])
        yield from contents
        if not first.get("IsTruncated"):
            return
        last = contents[-1]["Key"]
        sub = last.removeprefix(self.key(directory) + "/").split("/")[0]
        if not re.fullmatch(r"[0-9a-f]{2}", sub):  # not our layout: go on in order
            for page in pages:
                yield from page.get("Contents", [])
            return
        first_sub = int(sub, 16)
        with ThreadPoolExecutor(max_workers=self.max_workers) as pool:
            listings = pool.map(
                lambda d: list(self._list(f"{directory}/{d:02x}", last if d == first_sub else "")),
                range(first_sub, 256),
            )
            for objects in listings:
                yield from objects

    def location(self, handle: Handle) -> str:
        return f"s3://{self.bucket}/{self.key(layout.path(handle))}"

    def save(self, handle: Handle, data: bytes | pack.Parts) -> None:
        body = data if isinstance(data, bytes) else b"".join(map(pack.blob_bytes, data))
        self._put(self.key(layout.path(handle)), body)

    def save_if_absent(self, handle: Handle, data: bytes) -> bool:
        """``If-None-Match: *`` where the server honours it; else under a lock of objects
        (:meth:`_create_locked`): many S3-compatible servers ignore the header and
        overwrite (the juicefs gateway, tests/test_backend_contract.py)."""
        extra = {"ContentType": "application/json"} if handle.kind is Kind.RECORD else {}
        key = self.key(layout.path(handle))
        if self.conditional_writes():
            return self._put(key, data, exists_ok=True, IfNoneMatch="*", **extra) is not None
        return self._create_locked(key, f"{layout.LOCKS_DIR}/{layout.path(handle)}", data, extra)

    def conditional_writes(self) -> bool:
        """Whether this bucket's server honours ``If-None-Match: *`` (a second PUT of a
        scratch object with it answers 412), probed at the first need, once a process."""
        where = (str(self.client.meta.endpoint_url), self.bucket)
        with _CONDITIONAL_LOCK:
            if where not in _CONDITIONAL_WRITES:
                honoured = self._probe_conditional_writes()
                if not honoured:
                    logger.warning(
                        "The S3 server %s ignores If-None-Match (conditional writes) in bucket "
                        "%s: records and keys are created under lock objects instead "
                        "(docs/storage.md)",
                        where[0],
                        self.bucket,
                    )
                _CONDITIONAL_WRITES[where] = honoured
            return _CONDITIONAL_WRITES[where]

    def _probe_conditional_writes(self) -> bool:
        key = self.key(layout.LOCKS_DIR, f"probe-{uuid.uuid4().hex}")
        self._put(key, b"first")
        try:
            second = self._put(key, b"second", exists_ok=True, IfNoneMatch="*")
        except StoreError as exc:  # a server that refuses the header (501) has none either
            logger.info("A conditional write was refused: %s", exc)
            second = True
        finally:
            self._call("delete_object", key)
        return second is None

    def _create_locked(self, key: str, locks: str, data: bytes, extra: dict[str, Any]) -> bool:
        """Create ``key`` unless it exists, without conditional writes: put a lock object of
        one's own under ``locks/``, list the locks, and only alone (no other lock younger
        than LOCK_STALE_SECONDS by the server's clock) check that ``key`` is absent and
        write it; else remove one's lock and try again after a random pause. On a server
        with read-after-write and listing consistency (S3, MinIO, the juicefs gateway) two
        writers are never alone at once: the later one to list sees the other's lock, or
        (the other done) the key. A writer whose lock grew old before its write re-reads."""
        rng = random.Random()
        deadline = time.monotonic() + 2 * LOCK_STALE_SECONDS
        attempt = 0
        while time.monotonic() < deadline:
            if self._call("head_object", key, missing_ok=True) is not None:
                return False
            mine = self.key(locks, uuid.uuid4().hex)
            started = time.monotonic()
            self._put(mine, b"")
            try:
                ages = {o["Key"]: o["LastModified"].timestamp() for o in self._list(locks)}
                now = ages.get(mine, time.time())
                if not [k for k, t in ages.items() if k != mine and t > now - LOCK_STALE_SECONDS]:
                    if self._call("head_object", key, missing_ok=True) is not None:
                        return False
                    if time.monotonic() - started < LOCK_STALE_SECONDS / 2:
                        self._put(key, data, **extra)
                        if time.monotonic() - started < LOCK_STALE_SECONDS / 2:
                            return True
                        return self._read(key) == data
            finally:
                self._call("delete_object", mine)
            attempt += 1
            time.sleep(rng.uniform(0.01, 0.05) * min(2**attempt, 16))
        raise StoreError(
            f"Could not create s3://{self.bucket}/{key}: other writers kept it locked "
            f"(s3://{self.bucket}/{self.key(locks)}/) for {2 * LOCK_STALE_SECONDS:.0f} s.",
            hint="Retry; if it keeps failing, remove that lock prefix's objects.",
        )

    def adopt(self, handle: Handle, source: Path) -> bool:
        """S3 has no links: the file is copied into packs instead."""
        return False

    def load(
        self, handle: Handle, offset: int = 0, length: int | None = None
    ) -> bytes | memoryview | None:
        key = self.key(layout.path(handle))
        if length is None:
            return self._read(key)
        return self._read(key, Range=f"bytes={offset}-{offset + length - 1}")

    def names(self, kind: Kind) -> list[str]:
        if kind is Kind.RECORD:
            found = (obj["Key"].rsplit("/", 1)[-1] for obj in self._list(layout.RECORDS_DIR))
            return [i for i in map(layout.record_id, found) if i is not None]
        return [name for name, _ in self.entries(kind)]

    def entries(self, kind: Kind) -> Iterator[tuple[str, ObjectStat]]:
        if kind in layout.FLAT:
            for obj in self._list(layout.directory(kind)):
                stat = ObjectStat(int(obj["Size"]), obj["LastModified"].timestamp())
                yield obj["Key"].rsplit("/", 1)[-1], stat
            return
        root = self.key() + "/" if self.prefix else ""
        for obj in self._objects_under(layout.directory(kind)):
            name = obj["Key"].removeprefix(root)
            if pack.is_object_name(name):
                yield name, ObjectStat(int(obj["Size"]), obj["LastModified"].timestamp())

    def remove(self, handle: Handle) -> None:
        self._call("delete_object", self.key(layout.path(handle)))

    def remove_all(self, names: list[str]) -> None:
        """One DeleteObject a name, ``max_workers`` at a time: the key in the signed path,
        never in a DeleteObjects body (which not every S3 server checks against the
        signature: the hub service signs no such request, core/store/scope.py)."""
        keys = [self.key(name) for name in names]
        if len(keys) <= 1:
            for key in keys:
                self._call("delete_object", key)
            return
        with ThreadPoolExecutor(max_workers=self.max_workers) as pool:
            list(pool.map(lambda key: self._call("delete_object", key), keys))

    def sync(self) -> None:
        """Nothing to do: S3 acknowledges a PUT only once the object is durable."""

    def close(self) -> None:
        self.client.close()

    def tighten(self) -> list[Exposed]:
        """Nothing on this machine: objects are written private."""
        return []
