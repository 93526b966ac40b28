"""Undo a cell (issue 49): a cell checkpoint after each cell (kernel_wrapper/checkpoints.py,
jupyter_ext/core/checkpoints/), undo and redo restoring the kernel in place from them.

The decisions (the timeline's paths and marks, what stays, when a kernel gets none) are
tested without processes; then real kernels: cells with the ids JupyterLab sends, each
kernel checking its own state after every undo (its arrays' digests), the execution
count going on, marks, redo, a checkpoint never holding half a cell, the skip budget,
retention, files changed since, snapshots building on checkpoints and checkpoints on
snapshots. The server's side (REST, take-back, the CLI, the sweep of a killed kernel's
area) is at the end; the fault suite kills kernels during checkpoints (test_faults.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from jupyter_ext.core import proctree
from jupyter_ext.core.checkpoints import (
    CellRun,
    Checkpoint,
    CheckpointAreas,
    CheckpointSettings,
    Timeline,
    off_reason,
    to_remove,
)
from jupyter_ext.core.checkpoints.pacing import (
    GIB,
    LEARN_MIN_BYTES,
    STALL_PER_GIB,
    Pacing,
    stall_of,
)
from jupyter_ext.core.checkpoints.settings import skip_reason
from jupyter_ext.core.errors import NothingToUndoError, SnapshotError, WrapperUnavailableError
from jupyter_ext.core.memtrack import plan as memplan
from jupyter_ext.core.protocol.environment import ENV_CELL_CHECKPOINTS, ENV_LAZY_RESTORE_MIN_BYTES
from testkit.processes import KernelProcess, ServerProcess, wait_until, ws_close, ws_connect

from .support.fakecuda.build import build_fakecuda
from .support.fakecuda.programs import USE_GPU
from .support.jupyter_api import server_config
from .support.servers import follow, ws_execute

Factory = Callable[..., KernelProcess]
MB = 1 << 20


@pytest.fixture(scope="module")
def libcuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fakecuda(tmp_path_factory.mktemp("fakecuda"))


# ------------------------------------------------------------------- the timeline


def _record(timeline: Timeline, name: str, kind: str = "cell") -> Checkpoint:
    record = Checkpoint(id=name, kind=kind, created="", directory=f"/x/{name}")
    timeline.taken(record)
    return record


def _ran(timeline: Timeline, cell: str, count: int) -> None:
    timeline.cell_ran(CellRun(cell, count))


def _cells(undone: list[CellRun]) -> list[str | None]:
    return [cell.cell_id for cell in undone]


def _two_cells_checkpointed() -> Timeline:
    """Checkpoints start, A (after cell a) and B (after cell b)."""
    timeline = Timeline()
    _record(timeline, "start", "start")
    _ran(timeline, "a", 1)
    _record(timeline, "A")
    _ran(timeline, "b", 2)
    _record(timeline, "B")
    return timeline


def test_undo_last_cell_goes_to_the_checkpoint_before_it() -> None:
    timeline = _two_cells_checkpointed()
    plan = timeline.plan_undo()
    assert (plan.target, _cells(plan.undone), plan.not_in_state) == ("A", ["b"], ["b"])
    assert plan.exact
    assert plan.save
    timeline.moved_to(plan, redo="S")
    # A second undo in a row: the kernel is A's images, nothing to save; redo stays.
    again = timeline.plan_undo()
    assert (again.target, _cells(again.undone), again.save) == ("start", ["a"], False)
    timeline.moved_to(again, redo=timeline.redo)
    assert timeline.not_in_state == ["a", "b"]
    assert timeline.redo == "S"
    with pytest.raises(NothingToUndoError, match="No cell has run"):
        timeline.plan_undo()


def test_before_a_cell_undoes_every_cell_after_it_and_says_a_batch() -> None:
    timeline = Timeline()
    _record(timeline, "start", "start")
    _ran(timeline, "a", 1)
    _ran(timeline, "b", 2)  # queued with a: no checkpoint between them
    _record(timeline, "AB")
    _ran(timeline, "c", 3)
    _record(timeline, "C")
    _ran(timeline, "d", 4)  # its checkpoint not taken yet
    plan = timeline.plan_undo(before_cell="c")
    assert (plan.target, _cells(plan.undone), plan.exact) == ("AB", ["d", "c"], True)
    plan = timeline.plan_undo(before_cell="b")
    assert plan.target == "start"
    assert not plan.exact
    assert _cells(plan.undone) == ["d", "c", "b", "a"]
    with pytest.raises(NothingToUndoError, match="has not run"):
        timeline.plan_undo(before_cell="zz")


def test_a_cell_run_again_is_back_in_the_state_and_redo_keeps_its_marks() -> None:
    timeline = _two_cells_checkpointed()
    plan = timeline.plan_undo()
    timeline.moved_to(plan, redo="B")  # the save: here B itself, for the test
    assert timeline.not_in_state == ["b"]
    _ran(timeline, "c", 3)  # a new branch from A
    _record(timeline, "C")
    _ran(timeline, "b", 4)  # b again: in the state
    assert timeline.not_in_state == []
    _record(timeline, "B2")
    redo = timeline.plan_redo()
    # Back on the old branch (A, b): c and the second b are not in its state.
    assert redo.target == "B"
    assert redo.not_in_state == ["c", "b"]
    assert _cells(redo.undone) == ["b", "c"]


def test_a_checkpoint_no_longer_kept_is_said() -> None:
    timeline = Timeline()
    _record(timeline, "start", "start")
    _ran(timeline, "a", 1)
    _record(timeline, "A")
    timeline.removed("start")
    with pytest.raises(NothingToUndoError, match="no longer kept"):
        timeline.plan_undo()
    assert [r.id for r in timeline.kept()] == ["A"]


def test_what_a_freeze_held_is_what_the_checkpoint_holds() -> None:
    """A cell that finishes while a checkpoint is sealed belongs to the next one."""
    timeline = Timeline()
    _record(timeline, "start", "start")
    _ran(timeline, "a", 1)
    point = timeline.point()
    _ran(timeline, "b", 2)
    record = Checkpoint(id="A", kind="cell", created="", directory="/x")
    timeline.taken(record, point)
    assert _cells(record.cells) == ["a"]
    assert _cells(timeline.cells_since) == ["b"]


# ------------------------------------------------------------------- what stays


def test_the_oldest_go_and_shared_files_count_once() -> None:
    # Each checkpoint links its parent's 100-byte level (inode 1) and adds its own.
    files = {"c1": {1: 100}, "c2": {1: 100, 2: 10}, "c3": {1: 100, 2: 10, 3: 10}}
    order = ["c1", "c2", "c3"]
    assert to_remove(order, files, keep=3, budget=120, protected=set()) == []
    assert to_remove(order, files, keep=2, budget=10**6, protected=set()) == ["c1"]
    # Over budget: removing c1 frees nothing (c2, c3 link its file), c2 neither.
    assert to_remove(order, files, keep=3, budget=115, protected={"c3"}) == ["c1", "c2"]
    # Only the protected one is left when it must.
    assert to_remove(order, files, keep=1, budget=10**6, protected={"c1"}) == ["c2", "c3"]


# ------------------------------------------------------------------- when a kernel gets them


def test_auto_takes_them_where_memory_is_tracked_only() -> None:
    auto = CheckpointSettings(mode="auto", root="/r")
    situation = memplan.Situation(tracking="userfaultfd", memory_bytes=1 << 30)
    assert off_reason(auto, memplan.plan_dump(situation)) == ""
    gpu = memplan.plan_dump(memplan.Situation(tracking="userfaultfd", gpu=True))
    assert "GPU" in off_reason(auto, gpu)
    assert "'on'" in off_reason(auto, gpu)
    assert off_reason(CheckpointSettings(mode="on", root="/r"), gpu) == ""
    untracked = memplan.plan_dump(memplan.Situation(tracking=None, unavailable="no uffd here"))
    assert "no uffd here" in off_reason(auto, untracked)
    assert "off on this server" in off_reason(CheckpointSettings(mode="off", root="/r"), gpu)
    assert "not started by a server" in off_reason(CheckpointSettings(), gpu)
    assert CheckpointSettings.from_json("{bad") == CheckpointSettings()
    settings = CheckpointSettings(mode="auto", root="/r", max_change_bytes=100)
    assert "more than cell_checkpoint_max_change_bytes" in skip_reason(
        settings, 101, 10**12, 10**12, 10**9
    )
    assert "free" in skip_reason(settings, 50, 60, 1000, 10**9)
    assert skip_reason(settings, 50, 10**12, 10**12, 10**9) == ""


def test_the_pause_budget_counts_what_the_next_one_would_stall() -> None:
    """After a checkpoint that stalled the kernel S seconds the next waits S / share - S;
    one that would copy far more waits for its own expected stall (a rate learned from
    the kernel's own large checkpoints)."""
    pacing = Pacing(0.02)
    assert pacing.not_before(10 * GIB) == 0.0  # the first: at once
    stall = stall_of(0.06, {"precopy": [{"frozen_seconds": 0.02}, {"frozen_seconds": 0.02}]})
    assert stall == pytest.approx(0.1)
    pacing.taken(stall, 10 << 20, ended=100.0)
    assert pacing.not_before() == pytest.approx(100 + 0.1 * 49)
    assert pacing.not_before(10 << 20) == pytest.approx(100 + 0.1 * 49)  # small: the last's
    assert pacing.not_before(GIB) == pytest.approx(100 + max(0.1, STALL_PER_GIB) * 49)
    pacing.taken(0.5, 2 * GIB, ended=200.0)  # learned: 0.25 s per GiB
    assert pacing.not_before(4 * GIB) == pytest.approx(200 + 1.0 * 49)
    pacing.taken(0.05, LEARN_MIN_BYTES - 1, ended=300.0)  # too small to learn from
    assert pacing.not_before(4 * GIB) == pytest.approx(300 + 1.0 * 49)
    assert Pacing(0.0).not_before(GIB) == 0.0
    unpaced = Pacing(0.0)
    unpaced.taken(1.0, GIB, ended=5.0)
    assert unpaced.not_before(GIB) == 5.0


def test_an_area_goes_once_its_holder_is_gone(tmp_path: Path) -> None:
    areas = CheckpointAreas(tmp_path / "checkpoints")
    live = areas.create("kernel")
    dead = areas.create("kernel")
    (dead.path / "x").mkdir()
    os.close(dead._lock_fd)  # as a killed wrapper's
    dead._lock_fd = -1
    assert areas.sweep() == [dead.path]
    assert live.path.is_dir()
    assert not dead.path.exists()
    held = areas.hold(live.path / "nothing")
    assert held is None
    live.close()
    assert list(areas.root.iterdir()) == []


# ------------------------------------------------------------------- real kernels


@pytest.fixture
def checkpointed(kernel_factory: Factory, tmp_path: Path) -> Callable[..., KernelProcess]:
    """Kernels with cell checkpoints in ``tmp_path/checkpoints`` (as a server sets them)."""

    def start(kernel_env: dict[str, str] | None = None, **settings: Any) -> KernelProcess:
        # A checkpoint after every cell (no pause budget) unless a test asks for one: these
        # tests run cells back to back and undo each on its own.
        config = {
            "mode": "auto",
            "root": str(tmp_path / "checkpoints"),
            "max_pause_share": 0,
            **settings,
        }
        env = {ENV_CELL_CHECKPOINTS: json.dumps(config), **(kernel_env or {})}
        kernel = kernel_factory(env=env)
        # Its "start" checkpoint, as a notebook just opened gets it before its first cell
        # (a cell sent at once cuts it short: then the first cell cannot be undone).
        settled(kernel, 1)
        return kernel

    return start


def run(kernel: KernelProcess, code: str, cell_id: str | None = None) -> tuple[str, int]:
    """Run a cell as JupyterLab sends it (its ``cellId``): its stdout and execution count;
    raises with the traceback if it failed."""
    client = kernel.client
    content = {"code": code, "silent": False, "store_history": True, "user_expressions": {}}
    msg = client.session.msg("execute_request", content, metadata={"cellId": cell_id})
    client.shell_channel.send(msg)
    out: list[str] = []
    while True:
        reply = client.get_shell_msg(timeout=120)
        if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
            break
    while True:  # its output, up to its idle status
        iopub = client.get_iopub_msg(timeout=120)
        if iopub["parent_header"].get("msg_id") != msg["header"]["msg_id"]:
            continue
        if iopub["msg_type"] == "stream":
            out.append(iopub["content"]["text"])
        if iopub["msg_type"] == "status" and iopub["content"]["execution_state"] == "idle":
            break
    if reply["content"]["status"] != "ok":
        raise AssertionError(f"cell failed: {reply['content']}")
    return "".join(out), int(reply["content"]["execution_count"])


def listing(kernel: KernelProcess) -> dict[str, Any]:
    result: dict[str, Any] = kernel.control.request_sync("checkpoints", timeout=60)
    return result


def settled(kernel: KernelProcess, count: int) -> dict[str, Any]:
    """The listing once ``count`` checkpoints were taken (or one was skipped since) and
    none is being taken."""
    found: dict[str, Any] = {}

    def done() -> bool:
        nonlocal found
        found = listing(kernel)
        if found["taking"]:
            return False
        if found["skipped"] is not None:
            return True
        return len(found["checkpoints"]) >= count and not found["cells_since"]

    try:
        wait_until(done, timeout=120, what=f"{count} cell checkpoints")
    except TimeoutError:
        raise AssertionError(f"{count} checkpoints not taken: {found}\n{kernel.log()}") from None
    return found


def undo(kernel: KernelProcess, **args: Any) -> dict[str, Any]:
    result: dict[str, Any] = kernel.control.request_sync("undo", args, timeout=300)
    return result


#: In the kernel: what it holds, checked by the kernel itself (its arrays' digests).
STATE = "import hashlib, numpy as np\ndigest = lambda a: hashlib.sha256(a.tobytes()).hexdigest()\n"


def test_undo_redo_and_the_count_goes_on(checkpointed: Callable[..., KernelProcess]) -> None:
    kernel = checkpointed()
    run(kernel, STATE + "big = np.random.default_rng(1).random(4 * 2**20); x = 1", "c1")
    first = settled(kernel, 2)
    assert [c["kind"] for c in first["checkpoints"]] == ["start", "cell"]
    run(kernel, "big[: 2**16] = 7; saved = digest(big); x = 2", "c2")
    settled(kernel, 3)  # a cell sent at once would cut its checkpoint short (see below)
    run(kernel, "big[-(2**16):] = 9; x = 3", "c3")
    listed = settled(kernel, 4)
    after_c2 = listed["checkpoints"][2]
    assert after_c2["cells"] == [{"cell_id": "c2", "execution_count": 2}]
    # Later checkpoints copy what their cell changed (c1's holds its 32 MiB array).
    assert after_c2["memory"]["mode"] == "incremental"
    assert after_c2["own_bytes"] < listed["checkpoints"][1]["own_bytes"] / 2

    preview = undo(kernel, preview=True)
    assert preview["target"] == after_c2["id"]
    assert preview["undone"][0]["cell_id"] == "c3"
    assert "files the cells wrote" in preview["outside_world"]
    done = undo(kernel)
    assert done["not_in_state"] == ["c3"]
    assert done["redo"] is not None
    assert done["execution_count"] == 4  # the notebook's next cell, not the checkpoint's
    # Where its time went, in order: the kernel saved first, then CRIU.
    phases = list(done["phases"])
    assert phases.index("save the kernel there was") < phases.index("criu restore"), phases
    assert all(seconds >= 0 for seconds in done["phases"].values())
    assert kernel.status()["checkpoints"]["not_in_state"] == ["c3"]
    # The kernel checks itself: as it was after c2.
    out, count = run(kernel, "print(x, digest(big) == saved, big[-1] != 9)", "check")
    assert (out.split(), count) == (["2", "True", "True"], 4)
    # A cell after an undo gets its checkpoint too (a full copy: the restored kernel's
    # memory is untracked until its next dump).
    after_check = settled(kernel, 6)["checkpoints"][-1]
    assert [c["cell_id"] for c in after_check["cells"]] == ["check"]

    # Undo twice: back to after c1 (c2 and the check cell undone too).
    undo(kernel)
    again = undo(kernel)
    assert again["save"] is False  # a checkpoint's images already: nothing saved
    assert "save the kernel there was" not in again["phases"]
    assert set(again["not_in_state"]) >= {"c2", "c3", "check"}
    assert run(kernel, "print(x, 'saved' in dir())", "check2")[0].split() == ["1", "False"]

    # Redo: back to where the last undo began.
    redone = undo(kernel, redo=True)
    assert redone["redo"] is None
    out, count = run(kernel, "print(x, digest(big) == saved)", "check3")
    assert out.split() == ["2", "True"]
    assert count == 6  # [4] check, [5] check2: the count went on through every undo
    with pytest.raises(SnapshotError, match="nothing to redo"):
        undo(kernel, redo=True)


def test_undo_restores_lazily_where_large(checkpointed: Callable[..., KernelProcess]) -> None:
    """A large kernel (here: every kernel, the threshold lowered) is undone lazily: it runs
    as soon as CRIU has rebuilt it, its memory served from the checkpoint's chain."""
    kernel = checkpointed(kernel_env={ENV_LAZY_RESTORE_MIN_BYTES: "1"})
    run(kernel, STATE + "big = np.random.default_rng(4).random(2**21); keep = digest(big)", "a")
    settled(kernel, 2)
    run(kernel, "big[:1000] = 0; x = 'changed'", "b")
    settled(kernel, 3)
    done = undo(kernel)
    assert done["lazy"] is True
    out = run(kernel, "print(digest(big) == keep, 'x' in dir())")[0]
    assert out.split() == ["True", "False"]
    wait_until(lambda: kernel.status()["lazy_restore"].get("state") == "complete")


class DaemonHold(threading.Thread):
    """Stops (SIGSTOP) the ``criu lazy-pages`` daemon that the wrapper ``wrapper_pid``
    starts as soon as the ``criu restore`` beside it has ended: the restored kernel runs,
    and its memory's transfer cannot end until :meth:`release`."""

    def __init__(self, wrapper_pid: int) -> None:
        super().__init__(daemon=True)
        self.wrapper_pid = wrapper_pid
        self.pid: int | None = None
        self.stopped = threading.Event()
        self._cancel = threading.Event()

    def _criu(self) -> dict[str, int]:
        """The wrapper's CRIU processes by command ("lazy-pages", "restore", ...)."""
        found: dict[str, int] = {}
        for pid in proctree.descendants(self.wrapper_pid):
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if "criu" in Path(argv[0].decode()).name and len(argv) > 1:
                    found[argv[1].decode()] = pid
        return found

    def run(self) -> None:
        restore_seen = False
        while not self._cancel.is_set():
            criu = self._criu()
            restore_seen = restore_seen or "restore" in criu
            if restore_seen and "restore" not in criu and "lazy-pages" in criu:
                self.pid = criu["lazy-pages"]
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGSTOP)
                    self.stopped.set()
                return

    def release(self) -> None:
        self._cancel.set()
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)


