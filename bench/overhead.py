"""Gateway overhead, side by side: direct to a backend, through Switchyard, through the Rust routers.

    python bench/overhead.py --quick          # < 2 minutes
    python bench/overhead.py                  # full mode
    python bench/overhead.py --tiny --peers none   # seconds; what the test runs

Processes, all on 127.0.0.1, each in its own process group, each stopped by pid on every exit path
(Ctrl-C included): one fast backend (``bench/fastbackend.py``), Switchyard (``python -m gateway``),
``sglang-router`` (``smg launch``) and ``vllm-router`` when installed in ``--peers-venv`` (``make
bench-peers``; a peer that is absent is skipped and the report says so), and one load generator
process per measurement (``bench/loadgen.py``). Nothing is pinned: backend, target and load
generator share the machine's cores, as in the issue's reference numbers.

Scenarios, each measured for every target in turn, targets rotated between rounds so slow drifts
of the machine hit all targets alike:

- ``ns1``, ``ns32``, ``ns256``: non-streaming chat completions, closed loop at that concurrency;
- ``st64``: 64 concurrent streams of 100 chunks, unpaced;
- ``paced1``: one stream at a time, chunks 5 ms apart (the first 5 ms after the headers): TTFT;
- ``idle1k``, ``idle10k``: that many streams held open after their first chunk; RSS before, held,
  and after they close, i.e. memory per open stream.

Figures: req/s (streams/s), p50/p99 latency and TTFT, CPU per request of the target process
(utime+stime deltas of ``/proc/PID/stat`` over exactly the measured window, so the backend and the
load generator are not counted), RSS (``VmRSS``). Every figure is also given as a ratio to direct
and to each peer. Output: a Markdown report on stdout and in ``--out`` (``overhead-<stamp>.md``),
and the same data as JSON (``overhead-<stamp>.json``); ``overhead-latest.*`` point at the last run.
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
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
from loadgen import percentile, rss_bytes  # noqa: E402

MODEL = "m"
SETTLE = 0.5   # seconds between a change in idle streams and the RSS reading
UPSTREAM_WAIT = 2.0   # how long a target may take to close its upstream legs once its clients left
PEERS = {
    # name: (executable in the peers venv, distribution, argv after the executable)
    "sglang-router": ("smg", "sglang-router",
                      lambda port, mport, url: ["launch", "--host", "127.0.0.1", "--port", str(port),
                                                "--worker-urls", url, "--policy", "round_robin",
                                                "--prometheus-host", "127.0.0.1",
                                                "--prometheus-port", str(mport), "--log-level", "warn",
                                                "--shutdown-grace-period-secs", "1"]),
    "vllm-router": ("vllm-router", "vllm-router",
                    lambda port, mport, url: ["--host", "127.0.0.1", "--port", str(port),
                                              "--worker-urls", url, "--policy", "round_robin",
                                              "--prometheus-host", "127.0.0.1",
                                              "--prometheus-port", str(mport), "--log-level", "warning"]),
}


@dataclass
class Scenario:
    name: str
    title: str
    mode: str                 # nonstream | stream | idle
    concurrency: int = 1
    max_tokens: int = 16
    pace_ms: float = 0.0
    idle_n: int = 0


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


MODES = {
    "tiny": Mode(rounds=1, warmup=0.1, duration=0.3, idle=[50], paced_chunks=4, stream_chunks=20,
                 ns_concurrency=(1, 8), stream_concurrency=8),
    "quick": Mode(rounds=2, warmup=0.3, duration=1.0, idle=[1000, 10000], paced_chunks=10),
    "full": Mode(rounds=3, warmup=1.0, duration=5.0, idle=[1000, 10000], paced_chunks=20),
}


def scenarios_for(m: Mode) -> list[Scenario]:
    out = [Scenario(f"ns{c}", f"non-streaming, concurrency {c}", "nonstream", c) for c in m.ns_concurrency]
    out.append(Scenario(f"st{m.stream_concurrency}",
                        f"streaming, {m.stream_concurrency} streams × {m.stream_chunks} chunks",
                        "stream", m.stream_concurrency, m.stream_chunks))
    out.append(Scenario("paced1", f"paced stream, concurrency 1, {m.paced_chunks} chunks 5 ms apart",
                        "stream", 1, m.paced_chunks, pace_ms=5.0))
    for n in m.idle:
        label = f"{n // 1000}k" if n % 1000 == 0 else str(n)
        out.append(Scenario(f"idle{label}", f"{n:,} idle streams held open", "idle", idle_n=n))
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

    def start(self, name: str, argv: list[str], *, stdin=None, stdout=None) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "ab")
        self.logs.append(log)
        p = subprocess.Popen(argv, cwd=REPO, stdin=stdin, stdout=stdout if stdout is not None else log,
                             stderr=log, start_new_session=True, preexec_fn=_die_with_parent)
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen, grace: float = 3.0) -> None:
        if p.poll() is None:
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)   # the group: p.pid leads its own session
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_request(port: int, method: str, path: str, body: bytes = b"", timeout: float = 2.0) -> tuple[int, bytes]:
    """One blocking HTTP/1.1 exchange on a fresh connection: (status, body); (0, b"") on failure."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
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


