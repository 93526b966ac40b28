"""Same-machine restore from the local image cache vs bare ``criu restore`` of the same images.

A real ``jupyter server`` with the extension (local store, image cache on) runs a snapshot
kernel holding ``--mib`` MiB of random floats; one snapshot of it is taken through the
REST API, so its images sit in the image cache. Then, ``--repeat`` times, interleaved:

- *in place*: the kernel is restarted (as jupyter_server does after a crash: a fresh,
  empty kernel) and the snapshot restored into it, POST until the job is done, and until
  the first output of a cell (``print('ok')``) run on it through the kernel's websocket
  (the fresh kernel is saved first: a restore in place never loses the kernel it
  replaces); then the kernel checks its memory (``x.sum() == s``, not timed);
- *new kernel*: the snapshot restored into a new kernel (server restarted, notebook
  reopened), POST until done and until first output;
- *bare*: ``criu restore`` of the very same image directory with the options and
  inherited fds our wrapper gives it (the ceiling: no server, no wrapper, no checks);
- *store*: the cache entry removed first, so the restore (new kernel) downloads from the
  local store, as every restore did before the cache (and caches it again).

The server restores eagerly, as bare CRIU does; ``--lazy`` turns its lazy restore on.

Goal (issue 16): a restore served from the cache within 1.3x of the bare restore.

    nice -n 10 .venv/bin/python bench/bench_cache.py --mib 600 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import QUIET, Server, extension_config

from jupyter_ext.core.criu import Criu
from jupyter_ext.core.humanize import human_bytes
from jupyter_ext.core.isolation import mountns
from jupyter_ext.core.manifest import IMAGES_DIR, Manifest

STATE = "import numpy as np; x = np.random.default_rng(1).random({mib} * 131072); s = x.sum()"


def bare_restore(criu: Criu, snapshot_dir: Path) -> float:
    """``criu restore`` of the snapshot's images with our wrapper's options and inherited
    fds (a pipe for its output, a directory for its channels) and mounts (the kernel's
    mount namespace, core/isolation/mountns.py); the restored tree is
    killed afterwards. Returns the seconds CRIU ran."""
    manifest = Manifest.read(snapshot_dir)
    work = Path(tempfile.mkdtemp(prefix="bare-restore-"))
    channels = Path(tempfile.mkdtemp(prefix="bare-channels-"))
    read_end, write_end = os.pipe()
    dir_fd = os.open(channels, os.O_RDONLY | os.O_DIRECTORY)
    pidfile = work / "restored.pid"
    args = [str(criu.path), "restore", "-D", str(snapshot_dir / IMAGES_DIR), "-W", str(work)]
    args += ["-o", "restore.log", "-v4", "--file-locks", "--restore-detached"]
    args += ["--restore-sibling", "--tcp-close", "--pidfile", str(pidfile)]
    args += ["--inherit-fd", f"fd[{write_end}]:{manifest.stdio_pipe}"]
    args += ["--inherit-fd", f"fd[{dir_fd}]:{manifest.runtime_dir_key}"]
    args += mountns.restore_options(manifest.mounts, work / "no-mount")[0]
    try:
        started = time.monotonic()
        subprocess.run(args, check=True, pass_fds=(write_end, dir_fd), stdin=subprocess.DEVNULL)
        seconds = time.monotonic() - started
        pid = int(pidfile.read_text())
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return seconds
    finally:
        for fd in (read_end, write_end, dir_fd):
            os.close(fd)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(channels, ignore_errors=True)


def restored(server: Server, snapshot_id: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """POST a restore: seconds until the job is done ("done"), until the first output of
    a cell run then ("output"), and after the POST at which each phase was first seen;
    and the restored kernel, which must hold its memory (not timed)."""
    started = time.monotonic()
    run = server.run_job(f"api/snapshots/{snapshot_id}/restore", body, interval=0.005)
    kernel_id = body.get("kernel_id") or run.result["kernel_id"]
    sent = time.monotonic()
    cell = server.execute(kernel_id, "print('ok')")
    assert cell["out"].strip() == "ok", cell
    output = sent - started + cell["first_output"]
    assert server.execute(kernel_id, "print(x.sum() == s)")["out"].strip() == "True"
    times = {"done": run.seconds, "output": output, "source": run.result["source"]}
    return {**times, **run.first_seen}, kernel_id


def restore_in_place(server: Server, kernel_id: str, snapshot_id: str) -> dict[str, Any]:
    """The kernel restarted (what jupyter_server does after a crash: a fresh, empty
    kernel), then the snapshot restored into it (its fresh state is saved first)."""
    server.api("POST", f"api/kernels/{kernel_id}/restart", {})
    while server.api("GET", f"api/snapshots/kernels/{kernel_id}").get("state") != "running":
        time.sleep(0.05)
    server.execute(kernel_id, "print(1)")
    return restored(server, snapshot_id, {"kernel_id": kernel_id})[0]


def restore_new(server: Server, snapshot_id: str) -> dict[str, Any]:
    result, kernel_id = restored(server, snapshot_id, {})
    server.api("DELETE", f"api/kernels/{kernel_id}")
    return result


def bench_cache(mib: int, repeat: int, home: Path, lazy: bool = False) -> dict[str, Any]:
    """Restores from the image cache against bare ``criu restore`` of the same images:
    every run and the medians (seconds). ``lazy``: the server restores with lazy pages."""
    criu = Criu.locate()
    # CRIU restores the whole memory before the kernel runs, as bare CRIU does.
    config = extension_config(
        home / "work", local_store_dir=str(home / "store"), lazy_restore=lazy, **QUIET
    )
    server = Server(home / "server", home / "notebooks", config)
    try:
        kernel_id = server.start_kernel()
        server.execute(kernel_id, STATE.format(mib=mib) + "; print('ready')")
        snap = server.run_job("api/snapshots", {"kernel_id": kernel_id}).job
        snapshot_id = snap["result"]["id"]
        entry = home / "work" / "image-cache" / snapshot_id
        assert entry.is_dir(), "the snapshot is not in the image cache"
        runs: dict[str, list[Any]] = {"in_place": [], "new_kernel": [], "bare": [], "store": []}
        for i in range(repeat):
            order = ["in_place", "new_kernel", "bare", "store"]
            for kind in order[i % 4 :] + order[: i % 4]:
                if kind == "bare":
                    runs["bare"].append(bare_restore(criu, entry))
                elif kind == "in_place":
                    runs["in_place"].append(restore_in_place(server, kernel_id, snapshot_id))
                elif kind == "store":  # the entry gone: downloaded (and cached again)
                    shutil.rmtree(entry)
                    runs["store"].append(restore_new(server, snapshot_id))
                    assert entry.is_dir(), "the download was not cached"
                else:
                    runs["new_kernel"].append(restore_new(server, snapshot_id))
        sources = {r["source"] for kind in ("in_place", "new_kernel") for r in runs[kind]}
        assert sources == {"cache"}, sources
        assert {r["source"] for r in runs["store"]} == {"store"}
        bare = statistics.median(runs["bare"])
        result: dict[str, Any] = {
            "mib": mib,
            "image_bytes": snap["result"]["total_bytes"],
            "criu": criu.version_text,
            "cpus": os.cpu_count(),
            "repeat": repeat,
            "lazy_restore": lazy,
            "bare_restore": bare,
            "runs": runs,
        }
        for kind in ("in_place", "new_kernel", "store"):
            for what in ("done", "output"):
                values = [r[what] for r in runs[kind]]
                result[f"{kind}_{what}"] = statistics.median(values)
                result[f"{kind}_{what}_ratio"] = statistics.median(values) / bare
                # Ours against the bare restore of the same round (the machine is shared).
                paired = [v / b for v, b in zip(values, runs["bare"], strict=True)]
                result[f"{kind}_{what}_paired"] = statistics.median(paired)
        return result
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=600)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write every run here")
    parser.add_argument("--lazy", action="store_true", help="the server restores lazily")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    try:
        result = bench_cache(args.mib, args.repeat, home, args.lazy)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    print(
        f"{result['criu']}, {result['cpus']} CPUs, {args.mib} MiB kernel "
        f"({human_bytes(result['image_bytes'])} of images), median of {args.repeat} runs, "
        f"lazy restore {'on' if args.lazy else 'off'}"
    )
    print(f"{'bare criu restore:':<48}{result['bare_restore']:.3f} s")
    kinds = [("in_place", "cache, in place after a restart"), ("new_kernel", "cache, new kernel")]
    for kind, label in [*kinds, ("store", "store (local), new kernel")]:
        for what, words in (("done", "job done"), ("output", "first output")):
            value, ratio = result[f"{kind}_{what}"], result[f"{kind}_{what}_ratio"]
            paired = result[f"{kind}_{what}_paired"]
            print(
                f"{label + ', ' + words + ':':<48}{value:.3f} s  ({ratio:.2f}x bare; "
                f"{paired:.2f}x in each round)"
            )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
