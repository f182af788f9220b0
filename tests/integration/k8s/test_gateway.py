"""End to end: pods in the API server emulator point at real enginesim servers on 127.0.0.1, and
requests through the gateway reach them — with models that have no static endpoints, models the
config does not name at all, and static endpoints next to discovered ones."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from gateway.server.app import DISCOVERY_KEY
from tests.support.factories import model_block, sim_pod
from tests.support.http import openai_client, sim_state
from tests.support.waiting import wait_for

M = "model.aibrix.ai/name"
CHAT = [{"role": "user", "content": "Where do the trains go at night?"}]


@pytest.fixture
def kube_block(emu, tmp_path):
    path = tmp_path / "kubeconfig"
    path.write_text(emu.kubeconfig())
    return {"enabled": True, "kubeconfig": str(path), "namespaces": ["llm"], "retry_backoff_s": 0.05}


async def ready_names(base: str, model: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(base + "/v1/models") as r:
        data = (await r.json())["data"]
    return next((m["ready_endpoints"] for m in data if m["id"] == model), 0)


async def test_chat_through_discovered_pods(emu, kube_block, sims, gateway):
    v1 = await sims("vllm", "llama")
    s1 = await sims("sglang", "qwen")
    sim_pod(emu, "llama-0", v1, "llama")
    sim_pod(emu, "qwen-0", s1, "qwen", **{"model.aibrix.ai/engine": "sglang"})
    # llama is configured without endpoints; qwen is not configured at all
    gw = await gateway([{"name": "llama", "engine": "vllm", "strategy": "least-request"}], kubernetes=kube_block)
    assert await wait_for(lambda: gw.gw.pool.ready("llama") and gw.gw.pool.ready("qwen"), timeout=3)

    client = openai_client(gw)
    for model, sim in (("llama", v1), ("qwen", s1)):
        raw = await client.chat.completions.with_raw_response.create(model=model, messages=CHAT, max_tokens=4)
        r = raw.parse()
        assert r.choices[0].message.content and r.usage.completion_tokens == 4
        assert raw.headers["target-pod"] == f"{model}-0"          # the pod name
        assert (await sim_state(sim.url))["counts"]["started"] >= 1
    ep = gw.gw.pool.endpoints("qwen")[0]
    assert (ep.engine, ep.source) == ("sglang", "kubernetes")
    stream = await client.chat.completions.create(model="qwen", messages=CHAT, max_tokens=5, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    await client.close()


async def test_pods_coming_and_going_steer_traffic(emu, kube_block, sims, gateway):
    a = await sims("vllm", "llama", itl_ms=40)
    b = await sims("vllm", "llama")
    sim_pod(emu, "a", a, "llama")
    gw = await gateway([], kubernetes=kube_block)
    assert await wait_for(lambda: len(gw.gw.pool.ready("llama")) == 1, timeout=3)
    client = openai_client(gw)

    # a stream is running on pod a when a is deleted: it finishes; new requests go to b
    stream = await client.chat.completions.create(model="llama", messages=CHAT, max_tokens=20, stream=True)
    first = await stream.__anext__()
    assert first is not None
    sim_pod(emu, "b", b, "llama")
    emu.delete_pod("llm", "a")
    assert await wait_for(lambda: [e.name for e in gw.gw.pool.ready("llama")] == ["b"], timeout=3)
    rest = [c async for c in stream]
    assert rest[-1].choices[0].finish_reason == "length"
    before = (await sim_state(a.url))["counts"]["started"]
    for _ in range(3):
        raw = await client.chat.completions.with_raw_response.create(model="llama", messages=CHAT, max_tokens=2)
        assert raw.headers["target-pod"] == "b"
    assert (await sim_state(a.url))["counts"]["started"] == before

    # b not ready: the model is still known, requests get 503 (not 404), /ready says so
    emu.set_ready("llm", "b", False)
    assert await wait_for(lambda: not gw.gw.pool.ready("llama"), timeout=3)
    with pytest.raises(openai.APIStatusError) as e:
        await client.chat.completions.create(model="llama", messages=CHAT, max_tokens=2)
    assert e.value.status_code == 503
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/ready") as r:
        assert r.status == 503
    emu.set_ready("llm", "b", True)
    assert await wait_for(lambda: ready_names(gw.url, "llama"), timeout=3) == 1
    await client.close()


async def test_a_configured_model_without_pods_is_listed_and_retrieved(emu, kube_block, sims, gateway, monkeypatch):
    """A model the config declares is one the gateway serves whether or not a pod serves it now
    (a request for it is a 503, not a 404): ``GET /v1/models`` lists it with no ready endpoint and
    ``GET /v1/models/{id}`` finds it, before its first pod and after its last one left; a model
    only pods served is gone from both, and a 404, once its pods are (and the while after its last
    pod left that it is still awaited is over: none here)."""
    monkeypatch.setattr("k8s.discovery.LEFT_GRACE_S", 0.0)
    v = await sims("vllm", "llama")
    q = await sims("vllm", "qwen")
    sim_pod(emu, "qwen-0", q, "qwen")
    gw = await gateway([{"name": "llama", "engine": "vllm"}], kubernetes=kube_block)
    assert await wait_for(lambda: gw.gw.pool.ready("qwen"), timeout=3)
    client = openai_client(gw)

    async def listed() -> dict:
        return {m.id: m for m in (await client.models.list()).data}

    async def check_llama_without_pods() -> None:
        models = await listed()
        assert "llama" in models and models["llama"].ready_endpoints == 0
        assert await client.models.retrieve("llama") == models["llama"]
        with pytest.raises(openai.APIStatusError) as e:
            await client.chat.completions.create(model="llama", messages=CHAT, max_tokens=2)
        assert e.value.status_code == 503

    await check_llama_without_pods()
    sim_pod(emu, "llama-0", v, "llama")
    assert await wait_for(lambda: gw.gw.pool.ready("llama"), timeout=3)
    assert (await client.models.retrieve("llama")).ready_endpoints == 1
    emu.delete_pod("llm", "llama-0")
    emu.delete_pod("llm", "qwen-0")
    assert await wait_for(lambda: not gw.gw.pool.endpoints("llama") and not gw.gw.pool.endpoints("qwen"),
                          timeout=3)
    await check_llama_without_pods()
    assert "qwen" not in await listed()
    with pytest.raises(openai.NotFoundError) as nf:
        await client.models.retrieve("qwen")
    assert (nf.value.body["code"], nf.value.body["param"]) == ("model_not_found", "model")
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="qwen", messages=CHAT, max_tokens=2)
    await client.close()


async def test_static_and_discovered_endpoints_share_the_pool(emu, kube_block, sims, gateway):
    static = await sims("vllm", "llama")
    pod = await sims("vllm", "llama")
    sim_pod(emu, "llama-pod", pod, "llama")
    gw = await gateway([model_block("llama", "vllm", [static.url], strategy="round-robin")], kubernetes=kube_block)
    assert await wait_for(lambda: len(gw.gw.pool.ready("llama")) == 2, timeout=3)
    assert {e.source for e in gw.gw.pool.endpoints("llama")} == {"static", "kubernetes"}
    client = openai_client(gw)
    pods = set()
    for _ in range(4):
        raw = await client.completions.with_raw_response.create(model="llama", prompt="hi", max_tokens=2)
        pods.add(raw.headers["target-pod"])
    assert pods == {"llama-pod", f"127.0.0.1:{static.port}"}
    # the pod leaves; the static endpoint stays
    emu.delete_pod("llm", "llama-pod")
    assert await wait_for(lambda: [e.source for e in gw.gw.pool.endpoints("llama")] == ["static"], timeout=3)
    await client.close()
    disc = gw.runner.app[DISCOVERY_KEY]
    assert disc.stats["lists"] == 1


async def test_pd_pods_route_through_the_pd_strategy(emu, kube_block, sims, gateway):
    pre = await sims("vllm", "llama", role="prefill")
    dec = await sims("vllm", "llama", role="decode")
    sim_pod(emu, "rs1-prefill", pre, "llama", **{"role-name": "prefill", "roleset-name": "rs1"})
    sim_pod(emu, "rs1-decode", dec, "llama", **{"role-name": "decode", "roleset-name": "rs1"})
    gw = await gateway([{"name": "llama", "strategy": "pd"}], kubernetes=kube_block)
    assert await wait_for(lambda: len(gw.gw.pool.ready("llama")) == 2, timeout=3)
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.base_url + "/chat/completions",
                          json={"model": "llama", "messages": CHAT, "max_tokens": 3}) as r:
            body = await r.json()
            assert r.status == 200, body
            assert r.headers["prefill-target-pod"] == "rs1-prefill"
    assert body["choices"][0]["message"]["content"]
    assert (await sim_state(pre.url))["counts"]["started"] == 1
    assert (await sim_state(dec.url))["counts"]["started"] == 1


async def test_discovered_pd_pods_default_to_pd_and_the_annotation_strategy_applies(emu, kube_block, sims, gateway):
    import json

    pre = await sims("vllm", "llama", role="prefill")
    dec = await sims("vllm", "llama", role="decode")
    sim_pod(emu, "rs1-prefill", pre, "llama", **{"role-name": "prefill", "roleset-name": "rs1"})
    sim_pod(emu, "rs1-decode", dec, "llama", **{"role-name": "decode", "roleset-name": "rs1"})
    a, b = await sims("vllm", "qwen"), await sims("vllm", "qwen")
    profile = json.dumps({"defaultProfile": "default", "profiles": {"default": {"routingStrategy": "round-robin"}}})
    for name, sim in (("qwen-a", a), ("qwen-b", b)):
        emu.create_pod("llm", name, {M: "qwen", "model.aibrix.ai/port": str(sim.port)}, ip="127.0.0.1",
                       annotations={"model.aibrix.ai/config": profile})
    gw = await gateway([], kubernetes=kube_block)     # neither model is in the config
    assert await wait_for(lambda: len(gw.gw.pool.ready("llama")) == 2 and len(gw.gw.pool.ready("qwen")) == 2,
                          timeout=3)
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.base_url + "/chat/completions",
                          json={"model": "llama", "messages": CHAT, "max_tokens": 3}) as r:
            assert r.status == 200 and r.headers["routing-strategy"] == "pd"
            assert r.headers["prefill-target-pod"] == "rs1-prefill"
        pods = []
        for _ in range(4):
            async with s.post(gw.base_url + "/chat/completions",
                              json={"model": "qwen", "messages": CHAT, "max_tokens": 1}) as r:
                assert r.status == 200 and r.headers["routing-strategy"] == "round-robin"
                pods.append(r.headers["target-pod"])
    assert pods[0] != pods[1] and pods[:2] == pods[2:]


async def test_an_annotation_strategy_this_gateway_lacks_is_not_the_clients_error(emu, kube_block, sims, gateway):
    """A pod's ``routingStrategy`` that names no strategy here (an AIBrix one, a typo): logged,
    and the model's default routes; no request is refused for the operator's annotation."""
    import json

    sim = await sims("vllm", "qwen")
    profile = json.dumps({"defaultProfile": "default", "profiles": {"default": {"routingStrategy": "least-busy-time"}}})
    emu.create_pod("llm", "qwen-a", {M: "qwen", "model.aibrix.ai/port": str(sim.port)}, ip="127.0.0.1",
                   annotations={"model.aibrix.ai/config": profile})
    gw = await gateway([], kubernetes=kube_block)
    assert await wait_for(lambda: len(gw.gw.pool.ready("qwen")) == 1, timeout=3)
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(gw.base_url + "/chat/completions",
                              json={"model": "qwen", "messages": CHAT, "max_tokens": 1}) as r:
                assert r.status == 200 and r.headers["routing-strategy"] == "least-request"


async def test_a_pod_whose_annotations_cannot_be_read_stops_no_other_pod(emu, kube_block, sims, gateway):
    """Malformed annotations (a profile named by a list, JSON nested past reading) skip that pod,
    or its events; the other pods come and go as before."""
    good = await sims("vllm", "qwen")
    deep = "[" * 50000 + "]" * 50000
    emu.create_pod("llm", "bad-profile", {M: "qwen", "model.aibrix.ai/port": "9"}, ip="127.0.0.1",
                   annotations={"model.aibrix.ai/config": '{"defaultProfile": ["a"], "profiles": {"a": {}}}'})
    emu.create_pod("llm", "deep-profile", {M: "qwen", "model.aibrix.ai/port": "9"}, ip="127.0.0.1",
                   annotations={"model.aibrix.ai/config": deep})
    emu.create_pod("llm", "deep-events", {M: "qwen", "model.aibrix.ai/port": str(good.port)}, ip="127.0.0.1",
                   annotations={"switchyard.io/kv-events": deep})
    gw = await gateway([], kubernetes=kube_block)
    assert await wait_for(lambda: [ep.name for ep in gw.gw.pool.ready("qwen")] == ["deep-events"], timeout=5)
    emu.create_pod("llm", "late", {M: "qwen", "model.aibrix.ai/port": str(good.port)}, ip="127.0.0.1")
    assert await wait_for(lambda: len(gw.gw.pool.ready("qwen")) == 2, timeout=5)
    emu.delete_pod("llm", "deep-events")
    assert await wait_for(lambda: [ep.name for ep in gw.gw.pool.ready("qwen")] == ["late"], timeout=5)


@pytest.mark.timeout(90)
async def test_discovery_metrics_of_two_workers_merge_into_one_exposition(emu, sims, tmp_path):
    """Each worker of ``--workers 2`` runs its own discovery (its own list and watch) and exports its
    metrics; the merged ``/metrics`` sums the requests (the API server served both), shows each pod
    once (the same pods seen twice) and the older of the two last-sync times; the status page lists
    both workers' discovery and adds their requests up as /metrics does."""
    from tests.support.gateway_process import gateway_process, get_new, metric_total
    from tests.support.ports import listen_port

    sim = await sims("vllm", "llama")
    sim_pod(emu, "llama-0", sim, "llama")
    emu.create_pod("llm", "llama-1", {M: "llama"}, ready=False)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(emu.kubeconfig())
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, shutdown_grace_s: 2, log_level: warning}\n"
                   f"kubernetes: {{enabled: true, kubeconfig: '{kubeconfig}', namespaces: [llm]}}\n")
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2):
        assert await wait_for(lambda: len(emu.watchers) == 2, timeout=10), "one watch per worker"
        page = (await get_new(port, "/metrics"))[1]
        assert metric_total(page, "switchyard_kubernetes_requests_total", verb="list", result="ok") == 2
        assert emu.stats["lists"] == 2
        assert metric_total(page, "switchyard_kubernetes_pods", model="llama", state="routable") == 1
        assert metric_total(page, "switchyard_kubernetes_pods", model="llama", state="not_routable") == 1
        synced = metric_total(page, "switchyard_kubernetes_last_sync_timestamp_seconds", watched_namespace="llm")
        assert synced > 0 and page.count("switchyard_kubernetes_last_sync_timestamp_seconds{") == 1
        # the status page: each worker's discovery listed, the requests added up as /metrics adds them
        code, doc = await get_new(port, "/status.json")
        assert code == 200
        k = doc["discovery"]["kubernetes"]
        assert [(w["worker"], w["pods"], [x["namespace"] for x in w["watches"]]) for w in k["workers"]] == [
            (i, {"routable": 1, "not_routable": 1, "skipped": 0}, ["llm"]) for i in (0, 1)]
        assert doc["gateway"]["pid"] in {w["pid"] for w in k["workers"]} and k["workers"][0]["pid"] != k["workers"][1]["pid"]
        assert next(r["count"] for r in k["requests"] if (r["verb"], r["result"]) == ("list", "ok")) == 2
        assert k["last_sync"] == min(x["last_sync"] for w in k["workers"] for x in w["watches"])


