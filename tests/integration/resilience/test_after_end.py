"""A stream whose terminal event reached the client is a complete answer, whatever happens after
it: the engine resets or stalls before ending its body (``stall_at_end``, ``drop_at_end``), or
the client closes as soon as it has the last event while the engine's end is still awaited. The
client gets no error after the end, the request is logged and counted as a 200 with its usage,
and no client cancel is counted."""

from __future__ import annotations

import asyncio
from functools import partial

import aiohttp
import orjson
import pytest
from aiohttp import web

from tests.support.factories import model_block
from tests.support.fake_engine import fake_engine
from tests.support.http import anthropic_client, chat_body, openai_client, post, sse_events, sse_frames
from tests.support.metrics import metric
from tests.support.waiting import wait_for

CHAT = [{"role": "user", "content": "hello there"}]
body = partial(chat_body, CHAT, max_tokens=6, stream=True)
WATCHDOG = {"idle_timeout_s": 0.3, "first_chunk_timeout_s": 5, "aggregated": True}
ENDS = ["stall_at_end=10", "drop_at_end=1"]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("fault", ENDS)
async def test_a_chat_stream_that_ended_is_not_failed_by_the_engine_after_its_end(sims, gateway, engine, fault):
    sim = await sims(engine, "m")
    gw = await gateway([model_block("m", engine, [sim.url])], watchdog=WATCHDOG)
    st, _, raw = await post(gw.url, body(stream_options={"include_usage": True}), {"x-sim-fault": fault})
    assert st == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)
    assert events[-2]["usage"]["completion_tokens"] == 6
    # the real client reads the whole answer, no error
    client = openai_client(gw)
    stream = await client.chat.completions.create(**body(), extra_headers={"x-sim-fault": fault})
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    await client.close()
    assert text
    m = await gw.metrics_text()
    assert metric(m, "switchyard_path_requests_total", path="/v1/chat/completions", status="200") == 2
    assert metric(m, "switchyard_completion_tokens_total", model="m") == 12     # asked of the engine for both
    assert metric(m, "switchyard_upstream_errors_total") == 0        # no fault of the engine's counted


