"""The engine simulator, tested the way a gateway sees it: real sockets on loopback."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from enginesim import SimConfig, SimServer, start_sim
from enginesim.config import config_from_args
from enginesim.engine import Engine
from enginesim.faults import FaultSpecError, parse_fault
from enginesim.kvcache import BlockPool, root_key
from enginesim.tokenizer import FakeTokenizer, render_chat
from tests.support.enginesim import FAST, call, metric_samples, next_event, parse_sse, wait_state
from tests.support.http import sim_state
from tests.support.metrics import metric

MakeSim = Callable[..., Awaitable[SimServer]]
CHAT = [{"role": "user", "content": "Tell me about switchyards."}]
LONG_TEXT = " ".join(f"word{i} is here," for i in range(120))  # several hundred tokens


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def make_sim() -> AsyncIterator[MakeSim]:
    servers: list[SimServer] = []

    async def make(wait: bool = True, **knobs: Any) -> SimServer:
        server = await start_sim(SimConfig(**{**FAST, **knobs}))
        servers.append(server)
        if wait:
            await server.wait_ready()
        return server

    yield make
    for server in servers:
        await server.close()
        # close() leaves nothing behind: no request, no producer or delayed-abort task.
        assert not server.engine._tasks
        assert not server.engine.running and not server.engine.waiting


@pytest.fixture
async def vllm(make_sim: MakeSim) -> SimServer:
    return await make_sim(engine="vllm", model="org/llama-sim", served_model_names=("llama", "llama-alias"))


@pytest.fixture
async def sglang(make_sim: MakeSim) -> SimServer:
    return await make_sim(engine="sglang", model="org/llama-sim")


# -- vLLM: streaming framing ----------------------------------------------------------------------


async def test_vllm_chat_stream_framing(vllm: SimServer, http: aiohttp.ClientSession) -> None:
    body = {"model": "llama", "messages": CHAT, "stream": True, "max_tokens": 5,
            "stream_options": {"include_usage": True}}
    status, events, resp = await call(http, vllm.url + "/v1/chat/completions", body, {"X-Request-Id": "abc"})
    assert status == 200
    assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["id"] == "chatcmpl-abc" and c["model"] == "llama" for c in chunks)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    role, *deltas, usage = chunks
    assert role["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}]
    assert len(deltas) == 5
    for d in deltas[:-1]:
        assert d["choices"][0]["finish_reason"] is None and "stop_reason" not in d["choices"][0]
        assert d["choices"][0]["delta"]["content"]
    last = deltas[-1]["choices"][0]
    assert last["finish_reason"] == "length" and last["stop_reason"] is None and last["delta"]["content"]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 5
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usage["system_fingerprint"].startswith("vllm-0.33.0-")


async def test_vllm_stream_without_usage_puts_fingerprint_on_last_chunk(
        vllm: SimServer, http: aiohttp.ClientSession) -> None:
    body = {"messages": CHAT, "stream": True, "max_tokens": 2}
    _, events, _ = await call(http, vllm.url + "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    assert all(e["choices"] for e in events[:-1])  # no usage chunk
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert "system_fingerprint" in events[-2]


async def test_vllm_continuous_usage_stats(vllm: SimServer, http: aiohttp.ClientSession) -> None:
    body = {"messages": CHAT, "stream": True, "max_tokens": 3,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    _, events, _ = await call(http, vllm.url + "/v1/chat/completions", body)
    counts = [e["usage"]["completion_tokens"] for e in events[:-1]]
    assert counts == [1, 1, 2, 3, 3]  # role chunk rides with the first token; then the usage chunk
    # Without include_usage, continuous_usage_stats alone adds nothing.
    body["stream_options"] = {"continuous_usage_stats": True}
    _, events, _ = await call(http, vllm.url + "/v1/chat/completions", body)
    assert all("usage" not in e for e in events[:-1])


async def test_sglang_continuous_usage_stats_need_no_include_usage(sglang: SimServer,
                                                                      http: aiohttp.ClientSession) -> None:
    """SGLang reads continuous_usage_stats apart from include_usage: alone, it puts the usage on
    every chunk, and no usage chunk ends the stream."""
    body = {"messages": CHAT, "stream": True, "max_tokens": 3, "stream_options": {"continuous_usage_stats": True}}
    _, events, _ = await call(http, sglang.url + "/v1/chat/completions", body)
    assert events[-1] == "[DONE]" and all(e["choices"] for e in events[:-1])
    assert events[-2]["usage"]["completion_tokens"] == 3 and all("usage" in e for e in events[:-1])


async def test_vllm_prompt_embeds_need_the_flag(vllm: SimServer, http: aiohttp.ClientSession) -> None:
    """vLLM takes prompt_embeds in the place of a completion's prompt, and refuses them unless
    started with --enable-prompt-embeds, as the simulated vLLM is not."""
    for body in ({"prompt_embeds": "AAAA"}, {"prompt": None, "prompt_embeds": ["AAAA"]},
                 {"prompt": "", "prompt_embeds": "AAAA"}):
        status, data, _ = await call(http, vllm.url + "/v1/completions", {**body, "max_tokens": 2})
        assert status == 400 and data["error"]["param"] == "prompt_embeds", data
        assert "--enable-prompt-embeds" in data["error"]["message"]


async def test_vllm_completions_stream_and_non_stream(vllm: SimServer, http: aiohttp.ClientSession) -> None:
    body = {"model": "llama-alias", "prompt": "Once upon a time", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    _, events, _ = await call(http, vllm.url + "/v1/completions", body, {"X-Request-Id": "r7"})
    chunks = events[:-1]
    assert events[-1] == "[DONE]"
    assert all(c["object"] == "text_completion" and c["id"] == "cmpl-r7" for c in chunks)
    assert all(c["model"] == "llama" for c in chunks)  # first served name, not the alias
    texts = [c["choices"][0]["text"] for c in chunks[:-1]]
    assert len(texts) == 4 and chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4

    body.pop("stream_options")
    body["stream"] = False
    status, data, resp = await call(http, vllm.url + "/v1/completions", body)
    assert status == 200 and resp.content_type == "application/json"
    assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
    choice = data["choices"][0]
    assert choice["text"] == "".join(texts)  # deterministic output for the same prompt
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert data["usage"]["completion_tokens"] == 4
    assert data["kv_transfer_params"] is None


async def test_vllm_chat_non_stream_shape_and_determinism(vllm: SimServer, http: aiohttp.ClientSession) -> None:
    body = {"model": "llama", "messages": CHAT, "max_completion_tokens": 6, "max_tokens": 99}
    _, first, _ = await call(http, vllm.url + "/v1/chat/completions", body)
    _, second, _ = await call(http, vllm.url + "/v1/chat/completions", body)
    assert first["object"] == "chat.completion" and first["id"].startswith("chatcmpl-")
    msg = first["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"] and msg["reasoning"] is None
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["usage"]["completion_tokens"] == 6  # max_completion_tokens wins over max_tokens
    assert msg["content"] == second["choices"][0]["message"]["content"]
    # Content given as a list of parts renders like the plain string.
    parts = [{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}]
    _, third, _ = await call(http, vllm.url + "/v1/chat/completions", {**body, "messages": parts})
    assert third["choices"][0]["message"]["content"] == msg["content"]


async def test_default_max_tokens(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    v = await make_sim(engine="vllm")
    s = await make_sim(engine="sglang")
    _, data, _ = await call(http, v.url + "/v1/completions", {"prompt": "hi"})
    assert data["usage"]["completion_tokens"] == 16
    _, data, _ = await call(http, s.url + "/generate", {"text": "hi"})
    assert data["meta_info"]["completion_tokens"] == 128


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_stop_strings(engine: str, make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    sim = await make_sim(engine=engine)
    body: dict[str, Any] = {"messages": CHAT, "max_tokens": 8}
    _, full, _ = await call(http, sim.url + "/v1/chat/completions", body)
    text = full["choices"][0]["message"]["content"]
    words = text.split(" ")[1:]  # text starts with a space
    stop = " " + words[3]
    body["stop"] = [stop, "never-matches"]
    _, data, _ = await call(http, sim.url + "/v1/chat/completions", body)
    choice = data["choices"][0]
    assert choice["message"]["content"] == text[:text.index(stop)]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason" if engine == "vllm" else "matched_stop"] == stop
    # The stream never leaks a piece of the stop string.
    _, events, _ = await call(http, sim.url + "/v1/chat/completions", {**body, "stream": True})
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert streamed == text[:text.index(stop)]


async def test_ignore_eos_and_min_tokens(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    sim = await make_sim(engine="vllm", eos_probability=1.0)
    base = {"prompt": "x", "max_tokens": 5}
    _, data, _ = await call(http, sim.url + "/v1/completions", base)
    assert data["choices"][0]["finish_reason"] == "stop" and data["usage"]["completion_tokens"] == 1
    _, data, _ = await call(http, sim.url + "/v1/completions", {**base, "min_tokens": 3})
    assert data["usage"]["completion_tokens"] == 4 and data["choices"][0]["finish_reason"] == "stop"
    _, data, _ = await call(http, sim.url + "/v1/completions", {**base, "ignore_eos": True})
    assert data["choices"][0]["finish_reason"] == "length" and data["usage"]["completion_tokens"] == 5
    # vLLM's SamplingParams refuses a min_tokens above the bound it got
    status, data, _ = await call(http, sim.url + "/v1/completions", {**base, "min_tokens": 6})
    assert status == 400 and data["error"]["message"] == "min_tokens must be less than or equal to max_tokens=5, got 6."


# -- vLLM: other endpoints and errors -------------------------------------------------------------


async def test_vllm_embeddings(vllm: SimServer, http: aiohttp.ClientSession) -> None:
    body = {"model": "llama", "input": ["hello world", "hello world", "other"]}
    status, data, _ = await call(http, vllm.url + "/v1/embeddings", body)
    assert status == 200 and data["object"] == "list" and data["id"].startswith("embd-")
    vecs = [d["embedding"] for d in data["data"]]
    assert [d["index"] for d in data["data"]] == [0, 1, 2]
    assert all(d["object"] == "embedding" for d in data["data"])
    assert len(vecs[0]) == 16 and vecs[0] == vecs[1] != vecs[2]
    assert abs(sum(v * v for v in vecs[0]) - 1.0) < 1e-9
    assert data["usage"]["prompt_tokens"] == data["usage"]["total_tokens"] > 0
    _, b64, _ = await call(http, vllm.url + "/v1/embeddings",
                           {"input": "hello world", "encoding_format": "base64", "dimensions": 8})
    assert len(base64.b64decode(b64["data"][0]["embedding"])) == 8 * 4


async def test_vllm_chat_embeddings(vllm: SimServer, http: aiohttp.ClientSession) -> None:
    """vLLM's chat embeddings: ``messages`` in the place of ``input``, rendered by the chat template
    into one prompt, embedded as one vector; the same conversation, the same vector."""
    messages = [{"role": "system", "content": "Embed this."}, {"role": "user", "content": "hello world"}]
    status, data, _ = await call(http, vllm.url + "/v1/embeddings", {"model": "llama", "messages": messages})
    assert status == 200 and [d["index"] for d in data["data"]] == [0]
    assert data["usage"]["prompt_tokens"] > 2       # the template's role markers count
    _, again, _ = await call(http, vllm.url + "/v1/embeddings", {"messages": messages})
    assert again["data"] == data["data"]
    status, data, _ = await call(http, vllm.url + "/v1/embeddings", {"messages": []})
    assert status == 400 and data["error"]["param"] == "messages"


async def test_sglang_embeddings(sglang: SimServer, http: aiohttp.ClientSession) -> None:
    status, data, _ = await call(http, sglang.url + "/v1/embeddings", {"input": ["hello world", "hello world", "x"]})
    assert status == 200 and data["object"] == "list"
    vecs = [d["embedding"] for d in data["data"]]
    assert [d["index"] for d in data["data"]] == [0, 1, 2] and vecs[0] == vecs[1] != vecs[2]
    assert data["usage"]["prompt_tokens"] == data["usage"]["total_tokens"] > 0
    status, data, _ = await call(http, sglang.url + "/v1/embeddings", {"input": "x", "dimensions": -1})
    assert status == 400


async def test_vllm_models_card(vllm: SimServer, http: aiohttp.ClientSession) -> None:
    async with http.get(vllm.url + "/v1/models") as resp:
        data = await resp.json()
    assert data["object"] == "list"
    assert [c["id"] for c in data["data"]] == ["llama", "llama-alias"]
    card = data["data"][0]
    assert card["owned_by"] == "vllm" and card["root"] == "org/llama-sim" and card["parent"] is None
    assert card["max_model_len"] == 8192
    assert card["permission"][0]["object"] == "model_permission"


async def test_vllm_stream_options_without_stream_is_400(vllm: SimServer, http: aiohttp.ClientSession) -> None:
    body = {"messages": CHAT, "stream_options": {"include_usage": True}}
    status, data, _ = await call(http, vllm.url + "/v1/chat/completions", body)
    assert status == 400
    assert data["error"]["message"] == "Stream options can only be defined when `stream=True`."
    assert set(data["error"]) == {"message", "type", "param", "code"} and data["error"]["code"] == 400


async def test_unknown_model_vllm_404_sglang_echo(vllm: SimServer, sglang: SimServer,
                                                  http: aiohttp.ClientSession) -> None:
    body = {"model": "nope", "messages": CHAT, "max_tokens": 1}
    status, data, _ = await call(http, vllm.url + "/v1/chat/completions", body)
    assert status == 404
    assert data == {"error": {"message": "The model `nope` does not exist. Valid aliases: llama, llama-alias.",
                              "type": "NotFoundError", "param": "model", "code": 404}}
    status, data, _ = await call(http, sglang.url + "/v1/chat/completions", body)
    assert status == 200 and data["model"] == "nope"
    _, data, _ = await call(http, sglang.url + "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1})
    assert data["model"] == "default"


async def test_vllm_requires_json_content_type(vllm: SimServer, http: aiohttp.ClientSession) -> None:
    async with http.post(vllm.url + "/v1/chat/completions", data=b'{"messages": []}',
                         headers={"Content-Type": "text/plain"}) as resp:
        assert resp.status == 400
        data = await resp.json()
    assert data["error"]["message"] == "Unsupported Media Type: Only 'application/json' is allowed"


async def test_context_length_errors(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    v = await make_sim(engine="vllm", max_model_len=64)
    s = await make_sim(engine="sglang", max_model_len=64)
    body = {"prompt": LONG_TEXT, "max_tokens": 1}
    status, data, _ = await call(http, v.url + "/v1/completions", body)
    assert status == 400 and data["error"]["type"] == "BadRequestError"
    assert data["error"]["message"].startswith("This model's maximum context length is 64 tokens.")
    status, data, _ = await call(http, v.url + "/v1/completions", {"prompt": "short", "max_tokens": 100})
    assert status == 400 and "'max_tokens' or 'max_completion_tokens' is too large: 100" in data["error"]["message"]
    status, data, _ = await call(http, s.url + "/v1/completions", body)
    assert status == 400 and data["object"] == "error" and data["code"] == 400
    assert data["message"].startswith("The input (") and "context length (64 tokens)" in data["message"]
    status, data, _ = await call(http, s.url + "/generate", {"text": LONG_TEXT})
    assert status == 400 and set(data) == {"error"} and set(data["error"]) == {"message"}
    # SGLang refuses a named max_tokens that, with the prompt, reaches the context (the prompt
    # checked first); a prompt that fits with room to spare is served
    for path, extra in (("/v1/completions", {"prompt": "short"}), ("/v1/chat/completions", {"messages": CHAT})):
        for max_tokens in (64, 10**18):
            status, data, _ = await call(http, s.url + path, {**extra, "max_tokens": max_tokens})
            assert status == 400 and data["object"] == "error" and data["code"] == 400, data
            assert data["message"].startswith("Requested token count exceeds the model's maximum context length "
                                              "of 64 tokens. You requested a total of"), data
        status, data, _ = await call(http, s.url + path, {**extra, "max_tokens": 4})
        assert status == 200, data
    status, data, _ = await call(http, s.url + "/v1/completions", {"prompt": LONG_TEXT, "max_tokens": 64})
    assert status == 400 and data["message"].startswith("The input ("), data


async def test_vllm_small_endpoints(vllm: SimServer, http: aiohttp.ClientSession) -> None:
    _, tok, _ = await call(http, vllm.url + "/tokenize", {"prompt": "Hello, tokenizer world!",
                                                         "return_token_strs": True})
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 8192
    assert "".join(tok["token_strs"]) == "Hello, tokenizer world!"
    _, detok, _ = await call(http, vllm.url + "/detokenize", {"tokens": tok["tokens"]})
    assert detok == {"prompt": "Hello, tokenizer world!"}
    _, chat_tok, _ = await call(http, vllm.url + "/tokenize", {"messages": CHAT})
    _, usage, _ = await call(http, vllm.url + "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1})
    assert chat_tok["count"] == usage["usage"]["prompt_tokens"]
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
        async with http.request(method, vllm.url + path) as resp:
            assert resp.status == 200 and await resp.read() == b""
    async with http.get(vllm.url + "/version") as resp:
        assert await resp.json() == {"version": "0.33.0"}
    async with http.get(vllm.url + "/load") as resp:
        assert await resp.json() == {"server_load": 0}


async def test_vllm_request_id_header_echo(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    sim = await make_sim(engine="vllm", enable_request_id_headers=True)
    _, data, resp = await call(http, sim.url + "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1},
                               {"X-Request-Id": "trace-1"})
    assert resp.headers["X-Request-Id"] == "trace-1" and data["id"] == "chatcmpl-trace-1"


async def test_dead_engine(vllm: SimServer, http: aiohttp.ClientSession) -> None:
    await call(http, vllm.url + "/_sim/config", {"dead": True})
    async with http.get(vllm.url + "/health") as resp:
        assert resp.status == 503
    status, data, _ = await call(http, vllm.url + "/v1/chat/completions", {"messages": CHAT})
    assert status == 500 and data["error"]["type"] == "InternalServerError"
    await call(http, vllm.url + "/_sim/config", {"dead": False})
    async with http.get(vllm.url + "/health") as resp:
        assert resp.status == 200


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_api_key_protects_the_engines_routes(engine: str, make_sim: MakeSim,
                                                   http: aiohttp.ClientSession) -> None:
    """--api-key: the routes each engine guards answer 401 {"error": "Unauthorized"} without the
    key; /health and /metrics stay open on both; vLLM leaves paths outside /v1 open and takes the
    scheme in any case, SGLang guards its own routes too and compares the header whole."""
    sim = await make_sim(engine=engine, model="m", api_key="k-123")
    guarded = ["/v1/models"] + (["/get_model_info"] if engine == "sglang" else [])
    for path in guarded:
        for header in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k-123"}):
            async with http.get(sim.url + path, headers=header) as r:
                assert (r.status, await r.json()) == (401, {"error": "Unauthorized"}), (path, header)
        async with http.get(sim.url + path, headers={"Authorization": "Bearer k-123"}) as r:
            assert r.status == 200, path
    async with http.get(sim.url + "/v1/models", headers={"Authorization": "bearer k-123"}) as r:
        assert r.status == (200 if engine == "vllm" else 401)
    for path in ("/health", "/metrics"):
        async with http.get(sim.url + path) as r:
            assert r.status == 200, path
    body = {"model": "m", "messages": CHAT, "max_tokens": 2}
    async with http.post(sim.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 401
    status, _, _ = await call(http, sim.url + "/v1/chat/completions", body, {"Authorization": "Bearer k-123"})
    assert status == 200
    if engine == "vllm":
        async with http.post(sim.url + "/tokenize", json={"model": "m", "prompt": "hi"}) as r:
            assert r.status == 200
    else:
        async with http.post(sim.url + "/abort_request", json={"rid": "x"}) as r:
            assert r.status == 401
    state = await sim_state(sim.url, http)
    assert {"method": "POST", "path": "/v1/chat/completions"} in state["refused"]
    assert [e["path"] for e in state["received"]].count("/v1/chat/completions") == 1


async def test_vllm_keepalive_frames(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    sim = await make_sim(engine="vllm", sse_keepalive_s=0.01)
    body = {"messages": CHAT, "stream": True}
    async with http.post(sim.url + "/v1/chat/completions", json=body,
                         headers={"x-sim-fault": "stall_before_first=inf"}) as resp:
        assert resp.status == 200
        assert await next_event(resp) == ": keep-alive"
        assert await next_event(resp) == ": keep-alive"
    await wait_state(http, sim.url, lambda s: s["counts"]["aborted"] == 1)


# -- SGLang ---------------------------------------------------------------------------------------


async def test_sglang_chat_stream_shapes(sglang: SimServer, http: aiohttp.ClientSession) -> None:
    body = {"model": "whatever", "rid": "my-rid", "messages": CHAT, "stream": True, "max_tokens": 3,
            "stream_options": {"include_usage": True}}
    status, events, resp = await call(http, sglang.url + "/v1/chat/completions", body)
    assert status == 200 and resp.content_type == "text/event-stream"
    assert events[-1] == "[DONE]"
    role, *content, finish, usage = events[:-1]
    for e in events[:-2]:
        assert e["id"] == "my-rid" and e["model"] == "whatever"
        (choice,) = e["choices"]
        assert "reasoning_content" in choice["delta"] and choice["delta"]["reasoning_content"] is None
        assert "matched_stop" in choice and "finish_reason" in choice and "logprobs" in choice
    assert role["choices"][0]["delta"] == {"reasoning_content": None, "role": "assistant", "content": ""}
    assert len(content) == 3 and all(c["choices"][0]["finish_reason"] is None for c in content)
    assert finish["choices"][0] == {"index": 0, "delta": {"reasoning_content": None}, "logprobs": None,
                                    "finish_reason": "length", "matched_stop": None}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert usage["usage"]["reasoning_tokens"] == 0
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_sglang_completions_and_non_stream(sglang: SimServer, http: aiohttp.ClientSession) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 3, "stream": True}
    _, events, _ = await call(http, sglang.url + "/v1/completions", body)
    chunks = events[:-1]
    assert len(chunks) == 3 and all(c["object"] == "text_completion" for c in chunks)
    assert all("matched_stop" in c["choices"][0] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    _, data, _ = await call(http, sglang.url + "/v1/chat/completions",
                            {"messages": CHAT, "max_tokens": 2, "rid": "x1"})
    assert data["id"] == "x1" and data["object"] == "chat.completion"
    choice = data["choices"][0]
    assert choice["message"]["reasoning_content"] is None and choice["matched_stop"] is None
    assert data["usage"]["reasoning_tokens"] == 0
    _, data, _ = await call(http, sglang.url + "/v1/chat/completions", {"messages": []})
    assert data == {"object": "error", "message": "Messages cannot be empty.", "type": "BadRequestError",
                    "param": "messages", "code": 400}


async def test_headers_timing_sglang_waits_for_first_chunk_vllm_does_not(
        vllm: SimServer, sglang: SimServer, http: aiohttp.ClientSession) -> None:
    body = {"messages": CHAT, "stream": True, "max_tokens": 2}
    stall = {"x-sim-fault": "stall_before_first=inf"}
    # vLLM: headers as soon as the request is admitted, even though no token will ever come.
    async with http.post(vllm.url + "/v1/chat/completions", json=body, headers=stall) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
    # SGLang: no first chunk, no headers.
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(http.post(sglang.url + "/v1/chat/completions", json=body, headers=stall), 0.2)
    # Both clients gave up; both engines aborted their request (SGLang after its detection delay).
    for sim in (vllm, sglang):
        await wait_state(http, sim.url, lambda s: s["counts"]["aborted"] == 1 and not s["running"])
    # With a short stall the SGLang stream does arrive, headers together with the first chunk.
    _, events, _ = await call(http, sglang.url + "/v1/chat/completions", body,
                              {"x-sim-fault": "stall_before_first=0.02"})
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"]["role"] == "assistant"


async def test_sglang_generate_cumulative_stream(sglang: SimServer, http: aiohttp.ClientSession) -> None:
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4}, "stream": True,
            "rid": "gen-1"}
    _, events, _ = await call(http, sglang.url + "/generate", body)
    assert events[-1] == "[DONE]"
    frames = events[:-1]
    assert len(frames) == 4
    for i, f in enumerate(frames):
        assert f["meta_info"]["id"] == "gen-1"
        assert len(f["output_ids"]) == i + 1 == f["meta_info"]["completion_tokens"]
        if i:
            assert f["text"].startswith(frames[i - 1]["text"]) and len(f["text"]) > len(frames[i - 1]["text"])
        assert f["meta_info"]["finish_reason"] is (None if i < 3 else f["meta_info"]["finish_reason"])
    assert frames[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    _, data, _ = await call(http, sglang.url + "/generate", {**body, "stream": False})
    assert data["text"] == frames[-1]["text"] and data["output_ids"] == frames[-1]["output_ids"]
    meta = data["meta_info"]
    assert meta["prompt_tokens"] > 0 and meta["cached_tokens"] == meta["prompt_tokens"] - 1
    assert meta["e2e_latency"] >= 0
    _, data, _ = await call(http, sglang.url + "/generate", {"input_ids": [5, 6, 7],
                                                             "sampling_params": {"max_new_tokens": 2}})
    assert data["meta_info"]["prompt_tokens"] == 3 and len(data["output_ids"]) == 2


async def test_sglang_abort_request_takes_a_rid_it_holds(sglang: SimServer, http: aiohttp.ClientSession) -> None:
    """SGLang's tokenizer manager passes an abort on only for a rid it holds a request of; its
    scheduler then aborts every request whose rid starts with it."""
    stall = {"x-sim-fault": "stall_after=1:inf"}
    body = {"messages": CHAT, "stream": True, "rid": "grp-0001-a"}
    async with http.post(sglang.url + "/v1/chat/completions", json=body, headers=stall) as resp:
        assert (await next_event(resp))["choices"][0]["delta"]["role"] == "assistant"
        assert (await next_event(resp))["choices"][0]["delta"]["content"]
        for other in ("grp-0002", "grp-0001"):      # another rid, and a prefix no request has
            async with http.post(sglang.url + "/abort_request", json={"rid": other}) as r:
                assert r.status == 200
        assert len((await sim_state(sglang.url, http))["running"]) == 1  # untouched
        async with http.post(sglang.url + "/abort_request", json={"rid": "grp-0001-a"}) as r:
            assert r.status == 200 and await r.read() == b""
        finish = await next_event(resp)
        assert finish["choices"][0]["finish_reason"] == "abort"
        assert await next_event(resp) == "[DONE]"
    state = await sim_state(sglang.url, http)
    assert state["counts"]["aborted"] == 1 and state["aborted_ids"] == ["grp-0001-a"]
    samples = await metric_samples(http, sglang.url)
    assert metric(samples, "sglang:num_aborted_requests_total") == 1

    # abort_all, on the native API: finish_reason is an object there.
    gen = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 50}}
    async with http.post(sglang.url + "/generate", json=gen, headers=stall) as resp:
        await next_event(resp)
        await call(http, sglang.url + "/abort_request", {"abort_all": True})
        last = await next_event(resp)
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert await next_event(resp) == "[DONE]"


async def test_sglang_batch_prompts_are_held_by_rids_of_their_own(sglang: SimServer,
                                                                 http: aiohttp.ClientSession) -> None:
    """A completion's list of prompts (even of one) is a batch: one rid R gives prompt i ``R_i``, a
    list names each; an abort of R reaches none of them, theirs each one."""
    stall = {"x-sim-fault": "stall_after=1:inf"}
    for prompts, rid, held in ((["Once upon a time", "Freight cars"], "bt-1", ["bt-1_0", "bt-1_1"]),
                               (["Once upon a time"], "bt-2", ["bt-2_0"]),
                               (["Once upon a time", "Freight cars"], ["bt-3a", "bt-3b"], ["bt-3a", "bt-3b"])):
        body = {"prompt": prompts, "max_tokens": 50, "stream": True, "rid": rid}
        k = len(held)
        async with http.post(sglang.url + "/v1/completions", json=body, headers=stall) as resp:
            state = await wait_state(http, sglang.url, lambda s, k=k: len(s["running"]) == k)
            assert sorted(r["rid"] for r in state["running"]) == held
            if isinstance(rid, str):
                await call(http, sglang.url + "/abort_request", {"rid": rid})
                assert len((await sim_state(sglang.url, http))["running"]) == len(held)
            for r in held:
                await call(http, sglang.url + "/abort_request", {"rid": r})
            await resp.read()
        assert (await sim_state(sglang.url, http))["running"] == []
    status, out, _ = await call(http, sglang.url + "/v1/completions",
                                {"prompt": ["a", "b"], "max_tokens": 1, "rid": ["only-one"]})
    assert status == 400 and "rids length mismatch" in out["message"]


async def test_sglang_info_endpoints_and_flush(sglang: SimServer, http: aiohttp.ClientSession) -> None:
    for path in ("/model_info", "/get_model_info"):
        async with http.get(sglang.url + path) as resp:
            info = await resp.json()
        assert info["disaggregation_mode"] == "null" and info["model_path"] == "org/llama-sim"
    for path in ("/server_info", "/get_server_info"):
        async with http.get(sglang.url + path) as resp:
            assert (await resp.json())["version"] == "0.5.23"
    async with http.get(sglang.url + "/v1/loads") as resp:
        loads = (await resp.json())["loads"][0]
    assert loads["num_running_reqs"] == 0 and loads["max_running_requests"] == 64
    async with http.get(sglang.url + "/v1/models") as resp:
        card = (await resp.json())["data"][0]
    assert card["owned_by"] == "sglang" and card["id"] == card["root"] == "org/llama-sim"
    async with http.get(sglang.url + "/v1/models/nope") as resp:
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"
    for path in ("/health", "/health_generate", "/ready"):
        async with http.get(sglang.url + path) as resp:
            assert resp.status == 200
    async with http.get(sglang.url + "/flush_cache") as resp:
        assert resp.status == 200 and (await resp.text()).startswith("Cache flushed.")
    stall = {"x-sim-fault": "stall_before_first=inf"}
    async with http.post(sglang.url + "/generate", json={"text": "x", "stream": True}, headers=stall):
        await wait_state(http, sglang.url, lambda s: len(s["running"]) == 1)
        async with http.post(sglang.url + "/flush_cache") as resp:
            assert resp.status == 400


# -- prefix caching and KV pool -------------------------------------------------------------------


async def test_vllm_prefix_cache_hits(vllm: SimServer, http: aiohttp.ClientSession) -> None:
    body = {"prompt": LONG_TEXT, "max_tokens": 1}
    before = await metric_samples(http, vllm.url)
    _, first, _ = await call(http, vllm.url + "/v1/completions", body)
    _, second, _ = await call(http, vllm.url + "/v1/completions", body)
    prompt_len = second["usage"]["prompt_tokens"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert 0 < cached <= prompt_len - 1 and cached % 16 == 0
    assert cached == (prompt_len - 1) // 16 * 16
    after = await metric_samples(http, vllm.url)
    hits = metric(after, "vllm:prefix_cache_hits_total") - metric(before, "vllm:prefix_cache_hits_total")
    queries = (metric(after, "vllm:prefix_cache_queries_total")
               - metric(before, "vllm:prefix_cache_queries_total"))
    assert hits == cached and queries == 2 * prompt_len
    # A different cache_salt is a different cache.
    _, salted, _ = await call(http, vllm.url + "/v1/completions", {**body, "cache_salt": "tenant-b"})
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # A shared prefix hits up to the last full shared block.
    _, partial, _ = await call(http, vllm.url + "/v1/completions",
                               {"prompt": LONG_TEXT + " and a different ending", "max_tokens": 1})
    assert 0 < partial["usage"]["prompt_tokens_details"]["cached_tokens"] <= cached


async def test_cap_is_prompt_len_minus_one(vllm: SimServer, http: aiohttp.ClientSession) -> None:
    body = {"prompt": list(range(100, 132)), "max_tokens": 1}  # exactly two full blocks
    await call(http, vllm.url + "/v1/completions", body)
    _, data, _ = await call(http, vllm.url + "/v1/completions", body)
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 16


async def test_sglang_cached_tokens_report(sglang: SimServer, http: aiohttp.ClientSession) -> None:
    body = {"messages": CHAT, "max_tokens": 1}
    await call(http, sglang.url + "/v1/chat/completions", body)
    _, data, _ = await call(http, sglang.url + "/v1/chat/completions", body)
    usage = data["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1  # page size 1
    samples = await metric_samples(http, sglang.url)
    assert metric(samples, "sglang:cached_tokens_total", cache_source="device") == usage["prompt_tokens"] - 1
    assert 0 < metric(samples, "sglang:cache_hit_rate") < 1


async def test_cached_tokens_hidden_when_reporting_off(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    sim = await make_sim(engine="vllm", report_cached_tokens=False)
    _, data, _ = await call(http, sim.url + "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert data["usage"]["prompt_tokens_details"] is None


async def test_lru_eviction_with_tiny_pool(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    sim = await make_sim(engine="vllm", kv_blocks=4, block_size=4, max_model_len=16)

    async def cached(prompt_start: int) -> int:
        body = {"prompt": list(range(prompt_start, prompt_start + 8)), "max_tokens": 1}
        _, data, _ = await call(http, sim.url + "/v1/completions", body)
        return data["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert await cached(100) == 0
    assert await cached(100) == 4  # 8-token prompt: hit capped at one 4-token block
    for other in (200, 300, 400):  # three more prompts push A's blocks out of a 4-block pool
        assert await cached(other) == 0
    assert await cached(400) == 4  # the most recent prompt survived
    assert await cached(100) == 0  # the least recently used one was evicted
    state = await sim_state(sim.url, http)
    assert state["kv"]["used_blocks"] == 0 and state["kv"]["cached_blocks"] <= 4


async def test_kv_pool_full_makes_requests_wait(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    sim = await make_sim(engine="vllm", kv_blocks=4, block_size=4, max_model_len=16)
    hog = {"prompt": list(range(12)), "max_tokens": 4, "stream": True}
    async with http.post(sim.url + "/v1/completions", json=hog,
                         headers={"x-sim-fault": "stall_after=1:inf"}) as resp:
        await next_event(resp)  # running, holding 4 blocks (12 prompt + 1 generated token)
        task = asyncio.ensure_future(call(http, sim.url + "/v1/completions",
                                          {"prompt": list(range(50, 58)), "max_tokens": 1}))
        state = await wait_state(http, sim.url, lambda s: len(s["waiting"]) == 1)
        assert len(state["running"]) == 1 and state["kv"]["used_blocks"] == 4
    # The hog's client went away: its blocks are freed and the waiting request runs.
    status, data, _ = await task
    assert status == 200 and data["choices"][0]["finish_reason"] == "length"


async def test_max_num_seqs_queues_requests(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    sim = await make_sim(engine="vllm", max_num_seqs=1)
    body = {"messages": CHAT, "stream": True, "max_tokens": 3}
    async with http.post(sim.url + "/v1/chat/completions", json=body,
                         headers={"x-sim-fault": "stall_after=1:inf"}) as resp:
        await next_event(resp)
        second = asyncio.ensure_future(call(http, sim.url + "/v1/chat/completions",
                                            {"messages": CHAT, "max_tokens": 2}))
        state = await wait_state(http, sim.url, lambda s: len(s["waiting"]) == 1)
        assert len(state["running"]) == 1 and state["waiting"][0]["generated"] == 0
        samples = await metric_samples(http, sim.url)
        assert metric(samples, "vllm:num_requests_waiting") == 1
        assert metric(samples, "vllm:num_requests_running") == 1
        async with http.get(sim.url + "/load") as r:
            assert (await r.json())["server_load"] == 2
    status, data, _ = await second
    assert status == 200 and data["usage"]["completion_tokens"] == 2
    samples = await metric_samples(http, sim.url)
    assert metric(samples, "vllm:request_queue_time_seconds_count") == 2
    assert metric(samples, "vllm:num_requests_waiting") == 0


# -- faults ---------------------------------------------------------------------------------------


async def test_fault_status_in_each_engine_shape(vllm: SimServer, sglang: SimServer,
                                                 http: aiohttp.ClientSession) -> None:
    fault = {"x-sim-fault": "status=503"}
    status, data, _ = await call(http, vllm.url + "/v1/chat/completions", {"messages": CHAT, "stream": True},
                                 fault)
    assert status == 503 and data["error"]["code"] == 503 and data["error"]["type"] == "ServiceUnavailableError"
    status, data, _ = await call(http, sglang.url + "/v1/chat/completions", {"messages": CHAT}, fault)
    assert status == 503 and data["object"] == "error" and data["type"] == "503"
    status, data, _ = await call(http, sglang.url + "/generate", {"text": "hi"}, fault)
    assert status == 503 and set(data["error"]) == {"message"}
    assert (await sim_state(vllm.url, http))["counts"]["errors"] == 1


async def test_fault_error_after(vllm: SimServer, sglang: SimServer, http: aiohttp.ClientSession) -> None:
    fault = {"x-sim-fault": "error_after=2"}
    body = {"messages": CHAT, "stream": True, "max_tokens": 5}
    status, events, _ = await call(http, vllm.url + "/v1/chat/completions", body, fault)
    assert status == 200 and events[-1] == "[DONE]"
    assert [e["choices"][0]["delta"].get("content") for e in events[1:3]] != [None, None]
    assert events[-2] == {"error": {"message": "Internal server error", "type": "InternalServerError",
                                    "param": None, "code": 500}}
    assert len(events) == 5  # role, 2 tokens, error, [DONE]
    status, data, _ = await call(http, vllm.url + "/v1/chat/completions", {"messages": CHAT}, fault)
    assert status == 500 and data["error"]["type"] == "InternalServerError"
    state = await sim_state(vllm.url, http)
    assert state["counts"]["errors"] == 2 and not state["running"]
    samples = await metric_samples(http, vllm.url)
    assert metric(samples, "vllm:request_success_total", finished_reason="error") == 2

    # SGLang: an error before the first chunk is still a proper HTTP error (no headers were sent).
    status, data, _ = await call(http, sglang.url + "/v1/chat/completions", body, {"x-sim-fault": "error_after=0"})
    assert status == 500 and data["object"] == "error" and data["code"] == 500
    status, events, _ = await call(http, sglang.url + "/v1/chat/completions", body, fault)
    assert status == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["object"] == "error" and events[-2]["error"]["code"] == 500


async def test_fault_error_code(vllm: SimServer, sglang: SimServer, http: aiohttp.ClientSession) -> None:
    """``error_code``: the status ``error_after``'s failure carries, in its event or its answer."""
    body = {"messages": CHAT, "stream": True, "max_tokens": 5}
    for after in (0, 2):        # before the first token (a vLLM stream's head went out already), and after two
        fault = {"x-sim-fault": f"error_after={after};error_code=501"}
        status, events, _ = await call(http, vllm.url + "/v1/chat/completions", body, fault)
        assert status == 200 and events[-1] == "[DONE]"
        assert events[-2] == {"error": {"message": f"Simulated engine failure after {after} tokens",
                                        "type": "NotImplementedError", "param": None, "code": 501}}
    status, data, _ = await call(http, vllm.url + "/v1/chat/completions", {"messages": CHAT},
                                 {"x-sim-fault": "error_after=2;error_code=501"})
    assert status == 501 and data["error"]["code"] == 501 and data["error"]["type"] == "NotImplementedError"
    status, events, _ = await call(http, sglang.url + "/v1/chat/completions", body,
                                   {"x-sim-fault": "error_after=2;error_code=501"})
    assert status == 200 and events[-2]["error"]["code"] == 501
    status, data, _ = await call(http, sglang.url + "/v1/chat/completions", body,
                                 {"x-sim-fault": "error_after=0;error_code=501"})
    assert status == 501 and data["code"] == 501
    status, events, _ = await call(http, vllm.url + "/v1/chat/completions", body,
                                   {"x-sim-fault": "error_after=1;error_code=500"})
    assert events[-2]["error"]["code"] == 500 and events[-2]["error"]["message"] == "Internal server error"


