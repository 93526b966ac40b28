"""Images the agent hands out are sealed; it restores only images with its seal.

A restore runs CRIU as root: the images say which credentials, capabilities and seccomp
filter the restored processes get, so an image a pod made up would be a way to root on
the node. The agent therefore seals what it dumps with an HMAC-SHA256, under a key that
only the agents hold (a Secret mounted into the DaemonSet, never into user pods), over
the pod's name (KubeSpawner's, unique per user and server, and the same for the next pod
of that server) and every image file's name, size and sha256. A pod keeps its images (in
its store, on S3), and gives them back for a restore, each with its size; the agent
copies them into its own directory first (regular files only, no byte past the size
given, the sizes' sum within the agent's budget), hashes its copy, and runs CRIU on it
only if the seal matches the calling pod's name: another pod's images, or altered ones,
are refused.

Each file is also sealed on its own (:meth:`ImageSetSealer.seal_file`: the pod's name and the
file's name, size and sha256). A tracked dump builds on the images of an earlier dump or
pre-dump, and a restore of it needs the memory levels of several dumps (core/criu/chain.py),
of which the pod keeps only some files: each such file is checked against its own seal,
so that every byte CRIU reads is still one the agent wrote for that pod.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from jupyter_ext.core.agent.protocol import AgentRequestError

#: Bytes read at a time when images are hashed or copied.
BLOCK = 1 << 20


@dataclass(frozen=True)
class ImageFile:
    name: str
    size: int
    sha256: str


class ImageSetSealer:
    """Seals and checks image sets with the agents' shared key."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 32:
            raise ValueError("the sealing key must have at least 32 bytes")
        self._key = key

    @classmethod
    def from_file(cls, path: Path) -> ImageSetSealer:
        """The key in ``path``, made (random, 0600) if there is none: one node's agent can
        then restore only what it dumped itself; give every node's agent the same file (a
        Secret) to restore on another node."""
        try:
            return cls(path.read_bytes())
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, os.urandom(32))
            finally:
                os.close(fd)
            return cls(path.read_bytes())

    def seal(self, pod_name: str, files: list[ImageFile]) -> str:
        record = {
            "v": 2,
            "pod": pod_name,
            "files": [[f.name, f.size, f.sha256] for f in sorted(files, key=lambda f: f.name)],
        }
        message = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def seal_file(self, pod_name: str, file: ImageFile) -> str:
        record = {"v": 3, "pod": pod_name, "file": [file.name, file.size, file.sha256]}
        message = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def check(self, pod_name: str, files: list[ImageFile], seal: str) -> None:
        if not hmac.compare_digest(self.seal(pod_name, files), seal):
            raise _not_sealed(pod_name, "these images are")

    def check_files(self, pod_name: str, files: list[tuple[str, ImageFile, str]]) -> None:
        """Each file (its path in the request, its copy, its seal) sealed on its own."""
        for path, file, seal in files:
            if not hmac.compare_digest(self.seal_file(pod_name, file), seal):
                raise _not_sealed(pod_name, f"the image {path} is")


def _not_sealed(pod_name: str, what: str) -> AgentRequestError:
    return AgentRequestError(
        f"The node agent refused the request: {what} not sealed for the pod {pod_name!r} by "
        "the agents of this cluster (another user's or another server's snapshot, altered "
        "images, or a snapshot of an older agent).",
        hint="Restore a snapshot this user's server took; a snapshot taken with in-pod CRIU "
        "cannot be restored through the agent.",
    )


def hash_file(path: Path) -> ImageFile:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while block := f.read(BLOCK):
            digest.update(block)
            size += len(block)
    return ImageFile(path.name, size, digest.hexdigest())


def copy_in(fd: int, size: int, dest: Path, owner: tuple[int, int]) -> ImageFile:
    """Copy the ``size`` bytes the caller's ``fd`` holds into the new file ``dest`` (of
    ``owner``, uid and gid: CRIU reads it as the caller's user), hashing the copy's bytes
    as written (the caller may change its file meanwhile; what is checked and restored is
    this copy). Only a regular file of that very size is taken: a pipe, a device or a
    socket could be read forever, and not a byte more than declared is written."""
    name = dest.name
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise _bad_image(f"the image {name} was not given as a regular file")
    if info.st_size != size:
        raise _bad_image(f"the image {name} has {info.st_size} bytes, not the {size} declared")
    digest = hashlib.sha256()
    copied = 0
    out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchown(out, *owner)
        while copied < size:
            block = _read(fd, min(BLOCK, size - copied), copied, name)
            if not block:
                raise _bad_image(f"the image {name} ended after {copied} of {size} bytes")
            digest.update(block)
            _write_all(out, block, dest)
            copied += len(block)
        if _read(fd, 1, size, name):
            raise _bad_image(f"the image {name} grew past the {size} bytes declared")
    finally:
        os.close(out)
    return ImageFile(name, size, digest.hexdigest())


def _read(fd: int, count: int, offset: int, name: str) -> bytes:
    try:
        return os.pread(fd, count, offset)
    except OSError as exc:
        raise _bad_image(f"the image {name} could not be read ({exc.strerror})") from exc


def _write_all(fd: int, data: bytes, dest: Path) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except OSError as exc:
            raise AgentRequestError(
                f"The node agent could not write {dest} ({exc.strerror}).",
                hint="Free space on the node's disk of the agent's state directory, or "
                "lower the agent's --max-request-bytes.",
            ) from exc


def _bad_image(what: str) -> AgentRequestError:
    return AgentRequestError(
        f"The node agent refused the restore: {what}.",
        hint="Give the images as regular files opened for reading, each with its size, "
        "and do not change them during the restore.",
    )
