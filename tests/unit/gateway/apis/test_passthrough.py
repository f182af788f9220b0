"""The pass-through API objects: JSON estimates, the multipart field search, the audio body read."""

from __future__ import annotations

import asyncio
import tracemalloc

import orjson
import pytest

from gateway.apis.passthrough import AudioApi, PassthroughApi, form_fields
from gateway.endpoints import EndpointPool
from gateway.errors import GatewayError

PASSTHROUGH = PassthroughApi(EndpointPool())
AUDIO = AudioApi(EndpointPool())


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
    for path, body in (("/classify", {"input": ["a" * 40, "b" * 40]}), ("/v1/classify", {"input": "a" * 80}),
                       ("/pooling", {"input": "a" * 80}),
                       ("/v2/embed", {"texts": ["a" * 40], "inputs": [{"content": [{"type": "text", "text": "b" * 40}]}]})):
        ireq = PASSTHROUGH.parse(path, orjson.dumps({"model": "m", **body}), {}, "r")
        assert ireq.prompt_tokens_est == 80 // 4, path


def test_passthrough_reads_the_usage_each_engine_reports():
    assert PASSTHROUGH.body_usage(None, {"usage": {"total_tokens": 7}}) == {"prompt_tokens": 7}
    # Cohere's embed answer: no usage, its tokens in meta
    assert PASSTHROUGH.body_usage(None, {"meta": {"tokens": {"input_tokens": 9}}}) == {"prompt_tokens": 9}
    assert PASSTHROUGH.body_usage(None, {"meta": {"tokens": {"input_tokens": True}}}) is None
    # SGLang's rerank: a list, each item's prompt tokens in its meta_info
    items = [{"score": 0.5, "meta_info": {"prompt_tokens": 4}}, {"score": 0.1, "meta_info": {"prompt_tokens": 6}}]
    assert PASSTHROUGH.list_usage(None, items) == {"prompt_tokens": 10}
    assert PASSTHROUGH.list_usage(None, [*items, {"score": 0.0}]) is None
    assert PASSTHROUGH.list_usage(None, []) is None


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
        self.body_exists = True


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


def test_audio_alias_rewrite_replaces_only_the_model_field():
    audio = bytes(range(256)) * 4
    body = _form("bnd", [("model", b"speech", None), ("file", audio, "a.wav")])
    ireq = AUDIO.parse("/v1/audio/transcriptions", body, {"content-type": "multipart/form-data; boundary=bnd"}, "r")
    AUDIO.with_model(ireq, "whisper-large-v3")
    assert ireq.model == "whisper-large-v3" and ireq.data == {"model": "whisper-large-v3"}
    assert ireq.body == _form("bnd", [("model", b"whisper-large-v3", None), ("file", audio, "a.wav")])
