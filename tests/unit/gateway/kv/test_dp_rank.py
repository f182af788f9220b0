"""The per-rank side of the event index (which ranks of a data-parallel engine hold each key, the
match depth per rank) and the rank choice (deepest match, then fewest in flight, then lowest index)."""

from __future__ import annotations

from functools import partial

import msgspec

from enginesim.tiny_tokenizer import TINY_DIR
from gateway.endpoints import Endpoint
from gateway.kv.dp_rank import choose
from gateway.kv.index import EventIndex
from gateway.kv.settings import KVEventsConfig
from gateway.kv.tokenization import ModelTokenizer
from gateway.kv.wire import decode_batch
from gateway.pipeline.ledger import Charges, RankInFlight
from gateway.request import parse
from tests.support.factories import block_stored

enc = msgspec.msgpack.encode
TOK = ModelTokenizer(TINY_DIR)


_stored = partial(block_stored, lora_id=None, medium="GPU", lora_name=None, block_size=4)


def _index(**kw):
    s = KVEventsConfig(enabled=True, speculative_ttl_s=0, data_parallel_size=3, **kw)
    idx = EventIndex({"m": TOK}, lambda m: s)
    ep = Endpoint(url="http://10.0.0.1:8000", model="m")
    return idx, idx.track(ep, s), ep


def _feed(idx, st, rank, *events):
    idx.apply(st, decode_batch(enc({"ts": 0, "events": list(events), "data_parallel_rank": rank}), rank), rank)


def _request(text: str):
    return parse("/v1/completions", msgspec.json.encode({"model": "m", "prompt": text}), {}, "r1")


def test_only_ranked_endpoints_keep_rank_masks():
    idx, st, ep = _index()
    assert st.rank_keys == {} and st.ranks == 3 and st.rank_in_flight == [0, 0, 0] and idx.ranked == {ep: st}
    _, off, _ = _index(route_ranks=False)
    assert off.rank_keys is None
    one = EventIndex({}, lambda m: None).track(Endpoint(url="http://10.0.0.2:8000", model="m"), KVEventsConfig())
    assert one.rank_keys is None


