"""A backend in an S3 bucket: one PUT a file, ranged GETs, conditional writes
(``If-None-Match: *``) for what must never be replaced."""

from __future__ import annotations

import re
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
        """One S3 request; None for an expected 404 (missing_ok) or 412 (exists_ok)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self.client, op)(Bucket=self.bucket, Key=key, **kw)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
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
        extra = {"ContentType": "application/json"} if handle.kind is Kind.RECORD else {}
        response = self._put(
            self.key(layout.path(handle)), data, exists_ok=True, IfNoneMatch="*", **extra
        )
        return response is not None

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
        """DeleteObjects, 1000 keys a request (S3's most)."""
        from botocore.exceptions import BotoCoreError, ClientError

        for start in range(0, len(names), 1000):
            keys = [{"Key": self.key(name)} for name in names[start : start + 1000]]
            try:
                response = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True}
                )
            except (BotoCoreError, ClientError) as exc:
                self._raise("delete_objects", self.key("packs"), exc)
            errors = response.get("Errors") or []
            if errors:
                first = errors[0]
                raise StoreError(
                    f"S3 delete_objects in s3://{self.bucket}/{self.key()} failed for "
                    f"{len(errors)} objects, e.g. {first.get('Key')}: {first.get('Code')} "
                    f"{first.get('Message')}",
                    hint=_CREDENTIALS_HINT.format(bucket=self.bucket, prefix=self.prefix),
                )

    def sync(self) -> None:
        """Nothing to do: S3 acknowledges a PUT only once the object is durable."""

    def close(self) -> None:
        self.client.close()

    def tighten(self) -> list[Exposed]:
        """Nothing on this machine: objects are written private."""
        return []
