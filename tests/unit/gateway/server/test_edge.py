"""The edge's pieces without sockets: config keys, the error shape, and the aiohttp internals
gateway/server/edge.py leans on (these tests break first if an aiohttp upgrade moves them)."""

from __future__ import annotations

import asyncio
import inspect
import re
import sys
from pathlib import Path

import orjson
import pytest
from aiohttp import web, web_protocol
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong, TransferEncodingError

from gateway.config.schema import ConfigError, config_from_dict, parse_config
from gateway.server.edge import (
    Edge,
    EdgeLimits,
    EdgeProtocol,
    EdgeRunner,
    EdgeServer,
    error_response_bytes,
    inline_request_handlers,
)


def test_server_block_defaults_and_limits_follow_config():
    cfg = config_from_dict({"models": []})
    limits = EdgeLimits.from_config(cfg.server)
    assert limits == EdgeLimits()      # the defaults agree in config.py and edge.py
    assert (limits.header_timeout_s, limits.body_timeout_s, limits.body_total_timeout_s,
            limits.keepalive_timeout_s, limits.write_stall_timeout_s) == (10.0, 30.0, 120.0, 75.0, 30.0)
    assert (limits.max_connections, limits.max_header_bytes, limits.max_headers) == (10000, 16384, 100)
    cfg = config_from_dict({"server": {"header_timeout_s": 0.5, "max_connections": 3, "max_headers": 20},
                            "models": []})
    limits = EdgeLimits.from_config(cfg.server)
    assert (limits.header_timeout_s, limits.max_connections, limits.max_headers) == (0.5, 3, 20)
    kw = limits.handler_kwargs()
    assert kw["max_headers"] == 20 and kw["max_field_size"] == kw["max_line_size"] == 16384
    # aiohttp's own keep-alive timer is only a backstop behind ours
    assert kw["keepalive_timeout"] > limits.keepalive_timeout_s + limits.header_timeout_s


@pytest.mark.parametrize("text,key", [
    ("server: {header_timeout_s: -1}", "server.header_timeout_s"),
    ("server: {body_timeout_s: soon}", "server.body_timeout_s"),
    ("server: {max_connections: 1.5}", "server.max_connections"),
    ("server: {max_header_bytes: 100}", "server.max_header_bytes"),
    ("server: {max_headers: 2}", "server.max_headers"),
    ("server: {write_stall_timeout: 3}", "server.write_stall_timeout"),
])
def test_server_edge_keys_are_validated_by_name(text, key):
    with pytest.raises(ConfigError) as ei:
        parse_config(text, source="conf.yaml")
    assert ei.value.key_path == key


def test_raw_error_answer_is_http_and_openai_shaped():
    raw = error_response_bytes(408, "slow", code="request_timeout", request_id="abc")
    head, body = raw.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 408 Request Timeout"
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert headers["Connection"] == "close" and headers["request-id"] == "abc"
    assert int(headers["Content-Length"]) == len(body)
    err = orjson.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "request_timeout"


def test_classification_of_parser_errors():
    edge = Edge(EdgeLimits(max_header_bytes=2048, max_headers=10))
    assert edge.classify(400, LineTooLong(b"x" * 10, 2048), None)[0] == 431
    assert edge.classify(400, BadHttpMessage("Too many headers received"), None)[0:3:2] == (431, "too_many_headers")
    status, msg, code = edge.classify(400, TransferEncodingError("bad chunk"), None)
    assert (status, code) == (400, "bad_request") and "bad chunk" in msg
    assert edge.classify(500, web.RequestPayloadError("x"), None)[0] == 400
    assert edge.classify(500, RuntimeError("boom"), None)[0:3:2] == (500, "internal_error")
    assert edge.classify(504, None, None)[0] == 504


# -- the aiohttp hooks edge.py relies on (semi-private in 3.14) ----------------------------------

def test_aiohttp_runner_builds_its_server_in_make_server():
    """EdgeRunner overrides BaseRunner._make_server, and reads the Server's handler kwargs."""
    assert inspect.iscoroutinefunction(web.AppRunner._make_server)
    assert "_make_server" in inspect.getsource(web.BaseRunner.setup)
    init = inspect.getsource(web.Server.__init__)
    assert "self._kwargs = kwargs" in init and "self.request_factory" in init
    assert "self._kwargs" in inspect.getsource(web.Server.__call__)


