"""The router contract: every strategy returns a Decision; hooks and capabilities are declared."""

from __future__ import annotations

import dataclasses
import random

import pytest

from gateway.request import CHAT, InferenceRequest
from routers.base import Decision, RouterContext
from routers.pd import PDRouteSettings
from routers.registry import (
    default_registry,
)
from routers.simple import LeastRequestRouter
from tests.unit.routers.registry_helpers import (
    FixedScorer,
    PlainRouter,
    make_eps,
    make_req,
    weighted,
)

# -- the contract: every strategy returns a Decision; hooks and capabilities are declared -------------

EVERY_SPEC = ["prefix-cache:3,least-request:2,least-kv-cache:2", "session-affinity:1,least-waiting:2",
              "least-latency:1,throughput:1,vtc-basic:1"]


@pytest.mark.parametrize("n", [1, 3])
def test_every_strategy_returns_a_decision(n):
    reg = default_registry(RouterContext(rng=random.Random(1)))
    eps = make_eps(n, in_flight=list(range(n)))
    req = InferenceRequest(path=CHAT, body=b"{}", data={}, model="m", stream=False, include_usage=False,
                           prompt_text="user\nhello " * 200, prompt_tokens_est=500, request_id="r", user="alice",
                           session_key="k")
    for spec in reg.names() + EVERY_SPEC:
        router = reg.get(spec)
        decision = router.route(req, eps)
        assert isinstance(decision, Decision), spec
        assert any(decision.endpoint is ep for ep in eps) and decision.prefill is None, spec
        assert decision.strategy == router.name, spec      # the gateway overwrites it with the spec


def test_only_pd_chooses_pairs():
    reg = default_registry(RouterContext())
    assert [name for name in reg.names() if reg.get(name).chooses_pairs] == ["pd"]
    assert not reg.get("prefix-cache:1,least-request:1").chooses_pairs


def test_hooks_default_to_nothing():
    ctx = RouterContext()
    eps = make_eps(2)
    plain = PlainRouter("plain")
    assert plain.post_route(make_req(), eps[0]) is None
    assert plain.response_headers(make_req(), eps[0]) == {}
    assert not plain.chooses_pairs
    # in a weighted list, parts without hooks add nothing; a part's own hooks see the list's choice
    scorer = FixedScorer("s", "most", {9002: 1.0})
    decision = weighted([(LeastRequestRouter(ctx), 1), (scorer, 3)]).route(make_req(), eps)
    assert decision.endpoint is eps[1] and decision.headers == {} and scorer.routed == [eps[1]]


def test_the_context_is_built_once():
    ctx = RouterContext()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.on_fallback = print   # type: ignore[misc]
    assert ctx.pd_settings("any-model") == PDRouteSettings()
    assert ctx.prefix_index is ctx.prefix_index and len(ctx.prefix_index) == 0
