"""The GPU checkpoint layer (jupyter_ext.core.gpu).

Most tests run anywhere: a stand-in libcuda (tests/support/fakecuda/fakecuda.c, built with gcc)
implements the driver's checkpoint state machine, and a small GPU program
(tests/support/fakecuda/gpuprog.c) uses it like a real CUDA program uses libcuda. Tests marked
``gpu`` use NVIDIA's real driver and a real GPU, and skip (saying why) where there is none.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from jupyter_ext.core.errors import IncompatibleSnapshotError, SnapshotError
from jupyter_ext.core.gpu import (
    ENV_LIBCUDA,
    CudaCheckpointTool,
    CudaDriver,
    GpuCheckpoint,
    GpuCheckpointer,
    GpuCheckpointError,
    GpuUnavailableError,
    ProcessState,
    check_restore_compatible,
    find_cuda_processes,
    gpu_inventory,
    gpu_record,
    open_backend,
    plan_gpu_pairs,
    process_gpu_memory,
    process_gpu_usage,
    uuid_bytes,
)

from .support.fakecuda.build import (
    GpuProgram,
    build_fakecuda,
    build_gpuprog,
    write_fake_tool,
)
from .support.fakecuda.nvml import GIB, FakeNvml

# ------------------------------------------------------------------------ fixtures


@dataclass
class Built:
    libcuda: Path
    gpuprog: Path
    dir: Path


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The stand-in libcuda and the GPU program, compiled once. No gcc is an error, not a skip."""
    out = tmp_path_factory.mktemp("fakecuda")
    return Built(build_fakecuda(out), build_gpuprog(out), out)


@dataclass
class FakeCuda:
    libcuda: Path
    gpuprog: Path
    state_dir: Path
    log: Path
    monkeypatch: pytest.MonkeyPatch
    programs: list[GpuProgram] = field(default_factory=list)

    def driver(self) -> CudaDriver:
        return CudaDriver(str(self.libcuda))

    def start(self, **env: str) -> GpuProgram:
        """A GPU program on the stand-in; its CUDA calls give up after 300 ms while locked."""
        program = GpuProgram(self.gpuprog, self.libcuda, env={"FAKECUDA_BLOCK_MS": "300", **env})
        self.programs.append(program)
        return program

    def start_restored(self) -> GpuProgram:
        """A GPU program as CRIU restores it: mid-run, its driver state CHECKPOINTED (the
        state lives in the process image; the stand-in writes it there through /proc/PID/mem)."""
        program = self.start()
        lib = ctypes.CDLL(str(self.libcuda))
        assert lib.fakecuda_set_state(program.pid, int(ProcessState.CHECKPOINTED)) == 0
        return program

    def fail(self, spec: str) -> None:
        self.monkeypatch.setenv("FAKECUDA_FAIL", spec)

    def calls(self, pid: int | None = None, *, queries: bool = False) -> list[str]:
        """The checkpoint calls made so far, as "op" (for ``pid``) or "op pid"."""
        if not self.log.exists():
            return []
        out = []
        for line in self.log.read_text().splitlines():
            op, target, *_ = line.split()
            if op == "init" or (not queries and op in ("get_state", "get_restore_tid")):
                continue
            if pid is None:
                out.append(f"{op} {target}")
            elif int(target) == pid:
                out.append(op)
        return out

    def lines(self, op: str, pid: int) -> list[str]:
        return [
            line for line in self.log.read_text().splitlines() if line.split()[:2] == [op, str(pid)]
        ]


@pytest.fixture
def fake(built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCuda]:
    state = tmp_path / "fakecuda-state"
    state.mkdir()
    for name in ("FAKECUDA_FAIL", "FAKECUDA_PERSISTENCE", "FAKECUDA_DRIVER_VERSION", ENV_LIBCUDA):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FAKECUDA_STATE_DIR", str(state))
    monkeypatch.setenv("FAKECUDA_LOG", str(state / "calls.log"))
    fake = FakeCuda(built.libcuda, built.gpuprog, state, state / "calls.log", monkeypatch)
    yield fake
    for program in fake.programs:
        if program.process.poll() is None:
            program.cont()
        program.kill()


