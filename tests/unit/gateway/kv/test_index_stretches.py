"""``EventIndex.stretches``: a batch applied a stretch at a time leaves the index exactly as
``apply`` does, whatever the batch holds (chains stored whole or from a parent, orphans, extras,
removals per medium, clears, a data-parallel endpoint's ranks, the bound on entries), and reports
the same counts; it yields between stretches of at most the blocks it is given."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.endpoints import Endpoint
from gateway.kv.index import EventIndex
from gateway.kv.settings import KVEventsConfig
from gateway.kv.wire import AllBlocksCleared, Batch, BlockRemoved, BlockStored, _ranked

BS = 4


def _index(ranks: int, bound: int) -> tuple[EventIndex, list]:
    s = KVEventsConfig(enabled=True, speculative_ttl_s=0, max_blocks_per_endpoint=bound, data_parallel_size=ranks,
                       port=5557, replay_port=None)
    idx = EventIndex({}, lambda m: s, clock=lambda: 1.0)
    return idx, [idx.track(Endpoint(url=f"http://10.0.0.{i + 1}:8000", model="m"), s) for i in range(2)]


def _state(idx: EventIndex, states: list) -> tuple:
    return (tuple((list(s.emap.items()), list(s.media.items()), s.owned, s.rank_keys, s.block_size)
                  for s in states),
            idx._holders, idx._children, idx._parent_of, idx.orphans)


def _event(spec: tuple, seen: list[int]) -> object:
    kind, start, n, medium, extras = spec
    if kind == "clear":
        return AllBlocksCleared()
    if kind == "remove":
        return BlockRemoved(seen[start % len(seen)::2] if seen else [7], medium)
    hashes = list(range(1000 + start * 10, 1000 + start * 10 + n))       # a chain per start; some overlap
    parent = None if start % 3 == 0 else (seen[start % len(seen)] if start % 3 == 1 and seen else 5)  # 5: never
    seen.extend(hashes)
    tokens = [(start + i) % 23 for i in range(n * BS + start % 2)]       # a spare token sometimes
    ex = [None if i % 3 else ("img", i) for i in range(n)] if extras else None
    return BlockStored(hashes, parent, tokens, BS, medium=medium, extra_keys=ex, cache_salt="s" if start == 6 else None)


_batches = st.lists(st.lists(st.tuples(st.sampled_from(["store", "store", "remove", "clear"]), st.integers(0, 9),
                                       st.integers(0, 12), st.sampled_from([None, "GPU", "CPU"]), st.booleans()),
                             min_size=1, max_size=6), min_size=1, max_size=6)


@settings(max_examples=80, deadline=None)
@given(_batches, st.integers(1, 5), st.sampled_from([1, 2]), st.sampled_from([30, 1000]))
# past the bound, events cut into runs that store the oldest blocks again (1000-1001): bounded after
# each run rather than after each event, as apply bounds it, the endpoint kept other entries
@example([[("store", 0, 0, None, False), ("store", 0, 0, None, False), ("store", 0, 11, None, True),
           ("store", 3, 10, None, False)], [("store", 0, 0, None, False)],
          [("store", 4, 10, None, False), ("store", 0, 2, None, True)]], 1, 1, 30)
def test_stretches_leave_the_index_as_apply_does(batches, per, ranks, bound):
    whole, a = _index(ranks, bound)
    cut, b = _index(ranks, bound)
    seen: list[int] = []
    for i, specs in enumerate(batches):
        events = [_event(spec, seen) for spec in specs]
        e, rank = i % 2, (i // 2) % ranks if ranks > 1 else None
        for ev in events if rank else ():
            _ranked(ev, rank)           # a rank's hashes, qualified as its subscriber's decoder does
        want = whole.apply(a[e], Batch(0.0, events, rank), rank)
        steps = cut.stretches(b[e], Batch(0.0, events, rank), rank, per)
        while True:
            try:
                next(steps)
            except StopIteration as stop:
                got = stop.value
                break
        assert got == want
        assert _state(cut, b) == _state(whole, a)


def test_a_large_event_is_cut_into_stretches_of_the_given_blocks():
    idx, (a, _) = _index(1, 1 << 20)
    tokens = list(range(10 * BS))
    batch = Batch(0.0, [BlockStored(list(range(1, 11)), None, tokens, BS), BlockRemoved([1, 2, 3, 4, 5]),
                        AllBlocksCleared(), BlockRemoved([9])], None)
    sizes = []
    steps = idx.stretches(a, batch, None, 4)
    for _ in steps:                         # the index between stretches: each block done or not begun
        sizes.append(len(a.emap))
    assert sizes == [4, 8, 10, 6, 5]        # 4 + 4 + 2 stored, then 4 + 1 removed, then the rest in one
    assert not a.emap
