"""A request body in a content coding the gateway does not decode, on a raw socket against a real
gateway: RFC 9110 §15.5.16's 415 with ``Accept-Encoding`` naming the codings it decodes, in OpenAI's
shape (Anthropic's on the Messages paths), with a request id, on every path; nothing reaches the
engine. The codings it decodes (gzip, deflate) keep being served, and x-gzip as gzip (RFC 9110
§8.4.1.3)."""

from __future__ import annotations

import gzip
import zlib

import orjson
import pytest
from aiohttp import compression_utils

from gateway.server.app import GATEWAY_KEY
from tests.support.edge import assert_openai_error, edge_gateway, exchange, request
from tests.support.loops import on_both_loops
from tests.support.waiting import wait_for

CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
MESSAGES_BODY = orjson.dumps({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
DECODED = ["gzip", "deflate"] + (["br"] if compression_utils.HAS_BROTLI else []) \
    + (["zstd"] if getattr(compression_utils, "HAS_ZSTD", False) else [])

# (Content-Encoding header lines, the coding the answer names)
REFUSED = [
    (["x-foo"], "x-foo"),
    (["compress"], "compress"),
    (["x-compress"], "x-compress"),
    (["gzip, gzip"], "gzip, gzip"),             # two codings: aiohttp decodes neither
    (["gzip, identity"], "gzip, identity"),
    (["gzip", "gzip"], "gzip, gzip"),           # the same in two header lines
] + [([c], c) for c in ("br", "zstd") if c not in DECODED]
PATHS = [CHAT, "/v1/messages", "/v1/embeddings", "/v1/tokenize", "/v1/files", "/admin/reload", "/v1/nope"]


def _head(path: str, codings: list[str], body: bytes) -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: gateway.test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n" + "".join(f"Content-Encoding: {c}\r\n" for c in codings) + "\r\n")
    return head.encode() + body


@pytest.mark.parametrize("codings,named", REFUSED, ids=[" + ".join(c) for c, _ in REFUSED])
@on_both_loops
async def test_a_coding_the_gateway_does_not_decode_is_a_shaped_415(codings, named):
    async with edge_gateway(max_body_bytes=4096) as gw:
        for path in PATHS:
            body = MESSAGES_BODY if path == "/v1/messages" else BODY
            ex = await exchange(gw.port, _head(path, codings, body), wait=8.0)
            r = ex.first
            assert r.status == 415, (path, r.status, r.body[:300])
            assert r.headers.get("request-id"), (path, r.headers)
            assert r.headers.get("accept-encoding") == ", ".join(DECODED), (path, r.headers)
            if path == "/v1/messages":
                got = r.json()
                assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error", got
                message = got["error"]["message"]
            else:
                err = assert_openai_error(r, 415)
                assert (err["type"], err["code"], err["param"]) == (
                    "invalid_request_error", "unsupported_content_encoding", "Content-Encoding"), err
                message = err["message"]
            assert repr(named) in message and "gzip" in message and "install" not in message.lower(), message
            assert ex.closed and len(ex.responses) == 1, path
        assert await gw.received() == []


@on_both_loops
async def test_the_codings_the_gateway_decodes_are_served():
    async with edge_gateway(max_body_bytes=4096) as gw:
        for coding, body in (("gzip", gzip.compress(BODY)), ("GZIP", gzip.compress(BODY)),
                             ("deflate", zlib.compress(BODY)), ("identity", BODY)):
            ex = await exchange(gw.port, _head(CHAT, [coding], body), wait=8.0, until_close=False, responses=1)
            assert ex.first.status == 200, (coding, ex.first.body[:300])
        # a request without a body is not refused for the coding it names
        ex = await exchange(gw.port, request("GET", "/health", headers={"Content-Encoding": "x-foo"}),
                            until_close=False, responses=1)
        assert ex.first.status == 200, ex.first.body
        assert len(await gw.received()) == 4


@on_both_loops
async def test_a_page_reads_the_415():
    """With CORS on, a page's request in a coding the gateway does not decode gets the 415 with
    CORS's headers, so the page can read why (the fast lane hands such a request to aiohttp)."""
    origin = "https://app.example"
    async with edge_gateway(max_body_bytes=4096, cors_allowed_origins=[origin]) as gw:
        ex = await exchange(gw.port, _head(CHAT, ["x-foo"], BODY)[:-len(BODY) - 2]
                            + f"Origin: {origin}\r\n\r\n".encode() + BODY, wait=8.0)
        err = assert_openai_error(ex.first, 415)
        assert err["code"] == "unsupported_content_encoding"
        assert ex.first.headers.get("access-control-allow-origin") == origin, ex.first.headers
        assert await gw.received() == []


def _chunked(data: bytes, size: int = 7) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(data[i:i + size]), data[i:i + size])
                    for i in range(0, len(data), size)) + b"0\r\n\r\n"


