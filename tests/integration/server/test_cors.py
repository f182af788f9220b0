"""CORS (``server.cors_allowed_origins``, gateway/server/cors.py) over real sockets: preflights, and
the headers of JSON answers, errors and streams for a listed origin, another origin, any origin,
and CORS off (the gateway as before: OPTIONS refused, no CORS header)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

import aiohttp
import orjson
import pytest
from multidict import CIMultiDict

from gateway.config.schema import config_from_dict
from gateway.observability.logs import LineWriter
from gateway.server.app import GATEWAY_KEY
from gateway.server.run import start
from tests.support.edge import Resp, assert_openai_error, edge_gateway, exchange, request
from tests.support.factories import model_block
from tests.support.gateway_process import get_new
from tests.support.http import bearer, chat_body, openai_client, post
from tests.support.loops import on_both_loops
from tests.support.metrics import metric
from tests.support.ports import listen_port
from tests.support.tenancy import ALICE
from tests.support.waiting import wait_for

CHAT = [{"role": "user", "content": "Hello from a web page."}]
APP = "https://app.example.com"
OTHER = "https://evil.example.net"
ACAO = "Access-Control-Allow-Origin"
PREFLIGHT = {"Origin": APP, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os, routing-strategy"}


def _lane(gw) -> int:
    return gw.runner.server.edge.lane_requests


def _no_cors(headers) -> None:
    assert not [k for k in headers if k.lower().startswith("access-control-")], dict(headers)


def _cors(headers, origin: str = APP) -> None:
    """The headers of an answer to a listed origin."""
    assert headers[ACAO] == origin, dict(headers)
    assert "Origin" in [v.strip() for v in headers.get("Vary", "").split(",")], dict(headers)
    exposed = [v.strip() for v in headers["Access-Control-Expose-Headers"].split(",")]
    for name in ("x-request-id", "request-id", "target-pod", "routing-strategy", "x-ratelimit-remaining-requests",
                 "retry-after", "x-error-upstream"):
        assert name in exposed, exposed
    # every header of the answer a page's script would read is exposed: none of them is left for
    # the browser to hide (the safelisted ones, framing and CORS's own need no listing)
    hidden = {k.lower() for k in headers} - {v.lower() for v in exposed} - _NOT_FOR_SCRIPTS
    assert not hidden, hidden
    assert "Access-Control-Allow-Credentials" not in headers


# response headers a page's script reads without CORS listing them (the safelisted ones), or that are
# the connection's, a proxy's, the browser's or CORS's own
_NOT_FOR_SCRIPTS = {"cache-control", "content-language", "content-length", "content-type", "expires",
                    "last-modified", "pragma", "date", "server", "connection", "keep-alive", "transfer-encoding",
                    "vary", "x-content-type-options", "x-accel-buffering", "allow", "access-control-allow-origin",
                    "access-control-expose-headers", "access-control-allow-credentials"}


def _resp(r) -> Resp:
    """A Reply as the edge tests' error check reads it."""
    return Resp(status=r.status, headers={k.lower(): v for k, v in r.headers.items()}, body=r.body)


async def _options(gw, path: str, headers: dict[str, str]) -> tuple[int, CIMultiDict, bytes]:
    async with aiohttp.ClientSession() as s, s.options(gw.url + path, headers=headers) as r:
        return r.status, r.headers, await r.read()


async def _cors_gateway(sims, gateway, origins: list[str], **blocks):
    sim = await sims("vllm", "m")
    return await gateway([model_block("m", "vllm", [sim.url])],
                         server={"cors_allowed_origins": origins, **blocks.pop("server", {})}, **blocks)


