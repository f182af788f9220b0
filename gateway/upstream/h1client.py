"""A lean HTTP/1.1 client for the upstream legs (gateway → engine).

Why not aiohttp's client: on the hot path the gateway only ever POSTs a JSON body it already holds
as bytes to an engine it already knows, and relays the answer's bytes. aiohttp's general machinery
(URL objects, request/response classes, multidicts, connector bookkeeping, its StreamReader) cost
more CPU per request than the rest of the gateway together. This module does just that job:

- ``UpstreamPool``: one per gateway; idle keep-alive connections per origin (scheme, host, port),
  optionally capped in total (``upstream.max_connections``), closed after ``keepalive_timeout_s``
  idle. A request goes out as one ``transport.write`` of a pre-encoded head plus the body.
- ``_Conn``: an asyncio ``Protocol`` whose bytes go straight into an ``httptools`` (llhttp)
  response parser; the parser's callbacks fill the ``UpstreamResponse`` being read.
- ``UpstreamResponse``: status, headers, and the body as it arrives (``readany``/``read``, or
  ``pipe``: handed to a callback from the connection's read callback, no task wake-up per read),
  with flow control: reading from the engine pauses while too much is buffered unread, so a slow
  client cannot make the gateway hold an unbounded answer. ``release()`` gives a fully read
  connection back to the pool; ``close()`` drops the connection, which is how an engine learns
  that nobody wants the rest (it aborts the request).

Failures are this module's own exceptions (``UpstreamError`` and subclasses); ``gateway.upstream.upstream``
and ``gateway.pipeline.relay`` turn them into the gateway's error classes.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import ssl as ssl_module
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import itemgetter, methodcaller
from urllib.parse import urlsplit

import httptools
import structlog

log = structlog.get_logger("switchyard.upstream")

# unread body bytes above which reading from the engine pauses; it resumes when the reader takes
# them (``readany`` hands out everything buffered, so the buffer is then empty)
HIGH_WATER = 256 * 1024
# bytes an answer's head may take, with any 1xx before it (an engine's is a few hundred, but vLLM's
# binary embeddings carry a metadata header of some 110 bytes a vector: about 230 KB for 2048
# inputs): an engine, or a proxy before it, that sends header bytes without end fails the leg here,
# not at the header timeout with all it sent meanwhile held (the parser keeps a header's bytes until
# its line ends)
MAX_HEAD_BYTES = 1024 * 1024
# bodies up to this size go out in one buffer with their head (one write); larger ones beside it
_JOIN_MAX = 64 * 1024
_FIELD = "%s: %s\r\n"    # one header line of a request head
_NAME, _VALUE, _LATIN1 = itemgetter(0), itemgetter(1), methodcaller("decode", "latin-1")


class UpstreamError(Exception):
    """Base of the client's failures."""


class UpstreamConnectError(UpstreamError):
    """No connection could be opened (refused, unreachable, DNS, connect timeout): nothing was sent.
    ``refused``: the engine's host answered that nothing listens on the port (``ECONNREFUSED``), where
    a connect timeout may be an engine alive but slow to accept (its listen queue full)."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class UpstreamLocalError(UpstreamConnectError):
    """No connection could be opened because this process could not make a socket (out of file
    descriptors, or the kernel out of buffers): the engine was never asked, and is not at fault."""


# errnos of a socket this process could not make: its RLIMIT_NOFILE met (EMFILE), the system's
# file table full (ENFILE), the kernel out of socket buffers or memory (ENOBUFS, ENOMEM)
LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class UpstreamDisconnected(UpstreamError):
    """The connection closed or broke before the answer was complete.

    ``received`` says whether any byte of the answer had arrived (if not, no engine output was lost
    and the request may be tried elsewhere)."""

    def __init__(self, message: str, received: bool) -> None:
        super().__init__(message)
        self.received = received


class UpstreamProtocolError(UpstreamError):
    """The engine's bytes are not a valid HTTP/1.1 response."""


class UpstreamTooLarge(UpstreamError):
    """A body read whole (``UpstreamResponse.read`` with a limit) is larger than the limit: said by
    its ``Content-Length`` (``received`` 0: nothing of it was read), or seen as it came."""

    def __init__(self, limit: int, received: int, declared: int | None = None) -> None:
        size = f"{declared} bytes (its Content-Length)" if declared is not None else f"over {limit} bytes"
        super().__init__(f"the answer is {size}, more than {limit}")
        self.limit = limit
        self.received = received
        self.declared = declared


class UpstreamTimeout(UpstreamError):
    """No response head within the header timeout, or the whole exchange exceeded the total timeout."""

    def __init__(self, seconds: float, what: str) -> None:
        super().__init__(f"{what} within {seconds:g}s")
        self.seconds = seconds
        self.what = what


