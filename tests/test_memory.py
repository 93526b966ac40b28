"""The server process's malloc tuning (jupyter_ext/memory.py), each in a fresh Python: what
glibc gives back to the system after a burst of chunk-sized buffers (the soak benchmark,
bench/bench_soak.py, measures the whole server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jupyter_ext import memory
from jupyter_ext.core.protocol.environment import ENV_TUNING

BURST = """
import json
from pathlib import Path
from jupyter_ext import memory

def rss():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10

memory.tune()
# 160 MiB of 64 KiB buffers (sealed chunks, below the mmap threshold) with small buffers
# that outlive them in between (a record's, a job's): their heap cannot shrink from the top.
burst, kept = [], []
for _ in range(2560):
    burst.append(bytearray(65536))
    kept.append(bytearray(600))
loaded = rss()
del burst
freed = rss()
memory.give_back()
print(json.dumps({"loaded": loaded, "freed": freed, "given_back": rss()}))
"""

MIB = 1 << 20


def burst(tuning: str | None) -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    if tuning is not None:
        env[ENV_TUNING] = tuning
    done = subprocess.run(
        [sys.executable, "-c", BURST], env=env, capture_output=True, text=True, check=True
    )
    return dict(json.loads(done.stdout))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_the_free_space_a_burst_leaves_in_the_heap_goes_back_to_the_system() -> None:
    """Freed, the burst's buffers stay in the heap (RSS counts them) until ``give_back``
    returns their pages; with the tuning off (the soak benchmark's baseline) they stay."""
    ours = burst(None)
    assert ours["freed"] > ours["loaded"] - 20 * MIB  # glibc alone keeps them
    assert ours["given_back"] < ours["freed"] - 120 * MIB
    baseline = burst("0")
    assert baseline["given_back"] > baseline["freed"] - 20 * MIB


SMALL_OBJECTS = """
import gc, json
from pathlib import Path
from jupyter_ext import memory

def rss():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10

memory.tune()
# A job's worth of small objects (a manifest parsed: dicts, strings, lists), a few of
# which outlive it (a job's record, a cached entry): one in 2,000, spread through it all.
burst, kept = [], []
for i in range(400_000):
    item = {"path": f"images/pages-{i}.img", "size": i, "chunks": [i, i + 1]}
    burst.append(item)
    if i % 2000 == 0:
        kept.append({"kept": i})
before = rss()
del burst, item
gc.collect()
memory.give_back()
print(json.dumps({"grown": before, "after": rss()}))
"""


def small_objects(allocator: str) -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "PYTHON"))}
    env["PYTHONMALLOC"] = allocator
    done = subprocess.run(
        [sys.executable, "-c", SMALL_OBJECTS],
        env={**env, "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(json.loads(done.stdout))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_small_objects_a_job_freed_go_back_from_malloc_not_from_pymalloc() -> None:
    """Why the product's launchers start the server with PYTHONMALLOC=malloc: a few small
    objects that outlive a burst keep pymalloc's arenas (and the memory of everything
    else in them); from malloc, the freed memory goes back to the system."""
    pymalloc = small_objects("pymalloc")
    malloc = small_objects("malloc")
    kept_by_pymalloc = pymalloc["after"]
    kept_by_malloc = malloc["after"]
    assert pymalloc["grown"] - kept_by_pymalloc < 20 * MIB, pymalloc  # little went back
    assert malloc["grown"] - kept_by_malloc > 40 * MIB, malloc  # most of it went back
    assert kept_by_malloc < kept_by_pymalloc - 40 * MIB, (malloc, pymalloc)


def test_the_servers_allocator_is_not_passed_on_to_its_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PYTHONMALLOC=malloc, as the launchers set it for the server, is taken out of the
    environment that the kernels it starts inherit; another value is the admin's own."""
    monkeypatch.delenv(ENV_TUNING, raising=False)
    monkeypatch.setenv("PYTHONMALLOC", "malloc")
    memory.tune()
    assert "PYTHONMALLOC" not in os.environ
    monkeypatch.setenv("PYTHONMALLOC", "debug")
    memory.tune()
    assert os.environ["PYTHONMALLOC"] == "debug"
