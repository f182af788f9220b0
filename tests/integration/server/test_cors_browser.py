"""CORS in a real headless Chromium (tests/support/cdp.py): a page served from one loopback origin
calls the gateway, at another origin (another port), with ``fetch()``, an API key and a JSON body,
as a chat playground served elsewhere would. With the page's origin in
``server.cors_allowed_origins`` the page gets the answer (the preflight its Authorization header
causes passes without the key); with another origin listed, the browser refuses it the answer.
Either way the browser's preflight has its request log line, which says what became of it."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from tests.support.cdp import launch_for_test
from tests.support.factories import model_block
from tests.support.tenancy import ALICE
from tests.support.waiting import wait_for

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>playground</title><link rel="icon" href="data:,"></head>
<body>
<script>
// what a chat playground does: one chat completion, whole or streamed, with the user's API key
async function ask(base, key, stream) {
  try {
    const r = await fetch(base + "/v1/chat/completions", {
      method: "POST",
      headers: {"Authorization": "Bearer " + key, "Content-Type": "application/json"},
      body: JSON.stringify({model: "m", max_tokens: 4, stream: stream,
                            messages: [{role: "user", content: "Hello from the playground"}]}),
    });
    const text = await r.text();
    return {status: r.status, requestId: r.headers.get("x-request-id"),
            targetPod: r.headers.get("target-pod"), text: text};
  } catch (e) {
    return {failed: e.name + ": " + e.message};
  }
}
// what any page may do without a preflight: a plain GET, its answer read if CORS allows it
async function read(url) {
  try {
    const r = await fetch(url);
    return {status: r.status, text: await r.text()};
  } catch (e) {
    return {failed: e.name + ": " + e.message};
  }
}
</script>
</body></html>"""


@pytest.fixture(scope="module")
def browser():
    b = launch_for_test()
    yield b
    b.close()


@pytest.fixture
async def page(browser):
    p = await browser.new_page()
    yield p
    await p.close()


@contextlib.asynccontextmanager
async def playground() -> AsyncIterator[str]:
    """The page, served on a loopback port of its own: its origin."""
    async def index(_request: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/html")

    app = web.Application()
    app.router.add_get("/", index)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


async def _gateway(sims, gateway, origins: list[str]):
    sim = await sims("vllm", "m")
    return await gateway([model_block("m", "vllm", [sim.url])], server={"cors_allowed_origins": origins},
                         auth={"api_keys": [{"key": ALICE, "user": "alice"}]})


async def _ask(page, gw, stream: bool) -> dict:
    return await page.evaluate(f"ask({json.dumps(gw.url)}, {json.dumps(ALICE)}, {json.dumps(stream)})")


def _preflights(lines: list[dict]) -> list[dict]:
    return [line for line in lines if line.get("method") == "OPTIONS"]


async def test_a_page_on_a_listed_origin_gets_the_answer(sims, gateway, page):
    async with playground() as origin:
        gw = await _gateway(sims, gateway, [origin])
        await page.navigate(origin + "/")
        with gw.gw.request_log.capture() as lines:
            got = await _ask(page, gw, stream=False)
            assert got.get("status") == 200, got
            assert await wait_for(lambda: len(lines) >= 2, timeout=10.0, interval=0.01), lines
        # the browser's preflight (its Authorization header needs one), then the call it allowed
        preflight, call = lines[0], lines[-1]
        assert (preflight["method"], preflight["path"], preflight["status"], preflight["cors"]) == (
            "OPTIONS", "/v1/chat/completions", 204, "preflight_allowed"), lines
        assert preflight["user"] is None and preflight["error"] is None
        assert (call["status"], call["cors"], call["user"], call["request_id"]) == (200, "allowed", "alice",
                                                                                  got["requestId"])
        assert json.loads(got["text"])["choices"][0]["message"]["content"]
        # the gateway's own headers are readable by the page
        assert got["requestId"] and got["targetPod"] == gw.gw.pool.endpoints("m")[0].name
        got = await _ask(page, gw, stream=True)
        assert got.get("status") == 200, got
        assert got["text"].rstrip().endswith("data: [DONE]") and got["requestId"]
        assert page.problems == [], "\n".join(page.problems)


async def test_a_page_on_another_origin_is_refused_the_answer(sims, gateway, page):
    async with playground() as origin:
        gw = await _gateway(sims, gateway, ["http://127.0.0.1:1"])
        await page.navigate(origin + "/")
        with gw.gw.request_log.capture() as lines:
            got = await _ask(page, gw, stream=False)
            assert got == {"failed": "TypeError: Failed to fetch"}, got
            # the browser says why: the preflight carried no Access-Control-Allow-Origin
            assert any("CORS policy" in p for p in page.problems), page.problems
            # and so does the gateway's log: the refused preflight is the only request the page made
            assert await wait_for(lambda: lines, timeout=10.0, interval=0.01)
        assert [(x["method"], x["path"], x["status"], x["cors"], x["error_class"]) for x in lines] == [
            ("OPTIONS", "/v1/chat/completions", 403, "preflight_refused", "client")], lines
        assert origin in lines[0]["error"] and "server.cors_allowed_origins" in lines[0]["error"]


async def test_a_page_is_refused_the_answer_with_cors_off(sims, gateway, page):
    async with playground() as origin:
        sim = await sims("vllm", "m")
        gw = await gateway([model_block("m", "vllm", [sim.url])])
        await page.navigate(origin + "/")
        got = await _ask(page, gw, stream=False)
        assert got == {"failed": "TypeError: Failed to fetch"}, got


async def test_a_page_on_a_listed_origin_reads_the_api_and_not_the_gateways_own_pages(sims, gateway, page):
    """CORS lets pages call the API; /status.json (open without auth: internal addresses, users,
    request ids), /metrics (open with auth too), /status, /health and /ready are not the API, and a
    preflight to them is refused. A plain GET needs no preflight: its answer must not carry
    Access-Control-Allow-Origin either, or the page reads what the browser would otherwise keep
    from it."""
    async with playground() as origin:
        sim = await sims("vllm", "m")
        gw = await gateway([model_block("m", "vllm", [sim.url])], server={"cors_allowed_origins": [origin]})
        await page.navigate(origin + "/")
        got = await page.evaluate(f"read({json.dumps(gw.url + '/v1/models')})")
        assert got.get("status") == 200 and json.loads(got["text"])["data"][0]["id"] == "m", got
        for path in ("/status.json", "/metrics", "/status", "/health", "/ready"):
            got = await page.evaluate(f"read({json.dumps(gw.url + path)})")
            assert got == {"failed": "TypeError: Failed to fetch"}, (path, got)
