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

- ``fleet``: ``--streams`` streams, each on a connection of its own, started evenly over ``--ramp``
  seconds, each ``--max-tokens`` chunks ``--pace-ms`` apart; the window runs from the first connect
  to the end of the last stream. Besides TTFT it records the gap between successive chunk
  arrivals of a stream, and the RSS of the ``--cpu-pid`` processes before, at peak (sampled every
  0.25 s) and after the streams closed.

``--pd vllm|sglang`` makes the load generator the P/D orchestrator itself (the baseline a gateway's
P/D is compared with), against ``bench/pdbackend.py``: each worker also holds a keep-alive
connection to the prefill (``--prefill-port``; ``--port`` is the decode). vLLM: the prefill request
(``kv_transfer_params.do_remote_decode``, ``max_tokens`` 1, not streamed), then the decode request
carrying the ``kv_transfer_params`` of its answer. SGLang: both at once, with the same
``bootstrap_host``/``bootstrap_port``/``bootstrap_room``; the next request once both answered.
Latency and TTFT count from the first byte written for the request (the prefill's).

``--port`` may be repeated: connections are spread over the ports in turn (several endpoints).

``--cpu-pid NAME=PID`` (repeatable; several pids under one NAME are summed, e.g. a gateway's worker
processes) samples the CPU time of those processes at the start and end of the window, so CPU per
request covers exactly the measured requests: ``cpu_s`` from the threads'
``/proc/PID/task/*/schedstat`` (ns resolution), ``cpu_stat_s`` from utime+stime of ``/proc/PID/stat``
(10 ms ticks, too coarse for short windows; kept as a cross-check).

Output: one JSON object on the last stdout line (raw samples in microseconds with ``--samples``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
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


def pid_groups(pairs: list[tuple[str, int]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for name, pid in pairs:
        out.setdefault(name, []).append(pid)
    return out


def group_sum(read, pids: list[int]) -> float:
    """The sum of ``read(pid)`` over a group of processes; -1 when any of them is gone."""
    values = [read(pid) for pid in pids]
    return -1 if any(v < 0 for v in values) else sum(values)


def gone_pids(pids: dict[str, list[int]], cpu0: dict[str, float], cpu1: dict[str, float]) -> dict[str, list[int]]:
    """For each group whose CPU could not be read at the start or the end of the window, its
    processes that are gone now (a measured process that exited: its group has no CPU figure)."""
    return {name: [pid for pid in ps if not os.path.exists(f"/proc/{pid}/stat")]
            for name, ps in pids.items() if cpu0[name] < 0 or cpu1[name] < 0}


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of an already sorted list."""
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, int(round(q / 100.0 * len(sorted_values) + 0.5)) - 1))
    return sorted_values[k]


def build_payload(model: str, stream: bool, max_tokens: int, pace_ms: float, hold: bool, usage: bool) -> dict:
    prompt = "Say something."
    if pace_ms > 0:
        prompt += f" bench-pace-ms={pace_ms:g}"
    if hold:
        prompt += " bench-hold"
    payload: dict = {"model": model, "messages": [{"role": "user", "content": prompt}],
                     "max_tokens": max_tokens, "stream": stream}
    if stream and usage:
        payload["stream_options"] = {"include_usage": True}
    return payload


def http_post(host: str, port: int, path: str, payload: dict, api_key: str | None = None) -> bytes:
    body = orjson.dumps(payload)
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: */*\r\n{auth}Content-Length: {len(body)}\r\n\r\n").encode() + body


def build_request(host: str, port: int, path: str, model: str, stream: bool, max_tokens: int,
                  pace_ms: float, hold: bool, usage: bool) -> bytes:
    return http_post(host, port, path, build_payload(model, stream, max_tokens, pace_ms, hold, usage))


# what a vLLM prefill request carries (the client orchestrating P/D itself)
PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}


