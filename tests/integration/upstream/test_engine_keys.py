"""Engines started with --api-key (enginesim's, which guards the routes the real engine guards):
the gateway sends the model's or endpoint's ``api_key`` on every request to them, its own calls
included (P/D legs, SGLang's /abort_request, LoRA loads and the /v1/models discovery), in place of
the client's key; a wrong key is the operator's 502, and the key is shown nowhere."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import openai
import orjson
import pytest
import structlog

from tests.support.factories import model_block, pd_model, pd_pair, roleset
from tests.support.http import anthropic_client, bearer, openai_client, post, sim_state
from tests.support.lora import FAST_LORA, LORA_SIM, load_calls
from tests.support.metrics import metric
from tests.support.status import ADMIN
from tests.support.waiting import wait_for

KEY = "engine-key-4f1d9c"
CHAT = [{"role": "user", "content": "Which track does the night train take?"}]
ENGINES = ["vllm", "sglang"]
NO_DISCOVERY = {"discovery_interval_s": 0}      # no periodic GET /v1/models for adapters


async def refused(*sims) -> list[dict]:
    """The requests the engines answered 401 (no key, or a wrong one)."""
    return [r for s in sims for r in (await sim_state(s.url))["refused"]]


@pytest.mark.parametrize("engine", ENGINES)
async def test_aggregated_requests_carry_the_models_key_not_the_clients(sims, gateway, engine):
    sim = await sims(engine, "m", api_key=KEY)
    gw = await gateway([model_block("m", engine, [sim.url], api_key=KEY)])
    client = openai_client(gw, key="the-clients-own-key")    # auth is off: it would pass through
    r = await client.chat.completions.create(model="m", messages=CHAT, max_tokens=4)
    assert r.choices[0].message.content and r.usage.completion_tokens == 4
    stream = await client.chat.completions.create(model="m", messages=CHAT, max_tokens=4, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    if engine == "vllm":        # an Anthropic client's x-api-key is replaced the same way
        message = await anthropic_client(gw, key="the-clients-own-key").messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert message.content[0].text
    assert await refused(sim) == []
    assert (await sim_state(sim.url))["counts"]["completed"] == (3 if engine == "vllm" else 2)


async def test_an_endpoints_key_from_the_environment_wins_over_the_models(sims, gateway, monkeypatch):
    a = await sims("vllm", "m", api_key=KEY)
    b = await sims("vllm", "m", api_key="another-engines-key")
    monkeypatch.setenv("M_ENGINE_KEY", KEY)
    monkeypatch.setenv("B_ENGINE_KEY", "another-engines-key")
    gw = await gateway([model_block("m", "vllm", [a.url, {"url": b.url, "api_key_env": "B_ENGINE_KEY"}],
                                    api_key_env="M_ENGINE_KEY")], routing={"strategy": "round-robin"})
    client = openai_client(gw)
    for _ in range(4):
        await client.chat.completions.create(model="m", messages=CHAT, max_tokens=2)
    assert await refused(a, b) == []
    assert [(await sim_state(s.url))["counts"]["completed"] for s in (a, b)] == [2, 2]


@pytest.mark.parametrize("engine", ENGINES)
async def test_both_pd_legs_carry_the_key(sims, gateway, engine):
    p, d = await pd_pair(sims, engine, api_key=KEY)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)], api_key=KEY)])
    client = openai_client(gw)
    r = await client.chat.completions.create(model="m", messages=CHAT, max_tokens=4)
    assert r.usage.completion_tokens == 4
    stream = await client.chat.completions.create(model="m", messages=CHAT, max_tokens=4, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert await refused(p, d) == []
    assert [(await sim_state(s.url))["counts"]["completed"] for s in (p, d)] == [2, 2]


async def test_sglangs_abort_on_a_client_disconnect_carries_the_key(sims, gateway):
    p = await sims("sglang", "m", role="prefill", api_key=KEY)
    d = await sims("sglang", "m", role="decode", api_key=KEY, itl_ms=50)
    gw = await gateway([pd_model("sglang", [roleset("sglang", p, d)], api_key=KEY)])
    async with aiohttp.ClientSession() as s:
        resp = await s.post(gw.url + "/v1/chat/completions",
                            json={"model": "m", "messages": CHAT, "max_tokens": 500, "stream": True})
        assert resp.status == 200
        await resp.content.readline()
        resp.close()

    async def aborted() -> bool:
        st = await sim_state(d.url)
        return bool(st["abort_requests"]) and not st["running"] and not st["waiting"]

    assert await wait_for(aborted, timeout=8)
    assert any(r["path"] == "/abort_request" for r in (await sim_state(d.url))["received"])
    assert await refused(p, d) == []


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_lora_load_and_the_adapter_discovery_carry_the_key(sims, gateway, engine):
    sim = await sims(engine, "m", api_key=KEY, **LORA_SIM)
    gw = await gateway([model_block("m", engine, [sim.url], api_key=KEY, adapters={"sql": "org/sql-lora"})],
                       lora=FAST_LORA)
    r = await openai_client(gw).chat.completions.create(model="sql", messages=CHAT, max_tokens=2)
    assert r.usage.completion_tokens == 2
    state = await sim_state(sim.url)
    assert len(load_calls(state)) == 1

    async def discovered() -> bool:     # the periodic GET /v1/models, keyed too
        return any(e["path"] == "/v1/models" for e in (await sim_state(sim.url))["received"])

    assert await wait_for(discovered, timeout=3)
    assert await refused(sim) == []


async def test_a_stored_response_is_read_from_its_engine_with_the_key(sims, gateway):
    sim = await sims("vllm", "m", api_key=KEY, enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url], api_key=KEY)])
    client = openai_client(gw)
    r = await client.responses.create(model="m", input="Tell me a story", max_output_tokens=4)
    got = await client.responses.retrieve(r.id)        # GET /v1/responses/{id} on the engine that holds it
    assert got.id == r.id and got.status == "incomplete"
    assert await refused(sim) == []


async def test_discovered_pods_take_their_models_key(emu, sims, gateway, tmp_path):
    from tests.support.factories import sim_pod
    sim = await sims("sglang", "qwen", api_key=KEY)
    sim_pod(emu, "qwen-0", sim, "qwen", **{"model.aibrix.ai/engine": "sglang"})
    path = tmp_path / "kubeconfig"
    path.write_text(emu.kubeconfig())
    gw = await gateway([{"name": "qwen", "engine": "sglang", "api_key": KEY}],
                       kubernetes={"enabled": True, "kubeconfig": str(path), "namespaces": ["llm"],
                                   "retry_backoff_s": 0.05})
    assert await wait_for(lambda: gw.gw.pool.ready("qwen"), timeout=3)
    r = await openai_client(gw).chat.completions.create(model="qwen", messages=CHAT, max_tokens=2)
    assert r.usage.completion_tokens == 2
    assert await refused(sim) == []


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_wrong_key_is_a_502_the_operator_sees(sims, gateway, engine):
    """Not the engine's 401 (the client's key is not the one refused): a 502, counted, and a
    warning that names the endpoint, once for the two refusals in a row."""
    sim = await sims(engine, "m", api_key=KEY)
    # no adapter discovery: its refusals would be counted too (a test of their own below)
    gw = await gateway([model_block("m", engine, [sim.url], api_key="not-the-engines-key")], lora=NO_DISCOVERY)
    client = openai_client(gw)
    with structlog.testing.capture_logs() as logs:
        with pytest.raises(openai.APIStatusError) as e:
            await client.chat.completions.create(model="m", messages=CHAT, max_tokens=2)
        with pytest.raises(openai.APIStatusError):
            await client.chat.completions.create(model="m", messages=CHAT, max_tokens=2, stream=True)
    assert e.value.status_code == 502 and e.value.code == "upstream_auth_failed"
    assert e.value.response.headers["x-error-upstream"] == "auth"
    assert "Unauthorized" not in e.value.message            # the engine's body is not passed on
    warned = [x for x in logs if x["event"] == "engine refused the gateway's api_key"]
    assert len(warned) == 1 and warned[0]["status"] == 401 and warned[0]["endpoint"] == gw.gw.pool.endpoints("m")[0].name
    assert (f'switchyard_upstream_errors_total{{endpoint="{warned[0]["endpoint"]}",error_class="upstream_auth",'
            f'model="m"}} 2.0') in await gw.metrics_text()
    if engine == "sglang":
        return
    # Anthropic-shaped on /v1/messages
    r = await post(gw, {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
                   path="/v1/messages")
    assert r.status == 502 and orjson.loads(r.body)["type"] == "error"


async def test_a_wrong_key_on_a_vllm_prefill_is_a_502_without_the_engines_body(sims, gateway):
    p, d = await pd_pair(sims, "vllm", api_key=KEY)
    rs = {"name": "rs-1", "prefill": [{"url": p.url, "api_key": "not-the-engines-key"}], "decode": [d.url]}
    gw = await gateway([pd_model("vllm", [rs], api_key=KEY)], lora=NO_DISCOVERY)
    with pytest.raises(openai.APIStatusError) as e:
        await openai_client(gw).chat.completions.create(model="m", messages=CHAT, max_tokens=2)
    assert e.value.status_code == 502 and e.value.code == "pd_prefill_http_status"
    assert "refused the gateway's credentials" in e.value.message and "Unauthorized" not in e.value.message
    prefill = next(ep for ep in gw.gw.pool.endpoints("m") if ep.role == "prefill")
    assert metric(await gw.metrics_text(), "switchyard_upstream_errors_total", endpoint=prefill.name,
                  error_class="upstream_auth", model="m") == 1
    assert not [r for r in (await sim_state(d.url))["received"] if r["path"].startswith("/v1/chat")]  # no decode


async def test_a_lora_load_refused_for_a_wrong_key_says_so(sims, gateway):
    sim = await sims("vllm", "m", api_key=KEY, **LORA_SIM)
    gw = await gateway([model_block("m", "vllm", [sim.url], api_key="not-the-engines-key",
                                    adapters={"sql": "org/sql-lora"})], lora=FAST_LORA)
    with pytest.raises(openai.APIStatusError) as e:
        await openai_client(gw).chat.completions.create(model="sql", messages=CHAT, max_tokens=2)
    assert e.value.status_code == 502
    assert "refused the gateway's credentials" in e.value.message and "Unauthorized" not in e.value.message
    assert {"method": "POST", "path": "/v1/load_lora_adapter"} in await refused(sim)
    assert metric(await gw.metrics_text(), "switchyard_upstream_errors_total", error_class="upstream_auth") >= 1


async def test_the_adapter_discovery_refused_for_a_wrong_key_is_counted(sims, gateway):
    """The periodic GET /v1/models meets the wrong key before any client asks for an adapter: the
    operator sees it in the metric as for a client's request, not only as adapters never found."""
    sim = await sims("vllm", "m", api_key=KEY, **LORA_SIM)
    gw = await gateway([model_block("m", "vllm", [sim.url], api_key="not-the-engines-key",
                                    adapters={"sql": "org/sql-lora"})], lora=FAST_LORA)

    async def counted() -> bool:
        return metric(await gw.metrics_text(), "switchyard_upstream_errors_total", error_class="upstream_auth") >= 1

    assert await wait_for(counted, timeout=5)
    assert {"method": "GET", "path": "/v1/models"} in await refused(sim)


