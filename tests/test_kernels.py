"""Kernels other than ipykernel behind the wrapper's bridge (kernel_wrapper.inkernel.bridge,
docs/kernels.md): IRkernel (Debian's R, pbdZMQ) and xeus-python (PyPI, xeus's own C++
ZeroMQ stack), unchanged, made snapshot kernels by ``install-kernelspec --wrap``.

Like the ipykernel tests: each builds state in a kernel, snapshots it, kills its process
tree as a node failure would, restores it on another node (a server in its own network
and PID namespace that shares only S3 and the notebooks' directory: tests/support/servers.py) and
lets the restored kernel use that state. An R kernel holds a data.frame, a file it reads,
a fork cluster (``mclapply``, ``makeForkCluster``) and a PSOCK cluster of 2 workers (their
TCP connections to the kernel kept: root only), and a cell printing when the snapshot is
taken, which goes on in the restored kernel.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from jupyter_ext.core.errors import SnapshotError
from jupyter_ext.core.store import LocalStore
from testkit.processes import (
    KernelProcess,
    ServerProcess,
    execute_request,
    kernel_message,
    run_keys,
    wait_until,
    ws_close,
    ws_connect,
)

from .support.jupyter_api import server_config
from .support.servers import NODE_USER, Network, follow, node_server, ws_execute

Factory = Callable[..., KernelProcess]

pytestmark = pytest.mark.usefixtures("criu")

#: The kernelspecs the packages install (Debian's r-cran-irkernel; xeus-python's wheel).
IR = ["R", "--slave", "-e", "IRkernel::main()", "--args", "{connection_file}"]
XPYTHON = ["python3.11", "-m", "xpython_launcher", "-f", "{connection_file}"]


def install_wrapped(home: Path, name: str) -> str:
    """``jupyter snapshot install-kernelspec --wrap NAME --user`` for a server whose data
    directory is ``home``/data (testkit.processes.ServerProcess): the new kernel's name."""
    subprocess.run(
        [sys.executable, "-m", "jupyter_ext.cli", "install-kernelspec", "--wrap", name, "--user"],
        env={**os.environ, "JUPYTER_DATA_DIR": str(home / "data")},
        check=True,
        capture_output=True,
    )
    return f"{name}-snapshot"


# -------------------------------------------------------------------- in one wrapper


def test_an_r_kernels_variables_are_read_without_a_trace(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    """The snapshot's record lists an R kernel's cells and its global environment's names,
    classes and sizes, read by a silent execute that no client sees, that counts no
    execution and leaves no variable; a promise is listed, never forced; variables cannot
    be taken back from it, and the record says why."""
    kernel = kernel_factory(kernel_argv=IR)
    kernel.execute(
        "df <- data.frame(a = 1:1000, b = rnorm(1000)); m <- matrix(1:20, 4)\n"
        "s <- 'text'; f <- function(x) x; delayedAssign('later', stop('forced'))"
    )
    manifest = kernel.snapshot(tmp_path / "s")
    contents = manifest["contents"]
    assert [cell["code"][:16] for cell in contents["cells"]] == ["df <- data.frame"]
    assert contents["cells"][0]["execution_count"] == 1
    found = {v["name"]: v for v in contents["variables"]}
    assert set(found) == {"df", "m", "s", "later"}  # functions are left out
    assert found["df"]["type"] == "data.frame"
    assert found["df"]["shape"] == [1000, 2]
    assert found["df"]["size"] > 12000  # 1000 integers and 1000 doubles
    assert found["m"]["shape"] == [4, 5]
    assert found["m"]["dtype"] == "integer"
    assert found["later"]["type"] == "promise"
    assert contents["variables"][0]["name"] == "df"  # largest first
    assert "not available for R kernels" in contents["take_unavailable"]
    assert not contents["partial"]
    # The read reached no client, counted no execution and left nothing behind.
    seen = []
    while kernel.client.iopub_channel.msg_ready():
        seen.append(kernel.client.get_iopub_msg(timeout=1)["msg_type"])
    assert "display_data" not in seen, seen
    assert "execute_input" not in seen, seen
    out = kernel.execute("cat(ls(), '\\n')")
    assert out.split() == ["df", "f", "later", "m", "s"]
    reply = kernel.client.execute_interactive("invisible(1)", timeout=60)
    assert reply["content"]["execution_count"] == 3


#: Kernels that cannot take the ipc transport: one listening on TCP instead, one that exits.
TCP_ONLY = """
import socket, sys, time
server = socket.create_server(("127.0.0.1", 0))
time.sleep(600)
"""
EXITS = "import sys; print('cannot use', sys.argv[1], file=sys.stderr); sys.exit(3)"


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (
            TCP_ONLY,
            "does not take the ipc transport that its connection file names: it "
            "listens on TCP port 127.0.0.1:",
        ),
        (EXITS, "The kernel exited (status 3) before it bound the ipc endpoints"),
    ],
    ids=["listens-on-tcp", "exits"],
)
def test_a_kernel_without_the_ipc_transport_says_why(
    kernel_factory: Factory, code: str, reason: str
) -> None:
    """A kernel that ignores its connection file's transport cannot be a snapshot kernel:
    every cell says why (the port it listens on), instead of the server restarting it in
    vain."""
    kernel = kernel_factory(kernel_argv=[sys.executable, "-c", code, "{connection_file}"])
    reply = kernel.client.execute_interactive("1", timeout=60)
    assert reply["content"]["status"] == "error"
    assert reason in reply["content"]["evalue"]
    assert kernel.status()["state"] == "dead"


