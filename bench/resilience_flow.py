"""Flow control under overload (issue 25): what each tenant sees when the fleet is offered about three
times its capacity, with admission control on. Shared by the scenarios ``priorities``, ``fairness``
(``bench/resilience_priorities.py``, ``bench/resilience_fairness.py``) and ``slo-overload``
(``bench/resilience_slo.py``).

The fleet is the issue's: two simulated vLLM engines with two running slots each, 16-token streamed
answers (TTFT 30 ms, ITL 20 ms: about 0.33 s a request, about 12 requests per second in all),
tenants by API key, ``admission: {enabled: true, queue_max: 20, queue_timeout_s: 2}`` and every other
key at its default. Each tenant offers an open loop of evenly spaced requests (so a tenant at 5 req/s
for 10 s sends exactly 50); a client answered 429 does not retry, it records whether the answer
carried ``Retry-After``. Each engine's queue is sampled every 100 ms (``vllm:num_requests_waiting``)
and its exact peak read at the end (``/_sim/state`` ``counts.waiting_peak``).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from dataclasses import dataclass, field

import orjson

from bench.resilience import Harness, quantile, read_stream

PROMPT = "tell me a story"


@dataclass
class Tenant:
    name: str
    rate: float                      # requests per second, evenly spaced
    priority: str | None = None      # limits.users.NAME.priority
    slo_ttft_ms: list[float | None] = field(default_factory=list)   # cycled over its requests
    send_slo: bool = True            # send x-slo-ttft-ms (else the objective is only measured)

    @property
    def key(self) -> str:
        return f"sk-{self.name}"


@dataclass
class Result:
    tenant: str
    status: int = 0
    ok: bool = False
    ttft: float | None = None
    code: str = ""
    retry_after: bool = False
    slo_ms: float | None = None


def add_fleet_args(g, prefix: str, *, duration: float = 10.0, queue_timeout: float = 2.0) -> None:
    g.add_argument(f"--{prefix}-duration-s", type=float, default=duration, help=f"arrivals last this long (default {duration:g})")
    g.add_argument(f"--{prefix}-slots", type=int, default=2, help="running slots per engine (default 2)")
    g.add_argument(f"--{prefix}-max-tokens", type=int, default=16)
    g.add_argument(f"--{prefix}-itl-ms", type=float, default=20.0)
    g.add_argument(f"--{prefix}-ttft-ms", type=float, default=30.0)
    g.add_argument(f"--{prefix}-queue-max", type=int, default=20, help="admission.queue_max (default 20)")
    g.add_argument(f"--{prefix}-queue-timeout-s", type=float, default=queue_timeout,
                   help=f"admission.queue_timeout_s (default {queue_timeout:g})")


def settings(args, prefix: str) -> dict:
    p = prefix.replace("-", "_") + "_"
    return {k.removeprefix(p): v for k, v in vars(args).items() if k.startswith(p)}


async def fleet(h: Harness, s: dict, tag: str, tenants: list[Tenant], admission: dict | None,
                strategy: str = "least-request") -> tuple[list[str], str, list]:
    extra = ["--max-num-seqs", str(s["slots"]), "--itl-ms", str(s["itl_ms"]), "--ttft-base-ms", str(s["ttft_ms"]),
             "--prefill-ms-per-token", "0"]
    engines, procs = [], []
    for k in range(2):
        url, p = await h.engine(f"{tag}-engine{k}", "vllm", "m", *extra, "--seed", str(k + 1))
        engines.append(url)
        procs.append(p)
    users = {t.name: {"priority": t.priority} for t in tenants if t.priority}
    cfg: dict = {"auth": {"api_keys": [{"key": t.key, "user": t.name} for t in tenants]},
                 "routing": {"strategy": strategy},
                 "models": [{"name": "m", "engine": "vllm", "endpoints": engines}]}
    if users:
        cfg["limits"] = {"users": users}
    if admission is not None:
        cfg["admission"] = admission
    gw, gp = await h.gateway(f"{tag}-gateway", cfg)
    return engines, gw, [*procs, gp]


async def _chat(h: Harness, base: str, t: Tenant, slo: float | None, max_tokens: int) -> Result:
    assert h.session is not None
    body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "stream": True, "max_tokens": max_tokens}
    headers = {"Authorization": f"Bearer {t.key}"}
    if slo is not None and t.send_slo:
        headers["x-slo-ttft-ms"] = f"{slo:g}"
    res = Result(t.name, slo_ms=slo)
    t0 = time.perf_counter()
    try:
        async with h.session.post(base + "/v1/chat/completions", json=body, headers=headers) as r:
            res.status = r.status
            if r.status != 200:
                raw = await r.read()
                with contextlib.suppress(Exception):
                    res.code = str(orjson.loads(raw)["error"]["code"])
                res.retry_after = "Retry-After" in r.headers
                return res
            res.ok, res.ttft = await read_stream(r, t0)
    except Exception as e:           # a broken connection: reported as such
        res.code = type(e).__name__
    return res


async def _sample(h: Harness, engines: list[str], out: list[list[float]], stop: asyncio.Event) -> None:
    while not stop.is_set():
        row = []
        for url in engines:
            waiting = 0.0
            with contextlib.suppress(Exception):
                for line in (await h.metrics(url)).splitlines():
                    if line.startswith("vllm:num_requests_waiting{"):
                        waiting += float(line.rsplit(" ", 1)[1])
            row.append(waiting)
        out.append(row)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)


async def offer(h: Harness, s: dict, tag: str, tenants: list[Tenant], admission: dict | None,
                strategy: str = "least-request") -> dict:
    """One run on a fresh fleet: every tenant's arrivals, then what each saw."""
    engines, gw, procs = await fleet(h, s, tag, tenants, admission, strategy)
    samples: list[list[float]] = []
    stop = asyncio.Event()
    sampling = asyncio.create_task(_sample(h, engines, samples, stop))
    arrivals = sorted((i / t.rate, t.name, i) for t in tenants for i in range(int(round(t.rate * s["duration_s"]))))
    by_name = {t.name: t for t in tenants}
    tasks: list[asyncio.Task] = []
    t0 = time.perf_counter()
    for at, name, i in arrivals:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        t = by_name[name]
        slo = t.slo_ttft_ms[i % len(t.slo_ttft_ms)] if t.slo_ttft_ms else None
        tasks.append(asyncio.create_task(_chat(h, gw, t, slo, s["max_tokens"])))
    results: list[Result] = await asyncio.gather(*tasks)
    stop.set()
    await sampling
    peaks = []
    assert h.session is not None
    for url in engines:
        with contextlib.suppress(Exception):
            async with h.session.get(url + "/_sim/state") as r:
                peaks.append((await r.json())["counts"]["waiting_peak"])
    gw_metrics = ""
    with contextlib.suppress(Exception):
        gw_metrics = await h.metrics(gw)
    for p in procs:
        h.stop(p)
    out: dict = {"tenants": {}, "engine_queue_peak": peaks,
                 "engine_queue_sampled_max": max((max(r) for r in samples), default=0.0),
                 "engine_queues_sampled_max_sum": max((sum(r) for r in samples), default=0.0),
                 "engine_queue_sampled_mean": round(statistics.mean(sum(r) for r in samples), 2) if samples else 0.0,
                 "slo_counts": _slo_counts(gw_metrics)}
    for t in tenants:
        rs = [r for r in results if r.tenant == t.name]
        out["tenants"][t.name] = summarize(rs)
    out["results"] = results
    return out


