"""The prefix-cache router: holders, load guards, scores for weighted lists."""

from __future__ import annotations

import random

import pytest

from routers.base import RouterContext, RoutingSettings
from routers.registry import default_registry
from tests.unit.routers.prefix_helpers import BLOCK, SYSTEM, make_eps, make_req, setup

# -- the router ----------------------------------------------------------------------------------


def test_routes_to_the_holder_and_records_the_choice():
    router, index, _, fallbacks = setup()
    eps = make_eps(4, in_flight=[1, 1, 1, 1])
    first = router.route(make_req(SYSTEM), eps).endpoint
    assert fallbacks[("prefix-cache", "no_match")] == 1
    for turn in range(5):
        conv = make_req(SYSTEM + f"user: question {turn} " * 3)
        assert router.route(conv, eps).endpoint is first
    assert index.depths(make_req(SYSTEM + "user: question 4 " * 3), eps)[0] == {first: 26}


def test_highest_match_wins_then_the_least_loaded():
    router, index, _, _ = setup()
    eps = make_eps(3, in_flight=[2, 2, 1])
    index.insert(make_req(SYSTEM), eps[0])
    index.insert(make_req(SYSTEM[:80]), eps[1])
    assert router._choose(make_req(SYSTEM), eps) is eps[0]
    index.insert(make_req(SYSTEM), eps[2])              # same depth, less load
    assert router._choose(make_req(SYSTEM), eps) is eps[2]


def test_short_prompt_goes_least_request():
    router, _, _, fallbacks = setup()
    eps = make_eps(3, in_flight=[3, 0, 2])
    assert router.route(make_req("hi"), eps).endpoint is eps[1]
    assert fallbacks[("prefix-cache", "short_prompt")] == 1


def test_std_guard_leaves_an_overloaded_holder():
    # loads [9, 2, 2, 2]: mean 3.75, sample stddev 3.5 → limit 7.25 with k = 1; spread 7 ≤ 8
    router, index, _, fallbacks = setup(prefix_std_factor=1.0)
    eps = make_eps(4, in_flight=[9, 2, 2, 2])
    index.insert(make_req(SYSTEM), eps[0])
    chosen = router.route(make_req(SYSTEM), eps).endpoint
    assert chosen is not eps[0]
    assert fallbacks[("prefix-cache", "overloaded")] == 1
    # the next request can use both copies: the new one (less loaded) wins
    assert router.route(make_req(SYSTEM), eps).endpoint is chosen
    # with a laxer factor the holder is kept
    lax, index2, _, _ = setup(prefix_std_factor=2.0)
    index2.insert(make_req(SYSTEM), eps[0])
    assert lax.route(make_req(SYSTEM), eps).endpoint is eps[0]


@pytest.mark.parametrize(("loads", "expected"), [
    ([5, 5, 5], None), ([10, 15, 20], None),            # spread ≤ 16: the match decides (holder = pod 2)
    ([5, 40, 45], {0}), ([2, 2, 50, 45], {0, 1}), ([0, 50], {0}),
])
def test_absolute_spread_guard_aibrix_cases(loads, expected):
    """AIBrix §9 item 15's imbalance cases (spread must exceed the threshold, 16 here): above it
    only the least-loaded endpoints are considered, whatever the prefix match says."""
    router, index, _, fallbacks = setup(prefix_imbalance_abs=16, prefix_std_factor=100.0)
    eps = make_eps(len(loads), in_flight=loads)
    holder = eps[-1]
    index.insert(make_req(SYSTEM), holder)
    seen = {eps.index(router._choose(make_req(SYSTEM), eps)) for _ in range(30)}
    if expected is None:
        assert seen == {len(loads) - 1}
        assert not fallbacks
    else:
        assert seen == expected
        assert fallbacks[("prefix-cache", "load_imbalance")] == 30


def test_a_hot_prefix_spreads_instead_of_piling_up():
    """Without releases (requests still running), one hot prompt may not pile onto one engine:
    the guards hand it to more engines as load grows."""
    router, _, _, _ = setup()
    eps = make_eps(8)
    for _ in range(200):
        router.route(make_req(SYSTEM), eps).endpoint.in_flight += 1      # charged like the pipeline does
    loads = [ep.in_flight for ep in eps]
    assert max(loads) - min(loads) <= 8
    assert sum(loads) == 200


