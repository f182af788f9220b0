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
