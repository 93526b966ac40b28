"""``jupyter snapshot``: check the machine, install the kernel, and manage snapshots."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from jupyter_core.application import JupyterApp
from traitlets import Bool, TraitError, Unicode, default

from . import __version__, _quickstart  # noqa: F401  (_quickstart before .app)
from .app import SnapshotExtensionApp
from .core.contents import (
    compare_contents,
    describe_comparison,
    describe_contents,
    short_contents,
)
from .core.doctor import (
    check_bucket_credentials,
    check_encryption,
    check_store,
    check_store_server,
    run_checks,
)
from .core.errors import SnapshotError
from .core.humanize import human_bytes, human_seconds, time_ago
from .core.manifest import check_snapshot_id
from .core.protocol.environment import DEFAULT_RUNTIME_ROOT, ENV_AGENT_SOCKET
from .core.store import SnapshotStore, StoreSpec, open_store
from .kernelspecs import KERNEL_NAME, install_kernelspec, wrap_kernelspec
from .serverclient import ServerClient
from .settings import SnapshotSettings


class _ServerConfigFiles(JupyterApp):
    name = "jupyter-snapshot-server-config"
    config_file_name = "jupyter_server_config"


@functools.cache
def server_settings() -> SnapshotSettings:
    """SnapshotExtensionApp's options as a Jupyter server here would read them from its
    config files (a hub's /etc/jupyter), so that the commands use the server's key and
    store settings (a store is made from them as the server makes its own)."""
    files = _ServerConfigFiles()
    files.load_config_file()
    try:
        return SnapshotExtensionApp(config=files.config)
    except TraitError as exc:
        raise SnapshotError(
            f"The Jupyter server's configuration is not valid: {exc}",
            hint="Correct it in its jupyter_server_config file ('jupyter --paths' lists "
            "where those are).",
        ) from exc


class _ServerKey(JupyterApp):
    """The store's encryption key options, by default the server's."""

    key_source = Unicode(
        config=True,
        help="""Where the store's encryption key comes from, as
        SnapshotExtensionApp.encryption_key_source ("file", "env", "hub" or "none").
        Default: the server's (its config files), else "file".""",
    )
    key_file = Unicode(
        config=True,
        help="""The key file of key source "file". Default: the server's
        encryption_key_file (its config files), else <Jupyter data dir>/kernel_snapshots/
        store.key.""",
    )
    aliases = {"key-source": "_ServerKey.key_source", "key-file": "_ServerKey.key_file"}

    @default("key_source")
    def _default_key_source(self) -> str:
        return server_settings().encryption_key_source

    @default("key_file")
    def _default_key_file(self) -> str:
        return server_settings().encryption_key_file

    def server_store(self) -> StoreSpec:
        """The server's store of this user, with this command's key options."""
        settings = server_settings().option_values()
        settings["encryption_key_source"] = self.key_source
        settings["encryption_key_file"] = self.key_file
        return StoreSpec.from_settings(settings)


