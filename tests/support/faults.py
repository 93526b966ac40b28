"""Helpers of the fault suite (tests/test_faults.py): a real server that can be SIGKILLed
and started again on the same work directory and store, kernels that check their own
state (zdtm style), kill points watched over REST and on disk, and the invariants that
must hold after every fault.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import re
import signal
import subprocess
import threading
import time
import urllib.error
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jupyter_ext.core import proctree
from jupyter_ext.core.errors import SnapshotError
from jupyter_ext.core.manifest import MANIFEST_NAME, SNAPSHOT_ID_RE, verify
from jupyter_ext.core.store import LocalStore, S3Store, sealing
from jupyter_ext.core.store.backend import layout
from jupyter_ext.manager import user_prefix
from testkit.processes import ServerProcess, run_keys

from .servers import ws_execute

OWNER = "fault"
S3_PREFIX = "kernel-snapshots"
FAULT_ITERATIONS = int(os.environ.get("FAULT_ITERATIONS", "1"))
"""Rounds of each kill loop: 1 in CI; more for a longer run by hand."""
FAULT_SEED = int(os.environ.get("FAULT_SEED", "20261130"))
"""Seed of every random choice (kill point, victim, delay); printed by each test."""

#: Every fault tried, as (test, fault, where, outcome): tests/test_faults.py prints them
#: at the end so docs/reliability.md can be written from real runs.
TALLY: list[tuple[str, str, str, str]] = []


def record(test: str, fault: str, where: str, outcome: str) -> None:
    TALLY.append((test, fault, where, outcome))
    print(f"FAULT {test}: {fault} at {where}: {outcome}", flush=True)


# ------------------------------------------------------------------- the server


@dataclass
class Lab:
    """One server's work directory and store, served by a server that can be SIGKILLed
    and started again on them (each start gets its own home: config, runtime, log)."""

    root: Path
    store: str = "local"
    s3_url: str = ""
    s3_bucket: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    server: ServerProcess | None = None
    starts: int = 0

    def __post_init__(self) -> None:
        self.notebooks = self.root / "notebooks"
        self.work_dir = self.root / "work"
        self.store_dir = self.root / "store"
        for path in (self.notebooks, self.work_dir, self.store_dir):
            path.mkdir(parents=True, exist_ok=True)
        self.seen_objects: set[str] = set()
        """Packs any record ever referenced (a deleted snapshot's stay for the grace
        period by design; packs no record ever referenced were left by failed work)."""

    def config(self) -> dict[str, Any]:
        app: dict[str, Any] = {
            "owner": OWNER,
            "store": self.store,
            "work_dir": str(self.work_dir),
            "local_store_dir": str(self.store_dir),
            "idle_suspend_after": 0,
            "snapshot_before_shutdown": False,
            "keep_last": 0,
            "upload_retry_interval": 1.0,
            "policy_tick": 0.5,
            # Fewer, larger chunks than the automatic size: the same code paths, less
            # work for 2 cores and moto.
            "chunk_kib": 256,
            # Restores go through the store (its faults are under test), not the local
            # image cache (tests/test_image_cache.py).
            "image_cache_max_bytes": 0,
            # Cell checkpoints: their own fault test turns them on (test_faults.py).
            "cell_checkpoints": "off",
        }
        if self.store == "s3":
            app.update(s3_bucket=self.s3_bucket, s3_endpoint_url=self.s3_url, s3_prefix=S3_PREFIX)
        app.update(self.settings)
        return {"SnapshotExtensionApp": app}

    def start(self) -> ServerProcess:
        self.starts += 1
        self.server = ServerProcess(
            self.root / f"home-{self.starts}", self.notebooks, self.config()
        )
        return self.server

    @property
    def up(self) -> ServerProcess:
        assert self.server is not None, "the server is not started"
        return self.server

    def kill_server(self) -> None:
        """SIGKILL the server, then its kernels (orphans no new server could adopt, killed
        as the server's cgroup or pod would be), and wait for all of them to be gone."""
        server = self.up
        tree = proctree.descendants(server.process.pid)
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(30)
        kill_pids(tree)
        server._log.close()
        self.server = None

    def stop(self) -> None:
        if self.server is not None:
            server = self.server
            tree = proctree.descendants(server.process.pid)
            server.stop()
            kill_pids(tree)
            self.server = None

    # ------------------------------------------------------------- the store

    def open_store(self) -> LocalStore | S3Store:
        """The server's store, opened directly (as a second reader would)."""
        if self.store == "s3":
            return S3Store(
                self.s3_bucket,
                f"{S3_PREFIX}/{user_prefix(OWNER)}",
                endpoint_url=self.s3_url,
                keys=run_keys(),
            )
        return LocalStore(self.store_dir / user_prefix(OWNER), keys=run_keys())

    def store_files(self) -> tuple[dict[str, bytes], set[str]]:
        """(record id -> record bytes, object names) as they lie in the store."""
        records: dict[str, bytes] = {}
        objects: set[str] = set()
        if self.store == "s3":
            import boto3

            client = boto3.client("s3", endpoint_url=self.s3_url)
            try:
                prefix = f"{S3_PREFIX}/{user_prefix(OWNER)}/"
                pages = client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.s3_bucket, Prefix=prefix
                )
                for page in pages:
                    for item in page.get("Contents", []):
                        key = item["Key"][len(prefix) :]
                        if key.startswith(("packs/", "chunks/")):
                            objects.add(key)
                        elif key.startswith("snapshots/") and key.endswith(".json"):
                            body = client.get_object(Bucket=self.s3_bucket, Key=item["Key"])
                            records[key[len("snapshots/") : -len(".json")]] = body["Body"].read()
            finally:
                client.close()
        else:
            root = self.store_dir / user_prefix(OWNER)
            objects = {
                p.relative_to(root).as_posix()
                for p in [*root.glob("packs/*/*"), *root.glob("chunks/*/*")]
                if not p.name.startswith(".")
            }
            for path in root.glob("snapshots/*.json"):
                if not path.name.startswith("."):
                    with contextlib.suppress(FileNotFoundError):
                        records[path.name.removesuffix(".json")] = path.read_bytes()
        return records, objects

    def observe_store(self) -> tuple[dict[str, set[str]], set[str]]:
        """Read every record's packs (remembered in ``seen_objects``); returns
        (record id -> its packs, packs in the store)."""
        records, objects = self.store_files()
        refs: dict[str, set[str]] = {}
        store: LocalStore | S3Store | None = None
        try:
            for snapshot_id, data in records.items():
                if sealing.is_sealed_file(data):  # opened with the user's key, as a reader
                    store = store or self.open_store()
                    assert store.keyring is not None
                    path = layout.path(layout.record(snapshot_id))
                    data = store.keyring.sealer().open_file(path, data)
                refs[snapshot_id] = set(json.loads(data)["objects"])
                self.seen_objects |= refs[snapshot_id]
        finally:
            if store is not None:
                store.close()
        return refs, objects

    def orphan_objects(self) -> set[str]:
        """Packs in the store that no record references or ever referenced."""
        _refs, objects = self.observe_store()
        return objects - self.seen_objects

    def clear_after_violation(self) -> None:
        """Forget what a violated round left (reported already), so the next round is
        judged on its own: leftovers in the work directory go, orphan packs are noted."""
        listed: set[str] = set()
        with contextlib.suppress(Exception):
            listed = {s["id"] for s in self.up.client.call("GET", "")["snapshots"]}
        for rel in self.leftovers(listed):
            subprocess.run(["rm", "-rf", str(self.work_dir / rel)], check=False)
        self.seen_objects |= self.store_files()[1]

    # ------------------------------------------------------------- the work dir

    def staged_id(self, path: Path) -> str | None:
        """The id of the sealed snapshot in a staging directory (not its name: a dump is
        sealed under another id than its directory's)."""
        try:
            return str(json.loads((path / MANIFEST_NAME).read_text())["id"])
        except (OSError, ValueError, KeyError):
            return None

    def staged_dir(self, snapshot_id: str) -> Path:
        for path in (self.work_dir / "staging").iterdir():
            if self.staged_id(path) == snapshot_id:
                return path
        raise AssertionError(f"snapshot {snapshot_id} is listed but not in the work directory")

    def leftovers(self, pending: set[str] | None = None) -> list[str]:
        """What is in the work directory besides the sealed snapshots waiting for upload
        (``pending``) and the sealed cell checkpoints of live kernels: partial dumps,
        downloads, restore requests, the checkpoints of a kernel that is gone."""
        left = []
        live = live_checkpoint_areas(self.work_dir / "checkpoints")
        for path in sorted(entries_now(self.work_dir)):
            rel = path.relative_to(self.work_dir)
            parts = rel.parts
            if parts in (("staging",), ("cache",), ("suspended",), ("image-cache",)):
                continue
            if parts[0] == "checkpoints" and (
                len(parts) == 1
                or (
                    parts[1].removesuffix(".lock") in live
                    and (len(parts) < 3 or not parts[2].startswith("."))
                )
            ):
                continue  # a live kernel's area and its sealed checkpoints
            if parts == ("image-cache", ".lock"):  # the (empty, off) image cache's lock
                continue
            if (
                parts[0] == "staging"
                and len(parts) == 2
                and self.staged_id(path) in (pending or ())
            ):
                continue
            if len(parts) > 2 and parts[0] == "staging":
                continue  # inside something already listed
            if len(parts) > 2 and parts[0] == "cache":
                continue
            left.append(str(rel))
        return left


