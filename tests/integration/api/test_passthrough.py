"""Pass-through endpoints (rerank, score, tokenize, detokenize, audio) routed by model: real
clients (the openai SDK for audio, aiohttp as curl would for the rest) on real sockets."""

from __future__ import annotations

import asyncio
import math
import warnings

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from enginesim.audio_api import BYTES_PER_SECOND, transcript
from gateway.pipeline.relay import VIEW_ABOVE
from tests.support.factories import model_block
from tests.support.fake_engine import fake_engine
from tests.support.gateway_process import gateway_process, post_new
from tests.support.http import openai_client, post, post_json, sim_state
from tests.support.ports import listen_port
from tests.support.waiting import wait_for

RERANK = {"query": "red apple pie", "documents": ["green pear", "a red apple pie recipe", "trains"]}
AUDIO = bytes(range(256)) * 800          # 204,800 bytes: bigger than one socket read, one write


@pytest.fixture
async def fleet(sims, gateway):
    v = await sims("vllm", "llama")
    s = await sims("sglang", "qwen")
    gw = await gateway([model_block("llama", "vllm", [v.url]), model_block("qwen", "sglang", [s.url])])
    return gw, v, s


VLLM_CALLS = [
    ("/v1/rerank", RERANK), ("/rerank", RERANK), ("/v2/rerank", {**RERANK, "top_n": 2}),
    ("/v1/score", {"text_1": "red apple", "text_2": ["apple", "pear"]}), ("/score", {"text_1": "a", "text_2": "a"}),
    ("/tokenize", {"prompt": "hello there"}), ("/detokenize", {"tokens": [1000, 1001]}),
]


@pytest.mark.parametrize("path,body", VLLM_CALLS)
async def test_every_json_path_reaches_a_vllm_engine(fleet, path, body):
    """Each path reaches the engine as that path, its body unchanged; a query string (an Azure
    client's ``api-version``) is not passed on: no engine's route for these paths reads one."""
    gw, v, _ = fleet
    status, got, headers = await post_json(gw, path + "?api-version=2024-06-01", {"model": "llama", **body})
    assert status == 200, got
    assert headers["target-pod"] == v.url.removeprefix("http://") and headers["request-id"]
    if "rerank" in path:
        assert got["results"][0]["document"]["text"] == "a red apple pie recipe"
        assert len(got["results"]) == body.get("top_n", 3) and got["usage"]["prompt_tokens"] > 0
    elif "score" in path:
        assert got["object"] == "list" and [d["object"] for d in got["data"]] == ["score"] * len(got["data"])
    elif path == "/tokenize":
        assert got["count"] == len(got["tokens"]) == 4
    else:
        assert "prompt" in got
    assert [r for r in (await sim_state(v.url))["received"] if r["method"] == "POST"][-1]["path"] == path
    assert f'switchyard_path_requests_total{{path="{path}",status="200"}} 1.0' in await gw.metrics_text()


async def test_sglang_paths_and_the_ones_it_does_not_serve(fleet):
    gw, _, s = fleet
    status, got, _ = await post_json(gw, "/v1/rerank", {"model": "qwen", **RERANK})
    assert status == 200 and got[0]["document"] == "a red apple pie recipe" and "meta_info" in got[0]
    status, got, _ = await post_json(gw, "/v1/score", {"model": "qwen", "query": "apple", "items": ["apple", "pear"],
                                                  "label_token_ids": [1, 2]})
    assert status == 200 and got["object"] == "scoring" and len(got["scores"]) == 2
    status, got, _ = await post_json(gw, "/tokenize", {"model": "qwen", "prompt": "hello there"})
    assert status == 200 and got["count"] == 4
    status, back, _ = await post_json(gw, "/detokenize", {"model": "qwen", "tokens": got["tokens"]})
    assert status == 200 and back == {"text": "hello there"}
    for path in ("/rerank", "/v2/rerank", "/score"):
        status, got, headers = await post_json(gw, path, {"model": "qwen", **RERANK})
        assert status == 404 and got["error"]["code"] == "unsupported_path"
        assert got["error"]["message"] == f"The model `qwen` is served by sglang, which does not serve POST {path}."
        assert headers["x-error-unsupported-path"] == path
    assert {r["path"] for r in (await sim_state(s.url))["received"] if r["method"] == "POST"} == {"/v1/rerank", "/v1/score", "/tokenize",
                                                                         "/detokenize"}


SGLANG_CALLS = [
    ("/v1/rerank", RERANK), ("/v1/score", {"query": "apple", "items": ["apple", "pear"], "label_token_ids": [1, 2]}),
    ("/tokenize", {"prompt": "hello there"}), ("/detokenize", {"tokens": [1000, 1001]}),
]


