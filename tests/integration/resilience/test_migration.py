"""Mid-stream continuation on loopback: a stream whose engine dies goes on elsewhere, and its
content is the unbroken run's, byte for byte (enginesim is deterministic in its context)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from aiohttp import web

from tests.support.factories import model_block
from tests.support.fake_engine import fake_engine
from tests.support.http import openai_client, sim_state, sse_events
from tests.support.tenancy import ALICE, KEYS
from tests.support.waiting import until, wait_for

MSG = [{"role": "user", "content": "tell me a long story about gateways"}]


async def raw_post(url: str, path: str, payload: dict, headers: dict | None = None) -> tuple[int, list]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=payload, headers=headers or {}) as r:
        return r.status, sse_events(await r.read())


def text_of(events: list, chat: bool = True) -> str:
    out = []
    for e in events:
        if isinstance(e, dict) and e.get("choices"):
            c = e["choices"][0]
            out.append((c.get("delta") or {}).get("content") or "" if chat else c.get("text") or "")
    return "".join(out)


async def setup(sims, gateway, engine: str, fault: str, limit: int = 1, healthy: int = 1, **sim_kw):
    """A model on a faulty endpoint (listed first: round-robin sends the first stream to it) and
    ``healthy`` good ones; returns (gateway, a healthy sim for the reference run)."""
    bad = await sims(engine, "m", fault=fault, **sim_kw)
    good = [await sims(engine, "m", **sim_kw) for _ in range(healthy)]
    gw = await gateway([model_block("m", engine, [bad.url] + [g.url for g in good], strategy="round-robin",
                                    migration_limit=limit)])
    return gw, (good[0] if good else bad)


async def two_words_then_break(request: web.Request, cid: str, end: bytes, extra) -> web.StreamResponse:
    """A vLLM-like stream of " alpha", " beta" (the first chunk with prompt_token_ids), each event
    ended by ``end``, then a reset. ``extra(i)``: fields for chunk ``i`` (``token_ids`` go in its
    choice, anything else in the chunk)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i, word in enumerate([" alpha", " beta"]):
        choice = {"index": 0, "delta": {"content": word}, "logprobs": None, "finish_reason": None}
        ev = {"id": cid, "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}
        for k, v in extra(i).items():
            (choice if k == "token_ids" else ev)[k] = v
        if i == 0:
            ev["prompt_token_ids"] = [1, 2, 3]
        await resp.write(b"data: " + json.dumps(ev).encode() + end)
    request.transport.abort()
    return resp


def migrations(text: str, outcome: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith("switchyard_migrations_total{") and f'outcome="{outcome}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def recording_relay(url: str, sent: list[dict]):
    """A fake engine's handler standing for a continuation's engine: it keeps the body it is sent
    in ``sent`` and streams back the answer of the real engine at ``url``."""

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        sent.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        async with aiohttp.ClientSession() as s, s.post(url + request.path, json=body) as r:
            async for chunk in r.content.iter_any():
                await resp.write(chunk)
        await resp.write_eof()
        return resp

    return relay


@pytest.mark.parametrize("engine,fault", [("vllm", "drop_after=7"), ("vllm", "error_after=7"),
                                          ("sglang", "drop_after=7"), ("sglang", "error_after=7")])
async def test_chat_stream_continues_and_matches_an_unbroken_run(sims, gateway, engine, fault):
    gw, good = await setup(sims, gateway, engine, fault)
    req = {"model": "m", "messages": MSG, "max_tokens": 30, "stream": True}
    _, ref = await raw_post(good.url, "/v1/chat/completions", {**req, "stream_options": {"include_usage": True}})
    client = openai_client(gw)
    stream = await client.chat.completions.create(**req, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    await client.close()
    got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert got == text_of(ref) and len(got) > 0
    assert len({c.id for c in chunks}) == 1                       # one stream, one id
    # a token-exact continuation's legs are completions: its usage chunk was a "text_completion"
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.role) == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1                                        # one usage block, both legs
    ref_usage = next(e["usage"] for e in ref if isinstance(e, dict) and e.get("usage"))
    assert usage[0].completion_tokens == ref_usage["completion_tokens"] == 30
    assert usage[0].prompt_tokens == ref_usage["prompt_tokens"]
    assert migrations(await gw.metrics_text(), "continued") == 1


async def test_chat_without_max_tokens_continues_to_where_the_unbroken_answer_ends(sims, gateway):
    """A chat that names no length runs to the rest of the context on vLLM. Its token-exact
    continuation is a completion, whose own default is 16 tokens, so it must carry an explicit
    null: without it the answer was cut at 16 more tokens with finish_reason "length"."""
    gw, good = await setup(sims, gateway, "vllm", "drop_after=3", max_model_len=64, rest_of_context=True)
    req = {"model": "m", "messages": MSG, "stream": True}
    _, ref = await raw_post(good.url, "/v1/chat/completions", {**req, "stream_options": {"include_usage": True}})
    ref_usage = next(e["usage"] for e in ref if isinstance(e, dict) and e.get("usage"))
    assert ref_usage["completion_tokens"] > 3 + 16                # long enough to tell the two apart
    client = openai_client(gw)
    stream = await client.chat.completions.create(**req, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    await client.close()
    got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert got == text_of(ref)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage[0].completion_tokens == ref_usage["completion_tokens"]
    assert usage[0].prompt_tokens + usage[0].completion_tokens == 64     # the whole context, as unbroken
    assert migrations(await gw.metrics_text(), "continued") == 1


async def test_completion_stream_continues_token_exactly_without_usage_asked(sims, gateway):
    gw, good = await setup(sims, gateway, "vllm", "drop_after=5")
    req = {"model": "m", "prompt": "Once upon a time", "max_tokens": 25, "stream": True}
    _, ref = await raw_post(good.url, "/v1/completions", req)
    st, got = await raw_post(gw.url, "/v1/completions", req)
    assert st == 200 and got[-1] == "[DONE]"
    assert text_of(got, chat=False) == text_of(ref, chat=False)
    assert not any(isinstance(e, dict) and ("usage" in e or "token_ids" in e["choices"][0]) for e in got[:-1])
    metrics = await gw.metrics_text()
    assert 'switchyard_completion_tokens_total{model="m"} 25.0' in metrics



@pytest.mark.parametrize("stop", [None, ["@"]])
async def test_a_completion_with_max_tokens_null_continues_to_the_rest_of_the_context(sims, gateway, stop):
    """vLLM reads a completion's explicit "max_tokens": null as the rest of the context (only a
    missing key is its default of 16). The continuation took the null for the missing key: the
    answer was cut 16 tokens after its start with finish_reason "length", token-exact or as text."""
    gw, good = await setup(sims, gateway, "vllm", "drop_after=3", max_model_len=64, rest_of_context=True)
    req = {"model": "m", "prompt": "Once upon a time", "max_tokens": None, "stream": True,
           "stream_options": {"include_usage": True}, **({"stop": stop} if stop else {})}
    _, ref = await raw_post(good.url, "/v1/completions", req)
    ref_usage = next(e["usage"] for e in ref if isinstance(e, dict) and e.get("usage"))
    assert ref_usage["completion_tokens"] > 16                    # long enough to tell the two apart
    st, got = await raw_post(gw.url, "/v1/completions", req)
    assert st == 200 and got[-1] == "[DONE]", got[-2:]
    usage = next(e["usage"] for e in got if isinstance(e, dict) and e.get("usage"))
    assert usage["completion_tokens"] == ref_usage["completion_tokens"]
    if not stop:                                                  # text is faithful up to the seam
        assert text_of(got, chat=False) == text_of(ref, chat=False)
    assert migrations(await gw.metrics_text(), "continued") == 1

@pytest.mark.parametrize("fault", ["none", "drop_after=5"])
async def test_continuous_usage_stats_are_counted_once(sims, gateway, fault):
    """A client asking for usage on every chunk receives it in every event the gateway re-encodes;
    the stream's tokens were counted both from the legs' sum and from what the client received."""
    gw, _ = await setup(sims, gateway, "vllm", fault)
    req = {"model": "m", "messages": MSG, "max_tokens": 20, "stream": True,
           "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    st, got = await raw_post(gw.url, "/v1/chat/completions", req)
    assert st == 200 and got[-1] == "[DONE]"
    final = [e["usage"] for e in got if isinstance(e, dict) and e.get("usage")][-1]
    assert final["completion_tokens"] == 20
    metrics = await gw.metrics_text()
    assert 'switchyard_completion_tokens_total{model="m"} 20.0' in metrics
    assert f'switchyard_prompt_tokens_total{{model="m"}} {float(final["prompt_tokens"])}' in metrics


@pytest.mark.parametrize("fault", ["none", "drop_after=5"])
async def test_sglangs_continuous_usage_stats_asked_alone_ride_on_every_chunk(sims, gateway, fault):
    """SGLang reads continuous_usage_stats apart from include_usage: asked alone, every chunk carries
    the usage and no usage chunk ends the stream. A continued stream's client gets the same, the
    usage counting every leg's tokens."""
    gw, good = await setup(sims, gateway, "sglang", fault)
    req = {"model": "m", "messages": MSG, "max_tokens": 20, "stream": True,
           "stream_options": {"continuous_usage_stats": True}}
    _, ref = await raw_post(good.url, "/v1/chat/completions", req)
    st, got = await raw_post(gw.url, "/v1/chat/completions", req)
    assert st == 200 and got[-1] == "[DONE]"
    assert all(e["choices"] for e in ref[:-1]) and all("usage" in e for e in ref[:-1])     # the engine's
    assert all(e["choices"] for e in got[:-1]) and all("usage" in e for e in got[:-1])
    assert got[-2]["usage"]["completion_tokens"] == 20
    assert 'switchyard_completion_tokens_total{model="m"} 20.0' in await gw.metrics_text()


ERROR = {"message": "boom", "type": "InternalServerError", "code": 500}


@pytest.mark.parametrize("end", ["reset", "stall", "error", "error_text"])
async def test_an_answer_whose_finish_reason_came_is_not_continued(sims, gateway, end):
    """The engine sent the chunk carrying finish_reason, then broke (or stalled past the idle
    watchdog, or sent an error event of its own) before [DONE]: the answer is whole. It was
    continued on another engine, so the client got a finish_reason "stop", more text, and a second
    finish_reason (after an error event, still so until now). An error event after the finish
    reaches the client as the plain relay passes it, and is the request's error, as there."""
    async def chat(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, (word, fin) in enumerate([(" alpha", None), (" beta", "stop")]):
            ev = {"id": "chatcmpl-f", "object": "chat.completion.chunk", "created": 1, "model": "m",
                  "choices": [{"index": 0, "delta": {"content": word}, "logprobs": None, "finish_reason": fin,
                               "token_ids": [100 + i]}],
                  "usage": {"prompt_tokens": 3, "completion_tokens": i + 1, "total_tokens": 4 + i}}
            if i == 0:
                ev["prompt_token_ids"] = [1, 2, 3]
            await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
        if end == "reset":
            request.transport.abort()
        elif end.startswith("error"):
            await resp.write(b"data: " + json.dumps({"error": ERROR if end == "error" else "boom"}).encode() + b"\n\n"
                             b"data: [DONE]\n\n")
            await resp.write_eof()
        else:       # stalled until the gateway's watchdog leaves (bounded: 10 s)
            for _ in range(200):
                if request.transport is None or request.transport.is_closing():
                    break
                await asyncio.sleep(0.05)
        return resp

    good = await sims("vllm", "m")
    async with fake_engine(chat) as bad:
        gw = await gateway([model_block("m", "vllm", [bad, good.url], strategy="round-robin", migration_limit=1,
                                        watchdog={"idle_timeout_s": 0.5, "aggregated": True})])
        with gw.gw.request_log.capture() as logs:
            st, got = await raw_post(gw.url, "/v1/chat/completions",
                                     {"model": "m", "messages": MSG, "max_tokens": 20, "stream": True})
            await until(lambda: any(e["event"] == "request" for e in logs))
    assert st == 200 and got[-1] == "[DONE]", got[-2:]
    assert text_of(got) == " alpha beta"
    fins = [e["choices"][0]["finish_reason"] for e in got if isinstance(e, dict) and e.get("choices")
            and e["choices"][0].get("finish_reason")]
    assert fins == ["stop"]
    assert migrations(await gw.metrics_text(), "continued") == 0
    assert (await sim_state(good.url))["counts"]["started"] == 0
    if end.startswith("error"):
        # the engine's numeric code comes as its string, as OpenAI's error object has it
        assert got[-2] == {"error": {**ERROR, "code": str(ERROR["code"])} if end == "error" else "boom"}
        line = next(e for e in logs if e["event"] == "request")
        assert (line["status"], line["error_class"], line["error"]) == (200, "upstream_stream_error", "boom")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_a_stream_that_broke_with_all_its_max_tokens_ends_there(sims, gateway, engine, kind):
    """The engine generated the request's max_tokens and broke before the chunk with its
    finish_reason (SGLang sends that chunk on its own, after the last token's): the answer has all
    its tokens, and ends as the engine would have ended it, with finish_reason "length", no other
    engine asked. It was continued with max_tokens 1, so the client got a token more than it asked."""
    chat = kind == "chat"

    async def answer(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, word in enumerate([" alpha", " beta"]):
            choice = {"index": 0, "logprobs": None, "finish_reason": None,
                      **({"delta": {"content": word}} if chat else {"text": word})}
            ev = {"id": "cmpl-x", "object": "chat.completion.chunk" if chat else "text_completion",
                  "created": 1, "model": "m", "choices": [choice],
                  "usage": {"prompt_tokens": 3, "completion_tokens": i + 1, "total_tokens": 4 + i}}
            if engine == "vllm":
                choice["token_ids"] = [100 + i]
                if i == 0:
                    (ev if chat else choice)["prompt_token_ids"] = [1, 2, 3]
            await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
        request.transport.abort()
        return resp

    good = await sims(engine, "m")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": "m", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True},
            **({"messages": MSG} if chat else {"prompt": "tell me a story"})}
    async with fake_engine(answer, paths=(path,)) as bad:
        gw = await gateway([model_block("m", engine, [bad, good.url], strategy="round-robin", migration_limit=1)])
        with gw.gw.request_log.capture() as logs:
            st, got = await raw_post(gw.url, path, body)
            await until(lambda: any(e["event"] == "request" for e in logs))
    assert st == 200 and got[-1] == "[DONE]", got[-3:]
    assert text_of(got, chat) == " alpha beta"
    assert [e["choices"][0]["finish_reason"] for e in got if isinstance(e, dict) and e.get("choices")
            and e["choices"][0].get("finish_reason")] == ["length"]
    assert len({e["id"] for e in got if isinstance(e, dict)}) == 1
    usage = [e["usage"] for e in got if isinstance(e, dict) and e.get("usage")]
    assert [(u["prompt_tokens"], u["completion_tokens"]) for u in usage] == [(3, 2)]
    assert (await sim_state(good.url))["counts"]["started"] == 0
    line = next(e for e in logs if e["event"] == "request")
    assert line["status"] == 200 and line.get("error_class") is None and line["completion_tokens"] == 2
    assert line["finish_reason"] == "length"
    assert [(m["reason"], m["outcome"], m["tokens"]) for m in line["migrations"]] == [("broken", "length", 2)]
    assert migrations(await gw.metrics_text(), "length") == 1
    breakers = gw.gw.gen.services.breakers
    assert {ep.url: breakers.describe(ep)["consecutive_faults"] for ep in gw.gw.pool.endpoints()} == {
        bad: 1, good.url: 0}      # the engine broke all the same


async def test_a_continuation_that_broke_with_all_its_max_tokens_sends_what_it_held_at_the_seam(gateway):
    """SGLang, a stop string: the continuation's " be" could begin "a be!" with the " alpha" the
    client had, so it was held at the seam; the continuation then broke with the answer's
    max_tokens generated. Its engine would have ended with that text and finish_reason "length":
    the held text is the answer's end. It was dropped."""
    def leg(words: list[str], before: int):
        async def chat(request: web.Request) -> web.StreamResponse:
            await request.read()
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i, word in enumerate(words):
                ev = {"id": "s", "object": "chat.completion.chunk", "created": 1, "model": "m",
                      "choices": [{"index": 0, "delta": {"content": word}, "logprobs": None, "finish_reason": None,
                                   "matched_stop": None}],
                      "usage": {"prompt_tokens": 3 + before, "completion_tokens": i + 1, "total_tokens": 4 + before + i}}
                await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
            request.transport.abort()
            return resp
        return chat

    async with fake_engine(leg([" alpha"], 0)) as first, fake_engine(leg([" be"], 1)) as second:
        gw = await gateway([model_block("m", "sglang", [first, second], strategy="round-robin", migration_limit=2)])
        st, got = await raw_post(gw.url, "/v1/chat/completions", {"model": "m", "messages": MSG, "max_tokens": 2,
                                                                   "stop": ["a be!"], "stream": True})
    assert st == 200 and got[-1] == "[DONE]", got[-3:]
    assert text_of(got) == " alpha be"
    assert [e["choices"][0]["finish_reason"] for e in got if isinstance(e, dict) and e.get("choices")
            and e["choices"][0].get("finish_reason")] == ["length"]


async def test_a_continued_streams_completion_details_count_every_leg(gateway):
    """SGLang, usage on every chunk: each leg reports the reasoning tokens among those it generated
    (vLLM's place, ``completion_tokens_details``, and SGLang's own, beside ``prompt_tokens``). The
    final usage sums them over the legs as it sums ``completion_tokens``, and so does the usage on
    the chunks of a client that asked for it on every chunk. They were the last leg's alone."""
    def leg(words: list[str], before: int, reasoning: list[int], whole: bool):
        async def chat(request: web.Request) -> web.StreamResponse:
            await request.read()
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            usage = {}
            for i, word in enumerate(words):
                usage = {"prompt_tokens": 3 + before, "completion_tokens": i + 1, "total_tokens": 4 + before + i,
                         "reasoning_tokens": reasoning[i], "completion_tokens_details": {"reasoning_tokens": reasoning[i]}}
                ev = {"id": "s", "object": "chat.completion.chunk", "created": 1, "model": "m",
                      "choices": [{"index": 0, "delta": {"content": word}, "logprobs": None, "finish_reason": None,
                                   "matched_stop": None}], "usage": usage}
                await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
            if not whole:
                request.transport.abort()
                return resp
            fin = {"id": "s", "object": "chat.completion.chunk", "created": 1, "model": "m",
                   "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length",
                                "matched_stop": None}], "usage": usage}
            last = {"id": "s", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
                    "usage": usage}
            for ev in (fin, last):
                await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return chat

    async with fake_engine(leg([" alpha", " beta"], 0, [1, 2], False)) as first, \
            fake_engine(leg([" gamma"], 2, [1], True)) as second:
        gw = await gateway([model_block("m", "sglang", [first, second], strategy="round-robin", migration_limit=1)])
        body = {"model": "m", "messages": MSG, "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        with gw.gw.request_log.capture() as logs:
            st, got = await raw_post(gw.url, "/v1/chat/completions", body)
            await until(lambda: any(e["event"] == "request" for e in logs))
    assert st == 200 and got[-1] == "[DONE]", got[-3:]
    assert text_of(got) == " alpha beta gamma"
    usage = [e["usage"] for e in got if isinstance(e, dict) and e.get("usage")]
    final = usage[-1]
    assert (final["prompt_tokens"], final["completion_tokens"], final["total_tokens"]) == (3, 3, 6)
    assert final["completion_tokens_details"] == {"reasoning_tokens": 3}
    assert final["reasoning_tokens"] == 3
    # on every chunk too: the reasoning tokens of the legs before and the current one's so far
    assert [u["completion_tokens_details"]["reasoning_tokens"] for u in usage[:3]] == [1, 2, 3]
    line = next(e for e in logs if e["event"] == "request")
    assert (line["prompt_tokens"], line["completion_tokens"]) == (3, 3)

async def test_a_stream_whose_chunks_carry_no_token_ids_is_not_continued_from_its_prompt(sims, gateway):
    """vLLM sends prompt_token_ids on the first chunk but no token_ids on any chunk while its
    reasoning parser hides the reasoning (include_reasoning false on the server's side): continued
    token-exactly, the next engine got the prompt alone and started the answer over after text the
    client had. Such a stream is refused (no_token_ids) and ends with today's error event."""
    async def chat(request: web.Request) -> web.StreamResponse:
        return await two_words_then_break(request, "chatcmpl-h", b"\n\n", lambda i: {
            "usage": {"prompt_tokens": 3, "completion_tokens": 5 * (i + 1), "total_tokens": 8 + 5 * i}})

    good = await sims("vllm", "m")
    async with fake_engine(chat) as bad:
        gw = await gateway([model_block("m", "vllm", [bad, good.url], strategy="round-robin", migration_limit=1)])
        st, got = await raw_post(gw.url, "/v1/chat/completions",
                                 {"model": "m", "messages": MSG, "max_tokens": 20, "stream": True})
    assert st == 200 and isinstance(got[-1], dict) and "error" in got[-1], got[-2:]
    assert text_of(got) == " alpha beta"
    assert migrations(await gw.metrics_text(), "refused_no_token_ids") == 1
    assert (await sim_state(good.url))["counts"]["started"] == 0


async def test_a_tool_call_broken_mid_arguments_is_not_continued(sims, gateway):
    """A tool call's arguments already streamed cannot be continued (the next engine's tool parser
    would start a call of its own): the OpenAI SDK's stream raises on the error event after the
    arguments it had, and the refusal is counted, the other engine never asked."""
    async def chat(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        deltas = [{"role": "assistant", "content": ""},
                  {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                   "function": {"name": "get", "arguments": ""}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}]
        for i, delta in enumerate(deltas):
            ev = {"id": "chatcmpl-t", "object": "chat.completion.chunk", "created": 1, "model": "m",
                  "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None,
                               "token_ids": [100 + i]}],
                  "usage": {"prompt_tokens": 3, "completion_tokens": i + 1, "total_tokens": 4 + i}}
            if i == 0:
                ev["prompt_token_ids"] = [1, 2, 3]
            await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
        request.transport.abort()
        return resp

    good = await sims("vllm", "m")
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object", "properties": {}}}}]
    async with fake_engine(chat) as bad:
        gw = await gateway([model_block("m", "vllm", [bad, good.url], strategy="round-robin", migration_limit=1)])
        client = openai_client(gw)
        stream = await client.chat.completions.create(model="m", messages=MSG, tools=tools, max_tokens=20, stream=True)
        args = []
        with pytest.raises(openai.APIError, match="broke mid-stream"):
            async for c in stream:
                args += [t.function.arguments for t in (c.choices[0].delta.tool_calls or []) if t.function]
    assert "".join(a or "" for a in args) == '{"ci'
    assert migrations(await gw.metrics_text(), "refused_tool_calls") == 1
    assert (await sim_state(good.url))["counts"]["started"] == 0


async def test_include_reasoning_false_is_refused_up_front(sims, gateway):
    """Its reasoning is hidden by the engine's parser, which a continuation (a completion) would not run."""
    gw, _ = await setup(sims, gateway, "vllm", "drop_after=4")
    st, got = await raw_post(gw.url, "/v1/chat/completions", {"model": "m", "messages": MSG, "max_tokens": 30,
                                                              "stream": True, "include_reasoning": False})
    assert st == 200 and isinstance(got[-1], dict) and "error" in got[-1]
    assert migrations(await gw.metrics_text(), "refused_reasoning") == 1


async def test_stop_strings_continue_as_text_on_vllm(sims, gateway):
    gw, good = await setup(sims, gateway, "vllm", "drop_after=6")
    req = {"model": "m", "messages": MSG, "max_tokens": 30, "stream": True, "stop": ["@"]}
    _, ref = await raw_post(good.url, "/v1/chat/completions", req)
    st, got = await raw_post(gw.url, "/v1/chat/completions", req)
    assert text_of(got) == text_of(ref) and got[-1] == "[DONE]"


@pytest.mark.parametrize("engine,fault,phase", [("vllm", "stall_after=4:inf", "idle"),
                                                 ("sglang", "stall_after=4:inf", "idle"),
                                                 ("vllm", "stall_before_first=inf", "first_chunk")])
async def test_a_watchdog_fire_that_is_continued_is_counted_as_the_watchdogs(sims, gateway, engine, fault, phase):
    """The watchdog cut a leg (an engine gone silent mid-stream, or a vLLM stream, whose head came
    at once, silent before its first token) and the stream went on on another engine: the fire is
    the watchdog's as any other (docs/resilience.md), counted in switchyard_watchdog_fires_total,
    its phase the reason of the log line's migrations entry, and the silent engine is let go. A
    continued stream's fire was counted nowhere."""
    bad = await sims(engine, "m", fault=fault)
    good = await sims(engine, "m")
    gw = await gateway([model_block("m", engine, [bad.url, good.url], strategy="round-robin", migration_limit=1,
                                    watchdog={"idle_timeout_s": 0.3, "first_chunk_timeout_s": 0.3,
                                              "aggregated": True})])
    req = {"model": "m", "messages": MSG, "max_tokens": 20, "stream": True}
    _, ref = await raw_post(good.url, "/v1/chat/completions", req)
    with gw.gw.request_log.capture() as logs:
        st, got = await raw_post(gw.url, "/v1/chat/completions", req)
        await until(lambda: any(e["event"] == "request" for e in logs))
    assert st == 200 and got[-1] == "[DONE]", got[-2:]
    assert text_of(got) == text_of(ref)
    line = next(e for e in logs if e["event"] == "request")
    assert [m["reason"] for m in line["migrations"]] == [f"{phase}_timeout"]
    text = await gw.metrics_text()
    assert migrations(text, "continued") == 1
    assert f'switchyard_watchdog_fires_total{{model="m",phase="{phase}"}} 1.0' in text
    await until(lambda: _quiet(bad.url))


async def _quiet(url: str) -> bool:
    return not (await sim_state(url))["running"]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("others", ["another", "none"])
async def test_a_continuation_whose_engine_is_silent_before_its_first_token_is_the_watchdogs_fire(
        sims, gateway, engine, others):
    """The engine that took a continuation was silent past the first-chunk bound before its first
    token: the watchdog's fire on that leg (docs/resilience.md), whether its head came at once
    (vLLM) or comes with its first token (SGLang). It is counted as the watchdog's, the broken leg
    was continued and the silent one has its own migrations entry; the stream goes on on another
    endpoint when one is left, else it ends with the watchdog's error event, its endpoint the silent
    one's, each breaker told once. An SGLang continuation's silence was taken for a header timeout:
    the stream ended with the first break's error event, another endpoint left untried, and the
    fire counted nowhere."""
    bad = await sims(engine, "m", fault="drop_after=5")
    silent = await sims(engine, "m", fault="stall_before_first=inf")
    good = [await sims(engine, "m")] if others == "another" else []
    # round-robin: the first leg goes to the first endpoint, the continuation to the last
    gw = await gateway([model_block("m", engine, [bad.url] + [g.url for g in good] + [silent.url],
                                    strategy="round-robin", migration_limit=2,
                                    watchdog={"first_chunk_timeout_s": 0.5, "aggregated": True})],
                       health={"enabled": False})
    req = {"model": "m", "messages": MSG, "max_tokens": 20, "stream": True}
    with gw.gw.request_log.capture() as logs:
        st, got = await raw_post(gw.url, "/v1/chat/completions", req)
        await until(lambda: any(e["event"] == "request" for e in logs))
    line = next(e for e in logs if e["event"] == "request")
    entries = [(m["reason"], m["outcome"], m["endpoint"]) for m in line["migrations"]]
    assert entries[0] == ("broken", "continued", bad.url[7:])
    assert entries[1][:1] + entries[1][2:] == ("first_chunk_timeout", silent.url[7:])
    text = await gw.metrics_text()
    assert 'switchyard_watchdog_fires_total{model="m",phase="first_chunk"} 1.0' in text
    if good:
        _, ref = await raw_post(good[0].url, "/v1/chat/completions", req)
        assert st == 200 and got[-1] == "[DONE]" and text_of(got) == text_of(ref)
        assert entries[1][1] == "continued" and len(entries) == 2
    else:
        assert st == 200 and got[-1]["error"]["code"] == "upstream_timeout", got[-1]
        assert "first chunk" in got[-1]["error"]["message"]
        assert entries[1][1] == "failed" and len(entries) == 2
        assert line["endpoint"] == silent.url[7:] and line["error_class"] == "watchdog_first_chunk"
        breakers = gw.gw.gen.services.breakers
        faults = {ep.url: breakers.describe(ep)["consecutive_faults"] for ep in gw.gw.pool.endpoints()}
        assert faults == {bad.url: 1, silent.url: 1}
    await until(lambda: _quiet(silent.url))


@pytest.mark.parametrize("fault", ["none", "drop_after=20"])
async def test_a_continuable_stream_its_client_drops_is_charged_and_timed_as_a_plain_one(sims, gateway, fault):
    """A stream on a model with migration_limit (continued or not) that its client drops before
    the end: what it was sent is recorded as for any stream (docs/tenancy.md: its prompt and a
    token for each generated chunk at least, so reading all but the end is not a way around TPM;
    its TTFT). It was charged the prompt's estimate alone and had no TTFT, the migration's relay
    recording nothing of a stream its client left."""
    first = await sims("vllm", "m", itl_ms=5.0, fault=fault)
    other = await sims("vllm", "m", itl_ms=5.0)
    gw = await gateway([model_block("m", "vllm", [first.url, other.url], strategy="round-robin", migration_limit=1)],
                       auth=KEYS, limits={"users": {"alice": {"tpm": 100000}}})
    body = {"model": "m", "messages": MSG, "max_tokens": 400, "stream": True}
    with gw.gw.request_log.capture() as logs:
        async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/chat/completions", json=body,
                                                        headers={"Authorization": f"Bearer {ALICE}"}) as r:
            got = 0
            async for line in r.content:
                got += line.startswith(b"data:") and b'"content"' in line
                if got >= 60:
                    break
            r.connection.transport.abort()           # gone before the end (and the usage)
        await until(lambda: any(e["event"] == "request" for e in logs))
    line = next(e for e in logs if e["event"] == "request")
    assert line["status"] == 499 and line["ttft_ms"] is not None
    assert [m["outcome"] for m in line.get("migrations", [])] == (["continued"] if fault != "none" else [])
    state = gw.gw.tenancy.state

    async def charged():
        tokens = (await state.usage("alice"))["tokens"]
        return tokens if tokens >= 60 else 0
    assert await wait_for(charged), await state.usage("alice")
    assert 'switchyard_time_to_first_token_seconds_count{model="m"} 1.0' in await gw.metrics_text()


async def test_a_client_that_leaves_while_its_continuation_opens_leaves_the_break_counted(sims, gateway):
    """The stream broke and its client left while the continuation's engine had not answered yet
    (SGLang's head comes with its first token): the broken leg is counted as every failed leg of a
    stream with migration_limit is (docs/observability.md), outcome cancelled, on the metric and the
    log line, and the fault goes to the broken endpoint's breaker, none to the one left unanswered.
    The break was counted nowhere and no breaker heard of it, the migration's count and the fault
    both coming after the continuation's head."""
    bad = await sims("sglang", "m", fault="drop_after=3")
    slow = await sims("sglang", "m", fault="stall_before_first=inf")
    gw = await gateway([model_block("m", "sglang", [bad.url, slow.url], strategy="round-robin", migration_limit=1)],
                       health={"enabled": False})

    async def continuing() -> bool:
        return bool((await sim_state(slow.url))["running"])

    with gw.gw.request_log.capture() as logs:
        async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/chat/completions", json={
                "model": "m", "messages": MSG, "max_tokens": 30, "stream": True}) as r:
            assert r.status == 200
            await until(continuing)              # the continuation is asked for, its head not come
            r.connection.transport.abort()
        await until(lambda: any(e["event"] == "request" for e in logs))
    line = next(e for e in logs if e["event"] == "request")
    assert line["status"] == 499
    assert [(m["reason"], m["outcome"], m["endpoint"]) for m in line.get("migrations", [])] == [
        ("broken", "cancelled", bad.url[7:])]
    assert migrations(await gw.metrics_text(), "cancelled") == 1
    breakers = gw.gw.gen.services.breakers
    faults = {ep.url: breakers.describe(ep)["consecutive_faults"] for ep in gw.gw.pool.endpoints()}
    assert faults == {bad.url: 1, slow.url: 0}
    await until(lambda: _quiet(slow.url))