async def test_a_worker_serves_once_its_first_list_of_pods_is_in(emu, sims, tmp_path):
    """A worker that starts while the API server is slow to list (the gateway's start, or a worker the
    parent starts again beside siblings that serve) listens once it knows the pods: a client is not
    told that a model its pods serve does not exist, it is served once the list is in."""
    import asyncio

    import structlog

    from gateway.config.schema import config_from_dict
    from gateway.server.run import start
    from tests.support.gateway_process import post_new
    from tests.support.ports import listen_port
    from tests.support.waiting import until

    sim = await sims("vllm", "llama")
    sim_pod(emu, "llama-0", sim, "llama")
    path = tmp_path / "kubeconfig"
    path.write_text(emu.kubeconfig())
    port = listen_port()
    cfg = config_from_dict({"listen": {"host": "127.0.0.1", "port": port}, "server": {"shutdown_grace_s": 1.0},
                            "kubernetes": {"enabled": True, "kubeconfig": str(path), "namespaces": ["llm"]}},
                           source="<test>")
    answers: list[int] = []

    async def ask() -> None:
        while not answers:
            try:
                answers.append((await post_new(port, "/v1/chat/completions",
                                               {"model": "llama", "messages": CHAT, "max_tokens": 2}))[0])
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.02)       # not listening yet

    emu.hold_lists()
    runner = None
    with structlog.testing.capture_logs() as logs:
        starting = asyncio.create_task(start(cfg))
        asker = asyncio.create_task(ask())
        try:
            await until(lambda: answers or any(e["event"] == "kubernetes discovery: waiting for the first list "
                                                             "of pods before serving" for e in logs))
            assert answers == [], "answered before the pods were listed"
            assert emu.stats["held_lists"] == 1 or await until(lambda: emu.stats["held_lists"] == 1)
            emu.release_lists()
            runner, _, _ = await starting
            await until(lambda: answers)
            assert answers == [200]
        finally:
            emu.release_lists()
            asker.cancel()
            if runner is None:
                runner = (await starting)[0]
            await runner.cleanup()


