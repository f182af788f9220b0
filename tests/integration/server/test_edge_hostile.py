"""Hostile clients on a raw socket, against a real gateway and a simulated engine on loopback.

For each classic case: the client gets an answer in OpenAI shape with a ``request-id``, or a
clean close where HTTP allows nothing else; nothing reaches the engine that the client did not
send as one valid request (the engine's ``/_sim/state`` lists what it received); and no header,
target or body field makes the gateway connect anywhere outside its pool. Every test runs on the
default event loop and on uvloop.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging

import orjson
import pytest
from aiohttp import web

from gateway.server.edge import CHUNK_FRAMING_SLACK, EdgeProtocol
from tests.support.edge import assert_openai_error, edge_gateway, exchange, parse_responses, request
from tests.support.fake_engine import fake_engine
from tests.support.loops import on_both_loops
from tests.support.waiting import wait_for

CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
H = b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: gateway.test\r\nContent-Type: application/json\r\n"
SMUGGLED = request("POST", CHAT, BODY)


def chunked(body: bytes) -> bytes:
    return b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"


# (case, bytes sent as separate writes, expected status, valid requests the engine must receive)
CASES = [
    # request smuggling: framing that two parsers could read differently is refused outright
    ("cl_and_te", [H + b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + SMUGGLED], 400, 0),
    ("te_and_cl", [H + b"Transfer-Encoding: chunked\r\nContent-Length: 40\r\n\r\n0\r\n\r\n" + SMUGGLED], 400, 0),
    ("te_chunked_twice", [H + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n"
                          + chunked(BODY)], 400, 0),
    ("te_obfuscated", [H + b"Transfer-Encoding: xchunked\r\n\r\n" + chunked(BODY)], 400, 0),
    ("te_not_last", [H + b"Transfer-Encoding: chunked, identity\r\n\r\n" + chunked(BODY)], 400, 0),
    ("te_space_before_colon", [H + b"Transfer-Encoding : chunked\r\n\r\n" + chunked(BODY)], 400, 0),
    # a transfer coding before chunked that the gateway does not apply (RFC 9112 §6.1: 501): never
    # served as if the body had none of it
    ("te_gzip_chunked", [H + b"Transfer-Encoding: gzip, chunked\r\n\r\n" + chunked(gzip.compress(BODY))], 501, 0),
    ("te_unknown_chunked", [H + b"Transfer-Encoding: x-foo, chunked\r\n\r\n" + chunked(BODY)], 501, 0),
    ("double_content_length", [H + b"Content-Length: %d\r\nContent-Length: 5\r\n\r\n" % len(BODY) + BODY], 400, 0),
    ("double_content_length_equal",
     [H + b"Content-Length: %d\r\nContent-Length: %d\r\n\r\n" % (len(BODY), len(BODY)) + BODY], 400, 0),
    ("negative_content_length", [H + b"Content-Length: -1\r\n\r\n" + BODY], 400, 0),
    ("plus_content_length", [H + b"Content-Length: +%d\r\n\r\n" % len(BODY) + BODY], 400, 0),
    ("hex_content_length", [H + b"Content-Length: 0x10\r\n\r\n" + BODY], 400, 0),
    ("huge_content_length", [H + b"Content-Length: 99999999999999999999999\r\n\r\n" + BODY], 400, 0),
    # zeros before a small length, more digits than int() converts: the lane's head and aiohttp's
    ("content_length_of_4400_digits", [H + b"Content-Length: " + b"0" * 4400 + b"%d\r\n\r\n" % len(BODY) + BODY],
     400, 0),
    ("content_length_of_4400_digits_with_a_query",
     [H.replace(b" HTTP/1.1", b"?x=1 HTTP/1.1") + b"Content-Length: " + b"0" * 4400 + b"%d\r\n\r\n" % len(BODY)
      + BODY], 400, 0),
    # chunked bodies that break
    ("bad_chunk_size", [H + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + BODY + b"\r\n0\r\n\r\n"], 400, 0),
    ("bad_chunk_size_later", [H + b"Transfer-Encoding: chunked\r\n\r\n", b"4\r\n{\"mo\r\n", b"-1\r\nxx\r\n"], 400, 0),
    ("overflowing_chunk_size", [H + b"Transfer-Encoding: chunked\r\n\r\nfffffffffffffffffffff\r\nx\r\n"], 400, 0),
    ("chunk_longer_than_size", [H + b"Transfer-Encoding: chunked\r\n\r\n2\r\n" + BODY + b"\r\n0\r\n\r\n"], 400, 0),
    ("undecodable_gzip_body", [H + b"Content-Encoding: gzip\r\nContent-Length: 10\r\n\r\n0123456789"], 400, 0),
    ("undecodable_gzip_body_later", [H + b"Content-Encoding: gzip\r\nContent-Length: 10\r\n\r\n", b"0123456789"],
     400, 0),
    # not a request this gateway serves
    ("connect", [b"CONNECT evil.example:443 HTTP/1.1\r\nHost: evil.example:443\r\n\r\n"], 405, 0),
    ("trace", [b"TRACE / HTTP/1.1\r\nHost: gateway.test\r\n\r\n"], 404, 0),
    ("unknown_path", [request("POST", "/v1/nope", BODY)], 404, 0),
    ("wrong_method", [request("DELETE", CHAT)], 405, 0),
    ("malformed_request_line", [b"GARBAGE\r\n\r\n"], 400, 0),
    ("request_line_without_version", [b"POST " + CHAT.encode() + b"\r\nHost: x\r\n\r\n"], 400, 0),
    ("bad_http_version", [b"GET /health HTTP/7.0\r\nHost: x\r\n\r\n"], 400, 0),
    # versions the parser takes but HTTP/1.x framing does not: never served, whatever the body
    ("http_2_0_request_line", [H.replace(b"HTTP/1.1", b"HTTP/2.0") + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY],
     400, 0),
    ("http_0_9_request_line", [H.replace(b"HTTP/1.1", b"HTTP/0.9") + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY],
     400, 0),
    ("request_line_without_version_with_a_body",
     [H.replace(b" HTTP/1.1", b"") + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY], 400, 0),
    ("http_2_0_get", [b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n"], 400, 0),
    ("bare_lf_line_endings", [b"GET /health HTTP/1.1\nHost: x\n\n"], 400, 0),
    ("tls_client_hello", [b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(40)], 400, 0),
    ("http2_preface", [b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"], 400, 0),
    ("missing_host", [b"GET /health HTTP/1.1\r\n\r\n"], 400, 0),
    ("two_hosts", [b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"], 400, 0),
    ("nul_in_header", [b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n"], 400, 0),
    ("obsolete_line_folding", [b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n"], 400, 0),
    # sizes
    ("header_60kb", [request("POST", CHAT, BODY, {"X-Big": "a" * 60_000})], 431, 0),
    ("headers_300", [request("POST", CHAT, BODY, {f"X-H{i}": "v" for i in range(300)})], 431, 0),
    ("routing_strategy_10000_items",
     [request("POST", CHAT, BODY, {"routing-strategy": ",".join(["random"] * 10_000)})], 431, 0),
    # RFC 9112 §3: a request-target longer than the server parses MUST get a 414, not a header's 431
    ("url_20kb", [request("GET", "/health?" + "a" * 20_000)], 414, 0),
    ("url_20kb_post", [request("POST", CHAT + "?" + "a" * 20_000, BODY)], 414, 0),
    ("url_1kb_then_header_60kb", [request("POST", CHAT + "?" + "a" * 1000, BODY, {"X-Big": "a" * 60_000})], 431, 0),
    ("body_over_max_by_length", [H + b"Content-Length: 5000\r\n\r\n" + b"x" * 5000], 413, 0),
    ("body_over_max_length_only", [H + b"Content-Length: 5000000000\r\n\r\n"], 413, 0),
    ("body_over_max_chunked", [H + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(b" " * 5000)], 413, 0),
    ("gzip_bomb", [H + b"Content-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n"
                   + chunked(gzip.compress(b" " * 2_000_000))], 413, 0),
]


# answered by the app with the connection kept (the body, if any, was read to its end)
KEPT_ALIVE = {"trace", "unknown_path", "wrong_method", "body_over_max_chunked", "gzip_bomb"}


# the gateway every case meets: a small body limit, patient enough timeouts for the cases that
# are not about time (bodies over the limit are lingered on until body_timeout_s)
SERVER = {"max_body_bytes": 4096, "keepalive_timeout_s": 30.0, "header_timeout_s": 2.0, "body_timeout_s": 1.0}


@pytest.mark.parametrize("case,parts,status,reach", CASES, ids=[c[0] for c in CASES])
@on_both_loops
async def test_hostile_request_gets_a_shaped_answer_and_reaches_no_engine(case, parts, status, reach):
    async with edge_gateway(**SERVER) as gw:
        # framing errors, and the edge's refusals, end the connection; answers of the app keep it
        closes = case not in KEPT_ALIVE
        ex = await exchange(gw.port, *parts, wait=8.0, until_close=closes, responses=1)
        err = assert_openai_error(ex.first, status)
        assert ex.first.headers.get("x-request-id") == ex.first.headers["request-id"]
        # RFC 9110 §6.2: the server's own version, whatever the client's head was (none of these is HTTP/1.0)
        assert ex.first.version == "HTTP/1.1", f"{case}: answered as {ex.first.version}"
        if status == 431:
            assert err["code"] in ("header_too_large", "too_many_headers")
        if status == 414:
            assert err["code"] == "uri_too_long" and "server.max_header_bytes" in err["message"], err
        if closes:
            assert ex.closed, f"{case}: the connection stays open after a framing error"
            assert len(ex.responses) == 1 and not ex.trailing, f"{case}: more than one answer: {ex.responses[1:]}"
        got = await gw.received()
        assert len(got) == reach and all(r["json_object"] for r in got), got


@pytest.mark.parametrize("head,status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", 400),
    (b"GET /health HTTP/1.0\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", 400),     # RFC 9112 §2.3 allows 1.1 to 1.0
    (request("POST", CHAT, BODY, {"X-Big": "a" * 60_000}), 431),
    (request("POST", CHAT, BODY, {f"X-H{i}": "v" for i in range(300)}), 431),
], ids=["malformed_line", "nul_in_header", "http10_nul_in_header", "header_60kb", "headers_300"])
@on_both_loops
async def test_a_head_the_parser_refuses_is_answered_in_http11_and_closed(head, status):
    """RFC 9110 §6.2: a server sends the highest version it conforms to; a head the parser could
    not read has no version of its own to answer in."""
    async with edge_gateway(**SERVER) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        try:
            writer.write(head)
            async with asyncio.timeout(8.0):
                raw = await reader.read()           # to EOF: the edge closes after the answer
        finally:
            writer.close()
        assert raw.startswith(b"HTTP/1.1 %d " % status), raw[:80]
        assert b"\r\nConnection: close\r\n" in raw[:raw.index(b"\r\n\r\n") + 2], raw[:400]


@on_both_loops
async def test_error_answer_keeps_the_clients_request_id():
    async with edge_gateway(**SERVER) as gw:
        ex = await exchange(gw.port, H + b"x-request-id: my-req-42\r\nTransfer-Encoding: chunked\r\n\r\n",
                            b"4\r\n{\"mo\r\n", b"zz\r\n")
        assert_openai_error(ex.first, 400)
        assert ex.first.headers["request-id"] == "my-req-42"


@on_both_loops
async def test_an_x_request_id_sent_twice_with_two_values_is_not_taken():
    """Two x-request-id lines giving different ids name no one id: the answer carries a fresh one,
    as for an id the gateway cannot keep, rather than the first line's (a proxy's line and a
    client's disagreeing), on the fast lane and off it, on an inference path, the gateway's own
    paths and its error answers; the same id twice is the client's id."""
    async with edge_gateway(**SERVER) as gw:
        def twice(method: str, target: str, body: bytes | None, first: str, second: str) -> bytes:
            raw = request(method, target, body)
            return raw.replace(b"\r\n\r\n", f"\r\nx-request-id: {first}\r\nX-Request-Id: {second}\r\n\r\n".encode(), 1)

        for method, target, body, status in (("POST", CHAT, BODY, 200), ("POST", CHAT + "?x=1", BODY, 200),
                                             ("GET", "/health", None, 200), ("POST", "/v1/nope", b"{}", 404)):
            ex = await exchange(gw.port, twice(method, target, body, "req-a", "req-b"), until_close=False,
                                responses=1)
            assert ex.first.status == status, (target, ex.first.body[:200])
            rid = ex.first.headers["request-id"]
            assert rid not in ("req-a", "req-b") and len(rid) == 32, (target, rid)
            assert ex.first.headers["x-request-id"] == rid
            ex = await exchange(gw.port, twice(method, target, body, "req-a", "req-a"), until_close=False,
                                responses=1)
            assert ex.first.status == status and ex.first.headers["request-id"] == "req-a", target