async def test_the_limit_ends_the_stream_with_todays_error_event(sims, gateway):
    gw, _ = await setup(sims, gateway, "vllm", "drop_after=4", limit=1, healthy=0)
    other = await sims("vllm", "m", fault="drop_after=4")
    gw = await gateway([model_block("m", "vllm", [gw.gw.pool.endpoints()[0].url, other.url],
                                    strategy="round-robin", migration_limit=1)])
    st, got = await raw_post(gw.url, "/v1/chat/completions",
                             {"model": "m", "messages": MSG, "max_tokens": 30, "stream": True})
    assert st == 200 and isinstance(got[-1], dict) and got[-1]["error"]["code"] == "upstream_incomplete"
    text = await gw.metrics_text()
    assert migrations(text, "continued") == 1 and migrations(text, "limit") == 1


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("others", ["none", "broken"])
async def test_a_broken_stream_no_leg_continues_is_charged_the_tokens_its_legs_reported(sims, gateway, engine, others):
    """A stream that broke after some tokens and was not continued (no other endpoint; the one that
    took its continuation broke too, at the limit) is charged as an abandoned one (docs/tenancy.md):
    on a model with migration_limit, whose legs report usage on every chunk, the original prompt
    and every token generated, on its log line and in the token counters too. It was charged the
    prompt's estimate and a token per chunk, and its log line had no usage."""
    bad = [await sims(engine, "m", fault="drop_after=7") for _ in range(1 if others == "none" else 2)]
    gw = await gateway([model_block("m", engine, [b.url for b in bad], strategy="round-robin", migration_limit=1)],
                       auth=KEYS, limits={"users": {"alice": {"tpm": 100000}}}, health={"enabled": False})
    body = {"model": "m", "messages": MSG, "max_tokens": 30, "stream": True}
    good = await sims(engine, "m")                # the prompt's tokens, as an engine counts them
    _, ref = await raw_post(good.url, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    prompt = next(e["usage"]["prompt_tokens"] for e in ref if isinstance(e, dict) and e.get("usage"))
    with gw.gw.request_log.capture() as logs:
        st, got = await raw_post(gw.url, "/v1/chat/completions", body, headers={"Authorization": f"Bearer {ALICE}"})
        await until(lambda: any(e["event"] == "request" for e in logs))
    assert st == 200 and got[-1]["error"]["code"] == "upstream_incomplete"
    line = next(e for e in logs if e["event"] == "request")
    generated = 7 * len(bad)
    assert [m["outcome"] for m in line["migrations"]] == (["failed"] if others == "none" else ["continued", "limit"])
    assert (line["prompt_tokens"], line["completion_tokens"]) == (prompt, generated)
    assert (await gw.gw.tenancy.state.usage("alice"))["tokens"] == prompt + generated
    text = await gw.metrics_text()
    assert counter(text, "switchyard_completion_tokens_total") == generated
    assert counter(text, "switchyard_prompt_tokens_total") == prompt


@pytest.mark.parametrize("extra,why", [({"response_format": {"type": "json_object"}}, "response_format"),
                                       ({"logprobs": True}, "logprobs"),
                                       ({"seed": 7, "temperature": 0.8}, "seed"),
                                       ({"guided_regex": "[a-z ]+"}, "guided"),
                                       ({"n": 2}, "n")])
async def test_refused_streams_get_todays_error_event(sims, gateway, extra, why):
    gw, _ = await setup(sims, gateway, "vllm", "drop_after=4")
    st, got = await raw_post(gw.url, "/v1/chat/completions",
                             {"model": "m", "messages": MSG, "max_tokens": 30, "stream": True, **extra})
    assert st == 200 and isinstance(got[-1], dict) and "error" in got[-1]
    assert migrations(await gw.metrics_text(), f"refused_{why}") == 1


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_a_stream_asking_for_best_of_is_continued(sims, gateway, engine):
    """Neither engine generates ``best_of`` sequences now (vLLM V1 dropped the field, SGLang never
    used it): a stream asking for more than one is one choice, continued as any other. It was
    refused (``refused_n``) and ended with the error event."""
    gw, good = await setup(sims, gateway, engine, "drop_after=7")
    req = {"model": "m", "messages": MSG, "max_tokens": 30, "stream": True, "stream_options": {"include_usage": True}}
    _, ref = await raw_post(good.url, "/v1/chat/completions", req)
    st, got = await raw_post(gw.url, "/v1/chat/completions", {**req, "best_of": 3})
    assert st == 200 and got[-1] == "[DONE]", got[-2:]
    assert text_of(got) == text_of(ref)
    assert next(e["usage"] for e in got if isinstance(e, dict) and e.get("usage"))["completion_tokens"] == 30
    assert migrations(await gw.metrics_text(), "continued") == 1

@pytest.mark.parametrize("count", [0, False])
async def test_a_completion_asking_for_logprobs_0_is_refused(sims, gateway, count):
    """vLLM reads a completion's "logprobs": 0 as a request for logprobs (the sampled token's own on
    each chunk: its serving sends a logprobs object whenever the field is not null), with a
    text_offset counted from the leg's first character, which a continuation would start again
    from 0. Such a stream is refused as any with logprobs; a 0 was read as none, and the stream
    continued. A false, the chat's flag written on a completion, is the count 0 to vLLM (pydantic's
    lax mode reads a bool as an int) and asks for them too; it was read as none."""
    gw, _ = await setup(sims, gateway, "vllm", "drop_after=4")
    st, got = await raw_post(gw.url, "/v1/completions", {"model": "m", "prompt": "Once upon a time", "max_tokens": 30,
                                                         "stream": True, "logprobs": count})
    assert any(isinstance(e, dict) and e.get("choices") and e["choices"][0].get("logprobs") for e in got)
    assert st == 200 and isinstance(got[-1], dict) and "error" in got[-1], got[-2:]
    text = await gw.metrics_text()
    assert migrations(text, "refused_logprobs") == 1 and migrations(text, "continued") == 0


@pytest.mark.parametrize("extra,why", [({"seed": 7, "temperature": "0.8"}, "seed"),
                                       ({"include_reasoning": "false"}, "reasoning"),
                                       ({"logprobs": "true"}, "logprobs"),
                                       ({"presence_penalty": "0.5"}, "penalty")])
async def test_refusals_read_fields_as_the_engine_reads_them(sims, gateway, extra, why):
    """vLLM reads its request in pydantic's lax mode: a temperature of "0.8" samples (with the
    seed, draws a continuation cannot resume), an include_reasoning of "false" hides the reasoning.
    The refusal checks read only a number and the literal false, so both streams were continued."""
    gw, _ = await setup(sims, gateway, "vllm", "drop_after=4")
    st, got = await raw_post(gw.url, "/v1/chat/completions",
                             {"model": "m", "messages": MSG, "max_tokens": 30, "stream": True, **extra})
    assert st == 200 and isinstance(got[-1], dict) and "error" in got[-1], got[-2:]
    assert migrations(await gw.metrics_text(), f"refused_{why}") == 1


@pytest.mark.parametrize("extra", [{"logprobs": "false"}, {"logprobs": "0"}, {"presence_penalty": "0"},
                                   {"frequency_penalty": "0.0"}])
async def test_what_the_engine_reads_as_not_asking_is_no_refusal(sims, gateway, extra):
    """A chat's logprobs of "false" or "0" is false to vLLM, which reads its request in pydantic's
    lax mode, and a penalty of "0" is no penalty: nothing a continuation could not carry on, so the
    stream is continued (docs/resilience.md: each field read as vLLM reads it). Read as any
    non-empty string, each was refused, and the client got the error event of a broken stream."""
    gw, good = await setup(sims, gateway, "vllm", "drop_after=4")
    req = {"model": "m", "messages": MSG, "max_tokens": 20, "stream": True, **extra}
    _, ref = await raw_post(good.url, "/v1/chat/completions", req)
    st, got = await raw_post(gw.url, "/v1/chat/completions", req)
    assert st == 200 and got[-1] == "[DONE]", got[-2:]
    assert text_of(got) == text_of(ref)
    assert migrations(await gw.metrics_text(), "continued") == 1


async def test_what_the_client_declined_as_false_words_stays_out_of_a_continued_stream(sims, gateway):
    """A continued stream's legs ask for per-chunk usage and token ids, which the client gets only
    if it asked: a continuous_usage_stats or return_token_ids of "false" (false to vLLM, which reads
    its request in pydantic's lax mode) asks for neither. Read as any non-empty string, both went
    to the client on every chunk."""
    gw, good = await setup(sims, gateway, "vllm", "drop_after=5")
    req = {"model": "m", "messages": MSG, "max_tokens": 20, "stream": True, "return_token_ids": "false",
           "stream_options": {"include_usage": True, "continuous_usage_stats": "false"}}
    st, got = await raw_post(gw.url, "/v1/chat/completions", req)
    assert st == 200 and got[-1] == "[DONE]", got[-2:]
    chunks = [e for e in got if isinstance(e, dict) and e.get("choices")]
    assert not any(e.get("usage") for e in chunks)
    assert not any(e["choices"][0].get("token_ids") or e.get("prompt_token_ids") for e in chunks)
    assert [e["usage"]["completion_tokens"] for e in got if isinstance(e, dict) and e.get("usage")] == [20]
    assert migrations(await gw.metrics_text(), "continued") == 1


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_min_tokens_given_as_a_string_is_reduced_as_a_number(sims, gateway, engine):
    """An engine reads min_tokens "12" as 12 (pydantic's lax mode) and holds its end of sequence back
    until then. The continuation's min_tokens is what is left of it: read only as a number, the
    string was left out of a token-exact continuation (which could then end early) and sent as it
    came in a text one (which then held its end back 12 tokens more)."""
    gw, good = await setup(sims, gateway, engine, "drop_after=4", eos_probability=0.3)
    req = {"model": "m", "messages": MSG, "max_tokens": 40, "stream": True, "min_tokens": "12",
           "stream_options": {"include_usage": True}}
    _, ref = await raw_post(good.url, "/v1/chat/completions", req)
    ref_usage = next(e["usage"] for e in ref if isinstance(e, dict) and e.get("usage"))
    assert 12 <= ref_usage["completion_tokens"] < 40        # the end of sequence came, after the minimum
    st, got = await raw_post(gw.url, "/v1/chat/completions", req)
    assert st == 200 and got[-1] == "[DONE]", got[-2:]
    assert text_of(got) == text_of(ref)
    assert next(e["usage"] for e in got if isinstance(e, dict) and e.get("usage"))["completion_tokens"] == \
        ref_usage["completion_tokens"]
    assert migrations(await gw.metrics_text(), "continued") == 1


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_a_prefill_given_as_text_parts_is_extended_by_its_continuation(sims, gateway, engine):
    """The client continues its own assistant message (continue_final_message), its content a list
    of text parts, and the stream is continued as text (SGLang; vLLM with stop strings): the
    continuation extends that message, and the answer is the unbroken run's. The prefill was left
    as it was and the text the client had sent as an assistant message of its own, another turn."""
    gw, good = await setup(sims, gateway, engine, "drop_after=5")
    parts = [{"type": "text", "text": "Once upon"}, {"type": "text", "text": "a time"}]
    # a stop string of one character: text mode on vLLM, nothing held back, so the seam is a token's end
    req = {"model": "m", "max_tokens": 20, "stream": True, "stop": ["Q"], "continue_final_message": True,
           "add_generation_prompt": False, "messages": MSG + [{"role": "assistant", "content": parts}]}
    _, ref = await raw_post(good.url, "/v1/chat/completions", req)
    st, got = await raw_post(gw.url, "/v1/chat/completions", req)
    assert st == 200 and got[-1] == "[DONE]", got[-2:]
    assert text_of(got) == text_of(ref)
    assert migrations(await gw.metrics_text(), "continued") == 1


async def test_a_continue_final_message_of_false_given_as_a_string_is_not_a_prefill(sims, gateway):
    """A chat ending in an assistant message with continue_final_message "false" (false to the
    engines, pydantic's lax mode) is answered by a new assistant message; its text continuation
    appends the partial answer as that new message. The string read as true: the partial answer
    was glued to the client's assistant message, and the continuation went on from another text."""
    gw, good = await setup(sims, gateway, "sglang", "drop_after=5")
    req = {"model": "m", "max_tokens": 20, "stream": True, "continue_final_message": "false",
           "messages": MSG + [{"role": "assistant", "content": "Once"}, {"role": "user", "content": "Go on."},
                              {"role": "assistant", "content": "Well"}]}
    _, ref = await raw_post(good.url, "/v1/chat/completions", req)
    st, got = await raw_post(gw.url, "/v1/chat/completions", req)
    assert st == 200 and got[-1] == "[DONE]", got[-2:]
    assert text_of(got) == text_of(ref)
    assert migrations(await gw.metrics_text(), "continued") == 1


async def test_migration_off_by_default(sims, gateway):
    bad = await sims("vllm", "m", fault="drop_after=4")
    good = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [bad.url, good.url], strategy="round-robin")])
    st, got = await raw_post(gw.url, "/v1/chat/completions",
                             {"model": "m", "messages": MSG, "max_tokens": 30, "stream": True})
    assert isinstance(got[-1], dict) and "error" in got[-1]
    assert migrations(await gw.metrics_text(), "continued") == 0


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_dying_decode_continues_through_a_fresh_pair(sims, gateway, engine):
    p1 = await sims(engine, "m", role="prefill")
    d1 = await sims(engine, "m", role="decode", fault="drop_after=6")
    p2 = await sims(engine, "m", role="prefill")
    d2 = await sims(engine, "m", role="decode")
    ref_sim = await sims(engine, "m")

    def rs(name, p, d):
        prefill = [{"url": p.url, "bootstrap_port": p.bootstrap_port}] if engine == "sglang" else [p.url]
        return {"name": name, "prefill": prefill, "decode": [d.url]}

    gw = await gateway([{"name": "m", "engine": engine, "rolesets": [rs("a", p1, d1), rs("b", p2, d2)],
                         "migration_limit": 2}])
    req = {"model": "m", "messages": MSG, "max_tokens": 24, "stream": True}
    _, ref = await raw_post(ref_sim.url, "/v1/chat/completions", req)
    for _ in range(2):          # whichever pair the first leg lands on, the stream completes
        st, got = await raw_post(gw.url, "/v1/chat/completions", req)
        assert st == 200 and got[-1] == "[DONE]", got[-2:]
        assert text_of(got) == text_of(ref)


