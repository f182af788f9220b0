"""Admission's 429 as each API's clients meet it: the chat, completions and Responses paths answer
in OpenAI's error shape and the Messages path in Anthropic's, streamed or not (a shed request has
sent nothing yet, so it is an HTTP error, never a stream's error event), with ``Retry-After`` and
``retry-after-ms``; the SDKs raise their rate-limit error and, given retries, wait what the gateway
said and are served once room frees."""

from __future__ import annotations

import asyncio
import contextlib

import anthropic
import openai
import orjson
import pytest

from tests.support.factories import model_block
from tests.support.http import anthropic_client, chat_body, openai_client, post
from tests.support.waiting import until, wait_for

CHAT = [{"role": "user", "content": "hello there"}]
HOLD = {"x-sim-fault": "stall_before_first=inf"}      # runs on the engine until its client leaves
PATHS = {
    "chat": ("/v1/chat/completions", chat_body(CHAT)),
    "completions": ("/v1/completions", {"model": "m", "prompt": "hello there", "max_tokens": 4}),
    "responses": ("/v1/responses", {"model": "m", "input": "hello there", "max_output_tokens": 4}),
    "messages": ("/v1/messages", {"model": "m", "messages": CHAT, "max_tokens": 4}),
}


async def full_gateway(sims, gateway, queue_timeout_s: float):
    """One engine admission lets one request at a time onto, held by a request until it is cancelled."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       admission={"enabled": True, "max_in_flight_per_endpoint": 1, "queue_timeout_s": queue_timeout_s})
    return gw


async def hold(gw) -> asyncio.Task:
    task = asyncio.create_task(post(gw.url, chat_body(CHAT), HOLD))
    assert await wait_for(lambda: gw.gw.pool.endpoints("m")[0].in_flight == 1)
    return task


async def cancel(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", list(PATHS))
async def test_a_queue_timeout_is_a_429_in_the_apis_shape_with_retry_after(sims, gateway, api, stream):
    gw = await full_gateway(sims, gateway, 0.3)
    blocker = await hold(gw)
    path, payload = PATHS[api]
    status, headers, raw = await post(gw.url, {**payload, "stream": stream}, path=path)
    assert status == 429 and headers["Content-Type"].startswith("application/json")
    assert int(headers["Retry-After"]) >= 1 and int(headers["retry-after-ms"]) >= 1000
    assert headers["x-error-admission"] == "queue_timeout"
    doc = orjson.loads(raw)
    if api == "messages":
        assert doc["type"] == "error" and doc["error"]["type"] == "rate_limit_error" and doc["error"]["message"]
    else:
        assert set(doc["error"]) == {"message", "type", "param", "code"}
        assert doc["error"]["code"] == "queue_timeout" and doc["error"]["type"] == "rate_limit_error"
    # the SDKs raise their rate-limit error, stream or not
    if api == "messages":
        client = anthropic_client(gw)
        with pytest.raises(anthropic.RateLimitError) as err:
            if stream:
                async with client.messages.stream(**payload) as events:
                    async for _ in events:
                        pass
            else:
                await client.messages.create(**payload)
        assert err.value.body["error"]["type"] == "rate_limit_error"
    else:
        client = openai_client(gw)
        call = {"chat": client.chat.completions.create, "completions": client.completions.create,
                "responses": client.responses.create}[api]
        with pytest.raises(openai.RateLimitError) as err:
            answer = await call(**payload, stream=stream)
            if stream:
                async for _ in answer:
                    pass
        assert err.value.code == "queue_timeout"
    assert err.value.response.headers["x-error-admission"] == "queue_timeout"
    await cancel(blocker)
    assert len(gw.gw.admission._models["m"].queue) == 0


@pytest.mark.parametrize("sdk", ["anthropic", "openai"])
async def test_an_sdk_given_retries_waits_the_retry_after_and_is_served_once_room_frees(sims, gateway, sdk):
    """The SDKs honour ``retry-after-ms`` (and ``Retry-After``) up to 60 s: the one shed for
    ``queue_timeout`` comes back after the second the drain rate gave and is served, the room having
    freed meanwhile."""
    gw = await full_gateway(sims, gateway, 1.0)
    for _ in range(3):          # answered requests: a drain rate, so Retry-After is computed, not the cap
        assert (await post(gw.url, chat_body(CHAT))).status == 200
    blocker = await hold(gw)
    with gw.gw.request_log.capture() as lines:
        async def free_on_the_first_429():
            await until(lambda: any(x["status"] == 429 for x in lines), timeout=30)
            await cancel(blocker)
        freeing = asyncio.create_task(free_on_the_first_429())
        if sdk == "anthropic":
            client = anthropic.AsyncAnthropic(base_url=gw.url, api_key="none", max_retries=1)
            answer = await client.messages.create(**PATHS["messages"][1])
            assert answer.content[0].text
        else:
            client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="none", max_retries=1)
            answer = await client.chat.completions.create(**chat_body(CHAT))
            assert answer.choices[0].message.content
        await client.close()
        await freeing
        shed = [x for x in lines if x["status"] == 429]
        assert len(shed) == 1 and 1 <= shed[0]["retry_after_s"] < 60      # computed from the drain, not the cap
        assert [x["status"] for x in lines if x["status"] != 499] == [429, 200]   # 499: the blocker