def entries_now(root: Path) -> list[Path]:
    """Every file and directory under ``root``, read while the server may be removing
    some (a failed checkpoint's partial directory): one removed meanwhile is not listed
    (``Path.rglob`` raised FileNotFoundError on it, failing a full run's fault test)."""
    found = []
    for directory, dirs, files in os.walk(root):  # errors (a directory gone) are skipped
        found.extend(Path(directory, name) for name in (*dirs, *files))
    return found


def live_checkpoint_areas(root: Path) -> set[str]:
    """The cell checkpoint areas whose wrapper lives (holds its lock file)."""
    live = set()
    for lock in root.glob("*.lock") if root.is_dir() else []:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # its kernel's area removed meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            live.add(lock.name.removesuffix(".lock"))
        finally:
            os.close(fd)
    return live


def kill_pids(pids: Iterator[int] | list[int] | set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        deadline = time.monotonic() + 30
        while process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)


def process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


# ------------------------------------------------------------------- kernels


@dataclass
class ZdtmState:
    """What a kernel holds, and what it checks itself after any fault: a value and a
    numpy array with its sha256 (recomputed by the kernel, compared with the one kept)."""

    value: str
    seed: int
    floats: int

    def setup_code(self) -> str:
        return (
            "import hashlib, numpy as np\n"
            f"zdtm_value = {self.value!r}\n"
            f"zdtm_arr = np.random.default_rng({self.seed}).random({self.floats})\n"
            "zdtm_sum = hashlib.sha256(zdtm_arr.tobytes()).hexdigest()\n"
        )

    @staticmethod
    def check_code() -> str:
        return (
            "assert hashlib.sha256(zdtm_arr.tobytes()).hexdigest() == zdtm_sum, "
            "'the array changed'\n"
            "print(zdtm_value)\n"
        )


