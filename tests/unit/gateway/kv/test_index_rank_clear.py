"""``EventIndex.clear_rank`` takes one data-parallel rank of an endpoint out of routing at once and
leaves its old entries to ``drain``, a stretch at a time, as ``clear`` does for a whole endpoint:
the call itself touches none of them, no match made meanwhile counts them (the other ranks' blocks
count as before), what the rank stores afterwards counts at once and survives the drain, a remove
naming an old block is harmless, and once drained the index is the one cleared at once."""

from __future__ import annotations

import msgspec
import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from enginesim.tiny_tokenizer import TINY_DIR
from gateway.endpoints import Endpoint
from gateway.kv.index import EventIndex
from gateway.kv.settings import KVEventsConfig
from gateway.kv.tokenization import ModelTokenizer
from gateway.kv.wire import AllBlocksCleared, Batch, BlockRemoved, BlockStored, rank_of
from gateway.request import parse

BS = 16
TOK = ModelTokenizer(TINY_DIR)
CHAINS = [[tuple((c * 31 + b * 7 + j) % 40 for j in range(BS)) for b in range(6)] for c in range(3)]
RANKS = 3


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def _index(at_once: bool) -> tuple[EventIndex, list[Endpoint], Clock]:
    cfg = KVEventsConfig(enabled=True, speculative_ttl_s=5.0, stall_timeout_s=1000, data_parallel_size=RANKS,
                         port=5557, replay_port=None)
    clock = Clock()
    idx = EventIndex({"m": TOK}, lambda m: cfg, clock)
    if not at_once:
        idx.on_retired = lambda: None              # drained by the test, a stretch at a time
    eps = [Endpoint(url=f"http://10.0.0.{i}:8000", model="m") for i in (1, 2)]
    for ep in eps:
        idx.track(ep, cfg)
    return idx, eps, clock


def _req(c: int, n: int, rid: str):
    ids = [t for block in CHAINS[c][:n] for t in block] + [1]
    return parse("/v1/completions", orjson.dumps({"model": "m", "prompt": ids}), {}, rid)


def _h(rank: int, h: int):
    """``h`` as rank ``rank``'s subscriber qualifies it (``kv_wire.rank_of``)."""
    return (rank, h) if rank else h


def _store(idx: EventIndex, s, rank: int, c: int, n: int, start: int = 0, seed: int = 0) -> None:
    """Blocks ``start:n`` of chain ``c`` stored by ``rank``; another ``seed``: the engine hashes the
    same blocks otherwise (it restarted with another hash seed)."""
    ids = [t for block in CHAINS[c][:n] for t in block]
    hashes = [_h(rank, c * 100 + b + 1 + seed) for b in range(n)]
    idx.apply(s, Batch(0.0, [BlockStored(hashes[start:], hashes[start - 1] if start else None,
                                         ids[start * BS:], BS)], rank), rank)


def _live(idx: EventIndex, s) -> None:
    """``s`` sends events (one block nothing else chains on), so ``match`` counts it."""
    idx.apply(s, Batch(0.0, [BlockStored([77], None, [38] * BS, BS)], 0), 0)


def _named(idx: EventIndex, eps: list[Endpoint]) -> dict:
    """The shared maps with each slot's bit named by its endpoint (a cleared endpoint's slot differs)."""
    who = {idx.states[ep].slot: i for i, ep in enumerate(eps)}

    def named(mask: int) -> tuple[int, ...]:
        out = []
        while mask:
            low = mask & -mask
            out.append(who[low.bit_length() - 1])      # a KeyError: the bit of no endpoint left behind
            mask ^= low
        return tuple(sorted(out))

    return {"holders": {k: named(m) for k, m in idx._holders.items()},
            "pending": {k: named(m) for k, m in idx._pending.items()},
            "children": idx._children, "parent_of": idx._parent_of}


def _depths(idx: EventIndex, eps: list[Endpoint], c: int, n: int, rid: str) -> tuple:
    req = _req(c, n, rid)
    got = idx.match(req, eps)
    assert got is not None
    return tuple(got[0].get(ep) for ep in eps), tuple(tuple(idx.rank_depths(req, ep) or ()) for ep in eps)