def wait_ready(name: str, p: subprocess.Popen, port: int, timeout: float) -> None:
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "ready?"}],
                         "max_tokens": 4, "stream": False})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"{name} exited with {p.returncode} during start-up (see its log)")
        if http_request(port, "POST", "/v1/chat/completions", body)[0] == 200:
            return
        time.sleep(0.1)
    raise RuntimeError(f"{name} not ready on port {port} after {timeout:g}s")


@dataclass
class Target:
    name: str
    port: int
    pid: int | None            # the process whose CPU and RSS we measure (None: direct)
    version: str = ""
    rss: dict[str, int] = field(default_factory=dict)


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


def write_gateway_config(path: Path, port: int, backend_url: str) -> None:
    path.write_text(
        f"# written by bench/overhead.py\n"
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        f"server: {{log_level: warning, shutdown_grace_s: 1}}\n"   # per-request lines are info
        f"routing: {{strategy: round-robin}}\n"                    # what the peers run
        f"health: {{interval_s: 5}}\n"
        f"scrape: {{enabled: false}}\n"                            # the backend has no metrics
        f"models:\n"
        f"  - name: {MODEL}\n"
        f"    engine: vllm\n"
        f"    endpoints: [{backend_url}]\n")


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


# -- measurement -------------------------------------------------------------------------------------

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


def loadgen_argv(t: Target, sc: Scenario, mode: Mode, backend_pid: int) -> list[str]:
    argv = [sys.executable, str(BENCH / "loadgen.py"), "--port", str(t.port), "--model", MODEL,
            "--mode", sc.mode, "--max-tokens", str(sc.max_tokens)]
    if sc.pace_ms:
        argv += ["--pace-ms", f"{sc.pace_ms:g}"]
    if sc.mode == "idle":
        return argv + ["--idle-n", str(sc.idle_n), "--hold-timeout", "20"]
    argv += ["--concurrency", str(sc.concurrency), "--warmup", f"{mode.warmup:g}",
             "--duration", f"{mode.duration:g}", "--samples", "--cpu-pid", f"backend={backend_pid}"]
    if t.pid is not None:
        argv += ["--cpu-pid", f"target={t.pid}"]
    return argv


def run_load(procs: Procs, t: Target, sc: Scenario, mode: Mode, backend_pid: int) -> dict:
    p = procs.start("loadgen", loadgen_argv(t, sc, mode, backend_pid), stdout=subprocess.PIPE)
    try:
        out, _ = p.communicate(timeout=mode.warmup + mode.duration + 60)
    except subprocess.TimeoutExpired:
        return {"failed": f"load generator timed out against {t.name}"}
    finally:
        procs.stop(p)
    lines = out.strip().splitlines()
    if p.returncode != 0 or not lines:
        return {"failed": f"load generator exited with {p.returncode} against {t.name}"}
    return orjson.loads(lines[-1])