async def test_a_stream_field_on_a_json_path_is_ignored_as_the_engines_ignore_it(fleet):
    """No engine streams a rerank, a score or a (de)tokenization: their request models have no
    ``stream`` (vLLM's RerankRequest, ScoreRequest, TokenizeRequest, DetokenizeRequest, whose
    extra fields are ignored; SGLang's likewise), so ``"stream": true`` is answered with the plain
    JSON body, as the engine answers it without the gateway, and no engine is blamed for it."""
    gw, v, s = fleet
    calls = [("llama", p, b) for p, b in VLLM_CALLS] + [("qwen", p, b) for p, b in SGLANG_CALLS]
    for model, path, body in calls:
        status, got, headers = await post_json(gw, path, {"model": model, **body, "stream": True})
        assert status == 200 and headers["Content-Type"].startswith("application/json"), (model, path, got)
        assert "error" not in got, (model, path, got)
    assert 'error_class="protocol"' not in await gw.metrics_text()
    # each call reached its engine once: answered, not retried elsewhere
    for sim, n in ((v, len(VLLM_CALLS)), (s, len(SGLANG_CALLS))):
        sent = [r for r in (await sim_state(sim.url))["received"] if r["method"] == "POST"]
        assert len(sent) == n


async def test_errors_are_openai_shaped(fleet):
    gw, _, _ = fleet
    status, got, _ = await post_json(gw, "/v1/rerank", RERANK)
    assert status == 400 and got["error"]["param"] == "model"
    status, got, _ = await post_json(gw, "/tokenize", {"model": "nope", "prompt": "x"})
    assert status == 404 and got["error"]["code"] == "model_not_found"
    # the engine's own refusal keeps its status and message
    status, got, _ = await post_json(gw, "/v1/rerank", {"model": "llama", **RERANK, "top_n": -1})
    assert status == 400 and "top_n" in got["error"]["message"] and got["error"]["type"] == "Bad Request"


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling"])
async def test_vllm_binary_embeddings_reach_the_client_whole(fleet, path):
    """vLLM answers ``encoding_format: "bytes"`` with the vectors' bytes (application/octet-stream,
    chunked) and a ``metadata`` header giving each vector's offsets, dtype and shape and the usage,
    without which the bytes cannot be read back; ``"bytes_only"`` with the bytes alone. Both reach
    the client as the engine sent them, the metadata header included, and the header's usage is
    counted like a JSON answer's."""
    gw, v, _ = fleet
    body = {"model": "llama", "input": ["red apple", "green pear"], "encoding_format": "bytes",
            "embed_dtype": "float16"}
    direct = await post(v.url, body, path=path)
    r = await post(gw, body, path=path)
    assert r.status == 200, r.body[:300]
    assert r.headers["Content-Type"] == "application/octet-stream" and r.body == direct.body
    meta, want = orjson.loads(r.headers["metadata"]), orjson.loads(direct.headers["metadata"])
    assert meta["data"] == want["data"] and meta["usage"] == want["usage"]
    tokens = want["usage"]["prompt_tokens"]
    assert f'switchyard_prompt_tokens_total{{model="llama"}} {float(tokens)}' in await gw.metrics_text()
    r = await post(gw, {**body, "encoding_format": "bytes_only"}, path=path)
    assert r.status == 200 and r.body == direct.body and "metadata" not in r.headers


