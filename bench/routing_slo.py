"""Latency objectives met: ``python -m bench.routing --workload slo [--quick] [--loads 0.6 2] [--strategies ...]``.

How many requests meet their latency objectives (``x-slo-ttft-ms``, ``x-slo-tpot-ms``) under each
strategy, on a fleet of engines of different speeds, below and above its capacity? One process,
one event loop, as ``bench.routing``: simulated vLLM engines (``enginesim``, in-process), the real
gateway in front of them on loopback, and an open-loop load generator that measures at the client
TTFT (sent → first chunk with generated text) and TPOT ((end − TTFT) / (output tokens − 1)).

Fleet (``FLEET``): two fast engines and two slow ones (the slow prefill 4× and decode 3× slower);
each runs at most ``max_num_seqs`` requests (the rest queue) and decodes slower as its batch grows.

Workload: Poisson arrivals at ``load`` × the fleet's capacity. The capacity is computed from the
engines' time model: each engine serves ``max_num_seqs`` requests at a time, each taking its
prefill (the question; the system prompt is cached) plus ``max_tokens − 1`` gaps at a full batch's
inter-token latency. Every request is one of ``system_prompts`` system prompts (Zipf popularity)
plus a unique question, and belongs to an objective class (``CLASSES``): *interactive* (tight TTFT
and TPOT: only a fast engine's decode meets it), *standard*, *relaxed*, and a few *impossible*
ones (a TTFT no engine reaches). A request's objective is *feasible* when an idle fast engine,
with nothing of the prompt cached, would meet it (its time model: ``ttft_base_ms +
prefill_ms_per_token`` × prompt tokens, and ``itl_ms``); the headline figure is the share of
feasible requests that met theirs, counting a request refused (429/503) or failed as missed.
The same schedule (arrivals, prompts, classes; seeded) is replayed for each strategy on fresh
engines; the first ``warmup_s`` seconds of arrivals are not measured (the latency models learn
then, and the caches fill).

A strategy label may end with ``+admission``: the same strategy with ``admission.enabled`` (the
gateway queues requests while every endpoint is saturated and sheds what waits too long), at
``ADMISSION_DEFAULTS`` (an engine counts as saturated from one request waiting; a request waits
at most a second in the gateway's queue: tight enough for TTFT objectives of seconds);
``--admission KEY=VALUE`` overrides them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import aiohttp

from bench.routing import MODEL, EngineModel, Workload, _pct, _vocab, gateway_config, send
from bench.routing import _pseudo_text as _text

ADMISSION = "+admission"
ADMISSION_DEFAULTS = {"max_waiting_per_endpoint": 1, "queue_timeout_s": 1.0}
STRATEGIES = ["least-request", "prefix-cache", "slo", "least-request" + ADMISSION, "slo" + ADMISSION]
QUICK_STRATEGIES = ["least-request", "prefix-cache", "slo"]

FAST = EngineModel(ttft_base_ms=10.0, prefill_ms_per_token=0.1, itl_ms=40.0, itl_growth_per_running=3.0,
                   max_num_seqs=4)
SLOW = EngineModel(ttft_base_ms=40.0, prefill_ms_per_token=0.4, itl_ms=120.0, itl_growth_per_running=6.0,
                   max_num_seqs=4)
FLEET = (FAST, FAST, SLOW, SLOW)


@dataclass(frozen=True)
class SloClass:
    name: str
    share: float
    ttft_ms: float
    tpot_ms: float


CLASSES = (SloClass("interactive", 0.30, 300.0, 60.0),
           SloClass("standard", 0.40, 1500.0, 160.0),
           SloClass("relaxed", 0.25, 5000.0, 300.0),
           SloClass("impossible", 0.05, 30.0, 60.0))


@dataclass(frozen=True)
class SloWorkload:
    duration_s: float = 50.0          # arrivals happen in [0, duration)
    warmup_s: float = 15.0            # requests sent before this are not measured
    system_prompts: int = 8
    system_tokens: int = 800
    zipf_s: float = 0.8
    question_tokens: tuple[int, int] = (100, 300)
    max_tokens: int = 24
    seed: int = 1


@dataclass
class Arrival:
    start: float
    system: int
    question: str
    cls: SloClass


def capacity(fleet: tuple[EngineModel, ...], w: SloWorkload) -> float:
    """Requests per second the fleet completes at full batches (see the module docstring)."""
    question = sum(w.question_tokens) / 2
    total = 0.0
    for em in fleet:
        gap = em.itl_ms + em.itl_growth_per_running * (em.max_num_seqs - 1)
        service_ms = em.ttft_base_ms + em.prefill_ms_per_token * question + (w.max_tokens - 1) * gap
        total += em.max_num_seqs / (service_ms / 1000.0)
    return total


def feasible(cls: SloClass, prompt_tokens: int, fleet: tuple[EngineModel, ...]) -> bool:
    """Whether an idle engine of the fleet's fastest kind, nothing cached, meets the objective."""
    return any(em.ttft_base_ms + em.prefill_ms_per_token * prompt_tokens <= cls.ttft_ms and em.itl_ms <= cls.tpot_ms
               for em in fleet)


