"""Large answers (a completion's prompt logprobs, a chat's logprobs of many tokens): relayed byte
for byte, with their usage counted and their finish reasons read as for any answer, and one that is
no JSON object still the engine's protocol fault; a streamed event far past the scan bound too."""

from __future__ import annotations

import asyncio
import contextlib

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


def _event_of(content: bytes, finish: str | None) -> bytes:
    return (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
            b'"delta":{"content":"' + content + b'"},"finish_reason":' + (b'"%s"' % finish.encode() if finish else b"null")
            + b"}]}\n\n")


async def test_a_streamed_event_far_past_the_scan_bound_reaches_the_client_whole(gateway):
    """An engine's 20 MiB event (past the 8 MiB scan bound, in 64 KiB chunks as an engine writes a
    long line), between ordinary ones, in LF and in bare-CR lines: the client gets every byte, the
    log line its first token, its finish and its usage, and the engine's connection is reused."""
    big = _event_of(b"y" * (20 << 20), "stop")
    usage = b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[],' \
            b'"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'
    stream = _event_of(b"hi", None) + big + usage + b"data: [DONE]\n\n"
    conns = set()       # the connections that carried a request for an answer

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"POST"):         # the monitor's scrape
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    continue
                conns.add(writer)
                length = next(int(v) for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n"))
                              if k.lower() == b"content-length")
                body = orjson.loads(await reader.readexactly(length))
                data = stream.replace(b"\n", b"\r") if body["user"] == "cr" else stream
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
                for i in range(0, len(data), 1 << 16):
                    part = data[i:i + (1 << 16)]
                    writer.write(b"%x\r\n%b\r\n" % (len(part), part))
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        gw = await gateway([model_block("m", "vllm", [url])], health={"enabled": False})
        with gw.gw.request_log.capture() as logs:
            for framing in ("lf", "cr"):
                chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "user": framing,
                        "stream_options": {"include_usage": True}}
                r = await post(gw.url, chat)
                want = stream.replace(b"\n", b"\r") if framing == "cr" else stream
                assert r.status == 200 and r.body == want, framing
        lines = [e for e in logs if e["event"] == "request"]
        assert [(e["status"], e["finish_reason"], e["prompt_tokens"], e["completion_tokens"], e["error_class"])
                for e in lines] == [(200, "stop", 3, 2, None)] * 2
        assert all(e["ttft_ms"] is not None for e in lines)
        assert len(conns) == 1 and gw.gw.upstream.open_connections == 1
    finally:
        server.close()
