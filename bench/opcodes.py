"""The interpreter's work per request, counted, not timed: ``python bench/opcodes.py [--base REF]``.

On a shared, noisy machine a change worth 2% of the CPU per request hides inside the noise of any
timing (``bench/cpu_ab.py``'s A/A runs differ by 6-10%). Most of the gateway's CPU is the Python
interpreter's, so this counts what the interpreter does instead: ``python -m gateway`` (its
defaults, request log on) behind the fast backend (``bench/fastbackend.py``), traced with
``sys.settrace`` and per-opcode events (``frame.f_trace_opcodes``) on its event loop's thread while
this script sends ``--requests`` requests one after the other on one keep-alive connection (after
``--warmup`` untraced ones), then reports per request:

- **opcodes**: bytecode instructions executed in Python code (the gateway's, aiohttp's, the
  standard library's); work inside C (orjson, the HTTP parsers, uvloop, system calls) counts once
  per call, so it is a measure of the interpreted path, not of every microsecond;
- **calls**: Python frames entered or resumed (a coroutine's resume counts again);
- the files and functions with the most opcodes.

The count is the same from run to run (within about 1%, from timers that fire or
not), so ``--base REF`` (a tree exported with ``git archive``, as ``bench/cpu_ab.py`` does) gives an
exact A/B of a hot-path change, to report beside the CPU time it saves. Tracing makes the gateway
some fifty times slower: timers that fire on the clock (the request log's flush, the view's ticks)
fire more often per request than at full speed.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.cpu_ab import export  # noqa: E402
from bench.overhead import children_of, wait_ready  # noqa: E402
from bench.procs import stop, wait_port  # noqa: E402
from gateway.server.run import free_port  # noqa: E402

PY = sys.executable

# Runs as the gateway's process (each forked worker inherits the handlers): SIGUSR1 starts the
# count on the loop's thread, SIGUSR2 stops it and writes ``OUT.<pid>.json``.
TRACED = textwrap.dedent('''
    import collections, json, os, signal, sys
    out = sys.argv[1]
    ops, calls = collections.Counter(), collections.Counter()
    names = {}

    def tracer(frame, event, arg):
        if event != "call":
            return None
        co = frame.f_code
        key = names.get(co)
        if key is None:
            key = names[co] = f"{co.co_filename}:{co.co_firstlineno}:{co.co_qualname}"
        calls[key] += 1
        frame.f_trace_opcodes = True

        def local(f, ev, a):
            if ev == "opcode":
                ops[key] += 1
            return local
        return local

    def start(*_):
        sys.settrace(tracer)

    def dump(*_):
        sys.settrace(None)
        with open(f"{out}.{os.getpid()}.json", "w") as f:
            json.dump({"ops": ops, "calls": calls}, f)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, dump)
    sys.argv = ["gateway"] + sys.argv[2:]
    from gateway.__main__ import main
    main()
''')


def _body(stream: bool, pace_ms: float = 0.0, usage: bool = False, max_tokens: int = 8) -> bytes:
    text = "hello there, how are you?" + (f" bench-pace-ms={pace_ms:g}" if pace_ms else "")
    body = {"model": "m", "stream": stream, "max_tokens": max_tokens, "messages": [{"role": "user", "content": text}]}
    if stream and usage:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


# the header fields the openai SDK (Python, 1.x) sends with a chat completion, besides Host,
# Accept-Encoding, Content-Length and Content-Type: ``--sdk-headers``
SDK_HEADERS = {"Accept": "application/json", "User-Agent": "OpenAI/Python 1.54.0", "Authorization": "Bearer sk-bench",
               "X-Stainless-Lang": "python", "X-Stainless-Package-Version": "1.54.0", "X-Stainless-OS": "Linux",
               "X-Stainless-Arch": "x64", "X-Stainless-Runtime": "CPython", "X-Stainless-Runtime-Version": "3.11.7",
               "X-Stainless-Async": "false", "X-Stainless-Retry-Count": "0", "X-Stainless-Read-Timeout": "600",
               "Connection": "keep-alive"}


def _send(conn: http.client.HTTPConnection, body: bytes, api_key: str | None = None, sdk: bool = False) -> None:
    """One request, its head and body in one write: ``http.client`` sends them in two, and a gateway
    that reads the head before the body has come (a loaded machine) takes the edge's path that
    waits for the body, some hundreds of opcodes a request that a quiet run does not count."""
    headers = {"Host": "127.0.0.1", "Content-Type": "application/json", **(SDK_HEADERS if sdk else {}),
               "Content-Length": str(len(body))}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if conn.sock is None:
        conn.connect()
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    conn.sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\n{head}\r\n".encode("latin-1") + body)
    resp = http.client.HTTPResponse(conn.sock, method="POST")
    resp.begin()
    resp.read()
    if resp.status != 200:
        raise RuntimeError(f"the gateway answered {resp.status}")


def count(tree: Path, requests: int, warmup: int, stream: bool, workers: int, pace_ms: float = 0.0,
          usage: bool = False, max_tokens: int = 8, extra: str = "", api_key: str | None = None,
          sdk: bool = False) -> dict:
    """Opcodes and calls per request of the gateway in ``tree``, by function."""
    with tempfile.TemporaryDirectory() as d:
        be_port, gw_port = free_port(), free_port()
        backend = subprocess.Popen([PY, str(REPO / "bench" / "fastbackend.py"), "--port", str(be_port)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        cfg, out = Path(d) / "gw.yaml", Path(d) / "ops"
        cfg.write_text(f"server:\n  drain_delay_s: 0\n  shutdown_grace_s: 1\nrouting:\n  strategy: round-robin\n"
                       f"models:\n  - name: m\n    engine: vllm\n    endpoints: [http://127.0.0.1:{be_port}]\n"
                       + (extra.rstrip("\n") + "\n" if extra else ""))
        gw = None
        try:
            wait_port(be_port, backend)
            with open(Path(d) / "gw.log", "wb") as log:
                gw = subprocess.Popen([PY, "-c", TRACED, str(out), "--config", str(cfg), "--port", str(gw_port),
                                       "--workers", str(workers)], cwd=tree, stdout=subprocess.DEVNULL, stderr=log,
                                      start_new_session=True)
            wait_ready("gateway", gw, gw_port, 60, "m", api_key=api_key)
            pids = children_of(gw.pid) if workers > 1 else [gw.pid]
            body = _body(stream, pace_ms, usage, max_tokens)
            conn = http.client.HTTPConnection("127.0.0.1", gw_port, timeout=30)
            for _ in range(warmup):
                _send(conn, body, api_key, sdk)
            # a request's bookkeeping (its record, log line, breakers) runs after its answer went
            # out: the last warm-up's must end before the count starts, and the last counted
            # request's before it stops, or a request's tail is counted once too often or too few
            time.sleep(0.3)
            for pid in pids:
                os.kill(pid, signal.SIGUSR1)
            time.sleep(0.2)
            for _ in range(requests):
                _send(conn, body, api_key, sdk)
            time.sleep(0.3)
            for pid in pids:
                os.kill(pid, signal.SIGUSR2)
            deadline = time.monotonic() + 30
            while len(list(Path(d).glob("ops.*.json"))) < len(pids) and time.monotonic() < deadline:
                time.sleep(0.1)
            conn.close()
        finally:
            if gw is not None:
                gw.send_signal(signal.SIGTERM)
                try:
                    gw.wait(30)
                except subprocess.TimeoutExpired:
                    stop(gw)
            stop(backend)
        ops, calls = collections.Counter(), collections.Counter()
        for f in Path(d).glob("ops.*.json"):
            got = json.loads(f.read_text())
            ops.update(got["ops"])
            calls.update(got["calls"])
    prefix = str(tree.resolve()) + "/"
    strip = {k: k.replace(prefix, "") for k in ops.keys() | calls.keys()}
    return {"ops": {strip[k]: v / requests for k, v in ops.items()},
            "calls": {strip[k]: v / requests for k, v in calls.items()}}


def by_file(c: dict) -> dict[str, float]:
    out: dict[str, float] = collections.defaultdict(float)
    for k, v in c["ops"].items():
        out[k.split(":")[0]] += v
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="", metavar="REF", help="also count a tree exported from this git ref, side by side")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--mode", choices=("nonstream", "stream"), default="nonstream")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--pace-ms", type=float, default=0.0,
                    help="stream: the backend's gap between chunks (0: all at once, often one read; "
                         "1: one read per event, piped as a paced engine's tokens are)")
    ap.add_argument("--max-tokens", type=int, default=8, help="stream: the events a stream has (the backend's chunks)")
    ap.add_argument("--include-usage", action="store_true",
                    help="stream: the client asks for usage (stream_options), so the gateway strips none")
    ap.add_argument("--config", default="", metavar="YAML",
                    help="top-level config blocks added to both gateways' config (not server, routing or models)")
    ap.add_argument("--sdk-headers", action="store_true",
                    help="send the header fields the openai SDK sends (17 in all, where the default is 4)")
    ap.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (with tenants' keys in --config)")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    stream = a.mode == "stream"
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        if a.base:
            runs[f"base ({a.base})"] = count(export(a.base, Path(d)), a.requests, a.warmup, stream, a.workers,
                                             a.pace_ms, a.include_usage, a.max_tokens, a.config, a.api_key,
                                             a.sdk_headers)
        runs["this tree"] = count(REPO, a.requests, a.warmup, stream, a.workers, a.pace_ms, a.include_usage, a.max_tokens,
                                  a.config, a.api_key, a.sdk_headers)
    names = list(runs)
    paced = (f", chunks {a.pace_ms:g} ms apart" if stream and a.pace_ms else "") + \
        (", usage asked" if stream and a.include_usage else "") + (f", {a.max_tokens} tokens" if stream else "") + \
        (", the openai SDK's header fields" if a.sdk_headers else "")
    print(f"{a.mode}{paced}, {a.requests} requests one at a time on one connection, {a.workers} worker(s), per request:\n")
    print("| | " + " | ".join(names) + (" | change |" if len(names) > 1 else " |"))
    print("|---|" + "---:|" * (len(names) + (len(names) > 1)))
    for what in ("ops", "calls"):
        totals = [sum(runs[n][what].values()) for n in names]
        change = f" | {totals[-1] - totals[0]:+,.0f} ({totals[-1] / totals[0] - 1:+.1%})" if len(names) > 1 else ""
        print(f"| {'opcodes' if what == 'ops' else 'calls'} | " + " | ".join(f"{t:,.0f}" for t in totals) + change + " |")
    files = [by_file(runs[n]) for n in names]
    keys = sorted(set().union(*files), key=lambda k: -files[-1].get(k, 0.0))[:a.top]
    print("\n| file: opcodes per request | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{f.get(k, 0.0):,.0f}" for f in files) + " |")
    last = runs[names[-1]]
    print(f"\n| function ({names[-1]}) | opcodes | calls |\n|---|---:|---:|")
    for k, v in sorted(last["ops"].items(), key=lambda kv: -kv[1])[:a.top]:
        print(f"| {k} | {v:,.0f} | {last['calls'].get(k, 0.0):.1f} |")


if __name__ == "__main__":
    main()
