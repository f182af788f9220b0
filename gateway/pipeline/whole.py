"""Answers written whole: the status line, the headers and the body of a complete answer (an
engine's answer, or an error) in one write to the client's transport, without building aiohttp's
response objects; and the head of an event stream the same way, its chunks framed as aiohttp
frames them.

A non-streaming answer is complete when the handler has it, so there is nothing for aiohttp's
``web.Response`` to do but serialize it: a header multidict, ``prepare`` (keep-alive, length,
``Date``, ``Server``), a header serializer, a payload writer and ``write_eof``, a few dozen µs of
CPU per request under load and more at low load, when every cache is cold. ``write_whole`` writes
the same bytes itself and hands back a ``WrittenAnswer``: what aiohttp's request handler reads of
an answer after the handler returns (``prepare`` and ``write_eof``, which have nothing left to do,
its status and whether the connection stays open).

An event stream's head (``open_stream``) is written the same way, and its ``WrittenStream``
frames each chunk for HTTP/1.1 chunked transfer, waits for a client that stops reading (the
transport's flow control, as aiohttp's ``drain``) and writes the last chunk once. When the stream's
first bytes are already in hand (a P/D decode's, awaited before the head), the head may be held
and go out in the same write as the first chunk: one system call and one wake-up of the client
instead of two, on the way to its first token.

Both decline (return None, and the caller builds a ``web.Response``) where aiohttp's framing rules
would differ or the answer must pass through the application: a request that is not HTTP/1.1, a
status no body may follow, a transport already closing (``open_stream`` raises there, as aiohttp's
``prepare`` does), and any request that is neither aiohttp's own nor the edge's fast lane's (the
batch runner's in-process requests read the response back). A header line with a line break in
it is not sent (aiohttp answers 500 instead; the gateway's header values are made safe before
they get here, so this is a last guard, not a path). Nothing is added to an answer after it is
written here: the tenants' ``x-ratelimit-*`` headers come with the headers the caller passes
(``RequestRecord.response_headers``), and the header lines every answer to a request class
carries (``Vary: Origin`` with CORS on, gateway/server/cors.py) are made once, with the end of the
head, when the class is registered (``writes_for``).
"""

from __future__ import annotations

import asyncio
import contextlib
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE, HttpVersion11

from gateway.errors import EXTRA_REASONS

_SERVER = f"\r\nServer: {SERVER_SOFTWARE}\r\n".encode("ascii")
_END = _SERVER + b"\r\n"       # the end of a head: Server, then the blank line
# each status's line with aiohttp's reason phrase, and the gateway's for Anthropic's 529, made
# once (other codes have none)
_STATUS_LINES = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode())
                 for s in HTTPStatus} | {code: b"HTTP/1.1 %d %s\r\n" % (code, phrase.encode())
                                         for code, phrase in EXTRA_REASONS.items()}
# the statuses an answer is written whole with: 200-599, but those no body may follow (204, 205,
# 304), which aiohttp frames; one lookup in C
_WHOLE_STATUSES = frozenset(range(200, 600)) - {204, 205, 304}
_COPY_BELOW = 16384     # smaller bodies are joined to the head; larger ones go out with writev
_FIELD = "%s: %s"


class WrittenAnswer:
    """An answer ``write_whole`` has sent: what aiohttp's ``RequestHandler`` needs of it once the
    handler returns (``finish_response`` prepares it and writes its end, ``start`` reads
    ``keep_alive``), with nothing left to send."""

    __slots__ = ("status", "keep_alive", "body_length", "_writer")

    prepared = True

    def __init__(self, status: int, keep_alive: bool, body_length: int, writer: Any = None) -> None:
        self.status = status
        self.keep_alive = keep_alive
        self.body_length = body_length
        self._writer = writer           # set when the answer left the client's transport over its limit

    async def prepare(self, request: Any) -> None:
        return None

    async def write_eof(self, data: bytes = b"") -> None:
        writer = self._writer
        if writer is not None:
            # the client is not reading: its connection's next request (pipelined behind this
            # one) waits until it does, as after aiohttp's own write; else a client that sends
            # requests and reads no answer has the gateway run them all and hold their answers
            with contextlib.suppress(ConnectionError):
                await writer.drain()

    @property
    def unsent(self) -> bool:
        """Whether the answer was still in the client's transport, over its limit, once written."""
        return self._writer is not None

    async def went(self) -> bool:
        """Whether the answer left the client's transport before the connection was lost (an
        answer under the transport's limit went at once); awaited off the handler's way, in a task
        of its own."""
        writer = self._writer
        if writer is None:
            return True
        try:
            await writer.drain()
        except ConnectionError:
            return False
        except asyncio.CancelledError:
            # the wait is the handler's too (its ``write_eof``), which the connection's loss
            # cancels, and the wait with it; this task's own cancel (the gateway's stop) goes on
            if asyncio.current_task().cancelling():     # type: ignore[union-attr]
                raise
            return False
        return True         # (a connection closed after its answer is no longer the protocol's: not asked)

    def __repr__(self) -> str:
        return f"<WrittenAnswer {self.status} {self.body_length} bytes>"


