"""The Anthropic Messages API through the gateway, driven by the real ``anthropic`` SDK."""

from __future__ import annotations

import aiohttp
import aiohttp.web
import anthropic
import orjson
import pytest

from gateway.apis.anthropic import error_type as anthropic_error_type
from tests.support.edge import assert_openai_error, exchange, request
from tests.support.factories import model_block
from tests.support.fake_engine import cutting_stream, fake_engine
from tests.support.http import anthropic_client, sim_state, sse_frames
from tests.support.metrics import metric
from tests.support.waiting import wait_for

MSGS = [{"role": "user", "content": "Tell me about switchyards and trains."}]
SYSTEM = "You are a railway historian. " * 20
ALICE = "sk-alice-0123456789"
KEYS = {"api_keys": [{"key": ALICE, "user": "alice"}]}


@pytest.fixture
async def fleet(sims, gateway):
    v1 = await sims("vllm", "llama")
    v2 = await sims("vllm", "llama")
    s1 = await sims("sglang", "qwen")
    gw = await gateway([model_block("llama", "vllm", [v1.url, v2.url]),
                        model_block("qwen", "sglang", [s1.url])])
    return gw, (v1, v2, s1)


async def test_sdk_create_stream_and_count_tokens(fleet):
    gw, _ = fleet
    c = anthropic_client(gw)
    msg = await c.messages.create(model="llama", max_tokens=8, system="Be brief.", messages=MSGS)
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].text
    assert msg.usage.output_tokens == 8 and msg.usage.input_tokens > 0 and msg.stop_reason == "max_tokens"

    async with c.messages.stream(model="llama", max_tokens=6, messages=MSGS) as stream:
        text = [t async for t in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(text) == final.content[0].text and len(text) == 6
    assert final.usage.output_tokens == 6 and final.usage.input_tokens > 0 and final.stop_reason == "max_tokens"

    counted = await c.messages.count_tokens(model="llama", messages=MSGS)
    assert counted.input_tokens == final.usage.input_tokens
    await c.close()

    text = await gw.metrics_text()
    # accounted like chat: input from message_start, output from message_delta, TTFT at the first delta
    assert 'switchyard_completion_tokens_total{model="llama"} 14.0' in text
    assert f'switchyard_prompt_tokens_total{{model="llama"}} {float(msg.usage.input_tokens + final.usage.input_tokens)}' in text
    assert 'switchyard_time_to_first_token_seconds_count{model="llama"} 1.0' in text
    assert 'switchyard_inter_token_latency_seconds_count{model="llama"} 5.0' in text
    assert 'switchyard_path_requests_total{path="/v1/messages",status="200"} 2.0' in text
    assert 'switchyard_path_requests_total{path="/v1/messages/count_tokens",status="200"} 1.0' in text



async def test_a_stop_sequence_that_ended_the_answer_is_named(fleet):
    gw, _ = fleet
    c = anthropic_client(gw)
    full = await c.messages.create(model="llama", max_tokens=8, messages=MSGS)
    text = full.content[0].text
    stop = " " + text.split(" ")[3]                 # the text starts with a space
    msg = await c.messages.create(model="llama", max_tokens=8, messages=MSGS, stop_sequences=[stop, "never"])
    assert msg.content[0].text == text[:text.index(stop)]
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    async with c.messages.stream(model="llama", max_tokens=8, messages=MSGS, stop_sequences=[stop]) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert final.content[0].text == text[:text.index(stop)]
    # a stop sequence that never came: the budget ended it, and no sequence is named
    async with c.messages.stream(model="llama", max_tokens=8, messages=MSGS, stop_sequences=["never"]) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "max_tokens" and final.stop_sequence is None
    text = await gw.metrics_text()
    assert 'switchyard_path_requests_total{path="/v1/messages",status="200"} 4.0' in text


async def test_an_sglang_model_serves_messages_in_sglang_s_dialect(fleet):
    """SGLang serves the Messages API too (its Anthropic handler): the SDK works against it, and
    the gateway counts SGLang's usage right. Its ``input_tokens`` is the whole prompt and
    ``cache_read_input_tokens`` a part of it (Anthropic's leaves the cache reads out), so the
    prompt tokens counted are ``input_tokens``, not their sum."""
    gw, (_, _, s1) = fleet
    c = anthropic_client(gw)
    msg = await c.messages.create(model="qwen", max_tokens=5, system=SYSTEM, messages=MSGS)
    assert msg.id.startswith("msg_") and msg.content[0].text and msg.stop_reason == "max_tokens"
    assert msg.usage.output_tokens == 5 and msg.usage.input_tokens > 0
    async with c.messages.stream(model="qwen", max_tokens=4, system=SYSTEM, messages=MSGS) as stream:
        text = [t async for t in stream.text_stream]
        final = await stream.get_final_message()
    assert len(text) == 4 and "".join(text) == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 4
    # the second time the prompt was in the engine's cache, and SGLang says so
    assert final.usage.input_tokens == msg.usage.input_tokens and final.usage.cache_read_input_tokens > 0
    counted = await c.messages.count_tokens(model="qwen", system=SYSTEM, messages=MSGS)
    assert counted.input_tokens == msg.usage.input_tokens
    await c.close()
    sent = [r["path"] for r in (await sim_state(s1.url))["received"]]
    assert sent.count("/v1/messages") == 2 and sent.count("/v1/messages/count_tokens") == 1
    text = await gw.metrics_text()
    assert f'switchyard_prompt_tokens_total{{model="qwen"}} {float(2 * msg.usage.input_tokens)}' in text
    assert 'switchyard_completion_tokens_total{model="qwen"} 9.0' in text
    assert f'switchyard_cached_prompt_tokens_total{{model="qwen"}} {float(final.usage.cache_read_input_tokens)}' in text
    assert 'switchyard_time_to_first_token_seconds_count{model="qwen"} 1.0' in text
    assert 'switchyard_path_requests_total{path="/v1/messages",status="200"} 2.0' in text


async def test_an_sglang_messages_failure_reaches_the_sdk_as_its_error(fleet):
    """SGLang answers a failed non-streaming request 500 ``internal_error`` (not a type of
    Anthropic's: re-typed ``api_error``), and a stream's failure as an ``api_error`` event."""
    gw, _ = fleet
    c = anthropic_client(gw)
    with pytest.raises(anthropic.InternalServerError) as ei:
        await c.messages.create(model="qwen", max_tokens=20000, messages=MSGS)
    assert ei.value.status_code == 500 and ei.value.body["error"]["type"] == "api_error"
    with pytest.raises(anthropic.APIStatusError) as ei:
        async with c.messages.stream(model="qwen", max_tokens=20000, messages=MSGS) as stream:
            await stream.get_final_message()
    assert ei.value.body["error"] == {"type": "api_error", "message": "Stream processing error"}
    await c.close()
    with pytest.raises(anthropic.NotFoundError) as ei:
        await anthropic_client(gw).messages.create(model="nope", max_tokens=8, messages=MSGS)
    assert ei.value.body["error"]["type"] == "not_found_error"


async def test_an_engine_without_the_messages_api_is_an_anthropic_404(sims, gateway):
    """An SGLang release older than its Anthropic handler answers FastAPI's 404; the SDK gets it
    in Anthropic's shape."""
    async def old(request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"detail": "Not Found"}, status=404)

    async with fake_engine(old, paths=("/v1/messages",)) as url:
        gw = await gateway([model_block("old", "sglang", [url])])
        c = anthropic_client(gw)
        with pytest.raises(anthropic.NotFoundError) as ei:
            await c.messages.create(model="old", max_tokens=8, messages=MSGS)
        assert ei.value.body == {"type": "error", "error": {"type": "not_found_error", "message": "Not Found"}}
        await c.close()