@pytest.fixture
def plain_process() -> Iterator[subprocess.Popen[bytes]]:
    """A process that never loaded libcuda."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


# ------------------------------------------------------------- the snapshot order


def test_snapshot_that_leaves_the_kernel_running(fake: FakeCuda) -> None:
    program = fake.start()
    assert program.send("inc") == "ok 1"
    checkpointer = GpuCheckpointer(fake.driver(), lock_timeout_ms=5000)

    cp = checkpointer.checkpoint([program.pid])
    assert fake.driver().get_state(program.pid) == ProcessState.CHECKPOINTED
    assert cp.status == "checkpointed"
    # While checkpointed (and during the CRIU dump) its CUDA calls block.
    assert program.send("check") == "err 401"

    checkpointer.resume(cp)
    assert fake.driver().get_state(program.pid) == ProcessState.RUNNING
    assert cp.status == "resumed"
    assert fake.calls(program.pid) == ["lock", "checkpoint", "restore", "unlock"]
    assert fake.lines("lock", program.pid)[0].endswith("timeout_ms=5000")
    assert program.send("check") == "ok 1"
    assert program.send("inc") == "ok 2"

    totals = cp.totals()
    for step in ("lock_s", "checkpoint_s", "restore_s", "unlock_s"):
        assert getattr(totals, step) > 0
    record = json.loads(json.dumps(cp.to_dict()))
    assert record["pids"] == [program.pid]
    assert set(record["timings"][str(program.pid)]) == {
        "lock_s",
        "checkpoint_s",
        "restore_s",
        "unlock_s",
    }
    assert record["backend"].startswith("libcuda ")


def test_snapshot_that_does_not_leave_the_kernel_running(fake: FakeCuda) -> None:
    program = fake.start()
    cp = GpuCheckpointer(fake.driver()).checkpoint([program.pid])
    assert fake.calls(program.pid) == ["lock", "checkpoint"]
    assert fake.driver().get_state(program.pid) == ProcessState.CHECKPOINTED
    assert cp.timings[program.pid].restore_s == 0
    assert cp.timings[program.pid].unlock_s == 0


def test_all_processes_are_locked_before_any_is_checkpointed(fake: FakeCuda) -> None:
    a, b = fake.start(), fake.start()
    checkpointer = GpuCheckpointer(fake.driver())
    cp = checkpointer.checkpoint([a.pid, b.pid])
    checkpointer.resume(cp)
    assert fake.calls() == [
        f"lock {a.pid}",
        f"lock {b.pid}",
        f"checkpoint {a.pid}",
        f"checkpoint {b.pid}",
        f"restore {a.pid}",
        f"restore {b.pid}",
        f"unlock {a.pid}",
        f"unlock {b.pid}",
    ]
    assert a.send("check") == "ok 0"
    assert b.send("check") == "ok 0"


def test_abort_after_a_failed_dump_gives_the_gpu_back(fake: FakeCuda) -> None:
    program = fake.start()
    checkpointer = GpuCheckpointer(fake.driver())
    cp = checkpointer.checkpoint([program.pid])
    checkpointer.abort(cp)
    assert cp.status == "aborted"
    assert fake.calls(program.pid) == ["lock", "checkpoint", "restore", "unlock"]
    assert program.send("inc") == "ok 1"


# -------------------------------------------------------------------- failures


def test_lock_timeout_is_a_clear_error_and_the_kernel_keeps_running(fake: FakeCuda) -> None:
    program = fake.start()
    fake.fail("lock_timeout")
    with pytest.raises(GpuCheckpointError) as info:
        GpuCheckpointer(fake.driver(), lock_timeout_ms=50).checkpoint([program.pid])
    error = info.value
    assert error.pid == program.pid
    assert error.step == "lock"
    assert error.cuda_error == 909
    assert error.cuda_error_name == "CUDA_ERROR_TIMEOUT"
    assert f"process {program.pid}" in error.message
    assert "lock timeout" in error.hint
    assert "keeps running" in error.message
    assert fake.calls(program.pid) == ["lock"]
    assert fake.driver().get_state(program.pid) == ProcessState.RUNNING
    assert program.send("inc") == "ok 1"


def test_failing_checkpoint_rolls_back_and_the_kernel_keeps_running(fake: FakeCuda) -> None:
    program = fake.start()
    fake.fail("checkpoint")
    with pytest.raises(GpuCheckpointError) as info:
        GpuCheckpointer(fake.driver()).checkpoint([program.pid])
    error = info.value
    assert error.step == "checkpoint"
    assert error.cuda_error_name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert error.state == ProcessState.LOCKED
    assert "rolled back" in error.message
    assert "host memory" in error.hint
    assert fake.calls(program.pid) == ["lock", "checkpoint", "unlock"]
    assert fake.driver().get_state(program.pid) == ProcessState.RUNNING
    assert program.send("inc") == "ok 1"


def test_failing_checkpoint_of_a_second_process_rolls_back_both(fake: FakeCuda) -> None:
    a, b = fake.start(), fake.start()
    fake.fail(f"checkpoint:{b.pid}")
    with pytest.raises(GpuCheckpointError) as info:
        GpuCheckpointer(fake.driver()).checkpoint([a.pid, b.pid])
    assert info.value.pid == b.pid
    # a was checkpointed: restore + unlock; b only locked: unlock.
    assert fake.calls(a.pid) == ["lock", "checkpoint", "restore", "unlock"]
    assert fake.calls(b.pid) == ["lock", "checkpoint", "unlock"]
    assert a.send("inc") == "ok 1"
    assert b.send("inc") == "ok 1"


def test_failing_lock_of_a_second_process_unlocks_the_first(fake: FakeCuda) -> None:
    a, b = fake.start(), fake.start()
    fake.fail(f"lock:{b.pid}")
    with pytest.raises(GpuCheckpointError):
        GpuCheckpointer(fake.driver()).checkpoint([a.pid, b.pid])
    assert fake.calls(a.pid) == ["lock", "unlock"]
    assert fake.calls(b.pid) == ["lock"]
    assert a.send("check") == "ok 0"


def test_checkpoint_that_breaks_the_process_says_so(fake: FakeCuda) -> None:
    program = fake.start()
    fake.fail("checkpoint_fatal")
    with pytest.raises(GpuCheckpointError) as info:
        GpuCheckpointer(fake.driver()).checkpoint([program.pid])
    assert "FAILED" in info.value.message
    assert "restart the kernel" in info.value.message + info.value.hint


def test_left_locked_the_kernel_cannot_compute(fake: FakeCuda) -> None:
    """Why every failure must roll back: a process left LOCKED blocks in its next CUDA call."""
    program = fake.start()
    fake.driver().lock(program.pid, 1000)
    assert program.send("inc") == "err 401"
    fake.driver().unlock(program.pid)
    assert program.send("inc") == "ok 1"


def test_failing_restore_after_the_dump_names_the_pid_and_state(fake: FakeCuda) -> None:
    program = fake.start()
    checkpointer = GpuCheckpointer(fake.driver())
    cp = checkpointer.checkpoint([program.pid])
    fake.fail("restore")
    with pytest.raises(GpuCheckpointError) as info:
        checkpointer.resume(cp)
    error = info.value
    assert error.pid == program.pid
    assert f"process {program.pid}" in error.message
    assert "CUDA_ERROR_OUT_OF_MEMORY" in error.message
    assert "checkpointed" in error.message
    assert "restart the kernel" in error.hint
    assert fake.driver().get_state(program.pid) == ProcessState.CHECKPOINTED


def test_failing_restore_after_criu_restore_names_the_pid_and_state(fake: FakeCuda) -> None:
    program = fake.start_restored()
    fake.fail("restore")
    with pytest.raises(GpuCheckpointError) as info:
        GpuCheckpointer(fake.driver()).restore([program.pid])
    error = info.value
    assert error.pid == program.pid
    assert error.step == "restore"
    assert error.state == ProcessState.CHECKPOINTED
    assert f"CUDA restore of process {program.pid} failed" in error.message
    assert "It is checkpointed" in error.message
    assert "Free GPU memory" in error.hint
    # The error travels through the wrapper's control socket as a SnapshotError.
    data = error.to_dict()
    assert data["code"] == "gpu-checkpoint-failed"
    assert isinstance(SnapshotError.from_dict(data), SnapshotError)


# -------------------------------------------------------------- after a CRIU restore


def test_restore_after_a_criu_restore(fake: FakeCuda) -> None:
    # A process that CRIU has just restored: the driver state in its memory is CHECKPOINTED.
    program = fake.start_restored()
    assert program.send("check") == "err 401"
    cp = GpuCheckpointer(fake.driver()).restore([program.pid])
    assert cp.status == "restored"
    assert fake.calls(program.pid) == ["restore", "unlock"]
    ops = fake.calls(program.pid, queries=True)
    # The state is read before the restore, after it, and after the unlock.
    assert ops.index("get_state") < ops.index("restore")
    assert "get_state" in ops[ops.index("restore") + 1 : ops.index("unlock")]
    assert ops[-1] == "get_state"
    assert cp.timings[program.pid].restore_s > 0
    assert program.send("check") == "ok 0"
    assert fake.driver().get_state(program.pid) == ProcessState.RUNNING


def test_restore_refuses_a_process_that_is_not_checkpointed(fake: FakeCuda) -> None:
    program = fake.start()
    with pytest.raises(GpuCheckpointError) as info:
        GpuCheckpointer(fake.driver()).restore([program.pid])
    assert f"Process {program.pid} is running, not checkpointed" in info.value.message
    assert fake.calls(program.pid) == []


def test_restore_refuses_a_stopped_process_instead_of_hanging(fake: FakeCuda) -> None:
    program = fake.start_restored()
    program.stop()
    with pytest.raises(GpuCheckpointError) as info:
        GpuCheckpointer(fake.driver()).restore([program.pid])
    assert "restore thread" in info.value.message
    assert "stopped" in info.value.message
    assert "SIGCONT" in info.value.hint
    assert fake.calls(program.pid) == []
    program.cont()
    GpuCheckpointer(fake.driver()).restore([program.pid])
    assert program.send("check") == "ok 0"


def test_restore_needs_cuinit_or_persistence_mode(
    fake: FakeCuda, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver documents that a restore needs persistence mode or cuInit in the caller."""
    program = fake.start_restored()
    # A separate copy of the stand-in, so that this controller has not called cuInit yet.
    copy = tmp_path / "fresh" / "libcuda.so.1"
    copy.parent.mkdir()
    shutil.copy(fake.libcuda, copy)
    driver = CudaDriver(str(copy))
    state_dir = os.environ["FAKECUDA_STATE_DIR"]
    monkeypatch.delenv("FAKECUDA_STATE_DIR")  # cuInit now fails: no device
    assert driver.init() == 100
    monkeypatch.setenv("FAKECUDA_STATE_DIR", state_dir)
    with pytest.raises(GpuCheckpointError) as info:
        driver.restore(program.pid)
    assert info.value.cuda_error_name == "CUDA_ERROR_NOT_INITIALIZED"
    assert "cuInit(0) failed with CUDA_ERROR_NO_DEVICE" in info.value.message
    assert "persistence mode" in info.value.hint
    monkeypatch.setenv("FAKECUDA_PERSISTENCE", "1")
    driver.restore(program.pid)
    driver.unlock(program.pid)
    assert program.send("check") == "ok 0"