def run_idle(procs: Procs, t: Target, sc: Scenario, mode: Mode, backend_pid: int, backend_port: int,
             settle: float) -> dict:
    pid = t.pid if t.pid is not None else backend_pid
    rss0 = rss_bytes(pid)
    p = procs.start("loadgen", loadgen_argv(t, sc, mode, backend_pid),
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    buf = bytearray()
    res: dict = {"rss_before": rss0, "measured_pid": "target" if t.pid is not None else "backend"}
    try:
        line = read_line(p, buf, time.monotonic() + 30 + sc.idle_n / 100)
        if line is None:
            res["failed"] = f"{sc.idle_n} idle streams not established in time"
            return res
        held = orjson.loads(line)
        res.update(held=held["held"], failed_streams=held["failed"], open_s=held["open_s"],
                   error_samples=held.get("error_samples", []))
        time.sleep(settle)
        res["rss_held"] = rss_bytes(pid)
        if t.pid is not None:
            res["backend_rss_held"] = rss_bytes(backend_pid)
        p.stdin.write(b"close\n")
        p.stdin.flush()
        line = read_line(p, buf, time.monotonic() + 30)
        if line is not None:
            res["still_open_at_close"] = orjson.loads(line).get("still_open_at_close")
        # the clients are gone: does the target let go of its upstream streams, and how fast?
        t_closed = time.monotonic()
        while True:
            left = backend_stats(backend_port).get("held")
            waited = time.monotonic() - t_closed
            if left == 0 or left is None or waited >= UPSTREAM_WAIT:
                break
            time.sleep(0.05)
        res["upstream_held_after_close"] = left
        res["upstream_wait_s"] = waited
        res["released"] = backend_release(backend_port)
        time.sleep(settle)
        res["rss_after_close"] = rss_bytes(pid)
        res["backend_after_release"] = backend_stats(backend_port)
        if res["held"]:
            res["bytes_per_stream"] = (res["rss_held"] - rss0) / res["held"]
        return res
    finally:
        procs.stop(p)


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
    for who in ("target", "backend"):
        cpu = [r["cpu_s"].get(who) for r in ok]
        if all(c is not None for c in cpu) and completed:
            agg[f"{who}_cpu_us_per_req"] = sum(cpu) / completed * 1e6
            agg[f"{who}_cpu_util"] = sum(cpu) / window
        ticks = [r.get("cpu_stat_s", {}).get(who) for r in ok]
        if all(c is not None for c in ticks) and completed:
            agg[f"{who}_cpu_stat_us_per_req"] = sum(ticks) / completed * 1e6
    return agg


# -- report ------------------------------------------------------------------------------------------

def fmt(x, digits: int = 2, suffix: str = "") -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        if abs(x) >= 1000:
            return f"{x:,.0f}{suffix}"
        if abs(x) >= 100:
            return f"{x:.0f}{suffix}"
        return f"{x:.{digits}f}{suffix}"
    return f"{x}{suffix}"


def ratio(a, b) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


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
            "kernel": platform.release(), "python": platform.python_version(),
            "hostname": platform.node()}


RATIO_FIGURES = [
    # key, label, better
    ("rps", "req/s (streams/s)", "higher"),
    ("lat_p50_ms", "p50 latency", "lower"),
    ("lat_p99_ms", "p99 latency", "lower"),
    ("ttft_p50_ms", "p50 TTFT", "lower"),
    ("ttft_p99_ms", "p99 TTFT", "lower"),
    ("target_cpu_us_per_req", "CPU per request", "lower"),
]


def render(report: dict) -> str:
    L: list[str] = []
    _header(report, L)
    if any(sc["mode"] != "idle" for sc in report["scenarios"]):
        _load_tables(report, L)
    if any(sc["mode"] == "idle" for sc in report["scenarios"]) or report["targets"]:
        _memory_tables(report, L)
    L.append("### Issue #5 targets (Switchyard)")
    L.append("")
    L.append("| target | measured | goal | met |")
    L.append("|---|---:|---|---|")
    for row in report["goals"]:
        met = {True: "yes", False: "**no**", None: "n/a"}[row["met"]]
        L.append(f"| {row['what']} | {row['measured']} | {row['goal']} | {met} |")
    L.append("")
    return "\n".join(L)


