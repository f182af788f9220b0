"""Overload with mixed latency objectives (issue 25, "Done when"): two standard tenants offer
together about twice the fleet's capacity (``bench/resilience_flow.py``: 12 req/s each against about
12 in all), every request with a TTFT objective taken in turn from ``--slo-overload-objectives-ms``
(default 400, 1000, 2500 ms; every one feasible: an unloaded request's TTFT is about 40 ms). Three
runs on fresh fleets, in one command:

- **admission off** (the routing strategy alone, ``least-request`` by default): the objectives ride
  along in ``x-slo-ttft-ms`` but nothing acts on them;
- **admission on, no SLOs**: admission control as configured, the requests carry no objective (it is
  only measured by the client);
- **admission on, SLOs**: the same with ``x-slo-ttft-ms`` sent: earliest deadline first inside a
  user's line, shed at once (429 ``deadline``, ``Retry-After``) when the queue cannot meet it.

The figure is the share of the requests served whose objective was met ("attainment"), with how many
were served, met in all and shed. ``--slo-overload-strategy`` sets the routing strategy of every run
(``least-request`` or ``prefix-cache``); an SLO-aware strategy can be added as a fourth run.

    python -m bench.resilience --scenario slo-overload
"""

from __future__ import annotations

from bench.resilience import Harness
from bench.resilience_flow import Tenant, add_fleet_args, fleet_line, fmt, offer, settings, strip

PREFIX = "slo-overload"


def add_args(ap) -> None:
    g = ap.add_argument_group(PREFIX)
    add_fleet_args(g, PREFIX, duration=15.0, queue_timeout=5.0)
    g.add_argument("--slo-overload-rps", type=float, default=12.0, help="each of the two tenants' rate (default 12)")
    g.add_argument("--slo-overload-objectives-ms", default="400,1000,2500", help="TTFT objectives, taken in turn")
    g.add_argument("--slo-overload-strategy", default="least-request", help="routing strategy of every run")


def _objectives(run: dict, results) -> dict:
    served = [r for r in results if r.ok]
    met = [r for r in served if r.ttft is not None and r.slo_ms is not None and r.ttft * 1000 <= r.slo_ms]
    shed = [r for r in results if r.status == 429]
    return {"sent": len(results), "served": len(served), "met": len(met),
            "attainment": round(len(met) / len(served), 3) if served else None,
            "met_of_sent": round(len(met) / len(results), 3) if results else None,
            "shed": len(shed), "shed_deadline": sum(1 for r in shed if r.code == "deadline"),
            "shed_with_retry_after": sum(r.retry_after for r in shed),
            "5xx": sum(1 for r in results if r.status >= 500),
            "engine_queue_peak": run["engine_queue_peak"]}


async def run(h: Harness, args) -> dict:
    s = settings(args, PREFIX)
    slos = [float(x) for x in str(s["objectives_ms"]).split(",") if x.strip()]
    admission = {"enabled": True, "queue_max": s["queue_max"], "queue_timeout_s": s["queue_timeout_s"]}
    runs = {}
    for name, adm, send in (("admission off", None, True), ("admission on, no SLOs", admission, False),
                            ("admission on, SLOs", admission, True)):
        tenants = [Tenant(n, s["rps"], slo_ttft_ms=list(slos), send_slo=send) for n in ("u1", "u2")]
        out = await offer(h, s, name.replace(" ", "").replace(",", "-"), tenants, adm, s["strategy"])
        runs[name] = {**_objectives(out, out["results"]), "tenants": strip(out)["tenants"],
                      "slo_counts": out["slo_counts"]}
    return {"settings": s, "runs": runs}


def report(r: dict) -> str:
    s = r["settings"]
    lines = ["## Overload with mixed latency objectives", "",
             fleet_line(s).replace(f"queue_timeout_s: {s['queue_timeout_s']:g}}}`",
                                   f"queue_timeout_s: {s['queue_timeout_s']:g}}}` (in the runs with admission on)")
             + f" Two standard tenants at {s['rps']:g} req/s each; TTFT objectives {s['objectives_ms']} ms in turn; "
             f"routing `{s['strategy']}`.", "",
             "| run | sent | served | objective met | attainment (met / served) | met / sent | shed (429) | of which `deadline` | with Retry-After | 5xx | engine queue peak (each) | TTFT p99 (u1 / u2) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, x in r["runs"].items():
        p99 = " / ".join(fmt(t["ttft_p99_ms"]) for t in x["tenants"].values())
        att = f"{x['attainment']:.0%}" if x["attainment"] is not None else "—"
        lines.append(f"| {name} | {x['sent']} | {x['served']} | {x['met']} | **{att}** | {x['met_of_sent']:.0%} | "
                     f"{x['shed']} | {x['shed_deadline']} | {x['shed_with_retry_after']} | {x['5xx']} | "
                     f"{' / '.join(str(p) for p in x['engine_queue_peak'])} | {p99} |")
    return "\n".join(lines)
