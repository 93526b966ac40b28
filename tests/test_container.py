"""The Zero to JupyterHub user pod of ``deploy/z2jh/config.yaml`` in a real container
runtime: the image of ``deploy/Dockerfile``, the pod rendered by KubeSpawner and run by
``podman kube play`` as uid 1000 with Kubernetes' capability sets, snapshots in an S3
server (moto) on the host. Run by ``scripts/container-tests.sh`` (the CI stage that builds
the image); skipped elsewhere, saying so. How podman stands in for Kubernetes:
``tests/pods.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from jupyter_ext.core.errors import SnapshotError

from .pods import Pod, chart_values, pod_network, render_pod
from .servers import follow, ws_execute

IMAGE = os.environ.get("JKS_CONTAINER_IMAGE", "")
pytestmark = [
    pytest.mark.skipif(
        not IMAGE, reason="needs the image and podman of scripts/container-tests.sh"
    ),
    pytest.mark.timeout(900),
]
USER = "alice"
BUCKET = "pod-snapshots"
NOTEBOOK = "analysis.ipynb"

MakePod = Callable[..., Pod]


class Moto:
    """moto's S3 server on the host, reachable from the pods at their network's gateway."""

    def __init__(self, log: Path) -> None:
        from jupyter_ext.testing import free_port

        self.port = free_port()
        self._log = log.open("wb")
        moto_server = Path(sys.executable).with_name("moto_server")
        self.process = subprocess.Popen(
            [str(moto_server), "-H", "0.0.0.0", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.pod_url = f"http://{pod_network()}:{self.port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client().create_bucket(Bucket=BUCKET)
                break
            except Exception:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise
                time.sleep(0.2)

    def client(self) -> Any:
        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def records(self) -> list[str]:
        listed = self.client().list_objects_v2(Bucket=BUCKET).get("Contents", [])
        return sorted(o["Key"] for o in listed if "/snapshots/" in o["Key"])

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Moto]:
    server = Moto(tmp_path_factory.mktemp("moto") / "moto.log")
    yield server
    server.close()


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """The user's home volume (a PVC in Kubernetes), with a notebook whose metadata say
    python3, as every notebook made by a plain JupyterLab does."""
    home = tmp_path / "home"
    home.mkdir()
    notebook = {
        "cells": [],
        "metadata": {
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (home / NOTEBOOK).write_text(json.dumps(notebook))
    subprocess.run(["chown", "-R", "1000:100", str(home)], check=True)
    for parent in home.parents:
        parent.chmod(parent.stat().st_mode | 0o005)
    return home


@pytest.fixture
def make_pod(tmp_path: Path, moto: Moto, home: Path) -> Iterator[MakePod]:
    """``make_pod(edit=None)``: a fresh user pod from config.yaml's values, ``edit``
    changing the values first (the misconfigurations)."""
    pods: list[Pod] = []

    def make(edit: Callable[[dict[str, Any]], None] | None = None) -> Pod:
        values = chart_values()
        if edit is not None:
            edit(values)
        config = values["singleuser"]["extraFiles"]["jupyter-server-config"]["data"]
        config["SnapshotExtensionApp"].update(
            s3_bucket=BUCKET, s3_endpoint_url=moto.pod_url, chunk_kib=1024
        )
        # No hub in this stage, so no hub service to sign requests or give the key: the pod
        # gets the store's credentials itself (the shared-Secret way) and keeps its key in a
        # file on its home volume (the service: tests/test_jupyterhub.py).
        del config["SnapshotExtensionApp"]["hub_service_url"]
        config["SnapshotExtensionApp"]["encryption_key_source"] = "file"
        config_file = tmp_path / f"server-config-{uuid.uuid4().hex[:6]}.json"
        config_file.write_text(json.dumps(config))
        config_file.chmod(0o644)
        manifest = render_pod(
            values,
            image=IMAGE,
            user=USER,
            home=home,
            server_config=config_file,
            environment={
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true",
            },
        )
        grace = values["hub"]["config"]["KubeSpawner"]["delete_grace_period"]
        pod = Pod(manifest, tmp_path, home=home, grace=grace)
        pods.append(pod)
        pod.wait_ready()
        return pod

    yield make
    for pod in pods:
        pod.close()


def _dockerfile_arg(name: str) -> str:
    dockerfile = Path(__file__).resolve().parent.parent / "deploy" / "Dockerfile"
    for line in dockerfile.read_text().splitlines():
        if line.startswith(f"ARG {name}="):
            return line.split("=", 1)[1]
    raise AssertionError(f"no ARG {name} in deploy/Dockerfile")


def open_notebook(pod: Pod) -> str:
    """What JupyterLab does when a user opens the notebook: a session with the kernel its
    metadata name (python3). Returns the kernel id."""
    session = pod.server.api(
        "POST",
        "api/sessions",
        {"path": NOTEBOOK, "type": "notebook", "name": NOTEBOOK, "kernel": {"name": "python3"}},
    )
    kernel_id: str = session["kernel"]["id"]
    return kernel_id


def snapshot(pod: Pod, kernel_id: str) -> dict[str, Any]:
    """Snapshot a kernel through the REST API; its job must succeed."""
    job = pod.server.client.call("POST", "", body={"kernel_id": kernel_id})["job"]
    return follow(pod.server, job)


def test_recipe_pod_is_rendered_as_kubernetes_would_run_it(make_pod: MakePod) -> None:
    """KubeSpawner's manifest from config.yaml: uid 1000, not privileged, only the two
    capabilities, no privileged init container; in the pod the server has no effective
    capability, both in its bounding set, no no_new_privs, no seccomp filter."""
    pod = make_pod()
    spec = pod.manifest["spec"]
    assert not spec.get("initContainers"), "a privileged init container is still on"
    context = spec["containers"][0]["securityContext"]
    assert context["runAsUser"] == 1000
    assert context["privileged"] is False
    assert context["capabilities"] == {"add": ["CHECKPOINT_RESTORE", "SETPCAP"], "drop": ["ALL"]}
    status = pod.exec("grep", "-E", "^(Uid|CapEff|CapBnd|NoNewPrivs|Seccomp):", "/proc/self/status")
    fields = dict(line.split(":\t") for line in status.stdout.strip().splitlines())
    assert fields["Uid"].split()[0] == "1000"
    assert int(fields["CapEff"], 16) == 0
    assert int(fields["CapBnd"], 16) == (1 << 40) | (1 << 8)
    assert fields["NoNewPrivs"] == "0"
    assert fields["Seccomp"] == "0"
    # The image's own command (a hub's pods run it; this stage has no hub) is there, at
    # the Dockerfile's JupyterHub version.
    singleuser = pod.exec("jupyterhub-singleuser", "--version")
    assert singleuser.returncode == 0, singleuser.stderr
    assert singleuser.stdout.strip() == _dockerfile_arg("JUPYTERHUB_VERSION")


def test_doctor_in_the_pod_says_snapshots_work(make_pod: MakePod) -> None:
    pod = make_pod()
    out = pod.exec("jupyter", "snapshot", "doctor", "--json")
    checks = {c["name"]: c for c in json.loads(out.stdout)}
    failed = [c for c in checks.values() if c["required"] and not c["ok"]]
    assert not failed, failed
    assert out.returncode == 0
    assert "read-only" in checks["/proc/sys"]["detail"]
    assert checks["/proc/sys"]["ok"]
    text = pod.exec("jupyter", "snapshot", "doctor").stdout
    assert "Snapshots work on this machine." in text


def test_kernel_state_across_pods_and_the_culled_pods_snapshot(
    make_pod: MakePod, moto: Moto
) -> None:
    """A notebook whose metadata say python3 gets a snapshot kernel; its snapshot goes to
    S3; the pod is deleted as the culler's stop deletes it (SIGTERM, grace period), and
    its server snapshots the kernel on the way out; a fresh pod offers that snapshot for
    the notebook and restores it, and the manual one too, each with its state."""
    pod = make_pod()
    kernel = open_notebook(pod)
    assert ws_execute(pod.server, kernel, "x = 42\nprint(x)") == "42\n"
    manual = snapshot(pod, kernel)
    manual_id = manual["result"]["id"]
    assert f"kernel-snapshots/users/{USER}/snapshots/{manual_id}.json" in moto.records()
    ws_execute(pod.server, kernel, "x = 43")

    took = pod.delete()
    assert took < pod.grace, f"the server was killed at the end of its grace ({took:.0f} s)"
    assert "snapshots before shutdown: ['done']" in pod.log(), pod.log()

    fresh = make_pod()
    offered = fresh.server.client.call("GET", "", path=NOTEBOOK)["snapshots"]
    assert [(s["trigger"], s["status"]) for s in offered] == [
        ("before-shutdown", "complete"),
        ("manual", "complete"),
    ], offered
    assert offered[0]["kernel_id"] == kernel
    restored = follow(
        fresh.server,
        fresh.server.client.call("POST", f"{offered[0]['id']}/restore", body={})["job"],
    )["result"]
    assert ws_execute(fresh.server, restored["kernel_id"], "print(x)") == "43\n"
    # The restored kernel is a snapshot kernel in this pod too.
    snapshot(fresh, restored["kernel_id"])
    fresh.server.api("DELETE", f"api/kernels/{restored['kernel_id']}")

    answer = fresh.server.client.call("POST", f"{manual_id}/restore", body={})
    first = follow(fresh.server, answer["job"])["result"]
    assert ws_execute(fresh.server, first["kernel_id"], "print(x)") == "42\n"


def _seccomp_runtime_default(values: dict[str, Any]) -> None:
    context = values["hub"]["config"]["KubeSpawner"]["extra_container_config"]["securityContext"]
    context["seccompProfile"] = {"type": "RuntimeDefault"}


def _no_privilege_escalation(values: dict[str, Any]) -> None:
    values["singleuser"]["allowPrivilegeEscalation"] = False
    context = values["hub"]["config"]["KubeSpawner"]["extra_container_config"]["securityContext"]
    context["allowPrivilegeEscalation"] = False


def _no_checkpoint_restore(values: dict[str, Any]) -> None:
    context = values["hub"]["config"]["KubeSpawner"]["extra_container_config"]["securityContext"]
    context["capabilities"]["add"] = ["SETPCAP"]


@pytest.mark.parametrize(
    ("edit", "doctor_check", "words", "fix"),
    [
        (_seccomp_runtime_default, "seccomp", "seccomp profile", "type: Unconfined"),
        (_no_privilege_escalation, "criu capabilities", "no_new_privs", "allowPrivilegeEscalation"),
        (_no_checkpoint_restore, "criu", "bounding set", "CHECKPOINT_RESTORE"),
    ],
    ids=["seccomp-runtime-default", "allow-privilege-escalation-false", "no-checkpoint-restore"],
)
def test_misconfigured_pod_names_its_setting(
    make_pod: MakePod,
    edit: Callable[[dict[str, Any]], None],
    doctor_check: str,
    words: str,
    fix: str,
) -> None:
    """Each setting that stops CRIU: doctor fails the check that names it, and a snapshot
    of a notebook's kernel fails with an error that names it and its fix."""
    pod = make_pod(edit)
    doctor = pod.exec("jupyter", "snapshot", "doctor", "--json")
    assert doctor.returncode != 0
    checks = {c["name"]: c for c in json.loads(doctor.stdout)}
    assert not checks[doctor_check]["ok"]
    assert words in checks[doctor_check]["detail"], checks[doctor_check]
    assert fix in checks[doctor_check]["fix"], checks[doctor_check]

    kernel = open_notebook(pod)
    assert ws_execute(pod.server, kernel, "print(1 + 1)") == "2\n"
    with pytest.raises(SnapshotError) as failed:
        snapshot(pod, kernel)
    assert words in failed.value.message, failed.value
    assert fix in failed.value.hint, failed.value
    # The kernel is not harmed by the failed snapshot.
    assert ws_execute(pod.server, kernel, "print(2 + 2)") == "4\n"
