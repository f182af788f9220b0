"""The first request after a lull, with and without warm upstream connections: ``python bench/warm_pool.py``.

vLLM and SGLang close a kept-alive connection after 5 idle seconds (uvicorn's ``timeout_keep_alive``).
A gateway that only reuses what it holds then opens a new connection for the first request after
every lull longer than that; with ``upstream.warm_connections`` (default 1) the pool opens one again
as soon as the engine closes the old one. This runs one simulated vLLM engine (``python -m
enginesim``) that closes idle connections after ``--engine-keepalive`` seconds, and two gateways at
their defaults in front of it, one with ``warm_connections: 1`` and one with ``0``. A client keeps
one connection to each gateway and, every ``--gap`` seconds (longer than the engine's keep-alive),
sends each gateway one non-streaming chat completion, in alternating order. It prints each
gateway's latency (request written to answer read) p50 and p90 over ``--rounds`` rounds, and the
median of the rounds' differences (each round's pair ran back to back, so the machine's drift
hits both). The engine's keep-alive is shortened from 5 s so a run takes seconds, not minutes; the
connect it saves is the same.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.overhead import wait_ready  # noqa: E402
from bench.procs import stop, wait_port  # noqa: E402
from gateway.server.run import free_port  # noqa: E402

PY = sys.executable
BODY = {"model": "m", "messages": [{"role": "user", "content": "after a lull"}], "max_tokens": 1}


def start_gateway(workdir: Path, name: str, engine_url: str, warm: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cfg = workdir / f"{name}.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {shutdown_grace_s: 1, drain_delay_s: 0}\n"
                   f"upstream: {{warm_connections: {warm}}}\n"
                   f"models:\n  - name: m\n    engine: vllm\n    endpoints: [{engine_url}]\n")
    with open(workdir / f"{name}.log", "wb") as err:
        p = subprocess.Popen([PY, "-m", "gateway", "--config", str(cfg)], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=err, start_new_session=True)
    wait_ready(name, p, port, 60, "m")
    return p, port


async def drive(ports: dict[str, int], rounds: int, gap: float) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {name: [] for name in ports}
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=600)
    async with aiohttp.ClientSession(connector=conn) as s:
        for port in ports.values():                 # the client's connection to each gateway, once
            async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=BODY) as r:
                await r.read()
        for i in range(rounds):
            await asyncio.sleep(gap)
            order = list(ports) if i % 2 == 0 else list(reversed(ports))
            for name in order:
                t0 = time.perf_counter()
                async with s.post(f"http://127.0.0.1:{ports[name]}/v1/chat/completions", json=BODY) as r:
                    await r.read()
                    assert r.status == 200, r.status
                out[name].append((time.perf_counter() - t0) * 1000)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--engine-keepalive", type=float, default=1.2, help="seconds (vLLM and SGLang: 5)")
    ap.add_argument("--gap", type=float, default=1.6, help="seconds between rounds (> the engine's keep-alive)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        eport = free_port()
        engine = subprocess.Popen([PY, "-m", "enginesim", "--engine", "vllm", "--model", "m", "--port", str(eport),
                                   "--ttft-base-ms", "1", "--itl-ms", "1", "--prefill-ms-per-token", "0",
                                   "--keepalive-timeout-s", f"{a.engine_keepalive:g}"],
                                  cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        procs = [engine]
        try:
            wait_port(eport, engine)
            url = f"http://127.0.0.1:{eport}"
            ports = {}
            for name, warm in (("warm", 1), ("cold", 0)):
                p, port = start_gateway(work, name, url, warm)
                procs.append(p)
                ports[name] = port
            res = asyncio.run(drive(ports, a.rounds, a.gap))
        finally:
            for p in procs:
                stop(p)
    print(f"engine keep-alive {a.engine_keepalive:g} s, a request to each gateway every {a.gap:g} s, "
          f"{a.rounds} rounds\n")
    print("| gateway | latency p50 ms | p90 ms |\n|---|---:|---:|")
    for name, xs in res.items():
        xs = sorted(xs)
        print(f"| `warm_connections: {1 if name == 'warm' else 0}` | {statistics.median(xs):.3f} | "
              f"{xs[int(len(xs) * 0.9)]:.3f} |")
    diffs = sorted(c - w for c, w in zip(res["cold"], res["warm"], strict=True))
    print(f"\nthe first request after a lull costs {statistics.median(diffs):+.3f} ms more without warm "
          f"connections (median of the {len(diffs)} rounds' differences; quartiles "
          f"{diffs[len(diffs) // 4]:+.3f} and {diffs[(3 * len(diffs)) // 4]:+.3f} ms)")


if __name__ == "__main__":
    main()
