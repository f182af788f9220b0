"""Pods churning under traffic, as a real gateway of ``--workers 1`` and ``--workers 2`` meets
it: the openai SDK streams without a pause while a pod is deleted and made again under its name at
a new address, another
has its port label changed, its readiness flaps, is marked terminating with requests on it, and a
pod moves to another model. No request the pods could serve is lost, none goes to an engine after
every worker saw its pod leave, every worker ends with the same pods, and the series of an
endpoint that left go after ``server.removed_endpoint_series_s``."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.support.factories import sim_pod
from tests.support.gateway_process import gateway_process, per_worker
from tests.support.http import sim_state
from tests.support.ports import listen_port
from tests.support.waiting import until

M = "model.aibrix.ai/name"
CHAT = [{"role": "user", "content": "Which pod answers now?"}]


def pods(doc: dict) -> list[tuple[str, str, str, bool]]:
    return sorted((e["model"], e["name"], e["url"], e["ready"]) for e in doc["endpoints"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2])
async def test_pods_churning_under_traffic_lose_no_request_and_every_worker_follows(emu, sims, tmp_path, workers):
    s0, s1, s2, s3 = [await sims("vllm", "llama", itl_ms=5) for _ in range(4)]
    q = await sims("vllm", "qwen")
    sim_pod(emu, "p0", s0, "llama")
    sim_pod(emu, "p1", s1, "llama")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(emu.kubeconfig())
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, shutdown_grace_s: 2, log_level: warning, removed_endpoint_series_s: 0.3}\n"
                   "routing: {strategy: round-robin}\n"
                   f"kubernetes: {{enabled: true, kubeconfig: '{kubeconfig}', namespaces: [llm], retry_backoff_s: 0.05}}\n")

    async def both(expected: list[tuple[str, str, str, bool]]) -> None:
        async def seen() -> bool:
            return all(pods(d) == expected for d in (await per_worker(port, workers, "/status.json")).values())
        await until(seen, timeout=10)

    async with gateway_process(cfg, port, "--workers", str(workers), ready_workers=workers):
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        errors: list[str] = []
        served = [0, 0, 0, 0]           # requests each load task has seen through
        stop = asyncio.Event()

        async def settled() -> None:
            """Every request under way when this is called has ended: each task saw one more through."""
            start = list(served)
            await until(lambda: all(a > b for a, b in zip(served, start, strict=True)))

        async def load(i: int) -> None:
            while not stop.is_set():
                try:
                    stream = await client.chat.completions.create(model="llama", messages=CHAT, max_tokens=6,
                                                                  stream=True)
                    chunks = [c async for c in stream]
                    assert chunks[-1].choices[0].finish_reason == "length"
                    served[i] += 1
                except Exception as e:  # noqa: BLE001 - every failure is the test's finding
                    errors.append(f"{type(e).__name__}: {e}")

        tasks = [asyncio.create_task(load(i)) for i in range(4)]
        try:
            await until(lambda: min(served) >= 2)
            # p0 deleted, made again under its name at a new address
            emu.delete_pod("llm", "p0")
            sim_pod(emu, "p0", s2, "llama")
            await both([("llama", "p0", s2.url, True), ("llama", "p1", s1.url, True)])
            # p1's serving port changes
            emu.set_labels("llm", "p1", **{"model.aibrix.ai/port": str(s3.port)})
            await both([("llama", "p0", s2.url, True), ("llama", "p1", s3.url, True)])
            await settled()         # what was routed before every worker saw it has started
            gone = {s.url: (await sim_state(s.url))["counts"]["started"] for s in (s0, s1)}
            # p1's readiness flaps, and ends ready
            for ready in (False, True, False, True, False, True):
                emu.set_ready("llm", "p1", ready)
            await both([("llama", "p0", s2.url, True), ("llama", "p1", s3.url, True)])
            # p0 terminating with requests on it: they end, no new one comes; then it is deleted
            emu.mark_terminating("llm", "p0")
            await both([("llama", "p0", s2.url, False), ("llama", "p1", s3.url, True)])
            await settled()
            on_p0 = (await sim_state(s2.url))["counts"]["started"]
            await settled()
            await settled()
            assert (await sim_state(s2.url))["counts"]["started"] == on_p0       # no new request on it
            emu.delete_pod("llm", "p0")
            await both([("llama", "p1", s3.url, True)])
            sim_pod(emu, "p0", s2, "llama")
            await both([("llama", "p0", s2.url, True), ("llama", "p1", s3.url, True)])
            await settled()
            # p0's labels move it to qwen, served at q
            emu.set_labels("llm", "p0", **{M: "qwen", "model.aibrix.ai/port": str(q.port)})
            await both([("llama", "p1", s3.url, True), ("qwen", "p0", q.url, True)])
            await settled()
            await settled()
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        assert errors == []
        # the engines whose pods left got nothing after every worker saw them go
        assert {s.url: (await sim_state(s.url))["counts"]["started"] for s in (s0, s1)} == gone
        for sim in (s0, s1, s2, s3):
            assert (await sim_state(sim.url))["counts"]["aborted"] == 0
        raw = await client.chat.completions.with_raw_response.create(model="qwen", messages=CHAT, max_tokens=2)
        assert raw.headers["target-pod"] == "p0"
        await client.close()

        # each worker's per-endpoint series: those of llama's p0 went once its last request ended
        async def series_follow() -> bool:
            pages = await per_worker(port, workers, "/metrics")
            return all('model="llama",endpoint="p0"' not in page.replace('endpoint="p0",model="llama"',
                                                                          'model="llama",endpoint="p0"')
                       and 'endpoint="p1"' in page for page in pages.values())
        await until(series_follow, timeout=10)
