"""A small soak (bench/soak.py) as a test: a real gateway process in front of real enginesim
processes, a few hundred requests at concurrency 50 with faults and abandoned streams, and the
invariants afterwards. Speed is never asserted; only that nothing leaked and every client got a
well-formed end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("soak")
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "soak.py"), "--requests", "300", "--concurrency", "50",
         "--engines", "vllm:1,sglang:1", "--max-tokens", "4", "24", "--itl-ms", "10", "--watchdog-idle-s", "1",
         "--fault-rate", "0.15", "--abandon-rate", "0.1", "--seed", "1", "--out", str(out), "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=100)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]     # 2: the setup failed
    return orjson.loads(proc.stdout)


def test_every_invariant_holds(report):
    failed = {k: v for k, v in report["checks"].items() if v}
    assert not failed, (failed, report["problem_examples"])
    assert report["ok"]


def test_every_stream_ended_with_done_or_an_error_event(report):
    a = report["answers"]
    assert a["finished"] == a["started"] == 300
    assert report["checks"]["streams_without_done_or_error"] == 0
    assert a["by_outcome"].get("truncated", 0) == 0
    streams_ended = sum(a["by_outcome"].get(k, 0) for k in ("done", "error_event", "abandoned"))
    assert streams_ended + sum(v for k, v in a["by_outcome"].items() if k.startswith("http_")) >= a["streams"]


def test_every_answer_is_200_or_an_openai_shaped_error(report):
    statuses = report["answers"]["by_status"]
    assert "none" not in statuses                                # no connection ended without an answer
    assert all(k == "200" or 400 <= int(k) <= 599 for k in statuses), statuses
    assert report["checks"]["errors_not_openai_shaped"] == 0
    assert report["checks"]["bad_200_bodies"] == 0


def test_gauges_back_to_zero_and_fds_and_tasks_back_near_the_start(report):
    g = report["gauges_end"]
    assert g["gauge_lines"] > 0 and g["in_flight_sum"] == 0, g   # the gauges were there, and at 0
    assert report["engines_busy_end"] and not any(report["engines_busy_end"].values())
    p = report["process"]
    start, end = p["start"], p["end"]
    assert start["fds"] > 0 and end["fds"] <= start["fds"] + 8, (start, end)
    assert start["tasks"] is not None and end["tasks"] is not None  # switchyard_event_loop_tasks
    assert end["tasks"] <= start["tasks"] + 4, (start, end)
    assert p["middle"]["tasks"] is None or p["middle"]["tasks"] >= end["tasks"]


def test_the_faults_and_abandonments_happened(report):
    by_fault = report["answers"]["by_fault"]
    assert {"none", "drop", "error", "status", "stall_short", "stall_forever"} <= by_fault.keys(), by_fault
    outcomes = report["answers"]["by_outcome"]
    assert outcomes.get("abandoned", 0) > 0 and outcomes.get("error_event", 0) > 0, outcomes
    assert report["gateway_exit"] == 0
