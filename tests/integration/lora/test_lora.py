"""LoRA adapters on loopback: discovery from /v1/models, adapter-aware routing, loading on demand
under concurrency, failed loads and their cool-down, enginesim's slots, load calls and metric."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import aiohttp
import anthropic
import msgspec
import openai
import pytest
import structlog

from gateway.config.schema import config_from_dict
from gateway.request import CHAT, COMPLETIONS, EMBEDDINGS
from gateway.server.app import RELOAD_KEY
from tests.support.enginesim import restart_sim, start_sim
from tests.support.factories import model_block
from tests.support.http import anthropic_client, chat_body, openai_client, post, sim_state
from tests.support.lora import FAST_LORA, LORA_SIM, MSG, chat, load_calls
from tests.support.metrics import metric
from tests.support.waiting import until, wait_for


async def test_discovered_adapter_routes_to_its_endpoint_with_the_sdk(sims, gateway):
    a = await sims("vllm", "m", lora_modules=("sql=org/sql-lora",), **LORA_SIM)
    b = await sims("vllm", "m", **LORA_SIM)
    gw = await gateway([model_block("m", "vllm", [a.url, b.url])], lora=FAST_LORA)
    await wait_for(lambda: any("sql" in ep.adapters.served for ep in gw.gw.pool.endpoints()))
    client = openai_client(gw)
    for _ in range(4):
        raw = await client.chat.completions.with_raw_response.create(model="sql", messages=MSG, max_tokens=3)
        assert raw.headers["target-pod"] == a.url.split("//")[1]
        assert raw.headers["routing-strategy"] == "lora-affinity"
        assert raw.parse().model == "sql"
    models = {m.id: m for m in (await client.models.list()).data}
    assert models["sql"].model_extra["parent"] == "m"
    assert models["sql"].model_extra["ready_endpoints"] == 1
    with pytest.raises(openai.NotFoundError) as e:
        await client.chat.completions.create(model="nope", messages=MSG, max_tokens=3)
    assert e.value.body["code"] == "model_not_found"
    await client.close()
    st = await sim_state(a.url)
    assert st["lora"]["cold_loads"] == 1 and st["counts"]["completed"] == 4
    assert (await sim_state(b.url))["counts"]["started"] == 0
    text = await gw.metrics_text()
    assert 'switchyard_lora_requests_total{adapter="sql",model="m"' in text
    assert 'switchyard_lora_adapter_endpoints{adapter="sql",model="m"} 1.0' in text


async def test_concurrent_requests_wait_on_one_load(sims, gateway):
    a = await sims("vllm", "m", **LORA_SIM)
    b = await sims("vllm", "m", **LORA_SIM)
    gw = await gateway([model_block("m", "vllm", [a.url, b.url], adapters={"chat": "org/chat-lora"})],
                       lora=FAST_LORA)
    results = await asyncio.gather(*(chat(gw, "chat") for _ in range(8)))
    assert [s for s, _, _ in results] == [200] * 8
    pods = {h["target-pod"] for _, h, _ in results}
    assert len(pods) == 1                                # all on the endpoint that loaded it
    states = [await sim_state(a.url), await sim_state(b.url)]
    assert sum(len(load_calls(st)) for st in states) == 1
    assert sum("chat" in st["lora"]["registered"] for st in states) == 1
    text = await gw.metrics_text()
    assert 'switchyard_lora_loads_total{adapter="chat",model="m",result="ok"} 1.0' in text


async def test_failed_load_answers_the_engine_message_and_cools_down(sims, gateway):
    a = await sims("vllm", "m", **LORA_SIM)
    b = await sims("vllm", "m", **LORA_SIM)
    gw = await gateway([model_block("m", "vllm", [a.url, b.url], adapters={"gone": "/nonexistent/gone-lora"})],
                       lora=FAST_LORA)
    first = await asyncio.gather(*(chat(gw, "gone") for _ in range(3)))   # one load, three answers
    for status, headers, body in first:
        assert status == 502 and headers["x-error-lora-load"] == "error"
        assert body["error"]["code"] == "lora_load_failed"
        assert "No adapter found for /nonexistent/gone-lora" in body["error"]["message"]
    status, _, _ = await chat(gw, "gone")          # the other endpoint is asked once
    assert status == 502
    status, headers, body = await chat(gw, "gone")  # both cool down: no call at all
    assert status == 503 and int(headers["Retry-After"]) >= 1
    assert "No adapter found" in body["error"]["message"]
    assert [len(load_calls(await sim_state(u))) for u in (a.url, b.url)] == [1, 1]


async def test_a_load_call_to_a_port_that_refuses_connections_counts_as_an_error_and_cools_down(sims, gateway):
    """The engine's port closes while its endpoint is still ready (its probes have not seen it yet):
    the load call's connection is refused. No engine answered, but one was asked for (its port is
    the engine's): the load fails with the refusal, counted as a load error in /metrics and as the
    endpoint's upstream connect error, and that endpoint cools down as for any failed load."""
    a = await sims("vllm", "m", **LORA_SIM)
    gw = await gateway([model_block("m", "vllm", [a.url], adapters={"tone": "org/tone-lora"})],
                       lora={"discovery_interval_s": 0}, health={"interval_s": 3600}, scrape={"enabled": False})
    await until(lambda: gw.gw.pool.ready("m"), timeout=10)
    await a.close()                 # nothing listens on its port now
    status, headers, body = await chat(gw, "tone")
    assert status == 502 and headers["x-error-lora-load"] == "error", body
    assert body["error"]["code"] == "lora_load_failed" and "connect" in body["error"]["message"], body
    status, headers, body = await chat(gw, "tone")      # cooling down: not asked again
    assert status == 503 and headers["x-error-lora-load"] == "cooldown", body
    text = await gw.metrics_text()
    assert metric(text, "switchyard_lora_loads_total", model="m", adapter="tone", result="error") == 1
    assert metric(text, "switchyard_lora_loads_total", model="m", adapter="tone", result="cooldown") == 1
    assert metric(text, "switchyard_lora_loads_total", result="no_socket") == 0
    assert metric(text, "switchyard_upstream_errors_total", model="m", error_class="connect") == 1


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_an_adapter_the_engine_lost_is_loaded_again(sims, gateway, engine):
    """The engine drops an adapter the gateway loaded there (a restart, another gateway's unload):
    its error answers the request that meets it, and the next request loads the adapter again,
    with discovery off (it would otherwise never be found missing)."""
    s = await sims(engine, "m", **LORA_SIM)
    gw = await gateway([model_block("m", engine, [s.url], adapters={"tone": "org/tone-lora"})],
                       lora={"discovery_interval_s": 0})
    assert (await chat(gw, "tone"))[0] == 200
    unload = "/v1/unload_lora_adapter" if engine == "vllm" else "/unload_lora_adapter"
    async with aiohttp.ClientSession() as session, \
            session.post(s.url + unload, json={"lora_name": "tone"}) as r:
        assert r.status == 200
    status, _, body = await chat(gw, "tone")        # the engine's own error, once
    assert status in (400, 404) and "tone" in body["error"]["message"]
    for _ in range(2):
        status, _, body = await chat(gw, "tone")
        assert status == 200, body
    st = await sim_state(s.url)
    assert len(load_calls(st)) == 2 and st["lora"]["registered"] == {"tone": "org/tone-lora"}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_an_engine_seen_down_and_up_again_gets_its_adapters_loaded_again_without_an_error(sims, gateway,
                                                                                               engine):
    """An engine that restarted (the probes saw it down, then up) has lost the adapters the gateway
    loaded there: they are loaded again by the next request, which gets its answer, not the
    engine's "not loaded" error."""
    s = await sims(engine, "m", **LORA_SIM)
    gw = await gateway([model_block("m", engine, [s.url], adapters={"tone": "org/tone-lora"})],
                       lora={"discovery_interval_s": 0}, health={"interval_s": 0.1, "timeout_s": 0.5})
    assert (await chat(gw, "tone"))[0] == 200
    ep = gw.gw.pool.endpoints("m")[0]
    unload = "/v1/unload_lora_adapter" if engine == "vllm" else "/unload_lora_adapter"
    async with aiohttp.ClientSession() as session:
        async with session.post(s.url + "/_sim/config", json={"dead": True}) as r:
            assert r.status == 200
        assert await wait_for(lambda: not ep.healthy, timeout=10)
        async with session.post(s.url + unload, json={"lora_name": "tone"}) as r:     # restarted without it
            assert r.status == 200
        async with session.post(s.url + "/_sim/config", json={"dead": False}) as r:
            assert r.status == 200
    assert await wait_for(lambda: ep.healthy, timeout=10)
    status, _, body = await chat(gw, "tone")
    assert status == 200, body
    assert len(load_calls(await sim_state(s.url))) == 2