async def test_pass_through_is_limited_like_chat(sims, gateway):
    v = await sims("vllm", "llama")
    key = "sk-alice-0123456789"
    gw = await gateway([model_block("llama", "vllm", [v.url])], auth={"api_keys": [{"key": key, "user": "alice"}]},
                       limits={"users": {"alice": {"rpm": 2}}})
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
        got = []
        for _ in range(3):
            async with s.post(gw.url + "/v1/score", json={"model": "llama", "text_1": "a", "text_2": "b"}) as r:
                got.append(r.status)
        async with s.post(gw.url + "/tokenize", json={"model": "llama", "prompt": "x"},
                          headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status == 401
    assert got == [200, 200, 429]


async def test_audio_with_the_openai_sdk(fleet):
    gw, v, _ = fleet
    c = openai_client(gw)
    seconds = math.ceil(len(AUDIO) / BYTES_PER_SECOND)
    tr = await c.audio.transcriptions.create(model="llama", file=("speech.wav", AUDIO))
    # the engine hashed exactly the bytes the client sent
    assert tr.text == transcript(AUDIO, seconds)
    assert tr.usage.seconds == seconds
    text = await c.audio.transcriptions.create(model="llama", file=("speech.wav", AUDIO), response_format="text")
    assert text.strip() == tr.text
    with warnings.catch_warnings():                        # the SDK marks translations deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        tl = await c.audio.translations.create(model="llama", file=("speech.wav", AUDIO))
        assert tl.text == tr.text
        with pytest.raises(openai.NotFoundError) as ei:    # SGLang has no translation endpoint
            await c.audio.translations.create(model="qwen", file=("speech.wav", AUDIO))
    assert ei.value.body["code"] == "unsupported_path"
    with pytest.raises(openai.NotFoundError):
        await c.audio.transcriptions.create(model="nope", file=("speech.wav", AUDIO))
    await c.close()
    received = [r for r in (await sim_state(v.url))["received"] if r["path"].startswith("/v1/audio/")]
    assert len(received) == 3 and len({r["bytes"] for r in received if r["path"].endswith("translations")}) == 1
    text = await gw.metrics_text()
    assert 'switchyard_path_requests_total{path="/v1/audio/transcriptions",status="200"} 2.0' in text
    assert 'switchyard_path_requests_total{path="/v1/audio/translations",status="404"} 1.0' in text


async def test_audio_streams_whenever_the_engine_reads_its_stream_field_as_true(fleet):
    """vLLM reads a transcription's form fields with its pydantic model: ``stream`` is true for
    ``1``, ``on``, ``yes``, ``True`` as for ``true`` (an empty field is the default, false). The
    engine then streams, and so must the gateway's relay: every such form gets the event stream
    whole, through to ``[DONE]``, as the openai SDK's ``stream=True`` does."""
    gw, v, _ = fleet
    seconds = math.ceil(len(AUDIO) / BYTES_PER_SECOND)
    words = transcript(AUDIO, seconds)

    async def send(**fields: str) -> tuple[int, str, bytes]:
        form = aiohttp.FormData()
        form.add_field("model", "llama")
        for k, val in fields.items():
            form.add_field(k, val)
        form.add_field("file", AUDIO, filename="speech.wav")
        async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/audio/transcriptions", data=form) as r:
            return r.status, r.headers.get("Content-Type", ""), await r.read()

    for word in ("true", "1", "on", "yes", "True", "Y"):
        status, ctype, raw = await send(stream=word)
        assert status == 200 and ctype.startswith("text/event-stream"), (word, raw[:300])
        assert raw.endswith(b"data: [DONE]\n\n"), (word, raw[-300:])
        assert b'"transcription.chunk"' in raw and b"error" not in raw
    for word in ("", "0", "off", "false"):
        status, ctype, raw = await send(stream=word)
        assert status == 200 and ctype.startswith("application/json"), (word, raw[:300])
        assert orjson.loads(raw)["text"] == words
    status, _, raw = await send(stream="maybe")     # neither: the engine's 400, in OpenAI's shape
    assert status == 400 and orjson.loads(raw)["error"]["param"] == "stream", raw
    c = openai_client(gw)
    got = [e async for e in await c.audio.transcriptions.create(model="llama", file=("speech.wav", AUDIO),
                                                                  stream=True)]
    await c.close()
    # vLLM's chunks are chat-like, not OpenAI's transcript.text.* events: the SDK yields them with
    # their fields as it found them
    deltas = [c["delta"]["content"] for e in got for c in (e.model_extra or {}).get("choices") or ()]
    assert "".join(deltas) == words, got
    assert 'error_class="protocol"' not in await gw.metrics_text()


async def test_audio_model_found_anywhere_in_the_form(fleet):
    gw, v, _ = fleet
    form = aiohttp.FormData()          # the file first, then the fields (curl -F order is the user's)
    form.add_field("file", AUDIO, filename="a.wav", content_type="audio/wav")
    form.add_field("response_format", "json")
    form.add_field("model", "llama")
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/audio/transcriptions", data=form) as r:
        assert r.status == 200 and (await r.json())["usage"]["seconds"] == math.ceil(len(AUDIO) / BYTES_PER_SECOND)
        assert r.headers["target-pod"] == v.url.removeprefix("http://")
    form = aiohttp.FormData()
    form.add_field("file", AUDIO, filename="model", content_type="audio/wav")    # a file named "model" is no model
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/audio/transcriptions", data=form) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "model"
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/audio/transcriptions", json={"model": "llama"}) as r:
        assert r.status == 415 and (await r.json())["error"]["type"] == "invalid_request_error"


async def test_audio_body_limit(sims, gateway):
    v = await sims("vllm", "llama")
    gw = await gateway([model_block("llama", "vllm", [v.url])], server={"max_body_bytes": 100_000})

    async def chunks():                # no Content-Length: the limit is counted as the body arrives
        for i in range(0, len(AUDIO), 16384):
            yield AUDIO[i:i + 16384]

    boundary = "sYbOuNdArY"
    head = (f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\nllama\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n').encode()

    async def body():
        yield head
        async for c in chunks():
            yield c
        yield f"\r\n--{boundary}--\r\n".encode()

    ctype = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/audio/transcriptions", data=body(), headers=ctype) as r:
            err = (await r.json())["error"]
            assert r.status == 413 and err["message"] == "request body exceeds 100000 bytes (server.max_body_bytes)"
            assert err["code"] == "body_too_large"          # as with a Content-Length over the limit
        c = openai_client(gw)
        with pytest.raises(openai.APIStatusError) as ei:        # with a Content-Length: refused before reading
            await c.audio.transcriptions.create(model="llama", file=("a.wav", AUDIO))
        assert ei.value.status_code == 413
        small = await c.audio.transcriptions.create(model="llama", file=("a.wav", AUDIO[:50_000]))
        assert small.usage.seconds == 2
        await c.close()
    assert not [r for r in (await sim_state(v.url))["received"] if r["bytes"] > 100_000]


@pytest.mark.parametrize("path,body", [("/v1/rerank", {"query": "q", "documents": ["x" * 1000] * 200}),
                                       ("/v1/embeddings", {"input": ["x" * 1000] * 200}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 200_000}]})])
