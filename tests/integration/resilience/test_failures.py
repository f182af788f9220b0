"""Failure semantics before and after headers, retries, watchdog, client disconnect, drain."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from functools import partial

import aiohttp
import anthropic
import openai
import orjson
import pytest
from aiohttp import web

from tests.support.factories import model_block
from tests.support.fake_engine import fake_engine
from tests.support.http import anthropic_client, chat_body, openai_client, post, sim_state, sse_events
from tests.support.metrics import metric
from tests.support.waiting import until, wait_for

CHAT = [{"role": "user", "content": "hello there"}]
body = partial(chat_body, CHAT, stream=False, max_tokens=10)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_engine_error_before_headers_keeps_status_in_openai_shape(sims, gateway, engine):
    sim = await sims(engine, "m")
    gw = await gateway([model_block("m", engine, [sim.url])])
    st, hdrs, raw = await post(gw.url, body(), {"x-sim-fault": "status=503"})
    assert st == 503
    err = orjson.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert hdrs["request-id"] and hdrs["target-pod"]
    client = openai_client(gw)
    with pytest.raises(openai.InternalServerError):
        await client.chat.completions.create(**body(), extra_headers={"x-sim-fault": "status=500"})
    await client.close()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_in_stream_engine_error_reaches_the_client(sims, gateway, engine):
    sim = await sims(engine, "m")
    gw = await gateway([model_block("m", engine, [sim.url])])
    st, _, raw = await post(gw.url, body(stream=True), {"x-sim-fault": "error_after=3"})
    assert st == 200
    events = sse_events(raw)
    assert any(isinstance(e, dict) and "error" in e for e in events)
    client = openai_client(gw)
    stream = await client.chat.completions.create(**body(stream=True), extra_headers={"x-sim-fault": "error_after=3"})
    with pytest.raises(openai.APIError):
        async for _ in stream:
            pass
    await client.close()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_engine_dropping_mid_stream_gives_a_final_error_event(sims, gateway, engine):
    sim = await sims(engine, "m")
    gw = await gateway([model_block("m", engine, [sim.url])])
    st, _, raw = await post(gw.url, body(stream=True, max_tokens=20), {"x-sim-fault": "drop_after=3"})
    assert st == 200
    events = sse_events(raw)
    assert isinstance(events[-1], dict) and "error" in events[-1]
    assert events[-1]["error"]["code"] == "upstream_incomplete"
    text = await gw.metrics_text()
    assert "switchyard_upstream_errors_total" in text


async def test_engine_dropping_non_stream_is_502(sims, gateway):
    # a non-streaming engine sends nothing until the answer is done, so a drop is a reset before
    # any byte: 502, after one retry elsewhere when there is an elsewhere
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    st, hdrs, raw = await post(gw.url, body(max_tokens=20), {"x-sim-fault": "drop_after=3"})
    assert st == 502
    assert hdrs["x-error-upstream"] == "reset"
    assert orjson.loads(raw)["error"]["code"] == "upstream_unavailable"


async def test_connect_refused_is_retried_on_another_endpoint(sims, gateway):
    good = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", ["http://127.0.0.1:9", good.url])],
                       health={"interval_s": 60}, routing={"strategy": "round-robin"})
    for _ in range(2):
        st, hdrs, _ = await post(gw.url, body())
        assert st == 200
        assert hdrs["target-pod"] == good.url.split("//")[1]
    text = await gw.metrics_text()
    assert 'switchyard_retries_total{model="m"} 1.0' in text       # the dead one was then taken out
    dead = [ep for ep in gw.gw.pool.endpoints() if ep.port == 9][0]
    assert not dead.ready


async def test_all_endpoints_refusing_is_502(gateway):
    gw = await gateway([model_block("m", "vllm", ["http://127.0.0.1:9"])], health={"interval_s": 60})
    st, hdrs, raw = await post(gw.url, body())
    assert st == 502
    assert hdrs["x-error-upstream"] == "connect"
    assert "cannot connect" in orjson.loads(raw)["error"]["message"]


async def test_a_connect_timeout_is_retried_elsewhere_and_does_not_open_the_breaker_at_once(sims, gateway):
    """An engine whose listen queue is full (a burst it has not accepted yet) lets connects time
    out: the request is tried on another endpoint, and the fault is counted as any other, not as
    a refused connection (which with ``health.passive`` opens the breaker at once)."""
    good = await sims("vllm", "m")
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    fillers = []
    try:
        for _ in range(4):      # the queue takes one; the SYNs of the others, and the gateway's, are dropped
            c = socket.socket()
            c.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                c.connect(full.getsockname())
            fillers.append(c)
        url = f"http://127.0.0.1:{full.getsockname()[1]}"
        gw = await gateway([model_block("m", "vllm", [url, good.url])], upstream={"connect_timeout_s": 0.3},
                           health={"interval_s": 60}, routing={"strategy": "round-robin"})
        st, hdrs, _ = await post(gw.url, body())
        assert st == 200 and hdrs["target-pod"] == good.url.split("//")[1]
        text = await gw.metrics_text()
        assert metric(text, "switchyard_retries_total", model="m") == 1
        assert metric(text, "switchyard_upstream_errors_total", error_class="connect") == 1
        slow = [ep for ep in gw.gw.pool.endpoints() if ep.url == url][0]
        assert slow.ready and gw.gw.upstream.breakers.state(slow) == "closed"
    finally:
        for c in fillers:
            c.close()
        full.close()


@pytest.mark.parametrize("fault", ["slow_headers=5", "stall_before_first=10"])
async def test_no_answer_within_the_first_byte_timeout_is_504(sims, gateway, fault):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], upstream={"first_byte_timeout_s": 0.3})
    st, _, raw = await post(gw.url, body(), {"x-sim-fault": fault})
    assert st == 504
    assert orjson.loads(raw)["error"]["code"] == "upstream_timeout"
    if fault.startswith("slow_headers"):
        return  # the sim finished generating before its slow headers; nothing left to abort
    # the upstream leg was closed, so the engine aborted the request
    assert await wait_for(lambda: _aborted(sim.url), timeout=5)


async def _aborted(url) -> bool:
    st = await sim_state(url)
    return st["counts"]["aborted"] >= 1 and not st["running"]


async def test_watchdog_first_chunk_on_sglang_is_504_before_headers(sims, gateway):
    sim = await sims("sglang", "m")
    gw = await gateway([model_block("m", "sglang", [sim.url])],
                       watchdog={"first_chunk_timeout_s": 0.3, "aggregated": True})
    st, hdrs, raw = await post(gw.url, body(stream=True), {"x-sim-fault": "stall_before_first=10"})
    assert st == 504
    assert await wait_for(lambda: _aborted(sim.url), timeout=8)
    # a plain leg's fire is counted as a P/D decode's is (docs/resilience.md)
    assert 'switchyard_watchdog_fires_total{model="m",phase="first_chunk"} 1.0' in await gw.metrics_text()


async def test_watchdog_idle_mid_stream_sends_error_event_and_aborts(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       watchdog={"idle_timeout_s": 0.3, "first_chunk_timeout_s": 5, "aggregated": True})
    st, _, raw = await post(gw.url, body(stream=True, max_tokens=20), {"x-sim-fault": "stall_after=3:10"})
    assert st == 200
    events = sse_events(raw)
    assert "error" in events[-1] and events[-1]["error"]["code"] == "upstream_timeout"
    assert await wait_for(lambda: _aborted(sim.url), timeout=5)
    text = await gw.metrics_text()
    assert "watchdog_idle" in text and 'switchyard_watchdog_fires_total{model="m",phase="idle"} 1.0' in text


@pytest.mark.parametrize("fault,phase", [("stall_after=3:4", "idle"), ("stall_before_first=4", "first_chunk")])
async def test_watchdog_is_not_kept_quiet_by_keepalive_comments(sims, gateway, fault, phase):
    """A stalled engine that still sends SSE keep-alive comments (vLLM's --sse-keep-alive-interval,
    or a proxy in front of it) makes no progress: the first-chunk bound waits for its first event
    with data and the idle bound for its next one. The comments still reach the client; the leg is
    cut, the engine told, and the client gets the timeout's error event."""
    sim = await sims("vllm", "m", sse_keepalive_s=0.05)
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       watchdog={"idle_timeout_s": 0.4, "first_chunk_timeout_s": 0.4, "aggregated": True})
    st, _, raw = await post(gw.url, body(stream=True, max_tokens=20), {"x-sim-fault": fault})
    assert st == 200
    assert b": keep-alive\n\n" in raw
    events = sse_events(raw)
    assert "error" in events[-1] and events[-1]["error"]["code"] == "upstream_timeout", events[-1]
    assert await wait_for(lambda: _aborted(sim.url), timeout=8)
    text = await gw.metrics_text()
    assert f'switchyard_watchdog_fires_total{{model="m",phase="{phase}"}} 1.0' in text