async def test_fault_error_code_quoted_is_sent_as_a_string(vllm: SimServer, sglang: SimServer,
                                                           http: aiohttp.ClientSession) -> None:
    """``error_code="501"``: the in-stream event's ``code`` is the string ``"501"``; an answer's
    HTTP status stays the number."""
    body = {"messages": CHAT, "stream": True, "max_tokens": 5}
    fault = {"x-sim-fault": 'error_after=2;error_code="501"'}
    for sim in (vllm, sglang):
        status, events, _ = await call(http, sim.url + "/v1/chat/completions", body, fault)
        assert status == 200 and events[-1] == "[DONE]" and events[-2]["error"]["code"] == "501"
    status, events, _ = await call(http, vllm.url + "/v1/completions", {"prompt": "hi", "stream": True,
                                                                         "max_tokens": 5}, fault)
    assert status == 200 and events[-2]["error"]["code"] == "501"
    status, data, _ = await call(http, vllm.url + "/v1/chat/completions", {"messages": CHAT}, fault)
    assert status == 501 and data["error"]["code"] == "501"
    status, events, _ = await call(http, vllm.url + "/v1/chat/completions", body,
                                   {"x-sim-fault": 'error_after=1;error_code="500"'})
    assert events[-2]["error"]["code"] == "500"