async def test_a_model_asked_for_before_the_pods_are_listed_is_not_a_404(emu, sims, gateway, tmp_path, monkeypatch):
    """A worker that serves before its first list of pods is in (the API server answered none within
    the wait, as when the control plane is down while the worker starts again) cannot tell that a
    model does not exist: it answers 503 with a Retry-After, which clients retry, not 404
    model_not_found, which they do not; once the pods are listed the model is served."""
    import k8s.discovery
    from tests.support.gateway_process import post_new
    from tests.support.waiting import until

    monkeypatch.setattr(k8s.discovery, "FIRST_LIST_WAIT_S", 0.0)
    sim = await sims("vllm", "llama")
    sim_pod(emu, "llama-0", sim, "llama")
    path = tmp_path / "kubeconfig"
    path.write_text(emu.kubeconfig())
    emu.hold_lists()
    try:
        gw = await gateway([], kubernetes={"enabled": True, "kubeconfig": str(path), "namespaces": ["llm"]})
        body = {"model": "llama", "messages": CHAT, "max_tokens": 2}
        status, headers, doc = await post_new(gw.port, "/v1/chat/completions", body)
        assert (status, headers.get("Retry-After"), doc["error"]["code"]) == (503, "5", "service_unavailable"), doc
        assert "not been listed yet" in doc["error"]["message"]
        assert (await post_new(gw.port, "/v1/chat/completions", {**body, "model": "nobody"}))[0] == 503
        emu.release_lists()
        await until(lambda: gw.gw.pool.ready("llama"))
        assert (await post_new(gw.port, "/v1/chat/completions", body))[0] == 200
        assert (await post_new(gw.port, "/v1/chat/completions", {**body, "model": "nobody"}))[0] == 404
    finally:
        emu.release_lists()


