"""Sick engine: one of four endpoints answers half of its requests with a 500 and breaks a fifth of
the streams it serves (its ``/health`` stays fine), under a closed-loop streaming load.

Four gateways in turn, fresh each (no breaker state carried over), in front of the same engines:
breakers and retries off, retries only, breakers only, both (the defaults). For each: the share of
requests a client saw fail (a non-200, an error event, a stream without ``[DONE]``), TTFT p50/p99 of
the requests that succeeded, how many were retried, and the share the sick endpoint was sent.

Then recovery, at the defaults: the load runs against the sick engine for ``--sick-sick-s`` seconds,
the engine heals (its fault is switched off at run time), and the load goes on until its breaker is
closed again and it served a request. Reported: the time from the heal to the first request it
served successfully, and to its breaker reading closed in ``/metrics`` (polled every 100 ms), with
the ejections it had before the heal (each lengthens the next ejection).
"""

from __future__ import annotations

import asyncio
import time

SICK_FAULT = "status=500;p=0.5|drop_after=4;p=0.2"
VARIANTS = {                       # name → (breaker block, retry block)
    "off": ({"enabled": False}, {"enabled": False}),
    "retries only": ({"enabled": False}, {}),
    "breakers only": ({}, {"enabled": False}),
    "breakers + retries": ({}, {}),
}


def add_args(ap) -> None:
    g = ap.add_argument_group("sick-engine")
    g.add_argument("--sick-requests", type=int, default=400, help="requests per variant (default 400)")
    g.add_argument("--sick-concurrency", type=int, default=8)
    g.add_argument("--sick-max-tokens", type=int, default=16)
    g.add_argument("--sick-fault", default=SICK_FAULT, help=f"the sick engine's fault spec (default {SICK_FAULT!r})")
    g.add_argument("--sick-sick-s", type=float, default=15.0, help="recovery run: seconds sick before the heal")
    g.add_argument("--sick-recovery-timeout-s", type=float, default=120.0)


def _engine_args(k: int) -> list[str]:
    return ["--ttft-base-ms", "20", "--itl-ms", "5", "--max-num-seqs", "64", "--seed", str(k + 1)]


def _config(urls: list[str], breaker: dict, retry: dict) -> dict:
    return {"health": {"interval_s": 1}, "scrape": {"interval_s": 1},
            "breaker": breaker, "retry": retry,
            "models": [{"name": "m", "engine": "vllm", "endpoints": urls}]}


def _state(text: str, addr: str) -> float | None:
    for line in text.splitlines():
        if line.startswith("switchyard_breaker_state{") and f'endpoint="{addr}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def _openings(text: str, addr: str) -> int:
    n = 0
    for line in text.splitlines():
        if line.startswith("switchyard_breaker_transitions_total{") and f'endpoint="{addr}"' in line \
                and 'to_state="open"' in line:
            n += int(float(line.rsplit(" ", 1)[1]))
    return n


async def run(h, args) -> dict:
    from bench.resilience import summarize

    urls = []
    for k in range(4):
        extra = _engine_args(k) + (["--fault", args.sick_fault] if k == 0 else [])
        url, _ = await h.engine(f"sick-engine-{k}", "vllm", "m", *extra)
        urls.append(url)
    sick_addr = urls[0].split("//")[1]
    out: dict = {"fault": args.sick_fault, "requests": args.sick_requests, "concurrency": args.sick_concurrency,
                 "max_tokens": args.sick_max_tokens, "variants": {}}
    for name, (breaker, retry) in VARIANTS.items():
        base, p = await h.gateway(f"gw-sick-{name.replace(' ', '-').replace('+', 'and')}",
                                  _config(urls, breaker, retry))
        await asyncio.sleep(1.2)       # first scrapes in
        answers = await h.load(base, args.sick_requests, args.sick_concurrency, max_tokens=args.sick_max_tokens)
        s = summarize(answers)
        s["sick_share"] = sum(1 for a in answers if a.endpoint == sick_addr) / max(1, len(answers))
        s["ejections"] = _openings(await h.metrics(base), sick_addr)
        out["variants"][name] = s
        h.stop(p)
    out["recovery"] = await _recovery(h, args, urls, sick_addr)
    return out


