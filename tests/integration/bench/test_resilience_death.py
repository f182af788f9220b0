"""The engine-death scenario of the resilience benchmark runs end to end on a short setting: an
SGLang decode engine killed under a streaming load behind a gateway at its defaults, and started
again. Nothing about speed is asserted. The behaviour the scenario measures is held by
deterministic tests elsewhere (tests/integration/view/test_engine_death.py: nothing sent after a
kill fails; tests/integration/pd/test_pd.py: each P/D leg failure that is retried); here, that the
scenario kills, counts and reports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[3]


def test_the_engine_death_scenario_kills_counts_and_reports(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.resilience", "--scenario", "engine-death", "--out", str(tmp_path),
         "--death-cases", "sglang-pd:decode", "--death-seconds", "3", "--death-clients", "8"],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = orjson.loads((tmp_path / "resilience-latest.json").read_bytes())
    case = data["scenarios"]["engine-death"]["cases"]["sglang-pd:decode"]
    assert case["requests"] > case["in_flight_at_kill"] > 0
    assert 0 < case["victim_share_before"] < 1            # both decodes served before the kill
    assert case["failed_in_flight_at_kill"] <= case["in_flight_at_kill"]
    failed = sum(case["errors"].values())
    assert failed == case["failed_in_flight_at_kill"] + case["failed_other"]
    assert len(case["other_failures"]) == min(10, case["failed_other"])     # each one described
    md = (tmp_path / "resilience-latest.md").read_text()
    assert "## Engine death" in md and "sglang-pd" in md