async def test_a_model_looked_up_before_the_pods_are_listed_is_not_a_404(emu, sims, gateway, tmp_path, monkeypatch):
    """``GET /v1/models/{id}`` says what an inference request for the model says: before the first
    list of pods is in, a model the worker does not know may be one of theirs (503, Retry-After);
    once they are listed it is found, and one that no pod serves is a 404."""
    import k8s.discovery
    from tests.support.waiting import until

    monkeypatch.setattr(k8s.discovery, "FIRST_LIST_WAIT_S", 0.0)
    sim = await sims("vllm", "llama")
    sim_pod(emu, "llama-0", sim, "llama")
    path = tmp_path / "kubeconfig"
    path.write_text(emu.kubeconfig())
    emu.hold_lists()

    async def get(model: str) -> tuple[int, str | None, dict]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
                s.get(f"{gw.url}/v1/models/{model}") as r:
            return r.status, r.headers.get("Retry-After"), await r.json()
    try:
        gw = await gateway([], kubernetes={"enabled": True, "kubeconfig": str(path), "namespaces": ["llm"]})
        status, retry_after, doc = await get("llama")
        assert (status, retry_after, doc["error"]["code"]) == (503, "5", "service_unavailable"), doc
        assert "not been listed yet" in doc["error"]["message"]
        assert (await get("nobody"))[0] == 503
        # Anthropic's SDK (anthropic-version) and its Messages requests: Anthropic's overload, 529
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            for method, path, body in (("GET", "/v1/models/llama", None),
                                       ("POST", "/v1/messages", {"model": "llama", "max_tokens": 2, "messages": CHAT})):
                async with s.request(method, gw.url + path, json=body, headers={"anthropic-version": "2023-06-01"}) as r:
                    doc = await r.json()
                    assert (r.status, r.headers.get("Retry-After")) == (529, "5"), doc
                    assert doc["type"] == "error" and doc["error"]["type"] == "overloaded_error", doc
        emu.release_lists()
        await until(lambda: gw.gw.pool.ready("llama"))
        status, _, doc = await get("llama")
        assert (status, doc["id"]) == (200, "llama")
        status, _, doc = await get("nobody")
        assert (status, doc["error"]["code"]) == (404, "model_not_found")
    finally:
        emu.release_lists()


