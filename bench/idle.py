"""A gateway at rest: its CPU per second and the requests it makes of the engines, config against
config: ``python bench/idle.py``.

    python bench/idle.py                                   # share_monitoring on, then off
    python bench/idle.py --workers 4 --engines 8 --duration 20 --rounds 3
    python bench/idle.py --variant quiet='{health: {enabled: false}, scrape: {enabled: false}}'

What a gateway costs when no request comes: its workers' periodic work (health probes, engine
scrapes, the routing view's heartbeat between workers, the event-loop lag sampler, the memory
reclaim check) wakes each process many times a second, and each probe and scrape is a request an
engine answers. This starts ``--engines`` simulated vLLM engines (``python -m enginesim``, their
``/metrics`` the size of a real engine's), then for each round and each variant in turn a gateway
(``python -m gateway --workers N``, the default config plus the variant's top-level blocks, request
log to a file), waits ``--settle`` seconds after it is ready, and measures over ``--duration``
seconds: the CPU of all its processes (``/proc/PID/task/*/schedstat``, nanoseconds) and the
requests the engines received (``/_sim/state``, by path).

Prints each run and, per variant, the median and range of CPU ms per second and of the engine
requests per second (per engine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.loadgen import cpu_seconds_precise  # noqa: E402
from bench.overhead import children_of, wait_ready  # noqa: E402
from bench.procs import start_group, stop, wait_port  # noqa: E402
from gateway.server.run import free_port  # noqa: E402

PY = sys.executable
DEFAULT_VARIANTS = ["shared={view: {share_monitoring: true}}", "per-worker={view: {share_monitoring: false}}"]


def _get(port: int, path: str, method: str = "GET") -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method, data=b"{}" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def _engine_requests(ports: list[int]) -> dict[str, int]:
    """The requests the engines received since their last reset, by path."""
    out: dict[str, int] = {}
    for p in ports:
        for r in _get(p, "/_sim/state")["received"]:
            out[r["path"]] = out.get(r["path"], 0) + 1
    return out


def run(name: str, blocks: str, engine_ports: list[int], a: argparse.Namespace, work: Path) -> tuple[float, float, dict]:
    port = free_port()
    cfg = work / f"{name}.yaml"
    eps = ", ".join(f"'http://127.0.0.1:{p}'" for p in engine_ports)
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {shutdown_grace_s: 1, drain_delay_s: 0}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: [{eps}]}}]\n" + (blocks + "\n" if blocks else ""))
    with open(work / f"{name}.log", "wb") as err:
        p = start_group([PY, "-m", "gateway", "--config", str(cfg), "--workers", str(a.workers)], cwd=REPO,
                        stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_ready(name, p, port, 60, "m")
        time.sleep(a.settle)
        for ep in engine_ports:
            _get(ep, "/_sim/reset", "POST")
        pids = [p.pid, *children_of(p.pid)]
        c0, t0 = sum(cpu_seconds_precise(x) for x in pids), time.monotonic()
        time.sleep(a.duration)
        c1, t1 = sum(cpu_seconds_precise(x) for x in pids), time.monotonic()
        got = _engine_requests(engine_ports)
    finally:
        stop(p)
    window = t1 - t0
    per_engine = sum(got.values()) / len(engine_ports) / window
    return (c1 - c0) / window * 1000, per_engine, got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variant", action="append", default=None, metavar="NAME=YAML",
                    help="a name and the top-level config blocks it adds, in YAML flow style (repeat); default: "
                         "view.share_monitoring on, then off")
    a = ap.parse_args()
    variants = [v.split("=", 1) for v in (a.variant or DEFAULT_VARIANTS)]
    engines, ports = [], []
    for _ in range(a.engines):
        port = free_port()
        engines.append(start_group([PY, "-m", "enginesim", "--engine", "vllm", "--model", "m", "--port", str(port)],
                                   cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        ports.append(port)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in variants}
    try:
        for port, e in zip(ports, engines, strict=True):
            wait_port(port, e)
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(a.rounds):
                order = variants if r % 2 == 0 else variants[::-1]
                for name, blocks in order:
                    flow = "\n".join(f"{k}: {json.dumps(v)}" for k, v in _flow(blocks).items())
                    cpu, per_engine, got = run(name, flow, ports, a, Path(tmp))
                    results[name].append((cpu, per_engine))
                    print(f"round {r + 1} {name}: {cpu:.2f} ms CPU/s, {per_engine:.2f} requests/s per engine {got}",
                          flush=True)
    finally:
        for e in engines:
            stop(e)
    print(f"\n{a.workers} workers, {a.engines} engines, {a.duration:g} s windows, {a.rounds} rounds\n")
    print("| variant | gateway CPU, ms/s (median, range) | engine requests/s per engine (median, range) |")
    print("|---|---:|---:|")
    for name, rows in results.items():
        cpu = [c for c, _ in rows]
        req = [q for _, q in rows]
        print(f"| {name} | {statistics.median(cpu):.2f} ({min(cpu):.2f}-{max(cpu):.2f}) | "
              f"{statistics.median(req):.2f} ({min(req):.2f}-{max(req):.2f}) |")


def _flow(blocks: str) -> dict:
    """Top-level blocks given in YAML flow style (``{view: {...}}`` or ``view: {...}``)."""
    import yaml
    text = blocks.strip()
    data = yaml.safe_load(text if text.startswith("{") else "{" + text + "}")
    if not isinstance(data, dict):
        raise SystemExit(f"--variant: not a mapping of config blocks: {blocks!r}")
    return data


if __name__ == "__main__":
    main()
