"""The wrapper's private runtime directory: the inner channels' endpoints, the control
socket, CRIU's work directories; removed when the wrapper ends, and by the next wrapper
that starts when a killed one could not."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from jupyter_ext.core import private
from jupyter_ext.core.errors import SnapshotError
from jupyter_ext.core.isolation import mountns
from jupyter_ext.core.protocol.environment import ENV_RUNTIME_DIR
from jupyter_ext.core.protocol.inner import INNER_PORTS, KERNEL_PORTS

log = logging.getLogger("kernel_wrapper")

#: Where kernels other than ipykernel bind their endpoints (see kernel_connection_file).
KERNEL_ENDPOINTS_ROOT = "/tmp"
#: The longest path a unix socket can have (``sockaddr_un.sun_path``, 108 bytes with its
#: NUL); the inner channels' sockets are ``ch-NNNNN`` in the runtime directory.
SOCKET_PATH_MAX = 107
#: A runtime directory without ``wrapper.pid`` this old (seconds) was left by a wrapper
#: that died while making it; a younger one is being made right now.
STALE_UNNAMED_SECONDS = 3600.0


class RuntimeDir:
    """This wrapper's directory under ``root``, held open for its whole life.

    The inner kernel reaches it only through an inherited directory descriptor
    (``/proc/self/fd/N``), never by its path: on restore CRIU hands the restored kernel
    this wrapper's descriptor in place of the old one, so any number of kernels restored
    from one snapshot can run side by side, on any machine.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / secrets.token_hex(8)
        longest = len(os.fsencode(self.path / "ch-65535"))
        if longest > SOCKET_PATH_MAX:
            raise SnapshotError(
                f"The kernel's channels cannot live in {root}: their sockets' paths would "
                f"be {longest} bytes long, and a unix socket's path holds at most "
                f"{SOCKET_PATH_MAX}.",
                hint=f"Set {ENV_RUNTIME_DIR} to a shorter directory for the kernel wrappers "
                "(by default /run/jupyter-kernel-snapshots as root, "
                "/tmp/jupyter-kernel-snapshots-UID otherwise).",
            )
        private.make_dirs(root)
        self.path.mkdir(mode=0o700)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        self._kernel_dirs: list[Path] = []
        tmp = self.path / "wrapper.pid.tmp"
        tmp.write_text(f"{os.getpid()} {self.fd}\n")
        os.replace(tmp, self.path / "wrapper.pid")
        try:
            remove_stale_runtime_dirs(root)
        except OSError as exc:  # never a reason not to start
            log.warning("could not look for stale runtime directories: %s", exc)

    @property
    def inner_path(self) -> str:
        """The directory as the inner kernel names it."""
        return f"/proc/self/fd/{self.fd}"

    def inner_connection_file(self, connection: dict[str, Any]) -> Path:
        """The inner kernel's connection file: ipc endpoints in this directory, no key (the
        wrapper checks and signs every message, see relay.Relay.unsign)."""
        path = self.path / "inner.json"
        info = {
            "transport": "ipc",
            "ip": f"{self.inner_path}/ch",
            "key": "",
            "signature_scheme": connection.get("signature_scheme", "hmac-sha256"),
            "kernel_name": connection.get("kernel_name", ""),
        }
        info.update({f"{name}_port": port for name, port in INNER_PORTS.items()})
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(info, fh)
        return path

    def kernel_connection_file(self, connection: dict[str, Any]) -> Path:
        """The connection file of a kernel other than ipykernel, which binds what it names
        (kernel_wrapper.inkernel.bridge), and a key of its own, which only the kernel and
        the bridge in its tree hold. Its ipc endpoints are in a new private directory
        under /tmp (0700; the bridge removes them once connected): a short path, since
        xeus-python (0.19) fails to start ("RuntimeError: Invalid argument") with an ipc
        ``ip`` longer than 23 characters, and one every machine has, where CRIU binds the
        sockets again (and removes them) on restore."""
        endpoints = kernel_endpoints_dir(self.path.name)
        try:
            endpoints.mkdir(mode=0o700)
        except FileExistsError:  # another wrapper's name begins alike: one of our own
            endpoints = Path(tempfile.mkdtemp(prefix="jks-", dir=KERNEL_ENDPOINTS_ROOT))
        self._kernel_dirs.append(endpoints)
        path = self.path / "kernel.json"
        info = {
            "transport": "ipc",
            "ip": str(endpoints / "k"),
            "key": secrets.token_hex(32),
            "signature_scheme": "hmac-sha256",
            "kernel_name": connection.get("kernel_name", ""),
        }
        info.update({f"{name}_port": port for name, port in KERNEL_PORTS.items()})
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(info, fh)
        return path

    def remove(self) -> None:
        os.close(self.fd)
        shutil.rmtree(self.path, ignore_errors=True)
        for endpoints in self._kernel_dirs:  # a kernel that never bound them all
            shutil.rmtree(endpoints, ignore_errors=True)


def runtime_dir_in_use(directory: Path) -> bool:
    """Whether a live wrapper owns a runtime directory, by its ``wrapper.pid`` ("PID DIRFD").

    Live means: process PID runs ``kernel_wrapper`` and holds this very directory open at
    DIRFD (that survives PID reuse, also by another wrapper). Anything that cannot be
    proven dead (unreadable, no permission) counts as in use.
    """
    try:
        pid_text, fd_text = (directory / "wrapper.pid").read_text().split()
        pid, fd = int(pid_text), int(fd_text)
    except FileNotFoundError:
        try:
            age = time.time() - directory.stat().st_mtime
        except FileNotFoundError:
            return True  # gone already
        return age < STALE_UNNAMED_SECONDS
    except (OSError, ValueError):
        return True
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False  # no such process
    except OSError:
        return True
    if b"kernel_wrapper" not in cmdline:
        return False  # the PID is another program's now (or a zombie's)
    try:
        theirs = os.stat(f"/proc/{pid}/fd/{fd}")
        ours = os.stat(directory)
    except FileNotFoundError:
        return False  # that wrapper does not hold it (any more)
    except OSError:
        return True
    return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)


def remove_stale_runtime_dirs(root: Path) -> list[Path]:
    """Remove the runtime directories of wrappers that died without removing their own
    (kill -9, a node's processes killed, an OOM kill); they would stay forever. Called by
    every wrapper that starts; live wrappers' directories are never touched."""
    removed: list[Path] = []
    for directory in root.iterdir():
        if directory.is_symlink() or not directory.is_dir():
            continue
        if not runtime_dir_in_use(directory):
            log.info("removing the runtime directory of a dead wrapper: %s", directory)
            mountns.detach_below(directory)  # a private view's tmpfs (core/isolation/privatetmp.py)
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
            # Its kernel's endpoints, if it died before the kernel had bound them all.
            endpoints = kernel_endpoints_dir(directory.name)
            with contextlib.suppress(OSError):
                if endpoints.lstat().st_uid == os.geteuid() and endpoints.is_dir():
                    shutil.rmtree(endpoints, ignore_errors=True)
    return removed


def kernel_endpoints_dir(runtime_name: str) -> Path:
    """Where the kernel of the runtime directory ``runtime_name`` (behind the bridge)
    binds its endpoints: named after it, so that what a killed wrapper left there goes
    with its runtime directory."""
    return Path(KERNEL_ENDPOINTS_ROOT) / f"jks-{runtime_name[:8]}"