async def test_a_model_whose_only_pod_is_made_again_is_not_a_404_in_between(emu, kube_block, sims, gateway):
    """A StatefulSet rolls its one pod by deleting it and then making it again under its name: in
    between, the model its pod served (here one the config does not name) is a 503 to retry, as
    while the pod was terminating, for a request and for ``GET /v1/models/{id}`` alike, not a 404
    model_not_found that no client retries; a model no pod ever served is still a 404."""
    sim = await sims("vllm", "llama")
    sim_pod(emu, "llama-0", sim, "llama")
    gw = await gateway([], kubernetes=kube_block)
    assert await wait_for(lambda: gw.gw.pool.ready("llama"), timeout=3)
    client = openai_client(gw)
    emu.mark_terminating("llm", "llama-0")
    assert await wait_for(lambda: not gw.gw.pool.ready("llama"), timeout=3)
    emu.delete_pod("llm", "llama-0")
    assert await wait_for(lambda: not gw.gw.pool.endpoints("llama"), timeout=3)
    with pytest.raises(openai.APIStatusError) as e:
        await client.chat.completions.create(model="llama", messages=CHAT, max_tokens=2)
    assert (e.value.status_code, e.value.response.headers.get("retry-after")) == (503, "5"), e.value.response.text
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/v1/models/llama") as r:
            assert r.status == 503 and r.headers.get("Retry-After") == "5"
        async with s.get(gw.url + "/v1/models/never") as r:
            assert r.status == 404
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="never", messages=CHAT, max_tokens=2)
    # a pod waiting for its address (Pending: not scheduled yet, its sandbox not made) is a pod of
    # its model too: a 503 until it serves
    emu.create_pod("llm", "qwen-0", {M: "qwen"}, ip=None, ready=False)
    assert await wait_for(lambda: gw.runner.app[DISCOVERY_KEY].status()["skipped"], timeout=3)
    with pytest.raises(openai.APIStatusError) as e:
        await client.chat.completions.create(model="qwen", messages=CHAT, max_tokens=2)
    assert e.value.status_code == 503, e.value.response.text
    sim_pod(emu, "llama-0", sim, "llama")
    assert await wait_for(lambda: gw.gw.pool.ready("llama"), timeout=3)
    r = await client.chat.completions.create(model="llama", messages=CHAT, max_tokens=2)
    assert r.choices[0].message.content
    await client.close()


