"""Answers the gateway writes itself (gateway/pipeline/whole.py): a complete answer's head and body in
one write, an event stream's head and chunks, byte for byte what aiohttp's responses would send
(apart from the date and the request id), on a kept-alive connection, and aiohttp's own responses
wherever its framing differs (HTTP/1.0); a tenant's answers carry its x-ratelimit-* headers once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import openai
import orjson
import pytest

from gateway.pipeline.relay import Relay
from gateway.pipeline.whole import WrittenAnswer, WrittenStream, open_stream, write_whole
from tests.support.factories import model_block
from tests.support.first_writes import assert_written_from_reads, record_first_writes
from tests.support.http import openai_client
from tests.support.tenancy import ALICE, KEYS

CHAT = [{"role": "user", "content": "Write the answer in one go."}]


def _request(body: dict, *, version: str = "1.1", close: bool = False, rid: str = "r-1", key: str | None = None) -> bytes:
    data = orjson.dumps(body)
    head = (f"POST /v1/chat/completions HTTP/{version}\r\nHost: gw\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nx-request-id: {rid}\r\n")
    if close:
        head += "Connection: close\r\n"
    if key is not None:
        head += f"Authorization: Bearer {key}\r\n"
    return head.encode() + b"\r\n" + data


async def _answer(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes]:
    """One HTTP/1.x answer off the wire: its status line, headers (lower-cased names) and body
    (de-chunked)."""
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).decode()
    status, *lines = head[:-4].split("\r\n")
    headers: dict[str, str] = {}
    for line in lines:
        k, v = line.split(": ", 1)
        assert k.lower() not in headers, f"{k} twice"
        headers[k.lower()] = v
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    else:
        assert headers["transfer-encoding"] == "chunked"
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            chunk = await reader.readexactly(size + 2)
            assert chunk.endswith(b"\r\n")
            if size == 0:
                break
            body += chunk[:-2]
    return status, headers, body


async def _exchange(port: int, *requests: bytes) -> list[tuple[str, dict[str, str], bytes]]:
    """Send each request on one connection in turn; the answers, then whether the server closed it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        out = []
        for r in requests:
            writer.write(r)
            out.append(await _answer(reader))
        return out
    finally:
        writer.close()


def _comparable(headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k not in ("date",)}


def _same_body(a: bytes, b: bytes) -> bool:
    """Two answers to the same request: equal but for the time they were made (a JSON answer's
    ``created``, which may fall on either side of a second), or the same number of events."""
    if a.startswith(b"data: "):
        return a.count(b"data: ") == b.count(b"data: ")
    x, y = orjson.loads(a), orjson.loads(b)
    for d in (x, y):
        d.pop("created", None)
    return x == y


@pytest.fixture
def written(monkeypatch):
    """The answers the pipeline handed back to aiohttp, in order."""
    seen: list[object] = []

    def recorded(method):
        async def recording(self, *a, **kw):
            out = await method(self, *a, **kw)
            seen.append(out)
            return out
        return recording

    monkeypatch.setattr(Relay, "answer", recorded(Relay.answer))
    monkeypatch.setattr(Relay, "stream_from_head", recorded(Relay.stream_from_head))   # SGLang's streams
    return seen


async def test_answers_are_written_whole_and_match_what_aiohttp_would_send(sims, gateway, written):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    plain = {"model": "m", "messages": CHAT, "max_tokens": 4, "temperature": 0}
    stream = {**plain, "stream": True}
    got = await _exchange(gw.port, _request(plain), _request(stream), _request(plain, close=True))
    assert [type(w) for w in written] == [WrittenAnswer, WrittenStream, WrittenAnswer]
    (s1, h1, b1), (s2, h2, b2), (s3, h3, b3) = got
    assert s1 == s2 == s3 == "HTTP/1.1 200 OK"
    assert orjson.loads(b1)["object"] == "chat.completion" and _same_body(b1, b3)
    assert b2.endswith(b"data: [DONE]\n\n") and b'"chat.completion.chunk"' in b2
    assert h1["content-length"] == str(len(b1)) and h1["content-type"] == "application/json"
    assert h2["content-type"] == "text/event-stream; charset=utf-8" and h2["cache-control"] == "no-cache"
    assert "connection" not in h1 and "connection" not in h2 and h3["connection"] == "close"
    assert h1["request-id"] == h1["x-request-id"] == "r-1" and h1["date"] and h1["server"].startswith("Python/")

    # the same three exchanges through aiohttp's responses: the same status, headers and bodies
    written.clear()
    gw.gw.relay.whole = False
    gw.runner.server.lane_paths.clear()     # the edge's fast lane writes whole only
    again = await _exchange(gw.port, _request(plain), _request(stream), _request(plain, close=True))
    assert not any(isinstance(w, WrittenAnswer) for w in written)
    for (s, h, b), (s0, h0, b0) in zip(got, again, strict=True):
        assert (s, _comparable(h)) == (s0, _comparable(h0))
        assert _same_body(b, b0)


