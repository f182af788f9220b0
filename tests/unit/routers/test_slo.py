"""The slo strategy: predicted-feasible endpoints, prefix affinity among them, exploration, and
prefix-cache's behaviour for requests without objectives."""

from __future__ import annotations

import random
from collections import Counter
from functools import partial

import pytest

from gateway.endpoints import EngineMetrics
from routers.prefix_cache import PrefixCacheRouter
from routers.slo import SloRouter
from tests.support.factories import Clock, endpoints, inference_request, router_ctx

BLOCK = 8
make_req = partial(inference_request, model="m")


def setup(n: int = 2, seed: int = 1, **knobs):
    clock = Clock()
    ctx, fallbacks = router_ctx(seed, clock, prefix_block_chars=BLOCK, slo_min_samples=4, **knobs)
    return SloRouter(ctx), ctx, endpoints(n), fallbacks


def teach(ctx, ep, ttft_base: float, ttft_per_ktoken: float, tpot: float, per_running: float = 0.0) -> None:
    """Observations of an engine with TTFT = base + per_ktoken x uncached ktokens and a TPOT."""
    model = ctx.latency
    for tokens in (200, 800, 1600, 3000, 400, 2400):
        for running in (0, 2, 4):
            ep.in_flight = running
            f = model.features(tokens, ep, 0.0)
            model.observe(ep, f, ttft_base + ttft_per_ktoken * tokens / 1000, tpot + per_running * running)
    ep.in_flight = 0


_unique = iter(range(10**9))


def slo_req(text: str | None = None, *, ttft=None, tpot=None, tokens=1000, stream=True, **kw):
    """A request with objectives, streamed unless told; by default a prompt no endpoint holds."""
    if text is None:
        text = f"{next(_unique)}: a question of no consequence. " * 4
    req = make_req(text, tokens=tokens, slo_ttft_ms=ttft, slo_tpot_ms=tpot, **kw)
    req.stream = stream
    return req


def test_a_tight_ttft_goes_to_the_fast_engine_and_a_loose_one_is_packed_on_the_slow():
    router, ctx, (fast, slow), fallbacks = setup(slo_exploration=0.0)
    teach(ctx, fast, 30, 100, 10)          # 1000 tokens: 130 ms
    teach(ctx, slow, 100, 600, 30)         # 1000 tokens: 700 ms
    d = router.route(slo_req(ttft=300), [fast, slow])
    assert d.endpoint is fast and d.reason == "slo_feasible" and d.strategy == "slo"
    d = router.route(slo_req(ttft=2000), [fast, slow])
    assert d.endpoint is slow and d.reason == "slo_feasible"       # the least room left: fast stays free
    assert not fallbacks


def test_spread_takes_the_lowest_predicted_latency_instead():
    router, ctx, (fast, slow), _ = setup(slo_exploration=0.0, slo_select="spread")
    teach(ctx, fast, 30, 100, 10)
    teach(ctx, slow, 100, 600, 30)
    assert router.route(slo_req(ttft=2000), [fast, slow]).endpoint is fast


def test_the_tpot_objective_counts_too():
    router, ctx, (fast, slow), _ = setup(slo_exploration=0.0)
    teach(ctx, fast, 100, 600, 10)         # slow prefill, fast decode
    teach(ctx, slow, 30, 100, 40)          # fast prefill, slow decode
    d = router.route(slo_req(ttft=5000, tpot=20), [fast, slow])
    assert d.endpoint is fast
    d = router.route(slo_req(ttft=300, tpot=60), [fast, slow])
    assert d.endpoint is slow


def test_the_margin_keeps_predictions_off_the_edge():
    router, ctx, (fast, slow), _ = setup(slo_exploration=0.0, slo_margin=0.1)
    teach(ctx, fast, 30, 100, 10)          # 130 ms
    teach(ctx, slow, 100, 600, 30)         # 700 ms: 0.93 of 750, over 0.9
    assert router.route(slo_req(ttft=750), [fast, slow]).endpoint is fast
    assert router.route(slo_req(ttft=800), [fast, slow]).endpoint is slow


