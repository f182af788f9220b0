"""Routing quality in simulated time: ``python -m bench.routing_sim [--replicas N] [--strategies ...]``.

``bench.routing`` measures on loopback with real sockets, so on a busy machine its TTFTs carry the
process's own CPU lag (the engines' sleeps wake late, slots stay busy longer, queues grow). This
runs the same workload (``bench.routing.make_schedule``, the same ``Workload`` and ``EngineModel``)
through the gateway's real routers in a discrete-event simulation: nothing sleeps, the result does
not depend on the machine, and a run takes seconds.

What is real: the routers (``prefix-cache`` on the approximate index, or on the event index fed
by ``BlockStored``/``BlockRemoved`` events), the tokenizer (``enginesim.tiny_tokenizer``) and the
engines' KV pool (``enginesim.kvcache.BlockPool``: prefix caching, LRU eviction, events). What is
modelled: an engine admits FIFO while it has a slot (``max_num_seqs``) and KV blocks, prefills in
``ttft_base_ms + prefill_ms_per_token`` × uncached tokens, then decodes ``max_tokens`` tokens at
``itl_ms + itl_growth_per_running`` × running ms each. Each gateway replica has its own in-flight
counts, indexes and scrapes (every ``--scrape-s``, like ``scrape.interval_s``: running, waiting and
the replica's own in-flight then, as the monitor records them); events reach every replica
``--event-delay-ms`` after the engine stores or evicts. An answer is a fixed text per turn.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import orjson

from bench.routing import (
    EVENTS,
    MODEL,
    WORKLOADS,
    EngineModel,
    Sample,
    Workload,
    _pct,
    make_schedule,
    reachable_hit,
    tokenizer_dir,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._n = 0

    def __call__(self) -> float:
        return self.now

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        self._n += 1
        heapq.heappush(self._heap, (t, self._n, fn, args))

    def run(self) -> None:
        while self._heap:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            fn(*args)


@dataclass(eq=False)
class Job:
    messages: list[dict]
    sent: float
    replica: int
    endpoint: Any = None           # the replica's Endpoint object
    prompt_ids: list[int] | None = None
    hashes: list[bytes] | None = None
    alloc: Any = None
    sample: Sample | None = None
    done: Callable[[Job], None] | None = None


class _Publisher:
    """BlockPool's event hooks, delivered to every replica's event index after a delay."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    def stored(self, hashes, parent, token_ids, block_size, lora_name, extra_keys=None) -> None:
        from gateway.kv.wire import BlockStored

        self.engine.emit(BlockStored(list(hashes), parent, list(token_ids), block_size, lora_name, "GPU", None,
                                     extra_keys))

    def removed(self, hashes) -> None:
        from gateway.kv.wire import BlockRemoved

        self.engine.emit(BlockRemoved(list(hashes), "GPU", None))

    def cleared(self) -> None:
        from gateway.kv.wire import AllBlocksCleared

        self.engine.emit(AllBlocksCleared())


class SimEngine:
    def __init__(self, idx: int, em: EngineModel, clock: Clock, delay_s: float) -> None:
        from enginesim.kvcache import BlockPool

        self.idx, self.em, self.clock, self.delay_s = idx, em, clock, delay_s
        self.pool = BlockPool(em.kv_blocks, em.block_size, True)
        self.running: set[Job] = set()
        self.waiting: deque[Job] = deque()
        self.listeners: list[Callable[[list], None]] = []
        self._batch: list = []

    def emit(self, ev: Any) -> None:
        if not self._batch:
            self.clock.at(self.clock.now + self.delay_s, self._flush)
        self._batch.append(ev)

    def _flush(self) -> None:
        batch, self._batch = self._batch, []
        for listener in self.listeners:
            listener(batch)

    def submit(self, job: Job) -> None:
        self.waiting.append(job)
        self._schedule()

    def _schedule(self) -> None:
        em = self.em
        while self.waiting and len(self.running) < em.max_num_seqs:
            job = self.waiting[0]
            alloc = self.pool.allocate(job.hashes, len(job.prompt_ids))
            if alloc is None:
                break
            self.waiting.popleft()
            alloc.token_ids = job.prompt_ids
            alloc.lora_name = None
            job.alloc = alloc
            self.running.add(job)
            cached = alloc.hit_blocks * self.pool.block_size
            job.sample.cached_tokens = cached
            uncached = len(job.prompt_ids) - cached
            self.clock.at(self.clock.now + (em.ttft_base_ms + em.prefill_ms_per_token * uncached) / 1000,
                          self._prefilled, job)

    def _prefilled(self, job: Job) -> None:
        self.pool.commit(job.alloc)
        job.sample.ttft = self.clock.now - job.sent
        em = self.em
        decode = job.sample.output_tokens * (em.itl_ms + em.itl_growth_per_running * len(self.running)) / 1000
        self.clock.at(self.clock.now + decode, self._finished, job)

    def _finished(self, job: Job) -> None:
        self.pool.free(job.alloc)
        self.running.discard(job)
        job.sample.e2e = self.clock.now - job.sent
        self._schedule()
        assert job.done is not None
        job.done(job)