def test_an_r_kernel_is_interrupted_and_reads_stdin(kernel_factory: Factory) -> None:
    """The server's interrupt (SIGINT to the wrapper) reaches R in its namespace; an
    input_request goes to the client and its answer back to R."""
    kernel = kernel_factory(kernel_argv=IR)
    msg_id = kernel.client.execute('cat("sleeping\\n"); Sys.sleep(60)')
    while kernel.client.get_iopub_msg(timeout=60)["msg_type"] != "stream":
        pass
    # R is in Sys.sleep now (IRkernel loses an interrupt that comes before its evaluate).
    time.sleep(0.5)
    kernel.process.send_signal(signal.SIGINT)
    reply = kernel.client.get_shell_msg(timeout=30)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert reply["content"]["status"] == "abort"
    # After an interrupt IRkernel aborts the requests already queued, up to its idle status:
    # a cell sent before that is answered "aborted" (seen on a busy machine).
    while True:
        status = kernel.client.get_iopub_msg(timeout=30)
        if (
            status["parent_header"].get("msg_id") == msg_id
            and status["msg_type"] == "status"
            and status["content"]["execution_state"] == "idle"
        ):
            break
    msg_id = kernel.client.execute("x <- readline('name? '); cat('hello', x)", allow_stdin=True)
    assert kernel.client.get_stdin_msg(timeout=30)["content"]["prompt"] == "name? "
    kernel.client.input("world")
    assert kernel.execute("cat(x)") == "world"


def test_an_r_kernel_restored_into_a_new_wrapper(kernel_factory: Factory, tmp_path: Path) -> None:
    """The tree killed, a new wrapper restores it (as a new kernel on this machine): the
    data.frame, the file read on where it was, forks made again. Also as an ordinary user
    (scripts/nonroot-tests.sh), where CRIU saves the kernel's removed endpoints with root
    as their owner (core/carried/restorable.py)."""
    kernel = kernel_factory(kernel_argv=IR)
    before = kernel.execute(R_STATE.replace("CLUSTERS", "")).split()
    kernel.snapshot(tmp_path / "s")
    kernel.kill_all()
    restored = kernel_factory(restore_from=tmp_path / "s", kernel_argv=IR)
    after = restored.execute(R_CHECK.replace("CLUSTERS", "")).split()
    assert after == [before[0], "line", "3", "-1", "-2", "-3"]


