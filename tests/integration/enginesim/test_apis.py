"""enginesim's Messages, pooling and audio surfaces, straight from the engine (no gateway)."""

from __future__ import annotations

import functools
import json

import aiohttp
import orjson

from tests.support.http import sse_frames

MSGS = [{"role": "user", "content": "Hello there"}]


async def test_vllm_messages_event_sequence_and_errors(sims):
    v = await sims("vllm", "llama")
    async with aiohttp.ClientSession() as s:
        body = {"model": "llama", "max_tokens": 3, "stream": True, "system": "Be brief.", "messages": MSGS}
        async with s.post(v.url + "/v1/messages", json=body) as r:
            got = sse_frames(await r.read())
        assert [n for n, _ in got] == ["message_start", "content_block_start", "content_block_delta",
                                       "content_block_delta", "content_block_delta", "content_block_stop",
                                       "message_delta", "message_stop"]
        assert all(n == d["type"] for n, d in got)
        start, delta = got[0][1]["message"], got[-2][1]
        assert start["usage"] == {"input_tokens": delta["usage"]["input_tokens"], "output_tokens": 0}
        assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
        assert delta["usage"]["output_tokens"] == 3
        async with s.post(v.url + "/v1/messages/count_tokens", json={"model": "llama", "system": "Be brief.",
                                                                    "messages": MSGS}) as r:
            n = delta["usage"]["input_tokens"]
            assert await r.json() == {"input_tokens": n, "context_management": {"original_input_tokens": n}}
        async with s.post(v.url + "/v1/messages", json={**body, "model": "other"}) as r:
            assert r.status == 404 and (await r.json()) == {"type": "error", "error": {
                "type": "NotFoundError", "message": "The model `other` does not exist."}}
        async with s.post(v.url + "/v1/messages", json={**body, "stream": False}) as r:
            msg = await r.json()
        assert msg["type"] == "message" and msg["content"][0]["type"] == "text" and "stop_sequence" not in msg


async def test_sglang_messages_dialect_and_its_own_pooling_surface(sims):
    s1 = await sims("sglang", "qwen")
    async with aiohttp.ClientSession() as s:
        body = {"model": "any-name", "max_tokens": 3, "messages": MSGS}
        async with s.post(s1.url + "/v1/messages", json=body) as r:
            got = await r.json()
        assert r.status == 200 and got["id"].startswith("msg_") and got["model"] == "any-name"
        assert got["stop_reason"] == "max_tokens" and "stop_sequence" not in got
        n = got["usage"]["input_tokens"]
        assert got["usage"] == {"input_tokens": n, "output_tokens": 3, "cache_read_input_tokens": 0}
        async with s.post(s1.url + "/v1/messages", json={**body, "stream": True}) as r:
            frames = [f for f in (await r.text()).split("\n\n") if f]
        names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
        assert names == ["message_start", "content_block_start", *["content_block_delta"] * 3,
                         "content_block_stop", "message_delta", "message_stop"]
        start, delta = (orjson.loads(frames[i].split("data: ", 1)[1]) for i in (0, 6))
        assert start["message"]["usage"] == {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0}
        assert delta["delta"] == {"stop_reason": "max_tokens"}
        assert delta["usage"]["input_tokens"] == n and delta["usage"]["cache_read_input_tokens"] > 0
        async with s.post(s1.url + "/v1/messages/count_tokens", json={"model": "m", "messages": MSGS}) as r:
            assert await r.json() == {"input_tokens": n}
        async with s.post(s1.url + "/v1/messages", json={**body, "max_tokens": 10**6}) as r:
            assert r.status == 500 and await r.json() == {
                "type": "error", "error": {"type": "internal_error", "message": "Internal processing error"}}
        async with s.post(s1.url + "/v1/messages", json={**body, "max_tokens": 10**6, "stream": True}) as r:
            text = await r.text()
        assert r.status == 200 and text.startswith("event: error\n") and text.endswith(
            'event: message_stop\ndata: {"type":"message_stop"}\n\n') and "Stream processing error" in text
        async with s.post(s1.url + "/v1/messages", json={**body, "messages": [{"role": "system", "content": "x"}]}) as r:
            assert r.status == 400 and (await r.json())["object"] == "error"
        for stream in (False, True):      # stop_sequences its request model refuses: its validation 400
            async with s.post(s1.url + "/v1/messages", json={**body, "stop_sequences": 5, "stream": stream}) as r:
                assert r.status == 400 and (await r.json())["object"] == "error"
        async with s.post(s1.url + "/v1/tokenize", json={"prompt": ["ab", "cdefgh"]}) as r:
            got = await r.json()
        assert got["count"] == [1, 2] and len(got["tokens"]) == 2
        async with s.post(s1.url + "/v1/rerank", json={"query": " ", "documents": ["a"]}) as r:
            assert r.status == 400 and (await r.json())["object"] == "error"


async def test_vllm_transcription_formats(sims):
    v = await sims("vllm", "whisper")
    audio = bytes(70_000)
    async with aiohttp.ClientSession() as s:
        for fmt, check in (("json", lambda b: orjson.loads(b)["usage"] == {"type": "duration", "seconds": 3}),
                           ("text", lambda b: b and not b.startswith(b"{")),
                           ("verbose_json", lambda b: orjson.loads(b)["duration"] == "3")):
            form = aiohttp.FormData()
            form.add_field("model", "whisper")
            form.add_field("response_format", fmt)
            form.add_field("file", audio, filename="a.wav")
            async with s.post(v.url + "/v1/audio/transcriptions", data=form) as r:
                assert r.status == 200 and check(await r.read())
        form = aiohttp.FormData()
        form.add_field("model", "whisper")
        async with s.post(v.url + "/v1/audio/transcriptions", data=form) as r:
            assert r.status == 400


async def test_vllm_transcription_streams_as_vllms_form_reads_stream(sims):
    """``stream`` is read as vLLM's form model reads a bool: ``1``, ``on``, ``True`` stream, an
    empty field is the default (false), another word is a 400."""
    v = await sims("vllm", "whisper")
    audio = bytes(70_000)

    async def send(path: str, **fields: str) -> tuple[int, str, bytes]:
        form = aiohttp.FormData()
        form.add_field("model", "whisper")
        for k, val in fields.items():
            form.add_field(k, val)
        form.add_field("file", audio, filename="a.wav")
        async with aiohttp.ClientSession() as s, s.post(v.url + path, data=form) as r:
            return r.status, r.headers.get("Content-Type", ""), await r.read()

    status, _, whole = await send("/v1/audio/transcriptions")
    text = orjson.loads(whole)["text"]
    for word in ("1", "on", "True", "yes"):
        status, ctype, raw = await send("/v1/audio/transcriptions", stream=word, stream_include_usage="1")
        assert status == 200 and ctype.startswith("text/event-stream"), raw
        assert raw.endswith(b"data: [DONE]\n\n")
        got = [d for _, d in sse_frames(raw[:-len(b"data: [DONE]\n\n")])]
        chunks = [d for d in got if d["choices"]]
        assert {d["object"] for d in got} == {"transcription.chunk"}
        assert "".join(d["choices"][0]["delta"]["content"] for d in chunks) == text
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert got[-1]["usage"]["completion_tokens"] == len(chunks)
    status, ctype, raw = await send("/v1/audio/translations", stream="1")
    assert status == 200 and b'"translation.chunk"' in raw and b'"usage"' not in raw
    status, ctype, raw = await send("/v1/audio/transcriptions", stream="")
    assert status == 200 and ctype.startswith("application/json"), raw
    for fields in ({"stream": "maybe"}, {"stream": "0", "stream_include_usage": "1"}):
        status, _, raw = await send("/v1/audio/transcriptions", **fields)
        assert status == 400, raw


