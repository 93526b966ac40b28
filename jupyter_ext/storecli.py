"""``jupyter snapshot store ...``: commands on a store itself (check, prune, the key's
passphrase copy, encryption), on the server's store of this user or one named."""

from __future__ import annotations

import getpass
import json
import sys
from pathlib import Path

from jupyter_core.application import JupyterApp
from traitlets import Bool, Unicode, default

from .cli import STORE_DESCRIPTION, _SnapshotCommand, command_aliases, server_settings
from .core.errors import SnapshotError
from .core.store import Repository, open_store
from .core.store.backend import layout
from .core.store.check import CheckReport
from .core.store.keys import LOST_KEY, FileKeySource
from .core.store.prune import PruneReport
from .core.store.scope import user_prefix
from .serverclient import ProgressLine


class _StoreCommand(_SnapshotCommand):
    """A command on a store itself (--store-dir or --s3-*), never through a server."""

    def open(self, default_to_server: bool = False) -> Repository:
        """The store named on the command line; with ``default_to_server``, else the
        server's store of this user (its config files)."""
        spec = self.store_spec()
        if spec is None and default_to_server:
            spec = self.server_store()
        if spec is None:
            server = server_settings()
            raise SnapshotError(
                "Name the store: --store-dir DIR, or --s3-bucket B [--s3-prefix P].",
                hint="The server's local store of this user is "
                f"{Path(server.local_store_dir) / user_prefix(server.owner)}.",
            )
        return open_store(spec)


class EncryptStoreApp(_StoreCommand):
    name = "jupyter-snapshot-store-encrypt"
    description = (
        "Encrypt a store's unencrypted snapshots (a store from before encryption), which an "
        "encrypted store never reads otherwise: run it only if every unencrypted snapshot in "
        "the store is yours (delete any other first). Each is read and verified, stored "
        "again encrypted under its id, and the unencrypted packs are removed. Run it while "
        "no server takes snapshots into the store."
    )
    work_dir = Unicode(
        config=True,
        help="Where each snapshot is unpacked on its way (default: the server's work_dir).",
    )
    aliases = command_aliases("EncryptStoreApp", "work_dir")

    @default("work_dir")
    def _default_work_dir(self) -> str:
        return server_settings().work_dir

    def run(self) -> None:
        store = self.open()

        def said(snapshot_id: str) -> None:
            print(f"encrypted {snapshot_id}", flush=True)

        done = store.encrypt_unencrypted(Path(self.work_dir), said)
        assert store.keyring is not None  # encrypt_unencrypted refuses a store without
        print(f"{len(done)} snapshot(s) encrypted; key: {store.keyring.describe()}. {LOST_KEY}")


class RotateKeyApp(_StoreCommand):
    name = "jupyter-snapshot-store-rotate-key"
    description = (
        "A new key-encryption key for a store of key source 'file': the store's master key "
        "is rewrapped (one small object; no snapshot rewritten). The old key stays in "
        "<key file>.previous, still accepted by other stores that use the same file until "
        "they are opened once."
    )

    def run(self) -> None:
        if self.key_source != "file":
            raise SnapshotError(
                f"rotate-key changes a key file; this store's key source is {self.key_source!r}.",
                hint="With 'env': set JUPYTER_SNAPSHOT_KEY to the new key and "
                "JUPYTER_SNAPSHOT_KEY_PREVIOUS to the old one; the server rewraps at start.",
            )
        store = self.open()
        if store.keyring is None:
            raise SnapshotError("This store is not encrypted.", hint="Leave --key-source at file.")
        before = store.keyring.kek_id  # unwrapped with the key of today
        FileKeySource(Path(self.key_file)).rotate()
        rotated = self.open()
        assert rotated.keyring is not None
        print(
            f"The store's master key is now wrapped by key {rotated.keyring.kek_id} (was "
            f"{before}), in {self.key_file}; the old key is in {self.key_file}.previous. "
            + LOST_KEY
        )


class CheckStoreApp(_SnapshotCommand):
    name = "jupyter-snapshot-store-check"
    description = (
        "Check that the store is whole (restic's check): the key opens, every record is "
        "readable, every chunk a snapshot needs is in a pack that lists it there; with "
        "--read-data every such chunk is read and checked too (decrypted, or hashed). "
        "Damaged or missing pieces are named with the snapshots they break (exit 1); what "
        "nothing needs is listed with what 'store prune' removes. It only reads. The "
        "server's store (through the running server), or one named with --store-dir or "
        "--s3-bucket."
    )
    read_data = Bool(False, config=True, help="Read and check every chunk a snapshot needs.")
    flags = {
        **_SnapshotCommand.flags,
        "read-data": ({"CheckStoreApp": {"read_data": True}}, "Read and check every chunk too."),
    }

    def run(self) -> None:
        store = self.direct_store()
        if store is None:
            server = self.server()
            job = server.call("POST", "store/check", body={"read_data": self.read_data})["job"]
            found = server.follow(job)["result"]
            lines = CheckReport.from_dict(found).lines()
        else:
            with ProgressLine("check") as line:
                report = store.check(self.read_data, line.event)
            found, lines = report.to_dict(), report.lines()
        print(json.dumps(found, indent=1) if self.as_json else "\n".join(lines))
        if not found["ok"]:
            self.exit(1)


