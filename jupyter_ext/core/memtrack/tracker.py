"""The tracker of one kernel process, held outside it (by its wrapper).

It holds the kernel's asynchronous write-protect userfaultfd (:mod:`.uffd`) and, before
each dump, registers the private anonymous mappings the kernel made since the last one
(a new mapping is not protected yet: it counts as written, so it is dumped whole). What
it does not register (file mappings, shared memory, device memory, mappings another
userfaultfd holds) is always reported written: nothing untracked is ever taken from a
parent snapshot. The memory is protected only while a snapshot runs (:meth:`protect`,
then what differs from the parent snapshot by content is unprotected: :mod:`.digests`);
CRIU reads the written bits and protects the pages again at each of its runs
(scripts/criu-patches/0001); :meth:`release` unprotects everything after.
"""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass
from pathlib import Path

from .. import proctree
from . import uffd
from .digests import DENSE_PAGES, HUGE_PAGE, Changes, PageDigests, changed_runs

#: Mapping names that are anonymous memory (glibc and the kernel name some of theirs).
_ANONYMOUS_NAMES = ("[heap]", "[stack]", "[anon:")

#: How often a changed run the process remaps meanwhile is tried (:meth:`unprotect`).
_UNPROTECT_TRIES = 4


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


class MemoryTracker:
    """Write tracking of process ``pid``'s memory through ``fd``, its userfaultfd (this
    process's copy), during each of its snapshots (:mod:`.digests`: between them nothing
    is protected). Close it when the process is gone or will no longer be dumped."""

    def __init__(self, pid: int, fd: int) -> None:
        self.pid = pid
        self.fd = fd
        self.started = proctree.start_time(pid)
        self.ranges: list[tuple[int, int]] = []
        """The mappings registered at the last :meth:`register_new`."""
        self.registered = 0
        """Bytes of the process's memory registered at the last :meth:`register_new`."""
        self.untracked = 0
        """Bytes of private anonymous memory the kernel refused to register."""
        self.split: set[int] = set()
        """Huge-page blocks split in this snapshot: where the process wrote while they
        were protected, or :meth:`protect` unprotected a few of their pages."""
        self.whole: set[int] = set()
        """Huge-page blocks :meth:`protect` unprotected whole (never split)."""
        self.protected = False
        """Whether the memory was protected since the last :meth:`release` (by
        :meth:`protect`, or by a CRIU run: :meth:`criu_runs`)."""

    @classmethod
    def take(cls, pid: int, fd_in_process: int) -> MemoryTracker:
        """The tracker of ``pid`` from its descriptor ``fd_in_process`` (which the process
        opened with :func:`uffd.open_tracking_fd`; it must close its own copy after)."""
        return cls(pid, uffd.take_fd(pid, fd_in_process))

    def same_process(self) -> bool:
        """Whether ``pid`` is still the process this tracker was made for."""
        return bool(self.started) and proctree.start_time(self.pid) == self.started

    def register_new(self) -> None:
        """Register every private anonymous mapping of the process (those registered
        before are skipped by the kernel). Call it before each dump."""
        ranges, untracked = [], 0
        for mapping in read_maps(self.pid):
            if not mapping.private_anonymous:
                continue
            size = mapping.end - mapping.start
            if uffd.register(self.fd, mapping.start, size):
                ranges.append((mapping.start, mapping.end))
            else:
                untracked += size
        self.ranges = ranges
        self.registered = sum(end - start for start, end in ranges)
        self.untracked = untracked

    def protect(self, digests: PageDigests) -> Changes:
        """At the start of a snapshot built on the one ``digests`` describes: protect all
        registered memory, then unprotect what holds something else than that snapshot
        (a dump copies it). Returns what the comparison found. A range that cannot be
        protected (the process unmapped it meanwhile) stays written: copied."""
        self.split.clear()
        self.whole.clear()
        for start, end in self.ranges:
            with contextlib.suppress(uffd.TrackingUnavailable):
                uffd.protect(self.fd, start, end - start)
        changes = changed_runs(self.pid, digests)
        for start, end in changes.runs:
            self.unprotect(start, end)
        self.split.update(changes.split)
        self.whole = changes.whole
        self.protected = True
        return changes

    def unprotect(self, start: int, end: int) -> None:
        """Unprotect a changed run. The process runs meanwhile: where it unmapped a part
        and mapped something else there (a new mapping is not registered, so Linux refuses
        the range: ENOENT), what is still protected in the run is unprotected piece by
        piece. Fails loudly where that does not settle: else a changed page is lost."""
        for _ in range(_UNPROTECT_TRIES):
            try:
                uffd.unprotect(self.fd, start, end - start)
                return
            except uffd.TrackingUnavailable as exc:
                if exc.errno != errno.ENOENT:
                    raise
            try:
                for piece_start, piece_end, _ in uffd.protected_ranges(self.pid, start, end):
                    uffd.unprotect(self.fd, piece_start, piece_end - piece_start)
                return
            except uffd.TrackingUnavailable as exc:
                if exc.errno != errno.ENOENT:
                    raise
        raise uffd.TrackingUnavailable(
            errno.ENOENT, f"the process keeps remapping {start:#x}-{end:#x} while compared"
        )

    def criu_runs(self) -> None:
        """A tracked CRIU run starts: it protects what it copies (writes after it split
        huge pages); what was written while protected before it is noted first."""
        self._note_split()
        self.protected = True

    def release(self) -> list[int]:
        """The snapshot over (sealed or not): unprotect everything, so that the process
        writes without faults until the next one. Returns the huge-page blocks it wrote
        densely while protected (Linux split them to take the faults): its agent
        collapses them again (``MADV_COLLAPSE``)."""
        self._note_split()
        self.protected = False
        for start, end in self.ranges:
            with contextlib.suppress(uffd.TrackingUnavailable):
                uffd.unprotect(self.fd, start, end - start)
        split = sorted(self.split - self.whole)
        self.split.clear()
        return split

    def pending_bytes(self) -> int:
        """Bytes a dump would copy now: private memory written since the last protection
        (or never tracked)."""
        runs = uffd.written_ranges(self.pid)
        return sum(end for _, end in runs) - sum(start for start, _ in runs)

    def _note_split(self) -> None:
        """Note the blocks the process wrote densely while protected (since the last
        protection): Linux split their huge pages to take the faults."""
        if not self.protected:
            return
        try:
            written = uffd.written_tracked_ranges(self.pid)
        except (uffd.TrackingUnavailable, OSError):
            return
        counts: dict[int, int] = {}  # bytes written, by block
        for start, end in written:
            block = start - start % HUGE_PAGE
            if end <= block + HUGE_PAGE:  # most runs: a writing kernel's are single pages
                counts[block] = counts.get(block, 0) + end - start
                continue
            at = start
            while at < end:
                block = at - at % HUGE_PAGE
                step = min(end, block + HUGE_PAGE)
                counts[block] = counts.get(block, 0) + step - at
                at = step
        dense = DENSE_PAGES * uffd.PAGE_SIZE
        self.split.update(block for block, done in counts.items() if done >= dense)

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
