"""`jupyter snapshot doctor`: what works on this machine, what is missing, how to fix it."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .agent.client import AgentCriu
from .criu import REQUIRED_FEATURES, UNPRIVILEGED_CAPS, Criu, unprivileged
from .errors import CriuNotFoundError, SnapshotError
from .isolation.confinement import CAP_CHECKPOINT_RESTORE, CAP_SETPCAP, Confinement, seccomp_blocker
from .memtrack import TrackingUnavailable, open_tracking_fd, why_unavailable
from .private import exposed, make_dirs, others_can_replace
from .protocol.environment import ENV_AGENT_SOCKET, ENV_KEY, ENV_RUNTIME_DIR
from .store import SnapshotStore
from .store.api import StoreError, StoreReport
from .store.keys import KEEP_PASSPHRASE, LOST_KEY, RECOVER

VFS_CAP_FLAGS_EFFECTIVE = 0x1
ST_NOSUID = 2
GRANT_HINT = (
    f"As root: 'scripts/install-criu.sh' (setcap {UNPRIVILEGED_CAPS} on the product's CRIU "
    "copy, executable by the group jupyter-snapshots), then 'usermod -aG jupyter-snapshots "
    "USER' and log in again; in a container see docs/nonroot.md."
)


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


def check_privileges(*, agent_mode: bool = False) -> Check:
    """Root, non-root mode (docs/nonroot.md) or agent mode (docs/agent.md): each works,
    with different limits."""
    if not unprivileged():
        return Check("privileges", True, "running as root" + (", agent mode" * agent_mode))
    how = (
        "agent mode (the node agent runs CRIU for this server, as this uid, in this pod's "
        "namespaces"
        if agent_mode
        else "non-root mode (CRIU --unprivileged on the file capabilities of its binary"
    )
    return Check(
        "privileges",
        True,
        f"uid {os.geteuid()}: {how}; kernels without PID and time namespaces of their own)",
        required=False,
    )


def file_capabilities(path: Path) -> tuple[int, bool]:
    """The permitted file capabilities of ``path`` and whether they are effective, from
    its ``security.capability`` attribute (what ``getcap`` prints); (0, False) if none."""
    try:
        raw = os.getxattr(path, "security.capability")
    except OSError:
        return 0, False
    if len(raw) < 12:
        return 0, False
    words = [int.from_bytes(raw[i : i + 4], "little") for i in range(0, len(raw) - 3, 4)]
    permitted = words[1] | (words[3] << 32 if len(words) > 3 else 0)
    return permitted, bool(words[0] & VFS_CAP_FLAGS_EFFECTIVE)


def check_criu_capabilities(criu: Criu | None) -> Check:
    """Without root: whether this user can run CRIU with the capabilities it needs, and if
    not, which privilege is missing and how to grant it."""
    name = "criu capabilities"
    if not unprivileged():
        return Check(name, True, "not needed: running as root", required=False)
    if criu is None:
        return Check(name, False, "skipped: no CRIU", fix="Install CRIU first.")
    path = criu.path.resolve()
    needed = {CAP_CHECKPOINT_RESTORE: "cap_checkpoint_restore", CAP_SETPCAP: "cap_setpcap"}
    permitted, effective = file_capabilities(path)
    missing = [cap for bit, cap in needed.items() if not permitted & (1 << bit)]
    if missing or not effective:
        return Check(
            name,
            False,
            f"{path} lacks the file capabilities {','.join(missing) or 'effective flag'} "
            "(CAP_CHECKPOINT_RESTORE reads the kernel's mappings and sets the restored "
            "process ids; CAP_SETPCAP lets a restore trim the bounding set).",
            fix=GRANT_HINT,
        )
    if os.statvfs(path).f_flag & ST_NOSUID:
        return Check(
            name,
            False,
            f"{path} is on a file system mounted nosuid: its file capabilities are ignored.",
            fix="Install CRIU on a file system without nosuid (scripts/install-criu.sh PREFIX).",
        )
    confinement = Confinement.read()
    for blocker in confinement.blockers(unprivileged=True):
        if blocker.name in ("no_new_privs", "bounding set"):
            return Check(name, False, blocker.message, fix=blocker.fix)
    return Check(
        name,
        True,
        f"{path} has {UNPRIVILEGED_CAPS}, in this process's bounding set, no no_new_privs",
    )


def check_pid_namespaces() -> Check:
    """What a kernel without a PID namespace of its own (non-root mode) cannot do."""
    if not unprivileged():
        return _namespace_check("pid", "restored kernels get fresh PIDs", True)
    return Check(
        "pid namespaces",
        False,
        "not used without root: a restored kernel keeps its process ids, so they must be "
        "free (restore in place, resume after suspend and restore on a fresh node work; two "
        "kernels restored from one snapshot cannot run side by side, and a snapshot taken "
        "as root restores only as root)",
        fix="Run Jupyter as root (CRIU needs CAP_SYS_ADMIN to dump a kernel in its own PID "
        "namespace); docs/nonroot.md",
        required=False,
    )


def check_node_agent(socket_path: Path) -> tuple[Check, AgentCriu | None]:
    """Agent mode (docs/agent.md): the node agent answers a hello on its socket, in this
    server's protocol version, and takes this pod for a user's pod. If not, the cause (no
    socket volume, no agent on the node, another release) and what to do."""
    name = "node agent"
    try:
        agent = AgentCriu.connect(socket_path)
    except SnapshotError as exc:
        return Check(name, False, exc.message, fix=exc.hint), None
    hello = agent.hello
    return Check(
        name,
        True,
        f"answers on {socket_path} (${ENV_AGENT_SOCKET}): protocol version {hello.version}, "
        f"CRIU {hello.criu_version}; it takes this server for the pod {hello.pod_name!r} "
        f"of user {hello.owner!r} (its snapshots are sealed for that pod name)",
    ), agent


AGENT_RUNS_CRIU = Check(
    "criu in the pod",
    True,
    "not needed in agent mode: the node agent runs CRIU for this pod's kernels, with the "
    "privileges a pod at Pod Security baseline lacks (CHECKPOINT_RESTORE, SYS_ADMIN to "
    "suspend the kernel's seccomp filter, NET_ADMIN for TCP repair); this pod's missing "
    "capabilities, no_new_privs and seccomp profile do not stop snapshots (docs/agent.md)",
    required=False,
)


def check_agent_yama(scope: int | None) -> Check:
    """Yama in agent mode: the agent's CRIU is neither the kernel's ancestor nor its
    declared tracer, and attaches with CAP_SYS_PTRACE (nodeagent/podcriu.py), which
    Yama accepts up to scope 2; at 3 nothing may attach."""
    name = "yama ptrace_scope"
    if scope is None:
        return Check(name, True, "no Yama on this kernel", required=False)
    if scope < 3:
        return Check(
            name,
            True,
            f"{scope}: the node agent's CRIU attaches with CAP_SYS_PTRACE, which Yama "
            "accepts at this scope",
            required=False,
        )
    return Check(
        name,
        False,
        f"{scope} on this node: Yama lets no process attach to another, not even with "
        "CAP_SYS_PTRACE, so the node agent's CRIU cannot dump or restore a kernel",
        fix="Boot the user nodes with kernel.yama.ptrace_scope 2 or lower (3 cannot be "
        "lowered without a reboot; a node image's sysctl.d sets it).",
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
    """The kernel features a dump and a restore of a kernel need (``criu check --feature``).
    Not the whole ``criu check``: in a container it fails on the read-only
    ``ns_last_pid``, which restores do not use (they pick process ids with clone3)."""
    if criu is None:
        return Check("criu features", False, "skipped: no CRIU", fix="Install CRIU first.")
    missing = [(feature, said) for feature, ok, said in criu.check_features() if not ok]
    if missing:
        return Check(
            "criu features",
            False,
            "; ".join(f"{feature}: {said}" for feature, said in missing),
            fix="A Linux kernel >= 5.10 with CONFIG_CHECKPOINT_RESTORE, CONFIG_KCMP and "
            "CONFIG_FHANDLE is needed; `criu check --feature NAME` says more.",
        )
    return Check("criu features", True, f"supported: {', '.join(REQUIRED_FEATURES)}")


def check_confinement(
    confinement: Confinement | None = None, *, as_user: bool | None = None
) -> list[Check]:
    """Seccomp, Yama's ptrace_scope and /proc/sys: what a pod or node sets around the
    server that stops CRIU, read from /proc unless given (no_new_privs and the bounding
    set are part of :func:`check_criu_capabilities`). ``as_user``: non-root mode (default:
    this process's)."""
    confinement = confinement or Confinement.read()
    user = unprivileged() if as_user is None else as_user
    if confinement.seccomp:
        blocker = seccomp_blocker(confinement.seccomp)
        seccomp = Check("seccomp", False, blocker.message, fix=blocker.fix)
    else:
        seccomp = Check("seccomp", True, "no seccomp filter (Seccomp: 0), as CRIU needs")
    yama = confinement.yama_blocker(unprivileged=user)
    scope = confinement.yama_scope
    if yama is not None:
        ptrace = Check("yama ptrace_scope", False, yama.message, fix=yama.fix)
    elif scope is None:
        ptrace = Check("yama ptrace_scope", True, "no Yama on this kernel", required=False)
    else:
        how = (
            "each kernel declares its wrapper, CRIU's parent, as its tracer "
            "(PR_SET_PTRACER) and restores keep the restored tasks CRIU's children; child "
            "processes a kernel starts with subprocess cannot be snapshotted without root"
            if scope == 1 and user
            else "no limit for CRIU here"
        )
        ptrace = Check("yama ptrace_scope", True, f"{scope}: {how}", required=False)
    proc_sys = Check(
        "/proc/sys",
        True,
        "writable"
        if confinement.proc_sys_writable
        else "read-only (as in any container): not needed, restores pick process ids with "
        "clone3 instead of ns_last_pid",
        required=False,
    )
    return [seccomp, ptrace, proc_sys]


def skipped(name: str, agent_mode: bool) -> Check:
    """A check that needs CRIU (or the node agent, in agent mode), which is missing."""
    if agent_mode:
        return Check(
            name,
            False,
            "skipped: the node agent does not answer",
            fix="See 'node agent' above.",
            required=False,
        )
    return Check(name, False, "skipped: no CRIU", fix="Install CRIU first.", required=False)


def check_lazy_pages(criu: Criu | None, *, agent_mode: bool = False) -> Check:
    """Lazy restore (CRIU's userfaultfd lazy pages): the first cell of a restored kernel
    runs before its memory has arrived. Without it restores copy every page first."""
    name = "lazy restore"
    if criu is None:
        return skipped(name, agent_mode)
    ok, said = criu.supports_lazy_pages()
    if ok:
        return Check(name, True, f"supported ({said})", required=False)
    where = (
        "in-pod mode as root (docs/agent.md, 'What agent mode does not do')"
        if isinstance(criu, AgentCriu)
        else "Jupyter as root on a Linux kernel with userfaultfd (CONFIG_USERFAULTFD, >= 4.11)"
    )
    return Check(
        name,
        False,
        f"not possible here, restores copy every page first: {said}",
        fix=f"Lazy restores need {where}; set SnapshotExtensionApp.lazy_restore = False to "
        "silence this.",
        required=False,
    )


def check_memory_tracking(criu: Criu | None, *, agent_mode: bool = False) -> Check:
    """Memory tracking between snapshots: a kernel's later snapshots copy only what it
    wrote since its previous one (docs/storage.md, "Snapshots cost what changed")."""
    name = "memory tracking"
    if criu is None:
        return skipped(name, agent_mode)
    kind, said = criu.dirty_tracking()
    if kind == "userfaultfd":
        try:
            os.close(open_tracking_fd())
        except TrackingUnavailable as exc:
            kind, said = None, f"this process cannot open a userfaultfd: {why_unavailable(exc)}"
    if kind is not None:
        return Check(name, True, f"later snapshots copy what changed ({said})", required=False)
    where = (
        "Give the user pods a seccomp profile that allows userfaultfd (docs/agent.md, "
        "'Memory tracking'), or accept that every snapshot is a full copy."
        if agent_mode
        else "Use the CRIU that scripts/install-criu.sh builds, on Linux >= 6.7 (or a kernel "
        "with CONFIG_MEM_SOFT_DIRTY), without a seccomp filter that blocks userfaultfd."
    )
    return Check(
        name,
        False,
        f"every snapshot copies the whole memory, frozen: {said}",
        fix=where,
        required=False,
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
    from .carried.sockdiag import unix_sockets

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


TCP_REPAIR = 19


def tcp_repair_allowed() -> tuple[bool, str]:
    """Whether this process may put a TCP socket into repair mode (CAP_NET_ADMIN in its
    network namespace), which CRIU needs to keep a connection's state."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.setsockopt(socket.SOL_TCP, TCP_REPAIR, 1)
        except OSError as exc:
            return False, exc.strerror or str(exc)
    return True, "allowed"


def check_tcp_connections(criu: Criu | None, *, agent_mode: bool = False) -> Check:
    """How kernels holding TCP connections fare here: said, because users ask it first."""
    from .criu import TCP_DUMP_OPTIONS

    if criu is None:
        return skipped("tcp connections", agent_mode)
    closed = (
        f"kernels holding TCP connections are snapshotted ({' '.join(TCP_DUMP_OPTIONS)} for "
        "connections to outside peers): no network lock (iptables, nftables) needed, the "
        "running kernel's connections are untouched; after a restore connections to outside "
        "peers are closed and clients reconnect (restore hooks: docs/network.md)"
    )
    if isinstance(criu, AgentCriu):
        repair, said = True, "by the node agent's CRIU, which has CAP_NET_ADMIN"
    else:
        repair, said = tcp_repair_allowed()
        repair = repair and criu.keeps_tcp()
    if repair:
        return Check(
            "tcp connections",
            True,
            closed + "; connections between the kernel's own processes (managers, Dask, "
            f"process pools on TCP) are kept: they come back established (TCP repair {said})",
            required=False,
        )
    return Check(
        "tcp connections",
        False,
        closed + "; connections between the kernel's own processes come back closed too: "
        f"keeping them needs TCP repair mode (CAP_NET_ADMIN, root), here: {said}",
        fix="Run Jupyter as root with CAP_NET_ADMIN to keep a Dask cluster or a "
        "multiprocessing manager connected across restores (docs/network.md).",
        required=False,
    )


def check_copies_side_by_side() -> Check:
    """Whether a copy restored beside a kernel that holds its ports can have a network
    namespace of its own (core/isolation/netns.py)."""
    from .isolation.netns import slirp_path
    from .isolation.privatetmp import overlay_supported

    name = "copies side by side"
    if unprivileged():
        return Check(
            name,
            False,
            "without root a copy whose ports (listening) another kernel holds here is "
            "refused (no network namespace of its own)",
            fix="Run Jupyter as root (docs/network.md, docs/nonroot.md).",
            required=False,
        )
    slirp = slirp_path()
    if slirp is None:
        return Check(
            name,
            False,
            "slirp4netns is missing: a copy whose ports another kernel holds here (a copy "
            "of a kernel with a Dask cluster or a manager beside the original) is refused",
            fix="apt-get install slirp4netns",
            required=False,
        )
    if not overlay_supported():
        return Check(
            name,
            False,
            "overlayfs is missing: a copy of a kernel whose workers lock files in its "
            "temporary directory (Dask) beside the original is refused "
            "(core/isolation/privatetmp.py)",
            fix="modprobe overlay",
            required=False,
        )
    return Check(
        name,
        True,
        "a copy whose ports another kernel holds here gets a network namespace of its own, "
        f"reaching out through {slirp} (the server's loopback at 10.0.2.2), and a private "
        "view of its temporary directory where the other holds its file locks (overlayfs)",
        required=False,
    )


def check_runtime_dir(runtime_dir: Path) -> Check:
    try:
        make_dirs(runtime_dir)
        with tempfile.NamedTemporaryFile(dir=runtime_dir):
            pass
    except OSError as exc:
        return Check(
            "runtime directory",
            False,
            f"{runtime_dir} is not writable: {exc}",
            fix=f"Set {ENV_RUNTIME_DIR} to a writable directory.",
        )
    return Check("runtime directory", True, f"{runtime_dir} is writable")


def check_private(paths: list[Path]) -> Check:
    """Whether another user can read anything of the product's (a snapshot is a kernel's
    whole memory), or replace a directory of it through a parent open to them."""
    name = "private files"
    open_to_others = [found for path in paths for found in exposed(path)]
    replaceable = [(path, parent) for path in paths if (parent := others_can_replace(path))]
    if not open_to_others and not replaceable:
        shown = ", ".join(str(p) for p in paths)
        return Check(name, True, f"only this user can read {shown}", required=False)
    detail = []
    if open_to_others:
        listed = ", ".join(found.describe() for found in open_to_others[:5])
        more = f" and {len(open_to_others) - 5} more" if len(open_to_others) > 5 else ""
        detail.append(f"other users can read or list {listed}{more}")
    for path, parent in replaceable:
        detail.append(f"other users may replace {path}: {parent} is writable by all")
    return Check(
        name,
        False,
        "; ".join(detail),
        fix="Start the Jupyter server once (it makes its store and work directory "
        "owner-only and logs what it changed), or run 'chmod -R go= DIR'; keep the store "
        "in a directory only you can write to (docs/nonroot.md, 'Who can read a snapshot').",
        required=False,
    )


CREDENTIAL_FILE_WORDS = ("aws_access_key_id", "web_identity_token_file", "credential_process")
"""What in an AWS config or credentials file makes boto3 get credentials from it."""


def check_bucket_credentials(
    environ: Mapping[str, str], home: Path, store: str = "", hub_service_url: str = ""
) -> Check:
    """Under a hub, bucket credentials a user's server can get reach every user's
    snapshots when every server gets the same (one Secret, one pod role): the user's own
    code gets them as the server does (docs/jupyterhub.md). ``store`` and
    ``hub_service_url``: the server's options (an s3 store without the hub service takes
    credentials of its own)."""
    name = "bucket credentials"
    if not (environ.get("JUPYTERHUB_API_TOKEN") or environ.get("JUPYTERHUB_USER")):
        return Check(name, True, "not under JupyterHub", required=False)
    found = []
    if environ.get("AWS_ACCESS_KEY_ID"):
        found.append(
            "AWS_ACCESS_KEY_ID with AWS_SESSION_TOKEN in the environment (temporary, but "
            "shared unless a session policy scopes them to this user's prefix, which "
            "doctor cannot tell)"
            if environ.get("AWS_SESSION_TOKEN")
            else "AWS_ACCESS_KEY_ID in the environment"
        )
    if environ.get("AWS_WEB_IDENTITY_TOKEN_FILE"):
        found.append(
            "the pod's web identity (AWS_WEB_IDENTITY_TOKEN_FILE, IRSA: the role of a "
            "service account every user's pod shares)"
        )
    for variable in (
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    ):
        if environ.get(variable):
            found.append(f"the container's credentials endpoint ({variable}: a pod role)")
    files = {Path(environ.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials")}
    files.add(Path(environ.get("AWS_CONFIG_FILE") or home / ".aws" / "config"))
    for path in sorted(files):
        try:
            text = path.read_text(errors="replace").lower()
        except OSError:
            continue
        if any(word in text for word in CREDENTIAL_FILE_WORDS):
            found.append(f"credentials in {path}")
    if store == "s3" and not hub_service_url:
        found.append(
            "the s3 store without the hub service (hub_service_url unset): the server "
            "signs its requests with credentials of its own"
        )
    if not found:
        return Check(name, True, "no bucket credentials in this server", required=False)
    return Check(
        name,
        False,
        f"this hub server can get bucket credentials ({'; '.join(found)}): code in any "
        "kernel can get them too, and where every user's server gets the same (the "
        "shared-Secret mode, one pod role) read and delete every user's snapshots. Unsafe "
        "for multi-user hubs.",
        fix="Run the product's hub service (python -m jupyter_ext.hubservice) and set "
        "SnapshotExtensionApp.hub_service_url; remove the credentials and roles from the "
        "servers (deploy/z2jh/config.yaml, docs/jupyterhub.md).",
        required=False,
    )


def check_store_server(settings: Mapping[str, Any], environ: Mapping[str, str]) -> Check:
    """Probe the S3 server of the store ``settings`` (the server's options) describe, with
    harmless requests in a scratch prefix of the user's (core/store/probe.py), through the
    hub service where there is one: whether it honours conditional writes, and under a hub
    whether it keeps users apart (issue 45)."""
    import boto3

    from .store.backend.s3 import S3Options
    from .store.hubclient import TOKEN_ENV, HubClient
    from .store.probe import Signer, probe_server
    from .store.stores import StoreSpec

    name = "store server"
    try:
        options = StoreSpec.from_settings(settings).options
    except StoreError as exc:
        return Check(name, False, exc.message, fix=exc.hint, required=False)
    if not isinstance(options, S3Options):
        return Check(name, True, "not an S3 store: nothing to probe", required=False)
    region = options.region or boto3.session.Session().region_name or "us-east-1"

    try:
        if options.hub_service_url:
            service = HubClient(options.hub_service_url, environ.get(TOKEN_ENV, ""))
            signer = Signer(service=service)
        else:
            credentials = boto3.session.Session().get_credentials()
            if credentials is None:
                return Check(
                    name,
                    False,
                    "no credentials for the bucket (boto3's chain found none)",
                    fix="Give the server the bucket's credentials, or set hub_service_url.",
                )
            signer = Signer(credentials.get_frozen_credentials(), region)
        checks = probe_server(options.endpoint_url, region, options.bucket, options.prefix, signer)
    except StoreError as exc:
        return Check(name, False, f"could not probe it: {exc.message}", fix=exc.hint)
    found = f"{checks.endpoint} {'; '.join(checks.findings())}"
    if not (environ.get("JUPYTERHUB_API_TOKEN") or environ.get("JUPYTERHUB_USER")):
        return Check(name, True, found, required=False)
    if not options.hub_service_url or (checks.keeps_users_apart and not checks.lax):
        return Check(name, True, f"{checks.verdict()} It {found}", required=False)
    return Check(
        name,
        False,
        f"{checks.verdict()} It {found}",
        fix="Move the hub's store to an S3 server that refuses x-amz-* headers a request's "
        "signature does not cover (docs/jupyterhub.md, 'What is protected from whom').",
        required=False,
    )


def check_encryption(source: str, key_file: Path, environ: Mapping[str, str]) -> Check:
    """Whether the store is encrypted, where its key is, and that a lost key loses every
    snapshot: said before anyone loses it."""
    name = "store encryption"
    if source == "none":
        return Check(
            name,
            False,
            "off (encryption_key_source 'none'): whoever may read the store or the bucket "
            "reads every snapshot, the kernels' whole memory",
            fix="Set SnapshotExtensionApp.encryption_key_source to 'file' (the default) or "
            "'env'; then 'jupyter snapshot store encrypt' for the snapshots stored so far.",
            required=False,
        )
    if source == "env":
        if not environ.get(ENV_KEY):
            return Check(
                name,
                False,
                f"on, key from ${ENV_KEY}, which is not set here: the server cannot read "
                "or write its store",
                fix=f"Set {ENV_KEY} (32 random bytes, base64) in the server's environment.",
            )
        return Check(name, True, f"on (AES-256-GCM), key from ${ENV_KEY}. {LOST_KEY}")
    if source == "hub":
        return Check(
            name,
            True,
            "on (AES-256-GCM), key from the hub service, derived there from the hub's secret "
            "and this user's name: without the service's key secrets (--key-secrets-file) "
            "no snapshot of any user can be read; its admin keeps a copy somewhere safe.",
        )
    if source != "file":
        return Check(name, True, f"on (AES-256-GCM), key from the {source!r} source. {LOST_KEY}")
    try:
        mode = key_file.stat().st_mode & 0o777
    except FileNotFoundError:
        return Check(
            name,
            True,
            f"on (AES-256-GCM); the key file {key_file} is made at the first snapshot. " + LOST_KEY,
        )
    except OSError as exc:
        return Check(name, False, f"on, but the key file {key_file} cannot be read: {exc}")
    if mode & 0o077:
        return Check(
            name,
            False,
            f"on, but the key file {key_file} is readable by others (mode {mode:04o})",
            fix=f"chmod 600 {key_file}",
        )
    return Check(name, True, f"on (AES-256-GCM), key file {key_file} (0600). {LOST_KEY}")


def check_store(open_store: Callable[[], SnapshotStore]) -> tuple[Check, Check | None]:
    """The server's store: is it whole (:func:`check_store_whole`), and would its key be
    lost with this machine (None: it would not)."""
    try:
        store = open_store()
        try:
            found, notice = store.check(), store.key_notice()
        finally:
            store.close()
    except SnapshotError as exc:
        return Check(STORE, False, f"the store cannot be checked: {exc}", required=False), None
    copy = None
    if notice:
        copy = Check(
            "store key copy",
            False,
            notice,
            fix=f"{KEEP_PASSPHRASE} (once; on another machine: {RECOVER})",
            required=False,
        )
    return check_store_whole(found), copy


STORE = "store integrity"


def check_store_whole(found: StoreReport) -> Check:
    """``store check`` without reading the data: the key, every record, every pack a
    snapshot needs and its trailer. Damage names the snapshots it breaks."""
    name = STORE
    lines = found.lines()
    if found.to_dict()["ok"]:
        return Check(name, True, " ".join(lines[:2]))
    return Check(
        name,
        False,
        " ".join(lines),
        fix="'jupyter snapshot store check --read-data' for every chunk; delete the broken "
        "snapshots it names, then 'jupyter snapshot store prune'.",
        required=False,
    )


def run_checks(
    criu_path: str | None = None,
    runtime_dir: Path | None = None,
    extra: list[Callable[[], Check]] | None = None,
    private_dirs: list[Path] | None = None,
    store_checks: tuple[Check, ...] = (),
    agent_socket: Path | None = None,
) -> list[Check]:
    """Every check, in the order a person fixing the machine would go through them.
    ``agent_socket`` (agent mode, ``$JUPYTER_SNAPSHOT_AGENT_SOCKET``): the node agent
    runs CRIU, so it is checked instead of CRIU in this process's confinement."""
    agent_mode = agent_socket is not None
    checks = [check_privileges(agent_mode=agent_mode)]
    criu: Criu | None
    if agent_socket is not None:
        agent_check, criu = check_node_agent(agent_socket)
        confinement = Confinement.read()
        checks += [agent_check, AGENT_RUNS_CRIU, check_agent_yama(confinement.yama_scope)]
    else:
        criu_check, criu = check_criu(criu_path)
        checks += [criu_check, check_criu_capabilities(criu), *check_confinement()]
        checks.append(check_criu_works(criu))
    checks.append(check_lazy_pages(criu, agent_mode=agent_mode))
    checks.append(check_memory_tracking(criu, agent_mode=agent_mode))
    checks += [
        check_pid_namespaces(),
        _namespace_check("time", "clocks continue across machines", False)
        if not unprivileged()
        else Check(
            "time namespaces",
            False,
            "not used without root: the monotonic clock of a kernel restored on another "
            "machine jumps to that machine's",
            fix="Run Jupyter as root; docs/nonroot.md",
            required=False,
        ),
        check_tools(),
        check_sock_diag(),
        check_tcp_connections(criu, agent_mode=agent_mode),
        check_copies_side_by_side(),
    ]
    if runtime_dir is not None:
        checks.append(check_runtime_dir(runtime_dir))
    if private_dirs:
        checks.append(check_private(private_dirs))
    checks += store_checks
    for factory in extra or []:
        checks.append(factory())
    return checks
