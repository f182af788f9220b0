"""least-kv-cache, least-waiting, throughput, least-latency on engine metrics."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.endpoints import EngineMetrics
from routers.metrics_based import LeastKVCacheRouter, LeastLatencyRouter, LeastWaitingRouter, ThroughputRouter
from routers.registry import default_registry
from tests.support.factories import Clock
from tests.unit.routers.metrics_helpers import ctx_for, make_eps, make_req, snap

# -- least-kv-cache --------------------------------------------------------------------------------


def test_least_kv_cache_picks_the_lowest_usage():
    ctx, fallbacks = ctx_for()
    router = LeastKVCacheRouter(ctx)
    eps = make_eps(3)
    for ep, kv in zip(eps, (0.7, 0.2, 0.5), strict=True):
        ep.metrics = snap(kv_usage=kv)
    assert router.route(make_req(), eps).endpoint is eps[1]
    assert router.score(make_req(), eps)[0] == 0.7
    assert not fallbacks


def test_least_kv_cache_ties_go_to_the_least_in_flight():
    ctx, _ = ctx_for()
    router = LeastKVCacheRouter(ctx)
    eps = make_eps(3, in_flight=[4, 1, 3])
    for ep in eps:
        ep.metrics = snap(kv_usage=0.25)
    assert router._pick(eps, router._scores(eps)[0]) is eps[1]


def test_least_kv_cache_counts_what_it_sent_since_the_scrape():
    """A burst between two scrapes fills the emptiest pool with its prompt tokens, not blindly."""
    ctx, _ = ctx_for()
    router = LeastKVCacheRouter(ctx)
    eps = make_eps(2)
    eps[0].metrics = snap(kv_usage=0.10, kv_capacity_tokens=10_000)
    eps[1].metrics = snap(kv_usage=0.20, kv_capacity_tokens=10_000)
    picks = [router.route(make_req(tokens=500), eps).endpoint for _ in range(6)]
    # 0.10 + 500/10000 per request: the first two go to eps[0] (0.20 ties, in-flight equal at 0)
    assert picks.count(eps[0]) == 4 and picks.count(eps[1]) == 2
    eps[0].metrics = snap(t=1001.0, kv_usage=0.10, kv_capacity_tokens=10_000)   # a new scrape: reset
    assert router.route(make_req(tokens=500), eps).endpoint is eps[0]


@pytest.mark.parametrize("router_cls", [LeastKVCacheRouter, LeastWaitingRouter, ThroughputRouter,
                                        LeastLatencyRouter])
def test_without_metrics_it_is_least_request_and_says_why(router_cls):
    clock = Clock()
    ctx, fallbacks = ctx_for(clock=clock)
    router = router_cls(ctx)
    eps = make_eps(3, in_flight=[5, 2, 9])
    assert router.route(make_req(), eps).endpoint is eps[1]
    assert fallbacks == {(router.name, "no_metrics"): 1}
    for ep in eps:                                     # scraped once, then the scraper stalls
        ep.metrics = snap(t=clock.t, kv_usage=0.1, waiting=0.0, prompt_tokens_total=10.0,
                          generation_tokens_total=10.0, prompt_throughput=1.0, gen_throughput=1.0,
                          ttft_recent_mean=0.1)
    clock.t += 10.5                                    # older than metrics_max_age_s: missing
    assert router.route(make_req(), eps).endpoint is eps[1]
    assert fallbacks[(router.name, "stale_metrics")] == 1
    assert router.score(make_req(), eps) == [None, None, None]
    assert fallbacks[(router.name, "stale_metrics")] == 2


def test_endpoints_without_fresh_metrics_go_by_their_in_flight():
    """A stale or missing snapshot is not read (however good it looks), nor is its endpoint left
    out: it is chosen when it has fewer requests in flight than the best scored one."""
    clock = Clock()
    ctx, fallbacks = ctx_for(clock=clock)
    router = LeastKVCacheRouter(ctx)
    eps = make_eps(3, in_flight=[3, 1, 2])
    eps[0].metrics = snap(t=clock.t - 20, kv_usage=0.0)      # stale, though it looks best
    eps[1].metrics = snap(kv_usage=0.6)
    eps[2].metrics = None
    assert router.route(make_req(), eps).endpoint is eps[1]
    assert not fallbacks
    eps[0].in_flight = 0
    assert router.route(make_req(), eps).endpoint is eps[0]
    assert fallbacks == {("least-kv-cache", "stale_metrics"): 1}
    eps[0].in_flight = 3
    eps[2].in_flight = 0
    assert router.route(make_req(), eps).endpoint is eps[2]
    assert fallbacks[("least-kv-cache", "no_metrics")] == 1


# -- least-waiting ---------------------------------------------------------------------------------


def test_least_waiting_picks_the_shortest_queue_and_spreads_a_burst():
    ctx, _ = ctx_for()
    router = LeastWaitingRouter(ctx)
    eps = make_eps(4)
    for ep, w in zip(eps, (3, 0, 0, 5), strict=True):
        ep.metrics = snap(waiting=float(w))
    picks = Counter()
    for _ in range(9):                                  # 9 requests before the next scrape
        ep = router.route(make_req(), eps).endpoint
        ep.in_flight += 1                               # charged, as the pipeline does
        picks[ep] += 1
    # eps[1] and eps[2] take 3 each; at 3 all three tie and eps[0] (no in-flight) takes one; then
    # eps[1] and eps[2] one more each; eps[3] (5 waiting) none
    assert (picks[eps[0]], picks[eps[1]], picks[eps[2]], picks[eps[3]]) == (1, 4, 4, 0)


# -- throughput ------------------------------------------------------------------------------------


def test_throughput_uses_counters_over_the_window():
    clock = Clock()
    ctx, _ = ctx_for(clock=clock, metrics_window_s=10.0)
    router = ThroughputRouter(ctx)
    eps = make_eps(2)
    # like AIBrix's decode case: throughput {50, 3000} → the first (lowest) endpoint
    eps[0].metrics = snap(t=990.0, prompt_tokens_total=0.0, generation_tokens_total=0.0)
    eps[1].metrics = snap(t=990.0, prompt_tokens_total=0.0, generation_tokens_total=0.0)
    router.score(make_req(), eps)
    eps[0].metrics = snap(t=1000.0, prompt_tokens_total=100.0, generation_tokens_total=300.0)   # 50 tok/s
    eps[1].metrics = snap(t=1000.0, prompt_tokens_total=10_000.0, generation_tokens_total=10_000.0)
    assert router.score(make_req(), eps) == [pytest.approx(2 * 10 + 30), pytest.approx(2 * 1000 + 1000)]
    assert router.route(make_req(), eps).endpoint is eps[0]


def test_throughput_window_slides_and_survives_a_restart():
    clock = Clock()
    ctx, _ = ctx_for(clock=clock, metrics_window_s=10.0)
    router = ThroughputRouter(ctx)
    ep = make_eps(1)
    for t, total in ((980.0, 0.0), (990.0, 1000.0), (1000.0, 1100.0)):
        ep[0].metrics = snap(t=t, prompt_tokens_total=total, generation_tokens_total=0.0)
        router.score(make_req(), ep)
    assert router.score(make_req(), ep) == [pytest.approx(2 * 100 / 10)]     # only the last 10 s
    ep[0].metrics = snap(t=1005.0, prompt_tokens_total=50.0, generation_tokens_total=0.0)   # restarted
    # the window starts at its first snapshot inside it (1000): 50 tokens since over 5 s
    assert router.score(make_req(), ep) == [pytest.approx(2 * 50 / 5)]


def test_throughput_counts_its_own_decisions_until_the_engines_show_them():
    """The engines' counters lag; what the router sent in the window counts at once, across scrapes."""
    clock = Clock()
    ctx, _ = ctx_for(clock=clock, metrics_window_s=10.0)
    router = ThroughputRouter(ctx)
    eps = make_eps(2)
    for ep in eps:
        ep.metrics = snap(t=995.0, prompt_tokens_total=0.0, generation_tokens_total=0.0)
    router.score(make_req(), eps)
    eps[0].metrics = snap(t=1000.0, prompt_tokens_total=0.0, generation_tokens_total=0.0)        # idle
    eps[1].metrics = snap(t=1000.0, prompt_tokens_total=500.0, generation_tokens_total=0.0)      # 200/s
    picks = Counter(router.route(make_req(tokens=100), eps).endpoint for _ in range(20))
    # eps[1] runs at 2 · 100 tokens/s; each decision adds 2 · 100 / 10 s = 20/s to a sent rate: eps[0]
    # takes the first 10 (up to 200/s), then eps[1] catches up with its own decisions: about even
    assert picks[eps[0]] + picks[eps[1]] == 20 and 10 <= picks[eps[0]] <= 11
    clock.t += 1.0
    for ep in eps:                                             # a new scrape that does not show it yet
        ep.metrics = snap(t=1001.0, prompt_tokens_total=ep.metrics.prompt_tokens_total,
                          generation_tokens_total=0.0)
    assert router.score(make_req(), eps)[0] == pytest.approx(20.0 * picks[eps[0]])
    clock.t += 10.0                                            # the window moved past the burst
    assert router.sent_rate(eps[0], clock.t) == 0.0


