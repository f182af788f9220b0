"""``EventIndex.apply`` against a plain model of what each endpoint holds: stored chains, removals
per medium, re-stored blocks, clears, orphans; and what ``apply`` reports."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.endpoints import Endpoint
from gateway.kv.index import Applied, EventIndex, fold_extras, root_key
from gateway.kv.settings import KVEventsConfig
from gateway.kv.tokenization import chain_keys
from gateway.kv.wire import AllBlocksCleared, Batch, BlockRemoved, BlockStored

BS = 4


def _index(n: int = 2, **kw):
    s = KVEventsConfig(enabled=True, speculative_ttl_s=0, **kw)
    idx = EventIndex({}, lambda m: s)
    return idx, [idx.track(Endpoint(url=f"http://10.0.0.{i + 1}:8000", model="m"), s) for i in range(n)]


def _engine_hash(parent, block) -> int:
    """An engine's chained block hash (content and parent decide it, as in vLLM)."""
    return hash(("engine", parent, tuple(block))) & (2 ** 64 - 1)


def test_apply_reports_what_it_applied():
    idx, (a, _) = _index()
    tokens = list(range(3 * BS))
    h = [1, 2, 3]
    done = idx.apply(a, Batch(0.0, [BlockStored(h, None, tokens, BS), BlockStored([9], 77, [0] * BS, BS),
                                    BlockRemoved([1], "GPU"), BlockRemoved([5]), AllBlocksCleared()], 0))
    assert done == Applied(stored=2, removed=2, cleared=1, orphans=1)
    assert idx.orphans == 1 and not a.emap


def test_a_block_stored_again_in_another_medium_keeps_its_key_until_both_are_gone():
    idx, (a, b) = _index()
    tokens = list(range(2 * BS))
    idx.apply(a, Batch(0.0, [BlockStored([1, 2], None, tokens, BS, medium="GPU")], 0))
    keys = chain_keys(root_key("m", None, BS), tokens, BS)
    assert [a.emap[1], a.emap[2]] == keys
    idx.apply(a, Batch(0.0, [BlockStored([1, 2], None, tokens, BS, medium="CPU")], 0))   # offloaded
    assert a.media == {1: 1 | 2, 2: 1 | 2} and a.owned == {keys[0]: 1, keys[1]: 1}
    idx.apply(a, Batch(0.0, [BlockRemoved([1, 2], "GPU")], 0))
    assert idx._holders == {keys[0]: a.bit, keys[1]: a.bit}
    idx.apply(a, Batch(0.0, [BlockRemoved([1, 2], "CPU")], 0))
    assert not a.emap and not a.media and not a.owned and not idx._holders


def test_a_hash_twice_in_one_event_is_counted_once():
    idx, (a, _) = _index()
    idx.apply(a, Batch(0.0, [BlockStored([1, 1], None, list(range(2 * BS)), BS)], 0))
    assert len(a.emap) == 1 and sum(a.owned.values()) == 1
    idx.apply(a, Batch(0.0, [BlockRemoved([1])], 0))
    assert not a.emap and not a.owned and not idx._holders


def test_the_bound_drops_the_oldest_entries():
    idx, (a, _) = _index(max_blocks_per_endpoint=3)
    idx.apply(a, Batch(0.0, [BlockStored([1, 2, 3, 4, 5], None, list(range(5 * BS)), BS)], 0))
    assert list(a.emap) == [3, 4, 5] and len(a.owned) == 3 and len(idx._holders) == 3


_ops = st.lists(st.tuples(st.sampled_from(["store", "store", "store", "remove", "clear"]),
                          st.integers(0, 1), st.integers(0, 5), st.integers(1, 4),
                          st.sampled_from([None, "GPU", "CPU", "disk"]), st.integers(0, 30)), max_size=40)


