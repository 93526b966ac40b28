"""Kernels without root take process ids that a fresh pod leaves free (core/isolation/pidspace.py).

A "pod" here is a PID namespace with its own /proc, made by root as a container runtime
would; the restore into a fresh pod itself is tests/test_nodes.py's (nodes are pods there).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from jupyter_ext.core.isolation import pidspace

IN_A_FRESH_POD = """
import random
from jupyter_ext.core.isolation import pidspace
before = pidspace.last_pid()
skipped = pidspace.skip_low_pids(500, 100, random.Random(7))
print(before, skipped, pidspace.last_pid())
"""


@pytest.mark.needs_root("a PID namespace of its own stands in for a fresh pod")
def test_a_young_pid_namespace_is_moved_past_the_floor() -> None:
    out = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", IN_A_FRESH_POD],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    before, skipped, after = (int(word) for word in out.split())
    assert before < 50  # a fresh namespace counts from 1
    assert 500 <= after < 600 + 10
    assert skipped == after - before


def test_a_counter_past_the_floor_is_left_alone() -> None:
    now = pidspace.last_pid()
    assert now is not None
    assert pidspace.skip_low_pids(floor=max(now - 1, 1)) == 0
    assert pidspace.skip_low_pids(floor=0) == 0  # turned off
