"""What admission control costs at rest: ``python -m bench.admission_cost [--requests N] [--duration S]``.

Two measures, admission off and on (``admission: {enabled: true}``, every other key at its default):

- **CPU per request** of admission's hooks on the path of a request that finds room (the common case
  below saturation): ``Admission.admit`` (the class, the headroom of two endpoints with fresh engine
  metrics, the user's counter), ``dispatched`` and ``released`` (the drain rate, the counter's
  correction, the slow start's TTFT check), in process, over ``--requests`` requests; off, the same
  calls return at their first check. Thread CPU time (``time.thread_time``), best of five rounds.
- **TTFT below saturation**: the issue's fleet (``bench/resilience_flow.py``: two simulated vLLM
  engines of two slots, 16-token streams, about 12 req/s in all) offered a third of its capacity
  (``--rps``, evenly spaced) for ``--duration`` seconds, admission off then on, on fresh fleets:
  TTFT p50 / p99 and how many requests were answered.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.resilience import Harness  # noqa: E402
from bench.resilience_flow import Tenant, fmt, offer  # noqa: E402
from gateway.admission.service import Admission  # noqa: E402
from gateway.config.schema import config_from_dict  # noqa: E402
from gateway.endpoints import EngineMetrics  # noqa: E402
from gateway.observability.metrics import GatewayMetrics  # noqa: E402
from gateway.pipeline.ledger import Charges  # noqa: E402
from gateway.request import parse  # noqa: E402
from gateway.server.app import pool_from_config  # noqa: E402


def _config(enabled: bool):
    return config_from_dict({"models": [{"name": "m", "endpoints": ["http://127.0.0.1:1", "http://127.0.0.1:2"]}],
                             "admission": {"enabled": enabled}})


async def _hooks(enabled: bool, n: int) -> float:
    """Thread CPU microseconds per request of admit + dispatched + released."""
    cfg = _config(enabled)
    pool = pool_from_config(cfg)
    clock = SimpleNamespace(t=1000.0)
    adm = Admission(cfg, pool, GatewayMetrics(), clock=lambda: clock.t)
    eps = pool.endpoints("m")
    for ep in eps:
        ep.metrics = EngineMetrics(scraped_at=1000.0, running=1, waiting=0, kv_usage=0.1)
    body = b'{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":16,"stream":true}'
    ireq = parse("/v1/chat/completions", body, {}, "rid")
    http = SimpleNamespace(headers={})
    best = float("inf")
    for _ in range(5):
        t0 = time.thread_time()
        for i in range(n):
            rec = SimpleNamespace(user=f"u{i % 8}", extra={}, ttft=0.05, completion_tokens=16, status=200,
                                  error_class=None, started=time.perf_counter())
            ctx = SimpleNamespace(ireq=ireq, rec=rec, http=http, decision=None, charges=Charges(), dispatched=None)
            cands = await adm.admit(ctx, eps, False)
            ep = cands[i % len(cands)]
            ctx.decision = SimpleNamespace(endpoint=ep, prefill=None)
            ep.in_flight += 1
            adm.dispatched(ctx)
            ep.in_flight -= 1
            ctx.charges.in_flight = ep
            adm.released("m", ctx)
            clock.t += 0.0001
            if i % 1000 == 0:                # a scrape every so often: the metrics stay fresh
                for e in eps:
                    e.metrics = EngineMetrics(scraped_at=clock.t, running=1, waiting=0, kv_usage=0.1)
        best = min(best, (time.thread_time() - t0) / n * 1e6)
    return best


async def _ttft(args) -> dict:
    s = {"duration_s": args.duration, "slots": 2, "max_tokens": 16, "itl_ms": 20.0, "ttft_ms": 30.0}
    out = {}
    with tempfile.TemporaryDirectory(prefix="admission-cost-") as d:
        for name, adm in (("off", None), ("on", {"enabled": True})):
            async with Harness(Path(d)) as h:
                run = await offer(h, s, f"rest-{name}", [Tenant("u", args.rps)], adm)
            out[name] = run["tenants"]["u"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--rps", type=float, default=4.0, help="offered load for the TTFT part (a third of capacity)")
    ap.add_argument("--no-ttft", action="store_true", help="only the CPU part")
    args = ap.parse_args()
    off = asyncio.run(_hooks(False, args.requests))
    on = asyncio.run(_hooks(True, args.requests))
    print("## Admission at rest\n")
    print(f"CPU per request of admission's hooks (best of 5 × {args.requests}): off {off:.1f} µs, on {on:.1f} µs "
          f"(+{on - off:.1f} µs)\n")
    if not args.no_ttft:
        r = asyncio.run(_ttft(args))
        print(f"TTFT at {args.rps:g} req/s (a third of the fleet's capacity), {args.duration:g} s:\n")
        print("| admission | sent | ok | shed | TTFT p50 | TTFT p99 | TTFT max |\n|---|---|---|---|---|---|---|")
        for name, t in r.items():
            print(f"| {name} | {t['sent']} | {t['ok']} | {t['shed']} | {fmt(t['ttft_p50_ms'])} | "
                  f"{fmt(t['ttft_p99_ms'])} | {fmt(t['ttft_max_ms'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