def test_load_makes_an_endpoint_infeasible():
    router, ctx, (fast, slow), _ = setup(slo_exploration=0.0)
    teach(ctx, fast, 30, 100, 10, per_running=5)
    teach(ctx, slow, 100, 600, 30)
    model = ctx.latency
    model.observe(fast, model.features(1000, fast, 0.0), None, None, service_ms=800)   # a slot frees every 200 ms
    fast.metrics = EngineMetrics(scraped_at=ctx.clock(), running=3, waiting=0, gateway_in_flight=0)
    assert router.route(slo_req(ttft=500), [fast, slow]).endpoint is fast
    fast.metrics = EngineMetrics(scraped_at=ctx.clock(), running=4, waiting=5, gateway_in_flight=0)
    d = router.route(slo_req(ttft=800), [fast, slow])
    assert d.endpoint is slow and d.reason == "slo_feasible"


def test_no_endpoint_predicted_to_meet_it_takes_the_least_late_and_says_so():
    router, ctx, (fast, slow), fallbacks = setup(slo_exploration=0.0)
    teach(ctx, fast, 30, 100, 10)
    teach(ctx, slow, 100, 600, 30)
    d = router.route(slo_req(ttft=50), [fast, slow])
    assert d.endpoint is fast and d.reason == "slo_infeasible"
    assert fallbacks == Counter({("slo", "slo_infeasible"): 1})


def test_prefix_affinity_counts_among_the_feasible():
    router, ctx, (a, b), _ = setup(slo_exploration=0.0)
    teach(ctx, a, 30, 100, 10)
    teach(ctx, b, 60, 200, 10)
    system = "You are the switchyard's helpful assistant. " * 30
    assert router.route(slo_req(ttft=5000), [a, b]).endpoint is b      # packed: b has less room
    ctx.prefix_index.insert(slo_req(system + "first question"), a)     # but a holds this prompt
    d = router.route(slo_req(system + "second question", ttft=5000, tokens=1000), [a, b])
    assert d.endpoint is a and d.prefix_match and d.prefix_match > 90


def test_a_holder_predicted_too_slow_is_passed_over():
    router, ctx, (fast, slow), _ = setup(slo_exploration=0.0)
    teach(ctx, fast, 30, 100, 10)
    teach(ctx, slow, 400, 600, 30)
    system = "You are the switchyard's helpful assistant. " * 30
    ctx.prefix_index.insert(slo_req(system + "first"), slow)
    d = router.route(slo_req(system + "second", ttft=300, tokens=1000), [fast, slow])
    assert d.endpoint is fast


def test_before_every_candidate_has_observations_it_routes_as_prefix_cache():
    router, ctx, (a, b), fallbacks = setup(slo_exploration=0.0)
    teach(ctx, a, 30, 100, 10)
    a.in_flight, b.in_flight = 3, 0
    d = router.route(slo_req(ttft=300), [a, b])
    assert d.endpoint is b and d.reason == "slo_no_model"       # prefix-cache: the least loaded
    assert fallbacks[("slo", "no_model")] == 1
    # a TPOT-only objective needs only the TPOT models
    teach(ctx, b, 30, 100, 10)
    assert router.route(slo_req(tpot=50), [a, b]).reason == "slo_feasible"


@pytest.mark.parametrize("rate", [0.0, 0.1, 0.3])
def test_the_exploration_rate_is_honoured(rate):
    router, ctx, (fast, slow), _ = setup(seed=42, slo_exploration=rate)
    teach(ctx, fast, 30, 100, 10)
    teach(ctx, slow, 100, 600, 30)
    n = 4000
    reasons = Counter(router.route(slo_req(ttft=300, request_id=str(i)), [fast, slow]).reason
                      for i in range(n))
    assert reasons["slo_explore"] / n == pytest.approx(rate, abs=0.02)
    assert reasons["slo_explore"] + reasons["slo_feasible"] == n
    assert _explored(seed=7, rate=rate) == _explored(seed=7, rate=rate)    # the same seed, the same choices


