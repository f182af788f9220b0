"""The aggregated gateway as a user sees it: the real OpenAI SDK against real sockets."""

from __future__ import annotations

import array
import asyncio
import base64
import hashlib

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web
from yarl import URL

from tests.support.factories import model_block
from tests.support.fake_engine import fake_engine
from tests.support.http import bearer, openai_client, sim_state
from tests.support.metrics import metric
from tests.support.waiting import wait_for

CHAT = [{"role": "user", "content": "Tell me about switchyards and trains."}]


@pytest.fixture
async def fleet(sims, gateway):
    v1 = await sims("vllm", "llama")
    v2 = await sims("vllm", "llama")
    s1 = await sims("sglang", "qwen")
    s2 = await sims("sglang", "qwen")
    gw = await gateway([model_block("llama", "vllm", [v1.url, v2.url]),
                        model_block("qwen", "sglang", [s1.url, s2.url])])
    return gw, (v1, v2, s1, s2)


@pytest.mark.parametrize("model", ["llama", "qwen"])
async def test_async_sdk_chat_stream_and_not(fleet, model):
    gw, _ = fleet
    client = openai_client(gw)
    r = await client.chat.completions.create(model=model, messages=CHAT, max_tokens=8)
    assert r.choices[0].message.content
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0

    stream = await client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, stream=True)
    text, usage_chunks, finish = [], 0, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage_chunks += 1
        for c in chunk.choices:
            if c.delta.content:
                text.append(c.delta.content)
            finish = c.finish_reason or finish
    assert "".join(text)
    assert finish == "length"
    # the client did not ask for usage: it must not see the usage chunk the gateway asked for
    assert usage_chunks == 0
    await client.close()


@pytest.mark.parametrize("model,path", [("llama", "chat"), ("qwen", "chat"), ("qwen", "completions")])
async def test_continuous_usage_stats_without_include_usage_as_the_engine_answers_it(fleet, model, path):
    """``stream_options: {continuous_usage_stats: true}`` without ``include_usage``: vLLM then sends
    no usage at all, SGLang the usage on every chunk (it reads the two options apart) and no usage
    chunk at the end. The client sees what its engine would have sent it, and the stream is counted."""
    gw, sims_ = fleet
    engine_url = sims_[0].url if model == "llama" else sims_[2].url
    client = openai_client(gw)
    create = client.chat.completions.create if path == "chat" else client.completions.create
    args = {"messages": CHAT} if path == "chat" else {"prompt": "Once upon a time"}
    body = {"model": model, "max_tokens": 4, "stream": True, "stream_options": {"continuous_usage_stats": True}, **args}
    async with aiohttp.ClientSession() as s, s.post(f"{engine_url}/v1/{path.replace('chat', 'chat/completions')}",
                                                    json=body) as r:
        direct = [orjson.loads(line[6:]) for line in (await r.text()).split("\n") if line.startswith("data: {")]
    with gw.gw.request_log.capture() as logs:
        chunks = [c async for c in await create(**{k: v for k, v in body.items() if k != "stream"}, stream=True)]
    assert [c.usage is not None for c in chunks] == ["usage" in d for d in direct]
    assert [bool(c.choices) for c in chunks] == [bool(d["choices"]) for d in direct]
    if model == "qwen":
        assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].choices
    line = next(e for e in logs if e["event"] == "request")
    assert line["completion_tokens"] == 4 and line["prompt_tokens"] > 0
    await client.close()


@pytest.mark.parametrize("model", ["llama", "qwen"])
async def test_sync_sdk_completions_with_usage(fleet, model):
    gw, _ = fleet

    def call():  # the sync client runs in a thread while the gateway serves on this loop
        client = openai.OpenAI(base_url=gw.base_url, api_key="none", max_retries=0)
        r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5)
        assert r.choices[0].text and r.usage.completion_tokens == 5
        chunks = list(client.completions.create(model=model, prompt="Once upon a time", max_tokens=5,
                                                stream=True, stream_options={"include_usage": True}))
        usage = [c.usage for c in chunks if c.usage is not None]
        assert len(usage) == 1 and usage[0].completion_tokens == 5
        assert "".join(c.choices[0].text for c in chunks if c.choices)
        client.close()

    await asyncio.to_thread(call)


