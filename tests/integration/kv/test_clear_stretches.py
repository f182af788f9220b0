"""An ``AllBlocksCleared`` of an endpoint holding many blocks, over a real ZeroMQ PUB socket on
loopback: the endpoint holds none of its old blocks from the moment the message is applied, its old
entries are unlinked from the index by a task in stretches with the event loop running between
them, the events after the clear apply to it meanwhile, matches made meanwhile never count its old
blocks (and still count another endpoint's), and the index ends as if cleared at once."""

from __future__ import annotations

import asyncio

import orjson
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from enginesim.tiny_tokenizer import TINY_DIR
from gateway.endpoints import Endpoint, EndpointPool
from gateway.kv.events import KVEventsManager, Subscriber
from gateway.kv.index import CLEAR_STRETCH
from gateway.kv.settings import KVEventsConfig
from gateway.kv.tokenization import ModelTokenizer
from gateway.kv.wire import Batch, BlockStored
from gateway.request import parse
from tests.support.factories import block_stored, event_batch
from tests.support.ports import listen_port

BLOCKS = 40_000                 # entries of the cleared endpoint
SHARED = 64                     # the first blocks, held by the other endpoint too
TOK = ModelTokenizer(TINY_DIR)
IDS = [(7 * i + i // 16) % 40 for i in range(16 * BLOCKS)]


def _manager(port: int) -> tuple[KVEventsManager, Subscriber, list[Endpoint]]:
    settings = KVEventsConfig(enabled=True, port=port, replay_port=None, stall_timeout_s=1000)
    pool = EndpointPool()
    manager = KVEventsManager(lambda model: settings, pool, CollectorRegistry(), {"m": TOK})
    eps = [pool.add(Endpoint(url=f"http://127.0.0.{i}:8000", model="m")) for i in (1, 2)]
    states = [manager.index.track(ep, settings) for ep in eps]
    big = Batch(0.0, [BlockStored(list(range(10_000, 10_000 + BLOCKS)), None, IDS, 16)], None)
    manager.index.apply(states[0], big)
    manager.index.apply(states[1], Batch(0.0, [BlockStored(list(range(10_000, 10_000 + SHARED)), None,
                                                           IDS[:16 * SHARED], 16)], None))
    return manager, Subscriber(manager, states[0]), eps


def _depths(manager: KVEventsManager, eps: list[Endpoint], rid: str) -> list[int]:
    req = parse("/v1/completions", orjson.dumps({"model": "m", "prompt": IDS[:16 * SHARED] + [1]}), {}, rid)
    got = manager.index.match(req, eps)
    assert got is not None
    return [got[0][ep] for ep in eps]


def _state(manager: KVEventsManager, eps: list[Endpoint]) -> tuple:
    idx = manager.index
    states = [idx.states[ep] for ep in eps]
    who = {s.slot: i for i, s in enumerate(states)}
    named = {k: sorted(who[b] for b in range(m.bit_length()) if m >> b & 1) for k, m in idx._holders.items()}
    return [(list(s.emap.items()), s.media, s.owned) for s in states], named, idx._children, idx._parent_of


async def test_a_clear_of_a_big_endpoint_runs_in_stretches_and_routes_on_none_of_its_old_blocks():
    port = listen_port()
    ctx = zmq.asyncio.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    manager, sub, eps = _manager(port)
    sent: list[bytes] = []
    seen: list[tuple[bool, int, list[int]]] = []    # (cleared yet, clears under way, depths) at each loop turn
    try:
        sub.start()
        seq = 0
        while 1 not in sub.st.emap:                 # the SUB socket connects (a slow joiner)
            sent.append(event_batch("vllm", [block_stored([1, 2], None, list(range(32)))]))
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), sent[-1]])
            seq += 1
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)
        assert _depths(manager, eps, "before") == [16 * SHARED, 16 * SHARED]
        after = [event_batch("vllm", [{"type": "AllBlocksCleared"}]),
                 event_batch("vllm", [block_stored(list(range(10_000, 10_008)), None, IDS[:16 * 8])])]
        for payload in after:
            sent.append(payload)
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            seq += 1
        cleared_at = seq - 1
        for i in range(200_000):                    # a hang guard, not a timing: one entry per loop turn
            done = sub.expected is not None and sub.expected > cleared_at
            seen.append((done, manager.index.retiring, _depths(manager, eps, f"r{i}")))
            if sub.expected == seq and not manager.index.retiring:
                break
            await asyncio.sleep(0)
        assert sub.expected == seq and not manager.index.retiring
        during = [(depths, n) for done, n, depths in seen if done]
        # the old entries were unlinked over many loop turns, this task running between them...
        assert sum(1 for _, n in during if n) >= BLOCKS // CLEAR_STRETCH
        # ...and no decision meanwhile counted the cleared endpoint's old blocks: none, or the 8 stored since
        assert {tuple(d) for d, _ in during} <= {(0, 16 * SHARED), (16 * 8, 16 * SHARED)}
        assert during[-1][0] == [16 * 8, 16 * SHARED]
        assert len(sub.st.emap) == 8

        ref, _, reps = _manager(listen_port())       # the same events, the clear at once
        ref.index.on_retired = None
        rsub = Subscriber(ref, ref.index.states[reps[0]])
        for payload in sent:
            ref.index.apply(rsub.st, rsub.decoder.decode(payload))
        assert _state(manager, eps) == _state(ref, reps)
        await ref.close()
    finally:
        await sub.stop()
        pub.close(0)
        await manager.close()
