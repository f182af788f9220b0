"""Graceful drain as Kubernetes needs it: at SIGTERM /ready turns 503 while requests are still
served; after ``server.drain_delay_s`` new connections are refused; streams in flight finish;
the process exits 0. One test drives ``drain_and_stop`` in-process, one the real process."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import aiohttp
import openai
import orjson
import pytest
import yaml
from aiohttp import web

from gateway.server.app import NOT_READY_KEY
from gateway.server.run import drain_and_stop
from tests.support.edge import Resp, parse_responses, request
from tests.support.factories import model_block
from tests.support.fake_engine import fake_engine
from tests.support.ports import listen_port

BODY = {"model": "m", "messages": [{"role": "user", "content": "Count the wagons."}], "stream": True}


async def status_of(url: str) -> int | None:
    """HTTP status on a fresh connection, or None when the connection is refused."""
    try:
        async with aiohttp.ClientSession() as s, s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status
    except aiohttp.ClientConnectorError:
        return None


async def read_stream(resp: aiohttp.ClientResponse) -> tuple[int, bool]:
    """(content chunks, saw [DONE])"""
    chunks, done = 0, False
    async for line in resp.content:
        line = line.strip()
        if line == b"data: [DONE]":
            done = True
        elif line.startswith(b"data: "):
            ev = orjson.loads(line[6:])
            if ev.get("choices") and ev["choices"][0].get("delta", {}).get("content"):
                chunks += 1
    return chunks, done


async def poll(pred, timeout: float = 5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        v = await pred()
        if v or asyncio.get_running_loop().time() > deadline:
            return v
        await asyncio.sleep(0.05)


async def test_drain_serves_during_the_delay_then_refuses_and_lets_streams_finish(sims, gateway):
    sim = await sims("vllm", "m", itl_ms=25)
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    app = gw.runner.app
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.base_url + "/chat/completions", json={**BODY, "max_tokens": 60}) as stream:
            assert stream.status == 200
            await stream.content.readline()
            drain = asyncio.create_task(drain_and_stop(gw.runner, app, grace=10, delay=0.5))
            await asyncio.sleep(0)
            assert app[NOT_READY_KEY].is_set()
            assert await status_of(gw.url + "/ready") == 503
            # still inside the delay: a new request on a new connection is served normally
            async with aiohttp.ClientSession() as s2:
                async with s2.post(gw.base_url + "/chat/completions",
                                   json={**BODY, "stream": False, "max_tokens": 2}) as r:
                    assert r.status == 200
            # after the delay the listener is closed
            assert await poll(lambda: _refused(gw.url + "/health")), "listener still accepting"
            chunks, done = await read_stream(stream)
            assert done and chunks >= 50
    await asyncio.wait_for(drain, 10)


async def _refused(url: str) -> bool:
    return await status_of(url) is None


async def test_sigterm_on_the_real_process_drains_and_exits_0(sims, tmp_path):
    sim = await sims("vllm", "m", itl_ms=30)
    port = listen_port()
    cfg = {"listen": {"host": "127.0.0.1", "port": port},
           "server": {"shutdown_grace_s": 15, "drain_delay_s": 0.5, "log_format": "json"},
           "health": {"interval_s": 1}, "scrape": {"enabled": False},
           "models": [{"name": "m", "engine": "vllm", "endpoints": [sim.url]}]}
    path = tmp_path / "switchyard.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "--config", str(path), env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        assert await poll(lambda: _is(base + "/ready", 200), timeout=20), "gateway did not become ready"
        async with aiohttp.ClientSession() as s:
            for i in range(50):                             # their log lines are still buffered at SIGTERM
                async with s.post(base + "/v1/chat/completions", json={**BODY, "stream": False, "max_tokens": 1},
                                  headers={"x-request-id": f"before-{i}"}) as r:
                    assert r.status == 200
            async with s.post(base + "/v1/chat/completions", json={**BODY, "max_tokens": 60}) as stream:
                assert stream.status == 200
                await stream.content.readline()             # the stream is under way
                proc.send_signal(signal.SIGTERM)
                assert await poll(lambda: _is(base + "/ready", 503), timeout=3), "/ready did not turn 503"
                assert await poll(lambda: _refused(base + "/health"), timeout=5), "listener still accepting"
                chunks, done = await read_stream(stream)
        assert done and chunks >= 50, "the in-flight stream was cut"
        rc = await asyncio.wait_for(proc.wait(), 20)
        out = (await proc.stdout.read()).decode()
        assert rc == 0, out
        assert '"draining"' in out and '"listener closed"' in out
        lines = [orjson.loads(x) for x in out.splitlines() if '"event":"request"' in x]
        assert [x["request_id"] for x in lines[:50]] == [f"before-{i}" for i in range(50)]
        assert len(lines) == 51 and lines[-1]["stream"] is True      # no request line lost at SIGTERM
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _is(url: str, status: int) -> bool:
    return await status_of(url) == status


TOKEN_EVENT = (b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m",'
               b'"choices":[{"index":0,"delta":{"content":"wagon"},"finish_reason":null}]}\n\n')


async def test_a_stream_cut_at_the_end_of_the_grace_ends_with_a_clean_error_event(gateway):
    """An engine's read may end inside an event (TCP splits a large one anywhere): a stream the end
    of the grace period cuts then still ends with the shutting-down error event on its own, not
    glued onto the half event the client already had, whether the client asked for usage or not."""
    halves: asyncio.Queue[None] = asyncio.Queue()
    done = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(TOKEN_EVENT)
        await out.write(TOKEN_EVENT[:-20])      # the rest of this event never comes
        halves.put_nowait(None)
        await done.wait()
        return out

    async with fake_engine(chat) as url:
        try:
            for usage in (True, False):
                await _cut_after_half_an_event(gateway, url, halves, usage)
        finally:
            done.set()      # the engine's handlers end: its server closes at once


async def _cut_after_half_an_event(gateway, url: str, halves: asyncio.Queue, usage: bool) -> None:
    gw = await gateway([model_block("m", "vllm", [url])])
    oc = openai.AsyncOpenAI(base_url=gw.base_url, api_key="none", max_retries=0)
    extra = {"stream_options": {"include_usage": True}} if usage else {}
    stream = await oc.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}],
                                              stream=True, **extra)
    got = [await stream.__aiter__().__anext__()]
    assert got[0].choices[0].delta.content == "wagon"
    await asyncio.wait_for(halves.get(), 10)
    await asyncio.sleep(0.3)        # for the half event to reach the client, where it is passed on
    drain = asyncio.create_task(drain_and_stop(gw.runner, gw.runner.app, grace=0.2))
    with pytest.raises(openai.APIError) as e:       # not a JSONDecodeError on a glued line
        async for chunk in stream:
            got.append(chunk)
    assert "shutting down" in str(e.value), e.value
    assert [c.choices[0].delta.content for c in got] == ["wagon"], usage
    await asyncio.wait_for(drain, 10)
    await oc.close()


class Conn:
    """One kept-alive client connection, read by hand."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.data = reader, writer, b""

    @classmethod
    async def open(cls, port: int) -> Conn:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def ask(self, body: dict) -> Resp:
        self.writer.write(request("POST", "/v1/chat/completions", orjson.dumps(body)))
        return await self.answer()

    async def answer(self) -> Resp:
        async with asyncio.timeout(10):
            while True:
                got, rest = parse_responses(self.data, eof=False)
                if got:
                    self.data = rest
                    return got[0]
                chunk = await self.reader.read(65536)
                assert chunk, "the connection closed before its answer"
                self.data += chunk

    async def closed(self) -> bool:
        """Whether the server closes the connection (EOF, not a reset) without sending anything more."""
        async with asyncio.timeout(5):
            return await self.reader.read(1) == b""

    def close(self) -> None:
        self.writer.close()


