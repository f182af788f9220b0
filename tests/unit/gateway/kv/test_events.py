"""KV events without sockets: both wire encodings, the event index, the cached tokenization."""

from __future__ import annotations

import msgspec
import pytest

from enginesim.hf_tokenizer import HFTokenizer
from enginesim.tiny_tokenizer import TINY_DIR
from gateway.endpoints import Endpoint
from gateway.kv.index import EventIndex, root_key
from gateway.kv.settings import KVEventsConfig
from gateway.kv.tokenization import ModelTokenizer, chain_keys
from gateway.kv.wire import AllBlocksCleared, Batch, BlockRemoved, BlockStored, WireError, decode_batch
from gateway.request import CHAT, parse

enc = msgspec.msgpack.encode


def test_decodes_positional_arrays():
    payload = enc([1.5, [["BlockStored", [11, 12], None, list(range(32)), 16, None, "GPU", "ad1"],
                         ["BlockRemoved", [11], "GPU"], ["AllBlocksCleared"], ["SomethingNew", 1]], 0])
    b = decode_batch(payload)
    assert b.ts == 1.5 and b.dp_rank == 0 and b.unknown == 1
    assert b.events[0] == BlockStored([11, 12], None, list(range(32)), 16, "ad1", "GPU", None)
    assert b.events[1] == BlockRemoved([11], "GPU", None)
    assert isinstance(b.events[2], AllBlocksCleared)


def test_decodes_maps_tagged_by_type():
    payload = enc({"ts": 2.0, "data_parallel_rank": 0, "events": [
        {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": 7, "token_ids": [1] * 16,
         "block_size": 16, "lora_id": None, "medium": "CPU", "lora_name": None, "group_idx": 0},
        {"type": "BlockRemoved", "block_hashes": [5], "medium": None},
        {"type": "AllBlocksCleared"}]})
    b = decode_batch(payload)
    assert b.events[0] == BlockStored([b"\x01" * 32], 7, [1] * 16, 16, None, "CPU", 0)
    assert b.events[1] == BlockRemoved([5], None, None)
    assert isinstance(b.events[2], AllBlocksCleared)


def test_lora_id_names_the_adapter_when_there_is_no_lora_name():
    b = decode_batch(enc([0, [["BlockStored", [1], None, [0] * 16, 16, 3, "GPU"]], 0]))
    assert b.events[0].lora_name == "3"


@pytest.mark.parametrize("payload", [b"\xc1", enc(5), enc([1.0, 5]), enc([1.0, [7]]),
                                     enc({"events": [{"type": "BlockStored"}]})])
def test_rejects_what_is_not_a_batch(payload):
    with pytest.raises(WireError):
        decode_batch(payload)


def _index():
    tok = ModelTokenizer(TINY_DIR)
    s = KVEventsConfig(enabled=True, speculative_ttl_s=0)
    idx = EventIndex({"m": tok}, lambda m: s)
    eps = [Endpoint(url=f"http://10.0.0.{i}:8000", model="m") for i in range(3)]
    return tok, idx, eps, [idx.track(ep, s) for ep in eps]


def _req(text: str):
    import orjson
    return parse(CHAT, orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}), {}, "r")


