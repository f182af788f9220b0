"""Slow and greedy clients: each is cut by its timeout (408 in OpenAI shape where the client can
still read it, a close otherwise), counted, and leaves nothing behind; a connection over the cap
is closed at once; well-behaved clients are untouched. Every test runs on the default event loop
and on uvloop. Timeouts here are short configured values; no test asserts a duration."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import orjson
import structlog
from aiohttp import web

from gateway.server.app import GATEWAY_KEY
from tests.support.edge import (
    assert_openai_error,
    edge_gateway,
    exchange,
    parse_responses,
    request,
)
from tests.support.fake_engine import fake_engine
from tests.support.http import openai_client
from tests.support.loops import on_both_loops
from tests.support.waiting import wait_for

CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
# an engine that streams as fast as it can, for as long as asked
FIREHOSE = {"itl_ms": 0.0, "max_model_len": 1_000_000, "eos_probability": 0.0}
PROMISED_BODY = request("POST", CHAT, None, {"Content-Type": "application/json", "Content-Length": "100000"})


def _timeout_lines(logs: list[dict]) -> list[tuple[str, str, bool]]:
    return [(x["log_level"], x["reason"], x["answered"]) for x in logs if x["event"] == "client timeout"]


@on_both_loops
async def test_half_a_head_gets_408_and_is_counted():
    """A head begun and stalled is a slow or hostile client: its cut is logged at info."""
    async with edge_gateway(header_timeout_s=0.3) as gw:
        with structlog.testing.capture_logs() as logs:
            ex = await exchange(gw.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        err = assert_openai_error(ex.first, 408)
        assert err["code"] == "request_timeout" and "header_timeout_s" in err["message"]
        assert ex.closed and ex.first.headers["connection"] == "close"
        assert gw.timeouts("header") == 1
        assert _timeout_lines(logs) == [("info", "header", True)], logs
        assert await wait_for(lambda: gw.connections() == 0, timeout=10.0, interval=0.01)


@on_both_loops
async def test_a_connection_that_never_speaks_is_closed_without_an_answer():
    """Closed without a word to the client, and to the log only at debug, as an idle kept-alive
    connection is: it ended no request (a client's spare pooled connection, a port probe)."""
    async with edge_gateway(header_timeout_s=0.3) as gw:
        with structlog.testing.capture_logs() as logs:
            ex = await exchange(gw.port)
        assert ex.closed and ex.responses == [] and ex.trailing == b""
        assert gw.timeouts("header") == 1
        assert _timeout_lines(logs) == [("debug", "header", False)], logs


@on_both_loops
async def test_a_body_that_stops_gets_408_and_never_reaches_the_engine():
    async with edge_gateway(body_timeout_s=0.3) as gw:
        ex = await exchange(gw.port, PROMISED_BODY + BODY[:20])
        err = assert_openai_error(ex.first, 408)
        assert "body_timeout_s" in err["message"] and ex.closed
        assert gw.timeouts("body") == 1
        assert (await gw.sim_state())["counts"]["started"] == 0 and await gw.received() == []


async def dribble(port: int, head: bytes, every: float, limit: int = 400) -> bytes:
    """Send ``head``, then one body byte every ``every`` s until the server answers or closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    data = b""

    async def read() -> None:
        nonlocal data
        with contextlib.suppress(ConnectionResetError):
            while chunk := await reader.read(65536):
                data += chunk

    reading = asyncio.ensure_future(read())
    try:
        for _ in range(limit):
            if reading.done():
                break
            try:
                writer.write(b" ")
                await writer.drain()
            except (ConnectionResetError, BrokenPipeError):
                break
            await asyncio.sleep(every)
        await asyncio.wait_for(reading, 10)
    finally:
        writer.close()
    return data


@on_both_loops
async def test_a_body_dribbled_byte_by_byte_hits_the_total_timeout():
    async with edge_gateway(body_timeout_s=5.0, body_total_timeout_s=0.5) as gw:
        resp, _ = parse_responses(await dribble(gw.port, PROMISED_BODY, every=0.05), eof=True)
        err = assert_openai_error(resp[0], 408)
        assert "body_total_timeout_s" in err["message"]
        assert gw.timeouts("body_total") == 1 and gw.timeouts("body") == 0


@on_both_loops
async def test_an_idle_kept_alive_connection_is_closed_silently():
    """Closed without a word to the client, and to the log only at debug: a busy gateway's idle
    clients would fill it with a line each."""
    async with edge_gateway(keepalive_timeout_s=0.3, header_timeout_s=5.0) as gw:
        with structlog.testing.capture_logs() as logs:
            ex = await exchange(gw.port, request("GET", "/health"))
        assert [r.status for r in ex.responses] == [200] and ex.closed and ex.trailing == b""
        assert gw.timeouts("keepalive") == 1 and gw.timeouts("header") == 0
        assert _timeout_lines(logs) == [("debug", "keepalive", False)], logs


@on_both_loops
async def test_half_a_head_on_a_kept_alive_connection_gets_408():
    async with edge_gateway(keepalive_timeout_s=5.0, header_timeout_s=0.3) as gw:
        with structlog.testing.capture_logs() as logs:
            ex = await exchange(gw.port, request("GET", "/health"), b"GET /v1/mod")
        assert [r.status for r in ex.responses] == [200, 408] and ex.closed
        assert_openai_error(ex.responses[1], 408)
        assert gw.timeouts("header") == 1 and gw.timeouts("keepalive") == 0
        assert _timeout_lines(logs) == [("info", "header", True)], logs     # a request cut: at info still


@on_both_loops
async def test_a_deadline_armed_a_hair_ahead_and_then_moved_leaves_the_connection_serving():
    """uvloop hands back a plain ``Handle``, without ``when()``, for a timer set less than half a
    millisecond ahead, as when a deadline's timer fires a float's hair early and re-arms it. The
    next read then moved the deadline by asking the handle its time: an exception in the
    connection's callback, which closed it under the client's request."""
    async with edge_gateway(keepalive_timeout_s=5.0, header_timeout_s=5.0) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        try:
            writer.write(request("GET", "/health"))
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            await asyncio.sleep(0.05)           # the answer is out: the connection idles
            (proto,) = gw.runner.server.connections
            loop = asyncio.get_running_loop()
            proto._e_arm(loop.time() + 1e-9)    # what the early timer's re-arm does
            proto._e_arm(loop.time() + 5.0)     # what the next read does
            await asyncio.sleep(0.05)
            writer.write(request("POST", CHAT, BODY, {"Content-Type": "application/json"}))
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        finally:
            writer.close()
        assert head.startswith(b"HTTP/1.1 200")


@on_both_loops
async def test_many_slow_clients_are_all_cut_and_leave_nothing_open():
    """The measurement that started this, scaled down: half heads and promised bodies that stop."""
    async with edge_gateway(header_timeout_s=0.5, body_timeout_s=0.5) as gw:
        results = await asyncio.gather(
            *[exchange(gw.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n") for _ in range(60)],
            *[exchange(gw.port, PROMISED_BODY + BODY[:10]) for _ in range(15)])
        assert all(ex.closed and ex.first.status == 408 for ex in results)
        assert gw.timeouts("header") == 60 and gw.timeouts("body") == 15
        assert await wait_for(lambda: gw.connections() == 0, timeout=10.0, interval=0.01)


@on_both_loops
async def test_a_streaming_client_that_stops_reading_is_cut_and_the_engine_aborted():
    async with edge_gateway(sim=FIREHOSE, write_stall_timeout_s=0.3) as gw:
        body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 200_000, "stream": True})
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)     # reads nothing, fills up fast
        s.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_connect(s, ("127.0.0.1", gw.port))
            await loop.sock_sendall(s, request("POST", CHAT, body))

            async def aborted():
                st = await gw.sim_state()
                return st if st["counts"]["aborted"] else None

            state = await wait_for(aborted, timeout=30.0, interval=0.01)
            assert state and state["counts"]["aborted"] == 1 and state["counts"]["completed"] == 0
            assert gw.timeouts("write_stall") == 1
            assert await wait_for(lambda: gw.connections() == 0, timeout=10.0, interval=0.01)
        finally:
            s.close()


@on_both_loops
async def test_a_stream_too_slow_to_fill_the_send_buffer_is_cut_when_its_client_stops_reading():
    """An engine writing tokens at a steady pace (not a firehose) takes minutes to fill the
    megabytes a kernel gives a connection's send buffer, so the gateway's write buffer never fills;
    a client whose receive window is shut for the bound is cut all the same, and the engine's
    request aborted, on every path that streams (translated ones too)."""
    paced = {"itl_ms": 2.0, "max_model_len": 1_000_000, "eos_probability": 0.0}
    bodies = {CHAT: {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200_000,
                     "stream": True},
              "/v1/messages": {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 200_000, "stream": True},
              "/v1/responses": {"model": "m", "input": "hi", "max_output_tokens": 200_000, "stream": True}}
    async with edge_gateway(sim=paced, write_stall_timeout_s=0.3) as gw:
        loop = asyncio.get_running_loop()
        socks = []
        try:
            for path, body in bodies.items():
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)     # reads nothing
                s.setblocking(False)
                socks.append(s)
                await loop.sock_connect(s, ("127.0.0.1", gw.port))
                await loop.sock_sendall(s, request("POST", path, orjson.dumps(body),
                                                   {"anthropic-version": "2023-06-01"}))

            async def aborted():
                st = await gw.sim_state()
                return st if st["counts"]["aborted"] == len(bodies) else None

            state = await wait_for(aborted, timeout=30.0, interval=0.05)
            assert state, (await gw.sim_state())["counts"]
            assert state["counts"]["completed"] == 0
            assert gw.timeouts("write_stall") == len(bodies)
            assert await wait_for(lambda: gw.connections() == 0, timeout=10.0, interval=0.01)
        finally:
            for s in socks:
                s.close()


@on_both_loops
async def test_a_kept_alive_connections_next_stream_is_watched_too():
    """A short stream read whole, then on the same connection a long one its client does not read:
    the second is cut (its look at the client is its own, not the first one's, which ended)."""
    paced = {"itl_ms": 2.0, "max_model_len": 1_000_000, "eos_probability": 0.0}
    async with edge_gateway(sim=paced, write_stall_timeout_s=1.0) as gw:
        loop = asyncio.get_running_loop()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.setblocking(False)
        try:
            await loop.sock_connect(s, ("127.0.0.1", gw.port))
            short = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
            await loop.sock_sendall(s, request("POST", CHAT, orjson.dumps(short)))
            got = b""
            while not got.endswith(b"\r\n0\r\n\r\n"):
                chunk = await loop.sock_recv(s, 65536)
                assert chunk, got
                got += chunk
            assert b"data: [DONE]" in got
            long = {**short, "max_tokens": 200_000}
            await loop.sock_sendall(s, request("POST", CHAT, orjson.dumps(long)))     # and reads nothing more

            async def aborted():
                st = await gw.sim_state()
                return st if st["counts"]["aborted"] else None

            state = await wait_for(aborted, timeout=30.0, interval=0.05)
            assert state, (await gw.sim_state())["counts"]
            assert state["counts"]["completed"] == 1 and gw.timeouts("write_stall") == 1
            assert await wait_for(lambda: gw.connections() == 0, timeout=10.0, interval=0.01)
        finally:
            s.close()


@on_both_loops
async def test_a_streaming_client_that_pauses_holds_the_engine_back_and_then_gets_every_byte():
    """The relay pipes chunks from the engine to the client; a client that stops reading (within
    the write-stall bound) makes the gateway stop reading the engine, not buffer the stream."""
    async with edge_gateway(sim=FIREHOSE, write_stall_timeout_s=60) as gw:
        tokens = 50_000
        body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens,
                             "stream": True})
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.setblocking(False)
        loop = asyncio.get_running_loop()
        pool = gw.app[GATEWAY_KEY].upstream.pool
        try:
            await loop.sock_connect(s, ("127.0.0.1", gw.port))
            await loop.sock_sendall(s, request("POST", CHAT, body, close=True))
            got = bytearray(await loop.sock_recv(s, 4096))          # headers and the first chunks
            assert await wait_for(lambda: any(c.paused for c in pool._conns), timeout=30.0, interval=0.01)
            assert (await gw.sim_state())["counts"]["completed"] == 0
            while chunk := await loop.sock_recv(s, 1 << 16):
                got += chunk
        finally:
            s.close()
        head, _, rest = bytes(got).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        events = parse_chunked(rest).split(b"\n\n")
        assert events[-2:] == [b"data: [DONE]", b""]
        assert sum(1 for e in events if b'"content":"' in e) >= tokens - 1