async def test_error_answers_are_written_whole_too(sims, gateway, monkeypatch):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    wrote = []
    from gateway.pipeline import relay as relay_module
    whole = relay_module.write_whole

    def recording(*a, **kw):
        out = whole(*a, **kw)
        wrote.append(out)
        return out

    monkeypatch.setattr(relay_module, "write_whole", recording)
    unknown = _request({"model": "nope", "messages": CHAT})
    too_long = _request({"model": "m", "messages": CHAT, "max_tokens": 10**9})     # the engine's 400
    got = await _exchange(gw.port, unknown, too_long)
    assert [type(w) for w in wrote] == [WrittenAnswer, WrittenAnswer]
    gw.gw.relay.whole = False
    gw.runner.server.lane_paths.clear()     # the edge's fast lane writes whole only
    again = await _exchange(gw.port, unknown, too_long)
    assert len(wrote) == 2
    for (s, h, b), (s0, h0, b0) in zip(got, again, strict=True):
        assert (s, _comparable(h)) == (s0, _comparable(h0)) and _same_body(b, b0)
    assert got[0][0] == "HTTP/1.1 404 Not Found" and orjson.loads(got[0][2])["error"]["code"] == "model_not_found"
    assert got[1][0] == "HTTP/1.1 400 Bad Request"


async def test_a_closed_answer_closes_the_connection(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(_request({"model": "m", "messages": CHAT, "max_tokens": 2}, close=True))
        status, headers, _ = await _answer(reader)
        assert status == "HTTP/1.1 200 OK" and headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 10) == b""        # and the server closed it
    finally:
        writer.close()


async def test_http_1_0_gets_aiohttps_responses(sims, gateway, written):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    [(status, headers, body)] = await _exchange(gw.port, _request({"model": "m", "messages": CHAT, "max_tokens": 2},
                                                                  version="1.0"))
    assert status == "HTTP/1.0 200 OK" and orjson.loads(body)["object"] == "chat.completion"
    assert not isinstance(written[-1], WrittenAnswer)


async def test_tenants_answers_are_written_whole_on_the_fast_lane_with_their_rate_headers_once(sims, gateway, written,
                                                                                                monkeypatch):
    """With API keys and limits, a tenant's answers (a body, a stream, a 429) are written by the
    gateway itself from the fast lane, and each carries the tenant's x-ratelimit-* headers once
    (``_answer`` fails on a header sent twice); a request refused before its limits were checked
    (no key) carries none."""
    error_answer = Relay.error_answer

    def recording(self, *a, **kw):
        out = error_answer(self, *a, **kw)
        written.append(out)
        return out

    monkeypatch.setattr(Relay, "error_answer", recording)
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS, limits={"users": {"alice": {"rpm": 4}}})
    # the openai SDK reads them as it reads OpenAI's
    raw = await openai_client(gw, ALICE).chat.completions.with_raw_response.create(model="m", messages=CHAT,
                                                                                    max_tokens=2)
    assert raw.headers["x-ratelimit-limit-requests"] == "4" and raw.headers["x-ratelimit-remaining-requests"] == "3"
    chat = {"model": "m", "messages": CHAT, "max_tokens": 2}
    answers = await _exchange(gw.port, _request(chat, key=ALICE, rid="a-1"),
                              _request({**chat, "stream": True}, key=ALICE, rid="a-2"),
                              _request(chat, key=ALICE, rid="a-3"),
                              _request(chat, key=ALICE, rid="a-4"),     # the fourth in a minute: 429
                              _request(chat, rid="a-5"))                # no key: 401
    statuses = [a[0] for a in answers]
    assert statuses == ["HTTP/1.1 200 OK"] * 3 + ["HTTP/1.1 429 Too Many Requests", "HTTP/1.1 401 Unauthorized"]
    remaining = [h.get("x-ratelimit-remaining-requests") for _, h, _ in answers]
    assert remaining == ["2", "1", "0", "0", None]
    for _, h, _ in answers[:4]:
        assert h["x-ratelimit-limit-requests"] == "4" and "x-ratelimit-reset-requests" in h
    assert answers[1][1]["content-type"].startswith("text/event-stream") and answers[1][2].endswith(b"data: [DONE]\n\n")
    assert orjson.loads(answers[3][2])["error"]["code"] == "rate_limit_exceeded"
    assert "retry-after" in answers[3][1]
    assert [type(w) for w in written] == [WrittenAnswer, WrittenAnswer, WrittenStream, WrittenAnswer, WrittenAnswer,
                                          WrittenAnswer]
    assert gw.runner.server.edge.lane_requests == 6