class _View:
    """The event index as ``RouterContext.precise_index`` sees it."""

    def __init__(self, index: Any) -> None:
        self.index = index

    def covers(self, model: str) -> bool:
        return True

    def match(self, req, candidates):
        return self.index.match(req, candidates)

    def routed(self, req, ep) -> None:
        self.index.routed(req, ep)


class Replica:
    def __init__(self, spec: str, engines: list[SimEngine], clock: Clock, routing: dict, kv_events: dict,
                 tok: Any, seed: int) -> None:
        from gateway.endpoints import Endpoint
        from gateway.kv.index import EventIndex
        from gateway.kv.settings import KVEventsConfig
        from routers.base import RouterContext, RoutingSettings
        from routers.registry import default_registry

        events = spec.endswith(EVENTS)
        self.eps = [Endpoint(url=f"http://10.0.{e.idx // 200}.{e.idx % 200 + 1}:8000", model=MODEL) for e in engines]
        self.by_engine = dict(zip(engines, self.eps, strict=True))
        precise = None
        if events:
            settings = KVEventsConfig(enabled=True, **kv_events)
            self.index = EventIndex({MODEL: tok}, lambda m: settings, clock)
            states = [self.index.track(ep, settings) for ep in self.eps]
            for engine, st in zip(engines, states, strict=True):
                engine.listeners.append(lambda batch, st=st: self._apply(st, batch))
            precise = _View(self.index)
        ctx = RouterContext(settings=msgspec_convert(routing, RoutingSettings), rng=random.Random(seed),
                            clock=clock, precise_index=precise)
        self.router = default_registry(ctx).get(spec.removesuffix(EVENTS))

    def _apply(self, st, batch) -> None:
        from gateway.kv.wire import Batch

        self.index.apply(st, Batch(0.0, batch, None))

    def scrape(self, engines: list[SimEngine], now: float) -> None:
        from gateway.endpoints import EngineMetrics

        for engine in engines:
            ep = self.by_engine[engine]
            ep.metrics = EngineMetrics(scraped_at=now, running=float(len(engine.running)),
                                       waiting=float(len(engine.waiting)), gateway_in_flight=ep.in_flight)


def msgspec_convert(values: dict, cls: type) -> Any:
    import msgspec

    return msgspec.convert(values, cls)


@dataclass
class SimResult:
    strategy: str
    requests: int
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    cache_hit: float
    reachable_hit: float
    fallbacks: dict


