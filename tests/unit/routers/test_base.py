"""The router contract: every strategy returns a Decision; hooks and capabilities are declared."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import pytest

from gateway.endpoints import Endpoint
from gateway.request import CHAT, InferenceRequest
from routers.base import Decision, Router, RouterContext, ScoringRouter
from routers.pd import PDRouteSettings
from routers.registry import (
    RouterRegistry,
    default_registry,
)
from routers.simple import LeastRequestRouter, RandomRouter, RoundRobinRouter


def weighted(parts, rng=None):
    from routers.registry import WeightedRouter
    return WeightedRouter("test", parts, rng=rng)


def make_req(model: str = "m") -> InferenceRequest:
    return InferenceRequest(path=CHAT, body=b"{}", data={}, model=model, stream=False, include_usage=False,
                            prompt_text="user\nhello", prompt_tokens_est=3, request_id="req-1")


def make_eps(n: int, model: str = "m", in_flight: Sequence[int] | None = None) -> list[Endpoint]:
    eps = [Endpoint(url=f"http://127.0.0.1:{9001 + i}", model=model) for i in range(n)]
    for ep, k in zip(eps, in_flight or [0] * n, strict=True):
        ep.in_flight = k
    return eps


class FixedScorer(ScoringRouter):
    """A scoring router whose scores are given per endpoint port (None / NaN / Inf allowed)."""

    def __init__(self, name: str, polarity: str, scores: dict[int, float | None] | None = None) -> None:
        self.name = name
        self.polarity = polarity
        self.scores = scores or {}
        self.routed: list[Endpoint] = []

    def score(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float | None]:
        return [self.scores.get(ep.port) for ep in candidates]

    def route(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> Decision:
        return Decision(candidates[0], self.name)

    def post_route(self, req: InferenceRequest, ep: Endpoint) -> None:
        self.routed.append(ep)


class PlainRouter(Router):
    def __init__(self, name: str) -> None:
        self.name = name

    def route(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> Decision:
        return Decision(candidates[-1], self.name)


AIBRIX_NAMES = {"prefix-cache", "least-latency", "least-request", "random", "pd", "slo", "slo-pack-load", "a", "b"}


def dummy_registry() -> RouterRegistry:
    """A registry holding the built-ins plus dummies named like AIBrix's strategies."""
    reg = RouterRegistry(RouterContext(rng=random.Random(7)))
    reg.register("random", RandomRouter, scoring=False)
    reg.register("round-robin", RoundRobinRouter, scoring=False)
    reg.register("least-request", LeastRequestRouter, scoring=True)
    for name in ("prefix-cache", "least-latency"):
        reg.register(name, lambda ctx, name=name: FixedScorer(name, "least"), scoring=True)
    for name in ("pd", "slo", "slo-pack-load"):
        reg.register(name, lambda ctx, name=name: PlainRouter(name), scoring=False)
    return reg


# -- the contract: every strategy returns a Decision; hooks and capabilities are declared -------------

EVERY_SPEC = ["prefix-cache:3,least-request:2,least-kv-cache:2", "session-affinity:1,least-waiting:2",
              "least-latency:1,throughput:1,vtc-basic:1"]


@pytest.mark.parametrize("n", [1, 3])
def test_every_strategy_returns_a_decision(n):
    reg = default_registry(RouterContext(rng=random.Random(1)))
    eps = make_eps(n, in_flight=list(range(n)))
    req = InferenceRequest(path=CHAT, body=b"{}", data={}, model="m", stream=False, include_usage=False,
                           prompt_text="user\nhello " * 200, prompt_tokens_est=500, request_id="r", user="alice",
                           session_key="k")
    for spec in reg.names() + EVERY_SPEC:
        router = reg.get(spec)
        decision = router.route(req, eps)
        assert isinstance(decision, Decision), spec
        assert any(decision.endpoint is ep for ep in eps) and decision.prefill is None, spec
        assert decision.strategy == router.name, spec      # the gateway overwrites it with the spec


def test_only_pd_chooses_pairs():
    reg = default_registry(RouterContext())
    assert [name for name in reg.names() if reg.get(name).chooses_pairs] == ["pd"]
    assert not reg.get("prefix-cache:1,least-request:1").chooses_pairs


def test_hooks_default_to_nothing():
    ctx = RouterContext()
    eps = make_eps(2)
    plain = PlainRouter("plain")
    assert plain.post_route(make_req(), eps[0]) is None
    assert plain.response_headers(make_req(), eps[0]) == {}
    assert not plain.chooses_pairs
    # in a weighted list, parts without hooks add nothing; a part's own hooks see the list's choice
    scorer = FixedScorer("s", "most", {9002: 1.0})
    decision = weighted([(LeastRequestRouter(ctx), 1), (scorer, 3)]).route(make_req(), eps)
    assert decision.endpoint is eps[1] and decision.headers == {} and scorer.routed == [eps[1]]


def test_the_context_is_built_once():
    ctx = RouterContext()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.on_fallback = print   # type: ignore[misc]
    assert ctx.pd_settings("any-model") == PDRouteSettings()
    assert ctx.prefix_index is ctx.prefix_index and len(ctx.prefix_index) == 0
