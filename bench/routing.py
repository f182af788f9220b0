"""Routing quality: ``python -m bench.routing [--quick] [--strategies ...] [--seed N]``.

How much faster does each strategy make a fleet of engines than a plain load balancer? One
process, one event loop: ``--engines`` simulated vLLM engines (``enginesim``, in-process, with a
bounded KV pool and prefix caching), the real gateway in front of them on loopback, and an
open-loop load generator that measures TTFT at the client (request sent → first chunk carrying
generated text). Every strategy gets fresh engines (cold caches), the same seeded arrival schedule
and the same prompts.

Workload (defaults; ``--quick`` shortens the run, not the shape):

* conversations arrive as a Poisson process; each picks one of ``system_prompts`` long system
  prompts by a Zipf popularity, lasts 2–6 turns, and waits an exponential think time after each
  answer before its next turn (whose prompt is the whole conversation so far, answers included);
* a share of single-turn requests with unique prompts (no reusable prefix) arrives on its own
  Poisson process;
* one engine's KV pool holds under a third of the system prompts and the fleet's pools about a
  fifth of the distinct prompt text of a run, so an engine keeps a prefix only if it keeps seeing it.

The engines' latency model makes prefill dominate TTFT (``prefill_ms_per_token`` per uncached
prompt token, like a GPU prefilling ~10k tokens/s), so a cache hit matters; ``max_num_seqs`` caps
each engine's concurrency (the rest queue), so load matters too; decode slows a little with the
batch size. The sims only sleep: their time model does not depend on the CPU.

Per strategy: mean, p50 and p99 TTFT of the requests sent after the warm-up, completed requests
and output tokens per second, the engines' prefix-cache hit rate (cached / prompt tokens, from the
usage they report) beside the *reachable* hit rate (``reachable_hit``: an infinite cache shared by
the fleet, over the same requests; unique prompts and first turns are misses for any strategy),
and load imbalance: the gateway's in-flight count per engine sampled every
100 ms, averaged over time per engine, max over mean (1.0 = perfectly even; ``peak`` is the mean of
the per-sample max/mean). ``loop lag`` is how late the 100 ms sampler woke up on average: if it
grows, the process is CPU-bound and the TTFTs include the load generator's own delay.

Outputs a Markdown table on stdout and, with matplotlib (``pip install -e '.[bench]'``), a plot of
the TTFT distribution per strategy (``--plot``, default ``bench/routing.png``).
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
import orjson

MODEL = "bench-model"
STRATEGIES = [
    "random", "round-robin", "least-request", "power-of-two", "least-kv-cache", "least-waiting",
    "throughput", "least-latency", "session-affinity", "vtc-basic", "prefix-cache",
    "prefix-cache+events", "prefix-cache:3,least-request:2,least-kv-cache:2", "prefix-cache:2,least-request:1",
]
QUICK_STRATEGIES = ["random", "least-request", "least-kv-cache", "prefix-cache", "prefix-cache" + "+events",
                    "prefix-cache:3,least-request:2,least-kv-cache:2"]
RECOMMENDED = "prefix-cache"
EVENTS = "+events"        # suffix: the strategy with KV events on (engines publish, the gateway subscribes)
KV_EVENTS: dict = {}      # extra kv_events keys (--kv-events KEY=VALUE)
_WORDS_SEED = 7919


@dataclass(frozen=True)
class EngineModel:
    ttft_base_ms: float = 10.0
    prefill_ms_per_token: float = 0.1
    itl_ms: float = 25.0
    itl_growth_per_running: float = 1.0
    max_num_seqs: int = 8
    kv_blocks: int = 1536          # × 16 tokens = 24k tokens per engine
    block_size: int = 16
    max_model_len: int = 32768


@dataclass(frozen=True)
class Workload:
    engines: int = 8
    duration_s: float = 45.0       # arrivals happen in [0, duration)
    warmup_s: float = 12.0         # requests sent before this are not measured
    conversation_rate: float = 14.0  # new conversations per second
    unique_rate: float = 9.0       # unique single-turn requests per second
    system_prompts: int = 40
    system_tokens: int = 2000
    zipf_s: float = 0.8
    turns: tuple[int, int] = (2, 6)
    user_tokens: tuple[int, int] = (40, 160)
    unique_tokens: tuple[int, int] = (600, 1800)
    think_s: float = 1.5
    max_tokens: int = 16
    users: int = 24                # vtc-basic: conversations belong to this many users
    seed: int = 1


# -- the schedule -----------------------------------------------------------------------------------


def _vocab() -> list[str]:
    """Short words (one sim token each: whitespace + at most four characters)."""
    rng = random.Random(_WORDS_SEED)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(2, 4))) for _ in range(4000)]


def _text(rng: random.Random, vocab: list[str], tokens: int) -> str:
    return " ".join(rng.choice(vocab) for _ in range(tokens))


@dataclass
class Conversation:
    cid: int
    start: float
    system: int
    user: str
    questions: list[str]
    thinks: list[float]


@dataclass
class Single:
    start: float
    prompt: str
    user: str


@dataclass
class Schedule:
    systems: list[str]
    conversations: list[Conversation]
    singles: list[Single]


def make_schedule(w: Workload) -> Schedule:
    rng = random.Random(w.seed)
    vocab = _vocab()
    systems = [f"System prompt {i}: you are assistant number {i}. " + _text(rng, vocab, w.system_tokens)
               for i in range(w.system_prompts)]
    weights = [1.0 / (i + 1) ** w.zipf_s for i in range(w.system_prompts)]
    convs: list[Conversation] = []
    t = rng.expovariate(w.conversation_rate)
    while t < w.duration_s:
        turns = rng.randint(*w.turns)
        convs.append(Conversation(
            cid=len(convs), start=t, system=rng.choices(range(w.system_prompts), weights)[0],
            user=f"user-{rng.randrange(w.users)}",
            questions=[f"Question {k}: " + _text(rng, vocab, rng.randint(*w.user_tokens)) for k in range(turns)],
            thinks=[rng.expovariate(1.0 / w.think_s) for _ in range(turns)]))
        t += rng.expovariate(w.conversation_rate)
    singles: list[Single] = []
    t = rng.expovariate(w.unique_rate) if w.unique_rate > 0 else math.inf
    while t < w.duration_s:
        singles.append(Single(start=t, prompt=f"Unique request {len(singles)}: "
                              + _text(rng, vocab, rng.randint(*w.unique_tokens)),
                              user=f"user-{rng.randrange(w.users)}"))
        t += rng.expovariate(w.unique_rate)
    return Schedule(systems, convs, singles)


# -- one request --------------------------------------------------------------------------------------


@dataclass
class Sample:
    sent: float                    # seconds since the run's start
    ttft: float | None
    e2e: float
    status: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    endpoint: str = ""
    kind: str = "turn"
    messages: list[dict] | None = None    # what was sent (for the reachable-hit oracle)


async def send(session: aiohttp.ClientSession, url: str, t0: float, messages: list[dict], w: Workload,
               headers: dict[str, str], kind: str) -> tuple[Sample, str]:
    body = orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": w.max_tokens, "stream": True,
                         "stream_options": {"include_usage": True}, "ignore_eos": True})
    start = time.perf_counter()
    sample = Sample(sent=start - t0, ttft=None, e2e=0.0, status=0, kind=kind, messages=list(messages))
    parts: list[str] = []
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json", **headers}) as r:
            sample.status = r.status
            sample.endpoint = r.headers.get("target-pod", "")
            if r.status != 200:
                await r.read()
            else:
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    event = orjson.loads(line[6:])
                    for choice in event.get("choices") or ():
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            if sample.ttft is None:
                                sample.ttft = time.perf_counter() - start
                            parts.append(text)
                    usage = event.get("usage")
                    if usage:
                        sample.prompt_tokens = usage.get("prompt_tokens") or 0
                        sample.output_tokens = usage.get("completion_tokens") or 0
                        sample.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except (TimeoutError, aiohttp.ClientError) as e:
        sample.status = -1
        parts = [str(e)]
    sample.e2e = time.perf_counter() - start
    return sample, "".join(parts)


# -- one strategy -------------------------------------------------------------------------------------


@dataclass
class Result:
    strategy: str
    requests: int
    errors: int
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    throughput_rps: float
    output_tps: float
    cache_hit: float
    reachable_hit: float     # the oracle's share (reachable_hit()): what a single infinite cache would hit
    imbalance: float
    imbalance_peak: float
    loop_lag_ms: float
    mean_in_flight: float
    wall_s: float
    ttfts_ms: list[float] = field(default_factory=list, repr=False)


def reachable_hit(samples: list[Sample], w: Workload, block_size: int) -> tuple[float, float]:
    """The hit rate an infinite cache shared by the whole fleet would reach on this run's requests:
    the share of the measured requests' prompt tokens whose full blocks (the engine's rule: never
    the prompt's last token) were a prefix of a request whose prefill had finished (sent + TTFT)
    before this one was sent. The second figure counts any earlier-sent request (no prefill time),
    an upper bound. No routing can beat the first on this schedule; unique single-turn prompts and
    first turns with a system prompt no one sent before are misses for every strategy."""
    from enginesim.tiny_tokenizer import TINY_DIR
    from gateway.tokenization import ModelTokenizer, chain_keys

    tok = ModelTokenizer(TINY_DIR)
    ok = sorted((s for s in samples if s.status == 200 and s.ttft is not None and s.messages), key=lambda s: s.sent)
    keyed = []
    for s in ok:
        ids = tok.encode(tok.render(s.messages or []))
        keys = chain_keys(0, ids, block_size)[:max(0, len(ids) - 1) // block_size]
        keyed.append((s, keys, len(ids)))
    # arrivals (1) after availabilities (0) at equal times
    timeline = sorted([(s.sent + (s.ttft or 0.0), 0, i) for i, (s, _, _) in enumerate(keyed)]
                      + [(s.sent, 1, i) for i, (s, _, _) in enumerate(keyed)])
    done: set[int] = set()
    sent: set[int] = set()
    hit = hit_sent = total = 0
    for _, kind, i in timeline:
        s, keys, n = keyed[i]
        if kind == 0:
            done.update(keys)
            continue
        if w.warmup_s <= s.sent < w.duration_s:
            total += n
            hit += block_size * next((j for j, k in enumerate(keys) if k not in done), len(keys))
            hit_sent += block_size * next((j for j, k in enumerate(keys) if k not in sent), len(keys))
        sent.update(keys)
    return (hit / total, hit_sent / total) if total else (0.0, 0.0)


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    k = (len(sorted_values) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


async def run_strategy(label: str, sched: Schedule, w: Workload, em: EngineModel,
                       routing: dict | None = None, replicas: int = 1) -> Result:
    from enginesim import SimConfig, start_sim
    from enginesim.tiny_tokenizer import TINY_DIR
    from gateway.app import GATEWAY_KEY
    from gateway.config import config_from_dict
    from gateway.server import start

    wall0 = time.perf_counter()
    events = label.endswith(EVENTS)
    spec = label.removesuffix(EVENTS)
    tok = str(TINY_DIR)
    # every engine publishes events (one PUB socket each): with events on, each endpoint is its own
    # model block in the gateway's eyes only for the port, so the endpoints share the default ports
    # by binding each sim's PUB and replay sockets on its own loopback address
    sims = []
    for i in range(w.engines):
        host = f"127.0.{1 + i // 200}.{1 + i % 200}" if events else "127.0.0.1"
        sims.append(await start_sim(SimConfig(
            engine="vllm", model=MODEL, port=0, host=host, seed=w.seed, tokenizer=tok,
            kv_events_port=5557 if events else -1, kv_events_replay_port=5558 if events else -1, **asdict(em))))
    model = {"name": MODEL, "engine": "vllm", "strategy": spec, "endpoints": [s.url for s in sims],
             "tokenizer": tok}
    if events:
        model["kv_events"] = {"enabled": True, "port": 5557, "replay_port": 5558, **KV_EVENTS}
    cfg = config_from_dict({
        "listen": {"host": "127.0.0.1", "port": 0},
        "server": {"shutdown_grace_s": 1.0, "log_level": "warning"},
        "health": {"interval_s": 5.0},
        "scrape": {"interval_s": 0.5},
        "routing": dict(routing or {}),
        "models": [model],
    }, source="<bench>")
    gateways = [await start(cfg) for _ in range(replicas)]
    runner, app, port = gateways[0]
    gw = app[GATEWAY_KEY]
    urls = [f"http://127.0.0.1:{p}/v1/chat/completions" for _, _, p in gateways]
    pick = random.Random(w.seed + 17)
    if events:
        await asyncio.sleep(0.5)          # the SUB sockets connect
    samples: list[Sample] = []
    in_flight_samples: list[list[int]] = []
    lags: list[float] = []
    seen = [0.0, 0.0, 0.0]        # sampled in-flight: all replicas, replica 0 alone, replica 0's fleet estimate
    from routers.prefix_cache import fleet_load
    max_age = cfg.routing.metrics_max_age_s
    stop_sampling = asyncio.Event()
    eps_per_gw = [g[1][GATEWAY_KEY].pool.endpoints(MODEL) for g in gateways]
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    loop = asyncio.get_running_loop()

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        loop_t0 = loop.time()

        async def sampler() -> None:
            while not stop_sampling.is_set():
                want = loop.time() + 0.1
                await asyncio.sleep(0.1)
                lags.append(max(0.0, loop.time() - want))
                if w.warmup_s <= time.perf_counter() - t0 <= w.duration_s:
                    row = [sum(eps[i].in_flight for eps in eps_per_gw) for i in range(w.engines)]
                    in_flight_samples.append(row)
                    if replicas > 1:       # what the first replica's load guard sees, against the truth
                        now = time.monotonic()
                        seen[0] += sum(row)
                        seen[1] += sum(ep.in_flight for ep in eps_per_gw[0])
                        seen[2] += sum(fleet_load(ep, now, max_age) for ep in eps_per_gw[0])

        async def conversation(c: Conversation) -> None:
            await asyncio.sleep(max(0.0, loop_t0 + c.start - loop.time()))
            messages: list[dict] = [{"role": "system", "content": sched.systems[c.system]}]
            headers = {"user": c.user, "x-session-key": f"conversation-{c.cid}"}
            for k, question in enumerate(c.questions):
                if time.perf_counter() - t0 >= w.duration_s:
                    return                                     # no new turns after the arrivals end
                messages.append({"role": "user", "content": question})
                url = urls[pick.randrange(len(urls))]       # replicas: each request to any of them
                sample, answer = await send(session, url, t0, messages, w, headers, "turn")
                samples.append(sample)
                if sample.status != 200:
                    return
                messages.append({"role": "assistant", "content": answer})
                if time.perf_counter() - t0 + c.thinks[k] >= w.duration_s:
                    return                                     # the next turn would come after the end
                await asyncio.sleep(c.thinks[k])

        async def single(s: Single) -> None:
            await asyncio.sleep(max(0.0, loop_t0 + s.start - loop.time()))
            url = urls[pick.randrange(len(urls))]
            sample, _ = await send(session, url, t0, [{"role": "user", "content": s.prompt}], w,
                                   {"user": s.user}, "unique")
            samples.append(sample)

        sampling = asyncio.create_task(sampler())
        tasks = [asyncio.create_task(conversation(c)) for c in sched.conversations]
        tasks += [asyncio.create_task(single(s)) for s in sched.singles]
        await asyncio.gather(*tasks)
        stop_sampling.set()
        await sampling

    fallbacks = gw.metrics.render().decode()
    for r, _, _ in gateways:
        await r.cleanup()
    for s in sims:
        with contextlib.suppress(Exception):
            await s.close()

    if seen[0]:
        print(f"    load seen by replica 1: local {seen[1] / seen[0]:.0%} of the fleet's in-flight, "
              f"fleet estimate {seen[2] / seen[0]:.0%}", file=sys.stderr)
    reach = reachable_hit(samples, w, em.block_size)
    print(f"    reachable hit: {reach[0]:.1%} (prefill done before the request), {reach[1]:.1%} (sent before)",
          file=sys.stderr)
    measured = [s for s in samples if w.warmup_s <= s.sent < w.duration_s]
    ok = [s for s in measured if s.status == 200 and s.ttft is not None]
    ttfts = sorted(s.ttft * 1000 for s in ok)
    window = w.duration_s - w.warmup_s
    prompt = sum(s.prompt_tokens for s in ok)
    per_engine = [statistics.fmean(col) for col in zip(*in_flight_samples, strict=True)] if in_flight_samples else []
    mean_load = statistics.fmean(per_engine) if per_engine else 0.0
    peaks = [max(row) / statistics.fmean(row) for row in in_flight_samples if sum(row) > 0]
    result = Result(
        strategy=label + (f" ×{replicas} replicas" if replicas > 1 else ""), requests=len(ok), errors=len(measured) - len(ok),
        ttft_mean_ms=statistics.fmean(ttfts) if ttfts else math.nan,
        ttft_p50_ms=_pct(ttfts, 0.5), ttft_p99_ms=_pct(ttfts, 0.99),
        throughput_rps=len(ok) / window, output_tps=sum(s.output_tokens for s in ok) / window,
        cache_hit=sum(s.cached_tokens for s in ok) / prompt if prompt else 0.0,
        reachable_hit=reach[0],
        imbalance=max(per_engine) / mean_load if mean_load else math.nan,
        imbalance_peak=statistics.fmean(peaks) if peaks else math.nan,
        loop_lag_ms=1000 * statistics.fmean(lags) if lags else 0.0, mean_in_flight=mean_load,
        wall_s=time.perf_counter() - wall0, ttfts_ms=ttfts)
    fb = [line for line in fallbacks.splitlines()
          if line.startswith(("switchyard_routing_fallbacks_total{", "switchyard_kv_events_fallbacks_total{"))]
    if fb:
        print("    fallbacks: " + "; ".join(line.split("{", 1)[1] for line in fb), file=sys.stderr)
    return result


# -- report --------------------------------------------------------------------------------------------


def markdown(results: list[Result], baseline: str = "random") -> str:
    base = next((r for r in results if r.strategy.split(" ×")[0] == baseline), None)
    out = ["| strategy | TTFT mean (ms) | vs random | TTFT p50 (ms) | TTFT p99 (ms) | req/s | output tok/s "
           "| cache hit | reachable | imbalance (peak) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        ratio = f"{r.ttft_mean_ms / base.ttft_mean_ms:.2f}×" if base and base.ttft_mean_ms else "–"
        errors = f" ({r.errors} errors)" if r.errors else ""
        out.append(f"| `{r.strategy}`{errors} | {r.ttft_mean_ms:.0f} | {ratio} | {r.ttft_p50_ms:.0f} | "
                   f"{r.ttft_p99_ms:.0f} | {r.throughput_rps:.1f} | {r.output_tps:.0f} | {r.cache_hit:.0%} | "
                   f"{r.reachable_hit:.0%} | "
                   f"{r.imbalance:.2f} ({r.imbalance_peak:.2f}) |")
    return "\n".join(out)


def plot(results: list[Result], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.plots import box_and_save

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    cmap = plt.get_cmap("tab20")
    for i, r in enumerate(results):
        if not r.ttfts_ms:
            continue
        n = len(r.ttfts_ms)
        ys = [(k + 1) / n for k in range(n)]
        style = "-" if "prefix" in r.strategy else "--"
        width = 2.4 if r.strategy == RECOMMENDED else 1.3
        ax1.plot(r.ttfts_ms, ys, style, lw=width, color=cmap(i % 20), label=r.strategy)
    ax1.set_xscale("log")
    ax1.set_xlabel("TTFT at the client (ms, log scale)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("TTFT distribution (CDF)")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=7, loc="lower right")
    labels = [r.strategy.replace(",", ",\n") for r in results]
    box_and_save(fig, ax2, [r.ttfts_ms or [math.nan] for r in results], labels, title, path, fontsize=7)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="5 strategies, 20 s of arrivals each (< 2 min; the default run takes ~10 min)")
    ap.add_argument("--strategies", nargs="+", help="strategy strings (default: all built-ins + combos)")
    ap.add_argument("--engines", type=int)
    ap.add_argument("--duration", type=float, help="seconds of arrivals per strategy")
    ap.add_argument("--warmup", type=float, help="seconds of arrivals not measured")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--plot", default=str(Path(__file__).with_name("routing.png")),
                    help="PNG path ('' to skip)")
    ap.add_argument("--json", default="", help="write the results (with raw TTFTs) to this file")
    ap.add_argument("--kv-events", nargs="*", default=[], metavar="KEY=VALUE",
                    help="kv_events keys for the +events strategies, e.g. speculative_ttl_s=5")
    ap.add_argument("--replicas", type=int, default=1,
                    help="gateway replicas in front of the same engines, each request sent to a random one")
    ap.add_argument("--kv-blocks", type=int, help="KV blocks per engine (16 tokens each; default 1536)")
    ap.add_argument("--routing", nargs="*", default=[], metavar="KEY=VALUE",
                    help="routing config knobs for the gateway, e.g. prefix_std_factor=2")
    args = ap.parse_args(argv)

    from gateway.logs import configure_logging

    configure_logging("json", "warning")
    w = Workload(seed=args.seed)
    if args.quick:
        w = replace(w, duration_s=20.0, warmup_s=6.0)
    if args.engines:
        w = replace(w, engines=args.engines)
    if args.duration:
        w = replace(w, duration_s=args.duration, warmup_s=args.warmup if args.warmup is not None
                    else min(w.warmup_s, args.duration / 4))
    elif args.warmup is not None:
        w = replace(w, warmup_s=args.warmup)
    em = EngineModel() if not args.kv_blocks else EngineModel(kv_blocks=args.kv_blocks)
    routing: dict = {}
    for item in args.routing:
        key, _, value = item.partition("=")
        routing[key] = json.loads(value)
    for item in args.kv_events:
        key, _, value = item.partition("=")
        KV_EVENTS[key] = json.loads(value)
    strategies = args.strategies or (QUICK_STRATEGIES if args.quick else STRATEGIES)
    sched = make_schedule(w)
    n_req = sum(len(c.questions) for c in sched.conversations) + len(sched.singles)
    print(f"workload: {w.engines} engines, {len(sched.conversations)} conversations + {len(sched.singles)} "
          f"unique requests (≤{n_req} requests) over {w.duration_s:.0f} s, seed {w.seed}", file=sys.stderr)

    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run

    results: list[Result] = []
    t0 = time.perf_counter()
    for spec in strategies:
        r = runner(run_strategy(spec, sched, w, em, routing, args.replicas))
        results.append(r)
        print(f"  {spec:<50} mean {r.ttft_mean_ms:7.0f} ms  p50 {r.ttft_p50_ms:6.0f}  p99 {r.ttft_p99_ms:6.0f}  "
              f"hit {r.cache_hit:4.0%} (reachable {r.reachable_hit:4.0%})  imbalance {r.imbalance:.2f} ({r.imbalance_peak:.2f})  "
              f"{r.requests} ok {r.errors} err  in-flight/engine {r.mean_in_flight:.1f}  lag {r.loop_lag_ms:.1f} ms  "
              f"{r.wall_s:.0f} s",
              file=sys.stderr, flush=True)
    total = time.perf_counter() - t0
    print(markdown(results))
    print(f"\n{w.engines} engines, {w.duration_s:.0f} s of arrivals per strategy ({w.warmup_s:.0f} s warm-up), "
          f"seed {w.seed}; total run {total:.0f} s")
    if args.plot:
        try:
            plot(results, Path(args.plot), f"Switchyard routing benchmark: {w.engines} simulated vLLM engines, "
                 f"{len(sched.conversations)} conversations over {w.system_prompts} system prompts "
                 f"+ {len(sched.singles)} unique prompts, seed {w.seed}")
            print(f"plot: {args.plot}", file=sys.stderr)
        except ImportError:
            print("matplotlib not installed: no plot (pip install -e '.[bench]')", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({"workload": asdict(w), "engine": asdict(em),
                                               "results": [asdict(r) for r in results]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
