"""Snapshot kernelspecs: ``--wrap NAME`` (docs/kernels.md), and the switch that makes
every Python kernel a snapshot kernel (README, docs/jupyterhub.md):
``jupyter snapshot install-kernelspec --name python3`` replaces ipykernel's plain
``python3`` kernelspec, which the Launcher's first Python tile and every notebook whose
metadata say ``python3`` start. deploy/Dockerfile runs it; tests/test_container.py opens a
``python3`` notebook in the image's pod and snapshots its kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from jupyter_client.kernelspec import KernelSpecManager

from jupyter_ext.core.errors import SnapshotError
from jupyter_ext.kernelspecs import wrap_kernelspec


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


def _spec(kernels: Path, name: str) -> dict[str, object]:
    data: dict[str, object] = json.loads((kernels / name / "kernel.json").read_text())
    return data


def test_wrap_makes_any_kernelspec_a_snapshot_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--wrap NAME`` keeps what the original says (argv as it is after ``--``, env,
    interrupt mode, language, metadata, its other files) with the debugger off; ``--name``
    may be the original's own (every notebook naming it then starts the snapshot kernel)."""
    prefix = tmp_path / "env"
    kernels = prefix / "share" / "jupyter" / "kernels"
    original = {
        "argv": ["mykernel", "--connection", "{connection_file}", "--fast"],
        "display_name": "My Lang",
        "language": "mylang",
        "interrupt_mode": "message",
        "env": {"MYLANG_HOME": "/opt/mylang"},
        "metadata": {"debugger": True, "other": {"a": 1}},
    }
    (kernels / "mylang").mkdir(parents=True)
    (kernels / "mylang" / "kernel.json").write_text(json.dumps(original))
    (kernels / "mylang" / "logo-64x64.png").write_bytes(b"png")
    cli = [sys.executable, "-m", "jupyter_ext.cli", "install-kernelspec", "--prefix", str(prefix)]
    env = {**os.environ, "JUPYTER_PATH": str(prefix / "share" / "jupyter")}
    subprocess.run([*cli, "--wrap", "mylang"], check=True, capture_output=True, env=env)
    wrapped = _spec(kernels, "mylang-snapshot")
    assert wrapped["argv"] == [
        sys.executable,
        "-m",
        "kernel_wrapper",
        "-f",
        "{connection_file}",
        "--",
        *original["argv"],  # type: ignore[misc]
    ]
    assert wrapped["display_name"] == "My Lang (snapshots)"
    assert wrapped["language"] == "mylang"
    assert wrapped["interrupt_mode"] == "message"
    assert wrapped["env"] == {"MYLANG_HOME": "/opt/mylang"}
    assert wrapped["metadata"] == {
        "debugger": False,
        "other": {"a": 1},
        "kernel_snapshots": {"format": 1, "wraps": "mylang"},
    }
    assert (kernels / "mylang-snapshot" / "logo-64x64.png").read_bytes() == b"png"

    monkeypatch.setenv("JUPYTER_PATH", env["JUPYTER_PATH"])
    wrap_kernelspec("mylang", "mylang", prefix=str(prefix))  # what --name mylang does
    assert _spec(kernels, "mylang")["argv"] == wrapped["argv"]
    with pytest.raises(SnapshotError, match="is a snapshot kernel already"):
        wrap_kernelspec("mylang", prefix=str(prefix))


def test_wrap_refuses_what_it_cannot_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernelspec that does not pass its connection file, and one that is not there,
    are refused with the reason; ipykernel of this Python becomes our own ipykernel."""
    prefix = tmp_path / "env"
    kernels = prefix / "share" / "jupyter" / "kernels"
    (kernels / "noconn").mkdir(parents=True)
    (kernels / "noconn" / "kernel.json").write_text(
        json.dumps({"argv": ["somekernel", "--port", "5555"], "display_name": "X", "language": "x"})
    )
    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    with pytest.raises(SnapshotError, match=r"does not pass \{connection_file\}"):
        wrap_kernelspec("noconn", prefix=str(prefix))
    with pytest.raises(SnapshotError, match="No kernelspec named 'nothing-here'"):
        wrap_kernelspec("nothing-here", prefix=str(prefix))
    plain = [sys.executable, "-m", "ipykernel", "install", "--prefix", str(prefix)]
    subprocess.run([*plain, "--name", "py"], check=True, capture_output=True)
    wrap_kernelspec("py", prefix=str(prefix))
    ours = _spec(kernels, "py-snapshot")
    assert ours["argv"] == [sys.executable, "-m", "kernel_wrapper", "-f", "{connection_file}"]
    assert ours["metadata"]["kernel_snapshots"] == {"format": 1, "wraps": "py"}  # type: ignore[index]
