"""Where an encrypted store's keys live (restic's key files): a random master key per
repository (per user prefix) seals every chunk, trailer, record and claim (sealing.py); it
is kept in the store only wrapped by a key-encryption key (KEK), as ``keys/<KEK id>``. The
KEK never enters the store: it comes from a :class:`KeySource` (a file in the user's 0700
Jupyter data directory, an environment variable set by a spawner, or a hub service).

A new KEK rewraps the master key (one small object; no data rewritten): the source's
``previous()`` keys still unwrap the old object, which is then replaced by one wrapped
with ``current()``. A lost KEK leaves the master key, and so every snapshot, unreadable.

A key file lives and dies with its machine, an S3 store does not: the master key can also
be kept in the store wrapped by the user's passphrase (restic's key files), as
``keys/passphrase-<id>``, with scrypt between the passphrase and the key. On another
machine ``recover`` opens it with the passphrase and wraps the master key with that
machine's KEK too (:meth:`Keyring.keep_passphrase`, :meth:`Keyring.recover`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from .. import private
from ..errors import SnapshotCorruptError
from ..private import Exposed
from ..protocol.environment import ENV_KEY, ENV_PREVIOUS_KEYS
from .api import StoreError
from .backend import Backend, Handle, Kind, ObjectStat, layout
from .hubclient import TOKEN_ENV, HubClient, HubKeySource
from .pack import Parts
from .sealing import KEY_BYTES, Sealer, is_sealed_file

logger = logging.getLogger(__name__)

KEY_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
KEY_FORMAT = 1
LOST_KEY = (
    "Without this key no snapshot in the store can be read, by anyone: keep a copy of it "
    "somewhere safe (a password manager), not in the store."
)
PASSPHRASE_PREFIX = "passphrase-"
"""Key objects that hold the master key wrapped by a passphrase (not by a KEK)."""
MIN_PASSPHRASE = 10
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**15, 8, 1
"""scrypt's cost (restic's defaults are alike): ~0.1 s and 32 MiB a try here."""
KEEP_PASSPHRASE = "jupyter snapshot store passphrase"
"""The command that keeps a copy of the store's key in the store, under a passphrase."""
RECOVER = "jupyter snapshot store recover"
"""The command that opens that copy on another machine."""


def only_here_notice(location: str, source: KeySource) -> str:
    """What to tell the user of an S3 store whose only key is a file on this machine."""
    return (
        f"The key of your snapshots in {location} is only on this machine ({source}): if "
        f"this machine is lost, every snapshot is lost with it. Run '{KEEP_PASSPHRASE}' "
        "once to keep a copy of the key in the store under a passphrase of yours; on "
        f"another machine '{RECOVER}' opens it with that passphrase."
    )


class KeySource(Protocol):
    """Where a repository's key-encryption key comes from."""

    def current(self) -> tuple[str, bytes]: ...  # (key id, 32 random bytes)

    def previous(self) -> list[tuple[str, bytes]]: ...  # older keys, still accepted to unwrap


def key_id(kek: bytes) -> str:
    """A KEK's public name (the name of the object it wraps): says nothing of the key."""
    return hashlib.sha256(b"jupyter-kernel-snapshots kek id\0" + kek).hexdigest()[:16]


def parse_key(text: str, where: str) -> tuple[str, bytes]:
    """A KEK written as base64 (32 bytes), with its id; ``where`` names it in the error."""
    try:
        kek = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        kek = b""
    if len(kek) != KEY_BYTES:
        raise StoreError(
            f"The snapshot encryption key in {where} is not {KEY_BYTES} bytes in base64.",
            hint='Give it as printed by: python -c "import base64, os; '
            'print(base64.b64encode(os.urandom(32)).decode())"',
        )
    return key_id(kek), kek


def new_key_text() -> str:
    return base64.b64encode(os.urandom(KEY_BYTES)).decode()


