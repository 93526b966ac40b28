"""What the out-of-memory killer did: the memory cgroup's ``oom_kill`` counter and limit
(cgroup v2 ``memory.events`` / ``memory.max``, v1 ``memory.oom_control`` /
``memory.limit_in_bytes``), and the kernel log's "Killed process" lines (``/dev/kmsg``,
readable with root or CAP_SYSLOG where ``dmesg_restrict`` is 1).

A process the OOM killer chose is counted in its own memory cgroup's ``oom_kill``,
whichever limit was hit (the cgroup's, a parent's or the machine's), and named with its
memory in the kernel log.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path

#: Limits at or above this are "no limit" (cgroup v1 writes 2**63 - 4096).
_NO_LIMIT = 1 << 62
_KILLED = re.compile(
    r"Killed process (?P<pid>\d+) \((?P<name>[^)]*)\).*?anon-rss:(?P<anon>\d+)kB, "
    r"file-rss:(?P<file>\d+)kB, shmem-rss:(?P<shmem>\d+)kB"
)


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, file system type, options) of the cgroup mounts."""
    found = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 4 and fields[2] in ("cgroup", "cgroup2"):
                found.append((fields[1], fields[2], set(fields[3].split(","))))
    return found


@dataclass(frozen=True)
class MemoryCgroup:
    """The memory cgroup directory of a process, and which version it is."""

    path: Path
    v2: bool

    @classmethod
    def of(cls, pid: int) -> MemoryCgroup | None:
        """The memory cgroup ``pid`` is in, None if there is none this process can read."""
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            return None
        mounts = _mounts()
        for line in lines:
            hierarchy, controllers, path = line.split(":", 2)
            relative = path.lstrip("/")
            if hierarchy == "0" and not controllers:
                for point, kind, _ in mounts:
                    directory = Path(point) / relative
                    if kind == "cgroup2" and (directory / "memory.events").is_file():
                        return cls(directory, True)
            elif "memory" in controllers.split(","):
                for point, kind, options in mounts:
                    directory = Path(point) / relative
                    if kind == "cgroup" and "memory" in options and directory.is_dir():
                        return cls(directory, False)
        return None

    def _read(self, name: str) -> str | None:
        try:
            return (self.path / name).read_text()
        except OSError:
            return None

    def oom_kills(self) -> int | None:
        """How many of its processes the OOM killer has killed, None if unreadable."""
        text = self._read("memory.events" if self.v2 else "memory.oom_control")
        for line in (text or "").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
        return None

    def limit(self) -> int | None:
        """Its memory limit in bytes, None if it has none (or it cannot be read)."""
        text = (self._read("memory.max" if self.v2 else "memory.limit_in_bytes") or "").strip()
        if not text.isdigit() or int(text) >= _NO_LIMIT:
            return None
        return int(text)


@dataclass(frozen=True)
class KernelLogKill:
    """A "Killed process" line of the kernel log: whom the OOM killer killed, its memory
    then (resident: anonymous, file and shared memory), and when (CLOCK_MONOTONIC s)."""

    pid: int
    name: str
    rss_bytes: int
    at: float


def kernel_log_kills(since: float = 0.0) -> list[KernelLogKill] | None:
    """The OOM killer's kills the kernel log holds from ``since`` (CLOCK_MONOTONIC
    seconds, as :func:`time.monotonic`) on; None if the log cannot be read here."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    kills = []
    try:
        while True:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records overwritten while reading: go on
                    continue
                return None
            header, _, message = record.decode(errors="replace").partition(";")
            fields = header.split(",")
            match = _KILLED.search(message)
            if match is None or len(fields) < 3 or not fields[2].isdigit():
                continue
            at = int(fields[2]) / 1e6
            if at < since:
                continue
            rss_kib = sum(int(match[key]) for key in ("anon", "file", "shmem"))
            kills.append(KernelLogKill(int(match["pid"]), match["name"], rss_kib * 1024, at))
    finally:
        os.close(fd)
    return kills
