"""Slow and greedy clients: each is cut by its timeout (408 in OpenAI shape where the client can
still read it, a close otherwise), counted, and leaves nothing behind; a connection over the cap
is closed at once. Timeouts here are short configured values; no test asserts a duration."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import orjson
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import model_block, sim_state, wait_for
from tests.edge_util import assert_openai_error, exchange, parse_responses, request

CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def samples(gw) -> dict[str, float]:
    """The gateway's metrics, read in-process (an HTTP scrape would be one more client connection)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(gw.gw.metrics.render().decode()):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def timeouts(gw, reason: str) -> float:
    return samples(gw).get(f"switchyard_client_timeouts_total{{reason={reason}}}", 0.0)


def connections(gw) -> float:
    return samples(gw)["switchyard_client_connections{}"]


async def start(sims, gateway, **server):
    sim = await sims("vllm", "m", itl_ms=0.0, max_model_len=1_000_000, eos_probability=0.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])], server=server)
    return sim, gw


async def test_half_a_head_gets_408_and_is_counted(sims, gateway):
    _sim, gw = await start(sims, gateway, header_timeout_s=0.3)
    ex = await exchange(gw.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
    err = assert_openai_error(ex.first, 408)
    assert err["code"] == "request_timeout" and "header_timeout_s" in err["message"]
    assert ex.closed and ex.first.headers["connection"] == "close"
    assert timeouts(gw, "header") == 1
    assert await wait_for(lambda: connections(gw) == 0)


async def test_a_connection_that_never_speaks_is_closed_without_an_answer(sims, gateway):
    _sim, gw = await start(sims, gateway, header_timeout_s=0.3)
    ex = await exchange(gw.port)
    assert ex.closed and ex.responses == [] and ex.trailing == b""
    assert timeouts(gw, "header") == 1


async def test_a_body_that_stops_gets_408_and_never_reaches_the_engine(sims, gateway):
    sim, gw = await start(sims, gateway, body_timeout_s=0.3)
    head = request("POST", CHAT, None, {"Content-Type": "application/json", "Content-Length": "100000"})
    ex = await exchange(gw.port, head + BODY[:20])
    err = assert_openai_error(ex.first, 408)
    assert "body_timeout_s" in err["message"] and ex.closed
    assert timeouts(gw, "body") == 1
    state = await sim_state(sim.url)
    assert state["counts"]["started"] == 0 and all(r["method"] == "GET" for r in state["received"])


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


async def test_a_body_dribbled_byte_by_byte_hits_the_total_timeout(sims, gateway):
    _sim, gw = await start(sims, gateway, body_timeout_s=5.0, body_total_timeout_s=0.5)
    head = request("POST", CHAT, None, {"Content-Type": "application/json", "Content-Length": "100000"})
    data = await dribble(gw.port, head, every=0.05)
    resp, _ = parse_responses(data, eof=True)
    err = assert_openai_error(resp[0], 408)
    assert "body_total_timeout_s" in err["message"]
    assert timeouts(gw, "body_total") == 1 and timeouts(gw, "body") == 0


async def test_an_idle_kept_alive_connection_is_closed_silently(sims, gateway):
    _sim, gw = await start(sims, gateway, keepalive_timeout_s=0.3, header_timeout_s=5.0)
    ex = await exchange(gw.port, request("GET", "/health"))
    assert [r.status for r in ex.responses] == [200] and ex.closed and ex.trailing == b""
    assert timeouts(gw, "keepalive") == 1 and timeouts(gw, "header") == 0


async def test_half_a_second_head_on_a_kept_alive_connection_gets_408(sims, gateway):
    _sim, gw = await start(sims, gateway, keepalive_timeout_s=5.0, header_timeout_s=0.3)
    ex = await exchange(gw.port, request("GET", "/health"), b"GET /v1/mod")
    assert [r.status for r in ex.responses] == [200, 408] and ex.closed
    assert_openai_error(ex.responses[1], 408)
    assert timeouts(gw, "header") == 1 and timeouts(gw, "keepalive") == 0


async def test_many_slow_clients_are_all_cut_and_leave_nothing_open(sims, gateway):
    """The measurement that started this, scaled down: half heads and promised bodies that stop."""
    _sim, gw = await start(sims, gateway, header_timeout_s=0.5, body_timeout_s=0.5)
    head = request("POST", CHAT, None, {"Content-Type": "application/json", "Content-Length": "100000"})
    results = await asyncio.gather(
        *[exchange(gw.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n") for _ in range(60)],
        *[exchange(gw.port, head + BODY[:10]) for _ in range(15)])
    assert all(ex.closed and ex.first.status == 408 for ex in results)
    assert timeouts(gw, "header") == 60 and timeouts(gw, "body") == 15
    assert await wait_for(lambda: connections(gw) == 0)


async def test_a_streaming_client_that_stops_reading_is_cut_and_the_engine_aborted(sims, gateway):
    sim, gw = await start(sims, gateway, write_stall_timeout_s=0.3)
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 200_000, "stream": True})
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)     # a client that reads nothing, fills up fast
    s.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(s, ("127.0.0.1", gw.port))
        await loop.sock_sendall(s, request("POST", CHAT, body))

        async def aborted():
            st = await sim_state(sim.url)
            return st if st["counts"]["aborted"] else None

        state = await wait_for(aborted, timeout=30.0)
        assert state and state["counts"]["aborted"] == 1 and state["counts"]["completed"] == 0
        assert timeouts(gw, "write_stall") == 1
        assert await wait_for(lambda: connections(gw) == 0)
    finally:
        s.close()