async def test_a_mixed_model_sends_messages_to_both_engines(sims, gateway):
    v = await sims("vllm", "mix")
    s = await sims("sglang", "mix")
    gw = await gateway([model_block("mix", "vllm", [v.url, {"url": s.url, "engine": "sglang"}])])
    c = anthropic_client(gw)
    served = set()
    for _ in range(2):       # in turn, so each engine has one (at random, all six went to one in 32 runs)
        r = await c.messages.with_raw_response.create(model="mix", max_tokens=2, messages=MSGS,
                                                      extra_headers={"routing-strategy": "round-robin"})
        served.add(r.headers["target-pod"])
        assert (await r.parse()).usage.output_tokens == 2
    await c.close()
    assert served == {v.url.removeprefix("http://"), s.url.removeprefix("http://")}


async def test_errors_before_headers_are_anthropic_shaped(fleet):
    gw, _ = fleet
    c = anthropic_client(gw)
    with pytest.raises(anthropic.BadRequestError) as ei:
        await c.messages.create(model="llama", max_tokens=0, messages=MSGS)
    assert ei.value.body["type"] == "error" and ei.value.body["error"]["type"] == "invalid_request_error"
    await c.close()
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/v1/messages") as r:     # aiohttp's own 405, shaped too
            assert r.status == 405 and (await r.json())["type"] == "error"
        async with s.post(gw.url + "/v1/messages", data=b"{not json", headers={"content-type": "application/json"}) as r:
            body = await r.json()
            assert r.status == 400 and body["error"]["type"] == "invalid_request_error" and r.headers["request-id"]


async def test_an_engines_busy_answer_is_anthropics_529_overloaded_error(fleet):
    """An engine's 503 (SGLang's full queue, a vLLM not ready) is overload, which Anthropic answers
    with 529 ``overloaded_error`` (the SDK's ``OverloadedError``), its message and Retry-After kept,
    logged and counted as 529 while the engine's own status labels its upstream error; an engine's
    429 stays a 429 ``rate_limit_error``, and its other errors keep their status and message."""
    gw, _ = fleet
    c = anthropic_client(gw)
    for model in ("llama", "qwen"):
        for stream in (False, True):
            with pytest.raises(anthropic.OverloadedError) as ei:
                await c.messages.create(model=model, max_tokens=4, messages=MSGS, stream=stream,
                                        extra_headers={"x-sim-fault": "status=503"})
            assert ei.value.status_code == 529
            assert ei.value.body["error"] == {"type": "overloaded_error", "message": "Simulated fault: HTTP 503"}
            assert ei.value.response.headers["Retry-After"] == "5"
    with pytest.raises(anthropic.RateLimitError) as ei:
        await c.messages.create(model="llama", max_tokens=4, messages=MSGS, extra_headers={"x-sim-fault": "status=429"})
    assert ei.value.body["error"]["type"] == "rate_limit_error" and ei.value.response.headers["Retry-After"] == "1"
    with pytest.raises(anthropic.InternalServerError) as ei:
        await c.messages.create(model="llama", max_tokens=4, messages=MSGS, extra_headers={"x-sim-fault": "status=500"})
    assert ei.value.status_code == 500 and ei.value.body["error"]["type"] == "api_error"
    chat = {"model": "llama", "max_tokens": 4, "messages": MSGS}
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/chat/completions", json=chat,
                                                    headers={"x-sim-fault": "status=503"}) as r:
        assert r.status == 503 and r.headers["Retry-After"] == "5"
    text = await gw.metrics_text()
    assert metric(text, "switchyard_path_requests_total", path="/v1/messages", status="529") == 4
    assert not metric(text, "switchyard_path_requests_total", path="/v1/messages", status="503")
    assert metric(text, "switchyard_upstream_errors_total", model="llama", error_class="status_503") >= 2
    assert not metric(text, "switchyard_upstream_errors_total", error_class="status_529")


async def test_an_engines_529_without_retry_after_gets_the_gateways_wait(fleet):
    """An engine (or an Anthropic-compatible server) answering 529, overload, with no Retry-After
    gets the one its 503 gets, as every overload answer of the gateway names a wait: 5 seconds, so
    an SDK's retry waits as long as after the gateway's own 529, not its shortest backoff."""
    gw, _ = fleet
    c = anthropic_client(gw)
    for model in ("llama", "qwen"):
        for stream in (False, True):
            with pytest.raises(anthropic.OverloadedError) as ei:
                await c.messages.create(model=model, max_tokens=4, messages=MSGS, stream=stream,
                                        extra_headers={"x-sim-fault": "status=529"})
            assert ei.value.status_code == 529 and ei.value.body["error"]["type"] == "overloaded_error"
            assert ei.value.response.headers.get("Retry-After") == "5"
    chat = {"model": "llama", "max_tokens": 4, "messages": MSGS}
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/chat/completions", json=chat,
                                                    headers={"x-sim-fault": "status=529"}) as r:
        assert r.status == 529 and r.headers.get("Retry-After") == "5"


async def test_the_gateways_own_sheds_are_anthropics_529_overloaded_error(fleet):
    """Anthropic answers overload with 529 ``overloaded_error`` (the SDK's ``OverloadedError``, which
    it retries): a model with no ready endpoint (every breaker open) and a gateway draining are
    that on /v1/messages, their Retry-After kept; the OpenAI paths keep their 503. A 503 the
    gateway answers for another reason (its shared state unavailable) is ``api_error``."""
    gw, _ = fleet
    c = anthropic_client(gw)
    eps = gw.gw.pool.endpoints("llama")
    chat = {"model": "llama", "max_tokens": 4, "messages": MSGS}
    for ep in eps:
        ep.ejected = True
    try:
        for stream in (False, True):
            with pytest.raises(anthropic.OverloadedError) as ei:
                await c.messages.create(model="llama", max_tokens=4, messages=MSGS, stream=stream)
            assert ei.value.status_code == 529 and ei.value.body["error"]["type"] == "overloaded_error"
            assert ei.value.body["error"]["message"].startswith("no ready endpoint for model llama")
            assert ei.value.response.headers["Retry-After"] == "5"
            assert ei.value.response.reason_phrase == "Overloaded"     # not an empty status line's
        async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/chat/completions", json=chat) as r:
            assert r.status == 503 and (await r.json())["error"]["type"] == "overloaded_error"
    finally:
        for ep in eps:
            ep.ejected = False
    gw.gw.lifecycle.draining = True
    try:
        with pytest.raises(anthropic.OverloadedError) as ei:
            await c.messages.create(model="llama", max_tokens=4, messages=MSGS)
        assert ei.value.body["error"] == {"type": "overloaded_error", "message": "the gateway is shutting down"}
        assert ei.value.response.headers["Retry-After"] == "1"
        async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/chat/completions", json=chat) as r:
            assert r.status == 503
    finally:
        gw.gw.lifecycle.draining = False
    text = await gw.metrics_text()
    assert metric(text, "switchyard_path_requests_total", path="/v1/messages", status="529") == 3
    assert metric(text, "switchyard_path_requests_total", path="/v1/chat/completions", status="503") == 2


