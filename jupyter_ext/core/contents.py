"""A snapshot's record of what it holds (``Manifest.contents``), shortened and compared.

The kernel's agent writes the record (kernel_wrapper.inkernel.contents); the server lists its short
form with every snapshot and gives the full one for a single snapshot; the CLI and the
panel compare two. Records come from manifests of any version: every field is optional.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from .humanize import human_bytes

#: Variables a listing shows per snapshot (the full record has up to 50).
SHORT_VARIABLES = 5
#: What a record says a kernel's language cannot give (kernel_wrapper/agents.py): why its
#: variables are not listed, why they cannot be taken back.
UNAVAILABLE = ("variables_unavailable", "take_unavailable")
#: Cells kept for the next snapshot, and characters of code kept per cell.
MAX_CELLS = 200
MAX_CODE_CHARS = 2000


def first_line(code: str) -> str:
    """The first non-empty line of a cell, for one-line displays."""
    for line in code.splitlines():
        if line.strip():
            return line.rstrip()[:200]
    return ""


def short_contents(contents: dict[str, Any]) -> dict[str, Any]:
    """The listing's form: each cell's first line, the largest variables, every variable's
    name (so a listing can be searched by name), the totals and whether it is partial."""
    if not contents:
        return {}
    cells = [c for c in contents.get("cells", []) if isinstance(c, dict)]
    variables = [v for v in contents.get("variables", []) if isinstance(v, dict)]
    short: dict[str, Any] = {
        "cells": [
            {
                "execution_count": c.get("execution_count"),
                "first_line": first_line(str(c.get("code", ""))),
                "seconds": c.get("seconds"),
                **({"running": True} if c.get("running") else {}),
            }
            for c in cells
        ],
        "variables": variables[:SHORT_VARIABLES],
        "variable_names": [str(v.get("name")) for v in variables],
        "variable_count": contents.get("variable_count", len(variables)),
        "variables_bytes": contents.get("variables_bytes", 0),
        "partial": bool(contents.get("partial", False)),
    }
    for key in ("partial_reason", "language", *UNAVAILABLE):
        if contents.get(key):
            short[key] = contents[key]
    return short


def compare_contents(older: dict[str, Any], newer: dict[str, Any]) -> dict[str, Any]:
    """What changed from ``older`` to ``newer``: variables added, removed, changed (in type,
    size, shape or dtype), and the cells ``newer`` ran since its previous snapshot."""
    before = {v.get("name"): v for v in older.get("variables", []) if isinstance(v, dict)}
    after = {v.get("name"): v for v in newer.get("variables", []) if isinstance(v, dict)}
    changed = []
    for name, new in after.items():
        old = before.get(name)
        if old is None:
            continue
        fields = [
            k for k in ("type", "size", "shape", "dtype", "device") if old.get(k) != new.get(k)
        ]
        if fields:
            changed.append({"name": name, "fields": fields, "before": old, "after": new})
    return {
        "added": [after[n] for n in after if n not in before],
        "removed": [before[n] for n in before if n not in after],
        "changed": changed,
        "cells": newer.get("cells", []),
        "partial": bool(older.get("partial") or newer.get("partial")),
    }


def _variable_line(v: dict[str, Any]) -> str:
    detail = []
    if v.get("shape") is not None:
        detail.append("x".join(str(n) for n in v["shape"]) or "scalar")
    if v.get("dtype"):
        detail.append(str(v["dtype"]))
    if v.get("length") is not None:
        detail.append(f"len {v['length']}")
    if v.get("device"):
        detail.append(str(v["device"]))
    approx = "~" if v.get("estimated") else ""
    return (
        f"  {v.get('name')!s:<24} {v.get('type')!s:<28} "
        f"{approx + human_bytes(int(v.get('size', 0))):>11}  {', '.join(detail)}"
    )


def describe_contents(contents: dict[str, Any]) -> list[str]:
    """Lines for a terminal: the cells since the previous snapshot, then the variables."""
    if not contents:
        return ["Contents: not recorded (a snapshot from before contents were recorded)."]
    lines = []
    cells = contents.get("cells", [])
    lines.append(f"Cells run since the previous snapshot: {len(cells)}")
    for cell in cells:
        count = cell.get("execution_count")
        state = "running" if cell.get("running") else f"{float(cell.get('seconds') or 0):.1f} s"
        text = cell.get("first_line") or first_line(str(cell.get("code", "")))
        lines.append(f"  [{count if count is not None else ' '}] {state:>9}  {text}")
    variables = contents.get("variables", [])
    total = human_bytes(int(contents.get("variables_bytes", 0)))
    if contents.get("variables_unavailable"):
        lines.append(f"Variables: {contents['variables_unavailable']}")
    else:
        count = contents.get("variable_count", len(variables))
        lines.append(f"Variables: {count} ({total}); largest:")
        lines.extend(_variable_line(v) for v in variables)
    if contents.get("partial"):
        lines.append(f"Partial: {contents.get('partial_reason', 'not all was summarised')}.")
    return lines


def describe_comparison(diff: dict[str, Any]) -> list[str]:
    """Lines for a terminal of :func:`compare_contents`."""
    lines = [f"Cells between them: {len(diff['cells'])}"]
    for cell in diff["cells"]:
        lines.append(f"  [{cell.get('execution_count')}] {first_line(str(cell.get('code', '')))}")
    for title, key in (("Added", "added"), ("Removed", "removed")):
        lines.append(f"{title}: {len(diff[key])}")
        lines.extend(_variable_line(v) for v in diff[key])
    lines.append(f"Changed: {len(diff['changed'])}")
    for change in diff["changed"]:
        before, after = change["before"], change["after"]
        what = ", ".join(
            f"{k} {before.get(k)} -> {after.get(k)}"
            if k != "size"
            else f"size {human_bytes(int(before.get(k) or 0))} -> "
            f"{human_bytes(int(after.get(k) or 0))}"
            for k in change["fields"]
        )
        lines.append(f"  {change['name']}: {what}")
    if diff.get("partial"):
        lines.append("(one of them is partial: variables past its summary are not compared)")
    return lines


class CellLog:
    """The cells a kernel ran, for the next snapshot's record: in ipykernel recorded by
    IPython's pre/post_run_cell events (silent executions, such as variable inspectors,
    fire neither; kernel_wrapper.inkernel), for other kernels by the wrapper from the
    messages it relays (an execute_input, then the execute_reply)."""

    def __init__(self, maxlen: int = MAX_CELLS) -> None:
        self.cells: collections.deque[dict[str, Any]] = collections.deque(maxlen=maxlen)
        self.seq = 0
        self._started = 0.0
        self._lock = threading.Lock()

    def started(self, code: str) -> None:
        """A cell with ``code`` begins."""
        with self._lock:
            self.seq += 1
            self._started = time.monotonic()
            cell: dict[str, Any] = {
                "seq": self.seq,
                "code": code[:MAX_CODE_CHARS],
                "started": time.time(),
            }
            if len(code) > MAX_CODE_CHARS:
                cell["trimmed"] = True
            self.cells.append(cell)

    def finished(self, execution_count: int | None, success: bool) -> None:
        """The running cell ended."""
        with self._lock:
            if not self.cells or "seconds" in self.cells[-1]:
                return
            cell = self.cells[-1]
            cell["seconds"] = round(time.monotonic() - self._started, 3)
            cell["execution_count"] = execution_count
            cell["success"] = success

    def pre_run_cell(self, info: Any) -> None:
        """IPython's event (ipykernel)."""
        self.started(str(getattr(info, "raw_cell", "") or ""))

    def post_run_cell(self, result: Any) -> None:
        """IPython's event (ipykernel)."""
        self.finished(
            getattr(result, "execution_count", None), bool(getattr(result, "success", True))
        )

    def restart_after(self, seq: int) -> None:
        """Forget every cell and go on counting after ``seq`` (a log the wrapper keeps,
        after a restore: the kernel's cells are those of its snapshot, recorded through
        ``seq``)."""
        with self._lock:
            self.cells.clear()
            self.seq = max(self.seq, seq)

    def since(self, seq: int, execution_count: int | None = None) -> dict[str, Any]:
        """Cells after ``seq`` (finished ones and the running one), and the last finished
        seq (the next snapshot asks from there: a running cell is listed again, done)."""
        with self._lock:
            cells = [dict(cell) for cell in self.cells if cell["seq"] > seq]
            started = self._started
        through = seq
        for cell in cells:
            if "seconds" in cell:
                through = cell["seq"]
            else:
                cell["running"] = True
                cell["seconds"] = round(time.monotonic() - started, 3)
                cell["execution_count"] = execution_count
        return {
            "cells": cells,
            "cells_through": through,
            "running_cell": any(cell.get("running") for cell in cells),
        }
