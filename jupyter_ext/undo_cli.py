"""``jupyter snapshot undo``: a kernel back to a cell checkpoint (docs/undo.md), through
the running server's REST API."""

from __future__ import annotations

import json
from typing import Any

from traitlets import Bool, Unicode

from .cli import UNDO_DESCRIPTION, _SnapshotCommand, command_aliases
from .core.errors import SnapshotError
from .core.humanize import human_bytes, human_seconds, time_ago
from .serverclient import ServerClient


def cells_text(cells: list[dict[str, Any]]) -> str:
    """Cells as the notebook numbers them: "[7] [6]" (a cell without a count: "[ ]")."""
    return " ".join(
        f"[{c['execution_count'] if c.get('execution_count') is not None else ' '}]" for c in cells
    )


class UndoApp(_SnapshotCommand):
    name = "jupyter-snapshot-undo"
    description = UNDO_DESCRIPTION
    kernel_id = Unicode("", config=True, help="The kernel (default: the server's only kernel).")
    before_cell = Unicode("", config=True, help="Back to before this cell's latest run.")
    to = Unicode("", config=True, help="Back to this cell checkpoint.")
    redo = Bool(False, config=True, help="Back to where the last undo began.")
    list_only = Bool(False, config=True, help="List the kernel's cell checkpoints.")
    dry_run = Bool(False, config=True, help="Only say what the undo would do.")
    aliases = command_aliases("UndoApp", "kernel_id", "before_cell", "to")
    flags = {
        **_SnapshotCommand.flags,
        "redo": ({"UndoApp": {"redo": True}}, "Back to where the last undo began."),
        "list": ({"UndoApp": {"list_only": True}}, "List the kernel's cell checkpoints."),
        "dry-run": ({"UndoApp": {"dry_run": True}}, "Only say what the undo would do."),
    }

    def _kernel(self, server: ServerClient) -> str:
        if self.kernel_id:
            return self.kernel_id
        kernels = [k for k in server.call("GET", "kernels")["kernels"] if k.get("snapshots")]
        if len(kernels) != 1:
            raise SnapshotError(
                f"The server has {len(kernels)} snapshot kernels: name one.",
                hint="jupyter snapshot undo --kernel-id KERNEL ('jupyter snapshot kernels' "
                "lists them).",
            )
        return str(kernels[0]["kernel_id"])

    def run(self) -> None:
        server = self.server()
        kernel_id = self._kernel(server)
        if self.list_only:
            self._list(server.call("GET", f"kernels/{kernel_id}/checkpoints"))
            return
        action = "redo" if self.redo else "undo"
        body = {k: v for k, v in (("to", self.to), ("before_cell", self.before_cell)) if v}
        if self.dry_run:
            plan = server.call("GET", f"kernels/{kernel_id}/{action}", **body)
            if self.as_json:
                print(json.dumps(plan, indent=1))
                return
            self._say(plan, would=True)
            return
        answer = server.call("POST", f"kernels/{kernel_id}/{action}", body=body)
        result = server.follow(answer["job"])["result"]
        if self.as_json:
            print(json.dumps(result, indent=1))
            return
        self._say(result, would=False)

    def _list(self, listing: dict[str, Any]) -> None:
        if self.as_json:
            print(json.dumps(listing, indent=1))
            return
        if not listing.get("enabled"):
            print(f"No cell checkpoints for this kernel: {listing.get('reason')}")
        for checkpoint in reversed(listing.get("checkpoints", [])):
            memory = checkpoint.get("memory") or {}
            mark = " <- the kernel" if checkpoint["id"] == listing.get("position") else ""
            if checkpoint["id"] == listing.get("redo"):
                mark += " <- redo"
            print(
                f"{checkpoint['id']}  {time_ago(checkpoint['created']):>12}  "
                f"{checkpoint['kind']:<11} after {cells_text(checkpoint['cells']) or '-':<10} "
                f"{memory.get('mode', ''):<11} {human_bytes(checkpoint.get('own_bytes', 0)):>10}"
                f"{mark}"
            )
        if skipped := listing.get("skipped"):
            print(f"Last one skipped: {skipped['reason']}")

    @staticmethod
    def _say(result: dict[str, Any], *, would: bool) -> None:
        undone = cells_text(result.get("undone", [])) or "no cell"
        if would:
            print(f"Would go back to checkpoint {result['target']}, undoing {undone}.")
        else:
            print(
                f"Back to checkpoint {result['target']} in "
                f"{human_seconds(result.get('seconds', 0))}, undoing {undone}; the next "
                f"cell is [{result.get('execution_count') or '?'}]."
                + (" Redo goes back to where this began." if result.get("redo") else "")
            )
        if not result.get("exact", True):
            print("No checkpoint was taken right before that cell: the cells run just before it")
            print("in the same batch are undone too.")
        print(result.get("outside_world", ""))
        for changed in result.get("changed_files", []):
            print(f"  changed since: {changed['path']} ({changed['change']})")
        for problem in result.get("problems", []):
            print(f"  the restore would be refused: {problem}")