async def test_vllm_choices_interleave_each_in_its_own_chunks(sims):
    v = await sims("vllm", "llama")
    async with aiohttp.ClientSession() as s:
        body = {"model": "llama", "max_tokens": 3, "n": 2, "stream": True, "messages": MSGS,
                "stream_options": {"include_usage": True}}
        async with s.post(v.url + "/v1/chat/completions", json=body) as r:
            raw = await r.read()
        assert raw.endswith(b"data: [DONE]\n\n")
        got = [d for _, d in sse_frames(raw[:-len(b"data: [DONE]\n\n")])]
        chunks = [d for d in got if d["choices"]]
        assert all(len(d["choices"]) == 1 for d in chunks)
        order = [d["choices"][0]["index"] for d in chunks]
        assert order[:2] == [0, 1] and all(d["choices"][0]["delta"].get("role") for d in chunks[:2])
        assert sorted(order) == [0] * 4 + [1] * 4 and order != sorted(order)     # interleaved
        ends = {d["choices"][0]["index"]: d["choices"][0]["finish_reason"] for d in chunks
                if d["choices"][0]["finish_reason"]}
        assert ends == {0: "length", 1: "length"}
        assert got[-1]["usage"]["completion_tokens"] == 6
        async with s.post(v.url + "/v1/completions", json={"model": "llama", "prompt": "hi", "max_tokens": 2,
                                                           "n": 3}) as r:
            whole = await r.json()
        assert [c["index"] for c in whole["choices"]] == [0, 1, 2] and whole["usage"]["completion_tokens"] == 6


async def test_sglang_choices_each_in_their_own_chunks(sims):
    """SGLang serves ``n`` > 1 (its parallel sampling): each choice its own sequence, a stream's
    chunks carrying one choice each (a chat's role chunk on each choice's first, its finish in a
    chunk of its own), the usage the prompt once and every choice's tokens."""
    s1 = await sims("sglang", "qwen")
    body = {"model": "qwen", "max_tokens": 3, "n": 2, "stream": True, "messages": MSGS,
            "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as s:
        async with s.post(s1.url + "/v1/chat/completions", json=body) as r:
            raw = await r.read()
            assert r.status == 200, raw
        got = [d for _, d in sse_frames(raw[:-len(b"data: [DONE]\n\n")])]
        chunks = [d for d in got if d["choices"]]
        assert all(len(d["choices"]) == 1 for d in chunks)
        roles = [d["choices"][0]["index"] for d in chunks if d["choices"][0]["delta"].get("role")]
        assert sorted(roles) == [0, 1]
        texts = {0: "", 1: ""}
        for d in chunks:
            texts[d["choices"][0]["index"]] += d["choices"][0]["delta"].get("content") or ""
        ends = {d["choices"][0]["index"]: d["choices"][0]["finish_reason"] for d in chunks
                if d["choices"][0]["finish_reason"]}
        assert ends == {0: "length", 1: "length"} and texts[0] != texts[1]
        usage = got[-1]["usage"]
        assert got[-1]["choices"] == [] and usage["completion_tokens"] == 6
        async with s.post(s1.url + "/v1/chat/completions", json={**body, "stream": False, "n": 1}) as r:
            one = await r.json()
        assert usage["prompt_tokens"] == one["usage"]["prompt_tokens"]
        async with s.post(s1.url + "/v1/completions", json={"model": "qwen", "prompt": "hi", "max_tokens": 2,
                                                            "n": 3}) as r:
            whole = await r.json()
            assert r.status == 200, whole
        assert [c["index"] for c in whole["choices"]] == [0, 1, 2] and whole["usage"]["completion_tokens"] == 6


TOOLS = [{"name": f"lookup_route_{i}", "description": f"Look up route table {i} of the fleet by prefix.",
          "input_schema": {"type": "object", "properties": {"prefix": {"type": "string"}}, "required": ["prefix"]}}
         for i in range(4)]
CHAT_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                "parameters": t["input_schema"]}} for t in TOOLS]


async def _usage(s: aiohttp.ClientSession, url: str, path: str, body: dict) -> dict:
    """The usage of a request for model ``m`` (a count's whole answer)."""
    async with s.post(url + path, json={"model": "m", **body}) as r:
        got = await r.json()
        assert r.status == 200, got
    return got if path.endswith(("count_tokens", "tokenize")) else got["usage"]


async def test_the_tools_a_request_offers_count_in_its_prompt_tokens(sims):
    """An engine renders the tools a request offers into the prompt (the chat template's
    ``tools``): they are prompt tokens, about one for every four characters of their JSON, and the
    same tools count the same on chat, on the Messages API (both engines build the chat request's
    tools from its ``tools``), its count_tokens, the Responses API's function tools and vLLM's
    /tokenize of a chat."""
    for engine in ("vllm", "sglang"):
        sim = await sims(engine, "m")
        async with aiohttp.ClientSession() as s:
            usage = functools.partial(_usage, s, sim.url)
            bare = (await usage("/v1/chat/completions", {"max_tokens": 1, "messages": MSGS}))["prompt_tokens"]
            chat = (await usage("/v1/chat/completions", {"max_tokens": 1, "messages": MSGS,
                                                         "tools": CHAT_TOOLS}))["prompt_tokens"]
            assert chat - bare >= len(orjson.dumps(CHAT_TOOLS)) // 5, (engine, bare, chat)
            msg = await usage("/v1/messages", {"max_tokens": 1, "messages": MSGS, "tools": TOOLS})
            assert msg["input_tokens"] == chat, engine
            counted = await usage("/v1/messages/count_tokens", {"messages": MSGS, "tools": TOOLS})
            assert counted["input_tokens"] == chat, engine
            flat = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
            resp = await usage("/v1/responses", {"max_output_tokens": 1, "input": MSGS[0]["content"], "tools": flat})
            assert resp.get("input_tokens", resp.get("prompt_tokens")) == chat, engine     # SGLang's: chat's names
            if engine == "vllm":
                assert (await usage("/tokenize", {"messages": MSGS, "tools": CHAT_TOOLS}))["count"] == chat


