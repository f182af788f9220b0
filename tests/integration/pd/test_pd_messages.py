"""The Anthropic Messages API over prefill/decode pairs: the real ``anthropic`` SDK through the
gateway against enginesim engines in prefill and decode roles.

vLLM's Messages request takes a top-level ``kv_transfer_params`` (passed into the chat request it
builds) and its non-streaming answer carries the chat answer's, so its context-first P/D runs on
/v1/messages as on chat. SGLang's Anthropic request has no bootstrap fields: an SGLang P/D model
refuses the Messages paths.
"""

from __future__ import annotations

import asyncio

import aiohttp
import aiohttp.web
import anthropic
import orjson
import pytest

from tests.support.factories import pd_model, pd_pair, roleset
from tests.support.fake_engine import fake_engine
from tests.support.http import anthropic_client, post, sim_state, sse_frames
from tests.support.waiting import wait_for

MSGS = [{"role": "user", "content": "Disaggregated serving splits prefill from decode. " * 8}]
MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"


def legs(state: dict, path: str = MESSAGES) -> list[dict]:
    """The bodies of the POSTs an engine received on ``path``."""
    return [r["body"] for r in state["received"] if r["method"] == "POST" and r["path"] == path]


async def quiet(url: str) -> bool:
    st = await sim_state(url)
    return not st["running"] and not st["waiting"]


async def test_messages_run_on_a_vllm_pair_through_the_sdk(sims, gateway):
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])])
    c = anthropic_client(gw)
    raw = await c.messages.with_raw_response.create(model="m", max_tokens=8, system="Be brief.", messages=MSGS,
                                                    extra_body={"temperature": 0.5, "stop_sequences": ["zzz"]})
    assert raw.headers["prefill-target-pod"] == p.url.split("//")[1]
    assert raw.headers["target-pod"] == d.url.split("//")[1]
    assert raw.headers["x-pd-decision"] == "disaggregated; reason=always"
    msg = await raw.parse()
    assert msg.type == "message" and msg.content[0].text and msg.stop_reason == "max_tokens"
    assert msg.usage.output_tokens == 8 and msg.usage.input_tokens > 0

    async with c.messages.stream(model="m", max_tokens=6, messages=MSGS) as stream:
        text = [t async for t in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(text) == final.content[0].text and len(text) == 6
    assert final.usage.output_tokens == 6 and final.usage.input_tokens > 0

    ps, ds = await sim_state(p.url), await sim_state(d.url)
    # the prefill legs: the client's body, one token, not streamed, for a remote decode
    prefills = legs(ps)
    assert len(prefills) == 2
    for sent in prefills:
        assert sent["max_tokens"] == 1 and sent["stream"] is False
        assert sent["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                              "remote_engine_id": None, "remote_block_ids": None,
                                              "remote_host": None, "remote_port": None}
        assert sent["messages"] == MSGS and "max_completion_tokens" not in sent and "stream_options" not in sent
    assert prefills[0]["system"] == "Be brief." and prefills[0]["temperature"] == 0.5
    assert prefills[0]["stop_sequences"] == ["zzz"]
    # the decode legs: the client's body plus the prefill's params (its host the prefill's)
    decodes = legs(ds)
    assert [b["max_tokens"] for b in decodes] == [8, 6] and [b.get("stream") for b in decodes] == [None, True]
    for sent in decodes:
        kv = sent["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["remote_engine_id"] and kv["remote_request_id"]
        assert kv["remote_host"] == "127.0.0.1" and kv["remote_port"] == p.side_channel_port
        assert "stream_options" not in sent
    assert decodes[0]["system"] == "Be brief." and decodes[0]["stop_sequences"] == ["zzz"]
    assert ds["pd"]["transfers"] == 2 and ds["counts"]["completed"] == 2 and ps["counts"]["completed"] == 2

    text = await gw.metrics_text()
    # the decode's answers alone are counted: the prefill's one token is not the client's
    assert 'switchyard_completion_tokens_total{model="m"} 14.0' in text
    assert f'switchyard_prompt_tokens_total{{model="m"}} {float(msg.usage.input_tokens + final.usage.input_tokens)}' \
        in text
    assert 'switchyard_time_to_first_token_seconds_count{model="m"} 1.0' in text
    assert 'switchyard_inter_token_latency_seconds_count{model="m"} 5.0' in text
    assert 'switchyard_pd_prefill_seconds_count{model="m"} 2.0' in text
    assert 'switchyard_pd_kv_transfer_seconds_count{model="m"} 1.0' in text
    assert 'switchyard_path_requests_total{path="/v1/messages",status="200"} 2.0' in text


async def test_count_tokens_of_a_vllm_pd_model_runs_whole_on_the_decode(sims, gateway):
    """count_tokens generates nothing (no KV to move): it is served by the chosen decode whole."""
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])])
    c = anthropic_client(gw)
    raw = await c.messages.with_raw_response.count_tokens(model="m", messages=MSGS)
    assert raw.headers["x-pd-decision"] == "decode; reason=no_generation"
    assert raw.headers["target-pod"] == d.url.split("//")[1] and "prefill-target-pod" not in raw.headers
    counted = await raw.parse()
    msg = await c.messages.create(model="m", max_tokens=2, messages=MSGS)
    assert counted.input_tokens == msg.usage.input_tokens > 0
    ps, ds = await sim_state(p.url), await sim_state(d.url)
    assert legs(ps, COUNT) == [] and legs(ds, COUNT) == [{"model": "m", "messages": MSGS}]
    text = await gw.metrics_text()
    assert 'switchyard_pd_decisions_total{mode="decode",model="m",reason="no_generation"} 1.0' in text
    assert 'switchyard_path_requests_total{path="/v1/messages/count_tokens",status="200"} 1.0' in text