def test_a_kernel_dying_in_a_lazy_undo_comes_back_as_before(
    checkpointed: Callable[..., KernelProcess], tmp_path: Path
) -> None:
    """The kernel dies while an undo restores its memory lazily (seen: CRIU's lazy-pages
    daemon crashed, the kernel with it): the kernel saved before the undo comes back, and
    the timeline with it. The daemon is held once the kernel is restored, so that the death
    lands during the transfer; a snapshot asked meanwhile waits for the transfer's end
    holding the wrapper's lock, which the put-back must not wait for (seen: both hung)."""
    kernel = checkpointed(kernel_env={ENV_LAZY_RESTORE_MIN_BYTES: "1"})
    run(kernel, STATE + "big = np.random.default_rng(5).random(2**25)", "a")
    settled(kernel, 2)
    run(kernel, "big[:1000] = 0; x = 'changed'; keep = digest(big)", "b")
    before = settled(kernel, 3)
    daemon = DaemonHold(kernel.status()["wrapper_pid"])
    daemon.start()
    try:
        assert undo(kernel)["lazy"] is True
        assert daemon.stopped.is_set(), "the restore and its lazy-pages daemon were not seen"
        assert kernel.status()["lazy_restore"].get("state") == "transferring"
        snapshot: dict[str, Any] = {}

        def snapshot_meanwhile() -> None:
            try:
                snapshot["result"] = kernel.snapshot(tmp_path / "meanwhile")
            except SnapshotError as exc:
                snapshot["error"] = exc

        asking = threading.Thread(target=snapshot_meanwhile, daemon=True)
        asking.start()
        wait_until(lambda: kernel.status()["busy"], what="the snapshot to wait for the transfer")
        os.kill(kernel.status()["inner_pid"], signal.SIGKILL)
    finally:
        daemon.release()
    try:
        wait_until(lambda: kernel.status()["lazy_restore"].get("state") == "failed")
    except TimeoutError:
        raise AssertionError(f"not put back: {kernel.status()}\n{kernel.log()}") from None
    asking.join(120)
    assert not asking.is_alive(), "the snapshot asked during the transfer never ended"
    assert snapshot, snapshot
    status = kernel.status()
    assert status["state"] == "running", status
    assert "put back as it was before the restore" in status["lazy_restore"]["error"]["message"]
    assert run(kernel, "print(x, digest(big) == keep)")[0].split() == ["changed", "True"]
    checkpoints = status["checkpoints"]
    assert checkpoints["not_in_state"] == []  # cell b is in the kernel's state again
    assert checkpoints["redo"] == before["redo"]