async def test_the_drain_closes_every_connection_after_its_next_answer_and_idle_ones_with_the_listener(
        sims, gateway):
    """At the drain's start a pooled client learns to reconnect (elsewhere, once the load balancers
    caught up), as nginx and Envoy tell it: an answer still to be written says ``Connection: close``,
    a stream under way ends with its connection, and an idle kept-alive connection is served once
    more, with ``Connection: close``; none is closed under a client that may be sending on it while
    traffic still comes. Meanwhile every request is still served."""
    sim = await sims("vllm", "m", itl_ms=25)
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    whole = {**BODY, "stream": False, "max_tokens": 2}
    idle, streaming, waiting = await Conn.open(gw.port), await Conn.open(gw.port), await Conn.open(gw.port)
    drain = None
    try:
        first = await idle.ask(whole)
        assert first.status == 200 and first.headers.get("connection") != "close"
        streaming.writer.write(request("POST", "/v1/chat/completions", orjson.dumps({**BODY, "max_tokens": 20})))
        streaming.data = await streaming.reader.readuntil(b"data: ")       # the stream is under way
        waiting.writer.write(request("POST", "/v1/chat/completions", orjson.dumps({**whole, "max_tokens": 16})))
        async with asyncio.timeout(10):     # the whole answer is on its way from the engine
            while gw.gw.lifecycle.in_flight < 2:
                await asyncio.sleep(0.01)
        # a delay longer than the test: every step below happens while the listener still accepts
        drain = asyncio.create_task(drain_and_stop(gw.runner, gw.runner.app, grace=60, delay=30))
        answer = await waiting.answer()
        assert answer.status == 200 and answer.headers.get("connection") == "close", answer.headers
        assert await waiting.closed()
        streamed = await streaming.answer()
        assert streamed.status == 200 and streamed.body.rstrip().endswith(b"data: [DONE]")
        assert await streaming.closed(), "the stream's connection stayed open"
        again = await idle.ask(whole)       # the idle connection was left open, and is served once
        assert again.status == 200 and again.headers.get("connection") == "close", again.headers
        assert await idle.closed()
        fresh = await Conn.open(gw.port)      # a new connection in the delay is served, once
        try:
            later = await fresh.ask(whole)
            assert later.status == 200 and later.headers.get("connection") == "close", later.headers
            assert await fresh.closed()
        finally:
            fresh.close()
    finally:
        for c in (idle, streaming, waiting):
            c.close()
        if drain is not None:
            drain.cancel()
            await asyncio.gather(drain, return_exceptions=True)


