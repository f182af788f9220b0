"""Prefill/decode orchestration: run an engine adapter's plan of two legs.

The plan (``handlers``) says whether the legs run one after the other or together, what each
body is, and how to abort a leg. This module runs it with the same failure semantics for every
engine:

- sequential (vLLM, context-first): the prefill runs to completion; the decode body is built from
  its answer; a failed prefill fails the request at once, with no decode leg.
- concurrent (SGLang, bootstrap): both legs start together; the prefill answers only after the
  decode took the KV. A terminal prefill failure fails the client if nothing was sent yet; once
  the decode streams, a late prefill failure is logged and the stream runs on. A decode leg that
  ends without being relayed, for whatever reason (prefill failure, decode failure or timeout,
  watchdog, client gone), is aborted once it is over if any byte of its request may have been
  written (``SendState``) and the engine did not end it itself with an error answer.

The decode watchdog is armed when the decode leg starts (concurrent: once the prefill
succeeded): a first-chunk bound for streams, a whole-answer bound for non-streams (off by
default), and an idle bound between chunks (in the relay). On fire the decode is aborted and
counted by phase.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

import orjson
import structlog
from aiohttp import web

from gateway.config.schema import Config
from gateway.endpoints import Endpoint, EndpointPool
from gateway.errors import ErrorClass, GatewayError, normalize_upstream_error
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.tracing import Leg
from gateway.pipeline.context import RequestContext
from gateway.pipeline.relay import (
    ENGINE_RETRY_AFTER,
    FirstBytesFailed,
    HeadAhead,
    Relay,
    read_error_body,
    watchdog_fired,
)
from gateway.pipeline.sse import has_fields
from gateway.resilience.outcome import Outcome, event_status, key_refused, of_status, unsupported_event
from gateway.resilience.retry import Retries
from gateway.upstream.h1client import Exchange, SendState, UpstreamError, UpstreamResponse
from gateway.upstream.upstream import (
    Upstream,
    UpstreamFailure,
    engine_key_refused,
    head_timeout,
    no_socket_error,
    upstream_headers,
)
from handlers.base import AbortSpec, BadPrefillAnswer, EngineAdapter, PDPlan
from routers.pd import in_bucket

log = structlog.get_logger("switchyard.pd")

Spawn = Callable[[Coroutine[Any, Any, Any]], asyncio.Task]


class PrefillFailed(Exception):
    """Classes: timeout, transport, http_status, bad_response. ``kind``: the upstream failure's
    (``connect`` for a refused connection) when there was one."""

    def __init__(self, failure_class: str, message: str, status: int | None = None, kind: str = "",
                 retryable: bool = False, refusal: dict[str, Any] | None = None,
                 retry_after: str | None = None, too_large: int | None = None) -> None:
        super().__init__(message)
        self.failure_class = failure_class
        self.message = message
        self.status = status
        self.kind = kind
        self.retryable = retryable      # refused, reset (its engine died), or an answer no decode can use
        # the engine's client error (``status`` a 4xx other than backpressure, or 501), normalized:
        # the request's own fault, answered as the engine answered it
        self.refusal = refusal
        self.retry_after = retry_after  # the engine's Retry-After, on its answer of ``status``
        self.too_large = too_large      # the answer passed upstream.max_response_bytes, this one

    def client_error(self, prefill: Endpoint) -> GatewayError:
        if self.refusal is not None and self.status is not None:
            e = self.refusal
            return GatewayError(self.status, str(e.get("message") or f"prefill answered {self.status}"),
                                param=e.get("param"), code=e.get("code"), type_=e.get("type"),
                                header=("x-error-pd-prefill", self.failure_class),
                                error_class=ErrorClass.pd_prefill(self.failure_class))
        status = {"http_status": 502, "bad_response": 502, "timeout": 504}.get(self.failure_class, 503)
        message = f"prefill request to {prefill.name} failed ({self.failure_class}): {self.message[:256]}"
        kw: dict[str, Any] = {"code": f"pd_prefill_{self.failure_class}",
                              "header": ("x-error-pd-prefill", self.failure_class),
                              "error_class": ErrorClass.pd_prefill(self.failure_class)}
        if self.too_large is not None:      # as any whole answer over the bound is answered
            kw.update(code="upstream_too_large", error_class=ErrorClass.UPSTREAM_TOO_LARGE)
            message = (f"prefill request to {prefill.name} failed: the engine's answer is larger than "
                       f"{self.too_large} bytes (upstream.max_response_bytes)")
        if status == 503:       # no prefill left to try: as the 503 of a model with no ready endpoint
            kw["headers"] = {"Retry-After": "5"}
        if self.retryable:
            return PairFailed(status, message, endpoint=prefill, cause=f"prefill_{self.kind}", **kw)
        e = GatewayError(status, message, **kw)
        if self.failure_class == "http_status" and self.status in _BUSY_STATUSES:
            # the prefill's engine busy: the pair's 502 here, its busy status where an API answers
            # it with one of its own (Anthropic's 529 of overload, its 429 of a rate limit), with
            # the wait an aggregated engine's 503 or 429 names
            e.busy = (_BUSY_STATUSES[self.status], self.retry_after or ENGINE_RETRY_AFTER[self.status])
        return e


# an engine's busy statuses (its 503 and Anthropic's 529 of overload, its 429 of a rate limit), and
# the status Anthropic's API answers each with
_BUSY_STATUSES = {503: 529, 529: 529, 429: 429}


class PairFailed(GatewayError):
    """A P/D leg failed before the client saw anything: its connection was refused, or reset with
    nothing received (its engine died; a prefill's, before its answer was whole), a prefill's 200
    could not be used, or a decode's stream failed before its first token. The legs were
    closed and aborted as for any failure, so the pipeline may choose the pair again without
    ``endpoint``, and without ``suspect`` too while another endpoint of its role is ready
    (gateway/pipeline/pipeline.py ``_forward_pd``); ``cause`` is the retry's cause. Unretried, it is
    the client's error answer."""

    def __init__(self, status: int, message: str, *, endpoint: Endpoint, cause: str,
                 suspect: Endpoint | None = None, **kw: Any) -> None:
        super().__init__(status, message, **kw)
        self.endpoint = endpoint
        self.cause = cause
        self.suspect = suspect          # a KV failure: the prefill whose KV the decode could not read


class PDOrchestrator:
    """What it needs of the gateway, and nothing more: the upstream legs, the relay, a way to run
    tasks that outlive the request (aborts), the config and the metrics."""

    def __init__(self, config: Config, upstream: Upstream, relay: Relay, spawn: Spawn,
                 metrics: GatewayMetrics, rng: random.Random, pool: EndpointPool, retries: Retries) -> None:
        self.config = config
        self.upstream = upstream
        self.relay = relay
        self.spawn = spawn
        self.metrics = metrics
        self.rng = rng
        self.pool = pool
        self.retries = retries

    async def forward(self, ctx: RequestContext, adapter: EngineAdapter, checked: Any) -> web.StreamResponse:
        assert ctx.ireq is not None and ctx.decision is not None and ctx.decision.prefill is not None
        ireq, prefill = ctx.ireq, ctx.decision.prefill
        ctx.rec.prefill_endpoint = prefill.name
        ctx.use(ctx.decision.endpoint)
        settings = self.config.pd_for(ireq.model)
        plan = adapter.pd_plan(ireq, checked, prefill=prefill, settings=settings, rng=self.rng)
        if plan.log:                        # log fields: once the first leg is out
            ctx.after_write.append(partial(ctx.rec.extra.update, plan.log))
        headers = upstream_headers(ireq)
        ctx.pd_plan = plan                  # a continuation elsewhere first stops this decode (abandon)
        ctx.pd_prefill_failed = None        # (a pair chosen again starts afresh)
        ctx.after_write.append(partial(self.retries.request, ireq.model))   # the retry budget counts it
        if plan.concurrent:
            return await self._concurrent(ctx, adapter, plan, headers)
        return await self._sequential(ctx, adapter, plan, headers)

    # -- the two modes -----------------------------------------------------------------------

    async def _sequential(self, ctx: RequestContext, adapter: EngineAdapter, plan: PDPlan,
                          headers: dict[str, str]) -> web.StreamResponse:
        resp, prefill_start, prefill_end, decode_start = await self._open_sequential(ctx, adapter, plan, headers)
        return await self._relay_decode(ctx, adapter, plan, resp, prefill_start, prefill_end, decode_start)

    async def _open_sequential(self, ctx: RequestContext, adapter: EngineAdapter, plan: PDPlan,
                               headers: dict[str, str]) -> tuple[UpstreamResponse, float, float | None, float]:
        assert ctx.ireq is not None and ctx.decision is not None and ctx.decision.prefill is not None
        ireq, prefill, decode = ctx.ireq, ctx.decision.prefill, ctx.decision.endpoint
        settings = self.config.pd_for(ireq.model)
        prefill_start = time.perf_counter()
        decode_x: Exchange | None = None
        leg: Leg | None = None
        early: list[tuple[Leg, bytes, Exchange]] = []   # the decode, when written from the prefill's read

        def write_decode(resp: UpstreamResponse) -> None:
            """The decode written from the read that completes the prefill's 200, before this task
            wakes for it: the KV transfer starts one loop turn sooner. Anything unusual (another
            status, an answer without ``kv_transfer_params``) is left to the task, which reads the
            same answer."""
            if resp.status != 200:
                return
            try:
                body = adapter.decode_body(ireq, resp.whole_body(), prefill=prefill, settings=settings)
                dleg = ctx.trace.leg("decode", decode, attempt=ctx.rec.retries + 1)
                early.append((dleg, body, self.upstream.begin(decode, ireq.path, body, dleg.inject(headers),
                                                              once=True)))
            except Exception:       # noqa: BLE001 - the task does it again, and reports what fails
                return

        try:
            bad: BadPrefillAnswer | None = None
            with ctx.trace.leg("prefill", prefill, attempt=ctx.rec.retries + 1) as pleg:
                x = self.upstream.begin(prefill, ireq.path, plan.prefill_body, pleg.inject(
                    ctx.leg_headers(prefill, headers)))
                x.tell_at_eof(write_decode)
                ctx.written()               # the routing bookkeeping, once the prefill is out
                try:
                    status, raw, prefill_end = await self._prefill_answer(ctx, x, prefill_start)
                except asyncio.CancelledError:
                    # the client left (or the gateway stops) while the prefill ran: nothing learnt of
                    # its engine, but its breaker hears the leg ended (a half-open one's trial slot)
                    self.upstream.record(prefill, Outcome.NONE, "cancelled")
                    raise
                finally:
                    x.tell_at_eof(None)
                    if early:               # written already: the task takes it over (and discards it on failure)
                        leg, body, decode_x = early.pop()
                if status == 200 and decode_x is None:
                    # the decode is written first; the prefill's bookkeeping follows it
                    try:
                        body = adapter.decode_body(ireq, raw, prefill=prefill, settings=settings)
                    except BadPrefillAnswer as e:
                        bad = e
                    else:
                        leg = ctx.trace.leg("decode", decode, attempt=ctx.rec.retries + 1)
                        decode_x = self.upstream.begin(decode, ireq.path, body, leg.inject(headers), once=True)
                self._prefill_answered(ctx, pleg, x, status, raw, prefill_start, prefill_end, bad)
        except PrefillFailed as f:
            if decode_x is not None:        # (a decode written early for an answer that then failed)
                decode_x.discard()
            # the decode was asked nothing it answered: its breaker hears the request ended without
            # it (a half-open one's trial slot is free for the next pair)
            self.upstream.record(decode, Outcome.NONE, "prefill_failed")
            raise self._prefill_failed(ctx, f, "before_response") from None
        except BaseException:
            if decode_x is not None:
                decode_x.discard()
            self.upstream.record(decode, Outcome.NONE, "prefill_ended")
            raise
        finally:
            ctx.charges.prefill_done()
        assert decode_x is not None and leg is not None
        decode_start = time.perf_counter()
        ctx.charges.decode_started()
        limit = self._decode_header_timeout(ctx)
        tried = [decode]
        while True:
            try:
                resp = await self.upstream.opened(decode, decode_x, limit, ireq.model)
                break
            except UpstreamFailure as f:
                leg.failed(f.kind)
                if f.kind == "connect" and not f.local:     # nothing went out, and the KV waits: another decode
                    again = self._other_decode(ctx, tried)
                    if again is not None:
                        decode = again
                        ctx.use(decode)
                        leg = ctx.trace.leg("decode", decode, attempt=ctx.rec.retries + 1)
                        decode_x = self.upstream.begin(decode, ireq.path, body, leg.inject(headers), once=True)
                        continue
                self._abort_decode(ctx, plan)
                raise self._decode_error(ctx, f, limit) from None
        leg.responded(resp.status)
        return resp, prefill_start, prefill_end, decode_start

    async def _concurrent(self, ctx: RequestContext, adapter: EngineAdapter, plan: PDPlan,
                          headers: dict[str, str]) -> web.StreamResponse:
        ahead: list[HeadAhead | None] = []
        # SGLang's decode sends its head with its first token: its relay waits for that read in a
        # task of its own, and writes both to the client from it (``Relay.stream_early``)
        early: list[tuple[asyncio.Task, UpstreamResponse]] | None = [] if adapter.head_with_first_token else None
        try:
            resp, prefill_start, prefill_end, decode_start = await self._open_concurrent(ctx, plan, headers, ahead,
                                                                                         early)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError) and early and _relayed(early[0][0]):
                task, relayed = early[0]        # the whole stream went out before this task woke
                self.relay.settle(ctx, relayed, False, False)
                return _whole_answer(task)
            for t, _ in early or ():
                await _stopped(t)
            raise
        if early:
            out = await self._early_decode(ctx, plan, resp, early[0][0], prefill_start, prefill_end, decode_start)
            if out is not None:
                return out
        return await self._relay_decode(ctx, adapter, plan, resp, prefill_start, prefill_end, decode_start,
                                        ahead[0] if ahead else None)

    async def _early_decode(self, ctx: RequestContext, plan: PDPlan, resp: UpstreamResponse, task: asyncio.Task,
                            prefill_start: float, prefill_end: float | None, decode_start: float
                            ) -> web.StreamResponse | None:
        """The decode's stream as its early relay relays it (``_concurrent``), with ``_relay_decode``'s
        bookkeeping; None when that relay did not begin (not a 200 event stream, a server error
        event, nothing, or another response than ``resp``): ``_relay_decode`` answers from ``resp``,
        whose bytes it left as they came."""
        rec = ctx.rec
        try:
            out = await asyncio.shield(task)
        except FirstBytesFailed:
            return None
        except asyncio.CancelledError:
            if not _relayed(task):
                await _stopped(task)
                self._abort_decode(ctx, plan)
                self.relay.settle(ctx, resp, True, False)
                self._observe_left(ctx, prefill_start, prefill_end, decode_start)
                raise
            out = _whole_answer(task)   # the stream had ended: its client left after the last byte
        except BaseException:
            self.relay.settle(ctx, resp, False, False)
            raise
        self.relay.settle(ctx, resp, False, False)
        if rec.watchdog is not None:          # the relay's fire (it counted it)
            self._abort_decode(ctx, plan)
        self._observe_phases(ctx, prefill_start, prefill_end, decode_start)
        return out

    async def _open_concurrent(self, ctx: RequestContext, plan: PDPlan, headers: dict[str, str],
                               ahead: list[HeadAhead | None] | None = None,
                               early: list[tuple[asyncio.Task, UpstreamResponse]] | None = None
                               ) -> tuple[UpstreamResponse, float, float | None, float]:
        """Both legs, up to the decode's head. ``ahead``: gets the client's stream head, made once
        the legs are written (SGLang's decode sends its head with its first token, which then finds
        it made). ``early``: gets the decode's relay, begun then in a task that waits for the read
        that brings that head (on a kept-alive connection), and the client's head and first event
        go out from there; a prefill that fails once it began is a late one (``_late_prefill``)."""
        assert ctx.ireq is not None and ctx.decision is not None and ctx.decision.prefill is not None
        assert plan.decode_body is not None
        ireq, prefill, decode = ctx.ireq, ctx.decision.prefill, ctx.decision.endpoint
        # both legs are written before anything else (on idle keep-alive connections, right here);
        # neither is written twice: they meet on a bootstrap room that is used once
        pleg = ctx.trace.leg("prefill", prefill, attempt=ctx.rec.retries + 1)
        prefill_x = self.upstream.begin(prefill, ireq.path, plan.prefill_body, pleg.inject(
                    ctx.leg_headers(prefill, headers)), once=True)
        decode_sent = SendState()
        leg = ctx.trace.leg("decode", decode, attempt=ctx.rec.retries + 1)
        decode_x = self.upstream.begin(decode, ireq.path, plan.decode_body, leg.inject(headers), decode_sent,
                                       once=True)
        prefill_start = decode_start = time.perf_counter()
        ctx.written()                       # the routing bookkeeping, once both legs are out
        if ahead is not None and ireq.stream and ctx.migration is None:
            ahead.append(self.relay.stream_ahead(ctx))
            if early is not None and ahead[0] is not None:
                before = decode_x.before_head(None)     # the decode task's wait bounds the head
                if before is not None:
                    early.append((asyncio.create_task(self.relay.stream_early(
                        ctx, before, plan.strip_usage, self.config.watchdog_for(ireq.model), ahead[0],
                        _first_event_error)), before))
        prefill_end: list[float] = []

        async def run_prefill() -> None:
            try:
                with pleg:
                    status, raw, end = await self._prefill_answer(ctx, prefill_x, prefill_start)
                    self._prefill_answered(ctx, pleg, prefill_x, status, raw, prefill_start, end)
                prefill_end.append(end)
            finally:
                ctx.charges.prefill_done()

        prefill_task = asyncio.create_task(run_prefill())
        decode_task = asyncio.create_task(self.upstream.opened(
            decode, decode_x, self.config.upstream.first_byte_timeout_s or None, ireq.model))
        # a task cancelled before its first step never reaches the connection: drop it then
        prefill_task.add_done_callback(lambda _: prefill_x.discard())
        decode_task.add_done_callback(lambda _, x=decode_x: x.discard())
        ctx.charges.decode_started()
        resp: UpstreamResponse | None = None
        tried = [decode]
        try:
            while True:
                await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
                if prefill_task.done() and early and ctx.rec.headers_sent:
                    # the early relay began the client's stream with the decode's first token: the
                    # decode holds the KV, whatever the prefill's answer says (a late one). (A
                    # continuation's client stream began on an earlier leg: its legs are waited
                    # for as a fresh request's, below.)
                    resp = await asyncio.shield(decode_task)
                    self.spawn(self._late_prefill(ctx, prefill_task))
                    break
                if prefill_task.done():
                    exc = prefill_task.exception()
                    if isinstance(exc, PrefillFailed):
                        raise self._prefill_failed(ctx, exc, "before_response")    # the decode ends below
                    if exc is not None:
                        raise exc
                    # prefill done: the decode holds the KV; arm the watchdog on its first answer
                    limit = self._decode_header_timeout(ctx)
                    try:
                        async with asyncio.timeout(limit):
                            resp = await asyncio.shield(decode_task)
                    except TimeoutError:
                        self.upstream.record(decode, Outcome.FAULT, ErrorClass.WATCHDOG_FIRST_CHUNK)
                        raise self._watchdog_error(ctx, limit) from None
                    break
                failure = None if decode_task.cancelled() else decode_task.exception()
                if isinstance(failure, UpstreamFailure) and failure.kind == "connect" and not failure.local \
                        and not decode_sent.sent:
                    # nothing of the decode went out; the prefill waits for a decode to take its
                    # KV by the bootstrap room: another decode of the roleset, with the same body
                    again = self._other_decode(ctx, tried)
                    if again is not None:
                        leg.failed(failure.kind)
                        decode = again
                        ctx.use(decode)
                        if ahead:
                            ahead[0] = self.relay.stream_ahead(ctx)     # its headers name this decode
                        decode_sent = SendState()
                        leg = ctx.trace.leg("decode", decode, attempt=ctx.rec.retries + 1)
                        decode_x = self.upstream.begin(decode, ireq.path, plan.decode_body, leg.inject(headers),
                                                       decode_sent, once=True)
                        decode_task = asyncio.create_task(self.upstream.opened(
                            decode, decode_x, self.config.upstream.first_byte_timeout_s or None, ireq.model))
                        decode_task.add_done_callback(lambda _, x=decode_x: x.discard())
                        continue
                # the decode answered first (its headers come with its first token): the prefill's
                # answer may still be on its way; let it finish in the background
                resp = decode_task.result()
                self.spawn(self._late_prefill(ctx, prefill_task, resp))
                break
        except UpstreamFailure as f:
            self._abort(ctx, prefill, plan.abort)
            if f.kind == "timeout":
                raise self._watchdog_error(ctx, self.config.upstream.first_byte_timeout_s) from None
            raise self._decode_unavailable(ctx, f) from None
        except asyncio.CancelledError:
            # the client went away: stop both legs, and tell the engine (it may notice a closed
            # connection only seconds later); the decode's abort is decided below
            if not prefill_task.done() and not (early and _relayed(early[0][0])):
                self._abort(ctx, prefill, plan.abort)
            raise
        finally:
            if resp is None:
                # the decode will not be relayed: stop both legs, and only once the decode leg is
                # over decide its abort, from whether its request may have been written (not from
                # whether its task had ended when the prefill failed: it may have ended on its own)
                for t in (prefill_task, decode_task):
                    if not t.done():
                        t.cancel()
                for t in (prefill_task, decode_task):
                    with contextlib.suppress(BaseException):
                        await t
                if not (early and _relayed(early[0][0])):   # (an early relay's stream is whole: no abort)
                    self._end_unrelayed_decode(ctx, plan, decode_task, decode_sent)
        leg.responded(resp.status)
        if resp.status != 200 and not prefill_task.done():
            self._abort(ctx, prefill, plan.abort)    # the prefill would wait for a decode that gave up
            prefill_task.cancel()
        return resp, prefill_start, prefill_end[0] if prefill_end else None, decode_start

    async def reopen(self, ctx: RequestContext, adapter: EngineAdapter) -> UpstreamResponse:
        """A mid-stream continuation through a fresh pair (``ctx.decision``, ``ctx.ireq`` already
        the continuation's): its prefill, then its decode up to the response head, for the relay
        to go on with (gateway/pipeline/migration.py)."""
        assert ctx.ireq is not None and ctx.decision is not None and ctx.decision.prefill is not None
        ireq, prefill = ctx.ireq, ctx.decision.prefill
        ctx.rec.prefill_endpoint = prefill.name
        ctx.use(ctx.decision.endpoint)
        plan = adapter.pd_plan(ireq, None, prefill=prefill, settings=self.config.pd_for(ireq.model), rng=self.rng)
        headers = upstream_headers(ireq)
        ctx.pd_plan = plan
        opened = self._open_concurrent(ctx, plan, headers) if plan.concurrent else \
            self._open_sequential(ctx, adapter, plan, headers)
        return (await opened)[0]

    # -- legs ----------------------------------------------------------------------------------

    async def _prefill_answer(self, ctx: RequestContext, x: Exchange, start: float) -> tuple[int, bytes, float]:
        """The begun prefill leg's answer: (status, bytes, when it was read); ``PrefillFailed``
        when no answer came. Its bookkeeping is ``_prefill_answered``'s."""
        assert ctx.ireq is not None and ctx.decision is not None and ctx.decision.prefill is not None
        ireq = ctx.ireq
        timeout = self.config.pd_for(ireq.model).prefill_timeout_s or None
        try:
            status, raw = await self.upstream.answer(ctx.decision.prefill, x, ireq.model, timeout)
        except UpstreamFailure as f:
            ctx.rec.extra["prefill_ms"] = round((time.perf_counter() - start) * 1000, 3)
            if f.local:             # this process could make no socket: no prefill failed
                raise no_socket_error(f, ctx.rec) from None
            if f.kind in ("protocol", "too_large"):
                # an answer that is not one (not HTTP, or over the bound read whole): the engine's
                # fault, a 502 as an aggregated engine's is, not a busy 503 to come back to
                too = f.too_large
                if too is not None:
                    ctx.rec.extra["upstream_bytes"] = too.declared if too.declared is not None else too.received
                raise PrefillFailed("bad_response", f.message, kind=f.kind,
                                    too_large=too.limit if too is not None else None) from None
            # a reset once some of the answer came is retried too: the prefill's engine died as it
            # answered, its KV with it, and neither the client nor a decode got anything of it
            raise PrefillFailed("timeout" if f.kind == "timeout" else "transport", f.message, kind=f.kind,
                                retryable=f.retryable or f.kind == "reset") from None
        return status, raw, time.perf_counter()

    def _prefill_answered(self, ctx: RequestContext, leg: Leg, x: Exchange, status: int, raw: bytes, start: float,
                          end: float, bad: BadPrefillAnswer | None = None) -> None:
        """Account a prefill's answer (breaker, trace, metrics, log fields); ``PrefillFailed``
        unless it is a 200 (with the Retry-After of ``x``'s answer), or when it is one no decode
        leg can be built from (``bad``): the prefill's fault, and another prefill may serve, since
        neither the client nor a decode got anything of it."""
        assert ctx.decision is not None and ctx.decision.prefill is not None
        rec = ctx.rec
        rec.extra["prefill_ms"] = round((end - start) * 1000, 3)
        prefill = ctx.decision.prefill
        keyed = prefill.api_key is not None
        outcome = of_status(status, keyed)
        if bad is not None:
            # as an aggregated engine's 200 that no client could read: its protocol fault
            self.upstream.record(prefill, Outcome.FAULT, "protocol")
            self.metrics.child(self.metrics.upstream_errors, rec.model, prefill.name, "protocol").inc()
        else:
            self.upstream.record(prefill, outcome, f"status_{status}")
        leg.responded(status)
        self.metrics.child(self.metrics.pd_prefill_time, rec.model).observe(end - start)
        rec.extra["prefill_status"] = status
        if bad is not None:
            raise PrefillFailed("bad_response", str(bad), kind="bad_response", retryable=True)
        if key_refused(status, keyed):      # the gateway's key is wrong: its body is not passed on
            engine_key_refused(self.metrics, prefill, rec.model, status, ctx.ireq.path if ctx.ireq else "")
            raise PrefillFailed("http_status", f"the engine refused the gateway's credentials for it (status {status})",
                                status)
        if status != 200:
            _, err = normalize_upstream_error(status, raw)
            raise PrefillFailed("http_status", f"status {status}: {err['error']['message']}", status,
                                refusal=err["error"] if outcome is Outcome.CLIENT_ERROR else None,
                                retry_after=x.resp.headers.get("Retry-After") if x.resp is not None else None)

    def _decode_error(self, ctx: RequestContext, f: UpstreamFailure, limit: float | None) -> GatewayError:
        if f.kind == "timeout":     # the watchdog: no answer from the decode in time
            return self._watchdog_error(ctx, limit)
        return self._decode_unavailable(ctx, f)

    def _other_decode(self, ctx: RequestContext, tried: list[Endpoint]) -> Endpoint | None:
        """Another decode endpoint of the prefill's roleset for a decode leg that could not be sent
        (gateway/resilience/retry.py ``redecode``), or None. Only one whose prompt-length bucket
        holds the request, and that serves its API or LoRA adapter when those narrowed the model's
        endpoints: the pair's choice dropped the others."""
        assert ctx.ireq is not None and ctx.decision is not None and ctx.decision.prefill is not None
        roleset, n = ctx.decision.prefill.roleset, ctx.ireq.prompt_tokens_est
        decodes = [e for e in (self.pool.endpoints(ctx.ireq.model) if ctx.serving is None else ctx.serving)
                   if e.role == "decode" and e.roleset == roleset and in_bucket(e, n)]
        return self.retries.redecode(ctx, self.metrics, decodes, tried, "connect")

    async def _relay_decode(self, ctx: RequestContext, adapter: EngineAdapter, plan: PDPlan,
                            resp: UpstreamResponse, prefill_start: float, prefill_end: float | None,
                            decode_start: float, made: HeadAhead | None = None) -> web.StreamResponse:
        assert ctx.ireq is not None
        rec = ctx.rec
        wd = self.config.watchdog_for(rec.model)
        try:
            if resp.status >= 500 and of_status(resp.status) is Outcome.FAULT:
                await self._failed_status(ctx, resp)
            ahead = None
            gate = None
            if ctx.ireq.stream and resp.status == 200:
                ahead = self.relay.head_ahead(ctx, resp, made)  # made while the KV moves, off the first token's way
                if ahead is not None and not (ctx.migration is not None and ctx.migration.active):
                    # the relay is ready before the first token, which its read callback checks
                    # and writes with the head, with no wake-up of this task on its way
                    gate = _first_event_error
                else:
                    await self._first_bytes(ctx, plan, resp, wd.first_chunk_timeout_s)
            try:
                out = await self.relay.answer(ctx, resp, adapter, plan.strip_usage, wd, ahead, gate)
            except FirstBytesFailed as f:
                if f.kind == "timeout":
                    raise self._first_bytes_late(ctx, plan, resp, f.detail) from None   # type: ignore[arg-type]
                cause, message = self._first_bytes_cause(ctx, f)
                raise self._first_bytes_bad(ctx, plan, resp, cause, message) from None
            except GatewayError as e:   # a whole answer that broke: its prefill's failure closed it
                if (failed := self._prefill_first(ctx, plan, resp)) is not None:
                    raise failed from None
                if rec.watchdog is not None or rec.error_class == ErrorClass.UPSTREAM_TIMEOUT:
                    self._abort_decode(ctx, plan)   # one that stalled after its head: stopped
                elif rec.error_class == ErrorClass.UPSTREAM_BROKEN and not ctx.ireq.stream:
                    raise self._whole_broken(ctx, plan, e) from None
                raise
        except asyncio.CancelledError:
            # the client left: a relay that was under way closed the decode's connection itself,
            # but one left while this task awaited the first bytes (a stream that may continue,
            # an HTTP/1.0 client) had no relay yet, and vLLM learns of the abort only from the close
            resp.close()
            self._abort_decode(ctx, plan)
            self._observe_left(ctx, prefill_start, prefill_end, decode_start)
            raise
        if rec.watchdog is not None:          # the relay's fire (it counted it)
            self._abort_decode(ctx, plan)
        self._observe_phases(ctx, prefill_start, prefill_end, decode_start)
        return out

    async def _first_bytes(self, ctx: RequestContext, plan: PDPlan, resp: UpstreamResponse, limit: float) -> None:
        """A streamed decode's first bytes, awaited before the client's head goes out (vLLM answers
        its head at once, before the KV is even read) and put back for the relay, when the relay
        cannot check them itself (``Relay.answer``'s gate: an answer aiohttp writes, a stream that
        may migrate). A decode that fails before them, one that breaks, ends empty or opens with a
        server error event (its KV pull failed: the prefill died), is a ``PairFailed``: the client
        has seen nothing, so the pipeline may choose the pair again. No first bytes within the
        first-chunk watchdog: 504."""
        try:
            async with asyncio.timeout(limit or None):
                first = await resp.readany()
                while first and not has_fields(first):    # keep-alive comments: no first bytes yet
                    more = await resp.readany()
                    if not more:
                        break
                    first += more
        except TimeoutError:
            raise self._first_bytes_late(ctx, plan, resp, limit) from None
        except UpstreamError as e:
            first, failed = b"", FirstBytesFailed("broken", e)
        else:
            failed = FirstBytesFailed("empty") if not has_fields(first) else None
            if first and (server_error := _first_event_error(first)) is not None:
                failed = FirstBytesFailed("refused", server_error)
        if failed is None:
            resp.unread(first)
            return
        cause, message = self._first_bytes_cause(ctx, failed)
        raise self._first_bytes_bad(ctx, plan, resp, cause, message)

    def _first_bytes_cause(self, ctx: RequestContext, f: FirstBytesFailed) -> tuple[str, str]:
        """The cause and message of a decode that failed before its first token."""
        assert ctx.decision is not None
        name = ctx.decision.endpoint.name
        if f.kind == "broken":
            return "decode_broken", f"decode endpoint {name} broke before its first token: {f.detail}"
        if f.kind == "empty":
            return "decode_empty", f"decode endpoint {name} ended its stream before its first token"
        return "decode_error", f"decode endpoint {name} failed before its first token: {f.detail}"

    def _prefill_first(self, ctx: RequestContext, plan: PDPlan, resp: UpstreamResponse) -> GatewayError | None:
        """The prefill's failure when it failed before the decode's first bytes (``_late_prefill``),
        the request's answer: the decode is stopped, and its breaker hears no fault of it."""
        f = ctx.pd_prefill_failed
        if f is None:
            return None
        assert ctx.decision is not None
        ctx.pd_prefill_failed = None
        ctx.rec.error_class = None          # (the broken answer's, when its relay set one)
        resp.close()
        self._abort_decode(ctx, plan)
        self.upstream.record(ctx.decision.endpoint, Outcome.NONE, "prefill_failed")
        return self._prefill_failed(ctx, f, "before_response")

    def _first_bytes_late(self, ctx: RequestContext, plan: PDPlan, resp: UpstreamResponse,
                          limit: float | None) -> GatewayError:
        """No first bytes within the first-chunk watchdog: the decode is stopped, the client gets 504."""
        assert ctx.decision is not None
        if (failed := self._prefill_first(ctx, plan, resp)) is not None:
            return failed
        resp.close()
        self._abort_decode(ctx, plan)
        self.upstream.record(ctx.decision.endpoint, Outcome.FAULT, ErrorClass.WATCHDOG_FIRST_CHUNK)
        return self._watchdog_error(ctx, limit)

    def _first_bytes_bad(self, ctx: RequestContext, plan: PDPlan, resp: UpstreamResponse, cause: str,
                         message: str) -> GatewayError:
        """A decode that failed before its first token: stopped, and a pair the pipeline may choose
        again; or the prefill's failure, when that came first and closed the decode."""
        assert ctx.decision is not None
        if (failed := self._prefill_first(ctx, plan, resp)) is not None:
            return failed
        decode = ctx.decision.endpoint
        resp.close()
        self._abort_decode(ctx, plan)
        self.upstream.record(decode, Outcome.FAULT, cause)
        ctx.rec.error_class = ErrorClass.decode("reset")
        return PairFailed(502, message[:512], endpoint=decode, cause=cause,
                          # a server error event: most likely the prefill's KV, not the decode, failed
                          suspect=ctx.decision.prefill if cause == "decode_error" else None,
                          code="upstream_unavailable", header=("x-error-pd-decode", cause),
                          error_class=ctx.rec.error_class)

    def _whole_broken(self, ctx: RequestContext, plan: PDPlan, e: GatewayError) -> GatewayError:
        """A whole answer its decode broke off after its head (its engine died): the client has seen
        nothing of it, so the pair may be chosen again, as for a stream that broke before its first
        token. The relay told the decode's breaker and counted the broken body. An SGLang prefill
        still waiting for this decode to take its KV is aborted too, as for a decode that hung up."""
        assert ctx.decision is not None and ctx.decision.prefill is not None
        self._abort_decode(ctx, plan)
        if plan.concurrent:
            self._abort(ctx, ctx.decision.prefill, plan.abort)
        return PairFailed(e.status, e.message, endpoint=ctx.decision.endpoint, cause="decode_broken", code=e.code,
                          headers=e.headers, error_class=e.error_class)

    async def _failed_status(self, ctx: RequestContext, resp: UpstreamResponse) -> None:
        """The decode answered a server error (a 5xx other than 501, 503 and 529; SGLang's when the KV transfer
        failed: the prefill died): a ``PairFailed`` carrying the engine's error, as for an aggregated
        leg, which is retried on another endpoint. The engine ended the request itself: no abort."""
        assert ctx.decision is not None
        decode, status = ctx.decision.endpoint, resp.status
        try:        # bounded in time as any engine's error body: a stalled one held the request
            raw = await read_error_body(resp, self.config.upstream.max_error_body_bytes)
        finally:
            resp.close()
        self.upstream.record(decode, Outcome.FAULT, f"status_{status}")
        self.metrics.child(self.metrics.upstream_errors, ctx.rec.model, decode.name, f"status_{status}").inc()
        status, err = normalize_upstream_error(status, raw)
        e = err["error"]
        ctx.rec.error_class = ErrorClass.UPSTREAM_STATUS
        raise PairFailed(status, str(e.get("message") or f"decode answered {status}"), endpoint=decode,
                         cause=f"decode_status_{status}", suspect=ctx.decision.prefill, code=e.get("code"),
                         type_=e.get("type"), header=("x-error-pd-decode", "http_status"),
                         error_class=ErrorClass.UPSTREAM_STATUS)

    # -- failures ------------------------------------------------------------------------------

    def _prefill_failed(self, ctx: RequestContext, f: PrefillFailed, stage: str) -> GatewayError:
        assert ctx.decision is not None and ctx.decision.prefill is not None
        self.metrics.child(self.metrics.pd_prefill_failures, ctx.rec.model, f.failure_class, stage).inc()
        ctx.rec.extra["prefill_failure"] = f.failure_class
        return f.client_error(ctx.decision.prefill)

    def _decode_unavailable(self, ctx: RequestContext, f: UpstreamFailure) -> GatewayError:
        assert ctx.decision is not None
        if f.local:                 # this process could make no socket: no decode is at fault
            return no_socket_error(f, ctx.rec)
        ctx.rec.error_class = ErrorClass.decode(f.kind)
        message = f"decode endpoint unavailable: {f.message}"
        kw: dict[str, Any] = {"code": "upstream_unavailable", "header": ("x-error-pd-decode", f.kind),
                              "error_class": ctx.rec.error_class}
        if f.retryable:
            return PairFailed(502, message, endpoint=ctx.decision.endpoint, cause=f"decode_{f.kind}", **kw)
        return GatewayError(502, message, **kw)

    def _decode_header_timeout(self, ctx: RequestContext) -> float | None:
        assert ctx.ireq is not None
        return head_timeout(self.config.upstream, self.config.watchdog_for(ctx.ireq.model), ctx.ireq.stream)

    def _watchdog_error(self, ctx: RequestContext, limit: float | None) -> GatewayError:
        assert ctx.ireq is not None and ctx.decision is not None
        rec = ctx.rec
        phase = "first_chunk" if ctx.ireq.stream else "response"
        watchdog_fired(ctx, self.metrics, phase, limit)
        rec.error_class = ErrorClass.watchdog(phase)
        verb = "start" if ctx.ireq.stream else "finish"
        return GatewayError(504, f"decode endpoint {ctx.decision.endpoint.name} did not {verb} responding "
                                 f"within {limit or 0:g}s",
                            code="upstream_timeout", header=("x-error-pd-decode", "true"), error_class=rec.error_class)

    def _observe_phases(self, ctx: RequestContext, prefill_start: float, prefill_end: float | None,
                        decode_start: float) -> None:
        m, rec = self.metrics, ctx.rec
        now = time.perf_counter()
        m.child(m.pd_decode_time, rec.model).observe(now - decode_start)
        if rec.ttft is not None and prefill_end is not None:
            # never below 0: SGLang's prefill answer may be read just after the decode's first token
            transfer = max(0.0, rec.started + rec.ttft - prefill_end)
            rec.extra["kv_transfer_ms"] = round(transfer * 1000, 3)
            m.child(m.pd_kv_transfer_time, rec.model).observe(transfer)

    def _observe_left(self, ctx: RequestContext, prefill_start: float, prefill_end: float | None,
                      decode_start: float) -> None:
        """A stream its client left: its phases, when it had its first token (its KV had come)."""
        if ctx.rec.ttft is not None:
            self._observe_phases(ctx, prefill_start, prefill_end, decode_start)

    async def _late_prefill(self, ctx: RequestContext, task: asyncio.Task,
                            decode: UpstreamResponse | None = None) -> None:
        """A concurrent prefill that answers after its decode's head. One that fails once the
        decode's answer began (the client's stream, or any of its bytes come) is logged and the
        answer runs on; one that fails while the answer ``decode`` has sent nothing but its head (a
        decode that sent it before its first token), whose KV will then never come, fails the
        request: the decode's answer is closed, which ends the wait for its bytes, and that wait's
        end answers the prefill's failure (``_prefill_first``)."""
        try:
            await task
        except PrefillFailed as f:
            if decode is not None and not ctx.rec.headers_sent and not decode.buffered and not decode.at_eof():
                ctx.pd_prefill_failed = f
                decode.close()
                return
            self._prefill_failed(ctx, f, "after_response")
            log.warning("prefill failed after the decode started streaming; the stream continues",
                        request_id=ctx.rec.request_id, failure_class=f.failure_class, error=f.message)
        except (asyncio.CancelledError, Exception):
            pass

    # -- aborts --------------------------------------------------------------------------------

    def abandon(self, ctx: RequestContext) -> None:
        """The stream's decode failed and continues elsewhere (gateway/pipeline/migration.py): tell
        its engine to stop. Nothing when the request's legs are not P/D ones."""
        if ctx.pd_plan is not None:
            self._abort_decode(ctx, ctx.pd_plan)

    def _abort_decode(self, ctx: RequestContext, plan: PDPlan) -> None:
        assert ctx.decision is not None
        self._abort(ctx, ctx.decision.endpoint, plan.abort)

    def _abort(self, ctx: RequestContext, ep: Endpoint, spec: AbortSpec | None) -> None:
        """Tell ``ep`` to drop the request, in the background. Engines without an abort call
        (``spec`` None) learn it from the closed connection."""
        ctx.trace.event("abort", {"switchyard.abort.by": "gateway", "switchyard.endpoint": ep.name,
                                  "switchyard.abort.sent": spec is not None})
        if spec is not None:
            self.spawn(self._send_abort(ep, spec, ctx.rec.model))

    def _end_unrelayed_decode(self, ctx: RequestContext, plan: PDPlan, task: asyncio.Task,
                              sent: SendState) -> None:
        """The concurrent decode leg ``task`` is over and will not be relayed. Close its answer if
        one came; then abort the request on the engine if any byte of it may have been written,
        unless the engine ended it itself (an error answer). ``sent`` is set just before the
        request's only write and read only once the task is done, so False proves nothing went out."""
        if not task.done():     # the handler was cancelled while waiting for the leg to end
            task.add_done_callback(lambda t: self._end_unrelayed_decode(ctx, plan, t, sent))
            return
        ctx.rec.extra["decode_sent"] = sent.sent
        answer = None if task.cancelled() or task.exception() is not None else task.result()
        if answer is not None:
            answer.close()
            if answer.status != 200:
                return
        if sent.sent:
            self._abort_decode(ctx, plan)
        elif plan.abort is not None:
            self.metrics.child(self.metrics.pd_aborts, ctx.rec.model, "skipped_unsent").inc()

    async def _send_abort(self, ep: Endpoint, spec: AbortSpec, model: str) -> None:
        """POST the abort; a second time after a delay (the abort may overtake the request it
        aborts: SGLang forgets an abort for a rid it does not know yet)."""
        if not spec.timeout_s:
            self.metrics.child(self.metrics.pd_aborts, model, "skipped_disabled").inc()
            return
        for attempt in range(2):
            for body in spec.bodies:
                try:
                    status, _ = await self.upstream.fetch(ep, spec.path, body, {"Content-Type": "application/json"},
                                                          model, spec.timeout_s, report=False)
                    result = "ok" if status == 200 else "error"
                except UpstreamFailure:
                    result = "error"
                self.metrics.child(self.metrics.pd_aborts, model, result).inc()
            if attempt == 0:
                if not spec.retry_delay_s:
                    return
                await asyncio.sleep(spec.retry_delay_s)


