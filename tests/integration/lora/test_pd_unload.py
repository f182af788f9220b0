"""LoRA adapters loaded on demand for P/D models (one load per missing role, shared by concurrent
requests, failures with the engine's message) and unloaded by the gateway: to stay under
``max_adapters_per_endpoint``, after ``idle_unload_s``, and when the engine refuses a load as full;
never while requests for the adapter are in flight there."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.support.factories import model_block
from tests.support.http import openai_client, sim_state
from tests.support.lora import FAST_LORA, LORA_SIM, MSG, chat, load_calls
from tests.support.waiting import until, wait_for


def unload_calls(state: dict) -> list[dict]:
    return [r for r in state["received"] if r["path"] in ("/v1/unload_lora_adapter", "/unload_lora_adapter")]


def rolesets(engine: str, prefills, decodes) -> list[dict]:
    if engine == "sglang":
        p = [{"url": s.url, "bootstrap_port": s.bootstrap_port} for s in prefills]
    else:
        p = [s.url for s in prefills]
    return [{"name": "rs", "prefill": p, "decode": [d.url for d in decodes]}]


class Held:
    """A streamed request for ``model`` held open after its first event (the engine stalls), so
    its adapter is in flight until ``close``."""

    def __init__(self, gw, model: str, fault: str = "stall_after=1:inf") -> None:
        self.gw, self.model, self.fault = gw, model, fault

    async def __aenter__(self) -> Held:
        self.session = aiohttp.ClientSession()
        self.resp = await self.session.post(
            self.gw.url + "/v1/chat/completions", headers={"x-sim-fault": self.fault},
            json={"model": self.model, "messages": MSG, "max_tokens": 50, "stream": True})
        assert self.resp.status == 200, await self.resp.text()
        await self.resp.content.readline()          # the first event: routed and charged
        return self

    async def __aexit__(self, *exc) -> None:
        self.resp.close()
        await self.session.close()
        await wait_for(lambda: all(not ep.adapters.in_flight for ep in self.gw.gw.pool.endpoints()))


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_pd_loads_once_per_role_under_concurrency(sims, gateway, engine):
    """No engine has the adapter: 8 concurrent requests share one load on a prefill and one on a
    decode, and both legs of every request run there."""
    prefills = [await sims(engine, "m", role="prefill", **LORA_SIM) for _ in range(2)]
    decodes = [await sims(engine, "m", role="decode", **LORA_SIM) for _ in range(2)]
    gw = await gateway([{"name": "m", "engine": engine, "rolesets": rolesets(engine, prefills, decodes),
                         "adapters": {"sql": "org/sql-lora"}}], lora=FAST_LORA)
    results = await asyncio.gather(*(chat(gw, "sql") for _ in range(8)))
    for status, headers, body in results:
        assert status == 200 and body["model"] == "sql", body
        assert headers["x-pd-decision"].startswith("disaggregated")
    for group in (prefills, decodes):
        states = [await sim_state(s.url) for s in group]
        assert sorted(len(load_calls(st)) for st in states) == [0, 1]       # one load, on one engine
        for st in states:
            has = "sql" in st["lora"]["registered"]
            assert st["counts"]["started"] == (8 if has else 0)
    text = await gw.metrics_text()
    assert 'switchyard_lora_loads_total{adapter="sql",model="m",result="ok"} 2.0' in text
    client = openai_client(gw)
    reply = await client.chat.completions.create(model="sql", messages=MSG, max_tokens=3)
    assert reply.model == "sql" and reply.choices[0].message.content
    await client.close()
    assert sum([len(load_calls(await sim_state(s.url))) for s in prefills + decodes]) == 2


async def test_pd_load_failure_answers_the_engine_message(sims, gateway):
    p = await sims("vllm", "m", role="prefill", **LORA_SIM)
    d = await sims("vllm", "m", role="decode", **LORA_SIM)
    gw = await gateway([{"name": "m", "engine": "vllm", "rolesets": rolesets("vllm", [p], [d]),
                         "adapters": {"gone": "/nonexistent/gone-lora"}}], lora=FAST_LORA)
    for status, headers, body in await asyncio.gather(*(chat(gw, "gone") for _ in range(3))):
        assert status == 502 and headers["x-error-lora-load"] == "error"
        assert body["error"]["code"] == "lora_load_failed"
        assert "No adapter found for /nonexistent/gone-lora" in body["error"]["message"]
    assert [len(load_calls(await sim_state(s.url))) for s in (p, d)] == [1, 1]
    status, headers, body = await chat(gw, "gone")      # both cool down: 503, no call
    assert status == 503 and headers["x-error-lora-load"] == "cooldown" and int(headers["Retry-After"]) >= 1
    assert [len(load_calls(await sim_state(s.url))) for s in (p, d)] == [1, 1]


async def test_capacity_unloads_the_least_recent_idle_adapter(sims, gateway):
    """Cap 1: a, then b unloads a; with b in flight, a request for a keeps b (503, nothing to
    unload); once b is done, a unloads b."""
    sim = await sims("vllm", "m", **LORA_SIM)
    gw = await gateway([model_block("m", "vllm", [sim.url], adapters={"a": "org/a", "b": "org/b"})],
                       lora={**FAST_LORA, "max_adapters_per_endpoint": 1})
    assert (await chat(gw, "a"))[0] == 200
    assert (await chat(gw, "b"))[0] == 200
    st = await sim_state(sim.url)
    assert st["lora"]["registered"] == {"b": "org/b"} and len(unload_calls(st)) == 1
    async with Held(gw, "b"):
        status, headers, body = await chat(gw, "a")
        assert status == 503 and headers["x-error-lora-load"] == "full" and headers["Retry-After"] == "1"
        assert "max_adapters_per_endpoint" in body["error"]["message"]
        st = await sim_state(sim.url)
        assert st["lora"]["registered"] == {"b": "org/b"} and len(unload_calls(st)) == 1
    status, _, body = await chat(gw, "a")
    assert status == 200 and body["model"] == "a"
    st = await sim_state(sim.url)
    assert st["lora"]["registered"] == {"a": "org/a"} and st["lora"]["unloads"] == 2
    text = await gw.metrics_text()
    for adapter in ("a", "b"):
        assert f'switchyard_lora_unloads_total{{adapter="{adapter}",model="m",reason="capacity"}} 1.0' in text
    assert 'switchyard_lora_loads_total{adapter="a",model="m",result="full"} 1.0' in text


async def test_capacity_prefers_an_endpoint_with_room(sims, gateway):
    a = await sims("vllm", "m", **LORA_SIM)
    b = await sims("vllm", "m", **LORA_SIM)
    gw = await gateway([model_block("m", "vllm", [a.url, b.url], adapters={"x": "org/x", "y": "org/y"})],
                       lora={**FAST_LORA, "max_adapters_per_endpoint": 1})
    assert (await chat(gw, "x"))[0] == 200
    assert (await chat(gw, "y"))[0] == 200
    states = [await sim_state(s.url) for s in (a, b)]
    assert sorted(len(st["lora"]["registered"]) for st in states) == [1, 1]
    assert all(st["lora"]["unloads"] == 0 for st in states)


async def test_idle_adapters_the_gateway_loaded_are_unloaded(sims, gateway):
    sim = await sims("vllm", "m", lora_modules=("kept=org/kept",), **LORA_SIM)
    gw = await gateway([model_block("m", "vllm", [sim.url], adapters={"a": "org/a"})],
                       lora={**FAST_LORA, "idle_unload_s": 0.2})
    assert (await chat(gw, "a"))[0] == 200
    unloaded = await wait_for(lambda: 'switchyard_lora_unloads_total{adapter="a",model="m",reason="idle"} 1.0'
                              in gw.gw.metrics.render().decode())
    assert unloaded
    st = await sim_state(sim.url)
    assert st["lora"]["registered"] == {"kept": "org/kept"}    # discovered, not the gateway's: stays
    assert all("a" not in ep.adapters.served for ep in gw.gw.pool.endpoints())
    assert (await chat(gw, "a"))[0] == 200                      # loaded again on demand
    assert len(load_calls(await sim_state(sim.url))) == 2


@pytest.mark.parametrize("discovery", [0, 0.1])
async def test_the_endpoints_gauge_follows_a_load_and_an_idle_unload(sims, gateway, discovery):
    """switchyard_lora_adapter_endpoints counts the adapter's endpoints when it is loaded (with
    discovery off too) and goes back to 0 when it is unloaded, not its last count forever."""
    sim = await sims("vllm", "m", **LORA_SIM)
    gw = await gateway([model_block("m", "vllm", [sim.url], adapters={"a": "org/a"})],
                       lora={"discovery_interval_s": discovery, "idle_unload_s": 0.3})
    gauge = 'switchyard_lora_adapter_endpoints{adapter="a",model="m"}'
    assert (await chat(gw, "a"))[0] == 200
    assert f"{gauge} 1.0" in gw.gw.metrics.render().decode()
    await until(lambda: 'reason="idle"} 1.0' in gw.gw.metrics.render().decode())
    await until(lambda: f"{gauge} 0.0" in gw.gw.metrics.render().decode())


async def test_pd_adapter_in_flight_is_not_unloaded_from_either_leg(sims, gateway):
    p = await sims("vllm", "m", role="prefill", **LORA_SIM)
    d = await sims("vllm", "m", role="decode", **LORA_SIM)
    gw = await gateway([{"name": "m", "engine": "vllm", "rolesets": rolesets("vllm", [p], [d]),
                         "adapters": {"sql": "org/sql-lora"}}], lora={**FAST_LORA, "idle_unload_s": 600})
    lora = gw.gw.lora
    async with Held(gw, "sql", fault="decode.stall_after=1:inf"):
        lora.clock = lambda: time.monotonic() + 3600        # everything looks idle
        assert await lora.unload_idle() == 0
        assert all(["sql" in (await sim_state(s.url))["lora"]["registered"] for s in (p, d)])
    assert await lora.unload_idle() == 2
    for s in (p, d):
        st = await sim_state(s.url)
        assert st["lora"]["registered"] == {} and len(unload_calls(st)) == 1


@pytest.mark.parametrize(("engine", "message"), [
    ("vllm", "No free adapter slots."),
    ("sglang", "Maximum number of loaded LoRA adapters is 1. Please unload some LoRA adapters"),
])
async def test_engine_full_unloads_an_idle_adapter_and_retries(sims, gateway, engine, message):
    sim = await sims(engine, "m", max_loaded_loras=1, **LORA_SIM)
    gw = await gateway([model_block("m", engine, [sim.url], adapters={"a": "org/a", "b": "org/b", "c": "org/c"})],
                       lora=FAST_LORA)
    assert (await chat(gw, "a"))[0] == 200
    assert (await chat(gw, "b"))[0] == 200      # refused as full, a unloaded, loaded on the retry
    st = await sim_state(sim.url)
    assert st["lora"]["registered"] == {"b": "org/b"} and len(load_calls(st)) == 3
    text = await gw.metrics_text()
    assert 'switchyard_lora_unloads_total{adapter="a",model="m",reason="error"} 1.0' in text
    async with Held(gw, "b"):                   # full again, and b is in use: the engine's message
        status, headers, body = await chat(gw, "c")
        assert status == 502 and headers["x-error-lora-load"] == "error"
        assert message in body["error"]["message"]
    assert (await sim_state(sim.url))["lora"]["registered"] == {"b": "org/b"}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_engine_full_of_adapters_it_may_not_unload_cools_nothing_down(sims, gateway, engine):
    """The engine's one slot holds another gateway's adapter (not in this config): the load is
    refused as full, and once that adapter is unloaded the next request loads its own at once,
    where the refusal kept the endpoint in failure_cooldown_s (60 s) for the adapter."""
    sim = await sims(engine, "m", max_loaded_loras=1, lora_modules=("other=org/other",), **LORA_SIM)
    gw = await gateway([model_block("m", engine, [sim.url], adapters={"a": "org/a"})], lora=FAST_LORA)
    status, headers, _ = await chat(gw, "a")
    assert status == 502 and headers["x-error-lora-load"] == "error"
    async with aiohttp.ClientSession() as s:        # the other gateway unloads its adapter
        path = "/v1/unload_lora_adapter" if engine == "vllm" else "/unload_lora_adapter"
        async with s.post(sim.url + path, json={"lora_name": "other"}) as r:
            assert r.status == 200
    assert (await chat(gw, "a"))[0] == 200
    assert (await sim_state(sim.url))["lora"]["registered"] == {"a": "org/a"}


async def test_engine_full_sends_the_load_to_an_endpoint_with_room(sims, gateway):
    """Of two engines, the one the gateway asks first is full of another gateway's adapters: the
    same request's load goes on to the other, and the next request for the adapter is not refused."""
    full = await sims("vllm", "m", max_loaded_loras=1, lora_modules=("other=org/other",), **LORA_SIM)
    free = await sims("vllm", "m", max_loaded_loras=1, **LORA_SIM)
    gw = await gateway([model_block("m", "vllm", [full.url, free.url], adapters={"a": "org/a"})],
                       lora={**FAST_LORA, "discovery_interval_s": 0})
    # the gateway does not know of "other" (no discovery): the full engine is as good a target as the
    # free one, and of equals the first listed is kept (the tie is otherwise broken at random, and the
    # free one, asked first, would leave the full one's refusal untried)
    gw.gw.lora.random = lambda: 0.99
    for _ in range(4):
        assert (await chat(gw, "a"))[0] == 200
    assert len(load_calls(await sim_state(full.url))) == 1        # asked first, it refused the load
    assert (await sim_state(free.url))["lora"]["registered"] == {"a": "org/a"}
    assert (await sim_state(full.url))["lora"]["registered"] == {"other": "org/other"}


