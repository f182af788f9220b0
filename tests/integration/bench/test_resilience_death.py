"""The engine-death scenario of the resilience benchmark runs end to end on a short setting: an
SGLang decode engine killed under a streaming load behind a gateway at its defaults, and started
again. Nothing about speed is asserted; what is, is the behaviour the scenario reports: no request
that was not in flight on the engine when it died fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[3]


def test_the_engine_death_scenario_runs_and_only_streams_in_flight_on_the_dead_engine_fail(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.resilience", "--scenario", "engine-death", "--out", str(tmp_path),
         "--death-cases", "sglang-pd:decode", "--death-seconds", "3", "--death-clients", "8"],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = orjson.loads((tmp_path / "resilience-latest.json").read_bytes())
    case = data["scenarios"]["engine-death"]["cases"]["sglang-pd:decode"]
    assert case["requests"] > case["in_flight_at_kill"] > 0
    assert case["failed_other"] == 0, case
    assert case["failed_in_flight_at_kill"] <= case["in_flight_at_kill"]
    assert "## Engine death" in (tmp_path / "resilience-latest.md").read_text()
