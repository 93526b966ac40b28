"""The real GPU check: a PyTorch kernel on an NVIDIA GPU, snapshotted, killed, restored.

Run on a machine with an NVIDIA GPU (driver >= 570), PyTorch, CRIU >= 4.2 and this
package's dependencies importable (see bench/README.md for the device recipe):

    python bench/gpu_check.py [--gib 10] [--json results.json]

It starts a snapshot kernel that holds ``--gib`` GiB of CUDA tensors and a small model
mid-training, records checksums, snapshots it (CUDA lock -> checkpoint -> CRIU dump ->
restore -> unlock; PyTorch's 1 GiB of cached, unused blocks must be released first and
not saved), kills it with kill -9, restores it into a new wrapper, and lets the
restored kernel compare its tensors bit for bit and continue training. Then it suspends
the kernel (NVML must show the GPU memory freed) and resumes it with the next cell.
Then cell checkpoints (docs/undo.md: off for GPU kernels in "auto", here "on"): what the
checkpoint after a cell that changed one block costs (its GPU part a full copy), and undo
of that cell until a cell runs, the block as it was. It prints timings and throughputs
and exits non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jupyter_ext.core import proctree
from jupyter_ext.core.gpu import gpu_inventory, process_gpu_memory
from jupyter_ext.core.humanize import human_bytes, human_seconds
from jupyter_ext.core.protocol.environment import ENV_CELL_CHECKPOINTS
from testkit.processes import KernelProcess, wait_until

SETUP = """
import torch, time
torch.manual_seed(0)
assert torch.cuda.is_available(), "no CUDA in the kernel"
GIB = {gib}
blocks = [torch.randn(256 * 1024 * 1024, device="cuda") for _ in range(GIB)]  # 1 GiB each
def fingerprint(t):
    v = t.view(torch.int32).to(torch.int64)
    w = torch.arange(v.numel(), device=v.device, dtype=torch.int64) % 65521 + 1
    return (int(v.sum()), int((v * w).sum()), int(v[::4097].sum()))
fingerprints = [fingerprint(b) for b in blocks]
layers = [torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1)]
model = torch.nn.Sequential(*layers).cuda()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
data = torch.randn(4096, 512, device="cuda"); target = data[:, :1] * 3.0
def train(steps):
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(data), target)
        loss.backward(); optimizer.step()
    return float(loss)