@pytest.mark.parametrize("cors", [False, True], ids=["cors_off", "cors_on"])
@on_both_loops
async def test_x_gzip_is_decoded_as_gzip(cors):
    """RFC 9110 §8.4.1.3: a recipient SHOULD consider x-gzip equivalent to gzip. Its body reaches the
    engine decoded, exactly as a gzip one does, whether it came with its head, after it, in pieces or
    chunked; the connection stays open for the next request (with CORS on too, a page's request among
    them)."""
    packed = gzip.compress(BODY)
    origin = "https://app.example"
    server = {"cors_allowed_origins": [origin]} if cors else {}
    async with edge_gateway(max_body_bytes=4096, **server) as gw:
        ex = await exchange(gw.port, _head(CHAT, ["gzip"], packed), wait=8.0, until_close=False, responses=1)
        assert ex.first.status == 200, ex.first.body[:300]
        as_gzip = await gw.received()
        assert len(as_gzip) == 1 and as_gzip[0]["json_object"], as_gzip
        head = _head(CHAT, ["x-gzip"], packed)[:-len(packed)]
        if cors:                # a page's request: the answer goes through aiohttp's response, with CORS's headers
            head = head[:-2] + f"Origin: {origin}\r\n\r\n".encode()
        for name, parts in (
                ("with its head", [head + packed]),
                ("in capitals", [_head(CHAT, ["X-GZip"], packed)]),
                ("after its head", [head, packed]),
                ("in pieces", [head, packed[:5], packed[5:20], packed[20:]]),
                ("chunked", [head.replace(f"Content-Length: {len(packed)}\r\n".encode(),
                                          b"Transfer-Encoding: chunked\r\n"), _chunked(packed)])):
            ex = await exchange(gw.port, *parts, request("GET", "/health"), wait=8.0, until_close=False,
                                responses=2)
            assert [r.status for r in ex.responses] == [200, 200], (name, [r.body[:300] for r in ex.responses])
            assert ex.first.json()["choices"], name
            assert not ex.closed, name
            if cors and name != "in capitals":
                assert ex.first.headers.get("access-control-allow-origin") == origin, (name, ex.first.headers)
        got = await gw.received()
        assert got[1:] == as_gzip * 5, got


@on_both_loops
async def test_an_x_gzip_body_is_refused_as_a_gzip_one():
    """What is not gzip under x-gzip is the 400 bad_body of gzip's, and a bomb the 413 once its decoded
    size crosses server.max_body_bytes; nothing reaches the engine."""
    async with edge_gateway(max_body_bytes=4096) as gw:
        for coding in ("gzip", "x-gzip"):
            whole = _head(CHAT, [coding], BODY)       # JSON, not gzip: with its head, and after it
            for parts in ([whole], [whole[:-len(BODY)], BODY]):
                ex = await exchange(gw.port, *parts, wait=8.0, until_close=False, responses=1)
                err = assert_openai_error(ex.first, 400)
                assert err["code"] == "bad_body", (coding, err)
            bomb = gzip.compress(b" " * 2_000_000)
            ex = await exchange(gw.port, _head(CHAT, [coding], bomb), wait=8.0, until_close=False, responses=1)
            err = assert_openai_error(ex.first, 413)
            assert err["code"] == "body_too_large", (coding, err)
        assert await gw.received() == []


@on_both_loops
async def test_an_x_gzip_body_that_stops_coming_is_the_408_of_any_body():
    """The body's clocks run on the bytes as they come, decoded or not: an x-gzip body that stops
    part way is the 408 of server.body_timeout_s, its handler ended (nothing left in flight), and a
    client that leaves part way costs nothing either."""
    packed = gzip.compress(BODY)
    head = _head(CHAT, ["x-gzip"], packed)[:-len(packed)]
    async with edge_gateway(max_body_bytes=4096, body_timeout_s=0.5) as gw:
        ex = await exchange(gw.port, head, packed[:10], wait=8.0)
        err = assert_openai_error(ex.first, 408)
        assert err["code"] == "request_timeout", err
        assert ex.closed
        await exchange(gw.port, head, packed[:10], wait=0.2, until_close=False, responses=1)     # and leaves
        assert await gw.received() == []


@on_both_loops
async def test_a_body_that_does_not_decode_closes_its_connection_in_either_spelling_of_gzip():
    """gzip and x-gzip are one coding (RFC 9110 §8.4.1.3), and a body that is not what its coding
    says gets one answer in either spelling: the 400 bad_body, with ``Connection: close``, and the
    connection closed after it, so a request sent behind it on the same connection gets nothing
    (the client sends it again on a new one); one request log line, the answer's. The parser that
    decodes gzip stops reading the connection at the first byte it cannot decode; x-gzip's body was
    answered by the pipeline with the connection kept open for the next request."""
    async with edge_gateway(max_body_bytes=4096) as gw:
        with gw.app[GATEWAY_KEY].request_log.capture() as lines:
            for path, body in ((CHAT, BODY), ("/v1/messages", MESSAGES_BODY), ("/v1/audio/transcriptions", BODY)):
                for coding in ("gzip", "x-gzip", "X-GZip"):
                    whole = _head(path, [coding], body)        # JSON, not gzip
                    head = whole[:-len(body)]
                    chunked = head.replace(f"Content-Length: {len(body)}\r\n".encode(), b"Transfer-Encoding: chunked\r\n")
                    for name, parts in (("with its head", [whole]), ("after its head", [head, body]),
                                        ("chunked", [chunked, _chunked(body)])):
                        case = (path, coding, name)
                        ex = await exchange(gw.port, *parts, request("GET", "/health"), wait=3.0)
                        assert len(ex.responses) == 1 and ex.closed, (case, [r.status for r in ex.responses])
                        r = ex.first
                        assert r.status == 400 and r.headers.get("connection") == "close", (case, r.status, r.headers)
                        if path == "/v1/messages":
                            assert r.json()["type"] == "error", (case, r.body)
                        else:
                            assert assert_openai_error(r, 400)["code"] == "bad_body", (case, r.body)
                        rid = r.headers["request-id"]
                        await wait_for(lambda rid=rid: any(x["request_id"] == rid for x in lines), timeout=5.0, interval=0.01)
                        got = [x for x in lines if x["request_id"] == rid]
                        assert [(x["status"], x["error_class"]) for x in got] == [(400, "http")], (case, got)
            assert await gw.received() == []
