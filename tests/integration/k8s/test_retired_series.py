"""Pods come and go: the metric series labelled with a pod that left the pool stay exported while
its last request runs and ``server.removed_endpoint_series_s`` after, then go (with its breaker),
so a fleet that rolls its pods every hour does not export and hold a series per pod it ever had,
nor the latency models learnt of it."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.support.factories import sim_pod
from tests.support.http import openai_client
from tests.support.metrics import sample_map
from tests.support.waiting import wait_for

CHAT = [{"role": "user", "content": "Which pods were here before?"}]
PER_ENDPOINT = ("switchyard_upstream_outcomes_total", "switchyard_health_probes_total")


async def endpoints_in_metrics(base: str) -> dict[str, set[str]]:
    """For each per-endpoint metric, the endpoints it has series for."""
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        page = await r.text()
    out: dict[str, set[str]] = {name: set() for name in PER_ENDPOINT}
    for (name, labels), _ in sample_map(page).items():
        if name in out:
            out[name].add(dict(labels)["endpoint"])
    return out


async def test_a_deleted_pods_series_go_after_its_last_request_and_the_grace(emu, sims, gateway, tmp_path):
    a = await sims("vllm", "llama", itl_ms=30.0)
    b = await sims("vllm", "llama")
    sim_pod(emu, "a", a, "llama")
    sim_pod(emu, "b", b, "llama")
    kube = tmp_path / "kubeconfig"
    kube.write_text(emu.kubeconfig())
    gw = await gateway([], kubernetes={"enabled": True, "kubeconfig": str(kube), "namespaces": ["llm"],
                                       "retry_backoff_s": 0.05},
                       server={"removed_endpoint_series_s": 0.3},
                       routing={"strategy": "round-robin"})       # each pod gets requests, so series
    assert await wait_for(lambda: len(gw.gw.pool.ready("llama")) == 2, timeout=5)
    client = openai_client(gw)
    for _ in range(4):              # streamed: the latency models (slo) learn of both pods too
        stream = await client.chat.completions.create(model="llama", messages=CHAT, max_tokens=2, stream=True)
        async for _ in stream:
            pass

    async def both_seen() -> bool:
        seen = await endpoints_in_metrics(gw.url)
        return all(s == {"a", "b"} for s in seen.values())
    assert await wait_for(both_seen, timeout=5)

    # a stream runs on pod a while a is deleted
    ep_a, ep_b = sorted(gw.gw.pool.endpoints("llama"), key=lambda e: e.name)
    latency = gw.gw.gen.routing.ctx.latency
    assert await wait_for(lambda: latency.samples(ep_a)[0] and latency.samples(ep_b)[0], timeout=5)
    ep_b.draining = True
    stream = await client.chat.completions.create(model="llama", messages=CHAT, max_tokens=200, stream=True)
    ep_b.draining = False
    await stream.__anext__()
    assert ep_a.in_flight == 1
    assert id(ep_a) in gw.gw.upstream.breakers._by_ep
    emu.delete_pod("llm", "a")
    assert await wait_for(lambda: [e.name for e in gw.gw.pool.endpoints("llama")] == ["b"], timeout=5)

    # long past the grace, its series are still there while its request is not over (the page is
    # read first: a request still in flight after the read was in flight during it)
    checked = 0
    for _ in range(4):              # the sweep runs every 0.2 s here
        await asyncio.sleep(0.3)
        seen = await endpoints_in_metrics(gw.url)
        if ep_a.in_flight:
            assert "a" in seen["switchyard_upstream_outcomes_total"]
            checked += 1
    assert checked                  # the stream (200 tokens, 30 ms apart) outlasts a few checks
    await stream.close()            # the client goes: the leg ends

    async def a_gone() -> bool:
        seen = await endpoints_in_metrics(gw.url)
        return all(s == {"b"} for s in seen.values())
    assert await wait_for(a_gone, timeout=5)
    assert id(ep_a) not in gw.gw.upstream.breakers._by_ep and gw.gw.pool.retired == []
    assert latency.samples(ep_a) == (0, 0) and latency.samples(ep_b)[0]      # its latency models went too
    # and b's counts go on
    await client.chat.completions.create(model="llama", messages=CHAT, max_tokens=2)
    assert (await endpoints_in_metrics(gw.url))["switchyard_upstream_outcomes_total"] == {"b"}
    await client.close()