def test_throughput_window_does_not_reach_back_across_a_pause():
    """After a pause longer than the window, the snapshot last seen before it is no start for the
    window: the burst before the pause is not in the true 10 s rates (all 0), so it weighs nothing
    (the endpoint busiest in the burst took nothing of the next 30 requests, split 19/11/0)."""
    clock = Clock(990.0)
    ctx, _ = ctx_for(clock=clock, metrics_window_s=10.0)
    router = ThroughputRouter(ctx)
    eps = make_eps(3)
    per_s = (300.0, 150.0, 0.0)                     # the burst's prompt tokens/s on each engine
    for t in (990.0, 992.0, 994.0, 996.0, 998.0, 1000.0):          # scraped every 2 s, routed between
        clock.t = t
        for ep, rate in zip(eps, per_s, strict=True):
            ep.metrics = snap(t=t, prompt_tokens_total=rate * (t - 990.0), generation_tokens_total=0.0,
                              prompt_throughput=rate, gen_throughput=0.0)
        router.score(make_req(), eps)
    # the engines finish the burst within a second, then nothing for 12 s; a scrape as the traffic resumes
    clock.t = 1012.0
    for ep, rate in zip(eps, per_s, strict=True):
        ep.metrics = snap(t=1012.0, prompt_tokens_total=rate * 11.0, generation_tokens_total=0.0,
                          prompt_throughput=0.0, gen_throughput=0.0)
    assert router.score(make_req(), eps) == [0.0, 0.0, 0.0]
    picks = Counter()
    for _ in range(30):
        ep = router.route(make_req(), eps).endpoint
        ep.in_flight += 1
        picks[ep] += 1
    assert [picks[ep] for ep in eps] == [10, 10, 10]


