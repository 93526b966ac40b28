"""Copies of one snapshot side by side, with connections inside each (a multiprocessing
manager on 127.0.0.1), while the original runs: each copy whose ports
are taken here gets a network namespace of its own (core/isolation/netns.py), its connections come
back established on its own loopback, it still reaches the server's loopback through
slirp4netns (10.0.2.2), its later snapshots restore, and its helper ends with it. A Dask
cluster's copy beside its original gets a private view of the temporary directory, where
its workers lock and write their own directories (core/isolation/privatetmp.py). docs/network.md
("Copies side by side").
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from jupyter_ext.core import proctree
from jupyter_ext.core.criu import unprivileged
from jupyter_ext.core.isolation import netns
from testkit.processes import KernelProcess, wait_until

Factory = Callable[..., KernelProcess]

pytestmark = [
    pytest.mark.skipif(unprivileged(), reason="without root a kernel keeps no connections"),
    pytest.mark.skipif(netns.slirp_path() is None, reason="slirp4netns is not installed"),
]

KERNEL = r"""
import json, multiprocessing as mp, socket
from multiprocessing.managers import SyncManager
manager = SyncManager(address=("127.0.0.1", 0), ctx=mp.get_context("fork"))
manager.start()
shared = manager.dict()
shared["who"] = "original"
"""

CHECK = r"""
shared["seen"] = shared["who"]
shared["who"] = WHO
print(json.dumps({"seen": shared["seen"], "who": shared["who"]}))
"""

DASK = r"""
from dask.distributed import Client, LocalCluster
cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                       dashboard_address=None, host="127.0.0.1")
client = Client(cluster)
"""

REACH_HOST = r"""
s = socket.create_connection((HOST, PORT), timeout=10)
print(s.recv(100).decode())
s.close()
"""


@pytest.fixture
def host_server() -> Iterator[int]:
    """A tiny server on the host's 127.0.0.1 that greets every connection."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(b"hello from the host")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    server.close()


def helpers(kernel: KernelProcess) -> list[int]:
    """The slirp4netns helpers of the kernel's wrapper."""
    return [
        pid
        for pid in proctree.children(kernel.process.pid)
        if Path(f"/proc/{pid}/comm").read_text().strip() == "slirp4netns"
    ]


def check(kernel: KernelProcess, who: str) -> dict[str, object]:
    out = kernel.execute(CHECK.replace("WHO", repr(who)), timeout=120)
    result: dict[str, object] = json.loads(out)
    return result


def test_copies_side_by_side_keep_their_connections(
    kernel_factory: Factory, tmp_path: Path, host_server: int
) -> None:
    kernel = kernel_factory()
    kernel.execute(KERNEL, timeout=300)
    manifest = kernel.snapshot(tmp_path / "snap")
    assert manifest["tcp_kept"]
    # Two copies beside the running original: their ports are taken, each gets its own
    # network namespace, where its connections come back established.
    first = kernel_factory(restore_from=tmp_path / "snap")
    second = kernel_factory(restore_from=tmp_path / "snap")
    assert not kernel.status()["own_network"]
    assert first.status()["own_network"]
    assert second.status()["own_network"]
    assert len(helpers(first)) == 1
    assert len(helpers(second)) == 1
    assert check(first, "first") == {"seen": "original", "who": "first"}
    assert check(second, "second") == {"seen": "original", "who": "second"}
    assert check(kernel, "original") == {"seen": "original", "who": "original"}
    assert check(first, "first")["seen"] == "first"
    # The server's own loopback, the documented way.
    reach = REACH_HOST.replace("HOST", repr(netns.HOST_ADDRESS)).replace("PORT", str(host_server))
    assert first.execute(reach).strip() == "hello from the host"
    # A later snapshot of a copy (its namespace not dumped), restored beside the others.
    later = first.snapshot(tmp_path / "later")
    assert later["tcp_kept"]
    third = kernel_factory(restore_from=tmp_path / "later")
    assert third.status()["own_network"]
    assert check(third, "third") == {"seen": "first", "who": "third"}
    assert third.execute(reach).strip() == "hello from the host"
    # The helper ends with its kernel: killed, and with its wrapper.
    (helper,) = helpers(first)
    first.kill_inner()
    assert not proctree.is_alive(helper)
    (helper,) = helpers(second)
    second.kill_all()
    wait_until(lambda: not proctree.is_alive(helper), what="the helper to end")