async def test_stop_sequences_that_are_not_a_list_of_strings_are_refused_before_routing(fleet):
    """Anthropic's ``stop_sequences`` is a list of strings, and Anthropic and vLLM refuse a string
    with a 400; on either engine the gateway refuses it as Anthropic does, before routing, so the
    answer does not depend on which engine serves the model."""
    gw, (v1, v2, s1) = fleet
    c = anthropic_client(gw)
    for model in ("llama", "qwen"):
        for stop, message in (("never", "stop_sequences: Input should be a valid list"),
                              (["never", 3], "stop_sequences.1: Input should be a valid string")):
            with pytest.raises(anthropic.BadRequestError) as ei:
                await c.messages.create(model=model, max_tokens=4, messages=MSGS, stop_sequences=stop)
            assert ei.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    for sim in (v1, v2, s1):
        assert not [r for r in (await sim_state(sim.url))["received"] if r["path"] == "/v1/messages"]
    msg = await c.messages.create(model="llama", max_tokens=4, messages=MSGS, stop_sequences=[])
    assert msg.stop_reason == "max_tokens"


async def test_a_tool_choice_of_a_tool_without_its_name_is_refused_before_routing(fleet):
    """Anthropic's ``tool_choice`` of type ``tool`` names the tool, and Anthropic refuses one
    without a name with a 400. vLLM's Messages request takes it (its name is optional there) and
    its conversion to a chat request then fails: its 500, a fault charged to the endpoint's breaker
    and retried on another, for a request's own mistake. The gateway refuses it first, on either
    engine and on count_tokens too; the other tool choices go on."""
    gw, (v1, v2, s1) = fleet
    c = anthropic_client(gw)
    tools = [{"name": "get_time", "input_schema": {"type": "object"}}]
    for model in ("llama", "qwen"):
        for choice, message in (({"type": "tool"}, "tool_choice.name: Field required"),
                                ({"type": "tool", "name": 3}, "tool_choice.name: Input should be a valid string")):
            with pytest.raises(anthropic.BadRequestError) as ei:
                await c.messages.create(model=model, max_tokens=4, messages=MSGS, tools=tools, tool_choice=choice)
            assert ei.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
            with pytest.raises(anthropic.BadRequestError) as ei:
                await c.messages.count_tokens(model=model, messages=MSGS, tools=tools, tool_choice=choice)
            assert ei.value.body["error"]["message"] == message
    for sim in (v1, v2, s1):
        assert not [r for r in (await sim_state(sim.url))["received"] if r["path"].startswith("/v1/messages")]
    for choice in ({"type": "tool", "name": "get_time"}, {"type": "any"}, {"type": "none"}, {"type": "auto"}):
        msg = await c.messages.create(model="llama", max_tokens=4, messages=MSGS, tools=tools, tool_choice=choice)
        assert msg.stop_reason in ("max_tokens", "tool_use")


async def test_a_tool_choice_naming_a_tool_not_offered_is_refused_before_routing(fleet):
    """A ``tool_choice`` of type ``tool`` naming no tool of ``tools`` (or with no tools at all) is
    Anthropic's 400; it went to the engine, which generated as if no tool were forced (enginesim),
    or failed on its own terms. Refused first on either engine and on count_tokens too."""
    gw, (v1, v2, s1) = fleet
    c = anthropic_client(gw)
    tools = [{"name": "get_time", "input_schema": {"type": "object"}}]
    choice = {"type": "tool", "name": "get_weather"}
    message = "tool_choice.name: no tool named 'get_weather' in tools"
    for model in ("llama", "qwen"):
        for offered in (tools, None):
            extra = {"tools": offered} if offered is not None else {}
            with pytest.raises(anthropic.BadRequestError) as ei:
                await c.messages.create(model=model, max_tokens=4, messages=MSGS, tool_choice=choice, **extra)
            assert ei.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
            with pytest.raises(anthropic.BadRequestError) as ei:
                await c.messages.count_tokens(model=model, messages=MSGS, tool_choice=choice, **extra)
            assert ei.value.body["error"]["message"] == message
    for sim in (v1, v2, s1):
        assert not [r for r in (await sim_state(sim.url))["received"] if r["path"].startswith("/v1/messages")]
    msg = await c.messages.create(model="llama", max_tokens=4, messages=MSGS, tools=tools,
                                  tool_choice={"type": "tool", "name": "get_time"})
    assert msg.stop_reason in ("max_tokens", "tool_use")


async def test_a_boolean_for_a_number_is_refused_before_routing(fleet):
    """Anthropic refuses a boolean where its API takes an integer (``max_tokens``, ``top_k``,
    ``thinking.budget_tokens``) or a number (``temperature``, ``top_p``) with a 400; the engine's
    lax reading takes ``true`` as 1, so the gateway refuses it first, on either engine."""
    gw, (v1, v2, s1) = fleet
    c = anthropic_client(gw)
    thinking = {"type": "enabled", "budget_tokens": True}
    for model in ("llama", "qwen"):
        for kw, message in (({"max_tokens": True}, "max_tokens: Input should be a valid integer"),
                            ({"max_tokens": 4, "extra_body": {"top_k": False}}, "top_k: Input should be a valid integer"),
                            ({"max_tokens": 2048, "thinking": thinking},
                             "thinking.budget_tokens: Input should be a valid integer"),
                            ({"max_tokens": 4, "extra_body": {"temperature": True}},
                             "temperature: Input should be a valid number"),
                            ({"max_tokens": 4, "extra_body": {"top_p": True}}, "top_p: Input should be a valid number")):
            with pytest.raises(anthropic.BadRequestError) as ei:
                await c.messages.create(model=model, messages=MSGS, **kw)
            assert ei.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    for sim in (v1, v2, s1):
        assert not [r for r in (await sim_state(sim.url))["received"] if r["path"] == "/v1/messages"]
    msg = await c.messages.create(model="llama", max_tokens=4, messages=MSGS,
                                  extra_body={"top_k": 5, "temperature": 1, "top_p": 0.9})
    assert msg.stop_reason == "max_tokens"


async def test_a_system_role_in_messages_is_refused_before_routing(fleet):
    """Anthropic's messages are the user's and the assistant's; the system prompt is the top-level
    ``system``. A message of role ``system`` (or any other) is Anthropic's 400, on both paths and
    either engine, not a request one engine takes and the other refuses."""
    gw, (v1, v2, s1) = fleet
    c = anthropic_client(gw)
    for model in ("llama", "qwen"):
        for role in ("system", "tool"):
            messages = [{"role": role, "content": "Be brief."}, *MSGS]
            for call in (c.messages.create, c.messages.count_tokens):
                kw = {"max_tokens": 4} if call == c.messages.create else {}
                with pytest.raises(anthropic.BadRequestError) as ei:
                    await call(model=model, messages=messages, **kw)
                assert ei.value.body == {"type": "error", "error": {
                    "type": "invalid_request_error", "message": "messages.0.role: Input should be 'user' or 'assistant'"}}
    for sim in (v1, v2, s1):
        assert not [r for r in (await sim_state(sim.url))["received"] if r["path"].startswith("/v1/messages")]
    # Claude Code's ctx and msg roles go on: vLLM reads them as user
    msg = await c.messages.create(model="llama", max_tokens=4, messages=[{"role": "ctx", "content": "Be brief."}, *MSGS])
    assert msg.stop_reason == "max_tokens"


