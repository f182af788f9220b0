"""How evenly the ``pd`` strategy spreads streams over the decodes: ``python bench/pd_balance.py``.

Two prefill and two decode simulators (enginesim, one roleset) behind a gateway at its defaults,
a closed loop of ``--clients`` streaming chat clients for ``--seconds``. Each decode's decode step
grows with its batch (``--itl-growth-per-running`` ms per running request, as a real engine's step
does), so a decode that holds more than its share streams slower. Every 50 ms the decodes' running
counts are read from the simulators (``/_sim/state``); reported per engine type: requests served,
the mean and largest gap between the two decodes' running counts, the mean total, and the
clients' latency and TTFT (p50, p99). Output: a Markdown table, and the JSON on the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import orjson  # noqa: E402

from bench.resilience import Harness, quantile  # noqa: E402
from bench.soak import free_port, wait_http  # noqa: E402


async def one(h: Harness, engine: str, args) -> dict[str, Any]:
    sim = ["--ttft-base-ms", "5", "--prefill-ms-per-token", "0.05", "--itl-ms", "5",
           "--itl-growth-per-running", str(args.itl_growth_per_running)]
    urls: dict[str, str] = {}
    boot: dict[str, int] = {}
    for name, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")):
        port = free_port()
        argv = [sys.executable, "-m", "enginesim", "--engine", engine, "--role", role, "--host", "127.0.0.1",
                "--port", str(port), "--model", "m", *sim, "--side-channel-port", str(free_port())]
        if engine == "sglang" and role == "prefill":
            boot[name] = free_port()
            argv += ["--bootstrap-port", str(boot[name])]
        p = h.procs.start(f"{engine}-{name}", argv)
        urls[name] = f"http://127.0.0.1:{port}"
        if not await wait_http(h.session, urls[name] + "/health", p, 30):
            raise RuntimeError(f"{engine} {name} did not start")
    prefill = [{"url": urls[n], "bootstrap_port": boot[n]} for n in ("p0", "p1")] if engine == "sglang" \
        else [urls["p0"], urls["p1"]]
    gw, gw_p = await h.gateway(f"{engine}-gw", {"models": [{"name": "m", "engine": engine, "rolesets": [
        {"name": "rs", "prefill": prefill, "decode": [urls["d0"], urls["d1"]]}]}]})
    stop = asyncio.Event()
    answers = []
    samples: list[tuple[int, int]] = []

    async def client() -> None:
        while not stop.is_set():
            answers.append(await h.chat(gw, max_tokens=args.tokens))

    async def running(url: str) -> int:
        assert h.session is not None
        async with h.session.get(url + "/_sim/state") as r:
            st = await r.json()
        run = st["running"]
        return len(run) if isinstance(run, list) else int(run)

    async def sampler() -> None:
        while not stop.is_set():
            a, b = await asyncio.gather(running(urls["d0"]), running(urls["d1"]))
            samples.append((a, b))
            await asyncio.sleep(0.05)

    tasks = [asyncio.create_task(client()) for _ in range(args.clients)] + [asyncio.create_task(sampler())]
    await asyncio.sleep(args.seconds)
    stop.set()
    await asyncio.gather(*tasks)
    h.stop(gw_p)
    steady = samples[len(samples) // 10:]          # the first tenth: the load ramping up
    gaps = [abs(a - b) for a, b in steady]
    ok = [a for a in answers if a.ok]
    lat = [a.latency for a in ok]
    ttft = [a.ttft for a in ok if a.ttft is not None]

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 1)

    return {"requests": len(answers), "failed": len(answers) - len(ok),
            "gap_mean": round(statistics.mean(gaps), 2), "gap_max": max(gaps),
            "running_mean": round(statistics.mean(a + b for a, b in steady), 1),
            "latency_p50_ms": ms(quantile(lat, 0.5)), "latency_p99_ms": ms(quantile(lat, 0.99)),
            "ttft_p50_ms": ms(quantile(ttft, 0.5)), "ttft_p99_ms": ms(quantile(ttft, 0.99))}


async def main_async(args) -> dict[str, Any]:
    logdir = Path(args.logdir) if args.logdir else Path(REPO / "bench" / "out" / "pd-balance-logs")
    logdir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"clients": args.clients, "seconds": args.seconds, "tokens": args.tokens,
                           "itl_growth_per_running": args.itl_growth_per_running, "engines": {}}
    for engine in args.engine.split(","):
        async with Harness(logdir) as h:
            out["engines"][engine] = await one(h, engine, args)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="vllm,sglang")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--tokens", type=int, default=24, help="tokens per stream")
    ap.add_argument("--itl-growth-per-running", type=float, default=0.2,
                    help="ms a decode step grows per running request (default 0.2)")
    ap.add_argument("--logdir", default="")
    args = ap.parse_args()
    r = asyncio.run(main_async(args))
    print(f"| engine | requests in {r['seconds']:g} s | decode gap mean / max | running (both) | "
          "latency p50 / p99 ms | TTFT p50 / p99 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for engine, e in r["engines"].items():
        print(f"| {engine} | {e['requests']} ({e['failed']} failed) | {e['gap_mean']} / {e['gap_max']} | "
              f"{e['running_mean']} | {e['latency_p50_ms']} / {e['latency_p99_ms']} | "
              f"{e['ttft_p50_ms']} / {e['ttft_p99_ms']} |")
    print(orjson.dumps(r).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