class PrefillConn(asyncio.Protocol):
    """The P/D baseline's keep-alive connection to the prefill: one non-streaming answer at a time."""

    def __init__(self, owner: Client) -> None:
        self.owner = owner
        self.t: asyncio.Transport | None = None
        self.busy = False
        self.buf = b""
        self.on_done = None

    def connection_made(self, transport) -> None:
        self.t = transport

    def request(self, data: bytes, on_done) -> None:
        self.busy = True
        self.buf = b""
        self.on_done = on_done
        self.t.write(data)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        i = self.buf.find(b"\r\n\r\n")
        if i < 0:
            return
        head = self.buf[:i].lower()
        j = head.find(b"content-length:")
        if j < 0:   # the P/D mock always answers a prefill with a length (or a one-chunk stream)
            if not self.buf.endswith(b"0\r\n\r\n"):
                return
            body = self.buf[i + 4:]
        else:
            k = head.find(b"\r\n", j)
            n = int(head[j + 15:k if k >= 0 else len(head)])
            if len(self.buf) < i + 4 + n:
                return
            body = self.buf[i + 4:i + 4 + n]
        try:
            status = int(head[9:12])
        except ValueError:
            status = 0
        self.busy = False
        self.buf = b""
        cb, self.on_done = self.on_done, None
        cb(status, body)

    def connection_lost(self, exc) -> None:
        if self.busy:
            self.busy = False
            cb, self.on_done = self.on_done, None
            cb(0, b"")


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
        self.prefill: PrefillConn | None = None     # --pd: this worker's prefill connection
        self.wait_prefill = False                   # the decode ended; the prefill has not answered
        self.last_ev = 0.0

    def connection_made(self, transport) -> None:
        self.t = transport

    def send(self) -> None:
        self.busy = True
        gen = self.gen
        gen.busy += 1
        self.in_body = False
        self.head = b""
        self.events = 0
        self.ttft = 0.0
        self.tail = b"\r\n"
        self.wait_prefill = False
        self.t0 = perf()
        if gen.pd is None:
            self.t.write(gen.req)
        elif gen.pd == "vllm":
            self.prefill.request(gen.prefill_req, self.vllm_prefilled)
        else:
            room = random.getrandbits(63)
            self.prefill.request(gen.sglang_request(gen.prefill_payload, room, gen.prefill_port), self.sglang_prefilled)
            self.t.write(gen.sglang_request(gen.payload, room, gen.args.port[0]))

    def vllm_prefilled(self, status: int, body: bytes) -> None:
        kv = None
        if status == 200:
            try:
                kv = orjson.loads(body).get("kv_transfer_params")
            except (orjson.JSONDecodeError, AttributeError):
                kv = None
        if not isinstance(kv, dict):
            if len(self.gen.error_samples) < 5:
                self.gen.error_samples.append(f"prefill answered {status} without kv_transfer_params")
            if self.t is not None:
                self.t.close()   # connection_lost counts the error and reconnects
            return
        self.t.write(http_post(self.gen.args.host, self.gen.args.port[0], self.gen.args.path,
                               {**self.gen.payload, "kv_transfer_params": kv}))

    def sglang_prefilled(self, status: int, body: bytes) -> None:
        if status != 200:
            self.gen.error(f"prefill answered {status}")
        if self.wait_prefill:
            self.after()

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
                    self.last_ev = self.ttft
                elif self.gen.gaps is not None:
                    now = perf()
                    self.gen.gaps.append(now - self.last_ev)
                    self.last_ev = now
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
        self.in_body = False
        self.gen.record(self, now)
        if self.prefill is not None and self.prefill.busy:
            self.wait_prefill = True   # SGLang: the next request once the prefill answered too
            return
        self.after()

    def after(self) -> None:
        if not self.busy:   # the connection was lost meanwhile (counted there)
            return
        self.busy = False
        gen = self.gen
        gen.busy -= 1
        gen.total_completed += 1
        if gen.once:
            self.close()
            gen.once_done()
        elif self.conn_close:
            self.close()
            gen.reconnect(self)
        elif gen.running:
            self.send()
        elif gen.idle_event is not None:
            gen.check_idle()

    def close(self) -> None:
        for t in (self.t, self.prefill.t if self.prefill is not None else None):
            if t is not None:
                t.close()

    def connection_lost(self, exc) -> None:
        gen = self.gen
        if self.prefill is not None and self.prefill.t is not None:
            self.prefill.t.close()
        if self.busy:
            self.busy = False
            gen.busy -= 1
            if self.kind == _CLOSE and self.in_body:
                self.finish_close()
                return
            gen.error("connection lost mid-request" + (f": {exc!r}" if exc else ""))
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(False)
            if gen.once:
                gen.once_done()
            else:
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
        stream = args.mode in ("stream", "idle", "fleet")
        self.stream = stream
        self.payload = build_payload(args.model, stream, args.max_tokens, args.pace_ms, args.mode == "idle",
                                     args.usage)
        self.req = http_post(args.host, args.port[0], args.path, self.payload, args.api_key)
        self.ports = itertools.cycle(args.port)
        self.pd = args.pd
        self.prefill_port = args.prefill_port
        if args.pd == "vllm":
            self.prefill_req = http_post(args.host, args.prefill_port, args.path, {
                **{k: v for k, v in self.payload.items() if k != "stream_options"},
                "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_KV})
        elif args.pd == "sglang":
            self.prefill_payload = {**{k: v for k, v in self.payload.items() if k != "stream_options"},
                                    "max_tokens": 1, "stream": False}
        self.once = args.mode == "fleet"     # one request per connection, then close it
        self.once_left = 0
        self.all_done: asyncio.Event | None = None
        self.gaps: list[float] | None = [] if args.mode == "fleet" else None
        self.total_completed = 0   # warm-up and drain included
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

    def sglang_request(self, payload: dict, room: int, port: int) -> bytes:
        return http_post(self.args.host, port, self.args.path, {
            **payload, "bootstrap_host": self.args.host, "bootstrap_port": self.args.bootstrap_port,
            "bootstrap_room": room})

    def once_done(self) -> None:
        self.once_left -= 1
        if self.once_left <= 0 and self.all_done is not None:
            self.all_done.set()

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
        _, c = await self.loop.create_connection(lambda: Client(self), self.args.host, next(self.ports))
        if self.pd is not None:
            try:
                _, c.prefill = await self.loop.create_connection(lambda: PrefillConn(c), self.args.host,
                                                                 self.prefill_port)
            except OSError:
                c.t.close()
                raise
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
    pids = pid_groups(args.cpu_pid)
    cpu0 = {name: group_sum(cpu_seconds_precise, ps) for name, ps in pids.items()}
    tick0 = {name: group_sum(cpu_seconds, ps) for name, ps in pids.items()}
    self0 = resource.getrusage(resource.RUSAGE_SELF)
    gen.measuring = True
    t0 = perf()
    await asyncio.sleep(args.duration)
    gen.measuring = False
    t1 = perf()
    cpu1 = {name: group_sum(cpu_seconds_precise, ps) for name, ps in pids.items()}
    tick1 = {name: group_sum(cpu_seconds, ps) for name, ps in pids.items()}
    self1 = resource.getrusage(resource.RUSAGE_SELF)
    gen.running = False
    gen.idle_event = asyncio.Event()
    gen.check_idle()
    try:
        await asyncio.wait_for(gen.idle_event.wait(), args.drain_timeout)
    except TimeoutError:
        pass
    for c in list(gen.clients):
        c.close()
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
        "gone": gone_pids(pids, cpu0, cpu1),
        "cpu_stat_s": {name: (tick1[name] - tick0[name]) if tick0[name] >= 0 and tick1[name] >= 0 else None
                       for name in pids},
        "loadgen_cpu_s": (self1.ru_utime + self1.ru_stime) - (self0.ru_utime + self0.ru_stime),
        "total_completed": gen.total_completed,
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


async def run_fleet(gen: Gen, args: argparse.Namespace) -> dict:
    """Many paced streams at once, each on its own connection, started evenly over the ramp."""
    loop = gen.loop
    n = args.streams
    pids = pid_groups(args.cpu_pid)
    peak = {name: group_sum(rss_bytes, ps) for name, ps in pids.items()}
    rss0 = dict(peak)
    sampling = True

    async def sample() -> None:
        while sampling:
            for name, ps in pids.items():
                peak[name] = max(peak[name], group_sum(rss_bytes, ps))
            await asyncio.sleep(0.25)

    sampler = loop.create_task(sample())
    gen.once_left = n
    gen.all_done = asyncio.Event()
    gen.measuring = True
    failures = 0
    cpu0 = {name: group_sum(cpu_seconds_precise, ps) for name, ps in pids.items()}
    self0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = perf()

    async def one(i: int) -> None:
        nonlocal failures
        await asyncio.sleep(max(0.0, t0 + args.ramp * i / n - perf()))
        try:
            c = await gen.connect()
        except OSError as e:
            failures += 1
            gen.error(f"connect: {e!r}")
            gen.once_done()
            return
        c.send()

    starters = [loop.create_task(one(i)) for i in range(n)]
    timeout = args.ramp + (args.max_tokens + 2) * args.pace_ms / 1e3 + args.drain_timeout
    try:
        await asyncio.wait_for(gen.all_done.wait(), timeout)
    except TimeoutError:
        gen.error(f"{gen.once_left} streams not finished {timeout:.0f} s after the start")
    t1 = perf()
    cpu1 = {name: group_sum(cpu_seconds_precise, ps) for name, ps in pids.items()}
    self1 = resource.getrusage(resource.RUSAGE_SELF)
    gen.measuring = False
    for t in starters:
        t.cancel()
    for c in list(gen.clients):
        c.close()
    await asyncio.sleep(args.settle)
    sampling = False
    await sampler
    rss_end = {name: group_sum(rss_bytes, ps) for name, ps in pids.items()}
    window = t1 - t0
    lat, ttft, gaps = sorted(gen.lat), sorted(gen.ttft), sorted(gen.gaps or [])
    out = {
        "mode": "fleet", "streams": n, "window_s": window, "completed": gen.completed, "errors": gen.errors,
        "connect_failures": failures, "short_streams": gen.short_streams, "error_samples": gen.error_samples,
        "events": gen.events, "events_per_s": gen.events / window if window > 0 else 0.0,
        "lat_p50_ms": _ms(percentile(lat, 50)), "lat_p99_ms": _ms(percentile(lat, 99)),
        "ttft_p50_ms": _ms(percentile(ttft, 50)), "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "gap_p50_ms": _ms(percentile(gaps, 50)), "gap_p99_ms": _ms(percentile(gaps, 99)),
        "gap_max_ms": _ms(gaps[-1] if gaps else None),
        "cpu_s": {name: (cpu1[name] - cpu0[name]) if cpu0[name] >= 0 and cpu1[name] >= 0 else None
                  for name in pids},
        "gone": gone_pids(pids, cpu0, cpu1),
        "rss_before": rss0, "rss_peak": peak, "rss_after": rss_end,
        "loadgen_cpu_s": (self1.ru_utime + self1.ru_stime) - (self0.ru_utime + self0.ru_stime),
        "total_completed": gen.total_completed,
    }
    return out


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def _pid_arg(s: str) -> tuple[str, int]:
    name, _, pid = s.partition("=")
    return name, int(pid)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, action="append", required=True,
                   help="repeat to spread connections over several ports (endpoints)")
    p.add_argument("--path", default="/v1/chat/completions")
    p.add_argument("--model", default="m")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (a gateway with tenants)")
    p.add_argument("--mode", choices=("nonstream", "stream", "idle", "fleet"), default="nonstream")
    p.add_argument("--pd", choices=("vllm", "sglang"), help="orchestrate P/D itself: --port is the decode")
    p.add_argument("--prefill-port", type=int, help="--pd: the prefill's port")
    p.add_argument("--bootstrap-port", type=int, default=8998, help="--pd sglang: bootstrap_port sent")
    p.add_argument("--streams", type=int, default=1000, help="fleet: streams")
    p.add_argument("--ramp", type=float, default=1.0, help="fleet: seconds over which the streams start")
    p.add_argument("--settle", type=float, default=0.5, help="fleet: seconds after the close before the last RSS reading")
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
    if args.pd and not args.prefill_port:
        print("loadgen: --pd needs --prefill-port", file=sys.stderr)
        return 2
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    async def amain() -> dict:
        gen = Gen(args, asyncio.get_running_loop())
        if args.mode == "idle":
            return await run_idle(gen, args)
        if args.mode == "fleet":
            return await run_fleet(gen, args)
        return await run_closed_loop(gen, args)

    run = uvloop.run if uvloop is not None else asyncio.run
    result = run(amain())
    # the event loop may leave stdout non-blocking: a large result (--samples) then reached the
    # reader cut at the pipe's 64 KiB
    os.set_blocking(sys.stdout.fileno(), True)
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
