"""Every error the snapshot core raises, in one small hierarchy.

Each error says what went wrong, why, and what to do about it, so that the server
extension, the CLI and the panel can show it as it is::

    SnapshotError                 base class; ``.hint`` says what to do
    ├── CriuError                 CRIU is missing, too old, or failed
    │   ├── CriuNotFoundError     no usable criu binary
    │   │   └── CriuNotPermittedError  the process's confinement forbids running it
    │   ├── DumpError             ``criu dump`` failed (the kernel keeps running)
    │   └── RestoreError          ``criu restore`` failed
    ├── SnapshotCorruptError      a file's sha256 differs from the manifest, or files are missing
    ├── IncompatibleSnapshotError the snapshot cannot run here (kernel, CPU, missing files)
    ├── SnapshotBusyError         another snapshot or restore of this kernel is in progress
    ├── KernelNotRunningError     there is no kernel process to snapshot
    ├── WrapperUnavailableError   the kernel is not a snapshot kernel, or its wrapper is gone
    ├── NotFoundError             what a request names does not exist (an HTTP 404)
    │   ├── SnapshotNotFoundError no snapshot with that id
    │   ├── KernelNotFoundError   no kernel with that id on this server
    │   └── JobNotFoundError      no job with that id
    ├── VariableTransferError     variables could not be taken from a snapshot (variables.py)
    │   └── VariablesExistError   the kernel has variables of those names (overwrite not asked)
    ├── NothingToUndoError        no cell checkpoint to go back to (core/checkpoints/)
    ├── StoreError                the store cannot be read or written (store/api.py)
    └── GpuCheckpointError        a CUDA checkpoint step failed (gpu/errors.py)
        └── GpuUnavailableError   no usable CUDA checkpoint support
"""

from __future__ import annotations


class SnapshotError(Exception):
    """Base class: a message that names the cause, and a hint that says what to do."""

    code = "snapshot-error"

    def __init__(self, message: str, *, hint: str = "", log_excerpt: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.log_excerpt = log_excerpt

    def __str__(self) -> str:
        parts = [self.message]
        if self.hint:
            parts.append(f"What to do: {self.hint}")
        if self.log_excerpt:
            parts.append(f"CRIU log:\n{self.log_excerpt}")
        return "\n".join(parts)

    def to_dict(self) -> dict[str, str]:
        """The error as sent over the wrapper's control socket and the REST API."""
        return {
            "code": self.code,
            "message": self.message,
            "hint": self.hint,
            "log_excerpt": self.log_excerpt,
        }

    @classmethod
    def from_dict(cls, data: dict[str, str]) -> SnapshotError:
        """Rebuild the error raised on the other side of the control socket."""
        error_cls = _error_classes().get(data.get("code", ""), SnapshotError)
        return error_cls(
            data.get("message", "unknown error"),
            hint=data.get("hint", ""),
            log_excerpt=data.get("log_excerpt", ""),
        )


class CriuError(SnapshotError):
    code = "criu-error"


class CriuNotFoundError(CriuError):
    code = "criu-not-found"


class CriuNotPermittedError(CriuNotFoundError):
    """CRIU is installed but this process may not run it (a container's bounding set,
    no_new_privs): the message names the setting, not the binary."""

    code = "criu-not-permitted"


class DumpError(CriuError):
    code = "dump-failed"


class RestoreError(CriuError):
    code = "restore-failed"


class SnapshotCorruptError(SnapshotError):
    code = "snapshot-corrupt"


class IncompatibleSnapshotError(SnapshotError):
    code = "snapshot-incompatible"


class PortTakenError(IncompatibleSnapshotError):
    """A port the snapshot binds is another process's here (found before or after CRIU)."""


class SnapshotBusyError(SnapshotError):
    code = "kernel-busy"


class KernelNotRunningError(SnapshotError):
    code = "kernel-not-running"


class WrapperUnavailableError(SnapshotError):
    code = "wrapper-unavailable"


class NotFoundError(SnapshotError):
    """What a request names (by its id) does not exist: the subclass says what."""

    code = "not-found"


class SnapshotNotFoundError(NotFoundError):
    code = "snapshot-not-found"


class KernelNotFoundError(NotFoundError):
    code = "kernel-not-found"


class JobNotFoundError(NotFoundError):
    code = "job-not-found"


class VariableTransferError(SnapshotError):
    """A variable taken from a snapshot could not be serialised in the side kernel or
    loaded into the target; the message names it and the reason (the target is unchanged)."""

    code = "variable-not-transferable"


class VariablesExistError(VariableTransferError):
    """The target kernel already has variables of the names taken back: replaced only when
    asked (``overwrite``)."""

    code = "variables-exist"


class NothingToUndoError(SnapshotError):
    """An undo or redo that has no cell checkpoint to go to; the message says why (none
    taken yet, no longer kept, skipped, or off for this kernel)."""

    code = "nothing-to-undo"


class BadIdError(SnapshotError):
    """Not an id at all (REST: 400), wherever it is given: API, CLI or store."""

    code = "bad-request"


def _error_classes() -> dict[str, type[SnapshotError]]:
    """Every SnapshotError subclass by code, also those defined in other core modules
    (store errors, GPU errors) once imported."""
    found: dict[str, type[SnapshotError]] = {}
    pending: list[type[SnapshotError]] = [SnapshotError]
    while pending:
        cls = pending.pop()
        found.setdefault(cls.code, cls)
        pending.extend(cls.__subclasses__())
    return found
