"""``EventIndex.clear`` takes an endpoint out of routing at once and leaves its old entries to
``drain``, a stretch at a time: matches made between the stretches are those of an index cleared at
once, new events apply to the endpoint meanwhile, a second clear (or the endpoint leaving the pool)
while one is under way neither leaks nor frees anything twice, and once drained the index is the
one cleared at once."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from enginesim.tiny_tokenizer import TINY_DIR
from gateway.endpoints import Endpoint
from gateway.kv.index import CLEAR_STRETCH, EventIndex
from gateway.kv.settings import KVEventsConfig
from gateway.kv.tokenization import ModelTokenizer
from gateway.kv.wire import AllBlocksCleared, Batch, BlockRemoved, BlockStored
from gateway.request import parse

BS = 16
TOK = ModelTokenizer(TINY_DIR)
CHAINS = [[tuple((c * 31 + b * 7 + j) % 40 for j in range(BS)) for b in range(6)] for c in range(3)]


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def _index(at_once: bool, ranks: int = 1, unlink: int = 0) -> tuple[EventIndex, list[Endpoint], Clock]:
    """``at_once``: every clear unlinked at once; else by the test, a stretch at a time, but for an
    endpoint holding fewer than ``unlink`` entries (0: none; the gateway's is ``CLEAR_STRETCH``)."""
    cfg = KVEventsConfig(enabled=True, speculative_ttl_s=5.0, stall_timeout_s=1000, data_parallel_size=ranks,
                         port=5557, replay_port=None)
    clock = Clock()
    idx = EventIndex({"m": TOK}, lambda m: cfg, clock)
    if not at_once:
        idx.on_retired = lambda: None              # drained by the test, a stretch at a time
        idx.clear_at_once = unlink
    eps = [Endpoint(url=f"http://10.0.0.{i}:8000", model="m") for i in (1, 2, 3)]
    for ep in eps:
        idx.track(ep, cfg)
    return idx, eps, clock


def _req(c: int, n: int, rid: str):
    ids = [t for block in CHAINS[c][:n] for t in block] + [1]
    return parse("/v1/completions", orjson.dumps({"model": "m", "prompt": ids}), {}, rid)


def _normal(idx: EventIndex, eps: list[Endpoint]) -> tuple:
    """The index with each slot's bit named by its endpoint (a cleared endpoint's slot differs)."""
    states = [idx.states[ep] for ep in eps]
    who = {s.slot: i for i, s in enumerate(states)}

    def named(mask: int) -> tuple[int, ...]:
        out = []
        while mask:
            low = mask & -mask
            out.append(who[low.bit_length() - 1])      # a KeyError: the bit of no endpoint left behind
            mask ^= low
        return tuple(sorted(out))

    return (tuple((list(s.emap.items()), s.media, s.owned, s.rank_keys, s.rank_pending) for s in states),
            {k: named(m) for k, m in idx._holders.items()}, {k: named(m) for k, m in idx._pending.items()},
            {(k, who[slot]): u for (k, slot), u in idx._pending_until.items()},
            idx._children, idx._parent_of)


_ops = st.lists(st.tuples(st.sampled_from(["store", "store", "store", "remove", "clear", "route", "expire", "forget"]),
                          st.integers(0, 2), st.integers(0, 2), st.integers(1, 6), st.integers(0, 9),
                          st.sampled_from([0, 1, 3, 1 << 30])), min_size=1, max_size=40)


@settings(max_examples=80, deadline=None)
@given(_ops, st.sampled_from([1, 2]), st.sampled_from([0, CLEAR_STRETCH]))
def test_a_clear_in_stretches_routes_as_a_clear_at_once(ops, ranks, unlink):
    whole, weps, wclock = _index(True, ranks)
    cut, eps, clock = _index(False, ranks, unlink)
    for i, (op, e, c, n, x, stretch) in enumerate(ops):
        rank = None if ranks == 1 else x % ranks
        for idx, ep in ((whole, weps[e]), (cut, eps[e])):
            s = idx.states[ep]
            if op == "store":
                start = x % n
                ids = [t for block in CHAINS[c][:n] for t in block]
                hashes = [c * 100 + b + 1 for b in range(n)]
                idx.apply(s, Batch(0.0, [BlockStored(hashes[start:], hashes[start - 1] if start else None,
                                                     ids[start * BS:], BS)], rank), rank)
            elif op == "remove":
                idx.apply(s, Batch(0.0, [BlockRemoved([c * 100 + b + 1 for b in range(x % 6, n)])], rank), rank)
            elif op == "clear":
                idx.apply(s, Batch(0.0, [AllBlocksCleared()], None))
                assert not s.emap and not s.owned               # out of routing at once
            elif op == "route":
                req = _req(c, n, f"r{i}")
                idx.match(req, eps if idx is cut else weps)
                idx.routed(req, ep)
            elif op == "forget":
                idx.forget(ep)
                idx.track(ep, s.settings)
        if op == "expire":
            wclock.t += x
            clock.t += x
        cut.drain(stretch)                      # a stretch of the clears under way, or none, or all
        for c2 in range(3):                     # every decision meanwhile: as on the index cleared at once
            for n2 in (1, 3, 6):
                got = cut.match(_req(c2, n2, f"p{i}"), eps)
                want = whole.match(_req(c2, n2, f"q{i}"), weps)
                assert got is not None and want is not None
                assert [got[0].get(ep) for ep in eps] == [want[0].get(ep) for ep in weps]
    while cut.drain(1):
        pass
    assert not cut.retiring
    assert _normal(cut, eps) == _normal(whole, weps)
    assert len(cut._free) + len(cut._by_slot) == cut._slots       # every slot in use or free, once
    assert len(set(cut._free)) == len(cut._free) and not set(cut._free) & set(cut._by_slot)


def test_a_clear_returns_at_once_and_leaves_its_entries_to_stretches():
    idx, eps, _ = _index(False)
    a, b = (idx.states[ep] for ep in eps[:2])
    ids = [t for block in CHAINS[0] for t in block]
    many = [BlockStored([1000 + i], 999 + i if i else None, [i % 40] * BS, BS) for i in range(10_000)]
    idx.apply(a, Batch(0.0, [BlockStored([1, 2, 3, 4, 5, 6], None, ids, BS), *many], None))
    idx.apply(b, Batch(0.0, [BlockStored([1, 2, 3, 4, 5, 6], None, ids, BS)], None))
    held = len(idx._holders)
    assert held == 10_006
    idx.apply(a, Batch(0.0, [AllBlocksCleared()], None))
    assert len(idx._holders) == held and idx.retiring == 1      # nothing unlinked yet...
    depths = idx.match(_req(0, 6, "r"), eps)[0]
    assert depths[eps[0]] == 0 and depths[eps[1]] == 6 * BS      # ...yet a has none of them, b all
    left = [len(idx._holders)]
    while idx.drain(1000):
        left.append(len(idx._holders))
    left.append(len(idx._holders))
    assert left[-1] == 6 and not idx.retiring                    # b's only
    assert all(0 <= x - y <= 1000 for x, y in zip(left, left[1:], strict=False))   # at most a stretch each
    assert len(left) >= 10_000 // 1000 + 1
    assert a.slot == 3 and idx._free == [0]                      # its old slot free once drained
    idx.apply(a, Batch(0.0, [AllBlocksCleared()], None))          # its new, empty slot: nothing to drain
    while idx.drain(1):
        pass
    assert a.slot == 0 and idx._free == [3]


def test_a_second_clear_while_one_is_under_way():
    idx, eps, _ = _index(False)
    a = idx.states[eps[0]]
    ids = [t for block in CHAINS[1] for t in block]
    idx.apply(a, Batch(0.0, [BlockStored([1, 2, 3, 4, 5, 6], None, ids, BS)], None))
    idx.apply(a, Batch(0.0, [AllBlocksCleared(), BlockStored([7, 8], None, ids[:2 * BS], BS)], None))
    assert list(a.emap) == [7, 8]                                 # new events build on the fresh maps
    idx.drain(2)
    idx.apply(a, Batch(0.0, [AllBlocksCleared()], None))
    idx.forget(eps[0])                                            # and it leaves the pool meanwhile
    assert idx.retiring == 3
    while idx.drain(1):
        pass
    assert not idx._holders and not idx._children and not idx._parent_of
    assert sorted(idx._free) == [0, 3, 4]


def test_a_clear_drops_what_was_held_for_the_endpoint_speculatively():
    for at_once in (True, False):
        idx, eps, _ = _index(at_once)
        a, b = (idx.states[ep] for ep in eps[:2])
        for s in (a, b):                                            # both live, nothing of the chain held
            idx.apply(s, Batch(0.0, [BlockStored([50], None, [39] * BS, BS)], None))
        req = _req(2, 6, "r")
        idx.match(req, eps)
        idx.routed(req, eps[0])
        assert idx.match(_req(2, 6, "s"), eps)[0][eps[0]] == 6 * BS    # a is about to hold it
        idx.apply(a, Batch(0.0, [AllBlocksCleared()], None))
        assert idx.match(_req(2, 6, "t"), eps)[0][eps[0]] == 0         # its engine's cache is gone: so is that
        while idx.drain(1):
            pass
        assert not idx._pending and not idx._pending_until and len(idx._parent_of) == 1     # b's block only


def test_a_speculative_hold_ends_when_the_engine_reports_the_block_so_its_removal_ends_the_match():
    """A routed request's new blocks count as held for ``speculative_ttl_s`` or until events confirm
    them: once the engine reports them stored, its ``BlockRemoved`` of them ends the match there
    (on the endpoint, and on the data-parallel rank the request was pinned to)."""
    idx, eps, _ = _index(True, ranks=2)
    a, b = (idx.states[ep] for ep in eps[:2])
    for s in (a, b):                                            # both live, nothing of the chain held
        idx.apply(s, Batch(0.0, [BlockStored([50], None, [39] * BS, BS)], None), 0)
    req = _req(2, 6, "r")
    idx.match(req, eps)
    idx.routed(req, eps[0])
    idx.rank_routed(req, eps[0], 1, 0)
    again = _req(2, 6, "s")
    assert idx.match(again, eps)[0][eps[0]] == 6 * BS and idx.rank_depths(again, eps[0]) == [0, 6 * BS]
    tokens = [t for block in CHAINS[2] for t in block]
    idx.apply(a, Batch(0.0, [BlockStored([(1, h) for h in range(60, 66)], None, tokens, BS)], 1), 1)   # rank 1 reports them
    assert idx.match(_req(2, 6, "t"), eps)[0][eps[0]] == 6 * BS
    idx.apply(a, Batch(0.0, [BlockRemoved([(1, h) for h in range(60, 66)])], 1), 1)       # and evicts them
    gone = _req(2, 6, "u")
    assert idx.match(gone, eps)[0][eps[0]] == 0 and idx.rank_depths(gone, eps[0]) == [0, 0]
    assert not idx._pending and not idx._pending_until and not a.rank_pending