def _relayed(task: asyncio.Task) -> bool:
    """Whether an early relay's task relayed its stream to the end."""
    return task.done() and not task.cancelled() and task.exception() is None


def _whole_answer(task: asyncio.Task) -> web.StreamResponse:
    """An early relay's stream that ended before the request's task, cancelled since (its client
    left after the last byte), woke for it: the answer is whole, the cancel is not the client's."""
    current = asyncio.current_task()
    if current is not None:
        current.uncancel()
    return task.result()


async def _stopped(task: asyncio.Task) -> None:
    """Cancel ``task`` and wait until it is over, whatever it ends with."""
    task.cancel()
    with contextlib.suppress(BaseException):
        await task


def _first_event_error(first: bytes) -> str | None:
    """A decode's first bytes that open with a server error event (its KV pull failed: the
    prefill died): that error's message; None for anything else."""
    if first.startswith(b"data: {\"error\""):
        return _server_error_event(first)
    if first.startswith(b"event: error"):       # a Messages stream's (vLLM's Anthropic handler)
        return _messages_server_error(first)
    return None


# the Anthropic error types of a server's failure; vLLM's Messages stream writes ``internal_error``
# for a chat stream that failed (a KV pull among them), before or after its first event
_SERVER_ERROR_TYPES = frozenset({"internal_error", "api_error", "overloaded_error"})


