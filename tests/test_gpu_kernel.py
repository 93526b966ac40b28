"""The kernel wrapper's GPU path, end to end, with the stand-in libcuda.

The kernel loads the stand-in (tests/fakecuda) as a CUDA program would load libcuda, and
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

from .fakecuda.build import build_fakecuda

Factory = Callable[..., KernelProcess]

USE_GPU = r"""
import ctypes
cuda = ctypes.CDLL({lib!r})
assert cuda.cuInit(0) == 0
device = ctypes.c_int(); context = ctypes.c_void_p()
assert cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
assert cuda.cuCtxSetCurrent(context) == 0
size = 1 << 20
dptr = ctypes.c_uint64()
assert cuda.cuMemAlloc_v2(ctypes.byref(dptr), ctypes.c_size_t(size)) == 0
pattern = (ctypes.c_ubyte * size)(*[(i * 7) % 251 for i in range(size)])
assert cuda.cuMemcpyHtoD_v2(dptr, pattern, ctypes.c_size_t(size)) == 0

def device_ok():
    back = (ctypes.c_ubyte * size)()
    rc = cuda.cuMemcpyDtoH_v2(back, dptr, ctypes.c_size_t(size))
    return rc == 0 and bytes(back) == bytes(pattern)
print(device_ok())
"""


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


# A framework's cache, as the kernel's snapshot agent sees it: a releaser (registered the
# way kernel_wrapper.inkernel.agent registers PyTorch's and CuPy's) frees a cached device block.
CACHED_BLOCK = r"""
import kernel_wrapper.inkernel.agent as agent
cached = ctypes.c_uint64()
assert cuda.cuMemAlloc_v2(ctypes.byref(cached), ctypes.c_size_t(3 << 20)) == 0
seen_at_release = []

def release_test_cache():
    seen_at_release.extend(open({calls!r}).read().split())
    if not cached.value:
        return None
    assert cuda.cuMemFree_v2(cached) == 0
    cached.value = 0
    return 3 << 20

def broken_cache():
    raise RuntimeError("this framework cannot release now")

agent.RELEASERS["test-cache"] = release_test_cache
agent.RELEASERS["broken"] = broken_cache
"""


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