async def test_a_chunked_json_body_over_the_limit_is_body_too_large(sims, gateway, path, body):
    """Without a Content-Length the limit is found while reading: the same 413 code as the edge's, and
    its message names the key that set the limit, as the edge's to a told length does."""
    v = await sims("vllm", "llama")
    gw = await gateway([model_block("llama", "vllm", [v.url])], server={"max_body_bytes": 100_000})
    raw = orjson.dumps({"model": "llama", **body})

    async def chunks():
        for i in range(0, len(raw), 16384):
            yield raw[i:i + 16384]

    async with aiohttp.ClientSession() as s, s.post(gw.url + path, data=chunks(),
                                                    headers={"Content-Type": "application/json"}) as r:
        err = (await r.json())["error"]
        assert r.status == 413 and err["code"] == "body_too_large" and err["type"] == "invalid_request_error"
        async with s.post(gw.url + path, data=raw, headers={"Content-Type": "application/json"}) as told:
            assert told.status == 413
            assert err["message"] == (await told.json())["error"]["message"] == (
                "request body exceeds 100000 bytes (server.max_body_bytes)")


async def test_an_alias_rewrites_the_model_inside_the_form(sims, gateway):
    v = await sims("vllm", "whisper-v2")      # the engine refuses any other model name (404)
    gw = await gateway([model_block("whisper-v2", "vllm", [v.url])],
                       aliases=[{"name": "speech", "targets": [{"model": "whisper-v2"}]}])
    c = openai_client(gw)
    raw = await c.audio.transcriptions.with_raw_response.create(model="speech", file=("a.wav", AUDIO))
    assert raw.headers["x-served-model"] == "whisper-v2"
    assert raw.parse().text == transcript(AUDIO, math.ceil(len(AUDIO) / BYTES_PER_SECOND))
    status, got, _ = await post_json(gw, "/v1/rerank", {"model": "speech", **RERANK})
    assert status == 200 and got["model"] == "whisper-v2"
    await c.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("framing", [b"Content-Length: 0\r\n", b""])
async def test_audio_requests_without_a_body_are_answered_every_time(sims, tmp_path, framing):
    """A body-less POST reads aiohttp's one shared empty payload, which says "end of an HTTP chunk"
    for ever once read: the second such request on a worker must be answered as the first was, not
    spin its event loop until the parent kills it as stalled."""
    v = await sims("vllm", "llama")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {workers: 1, drain_delay_s: 0, shutdown_grace_s: 2, log_level: warning}\n"
                   f"models: [{{name: llama, engine: vllm, endpoints: ['{v.url}']}}]\n")
    head = (b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n"
            b"Content-Type: multipart/form-data; boundary=b0\r\n" + framing + b"\r\n")
    async with gateway_process(cfg, port):
        for _ in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head)
            async with asyncio.timeout(10):          # a stalled worker never answers
                answer = await reader.read()
            writer.close()
            status_line, _, rest = answer.partition(b"\r\n")
            assert status_line.startswith(b"HTTP/1.1 400 "), answer
            assert orjson.loads(rest.partition(b"\r\n\r\n")[2])["error"]["param"] == "model"
        status, _, got = await post_new(port, "/tokenize", {"model": "llama", "prompt": "hello there"})
        assert status == 200 and got["count"] == 4


def _form(*parts: tuple[bytes, bytes], boundary: bytes = b"fOrMbOuNdArY") -> bytes:
    """A multipart/form-data body of (Content-Disposition value, content) parts, as written."""
    body = b"".join(b"--" + boundary + b"\r\nContent-Disposition: " + disposition + b"\r\n\r\n" + value + b"\r\n"
                    for disposition, value in parts)
    return body + b"--" + boundary + b"--\r\n"


async def test_a_form_field_is_named_as_the_engines_form_reader_names_it(fleet):
    """A part's ``name`` is a Content-Disposition parameter (RFC 7578 section 4.2), whose value is a
    token or a quoted string, the parameter's name in any case with spaces around its ``=`` (RFC
    2183, RFC 2045 section 5.1); the form readers in front of vLLM (Starlette's, python-multipart's
    options parser, like Python's ``email`` module) read every such spelling. The gateway must
    find ``model`` in each of them, as the engine does, and a second ``model`` spelled otherwise is
    a repeated field like any other: routed by one and read by the engine as the other, the answer
    would come from a model the gateway did not route (the last such field is the engine's)."""
    gw, v, _ = fleet
    audio = (b'form-data; name="file"; filename="a.wav"', AUDIO)
    words = transcript(AUDIO, math.ceil(len(AUDIO) / BYTES_PER_SECOND))
    headers = {"Content-Type": "multipart/form-data; boundary=fOrMbOuNdArY"}
    async with aiohttp.ClientSession() as s:
        for spelling in (b"form-data; name=model", b'form-data; Name = "model"', b"form-data;NAME=model"):
            async with s.post(gw.url + "/v1/audio/transcriptions", data=_form((spelling, b"llama"), audio),
                              headers=headers) as r:
                got = await r.json()
                assert r.status == 200 and got["text"] == words, (spelling, got)
                assert r.headers["target-pod"] == v.url.removeprefix("http://")
        before = len((await sim_state(v.url))["received"])
        for second in (b"form-data; name=model", b'form-data; name = "model"', b'form-data; name="file"; name="model"'):
            body = _form((b'form-data; name="model"', b"llama"), audio, (second, b"qwen"))
            async with s.post(gw.url + "/v1/audio/transcriptions", data=body, headers=headers) as r:
                got = await r.json()
                assert r.status == 400 and got["error"]["param"] == "model", (second, got)
                assert got["error"]["message"] == "the form gives 'model' more than once; give it once"
    assert len((await sim_state(v.url))["received"]) == before      # no engine saw them


