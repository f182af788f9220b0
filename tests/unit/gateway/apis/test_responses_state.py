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


async def test_a_stored_value_holds_its_length_not_its_encoders_buffer():
    """orjson.dumps answers a short value in a buffer of about 4 KiB; kept as it is, each of the
    100,000 affinity entries a worker keeps for a day held 4 KiB (a soak's RSS climbed ~4.3 KiB per
    Responses request). The store keeps a copy of the value's own length."""
    import tracemalloc

    import orjson

    s = MemoryStore(ttl_s=100, max_entries=10_000)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(1000):       # as gateway/apis/responses.py writes an affinity entry
            await s.put(f"resp_{i}", orjson.dumps({"url": "http://127.0.0.1:8000", "model": "m", "user": None}))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(s) == 1000 and await s.get("resp_7") == b'{"url":"http://127.0.0.1:8000","model":"m","user":null}'
    assert grown < 1000 * 512, f"{grown / 1000:.0f} bytes an entry"


# -- several workers: a worker's misses are asked of the others ---------------------------------

async def test_a_worker_store_asks_its_siblings_on_a_miss_and_deletes_everywhere():
    from gateway.apis.responses_state import WorkerStore

    other = WorkerStore(MemoryStore(60, 100), "hist", ask=None)       # the sibling's own store
    await other.local.put("resp_1", b'{"id": "resp_1"}')
    asked: list[str] = []
    found: list[int] = []

    async def ask(question: str) -> dict[int, bytes]:
        asked.append(question)
        op, name, key = question.split(" ")
        answer = await other.answer(op, key) if name == "hist" else b""
        return {1: answer} if answer else {}

    mine = WorkerStore(MemoryStore(60, 100), "hist", ask, lambda: found.append(1))
    await mine.put("resp_0", b"mine")
    assert await mine.get("resp_0") == b"mine" and asked == []          # its own: nobody asked
    assert await mine.get("resp_1") == b'{"id": "resp_1"}' and asked == ["rget hist resp_1"] and found == [1]
    assert await mine.get("resp_2") is None                              # nobody has it
    assert await mine.get("has space") is None and asked[-1] == "rget hist resp_2"   # not a question line
    assert await mine.delete("resp_1") is True and await other.local.get("resp_1") is None
    assert await mine.delete("resp_1") is False
    assert len(mine) == 1
