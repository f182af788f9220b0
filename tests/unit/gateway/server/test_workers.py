"""``server.workers: auto``: the CPUs of the cgroup's quota, capped by the CPUs the process may use."""

from __future__ import annotations

import os

import pytest

from gateway.config.schema import ConfigError, load_config
from gateway.server.workers import cpu_limit, resolve_workers

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
    assert resolve_workers(3) == 3 and resolve_workers("auto") == cpu_limit()


def test_config_accepts_auto_and_counts_only(tmp_path):
    base = "models:\n  - name: m\n    engine: vllm\n    endpoints: [http://127.0.0.1:9]\n"
    f = tmp_path / "c.yaml"
    f.write_text(base + "server:\n  workers: auto\n")
    assert load_config(str(f)).server.workers == "auto"
    f.write_text(base)
    assert load_config(str(f)).server.workers == 1
    f.write_text(base + "server:\n  workers: many\n")
    with pytest.raises(ConfigError, match="server.workers"):
        load_config(str(f))
