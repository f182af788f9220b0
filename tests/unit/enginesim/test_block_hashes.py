"""The simulator's block hashes: the prompt's bytes taken once, equal to hashing block by block."""

from __future__ import annotations

import hashlib
from array import array

from hypothesis import given
from hypothesis import strategies as st

from enginesim.kvcache import BlockPool
from enginesim.tokenizer import ids_bytes


def _block_by_block(ids: list[int], root: bytes, bs: int) -> list[bytes]:
    out, parent = [], root
    for start in range(0, len(ids) - bs + 1, bs):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(array("Q", (t & (1 << 64) - 1 for t in ids[start:start + bs])).tobytes())
        parent = h.digest()
        out.append(parent)
    return out


@given(st.lists(st.integers(0, 1 << 40), max_size=80), st.integers(1, 17))
def test_block_hashes_equal_hashing_each_block(ids, bs):
    assert BlockPool(4, bs).block_hashes(ids, b"root") == _block_by_block(ids, b"root", bs)


def test_ids_bytes_masks_what_does_not_fit_64_bits():
    assert ids_bytes([-1, 1 << 70, 3]) == array("Q", [(1 << 64) - 1, 0, 3]).tobytes()
    assert ids_bytes(iter([1, 2])) == ids_bytes((1, 2)) == array("Q", [1, 2]).tobytes()


class _Events:
    def __init__(self) -> None:
        self.stored_: list[tuple[list[bytes], bytes | None, list[int]]] = []

    def stored(self, hashes, parent, token_ids, block_size, lora_name, **kw) -> None:
        self.stored_.append((hashes, parent, token_ids))

    def removed(self, hashes) -> None:
        pass


@given(st.integers(1, 40), st.integers(1, 60))
def test_generated_blocks_chain_on_the_prompt_as_a_longer_prompt_would(prompt_len, generated):
    """``extend`` caches the blocks the generated tokens fill with the hashes a prompt of the same
    tokens gets, and reports them chained on the prompt's last full block."""
    bs = 4
    pool = BlockPool(64, bs)
    pool.events = _Events()
    ids = list(range(100, 100 + prompt_len + generated))
    prompt_hashes = pool.block_hashes(ids[:prompt_len], b"root")      # the sequence's list
    alloc = pool.allocate(prompt_hashes, prompt_len)
    assert alloc is not None
    alloc.token_ids = ids[:prompt_len]            # as the engine sets it
    pool.commit(alloc)
    pool.grow(alloc, len(ids))
    pool.extend(alloc, ids[:prompt_len], ids[prompt_len:] + [7], len(ids), b"root")   # 7: the newest, uncomputed
    assert alloc.hashes == pool.block_hashes(ids, b"root")
    assert pool.match(pool.block_hashes(ids + [1], b"root"), len(ids) + 1) == len(ids) // bs
    reported = [h for hashes, _, _ in pool.events.stored_ for h in hashes]
    assert reported == alloc.hashes
    assert [t for _, _, tokens in pool.events.stored_ for t in tokens] == ids[:len(ids) // bs * bs]
    assert prompt_hashes == pool.block_hashes(ids[:prompt_len], b"root")     # unchanged
