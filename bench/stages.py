"""Where a small non-streaming request's CPU goes: ``python bench/stages.py [--duration 8]``.

A sampling profiler's wall-clock samples pile up on the socket writes whenever the machine is
busy (a loopback write wakes the reader, and the writer is preempted right there), so this
measures CPU time instead, two ways, with the fast backend (``bench/fastbackend.py``) and the
load generator (``bench/loadgen.py``, concurrency ``--concurrency``) on 127.0.0.1:

- **floor**: a server that reads the body and answers a fixed JSON, as an asyncio ``Protocol``
  with httptools' parser (no aiohttp on the server side: what a protocol of our own could cost),
  as aiohttp's low-level ``web.Server`` and as a ``web.Application`` with one route and one
  middleware: what aiohttp itself costs per request, with no upstream leg; and a bare proxy (each
  of the first two plus the gateway's upstream client, ``gateway/upstream/h1client.py``, no
  pipeline): what forwarding costs;
- **vllm-router**, when ``make bench-peers`` installed it: the same load through it, as the
  reference the overhead targets are stated against;
- **gateway**: ``python -m gateway`` at its defaults but one worker (request log on, JSON to a file; the process measured), with the
  pipeline's stages wrapped in thread-CPU timers (``time.thread_time``, which a preemption does
  not inflate). The wrapping adds about a microsecond per stage.

Each row is CPU per request (user + system of the process over the measured window, from
``/proc/PID/stat``) or per stage (thread CPU summed over the window / requests).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.procs import cpu_seconds as cpu_of  # noqa: E402
from bench.procs import stop, wait_port  # noqa: E402
from gateway.server.run import free_port  # noqa: E402

PY = sys.executable

FLOOR = textwrap.dedent('''
    import asyncio, sys, uvloop
    from aiohttp import web
    BODY = b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant",' \\
           b'"content":"hello world"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":2,' \\
           b'"total_tokens":7}}'
    async def handler(request):
        await request.read()
        return web.Response(body=BODY, content_type="application/json")
    async def main(kind, port, backend):
        if kind == "proxy":
            from gateway.upstream.h1client import UpstreamPool
            pool = UpstreamPool(connect_timeout=5, keepalive_timeout=60, max_connections=0, total_timeout=0)
            url = f"http://127.0.0.1:{backend}/v1/chat/completions"
            async def proxy(request):
                body = await request.read()
                resp = await pool.post(url, body, {"Content-Type": "application/json"})
                data = await resp.read()
                resp.release()            # the connection goes back to the pool, as the gateway does
                return web.Response(body=data, status=resp.status, content_type="application/json")
            await asyncio.get_running_loop().create_server(web.Server(proxy), "127.0.0.1", port)
        elif kind in ("raw", "rawproxy"):
            # what a protocol of our own could cost: asyncio's Protocol and httptools' parser, no
            # aiohttp on the server side (keep-alive, Content-Length bodies only)
            import httptools
            HEAD = b"HTTP/1.1 200 OK\\r\\nContent-Type: application/json\\r\\nContent-Length: %d\\r\\n\\r\\n"
            if kind == "rawproxy":
                from gateway.upstream.h1client import UpstreamPool
                pool = UpstreamPool(connect_timeout=5, keepalive_timeout=60, max_connections=0, total_timeout=0)
                url = f"http://127.0.0.1:{backend}/v1/chat/completions"
            class Raw(asyncio.Protocol):
                def connection_made(self, transport):
                    self.t = transport
                    self.p = httptools.HttpRequestParser(self)
                    self.body = []
                def data_received(self, data):
                    self.p.feed_data(data)
                def on_body(self, b):
                    self.body.append(b)
                def on_message_complete(self):
                    body, self.body = b"".join(self.body), []
                    if kind == "raw":
                        self.t.write(HEAD % len(BODY) + BODY)
                    else:
                        asyncio.get_running_loop().create_task(self.forward(body))
                async def forward(self, body):
                    resp = await pool.post(url, body, {"Content-Type": "application/json"})
                    data = await resp.read()
                    resp.release()
                    self.t.write(HEAD % len(data) + data)
            await asyncio.get_running_loop().create_server(Raw, "127.0.0.1", port)
        elif kind == "lowlevel":
            await asyncio.get_running_loop().create_server(web.Server(handler), "127.0.0.1", port)
        else:
            @web.middleware
            async def mw(request, handler):
                return await handler(request)
            app = web.Application(middlewares=[mw])
            app.router.add_post("/v1/chat/completions", handler)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()
    uvloop.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
''')

# Runs inside the gateway process: wraps the stages, writes the sums at exit.
STAGES = textwrap.dedent('''
    import atexit, collections, json, sys, time
    clock = time.thread_time
    spent = collections.Counter()
    count = [0]

    def timed(f, name):
        def w(*a, **k):
            t = clock()
            try:
                return f(*a, **k)
            finally:
                spent[name] += clock() - t
        return w

    import gateway.pipeline.context as C, gateway.observability.logs as L, gateway.pipeline.pipeline as P, gateway.pipeline.relay as R, gateway.pipeline.routing as RT
    import gateway.observability.status as ST
    P.parse = timed(P.parse, "parse (orjson, validation, prompt for routing)")
    P.upstream_headers = timed(P.upstream_headers, "upstream headers")
    P.record_request = timed(P.record_request, "record (metrics, observers, log line)")
    C.RequestContext.start = classmethod(timed(C.RequestContext.start.__func__, "context (request id, record)"))
    RT.Routing.route = timed(RT.Routing.route, "route (router, histogram, observers)")
    RT.Routing.strategy_for = timed(RT.Routing.strategy_for, "strategy + candidates")
    RT.Routing.candidates = timed(RT.Routing.candidates, "strategy + candidates")
    R.Relay.account_usage = timed(R.Relay.account_usage, "usage accounting")
    L.RequestLog.emit = timed(L.RequestLog.emit, "  of which: the log line")
    ST.StatusBoard.on_request = timed(ST.StatusBoard.on_request, "  of which: status board")
    handle = P.Pipeline.handle
    async def counted(self, request):
        count[0] += 1
        return await handle(self, request)
    P.Pipeline.handle = counted
    out = sys.argv[1]
    atexit.register(lambda: json.dump({"requests": count[0], "stages": dict(spent)}, open(out, "w")))
    sys.argv = ["gateway"] + sys.argv[2:]
    from gateway.__main__ import main
    main()
''')


def load(port: int, duration: float, concurrency: int) -> dict:
    out = subprocess.run([PY, str(REPO / "bench" / "loadgen.py"), "--port", str(port), "--concurrency",
                          str(concurrency), "--duration", str(duration), "--warmup", "1"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def measure(proc: subprocess.Popen, port: int, duration: float, concurrency: int) -> tuple[float, dict]:
    load(port, 1.0, concurrency)                  # warm up
    before = cpu_of(proc.pid)
    r = load(port, duration, concurrency)
    return (cpu_of(proc.pid) - before) / r["total_completed"], r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--concurrency", type=int, default=32)
    a = ap.parse_args()
    rows: list[tuple[str, str]] = []
    names = {"raw": "asyncio Protocol + httptools alone (no aiohttp server)",
             "lowlevel": "aiohttp alone, web.Server", "application": "aiohttp alone, web.Application",
             "rawproxy": "bare proxy: Protocol + httptools + the gateway's upstream client",
             "proxy": "bare proxy: web.Server + the gateway's upstream client"}
    with tempfile.TemporaryDirectory() as d:
        be_port = free_port()
        backend = subprocess.Popen([PY, str(REPO / "bench" / "fastbackend.py"), "--port", str(be_port)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_port(be_port, backend)
            for kind in ("raw", "lowlevel", "application", "rawproxy", "proxy"):
                port = free_port()
                p = subprocess.Popen([PY, "-c", FLOOR, kind, str(port), str(be_port)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True, cwd=REPO)
                try:
                    wait_port(port, p)
                    cpu, r = measure(p, port, a.duration, a.concurrency)
                finally:
                    stop(p)
                rows.append((names[kind], f"{cpu * 1e6:.0f} µs ({r['rps']:,.0f} req/s)"))
            router = REPO / ".venv-peers" / "bin" / "vllm-router"
            if router.exists():          # the reference the issue compares with (make bench-peers)
                port, mport = free_port(), free_port()
                p = subprocess.Popen([str(router), "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                                      f"http://127.0.0.1:{be_port}", "--policy", "round_robin",
                                      "--prometheus-host", "127.0.0.1", "--prometheus-port", str(mport)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
                try:
                    wait_port(port, p)
                    cpu, r = measure(p, port, a.duration, a.concurrency)
                finally:
                    stop(p)
                rows.append(("vllm-router (all its threads)", f"{cpu * 1e6:.0f} µs ({r['rps']:,.0f} req/s)"))
            cfg, out, log = Path(d) / "gw.yaml", Path(d) / "stages.json", Path(d) / "gw.log"
            gw_port = free_port()      # taken now: a port picked earlier may since have gone to a peer
            cfg.write_text(f"server:\n  drain_delay_s: 0\n  shutdown_grace_s: 1\nmodels:\n  - name: m\n"
                           f"    engine: vllm\n    endpoints: [http://127.0.0.1:{be_port}]\n")
            with open(log, "wb") as err:
                gw = subprocess.Popen([PY, "-c", STAGES, str(out), "--config", str(cfg), "--port", str(gw_port), "--workers", "1"],
                                      stdout=subprocess.DEVNULL, stderr=err, start_new_session=True, cwd=REPO)
            try:
                wait_port(gw_port, gw)
                cpu, r = measure(gw, gw_port, a.duration, a.concurrency)
            finally:
                gw.send_signal(15)
                gw.wait(30)
        finally:
            stop(backend)
        stages = json.loads(out.read_text())
    n = stages["requests"]
    rows.append(("Switchyard, defaults (whole process)", f"{cpu * 1e6:.0f} µs ({r['rps']:,.0f} req/s)"))
    for name, secs in sorted(stages["stages"].items(), key=lambda kv: (kv[0].startswith(" "), -kv[1])):
        rows.append((f"  stage: {name}", f"{secs / n * 1e6:.1f} µs"))
    print(f"| CPU per non-streaming request, concurrency {a.concurrency} | µs |\n|---|---:|")
    for name, v in rows:
        print(f"| {name} | {v} |")
    print(f"\n(load average {os.getloadavg()[0]:.2f}; python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