def test_throughput_single_snapshot_uses_the_scrapers_rates():
    ctx, _ = ctx_for()
    router = ThroughputRouter(ctx)
    eps = make_eps(2)
    eps[0].metrics = snap(prompt_throughput=100.0, gen_throughput=10.0)
    eps[1].metrics = snap(gen_throughput=50.0)                # SGLang: a gen_throughput gauge only
    assert router.score(make_req(), eps) == [210.0, 50.0]


# -- least-latency ---------------------------------------------------------------------------------


def latency_snap(t: float, ttft_sum: float, ttft_count: float, q_sum: float, q_count: float,
                 waiting: float) -> EngineMetrics:
    return snap(t=t, ttft_sum=ttft_sum, ttft_count=ttft_count, queue_time_sum=q_sum,
                queue_time_count=q_count, waiting=waiting)


def test_least_latency_expected_ttft_from_histogram_deltas_and_queue():
    clock = Clock()
    ctx, _ = ctx_for(clock=clock, metrics_window_s=10.0)
    router = LeastLatencyRouter(ctx)
    eps = make_eps(3)
    for ep in eps:
        ep.metrics = latency_snap(995.0, 100.0, 1000.0, 10.0, 1000.0, 0.0)
    router.score(make_req(), eps)
    # in the window: eps[0] 10 first tokens at 0.5 s (0.1 s of it queued), no queue now → 0.5
    eps[0].metrics = latency_snap(1000.0, 105.0, 1010.0, 11.0, 1010.0, 0.0)
    # eps[1] 0.2 s TTFT (0.05 queued) but 4 waiting → 0.2 + 4 × 0.15 = 0.8
    eps[1].metrics = latency_snap(1000.0, 102.0, 1010.0, 10.5, 1010.0, 4.0)
    # eps[2] no first token in the window (idle) and 1 waiting → 0 + 1 × fleet prefill (0.4+0.15)/2
    eps[2].metrics = latency_snap(1000.0, 100.0, 1000.0, 10.0, 1000.0, 1.0)
    scores = router.score(make_req(), eps)
    assert scores == [pytest.approx(0.5), pytest.approx(0.8), pytest.approx(0.275)]
    assert router.route(make_req(), eps).endpoint is eps[2]
    # one more sent to eps[2] before the next scrape doubles its queue estimate
    assert router.score(make_req(), eps)[2] == pytest.approx(0.55)


