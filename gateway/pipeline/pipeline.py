"""The request pipeline: parse → admit → strategy → route+charge → forward → relay → finish.

``Pipeline.handle`` is the aiohttp handler of the inference paths and reads as the request's
script; each stage is a collaborator wired by ``gateway.server.app``: routing (``gateway.pipeline.routing``),
the ledger of charges (``gateway.pipeline.ledger``), the upstream legs (``gateway.upstream.upstream``), the relay
(``gateway.pipeline.relay``), P/D orchestration (``gateway.pd.orchestrator``), tenancy (``gateway.tenants``) and the
lifecycle (``gateway.server.lifecycle``). What the stages hand each other travels in one
``RequestContext``; every path out of ``handle`` (answer, error, client disconnect, a bug)
releases the charges and writes one log line.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial

import structlog
from aiohttp import web

from gateway.admission.service import Admission
from gateway.aliases import Aliases
from gateway.apis.base import ApiShape
from gateway.config.schema import Config
from gateway.endpoints import Endpoint, EndpointPool
from gateway.errors import GatewayError, error_response
from gateway.kv import dp_rank
from gateway.lora.adapters import Lora
from gateway.observability.logs import RequestLog
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.tracing import Tracing
from gateway.pd.decide import PDDecider
from gateway.pd.orchestrator import PDOrchestrator
from gateway.pipeline.context import RecordObserver, RequestContext, record_request, safe_header_value
from gateway.pipeline.ledger import charge
from gateway.pipeline.migration import Migration
from gateway.pipeline.relay import Relay, error_event
from gateway.pipeline.routing import Routing
from gateway.request import InferenceRequest, parse
from gateway.resilience.outcome import Outcome, of_status
from gateway.resilience.retry import Retries, discard
from gateway.server.lifecycle import Lifecycle
from gateway.tenants.service import Tenancy
from gateway.upstream.h1client import UpstreamResponse
from gateway.upstream.upstream import Upstream, UpstreamFailure, head_timeout, upstream_body, upstream_headers
from handlers import adapter_for
from handlers.base import BodyError

log = structlog.get_logger("switchyard.request")


class Pipeline:
    def __init__(self, config: Config, pool: EndpointPool, metrics: GatewayMetrics, routing: Routing,
                 upstream: Upstream, relay: Relay, pd: PDOrchestrator, tenancy: Tenancy | None,
                 lifecycle: Lifecycle, request_log: RequestLog, tracing: Tracing | None = None) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.routing = routing
        self.upstream = upstream
        self.relay = relay
        self.pd = pd
        self.tenancy = tenancy
        self.lifecycle = lifecycle
        self.request_log = request_log
        self.tracing = tracing
        self.aliases: Aliases | None = None          # set by app.py when the config has aliases
        self.retries: Retries | None = None          # set by app.py: the retry policy and budgets
        self.lora: Lora | None = None                # LoRA adapters (gateway/lora/adapters.py), set by app.py
        self.pd_decider: PDDecider | None = None     # conditional disaggregation (gateway/pd/decide.py)
        self.admission: Admission | None = None      # set by app.py: waits for room or sheds (gateway/admission)
        self.model_in_flight: dict[str, int] = {}
        self.observers: list[RecordObserver] = []    # told of every finished request (app.py wires them)
        self.apis: dict[str, ApiShape] = {}          # path → its API when not chat/completions/embeddings

    async def handle(self, request: web.Request) -> web.StreamResponse:
        ctx = RequestContext.start(request)
        rec = ctx.rec
        if self.tracing is not None:        # the span the tracing middleware opened
            ctx.trace = self.tracing.of(request)
            if ctx.trace.trace_id:
                rec.extra["trace_id"] = ctx.trace.trace_id
        self.lifecycle.enter()
        ticket = None
        model_gauge = None
        try:
            api = ctx.api = self.apis.get(request.path)   # first: every error is in its shape
            self.lifecycle.check_open()
            if self.tenancy is not None:    # API key → user (401), before the body is read
                ticket = await self.tenancy.authenticate(request, rec)
            body = await api.read_body(request, self.config.server.max_body_bytes) if api is not None else None
            ireq = ctx.ireq = (api.parse if api is not None else parse)(
                request.path, body if body is not None else await self._read_body(request), request.headers,
                rec.request_id)
            if self.aliases is not None:    # an alias names one of its models (gateway/aliases.py)
                self.aliases.resolve(ctx, ticket.user if ticket is not None else None)
            if self.lora is not None:       # an adapter: a request for its base model (gateway/lora/adapters.py)
                self.lora.resolve(ctx)
            rec.model, rec.stream = ireq.model, ireq.stream
            self._require_model(ireq.model)
            model_gauge = ireq.model
            self.model_in_flight[model_gauge] = self.model_in_flight.get(model_gauge, 0) + 1
            spec = rec.strategy = self.routing.strategy_for(ireq.model, request.headers.get("routing-strategy"),
                                                            lora=ireq.lora is not None)
            router = self.routing.router_for(spec)
            candidates = self.routing.candidates(ireq.model, router)
            if ticket is not None:          # model RPS, user RPM/TPM/concurrency (429), before routing
                await self.tenancy.admit(ticket, ireq, rec)
            rec.user = ireq.user            # with auth on, the key's user (admit decides it)
            if api is not None:             # the API's state, or the endpoints whose engine serves it
                if router.chooses_pairs and not api.supports_pd:
                    raise GatewayError(400, f"POST {ireq.path} is not served by prefill/decode pairs, and the "
                                            f"model `{ireq.model}` routes with the P/D strategy {spec!r}",
                                       header=("x-error-routing", "true"), error_class="routing")
                candidates = await api.prepare(ctx, candidates)
            if ireq.lora is not None and self.lora is not None:    # those serving it; loaded if none
                candidates = (await self.lora.serving_pairs(ctx, candidates) if router.chooses_pairs
                              else await self.lora.prepare(ctx, candidates))
            adapter = adapter_for(candidates[0].engine)
            checked = self._check_pd_body(adapter, ctx) if router.chooses_pairs else None
            if self.admission is not None:  # room on an endpoint, else the queue or a 429
                candidates = await self.admission.admit(ctx, candidates, router.chooses_pairs)
            if (kv := self.routing.ctx.precise_index) is not None and (router.reads_kv_events or router.chooses_pairs) \
                    and kv.covers(ireq.model):      # tokenized off the loop, so the match finds it cached
                await kv.prepare(ireq, candidates)
            ctx.trace.route_start()
            # the router's learning and observers wait in ctx.after_write until the leg is written
            decision = ctx.decision = self.routing.route(ireq, spec, router, candidates, ctx.after_write)
            if router.chooses_pairs and self.pd_decider is not None:   # disaggregate, or run it whole
                candidates = self.pd_decider.decide(ctx, adapter, candidates)
            # charged in the same synchronous step as the decision
            ctx.charges = charge(decision.endpoint, decision.prefill, self._prefill_tokens(ctx))
            if ireq.lora is not None and self.lora is not None:
                self.lora.charge(ctx)
            if (kv is not None and kv.index.ranked) or dp_rank.DP_RANK_HEADER in ireq.headers:
                dp_rank.pin(ctx, kv, adapter, self._client_rank(ireq.model))   # a data-parallel engine's rank
            ctx.trace.routed(decision, len(candidates))
            limit = getattr(self.config.model(ireq.model), "migration_limit", 0)
            if limit:                       # mid-stream continuation (gateway/pipeline/migration.py)
                ctx.migration = Migration.begin(ctx, limit, candidates[0].engine, self.metrics)
                if ctx.migration is not None:
                    ctx.migration.reopen = lambda cont, avoid: self._reopen(ctx, cont, avoid)
            if decision.prefill is not None:
                return await self.pd.forward(ctx, adapter, checked)
            return await self.forward(ctx, candidates)
        except GatewayError as e:
            return self._error_response(ctx, e)
        except asyncio.CancelledError:
            rec.status = 499
            rec.error_class = rec.error_class or "client_cancel"
            self.metrics.child(self.metrics.client_cancels, rec.model,
                               "streaming" if rec.headers_sent else "before_headers").inc()
            ctx.trace.event("abort", {"switchyard.abort.by": "client"})
            raise
        except Exception as e:   # a bug: the client still gets an answer, the traceback is logged once
            return await self._internal_error(ctx, e)
        finally:
            ctx.written()                   # bookkeeping of a request that ended before its leg
            ctx.charges.release()
            if model_gauge is not None:
                self.model_in_flight[model_gauge] -= 1
                if self.admission is not None:   # freed room goes to the next waiter
                    self.admission.released(model_gauge, ctx.charges.in_flight is not None)
            self.lifecycle.leave()
            if ticket is not None:          # charge usage tokens, release the concurrency slot
                self.tenancy.settle(ticket, rec)
            ctx.trace.finish(rec)
            record_request(rec, self.metrics, time.perf_counter(), self.request_log, self.observers)

    # -- stages --------------------------------------------------------------------------------

    async def _read_body(self, request: web.Request) -> bytes:
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise GatewayError(413, f"request body exceeds {self.config.server.max_body_bytes} bytes",
                               error_class="validation") from None
        except web.RequestPayloadError as e:     # broken chunking, an undecodable Content-Encoding
            raise GatewayError(400, f"the request body could not be read: {e}", code="bad_body",
                               error_class="validation") from None

    def _require_model(self, model: str) -> None:
        if not self.pool.has_model(model) and self.config.model(model) is None:
            raise GatewayError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found",
                               header=("x-error-no-model-backends", safe_header_value(model)),
                               error_class="model_not_found")

    @staticmethod
    def _check_pd_body(adapter, ctx: RequestContext):
        try:   # refused before any endpoint is chosen
            return adapter.check_pd_body(ctx.ireq)
        except BodyError as e:
            raise GatewayError(400, str(e), header=("x-error-routing", "true"), error_class="validation") from None

    def _client_rank(self, model: str) -> bool:
        """Whether the model lets a client's own ``X-data-parallel-rank`` through (``kv_events.client_rank``)."""
        m = self.config.model(model)
        return m is not None and m.kv_events is not None and m.kv_events.client_rank

    def _prefill_tokens(self, ctx: RequestContext) -> float:
        """The token-load charge of a P/D decision: a fixed cost plus the prompt tokens the prefill
        must compute."""
        d, ireq = ctx.decision, ctx.ireq
        if d is None or d.prefill is None or ireq is None:
            return 0.0
        return self.config.pd_for(ireq.model).token_request_cost + (d.uncached_tokens or ireq.prompt_tokens_est)

    async def forward(self, ctx: RequestContext, candidates: list[Endpoint]) -> web.StreamResponse:
        """Open the aggregated leg, retrying elsewhere (gateway/resilience/retry.py) while the client has seen
        nothing of a fault or a push-back, and relay it."""
        assert ctx.ireq is not None and ctx.decision is not None
        ireq, rec, cfg = ctx.ireq, ctx.rec, self.config
        body, strip_usage = upstream_body(ireq)
        headers = upstream_headers(ireq)
        wd = cfg.watchdog_for(ireq.model)
        if not wd.aggregated:
            wd = None
        header_timeout = head_timeout(cfg.upstream, wd, ireq.stream)
        ep = ctx.decision.endpoint
        tried = [ep]
        retries = self.retries
        if retries is not None:         # the budget counts it once the leg is out
            ctx.after_write.append(partial(retries.request, ireq.model))
        while True:
            ctx.use(ep)
            leg = ctx.trace.leg("generate", ep, attempt=len(tried))
            x = self.upstream.begin(ep, ireq.path, body, leg.inject(ctx.leg_headers(ep, headers)))
            ctx.written()                   # the leg is out: now the routing bookkeeping
            try:
                resp = await self.upstream.opened(ep, x, header_timeout, ireq.model)
                leg.responded(resp.status)
            except UpstreamFailure as f:
                leg.failed(f.kind)
                if f.retryable and retries is not None and retries.reroute(
                        ctx, self.routing, self.metrics, candidates, tried, Outcome.FAULT, f.kind) is not None:
                    ep = ctx.decision.endpoint
                    continue
                rec.error_class = f"upstream_{f.kind}"
                if f.kind == "timeout":
                    raise GatewayError(504, f"upstream timeout: {f.message}", code="upstream_timeout",
                                       header=("x-error-upstream", "timeout"), error_class=rec.error_class) from None
                raise GatewayError(502, f"upstream unavailable: {f.message}", code="upstream_unavailable",
                                   header=("x-error-upstream", f.kind), error_class=rec.error_class) from None
            if resp.status != 200 and retries is not None and (outcome := of_status(resp.status)).retryable \
                    and retries.reroute(ctx, self.routing, self.metrics, candidates, tried, outcome,
                                        f"status_{resp.status}") is not None:
                self.metrics.child(self.metrics.upstream_errors, ireq.model, ep.name, f"status_{resp.status}").inc()
                self.upstream.record(ep, outcome, f"status_{resp.status}")
                await discard(resp, cfg.upstream.max_error_body_bytes)
                ep = ctx.decision.endpoint
                continue
            break
        return await self.relay.answer(ctx, resp, adapter_for(ep.engine), strip_usage, wd)

    async def _reopen(self, ctx: RequestContext, cont: InferenceRequest, avoid: set[str]) -> UpstreamResponse:
        """Open the leg that continues a stream (``cont``) on an endpoint (or P/D pair) other
        than those in ``avoid``; the request's charges move to it."""
        rec = ctx.rec
        router = self.routing.router_for(rec.strategy)
        candidates = [c for c in self.routing.candidates(cont.model, router) if c.name not in avoid]
        ctx.ireq = cont
        if candidates and cont.lora is not None and self.lora is not None:   # those serving the adapter
            candidates = (await self.lora.serving_pairs(ctx, candidates) if router.chooses_pairs
                          else await self.lora.prepare(ctx, candidates))
        if not candidates:
            raise GatewayError(503, "no other endpoint to continue the stream on", error_class="no_endpoint")
        adapter = adapter_for(candidates[0].engine)
        ctx.trace.route_start()
        decision = ctx.decision = self.routing.route(cont, rec.strategy, router, candidates)
        if router.chooses_pairs and self.pd_decider is not None:
            candidates = self.pd_decider.decide(ctx, adapter, candidates)
            decision = ctx.decision
        ctx.charges.release()
        ctx.dp_rank = None                  # the continuation goes where the engine puts it
        ctx.charges = charge(decision.endpoint, decision.prefill, self._prefill_tokens(ctx))
        if cont.lora is not None and self.lora is not None:
            self.lora.charge(ctx)
        ctx.trace.routed(decision, len(candidates))
        if decision.prefill is not None:
            return await self.pd.reopen(ctx, adapter)
        ep = decision.endpoint
        ctx.use(ep)
        wd = self.config.watchdog_for(cont.model)
        limit = head_timeout(self.config.upstream, wd if wd.aggregated else None, cont.stream)
        leg = ctx.trace.leg("generate", ep, attempt=1)
        ctx.written()
        resp = await self.upstream.open(ep, cont.path, cont.body, leg.inject(upstream_headers(cont)), limit,
                                        cont.model)
        leg.responded(resp.status)
        return resp

    # -- error answers -------------------------------------------------------------------------

    def _error_response(self, ctx: RequestContext, e: GatewayError) -> web.Response:
        rec = ctx.rec
        rec.status = e.status
        rec.error_class = rec.error_class or e.error_class
        rec.error = e.message
        headers = rec.response_headers()
        headers.update(e.headers)
        body = ctx.api.error_body(e) if ctx.api is not None else e.body_bytes()
        return error_response(e.status, body, headers)

    async def _internal_error(self, ctx: RequestContext, e: Exception) -> web.StreamResponse:
        """A bug in the gateway. Before headers: an OpenAI-shaped 500. After them: the stream's
        final error event. Either way the traceback is logged once and the error counted."""
        rec = ctx.rec
        rec.error_class = "internal"
        rec.error = f"{type(e).__name__}: {e}"[:200]
        self.metrics.internal_errors.inc()
        log.error("internal error", request_id=rec.request_id, exc_info=e)
        out = ctx.response
        if out is None or not out.prepared:
            return self._error_response(ctx, GatewayError(500, "internal gateway error", code="internal_error",
                                                          error_class="internal"))
        try:
            await out.write(ctx.api.stream_error(ctx, 500, "internal gateway error", "internal_error")
                            if ctx.api is not None else error_event(500, "internal gateway error", code="internal_error"))
            await out.write_eof()
        except ConnectionResetError:
            pass
        return out