@settings(max_examples=60)
@given(_ops)
def test_apply_matches_a_model_of_the_engines(ops):
    """Engines storing chains that share prefixes, re-storing blocks in other media, evicting per
    medium and clearing; a chain stored with a salt (``cache_salt``: other engine hashes, the same
    tokens, so the same keys of ours). The index must hold exactly what the model of each engine holds."""
    idx, states = _index()
    root = root_key("m", None, BS)
    chains: list[list[tuple[int, tuple]]] = []          # (our key, tokens) per block, per chain
    model: list[dict[int, tuple[int, int]]] = [{}, {}]   # per endpoint: engine hash -> (key, media bits)
    bits = {None: 1, "GPU": 1, "CPU": 2, "disk": 4}
    for op, e, chain, n, medium, salt in ops:
        st_, held = states[e], model[e]
        if op == "store":
            while len(chains) <= chain:
                chains.append([])
            blocks = chains[chain]
            while len(blocks) < n:                  # the chain grows as needed (same content for everyone)
                tok = tuple((salt + chain * 7 + len(blocks) + j) % 50 for j in range(BS))
                blocks.append((hash((blocks[-1][0] if blocks else root, tok)), tok))
            hashes, h = [], salt % 2                # the engine's hashes, salted or not
            for _, tok in blocks[:n]:
                h = _engine_hash(h, tok)
                hashes.append(h)
            start = salt % n                        # store blocks start..n-1, chained on block start-1
            parent = hashes[start - 1] if start else None
            ev = BlockStored(hashes[start:n], parent, [t for _, tok in blocks[start:n] for t in tok], BS, medium=medium)
            idx.apply(st_, Batch(0.0, [ev], 0))
            if parent is not None and parent not in held:
                continue                            # an orphan: nothing indexed
            for h, (k, _) in zip(hashes[start:n], blocks[start:n], strict=True):
                old = held.get(h)
                held[h] = (k, (old[1] if old else 0) | bits[medium])
        elif op == "remove":
            hashes = [h for h, _ in list(held.items())[salt % 3::2]]
            idx.apply(st_, Batch(0.0, [BlockRemoved(hashes, medium)], 0))
            for h in hashes:
                k, m = held[h]
                m = m & ~bits[medium] if medium is not None else 0
                if m:
                    held[h] = (k, m)
                else:
                    del held[h]
        else:
            idx.apply(st_, Batch(0.0, [AllBlocksCleared()], 0))
            held.clear()
        for s, want in zip(states, model, strict=True):
            assert s.emap == {h: k for h, (k, _) in want.items()}
            assert s.media == {h: m for h, (_, m) in want.items()}
            assert s.owned == Counter(k for k, _ in want.values())
        holders: dict[int, int] = {}
        for s, want in zip(states, model, strict=True):
            for k, _ in want.values():
                holders[k] = holders.get(k, 0) | s.bit
        assert idx._holders == holders


# -- extra keys: what vLLM folds into a block's hash besides its tokens (cache_salt, multimodal) ---------

def _keys_of(st, hashes):
    return [st.emap[h] for h in hashes]


