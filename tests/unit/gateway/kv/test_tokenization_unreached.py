"""Tokenizing only as far as some engine's cache reaches: a segment past the last block any engine
holds is probed (its first characters), not tokenized, and the keys stop there; the probe's ids are
the ones the whole segment starts with; a segment an engine's cache reaches is tokenized whole."""

from __future__ import annotations

import asyncio

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from enginesim.tiny_tokenizer import TINY_DIR
from gateway.endpoints import Endpoint, EndpointPool
from gateway.kv.events import KVEventsManager
from gateway.kv.settings import KVEventsConfig
from gateway.kv.tokenization import ModelTokenizer, chain_keys
from gateway.kv.wire import Batch, BlockStored
from gateway.request import CHAT, parse
from tests.support.kv import text, words

BS = 16
TOK = ModelTokenizer(TINY_DIR)
WORDS = words(5, 500)
SYSTEM = "You are a helpful assistant. " + text(WORDS, 1006, 600)


def _text(seed: int, n: int) -> str:
    return text(WORDS, seed, n)


def _ids(tok, messages):
    return tok.tokenizer.encode(tok.render(messages), add_special_tokens=False).ids


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(WORDS + ["ünï", "🎉", "a,b", "x.", "  ", "\t", "42"]), min_size=40, max_size=300),
       st.integers(1, 40))
def test_a_probe_is_the_start_of_the_whole_segments_ids(words, need):
    tok = TOK                                   # as a new one: no probe kept, no ratio learnt
    tok._probes.clear()
    tok._seen_chars = tok._seen_tokens = 0
    seg = " ".join(words)
    probe = tok._probe(seg, need)
    whole = tok.tokenizer.encode(seg, add_special_tokens=False).ids
    if probe is not None:
        assert probe == whole[:len(probe)]
        assert len(probe) < len(whole)


def test_keys_stop_where_no_cache_reaches_and_the_count_is_estimated():
    tok = ModelTokenizer(TINY_DIR)
    tok.encode(SYSTEM)                          # the ratio of characters to tokens is known
    messages = [{"role": "user", "content": "Unique request: " + _text(1, 1500)}]
    segs, lead = tok.request_segments(CHAT, {"messages": messages})
    ids = _ids(tok, messages)
    exact = chain_keys(7, ids, BS)
    k = tok.block_keys(segs, lead, 7, BS, 1 << 20, reach=lambda key: False)
    assert not k.exact and 0 < len(k.keys) <= 3
    assert k.keys == exact[:len(k.keys)]         # what is keyed is right
    assert abs(k.tokens - len(ids)) < 0.15 * len(ids)
    long = max(segs, key=len)
    assert not tok.is_cached(long) and tok.segments_unreached == 1
    # an engine holds everything: tokenized whole, the same keys as the library's ids give
    k2 = tok.block_keys(segs, lead, 7, BS, 1 << 20, reach=lambda key: True)
    assert k2.exact and k2.keys == exact and k2.tokens == len(ids) and tok.is_cached(long)


def test_the_chain_held_into_the_probe_but_not_past_it():
    tok = ModelTokenizer(TINY_DIR)
    messages = [{"role": "user", "content": _text(2, 800)}]
    segs, lead = tok.request_segments(CHAT, {"messages": messages})
    exact = chain_keys(7, _ids(tok, messages), BS)
    held = set(exact[:1])                       # one block held: the probe's second block is not
    k = tok.block_keys(segs, lead, 7, BS, 1 << 20, reach=held.__contains__)
    assert not k.exact and k.keys[:2] == exact[:2]
    # held through the probe: the whole segment is tokenized
    held = set(exact[:10])
    k = tok.block_keys(segs, lead, 7, BS, 1 << 20, reach=held.__contains__)
    assert k.exact and k.keys == exact


def _manager(registry, **kw):
    tok = ModelTokenizer(TINY_DIR)
    cfg = KVEventsConfig(enabled=True, speculative_ttl_s=0, **kw)
    mgr = KVEventsManager(lambda m: cfg, EndpointPool(), registry, {"m": tok}, tokenize_threads=1)
    eps = [Endpoint(url=f"http://10.0.0.{i}:8000", model="m") for i in (1, 2)]
    for i, ep in enumerate(eps):
        mgr.index.track(ep, cfg)
        mgr.index.apply(mgr.index.states[ep], Batch(0.0, [BlockStored([i + 100], None, [i] * BS, BS)], 0))
    return mgr, tok, eps


