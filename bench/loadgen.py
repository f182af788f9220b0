"""A cheap, accurate HTTP/1.1 load generator for overhead benchmarks (a process of its own).

Raw asyncio ``Protocol`` clients on uvloop, one keep-alive connection per concurrent worker, the
request bytes encoded once; per-request latency is taken with ``time.perf_counter`` from the write
of the request to the last byte of the answer, TTFT to the first body bytes that carry an SSE
``data:`` event. Parsing is the minimum that is still exact: the status line, ``Content-Length`` or
chunked framing (the end is the ``0\\r\\n\\r\\n`` terminal chunk), and a count of ``data:`` events.

Modes (``--mode``):

- ``nonstream``/``stream``: closed loop at ``--concurrency``; ``--warmup`` seconds unmeasured, then a
  ``--duration`` window in which completions, latencies and TTFTs are recorded. Requests still in
  flight at the end of the window are completed (not counted) before the connections close.
- ``idle``: open ``--idle-n`` connections (``--connect-parallel`` at a time), each sending a stream
  request the backend holds open after one chunk (``bench-hold`` in the prompt); once every stream
  has its first event, print ``{"event": "held", ...}`` and wait for a line on stdin (or EOF), then
  close them all and print the result.

``--cpu-pid NAME=PID`` (repeatable) samples the CPU time of those processes at the start and end of
the window, so CPU per request covers exactly the measured requests: ``cpu_s`` from the threads'
``/proc/PID/task/*/schedstat`` (ns resolution), ``cpu_stat_s`` from utime+stime of ``/proc/PID/stat``
(10 ms ticks, too coarse for short windows; kept as a cross-check).

Output: one JSON object on the last stdout line (raw samples in microseconds with ``--samples``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import time

import orjson

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

perf = time.perf_counter
CLK_TCK = os.sysconf("SC_CLK_TCK")
_LEN, _CHUNKED, _CLOSE = 0, 1, 2
_END = b"\r\n0\r\n\r\n"


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds, from /proc/PID/stat (10 ms ticks);
    -1 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return -1.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_seconds_precise(pid: int) -> float:
    """CPU time of a process in seconds at nanosecond resolution: the sum of its threads' run time
    (/proc/PID/task/*/schedstat). Falls back to ``cpu_seconds`` when schedstat is not available."""
    if not os.path.exists(f"/proc/{pid}/schedstat"):
        return cpu_seconds(pid)
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return -1.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue   # a thread that just exited
    return total / 1e9


def rss_bytes(pid: int) -> int:
    """VmRSS of a process in bytes; -1 when it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of an already sorted list."""
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, int(round(q / 100.0 * len(sorted_values) + 0.5)) - 1))
    return sorted_values[k]


def build_request(host: str, port: int, path: str, model: str, stream: bool, max_tokens: int,
                  pace_ms: float, hold: bool, usage: bool) -> bytes:
    prompt = "Say something."
    if pace_ms > 0:
        prompt += f" bench-pace-ms={pace_ms:g}"
    if hold:
        prompt += " bench-hold"
    payload: dict = {"model": model, "messages": [{"role": "user", "content": prompt}],
                     "max_tokens": max_tokens, "stream": stream}
    if stream and usage:
        payload["stream_options"] = {"include_usage": True}
    body = orjson.dumps(payload)
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: */*\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


class Client(asyncio.Protocol):
    """One keep-alive connection; sends the next request as soon as the previous answer is complete."""

    def __init__(self, gen: Gen) -> None:
        self.gen = gen
        self.t: asyncio.Transport | None = None
        self.busy = False
        self.t0 = 0.0
        self.ttft = 0.0
        self.head = b""
        self.in_body = False
        self.kind = _LEN
        self.remaining = 0
        self.status = 0
        self.events = 0
        self.tail = b"\r\n"
        self.conn_close = False
        self.waiter: asyncio.Future | None = None   # idle mode: set at the first event

    def connection_made(self, transport) -> None:
        self.t = transport

    def send(self) -> None:
        self.busy = True
        self.gen.busy += 1
        self.in_body = False
        self.head = b""
        self.events = 0
        self.ttft = 0.0
        self.tail = b"\r\n"
        self.t0 = perf()
        self.t.write(self.gen.req)

    def data_received(self, data: bytes) -> None:
        if not self.in_body:
            head = self.head + data if self.head else data
            i = head.find(b"\r\n\r\n")
            if i < 0:
                self.head = head
                return
            self.head = b""
            data = head[i + 4:]
            hl = head[:i].lower()
            try:
                self.status = int(hl[9:12])
            except ValueError:
                self.status = 0
            j = hl.find(b"content-length:")
            if j >= 0:
                k = hl.find(b"\r\n", j)
                self.remaining = int(hl[j + 15:k if k >= 0 else len(hl)])
                self.kind = _LEN
            elif b"chunked" in hl:
                self.kind = _CHUNKED
            else:
                self.kind = _CLOSE
            self.conn_close = b"connection: close" in hl
            self.in_body = True
            if self.kind == _LEN and self.remaining <= 0:
                self.finish()
                return
            if not data:
                return
        if self.kind == _CHUNKED:
            tail = self.tail
            joined = tail + data
            n = joined.count(b"data:") - tail.count(b"data:")
            if n:
                if not self.events:
                    self.ttft = perf()
                    if self.waiter is not None and not self.waiter.done():
                        self.waiter.set_result(True)
                self.events += n
            if joined.endswith(_END):
                self.finish()
            else:
                self.tail = joined[-7:]
        elif self.kind == _LEN:
            if not self.ttft:
                self.ttft = perf()
            self.remaining -= len(data)
            if self.remaining <= 0:
                self.finish()
        else:
            if not self.ttft:
                self.ttft = perf()
            self.events += data.count(b"data:")

    def finish(self) -> None:
        now = perf()
        self.busy = False
        self.in_body = False
        gen = self.gen
        gen.busy -= 1
        gen.record(self, now)
        if self.conn_close:
            self.t.close()
            gen.reconnect(self)
        elif gen.running:
            self.send()
        elif gen.idle_event is not None:
            gen.check_idle()

    def connection_lost(self, exc) -> None:
        gen = self.gen
        if self.busy:
            self.busy = False
            gen.busy -= 1
            if self.kind == _CLOSE and self.in_body:
                self.finish_close()
                return
            gen.error("connection lost mid-request" + (f": {exc!r}" if exc else ""))
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(False)
            gen.reconnect(self)
        gen.clients.discard(self)
        gen.check_idle()

    def finish_close(self) -> None:
        self.gen.record(self, perf())
        self.gen.reconnect(self)


class Gen:
    def __init__(self, args: argparse.Namespace, loop: asyncio.AbstractEventLoop) -> None:
        self.args = args
        self.loop = loop
        stream = args.mode in ("stream", "idle")
        self.stream = stream
        self.req = build_request(args.host, args.port, args.path, args.model, stream,
                                 args.max_tokens, args.pace_ms, args.mode == "idle", args.usage)
        self.expect_events = args.max_tokens if stream else 0
        self.running = False
        self.measuring = False
        self.clients: set[Client] = set()
        self.lat: list[float] = []
        self.ttft: list[float] = []
        self.completed = 0
        self.events = 0
        self.errors = 0
        self.short_streams = 0
        self.error_samples: list[str] = []
        self.idle_event: asyncio.Event | None = None
        self.reconnecting = 0
        self.busy = 0       # requests in flight

    def error(self, msg: str) -> None:
        if self.measuring:
            self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(msg)

    def record(self, c: Client, now: float) -> None:
        if c.status != 200:
            self.error(f"HTTP {c.status}")
            return
        if self.stream and c.events < self.expect_events:
            self.short_streams += self.measuring
            self.error(f"stream ended after {c.events} events, expected >= {self.expect_events}")
            return
        if self.measuring:
            self.completed += 1
            self.lat.append(now - c.t0)
            if self.stream:
                self.events += c.events
                self.ttft.append(c.ttft - c.t0)

    def reconnect(self, c: Client) -> None:
        self.clients.discard(c)
        if self.running:
            self.reconnecting += 1
            self.loop.create_task(self._reconnect())

    async def _reconnect(self) -> None:
        try:
            await asyncio.sleep(0.01)
            c = await self.connect()
            if self.running:
                c.send()
        except OSError as e:
            self.error(f"reconnect failed: {e!r}")
        finally:
            self.reconnecting -= 1
            self.check_idle()

    async def connect(self) -> Client:
        _, c = await self.loop.create_connection(lambda: Client(self), self.args.host, self.args.port)
        self.clients.add(c)
        return c

    def check_idle(self) -> None:
        if self.idle_event is not None and not self.reconnecting and self.busy <= 0:
            self.idle_event.set()


async def run_closed_loop(gen: Gen, args: argparse.Namespace) -> dict:
    clients = await asyncio.gather(*(gen.connect() for _ in range(args.concurrency)))
    gen.running = True
    for c in clients:
        c.send()
    await asyncio.sleep(args.warmup)
    pids = dict(args.cpu_pid)
    cpu0 = {name: cpu_seconds_precise(pid) for name, pid in pids.items()}
    tick0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    self0 = resource.getrusage(resource.RUSAGE_SELF)
    gen.measuring = True
    t0 = perf()
    await asyncio.sleep(args.duration)
    gen.measuring = False
    t1 = perf()
    cpu1 = {name: cpu_seconds_precise(pid) for name, pid in pids.items()}
    tick1 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    self1 = resource.getrusage(resource.RUSAGE_SELF)
    gen.running = False
    gen.idle_event = asyncio.Event()
    gen.check_idle()
    try:
        await asyncio.wait_for(gen.idle_event.wait(), args.drain_timeout)
    except TimeoutError:
        pass
    for c in list(gen.clients):
        if c.t is not None:
            c.t.close()
    await asyncio.sleep(0)
    window = t1 - t0
    lat = sorted(gen.lat)
    ttft = sorted(gen.ttft)
    out = {
        "mode": args.mode, "concurrency": args.concurrency, "window_s": window,
        "completed": gen.completed, "errors": gen.errors, "short_streams": gen.short_streams,
        "error_samples": gen.error_samples,
        "rps": gen.completed / window if window > 0 else 0.0,
        "events": gen.events, "events_per_s": gen.events / window if window > 0 else 0.0,
        "lat_mean_ms": (sum(lat) / len(lat) * 1e3) if lat else None,
        "lat_p50_ms": _ms(percentile(lat, 50)), "lat_p99_ms": _ms(percentile(lat, 99)),
        "ttft_p50_ms": _ms(percentile(ttft, 50)), "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "cpu_s": {name: (cpu1[name] - cpu0[name]) if cpu0[name] >= 0 and cpu1[name] >= 0 else None
                  for name in pids},
        "cpu_stat_s": {name: (tick1[name] - tick0[name]) if tick0[name] >= 0 and tick1[name] >= 0 else None
                       for name in pids},
        "loadgen_cpu_s": (self1.ru_utime + self1.ru_stime) - (self0.ru_utime + self0.ru_stime),
    }
    if args.samples:
        out["lat_us"] = [int(x * 1e6) for x in gen.lat]
        out["ttft_us"] = [int(x * 1e6) for x in gen.ttft]
    return out