async def test_streamed_tokens_are_accounted_even_without_client_usage(fleet):
    gw, _ = fleet
    client = openai_client(gw)
    for _ in range(2):
        stream = await client.chat.completions.create(model="llama", messages=CHAT, max_tokens=7, stream=True)
        async for _chunk in stream:
            pass
    await client.close()
    text = await gw.metrics_text()
    assert 'switchyard_completion_tokens_total{model="llama"} 14.0' in text
    assert 'switchyard_time_to_first_token_seconds_count{model="llama"} 2.0' in text
    assert 'switchyard_requests_total{model="llama",status="200",strategy="least-request"} 2.0' in text


async def test_response_headers_and_request_id(fleet):
    gw, (v1, v2, *_) = fleet
    client = openai_client(gw)
    raw = await client.chat.completions.with_raw_response.create(
        model="llama", messages=CHAT, max_tokens=2, extra_headers={"x-request-id": "my-trace-42"})
    assert raw.headers["request-id"] == "my-trace-42"
    assert raw.headers["x-request-id"] == "my-trace-42"
    assert raw.headers["routing-strategy"] == "least-request"
    assert raw.headers["target-pod"] in {v1.url.split("//")[1], v2.url.split("//")[1]}
    body = raw.parse()
    assert body.id == "chatcmpl-my-trace-42"      # vLLM built its id from the forwarded X-Request-Id

    raw = await client.chat.completions.with_raw_response.create(
        model="llama", messages=CHAT, max_tokens=2, extra_headers={"x-request-id": "bad id with spaces"})
    assert raw.headers["request-id"] != "bad id with spaces" and len(raw.headers["request-id"]) == 32
    await client.close()


async def test_routing_strategy_header_and_round_robin(fleet):
    gw, (v1, v2, *_) = fleet
    pods = []
    async with aiohttp.ClientSession() as s:
        for _ in range(4):
            async with s.post(gw.url + "/v1/chat/completions", headers={"routing-strategy": "round-robin"},
                              json={"model": "llama", "messages": CHAT, "max_tokens": 1}) as r:
                assert r.status == 200
                assert r.headers["routing-strategy"] == "round-robin"
                pods.append(r.headers["target-pod"])
    assert pods[0] != pods[1] and pods[0] == pods[2] and pods[1] == pods[3]


async def test_models_health_ready_metrics(fleet):
    gw, _ = fleet
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/v1/models") as r:
            data = await r.json()
            assert data["object"] == "list"
            assert sorted(m["id"] for m in data["data"]) == ["llama", "qwen"]
            assert all(m["object"] == "model" for m in data["data"])
        async with s.get(gw.url + "/health") as r:
            assert r.status == 200
        async with s.get(gw.url + "/ready") as r:
            assert r.status == 200
        async with s.get(gw.url + "/metrics") as r:
            text = await r.text()
            assert "switchyard_requests_total" in text or "switchyard_in_flight_requests" in text
    client = openai_client(gw)
    models = await client.models.list()
    assert {m.id for m in models.data} == {"llama", "qwen"}
    await client.close()


async def test_one_model_is_retrieved_by_its_id(sims, gateway):
    """GET /v1/models/{id}, the openai SDK's ``models.retrieve``: a model, an alias, a name with a
    slash (as is or percent-encoded) or not ASCII; an unknown id is OpenAI's 404."""
    v = await sims("vllm", "org/llama")
    s = await sims("sglang", "qwen-ü")
    gw = await gateway([model_block("org/llama", "vllm", [v.url]), model_block("qwen-ü", "sglang", [s.url])],
                       aliases=[{"name": "chat", "targets": [{"model": "org/llama"}]}])
    client = openai_client(gw)
    listed = {m.id: m for m in (await client.models.list()).data}
    for name in ("org/llama", "chat", "qwen-ü"):
        got = await client.models.retrieve(name)
        assert got == listed[name]
    with pytest.raises(openai.NotFoundError) as ei:
        await client.models.retrieve("org/nope")
    assert ei.value.body["code"] == "model_not_found" and ei.value.body["param"] == "model"
    await client.close()
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/v1/models/org%2Fllama") as r:
            assert r.status == 200 and (await r.json())["id"] == "org/llama"
        async with http.get(gw.url + "/v1/models/nope") as r:
            assert r.status == 404 and r.headers["x-error-no-model-backends"] == "nope"
        # an id with a line break or a tab in it is an unknown id like any other, not another path
        for raw, name in (("m%0A", "m\n"), ("%0D%0Ax", "\r\nx"), ("a%09b", "a\tb"), ("org/llama%0A", "org/llama\n")):
            async with http.get(URL(gw.url + "/v1/models/" + raw, encoded=True)) as r:
                got = await r.json()
                assert r.status == 404 and got["error"]["code"] == "model_not_found", (raw, got)
                assert got["error"]["param"] == "model" and f"`{name}`" in got["error"]["message"], got
                assert "\n" not in r.headers["x-error-no-model-backends"]


