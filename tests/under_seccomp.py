"""Run a command as a pod's runtime starts a container's process with RuntimeDefault:
no_new_privs and a seccomp filter (one that allows every call; the kernel treats every
filter alike), then exec. For the stand-in pods of tests/agentpods.py.

    python tests/under_seccomp.py COMMAND...
"""

from __future__ import annotations

import ctypes
import os
import sys

PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2
#: BPF_RET | BPF_K, SECCOMP_RET_ALLOW.
ALLOW = (0x06, 0x7FFF0000)


class Insn(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_ushort),
        ("jt", ctypes.c_ubyte),
        ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint),
    ]


class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]


def main(argv: list[str]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    insns = (Insn * 1)(Insn(ALLOW[0], 0, 0, ALLOW[1]))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    prog = Prog(1, insns)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
