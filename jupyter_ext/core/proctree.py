"""Process-tree helpers (Linux /proc) for the kernel's inner process tree."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import stat
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37


def die_with_parent() -> None:
    """In a child before it execs (``preexec_fn``): SIGKILL it when its parent ends, so
    that no helper (the inner kernel's launcher, a CRIU run) outlives a killed wrapper."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def set_subreaper(on: bool) -> bool:
    """Adopt this process's orphaned descendants, or stop (prctl PR_SET_CHILD_SUBREAPER),
    so that :func:`reap_adopted` can free their process ids at once instead of waiting
    for PID 1 (in a container, PID 1 may never reap them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0)


@contextlib.contextmanager
def subreaper_while() -> Iterator[None]:
    """Adopt orphaned descendants only inside the block (what the process was before is
    restored after): a tree whose parent exits in the block becomes our child."""
    libc = ctypes.CDLL(None, use_errno=True)
    was = ctypes.c_int(0)
    libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0)
    set_subreaper(True)
    try:
        yield
    finally:
        if not was.value:
            set_subreaper(False)


def parent(pid: int) -> int | None:
    """The parent of ``pid`` (None if there is no such process)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def start_time(pid: int) -> str:
    """When ``pid`` started (clock ticks since boot), "" if there is no such process: with
    the pid, it names one process (a pid is reused, its start time is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def reap_adopted(kernels: Collection[int] = ()) -> list[int]:
    """Reap the zombies this (subreaper) process adopted: ``kernels`` (processes it knows
    were kernels, which lead their own sessions), and children in a session that is
    neither ours nor their own (what those kernels started). What it started itself (in
    its session, or session leaders such as kernel wrappers and terminals) is left to
    whoever waits for it."""
    me = os.getpid()
    own_session = os.getsid(0)
    reaped = []
    for pid in children(me):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, session = fields[0], int(fields[3])
        adopted = pid in kernels or session not in (own_session, pid)
        if state == "Z" and adopted:
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    reaped.append(pid)
    return reaped


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (all its threads' children)."""
    result: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return result
    for task in tasks:
        try:
            result.extend(int(p) for p in (task / "children").read_text().split())
        except OSError:
            continue
    return result


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, parents before children."""
    order = [pid]
    index = 0
    while index < len(order):
        order.extend(children(order[index]))
        index += 1
    return order


def private_memory_bytes(pids: Collection[int]) -> int:
    """The anonymous and shared memory the processes hold (RssAnon + RssShmem): about what
    a dump writes (file pages it does not save). 0 for processes that are gone."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith(("RssAnon:", "RssShmem:")):
                    total += int(line.split()[1]) * 1024
    return total


def pinned_memory_bytes(pids: Collection[int]) -> int:
    """The memory the processes pinned for devices or io_uring (VmPin): written by them
    without the page tables knowing, so it cannot be tracked. 0 for processes that are
    gone."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmPin:"):
                    total += int(line.split()[1]) * 1024
    return total


def process_name(pid: int) -> str:
    """The short name of ``pid`` (its ``comm``), "?" if it cannot be read."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def all_pids() -> list[int]:
    """Every process this one can see."""
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


#: ``PF_EXITING`` in /proc/PID/stat's flags: the thread is ending.
_PF_EXITING = 0x4
#: SIGKILL's bit in /proc/PID/status's signal masks.
_SIGKILL_BIT = 1 << (9 - 1)


def is_alive(pid: int) -> bool:
    """True while a thread of ``pid`` runs: a main thread that ended before the others is
    a zombie already, while the others still hold the process's files and sockets; a
    thread killed (SIGKILL pending) or ending runs no code of the process again, though it
    may take a moment to go (a dump that failed on it must not say it runs on)."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for thread in threads:
        try:
            fields = Path(f"/proc/{pid}/task/{thread}/stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] in ("Z", "X") or int(fields[6]) & _PF_EXITING:
                continue
            if not _killed(Path(f"/proc/{pid}/task/{thread}/status")):
                return True
        except OSError:
            continue  # ended while looked at
    return False


def has_ended(pid: int) -> bool:
    """Whether ``pid`` is gone or ending (:func:`is_alive` false), looked at cheaply
    first: only a main thread that is a zombie, dead or ending makes it look further."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return True
    if fields[0] not in ("Z", "X") and not int(fields[6]) & _PF_EXITING:
        return False
    return not is_alive(pid)


def _killed(status: Path) -> bool:
    """Whether SIGKILL is pending for the thread (its own or its process's)."""
    for line in status.read_text().splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & _SIGKILL_BIT:
            return True
    return False


def needed_files(
    pids: list[int], mapped: bool = True, known: Collection[str] = ()
) -> list[dict[str, object]]:
    """Regular files a restore of these processes needs at the same path and size.

    Open file descriptors, file-backed memory mappings (the interpreter, its libraries)
    and working directories (``mapped=False``: open file descriptors only, quicker).
    Deleted files are left out: CRIU carries them in the image, and so are the ``known``
    paths (not even looked at: a second look, while the tree is frozen, stays short).
    An open file that one of the processes appends to (``O_APPEND``, for writing: a log)
    is marked ``appended``, with its ``openers`` (``/proc/PID/fd/N`` of each descriptor that
    appends to it) to read it through during the dump: the snapshot carries it as it was
    (core/carried/appended.py), instead of needing it unchanged; and with ``size_checked``
    (CRIU records its size: a descriptor reads it, or it is mapped) and ``rewritten`` (a
    descriptor writes it without ``O_APPEND``, so that its start may change).
    """
    seen: dict[str, dict[str, object]] = {}
    flags: dict[str, list[int]] = {}  # path -> the flags of each descriptor open on it
    openers: dict[str, list[str]] = {}  # path -> each descriptor that appends to it

    def add(path: str, kind: str, opener: str = "") -> None:
        if path in known:
            return
        if path in seen:
            held = flags.setdefault(path, [])
            if opener:
                held.append(_flags(opener))
                if _appends(held[-1]):
                    openers.setdefault(path, []).append(opener)
            elif kind == "mapped":
                held.append(os.O_RDONLY)  # CRIU checks a mapped file's size
            return
        if not path.startswith("/") or path.endswith(DELETED):
            return
        try:
            st = os.stat(path)
        except OSError:
            return
        if kind == "cwd":
            seen[path] = {"path": path, "kind": kind, "size": None}
        elif stat.S_ISREG(st.st_mode):
            # The mode too: CRIU checks it, and a restore may make an empty file again.
            mode = stat.S_IMODE(st.st_mode)
            seen[path] = {"path": path, "kind": kind, "size": st.st_size, "mode": mode}
            flags[path] = [_flags(opener) if opener else os.O_RDONLY]
            if opener and _appends(flags[path][0]):
                openers[path] = [opener]

    for pid in pids:
        if mapped:
            with contextlib.suppress(OSError):
                add(os.readlink(f"/proc/{pid}/cwd"), "cwd")
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                add(os.readlink(f"/proc/{pid}/fd/{fd}"), "open", f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines() if mapped else []
        except OSError:
            maps = []
        for line in maps:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/"):
                add(parts[5], "mapped")
    for path, entry in seen.items():
        if path in openers:
            held = flags[path]
            entry.update(
                appended=True,
                openers=openers[path],
                # CRIU records no size for a file open write-only with O_APPEND only.
                size_checked=any(
                    f & os.O_ACCMODE != os.O_WRONLY or not f & os.O_APPEND for f in held
                ),
                rewritten=any(
                    f & os.O_ACCMODE != os.O_RDONLY and not f & os.O_APPEND for f in held
                ),
            )
    return sorted(seen.values(), key=lambda entry: str(entry["path"]))


#: How /proc marks the path of a file that has no name any more.
DELETED = " (deleted)"


@dataclass(frozen=True)
class DeletedFile:
    """A deleted regular file that a process holds open, maps or runs: CRIU saves such
    "ghost" files in the images whole, up to its ``--ghost-limit`` (Ray's object store is
    one, in /dev/shm; so is a ``tempfile.TemporaryFile``)."""

    path: str
    """As /proc shows it (``... (deleted)``)."""
    size: int
    exact: bool = True
    """False for a file that is only mapped and whose size cannot be read (without root a
    mapping's ``map_files`` entry cannot be opened): ``size`` is then a bound, the size of
    its file system, at least as far as a mapping reaches."""


def deleted_files(pids: list[int]) -> list[DeletedFile]:
    """The deleted regular files these processes hold open, map or run (their sizes as
    CRIU will see them: the whole file's, not a mapping's)."""
    found: list[DeletedFile] = []
    for pid in pids:
        with contextlib.suppress(OSError):
            links = [f"/proc/{pid}/fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd")]
            for link in [*links, f"/proc/{pid}/exe"]:
                with contextlib.suppress(OSError):
                    target = os.readlink(link)
                    if target.endswith(DELETED):
                        st = os.stat(link)
                        if stat.S_ISREG(st.st_mode):
                            found.append(DeletedFile(target, st.st_size))
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].endswith(DELETED):
                    found.append(_mapped_deleted(pid, parts[0], int(parts[2], 16), parts[5]))
    return found