async def test_a_decode_the_watchdog_cuts_at_the_limit_is_told_to_stop(sims, gateway):
    """SGLang P/D: both decodes go silent mid-stream; the first is continued through the other pair,
    whose fire ends the stream (its migration_limit used). Each silent decode gets its
    /abort_request (docs/resilience.md: an abandoned decode does), the last one too, as a P/D
    stream's watchdog fire always had it: a continuable stream's fire was not noted as the
    watchdog's, so that decode was left to notice the closed connection after its own delay."""
    def rs(name, p, d):
        return {"name": name, "prefill": [{"url": p.url, "bootstrap_port": p.bootstrap_port}], "decode": [d.url]}

    pairs = [(await sims("sglang", "m", role="prefill"), await sims("sglang", "m", role="decode", fault="stall_after=6:inf"))
             for _ in range(2)]
    gw = await gateway([{"name": "m", "engine": "sglang", "rolesets": [rs(f"r{i}", p, d) for i, (p, d) in enumerate(pairs)],
                         "migration_limit": 1, "watchdog": {"idle_timeout_s": 0.3}}])
    st, got = await raw_post(gw.url, "/v1/chat/completions", {"model": "m", "messages": MSG, "max_tokens": 24, "stream": True})
    assert st == 200 and isinstance(got[-1], dict) and got[-1]["error"]["code"] == "upstream_timeout", got[-2:]
    text = await gw.metrics_text()
    assert migrations(text, "continued") == 1 and migrations(text, "limit") == 1

    async def told(url: str) -> bool:
        return bool((await sim_state(url))["abort_requests"])
    for _, d in pairs:
        await until(lambda d=d: told(d.url))


