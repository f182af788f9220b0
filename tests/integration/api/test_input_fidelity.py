"""What the gateway refuses of a client's input before routing, whichever path the request takes.

A client's integer past 64 bits, a Messages ``temperature`` or tool the Messages API does not take,
a Responses ``temperature`` or function tool the Responses API does not take, an audio form that
names its ``model`` twice: each is a 400 in its API's shape, naming the field, sent by a real client
on real sockets, and no engine sees the request. The same input gets the same answer whether or not
the gateway re-encodes the body (a stream the gateway asks usage for, an alias).
"""

from __future__ import annotations

import json

import aiohttp
import anthropic
import openai
import orjson
import pytest
from aiohttp import web

from tests.support.batch import run_to_end
from tests.support.factories import model_block, pd_model, pd_pair
from tests.support.fake_engine import fake_engine
from tests.support.http import anthropic_client, openai_client, post, sim_state

MSGS = [{"role": "user", "content": "Tell me about switchyards and trains."}]
BIG = 123456789012345678901234567890          # past 64 bits: orjson reads it as a float


@pytest.fixture
async def fleet(sims, gateway):
    v = await sims("vllm", "m")
    s = await sims("sglang", "qwen")
    gw = await gateway([model_block("m", "vllm", [v.url]), model_block("qwen", "sglang", [s.url])],
                       aliases=[{"name": "chat", "targets": [{"model": "m"}]}])
    return gw, v, s


async def posts_seen(*sims) -> list[dict]:
    return [r for sim in sims for r in (await sim_state(sim.url))["received"] if r["method"] == "POST"]


def raw_body(fields: str, model: str = "m", stream: str = "") -> bytes:
    """A chat body with ``fields`` written as the client wrote them (digits kept: no JSON encoder)."""
    return (f'{{"model": "{model}", "messages": {orjson.dumps(MSGS).decode()}, "max_tokens": 2'
            f'{stream}, {fields}}}').encode()


# the body as sent, on the fast path (its bytes forwarded), a stream the gateway asks usage for (re-encoded)
# and an alias's (re-encoded with the target's name)
PATHS = [("m", ""), ("m", ', "stream": true'), ("chat", ""), ("qwen", ', "stream": true')]


@pytest.mark.parametrize("model,stream", PATHS)
@pytest.mark.parametrize("seed", [str(BIG), str(-BIG), str(1 << 64), str(1 << 63), str(-(1 << 63) - 1)])
async def test_a_seed_past_64_bits_is_refused_on_every_path(fleet, model, stream, seed):
    gw, v, s = fleet
    r = await post(gw, raw_body(f'"seed": {seed}', model, stream))
    assert r.status == 400, r.body
    err = r.json()["error"]
    assert err["param"] == "seed" and err["code"] == "integer_out_of_range", err
    assert err["type"] == "invalid_request_error" and "64-bit" in err["message"], err
    assert await posts_seen(v, s) == []


@pytest.mark.parametrize("model,stream", PATHS)
async def test_a_seed_within_64_bits_is_served_on_every_path(fleet, model, stream):
    gw, v, s = fleet
    for seed in ((1 << 63) - 1, -(1 << 63), 0):
        r = await post(gw, raw_body(f'"seed": {seed}', model, stream))
        assert r.status == 200, r.body
    assert len(await posts_seen(v, s)) == 3


async def test_the_openai_sdk_sees_a_seed_past_64_bits_refused(fleet):
    gw, v, s = fleet
    client = openai_client(gw)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as ei:
            await client.chat.completions.create(model="m", messages=MSGS, max_tokens=2, seed=BIG, stream=stream)
        assert ei.value.param == "seed" and ei.value.code == "integer_out_of_range"
        with pytest.raises(openai.BadRequestError) as ei:
            await client.completions.create(model="m", prompt="Once", max_tokens=2, seed=1 << 64, stream=stream)
        assert ei.value.param == "seed" and ei.value.code == "integer_out_of_range"
    assert await posts_seen(v, s) == []


@pytest.mark.parametrize("model,stream", PATHS)
async def test_a_count_past_64_bits_says_so_on_every_path(fleet, model, stream):
    gw, v, s = fleet
    for key in ("max_tokens", "n", "max_completion_tokens"):
        body = raw_body(f'"{key}": {BIG}', model, stream).replace(b'"max_tokens": 2, ', b"")
        r = await post(gw, body)
        assert r.status == 400, r.body
        err = r.json()["error"]
        assert err["param"] == key and err["code"] == "integer_out_of_range", err
    assert await posts_seen(v, s) == []


# -- Messages ----------------------------------------------------------------------------------