def _mapped_deleted(pid: int, span: str, offset: int, path: str) -> DeletedFile:
    """The deleted file mapped at ``span`` (``START-END``) of ``pid``, by its own size where
    it can be read, else by a bound: its file system's size, at least the mapping's reach."""
    try:
        return DeletedFile(path, os.stat(f"/proc/{pid}/map_files/{span}").st_size)
    except OSError:  # without CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE
        pass
    start, end = (int(x, 16) for x in span.split("-"))
    bound = offset + end - start
    with contextlib.suppress(OSError):
        directory = os.path.dirname(path.removesuffix(DELETED))
        fs = os.statvfs(f"/proc/{pid}/root{directory}")
        bound = max(bound, fs.f_blocks * fs.f_frsize)
    return DeletedFile(path, bound, exact=False)


def _flags(opener: str) -> int:
    """The open flags of the fd ``/proc/PID/fd/N`` (read-only where they cannot be read)."""
    fdinfo = opener.replace("/fd/", "/fdinfo/")
    with contextlib.suppress(OSError, ValueError):
        for line in Path(fdinfo).read_text().splitlines():
            if line.startswith("flags:"):
                return int(line.split()[1], 8)
    return os.O_RDONLY


def _appends(flags: int) -> bool:
    """Whether a descriptor with these flags appends (``O_APPEND``, writable)."""
    return bool(flags & os.O_APPEND) and flags & os.O_ACCMODE != os.O_RDONLY