def test_restore_in_place_of_a_copy_and_beside_nothing(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    """A restore in place of a copy decides anew: its namespace and helper go with the
    replaced kernel; with the original gone, the snapshot goes into the server's."""
    kernel = kernel_factory()
    kernel.execute(KERNEL, timeout=300)
    kernel.snapshot(tmp_path / "snap")
    copy = kernel_factory(restore_from=tmp_path / "snap")
    (helper,) = helpers(copy)
    copy.restore(tmp_path / "snap")
    assert copy.status()["own_network"]
    assert not proctree.is_alive(helper)
    kernel.kill_all()
    copy.restore(tmp_path / "snap")
    assert not copy.status()["own_network"]
    assert helpers(copy) == []
    assert check(copy, "copy") == {"seen": "original", "who": "copy"}


WORKER_DIR = r"""
worker_dir = next(iter(client.run(lambda dask_worker: dask_worker.local_directory).values()))
"""

MARK = r"""
import os
def mark(dask_worker, who=WHO):
    with open(os.path.join(dask_worker.local_directory, "mark"), "a") as fh:
        fh.write(who + " ")
    with open(os.path.join(dask_worker.local_directory, "mark")) as fh:
        return fh.read()
print(next(iter(client.run(mark).values())), client.submit(sum, [1, 2]).result())
"""


def mark(kernel: KernelProcess, who: str) -> str:
    """The Dask worker of ``kernel`` appends ``who`` to a file in its own directory, and
    says what the file holds, and what its cluster computed."""
    return kernel.execute(MARK.replace("WHO", repr(who)), timeout=120).strip()


def test_copies_of_a_dask_kernel_side_by_side_lock_and_write_their_own_scratch(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    """Dask's workers lock their directories in the temporary directory: a copy restored
    beside the running original gets a private view of it (core/isolation/privatetmp.py). The
    copy's cluster works on its own loopback, what each worker writes in its directory
    stays its own, the copy's snapshots restore, and its view ends with it. Restored where
    the workers' lock files are gone (another node), those are made again."""
    kernel = kernel_factory()
    kernel.execute(DASK + WORKER_DIR, timeout=300)
    worker_dir = kernel.execute("print(worker_dir)").strip()
    assert worker_dir.startswith("/tmp/")
    kernel.snapshot(tmp_path / "snap")
    copy = kernel_factory(restore_from=tmp_path / "snap")
    status = copy.status()
    assert status["private_temp"] == "/tmp", status
    assert status["own_network"], status
    assert kernel.status()["private_temp"] is None
    assert mark(copy, "copy") == "copy  3"
    assert mark(kernel, "original") == "original  3"
    assert mark(copy, "copy") == "copy copy  3"
    assert Path(worker_dir, "mark").read_text() == "original "
    # The copy's own snapshot, restored beside the original again and alone.
    copy.snapshot(tmp_path / "copy-snap")
    second = kernel_factory(restore_from=tmp_path / "copy-snap")
    assert second.status()["private_temp"] == "/tmp"
    # What the copy wrote there was its own, as a node's /tmp is: its snapshot has none.
    assert mark(second, "second") == "original second  3"
    view, left = (
        next(Path(k.status()["runtime_dir"]).glob("private-tmp-*")) for k in (copy, second)
    )
    copy.kill_inner()  # the kernel ends, its wrapper removes its view
    wait_until(lambda: not view.exists(), 30, "the copy's private view removed")
    kernel.kill_all()
    second.kill_all()  # a node failure: the next wrapper to start removes what it left
    assert left.exists()
    # As on another node: the workers' lock files and directories are gone; the restore
    # makes them again (empty), the copy's cluster works.
    shutil.rmtree(worker_dir)
    Path(worker_dir + ".dirlock").unlink()
    alone = kernel_factory(restore_from=tmp_path / "copy-snap")
    assert not left.exists()
    assert alone.status()["private_temp"] is None
    assert mark(alone, "alone") == "alone  3"


def test_copy_beside_a_kernel_locking_a_file_elsewhere_is_refused_naming_it(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    """Locks outside the temporary directory get no private view: a copy beside the
    kernel holding them would wait for ever in CRIU's restore; it is refused before
    anything starts, naming the file and the process."""
    locked = Path("/var/tmp") / f"snapshot-test-{tmp_path.name}.lock"
    locked.write_text("")
    try:
        kernel = kernel_factory()
        kernel.execute(f"import fcntl; fh = open({str(locked)!r}); fcntl.flock(fh, fcntl.LOCK_EX)")
        kernel.snapshot(tmp_path / "snap")
        with pytest.raises(RuntimeError, match=f"{locked} \\(locked by process"):
            kernel_factory(restore_from=tmp_path / "snap")
        kernel.kill_all()
        restored = kernel_factory(restore_from=tmp_path / "snap")
        assert restored.status()["private_temp"] is None
        assert restored.execute("print(fh.name)").strip() == str(locked)
    finally:
        locked.unlink()


def global_address() -> str | None:
    """This machine's first global IPv4 address (Ray binds its raylet, object store and
    workers to such a one, the node's address), or None."""
    shown = subprocess.run(
        ["ip", "-j", "-4", "addr", "show", "scope", "global"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return next((a["local"] for link in json.loads(shown) for a in link["addr_info"]), None)


def test_a_copy_keeps_its_connections_on_the_servers_own_address(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    """A tree whose sockets are bound to the server's own address, not to 127.0.0.1 (Ray's
    are): the copy beside the original has that address on its namespace's loopback, and
    its connections come back there. Without it CRIU failed: "Can't bind inet socket back:
    Cannot assign requested address" (seen with Ray on CI)."""
    address = global_address()
    if address is None:
        pytest.skip("this machine has no global IPv4 address")
    kernel = kernel_factory()
    kernel.execute(KERNEL.replace('"127.0.0.1"', repr(address)), timeout=300)
    manifest = kernel.snapshot(tmp_path / "snap")
    assert {p["address"] for p in manifest["bound_ports"]} == {address}
    copy = kernel_factory(restore_from=tmp_path / "snap")
    assert copy.status()["own_network"]
    assert check(copy, "copy") == {"seen": "original", "who": "copy"}
    assert check(kernel, "original") == {"seen": "original", "who": "original"}


@pytest.mark.parametrize("shared", [False, True], ids=["taken", "shared"])
def test_a_port_taken_during_the_restore_sends_it_into_its_own_namespace(
    kernel_factory: Factory, tmp_path: Path, shared: bool
) -> None:
    """The replaced kernel's port was free when the restore checked, and another process
    took it before CRIU bound it (seen on CI: a Ray port given to another process's
    connection): the restore goes into a namespace of its own, not fails. Where that
    process listens with ``SO_REUSEPORT`` (as gRPC servers do), CRIU's bind succeeds (it
    sets ``SO_REUSEPORT`` on every socket it restores), and the two would share the port,
    each getting some of the other's connections: found after CRIU, and restored apart
    all the same."""
    from jupyter_ext.core.criu import Criu
    from jupyter_ext.core.protocol.environment import ENV_CRIU

    asked, taken = tmp_path / "take-the-port", tmp_path / "port-taken"
    criu = tmp_path / "criu"  # before its first restore, has the port taken
    criu.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = restore ] && [ ! -e {asked} ]; then\n'
        f"  touch {asked}; while [ ! -e {taken} ]; do sleep 0.05; done\n"
        "fi\n"
        f'exec {Criu.locate().path} "$@"\n'
    )
    criu.chmod(0o755)
    kernel = kernel_factory(env={ENV_CRIU: str(criu)})
    kernel.execute(KERNEL, timeout=300)
    manifest = kernel.snapshot(tmp_path / "snap")
    (port,) = {p["port"] for p in manifest["bound_ports"]}
    holder = socket.socket()

    def take() -> None:
        wait_until(asked.exists, timeout=300, what="the restore to begin")
        if shared:
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", port))
        holder.listen()
        taken.touch()

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    try:
        kernel.restore(tmp_path / "snap")
        thread.join()
        assert taken.exists()
        assert kernel.status()["own_network"]
        assert "taken during its restore" in kernel.log()
        assert check(kernel, "restored") == {"seen": "original", "who": "restored"}
    finally:
        holder.close()


def test_only_addresses_a_fresh_namespace_lacks_are_added() -> None:
    bound = ["0.0.0.0", "::", "127.0.0.1", "::1", "10.0.2.100", "fe80::1", "192.0.2.7"]
    bound += ["::ffff:192.0.2.7", "2001:db8::5", "192.0.2.7"]
    assert netns.own_addresses(bound) == ["192.0.2.7/32", "2001:db8::5/128"]


def test_doctor_says_copies_side_by_side_get_their_own_network() -> None:
    from jupyter_ext.core.doctor import check_copies_side_by_side

    check = check_copies_side_by_side()
    assert check.ok
    assert "10.0.2.2" in check.detail
    assert "private view of its temporary directory" in check.detail


def test_helper_ends_when_its_namespace_is_closed() -> None:
    network = netns.OwnNetwork.create()
    helper = network.helper.pid
    assert proctree.is_alive(helper)
    network.close()
    network.close()
    assert not proctree.is_alive(helper)


def test_a_failed_restore_leaves_no_helper(kernel_factory: Factory, tmp_path: Path) -> None:
    """CRIU fails restoring a copy into its own namespace: the helper is gone with it, and
    the kernel that was there is put back."""
    from jupyter_ext.core.criu import Criu
    from jupyter_ext.core.errors import RestoreError
    from jupyter_ext.core.protocol.environment import ENV_CRIU

    kernel = kernel_factory()
    kernel.execute(KERNEL)
    kernel.snapshot(tmp_path / "snap")
    failing = tmp_path / "criu"
    failing.write_text(
        "#!/bin/sh\n"
        f'case "$*" in restore*{tmp_path / "snap"}*) echo refused >&2; exit 1;; esac\n'
        f'exec {Criu.locate().path} "$@"\n'
    )
    failing.chmod(0o755)
    other = kernel_factory(env={ENV_CRIU: str(failing)})
    other.execute("x = 42")
    with pytest.raises(RestoreError, match="put back"):
        other.restore(tmp_path / "snap")
    assert helpers(other) == []
    assert not other.status()["own_network"]
    assert other.execute("print(x)").strip() == "42"


def test_idle_suspend_and_resume_of_a_copy(kernel_factory: Factory, tmp_path: Path) -> None:
    """A suspend ends the copy (its namespace and helper with it); the next cell resumes it
    into a fresh namespace of its own (the original still holds the ports)."""
    kernel = kernel_factory()
    kernel.execute(KERNEL)
    kernel.snapshot(tmp_path / "snap")
    copy = kernel_factory(restore_from=tmp_path / "snap")
    check(copy, "copy")
    (helper,) = helpers(copy)
    copy.control.request_sync("suspend", {"dest": str(tmp_path / "suspended")}, timeout=300)
    assert copy.status()["state"] == "suspended"
    assert not proctree.is_alive(helper)
    assert helpers(copy) == []
    assert check(copy, "resumed") == {"seen": "copy", "who": "resumed"}  # resumes it
    assert copy.status()["own_network"]
    assert len(helpers(copy)) == 1
    assert check(kernel, "original") == {"seen": "original", "who": "original"}


def test_lazy_restore_of_a_copy(kernel_factory: Factory, tmp_path: Path) -> None:
    """A copy restored with lazy pages goes into its own namespace the same way."""
    from jupyter_ext.core.criu import Criu

    if not Criu.locate().supports_lazy_pages()[0]:
        pytest.skip("lazy pages are not supported on this machine")
    kernel = kernel_factory()
    kernel.execute(KERNEL + "import numpy as np; big = np.arange(4 << 20)\n")
    kernel.snapshot(tmp_path / "snap")
    copy = kernel_factory()
    restore = {"source": str(tmp_path / "snap"), "lazy": True}
    copy.control.request_sync("restore", restore, timeout=300)
    wait_until(lambda: copy.status()["lazy_restore"].get("state") != "transferring", 120)
    assert copy.status()["lazy_restore"]["state"] == "complete"
    assert copy.status()["own_network"]
    assert check(copy, "copy") == {"seen": "original", "who": "copy"}
    assert copy.execute("print(int(big.sum()) == (4 << 20) * ((4 << 20) - 1) // 2)").strip() == (
        "True"
    )
