"""Tokenizing before routing, in a thread: the cache filled with the library's ids, short segments
along with long ones, left inline when nothing long is new."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest
from prometheus_client import CollectorRegistry

from enginesim.tiny_tokenizer import TINY_DIR
from gateway.endpoints import Endpoint, EndpointPool
from gateway.kv.events import KVEventsManager
from gateway.kv.settings import KVEventsConfig
from gateway.kv.tokenization import INLINE_CHARS, ModelTokenizer, chain_keys
from gateway.request import CHAT, parse

SYSTEM = "You are number 4. " + "kqz lo abc the of " * 100


def _messages(turn: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"turn {turn} ok"}]


@pytest.fixture
def pool():
    with ThreadPoolExecutor(1) as ex:
        yield ex


def _plain(tok, segs):
    """The segments that are not special tokens, once each."""
    return list(dict.fromkeys(s for s in segs if s not in tok._special_ids))


async def test_prepare_fills_the_cache_with_the_librarys_ids_short_segments_riding_along(pool):
    tok = ModelTokenizer(TINY_DIR)
    segs, lead = tok.request_segments(CHAT, {"messages": _messages(0)})
    assert any(len(s) >= INLINE_CHARS for s in segs) and any(len(s) < INLINE_CHARS and s not in tok._special_ids for s in segs)
    assert await tok.prepare(segs, pool) == len(_plain(tok, segs))     # a long one: the short ones go along
    for s in _plain(tok, segs):               # all cached with the library's ids
        assert tok._segments[s] == tok.tokenizer.encode(s, add_special_tokens=False).ids
    misses = tok.segment_misses
    k = tok.block_keys(segs, lead, 3, 16, 10_000)
    text = tok.render(_messages(0))
    ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
    assert k.keys == chain_keys(3, ids, 16) and k.tokens == len(ids)
    assert tok.segment_misses == misses                                 # nothing left for the loop
    # the next turn: the system prompt is cached, nothing long is new, so no executor hop, and the
    # new short segment stays for the loop
    segs2, _ = tok.request_segments(CHAT, {"messages": _messages(1)})
    new = [s for s in _plain(tok, segs2) if s not in tok._segments]
    assert new and all(len(s) < INLINE_CHARS for s in new)
    assert await tok.prepare(segs2, pool) == 0
    assert all(s not in tok._segments for s in new)
    assert await tok.prepare(segs2, None) == 0 and await tok.prepare(None, pool) == 0


async def test_concurrent_prepares_tokenize_a_segment_once(pool):
    tok = ModelTokenizer(TINY_DIR)
    segs, _ = tok.request_segments(CHAT, {"messages": _messages(0)})
    counts = await asyncio.gather(tok.prepare(segs, pool), tok.prepare(segs, pool))
    n = len(_plain(tok, segs))
    assert sorted(counts) == [0, n] and tok.segments_off_loop == n and not tok._pending
    assert all(s in tok._segments for s in _plain(tok, segs))


async def test_an_encode_error_leaves_the_segment_to_the_inline_path(pool, monkeypatch):
    tok = ModelTokenizer(TINY_DIR)
    segs, _ = tok.request_segments(CHAT, {"messages": _messages(0)})

    def boom(_segments):
        raise RuntimeError("no")

    monkeypatch.setattr(tok, "_encode_all", boom)
    assert await tok.prepare(segs, pool) == 0
    assert not tok._segments and not tok._pending


def _live(mgr, ep, tok, ids, bs=16):
    """``ep`` live in ``mgr``'s index, its engine holding ``ids``' full blocks."""
    from gateway.kv.wire import Batch, BlockStored
    st = mgr.index.track(ep, mgr.settings(ep.model))
    n = len(ids) // bs
    mgr.index.apply(st, Batch(0.0, [BlockStored(list(range(1, n + 1)), None, ids[:n * bs], bs)], 0))
    return st


async def test_manager_prepares_once_rendered_and_counts_off_loop_segments():
    registry = CollectorRegistry()
    tok = ModelTokenizer(TINY_DIR)
    cfg = KVEventsConfig(enabled=True)
    mgr = KVEventsManager(lambda m: cfg, EndpointPool(), registry, {"m": tok}, tokenize_threads=1)
    ep = Endpoint(url="http://a:1", model="m")
    # the engine holds the conversation's system prompt (the gateway never tokenized it): the long
    # segment is reached, so it is tokenized, in the thread
    text = tok.render(_messages(0))
    _live(mgr, ep, tok, tok.tokenizer.encode(text, add_special_tokens=False).ids)
    tok._segments.clear()
    tok._prefixes.clear()
    req = parse(CHAT, orjson.dumps({"model": "m", "messages": _messages(0)}), {}, "r")
    await mgr.prepare(req, [ep])
    segs, _ = tok.request_segments(CHAT, {"messages": _messages(0)})
    long = [s for s in _plain(tok, segs) if len(s) >= INLINE_CHARS]
    assert long and registry.get_sample_value("switchyard_kv_events_tokenized_off_loop_total", {"model": "m"}) == \
        len(long)
    assert mgr.index._rendered[0] is req          # the match reuses the rendering
    assert mgr.index._memo[0] is req              # and the keys
    await mgr.close()
    off = KVEventsManager(lambda m: cfg, EndpointPool(), CollectorRegistry(), {"m": ModelTokenizer(TINY_DIR)},
                          tokenize_threads=0)
    await off.prepare(req, [ep])
    assert off.executor is None and not off.tokenizers["m"]._segments


def test_tokenize_settings_are_validated():
    import msgspec
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"tokenize_threads": -1}, KVEventsConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"tokenize_inline_chars": -5}, KVEventsConfig)
    assert KVEventsConfig().tokenize_threads == 1 and KVEventsConfig().tokenize_inline_chars == INLINE_CHARS == 1024


def test_the_thread_encodes_with_a_batch_call_and_gets_the_same_ids():
    tok = ModelTokenizer(TINY_DIR)
    segs = [SYSTEM, "user\nturn 1 ok", "ünï 🎉 text", "\n"]
    calls = []
    batch = tok._encode_batch
    # the batch calls are the ones that let go of the GIL while they encode (encode_batch_fast:
    # ids without character offsets, where the library has it)
    assert batch.__name__ in ("encode_batch_fast", "encode_batch")

    def spy(*a, **kw):
        calls.append(a)
        return batch(*a, **kw)

    tok._encode_batch = spy
    out = tok._encode_all(segs)
    assert [len(batch) for batch, in calls] == [1, 1, 1, 1]      # one a call: not over the library's threads
    assert out == [tok.tokenizer.encode(s, add_special_tokens=False).ids for s in segs]
    assert [tok._segment_ids(s) for s in segs] == out and len(calls) == 8       # inline too
