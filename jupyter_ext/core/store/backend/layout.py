"""The one path layout of a store, under its root (a directory, or ``<bucket>/<prefix>``)::

    packs/<hh>/<name>       a pack (pack.py); ``.img``: a local store's image pack
    snapshots/<id>.json     a snapshot's record (record.py)
    puts/<token>.json       a claim of a put in progress (claims.py)
    puts/<token>.cleaning   a clean-up in progress
    keys/<key id>           the master key, wrapped by the key-encryption key of that id
    chunks/<hh>/<sha256>    record format 1 only (one object per chunk): still read
    locks/<path>/<token>    an S3 backend's lock to create <path> once, where the server
                            ignores If-None-Match (backend/s3.py); never a kind's file

A pack's name is its path (records name packs so); a record is named by its snapshot id,
a claim or marker by its file name. :func:`path` refuses a name that would leave its
kind's directory (the backend contract: names are validated before any byte moves).
"""

from __future__ import annotations

from ..api import StoreError
from .base import Handle, Kind

PUTS_DIR = "puts"
KEYS_DIR = "keys"
RECORDS_DIR = "snapshots"
RECORD_SUFFIX = ".json"
LOCKS_DIR = "locks"


def path(handle: Handle) -> str:
    """Where the file of ``handle`` is, relative to the store's root ("/"-separated)."""
    check(handle)
    if handle.kind is Kind.RECORD:
        return f"{RECORDS_DIR}/{handle.name}{RECORD_SUFFIX}"
    if handle.kind is Kind.PUT:
        return f"{PUTS_DIR}/{handle.name}"
    if handle.kind is Kind.KEY:
        return f"{KEYS_DIR}/{handle.name}"
    return handle.name


def check(handle: Handle) -> None:
    """Refuse a name outside its kind's directory: a flat name (record, claim, key) with a
    "/", a pack or chunk path not under its directory, "." or ".." parts, NUL, empty."""
    name = handle.name
    if handle.kind in (Kind.PACK, Kind.LEGACY):
        parts = name.split("/")
        ok = len(parts) > 1 and parts[0] == directory(handle.kind)
    else:
        parts = [name]
        ok = "/" not in name
    if not ok or "\0" in name or any(p in ("", ".", "..") for p in parts):
        raise StoreError(
            f"{name!r} is not a valid name for a {handle.kind.value} in a snapshot store.",
            hint="Check the snapshot id (or the name) given.",
        )


def directory(kind: Kind) -> str:
    """The directory that holds every file of ``kind``."""
    return {
        Kind.PACK: "packs",
        Kind.LEGACY: "chunks",
        Kind.RECORD: RECORDS_DIR,
        Kind.PUT: PUTS_DIR,
        Kind.KEY: KEYS_DIR,
    }[kind]


def record_id(filename: str) -> str | None:
    """The snapshot id a file under ``snapshots/`` is the record of (None: not a record)."""
    return filename.removesuffix(RECORD_SUFFIX) if filename.endswith(RECORD_SUFFIX) else None


def object_handle(name: str) -> Handle:
    """The handle of an object a record or a trailer names (a pack, or a format-1 chunk)."""
    return Handle(Kind.LEGACY if name.startswith("chunks/") else Kind.PACK, name)


def record(snapshot_id: str) -> Handle:
    return Handle(Kind.RECORD, snapshot_id)


def put(name: str) -> Handle:
    return Handle(Kind.PUT, name)


def key(key_id: str) -> Handle:
    return Handle(Kind.KEY, key_id)


FLAT = (Kind.PUT, Kind.KEY)
"""Kinds kept in one directory without subdirectories (listed by file name)."""