async def test_embeddings(sims, gateway):
    e = await sims("vllm", "embed")
    gw = await gateway([model_block("embed", "vllm", [e.url])])
    client = openai_client(gw)
    r = await client.embeddings.create(model="embed", input=["hello", "world"])
    assert len(r.data) == 2 and len(r.data[0].embedding) > 0
    await client.close()


async def test_embeddings_reach_the_client_as_the_engine_wrote_them_and_are_charged(sims, gateway):
    """``encoding_format`` base64 comes back as the engine's base64 (the SDK decodes it when it
    asked for it itself), equal to the float answer; ``dimensions`` and a batch of token-id lists
    reach the engine; the usage the engine reports is counted in the metrics and charged to the
    user's TPM window, as a chat answer's is."""
    e = await sims("vllm", "org/embed")
    key = "sk-alice-0123456789"
    gw = await gateway([model_block("org/embed", "vllm", [e.url])], auth={"api_keys": [{"key": key, "user": "alice"}]},
                       limits={"users": {"alice": {"tpm": 1000}}})
    client = openai_client(gw, key)
    texts = ["hello", "world"]
    floats = await client.embeddings.create(model="org/embed", input=texts, encoding_format="float")
    raw = await client.embeddings.with_raw_response.create(model="org/embed", input=texts, encoding_format="base64")
    for f, d in zip(floats.data, raw.http_response.json()["data"], strict=True):
        assert list(array.array("f", base64.b64decode(d["embedding"]))) == pytest.approx(f.embedding, rel=1e-6)
    assert raw.headers["x-ratelimit-remaining-tokens"] == str(1000 - floats.usage.prompt_tokens)
    decoded = await client.embeddings.create(model="org/embed", input=texts)       # the SDK asks base64
    assert [d.embedding for d in decoded.data] == [pytest.approx(f.embedding, rel=1e-6) for f in floats.data]
    toks = await client.embeddings.create(model="org/embed", input=[[1, 2, 3], [4, 5]], dimensions=4)
    assert [len(d.embedding) for d in toks.data] == [4, 4] and toks.usage.prompt_tokens == 5
    await client.close()
    charged = 3 * floats.usage.prompt_tokens + 5
    assert metric(await gw.metrics_text(), "switchyard_prompt_tokens_total", model="org/embed") == charged
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/embeddings", json={"model": "org/embed", "input": "x"},
                                                    headers=bearer(key)) as r:
        assert r.status == 200 and r.headers["x-ratelimit-remaining-tokens"] == str(1000 - charged)


async def test_vllms_chat_embeddings_are_served_and_counted(sims, gateway):
    """vLLM's chat embeddings request: ``messages`` in the place of ``input`` on /v1/embeddings (a
    multimodal embedding model's usual request; the SDK sends it with ``client.post``). It reaches
    the engine and comes back as the engine answered it, its usage counted; a conversation that is
    no chat's (no messages, a message without a role) is refused naming the field, as for a chat."""
    e = await sims("vllm", "embed")
    gw = await gateway([model_block("embed", "vllm", [e.url])])
    client = openai_client(gw)
    messages = [{"role": "system", "content": "Embed this."},
                {"role": "user", "content": [{"type": "text", "text": "hello world"}]}]
    body = {"model": "embed", "messages": messages, "encoding_format": "float"}
    with gw.gw.request_log.capture() as logs:
        got = await client.post("/embeddings", cast_to=openai.types.CreateEmbeddingResponse, body=body)
    async with aiohttp.ClientSession() as s, s.post(e.url + "/v1/embeddings", json=body) as r:
        direct = await r.json()
    assert [d.embedding for d in got.data] == [d["embedding"] for d in direct["data"]]
    assert got.usage.prompt_tokens == direct["usage"]["prompt_tokens"] > 0
    assert metric(await gw.metrics_text(), "switchyard_prompt_tokens_total", model="embed") == got.usage.prompt_tokens
    line = next(e for e in logs if e["event"] == "request")
    assert line["status"] == 200 and line["prompt_tokens"] == got.usage.prompt_tokens
    for bad, param in (([], "messages"), ([{"content": "x"}], "messages[0].role")):
        with pytest.raises(openai.BadRequestError) as ei:
            await client.post("/embeddings", cast_to=openai.types.CreateEmbeddingResponse,
                              body={"model": "embed", "messages": bad})
        assert ei.value.param == param, ei.value.body
    await client.close()