async def test_a_messages_stream_is_not_continued_and_the_refusal_is_counted(sims, gateway):
    """Messages (and Responses) events are not rebuilt across legs: such a stream on a model with
    migration_limit ends with its API's error event, as without it, and is counted as refused."""
    import anthropic

    gw, _ = await setup(sims, gateway, "vllm", "drop_after=4")
    client = anthropic.AsyncAnthropic(base_url=gw.url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.APIStatusError):
        async with client.messages.stream(model="m", max_tokens=30,
                                          messages=[{"role": "user", "content": "Tell me about trains."}]) as s:
            async for _ in s:
                pass
    assert migrations(await gw.metrics_text(), "refused_api") == 1
    await client.close()


async def test_a_responses_stream_is_not_continued_and_ends_with_one_terminal_event(sims, gateway):
    """A Responses stream on a model with migration_limit that breaks is not continued: the OpenAI
    SDK reads its events in order, sequence numbers without a gap, then the error event and one
    response.failed; the refusal is counted (already so; only a Messages stream was tested)."""
    gw, _ = await setup(sims, gateway, "vllm", "drop_after=4")
    client = openai_client(gw)
    async with client.responses.stream(model="m", input="Tell me about trains.", max_output_tokens=30) as s:
        evs = [ev async for ev in s]
    events = [(ev.type, ev.sequence_number) for ev in evs]
    assert [n for _, n in events] == list(range(len(events)))
    # the failed response carries the message the client was streamed, as it stood
    text = "".join(ev.delta for ev in evs if ev.type == "response.output_text.delta")
    assert text and [[p.text for p in o.content] for o in evs[-1].response.output] == [[text]]
    types = [t for t, _ in events]
    assert types[-2:] == ["error", "response.failed"] and types.count("response.failed") == 1
    assert not {"response.completed", "response.incomplete"} & set(types)
    assert migrations(await gw.metrics_text(), "refused_api") == 1