def make_arrivals(w: SloWorkload, rate: float) -> tuple[list[str], list[Arrival]]:
    rng = random.Random(w.seed)
    vocab = _vocab()
    systems = [f"System prompt {i}: you are assistant number {i}. " + _text(rng, vocab, w.system_tokens)
               for i in range(w.system_prompts)]
    weights = [1.0 / (i + 1) ** w.zipf_s for i in range(w.system_prompts)]
    shares = [c.share for c in CLASSES]
    out: list[Arrival] = []
    t = rng.expovariate(rate)
    while t < w.duration_s:
        out.append(Arrival(t, rng.choices(range(w.system_prompts), weights)[0],
                           f"Question {len(out)}: " + _text(rng, vocab, rng.randint(*w.question_tokens)),
                           rng.choices(CLASSES, shares)[0]))
        t += rng.expovariate(rate)
    return systems, out


def _messages(systems: list[str], a: Arrival) -> list[dict]:
    return [{"role": "system", "content": systems[a.system]}, {"role": "user", "content": a.question}]


@dataclass
class Outcome:
    cls: str
    feasible: bool
    status: int
    ttft_ms: float | None
    tpot_ms: float | None
    met: bool
    endpoint: str


@dataclass
class SloResult:
    strategy: str
    load: float
    rate: float
    requests: int
    feasible: int
    attained: float            # met / feasible requests (refused and failed count as missed)
    attained_served: float     # met / feasible requests answered 200
    attained_all: float        # met / all requests
    refused: int               # 429 / 503
    failed: int                # other errors
    ttft_mean_ms: float
    ttft_p99_ms: float
    tpot_mean_ms: float
    per_class: dict[str, float] = field(default_factory=dict)
    fast_share: dict[str, float] = field(default_factory=dict)   # share of each class served by a fast engine
    model_error: dict[str, float] = field(default_factory=dict)  # the latency model's mean |obs − pred| / obs
    loop_lag_ms: float = 0.0
    wall_s: float = 0.0


async def start_fleet(fleet: tuple[EngineModel, ...], seed: int, tok: str) -> list:
    from enginesim import SimConfig, start_sim

    sims = []
    try:
        for em in fleet:
            sims.append(await start_sim(SimConfig(engine="vllm", model=MODEL, port=0, host="127.0.0.1", seed=seed,
                                                  tokenizer=tok, **asdict(em))))
    except BaseException:
        for s in sims:
            with contextlib.suppress(Exception):
                await s.close()
        raise
    return sims


def model_errors(page: str) -> dict[str, float]:
    """Mean of ``switchyard_slo_routing_prediction_error_ratio`` per objective, from a ``/metrics`` page."""
    acc: dict[str, list[float]] = {}
    for line in page.splitlines():
        for part in ("_sum{", "_count{"):
            prefix = "switchyard_slo_routing_prediction_error_ratio" + part
            if line.startswith(prefix):
                objective = line.split('objective="', 1)[1].split('"', 1)[0]
                acc.setdefault(objective, [0.0, 0.0])[part == "_count{"] += float(line.rpartition(" ")[2])
    return {k: s / n for k, (s, n) in acc.items() if n}