async def test_a_forms_model_is_read_as_the_engines_form_reader_reads_it(sims, gateway):
    """The form reader in front of vLLM (Starlette's) keeps a field's value as it came, spaces
    included, and decodes it as UTF-8, or as Latin-1 when it is not UTF-8. A model padded with
    spaces is then a model no engine serves: the gateway's 404, as for the same name in JSON,
    not a request routed by the trimmed name for the engine to refuse; a model named in Latin-1
    is the model the engine reads, and is served."""
    v = await sims("vllm", "whisper-ü")
    gw = await gateway([model_block("whisper-ü", "vllm", [v.url])],
                       aliases=[{"name": "speech", "targets": [{"model": "whisper-ü"}]}])
    audio = (b'form-data; name="file"; filename="a.wav"', AUDIO)
    headers = {"Content-Type": "multipart/form-data; boundary=fOrMbOuNdArY"}
    async with aiohttp.ClientSession() as s:
        for padded in (" whisper-ü ", "whisper-ü\t", " speech"):
            body = _form((b'form-data; name="model"', padded.encode()), audio)
            async with s.post(gw.url + "/v1/audio/transcriptions", data=body, headers=headers) as r:
                got = await r.json()
                assert r.status == 404, (padded, got)
                assert got["error"] == {"message": f"The model `{padded}` does not exist or you do not have access to it.", "type": "invalid_request_error",
                                        "param": "model", "code": "model_not_found"}, got
        assert [r for r in (await sim_state(v.url))["received"] if r["method"] == "POST"] == []
        body = _form((b'form-data; name="model"', "whisper-ü".encode("latin-1")), audio)
        async with s.post(gw.url + "/v1/audio/transcriptions", data=body, headers=headers) as r:
            got = await r.json()
            assert r.status == 200 and got["text"] == transcript(AUDIO, math.ceil(len(AUDIO) / BYTES_PER_SECOND)), got


async def test_a_part_with_two_content_dispositions_naming_model_is_a_repeated_model(fleet):
    """A part whose head gives Content-Disposition twice is named by one form reader after the
    first (Python's ``email``), by another after the last (Starlette's, in front of vLLM, keeps
    the last header it read): a file by one may be the ``model`` field of the other. Such a part
    naming ``model`` in either is ``model`` given twice, so that the engine never reads another
    model than the one routed."""
    gw, v, _ = fleet
    headers = {"Content-Type": "multipart/form-data; boundary=fOrMbOuNdArY"}
    audio = (b'form-data; name="file"; filename="a.wav"', AUDIO)
    hidden = b'form-data; name="file"; filename="b.wav"\r\nContent-Disposition: form-data; name="model"'
    before = len((await sim_state(v.url))["received"])
    async with aiohttp.ClientSession() as s:
        for parts in (((b'form-data; name="model"', b"llama"), audio, (hidden, b"qwen")),
                      ((hidden, b"qwen"), (b'form-data; name="model"', b"llama"), audio)):
            async with s.post(gw.url + "/v1/audio/transcriptions", data=_form(*parts), headers=headers) as r:
                got = await r.json()
                assert r.status == 400 and got["error"]["param"] == "model", got
                assert got["error"]["message"] == "the form gives 'model' more than once; give it once"
    assert len((await sim_state(v.url))["received"]) == before


async def test_the_forms_boundary_is_read_as_the_engines_form_reader_reads_it(fleet):
    """The multipart Content-Type's ``boundary`` is a parameter like a part's ``name``: the form
    reader in front of vLLM takes it with spaces around its ``=`` and its name in any case, and,
    given twice, the last (python-multipart's options, a dict filled in order). A form read
    with one boundary by the gateway and with another by the engine could name one model to each,
    so a Content-Type giving two boundaries is refused."""
    gw, v, _ = fleet
    form = _form((b'form-data; name="model"', b"llama"), (b'form-data; name="file"; filename="a.wav"', AUDIO))
    async with aiohttp.ClientSession() as s:
        for ctype in ("multipart/form-data; boundary = fOrMbOuNdArY", 'multipart/form-data;BOUNDARY= "fOrMbOuNdArY"'):
            async with s.post(gw.url + "/v1/audio/transcriptions", data=form, headers={"Content-Type": ctype}) as r:
                got = await r.json()
                assert r.status == 200 and "text" in got, (ctype, got)
        before = len((await sim_state(v.url))["received"])
        for ctype in ("multipart/form-data; boundary=fOrMbOuNdArY; boundary=other",
                      "multipart/form-data; boundary=other; Boundary=fOrMbOuNdArY"):
            async with s.post(gw.url + "/v1/audio/transcriptions", data=form, headers={"Content-Type": ctype}) as r:
                got = await r.json()
                assert r.status == 400 and got["error"]["param"] == "Content-Type", (ctype, got)
                assert got["error"]["message"] == "the multipart Content-Type gives 'boundary' more than once", got
    assert len((await sim_state(v.url))["received"]) == before


