"""The tracker of one kernel process, held outside it (by its wrapper).

It holds the kernel's asynchronous write-protect userfaultfd (:mod:`.uffd`) and, before
each dump, registers the private anonymous mappings the kernel made since the last one
(a new mapping is not protected yet: it counts as written, so it is dumped whole). What
it does not register (file mappings, shared memory, device memory, mappings another
userfaultfd holds) is always reported written: nothing untracked is ever taken from a
parent snapshot. CRIU reads the written bits and protects the pages again at each dump
(scripts/criu-patches/0001).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from . import uffd

#: Mapping names that are anonymous memory (glibc and the kernel name some of theirs).
_ANONYMOUS_NAMES = ("[heap]", "[stack]", "[anon:")
#: A transparent huge page: the block healing works on.
HUGE_PAGE = 2 << 20
#: Written pages (of 512) that make a huge-page block worth healing: then it counts as
#: written whole (a dump copies at most 8 times what was written there).
HEAL_MIN_PAGES = 64


@dataclass(frozen=True)
class Mapping:
    """One line of /proc/PID/maps."""

    start: int
    end: int
    perms: str
    name: str

    @property
    def private_anonymous(self) -> bool:
        return self.perms[3] == "p" and (not self.name or self.name.startswith(_ANONYMOUS_NAMES))


def read_maps(pid: int) -> list[Mapping]:
    maps = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        maps.append(Mapping(start, end, fields[1], fields[5] if len(fields) > 5 else ""))
    return maps


def start_time(pid: int) -> int:
    """The process's start time (clock ticks since boot): a pid with another start time
    is another process."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[19])


class MemoryTracker:
    """Write tracking of process ``pid``'s memory through ``fd``, its userfaultfd (this
    process's copy). Close it when the process is gone or will no longer be dumped."""

    def __init__(self, pid: int, fd: int) -> None:
        self.pid = pid
        self.fd = fd
        self.started = start_time(pid)
        self.registered = 0
        """Bytes of the process's memory registered at the last :meth:`register_new`."""
        self.untracked = 0
        """Bytes of private anonymous memory the kernel refused to register."""
        self.healed: set[int] = set()
        """Huge-page blocks unprotected since the last dump (:meth:`heal`)."""

    @classmethod
    def take(cls, pid: int, fd_in_process: int) -> MemoryTracker:
        """The tracker of ``pid`` from its descriptor ``fd_in_process`` (which the process
        opened with :func:`uffd.open_tracking_fd`; it must close its own copy after)."""
        return cls(pid, uffd.take_fd(pid, fd_in_process))

    def same_process(self) -> bool:
        """Whether ``pid`` is still the process this tracker was made for."""
        try:
            return start_time(self.pid) == self.started
        except (OSError, ValueError, IndexError):
            return False

    def register_new(self) -> None:
        """Register every private anonymous mapping of the process (those registered
        before are skipped by the kernel). Call it before each dump."""
        registered = untracked = 0
        for mapping in read_maps(self.pid):
            if not mapping.private_anonymous:
                continue
            size = mapping.end - mapping.start
            if uffd.register(self.fd, mapping.start, size):
                registered += size
            else:
                untracked += size
        self.registered, self.untracked = registered, untracked

    def heal(self) -> list[int]:
        """Undo what protection costs the kernel where it writes much: a write to a
        protected transparent huge page makes Linux split it into 512 small pages, each
        protected (one fault each, and the processor's TLB then covers 1/512 as much
        memory: random access over such memory ran 1.7-2.7x slower here). Each 2 MiB
        block of which at least :data:`HEAL_MIN_PAGES` pages were written since the last
        dump is unprotected whole (it counts as written: always safe) so that it can be
        collapsed back into a huge page. Returns the blocks unprotected (once each until
        the next dump); the kernel process collapses them (``MADV_COLLAPSE``)."""
        counts: dict[int, int] = {}
        for start, end in uffd.written_ranges(self.pid):
            at = start
            while at < end:
                block = at - at % HUGE_PAGE
                step = min(end, block + HUGE_PAGE)
                counts[block] = counts.get(block, 0) + (step - at) // uffd.PAGE_SIZE
                at = step
        healed = []
        for block, pages in sorted(counts.items()):
            if pages < HEAL_MIN_PAGES or block in self.healed:
                continue
            try:
                uffd.unprotect(self.fd, block, HUGE_PAGE)
            except uffd.TrackingUnavailable:
                continue  # not all of it tracked (a mapping's edge, untracked memory)
            self.healed.add(block)
            healed.append(block)
        return healed

    def dumped(self) -> None:
        """A tracked CRIU run protects the written pages again, healed blocks too."""
        self.healed.clear()

    def pending_bytes(self) -> int:
        """Bytes a dump would copy now: private memory written since the last dump (or
        never tracked)."""
        return sum(end - start for start, end in uffd.written_ranges(self.pid))

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


def pinned_bytes(pid: int) -> int:
    """The process's memory pinned for devices or io_uring (``VmPin``): written by them
    without the page tables knowing, so it cannot be tracked. 0 when it cannot be read."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmPin:"):
                return int(line.split()[1]) * 1024
    return 0
