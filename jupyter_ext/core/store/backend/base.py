"""What a backend is: a place that saves, loads, lists and removes whole files by handle
(restic's ``Backend`` and ``Handle``). It knows nothing of records, packs or clean-ups;
the repository above it does."""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol, Self

from ...private import Exposed
from ..api import StoreError
from ..pack import Parts


class Kind(enum.Enum):
    """What a file is, which decides where it lives (layout.py) and how durable a save is."""

    PACK = "pack"
    """A pack or image pack: saved without a sync each; :meth:`Backend.sync` makes the
    packs saved so far durable (before a record names them)."""
    LEGACY = "legacy"
    """A chunk object of record format 1 (read, listed, removed; never written)."""
    RECORD = "record"
    """A snapshot's record: durable once saved."""
    PUT = "put"
    """A claim or a clean-up marker: durable once saved, replaced whole."""
    KEY = "key"
    """The store's master key wrapped by a key-encryption key (keys.py): durable once
    saved, replaced whole."""


class Handle(NamedTuple):
    kind: Kind
    name: str


class ObjectStat(NamedTuple):
    size: int
    mtime: float
    """Seconds since the epoch; the store's clock (S3's LastModified)."""


class Backend(Protocol):
    """Moves bytes. Errors are :class:`~..api.StoreError` saying what failed and where.

    The contract every backend keeps (tests/test_backend_contract.py runs it over each):

    - a file is saved whole or not at all: a save that fails (its parts raise, the disk
      fills) leaves the file as it was, and no partial file is ever loaded or listed;
    - :meth:`save` replaces a file whole; :meth:`save_if_absent` never replaces one, and
      of concurrent ones for a handle exactly one returns True (its bytes are the file's);
    - a missing file is not an error: :meth:`load` returns None, :meth:`remove` and
      :meth:`remove_all` do nothing for it (removal is idempotent);
    - :meth:`names` and :meth:`entries` list one kind, and only files saved under it (the
      kind's directory is the prefix listed); a backend's temporaries are never listed;
    - a name that would leave its kind's directory is refused (``layout.check``:
      StoreError) before any byte moves;
    - saves from many threads at once are safe, and each lands whole.
    """

    def location(self, handle: Handle) -> str:
        """Where the file is, for messages: a path or an ``s3://`` URL."""
        ...

    def save(self, handle: Handle, data: bytes | Parts) -> None:
        """Write the file whole, replacing any (packs: durable after :meth:`sync`)."""
        ...

    def save_if_absent(self, handle: Handle, data: bytes) -> bool:
        """Write the file durably unless it exists; False if it did."""
        ...

    def adopt(self, handle: Handle, source: Path) -> bool:
        """Make the file ``source`` the file of ``handle`` without copying it (durable
        after :meth:`sync`); False where the backend cannot."""
        ...

    def load(
        self, handle: Handle, offset: int = 0, length: int | None = None
    ) -> bytes | memoryview | None:
        """The file (``length`` None), or ``length`` (>= 1) bytes of it from ``offset``
        (fewer past its end); None if it is missing. A range that starts at or past the
        end (any range of an empty file) is :func:`beyond_end`'s StoreError, never b""."""
        ...

    def names(self, kind: Kind) -> list[str]:
        """The names of every file of ``kind`` (records: the ids they are named by)."""
        ...

    def entries(self, kind: Kind) -> Iterator[tuple[str, ObjectStat]]:
        """The files of ``kind`` with their sizes and timestamps (packs: only names that
        are objects of the layout; puts: not the backend's own temporary files)."""
        ...

    def remove(self, handle: Handle) -> None:
        """Remove the file (a missing one is fine)."""
        ...

    def remove_all(self, names: list[str]) -> None:
        """Remove these objects (packs or chunk objects; missing ones are fine), in bulk."""
        ...

    def sync(self) -> None:
        """Make the packs saved so far durable."""
        ...

    def close(self) -> None:
        """Let go of connections (the backend is not used afterwards)."""
        ...

    def tighten(self) -> list[Exposed]:
        """Take from what the backend keeps on this machine the access its modes give
        nobody else; what was changed (nothing for a remote backend)."""
        ...


def beyond_end(where: str, offset: int, size: int | None = None) -> StoreError:
    """The one error of a ranged load starting at or past a file's end."""
    of = f" of {size} bytes" if size is not None else ""
    return StoreError(
        f"Cannot read {where}{of} from byte {offset}: that is at or past its end.",
        hint="The store's record and its packs disagree: check the store (or pick another "
        "snapshot).",
    )


Settings = Mapping[str, Any]
"""The store's settings by the names of SnapshotExtensionApp's options (``store``,
``local_store_dir``, ``s3_bucket``, ...): the server's, or the CLI's (the server's from its
config files, with what its command line names instead). Each backend reads its own."""


class Options(Protocol):
    """A backend's own settings, and how it is opened: each backend module has one (a
    frozen dataclass, so that equal settings make equal options), named in
    ``stores.STORE_KINDS``."""

    @classmethod
    def from_settings(cls, settings: Settings, place: str) -> Self:
        """The options ``settings`` give, refused with a StoreError naming the option to
        set. ``place``: the user's own part of the configured place (``users/<owner>``),
        or "" where the settings name the user's place whole (the CLI's --store-dir)."""
        ...

    def location(self) -> str:
        """Where the store is, for messages."""
        ...

    def open(self, max_workers: int, environ: Mapping[str, str]) -> Backend:
        """The backend (nothing read or written yet). ``environ``: the server's
        environment, where a backend finds a token it authenticates with."""
        ...
