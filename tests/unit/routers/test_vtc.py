"""vtc-basic: per-user token counts over a window."""

from __future__ import annotations

from routers.vtc import VTCRouter, request_tokens
from tests.support.factories import Clock
from tests.unit.routers.strategy_helpers import ctx_for, make_eps, make_req

# -- vtc-basic -----------------------------------------------------------------------------------------


def test_vtc_counts_tokens_per_user_over_a_window():
    clock = Clock()
    ctx, _ = ctx_for(clock=clock, vtc_window_s=300.0)
    router = VTCRouter(ctx)
    eps = make_eps(4)
    req = make_req("x" * 400, user="alice")                  # 100 tokens → 100 + 2 · 150 = 400
    assert request_tokens(req) == 400
    router.route(req, eps)
    clock.t += 200
    router.route(req, eps)
    assert router.user_tokens("alice") == 800
    clock.t += 150                                           # the first request left the window
    assert router.user_tokens("alice") == 400
    clock.t += 151
    assert router.user_tokens("alice") == 0


def test_vtc_separates_heavy_users_from_light_ones():
    clock = Clock()
    ctx, _ = ctx_for(clock=clock)
    router = VTCRouter(ctx)
    eps = make_eps(4)
    heavy, light = make_req("x" * 40_000, user="heavy"), make_req("x" * 40, user="light")
    for _ in range(5):
        router.route(heavy, eps)
        router.route(light, eps)
        clock.t += 2                                         # past the range refresh
    # nothing in flight: fairness decides; the heaviest user targets the last endpoint (address order)
    assert router.route(heavy, eps).endpoint is eps[3]
    assert router.route(light, eps).endpoint is eps[0]
    # load counts too: a busy last endpoint pushes the heavy user to its neighbour
    eps[3].in_flight = 10
    assert router.route(heavy, eps).endpoint is eps[2]


def test_vtc_without_user_is_random_and_counted():
    ctx, fallbacks = ctx_for()
    router = VTCRouter(ctx)
    eps = make_eps(3)
    assert {router.route(make_req(), eps).endpoint for _ in range(200)} == set(eps)
    assert fallbacks == {("vtc-basic", "no_user"): 200}
    assert router.score(make_req(), eps) == [None, None, None]


def test_vtc_bounds_its_users():
    from routers import vtc

    ctx, _ = ctx_for()
    router = VTCRouter(ctx)
    eps = make_eps(2)
    for i in range(vtc.MAX_USERS + 50):
        router.post_route(make_req(user=f"u{i}"), eps[0])
    assert len(router._users) == vtc.MAX_USERS


def test_vtc_a_lone_user_is_spread_over_equal_endpoints():
    """One active user weighs the same as every active user: the fairness term is neutral, so with
    nothing in flight its requests are spread at random, also between two range refreshes. Each
    request raised the cached heaviest count to the user's own and left the cached lightest at its
    count before, so the lone user read as the heaviest and went to the last endpoint in address order (59 of 60)."""
    ctx, _ = ctx_for()                                       # the clock stands: no range refresh
    router = VTCRouter(ctx)
    eps = make_eps(3)
    req = make_req("x" * 400, user="alice")
    counts = dict.fromkeys(eps, 0)
    for _ in range(60):
        counts[router.route(req, eps).endpoint] += 1
    assert min(counts.values()) >= 10, [counts[ep] for ep in eps]