def _tool_turn(result: str) -> tuple[list[dict], list[dict]]:
    """One conversation that called a tool and gives back its ``result``: as Messages blocks, and
    as the chat both engines make of them (the call an assistant's ``tool_calls``, its input as
    JSON; the result a ``tool`` message)."""
    args = {"path": "routes.txt", "content": "route 10.0.0.0/8 via east\n" * 20}
    blocks = [{"role": "user", "content": "Write the routing table, then read it back."},
              {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "write_file",
                                                 "input": args}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                            "content": [{"type": "text", "text": result}]}]}]
    chat = [blocks[0],
            {"role": "assistant", "content": None, "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
                "name": "write_file", "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": result}]
    return blocks, chat


async def test_a_conversations_tool_calls_and_results_count_in_its_prompt_tokens(sims):
    """An engine renders an earlier tool call (its arguments) and the tool's result into the
    prompt: a Messages ``tool_use`` block and ``tool_result`` block are the chat's ``tool_calls``
    and ``tool`` message they become, so a long result is a long prompt, on chat and on Messages."""
    long = "route 10.0.0.0/8 via the east gateway, metric 20\n" * 40       # ~2,000 characters
    for engine in ("vllm", "sglang"):
        sim = await sims(engine, "m")
        async with aiohttp.ClientSession() as s:
            usage = functools.partial(_usage, s, sim.url)
            counted = {}
            for result in ("42", long):
                blocks, chat = _tool_turn(result)
                msg = await usage("/v1/messages", {"max_tokens": 1, "messages": blocks})
                prompt = (await usage("/v1/chat/completions", {"max_tokens": 1, "messages": chat}))["prompt_tokens"]
                assert msg["input_tokens"] == prompt, (engine, result[:10])
                counted[result] = prompt
            assert counted[long] - counted["42"] >= len(long) // 5, (engine, counted)
            bare = (await usage("/v1/chat/completions", {"max_tokens": 1, "messages": chat[:1]}))["prompt_tokens"]
            assert counted["42"] - bare >= len(chat[1]["tool_calls"][0]["function"]["arguments"]) // 5, engine


