"""What the status page costs the gateway: ``python -m bench.status_cost [--quick]``.

1. On the request path: ``StatusBoard.on_request`` (every finished request) and
   ``StatusBoard.on_decision`` (every routing decision), exactly as ``record_request`` and
   ``Routing.route`` call them, for a success with a TTFT and for a failure (which also goes into
   the error ring). Reported as CPU ns per call (the thread's CPU time, so that other processes
   on a busy machine do not inflate it; median of rounds), beside ``record_request``'s other
   work for scale (its Prometheus updates, with the log line filtered out as at
   ``log_level: warning``).
2. When the page polls: building ``/status.json`` (``StatusBoard.document`` + ``orjson.dumps``) for
   pools of 8, 64 and 512 endpoints, every model's window full (traffic in all 30 buckets, many
   distinct latencies) and both rings full; CPU time per build and the document's size. The 512
   endpoints again as pods a Kubernetes discovery holds (one in eight not ready, and as many
   skipped), for what the page's discovery section adds.

The garbage collector stays on, as in the gateway. Markdown on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import orjson

from gateway.config.schema import config_from_dict
from gateway.endpoints import EngineMetrics
from gateway.observability.logs import RequestLog, configure_logging
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.status import StatusBoard, StatusSources
from gateway.pipeline.context import RequestRecord, record_request
from gateway.pipeline.routing import Routing
from gateway.request import CHAT, InferenceRequest
from gateway.server.app import pool_from_config
from gateway.server.lifecycle import Lifecycle
from k8s.discovery import KubernetesDiscovery
from routers.base import Decision


def per_call_ns(fn, n: int, rounds: int) -> float:
    out = []
    for _ in range(rounds):
        t = time.thread_time_ns()
        for _ in range(n):
            fn()
        out.append((time.thread_time_ns() - t) / n)
    return statistics.median(out)


def setup(endpoints: int, models: int):
    per = max(1, endpoints // models)
    cfg = config_from_dict({"models": [
        {"name": f"model-{m}", "endpoints": [f"http://10.0.{m}.{i}:8000" for i in range(per)]} for m in range(models)]})
    pool = pool_from_config(cfg)
    clock = [10_000.0]
    board = StatusBoard(cfg.status, pool.has_model, clock=lambda: clock[0])
    routing = Routing(cfg, pool, GatewayMetrics())
    src = StatusSources(cfg, pool, routing, Lifecycle(), {})
    return cfg, pool, board, src, clock


def discovered(endpoints: int, models: int):
    """``setup``'s pool, discovered from pods (not started: the pods are handed to it as a list)."""
    cfg = config_from_dict({"kubernetes": {"enabled": True, "namespaces": ["llm"]},
                            "models": [{"name": f"model-{m}"} for m in range(models)]})
    pool = pool_from_config(cfg)
    disc = KubernetesDiscovery(cfg.kubernetes, pool, {m.name: m for m in cfg.models})
    pods = []
    for i in range(endpoints + endpoints // 8):
        labels = {"model.aibrix.ai/name": f"model-{i % models}"}
        if i >= endpoints:
            labels["model.aibrix.ai/engine"] = "trtllm"          # skipped
        ready = i % 8 != 7
        pods.append({"metadata": {"name": f"pod-{i}", "namespace": "llm", "uid": str(i), "labels": labels},
                     "status": {"podIP": f"10.1.{i // 250}.{i % 250}", "phase": "Running",
                                "conditions": [{"type": "Ready", "status": str(ready)}]}})
    disc._reconcile("llm", pods)
    disc.metrics.heard("llm")
    clock = [10_000.0]
    board = StatusBoard(cfg.status, pool.has_model, clock=lambda: clock[0])
    src = StatusSources(cfg, pool, Routing(cfg, pool, GatewayMetrics()), Lifecycle(), {}, discovery=disc.status)
    return cfg, pool, board, src, clock


def fill(board: StatusBoard, pool, clock, rng: random.Random) -> None:
    """Five minutes of traffic on every model, rings full, every endpoint scraped."""
    eps = pool.endpoints()
    for ep in eps:
        ep.metrics = EngineMetrics(scraped_at=clock[0], running=3, waiting=1, kv_usage=0.4, prefix_hit_rate=0.6,
                                   gen_throughput=120.0)
    start = clock[0]
    for step in range(300):
        clock[0] = start + step
        for model in pool.models():
            for _ in range(5):
                r = RequestRecord(request_id=f"{rng.getrandbits(64):016x}", path=CHAT, started=0.0, model=model,
                                  status=200 if rng.random() > 0.02 else 502, ttft=rng.lognormvariate(-3, 1),
                                  prompt_tokens=100, completion_tokens=50, endpoint=eps[0].name)
                if r.status >= 400:
                    r.error_class, r.error = "upstream_refused", "connection refused"
                board.on_request(r, rng.lognormvariate(-1, 1))
    for i in range(board.settings.recent_decisions):
        board.on_decision(_req(str(i)), Decision(endpoint=eps[0], strategy="least-request"), (), 1e-5)


def _req(rid: str) -> InferenceRequest:
    return InferenceRequest(path=CHAT, body=b"{}", data={}, model="model-0", stream=True, include_usage=False,
                            prompt_text="hi", prompt_tokens_est=1, request_id=rid)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    configure_logging("json", "warning")        # discovery's line per pod added
    n, rounds = (20_000, 3) if args.quick else (200_000, 7)
    quiet = RequestLog(level="warning")      # record_request without its log line, as at log_level: warning
    rng = random.Random(1)

    _, pool, board, _, clock = setup(8, 4)
    ok = RequestRecord(request_id="r", path=CHAT, started=0.0, model="model-0", status=200, ttft=0.031,
                       prompt_tokens=120, completion_tokens=64, endpoint="10.0.0.0:8000", stream=True)
    bad = RequestRecord(request_id="r", path=CHAT, started=0.0, model="model-0", status=502,
                        error_class="upstream_refused", error="connection refused", endpoint="10.0.0.0:8000")
    req = _req("r")
    dec = Decision(endpoint=pool.endpoints()[0], strategy="least-request")
    metrics = GatewayMetrics()
    rows = [
        ("`on_request`, a success with TTFT", per_call_ns(lambda: board.on_request(ok, 0.2), n, rounds)),
        ("`on_request`, a failure (also into the error ring)", per_call_ns(lambda: board.on_request(bad, 0.01), n, rounds)),
        ("`on_decision`", per_call_ns(lambda: board.on_decision(req, dec, (), 1e-5), n, rounds)),
        ("for scale: `record_request` without observers (Prometheus updates; log line filtered)",
         per_call_ns(lambda: record_request(ok, metrics, 1.0, quiet), n // 4, rounds)),
    ]
    print("| on the request path | ns per call |\n|---|---:|")
    for name, ns in rows:
        print(f"| {name} | {ns:,.0f} |")

    print("\n| `/status.json` build | models | endpoints | CPU ms per build (median) | bytes |\n|---|---:|---:|---:|---:|")
    for endpoints, models, make in ((8, 4, setup), (64, 8, setup), (512, 16, setup), (512, 16, discovered)):
        _, pool, board, src, clock = make(endpoints, models)
        fill(board, pool, clock, rng)
        loop = asyncio.new_event_loop()
        times = []
        size = 0
        for _ in range(20 if args.quick else 100):
            t = time.thread_time()
            size = len(orjson.dumps(loop.run_until_complete(board.document(src))))
            times.append(time.thread_time() - t)
        loop.close()
        what = "full windows and rings" + (", pods from Kubernetes" if make is discovered else "")
        print(f"| {what} | {models} | {endpoints} | {statistics.median(times) * 1000:.2f} | {size:,} |")


if __name__ == "__main__":
    main()