async def test_engine_metrics_are_scraped_into_snapshots(fleet):
    gw, _ = fleet
    eps = gw.gw.pool.endpoints()
    ok = await wait_for(lambda: all(ep.metrics is not None for ep in eps), timeout=5)
    assert ok
    for ep in eps:
        assert ep.metrics.running is not None and ep.metrics.waiting is not None
        assert ep.metrics.kv_usage is not None


# -- validation: a clear OpenAI-shaped error, and no engine sees anything ------------------------

async def _post(url, body, headers=None):
    async with aiohttp.ClientSession() as s, s.post(url, data=body, headers=headers or {}) as r:
        return r.status, dict(r.headers), await r.read()


@pytest.mark.parametrize("path,body,headers,status,marker", [
    ("/v1/chat/completions", b"{oops", {}, 400, "x-error-request-body-processing"),
    ("/v1/chat/completions", orjson.dumps({"messages": CHAT}), {}, 400, None),
    ("/v1/chat/completions", orjson.dumps({"model": "llama", "messages": []}), {}, 400, None),
    ("/v1/chat/completions", orjson.dumps({"model": "llama", "messages": CHAT}),
     {"routing-strategy": "no-such-strategy"}, 400, "x-error-routing"),
    ("/v1/chat/completions", orjson.dumps({"model": "llama", "messages": CHAT}),
     {"routing-strategy": "least-request:1,bogus:2"}, 400, "x-error-routing"),
    ("/v1/embeddings", orjson.dumps({"model": "llama", "input": [1.5]}), {}, 400, None),
    ("/v1/chat/completions", orjson.dumps({"model": "nope", "messages": CHAT}), {}, 404,
     "x-error-no-model-backends"),
    ("/v1/nothing-here", b"{}", {}, 404, None),
])
async def test_validation_errors_touch_no_engine(fleet, path, body, headers, status, marker):
    gw, sims_ = fleet
    st, hdrs, raw = await _post(gw.url + path, body, {"Content-Type": "application/json", **headers})
    assert st == status
    err = orjson.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "request-id" in hdrs
    if marker:
        assert marker in {k.lower() for k in hdrs}
    for sim in sims_:
        assert (await sim_state(sim.url))["counts"]["started"] == 0


@pytest.mark.parametrize("fields", [{"prompt_embeds": "AAAA"}, {"prompt": None, "prompt_embeds": ["AAAA", "BBBB"]}])
async def test_a_completion_of_prompt_embeds_is_the_engines_to_answer(fleet, fields):
    """vLLM's completion request takes ``prompt_embeds`` (base64 tensors) in the place of ``prompt``:
    such a body reaches the engine, which serves it when started with ``--enable-prompt-embeds``
    and otherwise refuses it naming the field, as the simulated vLLM does. A body with neither is
    still the gateway's 400 naming ``prompt``."""
    gw, (v1, v2, _, _) = fleet
    client = openai_client(gw)
    with pytest.raises(openai.BadRequestError) as ei:
        await client.post("/completions", cast_to=openai.types.Completion,
                          body={"model": "llama", "max_tokens": 2, **fields})
    assert ei.value.param == "prompt_embeds" and "--enable-prompt-embeds" in ei.value.message, ei.value.body
    async def posts() -> int:
        received = [r for sim in (v1, v2) for r in (await sim_state(sim.url))["received"]]
        return sum(r["method"] == "POST" for r in received)

    assert await posts() == 1
    with pytest.raises(openai.BadRequestError) as ei:
        await client.post("/completions", cast_to=openai.types.Completion,
                          body={"model": "llama", "max_tokens": 2, "prompt_embeds": []})
    assert ei.value.param == "prompt" and ei.value.type == "invalid_request_error", ei.value.body
    assert await posts() == 1
    await client.close()


async def test_oversize_body_is_413(sims, gateway):
    v = await sims("vllm", "llama")
    gw = await gateway([model_block("llama", "vllm", [v.url])], server={"max_body_bytes": 1000})
    big = orjson.dumps({"model": "llama", "messages": [{"role": "user", "content": "x" * 5000}]})
    st, _, raw = await _post(gw.url + "/v1/chat/completions", big, {"Content-Type": "application/json"})
    assert st == 413
    assert orjson.loads(raw)["error"]["type"] == "invalid_request_error"
    assert (await sim_state(v.url))["counts"]["started"] == 0