def _header(report: dict, L: list[str]) -> None:
    m = report["machine"]
    L.append(f"## Switchyard overhead benchmark — {report['date']} ({report['mode']} mode)")
    L.append("")
    L.append(f"Machine: {m['cpu']}, {m['cores']} cores ({m['affinity']} usable), {m['memory']}, "
             f"Linux {m['kernel']}, Python {m['python']}. Load average before/after: "
             f"{report['loadavg_before']} / {report['loadavg_after']}.")
    L.append("Backend, target and load generator share the cores (nothing pinned); the backend is "
             "`bench/fastbackend.py` (pre-encoded answers, ~10 µs of CPU per request). CPU per request: "
             "the target process's CPU time over the measured window (sum of its threads' "
             "`/proc/PID/task/*/schedstat`; `/proc/PID/stat` utime+stime, 10 ms ticks, is in the JSON "
             "as a cross-check) divided by the requests completed in it.")
    tv = ", ".join(f"{t['name']} {t['version']}".strip() for t in report["targets"])
    L.append(f"Targets: {tv}." + (f" Absent: {'; '.join(report['absent'])}." if report["absent"] else ""))
    L.append(f"Rounds: {report['params']['rounds']} × {report['params']['duration']:g} s per scenario and "
             f"target (after {report['params']['warmup']:g} s warm-up), targets interleaved. "
             f"Total time {report['elapsed_s']:.0f} s.")
    L.append("Scenarios: " + "; ".join(f"`{s['name']}` {s['title']}" for s in report["scenarios"]) + ".")
    for note in report["notes"]:
        L.append(f"Note: {note}")
    L.append("")