class FileKeySource:
    """A key file of its own on this machine (the single-machine default): made at first
    use, mode 0600, in a 0700 directory; never in the store. ``<file>.previous`` holds
    the keys it replaced (one a line), still accepted to unwrap."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def __str__(self) -> str:
        return f"the key file {self.path}"

    @property
    def previous_path(self) -> Path:
        return self.path.with_name(self.path.name + ".previous")

    def current(self) -> tuple[str, bytes]:
        with self._lock:
            try:
                text = self.path.read_text()
            except FileNotFoundError:
                text = self._make()
            except OSError as exc:
                raise StoreError(
                    f"Cannot read the snapshot encryption key {self.path}: {exc.strerror}.",
                    hint="Check that this user may read it (mode 0600).",
                ) from exc
        return parse_key(text, str(self.path))

    def _make(self) -> str:
        text = new_key_text() + "\n"
        try:
            private.make_dirs(self.path.parent)
            fd = private.create(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return self.path.read_text()
        except OSError as exc:
            raise StoreError(
                f"Cannot create the snapshot encryption key {self.path}: {exc.strerror}.",
                hint="Check that this user may write its directory.",
            ) from exc
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        logger.warning("Made a new snapshot encryption key: %s. %s", self.path, LOST_KEY)
        return text

    def previous(self) -> list[tuple[str, bytes]]:
        try:
            lines = self.previous_path.read_text().split()
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StoreError(
                f"Cannot read the previous snapshot keys {self.previous_path}: {exc.strerror}.",
                hint="Check that this user may read it (mode 0600).",
            ) from exc
        return [parse_key(line, str(self.previous_path)) for line in lines]

    def rotate(self) -> tuple[str, bytes]:
        """A new current key; the one it replaces goes to ``<file>.previous`` first, so a
        crash at any step leaves both readable. The new key."""
        old = self.current()
        with self._lock:
            lines = self.previous_path.read_text().split() if self.previous_path.exists() else []
            lines.append(base64.b64encode(old[1]).decode())
            private.write_file(self.previous_path, "\n".join(lines) + "\n")
            text = new_key_text() + "\n"
            private.write_file(self.path, text)
        logger.warning("New snapshot encryption key in %s. %s", self.path, LOST_KEY)
        return parse_key(text, str(self.path))


class EnvKeySource:
    """The KEK in the server's environment, $JUPYTER_SNAPSHOT_KEY (base64), set by a
    spawner from a secret of the user's; older ones in $JUPYTER_SNAPSHOT_KEY_PREVIOUS
    (comma-separated). Read once, when the store is configured."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._current = environ.get(ENV_KEY, "")
        self._previous = [k for k in environ.get(ENV_PREVIOUS_KEYS, "").split(",") if k.strip()]

    def __str__(self) -> str:
        return f"${ENV_KEY}"

    def current(self) -> tuple[str, bytes]:
        if not self._current.strip():
            raise StoreError(
                f"The snapshot store's key source is 'env', but ${ENV_KEY} is not set.",
                hint=f"Set {ENV_KEY} (32 random bytes, base64) in the server's environment "
                "(the spawner's), or choose another encryption_key_source.",
            )
        return parse_key(self._current, f"${ENV_KEY}")

    def previous(self) -> list[tuple[str, bytes]]:
        return [parse_key(text, f"${ENV_PREVIOUS_KEYS}") for text in self._previous]


@dataclass(frozen=True)
class KeySettings:
    """What a key source may be made from."""

    key_file: Path
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ), repr=False)
    """The server's environment: $JUPYTER_SNAPSHOT_KEY ("env"), $JUPYTERHUB_API_TOKEN
    ("hub", and the hub service's signatures of S3 requests)."""
    hub_service_url: str = ""
    """The product's hub service ("hub"; also signs the s3 store's requests when set)."""

    @property
    def hub_token(self) -> str:
        return self.environ.get(TOKEN_ENV, "")


def _hub_key_source(settings: KeySettings) -> KeySource:
    """The user's KEK from the hub service, asked with the server's own hub token."""
    if not settings.hub_service_url:
        raise StoreError(
            "The snapshot store's key source is 'hub', but no hub service is configured.",
            hint="Set SnapshotExtensionApp.hub_service_url (docs/jupyterhub.md), or choose "
            "another encryption_key_source.",
        )
    return HubKeySource(HubClient(settings.hub_service_url, settings.hub_token))


KEY_SOURCES: dict[str, Callable[[KeySettings], KeySource]] = {
    "file": lambda settings: FileKeySource(settings.key_file),
    "env": lambda settings: EnvKeySource(settings.environ),
    "hub": _hub_key_source,
}
"""The key sources by the name ``encryption_key_source`` gives ("none": no encryption)."""


def make_key_source(name: str, settings: KeySettings) -> KeySource | None:
    """The source named ``name``; None for "none" (encryption off)."""
    if name == "none":
        return None
    if name not in KEY_SOURCES:
        choices = ", ".join(f'"{n}"' for n in [*KEY_SOURCES, "none"])
        raise StoreError(
            f"Unknown snapshot encryption key source {name!r}.",
            hint=f"Set encryption_key_source to one of {choices}.",
        )
    return KEY_SOURCES[name](settings)


def _payload(master: bytes) -> bytes:
    """What a key object wraps: the master key (a key object of the first encrypted
    version also listed records it let through unencrypted; that list is ignored)."""
    return json.dumps({"master": base64.b64encode(master).decode()}).encode()