async def test_the_match_of_a_prompt_no_engine_holds_tokenizes_a_probe_only():
    registry = CollectorRegistry()
    mgr, tok, eps = _manager(registry)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": _text(3, 50)}]
    req = parse(CHAT, orjson.dumps({"model": "m", "messages": messages}), {}, "r")
    await mgr.prepare(req, eps)
    depths, tokens, fallback = mgr.match(req, eps)
    assert depths == {eps[0]: 0, eps[1]: 0} and not fallback
    n = len(_ids(tok, messages))
    assert abs(tokens - n) < 0.15 * n
    long = max(tok.request_segments(CHAT, {"messages": messages})[0], key=len)
    assert SYSTEM in long and not tok.is_cached(long) and tok.segments_off_loop == 0
    assert registry.get_sample_value("switchyard_kv_events_requests_unreached_total", {"model": "m"}) == 1
    # the engine behind eps[1] prefills it and reports it: the next request tokenizes the system prompt
    # (off the loop) and matches it there
    ids = _ids(tok, messages)
    full = len(ids) // BS
    mgr.index.apply(mgr.index.states[eps[1]],
                    Batch(0.0, [BlockStored(list(range(1, full + 1)), None, ids[:full * BS], BS)], 0))
    req2 = parse(CHAT, orjson.dumps({"model": "m", "messages": messages + [
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": _text(4, 50)}]}), {}, "r2")
    await mgr.prepare(req2, eps)
    depths, tokens, _ = mgr.match(req2, eps)
    assert tok.segments_off_loop == 1 and tok.is_cached(long)
    assert depths[eps[1]] >= (len(tok.encode(tok.render(messages[:1]))) // BS) * BS and depths[eps[0]] == 0
    await mgr.close()


async def test_tokenize_unreached_keys_every_request_whole():
    registry = CollectorRegistry()
    mgr, tok, eps = _manager(registry, tokenize_unreached=True)
    messages = [{"role": "user", "content": _text(5, 1500)}]
    req = parse(CHAT, orjson.dumps({"model": "m", "messages": messages}), {}, "r")
    await mgr.prepare(req, eps)
    _, tokens, _ = mgr.match(req, eps)
    assert tokens == len(_ids(tok, messages)) and tok.segments_off_loop == 1
    assert registry.get_sample_value("switchyard_kv_events_requests_unreached_total", {"model": "m"}) is None
    await mgr.close()


async def test_a_chats_new_message_is_tokenized_after_routing_for_its_next_turn():
    registry = CollectorRegistry()
    mgr, tok, eps = _manager(registry)
    ids = _ids(tok, [{"role": "system", "content": SYSTEM}])
    full = len(ids) // BS - 1
    st = mgr.index.states[eps[0]]
    mgr.index.apply(st, Batch(0.0, [BlockStored(list(range(1, full + 1)), None, ids[:full * BS], BS)], 0))
    question = _text(6, 80)                 # a chat message: past every cache, probed only
    document = _text(7, 1500)               # too long to tokenize on the chance of a next turn
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question + "\n" + document}]
    short = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    for msgs, ahead in ((short, True), (messages, False)):
        req = parse(CHAT, orjson.dumps({"model": "m", "messages": msgs}), {}, "r")
        await mgr.prepare(req, eps)
        depths, _, _ = mgr.match(req, eps)
        assert depths[eps[0]] > 0
        seg = next(s for s in tok.request_segments(CHAT, {"messages": msgs})[0] if msgs[1]["content"] in s)
        assert not tok.is_cached(seg)
        mgr.routed(req, eps[0])
        for task in list(mgr._ahead):
            await task
        assert tok.is_cached(seg) is ahead
    # the next turn's keys are the library's, whether the message came from the cache or not
    turn2 = short + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": _text(8, 20)}]
    req = parse(CHAT, orjson.dumps({"model": "m", "messages": turn2}), {}, "r2")
    segs, lead = tok.request_segments(CHAT, {"messages": turn2})
    assert tok.block_keys(segs, lead, 7, BS, 1 << 20).keys == chain_keys(7, _ids(tok, turn2), BS)
    assert registry.get_sample_value("switchyard_kv_events_tokenized_off_loop_total", {"model": "m"}) >= 1
    await mgr.close()


async def test_tokenizing_ahead_stores_once_and_an_error_or_a_late_result_stores_nothing():
    from concurrent.futures import ThreadPoolExecutor

    tok = ModelTokenizer(TINY_DIR)
    executor = ThreadPoolExecutor(1)
    a, b = _text(20, 40), _text(21, 40)
    fut = tok.ahead([a, b, a], executor)
    assert fut is not None and tok.ahead([a], executor) is None     # under way: not twice
    assert await fut == 2
    assert tok._segment_ids(a) == tok.tokenizer.encode(a, add_special_tokens=False).ids
    assert tok.is_cached(b) and not tok._pending and tok.segments_off_loop == 2
    assert tok.ahead([a, b], executor) is None                       # cached: nothing to do

    def broken(segments):
        raise RuntimeError("encode failed")

    tok._encode_all = broken                                          # an encode error: left uncached
    c = _text(22, 40)
    assert await tok.ahead([c], executor) == 0
    assert not tok.is_cached(c) and not tok._pending
    del tok._encode_all
    fut = tok.ahead([c], executor)                                    # resolved before it lands (closing)
    fut.set_result(0)
    while tok._pending:
        await asyncio.sleep(0.001)
    assert not tok.is_cached(c)
    executor.shutdown()
    assert tok.ahead([c], executor) is not None and not tok._pending  # a shut executor: nothing under way


def test_a_prompt_that_only_opens_as_held_ones_do_is_probed_deeper_not_tokenized_whole():
    """Prompts that share an opening (a form's preamble, "Summarize the following: ...") longer than
    the first probe: the probe is held throughout, so it is taken further once; past the opening no
    engine holds the prompt, and it is not tokenized whole."""
    tok = ModelTokenizer(TINY_DIR)
    tok.encode(SYSTEM)                          # the ratio of characters to tokens is known
    opening = "Summarize the following text. " + _text(9, 15)     # about 50 tokens
    held_prompt = [{"role": "user", "content": opening + " " + _text(10, 600)}]
    held = set(chain_keys(7, _ids(tok, held_prompt), BS))
    messages = [{"role": "user", "content": opening + " " + _text(11, 1500)}]
    segs, lead = tok.request_segments(CHAT, {"messages": messages})
    exact = chain_keys(7, _ids(tok, messages), BS)
    k = tok.block_keys(segs, lead, 7, BS, 1 << 20, reach=held.__contains__)
    assert not k.exact and k.keys == exact[:len(k.keys)]
    assert exact[len(k.keys) - 1] not in held    # the keys stop at the first block past the opening
    assert not tok.is_cached(max(segs, key=len)) and tok.segments_unreached == 1


async def test_a_long_system_prompt_is_tokenized_ahead_the_final_long_message_is_not():
    """A chat's long system prompt no engine holds yet is left untokenized by its first request,
    and tokenized in the thread after routing, so the next chat on it (once an engine holds it)
    is keyed with no wait for the thread; the long final message is not tokenized ahead."""
    registry = CollectorRegistry()
    mgr, tok, eps = _manager(registry)
    document = _text(12, 1500)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": document}]
    req = parse(CHAT, orjson.dumps({"model": "m", "messages": messages}), {}, "r")
    await mgr.prepare(req, eps)
    mgr.match(req, eps)
    segs = tok.request_segments(CHAT, {"messages": messages})[0]
    system = next(s for s in segs if SYSTEM in s)
    doc = next(s for s in segs if document in s)
    assert len(system) > 2048 and not tok.is_cached(system) and not tok.is_cached(doc)
    mgr.routed(req, eps[0])
    for task in list(mgr._ahead):
        await task
    assert tok.is_cached(system) and not tok.is_cached(doc)
    assert tok._segment_ids(system) == tok.tokenizer.encode(system, add_special_tokens=False).ids
    # an engine prefills it and reports it: the next chat on the system prompt hops to no thread
    ids = _ids(tok, messages[:1])
    full = len(ids) // BS
    mgr.index.apply(mgr.index.states[eps[1]],
                    Batch(0.0, [BlockStored(list(range(1, full + 1)), None, ids[:full * BS], BS)], 0))
    before = tok.segments_off_loop
    req2 = parse(CHAT, orjson.dumps({"model": "m", "messages": [messages[0], {"role": "user", "content": "hi"}]}),
                 {}, "r2")
    await mgr.prepare(req2, eps)
    depths, _, _ = mgr.match(req2, eps)
    assert tok.segments_off_loop == before and depths[eps[1]] > depths[eps[0]]
    await mgr.close()