def test_aiohttp_request_handler_hooks_exist():
    rh = web.RequestHandler
    assert "_request_count" in rh.__slots__
    assert "self._request_count += 1" in inspect.getsource(rh.data_received)
    assert list(inspect.signature(rh.handle_error).parameters) == ["self", "request", "status", "exc", "message"]
    assert list(inspect.signature(rh.finish_response).parameters) == ["self", "request", "resp", "start_time"]
    # the protocol answers parse errors through handle_error, and every request via finish_response
    assert "self.handle_error(" in inspect.getsource(rh._make_error_handler)
    # with the module's ERROR as the request's message (the edge tells such a request by it)
    assert "message = ERROR" in inspect.getsource(rh.start)
    assert web_protocol.ERROR.method == "UNKNOWN"
    assert "self.finish_response(" in inspect.getsource(rh._handle_request)
    # and it reads the handler and the request factory off its manager (our EdgeServer)
    init = inspect.getsource(rh.__init__)
    assert "manager.request_handler" in init and "manager.request_factory" in init
    # the request factory gets the protocol, and the request's task is the connection's task
    assert "self._request_factory(" in inspect.getsource(rh.start)
    assert "self._task_handler or asyncio.current_task" in inspect.getsource(rh.start)
    # flow control: the body's StreamReader pauses the protocol; aiohttp re-parses on resume
    assert list(inspect.signature(rh.resume_reading).parameters) == ["self", "resume_parser"]
    assert "self.data_received(b\"\")" in inspect.getsource(rh.resume_reading)
    # a payload error after the handler: aiohttp marks the body so, which the edge must tell
    # apart from a broken body (tests/integration/server/test_edge_slow.py has the behaviour)
    assert "payload.set_exception(_PAYLOAD_ACCESS_ERROR)" in inspect.getsource(rh.start)
    # a read the parser refuses is queued as an _ErrInfo, after the requests parsed before it in
    # earlier reads (the edge feeds the parser a request at a time, and stops after a refusal)
    received = inspect.getsource(rh.data_received)
    assert "messages = [\n                    (_ErrInfo(status=400" in received
    assert "self._messages.append((msg, payload))" in received


def test_aiohttp_request_stream_and_decoder_an_x_gzip_body_uses():
    """A body in x-gzip (gateway/server/edge.py ``XGzipBody``) is given its stream in place of the
    parser's: the request's stream is ``_payload``, which ``content`` (reified in ``_cache``), ``read``,
    ``multipart`` and ``release`` read; the stream's reads wait on ``_wait`` when nothing is buffered,
    and it keeps its connection's protocol (``_protocol``); gzip is decoded by the parser's ``DeflateBuffer``, which reports output it still holds."""
    from aiohttp.helpers import reify
    from aiohttp.http_parser import DeflateBuffer
    from aiohttp.streams import StreamReader
    br = web.BaseRequest
    assert isinstance(vars(br)["content"], reify) and "return self._payload" in inspect.getsource(br.content.wrapped)
    assert "_payload" in br.ATTRS and "_cache" in br.ATTRS
    for method in (br.read, br.multipart, br.release):
        assert "self._payload" in inspect.getsource(method), method
    for method in (StreamReader.readany, StreamReader.read, StreamReader.readchunk, StreamReader.readuntil):
        assert "await self._wait(" in inspect.getsource(method), method
    assert list(inspect.signature(StreamReader._wait).parameters) == ["self", "func_name"]
    # the stream's protocol (the connection's), which a body that does not decode is answered on
    assert "_protocol" in StreamReader.__slots__ and "self._protocol = protocol" in inspect.getsource(StreamReader)
    assert list(inspect.signature(DeflateBuffer).parameters) == ["out", "encoding", "max_decompress_size"]
    assert "return self.decompressor.data_available" in inspect.getsource(DeflateBuffer.feed_data)


def test_aiohttp_hooks_a_drain_closes_connections_with():
    """At the drain's start (``EdgeServer.drain``) the edge walks the server's connections
    (``Server._connections``), and makes the answers to come close theirs: a request's ``keep_alive``
    is reified into its ``_cache``, which aiohttp's responses read when they prepare, and
    ``StreamResponse.force_close`` makes the connection close after an answer already under way."""
    from aiohttp.helpers import reify
    assert "self._connections[handler] = transport" in inspect.getsource(web.Server.connection_made)
    br = web.BaseRequest
    assert isinstance(vars(br)["keep_alive"], reify) and "_cache" in br.ATTRS
    assert "keep_alive = request.keep_alive" in inspect.getsource(web.StreamResponse._prepare_headers)
    assert "self._keep_alive = False" in inspect.getsource(web.StreamResponse.force_close)
    assert "self._keepalive = bool(resp.keep_alive)" in inspect.getsource(web.RequestHandler.start)