async def test_an_engine_restart_seen_only_by_its_scrape_gets_its_adapters_loaded_again_without_an_error(
        sims, gateway):
    """An engine that restarted between two health probes (they never saw it down) has lost the
    adapters the gateway loaded there; its scrape's new process_start_time_seconds says so, and the
    next request loads the adapter again rather than meeting the engine's "does not exist" 404."""
    s = await sims("vllm", "m", **LORA_SIM)
    gw = await gateway([model_block("m", "vllm", [s.url], adapters={"tone": "org/tone-lora"})],
                       lora={"discovery_interval_s": 0}, health={"interval_s": 60})
    assert (await chat(gw, "tone"))[0] == 200
    ep = gw.gw.pool.endpoints("m")[0]
    await until(lambda: ep.metrics is not None and ep.metrics.start_time == s.engine.started_at)
    restarted = await restart_sim(s)
    try:
        await until(lambda: ep.metrics.start_time == restarted.engine.started_at)
        assert ep.healthy
        status, _, body = await chat(gw, "tone")
        assert status == 200, body
        assert len(load_calls(await sim_state(restarted.url))) == 1
    finally:
        await restarted.close()


async def test_a_load_that_failed_on_an_engine_that_then_restarted_does_not_cool_down_the_new_engine(sims, gateway):
    """A load asked of an engine that was going down (its port refused the call) cools that
    endpoint down for the adapter; the engine that comes back up there (its scrape names a new
    start) is another process, which was never asked: the next request loads the adapter there,
    not a 503 until failure_cooldown_s has passed."""
    s = await sims("vllm", "m", **LORA_SIM)
    gw = await gateway([model_block("m", "vllm", [s.url], adapters={"tone": "org/tone-lora"})],
                       lora={"discovery_interval_s": 0, "failure_cooldown_s": 600}, health={"interval_s": 60})
    ep = gw.gw.pool.endpoints("m")[0]
    await until(lambda: ep.metrics is not None and ep.metrics.start_time == s.engine.started_at)
    await until(lambda: time.time() - s.engine.started_at > 1.5, timeout=10)     # two starts told apart
    await s.close()
    status, headers, body = await chat(gw, "tone")
    assert (status, headers["x-error-lora-load"]) == (502, "error"), body
    restarted = await start_sim(dataclasses.replace(s.cfg, port=s.port))
    try:
        await until(lambda: ep.metrics.start_time == restarted.engine.started_at, timeout=10)
        status, _, body = await chat(gw, "tone")
        assert status == 200, body
        assert len(load_calls(await sim_state(restarted.url))) == 1
    finally:
        await restarted.close()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_an_adapter_another_gateway_loaded_first_counts_as_loaded(sims, gateway, engine):
    """Another gateway (or a sibling worker at the same moment) loaded the adapter: the engine
    refuses the gateway's load as already there, in its own words, and the load counts as done."""
    s = await sims(engine, "m", **LORA_SIM)
    gw = await gateway([model_block("m", engine, [s.url], adapters={"tone": "org/tone-lora"})],
                       lora={"discovery_interval_s": 0})
    load = "/v1/load_lora_adapter" if engine == "vllm" else "/load_lora_adapter"
    async with aiohttp.ClientSession() as session, \
            session.post(s.url + load, json={"lora_name": "tone", "lora_path": "org/tone-lora"}) as r:
        assert r.status == 200
    for _ in range(2):
        status, _, body = await chat(gw, "tone")
        assert status == 200, body
    assert 'switchyard_lora_loads_total{adapter="tone",model="m",result="ok"} 1.0' in await gw.metrics_text()


