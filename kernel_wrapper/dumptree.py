"""What a dump must know of the kernel's process tree besides its memory.

CRIU saves the tree's memory and its open files' state, but a restore elsewhere needs
more: the /dev/shm files the tree holds (copied into the snapshot while it is frozen),
the regular files it needs at the same path, the ports it listens on, the directories of
its unix sockets, and its TCP connections (kept inside the tree with TCP repair, closed
toward outside peers). The tree is looked at once the wrapper has disconnected from it,
just before ``criu dump``; the images are fixed accordingly just after.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from jupyter_ext.core import proctree
from jupyter_ext.core.carried import appended, netports, shmfiles, sockdiag, tcpconns
from jupyter_ext.core.criu import images as criuimages
from jupyter_ext.core.criu import unprivileged


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
    """Connections inside the tree keep their state (needs TCP repair: root)."""
    appended_files: list[dict[str, object]]
    """The open files the tree appends to (logs), each with its ``opener``: carried in
    the snapshot as they were (core/carried/appended.py)."""
    ghost_bytes: int
    """The largest deleted file the tree holds (CRIU saves it in the images)."""

    @classmethod
    def inspect(cls, root: int) -> KernelTree:
        """Look at the tree (its /dev/shm files are held open from now on: ``held``)."""
        pids = proctree.descendants(root)
        held = shmfiles.hold_tree_files(pids)
        try:
            needed = [f for f in proctree.needed_files(pids) if f["path"] not in held.paths]
            appended_files = appended.appended(needed)
            needed = [{k: v for k, v in f.items() if k != "opener"} for f in needed]
            ghost_bytes = proctree.largest_deleted_file(pids)
            inodes = sockdiag.tree_socket_inodes(pids)
            ports = netports.bound_ports(inodes, root)
            socket_dirs = netports.unix_socket_dirs(root, inodes)
            connections = tcpconns.tree_connections(pids)
        except BaseException:
            held.close()
            raise
        keep_tcp = bool(connections.inside) and not unprivileged()
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

    async def fix_images(self, images: Path) -> None:
        """After the dump: connections to outside peers come back closed; the held
        /dev/shm files are opened by descriptor (the snapshot carries them)."""
        if self.keep_tcp:
            await asyncio.to_thread(tcpconns.close_outside_connections, images)
        if self.held.files:
            await asyncio.to_thread(
                criuimages.open_external_files_by_fd, images, set(self.held.keys)
            )
