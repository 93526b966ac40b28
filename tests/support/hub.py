"""A real JupyterHub for tests, on 127.0.0.1: the hub, the configurable-http-proxy it
starts (``tests/chp``, installed by ``npm ci`` in the test set-up), managed services, and
the single-user servers it spawns (``SimpleLocalProcessSpawner``: local processes running
``jupyterhub-singleuser`` from this environment, which loads the snapshot extension).

Every process of a hub carries a marker in its environment; ``close()`` stops the hub
(which stops its servers, proxy and services) and then kills whatever still carries the
marker or descends from the hub, so nothing outlives a test, even a failed one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jupyter_ext.core import proctree
from testkit.processes import OURS_ALONE, Endpoint, free_port

ROOT = Path(__file__).resolve().parents[2]
CHP = ROOT / "tests" / "chp" / "node_modules" / ".bin" / "configurable-http-proxy"
MARKER = "JKS_TEST_HUB"


class Hub:
    """``jupyterhub`` with its proxy, an admin service token and the given services.

    ``server_config`` is the single-user servers' ``jupyter_server_config.json`` (put on
    their ``JUPYTER_CONFIG_PATH``, as a Z2JH ``singleuser.extraFiles`` entry would put it in
    /etc/jupyter); ``environment`` is added to theirs (Z2JH: ``singleuser.extraEnv``).
    ``lab_settings`` are JupyterLab's default settings in the servers
    (``labconfig/default_setting_overrides.json`` in the same directory). ``port`` is the
    hub's (the proxy's public port; default: a free one); ``default_url`` is where a user's
    server sends a browser that opens it (``Spawner.default_url``, e.g. ``/lab``; default:
    the server's own). ``lab``: the servers load the other server extensions installed
    here too (JupyterLab's, for a browser); without, ours alone (``OURS_ALONE``).
    """

    def __init__(
        self,
        home: Path,
        server_config: dict[str, Any],
        environment: dict[str, str],
        *,
        services: Sequence[dict[str, Any]] = (),
        roles: Sequence[dict[str, Any]] = (),
        lab_settings: dict[str, Any] | None = None,
        port: int | None = None,
        default_url: str | None = None,
        lab: bool = False,
    ) -> None:
        if not os.access(CHP, os.X_OK):
            raise RuntimeError(
                f"configurable-http-proxy is missing ({CHP}): run `npm ci --prefix tests/chp` "
                "(scripts/dev.sh test does)"
            )
        home.mkdir(parents=True, exist_ok=True)
        self.home = home
        self.tag = uuid.uuid4().hex
        self.admin_token = uuid.uuid4().hex
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        server_config_dir = home / "singleuser-config"
        server_config_dir.mkdir()
        if not lab:
            server_config = {
                **server_config,
                "ServerApp": {**server_config.get("ServerApp", {}), **OURS_ALONE},
            }
        (server_config_dir / "jupyter_server_config.json").write_text(json.dumps(server_config))
        if lab_settings:
            (server_config_dir / "labconfig").mkdir()
            overrides = server_config_dir / "labconfig" / "default_setting_overrides.json"
            overrides.write_text(json.dumps(lab_settings))
        config = {
            "JupyterHub": {
                "bind_url": self.url,
                "hub_bind_url": f"http://127.0.0.1:{free_port()}",
                "db_url": "sqlite://",
                "cookie_secret_file": str(home / "cookie_secret"),
                "authenticator_class": "dummy",
                "spawner_class": "simple",
                # The hub reads the proxy's per-route activity every second, so what a test
                # does through the proxy counts as activity for the idle culler at once.
                "last_activity_interval": 1,
                "services": [
                    {"name": "test-admin", "api_token": self.admin_token},
                    *(
                        {**s, "environment": {**s.get("environment", {}), MARKER: self.tag}}
                        for s in services
                    ),
                ],
                "load_roles": [
                    {
                        "name": "test-admin",
                        "scopes": ["admin:users", "admin:servers", "tokens"],
                        "services": ["test-admin"],
                    },
                    *roles,
                ],
            },
            "Authenticator": {"allow_all": True},
            "ConfigurableHTTPProxy": {
                "command": [str(CHP)],
                "api_url": f"http://127.0.0.1:{free_port()}",
                "pid_file": str(home / "proxy.pid"),
            },
            "Spawner": {
                "cmd": [str(Path(sys.executable).with_name("jupyterhub-singleuser"))],
                "environment": {
                    **environment,
                    MARKER: self.tag,
                    "JUPYTER_CONFIG_PATH": str(server_config_dir),
                    "JUPYTER_SNAPSHOT_RUNTIME_DIR": str(home / "kernels"),
                    # The server tells the hub of its (kernels') activity every second.
                    "JUPYTERHUB_ACTIVITY_INTERVAL": "1",
                },
                "start_timeout": 120,
                "http_timeout": 120,
                **({"default_url": default_url} if default_url else {}),
            },
            # A stop is SIGINT first; the server snapshots its kernels before it exits.
            "LocalProcessSpawner": {"interrupt_timeout": 120},
            "SimpleLocalProcessSpawner": {"home_dir_template": str(home / "users" / "{username}")},
        }
        config_file = home / "jupyterhub_config.json"
        config_file.write_text(json.dumps(config))
        self.log_path = home / "hub.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [str(Path(sys.executable).with_name("jupyterhub")), "-f", str(config_file)],
            cwd=home,
            env={**os.environ, MARKER: self.tag},
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Hub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"jupyterhub exited: {self.log()}")
            with contextlib.suppress(OSError):
                self.api("GET", "")  # through the proxy: both are up
                return
            time.sleep(0.2)
        raise TimeoutError(f"jupyterhub did not start: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def api(self, method: str, path: str, body: Any = None) -> Any:
        """``METHOD /hub/api/<path>`` through the proxy, with the admin service's token."""
        return Endpoint(self.url + "hub/api/", self.admin_token).api(method, path, body)

    def add_user(self, name: str) -> Endpoint:
        """A user with a token of their own; returns their server's API (not started)."""
        self.api("POST", f"users/{name}")
        token = self.api("POST", f"users/{name}/tokens", {"note": "test", "expires_in": 3600})
        return Endpoint(f"{self.url}user/{name}/", token["token"])

    def server_state(self, name: str) -> dict[str, Any] | None:
        """The hub's record of the user's default server, or None if it has none."""
        servers: dict[str, Any] = self.api("GET", f"users/{name}")["servers"]
        return servers.get("")

    def start_server(self, name: str, timeout: float = 120) -> None:
        """Spawn the user's server and wait until the hub says it is ready."""
        self.api("POST", f"users/{name}/server")
        self.wait_server(name, lambda state: state is not None and state["ready"], timeout)

    def wait_server(
        self, name: str, done: Callable[[dict[str, Any] | None], bool], timeout: float = 120
    ) -> None:
        """Poll the hub until ``done(server_state(name))``; the hub's log on a time-out."""
        deadline = time.monotonic() + timeout
        while not done(self.server_state(name)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}'s server: {self.server_state(name)}\n{self.log()}")
            time.sleep(0.2)

    def processes(self) -> set[int]:
        """Every process of this hub still running: by the marker, or below the hub."""
        needle = f"{MARKER}={self.tag}".encode()
        pids = set(proctree.descendants(self.process.pid)) if self.process.poll() is None else set()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if needle in (entry / "environ").read_bytes().split(b"\0"):
                        pids.add(int(entry.name))
        return {pid for pid in pids if proctree.is_alive(pid)}

    def close(self, timeout: float = 120) -> None:
        """Stop the hub as its operator would (SIGTERM: it stops servers, services and the
        proxy), then kill -9 anything of it that is left."""
        pids = self.processes()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout)
        for pid in (pids | self.processes()) - {self.process.pid}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self._log.close()