async def test_an_adapter_sglang_unloaded_to_make_room_is_loaded_again_without_an_error(sims, gateway):
    """SGLang 0.5.23 at --max-loaded-loras loads a new adapter and unloads its least recently used
    one itself, saying so only in the answer's loaded_adapters. Read, the evicted adapter leaves that
    endpoint, so its next request loads it again instead of getting SGLang's "not loaded" 400."""
    s = await sims("sglang", "m", **LORA_SIM, max_loaded_loras=1, lora_full_evicts=True)
    gw = await gateway([model_block("m", "sglang", [s.url], adapters={"tone": "org/tone-lora",
                                                                       "terse": "org/terse-lora"})],
                       lora={"discovery_interval_s": 0})
    for name in ("tone", "terse", "tone", "terse"):
        status, _, body = await chat(gw, name)
        assert status == 200, (name, body)
    st = await sim_state(s.url)
    assert len(load_calls(st)) == 4 and list(st["lora"]["registered"]) == ["terse"]
    assert 'reason="engine"' in await gw.metrics_text()


async def test_sglang_adapter_load_and_lora_path(sims, gateway):
    s = await sims("sglang", "m", **LORA_SIM)
    gw = await gateway([model_block("m", "sglang", [s.url], adapters={"tone": "org/tone-lora"})], lora=FAST_LORA)
    status, headers, body = await chat(gw, "tone")
    assert status == 200, body
    st = await sim_state(s.url)
    assert st["lora"]["registered"] == {"tone": "org/tone-lora"} and st["lora"]["cold_loads"] == 1


async def test_an_sglang_request_naming_an_adapter_in_its_lora_path_is_refused(sims, gateway):
    """SGLang runs a chat, completion or embedding request with the adapter its body's ``lora_path``
    names, whatever its ``model`` says: a request for the base model carrying one would be routed,
    limited, logged and counted as the base model's (on an endpoint that may not hold the adapter,
    which the gateway may unload under it) while the engine ran the adapter. It is refused (400
    naming ``lora_path``, nothing sent); a null one is the base model's; a request naming the adapter
    in ``model`` carries the gateway's ``lora_path``, the client's replaced. vLLM picks an adapter by
    ``model`` alone and ignores the field."""
    s = await sims("sglang", "m", lora_modules=("tone=org/tone-lora",), **LORA_SIM)
    v = await sims("vllm", "v", lora_modules=("tone=org/tone-lora",), **LORA_SIM)
    gw = await gateway([model_block("m", "sglang", [s.url], adapters={"terse": "org/terse-lora"}),
                        model_block("v", "vllm", [v.url])], lora=FAST_LORA)
    for path, body in ((CHAT, chat_body(MSG, lora_path="tone")),
                       (COMPLETIONS, {"model": "m", "prompt": "hi", "max_tokens": 2, "lora_path": ["tone"]}),
                       (EMBEDDINGS, {"model": "m", "input": "hi", "lora_path": "tone"})):
        r = await post(gw, body, path=path)
        assert r.status == 400, (path, r.status, r.body[:200])
        err = r.json()["error"]
        assert err["param"] == "lora_path" and err["code"] == "unsupported_parameter", err
        assert "`model`" in err["message"]
    assert not [x for x in (await sim_state(s.url))["received"] if x["path"] in (CHAT, COMPLETIONS, EMBEDDINGS)]
    assert (await post(gw, chat_body(MSG, lora_path=None))).status == 200
    assert (await post(gw, {"model": "m", "prompt": ["a", "b"], "max_tokens": 1, "lora_path": [None, ""]},
                       path=COMPLETIONS)).status == 200
    assert (await post(gw, chat_body(MSG, model="terse", lora_path="tone"))).status == 200
    sent = [x["body"] for x in (await sim_state(s.url))["received"] if x["path"] == CHAT]
    assert [b.get("lora_path") for b in sent] == [None, "terse"]
    assert (await post(gw, chat_body(MSG, model="v", lora_path="tone"))).status == 200


