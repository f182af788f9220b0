"""Requests, endpoints and a context for the power-of-two, session, vtc and built-in registry tests."""

from __future__ import annotations

import random
from collections.abc import Sequence

from gateway.endpoints import Endpoint
from gateway.request import CHAT, InferenceRequest
from routers.base import RouterContext, RoutingSettings
from tests.support.clock import Clock, Fallbacks


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

