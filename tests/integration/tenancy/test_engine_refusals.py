"""A user's limits when the engine refuses a request, in memory and on Redis: TPM is charged only
the tokens the engine reported (none for a refusal, a refused connection or an error event before
the first token; a stream the engine broke off after some tokens, what it had sent), the
concurrency slot is given back, and the request windows keep the count of a request an engine saw
(not of one whose every connection was refused)."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from gateway.request import parse
from tests.support.factories import model_block
from tests.support.fake_engine import fake_engine
from tests.support.http import openai_client
from tests.support.waiting import until, wait_for

CHAT = [{"role": "user", "content": "hello there"}]
LIMITS = {"users": {"alice": {"tpm": 100000, "rpm": 1000, "max_concurrent": 4}}}

REFUSALS = {
    "400": ({"x-sim-fault": "status=400"}, openai.BadRequestError, False),
    "404": ({"x-sim-fault": "status=404"}, openai.NotFoundError, False),
    "500": ({"x-sim-fault": "status=500"}, openai.InternalServerError, False),
    "501": ({"x-sim-fault": "status=501"}, openai.APIStatusError, False),
    "too_long": ({}, openai.BadRequestError, False),                    # vLLM's 400: prompt past max_model_len
    "error_event": ({"x-sim-fault": "error_after=0"}, openai.APIError, True),   # before any token
    "refused": ({}, openai.InternalServerError, False),                 # the engine's port is closed: 502
}


@pytest.fixture(params=["memory", "redis"])
def backend(request):
    if request.param == "memory":
        return {}
    server = request.getfixturevalue("redis_server")
    return {"state": {"redis_url": server.url, "sync_interval_s": 0.05, "replica_ttl_s": 5.0, "timeout_s": 2.0}}


async def settled(gw) -> dict[str, int]:
    """alice's windows once her request settled: its slot released, in the same write as its tokens."""
    state = gw.gw.tenancy.state

    async def released() -> dict[str, int] | None:
        usage = await state.usage("alice")
        return usage if usage["concurrent"] == 0 and not state.slots().get("alice") else None

    return await until(released)


@pytest.mark.parametrize("case", sorted(REFUSALS))
async def test_a_refused_request_is_charged_no_tokens_and_gives_its_slot_back(sims, gateway, backend, case):
    sim = await sims("vllm", "m", max_model_len=4096)
    health = {"health": {"interval_s": 60}} if case == "refused" else {}
    gw = await gateway([model_block("m", "vllm", [sim.url])], limits=LIMITS, **health, **backend)
    assert await wait_for(lambda: gw.gw.pool.ready("m"))
    if case == "refused":
        await sim.close()
    headers, raised, stream = REFUSALS[case]
    content = "word " * 5000 if case == "too_long" else "hello there"
    client = openai_client(gw)
    with pytest.raises(raised):
        r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}],
                                                 max_tokens=100, user="alice", stream=stream, extra_headers=headers)
        if stream:
            async for _ in r:
                pass
    usage = await settled(gw)
    assert usage["tokens"] == 0 and usage["concurrent"] == 0
    # counted in the RPM window when an engine saw it; a refused connection: no engine did
    assert usage["requests"] == (0 if case == "refused" else 1)


async def test_a_stream_the_engine_breaks_off_is_charged_what_it_sent(sims, gateway, backend):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], limits=LIMITS, **backend)
    client = openai_client(gw)
    ok = await client.chat.completions.create(model="m", messages=CHAT,
                                              max_tokens=1, user="alice")
    first = (await settled(gw))["tokens"]
    assert first == ok.usage.total_tokens
    chunks = []
    with pytest.raises(openai.APIError):
        r = await client.chat.completions.create(model="m", messages=CHAT,
                                                 max_tokens=100, user="alice", stream=True,
                                                 extra_headers={"x-sim-fault": "error_after=2"})
        async for c in r:
            chunks.append(c)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 2
    usage = await settled(gw)
    # no usage came: the prompt's estimate and the two tokens sent
    estimate = parse("/v1/chat/completions", orjson.dumps({"model": "m", "messages": CHAT}), {}, "e").prompt_tokens_est
    assert usage["tokens"] - first == estimate + 2


async def test_a_client_that_leaves_on_the_engines_error_event_is_charged_nothing(gateway):
    """The SDKs raise on an error event and close the stream: a client that leaves there, while the
    engine's end is still awaited, left an answer the engine had already failed, before any token."""
    release = asyncio.Event()
    started: list[str] = []

    async def failing(request: web.Request) -> web.StreamResponse:
        await request.read()
        started.append(request.path)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
        error = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                           "code": 500}}
        await resp.write(b"data: " + orjson.dumps(head) + b"\n\ndata: " + orjson.dumps(error) + b"\n\n")
        await release.wait()            # its [DONE] and end are held back
        return resp

    records = []
    async with fake_engine(failing) as url:
        gw = await gateway([model_block("m", "vllm", [url])], limits=LIMITS, scrape={"enabled": False},
                           admission={"enabled": True, "max_in_flight_per_endpoint": 4})
        gw.gw.observers.append(lambda rec, _d: records.append(rec))
        client = openai_client(gw)
        stream = await client.chat.completions.create(model="m", messages=CHAT, max_tokens=1000, user="alice",
                                                      stream=True)
        with pytest.raises(openai.APIError, match="Internal server error"):
            async for _ in stream:
                pass
        await stream.close()            # as the SDK's `with` block does on the error
        usage = await settled(gw)
        release.set()
    assert started == ["/v1/chat/completions"]
    [rec] = records
    assert rec.status == 499 and rec.error_class == "upstream_stream_error"
    assert usage["tokens"] == 0
    assert gw.gw.admission._models["m"].queue.counter(1, "alice") == 0


