"""What a CRIU log says: how long the tree was frozen, the lines that explain a failure,
and that failure in words (message and hint)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import PortTakenError, SnapshotError
from ..humanize import human_bytes
from ..isolation.confinement import explain_denied

#: File capabilities with which an ordinary user runs the product's CRIU copy
#: (docs/nonroot.md, measured): CAP_CHECKPOINT_RESTORE opens /proc/PID/map_files and picks
#: the restored PIDs (clone3 set_tid); CAP_SETPCAP lets a restore trim the bounding set to
#: the image's. No CAP_SYS_PTRACE: the kernels are the user's own, ptrace needs none.
UNPRIVILEGED_CAPS = "cap_checkpoint_restore,cap_setpcap+ep"

#: CRIU's log level for dumps and pre-dumps: 3 (info) has every line this module reads
#: and every error. Level 4 adds lines for each run of pages, each one write(2) of its
#: own: a dump of a kernel whose writes were scattered logged 92,000 lines while frozen,
#: and the freeze fell from 295 to 169 ms without them (1 GiB kernel writing 100 MB/s).
DUMP_LOG_LEVEL = 3

_LOG_LINE = re.compile(rb"^\((\d+\.\d+)\) (.*)$")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def frozen_seconds(dump_log: Path) -> float:
    """How long a dump kept the tree frozen: from CRIU's first "Seized task" to its
    "Unfreezing tasks", read from the timestamps of the log (0.0 if they are missing).

    This is the kernel's real pause; the rest of ``criu dump`` runs beside the kernel.
    """
    seized: float | None = None
    try:
        with dump_log.open("rb") as log:
            for line in log:
                match = _LOG_LINE.match(line)
                if match is None:
                    continue
                if seized is None and match[2].startswith(b"Seized task"):
                    seized = float(match[1])
                elif seized is not None and match[2].startswith(b"Unfreezing tasks"):
                    return float(match[1]) - seized
    except OSError:
        pass
    return 0.0


_PAGEMAP_GENERATED = re.compile(rb"Pagemap generated: (\d+) pages")


def copied_bytes(dump_log: Path) -> int:
    """The bytes of memory a dump (or pre-dump) copied: the pages its pagemaps list as
    present in its own images ("Pagemap generated: N pages"), every process together. For
    a dump these were copied while the tree was frozen; a read-mode pre-dump copies them
    after."""
    total = 0
    try:
        with dump_log.open("rb") as log:
            for line in log:
                match = _PAGEMAP_GENERATED.search(line)
                if match is not None:
                    total += int(match[1]) * PAGE_SIZE
    except OSError:
        return 0
    return total


def log_excerpt(log_file: Path, output: str, limit: int = 20) -> str:
    """The lines of a CRIU log that explain a failure: its errors, and what led to them."""
    try:
        lines = log_file.read_text(errors="replace").splitlines()
    except OSError:
        lines = output.splitlines()
    picked = [line for line in lines if "Error" in line or "error" in line or "Warn" in line]
    if not picked:
        picked = lines[-limit:]
    return "\n".join(line.strip() for line in picked[-limit:])


# (pattern in the log, message, hint). A hint starting with "incompatible:" marks
# restore failures that come from the snapshot not fitting this machine.
_KNOWN_FAILURES: list[tuple[str, str, str]] = [
    (
        r"No space left|Disk quota exceeded",
        "CRIU could not write the dump: the disk is full (no space left on device).",
        "Free space on the disk of the work directory (work_dir), or move it to a larger disk.",
    ),
    (
        r"has bad size|bad mode|size mismatch",
        "A file the kernel had open has changed since the snapshot.",
        "incompatible:Restore the file to the state it had when the snapshot was taken, or "
        "take snapshots of kernels that do not keep growing files open.",
    ),
    (
        r"Can't stat mountpoint",
        "A mount of the kernel's mount namespace could not be made again here: the "
        "kernel's namespace is a copy of the server's as the kernel started, and a mount "
        "in it (a container's root or shared memory, a drive) changed while the restore "
        "ran.",
        "Retry the restore once no container starts or stops on this machine; the CRIU "
        "log lines below name the mount.",
    ),
    (
        r"Can't open (?:file|vma|mapping|fd).*No such file|No such file or directory",
        "A file the kernel had open at the snapshot is missing on this machine.",
        "incompatible:Make the file named in the log available at the same path, then restore.",
    ),
    (
        r"cpu(?:info)?.*(?:mismatch|not supported|compat)|CPU feature",
        "This machine's CPU lacks features the snapshot's CPU had.",
        "incompatible:Restore on a machine with the same (or a newer) CPU model.",
    ),
    (
        r"Connected TCP socket|In-flight connection|--tcp-close",
        "CRIU refused a TCP connection of the kernel; connections are saved closed (clients "
        "reconnect after a restore), which this CRIU did not do.",
        "Use the CRIU that 'jupyter snapshot doctor' finds (>= 4.2), which supports "
        "--tcp-close; restore snapshots with this product, not with a bare 'criu restore'.",
    ),
    (
        r"corked dgram socket",
        "The kernel holds a UDP socket with corked data not sent yet (UDP_CORK), which "
        "cannot be saved.",
        "Uncork the socket (setsockopt UDP_CORK 0) or close it, then retry.",
    ),
    (
        r"half of stream unix|unix.*external|External socket",
        "The kernel holds a unix socket connected to a process outside it.",
        "Close connections to outside processes (for example a connection to a local "
        "database server) before taking a snapshot.",
    ),
    (
        r"Can't dump.*device|Unsupported .* device|can't dump.*chrdev|Unsupported chr",
        "The kernel holds a device file CRIU cannot save.",
        "Close the device (for example a GPU opened without CUDA checkpoint support).",
    ),
    (
        r"Can't create a directory|can't get /proc fd",
        "CRIU could not make its private /proc (proc.crtools) in the kernel's working directory.",
        "Make sure the kernel's working directory is writable and holds no 'proc.crtools' "
        "left by another tool, then retry.",
    ),
    (
        r"Address already in use",
        "A network port the kernel had bound (a listening TCP socket or a UDP socket) is "
        "taken on this machine.",
        "incompatible:Stop the process that uses the port (the CRIU log names the socket), "
        "or close listening sockets in the kernel before taking snapshots.",
    ),
    (
        r"Can't .*pid.*busy|PID .* is busy|pid .* is in use",
        "A process id the snapshot needs is taken on this machine.",
        "Retry; restores run in a fresh PID namespace, so this points to a CRIU problem.",
    ),
    (
        r"needs to have the CAP_SYS_ADMIN or the CAP_CHECKPOINT_RESTORE|Effective capability "
        r"\d+ missing",
        "CRIU runs without the privileges it needs: not as root, and its binary lacks the "
        "file capabilities of non-root mode.",
        f"As root: setcap {UNPRIVILEGED_CAPS} on the product's CRIU copy "
        "(scripts/install-criu.sh does it, for the group jupyter-snapshots), or run Jupyter "
        "as root; 'jupyter snapshot doctor' names what is missing (docs/nonroot.md).",
    ),
    (
        r"Can't fork for \d+: File exists",
        "A process id the snapshot's kernel had is in use on this machine. Without root a "
        "restored kernel keeps its process ids (it has no PID namespace of its own), so "
        "two kernels restored from one snapshot cannot run side by side, and on another "
        "machine or pod another process may hold one of them.",
        "Shut down the kernel that holds the id (the kernel this snapshot was taken from, "
        "or another copy of it) and retry; elsewhere, retry once the process holding it "
        "has ended (restore into a fresh pod before starting new kernels there); or run "
        "Jupyter as root, where every restored kernel gets its own PID namespace "
        "(docs/nonroot.md).",
    ),
    (
        r"Operation not permitted|EPERM|Permission denied",
        "CRIU lacked a privilege it needs.",
        "Run 'jupyter snapshot doctor': without root, CRIU needs the file capabilities "
        f"{UNPRIVILEGED_CAPS} on the product's CRIU copy (sudo scripts/install-criu.sh), "
        "and a snapshot taken by root (in a PID namespace) restores only as root.",
    ),
]


#: CRIU's log line of a restore that could not bind a socket: its port is another's.
_PORT_TAKEN = re.compile(r"Can't bind .*socket.*Address already in use")


def port_taken(error: SnapshotError) -> bool:
    """Whether a restore failed because a port the snapshot binds is taken here."""
    return isinstance(error, PortTakenError) or bool(_PORT_TAKEN.search(error.log_excerpt))


#: CRIU's refusal of a deleted file larger than ``--ghost-limit``: its path and size.
_GHOST_TOO_BIG = re.compile(r"Can't dump ghost file (\S+) of (\d+) size")

#: Error lines CRIU prints on success too; they explain nothing.
_HARMLESS = re.compile(r"RLIMIT_NOFILE|Can't keep kdat cache|location for kerndat file")


#: Log lines of a CRIU that the kernel refused something: the confinement of this process
#: (seccomp, no_new_privs, bounding set, Yama) is then the first suspect.
_DENIED = re.compile(
    r"Operation not permitted|EPERM|Permission denied|suspending seccomp|Can't attach|"
    r"Unable to interrupt|needs to have the CAP_SYS_ADMIN or the CAP_CHECKPOINT_RESTORE"
)


def explain_failure(
    excerpt: str, *, restoring: bool, unprivileged: bool | None = None
) -> tuple[str, str]:
    """A plain message and hint for a failed dump or restore, from its log excerpt
    (``unprivileged``: whether CRIU ran without root; default: whether this process does)."""
    if unprivileged is None:
        unprivileged = os.geteuid() != 0
    meaningful = "\n".join(line for line in excerpt.splitlines() if not _HARMLESS.search(line))
    ghost = _GHOST_TOO_BIG.search(meaningful)
    if ghost:
        return (
            f"The kernel holds a deleted file ({ghost[1]}, {human_bytes(int(ghost[2]))}) "
            "larger than the limit for such files the dump gave CRIU (--ghost-limit, the "
            "largest deleted file the kernel held just before the dump: this one grew).",
            "Take the snapshot again once the kernel's files stop growing.",
        )
    if _DENIED.search(meaningful):
        denied = explain_denied(meaningful, unprivileged=unprivileged, restoring=restoring)
        if denied is not None:
            return denied
    for pattern, message, hint in _KNOWN_FAILURES:
        if re.search(pattern, meaningful, re.IGNORECASE):
            return message, hint
    if restoring:
        return (
            "CRIU could not restore the snapshot.",
            "Read the CRIU log lines below; 'jupyter snapshot doctor' checks this machine.",
        )
    return (
        "CRIU could not dump the kernel.",
        "Read the CRIU log lines below; 'jupyter snapshot doctor' checks this machine.",
    )
