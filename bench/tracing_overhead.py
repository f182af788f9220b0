"""What tracing costs per request: the gateway with tracing off, on with every request sampled
(spans exported to an OTLP receiver), and on with nothing sampled (context still propagated).

    python bench/tracing_overhead.py            # ~1.5 minutes
    python bench/tracing_overhead.py --quick    # ~30 s
    python bench/tracing_overhead.py --micro    # seconds: the tracing calls alone, in a loop

Processes on 127.0.0.1: the fast backend (``bench/fastbackend.py``), three Switchyards
(``python -m gateway``, uvloop, ``round-robin``, ``log_level: warning``), one per configuration,
up for the whole run and measured in turn, and one load generator process per measurement
(``bench/loadgen.py``: non-streaming chat completions, closed loop). The OTLP/HTTP receiver runs in this process (an aiohttp app on its own
thread and loop) and decodes every export with ``opentelemetry-proto``, so the span count proves
the spans arrived:

- ``off``: no ``tracing`` block (no middleware, no provider: the no-op trace object);
- ``on``: ``tracing.enabled``, ``sample_ratio: 1``, batches of up to 512 spans at least every
  0.2 s (so a window's spans are exported, and their cost counted, within that window);
- ``unsampled``: ``sample_ratio: 0``: spans are created but not recorded, every engine leg still
  gets a ``traceparent``.

Figures per configuration and concurrency: the gateway's CPU per request (its threads' CPU time
from ``/proc/PID/task/*/schedstat`` over exactly the measured window, divided by the requests
completed in it: the exporter thread counts), req/s and p50 latency. The order of the
configurations rotates between rounds; medians over ``--rounds`` rounds are reported, with the
load average before and after (other work on the machine inflates every figure).
Everything started is stopped by pid on every exit path.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import orjson
import yaml
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))

from bench.procs import stop, wait_port  # noqa: E402
from gateway.server.run import free_port  # noqa: E402

MODES = ("off", "on", "unsampled")


class Receiver:
    """An OTLP/HTTP trace receiver on its own thread: counts exports and spans."""

    def __init__(self) -> None:
        self.spans = 0
        self.exports = 0
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Receiver:
        self._thread.start()
        self._ready.wait(10)
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        ok = ExportTraceServiceResponse().SerializeToString()

        async def export(request: web.Request) -> web.Response:
            req = ExportTraceServiceRequest.FromString(await request.read())
            self.exports += 1
            self.spans += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
            return web.Response(body=ok, content_type="application/x-protobuf")

        app.router.add_post("/v1/traces", export)
        self.runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        async def close() -> None:
            await self.runner.cleanup()
            self.loop.stop()
        asyncio.run_coroutine_threadsafe(close(), self.loop)
        self._thread.join(5)


def config(port: int, backend: str, mode: str, receiver_port: int) -> dict:
    cfg: dict = {"listen": {"host": "127.0.0.1", "port": port},
                 "server": {"log_level": "warning", "shutdown_grace_s": 1},
                 "routing": {"strategy": "round-robin"},
                 "health": {"interval_s": 5}, "scrape": {"enabled": False},
                 "models": [{"name": "m", "engine": "vllm", "endpoints": [backend]}]}
    if mode != "off":
        # a short batch delay: spans are exported within the measured window that made them
        cfg["tracing"] = {"enabled": True, "endpoint": f"http://127.0.0.1:{receiver_port}/v1/traces",
                          "sample_ratio": 1.0 if mode == "on" else 0.0, "batch_delay_s": 0.2}
    return cfg


def load(port: int, gw_pid: int, concurrency: int, duration: float, warmup: float) -> dict:
    argv = [sys.executable, str(BENCH / "loadgen.py"), "--port", str(port), "--mode", "nonstream",
            "--concurrency", str(concurrency), "--duration", f"{duration:g}", "--warmup", f"{warmup:g}",
            "--cpu-pid", f"gateway={gw_pid}"]
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=warmup + duration + 60)
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed: {out.stderr[-500:]}")
    r = orjson.loads(out.stdout.strip().splitlines()[-1])
    if r["errors"]:
        raise RuntimeError(f"{r['errors']} failed requests: {r['error_samples']}")
    cpu = r["cpu_s"]["gateway"]
    return {"cpu_us": cpu / r["completed"] * 1e6, "rps": r["rps"], "p50_ms": r["lat_p50_ms"],
            "completed": r["completed"]}


def micro(n: int = 20000) -> None:
    """The tracing calls of one aggregated request in a loop, in this process: no sockets, so the
    figures are the spans' own CPU. Sampled: creating and ending the spans, then encoding them as
    the OTLP exporter does; unsampled; and tracing off (the no-op trace object)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from gateway.endpoints import Endpoint
    from gateway.observability.metrics import GatewayMetrics
    from gateway.observability.tracing import (
        _PROPAGATOR,
        NO_TRACE,
        RequestTrace,
        Tracing,
        TracingConfig,
        resolve,
    )
    from gateway.pipeline.context import RequestRecord
    from routers.base import Decision

    class Keep(SpanExporter):
        def __init__(self) -> None:
            self.spans: list = []

        def export(self, spans):
            self.spans.extend(spans)
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass

    ep = Endpoint(url="http://127.0.0.1:8001", model="m", engine="vllm", role="aggregated")
    headers = {"Content-Type": "application/json", "X-Request-Id": "r1"}
    rec = RequestRecord(request_id="r1", path="/v1/chat/completions", started=time.perf_counter(), model="m",
                        prompt_tokens=10, completion_tokens=5, cached_tokens=0, ttft=0.01, finish_reason="stop",
                        status=200, endpoint=ep.name, stream=True)

    decision = Decision(ep, "least-request")

    def one(trace) -> None:
        trace.route_start()
        trace.routed(decision, 2)
        leg = trace.leg("generate", ep)
        leg.inject(headers)
        leg.responded(200)
        trace.finish(rec)

    for ratio in (1.0, 0.0):
        keep = Keep()
        t = Tracing(resolve(TracingConfig(enabled=True, sample_ratio=ratio, max_queue_size=10 * n), env={}),
                    GatewayMetrics(), exporter=keep)
        c0 = time.process_time()
        for _ in range(n):
            span = t.tracer.start_span("POST /v1/chat/completions", context=_PROPAGATOR.extract(headers),
                                       kind=otel_server_kind(), attributes={"http.request.method": "POST",
                                                                            "url.path": rec.path})
            rt = RequestTrace(t, span)
            one(rt)
            rt.close(200)
        c1 = time.process_time()
        t.provider.force_flush()
        c2 = time.process_time()
        for i in range(0, len(keep.spans), 512):
            encode_spans(keep.spans[i:i + 512]).SerializePartialToString()
        c3 = time.process_time()
        t.provider.shutdown()
        print(f"sample_ratio {ratio:g}: {(c1 - c0) / n * 1e6:.1f} µs per request to create and end its spans"
              + (f", {(c3 - c2) / n * 1e6:.1f} µs to encode them ({len(keep.spans) / n:g} spans)" if keep.spans else ""))
    c0 = time.process_time()
    for _ in range(n * 10):
        one(NO_TRACE)
    print(f"tracing off: {(time.process_time() - c0) / (n * 10) * 1e6:.2f} µs per request in no-op calls")


