"""A backend in this process's memory: the reference implementation of the backend
contract (base.py), and a store for tests that need no disk or bucket. Thread-safe: one
lock guards the files; every file is immutable bytes, replaced whole."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from ...private import Exposed
from .. import pack
from . import layout
from .base import Handle, Kind, ObjectStat, Settings, beyond_end


@dataclass(frozen=True)
class MemoryOptions:
    """No settings: each store opened is a new one, in this process alone (tests)."""

    @classmethod
    def from_settings(cls, settings: Settings, place: str) -> MemoryOptions:
        return cls()

    def location(self) -> str:
        return "memory:"

    def open(self, max_workers: int, environ: Mapping[str, str]) -> MemoryBackend:
        return MemoryBackend()


class MemoryBackend:
    """Files as ``layout`` path -> (bytes, mtime); gone when the backend is."""

    def __init__(self) -> None:
        self._files: dict[str, tuple[bytes, float]] = {}
        self._lock = threading.Lock()

    def location(self, handle: Handle) -> str:
        return f"memory:{layout.path(handle)}"

    def save(self, handle: Handle, data: bytes | pack.Parts) -> None:
        """Joined before the lock is taken: parts that fail leave the old file."""
        key = layout.path(handle)
        body = data if isinstance(data, bytes) else b"".join(map(pack.blob_bytes, data))
        with self._lock:
            self._files[key] = (bytes(body), time.time())

    def save_if_absent(self, handle: Handle, data: bytes) -> bool:
        key = layout.path(handle)
        with self._lock:
            if key in self._files:
                return False
            self._files[key] = (bytes(data), time.time())
        return True

    def adopt(self, handle: Handle, source: Path) -> bool:
        """Memory has no links: the file is copied into packs instead."""
        return False

    def load(
        self, handle: Handle, offset: int = 0, length: int | None = None
    ) -> bytes | memoryview | None:
        key = layout.path(handle)
        with self._lock:
            found = self._files.get(key)
        if found is None:
            return None
        data = found[0]
        if length is None:
            return data
        if offset >= len(data):
            raise beyond_end(self.location(handle), offset, len(data))
        return memoryview(data)[offset : offset + length]

    def names(self, kind: Kind) -> list[str]:
        if kind is Kind.RECORD:
            found = (name.rsplit("/", 1)[-1] for name, _ in self._under(kind))
            return [i for i in map(layout.record_id, found) if i is not None]
        return [name for name, _ in self.entries(kind)]

    def _under(self, kind: Kind) -> list[tuple[str, ObjectStat]]:
        prefix = layout.directory(kind) + "/"
        with self._lock:
            return [
                (key, ObjectStat(len(data), mtime))
                for key, (data, mtime) in self._files.items()
                if key.startswith(prefix)
            ]

    def entries(self, kind: Kind) -> Iterator[tuple[str, ObjectStat]]:
        for key, stat in self._under(kind):
            if kind in layout.FLAT:
                yield key.rsplit("/", 1)[-1], stat
            elif pack.is_object_name(key):
                yield key, stat

    def remove(self, handle: Handle) -> None:
        key = layout.path(handle)
        with self._lock:
            self._files.pop(key, None)

    def remove_all(self, names: list[str]) -> None:
        for name in names:
            self.remove(layout.object_handle(name))

    def sync(self) -> None:
        """Nothing to do: a saved file is there at once (and never durable)."""

    def close(self) -> None:
        """Nothing to let go."""

    def tighten(self) -> list[Exposed]:
        """Nothing on disk."""
        return []
