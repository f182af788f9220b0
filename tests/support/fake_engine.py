"""A fake engine of a few handlers, for what ``enginesim`` does not misbehave at: an aiohttp app on
a free loopback port with ``/health`` answered, and the test's own ``/v1/chat/completions``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web


@contextlib.asynccontextmanager
async def fake_engine(chat: Callable[[web.Request], Awaitable[web.StreamResponse]],
                      paths: tuple[str, ...] = ("/v1/chat/completions",), metrics: str | None = None,
                      routes: tuple[web.RouteDef, ...] = ()) -> AsyncIterator[str]:
    """The engine's base URL while the block runs; ``chat`` answers POSTs to ``paths``; ``metrics``:
    the text of its ``/metrics`` (None: it has none); ``routes``: more of its own."""
    async def health(_request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    for path in paths:
        app.router.add_post(path, chat)
    app.router.add_get("/health", health)
    app.router.add_routes(routes)
    if metrics is not None:
        async def exposition(_request: web.Request) -> web.Response:
            return web.Response(text=metrics)
        app.router.add_get("/metrics", exposition)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def cutting_stream(events: Callable[[], list[bytes]]) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An engine handler that streams ``events()``; a request with ``x-cut: N`` gets half of
    event N, then its connection broken (a stream the engine breaks in the middle of an event)."""
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        cut = int(request.headers.get("x-cut", "-1"))
        for i, event in enumerate(events()):
            if i == cut:
                await resp.write(event[:len(event) // 2])
                await asyncio.sleep(0.05)
                assert request.transport is not None
                request.transport.abort()
                return resp
            await resp.write(event)
        await resp.write_eof()
        return resp

    return handler
