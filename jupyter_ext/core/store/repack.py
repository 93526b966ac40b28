"""Repack (restic's prune rewrites packs the same way): the still-needed chunks of packs that
are mostly garbage are checked, copied into new packs, and only then are the old packs
deleted. Records are never rewritten: readers find the moved chunks through the new
packs' trailers."""

from __future__ import annotations

import contextlib
import logging
import uuid

from ..errors import SnapshotError
from ..humanize import human_bytes
from . import pack
from .backend import Handle, Kind, layout
from .claims import Claims, CleanupLease
from .index import Index, Needs
from .pack import Location

logger = logging.getLogger(__name__)

_Copied = list[tuple[str, int, bytes | memoryview, pack.Codec]]


class Repack:
    """One repack, under the marker of the clean-up that planned it."""

    def __init__(self, claims: Claims, index: Index, pack_bytes: int, lease: CleanupLease) -> None:
        self.claims = claims
        self.index = index
        self.backend = index.backend
        self.pack_bytes = pack_bytes
        self.lease = lease
        keyring = index.keyring
        self.sealer = None if keyring is None else keyring.sealer()

    def run(self, worn: list[str], needed: Needs) -> tuple[list[str], int]:
        """Copy the needed chunks of ``worn`` packs into new packs, then delete them; the
        packs rewritten, and the bytes of them still needed (copied).

        Every chunk is checked before it is copied; a pack with a damaged chunk is left
        as it is. The new packs are claimed like a put's before they are written, and
        the old ones deleted only once other clean-ups are over and the new ones are
        there.
        """
        token = uuid.uuid4().hex
        written: set[str] = set()
        builder: pack.PackBuilder | None = None
        done: list[str] = []
        kept = 0

        def flush() -> None:
            nonlocal builder
            if builder is not None and len(builder):
                written.add(builder.name)
                self.claims.write(token, "repack", written)
                self.backend.save(Handle(Kind.PACK, builder.name), builder.finish())
            builder = None

        try:
            for name in worn:
                self.lease.check()
                copied = self._checked_chunks(name, needed.chunks(name))
                if copied is None:
                    continue
                for digest, size, blob, codec in copied:
                    builder = builder or pack.PackBuilder(self.sealer)
                    builder.add(digest, size, blob, codec)
                done.append(name)
                kept += needed.bytes[name]
                if builder is not None and builder.size >= self.pack_bytes:
                    flush()
            flush()
            if not done:
                return [], 0
            self.backend.sync()
            self.claims.wait_for_cleanups(besides=self.lease.marker)
            missing = written - self.index.objects().keys()
            if missing:
                logger.warning("A repack stopped: %d new packs were removed", len(missing))
                return [], 0
            self.lease.check()
            self.backend.remove_all(done)
            logger.info("Repacked %d packs (%s still needed)", len(done), human_bytes(kept))
            return done, kept
        finally:
            with contextlib.suppress(SnapshotError):
                self.claims.remove(f"{token}.json")

    def _checked_chunks(self, name: str, chunks: dict[str, tuple[int, Location]]) -> _Copied | None:
        """The chunks of a pack, each read and checked; None if one is damaged or gone."""
        copied: _Copied = []
        ordered = sorted(chunks.items(), key=lambda item: item[1][1].offset)
        try:
            for group in pack.coalesce([(digest, where) for digest, (_, where) in ordered]):
                start = group[0][1].offset
                end = max(w.offset + w.length for _, w in group)
                data = self.backend.load(layout.object_handle(name), start, end - start)
                if data is None:
                    raise ValueError("is gone")
                for digest, where in group:
                    blob = data[where.offset - start : where.offset - start + where.length]
                    size = chunks[digest][0]
                    pack.decode_checked(blob, where.codec, size, digest, self.sealer)
                    copied.append((digest, size, blob, where.codec))
        except ValueError as exc:
            logger.warning("Pack %s is not repacked: a chunk %s", name, exc)
            return None
        return copied
