"""Engine death: one engine is killed (SIGKILL) under a closed-loop streaming load and started again
on the same port, behind a gateway at its defaults (``server.workers: auto``: a worker per CPU,
sharing health probes and breakers over the local bus).

Cases (``--death-cases``, each ``fleet:victim``): ``aggregated:engine`` (three vLLM engines, one
killed), and for P/D (two prefill and two decode engines in one roleset) ``vllm-pd:prefill``,
``vllm-pd:decode``, ``sglang-pd:prefill``, ``sglang-pd:decode``. The load runs ``--death-seconds``
(32); the victim dies at a quarter of it and is started again at half of it, so that the second
half shows it coming back (its breaker's ejection, 10 s at the defaults, or the probes finding it
up again, whichever comes first).

Reported per case: the requests, those that failed, split into the ones in flight when the engine
died (started before the kill, ended after it: their engine took their stream with it, unless a
retry could take the request elsewhere before its client saw anything) and the others (which no
engine death should cost), the requests retried, and whether and how soon after it listened again
the victim answered a request.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from typing import Any

from bench.resilience import Answer, summarize
from bench.soak import free_port

NAME = "engine-death"
SIM = ["--ttft-base-ms", "5", "--prefill-ms-per-token", "0.05", "--itl-ms", "5"]
CASES = ("aggregated:engine", "vllm-pd:prefill", "vllm-pd:decode", "sglang-pd:prefill", "sglang-pd:decode")


def add_args(ap) -> None:
    g = ap.add_argument_group("engine-death")
    g.add_argument("--death-cases", default=",".join(CASES), help=f"comma-separated fleet:victim (default {','.join(CASES)})")
    g.add_argument("--death-clients", type=int, default=48, help="concurrent streaming clients (default 48)")
    g.add_argument("--death-seconds", type=float, default=32.0, help="load duration per case (default 32)")
    g.add_argument("--death-tokens", type=int, default=24, help="tokens per stream (default 24)")


class _Fleet:
    """The engines of one case: started, killed and started again by name, on fixed ports."""

    def __init__(self, h, case: str) -> None:
        self.h, self.case = h, case
        self.argv: dict[str, list[str]] = {}
        self.procs: dict[str, Any] = {}
        self.urls: dict[str, str] = {}

    async def start(self, name: str, engine: str, role: str) -> str:
        port = free_port()
        argv = [sys.executable, "-m", "enginesim", "--engine", engine, "--role", role, "--host", "127.0.0.1",
                "--port", str(port), "--model", "m", *SIM]
        if role != "aggregated":        # each engine its own KV side channel / bootstrap port
            argv += ["--side-channel-port", str(free_port())]
            if engine == "sglang" and role == "prefill":
                argv += ["--bootstrap-port", str(free_port())]
        self.argv[name], self.urls[name] = argv, f"http://127.0.0.1:{port}"
        await self._launch(name)
        return self.urls[name]

    async def _launch(self, name: str) -> None:
        from bench.soak import wait_http
        p = self.procs[name] = self.h.procs.start(f"{self.case}-{name}", self.argv[name])
        if not await wait_http(self.h.session, self.urls[name] + "/health", p, 30):
            raise RuntimeError(f"engine {name} did not start")

    def kill(self, name: str) -> None:
        p = self.procs[name]
        p.send_signal(signal.SIGKILL)
        p.wait()
        self.h.procs.stop(p)

    async def restart(self, name: str) -> None:
        await self._launch(name)

    def bootstrap(self, name: str) -> int:
        return int(self.argv[name][self.argv[name].index("--bootstrap-port") + 1])


async def _case(h, case: str, args) -> dict[str, Any]:
    fleet_kind, victim_role = case.split(":")
    fleet = _Fleet(h, fleet_kind.replace(":", "-"))
    if fleet_kind == "aggregated":
        urls = [await fleet.start(f"e{i}", "vllm", "aggregated") for i in range(3)]
        victim = "e0"
        model = {"name": "m", "engine": "vllm", "endpoints": urls}
    else:
        engine = fleet_kind.removesuffix("-pd")
        pre = [await fleet.start(f"p{i}", engine, "prefill") for i in range(2)]
        dec = [await fleet.start(f"d{i}", engine, "decode") for i in range(2)]
        victim = "p0" if victim_role == "prefill" else "d0"
        prefill = [{"url": u, "bootstrap_port": fleet.bootstrap(f"p{i}")} for i, u in enumerate(pre)] \
            if engine == "sglang" else pre
        model = {"name": "m", "engine": engine, "rolesets": [{"name": "rs", "prefill": prefill, "decode": dec}]}
    gw, gw_p = await h.gateway(f"{case.replace(':', '-')}-gw", {"models": [model]})
    victim_name = fleet.urls[victim].removeprefix("http://")
    answers: list[Answer] = []
    stop = asyncio.Event()

    async def client() -> None:
        while not stop.is_set():
            answers.append(await h.chat(gw, max_tokens=args.death_tokens))

    clients = [asyncio.create_task(client()) for _ in range(args.death_clients)]
    quarter = args.death_seconds / 4
    await asyncio.sleep(quarter)
    fleet.kill(victim)
    killed = time.perf_counter()
    await asyncio.sleep(quarter)
    await fleet.restart(victim)
    back = time.perf_counter()
    await asyncio.sleep(2 * quarter)
    stop.set()
    await asyncio.gather(*clients)
    h.stop(gw_p)
    for p in list(fleet.procs.values()):
        h.stop(p)

    def in_flight_at_kill(a: Answer) -> bool:
        return a.started < killed < a.started + a.latency

    failed = [a for a in answers if not a.ok]
    again = [a.started + a.latency - back for a in answers
             if a.ok and a.started > back and victim_name in (a.endpoint, a.prefill)]
    before = [a for a in answers if a.started + a.latency < killed]
    share = sum(1 for a in before if victim_name in (a.endpoint, a.prefill)) / max(1, len(before))
    s = summarize(answers)
    other = [a for a in failed if not in_flight_at_kill(a)]
    return {"victim": f"{victim_role} ({victim_name})", "requests": s["requests"],
            "other_failures": [{"sent_s": round(a.started - killed, 3), "ended_s": round(a.started + a.latency - killed, 3),
                                "status": a.status, "error": a.error, "endpoint": a.endpoint, "prefill": a.prefill}
                               for a in other][:10],
            "failed_in_flight_at_kill": sum(1 for a in failed if in_flight_at_kill(a)),
            "failed_other": sum(1 for a in failed if not in_flight_at_kill(a)),
            "in_flight_at_kill": sum(1 for a in answers if in_flight_at_kill(a)),
            "victim_share_before": round(share, 3),
            "retried": s["retried"], "errors": s["errors"],
            "victim_served_again_s": round(min(again), 3) if again else None}


async def run(h, args) -> dict[str, Any]:
    out: dict[str, Any] = {"clients": args.death_clients, "seconds": args.death_seconds,
                           "tokens": args.death_tokens, "cases": {}}
    for case in [c.strip() for c in args.death_cases.split(",") if c.strip()]:
        print(f"#   {case}", file=sys.stderr, flush=True)
        out["cases"][case] = await _case(h, case, args)
    return out


def report(r: dict[str, Any]) -> str:
    lines = [f"## Engine death ({r['clients']} streaming clients, {r['tokens']} tokens each, "
             f"{r['seconds']:g} s per case; the gateway at its defaults)", "",
             "| case | killed | its share before | requests | in flight at the kill | of those failed | "
             "other failures | retried | served again after restart |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for case, c in r["cases"].items():
        again = "no" if c["victim_served_again_s"] is None else f"{c['victim_served_again_s']:.2f} s"
        lines.append(f"| {case.split(':')[0]} | {c['victim']} | {c['victim_share_before']:.0%} | {c['requests']} | "
                     f"{c['in_flight_at_kill']} | "
                     f"{c['failed_in_flight_at_kill']} | {c['failed_other']} | {c['retried']} | {again} |")
    lines += ["", "A failure in flight at the kill is a stream whose engine died under it after its client "
              "saw its first bytes (or, for P/D, whose decode could no longer read the dead prefill's KV). "
              "\"Served again\": the end of the first answer the victim gave after it listened again "
              "(its breaker, opened by the refused connections, lets trials through once the probes see "
              "it up; the default probe interval is 5 s)."]
    return "\n".join(lines)
