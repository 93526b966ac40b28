"""The inner kernel's tie to its wrapper, shared by every kind of inner kernel (ipykernel's
:mod:`.inner` and the :mod:`.bridge` of other kernels): it ends when its wrapper is gone,
so no kernel is orphaned, and without root it lets the wrapper's CRIU seize it under Yama.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from pathlib import Path

import kernel_snapshots
from jupyter_ext.core import proctree
from jupyter_ext.core.isolation import confinement

#: How often the orphan watcher looks for the wrapper, in seconds.
WATCH_INTERVAL = 0.5


def wrapper_alive(lifeline: int) -> bool:
    """Whether anyone still reads the kernel's output pipe (``lifeline``: a copy of its
    write end, taken at start).

    The wrapper holds the pipe's only read end for its whole life, and a restore hands the
    restored kernel its new wrapper's pipe, so a pipe nobody reads means the wrapper is
    gone. Unlike a look at the wrapper's process in ``/proc``, this needs no view of the
    host's processes: as root the kernel has a ``/proc`` of its own
    (:mod:`jupyter_ext.core.isolation.mountns`).
    """
    poller = select.poll()
    poller.register(lifeline, 0)
    return not any(events & select.POLLERR for _, events in poller.poll(0))


def declare_wrapper_as_tracer(runtime_dir: Path) -> None:
    """Yama's ptrace_scope 1 lets CRIU (the wrapper's child, this kernel's sibling) seize
    this process only if it declared the wrapper (or an ancestor of CRIU) as its tracer.
    As root the kernel is PID 1 of its own namespace, the wrapper is outside it and CRIU
    has CAP_SYS_PTRACE: nothing to declare (the kernel is PID 1 there; its children never
    call this, see :func:`start`)."""
    if os.getpid() == 1:
        return
    try:
        wrapper = int((runtime_dir / "wrapper.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    confinement.declare_ptracer(wrapper)


def _restore_marker(runtime_dir: Path) -> tuple[int, ...]:
    """What changes with every restore: the wrapper's pid file (written anew, a new inode)
    and the restore record the wrapper rewrites before each restore (also a restore in
    place by the same wrapper). Looked at without opening either: a dump that froze this
    thread with one open would need that file at its restore, and in a new wrapper the
    old wrapper's runtime directory is gone ("Can't open file ... wrapper.pid on
    restore")."""
    marker: list[int] = []
    for name in ("wrapper.pid", kernel_snapshots.RESTORE_FILE):
        try:
            stat = os.stat(runtime_dir / name)
        except OSError:
            marker += [0, 0]
        else:
            marker += [stat.st_ino, stat.st_mtime_ns]
    return tuple(marker)


def _watch_wrapper(runtime_dir: Path, lifeline: int) -> None:
    # As PID 1 of its own namespace (root) the kernel has no tracer to declare, and must
    # not open files of the runtime directory now and then: they lie on the server's
    # mount, which its own mount namespace lacks, and a dump that froze this thread with
    # one open failed ("Can't lookup mount ... wrapper.pid").
    declares = os.getpid() != 1
    marker = _restore_marker(runtime_dir) if declares else None
    while True:
        time.sleep(WATCH_INTERVAL)
        if declares:
            # A restored task is new to Yama: declare the (maybe new) wrapper again.
            now = _restore_marker(runtime_dir)
            if now != marker:
                marker = now
                declare_wrapper_as_tracer(runtime_dir)
        if not wrapper_alive(lifeline):
            if os.getpid() != 1:
                # No PID namespace (non-root mode): our children would outlive us.
                for pid in proctree.descendants(os.getpid())[1:]:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
            os._exit(0)


def start(runtime_dir: Path) -> None:
    """Tie this process to its wrapper: declare the wrapper as its tracer where Yama needs
    it (here and in every child forked in Python), and end it (and, without a PID
    namespace of its own, its children) once the wrapper is gone."""
    lifeline = os.dup(2)
    if os.getpid() != 1:  # no PID namespace of our own: non-root mode, see below
        declare_wrapper_as_tracer(runtime_dir)
        # A declaration is not inherited by a fork: children forked in Python
        # (multiprocessing's fork start method, os.fork, IPython's pty) declare the wrapper
        # too. Children made by fork+exec in C (subprocess, the spawn start method) cannot:
        # docs/jupyterhub.md (Yama).
        os.register_at_fork(after_in_child=lambda: declare_wrapper_as_tracer(runtime_dir))
    threading.Thread(
        target=_watch_wrapper,
        args=(runtime_dir, lifeline),
        name="snapshot-wrapper-watch",
        daemon=True,
    ).start()
