"""Phases: seconds per named phase, in order, added up when entered again, kept when the
phase raises."""

from __future__ import annotations

import pytest

from jupyter_ext.core.phases import Phases


def test_phases_add_up_in_order_and_count_a_failing_one() -> None:
    ticks = iter([0.0, 1.0, 1.0, 1.5, 2.0, 4.25])
    phases = Phases(clock=lambda: next(ticks))
    with phases.phase("check"):
        pass
    with pytest.raises(RuntimeError), phases.phase("criu restore"):
        raise RuntimeError("CRIU failed")
    with phases.phase("check"):
        pass
    assert phases.to_dict() == {"check": 3.25, "criu restore": 0.5}
    assert list(phases.to_dict()) == ["check", "criu restore"]
