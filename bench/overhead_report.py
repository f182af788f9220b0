"""The overhead benchmark's Markdown report and its goal check (``bench/overhead.py`` collects the data).

Everything here reads the report dict only, so a saved ``overhead-<stamp>.json`` can be rendered
again: ``python bench/overhead_report.py bench/out/overhead-latest.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

MB = 1024 * 1024


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


RATIO_FIGURES = [
    # key, label, better
    ("rps", "req/s (streams/s)", "higher"),
    ("lat_p50_ms", "p50 latency", "lower"),
    ("lat_p99_ms", "p99 latency", "lower"),
    ("ttft_p50_ms", "p50 TTFT", "lower"),
    ("ttft_p99_ms", "p99 TTFT", "lower"),
    ("target_cpu_us_per_req", "CPU per request", "lower"),
]


def agg_targets(report: dict) -> list[dict]:
    """The targets of the aggregated stack (load and idle scenarios)."""
    return [t for t in report["targets"] if t.get("stack", "agg") == "agg"]


def stack_targets(report: dict, stack: str) -> list[dict]:
    return [t for t in report["targets"] if t.get("stack") == stack]


def render(report: dict) -> str:
    L: list[str] = []
    _header(report, L)
    kinds = {sc["mode"] for sc in report["scenarios"]}
    if kinds & {"nonstream", "stream"}:
        _load_tables(report, L)
        _variant_table(report, L)
    if "pd" in kinds:
        _pd_tables(report, L)
    if "fleet" in kinds:
        _fleet_table(report, L)
    if "idle" in kinds or agg_targets(report):
        _memory_tables(report, L)
    L.append("### Targets of the open issues (Switchyard at its defaults)")
    L.append("")
    L.append("Issue 24 asks for non-streaming throughput at concurrency 32 at least vllm-router's; issue 27 "
             "for the latency added to a lone stream, the P/D orchestrator's and the CPU per relayed chunk "
             "and per request, each against the same run's figures.")
    L.append("")
    L.append("| issue | target | measured | goal | met |")
    L.append("|---|---|---:|---|---|")
    for row in report.get("open_targets") or open_targets(report):
        met = {True: "yes", False: "**no**", None: "n/a"}[row["met"]]
        L.append(f"| {row['issue']} | {row['what']} | {row['measured']} | {row['goal']} | {met} |")
    L.append("")
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
             f"Linux {m['kernel']}, Python {m['python']}"
             + (f" ({m['python_build']})" if m.get("python_build") else "") + ". Load average before/after: "
             f"{report['loadavg_before']} / {report['loadavg_after']}.")
    L.append("Backend, target and load generator share the cores (nothing pinned); the backend is "
             "`bench/fastbackend.py` (pre-encoded answers, ~10 µs of CPU per request). CPU per request: "
             "the target process's CPU time over the measured window (sum of its threads' "
             "`/proc/PID/task/*/schedstat`; `/proc/PID/stat` utime+stime, 10 ms ticks, is in the JSON "
             "as a cross-check) divided by the requests completed in it.")
    L.append("Load generator: `bench/loadgen.py`, one process per measurement on the same cores: uvloop, "
             "raw asyncio `Protocol` clients, one keep-alive connection per concurrent request (one "
             "connection per stream in `fleet`), latency from the write of the request to the last byte.")
    seen: dict[str, str] = {}
    for t in report["targets"]:
        seen.setdefault(t["name"], t["version"])
    tv = ", ".join(f"{n} {v}".strip() for n, v in seen.items())
    L.append(f"Targets: {tv}." + (f" Absent: {'; '.join(report['absent'])}." if report["absent"] else ""))
    pr = report["params"]
    pd = pr.get("pd", {})
    L.append(f"Rounds: {pr['rounds']} × {pr['duration']:g} s per load scenario and target, "
             + (f"{pd['rounds']} × {pd['duration']:g} s per P/D scenario, " if pd else "")
             + f"after {pr['warmup']:g} s warm-up each, targets interleaved. "
             f"Total time {report['elapsed_s']:.0f} s.")
    L.append("Scenarios: " + "; ".join(f"`{s['name']}` {s['title']}" for s in report["scenarios"]) + ".")
    for note in report["notes"]:
        L.append(f"Note: {note}")
    L.append("")
    _columns(report, L)


def _columns(report: dict, L: list[str]) -> None:
    L.append("### Columns")
    L.append("")
    L.append("| column | what runs | log level | log format | processes | stderr | request log written |")
    L.append("|---|---|---|---|---|---|---|")
    logs: dict[str, dict[str, int]] = {}
    for t in report["targets"]:   # one column may run in several stacks: its logs summed
        total = logs.setdefault(t["name"], {})
        for k, v in (t.get("log") or {}).items():
            total[k] = total.get(k, 0) + v
    done: set[str] = set()
    for t in report["targets"]:
        if t["name"] in done:
            continue
        done.add(t["name"])
        a = t.get("about", {})
        log = logs[t["name"]]
        if log.get("requests"):
            written = (f"{log['bytes'] / log['requests']:.0f} B, {log['lines'] / log['requests']:.2f} lines "
                       f"per request ({log['bytes'] / MB:.1f} MB)")
        else:
            written = "—"
        L.append(f"| {t['name']} | {a.get('what', '')} | {a.get('log_level', '—')} | {a.get('log_format', '—')} | "
                 f"{a.get('processes', '—')} | {a.get('stderr', '—')} | {written} |")
    L.append("")
    L.append("Switchyard's config is its defaults except `listen`, `models`, `routing.strategy: round-robin` "
             "(what the Rust routers run; the P/D models use `pd`), `server.shutdown_grace_s: 1` and "
             "`server.drain_delay_s: 0` (a quick stop), and the column's one setting. Every gateway's stderr "
             "goes to a file on disk, as a container runtime's log driver writes a container's output; "
             "/dev/null would make logging look cheaper than it is where users run it. Request log written: "
             "the growth of the column's stderr files over its scenarios divided by the requests it served, "
             "warm-ups included.")
    L.append("")
    if any(t["name"] == "litellm" for t in report["targets"]):
        L.append("LiteLLM's config is a `model_list` with one entry per endpoint under the one model name "
                 "(`model: openai/<name>`, `api_base: <endpoint>/v1`, `api_key: x`), which its router balances "
                 "(its default strategy, simple-shuffle: random, where the Rust routers run round-robin), and "
                 "`general_settings.dangerously_permit_weak_or_unset_master_key: true` (no master key, hence no "
                 "auth, as for the other targets; it refuses to start without a key otherwise); started with "
                 "`LITELLM_LOCAL_MODEL_COST_MAP=True` (its model cost map from the package instead of fetched "
                 "from GitHub at start-up). Everything else at its defaults: one worker, no database, no "
                 "callbacks, usage telemetry off.")
        L.append("")


def _load_tables(report: dict, L: list[str]) -> None:
    names = [t["name"] for t in agg_targets(report)]
    peers = [t["name"] for t in agg_targets(report) if t.get("kind") == "peer"]
    others = ["direct", *peers] if "direct" in names else peers   # the variants have their own table
    res = report["results"]
    load_scs = [sc for sc in report["scenarios"] if sc["mode"] in ("nonstream", "stream")]
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
    for sc in load_scs:
        for c in _capped(report, sc["name"]):
            L.append(f"{c['target']} ran `{sc['name']}` at {c['streams']:,} concurrent streams, not {c['of']:,} "
                     f"(`{c['option']}`), after {c.get('warmup_s', 0):g} s of warm-up with a {c.get('window_s', 0):g} s "
                     f"window: at {c['of']:,} one stream takes it longer than the window. Its streams/s is what its "
                     "CPU allows at either concurrency; its latency and TTFT are at the lower concurrency.")
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


def _variant_table(report: dict, L: list[str]) -> None:
    sys_ = [t for t in agg_targets(report) if t.get("variant")]
    if len(sys_) < 2:
        return
    res = report["results"]
    names = [t["name"] for t in sys_]
    L.append("### What Switchyard's settings cost")
    L.append("")
    L.append("The same gateway at its defaults and with one setting changed (see Columns).")
    L.append("")
    L.append("| scenario | figure | " + " | ".join(names) + " |")
    L.append("|---|---|" + "---:|" * len(names))
    for sc in report["scenarios"]:
        if sc["mode"] not in ("nonstream", "stream"):
            continue
        r = res.get(sc["name"], {})
        rows = [("rps", "req/s", 1), ("target_cpu_us_per_req", "CPU µs/req", 1),
                ("ttft_p50_ms" if sc["mode"] == "stream" else "lat_p50_ms",
                 "TTFT p50 ms" if sc["mode"] == "stream" else "p50 ms", 3)]
        for key, label, digits in rows:
            L.append(f"| {sc['name']} | {label} | " + " | ".join(fmt(r.get(n, {}).get(key), digits) for n in names) + " |")
    L.append("")
    base = names[0] if names[0] == "switchyard" else None
    if base:
        L.append("Relative to `switchyard` (its defaults): "
                 + "; ".join(f"`{n}` {_rel_cpu(res, report, base, n)}" for n in names[1:]) + ".")
        L.append("")


def _rel_cpu(res: dict, report: dict, base: str, other: str) -> str:
    parts = []
    for sc in report["scenarios"]:
        if sc["mode"] not in ("nonstream", "stream"):
            continue
        a = res.get(sc["name"], {}).get(other, {}).get("target_cpu_us_per_req")
        b = res.get(sc["name"], {}).get(base, {}).get("target_cpu_us_per_req")
        if a is not None and b:
            parts.append(f"{sc['name']} {a / b:.2f}×")
    return ("CPU per request " + ", ".join(parts)) if parts else "—"


def _pd_tables(report: dict, L: list[str]) -> None:
    res = report["results"]
    scs = [sc for sc in report["scenarios"] if sc["mode"] == "pd"]
    p = report.get("params", {}).get("pd", {})
    L.append("### Prefill/decode: TTFT added by the orchestrator")
    L.append("")
    if p:
        L.append(f"Mock engines (`bench/pdbackend.py`): prefill {p.get('prefill_ms'):g} ms, KV transfer "
                 f"{p.get('transfer_ms'):g} ms, a token every {p.get('token_ms'):g} ms, {p.get('tokens')} tokens "
                 "per stream, streamed, keep-alive. `direct` is the load generator orchestrating the two legs "
                 "itself (vLLM: prefill, then decode with its `kv_transfer_params`; SGLang: both at once with "
                 "one bootstrap room); +TTFT is a target's percentile minus direct's. The wire column counts, at "
                 "the mock, the decodes that got the KV hand-over (vLLM) or met their prefill by bootstrap "
                 "room (SGLang).")
        L.append("")
    L.append("| scenario | target | streams | TTFT p50 ms | TTFT p99 ms | +TTFT p50 | +TTFT p99 | "
             "latency p50 ms | target CPU µs/stream | P/D on the wire | errors |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    skipped = report.get("skipped", [])
    for sc in scs:
        r = res.get(sc["name"], {})
        d = r.get("direct", {})
        for n, a in r.items():
            if "completed" not in a:
                L.append(f"| {sc['name']} | {n} | failed: {'; '.join(a.get('failed_rounds', []))[:80]} "
                         "| | | | | | | | |")
                continue

            def diff(k, a=a, d=d, n=n):
                return None if n == "direct" or a.get(k) is None or d.get(k) is None else a[k] - d[k]
            L.append(f"| {sc['name']} | {n} | {a['completed']} | {fmt(a.get('ttft_p50_ms'), 2)} | "
                     f"{fmt(a.get('ttft_p99_ms'), 2)} | {fmt(diff('ttft_p50_ms'), 2)} | {fmt(diff('ttft_p99_ms'), 2)} | "
                     f"{fmt(a.get('lat_p50_ms'), 1)} | {fmt(a.get('target_cpu_us_per_req'), 0)} | "
                     f"{_wire(sc, a.get('wire'))} | {a['errors']} |")
        for s in skipped:   # a peer that has no P/D mode for this engine: a row that says so
            if s.get("kind") == "pd" and sc["name"] in s.get("scenarios", "").split(", ") and s["target"] not in r:
                L.append(f"| {sc['name']} | {s['target']} | n/a{': ' + s['short'] if s.get('short') else ''} "
                         "| | | | | | | | |")
    L.append("")
    for s in skipped:
        if s.get("kind") == "pd":
            L.append(f"- {s['target']} skipped in {s['scenarios']}: {s['why']}")
    if any(s.get("kind") == "pd" for s in skipped):
        L.append("")


def _wire(sc: dict, w: dict | None) -> str:
    if not w:
        return "—"
    decodes = w.get("decode", 0)
    if sc.get("engine") == "vllm":
        ok = w.get("decode_kv", 0)
        out = f"{ok}/{decodes} with KV"
        if w.get("decode_recompute"):
            out += f", {w['decode_recompute']} recomputed"
    else:
        ok = w.get("rooms_matched", 0)
        out = f"{ok}/{decodes} met by room"
        waits = w.get("prefill_wait_timeouts", 0) + w.get("decode_wait_timeouts", 0)
        if waits:
            out += f", {waits} waits timed out"
    if w.get("bad"):
        out += f", {w['bad']} refused"
    if w.get("aborts"):
        out += f", {w['aborts']} aborts"
    return out


def _fleet_table(report: dict, L: list[str]) -> None:
    res = report["results"]
    for sc in (s for s in report["scenarios"] if s["mode"] == "fleet"):
        r = res.get(sc["name"], {})
        L.append(f"### Many paced streams: {sc['title']}")
        L.append("")
        L.append(f"Each stream on its own connection, the {sc['streams']:,} started evenly over "
                 f"{sc.get('ramp_s', sc['interval_s']):g} s; the window runs from the first connect to the end of the last stream. "
                 "Chunks relayed: SSE events the clients received (tokens, the usage event, `[DONE]`). "
                 "RSS: before the first connect, the peak (sampled every 0.25 s), and 0.5 s after the last "
                 "stream closed; for direct, the backend's. Gap: time between successive chunk arrivals of a "
                 f"stream (the backend sends one every {sc['interval_s']:g} s).")
        L.append("")
        L.append("| target | streams ok | errors | window s | target CPU s | CPU µs/chunk | RSS before MB | "
                 "peak MB | growth MB | after MB | TTFT p50/p99 ms | gap p50/p99/max ms | backend CPU s | "
                 "streams per endpoint |")
        L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---|")
        for n, a in r.items():
            if "completed" not in a:
                L.append(f"| {n} | failed: {a.get('failed', '')[:100]} |" + " |" * 12)
                continue
            who = "target" if a.get("cpu_s", {}).get("target") is not None else "backend"
            cpu = a.get("cpu_s", {}).get("target")
            rss0, peak, rss1 = (a.get(k, {}).get(who) for k in ("rss_before", "rss_peak", "rss_after"))
            grow = None if rss0 is None or peak is None or rss0 < 0 or peak < 0 else (peak - rss0) / MB
            per_chunk = _per_chunk(a)
            spread = a.get("by_port")
            L.append(f"| {n} | {a['completed']:,} | {a['errors']} | {fmt(a.get('window_s'), 1)} | {fmt(cpu, 2)} | "
                     f"{fmt(per_chunk, 1)} | {fmt(_div(rss0, MB), 1)} | {fmt(_div(peak, MB), 1)} | {fmt(grow, 1)} | "
                     f"{fmt(_div(rss1, MB), 1)} | {fmt(a.get('ttft_p50_ms'), 1)} / {fmt(a.get('ttft_p99_ms'), 1)} | "
                     f"{fmt(a.get('gap_p50_ms'), 1)} / {fmt(a.get('gap_p99_ms'), 1)} / {fmt(a.get('gap_max_ms'), 1)} | "
                     f"{fmt(a.get('cpu_s', {}).get('backend'), 2)} | "
                     f"{' / '.join(str(v) for v in spread) if spread else '—'} |")
        L.append("")
        for c in _capped(report, sc["name"]):
            L.append(f"- {c['target']} ran {c['streams']:,} of the {c['of']:,} streams (`{c['option']}`; the whole burst "
                     "would saturate it and run the scenario far past its window): the same ramp and chunk "
                     "interval, so its CPU per relayed chunk and its gaps compare; its CPU seconds, RSS growth "
                     "and TTFT are for the smaller burst.")
        for s in report.get("skipped", []):
            if s.get("kind") == "fleet":
                L.append(f"- {s['target']} skipped: {s['why']}")
        L.append("")


def _memory_tables(report: dict, L: list[str]) -> None:
    targets = [t for t in agg_targets(report) if not t.get("variant") or t["variant"] == "default"]
    names = [t["name"] for t in targets]
    peers = [t["name"] for t in targets if t.get("kind") == "peer"]
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
    L.append(head + " RSS after the whole run MB | PSS after the whole run MB |")
    L.append(sep + "---:|---:|")
    for t in targets:
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
        pss = t["rss"].get("end_pss")
        L.append(row + f" {fmt(_div(t['rss'].get('end'), mb), 1)} | {fmt(_div(pss, mb), 1)} |")
    L.append("")
    L.append("RSS of several processes (a parent and its workers) is their sum, which counts the pages "
             "they share after the fork once per process; PSS counts each shared page as each process's share, "
             "so its sum is what they hold together. "
             "Direct's row is the fast backend's own memory (a reference, not a gateway). "
             "KB/stream = (RSS held − RSS before) / streams held; a gateway holds two sockets per stream. "
             "After close: once the clients left and the backend ended any stream still open.")
    for s in idle_scs:
        for c in _capped(report, s["name"]):
            L.append(f"{c['target']} held {c['streams']:,} of the {c['of']:,} streams in `{s['name']}` "
                     f"(`{c['option']}`): opening each costs it about as much CPU as a whole request.")
    L.append("")
    mem_pairs = [("switchyard", p) for p in peers] if "switchyard" in names else []
    if mem_pairs:
        tby = {t["name"]: t for t in targets}
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
                 f"go; polled for up to {report['params'].get('upstream_wait_s', 2.0):g} s):")
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


def _capped(report: dict, scenario: str) -> list[dict]:
    """The targets that ran fewer streams than the scenario's in it (LiteLLM, bench/overhead.py's caps)."""
    return [c for c in report.get("capped", []) if c.get("scenario") == scenario]


def _div(a, b):
    return None if a is None or a < 0 else a / b


def _per_chunk(a: dict) -> float | None:
    """CPU µs per relayed chunk of one target in the many-paced-streams scenario."""
    cpu = a.get("cpu_s", {}).get("target")
    return None if cpu is None or not a.get("events") else cpu / a["events"] * 1e6


def open_targets(report: dict) -> list[dict]:
    """The "done when" figures of the open issues 24 and 27, from one run: each measured against
    the same run's vllm-router or direct figures (None when the run lacks them)."""
    res = report["results"]
    out = []

    def g(scn, tgt, key):
        return res.get(scn, {}).get(tgt, {}).get(key)

    def add(issue, what, value, goal, ok, unit):
        out.append({"issue": issue, "what": what, "measured": "—" if value is None else f"{value:.3g}{unit}",
                    "goal": goal, "met": None if value is None else bool(ok(value)), "value": value})

    def added(scn, tgt):
        a, d = g(scn, tgt, "ttft_p50_ms"), g(scn, "direct", "ttft_p50_ms")
        return None if a is None or d is None else a - d

    add(24, "non-streaming c=32 req/s / vllm-router's", ratio(g("ns32", "switchyard", "rps"), g("ns32", "vllm-router", "rps")),
        "≥ 1.0×", lambda v: v >= 1.0, "×")
    sy, vr = added("paced1", "switchyard"), added("paced1", "vllm-router")
    add(27, "paced-stream TTFT added p50, minus vllm-router's", None if sy is None or vr is None else sy - vr,
        "≤ +0.15 ms", lambda v: v <= 0.15, " ms")
    for sc in report["scenarios"]:
        if sc["mode"] == "pd":
            add(27, f"P/D TTFT added p50, {sc['name']}", added(sc["name"], "switchyard"), "≤ 0.3 ms",
                lambda v: v <= 0.3, " ms")
    fleet = next((sc["name"] for sc in report["scenarios"] if sc["mode"] == "fleet"), None)
    if fleet is not None:
        sy_c, vr_c = (_per_chunk(res.get(fleet, {}).get(t, {})) for t in ("switchyard", "vllm-router"))
        add(27, f"CPU per relayed chunk ({fleet}) / vllm-router's", ratio(sy_c, vr_c), "≤ 1.0×", lambda v: v <= 1.0, "×")
    add(27, "CPU per request (ns32) / vllm-router's", ratio(g("ns32", "switchyard", "target_cpu_us_per_req"),
                                                          g("ns32", "vllm-router", "target_cpu_us_per_req")),
        "≤ 1.5×", lambda v: v <= 1.5, "×")
    return out


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
    sy = next((t for t in agg_targets(report) if t["name"] == "switchyard"), None)
    end = sy["rss"].get("end") if sy else None
    add("RSS after the whole run", None if end is None or end < 0 else end / 1048576, "≤ 120 MB",
        lambda v: v <= 120, " MB")
    idle = [sc for sc in report["scenarios"] if sc["mode"] == "idle"]
    big = max(idle, key=lambda sc: sc["idle_n"]) if idle else None
    per = res.get(big["name"], {}).get("switchyard", {}).get("bytes_per_stream") if big else None
    add(f"memory per idle stream, {big['idle_n']:,} held" if big else "memory per idle stream, 10,000 held",
        None if per is None else per / 1024, "< 40 KB (10,000 held)", lambda v: v < 40, " KB")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/overhead_report.py",
                                description="Render a saved overhead report (bench/overhead.py's JSON) as "
                                            "Markdown, with its goal checks, on stdout.")
    p.add_argument("report", metavar="REPORT", type=Path,
                   help="a report bench/overhead.py saved, such as bench/out/overhead-latest.json")
    args = p.parse_args(argv)
    if not args.report.is_file():
        p.error(f"{args.report}: no such file")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(render(orjson.loads(args.report.read_bytes())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
