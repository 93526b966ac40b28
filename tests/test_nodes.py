"""Restore on another node: two servers, each in its own network and PID namespace (a pod:
process ids from 1, its own /proc), sharing only an S3 server (moto, real HTTP; the
node-loss round trip also on the juicefs gateway) and the notebooks' directory (a user's
home moving with them).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jupyter_ext.core.isolation.pidspace import PID_FLOOR
from jupyter_ext.core.protocol.environment import ENV_KEY
from testkit.processes import RUN_KEY, ServerProcess

from .support.s3server import JUICEFS_KEY
from .support.servers import BUCKET, NODE_USER, S3_ENV, Network, follow, node_server, ws_execute

pytestmark = [
    pytest.mark.usefixtures("criu"),
    pytest.mark.needs_root("network namespaces as nodes; JKS_NODE_USER runs the nodes as a user"),
]


@pytest.mark.parametrize("server", ["moto", "juicefs"])
def test_restore_on_another_node_after_node_loss(
    network: Network, server: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    notebooks = tmp_path / "home" / "notebooks"
    (notebooks / "work").mkdir(parents=True)
    s3_url: str = request.getfixturevalue("s3_url" if server == "moto" else "juicefs_url")
    env = S3_ENV if server == "moto" else {**S3_ENV, "AWS_SECRET_ACCESS_KEY": JUICEFS_KEY[1]}
    owner = "alice"

    def node(name: str, user: str) -> ServerProcess:
        return node_server(network, tmp_path / name, notebooks, s3_url, user, env)

    node_a = node("node-a", owner)
    session = node_a.api(
        "POST",
        "api/sessions",
        {"path": "work/n.ipynb", "type": "notebook", "kernel": {"name": "python3-snapshot"}},
    )
    kernel_a = session["kernel"]["id"]
    ws_execute(
        node_a,
        kernel_a,
        "import numpy as np, socket\n"
        "a = np.arange(10**6)\n"
        "secret = 'from node a: ' + socket.gethostname()\n"
        "def later(x):\n    return x * 2",
    )
    job = node_a.client.call("POST", "", body={"kernel_id": kernel_a})["job"]
    snapshot = follow(node_a, job)["result"]
    assert snapshot["status"] == "complete"
    assert snapshot["notebook_path"] == "work/n.ipynb"

    node_a.kill_node()  # the node is lost: server and kernel, kill -9
    for leftover in ("data", "runtime", "kernels"):
        shutil.rmtree(tmp_path / "node-a" / leftover, ignore_errors=True)

    node_b = node("node-b", owner)
    listed = node_b.client.call("GET", "", path="work/n.ipynb")["snapshots"]
    assert [s["id"] for s in listed] == [snapshot["id"]]
    assert listed[0]["status"] == "complete"

    answer = node_b.client.call("POST", f"{snapshot['id']}/restore", body={})
    result = follow(node_b, answer["job"])["result"]
    kernel_b = result["kernel_id"]
    assert result["session"]["path"] == "work/n.ipynb"
    sessions = node_b.api("GET", "api/sessions")
    assert [s["kernel"]["id"] for s in sessions if s["path"] == "work/n.ipynb"] == [kernel_b]
    out = ws_execute(node_b, kernel_b, "print(secret, a.sum(), later(21))")
    assert out.split() == ["from", "node", "a:", os.uname().nodename, "499999500000", "42"]
    # With JKS_NODE_USER the kernel was dumped and restored by that user, not root.
    uid = ws_execute(node_b, kernel_b, "import os; print(os.getuid())").strip()
    assert int(uid) == (pwd.getpwnam(NODE_USER).pw_uid if NODE_USER else 0)
    # Nodes are pods (fresh PID namespaces): without root the kernel kept the process id it
    # had, one its first pod took past the ids every pod's own start takes.
    pid = int(ws_execute(node_b, kernel_b, "print(os.getpid())").strip())
    assert pid >= PID_FLOOR if NODE_USER else pid < PID_FLOOR

    # Another user's server on the same bucket sees none of it.
    node_c = node("node-c", "bob")
    assert node_c.client.call("GET", "")["snapshots"] == []
    node_c.stop()
    node_b.stop()


def test_an_incremental_snapshot_restores_on_another_node(
    network: Network, s3_url: str, tmp_path: Path
) -> None:
    """A kernel's second snapshot copies only what changed (its chain's lower levels are
    the first snapshot's, stored by the same chunks); node A is lost with every local
    copy; node B restores the second from S3, lazily, to exactly its state."""
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    node_a = node_server(network, tmp_path / "node-a", notebooks, s3_url, "erin")
    kernel_a = node_a.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
    ws_execute(
        node_a,
        kernel_a,
        "import numpy as np, hashlib\na = np.random.default_rng(4).random(24 << 20)",
    )
    first = follow(node_a, node_a.client.call("POST", "", body={"kernel_id": kernel_a})["job"])
    ws_execute(node_a, kernel_a, "a[:1 << 19] = 0.5\nb = 'after the first'")
    second = follow(node_a, node_a.client.call("POST", "", body={"kernel_id": kernel_a})["job"])
    result = second["result"]
    assert result["memory"]["mode"] == "incremental", result["memory"]["reason"]
    assert result["memory"]["parent"] == first["result"]["id"]
    assert result["new_bytes"] < first["result"]["new_bytes"] // 4
    expected = ws_execute(node_a, kernel_a, "print(hashlib.sha256(a.tobytes()).hexdigest(), b)")
    node_a.kill_node()
    shutil.rmtree(tmp_path / "node-a", ignore_errors=True)

    node_b = node_server(network, tmp_path / "node-b", notebooks, s3_url, "erin")
    answer = node_b.client.call("POST", f"{result['id']}/restore", body={})
    kernel_b = follow(node_b, answer["job"])["result"]["kernel_id"]
    code = "print(hashlib.sha256(a.tobytes()).hexdigest(), b)"
    assert ws_execute(node_b, kernel_b, code) == expected
    node_b.stop()


def test_cli_lists_a_store_directly(network: Network, s3_url: str, tmp_path: Path) -> None:
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    node = node_server(network, tmp_path / "node", notebooks, s3_url, "carol")
    kernel = node.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
    ws_execute(node, kernel, "x = 1")
    snapshot = follow(node, node.client.call("POST", "", body={"kernel_id": kernel})["job"])
    snapshot_id = snapshot["result"]["id"]

    def cli(*args: str, s3: bool = False) -> str:
        store = [
            f"--s3-bucket={BUCKET}",
            f"--s3-endpoint-url={s3_url}",
            "--s3-prefix=kernel-snapshots/users/carol",
            "--key-source=env",  # the servers' key (a spawner's), to read the store directly
        ]
        return subprocess.run(
            [sys.executable, "-m", "jupyter_ext.cli", *args, *(store if s3 else [])],
            capture_output=True,
            text=True,
            env={**os.environ, **S3_ENV, ENV_KEY: RUN_KEY},
            check=True,
        ).stdout

    server = [f"--url=http://{node.address}:{node.port}/", f"--token={node.token}"]
    through_server = cli("list", *server)
    assert snapshot_id in through_server
    assert "manual" in through_server
    direct = cli("list", s3=True)
    assert snapshot_id in direct
    assert "MiB" in direct
    removed = cli("rm", snapshot_id, s3=True)
    assert f"Deleted {snapshot_id}" in removed
    assert node.client.call("GET", "")["snapshots"] == []
    kernels = cli("kernels", *server)
    assert kernel in kernels
    assert "running" in kernels
    node.stop()


PARALLEL = r"""
import multiprocessing as mp, concurrent.futures as cf
spawn_pool = mp.get_context("spawn").Pool(2)
fs_pool = cf.ProcessPoolExecutor(2, mp_context=mp.get_context("forkserver"))
lock = mp.get_context("spawn").Lock()
lock.acquire()
from joblib import Parallel, delayed
def squares():
    return Parallel(n_jobs=2)(delayed(pow)(i, 2) for i in range(8))
