"""Cell checkpoints as the server sees them: each kernel's wrapper takes its own
(kernel_wrapper/checkpoints.py); the server lists them, asks for undo and redo as jobs,
restores one as a side kernel for a take-back of variables, and removes the areas of
wrappers that are gone (core/checkpoints/areas.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.checkpoints import CheckpointAreas
from ..core.errors import SnapshotNotFoundError, WrapperUnavailableError
from ..core.lazypages import Into, lazy_plan
from ..core.manifest import Manifest, check_snapshot_id, verify
from ..core.protocol.control import RestoreRequest, UndoArgs
from .jobs import Job, JobKind, Jobs
from .kernels import Kernels
from .lazy import LazyLending
from .restore import LAZY_HOLD_SECONDS
from .shared import EmitEvent, ManagerSettings, Workspace, check_kernel_id, describe_manifest

log = logging.getLogger("jupyter_ext")


@dataclass
class HeldCheckpoint:
    """A checkpoint's directory held for a take-back (its wrapper keeps it meanwhile)."""

    kernel_id: str
    directory: Path
    fd: int

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _public(listing: dict[str, Any]) -> dict[str, Any]:
    """A wrapper's listing as the API shows it: without where the files are."""
    for entry in listing.get("checkpoints", []):
        entry.pop("directory", None)
    return listing


def _check_cell_id(cell_id: object) -> str:
    if not isinstance(cell_id, str) or not 0 < len(cell_id) <= 200 or not cell_id.isprintable():
        raise ValueError(f"{cell_id!r} is not a notebook cell id.")
    return cell_id


