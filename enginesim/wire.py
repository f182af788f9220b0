"""HTTP plumbing shared by both engines: JSON bodies, SSE framing, connection drops.

``SseWriter`` sends headers either at once (vLLM: Starlette starts the response as soon as the
request is admitted) or only with the first event (SGLang awaits its first chunk before it returns
the ``StreamingResponse``), which is the main timing difference a gateway sees between the two.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from enginesim.errors import ApiError

DONE_FRAME = b"data: [DONE]\n\n"
KEEPALIVE_FRAME = b": keep-alive\n\n"


def dumps(obj: Any) -> bytes:
    """``obj`` as compact JSON. A request may nest deeper than orjson writes (254 levels; it reads
    1024): what the engine echoes or renders of it (a Responses request's metadata, a tool's
    schema) is then written by Python's ``json``, as the engines write all they write."""
    try:
        return orjson.dumps(obj)
    except orjson.JSONEncodeError:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=dumps(obj), content_type="application/json",
                        headers=headers)


async def read_json(request: web.Request, *, require_json: bool) -> dict[str, Any]:
    """The request body as a JSON object, or an ``ApiError(400)`` shaped like the engine's."""
    if require_json and request.content_type != "application/json":
        raise ApiError(400, "Unsupported Media Type: Only 'application/json' is allowed",
                       type_="Bad Request")
    raw = await request.read()
    try:
        body = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"JSON decode error: {exc}", type_="Bad Request") from None
    if not isinstance(body, dict):
        raise ApiError(400, "1 validation error:\n  Input should be a valid dictionary or object",
                       type_="Bad Request")
    return body


def sse_frame(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


class SseWriter:
    """One ``text/event-stream`` response."""

    def __init__(self, request: web.Request, *, charset: str | None,
                 headers: dict[str, str] | None = None) -> None:
        self.request = request
        self.response = web.StreamResponse(headers=headers)
        self.response.content_type = "text/event-stream"
        if charset:
            self.response.charset = charset
        self.response.headers["Cache-Control"] = "no-cache"

    @property
    def started(self) -> bool:
        return self.response.prepared

    async def start(self) -> None:
        if not self.response.prepared:
            await self.response.prepare(self.request)

    async def send(self, obj: Any) -> None:
        await self.start()
        await self.response.write(sse_frame(obj))

    async def keepalive(self) -> None:
        await self.start()
        await self.response.write(KEEPALIVE_FRAME)

    async def done(self, before_end: Callable[[], Awaitable[None]] | None = None) -> web.StreamResponse:
        """``[DONE]``, then ``before_end`` (a stream's faults at its end), then the end of the body."""
        await self.start()
        await self.response.write(DONE_FRAME)
        if before_end is not None:
            await before_end()
        await self.response.write_eof()
        return self.response


def drop_connection(request: web.Request) -> None:
    """Abort the TCP connection: no terminating chunk, no ``[DONE]``; the peer sees a reset."""
    transport = request.transport
    if transport is not None:
        transport.abort()
