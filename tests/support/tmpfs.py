"""A small tmpfs a test mounts: a disk that fills up (needs root)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path


class Tmpfs:
    """A tmpfs of ``size`` (mount's syntax: "20m") at ``path``; unmount it after the test."""

    def __init__(self, path: Path, size: str) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True
        )

    def resize(self, size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True)

    def unmount(self) -> None:
        if subprocess.run(["umount", str(self.path)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(self.path)], check=False)


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` at ``path`` for the ``with`` block."""
    if os.geteuid() != 0:
        raise RuntimeError("mounting a tmpfs needs root")
    disk = Tmpfs(path, size)
    try:
        yield disk.path
    finally:
        disk.unmount()
