"""What the server hands its wrappers about cell checkpoints, and whether a kernel gets
them (and why not)."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, fields

from ..humanize import human_bytes
from ..memtrack.plan import DumpPlan

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
"""``auto``: where they are cheap (the kernel's memory is tracked, so each copies what
its cell changed; not a GPU kernel); ``on``: for every kernel, full copies where tracking
cannot work (a GPU kernel's device memory is copied whole every time); ``off``."""

#: Of the work directory's disk, what one kernel's checkpoints may take by default.
DEFAULT_DISK_FRACTION = 0.10
#: A checkpoint is skipped (and said) while less than this share of the disk (at most
#: RESERVE_CAP_BYTES) would stay free after it: undo must never fill the disk.
RESERVE_FRACTION = 0.10
RESERVE_CAP_BYTES = 2 << 30

OFF_SETTING = "cell checkpoints are off on this server (cell_checkpoints = 'off')"
NOT_CONFIGURED = "the kernel was not started by a server with cell checkpoints"


@dataclass(frozen=True)
class CheckpointSettings:
    """SnapshotExtensionApp's ``cell_checkpoints*`` traits (there documented), and where
    the wrappers' areas go (``<work_dir>/checkpoints``)."""

    mode: str = "off"
    root: str = ""
    keep: int = 20
    max_bytes: int = -1
    """One kernel's checkpoints together (files shared by hard links counted once); < 0:
    DEFAULT_DISK_FRACTION of the disk."""
    max_change_bytes: int = 8 << 30
    """A checkpoint that would copy more than this (what changed since the previous one)
    is skipped, and said."""
    max_pause_share: float = 0.02
    """Of the kernel's wall time, at most this share stalled by its checkpoints
    (core/checkpoints/pacing.py; the cells run meanwhile share the next); 0: after every
    cell."""
    track_memory: bool = True
    """The server's track_memory (off: every checkpoint a full copy, so none in "auto")."""
    chunk_kib: int | None = None
    """The server's chunk_kib (None: automatic). A snapshot that builds on a checkpoint
    keeps the checkpoint's levels as they were cut, so they are cut as its own memory is."""

    @property
    def enabled(self) -> bool:
        return self.mode != "off" and bool(self.root)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | None) -> CheckpointSettings:
        """The settings in the environment variable's text; off (logged) if it cannot be
        read, as for a kernel no server started."""
        if not text:
            return cls()
        try:
            data = json.loads(text)
            known = {f.name for f in fields(cls)}
            settings = cls(**{k: v for k, v in data.items() if k in known})
        except (ValueError, TypeError, AttributeError) as exc:
            log.warning("cell checkpoints off: their settings cannot be read (%s)", exc)
            return cls()
        if settings.mode not in MODES:
            log.warning("cell checkpoints off: unknown mode %r", settings.mode)
            return cls()
        return settings

    def disabled_reason(self) -> str:
        """Why no kernel of this server gets checkpoints ("" when they may)."""
        if self.enabled:
            return ""
        return OFF_SETTING if self.root else NOT_CONFIGURED

    def budget(self, disk_total: int) -> int:
        """The byte budget of one kernel's checkpoints on a disk of ``disk_total`` bytes."""
        return self.max_bytes if self.max_bytes >= 0 else int(disk_total * DEFAULT_DISK_FRACTION)


def off_reason(settings: CheckpointSettings, plan: DumpPlan) -> str:
    """Why a kernel gets no cell checkpoints now ("" when it does), given the plan of its
    next dump: in "auto", only where its memory is tracked (``plan.track``: the checkpoint
    after each cell copies what the cell changed; a first one, or the first after a
    restore, is a full copy once). GPU kernels and kernels with pinned memory get none
    ("on" takes them anyway, each a full copy)."""
    if not settings.enabled:
        return settings.disabled_reason()
    if settings.mode == "on" or plan.track:
        return ""
    return (
        f"each would be a full copy of the kernel: {plan.reason} "
        "(cell_checkpoints = 'on' takes them anyway)"
    )


def skip_reason(
    settings: CheckpointSettings, pending: int, free: int, disk_total: int, budget: int
) -> str:
    """Why this checkpoint is skipped ("" when it is taken): ``pending`` bytes would be
    copied, ``free`` bytes are free on the area's disk."""
    if pending > settings.max_change_bytes:
        return (
            f"{human_bytes(pending)} changed since the previous checkpoint, more than "
            f"cell_checkpoint_max_change_bytes ({human_bytes(settings.max_change_bytes)})"
        )
    if pending > budget:
        return (
            f"{human_bytes(pending)} changed since the previous checkpoint, more than the "
            f"kernel's checkpoints may hold ({human_bytes(budget)})"
        )
    reserve = min(int(disk_total * RESERVE_FRACTION), RESERVE_CAP_BYTES)
    if free - pending < reserve:
        return (
            f"the disk would keep less than {human_bytes(reserve)} free "
            f"({human_bytes(free)} free, {human_bytes(pending)} to copy)"
        )
    return ""
