"""When the server snapshots a kernel by itself: the decisions of one policy tick, and
what becomes of a kernel shutdown its user did not ask for.

Every ``policy_tick`` seconds the server reads each kernel's status once (its wrapper's
:class:`~..protocol.KernelStatus`; jupyter_ext/autosnap.py) and hands what it read to
:func:`decide`: a pure function of those statuses, the settings, what the policies
remember between ticks (:class:`PolicyMemory`) and the time, so that every decision is
tested without kernels or sleeps (tests/test_policy_decisions.py; one tick against real
kernels and the policies end to end: tests/test_policies.py).

The policies, asked in this order for each kernel (the first that applies wins: one job
per kernel at a time, and none while one of this server's jobs runs on it):

* ``periodic`` (``periodic_interval``): once per interval, each kernel that ran a cell
  since its last snapshot;
* ``long-cell`` (``long_cell_seconds``): a kernel whose longest cell since its last
  snapshot ran that long (the wrapper times each cell from its ``execute_input`` to its
  ``execute_reply``: queued cells do not count their wait), at most once per
  ``long_cell_min_interval`` per kernel; any snapshot resets the wrapper's record;
* ``idle-suspend`` (``idle_suspend_after``): a kernel idle that long and holding GPU
  memory (or any idle kernel, with ``suspend_cpu_kernels``) is snapshotted and its
  process ended; the next request brings it back.

The panel's per-kernel switch (:attr:`Kernel.automatic`) turns the first two off for a
kernel. A new policy is one function of a :class:`Kernel` here and one line in
:func:`decide` (and its trigger in manifest.TRIGGERS); the next one waiting is whether a
snapshot may be incremental.

A kernel shutdown the user did not ask for (jupyter_server's culler, with ``cull_action``
"suspend"; a shutdown asked by someone other than the server's owner, with
``admin_shutdown_action`` "suspend") is decided by :func:`culled` on the kernel's status,
read once when the shutdown comes (jupyter_ext/culling.py carries it out).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from ..protocol.control import KernelStatus

Trigger = Literal["periodic", "long-cell", "idle-suspend"]
"""What a policy starts; the manifest's trigger of the snapshot it takes."""

EndedBy = Literal["culler", "other"]
"""Who ends a kernel without its user asking: jupyter_server's culler, or a request by
someone other than the server's owner (a hub admin, a service)."""

EndAction = Literal["leave", "suspend", "snapshot", "shutdown"]
"""What such a shutdown becomes (:func:`culled`): "leave": nothing, the kernel stays as
it is; "suspend": the kernel is suspended instead (if that fails: "snapshot");
"snapshot": snapshotted, then shut down (a busy kernel cannot be suspended); "shutdown":
shut down as asked (not a snapshot kernel, or nothing in it to keep)."""

LEFT_ALONE = ("suspended", "snapshotting", "restoring", "starting")
"""Wrapper states in which the culler leaves a snapshot kernel alone: suspended (saved and
freed already: culling it would only lose it), or a snapshot, restore or start under way
(idle only to the culler)."""


@dataclass(frozen=True)
class PolicySettings:
    """SnapshotExtensionApp's traits of the same names (there documented; 0 turns a
    policy off). The defaults here are "every policy off", for a decision looked at alone;
    the product's defaults are the traits', which the app always passes."""

    periodic_interval: float = 0.0
    long_cell_seconds: float = 0.0
    long_cell_min_interval: float = 0.0
    idle_suspend_after: float = 0.0
    suspend_cpu_kernels: bool = False

    @property
    def needs_gpu(self) -> bool:
        """Whether a decision needs the kernels' GPU accounting (NVML, costlier than the
        rest of a status): only idle suspend of GPU kernels does."""
        return self.idle_suspend_after > 0 and not self.suspend_cpu_kernels


@dataclass(frozen=True)
class Kernel:
    """What one tick knows of a kernel."""

    kernel_id: str
    status: KernelStatus | None
    """Its wrapper's status; None: not a snapshot kernel, its wrapper gone, or not read
    (no policy could act on it: :func:`needs_status`)."""
    has_job: bool = False
    """A job of this server (snapshot, restore, suspend, resume) runs on it."""
    automatic: bool = True
    """The panel's per-kernel switch: off, no periodic or long-cell snapshots."""


@dataclass
class PolicyMemory:
    """What the policies remember between ticks (monotonic seconds)."""

    last_periodic: float
    """When the last periodic round was (at first: when the server started)."""
    last_long_cell: dict[str, float] = field(default_factory=dict)
    """When each kernel's last long-cell snapshot started."""

    def started(self, decision: Decision, now: float) -> None:
        """A decision's job started at ``now``."""
        if decision.trigger == "long-cell":
            self.last_long_cell[decision.kernel_id] = now

    def forget_others(self, kernel_ids: Iterable[str]) -> None:
        """Only the kernels of ``kernel_ids`` are still there."""
        kept = set(kernel_ids)
        for gone in set(self.last_long_cell) - kept:
            del self.last_long_cell[gone]


