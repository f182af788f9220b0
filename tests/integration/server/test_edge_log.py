"""The request log line of every answer the edge writes itself, on a raw socket against a real
gateway: a head or body the HTTP parser refuses (400, 431), a head or body that does not come in
time (408), a body over ``server.max_body_bytes`` (413), a content coding or an expectation the
gateway does not serve (415, 417), a version or a method it does not take (400, 405). Each gets
one line, the shape of every request line (``method``, ``path`` as far as the edge read it,
``status``, the ``request_id`` its answer carries, ``error_class: http`` and the answer's message
in ``error``), whose ``duration_ms`` runs from the head's start, as do the lines of the router's
404 and 405 and of the 501. The answers themselves are the hostile tests' (test_edge_hostile.py)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sys

import orjson
import pytest

from gateway.server.app import GATEWAY_KEY
from tests.integration.server.test_edge_hostile import CASES, SERVER
from tests.support.edge import assert_openai_error, edge_gateway, exchange, request
from tests.support.loops import on_both_loops
from tests.support.ports import listen_port
from tests.support.waiting import wait_for

CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
H = b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: gateway.test\r\nContent-Type: application/json\r\n"

# answered by the router (404, 405) or the pipeline (a chunked body over the limit, a gzip bomb): logged there
ELSEWHERE = {"trace", "unknown_path", "wrong_method", "body_over_max_chunked", "gzip_bomb"}

# more answers of the edge's own than the hostile cases hold: (case, bytes, status)
MORE = [
    ("coding_x_foo", request("POST", CHAT, BODY, {"Content-Encoding": "x-foo"}), 415),
    ("coding_stacked", request("POST", "/v1/embeddings", BODY, {"Content-Encoding": "gzip, gzip"}), 415),
    ("expect_unknown", request("POST", CHAT, BODY, {"Expect": "the-unexpected"}), 417),
    ("expect_unknown_on_models", request("GET", "/v1/models", None, {"Expect": "nothing"}), 417),
    ("body_over_max_on_messages", request("POST", "/v1/messages", b"x" * 5000), 413),
    ("head_with_nul_on_messages", b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", 400),
]

_LINE = re.compile(rb"([A-Z]+) (/[^ ?\r\n]*)")


def _said(raw: bytes) -> tuple[str | None, str | None]:
    """(method, path) as the bytes' request line gives them, when it is one."""
    m = _LINE.match(raw)
    return (m.group(1).decode(), m.group(2).decode()) if m is not None else (None, None)


@contextlib.contextmanager
def _lines(gw):
    with gw.app[GATEWAY_KEY].request_log.capture() as lines:
        yield lines


async def _line_of(lines: list[dict], rid: str) -> list[dict]:
    """The lines with the request id ``rid``, once one came (a line written after its answer, as the
    pipeline's, comes a moment later)."""
    await wait_for(lambda: any(x["request_id"] == rid for x in lines), timeout=5.0, interval=0.01)
    return [x for x in lines if x["request_id"] == rid]


@on_both_loops
async def test_each_answer_the_edge_writes_itself_has_one_request_log_line():
    async with edge_gateway(**SERVER) as gw:
        with _lines(gw) as every:
            for case, parts, status, _ in [*CASES, *((c, [raw], s, 0) for c, raw, s in MORE)]:
                ex = await exchange(gw.port, *parts, wait=8.0, until_close=case not in ELSEWHERE, responses=1)
                rid = ex.first.headers["request-id"]
                mine = await _line_of(every, rid)
                assert len(mine) == 1, (case, every)
                line = mine[0]
                assert (line["status"], line["request_id"]) == (ex.first.status, rid) == (status, rid), (case, line)
                if case in ELSEWHERE:
                    continue
                method, path = _said(parts[0])
                if case == "connect":               # an authority, no path
                    method, path = "CONNECT", ""
                elif case == "http2_preface":       # a request line's start, with * for its target
                    method = "PRI"
                elif case == "url_20kb":            # the edge kept the head's first bytes: the path is whole
                    path = "/health"
                assert (line["method"], line["path"]) == (method, path), (case, line)
                assert line["error_class"] == "http", (case, line)
                message = ex.first.json()["error"]["message"]
                assert line["error"] == message, (case, line)
                assert line["model"] == "-" and line["endpoint"] == "" and line["duration_ms"] >= 0, (case, line)
            assert await wait_for(lambda: gw.connections() == 0, timeout=10.0, interval=0.01)
            # a body that broke while the pipeline read it: its line is the edge's answer, not a client's cancel
            assert [x for x in every if x["status"] == 499] == [], every
            assert await gw.received() == []