async def test_a_messages_request_for_an_sglang_adapter_is_refused_not_served_by_the_base_model(sims, gateway):
    """SGLang picks an adapter by the body's ``lora_path``, which its Anthropic request has no field
    for: the gateway refuses such a request (400, Anthropic-shaped, nothing loaded or sent) rather
    than let the base model answer it under the adapter's name. vLLM picks it by ``model``."""
    s = await sims("sglang", "m", **LORA_SIM)
    v = await sims("vllm", "v", **LORA_SIM)
    gw = await gateway([model_block("m", "sglang", [s.url], adapters={"tone": "org/tone-lora"}),
                        model_block("v", "vllm", [v.url], adapters={"terse": "org/terse-lora"})], lora=FAST_LORA)
    c = anthropic_client(gw)
    with pytest.raises(anthropic.BadRequestError) as ei:
        await c.messages.create(model="tone", max_tokens=4, messages=MSG)
    assert ei.value.body["error"]["type"] == "invalid_request_error"
    assert "tone" in ei.value.body["error"]["message"] and "/v1/chat/completions" in ei.value.body["error"]["message"]
    st = await sim_state(s.url)
    assert not load_calls(st) and not [r for r in st["received"] if r["path"].startswith("/v1/messages")]
    msg = await c.messages.create(model="terse", max_tokens=4, messages=MSG)      # vLLM: by model
    assert msg.usage.output_tokens == 4 and len(load_calls(await sim_state(v.url))) == 1
    # vLLM's Messages answer is its chat answer converted: the model is the adapter's name, as in chat
    async with c.messages.stream(model="terse", max_tokens=2, messages=MSG) as stream:
        streamed = await stream.get_final_message()
    assert msg.model == streamed.model == "terse"