def _tool_turn(result: object) -> list[dict]:
    """A conversation whose last turn gives back a tool's result as ``result`` (a string, or a list
    of content blocks)."""
    return [{"role": "user", "content": "Read the routing table."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read_file",
                                               "input": {"path": "routes.txt"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result}]}]


async def test_a_tool_results_text_is_the_prompts_whether_a_string_or_text_blocks(sims, gateway):
    """A ``tool_result``'s content is a string or a list of content blocks, the same text to the
    engine (vLLM joins the text blocks into the tool message it renders; SGLang too): a long result
    is a long prompt either way, so the P/D rule for short prompts leaves both disaggregated."""
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)], pd={"disaggregate_min_prompt_tokens": 200})])
    c = anthropic_client(gw)
    table = "route 10.0.0.0/8 via the east gateway, metric 20\n" * 40        # ~2,000 characters
    for result in (table, [{"type": "text", "text": table}],
                   [{"type": "text", "text": table[:1000]}, {"type": "text", "text": table[1000:]}]):
        raw = await c.messages.with_raw_response.create(model="m", max_tokens=2, messages=_tool_turn(result))
        assert raw.headers["x-pd-decision"] == "disaggregated; reason=uncached", result
    raw = await c.messages.with_raw_response.create(model="m", max_tokens=2, messages=_tool_turn("42"))
    assert raw.headers["x-pd-decision"] == "decode; reason=short_prompt"


async def test_a_tool_calls_input_is_the_prompts(sims, gateway):
    """A ``tool_use`` block of an assistant turn is rendered as the call it was, its input as JSON
    (both engines make it a tool call whose arguments are that JSON): a call that wrote a long file
    makes a long prompt."""
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)], pd={"disaggregate_min_prompt_tokens": 200})])
    c = anthropic_client(gw)
    body = "route 10.0.0.0/8 via the east gateway, metric 20\n" * 40        # ~2,000 characters
    turn = [{"role": "user", "content": "Write the routing table."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "write_file",
                                               "input": {"path": "routes.txt", "content": body}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "written"}]}]
    raw = await c.messages.with_raw_response.create(model="m", max_tokens=2, messages=turn)
    assert raw.headers["x-pd-decision"] == "disaggregated; reason=uncached"


