"""The API server emulator speaks the real wire format: its objects load into the official client's
models, and the typed kubernetes-asyncio API and its Watch consume it as they would a cluster."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import kubernetes
import pytest
from kubernetes_asyncio import client as aclient
from kubernetes_asyncio import config as aconfig
from kubernetes_asyncio import watch as awatch

from tests.support.kube_emulator import KubeEmulator

M = "model.aibrix.ai/name"
AUTH = {"Authorization": "Bearer test-token"}


def official(data, klass: str):
    """Deserialize with the official (sync) client's models, as it does a response body (its model
    constructors validate required fields and enum values)."""
    return kubernetes.client.ApiClient()._ApiClient__deserialize(data, klass)


@pytest.fixture
async def emu():
    e = KubeEmulator(bookmark_interval=0.05)
    await e.start()
    yield e
    await e.close()


async def read_events(resp: aiohttp.ClientResponse, n: int) -> list[dict]:
    out = []
    while len(out) < n:
        line = await asyncio.wait_for(resp.content.readline(), 3)
        if not line:
            break
        out.append(json.loads(line))
    return out


async def test_list_and_watch_payloads_load_into_the_official_models(emu):
    emu.create_pod("llm", "a", {M: "llama", "role-name": "prefill"}, annotations={"x": "y"})
    async with aiohttp.ClientSession(headers=AUTH) as s:
        async with s.get(f"{emu.url}/api/v1/namespaces/llm/pods", params={"labelSelector": M}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("application/json")
            body = await r.json()
        pods = official(body, "V1PodList")
        assert isinstance(pods, kubernetes.client.V1PodList)
        assert pods.metadata.resource_version == str(emu.rv)
        p = pods.items[0]
        assert (p.metadata.name, p.metadata.labels["role-name"], p.status.pod_ip) == ("a", "prefill", "10.1.0.2")
        assert [c.status for c in p.status.conditions if c.type == "Ready"] == ["True"]

        rv = body["metadata"]["resourceVersion"]
        params = {"watch": "true", "resourceVersion": rv, "allowWatchBookmarks": "true", "timeoutSeconds": "5"}
        async with s.get(f"{emu.url}/api/v1/namespaces/llm/pods", params=params) as w:
            emu.set_ready("llm", "a", False)
            emu.mark_terminating("llm", "a")
            emu.delete_pod("llm", "a")
            events = await read_events(w, 4)
    types = [e["type"] for e in events]
    assert types[:3] == ["MODIFIED", "MODIFIED", "DELETED"] and types[3] == "BOOKMARK"
    for e in events[:3]:
        pod = official(e["object"], "V1Pod")
        assert isinstance(pod, kubernetes.client.V1Pod) and pod.metadata.name == "a"
    assert official(events[1]["object"], "V1Pod").metadata.deletion_timestamp is not None
    rvs = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
    assert rvs == sorted(rvs) and rvs[-1] == emu.rv       # bookmark: the current revision


async def test_too_old_resource_version_is_410_as_an_error_event_and_on_exact_lists(emu):
    emu.create_pod("llm", "a", {M: "llama"})
    old = str(emu.rv)
    emu.create_pod("llm", "b", {M: "llama"})
    emu.compact()
    async with aiohttp.ClientSession(headers=AUTH) as s:
        async with s.get(f"{emu.url}/api/v1/pods", params={"watch": "1", "resourceVersion": old}) as w:
            assert w.status == 200
            events = await read_events(w, 2)
        assert len(events) == 1 and events[0]["type"] == "ERROR"
        status = official(events[0]["object"], "V1Status")
        assert (status.code, status.reason, status.status) == (410, "Expired", "Failure")
        async with s.get(f"{emu.url}/api/v1/pods",
                         params={"resourceVersion": old, "resourceVersionMatch": "Exact"}) as r:
            assert r.status == 410 and official(await r.json(), "V1Status").code == 410


async def test_watch_without_resource_version_starts_with_the_current_state(emu):
    emu.create_pod("a", "p1", {M: "llama"})
    emu.create_pod("b", "p2", {M: "llama"})
    emu.create_pod("b", "other", {"app": "x"})
    async with aiohttp.ClientSession(headers=AUTH) as s:
        async with s.get(f"{emu.url}/api/v1/pods", params={"watch": "true", "labelSelector": M,
                                                           "timeoutSeconds": "1"}) as w:
            events = await read_events(w, 10)      # ends cleanly at timeoutSeconds
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "p1"), ("ADDED", "p2")]


async def test_auth_and_bad_selectors_answer_status_objects(emu):
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{emu.url}/api/v1/pods") as r:
            assert r.status == 401 and official(await r.json(), "V1Status").reason == "Unauthorized"
        async with s.get(f"{emu.url}/api/v1/pods", headers={"Authorization": "Bearer nope"}) as r:
            assert r.status == 401
        async with s.get(f"{emu.url}/api/v1/pods", headers=AUTH, params={"labelSelector": "a in ("}) as r:
            assert r.status == 400 and (await r.json())["kind"] == "Status"


async def test_typed_kubernetes_asyncio_api_and_watch_consume_the_emulator(emu, tmp_path):
    emu.create_pod("llm", "a", {M: "llama"})
    kc = tmp_path / "kubeconfig"
    kc.write_text(emu.kubeconfig())
    cfg = aclient.Configuration()
    await aconfig.load_kube_config(config_file=str(kc), client_configuration=cfg, persist_config=False)
    async with aclient.ApiClient(configuration=cfg) as api:
        v1 = aclient.CoreV1Api(api)
        pods = await v1.list_namespaced_pod("llm", label_selector=M)
        assert [p.metadata.name for p in pods.items] == ["a"]
        assert (await v1.read_namespaced_pod("a", "llm")).status.pod_ip == "10.1.0.2"
        seen = []
        async with awatch.Watch() as w:
            async for ev in w.stream(v1.list_namespaced_pod, "llm", resource_version=pods.metadata.resource_version,
                                     allow_watch_bookmarks=True, timeout_seconds=2):
                if ev["type"] == "BOOKMARK" and not seen:
                    emu.create_pod("llm", "b", {M: "llama"})
                elif ev["type"] == "ADDED":
                    seen.append(ev["object"])
                    w.stop()
        assert isinstance(seen[0], aclient.V1Pod) and seen[0].metadata.name == "b"
