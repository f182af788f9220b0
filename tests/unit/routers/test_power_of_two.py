"""power-of-two: the less loaded of two random candidates."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

from gateway.endpoints import Endpoint
from gateway.request import CHAT, InferenceRequest
from routers.base import RouterContext, RoutingSettings
from routers.power_of_two import PowerOfTwoRouter
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
