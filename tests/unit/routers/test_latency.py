"""The endpoints' latency model: an online linear fit that learns, follows drift and stays small."""

from __future__ import annotations

import math
import random

import pytest

from gateway.endpoints import EngineMetrics
from routers.base import RoutingSettings
from routers.latency import MAX_ENDPOINTS, Features, LatencyModel, OnlineRegression
from tests.support.factories import Clock, endpoints


def _model(clock: Clock | None = None, **knobs) -> LatencyModel:
    return LatencyModel(RoutingSettings(**knobs), clock or Clock())


def _ttft(f: Features) -> float:   # the "engine": the wait, + 20 ms + 5 per running + 400 per 1k uncached + 30 x KV
    x = f.ttft
    return f.queue_ms + 20 + 5 * x[1] + 400 * x[2] + 30 * x[3]


def _tpot(x) -> float:
    return 8 + 1.5 * x[1] + 4 * x[2] + 2 * x[3]


def _random_features(rng: random.Random) -> Features:
    queue, running = rng.choice([0.0, 0.0, rng.uniform(0, 3000)]), rng.randint(0, 32)
    kv, uncached, prompt = rng.random(), rng.uniform(0, 4), rng.uniform(0, 8)
    return Features(queue, (1.0, running, uncached, kv), (1.0, running + 1.0, kv, prompt))


def test_it_learns_a_linear_relation_from_observations():
    # within a percent: the prior pulls each slope toward 0 by about RIDGE / its feature's weighted
    # spread (here 0.1 / 7 on KV usage, which moves latency least)
    model, (ep,) = _model(slo_forgetting=0.99), endpoints(1)
    rng = random.Random(3)
    for _ in range(200):
        f = _random_features(rng)
        model.observe(ep, f, _ttft(f), _tpot(f.tpot))
    for _ in range(50):
        f = _random_features(rng)
        ttft, tpot = model.predict(ep, f)
        assert ttft == pytest.approx(_ttft(f), rel=1e-2)
        assert tpot == pytest.approx(_tpot(f.tpot), rel=1e-2)
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
    assert all(math.isfinite(v) for row in reg.cxx for v in row) and reg.w[2] == 0.0
    assert reg.predict((1.0, 2.0, 0.0)) == pytest.approx(20, rel=1e-3)
    assert reg.predict((1.0, 2.0, 0.5)) == pytest.approx(20, rel=1e-3)      # a weight it never learnt: none


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
        model.observe(ep, f, _ttft(f), _tpot(f.tpot))
    m = model._models[ep]
    assert len(m.ttft.w) == 4 and len(m.ttft.cxx) == 3 and len(m.tpot.w) == 4
    model.forget(ep)
    assert model.samples(ep) == (0, 0)


def test_what_exceeds_the_largest_batch_the_engine_reported_waits():
    clock = Clock(100.0)
    model, (ep,) = _model(clock, metrics_max_age_s=10.0), endpoints(1, [5])
    assert model.load(ep, clock()) == (0.0, 5.0, 0.0)                 # never scraped: all running
    # 8 running and 2 waiting at the scrape, 3 of them this gateway's: 7 are other gateways'
    ep.metrics = EngineMetrics(scraped_at=99.0, running=8, waiting=2, kv_usage=0.5, gateway_in_flight=3)
    assert model.load(ep, clock()) == (4.0, 8.0, 0.5)                 # 5 + 7 on a batch of 8
    ep.metrics = EngineMetrics(scraped_at=99.5, running=3, waiting=0, kv_usage=0.2, gateway_in_flight=3)
    assert model.load(ep, clock()) == (0.0, 5.0, 0.2)
    ep.in_flight = 10
    assert model.load(ep, clock()) == (2.0, 8.0, 0.2)                 # the batch seen before still holds
    ep.metrics = EngineMetrics(scraped_at=80.0, running=1, waiting=0, kv_usage=0.9, gateway_in_flight=1)
    assert model.load(ep, clock()) == (2.0, 8.0, 0.0)                 # stale: this gateway's count alone
    model.forget(ep)
    assert model.load(ep, clock()) == (0.0, 10.0, 0.0)


def test_features_count_what_the_endpoint_holds_of_the_prompt():
    model, (ep,) = _model(), endpoints(1, [2])
    f = model.features(3000, ep, 1000.0)
    assert f.queue_ms == 0.0 and f.ttft == (1.0, 2.0, 2.0, 0.0)
    assert f.tpot == (1.0, 3.0, 0.0, 3.0)
    assert model.features(100, ep, 500.0).ttft[2] == 0.0


