"""Request methods on a raw socket against a real gateway, with CORS off and on: a method the
gateway does not implement anywhere is RFC 9110 §9.1's 501, a known method a path does not serve
§15.5.6's 405 with an ``Allow`` naming what it does; each in OpenAI's shape (Anthropic's on the
Messages paths) with a request id, written to the request log, and, where the HTTP parser could
read the request's framing, with the connection kept for the next request. A method that is not a
token at all stays a malformed request (400)."""

from __future__ import annotations

import asyncio
import contextlib

import orjson
import pytest

from gateway.server.app import GATEWAY_KEY
from tests.support.edge import assert_openai_error, edge_gateway, exchange, request
from tests.support.loops import on_both_loops

ORIGIN = "https://app.example"
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
HEALTH = request("GET", "/health")
CORS = [False, True]


def _server(cors: bool) -> dict:
    return {"max_body_bytes": 4096, **({"cors_allowed_origins": [ORIGIN]} if cors else {})}


@contextlib.contextmanager
def _lines(gw):
    with gw.app[GATEWAY_KEY].request_log.capture() as lines:
        yield lines


def _error(resp, path: str, status: int) -> dict:
    """The error's fields in its path's shape: (type, message, code or None)."""
    if path.startswith("/v1/messages"):
        assert resp.status == status, (resp.status, resp.body[:300])
        assert resp.headers.get("request-id"), resp.headers
        got = resp.json()
        assert got["type"] == "error" and set(got["error"]) == {"type", "message"}, got
        return {"type": got["error"]["type"], "message": got["error"]["message"], "code": None}
    return assert_openai_error(resp, status)


# a method no route serves: the HTTP parser reads PROPFIND, MKCOL and QUERY (their framing is known),
# not FOO, BREW or a lowercase get (RFC 9110 §9.1: methods are case-sensitive)
PARSED = ["PROPFIND", "MKCOL", "QUERY"]
UNPARSED = ["FOO", "BREW", "get"]
PATHS = ["/v1/chat/completions", "/v1/models", "/v1/messages", "/health", "/nope"]


@pytest.mark.parametrize("cors", CORS, ids=["cors_off", "cors_on"])
@on_both_loops
async def test_a_method_the_gateway_does_not_implement_is_a_501(cors):
    async with edge_gateway(**_server(cors)) as gw:
        for method in PARSED + UNPARSED:
            for path in PATHS:
                body = BODY if path.startswith("/v1/") and path != "/v1/models" else None
                headers = {"Origin": ORIGIN} if cors else {}
                with _lines(gw) as lines:
                    ex = await exchange(gw.port, request(method, path, body, headers) + HEALTH, wait=8.0,
                                        until_close=method in UNPARSED, responses=2)
                where = (method, path)
                err = _error(ex.first, path, 501)
                assert method in err["message"] and "not implemented" in err["message"], (where, err)
                if not path.startswith("/v1/messages"):
                    assert err["code"] == "method_not_implemented", (where, err)
                rid = ex.first.headers["request-id"]
                if method in PARSED:        # its framing was read: the next request is answered
                    assert [r.status for r in ex.responses] == [501, 200], (where, ex.responses)
                    assert not ex.closed, where
                else:                       # the parser stops at it: closed after the answer, said so
                    assert ex.first.headers.get("connection", "").lower() == "close", (where, ex.first.headers)
                    assert ex.closed and len(ex.responses) == 1, (where, ex.responses)
                mine = [line for line in lines if line["request_id"] == rid]
                assert len(mine) == 1, (where, lines)
                assert (mine[0]["status"], mine[0]["path"], mine[0]["method"]) == (501, path, method), mine
        assert await gw.received() == []


# (method, path, the methods its Allow names)
NOT_ALLOWED = [
    ("GET", "/v1/chat/completions", {"POST"}),
    ("PUT", "/v1/chat/completions", {"POST"}),
    ("DELETE", "/v1/embeddings", {"POST"}),
    ("GET", "/v1/messages", {"POST"}),
    ("DELETE", "/v1/models", {"GET", "HEAD"}),
    ("PATCH", "/v1/models", {"GET", "HEAD"}),
    ("POST", "/v1/models/m", {"GET", "HEAD"}),
    ("TRACE", "/v1/models", {"GET", "HEAD"}),
    ("PUT", "/v1/responses/resp_1", {"GET", "HEAD", "DELETE"}),
    ("GET", "/v1/responses/resp_1/cancel", {"POST"}),
    ("POST", "/v1/responses/resp_1/input_items", {"GET", "HEAD"}),
    ("OPTIONS", "/v1/models", {"GET", "HEAD"}),
    ("POST", "/health", {"GET", "HEAD"}),
]


@pytest.mark.parametrize("cors", CORS, ids=["cors_off", "cors_on"])
@on_both_loops
async def test_a_known_method_a_path_does_not_serve_is_a_405_naming_what_it_does(cors):
    async with edge_gateway(**_server(cors)) as gw:
        for method, path, allowed in NOT_ALLOWED:
            body = BODY if method in ("POST", "PUT", "PATCH") else None
            for headers in ({}, {"Origin": ORIGIN}) if cors else ({},):
                where = (method, path, headers)
                with _lines(gw) as lines:
                    ex = await exchange(gw.port, request(method, path, body, headers) + HEALTH, wait=8.0,
                                        until_close=False, responses=2)
                err = _error(ex.first, path, 405)
                assert method in err["message"], (where, err)
                got = {m.strip() for m in ex.first.headers.get("allow", "").split(",")}
                assert got == allowed, (where, ex.first.headers)
                assert [r.status for r in ex.responses] == [405, 200] and not ex.closed, (where, ex.responses)
                rid = ex.first.headers["request-id"]
                mine = [line for line in lines if line["request_id"] == rid]
                assert [(m["status"], m["method"], m["path"]) for m in mine] == [(405, method, path)], (where, lines)
        assert await gw.received() == []