@dataclass(frozen=True)
class Decision:
    """Start a snapshot (a suspend for ``idle-suspend``) of a kernel."""

    kernel_id: str
    trigger: Trigger

    @property
    def suspends(self) -> bool:
        """The snapshot ends the kernel's process."""
        return self.trigger == "idle-suspend"


@dataclass(frozen=True)
class Plan:
    """One tick's decisions, and whether it was a periodic round (remembered then)."""

    decisions: list[Decision]
    periodic_round: bool


def periodic_round(settings: PolicySettings, memory: PolicyMemory, now: float) -> bool:
    """Whether this tick is a periodic round."""
    interval = settings.periodic_interval
    return interval > 0 and now - memory.last_periodic >= interval


def needs_status(
    settings: PolicySettings, is_periodic_round: bool, has_job: bool, automatic: bool
) -> bool:
    """Whether any policy could act on a kernel this tick (else its status is not read)."""
    if has_job:
        return False
    return settings.idle_suspend_after > 0 or (
        automatic and (is_periodic_round or settings.long_cell_seconds > 0)
    )


def _running(status: KernelStatus | None) -> bool:
    """A snapshot kernel whose process runs (not suspended, restoring or dead)."""
    return status is not None and status["state"] == "running"


def holds_gpu(status: KernelStatus) -> bool:
    """Whether a kernel holds GPU memory: by NVML's count, or (without NVML) because its
    processes use CUDA at all."""
    gpu = status["gpu"] or {}
    if gpu.get("bytes") is None:
        return bool(gpu.get("processes"))
    return bool(gpu.get("bytes"))


def periodic_due(kernel: Kernel) -> bool:
    """In a periodic round: the kernel ran a cell since its last snapshot."""
    status = kernel.status
    return status is not None and _running(status) and status["executions_since_snapshot"] > 0


def long_cell_due(kernel: Kernel, settings: PolicySettings, last: float | None, now: float) -> bool:
    """The kernel's longest cell since its last snapshot reached the threshold, and its
    previous long-cell snapshot (started at ``last``) is old enough."""
    status = kernel.status
    if settings.long_cell_seconds <= 0 or status is None or not _running(status):
        return False
    if float(status["longest_cell_since_snapshot"] or 0) < settings.long_cell_seconds:
        return False
    return last is None or now - last >= settings.long_cell_min_interval


def idle_suspend_due(kernel: Kernel, settings: PolicySettings, wall_now: float) -> bool:
    """The kernel is idle for ``idle_suspend_after`` seconds (by the wall clock, as its
    wrapper records activity) and holds GPU memory, unless CPU kernels are suspended too."""
    status = kernel.status
    if settings.idle_suspend_after <= 0 or status is None or not _running(status):
        return False
    if status["execution_state"] != "idle":
        return False
    if wall_now - float(status["last_activity"]) < settings.idle_suspend_after:
        return False
    return settings.suspend_cpu_kernels or holds_gpu(status)


def decide(
    kernels: Iterable[Kernel],
    settings: PolicySettings,
    memory: PolicyMemory,
    now: float,
    wall_now: float,
) -> Plan:
    """What one tick starts: at most one decision per kernel, the first policy that
    applies (see the module's docstring). ``now`` is monotonic, ``wall_now`` the wall
    clock (the wrapper's ``last_activity`` is one)."""
    is_round = periodic_round(settings, memory, now)
    decisions: list[Decision] = []
    for kernel in kernels:
        if kernel.has_job:
            continue
        trigger: Trigger | None = None
        if kernel.automatic and is_round and periodic_due(kernel):
            trigger = "periodic"
        elif kernel.automatic and long_cell_due(
            kernel, settings, memory.last_long_cell.get(kernel.kernel_id), now
        ):
            trigger = "long-cell"
        elif idle_suspend_due(kernel, settings, wall_now):
            trigger = "idle-suspend"
        # The next policy goes here, one more branch: whether a snapshot may be
        # incremental (a field of Decision that the dump reads).
        if trigger is not None:
            decisions.append(Decision(kernel.kernel_id, trigger))
    return Plan(decisions, is_round)


def culled(kernel: Kernel, by: EndedBy = "culler") -> EndAction:
    """What a shutdown of the kernel that its user did not ask for becomes, when it is to
    keep the kernel's state (``cull_action`` or ``admin_shutdown_action`` "suspend").

    The culler (which comes back every ``cull_interval``) leaves a kernel alone while one
    of this server's jobs or its wrapper works on it, and once it is suspended. Someone
    else's shutdown leaves a suspended kernel as it is (saved and freed already) and
    suspends one a job works on once the job is done; a kernel starting or restoring has
    nothing to keep yet that its snapshot does not hold: it is shut down."""
    status = kernel.status
    if by == "culler" and (
        kernel.has_job or (status is not None and status["state"] in LEFT_ALONE)
    ):
        return "leave"
    if status is None:
        return "shutdown"  # not a snapshot kernel, or its wrapper is gone
    if status["state"] == "suspended":
        return "leave"
    if status["state"] not in ("running", "snapshotting"):
        return "shutdown"
    return "snapshot" if status["execution_state"] == "busy" else "suspend"