async def test_a_whole_request_and_a_pd_request_for_a_new_adapter_each_get_the_load_they_need(sims, gateway):
    """A P/D model with a combined endpoint: a request whose routing-strategy header names a
    whole-request strategy is routed among the combined endpoints, one routed by pd among the
    pairs. Each arriving while the other's first load of the adapter is under way loads it where
    it can run (the combined endpoint; a prefill and a decode), not taking the other's load for its
    own, whichever came first."""
    slow = {**LORA_SIM, "lora_load_call_ms": 300.0}
    p = await sims("vllm", "m", role="prefill", **slow)
    d = await sims("vllm", "m", role="decode", **slow)
    c = await sims("vllm", "m", **slow)
    gw = await gateway([{"name": "m", "engine": "vllm", "adapters": {"sql": "org/sql-lora", "chat": "org/chat-lora"},
                         "rolesets": [{"name": "rs", "prefill": [p.url], "decode": [d.url], "combined": [c.url]}],
                         "pd": {"combined_load_ratio": 0}}], lora=FAST_LORA)
    whole = {"routing-strategy": "least-request"}

    async def loading(sim, adapter: str) -> bool:
        return any(r["body"]["lora_name"] == adapter for r in load_calls(await sim_state(sim.url)))

    for adapter, (first, first_sim), second in (("sql", (None, p), whole), ("chat", (whole, c), None)):
        first_req = asyncio.ensure_future(chat(gw, adapter, first))
        await until(lambda first_sim=first_sim, adapter=adapter: loading(first_sim, adapter))
        results = await asyncio.gather(first_req, chat(gw, adapter, second))
        for status, _, body in results:
            assert (status, body.get("model")) == (200, adapter), body
        assert [h["x-pd-decision"].split(";")[0] for _, h, _ in results if "x-pd-decision" in h] == ["disaggregated"]
        for sim in (p, d, c):
            assert await loading(sim, adapter)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("leg", ["prefill", "decode"])