async def test_a_client_that_leaves_at_done_is_a_completed_request(sims, gateway):
    """The client reads up to ``[DONE]`` and closes while the engine has not ended its body yet:
    a 200 with its TTFT and usage, no 499 and no client cancel."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    n = 3
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            resp = await s.post(gw.url + "/v1/chat/completions", json=body(stream_options={"include_usage": True}),
                                headers={"x-sim-fault": "stall_at_end=10"})
            assert resp.status == 200
            while (line := await resp.content.readline()) != b"data: [DONE]\n":
                assert line
            resp.close()                        # gone with the whole answer, the engine's end not awaited
    assert await wait_for(lambda: gw.gw.lifecycle.in_flight == 0, timeout=8)
    m = await gw.metrics_text()
    assert metric(m, "switchyard_requests_total", model="m", status="200", strategy="least-request") == n
    assert metric(m, "switchyard_requests_total", model="m", status="499", strategy="least-request") == 0
    assert metric(m, "switchyard_client_cancels_total", model="m", stage="streaming") == 0
    assert metric(m, "switchyard_completion_tokens_total", model="m") == 6 * n
    assert metric(m, "switchyard_time_to_first_token_seconds_count", model="m") == n


@pytest.mark.parametrize("fault", ENDS)
async def test_a_responses_stream_keeps_its_completed_event(sims, gateway, fault):
    sim = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url])], watchdog=WATCHDOG)
    c = openai_client(gw)
    stream = await c.responses.create(model="m", input="Hi", max_output_tokens=6, stream=True,
                                      extra_headers={"x-sim-fault": fault})
    events = [ev async for ev in stream]
    assert events[-1].type == "response.completed" and not [e for e in events if e.type in ("error", "response.failed")]
    seq = [e.sequence_number for e in events]
    assert seq == list(range(len(seq)))
    done = await c.responses.retrieve(events[-1].response.id)     # kept as the gateway saw it complete
    assert done.status == "incomplete" and done.output_text == events[-1].response.output_text
    await c.close()
    m = await gw.metrics_text()
    assert metric(m, "switchyard_path_requests_total", path="/v1/responses", status="200") == 1
    assert metric(m, "switchyard_completion_tokens_total", model="m") == 6


@pytest.mark.parametrize("fault", ENDS)
async def test_a_messages_stream_ends_at_its_message_stop(sims, gateway, fault):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], watchdog=WATCHDOG)
    c = anthropic_client(gw)
    async with c.messages.stream(model="m", max_tokens=6, messages=CHAT,
                                 extra_headers={"x-sim-fault": fault}) as stream:
        text = [t async for t in stream.text_stream]
        final = await stream.get_final_message()
    await c.close()
    assert "".join(text) == final.content[0].text and final.usage.output_tokens == 6
    st, _, raw = await post(gw.url, {"model": "m", "max_tokens": 6, "messages": CHAT, "stream": True},
                            {"x-sim-fault": fault}, path="/v1/messages")
    frames = sse_frames(raw)
    assert st == 200 and frames[-1][0] == "message_stop" and not [f for f in frames if f[0] == "error"]
    m = await gw.metrics_text()
    assert metric(m, "switchyard_path_requests_total", path="/v1/messages", status="200") == 2


@pytest.mark.parametrize("fault", ENDS)
async def test_a_continuable_stream_is_not_continued_after_its_end(sims, gateway, fault):
    """With ``migration_limit``: a leg that fails after its ``[DONE]`` is not continued elsewhere,
    and the client's usage block is the answer's, counted once."""
    a, b = await sims("vllm", "m"), await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [a.url, b.url], strategy="round-robin", migration_limit=1)],
                       watchdog=WATCHDOG)
    st, _, raw = await post(gw.url, body(stream_options={"include_usage": True}), {"x-sim-fault": fault})
    events = sse_events(raw)
    assert st == 200 and events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)
    assert events[-2]["usage"]["completion_tokens"] == 6
    m = await gw.metrics_text()
    assert metric(m, "switchyard_migrations_total") == 0 and metric(m, "switchyard_upstream_errors_total") == 0
    assert metric(m, "switchyard_completion_tokens_total", model="m") == 6
    assert metric(m, "switchyard_prompt_tokens_total", model="m") == events[-2]["usage"]["prompt_tokens"]


@pytest.mark.parametrize("migration_limit", [0, 1])
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_an_engine_that_stalls_after_its_last_event_does_not_hold_the_client(sims, gateway, engine,
                                                                                   migration_limit):
    """With no watchdog (aggregated legs are not watched by default), an engine that sent
    ``[DONE]`` and then stalled before ending its body held a client that reads the body to its
    end (curl, a proxy, an HTTP library without SSE parsing) for as long as the engine stalled. The
    engine's end is now awaited ``END_GRACE_S`` at most: the client gets its whole answer and its
    end. A continuable stream (``migration_limit``) too, whose legs the migration relays."""
    import asyncio

    sim = await sims(engine, "m")
    gw = await gateway([model_block("m", engine, [sim.url], migration_limit=migration_limit)])
    with gw.gw.request_log.capture() as logs:
        async with asyncio.timeout(20):         # the engine stalls 60 s
            st, _, raw = await post(gw.url, body(), {"x-sim-fault": "stall_at_end=60"})
        assert await wait_for(lambda: any(e["event"] == "request" for e in logs), timeout=5)
    events = sse_events(raw)
    assert st == 200 and events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)
    line = next(e for e in logs if e["event"] == "request")
    assert line["status"] == 200 and line["after_end"] == "idle" and line["error_class"] is None
    m = await gw.metrics_text()
    assert metric(m, "switchyard_upstream_errors_total") == 0


async def _errs_then_breaks(request: web.Request) -> web.StreamResponse:
    """A chat stream that sends a token, then its engine's own error event, then breaks its connection."""
    await request.read()
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "finish_reason": None}]}
    await out.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
    await out.write(b'data: {"error": {"message": "the engine failed", "type": "InternalServerError", "code": 500}}\n\n')
    await asyncio.sleep(0.05)
    assert request.transport is not None
    request.transport.abort()
    return out


