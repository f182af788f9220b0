"""P/D end to end on loopback: the gateway in front of enginesim prefill/decode engines.

Every row of the failure table, for both engines where it applies, with `/_sim/state` as the
proof that legs were cancelled or aborted, and the autouse check that every tracker is released.
"""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import orjson
import pytest

from tests.conftest import sim_state, sse_events, wait_for

MSG = [{"role": "user", "content": "Disaggregated serving splits prefill from decode. " * 8}]


async def pd_pair(sims, engine: str, **kw):
    p = await sims(engine, "m", role="prefill", **kw)
    d = await sims(engine, "m", role="decode", **kw)
    return p, d


def roleset(engine: str, p, d, name="rs-1", **extra) -> dict:
    if engine == "sglang":
        prefill = [{"url": p.url, "bootstrap_port": p.bootstrap_port}]
    else:
        prefill = [p.url]
    return {"name": name, "prefill": prefill, "decode": [d.url], **extra}


def pd_model(engine: str, rolesets: list[dict], **extra) -> dict:
    return {"name": "m", "engine": engine, "rolesets": rolesets, **extra}


async def post(gw, payload, headers=None):
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/chat/completions", json=payload,
                                                    headers=headers or {}) as r:
        return r.status, r.headers, await r.read()


def body(stream=False, max_tokens=8, **kw):
    return {"model": "m", "messages": MSG, "stream": stream, "max_tokens": max_tokens, **kw}


async def quiet(url) -> bool:
    """No request left running or waiting on the engine."""
    st = await sim_state(url)
    return not st["running"] and not st["waiting"] and not st.get("pd", {}).get("rooms_waiting")


ENGINES = ["vllm", "sglang"]


@pytest.mark.parametrize("engine", ENGINES)
async def test_happy_path_through_the_sdk(sims, gateway, engine):
    p, d = await pd_pair(sims, engine)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])])
    client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="none", max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(model="m", messages=MSG, max_tokens=6)
    assert raw.headers["prefill-target-pod"] == p.url.split("//")[1]
    assert raw.headers["target-pod"] == d.url.split("//")[1]
    assert raw.headers["routing-strategy"] == "pd"
    r = raw.parse()
    assert r.choices[0].message.content and r.usage.completion_tokens == 6

    stream = await client.chat.completions.create(model="m", messages=MSG, max_tokens=6, stream=True)
    text = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(text)
    await client.close()
    ps, ds = await sim_state(p.url), await sim_state(d.url)
    assert ps["counts"]["completed"] == 2 and ds["counts"]["completed"] == 2
    metrics = await gw.metrics_text()
    assert 'switchyard_pd_prefill_seconds_count{model="m"} 2.0' in metrics
    assert "switchyard_pd_kv_transfer_seconds_count" in metrics