def test_salted_and_unsalted_chains_never_share_keys():
    idx, (a, b) = _index()
    tokens = list(range(3 * BS))
    plain = chain_keys(root_key("m", None, BS), tokens, BS)
    # vLLM: one entry per block, None where a block has no extras; the salt on the first block only
    idx.apply(a, Batch(0.0, [BlockStored([1, 2, 3], None, tokens, BS, extra_keys=[None, None, None])], 0))
    idx.apply(b, Batch(0.0, [BlockStored([11, 12, 13], None, tokens, BS, extra_keys=[["s1"], None, None])], 0))
    idx.apply(a, Batch(0.0, [BlockStored([21, 22, 23], None, tokens, BS, extra_keys=[["s2"], None, None])], 0))
    assert _keys_of(a, [1, 2, 3]) == plain                       # no extras: today's keys
    s1, s2 = _keys_of(b, [11, 12, 13]), _keys_of(a, [21, 22, 23])
    assert not set(s1) & set(plain) and not set(s2) & set(plain) and not set(s1) & set(s2)
    # the salt's chain is the plain chain from a salted root: what a salted request computes
    assert s1 == chain_keys(fold_extras(root_key("m", None, BS), ("s1",)), tokens, BS)
    # the same salt elsewhere (a LoRA's name first, as vLLM puts it) shares its keys on the adapter's root
    idx.apply(b, Batch(0.0, [BlockStored([31, 32], None, tokens[:2 * BS], BS, lora_name="ad",
                                         extra_keys=[["ad", "s1"], ["ad"]])], 0))
    assert _keys_of(b, [31, 32]) == chain_keys(fold_extras(root_key("m", "ad", BS), ("s1",)), tokens, BS)[:2]
    # a LoRA alone (extras naming only the adapter, or the id of older engines) keeps the adapter's keys
    idx.apply(a, Batch(0.0, [BlockStored([41, 42], None, tokens[:2 * BS], BS, lora_name="ad",
                                         extra_keys=[["ad"], ["ad"]])], 0))
    idx.apply(b, Batch(0.0, [BlockStored([51], None, tokens[:BS], BS, lora_name="7", lora_id=7,
                                         extra_keys=[[7]])], 0))
    assert _keys_of(a, [41, 42]) == chain_keys(root_key("m", "ad", BS), tokens, BS)[:2]
    assert _keys_of(b, [51]) == chain_keys(root_key("m", "7", BS), tokens, BS)[:1]


def test_multimodal_extras_tell_images_apart_and_a_chain_continues_on_them():
    idx, (a, b) = _index()
    tokens = [5] * (3 * BS)                                      # the same placeholder tokens
    idx.apply(a, Batch(0.0, [BlockStored([1, 2], None, tokens[:2 * BS], BS,
                                         extra_keys=[[["img-a", 0]], [["img-a", -4]]])], 0))
    idx.apply(b, Batch(0.0, [BlockStored([1, 2], None, tokens[:2 * BS], BS,
                                         extra_keys=[[["img-b", 0]], [["img-b", -4]]])], 0))
    assert not set(_keys_of(a, [1, 2])) & set(_keys_of(b, [1, 2]))
    assert not set(_keys_of(a, [1, 2])) & set(chain_keys(root_key("m", None, BS), tokens, BS))
    # a later event chained on the image's blocks continues their keys (the text after it: no extras)
    idx.apply(a, Batch(0.0, [BlockStored([3], 2, tokens[2 * BS:], BS, extra_keys=[None])], 0))
    assert a.emap[3] == hash((a.emap[2], tuple(tokens[2 * BS:])))
    # fewer entries than hashes (a malformed event): the blocks without one are keyed without extras
    idx.apply(b, Batch(0.0, [BlockStored([7, 8], None, tokens[:2 * BS], BS, extra_keys=[["s"]])], 0))
    k7 = chain_keys(fold_extras(root_key("m", None, BS), ("s",)), tokens, BS)
    assert _keys_of(b, [7, 8]) == k7[:2]


def test_removing_salted_blocks_resolves():
    idx, (a, b) = _index()
    tokens = list(range(2 * BS))
    for st_, salt in ((a, "s1"), (b, "s1")):
        idx.apply(st_, Batch(0.0, [BlockStored([1, 2], None, tokens, BS, extra_keys=[[salt], None])], 0))
    keys = _keys_of(a, [1, 2])
    assert idx._holders == {keys[0]: a.bit | b.bit, keys[1]: a.bit | b.bit}
    idx.apply(a, Batch(0.0, [BlockRemoved([1, 2], "GPU")], 0))
    assert not a.emap and not a.owned and idx._holders == {keys[0]: b.bit, keys[1]: b.bit}
    idx.apply(b, Batch(0.0, [BlockRemoved([2]), BlockRemoved([1])], 0))
    assert not b.emap and not b.owned and not idx._holders
