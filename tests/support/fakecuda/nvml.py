"""Just enough of pynvml for the GPU inventory (core/gpu/nvml.py) without a GPU: the
models, memory and processes a test gives it."""

from __future__ import annotations

from types import SimpleNamespace

#: The unit of the GPUs' memory a test gives (total, used).
GIB = 2**30


class FakeNvmlError(Exception):
    pass


class FakeNvml:
    """Just enough of pynvml for the inventory code."""

    def __init__(
        self,
        gpus: list[tuple[str, str, int, int]] | None = None,
        processes: dict[int, list[tuple[int, int | None]]] | None = None,
        *,
        init_error: str = "",
        driver: str = "580.95.05",
        cuda: int = 13000,
    ) -> None:
        self.gpus = gpus or [("NVIDIA H200", "GPU-aaaaaaaa-0000-0000-0000-000000000000", 140, 2)]
        self.processes = processes or {}
        self.init_error = init_error
        self.driver = driver
        self.cuda = cuda
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.init_error:
            raise FakeNvmlError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.cuda

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return self.gpus[handle][0].encode()

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self.gpus[handle][1]

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        total, used = self.gpus[handle][2] * GIB, self.gpus[handle][3] * GIB
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetPersistenceMode(self, handle: int) -> int:
        return 1

    def nvmlDeviceGetMigMode(self, handle: int) -> list[int]:
        raise FakeNvmlError("Not Supported")

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
        return (9, 0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        return [
            SimpleNamespace(pid=pid, usedGpuMemory=used)
            for pid, used in self.processes.get(handle, [])
        ]
