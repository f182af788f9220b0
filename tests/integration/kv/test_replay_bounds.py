"""What an engine's KV-event stream cannot make the gateway do, whatever it sends: a replay socket
(a real ZeroMQ ROUTER on loopback) that floods repeated or out-of-range batches and never ends, or
an engine met with a very high first sequence number, costs a bounded replay; messages the index
cannot use are counted and skipped without clearing it; messages piling up behind a replay that
never answers are dropped past a bound, and the stream taken up again."""

from __future__ import annotations

import asyncio
import tracemalloc
from functools import partial

import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from gateway.endpoints import Endpoint, EndpointPool
from gateway.kv import events as kv_events
from gateway.kv.events import KVEventsManager, Subscriber
from gateway.kv.settings import KVEventsConfig
from tests.support.factories import block_stored, event_batch
from tests.support.kv import FakeSub
from tests.support.ports import listen_port

batch = partial(event_batch, "map")
END = (-1).to_bytes(8, "big", signed=True)


def subscriber(replay_port: int | None = None, timeout: float = 0.5) -> tuple[Subscriber, CollectorRegistry]:
    settings = KVEventsConfig(enabled=True, port=listen_port(), replay_port=replay_port, replay_timeout_s=timeout)
    pool = EndpointPool()
    registry = CollectorRegistry()
    manager = KVEventsManager(lambda model: settings, pool, registry, {})
    ep = pool.add(Endpoint(url="http://127.0.0.1:8000", model="m"))
    return Subscriber(manager, manager.index.track(ep, settings)), registry


async def replay_server(port: int, answer) -> asyncio.Task:
    """A ROUTER socket that answers each replay request with ``answer(send)``."""
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{port}")

    async def serve() -> None:
        try:
            while True:
                ident, _, _start = await sock.recv_multipart()
                await answer(lambda seq, payload, ident=ident: sock.send_multipart(
                    [ident, b"", seq.to_bytes(8, "big", signed=True), payload]))
        finally:
            sock.close(0)
    return asyncio.create_task(serve())


def stored(*hashes: int) -> bytes:
    return batch([block_stored(list(hashes), None, list(range(16 * len(hashes))))])


async def test_a_replay_that_floods_and_never_ends_is_bounded_and_keeps_nothing_it_did_not_ask_for():
    port = listen_port()

    async def flood(send) -> None:
        junk = b"x" * 4096
        for i in range(60_000):                 # seq 0 again and again, and seqs out of range: no end
            await send(0 if i % 2 else 10_000 + i, junk)

    server = await replay_server(port, flood)
    try:
        sub, registry = subscriber(port)
        sub.m.index.apply(sub.st, sub.decoder.decode(stored(1, 2)))
        await asyncio.wait_for(sub.replay(5, 9), 30)          # a hang guard, not a timing
        assert registry.get_sample_value("switchyard_kv_events_replays_total",
                                         {"model": "m", "result": "failed"}) == 1
        assert not sub.st.emap                  # the gap could not be filled: cleared
    finally:
        server.cancel()


async def test_a_first_contact_far_into_an_engines_life_replays_what_its_buffer_holds():
    """An engine met at seq 30,000,000: the replay from 0 brings its buffer's last batches; the
    check that they are whole costs no list of thirty million numbers."""
    port = listen_port()

    async def recent(send) -> None:
        for seq in range(29_999_998, 30_000_000):
            await send(seq, stored(seq % 1000 + 1))
        await send(-1, b"")

    server = await replay_server(port, recent)
    try:
        sub, registry = subscriber(port)
        tracemalloc.start()
        try:
            await asyncio.wait_for(sub.replay(0, 30_000_000, first=True), 30)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 32 << 20, peak
        assert registry.get_sample_value("switchyard_kv_events_replays_total",
                                         {"model": "m", "result": "incomplete"}) == 1
        assert sorted(sub.st.emap) == [999, 1000]      # what the buffer held is learned
    finally:
        server.cancel()


