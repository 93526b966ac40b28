"""Requests of the wrapper's own to its kernel: a silent execute that reads what a snapshot
holds in the kernel's own language (kernel_wrapper.agents). They go to the kernel beside
the clients' requests; what the kernel sends for them (its reply, its status, execute_input
and output) is kept from the clients and from the tracker, and handed to the waiting
caller instead."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
from typing import Any

from jupyter_client.session import DELIM, Session

#: The routing id the wrapper's own requests come from (no client has it).
OWN_IDENT = b"kernel-snapshot-wrapper-own"
#: Requests remembered without their end (a kernel killed, or one that never answered):
#: what they send later is still kept from the clients.
MAX_REMEMBERED = 32


class _Waiting:
    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.replied = False
        self.idle = False
        self.done = asyncio.Event()


class OwnRequests:
    """The wrapper's own requests not ended yet, by msg_id; ``session`` makes them."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._waiting: collections.OrderedDict[str, _Waiting] = collections.OrderedDict()

    def execute_request(self, code: str) -> tuple[str, list[bytes]]:
        """A silent execute_request (no output, no history, no stdin) as the kernel gets
        it from the relay (unsigned): its msg_id and frames."""
        content = {
            "code": code,
            "silent": True,
            "store_history": False,
            "user_expressions": {},
            "allow_stdin": False,
            "stop_on_error": False,
        }
        msg = self.session.msg("execute_request", content)
        msg_id = str(msg["header"]["msg_id"])
        self._waiting[msg_id] = _Waiting()
        while len(self._waiting) > MAX_REMEMBERED:
            self._waiting.popitem(last=False)
        parts = [msg["header"], msg["parent_header"], msg["metadata"], msg["content"]]
        return msg_id, [OWN_IDENT, DELIM, b"", *(self.session.pack(p) for p in parts)]

    def take(self, frames: list[bytes]) -> bool:
        """Whether a message from the kernel answers one of our requests (then it is
        kept here, and not passed on)."""
        if not self._waiting:
            return False
        try:
            at = frames.index(DELIM)
            parent = json.loads(frames[at + 3])
        except (ValueError, IndexError):
            return False
        msg_id = parent.get("msg_id") if isinstance(parent, dict) else None
        waiting = self._waiting.get(msg_id) if isinstance(msg_id, str) else None
        if waiting is None:
            return False
        with contextlib.suppress(ValueError, IndexError):
            header = json.loads(frames[at + 2])
            content = json.loads(frames[at + 5])
            waiting.messages.append({"msg_type": header.get("msg_type"), "content": content})
            if header.get("msg_type") == "execute_reply":
                waiting.replied = True
            elif header.get("msg_type") == "status" and content.get("execution_state") == "idle":
                waiting.idle = True
        if waiting.replied and waiting.idle:
            waiting.done.set()
            self._waiting.pop(str(msg_id), None)
        return True

    async def answers(self, msg_id: str, timeout: float) -> list[dict[str, Any]] | None:
        """What the kernel sent for ``msg_id`` once it has replied and is idle again;
        None if it did not within ``timeout`` (what it sends later is still kept)."""
        waiting = self._waiting.get(msg_id)
        if waiting is None:
            return None
        try:
            await asyncio.wait_for(waiting.done.wait(), timeout)
        except TimeoutError:
            return None
        return waiting.messages