async def test_a_request_retried_after_a_5xx_to_an_engine_that_took_no_connection_gives_its_count_back(
        sims, gateway, backend):
    """The client's answer decides the RPM count: an engine's 500 the gateway retried elsewhere never
    reached the client, so a retry that then finds no engine taking its connection answers with the
    gateway's refusal (502 upstream_unavailable), and gives the count back as a request whose every
    connection was refused does; the other way round, the engine's 500 is the client's answer and
    keeps it. Round-robin (a retry's route takes its turn too): each request starts on the failing
    engine."""
    failing = await sims("vllm", "m", fault="status=500")
    gone = await sims("vllm", "m")
    # passive health and the breaker would take either engine out after its first failure
    gw = await gateway([model_block("m", "vllm", [failing.url, gone.url])], limits=LIMITS,
                       routing={"strategy": "round-robin"}, health={"interval_s": 60, "timeout_s": 1.0,
                                                                     "passive": False},
                       breaker={"enabled": False}, scrape={"enabled": False}, **backend)
    assert await wait_for(lambda: len(gw.gw.pool.ready("m")) == 2)
    await gone.close()
    records = []
    gw.gw.observers.append(lambda rec, _d: records.append(rec))
    client = openai_client(gw)
    for _ in range(2):
        with pytest.raises(openai.InternalServerError):
            await client.chat.completions.create(model="m", messages=CHAT, max_tokens=10, user="alice")
    assert all(r.retries == 1 for r in records) and 502 in [r.status for r in records]
    usage = await settled(gw)
    assert usage["tokens"] == 0 and usage["concurrent"] == 0
    # the engine's 500s that were the client's answer, not the gateway's 502s
    assert usage["requests"] == sum(r.status == 500 for r in records)


@pytest.mark.parametrize(("path", "body", "delta"), [
    ("/v1/messages", {"messages": CHAT, "max_tokens": 50}, b"event: content_block_delta"),
    ("/v1/responses", {"input": "hello there", "max_output_tokens": 50}, b"event: response.output_text.delta"),
])
async def test_a_messages_or_responses_stream_whose_engine_dies_is_charged_what_it_sent(
        sims, gateway, backend, path, body, delta):
    """The engine's connection breaks after 3 tokens (no final usage): a Messages stream is charged
    the prompt message_start reported and the 3 deltas sent, a Responses stream (no usage before
    its end) the prompt's estimate and the 3 deltas; the slot is given back either way."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], limits=LIMITS, **backend)
    raw = b""
    async with aiohttp.ClientSession() as s, s.post(
            gw.url + path, json={"model": "m", "stream": True, **body},
            headers={"user": "alice", "x-sim-fault": "drop_after=3"}) as r:
        assert r.status == 200
        raw = await r.read()
    events = [orjson.loads(line[5:]) for line in raw.splitlines() if line.startswith(b"data:")]
    assert raw.count(delta) == 3 and events[-1]["type"] in ("error", "response.failed")
    if path == "/v1/messages":
        prompt = next(e["message"]["usage"]["input_tokens"] for e in events if e["type"] == "message_start")
    else:
        prompt = parse(path, orjson.dumps({"model": "m", **body}), {}, "e").prompt_tokens_est
    assert (await settled(gw))["tokens"] == prompt + 3


async def test_a_messages_count_tokens_request_is_charged_nothing(sims, gateway):
    """count_tokens generates nothing and reports no usage (docs/apis.md: it charges nothing): the
    prompt's estimate, charged when a generating request's usage never came, is not charged."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], limits=LIMITS)
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(gw.url + "/v1/messages/count_tokens", json={"model": "m", "messages": CHAT},
                              headers={"user": "alice"}) as r:
                assert r.status == 200 and (await r.json())["input_tokens"] > 0
    usage = await settled(gw)
    assert usage["tokens"] == 0 and usage["requests"] == 2



@pytest.mark.parametrize("fault", ["error_after=3", "drop_after=3"])
async def test_an_sglang_messages_stream_that_fails_is_charged_its_prompt_and_what_it_sent(sims, gateway, fault):
    """SGLang's ``message_start`` carries zero usage, and after its own error event its
    ``message_delta`` too (the counts come only in the ``message_delta`` of a stream that
    finished): a stream it fails after 3 tokens, or whose connection breaks there, reported no
    prompt, so it is charged the prompt's estimate and the 3 deltas sent, as any stream cut
    before its usage, not the deltas alone (or nothing, when SGLang's stream still ended)."""
    sim = await sims("sglang", "m")
    gw = await gateway([model_block("m", "sglang", [sim.url])], limits=LIMITS)
    body = {"model": "m", "stream": True, "messages": CHAT, "max_tokens": 50}
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/messages", json=body,
                                                    headers={"user": "alice", "x-sim-fault": fault}) as r:
        assert r.status == 200
        raw = await r.read()
    assert raw.count(b"event: content_block_delta") == 3 and b"event: error" in raw
    estimate = parse("/v1/messages", orjson.dumps(body), {}, "e").prompt_tokens_est
    assert estimate > 0 and (await settled(gw))["tokens"] == estimate + 3