loss_before = train(50)
scratch = torch.empty(256 * 1024 * 1024, device="cuda"); del scratch  # 1 GiB cached, unused
torch.cuda.synchronize()
print(GIB, loss_before)
"""

CHECK = """
ok = all(fingerprint(b) == f for b, f in zip(blocks, fingerprints))
loss_after = train(50)
print(ok, loss_after < loss_before, loss_after)
"""

CHANGE = (
    "blocks[0].mul_(1.5); torch.cuda.synchronize()\n"
    "print(fingerprint(blocks[0]) != fingerprints[0])"
)


def checkpoints_settled(kernel: KernelProcess, count: int) -> list[dict[str, Any]]:
    """The kernel's cell checkpoints once ``count`` are taken, none is under way and every
    cell run has one."""
    found: dict[str, Any] = {}

    def done() -> bool:
        nonlocal found
        found = kernel.control.request_sync("checkpoints", timeout=60)
        if found["skipped"]:
            raise RuntimeError(f"cell checkpoint skipped: {found['skipped']['reason']}")
        if found["taking"] or found["cells_since"]:
            return False
        return len(found["checkpoints"]) >= count

    wait_until(done, timeout=1200, what=f"{count} cell checkpoints")
    checkpoints: list[dict[str, Any]] = found["checkpoints"]
    return checkpoints


def cell_checkpoints(work: Path, gib: int, results: dict[str, Any]) -> None:
    """A GPU kernel with cell checkpoints on: the checkpoint after a cell that changed one
    block, and undo of that cell until a cell runs (the block as it was)."""
    settings = {"mode": "on", "root": str(work / "checkpoints")}
    kernel = KernelProcess(work / "kernels", env={ENV_CELL_CHECKPOINTS: json.dumps(settings)})
    try:
        kernel.execute(SETUP.format(gib=gib), timeout=600)
        before = len(checkpoints_settled(kernel, 1))
        changed = kernel.execute(CHANGE, timeout=600).strip() == "True"
        after = checkpoints_settled(kernel, before + 1)[-1]
        memory = after.get("memory") or {}
        results["cell_checkpoint"] = {
            "pause_seconds": after["pause_seconds"],
            "own_bytes": after["own_bytes"],
            "total_bytes": after["total_bytes"],
            "host_memory_mode": memory.get("mode"),
        }
        t0 = time.monotonic()
        undone = kernel.control.request_sync("undo", timeout=1200)
        out = kernel.execute("print(fingerprint(blocks[0]) == fingerprints[0])", timeout=600)
        results["cell_checkpoint"]["undo_seconds"] = undone["seconds"]
        results["cell_checkpoint"]["undo_to_output_seconds"] = time.monotonic() - t0
        results["checks"]["undo_restores_gpu_memory"] = changed and out.strip() == "True"
    finally:
        kernel.kill_all()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    inventory = gpu_inventory()
    if not inventory.get("available"):
        print(f"no usable NVIDIA GPU: {inventory.get('reason')}")
        return 2
    results: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "gpu": [g.get("name") for g in inventory.get("gpus", [])],
        "driver": inventory.get("driver_version"),
        "kernel_release": platform.release(),
        "gib": args.gib,
        "checks": {},
    }
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        kernel = KernelProcess(work / "kernels")
        t0 = time.monotonic()
        out = kernel.execute(SETUP.format(gib=args.gib), timeout=600)
        results["setup_seconds"] = time.monotonic() - t0
        inner = kernel.status()["inner_pid"]
        held = sum(process_gpu_memory(proctree.descendants(inner)).values())
        results["gpu_bytes_held"] = held
        print(f"kernel holds {human_bytes(held)} on the GPU ({out.strip()})")

        t0 = time.monotonic()
        manifest = kernel.snapshot(work / "snap")
        results["snapshot_seconds"] = time.monotonic() - t0
        timings = manifest["gpu"]["checkpoint"]["timings"]
        per_pid = next(iter(timings.values()))
        released = manifest["gpu"].get("released_caches", {})
        results["torch_cache_released_bytes"] = released.get("released", {}).get("torch", 0)
        results["checks"]["torch_cache_released"] = results[
            "torch_cache_released_bytes"
        ] >= 2**30 and not released.get("errors")
        # What the checkpoint moved: the memory left after the release (NVML, per process).
        checkpointed = int(manifest["gpu"].get("needed_bytes") or held)
        results["gpu_bytes_checkpointed"] = checkpointed
        results["lock_seconds"] = per_pid["lock_s"]
        results["checkpoint_seconds"] = per_pid["checkpoint_s"]
        results["dump_seconds"] = manifest["dump_seconds"]
        results["image_bytes"] = manifest["total_bytes"]
        results["gpu_to_host_gb_s"] = checkpointed / per_pid["checkpoint_s"] / 1e9
        kernel.kill_all()

        t0 = time.monotonic()
        restored = KernelProcess(work / "kernels", restore_from=work / "snap")
        results["restore_seconds"] = time.monotonic() - t0
        status = restored.status()
        check = restored.execute(CHECK, timeout=600).split()
        results["checks"]["tensors_bit_exact"] = check[0] == "True"
        results["checks"]["training_continues"] = check[1] == "True"
        # A second restore, in place through the control socket, reports the CUDA steps.
        restored.kill_inner()
        t0 = time.monotonic()
        answer = restored.restore(work / "snap")
        results["restore_in_place_seconds"] = time.monotonic() - t0
        cuda_restore = next(iter(answer["gpu"]["timings"].values()))
        results["cuda_restore_seconds"] = cuda_restore["restore_s"]
        results["cuda_unlock_seconds"] = cuda_restore["unlock_s"]
        results["host_to_gpu_gb_s"] = checkpointed / cuda_restore["restore_s"] / 1e9

        inner = restored.status()["inner_pid"]
        restored.control.request_sync("suspend", {"dest": str(work / "suspended")}, timeout=600)
        freed = process_gpu_memory([inner])
        results["checks"]["suspend_frees_gpu"] = not freed or sum(freed.values()) == 0
        t0 = time.monotonic()
        again = restored.execute("print(fingerprint(blocks[0]) == fingerprints[0])", timeout=600)
        results["resume_seconds"] = time.monotonic() - t0
        results["checks"]["resume_works"] = again.strip() == "True"
        results["restored_state"] = status["state"]
        restored.kill_all()
        cell_checkpoints(work, args.gib, results)

    for name, ok in results["checks"].items():
        print(f"[{'ok' if ok else 'FAIL'}] {name}")
        if not ok:
            failures.append(name)
    print(
        f"\nGPU {results['gpu']} driver {results['driver']}: {human_bytes(held)} of CUDA memory, "
        f"{human_bytes(results['torch_cache_released_bytes'])} of PyTorch cache released, "
        f"{human_bytes(results['gpu_bytes_checkpointed'])} checkpointed\n"
        f"lock {human_seconds(results['lock_seconds'])}, checkpoint "
        f"{human_seconds(results['checkpoint_seconds'])} "
        f"({results['gpu_to_host_gb_s']:.1f} GB/s GPU->host; goal >= 25), "
        f"CRIU dump {human_seconds(results['dump_seconds'])}, "
        f"image {human_bytes(results['image_bytes'])}\n"
        f"restore into a new wrapper {human_seconds(results['restore_seconds'])}, in place "
        f"{human_seconds(results['restore_in_place_seconds'])}, of which CUDA restore "
        f"{human_seconds(results['cuda_restore_seconds'])} "
        f"({results['host_to_gpu_gb_s']:.1f} GB/s host->GPU), "
        f"resume after suspend {human_seconds(results['resume_seconds'])}\n"
        f"cell checkpoint after a cell that changed 1 GiB of CUDA memory: paused "
        f"{human_seconds(results['cell_checkpoint']['pause_seconds'])}, "
        f"{human_bytes(results['cell_checkpoint']['own_bytes'])} written; undo until a cell "
        f"ran {human_seconds(results['cell_checkpoint']['undo_to_output_seconds'])}"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