async def test_a_system_block_that_is_not_text_is_refused_before_routing(fleet):
    """Anthropic's ``system`` is a string or a list of text blocks; an image or a document there is
    a 400 naming the block, as Anthropic answers, not a prompt the engine renders without it."""
    gw, (v1, v2, _) = fleet
    c = anthropic_client(gw)
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    for system in ([image], [{"type": "text", "text": "Be brief."}, {"type": "document", "source": {
            "type": "text", "media_type": "text/plain", "data": "a rule book"}}]):
        for call in (c.messages.create, c.messages.count_tokens):
            kw = {"max_tokens": 4} if call == c.messages.create else {}
            with pytest.raises(anthropic.BadRequestError) as ei:
                await call(model="llama", system=system, messages=MSGS, **kw)
            assert ei.value.body == {"type": "error", "error": {
                "type": "invalid_request_error", "message": f"system.{len(system) - 1}.type: Input should be 'text'"}}
    # text blocks, with cache_control as Claude Code sends them, are served
    msg = await c.messages.create(model="llama", max_tokens=4, messages=MSGS, system=[
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}])
    assert msg.stop_reason == "max_tokens"
    sent = [r for sim in (v1, v2) for r in (await sim_state(sim.url))["received"] if r["path"].startswith("/v1/messages")]
    assert len(sent) == 1


PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="


@pytest.mark.parametrize("model", ["llama", "qwen"])
async def test_content_the_engine_cannot_take_is_an_anthropic_400_and_images_are_served(fleet, model):
    """Both engines' Messages requests take text, image, tool_use, tool_result and thinking blocks
    (vLLM's also tool_reference) and a tool_choice of auto, any, tool or none: a document block, a
    block of a type neither knows, or another tool_choice is their validation 400, which reaches
    the SDK as Anthropic's ``invalid_request_error``; an image, base64 or by URL, is served."""
    gw, _ = fleet
    c = anthropic_client(gw)
    for source in ({"type": "base64", "media_type": "image/png", "data": PNG},
                   {"type": "url", "url": "https://example.com/a.png"}):
        msg = await c.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": source}, {"type": "text", "text": "What is in it?"}]}])
        assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 4
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0xLjQK"}}
    tools = [{"name": "get_time", "input_schema": {"type": "object"}}]
    for kw in ({"messages": [{"role": "user", "content": [pdf, {"type": "text", "text": "Summarise it."}]}]},
               {"messages": [{"role": "user", "content": [{"type": "no_such_block", "text": "x"}]}]},
               {"messages": MSGS, "tools": tools, "tool_choice": {"type": "required"}}):
        for stream in (False, True):
            with pytest.raises(anthropic.BadRequestError) as ei:
                if stream:
                    async with c.messages.stream(model=model, max_tokens=4, **kw) as events:
                        async for _ in events:
                            pass
                else:
                    await c.messages.create(model=model, max_tokens=4, **kw)
            assert ei.value.status_code == 400
            assert ei.value.body["type"] == "error" and ei.value.body["error"]["type"] == "invalid_request_error"
            assert "type" in ei.value.body["error"]["message"]


async def test_a_body_over_the_limit_is_an_anthropic_413(sims, gateway):
    """A Content-Length over server.max_body_bytes is refused by the edge before the body is read;
    that answer was OpenAI-shaped on /v1/messages, where a chunked body's 413 was Anthropic's."""
    v = await sims("vllm", "llama")
    gw = await gateway([model_block("llama", "vllm", [v.url])], server={"max_body_bytes": 2000})
    c = anthropic_client(gw)
    with pytest.raises(anthropic.APIStatusError) as ei:
        await c.messages.create(model="llama", max_tokens=4, messages=[{"role": "user", "content": "x" * 5000}])
    await c.close()
    assert ei.value.status_code == 413
    assert ei.value.body["type"] == "error" and ei.value.body["error"]["type"] == "request_too_large"
    assert ei.value.response.headers["request-id"]


async def test_a_failure_after_headers_is_an_error_event(sims, gateway):
    v = await sims("vllm", "llama")
    gw = await gateway([model_block("llama", "vllm", [v.url])], watchdog={"idle_timeout_s": 0.3, "aggregated": True})
    body = {"model": "llama", "max_tokens": 20, "stream": True, "messages": MSGS}
    async with aiohttp.ClientSession() as s:
        # the engine fails mid-stream: its own error event reaches the client
        async with s.post(gw.url + "/v1/messages", json=body, headers={"x-sim-fault": "error_after=3"}) as r:
            got = sse_frames(await r.read())
        assert got[0][0] == "message_start" and got[-1][0] == "error"
        assert got[-1][1]["type"] == "error"
        # the engine stalls: the watchdog ends the stream with an Anthropic error event
        async with s.post(gw.url + "/v1/messages", json=body, headers={"x-sim-fault": "stall_after=2:inf"}) as r:
            assert r.status == 200
            got = sse_frames(await r.read())
        assert [n for n, _ in got[:2]] == ["message_start", "content_block_start"]
        assert got[-1] == ("error", {"type": "error", "error": {
            "type": "timeout_error", "message": "no output from the engine for 0.3s (idle)"}})
    # the SDK raises it as an API error
    c = anthropic_client(gw)
    with pytest.raises(anthropic.APIStatusError):
        async with c.messages.stream(model="llama", max_tokens=20, messages=MSGS,
                                     extra_headers={"x-sim-fault": "stall_after=2:inf"}) as stream:
            async for _ in stream.text_stream:
                pass
    await c.close()


async def test_prefix_routing_keys_on_system_and_messages(sims, gateway):
    eps = [await sims("vllm", "llama") for _ in range(3)]
    gw = await gateway([model_block("llama", "vllm", [e.url for e in eps], strategy="prefix-cache")])
    c = anthropic_client(gw)
    pods = set()
    for i in range(5):
        r = await c.messages.with_raw_response.create(
            model="llama", max_tokens=2, system=SYSTEM, messages=[{"role": "user", "content": f"question {i}"}])
        pods.add(r.headers["target-pod"])
    await c.close()
    assert len(pods) == 1          # one long shared system prompt: one engine holds its cache


async def test_api_keys_from_x_api_key_and_bearer(sims, gateway):
    v = await sims("vllm", "llama")
    gw = await gateway([model_block("llama", "vllm", [v.url])], auth=KEYS)
    c = anthropic_client(gw, ALICE)                                   # the SDK sends x-api-key
    assert (await c.messages.create(model="llama", max_tokens=3, messages=MSGS)).usage.output_tokens == 3
    await c.close()
    bad = anthropic_client(gw, "sk-wrong")
    with pytest.raises(anthropic.AuthenticationError) as ei:
        await bad.messages.create(model="llama", max_tokens=3, messages=MSGS)
    assert ei.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                        "message": "Incorrect API key provided."}}
    await bad.close()
    bearer = anthropic.AsyncAnthropic(base_url=gw.url, auth_token=ALICE, max_retries=0)
    assert (await bearer.messages.create(model="llama", max_tokens=2, messages=MSGS)).usage.output_tokens == 2
    await bearer.close()
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/messages", json={"model": "llama"}) as r:
        assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
    # the tokens are charged to the key's user
    assert 'switchyard_user_tokens_total{kind="completion",user="alice"} 5.0' in await gw.metrics_text()