def test_an_undo_while_the_last_undo_fills_the_kernel_in_stays(
    checkpointed: Callable[..., KernelProcess],
) -> None:
    """Undo twice, the second while the first's memory is still on its way (its daemon
    held): the first transfer ends with its kernel, on purpose. Seen before the fix: its
    end counted as the kernel's death, and the kernel saved before the first undo was put
    back over the second undo (the cell run next waited for that restore)."""
    kernel = checkpointed(kernel_env={ENV_LAZY_RESTORE_MIN_BYTES: "1"})
    run(kernel, STATE + "big = np.random.default_rng(6).random(2**24); keep = digest(big)", "a")
    settled(kernel, 2)
    run(kernel, "x = 'b'", "b")
    settled(kernel, 3)
    run(kernel, "x = 'c'", "c")
    settled(kernel, 4)
    daemon = DaemonHold(kernel.status()["wrapper_pid"])
    daemon.start()
    try:
        assert undo(kernel)["lazy"] is True  # before cell c
        assert daemon.stopped.is_set(), "the restore and its lazy-pages daemon were not seen"
        assert kernel.status()["lazy_restore"].get("state") == "transferring"
        assert undo(kernel)["lazy"] is True  # before cell b, nothing saved
    finally:
        daemon.release()
    try:
        wait_until(lambda: kernel.status()["lazy_restore"].get("state") == "complete")
    except TimeoutError:
        raise AssertionError(f"{kernel.status()}\n{kernel.log()}") from None
    time.sleep(1)  # what the first transfer's end would have done (it is done by now)
    status = kernel.status()
    assert status["lazy_restore"]["state"] == "complete", status
    assert sorted(status["checkpoints"]["not_in_state"]) == ["b", "c"], status["checkpoints"]
    out = run(kernel, "print('x' in dir(), digest(big) == keep)")[0]
    assert out.split() == ["False", "True"], kernel.log()
    assert "lazy restore failed" not in kernel.log()