def simulate(spec: str, w: Workload, em: EngineModel, replicas: int = 1, routing: dict | None = None,
             kv_events: dict | None = None, scrape_s: float = 0.5, event_delay_ms: float = 2.0,
             tok: Any = None) -> SimResult:
    from enginesim.kvcache import root_key
    from gateway.kv.tokenization import ModelTokenizer
    from gateway.request import CHAT, parse

    tok = tok or ModelTokenizer(tokenizer_dir(w))
    sched = make_schedule(w)
    clock = Clock()
    engines = [SimEngine(i, em, clock, event_delay_ms / 1000) for i in range(w.engines)]
    for engine in engines:
        engine.pool.events = _Publisher(engine)
    gws = [Replica(spec, engines, clock, dict(routing or {}), dict(kv_events or {}), tok, w.seed + 31 * r)
           for r in range(replicas)]
    pick = random.Random(w.seed + 17)
    root = root_key(MODEL, "")
    samples: list[Sample] = []
    fallbacks: dict[str, int] = {}
    n_req = [0]

    def scrape() -> None:
        for gw in gws:
            gw.scrape(engines, clock.now)
        if clock.now < w.duration_s + 60:
            clock.at(clock.now + scrape_s, scrape)

    def send(messages: list[dict], kind: str, done: Callable[[Job], None]) -> None:
        r = pick.randrange(replicas)
        gw = gws[r]
        n_req[0] += 1
        body = orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": w.max_tokens})
        req = parse(CHAT, body, {}, f"r{n_req[0]}")
        ids = tok.encode(tok.render(messages))
        job = Job(messages=list(messages), sent=clock.now, replica=r, prompt_ids=ids)
        job.sample = Sample(sent=clock.now, ttft=None, e2e=0.0, status=200, prompt_tokens=len(ids),
                            output_tokens=w.max_tokens, kind=kind, messages=job.messages)
        job.hashes = engines[0].pool.block_hashes(ids, root)
        decision = gw.router.route(req, gw.eps)
        ep = decision.endpoint
        ep.in_flight += 1
        job.endpoint = ep
        engine = engines[gw.eps.index(ep)]
        job.sample.endpoint = str(engine.idx)

        def finished(j: Job) -> None:
            j.endpoint.in_flight -= 1
            samples.append(j.sample)
            done(j)

        job.done = finished
        engine.submit(job)

    ctx_fallback = fallbacks

    def start_conversation(c) -> None:
        messages: list[dict] = [{"role": "system", "content": sched.systems[c.system]}]

        def turn(k: int) -> None:
            if clock.now >= w.duration_s:
                return
            messages.append({"role": "user", "content": c.questions[k]})

            def done(job: Job, k: int = k) -> None:
                messages.append({"role": "assistant", "content": f"Answer {c.cid}.{k}: " + c.questions[k][:60]})
                if k + 1 < len(c.questions) and clock.now + c.thinks[k] < w.duration_s:
                    clock.at(clock.now + c.thinks[k], turn, k + 1)

            send(list(messages), "turn", done)

        turn(0)

    for c in sched.conversations:
        clock.at(c.start, start_conversation, c)
    for s in sched.singles:
        clock.at(s.start, send, [{"role": "user", "content": s.prompt}], "unique", lambda job: None)
    clock.at(0.0, scrape)
    clock.run()
    del ctx_fallback
    measured = [s for s in samples if w.warmup_s <= s.sent < w.duration_s and s.ttft is not None]
    ttfts = sorted(1000 * (s.ttft or 0.0) for s in measured)
    prompt = sum(s.prompt_tokens for s in measured)
    reach, _ = reachable_hit(samples, w, em.block_size)
    label = spec + (f" ×{replicas} replicas" if replicas > 1 else "")
    return SimResult(label, len(measured), statistics.fmean(ttfts) if ttfts else math.nan, _pct(ttfts, 0.5),
                     _pct(ttfts, 0.99), sum(s.cached_tokens for s in measured) / prompt if prompt else 0.0,
                     reach, fallbacks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.routing_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategies", nargs="+", default=["random", "prefix-cache", "prefix-cache" + EVENTS])
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="20 s of arrivals (6 s warm-up), like bench.routing")
    ap.add_argument("--duration", type=float)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="default", help="as bench.routing's")
    ap.add_argument("--kv-blocks", type=int)
    ap.add_argument("--scrape-s", type=float, default=0.5, help="scrape interval (the benchmark's 0.5 s)")
    ap.add_argument("--event-delay-ms", type=float, default=2.0)
    ap.add_argument("--routing", nargs="*", default=[], metavar="KEY=VALUE")
    ap.add_argument("--kv-events", nargs="*", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    w: Workload = replace(WORKLOADS[args.workload], seed=args.seed)
    if args.quick:
        w = replace(w, duration_s=min(w.duration_s, 20.0), warmup_s=min(w.warmup_s, 6.0))
    if args.duration:
        w = replace(w, duration_s=args.duration, warmup_s=min(w.warmup_s, args.duration / 4))
    em = EngineModel() if not args.kv_blocks else EngineModel(kv_blocks=args.kv_blocks)
    routing = {k: json.loads(v) for k, _, v in (i.partition("=") for i in args.routing)}
    kv = {k: json.loads(v) for k, _, v in (i.partition("=") for i in args.kv_events)}
    print("| strategy | TTFT mean (ms) | vs random | p50 | p99 | cache hit | reachable |\n|---|---:|---:|---:|---:|---:|---:|")
    base = None
    for spec in args.strategies:
        r = simulate(spec, w, em, args.replicas, routing, kv, args.scrape_s, args.event_delay_ms)
        if spec == "random":
            base = r.ttft_mean_ms
        ratio = f"{r.ttft_mean_ms / base:.2f}×" if base else "–"
        print(f"| `{r.strategy}` | {r.ttft_mean_ms:.0f} | {ratio} | {r.ttft_p50_ms:.0f} | {r.ttft_p99_ms:.0f} | "
              f"{r.cache_hit:.1%} | {r.reachable_hit:.1%} |", flush=True)
    print(f"\n{w.engines} engines, {w.duration_s:.0f} s of arrivals, seed {w.seed}, {args.replicas} replica(s), "
          f"routing {routing or 'defaults'}, kv_events {kv or 'defaults'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
