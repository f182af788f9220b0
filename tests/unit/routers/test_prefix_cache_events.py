"""The prefix-cache router on KV events: what counts as a match."""

from __future__ import annotations

import random

import orjson

from enginesim.tiny_tokenizer import TINY_DIR
from gateway.endpoints import Endpoint
from gateway.kv.index import EventIndex
from gateway.kv.settings import KVEventsConfig
from gateway.kv.tokenization import ModelTokenizer
from gateway.kv.wire import Batch, BlockStored
from gateway.request import CHAT, parse
from routers.base import RouterContext, RoutingSettings
from routers.prefix_cache import PrefixCacheRouter
from tests.support.factories import Clock, Fallbacks

BS = 16
HEADER = "Knowledge cutoff: December 2023. Today: 26 Jul 2024. "    # every system prompt starts with it


class _View:
    """The event index as ``RouterContext.precise_index`` (``KVEventsManager``'s router-facing part)."""

    def __init__(self, index: EventIndex) -> None:
        self.index = index

    def covers(self, req) -> bool:
        return True

    def match(self, req, candidates):
        return self.index.match(req, candidates)

    def routed(self, req, ep) -> None:
        self.index.routed(req, ep)

    async def prepare(self, req, candidates) -> None:
        return None


def _setup(**routing):
    tok = ModelTokenizer(TINY_DIR)
    settings = KVEventsConfig(enabled=True)
    index = EventIndex({"m": tok}, lambda m: settings)
    eps = [Endpoint(url=f"http://10.0.0.{i + 1}:8000", model="m") for i in range(3)]
    states = [index.track(ep, settings) for ep in eps]
    for i, st in enumerate(states):                  # live: each engine reported something else
        index.apply(st, Batch(0.0, [BlockStored([1000 + i], None, [7 + i] * BS, BS)], 0))
    fallbacks = Fallbacks()
    ctx = RouterContext(rng=random.Random(1), clock=Clock(), settings=RoutingSettings(**routing),
                        on_fallback=fallbacks, precise_index=_View(index))
    return PrefixCacheRouter(ctx), tok, index, eps, states, fallbacks


def _messages(n: int) -> list[dict]:
    return [{"role": "system", "content": HEADER + f"you are assistant {n}. " + "kqz lo abc the of " * 60},
            {"role": "user", "content": f"question for {n}"}]


def _req(messages: list[dict]):
    return parse(CHAT, orjson.dumps({"model": "m", "messages": messages}), {}, "r")


def _store(index: EventIndex, st, ids: list[int], blocks: int, first_hash: int) -> None:
    index.apply(st, Batch(0.0, [BlockStored(list(range(first_hash, first_hash + blocks)), None,
                                            ids[:blocks * BS], BS)], 0))


def test_a_short_shared_head_does_not_draw_a_new_prompt_to_its_holder():
    router, tok, index, eps, states, fallbacks = _setup()
    ids = tok.encode(tok.render(_messages(1)))
    other = tok.encode(tok.render(_messages(2)))
    shared = next(i for i, (a, b) in enumerate(zip(ids, other, strict=False)) if a != b)
    assert BS <= shared < 128                        # the prompts share their first blocks only
    _store(index, states[0], ids, len(ids) // BS, 1)     # engine 0 holds prompt 1 (and so the head)
    eps[0].in_flight = 3
    decision = router.route(_req(_messages(2)), eps)
    # the least loaded, not the holder of the shared head (a few % of the prompt)
    assert decision.endpoint is not eps[0] and decision.prefix_match is None
    assert fallbacks[("prefix-cache", "no_match")] == 1


def test_a_match_as_long_as_the_floor_still_wins_over_load():
    router, tok, index, eps, states, _ = _setup()
    ids = tok.encode(tok.render(_messages(1)))
    _store(index, states[1], ids, 8, 1)              # 128 tokens of the prompt
    eps[1].in_flight = 3
    assert router.route(_req(_messages(1)), eps).endpoint is eps[1]


def test_a_floor_of_zero_counts_any_cached_block():
    router, tok, index, eps, states, _ = _setup(prefix_min_match_tokens=0)
    ids = tok.encode(tok.render(_messages(1)))
    _store(index, states[0], ids, len(ids) // BS, 1)
    eps[0].in_flight = 3
    assert router.route(_req(_messages(2)), eps).endpoint is eps[0]