async def test_a_messages_requests_tools_count_in_its_prompt(sims, gateway):
    """The engine renders a Messages request's tools into the prompt it prefills (both engines make
    them the chat request's tools): a short question offering a dozen tools is not a short prompt."""
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)], pd={"disaggregate_min_prompt_tokens": 500})])
    c = anthropic_client(gw)
    tools = [{"name": f"lookup_route_{i}", "description": f"Look up route table {i} of the gateway fleet by prefix.",
              "input_schema": {"type": "object", "properties": {
                  "prefix": {"type": "string", "description": "an IPv4 prefix such as 10.0.0.0/8"},
                  "region": {"type": "string", "enum": ["east", "west", "north", "south"]}},
                  "required": ["prefix"]}} for i in range(12)]
    ask = [{"role": "user", "content": "Which route serves 10.1.2.3?"}]
    raw = await c.messages.with_raw_response.create(model="m", max_tokens=2, messages=ask, tools=tools)
    assert raw.headers["x-pd-decision"] == "disaggregated; reason=uncached"
    raw = await c.messages.with_raw_response.create(model="m", max_tokens=2, messages=ask, tools=tools[:1])
    assert raw.headers["x-pd-decision"] == "decode; reason=short_prompt"


async def test_an_sglang_pd_model_refuses_the_messages_api(sims, gateway):
    p, d = await pd_pair(sims, "sglang")
    gw = await gateway([pd_model("sglang", [roleset("sglang", p, d)])])
    path = MESSAGES
    r = await post(gw, {"model": "m", "max_tokens": 4, "messages": MSGS}, path=path)
    assert r.status == 400 and r.headers["x-error-routing"] == "true"
    err = orjson.loads(r.body)
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert "SGLang" in err["error"]["message"] and "bootstrap" in err["error"]["message"], err
    c = anthropic_client(gw)
    with pytest.raises(anthropic.BadRequestError):
        await c.messages.create(model="m", max_tokens=4, messages=MSGS)
    with pytest.raises(anthropic.BadRequestError):
        async with c.messages.stream(model="m", max_tokens=4, messages=MSGS) as stream:
            await stream.get_final_message()
    assert legs(await sim_state(p.url), path) == [] and legs(await sim_state(d.url), path) == []


