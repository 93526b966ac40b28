"""What an S3 server checks of a signed request, found with harmless requests in a scratch
prefix (``<prefix>/.probe/<random>/``, removed after): whether it honours
``If-None-Match: *``, acts on ``x-amz-*`` headers added unsigned beside a signed request
(a copy source, MinIO's tar extraction) and whether :data:`~.scope.LAX_SERVER_GUARDS`
stop that, hashes a body against ``x-amz-content-sha256``, checks ``Content-MD5``, and
refuses a signature an hour old.

The hub service probes its bucket at start with its own credentials, and signs the
guards into every PUT where the server acts on unsigned headers; ``jupyter snapshot
doctor`` probes the store it is given, through the hub service where there is one (then
only what the service signs can be tried: no old signatures, no unsigned payloads).
Measured on moto and the juicefs gateway: docs/jupyterhub.md, tests/test_hub_redteam.py.
"""

from __future__ import annotations

import base64
import hashlib
import io
import logging
import tarfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal
from urllib.parse import quote

from .api import StoreError
from .scope import LAX_SERVER_GUARDS, UNSIGNED_PAYLOAD, SignRequest, sign

logger = logging.getLogger(__name__)

Outcome = Literal["refused", "ignored", "performed"]
"""What the server did with an unsigned header: refused the request, served it as if the
header were not there, or did what the header asks."""
EXTRACT_HEADER = "X-Amz-Meta-Snowball-Auto-Extract"


@dataclass(frozen=True)
class Signer:
    """Signs the probe's requests: with ``credentials`` here (botocore's, frozen: the hub
    service's own, or a server's without the service), which sign anything (extra headers,
    a time in the past, an unsigned payload); or through ``service`` (a HubClient: the hub
    service's ``POST sign``, with the server's hub token), which signs what it signs."""

    credentials: Any = None
    region: str = "us-east-1"
    service: Any = None

    @property
    def local(self) -> bool:
        return self.service is None

    def __call__(
        self,
        request: SignRequest,
        extra: Mapping[str, str] | None = None,
        when: datetime | None = None,
    ) -> dict[str, str]:
        if self.service is not None:
            headers: dict[str, str] = self.service.call("POST", "sign", request.to_dict())[
                "headers"
            ]
            return headers
        return sign(request, self.credentials, self.region, extra=extra, when=when)


@dataclass(frozen=True)
class ServerChecks:
    """What the probe found. ``None``: not probed (through the hub service, or not needed)."""

    endpoint: str
    conditional_writes: bool
    copy: Outcome | None
    """An ``x-amz-copy-source`` added unsigned to a signed empty PUT, without guards."""
    copy_guarded: Outcome | None
    """The same with the guards signed in (probed where ``copy`` was performed, or as the
    hub service signs)."""
    extract: Outcome | None
    extract_guarded: Outcome | None
    body_hash: bool
    """Whether a body other than the one signed (by its SHA-256) is refused."""
    content_md5: bool | None
    expiry: bool | None
    """Whether a signature an hour old is refused."""
    guarded_by_the_service: bool = False
    """Probed through a hub service that signs the guards in (it found the server lax)."""

    @property
    def lax(self) -> bool:
        """Acts on unsigned ``x-amz-*`` headers: the service signs the guards into PUTs."""
        return self.guarded_by_the_service or "performed" in (self.copy, self.extract)

    @property
    def keeps_users_apart(self) -> bool:
        """Whether no user can reach another's objects through a request the service
        signed (with the guards, where it signs them)."""
        return all(
            (guarded or plain) != "performed"
            for plain, guarded in (
                (self.copy, self.copy_guarded),
                (self.extract, self.extract_guarded),
            )
        )

    def findings(self) -> list[str]:
        """Each finding as a sentence, for a log or doctor."""
        said = [
            "honours If-None-Match (conditional writes)"
            if self.conditional_writes
            else "ignores If-None-Match: a conditional PUT overwrites (records and keys are "
            "then created under lock objects, docs/storage.md)"
        ]
        for what, plain, guarded in (
            ("an x-amz-copy-source header added unsigned (a copy)", self.copy, self.copy_guarded),
            (f"an {EXTRACT_HEADER} header added unsigned (a tar extracted anywhere in the "
             "bucket)", self.extract, self.extract_guarded),
        ):  # fmt: skip
            if plain is not None:
                said.append(f"{_OUTCOME[plain]} {what}")
            if guarded is not None:
                held = "the service's guards hold" if guarded != "performed" else "NOT stopped"
                said.append(f"with the hub service's guards signed in, {what}: {held}")
        said.append(
            "checks the body against x-amz-content-sha256"
            if self.body_hash
            else "does NOT check the body against x-amz-content-sha256"
        )
        if self.content_md5 is not None:
            said.append("checks Content-MD5" if self.content_md5 else "does NOT check Content-MD5")
        if self.expiry is not None:
            said.append(
                "refuses a signature an hour old"
                if self.expiry
                else "accepts a signature an hour old (signatures never expire)"
            )
        return said

    def verdict(self) -> str:
        """Plainly: can this store keep a hub's users apart, with the hub service?"""
        if not self.keeps_users_apart:
            return (
                f"The S3 server {self.endpoint} CANNOT keep a hub's users apart: it does what "
                "an x-amz-* header added unsigned to a request the hub service signed asks "
                "(a copy of any object of the bucket into the user's prefix, or a tar's "
                "entries written anywhere in it), even with the service's guards: any user "
                "can copy or overwrite another's objects (encrypted, their content stays "
                "unreadable; their names and sizes do not). Use an S3 server that refuses "
                "unsigned x-amz-* headers (AWS S3 does)."
            )
        if self.lax:
            return (
                f"The S3 server {self.endpoint} acts on x-amz-* headers added unsigned beside "
                "a signed request; the hub service signs guards into every PUT that stop the "
                "copies and extractions found (probed: they hold). Any other such header it "
                "may act on is outside what the service can stop: prefer a server that "
                "refuses unsigned x-amz-* headers (AWS S3 does)."
            )
        return f"The S3 server {self.endpoint} keeps a hub's users apart."


