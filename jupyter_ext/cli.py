"""``jupyter snapshot``: check the machine, install the kernel, and manage snapshots."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from jupyter_core.application import JupyterApp
from traitlets import Bool, Unicode

from . import __version__
from .core.doctor import run_checks
from .core.protocol import DEFAULT_RUNTIME_ROOT

KERNELSPEC_DIR = Path(__file__).resolve().parent / "kernelspec"


class DoctorApp(JupyterApp):
    name = "jupyter-snapshot-doctor"
    description = "Say what works and what is missing for kernel snapshots, and how to fix it."
    criu = Unicode("", config=True, help="Path of the criu binary (default: search).")
    as_json = Bool(False, config=True, help="Print the checks as JSON.")
    flags = {"json": ({"DoctorApp": {"as_json": True}}, "Print the checks as JSON.")}
    aliases = {"criu": "DoctorApp.criu"}

    def start(self) -> None:
        checks = run_checks(self.criu or None, DEFAULT_RUNTIME_ROOT)
        if self.as_json:
            print(json.dumps([c.to_dict() for c in checks], indent=1))
        else:
            for check in checks:
                mark = "ok  " if check.ok else ("FAIL" if check.required else "warn")
                print(f"[{mark}] {check.name}: {check.detail}")
                if not check.ok and check.fix:
                    print(f"       fix: {check.fix}")
            failed = [c for c in checks if c.required and not c.ok]
            print(
                "\nSnapshots work on this machine."
                if not failed
                else f"\nSnapshots do not work here yet: {len(failed)} required check(s) failed."
            )
        self.exit(1 if any(c.required and not c.ok for c in checks) else 0)


class InstallKernelSpecApp(JupyterApp):
    name = "jupyter-snapshot-install-kernelspec"
    description = "Install the 'Python 3 (snapshots)' kernel for this Python environment."
    kernel_name = Unicode("python3-snapshot", config=True, help="Kernel name.")
    display_name = Unicode("Python 3 (snapshots)", config=True, help="Name shown in Jupyter.")
    user = Bool(False, config=True, help="Install for the current user only.")
    prefix = Unicode("", config=True, help="Install under this prefix (default: sys.prefix).")
    aliases = {
        "name": "InstallKernelSpecApp.kernel_name",
        "display-name": "InstallKernelSpecApp.display_name",
        "prefix": "InstallKernelSpecApp.prefix",
    }
    flags = {"user": ({"InstallKernelSpecApp": {"user": True}}, "Install for this user only.")}

    def start(self) -> None:
        path = install_kernelspec(
            self.kernel_name,
            self.display_name,
            user=self.user,
            prefix=None if self.user else (self.prefix or sys.prefix),
        )
        print(f"Installed kernelspec {self.kernel_name} in {path}")


def install_kernelspec(
    name: str = "python3-snapshot",
    display_name: str = "Python 3 (snapshots)",
    *,
    user: bool = False,
    prefix: str | None = None,
) -> str:
    """Install the snapshot kernelspec, pointing at this Python interpreter."""
    from jupyter_client.kernelspec import KernelSpecManager

    spec: dict[str, Any] = json.loads((KERNELSPEC_DIR / "kernel.json").read_text())
    spec["argv"][0] = sys.executable
    spec["display_name"] = display_name
    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp) / name
        shutil.copytree(KERNELSPEC_DIR, staging)
        (staging / "kernel.json").write_text(json.dumps(spec, indent=1))
        path: str = KernelSpecManager().install_kernel_spec(
            str(staging), name, user=user, prefix=prefix
        )
    return path


class SnapshotApp(JupyterApp):
    name = "jupyter-snapshot"
    version = __version__
    description = "Whole-process snapshots of Jupyter kernels (CRIU)."
    subcommands = {
        "doctor": (DoctorApp, DoctorApp.description),
        "install-kernelspec": (InstallKernelSpecApp, InstallKernelSpecApp.description),
    }

    def start(self) -> None:
        if self.subapp is None:
            print("No subcommand given; choose one of: " + ", ".join(self.subcommands))
            self.print_subcommands()
            self.exit(1)
        super().start()


main = SnapshotApp.launch_instance