async def test_sdk_exception_classes(fleet):
    gw, _ = fleet
    client = openai_client(gw)
    with pytest.raises(openai.NotFoundError) as ei:
        await client.chat.completions.create(model="unknown-model", messages=CHAT)
    assert ei.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="llama", messages=[])
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="llama", messages=CHAT,
                                             extra_headers={"routing-strategy": "nope"})
    await client.close()


async def test_no_ready_endpoint_is_503_with_retry_after(sims, gateway):
    gw = await gateway([model_block("llama", "vllm", ["http://127.0.0.1:9"])],
                       health={"interval_s": 0.05, "unhealthy_threshold": 1})
    ep = gw.gw.pool.endpoints()[0]
    assert await wait_for(lambda: not ep.ready, timeout=5)
    st, hdrs, raw = await _post(gw.url + "/v1/chat/completions",
                                orjson.dumps({"model": "llama", "messages": CHAT}),
                                {"Content-Type": "application/json"})
    assert st == 503 and "Retry-After" in hdrs
    assert orjson.loads(raw)["error"]["code"] == "service_unavailable"
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/ready") as r:
        assert r.status == 503


async def test_prefix_index_size_is_exported(sims, gateway):
    a, b = await sims("vllm", "m"), await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [a.url, b.url])], routing={"strategy": "prefix-cache"})
    long_prompt = [{"role": "user", "content": "a fairly long shared system prompt " * 200}]
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/chat/completions",
                                                    json={"model": "m", "messages": long_prompt, "max_tokens": 1}) as r:
        assert r.status == 200
    text = await gw.metrics_text()
    blocks = [ln for ln in text.splitlines() if ln.startswith("switchyard_prefix_index_blocks ")]
    assert blocks and float(blocks[0].split()[1]) > 0


async def test_one_structured_log_line_per_request(fleet):
    gw, _ = fleet
    with gw.gw.request_log.capture() as logs:
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/v1/chat/completions", headers={"x-request-id": "log-1", "user": "ann"},
                              json={"model": "llama", "messages": CHAT, "max_tokens": 3, "stream": True}) as r:
                await r.read()
            async with s.post(gw.url + "/v1/chat/completions", json={"model": "nope", "messages": CHAT}) as r:
                await r.read()
    lines = [e for e in logs if e["event"] == "request"]
    assert len(lines) == 2
    ok, bad = lines
    assert ok["request_id"] == "log-1" and ok["model"] == "llama" and ok["user"] == "ann"
    assert ok["status"] == 200 and ok["stream"] is True and ok["completion_tokens"] == 3
    assert ok["ttft_ms"] > 0 and ok["duration_ms"] >= ok["ttft_ms"] and ok["endpoint"] and ok["strategy"]
    assert bad["status"] == 404 and bad["error_class"] == "model_not_found"


async def test_a_client_written_value_of_megabytes_makes_a_bounded_log_line(fleet):
    """A body's ``user`` or an unknown model's name is the client's to choose: logged whole, one
    request made a log line of megabytes (and the error line repeats the model's name). A claimed
    user that long is logged as the digest it is kept as."""
    gw, _ = fleet
    client = openai_client(gw)
    with gw.gw.request_log.capture() as logs:
        await client.chat.completions.create(model="llama", messages=CHAT, max_tokens=2, user="u" * 300_000)
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="x" * 300_000, messages=CHAT, max_tokens=2)
    await client.close()
    ok, bad = [e for e in logs if e["event"] == "request"]
    assert ok["status"] == 200 and ok["user"] == "sha256:" + hashlib.sha256(b"u" * 300_000).hexdigest()
    assert bad["status"] == 404 and len(bad["model"]) < 1100 and len(bad["error"]) < 1100
    assert len(orjson.dumps(ok)) < 3000 and len(orjson.dumps(bad)) < 4000


