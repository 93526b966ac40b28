"""A copy's private view of the temporary directory (core/isolation/privatetmp.py), on its own:
the server's files visible, the copy's writes and locks its own, nothing left after it,
also where the view's layers cannot lie on the file system they are given (an overlay,
as in a container). The copies of a Dask kernel that need it: tests/test_netns.py."""

from __future__ import annotations

import fcntl
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from jupyter_ext.core.isolation import mountns
from jupyter_ext.core.isolation.privatetmp import PrivateTemp, make_missing_empty_files
from jupyter_ext.core.proctree import missing_files
from kernel_wrapper.runtime import remove_stale_runtime_dirs

needs_root = pytest.mark.needs_root("mounts (overlay, tmpfs)")


def mounted_below(directory: Path) -> list[str]:
    """What is mounted strictly below ``directory``."""
    prefix = str(directory) + "/"
    return [m.path for m in mountns.mount_points() if m.path.startswith(prefix)]


@pytest.fixture
def overlay_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on an overlay file system (where no overlay's upper layer may lie)."""
    layers = tmp_path / "container"
    for name in ("lower", "upper", "work", "root"):
        (layers / name).mkdir(parents=True)
    root = layers / "root"
    options = f"lowerdir={layers}/lower,upperdir={layers}/upper,workdir={layers}/work"
    mountns.mount("overlay", str(root), "overlay", 0, options)
    try:
        yield root
    finally:
        mountns.detach_below(root)


@needs_root
@pytest.mark.parametrize("where", ["disk", "overlay"])
def test_view_shows_the_servers_files_and_keeps_its_own(
    tmp_path: Path, overlay_dir: Path, where: str
) -> None:
    lower = tmp_path / "tmp"
    lower.mkdir()
    (lower / "shared").write_text("server")
    (lower / "worker.dirlock").write_text("")
    parent = tmp_path if where == "disk" else overlay_dir
    view = PrivateTemp.create(str(lower), parent)
    try:
        source = view.source
        assert (source / "shared").read_text() == "server"
        (source / "shared").write_text("copy")
        (source / "own").write_text("copy")
        (lower / "later").write_text("server")
        assert (lower / "shared").read_text() == "server"
        assert not (lower / "own").exists()
        assert (source / "later").read_text() == "server"
        with open(lower / "worker.dirlock") as theirs, open(source / "worker.dirlock") as ours:
            fcntl.flock(theirs, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(ours, fcntl.LOCK_EX | fcntl.LOCK_NB)  # an inode of its own
        on_tmpfs = [m for m in mountns.mount_points() if m.path == str(view.base / "layers")]
        assert bool(on_tmpfs) == (where == "overlay")
    finally:
        view.close()
    assert not view.base.exists()
    assert mounted_below(parent) == ([] if parent == overlay_dir else [str(overlay_dir)])
    assert (lower / "shared").read_text() == "server"


@needs_root
def test_a_view_its_wrapper_left_goes_with_the_next_wrapper(
    tmp_path: Path, overlay_dir: Path
) -> None:
    """A wrapper killed with its copy leaves the view's tmpfs mounted in its runtime
    directory: the next wrapper that starts detaches it and removes the directory."""
    lower = tmp_path / "tmp"
    lower.mkdir()
    runtime = overlay_dir / "runtime"
    dead = runtime / "0123456789abcdef"
    dead.mkdir(parents=True)
    # A wrapper.pid naming a process that is gone: no live wrapper holds the directory.
    gone = subprocess.Popen(["true"])
    gone.wait()
    (dead / "wrapper.pid").write_text(f"{gone.pid} 3\n")
    view = PrivateTemp.create(str(lower), dead)
    view.detach()  # as after a restore: only the layers' tmpfs stays mounted here
    assert mounted_below(dead) == [str(view.base / "layers")]
    assert remove_stale_runtime_dirs(runtime) == [dead]
    assert not dead.exists()
    assert mounted_below(runtime) == []


def test_empty_lock_files_gone_from_the_temporary_directory_are_made_again(
    tmp_path: Path,
) -> None:
    """A Dask worker's lock file (empty, held open) that a restore does not find in the
    kernel's temporary directory is no reason to refuse: it is made again with its mode,
    and the worker's directory beside it. Any other missing file still is."""
    temp = tmp_path / "tmp"
    lock = temp / "dask-scratch-space" / "worker-abc.dirlock"
    data = temp / "data.csv"
    entries: list[dict[str, object]] = [
        {"path": str(lock), "kind": "open", "size": 0, "mode": 0o644},
        {"path": str(data), "kind": "open", "size": 10, "mode": 0o600},
        {"path": str(tmp_path / "elsewhere.lock"), "kind": "open", "size": 0, "mode": 0o644},
    ]
    assert missing_files(entries, made_in=str(temp)) == [
        f"{data} (open) does not exist",
        f"{tmp_path / 'elsewhere.lock'} (open) does not exist",
    ]
    made = make_missing_empty_files(entries, str(temp))
    assert made == [temp, lock.parent, lock, temp / "dask-scratch-space" / "worker-abc"]
    assert lock.stat().st_size == 0
    assert stat.S_IMODE(lock.stat().st_mode) == 0o644
    assert (temp / "dask-scratch-space" / "worker-abc").is_dir()
    assert not data.exists()
    assert make_missing_empty_files(entries, str(temp)) == []  # there now
