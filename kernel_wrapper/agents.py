"""What the wrapper asks of the code inside its kernel, in the kernel's own language: what
a snapshot holds (the cells run since the previous one, the largest variables), and before
a GPU checkpoint the frameworks' caches released.

- :class:`IPythonAgent`: the wrapper's ipykernel, whose snapshot agent thread
  (kernel_wrapper.inkernel.agent) answers over the kernel's private socket, also while a
  cell runs; it also lets variables be taken back (pickled in Python).
- :class:`BridgedAgent`: any other kernel (behind the bridge,
  kernel_wrapper.inkernel.bridge). The wrapper records its cells itself from the
  messages it relays; an R kernel's variables are read by a silent execute (no output,
  no history, no execution count) of ``variables.R`` while the kernel is idle; for other
  languages the record says variables are not available, and so does the GPU cache
  release. Taking variables back is for Python kernels only: the record says so
  (``take_unavailable``), the server refuses and the panel disables it with that reason.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from importlib import resources
from typing import Any, Protocol

from jupyter_ext.core.contents import CellLog

from .relay import Relay

log = logging.getLogger("kernel_wrapper")

#: How long the kernel's agent gets to say what the snapshot holds (it takes ~50 ms at
#: most; more only while the kernel's code holds the interpreter lock in C).
SUMMARY_TIMEOUT = 1.0
#: How long the kernel's snapshot agent gets to release GPU caches before a checkpoint.
GPU_RELEASE_TIMEOUT = 10.0
#: How long an R kernel gets to answer the silent execute that reads its variables, and
#: how long that code itself reads before it stops (the record is then partial).
R_TIMEOUT = 5.0
R_READ_SECONDS = 1.0
#: How long one ask of an ipykernel's execution count waits (kernel_wrapper.inkernel.agent).
COUNT_ASK_TIMEOUT = 1.0
#: The largest variables listed per snapshot (as kernel_wrapper.inkernel.contents).
TOP_VARIABLES = 50


class KernelAgent(Protocol):
    """The kernel's own code, as the dump and the GPU steps ask it."""

    async def summary(self, since: int) -> dict[str, Any]:
        """The contents record of the snapshot about to be taken: cells after the cell
        ``since`` (a CellLog seq), variables; "partial" with a reason when not all."""
        ...

    async def release_gpu_caches(self) -> dict[str, Any]:
        """Give back what the kernel's frameworks cache on the GPU but do not use."""
        ...

    def restored(self, cells_through: int) -> None:
        """The kernel now runs from a snapshot that recorded cells through this seq."""
        ...

    async def execution_count(self, at_least: int | None, timeout: float) -> int | None:
        """The count the kernel's next cell gets, first raised to ``at_least`` where given
        (an undo: counting goes on), asked for at most ``timeout`` seconds (a kernel just
        restored connects again by itself); None where it cannot be had."""
        ...