class DoctorApp(_ServerKey):
    name = "jupyter-snapshot-doctor"
    description = "Say what works and what is missing for kernel snapshots, and how to fix it."
    criu = Unicode("", config=True, help="Path of the criu binary (default: search).")
    store_dir = Unicode(
        config=True,
        help="""The local store's directory to check for files others can read. Default:
        the server's local_store_dir (its config files, else <Jupyter data dir>/
        kernel_snapshots/store).""",
    )
    work_dir = Unicode(
        config=True,
        help="""The work directory to check likewise. Default: the server's work_dir (its
        config files, else <Jupyter data dir>/kernel_snapshots/work).""",
    )
    as_json = Bool(False, config=True, help="Print the checks as JSON.")
    flags = {"json": ({"DoctorApp": {"as_json": True}}, "Print the checks as JSON.")}
    aliases = {
        "criu": "DoctorApp.criu",
        "store-dir": "DoctorApp.store_dir",
        "work-dir": "DoctorApp.work_dir",
        **_ServerKey.aliases,
    }

    @default("store_dir")
    def _default_store_dir(self) -> str:
        return server_settings().local_store_dir

    @default("work_dir")
    def _default_work_dir(self) -> str:
        return server_settings().work_dir

    def start(self) -> None:
        checks = run_checks(
            self.criu or None,
            DEFAULT_RUNTIME_ROOT,
            private_dirs=[Path(p) for p in (self.store_dir, self.work_dir) if p],
            store_checks=(
                check_bucket_credentials(
                    os.environ,
                    Path.home(),
                    server_settings().store,
                    server_settings().hub_service_url,
                ),
                check_encryption(self.key_source, Path(self.key_file), os.environ),
                check_store_server(server_settings().option_values(), os.environ),
                *(c for c in check_store(lambda: open_store(self.server_store())) if c),
            ),
            agent_socket=Path(agent) if (agent := os.environ.get(ENV_AGENT_SOCKET)) else None,
        )
        if self.as_json:
            print(json.dumps([c.to_dict() for c in checks], indent=1))
        else:
            for check in checks:
                mark = "ok  " if check.ok else ("FAIL" if check.required else "warn")
                print(f"[{mark}] {check.name}: {check.detail}")
                if not check.ok and check.fix:
                    print(f"       fix: {check.fix}")
            failed = [c for c in checks if c.required and not c.ok]
            print(
                "\nSnapshots work on this machine."
                if not failed
                else f"\nSnapshots do not work here yet: {len(failed)} required check(s) failed."
            )
        self.exit(1 if any(c.required and not c.ok for c in checks) else 0)


class InstallKernelSpecApp(JupyterApp):
    name = "jupyter-snapshot-install-kernelspec"
    description = (
        "Install the 'Python 3 (snapshots)' kernel for this Python environment. With "
        "--name python3 it replaces ipykernel's kernelspec: the Launcher's Python tile and "
        "every notebook whose metadata say python3 then start a snapshot kernel. With "
        "--wrap NAME it makes the installed kernelspec NAME (IRkernel's ir, xeus-python's "
        "xpython, any Jupyter kernel) a snapshot kernel, 'NAME-snapshot' unless --name "
        "says otherwise (--wrap ir --name ir: every R notebook starts it); docs/kernels.md."
    )
    kernel_name = Unicode(
        "", config=True, help=f"Kernel name (default: {KERNEL_NAME}, or NAME-snapshot)."
    )
    display_name = Unicode(
        "",
        config=True,
        help="Name shown in Jupyter (default: 'Python 3 (snapshots)', or the wrapped "
        "kernel's followed by '(snapshots)').",
    )
    wrap = Unicode(
        "",
        config=True,
        help="Make this installed kernelspec a snapshot kernel (its argv, env, interrupt "
        "mode and metadata kept).",
    )
    user = Bool(False, config=True, help="Install for the current user only.")
    prefix = Unicode("", config=True, help="Install under this prefix (default: sys.prefix).")
    aliases = {
        "name": "InstallKernelSpecApp.kernel_name",
        "display-name": "InstallKernelSpecApp.display_name",
        "prefix": "InstallKernelSpecApp.prefix",
        "wrap": "InstallKernelSpecApp.wrap",
    }
    flags = {"user": ({"InstallKernelSpecApp": {"user": True}}, "Install for this user only.")}

    def start(self) -> None:
        prefix = None if self.user else (self.prefix or sys.prefix)
        if self.wrap:
            name = self.kernel_name or f"{self.wrap}-snapshot"
            try:
                path = wrap_kernelspec(
                    self.wrap, name, self.display_name, user=self.user, prefix=prefix
                )
            except SnapshotError as exc:
                print(f"error: {exc}", file=sys.stderr)
                self.exit(1)
            print(f"Installed kernelspec {name} (snapshots of {self.wrap}) in {path}")
            return
        name = self.kernel_name or KERNEL_NAME
        path = install_kernelspec(
            name, self.display_name or "Python 3 (snapshots)", user=self.user, prefix=prefix
        )
        print(f"Installed kernelspec {name} in {path}")


def memory_copy(memory: dict[str, Any]) -> str:
    """How a snapshot copied the kernel's memory, in words ("" for older snapshots)."""
    if not memory.get("mode"):
        return ""
    copied = human_bytes(memory.get("copied_bytes") or 0)
    frozen = human_seconds(memory.get("frozen_total_seconds") or 0)
    if memory["mode"] == "incremental":
        return (
            f"Only what changed since its previous snapshot: {copied} copied, kernel frozen "
            f"{frozen}."
        )
    reason = memory.get("reason") or "no reason given"
    return f"A full copy ({reason}): {copied}, kernel frozen {frozen}."