async def test_a_stream_in_bare_cr_lines_continues_as_any_other(sims, gateway):
    """SSE lets a line end in CR, LF or CRLF. The continuation's reader split events only at blank
    lines of LFs, so a stream of bare-CR lines was one unfinished event to it: what the first
    engine had sent before it broke never reached the client, and the continuation was refused."""
    async def chat(request: web.Request) -> web.StreamResponse:
        return await two_words_then_break(request, "chatcmpl-cr", b"\r\r", lambda i: {"token_ids": [100 + i]})

    good = await sims("vllm", "m")
    async with fake_engine(chat) as bad:
        gw = await gateway([model_block("m", "vllm", [bad, good.url], strategy="round-robin", migration_limit=1)])
        st, got = await raw_post(gw.url, "/v1/chat/completions",
                                 {"model": "m", "messages": MSG, "max_tokens": 6, "stream": True})
    assert st == 200 and got[-1] == "[DONE]", got[-2:]
    assert text_of(got).startswith(" alpha beta") and len(text_of(got)) > len(" alpha beta")
    fins = [e["choices"][0]["finish_reason"] for e in got if isinstance(e, dict) and e.get("choices")
            and e["choices"][0].get("finish_reason")]
    assert fins == ["length"]
    assert migrations(await gw.metrics_text(), "continued") == 1


@pytest.mark.parametrize("sick", ["status=500", "closed"])
async def test_a_continuation_an_engine_refuses_goes_on_to_another(sims, gateway, sick):
    """The engine chosen to continue a stream answered 500 (or refused the connection) before it
    sent anything: the continuation went no further and the client got the error event, where a
    fresh request is retried on another endpoint and a healthy one was there."""
    bad = await sims("vllm", "m", fault="drop_after=5")
    good = await sims("vllm", "m")
    if sick == "closed":
        gone = await sims("vllm", "m")
        refusing = gone.url
        await gone.close()
    else:
        refusing = (await sims("vllm", "m", fault=sick)).url
    # round-robin: the stream goes to bad (first); its continuation, among [good, refusing], to refusing
    gw = await gateway([model_block("m", "vllm", [bad.url, good.url, refusing], strategy="round-robin",
                                    migration_limit=1)], health={"enabled": False})
    req = {"model": "m", "messages": MSG, "max_tokens": 20, "stream": True}
    _, ref = await raw_post(good.url, "/v1/chat/completions", req)
    st, got = await raw_post(gw.url, "/v1/chat/completions", req)
    assert st == 200 and got[-1] == "[DONE]", got[-2:]
    assert text_of(got) == text_of(ref)
    assert migrations(await gw.metrics_text(), "continued") == 1


async def test_a_stream_no_engine_would_continue_is_the_broken_engines_fault(sims, gateway):
    """Its continuation was refused by the only other endpoint: the request's log line named that
    endpoint, beside the error of the one whose stream broke, and the broken stream's fault went
    to the refusing endpoint's breaker (its second), none to the one that broke it."""
    bad = await sims("vllm", "m", fault="drop_after=5")
    sick = await sims("vllm", "m", fault="status=500")
    gw = await gateway([model_block("m", "vllm", [bad.url, sick.url], strategy="round-robin",
                                    migration_limit=1)], health={"enabled": False})
    with gw.gw.request_log.capture() as logs:
        st, got = await raw_post(gw.url, "/v1/chat/completions",
                                 {"model": "m", "messages": MSG, "max_tokens": 20, "stream": True})
        await until(lambda: any(e["event"] == "request" for e in logs))
    assert st == 200 and got[-1]["error"]["code"] == "upstream_incomplete"
    line = next(e for e in logs if e["event"] == "request")
    assert line["endpoint"] == bad.url[7:] and line["error_class"] == "upstream_broken"
    assert line["migrations"][0]["outcome"] == "failed"
    breakers = gw.gw.gen.services.breakers
    faults = {ep.url: breakers.describe(ep)["consecutive_faults"] for ep in gw.gw.pool.endpoints()}
    assert faults == {bad.url: 1, sick.url: 1}


LONG_MSG = [{"role": "user", "content": "tell me a long story about gateways and the caches their engines keep " * 3}]


def cached_of(events: list) -> int | None:
    usage = next(e["usage"] for e in reversed(events) if isinstance(e, dict) and e.get("usage"))
    details = usage.get("prompt_tokens_details")
    return details.get("cached_tokens") if isinstance(details, dict) else None


def counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.parametrize("engine,kind", [("vllm", "chat"), ("vllm", "chat_stop"), ("vllm", "completions"),
                                         ("sglang", "chat"), ("sglang", "completions")])
async def test_a_continued_streams_cached_tokens_are_its_original_prompts(sims, gateway, engine, kind):
    """The final usage of a continued stream counts the original prompt's tokens, but its
    cached_tokens (and the log line's and the cached-tokens counter's) came from the last leg's
    prompt: the original prompt and the text generated before the break, on another engine with
    another cache. They are the first leg's, which SGLang reports on every chunk; vLLM reports them
    only in a stream's final usage, which a broken leg never sent, so they are left out."""
    bad = await sims(engine, "m", fault="drop_after=6")
    good = await sims(engine, "m")           # a cold cache: the last leg's prompt hits nothing there
    ref = await sims(engine, "m")
    gw = await gateway([model_block("m", engine, [bad.url, good.url], strategy="round-robin", migration_limit=1)])
    if kind == "completions":
        path, req = "/v1/completions", {"prompt": "Once upon a time, in a gateway far away, " * 4}
    else:
        path, req = "/v1/chat/completions", {"messages": LONG_MSG, **({"stop": ["@"]} if kind == "chat_stop" else {})}
    req = {"model": "m", "max_tokens": 30, "stream": True, "stream_options": {"include_usage": True}, **req}
    await raw_post(bad.url, path, req, {"x-sim-fault": "none"})         # the first leg's engine has the prompt cached
    for _ in range(2):                       # what the first leg's engine reports for it: the second run's
        _, ref_events = await raw_post(ref.url, path, req)
    first_cached = cached_of(ref_events)
    assert first_cached and first_cached > 0
    expected = first_cached if engine == "sglang" else None

    client = openai_client(gw)
    with gw.gw.request_log.capture() as logs:
        if kind == "completions":
            stream = await client.completions.create(**{k: v for k, v in req.items() if k != "stream"}, stream=True)
        else:
            stream = await client.chat.completions.create(**{k: v for k, v in req.items() if k != "stream"},
                                                          stream=True)
        chunks = [c async for c in stream]
        await until(lambda: any(e["event"] == "request" for e in logs))
    await client.close()
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 30
    details = usage[0].prompt_tokens_details
    assert (details.cached_tokens if details is not None else None) == expected
    line = next(e for e in logs if e["event"] == "request")
    assert line["migrations"][0]["outcome"] == "continued"
    assert line["cached_tokens"] == expected
    assert counter(await gw.metrics_text(), "switchyard_cached_prompt_tokens_total") == (expected or 0)