def test_a_full_batch_makes_the_request_wait_for_slots_at_the_service_time():
    clock = Clock(100.0)
    model, (ep,) = _model(clock, slo_min_samples=1), endpoints(1, [0])
    ep.metrics = EngineMetrics(scraped_at=99.0, running=4, waiting=0, gateway_in_flight=4)   # a batch of 4 seen
    f = model.features(1000, ep, 0.0)
    model.observe(ep, f, 100.0, 20.0, service_ms=2000.0)
    model.observe(ep, f, 100.0, 20.0, service_ms=1000.0)      # the mean: 1500 ms a request
    assert f.queue_ms == 0.0                                    # no service time known when it was taken
    # 4 running, this gateway's: a request now waits for one slot, one frees every 1500 / 4 ms
    ep.in_flight = 4
    f = model.features(1000, ep, 0.0)
    assert f.queue_ms == pytest.approx(375.0)
    assert model.predict(ep, f)[0] == pytest.approx(375.0 + 100.0, rel=1e-3)   # never seen queueing: still counted
    ep.in_flight = 6                                             # two waiting ahead: three slots
    assert model.features(1000, ep, 0.0).queue_ms == pytest.approx(1125.0)
    ep.in_flight = 3
    assert model.features(1000, ep, 0.0).queue_ms == 0.0


def test_four_features_unrolled_give_the_loops_floats_exactly():
    """The gateway's models have four features; their update and prediction are unrolled, and
    must give exactly what the general loops give, forgetting and a feature that stops moving included."""
    rng = random.Random(13)
    for forgetting in (1.0, 0.99, 0.9):
        fast, loops = OnlineRegression(4, forgetting), OnlineRegression(4, forgetting)
        for n in range(3000):
            x = (1.0, float(rng.randint(0, 32)), rng.uniform(0, 4), 0.0 if n < 1500 or n % 3 else rng.random())
            y = 20 + 5 * x[1] + 400 * x[2] + rng.gauss(0, 3)
            fast.update(x, y)
            loops._update(x, y)
            summed = 0.0
            for wi, v in zip(loops.w, x, strict=True):
                summed += wi * v
            assert fast.predict(x) == summed
        assert fast.w == loops.w and fast.cxx == loops.cxx and fast.cxy == loops.cxy and fast.n == loops.n
        assert fast.mean_x == loops.mean_x and fast.mean_y == loops.mean_y and fast.mass == loops.mass


def test_prompts_of_one_length_leave_the_fit_near_what_it_saw():
    """Prompts all of about one length (a few tokens either way): the uncached tokens move with the
    intercept, and KV usage with the running count, so the data cannot tell their weights apart. A
    request that moves them a little (a prefix hit, a fuller KV cache, a longer prompt) must still be
    predicted near the latencies observed, not at weights that drifted apart along the blind
    direction (thousands of ms per ktoken, the prediction clamped to 0)."""
    for seed in range(4):
        model, (ep,), rng = _model(slo_min_samples=1), endpoints(1), random.Random(seed)
        for _ in range(3000):
            tokens, running = 500 + rng.randint(-3, 3), rng.randint(0, 3)
            kv = running * tokens / 100_000
            f = Features(0.0, (1.0, running, tokens / 1000, kv), (1.0, running + 1.0, kv, tokens / 1000))
            model.observe(ep, f, 50 + 5 * running + rng.gauss(0, 30), 10 + rng.gauss(0, 2))
        for uncached, kv, prompt in ((0.5, 0.005, 0.5), (0.0, 0.005, 0.5), (0.5, 0.3, 0.5), (0.5, 0.005, 2.0)):
            ttft, tpot = model.predict(ep, Features(0.0, (1.0, 1.0, uncached, kv), (1.0, 2.0, kv, prompt)))
            assert 40 <= ttft <= 70, (seed, uncached, kv, model.weights(ep))     # 55 ms observed at 1 running
            assert 8 <= tpot <= 12, (seed, kv, prompt, model.weights(ep))


def test_what_an_endpoint_showed_long_ago_weighs_less_than_what_it_shows_now():
    """An engine observed slow at full traffic, then fast again but observed only by a few exploring
    requests (one every 10 s for 5 minutes): its prediction must follow what it shows now, not
    wait for a hundred new observations to outweigh a hundred old ones."""
    clock = Clock()
    model, (ep,) = _model(clock, slo_min_samples=1), endpoints(1)
    f = model.features(1000, ep, 0.0)
    for _ in range(300):
        clock.t += 0.1
        model.observe(ep, f, 1000.0, 50.0, service_ms=5000.0)
    for _ in range(30):
        clock.t += 10.0
        model.observe(ep, f, 100.0, 10.0, service_ms=500.0)
    ttft, tpot = model.predict(ep, f)
    assert ttft is not None and tpot is not None
    assert ttft < 150 and tpot < 15
    assert model._models[ep].service_ms < 750


def test_a_model_built_anew_takes_over_what_the_previous_one_learnt():
    clock = Clock()
    old = _model(clock, slo_forgetting=0.99)
    ep = endpoints(1)[0]
    for _ in range(3):
        old.observe(ep, old.features(1000, ep, 0.0), 100.0, 10.0)
    new = _model(clock, slo_forgetting=0.9, slo_min_samples=3)
    new.take_over(old)
    assert new.samples(ep) == (3, 3) and new.ready(ep, True, True)
    assert new.predict(ep, new.features(1000, ep, 0.0)) == (100.0, 10.0)    # old needs 8 to predict
    old.observe(ep, old.features(1000, ep, 0.0), 100.0, 10.0)     # a request routed before, ending after
    assert new.samples(ep) == (4, 4)
    assert new.weights(ep) == old.weights(ep) and new._models[ep].ttft.lam == 0.9
