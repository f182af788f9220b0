"""The upstream HTTP/1.1 client (gateway/upstream/h1client.py) against real loopback servers.

Each scenario runs on both the default asyncio loop and uvloop (what the gateway runs on). The
servers are small ``asyncio.start_server`` scripts, so each test says byte for byte what the engine
does, and counts connections and disconnects on the server's side.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import gzip
import socket
import struct
import time
import weakref

import aiohttp
import orjson
import pytest

from gateway.pipeline import relay
from gateway.resilience import retry
from gateway.upstream import h1client
from gateway.upstream.h1client import (
    HIGH_WATER,
    SendState,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamTooLarge,
)
from gateway.upstream.upstream import UpstreamFailure, classify
from tests.support.factories import model_block
from tests.support.loops import on_both_loops
from tests.support.metrics import metric
from tests.support.waiting import until

JSON = {"Content-Type": "application/json"}
GUARD = 10.0    # a bound on waits for the server's side, so a bug fails instead of hanging
HEAD_BOUND = 1024 * 1024    # h1client.MAX_HEAD_BYTES


async def open_leg(pool, url, body, headers, header_timeout):
    """A leg as the gateway opens it: the client's failures classified (``gateway.upstream.upstream``)."""
    try:
        return await pool.post(url, body, headers, header_timeout)
    except UpstreamError as e:
        raise classify(e, url) from None


