"""The Linux interfaces of memory tracking: asynchronous write-protect userfaultfds and
``PAGEMAP_SCAN`` (Linux >= 6.7), through ctypes.

A userfaultfd acts on the memory of the process that opened it, whoever holds it later:
the kernel process opens one (:func:`open_tracking_fd`, no privilege needed with
``UFFD_USER_MODE_ONLY``), the wrapper takes it (:func:`take_fd`, ``pidfd_getfd``) and
registers the kernel's anonymous memory through it (:func:`register`). A write to a
protected page then only clears the page's write-protect bit (``UFFD_FEATURE_WP_ASYNC``:
no fault reaches anyone), which ``PAGEMAP_SCAN`` reports as ``PAGE_IS_WRITTEN``, and
CRIU (with the project's patch, scripts/criu-patches/) dumps only those pages and
protects them again. The registration lives as long as some process holds the
descriptor; when the last copy closes, the kernel forgets it (nothing in the tracked
process changes).
"""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path
from typing import Any

NR_USERFAULTFD = 323
NR_PIDFD_OPEN = 434
NR_PIDFD_GETFD = 438
UFFD_USER_MODE_ONLY = 1
UFFD_API = 0xAA
UFFDIO_API = 0xC018AA3F
UFFDIO_REGISTER = 0xC020AA00
UFFDIO_WRITEPROTECT = 0xC018AA06
UFFDIO_REGISTER_MODE_WP = 1 << 1
UFFDIO_WRITEPROTECT_MODE_WP = 1 << 0
UFFD_FEATURE_WP_UNPOPULATED = 1 << 13
UFFD_FEATURE_WP_ASYNC = 1 << 15
#: What a tracking descriptor asks for: writes resolved by the kernel itself, and
#: protection of unpopulated ranges (PAGEMAP_SCAN write-protects only where it is on).
TRACKING_FEATURES = UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED

PAGEMAP_SCAN = 0xC0606610
PM_SCAN_WP_MATCHING = 1 << 0
PAGE_IS_WPALLOWED = 1 << 0
PAGE_IS_WRITTEN = 1 << 1
PAGE_IS_FILE = 1 << 2
PAGE_IS_PRESENT = 1 << 3
PAGE_IS_SWAPPED = 1 << 4
PAGE_IS_PFNZERO = 1 << 5
PAGE_IS_HUGE = 1 << 6
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
#: The top of a 64-bit x86/arm64 process's user address space (scans stop there; memory
#: above it exists only where a process asked for it on 5-level page tables).
TASK_SIZE = (1 << 47) - PAGE_SIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class TrackingUnavailable(OSError):
    """The kernel (or a seccomp filter) refuses what tracking needs."""