def new_state(rng: random.Random, floats: int = 1 << 22) -> ZdtmState:
    return ZdtmState(f"v-{rng.getrandbits(48):012x}", rng.getrandbits(32), floats)


def start_kernel(
    server: ServerProcess,
    state: ZdtmState,
    expect: dict[str, ZdtmState],
    path: str = "",
) -> str:
    """A kernel holding ``state``; ``expect`` learns it under the kernel's lineage (what
    its snapshots carry; a restarted kernel has a new one)."""
    body: dict[str, Any] = {"name": "python3-snapshot"}
    if path:
        body["path"] = path
    kernel_id: str = server.api("POST", "api/kernels", body)["id"]
    ws_execute(server, kernel_id, state.setup_code())
    expect[server.client.call("GET", f"kernels/{kernel_id}")["lineage"]] = state
    return kernel_id


def check_kernel(server: ServerProcess, kernel_id: str, state: ZdtmState) -> None:
    """The kernel checks its array itself and says its value, which must be ``state``'s."""
    out = ws_execute(server, kernel_id, ZdtmState.check_code(), timeout=120)
    assert out.strip() == state.value, f"kernel {kernel_id} holds {out!r}, not {state.value}"


def kernel_pids(server: ServerProcess, kernel_id: str) -> tuple[int, int]:
    """(wrapper pid, inner kernel pid) as the wrapper says."""
    status = server.client.call("GET", f"kernels/{kernel_id}")
    return int(status["wrapper_pid"]), int(status["inner_pid"])


