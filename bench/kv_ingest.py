"""Cost of the gateway's KV-event ingest: ``python -m bench.kv_ingest [--batches N] [--repeat R]``.

Every engine's KV events land on the gateway's one event loop, so their cost is CPU taken from
request handling. This feeds a realistic stream of event batches, already encoded, through one
subscriber's ``on_message`` (sequence check, ``kv_wire.decode_batch``, ``EventIndex.apply``, the
per-kind counters), exactly as a received message goes, without sockets; and through
``decode_batch`` alone. It prints events per second and microseconds per batch, per encoding, in
CPU time (``time.process_time``, best of ``--repeat``), so other load on the machine matters less:

* ``map``: batch and events as maps tagged ``type`` (what ``enginesim`` publishes by default);
* ``vllm``: the batch a positional array, its events maps tagged ``type`` (vLLM today);
* ``array``: batch and events positional arrays, the tag first (older engines).

The stream is what a prefix-caching engine publishes under the routing benchmark's workload
(``bench.routing``): ``--engines`` engines, each with an LRU cache of ``--kv-blocks`` blocks of 16
tokens; requests share one of 40 system prompts (125 blocks, Zipf popularity, most of them sent to
the engine that holds theirs) and add a few blocks of their own, a share of them unique prompts
(about 75 blocks); a request's evictions go out as one batch (one ``BlockRemoved`` per evicted
block, as vLLM sends them) and its newly cached blocks as another (one ``BlockStored`` chained on
the last block it hit). At steady state that is about 15 events per batch, mostly single-block
removals, and a ``BlockStored`` of some 30 blocks in every other batch (the routing benchmark's
events column measured 8 events per batch and 25 blocks per ``BlockStored`` over a quick run whose
caches are filling for part of it). Hashes are 64-bit ints (vLLM's default); ``--bytes-hashes``
sends 32-byte hashes instead. The socket reads are not in it (``gateway.kv.events`` reads a SUB
socket in a reader callback).

``--large`` measures one large message instead, as ``on_message`` takes it (sequence, decode, apply,
a large one in stretches): the longest the event loop is held meanwhile (the largest gap between
the turns of another task, which yields at every turn), the time the whole message takes and the
loop's turns meanwhile, in wall-clock time (best and worst of ``--repeat``). The messages: a
128k-token prompt's ``BlockStored`` (8,192 blocks with their token ids, vLLM's encoding), the same
after the 8,192 single-block ``BlockRemoved`` of what it evicted, and two near the 8 MiB bound: a
``BlockStored`` of 110,000 blocks (1.76M tokens) and 150,000 ``BlockRemoved`` of indexed blocks;
then a replay of 256 batches of about 60 KB (a 13.6k-token prompt's blocks each) from a ROUTER
socket on loopback; then an ``AllBlocksCleared`` of an endpoint holding ``max_blocks_per_endpoint``
(262,144) blocks, alone and as one of 4 endpoints holding the same blocks (what a restart, a gap
that cannot be replayed or an endpoint leaving the pool clears the same way), until its old entries
are unlinked from the index.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import time
from collections import OrderedDict
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from bench.view_catch_up import timed
from gateway.endpoints import Endpoint, EndpointPool
from gateway.kv.events import KVEventsManager, Subscriber
from gateway.kv.settings import KVEventsConfig
from gateway.kv.wire import Batch, BlockStored, decode_batch

BLOCK = 16
ENCODINGS = ("map", "vllm", "array")
_encode = msgspec.msgpack.Encoder().encode


class _Engine:
    """One engine's prefix cache: an LRU of chained block hashes, and the events it publishes."""

    def __init__(self, capacity: int, rng: random.Random, bytes_hashes: bool) -> None:
        self.capacity = capacity
        self.cached: OrderedDict[int, None] = OrderedDict()
        self.rng = rng
        self.bytes_hashes = bytes_hashes

    def wire(self, h: int) -> Any:
        return h.to_bytes(8, "big") * 4 if self.bytes_hashes else h

    def request(self, blocks: list[tuple[int, list[int]]]) -> list[list[dict]]:
        """The batches one request's prefill produces: its evictions, then its stored blocks."""
        hit = 0
        while hit < len(blocks) and blocks[hit][0] in self.cached:
            self.cached.move_to_end(blocks[hit][0])
            hit += 1
        new = blocks[hit:]
        removed: list[dict] = []
        while new and len(self.cached) + len(new) > self.capacity:
            h, _ = self.cached.popitem(last=False)
            removed.append({"type": "BlockRemoved", "block_hashes": [self.wire(h)], "medium": "GPU"})
        out = [removed] if removed else []
        if new:
            for h, _ in new:
                self.cached[h] = None
            parent = self.wire(blocks[hit - 1][0]) if hit else None
            out.append([{"type": "BlockStored", "block_hashes": [self.wire(h) for h, _ in new],
                         "parent_block_hash": parent, "token_ids": [t for _, ids in new for t in ids],
                         "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None}])
        return out


def _chain(rng: random.Random, parent: int, n: int) -> list[tuple[int, list[int]]]:
    out = []
    for _ in range(n):
        ids = [rng.randrange(12288) for _ in range(BLOCK)]
        parent = hash((parent, tuple(ids))) & (2 ** 64 - 1)
        out.append((parent, ids))
    return out


def event_stream(batches: int, engines: int, kv_blocks: int, seed: int = 1,
                 bytes_hashes: bool = False) -> list[tuple[int, list[dict]]]:
    """``(engine, events)`` per batch, events as maps (``encode`` turns them into each encoding)."""
    rng = random.Random(seed)
    systems = [_chain(rng, 0, 125) for _ in range(40)]
    weights = [1 / (i + 1) ** 0.8 for i in range(len(systems))]
    fleet = [_Engine(kv_blocks, rng, bytes_hashes) for _ in range(engines)]
    conversations: list[tuple[int, list[tuple[int, list[int]]]]] = []      # (engine, blocks so far)
    out: list[tuple[int, list[dict]]] = []
    while len(out) < batches:
        r = rng.random()
        if r < 0.15:                                  # a unique prompt, anywhere
            e = rng.randrange(engines)
            blocks = _chain(rng, rng.getrandbits(63), rng.randint(38, 112))
        elif r < 0.35 or not conversations:           # a new conversation, where its system prompt is
            s = rng.choices(range(len(systems)), weights)[0]
            e = s % engines if rng.random() < 0.9 else rng.randrange(engines)
            blocks = systems[s] + _chain(rng, systems[s][-1][0], rng.randint(3, 10))
            conversations.append((e, blocks))
            if len(conversations) > 200:
                conversations.pop(0)
        else:                                         # the next turn of a conversation, on its engine
            k = rng.randrange(len(conversations))
            e, prev = conversations[k]
            blocks = prev + _chain(rng, prev[-1][0], rng.randint(3, 10))
            conversations[k] = (e, blocks)
        out.extend((e, evs) for evs in fleet[e].request(blocks))
    return out[:batches]


def _as_array(ev: dict) -> list:
    if ev["type"] == "BlockStored":
        return ["BlockStored", ev["block_hashes"], ev["parent_block_hash"], ev["token_ids"], ev["block_size"],
                ev["lora_id"], ev["medium"], ev["lora_name"]]
    return ["BlockRemoved", ev["block_hashes"], ev["medium"]]


def encode(stream: list[tuple[int, list[dict]]], encoding: str) -> list[tuple[int, bytes]]:
    out = []
    for i, (e, events) in enumerate(stream):
        ts = 1_700_000_000.0 + i / 1000
        if encoding == "map":
            batch: Any = {"ts": ts, "events": events, "data_parallel_rank": 0}
        elif encoding == "vllm":
            batch = [ts, events, 0]
        else:
            batch = [ts, [_as_array(ev) for ev in events], 0]
        out.append((e, _encode(batch)))
    return out


def _subscribers(engines: int) -> tuple[KVEventsManager, list[Subscriber]]:
    settings = KVEventsConfig(enabled=True)
    pool = EndpointPool()
    manager = KVEventsManager(lambda model: settings, pool, CollectorRegistry(), {})
    subs = []
    for i in range(engines):
        ep = pool.add(Endpoint(url=f"http://10.0.0.{i + 1}:8000", model="m"))
        subs.append(Subscriber(manager, manager.index.track(ep, settings)))
    return manager, subs


async def _ingest(payloads: list[tuple[int, bytes]], engines: int) -> tuple[float, KVEventsManager]:
    manager, subs = _subscribers(engines)
    seqs = [0] * engines
    t = time.process_time()
    for e, payload in payloads:
        await subs[e].on_message(seqs[e], payload)
        seqs[e] += 1
    return time.process_time() - t, manager


def _decode(payloads: list[tuple[int, bytes]]) -> float:
    t = time.process_time()
    for _, payload in payloads:
        decode_batch(payload)
    return time.process_time() - t


def _large_messages(rng: random.Random) -> list[tuple[str, list[bytes], bytes]]:
    """(name, messages applied before it, the message) for ``--large``."""
    def stored(n: int) -> tuple[list[int], dict]:
        hashes = [rng.getrandbits(64) for _ in range(n)]
        return hashes, {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                        "token_ids": [rng.randrange(128_256) for _ in range(BLOCK * n)], "block_size": BLOCK,
                        "lora_id": None, "medium": "GPU", "lora_name": None}

    def removed(hashes: list[int]) -> list[dict]:
        return [{"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"} for h in hashes]

    _, prompt = stored(8192)
    old, evicted = stored(8192)
    _, long = stored(110_000)
    held, many = stored(150_000)
    return [("128k-token prompt: BlockStored of 8,192 blocks", [], _encode([0.0, [prompt], 0])),
            ("the same with the 8,192 BlockRemoved it evicted", [_encode([0.0, [evicted], 0])],
             _encode([0.0, [*removed(old), prompt], 0])),
            ("BlockStored of 110,000 blocks (1.76M tokens)", [], _encode([0.0, [long], 0])),
            ("150,000 BlockRemoved of indexed blocks", [_encode([0.0, [many], 0])], _encode([0.0, removed(held), 0]))]


def _replayed(rng: random.Random) -> list[bytes]:
    """256 batches of about 60 KB, a 13.6k-token prompt's ``BlockStored`` each (850 blocks)."""
    return [_encode([0.0, [{"type": "BlockStored", "block_hashes": [rng.getrandbits(64) for _ in range(850)],
                            "parent_block_hash": None, "token_ids": [rng.randrange(128_256) for _ in range(BLOCK * 850)],
                            "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None}], 0])
            for _ in range(256)]


async def _replay_hold(payloads: list[bytes]) -> tuple[float, float, int]:
    """``_hold`` of a replay bringing ``payloads``, from a ROUTER socket on loopback."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    async def serve() -> None:
        ident, _, _ = await router.recv_multipart()
        for seq, payload in enumerate(payloads):
            await router.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
        await router.send_multipart([ident, b"", (-1).to_bytes(8, "big", signed=True), b""])

    settings = KVEventsConfig(enabled=True, port=port + 1, replay_port=port, replay_timeout_s=60)
    pool = EndpointPool()
    manager = KVEventsManager(lambda model: settings, pool, CollectorRegistry(), {})
    sub = Subscriber(manager, manager.index.track(pool.add(Endpoint(url="http://127.0.0.1:8000", model="m")),
                                                  settings))
    server = asyncio.create_task(serve())
    try:
        return await _hold(sub, lambda: sub.replay(0, len(payloads)))
    finally:
        server.cancel()
        await manager.close()
        router.close(0)
        ctx.term()


async def _message_hold(before: list[bytes], payload: bytes) -> tuple[float, float, int]:
    _, (sub,) = _subscribers(1)
    for seq, p in enumerate(before):
        await sub.on_message(seq, p)
    return await _hold(sub, lambda: sub.on_message(len(before), payload))


async def _clear_hold(engines: int, hashes: list[int], tokens: list[int]) -> tuple[float, float, int]:
    """``_hold`` of an ``AllBlocksCleared`` to the first of ``engines`` endpoints, each holding the
    blocks ``hashes`` (their tokens ``tokens``)."""
    manager, subs = _subscribers(engines)
    stored = Batch(0.0, [BlockStored(hashes, None, tokens, BLOCK, medium="GPU")], None)
    for sub in subs:
        manager.index.apply(sub.st, stored)
    assert len(subs[0].st.emap) == len(hashes)
    payload = _encode([0.0, [{"type": "AllBlocksCleared"}], 0])

    async def cleared() -> None:       # the message, then its old entries unlinked (``EventIndex.drain``)
        await subs[0].on_message(0, payload)
        while manager.index.retiring:
            await asyncio.sleep(0)

    return await _hold(subs[0], cleared)


async def _rank_clear_hold(ranks: int, hashes: list[int], tokens: list[int]) -> tuple[float, float, int]:
    """``_hold`` of an ``AllBlocksCleared`` from rank 1 of an endpoint of ``ranks`` data-parallel
    ranks, each rank holding the blocks ``hashes`` (their tokens ``tokens``)."""
    settings = KVEventsConfig(enabled=True, data_parallel_size=ranks)
    pool = EndpointPool()
    manager = KVEventsManager(lambda model: settings, pool, CollectorRegistry(), {})
    st = manager.index.track(pool.add(Endpoint(url="http://10.0.0.1:8000", model="m")), settings)
    subs = [Subscriber(manager, st, r) for r in range(ranks)]
    for r in range(ranks):            # rank r's hashes as its subscriber qualifies them (``kv_wire.rank_of``)
        manager.index.apply(st, Batch(0.0, [BlockStored([(r, h) for h in hashes] if r else hashes, None, tokens,
                                                        BLOCK, medium="GPU")], r), r)
    assert len(st.emap) == ranks * len(hashes)
    payload = _encode([0.0, [{"type": "AllBlocksCleared"}], 1])

    async def cleared() -> None:       # the message, then what it left to unlink (``EventIndex.drain``)
        await subs[1].on_message(0, payload)
        while manager.index.retiring:
            await asyncio.sleep(0)

    return await _hold(subs[1], cleared)


async def _hold(sub: Subscriber, take: Any) -> tuple[float, float, int]:
    """(longest loop hold, whole message, loop turns) while ``take()`` runs, in seconds."""
    gc.collect()
    total, longest, turns = await timed(take())
    return longest, total, turns


def large(repeat: int) -> None:
    print("| message | MiB | longest loop hold (ms) | whole message (ms) | loop turns |")
    print("|---|---:|---:|---:|---:|")
    for name, before, payload in _large_messages(random.Random(1)):
        _row(name, len(payload), [asyncio.run(_message_hold(before, payload)) for _ in range(repeat)])
    payloads = _replayed(random.Random(2))
    _row("a replay of 256 batches of 60 KB (850 blocks each)", sum(map(len, payloads)),
         [asyncio.run(_replay_hold(payloads)) for _ in range(repeat)])
    rng = random.Random(3)
    n = KVEventsConfig().max_blocks_per_endpoint
    hashes = [rng.getrandbits(64) for _ in range(n)]
    tokens = [rng.randrange(128_256) for _ in range(BLOCK * n)]
    clear = len(_encode([0.0, [{"type": "AllBlocksCleared"}], 0]))
    for engines, name in ((1, f"AllBlocksCleared of an endpoint holding {n:,} blocks"),
                          (4, "the same, one of 4 endpoints holding the same blocks")):
        _row(name, clear, [asyncio.run(_clear_hold(engines, hashes, tokens)) for _ in range(repeat)])
    half = n // 2
    _row(f"AllBlocksCleared of one of 2 data-parallel ranks holding {half:,} blocks each", clear,
         [asyncio.run(_rank_clear_hold(2, hashes[:half], tokens[:BLOCK * half])) for _ in range(repeat)])


def _row(name: str, size: int, runs: list[tuple[float, float, int]]) -> None:
    hold, took, turns = ([r[i] for r in runs] for i in range(3))
    print(f"| {name} | {size / 2 ** 20:.2f} | {1e3 * min(hold):.0f}-{1e3 * max(hold):.0f} | "
          f"{1e3 * min(took):.0f}-{1e3 * max(took):.0f} | {min(turns)}-{max(turns)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=6000)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--kv-blocks", type=int, default=1536)
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    ap.add_argument("--bytes-hashes", action="store_true", help="32-byte block hashes instead of ints")
    ap.add_argument("--encodings", nargs="+", default=list(ENCODINGS), choices=ENCODINGS)
    ap.add_argument("--large", action="store_true", help="how long one large message holds the event loop")
    args = ap.parse_args()
    if args.large:
        large(args.repeat)
        return
    stream = event_stream(args.batches, args.engines, args.kv_blocks, bytes_hashes=args.bytes_hashes)
    events = sum(len(evs) for _, evs in stream)
    stored = [ev for _, evs in stream for ev in evs if ev["type"] == "BlockStored"]
    blocks = sum(len(ev["block_hashes"]) for ev in stored)
    print(f"{len(stream)} batches, {events} events ({events / len(stream):.1f} per batch; {len(stored)} BlockStored "
          f"of {blocks / max(1, len(stored)):.1f} blocks, {events - len(stored)} BlockRemoved), {args.engines} engines")
    print("| encoding | decode (events/s) | decode + apply (events/s) | µs per batch (decode + apply) |")
    print("|---|---:|---:|---:|")
    for encoding in args.encodings:
        payloads = encode(stream, encoding)
        dec, ing = [], []
        for _ in range(args.repeat):
            gc.collect()
            dec.append(_decode(payloads))
            gc.collect()
            took, manager = asyncio.run(_ingest(payloads, args.engines))
            ing.append(took)
            assert manager.index.blocks() > 0
        print(f"| {encoding} | {events / min(dec):,.0f} | {events / min(ing):,.0f} | "
              f"{1e6 * min(ing) / len(payloads):.1f} |")


if __name__ == "__main__":
    main()