def _check(result: int, what: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise TrackingUnavailable(code, f"{what}: {os.strerror(code)}")
    return result


def _ioctl(fd: int, request: int, arg: Any) -> int:
    """``ioctl(fd, request, arg)``, ``arg`` a ctypes array or pointer."""
    return _check(_libc.ioctl(fd, ctypes.c_ulong(request), arg), f"ioctl {request:#x}")


def open_tracking_fd() -> int:
    """In the process to be tracked: a new asynchronous write-protect userfaultfd for its
    own memory (close-on-exec, non-blocking). Raises TrackingUnavailable where the kernel
    is older than 6.7 or a seccomp filter blocks ``userfaultfd``."""
    fd = _check(
        _libc.syscall(NR_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK | UFFD_USER_MODE_ONLY),
        "userfaultfd",
    )
    api = (ctypes.c_uint64 * 3)(UFFD_API, TRACKING_FEATURES, 0)
    try:
        _ioctl(fd, UFFDIO_API, api)
    except BaseException:
        os.close(fd)
        raise
    return fd


#: Why a process under a seccomp filter gets no userfaultfd (docs/agent.md).
SECCOMP_REFUSES = (
    "a seccomp filter refuses the userfaultfd call here (the RuntimeDefault profiles of "
    "containerd, CRI-O, podman and Docker refuse it to every container)"
)


def why_unavailable(exc: TrackingUnavailable) -> str:
    """Why :func:`open_tracking_fd` failed in this process, in words."""
    opening = str(exc.strerror).startswith("userfaultfd")
    if opening and exc.errno in (errno.EPERM, errno.EACCES, errno.ENOSYS) and _filtered():
        return SECCOMP_REFUSES
    if opening and exc.errno == errno.ENOSYS:
        return "this Linux kernel has no userfaultfd (CONFIG_USERFAULTFD)"
    if not opening and exc.errno == errno.EINVAL:
        return "this Linux kernel's userfaultfd has no asynchronous write-protection (< 6.7)"
    return str(exc.strerror)


def _filtered() -> bool:
    """Whether this process runs under a seccomp filter."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    return any(line.split() == ["Seccomp:", "2"] for line in status.splitlines())


def take_fd(pid: int, target_fd: int) -> int:
    """A copy of descriptor ``target_fd`` of process ``pid`` (``pidfd_getfd``: the caller
    may ptrace ``pid``, as the wrapper may its kernel)."""
    pidfd = _check(_libc.syscall(NR_PIDFD_OPEN, pid, 0), "pidfd_open")
    try:
        return _check(_libc.syscall(NR_PIDFD_GETFD, pidfd, target_fd, 0), "pidfd_getfd")
    finally:
        os.close(pidfd)


def register(fd: int, start: int, length: int) -> bool:
    """Register a range for write-protect tracking; False where the kernel refuses that
    kind of mapping (device memory, a range another userfaultfd holds): it then stays
    untracked, so always reported written."""
    reg = (ctypes.c_uint64 * 4)(start, length, UFFDIO_REGISTER_MODE_WP, 0)
    try:
        _ioctl(fd, UFFDIO_REGISTER, reg)
    except TrackingUnavailable as exc:
        if exc.errno in (errno.EINVAL, errno.EBUSY, errno.EPERM, errno.ENOMEM):
            return False
        raise
    return True


def unprotect(fd: int, start: int, length: int) -> None:
    """Drop the write-protection of a range: its pages then count as written until CRIU
    protects them again (always safe: it only makes a dump copy more)."""
    wp = (ctypes.c_uint64 * 3)(start, length, 0)
    _ioctl(fd, UFFDIO_WRITEPROTECT, wp)


def protect(fd: int, start: int, length: int) -> None:
    """Write-protect a registered range: its pages count as not written from now on,
    until the process writes them (or :func:`unprotect`)."""
    wp = (ctypes.c_uint64 * 3)(start, length, UFFDIO_WRITEPROTECT_MODE_WP)
    _ioctl(fd, UFFDIO_WRITEPROTECT, wp)


class ScanArg(ctypes.Structure):
    """struct pm_scan_arg (include/uapi/linux/fs.h)."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in [
            "size",
            "flags",
            "start",
            "end",
            "walk_end",
            "vec",
            "vec_len",
            "max_pages",
            "category_inverted",
            "category_mask",
            "category_anyof_mask",
            "return_mask",
        ]
    ]


def scan(
    pid: int,
    *,
    inverted: int,
    mask: int,
    anyof: int,
    returned: int,
    start: int = 0,
    end: int = TASK_SIZE,
) -> list[tuple[int, int, int]]:
    """``PAGEMAP_SCAN`` of ``pid``'s pages from outside: the (start, end, categories)
    runs whose categories in ``mask`` (less those ``inverted``) are all set and that have
    one of ``anyof``, with their categories in ``returned``. Protects nothing. Raises
    TrackingUnavailable without PAGEMAP_SCAN."""
    slots = 4096
    vec = (ctypes.c_uint64 * (3 * slots))()
    # Read as one list per call, not element by element: a writing kernel's scan returns
    # tens of thousands of runs, and indexing them one by one cost about as much as the
    # kernel's walk (a 1 GiB kernel, 22,000 runs: 16 ms -> 11 ms, the ioctls 7 ms).
    words = memoryview(vec).cast("B").cast("Q")
    found: list[tuple[int, int, int]] = []
    fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    try:
        while start < end:
            arg = ScanArg(
                ctypes.sizeof(ScanArg),
                0,
                start,
                end,
                0,
                ctypes.addressof(vec),
                slots,
                0,
                inverted,
                mask,
                anyof,
                returned,
            )
            count = _ioctl(fd, PAGEMAP_SCAN, ctypes.pointer(arg))
            runs = words[: 3 * count].tolist()
            found.extend(zip(runs[0::3], runs[1::3], runs[2::3], strict=True))
            if arg.walk_end <= start:
                break
            start = arg.walk_end
    finally:
        os.close(fd)
    return found