async def test_a_forms_charset_decodes_its_model_as_the_engines_form_reader_decodes_it(sims, gateway):
    """Starlette's form reader decodes a field with the ``charset`` of the request's Content-Type
    (UTF-8 when it names none), falling back to Latin-1 when the bytes do not decode in it or the
    charset is unknown. The gateway routes by the name the engine will read: UTF-8 bytes declared
    Latin-1 are another name (a 404 at the gateway, no engine asked), Latin-1 bytes declared so
    are the model. A charset given twice is refused, as a boundary given twice is."""
    v = await sims("vllm", "whisper-ü")
    gw = await gateway([model_block("whisper-ü", "vllm", [v.url])])
    audio = (b'form-data; name="file"; filename="a.wav"', AUDIO)
    ctype = "multipart/form-data; boundary=fOrMbOuNdArY; charset="
    async with aiohttp.ClientSession() as s:
        for charset, raw in (("iso-8859-1", "whisper-ü".encode()), ("x-no-such-charset", "whisper-ü".encode())):
            body = _form((b'form-data; name="model"', raw), audio)
            async with s.post(gw.url + "/v1/audio/transcriptions", data=body,
                              headers={"Content-Type": ctype + charset}) as r:
                got = await r.json()
                assert r.status == 404 and got["error"]["code"] == "model_not_found", (charset, got)
                assert got["error"]["message"] == f"The model `{raw.decode('latin-1')}` does not exist or you do not have access to it.", got
        assert [r for r in (await sim_state(v.url))["received"] if r["method"] == "POST"] == []
        body = _form((b'form-data; name="model"', "whisper-ü".encode("latin-1")), audio)
        async with s.post(gw.url + "/v1/audio/transcriptions", data=body,
                          headers={"Content-Type": ctype + "ISO-8859-1"}) as r:
            assert r.status == 200, await r.text()
        async with s.post(gw.url + "/v1/audio/transcriptions", data=body,
                          headers={"Content-Type": ctype + "utf-8; charset=latin-1"}) as r:
            got = await r.json()
            assert r.status == 400 and got["error"]["param"] == "Content-Type", got
            assert got["error"]["message"] == "the multipart Content-Type gives 'charset' more than once", got


async def test_a_rerank_usage_of_total_tokens_alone_is_counted_and_charged(gateway):
    """vLLM releases before ``prompt_tokens`` was added to a rerank's usage report
    ``{"total_tokens": N}`` alone: the N tokens it encoded are the prompt tokens counted (metric,
    log line) and charged to the user's TPM, as a score's ``prompt_tokens`` are."""
    async def rerank(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"id": "rerank-1", "model": "llama", "usage": {"total_tokens": 37},
                                  "results": [{"index": 0, "document": {"text": "x"}, "relevance_score": 0.5}]})

    key = "sk-alice-0123456789"
    async with fake_engine(rerank, paths=("/v1/rerank",)) as url:
        gw = await gateway([model_block("llama", "vllm", [url])], auth={"api_keys": [{"key": key, "user": "alice"}]},
                           limits={"users": {"alice": {"tpm": 1000}}})
        status, got, _ = await post_json(gw, "/v1/rerank", {"model": "llama", **RERANK},
                                         {"Authorization": f"Bearer {key}"})
        assert status == 200 and got["usage"] == {"total_tokens": 37}       # passed on as it came
        assert 'switchyard_prompt_tokens_total{model="llama"} 37.0' in await gw.metrics_text()
        state = gw.gw.tenancy.state
        assert (await wait_for(lambda: _charged(state, "alice")))["tokens"] == 37


async def _charged(state, user):
    used = await state.usage(user)
    return used if used["tokens"] else None


async def test_an_sglang_rerank_counts_the_prompt_tokens_its_items_report(sims, gateway):
    """SGLang's ``/v1/rerank`` answers a JSON list, each item's ``meta_info`` with the prompt
    tokens of its query-document pair: their sum is the prompt tokens counted (metric, log line) and charged
    to the user's TPM, as vLLM's rerank usage is, not the gateway's estimate."""
    s = await sims("sglang", "qwen")
    key = "sk-alice-0123456789"
    gw = await gateway([model_block("qwen", "sglang", [s.url])], auth={"api_keys": [{"key": key, "user": "alice"}]},
                       limits={"users": {"alice": {"tpm": 100000}}})
    docs = ["green pear " * 40, "a red apple pie recipe", "trains"]
    with gw.gw.request_log.capture() as logs:
        status, got, _ = await post_json(gw, "/v1/rerank", {"model": "qwen", "query": "red apple pie",
                                                            "documents": docs}, {"Authorization": f"Bearer {key}"})
    assert status == 200 and len(got) == 3, got
    reported = sum(item["meta_info"]["prompt_tokens"] for item in got)
    [line] = [e for e in logs if e["event"] == "request"]
    assert line["prompt_tokens"] == reported, line
    assert f'switchyard_prompt_tokens_total{{model="qwen"}} {float(reported)}' in await gw.metrics_text()
    state = gw.gw.tenancy.state
    assert (await wait_for(lambda: _charged(state, "alice")))["tokens"] == reported


