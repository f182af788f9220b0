"""The per-API objects (gateway/apis): parsing, error shapes, the Messages stream scanner, the
multipart field search, and which engine serves which path."""

from __future__ import annotations

import asyncio
import tracemalloc

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.apis import OPENAI, api_for
from gateway.apis.anthropic import ANTHROPIC, MessagesScanner
from gateway.apis.passthrough import AUDIO, PASSTHROUGH, form_fields
from gateway.errors import GatewayError
from handlers import ADAPTERS

MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "image", "source": {}}]}]


def parse_messages(body: dict, path: str = "/v1/messages", headers: dict | None = None):
    return ANTHROPIC.parse(path, orjson.dumps(body), headers or {}, "rid")


def test_paths_select_their_api():
    assert api_for("/v1/chat/completions") is OPENAI
    assert api_for("/v1/messages") is ANTHROPIC and api_for("/v1/messages/count_tokens") is ANTHROPIC
    assert api_for("/v2/rerank") is PASSTHROUGH and api_for("/v1/audio/translations") is AUDIO


def test_engines_declare_their_surface():
    vllm, sglang = ADAPTERS["vllm"], ADAPTERS["sglang"]
    for path in ("/v1/messages", "/v1/messages/count_tokens", "/rerank", "/v2/rerank", "/score",
                 "/v1/audio/translations"):
        assert vllm.serves(path) and not sglang.serves(path)
    for path in ("/v1/chat/completions", "/v1/rerank", "/v1/score", "/tokenize", "/detokenize",
                 "/v1/audio/transcriptions"):
        assert vllm.serves(path) and sglang.serves(path)


def test_messages_parse_keys_the_prefix_on_system_then_messages():
    ireq = parse_messages({"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "SYS"}],
                           "messages": MESSAGES, "metadata": {"user_id": "u1"}, "stream": True})
    assert ireq.prompt_text == "SYS\nuser\nhello"
    assert ireq.stream and ireq.include_usage and ireq.user == "u1" and ireq.model == "m"
    assert parse_messages({"model": "m", "messages": MESSAGES}, "/v1/messages/count_tokens").prompt_tokens_est >= 1
    assert parse_messages({"model": "m", "max_tokens": 1, "messages": MESSAGES},
                          headers={"user": "h"}).user == "h"


@pytest.mark.parametrize("body,message", [
    ({"messages": MESSAGES, "max_tokens": 1}, "model: Field required"),
    ({"model": "m", "messages": MESSAGES}, "max_tokens: Field required"),
    ({"model": "m", "messages": MESSAGES, "max_tokens": 0}, "max_tokens: Input should be a positive integer"),
    ({"model": "m", "max_tokens": 1}, "messages: Field required"),
    ({"model": "m", "max_tokens": 1, "messages": []}, "messages: at least one message is required"),
    ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": 3}]},
     "messages.0.content: Input should be a valid string or a list of content blocks"),
    ({"model": "m", "max_tokens": 1, "messages": MESSAGES, "stream": "yes"}, "stream: Input should be a valid boolean"),
])
def test_messages_parse_refuses_bad_bodies(body, message):
    with pytest.raises(GatewayError) as ei:
        parse_messages(body)
    assert ei.value.status == 400 and ei.value.message == message
    assert orjson.loads(ANTHROPIC.error_body(ei.value)) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": message}}


def test_anthropic_error_shapes():
    e = GatewayError(429, "slow down")
    assert orjson.loads(ANTHROPIC.error_body(e))["error"]["type"] == "rate_limit_error"
    assert ANTHROPIC.error_event(504, "late") == (
        b'event: error\ndata: {"type":"error","error":{"type":"timeout_error","message":"late"}}\n\n')
    # vLLM's own envelope keeps its status and message; its exception-name type becomes Anthropic's
    status, body, message = ANTHROPIC.upstream_error(404, b'{"type":"error","error":{"type":"NotFoundError","message":"no"}}')
    assert (status, orjson.loads(body), message) == (404, {"type": "error", "error": {"type": "not_found_error",
                                                                                      "message": "no"}}, "no")
    _, body, _ = ANTHROPIC.upstream_error(400, b'{"error":{"message":"bad","type":"BadRequestError","code":400}}')
    assert orjson.loads(body)["error"] == {"type": "invalid_request_error", "message": "bad"}
    _, body, _ = ANTHROPIC.upstream_error(529, b'{"type":"error","error":{"type":"overloaded_error","message":"x"}}')
    assert orjson.loads(body)["error"]["type"] == "overloaded_error"


