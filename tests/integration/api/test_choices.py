"""Requests of several choices (``n`` > 1) through the gateway with the openai SDK, against a
simulated vLLM that streams each choice in chunks of its own, interleaved: the request log's
finish reason and the inter-token latency histogram are one choice's, streamed or not."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from tests.support.factories import model_block
from tests.support.fake_engine import fake_engine
from tests.support.http import openai_client, post, sim_state
from tests.support.metrics import metric


async def _itl_count(gw) -> float:
    return metric(await gw.metrics_text(), "switchyard_inter_token_latency_seconds_count", model="m")


async def _prompt_whose_choices_end_apart(url: str) -> list[dict]:
    """A prompt whose choice 0 ends (EOS) while choice 1 is cut at max_tokens, asked of the engine."""
    async with aiohttp.ClientSession() as s:
        for k in range(200):
            messages = [{"role": "user", "content": f"Tell me about trains, take {k}."}]
            async with s.post(url + "/v1/chat/completions",
                              json={"model": "m", "messages": messages, "max_tokens": 5, "n": 2}) as r:
                got = [c["finish_reason"] for c in (await r.json())["choices"]]
            if got == ["stop", "length"]:
                return messages
    raise AssertionError("no prompt whose choice 0 stops and choice 1 is cut")


@pytest.mark.parametrize("stream", [False, True])
async def test_the_log_line_says_choice_0s_finish_and_every_choices(sims, gateway, stream):
    sim = await sims("vllm", "m", eos_probability=0.25)
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    messages = await _prompt_whose_choices_end_apart(sim.url)
    client = openai_client(gw)
    with gw.gw.request_log.capture() as logs:
        for n in (2, 1):
            if stream:
                got = {}
                async for chunk in await client.chat.completions.create(model="m", messages=messages, max_tokens=5,
                                                                        n=n, stream=True):
                    got.update({c.index: c.finish_reason for c in chunk.choices if c.finish_reason})
            else:
                r = await client.chat.completions.create(model="m", messages=messages, max_tokens=5, n=n)
                got = {c.index: c.finish_reason for c in r.choices}
            assert got == ({0: "stop", 1: "length"} if n == 2 else {0: "stop"})
    several, one = [e for e in logs if e["event"] == "request"]
    # choice 0's, as the whole answer's choices[0] is; the stream's last finish was choice 1's "length"
    assert several["finish_reason"] == "stop" and several["finish_reasons"] == ["stop", "length"]
    assert one["finish_reason"] == "stop" and "finish_reasons" not in one


async def test_inter_token_latency_is_choice_0s(sims, gateway):
    sim = await sims("vllm", "m", itl_ms=20.0)        # each step of the choices in reads of its own
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    client = openai_client(gw)
    messages = [{"role": "user", "content": "Tell me about trains."}]
    for n in (1, 2, 3):
        before = await _itl_count(gw)
        tokens: dict[int, int] = {}
        async for chunk in await client.chat.completions.create(model="m", messages=messages, max_tokens=5, n=n,
                                                                stream=True):
            for c in chunk.choices:
                if c.delta.content:
                    tokens[c.index] = tokens.get(c.index, 0) + 1
        assert tokens == dict.fromkeys(range(n), 5)
        # 5 tokens of choice 0: 4 gaps, not the gaps between every choice's chunks (up to 5n - 1)
        assert await _itl_count(gw) - before == 4
    await client.chat.completions.create(model="m", messages=messages, max_tokens=5, n=2)
    assert await _itl_count(gw) - before == 4       # a whole answer has no gaps
    text = await gw.metrics_text()
    assert 'switchyard_time_to_first_token_seconds_count{model="m"} 3.0' in text


def _chunk(index: int, content: str, finish: str | None = None) -> bytes:
    choice = {"index": index, "delta": {"content": content}, "logprobs": None, "finish_reason": finish}
    return b"data: " + orjson.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                                     "model": "m", "choices": [choice]}) + b"\n\n"


async def _choices_apart(request: web.Request) -> web.StreamResponse:
    """Two choices of 4 tokens, each chunk its own write, a pause between: the gateway reads the
    choices' chunks apart, as it may any engine's."""
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for step in range(4):
        for index in (0, 1):
            await resp.write(_chunk(index, f" w{step}", "length" if step == 3 else None))
            await asyncio.sleep(0.01)
    await resp.write(b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
                     b'"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":8,"total_tokens":11}}\n\n')
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def test_inter_token_latency_is_choice_0s_when_the_choices_come_apart(gateway):
    async with fake_engine(_choices_apart) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        client = openai_client(gw)
        with gw.gw.request_log.capture() as logs:
            seen = [c.index async for chunk in await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2, stream=True)
                for c in chunk.choices]
        assert seen == [0, 1] * 4
        # choice 0's 4 tokens: 3 gaps, where the 8 chunks of both made 7 (each a fraction of a token's time)
        assert await _itl_count(gw) == 3
        line = next(e for e in logs if e["event"] == "request")
        assert line["completion_tokens"] == 8 and line["finish_reason"] == "length"


def _completion_chunk(index: int, text: str, finish: str | None = None) -> bytes:
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
    return b"data: " + orjson.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                                     "choices": [choice]}) + b"\n\n"


async def _two_choices_of_a_batch(request: web.Request) -> web.StreamResponse:
    """Whatever the batch asked, two choices come, and the stream ends."""
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for index in (0, 1):
        await resp.write(_completion_chunk(index, " w", "length"))
    await resp.write(b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[],'
                     b'"usage":{"prompt_tokens":2,"completion_tokens":2,"total_tokens":4}}\n\n')
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def test_a_streamed_batchs_finishes_are_kept_for_the_choices_that_came(gateway):
    """A completion's batch of prompts times ``n`` may claim far more choices than any engine will
    stream (1000 prompts of 128 choices: 128,000): what the gateway keeps of their finishes, and
    writes in the log line, is the choices that came, not a slot for each claimed one."""
    async with fake_engine(_two_choices_of_a_batch, paths=("/v1/completions",)) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        client = openai_client(gw)
        with gw.gw.request_log.capture() as logs:
            got = [c.index async for chunk in await client.completions.create(
                model="m", prompt=["once", "upon"] * 500, max_tokens=1, n=128, stream=True) for c in chunk.choices]
        assert got == [0, 1]
        line = next(e for e in logs if e["event"] == "request")
        assert line["status"] == 200 and line["finish_reason"] == "length"
        assert line["finish_reasons"] == ["length", "length"]


ALICE = "sk-alice-choices-0123"
MSGS = [{"role": "user", "content": "Tell me about trains."}]


async def test_a_fan_out_past_128_or_below_1_is_refused_before_routing(sims, gateway):
    """``n`` asks the engine for that many sequences. OpenAI's API takes it from 1 to 128, and so
    does the gateway: out of it, a 400 in
    OpenAI's shape naming the field, before the request is routed. The engine sees nothing and the
    user's limits are not charged."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth={"api_keys": [{"key": ALICE, "user": "alice"}]},
                       limits={"users": {"alice": {"rpm": 5}}})
    client = openai_client(gw, ALICE)
    chat, completions = client.chat.completions.create, client.completions.create
    prompt = "Once upon a time"
    refused = [     # (the field named, what its message says, the call's arguments)
        ("n", "128", chat, {"messages": MSGS, "n": 129, "stream": True}),
        ("n", "128", chat, {"messages": MSGS, "n": 1_000_000}),
        ("n", "128", chat, {"messages": MSGS, "extra_body": {"n": "1000000"}}),
        ("n", "at least 1", chat, {"messages": MSGS, "n": 0}),
        ("n", "at least 1", chat, {"messages": MSGS, "n": -1}),
        ("n", "128", completions, {"prompt": prompt, "n": 1_000_000}),
        ("n", "at least 1", completions, {"prompt": prompt, "n": 0}),
    ]
    for param, says, create, args in refused:
        with pytest.raises(openai.BadRequestError) as ei:
            await create(model="m", max_tokens=1, **args)
        err = ei.value
        assert err.status_code == 400 and err.param == param and err.type == "invalid_request_error", err.body
        assert says in err.message, err.message
    received = (await sim_state(sim.url))["received"]
    assert not [r for r in received if r["method"] == "POST"], received
    # none was charged to alice's 5 requests a minute: the bounds themselves are served
    raw = await client.chat.completions.with_raw_response.create(model="m", messages=MSGS, max_tokens=1, n=128)
    assert len(raw.parse().choices) == 128 and raw.headers["x-ratelimit-remaining-requests"] == "4"
    got = await completions(model="m", prompt=prompt, max_tokens=1, n=1, best_of=1)
    assert len(got.choices) == 1
    for best_of in (1, None):       # null is "not set", to vLLM's Optional[int]
        got = await chat(model="m", messages=MSGS, max_tokens=1, extra_body={"best_of": best_of})
        assert len(got.choices) == 1


