"""What tenancy costs per request: the gateway with no tenancy, with in-memory limits, with Redis.

    python bench/redis_overhead.py            # ~1 minute
    python bench/redis_overhead.py --quick    # ~20 s

Processes on 127.0.0.1: ``redis-server`` (no persistence), the fast backend (``bench/fastbackend.py``)
and, one at a time, Switchyard (``python -m gateway``, uvloop) in three configurations:

- ``off``: no ``auth``/``limits``/``state`` (the pipeline skips every tenancy hook);
- ``memory``: an API key and a user with RPM, TPM and concurrency limits, in-memory counters;
- ``redis``: the same with ``state.redis_url``: one ``EVALSHA`` per request before routing (the
  check) and one after the answer (tokens, concurrency slot), plus the 100 ms fleet sync.

The limits are set high enough never to trigger, so every request runs every check. Measured from
this process (an aiohttp client, the same for every configuration, so differences are the
gateway's): non-streaming latency at concurrency 1, streaming TTFT at concurrency 1, and
throughput and latency at concurrency 32. Configurations are rotated over ``--rounds`` rounds and
the medians of the per-round figures reported. Also: the gateway's own
``switchyard_state_admit_seconds`` (time spent in the limit check) and a direct ``EVALSHA``
round-trip figure for the admit script.

Everything started is stopped by pid on every exit path.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))

from bench.procs import stop, wait_port  # noqa: E402
from gateway.config.schema import StateConfig, UserLimits  # noqa: E402
from gateway.server.run import free_port  # noqa: E402
from gateway.tenants.limits import AdmitQuery  # noqa: E402
from gateway.tenants.redis_state import RedisState  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402

KEY = "sk-bench-0123456789abcdef"
BIG = 10**9
CHAT = [{"role": "user", "content": "Tell me about switchyards and trains."}]


def config(port: int, backend: str, mode: str, redis_url: str) -> dict:
    cfg: dict = {"listen": {"host": "127.0.0.1", "port": port},
                 "server": {"log_level": "warning", "shutdown_grace_s": 1},
                 "health": {"enabled": False}, "scrape": {"enabled": False},
                 "models": [{"name": "m", "engine": "vllm", "endpoints": [backend]}]}
    if mode != "off":
        cfg["auth"] = {"api_keys": [{"key": KEY, "user": "bench"}]}
        cfg["limits"] = {"users": {"bench": {"rpm": BIG, "tpm": BIG, "max_concurrent": BIG}}}
    if mode == "redis":
        cfg["state"] = {"redis_url": redis_url}
    return cfg


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


async def one(s: aiohttp.ClientSession, url: str, stream: bool) -> tuple[float, float]:
    """(latency, ttft) in seconds for one request."""
    body = {"model": "m", "messages": CHAT, "max_tokens": 8, "stream": stream}
    t0 = time.perf_counter()
    ttft = 0.0
    async with s.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"status {r.status}: {await r.text()}")
        if stream:
            async for line in r.content:
                if line.startswith(b"data:") and not ttft:
                    ttft = time.perf_counter() - t0
        else:
            await r.read()
    return time.perf_counter() - t0, ttft


async def measure(port: int, n1: int, duration: float, conc: int) -> dict:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {KEY}"}
    out: dict = {}
    async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=conc)) as s:
        for _ in range(50):                                  # warm-up: connections, caches, scripts
            await one(s, url, False)
        lat = [(await one(s, url, False))[0] for _ in range(n1)]
        ttft = [(await one(s, url, True))[1] for _ in range(n1)]
        out["ns1_p50_ms"], out["ns1_p99_ms"] = pct(lat, 50) * 1e3, pct(lat, 99) * 1e3
        out["ttft1_p50_ms"], out["ttft1_p99_ms"] = pct(ttft, 50) * 1e3, pct(ttft, 99) * 1e3
        seq = await admit_totals(s, port)
        lats: list[float] = []
        stop = time.perf_counter() + duration

        async def worker():
            while time.perf_counter() < stop:
                lats.append((await one(s, url, False))[0])
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        out[f"ns{conc}_rps"] = len(lats) / (time.perf_counter() - t0)
        out[f"ns{conc}_p50_ms"], out[f"ns{conc}_p99_ms"] = pct(lats, 50) * 1e3, pct(lats, 99) * 1e3
        end = await admit_totals(s, port)
    # the check's own time as the gateway sees it; at c>1 it includes waiting for the event loop
    out["admit1_mean_us"] = seq[0] / seq[1] * 1e6 if seq[1] else 0.0
    n = end[1] - seq[1]
    out[f"admit{conc}_mean_us"] = (end[0] - seq[0]) / n * 1e6 if n else 0.0
    return out


async def admit_totals(s: aiohttp.ClientSession, port: int) -> tuple[float, float]:
    """(sum, count) of ``switchyard_state_admit_seconds`` from the gateway's /metrics."""
    async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
        text = await r.text()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("switchyard_state_admit_seconds_sum"):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith("switchyard_state_admit_seconds_count"):
            count = float(line.rsplit(" ", 1)[1])
    return total, count