async def test_count_tokens_of_an_sglang_pd_model_runs_whole_on_the_decode(sims, gateway):
    """count_tokens generates nothing: SGLang's handler renders the chat and counts its tokens,
    without the scheduler a decode-mode server refuses a request without a bootstrap room in, so
    the chosen decode answers it whole, as on a vLLM pair, although Messages themselves cannot pair
    on SGLang (above)."""
    p, d = await pd_pair(sims, "sglang")
    gw = await gateway([pd_model("sglang", [roleset("sglang", p, d)])])
    c = anthropic_client(gw)
    raw = await c.messages.with_raw_response.count_tokens(model="m", system="Be brief.", messages=MSGS)
    assert raw.headers["x-pd-decision"] == "decode; reason=no_generation"
    assert raw.headers["target-pod"] == d.url.split("//")[1] and "prefill-target-pod" not in raw.headers
    counted = await raw.parse()
    assert counted.input_tokens > 0
    ps, ds = await sim_state(p.url), await sim_state(d.url)
    assert legs(ps, COUNT) == [] and legs(ds, COUNT) == [{"model": "m", "system": "Be brief.", "messages": MSGS}]
    text = await gw.metrics_text()
    assert 'switchyard_pd_decisions_total{mode="decode",model="m",reason="no_generation"} 1.0' in text
    assert 'switchyard_path_requests_total{path="/v1/messages/count_tokens",status="200"} 1.0' in text


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prefill_failure_reaches_the_sdk_as_its_error_class(sims, gateway, stream):
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])])
    c = anthropic_client(gw)

    async def ask(fault: str) -> None:
        kw = {"model": "m", "max_tokens": 6, "messages": MSGS, "extra_headers": {"x-sim-fault": fault}}
        if stream:
            async with c.messages.stream(**kw) as s:
                async for _ in s.text_stream:
                    pass
        else:
            await c.messages.create(**kw)

    # the prefill engine overloaded (503, or 529): Anthropic's overload, a 529 the SDK retries, with
    # the wait an unsplit engine's 503 gets when the engine named none
    for status in (503, 529):
        with pytest.raises(anthropic.OverloadedError) as ei:
            await ask(f"prefill.status={status}")
        e = ei.value
        assert e.status_code == 529 and e.response.headers["x-error-pd-prefill"] == "http_status"
        assert e.body["type"] == "error" and e.body["error"]["type"] == "overloaded_error", e.body
        assert f"Simulated fault: HTTP {status}" in e.body["error"]["message"]
        assert e.response.headers["Retry-After"] == "5"
    # the prefill engine limiting its rate (429): Anthropic's rate_limit_error, not the pair's
    # failure, with the wait an unsplit engine's 429 gets when the engine named none
    with pytest.raises(anthropic.RateLimitError) as ei:
        await ask("prefill.status=429")
    e = ei.value
    assert e.status_code == 429 and e.response.headers["x-error-pd-prefill"] == "http_status"
    assert e.body["type"] == "error" and e.body["error"]["type"] == "rate_limit_error", e.body
    assert "Simulated fault: HTTP 429" in e.body["error"]["message"] and e.response.headers["Retry-After"] == "1"
    with pytest.raises(anthropic.InternalServerError) as ei:
        await ask("prefill.status=500")
    e = ei.value
    assert e.status_code == 502 and e.response.headers["x-error-pd-prefill"] == "http_status"
    assert e.body["type"] == "error" and e.body["error"]["type"] == "api_error", e.body
    with pytest.raises(anthropic.BadRequestError) as ei:
        await ask("prefill.status=400")
    assert ei.value.body["error"]["type"] == "invalid_request_error", ei.value.body
    assert ei.value.response.headers["x-error-pd-prefill"] == "http_status"
    # on chat the prefill's 503 stays the pair's 502 (docs/pd.md)
    chat = {"model": "m", "max_tokens": 4, "messages": MSGS}
    for status in (503, 429):
        async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/chat/completions", json=chat,
                                                        headers={"x-sim-fault": f"prefill.status={status}"}) as r:
            assert r.status == 502 and r.headers["x-error-pd-prefill"] == "http_status"
    assert (await sim_state(d.url))["counts"]["started"] == 0          # no decode leg at all
    text = await gw.metrics_text()
    assert 'switchyard_pd_prefill_failures_total{failure_class="http_status",model="m",stage="before_response"} 7.0' \
        in text
    assert 'switchyard_path_requests_total{path="/v1/messages",status="529"} 2.0' in text
    assert 'switchyard_path_requests_total{path="/v1/messages",status="429"} 1.0' in text


async def test_a_prefills_retry_after_reaches_the_sdk_with_its_overload(sims, gateway):
    """A prefill engine that answers 503 with its own Retry-After: the Messages client's 529 carries it."""
    async def busy(request: aiohttp.web.Request) -> aiohttp.web.Response:
        await request.read()
        return aiohttp.web.json_response({"error": {"message": "the queue is full", "type": "overloaded_error"}},
                                         status=503, headers={"Retry-After": "7"})

    d = await sims("vllm", "m", role="decode")
    async with fake_engine(busy, paths=(MESSAGES,)) as prefill:
        gw = await gateway([pd_model("vllm", [{"name": "rs-1", "prefill": [prefill], "decode": [d.url]}])])
        c = anthropic_client(gw)
        with pytest.raises(anthropic.OverloadedError) as ei:
            await c.messages.create(model="m", max_tokens=4, messages=MSGS)
    e = ei.value
    assert e.status_code == 529 and e.response.headers["Retry-After"] == "7"
    assert e.body["error"]["type"] == "overloaded_error" and "the queue is full" in e.body["error"]["message"]