def _parse_payload(data: bytes) -> bytes:
    master = base64.b64decode(json.loads(data)["master"])
    if len(master) != KEY_BYTES:
        raise ValueError("the master key has the wrong size")
    return master


class Keyring:
    """The master key of one store, unwrapped on first use (not at start: a store may be
    unreachable then), and created with the first use of a store that has none."""

    def __init__(self, backend: Backend, source: KeySource) -> None:
        self.backend = backend
        self.source = source
        self._lock = threading.Lock()
        self._sealer: Sealer | None = None
        self._master = b""
        self._kek_id = ""

    def describe(self) -> str:
        return str(self.source)

    def sealer(self) -> Sealer:
        return self._unlocked()[0]

    def _unlocked(self) -> tuple[Sealer, bytes]:
        """The master key's sealer, and the key (opened once)."""
        with self._lock:
            if self._sealer is None:
                self._master = self._open()
                self._sealer = Sealer(self._master)
            return self._sealer, self._master

    @property
    def kek_id(self) -> str:
        self.sealer()
        return self._kek_id

    def _current(self) -> tuple[str, bytes]:
        kek_id, kek = self.source.current()
        if not KEY_ID_RE.match(kek_id) or len(kek) != KEY_BYTES:
            raise StoreError(
                f"{self.describe()} gave a malformed key (id {kek_id!r}, {len(kek)} bytes).",
                hint="Check the key source's configuration.",
            )
        return kek_id, kek

    def names(self) -> tuple[set[str], set[str]]:
        """The store's key objects: those wrapped by a KEK, and passphrase copies."""
        names = set(self.backend.names(Kind.KEY))
        copies = {n for n in names if n.startswith(PASSPHRASE_PREFIX)}
        return names - copies, copies

    def _open(self) -> bytes:
        kek_id, kek = self._current()
        names, copies = self.names()
        if kek_id in names:
            self._kek_id = kek_id
            return self._unwrap(kek_id, kek)
        for old_id, old in self.source.previous():
            if old_id in names:
                master = self._unwrap(old_id, old)
                self.backend.save(layout.key(kek_id), self._wrap(kek_id, kek, master))
                for name in names - {kek_id}:  # passphrase copies stay
                    self.backend.remove(layout.key(name))
                logger.info("Snapshot store key rewrapped: %s -> %s", old_id, kek_id)
                self._kek_id = kek_id
                return master
        if names or copies:
            where = self.backend.location(layout.key(sorted(names or copies)[0]))
            theirs = ", ".join(sorted(names)) or "a passphrase copy only"
            hint = (
                "Put back the key this store was made with; after a rotation, give the "
                "old one as a previous key."
            )
            if copies:
                hint += f" Or open the store's passphrase copy of its key: '{RECOVER}'."
            else:
                hint += " A lost key cannot be recovered."
            raise StoreError(
                f"The snapshot store is encrypted with another key than the one in "
                f"{self.describe()} (key id {kek_id}; the store's is {theirs} "
                f"at {where}): its snapshots cannot be read.",
                hint=hint,
            )
        created = self._create(kek_id, kek)
        self._kek_id = kek_id
        return self._unwrap(kek_id, kek) if created is None else created  # None: raced

    def _create(self, kek_id: str, kek: bytes) -> bytes | None:
        """A new master key. Unencrypted records already in the store are not let through
        (whoever could write the store before could have put them there): a user who
        trusts them encrypts them with ``jupyter snapshot store encrypt``."""
        for snapshot_id in self.backend.names(Kind.RECORD):
            data = self.backend.load(layout.record(snapshot_id))
            if data is not None and is_sealed_file(data):
                raise StoreError(
                    f"The snapshot store has encrypted snapshots but no key object under "
                    f"{self.backend.location(layout.key(kek_id)).rsplit('/', 1)[0]}: they "
                    "cannot be read.",
                    hint="Restore the store's keys/ objects from a backup; without them the "
                    "encrypted snapshots are lost.",
                )
        master = os.urandom(KEY_BYTES)
        if not self.backend.save_if_absent(layout.key(kek_id), self._wrap(kek_id, kek, master)):
            return None
        logger.info("Snapshot store encrypted from now on; key: %s", self.describe())
        return master

    def keep_passphrase(self, passphrase: str) -> str:
        """Keep the master key in the store wrapped by ``passphrase`` (it replaces an
        earlier copy, removed once the new one is written); the new object's name."""
        check_passphrase(passphrase)
        master = self._unlocked()[1]
        name = PASSPHRASE_PREFIX + os.urandom(4).hex()
        salt = os.urandom(16)
        sealed = Sealer(_stretch(passphrase, salt)).seal(_payload(master), _key_context(name))
        doc = {
            "format": KEY_FORMAT,
            "kdf": {"name": "scrypt", "n": SCRYPT_N, "r": SCRYPT_R, "p": SCRYPT_P},
            "salt": base64.b64encode(salt).decode(),
            "sealed": base64.b64encode(sealed).decode(),
        }
        self.backend.save(layout.key(name), json.dumps(doc).encode())
        for old in self.names()[1] - {name}:
            self.backend.remove(layout.key(old))
        logger.info("Snapshot store key kept under a passphrase: %s", name)
        return name

    def recover(self, passphrase: str) -> str:
        """Open the store's passphrase copy of its master key and wrap that key with the
        key source's KEK too (the other KEKs' objects stay): from now on this machine's
        key opens the store. The KEK's id."""
        copies = self.names()[1]
        if not copies:
            raise StoreError(
                "The snapshot store holds no passphrase copy of its key "
                f"({self.backend.location(layout.key(PASSPHRASE_PREFIX + '...'))}): it cannot "
                "be recovered with a passphrase.",
                hint="Put back the key this store was made with (the key file, or "
                "$JUPYTER_SNAPSHOT_KEY).",
            )
        for name in sorted(copies):
            master = self._unwrap_passphrase(name, passphrase)
            if master is None:
                continue
            kek_id, kek = self._current()
            self.backend.save(layout.key(kek_id), self._wrap(kek_id, kek, master))
            with self._lock:
                self._sealer, self._master, self._kek_id = Sealer(master), master, kek_id
            logger.info("Snapshot store key recovered from %s for %s", name, self.describe())
            return kek_id
        raise StoreError(
            "The passphrase does not open the store's passphrase copy of its key.",
            hint="Type the passphrase given to 'jupyter snapshot store passphrase' "
            "(passphrases are case-sensitive).",
        )

    def _unwrap_passphrase(self, name: str, passphrase: str) -> bytes | None:
        """The master key, if ``passphrase`` opens the copy ``name`` (None if not)."""
        data = self.backend.load(layout.key(name))
        try:
            if data is None:
                return None
            doc = json.loads(bytes(data))
            kdf = doc["kdf"]
            if doc.get("format") != KEY_FORMAT or kdf != {
                "name": "scrypt",
                "n": SCRYPT_N,
                "r": SCRYPT_R,
                "p": SCRYPT_P,
            }:
                raise ValueError("it is not a passphrase copy of this version")
            key = _stretch(passphrase, base64.b64decode(doc["salt"]))
            sealed = base64.b64decode(doc["sealed"])
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(
                f"The passphrase copy {self.backend.location(layout.key(name))} cannot be "
                f"read: {exc}.",
                hint="Restore the store's keys/ objects from a backup.",
            ) from exc
        try:
            return _parse_payload(Sealer(key).open(sealed, _key_context(name)))
        except ValueError:
            return None

    def _wrap(self, kek_id: str, kek: bytes, master: bytes) -> bytes:
        sealed = Sealer(kek).seal(_payload(master), _key_context(kek_id))
        return json.dumps(
            {"format": KEY_FORMAT, "kek": kek_id, "sealed": base64.b64encode(sealed).decode()}
        ).encode()

    def _unwrap(self, kek_id: str, kek: bytes) -> bytes:
        handle = layout.key(kek_id)
        data = self.backend.load(handle)
        try:
            if data is None:
                raise ValueError("it is gone")
            doc = json.loads(bytes(data))
            if doc.get("format") != KEY_FORMAT or doc.get("kek") != kek_id:
                raise ValueError("it is not a key object of this version")
            sealed = base64.b64decode(doc["sealed"])
            return _parse_payload(Sealer(kek).open(sealed, _key_context(kek_id)))
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(
                f"The snapshot store's key {self.backend.location(handle)} cannot be "
                f"unwrapped with {self.describe()}: {exc}.",
                hint="Put back the key this store was made with, or the store's keys/ "
                "objects from a backup.",
            ) from exc


