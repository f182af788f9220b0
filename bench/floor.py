"""What each part of the request pipeline adds to the gateway's forwarding floor: ``python bench/floor.py``.

    python bench/floor.py                                  # every step, 3 rounds of 3 s, one worker
    python bench/floor.py --steps floor,record,log,full --rounds 5 --workers 2

``bench/stages.py`` times the pipeline's stages from inside (thread-CPU timers around them); this
measures from outside what a request costs with only some of the pipeline in its path, on the
gateway's own edge (the fast lane), upstream client and answer writer. Each step is the gateway
(this checkout, at its defaults but ``routing.strategy: round-robin`` as ``bench/cpu_ab.py`` runs
it) started in a process of its own whose inference handler (``Pipeline.handle``) is replaced
before start-up by a shorter one; nothing in the gateway's source changes. The steps add parts
back, each on top of the one before:

- ``floor``: the body's ``model`` read with ``orjson``, the next endpoint in turn, the request
  forwarded with the upstream client (``UpstreamPool.begin``), the answer read and written whole
  (``gateway/pipeline/whole.py``): the least a forwarder on this edge does;
- ``context``: the request's context and record (``RequestContext.start``: request id,
  ``RequestRecord``) and the response headers they give the answer;
- ``record``: ``record_request`` at the end, without its observers and with the log line dropped
  before it is made: the request counter, the latency histogram, the log line's fields;
- ``render``: the log line made (timestamp, JSON) but not handed to the writer;
- ``log``: the log line written (the buffer, the writer thread and its system calls);
- ``observers``: the record's observers (status page, path counts, SLO learning, the shared view
  with several workers);
- ``parse``: the request parsed as the pipeline parses it (``Pipeline._parse``: validation, the
  prompt for routing, aliases and adapters);
- ``strategy``: the model counted in flight, its strategy and router (``_enter``,
  ``legs``, ``Routing.strategy``), the endpoint still the next in turn;
- ``admit``: ``_admit`` (the ready candidates, tenancy's and admission's checks, the engine's
  adapter, the latency objectives);
- ``route``: ``route_and_charge`` (the router's decision, its histogram and observers, the
  charges) and admission's note of the dispatch;
- ``upstream``: the leg opened as the pipeline opens it (``Upstream.begin`` and ``opened`` with
  the pipeline's upstream body and headers), the answer still read and written by the step;
- ``forward``: forwarded and answered by ``Pipeline.forward`` (upstream headers and body, retries
  and breakers, ``Relay.answer``: usage accounting, the head): the pipeline without the script's
  outer frame;
- ``full``: ``Pipeline.handle`` itself (lifecycle, tenancy's key check and settle, tracing).

Every step behind the same fast backend (``bench/fastbackend.py``, 4 ports), driven in turn by the
load generator (``bench/loadgen.py``, non-streaming, concurrency 32), in an order that reverses
every round so a drift of the machine hits all alike; CPU per request from the process's (and its
workers') threads over exactly the measured window. Prints every run, then per step the median,
the range and what it adds to the step before.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.cpu_ab import run, start_backend  # noqa: E402
from bench.overhead import wait_ready  # noqa: E402
from bench.procs import stop, wait_port  # noqa: E402
from gateway.server.run import free_port  # noqa: E402

PY = sys.executable
STEPS = ("floor", "context", "record", "render", "log", "observers", "parse", "strategy", "admit", "route",
         "upstream", "forward", "full")

# Runs as the gateway's process: installs the step's handler, then starts the gateway as
# ``python -m gateway`` would (forked workers inherit the class as patched).
BOOT = textwrap.dedent('''
    import sys, time
    import orjson
    from gateway.observability import logs
    from gateway.pipeline import pipeline as pl
    from gateway.pipeline.context import RequestContext, record_request
    from gateway.pipeline.whole import write_whole
    from gateway.tenants.service import NO_TICKET
    from gateway.upstream.upstream import upstream_body, upstream_headers

    step, STEPS = sys.argv[1], sys.argv[2].split(",")
    level = STEPS.index(step)

    def has(part):
        return level >= STEPS.index(part)

    class NoLog:
        def emit(self, fields):
            pass

    if step == "render":                      # the line made, not written
        logs.LineWriter.write = lambda self, line: None

    async def handle(self, request):
        ctx = rec = None
        if has("context"):
            ctx = RequestContext.start(request)
            rec = ctx.rec
        try:
            if has("parse"):
                ctx.api = self.apis.get(request.path)
                ireq = await self._parse(ctx, NO_TICKET)
                model, body = ireq.model, ireq.body
            else:
                body = request.content.read_nowait()
                model = orjson.loads(body)["model"]
            if has("strategy"):
                counted = self._enter(model)
                rec.model_known = True
                legs = self.legs(model)
                spec, router = self.routing.strategy(model, request.headers.get("routing-strategy"), lora=False)
                rec.strategy = spec
                if has("admit"):
                    adapter, _, candidates = await self._admit(ctx, NO_TICKET, spec, router, legs.slo)
                else:
                    candidates = self.pool.endpoints(model)
                if has("route"):
                    candidates = self.route_and_charge(ctx, spec, router, adapter, candidates, ctx.after_write)
                    self.admission.dispatched(ctx)
                    ep = ctx.decision.endpoint
                else:
                    self._turn = i = (getattr(self, "_turn", -1) + 1) % len(candidates)
                    ep = candidates[i]
                try:
                    if has("forward"):
                        return await self.forward(ctx, candidates, legs)
                    if has("upstream"):
                        ireq = ctx.ireq
                        ctx.use(ep)
                        x = self.upstream.begin(ep, ireq.path, upstream_body(ireq)[0],
                                                ctx.leg_headers(ep, upstream_headers(ireq)))
                        ctx.written()
                        resp = await self.upstream.opened(ep, x, None, ireq.model)
                    else:
                        x = self.upstream.pool.begin(ep.url + request.path, body, {"Content-Type": "application/json"})
                        ctx.written()
                        resp = await x.response(None)
                    data = await resp.read()
                    resp.release()
                finally:
                    ctx.written()
                    ctx.charges.release()
                    self._leave(counted, ctx)
            else:
                eps = self.pool.endpoints(model)
                self._turn = i = (getattr(self, "_turn", -1) + 1) % len(eps)
                ep = eps[i]
                x = self.upstream.pool.begin(ep.url + request.path, body, {"Content-Type": "application/json"})
                resp = await x.response(None)
                data = await resp.read()
                resp.release()
            headers = {}
            if rec is not None:
                rec.status = resp.status
                ctx.use(ep)
                headers = rec.response_headers()
            return write_whole(request, resp.status, headers, "application/json", data)
        finally:
            if has("record"):
                record_request(rec, self.metrics, time.perf_counter(),
                               self.request_log if has("render") else NoLog(),
                               self.observers if has("observers") else ())

    if step != "full":
        pl.Pipeline.handle = handle
    sys.argv = ["gateway"] + sys.argv[3:]
    from gateway.__main__ import main
    main()
''')


def start(step: str, urls: list[str], workdir: Path, workers: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cfg = workdir / f"{step}.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   f"server: {{shutdown_grace_s: 1, drain_delay_s: 0}}\n"
                   f"routing: {{strategy: round-robin}}\n"
                   f"models:\n  - name: m\n    engine: vllm\n    endpoints: [{', '.join(urls)}]\n")
    with open(workdir / f"{step}.log", "wb") as err:
        p = subprocess.Popen([PY, "-c", BOOT, step, ",".join(STEPS), "--config", str(cfg), "--workers", str(workers)], cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                             env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    wait_ready(step, p, port, 60, "m")
    return p, port


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--steps", default=",".join(STEPS), help=f"a comma-separated subset of {','.join(STEPS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--workers", type=int, default=1)
    a = ap.parse_args(argv)
    steps = [s for s in a.steps.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        ap.error(f"unknown steps {unknown}; choose among {', '.join(STEPS)}")
    a.api_key = None
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        backend, ports = start_backend()
        gws: dict[str, tuple[subprocess.Popen, int]] = {}
        try:
            wait_port(ports[0], backend)
            urls = [f"http://127.0.0.1:{p}" for p in ports]
            for s in steps:
                gws[s] = start(s, urls, work, a.workers)
            got: dict[str, list[tuple[float, float]]] = {s: [] for s in steps}
            for i in range(a.rounds):
                for s in (steps if i % 2 == 0 else steps[::-1]):
                    proc, port = gws[s]
                    cpu, rate = run("ns32", port, proc.pid, ports, a)
                    got[s].append((cpu, rate))
                    print(f"round {i + 1} {s}: {cpu:.1f} µs, {rate:,.0f}/s", file=sys.stderr, flush=True)
            print(f"| step | CPU per request, median of {a.rounds} (range) | adds | req/s |\n|---|---:|---:|---:|")
            before = None
            for s in steps:
                cpu = statistics.median(c for c, _ in got[s])
                lo, hi = min(c for c, _ in got[s]), max(c for c, _ in got[s])
                rate = statistics.median(r for _, r in got[s])
                adds = f"{cpu - before:+.1f} µs" if before is not None else ""
                print(f"| {s} | {cpu:.1f} µs ({lo:.1f}–{hi:.1f}) | {adds} | {rate:,.0f} |")
                before = cpu
        finally:
            for proc, _ in gws.values():
                stop(proc)
            stop(backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