def test_a_rank_clear_returns_at_once_and_leaves_its_entries_to_stretches():
    idx, eps, _ = _index(False)
    a, b = (idx.states[ep] for ep in eps)
    _store(idx, a, 0, 0, 6)                                       # ranks 0 and 1 of a hold chain 0
    _store(idx, a, 1, 0, 6)
    _store(idx, a, 1, 1, 6)                                       # rank 1 alone holds chain 1...
    many = [BlockStored([(1, 1000 + i)], (1, 999 + i) if i else None, [i % 40] * BS, BS) for i in range(10_000)]
    idx.apply(a, Batch(0.0, many, 1), 1)                           # ...and 10,000 blocks more
    _store(idx, b, 1, 1, 6)                                       # b's rank 1 holds chain 1 too
    entries, held = len(a.emap), len(idx._holders)
    assert entries == 10_018 and held == 10_012

    idx.apply(a, Batch(0.0, [AllBlocksCleared()], 1), 1)          # rank 1's cache reset
    assert len(a.emap) == entries and len(idx._holders) == held    # nothing touched yet...
    assert idx.retiring == 1
    assert _depths(idx, eps, 0, 6, "r") == ((6 * BS, 0), ((6 * BS, 0, 0), (0, 0, 0)))   # ...yet rank 1 holds none
    assert _depths(idx, eps, 1, 6, "s") == ((0, 6 * BS), ((0, 0, 0), (0, 6 * BS, 0)))   # of it; b keeps its own
    left, copied = [len(a.emap)], []
    while idx.drain(1000):
        left.append(len(a.emap))
        if idx._retired and idx._retired[0].todo is not None:
            copied.append(len(idx._retired[0].todo))   # the engine hashes drain copied, still to look at
    left.append(len(a.emap))
    assert copied[0] == entries and all(0 < x - y <= 1000 for x, y in zip(copied, copied[1:], strict=False))
    assert left[-1] == 6 and set(a.emap) == set(range(1, 7)) and not idx.retiring     # rank 0's only
    assert all(0 <= x - y <= 1000 for x, y in zip(left, left[1:], strict=False))   # at most a stretch each
    assert len(left) >= 10_000 // 1000 + 1
    assert len(idx._holders) == 12                                # chain 0 (a's rank 0) and chain 1 (b)
    assert _depths(idx, eps, 0, 6, "t") == ((6 * BS, 0), ((6 * BS, 0, 0), (0, 0, 0)))


def test_what_the_rank_stores_after_its_clear_counts_and_stays():
    idx, eps, _ = _index(False)
    a = idx.states[eps[0]]
    _live(idx, idx.states[eps[1]])
    _store(idx, a, 1, 0, 6)
    _store(idx, a, 2, 1, 6)
    idx.clear_rank(a, 1)
    assert _depths(idx, eps, 0, 6, "r")[1][0] == (0, 0, 0)
    _store(idx, a, 1, 0, 3)                                       # rank 1 prefills chain 0 again, 3 blocks of it
    assert _depths(idx, eps, 0, 6, "s") == ((3 * BS, 0), ((0, 3 * BS, 0), (0, 0, 0)))
    idx.apply(a, Batch(0.0, [BlockRemoved([(1, 5), (1, 6)])], 1), 1)     # removes of old blocks: harmless
    idx.apply(a, Batch(0.0, [BlockStored([(1, 5)], (1, 4), list(CHAINS[0][4]), BS)], 1), 1)   # an orphan now
    assert idx.orphans == 1
    assert _depths(idx, eps, 0, 6, "t")[0] == (3 * BS, 0)
    while idx.drain(1):
        pass
    assert set(a.emap) == {(1, 1), (1, 2), (1, 3), *((2, b) for b in range(101, 107))}
    assert _depths(idx, eps, 0, 6, "u") == ((3 * BS, 0), ((0, 3 * BS, 0), (0, 0, 0)))
    assert _depths(idx, eps, 1, 6, "v") == ((6 * BS, 0), ((0, 0, 6 * BS), (0, 0, 0)))
    idx.clear_rank(a, 2)
    _store(idx, a, 2, 1, 6, seed=50)                              # restarted: new hashes for the same blocks
    while idx.drain(1):
        pass
    assert _depths(idx, eps, 1, 6, "w") == ((6 * BS, 0), ((0, 0, 6 * BS), (0, 0, 0)))