def _frame(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


STREAM = b"".join([
    _frame("message_start", {"type": "message_start", "message": {"id": "m", "usage": {
        "input_tokens": 7, "cache_read_input_tokens": 5, "output_tokens": 0}}}),
    _frame("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    _frame("ping", {"type": "ping"}),
    *[_frame("content_block_delta", {"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "text_delta", "text": f" w{i}"}}) for i in range(3)],
    _frame("content_block_stop", {"type": "content_block_stop", "index": 0}),
    _frame("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}}),
    _frame("message_stop", {"type": "message_stop"}),
])


@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=12, unique=True))
def test_messages_scanner_sees_the_same_stream_however_it_is_split(cuts):
    sc = MessagesScanner()
    out, prev = [], 0
    for t, cut in enumerate(sorted(cuts) + [len(STREAM)]):
        out.append(sc.feed(STREAM[prev:cut], float(t)))
        prev = cut
    out.append(sc.finish())
    assert b"".join(out) == STREAM          # bytes pass through unchanged
    assert sc.done and sc.error is None and sc.finish_reason == "end_turn"
    # input tokens from message_start (cache reads included), output from message_delta
    assert sc.usage == {"prompt_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 5}}
    assert sc.first_token_at is not None and len(sc.drain_itl()) == 2


def test_messages_scanner_in_stream_error_and_eventless_frames():
    sc = MessagesScanner()
    sc.feed(b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"x"}}\n\n', 1.0)
    sc.feed(b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"busy"}}', 2.0)
    assert sc.first_token_at == 1.0 and sc.error is None
    sc.finish()                              # a trailing frame without its blank line is still read
    assert sc.error == {"type": "overloaded_error", "message": "busy"} and not sc.done


def _form(boundary: str, parts: list[tuple[str, bytes, str | None]]) -> bytes:
    out = b""
    for name, value, filename in parts:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disp}\r\n\r\n".encode() + value + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


def test_form_fields_found_in_place():
    b = "XyZ"
    audio = b"--XyZ is not a delimiter here\r\n--XyZ" + b"\x00" * 1000   # the delimiter needs a CRLF before it
    body = _form(b, [("file", audio[:20], "a.wav"), ("model", b"whisper", None), ("stream", b"true", None)])
    assert form_fields(body, b.encode()) == {"model": "whisper", "stream": "true"}
    body = _form(b, [("model", b"m", "model.wav"), ("x", b"y", None)])       # a file called model is no field
    assert form_fields(body, b.encode()) == {}
    assert form_fields(b"garbage", b"XyZ") == {}


def test_audio_parse_and_refusals():
    body = _form("bnd", [("file", b"\x01\x02", "a.wav"), ("model", b"whisper-1", None)])
    ireq = AUDIO.parse("/v1/audio/transcriptions", body, {"content-type": 'multipart/form-data; boundary="bnd"'}, "r")
    assert ireq.model == "whisper-1" and ireq.body is body and ireq.content_type.endswith('"bnd"')
    with pytest.raises(GatewayError) as ei:
        AUDIO.parse("/v1/audio/transcriptions", body, {"content-type": "application/json"}, "r")
    assert ei.value.status == 415
    with pytest.raises(GatewayError) as ei:
        AUDIO.parse("/v1/audio/transcriptions", _form("bnd", [("file", b"1", "a")]),
                    {"content-type": "multipart/form-data; boundary=bnd"}, "r")
    assert ei.value.status == 400 and ei.value.param == "model"


def test_passthrough_parse_estimates_what_the_engine_encodes():
    ireq = PASSTHROUGH.parse("/v1/rerank", orjson.dumps({"model": "m", "query": "q" * 40,
                                                         "documents": ["d" * 40, {"text": "e" * 40}]}), {}, "r")
    assert ireq.prompt_tokens_est == (40 * 3 + 2) // 4 and not ireq.stream
    ireq = PASSTHROUGH.parse("/detokenize", orjson.dumps({"model": "m", "tokens": [1, 2, 3]}), {}, "r")
    assert ireq.prompt_tokens_est == 3 and ireq.prompt_text == ""
    with pytest.raises(GatewayError) as ei:
        PASSTHROUGH.parse("/tokenize", b'{"prompt":"x"}', {}, "r")
    assert ei.value.status == 400 and ei.value.param == "model"


class _Content:
    """A request body arriving in chunks, as aiohttp's StreamReader hands them out."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = list(chunks)

    async def readchunk(self) -> tuple[bytes, bool]:
        return (self.chunks.pop(0), False) if self.chunks else (b"", False)


class _Request:
    def __init__(self, chunks: list[bytes]) -> None:
        self.content = _Content(chunks)
        self.content_length = None


def test_audio_body_is_copied_once():
    size = 8 << 20
    chunks = [bytes(64 << 10) for _ in range(size // (64 << 10))]
    req = _Request(chunks)
    loop = asyncio.new_event_loop()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        body = loop.run_until_complete(AUDIO.read_body(req, 0))        # type: ignore[arg-type]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        loop.close()
    assert len(body) == size
    assert peak < size * 1.1          # one buffer of the whole body, not two (request.read() needs two)
    with pytest.raises(GatewayError) as ei:
        asyncio.run(AUDIO.read_body(_Request([b"x" * 10] * 5), 45))   # type: ignore[arg-type]
    assert ei.value.status == 413