async def test_an_alias_names_a_messages_model(sims, gateway):
    v = await sims("vllm", "llama-v2")
    gw = await gateway([model_block("llama-v2", "vllm", [v.url])],
                       aliases=[{"name": "claude-ish", "targets": [{"model": "llama-v2"}]}])
    c = anthropic_client(gw)
    raw = await c.messages.with_raw_response.create(model="claude-ish", max_tokens=2, messages=MSGS)
    assert raw.headers["x-served-model"] == "llama-v2" and (await raw.parse()).model == "llama-v2"
    await c.close()


async def test_errors_the_edge_writes_itself_are_anthropic_shaped_on_messages_paths(sims, gateway):
    """An unknown ``Expect``, a body that stalls: answered before the pipeline, these were
    OpenAI-shaped on /v1/messages too."""
    v = await sims("vllm", "llama")
    gw = await gateway([model_block("llama", "vllm", [v.url])],
                       server={"body_timeout_s": 0.3})
    body = orjson.dumps({"model": "llama", "max_tokens": 3, "messages": MSGS})
    cases = {
        417: [request("POST", "/v1/messages", body, {"Expect": "teapot"})],
        408: [request("POST", "/v1/messages", None, {"Content-Type": "application/json",
                                                     "Content-Length": str(len(body) + 50)}) + body],
    }
    for status, parts in cases.items():
        got = await exchange(gw.port, *parts, wait=10)
        resp = got.first
        assert resp.status == status, (status, resp.body)
        assert resp.json() == {"type": "error", "error": {"type": anthropic_error_type(status),
                                                          "message": resp.json()["error"]["message"]}}, resp.body
        assert resp.headers["request-id"]
    # other paths keep OpenAI's shape
    got = await exchange(gw.port, request("POST", "/v1/chat/completions", body, {"Expect": "teapot"}))
    assert_openai_error(got.first, 417)


def _anthropic_error(resp, status: int) -> dict:
    assert resp.status == status, (status, resp.body)
    assert resp.headers["request-id"] and resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert body == {"type": "error", "error": {"type": anthropic_error_type(status),
                                               "message": body["error"]["message"]}}, resp.body
    return body["error"]


_MSG_HEAD = b"POST /v1/messages HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
_MSG_BODY = orjson.dumps({"model": "llama", "max_tokens": 2, "messages": MSGS})


def _chunked(body: bytes) -> bytes:
    return b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"