async def test_the_openai_client_reads_written_answers(sims, gateway, written):
    sim = await sims("sglang", "m")
    gw = await gateway([model_block("m", "sglang", [sim.url])])
    c = openai_client(gw)
    r = await c.chat.completions.create(model="m", messages=CHAT, max_tokens=5)
    assert r.choices[0].message.content and r.usage.completion_tokens == 5
    text = ""
    async for ev in await c.chat.completions.create(model="m", messages=CHAT, max_tokens=5, stream=True):
        if ev.choices:
            text += ev.choices[0].delta.content or ""
    assert text
    with pytest.raises(openai.NotFoundError):
        await c.chat.completions.create(model="nope", messages=CHAT)
    assert [type(w) for w in written] == [WrittenAnswer, WrittenStream]
    assert gw.runner.server.edge.lane_requests == 3        # the SDK's three, on the edge's fast lane
    assert "switchyard_client_requests_fast_lane_total 3.0" in await gw.metrics_text()


class _Transport:
    def __init__(self):
        self.out = b""

    def is_closing(self):
        return False

    def write(self, data):
        self.out += data

    def get_extra_info(self, name, default=None):
        return default


def test_a_header_line_with_a_line_break_is_not_sent():
    """A header value with CR or LF would split the head (aiohttp answers 500 for one); the whole
    writer leaves that line out and sends the rest. Statuses no body may follow are aiohttp's."""
    from aiohttp.test_utils import make_mocked_request

    t = _Transport()
    req = make_mocked_request("POST", "/v1/chat/completions", transport=t, writer=SimpleNamespace(output_size=0))
    assert write_whole(req, 204, {}, "application/json", b"{}") is None      # no body may follow a 204
    assert t.out == b""
    for bad in ("a\r\nx-injected: 1", "a\nb", "a\rb"):
        t.out = b""
        w = write_whole(req, 200, {"x": bad, "y": "kept"}, "application/json", b"{}")
        assert isinstance(w, WrittenAnswer)
        head = t.out.split(b"\r\n\r\n")[0]
        assert b"x:" not in head and b"injected" not in head and b"\r\ny: kept\r\n" in head
        assert t.out.endswith(b"\r\n\r\n{}")
    s = open_stream(req, {"x": "a\nb", "y": "kept"}, "text/event-stream")
    assert isinstance(s, WrittenStream) and b"y: kept" in t.out and b"a\nb" not in t.out
    assert t.out.startswith(b"HTTP/1.1 200 OK\r\ny: kept\r\n") or b"HTTP/1.1 200 OK\r\ny: kept\r\n" in t.out
    assert req.writer.output_size > 0


