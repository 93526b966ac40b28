"""What a dump must know of the kernel's process tree besides its memory.

CRIU saves the tree's memory and its open files' state, but a restore elsewhere needs
more: the /dev/shm files the tree holds (copied into the snapshot while it is frozen),
the regular files it needs at the same path, the ports it listens on, the directories of
its unix sockets, and its TCP connections (kept inside the tree with TCP repair, closed
toward outside peers). The tree is looked at once the wrapper has disconnected from it,
just before ``criu dump``, which fixes the images accordingly (core/criu/images.py).
"""

from __future__ import annotations

import dataclasses

from jupyter_ext.core import proctree
from jupyter_ext.core.carried import appended, netports, shmfiles, sockdiag, tcpconns
from jupyter_ext.core.criu.options import GHOST_LIMIT_MAX
from jupyter_ext.core.errors import SnapshotError
from jupyter_ext.core.humanize import human_bytes


@dataclasses.dataclass
class KernelTree:
    """The kernel's process tree under ``root`` as the dump finds it: what the snapshot
    must carry, or say, about its files, ports and connections."""

    root: int
    pids: list[int]
    held: shmfiles.HeldFiles
    """The /dev/shm files the tree holds, held open until the dump is over."""
    needed: list[dict[str, object]]
    ports: list[netports.BoundPort]
    socket_dirs: list[str]
    connections: tcpconns.TreeConnections
    keep_tcp: bool
    """Connections inside the tree keep their state (TCP repair, where the CRIU that dumps
    it can: :meth:`Criu.keeps_tcp`)."""
    appended_files: list[dict[str, object]]
    """The open files the tree appends to (logs), each with its ``openers``: carried in
    the snapshot as they were (core/carried/appended.py)."""
    ghost_bytes: int
    """The largest deleted file the tree holds (CRIU saves it in the images): the dump's
    ``--ghost-limit`` (:func:`ghost_limit`)."""

    @classmethod
    def inspect(cls, root: int, keeps_tcp: bool) -> KernelTree:
        """Look at the tree (its /dev/shm files are held open from now on: ``held``);
        ``keeps_tcp``: whether the CRIU that dumps it can keep connections."""
        pids = proctree.descendants(root)
        held = shmfiles.hold_tree_files(pids)
        try:
            needed = [f for f in proctree.needed_files(pids) if f["path"] not in held.paths]
            appended_files = appended.appended(needed)
            needed = [
                {k: v for k, v in f.items() if k not in appended.DUMP_ONLY_KEYS} for f in needed
            ]
            ghost_bytes = ghost_limit(proctree.deleted_files(pids))
            sockets = sockdiag.TreeSockets.of(pids)
            ports = netports.bound_ports(sockets, root)
            socket_dirs = netports.unix_socket_dirs(root, sockets.inodes)
            connections = tcpconns.tree_connections(pids, sockets)
        except BaseException:
            held.close()
            raise
        keep_tcp = bool(connections.inside) and keeps_tcp
        return cls(
            root,
            pids,
            held,
            needed,
            ports,
            socket_dirs,
            connections,
            keep_tcp,
            appended_files,
            ghost_bytes,
        )

    def kept_connections(self) -> list[tcpconns.Connection]:
        """The connections a restore brings back alive (both ends in the tree)."""
        return self.connections.inside if self.keep_tcp else []

    def closed_connections(self) -> list[tcpconns.Connection]:
        """The connections a restore brings back closed."""
        return self.connections.outside + ([] if self.keep_tcp else self.connections.inside)


def ghost_limit(files: list[proctree.DeletedFile]) -> int:
    """CRIU's ``--ghost-limit`` for a tree holding these deleted files: as large as the
    largest (a bound where its size cannot be read), at most :data:`GHOST_LIMIT_MAX`. A file
    known to be larger is refused here, named with its size, before CRIU runs."""
    too_big = [f for f in files if f.exact and f.size > GHOST_LIMIT_MAX]
    if too_big:
        largest = max(too_big, key=lambda f: f.size)
        raise SnapshotError(
            f"The kernel holds a deleted file larger than a snapshot can carry: {largest.path}, "
            f"{human_bytes(largest.size)} ({largest.size} bytes; the limit is {GHOST_LIMIT_MAX}"
            " bytes: such files are saved in the snapshot whole).",
            hint="Close the file in the kernel (or make it smaller), then snapshot again.",
        )
    return min(max((f.size for f in files), default=0), GHOST_LIMIT_MAX)