def test_score_is_the_match_percentage_for_weighted_lists():
    ctx = RouterContext(rng=random.Random(3), settings=RoutingSettings(prefix_block_chars=BLOCK))
    reg = default_registry(ctx)
    eps = make_eps(3, in_flight=[0, 4, 8])
    ctx.prefix_index.insert(make_req(SYSTEM), eps[2])
    prefix = reg.get("prefix-cache")
    assert prefix.score(make_req(SYSTEM), eps) == [0.0, 0.0, 100.0]
    # prefix weight 3 vs least-request 1: the full match on the busy endpoint wins
    assert reg.get("prefix-cache:3,least-request:1").route(make_req(SYSTEM), eps).endpoint is eps[2]
    # least-request 3 vs prefix 1: the idle endpoint wins, and the list's choice is indexed
    assert reg.get("prefix-cache:1,least-request:3").route(make_req(SYSTEM), eps).endpoint is eps[0]
    assert ctx.prefix_index.match(make_req(SYSTEM), eps) == {eps[0]: 100.0, eps[1]: 0.0, eps[2]: 100.0}


def test_the_context_index_is_the_router_index():
    ctx = RouterContext(settings=RoutingSettings(prefix_block_chars=BLOCK))
    eps = make_eps(2)
    assert ctx.prefix_index.match(make_req(SYSTEM), eps) == dict.fromkeys(eps, 0.0)
    assert ctx.prefix_index.stats() == {"blocks": 0, "capacity": 131072, "entries": 0, "evictions": 0}
    reg = default_registry(ctx)
    assert reg.get("prefix-cache").index is ctx.prefix_index
    ctx.prefix_index.insert(make_req(SYSTEM), eps[1])                     # e.g. the P/D prefill
    assert ctx.prefix_index.match(make_req(SYSTEM + "more text here"), eps)[eps[1]] > 90
    assert reg.get("prefix-cache").route(make_req(SYSTEM), eps).endpoint is eps[1]
    assert ctx.prefix_index.stats()["blocks"] == 20
    other_model = make_eps(2, model="n")
    assert ctx.prefix_index.match(make_req(SYSTEM, model="n"), other_model) == dict.fromkeys(other_model, 0.0)


# -- the fleet-aware load (routing.prefix_load) --------------------------------------------------


def _scraped(ep, at: float, running: float, waiting: float, ours: int):
    from gateway.endpoints import EngineMetrics

    ep.metrics = EngineMetrics(scraped_at=at, running=running, waiting=waiting, gateway_in_flight=ours)


def test_fleet_load_adds_what_other_gateways_run_on_the_engine():
    from routers.prefix_cache import fleet_load

    ep = make_eps(1, in_flight=[2])[0]
    assert fleet_load(ep, 100.0, 10.0) == 2                  # no scrape: this gateway's own
    _scraped(ep, 95.0, running=7, waiting=2, ours=3)
    assert fleet_load(ep, 100.0, 10.0) == 2 + 6              # 9 on the engine, 3 of them ours then
    _scraped(ep, 95.0, running=2, waiting=0, ours=3)
    assert fleet_load(ep, 100.0, 10.0) == 2                  # fewer than ours (finished since): none
    ep.remote_in_flight = 8
    assert fleet_load(ep, 100.0, 10.0) == 10                 # replicas' published counts, if larger
    _scraped(ep, 80.0, running=20, waiting=0, ours=0)
    ep.remote_in_flight = 0
    assert fleet_load(ep, 100.0, 10.0) == 2                  # stale scrape: ignored


def test_the_guards_see_other_gateways_on_the_holder_with_fleet_load():
    # this gateway has nothing in flight; another gateway's 9 requests sit on the holder
    for mode, holder_kept in (("local", True), ("fleet", False)):
        router, index, clock, fallbacks = setup(prefix_load=mode, prefix_std_factor=1.0)
        eps = make_eps(4)
        for ep in eps:
            _scraped(ep, clock.t - 1, running=0, waiting=0, ours=0)
        _scraped(eps[0], clock.t - 1, running=8, waiting=1, ours=0)
        index.insert(make_req(SYSTEM), eps[0])
        chosen = router.route(make_req(SYSTEM), eps).endpoint
        assert (chosen is eps[0]) is holder_kept, mode
        if not holder_kept:
            assert fallbacks[("prefix-cache", "load_imbalance")] == 1      # spread 9 > 8


