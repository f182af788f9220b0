"""The edge's fast lane on and off, side by side: ``python bench/lane_ab.py [--client sdk|loadgen]``.

Two gateways from this tree behind one engine, one with ``server.fast_lane: true`` (the default)
and one with ``false`` (every request through aiohttp's request path), driven in turn, ``on, off,
off, on, ...``, so a drift in the machine's load hits both alike:

- ``--client sdk``: the openai SDK (httpx, which writes a request's head and body apart), one chat
  completion at a time, ``--gap-ms`` apart, against both gateways and the backend
  (``bench/fastbackend.py``) directly: per round the p50 time of a call, and each gateway's CPU per
  call (``/proc/PID/stat``, 10 ms ticks) and the share of its calls the lane took;
- ``--client loadgen``: ``bench/loadgen.py`` non-streaming at ``--concurrency`` on ``--path``
  (e.g. ``/v1/messages``) against enginesim (``--engine``, no simulated delays): CPU per request
  from the load generator's ``--cpu-pid``.

Prints every round and the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.procs import cpu_seconds as cpu_of  # noqa: E402
from bench.procs import start_group, stop, wait_port  # noqa: E402
from gateway.server.run import free_port  # noqa: E402

PY = sys.executable
def lane_count(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith("switchyard_client_requests_fast_lane_total "):
            return float(line.split()[1])
    return 0.0


async def sdk_rounds(a: argparse.Namespace, be_port: int, gws: dict[str, tuple[int, int]]) -> None:
    import openai

    clients = {name: openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
               for name, (port, _) in gws.items()}
    clients["direct"] = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{be_port}/v1", api_key="x", max_retries=0)
    p50: dict[str, list[float]] = {k: [] for k in clients}
    cpu = dict.fromkeys(gws, 0.0)
    calls = dict.fromkeys(gws, 0)
    lanes0 = {name: lane_count(port) for name, (port, _) in gws.items()}
    for r in range(a.rounds):
        order = list(clients) if r % 2 == 0 else list(reversed(clients))
        for name in order:
            c = clients[name]
            before = cpu_of(gws[name][1]) if name in gws else 0.0
            times = []
            for _ in range(a.calls):
                t = time.perf_counter()
                await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hello there"}],
                                                max_tokens=2)
                times.append(time.perf_counter() - t)
                await asyncio.sleep(a.gap_ms / 1000)
            p50[name].append(statistics.median(times[5:]) * 1000)
            if name in gws:
                cpu[name] += cpu_of(gws[name][1]) - before
                calls[name] += a.calls
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f} ms" for k, v in p50.items()), flush=True)
    for name, v in p50.items():
        print(f"{name}: p50 of a call, median of {a.rounds} rounds {statistics.median(v):.3f} ms "
              f"(range {min(v):.3f}-{max(v):.3f})")
    for name, (port, _) in gws.items():
        took = lane_count(port) - lanes0[name]
        print(f"{name}: CPU per call {cpu[name] / calls[name] * 1e6:,.0f} µs; on the lane {took:.0f} of {calls[name]}")
    for c in clients.values():
        await c.close()


def loadgen_rounds(a: argparse.Namespace, gws: dict[str, tuple[int, int]]) -> None:
    per: dict[str, list[float]] = {k: [] for k in gws}
    for r in range(a.rounds):
        order = list(gws) if r % 2 == 0 else list(reversed(gws))
        for name in order:
            port, pid = gws[name]
            out = subprocess.run([PY, str(REPO / "bench" / "loadgen.py"), "--port", str(port), "--path", a.path,
                                  "--model", "m", "--mode", "nonstream", "--concurrency", str(a.concurrency),
                                  "--duration", f"{a.duration:g}", "--warmup", "0.5", "--max-tokens", "4",
                                  "--no-usage", "--cpu-pid", f"target={pid}"],
                                 check=True, capture_output=True, text=True).stdout
            res = json.loads(out.strip().splitlines()[-1])
            per[name].append(res["cpu_s"]["target"] / res["total_completed"] * 1e6)
            print(f"round {r + 1} {name}: {per[name][-1]:.1f} µs a request, {res['rps']:,.0f}/s, "
                  f"errors {res['errors']}", flush=True)
    for name, v in per.items():
        print(f"{name}: CPU per request on {a.path}, median of {a.rounds} {statistics.median(v):.1f} µs "
              f"(range {min(v):.1f}-{max(v):.1f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--client", choices=["sdk", "loadgen"], default="sdk")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=60, help="sdk: calls per gateway and round")
    ap.add_argument("--gap-ms", type=float, default=20.0, help="sdk: pause between calls")
    ap.add_argument("--path", default="/v1/messages", help="loadgen: the path driven")
    ap.add_argument("--engine", default="vllm", help="loadgen: enginesim's engine")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--duration", type=float, default=3.0)
    a = ap.parse_args()
    be_port = free_port()
    if a.client == "sdk":
        backend = start_group([PY, str(REPO / "bench" / "fastbackend.py"), "--port", str(be_port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    else:
        backend = start_group([PY, "-m", "enginesim", "--engine", a.engine, "--port", str(be_port), "--model", "m",
                               "--ttft-base-ms", "0", "--itl-ms", "0", "--itl-jitter-ms", "0",
                               "--prefill-ms-per-token", "0"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    procs = [backend]
    try:
        wait_port(be_port, backend)
        gws: dict[str, tuple[int, int]] = {}
        with tempfile.TemporaryDirectory() as d:
            for name, lane in (("lane on", "true"), ("lane off", "false")):
                cfg, port = Path(d) / f"{lane}.yaml", free_port()
                cfg.write_text(f"server:\n  drain_delay_s: 0\n  shutdown_grace_s: 1\n  fast_lane: {lane}\n"
                               f"models:\n  - name: m\n    engine: {a.engine}\n    endpoints: [http://127.0.0.1:{be_port}]\n")
                p = start_group([PY, "-m", "gateway", "--config", str(cfg), "--port", str(port), "--workers", "1"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
                procs.append(p)
                wait_port(port, p)
                gws[name] = (port, p.pid)
            if a.client == "sdk":
                asyncio.run(sdk_rounds(a, be_port, gws))
            else:
                loadgen_rounds(a, gws)
    finally:
        for p in procs:
            stop(p)


if __name__ == "__main__":
    main()
