"""Whole-kernel snapshot and restore with real CRIU, ipykernel and jupyter_client.

Like CRIU's zdtm: each test builds state in a kernel, snapshots it, kills the kernel,
restores it, and lets the restored kernel check its own state.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from jupyter_ext.core import proctree
from jupyter_ext.core.chunking import ChunkParams, iter_chunks
from jupyter_ext.core.compat import check_compatible
from jupyter_ext.core.criu import Criu, frozen_seconds
from jupyter_ext.core.errors import (
    CriuNotFoundError,
    DumpError,
    IncompatibleSnapshotError,
    SnapshotBusyError,
    SnapshotCorruptError,
    SnapshotError,
)
from jupyter_ext.core.growinghash import GrowingFileChunker
from jupyter_ext.core.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    chunk_list_digest,
    manifest_checksum,
    new_snapshot_id,
    seal,
    utc_now,
    verify,
)
from testkit.processes import KernelProcess, wait_until

Factory = Callable[..., KernelProcess]

STATE_SETUP = r"""
import random, threading, time, subprocess, sys, numpy as np, hashlib, copy

big = np.random.default_rng(7).random(512 * 1024 * 1024 // 8)   # 512 MiB
big_digest = hashlib.sha256(big.tobytes()).hexdigest()

counter = [0]
def count():
    while True:
        counter[0] += 1
        time.sleep(0.01)
threading.Thread(target=count, daemon=True).start()

with open(DATA_PATH, "w") as fh:
    fh.write("".join(f"line {i}\n" for i in range(100)))
data_file = open(DATA_PATH)
first_lines = [data_file.readline() for _ in range(10)]
data_offset = data_file.tell()

child = subprocess.Popen(
    [sys.executable, "-u", "-c", "import sys\nfor l in sys.stdin: print(int(l) * 2, flush=True)"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

squares = (i * i for i in range(100))
seen_squares = [next(squares) for _ in range(5)]

rng = random.Random(1234); rng.random()
np_rng = np.random.default_rng(99); np_rng.random(3)
expected_rng = copy.deepcopy(rng).random()
expected_np = copy.deepcopy(np_rng).random(4).tolist()
time.sleep(0.2)
counter_at_snapshot = counter[0]
print("ready")
"""

STATE_CHECK = r"""
assert hashlib.sha256(big.tobytes()).hexdigest() == big_digest, "array changed"
c1 = counter[0]; time.sleep(0.3); c2 = counter[0]
assert c1 >= counter_at_snapshot and c2 > c1, ("thread stopped", counter_at_snapshot, c1, c2)
assert data_file.tell() == data_offset, "file offset lost"
assert data_file.readline() == "line 10\n", "file content after offset wrong"
child.stdin.write("21\n"); child.stdin.flush()
assert child.stdout.readline() == "42\n", "child process lost"
assert child.poll() is None
assert next(squares) == 25, "generator lost its place"
assert rng.random() == expected_rng, "random state lost"
assert np_rng.random(4).tolist() == expected_np, "numpy rng state lost"
print("state ok")
"""


def setup_state(kernel: KernelProcess, tmp_path: Path) -> None:
    code = f"DATA_PATH = {str(tmp_path / 'data.txt')!r}\n" + STATE_SETUP
    assert kernel.execute(code).strip() == "ready"


def take_pid(pid: int) -> subprocess.Popen[bytes]:
    """Start a process that gets exactly ``pid`` (via ns_last_pid)."""
    for _ in range(100):
        if Path(f"/proc/{pid}").exists():  # not yet reaped
            time.sleep(0.05)
            continue
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        proc = subprocess.Popen(["sleep", "600"])
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    raise AssertionError(f"could not take PID {pid} for the test")


def test_state_survives_kill_and_restore_into_new_wrapper(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    kernel = kernel_factory()
    setup_state(kernel, tmp_path)
    manifest = kernel.snapshot(tmp_path / "snap", metadata={"notebook_path": "work/a.ipynb"})
    assert manifest["total_bytes"] > 512 * 1024 * 1024
    assert manifest["notebook_path"] == "work/a.ipynb"
    # The kernel is frozen only for part of the dump, and requests wait a little longer.
    assert 0 < manifest["frozen_seconds"] < manifest["dump_seconds"] < manifest["pause_seconds"]
    info = kernel.client.get_connection_info()
    old_ports = [v for k, v in info.items() if k.endswith("_port")]
    old_inner = kernel.status()["inner_pid"]
    kernel.kill_all()

    # Take the old kernel's host PID (as root: the restore makes a fresh PID namespace;
    # without root it keeps its PIDs, docs/nonroot.md) and server ports with other processes.
    squatter = take_pid(old_inner) if os.geteuid() == 0 else None
    listeners = []
    for port in old_ports:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
        listeners.append(s)
    try:
        restored = kernel_factory(restore_from=tmp_path / "snap")
        assert restored.execute(STATE_CHECK).strip() == "state ok"
        assert restored.status()["lineage"] == manifest["lineage"]
    finally:
        if squatter is not None:
            squatter.kill()
            squatter.wait()
        for s in listeners:
            s.close()


def test_snapshot_keeps_kernel_running_undisturbed(kernel_factory: Factory, tmp_path: Path) -> None:
    """The kernel runs on as it was, with only the modules its cells imported: our agent
    in it loads no numpy (the wrapper's tracker needs it, 12 MB in every snapshot)."""
    kernel = kernel_factory()
    kernel.execute("import os; x = [1, 2, 3]; pid = os.getpid()")
    kernel.snapshot(tmp_path / "s1")
    # PID 1 of its own namespace as root; without root it has none (docs/nonroot.md).
    pid = 1 if os.geteuid() == 0 else kernel.status()["inner_pid"]
    assert kernel.execute("x.append(4); print(x, pid)").strip() == f"[1, 2, 3, 4] {pid}"
    assert kernel.status()["state"] == "running"
    loaded = "import sys; print(sorted({'numpy', 'xxhash'} & set(sys.modules)))"
    assert kernel.execute(loaded).strip() == "[]"


def test_busy_cell_continues_after_restore(kernel_factory: Factory, tmp_path: Path) -> None:
    kernel = kernel_factory()
    kernel.execute("import time")
    kernel.execute("1")
    msg_id = kernel.client.execute(
        "for i in range(25):\n    print(i, flush=True)\n    time.sleep(0.1)\n'done'"
    )
    seen: list[str] = []

    def collect(until: Callable[[], bool], timeout: float = 60) -> dict | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not until():
            try:
                msg = kernel.client.get_iopub_msg(timeout=0.2)
            except Exception:  # noqa: BLE001 - queue.Empty
                continue
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
                seen.extend(msg["content"]["text"].split())
        return None

    collect(lambda: len(seen) >= 5)
    kernel.snapshot(tmp_path / "busy")
    kernel.kill_inner()
    progress: list[str] = []
    kernel.restore(tmp_path / "busy", on_progress=lambda e: progress.append(e["phase"]))
    assert progress == ["verifying", "restoring", "done"]
    reply = kernel.client.get_shell_msg(timeout=60)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert reply["content"]["status"] == "ok"
    assert reply["content"]["execution_count"] == 3
    collect(lambda: "24" in seen, timeout=10)
    numbers = [int(s) for s in seen]
    # Output from before the snapshot may repeat (the kernel resumes from the snapshot),
    # but the tail must be complete and in order.
    assert numbers[-1] == 24
    tail_start = len(numbers) - 1 - numbers[::-1].index(numbers[-1] - 0)
    assert sorted(set(numbers)) == list(range(25))
    assert tail_start >= 0
    assert kernel.execute("print('after')").strip() == "after"
    assert kernel.client.execute_interactive("2", timeout=30)["content"]["execution_count"] == 5


def test_snapshot_restore_snapshot_restore(kernel_factory: Factory, tmp_path: Path) -> None:
    kernel = kernel_factory()
    kernel.execute("n = 1")
    first = kernel.snapshot(tmp_path / "a")
    kernel.kill_all()
    second_kernel = kernel_factory(restore_from=tmp_path / "a")
    second_kernel.execute("n += 1")
    second = second_kernel.snapshot(tmp_path / "b")
    assert second["parent_id"] == first["id"]
    assert second["lineage"] == first["lineage"]
    assert second["sequence"] == first["sequence"] + 1
    second_kernel.kill_all()
    third = kernel_factory(restore_from=tmp_path / "b")
    assert third.execute("print(n)").strip() == "2"


@pytest.mark.needs_root("copies of one kernel side by side need a PID namespace each")
def test_two_kernels_restored_from_one_snapshot_side_by_side(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    original = kernel_factory()
    original.execute("v = 'shared'")
    original.snapshot(tmp_path / "s")
    one = kernel_factory(restore_from=tmp_path / "s")
    two = kernel_factory(restore_from=tmp_path / "s")
    one.execute("v += '-one'")
    two.execute("v += '-two'")
    assert original.execute("print(v)").strip() == "shared"
    assert one.execute("print(v)").strip() == "shared-one"
    assert two.execute("print(v)").strip() == "shared-two"


def test_control_requests_are_checked_against_the_protocol(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    """Each operation takes the fields of its dataclass in core.protocol: an unknown
    operation, an unknown argument or a missing one is refused with the cause, and the
    kernel goes on as before."""
    kernel = kernel_factory()
    kernel.execute("kept = 7")
    with pytest.raises(SnapshotError, match="Unknown control operation 'dump'"):
        kernel.control.request_sync("dump", {}, timeout=30)
    with pytest.raises(SnapshotError, match=r"Bad control request.*colour"):
        kernel.control.request_sync("status", {"colour": "red"}, timeout=30)
    with pytest.raises(SnapshotError, match=r"Bad control request.*dest"):
        kernel.control.request_sync("snapshot", {}, timeout=30)
    with pytest.raises(SnapshotError, match=r"Bad control request.*source"):
        kernel.control.request_sync("restore", {"verified": True}, timeout=30)
    assert not (tmp_path / "snap").exists()
    assert kernel.execute("print(kept)").strip() == "7"


def test_corrupted_snapshot_is_refused_before_criu(kernel_factory: Factory, tmp_path: Path) -> None:
    kernel = kernel_factory()
    kernel.execute("import numpy as np; a = np.ones(1000)")
    kernel.snapshot(tmp_path / "s")
    pages = max((tmp_path / "s" / "images").glob("pages-*.img"), key=lambda p: p.stat().st_size)
    data = bytearray(pages.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pages.chmod(0o600)  # sealed read-only
    pages.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorruptError, match=r"chunk of images/pages-\d+\.img at byte"):
        kernel.restore(tmp_path / "s")
    # The running kernel was not touched.
    assert kernel.execute("print(a.sum())").strip() == "1000.0"


def test_memory_images_are_cut_and_hashed_as_they_are_written(tmp_path: Path) -> None:
    """The seal's entries of pages-*.img come from a chunker that read them while they
    grew (as CRIU writes them, front to back, in pieces of any size): the chunks are those
    of cutting the finished file, each with its sha256, and the file's digest is that of
    the chunk list. Another file is hashed whole by the seal."""
    images = tmp_path / "staging" / "images"
    images.mkdir(parents=True)
    params = ChunkParams.of_kib(16)
    chunker = GrowingFileChunker(images.parent, images, params)
    rng = random.Random(3)
    written: dict[str, bytes] = {}
    for name in ("pages-1.img", "pages-2.img"):
        with (images / name).open("wb") as fh:
            for _ in range(40):
                block = rng.randbytes(rng.randrange(1, 300_000))
                fh.write(block)
                fh.flush()
                written[name] = written.get(name, b"") + block
                time.sleep(0.001)
    (images / "core-1.img").write_bytes(b"not memory")
    entries = chunker.finish()
    for name, data in written.items():
        entry = entries[f"images/{name}"]
        cut = iter_chunks(io.BytesIO(data), params)
        chunks = [(hashlib.sha256(c).hexdigest(), len(c)) for c in cut]
        assert len(chunks) > 20
        assert entry.chunks == chunks
        assert entry.size == len(data)
        assert entry.sha256 == chunk_list_digest(chunks)
    manifest = seal(
        images.parent,
        Manifest(
            id=new_snapshot_id(),
            lineage="0" * 32,
            sequence=1,
            created=utc_now(),
            trigger="manual",
            runtime_dir="/run/dummy",
            runtime_dir_key="dummy",
            stdio_pipe="pipe:[1]",
            chunk_kib=16,
        ),
        tmp_path / "sealed",
        entries | {"images/core-1.img": FileEntry("images/core-1.img", 99, "0" * 64)},
    )  # (not core-1.img's size: hashed again)
    verify(tmp_path / "sealed")
    by_path = {e.path: e for e in manifest.files}
    assert set(by_path) == {"images/core-1.img", *[f"images/{n}" for n in written]}
    assert by_path["images/core-1.img"].chunks is None
    assert by_path["images/core-1.img"].sha256 == hashlib.sha256(b"not memory").hexdigest()


def test_snapshot_without_manifest_is_not_a_snapshot(tmp_path: Path) -> None:
    (tmp_path / "half" / "images").mkdir(parents=True)
    with pytest.raises(SnapshotCorruptError, match=r"no manifest\.json"):
        verify(tmp_path / "half")


def test_failed_dump_leaves_kernel_running_and_no_snapshot(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    # A UDP socket holding corked, unsent data: one thing CRIU cannot dump (TCP connections
    # it can: tests/test_network.py).
    kernel = kernel_factory()
    kernel.execute(
        "import socket; udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); k = 7\n"
        "udp.setsockopt(socket.IPPROTO_UDP, 1, 1); udp.sendto(b'x', ('127.0.0.1', 9))"
    )
    with pytest.raises(DumpError) as info:
        kernel.snapshot(tmp_path / "snaps" / "s")
    assert "UDP socket" in info.value.message
    assert info.value.log_excerpt
    assert list((tmp_path / "snaps").iterdir()) == []
    assert kernel.execute("print(k)").strip() == "7"
    kernel.execute("udp.close()")
    kernel.snapshot(tmp_path / "snaps" / "s")
    assert (tmp_path / "snaps" / "s" / MANIFEST_NAME).exists()


def test_missing_criu_is_a_clear_error(kernel_factory: Factory, tmp_path: Path) -> None:
    kernel = kernel_factory(extra_args=["--criu", "/nonexistent/criu"])
    with pytest.raises(CriuNotFoundError, match=r"install-criu\.sh"):
        kernel.snapshot(tmp_path / "s")
    assert kernel.execute("print(1)").strip() == "1"


def test_changed_open_file_refused_before_restore(kernel_factory: Factory, tmp_path: Path) -> None:
    data = tmp_path / "log.txt"
    data.write_text("one\n")
    kernel = kernel_factory()
    kernel.execute(f"fh = open({str(data)!r})")
    kernel.snapshot(tmp_path / "s")
    data.write_text("one\ntwo\n")
    kernel.kill_inner()
    with pytest.raises(IncompatibleSnapshotError, match=str(data)):
        kernel.restore(tmp_path / "s")
    data.write_text("one\n")
    kernel.restore(tmp_path / "s")
    assert kernel.execute("print(fh.read())").strip() == "one"


def test_restore_checks_the_gpu_the_snapshot_needs(kernel_factory: Factory, tmp_path: Path) -> None:
    """The compatibility check (the server's, before any download, and the wrapper's,
    before CRIU) covers the GPU: a snapshot holding memory of a GPU model this machine
    lacks is refused, naming it, and the running kernel is left alone."""
    from jupyter_ext.core.gpu import gpu_inventory

    from .support.fakecuda.nvml import FakeNvml

    kernel = kernel_factory()
    kernel.execute("x = 1")
    kernel.snapshot(tmp_path / "s")
    manifest_path = tmp_path / "s" / MANIFEST_NAME
    data = json.loads(manifest_path.read_text())
    model = ("NVIDIA Imaginary 9000", "GPU-99999999-0000-0000-0000-000000000000", 80, 0)
    data["gpu"] = {
        # An old driver: on a GPU machine too, only the model is what does not fit.
        **gpu_inventory(nvml=FakeNvml([model], driver="570.86.10", cuda=12080)),
        "used_gpus": [model[1]],
        "ns_pids": [1],
        "needed_bytes": 2**30,
    }
    data["checksum"] = manifest_checksum(data)  # as if the snapshot was taken so
    manifest_path.write_text(json.dumps(data))
    with pytest.raises(IncompatibleSnapshotError, match="NVIDIA Imaginary 9000"):
        check_compatible(Manifest.read(tmp_path / "s"))
    with pytest.raises(IncompatibleSnapshotError, match="NVIDIA Imaginary 9000"):
        kernel.restore(tmp_path / "s")
    assert kernel.execute("print(x)").strip() == "1"


def test_concurrent_snapshots_are_refused(kernel_factory: Factory, tmp_path: Path) -> None:
    import threading

    kernel = kernel_factory()
    kernel.execute("import numpy as np; a = np.random.random(64 * 1024 * 1024 // 8)")
    errors: list[Exception] = []
    results: list[dict] = []

    def take(name: str) -> None:
        try:
            results.append(kernel.snapshot(tmp_path / name))
        except SnapshotBusyError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=take, args=(f"s{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 1
    assert len(errors) == 1
    assert "already in progress" in str(errors[0])
    verify(Path(tmp_path / ("s0" if (tmp_path / "s0").exists() else "s1")))


def test_manifest_records_the_machine(kernel_factory: Factory, tmp_path: Path) -> None:
    kernel = kernel_factory()
    data = kernel.snapshot(
        tmp_path / "s", trigger="periodic", metadata={"kernel_spec": {"name": "python3-snapshot"}}
    )
    manifest = Manifest.read(tmp_path / "s")
    assert manifest.id == data["id"]
    assert manifest.trigger == "periodic"
    assert manifest.kernel_spec == {"name": "python3-snapshot"}
    assert manifest.kernel_release == os.uname().release
    assert manifest.python_version == sys.version.split()[0]
    assert manifest.criu_version.startswith("4.")
    assert manifest.cpu_flags
    assert manifest.host
    assert manifest.kernel_info["language_info"]["name"] == "python"
    assert all(len(f.sha256) == 64 for f in manifest.files)
    assert manifest.total_bytes == sum(f.size for f in manifest.files)


def test_interrupt_restart_shutdown_like_ipykernel(kernel_factory: Factory, tmp_path: Path) -> None:
    import signal

    kernel = kernel_factory()
    msg_id = kernel.client.execute("import time; time.sleep(60)")
    time.sleep(0.5)
    os.kill(kernel.process.pid, signal.SIGINT)  # jupyter_server's signal interrupt mode
    reply = kernel.client.get_shell_msg(timeout=30)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    # After an error ipykernel aborts what arrives until its loop turns once more
    # (stop_on_error); on a loaded machine the next request can come in that window.
    wait_until(
        lambda: kernel.client.execute_interactive("pass", timeout=30)["content"]["status"] == "ok",
        what="the kernel to take requests again after the interrupt",
    )
    # Interrupt through the control channel (interrupt_mode "message").
    msg_id = kernel.client.execute("import time; time.sleep(60)")
    time.sleep(0.5)
    kernel.client.control_channel.send(kernel.client.session.msg("interrupt_request", {}))
    reply = kernel.client.get_shell_msg(timeout=30)
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    inner = kernel.inner_pids()
    kernel.client.shutdown()
    assert kernel.wait_exit(inner) == 0
    wait_until(lambda: not any(os.path.exists(f"/proc/{p}") for p in inner), what="inner exit")


def test_killed_wrapper_leaves_no_orphans(kernel_factory: Factory) -> None:
    kernel = kernel_factory()
    kernel.execute("import subprocess; p = subprocess.Popen(['sleep', '600'])")
    inner = kernel.inner_pids()
    assert len(inner) >= 2
    os.kill(kernel.process.pid, 9)
    kernel.process.wait(10)
    wait_until(
        lambda: not any(os.path.exists(f"/proc/{p}") for p in inner), timeout=10, what="orphans"
    )


def test_inner_death_with_exit_policy_ends_the_wrapper(kernel_factory: Factory) -> None:
    kernel = kernel_factory(on_inner_death="exit")
    os.kill(kernel.status()["inner_pid"], 9)
    assert kernel.process.wait(15) != 0


def test_dead_kernel_answers_with_a_clear_error(kernel_factory: Factory) -> None:
    kernel = kernel_factory()
    kernel.kill_inner()
    reply = kernel.client.execute_interactive("1", timeout=30)
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KernelDied"
    info = kernel.client.kernel_info(reply=True, timeout=30)
    assert info["content"]["language_info"]["name"] == "python"


def test_frozen_seconds_reads_criu_log(tmp_path: Path) -> None:
    log = tmp_path / "dump.log"
    log.write_text(
        "(00.001000) Version: 4.2\n"
        "(00.040000) Seized task 10, state 1\n"
        "(00.041000) Seized task 11, state 1\n"
        "(00.190500) Unfreezing tasks into 1\n"
        "(00.191000) Dumping finished successfully\n"
    )
    assert frozen_seconds(log) == pytest.approx(0.1505)
    log.write_text("(00.040000) Seized task 10, state 1\n(00.050000) Error (criu/cr-dump.c)\n")
    assert frozen_seconds(log) == 0.0
    assert frozen_seconds(tmp_path / "missing.log") == 0.0


def test_resume_is_activity_and_the_waking_cell_counts(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    """A kernel suspended for idleness must not look idle again the moment it is back (it
    was suspended again before the cell that woke it ran), and that cell counts as run
    since the last snapshot (periodic snapshots take kernels that ran something)."""
    kernel = kernel_factory()
    kernel.execute("x = 5")
    kernel.control.request_sync("suspend", {"dest": str(tmp_path / "first")}, timeout=120)
    suspended = kernel.status()
    assert suspended["state"] == "suspended"
    kernel.control.request_sync("resume", timeout=120)
    resumed = kernel.status()
    assert resumed["state"] == "running"
    assert resumed["last_activity"] > suspended["last_activity"]

    kernel.control.request_sync("suspend", {"dest": str(tmp_path / "second")}, timeout=120)
    assert kernel.execute("print(x)").strip() == "5"  # held, then run after the resume
    assert kernel.status()["executions_since_snapshot"] == 1


def test_simultaneous_snapshots_of_kernels_sharing_a_directory(
    kernel_factory: Factory, tmp_path: Path
) -> None:
    """Kernels of one notebook folder dumped at the same moment all succeed: CRIU's
    parasite makes ``proc.crtools`` in each task's working directory, and dumps sharing
    one used to collide there ("Can't create a directory (-17)")."""
    import threading

    kernels = [kernel_factory() for _ in range(3)]
    cwds = {os.readlink(f"/proc/{k.status()['inner_pid']}/cwd") for k in kernels}
    assert len(cwds) == 1, cwds  # the point of the test: one shared directory
    cwd = Path(next(iter(cwds)))
    (cwd / "proc.crtools").mkdir()  # as a dump killed at the wrong moment leaves it
    for i, kernel in enumerate(kernels):
        kernel.execute(f"import numpy as np; a = np.full(8 * 1024 * 1024 // 8, {i}.0)")
    failures: list[str] = []

    def take(barrier: threading.Barrier, round_: int, index: int, kernel: KernelProcess) -> None:
        barrier.wait()
        try:
            kernel.snapshot(tmp_path / f"r{round_}-k{index}")
        except SnapshotError as exc:
            failures.append(f"round {round_}, kernel {index}: {exc}")

    for round_ in range(4):
        barrier = threading.Barrier(len(kernels))
        threads = [
            threading.Thread(target=take, args=(barrier, round_, i, k))
            for i, k in enumerate(kernels)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert failures == []
    assert not (cwd / "proc.crtools").exists()
    for i, kernel in enumerate(kernels):
        assert kernel.execute("print(a[0])").strip() == f"{i}.0"


def test_failed_dump_says_truthfully_whether_the_kernel_runs_on(
    kernel_factory: Factory, tmp_path: Path, criu: Criu
) -> None:
    """ "The kernel keeps running unharmed" only when it does: here the kernel dies during
    the dump (killed by someone else), and the error says it is gone."""
    fake = tmp_path / "criu"
    fake.write_text(
        "#!/bin/sh\n"
        '[ "$1" = dump ] && [ -e ' + str(tmp_path / "kill") + ' ] && kill -9 "$3"\n'
        f'exec {criu.path} "$@"\n'
    )
    fake.chmod(0o755)
    kernel = kernel_factory(extra_args=["--criu", str(fake)])
    kernel.execute("x = 1")
    kernel.snapshot(tmp_path / "s1")  # the stand-in passes everything on to CRIU
    (tmp_path / "kill").touch()
    with pytest.raises(DumpError) as info:
        kernel.snapshot(tmp_path / "s2")
    assert "unharmed" not in info.value.message
    assert info.value.message.startswith("The kernel's process ended during the snapshot")
    assert "doctor" not in (info.value.hint or "")  # CRIU's failure was no machine's fault
    wait_until(lambda: kernel.status()["state"] == "dead", what="the wrapper to see it")


def test_a_dump_ends_with_its_wrapper(kernel_factory: Factory, tmp_path: Path) -> None:
    """A CRIU run never outlives a killed wrapper (it would hold the kernel seized): here
    a "criu" that hangs in its dump must end when the wrapper is killed with SIGKILL."""
    fake = tmp_path / "criu"
    fake.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && echo "Version: 4.2" && exit 0\nexec sleep 600\n'
    )
    fake.chmod(0o755)
    kernel = kernel_factory(extra_args=["--criu", str(fake)])
    kernel.execute("x = 1")
    wrapper = kernel.process.pid

    def snapshot() -> None:
        with contextlib.suppress(SnapshotError):  # the wrapper dies under it
            kernel.snapshot(tmp_path / "s")

    threading.Thread(target=snapshot, daemon=True).start()
    wait_until(lambda: any(is_sleep(pid) for pid in proctree.children(wrapper)), what="dump")
    (dump,) = [pid for pid in proctree.children(wrapper) if is_sleep(pid)]
    os.kill(wrapper, signal.SIGKILL)
    kernel.process.wait(10)
    wait_until(lambda: not proctree.is_alive(dump), what="the dump to end with its wrapper")


def is_sleep(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep\0")
    except OSError:
        return False


ADOPTER = """
import os, subprocess, sys, time
from jupyter_ext.core import proctree
assert proctree.set_subreaper(True)
own = subprocess.Popen([sys.executable, "-c", "pass"])  # ours: left to its Popen
# A "wrapper" in its own session starts a "kernel" leading its own session too (as
# kernel_wrapper.inkernel.inner does), then dies: the kernel is adopted.
wrapper = subprocess.Popen(
    [sys.executable, "-c", "import subprocess, sys; p = subprocess.Popen([sys.executable, "
     "'-c', 'import time; time.sleep(0.5)'], start_new_session=True); print(p.pid, flush=True)"],
    stdout=subprocess.PIPE, start_new_session=True, text=True,
)
# A session leader it did not name as a kernel (a terminal, say) is left alone.
leader = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
orphan = int(wrapper.stdout.readline())
wrapper.wait()
deadline = time.monotonic() + 30
reaped = []
while orphan not in reaped and time.monotonic() < deadline:
    time.sleep(0.05)
    reaped += proctree.reap_adopted(kernels=[orphan])
print(orphan in reaped, os.path.exists(f"/proc/{orphan}"), own.pid not in reaped,
      leader.pid not in reaped, own.wait(), leader.wait())
"""


def test_a_subreaper_reaps_adopted_kernels_not_its_own_children() -> None:
    """Without root the server adopts the kernels of killed wrappers and reaps them, so
    their process ids are free for a restore; its own children stay for their Popen."""
    out = subprocess.run(
        [sys.executable, "-c", ADOPTER], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["True", "False", "True", "True", "0", "0"], out
