"""The snapshot policies' decisions (jupyter_ext/core/policies/tick.py), on kernel statuses as
the wrapper answers them: no kernels, no sleeps, the times given. One policy tick against
real kernels, and the policies end to end: tests/test_policies.py; culled kernels end to
end: tests/test_culling.py."""

from __future__ import annotations

from typing import Any

from jupyter_ext.core.policies.tick import (
    Decision,
    Kernel,
    PolicyMemory,
    PolicySettings,
    culled,
    decide,
    needs_status,
)
from jupyter_ext.core.protocol.control import KernelStatus

NOW = 10_000.0
"""Monotonic seconds of the tick."""
WALL = 1_800_000_000.0
"""The wall clock of the tick (the wrappers' ``last_activity`` is one)."""


def status(**changes: Any) -> KernelStatus:
    """A running, idle kernel's status, 10 s after its last activity, with one cell run
    (a second long) since its last snapshot and no GPU."""
    base: KernelStatus = {
        "gpu": {"processes": 0, "bytes": 0, "utilization": 0},
        "state": "running",
        "inner_pid": 1234,
        "wrapper_pid": 1233,
        "lineage": "l" * 16,
        "runtime_dir": "/run/jupyter-kernel-snapshots/k",
        "execution_state": "idle",
        "last_activity": WALL - 10,
        "executions_since_snapshot": 1,
        "longest_cell_since_snapshot": 1.0,
        "sequence": 0,
        "busy": False,
        "resumed_request": None,
        "running_request": None,
        "lazy_restore": {},
        "closed_on_restore": [],
        "own_network": False,
        "private_temp": None,
    }
    return {**base, **changes}  # type: ignore[typeddict-item]


def kernel(kernel_id: str = "k1", **changes: Any) -> Kernel:
    return Kernel(kernel_id, status(**changes))


def triggers(
    kernels: list[Kernel], settings: PolicySettings, memory: PolicyMemory | None = None
) -> list[tuple[str, str]]:
    memory = memory or PolicyMemory(last_periodic=NOW)
    return [
        (d.kernel_id, d.trigger) for d in decide(kernels, settings, memory, NOW, WALL).decisions
    ]


GPU = {"processes": 1, "bytes": 2**30, "utilization": 0}


def test_periodic_decisions() -> None:
    on = PolicySettings(periodic_interval=60)
    due = PolicyMemory(last_periodic=NOW - 60)
    assert triggers([kernel()], on, due) == [("k1", "periodic")]
    assert triggers([kernel()], on, PolicyMemory(last_periodic=NOW - 59)) == []  # too soon
    assert triggers([kernel()], PolicySettings(), due) == []  # off
    assert triggers([kernel(executions_since_snapshot=0)], on, due) == []  # nothing ran
    assert triggers([kernel(state="suspended")], on, due) == []
    assert triggers([Kernel("k1", None)], on, due) == []  # not a snapshot kernel
    assert triggers([Kernel("k1", status(), has_job=True)], on, due) == []
    assert triggers([Kernel("k1", status(), automatic=False)], on, due) == []  # opted out
    # A round is a round for every kernel, and is remembered by the tick.
    plan = decide([kernel("a"), kernel("b")], on, due, NOW, WALL)
    assert plan.periodic_round
    assert [d.kernel_id for d in plan.decisions] == ["a", "b"]
    assert not decide([kernel()], on, PolicyMemory(NOW - 1), NOW, WALL).periodic_round


def test_long_cell_decisions() -> None:
    on = PolicySettings(long_cell_seconds=60, long_cell_min_interval=300)
    long = kernel(longest_cell_since_snapshot=61.0)
    assert triggers([long], on) == [("k1", "long-cell")]
    assert triggers([long], PolicySettings(long_cell_min_interval=300)) == []  # off
    assert triggers([kernel(longest_cell_since_snapshot=59.0)], on) == []  # too short
    too_soon = PolicyMemory(last_periodic=NOW, last_long_cell={"k1": NOW - 200})
    assert triggers([long], on, too_soon) == []
    long_ago = PolicyMemory(last_periodic=NOW, last_long_cell={"k1": NOW - 300})
    assert triggers([long], on, long_ago) == [("k1", "long-cell")]
    assert triggers([kernel(state="suspended", longest_cell_since_snapshot=61.0)], on) == []
    assert triggers([Kernel("k1", None)], on) == []
    assert triggers([Kernel("k1", long.status, has_job=True)], on) == []
    opted_out = Kernel("k1", status(longest_cell_since_snapshot=61.0), automatic=False)
    assert triggers([opted_out], on) == []  # the panel's switch: no automatic snapshots


def test_long_cell_memory() -> None:
    memory = PolicyMemory(last_periodic=NOW)
    memory.started(Decision("k1", "long-cell"), NOW)
    memory.started(Decision("k2", "periodic"), NOW)  # only long-cell snapshots are paced
    assert memory.last_long_cell == {"k1": NOW}
    memory.forget_others(["k2"])  # k1 went away
    assert memory.last_long_cell == {}


