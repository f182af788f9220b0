"""Soak: many requests through a real gateway process, with faults and clients that walk away,
then check that nothing leaked.

It starts simulated engines (``python -m enginesim``) and the gateway (``python -m gateway --config
FILE``) as subprocesses on loopback ports, sends ``--requests`` chat completions (or keeps going for
``--duration-s``) at ``--concurrency``, streaming and not, and makes some of them misbehave:

- faults, sent in the ``x-sim-fault`` header that the gateway forwards to the engine
  (enginesim/faults.py): the connection dropped (before the headers for a non-streaming answer or
  an SGLang stream not yet started, otherwise mid-stream), an error event in the stream (HTTP 500 when
  nothing was sent yet), an HTTP error status, a short stall the stream survives, and a stall that
  never ends, which the gateway's watchdog must cut;
- clients that close the connection after a few events of a stream.

Then it waits (bounded) for the gateway to settle and reports answers by status, how streams
ended, the gateway's in-flight gauges, its open fds, RSS and event-loop tasks at start, middle
and end, and whether the invariants hold:

- every stream ended with ``[DONE]`` or an error event, unless its client walked away;
- every answer was a 200 or a JSON error of the OpenAI shape; no connection ended without one;
- no usage-only chunk reached a client that did not ask for usage;
- the in-flight gauges are back to 0, and the engines run no request any more;
- open fds and event-loop tasks are back near where they started.

Exit status 0 when they hold, 1 when not, 2 when the setup failed. Every wait is bounded and the
run stops by itself; each process it starts is stopped by its pid (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import math
import os
import platform
import random
import re
import resource
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gateway.server.run import free_port  # noqa: E402  (bench.resilience imports it from here)

IN_FLIGHT_GAUGES = ("switchyard_in_flight_requests{", "switchyard_endpoint_in_flight_requests{",
                    "switchyard_pd_prefill_in_flight{", "switchyard_pd_pending_decode{",
                    "switchyard_pd_token_load_active_tokens{", "switchyard_pd_token_load_kv_tokens{")
TASKS_GAUGE = "switchyard_event_loop_tasks"
KEEPALIVE_S = 2      # the gateway's upstream keep-alive: idle connections close this long after the load
FAULT_KINDS = ("drop", "error", "status", "stall_short", "stall_forever")
WORDS = ("switch", "yard", "wagon", "signal", "track", "freight", "engine", "coupler", "brake", "junction",
         "timetable", "platform", "sleeper", "ballast", "gauge", "siding", "turntable", "depot", "lamp", "crew")


# -- processes ---------------------------------------------------------------------------------------

def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the soak itself dies without cleaning up."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Procs:
    """Every process the soak starts, each in its own session; stopped by its pid, always."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: list[subprocess.Popen] = []
        self.logs: list = []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "ab")
        self.logs.append(log)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        p = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                             start_new_session=True, preexec_fn=_die_with_parent)
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen, grace: float = 5.0) -> int | None:
        if p.poll() is None:
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)   # its own group: p.pid leads its session
                try:
                    p.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if p in self.procs:
            self.procs.remove(p)
        return p.returncode

    def stop_all(self) -> None:
        for p in reversed(list(self.procs)):
            self.stop(p, grace=2.0)
        for log in self.logs:
            with contextlib.suppress(OSError):
                log.close()


def raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def proc_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (-1 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return -1.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


# -- settings ----------------------------------------------------------------------------------------

@dataclass
class Settings:
    requests: int
    concurrency: int
    duration_s: float
    fault_rate: float
    abandon_rate: float
    stream_share: float
    engines: list[tuple[str, int]]
    seed: int
    itl_ms: float
    ttft_ms: float
    max_tokens: tuple[int, int]
    request_timeout_s: float
    settle_s: float
    watchdog_idle_s: float
    fd_slack: int
    task_slack: int
    out: Path

    @property
    def watchdog(self) -> dict:
        # generous against event-loop lag under load, short enough that a stall that never ends is
        # cut well inside the client's own timeout
        idle = self.watchdog_idle_s
        longest = self.ttft_ms / 1000 + self.max_tokens[1] * self.itl_ms / 1000
        return {"first_chunk_timeout_s": 3 * idle, "idle_timeout_s": idle,
                "response_timeout_s": round(max(3 * idle, 3 * longest), 1), "aggregated": True}


def parse_engines(spec: str) -> list[tuple[str, int]]:
    out = []
    for item in spec.split(","):
        name, _, n = item.strip().partition(":")
        if name not in ("vllm", "sglang"):
            raise argparse.ArgumentTypeError(f"--engines: unknown engine {name!r} (vllm, sglang)")
        try:
            count = int(n) if n else 1
        except ValueError:
            raise argparse.ArgumentTypeError(f"--engines: {item!r} is not ENGINE[:COUNT]") from None
        if not 1 <= count <= 16:
            raise argparse.ArgumentTypeError(f"--engines: {item!r}: 1..16 engines of a kind")
        out.append((name, count))
    return out


# -- one request -------------------------------------------------------------------------------------

@dataclass
class Plan:
    stream: bool
    model: str
    max_tokens: int
    include_usage: bool
    fault: str | None           # fault kind
    spec: str | None            # the x-sim-fault header
    abandon_after: int | None   # events read before the client closes the connection
    body: bytes


def plan_request(i: int, st: Settings, models: list[str]) -> Plan:
    """The i-th request, the same for a seed whatever the timing."""
    rnd = random.Random(st.seed * 1_000_003 + i)
    stream = rnd.random() < st.stream_share
    model = models[i % len(models)]
    lo, hi = st.max_tokens
    max_tokens = rnd.randint(lo, hi)
    include_usage = stream and rnd.random() < 0.3
    fault = spec = None
    if rnd.random() < st.fault_rate:
        fault = rnd.choice(FAULT_KINDS)
        k = rnd.randint(0, max(0, max_tokens // 2))
        spec = {"drop": f"drop_after={k}", "error": f"error_after={k}",
                "status": f"status={rnd.choice((500, 503, 429))}",
                "stall_short": f"stall_after={k}:{rnd.choice((0.2, 0.5, 1.0))}",
                "stall_forever": f"stall_after={k}:inf"}[fault]
    abandon_after = rnd.randint(1, 4) if stream and rnd.random() < st.abandon_rate else None
    shared = "You are the yard master. " * rnd.randint(0, 3)      # some shared prefixes
    words = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(5, 40)))
    body: dict = {"model": model, "messages": [{"role": "user", "content": shared + words}],
                  "max_tokens": max_tokens, "stream": stream}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    return Plan(stream, model, max_tokens, include_usage, fault, spec, abandon_after, orjson.dumps(body))


def openai_error(raw: bytes) -> dict | None:
    """The ``error`` object of an OpenAI-shaped error body, or None."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str) and {"message", "type", "param", "code"} <= err.keys():
        return err
    return None


def message_kind(status: str, message: str) -> str:
    """An error message with its numbers and addresses blanked, to count alike errors together."""
    return status + " " + re.sub(r"[0-9][0-9.:]*", "N", message)[:90]


@dataclass
class Tally:
    started: int = 0
    finished: int = 0
    status: Counter = field(default_factory=Counter)          # "200", "502", ..., "none"
    outcome: Counter = field(default_factory=Counter)         # streams and bodies, see Result
    by_fault: dict = field(default_factory=dict)              # fault kind -> Counter(outcome)
    problems: Counter = field(default_factory=Counter)        # invariant breaches, by kind
    examples: list = field(default_factory=list)              # a few breaches, for the report
    errors: Counter = field(default_factory=Counter)          # error answers and events, by message
    events: int = 0
    streams: int = 0
    nonstreams: int = 0

    def problem(self, kind: str, i: int, plan: Plan, detail: str) -> None:
        self.problems[kind] += 1
        if len(self.examples) < 10:
            self.examples.append({"kind": kind, "request": i, "stream": plan.stream, "model": plan.model,
                                  "fault": plan.spec, "detail": detail[:300]})


async def run_one(session: aiohttp.ClientSession, url: str, i: int, plan: Plan, st: Settings, t: Tally) -> None:
    headers = {"Content-Type": "application/json"}
    if plan.spec:
        headers["x-sim-fault"] = plan.spec
    t.started += 1
    if plan.stream:
        t.streams += 1
    else:
        t.nonstreams += 1
    outcome = "?"
    status = "none"
    try:
        async with asyncio.timeout(st.request_timeout_s):
            async with session.post(url, data=plan.body, headers=headers) as resp:
                status = str(resp.status)
                if resp.status != 200:
                    raw = await resp.read()
                    outcome = f"http_{resp.status}"
                    err = openai_error(raw)
                    if err is None:
                        t.problem("error_not_openai_shape", i, plan, raw[:200].decode(errors="replace"))
                    else:
                        t.errors[message_kind(status, err["message"])] += 1
                elif plan.stream:
                    outcome = await read_stream(resp, i, plan, t)
                else:
                    raw = await resp.read()
                    try:
                        obj = orjson.loads(raw)
                        ok = isinstance(obj, dict) and isinstance(obj.get("choices"), list) and obj["choices"]
                    except orjson.JSONDecodeError:
                        ok = False
                    outcome = "body"
                    if not ok:
                        t.problem("bad_200_body", i, plan, raw[:200].decode(errors="replace"))
    except TimeoutError:
        outcome = "client_timeout"
        t.problem("client_timeout", i, plan, f"no end after {st.request_timeout_s:g}s (status {status})")
    except (aiohttp.ClientError, ConnectionError) as e:
        if status == "none":
            outcome = "no_answer"
            t.problem("no_answer", i, plan, f"{type(e).__name__}: {e}")
        else:
            outcome = "truncated"
            t.problem("stream_without_done_or_error", i, plan, f"{type(e).__name__}: {e}")
    t.status[status] += 1
    t.outcome[outcome] += 1
    t.by_fault.setdefault(plan.fault or "none", Counter())[outcome] += 1
    t.finished += 1


def inspect_event(data: bytes, i: int, plan: Plan, t: Tally) -> bool:
    """Decode one event; True when it is an error event."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        t.problem("malformed_event", i, plan, data[:200].decode(errors="replace"))
        return False
    if not isinstance(obj, dict):
        t.problem("malformed_event", i, plan, data[:200].decode(errors="replace"))
        return False
    if "error" in obj:
        msg = obj["error"].get("message") if isinstance(obj["error"], dict) else obj["error"]
        t.errors[message_kind("event", str(msg))] += 1
        return True
    if obj.get("choices") == [] and "usage" in obj and not plan.include_usage:
        t.problem("unrequested_usage_chunk", i, plan, data[:200].decode(errors="replace"))
    return False


async def read_stream(resp: aiohttp.ClientResponse, i: int, plan: Plan, t: Tally) -> str:
    """Read a 200 stream to its end (or walk away); how it ended."""
    if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
        t.problem("stream_not_sse", i, plan, resp.headers.get("Content-Type", ""))
    buf = b""
    done = error = False
    events = 0
    async for chunk in resp.content.iter_any():
        buf += chunk
        if b"\r" in chunk:
            buf = buf.replace(b"\r\n", b"\n")      # a CR at the end waits for its LF in the next chunk
        while (j := buf.find(b"\n\n")) >= 0:
            ev, buf = buf[:j], buf[j + 2:]
            data = b"\n".join(ln[5:].lstrip(b" ") for ln in ev.split(b"\n") if ln.startswith(b"data:"))
            if not data:
                continue                                   # a comment or a blank line
            events += 1
            if done:
                t.problem("event_after_done", i, plan, data[:200].decode(errors="replace"))
            if data == b"[DONE]":
                done = True
            elif not (data.startswith(b"{") and data.endswith(b"}")):
                t.problem("malformed_event", i, plan, data[:200].decode(errors="replace"))
            elif events == 1 or b'"error"' in data or b'"usage"' in data:
                # token chunks are not decoded: that would cost the client more than the gateway
                error |= inspect_event(data, i, plan, t)
            if plan.abandon_after is not None and events >= plan.abandon_after and not (done or error):
                resp.close()                               # the client walks away mid-stream
                t.events += events
                return "abandoned"
    t.events += events
    if buf.strip():
        t.problem("unterminated_event", i, plan, buf[:200].decode(errors="replace"))
    if error:
        return "error_event"
    if done:
        return "done"
    t.problem("stream_without_done_or_error", i, plan, f"{events} events, then EOF")
    return "truncated"


# -- gateway state -----------------------------------------------------------------------------------

async def scrape(session: aiohttp.ClientSession, base: str) -> dict:
    """In-flight gauges (sum and the non-zero lines) and the event-loop task count."""
    try:
        async with asyncio.timeout(10), session.get(base + "/metrics") as r:
            text = await r.text()
    except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    nonzero, total, requests, tasks, lines = [], 0.0, 0.0, None, 0
    for line in text.splitlines():
        if line.startswith(IN_FLIGHT_GAUGES):
            lines += 1
            v = float(line.rsplit(" ", 1)[1])
            total += abs(v)
            if line.startswith(IN_FLIGHT_GAUGES[0]):
                requests += v
            if v:
                nonzero.append(line)
        elif line.startswith(TASKS_GAUGE + " "):
            tasks = int(float(line.rsplit(" ", 1)[1]))
    return {"in_flight_sum": total, "in_flight_requests": requests, "in_flight_nonzero": nonzero,
            "gauge_lines": lines, "tasks": tasks}


COUNTERS = {"switchyard_client_cancels_total": "stage", "switchyard_upstream_errors_total": "error_class",
            "switchyard_health_probes_total": "result", "switchyard_retries_total": None,
            "switchyard_watchdog_fires_total": "phase", "switchyard_internal_errors_total": None}


async def counters(session: aiohttp.ClientSession, base: str) -> dict[str, dict[str, float]]:
    """A few of the gateway's counters, summed by one label: what it saw of the faults."""
    try:
        async with asyncio.timeout(10), session.get(base + "/metrics") as r:
            text = await r.text()
    except (TimeoutError, aiohttp.ClientError, ConnectionError):
        return {}
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        name, _, rest = line.partition("{") if "{" in line.split(" ", 1)[0] else line.partition(" ")
        if name not in COUNTERS:
            continue
        label = COUNTERS[name]
        key = "total"
        if label is not None and (m := re.search(label + r'="([^"]*)"', rest)):
            key = m.group(1)
        d = out.setdefault(name.removeprefix("switchyard_").removesuffix("_total"), {})
        d[key] = d.get(key, 0) + float(line.rsplit(" ", 1)[1])
    return out


async def engines_busy(session: aiohttp.ClientSession, urls: list[str]) -> dict[str, int]:
    """Requests each engine still runs or queues (-1: no answer)."""
    out = {}
    for u in urls:
        try:
            async with asyncio.timeout(5), session.get(u + "/_sim/state") as r:
                s = await r.json()
            out[u] = len(s.get("running", [])) + len(s.get("waiting", []))
        except (TimeoutError, aiohttp.ClientError, ConnectionError, ValueError):
            out[u] = -1
    return out


async def engine_counts(session: aiohttp.ClientSession, urls: list[str]) -> dict[str, int]:
    total: Counter = Counter()
    for u in urls:
        with contextlib.suppress(TimeoutError, aiohttp.ClientError, ConnectionError, ValueError):
            async with asyncio.timeout(5), session.get(u + "/_sim/state") as r:
                total.update((await r.json()).get("counts", {}))
    return dict(total)


async def sample(session: aiohttp.ClientSession, base: str, pid: int, t0: float, t: Tally, label: str) -> dict:
    at = time.monotonic()
    m = await scrape(session, base)
    out = {"label": label, "t_s": round(at - t0, 2), "finished": t.finished,
           "probe_ms": round((time.monotonic() - at) * 1000, 1),
           "fds": proc_fds(pid), "rss_mib": round(proc_rss_kib(pid) / 1024, 1), "cpu_s": round(proc_cpu_s(pid), 2),
           "tasks": m.get("tasks"), "in_flight": m.get("in_flight_requests")}
    if "error" in m:
        out["scrape_error"] = m["error"]
    return out


# -- the run -----------------------------------------------------------------------------------------

async def wait_http(session: aiohttp.ClientSession, url: str, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with contextlib.suppress(TimeoutError, aiohttp.ClientError, ConnectionError):
            async with asyncio.timeout(2), session.get(url) as r:
                if r.status == 200:
                    return True
        await asyncio.sleep(0.1)
    return False


def gateway_config(port: int, st: Settings, models: dict[str, tuple[str, list[str]]]) -> str:
    lines = ["# written by bench/soak.py",
             f"listen: {{host: 127.0.0.1, port: {port}}}",
             "server: {log_level: warning, log_format: json, shutdown_grace_s: 5, drain_delay_s: 0}",
             "routing: {strategy: least-request}",
             # idle upstream connections close soon after the load, so the fd count can settle. On
             # the aggregated path the wait for a non-streaming answer's headers (vLLM and SGLang
             # send them with the body) is bounded by first_byte_timeout_s, not by the watchdog's
             # response_timeout_s: the same bound for both here
             f"upstream: {{keepalive_timeout_s: {KEEPALIVE_S}, connect_timeout_s: 5, "
             f"first_byte_timeout_s: {st.watchdog['response_timeout_s']}}}",
             "health: {interval_s: 1, timeout_s: 2}",
             "scrape: {interval_s: 1, timeout_s: 2}",
             "watchdog: " + orjson.dumps(st.watchdog).decode(),
             "models:"]
    for name, (engine, urls) in models.items():
        lines += [f"  - name: {name}", f"    engine: {engine}", f"    endpoints: [{', '.join(urls)}]"]
    return "\n".join(lines) + "\n"


async def soak(st: Settings) -> dict:
    st.out.mkdir(parents=True, exist_ok=True)
    nofile = raise_nofile()
    procs = Procs(st.out)
    report: dict = {"settings": settings_dict(st), "machine": machine_info(), "nofile": nofile}
    session = None
    try:
        # engines
        models: dict[str, tuple[str, list[str]]] = {}
        engine_urls: list[tuple[str, subprocess.Popen]] = []
        max_seqs = max(64, math.ceil(st.concurrency / sum(n for _, n in st.engines)) * 2)
        for engine, count in st.engines:
            name = f"soak-{engine}"
            urls = []
            for k in range(count):
                port = free_port()
                p = procs.start(f"{engine}-{k}", [
                    sys.executable, "-m", "enginesim", "--engine", engine, "--role", "aggregated",
                    "--host", "127.0.0.1", "--port", str(port), "--model", name, "--seed", str(st.seed + k),
                    "--itl-ms", str(st.itl_ms), "--ttft-base-ms", str(st.ttft_ms),
                    "--max-num-seqs", str(max_seqs), "--sglang-abort-delay-s", "0.1"])
                url = f"http://127.0.0.1:{port}"
                urls.append(url)
                engine_urls.append((url, p))
            models[name] = (engine, urls)
        # probes: a fresh connection each, never one the server is closing as it idles
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))
        for url, p in engine_urls:
            if not await wait_http(session, url + "/health", p, 30):
                raise SetupError(f"engine {url} did not become healthy (see {st.out}/*.log)")
        # gateway
        gport = free_port()
        cfg_path = st.out / "switchyard.yaml"
        cfg_path.write_text(gateway_config(gport, st, models))
        gw = procs.start("gateway", [sys.executable, "-m", "gateway", "--config", str(cfg_path), "--workers", "1"])
        base = f"http://127.0.0.1:{gport}"
        if not await wait_http(session, base + "/ready", gw, 30):
            raise SetupError(f"the gateway did not become ready (see {st.out}/gateway.log)")
        await asyncio.sleep(1.5)     # first health probes and scrapes are in: the baseline is steady
        t0 = time.monotonic()
        t = Tally()
        samples = [await sample(session, base, gw.pid, t0, t, "start")]
        report["tally"] = t
        await load(st, t, base, list(models), samples, session, gw.pid, t0)
        report["load_s"] = round(time.monotonic() - t0, 2)
        # settle: gauges back to 0, engines idle, idle connections closed (all bounded)
        urls = [u for u, _ in engine_urls]
        settle0 = time.monotonic()
        start_fds, start_tasks = samples[0]["fds"], samples[0]["tasks"] or 0
        while True:
            m = await scrape(session, base)
            busy = await engines_busy(session, urls)
            fds = proc_fds(gw.pid)
            settled = (m.get("in_flight_sum") == 0 and not any(busy.values())
                       and fds <= start_fds + st.fd_slack and (m.get("tasks") or 0) <= start_tasks + st.task_slack
                       # upstream connections idle after the load close after keepalive_timeout_s
                       and time.monotonic() - settle0 > KEEPALIVE_S + 1)
            if settled or time.monotonic() - settle0 > st.settle_s:
                break
            await asyncio.sleep(0.25)
        report["settle_s"] = round(time.monotonic() - settle0, 2)
        samples.append(await sample(session, base, gw.pid, t0, t, "end"))
        report["gauges_end"] = m
        report["engines_busy_end"] = busy
        report["engine_counts"] = await engine_counts(session, urls)
        report["gateway_counters"] = await counters(session, base)
        report["samples"] = samples
        report["gateway_alive"] = gw.poll() is None
        await session.close()
        session = None
        report["gateway_exit"] = procs.stop(gw, grace=10.0)
    finally:
        if session is not None:
            await session.close()
        procs.stop_all()
    return report


