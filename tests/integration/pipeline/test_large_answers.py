"""Large whole answers (a completion's prompt logprobs, a chat's logprobs of many tokens): relayed
byte for byte, with their usage counted and their finish reasons read as for any answer, and one
that is no JSON object still the engine's protocol fault."""

from __future__ import annotations

import openai
import orjson
import pytest
from aiohttp import web

from gateway.pipeline.relay import VIEW_ABOVE
from tests.support.factories import model_block
from tests.support.fake_engine import fake_engine
from tests.support.http import openai_client, post
from tests.support.metrics import metric

TOKENS = 6000       # about 2 MiB of logprobs: larger than any one read of the engine's connection


def _logprobs(n: int) -> dict:
    tokens = [f" w{i % 97}" for i in range(n)]
    return {"tokens": tokens, "token_logprobs": [-1.5 - i % 7 for i in range(n)],
            "top_logprobs": [{f" t{j}\u00e9": -0.25 * j for j in range(10)} for _ in range(n)],
            "text_offset": list(range(n))}


def _completion(data: dict) -> bytes:
    """A vLLM completion answer: ``n`` choices, each with its logprobs, the usage last."""
    n = data.get("n", 1)
    choices = [{"index": i, "text": "x" * TOKENS, "logprobs": _logprobs(TOKENS),
                "finish_reason": "length" if i else "stop", "stop_reason": None} for i in reversed(range(n))]
    return orjson.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                         "choices": choices,
                         "usage": {"prompt_tokens": TOKENS, "completion_tokens": 2 * n, "total_tokens": TOKENS + 2 * n,
                                   "prompt_tokens_details": {"cached_tokens": 16}}})


def _chat(data: dict) -> bytes:
    """A chat answer whose usage comes before its prompt logprobs (vLLM's order)."""
    return orjson.dumps({"id": "chat-1", "object": "chat.completion", "created": 1, "model": "m",
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "\u00e9t\u00e9 " * 10},
                                      "logprobs": {"content": [{"token": "usage", "logprob": -1.0, "top_logprobs": []}]},
                                      "finish_reason": "tool_calls"}],
                         "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14},
                         "prompt_logprobs": [None, *({"7": {"logprob": -2.0, "rank": 1, "decoded_token": "usage"}}
                                                     for _ in range(TOKENS * 4))]})


BROKEN = {
    "cut": lambda: _completion({})[:-40],                          # cut short, yet framed as whole
    "array": lambda: b"[" + _completion({}) + b"]",                # JSON, but no object
    "bad utf-8": lambda: _completion({}).replace(b"\xc3\xa9", b"\xc3\x28", 1),   # no JSON text
}


def _beyond_a_double(size: str) -> bytes:
    """A chat answer with a number beyond a double's range in its logprobs (a member the relay does
    not read), ``small`` or ``large`` (read through ``answer_view``'s partial decode)."""
    filler = [{"token": "x", "logprob": -0.5, "top_logprobs": []}] * (8 if size == "small" else TOKENS)
    raw = orjson.dumps({"id": "chat-1", "object": "chat.completion", "created": 1, "model": "m",
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                     "logprobs": {"content": [*filler, {"token": "y", "logprob": -7.0}]},
                                     "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})
    return raw.replace(b"-7.0", b"-1e999")


async def _engine(request: web.Request) -> web.Response:
    data = await request.json()
    broken = request.headers.get("x-broken")
    if request.headers.get("x-beyond") is not None:
        raw = _beyond_a_double(request.headers["x-beyond"])
    elif broken is not None:
        raw = BROKEN[broken]()
    else:
        raw = _chat(data) if request.path.endswith("/chat/completions") else _completion(data)
    return web.Response(body=raw, headers={"Content-Type": "application/json"})


async def test_large_whole_answers_are_relayed_exactly_with_their_usage_and_finish_reasons(gateway):
    async with fake_engine(_engine, ("/v1/chat/completions", "/v1/completions")) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        with gw.gw.request_log.capture() as logs:
            one = {"model": "m", "prompt": "hi", "max_tokens": 2, "echo": True, "logprobs": 10}
            r = await post(gw.url, one, path="/v1/completions")
            assert r.status == 200 and r.body == _completion(one)
            two = {**one, "n": 2}
            r = await post(gw.url, two, path="/v1/completions")
            assert r.status == 200 and r.body == _completion(two)
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1}
            r = await post(gw.url, chat)
            assert r.status == 200 and r.body == _chat(chat)
        lines = [e for e in logs if e["event"] == "request"]
        assert [(e["status"], e["prompt_tokens"], e["completion_tokens"], e["cached_tokens"], e["finish_reason"])
                for e in lines] == [(200, TOKENS, 2, 16, "stop"), (200, TOKENS, 4, 16, "stop"), (200, 11, 3, 0, "tool_calls")]
        assert lines[1]["finish_reasons"] == ["stop", "length"]
        text = await gw.metrics_text()
        assert metric(text, "switchyard_prompt_tokens_total", model="m") == 2 * TOKENS + 11
        assert metric(text, "switchyard_completion_tokens_total", model="m") == 9


async def test_a_large_whole_answer_that_is_no_json_object_is_a_502(gateway):
    async with fake_engine(_engine, ("/v1/completions",)) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        client = openai_client(gw)
        for broken in BROKEN:
            with pytest.raises(openai.InternalServerError) as ei:
                await client.completions.create(model="m", prompt="hi", max_tokens=2, extra_headers={"x-broken": broken})
            assert ei.value.status_code == 502 and ei.value.body["code"] == "upstream_bad_response", broken
        text = await gw.metrics_text()
        assert metric(text, "switchyard_upstream_errors_total", error_class="protocol") == len(BROKEN)


async def test_a_number_beyond_a_doubles_range_in_a_member_not_read_is_relayed_at_any_size(gateway):
    """RFC 8259 sets no bound on a number; the gateway reads the members it needs of an answer
    (usage, finish reasons, the message), and one it does not read (logprobs) is relayed as the
    engine wrote it, in a small answer as in one read through the partial decode."""
    assert len(_beyond_a_double("small")) < VIEW_ABOVE < len(_beyond_a_double("large"))
    async with fake_engine(_engine, ("/v1/chat/completions",)) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
        with gw.gw.request_log.capture() as logs:
            for size in ("small", "large"):
                r = await post(gw.url, chat, headers={"x-beyond": size})
                assert r.status == 200 and r.body == _beyond_a_double(size), size
        assert [(e["status"], e["prompt_tokens"], e["completion_tokens"], e["finish_reason"])
                for e in logs if e["event"] == "request"] == [(200, 5, 2, "stop")] * 2