async def test_pods_of_one_name_in_two_namespaces_are_two_endpoints_by_name(emu, sims, gateway, tmp_path):
    """A pod name is unique only within its namespace: with several namespaces watched, two pods of
    one name (a StatefulSet's ``engine-0`` in each) are two endpoints, told apart wherever an
    endpoint is named (the ``target-pod`` header, the ``endpoint`` metric label), and the one left
    when the other is deleted keeps serving under its own name."""
    a = await sims("vllm", "llama")
    b = await sims("vllm", "llama")
    for ns, sim in (("red", a), ("blue", b)):
        emu.create_pod(ns, "engine-0", {M: "llama", "model.aibrix.ai/port": str(sim.port)}, ip="127.0.0.1")
    kube = tmp_path / "kubeconfig"
    kube.write_text(emu.kubeconfig())
    gw = await gateway([], kubernetes={"enabled": True, "kubeconfig": str(kube), "namespaces": ["red", "blue"],
                                       "retry_backoff_s": 0.05},
                       routing={"strategy": "round-robin"})
    assert await wait_for(lambda: len(gw.gw.pool.ready("llama")) == 2, timeout=5)
    client = openai_client(gw)
    served = set()
    for _ in range(4):
        raw = await client.chat.completions.with_raw_response.create(model="llama", messages=CHAT, max_tokens=2)
        served.add(raw.headers["target-pod"])
    assert served == {"red/engine-0", "blue/engine-0"}
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        page = await r.text()
    lines = [ln.rsplit(" ", 1)[0] for ln in page.splitlines() if ln and not ln.startswith("#")]
    assert not [ln for ln in lines if lines.count(ln) > 1], "one series exported twice"
    infos = [ln for ln in lines if ln.startswith("switchyard_endpoint_info{")]
    assert sum('endpoint="red/engine-0"' in ln for ln in infos) == sum('endpoint="blue/engine-0"' in ln
                                                                       for ln in infos) == 1

    emu.delete_pod("red", "engine-0")
    assert await wait_for(lambda: [e.name for e in gw.gw.pool.endpoints("llama")] == ["blue/engine-0"], timeout=5)
    for _ in range(2):
        raw = await client.chat.completions.with_raw_response.create(model="llama", messages=CHAT, max_tokens=2)
        assert raw.headers["target-pod"] == "blue/engine-0"
    await client.close()


