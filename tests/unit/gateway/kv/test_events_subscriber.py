"""``gateway.kv.events.Subscriber`` without sockets: the reader callback applies what a SUB socket
holds, counts what is malformed (nothing escapes it), and hands a gap to the subscriber's task with
every message after it."""

from __future__ import annotations

import asyncio
from functools import partial

import msgspec
from prometheus_client import CollectorRegistry

from gateway.endpoints import Endpoint, EndpointPool
from gateway.kv import events as kv_events
from gateway.kv.events import KVEventsManager, Subscriber
from gateway.kv.settings import KVEventsConfig
from tests.support.factories import block_stored, event_batch
from tests.support.kv import FakeSub

enc = msgspec.msgpack.encode
batch = partial(event_batch, "map")


def test_a_subscriber_counts_bad_messages_and_keeps_applying_the_good_ones(monkeypatch):
    settings = KVEventsConfig(enabled=True)
    pool = EndpointPool()
    registry = CollectorRegistry()
    manager = KVEventsManager(lambda model: settings, pool, registry, {})
    ep = pool.add(Endpoint(url="http://10.0.0.1:8000", model="m"))
    sub = Subscriber(manager, manager.index.track(ep, settings))

    def msg(seq, events):
        return [b"", seq.to_bytes(8, "big"), events if isinstance(events, bytes) else batch(events)]

    def stored(*hashes):
        return [block_stored(list(hashes), None, list(range(16 * len(hashes))), medium="GPU")]

    apply = manager.index.apply
    calls = []

    def apply_failing_once(st, b, rank=None):       # a bug in the index, met once
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("index bug")
        return apply(st, b, rank)

    monkeypatch.setattr(manager.index, "apply", apply_failing_once)
    sub._sock = FakeSub([
        msg(0, stored(1, 2)),
        [b"", b"\x00" * 8],                                        # two frames
        [b"", b"\x00", batch([])],                          # a sequence frame of one byte
        msg(1, enc([0, [["BlockStored", [[1]], None, [0] * 16, 16]]])),    # a hash that is an array
        msg(1, stored(5, 6)),                                       # the index fails on it: cleared, skipped
        msg(2, stored(7, 8)),
    ])
    sub._readable()                   # nothing escapes; the bad ones are counted, the good ones applied
    assert not sub._sock.messages and not sub._backlog
    assert list(sub.st.emap) == [7, 8] and sub.expected == 3
    assert registry.get_sample_value("switchyard_kv_events_decode_errors_total", {"model": "m"}) == 4
    assert registry.get_sample_value("switchyard_kv_events_total", {"model": "m", "kind": "BlockStored"}) == 2


def test_a_gap_goes_to_the_subscriber_task_with_everything_after_it():
    settings = KVEventsConfig(enabled=True)
    pool = EndpointPool()
    manager = KVEventsManager(lambda model: settings, pool, CollectorRegistry(), {})
    sub = Subscriber(manager, manager.index.track(pool.add(Endpoint(url="http://10.0.0.1:8000", model="m")),
                                                  settings))
    removed = batch([{"type": "BlockRemoved", "block_hashes": [1]}])
    sub._sock = FakeSub([[b"", i.to_bytes(8, "big"), removed] for i in (0, 1, 3, 4)])
    sub._readable()
    assert sub.expected == 2 and [seq for seq, _ in sub._backlog] == [3, 4]


async def test_a_burst_is_applied_in_slices_the_loop_runs_between():
    settings = KVEventsConfig(enabled=True)
    pool = EndpointPool()
    manager = KVEventsManager(lambda model: settings, pool, CollectorRegistry(), {})
    sub = Subscriber(manager, manager.index.track(pool.add(Endpoint(url="http://10.0.0.1:8000", model="m")),
                                                  settings))
    n = kv_events._DRAIN + 10
    sub._sock = FakeSub([[b"", i.to_bytes(8, "big"), batch([block_stored([i], None, [i] * 16)])] for i in range(n)])
    sub._readable()
    assert sub.expected == kv_events._DRAIN            # the rest waits for the loop's next turn
    await asyncio.sleep(0)
    assert sub.expected == n and len(sub.st.emap) == n