async def test_vllm_completion_batch_of_prompts_answers_each_prompts_choices(sims):
    """vLLM's completions take a list of prompts (strings or token id lists) as a batch: choice
    ``prompt_i * n + j`` is prompt i's j-th, each echoing its own prompt; usage counts every prompt
    once and every choice's tokens; a stream sends each choice in chunks of its own, then the usage."""
    v = await sims("vllm", "llama")
    prompts = ["one prompt here", "and a second, longer prompt than that"]
    async with aiohttp.ClientSession() as s:
        async with s.post(v.url + "/tokenize", json={"model": "llama", "prompt": prompts[0]}) as r:
            ids0 = (await r.json())["tokens"]
        async with s.post(v.url + "/tokenize", json={"model": "llama", "prompt": prompts[1]}) as r:
            ids1 = (await r.json())["tokens"]
        body = {"model": "llama", "prompt": prompts, "max_tokens": 2, "n": 2, "echo": True}
        async with s.post(v.url + "/v1/completions", json=body) as r:
            whole = await r.json()
            assert r.status == 200, whole
        assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
        assert [c["text"].startswith(prompts[i // 2]) for i, c in enumerate(whole["choices"])] == [True] * 4
        assert whole["usage"]["prompt_tokens"] == len(ids0) + len(ids1)
        assert whole["usage"]["completion_tokens"] == 8
        assert whole["usage"]["total_tokens"] == len(ids0) + len(ids1) + 8
        # token id prompts, one choice each
        async with s.post(v.url + "/v1/completions", json={"model": "llama", "prompt": [ids0, ids1],
                                                           "max_tokens": 3}) as r:
            ids_whole = await r.json()
            assert r.status == 200, ids_whole
        assert [c["index"] for c in ids_whole["choices"]] == [0, 1]
        assert ids_whole["usage"]["prompt_tokens"] == len(ids0) + len(ids1)
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with s.post(v.url + "/v1/completions", json=body) as r:
            raw = await r.read()
            assert r.status == 200, raw
    assert raw.endswith(b"data: [DONE]\n\n")
    got = [d for _, d in sse_frames(raw[:-len(b"data: [DONE]\n\n")])]
    chunks = [d for d in got if d["choices"]]
    assert all(len(d["choices"]) == 1 for d in chunks)
    texts: dict[int, str] = {}
    for d in chunks:
        texts[d["choices"][0]["index"]] = texts.get(d["choices"][0]["index"], "") + d["choices"][0]["text"]
    assert sorted(texts) == [0, 1, 2, 3]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}     # same seed, same answers
    ends = {d["choices"][0]["index"] for d in chunks if d["choices"][0]["finish_reason"] == "length"}
    assert ends == {0, 1, 2, 3}
    assert got[-1]["choices"] == [] and got[-1]["usage"]["prompt_tokens"] == len(ids0) + len(ids1)
    assert got[-1]["usage"]["completion_tokens"] == 8


async def test_vllm_logprobs_ride_each_choice_and_chunk(sims):
    """vLLM answers ``logprobs`` (a chat's flag with ``top_logprobs``, a completion's count): a
    chat choice's ``logprobs.content`` has one entry per generated token (``token``, ``logprob``,
    ``bytes``, ``top_logprobs`` of the count asked), a completion's ``tokens``, ``token_logprobs``,
    ``text_offset`` and ``top_logprobs``; a stream's chunks carry their own tokens' entries, the same
    as the whole answer's; what vLLM's request models refuse is a 400."""
    v = await sims("vllm", "llama")
    async with aiohttp.ClientSession() as s:
        body = {"model": "llama", "messages": MSGS, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
        async with s.post(v.url + "/v1/chat/completions", json=body) as r:
            whole = await r.json()
            assert r.status == 200, whole
        content = whole["choices"][0]["logprobs"]["content"]
        assert "".join(e["token"] for e in content) == whole["choices"][0]["message"]["content"]
        assert len(content) == 4 and all(e["logprob"] <= 0 and bytes(e["bytes"]) == e["token"].encode()
                                         for e in content)
        assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"] for e in content)
        async with s.post(v.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
            raw = await r.read()
        chunks = [d for _, d in sse_frames(raw[:-len(b"data: [DONE]\n\n")])]
        streamed = [e for d in chunks for e in (d["choices"][0]["logprobs"] or {}).get("content", [])]
        assert streamed == content
        async with s.post(v.url + "/v1/chat/completions", json={**body, "logprobs": False}) as r:
            assert r.status == 400 and "`logprobs` must be set to true" in (await r.json())["error"]["message"]
        async with s.post(v.url + "/v1/chat/completions", json={**body, "logprobs": True, "top_logprobs": 0}) as r:
            none_top = await r.json()
        assert all(e["top_logprobs"] == [] for e in none_top["choices"][0]["logprobs"]["content"])
        async with s.post(v.url + "/v1/chat/completions", json={**body, "top_logprobs": 21}) as r:
            assert r.status == 400, await r.text()

        cbody = {"model": "llama", "prompt": "Once upon a time", "max_tokens": 3, "logprobs": 1}
        async with s.post(v.url + "/v1/completions", json=cbody) as r:
            comp = await r.json()
            assert r.status == 200, comp
        lp, text = comp["choices"][0]["logprobs"], comp["choices"][0]["text"]
        assert "".join(lp["tokens"]) == text and len(lp["token_logprobs"]) == 3
        assert [text[o:].startswith(t) for o, t in zip(lp["text_offset"], lp["tokens"], strict=True)] == [True] * 3
        assert all(list(top) == [t] for top, t in zip(lp["top_logprobs"], lp["tokens"], strict=True))
        async with s.post(v.url + "/v1/completions", json={**cbody, "echo": True, "stream": True}) as r:
            raw = await r.read()
        chunks = [d for _, d in sse_frames(raw[:-len(b"data: [DONE]\n\n")])]
        offsets = [o for d in chunks if d["choices"] for o in d["choices"][0]["logprobs"]["text_offset"]]
        # the echoed prompt's tokens come first, from 0; the generated ones' offsets follow its text
        assert offsets[-3:] == [len("Once upon a time") + o for o in lp["text_offset"]] and offsets[0] == 0
        async with s.post(v.url + "/v1/completions", json={**cbody, "logprobs": -1}) as r:
            assert r.status == 400 and "positive" in (await r.json())["error"]["message"]


async def test_vllm_completion_of_no_tokens_with_echo_answers_the_prompt(sims):
    """vLLM serves a completion with ``max_tokens: 0`` and ``echo``: it generates one token and
    answers the prompt alone (``finish_reason: length``, the token counted in usage), streamed or
    not, for each prompt of a batch; without ``echo`` the 0 is refused."""
    v = await sims("vllm", "llama")
    body = {"model": "llama", "prompt": "Once upon a time", "max_tokens": 0, "echo": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(v.url + "/v1/completions", json=body) as r:
            whole = await r.json()
            assert r.status == 200, whole
        assert [(c["text"], c["finish_reason"]) for c in whole["choices"]] == [("Once upon a time", "length")]
        assert whole["usage"]["completion_tokens"] == 1
        async with s.post(v.url + "/v1/completions", json={**body, "stream": True}) as r:
            raw = await r.read()
        chunks = [d for _, d in sse_frames(raw[:-len(b"data: [DONE]\n\n")])]
        assert "".join(d["choices"][0]["text"] for d in chunks) == "Once upon a time"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        async with s.post(v.url + "/v1/completions", json={**body, "prompt": ["one", "two"], "n": 2}) as r:
            batch = await r.json()
        assert [c["text"] for c in batch["choices"]] == ["one", "one", "two", "two"]
        async with s.post(v.url + "/v1/completions", json={**body, "echo": False}) as r:
            assert r.status == 400


async def test_vllm_refuses_what_its_request_models_refuse(sims):
    """Values real vLLM refuses with a 400: a ``seed`` outside the signed 64-bit range, and an
    embedding of ``dimensions: 0``; the values beside them are served. ``best_of``, which vLLM (V1)
    no longer has, is ignored whatever its value, as any field its requests do not have."""
    v = await sims("vllm", "llama")
    comp = {"model": "llama", "prompt": "hi", "max_tokens": 1}
    async with aiohttp.ClientSession() as s:
        for extra, ok in (({"best_of": 0}, True), ({"best_of": 1, "n": 2}, True), ({"best_of": 2, "n": 2}, True),
                          ({"best_of": "two"}, True), ({"best_of": -3}, True), ({"seed": 1 << 63}, False), ({"seed": -(1 << 63) - 1}, False),
                          ({"seed": (1 << 63) - 1}, True), ({"seed": -(1 << 63)}, True)):
            async with s.post(v.url + "/v1/completions", json={**comp, **extra}) as r:
                got = await r.json()
            assert (r.status == 200) is ok and (ok or got["error"]["param"] == next(iter(extra))), (extra, got)
        async with s.post(v.url + "/v1/chat/completions", json={"model": "llama", "messages": MSGS, "max_tokens": 1,
                                                                "seed": 1 << 64}) as r:
            assert r.status == 400
        for dims, status in ((0, 400), (-1, 400), (3, 200)):
            async with s.post(v.url + "/v1/embeddings", json={"model": "llama", "input": "hi",
                                                              "dimensions": dims}) as r:
                got = await r.json()
            assert r.status == status, (dims, got)
        assert len(got["data"][0]["embedding"]) == 3


async def test_vllm_refuses_a_suffix_a_logit_bias_it_cannot_read_and_an_empty_embedding(sims):
    """vLLM answers a completion's ``suffix`` (any, an empty one too) with its 400 ``suffix is not
    currently supported``; a ``logit_bias`` key that is not an integer (its SamplingParams' int())
    or is out of the vocabulary is a 400, on chat too; an embedding whose input has no token is
    its 400 ``The decoder prompt cannot be empty``, never an answer of 0 prompt tokens."""
    v = await sims("vllm", "llama")
    comp = {"model": "llama", "prompt": "hi", "max_tokens": 1}
    chat = {"model": "llama", "messages": MSGS, "max_tokens": 1}
    async with aiohttp.ClientSession() as s:
        async def ask(path: str, body: dict) -> tuple[int, dict]:
            async with s.post(v.url + path, json=body) as r:
                return r.status, await r.json()
        for suffix in ("x", ""):
            assert await ask("/v1/completions", {**comp, "suffix": suffix}) == (400, {"error": {
                "message": "suffix is not currently supported", "type": "BadRequestError", "param": None,
                "code": 400}})
        assert (await ask("/v1/completions", {**comp, "suffix": None}))[0] == 200
        for body in (comp, chat):
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            status, got = await ask(path, {**body, "logit_bias": {"abc": 1}})
            assert status == 400 and got["error"]["message"] == "invalid literal for int() with base 10: 'abc'", got
            status, got = await ask(path, {**body, "logit_bias": {str(1 << 30): 1, "-1": 1}})
            assert status == 400 and got["error"]["param"] == "logit_bias", got
            assert got["error"]["message"].startswith(f"token_id(s) [{1 << 30}, -1] in logit_bias contain "
                                                      "out-of-vocab token ids. Vocabulary size: "), got
            assert (await ask(path, {**body, "logit_bias": {"1000": -100, "7": 5.5}}))[0] == 200
        for empty in ("", [""], ["hi", ""]):
            status, got = await ask("/v1/embeddings", {"model": "llama", "input": empty})
            assert (status, got["error"]["message"]) == (400, "The decoder prompt cannot be empty"), (empty, got)
        status, got = await ask("/v1/embeddings", {"model": "llama", "input": ["hi", "there"]})
        assert status == 200 and got["usage"]["prompt_tokens"] > 0


async def test_vllm_refuses_an_embeddings_input_mixing_strings_and_token_ids(sims, gateway):
    """vLLM's embeddings ``input`` is a string, a list of strings, token ids or a list of token-id
    lists: a list mixing strings and token-id lists is none of them, its 400 validation error (the
    simulator embedded each item). Through the gateway its own 400 comes first."""
    v = await sims("vllm", "llama")
    async with aiohttp.ClientSession() as s:
        for mixed in (["hi", [1, 2]], [[1, 2], "hi"]):
            for path in ("/v1/embeddings", "/pooling"):
                async with s.post(v.url + path, json={"model": "llama", "input": mixed}) as r:
                    got = await r.json()
                assert r.status == 400 and got["error"]["param"] == "input", (path, mixed, got)
                assert got["error"]["message"].startswith("1 validation error"), got
        gw = await gateway([{"name": "llama", "engine": "vllm", "endpoints": [v.url]}])
        async with s.post(gw.url + "/v1/embeddings", json={"model": "llama", "input": ["hi", [1, 2]]}) as r:
            got = await r.json()
        assert r.status == 400 and r.headers.get("x-error-request-body-processing") == "true", got
        assert got["error"]["message"] == "'input' must be a string, an array of strings, or token ids", got


async def test_vllm_answers_prompt_logprobs_asked_for_on_their_own(sims):
    """vLLM's ``prompt_logprobs`` (a completion's or a chat's, without ``echo``) computes the
    prompt's logprobs: a completion's choice carries them, a chat's answer at its top level, None
    for the first token and then the prompt's token and the best ones, keyed by id. A stream may
    ask for 0 only; a count below -1 or not an integer is a 400."""
    v = await sims("vllm", "llama")
    comp = {"model": "llama", "prompt": "hello there general", "max_tokens": 2}
    chat = {"model": "llama", "messages": MSGS, "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        async with s.post(v.url + "/v1/completions", json={**comp, "prompt_logprobs": 2}) as r:
            got = await r.json()
        plp = got["choices"][0]["prompt_logprobs"]
        assert r.status == 200 and len(plp) == got["usage"]["prompt_tokens"] and plp[0] is None
        assert all(1 <= len(p) <= 3 and {"logprob", "rank", "decoded_token"} <= set(next(iter(p.values())))
                   for p in plp[1:]), plp
        assert got["choices"][0]["logprobs"] is None and got["choices"][0]["text"]
        async with s.post(v.url + "/v1/chat/completions", json={**chat, "prompt_logprobs": 0}) as r:
            got = await r.json()
        assert r.status == 200 and len(got["prompt_logprobs"]) == got["usage"]["prompt_tokens"]
        assert all(len(p) == 1 for p in got["prompt_logprobs"][1:])
        for path, body in (("/v1/completions", comp), ("/v1/chat/completions", chat)):
            for extra, message in (({"stream": True, "prompt_logprobs": 1},
                                    "`prompt_logprobs` are not available when `stream=True`."),
                                   ({"prompt_logprobs": -2}, "`prompt_logprobs` must be a positive value or -1."),
                                   ({"prompt_logprobs": "x"}, "`prompt_logprobs` must be an integer.")):
                async with s.post(v.url + path, json={**body, **extra}) as r:
                    got = await r.json()
                assert (r.status, got["error"]["message"], got["error"]["param"]) == (
                    400, message, "prompt_logprobs"), (path, extra, got)
            async with s.post(v.url + path, json={**body, "stream": True, "prompt_logprobs": 0}) as r:
                assert r.status == 200
                await r.read()


async def test_messages_bodies_the_engines_request_models_refuse(sims):
    """vLLM's and SGLang's Messages request models refuse a ``tool_choice`` that is not an object,
    ``metadata`` that is not one, ``stop_sequences`` that are not a list of strings, and a message's
    role outside theirs (vLLM: user, assistant, system, and Claude Code's ctx and msg, read as
    user; SGLang: user and assistant), each with its validation 400 naming the field, also on
    count_tokens where the field is one of its model's (tool_choice, the roles)."""
    v = await sims("vllm", "llama")
    sg = await sims("sglang", "qwen")
    base = {"max_tokens": 2, "messages": MSGS}
    refused = [({"tool_choice": "auto"}, "tool_choice"), ({"metadata": "x"}, "metadata"),
               ({"stop_sequences": "x"}, "stop_sequences"), ({"stop_sequences": ["x", 1]}, "stop_sequences.1"),
               ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role")]
    served = [{"tool_choice": {"type": "auto"}}, {"metadata": {"user_id": "u"}}, {"stop_sequences": ["x"]},
              {"metadata": None, "tool_choice": None, "stop_sequences": None}]
    async with aiohttp.ClientSession() as s:
        for sim, model in ((v, "llama"), (sg, "qwen")):
            for extra, where in refused:
                for path in ("/v1/messages", "/v1/messages/count_tokens"):
                    if path.endswith("count_tokens") and where not in ("tool_choice", "messages.0.role"):
                        continue
                    async with s.post(sim.url + path, json={"model": model, **base, **extra}) as r:
                        got = await r.json()
                    assert r.status == 400, (sim.cfg.engine, path, extra, got)
                    message = got["error"]["message"] if sim is v else got["message"]
                    assert f"\n  {where}: " in message, (sim.cfg.engine, path, extra, got)
            for extra in served:
                async with s.post(sim.url + "/v1/messages", json={"model": model, **base, **extra}) as r:
                    assert r.status == 200, (sim.cfg.engine, extra, await r.text())
        for role in ("ctx", "msg", "system"):
            body = {"model": "llama", **base, "messages": [{"role": role, "content": "Be brief."}, *MSGS]}
            async with s.post(v.url + "/v1/messages", json=body) as r:
                assert r.status == 200, (role, await r.text())


async def test_sglang_logprobs_ride_each_choice_and_chunk(sims):
    """SGLang answers ``logprobs`` in OpenAI's shape: a chat's flag with ``top_logprobs`` gives
    ``logprobs.content``, one entry per generated token (``token``, ``bytes``, ``logprob``,
    ``top_logprobs`` of the count asked, none without one); a completion's count gives ``tokens``,
    ``token_logprobs``, ``text_offset`` (-1: SGLang does not compute them) and ``top_logprobs`` of
    that many per token. A stream's chunks carry their own tokens' entries, the same as the whole
    answer's, and each of several choices carries its own."""
    g = await sims("sglang", "qwen")
    async with aiohttp.ClientSession() as s:
        body = {"model": "qwen", "messages": MSGS, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
        async with s.post(g.url + "/v1/chat/completions", json=body) as r:
            whole = await r.json()
            assert r.status == 200, whole
        content = whole["choices"][0]["logprobs"]["content"]
        assert "".join(e["token"] for e in content) == whole["choices"][0]["message"]["content"]
        assert len(content) == 4 and all(e["logprob"] <= 0 and bytes(e["bytes"]) == e["token"].encode()
                                         for e in content)
        assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"] for e in content)
        async with s.post(g.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
            raw = await r.read()
        chunks = [d for _, d in sse_frames(raw[:-len(b"data: [DONE]\n\n")])]
        streamed = [e for d in chunks for e in (d["choices"][0]["logprobs"] or {}).get("content", [])]
        assert streamed == content
        async with s.post(g.url + "/v1/chat/completions", json={**body, "top_logprobs": None}) as r:
            bare = await r.json()
        assert [e["top_logprobs"] for e in bare["choices"][0]["logprobs"]["content"]] == [[]] * 4
        async with s.post(g.url + "/v1/chat/completions", json={**body, "logprobs": False}) as r:
            assert (await r.json())["choices"][0]["logprobs"] is None
        async with s.post(g.url + "/v1/chat/completions", json={**body, "n": 2}) as r:
            two = await r.json()
        assert [len(c["logprobs"]["content"]) for c in two["choices"]] == [4, 4]

        cbody = {"model": "qwen", "prompt": "Once upon a time", "max_tokens": 3, "logprobs": 2}
        async with s.post(g.url + "/v1/completions", json=cbody) as r:
            comp = await r.json()
            assert r.status == 200, comp
        lp, text = comp["choices"][0]["logprobs"], comp["choices"][0]["text"]
        assert "".join(lp["tokens"]) == text and len(lp["token_logprobs"]) == 3
        assert lp["text_offset"] == [-1] * 3
        assert all(len(top) == 2 and list(top)[0] == t for top, t in zip(lp["top_logprobs"], lp["tokens"], strict=True))
        async with s.post(g.url + "/v1/completions", json={**cbody, "stream": True}) as r:
            raw = await r.read()
        chunks = [d for _, d in sse_frames(raw[:-len(b"data: [DONE]\n\n")])]
        tokens = [t for d in chunks if d["choices"] and d["choices"][0]["logprobs"]
                  for t in d["choices"][0]["logprobs"]["tokens"]]
        assert tokens == lp["tokens"]
        async with s.post(g.url + "/v1/completions", json={**cbody, "logprobs": 0}) as r:
            zero = (await r.json())["choices"][0]["logprobs"]
        assert len(zero["tokens"]) == 3 and zero["top_logprobs"] == []


async def test_sglang_echo_with_logprobs_answers_the_prompts_logprobs_first(sims):
    """SGLang computes an echoing completion's prompt logprobs when it asks for a count above 0
    (``logprob_start_len`` 0): its ``logprobs`` begin with the prompt's tokens (the first with null
    logprob and top logprobs), ``text_offset`` -1 throughout, then the generated ones, on the whole
    answer and the stream's first chunk alike; each prompt of a batch its own. Its request model
    refuses a completion's ``max_tokens`` of 0 with its validator's message."""
    sg = await sims("sglang", "qwen")
    body = {"model": "qwen", "prompt": "hello there general", "max_tokens": 2, "echo": True, "logprobs": 1}
    async with aiohttp.ClientSession() as s:
        async with s.post(sg.url + "/v1/completions", json=body) as r:
            got = await r.json()
        lp, usage = got["choices"][0]["logprobs"], got["usage"]
        n = usage["prompt_tokens"]
        assert len(lp["tokens"]) == n + usage["completion_tokens"] and "".join(lp["tokens"]) == got["choices"][0]["text"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
        assert all(len(t) == 1 for t in lp["top_logprobs"][1:]) and set(lp["text_offset"]) == {-1}
        async with s.post(sg.url + "/v1/completions", json={**body, "stream": True}) as r:
            chunks = [orjson.loads(f.split("data: ", 1)[1]) for f in (await r.text()).split("\n\n")
                      if f.startswith("data: {")]
        streamed = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                    for t in c["choices"][0]["logprobs"]["tokens"]]
        assert streamed == lp["tokens"] and chunks[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None
        async with s.post(sg.url + "/v1/completions", json={**body, "prompt": ["one two", "three"]}) as r:
            got = await r.json()
        for c, prompt in zip(got["choices"], ("one two", "three"), strict=True):
            assert "".join(c["logprobs"]["tokens"]) == c["text"] and c["text"].startswith(prompt), c
            assert c["logprobs"]["token_logprobs"][0] is None
        async with s.post(sg.url + "/v1/completions", json={**body, "logprobs": 0}) as r:
            got = await r.json()
        assert len(got["choices"][0]["logprobs"]["tokens"]) == got["usage"]["completion_tokens"]
        async with s.post(sg.url + "/v1/completions", json={**body, "max_tokens": 0}) as r:
            got = await r.json()
        assert (r.status, got["message"]) == (400, "1 validation error:\n  max_tokens: Value error, max_tokens "
                                                   "must be positive"), got


async def test_sglang_refuses_an_empty_embedding_input(sims):
    """SGLang's embeddings handler refuses an input that is empty or whitespace only, or holds such
    a string, with its 400 saying which (its ``_validate_request``), never an answer of 0 prompt
    tokens."""
    sg = await sims("sglang", "qwen")
    async with aiohttp.ClientSession() as s:
        for empty, message in (("", "Input cannot be empty"), ("  ", "Input cannot be empty or whitespace only"),
                               (["hi", " "], "Input at index 1 cannot be empty or whitespace only")):
            async with s.post(sg.url + "/v1/embeddings", json={"model": "qwen", "input": empty}) as r:
                got = await r.json()
            assert (r.status, got) == (400, {"object": "error", "message": message, "type": "BadRequestError",
                                             "param": None, "code": 400}), (empty, got)
        async with s.post(sg.url + "/v1/embeddings", json={"model": "qwen", "input": ["hi", "there"]}) as r:
            assert r.status == 200 and (await r.json())["usage"]["prompt_tokens"] > 0


async def test_sglang_refuses_a_logit_bias_it_cannot_read(sims):
    """SGLang's sampling params' check reads each ``logit_bias`` key with int() and bounds it by the
    vocabulary: a key that is not an integer, or the first out of range, is its 400 (chat and
    completions)."""
    sg = await sims("sglang", "qwen")
    async with aiohttp.ClientSession() as s:
        for path, body in (("/v1/completions", {"model": "qwen", "prompt": "hi", "max_tokens": 1}),
                           ("/v1/chat/completions", {"model": "qwen", "messages": MSGS, "max_tokens": 1})):
            for bias, message in (({"abc": 1}, "invalid literal for int() with base 10: 'abc'"),
                                  ({"5": 1, str(1 << 30): 1, "-1": 1}, "logit_bias must has keys in [0, ")):
                async with s.post(sg.url + path, json={**body, "logit_bias": bias}) as r:
                    got = await r.json()
                assert r.status == 400 and got["message"].startswith(message), (path, bias, got)
            assert got["message"].endswith(f"], got {1 << 30}."), got
            async with s.post(sg.url + path, json={**body, "logit_bias": {"1000": -100}}) as r:
                assert r.status == 200


async def test_sglang_refuses_a_best_of_that_is_no_integer(sims):
    """SGLang's completion request has ``best_of: Optional[int]`` (never used): a value pydantic's lax
    mode does not read as an integer (a word, a float with a fraction, a list) is its 400 validation
    error naming the field; any integer (0 and negatives too), a whole float, a numeric string and
    null are served. Its chat request has no such field, and ignores one whatever its value."""
    sg = await sims("sglang", "qwen")
    comp = {"model": "qwen", "prompt": "hi", "max_tokens": 1}
    async with aiohttp.ClientSession() as s:
        for bad, says in (("two", "Input should be a valid integer, unable to parse string as an integer"),
                          (2.5, "Input should be a valid integer, got a number with a fractional part"),
                          ([2], "Input should be a valid integer"), ({"n": 2}, "Input should be a valid integer")):
            for stream in (False, True):
                async with s.post(sg.url + "/v1/completions", json={**comp, "best_of": bad, "stream": stream}) as r:
                    got = await r.json()
                assert (r.status, got) == (400, {"object": "error", "message": f"1 validation error:\n  best_of: {says}",
                                                 "type": "Bad Request", "param": "best_of", "code": 400}), (bad, got)
        for ok in (0, -3, 1, 5, 2.0, "3", None, True):
            async with s.post(sg.url + "/v1/completions", json={**comp, "best_of": ok}) as r:
                got = await r.json()
            assert r.status == 200 and len(got["choices"]) == 1, (ok, got)
        async with s.post(sg.url + "/v1/chat/completions", json={"model": "qwen", "messages": MSGS, "max_tokens": 1,
                                                                 "best_of": "two"}) as r:
            assert r.status == 200


async def test_sglang_completion_batch_of_prompts_answers_each_prompts_choices(sims):
    """SGLang's completions take a list of prompts (strings or token id lists) as a batch, as vLLM's
    do: choice ``prompt_i * n + j`` is prompt i's j-th, each echoing its own prompt; usage counts
    every prompt once (and its cached tokens once) and every choice's tokens; a stream sends each
    choice in chunks of its own, then the usage."""
    sg = await sims("sglang", "llama")
    prompts = ["one prompt here", "and a second, longer prompt than that"]
    async with aiohttp.ClientSession() as s:
        async def prompt_tokens(prompt: str) -> int:
            async with s.post(sg.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}) as r:
                return (await r.json())["usage"]["prompt_tokens"]

        n0, n1 = await prompt_tokens(prompts[0]), await prompt_tokens(prompts[1])
        body = {"model": "llama", "prompt": prompts, "max_tokens": 2, "n": 2, "echo": True}
        async with s.post(sg.url + "/v1/completions", json=body) as r:
            whole = await r.json()
            assert r.status == 200, whole
        assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
        assert [c["text"].startswith(prompts[i // 2]) for i, c in enumerate(whole["choices"])] == [True] * 4
        assert whole["choices"][0]["text"] != whole["choices"][1]["text"]     # each choice samples its own
        usage = whole["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (n0 + n1, 8, n0 + n1 + 8)
        # each prompt's cached tokens once: both were run once before, block by block
        assert usage["prompt_tokens_details"]["cached_tokens"] <= n0 + n1
        async with s.post(sg.url + "/v1/completions", json={"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 3}) as r:
            ids_whole = await r.json()
            assert r.status == 200, ids_whole
        assert [c["index"] for c in ids_whole["choices"]] == [0, 1]
        assert ids_whole["usage"]["prompt_tokens"] == 5 and ids_whole["usage"]["completion_tokens"] == 6
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with s.post(sg.url + "/v1/completions", json=body) as r:
            raw = await r.read()
            assert r.status == 200, raw
    assert raw.endswith(b"data: [DONE]\n\n")
    got = [d for _, d in sse_frames(raw[:-len(b"data: [DONE]\n\n")])]
    chunks = [d for d in got if d["choices"]]
    assert all(len(d["choices"]) == 1 for d in chunks)
    texts: dict[int, str] = {}
    for d in chunks:
        texts[d["choices"][0]["index"]] = texts.get(d["choices"][0]["index"], "") + d["choices"][0]["text"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}     # same seed, same answers
    ends = {d["choices"][0]["index"] for d in chunks if d["choices"][0]["finish_reason"] == "length"}
    assert ends == {0, 1, 2, 3}
    assert got[-1]["choices"] == [] and got[-1]["usage"]["prompt_tokens"] == n0 + n1
    assert got[-1]["usage"]["completion_tokens"] == 8


async def test_sglang_chat_max_tokens_0_is_prefill_only(sims):
    """SGLang's chat takes ``max_completion_tokens or max_tokens`` as its max_new_tokens: a max_tokens
    of 0 runs the prompt alone (prefill only: a 200 with no token, ``finish_reason: "length"``,
    whole or streamed), a max_completion_tokens of 0 is no bound; ``/generate`` takes a
    max_new_tokens of 0 alike. Its completions refuse a max_tokens of 0."""
    sg = await sims("sglang", "llama")
    body = {"model": "llama", "messages": MSGS, "max_tokens": 0}
    async with aiohttp.ClientSession() as s:
        async with s.post(sg.url + "/v1/chat/completions", json=body) as r:
            whole = await r.json()
            assert r.status == 200, whole
        choice = whole["choices"][0]
        assert choice["message"]["content"] == "" and choice["finish_reason"] == "length"
        assert whole["usage"]["completion_tokens"] == 0 and whole["usage"]["prompt_tokens"] > 0
        async with s.post(sg.url + "/v1/chat/completions",
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            raw = await r.read()
            assert r.status == 200, raw
        got = [d for _, d in sse_frames(raw[:-len(b"data: [DONE]\n\n")])]
        assert [c["delta"].get("content") for d in got for c in d["choices"]] == ["", None]
        assert [c["finish_reason"] for d in got for c in d["choices"]] == [None, "length"]
        assert got[-1]["usage"]["completion_tokens"] == 0
        async with s.post(sg.url + "/v1/chat/completions",
                          json={"messages": MSGS, "max_completion_tokens": 0, "max_tokens": 3}) as r:
            assert (await r.json())["usage"]["completion_tokens"] == 3       # 0 or 3: 3
        async with s.post(sg.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 0}}) as r:
            gen = await r.json()
        assert gen["output_ids"] == [] and gen["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        async with s.post(sg.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 0}) as r:
            assert r.status == 400


async def test_vllm_echo_with_logprobs_answers_the_prompts_logprobs_first(sims):
    """A vLLM completion's ``echo`` with ``logprobs`` computes the prompt's logprobs (its
    ``prompt_logprobs`` count is the ``logprobs`` one): the choice's ``logprobs`` hold the prompt's
    tokens first (the first with null ``token_logprobs`` and ``top_logprobs``: nothing precedes it),
    then the generated ones, ``text_offset`` counted from 0 over all; the choice's
    ``prompt_logprobs`` are vLLM's ``Logprob`` objects keyed by token id. A stream's first chunk
    carries the prompt's with its first token's, the same values as the whole answer's; with
    ``max_tokens`` 0 only the prompt's come. The usage counts the generated tokens only."""
    v = await sims("vllm", "llama")
    prompt = "Once upon a time there was"
    body = {"model": "llama", "prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 2}
    async with aiohttp.ClientSession() as s:
        async with s.post(v.url + "/tokenize", json={"model": "llama", "prompt": prompt}) as r:
            ids = (await r.json())["tokens"]
        async with s.post(v.url + "/v1/completions", json=body) as r:
            whole = await r.json()
            assert r.status == 200, whole
        async with s.post(v.url + "/v1/completions", json={**body, "stream": True}) as r:
            raw = await r.read()
        async with s.post(v.url + "/v1/completions", json={**body, "max_tokens": 0}) as r:
            alone = await r.json()
    choice = whole["choices"][0]
    lp = choice["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) == n + 3 and "".join(lp["tokens"]) == choice["text"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert all(1 <= len(t) <= 2 for t in lp["top_logprobs"][1:])
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(n + 3)]
    assert lp["text_offset"] == offsets
    pl = choice["prompt_logprobs"]
    assert len(pl) == n and pl[0] is None
    for pos in range(1, n):
        entry = pl[pos][str(ids[pos])]
        assert entry["rank"] == 1 and entry["logprob"] == lp["token_logprobs"][pos]
        assert entry["decoded_token"] == lp["tokens"][pos]
    assert whole["usage"]["completion_tokens"] == 3
    chunks = [d["choices"][0] for _, d in sse_frames(raw[:-len(b"data: [DONE]\n\n")]) if d["choices"]]
    streamed: dict[str, list] = {k: [] for k in lp}
    for c in chunks:
        for k in lp:
            streamed[k] += c["logprobs"][k]
    assert streamed == lp
    assert len(chunks[0]["logprobs"]["tokens"]) == n + 1 and "prompt_logprobs" not in chunks[0]
    only = alone["choices"][0]
    assert only["text"] == prompt and only["logprobs"] == {k: vals[:n] for k, vals in lp.items()}
    assert only["prompt_logprobs"] == pl and alone["usage"]["completion_tokens"] == 1


async def test_vllm_messages_refuses_a_max_tokens_past_the_rest_of_the_context(sims):
    """vLLM's Messages API runs through its chat path, whose input check refuses a bound that does
    not fit beside the prompt in ``max_model_len`` (``'max_tokens' or 'max_completion_tokens' is too
    large``), as chat does; a bound that fits is served."""
    v = await sims("vllm", "llama")
    ctx = v.cfg.max_model_len
    async with aiohttp.ClientSession() as s:
        body = {"model": "llama", "max_tokens": ctx, "messages": MSGS}
        for stream in (False, True):
            async with s.post(v.url + "/v1/messages", json={**body, "stream": stream}) as r:
                got = await r.json()
            assert r.status == 400, (stream, got)
            assert got["type"] == "error" and got["error"]["type"] == "BadRequestError", got
            assert got["error"]["message"].startswith(f"'max_tokens' or 'max_completion_tokens' is too large: {ctx}."), got
        async with s.post(v.url + "/v1/messages", json={**body, "max_tokens": 4}) as r:
            assert r.status == 200, await r.text()


async def test_a_method_a_route_does_not_serve_is_fastapis_json_405(sims):
    """Both engines are FastAPI apps: a method a path does not serve is a 405 whose body is JSON,
    ``{"detail": "Method Not Allowed"}``, with the route's methods in ``Allow``; enginesim
    answered aiohttp's plain text."""
    for engine in ("vllm", "sglang"):
        sim = await sims(engine, "m")
        async with aiohttp.ClientSession() as s:
            for method, path in (("GET", "/v1/chat/completions"), ("PUT", "/v1/messages"),
                                 ("DELETE", "/v1/responses/resp_1")):
                async with s.request(method, sim.url + path) as r:
                    assert r.status == 405 and r.content_type == "application/json", (engine, method, path)
                    assert await r.json() == {"detail": "Method Not Allowed"}
                    assert r.headers["Allow"]


def _nested(depth: int) -> dict:
    out: dict = {"type": "object"}
    for _ in range(depth):
        out = {"type": "object", "properties": {"a": out}}
    return out


async def test_a_body_nested_deeper_than_orjson_writes_is_served(sims):
    """A JSON body the engine reads (orjson reads 1024 levels) may nest deeper than orjson writes
    (254): a tool's schema rendered into the prompt, a Responses request's metadata echoed in its
    answer and its events. The engines' Python JSON writes them; enginesim answered a 500 with a
    traceback."""
    deep = _nested(150)         # 300 levels of objects
    tools = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
    for engine in ("vllm", "sglang"):
        sim = await sims(engine, "m")
        async with aiohttp.ClientSession() as s:
            asks = [("/v1/chat/completions", {"max_tokens": 1, "messages": MSGS, "tools": tools}),
                    ("/v1/messages", {"max_tokens": 1, "messages": MSGS,
                                      "tools": [{"name": "f", "input_schema": deep}]}),
                    ("/v1/responses", {"max_output_tokens": 1, "input": "hi", "metadata": {"k": deep}}),
                    ("/v1/responses", {"max_output_tokens": 1, "input": "hi", "stream": True,
                                       "tools": [{"type": "function", "name": "f", "parameters": deep}]})]
            if engine == "vllm":
                asks.append(("/tokenize", {"messages": MSGS, "tools": tools}))
            for path, body in asks:
                async with s.post(sim.url + path, data=json.dumps({"model": "m", **body}),
                                  headers={"content-type": "application/json"}) as r:
                    text = await r.text()
                    assert r.status == 200, (engine, path, text[:200])
                    if not body.get("stream"):
                        json.loads(text)


async def test_vllm_ignores_best_of(sims):
    """vLLM (V1) has no ``best_of``: its requests ignore a field they do not have, whatever its value,
    and the answer has the ``n`` choices asked."""
    v = await sims("vllm", "llama")
    async with aiohttp.ClientSession() as s:
        for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": MSGS})):
            for extra in ({"best_of": 0}, {"best_of": 1, "n": 2}, {"best_of": -3}, {"best_of": "two"},
                          {"best_of": 500}):
                async with s.post(v.url + path, json={"model": "llama", "max_tokens": 1, **body, **extra}) as r:
                    got = await r.json()
                assert r.status == 200 and len(got["choices"]) == extra.get("n", 1), (path, extra, got)


async def test_vllm_chat_reasoning_with_a_reasoning_parser(sims):
    """``--reasoning-parser``: the first half of max_tokens is the message's ``reasoning``, streamed
    as ``{"reasoning": ...}`` deltas before the content's; the two answers split alike."""
    sim = await sims("vllm", "m", reasoning_parser="deepseek_r1")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    async with aiohttp.ClientSession() as s:
        async with s.post(sim.url + "/v1/chat/completions", json=body) as r:
            msg = (await r.json())["choices"][0]["message"]
        async with s.post(sim.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
            raw = await r.read()
    deltas = [d["choices"][0]["delta"] for _, d in sse_frames(raw[:-len(b"data: [DONE]\n\n")])][1:]
    assert [next(iter(d)) for d in deltas] == ["reasoning"] * 2 + ["content"] * 3
    assert msg["reasoning"] == "".join(d["reasoning"] for d in deltas[:2]) and msg["reasoning"]
    assert msg["content"] == "".join(d["content"] for d in deltas[2:]) and msg["content"]