MESSAGES_REFUSED = [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": [0.5]}, "temperature"),
    ({"tools": {"name": "x"}}, "tools"),
    ({"tools": ["x"]}, "tools.0"),
    ({"tools": [{"name": "get_weather"}]}, "tools.0.input_schema"),
    ({"tools": [{"name": "get_weather", "input_schema": "object"}]}, "tools.0.input_schema"),
    ({"tools": [{"name": "get_weather", "input_schema": None}]}, "tools.0.input_schema"),
    ({"tools": [{"input_schema": {"type": "object"}}]}, "tools.0.name"),
    ({"tools": [{"name": 5, "input_schema": {"type": "object"}}]}, "tools.0.name"),
    ({"tools": [{"type": "custom", "name": "a", "input_schema": {"type": "object"}},
                {"type": "custom", "name": "b"}]}, "tools.1.input_schema"),
    ({"tools": [{"type": 7, "name": "a", "input_schema": {}}]}, "tools.0.type"),
]


@pytest.mark.parametrize("path,fields,where", [
    (path, fields, where) for path in ("/v1/messages", "/v1/messages/count_tokens") for fields, where in MESSAGES_REFUSED
    if not (path.endswith("count_tokens") and "temperature" in fields)])     # count_tokens takes no temperature
async def test_a_messages_temperature_or_tool_the_api_does_not_take_is_refused(fleet, path, fields, where):
    gw, v, s = fleet
    body = {"model": "m", "max_tokens": 4, "messages": MSGS, **fields}
    r = await post(gw, orjson.dumps(body), {"anthropic-version": "2023-06-01"}, path=path)
    assert r.status == 400, r.body
    got = r.json()
    assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error", got
    assert got["error"]["message"].startswith(where + ":"), got
    assert await posts_seen(v, s) == []


async def test_the_anthropic_sdk_still_sends_tools_and_temperatures_the_api_takes(fleet):
    gw, v, _ = fleet
    c = anthropic_client(gw)
    tools = [{"name": "get_weather", "description": "The weather", "input_schema": {"type": "object"}},
             {"type": "custom", "name": "t2", "input_schema": {"type": "object", "properties": {}}}]
    for t in (0, 0.0, 0.7, 1, 1.0, 1.01, 1.5):
        # the SDK has no temperature argument of its own (any longer): sent as the engines take it;
        # above Anthropic's 1.0, the engine samples at it as chat's engine does
        msg = await c.messages.create(model="m", max_tokens=2, messages=MSGS, tools=tools, extra_body={"temperature": t})
        assert msg.usage.output_tokens == 2
    # a server tool has no input_schema: it is the engine's to take or refuse
    body = {"model": "m", "max_tokens": 2, "messages": MSGS,
            "tools": [{"type": "web_search_20250305", "name": "web_search"}], "temperature": None}
    r = await post(gw, orjson.dumps(body), {"anthropic-version": "2023-06-01"}, path="/v1/messages")
    assert r.status == 200, r.body
    with pytest.raises(anthropic.BadRequestError) as ei:
        await c.messages.create(model="m", max_tokens=2, messages=MSGS, extra_body={"temperature": -0.01})
    assert ei.value.status_code == 400 and "temperature" in ei.value.message


# -- Responses ---------------------------------------------------------------------------------

RESPONSES_REFUSED = [
    ({"temperature": -1}, "temperature"),
    ({"temperature": "warm"}, "temperature"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [5]}, "tools[0]"),
    ({"tools": [{"name": "f"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": ""}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": ["f"]}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "object"}]}, "tools[0].parameters"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "function", "parameters": {}}]}, "tools[1].name"),
]


@pytest.mark.parametrize("fields,param", RESPONSES_REFUSED)
async def test_a_responses_temperature_or_function_tool_the_api_does_not_take_is_refused(fleet, fields, param):
    gw, v, s = fleet
    body = {"model": "m", "input": "Hi", "max_output_tokens": 4, **fields}
    r = await post(gw, orjson.dumps(body), path="/v1/responses")
    assert r.status == 400, r.body
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert await posts_seen(v, s) == []


