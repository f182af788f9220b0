"""Relay an engine's answer to the client, measuring as the bytes pass.

Streams: each upstream chunk is written to the client as it arrives (no re-encoding); the SSE
scanner sees first token, inter-token gaps, usage, finish and in-stream errors. When the upstream
breaks after headers went out, the client gets a final ``data: {"error": ...}`` event and the
stream ends: never a silent truncation, never a replay.

The watchdog (when enabled for the leg) bounds the wait for the first chunk, the idle time between
chunks, and a non-streaming answer; on fire the upstream connection is closed (the engine aborts)
and the phase is counted.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from gateway.errors import GatewayError, error_body
from gateway.h1client import UpstreamError, UpstreamResponse, UpstreamTimeout
from gateway.sse import SSEScanner

if TYPE_CHECKING:
    from gateway.config import WatchdogConfig
    from gateway.pipeline import Gateway, RequestRecord

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_event(status: int, message: str, code: str | int | None = None, type_: str | None = None) -> bytes:
    return b"data: " + orjson.dumps(error_body(status, message, code=code, type_=type_)) + b"\n\n"


class WatchdogFired(Exception):
    def __init__(self, phase: str, seconds: float) -> None:
        super().__init__(phase)
        self.phase = phase
        self.seconds = seconds


async def relay_stream(gw: Gateway, request: web.Request, resp: UpstreamResponse, rec: RequestRecord,
                       headers: dict[str, str], strip_usage: bool, wd: WatchdogConfig | None) -> web.StreamResponse:
    clock = time.perf_counter   # not loop.time(): uvloop's clock is cached per iteration, at 1 ms
    scanner = SSEScanner(strip_usage=strip_usage)
    out = web.StreamResponse(status=200, headers={**headers, **SSE_HEADERS})
    out.content_type = "text/event-stream"
    out.charset = "utf-8"
    await out.prepare(request)
    rec.extra["headers_sent"] = True
    rec.status = 200
    readany = resp.readany
    write = out.write
    feed = scanner.feed
    first_to = wd.first_chunk_timeout_s if wd is not None else 0.0
    idle_to = wd.idle_timeout_s if wd is not None else 0.0
    failure: bytes | None = None
    try:
        if first_to or idle_to:
            phase, limit = ("first_chunk", first_to) if first_to else ("idle", idle_to)
            while True:
                try:
                    async with asyncio.timeout(limit or None):
                        chunk = await readany()
                except TimeoutError:
                    raise WatchdogFired(phase, limit) from None
                if not chunk:
                    break
                phase, limit = "idle", idle_to
                data = feed(chunk, clock())
                if data:
                    await write(data)
        else:
            while chunk := await readany():
                data = feed(chunk, clock())
                if data:
                    await write(data)
        tail = scanner.finish()
        if tail:
            await write(tail)
        if not scanner.done and scanner.error is None:
            rec.error_class = "upstream_eof"
            rec.error = "the engine closed the stream before it completed"
            failure = error_event(502, rec.error, code="upstream_incomplete")
    except WatchdogFired as w:
        rec.error_class = f"watchdog_{w.phase}"
        rec.error = f"no output from the engine for {w.seconds:g}s ({w.phase.replace('_', ' ')})"
        gw.metrics.child(gw.metrics.upstream_errors, rec.model, rec.endpoint, rec.error_class).inc()
        failure = error_event(504, rec.error, code="upstream_timeout")
    except UpstreamTimeout as e:
        # upstream.total_timeout_s: the whole exchange took too long
        rec.error_class = "upstream_timeout"
        rec.error = f"the engine did not finish the stream: {e}"
        gw.metrics.child(gw.metrics.upstream_errors, rec.model, rec.endpoint, rec.error_class).inc()
        failure = error_event(504, rec.error, code="upstream_timeout")
    except UpstreamError as e:
        # the engine's side broke mid-stream (a client-side write failure raises ConnectionResetError,
        # handled below as a cancel)
        rec.error_class = "upstream_broken"
        rec.error = f"the engine connection broke mid-stream: {type(e).__name__}: {e}"
        gw.metrics.child(gw.metrics.upstream_errors, rec.model, rec.endpoint, "broken_stream").inc()
        failure = error_event(502, rec.error, code="upstream_incomplete")
    except ConnectionResetError:
        # the client went away while we wrote: same as a disconnect
        rec.error_class = "client_cancel"
        raise asyncio.CancelledError from None
    _finish_stream_record(gw, rec, scanner)
    if failure is not None:
        try:
            await write(failure)
        except ConnectionResetError:
            raise asyncio.CancelledError from None
    elif scanner.error is not None:
        rec.error_class = "upstream_stream_error"
        msg = scanner.error.get("message") if isinstance(scanner.error, dict) else None
        rec.error = str(msg)[:200] if msg else "in-stream error"
    try:
        await out.write_eof()
    except ConnectionResetError:
        raise asyncio.CancelledError from None
    return out


def _finish_stream_record(gw: Gateway, rec: RequestRecord, scanner: SSEScanner) -> None:
    m = gw.metrics
    if scanner.first_token_at is not None:
        rec.ttft = scanner.first_token_at - rec.started
        m.child(m.ttft, rec.model).observe(rec.ttft)
        gaps = scanner.drain_itl()
        if gaps:
            h = m.child(m.itl, rec.model)
            for g in gaps:
                h.observe(g)
    rec.finish_reason = scanner.finish_reason
    gw.account_usage(rec, scanner.usage)


async def relay_body(gw: Gateway, request: web.Request, resp: UpstreamResponse, rec: RequestRecord,
                     headers: dict[str, str], ctype: str, wd: WatchdogConfig | None) -> web.StreamResponse:
    limit = wd.response_timeout_s if wd is not None else 0.0
    try:
        if limit:
            async with asyncio.timeout(limit):
                body = await resp.read()
        else:
            body = await resp.read()
    except (TimeoutError, UpstreamTimeout) as e:
        rec.error_class = "watchdog_response" if isinstance(e, TimeoutError) else "upstream_timeout"
        gw.metrics.child(gw.metrics.upstream_errors, rec.model, rec.endpoint, rec.error_class).inc()
        secs = limit if isinstance(e, TimeoutError) else e.seconds
        raise GatewayError(504, f"the engine did not answer within {secs:g}s", code="upstream_timeout",
                           header=("x-error-upstream", "timeout"), error_class=rec.error_class) from None
    except UpstreamError as e:
        rec.error_class = "upstream_broken"
        gw.metrics.child(gw.metrics.upstream_errors, rec.model, rec.endpoint, "broken_body").inc()
        raise GatewayError(502, f"the engine connection broke before the answer was complete: {type(e).__name__}",
                           code="upstream_incomplete", header=("x-error-upstream", "reset"),
                           error_class=rec.error_class) from None
    rec.status = 200
    if b'"usage"' in body:
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            data = None
        if isinstance(data, dict):
            usage = data.get("usage") if isinstance(data.get("usage"), dict) else None
            if usage is None and isinstance(data.get("meta_info"), dict):
                mi = data["meta_info"]
                usage = {"prompt_tokens": mi.get("prompt_tokens"), "completion_tokens": mi.get("completion_tokens"),
                         "prompt_tokens_details": {"cached_tokens": mi.get("cached_tokens")}}
            gw.account_usage(rec, usage)
            choices = data.get("choices")
            if isinstance(choices, list) and choices and isinstance(choices[0], dict):
                rec.finish_reason = choices[0].get("finish_reason")
    r = web.Response(status=200, body=body, headers=headers)
    r.headers["Content-Type"] = ctype
    return r
