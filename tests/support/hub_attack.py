"""Sent as a cell to alice's kernel by tests/test_jupyterhub.py: code that tries everything
her server holds against bob's objects: every credential in its environment and files (and
boto3's own chain), unsigned requests, and the hub service with her server's token.
``attack`` says what each attempt got: "allowed" (with the bytes of a small read) or
"refused: <why>". ``red_team`` (issue 45): requests the service signed for her, changed
after signing as an S3 server that checks less than AWS would let them through (a
DeleteObjects body swapped, DTD entities, an element inside a key, unsigned headers that
copy or extract, a replayed signature)."""

from __future__ import annotations

import base64
import configparser
import hashlib
import io
import json
import os
import pathlib
import tarfile
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import boto3
import botocore
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from jupyter_ext.core.errors import SnapshotError

ALICE = "kernel-snapshots/users/alice/"
BOB = "kernel-snapshots/users/bob/"
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def server_config() -> dict[str, Any]:
    """The snapshot options of alice's server, from its Jupyter config files."""
    config: dict[str, Any] = {}
    for directory in os.environ.get("JUPYTER_CONFIG_PATH", "").split(os.pathsep):
        path = pathlib.Path(directory, "jupyter_server_config.json")
        if path.is_file():
            config.update(json.loads(path.read_text()).get("SnapshotExtensionApp", {}))
    return config


def credentials() -> set[tuple[str, str]]:
    """Every bucket key her server holds: environment, files that name a key, boto3."""
    found = set()
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        found.add((os.environ["AWS_ACCESS_KEY_ID"], os.environ.get("AWS_SECRET_ACCESS_KEY", "")))
    roots = [pathlib.Path.home()]
    roots += [pathlib.Path(d) for d in os.environ.get("JUPYTER_CONFIG_PATH", "").split(os.pathsep)]
    for root in roots:
        for path in root.rglob("*"):
            if not path.is_file() or path.stat().st_size > 1 << 16:
                continue
            text = path.read_text(errors="replace")
            if "aws_access_key_id" not in text.lower():
                continue
            parser = configparser.ConfigParser()
            try:
                parser.read_string(text)
            except configparser.Error:  # names a key but is no credentials file (a manifest)
                continue
            for section in parser.values():
                if "aws_access_key_id" in section:
                    found.add((section["aws_access_key_id"], section["aws_secret_access_key"]))
    chain = boto3.session.Session().get_credentials()
    if chain is not None:
        found.add((chain.access_key, chain.secret_key))
    return found


def attempt(call: Callable[[], Any]) -> str:
    try:
        answer = call()
    except (ClientError, BotoCoreError, SnapshotError) as exc:  # the S3 server's or the service's
        return f"refused: {str(exc)[:160]}"
    if isinstance(answer, dict) and "Body" in answer:
        data = answer["Body"].read()
        if len(data) > 1 << 16:  # a pack: more than a cell's output may carry
            return f"allowed: {len(data)} bytes"
        return "allowed: " + base64.b64encode(data).decode()
    return "allowed"


def attack(bucket: str, bob_keys: list[str]) -> dict[str, Any]:
    config = server_config()
    endpoint, service = config["s3_endpoint_url"], config.get("hub_service_url", "")
    keys = credentials()
    clients: dict[str, Any] = {}
    for n, (key, secret) in enumerate(sorted(keys)):
        clients[f"key {n}"] = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id=key,
            aws_secret_access_key=secret,
        )
    clients["unsigned"] = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        config=Config(signature_version=botocore.UNSIGNED),
    )
    token = os.environ.get("JUPYTERHUB_API_TOKEN", "")
    if service:
        from jupyter_ext.core.store.hubclient import signing_client

        clients["hub service"] = signing_client(service, token, endpoint, "us-east-1", 4)

    record = next(k for k in bob_keys if "/snapshots/" in k)
    pack = next(k for k in bob_keys if "/snapshots/" not in k)
    everything = {"Objects": [{"Key": k} for k in bob_keys]}
    source = {"Bucket": bucket, "Key": record}
    results: dict[str, str] = {}

    def tries(c: Any) -> dict[str, Callable[[], Any]]:
        return {
            "list alice": lambda: c.list_objects_v2(Bucket=bucket, Prefix=ALICE),
            "list bob": lambda: c.list_objects_v2(Bucket=bucket, Prefix=BOB),
            "list all": lambda: c.list_objects_v2(Bucket=bucket),
            f"read {record}": lambda: c.get_object(Bucket=bucket, Key=record),
            f"read {pack}": lambda: c.get_object(Bucket=bucket, Key=pack),
            "copy": lambda: c.copy_object(Bucket=bucket, Key=ALICE + "stolen", CopySource=source),
            "overwrite": lambda: c.put_object(Bucket=bucket, Key=record, Body=b"{}"),
            "delete": lambda: c.delete_object(Bucket=bucket, Key=pack),
            "delete many": lambda: c.delete_objects(Bucket=bucket, Delete=everything),
        }

    for name, client in clients.items():
        for what, call in tries(client).items():
            results[f"{name}: {what}"] = attempt(call)

    def ask(path: str, body: dict[str, Any] | None = None, say: bool = False) -> str:
        """The service itself, with her token (``say``: a refusal's message too)."""
        request = urllib.request.Request(
            service + path,
            data=json.dumps(body).encode() if body else None,
            headers={"Authorization": f"token {token}"},
            method="POST" if body else "GET",
        )
        try:
            with urllib.request.urlopen(request) as answer:
                return "allowed: " + answer.read().decode()
        except urllib.error.HTTPError as exc:
            with exc:
                message = json.loads(exc.read())["message"] if say else ""
            return f"refused: {exc.code}" + (f": {message}" if say else "")

    if service:
        results.update(red_team(endpoint, bucket, service, token, bob_keys))
        url = f"{endpoint}/{bucket}/{record}"
        for extra in ({}, {"user": "bob"}):
            ask_bob = {"method": "GET", "url": url, "headers": {}, "payload_sha256": EMPTY_SHA256}
            results[f"sign {extra}"] = ask("sign", {**ask_bob, **extra})
        odd = {"method": "GET", "url": f"{endpoint}/{bucket}/{quote(BOB + 'a b%25')}"}
        results["a refusal's message"] = ask(
            "sign", {**odd, "headers": {}, "payload_sha256": EMPTY_SHA256}, say=True
        )
        results["key"] = ask("key")
        results["key ?user=bob"] = ask("key?user=bob")
    return {"token": bool(token), "keys": len(keys), "results": results}