async def test_a_decode_failure_after_headers_is_one_anthropic_error_event(sims, gateway):
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])])
    body = {"model": "m", "max_tokens": 20, "stream": True, "messages": MSGS}
    r = await post(gw, body, {"x-sim-fault": "decode.error_after=3"}, path=MESSAGES)
    assert r.status == 200
    frames = sse_frames(r.body)
    assert frames[0][0] == "message_start" and [n for n, _ in frames].count("error") == 1
    assert frames[-1] == ("error", {"type": "error", "error": {"type": "api_error", "message": frames[-1][1]["error"]
                                                              ["message"]}})
    assert sum(n == "content_block_delta" for n, _ in frames) == 3
    c = anthropic_client(gw)
    with pytest.raises(anthropic.APIStatusError):
        async with c.messages.stream(model="m", max_tokens=20, messages=MSGS,
                                     extra_headers={"x-sim-fault": "decode.error_after=3"}) as s:
            async for _ in s.text_stream:
                pass


async def test_a_kv_pull_that_fails_before_the_first_token_is_an_anthropic_502(sims, gateway):
    """vLLM's decode answers its head at once, then a failed KV pull as its Messages stream's first
    event (``internal_error``): nothing went to the client yet, so it is the pair's failure, retried
    on another pair if any, else an Anthropic-shaped 502, not a 200 stream holding only an error."""
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])])
    body = {"model": "m", "max_tokens": 6, "stream": True, "messages": MSGS}
    r = await post(gw, body, {"x-sim-fault": "decode.kv_pull_fail=1"}, path=MESSAGES)
    assert r.status == 502 and r.headers["x-error-pd-decode"] == "decode_error", (r.status, r.body)
    err = orjson.loads(r.body)
    assert err["type"] == "error" and err["error"]["type"] == "api_error"
    assert "before its first token" in err["error"]["message"]
    for url in (p.url, d.url):
        assert await wait_for(lambda url=url: quiet(url), timeout=5)


async def test_a_client_that_leaves_mid_stream_stops_the_decode(sims, gateway):
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])])
    body = {"model": "m", "max_tokens": 50, "stream": True, "messages": MSGS}
    async with aiohttp.ClientSession() as s:
        r = await s.post(gw.url + MESSAGES, json=body, headers={"x-sim-fault": "decode.stall_after=2:inf"})
        assert r.status == 200
        seen = b""
        while seen.count(b"event: content_block_delta") < 2:
            chunk = await asyncio.wait_for(r.content.readany(), 10)
            assert chunk
            seen += chunk
        r.close()
    assert await wait_for(lambda: quiet(d.url), timeout=10)
    counts = (await sim_state(d.url))["counts"]
    assert counts["aborted"] == 1 and counts["completed"] == 0


async def test_a_pd_messages_stream_of_a_model_with_migration_is_not_continued(sims, gateway):
    """Messages events are not rebuilt across legs: a P/D Messages stream whose decode dies on a
    model with migration_limit ends with one Anthropic error event, as without it, the decode's
    stream counted as refused."""
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)], migration_limit=2)])
    body = {"model": "m", "max_tokens": 20, "stream": True, "messages": MSGS}
    r = await post(gw, body, {"x-sim-fault": "decode.drop_after=3"}, path=MESSAGES)
    assert r.status == 200
    frames = sse_frames(r.body)
    assert frames[0][0] == "message_start" and [n for n, _ in frames].count("error") == 1
    assert frames[-1][0] == "error" and frames[-1][1]["error"]["type"] == "api_error", frames[-1]
    assert 'outcome="refused_api"' in await gw.metrics_text()


@pytest.mark.parametrize("path,body", [("/v1/responses", {"model": "m", "input": "Hi"}),
                                       ("/v1/rerank", {"model": "m", "query": "q", "documents": ["a"]})])
async def test_other_apis_are_still_refused_on_a_vllm_pd_model(sims, gateway, path, body):
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])])
    r = await post(gw, body, path=path)
    assert r.status == 400 and r.headers["x-error-routing"] == "true"
    assert "is not served by prefill/decode pairs" in orjson.loads(r.body)["error"]["message"]
    assert legs(await sim_state(p.url), path) == [] and legs(await sim_state(d.url), path) == []
