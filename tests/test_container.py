"""The Zero to JupyterHub user pod of ``deploy/z2jh/config.yaml`` in a real container
runtime: the image of ``deploy/Dockerfile``, the pod rendered by KubeSpawner and run by
``podman kube play`` as uid 1000 with Kubernetes' capability sets, snapshots in an S3
server (moto) on the host. Run by ``scripts/container-tests.sh`` (the CI stage that builds
the image); skipped elsewhere, saying so. How podman stands in for Kubernetes:
``tests/support/pods.py``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shlex
import signal
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
from jupyter_ext.core.protocol.environment import ENV_KEY
from testkit.processes import RUN_KEY

from .support.pods import AGENT_CSI_DRIVER, AgentPod, Pod, chart_values, pod_network, render_pod
from .support.servers import follow, ws_execute

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
        from testkit.processes import free_port

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
    """``make_pod(edit=None, agent=None, user=USER)``: a fresh user pod from the recipe's
    values, ``edit`` changing them first (the misconfigurations): in-pod mode
    (config.yaml with inpod.yaml), or agent mode (config.yaml alone) with ``agent``'s
    socket where the CSI volume would be."""
    pods: list[Pod] = []

    def make(
        edit: Callable[[dict[str, Any]], None] | None = None,
        agent: AgentPod | None = None,
        user: str = USER,
    ) -> Pod:
        values = chart_values() if agent is not None else chart_values("inpod.yaml")
        if edit is not None:
            edit(values)
        config = values["singleuser"]["extraFiles"]["jupyter-server-config"]["data"]
        config["SnapshotExtensionApp"].update(
            s3_bucket=BUCKET, s3_endpoint_url=moto.pod_url, chunk_kib=1024
        )
        # No hub in this stage, so no hub service to sign requests or give the key: the pod
        # gets the store's credentials itself (the shared-Secret way) and its user's key from
        # its environment, as a spawner would set it (the service: tests/test_jupyterhub.py).
        # One key per user for the whole stage: the tests share the bucket, and a user's
        # store keyed by an earlier test's key would be refused (rightly) as another key's.
        del config["SnapshotExtensionApp"]["hub_service_url"]
        config["SnapshotExtensionApp"]["encryption_key_source"] = "env"
        config_file = tmp_path / f"server-config-{uuid.uuid4().hex[:6]}.json"
        config_file.write_text(json.dumps(config))
        config_file.chmod(0o644)
        manifest = render_pod(
            values,
            image=IMAGE,
            user=user,
            home=home,
            server_config=config_file,
            environment={
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true",
                ENV_KEY: user_key(user),
            },
        )
        grace = values["hub"]["config"]["KubeSpawner"]["delete_grace_period"]
        csi = {AGENT_CSI_DRIVER: agent.socket_dir} if agent is not None else {}
        pod = Pod(manifest, tmp_path, home=home, grace=grace, csi_dirs=csi)
        pods.append(pod)
        pod.wait_ready()
        return pod

    yield make
    for pod in pods:
        pod.close()


def user_key(user: str) -> str:
    """The user's key-encryption key for this test run (base64), derived from the run's."""
    return base64.b64encode(hashlib.sha256(f"{RUN_KEY}\0{user}".encode()).digest()).decode()


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


# -- agent mode: user pods at Pod Security baseline, the node agent does the checkpointing


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[AgentPod]:
    """The node agent of deploy/agent/agent.yaml, privileged, in the node's PID namespace."""
    running = AgentPod(IMAGE, tmp_path / "agent")
    yield running
    running.close()


def _status(pod: Pod) -> dict[str, str]:
    status = pod.exec("grep", "-E", "^(Uid|CapEff|CapBnd|NoNewPrivs|Seccomp):", "/proc/self/status")
    return dict(line.split(":\t") for line in status.stdout.strip().splitlines())