def test_a_checkpoint_never_holds_half_a_cell(checkpointed: Callable[..., KernelProcess]) -> None:
    """A cell sent while a checkpoint prepares (here its pre-copy of 96 MiB) either waits
    for its freeze or cuts it short: no checkpoint holds part of it. Each one is checked
    by undoing to it."""
    kernel = checkpointed()
    run(kernel, STATE + "x = 0", "c0")
    settled(kernel, 2)
    run(kernel, "fill = np.random.default_rng(2).random(12 * 2**20); x = 1", "c1")
    wait_until(lambda: listing(kernel)["taking"], what="the checkpoint to start")
    # Sent while it is under way; it runs a while (a freeze may not land on it).
    out, _count = run(kernel, "import time; time.sleep(3); x = 2; print(x)", "c2")
    assert out.strip() == "2"
    done = settled(kernel, 3)
    # Whatever happened, every checkpoint holds whole cells: undo to each and look.
    for checkpoint in reversed(done["checkpoints"][1:]):
        undo(kernel, to=checkpoint["id"])
        cells = [c["cell_id"] for c in checkpoint["cells"]]
        expected = "2" if "c2" in cells else "1" if "c1" in cells else "0"
        assert run(kernel, "print(x)", None)[0].strip() == expected, (cells, done)
    if done["checkpoints"][-1]["cells"] != [{"cell_id": "c2", "execution_count": 3}]:
        # Cut short: said, and the next one holds both cells.
        assert [c["cell_id"] for c in done["checkpoints"][-1]["cells"]] == ["c1", "c2"]


