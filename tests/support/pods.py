"""User pods of ``deploy/z2jh/config.yaml`` in real podman (``podman kube play``).

The pod is rendered by KubeSpawner's own ``get_pod_manifest`` from the chart values the
recipe sets (the mapping of the Zero to JupyterHub chart's ``jupyterhub_config.py`` for
the keys it uses), then adapted where podman is not Kubernetes, each one said here:

- no Kubernetes API: the ``secretKeyRef`` credentials become literal test values, the
  ``extraFiles`` Secret and the user's PVC become host paths (the same mount paths);
- the node agent's CSI volume (deploy/z2jh/config.yaml, agent mode) becomes a bind of the
  agent's socket directory (what the CSI driver would mount); the pod's hostname is the
  name KubeSpawner gave it, as Kubernetes sets it;
- the node agent's container (deploy/agent/agent.yaml) runs with ``podman run``: podman
  4.3's ``kube play`` ignores ``hostPID``;
- podman ignores ``securityContext.seccompProfile``: it is turned into podman's seccomp
  annotation (Unconfined -> ``unconfined``, RuntimeDefault -> podman's default profile);
- podman puts a non-root container's added capabilities into its ambient set, which
  Kubernetes does not: the command starts with ``setpriv --inh-caps=-all
  --ambient-caps=-all`` so the server has CapEff 0 and the caps only in its bounding set;
- no hub: the container runs ``jupyter server`` with a token instead of
  ``jupyterhub-singleuser`` (the hub, its proxy and culler are tests/test_jupyterhub.py's);
  KubeSpawner's environment (``JUPYTERHUB_USER`` names the snapshots' owner) is kept;
- a pod is deleted as KubeSpawner deletes it: SIGTERM, SIGKILL after
  ``delete_grace_period`` (``podman stop --time`` of the server's container, while the
  pod's network stays up as Kubernetes keeps it), then removed.

scripts/container-tests.sh sets podman up (runc, cgroupfs, file logs) and builds the image.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import yaml

from testkit.processes import Endpoint

ROOT = Path(__file__).resolve().parents[2]
CONFIG_YAML = ROOT / "deploy" / "z2jh" / "config.yaml"
HOME = "/home/jovyan"
#: The pods' network (a bridge of podman's); the host is its gateway.
NETWORK = "jks-ct"
#: The container runtime's seccomp annotation for the profile Kubernetes would apply.
SECCOMP_ANNOTATION = {"Unconfined": "unconfined", "RuntimeDefault": "runtime/default"}


def podman(*args: str, check: bool = True, timeout: float = 300) -> str:
    out = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and out.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)}: {out.stderr.strip()[-2000:]}")
    return out.stdout


def pod_network() -> str:
    """Make the pods' network if need be; returns the host's address on it (moto's S3
    server there is what the pods reach: a name would be taken for a bucket by moto)."""
    if subprocess.run(["podman", "network", "exists", NETWORK], check=False).returncode != 0:
        podman("network", "create", NETWORK)
    return podman(
        "network", "inspect", NETWORK, "--format", "{{range .Subnets}}{{.Gateway}}{{end}}"
    ).strip()


def chart_values(*overlays: str) -> dict[str, Any]:
    """config.yaml's values, with the named files of deploy/z2jh/ given after it (``helm
    --values config.yaml --values inpod.yaml``)."""
    values: dict[str, Any] = yaml.safe_load(CONFIG_YAML.read_text())
    for name in overlays:
        values = helm_merge(values, yaml.safe_load((CONFIG_YAML.parent / name).read_text()))
    return values


def helm_merge(base: Any, overlay: Any) -> Any:
    """How Helm merges a later values file: maps key by key, anything else replaced, and a
    null removes the key."""
    if not isinstance(base, dict) or not isinstance(overlay, dict):
        return overlay
    merged = dict(base)
    for key, value in overlay.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = helm_merge(merged.get(key), value)
    return merged


def render_pod(
    values: dict[str, Any],
    *,
    image: str,
    user: str,
    home: Path,
    server_config: Path,
    environment: dict[str, str],
) -> dict[str, Any]:
    """The user pod as KubeSpawner renders it from the chart values."""
    from jupyterhub.objects import Hub
    from kubernetes_asyncio.client import ApiClient
    from kubespawner import KubeSpawner
    from traitlets.config import Config

    single = values["singleuser"]
    c = Config()
    spawner_config: dict[str, Any] = {
        "image": image,
        "uid": single["uid"],
        "fs_gid": single["fsGid"],
        "allow_privilege_escalation": single["allowPrivilegeEscalation"],
        "environment": {
            **{k: v for k, v in single.get("extraEnv", {}).items() if isinstance(v, str)},
            **environment,
        },
        "volumes": [
            {"name": "home", "hostPath": {"path": str(home), "type": "Directory"}},
            {"name": "files", "hostPath": {"path": str(server_config), "type": "File"}},
            *single.get("storage", {}).get("extraVolumes", []),
        ],
        "volume_mounts": [
            {"name": "home", "mountPath": HOME},
            {
                "name": "files",
                "mountPath": single["extraFiles"]["jupyter-server-config"]["mountPath"],
            },
            *single.get("storage", {}).get("extraVolumeMounts", []),
        ],
        **values["hub"]["config"]["KubeSpawner"],
    }
    for key, value in spawner_config.items():
        c.KubeSpawner[key] = value
    if single.get("cloudMetadata", {}).get("blockWithIptables", True):
        # The chart's default: a privileged init container, run as root, that sets
        # iptables rules; the recipe turns it off (docs/jupyterhub.md).
        c.KubeSpawner.init_containers = [
            {
                "name": "block-cloud-metadata",
                "image": image,
                "command": ["iptables", "-A", "OUTPUT", "-d", "169.254.169.254", "-j", "DROP"],
                "securityContext": {"privileged": True, "runAsUser": 0},
            }
        ]

    class _User:
        name = user
        id = 1
        escaped_name = user
        url = f"/user/{user}/"

    # KubeSpawner loads a client configuration when it is made (from $KUBECONFIG, read
    # when kubernetes_asyncio is imported: scripts/container-tests.sh writes one that
    # points nowhere); rendering a manifest never calls the API.
    async def render() -> dict[str, Any]:
        spawner = KubeSpawner(config=c, user=_User(), hub=Hub())
        manifest = await spawner.get_pod_manifest()
        async with ApiClient() as client:
            rendered: dict[str, Any] = client.sanitize_for_serialization(manifest)
        return rendered

    return asyncio.run(render())


class Pod:
    """A user pod running in podman, its server reached on 127.0.0.1:``port``."""

    def __init__(
        self,
        manifest: dict[str, Any],
        work: Path,
        *,
        home: Path,
        grace: int,
        csi_dirs: dict[str, Path] | None = None,
    ) -> None:
        self.home = home
        self.token = uuid.uuid4().hex
        self.name = f"jks-ct-{uuid.uuid4().hex[:8]}"
        self.port = _free_port()
        self.manifest = _for_podman(manifest, self.name, self.port, self.token, csi_dirs or {})
        container = self.manifest["spec"]["containers"][0]
        self.container = f"{self.name}-{container['name']}"
        # KubeSpawner.delete_grace_period: what a pod deletion gives the server.
        self.grace = grace
        self.file = work / f"{self.name}.yaml"
        self.file.write_text(yaml.safe_dump(self.manifest))
        podman("kube", "play", "--network", NETWORK, str(self.file))
        self.server = Endpoint(f"http://127.0.0.1:{self.port}/", self.token)

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, urllib.error.URLError):
                self.server.api("GET", "api/status")
                return
            time.sleep(0.3)
        raise RuntimeError(f"the pod's server did not answer; its log:\n{self.log()}")

    def exec(self, *argv: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        """Run a command in the server's container as the server runs (no ambient caps)."""
        return subprocess.run(
            ["podman", "exec", self.container, *DROP_AMBIENT, *argv],
            capture_output=True,
            text=True,
            timeout=300,
            check=check,
        )

    def log(self) -> str:
        """The end of the server's log (kept on the home volume)."""
        try:
            return (self.home / LOG_NAME.format(self.name)).read_text(errors="replace")[-6000:]
        except OSError as exc:
            return f"(no log: {exc})"

    def delete(self) -> float:
        """As KubeSpawner deletes a pod: SIGTERM, SIGKILL after the grace period; returns
        how long the server took to go."""
        start = time.monotonic()
        # The server's container only: `podman pod stop` would stop the pod's infra
        # container (its network) at once too, which Kubernetes keeps until the end.
        podman("stop", "--time", str(self.grace), self.container, timeout=self.grace + 60)
        took = time.monotonic() - start
        podman("pod", "rm", "--force", self.name, check=False)
        return took

    def close(self) -> None:
        podman("rm", "--force", "--time", "0", self.name, check=False)