async def test_an_engine_that_breaks_after_its_own_error_event_gets_no_second_error(gateway):
    """A chat stream its engine ended with its own error event and then broke, rather than closing:
    that error is the stream's last event, not followed by the gateway's upstream_incomplete."""
    async with fake_engine(_errs_then_breaks) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        st, _, raw = await post(gw.url, body())
        assert st == 200
        errors = [e["error"] for e in sse_events(raw) if isinstance(e, dict) and "error" in e]
        assert [e["message"] for e in errors] == ["the engine failed"], errors


async def _errs_then_stalls(request: web.Request) -> web.StreamResponse:
    """A chat stream that sends a token, then its engine's own error event, then neither ends its
    body nor sends anything more, until the gateway lets the connection go."""
    await request.read()
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "finish_reason": None}]}
    await out.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
    await out.write(b'data: {"error": {"message": "the engine failed", "type": "InternalServerError", "code": 500}}\n\n')
    for _ in range(600):            # at most 30 s: until the gateway closes the connection
        if request.transport is None or request.transport.is_closing():
            break
        await asyncio.sleep(0.05)
    return out


async def test_an_engine_that_stalls_after_its_own_error_event_does_not_hold_the_client(gateway):
    """With no watchdog (aggregated legs are not watched by default), an engine that ended a chat
    stream with its own error event and then stalled, its body not ended, held a client that reads
    the body to its end for as long as the engine stalled. Its end is awaited ``END_GRACE_S`` at
    most, as after ``[DONE]``: the client gets the engine's error as the stream's last event, and
    the stream's end."""
    async with fake_engine(_errs_then_stalls) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        with gw.gw.request_log.capture() as logs:
            async with asyncio.timeout(10):
                st, _, raw = await post(gw.url, body())
            assert await wait_for(lambda: any(e["event"] == "request" for e in logs), timeout=5)
        assert st == 200
        errors = [e["error"] for e in sse_events(raw) if isinstance(e, dict) and "error" in e]
        assert [e["message"] for e in errors] == ["the engine failed"], errors
        line = next(e for e in logs if e["event"] == "request")
        assert line["after_end"] == "idle"


async def _done_then_chatters(request: web.Request) -> web.StreamResponse:
    """A chat stream that ends with [DONE], then, its body not ended, goes on sending events (a
    chunk, a keep-alive comment) every 50 ms, until the gateway lets the connection go."""
    await request.read()
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}]}
    await out.write(b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n")
    for _ in range(600):            # at most 30 s: until the gateway closes the connection
        if request.transport is None or request.transport.is_closing():
            break
        await out.write(b"data: " + orjson.dumps(chunk) + b"\n\n: keep-alive\n\n")
        await asyncio.sleep(0.05)
    return out


async def test_an_engine_that_goes_on_sending_after_its_last_event_does_not_hold_the_client(gateway):
    """An engine that keeps writing events after its ``[DONE]`` holds the client no longer: the
    stream ends at [DONE], none of what follows is relayed, and the engine's connection is closed
    (``after_end: trailing``)."""
    async with fake_engine(_done_then_chatters) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        with gw.gw.request_log.capture() as logs:
            async with asyncio.timeout(10):
                st, _, raw = await post(gw.url, body())
            assert await wait_for(lambda: any(e["event"] == "request" for e in logs), timeout=5)
        assert st == 200 and raw.endswith(b"data: [DONE]\n\n") and raw.count(b"data: ") == 2, raw
        line = next(e for e in logs if e["event"] == "request")
        assert line["status"] == 200 and line["after_end"] == "trailing" and line["error_class"] is None