def print_snapshots(snapshots: list[dict[str, Any]]) -> None:
    if not snapshots:
        print("No snapshots.")
        return
    print(
        f"{'ID':<32}  {'WHEN':<12} {'TRIGGER':<15} {'SIZE':>10} {'NEW':>10}  STATUS    "
        "NOTEBOOK  LAST CELL  LARGEST"
    )
    for snap in snapshots:
        size = snap.get("stored_bytes") or snap.get("total_bytes") or 0
        contents = snap.get("contents") or {}
        cells = contents.get("cells") or []
        last = (
            f"[{cells[-1].get('execution_count')}] {cells[-1].get('first_line', '')}"
            if cells
            else "-"
        )
        largest = ", ".join(str(v.get("name")) for v in (contents.get("variables") or [])[:3])
        print(
            f"{snap['id']:<32}  {time_ago(snap['created']):<12} {snap['trigger']:<15} "
            f"{human_bytes(size):>10} {human_bytes(snap.get('new_bytes') or 0):>10}  "
            f"{snap['status']:<9} {snap.get('notebook_path') or '-'}  {last[:40]}  {largest or '-'}"
        )


SERVER_NAMES = {
    "s3_bucket": "s3_bucket",
    "s3_prefix": "s3_prefix",
    "s3_endpoint_url": "s3_endpoint_url",
    "s3_region": "s3_region",
    "s3_server_side_encryption": "s3_server_side_encryption",
    "s3_sse_kms_key_id": "s3_sse_kms_key_id",
    "group_access": "local_store_group_access",
}
"""A store command's options that stand for the server's (by its option's name) where
they are given."""


class _SnapshotCommand(_ServerKey):
    """Shared options: which server, or which store."""

    url = Unicode("", config=True, help="URL of the Jupyter server (default: the running one).")
    token = Unicode("", config=True, help="Token of the Jupyter server.")
    store_dir = Unicode(
        "", config=True, help="Work on this local store directly (a user's own directory)."
    )
    s3_bucket = Unicode("", config=True, help="Work on this S3 bucket directly.")
    s3_prefix = Unicode(
        None,
        allow_none=True,
        config=True,
        help="""The user's prefix in the bucket, whole. Default: this user's under the
        server's s3_prefix (<s3_prefix>/users/<user>).""",
    )
    s3_endpoint_url = Unicode(
        None, allow_none=True, config=True, help="S3-compatible endpoint. Default: the server's."
    )
    s3_region = Unicode(
        None, allow_none=True, config=True, help="S3 region. Default: the server's."
    )
    s3_server_side_encryption = Unicode(
        None,
        allow_none=True,
        config=True,
        help="As SnapshotExtensionApp.s3_server_side_encryption. Default: the server's.",
    )
    s3_sse_kms_key_id = Unicode(
        None,
        allow_none=True,
        config=True,
        help="As SnapshotExtensionApp.s3_sse_kms_key_id. Default: the server's.",
    )
    group_access = Bool(
        None,
        allow_none=True,
        config=True,
        help="As SnapshotExtensionApp.local_store_group_access. Default: the server's.",
    )
    as_json = Bool(False, config=True, help="Print JSON.")
    aliases = {
        "url": "_SnapshotCommand.url",
        "token": "_SnapshotCommand.token",
        "store-dir": "_SnapshotCommand.store_dir",
        "s3-bucket": "_SnapshotCommand.s3_bucket",
        "s3-prefix": "_SnapshotCommand.s3_prefix",
        "s3-endpoint-url": "_SnapshotCommand.s3_endpoint_url",
        "s3-region": "_SnapshotCommand.s3_region",
        **_ServerKey.aliases,
    }
    flags = {"json": ({"_SnapshotCommand": {"as_json": True}}, "Print JSON.")}

    def store_spec(self) -> StoreSpec | None:
        """The store named on the command line (None: work through the server): the
        server's settings (its config files) with what the command line names instead,
        made into a spec as the server makes its own (StoreSpec.from_settings)."""
        if not self.store_dir and not self.s3_bucket:
            return None
        named = {
            "store": "local" if self.store_dir else "s3",
            "local_store_dir": self.store_dir,
            "encryption_key_source": self.key_source,
            "encryption_key_file": self.key_file,
        }
        for option, server_name in SERVER_NAMES.items():
            if getattr(self, option) is not None:
                named[server_name] = getattr(self, option)
        whole = bool(self.store_dir) or self.s3_prefix is not None
        return StoreSpec.from_settings(
            {**server_settings().option_values(), **named}, "" if whole else None
        )

    def direct_store(self) -> SnapshotStore | None:
        spec = self.store_spec()
        return None if spec is None else open_store(spec)

    def server(self) -> ServerClient:
        return ServerClient.find(self.url, self.token)

    def start(self) -> None:
        try:
            self.run()
        except SnapshotError as exc:
            print(f"error: {exc}", file=sys.stderr)
            self.exit(1)

    def run(self) -> None:
        raise NotImplementedError


