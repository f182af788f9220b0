"""The flow-control scenarios of the resilience benchmark run end to end on a short setting and
report every tenant's figures. Nothing about speed is asserted (bench/ measures it): only that the
scenario ran, every request was answered one way or another and the report says whether it held."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[3]


def test_priorities_and_fairness_scenarios_run_and_report(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.resilience", "--scenario", "priorities,fairness", "--out", str(tmp_path),
         "--priorities-duration-s", "1", "--fairness-duration-s", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = orjson.loads((tmp_path / "resilience-latest.json").read_bytes())
    prio = data["scenarios"]["priorities"]["run"]
    assert prio["tenants"]["alice"]["sent"] == 5 and prio["tenants"]["bob"]["sent"] == 30
    fair = data["scenarios"]["fairness"]["run"]
    assert fair["tenants"]["dave"]["sent"] == 3 and fair["tenants"]["carol"]["sent"] == 30
    for run in (prio, fair):
        assert len(run["engine_queue_peak"]) == 2
        for t in run["tenants"].values():
            assert t["ok"] + t["shed"] + t["5xx"] + t["other_errors"] == t["sent"]
        assert set(run["holds"]) and all(isinstance(v, bool) for v in run["holds"].values())
    md = (tmp_path / "resilience-latest.md").read_text()
    assert "## Priorities" in md and "## Fairness" in md
