"""CRIU run by the agent inside a caller's pod: its namespaces, its cgroup, our binary.

A kernel's process ids, files and sockets are those its pod sees, so CRIU runs in the
pod's PID, mount, network, IPC, UTS and cgroup namespaces (``nsenter --target`` the
caller; it forks into the PID namespace), as root with every capability and no seccomp
filter (the agent's). It joins the caller's cgroups first, so a restored tree is the
pod's, counted against its limits, and its next dump passes the same-container check.

The binary is the agent's, never the pod's: it is started through the agent's root
directory (an ``O_PATH`` descriptor, reached as ``/proc/self/fd/N/...`` from inside the
pod's mount namespace), its ELF interpreter and libraries too. The images and the work
directory are the agent's own, passed the same way: CRIU never writes into a directory
the pod controls.

Inside the pod (after nsenter, as root, entered the namespaces) the agent's ``setpriv``
makes CRIU the caller's uid and gid with only the capabilities it needs
(:data:`DUMP_CAPS`, :data:`RESTORE_CAPS`), and CRIU runs ``--unprivileged``, as it does in
in-pod mode: it reads and sets the resource limits of the user's processes as their owner
(prlimit on another user's process needs ``CAP_SYS_RESOURCE``, which some nodes' root
lacks), and the user's processes cannot trace it (it holds capabilities they lack).

A restored tree is made the sibling of CRIU (``--restore-sibling``): the child of
nsenter, which exits after CRIU, so the agent (a child subreaper) adopts it and reaps it
when it ends: its process ids are free again for the next restore.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from jupyter_ext.core.agent.protocol import AgentRequestError

#: The namespaces CRIU joins (nsenter's options); the user namespace stays the node's.
NAMESPACES = ("--pid", "--mount", "--net", "--ipc", "--uts", "--cgroup")
PT_INTERP = 3


def elf_interpreter(path: Path) -> str:
    """The ELF interpreter (``PT_INTERP``) of a 64-bit little-endian binary."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError(f"{path} is not a 64-bit ELF binary")
    phoff = int.from_bytes(data[32:40], "little")
    phentsize = int.from_bytes(data[54:56], "little")
    phnum = int.from_bytes(data[56:58], "little")
    for index in range(phnum):
        header = data[phoff + index * phentsize : phoff + (index + 1) * phentsize]
        if int.from_bytes(header[0:4], "little") == PT_INTERP:
            offset = int.from_bytes(header[8:16], "little")
            size = int.from_bytes(header[32:40], "little")
            return data[offset : offset + size].rstrip(b"\0").decode()
    raise ValueError(f"{path} has no ELF interpreter")


#: The capabilities CRIU keeps (numbers: include/uapi/linux/capability.h) as the caller's
#: user: CHECKPOINT_RESTORE (40) and SETPCAP (8), as in in-pod mode, and SYS_ADMIN (21):
#: a dump suspends the kernel's seccomp filter (PTRACE_O_SUSPEND_SECCOMP), a restore
#: suspends the restored tasks' and sets their filter before their no_new_privs (without
#: it: "SECCOMP_SET_MODE_FILTER returned -13", a pod at RuntimeDefault). With SYS_ADMIN
#: CRIU 4.2 also sets the restored tasks' group list, which needs SETGID (6) (measured).
#: The restored tasks get back only the image's credentials (its pod's), which the agent
#: then checks.
DUMP_CAPS = (8, 21, 40)
RESTORE_CAPS = (6, 8, 21, 40)
#: Where the node's (the agent image's) shared libraries are.
LIBRARY_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64")


