"""Every answer names its request, and the answers to a bad routing header or objective say what
was wrong: ``request-id`` and ``x-request-id`` on the gateway's own paths (models, health, status,
Files and Batches, and their errors), an OpenAI-shaped 400 for an invalid ``routing-strategy`` whose
echo is bounded and printable, and a request log line that names the model a refused body named."""

from __future__ import annotations

import aiohttp
import pytest

from tests.support.factories import model_block

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