class Engine:
    """A scripted HTTP/1.1 server: ``handle(server, request, writer)`` answers each request and
    returns False to close the connection. Counts accepted and closed connections."""

    def __init__(self, handle, idle_timeout: float | None = None) -> None:
        self.handle = handle
        self.idle_timeout = idle_timeout        # close a kept-alive connection idle this long
        self.accepted_at: list[float] = []
        self.accepted = 0
        self.closed = 0
        self.requests: list[dict] = []
        self.disconnected = asyncio.Event()
        self.port = 0

    async def __aenter__(self) -> Engine:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.server.wait_closed(), 2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.accepted_at.append(time.monotonic())
        conn_no = self.accepted
        n = 0
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.idle_timeout)
                except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
                    break
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ")
                headers = {k.lower(): v for k, v in (ln.split(": ", 1) for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                n += 1
                req = {"method": method, "path": path, "headers": headers, "body": body, "conn": conn_no,
                       "nth": n, "reader": reader}
                self.requests.append(req)
                if await self.handle(self, req, writer) is False:
                    break
        except ConnectionError:
            pass
        finally:
            writer.close()
            self.closed += 1
            self.disconnected.set()


def answer(body: bytes = b'{"ok":true}', status: int = 200, extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"{extra}\r\n").encode() + body


async def ok(server, req, writer):
    writer.write(answer())
    await writer.drain()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- bodies ------------------------------------------------------------------------------------


@on_both_loops
async def test_content_length_answer_and_the_request_on_the_wire():
    async with Engine(ok) as eng:
        pool = UpstreamPool()
        resp = await pool.post(eng.url + "/v1/chat/completions", b'{"a":1}', {**JSON, "X-Request-Id": "r1"})
        assert resp.status == 200
        assert resp.headers["content-type"] == resp.headers.get("Content-Type") == "application/json"
        assert "CONTENT-TYPE" in resp.headers and "Retry-After" not in resp.headers
        assert await resp.read() == b'{"ok":true}'
        assert resp.at_eof()
        resp.release()
        req = eng.requests[0]
        assert (req["method"], req["path"], req["body"]) == ("POST", "/v1/chat/completions", b'{"a":1}')
        assert req["headers"]["host"] == f"127.0.0.1:{eng.port}"
        assert req["headers"]["content-length"] == "7"
        assert req["headers"]["x-request-id"] == "r1"
        assert "accept-encoding" not in req["headers"]
        await pool.close()


@on_both_loops
async def test_chunked_answer():
    async def chunked(server, req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for part in (b"hello ", b"chunked ", b"world"):
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
        writer.write(b"0\r\n\r\n")

    async with Engine(chunked) as eng:
        pool = UpstreamPool()
        resp = await pool.post(eng.url + "/x", b"{}", JSON)
        assert await resp.read() == b"hello chunked world"
        resp.release()
        assert pool.open_connections == 1       # a complete chunked answer keeps the connection
        await pool.close()


@on_both_loops
async def test_body_delimited_by_the_end_of_the_connection():
    async def eof_body(server, req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it")
        return False

    async with Engine(eof_body) as eng:
        pool = UpstreamPool()
        resp = await pool.post(eng.url + "/x", b"{}", JSON)
        assert await resp.read() == b"all of it"
        resp.release()
        assert pool.open_connections == 0
        await pool.close()


@on_both_loops
async def test_the_answers_headers_leave_out_an_interim_heads_and_join_a_repeated_names_values():
    async def interim(server, req, writer):
        writer.write(b"HTTP/1.1 100 Continue\r\nX-Interim: 1\r\n\r\n"
                     b"HTTP/1.1 200 OK\r\nX-Dup: a\r\nContent-Type: application/json\r\nx-dup: b\r\n"
                     b"Content-Length: 2\r\n\r\n{}")

    async with Engine(interim) as eng:
        pool = UpstreamPool()
        resp = await pool.post(eng.url + "/x", b"{}", JSON)
        assert resp.status == 200
        assert list(resp.headers.items()) == [("x-dup", "a, b"), ("content-type", "application/json"),
                                              ("content-length", "2")]
        assert await resp.read() == b"{}"
        resp.release()
        assert pool.open_connections == 1
        await pool.close()


@on_both_loops
async def test_a_chunked_body_cut_by_the_connections_end_is_incomplete():
    """A head that says where its body ends (chunked here): the connection's end before it is no end."""
    async def cut(server, req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: Chunked\r\n\r\n"
                     b"5\r\nhello\r\n")
        await writer.drain()
        return False

    async with Engine(cut) as eng:
        pool = UpstreamPool()
        resp = await pool.post(eng.url + "/x", b"{}", JSON)
        with pytest.raises(UpstreamDisconnected):
            await resp.read()
        assert not resp.at_eof()
        resp.release()
        await pool.close()


@on_both_loops
async def test_a_body_delimited_by_the_connection_and_cut_by_a_reset_is_incomplete():
    """Only a clean end delimits such a body: a reset (RST) cuts it, as it cuts any other."""
    async def reset_body(server, req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{\"choices\": [")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()                    # linger 0: the peer sees a reset
        return False

    async with Engine(reset_body) as eng:
        pool = UpstreamPool()
        resp = await pool.post(eng.url + "/x", b"{}", JSON)
        with pytest.raises(UpstreamDisconnected) as ei:
            await resp.read()
        assert ei.value.received and "reset" in str(ei.value) and not resp.at_eof()
        resp.release()
        assert pool.open_connections == 0
        await pool.close()


@on_both_loops
async def test_sse_stream_arrives_chunk_by_chunk():
    """The server sends each event only after the client received the previous one."""
    got = asyncio.Event()

    async def sse(server, req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(5):
            event = b"data: {\"i\": %d}\n\n" % i
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await got.wait()
            got.clear()
        writer.write(b"0\r\n\r\n")

    async with Engine(sse) as eng:
        pool = UpstreamPool()
        resp = await pool.post(eng.url + "/v1/chat/completions", b"{}", JSON)
        assert resp.headers["Content-Type"] == "text/event-stream"
        for i in range(5):
            expected = b"data: {\"i\": %d}\n\n" % i
            received = b""
            while len(received) < len(expected):    # (TCP may split even a small write)
                received += await resp.readany()
            assert received == expected
            got.set()
        assert await resp.readany() == b""
        assert resp.at_eof()
        resp.release()
        await pool.close()


# -- keep-alive --------------------------------------------------------------------------------


@on_both_loops
async def test_a_fully_read_answer_returns_its_connection_for_the_next_request():
    async with Engine(ok) as eng:
        pool = UpstreamPool()
        for _ in range(3):
            resp = await pool.post(eng.url + "/x", b"{}", JSON)
            await resp.read()
            resp.release()
        assert eng.accepted == 1
        assert [r["nth"] for r in eng.requests] == [1, 2, 3]
        await pool.close()


@on_both_loops
async def test_an_idle_connection_is_still_reused_after_the_origin_cache_overflows():
    """Idle pools are keyed by origin by identity: when thousands of other endpoints have come and
    gone (Kubernetes), the cache of origins is cut, but an origin with an idle connection stays,
    so its next request reuses that connection instead of opening another."""
    async with Engine(ok) as eng:
        pool = UpstreamPool()
        resp = await pool.post(eng.url + "/x", b"{}", JSON)
        await resp.read()
        resp.release()
        for i in range(4200):                       # endpoints seen once, never connected to
            pool._split(f"http://10.0.{i // 250}.{i % 250}:8000/v1/x")
        assert len(pool._origins) < 4200
        resp = await pool.post(eng.url + "/x", b"{}", JSON)
        await resp.read()
        resp.release()
        assert eng.accepted == 1
        assert [r["nth"] for r in eng.requests] == [1, 2]
        await pool.close()


@on_both_loops
async def test_an_unread_answer_is_not_reused():
    async with Engine(ok) as eng:
        pool = UpstreamPool()
        resp = await pool.post(eng.url + "/x", b"{}", JSON)
        resp.close()
        resp = await pool.post(eng.url + "/x", b"{}", JSON)
        await resp.read()
        resp.release()
        assert eng.accepted == 2
        await pool.close()


@on_both_loops
async def test_connection_close_is_honoured():
    async def closing(server, req, writer):
        writer.write(answer(extra="Connection: close\r\n"))
        await writer.drain()
        await req["reader"].read()        # the client closes it
        return False

    async with Engine(closing) as eng:
        pool = UpstreamPool()
        for _ in range(2):
            resp = await pool.post(eng.url + "/x", b"{}", JSON)
            assert await resp.read() == b'{"ok":true}'
            resp.release()
        assert eng.accepted == 2
        await until(lambda: eng.closed == 2, GUARD)
        await pool.close()


async def drops_second(server, req, writer):
    """An engine that answers every request but the second, on which it closes the connection."""
    if req["nth"] == 2:
        return False                  # closes without answering
    writer.write(answer())
    await writer.drain()


@pytest.fixture
def short_resend_idle(monkeypatch):
    """``RESEND_IDLE_S`` made short: a connection that idled 0.1 s counts as one whose keep-alive
    timeout may have ended."""
    monkeypatch.setattr(h1client, "RESEND_IDLE_S", 0.05)


@on_both_loops
async def test_a_pooled_connection_closed_by_the_engine_is_retried_once_on_a_fresh_one(short_resend_idle):
    """The engine drops an idle keep-alive connection just as the next request arrives on it:
    nothing came back, so the client sends the request again on a new connection."""
    async with Engine(drops_second) as eng:
        pool = UpstreamPool()
        resp = await pool.post(eng.url + "/x", b"first", JSON)
        await resp.read()
        resp.release()
        await asyncio.sleep(0.1)        # idle long enough for an engine's keep-alive timeout
        resp = await pool.post(eng.url + "/x", b"second", JSON)
        assert resp.status == 200 and await resp.read() == b'{"ok":true}'
        resp.release()
        assert eng.accepted == 2
        assert [(r["conn"], r["body"]) for r in eng.requests] == [(1, b"first"), (1, b"second"), (2, b"second")]
        await pool.close()


async def _second_request_lost_once(eng, idle_s: float = 0.0) -> None:
    """A first request answered, then (``idle_s`` later) a second on the kept-alive connection that
    the engine loses: by ``post`` and by ``begin``, the caller gets the loss, and the engine saw the
    second request once."""
    pool = UpstreamPool()
    for send in (lambda b: pool.post(eng.url + "/x", b, JSON), lambda b: pool.begin(eng.url + "/x", b, JSON).response()):
        resp = await pool.post(eng.url + "/x", b"first", JSON)
        await resp.read()
        resp.release()
        if idle_s:
            await asyncio.sleep(idle_s)
        with pytest.raises(UpstreamDisconnected) as ei:
            await send(b"second")
        assert not ei.value.received
        assert [r["body"] for r in eng.requests].count(b"second") == 1
        eng.requests.clear()
    await pool.close()


@on_both_loops
async def test_a_connection_that_had_idled_briefly_and_closes_unanswered_is_not_sent_again():
    """A reused connection the engine had open (it idled less than ``RESEND_IDLE_S``): the engine
    read the request and went away with it. Sending it again would run it twice (a P/D decode's
    KV pull is used once), so the failure is the caller's, as on a fresh connection."""
    async with Engine(drops_second) as eng:
        await _second_request_lost_once(eng)


@on_both_loops
async def test_a_connection_that_closes_long_after_the_request_went_out_is_not_sent_again(short_resend_idle,
                                                                                          monkeypatch):
    """A reused connection that had idled long enough for a keep-alive timeout, but the engine read
    the request and worked on it before the connection dropped with no answer (its worker died):
    that is no keep-alive race, and sending the request again would run it twice."""
    monkeypatch.setattr(h1client, "RESEND_WITHIN_S", 0.1, raising=False)

    async def works_then_dies(server, req, writer):
        if req["nth"] == 2:
            await asyncio.sleep(0.3)      # generating, then gone
            return False
        writer.write(answer())
        await writer.drain()

    async with Engine(works_then_dies) as eng:
        await _second_request_lost_once(eng, idle_s=0.1)   # idle long enough for an engine's keep-alive timeout


@on_both_loops
async def test_a_fresh_connection_closed_before_answering_is_not_retried():
    async def drops(server, req, writer):
        return False

    async with Engine(drops) as eng:
        pool = UpstreamPool()
        with pytest.raises(UpstreamDisconnected) as ei:
            await pool.post(eng.url + "/x", b"{}", JSON)
        assert not ei.value.received
        assert len(eng.requests) == 1
        with pytest.raises(UpstreamFailure) as fi:
            await open_leg(pool, eng.url + "/x", b"{}", JSON, None)
        assert fi.value.kind == "reset" and fi.value.retryable
        await pool.close()


@on_both_loops
async def test_idle_connections_expire_after_the_keepalive_timeout():
    async with Engine(ok) as eng:
        pool = UpstreamPool(keepalive_timeout=0.05)
        resp = await pool.post(eng.url + "/x", b"{}", JSON)
        await resp.read()
        resp.release()
        assert pool.open_connections == 1
        await asyncio.wait_for(eng.disconnected.wait(), GUARD)     # the pool closed it, the engine saw it
        assert pool.open_connections == 0
        resp = await pool.post(eng.url + "/x", b"{}", JSON)
        await resp.read()
        resp.release()
        assert eng.accepted == 2
        await pool.close()


@on_both_loops
async def test_max_connections_makes_requests_wait_for_a_free_connection():
    release = asyncio.Event()

    async def held(server, req, writer):
        if req["nth"] == 1:
            await release.wait()
        writer.write(answer())
        await writer.drain()

    async with Engine(held) as eng:
        pool = UpstreamPool(max_connections=1)
        first = asyncio.create_task(pool.post(eng.url + "/x", b"1", JSON))
        await until(lambda: len(eng.requests) == 1, GUARD)
        second = asyncio.create_task(pool.post(eng.url + "/x", b"2", JSON))
        await asyncio.sleep(0)
        assert not second.done() and pool.open_connections == 1
        release.set()
        r1 = await first
        await r1.read()
        r1.release()                      # the connection goes to the waiting request
        r2 = await second
        await r2.read()
        r2.release()
        assert eng.accepted == 1 and [r["body"] for r in eng.requests] == [b"1", b"2"]
        await pool.close()


# -- failures ----------------------------------------------------------------------------------


@on_both_loops
async def test_connect_refused():
    pool = UpstreamPool()
    url = f"http://127.0.0.1:{free_port()}/x"
    with pytest.raises(UpstreamConnectError):
        await pool.post(url, b"{}", JSON)
    with pytest.raises(UpstreamFailure) as fi:
        await open_leg(pool, url, b"{}", JSON, 5)
    assert fi.value.kind == "connect" and fi.value.retryable and "cannot connect" in fi.value.message
    assert pool.open_connections == 0
    await pool.close()


@on_both_loops
async def test_engine_closing_mid_body_is_an_error_after_the_bytes_it_sent():
    async def cut(server, req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        return False

    async def cut_chunked(server, req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n7\r\npartial\r\n")
        await writer.drain()
        return False

    for handle in (cut, cut_chunked):
        async with Engine(handle) as eng:
            pool = UpstreamPool()
            resp = await pool.post(eng.url + "/x", b"{}", JSON)
            assert await resp.readany() == b"partial"
            with pytest.raises(UpstreamDisconnected) as ei:
                await resp.readany()
            assert ei.value.received and not resp.at_eof()
            resp.release()                   # not reusable: closed
            assert pool.open_connections == 0
            await pool.close()


@on_both_loops
async def test_garbage_is_a_protocol_error():
    async def garbage(server, req, writer):
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()

    async with Engine(garbage) as eng:
        pool = UpstreamPool()
        with pytest.raises(UpstreamProtocolError):
            await pool.post(eng.url + "/x", b"{}", JSON)
        with pytest.raises(UpstreamFailure) as fi:
            await open_leg(pool, eng.url + "/x", b"{}", JSON, None)
        assert fi.value.kind == "protocol"
        await pool.close()


@on_both_loops
async def test_a_switch_of_protocols_nobody_asked_for_is_a_protocol_error(caplog):
    """A 101 answers a request that asked for an upgrade, which no leg does: the parser stops at
    it, and that is an engine not speaking HTTP as asked, as garbage is, not a connection that
    broke (the client would read a reset, and the loop log a fatal error of the transport)."""
    async def switch(server, req, writer):
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: upgrade\r\n\r\n")
        await writer.drain()

    async with Engine(switch) as eng:
        pool = UpstreamPool()
        with caplog.at_level("ERROR", logger="asyncio"):
            with pytest.raises(UpstreamProtocolError):
                await pool.post(eng.url + "/x", b"{}", JSON, GUARD)
            with pytest.raises(UpstreamFailure) as fi:
                await open_leg(pool, eng.url + "/x", b"{}", JSON, GUARD)
        assert fi.value.kind == "protocol"
        assert not [r for r in caplog.records if r.name == "asyncio"]
        assert pool.open_connections == 0
        await pool.close()


@on_both_loops
async def test_a_head_that_does_not_end_is_a_protocol_error_once_it_outgrows_the_bound():
    """An engine (or a proxy before it) that sends header bytes without end: the head is held
    only up to ``MAX_HEAD_BYTES``, not until the header timeout with all it sent meanwhile."""
    async def endless(server, req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Big: ")
        n = 0
        with contextlib.suppress(ConnectionError):
            while n < 32 * HEAD_BOUND:      # what the socket buffers take: the header timeout is not met
                writer.write(b"a" * 16384)
                await writer.drain()
                n += 16384
            await req["reader"].read(1)     # until the gateway drops the connection
        return False

    async with Engine(endless) as eng:
        pool = UpstreamPool()
        with pytest.raises(UpstreamFailure) as fi:
            await open_leg(pool, eng.url + "/x", b"{}", JSON, 3.0)
        assert fi.value.kind == "protocol" and "head" in fi.value.message
        await until(lambda: eng.closed == 1, GUARD)     # the connection was dropped
        # a head within the bound, in many reads, and a 1xx before it, is read as ever
        eng.handle = _head_in_pieces
        resp = await pool.post(eng.url + "/x", b"{}", JSON, GUARD)
        assert resp.status == 200 and len(resp.headers["x-big"]) == HEAD_BOUND // 2
        assert await resp.read() == b"{}"
        await pool.close()


@on_both_loops
async def test_the_head_of_a_large_binary_embeddings_answer_is_read():
    """vLLM's binary embeddings (``encoding_format: "bytes"``) say where each vector is in a
    ``metadata`` header of some 110 bytes a vector: for a batch of 2048 inputs, OpenAI's own bound,
    about 230 KB, which comes in many reads. It is an answer, not a head without end."""
    items = [{"index": i, "embed_dtype": "float32", "endianness": "native", "start": 4096 * i,
              "end": 4096 * (i + 1), "shape": [1024]} for i in range(2048)]
    meta = orjson.dumps({"id": "embd-1", "created": 1, "model": "m", "data": items,
                         "usage": {"prompt_tokens": 2048, "total_tokens": 2048}})
    assert len(meta) > 200_000

    async def binary(server, req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: 4\r\nmetadata: ")
        for i in range(0, len(meta), 8192):
            writer.write(meta[i:i + 8192])
            await writer.drain()
            await asyncio.sleep(0)          # the client's read takes what came: the head in pieces
        writer.write(b"\r\n\r\nabcd")
        await writer.drain()

    async with Engine(binary) as eng:
        pool = UpstreamPool()
        resp = await pool.post(eng.url + "/v1/embeddings", b"{}", JSON, GUARD)
        assert resp.status == 200 and resp.headers["metadata"] == meta.decode()
        assert await resp.read() == b"abcd"
        await pool.close()


async def _head_in_pieces(server, req, writer):
    writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Big: ")
    for _ in range(HEAD_BOUND // 2 // 1024):
        writer.write(b"a" * 1024)
        await writer.drain()
    writer.write(b"\r\n\r\n{}")
    await writer.drain()


@on_both_loops
async def test_no_head_within_the_header_timeout_drops_the_connection():
    async def silent(server, req, writer):
        await req["reader"].read()        # until the client goes away
        return False

    async with Engine(silent) as eng:
        pool = UpstreamPool()
        with pytest.raises(UpstreamTimeout):
            await pool.post(eng.url + "/x", b"{}", JSON, header_timeout=0.05)
        await asyncio.wait_for(eng.disconnected.wait(), GUARD)
        with pytest.raises(UpstreamFailure) as fi:
            await open_leg(pool, eng.url + "/x", b"{}", JSON, 0.05)
        assert fi.value.kind == "timeout" and not fi.value.retryable
        await pool.close()


@on_both_loops
async def test_one_timer_serves_head_deadlines_of_any_order():
    """A short header timeout started after a long one still fires first; the long one's exchange
    is untouched and gets its answer; nothing stays watched afterwards."""
    release = asyncio.Event()

    async def slow_or_silent(server, req, writer):
        if req["path"] == "/slow":
            await release.wait()
            writer.write(answer())
            await writer.drain()
            return True
        await req["reader"].read()
        return False

    async with Engine(slow_or_silent) as eng:
        pool = UpstreamPool()
        slow = asyncio.create_task(pool.post(eng.url + "/slow", b"{}", JSON, header_timeout=30.0))
        await until(lambda: pool._heads, GUARD)
        with pytest.raises(UpstreamTimeout):
            await pool.post(eng.url + "/silent", b"{}", JSON, header_timeout=0.05)
        assert not slow.done() and len(pool._heads) == 1
        release.set()
        resp = await asyncio.wait_for(slow, GUARD)
        assert resp.status == 200 and await resp.read() == b'{"ok":true}'
        resp.release()
        assert pool._heads == {}
        await pool.close()
        assert pool._head_timer is None


@on_both_loops
async def test_close_aborts_the_request_on_the_engine():
    """Closing a response mid-stream (client gone, watchdog) is how the engine learns to stop."""
    async def streams(server, req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"b\r\ndata: one\n\n\r\n")
        await writer.drain()
        assert await req["reader"].read() == b""   # blocks until the client drops the connection
        return False

    async with Engine(streams) as eng:
        pool = UpstreamPool()
        resp = await pool.post(eng.url + "/x", b"{}", JSON)
        assert await resp.readany() == b"data: one\n\n"
        resp.close()
        await asyncio.wait_for(eng.disconnected.wait(), GUARD)
        assert pool.open_connections == 0
        await pool.close()


@on_both_loops
async def test_a_closed_connection_is_freed_without_the_cycle_collector():
    """A gateway that goes idle after many streams ended runs no full collection: a connection
    the gateway closed must be freed by reference counting alone."""
    async def streams(server, req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"b\r\ndata: one\n\n\r\n")
        await writer.drain()
        assert await req["reader"].read() == b""
        return False

    async with Engine(streams) as eng:
        pool = UpstreamPool()
        resp = await pool.post(eng.url + "/x", b"{}", JSON)
        assert await resp.readany() == b"data: one\n\n"
        conn = weakref.ref(resp._conn)
        gc.disable()
        try:
            resp.close()
            await asyncio.wait_for(eng.disconnected.wait(), GUARD)
            await until(lambda: conn() is None, GUARD)
        finally:
            gc.enable()
        await pool.close()


@on_both_loops
async def test_cancelling_the_wait_for_the_head_drops_the_connection():
    async def silent(server, req, writer):
        await req["reader"].read()
        return False

    async with Engine(silent) as eng:
        pool = UpstreamPool()
        task = asyncio.create_task(pool.post(eng.url + "/x", b"{}", JSON))
        await until(lambda: len(eng.requests) == 1, GUARD)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(eng.disconnected.wait(), GUARD)
        await pool.close()



@on_both_loops
async def test_begin_writes_on_an_idle_connection_before_it_returns():
    """``begin`` on an idle keep-alive connection: the request is written before it returns (the
    P/D legs go out before any bookkeeping); without one, ``response`` connects and writes."""
    async with Engine(ok) as eng:
        pool = UpstreamPool()
        first = pool.begin(eng.url + "/x", b"first", JSON)
        assert not first.sent                 # no connection yet
        resp = await first.response()
        await resp.read()
        resp.release()
        state = SendState()
        second = pool.begin(eng.url + "/x", b"second", JSON, state)
        assert second.sent and state.sent
        resp = await second.response(5.0)
        assert resp.status == 200 and await resp.read() == b'{"ok":true}'
        resp.release()
        second.discard()                      # the answer was read: nothing to drop
        assert eng.accepted == 1 and [r["body"] for r in eng.requests] == [b"first", b"second"]
        assert pool.open_connections == 1
        await pool.close()


@on_both_loops
async def test_a_begun_exchange_on_a_stale_connection_is_sent_again_on_a_fresh_one(short_resend_idle):
    async with Engine(drops_second) as eng:
        pool = UpstreamPool()
        resp = await pool.post(eng.url + "/x", b"first", JSON)
        await resp.read()
        resp.release()
        await asyncio.sleep(0.1)
        x = pool.begin(eng.url + "/x", b"second", JSON)
        assert x.sent
        resp = await x.response()
        assert resp.status == 200 and await resp.read() == b'{"ok":true}'
        resp.release()
        assert [(r["conn"], r["body"]) for r in eng.requests] == [(1, b"first"), (1, b"second"), (2, b"second")]
        await pool.close()


async def _first_only(server, req, writer):
    """An engine that answers a connection's first request and holds its second until the client goes."""
    if req["nth"] == 1:
        writer.write(answer())
        await writer.drain()
        return None
    await req["reader"].read()
    return False


@on_both_loops
async def test_discarding_a_begun_exchange_drops_its_connection():
    """An exchange written but never awaited (its task was cancelled before it ran) must not leave
    the request running on the engine: ``discard`` closes its connection."""
    async with Engine(_first_only) as eng:
        pool = UpstreamPool()
        resp = await pool.post(eng.url + "/x", b"{}", JSON)
        await resp.read()
        resp.release()
        x = pool.begin(eng.url + "/x", b"{}", JSON)
        assert x.sent
        await until(lambda: len(eng.requests) == 2, GUARD)
        x.discard()
        await asyncio.wait_for(eng.disconnected.wait(), GUARD)
        assert pool.open_connections == 0
        bad = pool.begin("ftp://127.0.0.1/x", b"{}", JSON)   # raised where post() raises it
        with pytest.raises(UpstreamConnectError):
            await bad.response()
        await pool.close()


@on_both_loops
async def test_a_discarded_exchange_leaves_no_unretrieved_failure():
    """The P/D legs discard an exchange whose head nobody awaited (the client left, the prefill
    failed): the connection's end that follows must not leave a failed future no one reads, which
    asyncio logs as an error ("Future exception was never retrieved") when it is collected."""
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    try:
        async with Engine(_first_only) as eng:
            pool = UpstreamPool()
            resp = await pool.post(eng.url + "/x", b"{}", JSON)
            await resp.read()
            resp.release()
            x = pool.begin(eng.url + "/x", b"{}", JSON)
            assert x.sent
            await until(lambda: len(eng.requests) == 2, GUARD)
            x.discard()
            await asyncio.wait_for(eng.disconnected.wait(), GUARD)
            await asyncio.sleep(0)          # the transport's connection_lost callback
            del x
            gc.collect()
            await pool.close()
    finally:
        loop.set_exception_handler(None)
    assert [e.get("message") for e in errors] == []


@on_both_loops
async def test_send_state_says_whether_any_of_the_request_may_have_gone_out():
    """``sent`` stays False for a post that never wrote (refused; cancelled while waiting for a
    connection) and is True once the request was handed to a connection, however it ended."""
    release = asyncio.Event()

    async def held(server, req, writer):
        await release.wait()
        writer.write(answer())
        await writer.drain()

    refused = SendState()
    pool = UpstreamPool()
    with pytest.raises(UpstreamConnectError):
        await pool.post(f"http://127.0.0.1:{free_port()}/x", b"{}", JSON, state=refused)
    assert not refused.sent
    await pool.close()
    async with Engine(held) as eng:
        pool = UpstreamPool(max_connections=1)
        written, waiting = SendState(), SendState()
        first = asyncio.create_task(pool.post(eng.url + "/x", b"1", JSON, state=written))
        await until(lambda: len(eng.requests) == 1, GUARD)
        second = asyncio.create_task(pool.post(eng.url + "/x", b"2", JSON, state=waiting))
        await asyncio.sleep(0)
        first.cancel()
        second.cancel()
        for t in (first, second):
            with pytest.raises(asyncio.CancelledError):
                await t
        assert written.sent and not waiting.sent
        assert [r["body"] for r in eng.requests] == [b"1"]
        release.set()
        await pool.close()


# -- flow control ------------------------------------------------------------------------------


@on_both_loops
async def test_reading_pauses_while_the_unread_body_is_large_and_resumes_when_read():
    size = 32 * 1024 * 1024
    block = bytes(range(256)) * 256      # 64 KiB
    sent = []

    async def big(server, req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for _ in range(size // len(block)):
            writer.write(block)
            await writer.drain()
            sent.append(len(block))

    async with Engine(big) as eng:
        pool = UpstreamPool()
        resp = await pool.post(eng.url + "/x", b"{}", JSON)
        conn = resp._conn
        await until(lambda: conn.paused, GUARD)
        buffered = resp._size
        assert HIGH_WATER < buffered <= HIGH_WATER + 1024 * 1024     # bounded: one read past the mark
        assert sum(sent) < size                                     # the engine is held back
        total = len(await resp.readany())
        assert not conn.paused                                      # resumed once read
        while chunk := await resp.readany():
            total += len(chunk)
        assert total == size
        resp.release()
        assert pool.open_connections == 1
        await pool.close()


@on_both_loops
async def test_a_body_read_whole_is_read_on_as_it_comes_and_stops_at_its_limit(monkeypatch):
    """``read`` holds the whole body anyway: the engine's connection is read on as the bytes come,
    not paused every quarter MiB until the reading task wakes and takes them (a turn of the event
    loop apiece: behind every other request's on a loaded gateway). The body comes back exact and
    the connection goes back to the pool; with a limit, the read stops once past it, with no more
    than one read beyond it held."""
    size = 8 * 1024 * 1024
    block = bytes(range(256)) * 256      # 64 KiB
    resumed = []
    resume = h1client._Conn.resume

    def counted(conn):
        resumed.append(conn)
        resume(conn)
    monkeypatch.setattr(h1client._Conn, "resume", counted)

    async def big(server, req, writer):
        # the second answer's length is not said: it ends with the connection
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size if req["nth"] == 1 else
                     b"HTTP/1.1 200 OK\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            for _ in range(size // len(block)):
                writer.write(block)
                await writer.drain()
        return req["nth"] == 1

    async with Engine(big) as eng:
        pool = UpstreamPool()
        resp = await pool.post(eng.url + "/x", b"{}", JSON)
        body = await resp.read(2 * size)
        assert body == block * (size // len(block))
        assert resumed == []                         # never paused
        resp.release()
        assert pool.open_connections == 1
        resp = await pool.post(eng.url + "/x", b"{}", JSON)
        with pytest.raises(UpstreamTooLarge) as ei:
            await resp.read(2 * 1024 * 1024)
        assert 2 * 1024 * 1024 < ei.value.received <= 3 * 1024 * 1024 and resp._size == 0
        resp.close()
        await pool.close()


@on_both_loops
async def test_a_piped_body_goes_to_the_sink_from_the_read_callback_until_unpiped():
    """``pipe``: each read reaches the sink as it arrives; after ``unpipe`` later bytes are
    buffered for ``readany``, with reading paused above the high-water mark; the end is b""."""
    got = asyncio.Event()
    size = 8 * 1024 * 1024
    block = b"x" * 65536

    async def script(server, req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(3):
            event = b"data: %d\n\n" % i
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await got.wait()
            got.clear()
        for _ in range(size // len(block)):
            writer.write(b"%x\r\n%s\r\n" % (len(block), block))
            await writer.drain()
        writer.write(b"0\r\n\r\n")

    async with Engine(script) as eng:
        pool = UpstreamPool()
        resp = await pool.post(eng.url + "/x", b"{}", JSON)
        seen = bytearray()

        def sink(data: bytes) -> None:
            seen.extend(data)
            got.set()
            if len(seen) >= 2 * 9:          # the next two small events came: stop piping
                resp.unpipe()

        first = b""
        while len(first) < 9:               # (it may come with the head, or after)
            first += await resp.readany()
        assert first == b"data: 0\n\n"
        got.set()
        assert await resp.pipe(sink) is None
        assert bytes(seen) == b"data: 1\n\ndata: 2\n\n"
        conn = resp._conn
        await until(lambda: conn.paused, GUARD)           # buffered, bounded: nobody reads
        assert HIGH_WATER < resp._size <= HIGH_WATER + 1024 * 1024
        total = 0
        while chunk := await resp.readany():
            total += len(chunk)
        assert total == size
        resp.release()
        assert pool.open_connections == 1
        await pool.close()


@on_both_loops
async def test_a_pipe_raises_what_its_sink_raised_and_the_failure_after_the_bytes():
    """What the sink raises ends the pipe; an engine failure is raised after the bytes before it."""
    for fail in (True, False):
        await _pipe_until_failure(fail)


async def _pipe_until_failure(fail: bool) -> None:
    go = asyncio.Event()

    async def script(server, req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await go.wait()
        go.clear()
        writer.write(b"5\r\nhello\r\n")
        await writer.drain()
        await go.wait()
        writer.write(b"5\r\nworld\r\n")
        await writer.drain()
        return False                 # closes mid-body

    async with Engine(script) as eng:
        pool = UpstreamPool()
        resp = await pool.post(eng.url + "/x", b"{}", JSON)
        seen = []

        def sink(data: bytes) -> None:
            seen.append(data)
            go.set()
            if fail:
                raise ConnectionResetError("client gone")

        piped = asyncio.ensure_future(resp.pipe(sink))
        await until(lambda: resp.waiting, GUARD)
        go.set()
        if fail:
            with pytest.raises(ConnectionResetError):
                await piped
            assert seen == [b"hello"]
            resp.close()
        else:
            with pytest.raises(UpstreamDisconnected):
                await piped
            assert b"".join(seen) == b"helloworld"
        await pool.close()


# -- through the gateway ------------------------------------------------------------------------


async def _gateway_post(url: str, payload: dict, headers: dict | None = None) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=payload,
                                                    headers=headers or {}) as r:
        return r.status, await r.read()


def _chat(stream: bool, max_tokens: int = 5) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream,
            "max_tokens": max_tokens}


async def test_the_gateway_reuses_an_upstream_connection_once_an_answer_was_fully_read(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    for payload, fault in ((_chat(False), None), (_chat(True), None), (_chat(False), "status=503"),
                           (_chat(True), None)):
        status, _ = await _gateway_post(gw.url, payload, {"x-sim-fault": fault} if fault else None)
        assert status == (503 if fault else 200)
    assert gw.gw.upstream.open_connections == 1      # the probes and scrapes use their own session
    text = await gw.metrics_text()
    assert [metric(text, "switchyard_upstream_connections", state=st) for st in ("busy", "idle")] == [0, 1]


async def test_the_upstream_connections_gauge_counts_a_relayed_stream_busy_and_then_idle(sims, gateway):
    sim = await sims("vllm", "m", itl_ms=40)     # a stream of 0.8 s at least: scraped while it runs
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/chat/completions", json=_chat(True, 20)) as r:
        await r.content.readline()          # the stream is under way
        text = await gw.metrics_text()
        assert metric(text, "switchyard_upstream_connections", state="busy") == 1
        await r.read()
    text = await gw.metrics_text()
    assert [metric(text, "switchyard_upstream_connections", state=st) for st in ("busy", "idle")] == [0, 1]


async def test_the_total_timeout_bounds_the_whole_exchange(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], upstream={"total_timeout_s": 0.3})
    status, raw = await _gateway_post(gw.url, _chat(True, 20), {"x-sim-fault": "stall_after=3:10"})
    assert status == 200
    last = [b for b in raw.split(b"\n\n") if b.startswith(b"data:")][-1]
    assert orjson.loads(last[5:])["error"]["code"] == "upstream_timeout"
    status, raw = await _gateway_post(gw.url, _chat(False), {"x-sim-fault": "stall_before_first=10"})
    assert status == 504 and orjson.loads(raw)["error"]["code"] == "upstream_timeout"
    assert gw.gw.upstream.open_connections == 0      # both legs were dropped: the engine aborts


# -- warm connections: an idle connection the engine closes is opened again -------------------


async def _one(pool: UpstreamPool, url: str) -> None:
    resp = await pool.post(url + "/x", b"{}", JSON)
    await resp.read()
    resp.release()


@on_both_loops
async def test_an_idle_connection_the_engine_closes_is_opened_again_for_the_next_request():
    """vLLM and SGLang close a kept-alive connection after 5 idle seconds: the pool opens another
    at once, so the next request is written on a connection that was open before it came."""
    reopened: list[bool] = []
    async with Engine(ok, idle_timeout=1.0) as eng:
        pool = UpstreamPool(warm_connections=1, keepalive_timeout=30, on_reopen=reopened.append)
        pool.reopen_min_age = 0.2
        await _one(pool, eng.url)
        await until(lambda: eng.accepted >= 2)             # closed by the engine, opened again
        await until(lambda: reopened and all(reopened))
        sent_at = time.monotonic()
        await _one(pool, eng.url)
        last = eng.requests[-1]
        assert last["conn"] >= 2 and eng.accepted_at[last["conn"] - 1] < sent_at   # opened before it was sent
        await pool.close()


@on_both_loops
async def test_without_warm_connections_nothing_is_opened_after_the_engine_closes_one():
    async with Engine(ok, idle_timeout=0.3) as eng:
        pool = UpstreamPool(warm_connections=0, keepalive_timeout=30)
        pool.reopen_min_age = 0.1
        await _one(pool, eng.url)
        await asyncio.wait_for(eng.disconnected.wait(), GUARD)
        await asyncio.sleep(0.3)
        assert eng.accepted == 1 and pool.open_connections == 0
        await pool.close()


@on_both_loops
async def test_a_reopen_the_engine_refuses_is_counted_and_not_retried():
    reopened: list[bool] = []
    async with Engine(ok, idle_timeout=0.4) as eng:
        pool = UpstreamPool(warm_connections=1, keepalive_timeout=30, on_reopen=reopened.append)
        pool.reopen_min_age = 0             # any age is old enough: no wait before the listener goes
        await _one(pool, eng.url)
        # no longer listening, from the loop turn the answer was read in: the engine's idle close
        # (0.4 s on) is seen in a later turn, however late the loop runs, so the reopen is refused
        eng.server.close()                  # the kept connection goes now or when idle
        await until(lambda: reopened == [False])
        await asyncio.sleep(0.3)
        assert reopened == [False] and eng.accepted == 1 and pool.open_connections == 0
        await pool.close()


@on_both_loops
async def test_reopening_stops_at_the_pools_own_idle_horizon_and_for_a_connection_closed_at_once():
    async with Engine(ok, idle_timeout=0.3) as eng:
        pool = UpstreamPool(warm_connections=1, keepalive_timeout=1.0)
        pool.reopen_min_age = 0.1
        await _one(pool, eng.url)
        # past the pool's 1 s horizon since the last request: the last connection closed, none
        # opening (a connection lives 0.3 s at least, so four at most began within it)
        await until(lambda: eng.closed == eng.accepted >= 2 and pool.open_connections == 0
                    and not pool._reopening, timeout=GUARD)
        settled = eng.accepted
        assert 2 <= settled <= 4            # reopened while within it, then let go
        await asyncio.sleep(0.8)
        assert eng.accepted == settled and pool.open_connections == 0
        await pool.close()

    async def close_after_answer(server, req, writer):
        writer.write(answer())
        await writer.drain()
        return False

    async with Engine(close_after_answer) as eng:     # keeps nothing alive: no reopen loop
        pool = UpstreamPool(warm_connections=1, keepalive_timeout=30)
        await _one(pool, eng.url)
        await asyncio.sleep(0.3)
        assert eng.accepted == 1
        await pool.close()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_after_a_lull_the_openai_client_is_answered_on_a_connection_the_gateway_kept_warm(
        sims, gateway, engine, monkeypatch):
    """The simulated engine closes idle connections as vLLM and SGLang do (here after 1.2 s, not
    5 s); the gateway opens one again, and the request after the lull is written on it."""
    from openai import AsyncOpenAI

    connects: list[int] = []            # every connect, the pool's reopens included
    real_connect = UpstreamPool._connect

    async def connect(self, origin):
        connects.append(1)
        return await real_connect(self, origin)

    monkeypatch.setattr(UpstreamPool, "_connect", connect)
    sim = await sims(engine, "m", keepalive_timeout_s=1.2)
    gw = await gateway([model_block("m", engine, [sim.url])])
    pool = gw.gw.upstream.pool
    client = AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    try:
        first = await client.chat.completions.create(model="m", max_tokens=2, messages=msgs)
        assert first.choices[0].message.content
        [before] = list(pool._conns)
        await until(lambda: pool._conns and before not in pool._conns)     # closed by the engine, opened again
        second = await client.chat.completions.create(model="m", max_tokens=2, messages=msgs)
        assert second.choices[0].message.content
        text = await gw.metrics_text()
        [reopened] = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith('switchyard_upstream_connections_reopened_total{outcome="opened"}')]
        assert reopened >= 1
        assert len(connects) - reopened == 1        # only the first request's leg connected
    finally:
        await client.close()


async def test_a_switch_of_protocols_is_a_502_protocol_failure_through_the_gateway(gateway):
    async def switch(server, req, writer):
        if req["method"] == "GET":          # its health probes and scrapes
            writer.write(answer(b"{}"))
        else:
            writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: upgrade\r\n\r\n")
        await writer.drain()

    async with Engine(switch) as eng:
        gw = await gateway([model_block("m", "vllm", [eng.url])])
        with gw.gw.request_log.capture() as logs:
            async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/chat/completions", json=_chat(False)) as r:
                status, marker, err = r.status, r.headers.get("x-error-upstream"), (await r.json())["error"]
            await until(lambda: any(e["event"] == "request" for e in logs), GUARD)
        assert status == 502 and marker == "protocol" and "switched protocols" in err["message"], err
        assert [e["error_class"] for e in logs if e["event"] == "request"] == ["upstream_protocol"]
        assert gw.gw.pool.endpoints("m")[0].in_flight == 0 and gw.gw.upstream.open_connections == 0


async def test_an_engines_error_answer_whose_body_breaks_stalls_or_is_coded_is_still_its_status(gateway, monkeypatch):
    """An engine's error status came, its body did not as it should: cut short by the connection's
    end, a chunk framing it breaks, a stall past the bound on an error body's wait, or a coding
    the gateway does not decode. The client gets the engine's status (its Retry-After on a 503)
    with what came of the body it can read, not a 500 internal error or a wait for as long as the
    engine stalls; the connection is closed."""
    monkeypatch.setattr(relay, "ERROR_BODY_WAIT_S", 0.3, raising=False)
    head = "HTTP/1.1 {} X\r\nContent-Type: application/json\r\n{}\r\n"
    start = b'{"error":{"message":"busy"'

    async def errors(server, req, writer):
        if req["method"] == "GET":          # its health probes and scrapes
            writer.write(answer(b"{}"))
            await writer.drain()
            return True
        how = orjson.loads(req["body"])["user"]
        if how == "cut":
            writer.write(head.format(503, "Content-Length: 1000\r\n").encode() + start)
        elif how == "bad_chunk":
            writer.write(head.format(500, "Transfer-Encoding: chunked\r\n").encode() + b"zz\r\n" + start)
        elif how == "stall":
            writer.write(head.format(500, "Content-Length: 1000\r\n").encode() + start)
            await writer.drain()
            await req["reader"].read()      # until the gateway lets go
        else:
            coded = gzip.compress(start + b"}}")
            writer.write(head.format(500, f"Content-Encoding: gzip\r\nContent-Length: {len(coded)}\r\n").encode() + coded)
        await writer.drain()
        return False

    async with Engine(errors) as eng:
        gw = await gateway([model_block("m", "vllm", [eng.url])], health={"enabled": False},
                           retry={"enabled": False})
        got = {}
        with gw.gw.request_log.capture() as logs:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=GUARD)) as s:
                for how in ("cut", "bad_chunk", "stall", "gzip"):
                    for stream in (False, True):
                        body = {**_chat(stream), "user": how}
                        async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                            got[how, stream] = (r.status, r.headers.get("Retry-After"), (await r.json())["error"])
        said = 'upstream returned status {}: {{"error":{{"message":"busy"'
        for (how, stream), (status, retry_after, err) in got.items():
            assert err["code"] != "internal_error", (how, stream, err)
            if how == "cut":
                assert (status, retry_after, err["message"]) == (503, "5", said.format(503)), (how, stream)
            elif how == "gzip":
                assert (status, err["message"]) == (500, "upstream returned status 500"), (how, stream)
            else:
                assert status == 500 and err["message"] in (said.format(500), "upstream returned status 500"), (how, stream)
        assert [e["error_class"] for e in logs if e["event"] == "request"] == ["upstream_status"] * 8
        assert gw.gw.upstream.open_connections == 0
        text = await gw.metrics_text()
        assert [metric(text, "switchyard_upstream_connections", state=st) for st in ("busy", "idle")] == [0, 0]


async def test_a_retried_error_answer_whose_body_stalls_does_not_hold_the_retry(gateway, monkeypatch):
    """A 503 the gateway answers on another endpoint (its body the client never sees) is read to its
    end so its connection can be kept, for a short while at most: one whose body stalls is closed
    and the retry goes on, where it held the request for as long as the engine stalled."""
    monkeypatch.setattr(retry, "DISCARD_WAIT_S", 0.2, raising=False)

    async def busy(server, req, writer):
        if req["method"] == "GET":          # its health probes and scrapes
            writer.write(answer(b"{}"))
        else:
            writer.write(b"HTTP/1.1 503 X\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
            await writer.drain()
            await req["reader"].read()      # until the gateway lets go
            let_go.append(req)
        await writer.drain()

    let_go: list[dict] = []

    async def fine(server, req, writer):
        writer.write(answer(b"{}") if req["method"] == "GET" else answer(orjson.dumps(
            {"id": "c", "object": "chat.completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]})))
        await writer.drain()

    async with Engine(busy) as bad, Engine(fine) as good:
        gw = await gateway([model_block("m", "vllm", [bad.url, good.url])], health={"enabled": False},
                           routing={"strategy": "round-robin"})
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=GUARD)) as s:
            for _ in range(2):          # one of them goes to the busy engine first
                async with s.post(gw.url + "/v1/chat/completions", json=_chat(False)) as r:
                    assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"] == "hi"
        posts = [q for q in bad.requests if q["method"] == "POST"]
        assert posts
        await until(lambda: len(let_go) == len(posts), GUARD)       # the stalled answers' connections let go