def test_a_rank_clear_drops_what_was_held_for_the_rank_speculatively():
    for at_once in (True, False):
        idx, eps, _ = _index(at_once)
        a = idx.states[eps[0]]
        for r in range(RANKS):                                    # live, nothing of chain 2 held
            idx.apply(a, Batch(0.0, [BlockStored([_h(r, 50)], None, [39] * BS, BS)], r), r)
        req = _req(2, 6, "r")
        idx.match(req, eps)
        idx.rank_routed(req, eps[0], 1, 0)
        idx.rank_routed(req, eps[0], 2, 0)
        assert _depths(idx, eps, 2, 6, "s")[1][0] == (0, 6 * BS, 6 * BS)   # ranks 1 and 2 are about to hold it
        idx.clear_rank(a, 1)
        assert _depths(idx, eps, 2, 6, "t")[1][0] == (0, 0, 6 * BS)        # rank 1's cache is gone: so is that
        req = _req(2, 3, "u")
        idx.match(req, eps)
        idx.rank_routed(req, eps[0], 1, 0)                        # held for it again after the clear: counts
        assert _depths(idx, eps, 2, 6, "w")[1][0] == (0, 3 * BS, 6 * BS)
        while idx.drain(1):
            pass
        assert _depths(idx, eps, 2, 6, "x")[1][0] == (0, 3 * BS, 6 * BS)
        assert all(set(spec) <= {1, 2} for spec in a.rank_pending.values())
        assert sum(1 in spec for spec in a.rank_pending.values()) == 3


def test_a_clear_of_the_endpoint_or_of_the_rank_again_while_one_is_under_way():
    idx, eps, _ = _index(False)
    a = idx.states[eps[0]]
    _live(idx, idx.states[eps[1]])
    _store(idx, a, 1, 0, 6)
    _store(idx, a, 0, 1, 6)
    idx.clear_rank(a, 1)
    _store(idx, a, 1, 2, 4)
    idx.drain(3)
    idx.drain(3)
    assert len(idx._retired[0].todo) == 12 + 4 - 3
    idx.clear_rank(a, 1)                                          # what it stored since is old now too
    idx.drain(3)                                                  # the first clear's copy: let go of 3...
    assert len(idx._retired[0].todo) == 12 + 4 - 6
    assert _depths(idx, eps, 2, 4, "r")[0] == (0, 0)
    _store(idx, a, 1, 2, 2)
    while idx.drain(1):
        pass
    assert set(a.emap) == {*range(101, 107), (1, 201), (1, 202)}
    idx.clear_rank(a, 0)
    idx.apply(a, Batch(0.0, [AllBlocksCleared()], None))         # the whole endpoint meanwhile
    idx.forget(eps[1])
    while idx.drain(1):
        pass
    assert not a.emap and not a.owned and not a.rank_keys and not idx._holders
    assert not idx._children and not idx._parent_of and not idx.retiring


def test_a_rank_holding_a_block_under_two_hashes_keeps_it_when_one_goes():
    """A rank can hold one block under two engine hashes (it restarted with another hash seed and
    stored the block again); removing one leaves the block held by the rank, as by the endpoint,
    and a clear of another rank under way does not hide it."""
    for at_once in (True, False):
        idx, eps, _ = _index(at_once)
        a = idx.states[eps[0]]
        _store(idx, a, 0, 0, 1)                                   # hash 1...
        _store(idx, a, 0, 0, 1, seed=50)                          # ...and hash 51: the same block
        idx.apply(a, Batch(0.0, [BlockRemoved([1])], 0), 0)       # hash 1 evicted: 51 still holds it
        assert _depths(idx, eps, 0, 1, "r")[:1] == ((BS, None),)
        assert _depths(idx, eps, 0, 1, "s")[1][0] == (BS, 0, 0)
        idx.apply(a, Batch(0.0, [AllBlocksCleared()], 1), 1)      # rank 1 (holding nothing) cleared
        assert _depths(idx, eps, 0, 1, "t") == ((BS, None), ((BS, 0, 0), ()))
        while idx.drain(1):
            pass
        assert _depths(idx, eps, 0, 1, "u") == ((BS, None), ((BS, 0, 0), ()))
        a.settings = msgspec.structs.replace(a.settings, max_blocks_per_endpoint=2)
        _store(idx, a, 0, 0, 1)                                   # hash 1 again, then 51 dropped by the bound:
        _store(idx, a, 0, 2, 1)                                   # 1 still holds the block
        assert 51 not in a.emap
        assert _depths(idx, eps, 0, 1, "v") == ((BS, None), ((BS, 0, 0), ()))
        idx.apply(a, Batch(0.0, [BlockRemoved([1])], 0), 0)       # the last of the rank's hashes for it
        assert _depths(idx, eps, 0, 1, "w") == ((0, None), ((0, 0, 0), ()))
        assert len(a.rank_keys) == 1 and not a.rank_again