async def test_rolesets_of_one_name_in_two_namespaces_are_not_paired_across(emu, sims, gateway, tmp_path):
    """A roleset name is unique only within its namespace, like a pod's: with several namespaces
    watched, the prefill of ``rs-0`` in one is never paired with the decode of ``rs-0`` in the other
    (two deployments of one model, whose engines were not set up to pass KV to each other)."""
    pods = {}
    for ns in ("red", "blue"):
        for role in ("prefill", "decode"):
            sim = pods[ns, role] = await sims("vllm", "llama", role=role)
            emu.create_pod(ns, f"rs-0-{role}", {M: "llama", "model.aibrix.ai/port": str(sim.port),
                                                "role-name": role, "roleset-name": "rs-0"},
                           ip="127.0.0.1", ready=(ns, role) in (("red", "prefill"), ("blue", "decode")))
    kube = tmp_path / "kubeconfig"
    kube.write_text(emu.kubeconfig())
    gw = await gateway([{"name": "llama", "strategy": "pd"}],
                       kubernetes={"enabled": True, "kubeconfig": str(kube), "namespaces": ["red", "blue"],
                                   "retry_backoff_s": 0.05})
    assert await wait_for(lambda: len(gw.gw.pool.endpoints("llama")) == 4, timeout=5)
    body = {"model": "llama", "messages": CHAT, "max_tokens": 3}
    async with aiohttp.ClientSession() as s:
        # ready: red's prefill and blue's decode, two halves of two rolesets: no pair
        async with s.post(gw.base_url + "/chat/completions", json=body) as r:
            assert r.status == 503, await r.text()
        assert [(await sim_state(sim.url))["counts"]["started"] for sim in pods.values()] == [0, 0, 0, 0]
        emu.set_ready("red", "rs-0-decode", True)
        assert await wait_for(lambda: len(gw.gw.pool.ready("llama")) == 3, timeout=5)
        for _ in range(3):
            async with s.post(gw.base_url + "/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                assert (r.headers["prefill-target-pod"], r.headers["target-pod"]) == ("red/rs-0-prefill",
                                                                                     "red/rs-0-decode")