class SetupError(RuntimeError):
    pass


async def load(st: Settings, t: Tally, base: str, models: list[str], samples: list, probe: aiohttp.ClientSession,
               pid: int, t0: float) -> None:
    url = base + "/v1/chat/completions"
    deadline = t0 + st.duration_s if st.duration_s else None
    hard_stop = t0 + (st.duration_s or 0) + st.request_timeout_s + 60 + (
        0 if st.duration_s else st.requests * st.request_timeout_s)
    next_i = 0
    middle = asyncio.Event()

    def take() -> int | None:
        nonlocal next_i
        if deadline is not None:
            if time.monotonic() >= deadline:
                return None
        elif next_i >= st.requests:
            return None
        next_i += 1
        return next_i - 1

    # the client side: its own connection pool, no limit but the workers
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def worker() -> None:
            while (i := take()) is not None and time.monotonic() < hard_stop:
                await run_one(session, url, i, plan_request(i, st, models), st, t)
                if deadline is None and t.finished >= st.requests // 2:
                    middle.set()

        async def sampler() -> None:
            every = max(1.0, st.duration_s / 20) if st.duration_s else 2.0
            mid_at = t0 + st.duration_s / 2 if st.duration_s else None
            while True:
                await asyncio.sleep(every)
                if mid_at is not None and time.monotonic() >= mid_at:
                    middle.set()
                samples.append(await sample(probe, base, pid, t0, t, "run"))

        async def middle_sample() -> None:
            await middle.wait()
            samples.append(await sample(probe, base, pid, t0, t, "middle"))

        sampling = [asyncio.create_task(sampler()), asyncio.create_task(middle_sample())]
        try:
            async with asyncio.timeout(max(1.0, hard_stop - time.monotonic())):
                await asyncio.gather(*(worker() for _ in range(st.concurrency)))
        except TimeoutError:               # requests still open long after their own timeouts
            t.problems["load_hard_stop"] += 1
        finally:
            for task in sampling:
                task.cancel()
            await asyncio.gather(*sampling, return_exceptions=True)


