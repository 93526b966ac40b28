"""Whether this CRIU tracks a process's memory between dumps here, and how: the kernel's
soft-dirty bits, or the write-protect bits of an asynchronous userfaultfd (the project's
patch, scripts/criu-patches/0001; Linux >= 6.7). Asked of ``criu check`` once per binary;
and whether it can pre-copy a big kernel without root (:func:`precopies_unprivileged`).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from .. import proctree
from .options import mode_args

_KNOWN: dict[str, tuple[str | None, str]] = {}
_BUILDS: dict[str, bool] = {}

#: How ``criu --version`` names a build of scripts/install-criu.sh (``GitID: jks-...``).
PROJECT_BUILD = re.compile(r"^GitID:\s*jks-", re.MULTILINE)


def dirty_tracking(criu: Path) -> tuple[str | None, str]:
    """ "soft-dirty", "userfaultfd" or None for the CRIU at ``criu``, and what its check
    said (cached)."""
    key = str(criu)
    if key not in _KNOWN:
        try:
            out = subprocess.run(
                [key, "check", "-v4", "--feature", "mem_dirty_track", *mode_args()],
                capture_output=True,
                text=True,
                timeout=30,
                # Asked by a wrapper before a dump: it must not outlive a killed wrapper.
                preexec_fn=proctree.die_with_parent,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, str(exc)
        _KNOWN[key] = dirty_tracking_said(out.returncode, out.stdout + out.stderr)
    return _KNOWN[key]


def dirty_tracking_said(returncode: int, output: str) -> tuple[str | None, str]:
    """What ``criu check --feature mem_dirty_track`` said (:func:`dirty_tracking`)."""
    if returncode != 0 or "is supported" not in output:
        return None, (
            "this CRIU cannot track memory here (no soft-dirty bits in the kernel, and "
            "no userfaultfd write-protection: Linux >= 6.7 and the CRIU that "
            "scripts/install-criu.sh builds are needed)"
        )
    if "write-protect bits" in output:
        return "userfaultfd", "write-protect bits of an asynchronous userfaultfd"
    return "soft-dirty", "the kernel's soft-dirty bits"


def precopies_unprivileged(criu: Path) -> bool:
    """Whether the CRIU at ``criu`` pre-copies a big kernel for an ordinary user: the
    project's build (cached). Its patch 0004 has a read-mode ``pre-dump`` hold one pipe;
    CRIU 4.2 holds one per run of pages, and past the user's pipe pages
    (``fs.pipe-user-pages-soft``) each new pipe holds two: a kernel of a few hundred MiB
    then needs more descriptors than an ordinary user may open ("Too many open files")."""
    key = str(criu)
    if key not in _BUILDS:
        try:
            out = subprocess.run(
                [key, "--version"],
                capture_output=True,
                text=True,
                timeout=10,
                preexec_fn=proctree.die_with_parent,
            )
        except (OSError, subprocess.TimeoutExpired):
            return False
        _BUILDS[key] = out.returncode == 0 and bool(PROJECT_BUILD.search(out.stdout))
    return _BUILDS[key]


def tracking_args(track_mem: bool, prev_images: Path | None) -> list[str]:
    """CRIU's options for a dump that tracks memory, on ``prev_images`` if given."""
    args = ["--track-mem"] if track_mem or prev_images is not None else []
    if prev_images is not None:
        args += ["--prev-images-dir", str(prev_images)]
    return args