async def test_a_streaming_client_that_keeps_up_is_never_cut(sims, gateway):
    _sim, gw = await start(sims, gateway, write_stall_timeout_s=0.3)
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000,
                         "stream": True})
    ex = await exchange(gw.port, request("POST", CHAT, body, close=True), wait=30.0)
    assert ex.first.status == 200 and ex.first.body.endswith(b"data: [DONE]\n\n")
    assert timeouts(gw, "write_stall") == 0


async def test_connections_over_the_cap_are_closed_at_once_and_counted(sims, gateway):
    _sim, gw = await start(sims, gateway, max_connections=3, header_timeout_s=30.0)
    held = [await asyncio.open_connection("127.0.0.1", gw.port) for _ in range(3)]
    try:
        assert await wait_for(lambda: connections(gw) == 3)
        ex = await exchange(gw.port, request("GET", "/health"))
        assert ex.closed and ex.responses == []
        s = samples(gw)
        assert s["switchyard_connections_rejected_total{}"] == 1 and s["switchyard_client_connections{}"] == 3
        _r, w = held.pop()
        w.close()
        assert await wait_for(lambda: connections(gw) == 2)
        ex = await exchange(gw.port, request("GET", "/health", close=True))
        assert [r.status for r in ex.responses] == [200]
    finally:
        for _r, w in held:
            w.close()


async def test_a_body_the_handler_is_not_reading_yet_is_not_the_clients_silence():
    """While the app has not consumed the body, aiohttp stops reading the socket; that pause
    must not count as a silent client (here the app waits past body_timeout_s before reading)."""
    from aiohttp import web
    from prometheus_client import CollectorRegistry

    from gateway.edge import Edge, EdgeLimits, EdgeRunner

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

async def test_kept_alive_requests_whose_head_and_body_come_in_separate_writes(sims, gateway):
    """As httpx (the OpenAI SDK) sends them: head, then body, then the next request at once."""
    _sim, gw = await start(sims, gateway, header_timeout_s=5.0, body_timeout_s=5.0)
    head = request("POST", CHAT, None, {"Content-Type": "application/json", "Content-Length": str(len(BODY))})
    chunked_head = request("POST", CHAT, None, {"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
    ex = await exchange(gw.port, head, BODY, head, BODY, chunked_head, b"%x\r\n" % len(BODY) + BODY + b"\r\n",
                        b"0\r\n\r\n", request("GET", "/health", close=True), pause=0.05)
    assert [r.status for r in ex.responses] == [200, 200, 200, 200], [r.body[:200] for r in ex.responses]
    assert ex.closed and not ex.trailing
    s = samples(gw)
    assert not [k for k, v in s.items() if k.startswith("switchyard_client_timeouts_total") and v]
    assert not [k for k, v in s.items() if k.startswith("switchyard_client_protocol_errors_total") and v]


async def test_the_openai_sdk_reuses_its_connection_across_plain_and_streaming_requests(sims, gateway):
    import openai

    _sim, gw = await start(sims, gateway)
    client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="none", max_retries=0)
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
    assert samples(gw).get("switchyard_client_protocol_errors_total{status=400}", 0) == 0
