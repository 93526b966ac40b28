"""Runtime directories of wrappers killed with SIGKILL are removed; live ones never are."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from jupyter_ext.core.errors import SnapshotError
from kernel_wrapper.runtime import (
    SOCKET_PATH_MAX,
    STALE_UNNAMED_SECONDS,
    RuntimeDir,
    kernel_endpoints_dir,
    remove_stale_runtime_dirs,
)
from testkit.processes import KernelProcess


def _named(root: Path, name: str, pid: int, fd: int) -> Path:
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "wrapper.pid").write_text(f"{pid} {fd}\n")
    return directory


def test_stale_runtime_dirs_go_live_ones_stay(
    kernel_factory: Callable[..., KernelProcess], tmp_path: Path
) -> None:
    root = tmp_path / "runtime"
    exited = subprocess.Popen(["true"])
    exited.wait()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        dead = _named(root, "dead", exited.pid, 3)
        reused = _named(root, "reused", other.pid, 0)  # a live PID, not a wrapper's
        making = root / "making"  # a wrapper is making it right now: no wrapper.pid yet
        making.mkdir()
        abandoned = root / "abandoned"  # a wrapper died making it, long ago
        abandoned.mkdir()
        long_ago = time.time() - STALE_UNNAMED_SECONDS - 60
        os.utime(abandoned, (long_ago, long_ago))
        not_a_dir = root / "tmpfile"
        not_a_dir.write_text("")

        # A wrapper that starts removes what dead wrappers left, and only that.
        first = kernel_factory(extra_args=["--runtime-dir", str(root)])
        first_dir = Path(first.status()["runtime_dir"])
        assert sorted(p.name for p in root.iterdir()) == sorted(
            ["making", "tmpfile", first_dir.name]
        )
        assert not dead.exists()
        assert not reused.exists()
        assert not abandoned.exists()

        # A second wrapper leaves the first one's directory alone while it lives...
        second = kernel_factory(extra_args=["--runtime-dir", str(root)])
        second_dir = Path(second.status()["runtime_dir"])
        assert first_dir.is_dir()
        assert second_dir.is_dir()
        assert first.execute("print(6 * 7)").strip() == "42"

        # ... and once it was killed with SIGKILL, its directory is stale.
        first.kill_all()
        assert first_dir.is_dir()  # nobody removed it
        assert remove_stale_runtime_dirs(root) == [first_dir]
        assert second_dir.is_dir()
        assert making.is_dir()
        assert not_a_dir.exists()
        assert second.execute("print('still here')").strip() == "still here"
    finally:
        other.kill()
        other.wait()


def test_a_killed_wrappers_kernel_endpoints_go_with_its_runtime_dir(tmp_path: Path) -> None:
    """A wrapper killed before its kernel (behind the bridge) had bound its endpoints
    leaves their directory under /tmp: it goes with the wrapper's runtime directory, and
    another wrapper's stays."""
    root = tmp_path / "runtime"
    exited = subprocess.Popen(["true"])
    exited.wait()
    dead = _named(root, os.urandom(8).hex(), exited.pid, 3)
    living = _named(root, os.urandom(8).hex(), os.getpid(), 0)  # not a wrapper: stale too
    ours = [kernel_endpoints_dir(d.name) for d in (dead, living)]
    other = kernel_endpoints_dir(os.urandom(8).hex())  # no runtime directory of ours
    for directory in [*ours, other]:
        directory.mkdir(mode=0o700)
        (directory / "k-1").write_text("")
    try:
        assert sorted(remove_stale_runtime_dirs(root)) == sorted([dead, living])
        assert not any(d.exists() for d in ours)
        assert other.is_dir()
    finally:
        for directory in [*ours, other]:
            shutil.rmtree(directory, ignore_errors=True)


def test_a_runtime_directory_too_deep_for_the_kernels_sockets_is_refused(tmp_path: Path) -> None:
    """A unix socket's path holds at most 107 bytes: a wrapper whose channels would not fit
    says so, and which setting moves them, before it makes anything (zmq said only
    "Internal error" from the kernel's start)."""
    root = tmp_path / ("d" * (SOCKET_PATH_MAX - len(str(tmp_path)) - 20))
    with pytest.raises(SnapshotError, match=r"at most 107") as raised:
        RuntimeDir(root)
    assert "JUPYTER_SNAPSHOT_RUNTIME_DIR" in raised.value.hint
    assert not root.exists()
