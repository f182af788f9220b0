"""The fast lane: a plain inference request taken off the connection without aiohttp's request path.

Most requests a gateway sees are alike: an HTTP/1.1 ``POST`` of a JSON body with a
``Content-Length`` (chat, completions, embeddings, Messages, Responses, the JSON pass-through
paths) on a kept-alive connection that has nothing else in flight. For those, aiohttp's path to
the handler (its parser's message and header objects, a
``URL``, a ``StreamReader``, a ``StreamWriter``, ``web.Request``, its per-connection task's turn,
and ``finish_response`` after it) is most of what the gateway spends before its own work, and
more at low load, when every cache is cold. ``EdgeProtocol`` offers such a read to ``parse``: it
reads the head with two regular expressions over its text (below), and when every condition below
holds it builds a ``LaneRequest`` (what the pipeline reads of a request) and runs the inference path's
handler in a task of its own, whose answer the pipeline writes whole (gateway/pipeline/whole.py).
A read that holds the whole head and only part of the body (clients that write them apart, as the
openai SDK's httpx does: at low load the gateway reads them apart) is held until the body is in
(``Pending``; bodies up to ``HOLD_BODY``), with the body's clocks running as for aiohttp's request.

Anything else goes to aiohttp exactly as before, parsed from the same bytes: another method or
path, a query string, HTTP/1.0, a body that is chunked, compressed, larger than ``HOLD_BODY``
while it comes after its head, or followed by more than ``HOLD_BYTES``, ``Expect``, ``Upgrade``,
with CORS on an ``Origin`` (gateway/server/cors.py; a request without one is a ``CorsLaneRequest``,
whose answers carry ``Vary: Origin``), a head without exactly one ``Host`` (aiohttp's
400), or whose ``Host`` is no host[:port] (the edge's 400), a head with two of another field the
parser takes once (``Content-Type``, ``User-Agent``, ...: aiohttp's 400), a head near the edge's header limits, a body over ``server.max_body_bytes``, a connection
with a request of aiohttp's in flight, or a head that is
not plain lines of a token, a colon and a value (a control byte, a bare CR or LF, a folded line,
a value ending in a space or a tab).
aiohttp's answers to those (431, 413, 400 in OpenAI shape, 100 Continue) are therefore
unchanged; the lane only ever takes what aiohttp would have handed to the same handler (a
property test holds it to that: tests/unit/gateway/server/test_lane.py).

While a lane request runs, bytes of a next request are held (and reading paused past 64 KiB) and
given to the connection once the answer is out, so answers keep the order of their requests. A
read that holds a whole request and bytes after it (pipelined requests, or a request and junk)
is one of those: the first runs on the lane, the rest is held (``Split``). aiohttp's parser, given
such a read, drops the requests it parsed when a later part fails, so a request followed by junk
would get no answer; this way it gets its answer, and the junk its 400.
A client that disconnects cancels the lane's task as it cancels aiohttp's handler; one that leaves
while its request is held for the body has the request's handler run on a body whose read is its
cancel (``LeftBody``), so its line and counts are those of a client leaving on aiohttp's path.
A held request is in flight for a graceful stop (gateway/server/lifecycle.py), which waits for its
body; when the stop's grace period ends, its handler runs on such a body whose read is the cut
(``EdgeProtocol.lane_cut``) and answers the 503 of a gateway shutting down, as aiohttp's request
reading its body does.
"""

from __future__ import annotations

import asyncio
import re
from operator import itemgetter
from typing import Any

from aiohttp.http import HttpVersion11
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.pipeline import whole
from gateway.request import WholeBody, given_request_id

HOLD_BYTES = 65536      # bytes of a next request held while one runs, before reading pauses
HOLD_BODY = 1 << 20     # the largest body the lane waits for when it comes after its head