def test_an_endpoint_unobserved_for_slo_reobserve_s_gets_one_request_at_a_time():
    router, ctx, (fast, slow), _ = setup(slo_exploration=0.0, slo_reobserve_s=60.0)
    teach(ctx, fast, 30, 100, 10)
    teach(ctx, slow, 100, 600, 30)
    model, clock = ctx.latency, ctx.clock

    def serve(ep) -> None:                      # what the request routed there shows
        model.observe(ep, model.features(1000, ep, 0.0), 130.0, 10.0)

    reasons = []
    for i in range(300):                        # 2.5 minutes; slow answers none of its requests
        clock.t += 0.5
        # a non-streamed answer would show nothing: the next one
        d = router.route(slo_req(ttft=300, stream=i not in (120, 121)), [fast, slow])
        reasons.append((d.endpoint, d.reason))
        if d.endpoint is fast:
            serve(fast)
    sent = [i for i, r in enumerate(reasons) if r == (slow, "slo_reobserve")]
    assert sent == [122, 243]                   # past 60 s after what it last showed, then after that request
    assert all(r == (fast, "slo_feasible") for i, r in enumerate(reasons) if i not in sent)
    # what a re-observed endpoint shows counts: from then on it is judged by it
    serve(slow)
    assert router.route(slo_req(ttft=300), [fast, slow]).reason == "slo_feasible"
    # 0: never
    router, ctx, (fast, slow), _ = setup(slo_exploration=0.0, slo_reobserve_s=0.0)
    teach(ctx, fast, 30, 100, 10)
    teach(ctx, slow, 100, 600, 30)
    ctx.clock.t += 3600
    reqs = [slo_req(ttft=300) for _ in range(20)]
    assert {router.route(req, [fast, slow]).endpoint for req in reqs} == {fast}


def test_a_request_sent_to_reobserve_that_observed_nothing_lets_the_next_go_once():
    """slow is sent a request to observe it; that request observes nothing there (the engine
    refused it, the retry went elsewhere): the next streamed request goes to slow again. When that
    one observes nothing either, slow waits slo_reobserve_s, as an engine that keeps refusing must
    not take the first try of every request; one that did observe it starts the count anew."""
    router, ctx, (fast, slow), _ = setup(slo_exploration=0.0, slo_reobserve_s=60.0)
    teach(ctx, fast, 30, 100, 10)
    teach(ctx, slow, 100, 600, 30)
    model, clock = ctx.latency, ctx.clock
    clock.t += 61
    model.observe(fast, model.features(1000, fast, 0.0), 130.0, 10.0)

    def route() -> tuple:
        d = router.route(slo_req(ttft=300), [fast, slow])
        return d.endpoint, d.reason

    for _ in range(2):                          # each time slo_reobserve_s has passed
        assert route() == (slow, "slo_reobserve")
        model.unobserved(slow, model.reobserved(slow))
        assert route() == (slow, "slo_reobserve")       # tried again at once
        model.unobserved(slow, model.reobserved(slow))
        assert route() == (fast, "slo_feasible")        # the second in a row: it waits
        clock.t += 61
        model.observe(fast, model.features(1000, fast, 0.0), 130.0, 10.0)
    assert route() == (slow, "slo_reobserve")
    model.observe(slow, model.features(1000, slow, 0.0), 130.0, 10.0)     # observed: a fresh start
    assert route()[1] == "slo_feasible" and not model._models[slow].again


def test_a_non_streamed_request_is_not_sent_exploring():
    """A non-streamed answer has no first token to time and teaches the models nothing: sent to a
    random endpoint, it would only risk its objectives. It is routed on the predictions; the
    streamed requests explore at the rate asked for."""
    router, ctx, (fast, slow), _ = setup(seed=42, slo_exploration=0.3)
    teach(ctx, fast, 30, 100, 10)
    teach(ctx, slow, 100, 600, 30)
    reasons = Counter()
    for _ in range(400):
        d = router.route(slo_req(ttft=300, stream=False), [fast, slow])
        reasons[d.endpoint is fast, d.reason] += 1
    assert reasons == {(True, "slo_feasible"): 400}
    streamed = [router.route(slo_req(ttft=300), [fast, slow]).reason for _ in range(400)]
    assert Counter(streamed)["slo_explore"] / 400 == pytest.approx(0.3, abs=0.08)


