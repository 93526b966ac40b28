"""Kernel snapshots in a real JupyterHub: the hub, configurable-http-proxy, single-user
servers spawned by the hub (``jupyterhub-singleuser`` loading the extension) and the real
``jupyterhub-idle-culler``, with snapshots in an S3 server (moto), as in a Zero to
JupyterHub deployment: the single-user servers get the server configuration of
``deploy/z2jh/config.yaml``, pointed at the test S3 server. Every request goes through the
proxy with a hub token, as a browser's or a script's would.
"""

from __future__ import annotations

import base64
import json
import os
import random
import sys
import urllib.error
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from jupyter_ext.core.errors import SnapshotNotFoundError
from testkit.processes import Endpoint, MotoServer, free_port

from .support.hub import ROOT, Hub
from .support.pods import chart_values
from .support.s3server import JuicefsGateway, s3_client
from .support.servers import follow, ws_execute

pytestmark = pytest.mark.usefixtures("criu")
PREFIX = "kernel-snapshots"
# The idle culler stops a server after this many seconds without activity.
IDLE_TIMEOUT = 15


SERVICE = "kernel-snapshots"


def z2jh_values() -> dict[str, Any]:
    """The recipe's values in in-pod mode (config.yaml, then inpod.yaml): the servers here
    run CRIU themselves, there is no node agent (its tests: tests/test_container.py)."""
    return chart_values("inpod.yaml")


def z2jh_server_config() -> dict[str, Any]:
    """The single-user server configuration that deploy/z2jh/config.yaml mounts."""
    data: dict[str, Any] = z2jh_values()["singleuser"]["extraFiles"]["jupyter-server-config"][
        "data"
    ]
    return data


@dataclass
class Bucket:
    """An S3 server that enforces credentials (moto's IAM enforcement: the tests' own
    boto3 defaults, any unsigned request, any unknown key are refused; or the juicefs
    gateway, which checks signatures as MinIO does), its buckets, and the key of the one
    user allowed every S3 action: the store's admin (the hub service's, or in the
    shared-Secret mode every server's)."""

    server: MotoServer | JuicefsGateway
    access_key: tuple[str, str]

    @property
    def url(self) -> str:
        return self.server.url

    def client(self) -> Any:
        return s3_client(self.url, self.access_key)

    def keys(self, bucket: str, prefix: str = PREFIX) -> dict[str, bytes]:
        """Every object under ``prefix``, with its bytes."""
        client = self.client()
        try:
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
            return {k: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}
        finally:
            client.close()


BUCKETS = ("hub-snapshots", "culled-snapshots", "two-users", "shared-secret", "migrated")


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bucket]:
    server = MotoServer(tmp_path_factory.mktemp("moto-iam") / "moto.log")
    try:
        bucket = Bucket(server, server.enforce_credentials())
        client = bucket.client()
        for name in BUCKETS:
            client.create_bucket(Bucket=name)
        client.close()
        yield bucket
    finally:
        server.stop()


@pytest.fixture(scope="module")
def juicefs_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bucket]:
    """The juicefs gateway, its root user as the store's admin (unsigned requests and
    other keys are refused)."""
    server = JuicefsGateway(tmp_path_factory.mktemp("juicefs-hub"))
    try:
        bucket = Bucket(server, server.access_key)
        server.ensure_bucket("two-users")
        yield bucket
    finally:
        server.stop()


def hub_service(home: Path, s3: Bucket, bucket: str, key_secrets: list[str]) -> dict[str, Any]:
    """The z2jh recipe's hub service (hub.services.kernel-snapshots) on a free local port,
    its placeholders filled in, its Secret's two files written under ``home``."""
    values = z2jh_values()["hub"]["services"][SERVICE]
    secrets = home / "kernel-snapshots-hub"
    secrets.mkdir(mode=0o700)
    (secrets / "aws-credentials").write_text(
        "[default]\naws_access_key_id = {}\naws_secret_access_key = {}\n".format(*s3.access_key)
    )
    (secrets / "key-secrets").write_text("\n".join(key_secrets) + "\n")
    filled = {
        "<bucket>": bucket,
        "<https://s3.example.org>": s3.url,
        "<region, e.g. us-east-1>": "us-east-1",
        "0.0.0.0": "127.0.0.1",
        "/etc/kernel-snapshots": str(secrets),
    }

    def fill(text: str) -> str:
        for placeholder, value in filled.items():
            text = text.replace(placeholder, value)
        return text

    assert values["command"][:3] == ["python3", "-m", "jupyter_ext.hubservice"]
    return {
        "name": SERVICE,
        "url": f"http://127.0.0.1:{free_port()}",
        "command": [sys.executable, *map(fill, values["command"][1:])],
        "environment": {
            **{k: fill(v) for k, v in values["environment"].items()},
            "AWS_CONFIG_FILE": "/nonexistent",
            "AWS_EC2_METADATA_DISABLED": "true",
        },
    }