async def test_enginesim_slots_lru_metric_and_unknown_adapter(sims):
    sim = await sims("vllm", "m", lora_modules=("a=org/a", "b=org/b", "c=org/c"), **LORA_SIM)
    async with aiohttp.ClientSession() as s:
        for name in ("a", "b", "a", "c", "a"):     # 2 slots: c evicts b (least recently used)
            async with s.post(sim.url + "/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 1}) as r:
                assert r.status == 200
        async with s.post(sim.url + "/v1/completions", json={"model": "zz", "prompt": "hi"}) as r:
            assert r.status == 404 and "does not exist" in (await r.json())["error"]["message"]
        async with s.post(sim.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "x"}) as r:
            assert r.status == 400 and "already been loaded" in (await r.json())["error"]["message"]
        async with s.get(sim.url + "/metrics") as r:
            text = await r.text()
    st = (await sim_state(sim.url))["lora"]
    assert st["cold_loads"] == 3 and st["evictions"] == 1 and list(st["slots"]) == ["c", "a"]
    assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in text


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_pd_model_routes_both_legs_to_endpoints_serving_the_adapter(sims, gateway, engine):
    """Two prefills and two decodes, the adapter on one of each: both legs go to those two; with it
    on no decode, 503 says which role is missing."""
    lora = ("sql=org/sql-lora",)
    p_with = await sims(engine, "m", role="prefill", lora_modules=lora, **LORA_SIM)
    p_without = await sims(engine, "m", role="prefill", **LORA_SIM)
    d_with = await sims(engine, "m", role="decode", lora_modules=lora, **LORA_SIM)
    d_without = await sims(engine, "m", role="decode", **LORA_SIM)
    n_prefill = await sims(engine, "n", role="prefill", lora_modules=("chat=org/chat-lora",), **LORA_SIM)
    n_decode = await sims(engine, "n", role="decode", **LORA_SIM)

    def roleset(prefills, decodes):
        if engine == "sglang":
            prefills = [{"url": p.url, "bootstrap_port": p.bootstrap_port} for p in prefills]
        else:
            prefills = [p.url for p in prefills]
        return [{"name": "rs", "prefill": prefills, "decode": [d.url for d in decodes]}]

    gw = await gateway([{"name": "m", "engine": engine, "rolesets": roleset([p_with, p_without], [d_with, d_without])},
                        {"name": "n", "engine": engine, "rolesets": roleset([n_prefill], [n_decode])}], lora=FAST_LORA)
    await wait_for(lambda: sum(bool(ep.adapters.served) for ep in gw.gw.pool.endpoints()) == 3)
    for _ in range(6):
        status, headers, body = await chat(gw, "sql")
        assert status == 200 and body["model"] == "sql", body
        assert headers["x-pd-decision"].startswith("disaggregated")
    for sim, served in ((p_with, 6), (d_with, 6), (p_without, 0), (d_without, 0)):
        assert (await sim_state(sim.url))["counts"]["started"] == served
    status, _, _ = await chat(gw, "m")                   # the base model still uses every endpoint
    assert status == 200
    # model n has its adapter on the prefill only: no pair serves it
    status, _, body = await chat(gw, "chat")
    assert status == 503 and "no ready decode endpoint of the P/D model `n`" in body["error"]["message"]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_an_adapter_of_a_pd_model_without_a_ready_decode_runs_whole_on_a_combined_endpoint(sims, gateway, engine):
    """With no ready decode the ``pd`` strategy runs a base model's requests whole on the roleset's
    combined endpoint; an adapter's request too, loading the adapter there, not a 503 that says its
    load failed on every endpoint. Without a combined endpoint, the 503 names the missing role."""
    p, d = await sims(engine, "m", role="prefill", **LORA_SIM), await sims(engine, "m", role="decode", **LORA_SIM)
    c = await sims(engine, "m", **LORA_SIM)
    n_p, n_d = await sims(engine, "n", role="prefill", **LORA_SIM), await sims(engine, "n", role="decode", **LORA_SIM)

    def model(name, prefill, decode, **more):
        pre = {"url": prefill.url, "bootstrap_port": prefill.bootstrap_port} if engine == "sglang" else prefill.url
        return {"name": name, "engine": engine, "rolesets": [{"name": "rs", "prefill": [pre], "decode": [decode.url],
                                                              **more}]}

    gw = await gateway([{**model("m", p, d, combined=[c.url]), "adapters": {"sql": "org/sql-lora"}},
                        {**model("n", n_p, n_d), "adapters": {"chat": "org/chat-lora"}}],
                       lora={"discovery_interval_s": 0})
    await d.close()
    await n_d.close()
    await until(lambda: not any(ep.ready for ep in gw.gw.pool.endpoints() if ep.role == "decode"), timeout=10)
    status, headers, body = await chat(gw, "sql")
    assert status == 200 and body["model"] == "sql", body
    assert headers["x-pd-decision"] == "combined; reason=no_pair_combined"
    assert headers["target-pod"] == c.url.split("//")[1]
    assert [len(load_calls(await sim_state(u))) for u in (p.url, c.url)] == [0, 1]
    status, headers, body = await chat(gw, "chat")
    assert status == 503, body
    assert "no ready decode endpoint of the P/D model `n` serves the LoRA adapter `chat`" in body["error"]["message"]
    text = await gw.metrics_text()
    assert metric(text, "switchyard_lora_loads_total", result="cooldown") == 0


async def test_an_adapter_request_sglang_pairs_cannot_serve_runs_whole_on_a_combined_endpoint(sims, gateway):
    """SGLang's pairs cannot serve ``n`` > 1 (a prompt's samples share one bootstrap room): the base
    model's such request runs whole on the combined endpoint, and an adapter's too, loading the
    adapter there (not on the pairs, which cannot run it), not a 400 saying the model has no
    combined endpoint."""
    p, d = await sims("sglang", "m", role="prefill", **LORA_SIM), await sims("sglang", "m", role="decode", **LORA_SIM)
    c = await sims("sglang", "m", **LORA_SIM)
    rs = {"name": "rs", "prefill": [{"url": p.url, "bootstrap_port": p.bootstrap_port}], "decode": [d.url],
          "combined": [c.url]}
    gw = await gateway([{"name": "m", "engine": "sglang", "rolesets": [rs], "pd": {"combined_load_ratio": 0},
                         "adapters": {"sql": "org/sql-lora"}}], lora={"discovery_interval_s": 0})
    for _ in range(2):
        status, headers, body = await post(gw, chat_body(MSG, model="sql", n=2))
        assert status == 200, body
        assert headers["x-pd-decision"].startswith("combined; ") and headers["target-pod"] == c.url.split("//")[1]
    assert [len(load_calls(await sim_state(u))) for u in (p.url, d.url, c.url)] == [0, 0, 1]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_a_refused_decode_leg_of_an_adapter_goes_to_no_decode_without_it(sims, gateway, engine):
    """The adapter's decode died (its port refuses) before the probes noticed: its leg goes to no
    decode of the roleset that does not serve the adapter (which would answer that the adapter does
    not exist): with none left, the client gets the refused decode's 502."""
    lora = ("sql=org/sql-lora",)
    p = await sims(engine, "m", role="prefill", lora_modules=lora, **LORA_SIM)
    d_with = await sims(engine, "m", role="decode", lora_modules=lora, **LORA_SIM)
    d_without = await sims(engine, "m", role="decode", **LORA_SIM)
    prefills = [{"url": p.url, "bootstrap_port": p.bootstrap_port}] if engine == "sglang" else [p.url]
    gw = await gateway([{"name": "m", "engine": engine,
                         "rolesets": [{"name": "rs", "prefill": prefills, "decode": [d_with.url, d_without.url]}]}],
                       lora={"discovery_interval_s": 60}, health={"interval_s": 60})
    await wait_for(lambda: sum(bool(ep.adapters.served) for ep in gw.gw.pool.endpoints()) == 2)
    await d_with.close()
    status, headers, body = await chat(gw, "sql")
    assert status == 502 and headers["x-error-pd-decode"] == "connect", body
    assert [r for r in (await sim_state(d_without.url))["received"] if r["method"] == "POST"] == []


