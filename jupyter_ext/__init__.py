"""Jupyter kernel snapshots: save and restore whole kernel processes with CRIU.

The server extension is loaded lazily so that ``jupyter_ext.core`` stays importable
without Jupyter (the kernel wrapper and the CLI use it).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """Where the built JupyterLab extension lives (for ``jupyter labextension develop``)."""
    return [{"src": "labextension", "dest": "jupyter-kernel-snapshots"}]


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    from .app import SnapshotExtensionApp

    return [{"module": "jupyter_ext", "app": SnapshotExtensionApp}]