def start_hub(
    home: Path,
    s3: Bucket,
    bucket: str,
    *,
    shared_secret: bool = False,
    key_secrets: tuple[str, ...] = (os.urandom(32).hex(),),
    server_options: dict[str, Any] | None = None,
    services: Sequence[dict[str, Any]] = (),
    roles: Sequence[dict[str, Any]] = (),
    **hub_options: Any,
) -> Hub:
    """A hub whose users' servers keep their snapshots in ``bucket`` of the S3 server, as
    deploy/z2jh/config.yaml deploys them: the hub service signs their requests, and the
    servers hold no bucket credentials, and encrypt with their user's key from it.
    ``shared_secret``: the old recipe instead, as issue 33 found it: the store admin's key
    in every server's environment (one Secret in singleuser.extraEnv), no encryption.
    ``server_options``: more SnapshotExtensionApp options of the servers."""
    values = z2jh_values()
    config = z2jh_server_config()
    config["SnapshotExtensionApp"].update(
        s3_bucket=bucket,
        s3_endpoint_url=s3.url,
        # moto stores objects one by one, slowly: 1 MiB chunks (about 40 per snapshot, not
        # 2000) keep every request well within the culler's timeout. Chunking is not what
        # these tests are about.
        chunk_kib=1024,
        **(server_options or {}),
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
        **values["singleuser"]["extraEnv"],
    }
    if shared_secret:
        del config["SnapshotExtensionApp"]["hub_service_url"]
        config["SnapshotExtensionApp"]["encryption_key_source"] = "none"
        environment.update(
            AWS_ACCESS_KEY_ID=s3.access_key[0],
            AWS_SECRET_ACCESS_KEY=s3.access_key[1],
            AWS_DEFAULT_REGION="us-east-1",
        )
    else:
        service = hub_service(home, s3, bucket, list(key_secrets))
        config["SnapshotExtensionApp"]["hub_service_url"] = f"{service['url']}/services/{SERVICE}/"
        services = [service, *services]
        recipe = values["hub"]["loadRoles"]
        roles = [*({"name": name, **role} for name, role in recipe.items()), *roles]
    return Hub(home, config, environment, services=services, roles=roles, **hub_options)


def stored_records(s3: Bucket, bucket: str) -> list[str]:
    """The snapshot records in the bucket, as S3 keys."""
    return sorted(key for key in s3.keys(bucket) if "/snapshots/" in key)


