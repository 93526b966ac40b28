"""Two "nodes" for a UI test (``ui-tests/tests/nodes.spec.ts``): two real Jupyter servers
with the snapshot extension and JupyterLab, A and B, sharing one S3 store (moto's server)
and one notebook directory, each with its own data, runtime and kernel directories.

    python -m tests.support.nodes_for_ui [--log FILE]

Once both answer, one line on stdout gives their URLs and tokens as JSON
(``{"a": {"url", "token"}, "b": {...}}``). Commands, one per line on stdin:

- ``kill a`` (or ``b``): kill -9 that server and every process it started, as a node
  failure would; answers ``killed a``.
- ``start a``: start a killed server again, at the same URL with the same token and
  folders (the server restarted under an open page); answers ``started a``.

On end of input, SIGTERM or SIGINT the servers stop, moto stops, the servers' logs are
appended to FILE and the temporary directory is removed. No network namespaces: the
browser must reach both servers (``tests/test_nodes.py`` covers the isolated nodes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

from testkit.processes import MotoServer, ServerProcess

BUCKET = "kernel-snapshots-ui-nodes"
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": "/nonexistent",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
}
# A fresh JupyterLab would ask whether to fetch Jupyter news (offline here).
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension:notification": {
        "checkForUpdates": False,
        "fetchNews": "false",
    }
}


def _stop(signum: int, frame: FrameType | None) -> None:
    """Leave the command loop (once: a second signal must not cut the clean-up)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print(f"nodes_for_ui: stopping on signal {signum}", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def _server(
    tmp: Path, name: str, notebooks: Path, s3_url: str, again: ServerProcess | None = None
) -> ServerProcess:
    """Server ``name``; ``again``: the killed one it takes the place of."""
    home = tmp / f"node-{name}"
    labconfig = home / "config" / "labconfig"
    labconfig.mkdir(parents=True, exist_ok=True)
    (labconfig / "default_setting_overrides.json").write_text(json.dumps(LAB_SETTINGS))
    config: dict[str, Any] = {
        "SnapshotExtensionApp": {
            "store": "s3",
            "s3_bucket": BUCKET,
            "s3_endpoint_url": s3_url,
            "owner": "alice",
            "work_dir": str(home / "work"),
            # Nothing else happens by itself during the test.
            "periodic_interval": 0,
            "idle_suspend_after": 0,
            "snapshot_before_shutdown": False,
        }
    }
    if again is not None:
        return ServerProcess(
            home, notebooks, config, env=S3_ENV, port=again.port, token=again.token, lab=True
        )
    return ServerProcess(home, notebooks, config, env=S3_ENV, lab=True)


def main() -> None:
    """Start the nodes, follow the commands, clean up."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.nodes_for_ui", description=__doc__
    )
    parser.add_argument("--log", type=Path, help="where to append the servers' logs at exit")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    tmp = Path(tempfile.mkdtemp(prefix="kernel-snapshots-ui-nodes-"))
    moto: MotoServer | None = None
    servers: dict[str, ServerProcess] = {}
    try:
        moto = MotoServer(tmp / "moto.log")
        with contextlib.ExitStack() as stack:
            for name, value in S3_ENV.items():
                stack.enter_context(_environ(name, value))
            moto.ensure_bucket(BUCKET)
        notebooks = tmp / "notebooks"
        notebooks.mkdir()
        for name in ("a", "b"):
            servers[name] = _server(tmp, name, notebooks, moto.url)
        ready = {name: {"url": s.url, "token": s.token} for name, s in servers.items()}
        print(json.dumps(ready), flush=True)
        for line in sys.stdin:
            command = line.split()
            if len(command) == 2 and command[0] == "kill" and command[1] in servers:
                servers[command[1]].kill_node()
                print(f"killed {command[1]}", flush=True)
            elif len(command) == 2 and command[0] == "start" and command[1] in servers:
                name = command[1]
                servers[name] = _server(tmp, name, notebooks, moto.url, again=servers[name])
                print(f"started {name}", flush=True)
            elif command:
                print(f"unknown command: {line.strip()}", flush=True)
        print("nodes_for_ui: stopping at the end of input", file=sys.stderr, flush=True)
    finally:
        try:
            for name, server in servers.items():
                server.stop(timeout=60)
                if args.log:
                    with args.log.open("a") as log:
                        log.write(f"===== server {name} =====\n{server.log()}\n")
            if moto is not None:
                moto.stop()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _environ(name: str, value: str) -> Any:
    """Set an environment variable for a while (boto3 reads its credentials from it)."""
    import os

    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


if __name__ == "__main__":
    main()