def shutdown_kernel(server: ServerProcess, kernel_id: str) -> None:
    with contextlib.suppress(urllib.error.HTTPError):
        server.api("DELETE", f"api/kernels/{kernel_id}")


# ------------------------------------------------------------------- jobs


def job_of(server: ServerProcess, job_id: str) -> dict[str, Any]:
    job: dict[str, Any] = server.client.call("GET", f"jobs/{job_id}")
    return job


def wait_job(server: ServerProcess, job: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    """The job once it ended (done or failed; no exception either way)."""
    deadline = time.monotonic() + timeout
    while job["status"] == "running":
        if time.monotonic() > deadline:
            raise TimeoutError(f"job still running after {timeout} s: {job}")
        time.sleep(0.05)
        job = job_of(server, job["id"])
    return job


def snapshot(server: ServerProcess, kernel_id: str) -> dict[str, Any]:
    """Take a snapshot through REST; it must succeed. Returns its description."""
    job = server.client.call("POST", "", body={"kernel_id": kernel_id})["job"]
    done = wait_job(server, job)
    assert done["status"] == "done", done
    result: dict[str, Any] = done["result"]
    return result


def restore_new(server: ServerProcess, snapshot_id: str) -> dict[str, Any]:
    """Restore into a new kernel; returns the ended job (done or failed)."""
    answer = server.client.call("POST", f"{snapshot_id}/restore", body={})
    return wait_job(server, answer["job"])


class KillPoint:
    """Watch a job (REST, its phase) and the disk, and SIGKILL ``pid`` at the first
    moment ``condition`` holds, after a random delay. Runs in a thread; ``join`` says
    where it struck ("" if the job ended first)."""

    def __init__(
        self,
        condition: Callable[[], str],
        pid: Callable[[], int],
        rng: random.Random,
        max_delay: float = 0.05,
    ) -> None:
        self.condition = condition
        self.pid = pid
        self.delay = rng.uniform(0, max_delay)
        self.where = ""
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                where = self.condition()
            except Exception:  # noqa: BLE001 - a server answering late: look again
                where = ""
            if where == "end":
                return
            if where:
                time.sleep(self.delay)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid(), signal.SIGKILL)
                self.where = f"{where} (+{self.delay * 1000:.0f} ms)"
                return
            time.sleep(0.003)

    def join(self, timeout: float = 300) -> str:
        self.thread.join(timeout)
        self.stop.set()
        return self.where


def phase_or_file(
    server: ServerProcess,
    job_id: str,
    phases: set[str],
    files: Callable[[], bool] | None = None,
    file_label: str = "file",
) -> Callable[[], str]:
    """A kill condition: the job is in one of ``phases`` (asked every few polls), or
    ``files()`` holds (looked at every poll). "end" once the job has ended."""
    polls = 0

    def condition() -> str:
        nonlocal polls
        polls += 1
        if files is not None and files():
            return file_label
        if polls % 5 == 0:
            job = job_of(server, job_id)
            if job["status"] != "running":
                return "end"
            if job["phase"] in phases:
                return f"phase {job['phase']}"
        return ""

    return condition


# ------------------------------------------------------------------- invariants


@dataclass
class Checked:
    snapshots: int = 0
    restored: int = 0
    kernels: int = 0


