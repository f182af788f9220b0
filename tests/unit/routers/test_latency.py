"""The endpoints' latency model: an online linear fit that learns, follows drift and stays small."""

from __future__ import annotations

import math
import random

import pytest

from gateway.endpoints import EngineMetrics
from routers.base import RoutingSettings
from routers.latency import MAX_ENDPOINTS, Features, LatencyModel, OnlineRegression, engine_load
from tests.support.factories import Clock, endpoints


def _model(clock: Clock | None = None, **knobs) -> LatencyModel:
    return LatencyModel(RoutingSettings(**knobs), clock or Clock())


def _ttft(x) -> float:        # the "engine": 20 ms + 150 per waiting + 5 per running + 400 per 1k uncached + 30 x KV
    return 20 + 150 * x[1] + 5 * x[2] + 400 * x[3] + 30 * x[4]


def _tpot(x) -> float:
    return 8 + 1.5 * x[1] + 4 * x[2] + 2 * x[3]


def _random_features(rng: random.Random) -> Features:
    waiting, running = rng.randint(0, 6), rng.randint(0, 32)
    kv, uncached, prompt = rng.random(), rng.uniform(0, 4), rng.uniform(0, 8)
    return Features((1.0, waiting, running, uncached, kv), (1.0, running + 1.0, kv, prompt))


def test_it_learns_a_linear_relation_from_observations():
    model, (ep,) = _model(slo_forgetting=0.99), endpoints(1)
    rng = random.Random(3)
    for _ in range(200):
        f = _random_features(rng)
        model.observe(ep, f, _ttft(f.ttft), _tpot(f.tpot))
    for _ in range(50):
        f = _random_features(rng)
        ttft, tpot = model.predict(ep, f)
        assert ttft == pytest.approx(_ttft(f.ttft), rel=1e-3)
        assert tpot == pytest.approx(_tpot(f.tpot), rel=1e-3)
    w = model.weights(ep)
    assert w["ttft"]["uncached_ktokens"] == pytest.approx(400, rel=1e-3)
    assert w["tpot"]["running"] == pytest.approx(1.5, rel=1e-3)


def test_with_noise_it_finds_the_mean():
    reg, rng = OnlineRegression(2, forgetting=1.0), random.Random(5)
    for _ in range(4000):
        x = (1.0, rng.uniform(0, 10))
        reg.update(x, 100 + 30 * x[1] + rng.gauss(0, 20))
    assert reg.w[0] == pytest.approx(100, abs=5) and reg.w[1] == pytest.approx(30, abs=1)


def test_it_follows_an_engine_that_gets_slower():
    reg, rng = OnlineRegression(2, forgetting=0.98), random.Random(7)
    for _ in range(300):
        x = (1.0, rng.uniform(0, 4))
        reg.update(x, 50 + 100 * x[1])
    for _ in range(300):                       # the engine now prefills three times slower
        x = (1.0, rng.uniform(0, 4))
        reg.update(x, 50 + 300 * x[1])
    assert reg.predict((1.0, 2.0)) == pytest.approx(650, rel=0.01)


def test_a_feature_that_never_moves_does_not_wind_the_fit_up():
    reg, rng = OnlineRegression(3, forgetting=0.9), random.Random(11)
    for _ in range(5000):                      # the third feature is always 0 (no KV gauge)
        x = (1.0, rng.uniform(0, 4), 0.0)
        reg.update(x, 10 + 5 * x[1])
    assert sum(reg.p[i][i] for i in range(3)) <= reg.cap * 1.0001
    assert all(math.isfinite(v) for row in reg.p for v in row)
    assert reg.predict((1.0, 2.0, 0.0)) == pytest.approx(20, rel=1e-3)


def test_without_observations_it_predicts_nothing():
    model, (ep, other) = _model(slo_min_samples=4), endpoints(2)
    f = model.features(1000, ep, 0.0)
    assert model.predict(ep, f) == (None, None)
    assert not model.ready(ep, True, False) and model.ready(ep, False, False)
    for _ in range(3):
        model.observe(ep, f, 100.0, None)
    assert not model.ready(ep, True, False)
    model.observe(ep, f, 100.0, None)
    assert model.ready(ep, True, False) and not model.ready(ep, True, True)
    assert model.predict(ep, f)[0] == pytest.approx(100.0, rel=1e-3)
    assert model.predict(ep, f)[1] is None
    assert model.predict(other, f) == (None, None) and model.samples(ep) == (4, 0)


def test_memory_is_bounded_per_endpoint_and_in_endpoints():
    model, rng = _model(), random.Random(1)
    eps = endpoints(MAX_ENDPOINTS + 10)
    for ep in eps:
        model.observe(ep, _random_features(rng), 10.0, 1.0)
    assert len(model) == MAX_ENDPOINTS
    assert model.samples(eps[0]) == (0, 0) and model.samples(eps[-1]) == (1, 1)   # the oldest went first
    ep = eps[-1]
    for _ in range(500):
        f = _random_features(rng)
        model.observe(ep, f, _ttft(f.ttft), _tpot(f.tpot))
    m = model._models[ep]
    assert len(m.ttft.w) == 5 and len(m.ttft.p) == 5 and len(m.tpot.w) == 4
    model.forget(ep)
    assert model.samples(ep) == (0, 0)


def test_the_load_is_the_last_scrape_moved_by_what_the_gateway_sent_since():
    clock = Clock(100.0)
    (ep,) = endpoints(1, [5])
    assert engine_load(ep, clock(), 10.0) == (0.0, 5.0, 0.0)          # never scraped: the gateway's count
    ep.metrics = EngineMetrics(scraped_at=99.0, running=8, waiting=2, kv_usage=0.5, gateway_in_flight=3)
    assert engine_load(ep, clock(), 10.0) == (4.0, 8, 0.5)             # full: the 2 newcomers queue
    ep.metrics = EngineMetrics(scraped_at=99.0, running=3, waiting=0, kv_usage=0.2, gateway_in_flight=3)
    assert engine_load(ep, clock(), 10.0) == (0.0, 5.0, 0.2)           # room: they run
    ep.in_flight = 0
    assert engine_load(ep, clock(), 10.0) == (0.0, 0.0, 0.2)
    ep.metrics = EngineMetrics(scraped_at=80.0, running=3, waiting=4, gateway_in_flight=3)
    assert engine_load(ep, clock(), 10.0) == (0.0, 0.0, 0.0)           # stale: the gateway's count again


def test_features_count_what_the_endpoint_holds_of_the_prompt():
    model, (ep,) = _model(), endpoints(1, [2])
    f = model.features(3000, ep, 1000.0)
    assert f.ttft == (1.0, 0.0, 2.0, 2.0, 0.0)
    assert f.tpot == (1.0, 3.0, 0.0, 3.0)
    assert model.features(100, ep, 500.0).ttft[3] == 0.0