def otel_server_kind():
    from opentelemetry.trace import SpanKind
    return SpanKind.SERVER


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--micro", action="store_true", help="only the in-process loop of the tracing calls (seconds)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--duration", type=float, help="measured seconds per run")
    ap.add_argument("--concurrency", default="1,32", help="comma-separated closed-loop concurrencies")
    args = ap.parse_args(argv)
    if args.micro:
        micro()
        return 0
    rounds = args.rounds or (2 if args.quick else 5)
    duration = args.duration or (1.5 if args.quick else 2.0)
    warmup = 0.5
    concs = [int(c) for c in args.concurrency.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="switchyard-bench-"))
    rx = Receiver().start()
    procs: list[subprocess.Popen] = []
    results: dict[tuple[str, int], list[dict]] = {(m, c): [] for m in MODES for c in concs}
    load_before = os.getloadavg()
    try:
        bport = free_port()
        backend = subprocess.Popen([sys.executable, str(BENCH / "fastbackend.py"), "--port", str(bport)],
                                   cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True)
        procs.append(backend)
        wait_port(bport, backend)
        gateways: dict[str, tuple[int, subprocess.Popen]] = {}
        for mode in MODES:            # all three up for the whole run; measured in turn
            port = free_port()
            path = tmp / f"{mode}.yaml"
            path.write_text(yaml.safe_dump(config(port, f"http://127.0.0.1:{bport}", mode, rx.port)))
            gw = subprocess.Popen([sys.executable, "-m", "gateway", "--config", str(path), "--workers", "1"], cwd=REPO,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            procs.append(gw)
            gateways[mode] = (port, gw)
        for port, gw in gateways.values():
            wait_port(port, gw)
        for r in range(rounds):
            for c in concs:
                order = MODES[r % 3:] + MODES[:r % 3]     # a drift of the machine hits every mode alike
                for mode in order:
                    port, gw = gateways[mode]
                    res = load(port, gw.pid, c, duration, warmup)
                    results[(mode, c)].append(res)
                    print(f"round {r + 1}/{rounds} {mode} c={c}: " + ", ".join(
                        f"{k}={v:.1f}" for k, v in res.items()), file=sys.stderr, flush=True)
        for mode in MODES:
            stop(gateways[mode][1])       # shutdown flushes what is still queued
        time.sleep(0.3)
    finally:
        for p in procs:
            stop(p)
        rx.stop()
    load_after = os.getloadavg()

    med = {k: {f: statistics.median(x[f] for x in v) for f in v[0]} for k, v in results.items()}
    measured = sum(x["completed"] for c in concs for x in results[("on", c)])
    print(f"\n# Tracing overhead ({rounds} rounds, {duration:g} s per run after {warmup:g} s warm-up; "
          f"non-streaming; medians)\n")
    print(f"Load average before / after: {load_before[0]:.2f} / {load_after[0]:.2f} "
          f"({os.cpu_count()} CPUs), {time.strftime('%Y-%m-%d')}\n")
    print("| figure | off | on, ratio 1 | on, ratio 0 | ratio 1 − off | ratio 0 − off |")
    print("|---|---:|---:|---:|---:|---:|")
    for c in concs:
        for title, f, digits in (("gateway CPU per request (µs)", "cpu_us", 0), ("throughput (req/s)", "rps", 0),
                                 ("latency p50 (ms)", "p50_ms", 3)):
            o, on, un = med[("off", c)][f], med[("on", c)][f], med[("unsampled", c)][f]
            print(f"| {title}, c={c} | {o:.{digits}f} | {on:.{digits}f} | {un:.{digits}f} "
                  f"| {on - o:+.{digits}f} | {un - o:+.{digits}f} |")
    print(f"\nSpans received by the OTLP receiver: {rx.spans} (the ratio-1 gateway served {measured} measured "
          f"requests, plus warm-ups; 3 spans each); exports {rx.exports}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