def _load_tables(report: dict, L: list[str]) -> None:
    names = [t["name"] for t in report["targets"]]
    others = [n for n in names if n != "switchyard"]
    peers = [n for n in names if n not in ("direct", "switchyard")]
    res = report["results"]
    load_scs = [sc for sc in report["scenarios"] if sc["mode"] != "idle"]
    L.append("### Throughput, latency, CPU")
    L.append("")
    L.append("| scenario | target | req/s | p50 ms | p99 ms | TTFT p50 ms | TTFT p99 ms | "
             "target CPU µs/req | backend CPU µs/req | errors |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for sc in load_scs:
        stream = sc["mode"] == "stream"
        for n in names:
            a = res.get(sc["name"], {}).get(n, {})
            if "rps" not in a:
                L.append(f"| {sc['name']} | {n} | failed: {'; '.join(a.get('failed_rounds', []))[:80]} "
                         "| | | | | | | |")
                continue
            L.append(f"| {sc['name']} | {n} | {fmt(a['rps'], 1)} | {fmt(a['lat_p50_ms'], 3)} | "
                     f"{fmt(a['lat_p99_ms'], 3)} | {fmt(a['ttft_p50_ms'] if stream else None, 3)} | "
                     f"{fmt(a['ttft_p99_ms'] if stream else None, 3)} | "
                     f"{fmt(a.get('target_cpu_us_per_req'), 1)} | {fmt(a.get('backend_cpu_us_per_req'), 1)} | "
                     f"{a['errors']} |")
    L.append("")
    L.append("req/s counts streams for the streaming scenarios; latency is the whole answer (the whole "
             "stream); TTFT is the time to the first SSE `data:` event.")
    L.append("")
    if "direct" in names and len(names) > 1:
        L.append("### Added over direct (ms)")
        L.append("")
        L.append("| scenario | target | +p50 | +p99 | +TTFT p50 | +TTFT p99 |")
        L.append("|---|---|---:|---:|---:|---:|")
        for sc in load_scs:
            stream = sc["mode"] == "stream"
            d = res.get(sc["name"], {}).get("direct", {})
            for n in names:
                if n == "direct":
                    continue
                a = res.get(sc["name"], {}).get(n, {})

                def diff(k, a=a, d=d):
                    return None if a.get(k) is None or d.get(k) is None else a[k] - d[k]
                L.append(f"| {sc['name']} | {n} | {fmt(diff('lat_p50_ms'), 3)} | {fmt(diff('lat_p99_ms'), 3)} | "
                         f"{fmt(diff('ttft_p50_ms') if stream else None, 3)} | "
                         f"{fmt(diff('ttft_p99_ms') if stream else None, 3)} |")
        L.append("")
    pairs = ([("switchyard", o) for o in others] if "switchyard" in names else []) + \
        [(p, "direct") for p in peers if "direct" in names]
    if pairs:
        L.append("### Ratios: each target's figure divided by the other's")
        L.append("")
        L.append("| scenario | figure | " + " | ".join(f"{a} / {b}" for a, b in pairs) + " |")
        L.append("|---|---|" + "---:|" * len(pairs))
        for sc in load_scs:
            r = res.get(sc["name"], {})
            for key, label, better in RATIO_FIGURES:
                if key.startswith("ttft") and sc["mode"] != "stream":
                    continue
                cells = ["—" if key == "target_cpu_us_per_req" and b == "direct" else
                         fmt(ratio(r.get(a, {}).get(key), r.get(b, {}).get(key)), 2, "×") for a, b in pairs]
                if all(c == "—" for c in cells):
                    continue
                L.append(f"| {sc['name']} | {label} ({better} is better) | " + " | ".join(cells) + " |")
        L.append("")


def _memory_tables(report: dict, L: list[str]) -> None:
    names = [t["name"] for t in report["targets"]]
    peers = [n for n in names if n not in ("direct", "switchyard")]
    res = report["results"]
    idle_scs = [s for s in report["scenarios"] if s["mode"] == "idle"]
    mb = 1024 * 1024
    L.append("### Memory")
    L.append("")
    head = "| target | RSS at start MB | RSS after load MB |"
    sep = "|---|---:|---:|"
    for s in idle_scs:
        head += f" {s['name']}: held MB | {s['name']}: KB/stream | {s['name']}: after close MB |"
        sep += "---:|---:|---:|"
    L.append(head + " RSS after the whole run MB |")
    L.append(sep + "---:|")
    for t in report["targets"]:
        n = t["name"]
        row = f"| {n}{' (backend)' if n == 'direct' else ''} | {fmt(_div(t['rss'].get('start'), mb), 1)} | " \
              f"{fmt(_div(t['rss'].get('after_load'), mb), 1)} |"
        for s in idle_scs:
            a = res.get(s["name"], {}).get(n, {})
            if "failed" in a:
                row += f" {a['failed']} | | |"
                continue
            bad = f" ({a['failed_streams']} failed)" if a.get("failed_streams") else ""
            row += (f" {fmt(_div(a.get('rss_held'), mb), 1)}{bad} | "
                    f"{fmt(_div(a.get('bytes_per_stream'), 1024), 1)} | "
                    f"{fmt(_div(a.get('rss_after_close'), mb), 1)} |")
        L.append(row + f" {fmt(_div(t['rss'].get('end'), mb), 1)} |")
    L.append("")
    L.append("Direct's row is the fast backend's own memory (a reference, not a gateway). "
             "KB/stream = (RSS held − RSS before) / streams held; a gateway holds two sockets per stream. "
             "After close: once the clients left and the backend ended any stream still open.")
    L.append("")
    mem_pairs = [("switchyard", p) for p in peers] if "switchyard" in names else []
    if mem_pairs:
        tby = {t["name"]: t for t in report["targets"]}
        L.append("| figure | " + " | ".join(f"{a} / {b}" for a, b in mem_pairs) + " |")
        L.append("|---|" + "---:|" * len(mem_pairs))
        L.append("| RSS after the whole run | " + " | ".join(
            fmt(ratio(tby[a]["rss"].get("end"), tby[b]["rss"].get("end")), 2, "×") for a, b in mem_pairs) + " |")
        for s in idle_scs:
            L.append(f"| {s['name']}: KB/stream | " + " | ".join(
                fmt(ratio(res.get(s["name"], {}).get(a, {}).get("bytes_per_stream"),
                          res.get(s["name"], {}).get(b, {}).get("bytes_per_stream")), 2, "×")
                for a, b in mem_pairs) + " |")
        L.append("")
    gws = [n for n in names if n != "direct"]
    if idle_scs and gws:
        L.append("Upstream streams still open at the backend once the clients closed theirs (a held stream "
                 "sends nothing more, so only a proxy that aborts the upstream leg when its client leaves lets "
                 f"go; polled for up to {UPSTREAM_WAIT:g} s):")
        L.append("")
        L.append("| target | " + " | ".join(s["name"] for s in idle_scs) + " |")
        L.append("|---|" + "---:|" * len(idle_scs))
        for n in gws:
            cells = []
            for s in idle_scs:
                a = res.get(s["name"], {}).get(n, {})
                held, left, waited = a.get("held"), a.get("upstream_held_after_close"), a.get("upstream_wait_s")
                if held is None or left is None or waited is None:
                    cells.append("—")
                elif left == 0:
                    cells.append(f"none (all {held:,} closed within {waited:.1f} s)")
                else:
                    cells.append(f"{left:,} of {held:,} still open after {waited:.1f} s")
            L.append(f"| {n} | " + " | ".join(cells) + " |")
        L.append("")


def _div(a, b):
    return None if a is None or a < 0 else a / b


def goals(report: dict) -> list[dict]:
    res = report["results"]
    out = []

    def g(scn, tgt, key):
        return res.get(scn, {}).get(tgt, {}).get(key)

    def add(what, value, goal, ok, unit=""):
        out.append({"what": what, "measured": "—" if value is None else f"{value:.3g}{unit}",
                    "goal": goal, "met": None if value is None else bool(ok(value)), "value": value})

    sy_p50, d_p50 = g("paced1", "switchyard", "ttft_p50_ms"), g("paced1", "direct", "ttft_p50_ms")
    sy_p99, d_p99 = g("paced1", "switchyard", "ttft_p99_ms"), g("paced1", "direct", "ttft_p99_ms")
    add("paced-stream TTFT added over direct, p50", None if None in (sy_p50, d_p50) else sy_p50 - d_p50,
        "≤ 0.3 ms", lambda v: v <= 0.3, " ms")
    add("paced-stream TTFT added over direct, p99", None if None in (sy_p99, d_p99) else sy_p99 - d_p99,
        "≤ 2 ms", lambda v: v <= 2.0, " ms")
    st = next((s["name"] for s in report["scenarios"] if s["mode"] == "stream" and s["name"] != "paced1"), None)
    add(f"streaming throughput ({st or 'no stream scenario'}) / vllm-router's", ratio(g(st, "switchyard", "rps"), g(st, "vllm-router", "rps")),
        "≥ 1.0×", lambda v: v >= 1.0, "×")
    add("non-streaming c=32 throughput / vllm-router's", ratio(g("ns32", "switchyard", "rps"),
                                                              g("ns32", "vllm-router", "rps")),
        "≥ 0.8×", lambda v: v >= 0.8, "×")
    add("CPU per request (ns32) / vllm-router's", ratio(g("ns32", "switchyard", "target_cpu_us_per_req"),
                                                       g("ns32", "vllm-router", "target_cpu_us_per_req")),
        "≤ 1.5×", lambda v: v <= 1.5, "×")
    sy = next((t for t in report["targets"] if t["name"] == "switchyard"), None)
    end = sy["rss"].get("end") if sy else None
    add("RSS after the whole run", None if end is None or end < 0 else end / 1048576, "≤ 120 MB",
        lambda v: v <= 120, " MB")
    idle = [sc for sc in report["scenarios"] if sc["mode"] == "idle"]
    big = max(idle, key=lambda sc: sc["idle_n"]) if idle else None
    per = res.get(big["name"], {}).get("switchyard", {}).get("bytes_per_stream") if big else None
    add(f"memory per idle stream, {big['idle_n']:,} held" if big else "memory per idle stream, 10,000 held",
        None if per is None else per / 1024, "< 40 KB (10,000 held)", lambda v: v < 40, " KB")
    return out


# -- main --------------------------------------------------------------------------------------------

def loadavg() -> str:
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "?"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", dest="mode", action="store_const", const="quick", help="under 2 minutes")
    g.add_argument("--full", dest="mode", action="store_const", const="full", help="the default (~8 minutes)")
    g.add_argument("--tiny", dest="mode", action="store_const", const="tiny", help="seconds; for tests")
    p.set_defaults(mode="full")
    p.add_argument("--peers", default="auto",
                   help="auto (those installed in --peers-venv), none, or a comma list of "
                        + ", ".join(PEERS))
    p.add_argument("--peers-venv", default=str(REPO / ".venv-peers"))
    p.add_argument("--no-switchyard", action="store_true", help="measure only direct and the peers")
    p.add_argument("--scenarios", default="", help="comma list of scenario names to run (default: all)")
    p.add_argument("--rounds", type=int)
    p.add_argument("--duration", type=float)
    p.add_argument("--warmup", type=float)
    p.add_argument("--idle", default=None, help="comma list of idle-stream counts (e.g. 1000,10000; '' none)")
    p.add_argument("--out", default=str(BENCH / "out"))
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_begin = time.monotonic()
    mode = MODES[args.mode]
    if args.rounds:
        mode.rounds = args.rounds
    if args.duration:
        mode.duration = args.duration
    if args.warmup is not None:
        mode.warmup = args.warmup
    if args.idle is not None:
        mode.idle = [int(x) for x in args.idle.split(",") if x.strip()]
    scenarios = scenarios_for(mode)
    if args.scenarios:
        wanted = {s.strip() for s in args.scenarios.split(",")}
        unknown = wanted - {s.name for s in scenarios}
        if unknown:
            print(f"unknown scenarios {sorted(unknown)}; known: {[s.name for s in scenarios]}", file=sys.stderr)
            return 2
        scenarios = [s for s in scenarios if s.name in wanted]
    notes: list[str] = []

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"[{time.monotonic() - t_begin:6.1f}s] {msg}", file=sys.stderr, flush=True)

    max_idle = max([s.idle_n for s in scenarios if s.mode == "idle"], default=0)
    nofile, nofile_note = raise_nofile(2 * max_idle + 4096)
    kept = []
    for s in scenarios:
        # a gateway holds two sockets per stream; keep some room for everything else it has open
        cap = (nofile - 256) // 2 // 100 * 100
        if s.mode == "idle" and s.idle_n > cap:
            why = (f"{s.idle_n:,} need RLIMIT_NOFILE ≥ {2 * s.idle_n + 256:,} in the gateway and it is "
                   f"{nofile:,} here ({nofile_note or 'raise the hard limit: ulimit -Hn'})")
            if cap < s.idle_n // 2:
                notes.append(f"{s.name} skipped: {why}")
                continue
            notes.append(f"{s.name} held {cap:,} streams, not {s.idle_n:,}: {why}")
            s.idle_n = cap
            s.title = f"{cap:,} idle streams held open"
        kept.append(s)
    scenarios = kept

    # which peers
    venv = Path(args.peers_venv)
    wanted_peers = list(PEERS) if args.peers in ("auto", "all") else \
        [] if args.peers == "none" else [x.strip() for x in args.peers.split(",") if x.strip()]
    absent: list[str] = []
    present: list[str] = []
    for name in wanted_peers:
        if name not in PEERS:
            print(f"unknown peer {name!r}; known: {list(PEERS)}", file=sys.stderr)
            return 2
        exe = venv / "bin" / PEERS[name][0]
        if exe.exists():
            present.append(name)
        else:
            absent.append(f"{name} (no {exe}; `make bench-peers` installs it)")
    if args.peers == "none":
        notes.append("peers not requested (--peers none)")

    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    report: dict = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "mode": args.mode,
        "machine": machine_info(), "loadavg_before": loadavg(), "switchyard_commit": git_describe(),
        "params": {"rounds": mode.rounds, "warmup": mode.warmup, "duration": mode.duration,
                   "rlimit_nofile": nofile},
        "scenarios": [vars(s) for s in scenarios], "absent": absent, "notes": notes,
        "targets": [], "results": {}, "rounds": {}, "pids": {},
    }

    with tempfile.TemporaryDirectory(prefix="sy-overhead-") as tmp:
        logdir = Path(tmp)
        procs = Procs(logdir)
        # SIGINT too: a shell starts background jobs with SIGINT ignored, and Python keeps it so
        prev = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

        def on_signal(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")
        for sig in prev:
            signal.signal(sig, on_signal)
        try:
            targets = start_targets(procs, args, present, venv, report, logdir, say)
            run_all(procs, targets, scenarios, mode, report, say)
            for t in targets:
                pid = t.pid if t.pid is not None else report["pids"]["backend"]
                t.rss["end"] = rss_bytes(pid)
            report["targets"] = [{"name": t.name, "version": t.version, "port": t.port, "rss": t.rss}
                                 for t in targets]
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


def start_targets(procs: Procs, args, present: list[str], venv: Path, report: dict, logdir: Path,
                  say) -> list[Target]:
    bport = free_port()
    backend = procs.start("fastbackend", [sys.executable, str(BENCH / "fastbackend.py"), "--port", str(bport),
                                          "--model", MODEL, "--ready", ""])
    report["pids"]["backend"] = backend.pid
    report["backend_port"] = bport
    wait_ready("fastbackend", backend, bport, 15)
    url = f"http://127.0.0.1:{bport}"
    targets = [Target("direct", bport, None, "fastbackend")]
    starting: list[tuple[Target, subprocess.Popen]] = []
    if not args.no_switchyard:
        gport = free_port()
        cfg = logdir / "switchyard.yaml"
        write_gateway_config(cfg, gport, url)
        p = procs.start("switchyard", [sys.executable, "-m", "gateway", "--config", str(cfg),
                                       "--log-format", "json"])
        starting.append((Target("switchyard", gport, p.pid, report["switchyard_commit"]), p))
    for name in present:
        exe, dist, argv = PEERS[name]
        port, mport = free_port(), free_port()
        p = procs.start(name, [str(venv / "bin" / exe), *argv(port, mport, url)])
        starting.append((Target(name, port, p.pid, peer_version(venv, dist)), p))
    for t, p in starting:
        wait_ready(t.name, p, t.port, 60)
        report["pids"][t.name] = p.pid
        targets.append(t)
    time.sleep(0.5)
    for t in targets:
        t.rss["start"] = rss_bytes(t.pid if t.pid is not None else backend.pid)
    say("ready: " + ", ".join(f"{t.name} :{t.port}" for t in targets))
    return targets


def run_all(procs: Procs, targets: list[Target], scenarios: list[Scenario], mode: Mode, report: dict,
            say) -> None:
    backend_pid = report["pids"]["backend"]
    results = report["results"]
    for sc in scenarios:
        results[sc.name] = {}
        if sc.mode == "idle":
            if "after_load" not in targets[0].rss:
                for t in targets:
                    t.rss["after_load"] = rss_bytes(t.pid if t.pid is not None else backend_pid)
            for t in targets:
                say(f"{sc.name}: {t.name}")
                r = run_idle(procs, t, sc, mode, backend_pid, report["backend_port"], settle=SETTLE)
                results[sc.name][t.name] = r
                if "failed" in r:
                    say(f"  {r['failed']}")
                else:
                    say(f"  held {r['held']} in {r['open_s']:.1f}s, "
                        f"{fmt(_div(r.get('bytes_per_stream'), 1024), 1)} KB/stream; upstream streams still "
                        f"open {r.get('upstream_wait_s', 0):.1f}s after the clients left: "
                        f"{r.get('upstream_held_after_close')}")
            continue
        runs: dict[str, list[dict]] = {t.name: [] for t in targets}
        for rnd in range(mode.rounds):
            k = rnd % len(targets)
            for t in targets[k:] + targets[:k]:
                r = run_load(procs, t, sc, mode, backend_pid)
                runs[t.name].append(r)
                if "failed" in r:
                    say(f"{sc.name} round {rnd + 1}: {t.name}: {r['failed']}")
                else:
                    say(f"{sc.name} round {rnd + 1}: {t.name}: {r['rps']:.0f}/s p50 {fmt(r['lat_p50_ms'], 3)} ms"
                        + (f" ttft p50 {fmt(r['ttft_p50_ms'], 3)} ms" if sc.mode == "stream" else "")
                        + (f" errors {r['errors']}" if r["errors"] else ""))
        report["rounds"][sc.name] = {}
        for t in targets:
            agg = results[sc.name][t.name] = aggregate(runs[t.name])
            agg["rss_after"] = rss_bytes(t.pid if t.pid is not None else backend_pid)
            report["rounds"][sc.name][t.name] = [
                {k: v for k, v in r.items() if k not in ("lat_us", "ttft_us")} for r in runs[t.name]]
    for t in targets:
        if "after_load" not in t.rss:
            t.rss["after_load"] = rss_bytes(t.pid if t.pid is not None else backend_pid)


if __name__ == "__main__":
    sys.exit(main())
