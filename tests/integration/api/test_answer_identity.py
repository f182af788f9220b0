"""Every answer names its request, and the answers to a bad routing header or objective say what
was wrong: ``request-id`` and ``x-request-id`` on the gateway's own paths (models, health, status,
Files and Batches, and their errors), an OpenAI-shaped 400 for an invalid ``routing-strategy`` whose
echo is bounded and printable, and a request log line that names the model a refused body named."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from tests.support.factories import model_block
from tests.support.http import chat_body, post

CHAT = [{"role": "user", "content": "Which track?"}]
GIVEN = "ticket-4711"


@pytest.fixture
async def gw(sims, gateway, tmp_path):
    sim = await sims("vllm", "m")
    return await gateway([model_block("m", "vllm", [sim.url])], server={"max_body_bytes": 4096},
                         batch={"enabled": True, "dir": str(tmp_path / "batch")})


ASKED = [("GET", "/v1/models", {}, 200), ("GET", "/v1/models/m", {}, 200), ("GET", "/v1/models/nope", {}, 404),
         ("GET", "/health", {}, 200), ("GET", "/ready", {}, 200), ("GET", "/status.json", {}, 200),
         ("GET", "/status", {}, 200), ("GET", "/metrics", {}, 200),
         ("GET", "/v1/files", {}, 200), ("GET", "/v1/batches", {}, 200), ("GET", "/v1/batches/nope", {}, 404),
         ("POST", "/v1/files", {"data": b"x"}, 400), ("POST", "/v1/chat/completions", {"data": b"x" * 8192}, 413),
         ("GET", "/nowhere", {}, 404), ("DELETE", "/health", {}, 405),
         ("POST", "/v1/chat/completions", {"data": b"{}", "headers": {"Content-Type": "text/plain"}}, 400)]


async def test_every_answer_of_the_gateways_own_paths_carries_the_request_id(gw):
    async with aiohttp.ClientSession() as s:
        for method, path, kw, status in ASKED:
            for given in (GIVEN, None):
                headers = {**kw.get("headers", {}), **({"x-request-id": GIVEN} if given else {})}
                async with s.request(method, gw.url + path, **{**kw, "headers": headers}) as r:
                    await r.read()
                    assert r.status == status, (method, path, r.status)
                    rid = r.headers.get("request-id")
                    assert rid and r.headers.get("x-request-id") == rid, (method, path, dict(r.headers))
                    assert rid == given or given is None, (method, path, rid)


async def test_an_invalid_routing_strategy_is_an_openai_400_with_a_bounded_printable_echo(gw):
    r = await post(gw, chat_body(CHAT), {"routing-strategy": "least-requets"})
    err = orjson.loads(r.body)["error"]
    assert r.status == 400 and r.headers["x-error-routing"] == "true"
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "routing-strategy",
                                                        "invalid_routing_strategy")
    assert "did you mean 'least-request'?" in err["message"]
    assert "least-request, " in err["message"] and "prefix-cache" in err["message"]     # the valid names
    hostile = "random:1,x" + "\t\u00e9" * 3000
    r = await post(gw, chat_body(CHAT), {"routing-strategy": hostile})
    msg = orjson.loads(r.body)["error"]["message"]
    assert r.status == 400 and len(msg) < 1200, len(msg)
    assert msg.isprintable() and msg.isascii(), msg
    assert "random:1,x" in msg and "\u00e9" * 2 not in msg


async def test_a_refused_request_logs_the_model_its_body_named(gw):
    with gw.gw.request_log.capture() as lines:
        assert (await post(gw, chat_body(CHAT), {"x-slo-ttft-ms": "soon"})).status == 400
        assert (await post(gw, chat_body(CHAT, max_tokens=-1))).status == 400
        assert (await post(gw, {"model": "m", "max_tokens": 4, "messages": CHAT}, {"x-slo-tpot-ms": "-1"},
                           path="/v1/messages")).status == 400
        assert (await post(gw, {"model": "m", "input": "hi"}, {"x-slo-ttft-ms": "0"},
                           path="/v1/responses")).status == 400
        assert (await post(gw, {"messages": CHAT})).status == 400          # no model named: none logged
    assert [(x["status"], x["model"]) for x in lines] == [(400, "m")] * 4 + [(400, "-")], lines