async def test_a_pd_leg_that_lost_its_adapter_has_it_loaded_again_there_alone(sims, gateway, engine, leg):
    """One leg's engine drops the adapter (a restart, another gateway's unload): its error answers
    the request that meets it, and the next request loads the adapter again on that leg's engine
    only, the other leg's engine, which still has it, asked nothing and counted no load."""
    p = await sims(engine, "m", role="prefill", **LORA_SIM)
    d = await sims(engine, "m", role="decode", **LORA_SIM)
    gw = await gateway([{"name": "m", "engine": engine, "rolesets": rolesets(engine, [p], [d]),
                         "adapters": {"tone": "org/tone-lora"}}], lora={"discovery_interval_s": 0})
    assert (await chat(gw, "tone"))[0] == 200
    lost, kept = (p, d) if leg == "prefill" else (d, p)
    unload = "/v1/unload_lora_adapter" if engine == "vllm" else "/unload_lora_adapter"
    async with aiohttp.ClientSession() as session, \
            session.post(lost.url + unload, json={"lora_name": "tone"}) as r:
        assert r.status == 200
    status, headers, body = await chat(gw, "tone")       # the engine's own error, once
    assert status in (400, 404) and headers[f"x-error-pd-{leg}"] == "http_status", body
    for _ in range(2):
        status, _, body = await chat(gw, "tone")
        assert status == 200, body
    assert [len(load_calls(await sim_state(s.url))) for s in (lost, kept)] == [2, 1]
    text = await gw.metrics_text()
    assert 'switchyard_lora_loads_total{adapter="tone",model="m",result="ok"} 3.0' in text
