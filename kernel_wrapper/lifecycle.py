"""The kernel's state, and which part answers jupyter_server in each."""

from __future__ import annotations

import asyncio
import enum

from .relay import Relay
from .standin import StandIn


class State(enum.StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    SNAPSHOTTING = "snapshotting"
    RESTORING = "restoring"
    DEAD = "dead"
    """The inner kernel died; the wrapper waits for a restore (``--on-inner-death=wait``)."""
    SUSPENDED = "suspended"
    """The inner kernel was dumped and stopped; it comes back on the next request."""
    STOPPING = "stopping"


class Lifecycle:
    """``state``, and the parts it switches: RUNNING relays both ways; SNAPSHOTTING only
    what the kernel sends (requests wait in the server-facing sockets); DEAD and
    SUSPENDED have the stand-in answer; the others answer nothing. ``done`` is set when
    the wrapper should exit, with ``exit_code``."""

    def __init__(self, relay: Relay, stand_in: StandIn) -> None:
        self.relay = relay
        self.stand_in = stand_in
        self.state = State.STARTING
        self.exit_code: int | None = None
        self.done = asyncio.Event()

    def enter(self, state: State) -> None:
        self.state = state
        self.relay.stop()
        self.stand_in.stop()
        if state in (State.RUNNING, State.SNAPSHOTTING) and self.relay.inner is not None:
            self.relay.start(requests=state == State.RUNNING)
        elif state in (State.DEAD, State.SUSPENDED):
            self.stand_in.start(suspended=state == State.SUSPENDED)

    def is_(self, state: State) -> bool:
        """Whether the state is ``state`` now (it changes under awaits; mypy can't see it)."""
        return self.state == state

    def end(self, exit_code: int) -> None:
        """The wrapper stops, and exits with ``exit_code``."""
        self.exit_code = exit_code
        self.enter(State.STOPPING)
        self.done.set()