def unencrypted_record(where: str, snapshot_id: str) -> SnapshotCorruptError:
    store = where.rsplit("/snapshots/", 1)[0]
    return SnapshotCorruptError(
        f"The record {where} is not encrypted, though this store is: it is not read, since "
        "anyone who could write the store could have put it there (a snapshot that runs "
        "code when restored).",
        hint=f"If it is yours, from before {store} was encrypted, store it again encrypted: "
        "`jupyter snapshot store encrypt` with that store (--store-dir DIR, or --s3-bucket B "
        f"--s3-prefix P), which reads every unencrypted record there as yours; if it is not, "
        f"delete it: `jupyter snapshot rm {snapshot_id}`.",
    )


def _key_context(kek_id: str) -> bytes:
    return f"jks-key\0{kek_id}".encode()


def check_passphrase(passphrase: str) -> None:
    if len(passphrase) < MIN_PASSPHRASE:
        raise StoreError(
            f"A passphrase of {len(passphrase)} characters is too short to guard the key of "
            "every snapshot (anyone who reads the store can try passphrases offline).",
            hint=f"Use {MIN_PASSPHRASE} characters or more: several words, or a password "
            "manager's.",
        )


def _stretch(passphrase: str, salt: bytes) -> bytes:
    """The key a passphrase gives (scrypt): slow on purpose, against guessing offline."""
    kdf = Scrypt(salt=salt, length=KEY_BYTES, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P)
    return kdf.derive(passphrase.encode())


