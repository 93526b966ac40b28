"""What a CRIU log says: how long the tree was frozen, the lines that explain a failure."""

from __future__ import annotations

import re
from pathlib import Path

_LOG_LINE = re.compile(rb"^\((\d+\.\d+)\) (.*)$")


def frozen_seconds(dump_log: Path) -> float:
    """How long a dump kept the tree frozen: from CRIU's first "Seized task" to its
    "Unfreezing tasks", read from the timestamps of the log (0.0 if they are missing).

    This is the kernel's real pause; the rest of ``criu dump`` runs beside the kernel.
    """
    seized: float | None = None
    try:
        with dump_log.open("rb") as log:
            for line in log:
                match = _LOG_LINE.match(line)
                if match is None:
                    continue
                if seized is None and match[2].startswith(b"Seized task"):
                    seized = float(match[1])
                elif seized is not None and match[2].startswith(b"Unfreezing tasks"):
                    return float(match[1]) - seized
    except OSError:
        pass
    return 0.0


def log_excerpt(log_file: Path, output: str, limit: int = 20) -> str:
    """The lines of a CRIU log that explain a failure: its errors, and what led to them."""
    try:
        lines = log_file.read_text(errors="replace").splitlines()
    except OSError:
        lines = output.splitlines()
    picked = [line for line in lines if "Error" in line or "error" in line or "Warn" in line]
    if not picked:
        picked = lines[-limit:]
    return "\n".join(line.strip() for line in picked[-limit:])