@on_both_loops
async def test_pipelined_requests_are_answered_in_order():
    async with edge_gateway(**SERVER) as gw:
        other = orjson.dumps({"model": "m", "prompt": "x", "max_tokens": 1})
        ex = await exchange(gw.port, request("GET", "/health") + request("POST", CHAT, BODY)
                            + request("POST", "/v1/nope", b"{}") + request("POST", "/v1/completions", other)
                            + request("GET", "/v1/models", close=True))
        assert [r.status for r in ex.responses] == [200, 200, 404, 200, 200]
        assert ex.responses[1].json()["object"] == "chat.completion"
        assert_openai_error(ex.responses[2], 404)
        assert ex.closed and not ex.trailing
        got = await gw.received()
        assert [r["path"] for r in got] == [CHAT, "/v1/completions"] and all(r["json_object"] for r in got)


@on_both_loops
async def test_requests_before_a_broken_one_in_the_same_read_are_answered_off_the_fast_lane_too():
    """Requests the HTTP parser reads (a GET, an inference path with a query string, which the
    fast lane leaves to it) followed in the same write by a broken one: each is answered, then the
    broken one gets its 400 and the connection ends; nothing behind it runs. The client never reads
    the broken request's answer as its first request's."""
    chat_q = CHAT + "?x=1"
    smuggling = H + b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + SMUGGLED
    async with edge_gateway(**SERVER) as gw:
        exchanges = await asyncio.gather(
            exchange(gw.port, request("GET", "/health") + b"NOT HTTP AT ALL\r\n\r\n"),
            exchange(gw.port, request("GET", "/health") + request("GET", "/v1/models") + smuggling),
            exchange(gw.port, request("POST", chat_q, BODY) + smuggling),
            exchange(gw.port, request("POST", chat_q, BODY) + b"GARBAGE-AFTER-THE-BODY"))
        want = [[200, 400], [200, 200, 400], [200, 400], [200, 400]]
        assert [[r.status for r in ex.responses] for ex in exchanges] == want, \
            [[r.body[:120] for r in ex.responses] for ex in exchanges]
        for ex in exchanges:
            assert ex.closed and not ex.trailing
            assert_openai_error(ex.responses[-1], 400)
        got = await gw.received()
        assert [r["path"] for r in got] == [CHAT, CHAT] and all(r["json_object"] for r in got)


