"""Kernel snapshots in a real JupyterHub: the hub, configurable-http-proxy, single-user
servers spawned by the hub (``jupyterhub-singleuser`` loading the extension) and the real
``jupyterhub-idle-culler``, with snapshots in an S3 server (moto), as in a Zero to
JupyterHub deployment: the single-user servers get the server configuration of
``deploy/z2jh/config.yaml``, pointed at the test S3 server. Every request goes through the
proxy with a hub token, as a browser's or a script's would.
"""

from __future__ import annotations

import os
import sys
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml

from jupyter_ext.testing import Endpoint, MotoServer

from .hub import ROOT, Hub
from .servers import follow, ws_execute

pytestmark = pytest.mark.usefixtures("criu")
PREFIX = "kernel-snapshots"
# The idle culler stops a server after this many seconds without activity.
IDLE_TIMEOUT = 15


def z2jh_server_config() -> dict[str, Any]:
    """The single-user server configuration that deploy/z2jh/config.yaml mounts."""
    values = yaml.safe_load((ROOT / "deploy" / "z2jh" / "config.yaml").read_text())
    data: dict[str, Any] = values["singleuser"]["extraFiles"]["jupyter-server-config"]["data"]
    return data


def start_hub(home: Path, moto: MotoServer, bucket: str, **hub_options: Any) -> Hub:
    """A hub whose users' servers keep their snapshots in ``bucket`` of the moto server."""
    config = z2jh_server_config()
    config["SnapshotExtensionApp"].update(
        s3_bucket=moto.ensure_bucket(bucket),
        s3_endpoint_url=moto.url,
        # moto stores objects one by one, slowly: 1 MiB chunks (about 40 per snapshot, not
        # 2000) keep every request well within the culler's timeout. Chunking is not what
        # these tests are about.
        chunk_kib=1024,
    )
    assert config["SnapshotExtensionApp"]["s3_prefix"] == PREFIX
    assert "ServerApp" not in config, "the pods run as uid 1000, not root"
    if os.geteuid() == 0:
        # The root test run; scripts/nonroot-tests.sh runs hub and servers as a user.
        config["ServerApp"] = {"allow_root": True}
    environment = {
        # In Z2JH pods every user's server runs as the same OS user (getpass looks at
        # LOGNAME first): only $JUPYTERHUB_USER tells the users apart.
        "LOGNAME": "jovyan",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    return Hub(home, config, environment, **hub_options)


def stored_records(moto: MotoServer, bucket: str) -> list[str]:
    """The snapshot records in the bucket, as S3 keys."""
    client = boto3.client("s3", endpoint_url=moto.url)
    try:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=PREFIX)
        keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
    finally:
        client.close()
    return sorted(key for key in keys if "/snapshots/" in key)


def refused(server: Endpoint, path: str = "api/snapshots") -> int:
    """The HTTP status with which the server refuses ``GET path`` (it must refuse)."""
    with pytest.raises(urllib.error.HTTPError) as info:
        server.api("GET", path)
    return info.value.code


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory, moto: MotoServer) -> Iterator[Hub]:
    with start_hub(tmp_path_factory.mktemp("hub"), moto, "hub-snapshots") as running:
        yield running


@pytest.fixture(scope="module")
def alice(hub: Hub) -> Endpoint:
    """alice's server, spawned by the hub, with her own token."""
    server = hub.add_user("alice")
    hub.start_server("alice")
    return server


@pytest.fixture(scope="module")
def alice_snapshot(hub: Hub, alice: Endpoint) -> dict[str, Any]:
    """A snapshot of a kernel of alice's that ran a cell, all through the proxy."""
    kernel = alice.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
    try:
        output = ws_execute(alice, kernel, "answer = 6 * 7\nprint(answer)")
    except Exception as exc:  # the hub's log holds the server's and the kernel's
        log = "\n".join(hub.log().splitlines()[-150:])
        raise AssertionError(f"the cell failed ({exc!r}); the hub's log ends:\n{log}") from exc
    assert output == "42\n"
    job = alice.client.call("POST", "", body={"kernel_id": kernel})["job"]
    snapshot: dict[str, Any] = follow(alice, job)["result"]
    assert snapshot["kernel_id"] == kernel
    return snapshot


def test_snapshot_of_a_kernel_in_a_hub_server(
    alice: Endpoint, alice_snapshot: dict[str, Any], moto: MotoServer
) -> None:
    assert alice_snapshot["status"] == "complete"
    assert alice_snapshot["trigger"] == "manual"
    listed = alice.client.call("GET", "")["snapshots"]
    assert [s["id"] for s in listed] == [alice_snapshot["id"]]
    # alice's: the record is under her prefix, named by the hub ($JUPYTERHUB_USER).
    assert stored_records(moto, "hub-snapshots") == [
        f"{PREFIX}/users/alice/snapshots/{alice_snapshot['id']}.json"
    ]
    assert alice.client.call("GET", "policy")["snapshot_before_shutdown"] is True


def test_the_hub_decides_who_reaches_snapshots(
    hub: Hub, alice: Endpoint, alice_snapshot: dict[str, Any]
) -> None:
    bob = hub.add_user("bob")
    hub.start_server("bob")
    # bob's token is valid (it reaches his own server) but not for alice's server.
    assert bob.client.call("GET", "")["snapshots"] == []
    assert refused(Endpoint(alice.url, bob.token)) == 403
    assert refused(Endpoint(alice.url, bob.token), f"api/snapshots/{alice_snapshot['id']}") == 403
    assert refused(Endpoint(alice.url, "")) == 403
    # bob's server uses the same bucket, and still sees nothing of alice's.
    assert refused(bob, f"api/snapshots/{alice_snapshot['id']}") == 404
    assert bob.client.call("GET", "")["snapshots"] == []
    # alice's own token still works: the refusals above are about who asks.
    assert [s["id"] for s in alice.client.call("GET", "")["snapshots"]] == [alice_snapshot["id"]]


def test_idle_culler_stops_a_server_whose_kernel_comes_back(
    tmp_path: Path, moto: MotoServer
) -> None:
    culler = {
        "name": "idle-culler",
        "command": [
            sys.executable,
            "-m",
            "jupyterhub_idle_culler",
            f"--timeout={IDLE_TIMEOUT}",
            "--cull-every=1",
        ],
    }
    culler_role = {
        "name": "idle-culler",
        "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"],
        "services": ["idle-culler"],
    }
    with start_hub(
        tmp_path, moto, "culled-snapshots", services=[culler], roles=[culler_role]
    ) as hub:
        alice = hub.add_user("alice")
        hub.start_server("alice")
        kernel = alice.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
        ws_execute(alice, kernel, "import numpy as np\nbefore_cull = np.arange(1000)")

        # Nobody asks the hub to stop it: the culler does, once it has been idle.
        hub.wait_server("alice", lambda state: state is None, timeout=IDLE_TIMEOUT + 120)

        hub.start_server("alice")
        listed = alice.client.call("GET", "", trigger="before-shutdown")["snapshots"]
        assert [(s["kernel_id"], s["status"]) for s in listed] == [(kernel, "complete")]
        answer = alice.client.call("POST", f"{listed[0]['id']}/restore", body={})
        restored = follow(alice, answer["job"])["result"]
        out = ws_execute(alice, restored["kernel_id"], "print(before_cull.sum())")
        assert out == "499500\n"
