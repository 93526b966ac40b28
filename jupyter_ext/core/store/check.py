"""Is the store whole? (restic's ``check``): the key opens, every record is readable, every
chunk a snapshot needs is in a pack that lists it there (read and checked too with
``read_data``); what is damaged or missing is named with the snapshots it breaks, and what
nothing needs (packs, stale claims) is listed with what ``store prune`` would do about it.

It only reads. It runs beside puts and clean-ups: a pack a put is writing is unreferenced
(and younger than the grace period) until its record is written; one a clean-up removes
meanwhile may show as missing for a snapshot deleted meanwhile, so a check that finds
damage is worth running again before deleting anything.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from ..errors import SnapshotError
from ..humanize import human_bytes, human_seconds
from ..protocol.progress import ProgressCallback
from . import pack
from .api import report
from .backend import Kind, ObjectStat, layout
from .claims import Claims
from .index import Catalog, Index
from .keys import Keyring
from .pack import Location
from .prune import plan_cleanup, survey
from .record import Summary
from .workers import Bounded

DamageKind = Literal["key", "record", "pack", "chunk"]
_Located = dict[str, dict[str, tuple[Location, int]]]
"""object -> sha256 -> (where the records find the chunk, its size)."""
_Read = tuple[str, int, dict[str, str]]
"""A ranged read of a pack: its name, the bytes read, and sha256 -> why, for each chunk
that is damaged."""


@dataclass(frozen=True)
class Damage:
    """A damaged or missing piece of the store, and the snapshots it breaks (those that
    cannot be restored any more)."""

    kind: DamageKind
    name: str
    problem: str
    breaks: tuple[str, ...]

    def line(self) -> str:
        breaks = ", ".join(self.breaks[:5]) + (" ..." if len(self.breaks) > 5 else "")
        broken = f" -> breaks {len(self.breaks)} snapshot(s): {breaks}" if self.breaks else ""
        return f"{self.kind} {self.name}: {self.problem}{broken}"


@dataclass(frozen=True)
class Unneeded:
    """An object no readable record needs."""

    name: str
    size: int
    age_seconds: float
    prunable: bool
    """Whether ``store prune`` removes it now (else it is younger than the grace period:
    it may be a put's that is still running, or the store is damaged)."""


@dataclass
class CheckReport:
    """What a check found."""

    read_data: bool
    snapshots: int = 0
    packs: int = 0
    pack_bytes: int = 0
    chunks: int = 0
    """Distinct chunks the snapshots need."""
    read_bytes: int = 0
    """Bytes read (with read_data): the needed chunks, and the gaps between those read
    together."""
    keys: list[str] = field(default_factory=list)
    damage: list[Damage] = field(default_factory=list)
    unneeded: list[Unneeded] = field(default_factory=list)
    repack: list[str] = field(default_factory=list)
    """Packs mostly unneeded that ``store prune`` would rewrite."""
    stale_claims: list[str] = field(default_factory=list)
    """Claims and clean-up markers of puts and clean-ups that were killed."""
    prune_blocked: str = ""
    """Why ``store prune`` would remove nothing now (a damaged store)."""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.damage

    def broken(self) -> list[str]:
        """The snapshots that cannot be restored."""
        return sorted({s for d in self.damage for s in d.breaks})

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok, "broken": self.broken()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckReport:
        """A report as :meth:`to_dict` gave it (a check job's result)."""
        known = {f.name for f in fields(cls)}
        found = cls(**{k: v for k, v in data.items() if k in known})
        found.damage = [Damage(**{**d, "breaks": tuple(d["breaks"])}) for d in data["damage"]]
        found.unneeded = [Unneeded(**u) for u in data["unneeded"]]
        return found

    def lines(self) -> list[str]:
        """The report as a person reads it."""
        read = f", {human_bytes(self.read_bytes)} read and checked" if self.read_data else ""
        out = [
            f"{self.snapshots} snapshots, {self.packs} packs ({human_bytes(self.pack_bytes)}), "
            f"{self.chunks} chunks needed{read}, in {human_seconds(self.seconds)}.",
        ]
        if self.damage:
            out.append(
                f"DAMAGED: {len(self.damage)} problem(s); {len(self.broken())} snapshot(s) "
                "cannot be restored:"
            )
            out += [f"  {d.line()}" for d in self.damage]
            out.append(
                "  Delete the snapshots named (jupyter snapshot rm ID), then prune; restore "
                "another snapshot of the same kernel instead."
            )
        else:
            out.append(
                "No damage found"
                + ("." if self.read_data else " (--read-data reads and checks every chunk too).")
            )
        if self.unneeded:
            prunable = [u for u in self.unneeded if u.prunable]
            size = human_bytes(sum(u.size for u in prunable))
            young = len(self.unneeded) - len(prunable)
            out.append(
                f"{len(self.unneeded)} pack(s) no snapshot needs: {len(prunable)} ({size}) "
                f"removed by 'jupyter snapshot store prune'"
                + (f"; {young} kept (younger than the grace period, or a put's)" if young else "")
                + "."
            )
        if self.repack:
            out.append(f"{len(self.repack)} pack(s) mostly unneeded, rewritten by prune.")
        if self.stale_claims:
            out.append(
                f"{len(self.stale_claims)} stale claim(s) of killed puts or clean-ups, "
                f"removed by prune: {', '.join(self.stale_claims[:5])}"
            )
        if self.prune_blocked:
            out.append(f"Prune removes nothing now: {self.prune_blocked}")
        return out


@dataclass(frozen=True)
class Checker:
    """Checks one store (its parts as the repository has them)."""

    index: Index
    claims: Claims
    keyring: Keyring | None
    max_workers: int
    grace_seconds: float
    repack_below: float

    def run(self, read_data: bool, progress: ProgressCallback | None = None) -> CheckReport:
        started = time.monotonic()
        found = CheckReport(read_data)
        report(progress, "checking", 0, 0)
        ids = self.index.record_ids()
        found.snapshots = len(ids)
        found.keys = self.index.backend.names(Kind.KEY)
        objects = self.index.objects()
        found.packs, found.pack_bytes = len(objects), sum(s.size for s in objects.values())
        found.stale_claims = self._stale_claims()
        if not self._key_opens(found, ids):
            found.prune_blocked = "the store's key cannot be opened."
            found.seconds = time.monotonic() - started
            return found
        summaries = self._records(ids, found)
        located = self._locate(summaries, objects, found)
        found.chunks = len({d for chunks in located.values() for d in chunks})
        self._packs(located, objects, summaries, found)
        if read_data:
            self._read_data(located, summaries, found, progress)
        self._unneeded(located, objects, found)
        found.damage.sort(key=lambda d: (d.kind, d.name))
        found.seconds = time.monotonic() - started
        report(progress, "done", found.read_bytes, found.read_bytes)
        return found

    # -- keys and records ------------------------------------------------------------

    def _key_opens(self, found: CheckReport, ids: list[str]) -> bool:
        """Whether the master key opens with the key source's key. A store without a key
        object has none to open (each encrypted record then says so; a check never makes
        one)."""
        if self.keyring is None or not found.keys:
            return True
        try:
            self.keyring.sealer()
        except SnapshotError as exc:
            found.damage.append(Damage("key", self.keyring.describe(), exc.message, tuple(ids)))
            return False
        return True

    def _records(self, ids: list[str], found: CheckReport) -> dict[str, Summary]:
        """Every record read and parsed afresh (a summary cached earlier proves nothing
        about the bytes in the store now); the unreadable ones are damage."""

        def read(snapshot_id: str) -> Summary | SnapshotError | None:
            try:
                record = self.index.load(snapshot_id)
            except SnapshotError as exc:
                return exc
            return None if record is None else record.summary()

        summaries = {}
        with ThreadPoolExecutor(self.max_workers) as pool:
            for snapshot_id, result in zip(ids, pool.map(read, ids), strict=True):
                if isinstance(result, Summary):
                    summaries[snapshot_id] = result
                elif isinstance(result, SnapshotError):
                    found.damage.append(
                        Damage("record", snapshot_id, result.message, (snapshot_id,))
                    )
        return summaries

    # -- where the chunks are --------------------------------------------------------

    def _locate(
        self, summaries: dict[str, Summary], objects: dict[str, ObjectStat], found: CheckReport
    ) -> _Located:
        """Where each needed chunk is now (a repack may have moved it); a chunk that is
        nowhere breaks its snapshots, named by the pack that is gone."""
        located: _Located = {}
        missing: dict[str, set[str]] = {}
        lost: dict[str, set[str]] = {}
        catalog: Catalog | None = None
        for snapshot_id, summary in summaries.items():
            for ref in summary.chunks:
                where: Location | None = ref.where
                if ref.where.obj not in objects:
                    catalog = catalog or self.index.catalog(summaries.values(), objects)
                    where = catalog.find(ref.hash)
                if where is None:
                    missing.setdefault(ref.where.obj, set()).add(snapshot_id)
                    lost.setdefault(ref.where.obj, set()).add(ref.hash)
                    continue
                located.setdefault(where.obj, {}).setdefault(ref.hash, (where, ref.size))
        for name, breaks in missing.items():
            found.damage.append(
                Damage(
                    "pack",
                    name,
                    f"is missing from the store ({len(lost[name])} chunks needed)",
                    tuple(sorted(breaks)),
                )
            )
        return located

    def _packs(
        self,
        located: _Located,
        objects: dict[str, ObjectStat],
        summaries: dict[str, Summary],
        found: CheckReport,
    ) -> None:
        """Each pack holds the ranges its records read, and its trailer lists each chunk
        where they find it (a pack that holds no trailer, an image pack or a chunk object
        of record format 1, only the first)."""
        for name, chunks in sorted(located.items()):
            size = objects[name].size
            end = max(where.offset + where.length for where, _ in chunks.values())
            problem = ""
            listed: dict[str, pack.PackEntry] = {}
            if end > size:
                problem = f"is shorter ({size} bytes) than its records read ({end})"
            elif pack.PACK_NAME_RE.match(name):
                try:
                    listed = {e.hash: e for e in self.index.read_trailer(name, size)}
                except ValueError as exc:
                    problem = f"its trailer cannot be read ({exc})"
            if problem:
                users = self._users(summaries, {name: set(chunks)})
                found.damage.append(Damage("pack", name, problem, users))
            if problem or not listed:
                continue
            wrong = {
                digest
                for digest, (where, chunk_size) in chunks.items()
                if digest not in listed
                or listed[digest].where != where
                or listed[digest].size != chunk_size
            }
            for digest in sorted(wrong):
                found.damage.append(
                    Damage(
                        "chunk",
                        f"{digest[:12]}… in {name}",
                        "its pack's trailer does not list it where its records read it",
                        self._users(summaries, {name: {digest}}),
                    )
                )

    def _read_data(
        self,
        located: _Located,
        summaries: dict[str, Summary],
        found: CheckReport,
        progress: ProgressCallback | None,
    ) -> None:
        """Read every needed chunk (ranges of a pack coalesced, as a fetch reads them) and
        check it: decrypted and its tag checked, or hashed."""
        sealer = None if self.keyring is None else self.keyring.sealer()
        reads = [
            (name, group)
            for name, chunks in sorted(located.items())
            for group in pack.coalesce(
                sorted(((d, w) for d, (w, _) in chunks.items()), key=lambda c: c[1].offset)
            )
        ]
        total = sum(max(w.offset + w.length for _, w in g) - g[0][1].offset for _, g in reads)

        def read(name: str, group: list[tuple[str, Location]]) -> _Read:
            start = group[0][1].offset
            end = max(w.offset + w.length for _, w in group)
            data = self.index.backend.load(layout.object_handle(name), start, end - start)
            if data is None or len(data) != end - start:
                why = "its pack is gone" if data is None else "its pack is shorter than that"
                return name, end - start, {digest: why for digest, _ in group}
            bad = {}
            view = memoryview(data)
            for digest, where in group:
                blob = view[where.offset - start : where.offset - start + where.length]
                try:
                    pack.decode_checked(blob, where.codec, located[name][digest][1], digest, sealer)
                except ValueError as exc:
                    bad[digest] = str(exc)
            return name, end - start, bad

        damaged: dict[str, dict[str, str]] = {}

        def tally(results: Iterable[_Read]) -> None:
            for name, done, bad in results:
                found.read_bytes += done
                report(progress, "reading-data", found.read_bytes, total)
                if bad:
                    damaged.setdefault(name, {}).update(bad)

        report(progress, "reading-data", 0, total)
        with ThreadPoolExecutor(self.max_workers) as pool:
            tasks = Bounded(pool, 2 * self.max_workers)
            for name, group in reads:
                tally(tasks.submit(read, name, group))
            tally(tasks.drain())
        for name, bad in sorted(damaged.items()):
            for digest, why in sorted(bad.items()):
                found.damage.append(
                    Damage(
                        "chunk",
                        f"{digest[:12]}… in {name}",
                        f"cannot be read: {why}",
                        self._users(summaries, {name: {digest}}),
                    )
                )

    @staticmethod
    def _users(summaries: dict[str, Summary], pieces: dict[str, set[str]]) -> tuple[str, ...]:
        """The snapshots that read any of ``pieces`` (object -> chunks) there."""
        users = set()
        for snapshot_id, summary in summaries.items():
            for ref in summary.chunks:
                if ref.hash in pieces.get(ref.where.obj, ()):
                    users.add(snapshot_id)
                    break
        if not users:  # read where a repack moved them
            wanted = set().union(*pieces.values())
            users = {s for s, sm in summaries.items() if any(r.hash in wanted for r in sm.chunks)}
        return tuple(sorted(users))

    # -- what nothing needs ----------------------------------------------------------

    def _stale_claims(self) -> list[str]:
        now = time.time()
        return sorted(
            name for name, mtime in self.claims.listing() if self.claims.is_stale(name, mtime, now)
        )

    def _unneeded(
        self, located: _Located, objects: dict[str, ObjectStat], found: CheckReport
    ) -> None:
        """The objects no record needs, and what prune would do: its own plan, made as a
        clean-up makes it (it refuses a store with damage)."""
        now = time.time()
        removed: set[str] = set()
        if found.damage:
            found.prune_blocked = (
                "the store is damaged; delete the snapshots named above first (a clean-up "
                "by a wrong picture of the store could remove more)."
            )
        else:
            try:
                plan = plan_cleanup(
                    survey(self.claims, self.index, "", set()),
                    set(),
                    set(),
                    sweep=True,
                    cutoff=now - self.grace_seconds,
                    repack_below=self.repack_below,
                )
            except SnapshotError as exc:
                found.prune_blocked = exc.message
            else:
                removed = set(plan.delete)
                found.repack = plan.repack
        found.unneeded = [
            Unneeded(name, stat.size, max(0.0, now - stat.mtime), name in removed)
            for name, stat in sorted(objects.items())
            if name not in located
        ]
