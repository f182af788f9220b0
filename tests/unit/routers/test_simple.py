"""random, round-robin, least-request."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

from gateway.endpoints import Endpoint
from gateway.request import CHAT, InferenceRequest
from routers.base import Decision, Router, RouterContext, ScoringRouter
from routers.registry import (
    RouterRegistry,
)
from routers.simple import LeastRequestRouter, RandomRouter, RoundRobinRouter


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


# -- simple routers -----------------------------------------------------------------------------------


def test_random_uses_the_context_rng():
    eps = make_eps(4)
    router = RandomRouter(RouterContext(rng=random.Random(3)))
    seen = [router.route(make_req(), eps).endpoint for _ in range(400)]
    assert {ep.port for ep in seen} == {ep.port for ep in eps}
    again = RandomRouter(RouterContext(rng=random.Random(3)))
    assert [again.route(make_req(), eps).endpoint for _ in range(400)] == seen     # reproducible from the seed


def test_round_robin_cycles_per_model():
    router = RoundRobinRouter(RouterContext())
    eps = make_eps(3)
    other = make_eps(2, model="n")
    picks = [router.route(make_req(), eps).endpoint.port for _ in range(7)]
    assert picks == [9001, 9002, 9003, 9001, 9002, 9003, 9001]
    assert [router.route(make_req("n"), other).endpoint.port for _ in range(3)] == [9001, 9002, 9001]
    assert router.route(make_req(), eps).endpoint.port == 9002    # model m continued where it was
    # the candidate set shrinks: still a valid candidate
    assert router.route(make_req(), eps[:1]).endpoint is eps[0]


def test_least_request_picks_the_minimum():
    router = LeastRequestRouter(RouterContext(rng=random.Random(1)))
    eps = make_eps(5, in_flight=[4, 2, 7, 1, 3])
    assert router.route(make_req(), eps).endpoint is eps[3]
    assert router.score(make_req(), eps) == [4, 2, 7, 1, 3]
    assert router.polarity == "least"


def test_least_request_spreads_ties():
    router = LeastRequestRouter(RouterContext(rng=random.Random(2)))
    eps = make_eps(4, in_flight=[1, 0, 0, 0])
    seen = Counter(router.route(make_req(), eps).endpoint.port for _ in range(3000))
    assert set(seen) == {9002, 9003, 9004}
    assert min(seen.values()) > 800          # uniform among the three tied minima


def test_least_request_burst_with_charging_is_even():
    router = LeastRequestRouter(RouterContext(rng=random.Random(5)))
    eps = make_eps(3)
    for _ in range(30):
        router.route(make_req(), eps).endpoint.in_flight += 1   # what the pipeline does in the same step
    assert [ep.in_flight for ep in eps] == [10, 10, 10]
