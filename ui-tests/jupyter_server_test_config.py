"""JupyterLab for the UI tests: a real server with the snapshot extension, no token.

Never use this configuration for anything else: it turns off every security protection.
The snapshot store, the work directory and the notebooks live in a fresh temporary
directory (printed at start; scripts/ui-tests.sh removes it), so every run starts empty.
"""

import os
import tempfile

from jupyterlab.galata import configure_jupyter_server

c = get_config()  # type: ignore[name-defined]  # noqa: F821

configure_jupyter_server(c)

# scripts/ui-tests.sh makes (and removes) the directory; one of our own otherwise.
_tmp = os.environ.get("UI_TESTS_TMP") or tempfile.mkdtemp(prefix="kernel-snapshots-ui-")
_root = os.environ.get("JUPYTERLAB_GALATA_ROOT_DIR") or os.path.join(_tmp, "notebooks")
os.makedirs(_root, exist_ok=True)
print(f"kernel-snapshots UI tests: root {_root}, store and work under {_tmp}", flush=True)

c.ServerApp.root_dir = _root
c.ServerApp.allow_root = True  # CRIU needs root, and so does the test machine
c.ServerApp.port = int(os.environ.get("UI_TESTS_PORT", "8888"))
# Token-less for the test only (configure_jupyter_server sets an empty token).
c.IdentityProvider.token = ""

c.SnapshotExtensionApp.local_store_dir = os.path.join(_tmp, "store")
c.SnapshotExtensionApp.work_dir = os.path.join(_tmp, "work")
# Nothing should happen by itself during a test: no periodic snapshot, no idle suspend,
# and no snapshot of every kernel when Playwright stops the server.
c.SnapshotExtensionApp.periodic_interval = 0
c.SnapshotExtensionApp.idle_suspend_after = 0
c.SnapshotExtensionApp.snapshot_before_shutdown = False
