"""Relay an engine's answer to the client, measuring as the bytes pass.

Streams: each upstream chunk is written to the client as it arrives (no re-encoding), after the
first straight from the upstream connection's read callback while the client keeps up; the SSE
scanner sees first token, inter-token gaps, usage, finish and in-stream errors. When the upstream
breaks after headers went out, the client gets a final ``data: {"error": ...}`` event and the
stream ends: never a silent truncation, never a replay.

The watchdog (when enabled for the leg) bounds the wait for the first chunk, the idle time between
chunks, and a non-streaming answer; a read of nothing but SSE comments (keep-alives) is relayed
but is no chunk to it (``moved``: a stalled engine that keeps its connection open is still cut); on fire the upstream connection is closed (the engine aborts)
and the phase is recorded on the request.

Whatever the outcome, the upstream response is released to the pool when it was read to the end
and closed otherwise, which is how an engine learns that nobody wants the rest; and how the answer
ended (``gateway.resilience.outcome.of_answer``) is told to the endpoint's breaker through ``record``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec
import orjson
from aiohttp import web

from gateway.apis.base import StreamScanner
from gateway.config.schema import UpstreamConfig, WatchdogConfig
from gateway.errors import ErrorClass, GatewayError, error_body, error_response, normalize_upstream_error
from gateway.observability.metrics import GatewayMetrics, observe_all
from gateway.pipeline.context import RequestContext, RequestRecord, safe_header_value, watch_client
from gateway.pipeline.sse import (
    AnswerText,
    ChoicesScanner,
    SSEScanner,
    has_fields,
    message_text,
    string_code,
    usage_tokens,
)
from gateway.pipeline.whole import WatchedResponse, WrittenStream, open_stream, stream_head, write_whole
from gateway.request import BINARY_FORMATS, BINARY_PATHS, ROUTED_PATHS
from gateway.resilience.outcome import Outcome, key_refused, of_answer, of_status, unsupported_event
from gateway.upstream.h1client import UpstreamError, UpstreamResponse, UpstreamTimeout, UpstreamTooLarge
from gateway.upstream.upstream import engine_key_refused, key_refused_error, too_large_error
from handlers.base import EngineAdapter

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# the Retry-After of an engine's 429, 503 or 529 relayed without one, in seconds: a full queue drains
# in about a second; an engine unavailable or overloaded (529, Anthropic's overload, which an
# Anthropic-compatible server may answer) waits as long as the gateway's own 503s and 529s say
ENGINE_RETRY_AFTER = {429: "1", 503: "5", 529: "5"}
SSE_TYPE = "text/event-stream; charset=utf-8"


def error_event(status: int, message: str, code: str | int | None = None, type_: str | None = None) -> bytes:
    return b"data: " + orjson.dumps(error_body(status, message, code=code, type_=type_)) + b"\n\n"


def ended_event(tail: bytes) -> bytes:
    """The bytes a stream ends in, its last event ended by a blank line when it lacked one (its
    trailing line ends, LF, CRLF or bare CR, are then one blank line's LFs)."""
    if tail.endswith((b"\n\n", b"\r\r", b"\n\r\n")) or not tail.strip(b"\r\n"):
        return tail
    return tail.rstrip(b"\r\n") + b"\n\n"


class WatchdogFired(Exception):
    def __init__(self, phase: str, seconds: float) -> None:
        super().__init__(phase)
        self.phase = phase
        self.seconds = seconds



def watchdog_fired(ctx: RequestContext, metrics: GatewayMetrics, phase: str, seconds: float | None) -> None:
    """The watchdog cut the request's leg in ``phase`` after ``seconds``: its log field, its trace
    event and its count (``switchyard_watchdog_fires_total``), wherever the fire is taken (the relay,
    a plain leg's head bound, a P/D decode's)."""
    rec = ctx.rec
    rec.watchdog = phase    # type: ignore[assignment]
    ctx.trace.event("watchdog", {"switchyard.watchdog.phase": phase, "switchyard.watchdog.seconds": seconds or 0.0})
    metrics.child(metrics.watchdog_fires, rec.model, phase).inc()


class _PastDone(Exception):
    """The engine wrote on after its answer's ``[DONE]``: the stream ends there (nothing after it
    is relayed) and the engine's connection, whose next bytes are no answer's, is closed."""


class FirstBytesFailed(Exception):
    """A gated stream (``Relay.answer``'s ``gate``: a P/D decode; ``Relay.stream_from_head``) failed
    before its first bytes passed the gate, so the client has seen nothing of it. ``kind``: ``timeout`` (``detail``: the
    seconds waited), ``broken`` (the ``UpstreamError``), ``empty`` (it ended), ``refused`` (what
    the gate returned)."""

    def __init__(self, kind: str, detail: object = None) -> None:
        super().__init__(kind)
        self.kind = kind
        self.detail = detail


# a gated stream's check of its first bytes: None to begin the answer with them, else why not
Gate = Callable[[bytes], object]

def _unstarted(refused: object, failed: FirstBytesFailed) -> FirstBytesFailed:
    """Why a gated stream did not begin: the gate's word on its first bytes, when it said one."""
    return failed if refused is None else FirstBytesFailed("refused", refused)


# a stream's failure: (error class, message); a timeout ends it with a 504 event, anything else a 502
StreamFailure = tuple[ErrorClass, str]
EOF_FAILURE: StreamFailure = (ErrorClass.UPSTREAM_EOF, "the engine closed the stream before it completed")
# once the answer's terminal event ([DONE], message_stop, response.completed), or the engine's own
# error event, which ends it, went through, how long
# the engine's own end of the body is awaited before the client's stream is ended without it (an
# engine ends right after that event; one that stalls there would hold a client that reads to the
# end, as the SDKs do, whatever the watchdog)
END_GRACE_S = 1.0


def whole_finishes(rec: RequestRecord, choices: list) -> None:
    """A whole answer of several choices: ``finish_reason`` is choice 0's, as a stream's is
    (``ChoicesScanner``), and ``finish_reasons`` every choice's, by index."""
    reasons: list[str | None] = [None] * len(choices)
    for c in choices:
        i = c.get("index", 0) if isinstance(c, dict) else None
        if isinstance(i, int) and 0 <= i < len(reasons):
            fr = c.get("finish_reason")
            reasons[i] = fr if isinstance(fr, str) else None
    rec.finish_reason = reasons[0]
    rec.extra["finish_reasons"] = reasons


class _Choice(msgspec.Struct):
    index: object = msgspec.UNSET
    finish_reason: object = msgspec.UNSET
    message: object = msgspec.UNSET


class _Answer(msgspec.Struct):
    choices: list[_Choice] | msgspec.UnsetType = msgspec.UNSET
    usage: object = msgspec.UNSET
    model: object = msgspec.UNSET


_ANSWER = msgspec.json.Decoder(_Answer)
# a whole answer larger than this is read through ``answer_view``
VIEW_ABOVE = 256 << 10


def answer_view(body: bytes) -> object:
    """A whole answer's JSON as the relay reads it: its ``usage``, and each choice's ``index``,
    ``finish_reason`` and ``message``. A large answer (over ``VIEW_ABOVE``: a completion's prompt
    logprobs, tens of MB) is checked as JSON whole but decoded into those members alone, the rest
    skipped: decoding all of it took the most of the time such an answer spent in the gateway (a
    Python object for every logprob, made and freed again). Raises ``orjson.JSONDecodeError`` for a
    body that is not JSON, as ``orjson.loads``; an answer that is JSON but no object, or whose
    choices are not a list of objects, is decoded whole. A number beyond a double's range (RFC 8259
    bounds none; orjson refuses it) in a member not read is skipped at any size: a small answer
    orjson refuses is read as a large one is before it is refused."""
    if len(body) > VIEW_ABOVE:
        view = _view(body)
        if view is not None:
            return view
        return orjson.loads(body)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        view = _view(body)
        if view is None:
            raise
        return view


def _view(body: bytes) -> dict | None:
    """``answer_view``'s partial decode; None when the body is not a JSON object of that shape in UTF-8."""
    try:
        a = _ANSWER.decode(body)
    except msgspec.DecodeError:     # not JSON, or not this shape: decoded whole, as before
        return None
    if not (body.isascii() or _utf8(body)):     # the strings skipped are not checked by the decode
        return None
    view: dict = {}
    if a.choices is not msgspec.UNSET:
        view["choices"] = [{k: v for k, v in (("index", c.index), ("finish_reason", c.finish_reason),
                                              ("message", c.message)) if v is not msgspec.UNSET}
                           for c in a.choices]
    if a.usage is not msgspec.UNSET:
        view["usage"] = a.usage
    if a.model is not msgspec.UNSET:
        view["model"] = a.model
    return view


_MEMBERS: dict[tuple[str, ...], msgspec.json.Decoder] = {}


def members_view(body: bytes, names: tuple[str, ...]) -> dict | None:
    """A large answer's top-level members ``names`` (those present), the rest checked as JSON but
    skipped, as ``answer_view``; None when it is not a JSON object in UTF-8 (decoded whole then)."""
    decoder = _MEMBERS.get(names)
    if decoder is None:
        decoder = _MEMBERS[names] = msgspec.json.Decoder(
            msgspec.defstruct("Members", [(n, object, msgspec.UNSET) for n in names]))
    try:
        got = decoder.decode(body)
    except msgspec.DecodeError:
        return None
    if not (body.isascii() or _utf8(body)):
        return None
    return {n: v for n in names if (v := getattr(got, n)) is not msgspec.UNSET}


def _utf8(body: bytes) -> bool:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


_CODING_FIELDS = frozenset({"content-encoding", "transfer-encoding"})


def coding_of(resp: UpstreamResponse) -> str | None:
    """The content or transfer coding (other than chunked) an engine's answer is in, None when its
    bytes are the content itself. The relay passes bytes through as they came and sends the client
    no ``Content-Encoding``, so an answer in a coding is one no client could read."""
    h = resp.headers                      # names stored lower-cased (h1client.Headers): plain dict reads
    if _CODING_FIELDS.isdisjoint(h):      # the usual whole answer: neither field, found in one step in C
        return None
    ce = dict.get(h, "content-encoding")
    if ce is not None and ce.strip().lower() not in ("", "identity"):
        return ce
    te = dict.get(h, "transfer-encoding")
    if te is not None and any(c.strip() not in ("", "chunked", "identity") for c in te.lower().split(",")):
        return te
    return None


# how long an engine's error body is awaited once its status came: the engine has decided, and what
# of its body came by then is quoted (a body that stalls held the client for as long as it did)
ERROR_BODY_WAIT_S = 5.0


async def read_error_body(resp: UpstreamResponse, limit: int) -> bytes:
    """At most ``limit`` bytes of an engine's error body, as much of it as came when it broke off (cut
    short, its framing broken) or did not end within ``ERROR_BODY_WAIT_S`` (the caller closes the
    connection then: not at its end); none of a body in a content coding, which could only be
    quoted as mojibake. The engine's status is answered either way."""
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(ERROR_BODY_WAIT_S):
            while size < limit and (chunk := await resp.readany()):
                parts.append(chunk)
                size += len(chunk)
    except (TimeoutError, UpstreamError):
        pass
    if coding_of(resp) is not None:
        return b""
    return b"".join(parts)[:limit]


# switchyard_upstream_errors_total's class of an engine connection that broke mid-stream (the plain
# relay's and a migrating stream's leg alike)
BROKEN_STREAM = "broken_stream"


def stream_failure(e: WatchdogFired | UpstreamError, ctx: RequestContext | None = None) -> StreamFailure:
    """What a leg's failure mid-stream is called, for the plain relay and a migrating stream alike:
    a watchdog that fired, the whole-exchange timeout (``upstream.total_timeout_s``), or the
    engine's side breaking; a P/D decode's names the decode (``ctx``: the request)."""
    if isinstance(e, WatchdogFired):
        failure = ErrorClass.watchdog(e.phase), f"no output from the engine for {e.seconds:g}s ({e.phase.replace('_', ' ')})"
    elif isinstance(e, UpstreamTimeout):
        failure = ErrorClass.UPSTREAM_TIMEOUT, f"the engine did not finish the stream: {e}"
    else:
        failure = ErrorClass.UPSTREAM_BROKEN, f"the engine connection broke mid-stream: {type(e).__name__}: {e}"
    return of_leg(ctx, failure)


def of_leg(ctx: RequestContext | None, failure: StreamFailure) -> StreamFailure:
    """``failure`` of a P/D request's stream, whose only leg streaming is its decode, named so (no
    header can say which leg failed once the client's head is out); another's as it is."""
    if ctx is None or ctx.pd_plan is None or ctx.decision is None:
        return failure
    return failure[0], f"decode endpoint {ctx.decision.endpoint.name}: {failure[1]}"


def _decode_of(ctx: RequestContext) -> str | None:
    """The name of a P/D request's decode endpoint, whose answer the relay reads (None: no P/D leg)."""
    if ctx.pd_plan is None or ctx.decision is None:
        return None
    return ctx.decision.endpoint.name


class Watchdog:
    """A stream's watchdog (the plain relay's, and each leg's of a migrating stream): each wait for the engine's next chunk is bounded (``first_chunk`` for
    the first, ``idle`` after it), by one timer per stream rather than one per chunk. The relay
    notes when each wait starts (``since``); the timer, when due, checks the wait in progress and
    either interrupts it with ``WatchdogFired`` or sets itself for that wait's deadline. Time spent
    writing to the client is not counted, as no wait is in progress then.

    The bound is on the silence the gateway could watch: a check that the event loop ran late
    (held up past the deadline by a full garbage collection, a starved CPU) does not fire at once.
    The engine's bytes that came meanwhile are not read yet (uvloop runs its due timers before it
    polls the sockets), and an engine in the gateway's own process was held as well, so the wait
    is given as long again as the check was late (up to its bound), once, before it fails."""

    __slots__ = ("resp", "loop", "phase", "limit", "idle", "since", "handle", "at", "excused")

    def __init__(self, resp: UpstreamResponse, first_to: float, idle_to: float) -> None:
        """The first wait is bounded by ``first_to``, or by ``idle_to`` when that is 0 (one is not)."""
        self.resp = resp
        self.loop = asyncio.get_running_loop()
        self.phase, self.limit = ("first_chunk", first_to) if first_to else ("idle", idle_to)
        self.idle = idle_to
        self.since = self.loop.time()
        self.excused = -1.0         # the wait (its ``since``) that a late check gave more time
        self.handle: asyncio.TimerHandle | None = None
        self._arm(self.since + (first_to or idle_to))

    def _arm(self, when: float) -> None:
        self.at = when              # when the check is due: how late it ran is what the loop was held
        self.handle = self.loop.call_at(when, self._check)

    def first_chunk_came(self) -> None:
        """From now on each wait is bounded by the idle timeout (the timer is set anew for it)."""
        self.phase, self.limit = "idle", self.idle
        self.cancel()
        if self.idle:
            self._arm(self.loop.time() + self.idle)

    def _check(self) -> None:
        self.handle = None
        now = self.loop.time()
        limit = self.limit
        if not limit:       # after the first chunk, with no idle bound: nothing more to watch
            return
        if self.resp.waiting:
            due = self.since + limit
            if now >= due:
                late = now - self.at
                if late > 0 and self.excused != self.since:     # the loop was held: see above
                    self.excused = self.since
                    self._arm(now + min(late, limit))
                    return
                self.resp.interrupt(WatchdogFired(self.phase, limit))
                return
        else:               # no wait in progress: the next one starts no sooner than now
            due = now + limit
        self._arm(due)

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def end_within(self, seconds: float) -> None:
        """The answer's terminal event went through: each wait from now on is bounded by
        ``seconds`` (unless a shorter idle bound is set already)."""
        if self.phase == "idle" and 0 < self.idle <= seconds:
            return
        self.phase, self.limit, self.idle = "idle", seconds, seconds
        self.cancel()
        self._arm(self.loop.time() + seconds)


class HeadAhead:
    """A 200 event stream's headers and head, made while its first bytes are awaited
    (``Relay.head_ahead``). Used within ``FRESH_S`` of being made (its ``Date`` stays right)."""

    __slots__ = ("headers", "made", "at")

    FRESH_S = 1.0

    def __init__(self, headers: dict[str, str], made: tuple[bytes, bool], at: float) -> None:
        self.headers = headers
        self.made = made
        self.at = at


async def open_sse(ctx: RequestContext, headers: dict[str, str], whole: bool = False,
                   hold: bool = False, ahead: HeadAhead | None = None, begin: bool = True) -> web.StreamResponse:
    """Send the client the headers of a 200 event stream; from here on, errors are events.
    ``whole``: the head may be written by the gateway itself (gateway/pipeline/whole.py);
    ``hold``: it may then wait for the first write, to go out with it (``open_stream``);
    ``ahead``: the headers and head, made already (``Relay.head_ahead``); ``begin``: False for a
    held head whose answer begins later (``began``), when its first bytes are known good."""
    try:
        if ahead is not None:
            written = open_stream(ctx.http, ahead.headers, SSE_TYPE, hold, ahead.made)
        else:
            written = open_stream(ctx.http, {**headers, **SSE_HEADERS}, SSE_TYPE, hold) if whole else None
        if written is not None:
            out: web.StreamResponse = written      # type: ignore[assignment]   # the relay's part of its API
        else:
            out = web.StreamResponse(status=200, headers={**headers, **SSE_HEADERS})
            out.content_type = "text/event-stream"
            out.charset = "utf-8"
            await out.prepare(ctx.http)
    except ConnectionResetError:
        # the client's connection is closing (its reset read in this loop turn, after what woke
        # this task), and the cancel its connection_lost brings has not come yet: the client left
        raise asyncio.CancelledError from None
    watch_client(ctx.http)
    if begin:
        began(ctx, out)
    return out


def began(ctx: RequestContext, out: web.StreamResponse) -> None:
    """The client's answer is ``out``, a 200 event stream: from here on, errors are events."""
    ctx.response = out
    ctx.rec.headers_sent = True
    ctx.rec.status = 200


class Relay:
    def __init__(self, cfg: UpstreamConfig, metrics: GatewayMetrics,
                 record: Callable[..., None] | None = None, *, whole: bool = False) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.record = record        # (endpoint, Outcome, cause): the breakers' (gateway.resilience.breaker.Breakers.record)
        self.whole = whole          # complete answers may be written whole (gateway/pipeline/whole.py)

    def _headers(self, ctx: RequestContext) -> dict[str, str]:
        headers = ctx.rec.response_headers()
        if ctx.decision is not None:
            headers.update(ctx.decision.headers)
        return headers

    def head_ahead(self, ctx: RequestContext, resp: UpstreamResponse, made: HeadAhead | None = None) -> HeadAhead | None:
        """The client's headers and head for ``resp``'s event stream, made now, while its first
        bytes are awaited (a P/D decode's KV transfer), for ``answer``: the first token then finds
        them made; ``made``: those ``stream_ahead`` made already. None when the gateway does not
        write the head itself, or ``resp`` is no stream."""
        if not self.whole or resp.status != 200 or not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            return None
        return made if made is not None else self.stream_ahead(ctx)

    def stream_ahead(self, ctx: RequestContext) -> HeadAhead | None:
        """The client's headers and head for a 200 event stream, made before the engine answers
        (its leg is written, the engine computes): an engine that sends its head with its first
        token (SGLang) then finds them made. ``answer`` uses them for a 200 event stream only. None
        when the gateway does not write the head itself."""
        if not self.whole:
            return None
        headers = {**self._headers(ctx), **SSE_HEADERS}
        made = stream_head(ctx.http, headers, SSE_TYPE)
        return None if made is None else HeadAhead(headers, made, time.monotonic())

    async def answer(self, ctx: RequestContext, resp: UpstreamResponse, adapter: EngineAdapter,
                     strip_usage: bool, wd: WatchdogConfig | None, ahead: HeadAhead | None = None,
                     gate: Gate | None = None) -> web.StreamResponse:
        """The client's answer from an engine's response: its error, its stream or its body.
        ``ahead``: its stream's headers and head, made while its head or first bytes were awaited
        (``stream_ahead``, ``head_ahead``); used for a 200 event stream only.
        ``gate``: with ``ahead``, the stream's first bytes must pass it before the client sees
        anything (a P/D decode's, checked in the read that brings them: ``_stream``); else
        ``FirstBytesFailed`` is raised, and the caller decides the answer."""
        cancelled = unstarted = False
        try:
            ctype = dict.get(resp.headers, "content-type", "application/json")     # names stored lower-cased (coding_of)
            if ahead is not None and (resp.status != 200 or not ctype.startswith("text/event-stream") or (
                    gate is None and time.monotonic() - ahead.at > HeadAhead.FRESH_S)):
                ahead = None        # no stream, or made too long ago: its Date would be off (behind a gate: checked then)
            headers = ahead.headers if ahead is not None else self._headers(ctx)
            if resp.status != 200:
                return await self._error(ctx, resp, headers)
            sse = ctype.startswith("text/event-stream")
            if ctx.ireq is not None and sse != ctx.ireq.stream:
                self._mismatch(ctx, ctype)
            if (coding := coding_of(resp)) is not None:
                self._coded(ctx, coding)
            if sse:
                if ctx.migration is not None and ctx.migration.active:    # gateway/pipeline/migration.py
                    return await ctx.migration.stream(self, ctx, resp, headers, wd)
                return await self._stream(ctx, resp, headers, strip_usage, wd, ahead, gate)
            return await self._body(ctx, resp, adapter, headers, ctype, wd)
        except asyncio.CancelledError:
            cancelled = True
            raise
        except FirstBytesFailed:        # its caller tells the breaker
            unstarted = True
            raise
        finally:
            self.settle(ctx, resp, cancelled, unstarted)

    def _mismatch(self, ctx: RequestContext, ctype: str) -> None:
        """A 200 whose framing is not the one asked for (an event stream to a request that wants
        the body whole, or a body to one that wants a stream): no client of either kind could read
        it."""
        wanted = "a stream" if ctx.ireq is not None and ctx.ireq.stream else "a whole body"
        self._protocol_fault(ctx, f"upstream answered a request for {wanted} with Content-Type "
                                  f"{safe_header_value(ctype)[:80]!r}")

    def _not_an_object(self, ctx: RequestContext, ctype: str) -> None:
        """A whole 200 to a chat, completion or embedding request, or to an API's whose answers are
        objects (Messages, Responses), that is not a JSON object (a proxy's page in front of the
        engine, a body cut short yet framed as whole): no SDK could read it."""
        self._protocol_fault(ctx, f"upstream answered 200 with a body that is not a JSON object (Content-Type "
                                  f"{safe_header_value(ctype)[:80]!r})")

    def _coded(self, ctx: RequestContext, coding: str) -> None:
        """A 200 in a content or transfer coding (``coding_of``): its bytes relayed would be
        unreadable."""
        self._protocol_fault(ctx, f"upstream answered in a coding the gateway does not decode: "
                                  f"{safe_header_value(coding)[:80]!r}")

    def _protocol_fault(self, ctx: RequestContext, message: str) -> None:
        """A 200 no client could read: the engine's protocol fault, a 502 upstream_bad_response,
        before anything reached the client; counted under ``protocol``."""
        rec = ctx.rec
        rec.error_class = ErrorClass.UPSTREAM_PROTOCOL
        self.metrics.child(self.metrics.upstream_errors, rec.model, rec.endpoint, "protocol").inc()
        if (decode := _decode_of(ctx)) is not None:     # a P/D decode's: the header and message say which leg
            raise GatewayError(502, f"decode endpoint {decode}: {message}", code="upstream_bad_response",
                               header=("x-error-pd-decode", "bad_response"), error_class=ErrorClass.UPSTREAM_PROTOCOL)
        raise GatewayError(502, message, code="upstream_bad_response", header=("x-error-upstream", "protocol"),
                           error_class=ErrorClass.UPSTREAM_PROTOCOL)

    async def stream_from_head(self, ctx: RequestContext, resp: UpstreamResponse, strip_usage: bool,
                               wd: WatchdogConfig | None, ahead: HeadAhead,
                               on_head: Callable[[UpstreamResponse], None]) -> web.StreamResponse:
        """``answer`` for a stream whose engine sends its head with its first token (SGLang), taken
        from the read that brings them, before ``resp``'s head has come: the head and the first
        event go to the client from that read (its client head ``ahead``, made already), with no
        task woken on the first token's way; ``on_head(resp)`` from there. When what comes is not a
        200 event stream, or nothing does (a failure, an empty answer), ``FirstBytesFailed`` with
        ``resp`` as it came (nothing read from it, nothing recorded): the caller answers it as usual."""
        def came(first: bytes) -> object:
            on_head(resp)
            return None

        cancelled = untouched = False
        try:
            return await self.stream_early(ctx, resp, strip_usage, wd, ahead, came)
        except FirstBytesFailed:
            untouched = True            # the caller's, with ``resp`` as it came
            raise
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            if not untouched:
                self.settle(ctx, resp, cancelled, False)

    async def stream_early(self, ctx: RequestContext, resp: UpstreamResponse, strip_usage: bool,
                           wd: WatchdogConfig | None, ahead: HeadAhead, gate: Gate) -> web.StreamResponse:
        """The relay of ``stream_from_head`` without its end's bookkeeping (``settle``, the
        caller's): ``gate`` checks the first bytes once the head came and is a 200 event stream."""
        def head_then(first: bytes) -> object:
            if resp.status != 200 or not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                return "not a 200 event stream"
            if coding_of(resp) is not None:
                return "in a content coding"
            return gate(first)

        return await self._stream(ctx, resp, ahead.headers, strip_usage, wd, ahead, head_then, before_head=True)

    def settle(self, ctx: RequestContext, resp: UpstreamResponse, cancelled: bool, unstarted: bool) -> None:
        """An answer relayed, or given up: the connection back to the pool when it was read to the
        end (closed otherwise: the engine stops), and how it ended told to the endpoint's breaker."""
        if resp.at_eof():
            resp.release()
        else:
            resp.close()
        if ctx.migration is not None and ctx.migration.silent is not None:
            return      # it ended as a continuation's leg silent before its head, whose breaker heard it
        if self.record is not None and ctx.decision is not None and not unstarted:
            rec, ep = ctx.rec, ctx.decision.endpoint
            # (a P/D decode closed for its prefill's failure, ``ctx.pd_prefill_failed``: not its fault)
            outcome = (Outcome.NONE if cancelled or ctx.pd_prefill_failed is not None
                       else of_status(resp.status, ep.api_key is not None)
                       if resp.status != 200 else of_answer(rec.status, rec.error_class))
            cause = rec.error_class or ""
            broke = ctx.migration.broke_whole if ctx.migration is not None else None
            if broke is not None and outcome == Outcome.SUCCESS:
                # its engine broke after the answer's last token, which the gateway ended itself
                outcome, cause = Outcome.FAULT, broke
            self.record(ep, outcome, cause)

    def error_answer(self, ctx: RequestContext, status: int, body: bytes, headers: dict[str, str]) -> web.StreamResponse:
        """An error answer (``body``: the error in the request's API shape), written whole when it may be."""
        if self.whole:
            written = write_whole(ctx.http, status, headers, "application/json", body)
            if written is not None:
                return written      # type: ignore[return-value]
        return error_response(status, body, headers)

    async def _error(self, ctx: RequestContext, resp: UpstreamResponse, headers: dict[str, str]) -> web.StreamResponse:
        rec = ctx.rec
        if resp.status < 300 or resp.status == 304:
            # a success other than 200 (201, 203, ...) or a status no body may follow (204, 205, 304):
            # relayed with its status, an error body would read as a success (or, bodiless, not be
            # written at all); no client of these APIs can read it, so it is the engine's protocol fault
            self._protocol_fault(ctx, f"upstream answered with status {resp.status}")
        ep = ctx.decision.endpoint if ctx.decision is not None else None
        if ep is not None and key_refused(resp.status, ep.api_key is not None):
            # the gateway's key for the engine is wrong: the operator's to fix, so a 502, and the
            # engine's body (which may echo what it was sent) is not passed on
            engine_key_refused(self.metrics, ep, rec.model, resp.status, ctx.ireq.path if ctx.ireq is not None else "")
            rec.error_class = ErrorClass.UPSTREAM_AUTH
            raise key_refused_error(resp.status)
        raw = await read_error_body(resp, self.cfg.max_error_body_bytes)
        if ctx.api is not None:       # in the request's API shape (Anthropic's on /v1/messages)
            status, body, message = ctx.api.upstream_error(resp.status, raw, ctx)
        else:
            status, err = normalize_upstream_error(resp.status, raw)
            body, message = orjson.dumps(err), str(err["error"].get("message"))
        rec.status = status
        rec.error_class = ErrorClass.UPSTREAM_STATUS
        rec.error = message[:200]
        # the engine's status, not the one its API answers it with (Anthropic's 529 for a 503)
        self.metrics.child(self.metrics.upstream_errors, rec.model, rec.endpoint, f"status_{resp.status}").inc()
        if "Retry-After" in resp.headers:
            headers["Retry-After"] = resp.headers["Retry-After"]
        elif resp.status in ENGINE_RETRY_AFTER:     # the engine named no wait: every 429, 503 and 529 names one
            headers["Retry-After"] = ENGINE_RETRY_AFTER[resp.status]
        if resp.status == 405 and "Allow" in resp.headers:      # the methods the engine serves there
            headers["Allow"] = resp.headers["Allow"]
        if ctx.pd_plan is not None:     # a P/D decode leg's answer: which leg failed, as a prefill's says
            headers["x-error-pd-decode"] = "http_status"
        return self.error_answer(ctx, status, body, headers)

    async def _stream(self, ctx: RequestContext, resp: UpstreamResponse, headers: dict[str, str],
                      strip_usage: bool, wd: WatchdogConfig | None, ahead: HeadAhead | None = None,
                      gate: Gate | None = None, before_head: bool = False) -> web.StreamResponse:
        """``before_head``: ``resp``'s head has not come (``stream_from_head``): the watchdog starts
        once the first bytes passed the gate, and bytes it turns down are left in ``resp``."""
        rec = ctx.rec
        clock = time.perf_counter   # not loop.time(): uvloop's clock is cached per iteration, at 1 ms
        api = ctx.api
        if api is not None:
            scanner = api.scanner(ctx)
        elif ctx.ireq is not None and ctx.ireq.choices > 1:     # a chat's or completion's, parsed
            # several choices, interleaved: choice 0's gaps alone; each choice's finish as it comes
            ireq = ctx.ireq         # n: the choices of each prompt (``fan`` times the prompts is ``sequences``)
            scanner = ChoicesScanner(ireq.choices, strip_usage, ireq.choices * ireq.fan // ireq.sequences)
            rec.extra["finish_reasons"] = scanner.finish_reasons
        else:
            scanner = SSEScanner(strip_usage)
        cut = api is None
        if cut:     # the stream ends at [DONE]: what the engine writes after it is not relayed
            scanner.ends_at_done = True     # type: ignore[union-attr]
        # the first bytes already here (a P/D decode's, read before the head), or a gate for them:
        # the head goes out with them, in one write, when the gateway writes it itself; behind a
        # gate the answer begins only once they pass it (until then the client has seen nothing)
        out = await open_sse(ctx, headers, self.whole, resp.buffered or gate is not None, ahead, gate is None)
        holding = isinstance(out, WrittenStream) and out.holding
        gating = gate is not None
        assert not gating or holding, "a gated stream's head is held until its first bytes pass"
        refused: object = None          # what the gate said of first bytes it turned down
        # a gated stream's keep-alive comments so far: no first bytes yet (the head still waits),
        # they go out with the first bytes that are more than comments
        pre = b""
        held_at = ahead.at if ahead is not None else time.monotonic()

        def opened(first_bytes: bytes) -> bool:
            """Whether a gated stream's first bytes pass its gate; then its answer begins."""
            nonlocal gating, refused
            why = gate(first_bytes)     # type: ignore[misc]
            if why is not None:
                refused = why
                return False
            gating = False
            if time.monotonic() - held_at > HeadAhead.FRESH_S:     # a long KV transfer: its Date anew
                out.renew_head(ctx.http, SSE_TYPE)      # type: ignore[attr-defined]
            began(ctx, out)
            return True

        def watch_idle() -> None:
            """Before the head (``before_head``) the first chunk came with it: the idle bound from here."""
            nonlocal watch
            if idle_to:
                watch = Watchdog(resp, 0.0, idle_to)

        # the terminal event, or the engine's own error event that ended the answer, went through:
        # the engine's end within END_GRACE_S
        ended = False
        broke = False           # the engine's end failed after its own error event ended the answer

        def after_end() -> None:
            nonlocal watch, ended
            ended = True
            if cut and scanner.trailing:    # type: ignore[union-attr]   # bytes after [DONE] in its read
                raise _PastDone
            if watch is None:
                watch = Watchdog(resp, 0.0, END_GRACE_S)
            else:
                watch.end_within(END_GRACE_S)

        readany = resp.readany
        write = out.write
        feed = scanner.feed
        # a chat whose answer the KV-events router tokenizes ahead of the next turn: collected as it passes
        told = ctx.ireq.answered if ctx.ireq is not None else None
        kept = _Kept(feed) if told is not None else None
        if kept is not None:
            feed = kept
        first_to = wd.first_chunk_timeout_s if wd is not None else 0.0
        idle_to = wd.idle_timeout_s if wd is not None else 0.0
        failure: bytes | None = None
        watch: Watchdog | None = None
        # aiohttp's StreamResponse sends its headers in ``prepare``, so with chunked framing the body
        # is piped from the first chunk on: each read from the engine is scanned and written to the
        # client from the upstream connection's read callback, framed as aiohttp frames a chunk,
        # with no task wake-up per chunk (the first one included: it is the stream's TTFT). When
        # the client stops keeping up (its transport pauses writing) the pipe ends, the task waits
        # for the client to drain (the watchdog does not count it) and pipes again.
        http = ctx.http
        proto, transport = http.protocol, http.transport
        pipe_ok = out.headers.get("Transfer-Encoding") == "chunked" and transport is not None
        drain = http.writer.drain
        pipe = resp.pipe
        unpipe = resp.unpipe
        time_now = asyncio.get_running_loop().time
        first = False           # the watchdog still bounds the wait for the first chunk
        # a read the scanner passes on as it came (it only watches it: no usage to strip there,
        # no API to translate) is written before it is scanned, so the scan adds nothing to its latency
        passes = scanner.passes if api is None else None

        def sink(chunk: bytes) -> None:
            nonlocal first, pre
            held = gating               # a gated stream's first bytes: the gate, then the head with them
            if held:
                if pre:
                    chunk, pre = pre + chunk, b""
                if not has_fields(chunk):
                    pre = chunk         # comments alone: the first bytes are still to come
                    return
                if not opened(chunk):
                    resp.unread(chunk)  # turned down: nothing written, the bytes left, the task raises
                    unpipe()
                    return
            now = clock()
            early = passes is not None and passes(chunk)
            data = chunk if early else feed(chunk, now)
            if scanner.error is not None and not ended and cut:
                data = string_code(data)    # the read whose error event ended the answer (never ``early``)
            if data:
                if transport.is_closing():
                    raise ConnectionResetError("Cannot write to closing transport")
                if held:
                    out.send(data)      # type: ignore[attr-defined]
                else:
                    transport.write(b"%x\r\n%b\r\n" % (len(data), data))
                if early:
                    feed(chunk, now)
                if proto._paused:       # ``writing_paused``'s flag (aiohttp's BaseProtocol), read once a chunk
                    unpipe()
            elif held:
                out.send_head()         # type: ignore[attr-defined]   # nothing of it for the client
            elif cut and scanner.trailing:  # type: ignore[union-attr]   # a read after [DONE]: dropped, the stream ends
                raise _PastDone
            if held and before_head:
                watch_idle()            # after the first write: off the first token's way
            # comments alone are no progress, nor is anything after the end (awaited END_GRACE_S at most)
            if watch is not None and scanner.moved and not ended:
                if first:
                    first = False
                    watch.first_chunk_came()
                watch.since = time_now()
            if not ended and (scanner.done or scanner.error is not None):
                after_end()

        try:
            if (first_to or idle_to) and not before_head:
                watch = Watchdog(resp, first_to, idle_to)
                first = True
            # a held head goes out through ``write``, not the pipe, unless the sink sees it first
            sent = pipe_ok and (gating or not holding)
            try:
                while True:
                    if sent:
                        if proto.writing_paused:
                            await drain()
                        if watch is not None and scanner.moved and not ended:
                            watch.since = time_now()
                        chunk = await pipe(sink)
                        if refused is not None:     # the sink turned the first bytes down
                            if chunk:
                                resp.unread(chunk)
                            raise FirstBytesFailed("refused", refused)
                        if chunk is None:       # unpiped, nothing buffered: drain, then pipe again
                            continue
                    else:
                        if watch is not None and not first and scanner.moved and not ended:
                            watch.since = time_now()
                        chunk = await readany()
                    if gating:
                        if not chunk:
                            raise FirstBytesFailed("empty")
                        if pre:
                            chunk, pre = pre + chunk, b""
                        if not has_fields(chunk):
                            pre = chunk         # comments alone: the first bytes are still to come
                            continue
                        if not opened(chunk):
                            resp.unread(chunk)
                            raise FirstBytesFailed("refused", refused)
                        if before_head:
                            watch_idle()
                    if not chunk:
                        break
                    now = clock()
                    early = passes is not None and passes(chunk)
                    data = chunk if early else feed(chunk, now)
                    if scanner.error is not None and not ended and cut:
                        data = string_code(data)
                    if data:
                        await write(data)
                        sent = pipe_ok
                    elif holding:               # nothing of the first read for the client: the head alone
                        out.send_head()         # type: ignore[attr-defined]
                    elif cut and scanner.trailing:  # type: ignore[union-attr]   # a read after [DONE]: dropped, the stream ends
                        raise _PastDone
                    if early:
                        feed(chunk, now)
                    if first and scanner.moved:     # comments alone are not the first chunk
                        first = False
                        watch.first_chunk_came()    # type: ignore[union-attr]
                    if not ended and (scanner.done or scanner.error is not None):
                        after_end()
            except (WatchdogFired, UpstreamError) as e:
                if gating or not (scanner.done or scanner.error is not None):
                    raise
                # the answer's terminal event came first ([DONE], or its API's), or the engine's own
                # error event, which ended it and names its failure: the engine's end that failed
                # after it is no failure of the answer's (no second error event after the engine's)
                rec.extra["after_end"] = e.phase if isinstance(e, WatchdogFired) else "broken"
                broke = not scanner.done
            except _PastDone:           # (its read may have ended the body too: the end is read as such)
                pass
            if cut and scanner.trailing:    # type: ignore[union-attr]
                # the engine wrote on after [DONE]: nothing of it went out, and its connection, whose
                # next bytes would be no answer's, is not used again
                rec.extra["after_end"] = "trailing"
                resp.close()
            tail = scanner.finish()
            if broke:       # the start of an event the broken connection cut short is not passed on
                tail = b""
            if api is not None and scanner.done:    # its state is kept before its last event goes out
                await api.finish(ctx)
            # an event the engine's stream ended in without its blank line: passed on when the
            # stream ends well (a last ``[DONE]`` or error event), ended by the blank line it lacked
            # (an SSE client dispatches an event at its blank line only, and drops one its stream
            # ends in), dropped when it ends in the gateway's error event, which would be glued onto
            # it; a translated stream's tail is its API's own whole events
            if tail and (api is not None or scanner.done or scanner.error is not None):
                if scanner.error is not None and cut:
                    tail = string_code(tail)
                await write(ended_event(tail))
            if not scanner.done and scanner.error is None:
                if api is not None and await api.closed_early(ctx):
                    pass                # its own end (a cancelled background response): no failure
                else:
                    rec.error_class, rec.error = failure = of_leg(ctx, EOF_FAILURE)
            elif scanner.done:
                rec.delivered = True    # the client has the whole answer
        except WatchdogFired as w:
            if gating:
                raise _unstarted(refused, FirstBytesFailed("timeout", w.seconds)) from None
            watchdog_fired(ctx, self.metrics, w.phase, w.seconds)
            rec.error_class, rec.error = failure = stream_failure(w, ctx)
            self.metrics.child(self.metrics.upstream_errors, rec.model, rec.endpoint, rec.error_class).inc()
        except UpstreamTimeout as e:
            # upstream.total_timeout_s: the whole exchange took too long
            if gating:
                raise _unstarted(refused, FirstBytesFailed("broken", e)) from None
            rec.error_class, rec.error = failure = stream_failure(e, ctx)
            self.metrics.child(self.metrics.upstream_errors, rec.model, rec.endpoint, rec.error_class).inc()
        except UpstreamError as e:
            # the engine's side broke mid-stream (a client-side write failure raises
            # ConnectionResetError, handled below as a cancel)
            if gating:
                raise _unstarted(refused, FirstBytesFailed("broken", e)) from None
            rec.error_class, rec.error = failure = stream_failure(e, ctx)
            self.metrics.child(self.metrics.upstream_errors, rec.model, rec.endpoint, BROKEN_STREAM).inc()
        except ConnectionResetError:
            # the client went away while we wrote: same as a disconnect (after the engine's error
            # event, which it had: that error ended the answer, and is recorded)
            if scanner.error is not None:
                _engine_error(rec, scanner.error)
            else:
                rec.error_class = ErrorClass.CLIENT_CANCEL
            raise asyncio.CancelledError from None
        except asyncio.CancelledError:
            if not gating:
                # the client left once it had the answer's terminal event, while the engine's end
                # was awaited (a client that stops reading at [DONE] and closes): the answer is
                # complete. Either way what it received is recorded: its TTFT, its gaps, and the
                # engine's error event it left on (the SDKs raise on one and close)
                rec.delivered = scanner.done and api is None
                self.observe_stream(rec, scanner)
                if scanner.error is not None:
                    _engine_error(rec, scanner.error)
            raise
        finally:
            if watch is not None:
                watch.cancel()
        if failure is None and scanner.error is not None:   # the engine's error event went through
            _engine_error(rec, scanner.error)
        if ctx.migration is not None and (failure is not None or scanner.error is not None):
            ctx.migration.unmigrated(rec, rec.error_class or ErrorClass.UPSTREAM_STREAM_ERROR)   # refused: counted
        out = await self.end_stream(ctx, out, scanner, failure)
        if kept is not None and failure is None and scanner.error is None and scanner.done:
            answer = kept.answer
            text = answer.text()
            told(text, answer.gone or "not_text")       # type: ignore[misc]
        return out

    async def end_stream(self, ctx: RequestContext, out: web.StreamResponse, scanner: StreamScanner,
                         failure: StreamFailure | None) -> web.StreamResponse:
        """The end of a relayed stream, the plain relay's and a migrating stream's
        (gateway/pipeline/migration.py): what the client received goes to the metrics; a failure
        (recorded on the request by the caller) is the stream's last event, a 504 for a timeout and
        a 502 otherwise; then the end. The client gone while this is written is a cancel."""
        self.observe_stream(ctx.rec, scanner)
        try:
            if failure is not None:
                error_class, message = failure
                status, code = (504, "upstream_timeout") if error_class.is_timeout else (502, "upstream_incomplete")
                last = self.failure_event(ctx, status, message, code)
                if ctx.api is not None:
                    await ctx.api.failed(ctx)
                await out.write(last)
            elif scanner.error is not None and not scanner.done and ctx.api is not None:
                # the engine's own error event ended it: its API may owe a terminal event after it
                last = ctx.api.stream_errored(ctx)
                if last:
                    await ctx.api.failed(ctx)
                    await out.write(last)
            await out.write_eof()
        except ConnectionResetError:
            raise asyncio.CancelledError from None     # (an answer delivered whole stays so: ``rec.delivered``)
        return out

    @staticmethod
    def failure_event(ctx: RequestContext, status: int, message: str, code: str) -> bytes:
        """The event that ends a stream the gateway cannot complete, in the request's API shape."""
        if ctx.api is not None:
            return ctx.api.stream_error(ctx, status, message, code)
        return error_event(status, message, code=code)

    def observe_stream(self, rec: RequestRecord, scanner: StreamScanner) -> None:
        """A stream's first token, inter-token gaps, finish and usage, into the record and metrics."""
        m = self.metrics
        if scanner.first_token_at is not None:
            rec.ttft = scanner.first_token_at - rec.started
            if scanner.last_token_at is not None:
                rec.last_token = scanner.last_token_at - rec.started
            m.child(m.ttft, rec.model).observe(rec.ttft)
            gaps = scanner.drain_itl()
            if gaps:
                observe_all(m.child(m.itl, rec.model), gaps)
        rec.finish_reason = scanner.finish_reason
        rec.engine_model = scanner.model
        rec.streamed_events = scanner.token_events
        self.account_usage(rec, scanner.usage)

    async def _body(self, ctx: RequestContext, resp: UpstreamResponse, adapter: EngineAdapter,
                    headers: dict[str, str], ctype: str, wd: WatchdogConfig | None) -> web.Response:
        rec = ctx.rec
        limit = wd.response_timeout_s if wd is not None else 0.0
        most = self.cfg.max_response_bytes
        try:
            if limit:
                async with asyncio.timeout(limit):
                    body = await resp.read(most)
            else:
                body = await resp.read(most)
        except UpstreamTooLarge as e:
            # not read on: ``settle`` closes the connection (the engine stops), and nothing of it is held
            rec.error_class = ErrorClass.UPSTREAM_TOO_LARGE
            rec.extra["upstream_bytes"] = e.declared if e.declared is not None else e.received
            self.metrics.child(self.metrics.upstream_errors, rec.model, rec.endpoint, "too_large").inc()
            raise too_large_error(e.limit) from None
        except (TimeoutError, UpstreamTimeout) as e:
            if isinstance(e, TimeoutError):
                watchdog_fired(ctx, self.metrics, "response", limit)
            rec.error_class = ErrorClass.WATCHDOG_RESPONSE if isinstance(e, TimeoutError) else ErrorClass.UPSTREAM_TIMEOUT
            self.metrics.child(self.metrics.upstream_errors, rec.model, rec.endpoint, rec.error_class).inc()
            secs = limit if isinstance(e, TimeoutError) else e.seconds
            if (decode := _decode_of(ctx)) is not None:     # a P/D decode's: the header says which leg
                raise GatewayError(504, f"decode endpoint {decode} did not finish responding within {secs:g}s",
                                   code="upstream_timeout", header=("x-error-pd-decode", "true"),
                                   error_class=rec.error_class) from None
            raise GatewayError(504, f"the engine did not answer within {secs:g}s", code="upstream_timeout",
                               header=("x-error-upstream", "timeout"), error_class=rec.error_class) from None
        except UpstreamError as e:
            rec.error_class = ErrorClass.UPSTREAM_BROKEN
            if ctx.pd_prefill_failed is None:   # (else closed for its prefill's failure: not its fault)
                self.metrics.child(self.metrics.upstream_errors, rec.model, rec.endpoint, "broken_body").inc()
            message = f"the engine connection broke before the answer was complete: {type(e).__name__}"
            decode = _decode_of(ctx)
            raise GatewayError(502, message if decode is None else f"decode endpoint {decode}: {message}",
                               code="upstream_incomplete",
                               header=("x-error-upstream", "reset") if decode is None else ("x-error-pd-decode", "reset"),
                               error_class=rec.error_class) from None
        data = None
        if (ctype.startswith("application/octet-stream") and ctx.ireq is not None and ctx.ireq.path in BINARY_PATHS
                and ctx.ireq.data.get("encoding_format") in BINARY_FORMATS):
            return self._binary(ctx, resp, headers, ctype, body)
        if ctx.api is None:
            routed = ctx.ireq is not None and ctx.ireq.path in ROUTED_PATHS
            if routed or b'"usage"' in body:
                try:
                    data = answer_view(body)
                except orjson.JSONDecodeError:
                    data = None
                if routed and not isinstance(data, dict):
                    self._not_an_object(ctx, ctype)
        rec.status = 200
        if ctx.api is not None:           # another API's body: its own usage and state
            body = await self._api_body(ctx, body, ctype)
        elif data is not None:
            if isinstance(data, dict):
                self.account_usage(rec, adapter.usage(data))
                model = data.get("model")
                if model.__class__ is str:
                    rec.engine_model = model
                match data.get("choices"):
                    case [dict() as choice]:
                        rec.finish_reason = choice.get("finish_reason")
                    case [dict(), _, *_] as choices:        # several: choice 0's, as a stream's
                        whole_finishes(rec, choices)
                told = ctx.ireq.answered if ctx.ireq is not None else None
                if told is not None:        # after the answer is written
                    asyncio.get_running_loop().call_soon(told, message_text(data))
        return self._ok(ctx, headers, ctype, body)

    def _ok(self, ctx: RequestContext, headers: dict[str, str], ctype: str, body: bytes) -> web.Response:
        """A whole 200 answer: written at once where the edge lets it (``write_whole``), else as
        aiohttp's response."""
        if self.whole:
            written = write_whole(ctx.http, 200, headers, ctype, body)
            if written is not None:
                if written.unsent:      # a client slower than its answer: its line once the body went
                    ctx.unsent = written
                return written      # type: ignore[return-value]    # what aiohttp reads of a response
            transport = ctx.http.transport
            if transport is not None and transport.is_closing():
                return self._gone(ctx)
            if ctx.http.__class__ is web.Request:
                # aiohttp writes it once the handler returned (an HTTP/1.0 client's): its line and
                # span follow the write
                r = ctx.unsent = WatchedResponse(status=200, body=body, headers=headers)
                r.headers["Content-Type"] = ctype
                return r
        r = web.Response(status=200, body=body, headers=headers)
        r.headers["Content-Type"] = ctype
        return r

    def _gone(self, ctx: RequestContext) -> web.Response:
        """The client's connection was lost as the answer came (its reset read in the same loop turn
        as the engine's answer, before the handler wrote it): no byte of it can reach the client, so
        the request is the client's cancel (499), as when the connection is lost while the body
        goes out; the engine did the work, and its usage is charged alike."""
        rec = ctx.rec
        rec.status = 499
        rec.error_class = ErrorClass.CLIENT_CANCEL
        self.metrics.child(self.metrics.client_cancels, rec.label_model, "before_headers").inc()
        ctx.trace.event("abort", {"switchyard.abort.by": "client"})
        return web.Response(status=499)     # (not written: the transport closes)

    def _binary(self, ctx: RequestContext, resp: UpstreamResponse, headers: dict[str, str], ctype: str,
                body: bytes) -> web.Response:
        """vLLM's binary embeddings (``encoding_format`` "bytes", "bytes_only" on /v1/embeddings and
        /pooling): the vectors' bytes, relayed as they came, with the engine's ``metadata`` header
        (each vector's offsets, dtype and shape, without which the bytes cannot be read back, and
        the usage, counted here); "bytes_only" has none, and its estimate stays charged."""
        rec = ctx.rec
        rec.status = 200
        meta = dict.get(resp.headers, "metadata")      # names stored lower-cased (coding_of)
        if meta is not None:
            headers = {**headers, "metadata": meta}
            try:
                usage = orjson.loads(meta).get("usage")
            except (orjson.JSONDecodeError, AttributeError):
                usage = None
            if isinstance(usage, dict):
                self.account_usage(rec, usage)
        return self._ok(ctx, headers, ctype, body)

    async def _api_body(self, ctx: RequestContext, body: bytes, ctype: str) -> bytes:
        """Another API's whole answer: its usage counted, its state kept; the body to send (the
        engine's, unless the API reshaped it). One that is not a JSON object, from an API whose
        answers are one (``object_answers``), is the engine's protocol fault, as on chat."""
        assert ctx.api is not None
        names = ctx.api.answer_members
        data = members_view(body, names) if names and len(body) > VIEW_ABOVE else None
        if data is None:
            try:
                data = orjson.loads(body)
            except orjson.JSONDecodeError:
                # a number beyond a double's range in a member not read is skipped at any size (answer_view)
                data = members_view(body, names) if names and len(body) <= VIEW_ABOVE else None
                if data is None:
                    if ctx.api.object_answers:
                        self._not_an_object(ctx, ctype)
                    return body
        if ctx.api.object_answers and not isinstance(data, dict):
            self._not_an_object(ctx, ctype)
        if isinstance(data, dict):
            self.account_usage(ctx.rec, ctx.api.body_usage(ctx, data))
            model = data.get("model")       # (a large answer's view reads only the API's members)
            if model.__class__ is str:
                ctx.rec.engine_model = model
            body = ctx.api.answer_body(ctx, data, body)
            await ctx.api.finish(ctx)
        elif isinstance(data, list):        # SGLang's rerank: its usage is in the items
            self.account_usage(ctx.rec, ctx.api.list_usage(ctx, data))
        return body

    def account_usage(self, rec: RequestRecord, usage: dict | None) -> None:
        if not usage:
            return
        p, c, cached = usage_tokens(usage)
        rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens = p, c, cached
        if not c and usage.get("completion_tokens", 0) is None:
            rec.completion_tokens = None    # a usage that reports no output count yet (a Messages stream's start)
        m = self.metrics
        if p:
            m.child(m.prompt_tokens, rec.model).inc(p)
        if c:
            m.child(m.completion_tokens, rec.model).inc(c)
        if cached:
            m.child(m.cached_tokens, rec.model).inc(cached)


def _engine_error(rec: RequestRecord, error: object) -> None:
    """The engine's error event ended the stream: on the request's record (one with code 501 is the
    engine's 501, the request's fault, not the engine's)."""
    rec.error_class = ErrorClass.UPSTREAM_STREAM_UNSUPPORTED if unsupported_event(error) else ErrorClass.UPSTREAM_STREAM_ERROR
    msg = error.get("message") if isinstance(error, dict) else None
    rec.error = str(msg)[:200] if msg else "in-stream error"


class _Kept:
    """A scanner's ``feed`` that also collects the stream's answer (``answer``) as it passes."""

    __slots__ = ("answer", "_feed")

    def __init__(self, feed: Callable[[bytes, float], bytes]) -> None:
        self.answer = AnswerText()
        self._feed = feed

    def __call__(self, chunk: bytes, now: float) -> bytes:
        self.answer.add(chunk)
        return self._feed(chunk, now)