async def test_an_engines_numeric_error_code_reaches_the_client_as_a_string(fleet):
    """vLLM and SGLang write an error's ``code`` as the status, a number; OpenAI's error object has
    ``code`` a string or null, so a client that decodes it by that type (the openai SDK's
    ``ErrorObject``, a typed client in another language) reads it: ``"400"``, on every OpenAI path."""
    gw, _ = fleet
    client = openai_client(gw)
    fault = {"x-sim-fault": "status=400"}
    calls = {
        "vllm chat": lambda: client.chat.completions.create(model="llama", messages=CHAT, extra_headers=fault),
        "sglang chat": lambda: client.chat.completions.create(model="qwen", messages=CHAT, extra_headers=fault),
        "sglang stream": lambda: client.chat.completions.create(model="qwen", messages=CHAT, stream=True,
                                                                extra_headers=fault),
        "completions": lambda: client.completions.create(model="llama", prompt="switchyards", extra_headers=fault),
        "embeddings": lambda: client.embeddings.create(model="llama", input="switchyards", dimensions=0),
        "responses": lambda: client.responses.create(model="llama", input="switchyards", extra_headers=fault),
        "pass-through": lambda: client.post(gw.url + "/tokenize", body={"model": "llama"}, cast_to=object),
    }
    for what, call in calls.items():
        with pytest.raises(openai.BadRequestError) as ei:
            await call()
        assert ei.value.code == "400", what       # the SDK writes any code as a string
        sent = ei.value.response.json()["error"]  # what the gateway wrote, as OpenAI's type reads it
        assert sent["code"] == "400" and openai.types.ErrorObject.model_validate(sent).code == "400", (what, sent)
    await client.close()


async def test_an_engines_error_param_of_another_type_than_a_string_reaches_the_client_as_its_json_text(gateway):
    """OpenAI's error object has ``param`` a string or null; an engine that writes another type there
    (a validation error's location as a list, a number) has it relayed as its JSON text, before the
    head and inside a begun stream alike, so a client that decodes the error by its type reads it."""
    async def refusing(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        param = orjson.loads(body["messages"][0]["content"])     # the test names the engine's param
        err = {"message": "bad field", "type": "BadRequestError", "param": param, "code": 400}
        if not body.get("stream"):
            return web.json_response({"error": err}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
                         b'"choices":[{"index":0,"delta":{"role":"assistant","content":"hi"}}]}\n\n')
        await resp.write(b"data: " + orjson.dumps({"error": err}) + b"\n\ndata: [DONE]\n\n")
        return resp

    async with fake_engine(refusing) as url:
        gw = await gateway([model_block("m", "vllm", [url])], scrape={"enabled": False})
        client = openai_client(gw)
        for param, said in ((["body", "messages", 0], '["body","messages",0]'), (3, "3"), ({"a": 1}, '{"a":1}'),
                            (True, "true"), ("messages", "messages"), (None, None)):
            messages = [{"role": "user", "content": orjson.dumps(param).decode()}]
            with pytest.raises(openai.BadRequestError) as ei:
                await client.chat.completions.create(model="m", messages=messages)
            sent = ei.value.response.json()["error"]
            assert sent["param"] == said and sent["code"] == "400", (param, sent)
            assert openai.types.ErrorObject.model_validate(sent).param == said
            stream = await client.chat.completions.create(model="m", messages=messages, stream=True)
            with pytest.raises(openai.APIError) as ei:
                async for _ in stream:
                    pass
            sent = ei.value.body
            assert isinstance(sent, dict) and sent["param"] == said and sent["code"] == "400", (param, sent)
            assert openai.types.ErrorObject.model_validate(sent).param == said
        await client.close()


async def test_an_engines_numeric_error_code_in_a_begun_stream_reaches_the_client_as_a_string(fleet):
    """An engine's error event inside a stream already begun (vLLM's and SGLang's ``code: 400``)
    has its code a string as well, as an error answered before the head has it: the openai SDK's
    error carries the event's error as its body, which OpenAI's ``ErrorObject`` reads only so."""
    gw, _ = fleet
    client = openai_client(gw)
    fault = {"x-sim-fault": "error_after=2;error_code=400"}
    calls = {
        "vllm chat": lambda: client.chat.completions.create(model="llama", messages=CHAT, stream=True,
                                                            max_tokens=8, extra_headers=fault),
        "sglang chat": lambda: client.chat.completions.create(model="qwen", messages=CHAT, stream=True,
                                                              max_tokens=8, extra_headers=fault),
        "completions": lambda: client.completions.create(model="llama", prompt="switchyards", stream=True,
                                                         max_tokens=8, extra_headers=fault),
    }
    for what, call in calls.items():
        stream = await call()
        with pytest.raises(openai.APIError) as ei:
            async for _ in stream:
                pass
        assert ei.value.code == "400", what
        sent = ei.value.body
        assert isinstance(sent, dict) and sent["code"] == "400", (what, sent)
        assert openai.types.ErrorObject.model_validate(sent).code == "400", (what, sent)
    await client.close()
