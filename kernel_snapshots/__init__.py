"""Run code in a snapshot kernel after it is restored: re-open connections, refresh
credentials, re-create clients.

A restored kernel comes back with every object it had, but its TCP connections closed
(see docs/network.md). Connection pools (requests, urllib3, boto3, SQLAlchemy's
``pool_pre_ping``) reconnect by themselves; a single connection (``psycopg.connect``, a
Spark or Dask client) must be opened again::

    import kernel_snapshots

    @kernel_snapshots.on_restore
    def reconnect(info: kernel_snapshots.RestoreInfo) -> None:
        global db
        db = psycopg.connect(DSN)

Hooks run in the kernel's main thread, in the order they were added, before the first
cell that runs after a restore (an idle kernel's resume too). What a hook prints, and the
traceback of a hook that fails, appear in that cell's output; a failing hook never stops
the cell or the other hooks. ``last_restore()`` tells how the kernel was last restored.

Outside a snapshot kernel (plain Python, a test) the functions work and hooks never run.
This module imports nothing heavy: it is part of every snapshot kernel.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["RestoreInfo", "last_restore", "on_restore", "remove_restore_hook"]

#: The file in the wrapper's runtime directory that a restore writes before CRIU restores.
RESTORE_FILE = "restored.json"


@dataclass(frozen=True)
class RestoreInfo:
    """How a kernel was restored."""

    snapshot_id: str
    """The snapshot the kernel came back from."""
    snapshot_created: str
    """When that snapshot was taken (UTC, ISO 8601)."""
    snapshot_host: str
    """The host name of the machine the snapshot was taken on."""
    host: str
    """The host name of the machine the kernel was restored on."""
    restored_at: str
    """When the restore began (UTC, ISO 8601)."""
    in_place: bool
    """Restored into the kernel that was running (same notebook session), rather than
    into a new kernel."""
    resumed: bool
    """A suspended (idle) kernel brought back by the next request."""
    token: str
    """Unique per restore: two restores of one snapshot differ in it."""
    closed_connections: list[dict[str, Any]] = field(default_factory=list)
    """TCP connections to peers outside the kernel that this restore gave back closed (each
    with ``pid``, ``process``, ``local``, ``remote``): the ones to open again."""

    @property
    def same_host(self) -> bool:
        """Whether the kernel runs on the machine it was snapshotted on (by host name)."""
        return self.host == self.snapshot_host


Hook = Callable[[RestoreInfo], Any]
H = TypeVar("H", bound=Hook)

_hooks: list[Hook] = []
_lock = threading.RLock()
_runtime_dir: Path | None = None
_seen_token: str | None = None
_seen_stat: tuple[int, int, int] | None = None
_last: RestoreInfo | None = None
_pending = False


def on_restore(hook: H) -> H:
    """Run ``hook(info)`` before the first cell after every restore of this kernel.

    Usable as a decorator; returns ``hook``. Adding the same hook twice runs it once.
    """
    if not callable(hook):
        raise TypeError(f"on_restore needs a callable taking a RestoreInfo, not {hook!r}")
    with _lock:
        if hook not in _hooks:
            _hooks.append(hook)
    return hook


def remove_restore_hook(hook: Hook) -> bool:
    """Stop running ``hook`` after restores; whether it was registered."""
    with _lock:
        if hook in _hooks:
            _hooks.remove(hook)
            return True
    return False


def last_restore() -> RestoreInfo | None:
    """How this kernel was last restored, or None if it never was (or is no snapshot
    kernel)."""
    with _lock:
        _poll()
        return _last


def _poll() -> None:
    """Notice a restore this process has not seen yet; its hooks become pending.

    The wrapper writes RESTORE_FILE (atomically, with a new token) into its runtime
    directory before every restore; the kernel reaches that directory through the
    descriptor CRIU hands it, so after a restore it reads the new wrapper's file. A stat
    per cell; the file is read only when it changed.
    """
    global _seen_token, _seen_stat, _last, _pending
    if _runtime_dir is None:
        return
    try:
        st = os.stat(_runtime_dir / RESTORE_FILE)
    except OSError:
        return
    stat = (st.st_dev, st.st_ino, st.st_mtime_ns)
    if stat == _seen_stat:
        return
    _seen_stat = stat
    info = read_restore_info(_runtime_dir)
    if info is None or info.token == _seen_token:
        return
    _seen_token = info.token
    _last = info
    _pending = True


def run_pending_hooks() -> None:
    """Run the hooks if a restore happened since they last ran (called before each cell).

    A failing hook is reported on stderr (the cell's output) with its traceback; the
    others still run, and so does the cell.
    """
    global _pending
    with _lock:
        _poll()
        if not _pending or _last is None:
            return
        _pending = False
        info, hooks = _last, list(_hooks)
    for hook in hooks:
        try:
            hook(info)
        except BaseException:  # noqa: BLE001  (never fatal, even SystemExit or an interrupt)
            name = getattr(hook, "__qualname__", None) or repr(hook)
            print(
                f"kernel_snapshots: the restore hook {name} failed (the kernel carries on):\n"
                + traceback.format_exc(),
                file=sys.stderr,
                flush=True,
            )


def _install(runtime_dir: Path) -> None:
    """Follow restores through ``runtime_dir`` (the inner kernel calls this at start);
    a restore recorded there before this kernel started is not this kernel's."""
    global _runtime_dir, _seen_token
    with _lock:
        _runtime_dir = runtime_dir
        current = read_restore_info(runtime_dir)
        _seen_token = current.token if current is not None else None


def read_restore_info(runtime_dir: Path) -> RestoreInfo | None:
    """The restore recorded in ``runtime_dir``, or None (none, or unreadable)."""
    try:
        data = json.loads((runtime_dir / RESTORE_FILE).read_text())
        names = {f.name for f in fields(RestoreInfo)}
        return RestoreInfo(**{k: v for k, v in data.items() if k in names})
    except (OSError, ValueError, TypeError):
        return None


def write_restore_info(
    runtime_dir: Path,
    *,
    snapshot_id: str,
    snapshot_created: str,
    snapshot_host: str,
    in_place: bool,
    resumed: bool,
    closed_connections: list[dict[str, Any]] | None = None,
) -> RestoreInfo:
    """Record a restore that is about to happen (the wrapper calls this before CRIU)."""
    info = RestoreInfo(
        snapshot_id=snapshot_id,
        snapshot_created=snapshot_created,
        snapshot_host=snapshot_host,
        host=socket.gethostname(),
        restored_at=datetime.now(UTC).isoformat(timespec="seconds"),
        in_place=in_place,
        resumed=resumed,
        token=secrets.token_hex(8),
        closed_connections=list(closed_connections or []),
    )
    tmp = runtime_dir / f"{RESTORE_FILE}.tmp"
    tmp.write_text(json.dumps({**asdict(info), "same_host": info.same_host}))
    os.replace(tmp, runtime_dir / RESTORE_FILE)
    return info