def test_a_large_change_is_skipped_and_said(checkpointed: Callable[..., KernelProcess]) -> None:
    kernel = checkpointed(max_change_bytes=96 * MB)
    run(kernel, STATE + "x = 0", "c0")
    settled(kernel, 2)
    run(kernel, "big = np.ones(16 * 2**20); x = 1", "big")  # 128 MiB written
    skipped = settled(kernel, 3)
    assert len(skipped["checkpoints"]) == 2
    assert "more than cell_checkpoint_max_change_bytes" in skipped["skipped"]["reason"]
    assert kernel.status()["checkpoints"]["skipped"]["reason"] == skipped["skipped"]["reason"]
    # Once the change is smaller (the array freed: unmapped pages are not copied) the next
    # one is taken; it holds both cells, and undoing the last cell undoes both, said.
    run(kernel, "del big; x = 2", "small")
    taken = settled(kernel, 3)
    assert taken["skipped"] is None
    assert [c["cell_id"] for c in taken["checkpoints"][-1]["cells"]] == ["big", "small"]
    plan = undo(kernel, preview=True)
    assert [c["cell_id"] for c in plan["undone"]] == ["small", "big"]
    assert plan["exact"] is False
    undo(kernel)
    assert run(kernel, "print(x, 'big' in dir())")[0].split() == ["0", "False"]


