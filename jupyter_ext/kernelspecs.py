"""Snapshot kernelspecs: "Python 3 (snapshots)" (the wrapper with its own ipykernel), and
any installed kernelspec made a snapshot kernel (``--wrap NAME``: the wrapper with that
kernel behind its bridge, kernel_wrapper.inkernel.bridge).

A wrapped kernelspec keeps what the original says (argv, env, interrupt mode, language,
metadata, its logos and other files) and runs ``python -m kernel_wrapper -f
{connection_file} -- ARGV``, ARGV being the original argv as it is: jupyter_client puts the
server's connection file into both, and the wrapper gives the kernel its own in its place.
The debugger is turned off (a debug session does not survive a snapshot, and a kernel's
debug adapter listens on a TCP port that the image would carry).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from .core.errors import SnapshotError

#: The name of "Python 3 (snapshots)", the snapshot kernel a restore starts where a
#: snapshot names none (the panel's SNAPSHOT_KERNEL_NAME spells it too: a test checks).
KERNEL_NAME = "python3-snapshot"
#: The data of "Python 3 (snapshots)" (shipped in the wheel, installed with it too).
KERNELSPEC_DIR = Path(__file__).resolve().parent / "kernelspec"
#: What every snapshot kernelspec's metadata holds under "kernel_snapshots".
SPEC_FORMAT = 1
#: How the ipykernel of a kernelspec is started (then the wrapper's own ipykernel runs it).
IPYKERNEL_MODULES = ("ipykernel_launcher", "ipykernel")


def install_kernelspec(
    name: str = KERNEL_NAME,
    display_name: str = "Python 3 (snapshots)",
    *,
    user: bool = False,
    prefix: str | None = None,
) -> str:
    """Install the snapshot kernelspec, pointing at this Python interpreter."""
    spec: dict[str, Any] = json.loads((KERNELSPEC_DIR / "kernel.json").read_text())
    spec["argv"][0] = sys.executable
    spec["display_name"] = display_name
    return _install(KERNELSPEC_DIR, spec, name, user=user, prefix=prefix)


def wrapped_spec(original: dict[str, Any], wrapped_name: str) -> dict[str, Any]:
    """The kernel.json of a snapshot kernel running ``original``'s kernel (a kernelspec's
    kernel.json, named ``wrapped_name``); SnapshotError for one that cannot be wrapped."""
    argv = [str(arg) for arg in original.get("argv") or []]
    metadata = dict(original.get("metadata") or {})
    if "kernel_snapshots" in metadata or "kernel_wrapper" in argv:
        raise SnapshotError(
            f"The kernelspec {wrapped_name!r} is a snapshot kernel already.",
            hint="Wrap the kernel it was made from: install that kernel's own kernelspec "
            "again (for IRkernel: R -e 'IRkernel::installspec()'), then wrap it.",
        )
    if not any("{connection_file}" in arg for arg in argv):
        raise SnapshotError(
            f"The kernelspec {wrapped_name!r} does not pass {{connection_file}} to its "
            f"kernel (argv {argv}): a snapshot kernel must give the kernel a connection "
            "file of its own.",
            hint="Only kernels started with a Jupyter connection file can be wrapped.",
        )
    spec = {
        **original,
        "argv": [sys.executable, "-m", "kernel_wrapper", "-f", "{connection_file}", "--", *argv],
        "display_name": f"{original.get('display_name') or wrapped_name} (snapshots)",
        "metadata": {
            **metadata,
            "debugger": False,
            "kernel_snapshots": {"format": SPEC_FORMAT, "wraps": wrapped_name},
        },
    }
    return spec


def runs_our_ipykernel(argv: list[str]) -> bool:
    """Whether ``argv`` starts ipykernel in this Python environment (``python [-X...] -m
    ipykernel_launcher ...``, with this interpreter, one of its environment's bin
    directory, or a bare ``python3`` that jupyter_client makes this one): then our own
    ipykernel, with its snapshot agent, runs in its place."""
    if "-m" not in argv[1:]:
        return False
    at = argv.index("-m", 1)
    if at + 1 >= len(argv) or argv[at + 1] not in IPYKERNEL_MODULES:
        return False
    if not all(option.startswith("-") for option in argv[1:at]):
        return False
    names = {"python", f"python{sys.version_info[0]}", "python{}.{}".format(*sys.version_info)}
    program = shutil.which(argv[0]) or argv[0]
    ours = Path(os.path.abspath(sys.executable)).parent
    return argv[0] in names or Path(os.path.abspath(program)).parent == ours


def wrap_kernelspec(
    wrapped: str,
    name: str = "",
    display_name: str = "",
    *,
    user: bool = False,
    prefix: str | None = None,
) -> str:
    """Install ``name`` (default ``WRAPPED-snapshot``): the installed kernelspec
    ``wrapped`` as a snapshot kernel. ``name`` may be ``wrapped`` itself: then every
    notebook whose metadata name it starts the snapshot kernel."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        found = KernelSpecManager().get_kernel_spec(wrapped)
    except NoSuchKernel:
        raise SnapshotError(
            f"No kernelspec named {wrapped!r} is installed.",
            hint="'jupyter kernelspec list' shows the installed ones.",
        ) from None
    original = json.loads((Path(found.resource_dir) / "kernel.json").read_text())
    if runs_our_ipykernel([str(arg) for arg in original.get("argv") or []]):
        spec: dict[str, Any] = json.loads((KERNELSPEC_DIR / "kernel.json").read_text())
        spec["argv"][0] = sys.executable
        spec["display_name"] = display_name or f"{found.display_name} (snapshots)"
        spec["metadata"]["kernel_snapshots"]["wraps"] = wrapped
        if original.get("env"):
            spec["env"] = original["env"]
        return _install(
            KERNELSPEC_DIR, spec, name or f"{wrapped}-snapshot", user=user, prefix=prefix
        )
    spec = wrapped_spec(original, wrapped)
    if display_name:
        spec["display_name"] = display_name
    return _install(
        Path(found.resource_dir), spec, name or f"{wrapped}-snapshot", user=user, prefix=prefix
    )


def _install(
    files: Path, spec: dict[str, Any], name: str, *, user: bool, prefix: str | None
) -> str:
    """Install ``spec`` as kernelspec ``name``, with the other files of ``files``."""
    from jupyter_client.kernelspec import KernelSpecManager

    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp) / name
        shutil.copytree(files, staging)
        (staging / "kernel.json").write_text(json.dumps(spec, indent=1))
        path: str = KernelSpecManager().install_kernel_spec(
            str(staging), name, user=user, prefix=prefix
        )
    return path