# -- the report --------------------------------------------------------------------------------------

def settings_dict(st: Settings) -> dict:
    return {"requests": st.requests if not st.duration_s else None, "duration_s": st.duration_s or None,
            "concurrency": st.concurrency, "fault_rate": st.fault_rate, "abandon_rate": st.abandon_rate,
            "stream_share": st.stream_share, "engines": ",".join(f"{e}:{n}" for e, n in st.engines),
            "seed": st.seed, "itl_ms": st.itl_ms, "ttft_ms": st.ttft_ms, "max_tokens": list(st.max_tokens),
            "watchdog": st.watchdog, "request_timeout_s": st.request_timeout_s}


def machine_info() -> dict:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    rev = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10).stdout.strip()
    return {"cpus": os.cpu_count(), "cpu": cpu, "python": platform.python_version(), "commit": rev,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}


def finalize(report: dict, st: Settings) -> dict:
    """Turn the raw report into plain data and judge the invariants."""
    t: Tally = report.pop("tally")
    samples = report["samples"]
    by_label = {s["label"]: s for s in samples}
    start, end = by_label["start"], by_label["end"]
    mid = by_label.get("middle") or (samples[len(samples) // 2] if len(samples) > 2 else end)
    report["answers"] = {"started": t.started, "finished": t.finished, "streams": t.streams,
                         "non_streaming": t.nonstreams, "stream_events": t.events,
                         "by_status": dict(sorted(t.status.items())), "by_outcome": dict(sorted(t.outcome.items())),
                         "by_fault": {k: dict(sorted(v.items())) for k, v in sorted(t.by_fault.items())}}
    report["process"] = {"start": start, "middle": mid, "end": end}
    g = report["gauges_end"]
    checks = {
        "streams_without_done_or_error": t.problems["stream_without_done_or_error"],
        "answers_without_status": t.problems["no_answer"],
        "client_timeouts": t.problems["client_timeout"] + t.problems["load_hard_stop"],
        "errors_not_openai_shaped": t.problems["error_not_openai_shape"],
        "bad_200_bodies": t.problems["bad_200_body"] + t.problems["stream_not_sse"],
        "malformed_events": t.problems["malformed_event"] + t.problems["unterminated_event"]
        + t.problems["event_after_done"],
        "unrequested_usage_chunks": t.problems["unrequested_usage_chunk"],
        "in_flight_gauges_not_zero": len(g.get("in_flight_nonzero", [])) + (1 if "error" in g else 0),
        "engine_requests_left": sum(v if v > 0 else 1 for v in report["engines_busy_end"].values() if v),
        "fds_above_start": max(0, end["fds"] - start["fds"] - st.fd_slack),
        "tasks_above_start": max(0, (end["tasks"] or 0) - (start["tasks"] or 0) - st.task_slack)
        if start["tasks"] is not None and end["tasks"] is not None else 1,
        "gateway_died": 0 if report["gateway_alive"] else 1,
        "gateway_exit_not_0": 0 if report["gateway_exit"] == 0 else 1,
    }
    report["checks"] = checks
    report["ok"] = not any(checks.values()) and t.finished == t.started and t.finished > 0
    report["problem_examples"] = t.examples
    report["errors_by_message"] = dict(t.errors.most_common(20))
    return report


def render(r: dict) -> str:
    s, a, p = r["settings"], r["answers"], r["process"]
    size = f"for {s['duration_s']:g} s" if s["duration_s"] else f"{s['requests']} requests"
    L = [f"Soak: {size} at concurrency {s['concurrency']}, engines {s['engines']}, seed {s['seed']}",
         f"  faults {s['fault_rate']:.0%} of requests, clients abandoning {s['abandon_rate']:.0%} of streams, "
         f"streams {s['stream_share']:.0%}, max_tokens {s['max_tokens'][0]}..{s['max_tokens'][1]}, "
         f"itl {s['itl_ms']:g} ms, ttft {s['ttft_ms']:g} ms",
         f"  {r['machine']['cpus']} CPUs ({r['machine']['cpu']}), Python {r['machine']['python']}, "
         f"commit {r['machine']['commit']}, {r['machine']['date']}",
         f"  load {r['load_s']:g} s: {a['finished']} requests ({a['streams']} streams, {a['non_streaming']} "
         f"non-streaming), {a['stream_events']} stream events; settled in {r['settle_s']:g} s",
         "",
         "answers by status      " + "  ".join(f"{k}: {v}" for k, v in a["by_status"].items()),
         "how they ended         " + "  ".join(f"{k}: {v}" for k, v in a["by_outcome"].items()),
         "", "by fault injected"]
    for kind, outcomes in a["by_fault"].items():
        L.append(f"  {kind:<14} " + "  ".join(f"{k}: {v}" for k, v in outcomes.items()))
    L += ["", "the gateway's counters"]
    for name, d in r["gateway_counters"].items():
        L.append(f"  {name:<22} " + "  ".join(f"{k}: {v:g}" for k, v in sorted(d.items())))
    L.append("  engines (sum)          " + "  ".join(f"{k}: {v}" for k, v in r["engine_counts"].items()))
    L += ["", "most frequent errors (answers and stream events)"]
    for msg, n in list(r["errors_by_message"].items())[:8]:
        L.append(f"  {n:>6}  {msg}")
    L += ["", f"{'gateway process':<26} {'start':>8} {'middle':>8} {'end':>8}"]
    for key, name in (("fds", "open fds"), ("rss_mib", "RSS MiB"), ("tasks", "event-loop tasks"),
                      ("in_flight", "requests in flight"), ("cpu_s", "CPU seconds"), ("probe_ms", "/metrics ms (new conn)"),
                      ("t_s", "at second")):
        L.append(f"  {name:<24} " + " ".join(f"{str(p[w][key]):>8}" for w in ("start", "middle", "end")))
    L += ["", "invariants (each must be 0)"]
    for k, v in r["checks"].items():
        L.append(f"  {k:<32} {v}{'' if not v else '   <-- FAILED'}")
    L.append("")
    L.append("OK" if r["ok"] else "FAILED")
    for ex in r["problem_examples"]:
        L.append(f"  e.g. {ex}")
    return "\n".join(L)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/soak.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="how many requests (unless --duration-s)")
    ap.add_argument("--concurrency", type=int, default=100, help="requests in flight at once")
    ap.add_argument("--duration-s", type=float, default=0.0, help="run this long instead of --requests")
    ap.add_argument("--fault-rate", type=float, default=0.1, help="share of requests with an injected fault")
    ap.add_argument("--abandon-rate", type=float, default=0.05, help="share of streams the client abandons")
    ap.add_argument("--stream-share", type=float, default=0.7, help="share of streaming requests")
    ap.add_argument("--engines", type=parse_engines, default=parse_engines("vllm:2,sglang:2"),
                    help="ENGINE:COUNT,... (vllm, sglang); one model per engine kind")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--itl-ms", type=float, default=20.0, help="engines' inter-token latency")
    ap.add_argument("--ttft-ms", type=float, default=20.0, help="engines' base time to first token")
    ap.add_argument("--max-tokens", type=int, nargs=2, default=(8, 48), metavar=("LO", "HI"))
    ap.add_argument("--request-timeout-s", type=float, default=0.0,
                    help="client-side bound on one request (default: from the watchdog settings)")
    ap.add_argument("--watchdog-idle-s", type=float, default=5.0,
                    help="the gateway's idle watchdog (first chunk: 3x; non-streaming: 3x or 3x the longest answer)")
    ap.add_argument("--settle-s", type=float, default=20.0, help="how long to wait for the gateway to settle")
    ap.add_argument("--fd-slack", type=int, default=8, help="open fds allowed above the start at the end")
    ap.add_argument("--task-slack", type=int, default=4, help="tasks allowed above the start at the end")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "soak", help="logs and the report")
    ap.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    a = ap.parse_args(argv)
    if a.requests < 1 or a.concurrency < 1 or a.duration_s < 0 or not (0 <= a.fault_rate <= 1) \
            or not (0 <= a.abandon_rate <= 1) or not (0 <= a.stream_share <= 1) or not 1 <= a.max_tokens[0] <= a.max_tokens[1]:
        ap.error("out-of-range option")
    st = Settings(requests=a.requests, concurrency=a.concurrency, duration_s=a.duration_s, fault_rate=a.fault_rate,
                  abandon_rate=a.abandon_rate, stream_share=a.stream_share, engines=a.engines, seed=a.seed,
                  itl_ms=a.itl_ms, ttft_ms=a.ttft_ms, max_tokens=tuple(a.max_tokens),
                  request_timeout_s=a.request_timeout_s, settle_s=a.settle_s, watchdog_idle_s=a.watchdog_idle_s, fd_slack=a.fd_slack,
                  task_slack=a.task_slack, out=a.out)
    if not st.request_timeout_s:
        wd = st.watchdog
        st.request_timeout_s = wd["response_timeout_s"] + wd["first_chunk_timeout_s"] + 30
    run = uvloop.run if uvloop is not None else asyncio.run
    try:
        report = finalize(run(soak(st)), st)
    except SetupError as e:
        print(f"soak: {e}", file=sys.stderr)
        return 2
    (st.out / "soak-latest.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() if a.json else render(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