# the pooling paths vLLM serves beside rerank and score (its classify, pooling and Cohere embed
# routers), and SGLang's OpenAI-style classify; each answer reports the prompt tokens it encoded
POOLING_CALLS = [
    ("llama", "/classify", {"input": ["red apple pie", "trains"]}),
    ("llama", "/pooling", {"input": "red apple pie"}),
    ("llama", "/v2/embed", {"texts": ["red apple pie", "trains"], "input_type": "search_document",
                            "embedding_types": ["float"]}),
    ("qwen", "/v1/classify", {"input": ["red apple pie", "trains"]}),
]


async def test_the_pooling_paths_reach_the_engines_that_serve_them(sims, gateway):
    """``/classify``, ``/pooling`` and ``/v2/embed`` (vLLM) and ``/v1/classify`` (SGLang) are
    routed by their ``model`` like ``/v1/score``: the engine gets the body as it came, the answer
    comes back as the engine gave it, the prompt tokens it reports are counted and charged; an
    engine without the path is a 404 ``unsupported_path``, a missing model a 400."""
    v = await sims("vllm", "llama")
    s = await sims("sglang", "qwen")
    key = "sk-alice-0123456789"
    gw = await gateway([model_block("llama", "vllm", [v.url]), model_block("qwen", "sglang", [s.url])],
                       auth={"api_keys": [{"key": key, "user": "alice"}]}, limits={"users": {"alice": {"tpm": 100000}}})
    auth = {"Authorization": f"Bearer {key}"}
    counted = 0
    for model, path, body in POOLING_CALLS:
        status, got, headers = await post_json(gw, path, {"model": model, **body}, auth)
        assert status == 200, (path, got)
        sim = v if model == "llama" else s
        assert headers["target-pod"] == sim.url.removeprefix("http://")
        assert [r for r in (await sim_state(sim.url))["received"] if r["method"] == "POST"][-1]["path"] == path
        if path == "/v2/embed":
            assert len(got["embeddings"]["float"]) == 2
            counted += got["meta"]["tokens"]["input_tokens"]
        else:
            assert got["object"] == "list" and got["usage"]["prompt_tokens"] > 0
            counted += got["usage"]["prompt_tokens"]
        if "classify" in path:
            assert [d["index"] for d in got["data"]] == [0, 1] and all("label" in d for d in got["data"])
    text = await gw.metrics_text()
    for path in ("/classify", "/pooling", "/v2/embed", "/v1/classify"):
        assert f'switchyard_path_requests_total{{path="{path}",status="200"}} 1.0' in text
    prompt = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith("switchyard_prompt_tokens_total{"))
    assert prompt == counted
    state = gw.gw.tenancy.state
    assert (await wait_for(lambda: _charged(state, "alice")))["tokens"] == counted
    # where the engine has no such route: the gateway's 404, the engine never asked
    for model, path in (("qwen", "/classify"), ("qwen", "/pooling"), ("qwen", "/v2/embed"), ("llama", "/v1/classify")):
        status, got, headers = await post_json(gw, path, {"model": model, "input": "x"}, auth)
        assert status == 404 and got["error"]["code"] == "unsupported_path", (path, got)
        assert headers["x-error-unsupported-path"] == path
    status, got, _ = await post_json(gw, "/pooling", {"input": "x"}, auth)
    assert status == 400 and got["error"]["param"] == "model"


async def test_sglangs_v1_tokenize_and_detokenize_reach_it_and_vllm_says_it_does_not_serve_them(fleet):
    """SGLang serves its tokenizer at ``/v1/tokenize`` and ``/v1/detokenize`` (``/tokenize`` and
    ``/detokenize`` are aliases it leaves out of its schema); vLLM at the short paths only."""
    gw, _, s = fleet
    status, got, headers = await post_json(gw, "/v1/tokenize", {"model": "qwen", "prompt": "hello there"})
    assert status == 200 and got["count"] == 4, got
    assert headers["target-pod"] == s.url.removeprefix("http://")
    status, back, _ = await post_json(gw, "/v1/detokenize", {"model": "qwen", "tokens": got["tokens"]})
    assert status == 200 and back == {"text": "hello there"}
    posted = [r["path"] for r in (await sim_state(s.url))["received"] if r["method"] == "POST"]
    assert posted == ["/v1/tokenize", "/v1/detokenize"]
    for path in ("/v1/tokenize", "/v1/detokenize"):
        status, got, headers = await post_json(gw, path, {"model": "llama", "prompt": "x", "tokens": [1]})
        assert status == 404 and got["error"]["code"] == "unsupported_path", got
        assert got["error"]["message"] == f"The model `llama` is served by vllm, which does not serve POST {path}."
    metrics = await gw.metrics_text()
    assert 'switchyard_path_requests_total{path="/v1/tokenize",status="200"} 1.0' in metrics