async def test_an_idle_kept_alive_connection_closes_with_the_listener_not_with_a_503(sims, gateway):
    """A kept-alive connection no request came on during the delay is closed, silently, when the
    listener closes: its client's pool opens a new one (elsewhere) for its next request, where it
    would have got a 503 on it."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    idle = await Conn.open(gw.port)
    drain = None
    try:
        first = await idle.ask({**BODY, "stream": False, "max_tokens": 2})
        assert first.status == 200 and first.headers.get("connection") != "close"
        drain = asyncio.create_task(drain_and_stop(gw.runner, gw.runner.app, grace=60, delay=0.3))
        await asyncio.sleep(0)
        assert gw.runner.server.edge.connections == 1, "closed at the SIGTERM, while traffic still comes"
        assert await idle.closed(), "the idle kept-alive connection stayed open after the listener closed"
        assert not gw.runner.sites, "closed before the listener"
    finally:
        idle.close()
        if drain is not None:
            drain.cancel()
            await asyncio.gather(drain, return_exceptions=True)


async def test_an_sdk_whose_pooled_connection_the_drain_closes_asks_again_on_a_new_one(sims, gateway):
    """The openai SDK (httpx's pool) drops the connection its answer said ``Connection: close`` on
    and opens another for its next request: no error reaches the caller, without a retry."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    oc = openai.AsyncOpenAI(base_url=gw.base_url, api_key="none", max_retries=0)
    edge = gw.runner.server.edge
    drain = None
    try:
        ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        first = await oc.chat.completions.with_raw_response.create(**ask)
        assert first.headers.get("connection") != "close"
        assert edge.connections == 1
        drain = asyncio.create_task(drain_and_stop(gw.runner, gw.runner.app, grace=60, delay=30))
        await asyncio.sleep(0)
        told = await oc.chat.completions.with_raw_response.create(**ask)
        assert told.headers.get("connection") == "close"
        async with asyncio.timeout(5):      # the connection is closed on the gateway's side
            while edge.connections:
                await asyncio.sleep(0.01)
        again = await oc.chat.completions.create(**ask)
        assert again.choices[0].message.content
    finally:
        await oc.close()
        if drain is not None:
            drain.cancel()
            await asyncio.gather(drain, return_exceptions=True)


def _chunked(body: bytes) -> bytes:
    """A chat request whose body is chunked: aiohttp's request path, not the fast lane's."""
    head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: gateway.test\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n")
    return head.encode() + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"


async def _held_engine(go: asyncio.Event, asked: list[str]):
    """An engine whose stream sends one event, then waits for ``go`` before it ends; a request
    not streamed is answered at once."""
    async def chat(request: web.Request) -> web.StreamResponse:
        asked.append(request.headers.get("x-request-id", ""))
        if (await request.json()).get("stream"):
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await out.write(TOKEN_EVENT)
            await go.wait()
            await out.write(b"data: [DONE]\n\n")
            return out
        return web.json_response({"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "wagon"},
                                               "finish_reason": "stop"}]})
    return fake_engine(chat)