def delete_xml(*keys: str, doctype: str = "") -> bytes:
    objects = "".join(f"<Object><Key>{key}</Key></Object>" for key in keys)
    xmlns = "http://s3.amazonaws.com/doc/2006-03-01/"
    return f'{doctype}<Delete xmlns="{xmlns}">{objects}</Delete>'.encode()


def red_team(
    endpoint: str, bucket: str, service: str, token: str, bob_keys: list[str]
) -> dict[str, str]:
    """Signatures alice gets from the service for her own prefix, sent changed."""
    import urllib3

    http = urllib3.PoolManager(retries=False)
    record = next(k for k in bob_keys if "/snapshots/" in k)

    def signature(method: str, url: str, headers: dict[str, str], payload: str) -> Any:
        ask = {"method": method, "url": url, "headers": headers, "payload_sha256": payload}
        request = urllib.request.Request(
            service + "sign",
            data=json.dumps(ask).encode(),
            headers={"Authorization": f"token {token}"},
            method="POST",
        )
        with urllib.request.urlopen(request) as answer:
            return json.loads(answer.read())["headers"]

    def send(
        method: str,
        url: str,
        body: bytes = b"",
        *,
        signed: dict[str, str] | None = None,
        unsigned: dict[str, str] | None = None,
        sent: bytes | None = None,
        payload: str = "",
        to: str = "",
    ) -> tuple[int, bytes]:
        """Sign (method, url, signed headers, body's hash), then send to ``to`` (else
        ``url``) with ``unsigned`` headers added and ``sent`` as the body."""
        headers = urllib3.HTTPHeaderDict(signed or {})
        got = signature(method, url, signed or {}, payload or hashlib.sha256(body).hexdigest())
        for name, value in got.items():
            headers[name] = value
        for name, value in (unsigned or {}).items():
            headers.add(name, value)
        answer = http.request(
            method, to or url, body=body if sent is None else sent, headers=headers
        )
        return answer.status, answer.data

    def attempt(call: Callable[[], tuple[int, bytes]]) -> str:
        try:
            status, _ = call()
        except urllib.error.HTTPError as exc:
            return f"refused: {exc.code} by the service"
        return f"sent: {status}"

    def key_url(key: str) -> str:
        return f"{endpoint}/{bucket}/{quote(key)}"

    own = ALICE + "own"
    send("PUT", key_url(own), b"alice's own")
    delete = f"{endpoint}/{bucket}?delete"
    md5 = base64.b64encode(hashlib.md5(delete_xml(own)).digest()).decode()
    entity = '<!DOCTYPE Delete [<!ENTITY a "alice/">]>'
    results = {
        "DeleteObjects, the body swapped for bob's keys": lambda: send(
            "POST", delete, delete_xml(own), signed={"Content-MD5": md5}, sent=delete_xml(*bob_keys)
        ),
        "DeleteObjects with a DTD entity": lambda: send(
            "POST", delete, delete_xml(record.replace("users/", "users/&a;"), doctype=entity)
        ),
        "DeleteObjects, an element inside a key": lambda: send(
            "POST", delete, delete_xml(f"{own}<i/>{record}")
        ),
        "a PUT of an unsigned payload": lambda: send(
            "PUT", key_url(own), payload="UNSIGNED-PAYLOAD", sent=b"anything"
        ),
        "a signature replayed to bob's record": lambda: send(
            "GET", key_url(own), to=key_url(record)
        ),
        "a PUT turned into a copy of bob's record by an unsigned header": lambda: send(
            "PUT", key_url(ALICE + "copied"), unsigned={"x-amz-copy-source": f"/{bucket}/{record}"}
        ),
        "a tar extracted over bob's record by an unsigned header": lambda: send(
            "PUT",
            key_url(ALICE + "planted.tar"),
            planted_tar([record, BOB + "planted"]),
            unsigned={"X-Amz-Meta-Snowball-Auto-Extract": "true"},
        ),
    }
    said = {f"red team: {what}": attempt(call) for what, call in results.items()}
    status, copied = send("GET", key_url(ALICE + "copied"))
    said["red team: what the copy holds"] = base64.b64encode(
        copied if status == 200 else b""
    ).decode()
    return said


def planted_tar(keys: list[str]) -> bytes:
    """A tar whose entries are named by these keys (extracted relative to the bucket)."""
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        for key in keys:
            info = tarfile.TarInfo(key)
            info.size = 7
            tar.addfile(info, io.BytesIO(b"planted"))
    return archive.getvalue()