async def test_the_openai_sdk_still_sends_responses_tools_and_temperatures_the_api_takes(fleet):
    gw, _, _ = fleet
    client = openai_client(gw)
    tools = [{"type": "function", "name": "get_weather"},
             {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": False},
             {"type": "function", "name": "g", "parameters": None}]
    for t in (0, 1.0, 2, 2.0, 2.01):    # above OpenAI's 2, the engine samples at it as chat's engine does
        r = await client.responses.create(model="m", input="Hi", max_output_tokens=4, temperature=t, tools=tools)
        assert r.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as ei:
        await client.responses.create(model="m", input="Hi", max_output_tokens=4, temperature=-0.01)
    assert ei.value.param == "temperature"


# -- audio -------------------------------------------------------------------------------------

def form(*fields: tuple[str, bytes], boundary: str = "fIdElItY") -> tuple[bytes, dict[str, str]]:
    parts = []
    for name, value in fields:
        disp = f'form-data; name="{name}"' + ('; filename="a.wav"' if name == "file" else "")
        parts.append(f"--{boundary}\r\nContent-Disposition: {disp}\r\n\r\n".encode() + value + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


AUDIO = bytes(range(256)) * 40


@pytest.mark.parametrize("fields", [
    [("model", b"m"), ("file", AUDIO), ("model", b"qwen")],
    [("model", b"m"), ("model", b"m"), ("file", AUDIO)],
    [("file", AUDIO), ("model", b"chat"), ("model", b"m")],
    [("model", b"m"), ("stream", b"false"), ("file", AUDIO), ("stream", b"true")],
])
async def test_an_audio_form_that_names_a_field_twice_is_refused(fleet, fields):
    gw, v, s = fleet
    body, headers = form(*fields)
    twice = "model" if [n for n, _ in fields].count("model") == 2 else "stream"
    for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
        r = await post(gw, body, headers, path=path)
        assert r.status == 400, r.body
        err = r.json()["error"]
        assert err["param"] == twice and err["type"] == "invalid_request_error", err
        assert "more than once" in err["message"], err
    assert await posts_seen(v, s) == []
    # one of each is served
    body, headers = form(("model", b"m"), ("file", AUDIO), ("language", b"en"))
    r = await post(gw, body, headers, path="/v1/audio/transcriptions")
    assert r.status == 200, r.body


# -- integers past 64 bits the gateway does not read -------------------------------------------

def recording_relay(url: str, sent: list[bytes]):
    """A fake engine's handler that keeps the bytes it is sent and answers with what the real
    engine at ``url`` answers to them."""

    async def relay(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        sent.append(raw)
        async with aiohttp.ClientSession() as s, s.post(url + request.path, data=raw,
                                                        headers={"Content-Type": "application/json"}) as r:
            resp = web.StreamResponse(status=r.status, headers={"Content-Type": r.headers["Content-Type"]})
            await resp.prepare(request)
            async for chunk in r.content.iter_any():
                await resp.write(chunk)
        await resp.write_eof()
        return resp

    return relay


# an engine field the gateway passes on (vLLM's vllm_xargs, for custom logits processors): integer
# literals past 64 bits, one inside it, a float literal that is the double nearest one of them
XARGS = (f'{{"big": {BIG}, "neg": {-BIG}, "u64": {(1 << 64) - 1}, "past": {1 << 64}, '
         f'"double": 1.2345678901234568e+29, "list": [{BIG}, 1.5, 1e30, {BIG + 1}]}}')


@pytest.mark.parametrize("model,stream", [("m", ""), ("m", ', "stream": true'), ("chat", ""),
                                          ("chat", ', "stream": true'), ("cont", ', "stream": true'),
                                          ("m", ', "stream": true, "stream_options": {"include_usage": true}')])
async def test_integers_past_64_bits_reach_the_engine_as_the_client_wrote_them(sims, gateway, model, stream):
    """Whether the body goes out as it came (a whole answer, a stream with usage) or re-encoded (a
    stream the gateway asks usage for, an alias's target, a continuable stream's first leg), the
    engine reads the numbers the client wrote."""
    sim, other = await sims("vllm", "m"), await sims("vllm", "cont")
    sent: list[bytes] = []
    async with fake_engine(recording_relay(sim.url, sent)) as url, \
            fake_engine(recording_relay(other.url, sent)) as cont:
        gw = await gateway([model_block("m", "vllm", [url]),
                            model_block("cont", "vllm", [cont], migration_limit=1)],
                           aliases=[{"name": "chat", "targets": [{"model": "m"}]}])
        body = raw_body(f'"vllm_xargs": {XARGS}', model, stream)
        r = await post(gw, body)
        assert r.status == 200, r.body
    assert len(sent) == 1
    # read as Python's json reads them: integers exact, floats as doubles
    assert json.loads(sent[0])["vllm_xargs"] == json.loads(XARGS)
    assert all(type(a) is type(b) for a, b in zip(json.loads(sent[0])["vllm_xargs"]["list"],
                                                  json.loads(XARGS)["list"], strict=True))
    assert type(json.loads(sent[0])["vllm_xargs"]["double"]) is float


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_integers_past_64_bits_reach_both_pd_legs_as_the_client_wrote_them(sims, gateway, engine):
    p, d = await pd_pair(sims, engine)
    sent: list[bytes] = []
    async with fake_engine(recording_relay(p.url, sent)) as purl, fake_engine(recording_relay(d.url, sent)) as durl:
        prefill = {"url": purl, "bootstrap_port": p.bootstrap_port} if engine == "sglang" else purl
        gw = await gateway([pd_model(engine, [{"name": "rs-1", "prefill": [prefill], "decode": [durl]}])])
        for stream in ("", ', "stream": true'):
            sent.clear()
            r = await post(gw, raw_body(f'"vllm_xargs": {XARGS}', "m", stream))
            assert r.status == 200, r.body
            assert len(sent) == 2
            for raw in sent:
                assert json.loads(raw)["vllm_xargs"] == json.loads(XARGS)


@pytest.mark.parametrize("depth", [300, 1000])
async def test_a_deeply_nested_field_gets_the_same_answer_on_every_path(sims, gateway, depth):
    """The parser reads 1024 levels of nesting, orjson writes 254: a body nested deeper than that
    is re-encoded all the same, so an alias or a stream the gateway asks usage for does not turn the
    answer the body forwarded as it came gets into a 500."""
    sim = await sims("vllm", "m")
    sent: list[bytes] = []
    deep = "[" * depth + f"{BIG}" + "]" * depth
    async with fake_engine(recording_relay(sim.url, sent)) as url:
        gw = await gateway([model_block("m", "vllm", [url])], aliases=[{"name": "chat", "targets": [{"model": "m"}]}])
        for model, stream in PATHS[:3]:
            r = await post(gw, raw_body(f'"vllm_xargs": {{"a": {deep}}}', model, stream))
            assert r.status == 200, (model, stream, r.body)
    assert len(sent) == 3
    for raw in sent:        # the whole nesting, and the digits inside it
        assert deep.encode() in raw and orjson.loads(raw)["model"] == "m"


async def test_a_batch_line_reaches_the_engine_with_its_integers_and_nesting(sims, gateway, tmp_path):
    """A batch line's body is re-encoded (its ``stream`` dropped): its integers past 64 bits and a
    nesting deeper than orjson writes reach the engine as the line holds them, as a request's do."""
    sim = await sims("vllm", "m")
    sent: list[bytes] = []
    deep = "[" * 300 + "1" + "]" * 300
    rows = [f'{{"custom_id": "c{i}", "method": "POST", "url": "/v1/chat/completions", "body": '
            f'{raw_body(xargs).decode()}}}' for i, xargs in enumerate((f'"vllm_xargs": {XARGS}',
                                                                        f'"vllm_xargs": {{"a": {deep}}}'))]
    async with fake_engine(recording_relay(sim.url, sent)) as url:
        gw = await gateway([model_block("m", "vllm", [url])], scrape={"enabled": False},      # no engine metrics
                           batch={"enabled": True, "dir": str(tmp_path / "batch"), "poll_interval_s": 0.05,
                                  "retry_backoff_s": 0.05})
        c = openai_client(gw)
        f = await c.files.create(file=("in.jsonl", "\n".join(rows).encode() + b"\n"), purpose="batch")
        b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        b = await run_to_end(c, b.id)
        assert b.status == "completed" and b.request_counts.completed == 2, b
    assert len(sent) == 2
    got = sorted(sent, key=len)
    assert json.loads(got[0])["vllm_xargs"] == json.loads(XARGS)
    assert deep.encode() in got[1]


async def test_a_batch_lines_integers_are_its_bodys_not_those_around_it(sims, gateway, tmp_path):
    """The digits a batch line's body reaches the engine with are its body's own: an integer past
    64 bits elsewhere in the line (a key of its own beside ``body``, or the ``stream_options`` the
    line's body loses), read as the same double as one of the body's, does not take that one's
    place."""
    sim = await sims("vllm", "m")
    sent: list[bytes] = []
    xargs = f'"vllm_xargs": {{"big": {BIG}}}'
    streamed = f', "stream": false, "stream_options": {{"include_usage": true, "n": {BIG + 2}}}'
    line = '"custom_id": "c{}", "method": "POST", "url": "/v1/chat/completions", "body": '
    rows = [f'{{"row": {BIG + 1}, {line.format(0)}{raw_body(xargs).decode()}}}',
            f'{{{line.format(1)}{raw_body(xargs, stream=streamed).decode()}}}']
    async with fake_engine(recording_relay(sim.url, sent)) as url:
        gw = await gateway([model_block("m", "vllm", [url])], scrape={"enabled": False},
                           batch={"enabled": True, "dir": str(tmp_path / "batch"), "poll_interval_s": 0.05,
                                  "retry_backoff_s": 0.05})
        c = openai_client(gw)
        f = await c.files.create(file=("in.jsonl", "\n".join(rows).encode() + b"\n"), purpose="batch")
        b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        b = await run_to_end(c, b.id)
        assert b.status == "completed" and b.request_counts.completed == 2, b
    assert len(sent) == 2
    for raw in sent:
        body = json.loads(raw)
        assert body["vllm_xargs"] == {"big": BIG} and "stream" not in body and "stream_options" not in body, raw
