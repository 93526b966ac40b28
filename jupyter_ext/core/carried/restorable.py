"""A dump's images made restorable elsewhere, after CRIU wrote them and before they are
hashed (or sealed by the node agent): what the snapshot carries besides memory changes
how some files and connections come back. Above both the image rewrites
(core/criu/images.py) and the connections (tcpconns.py), which reads those images."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from ..criu.images import open_external_files_by_fd
from . import tcpconns, waits


def fix_for_restore(images_dir: Path, open_by_fd: Collection[str], tcp_kept: bool) -> None:
    """The external files ``open_by_fd`` reopened through the descriptors a restore
    hands over, with ``tcp_kept`` the connections to peers outside the tree made closed
    (a restore keeps those inside), and timed waits the dump interrupted restarted
    (:mod:`.waits`)."""
    waits.restart_interrupted_waits(images_dir)
    if tcp_kept:
        tcpconns.close_outside_connections(images_dir)
    if open_by_fd:
        open_external_files_by_fd(images_dir, set(open_by_fd))
