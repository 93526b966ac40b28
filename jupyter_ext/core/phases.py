"""Where an operation's time goes: seconds per named phase, in the order they ran (a
restore's check, save, end of the old kernel, CRIU, ...), reported with its result."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator


class Phases:
    """Seconds spent in each named phase; a phase entered again adds up."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as ``name`` (also when it raises)."""
        started = self._clock()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + self._clock() - started

    def to_dict(self) -> dict[str, float]:
        return {name: round(seconds, 3) for name, seconds in self.seconds.items()}