def test_memory_that_did_not_change_does_not_count_against_the_limit(
    checkpointed: Callable[..., KernelProcess],
) -> None:
    """Between snapshots nothing is protected (every page reads as written): what a
    checkpoint would copy is found by comparing the memory with the last one's pages
    (core/memtrack/digests.py), so an 80 MiB array made before does not count again."""
    kernel = checkpointed(max_change_bytes=96 * MB)
    run(kernel, STATE + "x = 0", "c0")
    settled(kernel, 2)
    run(kernel, "keep = np.ones(10 * 2**20); x = 1", "keep")  # 80 MiB written
    assert settled(kernel, 3)["skipped"] is None
    run(kernel, "x = 2", "small")
    taken = settled(kernel, 4)
    assert taken["skipped"] is None, taken["skipped"]
    assert len(taken["checkpoints"]) == 4
    assert taken["checkpoints"][-1]["memory"]["copied_bytes"] < 32 * MB


def test_one_cut_short_by_a_request_that_is_no_cell_comes_at_the_next_idle(
    checkpointed: Callable[..., KernelProcess],
) -> None:
    """A page that connects asks the kernel things (kernel_info, completions, inspection):
    a checkpoint cut short because the kernel was busy with one is taken once it is idle
    again, though no cell ran since (so a notebook just opened gets its "start" one)."""
    kernel = checkpointed()
    slow = "import time\nclass Slow:\n    def __repr__(self):\n        time.sleep(3); return 's'\n"
    run(kernel, slow + "slow = Slow()", "define")
    settled(kernel, 2)
    client = kernel.client
    for attempt in range(5):
        # A cell, and at once an inspection that keeps the kernel busy 3 s (its repr). The
        # cell lasts 0.3 s, so the inspection waits in the kernel's queue and is taken as
        # the cell ends (sent after a cell that ends at once, it came after the cell's
        # checkpoint in 5 tries of 5 on a loaded machine). The checkpoint, planned first,
        # then finds the kernel busy; seldom it freezes before the kernel takes the
        # inspection (then again).
        taken = len(listing(kernel)["checkpoints"])
        cell = client.session.msg(
            "execute_request",
            {"code": f"time.sleep(0.3); x = {attempt}", "silent": False, "store_history": True},
            metadata={"cellId": f"c{attempt}"},
        )
        client.shell_channel.send(cell)
        inspection = client.inspect("slow", detail_level=0)
        found: dict[str, Any] = {}

        def decided(taken: int = taken) -> bool:
            nonlocal found
            found = listing(kernel)
            busy = (found["skipped"] or {}).get("reason", "").endswith("was busy.")
            return busy or (len(found["checkpoints"]) > taken and not found["taking"])

        wait_until(decided, timeout=60, what=f"the checkpoint after c{attempt}")
        cut_short = found["skipped"] is not None
        while client.get_shell_msg(timeout=60)["parent_header"]["msg_id"] != inspection:
            pass
        if cut_short:
            break
    else:
        pytest.fail("no checkpoint found the kernel busy with the inspection in 5 tries")

    def taken_at_idle() -> bool:
        found = listing(kernel)
        return len(found["checkpoints"]) > taken and found["skipped"] is None

    wait_until(taken_at_idle, timeout=60, what=f"the checkpoint after c{attempt}, at the idle")
    last = listing(kernel)["checkpoints"][-1]
    assert [c["cell_id"] for c in last["cells"]] == [f"c{attempt}"]


def test_a_cell_the_kernel_has_not_started_is_never_in_a_checkpoint(
    checkpointed: Callable[..., KernelProcess],
) -> None:
    """A cell sent while a checkpoint waits for its turn (the pause budget's timer, here),
    which the kernel got but has not yet said it runs (no busy status yet): the checkpoint
    is not taken then (it was: once in a hub test, the manifest of a "start" checkpoint
    recorded the next cell as running, and an undo to it would have run that cell again).
    The kernel is held stopped (SIGSTOP) so that the cell stays unstarted past the timer;
    once it runs and ends, one checkpoint holds both cells, no running request in it."""
    kernel = checkpointed(max_pause_share=0.01)  # the next after a 30 ms freeze: >= 3 s
    run(kernel, "x = 1", "c1")
    held = listing(kernel)
    assert held["paced_seconds"] is not None, held  # c1's checkpoint waits for the budget
    taken = len(held["checkpoints"])
    inner = int(kernel.status()["inner_pid"])
    os.kill(inner, signal.SIGSTOP)
    try:
        cell = kernel.client.session.msg(
            "execute_request",
            {"code": "x = 2", "silent": False, "store_history": True},
            metadata={"cellId": "c2"},
        )
        kernel.client.shell_channel.send(cell)
        wait_until(lambda: kernel.status()["running_request"] is not None, what="c2 passed on")
        time.sleep(held["paced_seconds"] + 2)  # the timer fired: the kernel is "idle"
        while_stopped = listing(kernel)
        assert len(while_stopped["checkpoints"]) == taken, while_stopped
        assert not while_stopped["taking"], while_stopped
    finally:
        os.kill(inner, signal.SIGCONT)
    while (
        kernel.client.get_shell_msg(timeout=60)["parent_header"]["msg_id"]
        != cell["header"]["msg_id"]
    ):
        pass
    after = settled(kernel, taken + 1)
    last = after["checkpoints"][-1]
    assert [c["cell_id"] for c in last["cells"]] == ["c1", "c2"]
    manifest = json.loads((Path(last["directory"]) / "manifest.json").read_text())
    assert manifest["running_request"] is None


