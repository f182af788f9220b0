"""power-of-two, session-affinity, vtc-basic; the strategy grammar with the real strategy names
(AIBrix §9 items 1, 2); the routing knobs; and properties that hold for every strategy: a decision
is always one of the ready candidates, and charges balance."""

from __future__ import annotations

import base64
import random
from collections import Counter
from collections.abc import Sequence

import aiohttp
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import RoutingConfig, parse_config
from gateway.endpoints import Endpoint, EngineMetrics
from gateway.request import CHAT, InferenceRequest
from routers.base import Decision, RouterContext, RoutingSettings
from routers.power_of_two import PowerOfTwoRouter
from routers.registry import StrategyError, default_registry, parse_strategy
from routers.session import SessionAffinityRouter, decode_session_id, encode_session_id, fnv1a64, rendezvous
from routers.vtc import VTCRouter, request_tokens
from tests.conftest import model_block
from tests.strategy_util import Clock, Fallbacks


def make_req(text: str = "user\nhello there", *, user: str | None = None, session_id: str | None = None,
             session_key: str | None = None, model: str = "m") -> InferenceRequest:
    return InferenceRequest(path=CHAT, body=b"{}", data={}, model=model, stream=False, include_usage=False,
                            prompt_text=text, prompt_tokens_est=max(1, len(text) // 4), request_id="r",
                            user=user, session_id=session_id, session_key=session_key)


def make_eps(n: int, in_flight: Sequence[int] | None = None, base: str = "10.0.0") -> list[Endpoint]:
    eps = [Endpoint(url=f"http://{base}.{i + 1}:8000", model="m") for i in range(n)]
    for ep, k in zip(eps, in_flight or [0] * n, strict=True):
        ep.in_flight = k
    return eps


def ctx_for(seed: int = 1, clock: Clock | None = None, **knobs) -> tuple[RouterContext, Fallbacks]:
    fallbacks = Fallbacks()
    return RouterContext(rng=random.Random(seed), clock=clock or Clock(), settings=RoutingSettings(**knobs),
                         on_fallback=fallbacks), fallbacks


# -- power-of-two ----------------------------------------------------------------------------------


def test_power_of_two_takes_the_less_loaded_of_two_distinct_candidates():
    ctx, _ = ctx_for(seed=3)
    router = PowerOfTwoRouter(ctx)
    eps = make_eps(4, in_flight=[0, 5, 5, 5])
    picks = Counter(router.route(make_req(), eps).endpoint for _ in range(3000))
    # eps[0] wins whenever it is drawn: 1 - P(not drawn) = 1 - (3/4 · 2/3) = 1/2
    assert 1350 < picks[eps[0]] < 1650
    assert set(picks) == set(eps)
    # the busiest endpoint never wins a draw against an idler one
    eps = make_eps(3, in_flight=[9, 1, 2])
    assert all(router.route(make_req(), eps).endpoint is not eps[0] for _ in range(300))


def test_power_of_two_balances_a_burst():
    ctx, _ = ctx_for(seed=5)
    router = PowerOfTwoRouter(ctx)
    eps = make_eps(8)
    for _ in range(400):
        router.route(make_req(), eps).endpoint.in_flight += 1
    loads = [ep.in_flight for ep in eps]
    assert max(loads) - min(loads) <= 4


# -- session-affinity (AIBrix §9 item 18) -------------------------------------------------------------


def test_session_id_pins_the_endpoint_and_is_returned():
    ctx, fallbacks = ctx_for()
    router = SessionAffinityRouter(ctx)
    eps = make_eps(4)
    sid = base64.b64encode(b"10.0.0.3:8000").decode()
    d = router.route(make_req(session_id=sid), eps)
    assert isinstance(d, Decision) and d.endpoint is eps[2]
    assert d.headers == {"x-session-id": sid}
    assert not fallbacks


@pytest.mark.parametrize("sid", ["not base64!!", base64.b64encode(b"10.9.9.9:8000").decode(),
                                 base64.b64encode(b"\xff\xfe").decode()])
def test_invalid_or_gone_session_is_random_with_a_new_header(sid):
    ctx, fallbacks = ctx_for()
    router = SessionAffinityRouter(ctx)
    eps = make_eps(4)
    seen = set()
    for _ in range(100):
        d = router.route(make_req(session_id=sid), eps)
        assert decode_session_id(d.headers["x-session-id"]) == d.endpoint.address
        seen.add(d.endpoint)
    assert len(seen) == 4
    assert fallbacks == {("session-affinity", "session_endpoint_gone"): 100}


def test_session_key_rendezvous_is_stable_and_order_independent():
    ctx, _ = ctx_for()
    router = SessionAffinityRouter(ctx)
    eps = make_eps(6)
    first = router.route(make_req(session_key="conversation-42"), eps).endpoint
    shuffled = list(eps)
    for seed in range(10):
        random.Random(seed).shuffle(shuffled)
        assert router.route(make_req(session_key="conversation-42"), shuffled).endpoint is first
        # another gateway replica (fresh router, its own endpoint objects) agrees
        other = SessionAffinityRouter(ctx_for(seed=seed)[0])
        twins = [Endpoint(url=ep.url, model="m") for ep in shuffled]
        assert other.route(make_req(session_key="conversation-42"), twins).endpoint.url == first.url


def test_rendezvous_moves_only_the_sessions_of_a_removed_endpoint():
    eps = make_eps(5)
    keys = [f"s{i}" for i in range(300)]
    before = {k: rendezvous(k, eps) for k in keys}
    gone = eps[1]
    after = {k: rendezvous(k, [e for e in eps if e is not gone]) for k in keys}
    moved = [k for k in keys if after[k] is not before[k]]
    assert moved and all(before[k] is gone for k in moved)
    assert Counter(before.values()).most_common()[-1][1] > 30        # spread over all five


def test_rendezvous_is_aibrix_fnv1a():
    # FNV-1a 64 reference values, and the AIBrix composition key ‖ 0x00 ‖ address
    assert fnv1a64(b"") == 0xCBF29CE484222325
    assert fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    eps = make_eps(3)
    scores = {ep: fnv1a64(ep.address.encode(), fnv1a64(b"\0", fnv1a64(b"k1"))) for ep in eps}
    assert rendezvous("k1", eps) is max(scores, key=scores.get)


def test_no_session_is_random_and_counted():
    ctx, fallbacks = ctx_for()
    router = SessionAffinityRouter(ctx)
    eps = make_eps(3)
    picks = Counter(router.route(make_req(), eps).endpoint for _ in range(300))
    assert set(picks) == set(eps)
    assert fallbacks == {("session-affinity", "no_session"): 300}
    assert router.route(make_req(session_key="k" * 300), eps).endpoint in eps
    assert fallbacks[("session-affinity", "bad_session_key")] == 1


def test_session_affinity_scores_in_a_weighted_list():
    ctx, _ = ctx_for()
    reg = default_registry(ctx)
    eps = make_eps(3, in_flight=[0, 3, 6])
    pinned = make_req(session_id=encode_session_id(eps[2].address))
    assert reg.get("session-affinity").score(pinned, eps) == [0.0, 0.0, 1.0]
    d = reg.get("session-affinity:2,least-request:1").route(pinned, eps)
    assert d.endpoint is eps[2] and d.headers == {"x-session-id": encode_session_id(eps[2].address)}
    d = reg.get("session-affinity:1,least-request:2").route(pinned, eps)
    assert d.endpoint is eps[0] and d.headers == {"x-session-id": encode_session_id(eps[0].address)}
    d = reg.get("least-request:1,least-kv-cache:1").route(pinned, eps)
    assert isinstance(d, Decision) and d.endpoint is eps[0] and d.headers == {}


async def test_session_header_round_trip_through_the_gateway(sims, gateway):
    engines = [await sims("vllm", "m") for _ in range(3)]
    gw = await gateway([model_block("m", "vllm", [e.url for e in engines], strategy="session-affinity")])
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            sid, pod = r.headers["x-session-id"], r.headers["target-pod"]
        assert decode_session_id(sid) == pod
        for _ in range(5):
            async with s.post(gw.url + "/v1/completions", json=body, headers={"x-session-id": sid}) as r:
                assert r.status == 200 and r.headers["target-pod"] == pod and r.headers["x-session-id"] == sid
        pods = set()
        for _ in range(3):
            async with s.post(gw.url + "/v1/completions", json=body, headers={"x-session-key": "chat-9"}) as r:
                pods.add(r.headers["target-pod"])
        assert len(pods) == 1


# -- vtc-basic -----------------------------------------------------------------------------------------


def test_vtc_counts_tokens_per_user_over_a_window():
    clock = Clock()
    ctx, _ = ctx_for(clock=clock, vtc_window_s=300.0)
    router = VTCRouter(ctx)
    eps = make_eps(4)
    req = make_req("x" * 400, user="alice")                  # 100 tokens → 100 + 2 · 150 = 400
    assert request_tokens(req) == 400
    router.route(req, eps)
    clock.t += 200
    router.route(req, eps)
    assert router.user_tokens("alice") == 800
    clock.t += 150                                           # the first request left the window
    assert router.user_tokens("alice") == 400
    clock.t += 151
    assert router.user_tokens("alice") == 0


def test_vtc_separates_heavy_users_from_light_ones():
    clock = Clock()
    ctx, _ = ctx_for(clock=clock)
    router = VTCRouter(ctx)
    eps = make_eps(4)
    heavy, light = make_req("x" * 40_000, user="heavy"), make_req("x" * 40, user="light")
    for _ in range(5):
        router.route(heavy, eps)
        router.route(light, eps)
        clock.t += 2                                         # past the range refresh
    # nothing in flight: fairness decides; the heaviest user targets the last endpoint (address order)
    assert router.route(heavy, eps).endpoint is eps[3]
    assert router.route(light, eps).endpoint is eps[0]
    # load counts too: a busy last endpoint pushes the heavy user to its neighbour
    eps[3].in_flight = 10
    assert router.route(heavy, eps).endpoint is eps[2]


def test_vtc_without_user_is_random_and_counted():
    ctx, fallbacks = ctx_for()
    router = VTCRouter(ctx)
    eps = make_eps(3)
    assert {router.route(make_req(), eps).endpoint for _ in range(200)} == set(eps)
    assert fallbacks == {("vtc-basic", "no_user"): 200}
    assert router.score(make_req(), eps) == [None, None, None]


def test_vtc_bounds_its_users():
    from routers import vtc

    ctx, _ = ctx_for()
    router = VTCRouter(ctx)
    eps = make_eps(2)
    for i in range(vtc.MAX_USERS + 50):
        router.post_route(make_req(user=f"u{i}"), eps[0])
    assert len(router._users) == vtc.MAX_USERS


# -- grammar with the real names (AIBrix §9 items 1, 2) ------------------------------------------------


def test_real_registry_names_and_lists():
    reg = default_registry(RouterContext())
    assert {"random", "round-robin", "least-request", "power-of-two", "least-kv-cache", "least-waiting",
            "throughput", "least-latency", "prefix-cache", "session-affinity", "vtc-basic"} <= set(reg.names())
    assert reg.validate("prefix-cache:2,least-latency:1,least-request") == [
        ("prefix-cache", 2), ("least-latency", 1), ("least-request", 1)]
    assert reg.validate("prefix-cache:0,least-request") == [("least-request", 1)]
    assert parse_strategy("least-request,pd", reg.names()) == [("pd", 1)]
    for bad in ("invalid-routing-strategy", "least-request:1,invalid-strategy:2", "prefix-cache:1.5",
                "power-of-two,least-request", "random:1,prefix-cache:1"):
        with pytest.raises(StrategyError):
            reg.get(bad)
    combo = reg.get("prefix-cache:3,least-request:2,least-kv-cache:2")
    assert [r.name for r, _, _ in combo.parts] == ["prefix-cache", "least-request", "least-kv-cache"]


async def test_invalid_strategy_is_400_through_the_gateway(sims, gateway):
    e = await sims("vllm", "m")
    f = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [e.url, f.url])])
    async with aiohttp.ClientSession() as s:
        for spec in ("invalid-routing-strategy", "least-request:1,invalid-strategy:2"):
            async with s.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1},
                              headers={"routing-strategy": spec}) as r:
                assert r.status == 400 and r.headers["x-error-routing"] == "true"
        async with s.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1},
                          headers={"routing-strategy": "prefix-cache:3,least-request:2,least-kv-cache:2"}) as r:
            assert r.status == 200


