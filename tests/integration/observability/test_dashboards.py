"""The shipped dashboards and alerts query only what the gateway exports.

Every PromQL expression of the dashboards (charts/switchyard/dashboards/*.json: panels and
variables) and of the rendered PrometheusRule is parsed by a real PromQL parser, and every series
name and label it relies on is compared with the /metrics of a gateway under demo traffic:
aggregated vLLM and SGLang models, vLLM and SGLang P/D models, tenants with a limit, errors,
streams, a retry, a routing fallback, a client that leaves, a watchdog fire, and Kubernetes
discovery. A renamed metric or
label then fails here instead of showing "No data" on someone's screen (tests/support/promql_check.py).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml

from gateway.server.run import free_port
from tests.support.factories import model_block
from tests.support.helm import by_kind, render
from tests.support.http import bearer, chat_body, post
from tests.support.promql_check import Query, check, exported, parse, plain, variable_query
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[3]
DASHBOARDS = ROOT / "charts" / "switchyard" / "dashboards"
PROMPT = "Dashboards that match the metrics: every panel's query names a series the gateway exports. " * 6
BOB, ALICE = "sk-bob-dashboards", "sk-alice-dashboards"
ALL_ON = {"dashboards": {"enabled": True}, "prometheusRule": {"enabled": True}}


def dashboard_files() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def dashboard_queries(boards: dict[str, dict]) -> list[Query]:
    out = []
    for name, board in boards.items():
        for var in board["templating"]["list"]:
            if var["type"] == "query":
                out.append(variable_query(f"{name}: variable ${var['name']}", var["definition"]))
        for panel in board["panels"]:
            for t in panel.get("targets", []):
                out.append(Query(f"{name}: {panel['title']} [{t['refId']}]", t["expr"], t.get("legendFormat", "")))
    return out


def rule_queries(docs: list[dict]) -> list[Query]:
    return [Query(f"PrometheusRule {r.get('alert') or r.get('record')}", r["expr"])
            for rule in by_kind(docs)["PrometheusRule"] for g in rule["spec"]["groups"] for r in g["rules"]]


# -- static checks: no gateway needed ---------------------------------------------------------


def test_dashboards_are_what_the_generator_writes():
    spec = importlib.util.spec_from_file_location("build_dashboards", ROOT / "charts" / "build_dashboards.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    files = {p.name: p.read_text() for p in DASHBOARDS.glob("*.json")}
    assert files == mod.render(), "dashboards edited by hand: change charts/build_dashboards.py and run it"


def test_every_dashboard_expression_parses_and_the_layout_is_sound():
    boards = dashboard_files()
    assert set(boards) == {"switchyard-gateway.json", "switchyard-engines.json"}
    uids = [b["uid"] for b in boards.values()]
    assert len(set(uids)) == len(uids)
    for name, b in boards.items():
        assert b["templating"]["list"][0] == {**b["templating"]["list"][0], "name": "datasource", "type": "datasource"}
        ids = [p["id"] for p in b["panels"]]
        assert len(set(ids)) == len(ids), name
        cells = set()
        for p in b["panels"]:
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24, (name, p["title"])
            for x in range(g["x"], g["x"] + g["w"]):         # no two panels overlap
                for y in range(g["y"], g["y"] + g["h"]):
                    assert (x, y) not in cells, (name, p["title"])
                    cells.add((x, y))
            if p["type"] == "row":
                continue
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"} and p["targets"], p["title"]
            refs = [t["refId"] for t in p["targets"]]
            assert len(set(refs)) == len(refs)
            for t in p["targets"]:
                parse(t["expr"])                               # raises on a syntax or type error
                assert 'job=~"$job"' in t["expr"], (name, p["title"], t["expr"])


def test_all_models_takes_in_the_requests_of_no_known_model():
    """Grafana's All, without an allValue, is the regex of the values the variable listed, the
    models that have endpoints; the requests counted under model "-" (a model the gateway does not
    serve, a body that does not parse) would then be left out of every panel filtered on $model,
    the overview's requests/s and the requests by status among them. All is every model."""
    for name, board in dashboard_files().items():
        (var,) = [v for v in board["templating"]["list"] if v["name"] == "model"]
        assert var["includeAll"] and var.get("allValue") is not None, name
        assert re.fullmatch(var["allValue"], "-"), name
        for other in board["templating"]["list"]:       # a job's All stays the gateways' jobs
            assert other["name"] == "model" or other.get("allValue") is None, (name, other["name"])