LOG_NAME = ".server-{}.log"
DROP_AMBIENT = ["setpriv", "--inh-caps=-all", "--ambient-caps=-all", "--"]


def _for_podman(
    manifest: dict[str, Any], name: str, port: int, token: str, csi_dirs: dict[str, Path]
) -> dict[str, Any]:
    pod = json.loads(json.dumps(manifest))
    # Kubernetes names the pod's host after the pod (KubeSpawner's jupyter-<user>), which
    # the node agent reads its owner from; podman's own pod name must be unique here.
    pod["spec"]["hostname"] = pod["metadata"]["name"]
    pod["metadata"]["name"] = name
    for volume in pod["spec"].get("volumes", []):
        csi = volume.pop("csi", None)
        if csi is not None:
            # What the CSI driver would mount: the node agent's socket directory.
            volume["hostPath"] = {"path": str(csi_dirs[csi["driver"]]), "type": "Directory"}
    container = pod["spec"]["containers"][0]
    seccomp = (container.get("securityContext") or {}).get("seccompProfile")
    if seccomp:
        pod["metadata"].setdefault("annotations", {})[
            f"container.seccomp.security.alpha.kubernetes.io/{container['name']}"
        ] = SECCOMP_ANNOTATION[seccomp["type"]]
    server = [
        *DROP_AMBIENT,
        "jupyter",
        "server",
        "--ServerApp.ip=0.0.0.0",
        "--ServerApp.port=8888",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={HOME}",
    ]
    # The server's log on the home volume, where it outlives the pod (exec: the server is
    # the container's first process, as jupyterhub-singleuser would be).
    container["command"] = ["sh", "-c", f'exec "$@" >>{HOME}/{LOG_NAME.format(name)} 2>&1', "-"]
    container["args"] = server
    for entry in container.get("ports", []):
        if entry.get("containerPort") == 8888:
            entry["hostPort"] = port
            entry["hostIP"] = "127.0.0.1"
    return pod