class WatchedResponse(web.Response):
    """A whole answer aiohttp writes once the handler has returned (``write_whole`` declined it: an
    HTTP/1.0 client's): ``went`` says how its write ended, so that the request's line and span
    follow it, as a ``WrittenAnswer``'s do. The write fails where the client's connection is lost
    before the head went (``prepare``) or while the body goes out (``write_eof``'s drain)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._went: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    def _told(self, went: bool) -> None:
        if not self._went.done():
            self._went.set_result(went)

    async def prepare(self, request: Any) -> Any:
        try:
            return await super().prepare(request)
        except BaseException:
            self._told(False)
            raise

    async def write_eof(self, data: bytes = b"") -> None:
        went = False
        try:
            await super().write_eof(data)
            went = True
        finally:
            self._told(went)

    async def went(self) -> bool:
        """Whether the answer was written whole before the client's connection was lost; awaited
        off the handler's way, in a task of its own."""
        return await self._went


class _Ends(dict):
    """The request classes whose transport and writer are aiohttp's, or act alike, each with the end
    of its answers' heads; a class not listed gives None (one subscript in ``_head``, no call)."""

    def __missing__(self, key: type) -> None:
        return None


_WRITABLE: _Ends = _Ends({web.Request: _END})


def writes_for(cls: type, lines: bytes = b"") -> None:
    """Let answers to requests of ``cls`` be written whole (the edge's fast lane, gateway/server/lane.py);
    ``lines``: header lines, each ended by CRLF, that every one of them carries (made into the end
    of the head here, once)."""
    _WRITABLE[cls] = _SERVER + lines + b"\r\n"


def _head(request: Any, status: int, headers: dict[str, str], extra: tuple[str, ...]) -> tuple[bytes, bool] | None:
    """The response head and whether the connection stays open; None when aiohttp must frame it."""
    end = _WRITABLE[type(request)]
    if end is None or request.version != HttpVersion11:
        return None
    transport = request.transport
    if transport is None or transport.is_closing() or status not in _WHOLE_STATUSES:
        return None
    # formatted in C, no Python frame per header
    lines = [*map(_FIELD.__mod__, headers.items()), *extra, f"Date: {rfc822_formatted_time()}"]
    keep_alive = request.keep_alive
    if not keep_alive and "Connection" not in headers:     # (the 503 of a stop says it already)
        lines.append("Connection: close")
    text = "\r\n".join(lines)
    breaks = len(lines) - 1
    if text.count("\n") != breaks or text.count("\r") != breaks:    # a line break inside a value: not sent
        text = "\r\n".join(line for line in lines if "\r" not in line and "\n" not in line)
    status_line = _STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status
    return b"".join((status_line, text.encode("utf-8"), end)), keep_alive


def write_whole(request: Any, status: int, headers: dict[str, str], content_type: str,
                body: bytes) -> WrittenAnswer | None:
    """Send ``status``, ``headers`` (plus Content-Type, Content-Length, Date, Server and, when the
    client asked to close, ``Connection: close``) and ``body`` to the client in one write.

    Returns None, having written nothing, when the answer must go through ``web.Response``."""
    n = len(body)
    made = _head(request, status, headers, (f"Content-Type: {content_type}", f"Content-Length: {n}"))
    if made is None:
        return None
    head, keep_alive = made
    transport = request.transport
    if n < _COPY_BELOW:
        transport.write(head + body)
    else:
        transport.writelines((head, body))
    writer = request.writer
    writer.output_size += len(head) + n     # the edge reads it: something went out
    return WrittenAnswer(status, keep_alive, n, writer if request.protocol.writing_paused else None)


