"""Gateway overhead, side by side: direct to a backend, through Switchyard, through the peers (the Rust
routers and the LiteLLM proxy).

    python bench/overhead.py --quick          # < 3 minutes
    python bench/overhead.py                  # full mode
    python bench/overhead.py --tiny --peers none   # seconds; what the test runs

Every gateway runs as users run it: Switchyard at its default config (log level info, so one
request line per request, ``log_format`` auto, which is JSON since stderr is not a TTY, as many
worker processes as ``server.workers``' default gives on this machine; the Columns table says
how many), its stderr going to a file on disk (what a container runtime's log driver does with a
container's output); the peers at their own default log level, stderr to a file too.
Columns beside the headline Switchyard change one setting each (``--switchyard-variants``):
``warning`` (no request line: what logging costs), ``console`` (the console renderer),
``workers1`` (``--workers 1``: one process) and ``workers2`` (``--workers 2``; the Rust routers use
every core by default).

Processes, all on 127.0.0.1, each in its own process group, each stopped by pid on every exit path
(Ctrl-C included), started in three stacks, one after the other (a stack is stopped before the
next starts):

- ``agg``: one fast backend (``bench/fastbackend.py``), Switchyard in each variant, the peers
  (``sglang-router``'s ``smg launch``, ``vllm-router``) when installed in ``--peers-venv`` (``make
  bench-peers``), the LiteLLM proxy (``litellm --config``, one worker, no database, no master key)
  when installed in ``--litellm-venv`` (``make bench-litellm``); an absent peer is skipped and the
  report says so. Scenarios ``ns1``, ``ns32``,
  ``ns256`` (non-streaming, closed loop at that concurrency), ``st64`` (64 unpaced streams of 100
  chunks), ``paced1`` (one stream at a time, chunks 5 ms apart: TTFT), ``idle1k``/``idle10k``
  (streams held open: memory per stream; Switchyard's variants other than the default skip these);
- ``pd``: prefill/decode mock engines (``bench/pdbackend.py``, vLLM-style and SGLang-style),
  Switchyard with a P/D model of each engine (``pd`` strategy), ``vllm-router
  --vllm-pd-disaggregation`` and ``smg launch --pd-disaggregation`` (LiteLLM has no P/D: n/a). Scenarios ``pd-vllm-c1``,
  ``pd-vllm-c16``, ``pd-sglang-c1``, ``pd-sglang-c16``: TTFT added over a client that orchestrates
  the two legs itself (``direct``);
- ``fleet``: one fast backend listening on 4 ports (4 endpoints), Switchyard with those 4
  endpoints, the peers with 4 worker URLs (LiteLLM: 4 ``model_list`` entries of one model). Scenario
  ``fleet1k``: 1,000 concurrent streams of 40 chunks 1 s apart; CPU of the target over the window, CPU
  per relayed chunk, RSS growth.

LiteLLM relays a few streams a second where the others relay hundreds or thousands, so its runs of the
scenarios that hold many streams at once are smaller (``--litellm-stream-concurrency``,
``--litellm-fleet-streams``, ``--litellm-idle-streams``) and the report says so under each table.

One load generator process per measurement (``bench/loadgen.py``). Nothing is pinned: backend,
target and load generator share the machine's cores. Targets are measured one after another for
each scenario, their order rotating between rounds, so a drift in the machine's load hits all alike.

Output: a Markdown report on stdout and in ``--out`` (``overhead-<stamp>.md``, rendered by
``bench/overhead_report.py``), and the same data as JSON (``overhead-<stamp>.json``);
``overhead-latest.*`` point at the last run. See bench/README.md for every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import platform
import resource
import select
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
from loadgen import cpu_seconds_precise, percentile, rss_bytes  # noqa: E402
from overhead_report import goals, open_targets, render  # noqa: E402

if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))
from gateway.server.run import free_port  # noqa: E402  (each port once: several are picked before any binds)

MODEL = "m"
SETTLE = 0.5   # seconds between a change in idle streams and the RSS reading
UPSTREAM_WAIT = 2.0   # how long a target may take to close its upstream legs once its clients left
BOOTSTRAP_PORT = 8998   # SGLang P/D: the bootstrap port every orchestrator names (the mock opens none)


# -- what runs ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    """One Switchyard column: the default config with at most one setting changed."""
    name: str
    server: dict[str, str]          # keys of the config's server: block
    argv: tuple[str, ...] = ()      # extra command-line arguments
    log_level: str = "info (default)"
    log_format: str = "auto (default) → JSON: stderr is not a TTY"
    workers: int | str | None = None    # --workers; None: server.workers' default


def variant_workers(variant: Variant) -> tuple[int, str]:
    """The worker processes the variant runs on this machine, and where that count comes from."""
    if str(REPO) not in sys.path:
        sys.path.insert(1, str(REPO))
    from gateway.config.schema import ServerConfig
    from gateway.server.workers import resolve_workers
    if variant.workers is not None:
        return resolve_workers(variant.workers), f"`--workers {variant.workers}`"
    default = ServerConfig().workers
    return resolve_workers(default), f"`server.workers` default, {default}"


def variant_processes(variant: Variant) -> str:
    n, how = variant_workers(variant)
    return f"1 ({how})" if n == 1 else f"{n} workers ({how}) + their parent; CPU and RSS summed"


VARIANTS = {
    "default": Variant("switchyard", {}),
    "warning": Variant("switchyard-warning", {"log_level": "warning"},
                       log_level="warning (`server.log_level`): no request line"),
    "console": Variant("switchyard-console", {"log_format": "console"},
                       log_format="console (`server.log_format`)"),
    "workers1": Variant("switchyard-workers1", {}, ("--workers", "1"), workers=1),
    "workers2": Variant("switchyard-workers2", {}, ("--workers", "2"), workers=2),
}


@dataclass(frozen=True)
class Peer:
    exe: str                                            # executable in its venv
    dist: str                                           # its distribution (for the version)
    agg: Callable[[int, int, list[str], Path], list[str]]   # (port, metrics port, worker URLs, config) → argv
    pd_engine: str                                      # the P/D protocol it speaks ("": none)
    pd: Callable[[int, int, str, str], list[str]] | None    # (port, metrics port, prefill, decode) → argv
    no_pd: str                                          # why it cannot run the other engine's P/D (or any)
    no_pd_short: str                                    # the same, for a table cell
    levels: dict[str, str]                              # --peers-log-level → its log level value
    what: str                                           # the Columns table's "what runs"
    processes: str = "1 (a multi-threaded runtime)"
    log_level: str = "info (its default)"
    log_format: str = "its own (text)"
    venv: str = "peers"                                 # peers (--peers-venv) | litellm (--litellm-venv)
    install: str = "make bench-peers"
    config: Callable[[list[str]], str] | None = None    # worker URLs → the config file it reads
    env: dict[str, str] = field(default_factory=dict)   # added to its environment
    level_env: str | None = None                        # the level goes in this variable, not --log-level
    probe: str | None = None                            # a GET that answers 200 once it is up
    start_timeout: float = 90.0


def litellm_config(urls: list[str]) -> str:
    """The LiteLLM proxy's config: one ``model_list`` entry per endpoint under one ``model_name``,
    which its router balances (its default strategy, simple-shuffle); an OpenAI-compatible backend
    (``openai/`` + ``api_base``); everything else at its defaults: no database, no callbacks. No
    master key, so no auth, as for the other targets; since 1.108 the proxy refuses to start without
    one unless told that is meant."""
    out = "# written by bench/overhead.py\nmodel_list:\n"
    for url in urls:
        out += (f"  - model_name: {MODEL}\n    litellm_params:\n      model: openai/{MODEL}\n"
                f"      api_base: {url}/v1\n      api_key: x\n")
    return out + "general_settings:\n  dangerously_permit_weak_or_unset_master_key: true\n"


PEERS = {
    "sglang-router": Peer(
        "smg", "sglang-router",
        lambda port, mport, urls, cfg: ["launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
                                   "--policy", "round_robin", "--prometheus-host", "127.0.0.1",
                                   "--prometheus-port", str(mport), "--shutdown-grace-period-secs", "1"],
        "sglang",
        lambda port, mport, prefill, decode: [
            "launch", "--host", "127.0.0.1", "--port", str(port), "--pd-disaggregation",
            "--prefill", prefill, str(BOOTSTRAP_PORT), "--decode", decode, "--policy", "round_robin",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(mport),
            "--shutdown-grace-period-secs", "1"],
        "its --pd-disaggregation speaks SGLang's bootstrap protocol only; it has no mode that hands "
        "vLLM's kv_transfer_params from the prefill's answer to the decode",
        "SGLang P/D only",
        {"debug": "debug", "info": "info", "warn": "warn", "error": "error"},
        "`smg launch --policy round_robin` (P/D: `--pd-disaggregation`)"),
    "vllm-router": Peer(
        "vllm-router", "vllm-router",
        lambda port, mport, urls, cfg: ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
                                   "--policy", "round_robin", "--prometheus-host", "127.0.0.1",
                                   "--prometheus-port", str(mport)],
        "vllm",
        lambda port, mport, prefill, decode: [
            "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation", "--prefill", prefill,
            "--decode", decode, "--policy", "round_robin", "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(mport)],
        "its only P/D mode, --vllm-pd-disaggregation, is vLLM's context-first protocol; it has no "
        "SGLang bootstrap mode",
        "vLLM P/D only",
        {"debug": "debug", "info": "info", "warn": "warning", "error": "error"},
        "`vllm-router --policy round_robin` (P/D: `--vllm-pd-disaggregation`)"),
    "litellm": Peer(
        "litellm", "litellm",
        lambda port, mport, urls, cfg: ["--config", str(cfg), "--host", "127.0.0.1", "--port", str(port)],
        "", None,
        "it has no prefill/decode disaggregation: a model_list entry is one OpenAI-compatible endpoint",
        "no P/D",
        {"debug": "DEBUG", "info": "INFO", "warn": "WARNING", "error": "ERROR"},
        "`litellm --config` (the proxy at its defaults: one worker, no database, no master key; a "
        "`model_list` entry per endpoint, its default routing, simple-shuffle)",
        processes="1 (uvicorn, one worker: `--num_workers` default)",
        log_level="its default (uvicorn's access log: one line per request)",
        venv="litellm", install="make bench-litellm", config=litellm_config,
        # the model cost map from the package, not fetched from GitHub at every start (its only
        # outbound call at start-up; usage telemetry is off unless configured, since 1.107)
        env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        level_env="LITELLM_LOG", probe="/health/liveliness", start_timeout=150.0),
}
# LiteLLM spends tens of ms of CPU on a stream and relays a few streams a second: in the scenarios
# that hold many streams at once it gets fewer, so that its runs end in seconds, not minutes. At 64
# concurrent unpaced streams of 100 chunks, one stream takes it about 8 s, longer than the window:
# it runs at 16, after a warm-up long enough for the first streams to end.
LITELLM_STREAM_CONCURRENCY = 16
LITELLM_STREAM_WARMUP = 3.0     # seconds, at least
LITELLM_STREAM_WINDOW = 2.0     # seconds, at least
LITELLM_FLEET_STREAMS = 100
LITELLM_IDLE_STREAMS = 250


@dataclass
class Scenario:
    name: str
    title: str
    mode: str                 # nonstream | stream | idle | pd | fleet
    concurrency: int = 1
    max_tokens: int = 16
    pace_ms: float = 0.0
    idle_n: int = 0
    engine: str = ""          # pd: vllm | sglang
    streams: int = 0          # fleet
    interval_s: float = 0.0   # fleet
    endpoints: int = 0        # fleet
    ramp_s: float = 0.0       # fleet: the streams start evenly over this long

    @property
    def kind(self) -> str:
        return "load" if self.mode in ("nonstream", "stream") else self.mode


@dataclass
class Mode:
    rounds: int
    warmup: float
    duration: float
    idle: list[int]
    paced_chunks: int
    stream_chunks: int = 100
    ns_concurrency: tuple[int, ...] = (1, 32, 256)
    stream_concurrency: int = 64
    variants: str = "default,workers1,warning,console,workers2"
    pd_concurrency: tuple[int, ...] = (1, 16)
    pd_tokens: int = 32
    pd_duration: float = 6.0
    pd_rounds: int = 3
    pd_prefill_ms: float = 20.0
    pd_transfer_ms: float = 2.0
    pd_token_ms: float = 5.0
    fleet_streams: int = 1000
    fleet_chunks: int = 40
    fleet_interval: float = 1.0
    fleet_endpoints: int = 4
    fleet_ramp: float | None = None   # None: one interval


MODES = {
    "tiny": Mode(rounds=1, warmup=0.1, duration=0.3, idle=[50], paced_chunks=4, stream_chunks=20,
                 ns_concurrency=(1, 8), stream_concurrency=8, variants="default,workers2",
                 pd_concurrency=(2,), pd_tokens=8, pd_duration=0.4, pd_rounds=1,
                 fleet_streams=20, fleet_chunks=3, fleet_interval=0.1),
    "quick": Mode(rounds=1, warmup=0.3, duration=1.0, idle=[1000], paced_chunks=10,
                  pd_duration=2.5, pd_rounds=1, fleet_chunks=8, fleet_interval=0.5),
    "full": Mode(rounds=3, warmup=1.0, duration=5.0, idle=[1000, 10000], paced_chunks=20),
}
KINDS = ("load", "idle", "pd", "fleet")


def _count(n: int) -> str:
    return f"{n // 1000}k" if n % 1000 == 0 and n >= 1000 else str(n)


def scenarios_for(m: Mode) -> list[Scenario]:
    out = [Scenario(f"ns{c}", f"non-streaming, concurrency {c}", "nonstream", c) for c in m.ns_concurrency]
    out.append(Scenario(f"st{m.stream_concurrency}",
                        f"streaming, {m.stream_concurrency} streams × {m.stream_chunks} chunks",
                        "stream", m.stream_concurrency, m.stream_chunks))
    out.append(Scenario("paced1", f"paced stream, concurrency 1, {m.paced_chunks} chunks 5 ms apart",
                        "stream", 1, m.paced_chunks, pace_ms=5.0))
    for n in m.idle:
        out.append(Scenario(f"idle{_count(n)}", f"{n:,} idle streams held open", "idle", idle_n=n))
    for engine in ("vllm", "sglang"):
        for c in m.pd_concurrency:
            out.append(Scenario(f"pd-{engine}-c{c}", f"{'vLLM' if engine == 'vllm' else 'SGLang'} P/D, "
                                f"concurrency {c}, {m.pd_tokens} tokens streamed", "pd", c, m.pd_tokens,
                                engine=engine))
    out.append(Scenario(f"fleet{_count(m.fleet_streams)}",
                        f"{m.fleet_streams:,} paced streams × {m.fleet_chunks} chunks {m.fleet_interval:g} s apart "
                        f"over {m.fleet_endpoints} endpoints", "fleet", m.fleet_streams, m.fleet_chunks,
                        pace_ms=m.fleet_interval * 1000, streams=m.fleet_streams, interval_s=m.fleet_interval,
                        endpoints=m.fleet_endpoints,
                        ramp_s=m.fleet_interval if m.fleet_ramp is None else m.fleet_ramp))
    return out


# -- processes ---------------------------------------------------------------------------------------

def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the benchmark itself dies without cleaning up (kill -9)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Procs:
    """Every process we start, each in its own session (process group); stopped by pid, always."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: list[subprocess.Popen] = []
        self.logs: list = []

    def log_path(self, name: str) -> Path:
        return self.logdir / f"{name}.log"

    def start(self, name: str, argv: list[str], *, stdin=None, stdout=None,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.log_path(name), "ab")
        self.logs.append(log)
        p = subprocess.Popen(argv, cwd=REPO, stdin=stdin, stdout=stdout if stdout is not None else log,
                             stderr=log, start_new_session=True, preexec_fn=_die_with_parent,
                             env={**os.environ, **env} if env else None)
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen, grace: float = 3.0) -> None:
        if p.poll() is None:
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)   # the group: p.pid leads its own session (workers included)
                try:
                    p.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        for f in (p.stdin, p.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        if p in self.procs:
            self.procs.remove(p)

    def stop_all(self) -> None:
        for p in reversed(list(self.procs)):
            self.stop(p, grace=2.0)
        for log in self.logs:
            with contextlib.suppress(OSError):
                log.close()


def http_request(port: int, method: str, path: str, body: bytes = b"", timeout: float = 2.0,
                 api_key: str | None = None) -> tuple[int, bytes]:
    """One blocking HTTP/1.1 exchange on a fresh connection: (status, body); (0, b"") on failure."""
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      f"{auth}Connection: close\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            data = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
                head, sep, rest = data.partition(b"\r\n\r\n")
                if sep:
                    low = head.lower()
                    i = low.find(b"content-length:")
                    if i >= 0 and len(rest) >= int(low[i + 15:].split(b"\r\n", 1)[0]):
                        break
            if not data.startswith(b"HTTP/1."):
                return 0, b""
            return int(data[9:12]), data.partition(b"\r\n\r\n")[2]
    except (OSError, ValueError):
        return 0, b""


def backend_stats(port: int) -> dict:
    status, body = http_request(port, "GET", "/bench/stats")
    try:
        return orjson.loads(body) if status == 200 else {}
    except orjson.JSONDecodeError:
        return {}


def backend_release(port: int) -> int | None:
    """End every stream the backend holds; how many it ended."""
    status, body = http_request(port, "POST", "/bench/release")
    try:
        return orjson.loads(body).get("released") if status == 200 else None
    except orjson.JSONDecodeError:
        return None


def wait_ready(name: str, p: subprocess.Popen, port: int, timeout: float, model: str = MODEL,
               probe: str | None = None, api_key: str | None = None) -> None:
    """Until a small chat completion through ``port`` answers 200; with ``probe``, first until a GET of
    that path does (a slow start-up is then not a stream of failing completions). Both within ``timeout``."""
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "ready?"}],
                         "max_tokens": 4, "stream": False})
    deadline = time.monotonic() + timeout
    while probe and time.monotonic() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"{name} exited with {p.returncode} during start-up (see its log)")
        if http_request(port, "GET", probe, timeout=5.0)[0] == 200:
            break
        time.sleep(0.2)
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"{name} exited with {p.returncode} during start-up (see its log)")
        if http_request(port, "POST", "/v1/chat/completions", body, timeout=5.0, api_key=api_key)[0] == 200:
            return
        time.sleep(0.1)
    _end(p)                     # not ready: ended here, so no caller's exit path leaves it running
    raise RuntimeError(f"{name} not ready on port {port} after {timeout:g}s")


