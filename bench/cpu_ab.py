"""CPU per request and per relayed chunk, two source trees side by side: ``python bench/cpu_ab.py``.

    python bench/cpu_ab.py --base main                 # main against this tree
    python bench/cpu_ab.py --base HEAD~3 --rounds 7 --scenarios ns32,fleet
    python bench/cpu_ab.py --base HEAD --new-env PYTHONMALLOC=malloc      # one tree, two environments
    python bench/cpu_ab.py --base HEAD --new-python ../other-venv/bin/python   # one tree, two interpreters
    python bench/cpu_ab.py --base HEAD --new-config 'view: {workers: false}'  # one tree, two configs
    python bench/cpu_ab.py --base main --api-key sk-1 --base-config "$T" --new-config "$T"   # both with tenants

Meant for changes to the hot path on a shared, noisy machine: both gateways run at the same time,
from their own source trees (``--base REF`` is exported with ``git archive`` into a temporary
directory; the other is this checkout), at their default config (log level info, JSON log line
to a file, breakers on, one worker unless ``--workers``) behind one fast backend (``bench/fastbackend.py``) listening on
4 ports. The load generator (``bench/loadgen.py``) drives them in turn, ``base, new, new, base,
...`` so a drift in the machine's load hits both alike, and reads each gateway's CPU from its
threads' ``schedstat`` over exactly the measured window.

Scenarios (``--scenarios``):

- ``ns32``: non-streaming requests, closed loop at concurrency 32: CPU per request;
- ``st64``: 64 unpaced streams of 100 chunks: CPU per relayed chunk, streams/s;
- ``fleet``: ``--fleet-streams`` paced streams of ``--fleet-chunks`` chunks ``--fleet-interval``
  s apart (the shape of ``bench/overhead.py``'s ``fleet1k``, shorter): CPU per relayed chunk.
- ``paced1``: one stream at a time, 20 chunks 5 ms apart (``bench/overhead.py``'s ``paced1``):
  TTFT p50 added over the backend reached directly, measured in the same round.

Prints every run and the medians, and the ratio new / base.
"""

from __future__ import annotations

import argparse
import io
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.overhead import children_of, wait_ready  # noqa: E402
from bench.procs import stop, wait_port  # noqa: E402
from gateway.server.run import free_port  # noqa: E402

PY = sys.executable


def export(ref: str, into: Path) -> Path:
    """The tree of ``ref`` as files under ``into``."""
    raw = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", ref], check=True,
                         capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        tar.extractall(into, filter="data")
    return into


def start_backend(n: int = 4) -> tuple[subprocess.Popen, list[int]]:
    """The fast backend (``bench/fastbackend.py``) on ``n`` free ports, and those ports."""
    ports = [free_port() for _ in range(n)]
    argv = [PY, str(REPO / "bench" / "fastbackend.py")]
    for p in ports:
        argv += ["--port", str(p)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True), ports


