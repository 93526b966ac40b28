"""The switch that makes every Python kernel a snapshot kernel (README, docs/jupyterhub.md):
``jupyter snapshot install-kernelspec --name python3`` replaces ipykernel's plain
``python3`` kernelspec, which the Launcher's first Python tile and every notebook whose
metadata say ``python3`` start. deploy/Dockerfile runs it; tests/test_container.py opens a
``python3`` notebook in the image's pod and snapshots its kernel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from jupyter_client.kernelspec import KernelSpecManager


def test_python3_becomes_the_snapshot_kernel(tmp_path: Path) -> None:
    prefix = tmp_path / "env"
    plain = [sys.executable, "-m", "ipykernel", "install", "--prefix", str(prefix)]
    subprocess.run([*plain, "--name", "python3"], check=True, capture_output=True)
    kernels = prefix / "share" / "jupyter" / "kernels"
    before = json.loads((kernels / "python3" / "kernel.json").read_text())
    assert "kernel_wrapper" not in before["argv"]

    switch = [sys.executable, "-m", "jupyter_ext.cli", "install-kernelspec", "--name", "python3"]
    subprocess.run([*switch, "--prefix", str(prefix)], check=True, capture_output=True)
    spec = KernelSpecManager(kernel_dirs=[str(kernels)]).get_kernel_spec("python3")
    assert spec.argv[:3] == [sys.executable, "-m", "kernel_wrapper"]
    assert spec.metadata["kernel_snapshots"] == {"format": 1}
    assert spec.display_name == "Python 3 (snapshots)"
