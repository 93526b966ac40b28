"""Images the agent hands out are sealed; it restores only images with its seal.

A restore runs CRIU as root: the images say which credentials, capabilities and seccomp
filter the restored processes get, so an image a pod made up would be a way to root on
the node. The agent therefore seals what it dumps with an HMAC-SHA256, under a key that
only the agents hold (a Secret mounted into the DaemonSet, never into user pods), over
the owner's name and every image file's name, size and sha256. A pod keeps its images
(in its store, on S3), and gives them back for a restore; the agent copies them into its
own directory first, hashes its copy, and runs CRIU on it only if the seal matches the
calling pod's owner: another user's images, or altered ones, are refused.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
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


class Sealer:
    """Seals and checks image sets with the agents' shared key."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 32:
            raise ValueError("the sealing key must have at least 32 bytes")
        self._key = key

    @classmethod
    def from_file(cls, path: Path) -> Sealer:
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

    def seal(self, owner: str, files: list[ImageFile]) -> str:
        record = {
            "v": 1,
            "owner": owner,
            "files": [[f.name, f.size, f.sha256] for f in sorted(files, key=lambda f: f.name)],
        }
        message = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def check(self, owner: str, files: list[ImageFile], seal: str) -> None:
        if not hmac.compare_digest(self.seal(owner, files), seal):
            raise AgentRequestError(
                "The node agent refused the restore: these images are not sealed for "
                f"{owner!r} by the agents of this cluster (another user's snapshot, or "
                "altered images).",
                hint="Restore a snapshot this user took; a snapshot taken with in-pod "
                "CRIU cannot be restored through the agent.",
            )


def hash_file(path: Path) -> ImageFile:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while block := f.read(BLOCK):
            digest.update(block)
            size += len(block)
    return ImageFile(path.name, size, digest.hexdigest())


def copy_in(fd: int, dest: Path, owner: tuple[int, int]) -> ImageFile:
    """Copy what the caller's ``fd`` holds into the new file ``dest`` (of ``owner``, uid
    and gid: CRIU reads it as the caller's user), hashing the copy's bytes as written
    (the caller may change its file meanwhile; what is checked and restored is this
    copy)."""
    digest = hashlib.sha256()
    size = 0
    out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchown(out, *owner)
        os.lseek(fd, 0, os.SEEK_SET)
        while block := os.read(fd, BLOCK):
            digest.update(block)
            os.write(out, block)
            size += len(block)
    except OSError as exc:
        raise AgentRequestError(
            f"The node agent could not read the image {dest.name}: {exc.strerror}.",
            hint="Give the images as regular files opened for reading.",
        ) from exc
    finally:
        os.close(out)
    return ImageFile(dest.name, size, digest.hexdigest())