@on_both_loops
async def test_pipelined_request_behind_a_broken_one_is_never_run():
    async with edge_gateway(**SERVER) as gw:
        ex = await exchange(gw.port, H + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}" + SMUGGLED)
        assert_openai_error(ex.first, 400)
        assert len(ex.responses) == 1 and ex.closed
        assert await gw.received() == []


@on_both_loops
async def test_a_body_still_coming_after_its_answer_is_never_run_as_a_request_with_the_body_clocks_off():
    """A POST answered at its head (a 404) leaves its declared body to be read and dropped; with
    both body timeouts off that body is still the request's, not a next request for the fast lane."""
    async with edge_gateway(**{**SERVER, "body_timeout_s": 0, "body_total_timeout_s": 0}) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        try:
            writer.write(b"POST /v1/nope HTTP/1.1\r\nHost: gateway.test\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(SMUGGLED))
            data = b""
            while not parse_responses(data, eof=False)[0]:      # the 404 is out before its body comes
                chunk = await asyncio.wait_for(reader.read(65536), 10.0)
                assert chunk, "closed before the 404"
                data += chunk
            writer.write(SMUGGLED)                              # the declared body: a whole chat request
            await writer.drain()
            writer.write(request("GET", "/health", close=True))
            while chunk := await asyncio.wait_for(reader.read(65536), 10.0):
                data += chunk
        finally:
            writer.close()
        got, rest = parse_responses(data, eof=True)
        assert [r.status for r in got] == [404, 200] and not rest, [(r.status, r.body[:80]) for r in got]
        assert_openai_error(got[0], 404)
        assert await gw.received() == []


@on_both_loops
async def test_an_http10_request_with_transfer_encoding_is_answered_and_its_connection_closed():
    """RFC 9112 §6.1: HTTP/1.0 with Transfer-Encoding is faulty framing (an HTTP/1.0 hop may have
    read the body otherwise): served, then closed, whatever Connection asked; nothing behind it runs."""
    async with edge_gateway(**SERVER) as gw:
        head = (b"POST " + CHAT.encode() + b" HTTP/1.0\r\nHost: gateway.test\r\nContent-Type: application/json\r\n"
                b"Connection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n")
        ex = await exchange(gw.port, head + chunked(BODY) + SMUGGLED, wait=5.0)
        assert [r.status for r in ex.responses] == [200] and ex.closed and not ex.trailing
        assert "keep-alive" not in ex.first.headers.get("connection", "").lower()
        assert len(await gw.received()) == 1


# a stream asked in HTTP/1.0 has no chunked framing: its end is the end of the connection
HTTP10_STREAMS = [
    (CHAT, {"messages": [{"role": "user", "content": "hi"}]}, b"data: [DONE]"),
    ("/v1/completions", {"prompt": "hi"}, b"data: [DONE]"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}, b"event: message_stop"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}, b"event: response.completed"),
]


@on_both_loops
async def test_a_stream_asked_in_http10_ends_with_its_connection_even_when_kept_alive_was_asked():
    """HTTP/1.0 has no chunked coding: a stream's answer has no length and ends where the connection
    does (RFC 1945 §7.2.2), ``Connection: keep-alive`` or not."""
    async with edge_gateway(**SERVER) as gw:
        for path, fields, last in HTTP10_STREAMS:
            for keep in (b"Connection: keep-alive\r\n", b""):
                body = orjson.dumps({"model": "m", "max_tokens": 2, "stream": True, **fields})
                head = (b"POST " + path.encode() + b" HTTP/1.0\r\nHost: gateway.test\r\nContent-Type: application/json\r\n"
                        + keep + b"Content-Length: %d\r\n\r\n" % len(body))
                ex = await exchange(gw.port, head + body, wait=5.0)
                assert ex.closed, f"{path} {keep!r}: the stream never ends: {ex.trailing[-200:]!r}"
                assert [r.status for r in ex.responses] == [200], (path, keep)
                assert last in ex.first.body, (path, ex.first.body[-300:])
                assert "keep-alive" not in ex.first.headers.get("connection", "").lower()


@on_both_loops
async def test_no_header_target_or_field_makes_the_gateway_connect_outside_its_pool():
    """An absolute-form target naming another host is served by the pool (RFC 9112 §3.2.2: an
    origin server takes the target's host over Host, and this gateway's pool over both)."""
    dialled: list[str] = []

    async def evil(reader, writer):
        dialled.append("connected")
        writer.close()

    server = await asyncio.start_server(evil, "127.0.0.1", 0)
    evil_host = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    evil_port = int(evil_host.split(":")[1])
    try:
        async with edge_gateway(**SERVER) as gw:
            body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                 "base_url": f"http://{evil_host}", "api_base": f"http://{evil_host}/v1",
                                 "url": f"http://{evil_host}", "endpoint": evil_host, "target-pod": evil_host,
                                 "kv_transfer_params": {"remote_host": "127.0.0.1", "remote_port": evil_port},
                                 "bootstrap_host": "127.0.0.1", "bootstrap_port": evil_port})
            hostile_headers = {"Host": evil_host, "X-Forwarded-Host": evil_host, "Forwarded": f"host={evil_host}",
                               "X-Original-URL": f"http://{evil_host}/", "X-Rewrite-URL": f"http://{evil_host}/",
                               "target-pod": evil_host, "x-target-pod": evil_host, "routing-strategy": "random"}
            raw = (f"POST http://{evil_host}{CHAT} HTTP/1.1\r\n".encode()
                   + b"".join(f"{k}: {v}\r\n".encode() for k, v in hostile_headers.items())
                   + b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                   % len(body) + body)
            ex = await exchange(gw.port, raw)
            assert ex.first.status == 200, ex.first.body
            assert ex.first.headers["target-pod"] == gw.sim.url.removeprefix("http://")
            await asyncio.sleep(0.05)
            assert dialled == []
            got = await gw.received()
            assert len(got) == 1 and got[0]["path"] == CHAT and got[0]["json_object"]
            # nor the engine: a NIXL connector would dial the host kv_transfer_params name
            assert "kv_transfer_params" not in got[0]["body"], got[0]["body"]
    finally:
        server.close()
        await server.wait_closed()


