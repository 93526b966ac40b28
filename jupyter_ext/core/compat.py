"""Can a snapshot run on this machine? The host checks made before CRIU starts.

Kept apart from :mod:`.manifest`, which only describes a snapshot: this module holds the
policy (which differences refuse a restore) and reaches the process, CPU and GPU facts
of this machine to apply it.
"""

from __future__ import annotations

import platform

from .errors import IncompatibleSnapshotError
from .gpu import check_restore_compatible
from .manifest import Manifest, cpu_flags
from .proctree import missing_files

#: CPU flags whose absence breaks code already compiled or selected for them.
INSTRUCTION_SET_FLAGS = ("avx", "sse", "fma", "amx", "bmi", "f16c", "popcnt", "aes", "sha_ni")


def check_compatible(manifest: Manifest) -> None:
    """Refuse, before CRIU starts, a snapshot that cannot run on this machine: another
    architecture, missing CPU instruction sets, files the kernel had open that are gone or
    changed, no fit GPU (model, driver, free memory) for the GPU memory it holds."""
    if manifest.machine != platform.machine():
        raise IncompatibleSnapshotError(
            f"The snapshot was taken on {manifest.machine}; this machine is {platform.machine()}.",
            hint="Restore it on a machine of the same architecture.",
        )
    missing_flags = set(manifest.cpu_flags) - set(cpu_flags())
    important = sorted(f for f in missing_flags if f.startswith(INSTRUCTION_SET_FLAGS))
    if important:
        raise IncompatibleSnapshotError(
            f"This CPU lacks instruction sets the snapshot's CPU ({manifest.cpu_model}) had: "
            + ", ".join(important[:8]),
            hint="Restore on a machine with the same or a newer CPU model.",
        )
    problems = missing_files(manifest.needed_files, made_in=manifest.temp_dir)
    if problems:
        raise IncompatibleSnapshotError(
            "Files the kernel had open are missing or changed here: " + "; ".join(problems[:5]),
            hint="Make those files available at the same paths (same content), then restore.",
        )
    if manifest.gpu.get("ns_pids") and manifest.gpu.get("available"):
        check_restore_compatible(manifest.gpu, int(manifest.gpu.get("needed_bytes", 0)))
