"""The wrapper's parts that its dumps and restores work on, passed to each as one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jupyter_ext.core.criu import Criu

from .agents import KernelAgent
from .checkpointarea import KernelCheckpoints
from .gpusteps import GpuSteps
from .lazyrestore import LazyRestore
from .lifecycle import Lifecycle
from .memory import KernelMemory
from .record import KernelRecord
from .relay import Relay
from .runtime import RuntimeDir
from .supervisor import Supervisor
from .tracker import KernelTracker


@dataclasses.dataclass(frozen=True)
class KernelParts:
    """One kernel as a dump or a restore sees it: its state (``lifecycle``), its
    messages (``relay``, and what they tell: ``tracker``), its ``process``, its
    ``runtime`` directory, its CUDA steps (``gpu``), its lazy restores (``lazy``), the
    ``record`` of its snapshots, the tracking of its ``memory`` between them, its own
    code (``agent``: what a snapshot holds) and its cell ``checkpoints`` area, which its
    dumps build on; ``criu`` gives the CRIU binary (located on first use)."""

    lifecycle: Lifecycle
    relay: Relay
    process: Supervisor
    runtime: RuntimeDir
    gpu: GpuSteps
    lazy: LazyRestore
    record: KernelRecord
    memory: KernelMemory
    agent: KernelAgent
    checkpoints: KernelCheckpoints
    criu: Callable[[], Criu]

    @property
    def tracker(self) -> KernelTracker:
        return self.relay.tracker
