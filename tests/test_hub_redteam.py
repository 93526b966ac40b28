"""What two real S3 servers check of a request the hub service signed, changed after
signing (issue 45): moto with IAM enforcement and the juicefs gateway (MinIO's code). The
table in docs/jupyterhub.md ("What is protected from whom") is this test's expectations;
the service's own probe (core/store/probe.py) measures each row, and the attack the
service no longer signs (a DeleteObjects body swapped) is sent here with the store
admin's key, to show why. The same attacks from a hub user's kernel, through the real
service: tests/support/hub_attack.py (red_team), run by tests/test_jupyterhub.py on both."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
from botocore.credentials import Credentials

from jupyter_ext.core.store.probe import ServerChecks, Signer, probe_server
from jupyter_ext.core.store.scope import SignRequest, sign
from testkit.processes import MotoServer

from .support.s3server import JuicefsGateway, s3_client

BUCKET = "red-team"


@pytest.fixture(scope="module", params=["moto", "juicefs"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, tuple[str, str]]]:
    """(name, url, the store admin's key) of a server that refuses unsigned requests."""
    if request.param == "moto":
        moto = MotoServer(tmp_path_factory.mktemp("moto-iam") / "moto.log")
        try:
            key = moto.enforce_credentials()
            client = s3_client(moto.url, key)
            client.create_bucket(Bucket=BUCKET)
            client.close()
            yield "moto", moto.url, key
        finally:
            moto.stop()
    else:
        gateway = JuicefsGateway(tmp_path_factory.mktemp("juicefs"))
        try:
            gateway.ensure_bucket(BUCKET)
            yield "juicefs", gateway.url, gateway.access_key
        finally:
            gateway.stop()


MEASURED = {
    "moto": ServerChecks(
        "",
        conditional_writes=True,
        copy="performed",
        copy_guarded="performed",
        extract="ignored",
        extract_guarded="refused",
        body_hash=False,
        content_md5=False,
        expiry=False,
    ),
    "juicefs": ServerChecks(
        "",
        conditional_writes=False,
        copy="performed",
        copy_guarded="refused",
        extract="performed",
        extract_guarded="refused",
        body_hash=True,
        content_md5=True,
        expiry=True,
    ),
}


def test_what_each_server_checks(server: tuple[str, str, tuple[str, str]]) -> None:
    name, url, key = server
    signer = Signer(Credentials(*key), "us-east-1")
    found = probe_server(url, "us-east-1", BUCKET, "kernel-snapshots", signer)

    assert found == dataclasses.replace(MEASURED[name], endpoint=url)
    assert found.keeps_users_apart is (name == "juicefs")
    assert found.lax
    client = s3_client(url, key)
    try:  # the probe leaves nothing
        assert (
            client.list_objects_v2(Bucket=BUCKET, Prefix="kernel-snapshots/").get("Contents", [])
            == []
        )
    finally:
        client.close()


def test_a_deleteobjects_body_swapped_after_signing_deletes_on_both(
    server: tuple[str, str, tuple[str, str]], tmp_path: Path
) -> None:
    """Why the service signs no DeleteObjects: signed for alice's key (with its
    Content-MD5 and SHA-256), sent with bob's, it deletes bob's on both servers (moto
    hashes no body; MinIO's code hashes it only when it is read to its end, and its XML
    parser stops before)."""
    _, url, key = server
    client = s3_client(url, key)
    alice, bob = "kernel-snapshots/users/alice/a", "kernel-snapshots/users/bob/a"
    for k in (alice, bob):
        client.put_object(Bucket=BUCKET, Key=k, Body=b"theirs")

    def body(k: str) -> bytes:
        return (
            '<Delete xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Object><Key>{k}</Key></Object></Delete>"
        ).encode()

    signed_body = body(alice)
    md5 = base64.b64encode(hashlib.md5(signed_body).digest()).decode()
    request = SignRequest(
        "POST",
        f"{url}/{BUCKET}?delete",
        {"Content-MD5": md5},
        hashlib.sha256(signed_body).hexdigest(),
    )
    headers: dict[str, Any] = {"Content-MD5": md5, **sign(request, Credentials(*key), "us-east-1")}
    answer = urllib3.request("POST", request.url, body=body(bob), headers=headers)
    try:
        assert answer.status == 200
        left = client.list_objects_v2(Bucket=BUCKET, Prefix="kernel-snapshots/users/")
        # (the gateway lists bob's emptied directory as "users/bob/")
        assert [o["Key"] for o in left.get("Contents", []) if o["Key"][-1] != "/"] == [alice]
    finally:
        client.delete_object(Bucket=BUCKET, Key=alice)
        client.close()