def test_a_block_reported_stored_while_another_ranks_clear_is_under_way_ends_its_hold():
    """A block held speculatively for a routed request ends its hold once the engine reports it
    stored, even while another rank's old entry of the same block is left for ``drain``: its
    BlockRemoved then ends the match, as on an index that cleared the rank at once."""
    for at_once in (True, False):
        idx, eps, _ = _index(at_once)
        a = idx.states[eps[0]]
        _store(idx, a, 0, 0, 1)
        _store(idx, a, 2, 0, 1)                                   # rank 2 holds the block too
        idx.apply(a, Batch(0.0, [BlockRemoved([1])], 0), 0)
        idx.clear_rank(a, 2)                                      # its old entry left for drain
        req = _req(0, 1, "r")
        idx.match(req, eps)
        idx.routed(req, eps[0])                                   # held for the request...
        assert _depths(idx, eps, 0, 1, "s")[0] == (BS, None)
        _store(idx, a, 0, 0, 1)                                   # ...until rank 0 reports it stored...
        idx.apply(a, Batch(0.0, [BlockRemoved([1])], 0), 0)       # ...and evicted
        assert _depths(idx, eps, 0, 1, "t")[0] == (0, None)
        while idx.drain(1):
            pass
        assert _depths(idx, eps, 0, 1, "u")[0] == (0, None) and not idx._pending


_ops = st.lists(st.tuples(st.sampled_from(["store", "store", "stretches", "remove", "clear_rank", "clear_rank", "clear",
                                           "route", "expire", "forget"]),
                          st.integers(0, 1), st.integers(0, 2), st.integers(1, 6), st.integers(0, 9),
                          st.sampled_from([0, 1, 3, 1 << 30])), min_size=1, max_size=40)


@settings(max_examples=120, deadline=None)
@given(_ops)
def test_a_rank_clear_in_stretches_routes_as_a_rank_clear_at_once(ops):
    whole, weps, wclock = _index(True)
    cut, eps, clock = _index(False)
    for i, (op, e, c, n, x, stretch) in enumerate(ops):
        rank = x % RANKS
        for idx, ep in ((whole, weps[e]), (cut, eps[e])):
            s = idx.states[ep]
            if op == "store":
                _store(idx, s, rank, c, n, x % n, 50 * (x // 5))
            elif op == "stretches":            # applied two blocks at a time (``EventIndex.stretches``)
                ids = [t for block in CHAINS[c][:n] for t in block]
                hashes = [_h(rank, c * 100 + b + 1) for b in range(n)]
                start = x % n
                batch = Batch(0.0, [BlockRemoved(hashes[n - 1:]), BlockStored(hashes[start:], hashes[start - 1]
                                    if start else None, ids[start * BS:], BS)], rank)
                for _ in idx.stretches(s, batch, rank, blocks=2):
                    pass
            elif op == "remove":
                idx.apply(s, Batch(0.0, [BlockRemoved([_h(rank, c * 100 + b + 1) for b in range(x % 6, n)])],
                                   rank), rank)
            elif op == "clear_rank":
                idx.apply(s, Batch(0.0, [AllBlocksCleared()], rank), rank)
            elif op == "clear":
                idx.apply(s, Batch(0.0, [AllBlocksCleared()], None))
            elif op == "route":
                req = _req(c, n, f"r{i}")
                idx.match(req, eps if idx is cut else weps)
                idx.routed(req, ep)
                depths = idx.rank_depths(req, ep)
                if depths is not None:
                    idx.rank_routed(req, ep, rank, depths[rank])
            elif op == "forget":
                idx.forget(ep)
                idx.track(ep, s.settings)
        if op == "expire":
            wclock.t += x
            clock.t += x
        cut.drain(stretch)                      # a stretch of the clears under way, or none, or all
        for c2 in range(3):                     # every decision meanwhile: as on the index cleared at once
            for n2 in (1, 3, 6):
                assert _depths(cut, eps, c2, n2, f"p{i}") == _depths(whole, weps, c2, n2, f"q{i}")
    while cut.drain(1):
        pass
    assert not cut.retiring
    for ep, wep in zip(eps, weps, strict=True):
        s, w = cut.states[ep], whole.states[wep]
        assert list(s.emap.items()) == list(w.emap.items()) and s.media == w.media and s.owned == w.owned
        assert s.rank_keys == w.rank_keys and s.rank_again == w.rank_again and s.rank_pending == w.rank_pending
        held: dict[tuple[int, int], int] = {}                   # the ranks' bitmasks are those the entries make
        for bh, key in s.emap.items():
            held[(key, rank_of(bh))] = held.get((key, rank_of(bh)), 0) + 1
        ranks: dict[int, int] = {}
        for key, r in held:
            ranks[key] = ranks.get(key, 0) | 1 << r
        assert s.rank_keys == ranks and s.rank_again == {kr: n - 1 for kr, n in held.items() if n > 1}
    assert _named(cut, eps) == _named(whole, weps)
    assert len(cut._free) + len(cut._by_slot) == cut._slots