def written_ranges(pid: int, start: int = 0, end: int = TASK_SIZE) -> list[tuple[int, int]]:
    """The (start, end) ranges of ``pid``'s private memory, present or swapped, that a
    tracked dump would copy now: written since they were last protected, or not tracked
    at all (zero pages and file pages that were never written are left out, as CRIU does).
    """
    runs = scan(
        pid,
        inverted=PAGE_IS_PFNZERO | PAGE_IS_FILE,
        mask=PAGE_IS_PFNZERO | PAGE_IS_FILE | PAGE_IS_WRITTEN,
        anyof=PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
        returned=PAGE_IS_WRITTEN,
        start=start,
        end=end,
    )
    return [(run_start, run_end) for run_start, run_end, _ in runs]


def written_tracked_ranges(pid: int) -> list[tuple[int, int]]:
    """As :func:`written_ranges`, of the registered (tracked) memory only: what ``pid``
    wrote since it was last protected."""
    runs = scan(
        pid,
        inverted=PAGE_IS_PFNZERO | PAGE_IS_FILE,
        mask=PAGE_IS_PFNZERO | PAGE_IS_FILE | PAGE_IS_WRITTEN | PAGE_IS_WPALLOWED,
        anyof=PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
        returned=PAGE_IS_WRITTEN,
    )
    return [(run_start, run_end) for run_start, run_end, _ in runs]


def protected_ranges(pid: int, start: int = 0, end: int = TASK_SIZE) -> list[tuple[int, int, int]]:
    """The (start, end, categories) runs of ``pid``'s private memory, present or swapped,
    that are protected (tracked, and not written since): those a dump would take from the
    parent snapshot. ``categories``: :data:`PAGE_IS_HUGE` (a transparent huge page maps
    it) and :data:`PAGE_IS_SWAPPED` (swapped out, or not populated at all: Linux reports
    the marker of a protected unpopulated page as swapped)."""
    return scan(
        pid,
        inverted=PAGE_IS_PFNZERO | PAGE_IS_FILE | PAGE_IS_WRITTEN,
        mask=PAGE_IS_PFNZERO | PAGE_IS_FILE | PAGE_IS_WRITTEN | PAGE_IS_WPALLOWED,
        anyof=PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
        returned=PAGE_IS_HUGE | PAGE_IS_SWAPPED,
        start=start,
        end=end,
    )


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


#: What ``process_vm_readv`` fails with where no page of the process can be read (not a
#: page's fault): the comparison cannot be made at all.
_UNREADABLE = (errno.EPERM, errno.EACCES, errno.ESRCH, errno.ENOSYS)


def read_memory(pid: int, address: int, into: memoryview) -> int:
    """Copy ``pid``'s memory at ``address`` into ``into`` (``process_vm_readv``: the
    caller may ptrace ``pid``); the bytes read, fewer where a page cannot be read (gone,
    or ``PROT_NONE``). Raises TrackingUnavailable where the process cannot be read at
    all (gone, or a security module or seccomp filter refuses it)."""
    buffer = (ctypes.c_char * len(into)).from_buffer(into)
    local = _IoVec(ctypes.addressof(buffer), len(into))
    remote = _IoVec(address, len(into))
    got = int(_libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0))
    if got < 0:
        code = ctypes.get_errno()
        if code in _UNREADABLE:
            raise TrackingUnavailable(code, f"process_vm_readv of {pid}: {os.strerror(code)}")
        return 0
    return got
