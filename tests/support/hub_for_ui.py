"""A real JupyterHub for the UI tests (``ui-tests/tests/jupyterhub.spec.ts``): Playwright
starts it as a web server (``ui-tests/playwright.config.ts``) and stops it with SIGTERM.

    python -m tests.support.hub_for_ui --port PORT [--log FILE]

``tests.support.hub.Hub`` on 127.0.0.1:PORT: any user logs in with any password, and their server
(``jupyterhub-singleuser`` from this environment: the snapshot extension and JupyterLab
with the extension's panel) opens at ``/lab``, keeps its snapshots in a local store in a
temporary directory and snapshots its kernels when the hub stops it. Once the hub is up,
one line on stdout gives its URL and the admin service's token (scopes ``admin:users``,
``admin:servers``, ``tokens``). On SIGTERM or SIGINT the hub stops its servers and their
kernels, whatever is left of it is killed, its log is copied to FILE and the temporary
directory is removed.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import tempfile
from pathlib import Path
from types import FrameType

from .hub import Hub


def _stop(signum: int, frame: FrameType | None) -> None:
    """Leave the wait for a signal (once: a second signal must not cut the clean-up)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def main() -> None:
    """Run the hub until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m tests.support.hub_for_ui", description=__doc__)
    parser.add_argument("--port", type=int, required=True, help="the hub's port")
    parser.add_argument("--log", type=Path, help="where to copy the hub's log at exit")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    tmp = Path(tempfile.mkdtemp(prefix="kernel-snapshots-ui-hub-"))
    server_config = {
        "ServerApp": {"allow_root": True},  # CRIU needs root, and so does the test machine
        "SnapshotExtensionApp": {
            "local_store_dir": str(tmp / "store"),
            "work_dir": str(tmp / "work"),
            "snapshot_before_shutdown": True,
            # Nothing else happens by itself during a test.
            "periodic_interval": 0,
            "idle_suspend_after": 0,
        },
    }
    # A fresh JupyterLab would ask whether to fetch Jupyter news (offline here); Galata's
    # defaults for the other UI tests turn that off too.
    lab_settings = {
        "@jupyterlab/apputils-extension:notification": {
            "checkForUpdates": False,
            "fetchNews": "false",
        }
    }
    hub: Hub | None = None
    try:
        hub = Hub(
            tmp / "hub",
            server_config,
            {},
            lab_settings=lab_settings,
            port=args.port,
            default_url="/lab",
            lab=True,
        )
        print(f"UI test hub ready at {hub.url} admin token {hub.admin_token}", flush=True)
        while True:
            signal.pause()
    finally:
        try:
            if hub is not None:
                hub.close()
                if args.log:
                    shutil.copyfile(hub.log_path, args.log)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