async def run_idle(gen: Gen, args: argparse.Namespace) -> dict:
    loop = gen.loop
    sem = asyncio.Semaphore(args.connect_parallel)
    held: list[Client] = []
    failures = 0
    gen.running = False   # no re-sends: each connection carries one request that never ends

    async def one() -> None:
        nonlocal failures
        async with sem:
            try:
                c = await gen.connect()
            except OSError as e:
                failures += 1
                gen.error(f"connect: {e!r}")
                return
            c.waiter = loop.create_future()
            c.send()
            try:
                ok = await asyncio.wait_for(c.waiter, args.hold_timeout)
            except TimeoutError:
                ok = False
                gen.error("no first event in time")
            if ok and c.status == 200:
                held.append(c)
            else:
                failures += 1

    t0 = perf()
    await asyncio.gather(*(one() for _ in range(args.idle_n)))
    open_s = perf() - t0
    alive = sum(1 for c in held if c.busy)
    print(orjson.dumps({"event": "held", "held": alive, "failed": failures, "open_s": open_s,
                        "error_samples": gen.error_samples}).decode(), flush=True)
    if not args.no_wait:
        await loop.run_in_executor(None, sys.stdin.readline)
    still = sum(1 for c in held if c.busy)
    for c in list(gen.clients):
        if c.busy:
            c.busy = False
            gen.busy -= 1
        if c.t is not None:
            c.t.close()
    await asyncio.sleep(0.05)
    return {"mode": "idle", "idle_n": args.idle_n, "held": alive, "failed": failures,
            "still_open_at_close": still, "open_s": open_s, "error_samples": gen.error_samples}


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def _pid_arg(s: str) -> tuple[str, int]:
    name, _, pid = s.partition("=")
    return name, int(pid)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--path", default="/v1/chat/completions")
    p.add_argument("--model", default="m")
    p.add_argument("--mode", choices=("nonstream", "stream", "idle"), default="nonstream")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--duration", type=float, default=5.0, help="measured window (s)")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before the window")
    p.add_argument("--drain-timeout", type=float, default=15.0)
    p.add_argument("--max-tokens", type=int, default=16,
                   help="max_tokens in the request (the fast backend sends this many stream chunks)")
    p.add_argument("--pace-ms", type=float, default=0.0, help="ask the backend to pace stream chunks")
    p.add_argument("--usage", action=argparse.BooleanOptionalAction, default=True,
                   help="send stream_options.include_usage on streams (default: yes)")
    p.add_argument("--idle-n", type=int, default=1000)
    p.add_argument("--connect-parallel", type=int, default=200)
    p.add_argument("--hold-timeout", type=float, default=60.0)
    p.add_argument("--no-wait", action="store_true", help="idle: close at once instead of waiting for stdin")
    p.add_argument("--cpu-pid", type=_pid_arg, action="append", default=[], metavar="NAME=PID")
    p.add_argument("--samples", action="store_true", help="include raw latency samples (µs)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    async def amain() -> dict:
        gen = Gen(args, asyncio.get_running_loop())
        if args.mode == "idle":
            return await run_idle(gen, args)
        return await run_closed_loop(gen, args)

    run = uvloop.run if uvloop is not None else asyncio.run
    result = run(amain())
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