def _explored(seed: int, rate: float) -> list[int]:
    router, ctx, eps, _ = setup(seed=seed, slo_exploration=rate)
    teach(ctx, eps[0], 30, 100, 10)
    teach(ctx, eps[1], 100, 600, 30)
    return [i for i in range(300) if router.route(slo_req(ttft=300), eps).reason == "slo_explore"]


def test_without_objectives_it_routes_exactly_as_prefix_cache():
    slo, sctx, seps, sfb = setup(n=4, seed=9)
    ctx, pfb = router_ctx(9, Clock(), prefix_block_chars=BLOCK)
    prefix = PrefixCacheRouter(ctx)
    peps = endpoints(4)
    systems = [f"system prompt number {k}, be brief. " * 6 for k in range(5)]
    for i in range(300):
        text = systems[i % 5] + f"question {i % 7}"
        loads = [(i * 7 + k * 3) % 5 for k in range(4)]
        for ep, p, load in zip(seps, peps, loads, strict=True):
            ep.in_flight = p.in_flight = load
        a = slo.route(make_req(text, request_id=str(i)), seps)
        b = prefix.route(make_req(text, request_id=str(i)), peps)
        assert seps.index(a.endpoint) == peps.index(b.endpoint)
        assert a.prefix_match == b.prefix_match and a.reason == b.reason == ""
        assert a.strategy == "slo"
    assert {r for _, r in sfb} == {r for _, r in pfb}
    assert sum(sfb.values()) == sum(pfb.values())


def test_it_is_registered_and_routes_alone():
    from routers.registry import default_registry

    ctx, _ = router_ctx(1)
    reg = default_registry(ctx)
    assert isinstance(reg.get("slo"), SloRouter)
    assert reg.get("least-request:1,slo:1") is reg.get("slo")


def test_a_decision_with_objectives_leaves_its_record_for_after_the_leg():
    router, ctx, (fast, slow), _ = setup(slo_exploration=0.0)
    teach(ctx, fast, 30, 100, 10)
    teach(ctx, slow, 100, 600, 30)
    req = slo_req(ttft=300)
    d = router.decide(req, [fast, slow])
    assert d.endpoint is fast and d.reason == "slo_feasible" and d.learn is not None
    assert ctx.prefix_index.match(req, [fast, slow]) == {fast: 0.0, slow: 0.0}   # not recorded yet
    d.learn()
    assert ctx.prefix_index.match(req, [fast, slow])[fast] == 100.0


def test_a_recovered_engine_gets_its_traffic_back_within_minutes():
    """Three engines at 10 requests a second, spread: a is slow for a minute, then the fastest.
    Meanwhile only exploring requests (about 1.7% of them) observe a; what it showed a minute ago
    must lose weight with time, not only with a's own observations, so that a few minutes later
    (a few half-lives: about two and a half at the default 30 s) it is predicted fast and takes the
    requests again."""
    router, ctx, eps, _ = setup(n=3, seed=5, slo_select="spread")
    a = eps[0]
    model, clock = ctx.latency, ctx.clock
    rng = random.Random(5)

    def serve(ep, a_slow: bool) -> None:
        f = model.features(1000, ep, 0.0)
        base = (1000.0 if a_slow else 50.0) if ep is a else 100.0
        model.observe(ep, f, base + rng.gauss(0, 5), 10.0)

    for ep in eps:
        for _ in range(20):
            serve(ep, True)
    to_a: list[str] = []
    for i in range(3600):                       # 6 minutes; a recovers after the first
        clock.t += 0.1
        d = router.route(slo_req(ttft=2000), eps)
        serve(d.endpoint, a_slow=i < 600)
        if i >= 600 + 2400 and d.endpoint is a:     # from 4 minutes after its recovery
            to_a.append(d.reason)
    assert to_a.count("slo_feasible") > 300, Counter(to_a)