def test_controller_restores_after_its_own_cuinit(fake: FakeCuda) -> None:
    program = fake.start_restored()
    driver = fake.driver()
    driver.restore(program.pid)
    assert driver.init() == 0
    assert driver.get_state(program.pid) == ProcessState.LOCKED


# ------------------------------------------------------------------ CudaDriver


def test_cuda_driver_errors_carry_the_cuda_error(fake: FakeCuda, plain_process: Any) -> None:
    driver = fake.driver()
    with pytest.raises(GpuCheckpointError) as info:
        driver.get_state(plain_process.pid)
    assert info.value.cuda_error_name == "CUDA_ERROR_INVALID_VALUE"
    assert info.value.pid == plain_process.pid
    assert "uses CUDA" in info.value.hint

    program = fake.start()
    with pytest.raises(GpuCheckpointError) as info:
        driver.unlock(program.pid)
    assert info.value.cuda_error == 401
    assert info.value.state == ProcessState.RUNNING
    assert "It is running" in info.value.message
    assert info.value.cuda_error_string  # from cuGetErrorString


def test_cuda_driver_version_and_library_choice(
    fake: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKECUDA_DRIVER_VERSION", "13000")
    monkeypatch.setenv(ENV_LIBCUDA, str(fake.libcuda))
    driver = CudaDriver()
    assert driver.path == str(fake.libcuda)
    assert driver.driver_version() == 13000
    assert "CUDA 13.0" in driver.describe()
    program = fake.start()
    tid = driver.restore_thread_id(program.pid)
    assert tid != program.pid
    assert Path(f"/proc/{program.pid}/task/{tid}").exists()


def test_cuda_driver_missing_library_or_api(tmp_path: Path) -> None:
    with pytest.raises(GpuUnavailableError) as info:
        CudaDriver(str(tmp_path / "nowhere" / "libcuda.so.1"))
    assert "cannot be loaded" in info.value.message
    assert ENV_LIBCUDA in info.value.hint
    with pytest.raises(GpuUnavailableError) as info:
        CudaDriver("libc.so.6")
    assert "older than 570" in info.value.message


def test_restore_onto_another_gpu_uses_the_580_restore_args(
    fake: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = "GPU-11111111-2222-3333-4444-555555555555"
    new = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
    monkeypatch.setenv("FAKECUDA_GPU_UUID", uuid_bytes(new).hex())
    program = fake.start_restored()
    driver = fake.driver()

    monkeypatch.setenv("FAKECUDA_DRIVER_VERSION", "12080")
    with pytest.raises(GpuCheckpointError) as info:
        driver.restore(program.pid, {old: new})
    assert "driver 580" in info.value.message

    monkeypatch.setenv("FAKECUDA_DRIVER_VERSION", "13000")
    with pytest.raises(GpuCheckpointError) as info:
        driver.restore(program.pid, {old: old})  # not a GPU of this machine
    assert info.value.cuda_error_name == "CUDA_ERROR_INVALID_DEVICE"

    cp = GpuCheckpointer(driver).restore([program.pid], gpu_pairs={old: new})
    assert fake.lines("restore", program.pid)[-1].endswith("0 gpu_pairs=1")
    assert cp.status == "restored"
    assert program.send("check") == "ok 0"


def test_uuid_bytes() -> None:
    assert uuid_bytes("GPU-00112233-4455-6677-8899-aabbccddeeff") == bytes(range(0, 256, 17))
    with pytest.raises(ValueError, match="not a GPU UUID"):
        uuid_bytes("GPU-xyz")


# ------------------------------------------------------- the cuda-checkpoint fallback


def test_cuda_checkpoint_tool_backend(fake: FakeCuda, tmp_path: Path) -> None:
    tool = CudaCheckpointTool(str(write_fake_tool(tmp_path / "bin", fake.libcuda)))
    assert tool.supports_action
    assert not tool.toggle_only
    assert tool.version == "570.86.10"
    program = fake.start()
    checkpointer = GpuCheckpointer(tool, lock_timeout_ms=4000)
    cp = checkpointer.checkpoint([program.pid])
    assert tool.get_state(program.pid) == ProcessState.CHECKPOINTED
    checkpointer.resume(cp)
    assert fake.calls(program.pid) == ["lock", "checkpoint", "restore", "unlock"]
    assert fake.lines("lock", program.pid)[0].endswith("timeout_ms=4000")
    assert cp.backend.startswith("cuda-checkpoint 570.86.10")
    assert program.send("inc") == "ok 1"


def test_cuda_checkpoint_tool_failure_rolls_back(fake: FakeCuda, tmp_path: Path) -> None:
    tool = CudaCheckpointTool(str(write_fake_tool(tmp_path / "bin", fake.libcuda)))
    program = fake.start()
    fake.fail("lock_timeout")
    with pytest.raises(GpuCheckpointError) as info:
        GpuCheckpointer(tool, lock_timeout_ms=50).checkpoint([program.pid])
    assert info.value.cuda_error == 909
    assert "timed out" in info.value.message
    assert "lock timeout" in info.value.hint
    assert tool.get_state(program.pid) == ProcessState.RUNNING

    fake.fail("checkpoint")
    with pytest.raises(GpuCheckpointError) as info:
        GpuCheckpointer(tool).checkpoint([program.pid])
    assert "rolled back" in info.value.message
    assert tool.get_state(program.pid) == ProcessState.RUNNING
    assert program.send("inc") == "ok 1"


def test_cuda_checkpoint_tool_toggle_only(fake: FakeCuda, tmp_path: Path) -> None:
    tool = CudaCheckpointTool(
        str(write_fake_tool(tmp_path / "bin", fake.libcuda, toggle_only=True))
    )
    assert tool.toggle_only
    program = fake.start()
    checkpointer = GpuCheckpointer(tool)
    cp = checkpointer.checkpoint([program.pid])
    assert tool.get_state(program.pid) == ProcessState.CHECKPOINTED
    checkpointer.resume(cp)
    assert tool.get_state(program.pid) == ProcessState.RUNNING
    assert program.send("check") == "ok 0"

    restored = fake.start_restored()
    checkpointer.restore([restored.pid])
    assert restored.send("check") == "ok 0"


def test_open_backend_prefers_libcuda_and_falls_back_to_the_tool(
    fake: FakeCuda, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert isinstance(open_backend(str(fake.libcuda)), CudaDriver)
    tool = write_fake_tool(tmp_path / "bin", fake.libcuda)
    assert isinstance(open_backend("libc.so.6", str(tool)), CudaCheckpointTool)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(GpuUnavailableError) as info:
        open_backend("libc.so.6")
    assert "older than 570" in info.value.message
    assert "cuda-checkpoint utility is not installed" in info.value.message


# --------------------------------------------------------- finding CUDA processes


def test_find_cuda_processes(fake: FakeCuda, plain_process: Any) -> None:
    program = fake.start()
    pids = [plain_process.pid, program.pid, 2**22 + 12345]
    assert find_cuda_processes(pids) == [program.pid]
    assert find_cuda_processes(pids, use_nvml=False) == [program.pid]


def test_find_cuda_processes_cross_checks_nvml(fake: FakeCuda, plain_process: Any) -> None:
    program = fake.start()
    nvml = FakeNvml(processes={0: [(plain_process.pid, 1 << 20)]})
    # NVML also sees contexts in processes whose maps cannot be read.
    found = find_cuda_processes([program.pid, plain_process.pid], nvml=nvml)
    assert found == [program.pid, plain_process.pid]


# --------------------------------------------------------------- NVML inventory


def test_gpu_inventory_with_nvml() -> None:
    nvml = FakeNvml(
        gpus=[
            ("NVIDIA H200", "GPU-aaaaaaaa-0000-0000-0000-000000000000", 140, 2),
            ("NVIDIA H200", "GPU-bbbbbbbb-0000-0000-0000-000000000000", 140, 0),
        ]
    )
    inventory = gpu_inventory(nvml=nvml)
    assert inventory["available"] is True
    assert inventory["driver_version"] == "580.95.05"
    assert inventory["cuda_driver_version"] == 13000
    assert [gpu["index"] for gpu in inventory["gpus"]] == [0, 1]
    first = inventory["gpus"][0]
    assert first["name"] == "NVIDIA H200"
    assert first["uuid"] == "GPU-aaaaaaaa-0000-0000-0000-000000000000"
    assert first["memory_total"] == 140 * GIB
    assert first["memory_used"] == 2 * GIB
    assert first["memory_free"] == 138 * GIB
    assert first["persistence_mode"] is True
    assert first["mig_enabled"] is None  # not supported by this GPU
    assert first["compute_capability"] == "9.0"
    assert nvml.shutdowns == 1
    json.dumps(inventory)


def test_gpu_inventory_without_nvml_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    inventory = gpu_inventory(nvml=FakeNvml(init_error="NVML Shared Library Not Found"))
    assert inventory["available"] is False
    assert "NVML Shared Library Not Found" in inventory["reason"]
    assert "NVIDIA driver" in inventory["reason"]

    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    inventory = gpu_inventory()
    assert inventory["available"] is False
    assert "nvidia-ml-py" in inventory["reason"]
    assert process_gpu_memory([os.getpid()]) == {}


def test_gpu_inventory_from_the_real_pynvml() -> None:
    """Here without a driver it says why; on a GPU machine it lists the GPUs."""
    inventory = gpu_inventory()
    if inventory["available"]:
        assert inventory["gpus"]
        assert all(gpu["uuid"] and gpu["name"] for gpu in inventory["gpus"])
    else:
        assert inventory["reason"]
        assert inventory["gpus"] == []


def test_process_gpu_memory() -> None:
    nvml = FakeNvml(
        gpus=[
            ("NVIDIA H200", "GPU-aaaaaaaa-0000-0000-0000-000000000000", 140, 2),
            ("NVIDIA H200", "GPU-bbbbbbbb-0000-0000-0000-000000000000", 140, 0),
        ],
        processes={0: [(10, 3 * GIB), (11, None), (99, GIB)], 1: [(10, GIB)]},
    )
    assert process_gpu_memory([10, 11, 12], nvml=nvml) == {10: 4 * GIB, 11: 0, 12: 0}
    usage = process_gpu_usage([10], nvml=nvml)
    assert usage == {
        10: {
            "GPU-aaaaaaaa-0000-0000-0000-000000000000": 3 * GIB,
            "GPU-bbbbbbbb-0000-0000-0000-000000000000": GIB,
        }
    }
    record = gpu_record([10, 11], nvml=nvml)
    assert record["used_gpus"] == [
        "GPU-aaaaaaaa-0000-0000-0000-000000000000",
        "GPU-bbbbbbbb-0000-0000-0000-000000000000",
    ]
    assert record["process_memory"] == {"10": 4 * GIB, "11": 0}
    assert record["needed_bytes"] == 4 * GIB
    json.dumps(record)


# ------------------------------------------------------------ restore compatibility


def inventory(
    *gpus: tuple[str, str, int, int], driver: str = "580.95.05", cuda: int = 13000
) -> dict[str, Any]:
    return gpu_inventory(nvml=FakeNvml(list(gpus), driver=driver, cuda=cuda))


H200_A = ("NVIDIA H200", "GPU-aaaaaaaa-0000-0000-0000-000000000000", 140, 2)
H200_B = ("NVIDIA H200", "GPU-bbbbbbbb-0000-0000-0000-000000000000", 140, 100)
A100 = ("NVIDIA A100-SXM4-80GB", "GPU-cccccccc-0000-0000-0000-000000000000", 80, 0)


def test_restore_compatible_on_the_same_machine() -> None:
    recorded = inventory(H200_A)
    check_restore_compatible(recorded, 100 * GIB, current=inventory(H200_A))
    # A newer driver is fine.
    check_restore_compatible(
        recorded, 100 * GIB, current=inventory(H200_A, driver="590.10.01", cuda=13010)
    )


def test_restore_refused_without_a_gpu() -> None:
    current = gpu_inventory(nvml=FakeNvml(init_error="NVML Shared Library Not Found"))
    with pytest.raises(IncompatibleSnapshotError) as info:
        check_restore_compatible(inventory(H200_A), 3 * GIB, current=current)
    assert "no usable NVIDIA GPU" in info.value.message
    assert "NVML Shared Library Not Found" in info.value.message
    assert "NVIDIA H200" in info.value.hint


def test_restore_refused_on_another_gpu_model() -> None:
    with pytest.raises(IncompatibleSnapshotError) as info:
        check_restore_compatible(inventory(H200_A), GIB, current=inventory(A100))
    assert "NVIDIA H200" in info.value.message
    assert "NVIDIA A100-SXM4-80GB" in info.value.message
    assert "same GPU model" in info.value.message


def test_restore_refused_with_an_older_driver() -> None:
    with pytest.raises(IncompatibleSnapshotError) as info:
        check_restore_compatible(
            inventory(H200_A), GIB, current=inventory(H200_A, driver="575.57.08", cuda=12090)
        )
    assert "580.95.05" in info.value.message
    assert "older 575.57.08" in info.value.message
    assert "Update the NVIDIA driver" in info.value.hint
    with pytest.raises(IncompatibleSnapshotError, match=r"CUDA 13\.0"):
        check_restore_compatible(
            inventory(H200_A), GIB, current=inventory(H200_A, driver="", cuda=12090)
        )


def test_restore_refused_without_enough_free_gpu_memory() -> None:
    busy = ("NVIDIA H200", "GPU-dddddddd-0000-0000-0000-000000000000", 140, 130)
    with pytest.raises(IncompatibleSnapshotError) as info:
        check_restore_compatible(inventory(H200_A), 20 * GIB, current=inventory(busy))
    assert "needs 20.0 GiB" in info.value.message
    assert "10.0 GiB free" in info.value.message
    assert "nvidia-smi" in info.value.hint


def test_restore_needs_as_many_gpus_as_the_kernel_used() -> None:
    recorded = inventory(H200_A, H200_B)
    recorded["used_gpus"] = [H200_A[1], H200_B[1]]
    with pytest.raises(IncompatibleSnapshotError, match="2 x NVIDIA H200"):
        check_restore_compatible(recorded, GIB, current=inventory(H200_A))
    check_restore_compatible(recorded, 100 * GIB, current=inventory(H200_A, H200_B))


def test_restore_refused_on_a_mig_gpu() -> None:
    class MigNvml(FakeNvml):
        def nvmlDeviceGetMigMode(self, handle: int) -> list[int]:
            return [1, 1]

    current = gpu_inventory(nvml=MigNvml([H200_A]))
    with pytest.raises(IncompatibleSnapshotError, match="MIG"):
        check_restore_compatible(inventory(H200_A), GIB, current=current)


def test_plan_gpu_pairs() -> None:
    recorded = inventory(H200_A, H200_B)
    recorded["used_gpus"] = [H200_B[1]]
    assert plan_gpu_pairs(recorded, inventory(H200_A, H200_B)) == {}
    other = ("NVIDIA H200", "GPU-eeeeeeee-0000-0000-0000-000000000000", 140, 0)
    assert plan_gpu_pairs(recorded, inventory(A100, other)) == {H200_B[1]: other[1]}
    with pytest.raises(IncompatibleSnapshotError, match="No free NVIDIA H200"):
        plan_gpu_pairs(recorded, inventory(A100))


# ------------------------------------------------------------------ real GPU


def _real_driver_or_skip() -> CudaDriver:
    if not Path("/dev/nvidiactl").exists():
        pytest.skip("no NVIDIA GPU here: /dev/nvidiactl does not exist")
    try:
        driver = CudaDriver(os.environ.get(ENV_LIBCUDA) or "libcuda.so.1")
    except GpuUnavailableError as exc:
        pytest.skip(f"no usable NVIDIA driver with the CUDA checkpoint API: {exc.message}")
    if driver.init() != 0:
        pytest.skip(f"cuInit fails here: {driver.error_name(driver.init())}")
    return driver


@pytest.fixture
def real_driver() -> CudaDriver:
    return _real_driver_or_skip()


@pytest.fixture
def real_gpu_program(real_driver: CudaDriver, tmp_path: Path) -> Iterator[Callable[[], GpuProgram]]:
    """The test GPU program on NVIDIA's real libcuda (built with gcc, like the stand-in)."""
    prog = build_gpuprog(tmp_path)
    started: list[GpuProgram] = []

    def start() -> GpuProgram:
        program = GpuProgram(prog, real_driver.path, mebibytes=256, ready_timeout=120)
        started.append(program)
        return program

    yield start
    for program in started:
        with contextlib.suppress(GpuCheckpointError):
            if real_driver.get_state(program.pid) != ProcessState.RUNNING:
                GpuCheckpointer(real_driver).abort(GpuCheckpoint([program.pid], "cleanup"))
        program.kill()


@pytest.mark.gpu
def test_real_gpu_checkpoint_and_resume(
    real_driver: CudaDriver, real_gpu_program: Callable[[], GpuProgram]
) -> None:
    program = real_gpu_program()
    assert program.send("inc") == "ok 1"
    assert find_cuda_processes([program.pid, os.getppid()], use_nvml=False) == [program.pid]
    assert real_driver.driver_version() >= 12080
    assert real_driver.get_state(program.pid) == ProcessState.RUNNING
    held = process_gpu_memory([program.pid]).get(program.pid, 0)
    if held:  # NVML sees it (same PID namespace): it holds its 256 MiB on the GPU
        assert held >= 256 * 2**20
        assert find_cuda_processes([program.pid]) == [program.pid]

    checkpointer = GpuCheckpointer(real_driver, lock_timeout_ms=10_000)
    cp = checkpointer.checkpoint([program.pid])
    assert real_driver.get_state(program.pid) == ProcessState.CHECKPOINTED
    if held:  # the GPU memory is released
        assert process_gpu_memory([program.pid]).get(program.pid, 0) == 0
    checkpointer.resume(cp)
    assert real_driver.get_state(program.pid) == ProcessState.RUNNING
    assert program.send("check") == "ok 1"
    assert program.send("inc") == "ok 2"
    totals = cp.totals()
    assert totals.lock_s > 0
    assert totals.checkpoint_s > 0
    assert totals.restore_s > 0
    print("real GPU timings:", json.dumps(cp.to_dict()["totals"]))


@pytest.mark.gpu
def test_real_gpu_restore_path(
    real_driver: CudaDriver, real_gpu_program: Callable[[], GpuProgram]
) -> None:
    """Checkpoint without resuming, then the restore path used after a CRIU restore."""
    program = real_gpu_program()
    assert program.send("inc") == "ok 1"
    GpuCheckpointer(real_driver).checkpoint([program.pid])
    cp = GpuCheckpointer(real_driver).restore([program.pid])
    assert cp.status == "restored"
    assert real_driver.get_state(program.pid) == ProcessState.RUNNING
    assert program.send("check") == "ok 1"


@pytest.mark.gpu
def test_real_gpu_inventory_and_compatibility(real_driver: CudaDriver) -> None:
    here = gpu_inventory()
    assert here["available"], here.get("reason")
    assert here["gpus"]
    assert here["cuda_driver_version"] == real_driver.driver_version()
    check_restore_compatible(here, 1, current=here)
    assert plan_gpu_pairs(here, here) == {}
