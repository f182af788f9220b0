"""P/D pair selection (AIBrix §9 items 11, 15, 17)."""

from __future__ import annotations

import random

import orjson
import pytest

from gateway.request import CHAT, parse
from routers.base import NoRouteError, RouterContext, RoutingSettings
from routers.pd import PDRouter, PDRouteSettings, in_bucket
from tests.support.factories import pd_endpoint as ep

# -- pair selection (AIBrix §9 items 11, 15, 17) ---------------------------------------------------

def req(tokens=100):
    r = parse(CHAT, orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x " * tokens}]}), {}, "r")
    r.prompt_tokens_est = tokens
    return r


def router(**cfg):
    ctx = RouterContext(rng=random.Random(1), pd_settings=lambda m: PDRouteSettings(**cfg))
    return PDRouter(ctx)


def test_happy_pair_in_one_roleset():
    p, d = ep(1, "prefill"), ep(2, "decode")
    dec = router().route(req(), [p, d])
    assert dec.prefill is p and dec.endpoint is d


def test_incomplete_roleset_is_not_eligible():
    with pytest.raises(NoRouteError):
        router().route(req(), [ep(2, "decode", "a"), ep(3, "prefill", "b")])


def test_never_paired_across_rolesets():
    p1, d1 = ep(1, "prefill", "a"), ep(2, "decode", "a")
    p2, d2 = ep(3, "prefill", "b"), ep(4, "decode", "b")
    for _ in range(20):
        dec = router().route(req(), [p1, d1, p2, d2])
        assert dec.prefill.roleset == dec.endpoint.roleset


@pytest.mark.parametrize("counts,winner", [((5, 5, 5), None), ((10, 15, 20), None), ((5, 40, 45), 0),
                                           ((0, 50), 0), ((2, 2, 50, 45), {0, 1})])
def test_prefill_imbalance_fast_path(counts, winner):
    rsets = []
    for i, c in enumerate(counts):
        rsets += [ep(10 + i, "prefill", f"rs{i}", prefill_in_flight=c), ep(50 + i, "decode", f"rs{i}")]
    r = router(prefill_score_policy="least_request")
    dec = r.route(req(), rsets)
    chosen = int(dec.prefill.roleset[2:])
    if winner is None:
        return  # no fast path: scoring decides (least_request picks the lowest anyway)
    assert chosen in (winner if isinstance(winner, set) else {winner})


def test_prefill_fast_path_not_taken_below_spread():
    # {10, 15, 20}: spread 10 ≤ 16, so scoring decides; token_load policy ignores the counts
    eps = []
    for i, (c, tok) in enumerate([(10, 900.0), (15, 10.0), (20, 500.0)]):
        eps += [ep(10 + i, "prefill", f"rs{i}", prefill_in_flight=c, token_active=tok), ep(50 + i, "decode", f"rs{i}")]
    dec = router(prefill_score_policy="token_load").route(req(), eps)
    assert dec.prefill.roleset == "rs1"


def test_decode_fast_path_running_spread():
    eps = [ep(1, "prefill", "rs")]
    for i, run in enumerate((2, 40, 35)):
        eps.append(ep(10 + i, "decode", "rs", metrics={"running": run}))
    assert router().route(req(), eps).endpoint is eps[1]


def test_decode_fast_path_throughput_spread():
    eps = [ep(1, "prefill", "rs"),
           ep(10, "decode", "rs", metrics={"running": 10, "gen_throughput": 50.0}),
           ep(11, "decode", "rs", metrics={"running": 12, "gen_throughput": 3000.0})]
    assert router().route(req(), eps).endpoint is eps[1]


@pytest.mark.parametrize("state", [
    [{"metrics": {"running": 2}}, {"metrics": {"running": 40}}, {"metrics": {"running": 2}}],
    [{"metrics": {"running": 10, "gen_throughput": 50.0}}, {"metrics": {"running": 12, "gen_throughput": 3000.0}},
     {"metrics": {"running": 11, "gen_throughput": 50.0}}],
    [{"in_flight": 0}, {"in_flight": 30}, {"in_flight": 0}]], ids=["running", "throughput", "no_metrics"])
def test_decode_fast_path_breaks_ties_between_equal_decodes_at_random(state):
    """Past the decode imbalance thresholds (running requests, generation throughput, or this
    gateway's own count without metrics), two decodes equally least loaded are both picked over
    many requests, as every other tie of the router is: the first listed took them all."""
    p = ep(1, "prefill", "rs")
    decodes = [ep(10 + i, "decode", "rs", **kw) for i, kw in enumerate(state)]
    r = router()
    picks = {r.route(req(), [p, *decodes]).endpoint for _ in range(64)}     # one of the two only: 2 in 2^64
    assert picks == {decodes[0], decodes[2]}


def test_decode_scoring_without_fast_path_uses_free_kv():
    # running {10,12}, throughput {100,200}: no fast path; the load_balancing score decides, and a
    # nearly full KV (0.8 → 20% free) makes the first decode worse than the second
    eps = [ep(1, "prefill", "rs"),
           ep(10, "decode", "rs", metrics={"running": 10, "gen_throughput": 100.0, "kv_usage": 0.8}),
           ep(11, "decode", "rs", metrics={"running": 12, "gen_throughput": 200.0, "kv_usage": 0.3})]
    assert router().route(req(), eps).endpoint is eps[2]


def test_prefix_match_steers_the_prefill():
    p1, d1, p2, d2 = ep(1, "prefill", "a"), ep(2, "decode", "a"), ep(3, "prefill", "b"), ep(4, "decode", "b")
    r = router()
    r.ctx.prefix_index.insert(req(1000), p2)          # p2 prefilled this prompt before
    dec = r.route(req(1000), [p1, d1, p2, d2])
    assert dec.prefill is p2 and dec.uncached_tokens == 0


@pytest.mark.parametrize("lo,hi,n,ok", [(0, 0, 5, True), (0, 0, 10**6, True), (10, 100, 50, True), (10, 100, 5, False),
                                        (10, 100, 101, False), (100, 10, 50, False)])
def test_bucket_membership(lo, hi, n, ok):
    assert in_bucket(ep(1, "prefill", lo=lo, hi=hi), n) is ok


def test_outside_all_buckets_goes_to_combined():
    p, d, c = ep(1, "prefill", lo=0, hi=100), ep(2, "decode", lo=0, hi=100), ep(3, "combined")
    dec = router().route(req(500), [p, d, c])
    assert dec.endpoint is c and dec.prefill is None
    with pytest.raises(NoRouteError):
        router().route(req(500), [p, d])
    # the bucket's decode is down (not among the ready candidates) → combined
    dec = router().route(req(50), [p, c])
    assert dec.endpoint is c and dec.prefill is None


def test_combined_wins_when_clearly_less_loaded():
    p = ep(1, "prefill", prefill_in_flight=8)
    d = ep(2, "decode")
    c = ep(3, "combined", in_flight=0)
    assert router().route(req(), [p, d, c]).endpoint is c
    p.prefill_in_flight = 0
    assert router().route(req(), [p, d, c]).prefill is p


def test_between_two_scrapes_decodes_are_loaded_by_what_this_gateway_sent_since_not_all_on_one():
    """The engines' running counts are up to a scrape interval old. Charging each decision to its
    decode (as the gateway does) must move the next ones: a burst is spread over the decodes, not
    all sent to the one that was the least loaded at the last scrape."""
    p = ep(1, "prefill")
    # scraped when this gateway had 4 and 20 requests on them (the engines counted the same)
    d0 = ep(10, "decode", in_flight=4, metrics={"running": 4, "gateway_in_flight": 4})
    d1 = ep(11, "decode", in_flight=20, metrics={"running": 20, "gateway_in_flight": 20})
    r = router()
    got = []
    for _ in range(40):
        dec = r.route(req(), [p, d0, d1])
        dec.endpoint.in_flight += 1         # the decision's charge
        got.append(dec.endpoint)
    assert got[:16] == [d0] * 16            # d0 first, while it is the less loaded
    assert d0.in_flight - d1.in_flight in (-1, 0, 1) and got.count(d1) == 12
    # what the engine counted beyond this gateway's own (another gateway's) still counts
    d2 = ep(12, "decode", in_flight=0, metrics={"running": 30, "gateway_in_flight": 0})
    d3 = ep(13, "decode", in_flight=10, metrics={"running": 10, "gateway_in_flight": 10})
    assert router().route(req(), [p, d2, d3]).endpoint is d3


def test_other_replicas_in_flight_requests_count_as_load():
    """With shared state, requests other gateway replicas have on an endpoint (``remote_in_flight``)
    load it as much as this replica's own, as for least-request."""
    p = ep(1, "prefill")
    # no engine metrics: a decode's running count is the in-flight count of every replica
    for remote in (40, 5):           # the decode fast path (spread >= 16), then the load_balancing score
        quiet, busy = ep(10, "decode", in_flight=1), ep(11, "decode", remote_in_flight=remote)
        for _ in range(5):
            assert router().route(req(), [p, busy, quiet]).endpoint is quiet
    assert router(decode_score_policy="least_request").route(req(), [p, busy, quiet]).endpoint is quiet
    # combined endpoints are weighed the same way
    c1, c2 = ep(20, "combined", remote_in_flight=30), ep(21, "combined", in_flight=2)
    assert router().route(req(), [c1, c2]).endpoint is c2


# -- one prefill and one decode: the short path decides as the general one ------------------------

def _fields(dec):
    return (dec.endpoint, dec.prefill, dec.uncached_tokens, dec.reason, dec.prefix_match, dec.strategy)


@pytest.mark.parametrize("policy", ["prefix_cache", "least_request", "token_load"])
@pytest.mark.parametrize("metrics", [None, {"running": 3, "kv_usage": 0.5, "gen_throughput": 900.0}])
@pytest.mark.parametrize("warm", [False, True])
def test_one_pair_decides_as_the_general_path(policy, metrics, warm):
    fallbacks: list[tuple[str, str]] = []
    ctx = RouterContext(rng=random.Random(1), pd_settings=lambda m: PDRouteSettings(prefill_score_policy=policy),
                        on_fallback=lambda s, r: fallbacks.append((s, r)))
    r = PDRouter(ctx)
    p, d = ep(1, "prefill", prefill_in_flight=2), ep(2, "decode", metrics=metrics, in_flight=1)
    outside = ep(3, "combined", lo=10_000)            # out of the bucket: only forces the general path
    q = req(300)
    if warm:
        ctx.prefix_index.insert(q, p)
    short = r.decide(q, [d, p])                       # either order
    seen, fallbacks[:] = list(fallbacks), []
    general = r.decide(q, [p, d, outside])
    assert _fields(short) == _fields(general)
    assert seen == fallbacks == ([] if metrics else [("pd", "decode_metrics_missing")])
    assert (short.prefix_match == 100.0) is (warm and policy == "prefix_cache")


def test_decide_leaves_the_prefill_record_for_later_and_route_makes_it():
    r = router()
    p, d = ep(1, "prefill"), ep(2, "decode")
    q = req(300)
    dec = r.decide(q, [p, d])
    assert dec.learn is not None and r.ctx.prefix_index.match(q, [p])[p] == 0.0
    dec.learn()
    assert r.ctx.prefix_index.match(q, [p])[p] == 100.0
    q2 = req(300)
    dec = r.route(q2, [p, d])
    assert dec.learn is None and dec.prefix_match == 100.0


def test_pair_of_different_rolesets_is_not_the_short_path():
    with pytest.raises(NoRouteError):
        router().decide(req(), [ep(1, "prefill", "a"), ep(2, "decode", "b")])


# -- sessions ------------------------------------------------------------------------------------

def _session_req(key, tokens=100):
    r = req(tokens)
    r.session_key = key
    return r


def test_a_session_goes_back_to_its_prefill_unless_it_is_overloaded_or_gone():
    p1, d1, p2, d2 = ep(1, "prefill", "a"), ep(2, "decode", "a"), ep(3, "prefill", "b"), ep(4, "decode", "b")
    cfg = {}
    r = PDRouter(RouterContext(rng=random.Random(1), pd_settings=lambda m: PDRouteSettings(**cfg)))
    outcomes = []
    object.__setattr__(r.ctx, "on_session", lambda model, outcome: outcomes.append(outcome))
    first = r.route(_session_req("agent-1"), [p1, d1, p2, d2])
    assert "session" not in first.reason and outcomes == []
    for i in range(4):          # other prompts (no prefix match) of the same session stay on its prefill
        d = r.route(_session_req("agent-1", tokens=200 + i), [p1, d1, p2, d2])
        assert d.prefill is first.prefill and d.reason == "session"
        assert d.endpoint.roleset == first.prefill.roleset
    assert outcomes == ["kept"] * 4
    other = p2 if first.prefill is p1 else p1
    first.prefill.prefill_in_flight, other.prefill_in_flight = 9, 0     # busier, within the load filter
    d = r.route(_session_req("agent-1"), [p1, d1, p2, d2])              # (two prefills: 4.5 + 2 · 4.5 = 13.5)
    assert d.prefill is first.prefill and outcomes[-1] == "kept"
    p5, d5, p7, d7 = ep(5, "prefill", "c"), ep(6, "decode", "c"), ep(7, "prefill", "d"), ep(8, "decode", "d")
    first.prefill.prefill_in_flight = 14       # loads 14, 0, 0, 0: within 3.5 + 2 · 6.06 = 15.6, and the
    other.prefill_in_flight = p5.prefill_in_flight = p7.prefill_in_flight = 0   # spread 14 is below 16
    many = [p1, d1, p2, d2, p5, d5, p7, d7]
    assert r.route(_session_req("agent-1"), many).prefill is first.prefill and outcomes[-1] == "kept"
    cfg["prefill_load_std_factor"] = 1.0       # 3.5 + 6.06 < 14
    d = r.route(_session_req("agent-1"), many)
    assert d.prefill is not first.prefill and outcomes[-1] == "overloaded"
    moved = d.prefill           # the session follows the new decision
    rest = [e for e in (p1, d1, p2, d2, p5, d5) if e.roleset != moved.roleset]
    for e in rest:
        e.prefill_in_flight = 0
    n = len(outcomes)
    d = r.route(_session_req("agent-1"), rest)      # up and ready, left out (a retry off it): not counted
    assert d.prefill is not moved and len(outcomes) == n
    moved = d.prefill
    moved.healthy = False                           # down: gone
    d = r.route(_session_req("agent-1"), [e for e in (p1, d1, p2, d2, p5, d5, p7, d7) if e.roleset != moved.roleset])
    assert d.prefill is not moved and outcomes[-1] == "gone" and len(outcomes) == n + 1


def test_a_prompt_cache_key_keeps_its_session_on_its_prefill():
    p1, d1, p2, d2 = ep(1, "prefill", "a"), ep(2, "decode", "a"), ep(3, "prefill", "b"), ep(4, "decode", "b")
    r = PDRouter(RouterContext(rng=random.Random(1), pd_settings=lambda m: PDRouteSettings()))
    outcomes = []
    object.__setattr__(r.ctx, "on_session", lambda model, outcome: outcomes.append(outcome))

    def turn(tokens):
        q = req(tokens)
        q.data = {"prompt_cache_key": "conv-1"}
        return r.route(q, [p1, d1, p2, d2])

    first = turn(100)
    for i in range(4):          # other prompts (no prefix match) of the same key stay on its prefill
        d = turn(200 + i)
        assert d.prefill is first.prefill and d.reason == "session"
    assert outcomes == ["kept"] * 4


@pytest.mark.parametrize("settings, pd", [({"prefix_session": False}, {}),
                                          ({}, {"prefill_score_policy": "least_request"})])
def test_pd_session_preference_follows_the_prefix_session_setting_and_the_policy(settings, pd):
    p1, d1, p2, d2 = ep(1, "prefill", "a"), ep(2, "decode", "a"), ep(3, "prefill", "b"), ep(4, "decode", "b")
    r = PDRouter(RouterContext(rng=random.Random(1), settings=RoutingSettings(**settings),
                               pd_settings=lambda m: PDRouteSettings(**pd)))
    outcomes = []
    object.__setattr__(r.ctx, "on_session", lambda model, outcome: outcomes.append(outcome))
    for i in range(10):
        d = r.route(_session_req("agent-1", tokens=100 + i), [p1, d1, p2, d2])
        assert "session" not in d.reason
    assert outcomes == []


def test_a_session_stays_on_a_prefill_running_one_prefill_beside_idle_ones():
    """Six rolesets, the session's prefill running one prefill and the others idle: one above the
    mean is no overload (the filter, mean + 2 population stddevs, is 0.91 there), so the session
    keeps its prefill; three there are past it still."""
    eps = [e for i in range(6) for e in (ep(2 * i + 1, "prefill", f"r{i}"), ep(2 * i + 2, "decode", f"r{i}"))]
    r = PDRouter(RouterContext(rng=random.Random(1), pd_settings=lambda m: PDRouteSettings()))
    outcomes = []
    object.__setattr__(r.ctx, "on_session", lambda model, outcome: outcomes.append(outcome))
    first = r.route(_session_req("agent-1"), eps).prefill
    first.prefill_in_flight = 1
    d = r.route(_session_req("agent-1", tokens=200), eps)
    assert d.prefill is first and d.reason == "session" and outcomes == ["kept"]
    first.prefill_in_flight = 3                    # 3 > 0.5 + 2 x 1.12
    d = r.route(_session_req("agent-1", tokens=300), eps)
    assert d.prefill is not first and outcomes[-1] == "overloaded"
