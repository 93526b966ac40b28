"""A standing fault suite, in the spirit of CRIU's zdtm and restic's check.

Real servers (subprocesses that can be SIGKILLed and started again on the same work
directory and store), real kernels, real CRIU, a local store and moto's S3 server. Faults:
SIGKILL of the wrapper, the inner kernel or the server at random points of a snapshot, an
upload, a restore and a deletion; a full work directory and a full store (small tmpfs
mounts); simultaneous snapshots of kernels sharing a working directory; restores racing
deletions. After each fault ``check_invariants`` holds: the server answers, every listed
snapshot verifies and restores into a kernel that checks its own state, kernels other
than the killed one keep theirs, nothing is left in the work directory, and the store
holds no pack nothing references.

Every random choice comes from ``random.Random(FAULT_SEED)``; ``FAULT_ITERATIONS`` (1 in
CI) sets the rounds of each kill loop for a longer run by hand. docs/reliability.md
tabulates what is tried.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_ext.core import proctree
from jupyter_ext.core.errors import SnapshotError
from testkit.processes import MotoServer

from .support.faults import (
    FAULT_ITERATIONS,
    FAULT_SEED,
    TALLY,
    KillPoint,
    Lab,
    Survey,
    ZdtmState,
    check_kernel,
    job_of,
    kernel_pids,
    kill_pids,
    new_state,
    phase_or_file,
    process_alive,
    record,
    restore_new,
    says_no_space,
    sealed_in_staging,
    shutdown_kernel,
    snapshot,
    staged,
    start_kernel,
    upload_progress,
    wait_job,
    wait_quiet,
)
from .support.servers import ws_execute
from .support.tmpfs import Tmpfs

pytestmark = [
    pytest.mark.faults,
    pytest.mark.usefixtures("criu"),
    pytest.mark.timeout(300 * FAULT_ITERATIONS),  # longer runs by hand get longer
]
BUCKET = "kernel-snapshots-faults"


@pytest.fixture(scope="module", autouse=True)
def tally() -> Iterator[None]:
    """Print what was tried, for docs/reliability.md."""
    yield
    print("\nfault tally (test, fault, where, outcome):")
    for row in TALLY:
        print("  " + " | ".join(row))


def rng_for(name: str) -> random.Random:
    rng = random.Random(f"{FAULT_SEED}-{name}")
    print(f"{name}: FAULT_SEED={FAULT_SEED} FAULT_ITERATIONS={FAULT_ITERATIONS}")
    return rng


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    made = Lab(tmp_path / "lab")
    yield made
    made.stop()


@pytest.fixture
def s3_lab(tmp_path: Path, moto: MotoServer) -> Iterator[Lab]:
    made = Lab(tmp_path / "lab", store="s3", s3_url=moto.url, s3_bucket=moto.ensure_bucket(BUCKET))
    yield made
    made.stop()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[list[Tmpfs]]:
    mounts: list[Tmpfs] = []
    yield mounts
    for mount in reversed(mounts):
        mount.unmount()


# ------------------------------------------------------------------- kills during snapshots


SNAPSHOT_POINTS = ["dumping", "hashing", "uploading", "upload-half"]
VICTIMS = ["wrapper", "inner", "server"]


def snapshot_kill_loop(lab: Lab, name: str) -> None:
    """SIGKILL the wrapper, the inner kernel or the server at a random point of a snapshot
    (dump, seal, upload) of one of two kernels; the other one must keep its state."""
    rng = rng_for(name)
    survey = Survey(name)
    server = lab.start()
    lineage: dict[str, ZdtmState] = {}
    # Every point in turn (in a random order), each victim once per iteration.
    points = rng.sample(SNAPSHOT_POINTS, len(SNAPSHOT_POINTS))
    for iteration in range(FAULT_ITERATIONS):
        for v, victim in enumerate(rng.sample(VICTIMS, len(VICTIMS))):
            point = points[(iteration * len(VICTIMS) + v) % len(points)]
            target_state, bystander_state = new_state(rng), new_state(rng)
            target = start_kernel(server, target_state, lineage)
            bystander = start_kernel(server, bystander_state, lineage)
            # A snapshot of the bystander first, so there is something to lose.
            snapshot(server, bystander)
            wrapper_pid, inner_pid = kernel_pids(server, target)
            pid = {"wrapper": wrapper_pid, "inner": inner_pid, "server": server.process.pid}
            job = server.client.call("POST", "", body={"kernel_id": target})["job"]
            if point == "dumping":
                condition = phase_or_file(
                    server,
                    job["id"],
                    {"dumping"},
                    staged(lab, "staging/.*.partial-*/images/*"),
                    "images being written",
                )
            elif point == "hashing":
                condition = phase_or_file(server, job["id"], {"hashing"})
            elif point == "uploading":
                condition = phase_or_file(
                    server, job["id"], {"uploading"}, sealed_in_staging(lab), "sealed"
                )
            else:
                condition = upload_progress(server, job["id"], rng.uniform(0.2, 0.8))
            where = KillPoint(condition, lambda p=pid[victim]: p, rng).join()
            alive = {bystander: bystander_state}
            if victim == "server" and where:
                lab.kill_server()
                server = lab.start()
                alive = {}
            else:
                wait_job(server, job)
                if not where:
                    alive[target] = target_state
            survey.check(
                lab,
                f"SIGKILL {victim}",
                f"snapshot {point}: {where or 'job ended first'}",
                alive,
                lineage,
            )
            for kernel_id in (target, bystander):
                shutdown_kernel(server, kernel_id)
            for snap in server.client.call("GET", "")["snapshots"]:
                server.client.call("DELETE", snap["id"])
    survey.assert_held()


def test_kill_during_snapshot_local(lab: Lab) -> None:
    snapshot_kill_loop(lab, "kill-snapshot-local")


def test_kill_during_snapshot_s3(s3_lab: Lab) -> None:
    snapshot_kill_loop(s3_lab, "kill-snapshot-s3")


# ------------------------------------------------------------------- simultaneous snapshots


def test_simultaneous_snapshots_in_one_directory(lab: Lab) -> None:
    """Three kernels of one notebook folder (the same cwd), snapshotted at the same moment
    through REST, round after round: every snapshot succeeds (CRIU's parasite makes
    ``proc.crtools`` in the task's cwd: two dumps at once collided there)."""
    rng = rng_for("simultaneous")
    server = lab.start()
    (lab.notebooks / "project").mkdir()
    states = [new_state(rng, floats=1 << 20) for _ in range(3)]
    lineage: dict[str, ZdtmState] = {}
    kernels = [start_kernel(server, s, lineage, path="project/n.ipynb") for s in states]
    alive = dict(zip(kernels, states, strict=True))
    rounds = 5 * FAULT_ITERATIONS
    failures: list[str] = []
    for _ in range(rounds):
        barrier = threading.Barrier(len(kernels))
        jobs: dict[str, dict[str, Any]] = {}

        def create(
            kernel_id: str,
            barrier: threading.Barrier = barrier,
            jobs: dict[str, dict[str, Any]] = jobs,
        ) -> None:
            barrier.wait()
            jobs[kernel_id] = server.client.call("POST", "", body={"kernel_id": kernel_id})["job"]

        threads = [threading.Thread(target=create, args=(k,)) for k in kernels]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for kernel_id, job in jobs.items():
            ended = wait_job(server, job)
            if ended["status"] != "done":
                failures.append(f"{kernel_id}: {ended['error']}")
    survey = Survey("simultaneous")
    record(
        "simultaneous",
        f"{len(kernels)} snapshots at once, same cwd",
        f"{rounds} rounds",
        f"{rounds * len(kernels) - len(failures)}/{rounds * len(kernels)} succeeded",
    )
    assert not failures, failures

    def newest_per_kernel(snapshots: list[dict[str, Any]]) -> list[dict[str, Any]]:
        newest: dict[str, dict[str, Any]] = {}
        for snap in snapshots:  # newest first
            newest.setdefault(snap["kernel_id"], snap)
        return list(newest.values())

    checked = survey.check(
        lab, "invariants", "after the rounds", dict(alive), lineage, restore=newest_per_kernel
    )
    survey.assert_held()
    assert checked is not None
    assert checked.snapshots == rounds * len(kernels)
    assert checked.restored == len(kernels)


# ------------------------------------------------------------------- kills during restores


RESTORE_POINTS = ["downloading", "saving-kernel", "restoring"]
"""Where a restore from the store can be killed (a download is checked as it is written:
there is no separate verify phase)."""


def test_kill_during_restore(lab: Lab) -> None:
    """SIGKILL the wrapper or inner kernel of a kernel being restored in place, or the
    server, at a random point of the restore (download, saving the running kernel,
    CRIU restore). The snapshot must stay whole and the bystander keep its state."""
    name = "kill-restore"
    rng = rng_for(name)
    survey = Survey(name)
    server = lab.start()
    lineage: dict[str, ZdtmState] = {}
    # Every point in turn (in a random order), each victim once per iteration.
    points = rng.sample(RESTORE_POINTS, len(RESTORE_POINTS))
    for iteration in range(FAULT_ITERATIONS):
        for v, victim in enumerate(rng.sample(VICTIMS, len(VICTIMS))):
            point = points[(iteration * len(VICTIMS) + v) % len(points)]
            source_state, target_state = new_state(rng), new_state(rng)
            source = start_kernel(server, source_state, lineage)
            target = start_kernel(server, target_state, lineage)
            snap = snapshot(server, source)
            wrapper_pid, inner_pid = kernel_pids(server, target)
            pid = {"wrapper": wrapper_pid, "inner": inner_pid, "server": server.process.pid}
            answer = server.client.call("POST", f"{snap['id']}/restore", body={"kernel_id": target})
            job = answer["job"]
            condition = phase_or_file(
                server,
                job["id"],
                {point},
                staged(lab, "cache/.*.fetching-*") if point == "downloading" else None,
                "download written",
            )
            where = KillPoint(condition, lambda p=pid[victim]: p, rng).join()
            alive = {source: source_state}
            if victim == "server" and where:
                lab.kill_server()
                server = lab.start()
                alive = {}
            else:
                ended = wait_job(server, job)
                if not where:  # the restore ended first: the target holds what it says
                    alive[target] = source_state if ended["status"] == "done" else target_state
            survey.check(
                lab,
                f"SIGKILL {victim}",
                f"restore in place {point}: {where or 'job ended first'}",
                alive,
                lineage,
            )
            for kernel_id in (source, target):
                shutdown_kernel(server, kernel_id)
            for listed in server.client.call("GET", "")["snapshots"]:
                server.client.call("DELETE", listed["id"])
    survey.assert_held()


# ------------------------------------------------------------------- kills during clean-up


def record_gone(lab: Lab, snapshot_id: str, rng: random.Random) -> Callable[[], str]:
    """A kill condition during a deletion: its record is gone from the store (the sweep
    runs next), or a random moment within 50 ms, whichever comes first."""
    started = time.monotonic()
    at = rng.uniform(0, 0.05)
    record_path = lab.store_dir / "users" / "fault" / "snapshots" / f"{snapshot_id}.json"

    def condition() -> str:
        if lab.store == "local" and not record_path.exists():
            return "record deleted"
        if time.monotonic() - started >= at:
            return "during the deletion"
        return ""

    return condition


def test_kill_during_store_cleanup(lab: Lab) -> None:
    """SIGKILL the server while it deletes a snapshot (asked through REST) or while
    retention deletes one after a new snapshot (keep_last=1). Each snapshot is then listed
    whole (verifies, restores) or not at all; the other one is untouched."""
    name = "kill-cleanup"
    rng = rng_for(name)
    survey = Survey(name)
    lab.settings["keep_last"] = 1
    server = lab.start()
    lineage: dict[str, ZdtmState] = {}
    for i in range(2 * FAULT_ITERATIONS):
        mode = "retention" if i % 2 else "delete"
        first_state, other_state = new_state(rng), new_state(rng)
        first = start_kernel(server, first_state, lineage)
        other = start_kernel(server, other_state, lineage)
        old = snapshot(server, first)
        snapshot(server, other)
        lab.observe_store()  # the packs a deletion may leave for the grace period
        server_pid = server.process.pid
        if mode == "delete":
            deleting = threading.Thread(
                target=_quietly, args=(server.client.call, "DELETE", old["id"]), daemon=True
            )
            deleting.start()
        else:  # the second snapshot of the lineage: retention deletes the first
            job = server.client.call("POST", "", body={"kernel_id": first})["job"]
            deadline = time.monotonic() + 120
            # Stored ("uploading" into S3, "storing" into a local store) or past it: an
            # incremental snapshot may pass that phase between two looks.
            stored = {"uploading", "storing", "committing", "done"}
            while job_of(server, job["id"])["phase"] not in stored:
                assert time.monotonic() < deadline, "the snapshot never reached its store"
                time.sleep(0.01)
        kill = KillPoint(record_gone(lab, old["id"], rng), lambda p=server_pid: p, rng, 0)
        where = kill.join()
        lab.kill_server()
        server = lab.start()
        survey.check(lab, "SIGKILL server", f"{mode}: {where}", {}, lineage)
        for listed in server.client.call("GET", "")["snapshots"]:
            server.client.call("DELETE", listed["id"])
    survey.assert_held()


def _quietly(call: Callable[..., Any], *args: Any) -> None:
    """A REST call whose answer does not matter (the server may be killed under it)."""
    with contextlib.suppress(SnapshotError):
        call(*args)


# ------------------------------------------------------------------- full disks


def test_full_work_directory(lab: Lab, tmpfs: list[Tmpfs]) -> None:
    """The work directory is a small tmpfs: a dump that does not fit fails with a clear
    error and leaves nothing; the kernel keeps running with its state; a download that
    does not fit fails the same way; with space again, everything works."""
    name = "full-work-dir"
    rng = rng_for(name)
    survey = Survey(name)
    tmpfs.append(Tmpfs(lab.work_dir, "96M"))
    server = lab.start()
    big_state, small_state = new_state(rng, floats=1 << 24), new_state(rng, floats=1 << 10)
    lineage: dict[str, ZdtmState] = {}
    big = start_kernel(server, big_state, lineage)  # 128 MiB of floats: cannot fit
    small = start_kernel(server, small_state, lineage)
    alive = {big: big_state, small: small_state}

    job = server.client.call("POST", "", body={"kernel_id": big})["job"]
    ended = wait_job(server, job)
    assert ended["status"] == "failed", ended
    error = ended["error"]
    survey.require(
        says_no_space(error),
        "work dir full",
        "dump: the error names the full disk",
        f"{error['message']} {error['hint'][:80]}",
    )
    survey.check(lab, "work dir full", "dump (snapshot of a 128 MiB kernel)", dict(alive), lineage)

    snap = snapshot(server, small)  # the failed dump left nothing: a small one fits
    ballast = lab.work_dir / "ballast"
    free = shutil.disk_usage(lab.work_dir).free
    subprocess.run(["fallocate", "-l", str(max(free - (4 << 20), 0)), str(ballast)], check=True)
    try:
        ended = restore_new(server, snap["id"])
        assert ended["status"] == "failed", ended
        survey.require(
            says_no_space(ended["error"]),
            "work dir full",
            "download: the error names the full disk",
            ended["error"]["message"],
        )
        answer = server.client.call("POST", f"{snap['id']}/restore", body={"kernel_id": big})
        ended = wait_job(server, answer["job"])
        assert ended["status"] == "failed", ended
        left = lab.leftovers(set())
        survey.require(
            left == ["ballast"],
            "work dir full",
            "downloads that failed left nothing",
            f"in the work directory: {left}",
        )
    finally:
        ballast.unlink()
    survey.check(lab, "work dir full", "download (restore new and in place)", dict(alive), lineage)
    tmpfs[-1].resize("1G")
    snapshot(server, big)
    survey.check(lab, "work dir full", "after it has space again", dict(alive), lineage)
    survey.assert_held()


def test_full_store(lab: Lab, tmpfs: list[Tmpfs]) -> None:
    """The local store is a small tmpfs: an upload that does not fit leaves the snapshot
    in the work directory, listed as "upload failed", restorable there; once the store has
    space, the retry stores it, and no pack of the failed attempt is left unreferenced."""
    name = "full-store"
    rng = rng_for(name)
    survey = Survey(name)
    tmpfs.append(Tmpfs(lab.store_dir, "16M"))
    server = lab.start()
    state = new_state(rng)  # 32 MiB of random floats: does not compress into 16 MiB
    lineage: dict[str, ZdtmState] = {}
    kernel = start_kernel(server, state, lineage)
    alive = {kernel: state}
    job = server.client.call("POST", "", body={"kernel_id": kernel})["job"]
    ended = wait_job(server, job)
    assert ended["status"] == "done", ended
    assert ended["result"]["status"] == "upload-failed", ended["result"]
    survey.require(
        says_no_space(ended["result"]["error"]),
        "store full",
        "upload: the error names the full disk",
        ended["result"]["error"],
    )
    survey.check(lab, "store full", "upload", dict(alive), lineage, allow_pending=True)
    tmpfs[-1].resize("1G")
    survey.check(lab, "store full", "after it has space again (retry)", dict(alive), lineage)
    survey.assert_held()


# ------------------------------------------------------------------- restore / delete races


def test_restore_delete_race(lab: Lab) -> None:
    """Restore a snapshot (in place, or into a new kernel) while it is deleted: the
    restore succeeds or fails with a clear error; the kernel restored in place holds the
    snapshot's state or its own, never anything else; nothing is left behind."""
    name = "restore-delete-race"
    rng = rng_for(name)
    survey = Survey(name)
    server = lab.start()
    state = new_state(rng)
    expect: dict[str, ZdtmState] = {}
    kernel = start_kernel(server, state, expect)
    for i in range(4 * FAULT_ITERATIONS):
        in_place = i % 2 == 0
        snap = snapshot(server, kernel)
        expect[snap["id"]] = snap_state = state
        state = new_state(rng)
        ws_execute_state(server, kernel, state)
        body = {"kernel_id": kernel} if in_place else {}
        # The delete comes up to 0.4 s after the restore was asked for, or up to 0.05 s
        # before: both orders and every phase of the restore in between.
        delay = rng.uniform(-0.05, 0.4)
        answer: dict[str, Any] = {}
        deleted: list[str] = []

        def ask(
            body: dict[str, Any] = body,
            answer: dict[str, Any] = answer,
            target: str = f"{snap['id']}/restore",
            wait: float = max(0.0, -delay),
        ) -> None:
            time.sleep(wait)
            try:
                answer["job"] = server.client.call("POST", target, body=body)["job"]
            except SnapshotError as exc:
                answer["error"] = exc.to_dict()

        def delete(
            snapshot_id: str = snap["id"], deleted: list[str] = deleted, wait: float = delay
        ) -> None:
            time.sleep(max(0.0, wait))
            try:
                server.client.call("DELETE", snapshot_id)
                deleted.append("deleted")
            except SnapshotError as exc:
                deleted.append(f"delete refused: {exc.message}")

        lab.observe_store()  # the packs a deletion may leave for the grace period
        racers = [threading.Thread(target=ask), threading.Thread(target=delete)]
        for racer in racers:
            racer.start()
        for racer in racers:
            racer.join()
        if "job" in answer:
            ended = wait_job(server, answer["job"])
            outcome = ended["status"]
            error = ended["error"] or {}
        else:
            outcome, error = "refused", answer["error"]
        if outcome == "done":
            if in_place:
                state = snap_state
            else:
                new_kernel = ended["result"]["kernel_id"]
                check_kernel(server, new_kernel, snap_state)
                shutdown_kernel(server, new_kernel)
        else:
            assert error.get("message"), (outcome, error)
        survey.check(
            lab,
            "restore/delete race",
            f"{'in place' if in_place else 'new kernel'}, delete after {delay * 1000:.0f} ms: "
            f"restore {outcome}{': ' + error['message'][:120] if error else ''}; {deleted[0]}",
            {kernel: state},
            expect,
        )
    survey.assert_held()


def ws_execute_state(server: Any, kernel_id: str, state: ZdtmState) -> None:
    """Give a running kernel a new state (the old one is then only in snapshots)."""
    ws_execute(server, kernel_id, state.setup_code())


# ------------------------------------------------------------------- shutdown snapshots


def test_kill_during_shutdown_snapshots(lab: Lab) -> None:
    """The server is asked to stop (SIGTERM) and snapshots its kernels first; one kernel's
    inner process or wrapper is SIGKILLed during those snapshots. The other kernel's
    shutdown snapshot must be stored whole and restore with its state after a restart."""
    name = "kill-shutdown-snapshot"
    rng = rng_for(name)
    survey = Survey(name)
    lab.settings.update(snapshot_before_shutdown=True, shutdown_snapshot_timeout=120)
    server = lab.start()
    lineage: dict[str, ZdtmState] = {}
    for _ in range(FAULT_ITERATIONS):
        for victim in ("inner", "wrapper"):
            states = [new_state(rng), new_state(rng)]
            killed, kept = (start_kernel(server, s, lineage) for s in states)
            pid = kernel_pids(server, killed)[0 if victim == "wrapper" else 1]
            images = staged(lab, "staging/.*.partial-*/images/*")
            started = time.monotonic()
            at = rng.uniform(0, 0.5)

            def condition(
                images: Callable[[], bool] = images, at: float = at, started: float = started
            ) -> str:
                if images():
                    return "images being written"
                if time.monotonic() - started > at:
                    return "after SIGTERM"
                return ""

            server.process.send_signal(signal.SIGTERM)
            where = KillPoint(condition, lambda p=pid: p, rng).join()
            server.process.wait(180)
            lab.stop()
            server = lab.start()
            listed = wait_quiet(lab)["snapshots"]
            kept_snaps = [s["trigger"] for s in listed if s["kernel_id"] == kept]
            survey.require(
                kept_snaps == ["before-shutdown"],
                f"SIGKILL {victim}",
                f"shutdown snapshots: {where}: the other kernel's snapshot is stored",
                f"its snapshots: {kept_snaps}",
            )
            survey.check(lab, f"SIGKILL {victim}", f"shutdown snapshots: {where}", {}, lineage)
            for snap in server.client.call("GET", "")["snapshots"]:
                server.client.call("DELETE", snap["id"])
    survey.assert_held()


# ------------------------------------------------------------------- cell checkpoints


CHECKPOINT_VICTIMS = ["criu", "inner", "wrapper"]


def criu_dumping(wrapper_pid: int) -> int | None:
    """The CRIU process a kernel's wrapper runs for a dump now, if any."""
    for pid in proctree.descendants(wrapper_pid):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if any(arg.endswith(b"criu") for arg in argv) and b"dump" in argv:
                return pid
    return None


def checkpoints_of(server: Any, kernel_id: str) -> dict[str, Any]:
    listing: dict[str, Any] = server.client.call("GET", f"kernels/{kernel_id}/checkpoints")
    return listing


def checkpoints_settled(server: Any, kernel_id: str) -> dict[str, Any]:
    """The kernel's checkpoints once every cell run has one (or the last one failed) and
    none is being taken."""
    deadline = time.monotonic() + 120
    while True:
        listing = checkpoints_of(server, kernel_id)
        done = not listing["cells_since"] or listing["skipped"] is not None
        if listing["checkpoints"] and not listing["taking"] and done:
            return listing
        if time.monotonic() > deadline:
            raise TimeoutError(f"kernel {kernel_id}'s checkpoints did not settle: {listing}")
        time.sleep(0.05)


def checkpoint_kill(
    lab: Lab, server: Any, target: str, victim: str, before: int, rng: random.Random
) -> KillPoint:
    """SIGKILL ``victim`` (criu, inner, wrapper) once the target kernel's next cell
    checkpoint writes its images ("end" once a checkpoint more is taken)."""
    wrapper_pid, inner_pid = kernel_pids(server, target)
    images = staged(lab, f"checkpoints/{target}-*/.*.partial-*/images/*")
    found = {"inner": inner_pid, "wrapper": wrapper_pid}
    polls = 0

    def condition() -> str:
        nonlocal polls
        polls += 1
        if images():
            if victim != "criu":
                return "checkpoint images being written"
            criu = criu_dumping(wrapper_pid)
            if criu is not None:
                found["criu"] = criu
                return "checkpoint images being written, CRIU dumping"
        if polls % 10 == 0 and len(checkpoints_of(server, target)["checkpoints"]) > before:
            return "end"
        return ""

    return KillPoint(condition, lambda: found[victim], rng)


def test_kill_during_cell_checkpoint(lab: Lab) -> None:
    """SIGKILL the CRIU dump of a cell checkpoint, the kernel, or its wrapper while the
    checkpoint's images are being written. Nothing is lost: a kernel whose dump was killed
    keeps its state and its earlier checkpoints (an undo to before the cell works); the
    other kernel keeps its state and checkpoints. Nothing is left: no partial checkpoint,
    and a kernel that died leaves no area (its wrapper removes it, or the server does)."""
    name = "kill-cell-checkpoint"
    rng = rng_for(name)
    survey = Survey(name)
    # A checkpoint after every cell (no pause budget): the kill lands on the one after the
    # cell, as soon as it is taken.
    lab.settings.update(
        cell_checkpoints="auto", policy_tick=0.5, cell_checkpoint_max_pause_share=0.0
    )
    server = lab.start()
    lineage: dict[str, ZdtmState] = {}
    for _ in range(FAULT_ITERATIONS):
        for victim in rng.sample(CHECKPOINT_VICTIMS, len(CHECKPOINT_VICTIMS)):
            target_state, bystander_state = new_state(rng), new_state(rng)
            target = start_kernel(server, target_state, lineage)
            bystander = start_kernel(server, bystander_state, lineage)
            kept = {c["id"] for c in checkpoints_settled(server, bystander)["checkpoints"]}
            before = len(checkpoints_settled(server, target)["checkpoints"])
            killer = checkpoint_kill(lab, server, target, victim, before, rng)
            ws_execute(server, target, "extra = np.ones(4 * 2**20)")  # 32 MiB to copy
            where = killer.join()
            alive = {bystander: bystander_state}
            if victim == "criu" or not where:
                alive[target] = target_state
                listing = checkpoints_settled(server, target)
                survey.require(
                    where == "" or listing["skipped"] is not None,
                    f"SIGKILL {victim}",
                    f"cell checkpoint: {where}",
                    f"the failed checkpoint is said: {(listing['skipped'] or {}).get('reason')}",
                )
                # Nothing lost: the kernel goes back to before the cell.
                job = server.client.call("POST", f"kernels/{target}/undo", body={})["job"]
                ended = wait_job(server, job)
                survey.require(
                    ended["status"] == "done",
                    f"SIGKILL {victim}",
                    f"cell checkpoint: {where}",
                    f"undo after it: {ended['status']} {ended['error'] or ''}",
                )
                out = ws_execute(server, target, "print('extra' in dir())").strip()
                survey.require(
                    out == "False", f"SIGKILL {victim}", f"undo: {where}", f"extra still: {out}"
                )
            left = {c["id"] for c in checkpoints_of(server, bystander)["checkpoints"]}
            survey.require(
                kept <= left,
                f"SIGKILL {victim}",
                f"cell checkpoint: {where}",
                f"the other kernel kept its checkpoints: {kept - left} gone",
            )
            survey.check(lab, f"SIGKILL {victim}", f"cell checkpoint: {where}", alive, lineage)
            for kernel_id in (target, bystander):
                shutdown_kernel(server, kernel_id)
    survey.assert_held()


# ------------------------------------------------------------------- orphans


def test_kernels_end_with_a_killed_server(lab: Lab) -> None:
    """A SIGKILLed server's kernels end by themselves, as plain ipykernels do (they poll
    JPY_PARENT_PID): no new server can adopt them, and left running they would hold their
    memory and GPU for good. Waits up to 30 s for them (ipykernel polls every second)."""
    survey = Survey("orphans")
    server = lab.start()
    expect: dict[str, ZdtmState] = {}
    kernel = start_kernel(server, new_state(random.Random(FAULT_SEED), floats=1 << 10), expect)
    wrapper_pid, inner_pid = kernel_pids(server, kernel)
    tree = proctree.descendants(server.process.pid)
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(process_alive(p) for p in (wrapper_pid, inner_pid)):
        time.sleep(0.2)
    left = [p for p in tree if process_alive(p)]
    kill_pids(tree)
    server._log.close()
    lab.server = None
    survey.require(
        not left,
        "SIGKILL server",
        "idle kernel: its wrapper and kernel end by themselves",
        f"still running 30 s later: {left}",
    )
    survey.assert_held()