def test_a_held_head_goes_out_with_the_first_write():
    """``open_stream(hold=True)`` writes nothing; the first chunk carries the head in the same
    write, and an answer with nothing to write sends the head alone, or with its end."""
    from aiohttp.test_utils import make_mocked_request

    class Writes(_Transport):
        def __init__(self):
            super().__init__()
            self.calls: list[bytes] = []

        def write(self, data):
            self.calls.append(bytes(data))
            super().write(data)

    proto = SimpleNamespace(writing_paused=False)
    for finish in ("chunk", "send_head", "eof"):
        t = Writes()
        req = make_mocked_request("POST", "/v1/chat/completions", transport=t, writer=SimpleNamespace(output_size=0))
        s = open_stream(req, {"y": "kept"}, "text/event-stream", hold=True)
        s._protocol = proto                     # a client reading along: no drain
        assert isinstance(s, WrittenStream) and s.holding and t.calls == [] and req.writer.output_size == 0
        if finish == "chunk":
            asyncio.run(s.write(b"data: 1\n\n"))
            asyncio.run(s.write(b"data: 2\n\n"))
            assert len(t.calls) == 2 and t.calls[0].startswith(b"HTTP/1.1 200 OK\r\ny: kept\r\n")
            assert t.calls[0].endswith(b"\r\n\r\n9\r\ndata: 1\n\n\r\n") and t.calls[1] == b"9\r\ndata: 2\n\n\r\n"
        elif finish == "send_head":
            s.send_head()
            s.send_head()                       # once only
            assert len(t.calls) == 1 and t.calls[0].endswith(b"\r\n\r\n")
        else:
            asyncio.run(s.write_eof())
            assert len(t.calls) == 1 and t.calls[0].endswith(b"\r\n\r\n0\r\n\r\n")
        assert not s.holding and req.writer.output_size == len(t.out)
    t = Writes()
    req = make_mocked_request("POST", "/v1/chat/completions", transport=t, writer=SimpleNamespace(output_size=0))
    s = open_stream(req, {}, "text/event-stream")
    assert not s.holding and len(t.calls) == 1          # not held: the head at once


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_a_pd_streams_head_goes_out_with_its_first_token_and_an_aggregated_ones_at_once(
        sims, gateway, engine, monkeypatch):
    """A P/D stream's head waits for the decode's first bytes (gateway/pd/orchestrator.py), so it
    goes to the client in the same write as the first event: the client wakes once for its first
    token. An aggregated stream's head still goes out as soon as the engine's does, before the
    first token."""
    from tests.support.factories import pd_model, pd_pair, roleset

    sent: list[bytes] = []
    send = WrittenStream._send

    def recording(self, data):
        held = getattr(self, "_held", None)      # the head this write carries, if held
        sent.append(held + data if held is not None else data)
        send(self, data)

    monkeypatch.setattr(WrittenStream, "_send", recording)
    p, d = await pd_pair(sims, engine)
    agg = await sims("vllm", "a", ttft_base_ms=30.0, itl_ms=5.0)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)]), model_block("a", "vllm", [agg.url])])
    for model in ("m", "a"):
        sent.clear()
        [(status, headers, body)] = await _exchange(gw.port, _request(
            {"model": model, "messages": CHAT, "stream": True, "max_tokens": 4}))
        assert status == "HTTP/1.1 200 OK" and body.endswith(b"data: [DONE]\n\n")
        head, _, first = sent[0].partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        if model == "m":
            assert first.split(b"\r\n", 1)[-1].startswith(b"data: {"), sent[0]  # the first event, same write
        else:
            assert first == b"", sent[0]                                        # the head alone, at once


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_a_pd_streams_head_is_made_while_its_first_bytes_are_awaited_and_remade_when_stale(
        sims, gateway, engine, monkeypatch):
    """The head a P/D stream's client gets is made while the decode's KV moves (``Relay.head_ahead``),
    so the first token does not wait for it; it is the head the relay would make then, and one
    made more than ``HeadAhead.FRESH_S`` earlier is made again (its ``Date`` would be off)."""
    import gateway.pipeline.relay as relay_mod
    import gateway.pipeline.whole as whole_mod
    from tests.support.factories import pd_model, pd_pair, roleset

    made: list[bytes] = []
    stream_head = whole_mod.stream_head

    def counting(*a, **kw):
        out = stream_head(*a, **kw)
        made.append(out[0])
        return out

    monkeypatch.setattr(relay_mod, "stream_head", counting)
    monkeypatch.setattr(whole_mod, "stream_head", counting)
    p, d = await pd_pair(sims, engine)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])])
    heads = []
    for fresh in (relay_mod.HeadAhead.FRESH_S, 0.0):
        monkeypatch.setattr(relay_mod.HeadAhead, "FRESH_S", fresh)
        made.clear()
        [(status, headers, body)] = await _exchange(gw.port, _request(
            {"model": "m", "messages": CHAT, "stream": True, "max_tokens": 4}, rid="same"))
        assert status == "HTTP/1.1 200 OK" and body.endswith(b"data: [DONE]\n\n")
        assert len(made) == (1 if fresh else 2)       # made ahead, and again only when stale
        heads.append(_comparable(headers))
    assert heads[0] == heads[1]
    assert {"prefill-target-pod", "target-pod", "routing-strategy", "cache-control", "x-accel-buffering",
            "transfer-encoding", "content-type", "request-id"} <= set(heads[0])


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_a_streams_head_is_made_while_the_engine_computes_and_names_the_endpoint_that_answered(
        sims, gateway, engine, monkeypatch):
    """An aggregated stream's head for the client is made once the leg is written on a kept-alive
    connection, before the engine's own head comes (SGLang sends it with the first token, which
    then finds it made), and made again for each leg: the head names the endpoint that answered,
    with ``x-retries`` after a 503 sent the stream elsewhere. An engine's error is answered with
    the plain error headers."""
    import gateway.upstream.h1client as h1
    order: list[str] = []
    stream_ahead, on_headers = Relay.stream_ahead, h1._Conn.on_headers_complete

    def ahead(self, ctx):
        order.append("made")
        return stream_ahead(self, ctx)

    def engine_head(self):
        order.append(f"engine {self.parser.get_status_code()}")
        return on_headers(self)

    monkeypatch.setattr(Relay, "stream_ahead", ahead)
    monkeypatch.setattr(h1._Conn, "on_headers_complete", engine_head)
    busy = await sims(engine, "m", fault="status=503")
    live = await sims(engine, "m")
    gw = await gateway([model_block("m", engine, [busy.url, live.url])], routing={"strategy": "round-robin"},
                       breaker={"consecutive_faults": 100, "fault_rate": 0})
    client = openai_client(gw)
    retried = 0
    for i in range(6):
        order.clear()
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=CHAT, max_tokens=4, stream=True)
        assert raw.headers["target-pod"] == live.url.split("//")[1]
        assert "".join([c.choices[0].delta.content or "" async for c in raw.parse() if c.choices])
        if i < 2:
            continue                    # the connections to both engines are new: the head is made after
        if raw.headers.get("x-retries"):
            retried += 1
            assert raw.headers["x-retries"] == "1" and order == ["made", "engine 503", "made", "engine 200"], order
        else:
            assert order == ["made", "engine 200"], order
    assert retried >= 1
    order.clear()
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="m", messages=CHAT, max_tokens=4, stream=True,
                                             extra_headers={"x-sim-fault": "status=400"})
    assert e.value.response.headers["content-type"].startswith("application/json")
    assert "cache-control" not in e.value.response.headers       # not the stream's headers
    await client.close()


