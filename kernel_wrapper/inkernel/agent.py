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

Every kernel runs one (it costs a thread blocked on a socket): before each dump the
wrapper asks it what the snapshot holds (``{"op": "summary", "since": N}``): the cells
run since the previous snapshot and the largest variables (kernel_wrapper.inkernel.contents),
recorded in the manifest.

Before a kernel's first tracked dump the wrapper asks it for a memory tracker
(``{"op": "open_tracker"}``): a userfaultfd only this process can open for its own
memory (jupyter_ext/core/memtrack/). The wrapper takes a copy of the descriptor
(``pidfd_getfd``) and says so (``{"op": "close_tracker", "fd": N}``); the kernel's own
copy is closed then, or after :data:`TRACKER_HANDOVER_SECONDS` whatever happens: a dump
must never find it open (CRIU cannot save a userfaultfd).

Around a dump it holds the kernel's output gate (``{"op": "hold"}``) and releases it
once connected again (``{"op": "release"}``): kernel_wrapper.inkernel.gate.

An undo restores the kernel from a cell checkpoint, whose execution count is older than
the notebook's: the wrapper then asks ``{"op": "execution_count", "at_least": N}`` so
that the next cell goes on counting (kernel_wrapper/checkpoints.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import zmq

from jupyter_ext.core.contents import CellLog
from jupyter_ext.core.memtrack import TrackingUnavailable, open_tracking_fd, why_unavailable

from .contents import summarize_namespace
from .gate import OutputGate

log = logging.getLogger(__name__)

#: How long the kernel keeps a tracker's descriptor for the wrapper to take.
TRACKER_HANDOVER_SECONDS = 10.0


MADV_COLLAPSE = 25
#: The most blocks one "collapse" request names (2 GiB of 2 MiB blocks).
MAX_COLLAPSE = 1024


def collapse(request: dict[str, Any]) -> dict[str, Any]:
    """Make the 2 MiB blocks the wrapper unprotected huge pages again
    (``MADV_COLLAPSE``; jupyter_ext/core/memtrack/tracker.py, ``release``). Blocks that cannot
    be (no memory for a huge page, a mapping's edge) are left as they are."""
    blocks = request.get("blocks")
    if not isinstance(blocks, list) or len(blocks) > MAX_COLLAPSE:
        return {"error": f"blocks must be a list of at most {MAX_COLLAPSE} addresses"}
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = sum(
        1 for block in blocks if type(block) is int and madvise(block, 2 << 20, MADV_COLLAPSE) == 0
    )
    return {"collapsed": done}


class TrackerHandover:
    """The tracking descriptors opened for the wrapper and not yet closed here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, threading.Timer] = {}

    def open(self, _request: dict[str, Any]) -> dict[str, Any]:
        try:
            fd = open_tracking_fd()
        except TrackingUnavailable as exc:
            return {"error": f"the kernel cannot open a userfaultfd: {why_unavailable(exc)}"}
        timer = threading.Timer(TRACKER_HANDOVER_SECONDS, self._close, (fd,))
        timer.daemon = True
        with self._lock:
            self._open[fd] = timer
        timer.start()
        return {"fd": fd}

    def close(self, request: dict[str, Any]) -> dict[str, Any]:
        fd = request.get("fd")
        closed = type(fd) is int and self._close(fd)
        return {"closed": closed}

    def _close(self, fd: int) -> bool:
        with self._lock:
            timer = self._open.pop(fd, None)
        if timer is None:
            return False
        timer.cancel()
        os.close(fd)
        return True


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


class SnapshotAgent(threading.Thread):
    """Answers the wrapper's requests on ``endpoint``, one at a time, for the kernel's life.

    ``shell`` is the kernel's InteractiveShell (its namespace is summarised, its cells are
    logged by ``cells``, which the caller registers for IPython's run-cell events);
    ``gate`` is the output gate of its channels."""

    def __init__(
        self,
        context: zmq.Context[Any],
        endpoint: str,
        shell: Any = None,
        cells: CellLog | None = None,
        gate: OutputGate | None = None,
    ) -> None:
        super().__init__(name="snapshot-agent", daemon=True)
        self.shell = shell
        self.cells = cells or CellLog()
        self.trackers = TrackerHandover()
        gate = gate or OutputGate()
        self.operations: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "release_gpu_caches": lambda _request: release_gpu_caches(),
            "summary": self.summary,
            "open_tracker": self.trackers.open,
            "close_tracker": self.trackers.close,
            "collapse": collapse,
            "hold": lambda _request: gate.hold(),
            "release": lambda _request: gate.release(),
            "execution_count": self.execution_count,
        }
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
            answer = self.operations.get(str(request.get("op")))
            reply: dict[str, Any] = {"id": request.get("id")}
            if answer is None:
                reply["error"] = f"unknown operation {request.get('op')!r}"
            else:
                try:
                    reply.update(answer(request))
                except Exception as exc:  # noqa: BLE001  (the snapshot goes on without it)
                    reply["error"] = f"{type(exc).__name__}: {exc}"
            try:
                self.socket.send_json(reply, zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # the wrapper went away: it asks again if it needs
                log.warning("snapshot agent: cannot reply: %s", exc)

    def summary(self, request: dict[str, Any]) -> dict[str, Any]:
        """What the snapshot about to be taken holds: cells after ``since``, variables."""
        since = request.get("since")
        shell = self.shell
        # The running cell's count: IPython 9 counts before the cell runs, older versions
        # after; the wrapper fills it in from the cell's execute_input (kernel_wrapper.dump).
        result = self.cells.since(since if type(since) is int else 0)
        if shell is not None:
            hidden = set(getattr(shell, "user_ns_hidden", {}))
            result.update(summarize_namespace(shell.user_ns, hidden))
        return result

    def execution_count(self, request: dict[str, Any]) -> dict[str, Any]:
        """The count the kernel's next cell gets, raised to ``at_least`` if given (IPython
        counts a cell before it runs: its ``execution_count`` is the next cell's)."""
        shell = self.shell
        if shell is None:
            return {"error": "the kernel has no IPython shell"}
        at_least = request.get("at_least")
        if type(at_least) is int and at_least > shell.execution_count:
            shell.execution_count = at_least
        return {"execution_count": int(shell.execution_count)}