# a chat chunk of 900 characters: an engine that writes 16 of them at a time writes MBs at once
_BIG_EVENT = b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                       "choices": [{"index": 0, "delta": {"content": "x" * 900},
                                                    "finish_reason": None}]}) + b"\n\n"


@on_both_loops
async def test_a_streaming_client_that_reads_slowly_is_not_cut():
    """A client that keeps reading, slower than the engine writes, is no stalled client: the
    gateway's write buffer stays full (the engine is held back), but the client takes bytes out of
    it within every write_stall_timeout_s, so its stream runs to the end."""
    blocks = 400                    # about 6 MB: more than the sockets' buffers hold

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for _ in range(blocks):
            await out.write(_BIG_EVENT * 16)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async with fake_engine(chat) as url, edge_gateway(endpoint=url, write_stall_timeout_s=0.5) as gw:
        body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
        s = socket.socket()
        s.setblocking(False)
        loop = asyncio.get_running_loop()
        got = bytearray()
        try:
            await loop.sock_connect(s, ("127.0.0.1", gw.port))
            await loop.sock_sendall(s, request("POST", CHAT, body, close=True))
            for _ in range(25):         # 16 KiB every 50 ms for 1.25 s: a read in every part of each bound
                chunk = await loop.sock_recv(s, 16384)
                assert chunk, "the gateway cut a client that was reading"
                got += chunk
                await asyncio.sleep(0.05)
            while chunk := await loop.sock_recv(s, 1 << 16):
                got += chunk
        finally:
            s.close()
        head, _, rest = bytes(got).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        events = parse_chunked(rest).split(b"\n\n")
        assert events[-2:] == [b"data: [DONE]", b""] and len(events) == blocks * 16 + 2
        assert gw.timeouts("write_stall") == 0


