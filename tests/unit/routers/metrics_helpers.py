"""Requests, endpoints, a context and engine snapshots for the metric strategies."""

from __future__ import annotations

import random
from collections.abc import Sequence

from gateway.endpoints import Endpoint, EngineMetrics
from gateway.request import CHAT, InferenceRequest
from routers.base import RouterContext, RoutingSettings
from tests.support.clock import Clock, Fallbacks


def make_req(tokens: int = 100) -> InferenceRequest:
    return InferenceRequest(path=CHAT, body=b"{}", data={}, model="m", stream=False, include_usage=False,
                            prompt_text="x" * (4 * tokens), prompt_tokens_est=tokens, request_id="r")


def make_eps(n: int, in_flight: Sequence[int] | None = None) -> list[Endpoint]:
    eps = [Endpoint(url=f"http://127.0.0.1:{9001 + i}", model="m") for i in range(n)]
    for ep, k in zip(eps, in_flight or [0] * n, strict=True):
        ep.in_flight = k
    return eps


def ctx_for(clock: Clock | None = None, seed: int = 1, **knobs) -> tuple[RouterContext, Fallbacks]:
    fallbacks = Fallbacks()
    ctx = RouterContext(rng=random.Random(seed), clock=clock or Clock(),
                        settings=RoutingSettings(metrics_max_age_s=10.0, **knobs), on_fallback=fallbacks)
    return ctx, fallbacks


def snap(t: float = 1000.0, **fields) -> EngineMetrics:
    return EngineMetrics(scraped_at=t, **fields)

