"""Requests, endpoints and stand-in routers for the registry, contract and simple-router tests."""

from __future__ import annotations

import random
from collections.abc import Sequence
from functools import partial

from gateway.endpoints import Endpoint
from gateway.request import InferenceRequest
from routers.base import Decision, Router, RouterContext, ScoringRouter
from routers.registry import RouterRegistry, WeightedRouter
from routers.simple import LeastRequestRouter, RandomRouter, RoundRobinRouter
from tests.support.factories import endpoints, inference_request

make_req = partial(inference_request, "user\nhello", tokens=3, request_id="req-1")
make_eps = endpoints


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


def weighted(parts, rng=None) -> WeightedRouter:
    """A weighted list of routers, as ``prefix-cache:2,least-request:1`` builds."""
    return WeightedRouter("test", parts, rng=rng)
