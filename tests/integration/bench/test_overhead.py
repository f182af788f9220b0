"""The overhead benchmark runs end to end on a tiny setting and writes a well-formed report.

Speed is never asserted here (bench/ measures it); only that every scenario kind (load, idle,
prefill/decode, many paced streams) produced figures for every column that takes part, that the
report states each column's log settings, that an absent peer is reported as absent, and that every
process the benchmark started is gone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[dict, str, str]:
    out = tmp_path_factory.mktemp("overhead")
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "overhead.py"), "--tiny", "--peers", "auto",
         "--peers-venv", str(out / "no-such-venv"), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = orjson.loads((out / "overhead-latest.json").read_bytes())
    md = (out / "overhead-latest.md").read_text()
    return data, md, proc.stdout


def _agg(data: dict) -> list[dict]:
    return [t for t in data["targets"] if t["stack"] == "agg"]


def test_columns_and_their_log_settings(tiny_run):
    data, md, _ = tiny_run
    assert [t["name"] for t in _agg(data)] == ["direct", "switchyard", "switchyard-workers2"]
    sy, w2 = _agg(data)[1:]
    assert sy["variant"] == "default" and "info" in sy["about"]["log_level"]
    assert "JSON" in sy["about"]["log_format"] and "file" in sy["about"]["stderr"]
    assert "--workers 2" in w2["about"]["what"] and len(w2["pids"]) == 3   # the parent and two workers
    for t in (sy, w2):   # the request line is on: about one line per request served
        assert t["log"]["requests"] > 0 and t["log"]["lines"] >= t["log"]["requests"] * 0.9, t["log"]
    assert "### Columns" in md and "| switchyard-workers2 |" in md
    assert {t["stack"] for t in data["targets"]} == {"agg", "pd", "fleet"}


def test_every_scenario_has_figures(tiny_run):
    data, _, _ = tiny_run
    kinds = {s["mode"] for s in data["scenarios"]}
    assert kinds == {"nonstream", "stream", "idle", "pd", "fleet"}
    assert {s["engine"] for s in data["scenarios"] if s["mode"] == "pd"} == {"vllm", "sglang"}
    for sc in data["scenarios"]:
        res = data["results"][sc["name"]]
        if sc["mode"] == "idle":
            assert sorted(res) == ["direct", "switchyard"]   # variants other than the default skip idle
        elif sc["mode"] in ("pd", "fleet"):
            assert sorted(res) == ["direct", "switchyard"]
        else:
            assert sorted(res) == ["direct", "switchyard", "switchyard-workers2"]
        for target, r in res.items():
            if sc["mode"] == "idle":
                assert r["held"] == sc["idle_n"], r
                assert r["rss_held"] > 0 and r["rss_before"] > 0
                assert isinstance(r["bytes_per_stream"], float)
                assert r["upstream_held_after_close"] is not None
                continue
            if sc["mode"] == "fleet":
                assert r["completed"] == sc["streams"] and r["errors"] == 0, r
                assert r["events"] >= sc["streams"] * sc["max_tokens"]
                assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and 0 < r["gap_p50_ms"] <= r["gap_max_ms"]
                who = "backend" if target == "direct" else "target"
                assert r["rss_peak"][who] >= r["rss_before"][who] > 0
                assert sum(r["by_port"]) == sc["streams"] and len(r["by_port"]) == sc["endpoints"]
                if target == "direct":
                    assert "target" not in r["cpu_s"]
                else:
                    assert r["cpu_s"]["target"] > 0
                continue
            assert not r["failed_rounds"], r
            assert r["completed"] > 0 and r["errors"] == 0, r
            assert r["rps"] > 0 and 0 < r["lat_p50_ms"] <= r["lat_p99_ms"]
            if sc["mode"] in ("stream", "pd"):
                assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
                assert r["events_per_s"] >= r["rps"] * sc["max_tokens"]
            if sc["mode"] == "pd":   # the orchestration reached the mock engines as P/D
                w = r["wire"]
                assert w["decode"] >= r["completed"] and w["bad"] == 0, w
                assert w["decode_kv" if sc["engine"] == "vllm" else "rooms_matched"] == w["decode"], w
            assert r["backend_cpu_us_per_req"] >= 0
            if target == "direct":
                assert "target_cpu_us_per_req" not in r
            else:
                assert r["target_cpu_us_per_req"] > 0
    for t in data["targets"]:
        assert t["rss"]["start"] > 0 and t["rss"]["end"] > 0


def test_report_is_markdown_with_ratios_and_goals(tiny_run):
    data, md, stdout = tiny_run
    assert md.strip() == stdout.strip()
    assert data["markdown"] == md
    for heading in ("### Columns", "### Throughput, latency, CPU", "### Added over direct (ms)", "### Ratios",
                    "### What Switchyard's settings cost", "### Prefill/decode", "### Many paced streams",
                    "### Memory", "### Issue #5 targets"):
        assert heading in md
    assert "| switchyard / direct |" in md and "| ns1 | CPU µs/req |" in md
    for line in md.splitlines():
        if line.startswith("|"):
            assert line.endswith("|"), line
    assert data["machine"]["cores"] >= 1 and data["date"]
    assert {g["met"] for g in data["goals"]} <= {True, False, None}


def test_absent_peers_are_named(tiny_run):
    data, md, _ = tiny_run
    absent = " ".join(data["absent"])
    assert "sglang-router" in absent and "vllm-router" in absent
    assert "Absent:" in md and "make bench-peers" in md


def test_no_process_left_behind(tiny_run):
    data, _, _ = tiny_run
    assert data["pids"]
    for name, pid in data["pids"].items():
        assert not os.path.exists(f"/proc/{pid}") or _someone_else(pid), f"{name} ({pid}) still running"


def _someone_else(pid: int) -> bool:
    """A recycled pid can belong to another process; only one with the benchmark's command line counts."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True
    return b"sy-overhead-" not in cmd and b"bench/fastbackend.py" not in cmd and b"bench/pdbackend.py" not in cmd