def parse_chunked(raw: bytes) -> bytes:
    out, i = bytearray(), 0
    while True:
        j = raw.index(b"\r\n", i)
        n = int(raw[i:j], 16)
        if n == 0:
            return bytes(out)
        out += raw[j + 2:j + 2 + n]
        assert raw[j + 2 + n:j + 4 + n] == b"\r\n"
        i = j + 4 + n


@on_both_loops
async def test_connections_over_the_cap_are_closed_at_once_and_counted():
    async with edge_gateway(max_connections=3, header_timeout_s=30.0) as gw:
        held = [await asyncio.open_connection("127.0.0.1", gw.port) for _ in range(3)]
        try:
            assert await wait_for(lambda: gw.connections() == 3, timeout=10.0, interval=0.01)
            ex = await exchange(gw.port, request("GET", "/health"))
            assert ex.closed and ex.responses == []
            s = gw.samples()
            assert s["switchyard_connections_rejected_total{}"] == 1 and s["switchyard_client_connections{}"] == 3
            _r, w = held.pop()
            w.close()
            assert await wait_for(lambda: gw.connections() == 2, timeout=10.0, interval=0.01)
            ex = await exchange(gw.port, request("GET", "/health", close=True))
            assert [r.status for r in ex.responses] == [200]
        finally:
            for _r, w in held:
                w.close()


