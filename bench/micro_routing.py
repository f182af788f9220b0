"""Decision cost of every routing strategy: ``python -m bench.micro_routing [--quick]``.

Routing runs on every request, synchronously, in the event loop, so its cost is latency added to
every request and a ceiling on requests per second per core. This measures ``router.route(req,
candidates)`` exactly as the pipeline calls it (one new ``InferenceRequest`` per call, so nothing is
memoised across requests; prefix insertion and the other post-decision updates included) with 8,
64 and 512 endpoints and prompts of 1k, 32k and 128k tokens (4 characters per token), and prints
a Markdown table of p50 / p99 in microseconds. The garbage collector stays on, as in the gateway.

State is what a busy gateway holds: endpoints with in-flight counts and two fresh engine-metrics
snapshots (so windowed rates exist); for ``prefix-cache`` a warm index where the request's
conversation (one of 16 rotating ones) is held by a few endpoints at various depths, plus, as a
separate row, never-seen prompts (every block new; the index full, so every insertion evicts).
Strategies whose work does not depend on the prompt are measured with the 1k prompt only.

Targets (issue #4): ``prefix-cache`` p99 < 1 ms at 128k tokens and 64 endpoints; the load-only
strategies (least-request, power-of-two, random, round-robin) p99 < 50 µs at 512 endpoints.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.endpoints import Endpoint, EngineMetrics
from gateway.request import CHAT, InferenceRequest
from routers.base import RouterContext, RoutingSettings
from routers.registry import default_registry

ENDPOINTS = (8, 64, 512)
PROMPT_TOKENS = (1_000, 32_000, 128_000)
CHARS_PER_TOKEN = 4
LOAD_ONLY = ("random", "round-robin", "least-request", "power-of-two")
ENGINE_METRICS = ("least-kv-cache", "least-waiting", "throughput", "least-latency")
OTHER = ("session-affinity", "vtc-basic")
PREFIX = ("prefix-cache",)
COMBOS = ("prefix-cache:3,least-request:2,least-kv-cache:2",)
# the recommended default (README "Routing strategies"); measured too when it is a combination
RECOMMENDED = "prefix-cache"
_WORDS = ("the", "switch", "yard", "engine", "token", "cache", "prefix", "route", "of", "a", "model",
          "request", "gateway", "block", "decode", "prefill", "queue", "latency", "kv", "fleet")


def corpus(chars: int, rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(chars // 3)]
    return " ".join(words)[:chars]


def make_request(text: str, i: int, user: str | None = None, session_key: str | None = None) -> InferenceRequest:
    return InferenceRequest(path=CHAT, body=b"{}", data={}, model="bench", stream=False, include_usage=False,
                            prompt_text=text, prompt_tokens_est=max(1, len(text) // CHARS_PER_TOKEN),
                            request_id=f"r{i}", user=user, session_key=session_key)


def snapshot(rng: random.Random, t: float, scale: float) -> EngineMetrics:
    running = rng.randint(0, 32)
    return EngineMetrics(
        scraped_at=t, running=float(running), waiting=float(rng.randint(0, 8)), kv_usage=rng.random(),
        prompt_tokens_total=1e6 * scale + rng.randint(0, 10_000), generation_tokens_total=2e5 * scale,
        ttft_sum=50.0 * scale + rng.random(), ttft_count=400.0 * scale + rng.randint(1, 20),
        queue_time_sum=10.0 * scale + rng.random(), queue_time_count=400.0 * scale + rng.randint(1, 20),
        kv_capacity_tokens=500_000.0, block_size=16)


def fleet(n: int, rng: random.Random, clock: Callable[[], float]) -> list[Endpoint]:
    eps = []
    for i in range(n):
        ep = Endpoint(url=f"http://10.0.{i // 250}.{i % 250 + 1}:8000", model="bench")
        ep.in_flight = rng.randint(0, 20)
        eps.append(ep)
    return eps


@dataclass
class Cell:
    strategy: str
    label: str
    endpoints: int
    tokens: int
    p50_us: float
    p99_us: float
    max_us: float


def measure(fn: Callable[[int], None], iters: int) -> tuple[float, float, float]:
    samples = []
    clock = time.perf_counter_ns
    for i in range(iters):
        t = clock()
        fn(i)
        samples.append(clock() - t)
    samples.sort()
    p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))]
    return statistics.median(samples) / 1e3, p99 / 1e3, samples[-1] / 1e3


def bench_strategy(spec: str, n: int, tokens: int, iters: int, seed: int, unseen: bool = False) -> Cell:
    rng = random.Random(seed)
    now = [1000.0]
    ctx = RouterContext(settings=RoutingSettings(), rng=random.Random(seed), clock=lambda: now[0])
    reg = default_registry(ctx)
    router = reg.get(spec)
    eps = fleet(n, rng, ctx.clock)
    for ep in eps:                                   # two snapshots: windows and rates exist
        ep.metrics = snapshot(rng, 995.0, 1.0)
    router.route(make_request("warm up " * 200, -1, "u0", "k0"), eps)
    for ep in eps:
        ep.metrics = snapshot(rng, 999.0, 1.01)
    chars = tokens * CHARS_PER_TOKEN
    base = corpus(chars + 64, rng)
    convs = [f"conversation {c:04d} " + base[24:chars] for c in range(16)]
    users = [f"user-{u}" for u in range(50)]
    keys = [f"session-{k}" for k in range(100)]
    if "prefix-cache" in spec and not unseen:
        for c, text in enumerate(convs):             # the index holds each conversation somewhere
            for depth in (0.3, 0.6, 1.0):
                holder = eps[(c * 7 + int(depth * 10)) % n]
                ctx.prefix_index.insert(make_request(text[:int(len(text) * depth)], -2), holder)
    if unseen:
        # fill the index to capacity with other prompts so every insertion evicts
        filler = corpus(1024 * 512, rng)
        i = 0
        while len(reg.get("prefix-cache").index) < RoutingSettings().prefix_index_blocks:
            ctx.prefix_index.insert(make_request(f"{i:09d}" + filler[9:], -3), eps[i % n])
            i += 1
        texts = [f"{i:09d}-unseen " + base[16:chars] for i in range(iters)]
    gc.collect()

    def one(i: int) -> None:
        text = texts[i] if unseen else convs[i % len(convs)]
        req = make_request(text, i, users[i % len(users)], keys[i % len(keys)])
        now[0] += 0.001
        router.route(req, eps)

    p50, p99, mx = measure(one, iters)
    label = "prefix-cache, never-seen prompts" if unseen else spec
    return Cell(spec, label, n, tokens, p50, p99, mx)


def run(quick: bool, seed: int, only: Sequence[str] | None = None) -> list[Cell]:
    cells: list[Cell] = []
    specs: list[tuple[str, bool, bool]] = []          # (spec, prompt-dependent, unseen)
    for s in LOAD_ONLY + ENGINE_METRICS + OTHER:
        specs.append((s, False, False))
    for s in PREFIX:
        specs.append((s, True, False))
        specs.append((s, True, True))
    for s in dict.fromkeys(COMBOS + ((RECOMMENDED,) if "," in RECOMMENDED else ())):
        specs.append((s, True, False))
    for spec, by_prompt, unseen in specs:
        if only and spec not in only:
            continue
        for tokens in (PROMPT_TOKENS if by_prompt else PROMPT_TOKENS[:1]):
            for n in ENDPOINTS:
                big = tokens >= 32_000
                iters = (300 if big else 3000) if not quick else (150 if big else 1000)
                cell = bench_strategy(spec, n, tokens, iters, seed, unseen)
                cells.append(cell)
                print(f"  {cell.label:<50} {tokens // 1000:>4}k {n:>4} endpoints  p50 {cell.p50_us:8.1f} µs  "
                      f"p99 {cell.p99_us:8.1f} µs  max {cell.max_us:8.1f} µs", file=sys.stderr, flush=True)
    return cells


def markdown(cells: list[Cell]) -> str:
    rows: dict[tuple[str, int], dict[int, Cell]] = {}
    for c in cells:
        rows.setdefault((c.label, c.tokens), {})[c.endpoints] = c
    head = "| strategy | prompt | " + " | ".join(f"{n} endpoints p50 / p99 (µs)" for n in ENDPOINTS) + " |"
    out = [head, "|" + "---|" * (2 + len(ENDPOINTS))]
    for (label, tokens), by_n in rows.items():
        vals = []
        for n in ENDPOINTS:
            c = by_n.get(n)
            vals.append(f"{c.p50_us:.1f} / {c.p99_us:.1f}" if c else "–")
        out.append(f"| `{label}` | {tokens // 1000}k | " + " | ".join(vals) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.micro_routing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations (≈20 s)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", nargs="*", help="strategy strings to run (default: all)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    cells = run(args.quick, args.seed, args.only)
    print(markdown(cells))
    print(f"\n(python {sys.version.split()[0]}, {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