async def _recovery(h, args, urls: list[str], sick_addr: str) -> dict:
    from bench.resilience import summarize

    base, p = await h.gateway("gw-sick-recovery", _config(urls, {}, {}))
    await asyncio.sleep(1.2)
    answers = []
    stop = asyncio.Event()
    healed_at: list[float] = []
    first_ok: list[float] = []

    async def worker() -> None:
        while not stop.is_set():
            a = await h.chat(base, max_tokens=args.sick_max_tokens)
            answers.append(a)
            if healed_at and a.ok and a.endpoint == sick_addr and a.started >= healed_at[0] and not first_ok:
                first_ok.append(time.perf_counter())

    workers = [asyncio.create_task(worker()) for _ in range(args.sick_concurrency)]
    try:
        await asyncio.sleep(args.sick_sick_s)
        before = _openings(await h.metrics(base), sick_addr)
        await h.sim_config(urls[0], fault="none")
        healed_at.append(time.perf_counter())
        closed_at = None
        deadline = healed_at[0] + args.sick_recovery_timeout_s
        while time.perf_counter() < deadline:
            if closed_at is None and _state(await h.metrics(base), sick_addr) == 0:
                closed_at = time.perf_counter()
            if closed_at is not None and first_ok:
                break
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.gather(*workers)
        await h.sim_config(urls[0], fault=args.sick_fault)
        h.stop(p)
    heal = healed_at[0] if healed_at else None
    sick_phase = [a for a in answers if heal is None or a.started < heal]
    after = [a for a in answers if heal is not None and a.started >= heal]
    return {"sick_s": args.sick_sick_s, "ejections_before_heal": before,
            "to_first_success_s": round(first_ok[0] - heal, 2) if first_ok and heal else None,
            "to_breaker_closed_s": round(closed_at - heal, 2) if closed_at and heal else None,
            "sick_phase": summarize(sick_phase), "after_heal": summarize(after)}


def _fmt(v, unit="") -> str:
    return "—" if v is None else f"{v}{unit}"


def report(r: dict) -> str:
    lines = ["## Sick engine", "",
             f"4 vLLM simulators (TTFT 20 ms, 5 ms/token), one with the fault `{r['fault']}` (half of its "
             f"requests answered 500, a fifth of the streams it serves broken after 4 tokens; its `/health` "
             f"fine). {r['requests']} streaming chat requests of {r['max_tokens']} tokens per gateway, "
             f"{r['concurrency']} at a time, routing `least-request` (the default).", "",
             "| breakers / retries | client-visible errors | TTFT p50 | TTFT p99 | retried | answered by the sick engine | its ejections |",
             "|---|---|---|---|---|---|---|"]
    for name, s in r["variants"].items():
        lines.append(f"| {name} | {s['failed']}/{s['requests']} ({s['error_rate']:.1%}) | {_fmt(s['ttft_p50_ms'], ' ms')} "
                     f"| {_fmt(s['ttft_p99_ms'], ' ms')} | {s['retried']} | {s['sick_share']:.1%} | {s['ejections']} |")
    rc = r["recovery"]
    lines += ["", f"Recovery (breakers + retries): sick for {rc['sick_s']:g} s ({rc['ejections_before_heal']} "
                  f"ejection(s) by then; client-visible errors {rc['sick_phase']['failed']}/"
                  f"{rc['sick_phase']['requests']}), then healed: its first successful answer "
                  f"{_fmt(rc['to_first_success_s'], ' s')} later, its breaker closed after "
                  f"{_fmt(rc['to_breaker_closed_s'], ' s')}; client-visible errors after the heal "
                  f"{rc['after_heal']['failed']}/{rc['after_heal']['requests']}."]
    return "\n".join(lines)