async def run_one(label: str, load: float, w: SloWorkload, routing: dict, admission: dict) -> SloResult:
    from enginesim.tiny_tokenizer import TINY_DIR
    from gateway.config.schema import config_from_dict
    from gateway.kv.tokenization import ModelTokenizer
    from gateway.server.app import GATEWAY_KEY
    from gateway.server.run import start

    wall0 = time.perf_counter()
    spec = label.removesuffix(ADMISSION)
    rate = load * capacity(FLEET, w)
    systems, arrivals = make_arrivals(w, rate)
    tok = ModelTokenizer(TINY_DIR)
    feasibility = {id(a): feasible(a.cls, len(tok.encode(tok.render(_messages(systems, a)))), FLEET)
                   for a in arrivals}
    sims = await start_fleet(FLEET, w.seed, str(TINY_DIR))
    fast_urls = {s.url.removeprefix("http://") for s, em in zip(sims, FLEET, strict=True) if em is FAST}
    raw = gateway_config(spec, False, [s.url for s in sims], str(TINY_DIR), routing)
    if label.endswith(ADMISSION):
        raw["admission"] = {"enabled": True, **ADMISSION_DEFAULTS, **admission}
    runner = None
    outcomes: list[tuple[Arrival, Outcome]] = []
    lags: list[float] = []
    try:
        runner, app, port = await start(config_from_dict(raw, source="<bench>"))
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        send_w = replace(Workload(), max_tokens=w.max_tokens)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
            t0 = time.perf_counter()
            loop_t0 = loop.time()

            async def sampler() -> None:
                while not stop.is_set():
                    want = loop.time() + 0.1
                    await asyncio.sleep(0.1)
                    lags.append(max(0.0, loop.time() - want))

            async def one(a: Arrival) -> None:
                await asyncio.sleep(max(0.0, loop_t0 + a.start - loop.time()))
                messages = _messages(systems, a)
                headers = {"x-slo-ttft-ms": f"{a.cls.ttft_ms:g}", "x-slo-tpot-ms": f"{a.cls.tpot_ms:g}"}
                sample, _ = await send(session, url, t0, messages, send_w, headers, a.cls.name)
                ttft = sample.ttft * 1000 if sample.ttft is not None else None
                tpot = None
                if ttft is not None and sample.output_tokens >= 2:
                    tpot = (sample.e2e * 1000 - ttft) / (sample.output_tokens - 1)
                met = (sample.status == 200 and ttft is not None and ttft <= a.cls.ttft_ms
                       and (tpot is None or tpot <= a.cls.tpot_ms))
                outcomes.append((a, Outcome(a.cls.name, feasibility[id(a)], sample.status, ttft, tpot, met,
                                            sample.endpoint)))

            sampling = asyncio.create_task(sampler())
            tasks = [asyncio.create_task(one(a)) for a in arrivals]
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
                stop.set()
                await sampling
        page = app[GATEWAY_KEY].metrics.render().decode()
    finally:
        if runner is not None:
            await runner.cleanup()
        for s in sims:
            with contextlib.suppress(Exception):
                await s.close()

    measured = [o for a, o in outcomes if w.warmup_s <= a.start < w.duration_s]
    feas = [o for o in measured if o.feasible]
    served = [o for o in feas if o.status == 200]
    ok = [o for o in measured if o.status == 200 and o.ttft_ms is not None]
    ttfts = sorted(o.ttft_ms for o in ok if o.ttft_ms is not None)
    tpots = [o.tpot_ms for o in ok if o.tpot_ms is not None]
    per_class, fast_share = {}, {}
    for c in CLASSES:
        mine = [o for o in measured if o.cls == c.name]
        if mine:
            per_class[c.name] = sum(o.met for o in mine) / len(mine)
            done = [o for o in mine if o.status == 200]
            fast_share[c.name] = sum(o.endpoint in fast_urls for o in done) / len(done) if done else math.nan
    return SloResult(
        strategy=label, load=load, rate=rate, requests=len(measured), feasible=len(feas),
        attained=sum(o.met for o in feas) / len(feas) if feas else math.nan,
        attained_served=sum(o.met for o in served) / len(served) if served else math.nan,
        attained_all=sum(o.met for o in measured) / len(measured) if measured else math.nan,
        refused=sum(o.status in (429, 503) for o in measured),
        failed=sum(o.status not in (200, 429, 503) for o in measured),
        ttft_mean_ms=statistics.fmean(ttfts) if ttfts else math.nan, ttft_p99_ms=_pct(ttfts, 0.99),
        tpot_mean_ms=statistics.fmean(tpots) if tpots else math.nan,
        per_class=per_class, fast_share=fast_share, model_error=model_errors(page),
        loop_lag_ms=1000 * statistics.fmean(lags) if lags else 0.0, wall_s=time.perf_counter() - wall0)


