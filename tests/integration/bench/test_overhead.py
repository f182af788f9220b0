"""The overhead benchmark runs end to end on a tiny setting and writes a well-formed report.

Speed is never asserted here (bench/ measures it); only that every scenario kind (load, idle,
prefill/decode, many paced streams) produced figures for every column that takes part, that the
report states each column's log settings, that an absent peer is reported as absent, and that every
process the benchmark started is gone. The peers' columns (LiteLLM's with its smaller runs and its
n/a P/D rows) are checked on a report made up here, so no peer needs to be installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))
import overhead  # noqa: E402
from overhead_report import goals, open_targets, render  # noqa: E402


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[dict, str, str]:
    out = tmp_path_factory.mktemp("overhead")
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "overhead.py"), "--tiny", "--peers", "auto",
         "--peers-venv", str(out / "no-such-venv"), "--litellm-venv", str(out / "no-such-venv"), "--out", str(out)],
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
                assert r.get("target_cpu_us_per_req", 0) > 0, (sc["name"], target, r.get("unmeasured"), data["pids"])
    for t in data["targets"]:
        assert t["rss"]["start"] > 0 and t["rss"]["end"] > 0


def test_report_is_markdown_with_ratios_and_goals(tiny_run):
    data, md, stdout = tiny_run
    assert md.strip() == stdout.strip()
    assert data["markdown"] == md
    for heading in ("### Columns", "### Throughput, latency, CPU", "### Added over direct (ms)", "### Ratios",
                    "### What Switchyard's settings cost", "### Prefill/decode", "### Many paced streams",
                    "### Memory", "### Targets of the open issues", "### Issue #5 targets"):
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
    assert "sglang-router" in absent and "vllm-router" in absent and "litellm" in absent
    assert "Absent:" in md and "make bench-peers" in md and "make bench-litellm" in md


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


# -- the peers' columns, on a made-up report ------------------------------------------------------------

def test_peers_option_accepts_litellm(tmp_path):
    args = overhead.parse_args(["--quick", "--peers", "vllm-router,sglang-router,litellm",
                                "--litellm-venv", str(tmp_path), "--litellm-fleet-streams", "50"])
    assert args.peers.split(",") == ["vllm-router", "sglang-router", "litellm"]
    assert args.litellm_venv == str(tmp_path) and args.litellm_fleet_streams == 50
    assert args.litellm_idle_streams == overhead.LITELLM_IDLE_STREAMS
    assert set(overhead.PEERS) == {"sglang-router", "vllm-router", "litellm"}
    lite = overhead.PEERS["litellm"]
    assert lite.venv == "litellm" and lite.pd is None and lite.probe == "/health/liveliness"


def test_litellm_config_balances_one_model_over_the_endpoints(tmp_path):
    import yaml
    urls = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    cfg = yaml.safe_load(overhead.litellm_config(urls))
    assert [m["model_name"] for m in cfg["model_list"]] == [overhead.MODEL] * 2
    assert [m["litellm_params"] for m in cfg["model_list"]] == [
        {"model": f"openai/{overhead.MODEL}", "api_base": f"{u}/v1", "api_key": "x"} for u in urls]
    assert cfg["general_settings"] == {"dangerously_permit_weak_or_unset_master_key": True}   # no master key
    argv = overhead.PEERS["litellm"].agg(4000, 4001, urls, tmp_path / "c.yaml")
    assert argv == ["--config", str(tmp_path / "c.yaml"), "--host", "127.0.0.1", "--port", "4000"]


PEER_NAMES = ("sglang-router", "vllm-router", "litellm")


def _load(rps: float, cpu: float | None, stream: bool) -> dict:
    return {"rounds": 1, "failed_rounds": [], "completed": int(rps), "errors": 0, "rps": rps, "events_per_s": rps,
            "lat_p50_ms": 1.0, "lat_p99_ms": 2.0, "ttft_p50_ms": 0.5 if stream else None,
            "ttft_p99_ms": 0.9 if stream else None, "backend_cpu_us_per_req": 10.0,
            **({"target_cpu_us_per_req": cpu} if cpu is not None else {})}


def _fake_report() -> dict:
    """What bench/overhead.py writes for a quick run with the three peers, figures made up."""
    mb = 1024 * 1024
    scenarios = [
        {"name": "ns32", "title": "non-streaming, concurrency 32", "mode": "nonstream", "concurrency": 32},
        {"name": "st64", "title": "streaming, 64 streams × 100 chunks", "mode": "stream", "concurrency": 64},
        {"name": "paced1", "title": "paced stream", "mode": "stream", "concurrency": 1, "pace_ms": 5.0},
        {"name": "idle1k", "title": "1,000 idle streams held open", "mode": "idle", "idle_n": 1000},
        {"name": "pd-vllm-c1", "title": "vLLM P/D", "mode": "pd", "engine": "vllm", "concurrency": 1},
        {"name": "pd-sglang-c1", "title": "SGLang P/D", "mode": "pd", "engine": "sglang", "concurrency": 1},
        {"name": "fleet1k", "title": "1,000 paced streams", "mode": "fleet", "streams": 1000, "interval_s": 0.5,
         "ramp_s": 0.5},
    ]
    names = ("direct", "switchyard", *PEER_NAMES)
    targets = []
    for stack in ("agg", "pd", "fleet"):
        for n in names:
            if stack == "pd" and n == "litellm":
                continue
            targets.append({"name": n, "stack": stack, "kind": "direct" if n == "direct" else
                            "switchyard" if n == "switchyard" else "peer",
                            "variant": "default" if n == "switchyard" else None, "version": "1",
                            "rss": {"start": 50 * mb, "after_load": 60 * mb, "end": 70 * mb},
                            "about": {"what": n}, "log": {"bytes": 100, "lines": 1, "requests": 1}})
    res: dict = {}
    for sc in scenarios[:3]:
        stream = sc["mode"] == "stream"
        res[sc["name"]] = {n: _load(10.0 if n == "litellm" else 1000.0, None if n == "direct" else 100.0, stream)
                           for n in names}
    res["idle1k"] = {n: {"held": 250 if n == "litellm" else 1000, "rss_held": 80 * mb, "bytes_per_stream": 20480.0,
                         "rss_after_close": 70 * mb, "upstream_held_after_close": 0, "upstream_wait_s": 0.1}
                     for n in names}
    for sc, peer in (("pd-vllm-c1", "vllm-router"), ("pd-sglang-c1", "sglang-router")):
        res[sc] = {n: {**_load(5.0, None if n == "direct" else 900.0, True), "wire": {}}
                   for n in ("direct", "switchyard", peer)}
    res["fleet1k"] = {n: {"completed": 100 if n == "litellm" else 1000, "errors": 0, "window_s": 5.0, "events": 900,
                          "cpu_s": {"backend": 0.3, **({} if n == "direct" else {"target": 1.0})},
                          "rss_before": {"target": 50 * mb, "backend": 20 * mb},
                          "rss_peak": {"target": 60 * mb, "backend": 21 * mb},
                          "rss_after": {"target": 55 * mb, "backend": 20 * mb}, "ttft_p50_ms": 500.0,
                          "ttft_p99_ms": 510.0, "gap_p50_ms": 500.0, "gap_p99_ms": 501.0, "gap_max_ms": 505.0,
                          "by_port": [250, 250, 250, 250]} for n in names}
    report = {
        "date": "2026-12-01 00:00 UTC", "mode": "quick", "loadavg_before": "0.1", "loadavg_after": "0.2",
        "machine": {"cpu": "cpu", "cores": 2, "affinity": 2, "memory": "1 GiB", "kernel": "6", "python": "3.11"},
        "params": {"rounds": 1, "duration": 1.0, "warmup": 0.3, "upstream_wait_s": 2.0,
                   "pd": {"prefill_ms": 20, "transfer_ms": 2, "token_ms": 5, "tokens": 32, "rounds": 1,
                          "duration": 2.5}},
        "scenarios": scenarios, "absent": [], "notes": [], "targets": targets, "results": res, "elapsed_s": 170.0,
        "skipped": [
            {"kind": "pd", "target": "sglang-router", "scenarios": "pd-vllm-c1", "why": "SGLang only",
             "short": overhead.PEERS["sglang-router"].no_pd_short},
            {"kind": "pd", "target": "vllm-router", "scenarios": "pd-sglang-c1", "why": "vLLM only",
             "short": overhead.PEERS["vllm-router"].no_pd_short},
            {"kind": "pd", "target": "litellm", "scenarios": "pd-vllm-c1, pd-sglang-c1",
             "why": overhead.PEERS["litellm"].no_pd, "short": overhead.PEERS["litellm"].no_pd_short}],
        "capped": [
            {"scenario": "st64", "target": "litellm", "streams": 16, "of": 64, "option": "--litellm-stream-concurrency",
             "warmup_s": 3.0, "window_s": 2.0},
            {"scenario": "idle1k", "target": "litellm", "streams": 250, "of": 1000,
             "option": "--litellm-idle-streams"},
            {"scenario": "fleet1k", "target": "litellm", "streams": 100, "of": 1000,
             "option": "--litellm-fleet-streams"}],
    }
    report["goals"] = goals(report)
    return report


def _rows(md: str, heading: str) -> list[str]:
    part = md.split(heading, 1)[1].split("\n### ", 1)[0]
    return [line for line in part.splitlines() if line.startswith("|")]


def test_the_open_issues_targets_are_checked_against_the_same_runs_figures():
    report = _fake_report()
    res = report["results"]
    res["ns32"]["switchyard"]["rps"] = 1200.0           # vllm-router's: 1,000
    res["ns32"]["switchyard"]["target_cpu_us_per_req"] = 160.0       # vllm-router's: 100
    res["paced1"]["switchyard"]["ttft_p50_ms"] = 0.6    # added 0.1 over direct (0.5); vllm-router's 0
    res["pd-vllm-c1"]["switchyard"]["ttft_p50_ms"] = 0.7      # direct's 0.5: +0.2
    res["pd-sglang-c1"]["switchyard"]["ttft_p50_ms"] = 0.9    # +0.4
    res["fleet1k"]["switchyard"]["cpu_s"]["target"] = 0.9     # 1.0 µs a chunk against vllm-router's 1.11
    rows = {r["what"]: r for r in open_targets(report)}
    assert [r["issue"] for r in rows.values()] == [24, 27, 27, 27, 27, 27]
    got = {w: (round(r["value"], 3), r["met"]) for w, r in rows.items()}
    assert got == {"non-streaming c=32 req/s / vllm-router's": (1.2, True),
                   "paced-stream TTFT added p50, minus vllm-router's": (0.1, True),
                   "P/D TTFT added p50, pd-vllm-c1": (0.2, True),
                   "P/D TTFT added p50, pd-sglang-c1": (0.4, False),
                   "CPU per relayed chunk (fleet1k) / vllm-router's": (0.9, True),
                   "CPU per request (ns32) / vllm-router's": (1.6, False)}
    del res["fleet1k"]["vllm-router"]                   # a run without the peer: not judged
    assert {r["met"] for r in open_targets(report) if "chunk" in r["what"]} == {None}
    md = render(report)
    assert "| 27 | P/D TTFT added p50, pd-sglang-c1 | 0.4 ms | ≤ 0.3 ms | **no** |" in md


def test_litellm_column_renders_beside_the_rust_routers():
    md = render(_fake_report())
    for line in md.splitlines():
        if line.startswith("|"):
            assert line.endswith("|"), line
    load = _rows(md, "### Throughput, latency, CPU")
    for sc in ("ns32", "st64", "paced1"):   # req/s, streams/s, paced TTFT, CPU per request
        for peer in PEER_NAMES:
            assert any(r.startswith(f"| {sc} | {peer} | ") for r in load), (sc, peer)
    ratios = _rows(md, "### Ratios")
    assert "switchyard / litellm" in ratios[0] and "litellm / direct" in ratios[0]
    assert "switchyard / vllm-router" in ratios[0]
    memory = _rows(md, "### Memory")
    assert any(r.startswith("| litellm | ") for r in memory) and "switchyard / litellm" in "".join(memory)
    fleet = _rows(md, "### Many paced streams")
    assert any(r.startswith("| litellm | 100 |") for r in fleet)
    # its smaller runs are said under each table
    assert "litellm ran `st64` at 16 concurrent streams, not 64 (`--litellm-stream-concurrency`)" in md
    assert "litellm held 250 of the 1,000 streams in `idle1k`" in md
    assert "litellm ran 100 of the 1,000 streams (`--litellm-fleet-streams`" in md
    # P/D: a row that says n/a, in both engines' scenarios, and why
    pd = _rows(md, "### Prefill/decode")
    for sc in ("pd-vllm-c1", "pd-sglang-c1"):
        row = next(r for r in pd if r.startswith(f"| {sc} | litellm | "))
        assert "n/a: no P/D" in row and row.count("|") == pd[0].count("|"), row
    assert any(r.startswith("| pd-vllm-c1 | sglang-router | n/a") for r in pd)
    assert "- litellm skipped in pd-vllm-c1, pd-sglang-c1: it has no prefill/decode disaggregation" in md
    assert "LiteLLM's config is a `model_list`" in md


def test_a_target_that_never_answers_is_ended_when_its_wait_gives_up(tmp_path):
    """A gateway that listens but never answers a completion (here a plain file server) is ended by
    the wait that gives up on it, so no benchmark's failure leaves it running."""
    from gateway.server.run import free_port
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], cwd=tmp_path,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        with pytest.raises(RuntimeError, match="not ready"):
            overhead.wait_ready("files", p, port, 1.5)
        assert p.poll() is not None
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_the_report_script_has_a_help_and_renders_a_saved_report(tmp_path):
    """``overhead_report.py --help`` prints its usage and touches nothing; given a saved report's
    path it prints the report's Markdown; a path that is no file is a usage error, not a traceback."""
    script = str(REPO / "bench" / "overhead_report.py")
    run = dict(cwd=tmp_path, capture_output=True, text=True, timeout=60)
    got = subprocess.run([sys.executable, script, "--help"], **run)
    assert got.returncode == 0 and got.stdout.startswith("usage:") and "REPORT" in got.stdout, got
    assert list(tmp_path.iterdir()) == []
    report = _fake_report()
    (tmp_path / "overhead-latest.json").write_bytes(orjson.dumps(report))
    got = subprocess.run([sys.executable, script, "overhead-latest.json"], **run)
    assert got.returncode == 0 and got.stdout == render(report) + "\n", got.stderr
    got = subprocess.run([sys.executable, script, "no-such.json"], **run)
    assert got.returncode == 2 and "Traceback" not in got.stderr and "no-such.json" in got.stderr, got
