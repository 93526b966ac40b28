"""Claims and clean-up markers under ``puts/`` (restic's locks, as files a heartbeat keeps
fresh): a put's claim lists the packs it wrote or reuses; a clean-up's marker says one
runs (host, pid, start time). A clean-up writes its marker, then reads the claims, and
spares what a live claim lists; a put publishes its claim, then waits while a marker is
fresh, before it trusts its packs."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from .. import proctree
from ..errors import SnapshotError
from . import pack
from .api import StoreError
from .backend import Backend, Kind, layout

logger = logging.getLogger(__name__)

CLAIM_REFRESH_SECONDS = 30.0
"""How often a put rewrites its claim (a heartbeat)."""
CLAIM_STALE_SECONDS = 600.0
"""A claim not rewritten for this long belongs to a put that was killed."""
MARKER_REFRESH_SECONDS = 5.0
"""How often a clean-up rewrites its marker."""
MARKER_STALE_SECONDS = 6 * MARKER_REFRESH_SECONDS
"""A clean-up marker not rewritten for this long belongs to a clean-up that was killed (a
clean-up stops deleting once its own heartbeat is half this old). Puts wait while a
marker is fresh; one whose process is gone from this host is ignored at once."""


class Claims:
    """The claims and markers of one store, and how long each stays fresh."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.claim_refresh_seconds = CLAIM_REFRESH_SECONDS
        self.marker_refresh_seconds = MARKER_REFRESH_SECONDS
        self.claim_stale_seconds = CLAIM_STALE_SECONDS
        self.marker_stale_seconds = MARKER_STALE_SECONDS
        self._leftover_markers: set[str] = set()
        """Clean-up markers that could not be removed (tried again first thing)."""
        self._lock = threading.Lock()

    def listing(self) -> list[tuple[str, float]]:
        """Names under ``puts/`` with their timestamps (the store's clock)."""
        return [(name, stat.mtime) for name, stat in self.backend.entries(Kind.PUT)]

    def write(self, token: str, snapshot_id: str, objects: set[str]) -> None:
        """Write (or rewrite) the claim ``token`` of a put (or a repack) of ``objects``."""
        claim = {
            "snapshot_id": snapshot_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "objects": sorted(objects),
        }
        self.backend.save(layout.put(f"{token}.json"), json.dumps(claim).encode())

    def remove(self, name: str) -> None:
        """Remove a claim or marker by its file name (a missing one is fine)."""
        self.backend.remove(layout.put(name))

    def stale_after(self, name: str) -> float:
        return self.marker_stale_seconds if name.endswith(".cleaning") else self.claim_stale_seconds

    def is_stale(self, name: str, mtime: float, now: float) -> bool:
        """Whether a claim or marker is one a killed put or clean-up left: past its age, or
        a clean-up marker whose process on this host has ended."""
        if mtime <= now - self.stale_after(name):
            return True
        return name.endswith(".cleaning") and self.marker_owner_gone(name)

    def any_stale(self) -> bool:
        """Whether a killed put or clean-up left its claim or marker."""
        now = time.time()
        return any(self.is_stale(name, mtime, now) for name, mtime in self.listing())

    def claimed_objects(self, name: str, stale: bool) -> set[str]:
        """The objects a claim lists; a live claim that cannot be read stops the clean-up."""
        data = self.backend.load(layout.put(name))
        try:
            if data is None:
                return set()  # its put ended meanwhile
            claim = json.loads(bytes(data))
            objects = claim["objects"]
            if not all(isinstance(o, str) and pack.is_object_name(o) for o in objects):
                raise ValueError("not a list of pack names")
            return set(objects)
        except (ValueError, KeyError, TypeError) as exc:
            if stale:
                return set()
            raise StoreError(
                f"The claim {self.backend.location(layout.put(name))} of a put in progress "
                f"cannot be read ({exc}), so nothing is removed now.",
                hint="Remove that file if no put is running, then retry.",
            ) from exc

    def wait_for_cleanups(self, besides: str = "") -> None:
        """Wait while a clean-up (other than ``besides``) that may not have seen this
        put's claim is deleting. The marker of a clean-up whose process is gone from this
        host (a server killed during it) is removed at once, not waited out."""
        while True:
            now = time.time()
            fresh = [
                name
                for name, mtime in self.listing()
                if name.endswith(".cleaning")
                and name != besides
                and mtime > now - self.marker_stale_seconds
            ]
            live = [name for name in fresh if not self.marker_owner_gone(name)]
            for name in set(fresh) - set(live):
                logger.info("removing the marker of a clean-up whose process ended: %s", name)
                with contextlib.suppress(SnapshotError):
                    self.remove(name)
            if not live:
                return
            time.sleep(0.05)

    def marker_owner_gone(self, name: str) -> bool:
        """Whether a clean-up marker names a process of this host that no longer runs."""
        with contextlib.suppress(SnapshotError, ValueError, KeyError, TypeError):
            data = self.backend.load(layout.put(name))
            if data is None:
                return True  # removed meanwhile
            owner = json.loads(bytes(data))
            if owner["host"] == socket.gethostname():
                return bool(process_identity(int(owner["pid"])) != owner)
        return False  # another host's, or unreadable: only its age tells

    def remove_leftover_markers(self) -> None:
        with self._lock:
            markers = set(self._leftover_markers)
        for marker in markers:
            with contextlib.suppress(SnapshotError):
                self.remove(marker)
                with self._lock:
                    self._leftover_markers.discard(marker)

    @contextlib.contextmanager
    def cleaning(self) -> Iterator[CleanupLease]:
        """Hold a fresh clean-up marker for the block (written first, kept fresh by a
        heartbeat, removed at the end; remembered if it cannot be)."""
        lease = CleanupLease(self, f"{uuid.uuid4().hex}.cleaning")
        lease.beat()
        try:
            with Heartbeat(self.marker_refresh_seconds, lease.beat):
                yield lease
        finally:
            try:
                self.remove(lease.marker)
            except SnapshotError:
                with self._lock:
                    self._leftover_markers.add(lease.marker)
                raise


class CleanupLease:
    """A clean-up's marker, and whether it is still fresh enough to go on deleting."""

    def __init__(self, claims: Claims, marker: str) -> None:
        self.claims = claims
        self.marker = marker
        self.last_beat = time.monotonic()
        self._owner = json.dumps(process_identity()).encode()

    def beat(self) -> None:
        self.claims.backend.save(layout.put(self.marker), self._owner)
        self.last_beat = time.monotonic()

    def check(self) -> None:
        """Stop deleting once the marker may look stale to others (its heartbeat failed)."""
        if time.monotonic() - self.last_beat > self.claims.marker_stale_seconds / 2:
            raise StoreError(
                "A clean-up of the store stopped: its marker could not be kept fresh.",
                hint="Check that the store is reachable; the clean-up is tried again later.",
            )


class Heartbeat:
    """Calls ``beat`` every ``interval`` seconds on a thread until the block ends; a failed
    beat is logged (the next one may work)."""

    def __init__(self, interval: float, beat: Callable[[], None]) -> None:
        self._interval = interval
        self._beat = beat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._beat()
            except SnapshotError as exc:
                logger.warning("Store heartbeat failed: %s", exc)


def process_identity(pid: int | None = None) -> dict[str, Any]:
    """Host, pid and start time of a process (this one by default): a pid reused by a
    later process has another start time. Empty start for a process that is gone."""
    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "pid": pid, "start": proctree.start_time(pid)}