# the fields aiohttp's parser refuses twice in a request (RFC 9110's of one value), with a 400; the
# lane leaves a head with two of one to it (Content-Length and Host are counted on their own)
_SINGLETONS = ("content-type", "user-agent", "content-location", "content-range", "etag", "max-forwards", "server")
# headers that make a request aiohttp's to handle (framing, encodings, protocol switches)
_DECLINE = frozenset(("transfer-encoding", "content-encoding", "expect", "upgrade", "http2-settings"))
# and with CORS on, a request from a web page, whose answer gets CORS's headers there (gateway/server/cors.py)
CORS_DECLINE = _DECLINE | {"origin"}


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

    __slots__ = ("path", "headers", "content", "content_length", "keep_alive", "protocol", "transport", "writer",
                 "task", "head_read")

    method = "POST"
    version = HttpVersion11
    query: dict[str, str] = {}
    match_info: dict[str, str] = {}

    def __init__(self, path: str, headers: CIMultiDictProxy[str], body: bytes, keep_alive: bool,
                 protocol: Any, head_read: float | None = None) -> None:
        self.path = path                    # the mapping starts empty (dict.__new__): no dict.__init__ to run
        self.headers = headers
        self.content = WholeBody(body)
        self.content_length = len(body)
        self.keep_alive = keep_alive
        self.protocol = protocol
        self.transport = protocol.transport
        self.writer = LaneWriter(protocol)
        self.task: asyncio.Task | None = None
        # when its head came whole (``time.perf_counter``), for a request the lane held until its body
        # was in (``Pending``): its request log line counts from there; None: from its handler's start,
        # which is the moment its head came (one read held it whole)
        self.head_read = head_read

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
        return self.content.read_nowait()       # (``LeftBody``: raises the client's cancel)

    def __hash__(self) -> int:          # keyed by identity, as aiohttp's requests are
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


whole.writes_for(LaneRequest)


class CorsLaneRequest(LaneRequest):
    """A lane request while CORS is on, which has no ``Origin`` (``CORS_DECLINE``): its answers say
    ``Vary: Origin``, so a shared cache does not hand one to a browser; the line is part of the
    head's end, made once (``whole.writes_for``)."""

    __slots__ = ()


whole.writes_for(CorsLaneRequest, b"Vary: Origin\r\n")


# A head the lane may take, read by two regular expressions (C) over its decoded text rather than
# a parser calling back into Python once per header: at low load, when every cache is cold, those
# callbacks were most of the lane's cost. The header block must be lines of a token, a colon and
# a value of visible characters, spaces and tabs (and bytes above ASCII, which aiohttp accepts
# too), each ended by CRLF; a control byte, a bare CR or LF, a space before the colon or a folded
# line fails it, and aiohttp, which parses the same bytes, answers it. So does a value that ends in
# a space or a tab (no client sends one): then a field's value is all that follows the colon and
# its spaces, which a greedy match finds without trying every byte for the end of the value.
_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_BLOCK = re.compile(r"(?:" + _TOKEN + r":[^\x00-\x08\x0a-\x1f\x7f]*(?<![ \t])\r\n)*")
_NAME = itemgetter(0)
_FIELD = re.compile(r"(" + _TOKEN + r"):[ \t]*([^\r\n]*)\r\n")
# a Host field's value (RFC 9112 §3.2: uri-host [ ":" port ], RFC 3986 §3.2.2): an IP literal in
# brackets (an IPv6 address's zone after %25, RFC 6874), or a reg-name (an IPv4 address is one), not
# empty, then a port of digits. Any other value (empty, a space, userinfo, a path) is a 400
# (gateway/server/edge.py ``host_refused``), which the lane leaves to aiohttp's path
HOST = re.compile(r"(?:\[(?:[0-9A-Fa-f:.]+(?:%25(?:[A-Za-z0-9\-._~]|%[0-9A-Fa-f]{2})+)?"
                  r"|[vV][0-9A-Fa-f]+\.[A-Za-z0-9\-._~!$&'()*+,;=:]+)\]"
                  r"|(?:[A-Za-z0-9\-._~!$&'()*+,;=]|%[0-9A-Fa-f]{2})+)(?::[0-9]*)?")


def _keep_alive(fields: list[tuple[str, str]], lowered: list[str]) -> bool:
    """HTTP/1.1 keeps the connection open unless a ``Connection`` header lists ``close``."""
    if "connection" not in lowered:
        return True
    if "close" not in fields[lowered.index("connection")][1].lower() and lowered.count("connection") == 1:
        return True                     # the usual one: keep-alive (one C call each, no generator)
    return not any(name == "connection" and "close" in (t.strip() for t in value.lower().split(","))
                   for name, (_, value) in zip(lowered, fields, strict=True))


