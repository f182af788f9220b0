"""power-of-two: the less loaded of two random candidates."""

from __future__ import annotations

from collections import Counter

from routers.power_of_two import PowerOfTwoRouter
from tests.unit.routers.strategy_helpers import ctx_for, make_eps, make_req

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
