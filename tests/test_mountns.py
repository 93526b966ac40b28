"""The kernel's own mount namespace (core/isolation/mountns.py): which mounts a dump names external,
and how a restore binds them on a machine that may lack some. The dump and restore of such
a kernel run for real in tests/test_parallel.py and every root-mode kernel test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def test_mount_points_this_machine_lacks_are_made_and_removed(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    there = str(tmp_path)
    nested = str(tmp_path / "gone" / "overlay" / "merged")
    under_a_file = str(tmp_path / "a-file" / "merged")
    made = mountns.make_mount_points([there, nested, under_a_file])
    assert made == [tmp_path / "gone", tmp_path / "gone" / "overlay", Path(nested)]
    assert Path(nested).is_dir()
    mountns.remove_mount_points(made)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.parametrize("kind", ["tmpfs", "overlay", "podman", "podman-ended"])
def test_a_mount_gone_since_the_kernel_started_does_not_stop_its_restore(
    kernel_factory: Callable[..., Any], tmp_path: Path, kind: str
) -> None:
    """A kernel's mount namespace is a copy of the server's as the kernel started, with
    whatever was mounted then: a container's overlay (podman, docker), a drive. When that
    is gone by the restore (the container removed), the restore still works, and leaves
    nothing on the host."""
    if unprivileged():
        pytest.skip("a mount namespace needs root (non-root kernels share the server's)")
    transient = tmp_path / "containers" / "overlay"
    point = transient / "merged"
    point.mkdir(parents=True)
    storage = tmp_path / "containers"
    if kind.startswith("podman"):
        # containers/storage binds its overlay directory on itself, private, and mounts
        # each container's root below it; "podman-ended": that bind is gone too by the
        # restore (the last container ended)
        subprocess.run(["mount", "--bind", str(storage), str(storage)], check=True)
        subprocess.run(["mount", "--make-private", str(storage)], check=True)
    if kind == "tmpfs":
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(point)], check=True)
    else:
        layers = {name: tmp_path / name for name in ("lower", "upper", "work")}
        for layer in layers.values():
            layer.mkdir()
        options = ",".join(f"{name}dir={path}" for name, path in layers.items())
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(point)], check=True)
    try:
        kernel = kernel_factory()
        kernel.execute("x = 5")
        assert str(point) in mountns.external_mounts(kernel.status()["inner_pid"])
        kernel.snapshot(tmp_path / "snap")
        kernel.kill_all()
    finally:
        subprocess.run(["umount", "--lazy", str(point)], check=True)
        if kind == "podman-ended":
            subprocess.run(["umount", "--lazy", str(storage)], check=True)
    shutil.rmtree(transient)

    try:
        restored = kernel_factory(restore_from=tmp_path / "snap")
        assert restored.execute("print(x)").strip() == "5"
        assert not transient.exists()
    finally:
        if kind == "podman":
            subprocess.run(["umount", "--lazy", str(storage)], check=True)