def empty_open_file_in(entry: dict[str, object], directory: str) -> bool:
    """Whether a needed file is an empty file the tree held open in ``directory`` (a
    lock file in the kernel's temporary directory: a restore may make it again)."""
    prefix = directory.rstrip("/") + "/"
    return (
        bool(directory)
        and entry["kind"] == "open"
        and entry.get("size") == 0
        and str(entry["path"]).startswith(prefix)
    )


def missing_files(entries: list[dict[str, object]], made_in: str = "") -> list[str]:
    """Which needed files are absent or changed here, in words (empty when all is well).
    Empty open files in ``made_in`` that are absent are no problem: the restore makes them
    (core/isolation/privatetmp.py); nor are files the kernel appended to."""
    problems: list[str] = []
    for entry in entries:
        if entry.get("appended"):
            continue  # the snapshot carries it; the restore puts it back (core/carried/appended.py)
        path = str(entry["path"])
        try:
            st = os.stat(path)
        except OSError:
            if not empty_open_file_in(entry, made_in):
                problems.append(f"{path} ({entry['kind']}) does not exist")
            continue
        size = entry.get("size")
        if size is not None and st.st_size != size:
            problems.append(f"{path} ({entry['kind']}) has {st.st_size} bytes, expected {size}")
    return problems


def ns_pid(pid: int) -> int:
    """The pid of process ``pid`` inside its own (innermost) PID namespace."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    return pid


def host_pids_by_ns_pid(root: int) -> dict[int, int]:
    """For the tree under ``root``: namespace pid -> host pid."""
    result: dict[int, int] = {}
    for pid in descendants(root):
        try:
            result[ns_pid(pid)] = pid
        except OSError:
            continue
    return result
