"""The SLO routing benchmark's workload: capacity, feasibility, the schedule, the report."""

from __future__ import annotations

import math

import pytest

from bench.routing_slo import (
    CLASSES,
    FAST,
    FLEET,
    SLOW,
    SloResult,
    SloWorkload,
    capacity,
    feasible,
    make_arrivals,
    markdown,
    model_errors,
)


def test_the_capacity_counts_each_engine_at_a_full_batch():
    w = SloWorkload(question_tokens=(100, 300), max_tokens=24)
    fast_ms = 10 + 0.1 * 200 + 23 * (40 + 3 * 3)
    slow_ms = 40 + 0.4 * 200 + 23 * (120 + 6 * 3)
    assert capacity(FLEET, w) == pytest.approx(2 * 4 / (fast_ms / 1000) + 2 * 4 / (slow_ms / 1000))
    assert capacity((FAST,), w) > capacity((SLOW,), w)


def test_feasible_means_an_idle_engine_with_nothing_cached_meets_it():
    by = {c.name: c for c in CLASSES}
    assert feasible(by["interactive"], 1000, FLEET)            # fast: 10 + 100 ms, 40 ms a token
    assert not feasible(by["interactive"], 1000, (SLOW,))      # 120 ms a token
    assert not feasible(by["impossible"], 1000, FLEET)
    assert not feasible(by["interactive"], 3000, FLEET)        # 310 ms of prefill


def test_the_schedule_is_seeded_and_follows_the_rate():
    w = SloWorkload(duration_s=200.0, seed=3)
    systems, a = make_arrivals(w, 5.0)
    assert (systems, a) == make_arrivals(w, 5.0)
    assert len(systems) == w.system_prompts
    assert abs(len(a) / 200.0 - 5.0) < 0.5
    shares = {c.name: sum(x.cls is c for x in a) / len(a) for c in CLASSES}
    assert all(abs(shares[c.name] - c.share) < 0.06 for c in CLASSES)
    assert all(0 <= x.start < 200.0 for x in a) and a == sorted(a, key=lambda x: x.start)


def test_the_model_error_comes_from_the_gateways_histogram():
    page = ('switchyard_slo_routing_prediction_error_ratio_sum{model="m",objective="ttft"} 3.0\n'
            'switchyard_slo_routing_prediction_error_ratio_count{model="m",objective="ttft"} 4.0\n'
            'switchyard_slo_routing_prediction_error_ratio_count{model="m",objective="tpot"} 0.0\n')
    assert model_errors(page) == {"ttft": 0.75}


def test_the_report_has_a_row_per_run():
    r = SloResult(strategy="slo", load=2.0, rate=18.0, requests=10, feasible=9, attained=0.9, attained_served=1.0,
                  attained_all=0.8, refused=1, failed=0, ttft_mean_ms=100.0, ttft_p99_ms=900.0, tpot_mean_ms=50.0,
                  per_class={"interactive": 1.0}, fast_share={"interactive": 1.0})
    table = markdown([r])
    assert "| 2× | `slo` | **90.0%** | 100.0% | 80.0% | 100% |" in table
    assert math.isnan(r.per_class.get("standard", math.nan))