def test_aiohttp_state_the_fast_lane_keeps_in_step():
    """The fast lane (gateway/server/lane.py) takes a request beside aiohttp's protocol: it reads and
    sets these of its state, with the meaning pinned here."""
    rh = web.RequestHandler
    for name in ("_messages", "_payload_parser", "_upgraded", "_force_close", "_close", "_request_count",
                 "_next_keepalive_close_time", "_keepalive_timeout", "_request_in_progress", "_handler_waiter"):
        assert any(name in vars(c).get("__slots__", ()) for c in rh.__mro__), name
    # the keep-alive backstop closes an idle connection once its close time passed: pushed on while a lane
    # request runs, set again after it
    keepalive = inspect.getsource(rh._process_keepalive)
    assert "close_time = self._next_keepalive_close_time" in keepalive and "self.force_close()" in keepalive
    # a graceful shutdown waits for a request in progress on _handler_waiter, which the lane resolves
    shutdown = inspect.getsource(rh.shutdown)
    assert "if self._request_in_progress:" in shutdown and "await self._handler_waiter" in shutdown
    # aiohttp's own data path refuses bytes once the connection is closing (the lane does too)
    assert "if self._force_close or self._close:" in inspect.getsource(rh.data_received)
    # a client that stops reading: the lane's writer waits as aiohttp's StreamWriter does
    from aiohttp.base_protocol import BaseProtocol
    assert "_paused" in BaseProtocol.__slots__ and callable(BaseProtocol._drain_helper)


async def test_edge_runner_makes_edge_protocols_with_the_limits():
    edge = Edge(EdgeLimits(max_headers=20, max_header_bytes=4096))
    runner = EdgeRunner(web.Application(), edge, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        server = runner.server
        assert isinstance(server, EdgeServer) and server.handler_cancellation
        proto = server()
        assert isinstance(proto, EdgeProtocol)
        assert (proto.max_headers, proto.max_field_size, proto.max_line_size) == (20, 4096, 4096)
        assert proto.keepalive_timeout == edge.limits.handler_kwargs()["keepalive_timeout"]
    finally:
        await runner.cleanup()


async def test_a_client_that_keeps_up_costs_no_timer_per_chunk():
    """Write flow control arms the stall timer only while the transport is paused."""
    edge = Edge(EdgeLimits(write_stall_timeout_s=5.0))
    runner = EdgeRunner(web.Application(), edge, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        proto = runner.server()
        assert proto._e_stall is None
        proto.pause_writing()
        assert isinstance(proto._e_stall, asyncio.TimerHandle)
        proto.resume_writing()
        assert proto._e_stall is None
    finally:
        await runner.cleanup()


def test_aiohttp_starts_each_request_as_a_task_it_awaits_at_once():
    """What ``inline_request_handlers`` relies on (Python 3.11): the connection task creates the
    request's task from ``_handle_request`` with ``loop.create_task`` and awaits it right away."""
    src = inspect.getsource(web.RequestHandler.start)
    assert "coro = self._handle_request(request, start, request_handler)" in src
    assert "task = loop.create_task(coro)" in src
    assert "resp, reset = await task" in src
    assert inspect.iscoroutinefunction(web.RequestHandler._handle_request)


def test_no_context_variables_in_the_gateway():
    """The handler runs in the connection's task, so a ContextVar set by one request would be seen
    by the next on the same connection: the gateway's own code sets none."""
    root = Path(__file__).resolve().parents[4]
    pattern = re.compile(r"\bContextVar\b|contextvars|bind_contextvars")
    found = [str(p.relative_to(root)) for d in ("gateway", "routers", "handlers")
             for p in (root / d).rglob("*.py") if pattern.search(p.read_text())]
    assert found == []


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12 starts the request's task eagerly")
async def test_the_handler_runs_in_the_connection_task_and_a_disconnect_cancels_it():
    loop = asyncio.get_running_loop()
    assert inline_request_handlers(loop)
    try:
        assert not inline_request_handlers(loop)        # never over a factory already there
        seen: dict[str, object] = {}
        entered, gone = asyncio.Event(), asyncio.Event()

        async def handler(request: web.Request) -> web.StreamResponse:
            seen["task"] = asyncio.current_task()
            seen["request_task"] = request.task
            if request.path == "/hang":
                entered.set()
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    gone.set()
                    raise
            return web.Response(text="ok")

        async def other() -> str:
            return "a task"

        t = asyncio.create_task(other())            # every other task is a real task
        assert isinstance(t, asyncio.Task) and await t == "a task"
        app = web.Application()
        app.router.add_get("/ok", handler)
        app.router.add_get("/hang", handler)
        runner = EdgeRunner(app, Edge(EdgeLimits()), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            tasks = []
            for _ in range(2):                        # kept alive: the same connection task each time
                writer.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
                await writer.drain()
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200")
                await reader.readexactly(2)
                assert seen["task"] is seen["request_task"]
                tasks.append(seen["task"])
            assert tasks[0] is tasks[1]
            writer.write(b"GET /hang HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            async with asyncio.timeout(5):
                await entered.wait()
            assert seen["task"] is tasks[0]
            writer.close()                            # the client goes: the handler is cancelled
            async with asyncio.timeout(5):
                await gone.wait()
        finally:
            await runner.cleanup()
    finally:
        loop.set_task_factory(None)
