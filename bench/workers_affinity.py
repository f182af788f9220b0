"""What ``--workers N`` costs prefix-cache routing: ``python bench/workers_affinity.py``.

Each worker keeps its own prefix index, and the kernel hands each new connection to one worker.
A conversation whose turns arrive on different connections (a web backend's connection pool, a
client that does not keep connections alive) is seen by each worker only in part, so the worker
that gets a follow-up may not know where the earlier turns' KV lives.

This starts 4 simulated vLLM engines with prefix caching (``enginesim``), then for each worker
count a gateway with ``routing.strategy: prefix-cache`` in front of them, and plays the same
conversations through it: ``--conversations`` conversations of ``--turns`` turns, each turn a
new connection, the conversations interleaved. Each answer's ``usage`` says how many prompt
tokens the engine found in its cache; the report is cached / prompt tokens over all turns after
the first, per worker count, and the requests per second of the run. Everything is on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.procs import stop, wait_port  # noqa: E402
from gateway.server.run import free_port  # noqa: E402

PY = sys.executable


def start(args: list[str], port: int) -> subprocess.Popen:
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_port(port, p)
    return p


async def play(base: str, conversations: int, turns: int, seed: int) -> tuple[int, int, int, float]:
    rng = random.Random(seed)
    histories = [[{"role": "system", "content": f"conversation {i}: " + "context " * rng.randint(150, 300)}]
                 for i in range(conversations)]
    prompt = cached = requests = 0
    started = time.perf_counter()
    for turn in range(turns):
        order = list(range(conversations))
        rng.shuffle(order)
        for i in order:
            histories[i].append({"role": "user", "content": f"turn {turn}: " + "question " * rng.randint(20, 60)})
            # a new connection per request: the kernel picks the worker
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
                    s.post(base + "/v1/chat/completions",
                           json={"model": "m", "messages": histories[i], "max_tokens": 8}) as r:
                body = await r.json()
            requests += 1
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {body}")
            histories[i].append(body["choices"][0]["message"])
            if turn:
                u = body["usage"]
                prompt += u["prompt_tokens"]
                cached += (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return prompt, cached, requests, time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="1,2", help="comma list of worker counts")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=40)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    engines, ports = [], [free_port() for _ in range(a.engines)]
    rows = []
    try:
        for i, port in enumerate(ports):
            engines.append(start([PY, "-m", "enginesim", "--engine", "vllm", "--port", str(port), "--model", "m",
                                  "--seed", str(i), "--ttft-base-ms", "2", "--itl-ms", "1",
                                  "--enable-prefix-caching", "--report-cached-tokens"], port))
        for n in (int(x) for x in a.workers.split(",")):
            gw_port = free_port()
            with tempfile.TemporaryDirectory() as d:
                cfg = Path(d) / "gw.yaml"
                cfg.write_text("routing:\n  strategy: prefix-cache\nserver:\n  log_level: warning\n"
                               "  drain_delay_s: 0\n  shutdown_grace_s: 1\nmodels:\n  - name: m\n    engine: vllm\n"
                               f"    endpoints: [{', '.join(f'http://127.0.0.1:{p}' for p in ports)}]\n")
                gw = start([PY, "-m", "gateway", "--config", str(cfg), "--port", str(gw_port), "--workers", str(n)],
                           gw_port)
                try:
                    # a fresh conversation set per run (the seed differs), so no run inherits the cache of another
                    prompt, cached, reqs, secs = asyncio.run(
                        play(f"http://127.0.0.1:{gw_port}", a.conversations, a.turns, a.seed * 100 + n))
                finally:
                    stop(gw)
            rows.append({"workers": n, "prompt_tokens": prompt, "cached_tokens": cached,
                         "hit_rate": cached / prompt if prompt else 0.0, "requests": reqs, "seconds": secs})
    finally:
        for e in engines:
            stop(e)
    print(f"| workers | follow-up prompt tokens | found in an engine's cache | hit rate |  ({a.conversations} "
          f"conversations × {a.turns} turns, {a.engines} engines, a new connection per request)")
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workers']} | {r['prompt_tokens']:,} | {r['cached_tokens']:,} | {r['hit_rate']:.1%} |")
    if os.environ.get("JSON"):
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
