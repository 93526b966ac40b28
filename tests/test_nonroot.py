"""Non-root mode (docs/nonroot.md): what an ordinary user can and cannot do with the
product's CRIU copy, and that what cannot work says so.

These tests need an ordinary user: CI runs them, with the kernel, server, other-node and
JupyterHub tests, as one (scripts/nonroot-tests.sh). As root they are skipped.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from jupyter_ext.core import proctree
from jupyter_ext.core.criu import UNPRIVILEGED_CAPS, Criu, unprivileged
from jupyter_ext.core.doctor import check_criu_capabilities, file_capabilities, run_checks
from jupyter_ext.core.errors import DumpError
from testkit.processes import KernelProcess, wait_until

pytestmark = pytest.mark.skipif(
    os.geteuid() == 0, reason="needs an ordinary user: run scripts/nonroot-tests.sh as root"
)

Factory = Callable[..., KernelProcess]


def test_doctor_passes_for_a_user_with_the_capable_criu() -> None:
    checks = {check.name: check for check in run_checks()}
    failed = [check for check in checks.values() if check.required and not check.ok]
    assert not failed, failed
    assert "non-root mode" in checks["privileges"].detail
    # What non-root mode cannot do is named, with the way to get it.
    assert not checks["pid namespaces"].ok
    assert "side by side" in checks["pid namespaces"].detail
    assert "root" in checks["pid namespaces"].fix


def test_criu_without_capabilities_is_named_with_the_grant(criu: Criu, tmp_path: Path) -> None:
    """A CRIU copy without the file capabilities (a copy loses them): doctor names the
    missing capabilities and how to grant them, and a dump says so too."""
    bare = tmp_path / "criu"
    shutil.copy(criu.path, bare)
    assert file_capabilities(bare) == (0, False)
    check = check_criu_capabilities(Criu(bare, criu.version, "test"))
    assert not check.ok
    assert "cap_checkpoint_restore" in check.detail
    assert "cap_setpcap" in check.detail
    assert "setcap" in check.fix
    assert "install-criu.sh" in check.fix

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(DumpError) as caught:
            asyncio.run(
                Criu(bare, criu.version, "test").dump(
                    victim.pid, tmp_path / "img", tmp_path, leave_running=True
                )
            )
        assert "without the privileges it needs" in caught.value.message
        assert UNPRIVILEGED_CAPS in caught.value.hint
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_capable_criu_cannot_reach_another_users_process(criu: Criu, tmp_path: Path) -> None:
    """The capabilities reach only the user's own processes: a dump of a root process
    (PID 1 here, or any other user's) fails before it stops or reads it."""
    others = [
        pid
        for pid in (int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
        if _uid(pid) not in (None, os.getuid())
    ]
    assert others, "no process of another user to try"
    target = others[0]
    images = tmp_path / "img"
    images.mkdir()
    argv = [str(criu.path), "dump", "--unprivileged", "-t", str(target), "-D", str(images)]
    result = subprocess.run(
        [*argv, "-o", "dump.log", "-v4", "--leave-running"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    log = (images / "dump.log").read_text(errors="replace")
    assert "Operation not permitted" in log or "Permission denied" in log, log[-2000:]
    assert "Seized task" not in log, "the capable CRIU stopped another user's process"
    assert not list(images.glob("pages-*.img"))


def _uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def test_kernel_runs_without_namespaces_and_restores_in_place(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    """As a user the kernel has no PID namespace: same PID after a kill and restore."""
    assert unprivileged()
    kernel = kernel_factory()
    inner = kernel.status()["inner_pid"]
    assert os.readlink(f"/proc/{inner}/ns/pid") == os.readlink("/proc/self/ns/pid")
    assert os.stat(f"/proc/{inner}").st_uid == os.getuid()
    kernel.execute("import os, subprocess; v = 41; child = subprocess.Popen(['cat'], stdin=-1)")
    kernel.snapshot(tmp_path / "s")
    kernel.kill_all()
    restored = kernel_factory(restore_from=tmp_path / "s")
    assert restored.status()["inner_pid"] == inner
    assert restored.execute("v += 1; print(v, os.getpid(), child.poll())").split() == [
        "42",
        str(inner),
        "None",
    ]
    # Its children are the user's too, and end with it.
    tree = proctree.descendants(inner)
    assert len(tree) >= 2
    assert all(os.stat(f"/proc/{pid}").st_uid == os.getuid() for pid in tree)


def test_copy_beside_the_running_kernel_is_a_clear_error(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    """Without a PID namespace a second copy needs PIDs the original holds: refused with
    the reason and the way out, and the original runs on untouched."""
    original = kernel_factory()
    original.execute("v = 'original'")
    original.snapshot(tmp_path / "s")
    with pytest.raises(RuntimeError) as caught:
        kernel_factory(restore_from=tmp_path / "s")
    message = str(caught.value)
    assert "process id" in message, message
    assert "side by side" in message
    assert "run Jupyter as root" in message
    assert original.execute("print(v)").strip() == "original"


def test_a_port_shared_during_the_restore_is_refused_and_the_kernel_kept(
    kernel_factory: Factory, tmp_path: Path, criu: Criu
) -> None:
    """Another process listens with ``SO_REUSEPORT`` on the kernel's port from between the
    restore's check and CRIU (which binds with it too, so CRIU does not fail): without root
    there is no namespace of its own to go to, so the restore is refused naming that
    process. The kernel saved before it cannot come back while that process holds its
    port either: it stays suspended, and the first cell after the port is free again
    brings it back as it was."""
    from jupyter_ext.core.errors import SnapshotError
    from jupyter_ext.core.protocol.environment import ENV_CRIU

    asked, taken = tmp_path / "take-the-port", tmp_path / "port-taken"
    wrapper = tmp_path / "criu"  # before its first restore, has the port taken
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = restore ] && [ ! -e {asked} ]; then\n'
        f"  touch {asked}; while [ ! -e {taken} ]; do sleep 0.05; done\n"
        "fi\n"
        f'exec {criu.path} "$@"\n'
    )
    wrapper.chmod(0o755)
    kernel = kernel_factory(env={ENV_CRIU: str(wrapper)})
    kernel.execute("import socket; server = socket.create_server(('127.0.0.1', 0)); v = 1")
    manifest = kernel.snapshot(tmp_path / "s")
    (port,) = {p["port"] for p in manifest["bound_ports"]}
    kernel.execute("v = 2")
    holder = socket.socket()
    try:

        def take() -> None:
            wait_until(asked.exists, timeout=300, what="the restore to begin")
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            holder.bind(("127.0.0.1", port))
            holder.listen()
            taken.touch()

        thread = threading.Thread(target=take, daemon=True)
        thread.start()
        with pytest.raises(SnapshotError) as caught:
            kernel.restore(tmp_path / "s")
        thread.join()
        message = str(caught.value)
        assert "another process took here during the restore" in message, message
        assert f"process {os.getpid()}" in message
        assert "back failed too" in message
        assert kernel.status()["state"] == "suspended"
    finally:
        holder.close()
    assert kernel.execute("print(v)").strip() == "2"