class ServerCheckpoints:
    """Listing, undo and redo of the server's kernels' cell checkpoints (each kernel's
    wrapper takes its own: kernel_wrapper/checkpoints.py's CellCheckpoints)."""

    def __init__(
        self,
        settings: ManagerSettings,
        kernels: Kernels,
        jobs: Jobs,
        lending: LazyLending,
        workspace: Workspace,
        emit: EmitEvent,
    ) -> None:
        self.settings = settings
        self.kernels = kernels
        self.jobs = jobs
        self.lending = lending
        self.emit = emit
        self.areas = CheckpointAreas(workspace.checkpoints_dir)

    async def listing(self, kernel_id: str) -> dict[str, Any]:
        """The kernel's checkpoints (oldest first), its position, redo point and marks."""
        self.kernels.kernel(kernel_id)
        listing = await self.kernels.wrapper(kernel_id).checkpoints()
        return {"kernel_id": kernel_id, **_public(listing)}

    async def describe(self, kernel_id: str, checkpoint_id: str) -> dict[str, Any]:
        """One checkpoint with the full record of what it holds (its manifest)."""
        manifest = await self._manifest(await self.hold(checkpoint_id, kernel_id))
        data = describe_manifest(manifest, "checkpoint", full=True)
        data["id"] = checkpoint_id
        return data

    async def manifest(self, checkpoint_id: str) -> Manifest | None:
        """The manifest of a checkpoint of one of the server's kernels; None if none has
        it (a take-back checks what it holds before it starts)."""
        try:
            held = await self.hold(checkpoint_id)
        except SnapshotNotFoundError:
            return None
        return await self._manifest(held)

    @staticmethod
    async def _manifest(held: HeldCheckpoint) -> Manifest:
        try:
            return await asyncio.to_thread(Manifest.read, held.directory)
        finally:
            held.release()

    async def preview(self, kernel_id: str, args: UndoArgs) -> dict[str, Any]:
        """What an undo (or redo) would do: the checkpoint, the cells it undoes, the files
        the kernel holds open that changed since, what would stop it."""
        self._check(kernel_id, args)
        preview = await self.kernels.wrapper(kernel_id).undo(
            UndoArgs(args.to, args.before_cell, args.redo, preview=True)
        )
        return {"kernel_id": kernel_id, **preview}

    def undo(self, kernel_id: str, args: UndoArgs) -> Job:
        """Undo (or redo) as a job of kind "undo" ("redo")."""
        self._check(kernel_id, args)
        self.jobs.check_not_busy(kernel_id)
        kind: JobKind = "redo" if args.redo else "undo"

        async def work(job: Job) -> dict[str, Any]:
            result = await self.kernels.wrapper(kernel_id).undo(
                args, self.jobs.wrapper_progress(job)
            )
            self.emit(
                "redone" if args.redo else "undone",
                {"kernel_id": kernel_id, "snapshot_id": result.get("target"), "job_id": job.id},
            )
            return {"kernel_id": kernel_id, **result}

        return self.jobs.start(kind, kernel_id, work)

    def _check(self, kernel_id: str, args: UndoArgs) -> None:
        check_kernel_id(kernel_id)
        self.kernels.kernel(kernel_id)
        if args.to is not None:
            check_snapshot_id(args.to)
        if args.before_cell is not None:
            _check_cell_id(args.before_cell)

    async def hold(self, checkpoint_id: str, kernel_id: str | None = None) -> HeldCheckpoint:
        """A checkpoint of one of the server's kernels (``kernel_id``'s, if given), held;
        SnapshotNotFoundError if there is none."""
        check_snapshot_id(checkpoint_id)
        kernel_ids = [kernel_id] if kernel_id else self.kernels.ids()
        for owner in kernel_ids:
            with contextlib.suppress(WrapperUnavailableError, SnapshotNotFoundError):
                listing = await self.kernels.wrapper(owner).checkpoints()
                for entry in listing.get("checkpoints", []):
                    if entry.get("id") != checkpoint_id:
                        continue
                    directory = Path(str(entry.get("directory")))
                    fd = await asyncio.to_thread(self.areas.hold, directory)
                    if fd is not None:
                        return HeldCheckpoint(owner, directory, fd)
        raise SnapshotNotFoundError(
            f"There is no cell checkpoint {checkpoint_id} of "
            + (f"kernel {kernel_id}." if kernel_id else "a kernel of this server."),
            hint="Checkpoints are kept per kernel while it runs (the last "
            "cell_checkpoints_keep); GET /api/snapshots/kernels/{id}/checkpoints lists them.",
        )

    async def restore_side_kernel(self, job: Job, checkpoint_id: str) -> dict[str, Any] | None:
        """Restore a checkpoint as a side kernel (a take-back of variables,
        jupyter_ext/variables.py); None if no kernel of this server has that checkpoint.
        Its files are checked against its manifest first; a kernel restored lazily reads
        its pages from there after the job: it stays held until they are all in."""
        try:
            held = await self.hold(checkpoint_id)
        except SnapshotNotFoundError:
            return None
        try:
            job.checked.set()
            self.jobs.progress(job, "verifying")
            manifest = await asyncio.to_thread(verify, held.directory)
            plan = lazy_plan(
                self.settings.lazy,
                manifest,
                into=Into.SIDE_KERNEL,
                in_store=False,
                supported=await self.lending.lazy_pages_here(),
            )
            self.jobs.progress(job, "restoring")
            side, _restored = await self.kernels.start_restored(
                self.kernels.kernel(held.kernel_id).kernel_name,
                None,
                RestoreRequest(held.directory, verified=True, lazy=plan.lazy),
                self.jobs.wrapper_progress(job),
            )
        except BaseException:
            held.release()
            raise

        async def release(_outcome: dict[str, Any]) -> None:
            held.release()

        self.lending.after_lazy(side, release, LAZY_HOLD_SECONDS)
        return {
            "kernel_id": side,
            "snapshot_id": checkpoint_id,
            "running_request": manifest.running_request,
            "source": "checkpoint",
        }

    async def sweep(self) -> list[Path]:
        """Remove the areas of wrappers that are gone (their kernels' checkpoints)."""
        removed = await asyncio.to_thread(self.areas.sweep)
        for path in removed:
            log.info("removed the cell checkpoints of a kernel that is gone: %s", path)
        return removed