class Headers(dict):
    """Response headers; names are stored lower-cased and looked up case-insensitively."""

    __slots__ = ()

    def __getitem__(self, name: str) -> str:
        return dict.__getitem__(self, name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and dict.__contains__(self, name.lower())

    def get(self, name: str, default=None):
        return dict.get(self, name.lower(), default)


def _framed(headers: Headers) -> bool:
    """Whether an answer's head says where its body ends (a Content-Length, or chunked): else the
    body ends with the connection."""
    return dict.__contains__(headers, "content-length") or "chunked" in dict.get(headers, "transfer-encoding", "").lower()


class SendState:
    """Whether any byte of one request may have left the gateway: ``sent`` is set just before the
    request is handed to a connection (``transport.write``), the only place its bytes go out.
    Read once the ``post`` call is over, ``sent`` False proves no byte of it was written."""

    __slots__ = ("sent",)

    def __init__(self) -> None:
        self.sent = False


@dataclass(frozen=True, slots=True, eq=False)
class _Origin:
    """One per base URL (``UpstreamPool._split`` keeps them), so compared and hashed by identity:
    the idle pools are looked up by origin on every request."""

    scheme: str
    host: str
    port: int
    host_header: str        # what goes in ``Host:`` (the URL's netloc)


class UpstreamResponse:
    """One answer being read. The body arrives in ``_chunks`` (fed by the connection's parser) and
    leaves through ``readany``; errors are raised only after the bytes received before them."""

    __slots__ = ("status", "headers", "_conn", "_loop", "_chunks", "_size", "_eof", "_exc", "_waiter", "_sink",
                 "_whole", "on_eof")

    def __init__(self, conn: _Conn) -> None:
        self.status = 0
        self.headers = Headers()
        self._conn: _Conn | None = conn
        self._loop = conn.loop
        self._chunks: list[bytes] = []
        self._size = 0
        self._eof = False                       # the whole body arrived
        self._exc: BaseException | None = None  # raised once the buffer is drained
        self._waiter: asyncio.Future | None = None
        self._sink: Callable[[bytes], None] | None = None   # ``pipe``: body bytes go here as they come
        # ``read``: the body is being read whole, up to this many bytes (reading is not paused below it)
        self._whole = 0
        # told of the whole answer from the read that completes it, before its reader wakes (once)
        self.on_eof: Callable[[UpstreamResponse], None] | None = None

    # -- fed by the connection -------------------------------------------------------------

    def _wake(self, exc: BaseException | None = None) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                if exc is None:
                    w.set_result(None)
                else:
                    w.set_exception(exc)

    def _fail(self, exc: BaseException) -> None:
        if self._exc is None and not self._eof:
            self._exc = exc
        self._wake(exc)

    @property
    def waiting(self) -> bool:
        """A reader is waiting in ``readany`` for bytes."""
        return self._waiter is not None

    def interrupt(self, exc: BaseException) -> None:
        """Raise ``exc`` in the reader waiting in ``readany`` or ``pipe`` (a watchdog); the answer
        itself is unchanged, and nothing happens when no reader waits."""
        self._wake(exc)

    def whole_body(self) -> bytes:
        """The whole body of a complete answer (``on_eof``), left for its reader as well."""
        chunks = self._chunks
        if len(chunks) > 1:
            chunks[:] = [b"".join(chunks)]
        return chunks[0] if chunks else b""

    def _take(self) -> bytes:
        """Everything buffered, as one bytes; a connection paused for a full buffer reads again."""
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._size = 0
        conn = self._conn
        if conn is not None and conn.paused:
            conn.resume()
        return data

    # -- the reader's side -----------------------------------------------------------------

    async def readany(self) -> bytes:
        """Whatever body bytes are buffered (waiting for some if none are), b"" at the end."""
        while True:
            if self._chunks:
                return self._take()
            if self._exc is not None:
                raise self._exc
            if self._eof:
                return b""
            self._waiter = self._loop.create_future()
            await self._waiter

    async def pipe(self, sink: Callable[[bytes], None]) -> bytes | None:
        """Hand the body to ``sink`` as it arrives, from the connection's read callback (one call
        per read, no task wake-up), until the answer ends, fails, is interrupted, or the sink calls
        ``unpipe``. Then: ``None`` when unpiped with nothing buffered, else as ``readany`` (the
        bytes buffered since, b"" at the end, or the failure raised after them)."""
        if not (self._chunks or self._eof or self._exc is not None):
            self._sink = sink
            try:
                self._waiter = self._loop.create_future()
                await self._waiter
            finally:
                self._sink = None
                self._waiter = None
            if not (self._chunks or self._eof or self._exc is not None):
                return None
        return await self.readany()

    @property
    def buffered(self) -> bool:
        """Body bytes wait to be read: ``readany`` returns them without waiting."""
        return bool(self._chunks)

    def unread(self, data: bytes) -> None:
        """Put ``data``, bytes ``readany`` returned, back in front of what is buffered: the next
        reader (or ``pipe``) gets them first."""
        if data:
            self._chunks.insert(0, data)
            self._size += len(data)

    def unpipe(self) -> None:
        """End a ``pipe`` (from its sink: the client stopped keeping up); later bytes are buffered,
        with reading from the engine paused above ``HIGH_WATER``, for ``readany``."""
        if self._sink is not None:
            self._sink = None
            self._wake()

    async def read(self, limit: int = 0) -> bytes:
        """The whole body. With ``limit`` (bytes; 0: none), ``UpstreamTooLarge`` as soon as the body
        is known to be larger: from its ``Content-Length`` before a byte of it is read, else once
        that many bytes came (what was read of it is dropped; reading from the engine pauses above
        ``HIGH_WATER`` unread, so no more than that is held beyond the limit)."""
        if limit:
            declared = dict.get(self.headers, "content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise UpstreamTooLarge(limit, 0, int(declared))
        if not (self._eof or self._exc is not None or (limit and self._size > limit)):
            # the body is held whole anyway: the connection is read on as its bytes come (no pause at
            # ``HIGH_WATER`` for this task to wake and take each read: a turn of the loop apiece,
            # behind every other request's on a loaded gateway), and this task wakes once, at the end
            # or once past ``limit``
            self._whole = limit or 1 << 62
            conn = self._conn
            if conn is not None and conn.paused:
                conn.resume()
            try:
                self._waiter = self._loop.create_future()
                await self._waiter
            finally:
                self._whole = 0
                self._waiter = None
        if limit and self._size > limit:
            size = self._size
            self._chunks = []
            self._size = 0
            raise UpstreamTooLarge(limit, size)
        if self._exc is not None:
            raise self._exc
        # all of it came (the usual whole answer came in the read that brought its head): one join
        data = self._take() if self._chunks else b""
        if limit and len(data) > limit:
            raise UpstreamTooLarge(limit, len(data))
        return data

    async def read_limited(self, limit: int) -> bytes:
        """At most ``limit`` bytes of the body (error bodies are bounded: they are only quoted)."""
        parts = []
        size = 0
        while size < limit and (chunk := await self.readany()):
            parts.append(chunk)
            size += len(chunk)
        return b"".join(parts)[:limit]

    def at_eof(self) -> bool:
        """The whole body arrived and was read."""
        return self._eof and not self._chunks

    def release(self) -> None:
        """Done with the answer: the connection goes back to the pool when the whole answer came
        and the engine keeps the connection alive; otherwise it is closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            if self._eof and self._exc is None and conn.keep_alive and not conn.closed:
                conn.pool._put_idle(conn)
            else:
                conn.abort()

    def close(self) -> None:
        """Drop the connection now: the engine sees the disconnect and stops generating."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()


class _Conn(asyncio.Protocol):
    """One keep-alive connection to an engine; at most one exchange at a time."""

    def __init__(self, pool: UpstreamPool, origin: _Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: UpstreamResponse | None = None   # the exchange in progress
        self.headers_waiter: asyncio.Future | None = None   # until the head arrives or the exchange fails
        self.sent_waiter: asyncio.Future | None = None      # the same future, kept for ``head``
        self.received = False        # any byte of the current answer
        self.head_bytes = 0          # bytes of the current answer read before its head was complete
        self.fields: list[tuple[bytes, bytes]] = []   # the head's header fields as they are parsed
        self.keep_alive = False
        self.closed = False
        self.paused = False
        self.idle_since = 0.0
        self.opened_at = 0.0
        self.idled = 0.0             # how long it had idled when taken for its current exchange
        self.sent_at = 0.0           # when its current request was written (``resendable``)
        self.deadline: asyncio.TimerHandle | None = None

    # -- an exchange -----------------------------------------------------------------------

    async def exchange(self, data: bytes | tuple[bytes, bytes], header_timeout: float | None,
                       state: SendState | None = None) -> UpstreamResponse:
        """Send one request; return once the response head arrived. Any failure or cancellation
        while waiting drops the connection (the engine must not go on for nobody)."""
        self.send(data, state)
        return await self.head(header_timeout)

    def send(self, data: bytes | tuple[bytes, bytes], state: SendState | None = None) -> None:
        """Write one request, now (no await: a cancel cannot fall between ``state`` and the write)."""
        self.resp = UpstreamResponse(self)
        self.received = self.keep_alive = False
        self.head_bytes = 0
        self.headers_waiter = self.sent_waiter = self.loop.create_future()
        if state is not None:
            state.sent = True
        self.sent_at = self.loop.time()
        try:
            if type(data) is tuple:
                self.transport.writelines(data)
            else:
                self.transport.write(data)   # type: ignore[arg-type]
        except (RuntimeError, OSError) as e:  # closed under us between the pool and here
            self.abort()
            raise UpstreamDisconnected(f"connection closed before the request was sent ({e})", False) from None
        total = self.pool.total_timeout
        if total:
            self.deadline = self.loop.call_later(total, self._fail, UpstreamTimeout(total, "no complete answer"))

    async def head(self, header_timeout: float | None) -> UpstreamResponse:
        """The answer to the request ``send`` wrote, once its head arrived."""
        resp, waiter = self.resp, self.sent_waiter
        assert resp is not None and waiter is not None
        watched = bool(header_timeout) and not waiter.done()
        if watched:
            self.pool._await_head(self, header_timeout)
        try:
            await waiter
        except BaseException:
            self.abort()
            raise
        finally:
            if watched:
                self.pool._heads.pop(self, None)
        return resp

    def _header_timeout(self, seconds: float) -> None:
        self._fail(UpstreamTimeout(seconds, "no response"))

    def _fail(self, exc: UpstreamError) -> None:
        """End the exchange with ``exc`` (for whoever waits: headers or body) and drop the connection."""
        w, self.headers_waiter = self.headers_waiter, None
        if w is not None and not w.done():
            w.set_exception(exc)
        if self.resp is not None:
            self.resp._fail(exc)
        self.abort()

    def abort(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        if not self.closed:
            self.closed = True
            self.transport.abort()
            self.pool._forget(self)

    def resume(self) -> None:
        self.paused = False
        if not self.closed:
            self.transport.resume_reading()

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.opened_at = self.loop.time()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.resp is None:     # bytes on an idle connection: nothing can be trusted on it
            self.abort()
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamProtocolError(f"invalid HTTP response: {e}"))
            return
        except httptools.HttpParserUpgrade:
            # a 101 (the parser stops there): no leg asks for an upgrade, so this is no HTTP answer
            self._fail(UpstreamProtocolError("the engine switched protocols (101) unasked"))
            return
        if self.headers_waiter is not None:     # the head is not complete: all read so far is head
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD_BYTES:
                self._fail(UpstreamProtocolError(f"the answer's head is larger than {MAX_HEAD_BYTES} bytes"))
                return
        resp = self.resp
        if resp is not None and (sink := resp._sink) is not None and (chunks := resp._chunks):
            # piped: what this read brought goes to the sink in one call, however many body chunks
            # it held (``_take`` inline: this runs once per relayed read); whatever the sink raises
            # ends the ``pipe`` with that exception
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            resp._chunks = []
            resp._size = 0
            if self.paused:
                self.resume()
            try:
                sink(data)
            except Exception as e:      # noqa: BLE001 - raised in the piping task, where it belongs
                resp._sink = None
                resp._wake(e)

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            self._lost(exc)
        finally:
            # the parser holds this protocol's bound methods: without that cycle a closed connection
            # is freed at once, not left for a full collection (which an idle gateway never runs)
            self.parser = None

    def _lost(self, exc: Exception | None) -> None:
        was_closed = self.closed
        self.closed = True
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        if not was_closed:
            self.pool._forget(self)
        resp = self.resp
        if resp is None:
            if not was_closed:          # the engine closed it while it idled
                self.pool._idle_lost(self)
            return
        if resp._eof or resp._exc is not None:
            return
        if resp.status and not _framed(resp.headers) and exc is None:
            self.on_message_complete()      # a body delimited by the connection's end: complete
            return                          # (not when a reset cut it: then it is incomplete)
        why = f"connection reset ({exc.strerror or exc})" if isinstance(exc, OSError) else "connection closed"
        when = "while reading the answer" if self.headers_waiter is None else "before answering"
        self._fail(UpstreamDisconnected(f"{why} {when}", self.received))

    # -- httptools callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.resp._eof:     # a second answer to one request: the connection is out of step
            raise UpstreamProtocolError("unexpected bytes after the answer")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name, value))     # read at the head's end, all at once (``on_headers_complete``)

    def on_headers_complete(self) -> None:
        resp = self.resp
        status = self.parser.get_status_code()
        fields, self.fields = self.fields, []
        if status < 200:        # an interim 1xx: its headers are not the answer's
            return
        # the answer's headers: names lower-cased, values as latin-1 text, decoded in C
        h = resp.headers
        dict.update(h, zip(map(str.lower, map(_LATIN1, map(_NAME, fields))), map(_LATIN1, map(_VALUE, fields)),
                           strict=True))
        if len(h) != len(fields):           # a repeated name: its values joined, in their order
            h.clear()
            for name, value in fields:
                key, val = name.decode("latin-1").lower(), value.decode("latin-1")
                if dict.__contains__(h, key):
                    val = f"{dict.__getitem__(h, key)}, {val}"
                dict.__setitem__(h, key, val)
        resp.status = status
        w, self.headers_waiter = self.headers_waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    def on_body(self, body: bytes) -> None:
        resp = self.resp
        resp._chunks.append(body)
        if resp._sink is not None:  # piped: handed over once the whole read is parsed (no count:
            return                  # nothing stays buffered past this read, so nothing to pause for)
        resp._size += len(body)
        if resp._whole:                 # ``read``: woken at the end (``on_message_complete``) or past its limit
            if resp._size > resp._whole:
                if not self.paused and not self.closed:
                    self.paused = True
                    self.transport.pause_reading()
                resp._wake()
            return
        if resp._size > HIGH_WATER and not self.paused and not self.closed:
            self.paused = True
            self.transport.pause_reading()
        if resp._waiter is not None:    # a reader waits (``_wake``; none while a whole answer comes in one read)
            resp._wake()

    def on_message_complete(self) -> None:
        resp = self.resp
        if resp is None or resp.status == 0:    # the end of an interim 1xx
            return
        self.keep_alive = self.parser.should_keep_alive()   # false for Connection: close and EOF-delimited
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        resp._eof = True
        if resp._waiter is not None:
            resp._wake()
        told = resp.on_eof
        if told is not None:
            resp.on_eof = None
            told(resp)


class Exchange:
    """A POST begun by ``UpstreamPool.begin``: written already (``conn`` set) or not yet."""

    __slots__ = ("pool", "url", "origin", "data", "state", "conn", "stale", "resp", "error", "told", "once")

    def __init__(self, pool: UpstreamPool, url: str, origin: _Origin | None, data: bytes | tuple[bytes, bytes],
                 state: SendState | None, once: bool = False) -> None:
        self.pool = pool
        self.url = url
        self.origin = origin
        self.data = data
        self.state = state
        self.conn: _Conn | None = None     # the connection the request went out on
        self.stale = False                 # the idle connection it was given had closed
        self.resp: UpstreamResponse | None = None
        self.error: UpstreamError | None = None
        self.told: Callable[[UpstreamResponse], None] | None = None    # ``tell_at_eof``
        # a request the engine may act on only once (a P/D decode's KV pull, an SGLang bootstrap
        # room): lost on a reused connection once written, it is not written again (``resendable``)
        self.once = once

    @property
    def sent(self) -> bool:
        """The request was written when the exchange began."""
        return self.conn is not None

    def tell_at_eof(self, told: Callable[[UpstreamResponse], None] | None) -> None:
        """``told(response)`` from the read that completes the answer, before ``response`` wakes
        its reader, whether the request went out when the exchange began or goes out in
        ``response`` (on a new connection, or again after a reused one turned out closed). None
        takes it back. ``told`` runs inside the connection's read callback: it must not raise."""
        self.told = told
        conn = self.conn
        resp = conn.resp if conn is not None else None
        if resp is not None and not resp._eof:
            resp.on_eof = told

    def _send(self, conn: _Conn) -> None:
        conn.send(self.data, self.state)
        if self.told is not None:
            conn.resp.on_eof = self.told     # type: ignore[union-attr]

    async def response(self, header_timeout: float | None = None) -> UpstreamResponse:
        """The answer's head, as ``UpstreamPool.post`` returns it (the same failures, and the same
        one retry on a fresh connection when a reused one turns out closed with nothing received)."""
        pool, conn, origin = self.pool, self.conn, self.origin
        if origin is None:
            assert self.error is not None
            raise self.error
        if conn is not None or self.stale:
            reused = True
        else:
            conn, reused = await pool._acquire(origin)
            self.conn = conn
            self._send(conn)
        if conn is not None:
            try:
                self.resp = await conn.head(header_timeout)
                return self.resp
            except UpstreamDisconnected as e:
                if self.once or not resendable(conn, reused, e):
                    raise
        self.conn = conn = await pool._connect(origin)
        self._send(conn)
        self.resp = await conn.head(header_timeout)
        return self.resp

    def before_head(self, header_timeout: float | None) -> UpstreamResponse | None:
        """The response that the request written when the exchange began will come in, before its
        head arrives: for a reader that takes the answer from the read that brings the head
        (``UpstreamResponse.pipe``). Its head is bounded by ``header_timeout`` as ``response``
        bounds it, until ``head_came``. None when the request is not out yet or its head came.
        ``response`` still gives the head, or the failure, afterwards."""
        conn = self.conn
        if conn is None or self.stale or conn.resp is None or conn.sent_waiter is None or conn.sent_waiter.done():
            return None
        if header_timeout:
            conn.pool._await_head(conn, header_timeout)
        return conn.resp

    def head_came(self) -> None:
        """The head ``before_head`` waits for came (or nobody waits for it any more): no bound on it."""
        conn = self.conn
        if conn is not None:
            conn.pool._heads.pop(conn, None)
            if conn.resp is not None and conn.resp.status:
                self.resp = conn.resp

    def discard(self) -> None:
        """Drop a connection whose answer nobody will read (``response`` never reached the head)."""
        conn = self.conn
        if conn is not None and self.resp is None:
            # nobody awaits the head: the failure the connection's end sets on its waiter would be
            # left unretrieved (asyncio logs that as an error when the future is collected)
            if conn.sent_waiter is not None:
                conn.sent_waiter.cancel()
            conn.abort()


# A reused connection that closes with nothing received is sent again on a fresh one only when it
# had idled this long: then the engine's server closed it at its keep-alive timeout (uvicorn's, which
# vLLM and SGLang run, is 5 s) as the request went out, and had not read it. One that idled less
# was open on the engine's side: the engine read the request and went away with it (it died, or
# dropped the connection), and sending it again would run it twice: a P/D decode's KV pull or
# bootstrap room is used once. That failure is the caller's (a retry elsewhere, or a 502).
RESEND_IDLE_S = 1.0
# ... and only when the close came this soon after the request was written: an engine that closed
# the connection at its keep-alive timeout had its close on the way as the request went out, so the
# close arrives within a round trip. A close that comes later is an engine that read the request and
# worked on it (a non-streaming answer's head comes with its body) before it went away: sending it
# again would run it twice.
RESEND_WITHIN_S = 0.5


def resendable(conn: _Conn | None, reused: bool, e: UpstreamDisconnected) -> bool:
    """Whether a request that ``conn`` lost (``e``) goes again on a fresh connection."""
    return reused and not e.received and (
        conn is None or (conn.idled >= RESEND_IDLE_S and conn.loop.time() - conn.sent_at < RESEND_WITHIN_S))


class UpstreamPool:
    """Keep-alive connections to the engines, for all upstream legs of one gateway.

    Idle connections are kept per origin and reused newest first (the oldest expire); a request on
    a reused connection that the engine had closed while it idled (a keep-alive race: nothing came
    back, after an idle time its keep-alive timeout may have ended: ``RESEND_IDLE_S``) is sent
    again once on a fresh connection. ``max_connections`` (0: unlimited) caps open
    connections in total; a request beyond it first closes an idle connection to another origin,
    else waits for one to come free.
    """

    def __init__(self, *, connect_timeout: float = 5.0, keepalive_timeout: float = 60.0,
                 max_connections: int = 0, total_timeout: float = 0.0, warm_connections: int = 0,
                 on_reopen: Callable[[bool], None] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.connect_timeout = connect_timeout
        self.keepalive_timeout = keepalive_timeout
        self.max_connections = max_connections
        self.total_timeout = total_timeout
        self.warm_connections = warm_connections
        self.on_reopen = on_reopen                  # told of each reopen: (opened?)
        self.reopen_min_age = 1.0                   # a connection closed younger is not replaced
        self._reopening: dict[_Origin, asyncio.Task] = {}
        self._idle: dict[_Origin, deque[_Conn]] = {}
        # origins of engines that left the pool with connections still busy: those close when their
        # answer ends, and none is opened again (``retire``)
        self._retired: set[_Origin] = set()
        self._conns: set[_Conn] = set()          # every open connection (idle or busy)
        self._connecting = 0
        self._waiters: deque[asyncio.Future] = deque()
        self._origins: dict[str, _Origin] = {}
        self._targets: dict[str, tuple[_Origin, str]] = {}     # a URL's origin and head start (``_target``)
        self._sweep: asyncio.TimerHandle | None = None
        # exchanges waiting for their response head: conn → (deadline, seconds), all watched by one
        # timer set for the earliest deadline (not a timer per request)
        self._heads: dict[_Conn, tuple[float, float]] = {}
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_due = float("inf")
        self._ssl: ssl_module.SSLContext | None = None
        self._closed = False

    @classmethod
    def from_config(cls, cfg) -> UpstreamPool:
        """From an ``UpstreamConfig``."""
        return cls(connect_timeout=cfg.connect_timeout_s, keepalive_timeout=cfg.keepalive_timeout_s,
                   max_connections=cfg.max_connections, total_timeout=cfg.total_timeout_s,
                   warm_connections=cfg.warm_connections)

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    @property
    def idle_connections(self) -> int:
        """Open connections kept for a next exchange (the rest carry one); one the engine closed
        while it idled is left in its queue until a request passes it over, and is not counted."""
        conns = self._conns
        return sum(1 for dq in self._idle.values() for c in dq if c in conns)

    # -- requests --------------------------------------------------------------------------

    async def post(self, url: str, body: bytes, headers: Mapping[str, str],
                   header_timeout: float | None = None, state: SendState | None = None) -> UpstreamResponse:
        """POST ``body`` to ``url`` (``http[s]://host:port/path``); return once the response head
        arrived. ``headers`` should carry Content-Type; Host and Content-Length are added here.
        ``state`` records whether any of the request may have been written (see ``SendState``)."""
        origin, data = self._encode(url, body, headers)
        conn, reused = await self._acquire(origin)
        try:
            return await conn.exchange(data, header_timeout, state)
        except UpstreamDisconnected as e:
            if not resendable(conn, reused, e):
                raise
        # the engine had closed the idle connection: nothing was received, so sending again is safe
        conn = await self._connect(origin)
        return await conn.exchange(data, header_timeout, state)

    def begin(self, url: str, body: bytes, headers: Mapping[str, str],
              state: SendState | None = None, once: bool = False) -> Exchange:
        """Start a POST now: on an idle keep-alive connection the request is written before this
        returns, with nothing else in between; otherwise ``Exchange.response`` connects and writes.
        Either way ``Exchange.response`` awaits the answer's head (as ``post`` does), and an
        exchange that is not awaited to its head must be ``discard``-ed. ``once``: a request lost
        once written is not written again, even where ``resendable`` would (``Exchange.once``)."""
        try:
            origin, data = self._encode(url, body, headers)
        except UpstreamConnectError as e:
            x = Exchange(self, url, None, b"", state)
            x.error = e                 # raised by response(), where post() raises it
            return x
        x = Exchange(self, url, origin, data, state, once)
        conn = self._take_idle(origin)
        if conn is not None:
            try:
                conn.send(data, state)
                x.conn = conn
            except UpstreamDisconnected:
                x.stale = True          # closed as it idled: response() sends on a fresh connection
        return x

    def _encode(self, url: str, body: bytes, headers: Mapping[str, str]) -> tuple[_Origin, bytes | tuple[bytes, bytes]]:
        target = self._targets.get(url)
        if target is None:
            target = self._target(url)
        origin, start = target
        lines = "".join(map(_FIELD.__mod__, headers.items()))    # formatted in C, no Python frame per header
        if lines.count("\n") != len(headers) or lines.count("\r") != len(headers):
            raise ValueError("a header name or value contains a line break")
        head = f"{start}Content-Length: {len(body)}\r\n{lines}\r\n".encode("utf-8", "surrogateescape")
        # a large body (an audio upload) is handed over beside its head, not copied onto it
        return origin, (head + body if len(body) <= _JOIN_MAX else (head, body))

    def _target(self, url: str) -> tuple[_Origin, str]:
        """``url``'s origin and the start of a request's head to it (the request line and Host),
        kept per URL (an endpoint's few paths), not split and formatted again for every request."""
        origin, path = self._split(url)
        if len(self._targets) >= 4096:      # paths that hold ids (a stored response's): keep it bounded
            self._targets.clear()
        target = self._targets[url] = (origin, f"POST {path} HTTP/1.1\r\nHost: {origin.host_header}\r\n")
        return target

    def _split(self, url: str) -> tuple[_Origin, str]:
        i = url.find("/", url.find("//") + 2)
        base, path = (url, "/") if i < 0 else (url[:i], url[i:])
        origin = self._origins.get(base)
        if origin is None:
            u = urlsplit(base)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise UpstreamConnectError(f"unsupported upstream URL {base!r}")
            origin = _Origin(u.scheme, u.hostname, u.port or (443 if u.scheme == "https" else 80), u.netloc)
            if len(self._origins) >= 4096:     # endpoints come and go (Kubernetes): keep the cache bounded,
                # keeping the origins connections are held under (they are keys by identity)
                self._origins = {b: o for b, o in self._origins.items() if self._idle.get(o) or o in self._reopening}
                self._targets.clear()           # they hold origins: none of those dropped is used again
            self._origins[base] = origin
        return origin, path

    # -- connections -----------------------------------------------------------------------

    async def _acquire(self, origin: _Origin) -> tuple[_Conn, bool]:
        while True:
            conn = self._take_idle(origin)
            if conn is not None:
                return conn, True
            cap = self.max_connections
            if not cap or len(self._conns) + self._connecting < cap or self._evict_idle():
                return await self._connect(origin), False
            fut = self.loop.create_future()
            self._waiters.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._wake_waiter()      # pass the freed slot on
                else:
                    with contextlib.suppress(ValueError):
                        self._waiters.remove(fut)
                raise

    def _take_idle(self, origin: _Origin) -> _Conn | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        now = self.loop.time()
        oldest_ok = now - self.keepalive_timeout
        while idle:
            conn = idle.pop()
            if conn.closed or conn.transport.is_closing():
                continue
            if conn.idle_since < oldest_ok:
                conn.abort()
                continue
            # since its last answer, or since it was opened (a warm reopen keeps the idle_since of
            # the connection it replaced, for the expiry): what the engine's keep-alive timer counts
            conn.idled = now - max(conn.idle_since, conn.opened_at)
            return conn
        return None

    def _evict_idle(self) -> bool:
        """Close the longest-idle connection (to any origin) to make room under the cap."""
        best: _Conn | None = None
        for dq in self._idle.values():
            while dq and dq[0].closed:
                dq.popleft()
            if dq and (best is None or dq[0].idle_since < best.idle_since):
                best = dq[0]
        if best is None:
            return False
        self._idle[best.origin].popleft()
        best.abort()
        return True

    async def _connect(self, origin: _Origin) -> _Conn:
        if self._closed:
            raise UpstreamConnectError("the upstream pool is closed")
        ssl = None
        if origin.scheme == "https":
            if self._ssl is None:
                self._ssl = ssl_module.create_default_context()
            ssl = self._ssl
        self._connecting += 1
        try:
            async with asyncio.timeout(self.connect_timeout or None):
                _, conn = await self.loop.create_connection(lambda: _Conn(self, origin), origin.host,
                                                            origin.port, ssl=ssl)
        except BaseException as e:
            self._connecting -= 1
            self._wake_waiter()     # the slot this attempt held is free again
            if isinstance(e, TimeoutError):
                raise UpstreamConnectError(f"connect timed out after {self.connect_timeout:g}s") from None
            if isinstance(e, OSError):
                if e.errno in LOCAL_ERRNOS:
                    raise UpstreamLocalError(e.strerror or str(e)) from None
                raise UpstreamConnectError(e.strerror or str(e), isinstance(e, ConnectionRefusedError)) from None
            raise
        self._connecting -= 1
        if self._closed:
            conn.abort()
            raise UpstreamConnectError("the upstream pool is closed")
        self._conns.add(conn)
        return conn

    def _await_head(self, conn: _Conn, seconds: float) -> None:
        due = self.loop.time() + seconds
        self._heads[conn] = (due, seconds)
        if due < self._head_due:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_due = due
            self._head_timer = self.loop.call_at(due, self._check_heads)

    def _check_heads(self) -> None:
        """Fail the exchanges whose head is overdue; set the timer for the next deadline."""
        self._head_timer = None
        self._head_due = float("inf")
        now = self.loop.time()
        nxt = float("inf")
        for conn, (due, seconds) in list(self._heads.items()):
            if due <= now:
                del self._heads[conn]
                conn._header_timeout(seconds)
            elif due < nxt:
                nxt = due
        if nxt != float("inf"):
            self._head_due = nxt
            self._head_timer = self.loop.call_at(nxt, self._check_heads)

    def retire(self, base: str) -> None:
        """The engine at ``base`` (its URL; a path is ignored) left the pool: its idle connections close,
        a busy one once its answer ends, and the pool opens none again for it (``_idle_lost``).
        The engine coming back gets a new origin."""
        i = base.find("/", base.find("//") + 2)
        origin = self._origins.pop(base if i < 0 else base[:i], None)
        if origin is None:
            return
        for url in [u for u, (o, _) in self._targets.items() if o is origin]:
            del self._targets[url]
        task = self._reopening.pop(origin, None)
        if task is not None:
            task.cancel()
        for conn in self._idle.pop(origin, ()):
            conn.abort()
        if any(c.origin is origin for c in self._conns):
            self._retired.add(origin)

    def _put_idle(self, conn: _Conn) -> None:
        conn.resp = None
        if self._closed or not self.keepalive_timeout:
            conn.abort()
            return
        if self._retired and conn.origin in self._retired:
            conn.abort()
            if not any(c.origin is conn.origin for c in self._conns if c is not conn):
                self._retired.discard(conn.origin)
            return
        if conn.paused:
            conn.resume()
        conn.idle_since = self.loop.time()
        dq = self._idle.get(conn.origin)
        if dq is None:
            dq = self._idle[conn.origin] = deque()
        dq.append(conn)
        if self._sweep is None:
            self._sweep = self.loop.call_later(self.keepalive_timeout, self._expire)
        if self._waiters:
            self._wake_waiter()

    # -- warm connections ------------------------------------------------------------------
    # vLLM and SGLang (uvicorn, ``timeout_keep_alive`` 5 s) close a kept-alive connection after a
    # few idle seconds, far sooner than this pool would: without a reopen, the first request after
    # a lull pays a connect (a round trip, and a loop iteration) before its bytes go out.

    def _idle_lost(self, conn: _Conn) -> None:
        """The engine closed ``conn`` while it idled: open another in its place, in the background,
        while the origin has fewer than ``warm_connections`` idle and served a request within
        ``keepalive_timeout`` (the reopened connection keeps that time: the chain ends where this
        pool's own idle horizon would have ended the first one). A connection the engine closed
        within a second of opening is not replaced (an engine that keeps nothing alive, or one going
        down), nor is any while a reopen to its origin is under way."""
        warm = self.warm_connections
        if not warm or self._closed:
            return
        origin, now = conn.origin, self.loop.time()
        if origin in self._retired or self._origins.get(f"{origin.scheme}://{origin.host_header}") is not origin:
            return                      # its engine left the pool (``retire``)
        if now - conn.idle_since >= self.keepalive_timeout or now - conn.opened_at < self.reopen_min_age \
                or origin in self._reopening:
            return
        idle = self._idle.get(origin)
        if idle is not None and sum(1 for c in idle if not c.closed) >= warm:
            return
        cap = self.max_connections
        if cap and len(self._conns) + self._connecting >= cap:
            return
        self._reopening[origin] = self.loop.create_task(self._reopen(origin, conn.idle_since))

    async def _reopen(self, origin: _Origin, idle_since: float) -> None:
        try:
            conn = await self._connect(origin)
        except (UpstreamConnectError, OSError) as e:
            log.info("engine connection not reopened", endpoint=origin.host_header, error=str(e) or type(e).__name__)
            if self.on_reopen is not None:
                self.on_reopen(False)
            return
        finally:
            self._reopening.pop(origin, None)
        if self._closed:
            conn.abort()
            return
        conn.idle_since = idle_since
        dq = self._idle.get(origin)
        if dq is None:
            dq = self._idle[origin] = deque()
        i = 0                           # the deque runs oldest idle first
        while i < len(dq) and dq[i].idle_since <= idle_since:
            i += 1
        dq.insert(i, conn)
        if self._sweep is None:
            self._sweep = self.loop.call_later(max(0.0, idle_since + self.keepalive_timeout - self.loop.time()),
                                               self._expire)
        if self.on_reopen is not None:
            self.on_reopen(True)
        if self._waiters:
            self._wake_waiter()

    def _forget(self, conn: _Conn) -> None:
        """A connection closed (by us or the engine): its slot is free."""
        self._conns.discard(conn)
        if self._waiters:
            self._wake_waiter()

    def _wake_waiter(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def _expire(self) -> None:
        """Close connections idle for longer than the keep-alive timeout; runs while any idle."""
        self._sweep = None
        now = self.loop.time()
        oldest_ok = now - self.keepalive_timeout
        next_due: float | None = None
        for origin, dq in list(self._idle.items()):
            while dq and (dq[0].closed or dq[0].idle_since <= oldest_ok):
                dq.popleft().abort()
            if not dq:
                del self._idle[origin]
            elif next_due is None or dq[0].idle_since < next_due:
                next_due = dq[0].idle_since
        if next_due is not None:
            self._sweep = self.loop.call_later(max(0.0, next_due + self.keepalive_timeout - now), self._expire)

    async def close(self) -> None:
        """Close every connection, idle or busy (at shutdown, after the requests finished)."""
        self._closed = True
        for task in list(self._reopening.values()):
            task.cancel()
        self._reopening.clear()
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        for conn in list(self._conns):
            conn.abort()
        self._idle.clear()
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.cancel()
        await asyncio.sleep(0)    # let the transports' connection_lost callbacks run
