"""What a pod or node sets around the server that stops CRIU: seccomp, no_new_privs, the
capability bounding set, Yama's ptrace_scope. Each is made real here in a child process
(a seccomp filter, setpriv), and doctor and CRIU's errors must name it with its fix.

Yama itself is not in this machine's kernel: its rule (security/yama/yama_lsm.c) is
applied to the real process tree instead, and the kernel's declaration of its tracer
is read back from the kernel. ``tests/container`` runs the same settings in real pods.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from jupyter_ext.core import proctree
from jupyter_ext.core.criu import Criu
from jupyter_ext.core.criu.log import explain_failure
from jupyter_ext.core.doctor import check_agent_yama, check_confinement
from jupyter_ext.core.isolation.confinement import (
    Confinement,
    explain_denied,
    yama_relational_permits,
)
from jupyter_ext.core.protocol.environment import ENV_CRIU
from testkit.processes import KernelProcess, wait_until

Factory = Callable[..., KernelProcess]

#: A child that installs a seccomp filter allowing every call (root needs no
#: no_new_privs for it), then runs the code in argv[1]: any filter is what matters.
ALLOW_ALL_SECCOMP = """
import ctypes, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
insn = struct.pack("HBBI", 0x06, 0, 0, 0x7FFF0000)  # BPF_RET|BPF_K SECCOMP_RET_ALLOW
buf = ctypes.create_string_buffer(insn)
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
prog = Prog(1, ctypes.addressof(buf))
if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, FILTER
    sys.exit(f"seccomp: errno {ctypes.get_errno()}")
