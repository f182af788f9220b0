"""session-affinity: session ids, rendezvous hashing, weighted lists (AIBrix §9 item 18)."""

from __future__ import annotations

import base64
import random
from collections import Counter

import pytest

from gateway.endpoints import Endpoint
from routers.base import Decision
from routers.registry import default_registry
from routers.session import SessionAffinityRouter, decode_session_id, encode_session_id, fnv1a64, rendezvous
from tests.unit.routers.strategy_helpers import ctx_for, make_eps, make_req

# -- session-affinity (AIBrix §9 item 18) -------------------------------------------------------------


def test_session_id_pins_the_endpoint_and_is_returned():
    ctx, fallbacks = ctx_for()
    router = SessionAffinityRouter(ctx)
    eps = make_eps(4)
    sid = base64.b64encode(b"10.0.0.3:8000").decode()
    d = router.route(make_req(session_id=sid), eps)
    assert isinstance(d, Decision) and d.endpoint is eps[2]
    assert d.headers == {"x-session-id": sid}
    assert not fallbacks


@pytest.mark.parametrize("sid", ["not base64!!", base64.b64encode(b"10.9.9.9:8000").decode(),
                                 base64.b64encode(b"\xff\xfe").decode()])
def test_invalid_or_gone_session_is_random_with_a_new_header(sid):
    ctx, fallbacks = ctx_for()
    router = SessionAffinityRouter(ctx)
    eps = make_eps(4)
    seen = set()
    for _ in range(100):
        d = router.route(make_req(session_id=sid), eps)
        assert decode_session_id(d.headers["x-session-id"]) == d.endpoint.address
        seen.add(d.endpoint)
    assert len(seen) == 4
    assert fallbacks == {("session-affinity", "session_endpoint_gone"): 100}


def test_session_key_rendezvous_is_stable_and_order_independent():
    ctx, _ = ctx_for()
    router = SessionAffinityRouter(ctx)
    eps = make_eps(6)
    first = router.route(make_req(session_key="conversation-42"), eps).endpoint
    shuffled = list(eps)
    for seed in range(10):
        random.Random(seed).shuffle(shuffled)
        assert router.route(make_req(session_key="conversation-42"), shuffled).endpoint is first
        # another gateway replica (fresh router, its own endpoint objects) agrees
        other = SessionAffinityRouter(ctx_for(seed=seed)[0])
        twins = [Endpoint(url=ep.url, model="m") for ep in shuffled]
        assert other.route(make_req(session_key="conversation-42"), twins).endpoint.url == first.url


def test_rendezvous_moves_only_the_sessions_of_a_removed_endpoint():
    eps = make_eps(5)
    keys = [f"s{i}" for i in range(300)]
    before = {k: rendezvous(k, eps) for k in keys}
    gone = eps[1]
    after = {k: rendezvous(k, [e for e in eps if e is not gone]) for k in keys}
    moved = [k for k in keys if after[k] is not before[k]]
    assert moved and all(before[k] is gone for k in moved)
    assert Counter(before.values()).most_common()[-1][1] > 30        # spread over all five


def test_rendezvous_is_aibrix_fnv1a():
    # FNV-1a 64 reference values, and the AIBrix composition key ‖ 0x00 ‖ address
    assert fnv1a64(b"") == 0xCBF29CE484222325
    assert fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    eps = make_eps(3)
    scores = {ep: fnv1a64(ep.address.encode(), fnv1a64(b"\0", fnv1a64(b"k1"))) for ep in eps}
    assert rendezvous("k1", eps) is max(scores, key=scores.get)


def test_no_session_is_random_and_counted():
    ctx, fallbacks = ctx_for()
    router = SessionAffinityRouter(ctx)
    eps = make_eps(3)
    picks = Counter(router.route(make_req(), eps).endpoint for _ in range(300))
    assert set(picks) == set(eps)
    assert fallbacks == {("session-affinity", "no_session"): 300}
    assert router.route(make_req(session_key="k" * 300), eps).endpoint in eps
    assert fallbacks[("session-affinity", "bad_session_key")] == 1


def test_session_affinity_scores_in_a_weighted_list():
    ctx, _ = ctx_for()
    reg = default_registry(ctx)
    eps = make_eps(3, in_flight=[0, 3, 6])
    pinned = make_req(session_id=encode_session_id(eps[2].address))
    assert reg.get("session-affinity").score(pinned, eps) == [0.0, 0.0, 1.0]
    d = reg.get("session-affinity:2,least-request:1").route(pinned, eps)
    assert d.endpoint is eps[2] and d.headers == {"x-session-id": encode_session_id(eps[2].address)}
    d = reg.get("session-affinity:1,least-request:2").route(pinned, eps)
    assert d.endpoint is eps[0] and d.headers == {"x-session-id": encode_session_id(eps[0].address)}
    d = reg.get("least-request:1,least-kv-cache:1").route(pinned, eps)
    assert isinstance(d, Decision) and d.endpoint is eps[0] and d.headers == {}