def summarize(rs: list[Result]) -> dict:
    ttfts = [r.ttft for r in rs if r.ok and r.ttft is not None]
    shed = [r for r in rs if r.status == 429]
    codes: dict[str, int] = {}
    for r in shed:
        codes[r.code] = codes.get(r.code, 0) + 1
    return {"sent": len(rs), "ok": sum(r.ok for r in rs), "shed": len(shed), "shed_codes": codes,
            "shed_with_retry_after": sum(r.retry_after for r in shed),
            "5xx": sum(1 for r in rs if r.status >= 500),
            "other_errors": sum(1 for r in rs if not r.ok and r.status != 429 and r.status < 500),
            "ttft_p50_ms": _ms(quantile(ttfts, 0.5)), "ttft_p99_ms": _ms(quantile(ttfts, 0.99)),
            "ttft_max_ms": _ms(max(ttfts) if ttfts else None)}


def _slo_counts(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("switchyard_slo_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.removeprefix("switchyard_slo_requests_total")] = float(value)
    return out


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


def fmt(ms: float | None) -> str:
    if ms is None:
        return "—"
    return f"{ms / 1000:.2f} s" if ms >= 1000 else f"{ms:.0f} ms"


def fleet_line(s: dict) -> str:
    return (f"2 simulated vLLM engines × {s['slots']} running slots, {s['max_tokens']}-token streamed answers "
            f"(TTFT {s['ttft_ms']:g} ms, ITL {s['itl_ms']:g} ms), tenants by API key, "
            f"`admission: {{enabled: true, queue_max: {s['queue_max']}, queue_timeout_s: {s['queue_timeout_s']:g}}}`, "
            f"other keys at their defaults; {s['duration_s']:g} s of evenly spaced arrivals; no client retries.")


def tenant_table(runs: dict[str, dict]) -> list[str]:
    lines = ["| run | tenant | sent | ok | shed (429) | with Retry-After | 5xx | TTFT p50 | TTFT p99 | TTFT max | engine queue peak (each) | sampled max (sum) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, run in runs.items():
        for tenant, c in run["tenants"].items():
            codes = ", ".join(f"{k} {v}" for k, v in sorted(c["shed_codes"].items()))
            lines.append(f"| {name} | {tenant} | {c['sent']} | {c['ok']} | {c['shed']}{f' ({codes})' if codes else ''} | "
                         f"{c['shed_with_retry_after']} | {c['5xx']} | {fmt(c['ttft_p50_ms'])} | {fmt(c['ttft_p99_ms'])} | "
                         f"{fmt(c['ttft_max_ms'])} | {' / '.join(str(p) for p in run['engine_queue_peak'])} | "
                         f"{run['engine_queues_sampled_max_sum']:g} |")
    return lines


def strip(run: dict) -> dict:
    """The run without its per-request results (the JSON report keeps the figures)."""
    return {k: v for k, v in run.items() if k != "results"}
