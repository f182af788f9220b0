"""The retry budget and the choice of endpoints a retry may go to (gateway/resilience/retry.py)."""

from __future__ import annotations

import time

import msgspec
from prometheus_client import CollectorRegistry

from gateway.config.schema import config_from_dict
from gateway.endpoints import Endpoint, EndpointPool, EngineMetrics
from gateway.pipeline.generation import build_services
from gateway.resilience.outcome import Outcome
from gateway.resilience.retry import Retries, RetryBudget, RetryConfig
from tests.support.factories import Clock


def test_budget_is_a_floor_plus_a_share_of_recent_requests():
    clock = Clock(500.0)
    cfg = RetryConfig(budget_percent=20, budget_min=2, budget_window_s=10)
    b = RetryBudget(cfg.budget_window_s, clock)
    spent = 0
    while b.allows(cfg):             # no traffic: the floor only
        b.spend()
        spent += 1
    assert spent == 2
    for _ in range(50):
        b.request()
    while b.allows(cfg):
        b.spend()
        spent += 1
    assert spent == 12               # 2 + 20 % of 50
    clock.t += 10.5                # the window moved on: requests and retries forgotten
    assert b.allows(cfg)
    assert RetryBudget(10, clock).allows(RetryConfig(budget_min=0, budget_percent=0)) is False


def eps(n):
    return [Endpoint(url=f"http://127.0.0.1:{9000 + i}", model="m") for i in range(n)]


def test_others_and_denials():
    clock = Clock(500.0)
    r = Retries(lambda _m: RetryConfig(max_retries=1, budget_min=1, budget_percent=0), CollectorRegistry(),
                clock=clock)
    a, b, c = eps(3)
    assert r.others("m", Outcome.CLIENT_ERROR, a, 0, [a, b, c], [a]) is None
    assert r.others("m", Outcome.SUCCESS, a, 0, [a, b, c], [a]) is None
    assert r.others("m", Outcome.FAULT, a, 1, [a, b, c], [a]) is None          # max_retries
    b.ejected = True
    assert r.others("m", Outcome.FAULT, a, 0, [a, b, c], [a]) == [c]            # ready ones, not tried
    assert r.others("m", Outcome.FAULT, a, 0, [a, b, c], [a]) is None           # budget: the floor of 1 is spent
    denied = {s.labels["reason"]: s.value for f in r.metrics.denied.collect() for s in f.samples
              if s.name.endswith("_total")}
    assert denied == {"max_retries": 1, "budget": 1}


def test_backpressure_goes_only_where_there_is_headroom():
    r = Retries(lambda _m: RetryConfig(budget_min=100), CollectorRegistry())
    busy, idle, queued, unknown = eps(4)
    busy.in_flight = 3
    idle.metrics = EngineMetrics(scraped_at=1e12, waiting=0)
    queued.metrics = EngineMetrics(scraped_at=1e12, waiting=4)
    unknown.in_flight = 5            # no fresh metrics: compared by in-flight requests
    assert r.others("m", Outcome.BACKPRESSURE, busy, 0, [busy, idle, queued, unknown], [busy]) == [idle]
    unknown.in_flight = 1
    assert r.others("m", Outcome.BACKPRESSURE, busy, 0, [busy, queued, unknown], [busy]) == [unknown]
    off = Retries(lambda _m: RetryConfig(on_backpressure=False), CollectorRegistry())
    assert off.others("m", Outcome.BACKPRESSURE, busy, 0, [busy, idle], [busy]) is None
    assert off.others("m", Outcome.FAULT, busy, 0, [busy, idle], [busy]) == [idle]


def test_a_reload_keeps_a_budget_whose_window_is_unchanged_and_starts_one_whose_window_changed():
    clock = Clock(500.0)
    ten = RetryConfig(budget_percent=10, budget_min=0, budget_window_s=10)
    r = Retries(lambda _m: ten, CollectorRegistry(), clock=clock)
    a, b = eps(2)
    for _ in range(20):
        r.request("m")
    assert r.others("m", Outcome.FAULT, a, 0, [a, b], [a]) == [b]     # 10 % of 20 requests: 2 retries
    r.reconfigure(lambda _m: RetryConfig(budget_percent=10, budget_min=0, budget_window_s=10))
    assert r.others("m", Outcome.FAULT, a, 0, [a, b], [a]) == [b]     # the same window: the counts stay
    assert r.others("m", Outcome.FAULT, a, 0, [a, b], [a]) is None
    r.reconfigure(lambda _m: RetryConfig(budget_percent=10, budget_min=0, budget_window_s=30))
    for _ in range(10):
        r.request("m")                                                 # counted in the new window's budget
    assert r.others("m", Outcome.FAULT, a, 0, [a, b], [a]) == [b]
    assert r.others("m", Outcome.FAULT, a, 0, [a, b], [a]) is None


async def test_a_reload_that_changes_metrics_max_age_s_judges_headroom_by_the_new_age():
    """``routing.metrics_max_age_s`` reloads with the rest of ``routing``: a backpressure retry
    reads an engine's queue only from metrics younger than the live value. An engine whose last
    scrape, a second old, said 4 waiting is no retry's target while metrics live 600 s; once a
    reload makes them stale after 0.05 s, it is compared by in-flight requests and takes the
    retry. Before, the retries kept the age the gateway started with."""
    config = config_from_dict({"models": [{"name": "m", "endpoints": ["http://127.0.0.1:9000"]}],
                               "routing": {"metrics_max_age_s": 600.0}})
    services = build_services(config, EndpointPool())
    busy, queued = eps(2)
    busy.in_flight = 3
    queued.metrics = EngineMetrics(scraped_at=time.monotonic() - 1.0, waiting=4)
    assert services.retries.others("m", Outcome.BACKPRESSURE, busy, 0, [busy, queued], [busy]) is None
    services.follow(msgspec.structs.replace(config, routing=msgspec.structs.replace(config.routing,
                                                                                     metrics_max_age_s=0.05)))
    assert services.retries.others("m", Outcome.BACKPRESSURE, busy, 0, [busy, queued], [busy]) == [queued]
