"""The edge: what the gateway does to a client connection before and around the request handler.

Switchyard faces clients directly, so the HTTP server itself must bound what a slow or hostile
client can hold: a file descriptor and a handler each, forever, on a stock aiohttp server. Here:

- **Slow clients.** One lazily re-armed timer per connection (a deadline field plus at most one
  ``call_at`` handle, the way aiohttp's own keep-alive timer works) covers the phases of a
  connection: the request head (``header_timeout_s``, from accept, or from the first byte of the
  next request on a kept-alive connection; the empty lines a client may send before a request
  line, RFC 9112 §2.2, are no byte of one), the idle kept-alive connection
  (``keepalive_timeout_s``), and the body (``body_timeout_s`` between reads,
  ``body_total_timeout_s`` in all). A head or body that times out gets a 408 in OpenAI shape
  (Anthropic's on the Messages paths) when the client can still read one (nothing of a response went out yet), then the connection
  closes; an idle connection is closed silently, as HTTP clients expect of kept-alive
  connections (a 408 there would race with the client's next request).
- **Clients that stop reading.** ``pause_writing``/``resume_writing`` (asyncio's flow control,
  which is what makes aiohttp's ``StreamResponse.write`` block in ``drain``) arm and cancel a
  ``write_stall_timeout_s`` timer; when it fires and the client took no byte meanwhile (its TCP
  acknowledgements, ``_taken``: one that reads, however slowly, is given the bound again) the transport is aborted, which cancels the
  handler exactly as a client disconnect does, so the upstream leg is closed or aborted. A
  client that keeps up never pauses the transport and pays nothing per chunk. The kernel's send
  buffer grows to megabytes, which a stream's steady pace of tokens fills only after minutes, so
  while a stream runs its client is also looked at every ``write_stall_timeout_s``
  (``watch_stream``: one timer per stream, not per chunk) and cut when it took no byte of what
  waited for it over a whole period.
- **Heads that do not end.** The parser holds every byte of a head until its end, up to
  ``max_headers`` fields of ``max_header_bytes`` (1.6 MB by default); ``max_header_total_bytes``
  is checked on a whole head. A head still coming past ``EdgeLimits.head_bytes`` (the request line,
  that bound and ``HEAD_SLACK``) is answered 431 at once (``_e_head_too_large``); one pipelined
  behind a running request stops the connection's reading there and is answered at its turn.
- **The connection cap.** Over ``max_connections`` a new connection is closed at once, before
  a byte is read: there is no request yet to answer, and the cap exists to protect file
  descriptors and memory exactly when they are short. The cap in force is the lower of
  ``server.max_connections`` and the worker's share of its file-descriptor limit
  (gateway/server/run.py ``connection_limit``): the descriptors past that share are kept for the
  engine connections of the requests those connections send. A refusal is counted; the first one
  is logged, and then at most one line a minute (``refused_since_last``).
- **Errors aiohttp answers itself.** A request line or header that the parser refuses, or a body
  whose framing breaks, never reaches the app's middleware: aiohttp's ``RequestHandler`` answers
  through ``handle_error`` in plain text. ``EdgeProtocol.handle_error`` answers in OpenAI shape,
  Anthropic's for a request to a Messages path (aiohttp gives it no path for a request it could not
  parse: the edge keeps the first bytes of the head it reads, ``_e_line``, and reads the path from
  them, its target in origin or absolute form), with ``request-id``, and with 431 for header fields that are too large or too many (414 for a request-target over the line limit, RFC 9112 §3); the
  answer to a head it could not parse goes out in HTTP/1.1 (aiohttp's stand-in request says 1.0).
  A request line whose method is a token the parser does not know (``FOO``) is RFC 9110 §9.1's 501,
  not a malformed request: the gateway implements no such method (the router's 404 and 405 for a
  method the parser knows, ``PROPFIND``, are made a 501 too, gateway/server/app.py); the connection
  closes, the rest of the request's framing being unknown.
- **Chunked framing.** A chunked body's framing (its size lines with their extensions, CRLFs,
  trailers) is bounded by its data (``_e_framing``): the parser reads a size line at any length,
  which no body limit counts (RFC 9112 §7.1.1 asks a server to bound chunk extensions).
- **Answers that close before the body came.** A refusal at the head that closes the connection
  (a 413 to a told length, a version, a coding) shuts the connection's write side right after the
  answer, so the client reads its end at once; aiohttp's read-and-drop of what the client still
  sends (up to 10 s, or the body clock) goes on behind it, so the close does not reset the
  connection under an answer not yet read. A refusal after which aiohttp reads nothing more (a head
  it could not parse, a request line in HTTP/2.0, a body whose framing broke, a body's 408, a held
  lane request cut by a stop) closes lingering (``_Linger``): the write side shut after the
  answer, what the client still sends is read and dropped for a bounded while before the close.
- **The request log.** Every answer the edge writes itself (those above, the 408s, and the
  refusals of ``EdgeServer``'s handler: a version, a ``Host`` that is no host, ``CONNECT``, a
  ``Content-Length``, a transfer coding, a coding, an ``Expect``) has a request log line (``log_edge_answer``, the shape of every request line), its
  method and path as far as the edge read them, its duration from the head's start
  (``e_head_started``: the start of the head clock the edge runs anyway). A 408 or 400 for a body
  the pipeline was reading is left to the pipeline's line, which says that answer
  (gateway/pipeline/context.py ``take_edge_answer``) rather than a client's cancel.
- **A stop.** At the drain's start (gateway/server/run.py ``drain_and_stop``) ``EdgeServer.drain``
  closes every idle kept-alive connection, as HTTP clients expect of them (their pools open a new
  one, elsewhere once the load balancers caught up), and every other connection closes after the
  answer it is giving, or the first one of a connection accepted since: that answer says
  ``Connection: close`` when its head has not gone out yet (a stream under way ends with its
  connection instead, or, when the client pipelined a request behind it that the edge read, after
  that request's answer, which says ``Connection: close``: ``_e_drain_next``).
- **CORS**, when ``server.cors_allowed_origins`` lists origins (gateway/server/cors.py): a browser's
  preflight to an API path is answered before the application (and written to the request log as
  a request of its own), and a request with an ``Origin``
  is left to aiohttp's request path, whose answers get CORS's headers; so do the 408 and 400 the
  edge writes to the socket itself, when the request's head was read.

aiohttp hooks used (3.14): ``web.Server`` subclassed (public; ``__call__`` is the protocol
factory), ``web.RequestHandler`` subclassed (public; ``connection_made``/``connection_lost``/
``data_received`` are asyncio's protocol API, ``finish_response`` and ``handle_error`` are its
documented-in-source override points). Semi-private, and pinned by tests in
``tests/unit/gateway/server/test_edge.py`` that break if aiohttp changes them: ``AppRunner._make_server`` (the
runner's factory of its ``Server``), ``Server._kwargs`` (the handler keyword arguments the runner
collected), ``RequestHandler._request_count`` (requests parsed on this connection),
``web_protocol.ERROR`` (the message of the request aiohttp hands ``handle_error`` for a head it
could not parse), ``web_protocol._ErrInfo`` and ``RequestHandler._messages`` (a refused read, as
queued after the requests before it: ``_e_feed``), ``Server._connections`` and a request's reified
``keep_alive`` in ``BaseRequest._cache`` (a drain: ``EdgeServer.drain``, ``_e_closing``), and for a body in ``x-gzip`` (``XGzipBody``) ``BaseRequest._payload`` with its
reified ``content``, ``StreamReader._wait`` and ``_protocol`` (the connection a body that does not
decode is answered on) and the parser's ``DeflateBuffer``.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import re
import socket
import sys
import termios
import time
from collections.abc import Iterable
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import orjson
import structlog
from aiohttp import compression_utils, hdrs, web
from aiohttp.http import HttpVersion10, HttpVersion11
from aiohttp.http_exceptions import (
    BadHttpMessage,
    BadHttpMethod,
    ContentEncodingError,
    HttpProcessingError,
    LineTooLong,
)
from aiohttp.http_parser import DeflateBuffer
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import ERROR as _UNPARSED
from aiohttp.web_protocol import _ErrInfo
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.apis.anthropic import anthropic_error
from gateway.apis.anthropic_models import asks_anthropic
from gateway.apis.paths import AUDIO_PATHS, on_messages
from gateway.errors import ErrorClass, error_body, error_response, parser_message
from gateway.observability.logs import RequestLog
from gateway.observability.metrics import Counter as RequestCounter
from gateway.pipeline.context import EDGE_ANSWER, RequestRecord, log_answer, safe_header_value
from gateway.pipeline.whole import WrittenAnswer, write_whole
from gateway.request import given_request_id, request_id_from
from gateway.server import lane
from gateway.server.cors import (
    OUTCOMES,
    CorsPolicy,
    CorsRequest,
    VaryRequest,
    head_lines,
    is_api_path,
    is_preflight,
    outcome,
    preflight,
    request_class,
)

log = structlog.get_logger("switchyard.edge")

TIMEOUT_REASONS = ("header", "body", "body_total", "keepalive", "write_stall")

# connection phases (ints: compared on every data_received)
# Linux's TCP_INFO: its tcpi_bytes_acked (bytes 120 to 128, since Linux 4.1) counts the bytes of a
# connection its peer took (acknowledged); None where there is none
_TCP_INFO: int | None = getattr(socket, "TCP_INFO", None)


def _taken(transport: asyncio.BaseTransport | None) -> int:
    """How many bytes the client took of what was written to it (its TCP acknowledgements: once its
    receive buffer is full, a byte is taken only as the client reads one); -1 when not known (not
    TCP, not Linux)."""
    sock = transport.get_extra_info("socket") if transport is not None and _TCP_INFO is not None else None
    if sock is None:
        return -1
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 128)
    except (OSError, ValueError):
        return -1
    return int.from_bytes(info[120:128], sys.byteorder) if len(info) >= 128 else -1


# Linux's ioctl for the bytes in a socket's send queue (sent and not acknowledged, or not sent yet)
_OUTQ: int | None = getattr(termios, "TIOCOUTQ", None)


def _waiting(transport: asyncio.BaseTransport) -> int:
    """The bytes written to the client that it has not taken yet (the kernel's send queue, and the
    transport's own buffer); -1 when not known."""
    sock = transport.get_extra_info("socket") if _OUTQ is not None else None
    if sock is None:
        return -1
    try:
        queued = int.from_bytes(fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0"), sys.byteorder)
    except (OSError, ValueError):
        return -1
    return queued + transport.get_write_buffer_size()     # type: ignore[attr-defined]


_HEAD = 0      # waiting for a request head, the clock runs (fresh connection, or bytes of a next one)
_IDLE = 1      # kept-alive, no byte of a next request yet
_READY = 2     # a complete head is queued, the handler is about to start
_BODY = 3      # the handler runs and the body is still arriving
_BUSY = 4      # the handler runs, the body is complete: only the write-stall clock applies

# a request head's Content-Length and Transfer-Encoding fields, which tell where its body ends (``_e_feed``)
_FRAMING = re.compile(rb"\r\n(content-length|transfer-encoding)[ \t]*:[ \t]*([^\r\n]*?)[ \t]*(?=\r\n)", re.I)

# a chunk's size line (RFC 9112 §7.1): its size in hex, its extensions, if any, to the line's end
# (chunk-ext: ``;`` name [``=`` token or quoted string], each after optional blanks); a line that came
# in part, as far as it came
_EXT_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,15})(?:[ \t]*;[ \t]*" + _EXT_TOKEN + rb"(?:[ \t]*=[ \t]*(?:" + _EXT_TOKEN
                         + rb'|"(?:[^"\\\r\n]|\\[^\r\n])*"))?)*[ \t]*\r\n')
_CHUNK_PART = re.compile(rb"[0-9A-Fa-f]{0,15}(?:[ \t;][^\r\n]*)?\r?")
_BROKEN = -2        # ``_chunked_end``: a line of the chunked framing that came whole does not parse

# the bytes of a chunked body's framing (its size lines, their extensions, the CRLFs, its trailers)
# taken beyond 8 per byte of its data (a chunk of one byte has 5: ``1``, two CRLFs): RFC 9112
# §7.1.1's bound on chunk extensions, which the HTTP parser reads at any length (``_e_framing``)
CHUNK_FRAMING_SLACK = 65536
CHUNK_FRAMING_PER_BYTE = 8

# CR and LF, the bytes of the empty lines a server ignores before a request line (RFC 9112 §2.2)
_EMPTY_LINE = b"\r\n"

# how many first bytes of a request head the edge keeps (``_e_line``): enough for the method and a
# Messages path, to answer a head that does not parse in its API's shape, in absolute form too (a
# scheme, a host name of up to 253 characters and a port before the path)
_LINE_KEEP = 320
# the path of a request line's target, as far as the kept bytes hold it (to a space, a query or the
# line's end; a path cut short by ``_LINE_KEEP`` still shows whether it is a Messages path): in
# origin form, or after the scheme and authority of absolute form (RFC 9112 §3.2.2, which a server
# takes and aiohttp serves as its path)
_LINE_PATH = re.compile(rb"[^ \r\n]+ (?:[A-Za-z][A-Za-z0-9+.\-]*://[^/ ?#\r\n]*)?(/[^ ?\r\n]*)")
# a request line whose method is a token the HTTP parser does not know (RFC 9110 §9.1's 501), as
# far as the kept bytes hold it: the method, a space, a target's start (a path, ``*``, a scheme),
# and when the line ends within them, the rest of a request line (``NOT HTTP AT ALL`` is none)
_METHOD = rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+) "
_LINE_METHOD = re.compile(_METHOD + rb"(?:/|\*|[A-Za-z][A-Za-z0-9+.\-]*://)")
_LINE_WHOLE = re.compile(_METHOD + rb"[^ \r\n]+ HTTP/1\.[01]")

# the methods the gateway knows: RFC 9110 §9's and PATCH (RFC 5789). One of them on a path that
# does not serve it is a 405 with the path's Allow; a method neither among them nor served by a
# route is a 501 (RFC 9110 §9.1: a method the origin server does not recognize or implement)
STANDARD_METHODS = frozenset(("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"))

# the content codings aiohttp's parser decodes in a request body (br and zstd when their decoders are
# installed): what a 415 lists in Accept-Encoding (RFC 9110 §15.5.16)
DECODED_CODINGS = ("gzip", "deflate") + (("br",) if compression_utils.HAS_BROTLI else ()) \
    + (("zstd",) if getattr(compression_utils, "HAS_ZSTD", False) else ())
ACCEPT_ENCODING = ", ".join(DECODED_CODINGS)
# aiohttp's parser refusing a head whose coding has no decoder installed: "Can not decode
# content-encoding: brotli (br). Please install `Brotli`"
_NO_DECODER = re.compile(r"content-encoding: [^()]* \(([a-z0-9-]+)\)")

# the bytes a request head may hold beyond its request line and the header section
# ``server.max_header_total_bytes`` counts: the empty lines before its request line, the whitespace
# around its field values, its last empty line (``EdgeLimits.head_bytes``)
HEAD_SLACK = 4096

_REASONS = {400: "Bad Request", 408: "Request Timeout", 413: "Payload Too Large", 414: "URI Too Long",
            431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable",
            504: "Gateway Timeout"}


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    """The ``server:`` keys the edge reads (gateway/config/schema.py ``ServerConfig``)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    body_total_timeout_s: float = 120.0
    keepalive_timeout_s: float = 75.0
    write_stall_timeout_s: float = 30.0
    max_connections: int = 10000
    max_header_bytes: int = 16384
    max_headers: int = 100
    max_header_total_bytes: int = 65536     # the header section in all (``header_bytes``); 0: no bound
    max_body_bytes: int = 16 * 1024 * 1024
    upload_max_bytes: int = 0          # POST /v1/files (batch.max_file_bytes and its multipart); 0: as any body
    upload_file_bytes: int = 0         # batch.max_file_bytes itself, which an upload's 413 names
    fast_lane: bool = True             # gateway/server/lane.py
    cors_allowed_origins: tuple[str, ...] = ()     # gateway/server/cors.py; empty: CORS off

    @classmethod
    def from_config(cls, server: Any) -> EdgeLimits:
        return cls(**{name: getattr(server, name) for name in cls.__dataclass_fields__ if hasattr(server, name)})

    @property
    def head_bytes(self) -> int:
        """The most bytes of a request head the edge reads before its end (0: no bound but the
        parser's, ``max_headers`` fields of ``max_header_bytes``): a request line, a header section
        within ``max_header_total_bytes`` and ``HEAD_SLACK`` bytes of the whitespace the total does not
        count. A head still coming past it is refused with 431 (``EdgeProtocol._e_head_too_large``)."""
        total = self.max_header_total_bytes
        return self.max_header_bytes + total + HEAD_SLACK if total else 0

    def handler_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for aiohttp's ``RequestHandler`` (through the runner)."""
        # aiohttp's keep-alive timer cannot tell an idle connection from a half-sent head, and it
        # closes both silently; ours does both (and counts them), so aiohttp's stays a backstop.
        ka, hd = self.keepalive_timeout_s, self.header_timeout_s
        backstop = ka + hd + 60.0 if ka and hd else 10.0 ** 7
        return {"keepalive_timeout": backstop, "max_line_size": self.max_header_bytes,
                "max_field_size": self.max_header_bytes, "max_headers": self.max_headers}


UPLOAD_PATH = "/v1/files"      # a batch input file may be larger than an inference body (gateway/batch)


class EdgeMetrics:
    def __init__(self, registry: CollectorRegistry, edge: Edge) -> None:
        self.timeouts = Counter("switchyard_client_timeouts",
                                "Client connections cut by a slow-client timeout, by phase", ["reason"],
                                registry=registry)
        self._timeouts = {r: self.timeouts.labels(r) for r in TIMEOUT_REASONS}
        self.rejected = Counter("switchyard_connections_rejected",
                                "Client connections closed at accept because the worker's connection limit "
                                "(server.max_connections, or its share of the file-descriptor limit) was reached",
                                registry=registry)
        self.protocol_errors = Counter("switchyard_client_protocol_errors",
                                       "Requests answered by the edge because HTTP framing was broken, by status",
                                       ["status"], registry=registry)
        registry.register(_ConnectionGauge(edge))

    def timeout(self, reason: str) -> None:
        self._timeouts[reason].inc()


class _ConnectionGauge(Collector):
    """``switchyard_client_connections``, read off the edge at scrape time."""

    def __init__(self, edge: Edge) -> None:
        self._edge = edge

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        yield GaugeMetricFamily("switchyard_client_connections", "Open client connections",
                                value=self._edge.connections)
        yield GaugeMetricFamily("switchyard_client_connections_limit",
                                "Client connections a worker takes before it closes new ones at accept (0: no cap)",
                                value=self._edge.limits.max_connections)
        yield CounterMetricFamily("switchyard_client_requests_fast_lane",
                                  "Requests the edge's fast lane took off the connection (gateway/server/lane.py); "
                                  "the others went through aiohttp's request path", value=self._edge.lane_requests)


def _shaped_body(path: str | None, status: int, message: str, type_: str | None, code: str,
                 param: str | None = None, headers: Any = None) -> bytes:
    """An error body in the shape the path's clients read: Anthropic's on the Messages paths
    (``gateway.apis.paths.on_messages``), and on the models paths asked with ``anthropic-version``
    (``headers``: the request's, when its head was read)."""
    if on_messages(path) or (path is not None and headers is not None and asks_anthropic(path, headers)):
        return orjson.dumps(anthropic_error(status, message))
    return orjson.dumps(error_body(status, message, type_=type_, code=code, param=param))


def error_response_bytes(status: int, message: str, *, code: str, request_id: str | None = None,
                         path: str | None = None, cors: str = "", headers: Any = None) -> bytes:
    """A complete HTTP/1.1 error answer with ``Connection: close``, written straight to a transport
    when no aiohttp response object exists (a head that never completed, a body that stalled);
    ``path`` and ``headers``: the request's, when its head was read; ``cors``: CORS's header lines
    for it (gateway/server/cors.py ``head_lines``), when CORS is on."""
    rid = request_id or request_id_from(None)
    body = _shaped_body(path, status, message, "invalid_request_error", code, headers=headers)
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
            "Connection: close\r\n"
            f"request-id: {rid}\r\nx-request-id: {rid}\r\n{cors}\r\n")
    return head.encode("ascii") + body


# the handlers of held lane requests whose client left (``EdgeProtocol._lane_left``), referenced until done
_LEFT: set[asyncio.Task] = set()

# a worker that keeps refusing connections at its cap says so at most once in this many seconds
REFUSED_LOG_EVERY_S = 60.0

# a lingering close (``_Linger``): what still comes of a refused request is read and dropped for at most
# this long in all, until no byte came for this long, or past this many bytes over server.max_body_bytes
LINGER_S = 10.0
LINGER_IDLE_S = 2.0
LINGER_SLACK = 1 << 20


class _Linger(asyncio.Protocol):
    """A connection closing after a refusal while its client may still be sending its request (RFC
    9112 section 9.6: a lingering close): the answer was written and the write side shut
    (``write_eof``, so the client reads the answer and then the connection's end), and what still
    comes is read and dropped, never kept, until the client ends its side or a bound passes
    (``LINGER_S`` in all, ``LINGER_IDLE_S`` without a byte, ``bytes`` read), and then the connection
    closes. Closed with the client's bytes unread, the connection would be reset under an answer the
    client may not have read yet (a stack drops its receive buffer at a reset), and a client writing
    its body would meet the reset as a write error instead of reading the answer. The connection's
    own protocol (``owner``) hears of its end (``connection_lost``) when it closes."""

    __slots__ = ("_owner", "_transport", "_loop", "_left", "_end", "_last", "_timer", "done")

    def __init__(self, owner: EdgeProtocol, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop,
                 max_bytes: float) -> None:
        self._owner, self._transport, self._loop = owner, transport, loop
        self._left = max_bytes
        now = self._last = loop.time()
        self._end = now + LINGER_S
        self.done = loop.create_future()
        transport.set_protocol(self)
        try:
            transport.resume_reading()      # (reading may have been paused for the request)
        except (RuntimeError, AttributeError):
            pass
        self._timer: asyncio.TimerHandle | None = loop.call_at(min(self._end, now + LINGER_IDLE_S), self._check)

    def data_received(self, data: bytes) -> None:
        self._last = self._loop.time()
        self._left -= len(data)
        if self._left < 0:
            self.close()

    def eof_received(self) -> bool:
        return False                        # the client ended its side: the transport closes

    def _check(self) -> None:
        self._timer = None
        now = self._loop.time()
        if now >= self._end or now - self._last >= LINGER_IDLE_S:
            self.close()
        else:
            self._timer = self._loop.call_at(min(self._end, self._last + LINGER_IDLE_S), self._check)

    def close(self) -> None:
        if not self._transport.is_closing():
            self._transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.done.done():
            self.done.set_result(None)
        self._owner.connection_lost(exc)


class Edge:
    """Limits, counters and the count of open connections, shared by every connection of a server."""

    def __init__(self, limits: EdgeLimits, registry: CollectorRegistry | None = None,
                 cors_requests: RequestCounter | None = None, request_log: RequestLog | None = None) -> None:
        self.limits = limits
        # what set ``limits.max_connections``: the config's key, or the file-descriptor limit (``nofile``)
        self.limit_from = "server.max_connections"
        self.nofile: int | None = None
        self._refused_logged = -float("inf")    # loop time of the last "at the worker's limit" line
        self._refused_since = 0
        # the gateway's request log, where the edge writes the lines of the answers it makes itself
        # (a CORS preflight's); None: no line for them
        self.request_log = request_log
        self.connections = 0
        self.lane_requests = 0
        # the gateway stops (``EdgeServer.drain``): every connection closes after its answer in progress
        self.draining = False
        # the gateway's requests in flight (gateway/server/lifecycle.py), where a request the fast lane
        # holds for its body is counted, as aiohttp's request reading its body is; None: not counted
        self.lifecycle: Any = None
        # gateway/server/cors.py; None: CORS off
        self.cors = CorsPolicy(limits.cors_allowed_origins) if limits.cors_allowed_origins else None
        # the inference paths besides /v1/... that CORS lets a page call (``is_api_path``): the server's
        self.cors_api: frozenset[str] = frozenset()
        # with CORS on, ``switchyard_cors_requests_total`` by outcome (the gateway's metric, or one of its own)
        self.cors_counted: dict[str, Any] = {}
        if self.cors is not None:
            family = cors_requests if cors_requests is not None else RequestCounter(
                "switchyard_cors_requests", "", ["outcome"])
            self.cors_counted = {o: family.labels(o) for o in OUTCOMES}
        self.metrics = EdgeMetrics(registry if registry is not None else CollectorRegistry(), self)

    def refused(self, now: float) -> None:
        """A connection closed at accept over the cap: counted, and logged when none was for a while."""
        self.metrics.rejected.inc()
        if now - self._refused_logged < REFUSED_LOG_EVERY_S:
            self._refused_since += 1
            return
        log.warning("client connections at the worker's limit; closing new ones", connections=self.connections,
                    connection_limit=self.limits.max_connections, limit_from=self.limit_from, nofile=self.nofile,
                    refused_since_last=self._refused_since)
        self._refused_logged = now
        self._refused_since = 0

    def classify(self, status: int, exc: BaseException | None, message: str | None) -> tuple[int, str, str]:
        """(status, message, code) for an error aiohttp's protocol layer met before or under the app."""
        lim = self.limits
        if isinstance(exc, ContentEncodingError) and (m := _NO_DECODER.search(str(exc.message))) is not None:
            return 415, _coding_message(m.group(1)), "unsupported_content_encoding"
        if isinstance(exc, LineTooLong):
            return 431, (f"the request line or a header field is larger than {lim.max_header_bytes} bytes "
                         "(server.max_header_bytes)"), "header_too_large"
        if isinstance(exc, BadHttpMessage) and "Too many headers" in str(exc.message):
            return 431, f"more than {lim.max_headers} header fields (server.max_headers)", "too_many_headers"
        if isinstance(exc, HttpProcessingError):
            code = exc.code if 400 <= exc.code < 500 else 400
            return code, f"malformed HTTP request: {_short(parser_message(exc.message or message or ''))}", "bad_request"
        if isinstance(exc, web.RequestPayloadError | ConnectionResetError):
            return 400, f"malformed request body: {_cause_text(exc)}", "bad_body"
        if status == 504:
            return 504, "the request handler timed out", "timeout"
        if status >= 500:
            return status, "internal error in the gateway", "internal_error"
        return status, _short(message or _REASONS.get(status, "error")), "bad_request"


def _chunked_end(data: bytes, pos: int) -> int:
    """Where the chunked body that begins at ``pos`` ends in ``data``: past its last chunk (size 0)
    and its trailer section's empty line. -1 when it does not end within ``data``, ``_BROKEN`` when
    a size line that came whole does not parse or a chunk's data is not followed by its CRLF. Only
    where ``_e_feed`` cuts a read is read off it: the parser reads the body as it reads it anyway."""
    size = len(data)
    while True:
        m = _CHUNK_SIZE.match(data, pos)
        if m is None:
            if data.find(b"\r\n", pos) < 0 and _CHUNK_PART.fullmatch(data, pos) is not None:
                return -1               # the line's start, the rest to come
            return _BROKEN
        n = int(m.group(1), 16)
        pos = m.end()
        if n == 0:
            end = data.find(b"\r\n\r\n", pos - 2)       # the trailer section ends in an empty line
            return end + 4 if end >= 0 else -1
        pos += n + 2
        if pos > size:
            return -1
        if data[pos - 2:pos] != b"\r\n":
            return _BROKEN


def _chunked_body(request: web.BaseRequest) -> bool:
    """Whether ``request``'s body is in the chunked transfer coding (the parser takes it only as
    the last coding, and the edge refuses any other before it)."""
    coding = request.headers.get(hdrs.TRANSFER_ENCODING)
    return coding is not None and coding.rsplit(",", 1)[-1].strip().lower() == "chunked"


def _error_type(status: int) -> str | None:
    """Errors the edge answers are the client's doing below 500: ``invalid_request_error``."""
    return "invalid_request_error" if status < 500 else None


def _cause_text(exc: BaseException | None) -> str:
    """The innermost parser message of a payload error (aiohttp wraps it as ``400, message: ...``)."""
    while exc is not None:
        msg = getattr(exc, "message", None)
        if isinstance(msg, str) and msg:
            return _short(parser_message(msg.strip()))
        exc = exc.__cause__
    return "undecodable"


def _short(text: str | None, limit: int = 200) -> str:
    text = text or ""
    return text if len(text) <= limit else text[:limit] + "..."


def _e_closing(request: Any) -> None:
    """``request``'s answer closes its connection: it says ``Connection: close`` when its head is
    written after this (``request.keep_alive``, which aiohttp's responses and the whole writes of
    gateway/pipeline/whole.py read; aiohttp's is reified into the request's ``_cache``, where
    aiohttp itself sets such values)."""
    if isinstance(request, lane.LaneRequest):
        request.keep_alive = False
    else:
        request._cache["keep_alive"] = False


def _unframed(request: web.BaseRequest, resp: web.StreamResponse) -> bool:
    """An answer to HTTP/1.0 that ends where the connection does: a body of no told length (an
    event stream; HTTP/1.0 has no chunked coding). aiohttp sends such a head without
    ``Connection: keep-alive`` yet leaves the response's ``keep_alive`` as the request asked, so the
    connection would stay open and the client would wait for the end of an answer that has no other
    end (RFC 1945 §7.2.2)."""
    return (hdrs.CONTENT_LENGTH not in resp.headers and request.method != "HEAD"
            and resp.status >= 200 and resp.status not in (204, 304))


class EdgeProtocol(web.RequestHandler):
    """aiohttp's HTTP/1.1 server protocol, with the edge's clocks, cap and error shape."""

    __slots__ = ("_edge", "_e_phase", "_e_deadline", "_e_timer", "_e_timer_at", "_e_stall", "_e_taken", "_e_rx_head", "_e_head_rx", "_e_next_head",
                 "_e_pipelined", "_e_started", "_e_request", "_e_payload", "_e_last_rx", "_e_body_end", "_e_counted",
                 "_e_read_paused", "_e_framed", "_e_framed_from", "_e_loop", "_e_line", "_e_heads", "_e_unparsed", "_e_head_at", "_lane", "_lane_held", "_lane_server",
                 "_lane_part", "_lane_task", "_lane_next", "_lane_wake", "_lane_parse", "_lane_request", "_e_linger",
                 "_e_watch", "_e_watch_of", "_e_watch_mark")

    def __init__(self, manager: web.Server, *, edge: Edge, loop: asyncio.AbstractEventLoop, **kwargs: Any) -> None:
        super().__init__(manager, loop=loop, **kwargs)
        self._edge = edge
        self._e_loop = loop
        self._e_phase = _HEAD
        self._e_deadline = 0.0
        self._e_timer: asyncio.Handle | None = None
        self._e_timer_at = 0.0          # when ``_e_timer`` fires (uvloop's handle for a delay under
                                        # half a millisecond is a plain ``Handle``, without ``when()``)
        self._e_stall: asyncio.TimerHandle | None = None
        self._e_taken = -1              # the bytes the client had taken when the stall bound was set (-1: not known)
        self._e_watch: asyncio.TimerHandle | None = None     # a stream's client, looked at every write_stall_timeout_s
        self._e_watch_of = 0            # the request (``_e_started``) whose stream is watched
        self._e_watch_mark = -1         # the bytes the client had taken at the last look, if some were waiting then (-1: none)
        self._e_rx_head = False         # a byte of the awaited head arrived
        self._e_head_rx = 0             # the bytes of it read so far (``EdgeLimits.head_bytes``)
        self._e_next_head = False       # bytes of a head after the last request parsed are the parser's
        self._e_pipelined = False       # bytes of a next request arrived while the handler ran
        self._e_started = 0             # requests handed to the handler
        self._e_request: web.BaseRequest | None = None
        self._e_payload: Any = None
        self._e_last_rx = 0.0
        self._e_body_end = 0.0
        self._e_counted = False
        self._e_read_paused = False     # the handler is not consuming the body: the silence is ours
        self._e_framed = 0              # bytes of a chunked body read since its handler started (``_e_framing``)
        self._e_framed_from = -1        # its data's bytes then (-1: no chunked body is being read)
        self._e_line = b""              # the first bytes of the head aiohttp is parsing (``_LINE_KEEP``)
        self._e_heads: dict[int, bytes] | None = None   # those of heads fed behind a request in one read (``_e_feed``)
        self._e_unparsed = False        # the request started last is aiohttp's for a head it could not parse
        self._e_head_at = 0.0           # loop time the head clock of the request in turn started (``e_head_started``)
        self._lane: Any = None          # the fast lane's request in flight (gateway/server/lane.py)
        self._e_linger: _Linger | None = None   # the connection's lingering close, once it closes so (``_e_lingering``)
        self._lane_held: list[bytes] = []   # bytes that came while it ran
        self._lane_part: lane.Pending | None = None     # a lane request whose body is still coming
        self._lane_task: asyncio.Task | None = None     # the connection's lane task (``_lane_serve``)
        self._lane_next: Any = None     # the request it runs next: (request, handler)
        self._lane_wake: asyncio.Future | None = None   # what it waits on for one, between requests
        self._lane_server = manager if isinstance(manager, EdgeServer) and manager.lane_paths else None
        # ``lane.parse``, or with CORS on the one that leaves a request with an Origin to aiohttp
        self._lane_parse = self._lane_server.lane_parse if self._lane_server is not None else lane.parse
        # the class of its requests: with CORS on, one whose answers carry Vary: Origin
        self._lane_request = self._lane_server.lane_request if self._lane_server is not None else lane.LaneRequest

    @property
    def _e_parsed(self) -> int:
        """Requests aiohttp parsed on this connection so far, parse errors included (the
        semi-private ``RequestHandler._request_count``, pinned by tests/unit/gateway/server/test_edge.py)."""
        return self._request_count

    # -- connection --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        edge = self._edge
        cap = edge.limits.max_connections
        if cap and edge.connections >= cap:
            edge.refused(self._e_loop.time())
            transport.close()           # before reading a byte: nothing to answer yet
            return
        edge.connections += 1
        self._e_counted = True
        super().connection_made(transport)
        self._e_enter_head(self._e_loop.time())

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._e_counted:         # refused at the cap: the base protocol never started
            return
        self._e_counted = False
        self._edge.connections -= 1
        self._e_cancel_timers()
        self._e_request = self._e_payload = None
        left = self._lane_part
        if left is not None:
            self._lane_released()
        self._lane = self._lane_next = None
        self._lane_held = []
        task, self._lane_task = self._lane_task, None
        if task is not None and not task.done():
            task.cancel()               # the client went away: as aiohttp cancels its handler
        super().connection_lost(exc)
        if left is not None:
            self._lane_left(left)
            self._lane_unhold(handed=self._lane_server is not None)     # after its handler was made

    def _lane_left(self, pending: lane.Pending) -> None:
        """The client of a request the lane held for its body left (``connection_lost``): its
        handler runs on a body whose read is the client's cancel (``lane.LeftBody``), as aiohttp's
        handler reading a body is cancelled, so the request has the line and the counts of a client
        that left (a 499 ``client_cancel``), timed from its head."""
        server = self._lane_server
        if server is None:
            return
        request = self._lane_request(pending.path, pending.headers, b"", False, self, pending.head_read)
        request.content = lane.LeftBody()
        request.content_length = pending.need - pending.start
        task = request.task = self._e_loop.create_task(server.direct[pending.path](request))
        _LEFT.add(task)
        task.add_done_callback(_LEFT.discard)

    def data_received(self, data: bytes) -> None:
        phase = self._e_phase
        if not data:                    # aiohttp re-parsing what it holds (resume_reading): no client byte
            if phase in (_HEAD, _IDLE):
                parsed = self._e_parsed
                super().data_received(data)
                if self._e_parsed != parsed:
                    self._e_phase = _READY
            else:
                super().data_received(data)
            return
        if self._lane_part is not None:     # the body of a lane request whose head came first
            self._lane_more(data)
            return
        if self._lane is not None:      # a lane request runs: its successor waits its turn
            if not self._lane_held:
                data = data.lstrip(b"\r\n")     # empty lines after a body are no next request (RFC 9112 §2.2)
                if not data:
                    return
            self._e_pipelined = True
            self._lane_held.append(data)
            if sum(map(len, self._lane_held)) > lane.HOLD_BYTES and self.transport is not None:
                self.transport.pause_reading()
            return
        if (phase == _IDLE or (phase == _HEAD and not self._e_rx_head)) and data[0] in _EMPTY_LINE \
                and not data.strip(b"\r\n"):
            # RFC 9112 §2.2: empty lines before a request line are ignored, and no byte of a head:
            # the connection is as idle as it was. The parser reads them (it skips them, or they
            # end a line of a head it holds part of)
            parsed = self._e_parsed
            super().data_received(data)
            if self._e_parsed != parsed:
                self._e_phase = _READY
            return
        if phase == _IDLE:              # first byte of the next request
            if self._lane_server is not None and self._lane_take(data):
                return                  # on the lane at once (or held for its body): no head clock to start
            self._e_enter_head(self._e_loop.time())     # the head clock starts
            phase = _HEAD
        elif phase == _HEAD and self._lane_server is not None and not self._e_rx_head and self._lane_take(data):
            return
        if phase == _HEAD:
            self._e_keep(data)          # a head for aiohttp: its request line, for its errors
            self._e_rx_head = True
            parsed = self._e_parsed
            self._e_feed(data)
            if self._e_parsed != parsed:
                self._e_phase = _READY      # the handler starts on the next loop iteration
            else:
                self._e_head_rx += len(data)
                bound = self._edge.limits.head_bytes
                if bound and self._e_head_rx > bound:
                    self._e_head_too_large()
            return
        if phase == _BODY:
            payload = self._e_payload
            if payload is None or payload.is_eof():     # the body is complete: these bytes are not its
                self._e_body_done()
                self.data_received(data)
                return
            self._e_last_rx = self._e_loop.time()
            parsed = self._e_parsed
            super().data_received(data)
            # aiohttp drops a body whose chunked framing breaks (it queues a parse error for a *next*
            # request and leaves the handler waiting), and a body that fails to decode raises in the
            # handler's read; either way the edge answers, the request is over
            if payload.exception() is not None or (self._e_parsed != parsed and not payload.is_eof()):
                broken = payload.exception()
                if broken is None and self._messages and self._messages[-1][0].__class__ is _ErrInfo:
                    broken = self._messages[-1][0].exc
                self._e_broken_body(f"malformed request body: {_cause_text(broken)}")
            elif payload.is_eof():
                self._e_body_done()
            elif self._e_framed_from >= 0 and self._e_framing(len(data), payload):
                self._e_broken_body(f"malformed request body: its chunked framing (chunk sizes, extensions, trailers) "
                                    f"passed {CHUNK_FRAMING_PER_BYTE} bytes per byte of data by more than "
                                    f"{CHUNK_FRAMING_SLACK} bytes")
            return
        if phase == _BUSY:
            if not self._e_pipelined and not data.strip(b"\r\n"):
                super().data_received(data)     # empty lines the parser skips: no next request yet
                return
            self._e_pipelined = True
        self._e_keep(data)              # the head of a next request
        parsed = self._e_parsed
        self._e_feed(data)
        if self._e_parsed != parsed:        # a head came whole: its answer is its own (``headers_too_large``)
            self._e_head_rx = 0
            self._e_next_head = False
            return
        messages = self._messages
        if messages and not messages[-1][1].is_eof():
            return                          # the body of a request waiting its turn
        # the parser is between requests: all of these bytes are the next head's, so far
        self._e_next_head = True
        self._e_head_rx += len(data)
        bound = self._edge.limits.head_bytes
        if bound and self._e_head_rx > bound and self.transport is not None:
            # no more of it is read while the requests before it run: at its turn it is answered
            # 431 (``_e_after_request``), the parser holding no more than this
            self.transport.pause_reading()

    def _e_keep(self, data: bytes) -> None:
        """The first bytes of the head aiohttp parses (``_e_line``), without the empty lines before
        its request line (RFC 9112 §2.2: none of a request, the parser skips them)."""
        line = self._e_line
        if len(line) < _LINE_KEEP:
            self._e_line = line + data[:_LINE_KEEP] if line else data[:_LINE_KEEP].lstrip(b"\r\n")

    def _e_feed(self, data: bytes) -> None:
        """``data`` to aiohttp's parser, a request at a time where a request's end is told by its
        head (no body, one ``Content-Length``, a chunked body whose last chunk and trailers are in
        ``data``) and more bytes follow it. The parser, given a read whose later part it refuses,
        drops the requests it parsed before in that read and answers the first of them with the
        refusal; fed apart, each of them is queued before the refusal (which ends the connection)
        and answered, as the fast lane answers its own (gateway/server/lane.py), and the first bytes
        of each next head are kept for its turn (``_e_heads``): the answer to a head the parser
        refuses is shaped by its own request line, not by the one before it. A chunked body whose
        framing breaks in ``data`` is fed after its head (``_e_feed_broken``). Where the parser's
        reading is cut makes no difference to what it reads: bytes the edge cannot tell the end of,
        or that are not a request's start, go on in one piece."""
        pos, size = 0, len(data)
        while True:
            end = data.find(b"\r\n\r\n", pos)
            if end < 0 or end + 4 >= size:
                break
            framing = _FRAMING.findall(data, pos, end + 2)
            stop = end + 4
            if framing:
                if len(framing) != 1:
                    break
                name, value = framing[0]
                if name.lower() == b"content-length":
                    if not value.isdigit() or len(value) > 18:  # (a length past int64 is refused: left whole)
                        break
                    stop += int(value)
                elif value.lower() == b"chunked":
                    stop = _chunked_end(data, stop)
                    if stop == _BROKEN:
                        self._e_feed_broken(data, pos, end + 4)
                        return
                    if stop < 0:
                        break
                else:
                    break
            if stop >= size:
                break
            super().data_received(data[pos:stop])
            pos = stop
            messages = self._messages
            if messages and messages[-1][0].__class__ is _ErrInfo:
                return                  # refused: what follows is never read (the connection ends)
            # (empty lines before a request line are none of it, RFC 9112 §2.2)
            head = data[pos:pos + _LINE_KEEP].lstrip(b"\r\n")
            if head:
                if self._e_heads is None:
                    self._e_heads = {}
                self._e_heads[self._e_parsed + 1] = head
        super().data_received(data[pos:] if pos else data)

    def _e_feed_broken(self, data: bytes, pos: int, body: int) -> None:
        """A chunked request whose framing breaks in this read (``data[pos:body]`` its head): the
        head is fed alone, then its body, so the parser reads the request and then the body's fault,
        as when the body comes in a later read; fed whole, the parser refused the read as a head it
        could not parse (the request's id and path unknown to the answer). The fault, which the
        parser queues as a next request's, is set on the request's body, whose handler answers it
        (``EdgeServer``'s 400 ``bad_body``) and closes the connection."""
        super().data_received(data[pos:body])
        messages = self._messages
        if not messages or messages[-1][0].__class__ is _ErrInfo:
            return
        payload = messages[-1][1]
        super().data_received(data[body:])
        last = messages[-1][0] if messages else None
        if last.__class__ is _ErrInfo and not payload.is_eof() and payload.exception() is None:
            payload.set_exception(last.exc)

    # -- the fast lane (gateway/server/lane.py) ----------------------------------------------

    def _lane_take(self, data: bytes) -> bool:
        """Run ``data`` on the fast lane when it is one plain request (or hold it when its body is
        still coming) and the connection has nothing of aiohttp's in flight; False leaves it to
        aiohttp."""
        if not self._lane_open(begun=False):
            return False
        lim = self._edge.limits
        got = self._lane_parse(data, self._lane_server.lane_paths, self._lane_server.lane_max_head, lim.max_headers,
                               lim.max_body_bytes or float("inf"))
        if got is None:
            return False
        if got.__class__ is tuple:              # one whole request: the usual read, checked first
            self._lane_start(got)
        elif got.__class__ is lane.Pending:
            self._lane_wait(got, lim)
        else:                                   # a Split: what follows waits its turn, as if it came meanwhile
            self._lane_start(got.first)
            rest = got.rest.lstrip(b"\r\n")    # empty lines after a body are no next request (RFC 9112 §2.2)
            if rest:
                self._e_pipelined = True
                self._lane_held.append(rest)
        return True

    def _lane_open(self, begun: bool) -> bool:
        """Whether the connection may run a request on the lane: nothing of aiohttp's in flight, not
        closing. ``begun``: the request's head came before a graceful stop began, which then waits
        for it (as for a request of aiohttp's)."""
        return not (self._messages or self._e_parsed != self._e_started or self._payload_parser is not None
                    or self._upgraded or (self._force_close and not begun) or self._close or self.transport is None)

    def _lane_start(self, got: lane.Parsed, head_read: float | None = None) -> None:
        """``head_read``: when the head of a request the lane held came (``lane.LaneRequest.head_read``)."""
        path, headers, body, keep_alive = got
        request = self._lane_request(path, headers, body, keep_alive and not self._edge.draining, self, head_read)
        self._request_count += 1            # parsed and started, as aiohttp counts its own
        self._e_started += 1
        self._e_pipelined = False
        self._e_request = request
        self._e_payload = None
        self._e_line = b""
        self._e_phase = _BUSY
        self._next_keepalive_close_time = self._e_loop.time() + 10.0 ** 9    # aiohttp's backstop waits
        self._lane = request
        self._edge.lane_requests += 1
        self._request_in_progress = True    # a graceful shutdown waits for it (aiohttp's shutdown)
        handler = self._lane_server.direct[path]
        task = self._lane_task
        if task is None or task.done():
            request.task = self._lane_task = self._e_loop.create_task(self._lane_serve(request, handler))
            return
        request.task = task                 # the connection's lane task runs it next
        self._lane_next = (request, handler)
        wake = self._lane_wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def _lane_wait(self, pending: lane.Pending, lim: EdgeLimits) -> None:
        """Hold a lane request whose whole head came and part of its body (a client that writes them
        apart, as the openai SDK's httpx does), to take it on the lane once the rest is in. The
        body's clocks run meanwhile, as they would for aiohttp's request."""
        self._lane_part = pending
        lifecycle = self._edge.lifecycle
        if lifecycle is not None:           # in flight: the drain waits for it, its cut answers it (``lane_cut``)
            lifecycle.enter()
        # the request's line counts from here (its handler starts once the body is in, and takes
        # this time instead of reading the clock itself)
        pending.head_read = time.perf_counter()
        self._e_phase = _HEAD               # a head came (from a kept-alive connection's idle too)
        self._request_in_progress = True    # a graceful stop waits for it, as for aiohttp's requests
        now = self._e_last_rx = self._e_loop.time()
        self._e_body_end = now + lim.body_total_timeout_s if lim.body_total_timeout_s else float("inf")
        self._next_keepalive_close_time = now + 10.0 ** 9    # aiohttp's backstop takes it for idle
        deadline = self._e_body_deadline()
        if deadline != float("inf"):
            self._e_arm(deadline)

    def _lane_more(self, data: bytes) -> None:
        """More of a held request: on the lane once it is whole; aiohttp's, with every byte so far,
        when more came than its length (a next request behind it) or the lane declines it."""
        pending = self._lane_part
        assert pending is not None
        self._e_last_rx = self._e_loop.time()
        got = pending.more(data, self._edge.limits.max_body_bytes or float("inf"))
        if got is pending:
            return
        if got is not None and self._lane_open(begun=True):
            self._lane_start(got, pending.head_read)     # a graceful stop waits on for it (``_lane_serve``)
            self._lane_unhold(handed=True)              # (after its handler's turn was set)
            return
        self._lane_unhold()
        self._lane_released()
        self._e_rx_head = True
        self._e_line = bytes(pending.data[:_LINE_KEEP])
        parsed = self._e_parsed
        self._e_feed(bytes(pending.data))
        if self._e_parsed != parsed:
            self._e_phase = _READY

    def _lane_stalled(self, now: float) -> None:
        """The body of a held request stopped coming: the deadline moves with each read, and when
        it passes the client gets the 408 aiohttp's request would get."""
        self._e_deadline = self._e_body_deadline()
        if now < self._e_deadline:
            self._e_arm(self._e_deadline)
            return
        pending = self._lane_unhold()
        rid = pending.rid if pending is not None else None
        self._lane_released()
        reason = "body_total" if now >= self._e_body_end else "body"
        # its head came whole with the first read the lane held (``_lane_wait``), which started the body's clock
        total = self._edge.limits.body_total_timeout_s
        self._e_timeout(reason, answer=True, request_id=request_id_from(rid),
                        path=pending.path if pending is not None else None,
                        headers=pending.headers if pending is not None else None, method="POST", given=rid,
                        started=self._e_since(self._e_body_end - total) if total else None)

    def _lane_released(self) -> None:
        """No lane request is in progress any more (answered, let go, timed out, or its client
        gone): a graceful stop waiting for it goes on."""
        self._request_in_progress = False
        waiter = self._handler_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _lane_unhold(self, handed: bool = False) -> lane.Pending | None:
        """The request the lane held for its body, no longer held (None: none was): out of the
        requests in flight it was counted in (``_lane_wait``). ``handed``: a handler, just given its
        turn, takes it on and counts it itself as it starts: it leaves them after that turn, so
        that no drain finds none in flight meanwhile."""
        pending, self._lane_part = self._lane_part, None
        lifecycle = self._edge.lifecycle
        if pending is not None and lifecycle is not None:
            if handed:
                self._e_loop.call_soon(lifecycle.leave)
            else:
                lifecycle.leave()
        return pending

    def lane_cut(self) -> bool:
        """The gateway's stop cuts the request the lane holds for its body (``EdgeServer.cut_held``):
        its handler runs now on a body whose read is the cut (``lane.LeftBody``), as aiohttp's
        request reading its body is cancelled, and answers the 503 of a gateway shutting down on the
        connection, which then closes. Returns whether there was one."""
        if self._lane_part is None or self.transport is None:
            return False
        pending = self._lane_part
        self._lane_start((pending.path, pending.headers, b"", False), pending.head_read)
        self._lane_unhold(handed=True)
        request = self._lane
        request.content = lane.LeftBody()
        request.content_length = pending.need - pending.start
        return True

    async def _lane_serve(self, request: Any, handler: Any) -> None:
        """The connection's lane task: its lane requests one after the other, as aiohttp runs a
        connection's requests in one task. A task made per request cost tens of µs at low load
        (cold caches); waking this one costs a future. It ends with the connection (cancelled by
        ``connection_lost``, as a request's handler is when its client goes away)."""
        loop = self._e_loop
        # this task, looked up once (the loop named: without it asyncio looks the running loop up, a
        # getpid() system call)
        me = asyncio.current_task(loop)
        while True:
            # one request, in this frame (no coroutine of its own to start and resume)
            keep = False
            try:
                resp = await handler(request)
                if not isinstance(resp, WrittenAnswer) and isinstance(resp, web.Response):
                    resp = _written(request, resp)  # an answer from outside the pipeline (the error middleware's)
                if isinstance(resp, WrittenAnswer):
                    await resp.write_eof()          # a stream's last chunk, when the relay left it
                    keep = resp.keep_alive
                # else: nothing could be written, which only a closing transport prevents
            except Exception as e:     # the direct handler answers what the pipeline raises; this is a bug
                log.error("internal error", path=request.path, exc_info=e)
            finally:
                self._lane_released()
                if self._lane is request:
                    self._lane = None
                    # a request the stop cut while its body came (``lane_cut``): the rest is dropped
                    self._lane_done(keep, linger=request.content.__class__ is lane.LeftBody)
            if self._lane_next is None:
                if self.transport is None or self._lane_task is not me:
                    return
                wake = self._lane_wake = loop.create_future()
                try:
                    await wake
                finally:
                    self._lane_wake = None
            nxt, self._lane_next = self._lane_next, None
            if nxt is None:
                return
            request, handler = nxt

    def _lane_done(self, keep: bool, linger: bool = False) -> None:
        """``linger``: the client may still be sending the request just answered."""
        self._e_request = None
        if not keep or self.transport is None or self._force_close or self._close \
                or (self._edge.draining and not self._e_drain_next(keep, bool(self._lane_held))):
            if linger:
                self._e_lingering()
            self.force_close()
            return
        self._next_keepalive_close_time = self._e_loop.time() + self._keepalive_timeout
        self._e_after_request()
        held = self._lane_held
        if held:                        # (none, mostly: the list is kept)
            self._lane_held = []
            self.transport.resume_reading()
            # they begin the next request, which the lane may take too: a client that sends it as
            # soon as the last byte of its answer arrives finds the request's own bookkeeping still
            # running (an SGLang P/D stream ends in its relay's task, a loop turn before the
            # handler's), and aiohttp's path costs such a request ~0.3 ms at low load
            self._e_rx_head = False
            self.data_received(b"".join(held))

    def e_drain(self, close_idle: bool) -> bool:
        """The gateway stops: a connection busy with an answer closes after it (``Connection: close``
        on it while its head is still to go out, ``_e_closing``); with ``close_idle`` an idle
        kept-alive connection closes now, silently, as at its keep-alive timeout. Returns whether it
        closed an idle connection."""
        if self.transport is None:
            return False
        if close_idle and self._e_phase == _IDLE and self._lane is None and self._lane_part is None and not self._messages \
                and not self._request_in_progress:
            self._e_close()
            return True
        request = self._e_request
        if request is not None:
            _e_closing(request)
        return False

    def pause_reading(self) -> None:
        self._e_read_paused = True
        super().pause_reading()

    def resume_reading(self, resume_parser: bool = True) -> None:
        self._e_read_paused = False
        if self._e_phase == _BODY:
            self._e_last_rx = self._e_loop.time()
        super().resume_reading(resume_parser)

    # -- requests ----------------------------------------------------------------------------

    def e_request_started(self, request: web.BaseRequest, payload: Any, unparsed: bool = False) -> None:
        """Called by ``EdgeServer``'s request factory as the handler is about to run; ``unparsed``:
        the request stands for a head or body aiohttp could not parse (its handler is ``handle_error``)."""
        self._e_started += 1
        self._e_rx_head = False
        self._e_request = request
        self._e_payload = payload
        self._e_unparsed = unparsed
        if self._edge.draining:
            _e_closing(request)
        if not unparsed:                # its head parsed: the next head's bytes are kept anew (or were: ``_e_feed``)
            heads = self._e_heads
            self._e_line = heads.pop(self._e_started + 1, b"") if heads else b""
        # part of the head after this request came while the one before it ran (with this one, or
        # after it): the next head is coming already, its clock runs once this one is answered
        self._e_pipelined = (self._e_next_head or bool(self._e_line) and not unparsed) \
            and self._e_parsed == self._e_started
        if not self._e_pipelined:
            self._e_head_rx = 0
        self._e_next_head = False
        if payload.is_eof():
            self._e_phase = _BUSY
            return
        # the body is still coming: its bytes are this request's, with or without a clock on them
        # (were the connection taken for idle once the answer is out, the lane would read them as a
        # next request while aiohttp's parser reads them as the body it discards)
        self._e_phase = _BODY
        chunked = _chunked_body(request)
        self._e_framed, self._e_framed_from = 0, payload.total_bytes if chunked else -1
        lim = self._edge.limits
        now = self._e_last_rx = self._e_loop.time()
        self._e_body_end = now + lim.body_total_timeout_s if lim.body_total_timeout_s else float("inf")
        deadline = self._e_body_deadline()
        if deadline != float("inf"):
            self._e_arm(deadline)

    async def finish_response(self, request: web.BaseRequest, resp: web.StreamResponse,
                              start_time: float | None) -> tuple[web.StreamResponse, bool]:
        # the connection closes after this answer (``e_drain``), or after the next one (``_e_drain_next``)
        if self._edge.draining and not self._e_drain_next(resp.prepared and resp.keep_alive, bool(self._messages)):
            if isinstance(resp, web.StreamResponse):
                resp.force_close()
            else:                       # a WrittenAnswer
                resp.keep_alive = False
        try:
            out = await super().finish_response(request, resp, start_time)
            if resp.keep_alive and request.version == HttpVersion10 and _unframed(request, resp):
                resp.force_close()
            if not out[1] and not resp.keep_alive:
                if not request.content.is_eof():
                    self._e_half_close()        # aiohttp reads and drops the rest of the body
                elif resp.status >= 400 and (self._e_unparsed or request.content.exception() is not None
                                             or _VERSION_REFUSED in request):
                    # a head it could not parse, a body whose framing broke, a request line in
                    # HTTP/2.0 (a client's frames follow it): what the client still sends is no
                    # request aiohttp reads, and it closes next
                    self._e_lingering()
            return out
        finally:
            self._e_request = None
            payload = self._e_payload
            # a body still arriving keeps its clock (aiohttp reads and drops it after the answer)
            if self._e_phase != _BODY or payload is None or payload.is_eof():
                self._e_after_request()

    def _e_drain_next(self, kept_alive: bool, queued: bool) -> bool:
        """During the drain, whether the connection stays open after an answer for the next request:
        when the answer's head went out kept alive (``kept_alive``: it was under way when the drain
        began) and bytes of a next request were read meanwhile (``queued``: a parsed one, or
        ``_e_pipelined``). Its client was told nothing of a close, so that request gets its own
        answer, with ``Connection: close`` (``e_request_started``, ``_lane_start``), rather than being
        dropped with the connection: the client could not tell whether it was served, nor send a
        POST again blindly (RFC 9112 §9.3.1). An answer that says ``Connection: close`` ends the
        connection, and a request pipelined behind it is not read (RFC 9112 §9.6): its client knows
        it was not served."""
        return kept_alive and (queued or self._e_pipelined)

    def _e_framing(self, n: int, payload: Any) -> bool:
        """Whether the chunked body being read, ``n`` more of its bytes read, has more framing than
        RFC 9112 §7.1.1 lets a server take: the bytes read since its handler started, less the data
        they carried (the body's bytes as the parser gives them: decoded, with a content coding,
        so a compressed body only looks leaner), past ``CHUNK_FRAMING_PER_BYTE`` per byte of data
        and ``CHUNK_FRAMING_SLACK``. The parser reads a chunk's size line, its extensions, at any
        length, and no body limit counts them."""
        self._e_framed += n
        data = payload.total_bytes - self._e_framed_from
        return self._e_framed - data > CHUNK_FRAMING_SLACK + CHUNK_FRAMING_PER_BYTE * data

    def _e_half_close(self) -> None:
        """An answer that closes the connection while the request's body is still coming (a 413 to
        a told length, a refusal at the head): the answer is whole, so the write side ends now and
        the client reads the end of the connection right behind it. The read side stays open while
        aiohttp reads and drops what the client still sends (its lingering read), so the close that
        follows does not reset the connection under an answer the client has not read yet; a
        client that closes its side ends it at once (connection_lost)."""
        transport = self.transport
        if transport is not None and not transport.is_closing() and transport.can_write_eof():
            try:
                transport.write_eof()
            except OSError:             # the client is gone already: connection_lost follows
                pass

    def _e_body_done(self) -> None:
        self._e_phase = _BUSY
        if self._e_request is None:     # answered while the body was arriving
            self._e_after_request()

    def _e_after_request(self) -> None:
        if self.transport is None:
            return
        if self._e_parsed > self._e_started:
            self._e_phase = _READY      # a head read while the last one ran: its turn starts now
            self._e_head_at = self._e_loop.time()
        elif self._e_pipelined:         # part of the next head is here already: its clock starts now
            held = self._e_head_rx
            self._e_enter_head(self._e_loop.time())
            self._e_rx_head = True
            self._e_head_rx = held
            bound = self._edge.limits.head_bytes
            if bound and held > bound:
                self._e_head_too_large()
        else:
            self._e_phase = _IDLE
            keepalive = self._edge.limits.keepalive_timeout_s
            if keepalive:
                self._e_arm(self._e_loop.time() + keepalive)

    # -- clocks ------------------------------------------------------------------------------

    def _e_enter_head(self, now: float) -> None:
        self._e_phase = _HEAD
        self._e_head_at = now
        self._e_rx_head = False
        self._e_head_rx = 0
        self._e_next_head = False
        if self._edge.limits.header_timeout_s:
            self._e_arm(now + self._edge.limits.header_timeout_s)

    def _e_body_deadline(self) -> float:
        gap = self._edge.limits.body_timeout_s
        return min(self._e_last_rx + gap if gap else float("inf"), self._e_body_end)

    def _e_arm(self, deadline: float) -> None:
        """Move the one deadline; a later one is picked up when the armed timer fires."""
        self._e_deadline = deadline
        timer = self._e_timer
        if timer is not None:
            if self._e_timer_at <= deadline:
                return
            timer.cancel()
        self._e_timer_at = deadline
        self._e_timer = self._e_loop.call_at(deadline, self._e_fire)

    def _e_fire(self) -> None:
        self._e_timer = None
        if self.transport is None:
            return
        now = self._e_loop.time()
        if self._lane_part is not None:
            self._lane_stalled(now)
            return
        phase = self._e_phase
        if phase == _BODY:
            payload = self._e_payload
            if payload is None or payload.is_eof() or payload.exception() is not None:
                self._e_body_done()
                return
            if self._e_read_paused:     # the body waits on the handler, not on the client
                self._e_last_rx = now
            self._e_deadline = self._e_body_deadline()
        if phase in (_READY, _BUSY):
            return
        if now < self._e_deadline:
            self._e_arm(self._e_deadline)
            return
        if phase == _IDLE:
            self._e_timeout("keepalive", answer=False)
        elif phase == _HEAD:
            self._e_timeout("header", answer=self._e_rx_head)
        else:
            total = now >= self._e_body_end
            self._e_timeout("body_total" if total else "body", answer=True)

    def _e_unanswered_request_id(self) -> str | None:
        """The request id when the running request has sent nothing of a response, else None."""
        request = self._e_request
        if request is None or request.writer.output_size > 0 or self.transport is None:
            return None
        return request_id_from(given_request_id(request.headers))

    def _e_request_path(self) -> str | None:
        request = self._e_request
        return request.path if request is not None else None

    # -- the request log of the edge's own answers ---------------------------------------------

    def _e_since(self, at: float) -> float:
        """``at``, a time of the loop's clock (the edge's clocks), on ``time.perf_counter``'s (the
        request log's durations), never later than now."""
        return time.perf_counter() - max(0.0, self._e_loop.time() - at)

    def e_head_started(self) -> float:
        """When the head of the request in turn began, on the request log's clock: its head clock's
        start, which the edge keeps anyway (the accept of a fresh connection, the first byte of a
        kept-alive connection's next request, the end of the last request for one whose head was
        read while it ran). Read only for an answer the edge, the router or the error middleware
        make themselves, not for a request served."""
        return self._e_since(self._e_head_at)

    def _e_logged_running(self, request: web.BaseRequest, rid: str, status: int, message: str) -> None:
        """The line of the edge's answer to ``request``, whose handler ``_e_close`` cancels next: the
        pipeline's writes it as the request's line (gateway/pipeline/context.py ``take_edge_answer``),
        with what the pipeline knows of it; another handler's, the edge once the handler ended."""
        started = self.e_head_started()
        request[EDGE_ANSWER] = (rid, status, message)

        def unclaimed(_: Any = None) -> None:
            if request.pop(EDGE_ANSWER, None) is not None:
                self._e_logged(rid, given_request_id(request.headers), request.method, request.path, status,
                               message, request, started)

        task = request.task
        if task is None or task.done():
            unclaimed()
        else:
            task.add_done_callback(unclaimed)

    def _e_logged(self, rid: str, given: str | None, method: str | None, path: str | None, status: int,
                  message: str, request: web.BaseRequest | None = None, started: float | None = None) -> None:
        """The request log line of an answer the edge writes itself (``log_edge_answer``): ``method``
        and ``path`` as far as the edge read them (None: not known), ``given`` the client's request id,
        its duration from ``started`` (``e_head_started`` by default), with ``request``'s log fields
        (``cors``) when its head was read."""
        request_log = self._edge.request_log
        if request_log is not None:
            log_edge_answer(rid, given, path, method, status, message,
                            self.e_head_started() if started is None else started, request_log,
                            extra=getattr(request, "log_fields", None))

    def _e_cors(self, headers: Any, path: str | None) -> str:
        """CORS's header lines for the edge's own answer to a request whose head was read
        (``headers``; None: none was), when CORS is on; ``Vary: Origin`` alone for a path outside
        the API."""
        edge = self._edge
        cors = edge.cors
        if cors is None or headers is None:
            return ""
        api = path is not None and is_api_path(path, edge.cors_api)
        return head_lines(cors, headers.get(hdrs.ORIGIN) if api else None)

    def _e_broken_body(self, message: str = "malformed request body: its chunked framing or content encoding "
                       "is broken") -> None:
        self._edge.metrics.protocol_errors.labels("400").inc()
        rid = self._e_unanswered_request_id()
        log.debug("bad request", status=400, error="broken request body", peer=_peer(self.transport))
        if rid is not None:
            request = self._e_request
            self.transport.write(error_response_bytes(
                400, message, code="bad_body", request_id=rid, path=self._e_request_path(),
                cors=self._e_cors(request.headers if request is not None else None, self._e_request_path()),
                headers=request.headers if request is not None else None))
            if request is not None:
                self._e_logged_running(request, rid, 400, message)
        self._e_close(linger=True)

    def e_undecodable(self, request: web.BaseRequest, exc: BaseException) -> bool:
        """``request``'s body, in x-gzip (``XGzipBody``), does not decode as its handler reads it: the
        answer a gzip body that does not decode gets from the parser (``_e_broken_body``: the 400,
        the connection closed, the handler cancelled). False when ``request`` is not the one running
        on a live connection (nothing done)."""
        if self.transport is None or self._e_request is not request:
            return False
        self._e_broken_body(f"malformed request body: {_cause_text(exc)}")
        return True

    def _e_timeout(self, reason: str, *, answer: bool, request_id: str | None = None,
                   path: str | None = None, headers: Any = None, method: str | None = None,
                   given: str | None = None, started: float | None = None) -> None:
        """``headers``, ``method``, ``given`` (its ``x-request-id``) and ``started`` (``e_head_started``'s
        clock): those of a held lane request (``_lane_stalled``); otherwise a body's timeout reads the
        running request's, and a head's has none (it never came whole: its method and path are read
        off its first bytes)."""
        edge = self._edge
        edge.metrics.timeout(reason)
        rid = request_id
        if reason in ("body", "body_total") and rid is None:    # only while nothing of a response went out
            rid = self._e_unanswered_request_id()
            answer = rid is not None
        # an idle kept-alive connection's close ends no request, nor does that of a fresh one that
        # never sent a byte of a head (a client's spare pooled connection, a port probe): one line
        # each at info would fill a busy gateway's log with its idle clients. A head begun and
        # stalled (answered) is a slow or hostile client's: at info.
        quiet = reason == "keepalive" or (reason == "header" and not answer)
        (log.debug if quiet else log.info)("client timeout", reason=reason, peer=_peer(self.transport),
                                           answered=answer)
        if answer and self.transport is not None:
            lim = edge.limits
            seconds = {"header": lim.header_timeout_s, "body": lim.body_timeout_s,
                       "body_total": lim.body_total_timeout_s}[reason]
            what = {"header": "the request head was not received within",
                    "body": "no byte of the request body arrived for",
                    "body_total": "the request body was not received within"}[reason]
            request = self._e_request if reason != "header" else None
            if headers is None and request is not None:
                headers = request.headers
            message = f"{what} {seconds:g} s (server.{reason}_timeout_s)"
            path = path or self._e_request_path()
            rid = rid or request_id_from(None)
            self.transport.write(error_response_bytes(
                408, message, code="request_timeout", request_id=rid, path=path, cors=self._e_cors(headers, path),
                headers=headers))
            if request is not None and method is None:
                self._e_logged_running(request, rid, 408, message)
            else:
                if reason == "header":
                    method, path = self._e_line_method(), self._e_line_path()
                self._e_logged(rid, given, method, path, 408, message, None, started)
        # a body's client may still be sending it (one too slow in all is, most often): the answer
        # is read whole before the close; a head's, which sent too little, closes at once
        self._e_close(linger=answer and reason != "header")

    def _e_head_too_large(self) -> None:
        """A head still coming past ``EdgeLimits.head_bytes``: more than a head whose header section
        is within ``server.max_header_total_bytes`` holds. Answered 431 as a whole head over the bound
        is (``headers_too_large``), at once rather than when it ends or its clock runs out: the parser
        holds every byte of a head until its end, up to ``max_headers`` fields of ``max_header_bytes``
        (1.6 MB by default) a connection. The client may still be sending it: the close lingers."""
        if self.transport is None or self.transport.is_closing():
            return
        edge = self._edge
        limit = edge.limits.max_header_total_bytes
        edge.metrics.protocol_errors.labels("431").inc()
        message = f"the request's header fields are larger than {limit} bytes in all (server.max_header_total_bytes)"
        rid = request_id_from(None)
        path = self._e_line_path()
        self.transport.write(error_response_bytes(431, message, code="header_too_large", request_id=rid, path=path))
        self._e_logged(rid, None, self._e_line_method(), path, 431, message)
        self._e_close(linger=True)

    def _e_close(self, linger: bool = False) -> None:
        """Close as aiohttp's own keep-alive timer does (the transport flushes what was written,
        then closes) and cancel a running handler at once, as a client disconnect does: were it
        left to connection_lost, a handler woken by the broken body would first see the parser's
        exception and take it for a fault of its own. A request answered before its body came
        whole has that body read and dropped by aiohttp (its lingering read): the body is ended
        here, so that the read, woken by the bytes that just came, ends with it instead of meeting
        the connection ``force_close`` took away (a RuntimeError aiohttp logs as an unhandled
        exception, with its traceback, before connection_lost would have cancelled it). ``linger``:
        the client may still be sending the refused request (``_e_lingering``)."""
        request = self._e_request
        payload = self._e_payload
        if linger:
            self._e_lingering()
        self.force_close()
        if request is not None and request.task is not None and not request.task.done():
            request.task.cancel()
        elif request is None and payload is not None and not payload.is_eof():
            payload.feed_eof()

    def _e_lingering(self) -> bool:
        """Close the connection after the answer written to it lingering (``_Linger``): its write
        side ends now, and what the client still sends of the refused request is read and dropped
        for a bounded while before the close. The connection is aiohttp's no more (its ``transport``
        None, as after a close: nothing is written to it, and its ``force_close`` closes nothing);
        it ends as a connection does, with ``connection_lost``, when the linger closes it. False
        when the connection cannot end its write side (it is closing already): it closes as it would."""
        transport = self.transport
        if transport is None or transport.is_closing() or not transport.can_write_eof():
            return False
        try:
            transport.write_eof()           # after what was written, as the buffer empties
        except OSError:                     # the client is gone already: connection_lost follows
            return False
        max_body = self._edge.limits.max_body_bytes
        self._e_linger = _Linger(self, transport, self._e_loop, max_body + LINGER_SLACK if max_body else float("inf"))
        self.transport = None
        return True

    async def shutdown(self, timeout: float | None = 15.0) -> None:
        """aiohttp's, and a lingering close (``_e_lingering``) given up to ``timeout`` to end (the
        client reading the answer the stop's cut gave it) before the connection closes."""
        linger = self._e_linger
        if linger is not None and not linger.done.done():
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.shield(linger.done)
            except TimeoutError:
                pass
            linger.close()
        await super().shutdown(timeout)

    def pause_writing(self) -> None:
        super().pause_writing()
        stall = self._edge.limits.write_stall_timeout_s
        if stall and self._e_stall is None:
            self._e_taken = _taken(self.transport)
            self._e_stall = self._e_loop.call_later(stall, self._e_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._e_stall is not None:
            self._e_stall.cancel()
            self._e_stall = None

    def _e_stalled(self) -> None:
        self._e_stall = None
        transport = self.transport
        if transport is None or not self.writing_paused:
            return
        taken = _taken(transport)
        if taken > self._e_taken >= 0:
            # the client took bytes within the bound: it reads, slower than its answer is written,
            # and is given the bound again
            self._e_taken = taken
            self._e_stall = self._e_loop.call_later(self._edge.limits.write_stall_timeout_s, self._e_stalled)
            return
        self._edge.metrics.timeout("write_stall")
        log.info("client timeout", reason="write_stall", peer=_peer(transport), answered=False)
        transport.abort()               # → connection_lost: the handler is cancelled, as on a disconnect

    def watch_stream(self) -> None:
        """A stream's answer began: its handler holds an engine's request for as long as it runs.
        The write-stall clock above runs only once the kernel's send buffer is full, which an
        engine writing at a steady pace fills only after minutes (Linux grows it up to
        ``net.ipv4.tcp_wmem``, 4 MB); so the stream's client is looked at every
        ``write_stall_timeout_s``, and one that took no byte in a whole period while bytes waited
        for it in that buffer is cut as a stalled client is."""
        stall = self._edge.limits.write_stall_timeout_s
        if not stall or self.transport is None:
            return
        watch = self._e_watch
        if watch is not None:
            if self._e_watch_of == self._e_started:
                return
            watch.cancel()              # the look at an earlier stream of the connection, which ended
            self._e_watch = None
        if _taken(self.transport) < 0:
            return
        self._e_watch_of = self._e_started
        self._e_watch_mark = -1
        self._e_watch = self._e_loop.call_later(stall, self._e_watched)

    def _e_watched(self) -> None:
        self._e_watch = None
        transport = self.transport
        if transport is None or self._e_started != self._e_watch_of or self._e_phase not in (_BODY, _BUSY):
            return                      # the stream ended
        taken = _taken(transport)
        waiting = _waiting(transport)
        if taken < 0 or waiting < 0:
            return
        if taken == self._e_watch_mark:
            # bytes waited for the client a whole period ago, and it took none of them since
            self._edge.metrics.timeout("write_stall")
            log.info("client timeout", reason="write_stall", peer=_peer(transport), answered=False)
            transport.abort()           # → connection_lost: the handler is cancelled, as on a disconnect
            return
        self._e_watch_mark = taken if waiting else -1
        self._e_watch = self._e_loop.call_later(self._edge.limits.write_stall_timeout_s, self._e_watched)

    def _e_cancel_timers(self) -> None:
        for t in (self._e_timer, self._e_stall, self._e_watch):
            if t is not None:
                t.cancel()
        self._e_timer = self._e_stall = self._e_watch = None

    # -- errors aiohttp answers itself ---------------------------------------------------------

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp: a response is half out, only a close is left
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        edge = self._edge
        if isinstance(exc, BadHttpMethod) and self._e_unparsed:
            line = self._e_line
            m = _LINE_METHOD.match(line)
            end = line.find(b"\r\n")
            if m is not None and (end < 0 or _LINE_WHOLE.fullmatch(line, 0, end) is not None):
                # a token, but no method the parser knows: none the gateway implements
                return self._e_not_implemented(request, m.group(1).decode("ascii"))
        status, text, code = edge.classify(status, exc, message)
        if status == 431 and isinstance(exc, LineTooLong) and self._e_unparsed and self._e_long_target(exc):
            status, code = 414, "uri_too_long"
            text = f"the request-target is longer than {edge.limits.max_header_bytes} bytes (server.max_header_bytes)"
        edge.metrics.protocol_errors.labels(str(status)).inc()
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        else:
            log.debug("bad request", status=status, error=text, peer=request.remote)
        given = given_request_id(request.headers)
        rid = request_id_from(given)
        path = self._e_line_path() if self._e_unparsed else request.path
        headers = {"request-id": rid, "x-request-id": rid}
        param = None
        if status == 415:
            headers[hdrs.ACCEPT_ENCODING], param = ACCEPT_ENCODING, "Content-Encoding"
        shaped = _shaped_body(path, status, text, _error_type(status), code, param,
                              None if self._e_unparsed else request.headers)
        resp = error_response(status, shaped, headers)
        resp.force_close()
        if self._e_unparsed:
            self._e_logged(rid, None, self._e_line_method(), path, status, text)
        else:
            self._e_logged(rid, given, request.method, path, status, text, request)
        return resp

    def _e_long_target(self, exc: LineTooLong) -> bool:
        """Whether the line the parser found too long is the request line's target (RFC 9112 §3: a
        414, where a header field's is a 431): the request line does not end within the head's
        kept first bytes (``_e_line``), and the line the parser quotes (its first 100 bytes) is the
        start of the target there."""
        line = self._e_line
        quoted = exc.args[0] if exc.args else None
        if b"\r\n" in line or not isinstance(quoted, bytes | bytearray) or not quoted.endswith(b"..."):
            return False
        space = line.find(b" ")
        start = bytes(quoted[:-3])
        return space > 0 and bool(start) and line.startswith(start, space + 1)

    def _e_not_implemented(self, request: web.BaseRequest, method: str) -> web.Response:
        """The 501 of a method the HTTP parser stopped at (it knows every method a route serves): the
        rest of the request's framing is unknown, so the connection closes after the answer."""
        path = self._e_line_path() or "/"
        rid = request_id_from(None)
        resp = not_implemented_answer(path, method, rid)
        resp.force_close()
        self._e_logged(rid, None, method, path, resp.status, not_implemented_message(method))
        return resp

    def _e_line_method(self) -> str | None:
        """The method of the head kept in ``_e_line``, when its first bytes are a request line's."""
        m = _LINE_METHOD.match(self._e_line)
        return m.group(1).decode("ascii") if m is not None else None

    def _e_line_path(self) -> str | None:
        """The target path of the head kept in ``_e_line`` (a head aiohttp could not parse), as far
        as its first bytes hold it: only the answer's shape is read off it."""
        m = _LINE_PATH.match(self._e_line)
        return m.group(1).decode("latin-1") if m is not None else None


def _closing_error(request: web.BaseRequest, status: int, message: str, code: str,
                   headers: dict[str, str] | None = None, param: str | None = None,
                   type_: str | None = None) -> web.Response:
    rid = request_id_from(given_request_id(request.headers))
    body = _shaped_body(request.path, status, message, type_ or _error_type(status), code, param,   # Anthropic's on its paths
                        request.headers)
    resp = error_response(status, body, {"request-id": rid, "x-request-id": rid, **(headers or {})})
    resp.force_close()      # Connection: close; aiohttp reads and drops an unread body a little while first
    return resp


# aiohttp's stand-in for a head it could not parse (HTTP/1.0, should_close), in HTTP/1.1
_UNPARSED_11 = _UNPARSED._replace(version=HttpVersion11)

# a request's key: the HTTP version it came with, when refused
_VERSION_REFUSED = web.RequestKey("edge_version_refused", tuple)


def version_refused(request: web.BaseRequest, version: Any) -> web.Response:
    """A request line the parser took with a version HTTP/1.x framing does not have: its headers
    and body mean nothing certain, so nothing of it is served."""
    return _closing_error(request, 400, f"malformed HTTP request: the request line's version reads as "
                          f"HTTP/{version[0]}.{version[1]} (a line without one as HTTP/0.9); HTTP/1.0 and "
                          "HTTP/1.1 are served", "bad_request")


def host_refused(request: web.BaseRequest) -> web.Response | None:
    """RFC 9112 §3.2: a request whose ``Host`` is not a valid field value gets a 400 (the parser
    refuses two Host lines, and a missing one in HTTP/1.1, itself). A valid one is a host (a name,
    an IPv4 address, an IP literal in brackets), not empty, and a port of digits (``lane.HOST``):
    an empty Host, one with a space, userinfo or a path names no server this one could be; none of
    it is served, and the connection closes. None: no Host (HTTP/1.0), or a valid one."""
    host = request.headers.get(hdrs.HOST)
    if host is None or lane.HOST.fullmatch(host) is not None:
        return None
    what = f"the Host header {safe_header_value(host)[:64]!r} is not a host[:port]" if host else "the Host header is empty"
    return _closing_error(request, 400, f"malformed HTTP request: {what} (RFC 9112 section 3.2)", "bad_request",
                          param="Host", type_="invalid_request_error")


def connect_refused(request: web.BaseRequest, allow: str) -> web.Response:
    """CONNECT names a host to tunnel to (``evil.example:443``), not a path: never routed, and the
    connection, which the parser put in tunnel mode, is closed after the answer. Its ``Allow`` is
    the server's methods (``methods_served``), as an ``OPTIONS *`` gives them."""
    return _closing_error(request, 405, "method CONNECT is not allowed: the gateway is not a proxy",
                          "method_not_allowed", {"Allow": allow})


_METHOD_ORDER = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def _listed(methods: set[str]) -> str:
    return ", ".join(sorted(methods, key=lambda m: (_METHOD_ORDER.index(m) if m in _METHOD_ORDER else 99, m)))


def methods_served(router: web.UrlDispatcher) -> str:
    """The ``Allow`` of an ``OPTIONS *``: every method a route of ``router`` serves (aiohttp's GET
    routes serve HEAD too), and OPTIONS, which the edge answers for the server as a whole."""
    return _listed({route.method for route in router.routes() if route.method != hdrs.METH_ANY} | {"OPTIONS"})


def api_methods(router: web.UrlDispatcher) -> str:
    """The methods the API's routes (``/v1/...``) serve: a CORS preflight's ``Access-Control-Allow-Methods``."""
    return _listed({route.method for route in router.routes() if route.method != hdrs.METH_ANY
                    and route.resource is not None and route.resource.canonical.startswith("/v1/")})


def server_options(request: web.BaseRequest, allow: str) -> web.Response:
    """RFC 9110 §9.3.7: ``OPTIONS *`` asks about the server in general, not about a resource: a 200
    with the methods it serves and no content; the connection stays open for the next request."""
    rid = request_id_from(given_request_id(request.headers))
    return web.Response(status=200, headers={"Allow": allow, "request-id": rid, "x-request-id": rid})


def expectation_failed(request: web.BaseRequest) -> web.Response | None:
    """RFC 9110 §10.1.1: an ``Expect`` other than ``100-continue`` gets a 417, shaped as every error
    (Anthropic's on a Messages path), the connection closed after it (a body may follow unread).
    None for ``100-continue``, for no (or an empty) ``Expect``, and for HTTP/1.0, where aiohttp
    reads none either. The edge answers it on every path (aiohttp's own answer, given before the
    application's middleware, is plain text without a request id); the inference routes' expect
    handler (gateway/server/app.py) gives the same answer."""
    expect = request.headers.get(hdrs.EXPECT)
    if not expect or request.version != HttpVersion11 or expect.lower() == "100-continue":
        return None
    return _closing_error(request, 417, f"unknown Expect: {safe_header_value(expect)[:64]!r}; only 100-continue "
                          "is served", "expectation_failed", param="Expect")


def _coding_message(coding: str) -> str:
    return (f"the request body's Content-Encoding {safe_header_value(coding)[:64]!r} is not one the gateway "
            f"decodes: send the body in one of {ACCEPT_ENCODING} (Accept-Encoding), or in none")


def coding_refused(request: web.BaseRequest) -> web.Response | None:
    """RFC 9110 §15.5.16: a body in a content coding the gateway does not decode is a 415 naming the
    codings it does (``Accept-Encoding``), shaped as every error, the connection closed after it (the
    body is not read). aiohttp's parser decodes a body whose one ``Content-Encoding`` is one of
    ``DECODED_CODINGS`` and reads any other as if it had none: an unknown coding (``x-foo``), or
    codings stacked in one field or two (``gzip, gzip``), would reach the API as bytes it cannot
    read, or be served as if they were not encoded. ``identity`` (no coding) is taken. ``x-gzip``,
    which RFC 9110 §8.4.1.3 says a recipient SHOULD take as gzip and the parser passes through, is
    given its decoder here (``XGzipBody``). None: served.
    (br or zstd without its decoder never gets here: the parser refuses the head, and the edge's
    ``handle_error`` gives the same 415.)"""
    fields = request.headers.getall(hdrs.CONTENT_ENCODING)
    value = ", ".join(fields)
    applied = [c for c in (p.strip().lower() for p in value.split(",")) if c and c != "identity"]
    if not applied:
        return None
    if len(applied) == 1 and len(fields) == 1 and value.isascii():
        coding = value.strip().lower()
        if coding in DECODED_CODINGS:
            return None
        if coding == "x-gzip" and isinstance(request, web.Request):
            # semi-private: the request's stream (``content``, a reified property, and what ``read``,
            # ``multipart`` and ``release`` read), pinned by tests/unit/gateway/server/test_edge.py
            request._payload = request._cache["content"] = XGzipBody(request.content, request.protocol, request)
            return None
    return _closing_error(request, 415, _coding_message(value), "unsupported_content_encoding",
                          {hdrs.ACCEPT_ENCODING: ACCEPT_ENCODING}, param="Content-Encoding")


def transfer_coding_refused(request: web.BaseRequest) -> web.Response | None:
    """RFC 9112 §6.1: a request in a transfer coding the server does not understand SHOULD get a
    501. The HTTP parser frames a body whose ``Transfer-Encoding`` ends in ``chunked`` and applies no
    other coding listed before it (``gzip, chunked``, ``x-foo, chunked``; two fields it refuses as
    duplicates): such a body would be served as if it had none of them. The gateway decodes only
    ``chunked`` (a compressed body is sent with ``Content-Encoding``); shaped as every error, the
    connection closed after it (the body is not read). None: ``chunked`` alone, in any case (the
    parser refuses every other framing)."""
    value = ", ".join(request.headers.getall(hdrs.TRANSFER_ENCODING))
    if all(c.strip().lower() == "chunked" for c in value.split(",")):
        return None
    return _closing_error(request, 501, f"the request's Transfer-Encoding {safe_header_value(value)[:64]!r} has a "
                          "transfer coding the gateway does not implement: only chunked is (a compressed body "
                          "is sent with Content-Encoding)", "unsupported_transfer_encoding",
                          param="Transfer-Encoding", type_="invalid_request_error")    # the client's doing


class XGzipBody(StreamReader):
    """The body of a request in ``x-gzip``, gzip's old name (RFC 9110 §8.4.1.3: a recipient SHOULD
    consider it equivalent to gzip), which aiohttp's parser passes through as it came (``raw``):
    decoded as the parser decodes a gzip body, by its ``DeflateBuffer`` (at most its read size of
    output at a time, so a bomb is a 413 once the decoded body crosses the limit), on demand: a read
    that finds nothing decoded takes what ``raw`` holds (``_wait``). No task of its own, and nothing
    of ``raw`` is read but by the handler's reads: aiohttp's reading and dropping of a body left
    unread, after the answer, meets ``raw`` as it would a gzip body's. A body that is not gzip gets
    the answer of a gzip body that is not (``EdgeProtocol.e_undecodable``: the edge's 400, the
    connection closed, the handler cancelled, which its read then raises), whatever handler reads
    it; without a connection (or one no longer running ``request``), the parser's error for one
    (``RequestPayloadError``, the cause ``ContentEncodingError``)."""

    __slots__ = ("_raw", "_gzip", "_more", "_request")

    def __init__(self, raw: StreamReader, protocol: Any, request: web.BaseRequest | None = None) -> None:
        low, _ = raw.get_read_buffer_limits()
        super().__init__(protocol, low, loop=asyncio.get_running_loop())
        self._raw = raw
        self._request = request
        self._gzip = DeflateBuffer(self, "gzip", max_decompress_size=low)
        self._more = False              # the decoder holds output past the last read's size
        broken = raw.exception()
        if broken is not None:          # as it came with the head (a chunk size that does not parse)
            self.set_exception(broken)

    async def _wait(self, func_name: str) -> None:
        try:
            if self._more:
                self._more = self._gzip.feed_data(b"", 0)
                return
            chunk = await self._raw.readany()
            if chunk:
                self._more = self._gzip.feed_data(chunk, len(chunk))
            else:
                self._gzip.feed_eof()
        except ContentEncodingError as e:
            broken = web.RequestPayloadError(str(e))
            self.set_exception(broken, e)
            protocol, request = self._protocol, self._request
            if isinstance(protocol, EdgeProtocol) and request is not None and protocol.e_undecodable(request, e):
                # the edge answered and cancelled the handler's task: a read in that task ends in
                # its cancellation here, as the read of a gzip body the parser could not decode does
                # (its handler then logs the edge's answer, not one of its own); a read in another
                # task goes on to the error
                await asyncio.sleep(0)
            raise broken from e
        except Exception as e:          # the body's framing broke, or the client left
            self.set_exception(e)
            raise


def header_bytes(request: web.BaseRequest) -> int:
    """The size of ``request``'s header section as ``server.max_header_total_bytes`` counts it: its
    fields' names and values, and 4 bytes a field for its colon, space and line end."""
    fields = request.raw_headers
    return sum(map(len, map(itemgetter(0), fields))) + sum(map(len, map(itemgetter(1), fields))) + 4 * len(fields)


def headers_too_large(request: web.BaseRequest, limit: int) -> web.Response:
    """A header section over ``server.max_header_total_bytes`` in all, each field within
    ``max_header_bytes``: refused before any engine is asked, whose own bound on the headers the
    request forwards would refuse them with a 400 of its own (an h11 server's 16 KiB head)."""
    return _closing_error(request, 431, f"the request's header fields are larger than {limit} bytes in all "
                          "(server.max_header_total_bytes)", "header_too_large")


def content_length_refused(request: web.BaseRequest) -> web.Response:
    """A ``Content-Length`` of more digits than Python converts to an int (4300: zeros in front of
    a small length, which the parser read as that length): refused as any malformed
    ``Content-Length`` is, where reading it raised in the handler and answered 500."""
    return _closing_error(request, 400, "malformed HTTP request: the Content-Length has too many digits",
                          "bad_request")


def body_too_large(request: web.BaseRequest, limit: int, key: str = "server.max_body_bytes") -> web.Response:
    """A Content-Length above ``server.max_body_bytes`` is refused at once, not after reading it."""
    return _closing_error(request, 413, f"request body exceeds {limit} bytes ({key})",
                          "body_too_large")


def file_too_large(request: web.BaseRequest, limit: int) -> web.Response:
    """An upload whose Content-Length cannot hold a file within ``batch.max_file_bytes``: refused at
    once, with the answer the Files API gives a file found too large as it arrives."""
    return _closing_error(request, 413, f"the file exceeds batch.max_file_bytes ({limit} bytes)",
                          "file_too_large", param="file")


def _peer(transport: asyncio.BaseTransport | None) -> str | None:
    if transport is None:
        return None
    peer = transport.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else None


def _written(request: Any, resp: web.Response) -> WrittenAnswer | None:
    """A ``web.Response`` for a fast-lane request, written whole (its body is bytes: a JSON error)."""
    headers = {k: v for k, v in resp.headers.items() if k not in (hdrs.CONTENT_TYPE, hdrs.CONTENT_LENGTH)}
    body = resp.body if isinstance(resp.body, bytes) else b""
    return write_whole(request, resp.status, headers, resp.content_type, body)


def _declined_upgrade(message: Any) -> bool:
    """A request asking to switch protocols (``Connection: upgrade`` and an ``Upgrade``) to one
    aiohttp does not take up: anything but ``websocket`` (``h2c``, as ``curl --http2`` asks over
    cleartext). The gateway switches to none (RFC 9110 §7.8 lets it answer in HTTP/1.1), but
    aiohttp's parser stops at such a request and drops the bytes behind it in the same read; a
    declined websocket upgrade it parses on from."""
    return message.headers.get(hdrs.UPGRADE, "").strip().lower() != "websocket"


def _cors_factory(make: Any, cls: type[web.Request]) -> Any:
    """The application's request factory, making a request that carries an Origin a ``cls``, and
    one that does not a ``VaryRequest`` (its answers say ``Vary: Origin``)."""
    def factory(message, payload, protocol, writer, task):
        if hdrs.ORIGIN in message.headers:
            return make(message, payload, protocol, writer, task, _cls=cls)
        return make(message, payload, protocol, writer, task, _cls=VaryRequest)
    return factory


def _cors_refusal(request: web.BaseRequest) -> str:
    origin = _short(request.headers.get(hdrs.ORIGIN, ""), 100)
    return f"the origin {origin!r} may not call the API from a browser (server.cors_allowed_origins)"


def cors_refused(request: web.BaseRequest) -> web.Response:
    """A preflight from an origin ``server.cors_allowed_origins`` does not list: a 403 in the path's
    API shape, without CORS's headers, so the browser keeps the page from calling."""
    rid = request_id_from(given_request_id(request.headers))
    body = _shaped_body(request.path, 403, _cors_refusal(request), None, "cors_origin_not_allowed")
    return error_response(403, body, {"request-id": rid, "x-request-id": rid})


def not_implemented_message(method: str) -> str:
    return (f"method {_short(method, 64)} is not implemented by the gateway (an OPTIONS * request lists "
            "the methods it serves)")


def not_implemented_answer(path: str, method: str, rid: str) -> web.Response:
    """RFC 9110 §9.1: a method the gateway does not recognize or implement on any path is a 501, in
    the path's API shape (Anthropic's on a Messages path)."""
    body = _shaped_body(path, 501, not_implemented_message(method), "invalid_request_error", "method_not_implemented")
    return error_response(501, body, {"request-id": rid, "x-request-id": rid})


def log_edge_answer(rid: str, given: str | None, path: str | None, method: str | None, status: int, error: str | None,
                    started: float, request_log: RequestLog, error_class: ErrorClass = ErrorClass.HTTP,
                    extra: dict[str, Any] | None = None) -> None:
    """The request log line of an error answer made before any API handler (an unknown method's 501,
    an unknown path's 404, a method's 405, the edge's own answers): what a request line says of an
    answer without a model or an endpoint, with ``method``; ``rid``, the request id the answer
    carries, ``given`` the client's; ``path`` and ``method`` None when the edge could not read them
    (a head that is no request line); ``started``, on ``time.perf_counter``'s clock (``head_started``)."""
    rec = RequestRecord(rid, path, started, status=status, request_id_replaced=given is not None and given != rid,
                        error_class=error_class, error=error)
    rec.extra["method"] = method
    if extra:
        rec.extra.update(extra)
    log_answer(rec, time.perf_counter(), request_log)


def head_started(request: web.BaseRequest) -> float:
    """When ``request``'s head began, on the request log's clock (``EdgeProtocol.e_head_started``);
    now for a request that came through no edge connection."""
    protocol = request.protocol
    if isinstance(protocol, EdgeProtocol):
        return protocol.e_head_started()
    return time.perf_counter()


def logged_refusal(request: web.BaseRequest, resp: web.Response, request_log: RequestLog | None) -> web.Response:
    """``resp``, an error answer the edge makes for a request whose head it read (its version, a
    ``CONNECT``, its Content-Length, its coding, its Expect), once written to ``request_log``: its
    message read back off its body (``error.message`` in either API's shape)."""
    if request_log is not None:
        try:
            message = orjson.loads(resp.body)["error"]["message"]
        except (TypeError, ValueError, KeyError):
            message = None
        log_edge_answer(resp.headers["request-id"], given_request_id(request.headers), request.path,
                        request.method, resp.status, message, head_started(request), request_log,
                        extra=getattr(request, "log_fields", None))
    return resp


def _log_preflight(request: web.BaseRequest, resp: web.Response, result: str, started: float,
                   request_log: RequestLog) -> None:
    """A preflight's request log line: what a request line says of an answer without a model or an
    endpoint, with ``method`` (OPTIONS) and ``cors`` (``preflight_allowed``, ``preflight_refused``);
    its request id is the one its answer carries."""
    given = given_request_id(request.headers)
    rid = resp.headers.get("request-id") or request_id_from(given)
    rec = RequestRecord(rid, request.path, started, status=resp.status,
                        request_id_replaced=given is not None and given != rid)
    if resp.status >= 400:
        rec.error_class, rec.error = ErrorClass.CLIENT, _cors_refusal(request)
    rec.extra["method"] = request.method
    rec.extra["cors"] = result
    log_answer(rec, time.perf_counter(), request_log)


def _cors_preflights(handler: Any, cors: CorsPolicy, methods: str, direct: dict[str, Any],
                     counted: dict[str, Any], request_log: RequestLog | None = None) -> Any:
    """``handler``, with a preflight to an API path (``/v1/...``, an inference path) answered first
    (and written to ``request_log``), and each request with an Origin (a ``CorsRequest``) counted by
    its outcome (``counted``)."""
    async def request_handler(request: web.BaseRequest) -> web.StreamResponse:
        if isinstance(request, CorsRequest):
            api = is_api_path(request.path, direct)
            result = outcome(cors, request.headers.get(hdrs.ORIGIN), api)     # allowed, refused
            if is_preflight(request):
                if api:
                    started = head_started(request)
                    result = "preflight_" + result
                    counted[result].inc()
                    resp = preflight(request, cors, methods, cors_refused)
                    if request_log is not None:
                        _log_preflight(request, resp, result, started, request_log)
                    return resp
                # a path outside the API: its own 404 or 405, without CORS's headers, and its line
                result = "preflight_refused"
            counted[result].inc()
        return await handler(request)
    return request_handler


class EdgeServer(web.Server):
    """aiohttp's low-level server, making ``EdgeProtocol`` connections."""

    def __init__(self, handler: Any, *, edge: Edge, loop: asyncio.AbstractEventLoop | None = None,
                 direct: dict[str, Any] | None = None, allow: str, cors_methods: str = "", **kwargs: Any) -> None:
        super().__init__(handler, loop=loop, **kwargs)
        self.edge = edge
        self._edge_loop = loop or asyncio.get_running_loop()
        self._edge_handler_kwargs = {k: v for k, v in kwargs.items()
                                     if k not in ("request_factory", "handler_cancellation")}
        inner = plain = self.request_factory
        direct = direct or {}
        cors = edge.cors
        if cors is not None:            # a request with an Origin is a CorsRequest (gateway/server/cors.py)
            edge.cors_api = frozenset(direct)
            inner = _cors_factory(inner, request_class(cors, direct))

        def request_factory(message, payload, protocol, writer, task):
            version = message.version
            if version is not HttpVersion11 and version != HttpVersion11:
                if message is _UNPARSED:
                    # a head the parser refused has no version to answer in: aiohttp's stand-in
                    # message says HTTP/1.0; the answer goes out in HTTP/1.1 (RFC 9110 §6.2), closed
                    # (a plain request: no Origin is known, its answer is the same with CORS on)
                    request = plain(_UNPARSED_11, payload, protocol, writer, task)
                    if isinstance(protocol, EdgeProtocol):
                        protocol.e_request_started(request, payload, True)
                    return request
                if version != HttpVersion10:
                    # the parser takes HTTP/2.0, HTTP/0.9 and a request line without a version (as
                    # 0.9), none of them HTTP/1.x framing: refused, answered in HTTP/1.1 and closed
                    message = message._replace(version=HttpVersion11, should_close=True)
                    request = inner(message, payload, protocol, writer, task)
                    request[_VERSION_REFUSED] = version
                    if isinstance(protocol, EdgeProtocol):
                        protocol.e_request_started(request, payload, False)
                    return request
                if not message.should_close and hdrs.TRANSFER_ENCODING in message.headers:
                    # RFC 9112 §6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing (an
                    # HTTP/1.0 hop before us may have read its body otherwise), so the connection
                    # closes after its answer, whatever its Connection header asked for
                    message = message._replace(should_close=True)
            if message.upgrade and not message.should_close and _declined_upgrade(message):
                # aiohttp's parser drops what came behind such a request in the same read: a
                # request pipelined there would never be answered (the connection left open until
                # keepalive_timeout_s). Closed after the answer, the client sends it again.
                message = message._replace(should_close=True)
            request = inner(message, payload, protocol, writer, task)
            if isinstance(protocol, EdgeProtocol):
                protocol.e_request_started(request, payload, False)
            return request

        self.request_factory = request_factory
        app_handler = self.request_handler
        max_body = edge.limits.max_body_bytes or float("inf")
        max_upload = edge.limits.upload_max_bytes
        max_head_total = edge.limits.max_header_total_bytes
        self.direct = direct
        # the fast lane takes every inference path whose body the pipeline reads whole (chat,
        # completions, embeddings, Messages, Responses, the JSON pass-through paths); not the audio
        # uploads, whose API reads a multipart body piece by piece
        self.lane_paths = ({p.encode(): p for p in direct if p not in AUDIO_PATHS}
                           if edge.limits.fast_lane else {})
        self.lane_parse = lane.parse if cors is None else functools.partial(lane.parse, decline=lane.CORS_DECLINE)
        self.lane_request = lane.LaneRequest if cors is None else lane.CorsLaneRequest
        # the largest head the lane takes: a larger one is aiohttp's, whose parser and
        # ``header_bytes`` answer it (its request line and each field, its fields in all)
        total = edge.limits.max_header_total_bytes
        self.lane_max_head = min(edge.limits.max_header_bytes, total) if total else edge.limits.max_header_bytes

        # the edge's refusals, each with its request log line
        refused = functools.partial(logged_refusal, request_log=edge.request_log)

        async def request_handler(request: web.BaseRequest) -> web.StreamResponse:
            if _VERSION_REFUSED in request:
                edge.metrics.protocol_errors.labels("400").inc()
                return refused(request, version_refused(request, request[_VERSION_REFUSED]))
            if (host := host_refused(request)) is not None:
                edge.metrics.protocol_errors.labels("400").inc()
                return refused(request, host)
            if max_head_total and header_bytes(request) > max_head_total:
                edge.metrics.protocol_errors.labels("431").inc()
                return refused(request, headers_too_large(request, max_head_total))
            if request.method == "CONNECT":     # a tunnel request: this is not a forward proxy
                return refused(request, connect_refused(request, allow))
            if request.method == "OPTIONS" and request.raw_path == "*":    # about the server, not a path
                return server_options(request, allow)
            try:
                length = request.content_length
            except ValueError:              # more digits than int() converts (leading zeros the parser took)
                edge.metrics.protocol_errors.labels("400").inc()
                return refused(request, content_length_refused(request))
            if length is not None and length > max_body:   # refused before a byte of it is read
                if not (max_upload and request.path == UPLOAD_PATH):
                    return refused(request, body_too_large(request, max_body))
                if length > max_upload:
                    return refused(request, file_too_large(request, edge.limits.upload_file_bytes))
            if hdrs.TRANSFER_ENCODING in request.headers:
                coding = transfer_coding_refused(request)   # one before chunked, which the parser ignores
                if coding is not None:
                    edge.metrics.protocol_errors.labels("501").inc()
                    return refused(request, coding)
            if hdrs.CONTENT_ENCODING in request.headers and request.body_exists:
                coding = coding_refused(request)        # one the parser did not decode
                if coding is not None:
                    edge.metrics.protocol_errors.labels("415").inc()
                    return refused(request, coding)
            broken = request.content.exception()
            if broken is not None:          # the body came with the head and does not decode, or its framing broke
                edge.metrics.protocol_errors.labels("400").inc()
                request.content.feed_eof()  # abandoned: aiohttp must not linger reading it after the answer
                return refused(request, _closing_error(request, 400, f"malformed request body: {_cause_text(broken)}",
                                                       "bad_body"))
            if request.method == "POST":    # an inference path: its handler, without the application's
                handler = direct.get(request.path)      # router and middleware (unless Expect needs them)
                if handler is not None and hdrs.EXPECT not in request.headers:
                    return await handler(request)
            if hdrs.EXPECT in request.headers:      # aiohttp answers an unknown one in plain text
                expectation = expectation_failed(request)
                if expectation is not None:
                    return refused(request, expectation)
            return await app_handler(request)

        if cors is not None:            # a preflight to an API path is answered here, without an API key
            preflights = _cors_preflights(request_handler, cors, cors_methods, direct, edge.cors_counted,
                                          edge.request_log)

            async def request_handler(request: web.BaseRequest) -> web.StreamResponse:
                # a preflight is refused for a Host that is no host, as every request is
                if _VERSION_REFUSED not in request and (host := host_refused(request)) is not None:
                    edge.metrics.protocol_errors.labels("400").inc()
                    return refused(request, host)
                return await preflights(request)
        self.request_handler = request_handler

    def drain(self, close_idle: bool = False) -> int:
        """The gateway stops (gateway/server/run.py ``drain_and_stop``): a connection busy with an
        answer closes after it, and one idle or accepted from now on after its next answer; with
        ``close_idle`` (the listener closed) an idle kept-alive connection closes now. Returns how
        many idle connections were closed."""
        self.edge.draining = True
        return sum(conn.e_drain(close_idle) for conn in list(self._connections) if isinstance(conn, EdgeProtocol))

    def cut_held(self) -> int:
        """The gateway's stop cuts its requests in flight (gateway/server/lifecycle.py ``cut``): those
        the fast lane holds for their body are answered the 503 of a gateway shutting down, as
        aiohttp's requests reading theirs are (``EdgeProtocol.lane_cut``). Returns how many."""
        return sum(conn.lane_cut() for conn in list(self._connections) if isinstance(conn, EdgeProtocol))

    def __call__(self) -> EdgeProtocol:
        return EdgeProtocol(self, loop=self._edge_loop, edge=self.edge, **self._edge_handler_kwargs)


class EdgeRunner(web.AppRunner):
    """``web.AppRunner`` whose server speaks through ``EdgeProtocol``."""

    __slots__ = ("edge", "direct")

    def __init__(self, app: web.Application, edge: Edge, direct: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(app, **{**edge.limits.handler_kwargs(), **kwargs})
        self.edge = edge
        self.direct = direct

    async def _make_server(self) -> web.Server:
        # semi-private: BaseRunner's factory of its Server. The app's startup and freeze happen in
        # the base implementation; its Server's handler kwargs (``_kwargs``) carry what the runner
        # and the app collected (limits, access log, debug, handler_args).
        base = await super()._make_server()
        return EdgeServer(base.request_handler, edge=self.edge, direct=self.direct,
                          allow=methods_served(self._app.router), cors_methods=api_methods(self._app.router),
                          request_factory=base.request_factory,
                          handler_cancellation=base.handler_cancellation, **base._kwargs)


def inline_request_handlers(loop: asyncio.AbstractEventLoop) -> bool:
    """Run each request's handler inside its connection's task on Python 3.11.

    aiohttp's per-connection task (``RequestHandler.start``) creates a task for every request and
    awaits it at once. Python 3.12 starts that task eagerly; 3.11 cannot, so the handler first runs
    a loop iteration later, and the connection task wakes another iteration after it ends: two
    hops of the event loop per request, the first one on the path to the engine (about 50 µs at
    low load, when every cache is cold). Since the connection task does nothing but wait for that
    task, a task factory that hands back the bare coroutine of aiohttp's ``_handle_request`` lets
    the connection task run the handler itself: nothing else changes for the handler. A client
    disconnect cancels the connection task (``handler_cancellation``), which is where the handler
    now runs; ``request.task`` was that task already. What the separate task was for in aiohttp, a
    copy of the context variables per request, the gateway does not need: no code of its own sets
    a context variable (tests/unit/gateway/server/test_edge.py pins that, and aiohttp's code this
    relies on).

    Returns whether the factory was installed (not on 3.12 and later, nor over another factory).
    """
    if sys.version_info >= (3, 12) or loop.get_task_factory() is not None:
        return False
    code = web.RequestHandler._handle_request.__code__
    task_class = asyncio.Task

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, context: Any = None, **kwargs: Any) -> Any:
        if context is None and not kwargs and getattr(coro, "cr_code", None) is code:
            return coro             # awaited at once by the connection task (aiohttp's start())
        return task_class(coro, loop=loop, context=context, **kwargs)

    loop.set_task_factory(factory)
    return True
