"""Where a lone request's time goes, on the wall clock: ``python bench/timeline.py``.

At low load every request finds the CPU's caches cold, so the gateway's own steps take many
times what they take under load (aiohttp's parser alone: about 3 µs hot, 40-60 µs after 5 ms of
other work). This runs ``python -m gateway`` at its defaults but one worker (request log on, JSON to a file)
behind the fast backend (``bench/fastbackend.py``), drives it with the load generator at
concurrency 1 (``--mode stream`` paced, or ``nonstream``), and stamps ``time.perf_counter_ns``
at the steps of each request, from the first byte read from the client to the first byte written
back:

    rx         the request's first bytes reach the edge (``EdgeProtocol.data_received``)
    lane_parse_in / lane_parsed   the fast lane reading the request's head and body
               (gateway/server/lane.py ``parse``; not for aiohttp's requests)
    rx_done    aiohttp parsed them (its C parser, the payload's StreamReader), or the fast lane
               parsed them and handed the request to the connection's lane task
    start      aiohttp's per-connection task resumed for the request (a loop iteration later;
               not on the fast lane)
    request    the ``web.Request`` is built (request factory; not on the fast lane)
    task       the request's handler runs (in the connection's task on Python 3.11,
               ``gateway/server/edge.py`` ``inline_request_handlers``; eagerly on 3.12), or the
               fast lane's task starts
    handler    the pipeline's ``handle``
    parse_in / parsed      reading and parsing the body
    route_in / routed      routing and charging the decision
    forward    the pipeline's leg begins (``Pipeline.forward``; after the decision's bookkeeping)
    leg_body / leg_headers the leg's body and headers made (gateway/upstream/upstream.py)
    leg_begin  the upstream client asked to begin the exchange
    encode_in / encoded    the upstream request's head encoded (gateway/upstream/h1client.py)
    up_send_in / up_sent   the upstream write (the system call; on loopback it runs the receiver's
                           TCP input too, and often lets the engine run first)
    up_rx      the engine's first bytes arrive
    client_write           the first bytes go to the client (aiohttp's writer, or an answer
                           written whole, gateway/pipeline/whole.py)
    chunk_rx / chunk_out   a stream's first chunk: the engine's read that brings it (after the
                           stream's head went out) and the relay done with it (written to the
                           client, scanned): the part of a paced stream's TTFT the gateway adds
                           after the engine answers

``--mode pd-vllm`` / ``pd-sglang``: a P/D stream behind the P/D mock engines
(``bench/pdbackend.py``: prefill 20 ms, KV transfer 2 ms, a token every 5 ms), with the P/D steps
stamped as well; a step that happens once per leg is numbered (``up_sent`` the prefill's write,
``up_sent#2`` the decode's for vLLM), and the steps are listed in the order of their median time
from ``rx``, each with its median gap to the one before:

    route_in / routed     routing and charging (``r_route``: the strategy's ``route``;
                          ``match``: the ``pd`` router's prefix match; ``pdd``: conditional P/D)
    plan_in / plan_out    the engine adapter's P/D plan (the legs' bodies)
    leg_begin / leg_begun a leg handed to the upstream client (written there when a connection idles)
    up_rx / up_rx_done    an engine's bytes read and parsed (prefill answer, decode head, chunks)
    dbody_in / dbody_out  vLLM: the decode's body from the prefill's answer
    pf_acct_in / _out     the prefill's bookkeeping (breaker, trace, metrics), after the decode's write
    gate_in / gate_out    the decode's first bytes checked by the relay, before the client's
                          head goes out with them (``first_bytes_in`` / ``_out`` where the
                          orchestrator awaits them instead: a head aiohttp writes)
    client_write          a write to the client (the head and the first event go out together)

Prints each step's p50 and p90 in µs over the requests (the first ``--skip`` dropped). The stamps
wrap functions from outside (``--wrappers`` shows what they cost); they move nothing in the
gateway. Run it on a quiet machine: a busy one lengthens every step alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.procs import start_group, stop, wait_port  # noqa: E402
from gateway.server.run import free_port  # noqa: E402

PY = sys.executable
STEPS = ("rx", "lane_parse_in", "lane_parsed", "rx_done", "start", "request", "task", "handler", "parse_in", "parsed", "route_in", "routed",
         "forward", "leg_body", "leg_headers", "leg_begin", "encode_in", "encoded",
         "up_send_in", "up_sent", "up_rx", "client_write", "chunk_rx", "chunk_out")

# Runs inside the gateway process: wraps the steps, writes the stamps at exit.
STAMPS = textwrap.dedent('''
    import atexit, json, os, sys, time
    out = sys.argv[1]
    sys.argv = ["gateway"] + sys.argv[2:]
    import aiohttp.http_writer as W, aiohttp.web_protocol as WP, aiohttp.web_request as WR
    import gateway.pipeline.pipeline as P, gateway.server.edge as E, gateway.upstream.h1client as H
    ns = time.perf_counter_ns
    cur, rows = {}, []
    PD = os.environ.get("TIMELINE_PD") == "1"
    def mark(k):
        if k not in cur:
            cur[k] = ns()
        elif PD:                          # a step of each leg: numbered
            for i in range(2, 6):
                if f"{k}#{i}" not in cur:
                    cur[f"{k}#{i}"] = ns()
                    return
    def around(cls, name, before, after=None, is_async=False):
        f = getattr(cls, name)
        if is_async:
            async def w(*a, **k):
                mark(before)
                r = await f(*a, **k)
                if after:
                    mark(after)
                return r
        else:
            def w(*a, **k):
                mark(before)
                r = f(*a, **k)
                if after:
                    mark(after)
                return r
        setattr(cls, name, w)
    rx = E.EdgeProtocol.data_received
    def data_received(self, data):
        # a request's first bytes; or, at concurrency 1, bytes that come while the request before
        # still finishes after its answer went out (the edge holds them until it is over)
        if data and (self._e_phase in (E._IDLE, E._HEAD) or (self._e_phase == E._BUSY and "client_write" in cur)):
            if cur:
                rows.append(dict(cur))
                cur.clear()
            mark("rx")
            rx(self, data)
            mark("rx_done")
            return
        rx(self, data)
    E.EdgeProtocol.data_received = data_received
    around(W.StreamWriter, "__init__", "start")            # start() builds the writer first
    around(WR.BaseRequest, "__init__", "request")
    handle_request = WP.RequestHandler._handle_request
    async def _handle_request(*a, **k):     # a code object of its own: the edge recognises it
        mark("task")                          # (gateway/server/edge.py inline_request_handlers)
        return await handle_request(*a, **k)
    WP.RequestHandler._handle_request = _handle_request
    around(E.EdgeProtocol, "_lane_run", "task", is_async=True)     # the fast lane's task (gateway/server/lane.py)
    around(P.Pipeline, "handle", "handler", is_async=True)
    around(P.Pipeline, "_parse", "parse_in", "parsed", is_async=True)
    around(P.Pipeline, "route_and_charge", "route_in", "routed")
    around(H._Conn, "send", "up_send_in", "up_sent")
    import gateway.server.lane as L
    parse = L.parse
    def lane_parse(*a, **k):
        mark("lane_parse_in")
        r = parse(*a, **k)
        mark("lane_parsed")
        return r
    E.lane.parse = lane_parse
    around(P.Pipeline, "forward", "forward", is_async=True)
    for fname, step in (("upstream_body", "leg_body"), ("upstream_headers", "leg_headers")):
        def after(f=getattr(P, fname), step=step):
            def w(*a, **k):
                r = f(*a, **k)
                mark(step)
                return r
            return w
        setattr(P, fname, after())
    import gateway.upstream.upstream as U
    if not PD:
        around(U.Upstream, "begin", "leg_begin")
    around(H.UpstreamPool, "_encode", "encode_in", "encoded")
    if not PD:
        around(H._Conn, "data_received", "up_rx")
    around(W.StreamWriter, "_write", "client_write")
    around(W.StreamWriter, "_writelines", "client_write")
    import gateway.pipeline.relay as RL, gateway.pipeline.whole as WH
    around(WH.WrittenStream, "_send", "client_write")              # answers written whole
    RL.write_whole = WH.write_whole = (lambda f: lambda *a, **k: (mark("client_write"), f(*a, **k))[1])(WH.write_whole)
    data_received = H._Conn.data_received
    def upstream_read(self, data):          # a read after the stream's head went out: its first chunk,
        if "client_write" not in cur:       # relayed (written and scanned) by the time the read returns
            return data_received(self, data)
        mark("chunk_rx")
        data_received(self, data)
        mark("chunk_out")
    if not PD:
        H._Conn.data_received = upstream_read
    else:
        import gateway.pd.orchestrator as O, gateway.pipeline.routing as R, gateway.pd.decide as D
        import routers.pd as RP, handlers.vllm as HV, handlers.sglang as HS
        around(R.Routing, "route", "r_route_in", "r_route_out")
        around(RP.PDRouter, "_match", "match_in", "match_out")
        around(D.PDDecider, "decide", "pdd_in", "pdd_out")
        around(U.Upstream, "begin", "leg_begin", "leg_begun")
        for A in (HV.VLLMAdapter, HS.SGLangAdapter):
            around(A, "pd_plan", "plan_in", "plan_out")
        around(HV.VLLMAdapter, "decode_body", "dbody_in", "dbody_out")
        around(O.PDOrchestrator, "_prefill_answered", "pf_acct_in", "pf_acct_out")
        around(O.PDOrchestrator, "_first_bytes", "first_bytes_in", "first_bytes_out", is_async=True)
        gate = O._first_event_error
        def gated(first, gate=gate):
            mark("gate_in")
            r = gate(first)
            mark("gate_out")
            return r
        O._first_event_error = gated
        around(H._Conn, "data_received", "up_rx", "up_rx_done")
        around(O.PDOrchestrator, "forward", "pd_forward", is_async=True)
    def dump():
        if cur:
            rows.append(dict(cur))
        with open(out, "w") as f:
            json.dump(rows, f)
    atexit.register(dump)
    from gateway.__main__ import main
    main()
''')


def wrapper_cost(n: int = 200_000) -> float:
    """µs one stamp wrapper adds to a call (hot): a bound for what the stamps themselves add."""
    import time as _t
    cur: dict = {}

    def mark(k):
        if k not in cur:
            cur[k] = _t.perf_counter_ns()

    def f():
        return None

    def w():
        mark("a")
        r = f()
        mark("b")
        cur.clear()
        return r

    t0 = _t.perf_counter()
    for _ in range(n):
        w()
    t1 = _t.perf_counter()
    for _ in range(n):
        f()
    return ((t1 - t0) - (_t.perf_counter() - t1)) / n * 1e6


def summarize(rows: list[dict], skip: int) -> list[tuple[str, float, float, int]]:
    full = [r for r in rows[skip:] if "rx" in r and "client_write" in r]
    if any("chunk_out" in r for r in full):         # streams: those whose first chunk was stamped
        full = [r for r in full if "chunk_out" in r]
    out = []
    steps = [s for s in STEPS if all(s in r for r in full)]
    for a, b in zip(steps, steps[1:], strict=False):
        d = sorted((r[b] - r[a]) / 1000 for r in full)
        if d:
            out.append((f"{a} → {b}", statistics.median(d), d[int(len(d) * 0.9)], len(d)))
    if full:
        d = sorted((r["client_write"] - r["rx"]) / 1000 for r in full)
        out.append(("rx → client_write (all)", statistics.median(d), d[int(len(d) * 0.9)], len(d)))
    return out


def summarize_pd(rows: list[dict], skip: int) -> list[tuple[str, float, float, int]]:
    """P/D: every step stamped in all the requests, in the order of its median time from ``rx``,
    each with its gap to the step before; last, ``rx`` to the first write to the client."""
    full = [r for r in rows[skip:] if "rx" in r and "client_write" in r and ("first_bytes_out" in r or "gate_out" in r)]
    if not full:
        return []
    keys = [k for k in full[0] if all(k in r for r in full)]
    at = {k: statistics.median(r[k] - r["rx"] for r in full) for k in keys}
    keys.sort(key=at.__getitem__)
    out = []
    for a, b in zip(keys, keys[1:], strict=False):
        d = sorted((r[b] - r[a]) / 1000 for r in full)
        out.append((f"{a} → {b}", statistics.median(d), d[int(len(d) * 0.9)], len(d)))
    d = sorted((r["client_write"] - r["rx"]) / 1000 for r in full)
    out.append(("rx → client_write (all)", statistics.median(d), d[int(len(d) * 0.9)], len(d)))
    return out


def pd_config(style: str, pport: int, dport: int) -> str:
    boot = "        bootstrap_port: 8998\n" if style == "sglang" else ""
    return (f"server:\n  drain_delay_s: 0\n  shutdown_grace_s: 1\nmodels:\n  - name: m\n    engine: {style}\n"
            f"    strategy: pd\n    rolesets:\n      - name: rs-0\n{boot}"
            f"        prefill: [http://127.0.0.1:{pport}]\n        decode: [http://127.0.0.1:{dport}]\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["stream", "nonstream", "pd-vllm", "pd-sglang"], default="stream")
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--pace-ms", type=float, default=5.0, help="stream: the backend's gap between chunks")
    ap.add_argument("--skip", type=int, default=20, help="first requests left out (warm-up)")
    ap.add_argument("--head-with-first", action="store_true",
                    help="stream: the backend sends a stream's head with its first chunk, as SGLang does "
                         "(and the gateway's model says engine: sglang)")
    ap.add_argument("--json", action="store_true", help="print the table as JSON")
    a = ap.parse_args()
    pd = a.mode.startswith("pd-")
    with tempfile.TemporaryDirectory() as d:
        be_port, gw_port = free_port(), free_port()
        cfg, out, log = Path(d) / "gw.yaml", Path(d) / "stamps.json", Path(d) / "gw.log"
        if pd:
            dport = free_port()
            cfg.write_text(pd_config(a.mode[3:], be_port, dport))
            backend = start_group([PY, str(REPO / "bench" / "pdbackend.py"), "--style", a.mode[3:], "--model", "m",
                                   "--prefill-port", str(be_port), "--decode-port", str(dport), "--ready", ""],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        else:
            engine = "sglang" if a.head_with_first else "vllm"     # the engine whose wire the backend plays
            cfg.write_text(f"server:\n  drain_delay_s: 0\n  shutdown_grace_s: 1\nmodels:\n  - name: m\n"
                           f"    engine: {engine}\n    endpoints: [http://127.0.0.1:{be_port}]\n")
            backend = start_group([PY, str(REPO / "bench" / "fastbackend.py"), "--port", str(be_port),
                                   *(["--head-with-first"] if a.head_with_first else [])],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_port(be_port, backend)
            if pd:
                wait_port(dport, backend)
            with open(log, "wb") as err:
                gw = start_group([PY, "-c", STAMPS, str(out), "--config", str(cfg), "--port", str(gw_port), "--workers", "1"],
                                 stdout=subprocess.DEVNULL, stderr=err, cwd=REPO,
                                 env={**os.environ, "TIMELINE_PD": "1" if pd else "0"})
            try:
                wait_port(gw_port, gw)
                argv = [PY, str(REPO / "bench" / "loadgen.py"), "--port", str(gw_port), "--model", "m",
                        "--concurrency", "1", "--duration", str(a.duration), "--mode", "stream" if pd else a.mode]
                if a.mode == "stream":
                    argv += ["--pace-ms", str(a.pace_ms)]
                if pd:
                    argv += ["--max-tokens", "8"]
                r = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)
            finally:
                stop(gw)
        finally:
            stop(backend)
        rows = json.loads(out.read_text()) if out.exists() else []
    table = summarize_pd(rows, a.skip) if pd else summarize(rows, a.skip)
    if a.json:
        print(json.dumps({"steps": table, "loadgen": {k: r.get(k) for k in ("completed", "ttft_p50_ms", "lat_p50_ms")}}))
        return
    print(f"| step ({a.mode}, concurrency 1) | p50 µs | p90 µs |\n|---|---:|---:|")
    for name, p50, p90, _ in table:
        print(f"| {name} | {p50:.1f} | {p90:.1f} |")
    print(f"\n{table[-1][3] if table else 0} requests; a stamp wrapper adds about {wrapper_cost():.2f} µs (hot)")


if __name__ == "__main__":
    main()