async def test_an_adapter_named_as_a_model_or_an_alias_is_not_listed_twice(sims, gateway):
    """An engine may serve adapters whose names a model or an alias of the gateway has (no file
    check can see them): a request naming one reaches that model or alias, so the listing names it
    once, as that model or alias, and the Anthropic SDK's walk by cursor ends, each id met once."""
    a = await sims("vllm", "m", lora_modules=("m2=org/m2-lora", "chat=org/chat-lora", "sql=org/sql-lora"),
                   **LORA_SIM)
    b = await sims("vllm", "m2")
    gw = await gateway([model_block("m", "vllm", [a.url]), model_block("m2", "vllm", [b.url])], lora=FAST_LORA,
                       aliases=[{"name": "chat", "targets": [{"model": "m2"}]}])
    await wait_for(lambda: len(gw.gw.pool.endpoints("m")[0].adapters.served) == 3)
    client = openai_client(gw)
    listed = [(m.id, m.model_extra.get("parent"), m.model_extra.get("targets")) for m in (await client.models.list()).data]
    assert listed == [("m", None, None), ("m2", None, None), ("chat", None, [{"model": "m2", "weight": 1}]),
                      ("sql", "m", None)], listed
    for name, served in (("chat", "m2"), ("m2", "m2"), ("sql", "sql")):     # who answers each name
        assert (await client.chat.completions.create(model=name, messages=MSG, max_tokens=2)).model == served
    assert (await client.models.retrieve("chat")).model_extra["targets"] == [{"model": "m2", "weight": 1}]
    c = anthropic_client(gw)
    async with asyncio.timeout(5):
        walked = [m.id async for m in c.models.list(limit=1)]
    assert walked == ["m", "m2", "chat", "sql"]


async def test_an_endpoint_a_reload_declares_anew_keeps_its_engines_adapters(sims, gateway):
    """A reload that declares an endpoint again at its URL with other settings (its
    max_prompt_tokens) puts a new endpoint in its place, but the engine is the same and holds its
    adapters still: the one discovery found is served at once, not refused until the next round;
    the one the gateway loaded is neither loaded again nor kept there for ever: it is still the
    gateway's, unloaded once idle."""
    a = await sims("vllm", "m", lora_modules=("sql=org/sql-lora",), **LORA_SIM)
    # idle unloading stays off until the reload is done: on at 1 s, a stalled process (a busy
    # machine, a GC pass) could let chat go idle between its first request and the reload's
    gw = await gateway([model_block("m", "vllm", [a.url], adapters={"chat": "org/chat-lora"})],
                       lora={"discovery_interval_s": 60, "idle_unload_s": 0})
    await wait_for(lambda: "sql" in gw.gw.pool.endpoints("m")[0].adapters.served)
    status, _, body = await chat(gw, "chat")
    assert status == 200, body
    reloader = gw.runner.app[RELOAD_KEY]
    raw = msgspec.to_builtins(reloader.live.config)
    raw["models"][0]["endpoints"] = [{"url": a.url, "max_prompt_tokens": 100_000}]
    result = reloader.reload("test", config_from_dict(raw, source="<test>"))
    assert (result.result, result.removed, result.added) == ("ok", [f"m {a.url}"], [f"m {a.url}"])
    for name in ("chat", "sql"):
        status, _, body = await chat(gw, name)
        assert (status, body.get("model")) == (200, name), body
    assert len(load_calls(await sim_state(a.url))) == 1         # chat was there: no second load
    raw = msgspec.to_builtins(reloader.live.config)
    raw["lora"]["idle_unload_s"] = 0.2                          # the endpoints as they are
    result = reloader.reload("test", config_from_dict(raw, source="<test>"))
    assert (result.result, result.removed, result.added) == ("ok", [], []), result
    assert await wait_for(lambda: "chat" not in gw.gw.pool.endpoints("m")[0].adapters.served, timeout=10)
    st = await sim_state(a.url)
    assert list(st["lora"]["registered"]) == ["sql"], st["lora"]


