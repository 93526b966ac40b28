"""CRIU run by the agent inside a caller's pod: its namespaces, its cgroup, our binary.

A kernel's process ids, files and sockets are those its pod sees, so CRIU runs in the
pod's PID, mount, network, IPC, UTS and cgroup namespaces, entered by descriptors the
agent opened while the caller was proven alive (``nsenter --pid=/proc/self/fd/N ...``:
never by a pid number, which may be another process's by then; nsenter forks into the
PID namespace), as root with every capability and no seccomp filter (the agent's). It
joins the caller's cgroups first, so a restored tree is the pod's, counted against its
limits, and its next dump passes the same-container check.

The binaries are the agent's, never the pod's: at start the agent copies CRIU and
``setpriv``, each with its ELF interpreter and every library it loads, into a directory of
its own (``bin``, readable by all, inside the agent's state directory, which is root's
alone), and starts them as ``/proc/self/fd/N/<program>/ld.so --inhibit-rpath ''
--library-path /proc/self/fd/N/<program> ...`` from inside the pod's mount namespace: no
library is looked up in the pod's file system (CRIU's RPATH names a path the pod's image
may hold too), and CRIU's plugins come from an empty directory of the agent's (``-L``),
not the pod's ``/usr/lib/criu``. That one directory descriptor is all of the agent's file
system CRIU gets: it runs as the caller's user without ``CAP_DAC_OVERRIDE``, and its
parent (the state directory, 0700 root) cannot be searched from it. Its PATH names no
directory (:data:`NO_PROGRAMS`), so no helper it starts by name is the pod's. The images
and the work directory are the agent's own, passed the same way: CRIU never writes into a
directory the pod controls. A dump runs as ``criu swrk`` (its options before it: CRIU's
RPC, nodeagent/criurpc.py), the same program, so that it asks the agent at the freeze.

Inside the pod (after nsenter, as root, entered the namespaces) the agent's ``setpriv``
makes CRIU the caller's uid and gid with only the capabilities it needs
(:data:`DUMP_CAPS`, :data:`RESTORE_CAPS`), and CRIU runs ``--unprivileged``, as it does in
in-pod mode: it reads and sets the resource limits of the user's processes as their owner
(prlimit on another user's process needs ``CAP_SYS_RESOURCE``, which some nodes' root
lacks), and the user's processes cannot trace it or read its descriptors through /proc
(it holds capabilities they lack: the kernel's ptrace access check refuses them).

A restored tree is made the sibling of CRIU (``--restore-sibling``): the child of
nsenter, which exits after CRIU, so the agent (a child subreaper) adopts it and reaps it
when it ends: its process ids are free again for the next restore.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from jupyter_ext.core.agent.peers import nsenter_options
from jupyter_ext.core.agent.protocol import AgentRequestError
from jupyter_ext.core.criu.tracking import dirty_tracking_said

PT_INTERP = 3
#: The name of a program's ELF interpreter in its directory under ``bin``.
INTERPRETER = "ld.so"


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


def loaded_libraries(binary: Path, interpreter: Path) -> dict[str, Path]:
    """Every library ``binary`` loads (``ld.so --list``), by the name it is asked for."""
    out = subprocess.run(
        [str(interpreter), "--list", str(binary)],
        capture_output=True,
        text=True,
        env={},
        timeout=60,
        check=False,
    )
    if out.returncode != 0:
        raise ValueError(f"the libraries of {binary} cannot be listed: {out.stderr.strip()}")
    found: dict[str, Path] = {}
    for line in out.stdout.splitlines():
        name, arrow, rest = line.strip().partition(" => ")
        if "/" in name:
            continue  # the interpreter (copied as INTERPRETER)
        if arrow and rest.startswith("/"):
            found[name] = Path(rest.rsplit(" (", 1)[0])
        elif arrow:
            raise ValueError(f"{binary} needs {name}, which is not found ({rest})")
    return found


def install_program(binary: Path, directory: Path) -> None:
    """Copy ``binary``, its ELF interpreter (as :data:`INTERPRETER`) and its libraries
    into the new ``directory``, all readable by every user."""
    binary = binary.resolve()
    interpreter = Path(elf_interpreter(binary)).resolve()
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True, mode=0o755)
    os.chmod(directory, 0o755)
    copies = {binary.name: binary, INTERPRETER: interpreter}
    copies.update(loaded_libraries(binary, interpreter))
    for name, source in copies.items():
        shutil.copyfile(source, directory / name)
        os.chmod(directory / name, 0o755)


#: The capabilities CRIU keeps (numbers: include/uapi/linux/capability.h) as the caller's
#: user: CHECKPOINT_RESTORE (40) and SETPCAP (8), as in in-pod mode, and SYS_ADMIN (21):
#: a dump suspends the kernel's seccomp filter (PTRACE_O_SUSPEND_SECCOMP), a restore
#: suspends the restored tasks' and sets their filter before their no_new_privs (without
#: it: "SECCOMP_SET_MODE_FILTER returned -13", a pod at RuntimeDefault). With SYS_ADMIN
#: CRIU 4.2 also sets the restored tasks' group list, which needs SETGID (6) (measured).
#: SYS_PTRACE (19) for Yama: at ``kernel.yama.ptrace_scope`` 1 (Ubuntu's default) a tracer
#: that is neither the tracee's ancestor nor its declared tracer needs it, at 2 every
#: tracer does, and CRIU seizes the kernel's tree on a dump and the restored tree (its
#: sibling, not its child) on a restore. It reaches no other process: CRIU runs in the
#: pod's PID namespace on the tree the agent names, and the pod's processes cannot trace
#: CRIU (it holds capabilities they lack).
#: The restored tasks get back only the image's credentials (its pod's), which the agent
#: then checks.
DUMP_CAPS = (8, 19, 21, 40)
RESTORE_CAPS = (6, 8, 19, 21, 40)
#: The user CRIU runs as to ask the kernel what it can do (no pod's: any will do).
NOBODY = (65534, 65534)
#: NET_ADMIN (12), for a dump or restore that keeps the tree's own connections with TCP
#: repair (``--tcp-established``). CRIU then sets their state on sockets of the pod's
#: network namespace; it holds SYS_ADMIN already, a superset of what this adds.
TCP_REPAIR_CAP = 12
#: CRIU's PATH. It starts helpers by name (``sh -c "iptables -n -w -L"`` whenever it probes
#: the kernel, ``ip``, ``tar``), in the pod's mount namespace and with the capabilities
#: above: a PATH of the node's would find the pod's ``sh`` (a root pod may replace it; a
#: directory of the node's PATH may be the pod user's). A directory of the pod's /proc
#: cannot exist nor be made: every such helper fails to start, and CRIU goes on without
#: (none is needed for a kernel's dump or restore).
NO_PROGRAMS = "/proc/jupyter-kernel-snapshots-agent-runs-no-program"
#: The longest a CRIU of the agent may run.
RUN_SECONDS = 3600.0


class PodCriu:
    """The agent's CRIU binary, runnable inside any caller's pod."""

    def __init__(self, criu: Path, bin_dir: Path) -> None:
        """CRIU and setpriv (each with its interpreter and libraries) are copied into
        ``bin_dir`` (an agent's directory), readable by all: CRIU runs as the caller's
        user, and the product's CRIU copy may be only its group's
        (scripts/install-criu.sh)."""
        bin_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(bin_dir, 0o755)
        setpriv = Path(shutil.which("setpriv") or "/usr/bin/setpriv")
        try:
            install_program(criu, bin_dir / "criu")
            install_program(setpriv, bin_dir / "setpriv")
        except (OSError, ValueError) as exc:
            raise AgentRequestError(
                f"The node agent cannot copy its programs into {bin_dir}: {exc}.",
                hint="Run the agent from its image (deploy/agent/agent.yaml), where CRIU "
                "and setpriv are dynamically linked ELF binaries.",
            ) from exc
        (bin_dir / "plugins").mkdir(mode=0o755, exist_ok=True)
        self.nsenter = shutil.which("nsenter") or "/usr/bin/nsenter"
        self.bin_fd = os.open(bin_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    def program(self, name: str) -> list[str]:
        """How to start the agent's copy of ``name`` from inside a pod's mount namespace:
        its own interpreter, only its own libraries (no RPATH: ``--inhibit-rpath ''``
        covers the program, the only object with one)."""
        directory = f"/proc/self/fd/{self.bin_fd}/{name}"
        return [
            f"{directory}/{INTERPRETER}",
            "--inhibit-rpath",
            "",
            "--library-path",
            directory,
            f"{directory}/{name}",
        ]

    def argv(self, user: tuple[int, int], caps: Sequence[int], args: Sequence[str]) -> list[str]:
        """What runs inside the pod: the agent's setpriv to ``user`` keeping ``caps`` as
        ambient capabilities, then the agent's CRIU with ``args``."""
        uid, gid = user
        keep = ",".join(f"+cap_{cap}" for cap in caps)
        return [
            *self.program("setpriv"),
            f"--reuid={uid}",
            f"--regid={gid}",
            "--clear-groups",
            f"--inh-caps={keep}",
            f"--ambient-caps={keep}",
            "--",
            *self.program("criu"),
            "--unprivileged",
            "--libdir",
            f"/proc/self/fd/{self.bin_fd}/plugins",
            *args,
        ]

    def check(self, caps: Sequence[int], feature: str) -> tuple[int, str]:
        """``criu check --feature FEATURE`` as a pod's user with ``caps``: its exit status
        and output. Asked as the user nobody, outside any pod: CRIU asks the kernel, whose
        answer is the same for every pod."""
        try:
            out = subprocess.run(
                self.argv(NOBODY, caps, ["check", "-v4", "--feature", feature]),
                pass_fds=[self.bin_fd],
                capture_output=True,
                text=True,
                timeout=60,
                env={"PATH": NO_PROGRAMS},
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return -1, str(exc)
        return out.returncode, out.stdout + out.stderr

    def dirty_tracking(self) -> tuple[str | None, str]:
        """How this CRIU, run for pods (:data:`DUMP_CAPS`, ``--unprivileged``), tracks
        memory between dumps on this node (:meth:`Criu.dirty_tracking`)."""
        return dirty_tracking_said(*self.check(DUMP_CAPS, "mem_dirty_track"))

    def start(
        self,
        namespaces: Mapping[str, int],
        user: tuple[int, int],
        cgroup_procs: Sequence[Path],
        args: Sequence[str],
        fds: Sequence[int],
    ) -> subprocess.Popen[str]:
        """Start ``criu ARGS`` (``restore ...``, or a dump's options and ``swrk FD``) in
        the namespaces whose descriptors are given (peers.Caller.namespaces), as ``user``
        (uid, gid), in the cgroups whose ``cgroup.procs`` are given, with ``fds`` open;
        its output (one stream) is piped."""

        def enter_cgroups() -> None:
            for procs in cgroup_procs:
                with open(procs, "w") as f:
                    f.write("0")

        caps = RESTORE_CAPS if args[0] == "restore" else DUMP_CAPS
        if "--tcp-established" in args:
            caps = (*caps, TCP_REPAIR_CAP)
        command = [self.nsenter, *nsenter_options(namespaces), "--", *self.argv(user, caps, args)]
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            pass_fds=[self.bin_fd, *namespaces.values(), *fds],
            preexec_fn=enter_cgroups,
            env={"PATH": NO_PROGRAMS},
        )


def finish(process: subprocess.Popen[str], timeout: float = RUN_SECONDS) -> tuple[int, str]:
    """The exit status and output of a CRIU started by :meth:`PodCriu.start`; killed past
    ``timeout``."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        return -9, output + f"\nCRIU was killed after {timeout:.0f} s."
    return process.returncode, output


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
