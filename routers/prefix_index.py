"""The prefix index: which endpoint was last sent which prompt prefix (``PrefixIndex``).

Engines (vLLM's automatic prefix caching, SGLang's radix cache) skip the prefill of a prompt's
leading tokens they computed before. The gateway cannot see their caches, so it keeps an index of
what it sent where: the prompt text the engine will prefill (chat messages in order, or the
completion prompt — ``InferenceRequest.prompt_text``) is cut into fixed-size character blocks,
each block's key is a hash chained over all blocks before it (so a key names a whole prefix), and
the index maps key → {endpoint: last time a request with that prefix went there}.

One index per gateway lives in ``RouterContext.prefix_index``: the ``prefix-cache`` strategy routes
by it and the ``pd`` strategy uses it for its prefill choice. This module imports nothing of
``routers`` (the context builds the index), so the context can hold it without an import circle.

* One bounded LRU over all models; the chain is seeded with the model name (and a request's LoRA
  adapter and ``cache_salt``), so models never share keys (what vLLM does with its root hash). ``prefix_index_blocks`` bounds the number of
  keys; ``prefix_idle_ttl_s`` forgets keys and endpoint entries no request touched for that long.
* Hash: XXH3-64 (``xxhash``) of each block's UTF-8 bytes, seeded with the previous block's key, so
  a key names the whole prefix; the first block is seeded with the hash of the model name. It is
  deterministic: every worker and every replica computes the same keys for the same prompt, so the
  shared routing view (``gateway.view``) can carry keys between processes. It costs less than
  Python's per-process SipHash of ``str`` slices, which it replaced (≈0.14 ms against ≈0.2 ms for
  512 KB of text, a 128k-token prompt). The chain of the last request is memoised, so a weighted
  list or the P/D strategy asking twice hashes once.
* Sharing: ``on_insert`` (set by the gateway) is told of every insertion's keys and endpoint;
  ``apply_insert`` records another process's insertion without telling ``on_insert`` again.
* Insertion touches a prompt's blocks deepest-first, so a prefix is always at least as recent as
  anything that extends it. LRU and idle eviction then always drop the deep end of a chain first,
  the index stays *prefix-closed* (if block *i* is held by an endpoint, so are blocks 0..i), and an
  endpoint's match depth is found by binary search: O(log n) lookups per endpoint, not O(n).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import orjson
from xxhash import xxh3_64_intdigest

from gateway.endpoints import Endpoint
from gateway.request import InferenceRequest

# A block's holders: one endpoint packed into an int, ``(last_touch_ms << _SLOT_BITS) | slot``, or a
# dict {slot: last_touch_ms} when several endpoints hold it. Both are plain ints inside, so the
# garbage collector never tracks them: a full index costs a collection nothing, and one holder
# (the common case) costs an int rather than a dict.
_SLOT_BITS = 24
_SLOT_MASK = (1 << _SLOT_BITS) - 1
_NEVER = -(1 << 62)          # "no entry" when comparing against a (possibly negative) cutoff
# a block's holder dict is pruned of idle entries when it reaches this size
_PRUNE_AT = 8
# endpoints remembered before the slots of those no block mentions are released
_SLOT_COMPACT_AT = 1024
# idle sweeps run at most this often (seconds)
_SWEEP_EVERY_S = 1.0
# the seed of a chain's root (the model name's hash): keys of this index apart from other XXH3 uses
_ROOT_SEED = 0x5357_4954_4348_5944     # "SWITCHYD"

# told of each insertion: (keys, endpoint) — the shared view publishes it to the other processes
InsertListener = Callable[[list[int], Endpoint], None]


class IndexSettings(Protocol):
    """The knobs the index reads (``routers.base.RoutingSettings`` has them)."""

    @property
    def prefix_block_chars(self) -> int: ...
    @property
    def prefix_max_blocks(self) -> int: ...
    @property
    def prefix_index_blocks(self) -> int: ...
    @property
    def prefix_idle_ttl_s(self) -> float: ...


def prefix_keys(text: str, model: str, block_chars: int, max_blocks: int) -> list[int]:
    """Chained keys of the full ``block_chars`` blocks of ``text`` (at most ``max_blocks``).

    ``key[i]`` depends on the model and on every character of blocks 0..i; a trailing partial
    block is not keyed (as engines only cache full blocks). Keys are unsigned 64-bit ints, the same
    in every process. Only the keyed characters are read and encoded, whatever the prompt's length.
    """
    n = min(len(text) // block_chars, max_blocks)
    h = xxh3_64_intdigest(model.encode(), _ROOT_SEED)
    keys = [0] * n
    b = block_chars
    xxh = xxh3_64_intdigest
    if len(text) > n * b:           # only what is hashed is read and encoded (a prompt may be 16 MB)
        text = text[:n * b]         # blocks are characters: the cut is too, so the keys do not change
    if text.isascii():              # one encoding, then zero-copy block views
        view = memoryview(text.encode())
        for i in range(n):
            start = i * b
            h = xxh(view[start:start + b], h)
            keys[i] = h
        return keys
    for i in range(n):
        start = i * b
        h = xxh(text[start:start + b].encode(), h)
        keys[i] = h
    return keys


def tools_text(tools: object) -> str:
    """The text a request's ``tools`` are keyed as, before its messages: the engine renders them
    into the prompt it prefills, at its head in the usual chat templates (a system prompt's part),
    so the same messages under other tools are another prefix, and the turns of an agent that
    offers the same tools share their blocks. Their JSON with sorted keys (clients' field orders
    differ); empty when the encoder cannot write them (nested past its limit)."""
    try:
        return orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode() + "\n"
    except TypeError:       # orjson.JSONEncodeError
        return ""


def _newest(held: int | dict[int, int]) -> int:
    return held >> _SLOT_BITS if held.__class__ is int else max(held.values())


class PrefixIndex:
    """Bounded LRU index: prefix-block key → the endpoints holding it, with their last touch."""

    def __init__(self, settings: IndexSettings, clock: Callable[[], float] | None = None) -> None:
        s = settings
        if s.prefix_block_chars < 1:
            raise ValueError("routing.prefix_block_chars must be >= 1")
        self.block_chars = s.prefix_block_chars
        self.max_blocks = s.prefix_max_blocks
        self.capacity = max(1, s.prefix_index_blocks)
        self.idle_ttl_ms = int(s.prefix_idle_ttl_s * 1000)
        self.clock = clock or time.monotonic
        self._blocks: OrderedDict[int, int | dict[int, int]] = OrderedDict()
        self._slots: dict[Endpoint, int] = {}     # endpoint → small int used inside the index
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._slot_limit = _SLOT_COMPACT_AT
        self._memo_req: InferenceRequest | None = None
        self._memo_keys: list[int] = []
        self._next_sweep = 0
        self.evictions = 0
        self.on_insert: InsertListener | None = None
        # endpoint → when (ms) its entries were dropped (``forget``): a sibling's entry merged later
        # (``merge``) that is older is not taken; kept while such an entry could still be live
        self._cleared: dict[Endpoint, int] = {}

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    def _slot(self, ep: Endpoint) -> int:
        slot = self._slots.get(ep)
        if slot is None:
            if len(self._slots) >= self._slot_limit:
                self._compact_slots()
            if self._free_slots:
                slot = self._free_slots.pop()
            else:
                slot = self._next_slot & _SLOT_MASK
                self._next_slot += 1
            self._slots[ep] = slot
        return slot

    def _compact_slots(self) -> None:
        """Release the slots of endpoints no block mentions any more (endpoints come and go with
        Kubernetes pods; the index must not keep every one it ever saw). Rare: O(index size)."""
        used: set[int] = set()
        for held in self._blocks.values():
            if held.__class__ is int:
                used.add(held & _SLOT_MASK)
            else:
                used.update(held)
        for ep, slot in list(self._slots.items()):
            if slot not in used:
                del self._slots[ep]
                self._free_slots.append(slot)
        self._slot_limit = max(_SLOT_COMPACT_AT, 2 * len(self._slots))

    # -- keys ------------------------------------------------------------------------------------

    def keys(self, req: InferenceRequest) -> list[int]:
        """The request's chain, computed once per request object."""
        if req is self._memo_req:
            return self._memo_keys
        # an adapter's prompts are keyed apart from its base model's, and a cache_salt's from other
        # salts' and unsalted ones (vLLM folds it into the first block's hash): the engine caches them apart
        seed = req.model if req.lora is None else f"{req.model}\0lora:{req.lora}"
        salt = req.data.get("cache_salt")
        if salt.__class__ is str and salt:
            seed = f"{seed}\0salt:{salt}"
        tools = req.data.get("tools")
        # behind the tools, only what can be hashed of the prompt is copied (it may be 16 MB)
        text = req.prompt_text if not tools else tools_text(tools) + req.prompt_text[:self.block_chars * self.max_blocks]
        keys = prefix_keys(text, seed, self.block_chars, self.max_blocks)
        self._memo_req, self._memo_keys = req, keys
        return keys

    # -- lookup ----------------------------------------------------------------------------------

    def depths(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> tuple[dict[Endpoint, int], int]:
        """``({endpoint: matched blocks}, blocks in the prompt)`` for candidates that match at all."""
        keys = self.keys(req)
        n = len(keys)
        if n == 0:
            return {}, 0
        blocks = self._blocks
        root = blocks.get(keys[0])
        if root is None:
            return {}, n
        cut = self._now_ms() - self.idle_ttl_ms
        slots = self._slots
        holders: list[tuple[Endpoint, int]] = []
        if root.__class__ is int:
            if (root >> _SLOT_BITS) >= cut:
                only = root & _SLOT_MASK
                holders = [(ep, only) for ep in candidates if slots.get(ep) == only]
        else:
            for ep in candidates:
                slot = slots.get(ep)
                if slot is not None and root.get(slot, _NEVER) >= cut:
                    holders.append((ep, slot))
        if not holders:
            return {}, n
        # the deepest block anyone holds bounds every endpoint's search (the index is prefix-closed)
        lo, hi = 0, n - 1
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if keys[mid] in blocks:
                lo = mid
            else:
                hi = mid - 1
        top = lo
        get = blocks.get
        out: dict[Endpoint, int] = {}
        for ep, slot in holders:
            lo, hi = 0, top
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                held = get(keys[mid])
                if held is not None and (
                        ((held & _SLOT_MASK) == slot and (held >> _SLOT_BITS) >= cut) if held.__class__ is int
                        else held.get(slot, _NEVER) >= cut):
                    lo = mid
                else:
                    hi = mid - 1
            out[ep] = lo + 1
        return out, n

    def match(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> dict[Endpoint, float]:
        """Every candidate's match percentage 0..100 (the ``pd`` strategy's prefill signal)."""
        depths, n = self.depths(req, candidates)
        if not depths:
            return dict.fromkeys(candidates, 0.0)
        scale = 100.0 / n
        get = depths.get
        return {ep: get(ep, 0) * scale for ep in candidates}

    # -- update ----------------------------------------------------------------------------------

    def insert(self, req: InferenceRequest, ep: Endpoint) -> None:
        """Record that ``ep`` holds every block of ``req``'s prompt (``prefix-cache`` after its choice,
        ``pd`` for its prefill); ``on_insert`` is told."""
        keys = self.keys(req)
        if not keys:
            return
        self._insert(keys, ep)
        if self.on_insert is not None:
            self.on_insert(keys, ep)

    def apply_insert(self, keys: Sequence[int], ep: Endpoint) -> None:
        """Record another process's insertion (its chain of keys, as ``prefix_keys`` makes them) as
        if made now; ``on_insert`` is not told (a fact is published once, by its maker)."""
        if keys:
            self._insert(keys, ep)

    def _insert(self, keys: Sequence[int], ep: Endpoint) -> None:
        now = self._now_ms()
        slot = self._slot(ep)
        packed = (now << _SLOT_BITS) | slot
        cut = now - self.idle_ttl_ms
        blocks = self._blocks
        get = blocks.get
        touch = blocks.move_to_end
        for k in reversed(keys):                 # deepest first: a prefix is never older than its extensions
            held = get(k)
            if held is None:
                blocks[k] = packed
                continue
            touch(k)
            if held.__class__ is int:
                if (held & _SLOT_MASK) == slot or (held >> _SLOT_BITS) < cut:
                    blocks[k] = packed
                else:
                    blocks[k] = {held & _SLOT_MASK: held >> _SLOT_BITS, slot: now}
            else:
                if len(held) >= _PRUNE_AT and slot not in held:
                    for s in [s for s, t in held.items() if t < cut]:
                        del held[s]
                held[slot] = now
        if len(blocks) > self.capacity:
            self._evict_over()
        if now >= self._next_sweep:
            self._next_sweep = now + int(_SWEEP_EVERY_S * 1000)
            self.sweep(now / 1000)

    def block_keys(self) -> list[int]:
        """The blocks' keys as they are now, a copy (one list of ints: nothing new for the collector
        to track), for ``export`` to read in parts while the index goes on changing."""
        return list(self._blocks)

    def slots(self) -> dict[int, Endpoint]:
        """The index's endpoints by slot."""
        return {slot: ep for ep, slot in self._slots.items()}

    def export(self, keys: list[int] | None = None) -> tuple[dict[int, Endpoint], list[list[int]]]:
        """The index as a sibling catching up merges it (``merge``): its endpoints by slot, and every
        live block (of ``keys``, a part of what ``block_keys()`` gave, those still here; or of the
        whole index), least recently touched first, as ``[key, slot, at_ms, slot, at_ms, ...]`` (the
        times on the index's clock). O(size)."""
        cut = self._now_ms() - self.idle_ttl_ms
        rows = []
        add = rows.append
        bits, mask = _SLOT_BITS, _SLOT_MASK
        blocks = self._blocks
        pairs = blocks.items() if keys is None else ((k, blocks.get(k)) for k in keys)
        for k, held in pairs:
            if held is None:                 # gone since the keys were taken
                continue
            if held.__class__ is int:
                if held >> bits >= cut:
                    add([k, held & mask, held >> bits])
            else:
                row = [k]
                for slot, at in held.items():
                    if at >= cut:
                        row += (slot, at)
                if len(row) > 1:
                    add(row)
        return self.slots(), rows

    def merge(self, rows: Sequence[Sequence[int]], endpoints: dict[int, Endpoint]) -> int:
        """Another process's blocks as ``export`` gave them, its slots named by ``endpoints`` (a slot
        not there is skipped): each holder's touch kept unless this index knows a later one.
        ``on_insert`` is not told. Returns the block-endpoint entries merged."""
        cut = self._now_ms() - self.idle_ttl_ms
        # an endpoint that left the pool while the parts came is not taken back (``drop``)
        mine = {theirs: self._slot(ep) for theirs, ep in endpoints.items() if not ep.removed}
        cleared = self._cleared
        floors = {theirs: cleared[ep] for theirs, ep in endpoints.items() if ep in cleared} if cleared else None
        blocks = self._blocks
        get = blocks.get
        bits, mask = _SLOT_BITS, _SLOT_MASK
        n = 0
        for row in rows:
            key = row[0]
            for j in range(1, len(row) - 1, 2):
                slot, at = mine.get(row[j]), row[j + 1]
                if slot is None or at < cut or (floors and at < floors.get(row[j], _NEVER)):
                    continue
                n += 1
                held = get(key)
                if held is None:
                    blocks[key] = (at << bits) | slot
                elif held.__class__ is int:
                    if (held & mask) == slot or (held >> bits) < cut:
                        if (held & mask) != slot or (held >> bits) < at:
                            blocks[key] = (at << bits) | slot
                    else:
                        blocks[key] = {held & mask: held >> bits, slot: at}
                elif held.get(slot, _NEVER) < at:
                    held[slot] = at
        if len(blocks) > self.capacity:
            self._evict_over()
        return n

    def _evict_over(self) -> None:
        """Blocks past the capacity go, least recently touched first."""
        blocks = self._blocks
        over = len(blocks) - self.capacity
        if over > 0:
            self.evictions += over
            pop = blocks.popitem
            for _ in range(over):
                pop(last=False)

    def sweep(self, now: float | None = None) -> int:
        """Drop blocks idle for longer than the TTL (oldest first); returns how many."""
        now_ms = self._now_ms() if now is None else int(now * 1000)
        cut = now_ms - self.idle_ttl_ms
        blocks = self._blocks
        dropped = 0
        while blocks:
            k = next(iter(blocks))
            if _newest(blocks[k]) >= cut:
                break
            del blocks[k]
            dropped += 1
        self.evictions += dropped
        if self._cleared:
            for ep in [ep for ep, at in self._cleared.items() if at < cut]:
                del self._cleared[ep]
        return dropped

    def forget(self, ep: Endpoint) -> None:
        """Remove an endpoint from every block (its engine restarted and lost its cache); what a
        sibling's whole view brings of it from before now is not taken (``merge``). O(size)."""
        self._cleared[ep] = self._now_ms()
        slot = self._slots.get(ep)
        if slot is None:
            return
        blocks = self._blocks
        for k in list(blocks):
            held = blocks[k]
            if held.__class__ is int:
                if (held & _SLOT_MASK) == slot:
                    del blocks[k]
            elif slot in held:
                del held[slot]
                if not held:
                    del blocks[k]

    def drop(self, eps: Iterable[Endpoint]) -> int:
        """Remove endpoints that left the pool for good from every block, and their slots: nothing
        here holds them any more (they are not ``forget``'s restarted engines, still routed to, so
        nothing is kept to refuse a sibling's older entries of them: ``merge`` takes none of an
        endpoint that left). One walk for all of them, O(size). Returns the entries removed."""
        slots = set()
        for ep in eps:
            self._cleared.pop(ep, None)
            slot = self._slots.pop(ep, None)
            if slot is not None:
                slots.add(slot)
        if not slots:
            return 0
        blocks = self._blocks
        mask = _SLOT_MASK
        gone = [k for k, held in blocks.items()
                if (held & mask in slots if held.__class__ is int else not slots.isdisjoint(held))]
        n = 0
        for k in gone:
            held = blocks[k]
            if held.__class__ is int:
                del blocks[k]
                n += 1
                continue
            for slot in slots.intersection(held):
                del held[slot]
                n += 1
            if not held:
                del blocks[k]
        self._free_slots.extend(slots)
        return n

    def rebind(self, old: Endpoint, new: Endpoint) -> None:
        """``old``'s entries are ``new``'s (a reload declared ``old``'s engine again with other
        settings, and it still holds its cache); nothing when ``new`` has entries of its own. O(1)."""
        if new in self._slots or old not in self._slots:
            return
        self._slots[new] = self._slots.pop(old)
        if old in self._cleared:
            self._cleared[new] = self._cleared.pop(old)

    # -- introspection ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._blocks)

    def holders(self, req: InferenceRequest) -> int:
        """How many endpoints hold the request's first block (for tests and debugging)."""
        keys = self.keys(req)
        held = self._blocks.get(keys[0]) if keys else None
        if held is None:
            return 0
        return 1 if held.__class__ is int else len(held)

    def stats(self) -> dict[str, int]:
        """Size for metrics: blocks, capacity, block-endpoint entries, evictions so far.
        ``entries`` walks the index (O(size)): call it at scrape time, not per request."""
        return {"blocks": len(self._blocks), "capacity": self.capacity,
                "entries": sum(1 if h.__class__ is int else len(h) for h in self._blocks.values()),
                "evictions": self.evictions}


