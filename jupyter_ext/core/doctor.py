"""`jupyter snapshot doctor`: what works on this machine, what is missing, how to fix it."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from .criu import Criu
from .errors import CriuNotFoundError

CAP_SYS_ADMIN = 21
CAP_CHECKPOINT_RESTORE = 40


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True
    """A failed required check means snapshots do not work; others limit features."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _effective_capabilities() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def check_privileges() -> Check:
    caps = _effective_capabilities()
    has = [
        name
        for bit, name in (
            (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"),
            (CAP_CHECKPOINT_RESTORE, "CAP_CHECKPOINT_RESTORE"),
        )
        if caps & (1 << bit)
    ]
    ok = os.geteuid() == 0 or len(has) == 2
    detail = "running as root" if os.geteuid() == 0 else f"uid {os.geteuid()}, capabilities: {has}"
    return Check(
        "privileges",
        ok,
        detail,
        fix="Run Jupyter as root, or grant CAP_SYS_ADMIN and CAP_CHECKPOINT_RESTORE "
        "(Kubernetes: securityContext.capabilities.add).",
    )


def check_criu(configured: str | None) -> tuple[Check, Criu | None]:
    try:
        criu = Criu.locate(configured)
    except CriuNotFoundError as exc:
        return Check("criu", False, exc.message, fix=exc.hint), None
    return Check(
        "criu", True, f"CRIU {criu.version_text} at {criu.path} (from {criu.source})"
    ), criu


def check_criu_works(criu: Criu | None) -> Check:
    if criu is None:
        return Check("criu check", False, "skipped: no CRIU", fix="Install CRIU first.")
    ok, text = criu.check()
    lines = [line for line in text.splitlines() if "kdat cache" not in line]
    return Check(
        "criu check",
        ok,
        lines[-1] if lines else "no output",
        fix="Read `criu check --all` for the missing kernel feature; a kernel >= 5.10 with "
        "CONFIG_CHECKPOINT_RESTORE is needed.",
    )


def _namespace_check(kind: str, what: str, required: bool) -> Check:
    ok = Path(f"/proc/self/ns/{kind}").exists()
    return Check(
        f"{kind} namespaces",
        ok,
        f"available ({what})" if ok else "not supported by this kernel",
        fix=f"Use a kernel with CONFIG_{kind.upper()}_NS.",
        required=required,
    )


def check_tools() -> Check:
    missing = [tool for tool in ("unshare",) if shutil.which(tool) is None]
    return Check(
        "util-linux",
        not missing,
        "unshare found" if not missing else f"missing: {', '.join(missing)}",
        fix="apt-get install util-linux",
    )


def check_sock_diag() -> Check:
    from .sockdiag import unix_sockets

    try:
        count = len(unix_sockets())
    except OSError as exc:
        return Check(
            "unix sock_diag",
            False,
            f"netlink sock_diag for unix sockets fails: {exc}",
            fix="Load the unix_diag kernel module (modprobe unix_diag).",
        )
    return Check("unix sock_diag", True, f"works ({count} unix sockets visible)")


def check_tcp_connections(criu: Criu | None) -> Check:
    """How kernels holding TCP connections fare here: said, because users ask it first."""
    from .criu import TCP_DUMP_OPTIONS

    if criu is None:
        return Check(
            "tcp connections", False, "skipped: no CRIU", fix="Install CRIU first.", required=False
        )
    return Check(
        "tcp connections",
        True,
        f"kernels holding TCP connections are snapshotted ({' '.join(TCP_DUMP_OPTIONS)}): "
        "no network lock (iptables, nftables) or CAP_NET_ADMIN needed, the running kernel's "
        "connections are untouched; after a restore they are closed and clients reconnect "
        "(restore hooks: docs/network.md)",
        required=False,
    )


def check_runtime_dir(runtime_dir: Path) -> Check:
    try:
        runtime_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=runtime_dir):
            pass
    except OSError as exc:
        return Check(
            "runtime directory",
            False,
            f"{runtime_dir} is not writable: {exc}",
            fix="Set JUPYTER_SNAPSHOT_RUNTIME_DIR to a writable directory.",
        )
    return Check("runtime directory", True, f"{runtime_dir} is writable")


def run_checks(
    criu_path: str | None = None,
    runtime_dir: Path | None = None,
    extra: list[Callable[[], Check]] | None = None,
) -> list[Check]:
    """Every check, in the order a person fixing the machine would go through them."""
    checks = [check_privileges()]
    criu_check, criu = check_criu(criu_path)
    checks += [criu_check, check_criu_works(criu)]
    checks += [
        _namespace_check("pid", "restored kernels get fresh PIDs", True),
        _namespace_check("time", "clocks continue across machines", False),
        check_tools(),
        check_sock_diag(),
        check_tcp_connections(criu),
    ]
    if runtime_dir is not None:
        checks.append(check_runtime_dir(runtime_dir))
    for factory in extra or []:
        checks.append(factory())
    return checks
