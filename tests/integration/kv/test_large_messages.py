"""A large KV-events message (a long prompt's prefill) over a real ZeroMQ PUB socket on loopback:
the subscriber applies it in stretches with the event loop running between them, the messages
published after it wait and are applied after it, in order, and the index ends exactly as if the
message had been applied at once."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from gateway.endpoints import Endpoint, EndpointPool
from gateway.kv.events import STRETCH_BYTES, KVEventsManager, Subscriber
from gateway.kv.index import STRETCH_BLOCKS
from gateway.kv.settings import KVEventsConfig
from tests.support.factories import block_stored, event_batch
from tests.support.ports import listen_port

BLOCKS = 8192                   # a 128k-token prompt at 16 tokens a block


def _subscriber(port: int) -> tuple[KVEventsManager, Subscriber]:
    settings = KVEventsConfig(enabled=True, port=port, replay_port=None)
    pool = EndpointPool()
    manager = KVEventsManager(lambda model: settings, pool, CollectorRegistry(), {})
    ep = pool.add(Endpoint(url="http://127.0.0.1:8000", model="m"))
    return manager, Subscriber(manager, manager.index.track(ep, settings))


def _state(manager: KVEventsManager, sub: Subscriber) -> tuple:
    st, idx = sub.st, manager.index
    return list(st.emap.items()), st.media, st.owned, idx._holders, idx._children, idx._parent_of


async def test_a_large_message_is_applied_in_stretches_and_what_follows_it_waits():
    port = listen_port()
    ctx = zmq.asyncio.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    manager, sub = _subscriber(port)
    big = event_batch("vllm", [block_stored(list(range(100, 100 + BLOCKS)), None,
                                            [(7 * i) % 128_000 for i in range(16 * BLOCKS)], medium="GPU")])
    after = [event_batch("vllm", [{"type": "BlockRemoved", "block_hashes": [100], "medium": "GPU"}]),   # its first block
             event_batch("vllm", [block_stored([9000], 100 + BLOCKS - 1, list(range(16)), medium="GPU")])]
    assert len(big) > STRETCH_BYTES
    sub.start()
    sent: list[bytes] = []
    seen: list[tuple[int, bool]] = []           # (blocks indexed, the message after it applied) at each loop turn
    try:
        seq = 0
        while not sub.st.emap:                  # the SUB socket connects (a slow joiner)
            sent.append(event_batch("vllm", [block_stored([1, 2], None, list(range(32)))]))
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), sent[-1]])
            seq += 1
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)
        base = len(sub.st.emap)
        for payload in (big, *after):
            sent.append(payload)
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            seq += 1
        for _ in range(200_000):                # a hang guard, not a timing: one entry per loop turn
            seen.append((len(sub.st.emap), 9000 in sub.st.emap))
            if sub.expected == seq:
                break
            await asyncio.sleep(0)
        assert sub.expected == seq
        partial = sorted({n for n, _ in seen if base < n < base + BLOCKS})
        # the loop ran this task between the stretches, and saw the index whole at each of them
        assert partial == [base + k * STRETCH_BLOCKS for k in range(1, BLOCKS // STRETCH_BLOCKS)]
        assert not any(later for n, later in seen if n < base + BLOCKS)   # nothing after it before it
        assert 100 not in sub.st.emap and 9000 in sub.st.emap          # applied after it, in order

        ref_manager, ref = _subscriber(listen_port())       # the same messages, each applied at once
        for payload in sent:
            ref_manager.index.apply(ref.st, ref.decoder.decode(payload))
        assert _state(manager, sub) == _state(ref_manager, ref)
        await ref_manager.close()
    finally:
        await sub.stop()
        pub.close(0)
        await manager.close()