class Pending:
    """A lane request whose whole head came and whose body is still coming (a client that writes
    the head and the body apart, as httpx does): its head, read once, and every byte so far, for
    aiohttp when the lane lets it go."""

    __slots__ = ("path", "headers", "keep_alive", "start", "need", "rid", "data", "head_read")

    def __init__(self, path: str, headers: CIMultiDictProxy[str], keep_alive: bool, start: int, need: int,
                 data: bytes) -> None:
        self.path, self.headers, self.keep_alive, self.start, self.need = path, headers, keep_alive, start, need
        rid = headers.get("x-request-id")
        self.rid: str | None = given_request_id(headers) if rid is not None else None
        self.data = bytearray(data)
        self.head_read = 0.0            # when its head came whole (``time.perf_counter``): set as it is held

    def more(self, data: bytes, max_body: float) -> Parsed | Pending | None:
        """``data`` added: itself while the body is still short, the request once it is whole, None
        when the lane lets it go (more bytes than its length: a next request behind it)."""
        self.data += data
        if len(self.data) > self.need:
            return None
        if len(self.data) < self.need:
            return self
        return self.path, self.headers, bytes(self.data[self.start:]), self.keep_alive


Parsed = tuple[str, CIMultiDictProxy[str], bytes, bool]


class LeftBody:
    """The body of a held request (``Pending``) whose client left before it came whole: its read
    is the client's cancel, as the read of a body on aiohttp's path is cancelled when its client
    leaves, so the handler writes the line and counts of a client's cancel (a 499). The body of one
    the gateway's stop cuts (``EdgeProtocol.lane_cut``) too: its read is then the cut, answered
    with the 503 of a gateway shutting down."""

    __slots__ = ()

    def is_eof(self) -> bool:
        return False

    def read_nowait(self, n: int = -1) -> bytes:
        raise asyncio.CancelledError

    def exception(self) -> None:
        return None

    def feed_eof(self) -> None:
        return None


class Split:
    """A whole lane request (``first``) and the bytes that came after it in the same read (``rest``)."""

    __slots__ = ("first", "rest")

    def __init__(self, first: Parsed, rest: bytes) -> None:
        self.first, self.rest = first, rest


def parse(data: bytes, paths: dict[bytes, str], max_head: int, max_headers: int,
          max_body: float, decline: frozenset[str] = _DECLINE) -> Parsed | Pending | Split | None:
    """(path, headers, body, keep-alive) of ``data`` when it is exactly one plain request to one of
    ``paths`` that the lane may take; a ``Split`` when more bytes (up to ``HOLD_BYTES``) follow
    that request; a ``Pending`` when it is the whole head of one and part of its body (bodies up
    to ``HOLD_BODY``; larger ones are aiohttp's, which reads them as they come); None otherwise
    (aiohttp then parses the same bytes). ``decline``: the header names that leave a request to
    aiohttp (``CORS_DECLINE`` with CORS on)."""
    # one whole head the lane may take (its body complete or not), read in this one frame
    if not data.startswith(b"POST /"):
        return None
    end = data.find(b"\r\n\r\n")
    if end < 0 or end + 4 > max_head:
        return None
    line = data.find(b"\r\n")
    target, _, version = data[5:line].partition(b" ")
    path = paths.get(target)
    if path is None or version != b"HTTP/1.1":
        return None
    block = data[line + 2:end + 2].decode("utf-8", "surrogateescape")
    if _BLOCK.fullmatch(block) is None:
        return None
    fields = _FIELD.findall(block)
    if len(fields) > max_headers:
        return None
    lowered = list(map(str.lower, map(_NAME, fields)))     # in C, no Python frame per header
    if not decline.isdisjoint(lowered) or lowered.count("content-length") != 1 or lowered.count("host") != 1:
        return None                     # (an HTTP/1.1 request without one Host is aiohttp's 400)
    if HOST.fullmatch(fields[lowered.index("host")][1]) is None:
        return None                     # (the edge's 400: ``host_refused``)
    if len(set(lowered)) != len(lowered) and any(lowered.count(name) > 1 for name in _SINGLETONS):
        return None                     # (aiohttp's 400)
    # its body
    length = fields[lowered.index("content-length")][1]
    if not length.isascii() or not length.isdigit():
        return None
    try:
        n = int(length)
    except ValueError:                  # more digits than int() converts: aiohttp's path refuses it
        return None
    start = end + 4
    if n > max_body or len(data) > start + n + HOLD_BYTES:
        return None
    headers = CIMultiDictProxy(CIMultiDict(fields))
    keep_alive = "connection" not in lowered or _keep_alive(fields, lowered)    # the usual: no Connection
    if len(data) == start + n:
        return path, headers, data[start:], keep_alive
    if len(data) > start + n:
        return Split((path, headers, data[start:start + n], keep_alive), data[start + n:])
    if n > HOLD_BODY:
        return None
    return Pending(path, headers, keep_alive, start, start + n, data)