def test_the_pause_budget_spaces_checkpoints_and_cells_run_meanwhile_share_one(
    checkpointed: Callable[..., KernelProcess],
) -> None:
    """cell_checkpoint_max_pause_share: after a checkpoint that paused the kernel P
    seconds, the next starts no sooner than P / share - P later; cells run meanwhile wait
    for it (the listing says how long) and share it, and an undo takes them back together."""
    share = 0.01  # a freeze of >= 30 ms spaces the next by >= 3 s: both cells run before
    kernel = checkpointed(max_pause_share=share)
    start = listing(kernel)["checkpoints"][-1]
    run(kernel, "x = 1", "c1")
    run(kernel, "x = 2", "c2")
    held = listing(kernel)
    assert [c["cell_id"] for c in held["cells_since"]] == ["c1", "c2"], held
    assert held["paced_seconds"] is not None, held
    after = settled(kernel, 2)
    shared = after["checkpoints"][-1]
    assert [c["cell_id"] for c in shared["cells"]] == ["c1", "c2"]
    assert after["paced_seconds"] is None
    spacing = start["pause_seconds"] * (1 / share - 1)
    gap = (
        datetime.fromisoformat(shared["created"]) - datetime.fromisoformat(start["created"])
    ).total_seconds()
    assert gap >= spacing, (gap, spacing, start)
    undo(kernel, before_cell="c2")  # c1 goes back with it: they share one checkpoint
    assert run(kernel, "print(globals().get('x'))")[0].strip() == "None"


def test_only_the_last_are_kept(checkpointed: Callable[..., KernelProcess]) -> None:
    kernel = checkpointed(keep=3)
    for index in range(5):
        run(kernel, f"x = {index}", f"c{index}")
        settled(kernel, min(index + 2, 3))
    listed = listing(kernel)
    kept = [c["cells"][0]["cell_id"] for c in listed["checkpoints"]]
    assert kept == ["c2", "c3", "c4"]
    # Their files on disk: only those of the kept ones (and the area's own).
    area = Path(listed["checkpoints"][0]["directory"]).parent
    assert len([p for p in area.iterdir() if not p.name.startswith(".")]) == 3
    with pytest.raises(SnapshotError, match="is no longer kept"):
        undo(kernel, before_cell="c0", preview=True)
    # Kept ones still restore whole: back to before c3.
    undo(kernel, before_cell="c3")
    assert run(kernel, "print(x)")[0].strip() == "2"


def test_the_undo_dialog_lists_files_changed_since(
    checkpointed: Callable[..., KernelProcess], tmp_path: Path
) -> None:
    kernel = checkpointed()
    log = tmp_path / "out.log"
    run(kernel, f"fh = open({str(log)!r}, 'a'); fh.write('one\\n'); fh.flush()", "open")
    settled(kernel, 2)
    run(kernel, "fh.write('two\\n'); fh.flush()", "write")
    settled(kernel, 3)
    plan = undo(kernel, preview=True)
    changed = {entry["path"]: entry for entry in plan["changed_files"]}
    assert changed[str(log)]["change"] == "written"
    assert plan["problems"] == []
    undo(kernel)
    # Undo does not bring the file back: the kernel's handle writes on at its end.
    run(kernel, "fh.write('three\\n'); fh.flush()", "again")
    assert log.read_text() == "one\ntwo\nthree\n"


def test_snapshots_and_checkpoints_build_on_each_other(
    checkpointed: Callable[..., KernelProcess], tmp_path: Path
) -> None:
    """A snapshot the server asks for copies what changed since the newest checkpoint,
    and the next checkpoint what changed since that snapshot, though the server moved its
    directory (an anchor in the area); each restores whole. The checkpoints are cut with
    the server's chunk size (its chunk_kib), which the snapshot keeps for their levels:
    (seen: automatic 4-64 KiB chunks under a store's fixed 1 MiB, a record 20 times the
    size)."""
    kernel = checkpointed(chunk_kib=256)
    run(kernel, STATE + "big = np.random.default_rng(3).random(4 * 2**20); x = 1", "c1")
    settled(kernel, 2)
    snap = kernel.snapshot(tmp_path / "snap")
    assert snap["memory"]["mode"] == "incremental"
    assert snap["memory"]["copied_bytes"] < 16 * MB  # not the 32 MiB array
    levels = [f for f in snap["files"] if "/parent/" in f["path"] and "/pages-" in f["path"]]
    assert levels
    for level in levels:  # chunks of 64 KiB to 1 MiB (ChunkParams.of_kib), the last shorter
        assert all(size >= 64 << 10 for _digest, size in level["chunks"][:-1]), level["path"]
    os.rename(tmp_path / "snap", tmp_path / "moved")  # as the server's upload moves it
    run(kernel, "big[:10] = 5; keep = digest(big); x = 2", "c2")
    after = settled(kernel, 3)["checkpoints"][-1]
    assert after["memory"]["mode"] == "incremental"
    # Not the 32 MiB array: the pages the cell (and the interpreter) changed, a huge-page
    # block whole where an eighth of it changed (core/memtrack/digests.py).
    assert after["memory"]["copied_bytes"] < 24 * MB
    kernel.restore(tmp_path / "moved")
    assert run(kernel, "print(x)")[0].strip() == "1"
    undo(kernel, to=after["id"])
    assert run(kernel, "print(x, digest(big) == keep)")[0].split() == ["2", "True"]


