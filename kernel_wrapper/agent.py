"""The snapshot agent: a thread in the inner kernel that the wrapper asks to get ready.

A GPU snapshot saves every byte of device memory the process holds, and frameworks hold
much more than they use: PyTorch's caching allocator and CuPy's memory pools keep freed
blocks for reuse. Releasing them before the CUDA checkpoint makes the snapshot smaller
and faster and costs the kernel only a few re-allocations later.

Only code inside the kernel's process can do that, so the agent connects one more ZMQ
socket to the wrapper (``ipc://<runtime dir>/ch-7``, like the kernel's channels: it is
dropped before a dump and reconnects by itself after a restore) and answers requests,
one JSON object each way:

    {"id": 1, "op": "release_gpu_caches"}  ->  {"id": 1, "released": {"torch": 123}, ...}

It never imports a framework: only one the kernel has already imported is touched.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

import zmq

from jupyter_ext.core.protocol import ENV_LIBCUDA

#: The channel "port" of the agent in the runtime directory (see kernel_wrapper.inner).


def wanted() -> bool:
    """Whether this kernel runs an agent: only where GPU memory can be cached, a machine
    with an NVIDIA driver, or one where a libcuda is named for the kernel
    (``JUPYTER_SNAPSHOT_LIBCUDA``). Elsewhere the kernel has no extra thread or connection,
    and the wrapper, finding no agent, goes on at once."""
    return os.path.exists("/dev/nvidiactl") or bool(os.environ.get(ENV_LIBCUDA))


log = logging.getLogger(__name__)


def _torch_reserved(torch: Any) -> int:
    cuda = torch.cuda
    return sum(int(cuda.memory_reserved(i)) for i in range(cuda.device_count()))


def release_torch_cache() -> int | None:
    """Give PyTorch's cached, unused CUDA blocks back to the driver; returns the bytes
    released, or None when PyTorch is not imported or has not initialised CUDA."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_initialized():
        return None
    before = _torch_reserved(torch)
    cuda.empty_cache()
    return max(0, before - _torch_reserved(torch))


def release_cupy_pools() -> int | None:
    """Free the unused blocks of CuPy's default device and pinned memory pools; returns
    the bytes released, or None when CuPy is not imported."""
    cupy = sys.modules.get("cupy")
    if cupy is None or not hasattr(cupy, "get_default_memory_pool"):
        return None
    pool = cupy.get_default_memory_pool()
    before = int(pool.total_bytes())
    pool.free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()
    return max(0, before - int(pool.total_bytes()))


#: What "release_gpu_caches" runs, by framework name.
RELEASERS = {"torch": release_torch_cache, "cupy": release_cupy_pools}


def release_gpu_caches() -> dict[str, Any]:
    """Run every releaser; a failing one is reported, never raised (the snapshot goes on)."""
    released: dict[str, int] = {}
    errors: dict[str, str] = {}
    for name, release in RELEASERS.items():
        try:
            freed = release()
        except Exception as exc:  # noqa: BLE001  (any framework error: report, go on)
            errors[name] = f"{type(exc).__name__}: {exc}"
            continue
        if freed is not None:
            released[name] = freed
    return {"released": released, "errors": errors}


OPERATIONS = {"release_gpu_caches": release_gpu_caches}


class SnapshotAgent(threading.Thread):
    """Answers the wrapper's requests on ``endpoint``, one at a time, for the kernel's life."""

    def __init__(self, context: zmq.Context[Any], endpoint: str) -> None:
        super().__init__(name="snapshot-agent", daemon=True)
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RECONNECT_IVL, 10)
        self.socket.setsockopt(zmq.RECONNECT_IVL_MAX, 200)
        self.socket.connect(endpoint)

    def run(self) -> None:
        while True:
            try:
                request = self.socket.recv_json()
            except zmq.ContextTerminated:  # the kernel is exiting
                self.socket.close()
                return
            except (zmq.ZMQError, ValueError) as exc:
                log.warning("snapshot agent: bad request: %s", exc)
                continue
            if not isinstance(request, dict):
                continue
            answer = OPERATIONS.get(str(request.get("op")))
            reply: dict[str, Any] = {"id": request.get("id")}
            if answer is None:
                reply["error"] = f"unknown operation {request.get('op')!r}"
            else:
                reply.update(answer())
            try:
                self.socket.send_json(reply, zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # the wrapper went away: it asks again if it needs
                log.warning("snapshot agent: cannot reply: %s", exc)
