"""The cell checkpoints of one kernel as states, and the cells run between them.

Each checkpoint records the checkpoint its kernel's state came from (``base``) and the
cells run since (``cells``): the kernel's history is a path back through bases from its
current position, and after an undo a new branch grows from the checkpoint it went back
to (the old one stays reachable: redo, or the timeline). What an undo restores, which
cells it takes out of the state, and what the notebook then marks "not in the kernel's
state" are decided here, on that path, without processes (tests/test_cell_checkpoints.py
and its unit tests):

- **Undo last cell**: the checkpoint before the newest cell run. Cells run back to back
  with no checkpoint between them (queued, "Run All", a checkpoint skipped) go together,
  and the plan says so.
- **Back to before this cell**: the checkpoint before the cell's latest run on the path,
  which undoes every cell after it (and, without a checkpoint right before it, the cells
  run just before it in the same batch: ``exact`` False).
- **To a checkpoint**: any one kept, also on another branch.
- **Redo**: back to where the last undo started (the kernel's state saved then).

A cell is marked "not in the kernel's state" when its latest run (whose output the
notebook shows) is not on the path the kernel's state came by: after going to checkpoint
T, every cell whose latest run is not in T's history. A cell that runs again is unmarked.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..errors import NothingToUndoError

KINDS = ("start", "cell", "before-undo", "before-redo")
"""``start``: the kernel before its first cell (or right after a restore that was not an
undo); ``cell``: after a cell; ``before-undo`` / ``before-redo``: the kernel's state
saved as an undo or redo began (redo goes back to the first)."""


@dataclass(frozen=True)
class CellRun:
    """One execution of a cell, as the wrapper saw its request and reply."""

    cell_id: str | None
    """The notebook cell (JupyterLab's ``cellId`` metadata); None for a request that
    named none (the console, a take-back of variables)."""
    execution_count: int | None
    seq: int = 0
    """This run among every run the wrapper saw (the timeline numbers them)."""

    def to_dict(self) -> dict[str, Any]:
        return {"cell_id": self.cell_id, "execution_count": self.execution_count}


@dataclass
class Checkpoint:
    """One checkpoint's record (its images are in ``directory``)."""

    id: str
    kind: str
    created: str
    directory: str
    base: str | None = None
    """The checkpoint the kernel's state came from before :attr:`cells` (None: none)."""
    cells: list[CellRun] = field(default_factory=list)
    """Cells run since :attr:`base`, oldest first."""
    total_bytes: int = 0
    """Its images, chain included: what a restore reads."""
    own_bytes: int = 0
    """What it added on disk (files no earlier checkpoint holds)."""
    memory: dict[str, Any] = field(default_factory=dict)
    """How its memory was copied (the manifest's ``memory``: mode, reason, bytes)."""
    pause_seconds: float = 0.0
    """How long requests waited for it (the kernel frozen, and disconnected around it)."""
    execution_count: int | None = None
    """The kernel's execution count after it (the last cell's), for the timeline."""
    gone: bool = False
    """No longer kept (its record stays for the path: the cells it saw)."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("directory")
        data["cells"] = [cell.to_dict() for cell in self.cells]
        return data


@dataclass(frozen=True)
class UndoPlan:
    """Where an undo or redo goes, and what it does to the notebook's marks."""

    target: str
    undone: list[CellRun]
    """The cells taken out of the kernel's state, newest first."""
    not_in_state: list[str]
    """The cells marked after it."""
    exact: bool
    """False: it also undoes cells run in the same batch before the one asked for (there
    was no checkpoint between them)."""
    save: bool
    """The kernel's state is saved first (it is not the images of a checkpoint): redo
    goes back to it; without a save, the kernel is exactly its position's images."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "undone": [cell.to_dict() for cell in self.undone],
            "not_in_state": self.not_in_state,
            "exact": self.exact,
            "save": self.save,
        }


Point = int
"""Where a checkpoint's freeze found the kernel: how many of the cells run since the
position it holds (a cell may finish while the checkpoint is sealed)."""

Segment = tuple[str | None, list[CellRun]]
"""A checkpoint (None: before the first) and the cells run after it, oldest first."""


class Timeline:
    """The checkpoints of one kernel, its position among them and the notebook's marks."""

    def __init__(self) -> None:
        self.records: dict[str, Checkpoint] = {}
        """Every checkpoint taken (the gone ones too), oldest first."""
        self.position: str | None = None
        """The checkpoint the kernel's state builds on (the newest on its path)."""
        self.cells_since: list[CellRun] = []
        """Cells run since :attr:`position`, oldest first."""
        self.redo: str | None = None
        """Where redo goes: the state saved when the last undo began."""
        self.latest: dict[str, int] = {}
        """Each cell's latest run (its seq), oldest first."""
        self._runs = 0
        self.exact = False
        """The kernel is its position's images: restored from it, nothing run since."""

    # ------------------------------------------------------------------ what happens

    def cell_ran(self, run: CellRun) -> None:
        """A cell finished (its latest run is in the state: it is no longer marked)."""
        self._runs += 1
        self.cells_since.append(replace(run, seq=self._runs))
        if run.cell_id is not None:
            self.latest.pop(run.cell_id, None)
            self.latest[run.cell_id] = self._runs
        self.exact = False

    def touched(self) -> None:
        """Something other than a cell may have changed the kernel (a comm message)."""
        self.exact = False

    def point(self) -> Point:
        """The kernel now, as a checkpoint frozen now holds it."""
        return len(self.cells_since)

    def taken(self, record: Checkpoint, point: Point | None = None) -> None:
        """A checkpoint of the kernel as it was at ``point`` (default: now) was sealed:
        the next builds on it."""
        count = point if point is not None else self.point()
        record.base = self.position
        record.cells = self.cells_since[:count]
        self.records[record.id] = record
        self.position = record.id
        self.cells_since = self.cells_since[count:]

    def moved_to(self, plan: UndoPlan, *, redo: str | None) -> None:
        """The kernel was restored from ``plan.target``; ``redo``: where redo goes now."""
        self.position = plan.target
        self.cells_since = []
        self.exact = True
        self.redo = redo

    def put_back(self, position: str, redo: str | None) -> None:
        """An undo said done failed after all (its kernel died while its memory was
        restored lazily) and the kernel saved before it is back: it is ``position``'s
        images, and redo goes where it went before that undo."""
        self.position = position
        self.cells_since = []
        self.exact = True
        self.redo = redo

    def forget(self) -> None:
        """The kernel was restored from something else (a snapshot): its state is no longer
        on this path, nor are its cells'. The checkpoints stay listed, and reachable by id."""
        self.position = None
        self.cells_since = []
        self.latest = {}
        self.redo = None
        self.exact = False

    def removed(self, checkpoint_id: str) -> None:
        record = self.records.get(checkpoint_id)
        if record is not None:
            record.gone = True
        if self.redo == checkpoint_id:
            self.redo = None

    def kept(self) -> list[Checkpoint]:
        """The checkpoints still on disk, oldest first."""
        return [r for r in self.records.values() if not r.gone]

    def prune_records(self, limit: int) -> None:
        """Forget the oldest gone records past ``limit`` records in all."""
        for record in list(self.records.values()):
            if len(self.records) <= limit:
                break
            if record.gone:
                del self.records[record.id]

    # ------------------------------------------------------------------ the path

    def segments(
        self, start: str | None = None, since: list[CellRun] | None = None
    ) -> list[Segment]:
        """The path from ``start`` (default: the kernel's position, with the cells run
        since) back to the first checkpoint, newest first."""
        if start is None and since is None:
            node, cells = self.position, list(self.cells_since)
        else:
            node, cells = start, list(since or [])
        found: list[Segment] = []
        while True:
            found.append((node, cells))
            record = self.records.get(node) if node is not None else None
            if record is None:
                return found
            node, cells = record.base, record.cells

    def history(self, checkpoint_id: str) -> list[str]:
        """``checkpoint_id`` and the checkpoints its state came from, newest first."""
        return [node for node, _ in self.segments(checkpoint_id, []) if node is not None]

    def _marks(self, segments: list[Segment]) -> list[str]:
        """The cells whose latest run is not on this path (oldest run first)."""
        runs = {cell.seq for _, cells in segments for cell in cells}
        return [cell for cell, seq in self.latest.items() if seq not in runs]

    @property
    def not_in_state(self) -> list[str]:
        """Cells of the notebook whose latest run is not in the kernel's state."""
        return self._marks(self.segments())

    # ------------------------------------------------------------------ plans

    def plan_undo(self, to: str | None = None, before_cell: str | None = None) -> UndoPlan:
        """Where an undo goes (see the module): the checkpoint ``to``, the one before the
        cell ``before_cell``'s latest run, or (neither) the one before the last cell.
        NothingToUndoError says why there is none."""
        if to is not None:
            return self._plan_to(to)
        segments = self.segments()
        exact = True
        for index, (node, cells) in enumerate(segments):
            if before_cell is None:
                if not cells:
                    continue
                exact = len(cells) == 1
            else:
                runs = [i for i, cell in enumerate(cells) if cell.cell_id == before_cell]
                if not runs:
                    continue
                exact = runs[-1] == 0
            if node is None:
                raise NothingToUndoError(
                    "That cell ran before the kernel's first cell checkpoint: there is no "
                    "checkpoint from before it."
                    if before_cell
                    else "The kernel has no cell checkpoint from before its last cell.",
                    hint="Cell checkpoints are taken once a cell has finished and the kernel "
                    "is idle; the kernel's status says why one was skipped.",
                )
            self._check_kept(node)
            undone = [cell for _, seg in segments[: index + 1] for cell in reversed(seg)]
            return UndoPlan(
                target=node,
                undone=undone,
                not_in_state=self._marks(segments[index + 1 :]),
                exact=exact,
                save=not self.exact,
            )
        if before_cell is not None:
            raise NothingToUndoError(
                f"The cell {before_cell} has not run in this kernel since its checkpoints "
                "began (or its run is no longer on the kernel's path).",
                hint="Pick a cell that ran in this kernel, or a checkpoint in the timeline.",
            )
        raise NothingToUndoError(
            "No cell has run in this kernel since its first cell checkpoint.",
            hint="Run a cell first; undo then brings the kernel back to before it.",
        )

    def plan_redo(self) -> UndoPlan:
        if self.redo is None:
            raise NothingToUndoError(
                "There is nothing to redo: no undo began since the kernel's last redo.",
                hint="Redo goes back to where the last undo started.",
            )
        return self._plan_to(self.redo)

    def _plan_to(self, target: str) -> UndoPlan:
        """Going to any checkpoint (on another branch too): the cells run on the kernel's
        path that are not in the target's history are undone."""
        if target not in self.records:
            raise NothingToUndoError(
                f"The kernel has no cell checkpoint {target}.",
                hint="Pick one of the kernel's checkpoints (GET .../checkpoints lists them).",
            )
        self._check_kept(target)
        path = self.segments(target, [])
        kept = {cell.seq for _, cells in path for cell in cells}
        undone = [
            cell for _, cells in self.segments() for cell in reversed(cells) if cell.seq not in kept
        ]
        return UndoPlan(
            target=target,
            undone=undone,
            not_in_state=self._marks(path),
            exact=True,
            save=not self.exact,
        )

    def _check_kept(self, checkpoint_id: str) -> None:
        if self.records[checkpoint_id].gone:
            raise NothingToUndoError(
                f"The cell checkpoint {checkpoint_id} is no longer kept (only the last "
                "cell_checkpoints_keep within cell_checkpoints_max_bytes are).",
                hint="Go back to a newer checkpoint, or restore a stored snapshot.",
            )

    # ------------------------------------------------------------------ listing

    def to_dict(self) -> dict[str, Any]:
        return {
            "checkpoints": [record.to_dict() for record in self.kept()],
            "position": self.position,
            "cells_since": [cell.to_dict() for cell in self.cells_since],
            "redo": self.redo,
            "not_in_state": self.not_in_state,
            "exact": self.exact,
        }
