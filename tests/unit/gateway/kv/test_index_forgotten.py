"""A batch for an endpoint that left the pool (its subscriber, stopped by a task, may still read
what its socket holds) is not indexed: it would be under the slot the endpoint had, which the next
endpoint tracked is given."""

from __future__ import annotations

from gateway.endpoints import Endpoint
from gateway.kv.index import Applied, EventIndex
from gateway.kv.settings import KVEventsConfig
from gateway.kv.wire import Batch, BlockStored

BS = 4


def test_a_batch_for_a_forgotten_endpoint_is_not_indexed():
    cfg = KVEventsConfig(enabled=True, speculative_ttl_s=0)
    idx = EventIndex({}, lambda m: cfg)
    a = idx.track(Endpoint(url="http://10.0.0.1:8000", model="m"), cfg)
    idx.forget(a.ep)
    stored = Batch(0.0, [BlockStored([1, 2], None, list(range(2 * BS)), BS)], None)
    assert idx.apply(a, stored) == Applied(0, 0, 0, 0)
    steps = idx.stretches(a, stored)
    try:
        while True:
            next(steps)
    except StopIteration as stop:
        assert stop.value == Applied(0, 0, 0, 0)
    assert not idx._holders and not idx._parent_of and not a.emap
    b = idx.track(Endpoint(url="http://10.0.0.2:8000", model="m"), cfg)
    assert b.slot == a.slot and not b.emap and not idx._holders      # the slot b takes holds nothing