async def test_a_relist_that_finds_many_pods_gone_does_not_walk_the_pool_per_pod(emu, kube_block, gateway, monkeypatch):
    """A relist that finds thousands of pods gone (their namespace emptied while the watch heard
    nothing) takes them out in one synchronous step on the event loop. What each removal asks of
    the pool (whether an endpoint left at the same URL keeps the engine's connections, or its
    routing facts under the same key) is not a walk of every endpoint: that made the step
    O(pods²) (measured: 4000 pods of one model held the loop 9.5 s)."""
    from gateway.endpoints import EndpointPool

    for i in range(200):
        emu.create_pod("llm", f"p{i}", {M: "llama"})
    gw = await gateway([], kubernetes=kube_block, health={"enabled": False}, scrape={"enabled": False})
    disc = gw.runner.app[DISCOVERY_KEY]
    assert await wait_for(lambda: len(gw.gw.pool.endpoints("llama")) == 200 and len(emu.watchers) == 1, timeout=5)
    walks = 0
    endpoints = EndpointPool.endpoints

    def counted(self, model=None):
        nonlocal walks
        walks += 1
        return endpoints(self, model)

    reconcile = disc._reconcile

    def measured(*args, **kwargs):
        monkeypatch.setattr(EndpointPool, "endpoints", counted)
        try:
            reconcile(*args, **kwargs)
        finally:
            monkeypatch.setattr(EndpointPool, "endpoints", endpoints)

    monkeypatch.setattr(disc, "_reconcile", measured)
    emu.partition()
    for i in range(200):
        emu.delete_pod("llm", f"p{i}")
    emu.create_pod("llm", "q", {M: "qwen"})
    emu.compact()
    emu.heal()
    emu.break_watches()
    assert await wait_for(lambda: gw.gw.pool.models() == ["qwen"], timeout=5)
    assert disc.stats["lists"] == 2 and walks <= 2


async def test_a_pod_changed_in_place_keeps_its_engines_connections(emu, kube_block, sims, gateway):
    """A pod whose annotations change in place (its ``model.aibrix.ai/config``; or a reload of
    ``kubernetes.models``, which changes every pod of the model) at the same address, serving the
    same model, is the same engine: the connection kept open to it serves the next request, rather
    than being closed as if the engine had left (every engine of the model at once, on a reload)."""
    sim = await sims("vllm", "llama")
    sim_pod(emu, "a", sim, "llama")
    gw = await gateway([], kubernetes=kube_block, health={"enabled": False}, scrape={"enabled": False})
    assert await wait_for(lambda: gw.gw.pool.ready("llama"), timeout=5)
    client = openai_client(gw)
    await client.chat.completions.create(model="llama", messages=CHAT, max_tokens=2)
    assert await wait_for(lambda: gw.gw.upstream.connections() == (0, 1), timeout=5)
    [before] = gw.gw.pool.endpoints("llama")
    emu.update_pod("llm", "a", lambda p: p["metadata"]["annotations"].update(
        {"model.aibrix.ai/config": '{"profiles": {"default": {"routingStrategy": "random"}}}'}))
    assert await wait_for(lambda: gw.gw.pool.endpoints("llama") != [before], timeout=5)
    assert gw.gw.upstream.connections() == (0, 1)
    raw = await client.chat.completions.with_raw_response.create(model="llama", messages=CHAT, max_tokens=2)
    assert raw.headers["target-pod"] == "a" and gw.gw.upstream.connections() == (0, 1)
    await client.close()
