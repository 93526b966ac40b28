"""The kernel wrapper's GPU path, end to end, with the stand-in libcuda.

The kernel loads the stand-in (tests/support/fakecuda) as a CUDA program would load libcuda, and
the wrapper drives the CUDA checkpoint API through it around real CRIU dumps and restores.
This proves the orchestration (order, rollback, PID mapping after restore), not GPUs: the
real driver is exercised by the tests marked ``gpu`` and by bench/gpu on a GPU machine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from jupyter_ext.core.gpu import GpuCheckpointError
from testkit.processes import KernelProcess

from .support.fakecuda.build import build_fakecuda
from .support.fakecuda.programs import CACHED_BLOCK, USE_GPU

Factory = Callable[..., KernelProcess]


@pytest.fixture(scope="module")
def libcuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fakecuda(tmp_path_factory.mktemp("fakecuda"))


@pytest.fixture
def gpu_kernel(
    kernel_factory: Factory, libcuda: Path, tmp_path: Path
) -> Callable[..., tuple[KernelProcess, Path]]:
    def start(fail: str = "", **kwargs: object) -> tuple[KernelProcess, Path]:
        state = tmp_path / "fakecuda-state"
        state.mkdir(exist_ok=True)
        env = {
            "JUPYTER_SNAPSHOT_LIBCUDA": str(libcuda),
            "FAKECUDA_STATE_DIR": str(state),
            "FAKECUDA_FAIL": fail,
        }
        kernel = kernel_factory(env=env, **kwargs)
        return kernel, state

    return start


def calls(state: Path) -> list[str]:
    """The checkpoint API calls the stand-in saw, in order ("op pid result")."""
    lines = (state / "calls.log").read_text().splitlines()
    wanted = ("lock", "checkpoint", "restore", "unlock")
    return [line.split()[0] for line in lines if line.split()[0] in wanted]


def test_snapshot_checkpoints_gpu_and_keeps_running(gpu_kernel, tmp_path: Path, libcuda) -> None:
    kernel, state = gpu_kernel()
    assert kernel.execute(USE_GPU.format(lib=str(libcuda))).strip() == "True"
    manifest = kernel.snapshot(tmp_path / "s")
    assert calls(state) == ["lock", "checkpoint", "restore", "unlock"]
    gpu = manifest["gpu"]
    assert gpu["ns_pids"] == [1]
    assert gpu["checkpoint"]["status"] == "resumed"
    assert set(
        gpu["checkpoint"]["timings"][
            "1" if "1" in gpu["checkpoint"]["timings"] else next(iter(gpu["checkpoint"]["timings"]))
        ]
    ) >= {"lock_s", "checkpoint_s"}
    assert kernel.execute("print(device_ok())").strip() == "True"


def test_restore_brings_gpu_state_back(gpu_kernel, tmp_path: Path, libcuda) -> None:
    kernel, state = gpu_kernel()
    kernel.execute(USE_GPU.format(lib=str(libcuda)))
    kernel.snapshot(tmp_path / "s")
    kernel.kill_all()
    restored, _ = gpu_kernel(restore_from=tmp_path / "s")
    assert calls(state)[-2:] == ["restore", "unlock"]
    assert restored.execute("print(device_ok())").strip() == "True"
    # ... and the restored kernel can be checkpointed again.
    restored.snapshot(tmp_path / "s2")
    assert calls(state)[-4:] == ["lock", "checkpoint", "restore", "unlock"]
    assert restored.execute("print(device_ok())").strip() == "True"
    # A restore in place reports how long the CUDA steps took.
    restored.kill_inner()
    answer = restored.restore(tmp_path / "s2")
    (timings,) = answer["gpu"]["timings"].values()
    assert timings["restore_s"] > 0
    assert restored.execute("print(device_ok())").strip() == "True"


@pytest.mark.parametrize("failure", ["checkpoint", "lock_timeout", "lock"])
def test_failing_gpu_step_rolls_back(gpu_kernel, tmp_path: Path, libcuda, failure: str) -> None:
    kernel, _state = gpu_kernel(fail=failure)
    kernel.execute(USE_GPU.format(lib=str(libcuda)))
    with pytest.raises(GpuCheckpointError) as info:
        kernel.snapshot(tmp_path / "snaps" / "s")
    assert info.value.hint
    assert not (tmp_path / "snaps" / "s").exists()
    assert kernel.status()["state"] == "running"
    assert kernel.execute("print(device_ok())").strip() == "True"


def test_failing_gpu_restore_is_reported(gpu_kernel, tmp_path: Path, libcuda) -> None:
    kernel, _ = gpu_kernel()
    kernel.execute(USE_GPU.format(lib=str(libcuda)))
    kernel.snapshot(tmp_path / "s")
    kernel.kill_all()
    with pytest.raises(RuntimeError, match="restore") as info:
        gpu_kernel(fail="restore", restore_from=tmp_path / "s")
    assert "CUDA" in str(info.value) or "GPU" in str(info.value)


def test_suspend_ends_the_process_and_next_cell_resumes(
    gpu_kernel, tmp_path: Path, libcuda
) -> None:
    kernel, state = gpu_kernel()
    kernel.execute(USE_GPU.format(lib=str(libcuda)))
    inner = kernel.status()["inner_pid"]
    kernel.control.request_sync("suspend", {"dest": str(tmp_path / "suspended")}, timeout=120)
    assert kernel.status()["state"] == "suspended"
    assert not Path(f"/proc/{inner}").exists()
    assert calls(state)[-2:] == ["lock", "checkpoint"]
    # The next cell brings the kernel back by itself; its output arrives as usual.
    assert kernel.execute("print(device_ok())").strip() == "True"
    assert kernel.status()["state"] == "running"
    assert calls(state)[-2:] == ["restore", "unlock"]
    assert not (tmp_path / "suspended").exists()


def test_gpu_caches_are_released_before_the_checkpoint(gpu_kernel, tmp_path: Path, libcuda) -> None:
    kernel, state = gpu_kernel()
    kernel.execute(USE_GPU.format(lib=str(libcuda)))
    kernel.execute(CACHED_BLOCK.format(calls=str(state / "calls.log")))

    # Asked not to: the cache stays.
    manifest = kernel.snapshot(tmp_path / "kept", release_gpu_caches=False)
    assert "released_caches" not in manifest["gpu"]
    assert kernel.execute("print(bool(cached.value))").strip() == "True"

    manifest = kernel.snapshot(tmp_path / "released")
    released = manifest["gpu"]["released_caches"]
    assert released["released"] == {"test-cache": 3 << 20}
    # A framework that fails is reported, and the snapshot goes on.
    assert released["errors"] == {"broken": "RuntimeError: this framework cannot release now"}
    # Released before the second lock (the first was the snapshot that kept the cache).
    assert kernel.execute("print(seen_at_release.count('lock'))").strip() == "1"
    assert calls(state)[-4:] == ["lock", "checkpoint", "restore", "unlock"]
    assert kernel.execute("print(bool(cached.value), device_ok())").strip() == "False True"