loky_before = squares()
umanager = mp.get_context("spawn").Manager()  # on a unix socket in /tmp/pymp-*
ushared = umanager.dict()
ushared["u"] = 1
def run():
    ushared["n"] = ushared.get("n", 0) + 1
    return (spawn_pool.map(abs, range(-9, 0)), list(fs_pool.map(pow, range(9), range(9))),
            dict(ushared))
before = run()
"""
#: With root: the Dask cluster after the pools, in a kernel that has made many processes
#: (its workers' ids, in the kernel's PID namespace, are ids the node's own processes
#: hold or not: psutil finds them in the kernel's own /proc either way, core/isolation/mountns.py).
CLUSTER = r"""
from dask.distributed import Client, LocalCluster
cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                       dashboard_address=None, host="127.0.0.1")
client = Client(cluster)
worker_dirs = list(client.run(lambda dask_worker: dask_worker.local_directory).values())
print(" ".join(worker_dirs))
"""
PARALLEL_TCP = r"""
from multiprocessing.managers import SyncManager
manager = SyncManager(address=("127.0.0.1", 0), ctx=mp.get_context("spawn"))
manager.start()
shared = manager.dict()
shared["a"] = 1
def run_tcp():
    return dict(shared), sum(client.gather(client.map(lambda x: x * x, range(20))))
