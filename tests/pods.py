"""User pods of ``deploy/z2jh/config.yaml`` in real podman (``podman kube play``).

The pod is rendered by KubeSpawner's own ``get_pod_manifest`` from the chart values the
recipe sets (the mapping of the Zero to JupyterHub chart's ``jupyterhub_config.py`` for
the keys it uses), then adapted where podman is not Kubernetes, each one said here:

- no Kubernetes API: the ``secretKeyRef`` credentials become literal test values, the
  ``extraFiles`` Secret and the user's PVC become host paths (the same mount paths);
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
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import yaml

from jupyter_ext.testing import Endpoint

ROOT = Path(__file__).resolve().parent.parent
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


def chart_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load(CONFIG_YAML.read_text())
    return values


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
        ],
        "volume_mounts": [
            {"name": "home", "mountPath": HOME},
            {
                "name": "files",
                "mountPath": single["extraFiles"]["jupyter-server-config"]["mountPath"],
            },
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

    def __init__(self, manifest: dict[str, Any], work: Path, *, home: Path, grace: int) -> None:
        self.home = home
        self.token = uuid.uuid4().hex
        self.name = f"jks-ct-{uuid.uuid4().hex[:8]}"
        self.port = _free_port()
        self.manifest = _for_podman(manifest, self.name, self.port, self.token)
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
        podman("pod", "rm", "--force", "--time", "0", self.name, check=False)


LOG_NAME = ".server-{}.log"
DROP_AMBIENT = ["setpriv", "--inh-caps=-all", "--ambient-caps=-all", "--"]


def _for_podman(manifest: dict[str, Any], name: str, port: int, token: str) -> dict[str, Any]:
    pod = json.loads(json.dumps(manifest))
    pod["metadata"]["name"] = name
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
    from jupyter_ext.testing import free_port

    return free_port()
