"""Writes the Grafana dashboards the chart ships (charts/switchyard/dashboards/*.json).

    python charts/build_dashboards.py            # rewrite the JSON files
    python charts/build_dashboards.py --check    # exit 1 if the files differ from this script

The JSON is generated so that panels stay laid out on Grafana's 24-column grid, ids and refIds
are unique, and every query uses the same selectors; edit this file, not the JSON
(tests/integration/observability/test_dashboards.py fails when they disagree, and checks every query's metric
names against a live gateway's /metrics).

Conventions: every query filters on the dashboard's ``$job`` (the Prometheus job(s) scraping the
gateway) and, where the metric has a model, ``$model``; rates use ``$__rate_interval``. Engine
state re-exported by each gateway replica is aggregated with ``max by (model, endpoint)`` so
several replicas do not multiply it; gateway counters are summed over replicas.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "switchyard" / "dashboards"
DS = {"type": "prometheus", "uid": "${datasource}"}
J = 'job=~"$job"'
JM = 'job=~"$job", model=~"$model"'
JME = 'job=~"$job", model=~"$model", endpoint=~"$endpoint"'
RI = "$__rate_interval"
S5XX = ', status=~"5.."'


def rate(metric: str, sel: str, by: str | None = None, extra: str = "") -> str:
    inner = f"rate({metric}{{{sel}{extra}}}[{RI}])"
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


def quantile(q: float, metric: str, sel: str, by: str) -> str:
    group = f"{by}, le" if by else "le"
    return f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{sel}}}[{RI}])))"


def p50_p99(metric: str, sel: str, by: str, legend: str) -> list[tuple[str, str]]:
    return [(quantile(0.5, metric, sel, by), f"{legend} p50"), (quantile(0.99, metric, sel, by), f"{legend} p99")]


class Board:
    def __init__(self, uid: str, title: str, description: str, variables: list[dict]) -> None:
        self.uid, self.title, self.description, self.variables = uid, title, description, variables
        self.panels: list[dict] = []
        self._id = 0
        self._x = self._y = self._row_h = 0

    def _next_id(self) -> int:
        self._id += 1
        return self._id

    def _newline(self) -> None:
        self._y += self._row_h
        self._x = self._row_h = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append({"type": "row", "id": self._next_id(), "title": title, "collapsed": False,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self._y}, "panels": []})
        self._y += 1

    def _place(self, w: int, h: int) -> dict:
        if self._x + w > 24:
            self._newline()
        pos = {"h": h, "w": w, "x": self._x, "y": self._y}
        self._x += w
        self._row_h = max(self._row_h, h)
        return pos

    @staticmethod
    def _targets(queries: list[tuple[str, str]], instant: bool = False, table: bool = False) -> list[dict]:
        out = []
        for i, (expr, legend) in enumerate(queries):
            t = {"datasource": DS, "editorMode": "code", "expr": expr, "legendFormat": legend,
                 "refId": chr(ord("A") + i)}
            if instant:
                t["instant"], t["range"] = True, False
            else:
                t["range"] = True
            if table:
                t["format"] = "table"
            out.append(t)
        return out

    def graph(self, title: str, queries: list[tuple[str, str]], unit: str, description: str, w: int = 8,
              h: int = 8, max_: float | None = None, stack: bool = False) -> None:
        defaults: dict = {"unit": unit, "min": 0, "color": {"mode": "palette-classic"},
                          "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                                     "spanNulls": False, "axisSoftMin": 0,
                                     "stacking": {"mode": "normal" if stack else "none", "group": "A"}}}
        if max_ is not None:
            defaults["max"] = max_
        self.panels.append({
            "type": "timeseries", "id": self._next_id(), "title": title, "description": description,
            "datasource": DS, "gridPos": self._place(w, h),
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
            "targets": self._targets(queries)})

    def stat(self, title: str, expr: str, unit: str, description: str, w: int = 4, h: int = 4,
             thresholds: list[tuple[float | None, str]] | None = None) -> None:
        steps = [{"color": c, "value": v} for v, c in (thresholds or [(None, "green")])]
        self.panels.append({
            "type": "stat", "id": self._next_id(), "title": title, "description": description,
            "datasource": DS, "gridPos": self._place(w, h),
            "fieldConfig": {"defaults": {"unit": unit, "color": {"mode": "thresholds"},
                                         "thresholds": {"mode": "absolute", "steps": steps}}, "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "area", "justifyMode": "auto", "textMode": "auto",
                        "orientation": "auto"},
            "targets": self._targets([(expr, "")])})

    def table(self, title: str, expr: str, description: str, w: int = 24, h: int = 7) -> None:
        self.panels.append({
            "type": "table", "id": self._next_id(), "title": title, "description": description,
            "datasource": DS, "gridPos": self._place(w, h),
            "fieldConfig": {"defaults": {}, "overrides": []},
            "options": {"showHeader": True, "cellHeight": "sm"},
            "transformations": [{"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True}}}],
            "targets": self._targets([(expr, "")], instant=True, table=True)})

    def json(self) -> dict:
        return {
            "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                      "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                      "name": "Annotations & Alerts", "type": "dashboard"}]},
            "description": self.description,
            "editable": True,
            "fiscalYearStartMonth": 0,
            "graphTooltip": 1,
            "links": [{"type": "dashboards", "tags": ["switchyard"], "asDropdown": False, "title": "Switchyard",
                       "includeVars": True, "keepTime": True, "icon": "external link", "targetBlank": False,
                       "tooltip": "", "url": ""}],
            "panels": self.panels,
            "refresh": "30s",
            "schemaVersion": 39,
            "tags": ["switchyard", "llm"],
            "templating": {"list": self.variables},
            "time": {"from": "now-1h", "to": "now"},
            "timepicker": {},
            "timezone": "",
            "title": self.title,
            "uid": self.uid,
            "version": 1,
        }


def datasource_var() -> dict:
    return {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1, "regex": ""}


def query_var(name: str, label: str, query: str) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": DS, "definition": query,
            "query": {"qryType": 1, "query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "current": {}, "hide": 0, "includeAll": True, "multi": True, "options": [], "refresh": 2,
            "regex": "", "sort": 1}


# The job variable reads a series every gateway exports from its first scrape (an unlabelled
# histogram), so the dashboards work before the first request.
JOB_VAR = query_var("job", "Gateway job", "label_values(switchyard_event_loop_lag_seconds_count, job)")
# Its All is every model, not the regex of the models listed (those with endpoints), which would
# leave out the requests counted under model "-": a model the gateway does not serve, a bad body.
MODEL_VAR = {**query_var("model", "Model", 'label_values(switchyard_endpoint_ready{job=~"$job"}, model)'),
             "allValue": ".*"}
ENDPOINT_VAR = query_var("endpoint", "Endpoint",
                         'label_values(switchyard_endpoint_ready{job=~"$job", model=~"$model"}, endpoint)')


def gateway_board() -> Board:
    b = Board("switchyard-gateway", "Switchyard / Gateway",
              "Traffic, latency, tokens, routing, prefill/decode, tenants and the gateway process "
              "(switchyard_* and process_* metrics of the gateway's /metrics).",
              [datasource_var(), JOB_VAR, MODEL_VAR])
    req = "switchyard_requests_total"
    b.row("Overview")
    b.stat("Requests / s", f"{rate(req, JM)} or vector(0)", "reqps",
           "Client requests answered per second, all statuses.")
    b.stat("5xx ratio", f"({rate(req, JM, extra=S5XX)} or vector(0)) / {rate(req, JM)}", "percentunit",
           "Share of client requests answered with a 5xx status.",
           thresholds=[(None, "green"), (0.01, "orange"), (0.05, "red")])
    b.stat("TTFT p99", quantile(0.99, "switchyard_time_to_first_token_seconds", JM, ""), "s",
           "99th percentile of time to first token, all selected models.")
    b.stat("Output tokens / s", f"{rate('switchyard_completion_tokens_total', JM)} or vector(0)", "short",
           "Completion tokens per second, as the engines reported them in usage.")
    b.stat("In flight", f"sum(switchyard_in_flight_requests{{{JM}}}) or vector(0)", "short",
           "Client requests in flight now, summed over gateway replicas.")
    b.stat("Ready endpoints",
           f"count(max by (model, endpoint) (switchyard_endpoint_ready{{{JM}}}) == 1) or vector(0)",
           "short", "Endpoints that receive new requests (ready on at least one gateway replica).",
           thresholds=[(None, "red"), (1, "green")])

    b.row("Traffic and errors")
    b.graph("Requests / s by model", [(rate(req, JM, "model"), "{{model}}")], "reqps",
            "Client requests per second, by model.")
    b.graph("Requests / s by status", [(rate(req, JM, "status"), "{{status}}")], "reqps",
            "Client requests per second, by the final HTTP status (499: the client went away).")
    b.graph("5xx ratio by model",
            [(f"({rate(req, JM, 'model', S5XX)} or {rate(req, JM, 'model')} * 0) / {rate(req, JM, 'model')}",
              "{{model}}")],
            "percentunit", "Share of each model's requests answered with a 5xx status.")
    b.graph("Upstream errors / s by class",
            [(rate("switchyard_upstream_errors_total", JM, "model, error_class"), "{{model}} {{error_class}}")],
            "reqps", "Failures of legs to the engines: connect errors, timeouts, engine statuses, broken streams.")
    b.graph("Retries, client cancels and internal errors / s",
            [(rate("switchyard_retries_total", JM, "model"), "{{model}} retried"),
             (rate("switchyard_client_cancels_total", JM, "model, stage"), "{{model}} cancelled {{stage}}"),
             (rate("switchyard_internal_errors_total", J), "internal errors (bugs)")],
            "reqps", "Requests retried on another endpoint after a connect failure, requests whose client "
                     "left, and unexpected exceptions in the gateway (each is logged with its traceback).")
    b.graph("In flight by model", [(f"sum by (model) (switchyard_in_flight_requests{{{JM}}})", "{{model}}")],
            "short", "Client requests in flight, by model, summed over gateway replicas.")

    b.row("Latency")
    b.graph("Time to first token", p50_p99("switchyard_time_to_first_token_seconds", JM, "model", "{{model}}"), "s",
            "Request arrival to the first event carrying generated content, p50 and p99 by model.")
    b.graph("Inter-token latency", p50_p99("switchyard_inter_token_latency_seconds", JM, "model", "{{model}}"), "s",
            "Gaps between chunks that carried generated tokens, p50 and p99 by model.")
    b.graph("End-to-end latency", p50_p99("switchyard_e2e_request_latency_seconds", JM, "model", "{{model}}"), "s",
            "Request arrival to the last byte, p50 and p99 by model.")

    b.row("Tokens")
    b.graph("Output tokens / s", [(rate("switchyard_completion_tokens_total", JM, "model"), "{{model}}")], "short",
            "Completion tokens per second by model (the engines' usage; streams included).", stack=True)
    b.graph("Prompt tokens / s", [(rate("switchyard_prompt_tokens_total", JM, "model"), "{{model}}")], "short",
            "Prompt tokens per second by model (the engines' usage).", stack=True)
    b.graph("Per-stream decode rate",
            [(f"{rate('switchyard_inter_token_latency_seconds_count', JM, 'model')} / "
              f"{rate('switchyard_inter_token_latency_seconds_sum', JM, 'model')}", "{{model}}")],
            "short", "Token-carrying chunks per second within one stream (1 / mean inter-token gap): what a "
                     "single client sees, as opposed to the aggregate throughput.")

    b.row("Routing")
    b.graph("Decisions / s by strategy",
            [(rate("switchyard_routing_decision_seconds_count", J, "strategy"), "{{strategy}}")], "reqps",
            "Routing decisions per second, by the strategy that made them.")
    b.graph("Decision latency", p50_p99("switchyard_routing_decision_seconds", J, "strategy", "{{strategy}}"), "s",
            "Time spent choosing an endpoint, p50 and p99 by strategy.")
    b.graph("Fallbacks / s", [(rate("switchyard_routing_fallbacks_total", J, "strategy, reason"),
                               "{{strategy}} {{reason}}")], "reqps",
            "Decisions a strategy made without its signal (no session, stale engine metrics, ...), by reason.")
    b.graph("Prefix-cache hit rate",
            [(f"{rate('switchyard_cached_prompt_tokens_total', JM, 'model')} / "
              f"{rate('switchyard_prompt_tokens_total', JM, 'model')}", "{{model}}")],
            "percentunit", "Share of prompt tokens the engines served from their prefix cache, from the "
                           "cached_tokens the engines report in usage (per endpoint: Switchyard / Engines).",
            max_=1)
    b.graph("Prefix index occupancy",
            [(f"switchyard_prefix_index_blocks{{{J}}} / switchyard_prefix_index_capacity{{{J}}}", "{{instance}}")],
            "percentunit", "Blocks held by the gateway's prefix-cache index over its bound "
                           "(routing.prefix_index_blocks).", max_=1)
    b.graph("Prefix index evictions / s",
            [(f"sum by (instance) (rate(switchyard_prefix_index_evictions_total{{{J}}}[{RI}]))", "{{instance}}")],
            "short", "Blocks evicted from the gateway's prefix-cache index per second.")

    b.row("Prefill/decode")
    b.graph("Prefill leg", p50_p99("switchyard_pd_prefill_seconds", JM, "model", "{{model}}"), "s",
            "Duration of the prefill leg, p50 and p99 by model.")
    b.graph("KV transfer", p50_p99("switchyard_pd_kv_transfer_seconds", JM, "model", "{{model}}"), "s",
            "First token minus prefill end: the KV transfer and decode start, p50 and p99 by model.")
    b.graph("Decode leg", p50_p99("switchyard_pd_decode_seconds", JM, "model", "{{model}}"), "s",
            "Duration of the decode leg, p50 and p99 by model.")
    b.graph("Prefill failures / s",
            [(rate("switchyard_pd_prefill_failures_total", JM, "model, failure_class, stage"),
              "{{model}} {{failure_class}} ({{stage}})")], "reqps",
            "Prefill legs that failed, by class and by whether the client had received bytes.")
    b.graph("Watchdog fires / s",
            [(rate("switchyard_watchdog_fires_total", JM, "model, phase"), "{{model}} {{phase}}")], "reqps",
            "Decode legs cut by the watchdog (first chunk, idle, response timeouts): a stalled engine.")
    b.graph("Abort calls / s", [(rate("switchyard_pd_aborts_total", JM, "model, result"), "{{model}} {{result}}")],
            "reqps", "Abort calls the gateway sent to engines for abandoned P/D requests, by result.")
    # the trackers exist on every endpoint; keep the P/D ones (prefill, decode, combined)
    pd_eps = f'and on (model, endpoint) switchyard_endpoint_info{{{JM}, role!="aggregated"}}'
    b.graph("Prefill calls in flight and pending decodes",
            [(f"sum by (model, endpoint) (switchyard_pd_prefill_in_flight{{{JM}}}) {pd_eps}",
              "{{endpoint}} prefill in flight"),
             (f"sum by (model, endpoint) (switchyard_pd_pending_decode{{{JM}}}) {pd_eps}",
              "{{endpoint}} pending decode")],
            "short", "The P/D trackers: prefill calls in progress per endpoint (PrefillRequestTracker) and "
                     "decodes chosen but not yet sent (PendingDecodeTracker), P/D endpoints only.", w=12)
    b.graph("Token load",
            [(f"sum by (model, endpoint) (switchyard_pd_token_load_active_tokens{{{JM}}}) {pd_eps}",
              "{{endpoint}} prefilling"),
             (f"sum by (model, endpoint) (switchyard_pd_token_load_kv_tokens{{{JM}}}) {pd_eps}",
              "{{endpoint}} KV held")],
            "short", "TokenLoadTracker: prompt tokens being prefilled and prompt tokens whose KV is held for "
                     "live requests, per P/D endpoint.", w=12)

    b.row("Tenants")
    b.graph("Rate-limited requests / s by user",
            [(rate("switchyard_rate_limited_total", JM, "user, limit"), "{{user}} {{limit}}")], "reqps",
            "Requests refused with 429, by user and limit (rpm, tpm, concurrency, model_rps). Users the "
            "gateway has no record of are _other; requests naming no user, _none.")
    b.graph("Tokens / s by user",
            [(rate("switchyard_user_tokens_total", J, "user, kind"), "{{user}} {{kind}}")], "short",
            "Prompt and completion tokens per second by user (what TPM limits count).", stack=True)
    b.graph("Auth failures / s", [(rate("switchyard_auth_failures_total", J, "reason"), "{{reason}}")], "reqps",
            "Requests refused by API-key auth: missing or invalid key, or a key that could not be verified.")
    b.graph("Limit check latency", p50_p99("switchyard_state_admit_seconds", J, "instance", "{{instance}}"), "s",
            "The rate-limit check before routing (one Redis round trip with the Redis backend).", w=12)
    b.graph("Shared state up", [(f"switchyard_state_up{{{J}}}", "{{instance}}")], "short",
            "1 while the shared state backend (Redis) is reachable from each gateway replica and takes its "
            "writes (0 also while Redis refuses them: out of memory, read-only, a failed save; "
            "switchyard_state_unavailable_total{reason} says which).", w=12, max_=1)

    b.row("Kubernetes discovery")
    b.graph("Discovery requests / s by result",
            [(rate("switchyard_kubernetes_requests_total", J, "verb, result"), "{{verb}} {{result}}")], "reqps",
            "Lists and watches of pods by how they ended: ok, and the failures by kind (unauthorized, "
            "forbidden, gone, idle, connect, timeout, ...). Empty without kubernetes discovery.")
    b.graph("Time since the API server was last heard",
            [(f"time() - max by (instance, watched_namespace) "
              f"(switchyard_kubernetes_last_sync_timestamp_seconds{{{J}}})", "{{instance}} {{watched_namespace}}")],
            "s", "Per replica and watched namespace (* for all): seconds since a list, a watch event or a "
                 "bookmark came. It grows while discovery cannot reach the API server; the chart's "
                 "SwitchyardDiscoveryStale alert fires past 10 minutes.")
    b.graph("Discovered pods by model",
            [(f"max by (model, state) (switchyard_kubernetes_pods{{{J}}})", "{{model}} {{state}}")], "short",
            "Pods discovery found, by model: routable (ready, with a model label and a port) or not.",
            stack=True)

    b.row("Gateway process")
    b.graph("CPU", [(f"rate(process_cpu_seconds_total{{{J}}}[{RI}])", "{{instance}}")], "percentunit",
            "CPU time per second of each gateway process (1 = one core; one process uses at most one).",
            w=6)
    b.graph("Resident memory", [(f"process_resident_memory_bytes{{{J}}}", "{{instance}}")], "bytes",
            "Resident set size of each gateway process.", w=6)
    b.graph("Open file descriptors and client connections",
            [(f"process_open_fds{{{J}}}", "{{instance}} fds"),
             (f"switchyard_client_connections{{{J}}}", "{{instance}} client connections")], "short",
            "Open file descriptors (client and engine connections, listeners) and open client connections.",
            w=6)
    b.graph("Event-loop lag",
            p50_p99("switchyard_event_loop_lag_seconds", J, "instance", "{{instance}}"), "s",
            "How late the event loop ran a periodic timer: every request on the process waits this long "
            "too. Sustained lag means the process is saturated (scale out, or add workers).", w=6)
    return b


def engines_board() -> Board:
    b = Board("switchyard-engines", "Switchyard / Engines",
              "Each engine endpoint as the gateway sees it: the engine's own running, waiting and KV "
              "figures from its last scrape, and the gateway's in-flight, readiness and errors.",
              [datasource_var(), JOB_VAR, MODEL_VAR, ENDPOINT_VAR])
    b.row("Endpoints")
    b.table("Endpoints",
            f"max by (model, endpoint, engine, role, roleset) (switchyard_endpoint_info{{{JME}}})",
            "Every endpoint the gateway routes to, with its engine, role and roleset.")

    b.row("Engine state (last scrape)")
    me = "max by (model, endpoint)"
    leg = "{{endpoint}} ({{model}})"
    b.graph("Running requests", [(f"{me} (switchyard_engine_running_requests{{{JME}}})", leg)], "short",
            "Requests running on each engine (vllm:num_requests_running, sglang:num_running_reqs).")
    b.graph("Waiting requests", [(f"{me} (switchyard_engine_waiting_requests{{{JME}}})", leg)], "short",
            "Requests queued on each engine (vllm:num_requests_waiting, sglang:num_queue_reqs).")
    b.graph("KV cache usage", [(f"{me} (switchyard_engine_kv_cache_usage_ratio{{{JME}}})", leg)],
            "percentunit", "KV cache in use on each engine (vllm:kv_cache_usage_perc, sglang:token_usage).",
            max_=1)
    b.graph("Engine prefix-cache hit rate", [(f"{me} (switchyard_engine_prefix_cache_hit_ratio{{{JME}}})", leg)],
            "percentunit", "Each engine's own prefix-cache hit rate (vLLM: hits/queries between two scrapes; "
                           "SGLang: sglang:cache_hit_rate).", max_=1)
    b.graph("Generation tokens / s", [(f"{me} (switchyard_engine_generation_tokens_per_second{{{JME}}})", leg)],
            "short", "Tokens each engine generated per second (its counters between two scrapes).")
    b.graph("Metrics age", [(f"{me} (switchyard_engine_metrics_age_seconds{{{JME}}})", leg)], "s",
            "Seconds since each engine's /metrics was last read. Past routing.metrics_max_age_s the engine "
            "gauges above are left out and metric-based strategies fall back.")

    b.row("The gateway's view")
    b.graph("In flight per endpoint",
            [(f"sum by (model, endpoint) (switchyard_endpoint_in_flight_requests{{{JME}}})", leg)], "short",
            "Requests the gateway replicas have charged to each endpoint (what least-request ranks).")
    b.graph("Ready", [(f"min by (model, endpoint) (switchyard_endpoint_ready{{{JME}}})", leg)], "short",
            "1 while an endpoint receives new requests (healthy and not draining) on every replica.", max_=1)
    b.graph("Upstream errors / s",
            [(f"sum by (model, endpoint, error_class) "
              f"(rate(switchyard_upstream_errors_total{{{JME}}}[{RI}]))", "{{endpoint}} {{error_class}}")],
            "reqps", "Failures of legs to each endpoint, by class.")
    b.graph("Health probe failures / s",
            [(f"sum by (model, endpoint) (rate(switchyard_health_probes_total{{{JME}, result=\"fail\"}}[{RI}]))",
              leg)], "reqps", "Failed active health probes per endpoint.", w=12)
    b.graph("Scrape failures / s",
            [(f"sum by (model, endpoint) (rate(switchyard_engine_scrapes_total{{{JME}, result=\"fail\"}}[{RI}]))",
              leg)], "reqps", "Failed reads of each engine's /metrics.", w=12)
    return b


BOARDS = {"switchyard-gateway.json": gateway_board, "switchyard-engines.json": engines_board}


def render() -> dict[str, str]:
    return {name: json.dumps(build().json(), indent=1, ensure_ascii=False) + "\n" for name, build in BOARDS.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the files differ from what this script writes")
    args = ap.parse_args()
    stale = []
    for name, text in render().items():
        path = OUT / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
        else:
            OUT.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}; run python charts/build_dashboards.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
