"""Chains of memory images: what an incremental dump leaves, kept self-contained.

``criu dump --track-mem --prev-images-dir P`` writes only the pages written since the
dump ``P`` holds; its pagemap marks the others ``PE_PARENT`` ("in the parent images"), and
a restore reads them from ``images/parent``, recursively. A dump only reads the parent's
pagemaps and inventory (it checks that each page it leaves out is there), so it is given
a *stub* of them (:func:`make_stub`): a few kilobytes, whatever the parent's size, which
also travels to a node agent as they are.

Once the dump is over, ``images/parent`` becomes a real directory of *hard links* to the
parent snapshot's memory images (:func:`link_parent`): the snapshot directory then holds
its whole chain, so that it is complete on its own (a restore needs no other snapshot,
and deleting the parent frees nothing it needs), at no copy. Its manifest lists the
parent's files under ``images/parent/`` with the parent's own entries (:func:`parent_entries`),
so a store that keeps the parent keeps them by the same chunks: unchanged memory is not
read, hashed or stored again.

Only what a restore reads of a parent level is kept there: its inventory, pagemaps and
pages files (and the node agent's seals of them, :data:`SEAL_FILE`). A chain grows by one
level per snapshot (two when it was pre-copied, see kernel_wrapper/memory.py);
:func:`chain_stats` tells how much of it later levels replaced, which decides when the
next snapshot starts a new chain (core/memtrack/plan.py).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import SnapshotError
from ..manifest import IMAGES_DIR, FileEntry, Manifest

PARENT = "parent"
"""CRIU's name for the parent images of an images directory."""
SEAL_FILE = "agent-seal.json"
"""In an images directory dumped through the node agent: the agent's seals of its files
(core/agent/client.py). A level keeps it: a restore through the agent checks each of
the level's files against it."""
_LEVEL_FILE = re.compile(r"^(inventory\.img|pagemap-\d+\.img|pages-\d+\.img|agent-seal\.json)$")


def is_level_file(name: str) -> bool:
    """Whether a file of an images directory belongs in a parent level."""
    return bool(_LEVEL_FILE.match(name))


def make_stub(images: Path, stub: Path) -> None:
    """What ``--prev-images-dir`` needs of ``images``: copies of its inventory and
    pagemaps, and empty pages files (never read by a dump)."""
    stub.mkdir(mode=0o700, parents=True)
    for path in images.iterdir():
        if not path.is_file() or not is_level_file(path.name):
            continue
        if path.name.startswith("pages-"):
            os.close(os.open(stub / path.name, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600))
        else:
            shutil.copyfile(path, stub / path.name)
    if not (stub / "inventory.img").is_file():
        raise SnapshotError(f"{images} has no inventory.img: it is not a dump of CRIU's.")


def keep_level_files(level: Path) -> None:
    """Remove from a pre-dump's directory what a parent level does not need (its own
    ``parent`` link included: :func:`attach` makes it again)."""
    for path in level.iterdir():
        if path.is_symlink() or (path.is_file() and not is_level_file(path.name)):
            path.unlink()


def attach(images: Path, level: Path) -> None:
    """Make ``level`` (a directory on the same file system) the parent of ``images``,
    replacing CRIU's ``parent`` symlink: moved there, no copy."""
    link = images / PARENT
    if link.is_symlink():
        link.unlink()
    elif link.exists():
        raise SnapshotError(f"{link} exists already.")
    level.rename(link)


def link_parent(images: Path, parent_images: Path, files: Iterable[str]) -> None:
    """Make ``images/parent`` hold hard links to the parent snapshot's level files
    ``files`` (paths relative to the parent's ``images`` directory, as its manifest
    lists them, its own ``parent/...`` chain included)."""
    link = images / PARENT
    if link.is_symlink():
        link.unlink()
    for rel in files:
        target = link / rel
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.link(parent_images / rel, target)


def level_files_of(manifest: Manifest) -> list[str]:
    """The files of a snapshot that its child's chain links: its level files and its own
    parent levels, relative to its ``images`` directory."""
    prefix = f"{IMAGES_DIR}/"
    found = []
    for entry in manifest.files:
        if not entry.path.startswith(prefix):
            continue
        rel = entry.path[len(prefix) :]
        name = rel.rsplit("/", 1)[-1]
        if (rel.startswith(f"{PARENT}/") or "/" not in rel) and is_level_file(name):
            found.append(rel)
    return found


def parent_entries(parent: Manifest, under: str = f"{IMAGES_DIR}/{PARENT}") -> dict[str, FileEntry]:
    """The manifest entries of the parent's level files as the child lists them: the
    parent's own entries (size, sha256, chunks), at their path under ``under``."""
    prefix = f"{IMAGES_DIR}/"
    entries = {e.path: e for e in parent.files}
    out = {}
    for rel in level_files_of(parent):
        entry = entries[prefix + rel]
        path = f"{under}/{rel}"
        out[path] = FileEntry(path, entry.size, entry.sha256, entry.chunks)
    return out


@dataclass(frozen=True)
class ChainStats:
    """A snapshot's chain of memory levels: how many, and how their bytes split."""

    levels: int
    pages_bytes: int
    """Every level's pages files together (what a restore from a store downloads)."""
    top_bytes: int
    """The newest level's pages files (what this snapshot itself added)."""


def chain_stats(manifest: Manifest) -> ChainStats:
    """The chain of ``manifest``'s snapshot, from its file list."""
    return _stats((entry.path, entry.size) for entry in manifest.files)


def chain_stats_of(snapshot_dir: Path) -> ChainStats:
    """The chain of a snapshot directory being assembled, from its files."""
    root = snapshot_dir / IMAGES_DIR
    return _stats(
        (path.relative_to(snapshot_dir).as_posix(), path.stat().st_size)
        for path in root.rglob("pages-*.img")
    )


def _stats(files: Iterable[tuple[str, int]]) -> ChainStats:
    depth = total = top = 0
    prefix = f"{IMAGES_DIR}/"
    for path, size in files:
        if not path.startswith(prefix):
            continue
        parts = path[len(prefix) :].split("/")
        if not parts[-1].startswith("pages-"):
            continue
        level = sum(1 for part in parts[:-1] if part == PARENT)
        depth = max(depth, level)
        total += size
        if level == 0:
            top += size
    return ChainStats(levels=depth + 1, pages_bytes=total, top_bytes=top)