before_tcp = run_tcp()
"""


def test_parallel_kernel_restored_on_another_node(
    network: Network, s3_url: str, tmp_path: Path
) -> None:
    """Spawn and forkserver pools, a lock held, joblib's loky workers, (with root) a manager
    and a Dask cluster, in pods:
    snapshotted on node A, the node lost and its /dev/shm files, its managers' socket
    directories and its Dask workers' directories (with their lock files) gone, restored
    on node B
    from S3 and used again with the same objects, with the same results."""
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    nodes: list[ServerProcess] = []
    try:
        node_a = node_server(network, tmp_path / "node-a", notebooks, s3_url, "dora")
        nodes.append(node_a)
        kernel_a = node_a.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
        code = PARALLEL if NODE_USER else PARALLEL + CLUSTER + PARALLEL_TCP
        worker_dirs = ws_execute(node_a, kernel_a, code, timeout=300).split()
        assert len(worker_dirs) == (0 if NODE_USER else 2), worker_dirs
        job = node_a.client.call("POST", "", body={"kernel_id": kernel_a})["job"]
        snapshot = follow(node_a, job)["result"]
        names = [name for f in snapshot["shm_files"] for name in f["names"]]
        assert names, "the semaphores travel in the snapshot"
        assert snapshot["tcp_kept"] is (NODE_USER is None)
        node_a.kill_node()
        for name in names:  # another machine has none of node A's files
            Path("/dev/shm", name).unlink(missing_ok=True)
        for directory in snapshot["unix_socket_dirs"]:
            shutil.rmtree(directory)
        for directory in worker_dirs:  # nor the Dask workers' directories and lock files
            shutil.rmtree(directory)
            Path(directory + ".dirlock").unlink()

        node_b = node_server(network, tmp_path / "node-b", notebooks, s3_url, "dora")
        nodes.append(node_b)
        answer = node_b.client.call("POST", f"{snapshot['id']}/restore", body={})
        kernel_b = follow(node_b, answer["job"])["result"]["kernel_id"]
        check = "print(run()[:2] == before[:2], not lock.acquire(False), run()[2])"
        check += "\nprint(squares() == loky_before)"
        if NODE_USER is None:
            check += "\nprint(run_tcp() == before_tcp)"
        out = ws_execute(node_b, kernel_b, check, timeout=300)
        assert out.split() == ["True", "True", "{'u':", "1,", "'n':", "3}", "True"] + (
            ["True"] if NODE_USER is None else []
        )
        node_b.stop()
    finally:  # a failed check must not leave a node's server and kernels running
        for node in nodes:
            if node.process.poll() is None:
                node.kill_node()