async def direct_admit(redis_url: str, n: int) -> dict:
    st = RedisState(StateConfig(redis_url=redis_url, key_prefix="bench-direct"))
    await st.sync(None)
    q = AdmitQuery("u", UserLimits(rpm=BIG, tpm=BIG, max_concurrent=BIG), "m")
    for _ in range(100):
        await st.admit(q)
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        await st.admit(q)
        xs.append(time.perf_counter() - t0)
    await st.stop()
    return {"p50_us": pct(xs, 50) * 1e6, "p99_us": pct(xs, 99) * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--requests", type=int, help="sequential requests per round (latency, TTFT)")
    ap.add_argument("--duration", type=float, help="seconds of the concurrent phase per round")
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    n1 = args.requests or (300 if args.quick else 1000)
    duration = args.duration or (2.0 if args.quick else 4.0)
    modes = ["off", "memory", "redis"]
    tmp = Path(tempfile.mkdtemp(prefix="switchyard-bench-"))
    redis = RedisServer().start()
    procs: list[subprocess.Popen] = []
    results: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        bport = free_port()
        backend = subprocess.Popen([sys.executable, str(BENCH / "fastbackend.py"), "--port", str(bport)],
                                   cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True)
        procs.append(backend)
        wait_port(bport, backend)
        for r in range(rounds):
            order = modes[r % 3:] + modes[:r % 3]
            for mode in order:
                port = free_port()
                path = tmp / f"{mode}.yaml"
                path.write_text(yaml.safe_dump(config(port, f"http://127.0.0.1:{bport}", mode, redis.url)))
                gw = subprocess.Popen([sys.executable, "-m", "gateway", "--config", str(path), "--workers", "1"], cwd=REPO,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
                procs.append(gw)
                try:
                    wait_port(port, gw)
                    res = asyncio.run(measure(port, n1, duration, args.concurrency))
                finally:
                    stop(gw)
                    procs.remove(gw)
                results[mode].append(res)
                print(f"round {r + 1}/{rounds} {mode}: " + ", ".join(f"{k}={v:.1f}" for k, v in res.items()),
                      file=sys.stderr, flush=True)
        direct = asyncio.run(direct_admit(redis.url, 3 * n1))
    finally:
        for p in procs:
            stop(p)
        redis.cleanup()

    med = {m: {k: statistics.median(r[k] for r in results[m]) for k in results[m][0]} for m in modes}
    c = args.concurrency
    rows = [("non-stream latency p50, c=1 (ms)", "ns1_p50_ms"), ("non-stream latency p99, c=1 (ms)", "ns1_p99_ms"),
            ("stream TTFT p50, c=1 (ms)", "ttft1_p50_ms"), ("stream TTFT p99, c=1 (ms)", "ttft1_p99_ms"),
            (f"throughput, c={c} (req/s)", f"ns{c}_rps"), (f"latency p50, c={c} (ms)", f"ns{c}_p50_ms"),
            (f"latency p99, c={c} (ms)", f"ns{c}_p99_ms"),
            ("limit check in the gateway, mean, c=1 (µs)", "admit1_mean_us"),
            (f"limit check in the gateway, mean, c={c} (µs)", f"admit{c}_mean_us")]
    print(f"\n# Tenancy overhead ({rounds} round(s), {n1} sequential requests, {duration:g} s at c={c}; medians)\n")
    print("| figure | off | memory | redis | redis − off |")
    print("|---|---:|---:|---:|---:|")
    for title, k in rows:
        o, m_, r_ = med["off"][k], med["memory"][k], med["redis"][k]
        delta = "" if k.startswith("admit") else f"{r_ - o:+.3f}"
        print(f"| {title} | {o:.3f} | {m_:.3f} | {r_:.3f} | {delta} |")
    print(f"\nDirect EVALSHA of the admit script from Python (redis-py asyncio, loopback): "
          f"p50 {direct['p50_us']:.0f} µs, p99 {direct['p99_us']:.0f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
