"""prefix-cache: the chained block keys, the bounded index, AIBrix's load guards, and the routing a
user sees through the gateway (a repeated conversation goes back to the engine that holds it and
leaves that engine when it is overloaded)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import Sequence

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.endpoints import Endpoint
from gateway.request import CHAT, InferenceRequest
from routers.base import RouterContext, RoutingSettings
from routers.prefix_cache import PrefixCacheRouter, PrefixIndex, prefix_keys
from routers.registry import default_registry
from routers.session import encode_session_id
from tests.conftest import model_block

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


# -- keys ----------------------------------------------------------------------------------------


def test_keys_are_chained_per_block_and_ignore_the_partial_tail():
    a = prefix_keys("abcdefgh" "ijklmnop" "qrs", "m", 8, 100)
    b = prefix_keys("abcdefgh" "ijklmnop" "XYZ", "m", 8, 100)
    c = prefix_keys("abcdefgh" "IJKLMNOP", "m", 8, 100)
    assert len(a) == 2 and a == b                # the 3-char tail is not a full block
    assert c[0] == a[0] and c[1] != a[1]
    # a block's key depends on everything before it, not just on its own text
    assert prefix_keys("zzzzzzzz" "ijklmnop", "m", 8, 100)[1] != a[1]
    assert prefix_keys("abcdefgh", "other-model", 8, 100)[0] != a[0]
    assert len(prefix_keys("x" * 80, "m", 8, 4)) == 4     # at most max_blocks
    assert prefix_keys("short", "m", 8, 100) == []


def test_chain_is_memoised_per_request_object():
    _, index, _, _ = setup()
    req = make_req(SYSTEM)
    assert index.keys(req) is index.keys(req)
    assert index.keys(make_req(SYSTEM)) == index.keys(req)


# -- the index -----------------------------------------------------------------------------------


def test_depth_is_the_longest_held_prefix():
    _, index, _, _ = setup()
    eps = make_eps(3)
    index.insert(make_req(SYSTEM), eps[0])
    index.insert(make_req(SYSTEM[:80]), eps[1])
    conv = make_req(SYSTEM + "user: how do switches work?")
    depths, n = index.depths(conv, eps)
    assert n == len(conv.prompt_text) // BLOCK
    assert depths == {eps[0]: 20, eps[1]: 10}
    match = index.match(conv, eps)
    assert match[eps[2]] == 0.0 and match[eps[0]] == pytest.approx(100 * 20 / n)


def test_capacity_evicts_the_deep_end_of_old_chains_first():
    _, index, _, _ = setup(prefix_index_blocks=30)
    eps = make_eps(2)
    index.insert(make_req(SYSTEM), eps[0])              # 20 blocks
    index.insert(make_req("Z" * 80), eps[1])            # 10 more: full
    assert len(index) == 30
    index.insert(make_req("Q" * 40), eps[1])            # 5 new: the 5 least recent go
    assert len(index) == 30 and index.evictions == 5
    depths, _ = index.depths(make_req(SYSTEM), eps)
    assert depths == {eps[0]: 15}                       # the prefix survived, its tail went


def test_idle_blocks_and_entries_expire():
    _, index, clock, _ = setup(prefix_idle_ttl_s=60.0)
    eps = make_eps(2)
    index.insert(make_req(SYSTEM), eps[0])
    clock.t += 30
    index.insert(make_req(SYSTEM[:40]), eps[1])
    clock.t += 40                                       # eps[0]'s entries are 70 s old, eps[1]'s 40 s
    depths, _ = index.depths(make_req(SYSTEM), eps)
    assert depths == {eps[1]: 5}
    assert index.sweep() == 15                          # the blocks only eps[0] held, idle > 60 s
    clock.t += 61
    assert index.sweep() == 5 and len(index) == 0


def test_forget_an_endpoint():
    _, index, _, _ = setup()
    eps = make_eps(2)
    index.insert(make_req(SYSTEM), eps[0])
    index.insert(make_req(SYSTEM[:40]), eps[1])
    index.forget(eps[0])
    assert index.depths(make_req(SYSTEM), eps)[0] == {eps[1]: 5}
    assert len(index) == 5


def test_stats_for_a_gauge():
    _, index, _, _ = setup(prefix_index_blocks=100)
    eps = make_eps(2)
    index.insert(make_req(SYSTEM), eps[0])
    index.insert(make_req(SYSTEM[:40]), eps[1])
    assert index.stats() == {"blocks": 20, "capacity": 100, "entries": 25, "evictions": 0}


texts = st.text(alphabet="ab", min_size=0, max_size=64)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(texts, st.integers(0, 3), st.integers(0, 30)), min_size=1, max_size=40),
       probe=texts, capacity=st.integers(1, 40), ttl=st.integers(5, 100))
def test_property_binary_search_equals_a_linear_walk(ops, probe, capacity, ttl):
    """The index stays prefix-closed under LRU and idle eviction, so binary search finds exactly
    the depth a block-by-block walk finds."""
    clock = Clock()
    index = PrefixIndex(RoutingSettings(prefix_block_chars=4, prefix_index_blocks=capacity,
                                        prefix_idle_ttl_s=float(ttl)), clock)
    eps = make_eps(4)
    for text, who, dt in ops:
        clock.t += dt
        index.insert(make_req(text), eps[who])
    req = make_req(probe)
    keys = index.keys(req)
    cut = int(clock() * 1000) - index.idle_ttl_ms
    expected = {}
    for ep in eps:
        slot = index._slots.get(ep)
        depth = 0
        for k in keys:
            held = index._blocks.get(k)
            if held is None or slot is None:
                break
            ts = (held >> 24 if (held & 0xFFFFFF) == slot else -(1 << 62)) if isinstance(held, int) else held.get(slot, -(1 << 62))
            if ts < cut:
                break
            depth += 1
        if depth:
            expected[ep] = depth
    assert index.depths(req, eps)[0] == expected
    assert len(index) <= capacity


# -- the router ----------------------------------------------------------------------------------


def test_routes_to_the_holder_and_records_the_choice():
    router, index, _, fallbacks = setup()
    eps = make_eps(4, in_flight=[1, 1, 1, 1])
    first = router.route(make_req(SYSTEM), eps).endpoint
    assert fallbacks[("prefix-cache", "no_match")] == 1
    for turn in range(5):
        conv = make_req(SYSTEM + f"user: question {turn} " * 3)
        assert router.route(conv, eps).endpoint is first
    assert index.depths(make_req(SYSTEM + "user: question 4 " * 3), eps)[0] == {first: 26}


def test_highest_match_wins_then_the_least_loaded():
    router, index, _, _ = setup()
    eps = make_eps(3, in_flight=[2, 2, 1])
    index.insert(make_req(SYSTEM), eps[0])
    index.insert(make_req(SYSTEM[:80]), eps[1])
    assert router._choose(make_req(SYSTEM), eps) is eps[0]
    index.insert(make_req(SYSTEM), eps[2])              # same depth, less load
    assert router._choose(make_req(SYSTEM), eps) is eps[2]


def test_short_prompt_goes_least_request():
    router, _, _, fallbacks = setup()
    eps = make_eps(3, in_flight=[3, 0, 2])
    assert router.route(make_req("hi"), eps).endpoint is eps[1]
    assert fallbacks[("prefix-cache", "short_prompt")] == 1


def test_std_guard_leaves_an_overloaded_holder():
    # loads [9, 2, 2, 2]: mean 3.75, sample stddev 3.5 → limit 7.25 with k = 1; spread 7 ≤ 8
    router, index, _, fallbacks = setup(prefix_std_factor=1.0)
    eps = make_eps(4, in_flight=[9, 2, 2, 2])
    index.insert(make_req(SYSTEM), eps[0])
    chosen = router.route(make_req(SYSTEM), eps).endpoint
    assert chosen is not eps[0]
    assert fallbacks[("prefix-cache", "overloaded")] == 1
    # the next request can use both copies: the new one (less loaded) wins
    assert router.route(make_req(SYSTEM), eps).endpoint is chosen
    # with a laxer factor the holder is kept
    lax, index2, _, _ = setup(prefix_std_factor=2.0)
    index2.insert(make_req(SYSTEM), eps[0])
    assert lax.route(make_req(SYSTEM), eps).endpoint is eps[0]


@pytest.mark.parametrize(("loads", "expected"), [
    ([5, 5, 5], None), ([10, 15, 20], None),            # spread ≤ 16: the match decides (holder = pod 2)
    ([5, 40, 45], {0}), ([2, 2, 50, 45], {0, 1}), ([0, 50], {0}),
])
def test_absolute_spread_guard_aibrix_cases(loads, expected):
    """AIBrix §9 item 15's imbalance cases (spread must exceed the threshold, 16 here): above it
    only the least-loaded endpoints are considered, whatever the prefix match says."""
    router, index, _, fallbacks = setup(prefix_imbalance_abs=16, prefix_std_factor=100.0)
    eps = make_eps(len(loads), in_flight=loads)
    holder = eps[-1]
    index.insert(make_req(SYSTEM), holder)
    seen = {eps.index(router._choose(make_req(SYSTEM), eps)) for _ in range(30)}
    if expected is None:
        assert seen == {len(loads) - 1}
        assert not fallbacks
    else:
        assert seen == expected
        assert fallbacks[("prefix-cache", "load_imbalance")] == 30


def test_a_hot_prefix_spreads_instead_of_piling_up():
    """Without releases (requests still running), one hot prompt may not pile onto one engine:
    the guards hand it to more engines as load grows."""
    router, _, _, _ = setup()
    eps = make_eps(8)
    for _ in range(200):
        router.route(make_req(SYSTEM), eps).endpoint.in_flight += 1      # charged like the pipeline does
    loads = [ep.in_flight for ep in eps]
    assert max(loads) - min(loads) <= 8
    assert sum(loads) == 200


def test_score_is_the_match_percentage_for_weighted_lists():
    ctx = RouterContext(rng=random.Random(3), settings=RoutingSettings(prefix_block_chars=BLOCK))
    reg = default_registry(ctx)
    eps = make_eps(3, in_flight=[0, 4, 8])
    ctx.prefix_index.insert(make_req(SYSTEM), eps[2])
    prefix = reg.get("prefix-cache")
    assert prefix.score(make_req(SYSTEM), eps) == [0.0, 0.0, 100.0]
    # prefix weight 3 vs least-request 1: the full match on the busy endpoint wins
    assert reg.get("prefix-cache:3,least-request:1").route(make_req(SYSTEM), eps).endpoint is eps[2]
    # least-request 3 vs prefix 1: the idle endpoint wins, and the list's choice is indexed
    assert reg.get("prefix-cache:1,least-request:3").route(make_req(SYSTEM), eps).endpoint is eps[0]
    assert ctx.prefix_index.match(make_req(SYSTEM), eps) == {eps[0]: 100.0, eps[1]: 0.0, eps[2]: 100.0}


def test_the_context_index_is_the_router_index():
    ctx = RouterContext(settings=RoutingSettings(prefix_block_chars=BLOCK))
    eps = make_eps(2)
    assert ctx.prefix_index.match(make_req(SYSTEM), eps) == dict.fromkeys(eps, 0.0)
    assert ctx.prefix_index.stats() == {"blocks": 0, "capacity": 131072, "entries": 0, "evictions": 0}
    reg = default_registry(ctx)
    assert reg.get("prefix-cache").index is ctx.prefix_index
    ctx.prefix_index.insert(make_req(SYSTEM), eps[1])                     # e.g. the P/D prefill
    assert ctx.prefix_index.match(make_req(SYSTEM + "more text here"), eps)[eps[1]] > 90
    assert reg.get("prefix-cache").route(make_req(SYSTEM), eps).endpoint is eps[1]
    assert ctx.prefix_index.stats()["blocks"] == 20
    other_model = make_eps(2, model="n")
    assert ctx.prefix_index.match(make_req(SYSTEM, model="n"), other_model) == dict.fromkeys(other_model, 0.0)


# -- through the gateway -------------------------------------------------------------------------

LONG_SYSTEM = ("You are the dispatcher of a railway switchyard. Trains arrive from the north and the "
               "south; every track has a length, a set of switches and a signal. ") * 12


async def chat(session: aiohttp.ClientSession, url: str, messages: list[dict], headers: dict | None = None,
               **extra) -> tuple[str, dict]:
    body = {"model": "m", "messages": messages, "max_tokens": 4, **extra}
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers or {}) as r:
        assert r.status == 200, await r.text()
        data = await r.json()
        return r.headers["target-pod"], data


async def test_gateway_sends_a_conversation_back_to_its_engine_and_leaves_it_when_overloaded(sims, gateway):
    engines = [await sims("vllm", "m", prefill_ms_per_token=0.01) for _ in range(3)]
    gw = await gateway([model_block("m", "vllm", [e.url for e in engines], strategy="prefix-cache")],
                       routing={"prefix_imbalance_abs": 2})
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Where is train 7?"}]
    async with aiohttp.ClientSession() as s:
        holder, first = await chat(s, gw.url, messages)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        for turn in range(3):
            messages += [{"role": "assistant", "content": "On track 3."},
                         {"role": "user", "content": f"And train {turn}?"}]
            pod, data = await chat(s, gw.url, messages)
            assert pod == holder                                     # back to the engine with the prefix
            assert data["usage"]["prompt_tokens_details"]["cached_tokens"] > 200   # and it was a cache hit

        # overload the holder: 3 requests stuck on it (pinned there with session-affinity)
        ep = next(e for e in gw.gw.pool.endpoints() if e.name == holder)
        pin = {"routing-strategy": "session-affinity", "x-session-id": encode_session_id(ep.address),
               "x-sim-fault": "stall_before_first=inf"}
        stuck = [asyncio.create_task(chat(s, gw.url, [{"role": "user", "content": f"block {i}"}], pin))
                 for i in range(3)]
        try:
            for _ in range(200):
                if ep.in_flight == 3:
                    break
                await asyncio.sleep(0.01)
            assert ep.in_flight == 3
            messages += [{"role": "user", "content": "One more?"}]
            pod, _ = await chat(s, gw.url, messages)
            assert pod != holder                                      # spread 3 > 2: least loaded instead
            assert ('switchyard_routing_fallbacks_total{reason="load_imbalance",strategy="prefix-cache"} 1.0'
                    in await gw.metrics_text())
        finally:
            for t in stuck:
                t.cancel()
            for t in stuck:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t


def test_endpoint_slots_are_released_when_no_block_mentions_them(monkeypatch):
    """Pods come and go: the index must not keep every endpoint it ever saw."""
    from routers import prefix_index

    monkeypatch.setattr(prefix_index, "_SLOT_COMPACT_AT", 4)
    _, index, _, _ = setup(prefix_index_blocks=40)
    kept = make_eps(1)[0]
    index.insert(make_req(SYSTEM), kept)                     # 20 blocks
    for i in range(30):                                      # 30 short-lived endpoints, 20 blocks each
        ep = Endpoint(url=f"http://10.1.0.{i + 1}:8000", model="m")
        index.insert(make_req(f"{i:03d}" + SYSTEM[3:]), ep)
    assert len(index._slots) <= 8
    assert len(index) == 40
    depths, _ = index.depths(make_req(f"{29:03d}" + SYSTEM[3:]), [ep])
    assert depths == {ep: 20}