def test_store_remove_and_clear_per_rank():
    idx, st, ep = _index()
    toks = list(range(12))
    _feed(idx, st, 0, _stored([1, 2, 3], None, toks))
    _feed(idx, st, 2, _stored([1, 2], None, toks[:8]))           # rank 2 holds the first two blocks too
    k1, k2, k3 = st.emap[1], st.emap[2], st.emap[3]
    assert st.rank_keys == {k1: 0b101, k2: 0b101, k3: 0b001}
    _feed(idx, st, 0, {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"})
    assert st.rank_keys == {k1: 0b101, k2: 0b101}
    _feed(idx, st, 2, {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"})
    assert st.rank_keys == {k1: 0b101, k2: 0b001}
    idx.clear_rank(st, 0)                                         # rank 0's gap or restart
    assert st.rank_keys == {k1: 0b100}
    _feed(idx, st, 1, _stored([1], None, toks[:4]))
    assert st.rank_keys == {k1: 0b110}
    _feed(idx, st, 1, {"type": "AllBlocksCleared"})
    assert st.rank_keys == {k1: 0b100}
    idx.forget(ep)
    assert st.rank_keys == {} and idx.ranked == {}


def test_rank_masks_stay_bounded_with_the_endpoint():
    idx, st, ep = _index(max_blocks_per_endpoint=4)
    _feed(idx, st, 1, _stored(list(range(1, 7)), None, list(range(24))))
    assert len(st.emap) == 4 and set(st.rank_keys) == set(st.owned)


def test_depths_per_rank_from_the_request_keys():
    idx, st, ep = _index()
    text = "the quick brown fox jumps over the lazy dog " * 6
    req = _request(text)
    keyed = idx._keys(req, "m", 4)
    assert keyed is not None
    keys, tokens = keyed
    assert len(keys) >= 6
    # index the request's own blocks as stored events: rank 1 holds 5 blocks, rank 0 holds 2, rank 2 none
    for rank, n in ((1, 5), (0, 2)):
        for i in range(n):
            st.emap[(rank, 100 + i) if rank else 100 + i] = keys[i]
            st.media[(rank, 100 + i) if rank else 100 + i] = 1
            st.owned[keys[i]] = st.owned.get(keys[i], 0) + 1
            st.rank_keys[keys[i]] = st.rank_keys.get(keys[i], 0) | (1 << rank)
    st.block_size, st.on_fallback = 4, None
    assert idx.rank_depths(req, ep) == [8, 20, 0]
    assert idx.rank_depths(_request("another prompt"), ep) is None      # not the keyed request
    st.on_fallback = "stalled"
    assert idx.rank_depths(req, ep) is None


def test_choose_deepest_then_least_loaded_then_lowest():
    assert choose([8, 20, 0], [0, 5, 0]) == (1, "match")
    assert choose([8, 8, 0], [3, 1, 0]) == (1, "match")
    assert choose([8, 8, 0], [1, 1, 0]) == (0, "match")
    assert choose([0, 0, 0], [2, 1, 1]) == (1, "load")
    assert choose([0, 0], [0, 0]) == (0, "load")


def test_the_rank_charge_is_released_once():
    counts = [0, 0]
    ep = Endpoint(url="http://10.0.0.1:8000", model="m")
    charges = Charges(rank=RankInFlight(ep, counts, 1))
    assert counts == [0, 1]
    charges.release()
    charges.release()
    assert counts == [0, 0]


def test_a_pinned_requests_new_blocks_count_on_its_rank_until_they_expire():
    now = [100.0]
    s = KVEventsConfig(enabled=True, speculative_ttl_s=5, data_parallel_size=3)
    idx = EventIndex({"m": TOK}, lambda m: s, clock=lambda: now[0])
    ep = Endpoint(url="http://10.0.0.1:8000", model="m")
    st = idx.track(ep, s)
    st.block_size, st.on_fallback = 4, None
    req = _request("the quick brown fox jumps over the lazy dog " * 6)
    keys, _tokens = idx._keys(req, "m", 4)
    assert idx.rank_depths(req, ep) == [0, 0, 0]
    idx.rank_routed(req, ep, 2, 0)
    again = _request("the quick brown fox jumps over the lazy dog " * 6)
    idx._keys(again, "m", 4)
    depths = idx.rank_depths(again, ep)
    assert depths[0] == depths[1] == 0 and depths[2] >= 4 * (len(keys) - 1)
    assert choose(depths, [0, 0, 5]) == (2, "match")       # the burst follows rank 2, busier or not
    now[0] += 5.0                                          # the speculation expired
    assert idx.rank_depths(again, ep) == [0, 0, 0]
    assert not st.rank_pending and not st.rank_pending_q
    idx.rank_routed(again, ep, 1, 0)
    idx.clear(st)
    assert not st.rank_pending and not st.rank_pending_q


def test_a_rank_cleared_keeps_none_of_its_speculative_holds_and_the_others_keep_theirs():
    """A rank's gap, restart or cache reset clears what it holds: the blocks this gateway held for
    it speculatively go too, as a whole endpoint's clear drops its holds; another rank's stay."""
    now = [100.0]
    s = KVEventsConfig(enabled=True, speculative_ttl_s=5, data_parallel_size=3)
    idx = EventIndex({"m": TOK}, lambda m: s, clock=lambda: now[0])
    ep = Endpoint(url="http://10.0.0.1:8000", model="m")
    st = idx.track(ep, s)
    st.block_size, st.on_fallback = 4, None
    text = "the quick brown fox jumps over the lazy dog " * 6
    req = _request(text)
    keys, _tokens = idx._keys(req, "m", 4)
    idx.rank_routed(req, ep, 1, 0)
    idx.rank_routed(req, ep, 2, 0)
    again = _request(text)
    idx._keys(again, "m", 4)
    before = idx.rank_depths(again, ep)
    assert before[0] == 0 and before[1] == before[2] > 0
    idx.clear_rank(st, 1)
    after = idx.rank_depths(again, ep)
    assert after == [0, 0, before[2]]
    now[0] += 5.0                                          # the rest expires as before
    assert idx.rank_depths(again, ep) == [0, 0, 0]
    assert not st.rank_pending and not st.rank_pending_q