def test_a_snapshot_of_another_kind_of_kernel_does_not_take_a_kernels_place(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    """An R snapshot restored in place of a running Python kernel is refused before the
    kernel is touched (the notebook would change language): it says how to restore it."""
    r = kernel_factory(kernel_argv=IR)
    r.execute("x <- 1")
    r.snapshot(tmp_path / "r")
    python = kernel_factory()
    python.execute("y = 2")
    with pytest.raises(
        SnapshotError,
        match=r"of a R \(IRkernel\) kernel and this kernel runs "
        r"python \(ipython\)",
    ) as refused:
        python.restore(tmp_path / "r")
    assert "Restore it into a new kernel" in (refused.value.hint or "")
    assert python.execute("print(y)").strip() == "2"


# -------------------------------------------------------------------- on another node

#: R: a data.frame, a file read line by line, fork workers (mclapply), and with root a
#: fork cluster and a PSOCK cluster of 2 workers, whose TCP connections to the kernel come
#: back established (without root they come back closed: docs/kernels.md).
R_STATE = """
library(parallel)
df <- data.frame(n = 1:100000, sq = (1:100000)^2)
writeLines(sprintf("line %d", 1:100), "lines.txt")
con <- file("lines.txt", "r")
first <- readLines(con, n = 2)
forked <- unlist(mclapply(1:4, function(i) i * i, mc.cores = 2))
CLUSTERS
cat(sum(df$sq), first, forked, "\\n")
"""
R_CLUSTERS = """
fork_cluster <- makeForkCluster(2)
psock <- makePSOCKcluster(2)
psock_pids <- unlist(clusterCall(psock, Sys.getpid))
"""
R_CHECK = """
cat(sum(df$sq), readLines(con, n = 1), unlist(mclapply(1:3, function(i) -i, mc.cores = 2)),
    "\\n")
CLUSTERS
"""
R_CLUSTERS_CHECK = """
cat(unlist(parLapply(fork_cluster, 1:2, function(i) i + 100)),
    identical(unlist(clusterCall(psock, Sys.getpid)), psock_pids), "\\n")
"""
#: Prints a step every 0.1 s: it runs when the snapshot is taken and goes on after. (With
#: message(): IRkernel sends what cat() prints once the whole top-level expression ends.)
R_LOOP = 'for (i in 0:59) { message("step ", i); Sys.sleep(0.1) }'


async def start_loop(server: ServerProcess, kernel_id: str, code: str) -> str:
    """Run ``code`` through a websocket; return its msg_id once "step 3" was printed."""
    ws = await ws_connect(server, kernel_id)
    msg_id, message = execute_request(code, "cell-loop")
    ws.write_message(message)
    while True:
        data = json.loads(await asyncio.wait_for(ws.read_message(), 60))
        if (
            data["parent_header"].get("msg_id") == msg_id
            and data["msg_type"] == "stream"
            and "step 3" in data["content"]["text"]
        ):
            await ws_close(ws)
            return msg_id


async def follow_resumed(server: ServerProcess, kernel_id: str, msg_id: str) -> dict[str, Any]:
    """The steps and the reply a new client of the restored kernel gets of the cell that
    ran at the snapshot. Like JupyterLab it asks for kernel_info first (the reply of a
    resumed cell goes to the shell clients that asked something since the restore)."""
    ws = await ws_connect(server, kernel_id)
    ws.write_message(kernel_message("kernel_info_request", {})[1])
    steps: list[int] = []
    reply: dict[str, Any] | None = None
    while reply is None:
        data = json.loads(await asyncio.wait_for(ws.read_message(), 60))
        if data["parent_header"].get("msg_id") != msg_id:
            continue
        if data["msg_type"] == "stream":
            steps += [int(w) for w in data["content"]["text"].split() if w.isdigit()]
        elif data["msg_type"] == "execute_reply":
            reply = data["content"]
    await ws_close(ws)
    return {"steps": steps, "reply": reply}


def lose_node_and_restore(
    network: Network,
    s3_url: str,
    tmp_path: Path,
    wrapped: str,
    setup: str,
    loop: str | None,
) -> tuple[ServerProcess, str, dict[str, Any], dict[str, Any] | None]:
    """A kernel of the kernelspec ``wrapped`` on node A runs ``setup``
    (and ``loop``, snapshotted mid-run); node A is lost; node B (the next one) restores the
    snapshot from S3. Returns node B, the restored kernel, the snapshot and what a client
    saw of the loop."""
    notebooks = tmp_path / "notebooks"
    (notebooks / "work").mkdir(parents=True)
    homes = [tmp_path / "node-a", tmp_path / "node-b"]
    name = ""
    for home in homes:
        home.mkdir()
        name = install_wrapped(home, wrapped)
    node_a = node_server(network, homes[0], notebooks, s3_url, "rita")
    node_b: ServerProcess | None = None
    try:
        session = node_a.api(
            "POST",
            "api/sessions",
            {"path": "work/n.ipynb", "type": "notebook", "kernel": {"name": name}},
        )
        kernel_a = session["kernel"]["id"]
        before = ws_execute(node_a, kernel_a, setup, timeout=300)
        msg_id = asyncio.run(start_loop(node_a, kernel_a, loop)) if loop else None
        job = node_a.client.call("POST", "", body={"kernel_id": kernel_a})["job"]
        snapshot = follow(node_a, job)["result"]
        snapshot["printed_before"] = before
        node_a.kill_node()  # the node is lost: server and every kernel process, kill -9

        node_b = node_server(network, homes[1], notebooks, s3_url, "rita")
        answer = node_b.client.call("POST", f"{snapshot['id']}/restore", body={})
        result = follow(node_b, answer["job"])["result"]
        assert result["session"]["path"] == "work/n.ipynb"
        kernel_b = result["kernel_id"]
        seen = asyncio.run(follow_resumed(node_b, kernel_b, msg_id)) if msg_id else None
        return node_b, kernel_b, snapshot, seen
    except BaseException:
        for node in (node_a, node_b):
            if node is not None and node.process.poll() is None:
                node.kill_node()
        raise


@pytest.mark.needs_root("network namespaces as nodes")
def test_an_r_kernel_on_another_node_after_node_loss(
    network: Network, s3_url: str, tmp_path: Path
) -> None:
    clusters = NODE_USER is None  # their TCP connections come back with root only
    setup = R_STATE.replace("CLUSTERS", R_CLUSTERS if clusters else "")
    node_b, kernel, snapshot, seen = lose_node_and_restore(
        network, s3_url, tmp_path, "ir", setup, R_LOOP
    )
    try:
        printed = snapshot["printed_before"].split()
        assert printed[1:] == ["line", "1", "line", "2", "1", "4", "9", "16"]
        # The loop went on in the restored kernel, its output and reply to a new client.
        assert seen is not None
        assert seen["reply"]["status"] == "ok"
        assert seen["steps"]
        assert seen["steps"][-1] == 59
        assert sorted(set(seen["steps"])) == list(range(min(seen["steps"]), 60))
        check = R_CHECK.replace("CLUSTERS", R_CLUSTERS_CHECK if clusters else "")
        out = ws_execute(node_b, kernel, check, timeout=120).split()
        assert out[:6] == [printed[0], "line", "3", "-1", "-2", "-3"]
        assert out[6:] == (["101", "102", "TRUE"] if clusters else [])
        assert snapshot["tcp_kept"] is clusters
        # Taken while the loop ran: R, busy, was not asked for its variables; the record
        # says so and lists the running cell.
        contents = node_b.client.call("GET", snapshot["id"])["contents"]
        assert "a cell was running" in contents["partial_reason"]
        assert [c.get("running", False) for c in contents["cells"]] == [False, True]
        assert contents["cells"][1]["code"] == R_LOOP
    finally:
        node_b.stop()


@pytest.mark.needs_root("network namespaces as nodes")
def test_a_xeus_python_kernel_on_another_node_after_node_loss(
    network: Network, s3_url: str, tmp_path: Path
) -> None:
    """xeus-python (its C++ loop aborts on EINTR: the restored images restart the wait a
    dump interrupted, core/carried/waits.py) with a NumPy array."""
    setup = "import numpy as np\na = np.arange(10**6)\nprint(a.sum())"
    node_b, kernel, snapshot, _ = lose_node_and_restore(
        network, s3_url, tmp_path, "xpython", setup, None
    )
    try:
        assert snapshot["printed_before"].strip() == "499999500000"
        assert ws_execute(node_b, kernel, "print(int(a.sum()) * 2, a.dtype)").split() == [
            "999999000000",
            "int64",
        ]
        contents = node_b.client.call("GET", snapshot["id"])["contents"]
        assert "not recorded for xeus-python kernels" in contents["variables_unavailable"]
    finally:
        node_b.stop()


# -------------------------------------------------------------------- through one server


def test_an_r_notebook_through_the_server(tmp_path: Path) -> None:
    """What needs no Python in the kernel works for R as for ipykernel, through the REST
    API, the CLI and a websocket, on an encrypted store: a snapshot, a suspend and the
    resume that the next cell brings, a restore in place and into a new kernel; taking
    variables back is refused with the reason."""
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    home = tmp_path / "home"
    home.mkdir()
    name = install_wrapped(home, "ir")
    server = ServerProcess(home, notebooks, server_config(tmp_path))
    try:
        session = server.api(
            "POST",
            "api/sessions",
            {"path": "r.ipynb", "type": "notebook", "kernel": {"name": name}},
        )
        kernel = session["kernel"]["id"]
        ws_execute(server, kernel, "x <- 41; secret <- 'plain-to-find'")
        job = server.client.call("POST", "", body={"kernel_id": kernel})["job"]
        snapshot = follow(server, job)
        snapshot_id = snapshot["result"]["id"]
        # Suspended, then back for the next cell.
        follow(server, server.client.call("POST", f"kernels/{kernel}/suspend")["job"])
        assert server.client.call("GET", f"kernels/{kernel}")["state"] == "suspended"
        assert ws_execute(server, kernel, "cat(x + 1)") == "42"
        # In place: the kernel is the snapshot's again.
        ws_execute(server, kernel, "x <- 0")
        body = {"kernel_id": kernel}
        follow(server, server.client.call("POST", f"{snapshot_id}/restore", body=body)["job"])
        assert ws_execute(server, kernel, "cat(x)") == "41"
        # Into a new kernel, attached to the notebook.
        job = server.client.call("POST", f"{snapshot_id}/restore", body={})["job"]
        new = follow(server, job)["result"]["kernel_id"]
        assert new != kernel
        assert ws_execute(server, new, "cat(x, secret)") == "41 plain-to-find"
        # What it holds, on the command line; no variable can be taken back.
        shown = subprocess.run(
            [
                sys.executable,
                "-m",
                "jupyter_ext.cli",
                "show",
                snapshot_id,
                f"--url={server.url}",
                f"--token={server.token}",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "x <- 41" in shown
        assert "secret" in shown
        assert "character" in shown
        with pytest.raises(SnapshotError, match="not available for R kernels"):
            server.client.call(
                "POST", f"{snapshot_id}/variables", body={"kernel_id": new, "names": ["x"]}
            )
        # The store holds the kernel's memory sealed: not a byte of it in the clear.
        for path in (tmp_path / "store").rglob("*"):
            if path.is_file():
                assert b"plain-to-find" not in path.read_bytes(), path
    finally:
        server.stop()


def test_an_r_kernel_is_snapshotted_by_the_servers_policies(tmp_path: Path) -> None:
    """The server's policies know nothing of a kernel's language: a cell of an R kernel
    that ran long is snapshotted (long_cell_seconds), jupyter_server's culler suspends the
    idle kernel and its next cell brings it back with its state, and a stopping server
    snapshots it (snapshot_before_shutdown)."""
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    home = tmp_path / "home"
    home.mkdir()
    name = install_wrapped(home, "ir")
    config = server_config(
        tmp_path, long_cell_seconds=1, long_cell_min_interval=0, snapshot_before_shutdown=True
    )
    config["MappingKernelManager"] = {
        "cull_idle_timeout": 6,
        "cull_interval": 1,
        "cull_connected": True,
    }
    server = ServerProcess(home, notebooks, config)
    try:
        session = server.api(
            "POST",
            "api/sessions",
            {"path": "r.ipynb", "type": "notebook", "kernel": {"name": name}},
        )
        kernel = session["kernel"]["id"]
        ws_execute(server, kernel, "x <- 41; Sys.sleep(1.5)")

        def triggers() -> list[str]:
            listed = server.client.call("GET", "", path="r.ipynb")["snapshots"]
            return sorted(s["trigger"] for s in listed if s["status"] == "complete")

        wait_until(lambda: "long-cell" in triggers(), timeout=120, what="long-cell snapshot")

        def suspended() -> bool:
            # ... and its upload done, so the resume below runs from the stored suspend.
            status = server.client.call("GET", f"kernels/{kernel}")
            return bool(status["state"] == "suspended" and status["job"] is None)

        wait_until(suspended, timeout=120, what="the culler's suspend")
        assert ws_execute(server, kernel, "cat(x + 1)") == "42"
    finally:
        assert server.stop(signal.SIGTERM) == 0
    stored = LocalStore(tmp_path / "store" / "users" / getpass.getuser(), keys=run_keys())
    assert {s.manifest.trigger for s in stored.snapshots()} >= {
        "long-cell",
        "cull",
        "before-shutdown",
    }