# -- knobs -----------------------------------------------------------------------------------------------


def test_routing_settings_are_the_config_block():
    """Every router knob is a ``routing:`` config key with the same default: the block is the
    settings class plus the default strategy."""
    assert issubclass(RoutingConfig, RoutingSettings)
    names = {f.name for f in msgspec.structs.fields(RoutingConfig)}
    assert names - {f.name for f in msgspec.structs.fields(RoutingSettings)} == {"strategy"}
    cfg = parse_config("routing: {prefix_block_chars: 64, vtc_window_s: 60, metrics_max_age_s: 3}")
    ctx = RouterContext(settings=cfg.routing)
    assert ctx.settings.prefix_block_chars == 64 and ctx.settings.vtc_window_s == 60.0
    assert ctx.prefix_index.block_chars == 64 and VTCRouter(ctx).window_s == 60.0
    assert default_registry(ctx).get("least-kv-cache").max_age == 3.0
    assert RouterContext().settings == RoutingSettings()


# -- properties for every strategy -----------------------------------------------------------------------

ALL = ["random", "round-robin", "least-request", "power-of-two", "least-kv-cache", "least-waiting",
       "throughput", "least-latency", "prefix-cache", "session-affinity", "vtc-basic",
       "prefix-cache:3,least-request:2,least-kv-cache:2", "least-latency:1,throughput:1,vtc-basic:1",
       "session-affinity:1,least-waiting:2"]

