"""Timed waits a dump interrupted, restarted by the restored task instead of failing.

A thread waiting in ``poll`` with a timeout, ``nanosleep`` or a timed ``futex`` when CRIU
seizes it is stopped with ``-ERESTART_RESTARTBLOCK``: the Linux kernel would go on with
the remaining time from a restart block it keeps in the task, which CRIU cannot save, so
CRIU's dump makes the call return ``EINTR`` in the restored task (compel: "Will restore
... with interrupted system call"). Python retries such calls (PEP 475) and IRkernel's
pbdZMQ polls with ``check.eintr``, but xeus kernels' C++ loop (cppzmq) throws on it and
the restored kernel aborts ("terminate called after throwing an instance of
'zmq::error_t' what(): Interrupted system call"). So the dump's images make such a thread
issue its call again (with its original arguments: the full timeout, or the same
absolute deadline), as a signal with ``SA_RESTART`` would for most calls.

x86-64 only (``core-*.img``'s x86 registers, native mode); on other machines the images
stay as CRIU wrote them.
"""

from __future__ import annotations

from pathlib import Path

from ..criu.images import Field, decode, encode, read_entries, sub_message, write_entries

#: CoreEntry (criu/images/core.proto): machine type, x86 thread info, its registers.
_MTYPE, _X86_64, _THREAD_INFO, _GPREGS = 1, 1, 2, 2
#: UserX86RegsEntry (core-x86.proto): ax, orig_ax, ip, mode (1 native, 2 compat).
_AX, _ORIG_AX, _IP, _MODE, _COMPAT = 11, 16, 17, 28, 2
#: The x86-64 calls that wait with a restart block: poll, nanosleep, futex,
#: clock_nanosleep.
RESTARTED = frozenset({7, 35, 202, 230})
_EINTR = (1 << 64) - 4
#: The length of x86-64's ``syscall`` instruction, which the thread executes again.
_SYSCALL_LEN = 2


def _value(fields: list[Field], number: int) -> int | None:
    return next((v for n, _, v in fields if n == number and isinstance(v, int)), None)


def restarted_regs(regs: list[Field]) -> list[Field] | None:
    """A thread's registers that return EINTR from an interrupted timed wait, made to
    issue the call again; None for any other thread."""
    orig_ax = _value(regs, _ORIG_AX)
    if _value(regs, _MODE) == _COMPAT or orig_ax not in RESTARTED:
        return None
    if _value(regs, _AX) != _EINTR or _value(regs, _IP) is None:
        return None
    changed: list[Field] = []
    for number, wire, value in regs:
        if number == _AX:
            value = orig_ax
        elif number == _IP and isinstance(value, int):
            value -= _SYSCALL_LEN
        changed.append((number, wire, value))
    return changed


def restart_interrupted_waits(images_dir: Path) -> int:
    """Rewrite every thread's core image whose timed wait the dump interrupted (see the
    module docstring); returns how many threads changed."""
    changed = 0
    for path in sorted(images_dir.glob("core-*.img")):
        header, entries = read_entries(path)
        if len(entries) != 1:
            continue
        core = decode(entries[0])
        if _value(core, _MTYPE) != _X86_64:
            return 0
        info = sub_message(core, _THREAD_INFO)
        regs = sub_message(info, _GPREGS) if info is not None else None
        new_regs = restarted_regs(regs) if regs is not None else None
        if info is None or new_regs is None:
            continue
        new_info = [(n, w, encode(new_regs) if n == _GPREGS else v) for n, w, v in info]
        new_core = [(n, w, encode(new_info) if n == _THREAD_INFO else v) for n, w, v in core]
        write_entries(path, header, [encode(new_core)])
        changed += 1
    return changed
