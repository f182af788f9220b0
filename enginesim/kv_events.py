"""KV-cache events in vLLM's wire format (``--kv-events-port``): what the engine caches, published.

vLLM's ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
"tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ...}'``, imitated:

* a ZMQ PUB socket sends ``(topic, seq as 8 bytes big-endian, msgpack batch)`` per engine step that
  changed the cache; seq counts from 0 in each process (a restarted engine starts again);
* a batch is ``{"ts", "events", "data_parallel_rank"}`` with events as maps tagged ``type``
  (``--kv-events-encoding map``, today's vLLM), or ``[ts, events, rank]`` with positional event
  arrays, the tag first (``array``, older engines);
* ``BlockStored{block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys}`` when a prefill's full prompt blocks enter the prefix cache (``extra_keys``:
  one entry per block, as vLLM folds them into its hashes: the LoRA's name, the ``cache_salt`` on the
  first block, else null; a simulated SGLang sends none, and names a salted request's salt as
  ``cache_salt`` instead, map encoding only, as SGLang 0.5.23 does), ``BlockRemoved`` when a
  cached block is evicted, ``AllBlocksCleared`` on a cache reset; block hashes are ints, the low 64
  bits of the pool's block hash, as vLLM sends them by default;
* a ROUTER socket on ``--kv-events-replay-port`` answers an 8-byte start seq with every buffered
  ``(seq, payload)`` from there (the last ``buffer_steps`` batches), then seq -1.

Data parallelism (``--data-parallel-size N``): vLLM runs one publisher per DP rank, rank r bound on
``port + r`` (and ``replay_port + r``), each counting its own seq and naming its rank in
``data_parallel_rank``. ``RankedPublishers`` holds them; each rank has its own cache pool
(``enginesim.engine``), which publishes through its rank's publisher, so a rank's stream is the
history of its own cache. With port 0, rank 0 takes a free port and the other ranks the ports
after it.

Events raised in one event-loop turn go out as one batch. ``drop_next`` (tests) publishes nothing
for the next N batches while still buffering them for replay, which is how a subscriber sees a gap;
``paused`` holds every batch back (a stalled publisher).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

import msgspec

log = logging.getLogger("enginesim.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_encode = msgspec.msgpack.Encoder().encode


def engine_hash(h: bytes) -> int:
    """The int a vLLM publisher sends for a block hash: its low 64 bits."""
    return int.from_bytes(h[-8:], "big")


class KVEventPublisher:
    def __init__(self, host: str, port: int, replay_port: int, topic: str, encoding: str,
                 buffer_steps: int = 10_000, rank: int = 0) -> None:
        import zmq
        import zmq.asyncio

        self.rank = rank
        self.ctx = zmq.asyncio.Context()
        # XPUB: a PUB that also hands over its subscribers' subscriptions (every one, verbose), so
        # ``subscriptions`` tells a test when a subscriber is listening; events published before
        # then never reach it, as from vLLM's PUB
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.replay = None
        self.replay_port = 0
        try:
            self.port = self._bind(self.pub, host, port)
            if replay_port >= 0 and replay_port is not None:
                self.replay = self.ctx.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay_port = self._bind(self.replay, host, replay_port)
        except zmq.ZMQError:
            self.close_sockets()
            raise
        # sends go through a plain socket on the same handle: a PUB socket never blocks (it drops
        # at its high-water mark), so the asyncio wrapper's future per send is pure overhead
        self._send = zmq.Socket.shadow(self.pub.underlying).send_multipart
        self._noblock = zmq.NOBLOCK
        self._again = zmq.Again
        self.topic = topic.encode()
        self.array = encoding == "array"
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.pending: list[Any] = []
        self.held: list[Any] = []
        self.drop_next = 0
        self.paused = False
        self.published = 0
        self.replays_served = 0
        self.subscriptions = 0          # subscribe messages received: one per subscriber and topic
        self._flush_scheduled = False
        self._replay_task: asyncio.Task | None = None
        self._subs_task: asyncio.Task | None = None

    @staticmethod
    def _bind(sock: Any, host: str, port: int) -> int:
        if port:
            sock.bind(f"tcp://{host}:{port}")
            return port
        return sock.bind_to_random_port(f"tcp://{host}")

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._subs_task = loop.create_task(self._read_subscriptions())
        if self.replay is not None:
            self._replay_task = loop.create_task(self._serve_replay())

    async def close(self) -> None:
        for task in (self._replay_task, self._subs_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self.close_sockets()

    async def _read_subscriptions(self) -> None:
        while True:
            msg = await self.pub.recv()
            if msg[:1] == b"\x01":
                self.subscriptions += 1

    def close_sockets(self) -> None:
        self.pub.close(0)
        if self.replay is not None:
            self.replay.close(0)
        self.ctx.term()

    # -- events ------------------------------------------------------------------------------------

    def stored(self, hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int,
               lora_name: str | None, extra_keys: list | None = None, cache_salt: str | None = None) -> None:
        ints = [engine_hash(h) for h in hashes]
        par = engine_hash(parent) if parent is not None else None
        if self.array:
            ev: Any = ["BlockStored", ints, par, token_ids, block_size, None, "GPU", lora_name]
            if extra_keys is not None:
                ev.append(extra_keys)
        else:
            ev = {"type": "BlockStored", "block_hashes": ints, "parent_block_hash": par, "token_ids": token_ids,
                  "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": lora_name}
            if extra_keys is not None:
                ev["extra_keys"] = extra_keys
            if cache_salt is not None:
                ev["cache_salt"] = cache_salt       # SGLang (map encoding): the storing request's salt
        self._add(ev)

    def removed(self, hashes: list[bytes]) -> None:
        ints = [engine_hash(h) for h in hashes]
        self._add(["BlockRemoved", ints, "GPU"] if self.array
                  else {"type": "BlockRemoved", "block_hashes": ints, "medium": "GPU"})

    def cleared(self) -> None:
        self._add(["AllBlocksCleared"] if self.array else {"type": "AllBlocksCleared"})

    def _add(self, ev: Any) -> None:
        self.pending.append(ev)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:        # no loop (a unit test driving the pool): flush now
                self.flush()

    def flush(self) -> None:
        self._flush_scheduled = False
        if not self.pending:
            return
        events, self.pending = self.pending, []
        if self.paused:
            self.held.extend(events)
            return
        if self.held:
            events, self.held = self.held + events, []
        ts = time.time()
        batch: Any = ([ts, events, self.rank] if self.array
                      else {"ts": ts, "events": events, "data_parallel_rank": self.rank})
        payload = _encode(batch)
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if self.drop_next > 0:
            self.drop_next -= 1
            return
        with contextlib.suppress(self._again):
            self._send((self.topic, seq.to_bytes(8, "big"), payload), flags=self._noblock)
            self.published += 1

    def resume(self) -> None:
        self.paused = False
        if self.held:
            self.pending = self.held + self.pending
            self.held = []
            self.flush()

    async def _serve_replay(self) -> None:
        assert self.replay is not None
        while True:
            frames = await self.replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            self.replays_served += 1
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self.replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            await self.replay.send_multipart((client, b"", END_SEQ, b""))


class RankedPublishers:
    """``size`` rank publishers behind one engine, rank r on ``port + r`` (see the module docstring);
    the pool's ``events`` like a single ``KVEventPublisher``."""

    def __init__(self, host: str, port: int, replay_port: int, topic: str, encoding: str, size: int) -> None:
        import zmq

        for attempt in range(64):
            ranks: list[KVEventPublisher] = []
            try:
                first = KVEventPublisher(host, port, replay_port, topic, encoding, rank=0)
                ranks.append(first)
                for r in range(1, size):
                    ranks.append(KVEventPublisher(host, first.port + r,
                                                  first.replay_port + r if first.replay is not None else -1,
                                                  topic, encoding, rank=r))
            except zmq.ZMQError:
                for p in ranks:
                    p.close_sockets()
                if (port and replay_port != 0) or attempt == 63:   # the ports were asked for: taken
                    raise
                continue                        # a free port whose neighbours are taken: try another
            break
        self.ranks = ranks
        self.port = ranks[0].port
        self.replay_port = ranks[0].replay_port

    @property
    def subscriptions(self) -> int:
        """The subscriptions every rank has had (a subscriber of all ranks counts on each)."""
        return min(p.subscriptions for p in self.ranks)

    def start(self) -> None:
        for p in self.ranks:
            p.start()

    async def close(self) -> None:
        for p in self.ranks:
            await p.close()