class IPythonAgent:
    """The snapshot agent thread in the wrapper's ipykernel (kernel_wrapper.inkernel.agent)."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay

    async def summary(self, since: int) -> dict[str, Any]:
        if self.relay.inner is None:
            return {"partial": True, "partial_reason": "the kernel is not connected"}
        answer = await self.relay.inner.ask_agent("summary", SUMMARY_TIMEOUT, since=since)
        answer.pop("id", None)
        if answer.get("error"):
            return {"partial": True, "partial_reason": str(answer["error"])}
        cells = answer.get("cells")
        running = self.relay.tracker.running_request()
        if cells and isinstance(cells[-1], dict) and cells[-1].get("running") and running:
            cells[-1]["execution_count"] = running.get("execution_count")
        return answer

    async def release_gpu_caches(self) -> dict[str, Any]:
        if self.relay.inner is None:
            return {}
        released = await self.relay.inner.ask_agent("release_gpu_caches", GPU_RELEASE_TIMEOUT)
        released.pop("id", None)
        return released

    def restored(self, cells_through: int) -> None:
        """The kernel's own cell log came back with it."""

    async def execution_count(self, at_least: int | None, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            inner = self.relay.inner
            if inner is None:
                return None
            answer = await inner.ask_agent(
                "execution_count", min(left, COUNT_ASK_TIMEOUT), at_least=at_least
            )
            if type(answer.get("execution_count")) is int:
                return int(answer["execution_count"])
            await asyncio.sleep(0.02)
        return None


def language_label(kernel_info: dict[str, Any]) -> str:
    """How messages name a kernel: its language ("R"), or for another Python than
    ipykernel its implementation ("xeus-python"), from its kernel_info."""
    language = str((kernel_info.get("language_info") or {}).get("name") or "")
    implementation = str(kernel_info.get("implementation") or "")
    if language.lower() == "python" and implementation:
        return implementation
    return language or implementation or "these"


class BridgedAgent:
    """A kernel behind the bridge: cells recorded by the wrapper (``cells``, which the
    relay's tracker fills), variables read in the kernel's language where the wrapper
    knows how (R)."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.cells = CellLog()
        relay.tracker.cells = self.cells

    def _label(self) -> str:
        return language_label(self.relay.tracker.kernel_info)

    async def summary(self, since: int) -> dict[str, Any]:
        tracker = self.relay.tracker
        running = tracker.running_request()
        record = self.cells.since(since, running.get("execution_count") if running else None)
        label = self._label()
        language = (tracker.kernel_info.get("language_info") or {}).get("name")
        if isinstance(language, str) and language:
            record["language"] = language  # the panel shows its types unshortened
        record["take_unavailable"] = (
            f"Taking variables back is not available for {label} kernels: it pickles them "
            "with Python in a copy of the snapshot's kernel."
        )
        if label.lower() != "r":
            record["variables"] = []
            record["variables_unavailable"] = (
                f"Variables are not recorded for {label} kernels: only Python (ipykernel) "
                "and R kernels are read."
            )
            return record
        record.update(await self._r_variables())
        return record

    async def _r_variables(self) -> dict[str, Any]:
        """The global environment's variables (``variables.R``), read while the kernel
        is idle (a cell running holds R's only thread: the read would wait behind it)."""
        tracker = self.relay.tracker
        if tracker.running_request() is not None or tracker.execution_state != "idle":
            return {
                "variables": [],
                "partial": True,
                "partial_reason": "a cell was running: an R kernel's variables are read "
                "only while it is idle",
            }
        code = (
            resources.files(__package__)
            .joinpath("variables.R")
            .read_text()
            .replace("@TOP@", str(TOP_VARIABLES))
            .replace("@SECONDS@", repr(R_READ_SECONDS))
        )
        messages = await self.relay.execute_own(code, R_TIMEOUT)
        if messages is None:
            reason = f"the kernel did not answer the read of its variables within {R_TIMEOUT:g} s"
            return {"variables": [], "partial": True, "partial_reason": reason}
        for message in messages:
            if message["msg_type"] == "display_data":
                try:
                    found = json.loads(message["content"]["data"]["text/plain"])
                except (KeyError, TypeError, ValueError):
                    break
                if isinstance(found, dict):
                    return found
        errors = [m["content"] for m in messages if m["msg_type"] in ("error", "execute_reply")]
        log.warning("reading the R kernel's variables failed: %s", errors)
        return {
            "variables": [],
            "partial": True,
            "partial_reason": "the kernel's variables could not be read (the server log says why)",
        }

    async def release_gpu_caches(self) -> dict[str, Any]:
        return {"skipped": f"releasing GPU caches is not available for {self._label()} kernels"}

    async def execution_count(self, at_least: int | None, timeout: float) -> int | None:
        """Not to be had: the kernel counts its cells itself, unasked (an undo leaves its
        count where the checkpoint had it)."""
        return None

    def restored(self, cells_through: int) -> None:
        self.cells.restart_after(cells_through)
