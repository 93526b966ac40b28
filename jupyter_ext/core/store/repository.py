"""The repository (restic's ``internal/repository``): the store's format and algorithms over
a backend that only moves bytes. It owns the index, the claims and the clean-ups, and is
what the manager, the CLI and the wrapper use (as :class:`~.stores.LocalStore` or
:class:`~.stores.S3Store`)."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self, TypedDict, Unpack

from .. import manifest as manifest_mod
from ..chunking import ChunkParams, auto_chunk_kib
from ..errors import SnapshotCorruptError, SnapshotError, SnapshotNotFoundError
from ..manifest import Manifest
from ..private import Exposed
from ..protocol.progress import ProgressCallback
from . import pack, sealing
from .api import Progress, Skip, StoredSnapshot, StoreError, StoreStats, corrupt, report
from .backend import Backend, layout
from .check import Checker, CheckReport
from .claims import Claims, Heartbeat
from .fetch import Reader, fetch_into
from .images import SnapshotImages
from .index import Index
from .keys import KEY_SOURCES, FileKeySource, Keyring, KeySource, SealedBackend, only_here_notice
from .prune import Cleaner, PruneReport
from .put import PutSettings, Upload
from .record import Record, Summary

logger = logging.getLogger(__name__)

DEFAULT_GRACE_SECONDS = 3600.0
REPACK_BELOW = 0.5
"""A pack older than the grace period is rewritten once less than this share of it is
still needed (restic's prune repacks on a similar share of unused bytes)."""
REUPLOAD_ROUNDS = 3
"""A put uploads again the chunks a concurrent clean-up removed, this many times at most."""


class Tuning(TypedDict, total=False):
    """The repository's settings a store passes on (:class:`Repository` has the defaults)."""

    grace_seconds: float
    chunking: ChunkParams | None
    pack_bytes: int
    repack_below: float
    keys: KeySource | None


class Repository:
    """Snapshots in one store. Subclasses choose the backend and their policies: whether
    images are adopted, what a failed put's error says, what a prune also removes."""

    adopts_images = False
    outlives_the_machine = False
    """Whether the store survives this machine's loss (a bucket): its key must too."""

    @classmethod
    def over(cls, backend: Backend, *, max_workers: int, **tuning: Unpack[Tuning]) -> Self:
        """This class's store over ``backend`` as it was opened (how ``stores.open_store``
        makes each; a subclass's own constructor opens its backend from arguments)."""
        store = cls.__new__(cls)
        Repository.__init__(store, backend, max_workers=max_workers, **tuning)
        return store

    def __init__(
        self,
        backend: Backend,
        *,
        max_workers: int,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        chunking: ChunkParams | None = None,
        pack_bytes: int = pack.DEFAULT_PACK_BYTES,
        repack_below: float = REPACK_BELOW,
        keys: KeySource | None = None,
    ) -> None:
        """``keys``: where the key-encryption key comes from; None stores everything
        unencrypted (encryption_key_source "none")."""
        self.backend = backend
        self.max_workers = max_workers
        self.grace_seconds = grace_seconds
        self.chunking = chunking
        """Fixed chunk sizes; None picks them per snapshot (:func:`auto_chunk_kib`)."""
        self.pack_bytes = pack_bytes
        self.repack_below = repack_below
        self.keyring = None if keys is None else Keyring(backend, keys)
        """The store's master key (None: not encrypted)."""
        if self.keyring is not None:
            self.adopts_images = False  # an image pack is the snapshot's file as it is
        self.sealed = SealedBackend(backend, self.keyring)
        self.index = Index(self.sealed, max_workers, self.keyring)
        self.claims = Claims(self.sealed)
        self._leftovers: dict[str, set[str]] = {}
        """Failed puts whose clean-up failed too (store unreachable): claim token -> the
        objects to remove; tried again after the next put and by every delete."""
        self._leftovers_lock = threading.Lock()

    # -- the API ---------------------------------------------------------------------

    def put(
        self,
        snapshot_dir: Path,
        progress: ProgressCallback | None = None,
        manifest: Manifest | None = None,
    ) -> StoredSnapshot:
        """Store a sealed snapshot directory; checks every file against its manifest:
        ``manifest`` when the caller holds it already (the wrapper's answer to a dump),
        else the directory's, read here.

        Putting a snapshot that is already stored returns it as it is.
        """
        if manifest is not None:
            raw = manifest.to_dict()
        else:
            raw = manifest_mod.read_raw(
                snapshot_dir,
                missing_hint="Only sealed snapshot directories can be stored.",
                damaged_hint="The snapshot is damaged; take a new one.",
            )
            try:
                manifest = Manifest.from_dict(raw)
            except (TypeError, ValueError) as exc:
                raise SnapshotCorruptError(
                    f"The manifest of {snapshot_dir} is incomplete: {exc}",
                    hint="The snapshot is damaged; take a new one.",
                ) from exc
        if not manifest_mod.SNAPSHOT_ID_RE.match(str(manifest.id)):
            raise SnapshotCorruptError(
                f"{snapshot_dir} has an invalid snapshot id {manifest.id!r}.",
                hint="Take a new snapshot.",
            )
        existing = self.index.load(manifest.id)
        if existing is not None:
            return self._same_or_conflict(existing, raw)
        self.claims.remove_leftover_markers()
        settings = PutSettings(self.max_workers, self.pack_bytes, self.adopts_images)
        params = self._chunking_for(manifest)
        upload = Upload(self.index, settings, snapshot_dir, manifest, params, progress)
        token = uuid.uuid4().hex
        try:
            # The claim exists before the put relies on any pack, and lists them as it goes.
            self.claims.write(token, manifest.id, set())
            with Heartbeat(
                self.claims.claim_refresh_seconds,
                lambda: self.claims.write(token, manifest.id, upload.relied_on()),
            ):
                stored = self._commit(upload, token, raw)
        except BaseException as exc:
            replacement = self._after_failed_put(token, manifest, upload, exc)
            if replacement is exc:
                raise
            raise replacement from exc
        self.claims.remove(f"{token}.json")
        try:
            self._collect_leftovers()
        except SnapshotError as exc:  # the put succeeded; the next one tries again
            logger.warning("Could not clean up after earlier failed puts: %s", exc)
        return stored

    def _commit(self, upload: Upload, token: str, raw: dict[str, Any]) -> StoredSnapshot:
        """Upload, then publish the claim, wait out clean-ups, check, and write the record."""
        manifest = upload.manifest
        upload.run()
        for _ in range(REUPLOAD_ROUNDS):
            self.claims.write(token, manifest.id, upload.relied_on())
            report(upload.progress, "committing", manifest.total_bytes, manifest.total_bytes)
            self.claims.wait_for_cleanups()
            missing = upload.recheck()
            if not missing:
                break
            logger.info(
                "A clean-up removed %d chunks snapshot %s relies on: uploading them again",
                len(missing),
                manifest.id,
            )
            upload.upload_again(missing)
        else:
            raise StoreError(
                f"Snapshot {manifest.id} could not be stored: concurrent clean-ups kept "
                "removing chunks it relies on.",
                hint="Store the snapshot again.",
            )
        chunks = upload.refs()
        distinct = {ref.hash: ref.where.length for refs in chunks.values() for ref in refs}
        record = Record(
            raw, manifest, chunks, sum(distinct.values()), upload.new_bytes, upload.params.kib
        )
        self.backend.sync()
        upload.check_unchanged()
        if not self.index.backend.save_if_absent(layout.record(manifest.id), record.to_json()):
            raced = self.index.load(manifest.id)
            if raced is None:
                raise StoreError(
                    f"Snapshot {manifest.id} was deleted while it was being stored again.",
                    hint="Store it again if it is still wanted.",
                )
            return self._same_or_conflict(raced, raw)
        self.index.remember(record)
        report(upload.progress, "done", manifest.total_bytes, manifest.total_bytes)
        return self._stored(record)

    def _after_failed_put(
        self, token: str, manifest: Manifest, upload: Upload, exc: BaseException
    ) -> BaseException:
        """Remove what the failed put wrote (unless others rely on it); the error to raise."""
        candidates = upload.written()
        try:
            self._cleaner().collect(candidates, own={token})
        except SnapshotError as cleanup_exc:
            logger.warning(
                "The failed put of snapshot %s is cleaned up later (%d packs): %s",
                manifest.id,
                len(candidates),
                cleanup_exc,
            )
            with self._leftovers_lock:
                self._leftovers[token] = candidates
        return self.explain_failure(manifest, exc) or exc

    def explain_failure(self, manifest: Manifest, exc: BaseException) -> StoreError | None:
        """The error to raise instead of ``exc`` after a failed put (None: ``exc``)."""
        return None

    def _chunking_for(self, manifest: Manifest) -> ChunkParams:
        """The chunk sizes the snapshot's memory was cut with (as the server asked: the
        configured ones, or automatic ones that follow the parent snapshot's); for a
        snapshot from before that was kept, chosen here the same way."""
        if manifest.chunk_kib is not None:
            try:
                return ChunkParams.of_kib(manifest.chunk_kib)
            except ValueError as exc:
                raise corrupt(manifest.id, f"its chunk size cannot be: {exc}") from exc
        if self.chunking is not None:
            return self.chunking
        previous = None
        if manifest.parent_id and manifest_mod.SNAPSHOT_ID_RE.match(manifest.parent_id):
            parent = self.index.try_summary(manifest.parent_id)
            if isinstance(parent, Summary):
                previous = parent.chunk_kib
        return ChunkParams.of_kib(auto_chunk_kib(manifest.total_bytes, previous))

    def snapshots(self) -> list[StoredSnapshot]:
        """Complete snapshots, by (lineage, sequence); unreadable records are logged, skipped."""
        records = self.index.records(strict=False)
        return sorted(
            (self._stored(r) for r in records.values()),
            key=lambda s: (s.manifest.lineage, s.manifest.sequence, s.manifest.id),
        )

    def get(self, snapshot_id: str) -> StoredSnapshot:
        return self._stored(self._require(snapshot_id))

    def fetch(
        self, snapshot_id: str, dest_dir: Path, progress: Progress = None, skip: Skip = None
    ) -> Path:
        """Rebuild the snapshot directory at ``dest_dir`` (which must not exist), verified;
        complete or absent (see :func:`~.fetch.fetch_into`)."""
        record = self._require(snapshot_id)
        return fetch_into(self.index, self.max_workers, record, dest_dir, progress, skip)

    def open_images(self, snapshot_id: str) -> SnapshotImages:
        """Byte ranges of the snapshot's files, read from the store on demand (verified)."""
        return SnapshotImages(Reader(self.index, self._require(snapshot_id)), self.max_workers)

    def delete(self, snapshot_id: str, *, missing_ok: bool = False) -> None:
        """Remove the record, then prune: remove and repack what nothing needs any more.

        ``missing_ok``: a snapshot already gone (another retention pass, another server
        deleted it) is not an error: retention deletes what it planned, once. A record
        that cannot be read (damaged, or unencrypted in an encrypted store) is deleted too."""
        manifest_mod.check_snapshot_id(snapshot_id)
        if self.index.try_summary(snapshot_id) is None:
            if missing_ok:
                return
            self._require(snapshot_id)
        self.backend.remove(layout.record(snapshot_id))
        self.index.forget(snapshot_id)
        try:
            self.prune()
        except SnapshotError as exc:
            logger.warning(
                "Snapshot %s deleted, but the store was not cleaned up: %s", snapshot_id, exc
            )

    def stats(self) -> StoreStats:
        objects = self.index.objects()
        return StoreStats(
            snapshot_count=len(self.index.record_ids()),
            object_count=len(objects),
            stored_bytes=sum(stat.size for stat in objects.values()),
        )

    def close(self) -> None:
        """Let go of connections (the store is not used afterwards)."""
        self.backend.close()

    def tighten(self) -> list[Exposed]:
        return self.backend.tighten()

    # -- encryption ------------------------------------------------------------------

    def encrypt_unencrypted(
        self, work_dir: Path, said: Callable[[str], None] | None = None
    ) -> list[str]:
        """Store every unencrypted snapshot again, encrypted: the user's explicit migration
        of a store from before its encryption, the only way an unencrypted record is read
        by an encrypted store (whoever could write the store could have put one there).
        Each is fetched and verified into ``work_dir``, its record removed and the snapshot
        put again under its id (a failed put writes the old record back). Then the
        unencrypted packs no record needs are removed at once. The ids done."""
        if self.keyring is None:
            raise StoreError(
                "This store has no encryption key source (encryption_key_source 'none').",
                hint=f"Choose one: {', '.join(KEY_SOURCES)} (--key-source; the server's "
                "encryption_key_source by default).",
            )
        self.keyring.sealer()
        unencrypted: dict[str, bytes] = {}
        for snapshot_id in self.index.record_ids():
            data = self.backend.load(layout.record(snapshot_id))
            if data is not None and not sealing.is_sealed_file(data):
                unencrypted[snapshot_id] = bytes(data)
        done = []
        with self.sealed.trusting(set(unencrypted)):
            for snapshot_id, data in unencrypted.items():
                staging = Path(work_dir) / f"encrypting-{snapshot_id}"
                manifest_mod.remove_tree(staging)
                self.fetch(snapshot_id, staging)
                try:
                    self.backend.remove(layout.record(snapshot_id))
                    self.index.forget(snapshot_id)
                    try:
                        self.put(staging)
                    except BaseException:
                        self.backend.save_if_absent(layout.record(snapshot_id), data)
                        raise
                finally:
                    manifest_mod.remove_tree(staging)
                done.append(snapshot_id)
                if said is not None:
                    said(snapshot_id)
        self._remove_unencrypted_packs()
        return done

    def _remove_unencrypted_packs(self) -> None:
        """Every pack no record needs whose chunks are not sealed (a pack of the store
        from before, a repack of one, an image pack): a migration leaves no plaintext."""
        named = {obj for r in self.index.records(strict=True).values() for obj in r.objects()}
        plain = []
        for name, stat in self.index.objects().items():
            if name in named:
                continue
            if not pack.PACK_NAME_RE.match(name) or stat.size < pack.FOOTER_SIZE:
                plain.append(name)  # an image pack, a chunk of format 1
                continue
            footer = self.backend.load(
                layout.object_handle(name), stat.size - pack.FOOTER_SIZE, pack.FOOTER_SIZE
            )
            if footer is not None and not pack.is_sealed_pack(bytes(footer)):
                plain.append(name)
        self.backend.remove_all(plain)
        logger.info("Removed %d unencrypted packs", len(plain))

    def key_notice(self) -> str:
        """What to tell the user while the store outlives this machine but its key does
        not (a key file, no passphrase copy in the store); "" otherwise."""
        keyring = self.keyring
        if not self.outlives_the_machine or keyring is None:
            return ""
        if not isinstance(keyring.source, FileKeySource) or keyring.names()[1]:
            return ""
        root = self.backend.location(layout.key("-")).rsplit("/", 2)[0]
        return only_here_notice(root, keyring.source)

    # -- clean-up --------------------------------------------------------------------

    def _cleaner(self) -> Cleaner:
        return Cleaner(
            self.claims, self.index, self.grace_seconds, self.repack_below, self.pack_bytes
        )

    def prune(self) -> PruneReport:
        """Delete unreferenced objects older than the grace period, repack mostly unused
        packs, and remove what failed or killed puts left; what was done."""
        with self._leftovers_lock:
            leftovers = {token: set(objects) for token, objects in self._leftovers.items()}
        done = self._cleaner().collect(
            set().union(*leftovers.values()), own=set(leftovers), sweep=True
        )
        with self._leftovers_lock:
            for token in leftovers:
                self._leftovers.pop(token, None)
        return done

    def check(self, read_data: bool = False, progress: Progress = None) -> CheckReport:
        """Whether the store is whole (check.py): it only reads."""
        checker = Checker(
            self.index,
            self.claims,
            self.keyring,
            self.max_workers,
            self.grace_seconds,
            self.repack_below,
        )
        return checker.run(read_data, progress)

    def _collect_leftovers(self) -> None:
        """After a put: clean up what earlier failed puts here (store unreachable then)
        and killed puts anywhere (stale claims) left, if there is any."""
        with self._leftovers_lock:
            leftovers = {token: set(objects) for token, objects in self._leftovers.items()}
        if not leftovers and not self.claims.any_stale():
            return
        self._cleaner().collect(set().union(*leftovers.values()), own=set(leftovers))
        with self._leftovers_lock:
            for token in leftovers:
                self._leftovers.pop(token, None)

    # -- records ---------------------------------------------------------------------

    def _require(self, snapshot_id: str) -> Record:
        manifest_mod.check_snapshot_id(snapshot_id)
        record = self.index.load(snapshot_id)
        if record is None:
            where = self.backend.location(layout.record(snapshot_id))
            raise SnapshotNotFoundError(
                f"There is no snapshot {snapshot_id} in {where}.",
                hint="List the snapshots to see which exist.",
            )
        return record

    def _same_or_conflict(self, record: Record, raw: dict[str, Any]) -> StoredSnapshot:
        if record.raw_manifest != raw:
            raise StoreError(
                f"A different snapshot with id {record.manifest.id} is already stored.",
                hint="Snapshot ids must be unique; take a new snapshot.",
            )
        return self._stored(record)

    def _stored(self, record: Record | Summary) -> StoredSnapshot:
        return StoredSnapshot(
            manifest=record.manifest,
            stored_bytes=record.stored_bytes,
            new_bytes=record.new_bytes,
            chunk_count=record.chunk_count,
            location=self.backend.location(layout.record(record.manifest.id)),
        )