async def test_cors_off_refuses_options_and_adds_no_header_as_before(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    status, headers, body = await _options(gw, "/v1/chat/completions", PREFLIGHT)
    assert status == 405 and headers["Allow"] == "POST"
    assert orjson.loads(body)["error"]["message"] == "method OPTIONS not allowed on /v1/chat/completions"
    _no_cors(headers)
    lane = _lane(gw)
    r = await post(gw, chat_body(CHAT), {"Origin": APP})
    assert r.status == 200
    _no_cors(r.headers)
    assert "Vary" not in r.headers
    assert _lane(gw) == lane + 1            # a request with an Origin is on the fast lane as any other


async def test_a_preflight_from_a_listed_origin_is_answered_without_a_key(sims, gateway):
    gw = await _cors_gateway(sims, gateway, [APP, "http://localhost:3000"], auth={"api_keys": [{"key": ALICE,
                                                                                                 "user": "alice"}]})
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/models", "/v1/responses/resp_1", "/tokenize"):
        status, headers, body = await _options(gw, path, PREFLIGHT)
        assert (status, body) == (204, b""), (path, status, body)
        assert headers[ACAO] == APP
        assert headers["Access-Control-Allow-Headers"] == "authorization, content-type, x-stainless-os, routing-strategy"
        methods = [m.strip() for m in headers["Access-Control-Allow-Methods"].split(",")]
        assert {"GET", "POST", "DELETE"} <= set(methods), methods
        assert int(headers["Access-Control-Max-Age"]) > 0
        assert "Origin" in headers["Vary"] and "Access-Control-Allow-Credentials" not in headers
        assert headers["x-request-id"]
    # the other listed origin is echoed in its turn; no headers asked for: none listed
    status, headers, _ = await _options(gw, "/v1/chat/completions", {
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
    assert status == 204 and headers[ACAO] == "http://localhost:3000"
    assert "Access-Control-Allow-Headers" not in headers
    # a plain OPTIONS (no Access-Control-Request-Method) is no preflight: refused as before, with CORS's headers
    status, headers, _ = await _options(gw, "/v1/chat/completions", {"Origin": APP})
    assert status == 405
    _cors(headers)
    # a preflight to a path outside the API (the gateway's own pages) is no API call either
    status, headers, _ = await _options(gw, "/metrics", PREFLIGHT)
    assert status == 405


async def test_a_preflight_from_another_origin_is_refused_without_cors_headers(sims, gateway):
    gw = await _cors_gateway(sims, gateway, [APP])
    status, headers, body = await _options(gw, "/v1/chat/completions", {**PREFLIGHT, "Origin": OTHER})
    assert status == 403
    _no_cors(headers)
    assert "Origin" in headers["Vary"]
    err = orjson.loads(body)["error"]
    assert err["code"] == "cors_origin_not_allowed" and OTHER in err["message"]
    assert "server.cors_allowed_origins" in err["message"]
    # Anthropic's shape on the Messages paths
    status, headers, body = await _options(gw, "/v1/messages", {**PREFLIGHT, "Origin": OTHER})
    assert status == 403 and orjson.loads(body)["type"] == "error"
    _no_cors(headers)


async def test_answers_to_a_listed_origin_carry_cors_headers(sims, gateway):
    gw = await _cors_gateway(sims, gateway, [APP], server={"max_body_bytes": 65536},
                             auth={"api_keys": [{"key": ALICE, "user": "alice"}]},
                             limits={"users": {"alice": {"rpm": 2}}})
    origin = {"Origin": APP}
    lane = _lane(gw)
    # a JSON answer, through the openai SDK
    raw = await openai_client(gw, ALICE).chat.completions.with_raw_response.create(
        model="m", messages=CHAT, max_tokens=3, extra_headers=origin)
    assert raw.parse().choices[0].message.content
    _cors(raw.headers)
    assert raw.headers["x-ratelimit-remaining-requests"] == "1"
    # a stream
    async with aiohttp.ClientSession() as s, s.post(gw.base_url + "/chat/completions", headers={**origin, **bearer(ALICE)},
                                                    json=chat_body(CHAT, stream=True)) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        _cors(r.headers)
        assert (await r.read()).rstrip().endswith(b"data: [DONE]")
    assert _lane(gw) == lane                # both went through aiohttp's request path
    # the gateway's own errors: no key (401), an unknown model (404), over the user's limit (429)
    r = await post(gw, chat_body(CHAT), origin)
    assert_openai_error(_resp(r), 401)
    _cors(r.headers)
    r = await post(gw, chat_body(CHAT, model="nope"), {**origin, **bearer(ALICE)})
    assert r.status == 404
    _cors(r.headers)
    r = await post(gw, chat_body(CHAT), {**origin, **bearer(ALICE)})
    assert r.status == 429 and r.headers["Retry-After"]
    _cors(r.headers)
    # an unknown path (aiohttp's router), GET /v1/models, and a body over server.max_body_bytes (the edge's)
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.base_url + "/nothing", headers=origin) as r:
            assert r.status == 404
            _cors(r.headers)
        async with s.get(gw.base_url + "/models", headers={**origin, **bearer(ALICE)}) as r:
            assert r.status == 200 and (await r.json())["data"][0]["id"] == "m"
            _cors(r.headers)
    got = await exchange(gw.port, request("POST", "/v1/chat/completions", b"x" * 70000, {"Origin": APP}), wait=10)
    assert got.first.status == 413
    _cors(CIMultiDict(got.first.raw_headers))
    # a client without an Origin header is served as before: on the fast lane, no CORS header
    lane = _lane(gw)
    r = await post(gw, chat_body(CHAT, model="nope"), bearer(ALICE))
    assert r.status == 404 and _lane(gw) == lane + 1
    _no_cors(r.headers)


async def test_answers_to_another_origin_carry_no_cors_header(sims, gateway):
    gw = await _cors_gateway(sims, gateway, [APP])
    r = await post(gw, chat_body(CHAT), {"Origin": OTHER})
    assert r.status == 200 and orjson.loads(r.body)["choices"]      # served: the browser keeps it from the page
    _no_cors(r.headers)
    assert "Origin" in r.headers["Vary"]
    r = await post(gw, chat_body(CHAT, model="nope"), {"Origin": OTHER})
    assert r.status == 404
    _no_cors(r.headers)


async def test_any_origin(sims, gateway):
    gw = await _cors_gateway(sims, gateway, ["*"])
    status, headers, _ = await _options(gw, "/v1/embeddings", {**PREFLIGHT, "Origin": OTHER})
    assert status == 204 and headers[ACAO] == "*"
    assert "Access-Control-Allow-Credentials" not in headers
    async with aiohttp.ClientSession() as s, s.post(gw.base_url + "/chat/completions", headers={"Origin": OTHER},
                                                    json=chat_body(CHAT, stream=True)) as r:
        assert r.status == 200
        _cors(r.headers, "*")
        await r.read()



# -- the answers the edge writes to the socket itself (a 408, a broken body's 400) ------------------

CHAT_PATH = "/v1/chat/completions"
# a head that promises a body of 100 bytes, then 20 of them: the body timeout's 408
STALLED = b'{"model": "m", "mes'


def _promised(headers: dict[str, str]) -> bytes:
    return request("POST", CHAT_PATH, None, {"Content-Type": "application/json", "Content-Length": "100",
                                              **headers}) + STALLED


def _broken(headers: dict[str, str]) -> tuple[bytes, ...]:
    """A chunked body whose second chunk's size is no number: the edge's 400 ``bad_body``."""
    head = request("POST", CHAT_PATH, None, {"Content-Type": "application/json", "Transfer-Encoding": "chunked",
                                             **headers})
    return head, b'4\r\n{"mo\r\n', b"zz\r\n"


def _vary(resp: Resp) -> list[str]:
    return [v.strip() for k, value in resp.raw_headers if k.lower() == "vary" for v in value.split(",")]


@on_both_loops
async def test_the_edges_own_answers_to_a_listed_origin_carry_cors_headers():
    async with edge_gateway(cors_allowed_origins=[APP], body_timeout_s=0.3, body_total_timeout_s=30.0) as gw:
        ex = await exchange(gw.port, _promised({"Origin": APP}))
        err = assert_openai_error(ex.first, 408)
        assert "body_timeout_s" in err["message"] and ex.closed
        _cors(CIMultiDict(ex.first.raw_headers))
        ex = await exchange(gw.port, *_broken({"Origin": APP}))
        assert assert_openai_error(ex.first, 400)["code"] == "bad_body" and ex.closed
        _cors(CIMultiDict(ex.first.raw_headers))
        # an origin not listed: no Access-Control-Allow-Origin, Vary: Origin as on every answer to it
        for parts in ((_promised({"Origin": OTHER}),), _broken({"Origin": OTHER})):
            ex = await exchange(gw.port, *parts)
            assert ex.first.status in (400, 408)
            _no_cors(ex.first.headers)
            assert _vary(ex.first) == ["Origin"]
    async with edge_gateway(cors_allowed_origins=["*"], body_timeout_s=0.3, body_total_timeout_s=30.0) as gw:
        ex = await exchange(gw.port, _promised({"Origin": OTHER}))
        assert ex.first.status == 408
        _cors(CIMultiDict(ex.first.raw_headers), "*")


@on_both_loops
async def test_an_edge_answer_without_a_known_origin_is_unchanged():
    """A head that never came whole, or that does not parse: no Origin is known, the answer is as before."""
    async with edge_gateway(cors_allowed_origins=[APP], header_timeout_s=0.3) as gw:
        ex = await exchange(gw.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: " + APP.encode()
                            + b"\r\nContent-Ty")
        assert ex.first.status == 408
        _no_cors(ex.first.headers)
        assert "vary" not in ex.first.headers
        ex = await exchange(gw.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: " + APP.encode()
                            + b"\r\nBad Header: x\r\n\r\n")
        assert ex.first.status == 400
        _no_cors(ex.first.headers)
        assert "vary" not in ex.first.headers


@on_both_loops
async def test_with_cors_off_the_edges_own_answers_are_as_before():
    async with edge_gateway(body_timeout_s=0.3, body_total_timeout_s=30.0) as gw:
        for parts in ((_promised({"Origin": APP}),), _broken({"Origin": APP})):
            ex = await exchange(gw.port, *parts)
            assert ex.first.status in (400, 408)
            assert [k.lower() for k, _ in ex.first.raw_headers] == [
                "content-type", "content-length", "connection", "request-id", "x-request-id"]


# -- answers to requests without an Origin: Vary: Origin with CORS on -------------------------------

def _varies(headers) -> bool:
    return "Origin" in [v.strip() for v in ",".join(headers.getall("Vary", [])).split(",")]


async def test_with_cors_on_answers_without_an_origin_vary_on_it(sims, gateway):
    """A shared cache must not hand an answer made without CORS's headers to a browser: with CORS
    on, every answer says it varies on Origin, those of the fast lane included."""
    gw = await _cors_gateway(sims, gateway, [APP])
    lane = _lane(gw)
    r = await post(gw, chat_body(CHAT))
    assert r.status == 200 and orjson.loads(r.body)["choices"]
    assert _varies(r.headers) and r.headers.getall("Vary") == ["Origin"]
    _no_cors(r.headers)
    r = await post(gw, chat_body(CHAT, model="nope"))
    assert r.status == 404 and _varies(r.headers)
    _no_cors(r.headers)
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.base_url + "/chat/completions", json=chat_body(CHAT, stream=True)) as r:
            assert r.status == 200 and _varies(r.headers)
            await r.read()
        assert _lane(gw) == lane + 3            # all three on the fast lane
        # aiohttp's request path: a query string (the pipeline writes the answer whole), a GET, a 404
        async with s.post(gw.base_url + "/chat/completions?x=1", json=chat_body(CHAT)) as r:
            assert r.status == 200 and _varies(r.headers)
            await r.read()
        for path in ("/v1/models", "/health", "/nothing"):
            async with s.get(gw.url + path) as r:
                assert _varies(r.headers), (path, dict(r.headers))
                _no_cors(r.headers)
        assert _lane(gw) == lane + 3
    # a listed origin's answer says it once
    r = await post(gw, chat_body(CHAT), {"Origin": APP})
    assert r.headers.getall("Vary") == ["Origin"]
    # with CORS off, none of them varies on Origin (the models' shape varies on anthropic-version)
    gw = await _cors_gateway(sims, gateway, [])
    r = await post(gw, chat_body(CHAT))
    assert r.status == 200 and "Vary" not in r.headers
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/v1/models") as r:
        assert r.headers.getall("Vary") == ["anthropic-version"]


@on_both_loops
async def test_with_cors_on_the_edges_own_answers_without_an_origin_vary_on_it():
    async with edge_gateway(cors_allowed_origins=[APP], body_timeout_s=0.3, body_total_timeout_s=30.0) as gw:
        # a body held for the fast lane, an aiohttp request's body (a query string), a broken body
        for parts in ((_promised({}),), (_promised({}).replace(b" HTTP/1.1", b"?x=1 HTTP/1.1", 1),), _broken({})):
            ex = await exchange(gw.port, *parts)
            assert ex.first.status in (400, 408) and ex.closed
            _no_cors(ex.first.headers)
            assert _vary(ex.first) == ["Origin"], ex.first.raw_headers


# -- what CORS did, counted and logged ------------------------------------------------------------

OUTCOMES = ("preflight_allowed", "preflight_refused", "allowed", "refused")


def _counted(page: str) -> dict[str, float]:
    return {o: metric(page, "switchyard_cors_requests_total", outcome=o) for o in OUTCOMES}


async def test_cors_outcomes_are_counted_and_logged(sims, gateway):
    gw = await _cors_gateway(sims, gateway, [APP])
    assert _counted(await gw.metrics_text()) == dict.fromkeys(OUTCOMES, 0.0)
    with gw.gw.request_log.capture() as lines:
        assert (await _options(gw, CHAT_PATH, PREFLIGHT))[0] == 204
        for path in (CHAT_PATH, "/v1/messages"):
            assert (await _options(gw, path, {**PREFLIGHT, "Origin": OTHER}))[0] == 403
        r = await post(gw, chat_body(CHAT), {"Origin": APP})
        assert r.status == 200
        # an origin not listed is served as before (the browser keeps the answer from the page)
        r = await post(gw, chat_body(CHAT), {"Origin": OTHER})
        assert r.status == 200 and orjson.loads(r.body)["choices"]
        _no_cors(r.headers)
        r = await post(gw, chat_body(CHAT, model="nope"), {"Origin": OTHER})
        assert r.status == 404
        r = await post(gw, chat_body(CHAT))         # no Origin: neither counted nor logged as CORS
        assert r.status == 200
        assert await wait_for(lambda: len(lines) == 7, timeout=10.0, interval=0.01), lines
    assert [(line["status"], line.get("cors")) for line in lines] == [
        (204, "preflight_allowed"), (403, "preflight_refused"), (403, "preflight_refused"),
        (200, "allowed"), (200, "refused"), (404, "refused"), (200, None)]
    assert "cors" not in lines[6]
    assert _counted(await gw.metrics_text()) == {"preflight_allowed": 1.0, "preflight_refused": 2.0,
                                                 "allowed": 1.0, "refused": 2.0}


async def test_with_cors_off_nothing_is_counted_or_logged(sims, gateway):
    gw = await _cors_gateway(sims, gateway, [])
    with gw.gw.request_log.capture() as lines:
        r = await post(gw, chat_body(CHAT), {"Origin": APP})
        assert r.status == 200
        assert await wait_for(lambda: len(lines) == 1, timeout=10.0, interval=0.01)
    assert "cors" not in lines[0]
    page = await gw.metrics_text()
    assert "# TYPE switchyard_cors_requests_total counter" in page     # the family, without a series
    assert _counted(page) == dict.fromkeys(OUTCOMES, 0.0)
    assert "switchyard_cors_requests_total{" not in page


# the line every request log line starts with, as a preflight has it: no model, user, endpoint or tokens
_PREFLIGHT_LINE = {"model": "-", "user": None, "strategy": "", "endpoint": "", "stream": False, "ttft_ms": None,
                   "prompt_tokens": None, "completion_tokens": None, "cached_tokens": None,
                   "finish_reason": None, "retries": 0, "method": "OPTIONS", "event": "request", "log_level": "info"}


async def test_each_preflight_answered_writes_a_request_log_line(sims, gateway):
    """An operator debugging a page's failing preflight finds it in the request log: one line per
    preflight the gateway answers, allowed or refused, with its status, its request id and the
    outcome in ``cors``; an OPTIONS that is no preflight, or one to a path outside the API, has the line
    of the 405 it gets, as every answer to a method a path does not serve."""
    gw = await _cors_gateway(sims, gateway, [APP], auth={"api_keys": [{"key": ALICE, "user": "alice"}]})
    with gw.gw.request_log.capture() as lines:
        status, allowed, _ = await _options(gw, CHAT_PATH, {**PREFLIGHT, "x-request-id": "preflight-1"})
        assert status == 204
        status, refused, body = await _options(gw, "/v1/messages", {**PREFLIGHT, "Origin": OTHER})
        assert status == 403
        status, odd, _ = await _options(gw, "/v1/models", {**PREFLIGHT, "x-request-id": "not a good id"})
        assert status == 204
        status, plain, _ = await _options(gw, CHAT_PATH, {"Origin": APP})           # no preflight
        assert status == 405
        status, elsewhere, _ = await _options(gw, "/metrics", PREFLIGHT)             # not the API
        assert status == 405
        r = await post(gw, chat_body(CHAT), {"Origin": APP, **bearer(ALICE)})      # a line as before
        assert r.status == 200
        assert await wait_for(lambda: len(lines) == 6, timeout=10.0, interval=0.01), lines
    first, second, third, not_preflight, not_api, fourth = lines
    for line in (first, second, third):
        assert line.pop("duration_ms") >= 0, line
    assert first == {"request_id": "preflight-1", "path": CHAT_PATH, "status": 204, "error_class": None,
                     "error": None, "cors": "preflight_allowed", **_PREFLIGHT_LINE}
    assert allowed["x-request-id"] == "preflight-1"
    message = orjson.loads(body)["error"]["message"]
    assert second == {"request_id": refused["x-request-id"], "path": "/v1/messages", "status": 403,
                      "error_class": "client", "error": message, "cors": "preflight_refused", **_PREFLIGHT_LINE}
    assert third == {"request_id": odd["x-request-id"], "path": "/v1/models", "status": 204, "error_class": None,
                     "error": None, "cors": "preflight_allowed", "request_id_replaced": True, **_PREFLIGHT_LINE}
    assert third["request_id"] != "not a good id"
    for line, path, answer, cors in ((not_preflight, CHAT_PATH, plain, "allowed"),
                                     (not_api, "/metrics", elsewhere, "preflight_refused")):
        assert (line["request_id"], line["path"], line["status"], line["method"], line["error_class"], line["cors"]) \
            == (answer["request-id"], path, 405, "OPTIONS", "http", cors), line
    assert not [k for k in elsewhere if k.lower().startswith("access-control-")], elsewhere
    assert (fourth["status"], fourth["cors"], fourth["user"]) == (200, "allowed", "alice")
    assert "method" not in fourth


@pytest.mark.timeout(90)
async def test_preflights_are_logged_by_every_worker(sims, tmp_path):
    """``--workers 2``, JSON lines on stderr: each worker writes its preflights' lines, info lines
    like the others; at ``server.log_level: warning`` (checked on the in-process gateway below) none."""
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   f"server: {{drain_delay_s: 0, log_format: json, cors_allowed_origins: ['{APP}']}}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: ['{sim.url}']}}]\n")
    log_path = tmp_path / "gw.log"
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                    "--workers", "2", stderr=log_file)
    sent: dict[str, tuple[int, int]] = {}         # request id: (the worker's pid, the status)
    try:
        async with asyncio.timeout(40):
            while True:
                with contextlib.suppress(OSError):
                    if (await get_new(port, "/ready"))[0] == 200:
                        break
                await asyncio.sleep(0.05)
            # a kept-alive connection stays with its worker: its pid, then preflights on it
            while len({pid for pid, _ in sent.values()}) < 2:
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
                    async with s.get(f"http://127.0.0.1:{port}/status.json") as r:
                        pid = (await r.json())["gateway"]["pid"]
                    for origin in (APP, OTHER):
                        rid = f"preflight-{len(sent)}"
                        async with s.options(f"http://127.0.0.1:{port}{CHAT_PATH}",
                                             headers={**PREFLIGHT, "Origin": origin, "x-request-id": rid}) as r:
                            sent[rid] = (pid, r.status)
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert {status for _, status in sent.values()} == {204, 403}
    lines = [orjson.loads(raw) for raw in log_path.read_bytes().splitlines() if raw.startswith(b"{")]
    logged = {x["request_id"]: x for x in lines if x.get("event") == "request"}
    assert set(logged) == set(sent), (sorted(logged), sorted(sent))
    for rid, (_, status) in sent.items():
        line = logged[rid]
        assert (line["method"], line["path"], line["status"], line["level"]) == ("OPTIONS", CHAT_PATH, status, "info")
        assert line["cors"] == ("preflight_allowed" if status == 204 else "preflight_refused")
        assert line["duration_ms"] >= 0 and line["timestamp"]