@on_both_loops
async def test_a_head_refused_on_a_messages_path_is_logged_with_its_path():
    async with edge_gateway(**SERVER) as gw:
        with _lines(gw) as lines:
            ex = await exchange(gw.port, b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n")
            assert ex.first.status == 400 and ex.first.json()["type"] == "error"
            mine = await _line_of(lines, ex.first.headers["request-id"])
        assert [(x["method"], x["path"], x["status"]) for x in mine] == [("POST", "/v1/messages", 400)]
        assert mine[0]["error"] == ex.first.json()["error"]["message"]


HEAD_TIMEOUT = 0.3


@on_both_loops
async def test_a_408_has_one_line_whose_duration_covers_the_timeout():
    """A head that stops on a fresh connection and on a kept-alive one, a body that stops on the fast
    lane's path (its head and part of its body in one read) and on aiohttp's, where the pipeline was
    reading it: each 408's one line (not a client's cancel), its duration at least the timeout that
    fired."""
    server = {"header_timeout_s": HEAD_TIMEOUT, "body_timeout_s": HEAD_TIMEOUT, "keepalive_timeout_s": 5.0}
    promised = request("POST", CHAT, None, {"Content-Type": "application/json", "Content-Length": "100000"})
    cases = [
        ("head", (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty",), "POST", CHAT, "header"),
        ("kept_alive_head", (request("GET", "/health"), b"GET /v1/mod"), "GET", "/v1/mod", "header"),
        ("body_lane", (promised + BODY[:20],), "POST", CHAT, "body"),
        ("body", (promised, BODY[:20]), "POST", CHAT, "body"),
        ("chunked_body", (request("POST", "/v1/completions", None, {"Transfer-Encoding": "chunked"}), b"5\r\nab"),
         "POST", "/v1/completions", "body"),
    ]
    async with edge_gateway(**server) as gw:
        with _lines(gw) as every:
            for case, parts, method, path, reason in cases:
                ex = await exchange(gw.port, *parts, wait=8.0)
                answer = ex.responses[-1]
                err = assert_openai_error(answer, 408)
                assert f"{reason}_timeout_s" in err["message"], (case, err)
                mine = await _line_of(every, answer.headers["request-id"])
                assert [(x["method"], x["path"], x["status"], x["error_class"]) for x in mine] == [
                    (method, path, 408, "http")], (case, every)
                assert mine[0]["error"] == err["message"], (case, mine)
                assert mine[0]["duration_ms"] >= HEAD_TIMEOUT * 1000 - 1, (case, mine)
            assert await wait_for(lambda: gw.connections() == 0, timeout=10.0, interval=0.01)
            assert [x["status"] for x in every if x["status"] != 200] == [408] * len(cases), every
            assert not [k for k, v in gw.samples().items() if k.startswith("switchyard_client_cancels_total") and v]


GAP = 0.3
# the gateway's clock starts when its loop reads the first write, which a loaded machine delays
# (3 ms once in a CI run, with the second write read on time): the line's duration is then short of
# the gap by as much. Half the gap still tells the head's start from the moment the answer was made
# (a duration of about 1 ms), what these tests pin.
COVERS_GAP_MS = GAP * 1000 / 2


@on_both_loops
async def test_the_404_405_and_501_lines_count_from_the_head_s_start():
    """A head sent in two writes ``GAP`` s apart, on a fresh connection and on a kept-alive one: its
    line's duration covers the gap (where it was the moment the answer was made)."""
    async with edge_gateway(header_timeout_s=10.0, keepalive_timeout_s=10.0) as gw:
        for first, status in ((b"GET /nope HTTP/1.1\r\n", 404), (b"DELETE /v1/models HTTP/1.1\r\n", 405),
                              (b"PROPFIND /v1/models HTTP/1.1\r\n", 501)):
            for before in (b"", request("GET", "/health")):
                with _lines(gw) as lines:
                    parts = (before + first, b"Host: x\r\n\r\n") if not before else (before, first, b"Host: x\r\n\r\n")
                    ex = await exchange(gw.port, *parts, pause=GAP, wait=8.0, until_close=False,
                                        responses=2 if before else 1)
                    answer = ex.responses[-1]
                    assert answer.status == status, (first, answer)
                    mine = await _line_of(lines, answer.headers["request-id"])
                assert len(mine) == 1 and mine[0]["status"] == status, (first, lines)
                assert mine[0]["duration_ms"] >= COVERS_GAP_MS, (first, before, mine)


@on_both_loops
async def test_an_unknown_method_s_501_and_a_refused_head_count_from_the_head_s_start():
    """The parser stops at a method it does not know, or at a header field it refuses, as soon as it
    reads it: the head's first bytes came ``GAP`` s before."""
    async with edge_gateway(header_timeout_s=10.0) as gw:
        for parts, method, status in (((b"GE", b"TX /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"), "GETX", 501),
                                      ((b"GET /v1/models HTTP/1.1\r\n", b"Host: x\r\nX-A: a\x00b\r\n\r\n"), "GET", 400)):
            with _lines(gw) as lines:
                ex = await exchange(gw.port, *parts, pause=GAP, wait=8.0)
                assert ex.first.status == status, ex.first
                mine = await _line_of(lines, ex.first.headers["request-id"])
            assert [(x["method"], x["path"], x["status"]) for x in mine] == [(method, "/v1/models", status)]
            assert mine[0]["duration_ms"] >= COVERS_GAP_MS, mine


@pytest.mark.timeout(90)
async def test_every_worker_logs_the_answers_its_edge_writes(sims, tmp_path):
    """``--workers 2``, JSON lines on stderr: each refused head, body or expectation, whichever
    worker took its connection, has its one request line, and a health check and a scrape none."""
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, log_format: json, max_body_bytes: 4096}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: ['{sim.url}']}}]\n")
    log_path = tmp_path / "gw.log"
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                    "--workers", "2", stderr=log_file)
    kinds = [
        (b"GARBAGE\r\n\r\n", 400),
        (request("POST", CHAT, BODY, {"X-Big": "a" * 20_000}), 431),
        (H + b"Content-Length: 5000\r\n\r\n" + b"x" * 5000, 413),
        (request("POST", CHAT, BODY, {"Content-Encoding": "x-foo"}), 415),
        (request("POST", CHAT, BODY, {"Expect": "the-unexpected"}), 417),
    ]
    sent: dict[str, int] = {}
    try:
        async with asyncio.timeout(40):
            while True:
                with contextlib.suppress(OSError):
                    ex = await exchange(port, request("GET", "/ready", close=True), wait=2.0)
                    if ex.responses and ex.first.status == 200:
                        break
                await asyncio.sleep(0.05)
        for _ in range(4):
            for raw, status in kinds:
                ex = await exchange(port, raw, wait=8.0)
                assert ex.first.status == status, (raw[:40], ex.first)
                sent[ex.first.headers["request-id"]] = status
            for path in ("/health", "/metrics"):
                assert (await exchange(port, request("GET", path, close=True), wait=8.0)).first.status == 200
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    lines = [orjson.loads(raw) for raw in log_path.read_bytes().splitlines() if raw.startswith(b"{")]
    requests = [x for x in lines if x.get("event") == "request"]
    assert sorted(x["request_id"] for x in requests if x["request_id"] in sent) == sorted(sent), requests
    for line in requests:
        if line["request_id"] in sent:
            assert line["status"] == sent[line["request_id"]] and line["error_class"] == "http", line
            assert line["level"] == "info" and line["timestamp"] and line["duration_ms"] >= 0, line
    assert not [x for x in requests if x["path"] in ("/health", "/metrics", "/ready")], requests