def start_gateway(tree: Path, name: str, urls: list[str], workdir: Path,
                  env: dict[str, str] | None = None, workers: int = 1, python: str = PY,
                  extra: str = "", api_key: str | None = None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cfg = workdir / f"{name}.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   f"server: {{shutdown_grace_s: 1, drain_delay_s: 0}}\n"
                   f"routing: {{strategy: round-robin}}\n"
                   f"models:\n  - name: m\n    engine: vllm\n    endpoints: [{', '.join(urls)}]\n"
                   + (extra.rstrip("\n") + "\n" if extra else ""))
    with open(workdir / f"{name}.log", "wb") as err:
        p = subprocess.Popen([python, "-m", "gateway", "--config", str(cfg), "--workers", str(workers)], cwd=tree, stdout=subprocess.DEVNULL,
                             stderr=err, start_new_session=True, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", **(env or {})})
    wait_ready(name, p, port, 60, "m", api_key=api_key)
    return p, port


def run(scenario: str, port: int, pid: int | None, backend_ports: list[int], a: argparse.Namespace) -> tuple[float, float]:
    """(CPU µs per request or chunk, requests or streams per second) of one measured run; for
    ``paced1``, (CPU µs per chunk, TTFT p50 in ms). ``pid`` None: the backend reached directly;
    else the gateway's process, whose workers' CPU is counted with its own."""
    argv = [PY, str(REPO / "bench" / "loadgen.py"), "--port", str(port), "--model", "m"]
    if pid is not None:
        for p in (pid, *children_of(pid)):
            argv += ["--cpu-pid", f"target={p}"]
        if a.api_key:
            argv += ["--api-key", a.api_key]
    if scenario == "paced1":
        argv += ["--mode", "stream", "--concurrency", "1", "--max-tokens", "20", "--pace-ms", "5",
                 "--duration", f"{a.duration:g}", "--warmup", "0.5"]
    elif scenario == "ns32":
        argv += ["--mode", "nonstream", "--concurrency", "32", "--duration", f"{a.duration:g}", "--warmup", "0.5"]
    elif scenario == "st64":
        argv += ["--mode", "stream", "--concurrency", "64", "--max-tokens", "100", "--duration", f"{a.duration:g}",
                 "--warmup", "0.5"]
    else:
        argv += ["--mode", "fleet", "--streams", str(a.fleet_streams), "--max-tokens", str(a.fleet_chunks),
                 "--pace-ms", f"{a.fleet_interval * 1000:g}", "--ramp", f"{a.fleet_interval:g}", "--settle", "0.2"]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    r = orjson.loads(out.strip().splitlines()[-1])
    if r.get("errors"):         # a gateway that fails requests has no CPU figure worth reporting
        raise RuntimeError(f"{scenario}: {r['errors']} requests failed on port {port}: {r.get('error_samples')}")
    if scenario == "paced1":
        cpu = r["cpu_s"]["target"] / r["events"] * 1e6 if pid is not None else 0.0
        return cpu, r["ttft_p50_ms"]
    cpu = r["cpu_s"]["target"]
    if scenario == "ns32":
        return cpu / r["total_completed"] * 1e6, r["rps"]
    events = r["events"]
    return cpu / events * 1e6, r["rps"] if "rps" in r else r["completed"] / r["window_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="main", help="git ref of the tree compared with this checkout")
    ap.add_argument("--new", default=None, help="a directory to use instead of this checkout")
    ap.add_argument("--scenarios", default="ns32,fleet")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--fleet-streams", type=int, default=1000)
    ap.add_argument("--fleet-chunks", type=int, default=10)
    ap.add_argument("--fleet-interval", type=float, default=0.5)
    ap.add_argument("--api-key", default=None, help="sent by the load generator to both gateways (for a "
                    "--base-config/--new-config with tenants' keys); not to the backend reached directly")
    ap.add_argument("--workers", type=int, default=1, help="worker processes of each gateway (their CPU summed)")
    ap.add_argument("--base-python", default=PY, help="the interpreter that runs the base gateway (its "
                    "packages must import: a venv made with it from requirements.lock)")
    ap.add_argument("--new-python", default=PY, help="the same for the new one")
    ap.add_argument("--base-env", nargs="*", default=[], metavar="KEY=VALUE",
                    help="environment of the base gateway's process, e.g. PYTHONMALLOC=malloc")
    ap.add_argument("--new-env", nargs="*", default=[], metavar="KEY=VALUE", help="the same for the new one")
    ap.add_argument("--base-config", default="", metavar="YAML",
                    help="top-level config blocks added to the base gateway's config, e.g. 'view: {workers: false}' "
                         "(not listen, server, routing or models, which the benchmark writes)")
    ap.add_argument("--new-config", default="", metavar="YAML", help="the same for the new one")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        trees = {"base": export(a.base, work / "base"), "new": Path(a.new) if a.new else REPO}
        backend, backend_ports = start_backend()
        gws: dict[str, tuple[subprocess.Popen, int]] = {}
        try:
            wait_port(backend_ports[0], backend)
            urls = [f"http://127.0.0.1:{p}" for p in backend_ports]
            for name, tree in trees.items():
                env = dict(kv.split("=", 1) for kv in (a.base_env if name == "base" else a.new_env))
                gws[name] = start_gateway(tree, name, urls, work, env, a.workers,
                                          a.base_python if name == "base" else a.new_python,
                                          a.base_config if name == "base" else a.new_config, a.api_key)
            results: dict[str, dict[str, list[tuple[float, float]]]] = {}
            for sc in a.scenarios.split(","):
                results[sc] = {"base": [], "new": [], "direct": []}
                for i in range(a.rounds):
                    order = ("base", "new") if i % 2 == 0 else ("new", "base")
                    if sc == "paced1":      # TTFT is read against the backend reached directly
                        _, ttft = run(sc, backend_ports[0], None, backend_ports, a)
                        results[sc]["direct"].append((0.0, ttft))
                    for name in order:
                        proc, port = gws[name]
                        cpu, rate = run(sc, port, proc.pid, backend_ports, a)
                        results[sc][name].append((cpu, rate))
                        if sc == "paced1":
                            print(f"{sc} round {i + 1} {name}: {cpu:.1f} µs, TTFT p50 {rate:.3f} ms "
                                  f"(direct {ttft:.3f} ms)", file=sys.stderr, flush=True)
                        else:
                            print(f"{sc} round {i + 1} {name}: {cpu:.1f} µs, {rate:,.0f}/s", file=sys.stderr, flush=True)
            unit = {"ns32": "CPU per request", "st64": "CPU per chunk", "fleet": "CPU per chunk", "paced1": "CPU per chunk"}
            print(f"| scenario | base ({a.base}) | new | new / base |\n|---|---:|---:|---:|")
            for sc, r in results.items():
                if sc == "paced1":
                    d = [t for _, t in r["direct"]]
                    added = {name: [t - dt for (_, t), dt in zip(r[name], d, strict=True)] for name in ("base", "new")}
                    b, n = statistics.median(added["base"]), statistics.median(added["new"])
                    print(f"| paced1: TTFT p50 added over direct, median of {a.rounds} | {b:.3f} ms | {n:.3f} ms | "
                          f"{n - b:+.3f} ms |")
                    print(f"| paced1: ranges | {min(added['base']):.3f}-{max(added['base']):.3f} ms | "
                          f"{min(added['new']):.3f}-{max(added['new']):.3f} ms | |")
                    continue
                b = statistics.median(c for c, _ in r["base"])
                n = statistics.median(c for c, _ in r["new"])
                br = statistics.median(x for _, x in r["base"])
                nr = statistics.median(x for _, x in r["new"])
                print(f"| {sc}: {unit[sc]}, median of {a.rounds} | {b:.1f} µs | {n:.1f} µs | {n / b:.2f} |")
                print(f"| {sc}: per second | {br:,.0f} | {nr:,.0f} | {nr / br:.2f} |")
        finally:
            for proc, _ in gws.values():
                stop(proc)
            stop(backend)


if __name__ == "__main__":
    main()