async def test_an_adapter_name_two_base_models_serve_lists_the_endpoints_requests_go_to(sims, gateway):
    """Engines of two base models each serve an adapter named sql: a request for sql goes to the
    first model's (the config's order), and the listing counts that model's endpoints only, its
    parent's: the other model's cannot be reached under that name."""
    a = await sims("vllm", "m", lora_modules=("sql=org/sql-m",), **LORA_SIM)
    b = await sims("vllm", "n", lora_modules=("sql=org/sql-n",), **LORA_SIM)
    gw = await gateway([model_block("m", "vllm", [a.url]), model_block("n", "vllm", [b.url])], lora=FAST_LORA)
    await wait_for(lambda: sum("sql" in ep.adapters.served for ep in gw.gw.pool.endpoints()) == 2)
    client = openai_client(gw)
    sql = await client.models.retrieve("sql")
    assert (sql.model_extra["parent"], sql.model_extra["ready_endpoints"]) == ("m", 1), sql
    for _ in range(3):
        raw = await client.chat.completions.with_raw_response.create(model="sql", messages=MSG, max_tokens=2)
        assert raw.headers["target-pod"] == a.url.removeprefix("http://")


async def test_the_serving_gauge_drops_an_adapter_no_engine_lists_and_the_config_does_not(sims, gateway):
    """Bounded series over a long life: an adapter an engine listed and no longer does, which the
    config does not list, loses its switchyard_lora_adapter_endpoints series (engines' own adapters
    come and go by the thousand over months); one the config lists reads 0, a fact about it."""
    sim = await sims("vllm", "m", lora_modules=("sql=org/sql-lora",), **LORA_SIM)
    gw = await gateway([model_block("m", "vllm", [sim.url], adapters={"cfg": "org/cfg"})], lora=FAST_LORA)
    assert (await chat(gw, "cfg"))[0] == 200
    series = 'switchyard_lora_adapter_endpoints{adapter="%s",model="m"}'
    assert await wait_for(lambda: (series % "sql") + " 1.0" in gw.gw.metrics.render().decode()
                          and (series % "cfg") + " 1.0" in gw.gw.metrics.render().decode(), timeout=10.0)
    async with aiohttp.ClientSession() as s:
        for name in ("sql", "cfg"):         # the engine drops both (an operator's unload, a restart)
            async with s.post(sim.url + "/v1/unload_lora_adapter", json={"lora_name": name}) as r:
                assert r.status == 200, await r.text()
    assert await wait_for(lambda: (series % "cfg") + " 0.0" in gw.gw.metrics.render().decode(), timeout=10.0)
    assert await wait_for(lambda: series % "sql" not in gw.gw.metrics.render().decode(), timeout=10.0), \
        "the series of an adapter nothing lists any more stays, at 0, forever"


async def test_a_reload_that_removes_a_model_or_a_listed_adapter_drops_their_serving_series_at_once(sims, gateway):
    """A reload that removes a model takes the series of the adapters its engines served with it,
    and one that takes an adapter off the model's ``adapters`` list, no engine serving it, drops its
    0: at the reload, not at the next discovery round (never, with discovery off), where a scrape
    meanwhile read a model the gateway no longer serves as serving its adapters."""
    a = await sims("vllm", "m", lora_modules=("sql=org/sql-lora",), **LORA_SIM)
    b = await sims("vllm", "m2", **LORA_SIM)
    # discovery's first round at start, then none for the test's length
    gw = await gateway([model_block("m", "vllm", [a.url]), model_block("m2", "vllm", [b.url], adapters={"cfg": "org/cfg"})],
                       lora={"discovery_interval_s": 600})
    series = 'switchyard_lora_adapter_endpoints{adapter="%s",model="%s"}'
    assert await wait_for(lambda: (series % ("sql", "m")) + " 1.0" in gw.gw.metrics.render().decode(), timeout=10.0)
    assert (await chat(gw, "cfg"))[0] == 200          # loaded on m2's engine: counted 1
    async with aiohttp.ClientSession() as s:          # the engine drops it: a listed adapter reads 0
        async with s.post(b.url + "/v1/unload_lora_adapter", json={"lora_name": "cfg"}) as r:
            assert r.status == 200, await r.text()
        await gw.gw.lora.discover(s)                  # a round, as the loop's
    assert (series % ("cfg", "m2")) + " 0.0" in gw.gw.metrics.render().decode()
    reloader = gw.runner.app[RELOAD_KEY]
    raw = msgspec.to_builtins(reloader.live.config)
    raw["models"] = [model_block("m2", "vllm", [b.url])]
    result = reloader.reload("test", config_from_dict(raw, source="<test>"))
    assert (result.result, result.removed) == ("ok", [f"m {a.url}"]), result
    text = gw.gw.metrics.render().decode()
    assert series % ("sql", "m") not in text, "a model the reload removed still serves its adapter"
    assert series % ("cfg", "m2") not in text, "an adapter the reload took off the list keeps its 0"