metric_values = st.one_of(st.none(), st.floats(0, 50, allow_nan=False))
step = st.tuples(
    st.integers(0, len(ALL) - 1),          # strategy
    st.integers(0, 7),                     # prompt variant
    st.sampled_from([None, "alice", "bob"]),
    st.sampled_from([None, "k1", "k2"]),
    st.lists(st.booleans(), min_size=8, max_size=8),      # which endpoints are ready
    st.integers(0, 3),                     # how many outstanding requests finish now
    st.booleans(),                         # a scrape happens
    st.lists(st.tuples(metric_values, metric_values, metric_values), min_size=8, max_size=8),
)


@settings(max_examples=120, deadline=None)
@given(steps=st.lists(step, min_size=1, max_size=25), seed=st.integers(0, 2**31))
def test_property_decisions_are_ready_candidates_and_charges_balance(steps, seed):
    clock = Clock()
    ctx = RouterContext(rng=random.Random(seed), clock=clock,
                        settings=RoutingSettings(prefix_block_chars=16, prefix_index_blocks=64))
    reg = default_registry(ctx)
    eps = make_eps(8)
    prompts = ["system: " + "shared prefix " * (i + 1) + f"turn {i}" for i in range(8)]
    outstanding: list[Endpoint] = []
    routed = 0
    for spec_i, p, user, key, ready, finish, scrape, values in steps:
        clock.t += 0.5
        for ep, ok in zip(eps, ready, strict=True):
            ep.healthy = ok
        if scrape:
            for ep, (kv, waiting, ttft) in zip(eps, values, strict=True):
                prev = ep.metrics
                ep.metrics = EngineMetrics(
                    scraped_at=clock.t, kv_usage=None if kv is None else kv / 50, waiting=waiting,
                    ttft_sum=(prev.ttft_sum or 0) + (ttft or 0) if prev else ttft,
                    ttft_count=(prev.ttft_count or 0) + 1 if prev else 1.0,
                    prompt_tokens_total=(prev.prompt_tokens_total or 0) + 100 if prev else 0.0,
                    generation_tokens_total=waiting)
        for _ in range(min(finish, len(outstanding))):
            outstanding.pop(0).in_flight -= 1                # a request finishes: its lease is released
        candidates = [ep for ep in eps if ep.ready]
        if not candidates:
            continue
        session_id = encode_session_id(eps[p].address) if p % 3 == 0 else None
        req = make_req(prompts[p], user=user, session_key=key, session_id=session_id)
        decision = reg.get(ALL[spec_i]).route(req, candidates)
        assert isinstance(decision, Decision)
        ep = decision.endpoint
        assert any(ep is c for c in candidates) and ep.ready
        ep.in_flight += 1                                    # charged in the same step
        outstanding.append(ep)
        routed += 1
        assert sum(e.in_flight for e in eps) == len(outstanding)
    for ep in outstanding:
        ep.in_flight -= 1
    assert all(ep.in_flight == 0 for ep in eps)
    assert len(ctx.prefix_index.match(make_req(prompts[0]), eps)) == 8
    assert ctx.prefix_index.stats()["blocks"] <= 64
