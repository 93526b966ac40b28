"""A restored tree holds no more than the pod that asked for it.

CRIU gives every restored task the credentials, capabilities, no_new_privs and seccomp
filters its images name. The images are the agent's own (sealed) and of a pod of the same
name, but that pod may have run with other settings than the caller's (a changed
configuration, a pod of that name made by someone else), and one task of a tree may hold
what its root does not (a child started before the root installed a filter). So after
every restore, while the tree is still stopped (CRIU's ``--leave-stopped``), the agent
compares every thread of every restored process with the caller:

- its uids and gids equal the caller's, its supplementary groups are among the caller's;
- each capability set (inheritable, permitted, effective, bounding, ambient) is a subset
  of the caller's;
- no_new_privs is set if the caller's is, and its seccomp mode is not below the caller's;
- the caller's seccomp filters, the BPF programs themselves (``PTRACE_SECCOMP_GET_FILTER``,
  which needs the agent's ``CAP_SYS_ADMIN``), are the oldest filters of the thread: a
  thread may have added filters of its own, which only take away. Two programs are the
  same if their bytes are, or (:func:`same_filter`) if they differ only in a leading
  block that reads nothing but the call's number and architecture and decides the same
  for every value that matters: runc prepends such a block (ENOSYS for calls newer than
  the profile), its architectures in Go's random map order, so the processes of one
  container differ there (measured in podman: 2 of 13 ``exec``s).

Only then is the tree resumed (SIGCONT); on the first difference it is killed and the
restore refused, naming the task and the field.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import signal
import struct

from jupyter_ext.core import proctree
from jupyter_ext.core.agent import peers
from jupyter_ext.core.agent.protocol import AgentRequestError

PTRACE_DETACH = 17
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_SECCOMP_GET_FILTER = 0x420C
#: waitpid(2)'s flag for threads and clones, which os does not name.
WALL = 0x40000000
#: One BPF instruction (struct sock_filter).
BPF_INSN = 8
#: /proc/PID/status fields that must equal the caller's.
EQUAL = ("Uid", "Gid")
#: Classic BPF (include/uapi/linux/bpf_common.h): what a leading block may hold.
BPF_LD_W_ABS = 0x20
BPF_JA = 0x05
BPF_JEQ_K = 0x15
BPF_JGT_K = 0x25
BPF_JGE_K = 0x35
BPF_JSET_K = 0x45
BPF_RET_K = 0x06
#: struct seccomp_data: the offsets of the call's number and architecture.
SECCOMP_NR = 0
SECCOMP_ARCH = 4
U32 = 0xFFFFFFFF
#: Capability sets: each a subset of the caller's.
CAPABILITIES = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.restype = ctypes.c_long
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]


def _ptrace(request: int, tid: int, addr: int = 0, data: ctypes.c_void_p | None = None) -> int:
    result = int(_libc.ptrace(request, tid, ctypes.c_void_p(addr), data))
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return result


def seccomp_filters(tid: int, stopped: bool = False) -> list[bytes]:
    """The seccomp filter programs of thread ``tid``, the newest first (empty without
    filters). The thread is interrupted while they are read, and left stopped after if
    ``stopped`` (a restored task, resumed only once all are checked)."""
    if peers.status_fields(tid).get("Seccomp") != "2":
        return []
    _ptrace(PTRACE_SEIZE, tid)
    try:
        _ptrace(PTRACE_INTERRUPT, tid)
        os.waitpid(tid, WALL)
        programs: list[bytes] = []
        while True:
            try:
                count = _ptrace(PTRACE_SECCOMP_GET_FILTER, tid, len(programs))
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    return programs
                raise
            buffer = ctypes.create_string_buffer(count * BPF_INSN)
            _ptrace(
                PTRACE_SECCOMP_GET_FILTER, tid, len(programs), ctypes.cast(buffer, ctypes.c_void_p)
            )
            programs.append(buffer.raw)
    finally:
        sig = ctypes.c_void_p(signal.SIGSTOP if stopped else 0)
        with contextlib.suppress(OSError):
            _ptrace(PTRACE_DETACH, tid, 0, sig)


def _refused(what: str) -> AgentRequestError:
    return AgentRequestError(
        f"The node agent undid the restore: {what}.",
        hint="Restore snapshots into pods configured as the one that took them (the same "
        "user, security context and seccomp profile).",
    )


class CallerPrivileges:
    """What the caller holds, read once per restore (confirmed to be the caller's)."""

    def __init__(self, caller: peers.Caller) -> None:
        self.status = caller.status()
        try:
            self.filters = seccomp_filters(caller.pid)
        except OSError as exc:
            caller.ensure_alive()
            raise AgentRequestError(
                f"The node agent cannot read the caller's seccomp filter ({exc.strerror}).",
                hint="A process being traced (a debugger, py-spy) cannot ask for a restore; "
                "ask again without it.",
            ) from exc
        caller.ensure_alive()

    def check(self, pid: int, tid: int, shown: str) -> None:
        """Refuse thread ``tid`` of restored process ``pid`` if it holds more than the
        caller; it is left stopped."""
        theirs = peers.status_fields(pid, tid)
        mine = self.status
        for key in EQUAL:
            if theirs.get(key) != mine.get(key):
                raise _refused(f"{shown} has {key} {theirs.get(key)}, its pod {mine.get(key)}")
        if not set(theirs.get("Groups", "").split()) <= set(mine.get("Groups", "").split()):
            raise _refused(f"{shown} has groups {theirs.get('Groups')}, its pod {mine['Groups']}")
        for key in CAPABILITIES:
            extra = int(theirs.get(key, "0"), 16) & ~int(mine.get(key, "0"), 16)
            if extra:
                raise _refused(f"{shown} has capabilities its pod lacks ({key} {extra:#x})")
        if int(theirs.get("NoNewPrivs", "0")) < int(mine.get("NoNewPrivs", "0")):
            raise _refused(f"{shown} runs without no_new_privs, its pod with")
        if int(theirs.get("Seccomp", "0")) < int(mine.get("Seccomp", "0")):
            mode = theirs.get("Seccomp")
            raise _refused(f"{shown} has seccomp mode {mode}, its pod {mine['Seccomp']}")
        if not self.filters:
            return
        filters = seccomp_filters(tid, stopped=True)
        oldest = filters[len(filters) - len(self.filters) :] if filters else []
        if len(filters) < len(self.filters) or not all(
            same_filter(a, b) for a, b in zip(oldest, self.filters, strict=True)
        ):
            raise _refused(
                f"{shown} runs under other seccomp filters than its pod (its "
                f"{_describe(filters)}; the pod's {_describe(self.filters)} are not its oldest)"
            )


def _instructions(program: bytes) -> list[tuple[int, int, int, int]]:
    """A program's instructions (code, jt, jf, k: struct sock_filter)."""
    return [struct.unpack_from("=HBBI", program, at) for at in range(0, len(program), BPF_INSN)]


def _probes(block: list[tuple[int, int, int, int]]) -> list[int] | None:
    """Values of the number or architecture on which a leading block's decisions turn:
    each constant it compares with and its neighbours, with and without each bit mask it
    tests; None if the block does more than load those two and compare them with
    constants."""
    points = {0, U32}
    masks = []
    for code, _, _, k in block:
        if code == BPF_LD_W_ABS:
            if k not in (SECCOMP_NR, SECCOMP_ARCH):
                return None
        elif code in (BPF_JEQ_K, BPF_JGT_K, BPF_JGE_K):
            points |= {(k - 1) & U32, k, (k + 1) & U32}
        elif code == BPF_JSET_K:
            masks.append(k)
        elif code not in (BPF_JA, BPF_RET_K):
            return None
    for mask in masks:
        points |= {p | mask for p in points} | {p & ~mask & U32 for p in points}
    return sorted(points)


def _run_block(
    program: list[tuple[int, int, int, int]], end: int, nr: int, arch: int
) -> tuple[str, int, str]:
    """Run a program's leading block (up to ``end``, as :func:`_probes` accepts it) on a
    call: ("ret", action, ""), or ("next", where it goes on, which field the accumulator
    holds then). Unconditional jumps after the block are followed (the same in both
    programs, and deciding nothing), so that blocks ending in different jumps to the same
    place compare equal."""
    pc = 0
    acc = ""
    while pc < len(program) and (pc < end or program[pc][0] == BPF_JA):
        code, jt, jf, k = program[pc]
        if code == BPF_LD_W_ABS:
            acc = "nr" if k == SECCOMP_NR else "arch"
            pc += 1
        elif code == BPF_RET_K:
            return ("ret", k, "")
        elif code == BPF_JA:
            pc += 1 + k
        else:
            value = {"nr": nr, "arch": arch, "": 0}[acc]
            taken = {
                BPF_JEQ_K: value == k,
                BPF_JGT_K: value > k,
                BPF_JGE_K: value >= k,
                BPF_JSET_K: bool(value & k),
            }[code]
            pc += 1 + (jt if taken else jf)
    return ("next", pc, acc)


def same_filter(a: bytes, b: bytes) -> bool:
    """Whether two seccomp programs decide alike: equal bytes, or equal length and bytes
    after a leading block that reads only the call's number and architecture and ends
    alike (returns the same, or goes on at the same place with the same field in the
    accumulator) for every value its comparisons turn on. Anything else counts as
    different."""
    if a == b:
        return True
    if len(a) != len(b):
        return False
    ia, ib = _instructions(a), _instructions(b)
    end = 1 + max(i for i, (x, y) in enumerate(zip(ia, ib, strict=True)) if x != y)
    probes = _probes(ia[:end] + ib[:end])
    if probes is None:
        return False
    return all(
        _run_block(ia, end, nr, arch) == _run_block(ib, end, nr, arch)
        for nr in probes
        for arch in probes
    )


def _describe(filters: list[bytes]) -> str:
    """Filter programs, newest first, as their sizes and hashes (for the error)."""
    shown = [f"{len(p) // BPF_INSN} insns {hashlib.sha256(p).hexdigest()[:12]}" for p in filters]
    return f"{len(filters)} filters [{', '.join(shown)}]"


def check_restored(caller: peers.Caller, root: int) -> None:
    """Check every thread of the stopped tree under the node's pid ``root`` against the
    caller (:class:`CallerPrivileges`), then resume it; AgentRequestError if one holds
    more (the tree is left stopped: the caller kills it)."""
    privileges = CallerPrivileges(caller)
    pinned = [peers.CallerTask(pid, pid) for pid in proctree.descendants(root)]
    try:
        for task in pinned:
            try:
                task.shown = proctree.ns_pid(task.pid)
                for tid in sorted(int(t) for t in os.listdir(f"/proc/{task.pid}/task")):
                    where = f"the restored process {task.shown} (thread {tid} on the node)"
                    privileges.check(task.pid, tid, where)
            except OSError as exc:
                task.ensure_alive()
                raise _refused(f"the restored process {task.shown} cannot be read ({exc})") from exc
            task.ensure_alive()
        for task in pinned:
            task.signal(signal.SIGCONT)
    finally:
        for task in pinned:
            task.close()
