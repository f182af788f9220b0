"""Tool calls and structured output through the gateway, against engines that make tool calls
(enginesim's ``--tool-call-parser``), driven by the real ``openai`` and ``anthropic`` SDKs: the
calls, their streamed arguments and the turn after them reach the client as the engine wrote them,
and are counted like any answer."""

from __future__ import annotations

import json

import pytest

from tests.support.factories import model_block
from tests.support.http import anthropic_client, openai_client, sim_state
from tests.support.waiting import until

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string"}}}}}]
RTOOLS = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
MTOOLS = [{"name": "get_weather", "description": "the weather", "input_schema": SCHEMA},
          {"name": "get_time", "input_schema": {"type": "object"}}]
MODELS = {"vllm": "llama", "sglang": "qwen"}


@pytest.fixture
async def fleet(sims, gateway):
    async def make(**blocks):
        v = await sims("vllm", "llama", tool_call_parser="hermes", enable_responses_store=True)
        s = await sims("sglang", "qwen", tool_call_parser="qwen25")
        gw = await gateway([model_block("llama", "vllm", [v.url]), model_block("qwen", "sglang", [s.url])], **blocks)
        return gw, {"vllm": v, "sglang": s}
    return make


def counted(text: str, model: str) -> tuple[str, str]:
    lines = {line.rsplit(" ", 1)[0]: line.rsplit(" ", 1)[1] for line in text.splitlines() if not line.startswith("#")}
    return (lines[f'switchyard_completion_tokens_total{{model="{model}"}}'],
            lines[f'switchyard_time_to_first_token_seconds_count{{model="{model}"}}'])


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_chat_tool_calls_streamed_and_whole_then_the_tool_turn(fleet, engine):
    gw, _ = await fleet()
    model, c = MODELS[engine], openai_client(gw)
    r = await c.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=4)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.usage.completion_tokens == 4
    assert [x.function.name for x in calls] == ["get_weather", "get_time"]
    # the SDK's stream helper assembles the arguments from their deltas; the usage chunk the
    # gateway asked for on its own account is not the client's
    async with c.chat.completions.stream(model=model, messages=ASK, tools=TOOLS, max_tokens=4,
                                         parallel_tool_calls=False) as stream:
        final = await stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls" and final.usage is None
    assert [x.function.name for x in streamed] == ["get_weather"]
    assert json.loads(streamed[0].function.arguments) == json.loads(calls[0].function.arguments)
    named = await c.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=4,
                                            tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [x.function.name for x in named.choices[0].message.tool_calls] == ["get_time"]
    none = await c.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=4, tool_choice="none")
    assert none.choices[0].message.content and not none.choices[0].message.tool_calls
    turn = ASK + [{"role": "assistant", "content": None, "tool_calls": [x.model_dump() for x in calls]}] + [
        {"role": "tool", "tool_call_id": x.id, "content": "sunny"} for x in calls]
    after = await c.chat.completions.create(model=model, messages=turn, tools=TOOLS, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True})
    chunks = [ch async for ch in after]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].usage.completion_tokens == 4
    assert counted(await gw.metrics_text(), model) == ("20.0", "2.0")


@pytest.mark.parametrize("state", ["engine", "gateway"])
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_responses_function_calls_and_their_outputs_continued(fleet, engine, state):
    gw, sims = await fleet(responses={"state": state})
    model, c = MODELS[engine], openai_client(gw)
    r = await c.responses.create(model=model, input="Weather in Paris?", tools=RTOOLS, max_output_tokens=4)
    assert [o.type for o in r.output] == ["function_call"]
    events = []
    async with c.responses.stream(model=model, input="Weather in Paris?", tools=RTOOLS, max_output_tokens=4) as stream:
        async for ev in stream:
            events.append(ev.type)
        final = await stream.get_final_response()
    assert events == ["response.created", "response.in_progress", "response.output_item.added"] + [
        "response.function_call_arguments.delta"] * 5 + [
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    call = final.output[0]
    assert call.type == "function_call" and json.loads(call.arguments) == json.loads(r.output[0].arguments)
    answer = await c.responses.create(model=model, previous_response_id=final.id, tools=RTOOLS, max_output_tokens=4,
                                      input=[{"type": "function_call_output", "call_id": call.call_id,
                                              "output": "sunny"}])
    assert answer.output_text and [o.type for o in answer.output] == ["message"]
    async with c.responses.stream(model=model, previous_response_id=answer.id, tools=RTOOLS,
                                  max_output_tokens=4, input="And in Rome?") as stream:
        again = await stream.get_final_response()
    assert [o.type for o in again.output] == ["function_call"]
    if state == "gateway":      # the engine got the whole conversation, the call and its output in place
        sent = [e for e in (await sim_state(sims[engine].url))["received"] if e["path"] == "/v1/responses"][-1]
        assert [i.get("type") or i["role"] for i in sent["body"]["input"]] == [
            "user", "function_call", "function_call_output", "assistant", "user"]
        items = [i async for i in c.responses.input_items.list(again.id, order="asc")]
        assert [i.type for i in items] == ["message", "function_call", "function_call_output", "message", "message"]
        assert items[1].call_id == call.call_id and items[2].output == "sunny"
    assert counted(await gw.metrics_text(), model) == ("16.0", "2.0")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_messages_tool_use_blocks_streamed_and_whole_then_the_tool_result(fleet, engine):
    gw, _ = await fleet()
    model, c = MODELS[engine], anthropic_client(gw)
    m = await c.messages.create(model=model, messages=ASK, tools=MTOOLS, max_tokens=4)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use", "tool_use"]
    assert m.content[0].name == "get_weather" and set(m.content[0].input) == {"city"}
    async with c.messages.stream(model=model, messages=ASK, tools=MTOOLS, max_tokens=4,
                                 tool_choice={"type": "tool", "name": "get_time"}) as stream:
        events = [ev.type async for ev in stream]
        final = await stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.name for b in final.content] == ["get_time"]
    assert events[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"] and "input_json" in events
    turn = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id,
                                                "content": [{"type": "text", "text": "sunny"}]} for b in m.content]}]
    async with c.messages.stream(model=model, messages=turn, tools=MTOOLS, max_tokens=4) as stream:
        after = await stream.get_final_message()
    assert [b.type for b in after.content] == ["text"] and after.stop_reason == "max_tokens"
    assert counted(await gw.metrics_text(), model) == ("12.0", "2.0")