async def test_watchdog_response_timeout_bounds_a_non_streaming_answer(sims, gateway):
    """Engines send a non-streaming answer's headers with its body, so the response bound must
    cover the wait for the headers too, not only the body read."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       watchdog={"response_timeout_s": 0.3, "aggregated": True})
    st, hdrs, raw = await post(gw.url, body(stream=False), {"x-sim-fault": "stall_before_first=10"})
    assert st == 504 and orjson.loads(raw)["error"]["code"] == "upstream_timeout"
    assert await wait_for(lambda: _aborted(sim.url), timeout=8)
    assert 'switchyard_watchdog_fires_total{model="m",phase="response"} 1.0' in await gw.metrics_text()


async def test_watchdog_is_off_for_aggregated_legs_by_default(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], watchdog={"idle_timeout_s": 0.1})
    st, _, raw = await post(gw.url, body(stream=True, max_tokens=5), {"x-sim-fault": "stall_after=2:0.4"})
    assert st == 200
    assert sse_events(raw)[-1] == "[DONE]"


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_client_disconnect_mid_stream_aborts_the_engine(sims, gateway, engine):
    sim = await sims(engine, "m", itl_ms=50)
    gw = await gateway([model_block("m", engine, [sim.url])])
    async with aiohttp.ClientSession() as s:
        resp = await s.post(gw.url + "/v1/chat/completions", json=body(stream=True, max_tokens=500))
        assert resp.status == 200
        await resp.content.readline()       # some bytes arrived: the stream is live
        assert (await sim_state(sim.url))["running"]
        resp.close()                        # the client goes away
    assert await wait_for(lambda: _aborted(sim.url), timeout=8)
    assert await wait_for(lambda: gw.gw.lifecycle.in_flight == 0, timeout=5)
    text = await gw.metrics_text()
    assert 'switchyard_client_cancels_total{model="m",stage="streaming"} 1.0' in text
    assert 'switchyard_time_to_first_token_seconds_count{model="m"} 1.0' in text     # it had its first token


async def test_client_disconnect_while_waiting_for_a_non_stream_answer(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(gw.url + "/v1/chat/completions", json=body(),
                                          headers={"x-sim-fault": "stall_before_first=30"}))
        assert await wait_for(lambda: _running(sim.url), timeout=5)
        task.cancel()
    assert await wait_for(lambda: _aborted(sim.url), timeout=8)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("continuable", [False, True])
async def test_a_client_reset_read_with_the_engines_head_is_a_client_cancel(sims, gateway, monkeypatch, engine,
                                                                           continuable):
    """The client's reset comes in the loop turn that brings the engine's head, read after it: its
    connection is closing when the request's task goes on to open the client's stream, and the
    cancel that ``connection_lost`` brings has not reached the task yet. The request is the
    client's cancel (a 499 ``client_cancel``, the engine's request ended), not a gateway bug."""
    from gateway.upstream import h1client

    sim = await sims(engine, "m")
    gw = await gateway([model_block("m", engine, [sim.url], **({"migration_limit": 1} if continuable else {}))])
    server = gw.runner.server
    received = h1client._Conn.data_received

    def head_then_reset(conn, data: bytes) -> None:
        received(conn, data)
        if data.startswith(b"HTTP/1.1 200"):
            for transport in list(server._connections.values()):
                transport.abort()       # as a reset read now does: closing, connection_lost to come
    monkeypatch.setattr(h1client._Conn, "data_received", head_then_reset)
    payload = orjson.dumps(body(stream=True, max_tokens=50))
    with gw.gw.request_log.capture() as lines:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                     b"x-sim-fault: stall_after=2:inf\r\nContent-Length: %d\r\n\r\n%b" % (len(payload), payload))
        assert await reader.read() == b""       # the gateway dropped the connection
        writer.close()
        line = (await until(lambda: [e for e in lines if e["event"] == "request"]))[0]
    assert (line["status"], line["error_class"]) == (499, "client_cancel"), line
    assert metric(await gw.metrics_text(), "switchyard_internal_errors_total") == 0
    await until(lambda: _quiet(sim.url))


async def _quiet(url) -> bool:
    st = await sim_state(url)
    return not st["running"] and not st["waiting"]


async def _running(url) -> bool:
    return bool((await sim_state(url))["running"])


async def test_drain_refuses_new_requests_and_lets_streams_finish(sims, gateway):
    sim = await sims("vllm", "m", itl_ms=20)
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    async with aiohttp.ClientSession() as s:
        resp = await s.post(gw.url + "/v1/chat/completions", json=body(stream=True, max_tokens=30))
        await resp.content.readline()
        gw.gw.lifecycle.begin_drain()
        async with s.get(gw.url + "/ready") as r:
            assert r.status == 503
        async with s.post(gw.url + "/v1/chat/completions", json=body()) as r:
            assert r.status == 503
        rest = await resp.read()             # the stream in flight completes normally
        assert rest.rstrip().endswith(b"data: [DONE]")
    assert await gw.gw.lifecycle.wait_idle(2)


async def _wrong_framing(request):
    """An engine that answers a stream request with a JSON body and a whole-body request with an
    event stream (a proxy in front of it that rewrites the request, say)."""
    from aiohttp import web

    data = await request.json()
    if data.get("stream"):
        return web.json_response({"id": "x", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n')
    await resp.write_eof()
    return resp


async def test_an_answer_framed_otherwise_than_asked_is_a_502(gateway):
    async with fake_engine(_wrong_framing) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        client = openai_client(gw)
        with pytest.raises(openai.InternalServerError) as ei:       # a stream that would read as empty
            stream = await client.chat.completions.create(**body(stream=True))
            async for _ in stream:
                pass
        assert ei.value.status_code == 502 and ei.value.body["code"] == "upstream_bad_response"
        with pytest.raises(openai.InternalServerError) as ei:       # a body that is an event stream
            await client.chat.completions.create(**body())
        assert ei.value.status_code == 502 and "application/json" not in ei.value.body["message"]
        assert ei.value.response.headers["x-error-upstream"] == "protocol"
        text = await gw.metrics_text()
        assert metric(text, "switchyard_requests_total", status="502") == 2
        assert metric(text, "switchyard_upstream_errors_total", error_class="protocol") == 2


async def test_an_answer_in_a_content_coding_is_a_502_and_engines_are_asked_for_identity(gateway):
    """The gateway relays an answer's bytes as they came, with no Content-Encoding of its own: a
    gzip-coded answer (a compressing proxy in front of an engine) reached the client as a 200 whose
    body no client could read. Engines are asked for none (``Accept-Encoding: identity``; without
    the header any coding is acceptable), and one that codes anyway is the engine's protocol fault."""
    import gzip

    from aiohttp import web

    asked: list[str | None] = []

    async def gzipped(request):
        data = await request.json()
        asked.append(request.headers.get("Accept-Encoding"))
        if data.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Content-Encoding": "gzip"})
            await resp.prepare(request)
            await resp.write(gzip.compress(b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n'))
            await resp.write_eof()
            return resp
        raw = orjson.dumps({"id": "x", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]})
        return web.Response(body=gzip.compress(raw), headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})

    async with fake_engine(gzipped) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        await _a_protocol_502_both_ways(openai_client(gw), "gzip")
        assert asked == ["identity", "identity"]