@pytest.mark.parametrize("event", [
    block_stored([7], None, list(range(16)), block_size=float("inf")),
    block_stored([7], None, list(range(16)), block_size=0),
    block_stored([7], None, list(range(16)), extra_keys=[7]),
    block_stored([7], None, list(range(16)), extra_keys=[[{"a": 1}]]),
])
def test_an_event_whose_values_make_no_sense_is_counted_and_skipped_and_the_entries_stay(event):
    sub, registry = subscriber()
    sub._sock = FakeSub([[b"", (0).to_bytes(8, "big"), stored(1, 2)],
                          [b"", (1).to_bytes(8, "big"), batch([event])],
                          [b"", (2).to_bytes(8, "big"), stored(3)]])
    sub._readable()
    assert sorted(sub.st.emap) == [1, 2, 3] and sub.expected == 3
    assert registry.get_sample_value("switchyard_kv_events_decode_errors_total", {"model": "m"}) == 1


def _nested_extra_keys(depth: int) -> bytes:
    """A batch whose ``BlockStored`` names ``extra_keys`` nested ``depth`` arrays deep."""
    b = batch([block_stored([7], None, list(range(16)), extra_keys=[[0]])])
    i = b.index(b"\x91\x91\x00")
    return b[:i] + b"\x91" * (depth + 2) + b"\x00" + b[i + 3:]


def test_a_message_nested_too_deeply_is_counted_and_skipped_and_the_entries_stay():
    """A few KB of msgpack arrays nested thousands deep (or ``extra_keys`` nested hundreds deep)
    are malformed like any other message: counted and skipped, the entries kept, the stream going
    on; they are not taken for a failure to apply, which clears the endpoint's entries."""
    sub, registry = subscriber()
    sub._sock = FakeSub([[b"", (0).to_bytes(8, "big"), stored(1, 2)],
                          [b"", (1).to_bytes(8, "big"), b"\x91" * 5000 + b"\x01"],
                          [b"", (2).to_bytes(8, "big"), _nested_extra_keys(800)],
                          [b"", (3).to_bytes(8, "big"), stored(3)]])
    sub._readable()
    assert sorted(sub.st.emap) == [1, 2, 3] and sub.expected == 4
    assert registry.get_sample_value("switchyard_kv_events_decode_errors_total", {"model": "m"}) == 2


async def test_a_malformed_batch_a_replay_brings_is_counted_and_skipped():
    """A batch of the replay that is not an event batch is skipped as a live one is, and counted
    as one: the batches around it are applied."""
    port = listen_port()

    async def serve(send) -> None:
        for seq, payload in enumerate([stored(1, 2), b"\xc1 not msgpack", stored(3)]):
            await send(seq, payload)
        await send(-1, b"")

    server = await replay_server(port, serve)
    try:
        sub, registry = subscriber(port, timeout=30)
        await asyncio.wait_for(sub.replay(0, 3), 30)          # a hang guard, not a timing
        assert sorted(sub.st.emap) == [1, 2, 3]
        assert registry.get_sample_value("switchyard_kv_events_replays_total", {"model": "m", "result": "ok"}) == 1
        assert registry.get_sample_value("switchyard_kv_events_decode_errors_total", {"model": "m"}) == 1
    finally:
        server.cancel()


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_a_block_hash_longer_than_any_engines_is_malformed_and_not_held(encoding):
    """Engines name a block by an int or a digest of at most 32 bytes. A publisher naming blocks by
    long byte strings (here 60 KB each) would have the index hold them: max_blocks_per_endpoint
    entries of that size are gigabytes. The message is counted as malformed and skipped."""
    sub, registry = subscriber()
    long = b"h" * 60_000
    sub._sock = FakeSub([[b"", (0).to_bytes(8, "big"), stored(1, 2)],
                          [b"", (1).to_bytes(8, "big"), event_batch(encoding, [block_stored([long], None, list(range(16)))])],
                          [b"", (2).to_bytes(8, "big"), batch([block_stored([b"d" * 32], 2, list(range(16)))])]])
    sub._readable()
    assert long not in sub.st.emap and sub.expected == 3
    assert set(sub.st.emap) == {1, 2, b"d" * 32}          # a 32-byte digest is a hash as before
    assert registry.get_sample_value("switchyard_kv_events_decode_errors_total", {"model": "m"}) == 1


