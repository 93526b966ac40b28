"""What the wrapper records of its kernel's snapshots, shared by its dumps and restores."""

from __future__ import annotations

import dataclasses
import os
import secrets
from pathlib import Path

from jupyter_ext.core.fileio import lock_directory
from jupyter_ext.core.manifest import Manifest


@dataclasses.dataclass
class KernelRecord:
    """The kernel's lineage (``lineage``, ``sequence``, the parent of its next snapshot),
    what its next snapshot starts from, and the snapshot a suspended kernel comes back
    from."""

    lineage: str = dataclasses.field(default_factory=lambda: secrets.token_hex(8))
    sequence: int = 0
    parent_snapshot: str | None = None
    chunk_kib: int | None = None
    """The chunk size of the kernel's last snapshot: the next keeps it if it can."""
    cells_through: int = 0
    """The kernel's last cell (jupyter_ext.core.contents.CellLog seq) that a snapshot
    recorded: the next one lists the cells after it."""
    suspended_snapshot: Path | None = None
    """The snapshot a suspended kernel comes back from."""
    discard_after_resume: bool = False
    """Whether ``suspended_snapshot`` is deleted once the kernel is back from it."""
    _held: int = dataclasses.field(default=-1, init=False, repr=False)
    """The flock held on ``suspended_snapshot`` (shared) while it is the kernel's: once
    the wrapper ends, the server finds it free and removes the dump
    (:func:`jupyter_ext.core.leftovers.remove_unlocked`)."""

    def next_sequence(self, sequence: int | None) -> int:
        """The sequence number of the snapshot being taken: ``sequence`` if given."""
        self.sequence = sequence if sequence is not None else self.sequence + 1
        return self.sequence

    def dumped(self, manifest: Manifest) -> None:
        """The kernel's next snapshot follows ``manifest``, just sealed."""
        self.parent_snapshot = manifest.id
        self.chunk_kib = manifest.chunk_kib
        self.cells_through = int(manifest.contents.get("cells_through", self.cells_through))

    def restored(self, manifest: Manifest) -> None:
        """The kernel now runs from ``manifest``'s snapshot."""
        self.sequence = max(self.sequence, manifest.sequence)
        self.parent_snapshot = manifest.id
        self.chunk_kib = manifest.chunk_kib
        self.cells_through = int(manifest.contents.get("cells_through", 0))

    def suspended(self, snapshot: Path, discard_after_resume: bool) -> None:
        """The kernel's process ended; it comes back from ``snapshot``."""
        self.resumed()
        self._held = lock_directory(snapshot, shared=True)
        self.suspended_snapshot = snapshot
        self.discard_after_resume = discard_after_resume

    def resumed(self) -> Path | None:
        """The kernel is no longer suspended: its snapshot, no longer held, is returned
        (the caller deletes it if it is to be)."""
        if self._held >= 0:
            os.close(self._held)
            self._held = -1
        snapshot, self.suspended_snapshot = self.suspended_snapshot, None
        return snapshot
