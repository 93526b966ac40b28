"""CRIU's options that say how a dump and a restore treat what the kernel holds: its TCP
connections, its deleted files, the files handed over from this process."""

from __future__ import annotations

import os
from pathlib import Path


def unprivileged() -> bool:
    """Whether CRIU runs without root: then with ``--unprivileged`` on its file
    capabilities, and kernels have no PID or time namespace of their own (CRIU 4.2 cannot
    dump a task in another PID namespace without CAP_SYS_ADMIN; docs/nonroot.md)."""
    return os.geteuid() != 0


def mode_args() -> list[str]:
    """CRIU options for this process's privileges."""
    return ["--unprivileged"] if unprivileged() else []


#: How a dump treats the kernel's TCP connections. ``--tcp-close`` records them without
#: their state and leaves them alone: no repair mode, no network lock (so neither iptables
#: nor nftables nor CAP_NET_ADMIN), no packet dropped, the running kernel's connections
#: untouched; a restore (always ``--tcp-close``) gives them back closed, and clients
#: reconnect. Saving their state (``--tcp-established``) would need a lock and could only
#: bring a connection back where its peer still has it in the same state, never after the
#: kernel ran on. ``--skip-in-flight``: connections a listening socket has not accepted yet
#: are left out (the running kernel still accepts them), instead of failing the dump.
TCP_DUMP_OPTIONS = ("--tcp-close", "--skip-in-flight")


#: How a dump of a tree with connections between its own processes saves them (with root:
#: TCP repair needs CAP_NET_ADMIN): with their state, to come back established (the ones
#: with an outside peer are made closed in the images afterwards: core/carried/tcpconns.py). No
#: network lock: both ends of a kept connection are frozen, and what an outside peer sends
#: meanwhile reaches the running kernel (TCP repair mode loses no data); the copy of such a
#: connection in the snapshot is restored closed anyway. Measured: docs/network.md.
TCP_KEEP_DUMP_OPTIONS = ("--tcp-established", "--network-lock", "skip", "--skip-in-flight")


TCP_KEEP_RESTORE_OPTIONS = ("--tcp-established", "--network-lock", "skip")


#: CRIU's own ghost-file limit, the least a dump passes.
DEFAULT_GHOST_LIMIT = 1 << 20

#: The largest deleted file a dump may save (CRIU's ``--ghost-limit``): 1 TiB. A kernel
#: holding a larger one is refused before CRIU runs, naming the file (kernel_wrapper/dumptree.py).
GHOST_LIMIT_MAX = 1 << 40


def external_file_key(fd: int) -> str:
    """CRIU's key for the file open at ``fd`` of this process: ``file[MNT_ID:INODE]``."""
    mnt_id = -1
    for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("mnt_id:"):
            mnt_id = int(line.split()[1])
    return f"file[{mnt_id:x}:{os.fstat(fd).st_ino:x}]"
