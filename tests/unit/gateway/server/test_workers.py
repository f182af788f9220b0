"""``server.workers: auto``: the CPUs of the cgroup's quota, capped by the CPUs the process may use
and by the cgroup's memory limit."""

from __future__ import annotations

import os

import pytest

from gateway.config.schema import ConfigError, load_config
from gateway.server.workers import WORKER_MEMORY_BYTES, auto_count, cpu_limit, memory_limit, resolve_workers

AFFINITY = len(os.sched_getaffinity(0))


def _v2(tmp_path, text):
    (tmp_path / "cpu.max").write_text(text)
    return tmp_path


def _v1(tmp_path, quota, period):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text(f"{period}\n")
    return tmp_path


def test_a_fractional_quota_rounds_up_and_never_exceeds_the_allowed_cpus(tmp_path):
    assert cpu_limit(_v2(tmp_path, "150000 100000\n")) == min(2, AFFINITY)


def test_a_quota_below_one_cpu_still_means_one_worker(tmp_path):
    assert cpu_limit(_v2(tmp_path, "20000 100000\n")) == 1


def test_no_quota_means_the_allowed_cpus(tmp_path):
    assert cpu_limit(_v2(tmp_path, "max 100000\n")) == AFFINITY
    assert cpu_limit(tmp_path / "absent") == AFFINITY           # no cgroup files at all


def test_cgroup_v1_quota(tmp_path):
    assert cpu_limit(_v1(tmp_path, 100000, 100000)) == 1


def test_cgroup_v1_unlimited(tmp_path):
    assert cpu_limit(_v1(tmp_path, -1, 100000)) == AFFINITY


def test_resolve():
    assert resolve_workers(3) == 3 and resolve_workers("auto") == auto_count()


def test_a_memory_limit_caps_auto_at_one_worker_per_share(tmp_path):
    (tmp_path / "cpu.max").write_text("max 100000\n")              # no CPU limit: every allowed CPU
    (tmp_path / "memory.max").write_text(f"{2 * WORKER_MEMORY_BYTES + 5}\n")
    assert memory_limit(tmp_path) == 2 * WORKER_MEMORY_BYTES + 5
    assert auto_count(tmp_path) == min(2, AFFINITY)
    (tmp_path / "memory.max").write_text(f"{WORKER_MEMORY_BYTES // 2}\n")
    assert auto_count(tmp_path) == 1                                 # never fewer than one
    (tmp_path / "memory.max").write_text("max\n")
    assert memory_limit(tmp_path) is None and auto_count(tmp_path) == AFFINITY


def test_cgroup_v1_memory_limit(tmp_path):
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")   # v1's "none"
    assert memory_limit(tmp_path) is None
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(f"{WORKER_MEMORY_BYTES}\n")
    assert memory_limit(tmp_path) == WORKER_MEMORY_BYTES and auto_count(tmp_path) == 1


def test_config_accepts_auto_and_counts_only(tmp_path):
    base = "models:\n  - name: m\n    engine: vllm\n    endpoints: [http://127.0.0.1:9]\n"
    f = tmp_path / "c.yaml"
    f.write_text(base + "server:\n  workers: auto\n")
    assert load_config(str(f)).server.workers == "auto"
    f.write_text(base)
    assert load_config(str(f)).server.workers == "auto"          # the default
    f.write_text(base + "server:\n  workers: 1\n")
    assert load_config(str(f)).server.workers == 1
    f.write_text(base + "server:\n  workers: many\n")
    with pytest.raises(ConfigError, match="server.workers"):
        load_config(str(f))


def test_auto_runs_one_worker_where_limits_or_admin_keys_would_be_per_process(monkeypatch):
    from gateway.config.schema import config_from_dict
    from gateway.server import workers as w

    monkeypatch.setattr(w, "auto_count", lambda root=None: 4)
    base = {"models": [{"name": "m", "engine": "vllm", "endpoints": ["http://127.0.0.1:9"]}]}

    def run(extra, value="auto"):
        return w.auto_workers(value, config_from_dict({**base, **extra}, source="<t>"))

    assert run({}) == (4, None)
    per_process = "{} are kept per process without state.redis_url"
    assert run({"limits": {"users": {"u": {"rpm": 10}}}}) == (1, per_process.format("rate limits"))
    assert run({"limits": {"default_user": {"max_concurrent": 2}}}) == (1, per_process.format("rate limits"))
    assert run({"limits": {"models": {"m": {"rps": 5}}}}) == (1, per_process.format("rate limits"))
    assert run({"limits": {"users": {"u": {"priority": "critical"}}}}) == (4, None)     # a class, not a limit
    assert run({"auth": {"admin_token": "t0ken"}}) == (1, per_process.format("the admin API's users and keys"))
    # admission's priority is strict within a process: one worker, whichever block enables it
    adm = (1, "admission's priority classes are strict within one process only")
    assert run({"admission": {"enabled": True}}) == adm
    model = {"name": "m", "engine": "vllm", "endpoints": ["http://127.0.0.1:9"], "admission": {"enabled": True}}
    assert run({"models": [model]}) == adm
    assert run({"admission": {"enabled": False, "max_in_flight_per_endpoint": 3}}) == (4, None)
    assert run({"admission": {"enabled": True}}, 2) == (2, None)          # an explicit count: shares
    # adapters loaded and unloaded on demand: every CPU, as the workers tell each other of the
    # adapters they have in flight; one worker when they do not
    lora = {"name": "m", "engine": "vllm", "endpoints": ["http://127.0.0.1:9"], "adapters": {"sql": "/a/sql"}}
    assert run({"models": [lora]}) == (4, None)
    for view in ({"share_monitoring": False}, {"workers": False}):
        n, why = run({"models": [lora], "view": view})
        assert n == 1 and "LoRA adapters" in why and "view.share_monitoring" in why
    assert run({"models": [lora], "view": {"share_monitoring": False}}, 2) == (2, None)
    # Redis holds them for every worker; an explicit count is the operator's choice
    assert run({"auth": {"admin_token": "t0ken"}, "state": {"redis_url": "redis://127.0.0.1:1/0"}}) == (4, None)
    assert run({"auth": {"admin_token": "t0ken"}}, 3) == (3, None)
