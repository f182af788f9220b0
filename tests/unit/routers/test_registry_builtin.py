"""The built-in registry: real strategy names and lists, the knobs, properties of every strategy."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config.schema import RoutingConfig, parse_config
from gateway.endpoints import Endpoint, EngineMetrics
from routers.base import Decision, RouterContext, RoutingSettings
from routers.registry import StrategyError, default_registry, parse_strategy
from routers.session import encode_session_id
from routers.vtc import VTCRouter
from tests.support.factories import Clock
from tests.unit.routers.strategy_helpers import make_eps, make_req

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


TIED = ["random", "least-request", "power-of-two", "least-kv-cache", "least-waiting", "throughput",
        "least-latency", "prefix-cache", "session-affinity", "lora-affinity", "slo",
        "prefix-cache:3,least-request:2,least-kv-cache:2", "least-latency:1,throughput:1"]


@pytest.mark.parametrize("spec", TIED)
def test_a_tied_fleet_is_spread_not_routed_by_the_list_order(spec):
    """An idle fleet whose engines report the same figures, no prefix held, no session or user: every
    strategy spreads 1,000 decisions over the four endpoints, none left out, not the first listed
    taking them all (replicas of the gateway, or workers, would otherwise all pick it)."""
    ctx = RouterContext(rng=random.Random(5), clock=Clock())
    router = default_registry(ctx).get(spec)
    eps = make_eps(4)
    for ep in eps:
        ep.metrics = EngineMetrics(scraped_at=1000.0, running=0.0, waiting=0.0, kv_usage=0.1,
                                   prompt_tokens_total=100.0, generation_tokens_total=100.0,
                                   prompt_throughput=0.0, gen_throughput=0.0, ttft_recent_mean=0.1,
                                   queue_time_recent_mean=0.0, gateway_in_flight=0)
    picks = {ep: 0 for ep in eps}
    for i in range(1000):
        picks[router.route(make_req(f"short {i}"), eps).endpoint] += 1
    assert min(picks.values()) > 150, picks
