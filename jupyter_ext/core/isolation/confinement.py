"""What this process's confinement lets CRIU do: seccomp, no_new_privs, the capability
bounding set, Yama's ptrace_scope and a read-only /proc/sys.

Container runtimes and Kubernetes set these per pod (the securityContext) or per node
(sysctls), and each one makes CRIU fail with a bare "Operation not permitted". They are
read here from /proc, the same for doctor and for a failed job, so both name the setting
that stopped CRIU and how to change it instead of blaming the CRIU binary. CRIU runs in
the wrapper, a child of the server: it inherits all of them from the server's process.
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass
from pathlib import Path

#: Capability numbers (linux/capability.h) of the product's CRIU copy's file capabilities.
CAP_SETPCAP = 8
CAP_SYS_PTRACE = 19
CAP_CHECKPOINT_RESTORE = 40
NEEDED_CAPS = {CAP_CHECKPOINT_RESTORE: "CHECKPOINT_RESTORE", CAP_SETPCAP: "SETPCAP"}
YAMA_SCOPE = Path("/proc/sys/kernel/yama/ptrace_scope")
POD_SECURITY_DOC = "docs/jupyterhub.md#pod-security"


@dataclass(frozen=True)
class Blocker:
    """One setting that stops CRIU here: what it is and does, and how to change it."""

    name: str
    message: str
    fix: str


def status_fields(pid: int | str = "self") -> dict[str, str]:
    """The ``Name: value`` fields of /proc/PID/status."""
    fields: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


@dataclass(frozen=True)
class Confinement:
    """The facts of one process (by default this one) that decide whether CRIU may run."""

    seccomp: int
    """0: no seccomp; 1: strict mode; 2: a filter (a container's seccomp profile)."""
    no_new_privs: bool
    bounding: int
    effective: int
    yama_scope: int | None
    """None where the kernel has no Yama (then only ordinary ptrace rules apply)."""
    proc_sys_writable: bool

    @classmethod
    def read(cls, pid: int | str = "self") -> Confinement:
        fields = status_fields(pid)
        try:
            scope: int | None = int(YAMA_SCOPE.read_text().strip())
        except (OSError, ValueError):
            scope = None
        return cls(
            seccomp=int(fields.get("Seccomp", "0") or 0),
            no_new_privs=fields.get("NoNewPrivs", "0") == "1",
            bounding=int(fields.get("CapBnd", "0") or "0", 16),
            effective=int(fields.get("CapEff", "0") or "0", 16),
            yama_scope=scope,
            proc_sys_writable=not os.statvfs("/proc/sys").f_flag & os.ST_RDONLY,
        )

    def outside_bounding(self) -> list[str]:
        """The capabilities of the CRIU copy that are not in the bounding set: execve
        refuses a binary whose file capabilities cannot all be had (EPERM)."""
        return [name for bit, name in NEEDED_CAPS.items() if not self.bounding & (1 << bit)]

    def blockers(self, *, unprivileged: bool) -> list[Blocker]:
        """Every setting that stops a dump or a restore, most fundamental first."""
        found: list[Blocker] = []
        if self.seccomp:
            found.append(seccomp_blocker(self.seccomp))
        if unprivileged and self.no_new_privs:
            found.append(
                Blocker(
                    "no_new_privs",
                    "This process runs with no_new_privs (NoNewPrivs: 1 in /proc/self/status; "
                    "Kubernetes: allowPrivilegeEscalation: false, Docker: "
                    "--security-opt no-new-privileges, systemd: NoNewPrivileges=yes), which "
                    "makes execve ignore the CRIU copy's file capabilities: CRIU runs without "
                    "CAP_CHECKPOINT_RESTORE.",
                    "Start Jupyter without no_new_privs: allowPrivilegeEscalation: true in the "
                    f"container's securityContext ({POD_SECURITY_DOC}).",
                )
            )
        outside = self.outside_bounding() if unprivileged else []
        if outside:
            found.append(
                Blocker(
                    "bounding set",
                    f"The capabilities {', '.join(outside)} are not in this process's "
                    "capability bounding set (CapBnd in /proc/self/status: the container "
                    "dropped them), so execve refuses to start the CRIU copy, whose file "
                    "capabilities name them (Operation not permitted).",
                    "Add them to the container: securityContext.capabilities.add: "
                    "[CHECKPOINT_RESTORE, SETPCAP] (Docker: --cap-add CHECKPOINT_RESTORE "
                    f"--cap-add SETPCAP; {POD_SECURITY_DOC}); Linux >= 5.9.",
                )
            )
        yama = self.yama_blocker(unprivileged=unprivileged)
        if yama is not None:
            found.append(yama)
        return found

    def yama_blocker(self, *, unprivileged: bool) -> Blocker | None:
        """Yama's ptrace_scope: 1 is handled (the kernel declares its tracer), 2 needs
        CAP_SYS_PTRACE, which the CRIU copy does not have, and 3 forbids every attach."""
        scope = self.yama_scope
        if scope == 3:
            return Blocker(
                "yama",
                "kernel.yama.ptrace_scope is 3 on this node: no process may ptrace another, "
                "so CRIU cannot seize the kernel (and 3 cannot be lowered until a reboot).",
                "Boot the node with kernel.yama.ptrace_scope = 1 (Ubuntu's default) or 0; it "
                "is a node setting, not a pod's (sysctl.d in the node image).",
            )
        has_ptrace = bool(self.effective & (1 << CAP_SYS_PTRACE))
        if scope == 2 and (unprivileged or not has_ptrace):
            return Blocker(
                "yama",
                "kernel.yama.ptrace_scope is 2 on this node: only processes with "
                "CAP_SYS_PTRACE may ptrace, and CRIU runs without it here (the CRIU copy "
                "does not get it: it would reach every process of the node's users).",
                "Set kernel.yama.ptrace_scope = 1 on the node (sysctl -w "
                "kernel.yama.ptrace_scope=1 there, or in its sysctl.d; it is per node, not "
                "per pod); with 1 each kernel declares its wrapper as its tracer.",
            )
        return None


#: ptrace_scope 1 without root: the kernel declares its wrapper, but a child it started by
#: fork+exec outside Python's fork hooks (subprocess, multiprocessing's spawn) did not.
YAMA_RELATIONAL_CHILD = Blocker(
    "yama",
    "kernel.yama.ptrace_scope is 1 on this node: CRIU may seize only its descendants and "
    "processes that declared it (or its parent, the wrapper) as their tracer. The kernel "
    "does declare its wrapper, and so do children it forks in Python; a child process "
    "started with subprocess or multiprocessing's 'spawn' method does not, so CRIU may "
    "not seize it.",
    "End such child processes before a snapshot (or start them with multiprocessing's "
    "'fork' method), run Jupyter as root, or set kernel.yama.ptrace_scope = 0 on the node.",
)


def seccomp_blocker(mode: int) -> Blocker:
    """Why any seccomp filter stops CRIU, measured: a profile that allows every call fails
    the same way, so no narrower profile can work."""
    return Blocker(
        "seccomp",
        f"This pod has a seccomp profile (Seccomp: {mode} in /proc/self/status). CRIU must "
        "suspend the kernel's seccomp filter to dump it (PTRACE_O_SUSPEND_SECCOMP), which "
        "Linux allows only to a tracer that has CAP_SYS_ADMIN and no filter of its own: "
        "every dump fails ('suspending seccomp failed'), whatever the profile allows.",
        "Snapshots need seccompProfile: {type: Unconfined} in the pod's securityContext "
        "(Docker/podman: --security-opt seccomp=unconfined); a Localhost profile does not "
        f"help ({POD_SECURITY_DOC}).",
    )


#: CRIU's words when ptrace refused it a task (attach, seize, interrupt).
_ATTACH_REFUSED = re.compile(r"Can't attach|Unable to interrupt|Unable to seize|PTRACE_SEIZE")


def explain_denied(
    log: str,
    *,
    unprivileged: bool,
    restoring: bool,
    confinement: Confinement | None = None,
) -> tuple[str, str] | None:
    """(message, fix) for a CRIU failure with EPERM (``log``: its log lines) when this
    process's confinement (read from /proc unless given) explains it; None when nothing
    here does (then the log's own words are used)."""
    confinement = confinement or Confinement.read()
    blockers = confinement.blockers(unprivileged=unprivileged)
    if (
        not blockers
        and confinement.yama_scope == 1
        and unprivileged
        and _ATTACH_REFUSED.search(log)
    ):
        blockers = [YAMA_RELATIONAL_CHILD]
    if not blockers:
        return None
    first = blockers[0]
    verb = "restore" if restoring else "dump"
    return f"CRIU could not {verb}: {first.message}", first.fix


# --- Yama (ptrace_scope 1) ---------------------------------------------------------------
#
# security/yama/yama_lsm.c, YAMA_SCOPE_RELATIONAL: PTRACE_ATTACH (and CRIU's PTRACE_SEIZE)
# is allowed when the tracer is the tracee or an ancestor of it (task_is_descendant), or
# when the tracee (its thread group leader) declared a tracer with prctl(PR_SET_PTRACER)
# and the tracer is that process or a descendant of it (ptracer_exception_found), or the
# tracer has CAP_SYS_PTRACE over the tracee. A declaration belongs to one process: a fork
# does not inherit it, exec keeps it, and it ends when either side exits, so a restored
# kernel (a new task) has none. CRIU runs as the wrapper's child and the kernel as the
# wrapper's other child: the kernel declares its wrapper, which makes CRIU (a descendant
# of the wrapper) a permitted tracer.

PR_SET_PTRACER = 0x59616D61

#: The last declaration this process made: (its own pid, the declared tracer's pid).
declared_ptracer: tuple[int, int] | None = None


def declare_ptracer(tracer: int) -> int:
    """Let ``tracer`` and its descendants ptrace this process under Yama's ptrace_scope 1
    (prctl PR_SET_PTRACER); 0, or the errno (EINVAL on a kernel without Yama, where
    nothing needs declaring). Recorded in :data:`declared_ptracer` either way."""
    global declared_ptracer
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(tracer), 0, 0, 0)
    declared_ptracer = (os.getpid(), tracer)
    return 0 if rc == 0 else ctypes.get_errno()


def _ancestors(pid: int) -> list[int]:
    """``pid`` and its ancestors up to PID 1, from /proc (threads count as their process)."""
    chain = [pid]
    while chain[-1] > 1:
        fields = status_fields(chain[-1])
        chain.append(int(fields.get("PPid", "0") or 0))
        if chain[-1] <= 0:
            chain.pop()
            break
    return chain


def yama_relational_permits(tracer: int, tracee: int, declared: int | None) -> bool:
    """Yama's rule at ptrace_scope 1 for processes of one user without CAP_SYS_PTRACE:
    whether ``tracer`` may attach to ``tracee``, which declared ``declared`` (or nothing)
    as its tracer, judged on the live process tree in /proc."""
    if tracer in _ancestors(tracee):
        return True
    return declared is not None and declared in _ancestors(tracer)
