"""A restore follows the notebook (issue 44 item 2): it goes to the notebook it is asked
for, by its path now and its session, also after renames; without one, to where the
snapshot's notebook is now; a restored kernel keeps the lineage of the snapshots it came
from, so listing by lineage finds them under every path they were taken at."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .support.jupyter_api import Fetch, call, manager_of, restore, server_config, snapshot

pytestmark = pytest.mark.usefixtures("criu", "snapshot_kernelspec")


@pytest.fixture
def jp_server_config(tmp_path: Path) -> dict[str, Any]:
    return server_config(tmp_path)


async def _session(jp_fetch: Fetch, path: str) -> dict[str, Any]:
    body = {"path": path, "type": "notebook", "kernel": {"name": "python3-snapshot"}}
    response = await jp_fetch("api", "sessions", method="POST", body=json.dumps(body))
    session: dict[str, Any] = json.loads(response.body)
    return session


async def _rename(jp_fetch: Fetch, session: dict[str, Any], path: str) -> None:
    """What JupyterLab does when a notebook is renamed or moved: its session follows."""
    body = json.dumps({"path": path, "name": Path(path).name})
    await jp_fetch("api", "sessions", session["id"], method="PATCH", body=body)


async def _sessions(jp_fetch: Fetch) -> dict[str, str]:
    """{path: kernel id} of every session."""
    listed = json.loads((await jp_fetch("api", "sessions")).body)
    return {s["path"]: s["kernel"]["id"] for s in listed}


async def test_a_restore_goes_where_the_notebook_is_now(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any
) -> None:
    session = await _session(jp_fetch, "Untitled.ipynb")
    kernel = await start_kernel(session["kernel"]["id"])
    await kernel.run("x = 42")
    before = (await snapshot(jp_fetch, kernel.id))["result"]
    assert before["notebook_path"] == "Untitled.ipynb"
    await _rename(jp_fetch, session, "demo.ipynb")
    await kernel.run("x = 43")
    after = (await snapshot(jp_fetch, kernel.id))["result"]
    assert after["notebook_path"] == "demo.ipynb"
    lineage = (await call(jp_fetch, "GET", "kernels", kernel.id))["lineage"]
    listed = (await call(jp_fetch, "GET", lineage=lineage))["snapshots"]
    assert [s["id"] for s in listed] == [after["id"], before["id"]]

    # Asked with no notebook (the CLI's default): the snapshot taken at the old path goes to
    # its notebook where it is now, demo.ipynb, whose kernel it replaces.
    job = await restore(jp_fetch, before["id"])
    assert job["status"] == "done", job
    assert job["result"]["session"]["path"] == "demo.ipynb"
    restored = job["result"]["kernel_id"]
    assert await _sessions(jp_fetch) == {"demo.ipynb": restored}
    assert restored != kernel.id
    assert kernel.id not in jp_serverapp.kernel_manager, "the replaced kernel is shut down"

    # The restored kernel keeps the lineage: both snapshots are still its notebook's.
    status = await call(jp_fetch, "GET", "kernels", restored)
    assert status["lineage"] == lineage
    assert status["snapshot_id"] == before["id"]
    fresh = await start_kernel(restored)
    assert (await fresh.run("print(x)")).strip() == "42"


async def test_a_restore_asked_from_a_notebook_takes_its_session_along(
    jp_fetch: Fetch, start_kernel: Any
) -> None:
    """The panel of a notebook moved since its session started (the session's path can
    lag) sends the notebook's path now and its session: that session follows."""
    session = await _session(jp_fetch, "a.ipynb")
    kernel = await start_kernel(session["kernel"]["id"])
    await kernel.run("x = 1")
    taken = (await snapshot(jp_fetch, kernel.id))["result"]

    body = {"path": "work/b.ipynb", "session_id": session["id"]}
    job = await restore(jp_fetch, taken["id"], **body)
    assert job["status"] == "done", job
    assert job["result"]["session"]["id"] == session["id"]
    assert await _sessions(jp_fetch) == {"work/b.ipynb": job["result"]["kernel_id"]}


async def test_a_renamed_and_moved_notebook_keeps_its_snapshots_when_its_kernel_is_gone(
    jp_fetch: Fetch, start_kernel: Any, jp_serverapp: Any, jp_root_dir: Path
) -> None:
    """Saved first as Untitled.ipynb, renamed to demo.ipynb, its folder moved: its kernel
    lost meanwhile (a node, a server), the notebook still lists its snapshots, and a
    restore without a path goes to where it is now."""
    (jp_root_dir / "Untitled.ipynb").write_text(json.dumps(EMPTY_NOTEBOOK))
    session = await _session(jp_fetch, "Untitled.ipynb")
    kernel = await start_kernel(session["kernel"]["id"])
    await kernel.run("x = 42")
    taken = (await snapshot(jp_fetch, kernel.id))["result"]
    await jp_serverapp.kernel_manager.shutdown_kernel(kernel.id, now=True)

    await _move(jp_fetch, "Untitled.ipynb", "demo.ipynb")
    (jp_root_dir / "work").mkdir()
    await _move(jp_fetch, "demo.ipynb", "work/demo.ipynb")
    await _move(jp_fetch, "work", "projects")
    listed = (await call(jp_fetch, "GET", path="projects/demo.ipynb"))["snapshots"]
    assert [(s["id"], s["notebook_path"]) for s in listed] == [(taken["id"], "Untitled.ipynb")]
    assert listed[0]["notebook_path_now"] == "projects/demo.ipynb"
    assert (await call(jp_fetch, "GET", path="Untitled.ipynb"))["snapshots"] == []

    job = await restore(jp_fetch, taken["id"])
    assert job["status"] == "done", job
    assert job["result"]["session"]["path"] == "projects/demo.ipynb"

    # Remembered by the next server on this work directory.
    renames = json.loads((manager_of(jp_serverapp).work_dir / "notebook-paths.json").read_text())
    assert renames[-1] == ["work", "projects"]


EMPTY_NOTEBOOK = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": []}


async def _move(jp_fetch: Fetch, old: str, new: str) -> None:
    """The file browser's rename or move (PATCH /api/contents)."""
    await jp_fetch("api", "contents", old, method="PATCH", body=json.dumps({"path": new}))