@on_both_loops
async def test_with_cors_on_the_edge_s_answer_to_a_page_s_request_says_its_cors_outcome():
    origin = "https://app.example"
    async with edge_gateway(max_body_bytes=4096, cors_allowed_origins=[origin]) as gw:
        with _lines(gw) as lines:
            for headers, cors in (({"Origin": origin}, "allowed"), ({"Origin": "https://other.example"}, "refused"),
                                  ({}, None)):
                for raw, status in ((request("POST", CHAT, BODY, {**headers, "Expect": "nothing"}), 417),
                                    (request("POST", CHAT, BODY, {**headers, "Content-Encoding": "x-foo"}), 415),
                                    (H + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items())
                                     + b"Content-Length: 5000\r\n\r\n", 413)):
                    ex = await exchange(gw.port, raw, wait=8.0, responses=1, until_close=False)
                    assert ex.first.status == status, (headers, ex.first)
                    mine = await _line_of(lines, ex.first.headers["request-id"])
                    assert [(x["status"], x.get("cors")) for x in mine] == [(status, cors)], (headers, mine)


SECRET = "sk-SECRET4d1f"
# heads and bodies the parser refuses at a byte that sits on a line carrying a secret: (case, parts, what the
# answer may still name)
LEAKY = [
    ("bad_char_in_authorization", [b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                                   + SECRET.encode() + b"\x01\r\n\r\n"], "Authorization"),
    ("nul_in_api_key", [b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: " + SECRET.encode()
                        + b"\x00\r\nContent-Length: 2\r\n\r\n{}"], "x-api-key"),
    ("authorization_without_colon", [b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization Bearer "
                                     + SECRET.encode() + b"\r\n\r\n"], None),
    ("bare_lf_after_authorization", [b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                                     + SECRET.encode() + b"\nX-A: b\r\n\r\n"], "Authorization"),
    ("del_in_cookie", [b"GET /v1/models HTTP/1.1\r\nHost: x\r\nCookie: session=" + SECRET.encode()
                       + b"\x7f\r\n\r\n"], "Cookie"),
    ("bad_char_in_query", [b"GET /v1/models?token=" + SECRET.encode() + b"\x01 HTTP/1.1\r\nHost: x\r\n\r\n"], None),
    ("bad_method_before_query", [b"GE\x01T /v1/models?token=" + SECRET.encode() + b" HTTP/1.1\r\nHost: x\r\n\r\n"], None),
    ("chunk_data_overruns", [H + b"Transfer-Encoding: chunked\r\n\r\n", b"5\r\n" + SECRET.encode() + b"\r\n0\r\n\r\n"],
     None),
    ("chunk_data_overruns_in_one_write", [H + b"Transfer-Encoding: chunked\r\n\r\n5\r\n" + SECRET.encode()
                                          + b"\r\n0\r\n\r\n"], None),
]


async def test_a_refused_head_or_body_s_answer_and_line_carry_none_of_its_bytes():
    """The parser's message quotes the line it stopped on: a header field's value (an API key, a
    cookie), a request target's query (a token), a chunked body's data. None of it reaches the 400's
    message or its request log line; a header field's name still says where the head broke."""
    async with edge_gateway(**SERVER) as gw:
        with _lines(gw) as lines:
            for case, parts, named in LEAKY:
                ex = await exchange(gw.port, *parts, wait=8.0)
                assert ex.first.status == 400, (case, ex.first)
                message = ex.first.json()["error"]["message"]
                mine = await _line_of(lines, ex.first.headers["request-id"])
                assert len(mine) == 1 and mine[0]["error"] == message, (case, mine)
                assert SECRET not in message and SECRET not in orjson.dumps(mine[0]).decode(), (case, message)
                assert message.startswith(("malformed HTTP request: ", "malformed request body: ")), (case, message)
                if named is not None:
                    assert f"'{named}'" in message, (case, message)
