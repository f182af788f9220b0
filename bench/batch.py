"""Batch jobs beside interactive traffic (issue 26): does a batch fill idle slots without delaying
interactive requests?

Two simulated vLLM engines (``max_num_seqs`` slots each, no queueing before that, no inter-token
slow-down with load, so the fleet's capacity is known: ``engines x slots / service time``) behind
one gateway with ``batch.enabled``. Three phases of ``--duration`` seconds each:

1. interactive traffic alone: streamed chat completions, Poisson arrivals at ``--load`` (0.7) of the
   fleet's capacity; its TTFT p50/p99;
2. the batch alone (``--lines`` requests, 10,000; ``--quick``: 1,000): the lines per second it runs
   at on an idle fleet (its idle capacity);
3. both: the same interactive traffic while the batch runs; TTFT again, and the batch's lines/s.

The report gives TTFT p99 with the batch over without it (target: at most 1.1x) and the batch's
lines/s beside interactive traffic against its idle rate and against the share of the fleet the
interactive traffic leaves (1 - load). The batch is cancelled at the end.

    python -m bench.batch [--quick] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import aiohttp
import orjson

from bench.procs import start_group, stop, terminate, wait_port
from gateway.server.run import free_port


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1,000 lines and 10 s phases")
    ap.add_argument("--lines", type=int, default=None, help="batch lines (default 10,000; quick: 1,000)")
    ap.add_argument("--duration", type=float, default=None, help="seconds per phase (default 30; quick: 10)")
    ap.add_argument("--load", type=float, default=0.7, help="interactive load, a share of the fleet's capacity")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--slots", type=int, default=8, help="each engine's max_num_seqs")
    ap.add_argument("--itl-ms", type=float, default=10.0)
    ap.add_argument("--ttft-ms", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=16, help="of interactive requests and batch lines")
    ap.add_argument("--reserve", type=int, default=2, help="batch.reserve_slots")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    a.lines = a.lines or (1000 if a.quick else 10_000)
    a.duration = a.duration or (10.0 if a.quick else 30.0)
    return a


def service_s(a: argparse.Namespace) -> float:
    return (a.ttft_ms + a.max_tokens * a.itl_ms) / 1000


def capacity_rps(a: argparse.Namespace) -> float:
    return a.engines * a.slots / service_s(a)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def one(s: aiohttp.ClientSession, url: str, a: argparse.Namespace, i: int) -> float | None:
    body = {"model": "m", "stream": True, "max_tokens": a.max_tokens,
            "messages": [{"role": "user", "content": f"interactive {i}"}]}
    t0 = time.perf_counter()
    try:
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                await r.read()
                return None
            ttft = None
            async for chunk in r.content.iter_any():
                if ttft is None and b'"content"' in chunk:
                    ttft = time.perf_counter() - t0
            return ttft
    except aiohttp.ClientError:
        return None


async def interactive(url: str, a: argparse.Namespace, rng: random.Random) -> dict:
    rate = a.load * capacity_rps(a)
    tasks, end = [], time.perf_counter() + a.duration
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        i = 0
        while time.perf_counter() < end:
            tasks.append(asyncio.ensure_future(one(s, url, a, i)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        got = await asyncio.gather(*tasks)
    ok = [t for t in got if t is not None]
    return {"sent": len(got), "ok": len(ok), "ttft_p50_ms": _ms(pct(ok, 0.5)), "ttft_p99_ms": _ms(pct(ok, 0.99)),
            "offered_rps": round(rate, 2)}


def _ms(x: float | None) -> float | None:
    return round(x * 1000, 1) if x is not None else None


async def batch_done(s: aiohttp.ClientSession, url: str, bid: str) -> int:
    async with s.get(f"{url}/v1/batches/{bid}") as r:
        doc = await r.json()
    c = doc["request_counts"]
    return c["completed"] + c["failed"]


async def run(a: argparse.Namespace) -> dict:
    rng = random.Random(a.seed)
    work = tempfile.mkdtemp(prefix="bench-batch-")
    procs = []
    try:
        ports = [free_port() for _ in range(a.engines)]
        for p in ports:
            procs.append(start_group([sys.executable, "-m", "enginesim", "--engine", "vllm", "--port", str(p),
                                      "--model", "m", "--max-num-seqs", str(a.slots), "--itl-ms", str(a.itl_ms),
                                      "--ttft-base-ms", str(a.ttft_ms), "--prefill-ms-per-token", "0",
                                      "--itl-growth-per-running", "0"],
                                     stdout=open(os.path.join(work, f"sim-{p}.log"), "wb"), stderr=subprocess.STDOUT))
        gport = free_port()
        cfg = os.path.join(work, "gw.yaml")
        eps = ", ".join(f"'http://127.0.0.1:{p}'" for p in ports)
        with open(cfg, "w") as f:
            f.write(f"listen: {{host: 127.0.0.1, port: {gport}}}\nserver: {{workers: 1, log_level: warning}}\n"
                    "scrape: {interval_s: 0.2}\nrouting: {strategy: least-request}\n"
                    f"models: [{{name: m, engine: vllm, endpoints: [{eps}]}}]\n"
                    f"batch: {{enabled: true, dir: '{work}/batch', endpoint_capacity: {a.slots}, "
                    f"reserve_slots: {a.reserve}, max_concurrency: {a.engines * a.slots}, poll_interval_s: 0.05}}\n")
        gw = start_group([sys.executable, "-m", "gateway", "--config", cfg],
                         stdout=open(os.path.join(work, "gw.log"), "wb"), stderr=subprocess.STDOUT)
        procs.append(gw)
        for p in ports:
            wait_port(p, procs[0])
        wait_port(gport, gw)
        url = f"http://127.0.0.1:{gport}"
        async with aiohttp.ClientSession() as s:
            while True:
                async with s.get(url + "/ready") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.1)
        await interactive(url, a, random.Random(a.seed + 1))          # warm-up (connections, scrapes)
        alone = await interactive(url, a, rng)
        rows = b"".join(orjson.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
                                      "body": {"model": "m", "max_tokens": a.max_tokens,
                                               "messages": [{"role": "user", "content": f"batch {i}"}]}}) + b"\n"
                        for i in range(a.lines))
        async with aiohttp.ClientSession() as s:
            form = aiohttp.FormData()
            form.add_field("purpose", "batch")
            form.add_field("file", rows, filename="lines.jsonl")
            async with s.post(url + "/v1/files", data=form) as r:
                fid = (await r.json())["id"]
            async with s.post(url + "/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/chat/completions",
                                                          "completion_window": "24h"}) as r:
                bid = (await r.json())["id"]
            while await batch_done(s, url, bid) == 0:
                await asyncio.sleep(0.05)
            n0, t0 = await batch_done(s, url, bid), time.perf_counter()
            await asyncio.sleep(a.duration)
            n1, t1 = await batch_done(s, url, bid), time.perf_counter()
            idle_lps = (n1 - n0) / (t1 - t0)
            beside = await interactive(url, a, rng)
            n2, t2 = await batch_done(s, url, bid), time.perf_counter()
            beside_lps = (n2 - n1) / (t2 - t1)
            async with s.post(f"{url}/v1/batches/{bid}/cancel") as r:
                await r.read()
        slots_lps = a.engines * (a.slots - a.reserve) / service_s(a)
        return {
            "settings": {k: getattr(a, k) for k in ("lines", "duration", "load", "engines", "slots", "itl_ms", "ttft_ms",
                                                    "max_tokens", "reserve", "seed")},
            "fleet_capacity_rps": round(capacity_rps(a), 2),
            "interactive_alone": alone, "interactive_with_batch": beside,
            "ttft_p99_ratio": round(beside["ttft_p99_ms"] / alone["ttft_p99_ms"], 3)
            if alone["ttft_p99_ms"] and beside["ttft_p99_ms"] else None,
            "batch_lines_per_s_idle": round(idle_lps, 2), "batch_lines_per_s_beside": round(beside_lps, 2),
            "batch_lines_per_s_idle_bound": round(slots_lps, 2),
            "left_by_interactive_lines_per_s": round(max(0.0, 1 - a.load) * capacity_rps(a), 2),
        }
    finally:
        for p in reversed(procs):
            with contextlib.suppress(Exception):
                (terminate if p is procs[-1] else stop)(p)
        shutil.rmtree(work, ignore_errors=True)


def report(r: dict) -> str:
    s, a, b = r["settings"], r["interactive_alone"], r["interactive_with_batch"]
    return "\n".join([
        "## Batch beside interactive traffic", "",
        f"{s['engines']} vLLM simulators x {s['slots']} slots, {s['max_tokens']} tokens at {s['itl_ms']:g} ms, "
        f"TTFT {s['ttft_ms']:g} ms: fleet capacity {r['fleet_capacity_rps']} req/s; interactive at "
        f"{s['load']:.0%} ({a['offered_rps']} req/s, Poisson), {s['duration']:g} s per phase; batch of "
        f"{s['lines']} lines, reserve_slots {s['reserve']}.", "",
        "| | sent | ok | TTFT p50 ms | TTFT p99 ms |", "|---|---|---|---|---|",
        f"| interactive alone | {a['sent']} | {a['ok']} | {a['ttft_p50_ms']} | {a['ttft_p99_ms']} |",
        f"| interactive + batch | {b['sent']} | {b['ok']} | {b['ttft_p50_ms']} | {b['ttft_p99_ms']} |", "",
        f"- TTFT p99 with the batch / without: **{r['ttft_p99_ratio']}x** (target <= 1.1x)",
        f"- batch on the idle fleet: {r['batch_lines_per_s_idle']} lines/s (bound with the reserve: "
        f"{r['batch_lines_per_s_idle_bound']} lines/s)",
        f"- batch beside interactive traffic: {r['batch_lines_per_s_beside']} lines/s; the interactive traffic "
        f"leaves {r['left_by_interactive_lines_per_s']} req/s of the fleet", ""])


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    r = asyncio.run(run(a))
    print(json.dumps(r, indent=2) if a.json else report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