def _messages_server_error(data: bytes) -> str | None:
    """The message of a Messages stream's opening ``event: error`` frame when its error is a
    server's (``_SERVER_ERROR_TYPES``), else None: a client's error passes on as it came."""
    event = data.split(b"\n\n", 1)[0]
    payload = next((line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")), None)
    if payload is None:
        return None
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict) and err.get("type") in _SERVER_ERROR_TYPES:
        return str(err.get("message", ""))[:256]
    return None


def _server_error_event(data: bytes) -> str | None:
    """The message of a stream's opening event when it is a server error (``{"error": {...}}`` with
    a 5xx code, the number or the string ``"502"`` (``event_status``), or a server error type, as
    vLLM sends for a failed KV pull), else None. An event with
    code 501 is none: the engine does not implement what the request asks (``unsupported_event``),
    as another decode would not, and the client gets it as it came."""
    event = data.split(b"\n\n", 1)[0].removeprefix(b"data: ")
    try:
        err = orjson.loads(event).get("error")
    except orjson.JSONDecodeError:
        return None
    if not isinstance(err, dict) or unsupported_event(err):
        return None
    status = event_status(err)
    if (status is not None and status >= 500) or err.get("type") in ("InternalServerError", "server_error"):
        return str(err.get("message", ""))[:256]
    return None
