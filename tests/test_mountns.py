"""The kernel's own mount namespace (core/isolation/mountns.py): which mounts a dump names external,
and how a restore binds them on a machine that may lack some. The dump and restore of such
a kernel run for real in tests/test_parallel.py and every root-mode kernel test."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jupyter_ext.core.criu import unprivileged
from jupyter_ext.core.isolation import mountns


def test_mountinfo_escapes_are_read() -> None:
    assert mountns._unescape(r"/mnt/with\040space\011tab") == "/mnt/with space\ttab"


def test_a_process_in_our_mount_namespace_has_nothing_external() -> None:
    assert mountns.external_mounts(os.getpid()) == []


def test_restore_binds_each_path_and_gives_missing_ones_an_empty_directory(
    tmp_path: Path,
) -> None:
    options, missing = mountns.restore_options(["/dev", "/no/such/mount"], tmp_path / "empty")
    assert options == [
        "--root",
        "/",
        "--external",
        "mnt[/dev]:/dev",
        "--external",
        f"mnt[/no/such/mount]:{tmp_path / 'empty'}",
    ]
    assert missing == ["/no/such/mount"]
    assert (tmp_path / "empty").is_dir()
    assert mountns.restore_options([], tmp_path / "unused") == ([], [])


def test_a_kernel_namespace_names_all_but_its_proc(tmp_path: Path) -> None:
    if unprivileged():
        pytest.skip("a mount namespace needs root (non-root kernels share the server's)")
    ready = tmp_path / "ready"
    code = (
        "import sys, time; from jupyter_ext.core.isolation import mountns; "
        "mountns.mount_own_proc();"
        f"open({str(ready)!r}, 'w').close(); time.sleep(60)"
    )
    child = subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            "--mount",
            "--propagation",
            "private",
            sys.executable,
            "-c",
            code,
        ],
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        kernel = int(Path(f"/proc/{child.pid}/task/{child.pid}/children").read_text().split()[0])
        mounts = mountns.mount_points(kernel)
        external = mountns.external_mounts(kernel)
        assert [m for m in mounts if m.path == "/proc"] == [mountns.MountPoint("/proc", "proc")]
        assert "/proc" not in external
        assert "/" not in external
        assert "/dev" in external
        assert "/sys" in external
        assert not [m for m in mounts if m.fstype in mountns.DETACHED_TYPES]
        assert len(external) == len(set(external))
        # Its /proc is its PID namespace's: it is process 1 there.
        assert Path(f"/proc/{kernel}/root/proc/1/cmdline").read_bytes().split(b"\0")[1] == b"-c"
    finally:
        child.kill()
        child.wait()