async def test_vllm_decode_receives_the_kv_and_counts_it_cached(sims, gateway):
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])])
    st, _, raw = await post(gw, body())
    assert st == 200
    usage = orjson.loads(raw)["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0      # pulled from the prefill
    assert (await sim_state(d.url))["pd"]["transfers"] == 1


async def test_sglang_duplicate_controlled_key_touches_no_engine(sims, gateway):
    p, d = await pd_pair(sims, "sglang")
    gw = await gateway([pd_model("sglang", [roleset("sglang", p, d)])])
    raw = b'{"model":"m","messages":[{"role":"user","content":"x"}],"stream":false,"stream":true}'
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/chat/completions", data=raw,
                                                    headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400 and r.headers["x-error-routing"] == "true"
        assert "duplicate" in (await r.json())["error"]["message"]
    for sim in (p, d):
        assert (await sim_state(sim.url))["counts"]["started"] == 0


async def test_incomplete_roleset_uses_combined_or_fails(sims, gateway):
    d = await sims("vllm", "m", role="decode")
    c = await sims("vllm", "m")
    gw = await gateway([pd_model("vllm", [{"name": "rs", "decode": [d.url], "combined": [c.url]}])])
    st, hdrs, _ = await post(gw, body())
    assert st == 200 and hdrs["target-pod"] == c.url.split("//")[1] and "prefill-target-pod" not in hdrs
    gw2 = await gateway([pd_model("vllm", [{"name": "rs", "decode": [d.url]}])])
    st, hdrs, raw = await post(gw2, body())
    assert st == 503 and hdrs["x-error-routing"] == "true"


async def test_no_ready_pod(gateway):
    gw = await gateway([pd_model("vllm", [{"name": "rs", "prefill": ["http://127.0.0.1:9"],
                                           "decode": ["http://127.0.0.1:9"]}])],
                       health={"interval_s": 0.05, "unhealthy_threshold": 1})
    assert await wait_for(lambda: not any(ep.ready for ep in gw.gw.pool.endpoints()), timeout=5)
    st, _, _ = await post(gw, body())
    assert st == 503


@pytest.mark.parametrize("engine", ENGINES)
async def test_prefill_error_fails_fast(sims, gateway, engine):
    p, d = await pd_pair(sims, engine)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])])
    st, hdrs, raw = await post(gw, body(stream=True), {"x-sim-fault": "prefill.status=503"})
    assert st == 502
    assert hdrs["x-error-pd-prefill"] == "http_status"
    assert hdrs["prefill-target-pod"] == p.url.split("//")[1]
    assert "503" in orjson.loads(raw)["error"]["message"]
    if engine == "vllm":
        assert (await sim_state(d.url))["counts"]["started"] == 0          # no decode leg at all
    else:
        assert await wait_for(lambda: quiet(d.url), timeout=5)              # the decode was aborted
        assert 'switchyard_pd_aborts_total{model="m",result="ok"}' in await gw.metrics_text()


@pytest.mark.parametrize("engine", ENGINES)
async def test_prefill_timeout(sims, gateway, engine):
    p, d = await pd_pair(sims, engine)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])], pd={"prefill_timeout_s": 0.3})
    st, hdrs, _ = await post(gw, body(), {"x-sim-fault": "prefill.hang=inf"})
    assert st == 504 and hdrs["x-error-pd-prefill"] == "timeout"
    assert await wait_for(lambda: quiet(p.url), timeout=5)
    assert await wait_for(lambda: quiet(d.url), timeout=5)


@pytest.mark.parametrize("engine", ENGINES)
async def test_prefill_refused(sims, gateway, engine):
    d = await sims(engine, "m", role="decode")
    rs = {"name": "rs", "prefill": [{"url": "http://127.0.0.1:9", "bootstrap_port": 9}], "decode": [d.url]}
    gw = await gateway([pd_model(engine, [rs])], health={"interval_s": 60})
    st, hdrs, raw = await post(gw, body())
    assert st == 503 and hdrs["x-error-pd-prefill"] == "transport"
    assert "transport" in orjson.loads(raw)["error"]["message"]
    assert await wait_for(lambda: quiet(d.url), timeout=5)


async def test_sglang_decode_stall_before_first_token(sims, gateway):
    p, d = await pd_pair(sims, "sglang")
    gw = await gateway([pd_model("sglang", [roleset("sglang", p, d)])], watchdog={"first_chunk_timeout_s": 0.5})
    st, hdrs, _ = await post(gw, body(stream=True), {"x-sim-fault": "decode.stall_before_first=30"})
    assert st == 504 and hdrs["x-error-pd-decode"] == "true"
    assert await wait_for(lambda: quiet(d.url), timeout=5)
    assert 'switchyard_watchdog_fires_total{model="m",phase="first_chunk"} 1.0' in await gw.metrics_text()


@pytest.mark.parametrize("engine", ENGINES)
async def test_decode_stall_mid_stream(sims, gateway, engine):
    p, d = await pd_pair(sims, engine)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])], watchdog={"idle_timeout_s": 0.3})
    st, _, raw = await post(gw, body(stream=True, max_tokens=20), {"x-sim-fault": "decode.stall_after=3:30"})
    assert st == 200
    last = sse_events(raw)[-1]
    assert last["error"]["code"] == "upstream_timeout"
    assert await wait_for(lambda: quiet(d.url), timeout=5)
    assert 'phase="idle"' in await gw.metrics_text()


