"""The fast lane: a plain inference request taken off the connection without aiohttp's request path.

Most requests a gateway sees are alike: an HTTP/1.1 ``POST`` of a JSON body with a
``Content-Length`` (chat, completions, embeddings, Messages, Responses, the JSON pass-through
paths) on a kept-alive connection that has nothing else in flight. For those, aiohttp's path to
the handler (its parser's message and header objects, a
``URL``, a ``StreamReader``, a ``StreamWriter``, ``web.Request``, its per-connection task's turn,
and ``finish_response`` after it) is most of what the gateway spends before its own work, and
more at low load, when every cache is cold. ``EdgeProtocol`` offers such a read to ``take``: it
parses it with httptools (the parser uvicorn uses, in C), and when every condition below holds it
builds a ``LaneRequest`` (what the pipeline reads of a request) and runs the inference path's
handler in a task of its own, whose answer the pipeline writes whole (gateway/pipeline/whole.py).
A read that holds the whole head and only part of the body (clients that write them apart, as the
openai SDK's httpx does: at low load the gateway reads them apart) is held until the body is in
(``Pending``; bodies up to ``HOLD_BODY``), with the body's clocks running as for aiohttp's request.

Anything else goes to aiohttp exactly as before, parsed from the same bytes: another method or
path, a query string, HTTP/1.0, a body that is chunked, compressed, larger than ``HOLD_BODY``
while it comes after its head, or followed by more bytes, ``Expect``, ``Upgrade``, a head near the edge's header limits, a body over
``server.max_body_bytes``, a connection with a request of aiohttp's in flight, or any byte the
parser refuses. aiohttp's answers to those (431, 413, 400 in OpenAI shape, 100 Continue) are
therefore unchanged; the lane only ever takes what aiohttp would have handed to the same handler.

While a lane request runs, bytes of a next request are held (and reading paused past 64 KiB) and
given to the connection once the answer is out, so answers keep the order of their requests.
A client that disconnects cancels the lane's task as it cancels aiohttp's handler.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httptools
from aiohttp.http import HttpVersion11
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.pipeline import whole
from gateway.request import WholeBody

HOLD_BYTES = 65536      # bytes of a next request held while one runs, before reading pauses
HOLD_BODY = 1 << 20     # the largest body the lane waits for when it comes after its head

# headers that make a request aiohttp's to handle (framing, encodings, protocol switches)
_DECLINE = frozenset((b"transfer-encoding", b"content-encoding", b"expect", b"upgrade", b"http2-settings"))


class LaneWriter:
    """What the gateway reads of aiohttp's ``StreamWriter``: bytes written, and a wait for a
    client that stopped reading (the protocol's flow control)."""

    __slots__ = ("output_size", "_protocol")

    def __init__(self, protocol: Any) -> None:
        self.output_size = 0
        self._protocol = protocol

    async def drain(self) -> None:
        protocol = self._protocol
        if protocol.transport is not None and protocol._paused:
            await protocol._drain_helper()


class LaneRequest(dict):
    """What the inference path reads of an ``aiohttp.web.Request``; the mapping holds request keys."""

    method = "POST"
    version = HttpVersion11
    query: dict[str, str] = {}
    match_info: dict[str, str] = {}

    def __init__(self, path: str, headers: CIMultiDictProxy[str], body: bytes, keep_alive: bool,
                 protocol: Any) -> None:
        super().__init__()
        self.path = path
        self.headers = headers
        self.content = WholeBody(body)
        self.content_length = len(body)
        self.keep_alive = keep_alive
        self.protocol = protocol
        self.transport = protocol.transport
        self.writer = LaneWriter(protocol)
        self.task: asyncio.Task | None = None

    @property
    def body_exists(self) -> bool:
        return self.content_length > 0

    @property
    def remote(self) -> str | None:
        transport = self.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        if isinstance(peer, (list, tuple)):
            return str(peer[0])
        return None if peer is None else str(peer)

    async def read(self) -> bytes:
        return self.content.read_nowait()

    def __hash__(self) -> int:          # keyed by identity, as aiohttp's requests are
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


whole.writes_for(LaneRequest)


class _Parse:
    """httptools' callbacks: the one message of a read, or why the lane declines it."""

    __slots__ = ("parser", "url", "names", "values", "body", "complete", "messages", "keep_alive")

    def __init__(self) -> None:
        self.url = b""
        self.names: list[bytes] = []
        self.values: list[bytes] = []
        self.body: list[bytes] = []
        self.complete = False
        self.messages = 0
        self.keep_alive = False
        self.parser: Any = None

    def on_message_begin(self) -> None:
        self.messages += 1

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.names.append(name)
        self.values.append(value)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()     # llhttp resets it once the message is over


def _head(data: bytes, paths: dict[bytes, str], max_head: int,
          max_headers: int) -> tuple[_Parse, str, int, list[bytes]] | None:
    """httptools' reading of ``data`` when it holds one whole head the lane may take (its body
    complete or not): the callbacks' record, the path, where the head ends, the lowered names."""
    if not data.startswith(b"POST /"):
        return None
    end = data.find(b"\r\n\r\n")
    if end < 0 or end + 4 > max_head:
        return None
    cb = _Parse()
    p = cb.parser = httptools.HttpRequestParser(cb)
    try:
        p.feed_data(data)
    except httptools.HttpParserError:
        return None
    if cb.messages != 1 or p.get_http_version() != "1.1" or p.should_upgrade():
        return None
    path = paths.get(cb.url)
    names = cb.names
    if path is None or len(names) > max_headers:
        return None
    lowered = [n.lower() for n in names]
    if not _DECLINE.isdisjoint(lowered) or lowered.count(b"content-length") != 1:
        return None
    return cb, path, end, lowered


class Pending:
    """A lane request whose whole head came and whose body is still coming (a client that writes
    the head and the body apart, as httpx does): its parser, fed as the rest comes, and every byte
    so far, for aiohttp when the lane lets it go."""

    __slots__ = ("cb", "path", "end", "need", "rid", "data")

    def __init__(self, cb: _Parse, path: str, end: int, need: int, rid: str | None, data: bytes) -> None:
        self.cb, self.path, self.end, self.need, self.rid = cb, path, end, need, rid
        self.data = bytearray(data)

    def more(self, data: bytes, max_body: float) -> Parsed | Pending | None:
        """``data`` added: itself while the body is still short, the request once it is whole, None
        when the lane lets it go (more bytes than its length: a next request behind it)."""
        self.data += data
        if len(self.data) > self.need:
            return None
        try:
            self.cb.parser.feed_data(data)
        except httptools.HttpParserError:
            return None
        if len(self.data) < self.need:
            return self
        return _whole(self.cb, self.path, self.end, self.need, max_body)


Parsed = tuple[str, CIMultiDictProxy[str], bytes, bool]


def parse(data: bytes, paths: dict[bytes, str], max_head: int, max_headers: int,
          max_body: float) -> Parsed | Pending | None:
    """(path, headers, body, keep-alive) of ``data`` when it is exactly one plain request to one of
    ``paths`` that the lane may take; a ``Pending`` when it is the whole head of one and part of its
    body (bodies up to ``HOLD_BODY``; larger ones are aiohttp's, which reads them as they come);
    None otherwise (aiohttp then parses the same bytes)."""
    got = _head(data, paths, max_head, max_headers)
    if got is None:
        return None
    cb, path, end, lowered = got
    if cb.complete:
        return _whole(cb, path, end, len(data), max_body)
    length = cb.values[lowered.index(b"content-length")]
    if not length.isdigit():
        return None
    n = int(length)
    if n > max_body or n > HOLD_BODY or len(data) >= end + 4 + n:
        return None
    rid = cb.values[lowered.index(b"x-request-id")] if b"x-request-id" in lowered else None
    return Pending(cb, path, end, end + 4 + n, None if rid is None else rid.decode("utf-8", "surrogateescape"), data)


def _whole(cb: _Parse, path: str, end: int, size: int, max_body: float) -> Parsed | None:
    """The request ``cb`` read, when it is one complete message of ``size`` bytes."""
    if not cb.complete or cb.messages != 1:
        return None
    body = cb.body[0] if len(cb.body) == 1 else b"".join(cb.body)
    if len(body) > max_body or end + 4 + len(body) != size:
        return None
    headers = CIMultiDict()
    for name, value in zip(cb.names, cb.values, strict=True):
        headers.add(name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))
    return path, CIMultiDictProxy(headers), body, cb.keep_alive
