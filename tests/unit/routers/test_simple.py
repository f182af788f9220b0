"""random, round-robin, least-request."""

from __future__ import annotations

import random
from collections import Counter

from routers.base import RouterContext
from routers.simple import LeastRequestRouter, RandomRouter, RoundRobinRouter
from tests.unit.routers.registry_helpers import (
    make_eps,
    make_req,
)

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
    assert [router.route(make_req(model="n"), other).endpoint.port for _ in range(3)] == [9001, 9002, 9001]
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
