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
