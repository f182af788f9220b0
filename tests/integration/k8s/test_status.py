"""The status page's discovery section (``discovery`` in ``/status.json``) on a real gateway: where
the endpoints come from, and with Kubernetes (the API server emulator) what discovery holds and
whether it is fresh, then stale once the API server stops answering."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import jsonschema

from tests.support.factories import model_block, sim_pod
from tests.support.waiting import until

M = "model.aibrix.ai/name"
SCHEMA = json.loads((Path(__file__).resolve().parents[3] / "docs" / "status.schema.json").read_text())


async def discovery(gw) -> dict:
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/status.json") as r:
        assert r.status == 200
        doc = await r.json()
    jsonschema.validate(doc, SCHEMA)
    return doc["discovery"]


async def metric(gw, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        text = await r.text()
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    for line in text.splitlines():
        if line.rsplit(" ", 1)[0] == want:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {want}")


async def test_a_static_config_says_so(sims, gateway):
    sim = await sims("vllm", "llama")
    gw = await gateway([model_block("llama", "vllm", [sim.url])])
    assert await discovery(gw) == {"source": "static", "static_endpoints": 1, "kubernetes": None}


async def test_kubernetes_discovery_fresh_then_stale_when_the_api_server_stops_answering(emu, sims, gateway, tmp_path):
    static = await sims("vllm", "llama")
    pod = await sims("vllm", "llama")
    sim_pod(emu, "llama-0", pod, "llama")
    emu.create_pod("llm", "llama-1", {M: "llama"}, ready=False)
    emu.create_pod("llm", "odd", {M: "llama", "model.aibrix.ai/engine": "trtllm"})
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(emu.kubeconfig())
    # a watch ends every 2 s and the emulator bookmarks every 0.1 s: stale after 4 s of silence
    kube = {"enabled": True, "kubeconfig": str(kubeconfig), "namespaces": ["llm"], "retry_backoff_s": 0.05,
            "watch_timeout_s": 2, "resync_interval_s": 0, "label_selector": M}
    gw = await gateway([model_block("llama", "vllm", [static.url])], kubernetes=kube)

    async def watching() -> dict | None:
        d = await discovery(gw)
        w = d["kubernetes"]["workers"][0]["watches"][0]
        return d if w["state"] == "watching" and w["last_sync"] is not None else None

    d = await until(watching)
    assert (d["source"], d["static_endpoints"]) == ("kubernetes", 1)
    k = d["kubernetes"]
    assert (k["namespaces"], k["label_selector"], k["stale_after_s"]) == (["llm"], M, 4.0)
    assert k["pods"] == {"routable": 1, "not_routable": 1, "skipped": 1}
    assert k["not_routable"] == [{"pod": "llm/llama-1", "model": "llama", "reason": "not ready"}]
    assert [s["pod"] for s in k["skipped"]] == ["llm/odd"] and "'trtllm' is not supported" in k["skipped"][0]["reason"]
    assert not k["stale"] and k["last_sync_age_s"] <= k["stale_after_s"]
    [worker] = k["workers"]
    assert (worker["worker"], worker["pods"]) == (0, k["pods"])
    [w] = worker["watches"]
    assert (w["namespace"], w["state"], w["stale"], w["last_error"], w["retry_at"]) == ("llm", "watching", False, None, None)
    assert w["last_sync"] == k["last_sync"]
    # the same counts as the metrics
    lists = {(r["verb"], r["result"]): r["count"] for r in k["requests"]}
    assert lists[("list", "ok")] == 1 == await metric(gw, "switchyard_kubernetes_requests_total", verb="list", result="ok")
    assert k["pods"]["skipped"] == await metric(gw, "switchyard_kubernetes_pods_skipped")
    assert await metric(gw, "switchyard_kubernetes_pods", model="llama", state="not_routable") == 1

    # the API server goes away: the watch breaks, every relist is refused, nothing is heard again
    await emu.close()

    async def stale() -> dict | None:
        d = (await discovery(gw))["kubernetes"]
        w = d["workers"][0]["watches"][0]
        err = w["last_error"]
        return d if d["stale"] and w["stale"] and err is not None and err["result"] == "connect" else None

    k = await until(stale, timeout=15)
    w = k["workers"][0]["watches"][0]
    assert w["state"] in ("backing_off", "relisting") and w["last_error"]["verb"] == "list"
    assert "Cannot connect" in w["last_error"]["message"]
    assert k["last_sync_age_s"] > k["stale_after_s"] and k["last_sync"] == w["last_sync"]
    assert k["pods"] == {"routable": 1, "not_routable": 1, "skipped": 1}      # the pool is left as it was
    failed = {(r["verb"], r["result"]): r["count"] for r in k["requests"]}
    assert 1 <= failed[("list", "connect")] <= await metric(gw, "switchyard_kubernetes_requests_total",
                                                            verb="list", result="connect")
