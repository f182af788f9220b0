"""Strategy grammar, registry, weighted combination (AIBrix §9 items 1 and 2)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routers import registry as registry_mod
from routers.base import Router, RouterContext, ScoringRouter
from routers.registry import (
    RouterRegistry,
    StrategyError,
    WeightedRouter,
    default_registry,
    parse_strategy,
    strategy_label,
)
from routers.simple import LeastRequestRouter, RandomRouter, RoundRobinRouter
from tests.unit.routers.registry_helpers import (
    AIBRIX_NAMES,
    FixedScorer,
    PlainRouter,
    dummy_registry,
    make_eps,
    make_req,
    weighted,
)


def test_default_registry_names():
    assert {"random", "round-robin", "least-request", "pd"} <= set(default_registry(RouterContext()).names())
    assert {"prefix-cache", "pd", "least-request"} <= set(dummy_registry().names())


# -- grammar (AIBrix §9 items 1 and 2) -------------------------------------------------------------


def test_parse_weighted_list():
    assert parse_strategy("prefix-cache:2,least-latency:1,least-request", AIBRIX_NAMES) == [
        ("prefix-cache", 2), ("least-latency", 1), ("least-request", 1)]


def test_weight_zero_drops_the_entry():
    assert parse_strategy("prefix-cache:0,least-request", AIBRIX_NAMES) == [("least-request", 1)]
    assert parse_strategy("a:1000000,b:0", AIBRIX_NAMES) == [("a", 1_000_000)]


def test_leading_zeros_keep_a_weight_whatever_their_number():
    assert parse_strategy("a:" + "0" * 5000 + "7,b:007", AIBRIX_NAMES) == [("a", 7), ("b", 7)]


def test_names_are_trimmed_and_case_insensitive():
    assert parse_strategy("  Least-Request : 2 , PREFIX-cache ", AIBRIX_NAMES) == [
        ("least-request", 2), ("prefix-cache", 1)]


@pytest.mark.parametrize("spec", [
    "a:1.5", "a:-1", "a:1000001", "a,,b", "a:1:2", "a:0", "a:0,b:0", "", "   ", "a:", ":1", "a:1e3", "a:+1",
    ",a", "a,", "a:one", "a,a", "bogus", "invalid-routing-strategy", "least-request:1,invalid-strategy:2",
    "a:" + "9" * 5000, "a:" + "0" * 4400 + "1000001",      # more digits than int() converts: still a bad weight
])
def test_invalid_specs(spec):
    with pytest.raises(StrategyError) as exc:
        parse_strategy(spec, AIBRIX_NAMES)
    assert str(exc.value).startswith(f"incorrect routing strategy {spec}")
    assert isinstance(exc.value, ValueError)


def test_exclusive_entries_win_alone():
    assert parse_strategy("least-request,pd", AIBRIX_NAMES) == [("pd", 1)]
    assert parse_strategy("slo,least-request", AIBRIX_NAMES) == [("slo", 1)]
    assert parse_strategy("least-request:3,slo-pack-load:2", AIBRIX_NAMES) == [("slo-pack-load", 2)]
    assert parse_strategy("pd:0,least-request", AIBRIX_NAMES) == [("least-request", 1)]   # dropped first


def test_without_known_names_any_name_parses():
    assert parse_strategy("x:3,y") == [("x", 3), ("y", 1)]


# -- registry --------------------------------------------------------------------------------------


def test_single_entry_returns_the_router_itself_and_is_cached():
    reg = dummy_registry()
    lr = reg.get("least-request")
    assert isinstance(lr, LeastRequestRouter)
    assert reg.get("least-request") is lr
    assert reg.get("LEAST-REQUEST") is lr             # another spelling, the same shared instance
    assert reg.get("least-request:5") is lr
    assert isinstance(reg.get("random"), RandomRouter)
    assert isinstance(reg.get("round-robin"), RoundRobinRouter)


def test_get_is_a_lookup_after_the_first_call(monkeypatch):
    reg = dummy_registry()
    spec = "prefix-cache:2,least-request"
    router = reg.get(spec)

    def boom(*a, **k):
        raise AssertionError("parsed again")
    monkeypatch.setattr(registry_mod, "parse_strategy", boom)
    assert reg.get(spec) is router


def test_factories_run_once_per_name():
    calls = Counter()
    reg = RouterRegistry(RouterContext())

    def factory(ctx):
        calls["x"] += 1
        return FixedScorer("x", "least")
    reg.register("x", factory, scoring=True)
    reg.register("y", lambda ctx: FixedScorer("y", "most"), scoring=True)
    reg.get("x")
    reg.get("x:1,y:1")
    reg.get("y,x")
    assert calls["x"] == 1


def test_weighted_list_builds_a_weighted_router():
    reg = dummy_registry()
    spec = "Prefix-Cache:2, least-request"
    router = reg.get(spec)
    assert isinstance(router, WeightedRouter)
    assert router.name == spec
    assert [(r.name, c) for r, c, _ in router.parts] == [("prefix-cache", 2 / 3), ("least-request", 1 / 3)]
    assert router.parts[1][0] is reg.get("least-request")


def test_non_scoring_routers_cannot_be_combined():
    reg = dummy_registry()
    with pytest.raises(StrategyError, match="random"):
        reg.get("random,least-request")
    with pytest.raises(StrategyError):
        reg.get("round-robin:1,least-request:1")


def test_unknown_strategy_through_the_registry():
    reg = dummy_registry()
    for spec in ("invalid-routing-strategy", "least-request:1,invalid-strategy:2"):
        with pytest.raises(StrategyError):
            reg.get(spec)


def test_exclusive_through_the_registry():
    reg = dummy_registry()
    assert reg.get("least-request,pd") is reg.get("pd")
    assert reg.get("slo,least-request").name == "slo"


def test_register_rules():
    reg = dummy_registry()
    with pytest.raises(ValueError):
        reg.register("Least-Request", LeastRequestRouter, scoring=True)
    with pytest.raises(ValueError):
        reg.register("a:b", LeastRequestRouter, scoring=True)
    with pytest.raises(StrategyError):
        reg.get("later")
    reg.register("later", lambda ctx: FixedScorer("later", "most"), scoring=True)
    assert reg.get("later").name == "later"
    assert "LATER" in reg and reg.is_scoring("later") and not reg.is_scoring("random")


def test_scoring_registration_is_checked():
    reg = RouterRegistry(RouterContext())
    reg.register("fake", lambda ctx: PlainRouter("fake"), scoring=True)
    with pytest.raises(TypeError):
        reg.get("fake")


def test_spec_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(registry_mod, "MAX_CACHED_SPECS", 4)
    reg = dummy_registry()
    for w in range(1, 20):
        assert reg.get(f"least-request:{w}") is reg.get("least-request")
    assert len(reg._cache) <= 4


def test_router_base_classes():
    ctx = RouterContext()
    assert isinstance(LeastRequestRouter(ctx), ScoringRouter)
    assert isinstance(RandomRouter(ctx), Router) and not isinstance(RandomRouter(ctx), ScoringRouter)
    assert isinstance(RoundRobinRouter(ctx), Router) and not isinstance(RoundRobinRouter(ctx), ScoringRouter)


# -- weighted combination ---------------------------------------------------------------------------


def test_weighted_normalisation_math():
    eps = make_eps(3)
    a = FixedScorer("a", "least", {9001: 1, 9002: 2, 9003: 3})     # → 1, 0.5, 0
    b = FixedScorer("b", "most", {9001: 10, 9002: 10, 9003: 40})   # → 0, 0, 1
    router = weighted([(a, 2), (b, 1)])
    assert router.score(make_req(), eps) == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    assert router.route(make_req(), eps).endpoint is eps[0]
    router = weighted([(a, 1), (b, 3)])
    assert router.score(make_req(), eps) == pytest.approx([0.25, 0.125, 0.75])
    assert router.route(make_req(), eps).endpoint is eps[2]


def test_weighted_equal_scores_get_one_and_invalid_get_zero():
    eps = make_eps(5)
    flat = FixedScorer("flat", "least", {p: 5 for p in range(9001, 9006)})
    assert weighted([(flat, 1)]).score(make_req(), eps) == [1.0] * 5
    odd = FixedScorer("odd", "least", {9001: None, 9002: 1, 9003: math.nan, 9004: math.inf, 9005: 3})
    assert weighted([(odd, 1)]).score(make_req(), eps) == [0.0, 1.0, 0.0, 0.0, 0.0]
    single = FixedScorer("single", "most", {9003: -2.5})
    assert weighted([(single, 1)]).score(make_req(), eps) == [0.0, 0.0, 1.0, 0.0, 0.0]
    nothing = FixedScorer("nothing", "most", {})
    assert weighted([(nothing, 1), (flat, 1)]).score(make_req(), eps) == [0.5] * 5


def test_weighted_ties():
    eps = make_eps(4)
    scorer = FixedScorer("s", "least", {9001: 3, 9002: 1, 9003: 1, 9004: 1})
    assert all(weighted([(scorer, 1)]).route(make_req(), eps).endpoint is eps[1] for _ in range(5))   # first tie
    router = weighted([(scorer, 1)], rng=random.Random(4))
    seen = Counter(router.route(make_req(), eps).endpoint.port for _ in range(3000))
    assert set(seen) == {9002, 9003, 9004} and min(seen.values()) > 800


def test_weighted_with_least_request():
    reg = dummy_registry()
    eps = make_eps(3, in_flight=[0, 5, 10])
    prefix = reg.get("prefix-cache")
    prefix.polarity = "least"
    prefix.scores = {9001: 100, 9002: 0, 9003: 0}          # endpoint 1 is worst for the prefix dummy
    router = reg.get("prefix-cache:1,least-request:3")
    # prefix: [0, 1, 1] * 1/4 ; least-request: [1, 0.5, 0] * 3/4 → [0.75, 0.625, 0.25]
    assert router.score(make_req(), eps) == pytest.approx([0.75, 0.625, 0.25])
    assert router.route(make_req(), eps).endpoint is eps[0]
    assert prefix.routed == [eps[0]]                        # post_route hook saw the decision


def test_weighted_rejects_bad_parts():
    eps = make_eps(2)
    with pytest.raises(ValueError):
        weighted([(FixedScorer("x", "sideways"), 1)])
    with pytest.raises(ValueError):
        weighted([])

    class Short(FixedScorer):
        def score(self, req, candidates):
            return [1.0]
    with pytest.raises(ValueError):
        weighted([(Short("short", "least"), 1)]).route(make_req(), eps)


# -- property: the decision is always a candidate ---------------------------------------------------

score_values = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5))


@settings(max_examples=300, deadline=None)
@given(
    in_flight=st.lists(st.integers(0, 6), min_size=1, max_size=16),
    spec=st.sampled_from(["random", "round-robin", "least-request", "prefix-cache", "least-latency:3,least-request",
                          "prefix-cache:2,least-latency:1,least-request", "least-request,pd"]),
    scores=st.lists(score_values, min_size=16, max_size=16),
    seed=st.integers(0, 2**32 - 1),
    polarity=st.sampled_from(["least", "most"]),
)
def test_property_decision_is_a_candidate(in_flight, spec, scores, seed, polarity):
    reg = dummy_registry()
    reg.ctx.rng.seed(seed)
    eps = make_eps(len(in_flight), in_flight=in_flight)
    for name in ("prefix-cache", "least-latency"):
        dummy = reg.get(name)
        dummy.polarity = polarity
        dummy.scores = {ep.port: s for ep, s in zip(eps, scores, strict=False)}
    router = reg.get(spec)
    for _ in range(3):
        chosen = router.route(make_req(), eps).endpoint
        assert any(chosen is ep for ep in eps)
    if spec == "least-request":
        assert chosen.in_flight == min(in_flight)


def test_every_spelling_of_a_strategy_resolves_to_one_canonical_name():
    reg = dummy_registry()
    assert reg.resolve("least-request") == ("least-request", reg.get("least-request"))
    for spec in ("LEAST-REQUEST", " least-request ", "least-request:5", "least-request,random:0"):
        assert reg.resolve(spec) == ("least-request", reg.get("least-request")), spec
    assert reg.resolve("Prefix-Cache:4, least-request:2")[0] == "prefix-cache:2,least-request"
    assert reg.resolve("prefix-cache:2,least-request")[0] == "prefix-cache:2,least-request"
    assert reg.resolve("prefix-cache:3,least-request:3")[0] == "prefix-cache,least-request"
    assert reg.resolve("least-request:1,pd")[0] == "pd"


def test_the_metric_label_of_a_strategy_is_its_names_sorted_without_weights():
    reg = dummy_registry()
    labels = {strategy_label(reg.resolve(spec)[0])
              for spec in ("prefix-cache:2,least-request", "least-request:9,prefix-cache:4",
                           "prefix-cache,least-request", "Least-Request:3, PREFIX-CACHE:1")}
    assert labels == {"least-request,prefix-cache"}
    assert strategy_label(reg.resolve("least-request:7")[0]) == "least-request"
    assert strategy_label("pd") == "pd"