@on_both_loops
async def test_a_body_the_handler_is_not_reading_yet_is_not_the_clients_silence():
    """While the app has not consumed the body, aiohttp stops reading the socket; that pause
    must not count as a silent client (here the app waits past body_timeout_s before reading)."""
    from aiohttp import web
    from prometheus_client import CollectorRegistry

    from gateway.server.edge import Edge, EdgeLimits, EdgeRunner

    async def slow_reader(request: web.Request) -> web.Response:
        await asyncio.sleep(0.6)
        return web.json_response({"read": len(await request.read())})

    app = web.Application(client_max_size=8 << 20)
    app.router.add_post("/upload", slow_reader)
    registry = CollectorRegistry()
    edge = Edge(EdgeLimits(body_timeout_s=0.2, body_total_timeout_s=30.0), registry)
    runner = EdgeRunner(app, edge, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        body = b"x" * (4 << 20)
        ex = await exchange(site.port, request("POST", "/upload", body, close=True), wait=20.0)
        assert ex.first.status == 200 and ex.first.json() == {"read": len(body)}
        assert registry.get_sample_value("switchyard_client_timeouts_total", {"reason": "body"}) == 0
    finally:
        await runner.cleanup()


# -- well-behaved clients are untouched -------------------------------------------------------------

@on_both_loops
async def test_a_streaming_client_that_keeps_up_is_never_cut():
    async with edge_gateway(sim=FIREHOSE, write_stall_timeout_s=0.3) as gw:
        body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000,
                             "stream": True})
        ex = await exchange(gw.port, request("POST", CHAT, body, close=True), wait=30.0)
        assert ex.first.status == 200 and ex.first.body.endswith(b"data: [DONE]\n\n")
        assert gw.timeouts("write_stall") == 0