def refused(server: Endpoint, path: str = "api/snapshots") -> int:
    """The HTTP status with which the server refuses ``GET path`` (it must refuse)."""
    with pytest.raises(urllib.error.HTTPError) as info:
        server.api("GET", path)
    return info.value.code


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory, s3: Bucket) -> Iterator[Hub]:
    with start_hub(tmp_path_factory.mktemp("hub"), s3, "hub-snapshots") as running:
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
    alice: Endpoint, alice_snapshot: dict[str, Any], s3: Bucket
) -> None:
    assert alice_snapshot["status"] == "complete"
    assert alice_snapshot["trigger"] == "manual"
    listed = alice.client.call("GET", "")["snapshots"]
    assert [s["id"] for s in listed] == [alice_snapshot["id"]]
    # alice's: the record is under her prefix, named by the hub ($JUPYTERHUB_USER).
    assert stored_records(s3, "hub-snapshots") == [
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


def test_idle_culler_stops_a_server_whose_kernel_comes_back(tmp_path: Path, s3: Bucket) -> None:
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
    with start_hub(tmp_path, s3, "culled-snapshots", services=[culler], roles=[culler_role]) as hub:
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


def test_an_admins_kernel_shutdown_suspends_it(tmp_path: Path, s3: Bucket) -> None:
    """admin_shutdown_action = "suspend": a hub service with access to alice's server (an
    admin's tool) shuts her kernel down through the API; the kernel is suspended instead,
    and alice's next cell has her state. Her own shutdown shuts down."""
    client = s3.client()
    client.create_bucket(Bucket="admin-shutdown")
    client.close()
    ops_token = os.urandom(16).hex()
    ops = {"name": "ops", "api_token": ops_token}
    ops_role = {"name": "ops", "scopes": ["access:servers"], "services": ["ops"]}
    with start_hub(
        tmp_path,
        s3,
        "admin-shutdown",
        server_options={"admin_shutdown_action": "suspend"},
        services=[ops],
        roles=[ops_role],
    ) as hub:
        alice = hub.add_user("alice")
        hub.start_server("alice")
        kernel = alice.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
        ws_execute(alice, kernel, "x = 6 * 7")
        Endpoint(alice.url, ops_token).api("DELETE", f"api/kernels/{kernel}")
        assert alice.client.call("GET", f"kernels/{kernel}")["state"] == "suspended"
        assert [k["id"] for k in alice.api("GET", "api/kernels")] == [kernel]
        [snapshot] = alice.client.call("GET", "", trigger="admin-shutdown")["snapshots"]
        assert snapshot["kernel_id"] == kernel
        assert ws_execute(alice, kernel, "print(x)") == "42\n"
        alice.api("DELETE", f"api/kernels/{kernel}")
        assert alice.api("GET", "api/kernels") == []


# Restores read the store, not the images a snapshot leaves on its server.
NO_CACHE = {"image_cache_max_bytes": 0}


def attack_from_alice(hub: Hub, alice: Endpoint, bucket: str, bob_keys: list[str]) -> Any:
    """Run tests/support/hub_attack.py in a kernel of alice's; what each attempt got."""
    kernel = alice.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
    code = (ROOT / "tests" / "support" / "hub_attack.py").read_text()
    code += f"\nprint(json.dumps(attack({bucket!r}, {bob_keys!r})))\n"
    try:
        out = ws_execute(alice, kernel, code)
    except Exception as exc:
        log = "\n".join(hub.log().splitlines()[-80:])
        raise AssertionError(
            f"the attack cell failed ({exc!r}); the hub's log ends:\n{log}"
        ) from exc
    return json.loads(out)


def command_in(server: Endpoint, *args: str) -> dict[str, Any]:
    """``jupyter snapshot ARGS`` run in a kernel of the server (with its environment, as in
    a terminal of it): its returncode, stdout and stderr."""
    kernel = server.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
    command = [str(Path(sys.executable).with_name("jupyter-snapshot")), *args]
    code = (
        "import json, subprocess\n"
        f"done = subprocess.run({command!r}, capture_output=True, text=True)\n"
        "print(json.dumps({'returncode': done.returncode, 'stdout': done.stdout, "
        "'stderr': done.stderr}))"
    )
    done: dict[str, Any] = json.loads(ws_execute(server, kernel, code, timeout=300))
    server.api("DELETE", f"api/kernels/{kernel}")
    return done


def doctor_says(hub: Hub, server: Endpoint) -> dict[str, Any]:
    """`jupyter snapshot doctor`'s checks of the bucket credentials, of the store's
    encryption and of its S3 server, by name, run in a kernel of the server."""
    checks = json.loads(command_in(server, "doctor", "--json")["stdout"])
    names = ("bucket credentials", "store encryption", "store server")
    return {c["name"]: c for c in checks if c["name"] in names}


def bob_with_a_secret(hub: Hub) -> tuple[Endpoint, dict[str, Any], str]:
    """bob's server, and a snapshot of his kernel holding a secret (also in his cell)."""
    secret = "bob-secret-" + os.urandom(8).hex()
    bob = hub.add_user("bob")
    hub.start_server("bob")
    kernel = bob.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
    ws_execute(bob, kernel, f"secret = {secret!r}")
    job = bob.client.call("POST", "", body={"kernel_id": kernel})["job"]
    snapshot: dict[str, Any] = follow(bob, job)["result"]
    assert snapshot["status"] == "complete", {k: v for k, v in snapshot.items() if "error" in k}
    return bob, snapshot, secret


def bucket_hits(s3: Bucket, bucket: str, needle: str) -> list[str]:
    """The objects of the whole bucket (every one, its raw bytes, read with the store
    admin's key) that hold ``needle`` in the clear or in a zstd frame."""
    return plaintext_hits(s3.keys(bucket, ""), needle.encode())


def plaintext_hits(objects: dict[str, bytes], needle: bytes) -> list[str]:
    """The keys of the objects that hold ``needle`` as it is or inside a zstd frame (how a
    pack's chunks are compressed): what anyone who can read the bucket finds."""
    import zstandard

    hits = []
    for key, data in objects.items():
        found = needle in data
        start = data.find(b"\x28\xb5\x2f\xfd")
        while not found and start >= 0:
            try:
                reader = zstandard.ZstdDecompressor().stream_reader(data[start:])
                found = needle in reader.read(1 << 30)
            except zstandard.ZstdError:
                pass
            start = data.find(b"\x28\xb5\x2f\xfd", start + 1)
        if found:
            hits.append(key)
    return hits


REFUSED_BY_THE_SERVICE = (
    "DeleteObjects, the body swapped for bob's keys",
    "DeleteObjects with a DTD entity",
    "DeleteObjects, an element inside a key",
    "a PUT of an unsigned payload",
)
COPY = "a PUT turned into a copy of bob's record by an unsigned header"
EXTRACT = "a tar extracted over bob's record by an unsigned header"


@pytest.mark.parametrize("server", ["moto", "juicefs"])
def test_alice_cannot_reach_bobs_snapshots(
    tmp_path: Path, server: str, request: pytest.FixtureRequest
) -> None:
    """The recipe's hub service: alice's kernel, holding all her server holds, cannot list,
    read, copy, overwrite or delete bob's objects, nor get them signed, nor get bob's key;
    bob's snapshot restores afterwards. On two S3 servers (moto with IAM enforcement, the
    juicefs gateway), with the red team's requests (hub_attack.red_team): signed for her,
    changed after. Where the server still lets one through (moto copies on an unsigned
    x-amz-copy-source, whatever is signed), doctor says plainly that this store cannot
    keep users apart, and the copy holds only ciphertext."""
    from jupyter_ext.core.store.userkey import derive_user_key

    s3: Bucket = request.getfixturevalue("s3" if server == "moto" else "juicefs_s3")
    bucket, secrets = "two-users", [os.urandom(32).hex(), os.urandom(32).hex()]
    # The gateway implements no server-side encryption (the recipe asks for AES256).
    options = NO_CACHE if server == "moto" else {**NO_CACHE, "s3_server_side_encryption": ""}
    with start_hub(tmp_path, s3, bucket, key_secrets=tuple(secrets), server_options=options) as hub:
        bob, snapshot, secret = bob_with_a_secret(hub)
        before = s3.keys(bucket, f"{PREFIX}/users/bob/")
        assert len(before) >= 3  # his pack(s), his record and his wrapped master key
        # Encrypted with bob's key from the service (derived from the current secret).
        bob_key = derive_user_key(bytes.fromhex(secrets[0]), "bob")
        assert [k for k in before if "/keys/" in k] == [f"{PREFIX}/users/bob/keys/{bob_key[0]}"]
        assert bucket_hits(s3, bucket, secret) == []
        alice = hub.add_user("alice")
        hub.start_server("alice")
        got = attack_from_alice(hub, alice, bucket, sorted(before))
        said = json.dumps(got)
        results = got["results"]
        assert got["token"], "alice's kernel holds her server's hub token"
        assert got["keys"] == 0, "no bucket credentials anywhere in alice's server"
        doctor = doctor_says(hub, alice)
        assert doctor["bucket credentials"]["ok"] is True
        assert "key from the hub service" in doctor["store encryption"]["detail"]
        # Her own prefix works through the service, not otherwise: the S3 server enforces.
        assert results.pop("hub service: list alice") == "allowed"
        assert results.pop("unsigned: list alice").startswith("refused: ")
        alice_key = json.loads(results.pop("key").removeprefix("allowed: "))
        assert alice_key == json.loads(results.pop("key ?user=bob").removeprefix("allowed: "))
        expected = [derive_user_key(bytes.fromhex(s), "alice") for s in secrets]
        assert (alice_key["current"]["id"], alice_key["previous"][0]["id"]) == tuple(
            kid for kid, _ in expected
        )
        # Nothing of bob's keys (any secret's) in what alice got (their ids are public:
        # the names of his key objects).
        bobs = [derive_user_key(bytes.fromhex(s), "bob")[1] for s in secrets]
        assert not [k for k in bobs if base64.b64encode(k).decode() in said or k.hex() in said]
        # The red team: what depends on a body, the service no longer signs; a signature
        # serves only its own request.
        for what in REFUSED_BY_THE_SERVICE:
            assert results.pop(f"red team: {what}") == "refused: 403 by the service", what
        assert results.pop("red team: a signature replayed to bob's record") == "sent: 403"
        copy, extract = results.pop(f"red team: {COPY}"), results.pop(f"red team: {EXTRACT}")
        copied = base64.b64decode(results.pop("red team: what the copy holds"))
        record = next(k for k in before if "/snapshots/" in k)
        server_said = doctor["store server"]
        if server == "juicefs":
            # MinIO's code acts on unsigned x-amz-* headers: the guards the service signs
            # into every PUT stop both (a copy condition no ETag meets; a second value of
            # a signed header), and doctor says what the server does.
            assert copy == "sent: 412"
            assert extract == "sent: 403"
            assert copied == b""
            assert "the service's guards hold" in server_said["detail"]
            assert "ignores If-None-Match" in server_said["detail"]
        else:
            # moto copies whatever is signed (the guard's copy condition it ignores); the
            # extraction header, a second value of a signed one, breaks the signature.
            # Said plainly, and only ciphertext moved.
            assert copy == "sent: 200"
            assert extract == "sent: 403"
            assert copied == before[record]
            assert "CANNOT keep a hub's users apart" in server_said["detail"]
            assert plaintext_hits({"copied": copied}, secret.encode()) == []
        assert server_said["ok"] is False
        allowed = {what: r for what, r in results.items() if not r.startswith("refused: ")}
        assert not allowed
        assert results["sign {}"] == results["sign {'user': 'bob'}"] == "refused: 403"
        # The refused key once, decoded, its % not doubled (issue 45 item 4).
        message = results.pop("a refusal's message")
        assert message.startswith(
            f"refused: 403: Refused to sign GET s3://{bucket}/{PREFIX}/users/bob/a b%25 for "
            "alice: that key is outside the user's prefix.\nWhat to do: "
        )
        assert message.count("users/bob") == 1
        assert "%%" not in message
        # Two clients (unsigned, the service) x 9 attempts, less the two above, 2 signings.
        assert len(results) == 2 * 9 - 2 + 2, results
        # Nothing of bob's changed, and his snapshot comes back.
        assert s3.keys(bucket, f"{PREFIX}/users/bob/") == before
        assert s3.keys(bucket, f"{PREFIX}/users/alice/stolen") == {}
        # A new server of bob's (nothing of the old one's memory) asks the service again.
        hub.api("DELETE", "users/bob/server")
        hub.wait_server("bob", lambda state: state is None)
        hub.start_server("bob")
        answer = bob.client.call("POST", f"{snapshot['id']}/restore", body={})
        restored = follow(bob, answer["job"])["result"]
        assert restored["source"] == "store"
        assert ws_execute(bob, restored["kernel_id"], "print(secret)") == secret + "\n"
        assert bucket_hits(s3, bucket, secret) == []


def test_shared_secret_mode_lets_alice_reach_bobs_snapshots(tmp_path: Path, s3: Bucket) -> None:
    """The old recipe, one Secret of bucket credentials in every server: the same code in
    alice's kernel reads bob's secret in his objects and deletes them. (What the test above
    refutes, on the same S3 server: its enforcement is what makes the refusals real; and
    without encryption the bucket holds bob's secret, which the grep above finds.)"""
    bucket = "shared-secret"
    with start_hub(tmp_path, s3, bucket, shared_secret=True, server_options=NO_CACHE) as hub:
        bob, snapshot, secret = bob_with_a_secret(hub)
        before = s3.keys(bucket, f"{PREFIX}/users/bob/")
        alice = hub.add_user("alice")
        hub.start_server("alice")
        results = attack_from_alice(hub, alice, bucket, sorted(before))["results"]
        doctor = doctor_says(hub, alice)["bucket credentials"]
        assert doctor["ok"] is False
        assert "AWS_ACCESS_KEY_ID" in doctor["detail"]
        assert "Unsafe for multi-user" in doctor["detail"]
        record = next(k for k in before if "/snapshots/" in k)
        read = results[f"key 0: read {record}"]
        assert read.startswith("allowed: ")
        stolen = {record: base64.b64decode(read.removeprefix("allowed: "))}
        assert plaintext_hits(stolen, secret.encode()) == [record]
        assert bucket_hits(s3, bucket, secret)  # and anyone who reads the bucket
        for what in ("list bob", "copy", "overwrite", "delete", "delete many"):
            assert results[f"key 0: {what}"] == "allowed", what
        assert s3.keys(bucket, f"{PREFIX}/users/bob/") == {}
        assert bob.client.call("GET", "")["snapshots"] == []
        with pytest.raises(SnapshotNotFoundError, match="There is no snapshot"):
            bob.client.call("POST", f"{snapshot['id']}/restore", body={})


def test_a_user_migrates_their_unencrypted_snapshots_through_the_hub(
    tmp_path: Path, s3: Bucket
) -> None:
    """A snapshot of the old recipe (unencrypted; put here with the store admin's key, as
    the old recipe's servers wrote) under a user whose name is escaped in the prefix: the
    user's server, with the recipe, reads none of it; `jupyter snapshot store encrypt
    --s3-bucket B` run in a kernel of theirs (as in a terminal: the prefix and the "hub"
    key source from the server's configuration, the hub service signing every request)
    stores it again encrypted, and the server lists it."""
    from jupyter_ext.core.store import S3Store
    from jupyter_ext.core.store.scope import user_prefix
    from jupyter_ext.core.store.userkey import derive_user_key

    from .support.stores import SMALL_CHUNKS, make_snapshot, random_pages

    bucket, user, secret = "migrated", "carol@example.org", os.urandom(32).hex()
    prefix = f"{PREFIX}/{user_prefix(user)}"
    assert prefix == f"{PREFIX}/users/_carol_40example.org"
    (tmp_path / "old").mkdir()
    admin = S3Store(bucket, prefix, client=s3.client(), chunking=SMALL_CHUNKS)
    old = admin.put(make_snapshot(tmp_path / "old", random_pages(random.Random(3), 64)))
    admin.close()
    with start_hub(tmp_path, s3, bucket, key_secrets=(secret,)) as hub:
        carol = hub.add_user(user)
        hub.start_server(user)
        assert carol.client.call("GET", "")["snapshots"] == []
        done = command_in(carol, "store", "encrypt", "--s3-bucket", bucket)
        assert done["returncode"] == 0, done
        assert f"encrypted {old.manifest.id}" in done["stdout"]
        assert "1 snapshot(s) encrypted; key: the hub service" in done["stdout"]
        listed = carol.client.call("GET", "")["snapshots"]
        assert [(s["id"], s["status"]) for s in listed] == [(old.manifest.id, "complete")]
    objects = s3.keys(bucket, f"{prefix}/")
    assert [k for k in objects if "/keys/" in k] == [
        f"{prefix}/keys/{derive_user_key(bytes.fromhex(secret), user)[0]}"
    ]
    records = {k: v for k, v in objects.items() if "/snapshots/" in k}
    assert list(records) == [f"{prefix}/snapshots/{old.manifest.id}.json"]
    assert all(v.startswith(b"JKSSEAL1") for v in records.values())