exec(sys.argv[1])
"""

REPORT = (
    "import json; from jupyter_ext.core.isolation.confinement import Confinement; "
    "c = Confinement.read(); "
    "print(json.dumps([c.seccomp, c.no_new_privs, "
    "[b.name for b in c.blockers(unprivileged=True)], "
    "[b.message + ' FIX ' + b.fix for b in c.blockers(unprivileged=True)]]))"
)


def _report(prefix: list[str], code: str = REPORT) -> list[object]:
    out = subprocess.run(
        [*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    result: list[object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_this_process_is_not_confined() -> None:
    """The test machine itself: no filter, no no_new_privs (else every test below proves
    nothing), and no blocker."""
    here = Confinement.read()
    assert here.seccomp == 0
    assert not here.no_new_privs
    assert here.blockers(unprivileged=os.geteuid() != 0) == []


def test_no_new_privs_is_named_with_its_pod_setting() -> None:
    seccomp, nnp, names, texts = _report(["setpriv", "--no-new-privs", "--"])
    assert nnp is True
    assert seccomp == 0
    assert names == ["no_new_privs"]
    assert isinstance(texts, list)
    assert "allowPrivilegeEscalation: true" in texts[0]


@pytest.mark.needs_root
def test_seccomp_filter_is_named_and_stops_a_real_dump(criu: Criu, tmp_path: Path) -> None:
    """Under any seccomp filter, even one that allows every call, CRIU cannot dump (it
    must suspend the tracee's filter, which a filtered tracer may not): the failed dump's
    error names the seccomp profile and Unconfined, not the binary."""
    seccomp, _, names, texts = _report([sys.executable, "-c", ALLOW_ALL_SECCOMP, REPORT])
    assert seccomp == 2
    assert names == ["seccomp"]
    assert isinstance(texts, list)
    assert "seccompProfile: {type: Unconfined}" in texts[0]
    images = tmp_path / "img"
    images.mkdir()
    dump = (
        "import subprocess, sys\n"
        "from jupyter_ext.core.criu.log import explain_failure, log_excerpt\n"
        "from pathlib import Path\n"
        "victim = subprocess.Popen(['sleep', '60'])\n"
        f"d = Path({str(images)!r})\n"
        f"r = subprocess.run([{str(criu.path)!r}, 'dump', '-t', str(victim.pid), '-D', str(d),"
        " '-o', 'dump.log', '-v4', '--leave-running', '--shell-job'], capture_output=True)\n"
        "victim.kill()\n"
        "print(r.returncode)\n"
        "print(explain_failure(log_excerpt(d / 'dump.log', ''), restoring=False)[0])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", ALLOW_ALL_SECCOMP, dump], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    rc, message = out.stdout.strip().splitlines()[-2:]
    assert rc != "0"
    assert "suspending seccomp failed" in (images / "dump.log").read_text(errors="replace")
    assert "seccomp profile" in message, message


@pytest.mark.needs_root
def test_capability_missing_from_the_bounding_set_is_named(criu: Criu) -> None:
    """A container that did not add CHECKPOINT_RESTORE: execve refuses the CRIU copy
    (EPERM). Finding CRIU then names the capability and the pod setting, not a reinstall."""
    # Where an ordinary user reaches it (pytest's own directories are root's alone).
    with tempfile.TemporaryDirectory(prefix="jks-bounding-") as tmp:
        Path(tmp).chmod(0o755)
        _check_bounding_set(criu, Path(tmp) / "criu")


def _check_bounding_set(criu: Criu, copy: Path) -> None:
    shutil.copy(criu.path, copy)
    copy.chmod(0o755)
    subprocess.run(["setcap", "cap_checkpoint_restore,cap_setpcap+ep", str(copy)], check=True)
    locate = (
        "import json\n"
        "from jupyter_ext.core.criu import Criu\n"
        "from jupyter_ext.core.errors import CriuNotFoundError\n"
        "try:\n"
        f"    Criu.locate({str(copy)!r}); print(json.dumps(['ok', '', '']))\n"
        "except CriuNotFoundError as e:\n"
        "    print(json.dumps([e.code, e.message, e.hint]))\n"
    )
    as_nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    # With the capabilities in its bounding set an ordinary user runs the copy ...
    assert _report(as_nobody, locate) == ["ok", "", ""]
    # ... without CHECKPOINT_RESTORE there, execve refuses it, and the error says why.
    code, message, hint = _report([*as_nobody, "--bounding-set=-checkpoint_restore"], locate)
    assert code == "criu-not-permitted"
    assert isinstance(message, str)
    assert isinstance(hint, str)
    assert "CHECKPOINT_RESTORE" in message
    assert "bounding set" in message
    assert "capabilities.add" in hint


def test_eperm_without_a_confinement_keeps_the_log_words() -> None:
    """Nothing confines this process: a denial is explained by CRIU's own words."""
    message, _hint = explain_failure("Error (criu): Can't fork for 39: File exists", restoring=True)
    assert "process id" in message
    message, _ = explain_failure(
        "Error (criu/ptrace.c): suspending seccomp failed: Operation not permitted",
        restoring=False,
    )
    assert "seccomp" not in message  # no filter here: not blamed on one
    # Seen while containers came and went beside a restore: a mount, not a missing file.
    message, _ = explain_failure(
        "1: Error (criu/mount-v2.c:634): mnt-v2: Can't stat mountpoint /tmp/.criu.mntns.X/"
        "mnt-0000000949/var/lib/containers/storage/overlay-containers/86/userdata/shm: "
        "No such file or directory",
        restoring=True,
    )
    assert "mount" in message
    assert "file the kernel had open" not in message


# --- Yama ---------------------------------------------------------------------------------


def _node(scope: int | None, *, root: bool) -> Confinement:
    """This process's facts on a node with Yama at ``scope`` (CAP_SYS_PTRACE as root)."""
    here = Confinement.read()
    effective = (1 << 19) if root else 0
    return dataclasses.replace(here, yama_scope=scope, effective=effective)


@pytest.mark.parametrize("root", [False, True], ids=["user", "root"])
def test_doctor_reads_yama_ptrace_scope(root: bool) -> None:
    """2 blocks without CAP_SYS_PTRACE (the CRIU copy never has it), 3 blocks everyone;
    both say to set it to 1 on the node; 1 and 0 work (the kernel declares its tracer)."""
    for scope in (2, 3):
        check = {c.name: c for c in check_confinement(_node(scope, root=root), as_user=not root)}
        yama = check["yama ptrace_scope"]
        if scope == 2 and root:
            assert yama.ok, yama
            continue
        assert not yama.ok, yama
        assert yama.required
        assert f"ptrace_scope is {scope}" in yama.detail
        assert "kernel.yama.ptrace_scope = 1" in yama.fix
    for scope in (None, 0, 1):
        check = {c.name: c for c in check_confinement(_node(scope, root=root), as_user=not root)}
        assert check["yama ptrace_scope"].ok, check["yama ptrace_scope"]
    one = {c.name: c for c in check_confinement(_node(1, root=False), as_user=True)}
    assert "PR_SET_PTRACER" in one["yama ptrace_scope"].detail


def test_doctor_in_agent_mode_passes_yama_up_to_scope_2() -> None:
    """The node agent's CRIU attaches with CAP_SYS_PTRACE (nodeagent/podcriu.py): Yama's
    scopes 1 and 2 let it; 3 lets no one, and doctor says what to do."""
    for scope in (None, 0, 1, 2):
        assert check_agent_yama(scope).ok, scope
    refused = check_agent_yama(3)
    assert not refused.ok
    assert "3 on this node" in refused.detail
    assert "2 or lower" in refused.fix


def test_dump_refused_at_ptrace_scope_1_names_the_undeclared_child() -> None:
    """At 1 the kernel's own processes are declared; a refused seize is a child started by
    subprocess, and the error says so. Other denials keep CRIU's words."""
    node = _node(1, root=False)
    refused = "Error (compel/src/lib/infect.c:357): Can't attach to 4242: Operation not permitted"
    message, fix = explain_denied(refused, unprivileged=True, restoring=False, confinement=node)
    assert "ptrace_scope is 1" in message
    assert "subprocess" in message
    assert "ptrace_scope = 0" in fix
    other = "Error (criu/files-reg.c): Can't open file x: Permission denied"
    assert explain_denied(other, unprivileged=True, restoring=False, confinement=node) is None
    assert explain_denied(refused, unprivileged=False, restoring=False, confinement=node) is None


def test_yama_rule_on_a_real_process_tree() -> None:
    """ptrace_scope 1: a process may trace its descendants, and a process that declared
    it, or an ancestor of it, as its tracer; not a sibling that declared nothing."""
    wrapper = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            "a = subprocess.Popen(['sleep', '60']); b = subprocess.Popen(['sleep', '60']); "
            "print(a.pid, b.pid, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert wrapper.stdout is not None
        kernel, criu = (int(x) for x in wrapper.stdout.readline().split())
        assert yama_relational_permits(wrapper.pid, kernel, None)  # an ancestor
        assert not yama_relational_permits(criu, kernel, None)  # a sibling: refused
        assert yama_relational_permits(criu, kernel, wrapper.pid)  # declared its parent
        assert yama_relational_permits(criu, kernel, criu)  # declared itself
        assert not yama_relational_permits(criu, kernel, kernel)  # declared another
        assert not yama_relational_permits(kernel, criu, None)
    finally:
        wrapper.kill()
        wrapper.wait()
        wrapper.stdout.close()
        for pid in (kernel, criu):
            os.kill(pid, 9)


def _recording_criu(criu: Criu, tmp_path: Path) -> tuple[Path, Path]:
    """A CRIU that logs its pid and ancestors, then execs the product's copy (so its
    file capabilities still apply): which process really runs CRIU."""
    log = tmp_path / "criu-runs.log"
    script = tmp_path / "criu"
    script.write_text(
        "#!/bin/sh\n"
        'chain="$$"; p=$PPID\n'
        'while [ "$p" -gt 1 ]; do chain="$chain $p"; '
        "p=$(sed -n 's/^PPid:[[:space:]]*//p' /proc/$p/status); done\n"
        f'echo "$1 $chain -- $*" >> {log}\n'
        f'exec {criu.path} "$@"\n'
    )
    script.chmod(0o755)
    return script, log


def _declared(kernel: KernelProcess) -> list[int]:
    return [
        int(x)
        for x in kernel.execute(
            "from jupyter_ext.core.isolation import confinement; "
            "print(*confinement.declared_ptracer)"
        ).split()
    ]


@pytest.mark.skipif(
    os.geteuid() == 0,
    reason="as root the kernel is PID 1 of its own namespace and CRIU has CAP_SYS_PTRACE: "
    "nothing to declare (scripts/nonroot-tests.sh runs this)",
)
def test_kernel_declares_its_wrapper_which_runs_criu(
    kernel_factory: Factory, criu: Criu, tmp_path: Path
) -> None:
    """Non-root on a node with ptrace_scope 1: the kernel declares its wrapper as tracer
    (at start, in forked children, after a restore into a new wrapper), and every CRIU
    dump is a descendant of that wrapper, which is what Yama's rule needs; a restore keeps
    the restored tasks CRIU's descendants until it exits, then the wrapper adopts them."""
    script, log = _recording_criu(criu, tmp_path)
    env = {ENV_CRIU: str(script)}
    kernel = kernel_factory(env=env)
    inner = kernel.status()["inner_pid"]
    assert _declared(kernel) == [inner, kernel.process.pid]
    child = kernel.execute(
        "import os\nr, w = os.pipe()\npid = os.fork()\n"
        "if pid == 0:\n"
        "    os.write(w, ('%d %d %d' % (os.getpid(), *confinement.declared_ptracer)).encode())\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\nprint(os.read(r, 100).decode())"
    ).split()
    assert child[0] == child[1] != str(inner), "the forked child did not declare itself"
    assert child[2] == str(kernel.process.pid)

    kernel.execute("v = 41")
    kernel.snapshot(tmp_path / "s")
    dumps = [line.split() for line in log.read_text().splitlines() if line.startswith("dump")]
    assert dumps
    assert all(d[2] == str(kernel.process.pid) for d in dumps), dumps
    kernel.kill_all()

    restored = kernel_factory(restore_from=tmp_path / "s", env=env)
    assert restored.status()["inner_pid"] == inner
    # CRIU seizes every task it restored: without --restore-sibling they are its own
    # children (Yama lets it), and the wrapper adopts the kernel when CRIU exits.
    restores = [line for line in log.read_text().splitlines() if line.startswith("restore")]
    assert restores
    assert all("--restore-sibling" not in line for line in restores), restores
    assert proctree.parent(inner) == restored.process.pid
    wait_until(
        lambda: _declared(restored) == [inner, restored.process.pid],
        what="the restored kernel declaring its new wrapper",
    )
    restored.snapshot(tmp_path / "s2")
    dumps = [line.split() for line in log.read_text().splitlines() if line.startswith("dump")]
    assert dumps[-1][2] == str(restored.process.pid)
    assert restored.execute("print(v + 1)").strip() == "42"