async def test_a_flood_of_cache_resets_leaves_the_endpoints_bit_in_the_index_small():
    """Each clear gives the endpoint a new bit in the index's masks while its old one is drained. A
    publisher sending thousands of AllBlocksCleared (alone, or between stores of a block) left the
    endpoint on a bit thousands of places up once they were drained: every mask naming its blocks
    then an integer of thousands of bits, and each block stored after costing as much."""
    sub, _ = subscriber()
    index = sub.m.index
    cleared = {"type": "AllBlocksCleared"}
    messages = [batch([cleared] * 2000), batch([cleared] * 2000),
                batch([e for k in range(500) for e in (block_stored([10 + k], None, list(range(16))), cleared)])]
    assert all(len(p) <= kv_events.STRETCH_BYTES for p in messages)       # each applied at once
    sub._sock = FakeSub([[b"", seq.to_bytes(8, "big"), p] for seq, p in enumerate([stored(1, 2), *messages])])
    sub._readable()
    for _ in range(100_000):                     # the clears' old entries drained, a stretch a loop turn
        if not index.retiring:
            break
        await asyncio.sleep(0)
    assert not index.retiring
    sub._sock = FakeSub([[b"", (4).to_bytes(8, "big"), stored(3, 4)]])
    sub._readable()
    assert sorted(sub.st.emap) == [3, 4]
    assert sub.st.slot < 64 and max(m.bit_length() for m in index._holders.values()) <= 64
    await sub.m.close()


async def test_a_negative_sequence_number_is_malformed():
    """Engines number their batches from 0 up. A message numbered below 0 is counted as malformed
    and skipped; the next one is a first contact as if it had not come."""
    sub, registry = subscriber(listen_port())
    sub._sock = FakeSub([[b"", (-5).to_bytes(8, "big", signed=True), stored(1)],
                          [b"", (0).to_bytes(8, "big"), stored(2, 3)]])
    sub._readable()
    while sub._backlog:                         # what the subscriber's task does with what waits
        await sub.on_message(*sub._backlog.popleft())
    assert sorted(sub.st.emap) == [2, 3] and sub.expected == 1
    assert registry.get_sample_value("switchyard_kv_events_decode_errors_total", {"model": "m"}) == 1


def test_an_sglang_salt_is_kept_when_the_batch_is_decoded_untyped():
    """A batch the typed decoders refuse (here one with an event type this gateway does not know:
    a newer engine's) is decoded untyped, and so are the 64 after it. SGLang's ``cache_salt`` on a
    ``BlockStored`` keys its chain from a salted root either way."""
    salted = batch([block_stored([7], None, list(range(16)), cache_salt="t1")])
    typed, _ = subscriber()
    typed._sock = FakeSub([[b"", (0).to_bytes(8, "big"), salted]])
    typed._readable()
    sub, _ = subscriber()
    sub._sock = FakeSub([[b"", (0).to_bytes(8, "big"), batch([{"type": "BlockPinned", "block_hashes": [1]}])],
                          [b"", (1).to_bytes(8, "big"), salted],
                          [b"", (2).to_bytes(8, "big"), batch([{"type": "BlockPinned", "block_hashes": [1]},
                                                               block_stored([8], None, list(range(16)),
                                                                            cache_salt="t1")])]])
    sub._readable()
    assert sub.decoder.untyped == 3
    assert sub.st.emap[7] == sub.st.emap[8] == typed.st.emap[7]


def test_messages_piling_up_behind_a_replay_are_dropped_past_a_bound(monkeypatch):
    monkeypatch.setattr(kv_events, "BACKLOG_MAX", 4)
    sub, registry = subscriber(listen_port())
    sub.expected = 1
    removed = batch([{"type": "BlockRemoved", "block_hashes": [1]}])
    sub._sock = FakeSub([[b"", i.to_bytes(8, "big"), removed] for i in (3, 4, 5, 6, 7, 8, 9)])
    sub._readable()                             # 3 needs a replay: it and what follows wait, up to 4
    assert [seq for seq, _ in sub._backlog] == [3, 4, 5, 6] and sub._overflowed
    assert registry.get_sample_value("switchyard_kv_events_decode_errors_total", {"model": "m"}) == 1


