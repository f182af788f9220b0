"""A bounded KV block pool with automatic prefix caching, in the manner of vLLM.

Why it exists: prefix-aware routing only pays off if an engine that has seen a prefix answers it
faster. So the simulator keeps a real, bounded pool of blocks:

- a prompt is cut into full blocks; each full block has a chained hash (parent hash + the block's
  token ids), and the root of the chain carries the model/LoRA and ``cache_salt``; KV events name
  them per block in ``extra_keys`` as vLLM does (the LoRA's name on every block, the salt on the
  first; see ``BlockPool.extra_keys``);
- a new request reuses the longest run of leading blocks whose hashes are cached, capped at
  ``prompt_len - 1`` tokens rounded down to whole blocks (the last prompt token is always computed);
- blocks referenced by a live request are never evicted; freed blocks keep their hash and go to an
  LRU free list, evicted (hash dropped) only when a new allocation needs the space;
- when the pool cannot hold a request, allocation fails and the scheduler leaves it waiting.

SGLang's radix cache is token-granular; it is approximated by the same machinery with block size 1.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from enginesim.tokenizer import ids_bytes


@dataclass(eq=False)
class Allocation:
    """The blocks one request holds. ``hit_blocks`` leading blocks came from the prefix cache."""

    hashes: list[bytes]
    block_ids: list[int] = field(default_factory=list)
    hit_blocks: int = 0
    committed: bool = False
    extended: bool = False               # generated blocks cached too (``BlockPool.extend``)
    token_ids: Sequence[int] = ()        # the prompt, for KV events
    lora_name: str | None = None
    cache_salt: str | None = None


def root_key(*parts: str) -> bytes:
    """Root of a hash chain: everything besides token ids that must match for a cache hit."""
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=16).digest()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # per block: the requests holding it and its prefix hash (None: holds nothing reusable); two
        # lists, not an object per block, so a pool is two objects to the garbage collector
        self._ref: list[int] = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        # ref == 0 blocks, eviction order first; value unused.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.events: Any = None              # a KVEventPublisher (enginesim.kv_events), when publishing
        self.extra_keys = False              # BlockStored names each block's extra hash keys (vLLM)

    # -- hashing and lookup -------------------------------------------------------------------

    def block_hashes(self, token_ids: Sequence[int], root: bytes) -> list[bytes]:
        """Chained hashes of the full blocks of ``token_ids``."""
        out: list[bytes] = []
        parent = root
        step = self.block_size * 8                     # the prompt's bytes once, cut per block
        data = ids_bytes(token_ids)
        blake2b = hashlib.blake2b
        for off in range(0, (len(token_ids) // self.block_size) * step, step):
            h = blake2b(parent, digest_size=16)
            h.update(data[off:off + step])
            parent = h.digest()
            out.append(parent)
        return out

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match(self, hashes: Sequence[bytes], prompt_len: int) -> int:
        """Number of leading blocks a prompt would get from the cache."""
        if not self.enable_caching or prompt_len <= 1:
            return 0
        limit = min(len(hashes), (prompt_len - 1) // self.block_size)
        hit = 0
        while hit < limit and hashes[hit] in self._cached:
            hit += 1
        return hit

    # -- allocation ---------------------------------------------------------------------------

    def allocate(self, hashes: list[bytes], num_tokens: int) -> Allocation | None:
        """Blocks for a prompt of ``num_tokens``, reusing cached ones; ``None`` if it cannot fit."""
        hit = self.match(hashes, num_tokens)
        hit_ids = [self._cached[h] for h in hashes[:hit]]
        fresh = self.blocks_for(num_tokens) - hit
        reusable_free = sum(1 for b in hit_ids if self._ref[b] == 0)
        if fresh > len(self._free) - reusable_free:
            return None
        alloc = Allocation(hashes=hashes, hit_blocks=hit)
        for b in hit_ids:
            self._take(b)
            alloc.block_ids.append(b)
        for _ in range(fresh):
            alloc.block_ids.append(self._take_fresh())
        return alloc

    def grow(self, alloc: Allocation, num_tokens: int) -> bool:
        """Best-effort extra blocks as decode proceeds; ``False`` when the pool is full."""
        while len(alloc.block_ids) < self.blocks_for(num_tokens):
            if not self._free:
                return False
            alloc.block_ids.append(self._take_fresh())
        return True

    def commit(self, alloc: Allocation) -> None:
        """After prefill, publish the request's freshly computed full prompt blocks to the cache."""
        if alloc.committed:
            return
        alloc.committed = True
        if not self.enable_caching:
            return
        self._cache(alloc, range(alloc.hit_blocks, len(alloc.hashes)))

    def _cache(self, alloc: Allocation, blocks: range, tokens: Sequence[int] | None = None, at: int = 0) -> None:
        """Cache ``alloc``'s ``blocks`` (indexes into its hashes) and report them, in runs of
        consecutive blocks; ``tokens`` as ``_stored`` takes them."""
        run: list[int] = []                  # blocks newly cached, consecutive, for one BlockStored
        for i in blocks:
            h = alloc.hashes[i]
            if h in self._cached:  # a concurrent request computed it first; keep that copy
                self._stored(alloc, run, tokens, at)
                run = []
                continue
            b = alloc.block_ids[i]
            self._hash[b] = h
            self._cached[h] = b
            run.append(i)
        self._stored(alloc, run, tokens, at)

    def extend(self, alloc: Allocation, prompt_ids: Sequence[int], output_ids: Sequence[int], computed: int,
               root: bytes) -> None:
        """Cache the full blocks of the first ``computed`` tokens of the prompt and its output (those
        whose KV is computed) past those already hashed, as vLLM caches a block of generated tokens
        once it fills; a block another request cached first keeps that copy."""
        if not alloc.committed or not self.enable_caching:
            return
        bs = self.block_size
        n = min(computed // bs, len(alloc.block_ids))
        first = len(alloc.hashes)
        if n <= first:
            return
        if not alloc.extended:                # the sequence's own list of prompt hashes stays as it was
            alloc.hashes = list(alloc.hashes)
            alloc.extended = True
        lo, hi, p = first * bs, n * bs, len(prompt_ids)
        span = list(prompt_ids[lo:hi]) + list(output_ids[max(0, lo - p):max(0, hi - p)])
        alloc.hashes.extend(self.block_hashes(span, alloc.hashes[-1] if alloc.hashes else root))
        self._cache(alloc, range(first, n), span, lo)

    def _stored(self, alloc: Allocation, run: list[int], tokens: Sequence[int] | None = None, at: int = 0) -> None:
        """Report ``run``'s blocks stored; their token ids from ``tokens`` (which starts at token ``at``),
        else from the prompt's."""
        if not run or self.events is None:
            return
        first, bs = run[0], self.block_size
        parent = alloc.hashes[first - 1] if first else None
        kw = {}
        if self.extra_keys:
            # vLLM's per-block extras: the adapter's name on every block, then the salt on the block at
            # token 0 only; None for a block with neither
            lora, salt = alloc.lora_name, alloc.cache_salt
            kw["extra_keys"] = [(*((lora,) if lora else ()), *((salt,) if salt and i == 0 else ())) or None
                                for i in run]
        elif alloc.cache_salt:
            kw["cache_salt"] = alloc.cache_salt      # SGLang names the salt on every event of its namespace
        ids = alloc.token_ids if tokens is None else tokens
        self.events.stored([alloc.hashes[i] for i in run], parent,
                           list(ids[first * bs - at:(run[-1] + 1) * bs - at]), bs, alloc.lora_name, **kw)

    def free(self, alloc: Allocation) -> None:
        """Drop the request's references. Tail blocks become the first eviction candidates."""
        ref = self._ref
        for b in reversed(alloc.block_ids):
            ref[b] -= 1
            if ref[b] == 0:
                self._free[b] = None
                if self._hash[b] is None:
                    self._free.move_to_end(b, last=False)  # nothing to keep: reuse first
        alloc.block_ids.clear()

    def flush(self) -> bool:
        """Forget every cached prefix; refused (``False``) while any block is in use."""
        if self.used_blocks:
            return False
        self._hash = [None] * self.num_blocks
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def _take(self, b: int) -> None:
        if self._ref[b] == 0:
            del self._free[b]
        self._ref[b] += 1

    def _take_fresh(self) -> int:
        b, _ = self._free.popitem(last=False)
        h = self._hash[b]
        if h is not None:
            del self._cached[h]
            if self.events is not None:
                self.events.removed([h])
            self._hash[b] = None
        self._ref[b] = 1
        return b

    # -- statistics ---------------------------------------------------------------------------

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def cached_blocks(self) -> int:
        """Blocks holding a reusable prefix (in use or not)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0