_OUTCOME: dict[Outcome, str] = {
    "refused": "refuses a request with",
    "ignored": "ignores",
    "performed": "ACTS ON",
}


class Probe:
    """One run of the probe in ``scratch`` (a key prefix, "/"-terminated, removed after)."""

    def __init__(
        self, endpoint_url: str, region: str, bucket: str, scratch: str, signer: Signer
    ) -> None:
        import urllib3

        self.endpoint = endpoint_url or f"https://{bucket}.s3.{region or 'us-east-1'}.amazonaws.com"
        self.path_style = bool(endpoint_url)
        self.bucket = bucket
        self.scratch = scratch
        self.signer = signer
        self.http = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(10, read=30))
        self.written: list[str] = []

    def url(self, key: str) -> str:
        path = quote(key, safe="/-_.~")
        base = f"{self.endpoint.rstrip('/')}/{self.bucket}" if self.path_style else self.endpoint
        return f"{base}/{path}"

    def send(
        self,
        method: str,
        key: str,
        body: bytes = b"",
        *,
        signed: Mapping[str, str] | None = None,
        unsigned: Mapping[str, str] | None = None,
        sent_body: bytes | None = None,
        payload: str = "",
        extra: Mapping[str, str] | None = None,
        when: datetime | None = None,
    ) -> tuple[int, bytes]:
        """A request signed for ``body`` and ``signed`` headers (``extra``: headers the
        signer adds too), sent with ``unsigned`` headers added and ``sent_body``."""
        import urllib3

        request = SignRequest(
            method, self.url(key), dict(signed or {}), payload or hashlib.sha256(body).hexdigest()
        )
        headers = urllib3.HTTPHeaderDict(dict(signed or {}))
        for name, value in self.signer(request, extra, when).items():
            headers[name] = value
        for name, value in (unsigned or {}).items():
            headers.add(name, value)
        data = body if sent_body is None else sent_body
        if method == "PUT":
            self.written.append(key)
        try:
            response = self.http.request(method, request.url, body=data, headers=headers)
        except urllib3.exceptions.HTTPError as exc:
            raise StoreError(
                f"The S3 server {self.endpoint} did not answer the store probe: {exc}",
                hint=f"Check that {self.endpoint} is reachable from here, then retry.",
            ) from exc
        return response.status, response.data

    def content(self, key: str) -> bytes | None:
        status, data = self.send("GET", key)
        return data if status == 200 else None

    def run(self) -> ServerChecks:
        try:
            return self._run()
        finally:
            self.clean_up()

    def _run(self) -> ServerChecks:
        source = self.scratch + "source"
        original = b"jupyter-kernel-snapshots store probe " + uuid.uuid4().hex.encode()
        status, said = self.send("PUT", source, original)
        if status != 200:
            raise StoreError(
                f"The store probe could not write s3://{self.bucket}/{source} ({status}): "
                f"{said[:300].decode(errors='replace')}",
                hint="Check the bucket's credentials and settings (doctor's other checks).",
            )
        conditional = self.scratch + "conditional"
        self.send("PUT", conditional, b"first")
        second, _ = self.send("PUT", conditional, b"second", signed={"If-None-Match": "*"})
        guards_back = False
        if not self.signer.local:  # whatever the service signs in, the probe sees
            probe = SignRequest(
                "PUT", self.url(self.scratch + "x"), {}, hashlib.sha256(b"").hexdigest()
            )
            guards_back = set(LAX_SERVER_GUARDS) <= {k.lower() for k in self.signer(probe)}
        copy: Outcome | None = self._copy("copy", source, original, {})
        extract: Outcome | None = self._extract("extracted", {})
        copy_guarded: Outcome | None = None
        extract_guarded: Outcome | None = None
        if guards_back:
            copy, copy_guarded, extract, extract_guarded = None, copy, None, extract
        elif self.signer.local and "performed" in (copy, extract):
            copy_guarded = self._copy("copy-guarded", source, original, LAX_SERVER_GUARDS)
            extract_guarded = self._extract("extracted-guarded", LAX_SERVER_GUARDS)
        hashed, _ = self.send("PUT", self.scratch + "hashed", b"signed body", sent_body=b"other")
        md5 = expiry = None
        if self.signer.local:
            digest = base64.b64encode(hashlib.md5(b"signed body").digest()).decode()
            status, _ = self.send(
                "PUT",
                self.scratch + "md5",
                b"signed body",
                signed={"Content-MD5": digest},
                sent_body=b"other body!",
                payload=UNSIGNED_PAYLOAD,
            )
            md5 = status >= 400
            old = datetime.now(UTC) - timedelta(hours=1)
            expiry = self.send("GET", source, when=old)[0] >= 400
        return ServerChecks(
            self.endpoint,
            conditional_writes=second == 412,
            copy=copy,
            copy_guarded=copy_guarded,
            extract=extract,
            extract_guarded=extract_guarded,
            body_hash=hashed >= 400,
            content_md5=md5,
            expiry=expiry,
            guarded_by_the_service=guards_back,
        )

    def _copy(self, name: str, source: str, original: bytes, extra: Mapping[str, str]) -> Outcome:
        """A signed empty PUT of ``name`` with ``x-amz-copy-source`` added unsigned."""
        target = self.scratch + name
        copy_source = "/" + quote(f"{self.bucket}/{source}", safe="/-_.~")
        status, _ = self.send(
            "PUT", target, unsigned={"x-amz-copy-source": copy_source}, extra=extra or None
        )
        if status >= 400:
            return "refused"
        return "performed" if self.content(target) == original else "ignored"

    def _extract(self, name: str, extra: Mapping[str, str]) -> Outcome:
        """A signed PUT of a tar whose one entry is the scratch key ``name`` (MinIO extracts
        entries relative to the bucket), with the extraction header added unsigned."""
        entry = self.scratch + name
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            info = tarfile.TarInfo(entry)
            info.size = 5
            tar.addfile(info, io.BytesIO(b"probe"))
        self.written.append(entry)
        status, _ = self.send(
            "PUT",
            self.scratch + name + ".tar",
            archive.getvalue(),
            unsigned={EXTRACT_HEADER: "true"},
            extra=extra or None,
        )
        if status >= 400:
            return "refused"
        return "performed" if self.content(entry) == b"probe" else "ignored"

    def clean_up(self) -> None:
        """Remove every scratch object (one DELETE each, as the store deletes)."""
        for key in dict.fromkeys(self.written):
            try:
                self.send("DELETE", key)
            except StoreError as exc:
                logger.warning("The store probe left s3://%s/%s: %s", self.bucket, key, exc)


def probe_server(
    endpoint_url: str, region: str, bucket: str, prefix: str, signer: Signer
) -> ServerChecks:
    """Probe the S3 server of ``bucket`` in ``<prefix>/.probe/<random>/``."""
    scratch = "/".join(p for p in (prefix.strip("/"), ".probe", uuid.uuid4().hex) if p) + "/"
    return Probe(endpoint_url, region, bucket, scratch, signer).run()