def test_fleet_fallback_is_least_loaded_by_the_same_load():
    router, _, clock, fallbacks = setup(prefix_load="fleet")
    eps = make_eps(3, in_flight=[0, 1, 1])
    _scraped(eps[0], clock.t, running=4, waiting=0, ours=0)                  # busy with others' work
    assert router.route(make_req("hi"), eps).endpoint in eps[1:]
    assert fallbacks[("prefix-cache", "short_prompt")] == 1


def test_one_gateway_alone_routes_the_same_with_fleet_load():
    # the engine reports exactly this gateway's requests: fleet load == local load
    rng = random.Random(5)
    local, idx_l, clock, _ = setup(prefix_load="local", seed=3)
    fleet, idx_f, _, _ = setup(prefix_load="fleet", seed=3, clock=clock)
    eps = make_eps(5)
    for step in range(200):
        for ep in eps:
            ep.in_flight = rng.randrange(6)
            _scraped(ep, clock.t, running=ep.in_flight, waiting=0, ours=ep.in_flight)
        req = make_req(SYSTEM[: 8 * rng.randrange(1, 21)] + f"q{step % 7}" * 4)
        assert local.route(req, eps).endpoint is fleet.route(req, eps).endpoint


def test_prefix_load_is_validated():
    import msgspec

    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"prefix_load": "global"}, RoutingSettings)



def test_decide_leaves_the_record_for_later_and_route_makes_it_at_once():
    """``decide`` chooses as ``route`` does; its learning (the prompt's record) waits in
    ``Decision.learn`` until the gateway has written the leg, and changes nothing until it runs."""
    router, index, _, _ = setup()
    eps = make_eps(3, in_flight=[0, 0, 0])
    decision = router.decide(make_req(SYSTEM), eps)
    assert decision.learn is not None
    assert index.match(make_req(SYSTEM), eps) == dict.fromkeys(eps, 0.0)      # nothing recorded yet
    decision.learn()
    assert index.match(make_req(SYSTEM), eps)[decision.endpoint] == 100.0
    routed = router.route(make_req(SYSTEM + "user: more "), eps)             # route learns in the call
    assert routed.learn is None
    assert routed.endpoint is decision.endpoint
    assert index.stats()["blocks"] == 21


def test_a_weighted_list_leaves_its_parts_learning_for_later():
    ctx = RouterContext(rng=random.Random(3), settings=RoutingSettings(prefix_block_chars=BLOCK))
    weighted = default_registry(ctx).get("prefix-cache:2,least-request:1")
    eps = make_eps(2, in_flight=[0, 0])
    decision = weighted.decide(make_req(SYSTEM), eps)
    assert ctx.prefix_index.match(make_req(SYSTEM), eps) == dict.fromkeys(eps, 0.0)
    decision.learn()
    assert ctx.prefix_index.match(make_req(SYSTEM), eps)[decision.endpoint] == 100.0


def test_one_request_beside_idle_endpoints_is_not_past_the_deviation_guard():
    """On 11 endpoints or more the deviation guard is relative whatever the loads: one request on
    the holder beside idle endpoints is above mean + 3 sample stddevs (12 endpoints: 1 > 0.08 +
    3 × 0.29). A load within one request of the mean is no sign of overload: the holder (and a
    session's endpoint) keeps its conversation; three requests there are past it still."""
    router, index, _, fallbacks = setup()
    eps = make_eps(12, in_flight=[1] + [0] * 11)
    index.insert(make_req(SYSTEM), eps[0])
    assert router.route(make_req(SYSTEM + "user: and then? " * 3), eps).endpoint is eps[0]
    assert not fallbacks
    eps[0].in_flight = 3                                  # 3 > 0.25 + 3 × 0.87: overloaded
    assert router.route(make_req(SYSTEM + "user: and now? " * 3), eps).endpoint is not eps[0]
    assert fallbacks[("prefix-cache", "overloaded")] == 1