async def test_a_reload_whose_alias_shadows_a_discovered_adapter_is_applied_with_a_warning(sims, gateway):
    """No file check can see the adapters the engines serve, so a reload may add an alias under the
    name of one: it is applied (the alias answers that name from then on, its targets without the
    adapter), and a warning names the alias and the adapter's model and endpoints, as it does again
    at each reload that keeps it."""
    a = await sims("vllm", "m", lora_modules=("sql=org/sql-lora",), **LORA_SIM)
    b = await sims("vllm", "m2")
    gw = await gateway([model_block("m", "vllm", [a.url]), model_block("m2", "vllm", [b.url])], lora=FAST_LORA)
    await wait_for(lambda: "sql" in gw.gw.pool.endpoints("m")[0].adapters.served)
    reloader = gw.runner.app[RELOAD_KEY]
    raw = msgspec.to_builtins(reloader.live.config)
    raw["aliases"] = [{"name": "chat", "targets": [{"model": "m2"}]}, {"name": "sql", "targets": [{"model": "m2"}]}]
    with structlog.testing.capture_logs() as logs:
        assert reloader.reload("test", config_from_dict(raw, source="<test>")).result == "ok"
    warned = [e for e in logs if e["event"] == "alias shadows a lora adapter the engines serve"]
    assert [(e["log_level"], e["alias"], e["adapter_model"], e["endpoints"]) for e in warned] == [
        ("warning", "sql", "m", [a.url.split("//")[1]])]
    status, _, body = await chat(gw, "sql")
    assert (status, body.get("model")) == (200, "m2"), body


async def test_a_vllm_without_runtime_adapter_loading_is_named_in_the_load_failure(sims, gateway):
    """vLLM serves the load call only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true; without it the
    route is not there, and its 404 says only Not Found: the 502 names the variable to set."""
    a = await sims("vllm", "m", runtime_lora_updating=False, **LORA_SIM)
    gw = await gateway([model_block("m", "vllm", [a.url], adapters={"sql": "org/sql-lora"})], lora=FAST_LORA)
    status, headers, body = await chat(gw, "sql")
    assert (status, headers["x-error-lora-load"], body["error"]["code"]) == (502, "error", "lora_load_failed")
    assert "status 404: Not Found" in body["error"]["message"]
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true" in body["error"]["message"], body


async def test_a_load_call_that_outlasts_load_timeout_s_is_no_fault_of_its_endpoint(sims, gateway):
    """An engine still reading a large adapter when ``load_timeout_s`` runs out is busy, not broken:
    the load fails (502, and the endpoint cools down for that adapter), but the endpoint's breaker
    hears no fault, and the base model's requests go on to both endpoints."""
    a = await sims("vllm", "m", **LORA_SIM, lora_load_call_ms=3000)
    b = await sims("vllm", "m", **LORA_SIM, lora_load_call_ms=3000)
    gw = await gateway([model_block("m", "vllm", [a.url, b.url], adapters={"big": "org/big-lora"})],
                       lora={"discovery_interval_s": 0, "load_timeout_s": 0.2},
                       breaker={"consecutive_faults": 1, "max_ejection_percent": 100})
    await until(lambda: len(gw.gw.pool.ready("m")) == 2, timeout=10)
    status, headers, body = await chat(gw, "big")
    assert (status, headers["x-error-lora-load"]) == (502, "error"), body
    assert "within 0.2s" in body["error"]["message"], body
    text = await gw.metrics_text()
    assert metric(text, "switchyard_lora_loads_total", model="m", adapter="big", result="error") == 1
    assert metric(text, "switchyard_upstream_errors_total", model="m", error_class="timeout") == 1
    assert metric(text, "switchyard_breaker_transitions_total") == 0, text
    assert len(gw.gw.pool.ready("m")) == 2


async def test_an_adapter_discovery_finds_under_an_alias_name_is_warned_of_without_a_reload(sims, gateway):
    """The file's check cannot see the adapters the engines will serve: an alias the gateway started
    with may have the name of one an engine lists later (registered at its start, or loaded by
    someone else). Discovery warns of it when it first finds it there, as a reload does, and not
    again at each round; requests for that name still go to the alias."""
    a = await sims("vllm", "m", **LORA_SIM)
    b = await sims("vllm", "m2")
    gw = await gateway([model_block("m", "vllm", [a.url]), model_block("m2", "vllm", [b.url])], lora=FAST_LORA,
                       aliases=[{"name": "sql", "targets": [{"model": "m2"}]}])
    with structlog.testing.capture_logs() as logs:
        async with aiohttp.ClientSession() as s:
            async with s.post(a.url + "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "org/sql"}) as r:
                assert r.status == 200, await r.text()
        await wait_for(lambda: "sql" in gw.gw.pool.endpoints("m")[0].adapters.served)
        lora, rounds = gw.gw.lora, []
        counted = lora.count_serving        # called at the end of each discovery round

        def count() -> None:
            rounds.append(1)
            counted()
        lora.count_serving = count
        await wait_for(lambda: len(rounds) >= 3)    # more rounds, which find it again
    warned = [e for e in logs if e["event"] == "alias shadows a lora adapter the engines serve"]
    assert [(e["log_level"], e["alias"], e["adapter_model"], e["endpoints"]) for e in warned] == [
        ("warning", "sql", "m", [a.url.split("//")[1]])]
    status, _, body = await chat(gw, "sql")
    assert (status, body.get("model")) == (200, "m2"), body