async def test_a_stream_started_over_reports_the_cached_tokens_of_the_leg_that_ran_its_prompt(sims, gateway):
    """A leg that broke before generating anything is not continued but started over: the leg that
    answers runs the original prompt, so its own cached tokens are the stream's."""
    bad = await sims("vllm", "m", fault="drop_after=0")
    good = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [bad.url, good.url], strategy="round-robin", migration_limit=1)])
    req = {"model": "m", "messages": LONG_MSG, "max_tokens": 12, "stream": True,
           "stream_options": {"include_usage": True}}
    await raw_post(good.url, "/v1/chat/completions", req)
    _, ref_events = await raw_post(good.url, "/v1/chat/completions", req)
    warm = cached_of(ref_events)
    assert warm and warm > 0
    st, got = await raw_post(gw.url, "/v1/chat/completions", req)
    assert st == 200 and got[-1] == "[DONE]", got[-2:]
    assert cached_of(got) == warm
    assert migrations(await gw.metrics_text(), "continued") == 1


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_a_stream_an_engine_ends_with_a_501_event_after_tokens_is_charged_the_tokens_reported(sims, gateway,
                                                                                                engine):
    """An error event of code 501 after some tokens ends the stream with that event, not continued
    (another engine would not implement it either); the engine broke it off without its final
    usage, so it is charged as an abandoned stream (docs/tenancy.md): on a model with
    migration_limit, the prompt and the tokens generated as its usage on every chunk reported them,
    on its log line too. It was charged the prompt's estimate and a token per chunk."""
    bad = await sims(engine, "m", fault="error_after=7;error_code=501")
    good = await sims(engine, "m")
    gw = await gateway([model_block("m", engine, [bad.url, good.url], strategy="round-robin", migration_limit=1)],
                       auth=KEYS, limits={"users": {"alice": {"tpm": 100000}}}, health={"enabled": False})
    body = {"model": "m", "messages": MSG, "max_tokens": 30, "stream": True}
    _, ref = await raw_post(good.url, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    prompt = next(e["usage"]["prompt_tokens"] for e in ref if isinstance(e, dict) and e.get("usage"))
    with gw.gw.request_log.capture() as logs:
        st, got = await raw_post(gw.url, "/v1/chat/completions", body, headers={"Authorization": f"Bearer {ALICE}"})
        await until(lambda: any(e["event"] == "request" for e in logs))
    assert st == 200 and got[-1] == "[DONE]" and got[-2]["error"]["code"] == "501"
    line = next(e for e in logs if e["event"] == "request")
    assert line["error_class"] == "upstream_stream_unsupported" and "migrations" not in line
    assert (line["prompt_tokens"], line["completion_tokens"]) == (prompt, 7)
    assert (await gw.gw.tenancy.state.usage("alice"))["tokens"] == prompt + 7


@pytest.mark.parametrize("end", ["reset", "error", "501"])
async def test_a_stream_an_engine_ends_before_its_first_token_is_charged_nothing(gateway, end):
    """docs/tenancy.md: a stream the engine ended with an error before its first token generated
    nothing and is charged no tokens, also on a model with migration_limit whose first leg (its
    role chunk, as vLLM sends it with continuous_usage_stats) reported the prompt's usage before
    it broke and no other endpoint took it."""
    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + json.dumps({
            "id": "chatcmpl-r", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None, "token_ids": []}], "prompt_token_ids": [1, 2, 3],
            "usage": {"prompt_tokens": 17, "completion_tokens": 0, "total_tokens": 17}}).encode() + b"\n\n")
        if end == "reset":
            request.transport.abort()
            return resp
        code = 501 if end == "501" else 500
        await resp.write(b"data: " + json.dumps({"error": {"message": "no", "type": "x", "code": code}}).encode()
                         + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async with fake_engine(chat) as bad:
        gw = await gateway([model_block("m", "vllm", [bad], migration_limit=1)], auth=KEYS,
                           limits={"users": {"alice": {"tpm": 100000}}}, health={"enabled": False})
        with gw.gw.request_log.capture() as logs:
            st, got = await raw_post(gw.url, "/v1/chat/completions", {"model": "m", "messages": MSG, "max_tokens": 30,
                                                                      "stream": True},
                                     headers={"Authorization": f"Bearer {ALICE}"})
            await until(lambda: any(e["event"] == "request" for e in logs))
    assert st == 200 and any(isinstance(e, dict) and "error" in e for e in got)
    line = next(e for e in logs if e["event"] == "request")
    assert line["completion_tokens"] is None
    assert (await gw.gw.tenancy.state.usage("alice"))["tokens"] == 0


@pytest.mark.parametrize("limit", [0, 1])
async def test_a_broken_connection_is_counted_under_one_error_class_with_migration_or_without(sims, gateway, limit):
    """An engine connection that breaks mid-stream is one upstream error of class broken_stream,
    whether its model has migration_limit or not: a dashboard reading that class lost every break
    of a model with continuation, counted as upstream_broken."""
    bad = await sims("vllm", "m", fault="drop_after=4")
    gw = await gateway([model_block("m", "vllm", [bad.url], migration_limit=limit)], health={"enabled": False})
    st, got = await raw_post(gw.url, "/v1/chat/completions",
                             {"model": "m", "messages": MSG, "max_tokens": 20, "stream": True})
    assert st == 200 and got[-1]["error"]["code"] == "upstream_incomplete"
    text = await gw.metrics_text()
    assert counter(text, "switchyard_upstream_errors_total") == 1
    assert (f'switchyard_upstream_errors_total{{endpoint="{bad.url[7:]}",error_class="broken_stream",model="m"}} 1.0'
            in text)


async def test_a_stream_started_over_then_continued_reports_its_original_prompts_tokens(sims, gateway):
    """A first leg broken before its first chunk is started over on another engine, which runs the
    original prompt and breaks after some tokens; the third leg continues it with a longer prompt
    (the original one and what was generated). The stream's usage counts the original prompt, as
    the leg that started over reported it (docs/resilience.md). It counted the continuation's
    prompt, the generated tokens in it counted twice, on the client's usage block, the log line
    and the tenant's charge."""
    early = await sims("vllm", "m", fault="drop_after=0")
    good = await sims("vllm", "m")
    bad = await sims("vllm", "m", fault="drop_after=5")
    # round-robin: the first leg on the engine that breaks at once, the one that starts over on the
    # one that breaks after five tokens (the second of those not tried yet), the continuation on the good one
    gw = await gateway([model_block("m", "vllm", [early.url, good.url, bad.url], strategy="round-robin",
                                    migration_limit=2)], health={"enabled": False})
    req = {"model": "m", "messages": MSG, "max_tokens": 20, "stream": True, "stream_options": {"include_usage": True}}
    _, ref = await raw_post(good.url, "/v1/chat/completions", req)
    ref_usage = next(e["usage"] for e in ref if isinstance(e, dict) and e.get("usage"))
    with gw.gw.request_log.capture() as logs:
        st, got = await raw_post(gw.url, "/v1/chat/completions", req)
        await until(lambda: any(e["event"] == "request" for e in logs))
    assert st == 200 and got[-1] == "[DONE]", got[-2:]
    assert text_of(got) == text_of(ref)
    line = next(e for e in logs if e["event"] == "request")
    assert [(m["reason"], m["endpoint"], m["tokens"]) for m in line["migrations"]] == [
        ("broken", early.url[7:], 0), ("broken", bad.url[7:], 5)]
    usage = next(e["usage"] for e in got if isinstance(e, dict) and e.get("usage"))
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (ref_usage["prompt_tokens"], 20)
    assert usage["total_tokens"] == ref_usage["prompt_tokens"] + 20
    assert line["prompt_tokens"] == ref_usage["prompt_tokens"]


async def test_a_chat_with_an_image_is_continued_with_its_messages_on_vllm(sims, gateway):
    """The prompt ids vLLM returns for a chat with an image hold the image's placeholder tokens, not
    the image: a completion of those ids would go on with no image at all. Such a chat is continued
    as text, its messages (the image with them) and the text the client received as the answer's
    start. It was continued token-exactly, as a completion of the prompt's ids."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is in this picture?"}, image]}]
    bad = await sims("vllm", "m", fault="drop_after=5")
    good = await sims("vllm", "m")
    sent: list[dict] = []
    req = {"model": "m", "max_tokens": 20, "stream": True, "messages": messages}
    _, ref = await raw_post(good.url, "/v1/chat/completions", req)
    async with fake_engine(recording_relay(good.url, sent), paths=("/v1/chat/completions", "/v1/completions")) as other:
        gw = await gateway([model_block("m", "vllm", [bad.url, other], strategy="round-robin", migration_limit=1)])
        st, got = await raw_post(gw.url, "/v1/chat/completions", req)
    assert st == 200 and got[-1] == "[DONE]", got[-2:]
    (cont,) = sent
    assert "prompt" not in cont and cont["messages"][0] == messages[0] and cont["continue_final_message"] is True
    assert text_of(got) == text_of(ref)


@pytest.mark.parametrize("kind", ["chat", "completions"])
async def test_a_text_continuation_starts_from_exactly_what_the_client_received(sims, gateway, kind):
    """vLLM holds back the last (longest stop string - 1) characters of a stream with stop strings,
    as they might begin one; a leg that breaks never sends them. The continuation is built from
    the text the client received, without them, and the next engine generates from there: what the
    client sees is that text followed by the continuation's output, nothing lost or repeated."""
    stop = ["@@@@@@@@"]                      # 7 characters held back: more than one token's worth
    bad = await sims("vllm", "m", fault="drop_after=6")
    good = await sims("vllm", "m")
    sent: list[dict] = []
    relay = recording_relay(good.url, sent)

    chat = kind == "chat"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    req = {"model": "m", "max_tokens": 30, "stream": True, "stop": stop,
           **({"messages": MSG} if chat else {"prompt": "Once upon a time"})}
    _, six = await raw_post(good.url, path, {**req, "max_tokens": 6})     # the first leg's 6 tokens, all of them
    async with fake_engine(relay, paths=(path,)) as other:
        gw = await gateway([model_block("m", "vllm", [bad.url, other], strategy="round-robin", migration_limit=1)])
        st, got = await raw_post(gw.url, path, req)
    assert st == 200 and got[-1] == "[DONE]", got[-2:]
    assert migrations(await gw.metrics_text(), "continued") == 1
    (cont,) = sent
    if chat:
        assert cont["messages"][:-1] == MSG and cont["continue_final_message"] is True
        seam = cont["messages"][-1]["content"]
    else:
        assert cont["prompt"].startswith(req["prompt"])
        seam = cont["prompt"][len(req["prompt"]):]
    generated = text_of(six, chat)
    assert generated.startswith(seam) and len(seam) == len(generated) - 7     # what vLLM held back is not in it
    assert cont["max_tokens"] == 30 - 6      # the held-back characters' tokens were generated: they count
    _, rest = await raw_post(good.url, path, cont)                           # the continuation's own output
    assert text_of(got, chat) == seam + text_of(rest, chat)


def _choice_text(c: dict, chat: bool) -> str:
    return ((c.get("delta") or {}).get("content") or "") if chat else (c.get("text") or "")


@pytest.mark.parametrize("engine,kind,declined", [
    ("vllm", "chat", {}), ("vllm", "completions", {}), ("sglang", "chat", {}), ("sglang", "completions", {}),
    ("vllm", "chat", {"include_stop_str_in_output": "false"}), ("sglang", "completions", {"no_stop_trim": "false"})])
async def test_a_stop_string_across_the_seam_ends_the_answer(sims, gateway, engine, kind, declined):
    """A stop string that begins in the text the client received and ends in the continuation's
    first characters: the continuation's engine looks for it in its own output only, so it went
    on past it. The answer ends as the unbroken engine's would have: the text before the stop
    string (already sent), finish_reason "stop" with the matched string, and the continuation's
    engine stops. ``declined``: the flag that keeps the stop string in the output given as
    "false", which the engines read as false (pydantic's lax mode): the string was read as true,
    and the stop string's rest was sent."""
    chat = kind == "chat"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = {"model": "m", "stream": True, **({"messages": MSG} if chat else {"prompt": "Once upon a time"})}
    # SGLang aborts a request whose connection closed after a delay (enginesim: 0.1 s), by which
    # time this short answer is whole: here it aborts at once, as vLLM does
    kw = {"sglang_abort_delay_s": 0.0} if engine == "sglang" else {}
    bad = await sims(engine, "m", fault="drop_after=6", **kw)
    good = await sims(engine, "m", **kw)
    # what the first leg's client receives: its 6 tokens less the 3 characters an engine holds back
    # while they might begin a stop string of 4 (one that is never generated)
    _, six = await raw_post(good.url, path, {**base, "max_tokens": 6, "stop": ["~~~~"]})
    generated = text_of(six, chat)
    sent = generated[:-3]
    # the continuation the gateway sends: what its engine generates after that text
    if chat:
        cont = {**base, "messages": MSG + [{"role": "assistant", "content": sent}],
                "continue_final_message": True, "add_generation_prompt": False}
    else:
        cont = {**base, "prompt": base["prompt"] + sent}
    _, after = await raw_post(good.url, path, {**cont, "max_tokens": 24})
    rest = text_of(after, chat)
    stop = sent[-2:] + rest[:2]              # begins in what the client has, ends in the continuation
    assert len(stop) == 4 and stop not in generated and stop not in rest
    # the tokens the continuation's engine had generated when it sent text the stop string completes in
    opts = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    _, held = await raw_post(good.url, path, {**cont, "max_tokens": 24, "stop": [stop], **opts})
    seen = ""
    for e in held:
        if isinstance(e, dict) and e.get("choices"):
            seen += _choice_text(e["choices"][0], chat)
            if len(seen) >= 2:
                cont_tokens = e["usage"]["completion_tokens"]
                break
    gw = await gateway([model_block("m", engine, [bad.url, good.url], strategy="round-robin", migration_limit=1)])
    client = openai_client(gw)
    req = {"model": "m", "max_tokens": 30, "stop": [stop], "stream_options": {"include_usage": True},
           "extra_body": declined}
    with gw.gw.request_log.capture() as logs:
        if chat:
            stream = await client.chat.completions.create(messages=MSG, stream=True, **req)
        else:
            stream = await client.completions.create(prompt=base["prompt"], stream=True, **req)
        chunks = [c async for c in stream]
        await client.close()
        await until(lambda: any(e["event"] == "request" for e in logs))
    line = next(e for e in logs if e["event"] == "request")
    assert line["migrations"][0]["outcome"] == "continued" and line["migrations"][0]["stop_at_seam"] is True
    assert line["finish_reason"] == "stop"
    choices = [c.choices[0] for c in chunks if c.choices]
    got = "".join((ch.delta.content or "") if chat else (ch.text or "") for ch in choices)
    assert migrations(await gw.metrics_text(), "continued") == 1
    assert got == sent                       # nothing past the stop string's start
    finished = [ch for ch in choices if ch.finish_reason]
    assert [ch.finish_reason for ch in finished] == ["stop"]
    matched = "stop_reason" if engine == "vllm" else "matched_stop"
    assert (finished[0].model_extra or {}).get(matched) == stop
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 6 + cont_tokens
    # the continuation's engine was told to stop: nothing generated past the answer's end
    await until(lambda: _aborted(good.url))


async def _aborted(url: str) -> bool:
    st = await sim_state(url)
    return st["counts"]["aborted"] == 1 and not st["running"]


@pytest.mark.parametrize("stop", [None, ["@@@@"]])
@pytest.mark.parametrize("keep", [3, 100])
async def test_a_truncated_prompt_is_continued_with_the_same_prompt_tokens(sims, gateway, stop, keep):
    """vLLM's truncate_prompt_tokens keeps the last k tokens of the prompt. A token-exact
    continuation's prompt is the ids the first leg's engine ran, already cut, and the generated
    ones: cut again, it lost the generated tokens' count from its front. A text continuation's
    prompt is the prompt and the generated text: its bound grows by the tokens generated (and
    never past the prompt the first leg ran and those tokens, which fit the context)."""
    bad = await sims("vllm", "m", fault="drop_after=5")
    good = await sims("vllm", "m")
    sent: list[dict] = []
    relay = recording_relay(good.url, sent)
    req = {"model": "m", "prompt": "Once upon a time", "max_tokens": 20, "stream": True,
           "truncate_prompt_tokens": keep, **({"stop": stop} if stop else {})}
    _, ref = await raw_post(good.url, "/v1/completions", {**req, "stream_options": {"include_usage": True}})
    prompt = next(e["usage"]["prompt_tokens"] for e in ref if isinstance(e, dict) and e.get("usage"))
    async with fake_engine(relay, paths=("/v1/completions",)) as other:
        gw = await gateway([model_block("m", "vllm", [bad.url, other], strategy="round-robin", migration_limit=1)])
        st, got = await raw_post(gw.url, "/v1/completions", req)
    assert st == 200 and got[-1] == "[DONE]", got[-2:]
    (cont,) = sent
    if stop is None:
        assert isinstance(cont["prompt"], list) and "truncate_prompt_tokens" not in cont
    else:
        assert cont["truncate_prompt_tokens"] == min(keep, prompt) + 5


@pytest.mark.parametrize("pieces,matched", [(["Z", "Q", " more"], True), (["Z", "W", " more"], False)])
async def test_a_continuation_sending_a_character_at_a_time_is_held_at_the_seam_then_released_or_ended(
        sims, gateway, pieces, matched):
    """The continuation's engine sends what might complete a stop string begun before the seam one
    character per event: it is held back until the stop string completes (the answer ends there,
    the leg's connection closed) or can no longer (all of it is released, nothing lost)."""
    bad = await sims("vllm", "m", fault="drop_after=6")
    good = await sims("vllm", "m")
    req = {"model": "m", "messages": MSG, "max_tokens": 30, "stream": True}
    _, six = await raw_post(good.url, "/v1/chat/completions", {**req, "max_tokens": 6, "stop": ["~~~~~"]})
    generated = text_of(six)
    sent = generated[:-4]                    # a stop string of 5: 4 characters held back
    stop = sent[-3:] + "ZQ"
    assert stop not in generated
    closed: list[bool] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        def ev(delta: dict, n: int, fin: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": fin}
            if fin:
                choice["stop_reason"] = None
            return b"data: " + json.dumps({
                "id": "chatcmpl-c", "object": "chat.completion.chunk", "created": 2, "model": "m",
                "choices": [choice], "usage": {"prompt_tokens": 40, "completion_tokens": n,
                                               "total_tokens": 40 + n}}).encode() + b"\n\n"

        await resp.write(ev({"role": "assistant", "content": ""}, 0))
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            await resp.write(ev({"content": piece}, i + 1, "length" if last else None))
        await resp.write(b"data: [DONE]\n\n")
        await until(lambda: request.transport is None or request.transport.is_closing())
        closed.append(True)
        return resp

    async with fake_engine(chat) as other:
        gw = await gateway([model_block("m", "vllm", [bad.url, other], strategy="round-robin", migration_limit=1)])
        client = openai_client(gw)
        stream = await client.chat.completions.create(**{**req, "stop": [stop]},
                                                      stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        await client.close()
        await until(lambda: closed)
    choices = [c.choices[0] for c in chunks if c.choices]
    got = "".join(ch.delta.content or "" for ch in choices)
    finished = [ch for ch in choices if ch.finish_reason]
    usage = [c.usage for c in chunks if c.usage is not None]
    assert migrations(await gw.metrics_text(), "continued") == 1
    if matched:
        assert got == sent
        assert [ch.finish_reason for ch in finished] == ["stop"]
        assert (finished[0].model_extra or {}).get("stop_reason") == stop
        assert usage[0].completion_tokens == 6 + 2      # the continuation's tokens up to "Q"
    else:
        assert got == sent + "".join(pieces)
        assert [ch.finish_reason for ch in finished] == ["length"]
        assert usage[0].completion_tokens == 6 + len(pieces)


@pytest.mark.parametrize("more", [0, 1])
async def test_a_stop_string_across_the_seam_counts_once_more_than_min_tokens_were_generated(sims, gateway, more):
    """vLLM looks for stop strings once more than ``min_tokens`` tokens were generated: a stop
    string completed across the seam by the stream's (min_tokens + 1)-th token ends the answer; one
    completed by its min_tokens-th does not, and the answer goes on to its length."""
    bad = await sims("vllm", "m", fault="drop_after=6")
    good = await sims("vllm", "m")
    req = {"model": "m", "messages": MSG, "stream": True}
    _, six = await raw_post(good.url, "/v1/chat/completions", {**req, "max_tokens": 6, "stop": ["~~~~"]})
    sent = text_of(six)[:-3]
    cont = {**req, "messages": MSG + [{"role": "assistant", "content": sent}], "continue_final_message": True,
            "add_generation_prompt": False, "max_tokens": 24}
    _, after = await raw_post(good.url, "/v1/chat/completions", cont)
    rest = text_of(after)
    stop = sent[-2:] + rest[:2]
    opts = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    _, held = await raw_post(good.url, "/v1/chat/completions", {**cont, "stop": [stop], **opts})
    first = next(e for e in held if isinstance(e, dict) and e.get("choices") and text_of([e]))
    assert len(text_of([first])) >= 2
    total = 6 + first["usage"]["completion_tokens"]       # the stream's tokens when the stop string completed
    gw = await gateway([model_block("m", "vllm", [bad.url, good.url], strategy="round-robin", migration_limit=1)])
    st, got = await raw_post(gw.url, "/v1/chat/completions",
                             {**req, "max_tokens": 30, "stop": [stop], "min_tokens": total - more})
    assert st == 200 and got[-1] == "[DONE]", got[-2:]
    fins = [e["choices"][0]["finish_reason"] for e in got if isinstance(e, dict) and e.get("choices")
            and e["choices"][0].get("finish_reason")]
    if more:
        assert text_of(got) == sent and fins == ["stop"]
    else:
        assert text_of(got) == sent + rest and fins == ["length"]


@pytest.mark.parametrize("engine,stop", [("vllm", None), ("vllm", ["@@@@"]), ("sglang", None), ("sglang", ["@@@@"])])
async def test_an_echoed_completion_continues_from_its_generated_text_only(sims, gateway, engine, stop):
    """A completion with ``echo``: its first chunk begins with the prompt (vLLM and SGLang send the
    prompt's text with the first output's). The continuation is built from the generated text only,
    sent without ``echo``: the client gets the unbroken answer (the prompt once, then the generated
    text), the usage counts the generated tokens, and the continuation's prompt holds the prompt
    once (vLLM token-exact without a stop string: its ids and the generated ones; as text with one,
    and on SGLang)."""
    bad = await sims(engine, "m", fault="drop_after=5")
    good = await sims(engine, "m")
    sent: list[dict] = []
    relay = recording_relay(good.url, sent)

    prompt = "Once upon a time"
    req = {"model": "m", "prompt": prompt, "max_tokens": 20, **({"stop": stop} if stop else {})}
    ids = {"return_token_ids": True} if engine == "vllm" else {}
    _, ref = await raw_post(good.url, "/v1/completions",
                            {**req, **ids, "echo": True, "stream": True, "stream_options": {"include_usage": True}})
    ref_text = text_of(ref, chat=False)
    ref_usage = next(e["usage"] for e in ref if isinstance(e, dict) and e.get("usage"))
    assert ref_text.startswith(prompt) and ref_usage["completion_tokens"] == 20
    async with fake_engine(relay, paths=("/v1/completions",)) as other:
        gw = await gateway([model_block("m", engine, [bad.url, other], strategy="round-robin", migration_limit=1)])
        client = openai_client(gw)
        stream = await client.completions.create(**req, echo=True, stream=True,
                                                 stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        await client.close()
    assert migrations(await gw.metrics_text(), "continued") == 1
    got = "".join(c.choices[0].text or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens == ref_usage["prompt_tokens"]
    (cont,) = sent
    assert not cont.get("echo")               # the client has the prompt already
    assert cont["max_tokens"] == 20 - 5       # the generated tokens only
    if engine == "vllm" and stop is None:     # token-exact: the prompt's ids, then the 5 generated
        choices = [e["choices"][0] for e in ref if isinstance(e, dict) and e.get("choices")]
        generated = [t for ch in choices for t in ch["token_ids"]]
        assert cont["prompt"] == choices[0]["prompt_token_ids"] + generated[:5]
    else:
        assert cont["prompt"].startswith(prompt) and cont["prompt"].count(prompt) == 1
        assert ref_text.startswith(cont["prompt"])
    if stop is None:
        assert got == ref_text                # the prompt once, then the generated text
        assert usage[0].completion_tokens == 20
    else:
        # an engine holds back what might begin a stop string, which a broken leg never sent: the
        # continuation goes on from the text the client received (faithful up to re-tokenization)
        _, rest = await raw_post(good.url, "/v1/completions", {**cont, "stream_options": {"include_usage": True}})
        rest_usage = next(e["usage"] for e in rest if isinstance(e, dict) and e.get("usage"))
        assert got == cont["prompt"] + text_of(rest, chat=False)
        assert usage[0].completion_tokens == 5 + rest_usage["completion_tokens"]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_an_echoed_prompt_is_not_looked_at_for_a_stop_string_across_the_seam(sims, gateway, engine):
    """An engine looks for stop strings in what it generates, never in the prompt, echoed or not.
    A stop string that begins in the echoed prompt and ends in the continuation's first characters
    does not end the answer: the unbroken engine would not have stopped there either."""
    kw = {"sglang_abort_delay_s": 0.0} if engine == "sglang" else {}
    bad = await sims(engine, "m", fault="drop_after=5", **kw)
    good = await sims(engine, "m", **kw)
    prompt = "Once upon a time"
    _, plain = await raw_post(good.url, "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 20,
                                                            "stream": True})
    generated = text_of(plain, chat=False)
    # longer than the first leg's text: an engine holds all of it back, the client gets the echoed
    # prompt alone before the break, and the continuation starts from the prompt
    stop = prompt[-3:] + generated[:40]
    assert len(stop) - 1 > len(text_of((await raw_post(good.url, "/v1/completions", {
        "model": "m", "prompt": prompt, "max_tokens": 5, "stream": True}))[1], chat=False))
    assert stop not in generated
    req = {"model": "m", "prompt": prompt, "max_tokens": 20, "stop": [stop]}
    _, ref = await raw_post(good.url, "/v1/completions", {**req, "echo": True, "stream": True})
    assert text_of(ref, chat=False) == prompt + generated               # the unbroken answer does not stop
    gw = await gateway([model_block("m", engine, [bad.url, good.url], strategy="round-robin", migration_limit=1)])
    client = openai_client(gw)
    with gw.gw.request_log.capture() as logs:
        stream = await client.completions.create(**req, echo=True, stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        await client.close()
        await until(lambda: any(e["event"] == "request" for e in logs))
    line = next(e for e in logs if e["event"] == "request")
    assert line["migrations"][0]["outcome"] == "continued" and "stop_at_seam" not in line["migrations"][0]
    choices = [c.choices[0] for c in chunks if c.choices]
    assert [ch.finish_reason for ch in choices if ch.finish_reason] == ["length"]
    # the continuation regenerates what the broken leg held back (its tokens counted as generated)
    left = 20 - line["migrations"][0]["tokens"]
    _, rest = await raw_post(good.url, "/v1/completions", {**req, "max_tokens": left, "stream": True})
    assert "".join(ch.text or "" for ch in choices) == prompt + text_of(rest, chat=False)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_an_echoed_completion_started_over_then_continued_has_the_prompt_once(sims, gateway, engine):
    """A first leg that broke before its first chunk starts over with ``echo``, as the client sent
    it: that leg's answer begins with the prompt, which is the client's, not generated. When that
    leg breaks in turn, its continuation holds the prompt once and the client gets the unbroken
    answer."""
    breaking = await sims(engine, "m", fault="drop_after=5")
    good = await sims(engine, "m")
    sent: list[dict] = []

    async def relay(request: web.Request) -> web.StreamResponse:
        """Two endpoints share it: the first leg either gets goes to an engine that breaks after 5
        tokens (its break passed on), every later one to a healthy engine."""
        body = await request.json()
        sent.append(body)
        upstream = breaking.url if len(sent) == 1 else good.url
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            async with aiohttp.ClientSession() as s, s.post(upstream + request.path, json=body) as r:
                async for chunk in r.content.iter_any():
                    await resp.write(chunk)
        except aiohttp.ClientPayloadError:
            request.transport.abort()
            return resp
        await resp.write_eof()
        return resp

    async def headers_then_break(request: web.Request) -> web.StreamResponse:
        """A stream that breaks after its headers, before its first chunk."""
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        request.transport.abort()
        return resp

    prompt = "Once upon a time"
    req = {"model": "m", "prompt": prompt, "max_tokens": 20}
    _, ref = await raw_post(good.url, "/v1/completions", {**req, "echo": True, "stream": True})
    paths = ("/v1/completions",)
    async with (fake_engine(headers_then_break, paths=paths) as first, fake_engine(relay, paths=paths) as a,
                fake_engine(relay, paths=paths) as b):
        gw = await gateway([model_block("m", engine, [first, a, b], strategy="round-robin", migration_limit=2)])
        client = openai_client(gw)
        stream = await client.completions.create(**req, echo=True, stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        await client.close()
    assert migrations(await gw.metrics_text(), "continued") == 2
    assert "".join(c.choices[0].text or "" for c in chunks if c.choices) == text_of(ref, chat=False)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 20
    restart, cont = sent
    assert restart.get("echo") is True and restart["prompt"] == prompt
    assert not cont.get("echo") and cont["max_tokens"] == 20 - 5
    if engine == "sglang":
        assert cont["prompt"].count(prompt) == 1


@pytest.mark.parametrize("stop", [None, ["@@@@"]])
async def test_an_echoed_chat_continues_from_its_generated_text_only(sims, gateway, stop):
    """vLLM's chat ``echo`` sends the last message's content back first (here the client's own
    prefill of the answer): it is the client's, not generated. The continuation extends the
    prefill with the generated text only and is sent without ``echo`` (which would send the
    extended message back once more); the client gets the unbroken answer (token-exact without a
    stop string, as text with one)."""
    bad = await sims("vllm", "m", fault="drop_after=5")
    good = await sims("vllm", "m")
    sent: list[dict] = []
    relay = recording_relay(good.url, sent)

    prefill = "Gateways are"
    messages = MSG + [{"role": "assistant", "content": prefill}]
    extra = {"echo": True, "continue_final_message": True, "add_generation_prompt": False}
    req = {"model": "m", "messages": messages, "max_tokens": 20, **({"stop": stop} if stop else {})}
    _, ref = await raw_post(good.url, "/v1/chat/completions",
                            {**req, **extra, "stream": True, "stream_options": {"include_usage": True}})
    ref_text = text_of(ref)
    assert ref_text.startswith(prefill)
    async with fake_engine(relay, paths=("/v1/chat/completions", "/v1/completions")) as other:
        gw = await gateway([model_block("m", "vllm", [bad.url, other], strategy="round-robin", migration_limit=1)])
        client = openai_client(gw)
        stream = await client.chat.completions.create(**req, stream=True, stream_options={"include_usage": True},
                                                      extra_body=extra)
        chunks = [c async for c in stream]
        await client.close()
    assert migrations(await gw.metrics_text(), "continued") == 1
    got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1
    (cont,) = sent
    assert not cont.get("echo")               # the client has the prefill already
    assert cont["max_tokens"] == 20 - 5
    if stop is None:                          # token-exact: a completion of the prompt's ids and the generated
        assert isinstance(cont["prompt"], list)
        assert got == ref_text and usage[0].completion_tokens == 20
    else:
        content = cont["messages"][-1]["content"]
        assert cont["messages"][:-1] == MSG and content.startswith(prefill) and content.count(prefill) == 1
        assert ref_text.startswith(content)
        _, rest = await raw_post(good.url, "/v1/chat/completions", {**cont, "stream_options": {"include_usage": True}})
        rest_usage = next(e["usage"] for e in rest if isinstance(e, dict) and e.get("usage"))
        assert got == content + text_of(rest)
        assert usage[0].completion_tokens == 5 + rest_usage["completion_tokens"]


FLAT = {"object": "error", "message": "boom", "type": "InternalServerError", "param": None, "code": 500}


@pytest.mark.parametrize("other", [True, False])
async def test_an_old_vllms_flat_error_event_fails_the_leg_as_a_wrapped_one(sims, gateway, other):
    """Older vLLM builds end a failing stream with a flat ``{"object": "error", "message": ...}``
    event (then ``[DONE]``) rather than ``{"error": {...}}``. It is the engine's error event all
    the same: the leg failed, and it is continued on another engine; with none, the stream ends
    with the final error event a wrapped one's gets, and the request's log line names the
    engine's error. The continuation relay
    dropped it and ended the answer there, cut short, with no finish_reason, no error and a 200
    with no error in the log, as though whole."""
    async def chat(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, word in enumerate([" alpha", " beta"]):
            ev = {"id": "chatcmpl-o", "object": "chat.completion.chunk", "created": 1, "model": "m",
                  "choices": [{"index": 0, "delta": {"content": word}, "logprobs": None, "finish_reason": None,
                               "token_ids": [100 + i]}],
                  "usage": {"prompt_tokens": 3, "completion_tokens": i + 1, "total_tokens": 4 + i}}
            if i == 0:
                ev["prompt_token_ids"] = [1, 2, 3]
            await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
        await resp.write(b"data: " + json.dumps(FLAT).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    good = await sims("vllm", "m")
    async with fake_engine(chat) as bad:
        urls = [bad, good.url] if other else [bad]
        gw = await gateway([model_block("m", "vllm", urls, strategy="round-robin", migration_limit=1)])
        with gw.gw.request_log.capture() as logs:
            st, got = await raw_post(gw.url, "/v1/chat/completions",
                                     {"model": "m", "messages": MSG, "max_tokens": 20, "stream": True})
            await until(lambda: any(e["event"] == "request" for e in logs))
    assert st == 200, got[-3:]
    line = next(e for e in logs if e["event"] == "request")
    assert text_of(got).startswith(" alpha beta")
    if other:
        assert got[-1] == "[DONE]", got[-3:]
        assert len(text_of(got)) > len(" alpha beta")
        fins = [e["choices"][0]["finish_reason"] for e in got if isinstance(e, dict) and e.get("choices")
                and e["choices"][0].get("finish_reason")]
        assert len(fins) == 1, got[-4:]
        assert migrations(await gw.metrics_text(), "continued") == 1
        assert line["migrations"][0]["reason"] == "stream_error" and line.get("error_class") is None
    else:
        errors = [e["error"] for e in got if isinstance(e, dict) and "error" in e]   # as a wrapped one's
        assert [e["message"] for e in errors] == ["boom"] and "error" in got[-1], got[-3:]
        assert line["migrations"][0]["outcome"] == "failed"
        assert (line["error_class"], line["error"]) == ("upstream_stream_error", "boom")


async def test_the_plain_relay_records_an_old_vllms_flat_error_event(gateway):
    """Without continuation the flat error event reaches the client as the engine sent it, and is
    the request's error, as a wrapped one is. It was passed on, but the request was logged as a
    200 without an error."""
    async def chat(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        ev = {"id": "chatcmpl-p", "object": "chat.completion.chunk", "created": 1, "model": "m",
              "choices": [{"index": 0, "delta": {"content": " alpha"}, "logprobs": None, "finish_reason": None}]}
        await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
        await resp.write(b"data: " + json.dumps(FLAT).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async with fake_engine(chat) as bad:
        gw = await gateway([model_block("m", "vllm", [bad])])
        with gw.gw.request_log.capture() as logs:
            st, got = await raw_post(gw.url, "/v1/chat/completions",
                                     {"model": "m", "messages": MSG, "max_tokens": 20, "stream": True})
            await until(lambda: any(e["event"] == "request" for e in logs))
    assert st == 200 and got[-2:] == [{**FLAT, "code": str(FLAT["code"])}, "[DONE]"], got[-3:]
    line = next(e for e in logs if e["event"] == "request")
    assert (line["error_class"], line["error"]) == ("upstream_stream_error", "boom")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_a_text_continuation_of_an_answer_that_fills_the_context_is_not_refused_for_its_length(
        sims, gateway, engine):
    """A chat whose max_tokens fills the context to the engine's limit, continued as text: the
    partial answer, tokenized again as part of the continuation's prompt, came out longer than the
    tokens generated (here " alpha beta", generated as one token), so its prompt and its reduced
    max_tokens passed the context and the engine refused the continuation with a 400 naming its
    limit; the stream ended with an error event. The continuation is sent again with the
    max_tokens that fits beside the prompt the engine counted."""
    ctx_len = 64
    good = await sims(engine, "m", max_model_len=ctx_len)
    async with aiohttp.ClientSession() as s, s.post(good.url + "/v1/chat/completions",
                                                    json={"model": "m", "messages": MSG, "max_tokens": 1}) as r:
        prompt = (await r.json())["usage"]["prompt_tokens"]
    # the most the engine takes beside that prompt: vLLM up to the context, SGLang short of it
    most = ctx_len - prompt - (1 if engine == "sglang" else 0)

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        ev = {"id": "chatcmpl-c", "object": "chat.completion.chunk", "created": 1, "model": "m",
              "choices": [{"index": 0, "delta": {"content": " alpha beta"}, "logprobs": None, "finish_reason": None}],
              "usage": {"prompt_tokens": prompt, "completion_tokens": 1, "total_tokens": prompt + 1}}
        await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
        request.transport.abort()
        return resp

    async with fake_engine(chat) as bad:
        gw = await gateway([model_block("m", engine, [bad, good.url], strategy="round-robin", migration_limit=1)])
        with gw.gw.request_log.capture() as logs:
            # a stop string: vLLM continues such a stream as text
            st, got = await raw_post(gw.url, "/v1/chat/completions",
                                     {"model": "m", "messages": MSG, "max_tokens": most, "stop": ["zzz!"],
                                      "stream": True})
            await until(lambda: any(e["event"] == "request" for e in logs))
    line = next(e for e in logs if e["event"] == "request")
    assert st == 200 and got[-1] == "[DONE]", [m.get("detail") for m in line["migrations"]]
    assert text_of(got).startswith(" alpha beta") and len(text_of(got)) > len(" alpha beta")
    fins = [e["choices"][0]["finish_reason"] for e in got if isinstance(e, dict) and e.get("choices")
            and e["choices"][0].get("finish_reason")]
    assert len(fins) == 1, got[-3:]
    assert line.get("error_class") is None and line["migrations"][0]["outcome"] == "continued", line


@pytest.mark.parametrize("when", ["same_read", "later"])
async def test_a_continuable_stream_ends_at_done_and_its_engines_connection_is_not_kept(gateway, when):
    """As the plain relay: ``data: [DONE]`` ends a stream that could be continued; an event the
    engine writes after it, in the same write or later, is not passed on, and the engine's
    connection, on which it wrote past its answer's end, is not used again (``after_end: trailing``)."""
    ports: list[int] = []
    words = [(" wagon", "stop")]
    extra = {"id": "chatcmpl-t", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": " caboose"}, "logprobs": None, "finish_reason": None}]}

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        ports.append(request.transport.get_extra_info("peername")[1])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for word, fin in words:
            ev = {"id": "chatcmpl-t", "object": "chat.completion.chunk", "created": 1, "model": "m",
                  "prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "delta": {"content": word},
                                                             "logprobs": None, "finish_reason": fin, "token_ids": [7]}],
                  "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
            await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
        trailing = b"data: " + json.dumps(extra).encode() + b"\n\n"
        if when == "same_read":
            await resp.write(b"data: [DONE]\n\n" + trailing)
        else:
            await resp.write(b"data: [DONE]\n\n")
            await asyncio.sleep(0.05)       # (a second write: the relay's order is the same either way)
            await resp.write(trailing)
        await resp.write_eof()
        return resp

    async with fake_engine(chat) as url:
        gw = await gateway([model_block("m", "vllm", [url], migration_limit=1)])
        with gw.gw.request_log.capture() as logs:
            async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/chat/completions", json={
                    "model": "m", "messages": MSG, "max_tokens": 20, "stream": True}) as r:
                st, raw = r.status, await r.read()
            await until(lambda: any(e["event"] == "request" for e in logs))
        assert st == 200 and raw.endswith(b"data: [DONE]\n\n") and b"caboose" not in raw, raw[-200:]
        assert raw.count(b"[DONE]") == 1, raw
        line = next(e for e in logs if e["event"] == "request")
        assert line["status"] == 200 and line["after_end"] == "trailing" and line["error_class"] is None, line
        client = openai_client(gw)
        stream = await client.chat.completions.create(model="m", messages=MSG, max_tokens=20, stream=True)
        assert [c.choices[0].delta.content async for c in stream if c.choices] == [" wagon"]
        await client.close()
        assert len(ports) == 2 and ports[0] != ports[1], ports     # the first connection was not kept
        assert migrations(await gw.metrics_text(), "continued") == 0


@pytest.mark.parametrize("fault", ["prefill_fails", "decode_silent"])
async def test_an_sglang_stream_continued_on_a_pair_that_fails_before_its_first_token_ends(sims, gateway, fault):
    """SGLang P/D: the stream's decode dies mid-stream and the continuation's pair fails before its
    decode's head (which SGLang sends with the first token): its prefill answers 500, or its decode
    takes the KV and then stays silent. The client's stream began long before; the continuation's
    legs are still waited for as a fresh request's are (the prefill's failure ends them, the
    first-chunk watchdog bounds the silent decode), not as a stream begun by that decode's first
    token, whose head the gateway awaited up to upstream.first_byte_timeout_s (5 minutes). The
    stream ends with its error event, the migration counted as failed, the continuation's decode
    told to stop."""
    def rs(name, p, d):
        return {"name": name, "prefill": [{"url": p.url, "bootstrap_port": p.bootstrap_port}], "decode": [d.url]}

    p1 = await sims("sglang", "m", role="prefill")
    d1 = await sims("sglang", "m", role="decode", fault="drop_after=3")
    p2 = await sims("sglang", "m", role="prefill", fault="status=500" if fault == "prefill_fails" else None)
    d2 = await sims("sglang", "m", role="decode",
                    fault="stall_before_first=inf" if fault == "decode_silent" else None)
    gw = await gateway([{"name": "m", "engine": "sglang", "rolesets": [rs("a", p1, d1), rs("b", p2, d2)],
                         "migration_limit": 1, "watchdog": {"first_chunk_timeout_s": 0.5}}],
                       health={"interval_s": 60}, breaker={"consecutive_faults": 100, "fault_rate": 0})
    req = {"model": "m", "messages": MSG, "max_tokens": 24, "stream": True}
    for _ in range(30):         # pairs are picked at random: until the stream began on the dying decode
        st, got = await asyncio.wait_for(raw_post(gw.url, "/v1/chat/completions", req), 30)
        if st == 200:
            break
    assert st == 200 and isinstance(got[-1], dict) and "error" in got[-1], got[-2:]
    assert text_of(got)             # the first leg's tokens went out
    text = await gw.metrics_text()
    assert migrations(text, "failed") == 1

    async def told(url: str) -> bool:
        return bool((await sim_state(url))["abort_requests"])
    await until(lambda: told(d2.url))


async def test_a_stream_that_streamed_reasoning_is_not_continued(sims, gateway):
    """vLLM's reasoning parser splits the answer: a continuation (a completion of the text so far)
    would run no parser, so a stream broken after its ``reasoning`` deltas is refused (reasoning),
    its client given the reasoning it had and the error event, the other engine never asked."""
    gw, good = await setup(sims, gateway, "vllm", "drop_after=2", reasoning_parser="deepseek_r1")
    st, got = await raw_post(gw.url, "/v1/chat/completions",
                             {"model": "m", "messages": MSG, "max_tokens": 10, "stream": True})
    assert st == 200 and isinstance(got[-1], dict) and "error" in got[-1], got[-2:]
    thought = "".join((e["choices"][0]["delta"].get("reasoning") or "") for e in got
                      if isinstance(e, dict) and e.get("choices"))
    assert thought and text_of(got) == ""
    assert migrations(await gw.metrics_text(), "refused_reasoning") == 1
    assert (await sim_state(good.url))["counts"]["started"] == 0