def test_least_latency_after_a_pause_an_engine_without_a_first_token_since_is_idle():
    """Across a pause longer than the window only the newest snapshot is in it; its TTFT mean, which
    the scraper carries over intervals that saw no first token, is not read when the engine's count
    has not moved since the snapshot before the window: it counts as idle."""
    clock = Clock()
    ctx, _ = ctx_for(clock=clock, metrics_window_s=10.0)
    router = LeastLatencyRouter(ctx)
    eps = make_eps(2)
    for t, count in ((995.0, 100.0), (1000.0, 110.0)):
        clock.t = t
        eps[0].metrics = snap(t=t, waiting=0.0, ttft_sum=count * 0.5, ttft_count=count,
                              ttft_recent_mean=0.5, queue_time_recent_mean=0.0)
        eps[1].metrics = snap(t=t, waiting=0.0, ttft_sum=count * 0.2, ttft_count=count,
                              ttft_recent_mean=0.2, queue_time_recent_mean=0.0)
        router.score(make_req(), eps)
    clock.t = 1012.0
    eps[0].metrics = snap(t=1012.0, waiting=0.0, ttft_sum=55.0, ttft_count=110.0, ttft_recent_mean=0.5,
                          queue_time_recent_mean=0.0)                  # nothing since 1000: idle
    eps[1].metrics = snap(t=1012.0, waiting=0.0, ttft_sum=22.4, ttft_count=112.0, ttft_recent_mean=0.2,
                          queue_time_recent_mean=0.0)                  # 2 first tokens since 1000
    assert router.score(make_req(), eps) == [0.0, pytest.approx(0.2)]


def test_least_latency_with_one_snapshot_uses_the_last_interval():
    ctx, _ = ctx_for()
    router = LeastLatencyRouter(ctx)
    eps = make_eps(2)
    eps[0].metrics = snap(waiting=0.0, ttft_recent_mean=0.3, queue_time_recent_mean=0.1)
    eps[1].metrics = snap(waiting=2.0, ttft_recent_mean=0.1, queue_time_recent_mean=0.0)
    assert router.score(make_req(), eps) == [pytest.approx(0.3), pytest.approx(0.3)]


def test_metric_strategies_combine():
    ctx, _ = ctx_for()
    reg = default_registry(ctx)
    eps = make_eps(3)
    for ep, (kv, w) in zip(eps, ((0.9, 0.0), (0.1, 6.0), (0.4, 1.0)), strict=True):
        ep.metrics = snap(kv_usage=kv, waiting=w)
    router = reg.get("least-kv-cache:1,least-waiting:1")
    # kv → [0, 1, 0.625]; waiting → [1, 0, 5/6]; halves summed
    assert router.score(make_req(), eps) == pytest.approx([0.5, 0.5, (0.625 + 5 / 6) / 2])
    assert router.route(make_req(), eps).endpoint is eps[2]