@on_both_loops
async def test_protocol_errors_are_counted():
    async with edge_gateway(**SERVER) as gw:
        await exchange(gw.port, b"GARBAGE\r\n\r\n")
        await exchange(gw.port, request("GET", "/health", headers={"X-Big": "a" * 20_000}))
        s = gw.samples()
        assert s["switchyard_client_protocol_errors_total{status=400}"] == 1
        assert s["switchyard_client_protocol_errors_total{status=431}"] == 1


@on_both_loops
async def test_a_model_name_cannot_inject_or_break_response_headers():
    """The model name is echoed in ``x-error-no-model-backends``: control characters must neither
    split the header nor make the writer refuse it (which would drop the connection unanswered)."""
    async with edge_gateway(**SERVER) as gw:
        for model in ("m\r\nx-injected: 1", "\u0000", "\x7f\u202e"):
            body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
            ex = await exchange(gw.port, request("POST", CHAT, body, close=True))
            assert_openai_error(ex.first, 404)
            assert "x-injected" not in ex.first.headers
            assert all(k.isascii() and "\r" not in v and "\n" not in v for k, v in ex.first.raw_headers)


@on_both_loops
async def test_a_gzip_encoded_body_reaches_the_engine_decoded():
    async with edge_gateway(**SERVER) as gw:
        ex = await exchange(gw.port, request("POST", CHAT, gzip.compress(BODY), {"Content-Encoding": "gzip"},
                                             close=True))
        assert ex.first.status == 200, ex.first.body
        got = await gw.received()
        assert len(got) == 1 and got[0]["json_object"]


@on_both_loops
async def test_expect_100_continue_on_an_inference_path_gets_the_interim_answer_first():
    """Inference paths are handed to their handler by the edge, without the application; a client
    that waits for ``100 Continue`` before sending its body still gets it (curl does this)."""
    async with edge_gateway(**SERVER) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        try:
            head = request("POST", CHAT, b"", {"Content-Length": str(len(BODY)), "Expect": "100-continue"},
                           close=True)
            writer.write(head)
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert interim.startswith(b"HTTP/1.1 100 Continue"), interim
            writer.write(BODY)
            rest = await asyncio.wait_for(reader.read(), 10)
        finally:
            writer.close()
        assert rest.startswith(b"HTTP/1.1 200 "), rest[:200]
        assert b'"chat.completion"' in rest


@on_both_loops
async def test_an_expectation_other_than_100_continue_is_a_shaped_417():
    async with edge_gateway(**SERVER) as gw:
        ex = await exchange(gw.port, request("POST", CHAT, BODY, {"Expect": "200-ok"}, close=True))
        err = assert_openai_error(ex.first, 417)
        assert err["code"] == "expectation_failed" and err["param"] == "Expect"


@on_both_loops
async def test_an_expectation_other_than_100_continue_is_a_shaped_417_on_every_path():
    """aiohttp answers an unknown expectation itself, before the application's middleware, in
    plain text and without a request id; every path's answer is the inference paths' 417 (Anthropic's
    shape on a Messages path), the connection closed after it, as a body may follow unread."""
    async with edge_gateway(cors_allowed_origins=["https://app.example.com"], **SERVER) as gw:
        for method, target in (("GET", "/health"), ("GET", "/ready"), ("GET", "/metrics"), ("GET", "/v1/models"),
                               ("GET", "/v1/models/m"), ("GET", "/status.json"), ("GET", "/status"),
                               ("GET", "/nothing"), ("DELETE", "/health"), ("POST", "/v1/models"),
                               ("GET", "/v1/responses/resp_1"), ("POST", CHAT + "?x=1")):
            body = BODY if method == "POST" else None
            for headers in ({"Expect": "200-ok"}, {"Expect": "200-ok", "Origin": "https://app.example.com"}):
                ex = await exchange(gw.port, request(method, target, body, headers))
                err = assert_openai_error(ex.first, 417)
                assert (err["code"], err["param"]) == ("expectation_failed", "Expect"), (method, target, err)
                assert "200-ok" in err["message"] and ex.closed, (method, target)
            # a page's answer carries CORS's headers as every other answer to it on an API path; a
            # path outside the API (the gateway's own pages, an unknown path) has Vary: Origin alone
            api = target.startswith("/v1/")
            assert ex.first.headers.get("access-control-allow-origin") == (
                "https://app.example.com" if api else None), (target, ex.first.headers)
            assert "Origin" in ex.first.headers.get("vary", ""), (target, ex.first.headers)
        ex = await exchange(gw.port, request("GET", "/v1/messages/batches", None, {"Expect": "teapot"}))
        assert ex.first.status == 417 and ex.first.headers["request-id"]
        assert ex.first.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                               "message": ex.first.json()["error"]["message"]}}
        # 100-continue is still served as before (the interim answer, then the request's)
        ex = await exchange(gw.port, request("GET", "/health", None, {"Expect": "100-continue"}, close=True))
        assert [r.status for r in ex.responses] == [200], ex.responses
        assert ex.first.json() == {"status": "ok"}
        assert await gw.received() == []


H2C = {"Connection": "Upgrade, HTTP2-Settings", "Upgrade": "h2c", "HTTP2-Settings": "AAMAAABkAAQCAAAAAAIAAAAA"}


@on_both_loops
async def test_a_request_pipelined_behind_an_upgrade_the_gateway_declines_is_not_left_hanging():
    """The gateway switches to no other protocol: a request asking for one (``Upgrade: h2c``, as
    ``curl --http2`` sends over cleartext) is answered in HTTP/1.1 (RFC 9110 §7.8 lets a server
    ignore the header). aiohttp's parser dropped the bytes that came behind it in the same read, so
    a request pipelined there was never answered and the connection sat until keepalive_timeout_s;
    the answer now closes the connection, which tells the client to send that request again
    (RFC 9112 §9.3.2). A request sent after the answer is served on the connection as before."""
    async with edge_gateway(**SERVER) as gw:
        behind = request("GET", "/health", None, close=True)
        for first in (request("GET", "/health", None, H2C), request("GET", "/v1/models", None, H2C),
                      request("POST", CHAT, BODY, H2C), request("POST", CHAT, BODY, {**H2C, "Upgrade": "foo/1"})):
            ex = await exchange(gw.port, first + behind, wait=5.0)
            assert ex.closed, (first, ex.responses)
            assert [r.status for r in ex.responses] in ([200], [200, 200]), ex.responses
            if len(ex.responses) == 1:
                assert ex.first.headers.get("connection", "").lower() == "close", ex.first.headers
        # the next request on the connection, sent once the answer came: served there
        ex = await exchange(gw.port, request("GET", "/health", None, H2C), behind, pause=0.2, wait=5.0)
        assert [r.status for r in ex.responses] in ([200], [200, 200]) and ex.closed, ex.responses
        # a declined websocket upgrade, which aiohttp parses on from, keeps the connection as before
        ex = await exchange(gw.port, request("GET", "/health", None, {"Connection": "Upgrade", "Upgrade": "websocket"})
                            + behind, wait=5.0)
        assert [r.status for r in ex.responses] == [200, 200] and ex.closed, ex.responses
        assert len(await gw.received()) == 2          # the two chat requests, each once