async def test_structured_output_reaches_the_engine_as_sent(sims, gateway):
    """``response_format`` (chat) and ``text.format`` (Responses) are the engine's: they reach it
    in the fields it reads, also when the gateway re-encodes the body (an alias, a stream it asks
    usage for), and a schema the engine would refuse is not the gateway's to refuse."""
    v = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [v.url])], aliases=[{"name": "al", "targets": [{"model": "m"}]}])
    c = openai_client(gw)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -0.0, "multipleOf": 1.0},
                                               "tag": {"type": "string", "pattern": "^[a-zé]+$"}},
              "required": ["n"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "w", "strict": True, "schema": schema}}

    async def last(path: str) -> dict:
        return [e for e in (await sim_state(v.url))["received"] if e["path"] == path][-1]["body"]

    for model in ("m", "al"):
        for stream in (False, True):
            r = await c.chat.completions.create(model=model, messages=ASK, max_tokens=2, response_format=rf,
                                                stream=stream)
            if stream:
                _ = [ch async for ch in r]
            assert (await last("/v1/chat/completions"))["response_format"] == rf
    text = {"format": {"type": "json_schema", "name": "w", "strict": True, "schema": schema}}
    await c.responses.create(model="m", input="hi", text=text, max_output_tokens=2)
    assert (await last("/v1/responses"))["text"] == text
    bad = {"type": "json_schema", "json_schema": {"name": "w", "schema": "not a schema"}}
    await c.chat.completions.create(model="m", messages=ASK, max_tokens=2, response_format=bad)
    assert (await last("/v1/chat/completions"))["response_format"] == bad


@pytest.mark.parametrize("state", ["engine", "gateway"])
async def test_a_responses_requests_tools_count_in_its_prompt_estimate(fleet, state):
    """A stream the engine breaks off before its usage is charged its prompt's estimate (and the
    events it sent): the tools the engine renders into the prompt are part of it, on a first turn
    and on a follow-up the gateway builds from its history."""
    gw, _ = await fleet(responses={"state": state},
                        limits={"users": {"alice": {"tpm": 1000000, "rpm": 1000, "max_concurrent": 4}}})
    tools = [{**RTOOLS[0], "name": f"lookup_route_{i}",
              "description": f"Look up route table {i} of the gateway fleet by prefix."} for i in range(12)]
    tools_chars = len(json.dumps(tools, separators=(",", ":")))          # about 2,000
    c = openai_client(gw)
    first = await c.responses.create(model="llama", input="Hi", max_output_tokens=2, user="alice")
    state_ = gw.gw.tenancy.state

    async def charged() -> int:
        async def settled():
            usage = await state_.usage("alice")
            return usage if usage["concurrent"] == 0 else None
        return (await until(settled))["tokens"]

    before = await charged()
    for prev in (None, first.id):
        async with c.responses.stream(model="llama", input="Which route serves 10.1.2.3?", tools=tools,
                                      max_output_tokens=20, user="alice", previous_response_id=prev,
                                      extra_headers={"x-sim-fault": "drop_after=2"}) as stream:
            seen = [ev.type async for ev in stream]
        assert seen[-1] == "response.failed"
        after = await charged()
        assert after - before >= tools_chars // 4, (after - before, tools_chars)
        before = after
