"""The edge's fast lane (gateway/server/lane.py): which requests it takes, that answers keep the
order of their requests on a connection, and that a client leaving still stops the engine."""

from __future__ import annotations

import asyncio
import gzip
import time

import aiohttp
import orjson

from tests.integration.pipeline.test_whole import _answer
from tests.support.factories import model_block
from tests.support.http import anthropic_client, openai_client, sim_state
from tests.support.waiting import wait_for

CHAT = [{"role": "user", "content": "Take the fast lane."}]
PATH = "/v1/chat/completions"


def _req(body: dict | bytes, *, rid: str, path: str = PATH, version: str = "1.1",
         extra: str = "", framing: str = "length") -> bytes:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    head = f"POST {path} HTTP/{version}\r\nHost: gw\r\nContent-Type: application/json\r\nx-request-id: {rid}\r\n{extra}"
    if framing == "chunked":
        return (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data)
    return (head + f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def _lane(gw) -> int:
    return gw.runner.server.edge.lane_requests


async def test_plain_requests_take_the_lane_on_a_kept_alive_connection(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        for i, stream in enumerate((False, True, False)):
            writer.write(_req({"model": "m", "messages": CHAT, "max_tokens": 3, "stream": stream}, rid=f"k-{i}"))
            status, headers, body = await _answer(reader)
            assert status == "HTTP/1.1 200 OK" and headers["request-id"] == f"k-{i}"
            assert body.endswith(b"data: [DONE]\n\n") if stream else orjson.loads(body)["object"] == "chat.completion"
    finally:
        writer.close()
    assert _lane(gw) == 3
    # and the SDK's requests take it too (embeddings and completions among them)
    c = openai_client(gw)
    await c.completions.create(model="m", prompt="hello", max_tokens=2)
    await c.embeddings.create(model="m", input="hello")
    assert _lane(gw) == 5


async def test_messages_responses_and_json_pass_through_take_the_lane_audio_does_not(sims, gateway):
    sim = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    a = anthropic_client(gw)
    msg = await a.messages.create(model="m", max_tokens=4, messages=CHAT)
    async with a.messages.stream(model="m", max_tokens=3, messages=CHAT) as stream:
        text = [t async for t in stream.text_stream]
    counted = await a.messages.count_tokens(model="m", messages=CHAT)
    await a.close()
    assert msg.usage.output_tokens == 4 and len(text) == 3 and counted.input_tokens > 0
    assert _lane(gw) == 3
    c = openai_client(gw)
    r = await c.responses.create(model="m", input="Hello there", max_output_tokens=3)
    follow = await c.responses.create(model="m", input="Go on", max_output_tokens=3, previous_response_id=r.id)
    assert r.status == follow.status == "incomplete" and follow.output_text
    assert (await c.responses.retrieve(r.id)).id == r.id          # a GET: aiohttp's
    assert _lane(gw) == 5
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/rerank", json={"model": "m", "query": "apple", "documents": ["a", "b"]}) as resp:
            assert resp.status == 200 and (await resp.json())["results"]
        form = aiohttp.FormData()
        form.add_field("model", "m")
        form.add_field("file", b"RIFF....WAVEfmt ", filename="a.wav", content_type="audio/wav")
        async with s.post(gw.url + "/v1/audio/transcriptions", data=form) as resp:
            assert resp.status == 200, await resp.text()
    assert _lane(gw) == 6                                           # the rerank; not the upload
    await c.close()


async def test_what_the_lane_leaves_to_aiohttp_is_answered_as_before(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    plain = {"model": "m", "messages": CHAT, "max_tokens": 2}
    cases = {
        "http/1.0": _req(plain, rid="a", version="1.0"),
        "query string": _req(plain, rid="b", path=PATH + "?x=1"),
        "chunked body": _req(plain, rid="c", framing="chunked"),
        "gzip body": _req(gzip.compress(orjson.dumps(plain)), rid="d", extra="Content-Encoding: gzip\r\n"),
    }
    for name, raw in cases.items():
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        try:
            writer.write(raw)
            status, _, body = await _answer(reader)
        finally:
            writer.close()
        assert status.endswith("200 OK"), (name, status, body[:200])
        assert orjson.loads(body)["object"] == "chat.completion", name
    assert _lane(gw) == 0


async def test_requests_sent_together_are_each_answered_in_order_and_junk_after_one_costs_it_nothing(
        sims, gateway):
    """Two requests in one write: the first runs on the lane, the second waits its turn (its
    bytes held as if they came meanwhile). A request followed by junk in the same write gets its
    answer, then the junk its 400 and the connection's end (aiohttp's parser, given both at once,
    dropped the request it had parsed)."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    plain = {"model": "m", "messages": CHAT, "max_tokens": 2}
    for tail, want in ((_req(plain, rid="e2"), "200 OK"), (b"NOT HTTP AT ALL\r\n\r\n", "400")):
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        try:
            writer.write(_req(plain, rid="e1") + tail)
            first = await _answer(reader)
            second = await _answer(reader)
        finally:
            writer.close()
        assert first[0].endswith("200 OK") and first[1]["request-id"] == "e1"
        assert orjson.loads(first[2])["object"] == "chat.completion"
        assert want in second[0], second
        if want == "400":
            assert orjson.loads(second[2])["error"]["type"] == "invalid_request_error"
        else:
            assert second[1]["request-id"] == "e2"
    assert _lane(gw) >= 2


async def test_a_request_without_one_host_is_left_to_aiohttp_which_refuses_it(sims, gateway):
    """HTTP/1.1 asks for exactly one Host: aiohttp answers 400 without one, in OpenAI's shape, and
    the lane leaves such a request to it rather than serve it."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    raw = _req({"model": "m", "messages": CHAT, "max_tokens": 2}, rid="no-host").replace(b"Host: gw\r\n", b"")
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(raw)
        status, _, body = await _answer(reader)
    finally:
        writer.close()
    assert status.split()[1] == "400" and orjson.loads(body)["error"]["type"] == "invalid_request_error"
    assert _lane(gw) == 0 and [r for r in (await sim_state(sim.url))["received"] if r["method"] == "POST"] == []


async def _send_apart(gw, pieces: list[bytes], answers: int = 1) -> list[tuple[str, dict[str, str], bytes]]:
    """``pieces`` written one by one, 30 ms apart (each reaches the gateway in a read of its own)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.03)
        return [await _answer(reader) for _ in range(answers)]
    finally:
        writer.close()


def _cut(raw: bytes, *body_cuts: int) -> list[bytes]:
    """``raw`` cut after its head and at ``body_cuts`` bytes into its body."""
    start = raw.index(b"\r\n\r\n") + 4
    cuts = [start, *(start + c for c in body_cuts)]
    return [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]


async def test_a_body_that_comes_after_its_head_is_waited_for_on_the_lane(sims, gateway, monkeypatch):
    """Clients that write a request's head and body apart (the openai SDK's httpx does, and at low
    load the gateway reads them apart) take the lane once the body is in; what the lane does not
    wait for is aiohttp's, answered as before."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    plain = {"model": "m", "messages": CHAT, "max_tokens": 2}
    (status, headers, body), = await _send_apart(gw, _cut(_req(plain, rid="f1")))
    assert status == "HTTP/1.1 200 OK" and headers["request-id"] == "f1" and orjson.loads(body)["choices"]
    stream = {**plain, "stream": True}
    (status, _, body), = await _send_apart(gw, _cut(_req(stream, rid="f2"), 5, 20, 40))
    assert status == "HTTP/1.1 200 OK" and body.endswith(b"data: [DONE]\n\n")
    assert _lane(gw) == 2
    # the rest of the body and a next request in one read: both aiohttp's, answered in order
    first, second = _req(plain, rid="g1"), _req(plain, rid="g2")
    pieces = _cut(first)
    answers = await _send_apart(gw, [pieces[0], pieces[1] + second], answers=2)
    assert [(s, h["request-id"]) for s, h, _ in answers] == [("HTTP/1.1 200 OK", "g1"), ("HTTP/1.1 200 OK", "g2")]
    # a body larger than the lane waits for: aiohttp's
    monkeypatch.setattr("gateway.server.lane.HOLD_BODY", 64)
    (status, _, _), = await _send_apart(gw, _cut(_req(plain, rid="h")))
    assert status == "HTTP/1.1 200 OK"
    assert _lane(gw) == 2
    monkeypatch.undo()
    # the openai SDK, one request at a time with pauses between: every one on the lane
    c = openai_client(gw)
    for i in range(8):
        await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi " * (i + 1)}], max_tokens=2)
        await asyncio.sleep(0.02)
    assert _lane(gw) == 10
    await c.close()


async def test_a_client_that_leaves_while_its_body_is_held_leaves_nothing_behind(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    edge = gw.runner.server.edge
    raw = _req({"model": "m", "messages": CHAT, "max_tokens": 2}, rid="gone")
    for _ in range(3):
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(raw[:raw.index(b"\r\n\r\n") + 10])
        await writer.drain()
        assert await wait_for(lambda: edge.connections == 1)
        writer.close()
        assert await wait_for(lambda: edge.connections == 0)
    assert [r for r in (await sim_state(sim.url))["received"] if r["method"] == "POST"] == []
    assert _lane(gw) == 0
    # the connection slot and the lane are free: the next client is answered on it
    (status, _, _), = await _send_apart(gw, _cut(raw))
    assert status == "HTTP/1.1 200 OK" and _lane(gw) == 1


async def test_a_held_body_that_stops_coming_gets_a_408_and_a_stop_waits_for_one_that_comes(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], server={"body_timeout_s": 0.3})
    raw = _req({"model": "m", "messages": CHAT, "max_tokens": 2}, rid="stall-1")
    head_and_some = raw[:raw.index(b"\r\n\r\n") + 10]
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(head_and_some)
        status, headers, body = await _answer(reader)
        assert status == "HTTP/1.1 408 Request Timeout" and headers["x-request-id"] == "stall-1"
        assert orjson.loads(body)["error"]["code"] == "request_timeout"
        assert await reader.read() == b""                 # and the connection is closed
    finally:
        writer.close()
    assert 'switchyard_client_timeouts_total{reason="body"} 1.0' in await gw.metrics_text()
    # a graceful stop that begins while a body is held waits for it, and it is answered
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        raw = _req({"model": "m", "messages": CHAT, "max_tokens": 2}, rid="stop-1")
        writer.write(head_and_some := raw[:raw.index(b"\r\n\r\n") + 10])
        await writer.drain()
        await asyncio.sleep(0.05)
        stopping = asyncio.create_task(gw.runner.server.shutdown(10))
        await asyncio.sleep(0.05)
        writer.write(raw[len(head_and_some):])
        status, headers, _ = await _answer(reader)
        await stopping
    finally:
        writer.close()
    assert status == "HTTP/1.1 200 OK" and headers["request-id"] == "stop-1"
    assert _lane(gw) == 1


async def test_a_request_sent_while_one_runs_is_answered_after_it(sims, gateway):
    """Bytes of a next request that come while a lane request runs wait for its answer, and then
    take the lane too (a client that sends its next request as soon as an answer's last byte came
    finds the request's bookkeeping still running: aiohttp's path would cost it ~0.3 ms)."""
    sim = await sims("vllm", "m", ttft_base_ms=150.0, itl_ms=5.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(_req({"model": "m", "messages": CHAT, "max_tokens": 4, "stream": True}, rid="first"))
        await writer.drain()
        assert await wait_for(lambda: _lane(gw) == 1, timeout=5)
        writer.write(_req({"model": "m", "messages": CHAT, "max_tokens": 2}, rid="second"))
        first = await _answer(reader)
        second = await _answer(reader)
    finally:
        writer.close()
    assert first[1]["request-id"] == "first" and first[2].endswith(b"data: [DONE]\n\n")
    assert second[1]["request-id"] == "second" and orjson.loads(second[2])["object"] == "chat.completion"
    assert _lane(gw) == 2


async def test_a_client_leaving_a_lane_stream_stops_the_engine(sims, gateway):
    sim = await sims("vllm", "m", itl_ms=50)
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    async with aiohttp.ClientSession() as s:
        resp = await s.post(gw.url + PATH, json={"model": "m", "messages": CHAT, "max_tokens": 500, "stream": True})
        assert resp.status == 200
        await resp.content.readline()
        assert _lane(gw) == 1 and (await sim_state(sim.url))["running"]
        resp.close()

    async def aborted() -> bool:
        st = await sim_state(sim.url)
        return st["counts"]["aborted"] >= 1 and not st["running"]

    assert await wait_for(aborted, timeout=8)
    assert await wait_for(lambda: gw.gw.lifecycle.in_flight == 0, timeout=5)
    assert 'switchyard_client_cancels_total{model="m",stage="streaming"} 1.0' in await gw.metrics_text()


async def test_a_graceful_stop_lets_a_lane_stream_finish(sims, gateway):
    sim = await sims("vllm", "m", itl_ms=20)
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    async with aiohttp.ClientSession() as s:
        resp = await s.post(gw.url + PATH, json={"model": "m", "messages": CHAT, "max_tokens": 30, "stream": True})
        await resp.content.readline()
        assert _lane(gw) == 1
        stopping = asyncio.create_task(gw.runner.server.shutdown(10))
        rest = await resp.read()
        await stopping
    assert rest.rstrip().endswith(b"data: [DONE]")


async def test_server_fast_lane_false_leaves_every_request_to_aiohttp(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], server={"fast_lane": False})
    c = openai_client(gw)
    r = await c.chat.completions.create(model="m", messages=CHAT, max_tokens=2)
    assert r.choices[0].message.content
    assert _lane(gw) == 0 and "switchyard_client_requests_fast_lane_total 0.0" in await gw.metrics_text()


def _lane_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__qualname__", "").endswith("_lane_serve")]


async def test_a_connection_runs_its_lane_requests_in_one_task_that_ends_with_it(sims, gateway):
    """The lane runs a connection's requests one after the other in one task, as aiohttp does (a
    task a request cost tens of µs at low load); the client leaving, idle or mid-answer, ends it."""
    sim = await sims("vllm", "m", itl_ms=20)
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    seen = set()
    try:
        for i in range(3):
            writer.write(_req({"model": "m", "messages": CHAT, "max_tokens": 2, "stream": i == 1}, rid=f"t-{i}"))
            status, headers, _ = await _answer(reader)
            assert status == "HTTP/1.1 200 OK" and headers["request-id"] == f"t-{i}"
            seen.update(_lane_tasks())
        assert len(seen) == 1 and not next(iter(seen)).done()       # one task, waiting for the next request
    finally:
        writer.close()
    assert await wait_for(lambda: not _lane_tasks())
    assert _lane(gw) == 3 and next(iter(seen)).cancelled()
    # a client that leaves mid-stream: its request is cancelled, and its task with it
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    writer.write(_req({"model": "m", "messages": CHAT, "max_tokens": 200, "stream": True}, rid="gone"))
    await reader.readuntil(b"data:")
    assert len(_lane_tasks()) == 1
    writer.close()
    assert await wait_for(lambda: not _lane_tasks() and gw.gw.lifecycle.in_flight == 0, timeout=5)


async def test_a_request_whose_body_comes_after_its_head_counts_its_duration_from_its_head(sims, gateway):
    """``duration_ms`` runs from the moment the request's head came whole, whichever way the request
    is read: a body sent a while after its head is in it on the lane (which holds the head until the
    body is in, as it does for the openai SDK's httpx) as on aiohttp's path (a chunked body, read by
    the handler that started at its head). The lane's line counted from its handler's start, once
    the body was in: the body's time was left out there only. (A bound by cause, no clock asserted:
    the gateway read the head before the test saw it held, and answered after the body was sent.)"""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    body = orjson.dumps({"model": "m", "messages": CHAT, "max_tokens": 2})
    server = gw.runner.server
    with gw.gw.request_log.capture() as lines:
        for framing in ("length", "chunked"):
            rid = f"slow-body-{framing}"
            raw = _req(body, rid=rid, framing=framing)
            cut = raw.index(b"\r\n\r\n") + 4
            lane_before = _lane(gw)
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            try:
                writer.write(raw[:cut])
                if framing == "length":     # the lane holds it
                    assert await wait_for(lambda: any(p._lane_part is not None for p in server.connections), timeout=10.0,
                                          interval=0.005)
                else:                       # aiohttp's handler runs, waiting on the body
                    assert await wait_for(lambda: any(p._e_request is not None for p in server.connections), timeout=10.0,
                                          interval=0.005)
                held_from = time.perf_counter()
                await asyncio.sleep(0.3)    # the body's time, which the line must hold
                sent = time.perf_counter()
                writer.write(raw[cut:])
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                assert head.startswith(b"HTTP/1.1 200"), head
            finally:
                writer.close()
            assert _lane(gw) == lane_before + (framing == "length")
            assert await wait_for(lambda rid=rid: any(x["request_id"] == rid for x in lines), timeout=5.0)
            line = next(x for x in lines if x["request_id"] == rid)
            assert line["status"] == 200
            assert line["duration_ms"] >= (sent - held_from) * 1000, (framing, line["duration_ms"], sent - held_from)


async def test_a_client_leaving_while_its_body_comes_is_logged_and_counted_on_the_lane_as_off_it(sims, gateway):
    """A client that leaves before its whole body came (its head whole, as httpx writes it apart)
    gets the line and counts of a client's cancel, a 499 ``client_cancel`` and
    ``switchyard_client_cancels_total``, whether the lane held the request for its body or
    aiohttp's path read it (a chunked one)."""
    from gateway.server.app import GATEWAY_KEY

    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    body = {"model": "m", "messages": CHAT, "max_tokens": 2}
    edge = gw.runner.server
    with gw.runner.app[GATEWAY_KEY].request_log.capture() as lines:
        for rid, framing in (("left-lane", "length"), ("left-aiohttp", "chunked")):
            raw = _req(body, rid=rid, framing=framing)
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            writer.write(raw[:raw.index(b"\r\n\r\n") + 12])
            await writer.drain()
            assert await wait_for(lambda: any(p._request_in_progress for p in edge._connections), timeout=5)
            writer.close()
            assert await wait_for(lambda rid=rid: any(x["request_id"] == rid for x in lines), timeout=5), rid
    mine = {x["request_id"]: x for x in lines}
    for rid in ("left-lane", "left-aiohttp"):
        assert (mine[rid]["status"], mine[rid]["error_class"]) == (499, "client_cancel"), mine[rid]
    assert 'switchyard_client_cancels_total{model="-",stage="before_headers"} 2.0' in await gw.metrics_text()


async def test_a_request_held_for_its_body_when_the_grace_period_ends_is_answered_503(sims, gateway):
    """A request the lane holds for its body (its head whole) is in flight for the drain, as
    aiohttp's request reading its body is: the drain waits for it, and when the grace period ends
    its client reads the 503 of a gateway shutting down that its request line says, on both paths,
    with one ``Connection: close``."""
    from gateway.server.app import GATEWAY_KEY, LIFECYCLE_KEY
    from gateway.server.run import drain_and_stop

    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    body = {"model": "m", "messages": CHAT, "max_tokens": 2}
    edge = gw.runner.server
    conns = {}
    with gw.runner.app[GATEWAY_KEY].request_log.capture() as lines:
        for rid, framing in (("cut-lane", "length"), ("cut-aiohttp", "chunked")):
            raw = _req(body, rid=rid, framing=framing)
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            writer.write(raw[:raw.index(b"\r\n\r\n") + 12])
            await writer.drain()
            conns[rid] = (reader, writer)
        assert await wait_for(lambda: sum(p._request_in_progress for p in edge._connections) == 2, timeout=5)
        assert gw.runner.app[LIFECYCLE_KEY].in_flight == 2
        drain = asyncio.ensure_future(drain_and_stop(gw.runner, gw.runner.app, 0.2))
        for rid, (reader, writer) in conns.items():
            async with asyncio.timeout(10):
                answer = await reader.read()
            writer.close()          # (the stop waits a moment for a connection still reading the body)
            assert answer.startswith(b"HTTP/1.1 503 "), (rid, answer)
            assert f"request-id: {rid}\r\n".encode() in answer and b"shutting down" in answer, (rid, answer)
            head = answer[:answer.index(b"\r\n\r\n")].lower().split(b"\r\n")
            assert [h for h in head if h.startswith(b"connection:")] == [b"connection: close"], (rid, answer)
        async with asyncio.timeout(10):
            await drain
    mine = {x["request_id"]: x for x in lines}
    for rid in conns:
        assert (mine[rid]["status"], mine[rid]["error_class"]) == (503, "draining"), mine[rid]
