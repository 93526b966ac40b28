"""Cell checkpoints: the kernel as it was after each of its last cells, kept on this
machine, so that a cell can be undone.

A cell checkpoint is a tracked snapshot (core/memtrack/) that the kernel's wrapper takes
into a local area of its own when a cell has finished and the kernel is idle, building on
the previous one: it copies what the cell changed, and freezes the kernel only for that.
Checkpoints are never uploaded; the server's own snapshots build on them (their chain is
hard-linked, core/criu/chain.py). Undo restores the kernel in place from one of them.

The parts here hold no processes and no Jupyter:

- :mod:`.settings`: what the server hands its wrappers (``JUPYTER_SNAPSHOT_CELL_CHECKPOINTS``),
  and whether a kernel gets checkpoints at all, and why not;
- :mod:`.timeline`: the checkpoints of one kernel as states and the cells between them:
  what "Undo last cell", "Back to before this cell" and redo restore, and which cells the
  notebook then marks "not in the kernel's state";
- :mod:`.keep`: which checkpoints stay (the last N within a byte budget, a file shared by
  hard links counted once);
- :mod:`.areas`: the areas on disk, one per wrapper, locked while it lives, swept by the
  server once it is gone.

kernel_wrapper/checkpoints.py takes them and undoes; jupyter_ext/manager/checkpoints.py
lists them and asks for undo and redo; docs/undo.md says what it costs.
"""

from .areas import Area, CheckpointAreas
from .keep import to_remove
from .settings import CheckpointSettings, off_reason
from .timeline import CellRun, Checkpoint, Timeline, UndoPlan

__all__ = [
    "Area",
    "CellRun",
    "Checkpoint",
    "CheckpointAreas",
    "CheckpointSettings",
    "Timeline",
    "UndoPlan",
    "off_reason",
    "to_remove",
]
