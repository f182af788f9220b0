"""Overload: offered load at twice the fleet's capacity, in two priority classes, with admission
control off and on.

Two simulated vLLM engines with few running slots each (``--overload-slots``), so capacity is
small and known: a calibration step first measures it (a closed loop holding every slot busy
through a gateway). Then three runs, each on fresh engines and a fresh gateway, with the same
seeded open-loop (Poisson) arrivals:

- **unloaded**: only the high class's arrivals (a share ``--overload-high-share`` of the total),
  admission off: the TTFT the high class gets when nobody else is there;
- **admission off**: both classes, twice the capacity: everything goes to the engines;
- **admission on**: the same, with ``admission.enabled: true``.

The high class is an API key whose user has ``limits.users.gold.priority: critical``; the low class
a user at the default (standard). A client that gets a 429 with ``Retry-After`` waits that long and
retries once (an obedient client); the report says how many got in on that retry. Every 0.5 s the
engines' ``vllm:num_requests_waiting`` and the gateway's admission queue depth are sampled.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
from dataclasses import dataclass, field

import orjson

from bench.resilience import Harness, quantile, read_stream

KEYS = {"high": "sk-gold", "low": "sk-free"}


def add_args(ap) -> None:
    g = ap.add_argument_group("overload")
    g.add_argument("--overload-duration-s", type=float, default=30.0, help="arrivals last this long (default 30)")
    g.add_argument("--overload-factor", type=float, default=2.0, help="offered load / capacity (default 2)")
    g.add_argument("--overload-high-share", type=float, default=0.3, help="share of arrivals in the high class")
    g.add_argument("--overload-slots", type=int, default=4, help="running slots per engine (--max-num-seqs)")
    g.add_argument("--overload-max-tokens", type=int, default=16)
    g.add_argument("--overload-itl-ms", type=float, default=25.0)
    g.add_argument("--overload-ttft-ms", type=float, default=30.0)
    g.add_argument("--overload-queue-max", type=int, default=64, help="admission.queue_max")
    g.add_argument("--overload-queue-timeout-s", type=float, default=10.0, help="admission.queue_timeout_s")
    g.add_argument("--overload-max-waiting", default="5,1",
                   help="admission.max_waiting_per_endpoint: one admission-on run per value (default 5,1)")
    g.add_argument("--overload-seed", type=int, default=15)


@dataclass
class Result:
    cls: str
    status: int = 0
    ok: bool = False
    ttft: float | None = None
    code: str = ""
    retry_after: float | None = None
    retry: Result | None = None


@dataclass
class Sampler:
    engine_waiting: list[float] = field(default_factory=list)
    gateway_queue: list[float] = field(default_factory=list)


async def _chat(h: Harness, base: str, cls: str, args) -> Result:
    assert h.session is not None
    body = {"model": "m", "messages": [{"role": "user", "content": "tell me a story"}], "stream": True,
            "max_tokens": args.overload_max_tokens}
    res = Result(cls)
    t0 = time.perf_counter()
    try:
        async with h.session.post(base + "/v1/chat/completions", json=body,
                                  headers={"Authorization": f"Bearer {KEYS[cls]}"}) as r:
            res.status = r.status
            if r.status != 200:
                raw = await r.read()
                with contextlib.suppress(Exception):
                    res.code = str(orjson.loads(raw)["error"]["code"])
                if "Retry-After" in r.headers:
                    res.retry_after = float(r.headers["Retry-After"])
                return res
            res.ok, res.ttft = await read_stream(r, t0)
    except Exception as e:       # a broken connection: reported as such
        res.code = type(e).__name__
    return res


async def _obedient(h: Harness, base: str, cls: str, args) -> Result:
    """One request; on a 429 with Retry-After, wait as told and retry once."""
    res = await _chat(h, base, cls, args)
    if res.status == 429 and res.retry_after is not None:
        await asyncio.sleep(res.retry_after)
        res.retry = await _chat(h, base, cls, args)
    return res


async def _sample(h: Harness, engines: list[str], gateway: str, s: Sampler, stop: asyncio.Event) -> None:
    while not stop.is_set():
        waiting = 0.0
        for url in engines:
            with contextlib.suppress(Exception):
                for line in (await h.metrics(url)).splitlines():
                    if line.startswith("vllm:num_requests_waiting"):
                        waiting += float(line.rsplit(" ", 1)[1])
        s.engine_waiting.append(waiting)
        depth = 0.0
        with contextlib.suppress(Exception):
            for line in (await h.metrics(gateway)).splitlines():
                if line.startswith("switchyard_admission_queue_depth{"):
                    depth += float(line.rsplit(" ", 1)[1])
        s.gateway_queue.append(depth)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


async def _fleet(h: Harness, args, tag: str, admission: dict | None) -> tuple[list[str], str, list]:
    extra = ["--max-num-seqs", str(args.overload_slots), "--itl-ms", str(args.overload_itl_ms),
             "--ttft-base-ms", str(args.overload_ttft_ms), "--prefill-ms-per-token", "0"]
    engines, procs = [], []
    for k in range(2):
        url, p = await h.engine(f"{tag}-engine{k}", "vllm", "m", *extra, "--seed", str(k + 1))
        engines.append(url)
        procs.append(p)
    cfg = {"auth": {"api_keys": [{"key": KEYS["high"], "user": "gold"}, {"key": KEYS["low"], "user": "free"}]},
           "limits": {"users": {"gold": {"priority": "critical"}}},
           "models": [{"name": "m", "engine": "vllm", "endpoints": engines}]}
    if admission is not None:
        cfg["admission"] = admission
    gw, gp = await h.gateway(f"{tag}-gateway", cfg)
    return engines, gw, [*procs, gp]


async def _calibrate(h: Harness, args) -> float:
    """Completed requests per second with every slot of the fleet busy (closed loop)."""
    engines, gw, procs = await _fleet(h, args, "calibrate", None)
    slots = 2 * args.overload_slots
    done = 0
    end = time.perf_counter() + 8.0

    async def worker():
        nonlocal done
        while time.perf_counter() < end:
            if (await _chat(h, gw, "low", args)).ok:
                done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(slots)))
    rate = done / (time.perf_counter() - t0)
    for p in procs:
        h.stop(p)
    return rate


async def _run(h: Harness, args, tag: str, rate: float, classes: list[str], admission: dict | None) -> dict:
    engines, gw, procs = await _fleet(h, args, tag, admission)
    rng = random.Random(args.overload_seed)
    sampler, stop = Sampler(), asyncio.Event()
    sampling = asyncio.create_task(_sample(h, engines, gw, sampler, stop))
    tasks: list[asyncio.Task] = []
    t0 = time.perf_counter()
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        cls = "high" if rng.random() < args.overload_high_share else "low"
        if t >= args.overload_duration_s:
            break
        if cls not in classes:
            continue
        delay = t0 + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_obedient(h, gw, cls, args)))
    arrivals_end = len(sampler.engine_waiting)
    results = await asyncio.gather(*tasks)
    stop.set()
    await sampling
    for p in procs:
        h.stop(p)
    out: dict = {"offered_rps": round(rate if len(classes) == 2 else rate * args.overload_high_share, 2),
                 "classes": {}}
    for cls in classes:
        rs = [r for r in results if r.cls == cls]
        ttfts = [r.ttft for r in rs if r.ok and r.ttft is not None]
        shed = [r for r in rs if r.status == 429]
        retried = [r.retry for r in shed if r.retry is not None]
        codes: dict[str, int] = {}
        for r in shed:
            codes[r.code] = codes.get(r.code, 0) + 1
        out["classes"][cls] = {
            "sent": len(rs), "ok": sum(r.ok for r in rs), "shed": len(shed),
            "shed_share": round(len(shed) / max(1, len(rs)), 3), "shed_codes": codes,
            "errors": sum(1 for r in rs if not r.ok and r.status != 429),
            "ttft_p50_ms": _ms(quantile(ttfts, 0.5)), "ttft_p99_ms": _ms(quantile(ttfts, 0.99)),
            "retry_after_mean_s": round(statistics.mean(r.retry_after for r in shed), 2) if shed else None,
            "retried": len(retried), "retry_ok": sum(r.ok for r in retried),
            "retry_shed": sum(1 for r in retried if r.status == 429)}
    ew, gq = sampler.engine_waiting[:arrivals_end] or [0.0], sampler.gateway_queue[:arrivals_end] or [0.0]
    out["engine_waiting_mean"] = round(statistics.mean(ew), 1)
    out["engine_waiting_max"] = max(ew)
    out["gateway_queue_mean"] = round(statistics.mean(gq), 1)
    out["gateway_queue_max"] = max(gq)
    return out


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


async def run(h: Harness, args) -> dict:
    capacity = await _calibrate(h, args)
    rate = capacity * args.overload_factor
    runs = {"unloaded": await _run(h, args, "unloaded", rate, ["high"], None),
            "admission off": await _run(h, args, "off", rate, ["high", "low"], None)}
    for w in (int(x) for x in str(args.overload_max_waiting).split(",") if x.strip()):
        admission = {"enabled": True, "queue_max": args.overload_queue_max,
                     "queue_timeout_s": args.overload_queue_timeout_s, "max_waiting_per_endpoint": w}
        runs[f"admission on, max_waiting {w}"] = await _run(h, args, f"on{w}", rate, ["high", "low"], admission)
    settings = {k.removeprefix("overload_"): v for k, v in vars(args).items() if k.startswith("overload_")}
    return {"capacity_rps": round(capacity, 2), "offered_rps": round(rate, 2), "settings": settings, "runs": runs}


def report(r: dict) -> str:
    s = r["settings"]
    lines = [
        "## Overload",
        "",
        f"2 simulated vLLM engines × {s['slots']} running slots, {s['max_tokens']} tokens per streamed answer "
        f"(TTFT {s['ttft_ms']:g} ms, ITL {s['itl_ms']:g} ms): measured capacity **{r['capacity_rps']} req/s**; "
        f"offered **{r['offered_rps']} req/s** ({s['factor']:g}×) for {s['duration_s']:g} s, "
        f"{s['high_share']:.0%} high class (critical), the rest low (standard). Admission on: "
        f"`queue_max: {s['queue_max']}`, `queue_timeout_s: {s['queue_timeout_s']:g}`, "
        "`max_waiting_per_endpoint` as the run says (5 is the default), other keys at their defaults. "
        "A client answered 429 waits its `Retry-After` and retries once.",
        "",
        "| run | class | sent | ok | shed (429) | shed share | TTFT p50 | TTFT p99 | Retry-After mean | retried → ok / shed again | engine queue mean / max | gateway queue mean / max |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in r["runs"].items():
        for cls, c in run["classes"].items():
            ra = f"{c['retry_after_mean_s']:g} s" if c["retry_after_mean_s"] is not None else "—"
            codes = ", ".join(f"{k} {v}" for k, v in sorted(c["shed_codes"].items()))
            lines.append(
                f"| {name} | {cls} | {c['sent']} | {c['ok']} | {c['shed']}{f' ({codes})' if codes else ''} | "
                f"{c['shed_share']:.0%} | {_fmt(c['ttft_p50_ms'])} | {_fmt(c['ttft_p99_ms'])} | {ra} | "
                f"{c['retried']} → {c['retry_ok']} / {c['retry_shed']} | "
                f"{run['engine_waiting_mean']:g} / {run['engine_waiting_max']:g} | "
                f"{run['gateway_queue_mean']:g} / {run['gateway_queue_max']:g} |")
    return "\n".join(lines)


def _fmt(ms: float | None) -> str:
    if ms is None:
        return "—"
    return f"{ms / 1000:.2f} s" if ms >= 1000 else f"{ms:.0f} ms"