async def test_a_message_over_the_size_bound_is_never_taken_in_and_the_stream_goes_on(monkeypatch):
    """An engine that publishes a message larger than any step's events (here over a bound made
    small for the test) has its connection dropped by the socket before the message is held in
    memory or applied; what it missed meanwhile is a gap (no replay port here: cleared), and the
    messages after it are applied."""
    monkeypatch.setattr(kv_events, "MAX_MESSAGE_BYTES", 64 << 10, raising=False)
    port = listen_port()
    ctx = zmq.asyncio.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    settings = KVEventsConfig(enabled=True, port=port, replay_port=None)
    pool = EndpointPool()
    registry = CollectorRegistry()
    manager = KVEventsManager(lambda model: settings, pool, registry, {})
    ep = pool.add(Endpoint(url="http://127.0.0.1:8000", model="m"))
    sub = Subscriber(manager, manager.index.track(ep, settings))
    sub.start()
    big = list(range(100, 100 + 8192))                     # 8192 blocks, about 200 KB
    seen_big = False
    try:
        seq = 0
        while not sub.st.emap:                             # the SUB socket connects (a slow joiner)
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), stored(1, 2)])
            seq += 1
            await asyncio.sleep(0.05)
        await pub.send_multipart([b"", seq.to_bytes(8, "big"), stored(*big)])
        seq += 1
        for _ in range(200):                               # a hang guard, not a timing
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), stored(5000 + seq)])
            seq += 1
            await asyncio.sleep(0.05)
            seen_big = seen_big or 100 in sub.st.emap
            if any(h >= 5000 for h in sub.st.emap):
                break
        assert not seen_big and 100 not in sub.st.emap
        assert any(h >= 5000 for h in sub.st.emap)         # the stream goes on after it
        assert registry.get_sample_value("switchyard_kv_events_replays_total",
                                         {"model": "m", "result": "no_replay_port"}) == 1
    finally:
        await sub.stop()
        pub.close(0)
        await manager.close()


def test_bad_messages_are_each_counted_and_warned_of_once_in_ten_seconds(monkeypatch):
    """A publisher that sends nothing but malformed messages fills no log: the first is warned of,
    then one line per 10 s with how many came since; the metric counts every one."""
    import structlog

    from gateway.kv.wire import WireError

    now = [1000.0]
    monkeypatch.setattr(kv_events.time, "monotonic", lambda: now[0])
    sub, registry = subscriber()
    with structlog.testing.capture_logs() as logs:
        for _ in range(100):
            sub._bad(WireError("2 frames, expected 3"))
        now[0] += 11
        sub._bad(WireError("2 frames, expected 3"))
    warned = [x for x in logs if x["event"] == "kv events: bad message"]
    assert [w.get("bad_since_last") for w in warned] == [0, 99]     # the 99 between the two lines
    assert registry.get_sample_value("switchyard_kv_events_decode_errors_total", {"model": "m"}) == 101


async def test_a_replay_lets_the_loop_run_between_stretches_of_its_batches():
    """Batches a replay brings (here 40 of about 30 KB: a 6k-token prompt's blocks each, each one
    applied at once) are applied in stretches of about 64 KiB, the loop running between them,
    not 256 batches at a time whatever their size."""
    port = listen_port()
    blocks = 400
    payloads = [batch([block_stored(list(range(10_000 * (s + 1), 10_000 * (s + 1) + blocks)), None,
                                    [(s + i) % 30_000 for i in range(16 * blocks)])]) for s in range(40)]
    assert all(len(p) <= kv_events.STRETCH_BYTES for p in payloads)
    per = kv_events.STRETCH_BYTES // len(payloads[0]) + 1        # batches of one stretch

    async def serve(send) -> None:
        for seq, payload in enumerate(payloads):
            await send(seq, payload)
        await send(-1, b"")

    server = await replay_server(port, serve)
    try:
        sub, _ = subscriber(port, timeout=30)
        task = asyncio.ensure_future(sub.replay(0, len(payloads)))
        seen = []                                 # blocks indexed at each turn of the loop meanwhile
        while not task.done():
            seen.append(len(sub.st.emap))
            await asyncio.sleep(0)
        await task
        assert len(sub.st.emap) == 40 * blocks
        steps = [b - a for a, b in zip(seen, seen[1:], strict=False) if b != a]
        assert len(steps) >= 40 // per and max(steps) <= per * blocks
    finally:
        server.cancel()


