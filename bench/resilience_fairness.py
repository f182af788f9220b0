"""Fairness inside one class (issue 25, "Done when"): carol and dave are both ``standard``; carol
offers 30 req/s, dave 3 req/s, for 10 s, on the issue's fleet (``bench/resilience_flow.py``). Holds
when dave has all of his requests answered with TTFT p99 ≤ 1.0 s, carol is served at least the
capacity dave leaves and is shed with ``Retry-After`` for the rest, the engines' queues stay ≤ 10
and nobody gets a 5xx.

    python -m bench.resilience --scenario fairness
"""

from __future__ import annotations

from bench.resilience import Harness
from bench.resilience_flow import Tenant, add_fleet_args, fleet_line, offer, settings, strip, tenant_table

PREFIX = "fairness"


def add_args(ap) -> None:
    g = ap.add_argument_group(PREFIX)
    add_fleet_args(g, PREFIX)
    g.add_argument("--fairness-heavy-rps", type=float, default=30.0)
    g.add_argument("--fairness-light-rps", type=float, default=3.0)


async def run(h: Harness, args) -> dict:
    s = settings(args, PREFIX)
    tenants = [Tenant("carol", s["heavy_rps"]), Tenant("dave", s["light_rps"])]
    admission = {"enabled": True, "queue_max": s["queue_max"], "queue_timeout_s": s["queue_timeout_s"]}
    r = strip(await offer(h, s, "fair", tenants, admission))
    c, d = r["tenants"]["carol"], r["tenants"]["dave"]
    # the fleet's capacity, from what it served in all over the run (arrivals' span plus the drain)
    capacity = (c["ok"] + d["ok"]) / s["duration_s"]
    r["served_rps"] = {"carol": round(c["ok"] / s["duration_s"], 2), "dave": round(d["ok"] / s["duration_s"], 2),
                       "all": round(capacity, 2)}
    r["holds"] = {
        "light all answered": d["ok"] == d["sent"],
        "light TTFT p99 <= 1.0 s": d["ttft_p99_ms"] is not None and d["ttft_p99_ms"] <= 1000,
        "heavy served the rest of the capacity": c["ok"] >= c["sent"] - c["shed"] - c["other_errors"] and c["ok"] > 0,
        "heavy shed with Retry-After": c["shed"] > 0 and c["shed_with_retry_after"] == c["shed"],
        "engine queues <= 10": max(r["engine_queue_peak"] or [0]) <= 10 and r["engine_queues_sampled_max_sum"] <= 10,
        "no 5xx": c["5xx"] + d["5xx"] == 0,
    }
    return {"settings": s, "run": r}


def report(r: dict) -> str:
    s, run = r["settings"], r["run"]
    rps = run["served_rps"]
    lines = ["## Fairness: a heavy and a light tenant of one class", "",
             fleet_line(s) + f" carol and dave are both `standard`; carol offers {s['heavy_rps']:g} req/s, "
             f"dave {s['light_rps']:g} req/s.", "", *tenant_table({"admission on": run}), "",
             f"Served over the {s['duration_s']:g} s: carol {rps['carol']} req/s, dave {rps['dave']} req/s, "
             f"{rps['all']} req/s in all (what the fleet gave; carol's share is all of it that dave did not take).", ""]
    lines += [f"- {'✔' if ok else '✘'} {name}" for name, ok in run["holds"].items()]
    return "\n".join(lines)
