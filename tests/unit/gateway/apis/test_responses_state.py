"""The in-memory Responses state: TTL, count and byte caps, oldest first."""

from __future__ import annotations

from gateway.apis.responses_state import MemoryStore
from tests.support.factories import Clock


async def test_entries_expire_after_their_ttl():
    clock = Clock(0.0)
    s = MemoryStore(ttl_s=10, max_entries=100, clock=clock)
    await s.put("a", b"1")
    clock.t = 5
    await s.put("b", b"2")
    clock.t = 10.5
    assert await s.get("a") is None and await s.get("b") == b"2"
    await s.put("c", b"3")          # a put sweeps what expired
    assert len(s) == 2


async def test_count_and_byte_caps_evict_the_oldest():
    s = MemoryStore(ttl_s=100, max_entries=2)
    for k in "abc":
        await s.put(k, b"x")
    assert await s.get("a") is None and len(s) == 2 and s.evictions == 1
    b = MemoryStore(ttl_s=100, max_entries=100, max_bytes=10)
    await b.put("a", b"12345")
    await b.put("b", b"12345")
    await b.put("c", b"1")
    assert await b.get("a") is None and b.bytes == 6
    assert await b.delete("b") and not await b.delete("b") and b.bytes == 1