def command_aliases(command: str, *options: str) -> dict[str, str]:
    """The shared options' command-line names, and the command's own ``options``
    (``kernel_id`` as ``--kernel-id``)."""
    own = {option.replace("_", "-"): f"{command}.{option}" for option in options}
    return {**_SnapshotCommand.aliases, **own}


class ListApp(_SnapshotCommand):
    name = "jupyter-snapshot-list"
    description = "List snapshots (of a running server, or of a store with --store-dir/--s3-*)."
    path = Unicode("", config=True, help="Only snapshots of this notebook.")
    kernel_id = Unicode("", config=True, help="Only snapshots of this kernel.")
    aliases = command_aliases("ListApp", "path", "kernel_id")

    def run(self) -> None:
        store = self.direct_store()
        if store is not None:
            snapshots = [
                {
                    **json.loads(s.manifest.to_json()),
                    "contents": short_contents(s.manifest.contents),
                    "status": "complete",
                    "stored_bytes": s.stored_bytes,
                    "new_bytes": s.new_bytes,
                }
                for s in store.snapshots()
            ]
            if self.path:
                snapshots = [s for s in snapshots if s.get("notebook_path") == self.path]
            snapshots.sort(key=lambda s: s["created"], reverse=True)
        else:
            answer = self.server().call("GET", "", path=self.path, kernel_id=self.kernel_id)
            snapshots = answer["snapshots"]
            if answer.get("store_error"):
                print(
                    f"warning: the store is unreachable: {answer['store_error']}", file=sys.stderr
                )
        if self.as_json:
            print(json.dumps(snapshots, indent=1))
        else:
            print_snapshots(snapshots)


class ShowApp(_SnapshotCommand):
    name = "jupyter-snapshot-show"
    description = (
        "What a snapshot holds (cells run since the previous one, largest variables): "
        "jupyter snapshot show ID; with two ids, what changed from the first to the second."
    )

    def _get(self, snapshot_id: str) -> dict[str, Any]:
        store = self.direct_store()
        if store is None:
            answer: dict[str, Any] = self.server().call("GET", check_snapshot_id(snapshot_id))
            return answer
        manifest = store.get(check_snapshot_id(snapshot_id)).manifest
        return {**json.loads(manifest.to_json()), "status": "complete"}

    def run(self) -> None:
        if len(self.extra_args) not in (1, 2):
            raise SnapshotError(
                "Name one snapshot id, or two to compare.",
                hint="jupyter snapshot show ID [ID2]",
            )
        snaps = [self._get(snapshot_id) for snapshot_id in self.extra_args]
        if len(snaps) == 2:
            diff = compare_contents(snaps[0].get("contents") or {}, snaps[1].get("contents") or {})
            print(
                json.dumps(diff, indent=1) if self.as_json else "\n".join(describe_comparison(diff))
            )
            return
        snap = snaps[0]
        if self.as_json:
            print(json.dumps(snap, indent=1))
            return
        print(
            f"Snapshot {snap['id']} of {snap.get('notebook_path') or 'a kernel'}, "
            f"{time_ago(snap['created'])} ({snap['trigger']}), "
            f"{human_bytes(snap.get('total_bytes') or 0)}"
        )
        if line := memory_copy(snap.get("memory") or {}):
            print(line)
        print("\n".join(describe_contents(snap.get("contents") or {})))