def test_gpu_kernels_get_none_in_auto_and_say_why(
    checkpointed: Callable[..., KernelProcess], tmp_path: Path, libcuda: Path
) -> None:
    state = tmp_path / "fakecuda-state"
    state.mkdir()
    env = {"JUPYTER_SNAPSHOT_LIBCUDA": str(libcuda), "FAKECUDA_STATE_DIR": str(state)}
    kernel = checkpointed(kernel_env=env)
    run(kernel, USE_GPU.format(lib=str(libcuda)), "gpu")
    wait_until(lambda: not listing(kernel)["enabled"], what="checkpoints off for the GPU kernel")
    status = kernel.status()["checkpoints"]
    assert "the kernel uses the GPU" in status["reason"]
    assert "cell_checkpoints = 'on'" in status["reason"]
    assert [c["kind"] for c in listing(kernel)["checkpoints"]] == ["start"]


# ------------------------------------------------------------------- through the server


async def open_notebook(server: ServerProcess, kernel_id: str) -> None:
    await ws_close(await ws_connect(server, kernel_id))


def server_settled(server: ServerProcess, kernel_id: str, count: int) -> dict[str, Any]:
    found: dict[str, Any] = {}

    def done() -> bool:
        nonlocal found
        try:
            found = server.client.call("GET", f"kernels/{kernel_id}/checkpoints")
        except WrapperUnavailableError:  # the kernel's wrapper is not up yet
            return False
        return len(found["checkpoints"]) >= count and not found["taking"]

    wait_until(done, timeout=120, what=f"{count} cell checkpoints")
    return found


def test_undo_redo_and_take_back_through_the_server(tmp_path: Path) -> None:
    """REST (listing, preview, undo, redo, a checkpoint's contents), a variable taken back
    from a checkpoint, `jupyter snapshot undo`, and a killed kernel's checkpoints removed
    by the server."""
    (tmp_path / "notebooks").mkdir()
    config = server_config(tmp_path, cell_checkpoints="auto", policy_tick=0.5)
    server = ServerProcess(tmp_path / "server", tmp_path / "notebooks", config)
    try:
        kernel_id = server.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
        # As JupyterLab opening the notebook: a websocket (its kernel_info), then the
        # kernel is idle and gets its "start" checkpoint.
        asyncio.run(open_notebook(server, kernel_id))
        server_settled(server, kernel_id, 1)
        for index, cell in enumerate("abc", start=1):
            ws_execute(server, kernel_id, f"x = {index}; label_{cell} = 'ran {cell}'", cell_id=cell)
            listed = server_settled(server, kernel_id, index + 1)
        after_a = listed["checkpoints"][1]
        assert "directory" not in after_a  # where the files are is the server's business
        plan = server.client.call("GET", f"kernels/{kernel_id}/undo", before_cell="b")
        assert [c["cell_id"] for c in plan["undone"]] == ["c", "b"]
        assert plan["target"] == after_a["id"]

        job = server.client.call("POST", f"kernels/{kernel_id}/undo", body={"before_cell": "b"})
        result = follow(server, job["job"])["result"]
        assert result["not_in_state"] == ["b", "c"]
        status = server.client.call("GET", f"kernels/{kernel_id}")
        assert status["checkpoints"]["not_in_state"] == ["b", "c"]
        assert ws_execute(server, kernel_id, "print(x, 'label_b' in dir())").split() == [
            "1",
            "False",
        ]

        # A checkpoint's record, and a variable taken back from one (the existing take-back).
        after_c = listed["checkpoints"][3]
        record = server.client.call("GET", f"kernels/{kernel_id}/checkpoints/{after_c['id']}")
        assert "label_c" in [v["name"] for v in record["contents"]["variables"]]
        body = {"kernel_id": kernel_id, "names": ["label_c"], "rename": {"label_c": "taken"}}
        follow(server, server.client.call("POST", f"{after_c['id']}/variables", body=body)["job"])
        assert ws_execute(server, kernel_id, "print(taken, x)").strip() == "ran c 1"

        follow(server, server.client.call("POST", f"kernels/{kernel_id}/redo", body={})["job"])
        assert ws_execute(server, kernel_id, "print(x, label_c)").split() == ["3", "ran", "c"]
        with pytest.raises(SnapshotError, match="nothing to redo"):
            server.client.call("GET", f"kernels/{kernel_id}/redo")
        with pytest.raises(SnapshotError, match="not a snapshot id"):
            server.client.call("GET", f"kernels/{kernel_id}/undo", to="nope")

        # The command line, on the same server.
        cli = [sys.executable, "-m", "jupyter_ext.cli", "undo", f"--url={server.url}"]
        cli += [f"--token={server.token}", f"--kernel-id={kernel_id}"]
        listed_text = subprocess.run([*cli, "--list"], capture_output=True, text=True, check=True)
        assert "<- the kernel" in listed_text.stdout
        said = subprocess.run(cli, capture_output=True, text=True, check=True).stdout
        assert "Back to checkpoint" in said
        assert "files the cells wrote" in said

        # A kernel whose wrapper is killed: its checkpoints go with it.
        status = server.client.call("GET", f"kernels/{kernel_id}")
        area = Path(config["SnapshotExtensionApp"]["work_dir"]) / "checkpoints"
        before = {p.name for p in area.iterdir()}
        os.kill(status["wrapper_pid"], signal.SIGKILL)
        wait_until(
            lambda: not ({p.name for p in area.iterdir()} & before),
            timeout=60,
            what="the killed kernel's checkpoints to be removed",
        )
    finally:
        server.stop()