async def test_fault_drop_after(vllm: SimServer, sglang: SimServer, http: aiohttp.ClientSession) -> None:
    for sim in (vllm, sglang):
        body = {"messages": CHAT, "stream": True, "max_tokens": 10}
        received = b""
        with pytest.raises(aiohttp.ClientError):
            async with http.post(sim.url + "/v1/chat/completions", json=body,
                                 headers={"x-sim-fault": "drop_after=2"}) as resp:
                async for piece in resp.content.iter_any():
                    received += piece
        events = parse_sse(received.decode())
        assert "[DONE]" not in events
        assert sum(1 for e in events if e["choices"][0]["delta"].get("content")) == 2
        state = await wait_state(http, sim.url, lambda s: not s["running"])
        assert state["counts"]["errors"] == 1 and state["counts"]["aborted"] == 0
    with pytest.raises(aiohttp.ClientError):
        await call(http, vllm.url + "/v1/completions", {"prompt": "x", "max_tokens": 5},
                   {"x-sim-fault": "drop_after=1"})


async def test_fault_stall_after_then_client_gives_up(vllm: SimServer, http: aiohttp.ClientSession) -> None:
    body = {"messages": CHAT, "stream": True, "max_tokens": 10}
    async with http.post(vllm.url + "/v1/chat/completions", json=body,
                         headers={"x-sim-fault": "stall_after=2:inf"}) as resp:
        for _ in range(3):  # role chunk + 2 tokens
            await next_event(resp)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(next_event(resp), 0.1)
        assert (await sim_state(vllm.url, http))["running"][0]["generated"] == 2
    state = await wait_state(http, vllm.url, lambda s: s["counts"]["aborted"] == 1)
    assert not state["running"] and state["kv"]["used_blocks"] == 0