@on_both_loops
async def test_kept_alive_requests_whose_head_and_body_come_in_separate_writes():
    """As httpx (the OpenAI SDK) sends them: head, then body, then the next request at once."""
    async with edge_gateway(header_timeout_s=5.0, body_timeout_s=5.0) as gw:
        head = request("POST", CHAT, None, {"Content-Type": "application/json", "Content-Length": str(len(BODY))})
        chunked_head = request("POST", CHAT, None, {"Content-Type": "application/json",
                                                    "Transfer-Encoding": "chunked"})
        ex = await exchange(gw.port, head, BODY, head, BODY, chunked_head, b"%x\r\n" % len(BODY) + BODY + b"\r\n",
                            b"0\r\n\r\n", request("GET", "/health", close=True), pause=0.05)
        assert [r.status for r in ex.responses] == [200, 200, 200, 200], [r.body[:200] for r in ex.responses]
        assert ex.closed and not ex.trailing
        s = gw.samples()
        assert not [k for k, v in s.items() if k.startswith("switchyard_client_timeouts_total") and v]
        assert not [k for k, v in s.items() if k.startswith("switchyard_client_protocol_errors_total") and v]


@on_both_loops
async def test_the_openai_sdk_reuses_its_connection_across_plain_and_streaming_requests():

    async with edge_gateway() as gw:
        client = openai_client(gw)
        try:
            for _ in range(2):
                r = await client.chat.completions.create(model="m", max_tokens=3,
                                                         messages=[{"role": "user", "content": "hi"}])
                assert r.choices[0].message.content
                stream = await client.chat.completions.create(model="m", max_tokens=3, stream=True,
                                                              messages=[{"role": "user", "content": "hi"}])
                assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        finally:
            await client.close()
        assert gw.samples().get("switchyard_client_protocol_errors_total{status=400}", 0) == 0