def test_weighted_list_counts_a_fallback_when_it_picks_an_engine_without_metrics():
    """As the single strategy does: each metric part that had no usable value for the chosen engine
    counts a fallback with its reason; none when the chosen engine had them."""
    clock = Clock()
    ctx, fallbacks = ctx_for(clock=clock)
    router = default_registry(ctx).get("least-kv-cache:2,least-waiting:1")
    eps = make_eps(3, in_flight=[1, 1, 0])
    eps[0].metrics = snap(kv_usage=0.2, waiting=1.0)
    eps[1].metrics = snap(kv_usage=0.5, waiting=0.0)
    # kv → [2/3, 0, 2/3 (its share: fewer in flight)]; waiting → [0, 1/3, 1/3]
    assert router.route(make_req(), eps).endpoint is eps[2]
    assert fallbacks == {("least-kv-cache", "no_metrics"): 1, ("least-waiting", "no_metrics"): 1}
    eps[2].in_flight = 5                               # busier: no share, the numbers decide
    assert router.route(make_req(), eps).endpoint is eps[0]
    assert sum(fallbacks.values()) == 2
    eps[2].in_flight = 0
    eps[2].metrics = snap(t=clock.t - 20, kv_usage=0.0, waiting=0.0)      # stale
    assert router.route(make_req(), eps).endpoint is eps[2]
    assert fallbacks[("least-kv-cache", "stale_metrics")] == 1
    assert fallbacks[("least-waiting", "stale_metrics")] == 1
    eps[1].metrics = eps[0].metrics = None            # nobody scores: counted once by each part
    router.route(make_req(), eps)
    assert fallbacks[("least-kv-cache", "stale_metrics")] == 2
    assert fallbacks[("least-waiting", "stale_metrics")] == 2


@pytest.mark.parametrize("router_cls", [LeastKVCacheRouter, LeastWaitingRouter, ThroughputRouter,
                                        LeastLatencyRouter])
def test_endpoints_that_left_the_pool_are_not_kept(router_cls):
    """Pods come and go for months: what a router keeps per endpoint stays bounded by the live ones."""
    from gateway.endpoints import EndpointPool

    clock = Clock()
    ctx, _ = ctx_for(clock=clock, metrics_window_s=10.0)
    router = router_cls(ctx)
    pool = EndpointPool()
    for rollout in range(100):          # 100 rollouts of 5 pods each
        eps = [pool.add(ep) for ep in make_eps(5, url=f"http://10.0.{rollout}.{{n1}}:8000")]
        for ep in eps:
            ep.metrics = snap(t=clock.t, kv_usage=0.1, waiting=0.0, prompt_tokens_total=0.0,
                              generation_tokens_total=0.0, ttft_sum=0.0, ttft_count=0.0)
        for _ in range(3):
            router.route(make_req(), eps)
        for ep in eps:
            pool.remove(ep)
        clock.t += 1.0
    kept = [d for d in (router._sent, getattr(router, "_windows", None), getattr(router, "_demand", None))
            if d is not None]
    assert all(len(d) <= 128 for d in kept), [len(d) for d in kept]
    assert any(kept)                    # the router did keep state per endpoint while they were there


def test_least_latency_is_not_steered_by_a_histogram_whose_mean_overflows():
    """An engine reporting a TTFT histogram of sum 1e200 over a count of 1e-200 (a broken exporter:
    each figure finite, their quotient past a double's range) has no usable recent TTFT, as one
    with none: no score is NaN, which no comparison is true of (the first candidate scoring NaN
    took every request, and one scoring NaN after another took none)."""
    ctx, _ = ctx_for()
    router = LeastLatencyRouter(ctx)
    eps = make_eps(3)
    eps[0].metrics = snap(waiting=0.0, ttft_recent_mean=float("inf"), queue_time_recent_mean=0.0)
    garbage = latency_snap(1000.0, 1e200, 1e-200, 0.0, 0.0, 0.0)
    for ep in eps[1:]:
        ep.metrics = snap(waiting=0.0, ttft_recent_mean=0.2, queue_time_recent_mean=0.0)
    scores = router.score(make_req(), eps)
    assert all(s == s for s in scores), scores
    router2 = LeastLatencyRouter(ctx_for()[0])
    eps2 = make_eps(3)
    eps2[0].metrics = latency_snap(990.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    for ep in eps2[1:]:
        ep.metrics = latency_snap(990.0, 1.0, 5.0, 0.0, 5.0, 0.0)
    router2.score(make_req(), eps2)
    eps2[0].metrics = garbage
    for ep in eps2[1:]:
        ep.metrics = latency_snap(1000.0, 2.0, 10.0, 0.0, 10.0, 0.0)
    scores = router2.score(make_req(), eps2)
    assert all(s == s for s in scores), scores
    picks = Counter(router2.route(make_req(), eps2).endpoint for _ in range(30))
    assert len(picks) > 1, picks
