"""Sent as a cell to alice's kernel by tests/test_jupyterhub.py: code that tries everything
her server holds against bob's objects: every credential in its environment and files (and
boto3's own chain), unsigned requests, and the hub service with her server's token.
``attack`` says what each attempt got: "allowed" (with the bytes of a small read) or
"refused: <why>"."""

from __future__ import annotations

import base64
import configparser
import json
import os
import pathlib
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

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
            parser.read_string(text)
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

    def ask(path: str, body: dict[str, Any] | None = None) -> str:
        """The service itself, with her token."""
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
            return f"refused: {exc.code}"

    if service:
        url = f"{endpoint}/{bucket}/{record}"
        for extra in ({}, {"user": "bob"}):
            ask_bob = {"method": "GET", "url": url, "headers": {}, "payload_sha256": EMPTY_SHA256}
            results[f"sign {extra}"] = ask("sign", {**ask_bob, **extra})
        results["key"] = ask("key")
        results["key ?user=bob"] = ask("key?user=bob")
    return {"token": bool(token), "keys": len(keys), "results": results}