def test_idle_suspend_decisions() -> None:
    on = PolicySettings(idle_suspend_after=60)
    idle_gpu = {"gpu": GPU, "last_activity": WALL - 61}
    assert triggers([kernel(**idle_gpu)], on) == [("k1", "idle-suspend")]
    assert decide([kernel(**idle_gpu)], on, PolicyMemory(NOW), NOW, WALL).decisions[0].suspends
    assert triggers([kernel(**idle_gpu)], PolicySettings()) == []  # off
    assert triggers([kernel(gpu=GPU, last_activity=WALL - 59)], on) == []  # not idle long
    assert triggers([kernel(**idle_gpu, execution_state="busy")], on) == []  # a cell runs
    assert triggers([kernel(**idle_gpu, state="suspended")], on) == []
    assert triggers([Kernel("k1", status(**idle_gpu), has_job=True)], on) == []
    # CPU kernels are left alone, unless suspend_cpu_kernels.
    cpu = kernel("cpu", last_activity=WALL - 61)
    assert triggers([cpu], on) == []
    assert triggers([cpu], PolicySettings(idle_suspend_after=60, suspend_cpu_kernels=True)) == [
        ("cpu", "idle-suspend")
    ]
    # Without NVML (no byte count) a kernel whose processes use CUDA holds the GPU.
    no_nvml = {"processes": 1, "bytes": None, "utilization": None}
    assert triggers([kernel(gpu=no_nvml, last_activity=WALL - 61)], on) == [("k1", "idle-suspend")]
    # The panel's switch is for snapshots that keep the kernel: idle suspend still applies.
    assert triggers([Kernel("k1", status(**idle_gpu), automatic=False)], on) == [
        ("k1", "idle-suspend")
    ]


def test_one_decision_per_kernel_the_first_policy_wins() -> None:
    every = PolicySettings(periodic_interval=60, long_cell_seconds=60, idle_suspend_after=60)
    due = PolicyMemory(last_periodic=NOW - 60)
    all_due = kernel(longest_cell_since_snapshot=61.0, gpu=GPU, last_activity=WALL - 61)
    assert triggers([all_due], every, due) == [("k1", "periodic")]
    assert triggers([all_due], every) == [("k1", "long-cell")]  # no periodic round
    nothing_ran = kernel(executions_since_snapshot=0, gpu=GPU, last_activity=WALL - 61)
    assert triggers([nothing_ran], every, due) == [("k1", "idle-suspend")]


def test_which_statuses_a_tick_reads() -> None:
    """A kernel's status is read only if a policy could act on it; with its GPU accounting
    only if idle suspend of GPU kernels is on."""
    off = PolicySettings()
    assert not needs_status(off, is_periodic_round=False, has_job=False, automatic=True)
    periodic = PolicySettings(periodic_interval=60)
    assert needs_status(periodic, is_periodic_round=True, has_job=False, automatic=True)
    assert not needs_status(periodic, is_periodic_round=False, has_job=False, automatic=True)
    assert not needs_status(periodic, is_periodic_round=True, has_job=True, automatic=True)
    assert not needs_status(periodic, is_periodic_round=True, has_job=False, automatic=False)
    long_cell = PolicySettings(long_cell_seconds=60)
    assert needs_status(long_cell, is_periodic_round=False, has_job=False, automatic=True)
    idle = PolicySettings(idle_suspend_after=60)
    assert needs_status(idle, is_periodic_round=False, has_job=False, automatic=False)
    assert idle.needs_gpu
    assert not PolicySettings(idle_suspend_after=60, suspend_cpu_kernels=True).needs_gpu
    assert not long_cell.needs_gpu
    assert not periodic.needs_gpu


def test_what_the_culler_does_to_a_kernel() -> None:
    """cull_action "suspend": an idle running kernel is suspended, a busy one (cull_busy)
    snapshotted and shut down; a suspended kernel, or one that a job or its wrapper works
    on, is left alone (the culler comes back); anything else just shuts down."""
    assert culled(kernel()) == "suspend"
    assert culled(kernel(execution_state="busy")) == "snapshot"
    for state in ("suspended", "snapshotting", "restoring", "starting"):
        assert culled(kernel(state=state)) == "leave", state
    assert culled(Kernel("k1", status(), has_job=True)) == "leave"
    assert culled(Kernel("k1", None)) == "shutdown"  # not a snapshot kernel
    assert culled(kernel(state="dead")) == "shutdown"
    # Neither the panel's switch nor the GPU changes it.
    assert culled(Kernel("k1", status(), automatic=False)) == "suspend"
    assert culled(kernel(gpu=GPU)) == "suspend"


def test_what_anothers_shutdown_does_to_a_kernel() -> None:
    """admin_shutdown_action "suspend": the request is now, not a pass to come back to. A
    kernel a job works on is suspended after it; a suspended one stays as it is; one
    starting or restoring (its state is its snapshot's) is shut down."""
    assert culled(kernel(), "other") == "suspend"
    assert culled(kernel(execution_state="busy"), "other") == "snapshot"
    assert culled(kernel(state="suspended"), "other") == "leave"
    assert culled(Kernel("k1", status(), has_job=True), "other") == "suspend"
    assert culled(kernel(state="snapshotting"), "other") == "suspend"
    assert culled(kernel(state="snapshotting", execution_state="busy"), "other") == "snapshot"
    for state in ("restoring", "starting", "dead"):
        assert culled(kernel(state=state), "other") == "shutdown", state
    assert culled(Kernel("k1", None), "other") == "shutdown"