def _host_pid(pod: Pod, pod_pid: int) -> int:
    """The node's pid of the process that is ``pod_pid`` in ``pod``'s server container."""
    container = subprocess.run(
        ["podman", "inspect", "--format", "{{.Id}}", pod.container],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if container not in (entry / "cgroup").read_text():
                continue
            status = (entry / "status").read_text()
        except OSError:
            continue
        ns_pids = next(line for line in status.splitlines() if line.startswith("NSpid:"))
        if ns_pids.split()[-1] == str(pod_pid):
            return int(entry.name)
    raise LookupError(pod_pid)


def _agent_call(pod: Pod, socket: str, code: str) -> list[str]:
    """Run ``code`` (with ``call``, the requests and ``SOCKET`` at hand) in the pod as its
    user; the messages of the errors it printed, one a line."""
    prelude = (
        "from pathlib import Path\n"
        "from jupyter_ext.core.agent.client import AgentCriu, call\n"
        "from jupyter_ext.core.agent.protocol import DumpRequest, AgentRestoreRequest\n"
        "from jupyter_ext.core.errors import SnapshotError\n"
        f"SOCKET = Path({socket!r})\n"
    )
    out = pod.exec("python3", "-c", prelude + code)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()


def test_baseline_pod_kernel_moves_through_the_agent_to_a_fresh_pod_on_another_node(
    make_pod: MakePod, agent: AgentPod, moto: Moto, tmp_path: Path
) -> None:
    """config.yaml's user pod meets Pod Security baseline (no capability, no_new_privs,
    the runtime's default seccomp filter, no host namespace); its notebook's kernel, x = 42
    and a NumPy array, is snapshotted through the node agent into S3, x becomes 43, the pod
    is deleted (its server snapshots the kernel on the way out, through the agent too), and
    a fresh pod on another node (another agent, with the cluster's seal key: the same
    Secret) restores the before-shutdown snapshot (x = 43) and the manual one (x = 42),
    each into its own namespaces and with its seccomp filter."""
    pod = make_pod(agent=agent)
    spec = pod.manifest["spec"]
    assert not any(spec.get(key) for key in ("hostPID", "hostNetwork", "hostIPC"))
    context = spec["containers"][0]["securityContext"]
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    assert context["privileged"] is False
    fields = _status(pod)
    assert int(fields["CapEff"], 16) == int(fields["CapBnd"], 16) == 0
    assert fields["NoNewPrivs"] == "1"
    assert fields["Seccomp"] == "2"

    kernel = open_notebook(pod)
    setup = "import numpy as np\nx = 42\na = np.arange(1_000_000)\nprint(x, int(a.sum()))"
    assert ws_execute(pod.server, kernel, setup) == "42 499999500000\n"
    manual = snapshot(pod, kernel)["result"]
    assert manual["frozen_seconds"] > 0
    assert f"kernel-snapshots/users/{USER}/snapshots/{manual['id']}.json" in moto.records()
    ws_execute(pod.server, kernel, "x = 43")
    pod.delete()
    assert "snapshots before shutdown: ['done']" in pod.log(), pod.log()

    other_node = AgentPod(IMAGE, tmp_path / "other-node", key=agent.key)
    try:
        fresh = make_pod(agent=other_node)
        offered = fresh.server.client.call("GET", "", path=NOTEBOOK)["snapshots"]
        ours = [(s["trigger"], s["status"]) for s in offered if s["kernel_id"] == kernel]
        assert ours == [("before-shutdown", "complete"), ("manual", "complete")], offered
        before_shutdown = next(s["id"] for s in offered if s["trigger"] == "before-shutdown")
        state = (
            "import os\n"
            "print(x, int(a.sum()), open('/proc/self/status').read().count('Seccomp:\\t2'))"
        )
        for snapshot_id, x in ((before_shutdown, 43), (manual["id"], 42)):
            job = fresh.server.client.call("POST", f"{snapshot_id}/restore", body={})["job"]
            restored = follow(fresh.server, job)["result"]["kernel_id"]
            assert ws_execute(fresh.server, restored, state) == f"{x} 499999500000 1\n"
            # In the fresh pod's namespaces: its server sees the kernel as its process.
            pid = int(ws_execute(fresh.server, restored, "print(os.getpid())"))
            assert fresh.exec("sh", "-c", f"kill -0 {pid}").returncode == 0
            # A restored kernel is snapshotted through the agent again.
            snapshot(fresh, restored)
            fresh.server.api("DELETE", f"api/kernels/{restored}")
    finally:
        other_node.close()


def _doctor(pod: Pod) -> tuple[int, dict[str, dict[str, Any]]]:
    """``jupyter snapshot doctor --json`` in the pod: its exit status and checks by name."""
    out = pod.exec("jupyter", "snapshot", "doctor", "--json")
    return out.returncode, {c["name"]: c for c in json.loads(out.stdout)}


def test_baseline_doctor_in_the_pod_says_snapshots_work_through_the_agent(
    make_pod: MakePod, agent: AgentPod
) -> None:
    """In a pod at baseline doctor checks the node agent instead of CRIU in the pod (which
    could not run there: no capability, no_new_privs, a seccomp filter): the agent answers
    in this protocol version and names the pod, the in-pod CRIU checks are said to be the
    agent's job, and snapshots work."""
    pod = make_pod(agent=agent)
    returncode, checks = _doctor(pod)
    failed = [c for c in checks.values() if c["required"] and not c["ok"]]
    assert not failed, failed
    assert returncode == 0
    assert checks["node agent"]["ok"]
    detail = checks["node agent"]["detail"]
    assert "protocol version 2" in detail, detail
    assert "'jupyter-alice' of user 'alice'" in detail, detail
    assert not {"criu", "criu capabilities", "seccomp", "criu features"} & set(checks), checks
    assert checks["criu in the pod"]["ok"], checks["criu in the pod"]
    assert "node agent runs CRIU" in checks["criu in the pod"]["detail"]
    assert "agent mode" in checks["privileges"]["detail"]
    assert checks["tcp connections"]["ok"], checks["tcp connections"]  # the agent's TCP repair
    assert not checks["lazy restore"]["ok"]  # said, not required: restores through the agent
    assert "Snapshots work on this machine." in pod.exec("jupyter", "snapshot", "doctor").stdout


def test_baseline_doctor_names_the_missing_node_agent(make_pod: MakePod, agent: AgentPod) -> None:
    """The node agent dies (its socket left behind), then its socket goes too (the volume
    mounted, no agent on the node): doctor fails its check naming each cause and what to
    do, and a snapshot fails with the same words; once the agent runs again, doctor says
    snapshots work."""
    pod = make_pod(agent=agent)
    kernel = open_notebook(pod)
    assert ws_execute(pod.server, kernel, "x = 42\nprint(x)") == "42\n"
    agent.kill()
    returncode, checks = _doctor(pod)
    assert returncode == 1
    missing = checks["node agent"]
    assert not missing["ok"]
    assert missing["required"]
    assert "nothing listens on it" in missing["detail"], missing
    assert "deploy/agent/agent.yaml" in missing["fix"]
    assert "CSI volume" in missing["fix"]
    assert "does not answer" in checks["lazy restore"]["detail"]
    text = pod.exec("jupyter", "snapshot", "doctor").stdout
    assert "Snapshots do not work here yet: 1 required check(s) failed." in text, text
    with pytest.raises(SnapshotError) as failed:
        snapshot(pod, kernel)
    assert "nothing listens on it" in failed.value.message, failed.value
    assert "deploy/agent/agent.yaml" in failed.value.hint, failed.value

    agent.socket.unlink()
    returncode, checks = _doctor(pod)
    assert returncode == 1
    assert "no node agent has started on this node" in checks["node agent"]["detail"], checks

    agent.restart()
    returncode, checks = _doctor(pod)
    assert returncode == 0
    assert checks["node agent"]["ok"], checks["node agent"]
    snapshot(pod, kernel)
    assert ws_execute(pod.server, kernel, "print(x)") == "42\n"


def test_baseline_agent_refuses_another_pods_kernel_and_another_users_images(
    make_pod: MakePod, agent: AgentPod
) -> None:
    """Bob's pod asks the agent for Alice's kernel by its node pid and by its pid in her
    pod: refused. Images Alice's pod had the agent dump (sealed for her) are refused to
    Bob's pod, and restore in hers."""
    alice = make_pod(agent=agent)
    kernel = open_notebook(alice)
    kernel_pid = int(ws_execute(alice.server, kernel, "import os\nprint(os.getpid())"))
    kernel_host_pid = _host_pid(alice, kernel_pid)
    bob = make_pod(agent=agent, user="bob")
    socket = "/run/jupyter-kernel-snapshots-agent/agent.sock"
    refusals = _agent_call(
        bob,
        socket,
        f"for pid in ({kernel_host_pid}, {kernel_pid}):\n"
        "    try:\n"
        "        request = DumpRequest(pid, leave_running=True, externals=[], ghost_limit=0)\n"
        "        call(SOCKET, request)\n"
        "        print('dumped', pid)\n"
        "    except SnapshotError as exc:\n"
        "        print(exc.message)\n",
    )
    assert len(refusals) == 2, refusals
    assert all("refused" in line and "no process" in line for line in refusals), refusals

    # Alice's own process, dumped for her; its images lie in the home volume both see.
    # A session leader of its own, the child of a process that reaps it (the container's
    # first process does not): once dumped and ended, its pid is free for the restore.
    sleeper_code = "import os, time; os.setsid(); time.sleep(600)"
    reaper = (
        "import subprocess, sys\n"
        f"p = subprocess.Popen([sys.executable, '-c', {sleeper_code!r}])\n"
        "open('/tmp/sleeper.pid', 'w').write(str(p.pid))\n"
        "p.wait()\n"
    )
    alice.exec("sh", "-c", f"python3 -c {shlex.quote(reaper)} </dev/null >/dev/null 2>&1 &")
    sleeper = 0
    deadline = time.monotonic() + 60
    while not sleeper:
        assert time.monotonic() < deadline, "the sleeper did not start"
        started = alice.exec("sh", "-c", "cat /tmp/sleeper.pid 2>/dev/null").stdout.strip()
        if started:
            check = f"import os; print(os.getsid({started}) == {started})"
            if alice.exec("python3", "-c", check).stdout.strip() == "True":
                sleeper = int(started)
        time.sleep(0.1)
    dumped = _agent_call(
        alice,
        socket,
        "import asyncio\n"
        "images = Path('/home/jovyan/alice-images')\n"
        "images.mkdir()\n"
        "criu = AgentCriu.connect(SOCKET)\n"
        f"asyncio.run(criu.dump({sleeper}, images, images, leave_running=False))\n"
        "print('dumped')\n",
    )
    assert dumped == ["dumped"]
    restore = (
        "import asyncio\n"
        "images = Path('/home/jovyan/alice-images')\n"
        "try:\n"
        "    print('restored', asyncio.run(AgentCriu.connect(SOCKET).restore(images, images)))\n"
        "except SnapshotError as exc:\n"
        "    print(exc.message)\n"
    )
    refused = _agent_call(bob, socket, restore)
    assert len(refused) == 1, refused
    assert "not sealed for the pod 'jupyter-bob'" in refused[0], refused
    assert _agent_call(alice, socket, restore) == [f"restored {sleeper}"]


def test_baseline_agent_killed_during_a_dump_loses_nothing(
    make_pod: MakePod, agent: AgentPod
) -> None:
    """The agent dies (SIGKILL) while CRIU dumps a kernel: the snapshot fails and says the
    agent went away, the kernel runs on with its state, the snapshot before stays, and the
    restarted agent (as the DaemonSet restarts it) snapshots the kernel again."""
    pod = make_pod(agent=agent, user="carol")  # a store (and key) of its own
    kernel = open_notebook(pod)
    setup = "import numpy as np\nx = 42\na = np.ones(60_000_000)\nprint(x)"
    assert ws_execute(pod.server, kernel, setup) == "42\n"
    before = snapshot(pod, kernel)["result"]["id"]
    job = pod.server.client.call("POST", "", body={"kernel_id": kernel})["job"]
    deadline = time.monotonic() + 120
    while not _criu_dumping():
        assert time.monotonic() < deadline, "no dump started"
        time.sleep(0.005)
    os.kill(agent.pid(), 9)
    with pytest.raises(SnapshotError) as failed:
        follow(pod.server, job)
    assert "node agent" in failed.value.message, failed.value
    assert ws_execute(pod.server, kernel, "print(x, int(a.sum()))") == "42 60000000\n"
    listed = pod.server.client.call("GET", "", path=NOTEBOOK)
    assert before in [s["id"] for s in listed["snapshots"] if s["status"] == "complete"], listed
    agent.restart()
    snapshot(pod, kernel)
    assert ws_execute(pod.server, kernel, "print(x)") == "42\n"


def _criu_dumping() -> bool:
    """Whether a CRIU of the node agent is dumping (its command line through the agent's
    descriptors; the agent dumps through CRIU's RPC, ``criu swrk``)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"swrk" in argv and any(
            a.endswith(b"/criu") and a.startswith(b"/proc/self/fd/") for a in argv
        ):
            return True
    return False


UI_TESTS = Path(__file__).resolve().parent.parent / "ui-tests"
#: Galata's page helpers in the pod's JupyterLab (what ui-tests/jupyter_server_test_config.py
#: loads for the other specs), from the user's config directory on the home volume: the
#: test's alone, not the product's.
GALATA_CONFIG = """\
from pathlib import Path
import jupyterlab
c.LabServerApp.extra_labextensions_path = [str(Path(jupyterlab.__file__).parent / "galata")]
c.LabApp.expose_app_in_browser = True
"""


def test_baseline_panel_in_a_browser_through_the_agent(
    make_pod: MakePod, agent: AgentPod, moto: Moto, home: Path
) -> None:
    """The panel's states in agent mode, in Chromium: ui-tests/tests/agent.spec.ts against
    JupyterLab served from a pod at baseline, with the node agent (a snapshot seen while
    it runs and then listed, a suspend shown in the panel and the indicator, the next cell
    resuming the kernel, a restore in place from the panel). Its packages and Chromium:
    scripts/container-tests.sh."""
    assert (UI_TESTS / "node_modules" / "@playwright" / "test").is_dir(), (
        "ui-tests' packages are missing: scripts/container-tests.sh installs them (npm ci)"
    )
    config = home / ".jupyter" / "jupyter_server_config.py"
    config.parent.mkdir()
    config.write_text(GALATA_CONFIG)
    subprocess.run(["chown", "-R", "1000:100", str(config.parent)], check=True)
    pod = make_pod(agent=agent, user="grace")  # a store (and key) of its own
    env = {
        **os.environ,
        "UI_TESTS_AGENT_URL": pod.server.url,
        "UI_TESTS_AGENT_TOKEN": pod.token,
        "UI_TESTS_AGENT_STORE_PID": str(moto.process.pid),
        "PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD": "1",
    }
    try:
        out = subprocess.run(
            ["npx", "playwright", "test", "tests/agent.spec.ts", "--reporter=list"],
            cwd=UI_TESTS,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    finally:
        os.kill(moto.process.pid, signal.SIGCONT)  # the spec holds it: never left stopped
    said = f"{out.stdout[-8000:]}\n{out.stderr[-2000:]}\nthe server's log:\n{pod.log()}"
    assert out.returncode == 0, said
    assert "1 passed" in out.stdout, said  # run, not skipped


def _policies_often(values: dict[str, Any]) -> None:
    """Periodic snapshots every second and idle CPU kernels suspended after 4 s."""
    config = values["singleuser"]["extraFiles"]["jupyter-server-config"]["data"]
    config["SnapshotExtensionApp"].update(
        periodic_interval=1, policy_tick=0.5, idle_suspend_after=4, suspend_cpu_kernels=True
    )


def _wait_for(what: str, check: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.25)


def test_baseline_periodic_idle_suspend_resume_and_restore_in_place_through_the_agent(
    make_pod: MakePod, agent: AgentPod
) -> None:
    """In agent mode, what the server does by itself goes through the node agent too: a
    periodic snapshot, an idle kernel suspended (its process ended) and resumed by the next
    cell with its state, and a restore in place of the running kernel."""
    pod = make_pod(_policies_often, agent=agent, user="dave")  # a store (and key) of its own
    kernel = open_notebook(pod)
    assert ws_execute(pod.server, kernel, "x = 42\nprint(x)") == "42\n"

    def listed(trigger: str) -> list[dict[str, Any]]:
        found = pod.server.client.call("GET", "", trigger=trigger, path=NOTEBOOK)
        assert not found["store_error"], found
        return [s for s in found["snapshots"] if s["status"] == "complete"]

    _wait_for("periodic snapshot", lambda: bool(listed("periodic")))
    inner = pod.server.client.call("GET", f"kernels/{kernel}")["inner_pid"]
    _wait_for(
        "idle suspend",
        lambda: pod.server.client.call("GET", f"kernels/{kernel}")["state"] == "suspended",
    )
    assert pod.exec("sh", "-c", f"kill -0 {inner}").returncode != 0  # its process ended
    assert ws_execute(pod.server, kernel, "print(x)") == "42\n"  # resumed by the next cell
    back = pod.server.client.call("GET", f"kernels/{kernel}")
    # Running again; its next periodic snapshot (every second here) may be under way.
    assert back["state"] in ("running", "snapshotting"), back

    # Restore in place: the running kernel (x = 44) replaced by its snapshot (x = 43).
    pod.server.client.call("PATCH", f"kernels/{kernel}", body={"periodic": False})
    assert ws_execute(pod.server, kernel, "x = 43\nprint(x)") == "43\n"
    saved = snapshot(pod, kernel)["result"]["id"]
    assert ws_execute(pod.server, kernel, "x = 44\nprint(x)") == "44\n"
    job = pod.server.client.call("POST", f"{saved}/restore", body={"kernel_id": kernel})["job"]
    assert follow(pod.server, job)["result"]["kernel_id"] == kernel
    assert ws_execute(pod.server, kernel, "print(x)") == "43\n"


def _long_cells(values: dict[str, Any]) -> None:
    """A snapshot after each cell that ran 1.5 s or more."""
    config = values["singleuser"]["extraFiles"]["jupyter-server-config"]["data"]
    config["SnapshotExtensionApp"].update(
        long_cell_seconds=1.5, long_cell_min_interval=0, policy_tick=0.5
    )


def test_baseline_long_cell_snapshot_through_the_agent_restores_into_a_new_kernel(
    make_pod: MakePod, agent: AgentPod
) -> None:
    """A cell that ran long is snapshotted through the agent once it ended; the kernel
    shut down, that snapshot restored into a new kernel of the same pod has what the cell
    made (beside the running kernel it would not: without a PID namespace of its own a
    copy needs the ids the kernel holds, docs/nonroot.md)."""
    pod = make_pod(_long_cells, agent=agent, user="erin")  # a store (and key) of its own
    kernel = open_notebook(pod)
    assert ws_execute(pod.server, kernel, "x = 1\nprint(x)") == "1\n"
    assert ws_execute(pod.server, kernel, "import time\ntime.sleep(2.5)\nx = 42") == ""

    def long_cell() -> list[dict[str, Any]]:
        found = pod.server.client.call("GET", "", trigger="long-cell", path=NOTEBOOK)
        return [s for s in found["snapshots"] if s["status"] == "complete"]

    _wait_for("long-cell snapshot", lambda: bool(long_cell()))
    [taken] = long_cell()
    assert [c["first_line"] for c in taken["contents"]["cells"]] == ["x = 1", "import time"]
    pod.server.api("DELETE", f"api/kernels/{kernel}")
    job = pod.server.client.call("POST", f"{taken['id']}/restore", body={})["job"]
    restored = follow(pod.server, job)["result"]["kernel_id"]
    assert restored != kernel
    assert ws_execute(pod.server, restored, "print(x)") == "42\n"


#: A notebook's cells with what only the snapshot carries to another pod: a spawn pool
#: (its locks are named semaphores in /dev/shm), a shared_memory segment, a log in the
#: pod's /tmp the kernel appends to, and a multiprocessing manager on TCP (its connection
#: to the kernel kept with TCP repair).
PARALLEL_SETUP = """\
import multiprocessing as mp
from multiprocessing import shared_memory
from multiprocessing.managers import SyncManager
pool = mp.get_context("spawn").Pool(2)
manager = SyncManager(address=("127.0.0.1", 0), ctx=mp.get_context("spawn"))
manager.start()
shared = manager.dict(x=42)
shm = shared_memory.SharedMemory(name="jks-ct-shm", create=True, size=1 << 20)
shm.buf[:5] = b"hello"
log = open("/tmp/kernel.log", "a")
print("before", file=log, flush=True)
print(sum(pool.map(abs, range(-5, 5))), bytes(shm.buf[:5]).decode(), shared["x"])
"""
PARALLEL_CHECK = """\
print("after", file=log, flush=True)
lines = open("/tmp/kernel.log").read().split()
print(sum(pool.map(abs, range(-5, 5))), bytes(shm.buf[:5]).decode(), shared["x"], lines)
"""


def test_baseline_spawn_pool_and_shared_memory_move_through_the_agent_to_a_fresh_pod(
    make_pod: MakePod, agent: AgentPod
) -> None:
    """A kernel with a spawn pool, a shared_memory segment, a log it appends to and a
    manager on TCP is snapshotted through the agent (its /dev/shm files and log copied
    while the agent holds it frozen, its connection to the manager kept), its pod
    deleted, and restored in a fresh pod: the pool and the manager work, the segment and
    the log are as they were, in the fresh pod's own /dev/shm and /tmp."""
    pod = make_pod(agent=agent, user="frank")  # a store (and key) of its own
    kernel = open_notebook(pod)
    assert ws_execute(pod.server, kernel, PARALLEL_SETUP) == "25 hello 42\n"
    taken = snapshot(pod, kernel)["result"]
    assert len(taken["shm_files"]) >= 3, taken["shm_files"]  # the segment, the pool's locks
    assert [f["path"] for f in taken["appended_files"]] == ["/tmp/kernel.log"]
    assert taken["tcp_kept"] is True
    assert taken["kept_connections"], taken
    pod.delete()

    fresh = make_pod(agent=agent, user="frank")
    assert fresh.exec("ls", "/dev/shm").stdout.split() == []
    job = fresh.server.client.call("POST", f"{taken['id']}/restore", body={})["job"]
    restored = follow(fresh.server, job)["result"]["kernel_id"]
    check = ws_execute(fresh.server, restored, PARALLEL_CHECK)
    assert check == "25 hello 42 ['before', 'after']\n", check
    assert "jks-ct-shm" in fresh.exec("ls", "/dev/shm").stdout.split()


R_NOTEBOOK = "r-analysis.ipynb"


def test_baseline_r_notebook_moves_through_the_agent_to_a_fresh_pod(
    make_pod: MakePod, agent: AgentPod, home: Path
) -> None:
    """The image's R (IRkernel, its kernelspec ir wrapped by deploy/Dockerfile:
    docs/kernels.md): an R notebook (metadata: ir) gets the snapshot kernel "R
    (snapshots)", its kernel is snapshotted through the node agent with its variables
    read in R, the pod is deleted, and a fresh pod restores it from S3."""
    notebook = {
        "cells": [],
        "metadata": {"kernelspec": {"name": "ir", "display_name": "R", "language": "R"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (home / R_NOTEBOOK).write_text(json.dumps(notebook))
    os.chown(home / R_NOTEBOOK, 1000, 100)
    pod = make_pod(agent=agent, user="rosa")  # a store (and key) of its own
    spec = pod.server.api("GET", "api/kernelspecs")["kernelspecs"]["ir"]["spec"]
    assert spec["display_name"] == "R (snapshots)"
    assert spec["metadata"]["kernel_snapshots"]["wraps"] == "ir"
    session = pod.server.api(
        "POST",
        "api/sessions",
        {"path": R_NOTEBOOK, "type": "notebook", "name": R_NOTEBOOK, "kernel": {"name": "ir"}},
    )
    kernel = session["kernel"]["id"]
    setup = "x <- 42; df <- data.frame(a = 1:1000); cat(x, sum(df$a))"
    assert ws_execute(pod.server, kernel, setup) == "42 500500"
    taken = snapshot(pod, kernel)["result"]
    assert [v["name"] for v in taken["contents"]["variables"]] == ["df", "x"]
    assert "not available for R kernels" in taken["contents"]["take_unavailable"]
    pod.delete()

    fresh = make_pod(agent=agent, user="rosa")
    job = fresh.server.client.call("POST", f"{taken['id']}/restore", body={})["job"]
    restored = follow(fresh.server, job)["result"]["kernel_id"]
    assert ws_execute(fresh.server, restored, "cat(x, sum(df$a))") == "42 500500"
