"""The event index: which endpoint holds which token blocks, as its engine reported them.

Engines publish KV-cache events (``gateway.kv.wire``); ``gateway.kv.events`` feeds them here per
endpoint. The index keeps keys of its own and never needs the engine's hash seed or algorithm:

* a block's key is chained over token ids, ``key[i] = hash((key[i-1], tokens of block i))``, from a
  root that names the model, the LoRA adapter (``lora_name``) and the block size, so adapters and
  models never share keys; a request's keys are made the same way from its tokens
  (``gateway.kv.tokenization``);
* what else the engine folds into a block's hash and names in the event's ``extra_keys`` (a
  request's ``cache_salt`` on its first block, multimodal feature hashes) is folded into our key of
  that block too (``fold_extras``), so salted and unsalted chains, or two images behind the same
  placeholder tokens, never share a key; a request's root carries its salt the same way
  (``request_root``); a request with multimodal parts cannot be keyed (the gateway cannot compute
  the engine's feature hashes) and is routed on the approximate index (fallback ``multimodal``);
* per endpoint, engine hash → our key, so a ``BlockRemoved`` (which carries only engine hashes)
  resolves, and a ``BlockStored`` whose parent is an earlier block continues that block's chain;
  a block held in several media (GPU, CPU offload) stays until the last one removes it;
* key → bitmask of the endpoints holding it, so a request's match depth on every candidate is one
  walk down its keys, stopping when no candidate holds the next block.

Between routing a request and the engine's events for it, the request's new blocks are held as
*speculative* entries for ``speculative_ttl_s``, so a burst of requests with one new prefix lands on
one engine instead of scattering before the first one's prefill is reported.

An endpoint's events are trusted only while they flow: an endpoint that never sent one, or that was
sent a request needing new blocks ``stall_timeout_s`` ago and reported nothing since, is on the
*fallback*: the router uses the approximate index (``routers.prefix_index``) for it, and the fallback
is counted. Memory is bounded by ``max_blocks_per_endpoint`` (oldest entries dropped first); an
engine that restarts (its sequence numbers start again) or leaves the pool is cleared: out of
routing at once (a new slot), its old entries unlinked a stretch at a time (``drain``). One
data-parallel rank of an engine is cleared the same way (``clear_rank``): out of routing at once,
its old entries dropped from the endpoint's maps a stretch at a time.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from heapq import heappop, heappush
from itertools import accumulate, chain, islice, repeat
from operator import and_
from typing import Any, NamedTuple

from gateway.apis.paths import RESPONSES
from gateway.endpoints import Endpoint
from gateway.kv.settings import KVEventsConfig
from gateway.kv.tokenization import Keys, ModelTokenizer
from gateway.kv.wire import AllBlocksCleared, Batch, BlockHash, BlockRemoved, BlockStored, rank_of
from gateway.request import InferenceRequest

_MEDIA = {None: 1, "GPU": 1, "CPU": 2}     # other media get bit 4
_WALK_CHUNK = 512                          # keys looked up per step of a walk (C-level map)
_NO_EXTRAS = repeat(None)                  # the extras of blocks whose event carries none
# the blocks of one stretch of a large batch applied in stretches (``EventIndex.stretches``): about
# 1-2 ms of the event loop's time
STRETCH_BLOCKS = 2048
# the entries of a cleared endpoint taken out of the shared maps in one stretch (``EventIndex.drain``):
# about 1-2 ms of the event loop's time. An endpoint holding fewer entries is unlinked at once
# and keeps its slot (``EventIndex.clear``)
CLEAR_STRETCH = 4096


def _medium_bit(medium: str | None) -> int:
    return _MEDIA.get(medium, 4)


def root_key(model: str, lora: str | None, block_size: int) -> int:
    return hash(("switchyard.kv", model, lora or "", block_size))


# What vLLM folds into a block's hash besides its tokens and its parent (``generate_block_hash_extra_keys``
# in vllm/v1/core/kv_cache_utils.py) and publishes per block in ``BlockStored.extra_keys`` (one entry per
# block hash, ``None`` for a block without extras, each entry a tuple that msgpack delivers as an array):
# the adapter's name first when the request runs on a LoRA, then one ``(feature hash, offset in the
# block)`` per multimodal item whose placeholder tokens the block covers (older engines: the bare hash),
# then the request's ``cache_salt`` on the block starting at token 0 only, then a hash of the block's
# prompt embeddings when the prompt came as embeddings. The root of our chain names the adapter already,
# so a leading entry equal to the event's ``lora_name`` (older engines: ``lora_id``) is dropped; what is
# left is folded into the parent key before the block is chained, ``hash((hash((parent, extras)),
# tokens))``. A block without extras keeps ``hash((parent, tokens))``, so plain traffic keys as before.
# SGLang's events carry no extras; its radix tree keeps a request's ``cache_salt`` namespace apart and
# names the salt on each ``BlockStored`` (``cache_salt``, 0.5.23): folded into the root of a chain
# that starts there, as vLLM's salt on the first block is, so both key a salted request alike.

def fold_extras(key: int, extras: tuple) -> int:
    """``key`` with a block's extras folded in (the block's tokens are chained on the result)."""
    return hash((key, extras))


def _frozen(v: Any) -> Any:
    """A decoded extra as a hashable value: msgpack arrays (tuples on the engine's side) as tuples."""
    return tuple(map(_frozen, v)) if v.__class__ is list else v


def _extras(entry: Any, ev: BlockStored) -> tuple | None:
    """One block's ``extra_keys`` entry without what the root names (the adapter), or ``None``."""
    if not entry:
        return None
    first = entry[0]
    if (ev.lora_name is not None and first == ev.lora_name) or (ev.lora_id is not None and first == ev.lora_id):
        entry = entry[1:]
        if not entry:
            return None
    return _frozen(entry)


def request_root(req: InferenceRequest, model: str, block_size: int) -> int | None:
    """The root a request's block keys chain from: the model's, adapter's (a request whose ``model``
    is not ``model`` names an adapter of it) and block size's, with the
    request's ``cache_salt`` folded in as vLLM's events present it on the first block; ``None`` when
    the request cannot be keyed like the engine (multimodal parts: the engine folds feature hashes
    the gateway cannot compute). One dict lookup for a plain request."""
    if req.multimodal:
        return None
    root = root_key(model, None if req.model == model else req.model, block_size)
    salt = req.data.get("cache_salt")
    if salt.__class__ is str and salt:
        return fold_extras(root, (salt,))
    return root


class Applied(NamedTuple):
    """What ``EventIndex.apply`` did with a batch: events per kind, and the orphaned ``BlockStored``."""

    stored: int
    removed: int
    cleared: int
    orphans: int


@dataclass(eq=False)
class EndpointState:
    ep: Endpoint
    slot: int
    settings: KVEventsConfig
    emap: dict[BlockHash, int] = field(default_factory=dict)    # engine hash → our key
    media: dict[BlockHash, int] = field(default_factory=dict)   # engine hash → medium bits
    owned: dict[int, int] = field(default_factory=dict)         # our key → engine hashes mapping to it
    block_size: int | None = None
    last_event: float | None = None
    expect_since: float | None = None     # first request needing new blocks since the last event
    on_fallback: str | None = "no_events"  # why the router uses the approximate index, None: live
    stats: dict[str, int] = field(default_factory=dict)
    # a data-parallel engine whose rank the gateway picks (``KVEventsConfig.ranked``): our key →
    # bitmask of the ranks holding it, kept beside ``owned`` (so bounded with it); None otherwise
    rank_keys: dict[int, int] | None = None
    # (our key, rank) → the rank's engine hashes keyed so past its first (it stored the block again
    # under another hash, e.g. restarted with another hash seed), so its bit goes with its last one
    rank_again: dict[tuple[int, int], int] = field(default_factory=dict)
    ranks: int = 1
    rank_in_flight: list[int] = field(default_factory=list)   # this gateway's requests pinned per rank
    # a pinned request's new blocks, held speculatively on its rank until ``speculative_ttl_s`` passes
    # (so a burst on one new prefix lands on one rank before its first prefill is reported):
    # our key → {rank: until}, and the (until, key) order they expire in
    rank_pending: dict[int, dict[int, float]] = field(default_factory=dict)
    rank_pending_q: deque[tuple[float, int]] = field(default_factory=deque)
    # ranks cleared whose old entries are still in the maps above, out of routing (``clear_rank``)
    rank_clearing: dict[int, _RankClear] = field(default_factory=dict)
    held: bool = False        # blocks were held for it speculatively under its slot (``routed``)

    @property
    def bit(self) -> int:
        return 1 << self.slot


@dataclass(eq=False)
class _Retired:
    """A cleared endpoint's entries, out of routing but still in the shared maps (``EventIndex.drain``):
    its old slot, no endpoint's until they are gone, and its maps, no endpoint's either."""

    slot: int
    keys: Iterator[int] | None        # its keys (``owned``'s) not unlinked yet: each has the slot's bit in _holders
    maps: list[Any]                   # its maps, freed once its keys are unlinked
    pending: deque | None = None      # the slot's speculative holds (_pending_q's entries), once the maps are freed


@dataclass(eq=False)
class _RankClear:
    """A data-parallel rank cleared (``EventIndex.clear_rank``) whose old entries are still in its
    endpoint's maps, out of routing, until ``drain`` drops them. Its rank's entries that are not old
    are those stored since the clear (``fresh``): they count as any other rank's."""

    st: EndpointState
    rank: int
    fresh: set[BlockHash] = field(default_factory=set)          # the rank's engine hashes stored since
    fresh_keys: dict[int, int] = field(default_factory=dict)    # their keys → how many of them
    held: set[int] = field(default_factory=set)                 # keys held for the rank speculatively since
    todo: list[Any] | None = None         # what ``drain`` is to look at still: engine hashes, then held keys
    step: int = 0                         # 0: the hashes to copy, 1: looked at, 2: the held keys, 3: those


class EventIndex:
    """The index of every endpoint with events (one per gateway process)."""

    def __init__(self, tokenizers: dict[str, ModelTokenizer], settings: Callable[[str], KVEventsConfig | None],
                 clock: Callable[[], float] = time.monotonic,
                 on_fallback: Callable[[str, str, str], None] | None = None) -> None:
        self.tokenizers = tokenizers
        self.settings = settings
        self.clock = clock
        self._on_fallback = on_fallback or (lambda model, endpoint, reason: None)
        self.states: dict[Endpoint, EndpointState] = {}
        self.ranked: dict[Endpoint, EndpointState] = {}   # those whose data-parallel rank the gateway picks
        self._by_slot: dict[int, EndpointState] = {}
        self._free: list[int] = []
        self.clear_at_once = CLEAR_STRETCH     # a cleared endpoint holding fewer entries is unlinked at once
        self._slots = 0                           # slots ever made (live, free or retired)
        # cleared endpoints' old entries, unlinked from the shared maps a stretch at a time (``drain``);
        # ``on_retired`` is told when there are some (None: they are unlinked at once)
        self._retired: deque[_Retired | _RankClear] = deque()
        self._clearing: set[EndpointState] = set()    # those with a rank's old entries left (``clear_rank``)
        self.on_retired: Callable[[], None] | None = None
        self._holders: dict[int, int] = {}        # our key → bitmask of endpoint slots
        self._pending: dict[int, int] = {}        # our key → slots holding it speculatively
        self._pending_until: dict[tuple[int, int], float] = {}
        self._pending_q: deque[tuple[float, int, list[int]]] = deque()
        self._memo: tuple[InferenceRequest | None, int, list[int], int, int] = (None, 0, [], 0, 0)
        # keys held or pending anywhere, by the key they chain on: parent → how many, key → parent
        # (a request's keys stop where nothing chains on: no engine can match deeper)
        self._children: dict[int, int] = {}
        self._parent_of: dict[int, int] = {}
        # the last request's rendered segments (``segments``), so ``prepare`` and ``match`` render once
        self._rendered: tuple[InferenceRequest | None, list[str] | None, list[int]] = (None, None, [])
        # the last walk's depths (blocks held or pending, per endpoint), reused by ``routed``
        self._walked: tuple[list[int] | None, dict[int, int]] = (None, {})
        # the last request keyed only as far as a cache reaches, and its segments left untokenized
        self._left: tuple[InferenceRequest | None, list[str]] = (None, [])
        self.orphans = 0
        self.unreached: dict[str, int] = {}      # model → requests keyed only as far as a cache reaches

    # -- endpoints ---------------------------------------------------------------------------------

    def track(self, ep: Endpoint, settings: KVEventsConfig) -> EndpointState:
        st = self.states.get(ep)
        if st is None:
            st = EndpointState(ep, self._slot(), settings)
            if settings.ranked:
                st.rank_keys, st.ranks = {}, settings.data_parallel_size
                st.rank_in_flight = [0] * st.ranks
                self.ranked[ep] = st
            self.states[ep] = st
            self._by_slot[st.slot] = st
        return st

    def _slot(self) -> int:
        if self._free:               # the lowest: masks are integers as wide as their highest bit
            return heappop(self._free)
        self._slots += 1
        return self._slots - 1

    def forget(self, ep: Endpoint) -> None:
        st = self.states.pop(ep, None)
        self.ranked.pop(ep, None)
        if st is not None:
            self._retire(st)

    def blocks(self, model: str | None = None) -> int:
        """Engine blocks indexed (all endpoints, or one model's)."""
        return sum(len(s.emap) for s in self.states.values() if model is None or s.ep.model == model)

    # -- events ------------------------------------------------------------------------------------

    def apply(self, st: EndpointState, batch: Batch, rank: int | None = None) -> Applied:
        """``batch`` from ``st``'s publisher; ``rank``: the data-parallel rank's publisher it came from
        (an ``AllBlocksCleared`` then clears that rank only), ``None``: the endpoint's only one.
        Returns how many events of each kind it applied, and how many ``BlockStored`` were orphans.

        One pass over the events, in order. A ``BlockRemoved`` is resolved inline (the most frequent
        event: engines send one per evicted block); a ``BlockStored``'s blocks are cut and keyed in
        one loop (``_stored``). A batch for an endpoint no longer tracked (it left the pool, and its
        subscriber read on until stopped) is not applied."""
        if self._by_slot.get(st.slot) is not st:
            return Applied(0, 0, 0, 0)
        st.last_event = self.clock()
        st.expect_since = None
        st.on_fallback = None
        media, emap, owned, holders = st.media, st.emap, st.owned, self._holders
        pending, leave = self._pending, self._leave
        ranked = st.rank_keys
        not_rank = ~(1 << (rank or 0))
        others = ~(1 << st.slot)
        old = st.rank_clearing.get(rank or 0) if st.rank_clearing else None    # its rank's old entries left
        stored = removed = cleared = orphans = 0
        for ev in batch.events:
            cls = ev.__class__
            if cls is BlockRemoved:
                removed += 1
                if old is not None:
                    self._removed_past(st, old, ev)     # type: ignore[arg-type]
                    continue
                medium = ev.medium              # type: ignore[union-attr]
                keep = ~_MEDIA.get(medium, 4) if medium is not None else 0
                for bh in ev.block_hashes:      # type: ignore[union-attr]
                    bits = media.get(bh)
                    if bits is None:
                        continue
                    bits &= keep
                    if bits:
                        media[bh] = bits
                        continue
                    del media[bh]               # the last medium gone: _drop, inline
                    key = emap.pop(bh)
                    if ranked is not None and not (st.rank_again and self._again_less(st, key, rank or 0)):
                        m = ranked.get(key, 0) & not_rank
                        if m:
                            ranked[key] = m
                        else:
                            ranked.pop(key, None)
                    n = owned[key] - 1
                    if n:
                        owned[key] = n
                        continue
                    del owned[key]
                    mask = holders.get(key, 0) & others
                    if mask:
                        holders[key] = mask
                    else:
                        holders.pop(key, None)
                        if key not in pending:
                            leave(key)
            elif cls is BlockStored:
                stored += 1
                if old is not None:         # an old entry it names is gone first, as if cleared at once
                    self._unstale(st, old, ev.block_hashes)     # type: ignore[union-attr]
                    if ev.parent_block_hash is not None:        # type: ignore[union-attr]
                        self._unstale(st, old, (ev.parent_block_hash,))    # type: ignore[union-attr]
                orphans += self._stored(st, ev)     # type: ignore[arg-type]
                if ranked is not None:
                    self._rank_stored(ranked, emap, ev.block_hashes, rank or 0, st.rank_pending)   # type: ignore[union-attr]
                if old is not None:
                    self._freshen(st, old, ev.block_hashes)     # type: ignore[union-attr]
            elif cls is AllBlocksCleared:
                cleared += 1
                if rank is None:
                    self.clear(st)           # new maps, and a new slot
                    media, emap, owned, ranked, others = st.media, st.emap, st.owned, st.rank_keys, ~st.bit
                else:
                    self.clear_rank(st, rank)
                old = st.rank_clearing.get(rank or 0) if st.rank_clearing else None
        return Applied(stored, removed, cleared, orphans)

    # -- a rank's old entries, left for ``drain`` (``clear_rank``) --------------------------------

    def _unstale(self, st: EndpointState, old: _RankClear, hashes: Sequence[BlockHash]) -> None:
        """Drop the old entries of ``old``'s rank (there before its clear) that ``hashes`` names: an
        event of the rank naming one finds it gone, as it would had the clear dropped it at once."""
        emap, fresh, rank = st.emap, old.fresh, old.rank
        for bh in hashes:
            if bh in emap and bh not in fresh and rank_of(bh) == rank:
                self._drop(st, bh)

    def _freshen(self, st: EndpointState, old: _RankClear, hashes: Sequence[BlockHash]) -> None:
        """The blocks of ``hashes`` (stored by ``old``'s rank after its clear) that the endpoint holds
        are the rank's new entries: they count, and ``drain`` leaves them."""
        get, fresh, keys = st.emap.get, old.fresh, old.fresh_keys
        for bh in hashes:
            key = get(bh)
            if key is not None and bh not in fresh:
                fresh.add(bh)
                keys[key] = keys.get(key, 0) + 1

    def _removed_past(self, st: EndpointState, old: _RankClear, ev: BlockRemoved) -> None:
        """``ev`` from a rank whose old entries are left: an old one it names is dropped (it is out of
        routing already, so nothing changes), a new one loses the medium as ``apply`` does inline."""
        media, fresh, rank = st.media, old.fresh, old.rank
        keep = ~_MEDIA.get(ev.medium, 4) if ev.medium is not None else 0
        for bh in ev.block_hashes:
            bits = media.get(bh)
            if bits is None:
                continue
            if bh in fresh or rank_of(bh) != rank:
                bits &= keep
                if bits:
                    media[bh] = bits
                    continue
            self._drop(st, bh)

    def _stored(self, st: EndpointState, ev: BlockStored) -> int:
        """Key ``ev``'s full blocks (chained on its parent's key) and index them; 1 for an orphan.
        The token blocks are cut by ``zip`` over one iterator (tuples made in C, no slicing). Blocks
        whose engine hash is known already (a block stored again in another medium, e.g. offloaded
        to CPU) keep their key and gain the medium, and when all are, nothing is hashed."""
        bs = ev.block_size
        if bs <= 0:
            return 0
        if len(ev.token_ids) >= bs:     # a full block: a store of none tells no block size
            st.block_size = bs
        h = self._chain_start(st, ev, bs)
        if h is None:
            return 1
        emap = st.emap
        hashes = ev.block_hashes
        bit = _medium_bit(ev.medium)
        n = min(len(hashes), len(ev.token_ids) // bs)
        if n < len(hashes):
            hashes = hashes[:n]
        if all(map(emap.__contains__, hashes)):      # every block known: only the medium is new
            media = st.media
            for bh in hashes:
                media[bh] |= bit
            return 0
        extra = ev.extra_keys           # vLLM sends one entry per block, None where it has none
        folds: Any = _NO_EXTRAS if not extra or not any(extra) else \
            chain([_extras(x, ev) for x in extra[:n]], _NO_EXTRAS)
        self._chain(st, h, hashes, zip(*repeat(iter(ev.token_ids), bs), strict=False), folds, bit)
        self._trim(st)
        return 0

    def _chain_start(self, st: EndpointState, ev: BlockStored, bs: int) -> int | None:
        """The key ``ev``'s first block chains on: the root's, or its parent block's; ``None`` (counted)
        for an orphan, whose parent was never seen (subscribed late, a lost gap)."""
        if ev.parent_block_hash is None:
            h = root_key(st.ep.model, ev.lora_name, bs)
            salt = ev.cache_salt        # SGLang names it on the event; vLLM among the first block's extras
            if salt and not (ev.extra_keys and ev.extra_keys[0]):
                h = fold_extras(h, (salt,))
            return h
        parent = st.emap.get(ev.parent_block_hash)
        if parent is None:
            self.orphans += 1
            st.stats["orphan"] = st.stats.get("orphan", 0) + 1
        return parent

    def _chain(self, st: EndpointState, h: int, hashes: list[BlockHash], blocks: Any, folds: Any, bit: int) -> int:
        """Index the blocks ``hashes`` names, their tokens' tuples taken from ``blocks`` and their
        extras (or ``None``) from ``folds``, keyed in a chain from ``h``; the last key. Both iterators
        are advanced by as many blocks as ``hashes`` has, so a caller may go on with them."""
        emap, media = st.emap, st.media
        owned, holders, sbit, pending = st.owned, self._holders, st.bit, self._pending
        get, owned_get, holders_get, pending_get = emap.get, owned.get, holders.get, pending.get
        ranked = st.rank_keys
        for bh, block, x in zip(hashes, blocks, folds, strict=False):
            if x is not None:                 # cache_salt, multimodal features: see fold_extras
                h = hash((h, x))
            p = h                             # what the block's tokens chain on (its parent, for _enter)
            h = hash((h, block))              # as gateway.kv.tokenization chains a request's blocks
            old = get(bh)
            if old is not None:
                if old == h:
                    media[bh] |= bit
                    continue
                self._drop(st, bh)
            emap[bh] = h
            media[bh] = bit
            k = owned_get(h, 0)
            owned[h] = k + 1
            if k and ranked is not None:      # the block's rank holds it under another hash already?
                r = bh[0] if bh.__class__ is tuple else 0     # (rank_of)
                if ranked.get(h, 0) >> r & 1:
                    again = st.rank_again
                    again[(h, r)] = again.get((h, r), 0) + 1
            if not k:
                mask = holders_get(h, 0)
                holders[h] = mask | sbit
                spec = pending_get(h, 0)
                if spec & sbit:               # held speculatively: the engine's report ends the hold,
                    self._unpend(h, st.slot)  # so its BlockRemoved is the end of the match
                elif not mask and not spec:
                    self._enter(h, p)
            elif pending_get(h, 0) & sbit:    # held under another hash (a cleared rank's old entry
                self._unpend(h, st.slot)      # left for drain): the report ends the hold all the same
        return h

    def _trim(self, st: EndpointState) -> None:
        """Drop ``st``'s oldest entries past ``max_blocks_per_endpoint``."""
        emap = st.emap
        over = len(emap) - st.settings.max_blocks_per_endpoint
        if over > 0:
            # the oldest in one pass: a dict keeps the slots of what was deleted at its head until
            # it is resized, and a lookup of its first key per block walked them again each time
            for bh in list(islice(emap, over)):
                self._drop(st, bh)

    # -- a large batch, in stretches ---------------------------------------------------------------

    def stretches(self, st: EndpointState, batch: Batch, rank: int | None = None,
                  blocks: int = STRETCH_BLOCKS) -> Generator[None, None, Applied]:
        """``apply`` a stretch at a time: a generator that applies about ``blocks`` blocks (an event
        counting its block hashes, at least one) and yields before the next stretch, so its caller
        can let the event loop run between them; it returns what ``apply`` returns. Small events
        are applied by ``apply`` in groups; an event with more blocks than a stretch is cut: a
        ``BlockRemoved`` into parts of its hashes, a ``BlockStored`` into runs of its blocks keyed
        on in one chain (``_stored_runs``). The index ends as ``apply`` leaves it, and is whole at
        every yield (each block done or not begun), so routing may read it meanwhile; ``st``'s
        entries are bounded once a cut event is in, as ``apply`` bounds them after each event (the
        oldest dropped a stretch at a time), so a large event holds more than the bound until then.
        Nothing for an endpoint no longer tracked, as ``apply``."""
        if self._by_slot.get(st.slot) is not st:
            return Applied(0, 0, 0, 0)
        st.last_event = self.clock()
        st.expect_since = None
        st.on_fallback = None
        stored = removed = cleared = orphans = 0
        todo: list[Any] = []
        size = 0
        pause = False                   # a stretch was applied: yield before the next
        for ev in batch.events:
            cls = ev.__class__
            n = 1 if cls is AllBlocksCleared else len(ev.block_hashes) or 1    # type: ignore[union-attr]
            if todo and size + n > blocks:
                if pause:
                    yield
                done = self.apply(st, Batch(batch.ts, todo, batch.dp_rank), rank)
                stored, removed, cleared, orphans = (stored + done.stored, removed + done.removed,
                                                     cleared + done.cleared, orphans + done.orphans)
                todo, size, pause = [], 0, True
            if n <= blocks:
                todo.append(ev)
                size += n
            elif cls is BlockRemoved:
                removed += 1
                hashes = ev.block_hashes            # type: ignore[union-attr]
                for lo in range(0, n, blocks):
                    if pause:
                        yield
                    self.apply(st, Batch(batch.ts, [BlockRemoved(hashes[lo:lo + blocks], ev.medium,  # type: ignore[union-attr]
                                                                 ev.group_idx)], batch.dp_rank), rank)  # type: ignore[union-attr]
                    pause = True
            else:
                stored += 1
                if pause:
                    yield
                orphans += yield from self._stored_runs(st, ev, rank, blocks)      # type: ignore[arg-type]
                pause = True
        if todo:
            if pause:
                yield
            done = self.apply(st, Batch(batch.ts, todo, batch.dp_rank), rank)
            stored, removed, cleared, orphans = (stored + done.stored, removed + done.removed,
                                                 cleared + done.cleared, orphans + done.orphans)
        return Applied(stored, removed, cleared, orphans)

    def _stored_runs(self, st: EndpointState, ev: BlockStored, rank: int | None,
                     blocks: int) -> Generator[None, None, int]:
        """``_stored`` (and, for a ranked endpoint, ``_rank_stored``) in runs of ``blocks`` blocks,
        yielding between them; the chain's key and the token iterator carry on from run to run."""
        r = rank or 0
        emap, ranked = st.emap, st.rank_keys
        hashes = ev.block_hashes
        bs = ev.block_size
        h = None
        old = st.rank_clearing.get(r)
        if old is not None and ev.parent_block_hash is not None:
            self._unstale(st, old, (ev.parent_block_hash,))
        if bs > 0:
            if len(ev.token_ids) >= bs:
                st.block_size = bs
            h = self._chain_start(st, ev, bs)
        if h is None:                   # nothing to key (an orphan, or a block size that is none)
            if ranked is not None:
                self._rank_stored(ranked, emap, hashes, r, st.rank_pending)
            return 0 if bs <= 0 else 1
        bit = _medium_bit(ev.medium)
        n = min(len(hashes), len(ev.token_ids) // bs)
        # every block known: only the medium is new (not told apart from old entries of a cleared rank)
        known = old is None and all(map(emap.__contains__, islice(hashes, n)))
        extra = ev.extra_keys
        folds: Any = _NO_EXTRAS if known or not extra or not any(extra) else \
            chain(map(_extras, islice(extra, n), repeat(ev)), _NO_EXTRAS)
        tokens = zip(*repeat(iter(ev.token_ids), bs), strict=False)
        for lo in range(0, n, blocks):
            if lo:
                yield
            emap, media, ranked = st.emap, st.media, st.rank_keys    # the endpoint's maps now
            old = st.rank_clearing.get(r)
            run = hashes[lo:min(n, lo + blocks)]
            if old is not None:
                self._unstale(st, old, run)
            if known:
                for bh in run:
                    if bh in media:         # (not if cleared since)
                        media[bh] |= bit
            else:
                h = self._chain(st, h, run, tokens, folds, bit)
            if ranked is not None:
                self._rank_stored(ranked, emap, run, r, st.rank_pending)
            if old is not None:
                self._freshen(st, old, run)
        if ranked is not None and n < len(hashes):
            old = st.rank_clearing.get(r)
            if old is not None:
                self._unstale(st, old, hashes[n:])
            self._rank_stored(ranked, st.emap, hashes[n:], r, st.rank_pending)
        if not known:
            # bounded once the event is in, as ``_stored`` bounds it: trimmed after each run, a
            # block of the event that re-stores an old entry could find it dropped and take one more
            over = len(st.emap) - st.settings.max_blocks_per_endpoint
            if over > 0:
                oldest = list(islice(st.emap, over))
                for lo in range(0, over, blocks):
                    yield
                    emap = st.emap          # (cleared meanwhile: new maps, none of these in them)
                    for bh in oldest[lo:lo + blocks]:
                        if bh in emap:
                            self._drop(st, bh)
        return 0

    @staticmethod
    def _rank_stored(ranked: dict[int, int], emap: dict[BlockHash, int], hashes: list[BlockHash], rank: int,
                     pending: dict[int, dict[int, float]]) -> None:
        """The blocks of ``hashes`` (a ``BlockStored`` from ``rank``'s publisher) that the endpoint now
        holds: held by ``rank``, which holds them speculatively no more (``pending``: the endpoint's
        ``rank_pending``)."""
        bit = 1 << rank
        get = emap.get
        for bh in hashes:
            key = get(bh)
            if key is not None:
                ranked[key] = ranked.get(key, 0) | bit
                if pending:
                    spec = pending.get(key)
                    if spec is not None and spec.pop(rank, None) is not None and not spec:
                        del pending[key]

    def _drop(self, st: EndpointState, bh: BlockHash) -> None:
        key = st.emap.pop(bh)
        del st.media[bh]
        ranked = st.rank_keys
        if ranked is not None:
            r = rank_of(bh)
            m = ranked.get(key, 0)
            if not (st.rank_again and self._again_less(st, key, r)):
                m &= ~(1 << r)
            if st.rank_clearing:
                old = st.rank_clearing.get(r)
                if old is not None:           # the rank was cleared: its new entries' keys keep its bit
                    keys = old.fresh_keys
                    if bh in old.fresh:
                        old.fresh.remove(bh)
                        left = keys[key] - 1
                        if left:
                            keys[key] = left
                        else:
                            del keys[key]
                    if key in keys:
                        m |= 1 << r
            if m:
                ranked[key] = m
            else:
                ranked.pop(key, None)
        n = st.owned[key] - 1
        if n:
            st.owned[key] = n
            return
        del st.owned[key]
        mask = self._holders.get(key, 0) & ~st.bit
        if mask:
            self._holders[key] = mask
        else:
            self._holders.pop(key, None)
            if key not in self._pending:
                self._leave(key)

    @staticmethod
    def _again_less(st: EndpointState, key: int, rank: int) -> bool:
        """One of ``rank``'s engine hashes keyed ``key`` goes: whether the rank holds the key under
        another still (``rank_again``), one fewer now."""
        again = st.rank_again
        n = again.get((key, rank))
        if n is None:
            return False
        if n > 1:
            again[(key, rank)] = n - 1
        else:
            del again[(key, rank)]
        return True

    def clear(self, st: EndpointState) -> None:
        """Forget everything ``st``'s engine holds (AllBlocksCleared, a restart, a gap, an overflow),
        and what this gateway held for it speculatively, at once: ``st`` takes empty maps and a new
        slot, so no walk counts it as holding any of its old blocks and new events build on nothing.
        Its old slot's bits are taken out of the shared maps by ``drain``, a stretch at a time; the
        slot is free again after that."""
        if self._by_slot.get(st.slot) is not st:      # forgotten already: nothing of it is held
            return
        if len(st.owned) < self.clear_at_once and not st.held and st.rank_keys is None:
            self._unlink(st)            # a stretch's worth: at once, keeping its slot
            return
        self._retire(st)
        st.slot = self._slot()
        st.held = False
        self._by_slot[st.slot] = st

    def _unlink(self, st: EndpointState) -> None:
        """Clear ``st``, which holds less than a stretch of ``drain`` and nothing speculatively, at
        once: its keys lose its bit and it keeps its slot. A new slot per clear (a publisher sending
        thousands of ``AllBlocksCleared``) left it on a bit thousands of places up, every mask naming
        its blocks then as wide."""
        holders, pending, leave, keep = self._holders, self._pending, self._leave, ~st.bit
        for key in st.owned:
            mask = holders.get(key, 0) & keep
            if mask:
                holders[key] = mask
            else:
                holders.pop(key, None)
                if key not in pending:
                    leave(key)
        st.emap, st.media, st.owned = {}, {}, {}
        self._walked = (None, {})

    def _retire(self, st: EndpointState) -> None:
        """Take ``st``'s slot and maps out of routing, for ``drain`` to unlink."""
        del self._by_slot[st.slot]
        if st.rank_clearing:              # its ranks' old entries go with the rest (``drain`` passes them over)
            st.rank_clearing = {}
            self._clearing.discard(st)
        maps: list[Any] = [st.owned, st.emap, st.media]
        if st.rank_keys is not None:
            maps += [st.rank_keys, st.rank_again, st.rank_pending, st.rank_pending_q]
            st.rank_keys, st.rank_again, st.rank_pending, st.rank_pending_q = {}, {}, {}, deque()
        self._retired.append(_Retired(st.slot, iter(st.owned), maps))    # owned changes no more
        st.emap, st.media, st.owned = {}, {}, {}
        self._walked = (None, {})          # depths by slot bit: the slot may be another's soon
        if self.on_retired is None:
            while self.drain(1 << 62):
                pass
        else:
            self.on_retired()

    @property
    def retiring(self) -> int:
        """Clears (of an endpoint, or of a rank) whose old entries are not all unlinked yet (``drain``)."""
        return len(self._retired)

    def drain(self, entries: int = CLEAR_STRETCH) -> bool:
        """Unlink about ``entries`` entries of cleared endpoints from the shared maps (oldest clear
        first); whether some are left. Per cleared endpoint: its keys lose its old slot's bit (a key
        no one else holds or awaits leaves the index), ``entries`` of them a call; then its maps are
        freed, one a call (a map of 262,144 entries in 2-3 ms); then its speculative holds are
        dropped; its slot is then free. Per cleared rank (``clear_rank``): its old entries are
        dropped from its endpoint's maps, ``entries`` of the endpoint's engine hashes looked at a
        call (``_drain_rank``). The index is whole after each call."""
        q = self._retired
        holders, pending, leave = self._holders, self._pending, self._leave
        while q and entries > 0:
            r = q[0]
            if r.__class__ is _RankClear:
                entries = self._drain_rank(r, entries)     # type: ignore[arg-type]
                continue
            if r.keys is not None:
                keep = ~(1 << r.slot)
                n = 0
                for key in islice(r.keys, entries):
                    n += 1
                    mask = holders.get(key, 0) & keep
                    if mask:
                        holders[key] = mask
                    else:
                        holders.pop(key, None)
                        if key not in pending:
                            leave(key)
                if n < entries:
                    r.keys = None
                entries -= n
                continue
            if r.maps:
                r.maps.pop().clear()
                return True
            slot = r.slot
            if r.pending is None:
                r.pending = deque(e for e in self._pending_q if e[1] == slot)
            held = r.pending
            until_of = self._pending_until
            while held and entries > 0:
                until, _, keys = held.popleft()
                entries -= len(keys)
                for k in keys:
                    if until_of.get((k, slot)) == until:     # not expired, nor routed again since
                        self._unpend(k, slot)
            if held:
                continue
            q.popleft()
            heappush(self._free, slot)
        return bool(q)

    def clear_rank(self, st: EndpointState, rank: int) -> None:
        """Forget what one data-parallel rank of ``st``'s engine holds (its gap, restart or cache
        reset): its hashes are ``(rank, hash)``, rank 0's the plain hash (``kv_wire.rank_of``). What
        this gateway held for the rank speculatively (``rank_routed``) goes too, as ``clear`` drops an
        endpoint's.

        At once, without touching an entry: from now on the rank's entries are *old* until ``drain``
        drops them, a stretch at a time, and no walk counts them (``_walk``, ``rank_depths``: only
        for an endpoint with old entries left do they look further than the shared bitmasks). What
        the rank stores afterwards is new and counts as usual; an event of the rank naming an old
        entry drops it first (a remove finds nothing, a store stores anew, an old parent is none).
        A second clear of the rank meanwhile makes what it stored since old too; a clear of the
        endpoint takes its old entries with the rest. An endpoint without per-rank bitmasks
        (``KVEventsConfig.ranked`` off) has its rank's entries dropped here, in one go."""
        if self._by_slot.get(st.slot) is not st:      # forgotten already: nothing of it is held
            return
        if st.rank_keys is None:
            for bh in [bh for bh in st.emap if rank_of(bh) == rank]:
                self._drop(st, bh)
            return
        old = _RankClear(st, rank)
        st.rank_clearing[rank] = old                  # one under way for the rank is superseded
        self._clearing.add(st)
        self._retired.append(old)
        self._walked = (None, {})          # depths that counted the rank's old entries
        if self.on_retired is None:
            while self.drain(1 << 62):
                pass
        else:
            self.on_retired()

    def _drain_rank(self, old: _RankClear, entries: int) -> int:
        """``drain`` of a rank's old entries, ``entries`` of them looked at; what is left of
        ``entries``. First the endpoint's engine hashes are copied (one step of its own: a list of
        up to ``max_blocks_per_endpoint``, made in C), then each of the rank's not stored since the
        clear is dropped, from the copy's end, ``entries`` of them looked at a call; then the keys
        held for the rank speculatively are copied and its holds made before the clear dropped;
        then the rank counts its entries as before."""
        st, rank = old.st, old.rank
        if st.rank_clearing.get(rank) is not old:    # cleared again since, or the whole endpoint
            todo = old.todo
            if todo:                                 # the copy let go of a stretch at a time, as below
                n = min(entries, len(todo))
                del todo[-n:]
                return entries - n
            self._retired.popleft()
            return entries
        if old.step in (0, 2):
            old.todo = list(st.emap) if old.step == 0 else list(st.rank_pending)
            old.step += 1
            return 0
        todo = old.todo
        assert todo is not None
        # the last ``entries`` of the copy, taken out of it: what the copy alone kept alive (the
        # hashes of entries dropped) is freed a stretch at a time, with the stretch
        part = todo[-entries:]
        del todo[-entries:]
        if old.step == 1:
            emap, fresh, drop = st.emap, old.fresh, self._drop
            for bh in part:
                if bh not in fresh and rank_of(bh) == rank and bh in emap:
                    drop(st, bh)
        else:
            pending, held = st.rank_pending, old.held
            for k in part:
                spec = pending.get(k)
                if spec is not None and rank in spec and k not in held:
                    del spec[rank]
                    if not spec:
                        del pending[k]
        n = len(part)
        if not todo:
            old.todo = None
            old.step += 1
            if old.step == 4:
                del st.rank_clearing[rank]
                if not st.rank_clearing:
                    self._clearing.discard(st)
                self._retired.popleft()
        return entries - n

    def _holds(self, st: EndpointState, speculative: bool = True) -> Callable[[int], bool]:
        """Whether ``st`` holds a key (or, with ``speculative``, holds it speculatively), for an
        endpoint with a rank's old entries left: its slot's bit in the shared map counts only when
        a rank not cleared, or a cleared one's new entries, hold the key."""
        holders, pending, bit, ranked = self._holders, self._pending, st.bit, st.rank_keys
        assert ranked is not None
        keep = ~sum(1 << r for r in st.rank_clearing)
        fresh = [old.fresh_keys for old in st.rank_clearing.values()]

        def holds(key: int) -> bool:
            if speculative and pending.get(key, 0) & bit:
                return True
            if not holders.get(key, 0) & bit:
                return False
            return bool(ranked.get(key, 0) & keep) or any(key in f for f in fresh)

        return holds

    def _rank_mask(self, st: EndpointState) -> Callable[[int, int], int]:
        """``st.rank_keys.get`` for an endpoint with a rank's old entries left: a cleared rank's bit
        stands only for its new entries."""
        ranked = st.rank_keys
        assert ranked is not None
        keep = ~sum(1 << r for r in st.rank_clearing)
        fresh = [(1 << r, old.fresh_keys) for r, old in st.rank_clearing.items()]

        def get(key: int, default: int = 0) -> int:
            m = ranked.get(key, default) & keep
            for b, keys in fresh:
                if key in keys:
                    m |= b
            return m

        return get

    # -- routing -----------------------------------------------------------------------------------

    def _live(self, st: EndpointState, now: float) -> bool:
        if st.on_fallback is not None:
            return False
        if st.expect_since is not None and now - st.expect_since > st.settings.stall_timeout_s:
            st.on_fallback = "stalled"
            self._on_fallback(st.ep.model, st.ep.name, "stalled")
            return False
        return True

    def match(self, req: InferenceRequest, candidates: Sequence[Endpoint]
              ) -> tuple[dict[Endpoint, int], int, list[Endpoint]] | None:
        """Cached tokens per candidate with live events, the prompt's token count, and the candidates
        on the fallback; ``None`` when the request cannot be tokenized (all on the fallback)."""
        now = self.clock()
        self._expire(now)
        live: list[EndpointState] = []
        fallback: list[Endpoint] = []
        for ep in candidates:
            st = self.states.get(ep)
            if st is not None and self._live(st, now) and st.block_size:
                live.append(st)
            else:
                fallback.append(ep)
                if st is not None and st.on_fallback == "no_events" and not st.stats.get("counted_no_events"):
                    st.stats["counted_no_events"] = 1
                    self._on_fallback(ep.model, ep.name, "no_events")
        if not live:
            return {}, 0, fallback
        bs = live[0].block_size or 16
        keyed = self._keys(req, candidates[0].model, bs)
        if keyed is None:
            return None
        keys, tokens = keyed
        depths: dict[Endpoint, int] = {}
        same = [st for st in live if st.block_size == bs]
        for st in live:
            if st.block_size != bs:             # a fleet with mixed block sizes: that endpoint alone
                other = self._keys(req, candidates[0].model, st.block_size or bs)
                if other is not None:
                    d = self._walk(other[0], other[1], [st])
                    depths.update(d)
        depths.update(self._walk(keys, tokens, same))
        return depths, tokens, fallback

    def _keys(self, req: InferenceRequest, model: str, bs: int) -> tuple[list[int], int] | None:
        memo = self._memo
        if memo[0] is req and memo[1] == bs:
            return memo[2], memo[3]
        tok = self.tokenizers.get(model)
        if tok is None:
            return None
        root = request_root(req, model, bs)
        if root is None:              # multimodal: route on the approximate index
            self._on_fallback(model, "", "multimodal")
            return None
        if req.path == RESPONSES:     # its input is the engine's to render (items, instructions): not keyed
            self._on_fallback(model, "", "responses")
            return None
        try:
            k = self.request_keys(req, tok, model, root, bs)
        except Exception:             # a template error, an odd body: route on the approximate index
            self._on_fallback(model, "", "tokenize_error")
            return None
        assert not isinstance(k, int)
        return k.keys, k.tokens

    def request_keys(self, req: InferenceRequest, tok: ModelTokenizer, model: str, root: int, bs: int,
                     defer_chars: int | None = None) -> Keys | int:
        """``tok.block_keys`` of the request: segments nobody's cache reaches are not tokenized
        (unless the model's ``tokenize_unreached``); with ``defer_chars``, the index of a segment to
        tokenize off the loop first (``KVEventsManager.prepare``)."""
        segments, lead = self.segments(req, tok)
        st = self.settings(model)
        reach = None if st is not None and st.tokenize_unreached else self._reaches
        k = tok.block_keys(segments, lead, root, bs,
                           st.max_request_blocks if st is not None else 1 << 20, reach,
                           defer_chars=defer_chars, extends=None if reach is None else self._children.__contains__,
                           held=self._reaches)
        if isinstance(k, Keys):
            self._memo = (req, bs, k.keys, k.tokens, root)
            if not k.exact:
                self.unreached[model] = self.unreached.get(model, 0) + 1
                if segments is not None and k.rest >= 0:
                    self._left = (req, segments[k.rest:])
        return k

    def left(self, req: InferenceRequest) -> list[str]:
        """The segments of ``req`` its keys stopped before (no engine's cache reached them), if it
        was the last request keyed."""
        left = self._left
        return left[1] if left[0] is req else []

    def _reaches(self, key: int) -> bool:
        """Some endpoint holds the block ``key``, or is about to (speculatively)."""
        return key in self._holders or key in self._pending

    def block_size(self, candidates: Sequence[Endpoint]) -> int | None:
        """The block size ``match`` keys the candidates' requests at (that of the first live one)."""
        for ep in candidates:
            st = self.states.get(ep)
            if st is not None and st.block_size and st.on_fallback is None:
                return st.block_size
        return None

    def segments(self, req: InferenceRequest, tok: ModelTokenizer) -> tuple[list[str] | None, list[int]]:
        """``tok.request_segments`` of the request, rendered once for ``prepare`` and ``match``."""
        r = self._rendered
        if r[0] is req:
            return r[1], r[2]
        segments, lead = tok.request_segments(req.path, req.data)
        self._rendered = (req, segments, lead)
        return segments, lead

    def rendered(self, req: InferenceRequest, segments: list[str] | None, lead: list[int]) -> None:
        self._rendered = (req, segments, lead)

    def _walk(self, keys: list[int], tokens: int, states: list[EndpointState]) -> dict[Endpoint, int]:
        """Cached tokens per endpoint of ``states``: how many leading keys each holds, or holds
        speculatively. One pass: the holder masks of a chunk of keys are looked up and AND-ed
        cumulatively in C (``map``, ``accumulate``); an endpoint's depth is where its bit first drops
        out, found by bisection (a cumulative AND only loses bits). An endpoint that drops out at a
        key it holds speculatively walks on alone. Stops when no endpoint is left."""
        if not states:
            return {}
        bs = states[0].block_size or 1
        cap = min(len(keys), max(0, tokens - 1) // bs)    # the engine always computes the last token
        apart = None
        if self._clearing:              # an endpoint with a rank's old entries left: walked apart
            apart = [st for st in states if st.rank_clearing]
            if apart:
                states = [st for st in states if not st.rank_clearing]
        alive = 0
        for st in states:
            alive |= st.bit
        blocks: dict[int, int] = {}       # slot bit -> depth in blocks
        holders, pending = self._holders, self._pending
        get = holders.get
        i = 0
        while i < cap and alive:
            end = min(cap, i + _WALK_CHUNK)
            acc = list(accumulate(map(get, keys[i:end], repeat(0, end - i)), and_, initial=alive))
            last = acc[-1]
            gone = alive & ~last
            while gone:
                low = gone & -gone
                # acc[j]: the endpoints holding keys up to i+j-1
                d = i + bisect_left(acc, True, key=lambda m, b=low: not m & b) - 1
                if pending:
                    while d < cap and (get(keys[d], 0) | pending.get(keys[d], 0)) & low:
                        d += 1
                blocks[low] = d
                gone ^= low
            alive = last
            i = end
        while alive:
            low = alive & -alive
            blocks[low] = i
            alive ^= low
        if apart:
            for st in apart:
                holds = self._holds(st)
                d = 0
                while d < cap and holds(keys[d]):
                    d += 1
                blocks[st.bit] = d
        self._walked = (keys, blocks)
        by_slot = self._by_slot
        return {by_slot[b.bit_length() - 1].ep: n * bs for b, n in blocks.items()}

    def routed(self, req: InferenceRequest, ep: Endpoint) -> None:
        """``req`` went to ``ep``: hold its new blocks there speculatively, and expect events."""
        st = self.states.get(ep)
        if st is None or not st.block_size:
            return
        memo = self._memo
        if memo[0] is not req or memo[1] != st.block_size:
            return
        keys, bs = memo[2], st.block_size
        cap = min(len(keys), max(0, memo[3] - 1) // bs)
        bit = st.bit
        walked = self._walked
        first_new = walked[1].get(bit) if walked[0] is keys else None
        if first_new is None:         # not walked on this endpoint (e.g. chosen off the fallback)
            holders = self._holders
            first_new = 0
            if st.rank_clearing:      # a rank's old entries left: held only as ``_holds`` tells
                holds = self._holds(st, speculative=False)
                while first_new < cap and holds(keys[first_new]):
                    first_new += 1
            else:
                while first_new < cap and holders.get(keys[first_new], 0) & bit:
                    first_new += 1
        new = keys[first_new:cap]
        if not new:
            return
        now = self.clock()
        if st.expect_since is None:
            st.expect_since = now
        ttl = st.settings.speculative_ttl_s
        if ttl <= 0:
            return
        until = now + ttl
        pending, pend_until, slot, holders = self._pending, self._pending_until, st.slot, self._holders
        parent = keys[first_new - 1] if first_new else memo[4]
        for k in new:
            m = pending.get(k, 0)
            if not m and k not in holders:
                self._enter(k, parent)
            pending[k] = m | bit
            pend_until[(k, slot)] = until
            parent = k
        self._pending_q.append((until, slot, new))
        st.held = True

    def rank_depths(self, req: InferenceRequest, ep: Endpoint) -> list[int] | None:
        """Cached tokens of ``req`` on each data-parallel rank of ``ep``, from the keys ``match``
        computed for it; ``None`` when the gateway does not pick ``ep``'s ranks, its events are not
        live, or the request was not keyed at its block size. One walk down the keys with a bitmask
        of the ranks still holding every block so far; it stops when no rank is left."""
        st = self.states.get(ep)
        if st is None or st.rank_keys is None or st.on_fallback is not None or not st.block_size:
            return None
        memo = self._memo
        if memo[0] is not req or memo[1] != st.block_size:
            return None
        keys, bs = memo[2], st.block_size
        cap = min(len(keys), max(0, memo[3] - 1) // bs)
        depths = [0] * st.ranks
        alive = (1 << st.ranks) - 1
        get = st.rank_keys.get
        cleared = st.rank_clearing         # ranks whose old entries (and holds) are left: not counted
        if cleared:
            get = self._rank_mask(st)
        pending = st.rank_pending
        if pending:
            now = self.clock()
            self._expire_ranks(st, now)
        i = 0
        while i < cap and alive:
            held = alive & get(keys[i], 0)
            if pending and held != alive:
                spec = pending.get(keys[i])
                if spec:
                    for r, until in spec.items():
                        if until > now and not (cleared and r in cleared and keys[i] not in cleared[r].held):
                            held |= alive & (1 << r)
            gone = alive & ~held
            while gone:
                low = gone & -gone
                depths[low.bit_length() - 1] = i * bs
                gone ^= low
            alive = held
            i += 1
        while alive:
            low = alive & -alive
            depths[low.bit_length() - 1] = i * bs
            alive ^= low
        return depths

    def rank_routed(self, req: InferenceRequest, ep: Endpoint, rank: int, depth: int) -> None:
        """``req`` was pinned to ``rank`` of ``ep``, whose match there was ``depth`` tokens: hold its
        blocks past that on the rank speculatively (``speculative_ttl_s``), as ``routed`` does per
        endpoint, so the next request on the same new prefix follows it to that rank."""
        st = self.states.get(ep)
        if st is None or st.rank_keys is None or not st.block_size:
            return
        ttl = st.settings.speculative_ttl_s
        memo = self._memo
        if ttl <= 0 or memo[0] is not req or memo[1] != st.block_size:
            return
        keys, bs = memo[2], st.block_size
        cap = min(len(keys), max(0, memo[3] - 1) // bs)
        now = self.clock()
        until = now + ttl
        pending, q = st.rank_pending, st.rank_pending_q
        old = st.rank_clearing.get(rank) if st.rank_clearing else None
        if old is not None:           # held since the rank's clear: ``drain`` leaves them
            old.held.update(keys[depth // bs:cap])
        for k in keys[depth // bs:cap]:
            spec = pending.get(k)
            if spec is None:
                pending[k] = {rank: until}
            else:
                spec[rank] = until
            q.append((until, k))

    def _expire_ranks(self, st: EndpointState, now: float) -> None:
        q, pending = st.rank_pending_q, st.rank_pending
        while q and q[0][0] <= now:
            _, k = q.popleft()
            spec = pending.get(k)
            if spec is not None:
                for r in [r for r, until in spec.items() if until <= now]:
                    del spec[r]
                if not spec:
                    del pending[k]

    def _expire(self, now: float) -> None:
        q = self._pending_q
        if not q or q[0][0] > now:
            return
        pending, pend_until, holders = self._pending, self._pending_until, self._holders
        while q and q[0][0] <= now:
            until, slot, keys = q.popleft()
            others = ~(1 << slot)
            for k in keys:                    # _unpend, inline: unless routed again since
                if pend_until.get((k, slot)) == until:
                    del pend_until[(k, slot)]
                    mask = pending.get(k, 0) & others
                    if mask:
                        pending[k] = mask
                    else:
                        pending.pop(k, None)
                        if k not in holders:
                            self._leave(k)

    def _unpend(self, key: int, slot: int) -> None:
        self._pending_until.pop((key, slot), None)
        mask = self._pending.get(key, 0) & ~(1 << slot)
        if mask:
            self._pending[key] = mask
        elif self._pending.pop(key, None) is not None and key not in self._holders:
            self._leave(key)

    def _enter(self, key: int, parent: int) -> None:
        """``key``, chained on ``parent``, is now held or pending somewhere (it was neither)."""
        self._parent_of[key] = parent
        self._children[parent] = self._children.get(parent, 0) + 1

    def _leave(self, key: int) -> None:
        """``key`` is neither held nor pending anywhere any more."""
        parent = self._parent_of.pop(key, None)
        if parent is not None:
            n = self._children[parent] - 1
            if n:
                self._children[parent] = n
            else:
                del self._children[parent]

    def snapshot(self) -> list[dict[str, Any]]:
        now = self.clock()
        return [{"model": s.ep.model, "endpoint": s.ep.name, "blocks": len(s.emap), "block_size": s.block_size,
                 "live": self._live(s, now), "fallback_reason": s.on_fallback,
                 "last_event_age_s": None if s.last_event is None else round(now - s.last_event, 3)}
                for s in self.states.values()]