async def test_fault_slow_headers(vllm: SimServer, http: aiohttp.ClientSession) -> None:
    body = {"messages": CHAT, "stream": True, "max_tokens": 2}
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(http.post(vllm.url + "/v1/chat/completions", json=body,
                                         headers={"x-sim-fault": "slow_headers=inf"}), 0.1)
    # The engine generated regardless of the withheld headers; nothing is left running.
    await wait_state(http, vllm.url, lambda s: s["counts"]["completed"] == 1 and not s["running"])
    status, events, _ = await call(http, vllm.url + "/v1/chat/completions", body,
                                   {"x-sim-fault": "slow_headers=0.01"})
    assert status == 200 and events[-1] == "[DONE]"


async def test_default_fault_probability_and_override(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    sim = await make_sim(engine="vllm", fault="status=429")
    body = {"messages": CHAT, "max_tokens": 1}
    assert (await call(http, sim.url + "/v1/chat/completions", body))[0] == 429
    assert (await call(http, sim.url + "/v1/chat/completions", body, {"x-sim-fault": "none"}))[0] == 200
    assert (await call(http, sim.url + "/v1/chat/completions", body,
                       {"x-sim-fault": "status=500;p=0"}))[0] == 200
    status, data, _ = await call(http, sim.url + "/v1/chat/completions", body, {"x-sim-fault": "bogus=1"})
    assert status == 400 and "unknown fault" in data["error"]["message"]
    await call(http, sim.url + "/_sim/config", {"fault": ""})
    assert (await call(http, sim.url + "/v1/chat/completions", body))[0] == 200


def test_fault_spec_parsing() -> None:
    spec = parse_fault(" status=503 ; stall_after=3:0.5; drop_after=7;slow_headers=inf;p=0.25 ")
    assert spec.status == 503 and spec.stall_after == (3, 0.5) and spec.drop_after == 7
    assert spec.slow_headers == float("inf") and spec.probability == 0.25 and spec.active
    assert not parse_fault("none").active and not parse_fault("").active
    assert parse_fault("error_after=0;error_code=501").error_code == 501
    assert not parse_fault("error_after=0;error_code=501").error_code_text
    quoted = parse_fault('error_after=0;decode.error_code="501"', role="decode")
    assert quoted.error_code == 501 and quoted.error_code_text
    for bad in ("status=200", "stall_after=3", "error_after=-1", "x", "p=2", "stall_before_first=abc",
                "error_code=200", "error_code=x", 'error_code="x"', 'error_code="200"', 'error_code="501'):
        with pytest.raises(FaultSpecError):
            parse_fault(bad)


# -- client disconnect ----------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_client_disconnect_aborts(engine: str, make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    sim = await make_sim(engine=engine, itl_ms=5.0)
    body = {"messages": CHAT, "stream": True, "max_tokens": 1000, "rid": "gone-1"}
    async with http.post(sim.url + "/v1/chat/completions", json=body,
                         headers={"X-Request-Id": "gone-1"}) as resp:
        await next_event(resp)
        await next_event(resp)
    state = await wait_state(http, sim.url, lambda s: s["counts"]["aborted"] == 1)
    assert state["running"] == [] and state["waiting"] == [] and state["kv"]["used_blocks"] == 0
    assert state["counts"]["completed"] == 0
    assert state["aborted_ids"] == ["chatcmpl-gone-1" if engine == "vllm" else "gone-1"]
    samples = await metric_samples(http, sim.url)
    if engine == "vllm":
        assert metric(samples, "vllm:request_success_total", finished_reason="abort") == 1
    else:
        assert metric(samples, "sglang:num_aborted_requests_total") == 1


async def test_non_stream_disconnect_aborts(sglang: SimServer, http: aiohttp.ClientSession) -> None:
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(call(http, sglang.url + "/generate", {"text": "hi"},
                                    {"x-sim-fault": "stall_before_first=inf"}), 0.1)
    await wait_state(http, sglang.url, lambda s: s["counts"]["aborted"] == 1 and not s["running"])


async def test_close_ends_open_streams(http: aiohttp.ClientSession) -> None:
    sim = await start_sim(SimConfig(engine="vllm", **FAST))
    body = {"messages": CHAT, "stream": True, "max_tokens": 5}
    async with http.post(sim.url + "/v1/chat/completions", json=body,
                         headers={"x-sim-fault": "stall_before_first=inf"}) as stalled:
        slow = asyncio.ensure_future(http.post(sim.url + "/v1/chat/completions", json=body,
                                               headers={"x-sim-fault": "slow_headers=inf"}))
        # The slow-headers request has finished generating; only its headers are held back.
        await wait_state(http, sim.url, lambda s: s["counts"]["started"] == 2 and s["counts"]["completed"] == 1)
        await sim.close()
        events = parse_sse((await stalled.read()).decode())
        assert events[-2]["choices"][0]["finish_reason"] == "abort" and events[-1] == "[DONE]"
        async with await slow as resp:
            assert resp.status == 200
            assert parse_sse((await resp.read()).decode())[-1] == "[DONE]"
    assert not sim.engine._tasks and sim.engine.counts.aborted == 1


# -- startup, metrics, SDK, config ----------------------------------------------------------------


async def test_vllm_refuses_connections_until_ready(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    slow = await make_sim(wait=False, engine="vllm", startup_delay_s=30.0)
    with pytest.raises(aiohttp.ClientConnectorError):
        await http.get(slow.url + "/health")
    quick = await make_sim(wait=False, engine="vllm", startup_delay_s=0.05)
    await quick.wait_ready()
    async with http.get(quick.url + "/health") as resp:
        assert resp.status == 200


async def test_sglang_health_503_while_starting(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    sim = await make_sim(wait=False, engine="sglang", startup_delay_s=30.0)
    for path in ("/health", "/health_generate", "/ready"):
        async with http.get(sim.url + path) as resp:
            assert resp.status == 503
    async with http.get(sim.url + "/model_info") as resp:
        assert resp.status == 200
    quick = await make_sim(wait=False, engine="sglang", startup_delay_s=0.05)
    await quick.wait_ready()
    async with http.get(quick.url + "/health") as resp:
        assert resp.status == 200


async def test_metrics_names_and_labels(vllm: SimServer, sglang: SimServer, http: aiohttp.ClientSession) -> None:
    for sim in (vllm, sglang):
        await call(http, sim.url + "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "stream": True})
    async with http.get(vllm.url + "/metrics") as resp:
        text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens",
                 "vllm:generation_tokens", "vllm:request_success", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:cache_config_info"):
        assert name in families, name
    samples = await metric_samples(http, vllm.url)
    assert metric(samples, "vllm:generation_tokens_total", model_name="llama", engine="0") == 3
    assert metric(samples, "vllm:request_success_total", finished_reason="length") == 1
    assert metric(samples, "vllm:time_to_first_token_seconds_count") == 1
    assert metric(samples, "vllm:inter_token_latency_seconds_count") == 2
    assert metric(samples, "vllm:cache_config_info", block_size="16", enable_prefix_caching="True") == 1

    async with http.get(sglang.url + "/metrics") as resp:
        text = await resp.text()
    assert "_created" not in text  # SGLang's multiprocess collector has none
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                 "sglang:cache_hit_rate", "sglang:gen_throughput", "sglang:prompt_tokens",
                 "sglang:generation_tokens", "sglang:num_requests", "sglang:cached_tokens",
                 "sglang:num_aborted_requests", "sglang:time_to_first_token_seconds"):
        assert name in families, name
    samples = await metric_samples(http, sglang.url)
    assert metric(samples, "sglang:num_requests_total", model_name="org/llama-sim", engine_type="unified") == 1
    assert metric(samples, "sglang:generation_tokens_total") == 3


async def test_metrics_tell_the_capacity_as_the_real_engines_do(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    """vLLM: the KV pool in cache_config_info's labels (no series for max_num_seqs); SGLang: the KV
    pool and the running-requests cap as gauges. What admission control reads before the engine queued."""
    vllm = await make_sim(engine="vllm", max_num_seqs=3, kv_blocks=100, block_size=16, max_model_len=400)
    samples = await metric_samples(http, vllm.url)
    assert metric(samples, "vllm:cache_config_info", num_gpu_blocks="100", kv_cache_size_tokens="1600",
                  kv_cache_max_concurrency="4.0") == 1
    sglang = await make_sim(engine="sglang", max_num_seqs=3, kv_blocks=1000)
    samples = await metric_samples(http, sglang.url)
    assert metric(samples, "sglang:max_running_requests", cap_source="requested") == 3
    assert metric(samples, "sglang:max_total_num_tokens") == 1000


async def test_vllm_metrics_tell_the_process_start_time(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    """vLLM serves prometheus_client's default registry, whose process collector reports the
    server's start: each simulator its own, kept across /_sim/reset. SGLang's multiprocess registry
    has no process collector, so none."""
    first = await make_sim(engine="vllm")
    second = await make_sim(engine="vllm")
    started = metric(await metric_samples(http, first.url), "process_start_time_seconds")
    assert abs(started - first.engine.started_at) < 1e-6
    assert abs(metric(await metric_samples(http, second.url), "process_start_time_seconds")
               - second.engine.started_at) < 1e-6
    await call(http, first.url + "/_sim/reset", {})
    assert metric(await metric_samples(http, first.url), "process_start_time_seconds") == started
    sglang = await make_sim(engine="sglang")
    assert not any(k.startswith("process_") for k in await metric_samples(http, sglang.url))


async def test_sglang_metrics_can_be_off(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    sim = await make_sim(engine="sglang", enable_metrics=False)
    async with http.get(sim.url + "/metrics") as resp:
        assert resp.status == 404


async def test_sim_reset(vllm: SimServer, http: aiohttp.ClientSession) -> None:
    await call(http, vllm.url + "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert (await sim_state(vllm.url, http))["counts"]["completed"] == 1
    _, state, _ = await call(http, vllm.url + "/_sim/reset", {})
    assert state["counts"] == {"started": 0, "completed": 0, "aborted": 0, "errors": 0, "waiting_peak": 0}
    samples = await metric_samples(http, vllm.url)
    assert metric(samples, "vllm:request_success_total") == 0


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_openai_sdk(engine: str, make_sim: MakeSim) -> None:
    sim = await make_sim(engine=engine, model="sdk-model")
    client = AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0)
    try:
        done = await client.chat.completions.create(model="sdk-model", messages=CHAT, max_tokens=4)  # type: ignore[arg-type]
        assert done.choices[0].message.content and done.choices[0].finish_reason == "length"
        assert done.usage is not None and done.usage.completion_tokens == 4
        stream = await client.chat.completions.create(
            model="sdk-model", messages=CHAT, max_tokens=4, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
        assert text == done.choices[0].message.content
        assert usage is not None and usage.completion_tokens == 4
        comp = await client.completions.create(model="sdk-model", prompt="Hello", max_tokens=2)
        assert comp.choices[0].text
    finally:
        await client.close()


def test_config_validation_and_cli() -> None:
    assert SimConfig(role="prefill").role == "prefill"  # P/D roles: tests/integration/enginesim/test_pd.py
    with pytest.raises(ValueError, match="unknown role"):
        SimConfig(role="bogus")
    with pytest.raises(ValueError):
        SimConfig(fault="status=200")
    assert SimConfig(engine="vllm").block_size == 16 and SimConfig(engine="sglang").block_size == 1
    cfg = config_from_args(["--engine", "sglang", "--model", "m", "--served-model-name", "a", "b",
                            "--itl-ms", "3", "--no-enable-prefix-caching", "--fault", "drop_after=2"])
    assert cfg.engine == "sglang" and cfg.port == 30000 and cfg.served_model_names == ("a", "b")
    assert cfg.itl_ms == 3.0 and cfg.enable_prefix_caching is False and cfg.fault == "drop_after=2"
    assert config_from_args(["--engine", "vllm"]).port == 8000
    with pytest.raises(SystemExit):
        config_from_args(["--role", "bogus"])


# -- units: tokenizer and block pool --------------------------------------------------------------


@given(st.text(max_size=200))
def test_tokenizer_round_trip(text: str) -> None:
    tok = FakeTokenizer()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode(text) == ids


def test_tokenizer_about_four_chars_per_token() -> None:
    ids = FakeTokenizer().encode(LONG_TEXT)
    assert len(LONG_TEXT) / 6 < len(ids) < len(LONG_TEXT) / 2
    assert render_chat(CHAT).endswith("<|assistant|>\n")


def test_block_pool_keeps_referenced_blocks() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    root = root_key("m")
    a = list(range(10, 15))  # 5 tokens: 2 full blocks + 1 partial
    ha = pool.block_hashes(a, root)
    alloc_a = pool.allocate(ha, len(a))
    assert alloc_a is not None and pool.used_blocks == 3
    pool.commit(alloc_a)
    b = list(range(50, 55))
    assert pool.allocate(pool.block_hashes(b, root), len(b)) is None  # in-use blocks are not evicted
    shared = pool.allocate(ha, len(a))  # the same prompt shares the cached blocks
    assert shared is not None and shared.hit_blocks == 2 and pool.used_blocks == 4
    pool.free(shared)
    pool.free(alloc_a)
    assert pool.used_blocks == 0 and pool.cached_blocks == 2
    alloc_b = pool.allocate(pool.block_hashes(b, root), len(b))
    assert alloc_b is not None and pool.cached_blocks == 1  # evicted one cached block, LRU tail first
    assert pool.match(ha, len(a)) == 1


def test_itl_grows_with_running_requests_and_jitter_is_seeded() -> None:
    engine = Engine(SimConfig(itl_ms=10.0, itl_growth_per_running=2.0))
    assert engine._itl_s() == pytest.approx(0.010)
    engine.running.update(dict.fromkeys([object(), object(), object()]))  # type: ignore[arg-type]
    assert engine._itl_s() == pytest.approx(0.014)  # two other running requests, 2 ms each
    a = Engine(SimConfig(itl_ms=10.0, itl_jitter_ms=5.0, seed=7))
    b = Engine(SimConfig(itl_ms=10.0, itl_jitter_ms=5.0, seed=7))
    gaps = [a._itl_s() for _ in range(20)]
    assert gaps == [b._itl_s() for _ in range(20)]
    assert all(0.005 <= g <= 0.015 for g in gaps) and len(set(gaps)) > 1


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_completions_echo_begins_the_answer_with_the_prompt(engine: str, make_sim: MakeSim,
                                                                  http: aiohttp.ClientSession) -> None:
    """``echo``: a completion's text begins with its prompt, as vLLM and SGLang answer it. A stream
    sends the prompt's text with the first output's, on its first chunk; the usage counts the
    generated tokens only, and vLLM's ``token_ids`` are the generated ones."""
    sim = await make_sim(engine=engine, model="org/llama-sim")
    url = sim.url + "/v1/completions"
    prompt = "Once upon a time"
    body = {"model": "org/llama-sim", "prompt": prompt, "max_tokens": 5}
    _, plain, _ = await call(http, url, body)
    _, echoed, _ = await call(http, url, {**body, "echo": True})
    assert echoed["choices"][0]["text"] == prompt + plain["choices"][0]["text"]
    counts = ("prompt_tokens", "completion_tokens")
    assert [echoed["usage"][k] for k in counts] == [plain["usage"][k] for k in counts]
    opts = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            **({"return_token_ids": True} if engine == "vllm" else {})}
    _, ref, _ = await call(http, url, {**body, **opts})
    _, events, _ = await call(http, url, {**body, **opts, "echo": True})
    chunks = [e for e in events if isinstance(e, dict) and e["choices"]]
    ref_chunks = [e for e in ref if isinstance(e, dict) and e["choices"]]
    assert len(chunks) == len(ref_chunks)
    assert chunks[0]["choices"][0]["text"] == prompt + ref_chunks[0]["choices"][0]["text"]
    assert [c["choices"][0]["text"] for c in chunks[1:]] == [c["choices"][0]["text"] for c in ref_chunks[1:]]
    assert [[c["usage"][k] for k in counts] for c in chunks] == [[c["usage"][k] for k in counts] for c in ref_chunks]
    assert events[-2]["usage"]["completion_tokens"] == 5
    if engine == "vllm":
        assert [c["choices"][0]["token_ids"] for c in chunks] == [c["choices"][0]["token_ids"] for c in ref_chunks]
        assert chunks[0]["choices"][0]["prompt_token_ids"] == ref_chunks[0]["choices"][0]["prompt_token_ids"]
    # a prompt of token ids echoes their text
    ids = sim.engine.tokenizer.encode(prompt)
    _, by_ids, _ = await call(http, url, {**body, "prompt": ids, "echo": True})
    assert by_ids["choices"][0]["text"] == sim.engine.tokenizer.decode(ids) + plain["choices"][0]["text"]


async def test_vllm_chat_echo_sends_the_last_message_back_first(vllm: SimServer, http: aiohttp.ClientSession) -> None:
    """vLLM's chat ``echo``: the last message's content when its role is the answer's (an assistant
    message, or any with ``add_generation_prompt: false``) begins the answer; a stream sends it in
    a chunk of its own after the role chunk; the usage does not count it."""
    url = vllm.url + "/v1/chat/completions"
    messages = CHAT + [{"role": "assistant", "content": "Switchyards are"}]
    body = {"model": "llama", "messages": messages, "max_tokens": 4, "continue_final_message": True,
            "add_generation_prompt": False}
    _, plain, _ = await call(http, url, body)
    _, echoed, _ = await call(http, url, {**body, "echo": True})
    assert echoed["choices"][0]["message"]["content"] == "Switchyards are" + plain["choices"][0]["message"]["content"]
    assert echoed["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"] == 4
    _, events, _ = await call(http, url, {**body, "echo": True, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in events if isinstance(e, dict) and e["choices"]]
    assert deltas[0]["role"] == "assistant" and deltas[1] == {"content": "Switchyards are"}
    assert "".join(d.get("content") or "" for d in deltas) == echoed["choices"][0]["message"]["content"]
    # a user message last, with the generation prompt: nothing to echo
    _, plain, _ = await call(http, url, {"model": "llama", "messages": CHAT, "max_tokens": 4})
    _, echoed, _ = await call(http, url, {"model": "llama", "messages": CHAT, "max_tokens": 4, "echo": True})
    assert echoed["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


async def _queue_in_order(sim: SimServer, http: aiohttp.ClientSession, path: str,
                          sends: list[tuple[dict[str, Any], dict[str, str]]]) -> list[dict[str, Any]]:
    """Hold the engine's one slot, queue ``sends`` one after another, and return its waiting queue."""
    tasks = [asyncio.create_task(call(http, sim.url + path, {"rid": "hold", "request_id": "hold", **sends[0][0]},
                                      {"x-sim-fault": "stall_before_first=inf"}))]
    await wait_state(http, sim.url, lambda s: len(s["running"]) == 1)
    for i, (body, headers) in enumerate(sends, 1):
        tasks.append(asyncio.create_task(call(http, sim.url + path, {**body, "rid": f"r{i}", "request_id": f"r{i}"},
                                              headers)))
        await wait_state(http, sim.url, lambda s, i=i: len(s["waiting"]) == i)
    waiting = (await sim_state(sim.url, http))["waiting"]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return waiting


async def test_priority_scheduling_orders_the_waiting_queue_in_each_engines_direction(
        make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    """vLLM ``--scheduling-policy priority`` admits the lowest ``priority`` first (0 when a request
    names none; ``X-Vllm-Priority`` over the body's); SGLang ``--enable-priority-scheduling`` the
    highest, one naming none last; then the earliest. Off (the default) the queue is FIFO."""
    v = await make_sim(engine="vllm", scheduling_policy="priority", max_num_seqs=1)
    body = {"model": "sim-model", "messages": CHAT, "max_tokens": 2}
    waiting = await _queue_in_order(v, http, "/v1/chat/completions", [
        (body, {}), ({**body, "priority": 3}, {}), ({**body, "priority": -2}, {}),
        ({**body, "priority": 3}, {"X-Vllm-Priority": "-5"}), ({**body, "priority": 0}, {})])
    assert [w["priority"] for w in waiting] == [-5, -2, None, 0, 3], waiting
    assert [w["id"] for w in waiting] == ["chatcmpl-r4", "chatcmpl-r3", "chatcmpl-r1", "chatcmpl-r5", "chatcmpl-r2"]

    gen = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    sends = [(gen, {}), ({**gen, "priority": 1}, {}), ({**gen, "priority": 5}, {}), ({**gen, "priority": 1}, {})]
    s = await make_sim(engine="sglang", enable_priority_scheduling=True, max_num_seqs=1)
    assert [w["rid"] for w in await _queue_in_order(s, http, "/generate", sends)] == ["r3", "r2", "r4", "r1"]
    off = await make_sim(engine="sglang", max_num_seqs=1)
    assert [w["rid"] for w in await _queue_in_order(off, http, "/generate", sends)] == ["r1", "r2", "r3", "r4"]


async def test_vllm_without_priority_scheduling_refuses_a_non_zero_priority(
        make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    """vLLM refuses a request whose priority is not 0 unless started with ``--scheduling-policy
    priority`` (400, "Got priority N but Priority scheduling is not enabled."), the body's or an
    ``X-Vllm-Priority`` header's; 0 passes. SGLang without priority scheduling serves it."""
    v = await make_sim(engine="vllm")
    body = {"model": "sim-model", "messages": CHAT, "max_tokens": 2}
    for extra, headers in (({"priority": -1}, {}), ({"priority": 0}, {"X-Vllm-Priority": "3"})):
        status, err, _ = await call(http, v.url + "/v1/chat/completions", {**body, **extra}, headers)
        assert status == 400 and err["error"]["type"] == "BadRequestError", err
        assert err["error"]["message"].startswith("Got priority ") and "Priority scheduling is not enabled" in \
            err["error"]["message"], err
    status, _, _ = await call(http, v.url + "/v1/completions", {"model": "sim-model", "prompt": "hi",
                                                                "max_tokens": 2, "priority": 0})
    assert status == 200
    s = await make_sim(engine="sglang")
    status, _, _ = await call(http, s.url + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2},
                                                         "priority": 5})
    assert status == 200


async def test_embeddings_dimensions_past_the_models_width_are_cut_to_it(
        vllm: SimServer, sglang: SimServer, http: aiohttp.ClientSession) -> None:
    """``dimensions`` keeps the first that many of the model's values (a Matryoshka cut), so asking
    for more than the model's width gives the whole vector, as an engine slicing its output does: a
    client's ``dimensions: 2**31`` is answered at once with 16 values, and the engine serves the next
    request, where it built a vector of two billion values and stopped answering."""
    for sim in (vllm, sglang):
        for dims in (17, 2**31, 2**63 - 1):
            status, data, _ = await call(http, sim.url + "/v1/embeddings", {"input": "hello", "dimensions": dims})
            assert status == 200, (sim.url, dims, data)
            assert len(data["data"][0]["embedding"]) == 16
        status, data, _ = await call(http, sim.url + "/v1/embeddings", {"input": "hello", "dimensions": 4})
        assert status == 200 and len(data["data"][0]["embedding"]) == 4