async def test_an_sglang_streams_first_token_goes_out_from_the_read_that_brings_its_head(sims, gateway, monkeypatch):
    """SGLang sends a stream's head with its first token: on a kept-alive connection the relay is
    ready before they come, and the read that brings them writes the client's head and first event,
    in one write, with no task running. What is not a 200 event stream is answered as before: an
    engine's 400 is the client's 400, a head that does not come within the first-chunk bound is a
    504 (the engine's request aborted), and the connections serve the next stream."""
    from tests.support.http import sim_state
    from tests.support.waiting import wait_for
    firsts = record_first_writes(monkeypatch)
    sim = await sims("sglang", "m")
    gw = await gateway([model_block("m", "sglang", [sim.url])],
                       watchdog={"first_chunk_timeout_s": 0.5, "aggregated": True})
    client = openai_client(gw)

    async def streamed(**kw) -> str:
        stream = await client.chat.completions.create(model="m", messages=CHAT, max_tokens=5, stream=True, **kw)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    assert await streamed()                     # the engine's connection opens: the usual path
    firsts.clear()
    for _ in range(2):
        assert await streamed(stream_options={"include_usage": True})
    assert_written_from_reads(firsts, 2)                       # from the engine connection's reads
    with pytest.raises(openai.BadRequestError):
        await streamed(extra_headers={"x-sim-fault": "status=400"})
    with pytest.raises(openai.APIStatusError) as e:
        await streamed(extra_headers={"x-sim-fault": "stall_before_first=10"})
    assert e.value.status_code == 504
    assert await wait_for(lambda: _sim_aborted(sim_state, sim.url), timeout=8)
    assert await streamed()
    await client.close()


async def _sim_aborted(sim_state, url) -> bool:
    st = await sim_state(url)
    return st["counts"]["aborted"] >= 1 and not st["running"]