class WrittenStream(WrittenAnswer):
    """An event stream whose head ``open_stream`` sent: its chunks, then its end, written by the
    relay. ``headers`` are those the head carried."""

    __slots__ = ("headers", "_transport", "_writer", "_protocol", "_ended", "_held")

    def __init__(self, request: web.Request, headers: dict[str, str], keep_alive: bool) -> None:
        super().__init__(200, keep_alive, 0)
        self.headers = headers
        self._transport = request.transport
        self._writer = request.writer
        self._protocol = request.protocol
        self._ended = False
        self._held: bytes | None = None    # the head, until the first write (``open_stream``'s ``hold``)

    def _send(self, data: bytes) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        if self._held is not None:
            data = self._held + data
            self._held = None
        transport.write(data)
        self._writer.output_size += len(data)

    @property
    def holding(self) -> bool:
        """The head waits for the first write (``open_stream``'s ``hold``)."""
        return self._held is not None

    def send_head(self) -> None:
        """Send a held head now, alone (nothing to write with it); nothing when none is held."""
        if self._held is not None:
            self._send(b"")

    def send(self, data: bytes) -> None:
        """Write ``data`` as one chunk now, after a held head in the same write (the relay's read
        callback: no wait here for a client that stopped reading, its caller watches for that)."""
        self.body_length += len(data)
        self._send(b"%x\r\n%b\r\n" % (len(data), data))

    def renew_head(self, request: Any, content_type: str) -> None:
        """Make a held head again (its ``Date`` now), for a first write long after it was made."""
        if self._held is not None:
            headers = {k: v for k, v in self.headers.items() if k != "Transfer-Encoding"}
            made = stream_head(request, headers, content_type)
            if made is not None:
                self._held = made[0]

    async def write(self, data: bytes) -> None:
        if self._ended:
            raise RuntimeError("Cannot call write() after write_eof()")
        if data:
            self.send(data)
            if self._protocol.writing_paused:     # the client stopped reading: wait as aiohttp's drain does
                await self._writer.drain()

    async def write_eof(self, data: bytes = b"") -> None:
        if self._ended:
            return
        if data:
            await self.write(data)
        self._ended = True
        self._send(b"0\r\n\r\n")
        if self._protocol.writing_paused:
            await self._writer.drain()

    def __repr__(self) -> str:
        return f"<WrittenStream {self.body_length} bytes{' ended' if self._ended else ''}>"


def stream_head(request: Any, headers: dict[str, str], content_type: str) -> tuple[bytes, bool] | None:
    """The head ``open_stream`` sends, and whether the connection stays open; None when the stream
    must go through ``web.StreamResponse``. Made ahead of ``open_stream`` while an answer's first
    bytes are awaited (a P/D decode's KV transfer), it takes that much off the first token's way."""
    return _head(request, 200, headers, (f"Content-Type: {content_type}", "Transfer-Encoding: chunked"))


def open_stream(request: Any, headers: dict[str, str], content_type: str, hold: bool = False,
                made: tuple[bytes, bool] | None = None) -> WrittenStream | None:
    """Send the head of a 200 answer streamed in chunks (``headers`` plus Content-Type,
    Transfer-Encoding, Date, Server and, when the client asked to close, ``Connection: close``).
    ``hold``: the head goes out with the first write instead (its caller writes, or calls
    ``send_head``, before it waits for anything). ``made``: ``stream_head``'s for these headers.

    Returns None, having written nothing, when the stream must go through ``web.StreamResponse``."""
    if made is None:
        made = stream_head(request, headers, content_type)
    if made is None:
        if type(request) in _WRITABLE and request.transport is not None and request.transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")     # as aiohttp's prepare
        return None
    head, keep_alive = made
    out = WrittenStream(request, headers, keep_alive)
    if hold:
        out._held = head
    else:
        out._send(head)
    headers["Transfer-Encoding"] = "chunked"
    return out
