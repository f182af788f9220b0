"""vLLM's newer event fields, decoded in both encodings: data-parallel ranks, ``extra_keys`` and the
hybrid-model fields; and what a rank means for the event index (one endpoint, several ranks)."""

from __future__ import annotations

import msgspec
import pytest

from enginesim.tiny_tokenizer import TINY_DIR
from gateway.endpoints import Endpoint
from gateway.kv.index import EventIndex
from gateway.kv.settings import KVEventsConfig
from gateway.kv.tokenization import ModelTokenizer
from gateway.kv.wire import BlockRemoved, BlockStored, WireError, decode_batch
from tests.support.factories import block_stored, block_stored_array

enc = msgspec.msgpack.encode
SALT = [["cache_salt", "tenant-a"], None]                   # block 0 salted, block 1 not
MM = [[b"\x9f" * 32, 0], None]                              # an image hash and its offset


def stored_array(hashes, parent, tokens, extra=None, rank_fields=True):
    rank = (1, "sliding_window", 4096) if rank_fields else ()   # group_idx, kv_cache_spec_kind, sliding window
    return block_stored_array(hashes, parent, tokens, None, "GPU", None, extra, *rank)


def stored_map(hashes, parent, tokens, extra=None):
    return block_stored(hashes, parent, tokens, lora_id=None, medium="GPU", lora_name=None, extra_keys=extra,
                        group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=4096)


@pytest.mark.parametrize("extra", [SALT, MM, None])
@pytest.mark.parametrize("encoding", ["array", "map"])
def test_extra_keys_and_hybrid_fields_decode_in_both_encodings(encoding, extra):
    tokens = list(range(32))
    ev = stored_array([11, 12], None, tokens, extra) if encoding == "array" else stored_map([11, 12], None, tokens, extra)
    batch = [0.5, [ev], None] if encoding == "array" else {"ts": 0.5, "events": [ev]}
    (b,) = decode_batch(enc(batch)).events
    assert b == BlockStored([11, 12], None, tokens, 16, None, "GPU", 1, extra)


def test_short_arrays_of_older_engines_still_decode():
    (b,) = decode_batch(enc([0, [stored_array([1], None, [0] * 16, rank_fields=False)[:7]]])).events
    assert b.extra_keys is None and b.group_idx is None


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_bad_extra_keys_and_ranks_are_wire_errors(encoding):
    ev = stored_array([1], None, [0] * 16, extra=5) if encoding == "array" else stored_map([1], None, [0] * 16, 5)
    with pytest.raises(WireError, match="extra_keys"):
        decode_batch(enc([0, [ev], 0]))
    for rank in (-1, "0", 1.5, True):
        batch = [0, [], rank] if encoding == "array" else {"ts": 0, "events": [], "data_parallel_rank": rank}
        with pytest.raises(WireError, match="data_parallel_rank"):
            decode_batch(enc(batch))


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_a_rank_above_zero_qualifies_its_hashes(encoding):
    tokens = list(range(16))
    removed = ["BlockRemoved", [22], "GPU", 0] if encoding == "array" else {
        "type": "BlockRemoved", "block_hashes": [22], "medium": "GPU", "group_idx": 0}
    for rank, key in ((None, lambda h: h), (0, lambda h: h), (3, lambda h: (3, h))):
        ev = stored_array([22], 21, tokens) if encoding == "array" else stored_map([22], 21, tokens)
        batch = [1.0, [ev, removed], rank] if encoding == "array" else {
            "ts": 1.0, "events": [ev, removed], "data_parallel_rank": rank}
        b = decode_batch(enc(batch))
        assert b.dp_rank == rank
        assert b.events[0].block_hashes == [key(22)] and b.events[0].parent_block_hash == key(21)
        assert b.events[1] == BlockRemoved([key(22)], "GPU", 0)


def test_one_endpoint_with_two_ranks_holds_a_block_until_both_drop_it():
    """The same block hash from two ranks of one engine (equal seeds hash equally): the endpoint
    holds the block while either rank does."""
    tok = ModelTokenizer(TINY_DIR)
    s = KVEventsConfig(enabled=True, speculative_ttl_s=0)
    idx = EventIndex({"m": tok}, lambda m: s)
    ep = Endpoint(url="http://10.0.0.1:8000", model="m")
    st = idx.track(ep, s)
    tokens = list(range(32))

    def batch(rank, *events):
        return decode_batch(enc({"ts": 0, "events": list(events), "data_parallel_rank": rank}))

    for rank in (0, 1):
        idx.apply(st, batch(rank, stored_map([7, 8], None, tokens)))
    assert len(st.emap) == 4 and len(st.owned) == 2 and idx.blocks("m") == 4
    idx.apply(st, batch(1, {"type": "BlockRemoved", "block_hashes": [7, 8], "medium": "GPU"}))
    assert len(st.owned) == 2                               # rank 0 still holds both blocks
    idx.apply(st, batch(0, {"type": "BlockRemoved", "block_hashes": [7, 8], "medium": "GPU"}))
    assert not st.emap and not st.owned
