"""Values the engines accept are served end to end; generated bodies never get a 5xx.

The gateway reads ints and bools as vLLM's and SGLang's pydantic request models do (lax mode:
``"max_tokens": 5.0``, ``"n": "1"``, ``"stream": "true"``), and so does enginesim; these requests
go through a real gateway to simulated engines of both kinds and are served.
(tests/unit/gateway/test_request_values.py has the field-by-field table and the engine sources.)

Then generated requests, every API's body with one field the parser reads replaced by arbitrary
JSON (tests/support/request_fuzz.py; seeded, so every run sends the same ones), are sent to the gateway:
none is answered with a 5xx, and every refusal is a 4xx in the API's error shape.
"""

from __future__ import annotations

import os
import random

import orjson
import pytest

from tests.support.factories import model_block
from tests.support.http import openai_client, post, sse_events
from tests.support.request_fuzz import CASES, random_json, with_value

CHAT = [{"role": "user", "content": "Tell me about switchyards and trains."}]
PER_CASE = int(os.environ.get("REQUEST_FUZZ_E2E", "8"))     # per case: 12 cases, 96 requests


@pytest.fixture
async def fleet(sims, gateway):
    v = await sims("vllm", "m")
    s = await sims("sglang", "qwen")
    return await gateway([model_block("m", "vllm", [v.url]), model_block("qwen", "sglang", [s.url])])


async def send(gw, path: str, body) -> tuple[int, bytes, str]:
    """``body`` as JSON bytes (orjson: the whole floats stay floats), and what came back."""
    r = await post(gw, orjson.dumps(body), path=path)
    return r.status, r.body, r.headers.get("Content-Type", "")


@pytest.mark.parametrize("model", ["m", "qwen"])
async def test_whole_floats_and_numeric_strings_are_served(fleet, model):
    client = openai_client(fleet)
    r = await client.chat.completions.create(model=model, messages=CHAT, max_tokens=5.0, n=1.0)   # type: ignore[arg-type]
    assert r.usage.completion_tokens == 5
    await client.close()

    status, raw, _ = await send(fleet, "/v1/completions", {"model": model, "prompt": "Once upon a time",
                                                           "max_tokens": "5", "n": 1.0})
    assert status == 200, raw
    assert orjson.loads(raw)["usage"]["completion_tokens"] == 5

    status, raw, _ = await send(fleet, "/v1/completions", {"model": model, "prompt": [1.0, 2.0, 3.0], "max_tokens": 3})
    assert status == 200, raw
    assert orjson.loads(raw)["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize("model", ["m", "qwen"])
async def test_booleans_written_as_strings_and_numbers(fleet, model):
    status, raw, ctype = await send(fleet, "/v1/chat/completions", {"model": model, "messages": CHAT,
                                                                    "max_tokens": 4, "stream": "true"})
    assert status == 200 and ctype.startswith("text/event-stream"), raw
    events = sse_events(raw)
    assert len(events) > 1 and events[-1] == "[DONE]"

    status, raw, _ = await send(fleet, "/v1/chat/completions", {
        "model": model, "messages": CHAT, "max_tokens": 4, "stream": 1, "stream_options": {"include_usage": "yes"}})
    assert status == 200
    usage = [e["usage"] for e in sse_events(raw)[:-1] if e.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 4

    # "false" passes vLLM's stream_options check as sent, and is false: a plain answer
    status, raw, ctype = await send(fleet, "/v1/chat/completions", {
        "model": model, "messages": CHAT, "max_tokens": 4, "stream": "false", "stream_options": {"include_usage": True}})
    assert status == 200 and ctype.startswith("application/json"), raw
    assert orjson.loads(raw)["usage"]["completion_tokens"] == 4


async def test_messages_and_responses_take_whole_floats(fleet):
    status, raw, _ = await send(fleet, "/v1/messages", {"model": "m", "max_tokens": 5.0, "messages": CHAT})
    assert status == 200, raw
    assert orjson.loads(raw)["usage"]["output_tokens"] == 5

    status, raw, _ = await send(fleet, "/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 5.0,
                                                        "store": "false"})
    assert status == 200, raw
    assert orjson.loads(raw)["usage"]["output_tokens"] == 5


async def test_generated_bodies_get_no_5xx(fleet):
    rng = random.Random(int(os.environ.get("REQUEST_FUZZ_SEED", "22")))
    sent = 0
    for case in CASES:
        for _ in range(PER_CASE):
            field = rng.choice(case.fields)
            body = with_value(case.body, field, random_json(rng))
            status, raw, _ = await send(fleet, case.path, body)
            sent += 1
            # the simulator's 501 for what it does not model (n > 1 on a P/D role, SGLang's batch of prompts) is an
            # engine's answer relayed, not a failure
            assert status < 500 or (status == 501 and b"enginesim" in raw), (case.path, field, body, status, raw[:300])
            if status >= 400:
                err = orjson.loads(raw)
                if case.api == "anthropic":
                    assert err["type"] == "error" and err["error"]["message"], raw
                else:
                    assert set(err["error"]) >= {"message", "type", "param", "code"}, raw
    assert sent == len(CASES) * PER_CASE


async def test_fields_an_api_does_not_have_reach_the_engine(fleet):
    """Embeddings have no stream, count_tokens no stream: the engines ignore the field, and the
    answer is the plain one."""
    status, raw, ctype = await send(fleet, "/v1/embeddings", {"model": "m", "input": "hi", "stream": True})
    assert status == 200 and ctype.startswith("application/json"), raw
    assert orjson.loads(raw)["data"]
    status, raw, _ = await send(fleet, "/v1/messages/count_tokens", {"model": "m", "messages": CHAT, "stream": True})
    assert status == 200 and orjson.loads(raw)["input_tokens"] > 0, raw


# bodies orjson refuses, and what the refusal says is wrong with them: some are valid JSON by RFC 8259's
# grammar (a number past a double's range, a lone surrogate escape, nesting past a parser's depth),
# which only "not valid JSON" would leave a client unable to see
NOT_PARSED = [
    (b'{"model":"m","temperature":NaN}', "unexpected character", "line 1, column 28"),
    (b'{"model":"m","max_tokens":1' + b"0" * 400 + b"}", "number is infinity", "line 1, column 27"),
    (b'{"model":"m","x":' + b"[" * 2000 + b"]" * 2000 + b"}", "depth limit exceeded", "column 1042"),
    (b'{"model":"m","user":"a\\ud800b"}', "no low surrogate", "line 1, column 23"),
    (b'{"model":"m",\n "user":"a\xffb"}', "not UTF-8 text", "at byte 24"),
    (b"\xef\xbb\xbf{}", "byte order mark", "line 1, column 1"),
    (b"", "empty", "line 1, column 1"),
    (b'{"model":"m"} x', "unexpected content after document", "line 1, column 15"),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank",
                                  "/v1/responses", "/v1/messages"])
async def test_a_body_that_does_not_parse_is_refused_saying_why_and_where(fleet, path):
    for raw, why, where in NOT_PARSED:
        r = await post(fleet, raw, path=path)
        assert r.status == 400, (raw[:40], r.body)
        err = r.json()
        message = err["error"]["message"]
        if path == "/v1/messages":
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        else:
            assert err["error"]["type"] == "invalid_request_error" and err["error"]["param"] is None, err
        assert "not valid JSON" in message and why in message and where in message, (raw[:40], message)
