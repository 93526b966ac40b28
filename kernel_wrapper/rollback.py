"""A running kernel is never lost to a failed restore in place.

Before the restore it is saved as a suspend does (:meth:`Rollback.save`), which also frees
its memory, GPU and ports for the restored one; if CRIU or the CUDA restore then fails,
or later a lazy restore cannot get a page, the saved kernel is put back as it was
(:meth:`Rollback.put_back`), and the error says so. A kernel that cannot be saved keeps
running, and the restore is refused.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import NoReturn

from jupyter_ext.core.criu import Criu
from jupyter_ext.core.errors import SnapshotError
from jupyter_ext.core.manifest import Manifest, remove_tree
from jupyter_ext.core.protocol.control import SnapshotArgs
from jupyter_ext.core.protocol.progress import ProgressCallback

from .dump import Dumper
from .parts import KernelParts
from .restore import Restorer

log = logging.getLogger("kernel_wrapper")


@dataclasses.dataclass
class SavedKernel:
    """A running kernel dumped before a restore in place replaces it."""

    directory: Path
    sequence: int
    parent_snapshot: str | None
    executions_since_snapshot: int
    keep: bool = False
    """The directory is a cell checkpoint (kernel_wrapper/checkpoints.py): never removed
    here, whatever the restore's outcome."""


class Rollback:
    """Saves the kernel of ``kernel`` with ``dumper`` and puts it back with ``restorer``,
    its record as it was."""

    def __init__(self, kernel: KernelParts, dumper: Dumper, restorer: Restorer) -> None:
        self.kernel = kernel
        self.dumper = dumper
        self.restorer = restorer

    async def save(
        self,
        directory: Path,
        progress: ProgressCallback,
        parent: Path | None = None,
        trigger: str = "before-restore",
    ) -> SavedKernel:
        """Dump the running kernel into the new ``directory`` and end it (a suspend), so
        that a failed restore can bring it back. A kernel that cannot be dumped keeps
        running; the restore is refused."""
        saved = SavedKernel(
            directory=directory,
            sequence=self.kernel.record.sequence,
            parent_snapshot=self.kernel.record.parent_snapshot,
            executions_since_snapshot=self.kernel.tracker.executions_since_snapshot,
        )
        progress({"phase": "saving-kernel"})
        args = SnapshotArgs(
            str(directory),
            trigger=trigger,
            leave_running=False,
            sequence=self.kernel.record.sequence,
            parent=str(parent) if parent else None,
        )
        try:
            await self.dumper.dump(args, lambda _: None)
        except SnapshotError as exc:
            raise type(exc)(
                "Nothing was restored: the running kernel could not be saved first, and a "
                f"restore in place would have lost it. {exc.message}",
                hint="Restore into a new kernel instead ('jupyter snapshot restore ID --path "
                "NOTEBOOK'), or shut this kernel down and restore then. " + exc.hint,
                log_excerpt=exc.log_excerpt,
            ) from exc
        return saved

    async def put_back(self, saved: SavedKernel, failure: SnapshotError, criu: Criu) -> NoReturn:
        """After a failed restore: bring back the kernel saved before it, then raise."""
        log.warning("restore failed (%s); putting the kernel back", failure.message)

        def put_back() -> None:
            self.kernel.record.sequence = saved.sequence
            self.kernel.record.parent_snapshot = saved.parent_snapshot
            self.kernel.tracker.executions_since_snapshot = saved.executions_since_snapshot

        try:
            await self.restorer.replace_inner(
                saved.directory, Manifest.read(saved.directory), criu, put_back
            )
        except SnapshotError as again:
            # Still nothing lost: it stays suspended on the saved images, and the next
            # request tries again to bring it back.
            self.kernel.record.suspended(saved.directory, discard_after_resume=not saved.keep)
            raise type(failure)(
                f"{failure.message} Putting the running kernel back failed too "
                f"({again.message}); its state is kept in {saved.directory}, and it comes "
                "back from there on the next cell.",
                hint=failure.hint,
                log_excerpt=failure.log_excerpt,
            ) from failure
        if not saved.keep:
            remove_tree(saved.directory)
        raise type(failure)(
            f"{failure.message} The kernel was put back as it was before the restore; "
            "nothing in it was lost.",
            hint=failure.hint,
            log_excerpt=failure.log_excerpt,
        ) from failure