def wait_quiet(lab: Lab, timeout: float = 120, allow_pending: bool = False) -> dict[str, Any]:
    """Wait until no job runs, no lazily restored kernel still pulls its pages (it keeps
    the kernel saved before a restore in place until then) and no upload is in flight
    (nor, unless ``allow_pending``, waits for its retry: the store works, so every
    snapshot must end up stored, those a killed server left in staging too); returns the
    listing."""
    server = lab.up
    deadline = time.monotonic() + timeout
    while True:
        kernels = server.client.call("GET", "kernels")["kernels"]
        busy = [
            k
            for k in kernels
            if (k.get("job") or {}).get("status") == "running"
            or (k.get("lazy_restore") or {}).get("state") == "transferring"
        ]
        listing: dict[str, Any] = server.client.call("GET", "")
        waiting = {"uploading"} if allow_pending else {"uploading", "upload-failed"}
        uploading = [s for s in listing["snapshots"] if s["status"] in waiting]
        if not busy and not uploading:
            return listing
        if time.monotonic() > deadline:
            raise TimeoutError(f"still busy after {timeout} s: {busy} {uploading}")
        time.sleep(0.1)


def settled_leftovers(lab: Lab, pending: set[str], timeout: float = 30) -> list[str]:
    """What stays in the work directory (:meth:`Lab.leftovers`) once the server is done
    with the kernels just shut down: a lazily restored kernel's download is removed by the
    server's watch on it, which sees the kernel gone a moment after it left the listing
    that :func:`wait_quiet` reads. A leak stays past ``timeout`` and is returned."""
    deadline = time.monotonic() + timeout
    while (left := lab.leftovers(pending)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def wrappers_waiting(lab: Lab) -> str:
    """Where each task of the server's kernel wrappers waits (SIGUSR1: their log says it,
    kernel_wrapper/wrapper.py), for a failure to show what held a leftover (one line: a
    :class:`Survey` keeps a violation's first line)."""
    server = lab.up
    wrappers = [
        pid
        for pid in proctree.descendants(server.process.pid)[1:]
        if b"kernel_wrapper\0-f" in _cmdline(pid)
    ]
    before = len(server.log())
    for pid in wrappers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    time.sleep(1)
    said = [
        line
        for line in server.log()[before:].splitlines()
        if " waits at " in line and not line.endswith("receive_ready")  # an idle relay
    ]
    return "".join(f" | {line}" for line in said)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def check_invariants(
    lab: Lab,
    alive: dict[str, ZdtmState],
    lineage: dict[str, ZdtmState],
    *,
    restore: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None,
    allow_pending: bool = False,
) -> Checked:
    """After a fault: the server answers; every listed snapshot is complete (or, with
    ``allow_pending``, kept locally after a store failure), verifies, and restores into a
    new kernel that holds the state of the kernel it was taken of (``lineage``: snapshot
    id or kernel lineage -> state); the kernels in ``alive`` still hold theirs; nothing
    is left in the work directory; the store holds no pack no record ever referenced.

    ``restore`` picks which snapshots to restore (default: all)."""
    server = lab.up
    checked = Checked()
    server.client.call("GET", "policy")  # the server answers
    listing = wait_quiet(lab, allow_pending=allow_pending)
    assert not listing["store_error"], listing["store_error"]
    snapshots = listing["snapshots"]
    pending = set()
    store = lab.open_store()
    try:
        for snap in snapshots:
            if snap["status"] != "complete":
                assert allow_pending, f"snapshot {snap['id']} is {snap['status']}"
                assert snap["status"] == "upload-failed", snap
                pending.add(snap["id"])
                verify(lab.staged_dir(snap["id"]))
            else:
                fetched = lab.root / f"verify-{uuid.uuid4().hex[:8]}"
                try:
                    store.fetch(snap["id"], fetched)
                    verify(fetched)
                finally:
                    subprocess.run(["rm", "-rf", str(fetched)], check=False)
            checked.snapshots += 1
    finally:
        store.close()
    for snap in restore(snapshots) if restore is not None else snapshots:
        # What the snapshot must hold: recorded for it, else its lineage's. A lineage the
        # test never saw is a kernel jupyter_server restarted blank after its wrapper was
        # killed (same kernel id): its snapshots restore into a kernel without the state.
        state = lineage.get(snap["id"]) or lineage.get(snap["lineage"])
        job = restore_new(server, snap["id"])
        assert job["status"] == "done", (snap["id"], job)
        new_kernel = job["result"]["kernel_id"]
        if state is None:
            out = ws_execute(server, new_kernel, "print('zdtm_value' in dir())")
            assert out.strip() == "False", f"snapshot {snap['id']} of an unknown kernel"
        else:
            check_kernel(server, new_kernel, state)
        shutdown_kernel(server, new_kernel)
        checked.restored += 1
    for kernel_id, state in alive.items():
        check_kernel(server, kernel_id, state)
        checked.kernels += 1
    wait_quiet(lab, allow_pending=allow_pending)
    left = settled_leftovers(lab, pending)
    assert not left, f"left in the work directory {lab.work_dir}: {left}{wrappers_waiting(lab)}"
    orphans = lab.orphan_objects()
    assert not orphans, f"{len(orphans)} packs in the store that no snapshot references"
    return checked


def staged(lab: Lab, pattern: str) -> Callable[[], bool]:
    """A kill condition on the work directory: something matching ``pattern`` exists."""
    return lambda: any(True for _ in lab.work_dir.glob(pattern))


def sealed_in_staging(lab: Lab) -> Callable[[], bool]:
    """A snapshot sealed and waiting for its upload (the upload has begun)."""

    def condition() -> bool:
        staging = lab.work_dir / "staging"
        return any(
            SNAPSHOT_ID_RE.match(p.name) and (p / MANIFEST_NAME).exists() for p in staging.iterdir()
        )

    return condition


def upload_progress(server: ServerProcess, job_id: str, fraction: float) -> Callable[[], str]:
    """A kill condition: the job uploads and has moved ``fraction`` of its bytes."""

    def condition() -> str:
        job = job_of(server, job_id)
        if job["status"] != "running":
            return "end"
        total = job.get("total_bytes") or 0
        if job["phase"] == "uploading" and total and job["done_bytes"] >= fraction * total:
            return f"upload {job['done_bytes'] * 100 // total}%"
        return ""

    return condition


class Survey:
    """Runs the invariants after each fault of a loop and keeps going when one is violated
    (after removing what the violation left, so the next round starts clean): the tally
    shows every round, and ``assert_held`` fails the test with all violations at once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.rounds = 0
        self.violations: list[str] = []

    def check(
        self,
        lab: Lab,
        fault: str,
        where: str,
        alive: dict[str, ZdtmState],
        lineage: dict[str, ZdtmState],
        **kwargs: Any,
    ) -> Checked | None:
        self.rounds += 1
        try:
            checked = check_invariants(lab, alive, lineage, **kwargs)
        except (AssertionError, SnapshotError, TimeoutError) as exc:
            text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip() or repr(exc)
            lines = [line for line in text.splitlines() if line.strip(" -")]
            # The first line, and the last of a traceback (what the kernel raised).
            first = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"
            record(self.name, fault, where, f"VIOLATED: {first[:300]}")
            self.violations.append(f"{fault} at {where}: {first}")
            lab.clear_after_violation()
            return None
        record(
            self.name,
            fault,
            where,
            f"held ({checked.snapshots} snapshots verified, {checked.restored} restored, "
            f"{checked.kernels} kernels kept their state)",
        )
        return checked

    def assert_held(self) -> None:
        assert not self.violations, (
            f"{len(self.violations)} of {self.rounds} rounds violated an invariant:\n"
            + "\n".join(self.violations)
        )

    def require(self, ok: bool, fault: str, where: str, what: str) -> None:
        """An expectation about the fault itself (a clear error, say), kept like a
        violated invariant when it does not hold."""
        self.rounds += 1
        record(self.name, fault, where, ("held: " if ok else "VIOLATED: ") + what[:300])
        if not ok:
            self.violations.append(f"{fault} at {where}: {what}")


def says_no_space(error: dict[str, Any] | str) -> bool:
    """Whether an error's message or hint (not only its CRIU log) names the full disk."""
    if isinstance(error, str):
        text = error
    else:
        text = f"{error.get('message', '')} {error.get('hint', '')}"
    return "space" in text.lower()