async def test_large_pass_through_answers_are_relayed_exactly_with_their_usage_counted(gateway):
    """A pooling answer of many vectors, a Cohere embed answer (its usage in ``meta.tokens``) and
    a rerank answered as a list (SGLang's, each item's tokens in its ``meta_info``), each of
    about a MB: the bytes the engine sent, and their prompt tokens counted."""
    rows = 1000
    vector = [0.125 * i for i in range(128)]
    answers = {
        "/pooling": {"object": "list", "data": [{"index": i, "data": vector} for i in range(rows)],
                     "usage": {"prompt_tokens": 11, "total_tokens": 11}},
        "/v2/embed": {"id": "e", "embeddings": {"float": [vector] * rows}, "meta": {"tokens": {"input_tokens": 13}}},
        "/v1/rerank": [{"index": i, "score": 0.5, "text": "x" * 100, "meta_info": {"prompt_tokens": 1}}
                       for i in range(rows * 4)],
    }

    async def engine(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=orjson.dumps(answers[request.path]), content_type="application/json")

    async with fake_engine(engine, paths=tuple(answers)) as url:
        gw = await gateway([model_block("llama", "vllm", [url])])
        with gw.gw.request_log.capture() as logs:
            async with aiohttp.ClientSession() as s:
                for path, body in (("/pooling", {"model": "llama", "input": "hi"}),
                                   ("/v2/embed", {"model": "llama", "texts": ["hi"], "input_type": "query"}),
                                   ("/v1/rerank", {"model": "llama", **RERANK})):
                    async with s.post(gw.url + path, json=body) as r:
                        assert r.status == 200 and await r.read() == orjson.dumps(answers[path]), path
        assert [e["prompt_tokens"] for e in logs if e["event"] == "request"] == [11, 13, rows * 4]


async def test_a_number_beyond_a_doubles_range_in_a_pooling_answer_is_relayed_with_its_usage_at_any_size(gateway):
    """A number orjson refuses (``1e999``: RFC 8259 bounds none) in a vector: the answer is relayed
    as the engine wrote it and its usage counted, in a small answer as in a large one (read for its
    usage alone)."""
    def answer(rows: int) -> bytes:
        return orjson.dumps({"object": "list", "data": [{"index": i, "data": [0.5, -7.0]} for i in range(rows)],
                             "usage": {"prompt_tokens": 11, "total_tokens": 11}}).replace(b"-7.0", b"1e999")

    answers = {"small": answer(2), "large": answer(20000)}
    assert len(answers["small"]) < VIEW_ABOVE < len(answers["large"])

    async def engine(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answers[request.headers["x-size"]], content_type="application/json")

    async with fake_engine(engine, paths=("/pooling",)) as url:
        gw = await gateway([model_block("llama", "vllm", [url])])
        with gw.gw.request_log.capture() as logs:
            async with aiohttp.ClientSession() as s:
                for size in answers:
                    async with s.post(gw.url + "/pooling", json={"model": "llama", "input": "hi"},
                                      headers={"x-size": size}) as r:
                        assert r.status == 200 and await r.read() == answers[size], size
        assert [e["prompt_tokens"] for e in logs if e["event"] == "request"] == [11, 11]


async def test_bytes_are_relayed_only_to_a_request_that_asked_for_them(gateway):
    """An engine (or a proxy in front of it) that answers an embeddings request for floats with
    application/octet-stream gave no answer the client can read: a 502 upstream_bad_response, as a
    body that is no JSON object is; the same bytes asked for with encoding_format "bytes" pass."""
    async def engine(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"\x00\x01" * 8, content_type="application/octet-stream",
                            headers={"metadata": '{"usage": {"prompt_tokens": 2, "total_tokens": 2}}'})

    async with fake_engine(engine, paths=("/v1/embeddings",)) as url:
        gw = await gateway([model_block("llama", "vllm", [url])])
        for fmt, status in ((None, 502), ("float", 502), ("base64", 502), ("bytes", 200)):
            body = {"model": "llama", "input": "hi", **({"encoding_format": fmt} if fmt else {})}
            r = await post(gw, body, path="/v1/embeddings")
            assert r.status == status, (fmt, r.body[:200])
            if status == 502:
                assert r.headers["x-error-upstream"] == "protocol" and r.json()["error"]["code"] == "upstream_bad_response"


async def test_an_engines_405_to_a_relayed_request_keeps_the_allow_header_it_sent(gateway):
    """An engine that serves a path with other methods only answers a 405 naming them in ``Allow``
    (RFC 9110 §15.5.6): the client gets both, the error in OpenAI's shape."""
    async def engine(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"detail": "Method Not Allowed"}, status=405, headers={"Allow": "GET, HEAD"})

    async with fake_engine(engine, paths=("/pooling",)) as url:
        gw = await gateway([model_block("llama", "vllm", [url])])
        async with aiohttp.ClientSession() as s, s.post(gw.url + "/pooling", json={"model": "llama", "input": "hi"}) as r:
            assert r.status == 405 and r.headers.get("Allow") == "GET, HEAD"
            assert (await r.json())["error"]["message"] == "Method Not Allowed"