async def test_at_log_level_warning_a_preflight_writes_no_line(sims, tmp_path):
    sim = await sims("vllm", "m")
    out = tmp_path / "lines"
    for level, written in (("warning", 0), ("info", 1)):
        # the gateway fixture writes to /dev/null: a gateway of its own, its lines to a file
        cfg = config_from_dict({"listen": {"host": "127.0.0.1", "port": 0},
                                "server": {"cors_allowed_origins": [APP], "log_level": level, "log_format": "json"},
                                "models": [model_block("m", "vllm", [sim.url])]}, source="<test>")
        runner, app, gw_port = await start(cfg)
        request_log = app[GATEWAY_KEY].request_log
        with out.open("wb") as f:
            request_log.writer = LineWriter(fd=f.fileno())
            try:
                async with aiohttp.ClientSession() as s, \
                        s.options(f"http://127.0.0.1:{gw_port}{CHAT_PATH}", headers=PREFLIGHT) as r:
                    assert r.status == 204
            finally:
                await runner.cleanup()      # closes the log: every line written
        got = [orjson.loads(raw) for raw in out.read_bytes().splitlines()]
        assert len(got) == written, (level, got)
        if written:
            assert (got[0]["method"], got[0]["cors"], got[0]["level"]) == ("OPTIONS", "preflight_allowed", "info")