async def test_a_wrong_key_on_one_endpoint_is_retried_on_another(sims, gateway):
    """The refusal is that endpoint's fault, not the request's: retried where the key is right."""
    good = await sims("vllm", "m", api_key=KEY)
    bad = await sims("vllm", "m", api_key="rotated-on-this-engine")
    gw = await gateway([model_block("m", "vllm", [good.url, bad.url], api_key=KEY)],
                       routing={"strategy": "round-robin"})
    client = openai_client(gw)
    for _ in range(4):
        r = await client.chat.completions.create(model="m", messages=CHAT, max_tokens=2)
        assert r.usage.completion_tokens == 2
    assert (await sim_state(good.url))["counts"]["completed"] == 4
    assert await refused(good) == [] and await refused(bad)


@pytest.mark.parametrize("given", [KEY, "wrong-" + KEY])
async def test_the_key_is_shown_nowhere(sims, gateway, given):
    """Not in the log lines, metrics, status page, models list, answers, nor a repr of the config or
    the endpoints; ``given``: the gateway's key for the engine, right or refused."""
    sim = await sims("vllm", "m", api_key=KEY)
    gw = await gateway([model_block("m", "vllm", [sim.url], api_key=given)], auth={"admin_token": ADMIN})
    with structlog.testing.capture_logs() as logs, gw.gw.request_log.capture() as lines:
        for stream in (False, True):
            await post(gw, {"model": "m", "messages": CHAT, "max_tokens": 2, "stream": stream})
        bodies = [(await post(gw, {"model": "m", "messages": CHAT, "max_tokens": 2})).body]
        await asyncio.sleep(0.5)        # a probe and a scrape or two
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/status.json", headers=bearer(ADMIN)) as r:
            assert r.status == 200
            status = await r.read()
        async with s.get(gw.url + "/v1/models") as r:
            models = await r.read()
    shown = [repr(logs), repr(lines), await gw.metrics_text(), status.decode(), models.decode(),
             *(b.decode() for b in bodies), repr(gw.gw.config), repr(gw.gw.pool.endpoints())]
    assert not [s for s in shown if given in s]
    assert lines and all(x["status"] == (200 if given == KEY else 502) for x in lines)