def _large(first: int, n: int = 3 * 2048, parent: int | None = None) -> bytes:
    """A message over ``STRETCH_BYTES``: one ``BlockStored`` of ``n`` blocks, hashes from ``first``."""
    payload = batch([block_stored(list(range(first, first + n)), parent, [i % 30_000 for i in range(16 * n)])])
    assert len(payload) > kv_events.STRETCH_BYTES
    return payload


def _subscriber(replay_port: int | None = None) -> tuple[KVEventsManager, Subscriber]:
    settings = KVEventsConfig(enabled=True, port=5557, replay_port=replay_port)
    pool = EndpointPool()
    manager = KVEventsManager(lambda model: settings, pool, CollectorRegistry(), {})
    ep = pool.add(Endpoint(url="http://10.0.0.1:8000", model="m"))
    return manager, Subscriber(manager, manager.index.track(ep, settings))


async def _ticking(coro, sub: Subscriber) -> list[int]:
    """Run ``coro``; the blocks indexed at each loop turn meanwhile (another callback of the loop)."""
    seen: list[int] = []
    task = asyncio.ensure_future(coro)
    while not task.done():
        seen.append(len(sub.st.emap))
        await asyncio.sleep(0)
    await task
    return seen


def test_a_large_message_goes_to_the_task_with_everything_after_it():
    _, sub = _subscriber()
    small = batch([block_stored([1], None, list(range(16)))])
    sub._sock = FakeSub([[b"", (0).to_bytes(8, "big"), small], [b"", (1).to_bytes(8, "big"), _large(100)],
                         [b"", (2).to_bytes(8, "big"), small]])
    sub._readable()
    assert list(sub.st.emap) == [1] and sub.expected == 1      # the small one before it: applied at once
    assert [seq for seq, _ in sub._backlog] == [1, 2]


async def test_a_large_message_from_a_restarted_engine_clears_then_applies_in_stretches():
    manager, sub = _subscriber()
    sub.expected = 40
    manager.index.apply(sub.st, sub.decoder.decode(batch([block_stored([1, 2], None, list(range(32)))])))
    seen = await _ticking(sub.on_message(0, _large(100)), sub)
    assert sub.expected == 1 and 1 not in sub.st.emap and len(sub.st.emap) == 3 * 2048
    assert {2048, 4096} <= set(seen)


async def test_a_gap_before_a_large_message_is_handled_before_it():
    manager, sub = _subscriber()                         # no replay port: the gap clears
    sub.expected = 3
    manager.index.apply(sub.st, sub.decoder.decode(batch([block_stored([1, 2], None, list(range(32)))])))
    await sub.on_message(7, _large(100))
    assert sub.expected == 8 and 1 not in sub.st.emap and len(sub.st.emap) == 3 * 2048


async def test_a_large_message_is_left_when_its_engine_restarts_meanwhile():
    manager, sub = _subscriber()
    manager.subscribers[sub.st.ep] = [sub]
    sub.expected = 0

    async def restart_after_the_first_stretch() -> None:
        while len(sub.st.emap) < 2048:
            await asyncio.sleep(0)
        manager.engine_restarted(sub.st.ep)

    restart = asyncio.ensure_future(restart_after_the_first_stretch())
    await sub.on_message(0, _large(100))
    await restart
    assert not sub.st.emap and sub.expected is None      # cleared, and the rest of it not applied after


async def test_a_large_message_is_left_when_its_endpoint_leaves_the_pool_meanwhile():
    manager, sub = _subscriber()
    sub.expected = 0

    async def forget_after_the_first_stretch() -> None:
        while len(sub.st.emap) < 2048:
            await asyncio.sleep(0)
        manager.index.forget(sub.st.ep)

    forget = asyncio.ensure_future(forget_after_the_first_stretch())
    await sub.on_message(0, _large(100))
    await forget
    assert not sub.st.emap                                   # out of routing at once
    while manager.index.retiring:                            # its old entries unlinked by the manager's task
        await asyncio.sleep(0)
    assert not manager.index._holders                        # nothing indexed under its freed slot
