"""The peer benchmark (bench/bench_peers.py) runs whole at its smallest size.

Not a timing test: it checks that one run measures every peer on every session, that a
peer which fails is reported with its error (dill cannot pickle the unpicklable
session), and that ours restores every session correctly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PEERS = ["ours", "criu", "kishu", "dill", "rerun"]
SESSIONS = ["analysis", "simulation", "unpicklable"]
METRICS = ["pause", "durable", "stored_bytes", "second_new_bytes", "restore_to_output"]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_one_run_measures_every_peer_on_every_session(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_peers.py"),
            "--sizes",
            "32",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "peers.png"),
            "--markdown",
            str(tmp_path / "peers.md"),
            "--work",
            str(tmp_path),
            "--peer-timeout",
            "600",
        ],
        capture_output=True,
        text=True,
        timeout=1450,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    report = json.loads(out.read_text())
    assert report["versions"]["kishu"] == "0.3.4"
    assert [(r["mib"], r["session"]) for r in report["rows"]] == [(32, s) for s in SESSIONS]
    for row in report["rows"]:
        where = f"{row['session']}"
        assert sorted(row["peers"]) == sorted(PEERS), where
        for peer, result in row["peers"].items():
            if "error" in result:
                # A failure names what failed and why, not just that it did.
                assert len(result["error"]) > 20, (where, peer, result)
                continue
            if peer == "rerun":
                assert result["restore_to_output"] > 0, (where, result)
                continue
            for metric in METRICS:
                assert result[metric] > 0, (where, peer, metric, result)
            assert isinstance(result["correct"], bool), (where, peer, result)
        ours = row["peers"]["ours"]
        assert "error" not in ours, ours
        assert ours["correct"], (where, ours["fingerprint"])
        # Both fingerprints are real output of the session's check cell.
        assert ours["fingerprint"][0].strip(), ours
    unpicklable = report["rows"][2]["peers"]
    assert "dill.dump_session" in unpicklable["dill"]["error"], unpicklable["dill"]
    assert "pickle" in unpicklable["dill"]["error"], unpicklable["dill"]
    assert unpicklable["criu"].get("correct") is True, unpicklable["criu"]
    # Goals are stated for every session ours ran on.
    assert len(report["goals"]) >= len(SESSIONS), report["goals"]
    assert (tmp_path / "peers.png").stat().st_size > 1000
    table = (tmp_path / "peers.md").read_text()
    for session in SESSIONS:
        assert f"| 32 MiB | {session} | kishu |" in table