@on_both_loops
async def test_empty_lines_between_requests_are_no_next_request_and_start_no_head_clock():
    """RFC 9112 §2.2: a server SHOULD ignore an empty line (CRLF) received before a request line;
    some clients send one after a POST's body. It is not the head of a next request: the kept-alive
    connection is idle after the answer, gets no 408 when the head clock would have passed, and
    serves the next request. Sent with the body or after the answer, on the fast lane and on
    aiohttp's path (a query string)."""
    async with edge_gateway(keepalive_timeout_s=30.0, header_timeout_s=0.1) as gw:
        runs = []
        for target in (CHAT, CHAT + "?x=1"):
            first = request("POST", target, BODY)
            last = request("POST", target, BODY, close=True)
            runs.append(exchange(gw.port, first + b"\r\n", last, pause=0.4))
            runs.append(exchange(gw.port, first, b"\r\n\r\n", last, pause=0.4))
        exchanges = await asyncio.gather(*runs)
        for ex in exchanges:
            assert [r.status for r in ex.responses] == [200, 200], [r.body[:200] for r in ex.responses]
            assert ex.closed and not ex.trailing
        assert gw.timeouts("header") == 0
        assert await wait_for(lambda: gw.connections() == 0, timeout=10.0, interval=0.01)
    # and the line end that completes a head whose start came behind the request before it is the
    # head's, not an empty line to drop (that head's clock runs from the answer before it: a long one)
    async with edge_gateway(keepalive_timeout_s=30.0, header_timeout_s=30.0) as gw:
        health = request("GET", "/health")
        ex = await exchange(gw.port, health + health[:-2], b"\r\n", request("GET", "/health", close=True),
                            pause=0.2)
        assert [r.status for r in ex.responses] == [200, 200, 200], [r.body[:200] for r in ex.responses]
        assert ex.closed and not ex.trailing