def _edge_connections_served() -> list[asyncio.Task]:
    """The gateway's connection tasks still running (aiohttp's ``RequestHandler.start`` of an
    ``EdgeProtocol``; the engine's own connections aside)."""
    out = []
    for t in asyncio.all_tasks():
        frame = getattr(t.get_coro(), "cr_frame", None)
        if frame is not None and isinstance(frame.f_locals.get("self"), EdgeProtocol):
            out.append(t)
    return out


@on_both_loops
async def test_a_body_that_breaks_while_an_early_answer_drains_it_logs_no_traceback(caplog):
    """A request answered before its body was read (a 405, a 404) has the rest of its body read
    and dropped; a chunked body whose framing breaks meanwhile closes the connection. aiohttp,
    still dropping what had come, then met the closed connection and logged "Unhandled exception"
    with a traceback (on stderr in plain text, whatever server.log_format says), for any client
    that cares to send that."""
    head = b"POST /health HTTP/1.1\r\nHost: gateway.test\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"
    async with edge_gateway(**{**SERVER, "max_body_bytes": 1 << 20}) as gw:
        with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
            for path in (b"/health", b"/nothing"):
                reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
                try:
                    writer.write(head.replace(b"/health", path))
                    answer = await asyncio.wait_for(reader.readuntil(b"}}"), 10)    # the whole error body
                    assert answer.startswith((b"HTTP/1.1 405 ", b"HTTP/1.1 404 ")), answer
                    writer.write(b"5\r\nhello\r\n" * 1000 + b"zz\r\n")
                    assert await asyncio.wait_for(reader.read(), 10) == b""         # closed
                finally:
                    writer.close()
                assert await wait_for(lambda: not _edge_connections_served(), timeout=10.0, interval=0.01)
        errors = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("aiohttp")]
        assert errors == [], [(r.getMessage(), r.exc_info) for r in errors]
        assert await gw.received() == []


@on_both_loops
async def test_header_bytes_that_are_not_utf8_are_quoted_in_a_shaped_error():
    """aiohttp reads a header's bytes that are not UTF-8 as lone surrogates; an error quoting
    them (an unknown routing strategy) is still written, with the bytes escaped, not a 500; the
    header that echoes the value has the bytes the client sent, percent-encoded (not the UTF-8 of
    the surrogates that stood for them, bytes it never sent)."""
    async with edge_gateway(**SERVER) as gw:
        body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        ex = await exchange(gw.port, request("POST", "/v1/chat/completions", body,
                                             {"routing-strategy": "least-\udcff\udcfe"}),
                            responses=1, until_close=False)
        err = assert_openai_error(ex.first, 400)
        assert "\\xff\\xfe" in err["message"]
        assert ex.first.headers["routing-strategy"] == "least-%FF%FE"


@on_both_loops
async def test_options_asterisk_is_answered_with_the_methods_served_and_the_connection_kept():
    """RFC 9110 §9.3.7: ``OPTIONS *`` asks about the server, not a resource; it is answered 200 with
    the methods the gateway's routes serve, and the next request on the connection is served."""
    async with edge_gateway(**SERVER) as gw:
        ex = await exchange(gw.port, request("OPTIONS", "*"), request("POST", CHAT, BODY),
                            request("OPTIONS", "*") + request("GET", "/v1/models", close=True))
        assert [r.status for r in ex.responses] == [200, 200, 200, 200], [(r.status, r.body[:80]) for r in ex.responses]
        for answer in (ex.responses[0], ex.responses[2]):
            assert {m.strip() for m in answer.headers["allow"].split(",")} == {"GET", "HEAD", "POST", "DELETE", "OPTIONS"}
            assert answer.headers["content-length"] == "0" and answer.body == b""
            assert answer.headers["request-id"]
        assert ex.responses[1].json()["object"] == "chat.completion"
        assert ex.responses[3].json()["object"] == "list"
        assert ex.closed and not ex.trailing


@on_both_loops
async def test_connect_is_refused_with_the_methods_served():
    """A 405 names the methods the target serves (RFC 9110 §15.5.6): a CONNECT's Allow is the
    server's, as an ``OPTIONS *`` gives it, not two of them."""
    async with edge_gateway(**SERVER) as gw:
        asked = await exchange(gw.port, request("OPTIONS", "*", close=True), until_close=True)
        refused = await exchange(gw.port, b"CONNECT evil.example:443 HTTP/1.1\r\nHost: evil.example:443\r\n\r\n",
                                 wait=8.0, until_close=True, responses=1)
        assert_openai_error(refused.first, 405)
        assert refused.first.headers["allow"] == asked.first.headers["allow"]
        assert "DELETE" in refused.first.headers["allow"]


@pytest.mark.parametrize("path", [CHAT, "/v1/messages"])
@on_both_loops
async def test_a_body_refused_by_its_length_gets_its_413_and_the_connection_ends_at_once(path):
    """A ``Content-Length`` over ``server.max_body_bytes`` is answered 413 with ``Connection:
    close`` before a byte of the body is read. The client then sees the end of the connection right
    after the answer, whether it sends nothing more (a client that waits for an interim answer) or
    goes on writing the body (drained meanwhile, so no reset destroys the answer it has not read),
    not when the gateway's read of the body that never comes gives up (10 s) or the body clock
    (30 s here) fires; and the connection is released once the client closes its side."""
    async with edge_gateway(**{**SERVER, "body_timeout_s": 30.0}) as gw:
        head = (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: gateway.test\r\nContent-Type: application/json\r\n"
                b"Content-Length: 5000\r\n\r\n")
        for body in (b"", b"x" * 1000):
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            try:
                writer.write(head + body)
                data = b""
                async with asyncio.timeout(5.0):        # milliseconds when it works; 10 s and more before
                    while chunk := await reader.read(65536):
                        data += chunk
                writer.write(b"x" * (5000 - len(body)))     # the rest of the body, after the end: drained
                await writer.drain()
            finally:
                writer.close()
            got, rest = parse_responses(data, eof=True)
            assert [r.status for r in got] == [413] and not rest, data[:200]
            assert got[0].headers["connection"].lower() == "close"
            assert got[0].json()["error"]["type"] == ("request_too_large" if path != CHAT else "invalid_request_error")
            assert await wait_for(lambda: gw.connections() == 0, timeout=5.0, interval=0.01)
        assert await gw.received() == []


# Host field values that are no host[:port] (RFC 3986's reg-name, IPv4 or IP literal, then a port)
BAD_HOSTS = {"empty": "", "space": "gateway .test", "tab": "gateway\t.test", "userinfo": "user@gateway.test",
             "path": "gateway.test/v1", "letters_as_port": "gateway.test:http", "unclosed_literal": "[::1",
             "non_ascii": "g\u00e4teway.test"}