def test_rules_parse_and_every_alert_has_severity_and_text(helm_render, tmp_path):  # noqa: F811
    docs = render(helm_render, ALL_ON, tmp=tmp_path)
    rules = [r for rule in by_kind(docs)["PrometheusRule"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert [r["alert"] for r in rules] == ["SwitchyardHighErrorRatio", "SwitchyardTimeToFirstTokenHigh",
                                           "SwitchyardNoReadyEndpoint", "SwitchyardWatchdogFiring",
                                           "SwitchyardDiscoveryStale"]
    for r in rules:
        parse(r["expr"])
        assert r["labels"]["severity"] and r["annotations"]["summary"] and r["annotations"]["description"]


# -- the demo run ------------------------------------------------------------------------------


async def ask(gw, model: str, key: str = BOB, stream: bool = False, headers: dict | None = None,
                  max_tokens: int = 6) -> tuple[int, bytes]:
    """One request of the demo run, as ``key``'s user: status and body."""
    status, _, raw = await post(gw, chat_body([{"role": "user", "content": PROMPT}], model=model, stream=stream,
                                              max_tokens=max_tokens), {**bearer(key), **(headers or {})})
    return status, raw


async def leave_mid_stream(gw, model: str) -> None:
    """A client that reads the first chunk of a stream and goes away."""
    body = {"model": model, "messages": [{"role": "user", "content": "bye"}], "stream": True, "max_tokens": 50}
    async with aiohttp.ClientSession() as s:
        r = await s.post(gw.url + "/v1/chat/completions", json=body,
                         headers={"Authorization": f"Bearer {BOB}", "x-sim-fault": "stall_after=1:inf"})
        assert r.status == 200
        await r.content.readany()
        r.close()


async def demo_gateway(sims, gateway, emu, tmp_path):
    """The four kinds of model, tenants with a limit, one dead endpoint (health probes at a long
    interval, so the first request to it is a connect failure and a retry), and Kubernetes
    discovery against the API server emulator (one pod of another model, not ready: discovered,
    not routed to)."""
    agg_vllm = await sims("vllm", "agg-vllm")
    agg_sglang = await sims("sglang", "agg-sglang")
    vp = await sims("vllm", "pd-vllm", role="prefill")
    vd = await sims("vllm", "pd-vllm", role="decode")
    sp = await sims("sglang", "pd-sglang", role="prefill")
    sd = await sims("sglang", "pd-sglang", role="decode")
    dead = f"http://127.0.0.1:{free_port()}"
    models = [
        model_block("agg-vllm", "vllm", [dead, agg_vllm.url], strategy="round-robin"),
        model_block("agg-sglang", "sglang", [agg_sglang.url]),
        {"name": "pd-vllm", "engine": "vllm", "rolesets": [{"name": "rs-1", "prefill": [vp.url], "decode": [vd.url]}]},
        {"name": "pd-sglang", "engine": "sglang", "watchdog": {"first_chunk_timeout_s": 0.3},
         "rolesets": [{"name": "rs-1", "prefill": [{"url": sp.url, "bootstrap_port": sp.bootstrap_port}],
                       "decode": [sd.url]}]},
    ]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(emu.kubeconfig())
    emu.create_pod("llm", "k8s-engine-0", {"model.aibrix.ai/name": "k8s-model"}, ready=False)
    return await gateway(models, health={"interval_s": 30.0},
                         kubernetes={"enabled": True, "kubeconfig": str(kubeconfig), "namespaces": ["llm"]},
                         auth={"api_keys": [{"key": BOB, "user": "bob"}, {"key": ALICE, "user": "alice"}]},
                         limits={"users": {"alice": {"rpm": 2}}})


async def demo_traffic(gw) -> None:
    # the first agg-vllm request meets the dead endpoint (round-robin starts there): a retry
    assert (await ask(gw, "agg-vllm"))[0] == 200
    for model in ("agg-vllm", "agg-sglang", "pd-vllm", "pd-sglang"):
        for _ in range(2):                              # the same prompt twice: prefix-cache hits
            assert (await ask(gw, model))[0] == 200
        status, raw = await ask(gw, model, stream=True)
        assert status == 200 and b"[DONE]" in raw
    # errors: an engine 500, a stream that breaks, a failed prefill, a stalled decode (watchdog)
    assert (await ask(gw, "agg-sglang", headers={"x-sim-fault": "status=500"}))[0] >= 500
    assert b'"error"' in (await ask(gw, "agg-vllm", stream=True, headers={"x-sim-fault": "error_after=2"}))[1]
    assert (await ask(gw, "pd-vllm", headers={"x-sim-fault": "prefill.status=503"}))[0] >= 500
    assert (await ask(gw, "pd-sglang", stream=True,
                       headers={"x-sim-fault": "decode.stall_before_first=inf"}))[0] == 504
    # a strategy without its signal (no session id): a routing fallback
    assert (await ask(gw, "agg-sglang", headers={"routing-strategy": "session-affinity"}))[0] == 200
    # tenants: alice's third request in the minute is refused; a wrong key is refused
    assert [(await ask(gw, "agg-vllm", key=ALICE))[0] for _ in range(3)] == [200, 200, 429]
    assert (await ask(gw, "agg-vllm", key="sk-nobody"))[0] == 401
    await leave_mid_stream(gw, "agg-vllm")


WAIT_FOR = ("switchyard_client_cancels_total", "switchyard_watchdog_fires_total", "switchyard_pd_aborts_total",
            "switchyard_engine_running_requests", "switchyard_engine_prefix_cache_hit_ratio",
            "switchyard_engine_generation_tokens_per_second", "switchyard_event_loop_lag_seconds_count",
            "switchyard_kubernetes_last_sync_timestamp_seconds")


async def test_every_series_the_dashboards_and_alerts_query_is_exported(sims, gateway, emu, helm_render, tmp_path):  # noqa: F811
    docs = await asyncio.to_thread(render, helm_render, ALL_ON, tmp=tmp_path)
    queries = dashboard_queries(dashboard_files()) + rule_queries(docs)
    assert len(queries) > 60

    gw = await demo_gateway(sims, gateway, emu, tmp_path)
    await demo_traffic(gw)

    async def scrape():
        text = await gw.metrics_text()
        return text if all(f"\n{name}{{" in text or f"\n{name} " in text for name in WAIT_FOR) else None

    text = await wait_for(scrape, timeout=10.0)
    assert text, "the demo run did not produce every series it waits for"
    problems = check(queries, exported(text))
    assert not problems, "\n".join(problems)


# -- the alerts, evaluated by Prometheus's own rule tester ----------------------------------------


def promtool() -> str:
    """promtool from Debian's prometheus package (make test unpacks it into the venv)."""
    found = Path(sys.executable).with_name("promtool")
    if found.is_file():
        return str(found)
    on_path = shutil.which("promtool")
    if on_path is None:
        pytest.fail("promtool is missing: `make .venv/bin/promtool` unpacks it from Debian's prometheus package")
    return on_path


SEL = 'namespace="llm", job="sy"'
RULE_TESTS = {
    "evaluation_interval": "1m",
    "tests": [
        {   # 10% of model m's requests fail (threshold 5%), 1% of model ok's
            "interval": "1m",
            "input_series": [
                {"series": f'switchyard_requests_total{{{SEL}, model="m", status="200", strategy="random"}}',
                 "values": "0+90x30"},
                {"series": f'switchyard_requests_total{{{SEL}, model="m", status="502", strategy="random"}}',
                 "values": "0+10x30"},
                {"series": f'switchyard_requests_total{{{SEL}, model="ok", status="200", strategy="random"}}',
                 "values": "0+99x30"},
                {"series": f'switchyard_requests_total{{{SEL}, model="ok", status="500", strategy="random"}}',
                 "values": "0+1x30"},
            ],
            "alert_rule_test": [
                {"eval_time": "3m", "alertname": "SwitchyardHighErrorRatio", "exp_alerts": []},   # pending
                {"eval_time": "15m", "alertname": "SwitchyardHighErrorRatio", "exp_alerts": [{
                    "exp_labels": {"severity": "critical", "namespace": "llm", "job": "sy", "model": "m"},
                    "exp_annotations": {
                        "summary": "Switchyard answers too many requests for a model with a 5xx status",
                        "description": "10% of the requests for model m (job sy) got a 5xx over 5m (threshold "
                                       "0.05). See switchyard_upstream_errors_total by error_class."}}]},
            ],
        },
        {   # model slow: most first tokens take 5-10 s (SLO 5 s); model fast: all under 1 s
            "interval": "1m",
            "input_series": [
                *({"series": f'switchyard_time_to_first_token_seconds_bucket{{{SEL}, model="slow", le="{le}"}}',
                   "values": f"0+{n}x30"} for le, n in (("1", 10), ("5", 50), ("10", 100), ("+Inf", 100))),
                *({"series": f'switchyard_time_to_first_token_seconds_bucket{{{SEL}, model="fast", le="{le}"}}',
                   "values": "0+100x30"} for le in ("1", "5", "10", "+Inf")),
            ],
            "alert_rule_test": [
                {"eval_time": "8m", "alertname": "SwitchyardTimeToFirstTokenHigh", "exp_alerts": []},  # for: 10m
                {"eval_time": "20m", "alertname": "SwitchyardTimeToFirstTokenHigh", "exp_alerts": [{
                    "exp_labels": {"severity": "warning", "namespace": "llm", "job": "sy", "model": "slow"},
                    "exp_annotations": {
                        "summary": "Switchyard time to first token p99 is over its SLO",
                        "description": "TTFT p99 of model slow (job sy) is 9.9s, over the 5s SLO. Check the "
                                       "engines' waiting queues and KV usage (Switchyard / Engines)."}}]},
            ],
        },
        {   # P/D model pd: its decode endpoint goes unready at 10m, its prefill stays; model gone: its
            # only endpoint vanishes at 10m; job down: the whole gateway stops being scraped at 10m
            "interval": "1m",
            "input_series": [
                {"series": f'switchyard_endpoint_ready{{{SEL}, instance="a", model="pd", endpoint="p:1"}}',
                 "values": "1x30"},
                {"series": f'switchyard_endpoint_ready{{{SEL}, instance="a", model="pd", endpoint="d:1"}}',
                 "values": "1x10 0x20"},
                {"series": f'switchyard_endpoint_info{{{SEL}, instance="a", model="pd", endpoint="p:1", '
                           'engine="vllm", role="prefill", roleset="rs"}', "values": "1x30"},
                {"series": f'switchyard_endpoint_info{{{SEL}, instance="a", model="pd", endpoint="d:1", '
                           'engine="vllm", role="decode", roleset="rs"}', "values": "1x30"},
                {"series": f'switchyard_endpoint_ready{{{SEL}, instance="a", model="gone", endpoint="g:1"}}',
                 "values": "1x10 stale"},
                {"series": f'switchyard_endpoint_info{{{SEL}, instance="a", model="gone", endpoint="g:1", '
                           'engine="sglang", role="aggregated", roleset=""}', "values": "1x10 stale"},
                {"series": f'switchyard_event_loop_lag_seconds_count{{{SEL}, instance="a"}}', "values": "0+2x30"},
                {"series": 'switchyard_endpoint_ready{namespace="llm", job="down", instance="b", model="x", '
                           'endpoint="x:1"}', "values": "1x10 stale"},
                {"series": 'switchyard_endpoint_info{namespace="llm", job="down", instance="b", model="x", '
                           'endpoint="x:1", engine="vllm", role="aggregated", roleset=""}', "values": "1x10 stale"},
                {"series": 'switchyard_event_loop_lag_seconds_count{namespace="llm", job="down", instance="b"}',
                 "values": "0+2x10 stale"},
            ],
            "alert_rule_test": [
                {"eval_time": "5m", "alertname": "SwitchyardNoReadyEndpoint", "exp_alerts": []},
                {"eval_time": "15m", "alertname": "SwitchyardNoReadyEndpoint", "exp_alerts": [
                    {"exp_labels": {"severity": "critical", "namespace": "llm", "job": "sy", "model": model,
                                    "role": role},
                     "exp_annotations": {
                         "summary": "A model served by Switchyard has no ready endpoint",
                         "description": f"Model {model} (job sy) had a ready {role} endpoint within 1h and has "
                                        "none now: its requests get 503. Its endpoints are unhealthy, draining "
                                        "or gone."}}
                    for model, role in (("gone", "aggregated"), ("pd", "decode"))]},
            ],
        },
        {   # the watchdog fires once at 5m for model m (a series born at 1) and once at 5m on a series
            # that already existed for model n; both alert at once, and are quiet 10m later
            "interval": "1m",
            "input_series": [
                {"series": f'switchyard_watchdog_fires_total{{{SEL}, model="m", phase="idle"}}',
                 "values": "_x5 1x25"},
                {"series": f'switchyard_watchdog_fires_total{{{SEL}, model="n", phase="first_chunk"}}',
                 "values": "0x5 1x25"},
            ],
            "alert_rule_test": [
                {"eval_time": "4m", "alertname": "SwitchyardWatchdogFiring", "exp_alerts": []},
                {"eval_time": "6m", "alertname": "SwitchyardWatchdogFiring", "exp_alerts": [
                    {"exp_labels": {"severity": "warning", "namespace": "llm", "job": "sy", "model": model,
                                    "phase": phase},
                     "exp_annotations": {
                         "summary": "Switchyard's watchdog cut stalled requests",
                         "description": f"The watchdog fired for model {model} (phase {phase}, job sy) within "
                                        "10m: an engine stopped sending tokens."}}
                    for model, phase in (("m", "idle"), ("n", "first_chunk"))]},
                {"eval_time": "25m", "alertname": "SwitchyardWatchdogFiring", "exp_alerts": []},
            ],
        },
        {   # instance a hears from the API server every minute; b's last sync stands still from 5m
            # (its watch stuck, its lists refused); c never synced (0 from its start); both alert
            "interval": "1m",
            "input_series": [
                {"series": f'switchyard_kubernetes_last_sync_timestamp_seconds{{{SEL}, instance="a", '
                           'watched_namespace="llm"}', "values": "0+60x40"},
                {"series": f'switchyard_kubernetes_last_sync_timestamp_seconds{{{SEL}, instance="b", '
                           'watched_namespace="llm"}', "values": "0+60x5 300x35"},
                {"series": f'switchyard_kubernetes_last_sync_timestamp_seconds{{{SEL}, instance="c", '
                           'watched_namespace="*"}', "values": "0x40"},
            ],
            "alert_rule_test": [
                # (promtool's clock starts at 0: c's age is the time since then)
                {"eval_time": "12m", "alertname": "SwitchyardDiscoveryStale", "exp_alerts": []},  # pending
                {"eval_time": "25m", "alertname": "SwitchyardDiscoveryStale", "exp_alerts": [
                    {"exp_labels": {"severity": "warning", "namespace": "llm", "job": "sy", "instance": inst,
                                    "watched_namespace": ns},
                     "exp_annotations": {
                         "summary": "Switchyard's Kubernetes discovery has not heard from the API server",
                         "description": f"Discovery of {inst} (job sy) has had no list, watch event or bookmark for "
                                        f"pods in namespace {ns} for {ago}: pods that come, go or turn unready "
                                        "there are not seen. See switchyard_kubernetes_requests_total by result "
                                        "and the gateway's log."}}
                    for inst, ns, ago in (("b", "llm", "20m 0s"), ("c", "*", "25m 0s"))]},
            ],
        },
    ],
}


def test_dashboard_expressions_pass_prometheus_own_parser(tmp_path):
    """Every dashboard query, as a recording rule, through `promtool check rules`: Prometheus's Go
    parser agrees with promql-parser."""
    queries = dashboard_queries(dashboard_files())
    rules = [{"record": f"switchyard:dashboard_check:{i}", "expr": plain(q.expr)}
             for i, q in enumerate(queries)]
    (tmp_path / "dashboards.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    r = subprocess.run([promtool(), "check", "rules", "dashboards.yml"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_alerts_fire_when_they_should_under_promtool(helm_render, tmp_path):  # noqa: F811
    """The rendered rules pass `promtool check rules` (Prometheus's own parser) and
    `promtool test rules` on synthetic series: each alert fires on its case, with its labels and
    text, and stays quiet on the healthy neighbour."""
    tool = promtool()
    docs = render(helm_render, ALL_ON, tmp=tmp_path)
    spec = by_kind(docs)["PrometheusRule"][0]["spec"]
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(spec, sort_keys=False))
    r = subprocess.run([tool, "check", "rules", "rules.yml"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    (tmp_path / "tests.yml").write_text(yaml.safe_dump({"rule_files": ["rules.yml"], **RULE_TESTS},
                                                       sort_keys=False))
    r = subprocess.run([tool, "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
