"""Priorities (issue 25, "Done when"): alice is ``critical`` at 5 req/s, bob ``sheddable`` at 30 req/s,
for 10 s, on the issue's fleet (``bench/resilience_flow.py``). Holds when alice has 50 of 50 answered
with TTFT p99 ≤ 1.0 s, the engines' queues stay ≤ 10, nobody gets a 5xx and bob is shed with
``Retry-After``.

    python -m bench.resilience --scenario priorities
"""

from __future__ import annotations

from bench.resilience import Harness
from bench.resilience_flow import Tenant, add_fleet_args, fleet_line, offer, settings, strip, tenant_table

PREFIX = "priorities"


def add_args(ap) -> None:
    g = ap.add_argument_group(PREFIX)
    add_fleet_args(g, PREFIX)
    g.add_argument("--priorities-critical-rps", type=float, default=5.0)
    g.add_argument("--priorities-sheddable-rps", type=float, default=30.0)


async def run(h: Harness, args) -> dict:
    s = settings(args, PREFIX)
    tenants = [Tenant("alice", s["critical_rps"], "critical"), Tenant("bob", s["sheddable_rps"], "sheddable")]
    admission = {"enabled": True, "queue_max": s["queue_max"], "queue_timeout_s": s["queue_timeout_s"]}
    r = strip(await offer(h, s, "prio", tenants, admission))
    a, b = r["tenants"]["alice"], r["tenants"]["bob"]
    r["holds"] = {
        "critical all answered": a["ok"] == a["sent"],
        "critical TTFT p99 <= 1.0 s": a["ttft_p99_ms"] is not None and a["ttft_p99_ms"] <= 1000,
        "engine queues <= 10": max(r["engine_queue_peak"] or [0]) <= 10 and r["engine_queues_sampled_max_sum"] <= 10,
        "no 5xx": a["5xx"] + b["5xx"] == 0,
        "sheddable shed with Retry-After": b["shed"] > 0 and b["shed_with_retry_after"] == b["shed"],
    }
    return {"settings": s, "run": r}


def report(r: dict) -> str:
    s, run = r["settings"], r["run"]
    lines = ["## Priorities: a critical tenant beside a sheddable flood", "",
             fleet_line(s) + f" alice is `critical` at {s['critical_rps']:g} req/s, bob `sheddable` at "
             f"{s['sheddable_rps']:g} req/s.", "", *tenant_table({"admission on": run}), "",
             "Engine queue peak: each engine's exact peak (`/_sim/state`); sampled max: of the two engines' "
             "`vllm:num_requests_waiting` summed, every 100 ms.", ""]
    lines += [f"- {'✔' if ok else '✘'} {name}" for name, ok in run["holds"].items()]
    return "\n".join(lines)
