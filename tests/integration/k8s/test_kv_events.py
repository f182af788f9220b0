"""The pod annotation ``switchyard.io/kv-events`` on Kubernetes, end to end: pods in the API server
emulator point at simulated vLLM engines on 127.0.0.1 that publish KV events; the annotation turns
on the gateway's subscription to the annotated port and topic, and a bad value is refused (logged,
counted) while the pod keeps serving on the approximate index."""

from __future__ import annotations

import asyncio
import json

import pytest

from enginesim.tiny_tokenizer import TINY_DIR
from gateway.server.app import DISCOVERY_KEY
from tests.support.factories import sim_pod
from tests.support.http import openai_client
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

M = "model.aibrix.ai/name"
KV = "switchyard.io/kv-events"
TOK = str(TINY_DIR)
SYSTEM = "You are a careful assistant. " + " ".join(f"rule {i} is kqz lo abc" for i in range(60))


async def test_annotation_subscribes_the_pod_on_its_port_and_topic(emu, tmp_path, sims, gateway, capsys):
    # a: annotated with its publisher's ports and topic; b: a bad annotation; c: none
    a = await sims("vllm", model="m", tokenizer=TOK, kv_events_port=0, kv_events_replay_port=0,
                   kv_events_topic="kv@a")
    b = await sims("vllm", model="m", tokenizer=TOK, kv_events_port=0)
    c = await sims("vllm", model="m", tokenizer=TOK)
    pa = a.engine.kv_events
    sim_pod(emu, "a", a, annotations={KV: json.dumps({"port": pa.port, "replay_port": pa.replay_port, "topic": "kv@a"})})
    sim_pod(emu, "b", b, annotations={KV: '{"port": "five"}'})
    sim_pod(emu, "c", c)
    path = tmp_path / "kubeconfig"
    path.write_text(emu.kubeconfig())
    # the model has a tokenizer and no kv_events block: the annotation alone subscribes
    gw = await gateway([{"name": "m", "engine": "vllm", "tokenizer": TOK, "strategy": "prefix-cache"}],
                       kubernetes={"enabled": True, "kubeconfig": str(path), "namespaces": ["llm"],
                                   "retry_backoff_s": 0.05})
    kv = gw.gw.routing.ctx.precise_index
    assert await wait_for(lambda: len(gw.gw.pool.ready("m")) == 3 and kv.subscribers, timeout=5)
    await asyncio.sleep(0.1)                     # the sync loop has seen every pod
    ((sub,),) = kv.subscribers.values()
    assert sub.st.ep.name == "a"
    assert sub.pub_addr == f"tcp://127.0.0.1:{pa.port}" and sub.replay_addr == f"tcp://127.0.0.1:{pa.replay_port}"
    assert sub.st.settings.topic == "kv@a" and sub.st.settings.enabled

    # the bad annotation: refused with the reason, counted, the pod still serves
    assert gw.runner.app[DISCOVERY_KEY].stats["kv_events_refused"] == 1
    refused = [line for line in capsys.readouterr().out.splitlines() if "annotation refused" in line]
    assert len(refused) == 1 and "pod=llm/b" in refused[0] and "got 'five'" in refused[0]
    assert await wait_for(lambda: 'reason="bad_annotation"' in gw.gw.metrics.render().decode(), timeout=3)
    text = await gw.metrics_text()
    assert 'switchyard_kv_events_fallbacks_total{model="m",reason="bad_annotation"} 1.0' in text
    ep_b = next(e for e in gw.gw.pool.endpoints("m") if e.name == "b")
    assert "port must be a port number" in ep_b.extra["kv_events_error"] and not ep_b.draining

    # events from pod a fill the index (b and c leave, so every request lands on a)
    emu.delete_pod("llm", "b")
    emu.delete_pod("llm", "c")
    assert await wait_for(lambda: [e.name for e in gw.gw.pool.endpoints("m")] == ["a"], timeout=5)
    client = openai_client(gw)
    for q in ("one", "two"):
        r = await client.chat.completions.create(model="m", max_tokens=2, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
    await client.close()
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    st = sub.st
    assert await wait_for(lambda: len(st.emap) == a.engine.pool.cached_blocks > 0, timeout=5)
    assert 'switchyard_kv_events_total{kind="BlockStored",model="m"}' in await gw.metrics_text()
