"""Header values and multipart parameters with bytes that are not UTF-8 (the HTTP parsers hold them
as surrogate escapes): a session key, an API key, a multipart boundary or filename made of such
bytes is the client's mistake or its opaque name, never a 500, and an upload refused for it
leaves no file behind."""

from __future__ import annotations

import os

import msgspec
import orjson
import pytest

from gateway.request import CHAT, header_text, parse
from routers.session_map import session_of
from tests.support.edge import assert_openai_error, exchange, request
from tests.support.factories import model_block
from tests.support.tenancy import ALICE, KEYS

BAD = "\udcff\udcfe"        # the bytes FF FE as the parsers hold them
MSGS = [{"role": "user", "content": "hi"}]


def test_header_text_keeps_a_value_distinct_and_encodable():
    assert header_text(None) is None and header_text("abc") == "abc" and header_text("жёлтый") == "жёлтый"
    a, b = header_text("k-" + BAD), header_text("k-\udcff")
    assert a == "k-\\xff\\xfe" and a != b and a.encode() and header_text("k-" + BAD) == a
    req = parse(CHAT, orjson.dumps({"model": "m", "messages": MSGS}), {"x-session-key": "s" + BAD}, "r1")
    key = session_of(req)
    assert key is not None and msgspec.msgpack.encode(key)     # the shared view can send it to the siblings


BODIES = {
    "/v1/chat/completions": {"model": "m", "messages": MSGS, "max_tokens": 3},
    "/v1/completions": {"model": "m", "prompt": "hi", "max_tokens": 3},
    "/v1/responses": {"model": "m", "input": "hi", "max_output_tokens": 3},
    "/v1/messages": {"model": "m", "messages": MSGS, "max_tokens": 3},
}


@pytest.mark.parametrize("path", list(BODIES))
async def test_a_session_key_of_any_bytes_keeps_its_session(sims, gateway, path):
    a, b = await sims("vllm", "m"), await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [a.url, b.url], strategy="session-affinity")])
    body = orjson.dumps(BODIES[path])
    pods = set()
    for header in ("x-session-key", "x-aibrix-session-key", "x-session-id"):
        for _ in range(3):
            got = await exchange(gw.port, request("POST", path, body, {header: "sess-" + BAD}, close=True))
            assert [r.status for r in got.responses] == [200], got.responses[0].body[:300]
            pods.add((header, got.responses[0].headers["target-pod"]))
    assert len({p for h, p in pods if h != "x-session-id"}) == 1      # one key, one endpoint, every time


async def test_an_api_key_of_any_bytes_is_a_401_in_its_api_shape(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth={**KEYS, "admin_token": "admin-" + "x" * 20})
    chat = orjson.dumps(BODIES["/v1/chat/completions"])
    for headers in ({"Authorization": "Bearer " + BAD}, {"x-api-key": BAD}):
        got = await exchange(gw.port, request("POST", "/v1/chat/completions", chat, headers, close=True))
        assert_openai_error(got.responses[0], 401)
        got = await exchange(gw.port, request("GET", "/v1/models", None, headers, close=True))
        assert got.responses[0].status == 401
    got = await exchange(gw.port, request("POST", "/v1/messages", orjson.dumps(BODIES["/v1/messages"]),
                                          {"x-api-key": BAD}, close=True))
    resp = got.responses[0]
    assert resp.status == 401 and orjson.loads(resp.body)["type"] == "error"     # Anthropic's shape
    for path in ("/admin/users", "/status.json"):
        got = await exchange(gw.port, request("GET", path, None, {"Authorization": "Bearer " + BAD}, close=True))
        assert got.responses[0].status in (401, 403)
    got = await exchange(gw.port, request("POST", "/v1/chat/completions", chat,
                                          {"Authorization": f"Bearer {ALICE}"}, close=True))
    assert got.responses[0].status == 200


@pytest.mark.parametrize("boundary", ["\u0436", "\udcff"])
async def test_an_audio_form_whose_boundary_is_not_ascii_is_a_400(sims, gateway, boundary):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    body = f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm\r\n--{boundary}--\r\n"
    raw = body.encode("utf-8", "surrogateescape")
    got = await exchange(gw.port, request("POST", "/v1/audio/transcriptions", raw,
                                          {"Content-Type": f"multipart/form-data; boundary={boundary}"}, close=True))
    err = assert_openai_error(got.responses[0], 400)
    assert "boundary" in err["message"]


async def test_a_file_whose_name_is_not_utf8_is_refused_and_not_kept(sims, gateway, tmp_path):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       batch={"enabled": True, "dir": str(tmp_path / "batch"), "poll_interval_s": 0.05})
    line = orjson.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                         "body": BODIES["/v1/chat/completions"]})
    form = (b"--XB\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            b"--XB\r\nContent-Disposition: form-data; name=\"file\"; filename=\"\xff\xfe.jsonl\"\r\n"
            b"Content-Type: application/jsonl\r\n\r\n" + line + b"\n\r\n--XB--\r\n")
    got = await exchange(gw.port, request("POST", "/v1/files", form,
                                          {"Content-Type": "multipart/form-data; boundary=XB"}, close=True))
    err = assert_openai_error(got.responses[0], 400)
    assert "filename" in err["message"]
    assert os.listdir(tmp_path / "batch" / "files") == [] and os.listdir(tmp_path / "batch" / "tmp") == []