SEALED_KINDS = (Kind.RECORD, Kind.PUT)


class SealedBackend:
    """A backend whose records and claims are sealed with the master key on the way in and
    opened on the way out (each bound to its path: a record moved to another name does
    not open). Packs pass through: their chunks are sealed one by one (pack.py). Without a
    keyring, everything passes through, and a sealed file is refused with the reason.

    With a keyring an unencrypted record is refused (anyone who could write the store
    could have put it there), except the ones a migration the user runs was told to
    trust (:meth:`trusting`, ``jupyter snapshot store encrypt``)."""

    def __init__(self, inner: Backend, keyring: Keyring | None) -> None:
        self.inner = inner
        self.keyring = keyring
        self._trusted: frozenset[str] = frozenset()

    @contextmanager
    def trusting(self, snapshot_ids: set[str]) -> Iterator[None]:
        """Let these snapshots' unencrypted records through while a migration reads them."""
        self._trusted = frozenset(snapshot_ids)
        try:
            yield
        finally:
            self._trusted = frozenset()

    def _seal(self, handle: Handle, data: bytes) -> bytes:
        if self.keyring is None or handle.kind not in SEALED_KINDS:
            return data
        return self.keyring.sealer().seal_file(layout.path(handle), data)

    def location(self, handle: Handle) -> str:
        return self.inner.location(handle)

    def save(self, handle: Handle, data: bytes | Parts) -> None:
        self.inner.save(handle, self._seal(handle, data) if isinstance(data, bytes) else data)

    def save_if_absent(self, handle: Handle, data: bytes) -> bool:
        return self.inner.save_if_absent(handle, self._seal(handle, data))

    def adopt(self, handle: Handle, source: Path) -> bool:
        return self.keyring is None and self.inner.adopt(handle, source)

    def load(
        self, handle: Handle, offset: int = 0, length: int | None = None
    ) -> bytes | memoryview | None:
        data = self.inner.load(handle, offset, length)
        if data is None or length is not None or handle.kind not in SEALED_KINDS:
            return data
        data = bytes(data)
        where = self.inner.location(handle)
        if not is_sealed_file(data):
            if (
                self.keyring is not None
                and handle.kind is Kind.RECORD
                and handle.name not in self._trusted
            ):
                raise unencrypted_record(where, handle.name)
            return data
        if self.keyring is None:
            raise StoreError(
                f"{where} is encrypted, and encryption is off for this store "
                "(encryption_key_source 'none').",
                hint="Configure the key source this store was written with.",
            )
        try:
            return self.keyring.sealer().open_file(layout.path(handle), data)
        except ValueError as exc:
            raise SnapshotCorruptError(
                f"{where} cannot be opened: {exc}.",
                hint="Delete this snapshot or file; pick another snapshot.",
            ) from exc

    def names(self, kind: Kind) -> list[str]:
        return self.inner.names(kind)

    def entries(self, kind: Kind) -> Iterator[tuple[str, ObjectStat]]:
        return self.inner.entries(kind)

    def remove(self, handle: Handle) -> None:
        self.inner.remove(handle)

    def remove_all(self, names: list[str]) -> None:
        self.inner.remove_all(names)

    def sync(self) -> None:
        self.inner.sync()

    def close(self) -> None:
        self.inner.close()

    def tighten(self) -> list[Exposed]:
        return self.inner.tighten()


def status(source: KeySource | None) -> dict[str, Any]:
    """Whether encryption is on and where the key is (doctor, the server's policy)."""
    if source is None:
        return {"encryption": "off", "key": ""}
    return {"encryption": "on", "key": str(source)}
