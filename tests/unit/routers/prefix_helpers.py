"""Requests, endpoints, a clock and a small index for the prefix-cache tests."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

from gateway.endpoints import Endpoint
from gateway.request import CHAT, InferenceRequest
from routers.base import RouterContext, RoutingSettings
from routers.prefix_cache import PrefixCacheRouter

BLOCK = 8


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_req(text: str, model: str = "m") -> InferenceRequest:
    return InferenceRequest(path=CHAT, body=b"{}", data={}, model=model, stream=False, include_usage=False,
                            prompt_text=text, prompt_tokens_est=max(1, len(text) // 4), request_id="r")


def make_eps(n: int, in_flight: Sequence[int] | None = None, model: str = "m") -> list[Endpoint]:
    eps = [Endpoint(url=f"http://127.0.0.1:{9001 + i}", model=model) for i in range(n)]
    for ep, k in zip(eps, in_flight or [0] * n, strict=True):
        ep.in_flight = k
    return eps


class Fallbacks(Counter):
    def __call__(self, strategy: str, reason: str) -> None:
        self[(strategy, reason)] += 1


def setup(block: int = BLOCK, clock: Clock | None = None, seed: int = 1, **knobs):
    clock = clock or Clock()
    fallbacks = Fallbacks()
    s = RoutingSettings(prefix_block_chars=block, **knobs)
    ctx = RouterContext(rng=random.Random(seed), clock=clock, settings=s, on_fallback=fallbacks)
    return PrefixCacheRouter(ctx), ctx.prefix_index, clock, fallbacks


SYSTEM = "You are a helpful switchyard assistant. " * 4     # 160 chars = 20 blocks of 8

