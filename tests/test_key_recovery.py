"""The key is not lost with the node (issue 46 item 5). An S3 store outlives the machine;
with the default key source, a key file on that machine, its snapshots did not: a second
machine answered "encrypted with another key". The store keeps a copy of its key under
the user's passphrase (``jupyter snapshot store passphrase``), which another machine opens
(``jupyter snapshot store recover``); until that copy exists, the panel's policy, doctor
and the server's log say so, with the command.

Node loss as docs/storage.md tells it: a server with its own home (its key file) takes a
snapshot and is lost with its home; a second server with another home and the same
configuration, and what the docs tell the user to keep (the passphrase), restores it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from jupyter_ext.core.store.keys import KEEP_PASSPHRASE, RECOVER
from testkit.processes import MotoServer, ServerProcess

from .support.servers import follow, ws_execute

pytestmark = pytest.mark.usefixtures("criu")
BUCKET = "kernel-snapshots-keys"
PASSPHRASE = "correct horse battery staple"


def node(home: Path, notebooks: Path, moto: MotoServer) -> ServerProcess:
    """A server as a user configures one: an S3 store, nothing said of keys (the default:
    a key file in this home). The same configuration in the user's config directory, where
    the CLI reads it."""
    config: dict[str, Any] = {
        "SnapshotExtensionApp": {
            "store": "s3",
            "s3_bucket": moto.ensure_bucket(BUCKET),
            "s3_endpoint_url": moto.url,
            "s3_region": "us-east-1",
            "owner": "alice",
            "encryption_key_source": "file",
            "idle_suspend_after": 0,
            "snapshot_before_shutdown": False,
        }
    }
    (home / "config").mkdir(parents=True, exist_ok=True)
    (home / "config" / "jupyter_server_config.json").write_text(json.dumps(config))
    return ServerProcess(home, notebooks, config)


def cli(server: ServerProcess, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """`jupyter snapshot ...` as the user runs it on that machine (its home's dirs)."""
    return subprocess.run(
        [sys.executable, "-m", "jupyter_ext.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=server.env,
        timeout=300,
    )


def key_notice(server: ServerProcess, said: bool) -> str:
    """The policy's key notice once it is ``said`` (or not), as the server reads it from
    the store: again in the background at each request (a stalled store never holds one
    up), so a change shows at a later one."""
    deadline = time.monotonic() + 60
    while True:
        notice = str(server.client.call("GET", "policy")["key_notice"])
        if bool(notice) == said or time.monotonic() > deadline:
            return notice
        time.sleep(0.2)


def test_snapshots_outlive_the_node_with_the_passphrase(moto: MotoServer, tmp_path: Path) -> None:
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    node_a = node(tmp_path / "node-a", notebooks, moto)
    session = node_a.api(
        "POST",
        "api/sessions",
        {"path": "n.ipynb", "type": "notebook", "kernel": {"name": "python3-snapshot"}},
    )
    kernel = session["kernel"]["id"]
    ws_execute(node_a, kernel, "import numpy as np; a = np.arange(10**6); kept = 'from a'")
    job = node_a.client.call("POST", "", body={"kernel_id": kernel})["job"]
    snapshot = follow(node_a, job)["result"]

    # Until a copy is kept: the panel's policy, doctor and the log say so, with the command.
    notice = key_notice(node_a, said=True)
    assert "only on this machine" in notice
    assert KEEP_PASSPHRASE in notice
    assert notice in node_a.log()
    doctor = cli(node_a, "doctor").stdout
    assert "[warn] store key copy: The key of your snapshots in s3://" in doctor
    assert f"fix: {KEEP_PASSPHRASE}" in doctor

    short = cli(node_a, "store", "passphrase", stdin="short\n")
    assert short.returncode == 1
    assert "too short" in short.stderr
    kept = cli(node_a, "store", "passphrase", stdin=PASSPHRASE + "\n")
    assert kept.returncode == 0, kept.stderr
    assert "kept there under your passphrase" in kept.stdout
    assert key_notice(node_a, said=False) == ""
    assert "store key copy" not in cli(node_a, "doctor").stdout

    node_a.kill_node()  # the node is lost, its home with it: the key file too
    shutil.rmtree(tmp_path / "node-a")

    node_b = node(tmp_path / "node-b", notebooks, moto)
    lost = node_b.client.call("GET", "")
    assert lost["snapshots"] == []
    assert "encrypted with another key" in lost["store_error"]
    assert RECOVER in lost["store_error"]
    wrong = cli(node_b, "store", "recover", stdin="not the passphrase\n")
    assert wrong.returncode == 1
    assert "does not open" in wrong.stderr
    recovered = cli(node_b, "store", "recover", stdin=PASSPHRASE + "\n")
    assert recovered.returncode == 0, recovered.stderr
    assert "1 snapshot(s) can be restored" in recovered.stdout

    listed = node_b.client.call("GET", "")["snapshots"]
    assert [s["id"] for s in listed] == [snapshot["id"]]
    answer = node_b.client.call("POST", f"{snapshot['id']}/restore", body={})
    restored = follow(node_b, answer["job"])["result"]["kernel_id"]
    assert ws_execute(node_b, restored, "print(kept, a.sum())").split() == [
        "from",
        "a",
        "499999500000",
    ]
    # This machine's key opens the store now; the passphrase copy stays for the next one.
    assert key_notice(node_b, said=False) == ""
    node_b.stop()