async def _a_protocol_502_both_ways(client, said: str) -> None:
    """A request and a stream each get a 502 upstream_bad_response naming ``said``."""
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as ei:
            answer = await client.chat.completions.create(**body(stream=stream))
            if stream:
                async for _ in answer:
                    pass
        assert ei.value.status_code == 502 and ei.value.body["code"] == "upstream_bad_response"
        assert said in ei.value.body["message"]
        assert ei.value.response.headers["x-error-upstream"] == "protocol"


@pytest.mark.parametrize("status", [201, 203, 204, 205, 304])
async def test_a_status_other_than_200_below_the_errors_is_a_502(gateway, status):
    """An engine's 2xx other than 200, or 304: relayed with its status, the error body made of it
    read as a success with no choices (2xx), or could not be written at all (204, 205, 304: the
    client's connection was closed with no answer)."""
    from aiohttp import web

    async def odd_status(request):
        await request.read()
        if status in (204, 205, 304):
            return web.Response(status=status)
        return web.json_response({"id": "x", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}, status=status)

    async with fake_engine(odd_status) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        await _a_protocol_502_both_ways(openai_client(gw), str(status))


MiB = 1 << 20


async def test_an_answer_larger_than_max_response_bytes_is_a_502_and_is_not_held(gateway):
    """A non-streaming answer is read whole before it is written: an engine (or a proxy before
    it) that answered without end, or with a body of hundreds of MB, was held in the gateway's
    memory as it came. Past ``upstream.max_response_bytes`` the client gets a 502
    upstream_too_large, the engine's connection is closed (what it sends stops), and little more
    than the limit was ever held; a Content-Length over the limit is refused before a byte of
    the body is read."""
    import tracemalloc

    from aiohttp import web

    sent: list[int] = []

    async def huge(request):
        await request.read()
        size = request.headers.get("x-size")
        if size is None:
            return web.json_response({"id": "x", "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]})
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        if size != "endless":
            resp.content_length = int(size)
        await resp.prepare(request)
        n = 0
        try:
            while n < 64 * MiB:             # "endless", within what a test may send
                await resp.write(b" " * (256 << 10))
                n += 256 << 10
        except ConnectionError:
            pass
        sent.append(n)
        return resp

    async with fake_engine(huge) as url:
        gw = await gateway([model_block("m", "vllm", [url])], upstream={"max_response_bytes": 2 * MiB})
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            with gw.gw.request_log.capture() as logs:
                for i, size in enumerate(("endless", str(100 * MiB))):
                    tracemalloc.start()
                    try:
                        async with s.post(gw.url + "/v1/chat/completions", json=body(), headers={"x-size": size}) as r:
                            status, err, marker = r.status, await r.json(), r.headers.get("x-error-upstream")
                        _, peak = tracemalloc.get_traced_memory()
                    finally:
                        tracemalloc.stop()
                    assert status == 502 and err["error"]["code"] == "upstream_too_large", (size, err)
                    assert "upstream.max_response_bytes" in err["error"]["message"] and marker == "too_large"
                    assert peak < 8 * MiB, f"{peak} bytes held for an answer cut at 2 MiB"
                    assert await wait_for(lambda i=i: len(sent) == i + 1, timeout=10)
                    assert sent[i] < 64 * MiB          # the engine stopped: its connection was closed
                # the client's keep-alive connection serves the next request
                async with s.post(gw.url + "/v1/chat/completions", json=body()) as r:
                    assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"] == "hi"
                assert await wait_for(lambda: sum(e["event"] == "request" for e in logs) == 3, timeout=5)
            lines = [e for e in logs if e["event"] == "request"]
            assert [e["error_class"] for e in lines] == ["upstream_too_large", "upstream_too_large", None]
            assert lines[0]["upstream_bytes"] > 2 * MiB and lines[1]["upstream_bytes"] == 100 * MiB
    text = await gw.metrics_text()
    assert metric(text, "switchyard_upstream_errors_total", error_class="too_large") == 2


async def test_a_stream_whose_lines_end_in_bare_crs_is_read_as_any_other(gateway):
    """SSE lets a line end in CR, LF or CRLF. An engine ending its lines with bare CRs had its
    whole stream taken for one unfinished event: no usage, no finish reason, no [DONE], so a
    complete answer ended with an upstream_incomplete error event, and the usage chunk the gateway
    asked for on the client's behalf reached the client."""
    from aiohttp import web

    chunks = [{"id": "c", "object": "chat.completion.chunk", "model": "m",
               "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]} for w in ("Hel", "lo")]
    chunks.append({"id": "c", "object": "chat.completion.chunk", "model": "m",
                   "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})

    async def cr_stream(request):
        data = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        events = list(chunks)
        if (data.get("stream_options") or {}).get("include_usage"):
            events.append({"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [],
                           "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})
        for e in events:
            await resp.write(b"data: " + orjson.dumps(e) + b"\r\r")
        await resp.write(b": done\rdata: [DONE]\r\r")
        await resp.write_eof()
        return resp

    async with fake_engine(cr_stream) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        client = openai_client(gw)
        stream = await client.chat.completions.create(**body(stream=True))
        got = [c async for c in stream]
        assert "".join(c.choices[0].delta.content or "" for c in got if c.choices) == "Hello"
        assert got[-1].choices[0].finish_reason == "stop" and all(c.usage is None for c in got)
        st, _, raw = await post(gw.url, body(stream=True))
        assert st == 200 and raw.endswith(b"data: [DONE]\r\r") and b'"usage"' not in raw and b"error" not in raw
    text = await gw.metrics_text()
    assert metric(text, "switchyard_requests_total", status="200") == 2
    assert metric(text, "switchyard_completion_tokens_total", model="m") == 4
    assert metric(text, "switchyard_upstream_errors_total") == 0


@pytest.mark.parametrize("ctype,raw", [
    ("text/html", b"<html><body>502 Bad Gateway</body></html>"),       # a proxy's page in front of the engine
    ("application/json", b'{"id": "x", "choices": [{"index": 0, "mess'),   # cut short, yet framed as whole
    ("application/json", b'["not", "an", "object"]'),
])
async def test_a_whole_answer_that_is_not_a_json_object_is_a_502(gateway, ctype, raw):
    """A 200 to a chat, completion or embedding request whose body is not a JSON object was relayed
    as a success that no SDK could read, and counted as one; it is the engine's protocol fault."""
    from aiohttp import web

    async def not_json(request):
        await request.read()
        return web.Response(body=raw, headers={"Content-Type": ctype})

    async with fake_engine(not_json, ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        client = openai_client(gw)
        for call in (client.chat.completions.create(**body()),
                     client.completions.create(model="m", prompt="hi", max_tokens=4),
                     client.embeddings.create(model="m", input="hi")):
            with pytest.raises(openai.InternalServerError) as ei:
                await call
            assert ei.value.status_code == 502 and ei.value.body["code"] == "upstream_bad_response"
            assert ei.value.response.headers["x-error-upstream"] == "protocol"
        text = await gw.metrics_text()
        assert metric(text, "switchyard_requests_total", status="502") == 3
        assert metric(text, "switchyard_upstream_errors_total", error_class="protocol") == 3


@pytest.mark.parametrize("ctype,raw", [
    ("text/html", b"<html><body>502 Bad Gateway</body></html>"),
    ("application/json", b'{"id": "x", "output": [{"type": "mess'),
    ("application/json", b'["not", "an", "object"]'),
])
async def test_a_whole_messages_or_responses_answer_that_is_not_a_json_object_is_a_502(gateway, ctype, raw):
    """The same 200 to a Messages or Responses request was relayed as it came, where chat's is a
    502: each is the engine's protocol fault, in its API's error shape, logged and counted alike."""
    async def not_json(request):
        await request.read()
        return web.Response(body=raw, headers={"Content-Type": ctype})

    async with fake_engine(not_json, ("/v1/messages", "/v1/responses")) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        with pytest.raises(anthropic.APIStatusError) as ai:
            await anthropic_client(gw).messages.create(model="m", max_tokens=4, messages=CHAT)
        assert ai.value.status_code == 502 and ai.value.body["type"] == "error"
        assert ai.value.body["error"]["type"] == "api_error" and "not a JSON object" in ai.value.body["error"]["message"]
        with pytest.raises(openai.InternalServerError) as oi:
            await openai_client(gw).responses.create(model="m", input="hi", max_output_tokens=4)
        assert oi.value.status_code == 502 and oi.value.body["code"] == "upstream_bad_response"
        for e in (ai.value, oi.value):
            assert e.response.headers["x-error-upstream"] == "protocol"
        text = await gw.metrics_text()
        assert metric(text, "switchyard_requests_total", status="502") == 2
        assert metric(text, "switchyard_upstream_errors_total", error_class="protocol") == 2


async def test_a_model_with_no_ready_endpoint_is_told_why(sims, gateway):
    """The 503 said "no ready endpoint" and no more: a client and an operator reading it could not
    tell an engine that is down from one draining or ejected by its breaker."""
    from tests.support.ports import listen_port
    from tests.support.waiting import wait_for

    up = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [f"http://127.0.0.1:{listen_port()}"]),
                        model_block("n", "vllm", [up.url])],
                       health={"interval_s": 0.1, "timeout_s": 0.5})
    down = gw.gw.pool.endpoints("m")[0]
    assert await wait_for(lambda: not down.healthy)
    client = openai_client(gw)
    with pytest.raises(openai.APIStatusError) as ei:
        await client.chat.completions.create(**body())
    assert ei.value.status_code == 503
    assert ei.value.message.endswith("no ready endpoint for model m (of 1 endpoints: 1 failing health probes)")
    gw.gw.pool.endpoints("n")[0].ejected = True                   # as its breaker does
    with pytest.raises(openai.APIStatusError) as ei:
        await client.chat.completions.create(**{**body(), "model": "n"})
    assert "(of 1 endpoints: 1 with an open circuit breaker after engine faults)" in ei.value.message


async def _set_dead(url: str, dead: bool) -> None:
    async with aiohttp.ClientSession() as s, s.post(url + "/_sim/config", json={"dead": dead}) as r:
        assert r.status == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_an_endpoint_ready_again_since_the_request_was_routed_takes_its_retry(sims, gateway, stream):
    """A request routed while the model's other endpoint was out (its probes failing: a restart, a
    breaker's trials taken) goes to the one endpoint left, whose engine dies with it unanswered
    after the other is back. The retry is chosen among the endpoints ready now, not those of the
    moment it was routed: the client gets its answer from the endpoint that came back, where it
    got a 502 (``no_endpoint``)."""
    got, release = asyncio.Event(), asyncio.Event()

    async def dies_with_the_leg(request: web.Request) -> web.StreamResponse:
        await request.read()
        got.set()
        await release.wait()
        assert request.transport is not None
        request.transport.abort()                   # nothing sent back: its engine died
        return web.Response()

    b = await sims("vllm", "m")
    async with fake_engine(dies_with_the_leg) as a:
        gw = await gateway([model_block("m", "vllm", [a, b.url])], health={"interval_s": 0.1},
                           breaker={"consecutive_faults": 100, "fault_rate": 0})
        back = next(ep for ep in gw.gw.pool.endpoints("m") if ep.url == b.url)
        await _set_dead(b.url, True)
        await until(lambda: not back.ready)
        sent = asyncio.create_task(post(gw.url, body(stream=stream)))
        await asyncio.wait_for(got.wait(), 10)      # on the only ready endpoint
        await _set_dead(b.url, False)
        await until(lambda: back.ready)
        release.set()
        st, hdrs, raw = await asyncio.wait_for(sent, 20)
    assert st == 200 and hdrs["x-retries"] == "1", raw[:300]
    assert hdrs["target-pod"] == b.url.split("//")[1]
    if stream:
        assert sse_events(raw)[-1] == "[DONE]"
    else:
        assert orjson.loads(raw)["usage"]["completion_tokens"] == 10
    text = await gw.metrics_text()
    assert 'switchyard_retry_causes_total{cause="reset",model="m"} 1.0' in text
    assert "switchyard_retries_denied_total{" not in text


HALF_OF = (b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m",'
           b'"choices":[{"index":0,"delta":{"content":"wagon"},"finish_reason":null}]}\n\n')


@pytest.mark.parametrize("ends", ["closes", "resets"])
async def test_an_engine_that_ends_inside_an_event_leaves_the_client_a_clean_error_event(gateway, ends):
    """An engine whose stream ends half way through an event, its connection closed or reset: the
    client gets the events that were whole, then the gateway's upstream_incomplete event on its own
    lines (an SSE client drops an event its stream ended in), with stream_options.include_usage or
    without."""
    async def chat(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(HALF_OF + HALF_OF[:-20])
        if ends == "closes":
            await out.write_eof()
        else:
            request.transport.abort()
        return out

    async with fake_engine(chat) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        client = openai_client(gw)
        for usage in (True, False):
            extra = {"stream_options": {"include_usage": True}} if usage else {}
            stream = await client.chat.completions.create(**body(stream=True), **extra)
            got = []
            with pytest.raises(openai.APIError) as e:       # not a JSONDecodeError on a glued line
                async for chunk in stream:
                    got.append(chunk)
            assert "upstream_incomplete" in repr(e.value.body) or "engine" in str(e.value), e.value
            assert [c.choices[0].delta.content for c in got] == ["wagon"], usage


def _event(obj: dict, name: str | None = None) -> bytes:
    return (b"event: " + name.encode() + b"\n" if name else b"") + b"data: " + orjson.dumps(obj) + b"\n\n"


_WAGON = HALF_OF
_ENGINE_ERROR = _event({"error": {"message": "the engine ran out of KV cache", "type": "internal_error", "code": 500}})
_RESPONSE = {"id": "resp_1", "object": "response", "model": "m", "status": "completed",
             "output": [{"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
                         "content": [{"type": "output_text", "text": "wagon", "annotations": []}]}],
             "usage": {"input_tokens": 5, "output_tokens": 1, "total_tokens": 6}}
_RESPONSES_STREAM = [
    _event({"type": "response.created", "sequence_number": 0,
            "response": {**_RESPONSE, "status": "in_progress", "output": [], "usage": None}}, "response.created"),
    _event({"type": "response.output_text.delta", "sequence_number": 1, "item_id": "msg_1", "output_index": 0,
            "content_index": 0, "delta": "wagon"}, "response.output_text.delta"),
    _event({"type": "response.completed", "sequence_number": 2, "response": _RESPONSE}, "response.completed"),
]


@pytest.mark.parametrize("last", ["done", "engine_error", "done_crlf"])
async def test_a_last_event_without_its_blank_line_reaches_the_client_whole(gateway, last):
    """An engine whose stream ends in its last event without the blank line after it ([DONE], its
    own error event): the client gets that event ended by its blank line, as an SSE client
    dispatches an event at its blank line only and drops one its stream ends in. The engine's
    error event then reaches the openai SDK, which raises it, and a Responses stream's
    response.completed reaches the SDK."""
    tail = {"done": b"data: [DONE]", "engine_error": _ENGINE_ERROR[:-2],
            "done_crlf": b"data: [DONE]\r\n"}[last]

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        if request.path == "/v1/responses":
            await out.write(b"".join(_RESPONSES_STREAM)[:-2])
        else:
            await out.write(_WAGON + tail)
        await out.write_eof()
        return out

    async with fake_engine(chat, paths=("/v1/chat/completions", "/v1/responses")) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        for usage in (True, False):
            extra = {"stream_options": {"include_usage": True}} if usage else {}
            st, _, raw = await post(gw.url, body(stream=True, **extra))
            # the engine's numeric code comes as its string, as OpenAI's error object has it
            sent = tail.rstrip(b"\r\n").replace(b'"code":500', b'"code":"500"')
            assert st == 200 and raw.endswith(sent + b"\n\n"), raw[-120:]
        client = openai_client(gw)
        stream = await client.chat.completions.create(**body(stream=True))
        got = []
        if last == "engine_error":
            with pytest.raises(openai.APIError, match="ran out of KV cache"):
                async for chunk in stream:
                    got.append(chunk)
        else:
            got = [c async for c in stream]
        assert [c.choices[0].delta.content for c in got] == ["wagon"]
        if last == "done":
            events = [e async for e in await client.responses.create(model="m", input="hi", stream=True)]
            assert [e.type for e in events] == ["response.created", "response.output_text.delta", "response.completed"]


_EXTRA = _event({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                 "choices": [{"index": 0, "delta": {"content": " caboose"}, "finish_reason": None}]})


@pytest.mark.parametrize("when", ["same_read", "later"])
async def test_bytes_an_engine_writes_after_done_are_not_relayed_and_its_connection_is_not_kept(gateway, when):
    """``data: [DONE]`` ends the answer: an event the engine writes after it, in the same write or
    later, is not passed on (the client's stream ends at [DONE]), and the engine's connection,
    on which the engine wrote past its answer's end, is not used again."""
    ports: list[int] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        ports.append(request.transport.get_extra_info("peername")[1])
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(_WAGON)
        if when == "same_read":
            await out.write(b"data: [DONE]\n\n" + _EXTRA)
        else:
            await out.write(b"data: [DONE]\n\n")
            await asyncio.sleep(0.05)       # (a second write: the relay's order is the same either way)
            await out.write(_EXTRA)
        await out.write_eof()
        return out

    async with fake_engine(chat) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        st, _, raw = await post(gw.url, body(stream=True))
        assert st == 200 and raw.endswith(b"data: [DONE]\n\n") and b"caboose" not in raw, raw[-200:]
        client = openai_client(gw)
        stream = await client.chat.completions.create(**body(stream=True))
        assert [c.choices[0].delta.content async for c in stream] == ["wagon"]
        await client.close()
        assert len(ports) == 2 and ports[0] != ports[1], ports     # the first connection was not kept


async def test_what_an_engine_writes_after_done_in_its_read_is_not_counted_nor_its_error(gateway):
    """Bytes after ``[DONE]`` in its own read are not the answer's: a usage event there is not what
    the request is charged (the client's answer had 1 token), and an error event there is no
    error of the request's, which the client never saw (``after_end: trailing``, no error_class)."""
    usage = _event({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})
    more = _event({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
                   "usage": {"prompt_tokens": 5, "completion_tokens": 90, "total_tokens": 95}})

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(_WAGON + usage + b"data: [DONE]\n\n" + more + _ENGINE_ERROR)
        await out.write_eof()
        return out

    async with fake_engine(chat) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        with gw.gw.request_log.capture() as logs:
            st, _, raw = await post(gw.url, body(stream=True, stream_options={"include_usage": True}))
            await until(lambda: any(e["event"] == "request" for e in logs))
        assert st == 200 and raw.endswith(b"data: [DONE]\n\n") and b"boom" not in raw and b"KV cache" not in raw, raw
        line = next(e for e in logs if e["event"] == "request")
        assert (line["status"], line["error_class"], line["after_end"]) == (200, None, "trailing"), line
        assert line["completion_tokens"] == 1, line
