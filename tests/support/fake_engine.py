"""A fake engine of a few handlers, for what ``enginesim`` does not misbehave at: an aiohttp app on
a free loopback port with ``/health`` answered, and the test's own ``/v1/chat/completions``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web


@contextlib.asynccontextmanager
async def fake_engine(chat: Callable[[web.Request], Awaitable[web.StreamResponse]],
                      paths: tuple[str, ...] = ("/v1/chat/completions",)) -> AsyncIterator[str]:
    """The engine's base URL while the block runs; ``chat`` answers POSTs to ``paths``."""
    async def health(_request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    for path in paths:
        app.router.add_post(path, chat)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