class KernelsApp(_SnapshotCommand):
    name = "jupyter-snapshot-kernels"
    description = "The running server's kernels: state, activity, GPU memory and utilization."

    def run(self) -> None:
        kernels = self.server().call("GET", "kernels")["kernels"]
        if self.as_json:
            print(json.dumps(kernels, indent=1))
            return
        if not kernels:
            print("No kernels.")
            return
        print(f"{'KERNEL':<36}  {'STATE':<12} {'ACTIVITY':<10} {'GPU MEMORY':>10} {'GPU %':>5}")
        for kernel in kernels:
            if not kernel.get("snapshots"):
                print(f"{kernel['kernel_id']:<36}  (not a snapshot kernel)")
                continue
            gpu = kernel.get("gpu") or {}
            memory = "-" if gpu.get("bytes") is None else human_bytes(gpu["bytes"])
            if gpu.get("processes") and gpu.get("bytes") is None:
                memory = "in use"
            usage = "-" if gpu.get("utilization") is None else f"{gpu['utilization']}"
            print(
                f"{kernel['kernel_id']:<36}  {kernel['state']:<12} "
                f"{kernel.get('execution_state', ''):<10} {memory:>10} {usage:>5}"
            )


class CreateApp(_SnapshotCommand):
    name = "jupyter-snapshot-create"
    description = "Snapshot a running kernel: jupyter snapshot create KERNEL_ID"

    def run(self) -> None:
        if len(self.extra_args) != 1:
            raise SnapshotError("Name one kernel id.", hint="jupyter snapshot create KERNEL_ID")
        server = self.server()
        started = time.monotonic()
        job = server.follow(server.call("POST", "", body={"kernel_id": self.extra_args[0]})["job"])
        snap = job["result"]
        if self.as_json:
            print(json.dumps(snap, indent=1))
            return
        print(
            f"Snapshot {snap['id']}: {human_bytes(snap.get('total_bytes', 0))} of memory, "
            f"{human_bytes(snap.get('new_bytes') or 0)} new in the store, "
            f"kernel frozen {human_seconds(snap.get('frozen_seconds', 0))}, "
            f"done in {human_seconds(time.monotonic() - started)} ({snap['status']})."
        )
        if line := memory_copy(snap.get("memory") or {}):
            print(line)


class RestoreApp(_SnapshotCommand):
    name = "jupyter-snapshot-restore"
    description = (
        "Restore a snapshot: into a running kernel (--kernel-id), or into a new kernel attached "
        "to a notebook (--path; default: the snapshot's notebook where it is now: the session "
        "of the kernel that took it, if that kernel still runs, else the path it was taken at)."
    )
    kernel_id = Unicode("", config=True, help="Restore in place of this kernel.")
    path = Unicode("", config=True, help="Attach the new kernel to this notebook.")
    aliases = command_aliases("RestoreApp", "kernel_id", "path")

    def run(self) -> None:
        if len(self.extra_args) != 1:
            raise SnapshotError("Name one snapshot id.", hint="jupyter snapshot restore ID")
        body: dict[str, str] = {}
        if self.kernel_id:
            body["kernel_id"] = self.kernel_id
        if self.path:
            body["path"] = self.path
        server = self.server()
        started = time.monotonic()
        answer = server.call("POST", f"{self.extra_args[0]}/restore", body=body)
        job = server.follow(answer["job"])
        result = job["result"]
        if self.as_json:
            print(json.dumps(result, indent=1))
            return
        session = result.get("session") or {}
        print(
            f"Restored into kernel {result['kernel_id']}"
            + (f" for {session['path']}" if session.get("path") else "")
            + f" in {human_seconds(time.monotonic() - started)}."
        )
        closed = result.get("closed_connections") or []
        if closed:  # what could not come back is said (docs/network.md)
            print(
                "closed on restore: "
                + ", ".join(
                    f"{c['process']} (pid {c['pid']}) {c['local']} -> {c['remote']}" for c in closed
                )
            )
        for shm in result.get("private_shm") or []:  # a live process holds the name here
            holders = ", ".join(f"{h['process']} (pid {h['pid']})" for h in shm["held_by"])
            print(
                f"/dev/shm/{shm['name']}: private copy (the name is {holders}'s here: a new "
                "attach by that name reaches that process's file, not the kernel's)"
            )