async def test_a_reload_changes_the_key_of_the_endpoints_it_keeps(sims, gateway, tmp_path, monkeypatch):
    from gateway.config.schema import load_config
    from gateway.server.app import RELOAD_KEY
    sim = await sims("vllm", "m", api_key=KEY)
    gw = await gateway([model_block("m", "vllm", [sim.url], api_key="the-old-key")])
    (ep,) = gw.gw.pool.endpoints("m")
    client = openai_client(gw)
    with pytest.raises(openai.APIStatusError):
        await client.chat.completions.create(model="m", messages=CHAT, max_tokens=2)
    monkeypatch.setenv("M_ENGINE_KEY", KEY)
    path = tmp_path / "gw.yaml"
    reloader = gw.runner.app[RELOAD_KEY]
    data = msgspec.to_builtins(reloader.live.config)
    data["models"] = [model_block("m", "vllm", [sim.url], api_key_env="M_ENGINE_KEY")]
    path.write_text(orjson.dumps(data).decode())        # JSON is YAML
    reloader.loader = lambda: load_config(path)
    result = reloader.reload("test")
    assert result.result == "ok" and result.added == result.removed == []
    assert gw.gw.pool.endpoints("m") == [ep]            # the same endpoint, its state kept
    r = await client.chat.completions.create(model="m", messages=CHAT, max_tokens=2)
    assert r.usage.completion_tokens == 2