async def test_a_catch_up_applies_each_batch_once_and_takes_another_history_for_a_restart():
    """At a connection the subscriber asks the replay socket for what it has not heard. At first
    contact it applies the engine's buffer, and drops the messages held meanwhile that the replay
    brought (each batch applied once); at a reconnect, an engine whose replay does not hold the
    last batch heard is a new one: its entries are cleared and its history taken up from 0."""
    port = listen_port()
    history = [(0, stored(1)), (1, stored(2)), (2, stored(3))]

    async def answer(send) -> None:
        for seq, payload in history:
            await send(seq, payload)
        await send(-1, b"")

    server = await replay_server(port, answer)
    try:
        sub, registry = subscriber(port, timeout=5)
        sub.ask_catch_up()
        sub._backlog.extend([(1, history[1][1]), (3, stored(4))])      # held while it runs
        await asyncio.wait_for(sub.catch_up(), 30)                  # a hang guard, not a timing
        assert sorted(sub.st.emap) == [1, 2, 3] and sub.expected == 3
        assert [seq for seq, _ in sub._backlog] == [kv_events.CATCH_UP, 3]
        assert registry.get_sample_value("switchyard_kv_events_replayed_batches_total", {"model": "m"}) == 3
        sub._backlog.clear()

        history[:] = [(0, stored(7))]          # the engine restarted: its buffer holds another batch 0
        sub._catch_up_queued = False
        await asyncio.wait_for(sub.catch_up(), 30)
        assert sorted(sub.st.emap) == [7] and sub.expected == 1
        assert registry.get_sample_value("switchyard_kv_events_restarts_total", {"model": "m"}) == 1
    finally:
        server.cancel()


def test_a_store_of_no_full_block_or_an_implausible_block_size_leaves_the_endpoints_block_size():
    """The endpoint's block size keys every request routed to it: a ``BlockStored`` naming a huge
    block size (over 65,536 tokens: no engine's is near) is malformed, and one whose tokens fill
    none of its blocks keys nothing, so neither changes it; requests keep matching the blocks the
    engine holds."""
    sub, registry = subscriber()
    sub._sock = FakeSub([[b"", (0).to_bytes(8, "big"), stored(1, 2)],
                          [b"", (1).to_bytes(8, "big"), batch([block_stored([7], None, [5], block_size=1 << 40)])],
                          [b"", (2).to_bytes(8, "big"), batch([block_stored([8], None, [5, 6], block_size=4096)])]])
    sub._readable()
    assert sub.expected == 3 and sorted(sub.st.emap) == [1, 2]
    assert sub.st.block_size == 16 and sub.m.index.block_size([sub.st.ep]) == 16
    assert registry.get_sample_value("switchyard_kv_events_decode_errors_total", {"model": "m"}) == 1


@pytest.mark.parametrize("bound", ["bytes", "batches"])
async def test_a_catch_up_over_a_bound_keeps_the_newest_batches(monkeypatch, bound):
    """An engine's whole buffer (vLLM keeps 10,000 batches, tens of MB on a busy engine) can be over
    a replay's byte bound, or (made small here) its batch bound: at first contact the catch-up keeps
    the newest batches within it, the ones that tell what the engine holds now, and the stream goes
    on after them."""
    if bound == "bytes":
        monkeypatch.setattr(kv_events, "REPLAY_MAX_BYTES", 3 * len(stored(1)))
    else:
        monkeypatch.setattr(kv_events, "REPLAY_MAX_FRAMES", 3)
    port = listen_port()

    async def answer(send) -> None:
        for seq in range(10):
            await send(seq, stored(seq + 1))
        await send(-1, b"")

    server = await replay_server(port, answer)
    try:
        sub, registry = subscriber(port, timeout=5)
        await asyncio.wait_for(sub.catch_up(), 30)                  # a hang guard, not a timing
        assert sorted(sub.st.emap) == [8, 9, 10] and sub.expected == 10
        assert registry.get_sample_value("switchyard_kv_events_replays_total",
                                         {"model": "m", "result": "incomplete"}) == 1
    finally:
        server.cancel()