def _free_port() -> int:
    from testkit.processes import free_port

    return free_port()


AGENT_YAML = ROOT / "deploy" / "agent" / "agent.yaml"
AGENT_CSI_DRIVER = "agent.kernel-snapshots.jupyter.org"


class AgentPod:
    """The node agent of ``deploy/agent/agent.yaml`` in podman: its DaemonSet's agent
    container (the CSI driver's containers need a kubelet), privileged, in the node's PID
    namespace, its hostPath volumes in ``work`` and its key Secret a file. Run with
    ``podman run`` from the container's spec: podman 4.3's ``kube play`` ignores
    ``hostPID`` (the agent would see no caller)."""

    def __init__(self, image: str, work: Path, key: Path | None = None) -> None:
        """``key``: the seal key file of another agent (another node's: every node's agent
        mounts the same Secret); else a new key."""
        documents = list(yaml.safe_load_all(AGENT_YAML.read_text()))
        daemonset = next(d for d in documents if d["kind"] == "DaemonSet")
        spec = daemonset["spec"]["template"]["spec"]
        container = next(c for c in spec["containers"] if c["name"] == "agent")
        self.socket_dir = work / "agent-socket"
        self.state_dir = work / "agent-state"
        key_dir = work / "agent-key"
        for path in (self.socket_dir, self.state_dir, key_dir):
            path.mkdir(parents=True, exist_ok=True)
        self.socket_dir.chmod(0o755)
        self.key = key_dir / "seal.key"
        self.key.write_bytes(
            key.read_bytes() if key is not None else uuid.uuid4().bytes + uuid.uuid4().bytes
        )
        host = {
            "socket": self.socket_dir,
            "state": self.state_dir,
            "key": key_dir,
            "cgroup": Path("/sys/fs/cgroup"),
        }
        context = container["securityContext"]
        options = ["--pid=host" if spec.get("hostPID") else "--pid=private"]
        options += ["--privileged"] if context.get("privileged") else []
        options += ["--user", str(context.get("runAsUser", 0)), "--network", "none"]
        for mount in container["volumeMounts"]:
            suffix = ":ro" if mount.get("readOnly") else ""
            options += ["--volume", f"{host[mount['name']]}:{mount['mountPath']}{suffix}"]
        self.name = self.container = f"jks-ct-agent-{uuid.uuid4().hex[:8]}"
        podman("run", "--detach", "--name", self.name, *options, image, *container["command"])
        self.socket = self.socket_dir / "agent.sock"
        self.wait_ready()

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not self.socket.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node agent did not start; its log:\n{self.log()}")
            time.sleep(0.2)

    def pid(self) -> int:
        """The agent's process (the node's pid)."""
        return int(podman("inspect", "--format", "{{.State.Pid}}", self.container).strip())

    def kill(self) -> None:
        """The agent dies (SIGKILL), as in a crash: its socket file stays behind, and no
        process listens on it once the container has stopped."""
        os.kill(self.pid(), signal.SIGKILL)
        podman("wait", self.container)

    def restart(self) -> None:
        """As the DaemonSet's restart policy does after the agent died."""
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        podman("start", self.container)
        self.wait_ready()

    def log(self) -> str:
        return podman("logs", self.container, check=False)[-6000:]

    def close(self) -> None:
        podman("rm", "--force", "--time", "0", self.name, check=False)
