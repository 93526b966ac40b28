"""The kernel's freeze through the node agent (agent mode) beside CRIU run in the pod
(in-pod mode), side by side in one run (issue 35).

A stand-in pod (testkit/agentpods.py: a container's cgroup, its own UTS, PID and mount
namespaces, user nobody) runs a process holding ``--mib`` MiB of random bytes. Interleaved,
in alternating order, ``--repeat`` times, each after ``sync`` and dropping the page cache:
a dump with ``--leave-running`` through the node agent on this machine (the pod's client,
``python -m testkit.agentpods client``: the agent's CRIU in the pod's namespaces, the
images then copied to the pod's directory) and the same dump as in-pod mode does it (this
package's ``Criu`` in the pod, as its user, on the CRIU copy with file capabilities).
Reported: CRIU's own frozen time (its log) and the whole dump call, medians and the
ratios agent / in-pod. Run as root from the repository root:

    sudo .venv/bin/python bench/bench_agent.py --mib 256,1024 --repeat 7
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import ROOT

from testkit.agentpods import FakePod, RunningAgent, cgroup_root

assert ROOT.is_dir()  # harness put the repository on sys.path

#: The "kernel": ``MIB`` MiB of random bytes, kept until it is killed.
HOLDER = (
    "import os, sys, time\n"
    "os.setsid()\n"
    "data = [os.urandom(1 << 20) for _ in range(int(sys.argv[1]))]\n"
    "open(sys.argv[2], 'w').write('ready')\n"
    "while True:\n"
    "    time.sleep(1)\n"
)


#: In-pod mode's dump: the product's Criu, run in the pod by its user (nobody here) on the
#: CRIU copy with file capabilities (docs/nonroot.md; its group may run it).
DIRECT = (
    "import asyncio, json, sys, time\n"
    "from pathlib import Path\n"
    "from jupyter_ext.core.criu import Criu\n"
    "criu = Criu.locate(sys.argv[1])\n"
    "images = Path(sys.argv[3])\n"
    "images.mkdir()\n"
    "started = time.monotonic()\n"
    "frozen = asyncio.run(criu.dump(int(sys.argv[2]), images, images, leave_running=True))\n"
    "print(json.dumps({'frozen_seconds': frozen, 'seconds': time.monotonic() - started}))\n"
)
#: The CRIU copy with file capabilities (scripts/install-criu.sh).
CAPPED_CRIU = Path("/opt/jupyter-kernel-snapshots/criu/bin/criu")


def _drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _agent_dump(pod: FakePod, agent: RunningAgent, pid: int, images: Path) -> dict[str, float]:
    answer = pod.client(str(agent.socket), "dump", str(pid), str(images))
    if answer["ok"] is not True:
        raise RuntimeError(f"the agent's dump failed: {answer}")
    return {"frozen": float(str(answer["frozen_seconds"])), "call": float(str(answer["seconds"]))}


def _direct_dump(pod: FakePod, pid: int, images: Path) -> dict[str, float]:
    group = CAPPED_CRIU.stat().st_gid
    command = [sys.executable, "-c", DIRECT, str(CAPPED_CRIU), str(pid), str(images)]
    answer = pod.run_json(command, groups=[group])
    return {"frozen": float(str(answer["frozen_seconds"])), "call": float(str(answer["seconds"]))}


def run(mib: int, repeat: int, top: Path, agent: RunningAgent, group: Path) -> dict[str, Any]:
    pod = FakePod("jupyter-bench", group)
    try:
        shared = top / f"pod-{mib}"
        shared.mkdir(mode=0o777)
        shared.chmod(0o777)
        ready = shared / "ready"
        pid = pod.start([sys.executable, "-c", HOLDER, str(mib), str(ready)])
        deadline = time.monotonic() + 120
        while not ready.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the holder did not start")
            time.sleep(0.05)
        runs: dict[str, list[dict[str, float]]] = {"agent": [], "direct": []}
        for index in range(repeat):
            order = ["agent", "direct"] if index % 2 == 0 else ["direct", "agent"]
            for way in order:
                images = shared / f"images-{way}"
                shutil.rmtree(images, ignore_errors=True)
                _drop_caches()
                if way == "agent":
                    runs[way].append(_agent_dump(pod, agent, pid, images))
                else:
                    runs[way].append(_direct_dump(pod, pid, images))
                shutil.rmtree(images, ignore_errors=True)
        medians = {
            way: {key: statistics.median(r[key] for r in rs) for key in ("frozen", "call")}
            for way, rs in runs.items()
        }
        return {
            "mib": mib,
            "repeat": repeat,
            "median": medians,
            "ratio_frozen": medians["agent"]["frozen"] / medians["direct"]["frozen"],
            "ratio_call": medians["agent"]["call"] / medians["direct"]["call"],
            "runs": runs,
        }
    finally:
        pod.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", default="256,1024", help="sizes, comma-separated")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", type=Path, help="every run besides the medians")
    args = parser.parse_args()
    top = Path(f"/tmp/jks-bench-agent-{secrets.token_hex(4)}")
    top.mkdir(mode=0o755)
    group = cgroup_root() / f"jks-bench-agent-{secrets.token_hex(4)}"
    group.mkdir()
    agent = RunningAgent(top)
    results = []
    try:
        for mib in (int(m) for m in args.mib.split(",")):
            result = run(mib, args.repeat, top, agent, group)
            results.append(result)
            med = result["median"]
            print(
                f"{mib} MiB: frozen agent {med['agent']['frozen']:.3f} s, direct "
                f"{med['direct']['frozen']:.3f} s (x{result['ratio_frozen']:.2f}); dump call "
                f"agent {med['agent']['call']:.3f} s, direct {med['direct']['call']:.3f} s "
                f"(x{result['ratio_call']:.2f})",
                flush=True,
            )
    finally:
        agent.close()
        group.rmdir()
        shutil.rmtree(top, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