@pytest.mark.parametrize("cors", CORS, ids=["cors_off", "cors_on"])
@on_both_loops
async def test_an_unknown_path_is_a_404_with_a_log_line(cors):
    async with edge_gateway(**_server(cors)) as gw:
        for method, path in (("GET", "/nope"), ("POST", "/v1/nope"), ("DELETE", "/v1/chat"), ("OPTIONS", "/nope")):
            body = BODY if method == "POST" else None
            for headers in ({}, {"Origin": ORIGIN}) if cors else ({},):
                where = (method, path, headers)
                with _lines(gw) as lines:
                    ex = await exchange(gw.port, request(method, path, body, headers) + HEALTH, wait=8.0,
                                        until_close=False, responses=2)
                assert_openai_error(ex.first, 404)
                assert [r.status for r in ex.responses] == [404, 200] and not ex.closed, (where, ex.responses)
                rid = ex.first.headers["request-id"]
                mine = [line for line in lines if line["request_id"] == rid]
                assert [(m["status"], m["method"], m["path"], m["error_class"]) for m in mine] == [
                    (404, method, path, "http")], (where, lines)
        assert await gw.received() == []


@pytest.mark.parametrize("cors", CORS, ids=["cors_off", "cors_on"])
@on_both_loops
async def test_head_on_a_path_that_serves_no_get_is_a_405_without_a_body(cors):
    """HEAD's answer has no content (RFC 9110 §9.3.2): the next answer on the connection starts right
    after its head."""
    async with edge_gateway(**_server(cors)) as gw:
        for path, allowed in (("/v1/chat/completions", {"POST"}), ("/v1/responses/resp_1/cancel", {"POST"})):
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            try:
                writer.write(request("HEAD", path) + HEALTH)
                data = b""
                async with asyncio.timeout(8.0):
                    while data.count(b"HTTP/1.1 ") < 2 or not data.endswith(b'{"status":"ok"}'):
                        chunk = await reader.read(65536)
                        assert chunk, data
                        data += chunk
            finally:
                writer.close()
            head, _, rest = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 405 "), head
            fields = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:])
            assert {m.strip() for m in fields["Allow"].split(",")} == allowed, fields
            assert rest.startswith(b"HTTP/1.1 200 "), rest


@on_both_loops
async def test_a_method_that_is_no_token_or_a_line_that_is_no_request_line_is_a_400():
    async with edge_gateway(max_body_bytes=4096) as gw:
        for line in (b"G@T /v1/models HTTP/1.1", b"GE(T /v1/models HTTP/1.1", b"\x16\x03\x01 /v1/models HTTP/1.1",
                     b"/v1/models HTTP/1.1", b"NOT HTTP AT ALL", b"FOO /v1/models HTTP/1.1 more",
                     b"FOO /v1/models", b"FOO  /v1/models HTTP/1.1"):
            ex = await exchange(gw.port, line + b"\r\nHost: gateway.test\r\n\r\n", wait=8.0)
            err = assert_openai_error(ex.first, 400)
            assert err["code"] == "bad_request", (line, err)
            assert ex.closed, line


# (path, its status, its Allow): paths outside the API
ELSEWHERE = [("/status", 405, {"GET", "HEAD"}), ("/metrics", 405, {"GET", "HEAD"}), ("/health", 405, {"GET", "HEAD"}),
             ("/nope", 404, None)]


@on_both_loops
async def test_a_preflight_to_a_path_outside_the_api_gets_that_path_s_answer_without_cors_headers():
    """CORS lets pages call the API (docs/apis.md, Browsers): a preflight to another path is answered as
    the path deserves, a 405 naming its methods or a 404, with no CORS header, so the browser keeps the
    page from calling it; it is counted and logged as a preflight refused, and the connection serves on.
    A plain OPTIONS there is the same answer, logged without ``cors``."""
    async with edge_gateway(**_server(True)) as gw:
        def refused() -> float:
            return gw.samples().get("switchyard_cors_requests_total{outcome=preflight_refused}", 0.0)

        for path, status, allow in ELSEWHERE:
            for origin in (ORIGIN, "https://other.example", None):
                headers = {} if origin is None else {"Origin": origin, "Access-Control-Request-Method": "GET"}
                where = (path, origin)
                before = refused()
                with _lines(gw) as lines:
                    ex = await exchange(gw.port, request("OPTIONS", path, headers=headers) + HEALTH, wait=8.0,
                                        until_close=False, responses=2)
                r = ex.first
                assert_openai_error(r, status)
                assert [x.status for x in ex.responses] == [status, 200] and not ex.closed, (where, ex.responses)
                assert not [k for k in r.headers if k.startswith("access-control-")], (where, r.headers)
                assert "origin" in r.headers.get("vary", "").lower(), (where, r.headers)
                if allow is not None:
                    assert {m.strip() for m in r.headers["allow"].split(",")} == allow, (where, r.headers)
                mine = [line for line in lines if line["request_id"] == r.headers["request-id"]]
                assert len(mine) == 1, (where, lines)
                line = mine[0]
                assert (line["method"], line["path"], line["status"]) == ("OPTIONS", path, status), line
                assert line.get("cors") == (None if origin is None else "preflight_refused"), line
                assert refused() == before + (origin is not None), where