@on_both_loops
async def test_a_host_header_that_is_no_host_is_a_400_on_the_fast_lane_and_off_it():
    """RFC 9112 §3.2: a server MUST answer 400 to a request with more than one Host field line or a
    Host whose value is not valid. The same bytes get the same answer whichever path takes them (the
    fast lane's POST, aiohttp's with a query string, a GET of the application's), in the path's API
    shape, and nothing of such a request reaches the engine; a host, a port, an IP literal are served."""
    async with edge_gateway(**SERVER) as gw:
        def sent(target: str, host: str, method: str = "POST") -> bytes:
            raw = request(method, target, BODY if method == "POST" else None)
            return raw.replace(b"Host: gateway.test\r\n", b"Host: " + host.encode("utf-8") + b"\r\n", 1)

        cases = [(name, target, method) for name in [*BAD_HOSTS, "two"]
                 for target, method in ((CHAT, "POST"), (CHAT + "?x=1", "POST"), ("/v1/models", "GET"),
                                        ("/v1/messages", "POST"))]

        def raw_of(name: str, target: str, method: str) -> bytes:
            if name == "two":
                return sent(target, "gateway.test\r\nHost: other.test", method)
            return sent(target, BAD_HOSTS[name], method)

        exchanges = await asyncio.gather(*(exchange(gw.port, raw_of(*case), wait=8.0) for case in cases))
        for (name, target, _), ex in zip(cases, exchanges, strict=True):
            assert [r.status for r in ex.responses] == [400], \
                (name, target, [(r.status, r.body[:100]) for r in ex.responses])
            assert ex.closed, (name, target)
            if target == "/v1/messages":
                assert ex.first.json()["type"] == "error", (name, ex.first.body)
            else:
                assert_openai_error(ex.first, 400)
        assert await gw.received() == []
        for host in ("gateway.test:8080", "127.0.0.1", "[::1]:8080", "gateway.test.", "my_host-1.internal:",
                     "[fe80::1%25eth0]:8080", "%2Fvar%2Frun%2Fgw.sock"):
            for target in (CHAT, CHAT + "?x=1"):
                raw = sent(target, host).replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
                ex = await exchange(gw.port, raw)
                assert [r.status for r in ex.responses] == [200], (host, target, ex.responses)


FOO = b"FOO /v1/models HTTP/1.1\r\nHost: gateway.test\r\n\r\n"
BROKEN_ON_MESSAGES = (b"POST /v1/messages HTTP/1.1\r\nHost: gateway.test\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1\r\nContent-Length: 2\r\n\r\n")
GARBAGE = b"GARBAGE\r\n\r\n"


def _answers(ex) -> list[tuple[int, object]]:
    """Each answer's status, with an error's whole body, a success's object."""
    return [(r.status, r.body if r.status >= 400 else r.json().get("object")) for r in ex.responses]


@on_both_loops
async def test_a_broken_request_pipelined_behind_a_good_one_gets_the_answers_it_gets_in_a_read_of_its_own():
    """The good request's answer, then the broken one's as it gets it when it comes in a read of its
    own: a method the gateway does not know is the 501 naming it, a broken head on a Messages path is
    a 400 in Anthropic's shape. In the same read as the good one, a GET or a query string (aiohttp's
    path) left the broken one the good one's request line to answer in, and a chunked request was
    not answered at all (the parser drops what it parsed in a read it then refuses); a chunked body
    with a chunk extension and a trailer ends where the parser ends it."""
    te = b"Transfer-Encoding: chunked\r\n\r\n"
    firsts = {"get": request("GET", "/v1/models"), "query": request("POST", CHAT + "?x=1", BODY),
              "lane": request("POST", CHAT, BODY), "chunked": H + te + chunked(BODY),
              "chunked_extension_trailer": H + te + b"%x;name=value\r\n" % len(BODY) + BODY
              + b"\r\n0;last\r\nX-Trailer: 1\r\n\r\n"}
    bads = {"foo": (FOO, 501), "messages": (BROKEN_ON_MESSAGES, 400), "garbage": (GARBAGE, 400)}
    cases = [(f, b) for f in firsts for b in bads]
    async with edge_gateway(**SERVER) as gw:
        one = await asyncio.gather(*(exchange(gw.port, firsts[f] + bads[b][0], wait=8.0) for f, b in cases))
        two = await asyncio.gather(*(exchange(gw.port, firsts[f], bads[b][0], wait=8.0) for f, b in cases))
        for (f, b), ex1, ex2 in zip(cases, one, two, strict=True):
            assert [r.status for r in ex2.responses] == [200, bads[b][1]], (f, b, _answers(ex2))
            assert _answers(ex1) == _answers(ex2), (f, b)
            assert ex1.closed and not ex1.trailing, (f, b)
            if b == "messages":
                assert ex1.responses[1].json()["type"] == "error", (f, ex1.responses[1].body)
            else:
                err = assert_openai_error(ex1.responses[1])
                assert "POST" not in err["message"], (f, b, err)
        got = await gw.received()
        assert len(got) == 2 * len(cases) - 2 * len(bads), len(got)     # every good one but the GET's



