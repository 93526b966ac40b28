"""How many more bytes of page cache may be dirtied before Linux makes writers wait.

A process that writes files while the page cache holds more dirty pages than the
"free-run" ceiling (halfway between the background and the hard dirty limits) is made to
wait for the disk in ``balance_dirty_pages``. A snapshot's freeze writes images; it must
not be that writer. Pre-copy rounds write most of a kernel's memory just before the
freeze, so the wrapper writes their files to disk first only where what they left dirty
would bring the freeze's own writes past that ceiling (syncing a round costs the kernel
a longer round, during which it writes more that the freeze must copy).

Two domains limit a writer (``mm/page-writeback.c``): the whole machine's, and its
memory cgroup's (cgroup v2 with a ``memory.max``: the cgroup's file pages plus its
headroom are what may be dirtied). The smaller room counts. The machine's limits are the
kernel's own, as ``/proc/vmstat`` reports them (``global_dirty_limits``, worked out when
the file is read); a cgroup's are not published, so they are worked out here the way
``domain_dirty_limits`` does. Read from ``/proc`` and ``/sys/fs/cgroup`` (a few small
files: cheap enough to ask before every freeze).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

PAGE = 4096
#: What a freeze writes besides memory pages (the process's other images), and slack
#: for the estimate of the kernel's reserve pages.
SLACK_BYTES = 64 << 20


def _meminfo(proc: Path) -> dict[str, int]:
    """/proc/meminfo in bytes."""
    values: dict[str, int] = {}
    for line in (proc / "meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            values[name] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return values


def _vmstat(proc: Path) -> dict[str, int]:
    """/proc/vmstat (counts of pages)."""
    values: dict[str, int] = {}
    for line in (proc / "vmstat").read_text().splitlines():
        name, _, value = line.partition(" ")
        if value.strip().isdigit():
            values[name] = int(value)
    return values


def _sysctl(proc: Path, name: str) -> int:
    return int((proc / "sys" / "vm" / name).read_text())


def _free_run_ceiling(proc: Path, dirtyable: int, global_dirtyable: int) -> int:
    """Below this many dirty bytes a domain whose writers may dirty ``dirtyable`` bytes
    is not throttled (``domain_dirty_limits``; byte settings scale to a cgroup as the
    ratio they are of the whole machine's)."""

    def limit(ratio_name: str, bytes_name: str) -> int:
        absolute = _sysctl(proc, bytes_name)
        if absolute:
            return absolute * dirtyable // max(global_dirtyable, 1)
        return _sysctl(proc, ratio_name) * dirtyable // 100

    hard = limit("dirty_ratio", "dirty_bytes")
    background = limit("dirty_background_ratio", "dirty_background_bytes")
    if background >= hard:
        background = hard // 2
    return (hard + background) // 2


def _cgroup_room(proc: Path, cgroup_root: Path, global_dirtyable: int) -> int | None:
    """The room in this process's cgroup v2 memory domain, None where no ancestor limits
    its memory (or cgroup v2 is not mounted with the memory controller)."""
    path = ""
    with contextlib.suppress(OSError):
        for line in (proc / "self" / "cgroup").read_text().splitlines():
            if line.startswith("0::"):
                path = line[3:].strip().lstrip("/")
    own = cgroup_root / path if path else cgroup_root
    if not (own / "memory.stat").is_file():
        return None
    headroom: int | None = None
    directory = own
    while True:
        with contextlib.suppress(OSError, ValueError):
            limit = (directory / "memory.max").read_text().strip()
            if limit != "max":
                used = int((directory / "memory.current").read_text())
                room = max(int(limit) - used, 0)
                headroom = room if headroom is None else min(headroom, room)
        if directory == cgroup_root or directory.parent == directory:
            break
        directory = directory.parent
    if headroom is None:
        return None
    stat: dict[str, int] = {}
    for line in (own / "memory.stat").read_text().splitlines():
        name, _, value = line.partition(" ")
        if value.strip().isdigit():
            stat[name] = int(value)
    dirtyable = stat.get("file", 0) + headroom
    dirty = stat.get("file_dirty", 0) + stat.get("file_writeback", 0)
    return _free_run_ceiling(proc, dirtyable, global_dirtyable) - dirty


def unthrottled_bytes(
    proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> int:
    """How many more bytes this process may dirty before Linux throttles its writes
    (negative when it already would), less :data:`SLACK_BYTES`."""
    vmstat = _vmstat(proc)
    ceiling = (vmstat["nr_dirty_threshold"] + vmstat["nr_dirty_background_threshold"]) // 2
    room = (ceiling - vmstat["nr_dirty"] - vmstat["nr_writeback"]) * PAGE
    info = _meminfo(proc)
    dirtyable = info.get("MemFree", 0) + info.get("Active(file)", 0) + info.get("Inactive(file)", 0)
    cgroup = _cgroup_room(proc, cgroup_root, dirtyable)
    if cgroup is not None:
        room = min(room, cgroup)
    return room - SLACK_BYTES