def _end(p: subprocess.Popen) -> None:
    """Kill ``p`` and the group it leads (a gateway's workers), and reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        p.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(5)


def wait_listening(name: str, p: subprocess.Popen, port: int, timeout: float) -> None:
    """Until ``GET /bench/stats`` answers (a benchmark backend)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"{name} exited with {p.returncode} during start-up (see its log)")
        if http_request(port, "GET", "/bench/stats")[0] == 200:
            return
        time.sleep(0.05)
    raise RuntimeError(f"{name} not listening on port {port} after {timeout:g}s")


def children_of(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (a gateway's forked workers)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(d))
    return sorted(out)


@dataclass
class Target:
    name: str
    port: int
    pid: int | None            # the process we measure (None: direct, whose figures are the backend's)
    version: str = ""
    stack: str = "agg"
    kind: str = "direct"       # direct | switchyard | peer
    variant: str | None = None  # Switchyard's variant key
    pids: list[int] = field(default_factory=list)   # every process measured (pid, and its workers)
    about: dict[str, str] = field(default_factory=dict)
    log: Path | None = None    # its stderr
    pd_engines: tuple[str, ...] = ()   # pd stack: the P/D protocols it can orchestrate
    rss: dict[str, int] = field(default_factory=dict)
    requests: int = 0          # requests it served in the measured phases (log bytes per request)
    log0: tuple[int, int] = (0, 0)
    log_figures: dict = field(default_factory=dict)
    cpu0: float = 0.0
    idle_cpu_s: float = 0.0    # CPU spent between ready and the start of its stack's scenarios

    def measured(self, backend_pid: int) -> list[int]:
        return self.pids or ([self.pid] if self.pid is not None else [backend_pid])

    def as_dict(self) -> dict:
        return {"name": self.name, "stack": self.stack, "kind": self.kind, "variant": self.variant,
                "version": self.version, "port": self.port, "pids": self.pids, "rss": self.rss,
                "about": self.about, "log": self.log_figures, "idle_cpu_s": self.idle_cpu_s}


def group_cpu(pids: list[int]) -> float:
    return sum(max(0.0, cpu_seconds_precise(p)) for p in pids)


def rss_sum(pids: list[int]) -> int:
    values = [rss_bytes(p) for p in pids]
    return -1 if any(v < 0 for v in values) else sum(values)


def pss_bytes(pid: int) -> int:
    """A process's proportional set size (``/proc/PID/smaps_rollup``): each page it shares counted
    as its share. Summed over a parent and its forked workers it counts their shared pages once,
    where their RSS counts them once per process. -1 when unreadable."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return -1


def pss_sum(pids: list[int]) -> int:
    values = [pss_bytes(p) for p in pids]
    return -1 if any(v < 0 for v in values) else sum(values)


def peer_version(venv: Path, dist: str) -> str:
    try:
        out = subprocess.run([str(venv / "bin" / "python"), "-c",
                              f"import importlib.metadata as m; print(m.version({dist!r}))"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def git_describe() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + ("+dirty" if dirty else "") if rev else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


def write_gateway_config(path: Path, port: int, models: str, server: dict[str, str]) -> None:
    """Switchyard's config: its defaults, except where the benchmark must say something (listen,
    models), a quick stop, round-robin (what the peers run), and the variant's one setting."""
    extra = "".join(f", {k}: {v}" for k, v in server.items())
    path.write_text(
        f"# written by bench/overhead.py\n"
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        f"server: {{shutdown_grace_s: 1, drain_delay_s: 0{extra}}}\n"   # stop quickly
        f"routing: {{strategy: round-robin}}\n"
        f"models:\n{models}")


def agg_models(urls: list[str]) -> str:
    return f"  - name: {MODEL}\n    engine: vllm\n    endpoints: [{', '.join(urls)}]\n"


def pd_models(backends: dict[str, tuple[int, int, int]]) -> str:
    out = ""
    for engine, (_, pport, dport) in backends.items():
        boot = f"        bootstrap_port: {BOOTSTRAP_PORT}\n" if engine == "sglang" else ""
        out += (f"  - name: pd-{engine}\n    engine: {engine}\n    strategy: pd\n    rolesets:\n"
                f"      - name: rs-0\n{boot}        prefill: [http://127.0.0.1:{pport}]\n"
                f"        decode: [http://127.0.0.1:{dport}]\n")
    return out


def raise_nofile(want: int) -> tuple[int, str]:
    """Soft RLIMIT_NOFILE up to the hard limit, and the hard limit itself when we may (root)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    note = ""
    if hard != resource.RLIM_INFINITY and hard < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
        except (ValueError, OSError):
            note = f"hard RLIMIT_NOFILE is {hard} and cannot be raised"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0], note


def fs_type(path: Path) -> str:
    """The file system a path lives on (from /proc/mounts: the longest mount point above it)."""
    best, kind = "", "?"
    with contextlib.suppress(OSError):
        real = str(path.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")) \
                    and len(parts[1]) >= len(best):
                best, kind = parts[1], parts[2]
    return kind


def log_size(path: Path | None) -> tuple[int, int]:
    """(bytes, lines) of a log file."""
    if path is None:
        return 0, 0
    size = lines = 0
    with contextlib.suppress(OSError), open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            size += len(chunk)
            lines += chunk.count(b"\n")
    return size, lines


# -- stacks ------------------------------------------------------------------------------------------

@dataclass
class Stack:
    name: str
    targets: list[Target] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)
    backend_pid: int = 0
    backend_port: int = 0
    backend_ports: list[int] = field(default_factory=list)
    pd_backends: dict[str, tuple[int, int, int]] = field(default_factory=dict)   # engine → (pid, prefill, decode)
    starting: list[tuple[Target, subprocess.Popen, str]] = field(default_factory=list)   # (target, process, model)


class Runner:
    """Starts the stacks, runs the scenarios, fills the report."""

    def __init__(self, args: argparse.Namespace, mode: Mode, procs: Procs, report: dict, present: list[str],
                 venvs: dict[str, Path], say: Callable[[str], None]) -> None:
        self.args = args
        self.mode = mode
        self.procs = procs
        self.report = report
        self.present = present
        self.venvs = venvs
        self.say = say
        self.versions = {name: peer_version(venvs[PEERS[name].venv], PEERS[name].dist) for name in present}
        # streams a target holds at once in the fleet and idle scenarios, when fewer than the scenario's
        self.caps = {"litellm": {"fleet": args.litellm_fleet_streams, "idle": args.litellm_idle_streams,
                                 "stream": args.litellm_stream_concurrency}}
        self.stderr_kind = f"a file on {fs_type(procs.logdir)}"

    # -- starting ------------------------------------------------------------------------------

    def _start_backend(self, stack: Stack, name: str, ports: list[int]) -> None:
        argv = [sys.executable, str(BENCH / "fastbackend.py"), "--model", MODEL, "--ready", ""]
        for port in ports:
            argv += ["--port", str(port)]
        p = self.procs.start(f"{stack.name}-{name}", argv)
        stack.procs.append(p)
        self.report["pids"][f"{stack.name}:{name}"] = p.pid
        wait_listening(name, p, ports[0], 15)
        stack.backend_pid, stack.backend_port, stack.backend_ports = p.pid, ports[0], ports

    def _peer_level(self, peer: Peer) -> tuple[list[str], dict[str, str], str]:
        lvl = self.args.peers_log_level
        if lvl == "default":
            return [], {}, peer.log_level
        if peer.level_env:
            return [], {peer.level_env: peer.levels[lvl]}, f"{peer.levels[lvl]} (`{peer.level_env}`)"
        return ["--log-level", peer.levels[lvl]], {}, f"{peer.levels[lvl]} (`--log-level`)"

    @staticmethod
    def _scenario_streams(sc: Scenario) -> int:
        """Streams the scenario holds at once (0: not a scenario of many streams)."""
        if sc.mode == "idle":
            return sc.idle_n
        if sc.mode == "fleet":
            return sc.streams
        return sc.concurrency if sc.mode == "stream" and not sc.pace_ms else 0

    def streams_for(self, t: Target, sc: Scenario) -> int:
        """The streams ``t`` holds at once in an idle, fleet or unpaced stream scenario: the scenario's,
        or fewer, the target's cap."""
        n = self._scenario_streams(sc)
        cap = self.caps.get(t.name, {}).get(sc.mode)
        return min(n, cap) if cap and n else n

    def timing(self, t: Target, sc: Scenario) -> tuple[int, float, float]:
        """(concurrency, warm-up, window) of a load or P/D run of ``t``."""
        m = self.mode
        duration = m.pd_duration if sc.mode == "pd" else m.duration
        n = self.streams_for(t, sc)
        if sc.mode == "stream" and 0 < n < sc.concurrency:
            return n, max(m.warmup, LITELLM_STREAM_WARMUP), max(duration, LITELLM_STREAM_WINDOW)
        return sc.concurrency, m.warmup, duration

    def _note_cap(self, t: Target, sc: Scenario) -> None:
        n, full = self.streams_for(t, sc), self._scenario_streams(sc)
        capped = self.report["capped"]
        if n < full and not any(c["scenario"] == sc.name and c["target"] == t.name for c in capped):
            c = {"scenario": sc.name, "target": t.name, "streams": n, "of": full,
                 "option": f"--{t.name}-{'stream-concurrency' if sc.mode == 'stream' else sc.mode + '-streams'}"}
            if sc.mode == "stream":
                _, c["warmup_s"], c["window_s"] = self.timing(t, sc)
            capped.append(c)

    def _starting_switchyard(self, stack: Stack, variant: Variant, key: str, models: str) -> tuple[Target, subprocess.Popen]:
        port = free_port()
        cfg = self.procs.logdir / f"{stack.name}-{variant.name}.yaml"
        write_gateway_config(cfg, port, models, variant.server)
        name = f"{stack.name}-{variant.name}"
        p = self.procs.start(name, [sys.executable, "-m", "gateway", "--config", str(cfg), *variant.argv])
        about = {"what": "`python -m gateway`, default config" + (f" with {', '.join(f'{k}: {v}' for k, v in variant.server.items())}"
                                                                   if variant.server else "")
                 + (f", `{' '.join(variant.argv)}`" if variant.argv else ""),
                 "log_level": variant.log_level, "log_format": variant.log_format, "processes": variant_processes(variant),
                 "workers": variant_workers(variant)[0],
                 "stderr": self.stderr_kind}
        t = Target(variant.name, port, p.pid, self.report["switchyard_commit"], stack.name, "switchyard", key,
                   about=about, log=self.procs.log_path(name), pd_engines=("vllm", "sglang"))
        return t, p

    def _peer_argv(self, stack: Stack, name: str, port: int, mport: int, urls: list[str]) -> list[str]:
        """The peer's arguments in the agg and fleet stacks (its config file written first, if it reads one)."""
        peer = PEERS[name]
        cfg = self.procs.logdir / f"{stack.name}-{name}.yaml"
        if peer.config is not None:
            cfg.write_text(peer.config(urls))
        return peer.agg(port, mport, urls, cfg)

    def _starting_peer(self, stack: Stack, name: str, argv_tail: list[str]) -> tuple[Target, subprocess.Popen]:
        peer = PEERS[name]
        level_argv, level_env, level = self._peer_level(peer)
        pname = f"{stack.name}-{name}"
        p = self.procs.start(pname, [str(self.venvs[peer.venv] / "bin" / peer.exe), *argv_tail, *level_argv],
                             env={**peer.env, **level_env})
        about = {"what": peer.what, "log_level": level, "log_format": peer.log_format, "processes": peer.processes,
                 "stderr": self.stderr_kind}
        t = Target(name, 0, p.pid, self.versions.get(name, ""), stack.name, "peer",
                   about=about, log=self.procs.log_path(pname),
                   pd_engines=(peer.pd_engine,) if stack.name == "pd" and peer.pd_engine else ())
        return t, p

    def ready(self, stack: Stack) -> None:
        """Wait until every gateway of the stack answers (those of the later stacks start meanwhile)."""
        starting, stack.starting = stack.starting, []
        for t, p, model in starting:
            try:
                peer = PEERS.get(t.name) if t.kind == "peer" else None
                wait_ready(t.name, p, t.port, peer.start_timeout if peer else 90, model,
                           peer.probe if peer else None)
            except RuntimeError as e:
                if t.kind != "peer":
                    raise
                tail = (t.log.read_text(errors="replace")[-300:] if t.log and t.log.exists() else "").strip()
                self.report["notes"].append(f"{t.name} ({stack.name} stack) did not start, skipped: {e}"
                                            + (f"; its log ends: {tail!r}" if tail else ""))
                self.report["skipped"].append({"kind": stack.name, "target": t.name, "scenarios": "all",
                                               "why": f"did not start: {e}"})
                self.procs.stop(p)
                continue
            stack.procs.append(p)
            self.report["pids"][f"{stack.name}:{t.name}"] = p.pid
            n = variant_workers(VARIANTS[t.variant])[0] if t.variant in VARIANTS else 1
            if n > 1:       # a parent and its forked workers: every process is measured
                deadline = time.monotonic() + 10
                while len(kids := children_of(p.pid)) < n and time.monotonic() < deadline:
                    time.sleep(0.1)
                t.pids = [p.pid, *kids]
                for i, k in enumerate(kids):
                    self.report["pids"][f"{stack.name}:{t.name}:worker{i}"] = k
            stack.targets.append(t)
        time.sleep(0.5)
        for t in stack.targets:
            t.rss["start"] = rss_sum(t.measured(stack.backend_pid))
            t.log0 = log_size(t.log)
            t.cpu0 = group_cpu(t.measured(stack.backend_pid))
        self.say(f"{stack.name} stack ready: " + ", ".join(f"{t.name} :{t.port}" if t.port else t.name
                                                         for t in stack.targets))

    def launch_agg(self) -> Stack:
        st = Stack("agg")
        self._start_backend(st, "fastbackend", [free_port()])
        url = f"http://127.0.0.1:{st.backend_port}"
        st.targets.append(Target("direct", st.backend_port, None, "fastbackend", "agg",
                                 about={"what": "the load generator straight to the backend"}))
        starting = []
        if not self.args.no_switchyard:
            for key in self.args.variants:
                t, p = self._starting_switchyard(st, VARIANTS[key], key, agg_models([url]))
                starting.append((t, p, MODEL))
        for name in self.present:
            port, mport = free_port(), free_port()
            t, p = self._starting_peer(st, name, self._peer_argv(st, name, port, mport, [url]))
            t.port = port
            starting.append((t, p, MODEL))
        st.starting = starting
        return st

    def launch_pd(self, engines: set[str]) -> Stack:
        st = Stack("pd")
        m = self.mode
        for engine in sorted(engines, reverse=True):   # vllm first
            pport, dport = free_port(), free_port()
            p = self.procs.start(f"pd-{engine}-mock", [
                sys.executable, str(BENCH / "pdbackend.py"), "--style", engine, "--model", MODEL,
                "--prefill-port", str(pport), "--decode-port", str(dport), "--chunks", str(m.pd_tokens),
                "--prefill-ms", f"{m.pd_prefill_ms:g}", "--transfer-ms", f"{m.pd_transfer_ms:g}",
                "--token-ms", f"{m.pd_token_ms:g}", "--ready", ""])
            st.procs.append(p)
            self.report["pids"][f"pd:{engine}-mock"] = p.pid
            wait_listening(f"{engine} P/D mock", p, pport, 15)
            wait_listening(f"{engine} P/D mock", p, dport, 15)
            st.pd_backends[engine] = (p.pid, pport, dport)
        st.backend_pid = next(iter(st.pd_backends.values()))[0]
        st.targets.append(Target("direct", 0, None, "pdbackend", "pd", pd_engines=tuple(engines),
                                 about={"what": "the load generator orchestrating prefill and decode itself"}))
        starting = []
        if not self.args.no_switchyard:
            t, p = self._starting_switchyard(st, VARIANTS["default"], "default", pd_models(st.pd_backends))
            starting.append((t, p, f"pd-{sorted(engines, reverse=True)[0]}"))
        for name in self.present:
            peer = PEERS[name]
            if peer.pd is None or peer.pd_engine not in engines:
                continue
            _, pport, dport = st.pd_backends[peer.pd_engine]
            port, mport = free_port(), free_port()
            t, p = self._starting_peer(st, name, peer.pd(port, mport, f"http://127.0.0.1:{pport}",
                                                         f"http://127.0.0.1:{dport}"))
            t.port = port
            starting.append((t, p, MODEL))
        st.starting = starting
        return st

    def launch_fleet(self, endpoints: int) -> Stack:
        st = Stack("fleet")
        self._start_backend(st, "fastbackend", [free_port() for _ in range(endpoints)])
        urls = [f"http://127.0.0.1:{port}" for port in st.backend_ports]
        st.targets.append(Target("direct", st.backend_port, None, "fastbackend", "fleet",
                                 about={"what": "the load generator straight to the backend's endpoints"}))
        starting = []
        if not self.args.no_switchyard:
            t, p = self._starting_switchyard(st, VARIANTS["default"], "default", agg_models(urls))
            starting.append((t, p, MODEL))
        for name in self.present:
            port, mport = free_port(), free_port()
            t, p = self._starting_peer(st, name, self._peer_argv(st, name, port, mport, urls))
            t.port = port
            starting.append((t, p, MODEL))
        st.starting = starting
        return st

    def begin(self, stack: Stack) -> None:
        """The stack's scenarios start: what its processes spent while they waited for them."""
        for t in stack.targets:
            t.idle_cpu_s = max(0.0, group_cpu(t.measured(stack.backend_pid)) - t.cpu0)

    def stop(self, stack: Stack) -> None:
        for t in stack.targets:
            t.rss.setdefault("end", rss_sum(t.measured(stack.backend_pid)))
            t.rss.setdefault("end_pss", pss_sum(t.measured(stack.backend_pid)))
        time.sleep(0.2)   # let buffered log lines reach the files
        for t in stack.targets:
            if t.log is not None:
                size, lines = log_size(t.log)
                t.log_figures = {"bytes": size - t.log0[0], "lines": lines - t.log0[1], "requests": t.requests}
        self.report["targets"] += [t.as_dict() for t in stack.targets]
        for p in reversed(stack.procs):
            self.procs.stop(p)
        stack.procs.clear()

    # -- running -------------------------------------------------------------------------------

    def loadgen_argv(self, t: Target, sc: Scenario, stack: Stack) -> list[str]:
        argv = [sys.executable, str(BENCH / "loadgen.py"), "--mode", "stream" if sc.mode == "pd" else sc.mode,
                "--max-tokens", str(sc.max_tokens)]
        backend_pid = stack.backend_pid
        if sc.mode == "pd":
            backend_pid, pport, dport = stack.pd_backends[sc.engine]
            if t.kind == "direct":
                argv += ["--pd", sc.engine, "--port", str(dport), "--prefill-port", str(pport), "--model", MODEL,
                         "--bootstrap-port", str(BOOTSTRAP_PORT)]
            else:
                argv += ["--port", str(t.port), "--model", f"pd-{sc.engine}" if t.kind == "switchyard" else MODEL]
        elif sc.mode == "fleet" and t.kind == "direct":
            for port in stack.backend_ports:
                argv += ["--port", str(port)]
            argv += ["--model", MODEL]
        else:
            argv += ["--port", str(t.port), "--model", MODEL]
        if sc.pace_ms:
            argv += ["--pace-ms", f"{sc.pace_ms:g}"]
        if sc.mode == "idle":
            return argv + ["--idle-n", str(self.streams_for(t, sc)), "--hold-timeout", "20"]
        if sc.mode == "fleet":
            argv += ["--streams", str(self.streams_for(t, sc)), "--ramp", f"{sc.ramp_s:g}", "--settle", f"{SETTLE:g}"]
        else:
            concurrency, warmup, duration = self.timing(t, sc)
            argv += ["--concurrency", str(concurrency), "--warmup", f"{warmup:g}",
                     "--duration", f"{duration:g}", "--samples"]
        argv += ["--cpu-pid", f"backend={backend_pid}"]
        for pid in (t.pids or ([t.pid] if t.pid is not None else [])):
            argv += ["--cpu-pid", f"target={pid}"]
        return argv

    def run_load(self, t: Target, sc: Scenario, stack: Stack) -> dict:
        _, warmup, duration = self.timing(t, sc)
        limit = duration + warmup + 60
        if sc.mode == "fleet":
            limit = sc.ramp_s + sc.interval_s * (sc.max_tokens + 3) + 120
        p = self.procs.start("loadgen", self.loadgen_argv(t, sc, stack), stdout=subprocess.PIPE)
        try:
            out, _ = p.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            return {"failed": f"load generator timed out against {t.name}"}
        finally:
            self.procs.stop(p)
        lines = out.strip().splitlines()
        if p.returncode != 0 or not lines:
            return {"failed": f"load generator exited with {p.returncode} against {t.name}"}
        try:
            r = orjson.loads(lines[-1])
        except orjson.JSONDecodeError as e:     # one measurement lost, not the whole run
            return {"failed": f"load generator's result against {t.name} unreadable "
                              f"({len(out)} bytes, {len(lines)} lines): {e}"}
        t.requests += r.get("total_completed", 0)
        return r

    def run_idle(self, t: Target, sc: Scenario, stack: Stack) -> dict:
        pids = t.measured(stack.backend_pid)
        rss0 = rss_sum(pids)
        p = self.procs.start("loadgen", self.loadgen_argv(t, sc, stack), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        buf = bytearray()
        res: dict = {"rss_before": rss0, "measured_pid": "target" if t.pid is not None else "backend"}
        try:
            n = self.streams_for(t, sc)
            line = read_line(p, buf, time.monotonic() + 30 + n / 100)
            if line is None:
                res["failed"] = f"{n} idle streams not established in time"
                return res
            held = orjson.loads(line)
            res.update(held=held["held"], failed_streams=held["failed"], open_s=held["open_s"],
                       error_samples=held.get("error_samples", []))
            t.requests += held["held"]
            time.sleep(SETTLE)
            res["rss_held"] = rss_sum(pids)
            if t.pid is not None:
                res["backend_rss_held"] = rss_bytes(stack.backend_pid)
            p.stdin.write(b"close\n")
            p.stdin.flush()
            line = read_line(p, buf, time.monotonic() + 30)
            if line is not None:
                res["still_open_at_close"] = orjson.loads(line).get("still_open_at_close")
            # the clients are gone: does the target let go of its upstream streams, and how fast?
            t_closed = time.monotonic()
            while True:
                left = backend_stats(stack.backend_port).get("held")
                waited = time.monotonic() - t_closed
                if left == 0 or left is None or waited >= UPSTREAM_WAIT:
                    break
                time.sleep(0.05)
            res["upstream_held_after_close"] = left
            res["upstream_wait_s"] = waited
            res["released"] = backend_release(stack.backend_port)
            time.sleep(SETTLE)
            res["rss_after_close"] = rss_sum(pids)
            res["backend_after_release"] = backend_stats(stack.backend_port)
            if res["held"]:
                res["bytes_per_stream"] = (res["rss_held"] - rss0) / res["held"]
            return res
        finally:
            self.procs.stop(p)

    def _participants(self, sc: Scenario, stack: Stack) -> list[Target]:
        if sc.mode == "idle":   # memory per stream does not depend on the log settings
            return [t for t in stack.targets if t.variant in (None, "default")]
        if sc.mode == "pd":
            return [t for t in stack.targets if sc.engine in t.pd_engines]
        return list(stack.targets)

    def run_scenarios(self, stack: Stack, scenarios: list[Scenario]) -> None:
        results = self.report["results"]
        say = self.say
        for sc in scenarios:
            results[sc.name] = {}
            targets = self._participants(sc, stack)
            if sc.mode == "idle":
                if "after_load" not in stack.targets[0].rss:
                    for t in stack.targets:
                        t.rss["after_load"] = rss_sum(t.measured(stack.backend_pid))
                for t in targets:
                    say(f"{sc.name}: {t.name}")
                    self._note_cap(t, sc)
                    r = results[sc.name][t.name] = self.run_idle(t, sc, stack)
                    if "failed" in r:
                        say(f"  {r['failed']}")
                    else:
                        per = r.get("bytes_per_stream")
                        say(f"  held {r['held']} in {r['open_s']:.1f}s, "
                            f"{'—' if per is None else f'{per / 1024:.1f}'} KB/stream; upstream streams still "
                            f"open {r.get('upstream_wait_s', 0):.1f}s after the clients left: "
                            f"{r.get('upstream_held_after_close')}")
                continue
            if sc.mode == "fleet":
                for t in targets:
                    self._note_cap(t, sc)
                    before = backend_stats(stack.backend_port).get("by_port", {})
                    r = results[sc.name][t.name] = self.run_load(t, sc, stack)
                    after = backend_stats(stack.backend_port).get("by_port", {})
                    r["by_port"] = [after.get(str(p), 0) - before.get(str(p), 0) for p in stack.backend_ports]
                    if "failed" in r:
                        say(f"{sc.name}: {t.name}: {r['failed']}")
                        continue
                    cpu = r["cpu_s"].get("target")
                    say(f"{sc.name}: {t.name}: {r['completed']}/{self.streams_for(t, sc)} streams in {r['window_s']:.1f}s, "
                        f"target CPU {'—' if cpu is None else f'{cpu:.2f}'} s, {r['events']} chunks, "
                        f"errors {r['errors']}")
                continue
            rounds = self.mode.pd_rounds if sc.mode == "pd" else self.mode.rounds
            runs: dict[str, list[dict]] = {t.name: [] for t in targets}
            wires: dict[str, dict[str, int]] = {t.name: {} for t in targets}
            for rnd in range(rounds):
                k = rnd % len(targets)
                for t in targets[k:] + targets[:k]:
                    self._note_cap(t, sc)
                    w0 = self._pd_counters(stack, sc)
                    r = self.run_load(t, sc, stack)
                    if sc.mode == "pd":
                        w1 = self._pd_counters(stack, sc)
                        for key, v in w1.items():
                            wires[t.name][key] = wires[t.name].get(key, 0) + v - w0.get(key, 0)
                    runs[t.name].append(r)
                    if "failed" in r:
                        say(f"{sc.name} round {rnd + 1}: {t.name}: {r['failed']}")
                    else:
                        say(f"{sc.name} round {rnd + 1}: {t.name}: {r['rps']:.0f}/s p50 {_f(r['lat_p50_ms'])} ms"
                            + (f" ttft p50 {_f(r['ttft_p50_ms'])} ms" if sc.mode != "nonstream" else "")
                            + (f" errors {r['errors']}" if r["errors"] else ""))
            self.report["rounds"][sc.name] = {}
            for t in targets:
                agg = results[sc.name][t.name] = aggregate(runs[t.name])
                agg["rss_after"] = rss_sum(t.measured(stack.backend_pid))
                if sc.mode == "pd":
                    agg["wire"] = wires[t.name]
                self.report["rounds"][sc.name][t.name] = [
                    {k: v for k, v in r.items() if k not in ("lat_us", "ttft_us")} for r in runs[t.name]]

    def _pd_counters(self, stack: Stack, sc: Scenario) -> dict[str, int]:
        if sc.mode != "pd":
            return {}
        return backend_stats(stack.pd_backends[sc.engine][1]).get("pd", {})


def _f(x) -> str:
    return "—" if x is None else f"{x:.3f}"


# -- measurement helpers -----------------------------------------------------------------------------

def read_line(p: subprocess.Popen, buf: bytearray, deadline: float) -> bytes | None:
    """The next line of the child's stdout, without blocking past the deadline."""
    fd = p.stdout.fileno()
    while True:
        i = buf.find(b"\n")
        if i >= 0:
            line = bytes(buf[:i])
            del buf[:i + 1]
            return line
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        r, _, _ = select.select([fd], [], [], left)
        if r:
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            buf += chunk


def aggregate(runs: list[dict]) -> dict:
    """Pool the rounds of one (scenario, target): sums for rates, pooled samples for percentiles."""
    ok = [r for r in runs if "failed" not in r]
    agg: dict = {"rounds": len(runs), "failed_rounds": [r["failed"] for r in runs if "failed" in r]}
    if not ok:
        return agg
    window = sum(r["window_s"] for r in ok)
    completed = sum(r["completed"] for r in ok)
    lat = sorted(x / 1e3 for r in ok for x in r.get("lat_us", []))
    ttft = sorted(x / 1e3 for r in ok for x in r.get("ttft_us", []))
    agg.update(
        completed=completed, errors=sum(r["errors"] for r in ok),
        error_samples=[e for r in ok for e in r.get("error_samples", [])][:5],
        rps=completed / window if window else None,
        events_per_s=sum(r["events"] for r in ok) / window if window else None,
        lat_mean_ms=sum(lat) / len(lat) if lat else None,
        lat_p50_ms=percentile(lat, 50), lat_p99_ms=percentile(lat, 99),
        ttft_p50_ms=percentile(ttft, 50), ttft_p99_ms=percentile(ttft, 99),
        loadgen_cpu_s=sum(r["loadgen_cpu_s"] for r in ok),
    )
    gone = sorted({pid for r in ok for ps in r.get("gone", {}).values() for pid in ps})
    if any(r.get("gone") for r in ok):      # a measured process could not be read: which, if it exited
        agg["unmeasured"] = {"groups": sorted({g for r in ok for g in r.get("gone", {})}), "gone_pids": gone}
    for who in ("target", "backend"):
        cpu = [r["cpu_s"].get(who) for r in ok]
        if all(c is not None for c in cpu) and completed:
            agg[f"{who}_cpu_us_per_req"] = sum(cpu) / completed * 1e6
            agg[f"{who}_cpu_util"] = sum(cpu) / window
        ticks = [r.get("cpu_stat_s", {}).get(who) for r in ok]
        if all(c is not None for c in ticks) and completed:
            agg[f"{who}_cpu_stat_us_per_req"] = sum(ticks) / completed * 1e6
    return agg


def machine_info() -> dict:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 1048576:.1f} GiB"
    return {"cpu": cpu, "cores": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "memory": mem,
            "kernel": platform.release(), "python": platform.python_version(), "python_build": python_build(),
            "hostname": platform.node()}


def python_build() -> str:
    """The interpreter's build options that move its speed (the gateway's CPU is mostly the
    interpreter's): what its ``configure`` was given, as ``sysconfig`` records it."""
    args = sysconfig.get_config_var("CONFIG_ARGS") or ""
    opts = [f"{flag}{'' if flag in args else ' absent'}" for flag in ("--enable-optimizations", "--with-lto")]
    shared = "libpython shared (--enable-shared)" if sysconfig.get_config_var("Py_ENABLE_SHARED") else "libpython static"
    return f"{shared}, configure flags {', '.join(opts)}"


# -- main --------------------------------------------------------------------------------------------

def loadavg() -> str:
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "?"


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", dest="mode", action="store_const", const="quick", help="under 3 minutes")
    g.add_argument("--full", dest="mode", action="store_const", const="full", help="the default (~20 minutes)")
    g.add_argument("--tiny", dest="mode", action="store_const", const="tiny", help="seconds; for tests")
    p.set_defaults(mode="full")
    p.add_argument("--peers", default="auto",
                   help="auto (those installed in --peers-venv and --litellm-venv), none, or a comma list of "
                        + ", ".join(PEERS))
    p.add_argument("--peers-venv", default=str(REPO / ".venv-peers"), help="the Rust routers' venv (make bench-peers)")
    p.add_argument("--litellm-venv", default=str(REPO / ".venv-litellm"), help="LiteLLM's venv (make bench-litellm)")
    p.add_argument("--litellm-stream-concurrency", type=int, default=LITELLM_STREAM_CONCURRENCY,
                   help=f"LiteLLM's concurrency in the unpaced stream scenario (default {LITELLM_STREAM_CONCURRENCY}, "
                        f"after at least {LITELLM_STREAM_WARMUP:g} s of warm-up, with a window of at least "
                        f"{LITELLM_STREAM_WINDOW:g} s; 0: the scenario's)")
    p.add_argument("--litellm-fleet-streams", type=int, default=LITELLM_FLEET_STREAMS,
                   help=f"streams LiteLLM gets in the many-paced-streams scenario (default {LITELLM_FLEET_STREAMS}; "
                        "0: the scenario's)")
    p.add_argument("--litellm-idle-streams", type=int, default=LITELLM_IDLE_STREAMS,
                   help=f"idle streams LiteLLM holds at most (default {LITELLM_IDLE_STREAMS:,}; 0: the scenario's)")
    p.add_argument("--peers-log-level", default="default", choices=("default", "debug", "info", "warn", "error"),
                   help="the peers' --log-level (default: theirs, info)")
    p.add_argument("--no-switchyard", action="store_true", help="measure only direct and the peers")
    p.add_argument("--switchyard-variants", default=None,
                   help="comma list of Switchyard columns in the load scenarios: "
                        + ", ".join(VARIANTS) + " (default: all; tiny: default,workers2)")
    p.add_argument("--scenarios", default="",
                   help="comma list of scenario names, or kinds (" + ", ".join(KINDS) + "); default: all")
    p.add_argument("--rounds", type=int)
    p.add_argument("--duration", type=float)
    p.add_argument("--warmup", type=float)
    p.add_argument("--idle", default=None, help="comma list of idle-stream counts (e.g. 1000,10000; '' none)")
    p.add_argument("--pd-concurrency", type=_ints, help="comma list (default 1,16)")
    p.add_argument("--pd-tokens", type=int, help="tokens per P/D stream (default 32)")
    p.add_argument("--pd-duration", type=float, help="seconds per P/D round")
    p.add_argument("--pd-rounds", type=int)
    p.add_argument("--pd-prefill-ms", type=float)
    p.add_argument("--pd-transfer-ms", type=float)
    p.add_argument("--pd-token-ms", type=float)
    p.add_argument("--fleet-streams", type=int, help="concurrent paced streams (default 1000)")
    p.add_argument("--fleet-chunks", type=int, help="chunks per stream (default 40; quick 8)")
    p.add_argument("--fleet-interval", type=float, help="seconds between chunks (default 1; quick 0.5)")
    p.add_argument("--fleet-endpoints", type=int, help="backend endpoints (default 4)")
    p.add_argument("--fleet-ramp", type=float, help="seconds over which the streams start (default: one interval)")
    p.add_argument("--out", default=str(BENCH / "out"))
    p.add_argument("--logdir", default=None, help="keep the processes' logs here (default: a temporary "
                                                  "directory, removed at the end)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p.parse_args(argv)


def configure(args: argparse.Namespace) -> tuple[Mode, list[Scenario]] | str:
    mode = MODES[args.mode]
    for opt, attr in (("rounds", "rounds"), ("duration", "duration"), ("pd_concurrency", "pd_concurrency"),
                      ("pd_tokens", "pd_tokens"), ("pd_duration", "pd_duration"), ("pd_rounds", "pd_rounds"),
                      ("pd_prefill_ms", "pd_prefill_ms"), ("pd_transfer_ms", "pd_transfer_ms"),
                      ("pd_token_ms", "pd_token_ms"), ("fleet_streams", "fleet_streams"),
                      ("fleet_chunks", "fleet_chunks"), ("fleet_interval", "fleet_interval"),
                      ("fleet_endpoints", "fleet_endpoints"), ("fleet_ramp", "fleet_ramp")):
        v = getattr(args, opt)
        if v is not None and v != ():
            setattr(mode, attr, v)
    if args.warmup is not None:
        mode.warmup = args.warmup
    if args.idle is not None:
        mode.idle = [int(x) for x in args.idle.split(",") if x.strip()]
    variants = [v.strip() for v in (args.switchyard_variants or mode.variants).split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        return f"unknown Switchyard variants {unknown}; known: {list(VARIANTS)}"
    args.variants = list(dict.fromkeys(variants))
    scenarios = scenarios_for(mode)
    if args.scenarios:
        wanted = {s.strip() for s in args.scenarios.split(",") if s.strip()}
        unknown = wanted - {s.name for s in scenarios} - set(KINDS)
        if unknown:
            return f"unknown scenarios {sorted(unknown)}; known: {[s.name for s in scenarios]} or kinds {list(KINDS)}"
        scenarios = [s for s in scenarios if s.name in wanted or s.kind in wanted]
    return mode, scenarios


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_begin = time.monotonic()
    conf = configure(args)
    if isinstance(conf, str):
        print(conf, file=sys.stderr)
        return 2
    mode, scenarios = conf
    notes: list[str] = []

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"[{time.monotonic() - t_begin:6.1f}s] {msg}", file=sys.stderr, flush=True)

    max_held = max([s.idle_n for s in scenarios if s.mode == "idle"] + [s.streams for s in scenarios if s.mode == "fleet"],
                   default=0)
    nofile, nofile_note = raise_nofile(2 * max_held + 4096)
    kept = []
    for s in scenarios:
        # a gateway holds two sockets per stream; keep some room for everything else it has open
        cap = (nofile - 256) // 2 // 100 * 100
        n = s.idle_n if s.mode == "idle" else s.streams if s.mode == "fleet" else 0
        if n > cap:
            why = (f"{n:,} streams need RLIMIT_NOFILE ≥ {2 * n + 256:,} in the gateway and it is "
                   f"{nofile:,} here ({nofile_note or 'raise the hard limit: ulimit -Hn'})")
            if cap < n // 2 or s.mode == "fleet":
                notes.append(f"{s.name} skipped: {why}")
                continue
            notes.append(f"{s.name} held {cap:,} streams, not {n:,}: {why}")
            s.idle_n = cap
            s.title = f"{cap:,} idle streams held open"
        kept.append(s)
    scenarios = kept

    # which peers
    venvs = {"peers": Path(args.peers_venv), "litellm": Path(args.litellm_venv)}
    wanted_peers = list(PEERS) if args.peers in ("auto", "all") else \
        [] if args.peers == "none" else [x.strip() for x in args.peers.split(",") if x.strip()]
    absent: list[str] = []
    present: list[str] = []
    for name in wanted_peers:
        if name not in PEERS:
            print(f"unknown peer {name!r}; known: {list(PEERS)}", file=sys.stderr)
            return 2
        exe = venvs[PEERS[name].venv] / "bin" / PEERS[name].exe
        if exe.exists():
            present.append(name)
        else:
            absent.append(f"{name} (no {exe}; `{PEERS[name].install}` installs it)")
    if args.peers == "none":
        notes.append("peers not requested (--peers none)")

    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    report: dict = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "mode": args.mode,
        "machine": machine_info(), "loadavg_before": loadavg(), "switchyard_commit": git_describe(),
        "params": {"rounds": mode.rounds, "warmup": mode.warmup, "duration": mode.duration,
                   "rlimit_nofile": nofile, "upstream_wait_s": UPSTREAM_WAIT, "variants": args.variants,
                   "peers_log_level": args.peers_log_level,
                   "pd": {"prefill_ms": mode.pd_prefill_ms, "transfer_ms": mode.pd_transfer_ms,
                          "token_ms": mode.pd_token_ms, "tokens": mode.pd_tokens, "rounds": mode.pd_rounds,
                          "duration": mode.pd_duration, "bootstrap_port": BOOTSTRAP_PORT}},
        "scenarios": [{**vars(s), "kind": s.kind} for s in scenarios], "absent": absent, "notes": notes,
        "skipped": [], "capped": [], "targets": [], "results": {}, "rounds": {}, "pids": {},
    }
    for name in present:
        peer = PEERS[name]
        other = [s.name for s in scenarios if s.mode == "pd" and s.engine != peer.pd_engine]
        if other:
            report["skipped"].append({"kind": "pd", "target": name, "scenarios": ", ".join(other),
                                      "why": peer.no_pd, "short": peer.no_pd_short})

    with contextlib.ExitStack() as exits:
        if args.logdir:
            logdir = Path(args.logdir)
            logdir.mkdir(parents=True, exist_ok=True)
        else:
            logdir = Path(exits.enter_context(tempfile.TemporaryDirectory(prefix="sy-overhead-")))
        procs = Procs(logdir)
        # SIGINT too: a shell starts background jobs with SIGINT ignored, and Python keeps it so
        prev = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

        def on_signal(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")
        for sig in prev:
            signal.signal(sig, on_signal)
        try:
            runner = Runner(args, mode, procs, report, present, venvs, say)
            agg = [s for s in scenarios if s.kind == "load"] + [s for s in scenarios if s.kind == "idle"]
            pd = [s for s in scenarios if s.kind == "pd"]
            fleet = [s for s in scenarios if s.kind == "fleet"]
            # every stack's processes start at once (their start-ups overlap); each is stopped when
            # its scenarios are done. The JSON has what each target spent while it waited (idle_cpu_s).
            phases = []
            if agg or not (pd or fleet):
                phases.append((runner.launch_agg(), agg))
            if pd:
                phases.append((runner.launch_pd({s.engine for s in pd}), pd))
            for sc in fleet:
                phases.append((runner.launch_fleet(sc.endpoints), [sc]))
            for stack, _ in phases:
                runner.ready(stack)
            for stack, scs in phases:
                runner.begin(stack)
                runner.run_scenarios(stack, scs)
                for t in stack.targets:
                    t.rss.setdefault("after_load", rss_sum(t.measured(stack.backend_pid)))
                runner.stop(stack)
        except KeyboardInterrupt:
            print("interrupted; stopping every process started", file=sys.stderr)
            procs.stop_all()
            return 130
        except RuntimeError as e:
            print(f"overhead: {e}", file=sys.stderr)
            for f in sorted(logdir.glob("*.log")):
                tail = f.read_text(errors="replace")[-2000:]
                if tail.strip():
                    print(f"--- {f.name} (tail)\n{tail}", file=sys.stderr)
            return 1
        finally:
            procs.stop_all()
            for sig, h in prev.items():
                signal.signal(sig, h)

    report["loadavg_after"] = loadavg()
    report["elapsed_s"] = time.monotonic() - t_begin
    report["goals"] = goals(report)
    report["open_targets"] = open_targets(report)
    md = render(report)
    report["markdown"] = md
    (outdir / f"overhead-{stamp}.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    (outdir / f"overhead-{stamp}.md").write_text(md)
    for ext in ("json", "md"):
        latest = outdir / f"overhead-latest.{ext}"
        with contextlib.suppress(OSError):
            latest.unlink()
        with contextlib.suppress(OSError):
            latest.symlink_to(f"overhead-{stamp}.{ext}")
    print(md)
    say(f"wrote {outdir / f'overhead-{stamp}.md'} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