class PodCriu:
    """The agent's CRIU binary, runnable inside any caller's pod."""

    def __init__(self, criu: Path, bin_dir: Path) -> None:
        """``criu`` is copied into ``bin_dir`` (an agent's directory), readable by all:
        CRIU runs as the caller's user, and the product's CRIU copy may be only its
        group's (scripts/install-criu.sh)."""
        bin_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(bin_dir, 0o755)
        copy = bin_dir / "criu"
        shutil.copyfile(criu, copy)
        os.chmod(copy, 0o755)
        self.criu = copy
        self.criu_interpreter = Path(elf_interpreter(criu.resolve())).resolve()
        self.setpriv = Path(shutil.which("setpriv") or "/usr/bin/setpriv").resolve()
        self.root_fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self.bin_fd = os.open(bin_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    def _through_root(self, path: str | Path) -> str:
        return f"/proc/self/fd/{self.root_fd}{path}"

    def program(self, binary: str, interpreter: Path) -> list[str]:
        """How to start one of the agent's binaries (``binary``, a path as reached from
        the pod) from inside a pod's mount namespace: its ELF ``interpreter`` started
        directly with the agent's library directories, all reached through the agent's
        root (nothing of the pod's file system is run)."""
        dirs = [str(interpreter.parent), *(d for d in LIBRARY_DIRS if Path(d).is_dir())]
        libraries = ":".join(self._through_root(d) for d in dict.fromkeys(dirs))
        return [self._through_root(interpreter), "--library-path", libraries, binary]

    def argv(self, user: tuple[int, int], caps: Sequence[int], args: Sequence[str]) -> list[str]:
        """What runs inside the pod: the agent's setpriv to ``user`` keeping ``caps`` as
        ambient capabilities, then the agent's CRIU with ``args``."""
        uid, gid = user
        keep = ",".join(f"+cap_{cap}" for cap in caps)
        return [
            *self.program(
                self._through_root(self.setpriv),
                Path(elf_interpreter(self.setpriv)).resolve(),
            ),
            f"--reuid={uid}",
            f"--regid={gid}",
            "--clear-groups",
            f"--inh-caps={keep}",
            f"--ambient-caps={keep}",
            "--",
            *self.program(f"/proc/self/fd/{self.bin_fd}/criu", self.criu_interpreter),
            "--unprivileged",
            *args,
        ]

    def run(
        self,
        caller_pid: int,
        user: tuple[int, int],
        cgroup_procs: Sequence[Path],
        args: Sequence[str],
        fds: Sequence[int],
    ) -> tuple[int, str]:
        """Run ``criu ARGS`` (``dump`` or ``restore``) in the namespaces of the node's
        process ``caller_pid``, as ``user`` (uid, gid), in the cgroups whose
        ``cgroup.procs`` are given, with ``fds`` open; exit status and output."""

        def enter_cgroups() -> None:
            for procs in cgroup_procs:
                with open(procs, "w") as f:
                    f.write("0")

        caps = DUMP_CAPS if args[0] == "dump" else RESTORE_CAPS
        command = [
            "nsenter",
            f"--target={caller_pid}",
            *NAMESPACES,
            "--",
            *self.argv(user, caps, args),
        ]
        out = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            pass_fds=[self.root_fd, self.bin_fd, *fds],
            preexec_fn=enter_cgroups,
            timeout=3600,
            check=False,
        )
        return out.returncode, out.stdout + out.stderr


def cgroup_procs_files(cgroup: str, mountinfo: str | None = None) -> list[Path]:
    """The ``cgroup.procs`` files, in the agent's mount namespace, of every hierarchy of
    a ``/proc/PID/cgroup`` (v1 controllers and v2), to move a process into that cgroup."""
    if mountinfo is None:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    v1: list[tuple[frozenset[str], str]] = []
    v2: str | None = None
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fstype, _, options = ([*right.split(), "", "", ""])[:3]
        fields = left.split()
        if len(fields) < 5 or fields[3] != "/":
            continue  # only mounts of a hierarchy's root
        if fstype == "cgroup2":
            v2 = v2 or fields[4]
        elif fstype == "cgroup":
            v1.append((frozenset(options.split(",")), fields[4]))
    files: list[Path] = []
    for line in cgroup.splitlines():
        number, controllers, path = line.split(":", 2)
        if number == "0":
            mount = v2
        else:
            wanted = {c for c in controllers.split(",") if c}
            mount = next((m for options, m in v1 if wanted and wanted <= options), None)
        if mount is None:
            continue  # a hierarchy the agent does not see: nothing to join there
        procs = Path(mount) / path.lstrip("/") / "cgroup.procs"
        if not procs.exists():
            raise AgentRequestError(
                f"The node agent cannot join the caller's cgroup {path} ({procs} is missing).",
                hint="Run the agent with the node's cgroup file system (a privileged "
                "container sees it at /sys/fs/cgroup).",
            )
        files.append(procs)
    return files