async def test_best_of_which_the_engines_ignore_is_passed_on_unread_and_uncharged(sims, gateway):
    """``best_of`` is in neither engine's sampling now: vLLM (V1) dropped it from its requests
    (their extra fields are ignored, whatever the value), SGLang's completions take it as an
    ``Optional[int]`` they never use. The gateway neither refuses it (it answered a 400 no engine
    gives for 0, -5, past 128, and for a value that is not an integer, which vLLM ignores too), nor
    counts sequences no engine generates in admission's reservation (n=1 and best_of=5 of 20 tokens
    were reserved as 5 x 20 output tokens); the engine gets the field as the client sent it."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    client = openai_client(gw)
    chat, completions = client.chat.completions.create, client.completions.create
    values = [0, -5, 1_000_000, "129", 2.5, [2], "two", 5]
    for v in values:
        got = await completions(model="m", prompt="Once upon a time", max_tokens=1, extra_body={"best_of": v})
        assert len(got.choices) == 1, v
        got = await chat(model="m", messages=MSGS, max_tokens=1, extra_body={"best_of": v})
        assert len(got.choices) == 1, v
    stream = await chat(model="m", messages=MSGS, max_tokens=2, stream=True, extra_body={"best_of": 0})
    assert [c async for c in stream]
    sent = [r["body"].get("best_of") for r in (await sim_state(sim.url))["received"] if r["method"] == "POST"]
    assert sent == [v for v in values for _ in range(2)] + [0]
    # what admission reserves for n=1, best_of=5: one sequence's output, as for n=1 alone
    from gateway.admission.service import expected_output
    from gateway.request import CHAT, parse
    ireq = parse(CHAT, orjson.dumps({"model": "m", "messages": MSGS, "max_tokens": 20, "best_of": 5}), {}, "r")
    assert (ireq.fan, ireq.sequences, expected_output(ireq)) == (1, 1, 20)
    ireq = parse(CHAT, orjson.dumps({"model": "m", "messages": MSGS, "max_tokens": 20, "n": 2, "best_of": 1}), {}, "r")
    assert (ireq.fan, ireq.sequences, expected_output(ireq)) == (2, 2, 40)

async def test_a_broken_stream_of_several_choices_with_usage_on_every_chunk_counts_every_choice(sims, gateway):
    """vLLM's (and SGLang's) usage on every chunk of a stream of several choices is that chunk's
    choice's: a stream the engine breaks before its final usage is counted as every choice's last
    usage together, not as the one choice whose chunk came last."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    payload = {"model": "m", "messages": MSGS, "max_tokens": 20, "n": 3, "stream": True, "ignore_eos": True,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with gw.gw.request_log.capture() as logs:
        r = await post(gw.url, payload, {"x-sim-fault": "drop_after=4"})
    assert r.status == 200
    events = [orjson.loads(line[6:]) for line in r.body.decode().split("\n\n") if line.startswith("data: {")]
    tokens = [0, 0, 0]
    for e in events:
        for c in e.get("choices") or ():
            if c.get("delta", {}).get("content"):
                tokens[c["index"]] += 1
    assert not any(e.get("choices") == [] for e in events)     # no final usage came
    last = {c["index"]: e["usage"] for e in events if e.get("usage") for c in e["choices"]}
    assert sorted(last) == [0, 1, 2] and [last[i]["completion_tokens"] for i in range(3)] == tokens
    line = next(e for e in logs if e["event"] == "request")
    assert line["completion_tokens"] == sum(tokens) and line["prompt_tokens"] == last[0]["prompt_tokens"]
    text = await gw.metrics_text()
    assert metric(text, "switchyard_completion_tokens_total", model="m") == sum(tokens)