class PruneStoreApp(_SnapshotCommand):
    name = "jupyter-snapshot-store-prune"
    description = (
        "Remove what no snapshot needs: packs last changed before the grace period, the "
        "claims of killed puts and clean-ups, and mostly unneeded packs rewritten; says "
        "what it freed. A damaged store is left as it is ('store check' names what to "
        "delete first). The server's store, or one named with --store-dir or --s3-bucket."
    )

    def run(self) -> None:
        store = self.direct_store()
        if store is None:
            server = self.server()
            done = server.follow(server.call("POST", "store/prune")["job"])["result"]
            lines = PruneReport.from_dict(done).lines()
        else:
            report = store.prune()
            done, lines = report.to_dict(), report.lines()
        print(json.dumps(done, indent=1) if self.as_json else "\n".join(lines))


def read_passphrase(prompt: str, twice: bool) -> str:
    """A passphrase typed at the terminal (twice for a new one), or one line of stdin when
    it is not a terminal (a script, a password manager's pipe)."""
    if not sys.stdin.isatty():
        return sys.stdin.readline().rstrip("\n")
    passphrase = getpass.getpass(prompt)
    if twice and getpass.getpass("Again: ") != passphrase:
        raise SnapshotError("The two passphrases differ.", hint="Type the same one twice.")
    return passphrase


class PassphraseStoreApp(_StoreCommand):
    name = "jupyter-snapshot-store-passphrase"
    description = (
        "Keep a copy of the store's key in the store, wrapped by a passphrase of yours "
        "(restic's way): the snapshots then outlive this machine and its key file. Another "
        "machine opens them with 'jupyter snapshot store recover' and the passphrase. Run "
        "again to change the passphrase. The server's store by default (this user's)."
    )

    def run(self) -> None:
        store = self.open(default_to_server=True)
        if store.keyring is None:
            raise SnapshotError("This store is not encrypted: it has no key to keep.")
        passphrase = read_passphrase("New passphrase for the store's key: ", twice=True)
        store.keyring.keep_passphrase(passphrase)
        root = store.backend.location(layout.key("-")).rsplit("/", 2)[0]
        print(
            f"The key of {root} is now kept there under your passphrase too. Keep the "
            "passphrase somewhere safe, outside this machine (a password manager): with it, "
            "'jupyter snapshot store recover' on another machine opens every snapshot; "
            "without it and this machine's key, nobody can."
        )


class RecoverStoreApp(_StoreCommand):
    name = "jupyter-snapshot-store-recover"
    description = (
        "On another machine (the first one lost): open the store's passphrase copy of its "
        "key with your passphrase, and let this machine's key (its key file, made if "
        "missing) open the store from now on. The server's store by default (this user's: "
        "its s3_bucket and prefix from the config files); then restore snapshots as usual."
    )

    def run(self) -> None:
        store = self.open(default_to_server=True)
        if store.keyring is None:
            raise SnapshotError("This store is not encrypted: there is no key to recover.")
        kek_id = store.keyring.recover(read_passphrase("The store's passphrase: ", twice=False))
        print(
            f"Recovered: {store.keyring.describe()} (key {kek_id}) now opens the store; "
            f"{len(store.snapshots())} snapshot(s) can be restored."
        )


class StoreApp(JupyterApp):
    name = "jupyter-snapshot-store"
    description = STORE_DESCRIPTION
    subcommands = {
        "check": (CheckStoreApp, CheckStoreApp.description),
        "prune": (PruneStoreApp, PruneStoreApp.description),
        "passphrase": (PassphraseStoreApp, PassphraseStoreApp.description),
        "recover": (RecoverStoreApp, RecoverStoreApp.description),
        "encrypt": (EncryptStoreApp, EncryptStoreApp.description),
        "rotate-key": (RotateKeyApp, RotateKeyApp.description),
    }

    def start(self) -> None:
        if self.subapp is None:
            print("No subcommand given; choose one of: " + ", ".join(self.subcommands))
            self.exit(1)
        super().start()
