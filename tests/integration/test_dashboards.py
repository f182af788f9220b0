"""The shipped dashboards and alerts query only what the gateway exports.

Every PromQL expression of the dashboards (charts/switchyard/dashboards/*.json: panels and
variables) and of the rendered PrometheusRule is parsed by a real PromQL parser, and every series
name and label it relies on is compared with the /metrics of a gateway under demo traffic:
aggregated vLLM and SGLang models, vLLM and SGLang P/D models, tenants with a limit, errors,
streams, a retry, a routing fallback, a client that leaves, a watchdog fire. A renamed metric or
label then fails here instead of showing "No data" on someone's screen (tests/promql_check.py).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import aiohttp

from gateway.server import free_port
from tests.conftest import model_block, wait_for
from tests.integration.test_k8s_chart import by_kind, helm_render, render  # noqa: F401 (helm_render: a fixture)
from tests.promql_check import Query, check, exported, parse, variable_query

ROOT = Path(__file__).resolve().parents[2]
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


def test_rules_parse_and_every_alert_has_severity_and_text(helm_render, tmp_path):  # noqa: F811
    docs = render(helm_render, ALL_ON, tmp=tmp_path)
    rules = [r for rule in by_kind(docs)["PrometheusRule"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert [r["alert"] for r in rules] == ["SwitchyardHighErrorRatio", "SwitchyardTimeToFirstTokenHigh",
                                           "SwitchyardNoReadyEndpoint", "SwitchyardWatchdogFiring"]
    for r in rules:
        parse(r["expr"])
        assert r["labels"]["severity"] and r["annotations"]["summary"] and r["annotations"]["description"]


# -- the demo run ------------------------------------------------------------------------------


async def post(gw, model: str, key: str = BOB, stream: bool = False, headers: dict | None = None,
               max_tokens: int = 6) -> tuple[int, bytes]:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "stream": stream,
            "max_tokens": max_tokens}
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/chat/completions", json=body,
                                                    headers={"Authorization": f"Bearer {key}", **(headers or {})}) as r:
        return r.status, await r.read()


async def leave_mid_stream(gw, model: str) -> None:
    """A client that reads the first chunk of a stream and goes away."""
    body = {"model": model, "messages": [{"role": "user", "content": "bye"}], "stream": True, "max_tokens": 50}
    async with aiohttp.ClientSession() as s:
        r = await s.post(gw.url + "/v1/chat/completions", json=body,
                         headers={"Authorization": f"Bearer {BOB}", "x-sim-fault": "stall_after=1:inf"})
        assert r.status == 200
        await r.content.readany()
        r.close()


async def demo_gateway(sims, gateway):
    """The four kinds of model, tenants with a limit, one dead endpoint (health probes at a long
    interval, so the first request to it is a connect failure and a retry)."""
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
    return await gateway(models, health={"interval_s": 30.0},
                         auth={"api_keys": [{"key": BOB, "user": "bob"}, {"key": ALICE, "user": "alice"}]},
                         limits={"users": {"alice": {"rpm": 2}}})


async def demo_traffic(gw) -> None:
    # the first agg-vllm request meets the dead endpoint (round-robin starts there): a retry
    assert (await post(gw, "agg-vllm"))[0] == 200
    for model in ("agg-vllm", "agg-sglang", "pd-vllm", "pd-sglang"):
        for _ in range(2):                              # the same prompt twice: prefix-cache hits
            assert (await post(gw, model))[0] == 200
        status, raw = await post(gw, model, stream=True)
        assert status == 200 and b"[DONE]" in raw
    # errors: an engine 500, a stream that breaks, a failed prefill, a stalled decode (watchdog)
    assert (await post(gw, "agg-sglang", headers={"x-sim-fault": "status=500"}))[0] >= 500
    assert b'"error"' in (await post(gw, "agg-vllm", stream=True, headers={"x-sim-fault": "error_after=2"}))[1]
    assert (await post(gw, "pd-vllm", headers={"x-sim-fault": "prefill.status=503"}))[0] >= 500
    assert (await post(gw, "pd-sglang", stream=True,
                       headers={"x-sim-fault": "decode.stall_before_first=inf"}))[0] == 504
    # a strategy without its signal (no session id): a routing fallback
    assert (await post(gw, "agg-sglang", headers={"routing-strategy": "session-affinity"}))[0] == 200
    # tenants: alice's third request in the minute is refused; a wrong key is refused
    assert [(await post(gw, "agg-vllm", key=ALICE))[0] for _ in range(3)] == [200, 200, 429]
    assert (await post(gw, "agg-vllm", key="sk-nobody"))[0] == 401
    await leave_mid_stream(gw, "agg-vllm")


WAIT_FOR = ("switchyard_client_cancels_total", "switchyard_watchdog_fires_total", "switchyard_pd_aborts_total",
            "switchyard_engine_running_requests", "switchyard_engine_prefix_cache_hit_ratio",
            "switchyard_engine_generation_tokens_per_second", "switchyard_event_loop_lag_seconds_count")


async def test_every_series_the_dashboards_and_alerts_query_is_exported(sims, gateway, helm_render, tmp_path):  # noqa: F811
    docs = await asyncio.to_thread(render, helm_render, ALL_ON, tmp=tmp_path)
    queries = dashboard_queries(dashboard_files()) + rule_queries(docs)
    assert len(queries) > 60

    gw = await demo_gateway(sims, gateway)
    await demo_traffic(gw)

    async def scrape():
        text = await gw.metrics_text()
        return text if all(f"\n{name}{{" in text or f"\n{name} " in text for name in WAIT_FOR) else None

    text = await wait_for(scrape, timeout=10.0)
    assert text, "the demo run did not produce every series it waits for"
    problems = check(queries, exported(text))
    assert not problems, "\n".join(problems)