def test_index_matches_what_each_engine_stored_and_resolves_removals():
    tok, idx, eps, states = _index()
    req = _req("hello there " * 40)
    ids = tok.encode(tok.render([{"role": "user", "content": "hello there " * 40}]))
    n = len(ids) // 16
    # engine 0 holds everything (stored in two events chained by parent), engine 1 the first half
    idx.apply(states[0], Batch(0, [BlockStored(list(range(100, 103)), None, ids[:48], 16)], 0))
    idx.apply(states[0], Batch(0, [BlockStored(list(range(103, 100 + n)), 102, ids[48:n * 16], 16)], 0))
    idx.apply(states[1], Batch(0, [BlockStored(list(range(200, 200 + n // 2)), None, ids[:n // 2 * 16], 16)], 0))
    idx.apply(states[2], Batch(0, [BlockStored([300], None, [9] * 16, 16)], 0))     # something else
    depths, tokens, fallback = idx.match(req, eps)
    assert tokens == len(ids) and not fallback
    cap = (len(ids) - 1) // 16 * 16
    assert depths == {eps[0]: min(n * 16, cap), eps[1]: n // 2 * 16, eps[2]: 0}
    idx.apply(states[0], Batch(0, [BlockRemoved([102], "GPU")], 0))     # an engine hash resolves
    assert idx.match(req, eps)[0][eps[0]] == 32
    idx.apply(states[1], Batch(0, [AllBlocksCleared()], 0))
    assert idx.match(req, eps)[0][eps[1]] == 0
    assert idx.blocks() == n - 1 + 1


def test_orphans_lora_keys_and_bounded_memory():
    tok, idx, eps, states = _index()
    idx.apply(states[0], Batch(0, [BlockStored([1], 999, [1] * 16, 16)], 0))    # parent never seen
    assert idx.orphans == 1 and idx.blocks() == 0
    ids = list(range(64))
    idx.apply(states[0], Batch(0, [BlockStored([1, 2, 3, 4], None, ids, 16, lora_name="a")], 0))
    assert set(states[0].owned) == set(chain_keys(root_key("m", "a", 16), ids, 16))
    assert not set(states[0].owned) & set(chain_keys(root_key("m", None, 16), ids, 16))
    small = KVEventsConfig(enabled=True, max_blocks_per_endpoint=2)
    st = idx.track(Endpoint(url="http://10.0.0.9:8000", model="m"), small)
    idx.apply(st, Batch(0, [BlockStored([1, 2, 3, 4], None, ids, 16)], 0))
    assert len(st.emap) == 2


def test_stall_and_no_events_fall_back():
    tok, idx, eps, states = _index()
    now = [0.0]
    idx.clock = lambda: now[0]
    calls = []
    idx._on_fallback = lambda m, e, r: calls.append(r)
    req = _req("a b c " * 100)
    assert idx.match(req, eps)[2] == eps                  # nothing heard yet
    for st in states:
        idx.apply(st, Batch(0, [BlockStored([1], None, [0] * 16, 16)], 0))
    idx.match(req, eps)
    idx.routed(req, eps[0])                               # needs new blocks: events expected
    now[0] = 11.0
    assert idx.match(req, eps)[2] == [eps[0]]
    assert calls.count("stalled") == 1 and "no_events" in calls
    idx.apply(states[0], Batch(0, [], 0))
    assert idx.match(req, eps)[2] == []


def test_cached_tokenization_equals_the_library_and_the_simulator():
    tok = ModelTokenizer(TINY_DIR, token_cache_chars=10_000)
    sim = HFTokenizer(TINY_DIR)
    system = "You are number 7. " + "kqz lo abc the of " * 200
    for turn in range(3):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"turn {turn} ok"},
                    {"role": "assistant", "content": [{"type": "text", "text": "fine"}]}]
        text = tok.render(messages)
        assert tok.encode(text) == tok.tokenizer.encode(text, add_special_tokens=False).ids == \
            sim.encode_chat(messages)
    assert tok.segment_hits > 0
    segs, lead = tok.request_segments(CHAT, {"messages": messages})
    k = tok.block_keys(segs, lead, 5, 16, 10_000)
    assert k.keys == chain_keys(5, tok.encode(text), 16) and k.tokens == len(tok.encode(text))
    assert tok.block_keys(segs, lead, 5, 16, 10_000).keys == k.keys        # from the prefix cache


def test_template_is_sandboxed():
    tok = ModelTokenizer(TINY_DIR)
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    assert isinstance(tok._template.environment, ImmutableSandboxedEnvironment)


def test_shipped_tokenizer_is_what_the_builder_makes(tmp_path):
    from enginesim.tiny_tokenizer import build
    out = build(tmp_path / "t")
    assert (out / "tokenizer.json").read_bytes() == (TINY_DIR / "tokenizer.json").read_bytes()
    assert (out / "tokenizer_config.json").read_text() == (TINY_DIR / "tokenizer_config.json").read_text()


def test_block_keys_of_branching_conversations_share_cached_prefixes_correctly():
    # two continuations of one cached prefix, taken in turns, each keyed from scratch elsewhere
    tok = ModelTokenizer(TINY_DIR)
    fresh = ModelTokenizer(TINY_DIR)
    base = [{"role": "system", "content": "You are number 3. " + "kqz lo abc the of " * 60}]
    results = []
    for turn in range(4):
        for branch in ("a", "b"):
            messages = [*base, {"role": "user", "content": f"branch {branch} " + "lo kqz " * (10 * turn + 3)}]
            segs, lead = tok.request_segments(CHAT, {"messages": messages})
            k = tok.block_keys(segs, lead, 9, 16, 10_000)
            results.append(k)
            ids = fresh.tokenizer.encode(fresh.render(messages), add_special_tokens=False).ids
            assert k.keys == chain_keys(9, ids, 16) and k.tokens == len(ids), (turn, branch)
    assert results[0].keys == tok.block_keys(*tok.request_segments(CHAT, {"messages": [
        *base, {"role": "user", "content": "branch a " + "lo kqz " * 3}]}), 9, 16, 10_000).keys


def _naive_depths(idx, keys, tokens, eps):
    bs = 16
    cap = min(len(keys), max(0, tokens - 1) // bs)
    out = {}
    for ep in eps:
        bit = idx.states[ep].bit
        d = 0
        while d < cap and (idx._holders.get(keys[d], 0) | idx._pending.get(keys[d], 0)) & bit:
            d += 1
        out[ep] = d * bs
    return out


def test_the_chunked_walk_equals_a_key_by_key_walk():
    import random

    from gateway.kv import index as kv_index

    rng = random.Random(11)
    tok = ModelTokenizer(TINY_DIR)
    s = KVEventsConfig(enabled=True, speculative_ttl_s=0)
    idx = EventIndex({"m": tok}, lambda m: s)
    eps = [Endpoint(url=f"http://10.0.0.{i}:8000", model="m") for i in range(6)]
    states = [idx.track(ep, s) for ep in eps]
    old_chunk = kv_index._WALK_CHUNK
    kv_index._WALK_CHUNK = 7                       # many chunk boundaries
    try:
        for trial in range(60):
            n = rng.randrange(1, 60)
            keys = [rng.randrange(1 << 40) for _ in range(n)]
            idx._holders.clear()
            idx._pending.clear()
            for st in states:
                st.block_size = 16
                depth = rng.randrange(n + 1)
                for k in keys[:depth]:
                    idx._holders[k] = idx._holders.get(k, 0) | st.bit
                for k in rng.sample(keys, rng.randrange(n // 2 + 1)):          # holes and extras
                    target = idx._pending if rng.random() < 0.5 else idx._holders
                    target[k] = target.get(k, 0) | st.bit
                for k in rng.sample(keys, rng.randrange(3)):                      # evicted mid-chain
                    idx._holders[k] = idx._holders.get(k, 0) & ~st.bit
            tokens = 16 * n + rng.randrange(3)
            walked = idx._walk(keys, tokens, states)
            assert walked == _naive_depths(idx, keys, tokens, eps), trial
    finally:
        kv_index._WALK_CHUNK = old_chunk


def test_routed_holds_the_new_blocks_after_the_walked_depth():
    tok, idx, eps, states = _index()
    idx.settings = lambda m: KVEventsConfig(enabled=True, speculative_ttl_s=5)
    text = "a b c " * 100
    req = _req(text)
    ids = tok.encode(tok.render([{"role": "user", "content": text}]))
    held = 4
    for st in states:
        idx.apply(st, Batch(0, [BlockStored(list(range(held)), None, ids[:held * 16], 16)], 0))
    for st in states:
        st.settings = KVEventsConfig(enabled=True, speculative_ttl_s=5)
    exact, tokens, _ = idx.match(req, eps)
    assert exact[eps[1]] == held * 16
    idx.routed(req, eps[1])
    again = _req(text)
    exact2, _, _ = idx.match(again, eps)
    assert exact2[eps[1]] == 16 * ((tokens - 1) // 16) and exact2[eps[0]] == held * 16


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_a_salted_request_keys_as_the_simulated_vllm_publishes_its_blocks(encoding):
    """enginesim's pool and publisher (vLLM's encoding, ``extra_keys`` per block) → the wire decoder →
    the index; a request's match comes from its own keys (``request_root``): the salted request finds
    exactly its salt's blocks, an unsalted or otherwise salted one finds none of them."""
    import orjson

    from enginesim.kv_events import KVEventPublisher
    from enginesim.kvcache import BlockPool
    from enginesim.kvcache import root_key as sim_root
    from gateway.kv.wire import BatchDecoder
    from gateway.request import COMPLETIONS

    tok, idx, eps, states = _index()
    pub = KVEventPublisher("127.0.0.1", 0, -1, "", encoding)
    try:
        pool = BlockPool(64, 16)
        pool.events, pool.extra_keys = pub, True
        ids = list(range(100, 180))                              # 5 full blocks
        stored = [("t1", None, states[0]), (None, None, states[1]), ("t1", "ad", states[2])]
        for salt, lora, _ in stored:
            alloc = pool.allocate(pool.block_hashes(ids, sim_root(f"m\0{lora or ''}", salt or "")), len(ids))
            alloc.token_ids, alloc.lora_name, alloc.cache_salt = ids, lora, salt
            pool.commit(alloc)
        decoder = BatchDecoder()
        for (_, payload), (_, _, st) in zip(pub.buffer, stored, strict=True):
            idx.apply(st, decoder.decode(payload))
    finally:
        pub.close_sockets()

    def match(model="m", **extra):
        body = {"model": model, "prompt": ids + [1, 2], **extra}
        return idx.match(parse(COMPLETIONS, orjson.dumps(body), {}, "r"), eps)[0]

    full = 5 * 16
    assert match(cache_salt="t1") == {eps[0]: full, eps[1]: 0, eps[2]: 0}
    assert match() == {eps[0]: 0, eps[1]: full, eps[2]: 0}
    assert match(cache_salt="t2") == {eps[0]: 0, eps[1]: 0, eps[2]: 0}
    assert match(cache_salt="") == {eps[0]: 0, eps[1]: full, eps[2]: 0}     # the engine refuses it anyway
    assert match("ad", cache_salt="t1") == {eps[0]: 0, eps[1]: 0, eps[2]: full}


def test_a_salted_request_keys_as_the_simulated_sglang_publishes_its_blocks():
    """SGLang names the storing request's ``cache_salt`` on its events (no per-block extras): a
    salted request finds exactly its salt's blocks, an unsalted one none of them, and the reverse."""
    import orjson

    from enginesim.kv_events import KVEventPublisher
    from enginesim.kvcache import BlockPool
    from enginesim.kvcache import root_key as sim_root
    from gateway.kv.wire import BatchDecoder
    from gateway.request import COMPLETIONS

    tok, idx, eps, states = _index()
    pub = KVEventPublisher("127.0.0.1", 0, -1, "", "map")
    try:
        pool = BlockPool(64, 16)
        pool.events = pub                                        # extra_keys off: SGLang's events
        ids = list(range(100, 180))
        stored = [("t1", states[0]), (None, states[1])]
        for salt, _ in stored:
            alloc = pool.allocate(pool.block_hashes(ids, sim_root("m\0", salt or "")), len(ids))
            alloc.token_ids, alloc.lora_name, alloc.cache_salt = ids, None, salt
            pool.commit(alloc)
        decoder = BatchDecoder()
        for (_, payload), (_, st) in zip(pub.buffer, stored, strict=True):
            idx.apply(st, decoder.decode(payload))
    finally:
        pub.close_sockets()

    def match(**extra):
        body = {"model": "m", "prompt": ids + [1, 2], **extra}
        got = idx.match(parse(COMPLETIONS, orjson.dumps(body), {}, "r"), eps[:2])[0]
        return [got.get(ep, 0) for ep in eps[:2]]

    full = 5 * 16
    assert match(cache_salt="t1") == [full, 0]
    assert match() == [0, full]
    assert match(cache_salt="t2") == [0, 0]


def test_a_multimodal_request_is_not_keyed_and_counts_the_fallback():
    import orjson

    tok, idx, eps, states = _index()
    calls = []
    idx._on_fallback = lambda m, e, r: calls.append(r)
    for st in states:
        idx.apply(st, Batch(0, [BlockStored([1], None, [0] * 16, 16)], 0))
    parts = [{"type": "text", "text": "what is this? " * 20},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    req = parse(CHAT, orjson.dumps({"model": "m", "messages": [{"role": "user", "content": parts}]}), {}, "r")
    assert req.multimodal and idx.match(req, eps) is None and calls == ["multimodal"]
    text_only = parse(CHAT, orjson.dumps({"model": "m", "messages": [{"role": "user", "content": parts[:1]}]}),
                      {}, "r")
    assert not text_only.multimodal and idx.match(text_only, eps) is not None and calls == ["multimodal"]


class _WalkCountingDict(dict):
    """A dict that counts the walks started over its keys (each one passes the deleted slots at its
    head again, until the dict is resized)."""

    walks = 0

    def __iter__(self):
        self.walks += 1
        return super().__iter__()


def test_an_endpoint_over_its_block_bound_drops_its_oldest_in_one_walk():
    tok, idx, eps, states = _index()
    small = KVEventsConfig(enabled=True, max_blocks_per_endpoint=100)
    st = idx.track(Endpoint(url="http://10.0.0.9:8000", model="m"), small)
    st.emap = _WalkCountingDict()
    idx.apply(st, Batch(0, [BlockStored(list(range(1, 401)), None, list(range(400 * 16)), 16)], 0))
    # the 300 oldest dropped, the 100 newest kept; one walk over the entries, not one per block dropped
    assert list(st.emap) == list(range(301, 401))
    assert len(st.owned) == 100 and idx.blocks() == 100
    assert st.emap.walks == 2          # the eviction's, and the list() above
    idx.apply(st, Batch(0, [BlockStored(list(range(401, 451)), 400, list(range(50 * 16)), 16)], 0))
    assert list(st.emap) == list(range(351, 451)) and st.emap.walks == 4