@pytest.mark.parametrize("engine", ENGINES)
async def test_decode_dying_mid_stream(sims, gateway, engine):
    p, d = await pd_pair(sims, engine)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])])
    st, _, raw = await post(gw, body(stream=True, max_tokens=20), {"x-sim-fault": "decode.drop_after=3"})
    assert st == 200
    assert sse_events(raw)[-1]["error"]["code"] == "upstream_incomplete"


@pytest.mark.parametrize("policy,status", [("fail", 500), ("recompute", 200)])
async def test_vllm_kv_pull_failure_policies(sims, gateway, policy, status):
    p = await sims("vllm", "m", role="prefill")
    d = await sims("vllm", "m", role="decode", kv_load_failure_policy=policy)
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])])
    st, _, raw = await post(gw, body(), {"x-sim-fault": "decode.kv_pull_fail=1"})
    assert st == status
    if status == 500:
        assert orjson.loads(raw)["error"]["message"]


@pytest.mark.parametrize("engine", ENGINES)
async def test_client_disconnect_during_prefill_cancels_both_legs(sims, gateway, engine):
    p, d = await pd_pair(sims, engine)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])])
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(gw.url + "/v1/chat/completions", json=body(stream=True),
                                          headers={"x-sim-fault": "prefill.hang=inf"}))
        assert await wait_for(lambda: _busy(p.url), timeout=5)
        task.cancel()
    assert await wait_for(lambda: quiet(p.url), timeout=8)
    assert await wait_for(lambda: quiet(d.url), timeout=8)
    assert await wait_for(lambda: gw.gw.lifecycle.in_flight == 0, timeout=5)


async def _busy(url) -> bool:
    st = await sim_state(url)
    return bool(st["running"] or st["waiting"])


@pytest.mark.parametrize("engine", ENGINES)
async def test_client_disconnect_during_decode(sims, gateway, engine):
    p = await sims(engine, "m", role="prefill")
    d = await sims(engine, "m", role="decode", itl_ms=50)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])])
    async with aiohttp.ClientSession() as s:
        resp = await s.post(gw.url + "/v1/chat/completions", json=body(stream=True, max_tokens=500))
        assert resp.status == 200
        await resp.content.readline()
        resp.close()
    assert await wait_for(lambda: quiet(d.url), timeout=8)
    assert (await sim_state(d.url))["counts"]["aborted"] >= 1


@pytest.mark.parametrize("engine", ENGINES)
async def test_trackers_balance_under_concurrency(sims, gateway, engine):
    p1, d1 = await pd_pair(sims, engine)
    p2, d2 = await pd_pair(sims, engine)
    gw = await gateway([pd_model(engine, [roleset(engine, p1, d1, "a"), roleset(engine, p2, d2, "b")])])
    results = await asyncio.gather(*(post(gw, body(stream=i % 2 == 0, max_tokens=4)) for i in range(24)))
    assert all(st == 200 for st, _, _ in results)
    pairs = {(h["prefill-target-pod"], h["target-pod"]) for _, h, _ in results}
    by_rs = {p1.url.split("//")[1]: d1.url.split("//")[1], p2.url.split("//")[1]: d2.url.split("//")[1]}
    assert all(by_rs[pp] == dd for pp, dd in pairs)       # never paired across rolesets


async def test_vllm_decode_stall_before_first_token_after_headers(sims, gateway):
    # vLLM sends its headers at once, so the first-chunk watchdog fires after them: a final SSE
    # error event, and the decode connection is closed (vLLM's abort)
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])], watchdog={"first_chunk_timeout_s": 0.5})
    st, _, raw = await post(gw, body(stream=True), {"x-sim-fault": "decode.stall_before_first=30"})
    assert st == 200
    assert sse_events(raw)[-1]["error"]["code"] == "upstream_timeout"
    assert await wait_for(lambda: quiet(d.url), timeout=5)
    assert 'phase="first_chunk"' in await gw.metrics_text()