async def test_a_console_request_line_is_one_line_whatever_the_client_wrote(sims, tmp_path):
    """The console format (``server.log_format: console``, for a terminal) writes each request's
    fields as ``key=value``: a control character a client put in a field it chose (a preflight's
    path, a body's ``user``) is written escaped, and the value quoted, so no client can cut a line in
    two, or forge one."""
    sim = await sims("vllm", "m")
    out = tmp_path / "lines"
    cfg = config_from_dict({"listen": {"host": "127.0.0.1", "port": 0},
                            "server": {"cors_allowed_origins": [APP], "log_format": "console"},
                            "models": [model_block("m", "vllm", [sim.url])]}, source="<test>")
    runner, _app, gw_port = await start(cfg)
    request_log = _app[GATEWAY_KEY].request_log
    with out.open("wb") as f:
        request_log.writer = LineWriter(fd=f.fileno())
        try:
            async with aiohttp.ClientSession() as s:
                async with s.options(f"http://127.0.0.1:{gw_port}/v1/x%0A2026-01-01%2000:00:00%20forged%0D%1B[2J",
                                     headers=PREFLIGHT) as r:
                    assert r.status == 204
                async with s.post(f"http://127.0.0.1:{gw_port}/v1/chat/completions",
                                  json={**chat_body(CHAT), "user": "eve\nforged=1\u2028\x00"}) as r:
                    assert r.status == 200
        finally:
            await runner.cleanup()      # closes the log: every line written
    text = out.read_bytes().decode()
    lines = text.splitlines(keepends=True)
    assert len(lines) == 2 and all(line.endswith("\n") for line in lines), lines
    assert not any(c in text for c in "\r\x1b\x00\u2028"), text
    preflight, chat = sorted(lines, key=lambda line: "method=OPTIONS" not in line)
    assert ' path="/v1/x\\n2026-01-01 00:00:00 forged\\r\\x1b[2J" ' in preflight, preflight
    assert ' user="eve\\nforged=1\\u2028\\x00"' in chat, chat


async def test_a_page_reads_the_metadata_of_binary_embeddings(sims, gateway):
    """vLLM's binary embeddings (``encoding_format: "bytes"``) carry where each vector is in their
    ``metadata`` header: a page on a listed origin may read it, or the bytes are of no use to it."""
    gw = await _cors_gateway(sims, gateway, [APP])
    r = await post(gw, {"model": "m", "input": ["a", "b"], "encoding_format": "bytes"}, {"Origin": APP},
                   path="/v1/embeddings")
    assert r.status == 200 and r.headers["Content-Type"] == "application/octet-stream"
    assert orjson.loads(r.headers["metadata"])["data"][1]["index"] == 1
    _cors(r.headers)
