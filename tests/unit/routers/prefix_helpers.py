"""Requests, endpoints, a clock and a small index for the prefix-cache tests."""

from __future__ import annotations

from routers.prefix_cache import PrefixCacheRouter
from tests.support.factories import Clock, endpoints, inference_request, router_ctx

BLOCK = 8


make_req = inference_request
make_eps = endpoints


def setup(block: int = BLOCK, clock: Clock | None = None, seed: int = 1, **knobs):
    clock = clock or Clock()
    ctx, fallbacks = router_ctx(seed, clock, prefix_block_chars=block, **knobs)
    return PrefixCacheRouter(ctx), ctx.prefix_index, clock, fallbacks


SYSTEM = "You are a helpful switchyard assistant. " * 4     # 160 chars = 20 blocks of 8