@pytest.mark.parametrize("path", ["lane", "aiohttp"])
async def test_a_request_pipelined_behind_a_stream_under_way_at_the_drain_is_answered(gateway, path):
    """A stream whose head went out before the drain (kept alive: it could not say
    ``Connection: close`` any more) ends with its connection; a request the client pipelined
    behind it, whose bytes the gateway read, is answered first, with ``Connection: close``, not
    dropped with the connection: the client, told nothing, could not know whether it was served,
    nor ask again (RFC 9112 §9.3.1: a POST is not retried blindly)."""
    go, asked = asyncio.Event(), []
    streamed = orjson.dumps({**BODY, "max_tokens": 40})
    first = request("POST", "/v1/chat/completions", streamed) if path == "lane" else _chunked(streamed)
    async with await _held_engine(go, asked) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        conn = await Conn.open(gw.port)
        drain = None
        try:
            conn.writer.write(first)
            conn.data = await conn.reader.readuntil(b"data: ")        # the stream is under way, kept alive
            conn.writer.write(request("POST", "/v1/chat/completions",
                                      orjson.dumps({**BODY, "stream": False, "max_tokens": 2})))
            async with asyncio.timeout(10):     # the gateway read the pipelined request
                while not any(p._e_pipelined for p in gw.runner.server._connections):
                    await asyncio.sleep(0.005)
            drain = asyncio.create_task(drain_and_stop(gw.runner, gw.runner.app, grace=60, delay=30))
            await asyncio.sleep(0)
            go.set()
            stream = await conn.answer()
            assert stream.status == 200 and stream.body.rstrip().endswith(b"data: [DONE]")
            assert stream.headers.get("connection") != "close"
            answer = await conn.answer()
            assert answer.status == 200 and answer.headers.get("connection") == "close", answer.headers
            assert answer.json()["choices"][0]["message"]["content"] == "wagon"
            assert await conn.closed()
            assert len(asked) == 2
        finally:
            go.set()
            conn.close()
            if drain is not None:
                drain.cancel()
                await asyncio.gather(drain, return_exceptions=True)


async def test_a_request_pipelined_behind_an_answer_that_says_close_is_not_read(gateway):
    """An answer whose head goes out after the drain began says ``Connection: close``; a request
    the client pipelined behind it is not served (RFC 9112 §9.6: its client knows from the close
    that it was not, and sends it again), and the connection ends cleanly behind the answer (no
    reset that could destroy it before the client read it)."""
    asked: list[str] = []
    go = asyncio.Event()

    async def chat(request: web.Request) -> web.Response:
        asked.append(request.headers.get("x-request-id", ""))
        await go.wait()             # held until the drain began
        return web.json_response({"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "wagon"},
                                               "finish_reason": "stop"}]})

    whole = {**BODY, "stream": False, "max_tokens": 2}
    async with fake_engine(chat) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        conn = await Conn.open(gw.port)
        drain = None
        try:
            conn.writer.write(request("POST", "/v1/chat/completions", orjson.dumps(whole), {"x-request-id": "one"})
                              + request("POST", "/v1/chat/completions", orjson.dumps(whole), {"x-request-id": "two"}))
            async with asyncio.timeout(10):     # the first is with the engine, the second read behind it
                while not asked or not any(p._e_pipelined for p in gw.runner.server._connections):
                    await asyncio.sleep(0.005)
            drain = asyncio.create_task(drain_and_stop(gw.runner, gw.runner.app, grace=60, delay=30))
            await asyncio.sleep(0)
            go.set()
            answer = await conn.answer()
            assert answer.status == 200 and answer.headers.get("connection") == "close", answer.headers
            assert answer.headers["request-id"] == "one"
            assert await conn.closed()
            assert asked == ["one"]
        finally:
            go.set()
            conn.close()
            if drain is not None:
                drain.cancel()
                await asyncio.gather(drain, return_exceptions=True)