@on_both_loops
async def test_a_whole_answer_whose_client_resets_while_its_body_goes_out_is_logged_as_its_cancel():
    """A non-streaming answer of MBs, its client reading its head and resetting the connection while
    the rest is still on its way: the request's line is the client's cancel (499, counted in
    ``switchyard_client_cancels_total``), not a 200 written before the body went out."""
    big = orjson.dumps({"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "w" * (24 << 20)},
                                     "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=big, content_type="application/json")

    async with fake_engine(chat) as url, edge_gateway(endpoint=url) as gw:
        with gw.app[GATEWAY_KEY].request_log.capture() as lines:
            await _reset_after_head(gw.port, request("POST", CHAT, BODY), b"HTTP/1.1 200")
            assert await wait_for(lambda: [x for x in lines if x["event"] == "request"], timeout=10.0, interval=0.01)
        line = next(x for x in lines if x["event"] == "request")
        assert (line["status"], line["error_class"]) == (499, "client_cancel"), line
        assert sum(v for k, v in gw.samples().items() if k.startswith("switchyard_client_cancels_total")) == 1
        assert await wait_for(lambda: gw.connections() == 0, timeout=10.0, interval=0.01)
        # a client as slow that reads it all: its line, written once the body went, is the 200
        with gw.app[GATEWAY_KEY].request_log.capture() as lines:
            got = await _read_all(gw.port, request("POST", CHAT, BODY, {"Connection": "close"}))
            assert got.endswith(big), bytes(got[:200])
            assert await wait_for(lambda: [x for x in lines if x["event"] == "request"], timeout=10.0, interval=0.01)
        line = next(x for x in lines if x["event"] == "request")
        assert (line["status"], line["error_class"]) == (200, None), line
        assert sum(v for k, v in gw.samples().items() if k.startswith("switchyard_client_cancels_total")) == 1


@on_both_loops
async def test_a_whole_answer_to_an_http_1_0_client_that_resets_while_its_body_goes_out_is_logged_as_its_cancel():
    """As on HTTP/1.1, for an HTTP/1.0 client, whose answer aiohttp writes: the request's line
    follows the write (a 499 counted as the client's cancel), not a 200 logged before the body
    went out; one that reads it all has its 200."""
    big = orjson.dumps({"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "w" * (24 << 20)},
                                     "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=big, content_type="application/json")

    raw = request("POST", CHAT, BODY).replace(b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", 1)
    async with fake_engine(chat) as url, edge_gateway(endpoint=url) as gw:
        with gw.app[GATEWAY_KEY].request_log.capture() as lines:
            await _reset_after_head(gw.port, raw, b"HTTP/1.0 200")
            assert await wait_for(lambda: [x for x in lines if x["event"] == "request"], timeout=10.0, interval=0.01)
        line = next(x for x in lines if x["event"] == "request")
        assert (line["status"], line["error_class"]) == (499, "client_cancel"), line
        assert sum(v for k, v in gw.samples().items() if k.startswith("switchyard_client_cancels_total")) == 1
        assert await wait_for(lambda: gw.connections() == 0, timeout=10.0, interval=0.01)
        with gw.app[GATEWAY_KEY].request_log.capture() as lines:
            got = await _read_all(gw.port, raw)
            assert got.startswith(b"HTTP/1.0 200") and got.endswith(big), bytes(got[:200])
            assert await wait_for(lambda: [x for x in lines if x["event"] == "request"], timeout=10.0, interval=0.01)
        line = next(x for x in lines if x["event"] == "request")
        assert (line["status"], line["error_class"]) == (200, None), line


@on_both_loops
async def test_a_client_reset_read_with_its_whole_answer_is_logged_as_its_cancel():
    """The engine's whole answer and the client's reset reach the gateway together (the engine
    writes its answer, and the client resets its connection, before the gateway's next read): no
    byte of the answer can reach the client, so the request's line is the client's cancel (499,
    counted), as for a reset while the body goes out, not a 200; over HTTP/1.1 and HTTP/1.0. The
    gateway serves the next client."""
    small = orjson.dumps({"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
                          "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                       "finish_reason": "stop"}],
                          "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
    client: list[socket.socket] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = len(small)
        await resp.prepare(request)
        await resp.write(small)         # into the engine's socket now: its transport is not paused
        if client:                      # in the same callback, before the gateway reads either
            s = client.pop()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            s.close()
        await resp.write_eof()
        return resp

    loop = asyncio.get_running_loop()
    async with fake_engine(chat) as url, edge_gateway(endpoint=url) as gw:
        for n, version in enumerate(("1.1", "1.0"), 1):
            raw = request("POST", CHAT, BODY).replace(b" HTTP/1.1\r\n", f" HTTP/{version}\r\n".encode(), 1)
            with gw.app[GATEWAY_KEY].request_log.capture() as lines:
                s = socket.socket()
                s.setblocking(False)
                await loop.sock_connect(s, ("127.0.0.1", gw.port))
                client.append(s)
                await loop.sock_sendall(s, raw)
                assert await wait_for(lambda: [x for x in lines if x["event"] == "request"], timeout=10.0,
                                      interval=0.01)
            assert not client
            line = next(x for x in lines if x["event"] == "request")
            assert (line["status"], line["error_class"]) == (499, "client_cancel"), (version, line)
            assert sum(v for k, v in gw.samples().items() if k.startswith("switchyard_client_cancels_total")) == n
            assert await wait_for(lambda: gw.connections() == 0, timeout=10.0, interval=0.01)
        ex = await exchange(gw.port, request("POST", CHAT, BODY, close=True))
        assert [r.status for r in ex.responses] == [200] and ex.first.body == small


async def _reset_after_head(port: int, raw: bytes, status: bytes) -> None:
    """Send ``raw`` from a client with a 4 KiB receive buffer, read the answer's head (it starts
    with ``status``), then reset the connection (SO_LINGER 0) with MBs of the answer unsent."""
    loop = asyncio.get_running_loop()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setblocking(False)
    try:
        await loop.sock_connect(s, ("127.0.0.1", port))
        await loop.sock_sendall(s, raw)
        head = b""
        while b"\r\n\r\n" not in head:
            got = await loop.sock_recv(s, 4096)
            assert got, head
            head += got
        assert head.startswith(status), head[:200]
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    finally:
        s.close()


async def _read_all(port: int, raw: bytes) -> bytearray:
    """What a client with a 4 KiB receive buffer reads after sending ``raw``, to the close."""
    loop = asyncio.get_running_loop()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setblocking(False)
    got = bytearray()
    try:
        await loop.sock_connect(s, ("127.0.0.1", port))
        await loop.sock_sendall(s, raw)
        while chunk := await loop.sock_recv(s, 1 << 20):
            got += chunk
    finally:
        s.close()
    return got
