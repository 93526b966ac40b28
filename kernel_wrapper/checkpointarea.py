"""The kernel's cell checkpoint area as its dumps see it (jupyter_ext/core/checkpoints/).

Every tracked dump of a kernel builds on its previous one, whatever took it: a cell
checkpoint on the last checkpoint or snapshot, a snapshot the server asked for on the
last checkpoint. So a dump's parent is looked up here first (:meth:`parent_dir`: the
kernel's memory is tracked since that one), and a snapshot the server asked for leaves
an *anchor* here: hard links of its memory levels, made before its seal stamps its files
(a link changes their ctime), and its manifest, so that the next checkpoint builds on it
though the server moves or removes the snapshot's own directory. An anchor is not a
checkpoint (a snapshot may be taken while a cell runs): it is never listed or undone to,
and goes once a newer dump builds on it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from jupyter_ext.core.checkpoints import Area, CheckpointAreas, CheckpointSettings, Timeline
from jupyter_ext.core.criu.chain import PARENT, is_level_file
from jupyter_ext.core.manifest import IMAGES_DIR, MANIFEST_NAME, remove_tree

from .memory import KernelMemory

log = logging.getLogger("kernel_wrapper")

#: A connection file as jupyter_client names it: the kernel id names the area.
_KERNEL_FILE = re.compile(r"^kernel-([0-9a-f-]{36})\.json$")


def area_name(connection_file: Path) -> str:
    """What the kernel's area is named after: its (jupyter) kernel id, where its
    connection file says it, else "kernel"."""
    found = _KERNEL_FILE.match(connection_file.name)
    return found.group(1) if found else "kernel"


class KernelCheckpoints:
    """The kernel's area (made at its first checkpoint), its checkpoints' timeline, and
    the anchors of the snapshots the server took."""

    def __init__(self, settings: CheckpointSettings, name: str = "kernel") -> None:
        self.settings = settings
        self.name = name
        self.timeline = Timeline()
        self.area: Area | None = None
        self.dirs: dict[str, Path] = {}
        """Each sealed checkpoint's and anchor's directory, by snapshot id."""
        self.anchors: set[str] = set()
        self.cells_through = 0
        """The kernel's last cell (its agent's CellLog seq) a checkpoint recorded."""

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    def open_area(self) -> Area:
        if self.area is None:
            self.area = CheckpointAreas(Path(self.settings.root)).create(self.name)
        return self.area

    def directory(self, snapshot_id: str) -> Path | None:
        """A sealed checkpoint's or anchor's directory here, or None."""
        path = self.dirs.get(snapshot_id)
        return path if path is not None and (path / MANIFEST_NAME).is_file() else None

    def added(self, snapshot_id: str, directory: Path) -> None:
        self.dirs[snapshot_id] = directory

    def remove(self, snapshot_id: str) -> bool:
        """Remove a checkpoint or anchor (False: a take-back holds it; tried again later)."""
        path = self.dirs.get(snapshot_id)
        if path is None or self.area is None:
            return True
        if not self.area.remove(path):
            return False
        del self.dirs[snapshot_id]
        self.anchors.discard(snapshot_id)
        return True

    def parent_dir(self, memory: KernelMemory) -> str | None:
        """The directory of the dump the kernel's memory is tracked since, if it is here."""
        tracked_since = memory.status()["tracked_since"]
        found = self.directory(tracked_since) if tracked_since else None
        return str(found) if found is not None else None

    # ------------------------------------------------------------------ anchors

    @contextlib.contextmanager
    def anchor(self) -> Iterator[Anchor]:
        """An anchor for a snapshot the server asked for (see the module): linked by its
        dump if tracked, given its id once sealed; removed if the dump fails."""
        anchor = Anchor(self)
        try:
            yield anchor
        except BaseException:
            if anchor.partial is not None:
                remove_tree(anchor.partial)
            raise

    def drop_anchors(self, keep: str | None) -> None:
        """Remove the anchors nothing builds on any more (all but ``keep``)."""
        for anchor in list(self.anchors):
            if anchor != keep:
                self.remove(anchor)

    def close(self) -> None:
        """The wrapper ends: its area goes."""
        if self.area is not None:
            self.area.close()
            self.area = None


class Anchor:
    """A snapshot's anchor being made (:meth:`KernelCheckpoints.anchor`)."""

    def __init__(self, checkpoints: KernelCheckpoints) -> None:
        self.checkpoints = checkpoints
        self.partial: Path | None = None

    def link(self, staging: Path) -> None:
        """Before the seal of a snapshot (tracked, the kernel running on): hard links of
        its memory levels in a new folder of the area, if the kernel has one (without a
        checkpoint nothing builds on anchors)."""
        area = self.checkpoints.area
        if area is None:
            return
        partial = area.path / f".anchor-{secrets.token_hex(4)}"
        images = staging / IMAGES_DIR
        try:
            for path in images.rglob("*"):
                rel = path.relative_to(images)
                in_chain = rel.parts[0] == PARENT or len(rel.parts) == 1
                if in_chain and is_level_file(path.name) and path.is_file():
                    target = partial / IMAGES_DIR / rel
                    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                    os.link(path, target)
        except OSError as exc:
            log.warning("no anchor for the next cell checkpoint: %s", exc)
            remove_tree(partial)
            return
        self.partial = partial

    def sealed(self, sealed: Path, snapshot_id: str) -> None:
        """The snapshot was sealed in ``sealed``: its anchor gets its manifest and its id
        (the next checkpoint builds on it)."""
        area, partial = self.checkpoints.area, self.partial
        if partial is None or area is None:
            return
        directory = area.new_dir()
        try:
            shutil.copyfile(sealed / MANIFEST_NAME, partial / MANIFEST_NAME)
            partial.rename(directory)
        except OSError as exc:
            log.warning("no anchor for the next cell checkpoint: %s", exc)
            remove_tree(partial)
            return
        finally:
            self.partial = None
        self.checkpoints.anchors.add(snapshot_id)
        self.checkpoints.added(snapshot_id, directory)