class TakeApp(_SnapshotCommand):
    name = "jupyter-snapshot-take"
    description = (
        "Copy variables from a snapshot into a running kernel, which keeps everything else: "
        "jupyter snapshot take ID NAME[=NEW_NAME] ... --kernel-id=KERNEL"
    )
    kernel_id = Unicode("", config=True, help="The kernel that gets the variables.")
    overwrite = Bool(False, config=True, help="Replace variables of the same names the kernel has.")
    aliases = command_aliases("TakeApp", "kernel_id")
    flags = {
        **_SnapshotCommand.flags,
        "overwrite": (
            {"TakeApp": {"overwrite": True}},
            "Replace variables of the same names the kernel has (else the command refuses).",
        ),
    }

    def run(self) -> None:
        if len(self.extra_args) < 2 or not self.kernel_id:
            raise SnapshotError(
                "Name a snapshot, at least one variable and the kernel.",
                hint="jupyter snapshot take ID df model=model_epoch30 --kernel-id=KERNEL",
            )
        names, rename = [], {}
        for arg in self.extra_args[1:]:
            name, _, new = arg.partition("=")
            names.append(name)
            if new:
                rename[name] = new
        server = self.server()
        body = {
            "kernel_id": self.kernel_id,
            "names": names,
            "rename": rename,
            "overwrite": self.overwrite,
        }
        answer = server.call(
            "POST", f"{check_snapshot_id(self.extra_args[0])}/variables", body=body
        )
        result = server.follow(answer["job"])["result"]
        if self.as_json:
            print(json.dumps(result, indent=1))
            return
        for variable in result["variables"]:
            renamed = f" as {variable['as']}" if variable["as"] != variable["name"] else ""
            print(
                f"{variable['name']}{renamed}: {human_bytes(variable['bytes'])} ({variable['how']})"
            )


class RemoveApp(_SnapshotCommand):
    name = "jupyter-snapshot-rm"
    description = "Delete snapshots: jupyter snapshot rm ID [ID ...]"

    def run(self) -> None:
        if not self.extra_args:
            raise SnapshotError("Name the snapshots to delete.", hint="jupyter snapshot rm ID")
        store = self.direct_store()
        for snapshot_id in self.extra_args:
            if store is not None:
                store.delete(snapshot_id)
            else:
                self.server().call("DELETE", snapshot_id)
            print(f"Deleted {snapshot_id}")


STORE_DESCRIPTION = (
    "Work on a store itself: check, prune, passphrase, recover, encrypt, rotate-key."
)
UNDO_DESCRIPTION = (
    "Undo the last cell of a kernel: restore it in place from its cell checkpoint from before "
    "that cell (--before-cell CELL_ID: before that cell; --to ID: that checkpoint; --redo: "
    "back to where the last undo began; --list: the checkpoints; --dry-run: only say what "
    "it would do). Files, rows and messages stay as they are."
)


class SnapshotApp(JupyterApp):
    name = "jupyter-snapshot"
    version = __version__
    description = "Whole-process snapshots of Jupyter kernels (CRIU)."
    subcommands = {
        "list": (ListApp, ListApp.description),
        "show": (ShowApp, ShowApp.description),
        "kernels": (KernelsApp, KernelsApp.description),
        "create": (CreateApp, CreateApp.description),
        "restore": (RestoreApp, RestoreApp.description),
        "take": (TakeApp, TakeApp.description),
        # Its own module (jupyter_ext/undo_cli.py), which imports this one.
        "undo": ("jupyter_ext.undo_cli.UndoApp", UNDO_DESCRIPTION),
        "rm": (RemoveApp, RemoveApp.description),
        "doctor": (DoctorApp, DoctorApp.description),
        "store": ("jupyter_ext.storecli.StoreApp", STORE_DESCRIPTION),
        "install-kernelspec": (InstallKernelSpecApp, InstallKernelSpecApp.description),
    }

    def start(self) -> None:
        if self.subapp is None:
            print("No subcommand given; choose one of: " + ", ".join(self.subcommands))
            self.print_subcommands()
            self.exit(1)
        super().start()


main = SnapshotApp.launch_instance


if __name__ == "__main__":
    main()
