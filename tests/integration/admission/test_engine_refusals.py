"""A request the engine refuses, on admission's side: the queue charges a user's counter the
request's expected size ahead of its answer (prompt plus twice its max_tokens), and settles it
against what the engine reported when the request ends. One the engine refused (a 400 for a prompt
past the context, a 404, a 500, a 501, an error event before any token) or that reached no engine
(a refused connection) served nothing: its user's counter is given the charge back, and nothing
else it took (the endpoint's in-flight count, a granted slot, the user's concurrency slot) is
left held, on the status page and in the metrics too."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import orjson
import pytest

from gateway.request import parse
from tests.support.factories import model_block
from tests.support.http import openai_client
from tests.support.waiting import wait_for

CHAT = [{"role": "user", "content": "hello there"}]
LIMITS = {"users": {"alice": {"tpm": 100000, "rpm": 1000, "max_concurrent": 4}}}
ADMISSION = {"enabled": True, "max_in_flight_per_endpoint": 4}
STANDARD = 1

# how each refusal is made, and what the SDK raises for it
REFUSALS = {
    "400": ({"x-sim-fault": "status=400"}, openai.BadRequestError),
    "404": ({"x-sim-fault": "status=404"}, openai.NotFoundError),
    "500": ({"x-sim-fault": "status=500"}, openai.InternalServerError),
    "501": ({"x-sim-fault": "status=501"}, openai.APIStatusError),
    "too_long": ({}, openai.BadRequestError),                       # vLLM's 400: prompt past max_model_len
    "error_event": ({"x-sim-fault": "error_after=0"}, openai.APIError),    # streamed: before any token
    "refused": ({}, openai.InternalServerError),                    # the engine's port is closed: 502
}


def counter(gw, user: str = "alice") -> float:
    return gw.gw.admission._models["m"].queue.counter(STANDARD, user)


async def get_json(gw, path: str):
    async with aiohttp.ClientSession() as s, s.get(gw.url + path) as r:
        assert r.status == 200
        return await r.json()


async def refused_gateway(sims, gateway, case: str):
    sim = await sims("vllm", "m", max_model_len=4096)
    # a refused connection: the engine goes away after the gateway saw it ready, before its next
    # check (and its metrics are not read: they would go stale, and admission would hold the request)
    health = {"health": {"interval_s": 60}, "scrape": {"enabled": False}} if case == "refused" else {}
    gw = await gateway([model_block("m", "vllm", [sim.url])], admission=ADMISSION, limits=LIMITS, **health)
    assert await wait_for(lambda: gw.gw.pool.ready("m"))
    if case == "refused":
        await sim.close()
    return sim, gw


@pytest.mark.parametrize(("case", "stream"), [(c, s) for c in sorted(REFUSALS) for s in (False, True)
                                               if s or c != "error_event"],     # an error event is a stream's
                         ids=lambda v: ("stream" if v else "whole") if isinstance(v, bool) else v)
async def test_a_request_the_engine_refuses_gives_its_users_counter_back(sims, gateway, case, stream):
    sim, gw = await refused_gateway(sims, gateway, case)
    headers, raised = REFUSALS[case]
    content = "word " * 5000 if case == "too_long" else "hello there"
    client = openai_client(gw)
    with pytest.raises(raised):
        r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}],
                                                 max_tokens=1000, user="alice", stream=stream, extra_headers=headers)
        if stream:
            async for _ in r:
                pass
    # the user was charged 2000 output tokens ahead of the answer; the engine generated none
    assert counter(gw) == 0
    ep = gw.gw.pool.endpoints("m")[0]
    assert ep.in_flight == 0 and gw.gw.admission._models["m"].granted == 0
    usage = await gw.gw.tenancy.state.usage("alice")
    assert usage["concurrent"] == 0
    status = await get_json(gw, "/status.json")
    assert [e["in_flight"] for e in status["endpoints"]] == [0]
    [alice] = status["tenants"]["users"]
    assert alice["usage"]["concurrent"] == 0
    text = await gw.metrics_text()
    assert 'switchyard_admission_queue_depth{model="m",priority="standard"} 0.0' in text


def prompt_estimate(body: dict) -> int:
    """The gateway's estimate of a request's prompt (what it is charged for until the engine says)."""
    return parse("/v1/chat/completions", orjson.dumps(body), {}, "est").prompt_tokens_est


async def test_a_served_request_settles_its_users_counter_with_the_engines_usage(sims, gateway):
    """Its prompt as the engine counted it and its output as the answer's usage says; a stream the
    engine broke off without usage: the tokens it had sent."""
    _, gw = await refused_gateway(sims, gateway, "served")
    client = openai_client(gw)
    r = await client.chat.completions.create(model="m", messages=CHAT, max_tokens=20, user="alice")
    assert r.usage.prompt_tokens != prompt_estimate({"model": "m", "messages": CHAT, "max_tokens": 20})
    assert counter(gw) == r.usage.prompt_tokens + 2 * r.usage.completion_tokens
    before = counter(gw)
    chunks = []
    with pytest.raises(openai.APIError):
        s = await client.chat.completions.create(model="m", messages=CHAT, max_tokens=1000, user="alice",
                                                 stream=True, extra_headers={"x-sim-fault": "error_after=2"})
        async for c in s:
            chunks.append(c)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 2
    body = {"model": "m", "messages": CHAT, "max_tokens": 1000, "stream": True}
    assert counter(gw) - before == prompt_estimate(body) + 2 * 2        # two tokens, not the 1000 asked for


async def test_a_request_granted_from_the_queue_then_refused_gives_its_counter_back(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], limits=LIMITS,
                       admission={**ADMISSION, "max_in_flight_per_endpoint": 1})
    client = openai_client(gw)
    hold = asyncio.create_task(client.chat.completions.create(
        model="m", messages=CHAT, max_tokens=4, user="bob", extra_headers={"x-sim-fault": "stall_before_first=inf"}))
    assert await wait_for(lambda: gw.gw.pool.endpoints("m")[0].in_flight == 1)
    refused = asyncio.create_task(client.chat.completions.create(
        model="m", messages=CHAT, max_tokens=1000, user="alice", extra_headers={"x-sim-fault": "status=400"}))
    assert await wait_for(lambda: gw.gw.admission.waiting("m") == 1)
    hold.cancel()
    with pytest.raises(openai.BadRequestError):
        await refused
    assert counter(gw) == 0
    assert gw.gw.pool.endpoints("m")[0].in_flight == 0 and gw.gw.admission._models["m"].granted == 0


async def test_a_messages_count_tokens_request_gives_its_users_counter_back(sims, gateway):
    """count_tokens generates nothing: no output is expected of it (it names no max_tokens, so twice
    its prompt was), and, served, it gives back what it was charged, as any request that got
    nothing generated."""
    _, gw = await refused_gateway(sims, gateway, "served")
    async with aiohttp.ClientSession() as s, s.post(
            gw.url + "/v1/messages/count_tokens", json={"model": "m", "messages": CHAT}, headers={"user": "alice"}) as r:
        assert r.status == 200 and (await r.json())["input_tokens"] > 0
    assert await wait_for(lambda: gw.gw.pool.endpoints("m")[0].in_flight == 0)    # released: settled
    assert counter(gw) == 0