# a Messages request whose head or body aiohttp's parser refuses: (case, bytes, status)
_UNPARSED = [
    ("cl_and_te", _MSG_HEAD + b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    ("double_content_length", _MSG_HEAD + b"Content-Length: %d\r\nContent-Length: 5\r\n\r\n" % len(_MSG_BODY)
     + _MSG_BODY, 400),
    ("negative_content_length", _MSG_HEAD + b"Content-Length: -1\r\n\r\n" + _MSG_BODY, 400),
    ("bad_chunk_size", _MSG_HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + _MSG_BODY + b"\r\n0\r\n\r\n", 400),
    ("chunk_longer_than_size", _MSG_HEAD + b"Transfer-Encoding: chunked\r\n\r\n2\r\n" + _MSG_BODY
     + b"\r\n0\r\n\r\n", 400),
    ("obsolete_line_folding", _MSG_HEAD + b"X-A: a\r\n b\r\nContent-Length: %d\r\n\r\n" % len(_MSG_BODY)
     + _MSG_BODY, 400),
    ("nul_in_header", _MSG_HEAD + b"X-A: a\x00b\r\nContent-Length: %d\r\n\r\n" % len(_MSG_BODY) + _MSG_BODY, 400),
    ("two_hosts", _MSG_HEAD + b"Host: b\r\nContent-Length: %d\r\n\r\n" % len(_MSG_BODY) + _MSG_BODY, 400),
    ("header_60kb", request("POST", "/v1/messages", _MSG_BODY, {"X-Big": "a" * 60_000}), 431),
    ("headers_300", request("POST", "/v1/messages", _MSG_BODY, {f"X-H{i}": "v" for i in range(300)}), 431),
    ("target_20kb", request("POST", "/v1/messages?" + "a" * 20_000, _MSG_BODY), 414),
    ("count_tokens_bad_chunk", b"POST /v1/messages/count_tokens HTTP/1.1\r\nHost: gw\r\n"
     b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    ("method_with_a_control_byte", _MSG_HEAD.replace(b"POST", b"PO\x01T") + b"Content-Length: %d\r\n\r\n"
     % len(_MSG_BODY) + _MSG_BODY, 400),
    ("http_2_0_request_line", _MSG_HEAD.replace(b"HTTP/1.1", b"HTTP/2.0") + b"Content-Length: %d\r\n\r\n"
     % len(_MSG_BODY) + _MSG_BODY, 400),
]


async def test_a_messages_request_the_parser_refuses_gets_an_anthropic_error(sims, gateway):
    """aiohttp answers a head or a body it cannot parse through the edge's ``handle_error``, with a
    request that has no path: those answers were OpenAI-shaped on /v1/messages, where the SDK reads
    Anthropic's. The edge keeps the first bytes of the head for them; other paths keep OpenAI's."""
    v = await sims("vllm", "llama")
    gw = await gateway([model_block("llama", "vllm", [v.url])])
    for case, raw, status in _UNPARSED:
        got = await exchange(gw.port, raw, wait=10)
        err = _anthropic_error(got.first, status)
        assert err["message"], case
        assert got.closed and len(got.responses) == 1, case
    # the head of a next request on a kept-alive connection, after one the lane answered
    got = await exchange(gw.port, request("POST", "/v1/messages", _MSG_BODY),
                         _MSG_HEAD + b"Content-Length: -1\r\n\r\n", wait=10)
    assert got.responses[0].status == 200
    _anthropic_error(got.responses[1], 400)
    # the head sent a few bytes at a time
    got = await exchange(gw.port, b"POST /v1/", b"messages HTTP/1.1\r\n", b"Host: gw\r\nContent-Length: x\r\n\r\n",
                         wait=10)
    _anthropic_error(got.first, 400)
    # other paths keep OpenAI's shape
    got = await exchange(gw.port, _MSG_HEAD.replace(b"/v1/messages", b"/v1/chat/completions")
                         + b"Content-Length: -1\r\n\r\n", wait=10)
    assert_openai_error(got.first, 400)
    # the SDK reads a 431 as Anthropic's error
    client = anthropic_client(gw)
    with pytest.raises(anthropic.APIStatusError) as ei:
        await client.messages.create(model="llama", max_tokens=2, messages=MSGS, extra_headers={"X-Big": "a" * 60_000})
    assert ei.value.status_code == 431
    assert ei.value.body["type"] == "error" and ei.value.body["error"]["type"] == "invalid_request_error"
    assert await sim_state(v.url) is not None and not [
        r for r in (await sim_state(v.url))["received"] if r["path"] == "/v1/messages"][1:]



async def test_an_absolute_form_messages_target_the_parser_refuses_gets_an_anthropic_error(sims, gateway):
    """A request line's target in absolute form (``POST http://host/v1/messages``, which a server
    takes, RFC 9112 §3.2.2: the gateway serves it as the Messages API) names its path as surely as
    one in origin form: a header field too large, too many of them or a malformed header line after
    it are answered in Anthropic's shape, with a host name of any length (253 characters at most in
    DNS) and a port, and the request log line names the path; the same on the chat path, and a line
    that is no request line, stay OpenAI's. They were OpenAI-shaped, with no path on the line."""
    v = await sims("vllm", "llama")
    gw = await gateway([model_block("llama", "vllm", [v.url])])
    long_host = ".".join(["a" * 63] * 3) + ".example"
    heads = {
        "header_100kib": lambda target: request("POST", target, _MSG_BODY, {"X-Big": "a" * 100 * 1024}),
        "headers_300": lambda target: request("POST", target, _MSG_BODY, {f"X-H{i}": "v" for i in range(300)}),
        "bad_header_line": lambda target: request("POST", target, _MSG_BODY).replace(b"Host:", b"Bad Line\r\nHost:"),
    }
    with gw.gw.request_log.capture() as lines:
        for target, path in (("http://gw/v1/messages", "/v1/messages"),
                             ("https://gw:8443/v1/messages/count_tokens?beta=true", "/v1/messages/count_tokens"),
                             (f"http://{long_host}:65535/v1/messages", "/v1/messages"),
                             ("HTTP://GW/v1/messages", "/v1/messages")):
            served = await exchange(gw.port, request("POST", target, _MSG_BODY, close=True), wait=10)
            assert served.first.status == 200, (target, served.first.body[:200])
            for case, make in heads.items():
                got = await exchange(gw.port, make(target), wait=10)
                err = _anthropic_error(got.first, 431 if case != "bad_header_line" else 400)
                assert err["message"] and got.closed, (target, case)
                rid = got.first.headers["request-id"]
                await wait_for(lambda rid=rid: any(x["request_id"] == rid for x in lines), timeout=5.0, interval=0.01)
                assert [(x["path"], x["method"]) for x in lines if x["request_id"] == rid] == [(path, "POST")], \
                    (target, case)
        for raw in (request("POST", "http://gw/v1/chat/completions", _MSG_BODY, {"X-Big": "a" * 100 * 1024}),
                    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"X" * 100 * 1024 + b"\r\n\r\n"):
            got = await exchange(gw.port, raw, wait=10)
            assert_openai_error(got.first)


# a Messages path with a byte no path name goes on with: (case, bytes, status); none reaches the engine
_BROKEN_PATHS = [
    ("nul", b"GET /v1/messages\x00 HTTP/1.1\r\nHost: gw\r\n\r\n", 400),
    ("nul_on_a_post", b"POST /v1/messages\x00 HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
     b"Content-Length: %d\r\n\r\n" % len(_MSG_BODY) + _MSG_BODY, 400),
    ("control_byte", b"GET /v1/messages\x01 HTTP/1.1\r\nHost: gw\r\n\r\n", 400),
    ("del", b"GET /v1/messages\x7f HTTP/1.1\r\nHost: gw\r\n\r\n", 400),
    ("tab", b"GET /v1/messages\t HTTP/1.1\r\nHost: gw\r\n\r\n", 400),
    ("non_ascii_byte", b"GET /v1/messages\xff HTTP/1.1\r\nHost: gw\r\n\r\n", 400),
    ("nul_before_a_query", b"GET /v1/messages\x00?a=1 HTTP/1.1\r\nHost: gw\r\n\r\n", 400),
    ("nul_then_a_long_path", b"GET /v1/messages\x00" + b"a" * 200 + b" HTTP/1.1\r\nHost: gw\r\n\r\n", 400),
    ("count_tokens_nul", b"POST /v1/messages/count_tokens\x00 HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\n\r\n{}",
     400),
    ("line_without_version", b"POST /v1/messages\r\nHost: gw\r\nContent-Length: 2\r\n\r\n{}", 400),
    # percent-encoded, the head parses and the path decodes to one the router does not know
    ("percent_nul", request("GET", "/v1/messages%00", close=True), 404),
    ("percent_nul_on_a_post", request("POST", "/v1/messages%00", _MSG_BODY, close=True), 404),
    ("percent_control_byte", request("POST", "/v1/messages%1b", _MSG_BODY, close=True), 404),
    ("percent_undecodable", request("GET", "/v1/messages%ff", close=True), 404),
    ("count_tokens_percent_nul", request("POST", "/v1/messages/count_tokens%00", _MSG_BODY, close=True), 404),
]


async def test_a_messages_path_with_a_control_byte_gets_an_anthropic_error(sims, gateway):
    """``/v1/messages`` followed by a NUL, another control byte or a byte outside ASCII, raw (the
    parser refuses the request line) or percent-encoded (the router knows no such path), is still a
    request to the Messages API: its error is Anthropic's. A path that goes on with a name's
    characters is another path, and keeps OpenAI's shape."""
    v = await sims("vllm", "llama")
    gw = await gateway([model_block("llama", "vllm", [v.url])])
    for case, raw, status in _BROKEN_PATHS:
        got = await exchange(gw.port, raw, wait=10)
        assert got.responses, case
        err = _anthropic_error(got.first, status)
        assert err["message"], case
    for path in ("/v1/messagesx", "/v1/messages-v2", "/v1/chat/completions%00"):
        got = await exchange(gw.port, request("POST", path, _MSG_BODY, close=True), wait=10)
        assert_openai_error(got.first, 404)
    got = await exchange(gw.port, b"GET /v1/chat/completions\x00 HTTP/1.1\r\nHost: gw\r\n\r\n", wait=10)
    assert_openai_error(got.first, 400)
    assert not [r for r in (await sim_state(v.url))["received"] if r["method"] == "POST"]


async def test_a_messages_path_the_gateway_does_not_serve_is_an_anthropic_404(fleet):
    """The SDK's ``messages.batches`` calls land on ``/v1/messages/batches``: a 404 in Anthropic's
    shape, which the SDK reads as such; other unknown paths keep OpenAI's."""
    gw, _ = fleet
    client = anthropic_client(gw)
    with pytest.raises(anthropic.NotFoundError) as ei:
        await client.messages.batches.list()
    assert ei.value.body["type"] == "error" and ei.value.body["error"]["type"] == "not_found_error"
    await client.close()
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/v1/nothing/here") as r:
        assert r.status == 404 and "type" not in await r.json()


def _messages_events() -> list[bytes]:
    """A Messages stream with a text block and a tool_use block, framed as the engines frame it."""
    def ev(name: str, data: dict) -> bytes:
        return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **data}) + b"\n\n"
    return [
        ev("message_start", {"message": {"id": "msg_1", "type": "message", "role": "assistant", "content": [],
                                         "model": "llama", "stop_reason": None, "stop_sequence": None,
                                         "usage": {"input_tokens": 10, "output_tokens": 0}}}),
        ev("ping", {}),
        ev("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
        ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "Let me look."}}),
        ev("content_block_stop", {"index": 0}),
        ev("content_block_start", {"index": 1, "content_block": {"type": "tool_use", "id": "toolu_1",
                                                                 "name": "get_weather", "input": {}}}),
        ev("content_block_delta", {"index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"city": '}}),
        ev("content_block_delta", {"index": 1, "delta": {"type": "input_json_delta", "partial_json": '"Paris"}'}}),
        ev("content_block_stop", {"index": 1}),
        ev("message_delta", {"delta": {"stop_reason": "tool_use", "stop_sequence": None}, "usage": {"output_tokens": 7}}),
        ev("message_stop", {}),
    ]


_cut_messages_engine = cutting_stream(_messages_events)


async def test_an_engine_that_breaks_mid_event_ends_the_stream_with_a_clean_error_event(gateway):
    """The half event an engine sent before its connection broke never reaches the client: the
    stream the SDK reads ends with the gateway's error event, which it raises, rather than a
    mangled frame (a JSON error, or a ping frame that swallowed the error: a silent success)."""
    tools = [{"name": "get_weather", "description": "the weather", "input_schema": {"type": "object"}}]
    async with fake_engine(_cut_messages_engine, paths=("/v1/messages",)) as url:
        gw = await gateway([model_block("llama", "vllm", [url])])
        c = anthropic_client(gw)
        async with c.messages.stream(model="llama", max_tokens=50, messages=MSGS, tools=tools) as stream:
            final = await stream.get_final_message()
        assert final.stop_reason == "tool_use" and final.content[1].input == {"city": "Paris"}
        for cut in (1, 4, 7, 9, 10):
            seen = []
            with pytest.raises(anthropic.APIStatusError) as ei:
                async with c.messages.stream(model="llama", max_tokens=50, messages=MSGS, tools=tools,
                                             extra_headers={"x-cut": str(cut)}) as stream:
                    async for event in stream:
                        seen.append(event.type)
            assert ei.value.body["error"]["type"] == "api_error", (cut, ei.value.body)
            assert "mid-stream" in ei.value.body["error"]["message"]
            assert seen[0] == "message_start"


def _erring_events(error: object, line_end: bytes) -> list[bytes]:
    """A Messages stream cut by the engine's own error event carrying ``error``, its lines ended with
    ``line_end``; the error frame is written in two parts."""
    events = [e for e in _messages_events()[:4]] + [
        b"event: error\ndata: " + orjson.dumps({"type": "error", "error": error}) + b"\n\n"]
    events = [e.replace(b"\n", line_end) for e in events]
    last = events.pop()
    return events + [last[:9], last[9:]]


async def _erring_engine(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
    await request.read()
    resp = aiohttp.web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    error = orjson.loads(request.headers["x-error"])
    for part in _erring_events(error, b"\r" if "x-cr" in request.headers else b"\n"):
        await resp.write(part)
    await resp.write_eof()
    return resp


async def test_an_engines_error_event_in_a_stream_carries_an_anthropic_error_type(sims, gateway):
    """vLLM ends a Messages stream it cannot complete with an error event of type ``internal_error``
    (vllm/entrypoints/anthropic/serving.py, ``message_stream_converter``), which is no Anthropic
    type: the client reads ``api_error`` there (another of the engine's status codes, its own type),
    with the engine's message; an error of one of Anthropic's types passes unchanged."""
    v = await sims("vllm", "llama")
    gw = await gateway([model_block("llama", "vllm", [v.url])])
    c = anthropic_client(gw)
    with pytest.raises(anthropic.APIStatusError) as ei:
        async with c.messages.stream(model="llama", max_tokens=20, messages=MSGS,
                                     extra_headers={"x-sim-fault": "error_after=3"}) as stream:
            assert [t async for t in stream.text_stream]
    assert ei.value.body == {"type": "error", "error": {
        "type": "api_error", "message": "Simulated engine failure after 3 tokens"}}
    body = {"model": "llama", "max_tokens": 20, "stream": True, "messages": MSGS}
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/messages", json=body,
                                                    headers={"x-sim-fault": "error_after=3"}) as r:
        raw = await r.read()
    assert raw.endswith(b'event: error\ndata: {"type":"error","error":{"type":"api_error",'
                        b'"message":"Simulated engine failure after 3 tokens"}}\n\n')
    assert [n for n, _ in sse_frames(raw)] == ["message_start", "content_block_start"] + ["content_block_delta"] * 3 + ["error"]

    async with fake_engine(_erring_engine, paths=("/v1/messages",)) as url:
        gw = await gateway([model_block("llama", "vllm", [url])])
        c = anthropic_client(gw)
        for error, line_end, want in [
            ({"type": "internal_error", "message": "boom"}, "", {"type": "api_error", "message": "boom"}),
            ({"type": "internal_error", "message": "boom"}, "cr", {"type": "api_error", "message": "boom"}),
            ({"message": "full", "code": 503}, "", {"type": "overloaded_error", "message": "full", "code": 503}),
            ({"type": "overloaded_error", "message": "Overloaded"}, "", {"type": "overloaded_error", "message": "Overloaded"}),
        ]:
            headers = {"x-error": orjson.dumps(error).decode(), **({"x-cr": "1"} if line_end else {})}
            with pytest.raises(anthropic.APIStatusError) as ei:
                async with c.messages.stream(model="llama", max_tokens=20, messages=MSGS, extra_headers=headers) as stream:
                    assert [t async for t in stream.text_stream] == ["Let me look."]
            assert ei.value.body == {"type": "error", "error": want}, (error, line_end)


def _thinking_events() -> list[bytes]:
    """A Messages stream with a thinking block closed by its signature, then a text block with a
    citation: five generated tokens' deltas, and two deltas that are none."""
    def ev(name: str, data: dict) -> bytes:
        return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **data}) + b"\n\n"

    def delta(index: int, d: dict) -> bytes:
        return ev("content_block_delta", {"index": index, "delta": d})
    citation = {"type": "char_location", "cited_text": "Switchyards sort cars.", "document_index": 0,
                "document_title": None, "start_char_index": 0, "end_char_index": 22}
    return [
        ev("message_start", {"message": {"id": "msg_1", "type": "message", "role": "assistant", "content": [],
                                         "model": "llama", "stop_reason": None, "stop_sequence": None,
                                         "usage": {"input_tokens": 10, "output_tokens": 0}}}),
        ev("content_block_start", {"index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
        *[delta(0, {"type": "thinking_delta", "thinking": t}) for t in ("Cars", " are", " sorted.")],
        delta(0, {"type": "signature_delta", "signature": "EqQBCgIYAhIM1gbcDa9GJwZA" * 8}),
        ev("content_block_stop", {"index": 0}),
        ev("content_block_start", {"index": 1, "content_block": {"type": "text", "text": "", "citations": []}}),
        delta(1, {"type": "citations_delta", "citation": citation}),
        *[delta(1, {"type": "text_delta", "text": t}) for t in ("They sort", " cars.")],
        ev("content_block_stop", {"index": 1}),
        ev("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None}, "usage": {"output_tokens": 5}}),
        ev("message_stop", {}),
    ]


async def test_a_thinking_blocks_signature_and_a_citation_are_not_counted_as_tokens(gateway):
    """A stream's inter-token gaps are those between the reads of its generated tokens' deltas (thinking, text,
    a tool's input): a thinking block's ``signature_delta`` and a text block's ``citations_delta``
    carry none, and add no gap to ``switchyard_inter_token_latency_seconds``."""
    async with fake_engine(cutting_stream(_thinking_events), paths=("/v1/messages",)) as url:
        gw = await gateway([model_block("llama", "vllm", [url])])
        c = anthropic_client(gw)
        with gw.gw.request_log.capture() as lines:
            async with c.messages.stream(model="llama", max_tokens=50, messages=MSGS) as stream:
                final = await stream.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text"]
        assert final.content[0].thinking == "Cars are sorted." and final.content[0].signature.startswith("EqQB")
        assert final.content[1].text == "They sort cars." and len(final.content[1].citations) == 1
        line = await wait_for(lambda: next((x for x in lines if x["path"] == "/v1/messages"), None), 10)
        assert line["completion_tokens"] == 5 and line["ttft_ms"] is not None
        async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
            page = await r.text()
        # a gap for each later read that carried a token's delta (how the engine's writes were read
        # decides how many: the exact count of token deltas is pinned in tests/unit), never one for
        # the signature's or the citation's
        assert metric(page, "switchyard_inter_token_latency_seconds_count", model="llama") <= 4


def _tool_only_events(request: aiohttp.web.Request) -> list[bytes]:
    """A tool-only answer, as a Messages stream or (on the chat path) as chat chunks: the tool's
    name, then its input in two pieces."""
    if request.path == "/v1/chat/completions":
        def chunk(delta: dict, finish: str | None = None) -> bytes:
            return b"data: " + orjson.dumps({"id": "c1", "object": "chat.completion.chunk", "model": "llama", "choices": [
                {"index": 0, "delta": delta, "finish_reason": finish}]}) + b"\n\n"

        def call(function: dict, **kw: str) -> dict:
            return {"tool_calls": [{"index": 0, **kw, "function": function}]}
        return [chunk({"role": "assistant", "content": ""}),
                chunk(call({"name": "get_weather"}, id="call_1", type="function")),
                chunk(call({"arguments": '{"city": '})), chunk(call({"arguments": '"Paris"}'})),
                chunk({}, "tool_calls"), b"data: [DONE]\n\n"]
    events = _messages_events()
    return [events[0], events[5].replace(b'"index":1', b'"index":0'),
            *[e.replace(b'"index":1', b'"index":0') for e in events[6:9]], *events[9:]]


async def _tool_only_engine(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
    await request.read()
    resp = aiohttp.web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    cut = int(request.headers.get("x-cut", "-1"))
    for i, event in enumerate(_tool_only_events(request)):
        if i == cut:
            assert request.transport is not None
            request.transport.abort()
            return resp
        await resp.write(event)
    await resp.write_eof()
    return resp


async def test_a_tool_only_answers_ttft_is_at_its_tools_name_on_messages_as_on_chat(gateway):
    """A tool-only answer's first generated output the client sees is the tool's name: in its
    block's ``content_block_start`` on /v1/messages, in the chunk that names it on chat. Both take
    TTFT there: a stream the engine breaks right after the name has a TTFT on either path."""
    tools = [{"name": "get_weather", "description": "the weather", "input_schema": {"type": "object"}}]
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    async with fake_engine(_tool_only_engine, paths=("/v1/messages", "/v1/chat/completions")) as url:
        gw = await gateway([model_block("llama", "vllm", [url])])
        c = anthropic_client(gw)
        async with c.messages.stream(model="llama", max_tokens=50, messages=MSGS, tools=tools) as stream:
            final = await stream.get_final_message()
        assert final.content[0].name == "get_weather" and final.content[0].input == {"city": "Paris"}
        messages = {"model": "llama", "max_tokens": 50, "stream": True, "messages": MSGS, "tools": tools}
        chat = {"model": "llama", "max_tokens": 50, "stream": True, "messages": MSGS, "tools": chat_tools}
        with gw.gw.request_log.capture() as lines:
            async with aiohttp.ClientSession() as s:
                for path, body in (("/v1/messages", messages), ("/v1/chat/completions", chat)):
                    async with s.post(gw.url + path, json=body, headers={"x-cut": "2"}) as r:
                        assert b'"get_weather"' in await r.read()
            await wait_for(lambda: lines if len(lines) == 2 else None, 10)
        assert {x["path"]: x["ttft_ms"] is not None for x in lines} == {"/v1/messages": True, "/v1/chat/completions": True}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_a_messages_stream_whose_engine_died_logs_no_completion_count(sims, gateway, engine):
    """A Messages stream the engine breaks off before its ``message_delta`` has no output count
    from the engine: ``message_start``'s (0, or 1) is not the answer's. Its log line's
    ``completion_tokens`` is null, as a chat stream's is, not a 0 that says nothing was generated
    while tokens reached the client; ``prompt_tokens`` is ``message_start``'s input count where
    the engine reported one (vLLM's; SGLang's are zeros: null)."""
    sim = await sims(engine, "m")
    gw = await gateway([model_block("m", engine, [sim.url])])
    with gw.gw.request_log.capture() as lines:
        async with aiohttp.ClientSession() as s, s.post(
                gw.url + "/v1/messages", json={"model": "m", "messages": MSGS, "max_tokens": 16, "stream": True},
                headers={"x-sim-fault": "drop_after=5"}) as r:
            raw = await r.read()
        assert await wait_for(lambda: len(lines) == 1)
    assert r.status == 200 and b"content_block_delta" in raw, raw[:300]
    line = lines[0]
    assert line["completion_tokens"] is None, line
    assert (line["prompt_tokens"] or 0) > 0 if engine == "vllm" else line["prompt_tokens"] is None, line


async def test_vllm_reasoning_reaches_the_sdk_as_a_thinking_block_and_counts_its_tokens(sims, gateway):
    """vLLM's Messages answer of a reasoning parser's output: a thinking block (its thinking
    deltas, then its signature) before the text block, whole and streamed, through the gateway
    to the anthropic SDK's ``messages.stream`` with ``thinking``; the output tokens count both
    blocks' and the inter-token gaps are those of the thinking and text deltas, the signature none."""
    sim = await sims("vllm", "llama", reasoning_parser="deepseek_r1")
    gw = await gateway([model_block("llama", "vllm", [sim.url])])
    c = anthropic_client(gw)
    ask = {"model": "llama", "max_tokens": 8, "messages": MSGS, "thinking": {"type": "enabled", "budget_tokens": 4}}
    whole = await c.messages.create(**ask)
    with gw.gw.request_log.capture() as lines:
        async with c.messages.stream(**ask) as stream:
            events = [ev async for ev in stream]
            final = await stream.get_final_message()
    for msg in (whole, final):
        assert [b.type for b in msg.content] == ["thinking", "text"], msg.content
        assert msg.content[0].thinking and msg.content[0].signature and msg.content[1].text
        assert msg.usage.output_tokens == 8 and msg.stop_reason == "max_tokens"
    assert final.content[0].thinking == whole.content[0].thinking and final.content[1].text == whole.content[1].text
    kinds = [ev.delta.type for ev in events if ev.type == "content_block_delta"]
    assert kinds == ["thinking_delta"] * 4 + ["signature_delta"] + ["text_delta"] * 4
    line = await wait_for(lambda: next((x for x in lines if x["path"] == "/v1/messages"), None), 10)
    assert line["completion_tokens"] == 8 and line["ttft_ms"] is not None and line["finish_reason"] == "max_tokens"
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        page = await r.text()
    assert metric(page, "switchyard_inter_token_latency_seconds_count", model="llama") <= 7