@on_both_loops
async def test_a_chunked_body_that_breaks_gets_one_answer_however_its_bytes_are_read():
    """A chunk size or extension that does not parse, in the read that brings the head or in a
    later one (with the end of a good chunk or alone): the same 400 bad_body, naming what broke,
    with the client's request id, in the path's API shape, the connection closed; nothing reaches
    the engine. With the head, the parser's refusal of the whole read was answered as a head it
    could not parse: another message and code, and the client's request id lost."""
    async with edge_gateway(**SERVER) as gw:
        for path in (CHAT, "/v1/messages"):
            head = (f"POST {path} HTTP/1.1\r\nHost: gateway.test\r\nx-request-id: my-req-7\r\n"
                    "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
            size = b"%x\r\n" % len(BODY)
            for bad in (b"zz\r\n", b"-1\r\n", b"1;\x01\r\n"):
                splits = [[head + size + BODY + b"\r\n" + bad], [head, size + BODY + b"\r\n" + bad],
                          [head + size + BODY[:8], BODY[8:] + b"\r\n" + bad], [head + size + BODY + b"\r\n", bad]]
                exs = await asyncio.gather(*(exchange(gw.port, *parts, wait=8.0) for parts in splits))
                for parts, ex in zip(splits, exs, strict=True):
                    assert ex.closed and [r.status for r in ex.responses] == [400], (path, parts, _answers(ex))
                    assert ex.first.headers["request-id"] == "my-req-7", (path, parts, ex.first.headers)
                    if path == CHAT:
                        assert assert_openai_error(ex.first)["code"] == "bad_body", (parts, ex.first.body)
                    else:
                        assert ex.first.json()["type"] == "error", ex.first.body
                assert len({ex.first.body for ex in exs}) == 1, (path, bad, [ex.first.body for ex in exs])
        assert await gw.received() == []


@on_both_loops
async def test_a_field_the_parser_takes_once_sent_twice_gets_the_same_400_on_the_fast_lane_and_off_it():
    """aiohttp's parser refuses a second Content-Type, User-Agent, ETag, Server, Max-Forwards,
    Content-Location or Content-Range (RFC 9110's fields of one value) with a 400; the fast lane,
    which reads the same bytes where they are a plain request, gives that answer too."""
    async with edge_gateway(**SERVER) as gw:
        for field in ("Content-Type: text/plain", "User-Agent: a", "user-agent: b"):
            raws = [request("POST", target, BODY, {"User-Agent": "x"}).replace(b"\r\n\r\n", b"\r\n" + field.encode()
                                                                                 + b"\r\n\r\n", 1)
                    for target in (CHAT, CHAT + "?x=1")]
            lane_ex, aiohttp_ex = [await exchange(gw.port, raw) for raw in raws]
            assert [r.status for r in aiohttp_ex.responses] == [400] and aiohttp_ex.closed, aiohttp_ex.responses
            assert [(r.status, r.body) for r in lane_ex.responses] == [(r.status, r.body) for r in aiohttp_ex.responses]
            assert lane_ex.closed, field
        assert await gw.received() == []


@on_both_loops
async def test_an_empty_line_after_a_request_lends_nothing_to_the_next_heads_answer():
    """An empty line after a request in its read (RFC 9112 §2.2: ignored), then a head the parser
    refuses in a later read: its answer is the one it gets alone, a 501 naming an unknown method."""
    async with edge_gateway(**SERVER) as gw:
        for first in (request("GET", "/v1/models"), request("POST", CHAT + "?x=1", BODY)):
            ex = await exchange(gw.port, first + b"\r\n", FOO, wait=8.0)
            assert [r.status for r in ex.responses] == [200, 501], _answers(ex)
            assert "FOO" in assert_openai_error(ex.responses[1])["message"]


@on_both_loops
async def test_empty_lines_before_a_head_the_parser_refuses_lend_nothing_to_its_answer():
    """Empty lines before a request line (RFC 9112 §2.2: ignored) in the read that brings it, on a
    fresh connection or a kept-alive one: the head's answer is the one it gets without them."""
    async with edge_gateway(**SERVER) as gw:
        for parts in ([b"\r\n" + FOO], [b"\r\n\r\n" + FOO], [request("GET", "/v1/models"), b"\r\n" + FOO]):
            ex = await exchange(gw.port, *parts, wait=8.0)
            assert [r.status for r in ex.responses][-1] == 501, (parts, _answers(ex))
        ex = await exchange(gw.port, b"\r\n" + BROKEN_ON_MESSAGES, wait=8.0)
        assert ex.first.status == 400 and ex.first.json()["type"] == "error", ex.first.body


@on_both_loops
async def test_a_chunked_body_whose_framing_outgrows_its_data_is_refused_and_one_in_small_chunks_is_served():
    """RFC 9112 §7.1.1: a server ought to limit the length of the chunk extensions it takes. The
    HTTP parser reads a chunk's size line of any length, so a client could send gigabytes of one
    (no byte of data: no body limit applies) for as long as the body clocks allow. Framing beyond
    ``CHUNK_FRAMING_SLACK`` plus 8 bytes per byte of data is a 400; a body sent a byte per chunk
    (5 bytes of framing each) is served."""
    async with edge_gateway(**SERVER) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        try:
            writer.write(H + b"Transfer-Encoding: chunked\r\n\r\n")
            await writer.drain()
            async with asyncio.timeout(8):      # the handler reads the body: the rest comes as its bytes
                while not any(p._e_phase == 3 for p in gw.runner.server._connections):
                    await asyncio.sleep(0.005)
            # a size line that never ends, cut as its last byte passes the bound (nothing is left
            # unread when the connection closes, so no reset can destroy the answer)
            line = b"10;a=" + b"b" * (CHUNK_FRAMING_SLACK + 1 - 5)
            writer.write(line)
            await writer.drain()
            async with asyncio.timeout(8):
                data = b""
                while chunk := await reader.read(65536):
                    data += chunk
            got, _ = parse_responses(data, eof=True)
            err = assert_openai_error(got[0], 400)
            assert err["code"] == "bad_body" and "chunked framing" in err["message"], err
        finally:
            writer.close()
        small = b"".join(b"1\r\n" + BODY[i:i + 1] + b"\r\n" for i in range(len(BODY))) + b"0\r\n\r\n"
        ex = await exchange(gw.port, H + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n", small)
        assert ex.first.status == 200, ex.first.body
        got = await gw.received()
        assert len(got) == 1 and got[0]["json_object"], got


# refusals that close the connection while the client may still be sending: (case, first bytes, status)
STILL_SENDING = [
    ("chunked_framing_breaks_after_the_body_began", H + b"Transfer-Encoding: chunked\r\n\r\n10\r\n0123456789abcdef\r\n",
     400),
    ("chunked_framing_broken_in_the_first_read", H + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    ("header_field_too_large", H + b"X-Big: " + b"a" * 20000, 431),
    ("content_length_not_a_number", H + b"Content-Length: 1x\r\n\r\n", 400),
    # a client speaking HTTP/2 with prior knowledge: its connection preface, then its frames
    ("http2_connection_preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),
    ("http2_request_line", b"POST /v1/chat/completions HTTP/2.0\r\nHost: gateway.test\r\n\r\n", 400),
]


async def _keep_sending(writer: asyncio.StreamWriter, first: bytes, answered: asyncio.Event,
                        size: int = 16384) -> None:
    """``first``, then more of the request every few milliseconds, until 20 writes after ``answered``."""
    writer.write(first)
    after = 0
    while after < 20:
        writer.write(b"x" * size)
        await writer.drain()
        after += answered.is_set()
        await asyncio.sleep(0.005)


@on_both_loops
async def test_a_refusal_that_closes_the_connection_is_read_whole_by_a_client_still_sending():
    """A client that goes on writing its request after the gateway refused it and closes the
    connection (its framing broke, its head is too large) reads the whole answer, then the end of
    the connection: the gateway ends its side and reads and drops what still comes (a lingering
    close, RFC 9112 section 9.6) instead of closing with the client's bytes unread, which resets
    the connection (a client whose stack drops its receive buffer at a reset never reads the
    answer, and one writing its body, as httpx does, meets the reset as a write error)."""
    async with edge_gateway(**SERVER) as gw:
        for case, first, status in STILL_SENDING:
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            answered = asyncio.Event()
            sender = asyncio.ensure_future(_keep_sending(writer, first, answered))
            data = b""
            try:
                async with asyncio.timeout(5.0):
                    while chunk := await reader.read(65536):
                        data += chunk
                    answered.set()
                    await sender        # the writes after the answer are taken, not reset
            finally:
                sender.cancel()
                writer.close()
            got, rest = parse_responses(data, eof=True)
            assert [r.status for r in got] == [status] and not rest, (case, data[:200])
            assert got[0].headers["connection"].lower() == "close", case
            assert_openai_error(got[0], status)
        assert await wait_for(lambda: gw.connections() == 0, timeout=5.0, interval=0.01)


@on_both_loops
async def test_a_header_section_over_its_total_bound_is_a_431_at_the_edge_and_reaches_no_engine():
    """Each header field within ``server.max_header_bytes`` and their count within
    ``server.max_headers``, a head may still hold 1.6 MB; the headers the gateway forwards then
    meet the engine's own bound (an h11 server's 16 KiB head by default) and come back as the
    engine's opaque 400. The whole header section is bounded at the edge
    (``server.max_header_total_bytes``, 64 KiB by default): over it, a 431 naming the key, and no
    engine is asked; a head of 60 KB under it is served."""
    async with edge_gateway(**SERVER) as gw:
        over = {f"X-Big-{i}": "a" * 10000 for i in range(8)}
        ex = await exchange(gw.port, request("POST", CHAT, BODY, over))
        [resp] = ex.responses
        err = assert_openai_error(resp, 431)
        assert err["code"] == "header_too_large" and "server.max_header_total_bytes" in err["message"], err
        assert resp.headers["connection"].lower() == "close" and ex.closed
        assert await gw.received() == []
        under = {f"X-Big-{i}": "a" * 5000 for i in range(12)}
        ex = await exchange(gw.port, request("POST", CHAT, BODY, under, close=True))
        assert [r.status for r in ex.responses] == [200], ex.responses[0].body[:300]


@on_both_loops
async def test_a_head_that_outgrows_its_total_bound_before_its_end_is_a_431_at_once():
    """The header section's bound holds while the head is still coming: a client that sends field
    after field (each within ``server.max_header_bytes``, their count within ``server.max_headers``)
    and never ends its head is answered 431 once its bytes pass what a head within
    ``server.max_header_total_bytes`` may hold, and the connection closes; the gateway does not
    hold its 1.6 MB until ``server.header_timeout_s``, nor a thousand such clients' 1.6 GB. A head
    within the bound that comes in pieces is served."""
    async with edge_gateway(**{**SERVER, "header_timeout_s": 60.0}) as gw:
        head = b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\n"
        fields = [b"X-Big-%d: %s\r\n" % (i, b"a" * 10000) for i in range(30)]
        for parts in ([head + b"".join(fields)], [head, *fields]):
            ex = await exchange(gw.port, *parts, pause=0.01, wait=20.0)
            [resp] = ex.responses
            err = assert_openai_error(resp, 431)
            assert err["code"] == "header_too_large" and "server.max_header_total_bytes" in err["message"], err
            assert resp.headers["connection"].lower() == "close" and ex.closed
        assert await gw.received() == []
        assert gw.timeouts("header") == 0
        assert await wait_for(lambda: gw.connections() == 0, timeout=10.0, interval=0.01)
        under = [b"X-Big-%d: %s\r\n" % (i, b"a" * 5000) for i in range(12)]
        body_head = b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(BODY)
        ex = await exchange(gw.port, head, *under, body_head + BODY, pause=0.01, wait=20.0)
        assert [r.status for r in ex.responses] == [200], ex.responses[0].body[:300]


# a chat whose chunked body takes it off the fast lane, onto aiohttp's path
CHUNKED_CHAT = (b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY))


def _held_chat(release: asyncio.Event):
    """An engine's chat handler that answers once ``release`` is set."""
    async def chat(req: web.Request) -> web.StreamResponse:
        await req.read()
        await release.wait()
        return web.json_response({"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]})
    return chat


@on_both_loops
async def test_a_head_pipelined_behind_a_running_request_is_not_read_past_its_bound_and_gets_a_431_at_its_turn():
    """A head that comes behind a request still running (here on aiohttp's path: a chunked body) is
    read only up to what a head within ``server.max_header_total_bytes`` holds: then the gateway
    stops reading the connection, the client's bytes wait in its socket, and once the answer before
    it is out the head is answered 431 and the connection closed, not left for its clock to run out."""
    release = asyncio.Event()

    chat = _held_chat(release)

    async with fake_engine(chat) as url, edge_gateway(endpoint=url, **{**SERVER, "header_timeout_s": 60.0}) as gw:
        first = CHUNKED_CHAT
        head = b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\n" + b"".join(
            b"X-Big-%d: %s\r\n" % (i, b"a" * 10000) for i in range(30))
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        try:
            writer.write(first + head)
            await writer.drain()

            def stopped() -> bool:
                served = [t.get_coro().cr_frame.f_locals["self"] for t in _edge_connections_served()]
                return len(served) == 1 and served[0].transport is not None and not served[0].transport.is_reading()

            assert await wait_for(stopped, timeout=10.0, interval=0.01)
            release.set()
            data = b""
            async with asyncio.timeout(20.0):
                while chunk := await reader.read(65536):
                    data += chunk
        finally:
            release.set()
            writer.close()
        got, _ = parse_responses(data, eof=True)
        assert [r.status for r in got] == [200, 431], data[:500]
        err = assert_openai_error(got[1], 431)
        assert err["code"] == "header_too_large" and "server.max_header_total_bytes" in err["message"], err
        assert gw.timeouts("header") == 0
        assert await wait_for(lambda: gw.connections() == 0, timeout=10.0, interval=0.01)


@on_both_loops
async def test_half_a_head_behind_a_queued_request_gets_its_408_or_431_at_its_turn():
    """A request runs, a second one waits its turn whole behind it, and a third one's head comes in
    part: once the second is answered, the third's head clock runs (a 408 after
    ``server.header_timeout_s``), and a head past its bound is not read on meanwhile and is a 431,
    as for a head right behind the running request. Whether the second came in the same read as
    the third's first bytes or apart."""
    release = asyncio.Event()

    chat = _held_chat(release)

    first = CHUNKED_CHAT
    second = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    third = b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nX-A: b\r\n"
    big = b"".join(b"X-Big-%d: %s\r\n" % (i, b"a" * 10000) for i in range(30))
    settings = {**SERVER, "header_timeout_s": 0.2, "keepalive_timeout_s": 60.0}
    async with fake_engine(chat) as url, edge_gateway(endpoint=url, **settings) as gw:
        for parts, status in (([second + third], 408), ([second, third], 408), ([second + third + big], 431)):
            release.clear()
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            try:
                writer.write(first)
                for part in parts:
                    await asyncio.sleep(0.05)
                    writer.write(part)
                await writer.drain()
                await asyncio.sleep(0.1)
                release.set()
                data = b""
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(20.0):
                        while chunk := await reader.read(65536):
                            data += chunk
            finally:
                release.set()
                writer.close()
            got, _ = parse_responses(data, eof=True)
            assert [r.status for r in got] == [200, 200, status], (status, data[-400:])
            assert_openai_error(got[2], status)
        assert await wait_for(lambda: gw.connections() == 0, timeout=10.0, interval=0.01)


@on_both_loops
async def test_a_408_to_a_body_still_coming_is_read_whole_by_its_client():
    """A body that comes too slowly (``server.body_total_timeout_s`` passes while the client is
    still sending it) gets its 408 and the connection closes lingering, as other refusals of a
    client still sending do: the client reads the whole answer and the connection's end, its
    writes after the answer taken, not reset. On the fast lane (which holds a request for its body)
    and on aiohttp's path (a query string leaves the request to it)."""
    async with edge_gateway(body_total_timeout_s=0.5, body_timeout_s=5.0, keepalive_timeout_s=30.0) as gw:
        for target in (CHAT, CHAT + "?x=1"):
            head = request("POST", target, None, {"Content-Type": "application/json", "Content-Length": "900000"})
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            answered = asyncio.Event()
            sender = asyncio.ensure_future(_keep_sending(writer, head, answered, size=256))
            data = b""
            try:
                async with asyncio.timeout(8.0):
                    while chunk := await reader.read(65536):
                        data += chunk
                    answered.set()
                    await sender        # the writes after the answer are taken, not reset
            finally:
                sender.cancel()
                writer.close()
            got, rest = parse_responses(data, eof=True)
            assert [r.status for r in got] == [408] and not rest, (target, data[:300])
            err = assert_openai_error(got[0], 408)
            assert "body_total_timeout_s" in err["message"], err
            assert got[0].headers["connection"].lower() == "close", target
        assert await wait_for(lambda: gw.connections() == 0, timeout=5.0, interval=0.01)
        assert await gw.received() == []