def markdown(results: list[SloResult]) -> str:
    names = [c.name for c in CLASSES]
    out = ["| load | strategy | feasible met | of served | all met | " + " | ".join(names)
           + " | refused | TTFT mean (ms) | TTFT p99 (ms) | TPOT mean (ms) | interactive on fast |",
           "|---:|---|---:|---:|---:|" + "---:|" * len(names) + "---:|---:|---:|---:|---:|"]
    for r in results:
        out.append(f"| {r.load:g}× | `{r.strategy}` | **{r.attained:.1%}** | {r.attained_served:.1%} | "
                   f"{r.attained_all:.1%} | " + " | ".join(f"{r.per_class.get(n, math.nan):.0%}" for n in names)
                   + f" | {r.refused} | {r.ttft_mean_ms:.0f} | {r.ttft_p99_ms:.0f} | {r.tpot_mean_ms:.0f} | "
                   f"{r.fast_share.get('interactive', math.nan):.0%} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.routing --workload slo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 strategies, 30 s of arrivals each")
    ap.add_argument("--strategies", nargs="+", help=f"strategy labels (default: {' '.join(STRATEGIES)})")
    ap.add_argument("--loads", nargs="+", type=float, default=[0.6, 2.0],
                    help="arrival rates as multiples of the fleet's capacity")
    ap.add_argument("--duration", type=float, help="seconds of arrivals per run")
    ap.add_argument("--warmup", type=float, help="seconds of arrivals not measured")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--routing", nargs="*", default=[], metavar="KEY=VALUE", help="routing config knobs")
    ap.add_argument("--admission", nargs="*", default=[], metavar="KEY=VALUE",
                    help="admission knobs of the +admission runs, e.g. queue_timeout_s=2")
    ap.add_argument("--json", default="", help="write the results to this file")
    args = ap.parse_args(argv)

    from gateway.observability.logs import configure_logging

    configure_logging("json", "warning")
    w = SloWorkload(seed=args.seed)
    if args.quick:
        w = replace(w, duration_s=30.0, warmup_s=10.0)
    if args.duration:
        w = replace(w, duration_s=args.duration, warmup_s=min(w.warmup_s, args.duration / 3))
    if args.warmup is not None:
        w = replace(w, warmup_s=args.warmup)
    routing = {k: json.loads(v) for k, _, v in (i.partition("=") for i in args.routing)}
    admission = {k: json.loads(v) for k, _, v in (i.partition("=") for i in args.admission)}
    strategies = args.strategies or (QUICK_STRATEGIES if args.quick else STRATEGIES)
    cap = capacity(FLEET, w)
    print(f"fleet: {len(FLEET)} engines ({sum(em is FAST for em in FLEET)} fast, {sum(em is SLOW for em in FLEET)} slow), "
          f"capacity ≈ {cap:.1f} req/s; {w.duration_s:.0f} s of arrivals per run ({w.warmup_s:.0f} s warm-up), "
          f"seed {w.seed}", file=sys.stderr)
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    results: list[SloResult] = []
    t0 = time.perf_counter()
    for load in args.loads:
        for label in strategies:
            r = runner(run_one(label, load, w, routing, admission))
            results.append(r)
            err = ", ".join(f"{k} {v:.0%}" for k, v in r.model_error.items())
            print(f"  {load:g}× {label:<28} feasible met {r.attained:6.1%} (served {r.attained_served:6.1%})  "
                  f"TTFT mean {r.ttft_mean_ms:6.0f} p99 {r.ttft_p99_ms:6.0f} ms  TPOT {r.tpot_mean_ms:4.0f} ms  "
                  f"{r.requests} req, {r.refused} refused, {r.failed} failed  model error {err or '-'}  "
                  f"lag {r.loop_lag_ms:.1f} ms  {r.wall_s:.0f} s", file=sys.stderr, flush=True)
    print(markdown(results))
    print(f"\n{len(FLEET)} simulated vLLM engines (2 fast, 2 slow), capacity ≈ {cap:.1f} req/s; objectives "
          + ", ".join(f"{c.name} {c.share:.0%} (TTFT {c.ttft_ms:g} ms, TPOT {c.tpot_ms:g} ms)" for c in CLASSES)
          + f"; {w.duration_s:.0f} s of arrivals per run ({w.warmup_s:.0f} s warm-up), seed {w.seed}; "
          f"the gateway in the benchmark's process; total {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"workload": asdict(w), "fleet": [asdict(em) for em in FLEET],
                                               "classes": [asdict(c) for c in CLASSES],
                                               "results": [asdict(r) for r in results]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
