"""The request pipeline: parse → admit → strategy → route+charge → forward → relay → finish.

``Pipeline.handle`` is the aiohttp handler of the inference paths and reads as the request's
script. A pipeline is built from one ``Generation`` (``gateway.pipeline.generation``): its config,
routing (``gateway.pipeline.routing``), P/D orchestration (``gateway.pd``) and aliases, with the
services every generation shares: the upstream legs (``gateway.upstream.upstream``), the relay
(``gateway.pipeline.relay``), tenancy (``gateway.tenants``), LoRA adapters, admission, retries,
tracing and the lifecycle (``gateway.server.lifecycle``). A feature that is off is a no-op object
with the same interface, so the script has no branch for it. Charges are taken by
``route_and_charge`` (``gateway.pipeline.ledger``), for a first leg and for a stream's
continuation (``reopen``, called by ``gateway.pipeline.migration``). What the stages hand each
other travels in one ``RequestContext``; every path out of ``handle`` (answer, error, client
disconnect, a bug) releases the charges and writes one log line.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import structlog
from aiohttp import web

from gateway.config.schema import SLOConfig, WatchdogConfig
from gateway.endpoints import Endpoint
from gateway.errors import ErrorClass, GatewayError, parser_message
from gateway.kv import dp_rank
from gateway.pd.decide import WHOLE_ROLES
from gateway.pd.orchestrator import PairFailed
from gateway.pipeline.context import RequestContext, model_not_found, record_request, take_edge_answer
from gateway.pipeline.generation import Generation
from gateway.pipeline.ledger import NO_CHARGES, charge
from gateway.pipeline.migration import LegSilent, Migration
from gateway.pipeline.relay import FirstBytesFailed, error_event, watchdog_fired
from gateway.pipeline.routing import WHOLE_REQUEST_ROLES
from gateway.request import InferenceRequest, body_bytes, parse
from gateway.resilience.outcome import Outcome, key_refused, of_status
from gateway.resilience.retry import discard
from gateway.server.lifecycle import shutting_down
from gateway.tenants.service import NO_TICKET, Ticket
from gateway.upstream.h1client import Exchange, UpstreamResponse
from gateway.upstream.upstream import (
    PRIORITY_HEADER,
    UpstreamFailure,
    engine_key_refused,
    head_timeout,
    no_socket_error,
    upstream_body,
    upstream_headers,
)
from handlers import adapter_for
from handlers.base import BodyError, EngineAdapter
from routers.base import Router
from routers.pd import in_bucket

log = structlog.get_logger("switchyard.request")


# body fields that steer the engine past the gateway's own controls (``Pipeline._engine_controls``)
DP_RANK_FIELDS = ("routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank")
DP_RANK_SET = frozenset(DP_RANK_FIELDS)
# vLLM's classes to load by name, SGLang's serialized callable: code run in the engine
LOGITS_PROCESSOR_FIELDS = ("logits_processors", "custom_logit_processor")
# vLLM's extra args (its sampling params' extra_args, where its KV connector reads kv_transfer_params)
XARGS_KV = "vllm_xargs.kv_transfer_params"
# a chat template of the client's: the request's own, or the member of the template's arguments
# (SGLang passes them to the tokenizer's apply_chat_template, whose template that member is)
TEMPLATE_KWARGS = "chat_template_kwargs"
KWARGS_TEMPLATE = "chat_template_kwargs.chat_template"
ENGINE_CONTROLS = frozenset({"priority", "kv_transfer_params", *DP_RANK_FIELDS, *LOGITS_PROCESSOR_FIELDS, "rid",
                             "vllm_xargs", "chat_template", TEMPLATE_KWARGS})


class ModelLegs(NamedTuple):
    """What a model's requests and aggregated legs read of the config: worked out once per model
    and generation (``Pipeline.legs``), not per request."""

    watchdog: WatchdogConfig | None         # the model's watchdog; None when it does not watch aggregated legs
    head_timeout: float | None              # the bound on a non-streamed leg's response head (``head_timeout``)
    stream_head_timeout: float | None       # on a streamed leg's
    migration_limit: int                    # the model's ``migration_limit`` (0: a stream does not continue)
    slo: SLOConfig | None                   # the model's default latency objectives (``slo:``), if any


def not_listed_yet(model: str, listed: bool = False) -> GatewayError:
    """A model the pool lacks while Kubernetes discovery has not listed the pods yet (it may be one
    of theirs), or, ``listed``, one whose pods discovery awaits (``EndpointPool.awaited``): a 503
    the client retries, not a 404 (``EndpointPool.listed``)."""
    why = ("its Kubernetes pods are starting or being made again" if listed
           else "the Kubernetes pods have not been listed yet")
    return GatewayError(503, f"no ready endpoint for model {model} ({why})",
                        code="service_unavailable", headers={"Retry-After": "5"},
                        header=("x-error-no-model-backends", "true"), error_class=ErrorClass.NO_ENDPOINT)


class Pipeline:
    """One generation's request handler (``gateway.pipeline.generation.Generation``): ``handle`` is
    the request's script, the methods below it its stages."""

    def __init__(self, gen: Generation) -> None:
        s = gen.services
        self.gen = gen
        self.config, self.routing, self.pd, self.pd_decider, self.aliases = (
            gen.config, gen.routing, gen.pd, gen.pd_decider, gen.aliases)
        self.pool, self.metrics, self.upstream, self.relay = s.pool, s.metrics, s.upstream, s.relay
        self.tenancy, self.tracing, self.lora, self.admission, self.retries = (
            s.tenancy, s.tracing, s.lora, s.admission, s.retries)
        self.lifecycle, self.request_log, self.apis = s.lifecycle, s.request_log, s.apis
        self.observers, self.model_in_flight = s.observers, s.model_in_flight
        self._legs: dict[str, ModelLegs] = {}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        ctx = RequestContext.start(request)
        rec = ctx.rec
        ctx.trace = self.tracing.of(request)        # the span the tracing middleware opened (or NO_TRACE)
        if ctx.trace.trace_id:
            rec.extra["trace_id"] = ctx.trace.trace_id
        # a client's request (a batch line has no connection): ended by the lifecycle's cut
        task = request.task if request.transport is not None else None
        self.lifecycle.enter(task)
        ticket = NO_TICKET
        model = None
        try:
            ctx.api = self.apis.get(request.path)   # first: every error is in its shape
            self.lifecycle.check_open()
            ticket = await self.tenancy.authenticate(request, rec)   # API key → user (401), before the body
            ireq = await self._parse(ctx, ticket)   # an alias or an adapter names its model; 404 if not the user's
            model = self._enter(ireq.model)         # 404 unless known; counted in flight
            rec.model_known = True                  # metric labels name known models only
            legs = self.legs(model)                 # what its stages read of the model's config
            if not ENGINE_CONTROLS.isdisjoint(ireq.data) or PRIORITY_HEADER in ireq.headers:
                self._engine_controls(ctx)          # fields that steer the engine past the gateway
            spec, router = self.routing.strategy(ireq.model, self.routing.header(request.headers, ireq.model),
                                                 lora=ireq.lora is not None)   # 400 unless known; one spelling
            rec.strategy = spec                     # metric labels hold known models and strategies only
            adapter, checked, candidates = await self._admit(ctx, ticket, spec, router, legs.slo)   # 503, 429, 400
            candidates = self.route_and_charge(ctx, spec, router, adapter, candidates, ctx.after_write)
            self.admission.dispatched(ctx)          # what the engine held when it went (slow start)
            self._pin_rank(ctx, adapter)            # a data-parallel engine's rank
            if legs.migration_limit:                # a stream that may continue elsewhere
                self._begin_migration(ctx, candidates, legs.migration_limit)
            if ctx.decision.prefill is not None:
                return await self._forward_pd(ctx, spec, router, adapter, checked, candidates)
            return await self.forward(ctx, candidates, legs)
        except GatewayError as e:
            return self._error_response(ctx, e)
        except asyncio.CancelledError:
            if rec.delivered:                       # the client left after the answer's end: complete
                if rec.error_class == ErrorClass.CLIENT_CANCEL:
                    rec.error_class = None
                raise
            if self.lifecycle.was_cut(task):        # the gateway stops: the client is told so
                return await self._cut(ctx, task)
            if (stopped := getattr(request, "stopped_as", None)) is not None:
                # a batch line its runner stopped (for an interactive request, as the gateway stops):
                # no client's cancel
                rec.status = 499
                rec.error_class, rec.error, by = stopped
                ctx.trace.event("abort", {"switchyard.abort.by": by})
                raise
            if take_edge_answer(request, rec):      # the edge's 408 or 400: the body stopped or broke
                raise
            rec.status = 499
            rec.error_class = rec.error_class or ErrorClass.CLIENT_CANCEL
            self.metrics.child(self.metrics.client_cancels, rec.label_model,
                               "streaming" if rec.headers_sent else "before_headers").inc()
            ctx.trace.event("abort", {"switchyard.abort.by": "client"})
            raise
        except Exception as e:   # a bug: the client still gets an answer, the traceback is logged once
            return await self._internal_error(ctx, e)
        finally:
            if ctx.after_write:                     # bookkeeping of a request that ended before its leg
                ctx.written()
            if ctx.ireq is not None and ctx.ireq.lora is not None:
                try:                                # an engine that said it lacks the request's adapter
                    self.lora.settle(ctx)
                except Exception:                   # a bug here must not keep the request's charges
                    log.exception("lora settle failed", request_id=ctx.rec.request_id)
            if ctx.api is not None:
                try:                                # what goes on on the engine keeps its own place
                    ctx.api.ending(ctx)
                except Exception:                   # a bug here must not keep the request's charges
                    log.exception("api ending failed", request_id=ctx.rec.request_id)
            ctx.charges.release()
            if model is not None:
                self._leave(model, ctx)
            self.lifecycle.leave(task)
            self.tenancy.settle(ticket, rec)        # charge usage tokens, release the concurrency slot
            if ctx.unsent is None:
                ctx.trace.finish(rec)
            else:                                   # the span too ends once the body went, or failed
                ctx.trace.hold()
            if (d := ctx.decision) is not None and d.reason:    # why the last decision chose as it did
                rec.extra["route_reason"] = d.reason
            if ctx.unsent is None:
                record_request(rec, self.metrics, time.perf_counter(), self.request_log, self.observers)
            else:               # its body still on its way to the client: the line once it went
                self.lifecycle.spawn(self._recorded_once_sent(ctx))

    async def _recorded_once_sent(self, ctx: RequestContext) -> None:
        """The line and span of a whole answer the client's transport held over its limit, or that
        aiohttp writes after the handler (``WatchedResponse``): written once the body went, or, when
        the client's connection was lost first (a reset while MBs went out), as the client's cancel
        (499), counted as one; the normal path never comes here."""
        rec = ctx.rec
        went = True
        try:
            went = await ctx.unsent.went()
        finally:
            if not went:
                rec.status = 499
                rec.error_class = ErrorClass.CLIENT_CANCEL
                # its head went out: ``streaming``, the stage after the headers
                self.metrics.child(self.metrics.client_cancels, rec.label_model, "streaming").inc()
            ctx.trace.finish(rec)
            ctx.trace.release(rec.status)
            record_request(rec, self.metrics, time.perf_counter(), self.request_log, self.observers)

    # -- stages ---------------------------------------------------------------------------------

    async def _parse(self, ctx: RequestContext, ticket: Ticket) -> InferenceRequest:
        """Body bytes → the parsed request (in its API's format); a name the user may not ask for
        is answered as a model that does not exist (``limits.users.<name>.models``, checked on the
        name the request gives, before any limit counts it); an alias names one of its models
        (gateway/aliases.py), an adapter is a request for its base model (gateway/lora)."""
        user = ticket.user
        request, api = ctx.http, ctx.api
        limit = self.config.server.max_body_bytes
        body = await api.read_body(request, limit) if api is not None else None
        if body is None:
            try:
                content = request.content
                if content.is_eof():        # the whole body came with the head: no await, one buffer
                    body = content.read_nowait()
                    if limit and len(body) > limit:     # a chunked body (a Content-Length is checked at the edge)
                        raise web.HTTPRequestEntityTooLarge(limit, len(body))
                else:
                    body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise GatewayError(413, f"request body exceeds {limit} bytes (server.max_body_bytes)",
                                   code="body_too_large", error_class=ErrorClass.VALIDATION) from None
            except web.RequestPayloadError as e:     # broken chunking, an undecodable Content-Encoding
                raise GatewayError(400, f"the request body could not be read: {parser_message(str(e))}", code="bad_body",
                                   error_class=ErrorClass.VALIDATION) from None
        try:
            ctx.ireq = (api.parse if api is not None else parse)(request.path, body, request.headers, ctx.rec.request_id)
        except GatewayError as e:
            if e.model is not None:         # refused after the body named its model: the log line says which
                self._refused_named(ctx, e.model, user)
            raise
        if not self.tenancy.allows(ticket, ctx.ireq):
            if ctx.rec.user is None:
                ctx.rec.user = ctx.ireq.user
            self._refused_named(ctx, ctx.ireq.model, user)
            raise model_not_found(ctx.ireq.model, ErrorClass.MODEL_NOT_ALLOWED)
        self.aliases.resolve(ctx, user)
        try:
            self.lora.resolve(ctx)
        except GatewayError:                # an adapter the request's path cannot carry
            self._refused_named(ctx, ctx.ireq.lora or ctx.ireq.model, user)
            raise
        ireq = ctx.ireq
        ireq.serial = ctx.rec.serial
        ctx.rec.model, ctx.rec.stream = ireq.model, ireq.stream
        if ctx.rec.user is None:            # without auth, who the request says it is (with auth, the key's)
            ctx.rec.user = ireq.user
        return ireq

    def _engine_controls(self, ctx: RequestContext) -> None:
        """Body fields that would steer the engine past the gateway's own controls are dropped
        unless the operator lets them through: ``priority``, which vLLM's and SGLang's priority
        scheduling read, and vLLM's ``X-Vllm-Priority`` header, which it reads over the body's,
        would put a request ahead in the engine's queue whatever its admission class
        (``upstream.client_priority``); a client's ``kv_transfer_params`` would have a vLLM engine
        with a NIXL connector pin the request's KV blocks for a remote decode or pull KV from a
        host the client chose (``pd.client_kv_transfer_params``; P/D legs carry the gateway's own
        whatever it says), and so would the ``kv_transfer_params`` member of vLLM's ``vllm_xargs``
        (the extra args vLLM puts its top-level field in, and its connector reads it from);
        SGLang's ``routed_dp_rank`` (and its older ``data_parallel_rank``) would pin the engine's
        data-parallel rank, and its ``disagg_prefill_dp_rank`` name the prefill rank a P/D decode
        fetches the KV from, ranks the gateway keeps to itself as it strips a client's
        ``X-data-parallel-rank`` (``kv_events.client_rank``); vLLM's ``logits_processors``
        (classes it loads by name) and SGLang's ``custom_logit_processor`` (a serialized callable it
        runs) would run code of the client's choosing in an engine other tenants share
        (``upstream.client_logits_processors``); a chat request's ``chat_template``, and the
        ``chat_template`` member of its ``chat_template_kwargs`` (where vLLM looks for it too, and
        which SGLang hands the tokenizer as its template), would have the engine render a Jinja
        template of the client's choosing (``upstream.client_chat_template``; the other template
        arguments, ``enable_thinking``, pass). SGLang's ``rid`` names the request in the engine,
        which aborts, as the request's connection closes, every request whose rid starts with it:
        a client's own would reach other tenants' requests (dropped whatever the config: the
        gateway's P/D legs carry its own). Each is counted and named in the log line."""
        ireq = ctx.ireq
        assert ireq is not None
        data = ireq.data
        allowed = self.config.upstream.client_priority
        dropped = []
        if "priority" in data and not allowed:
            dropped.append("priority")
        xargs = None        # vLLM's vllm_xargs without a kv_transfer_params member
        if ("kv_transfer_params" in data or "vllm_xargs" in data) \
                and not self.config.pd_for(ireq.model).client_kv_transfer_params:
            if "kv_transfer_params" in data:
                dropped.append("kv_transfer_params")
            if (given := data.get("vllm_xargs")).__class__ is dict and "kv_transfer_params" in given:
                xargs = {k: v for k, v in given.items() if k != "kv_transfer_params"}
        if not DP_RANK_SET.isdisjoint(data) and not self._client_rank(ireq.model):
            dropped += [name for name in DP_RANK_FIELDS if name in data]
        if not self.config.upstream.client_logits_processors:
            dropped += [name for name in LOGITS_PROCESSOR_FIELDS if name in data]
        kwargs = None       # chat_template_kwargs without a chat_template member
        if not self.config.upstream.client_chat_template:
            if "chat_template" in data:
                dropped.append("chat_template")
            if (given := data.get(TEMPLATE_KWARGS)).__class__ is dict and "chat_template" in given:
                kwargs = {k: v for k, v in given.items() if k != "chat_template"}
        if "rid" in data:
            dropped.append("rid")
        if dropped or xargs is not None or kwargs is not None:
            data = {k: v for k, v in data.items() if k not in dropped}
            if xargs is not None:
                data["vllm_xargs"] = xargs
                dropped.append(XARGS_KV)
            if kwargs is not None:
                data[TEMPLATE_KWARGS] = kwargs
                dropped.append(KWARGS_TEMPLATE)
            ireq.data, ireq.body = data, body_bytes(data, ireq.body)
        if PRIORITY_HEADER in ireq.headers:     # kept from every leg (upstream_headers) unless allowed
            if allowed:
                ireq.priority_header = True
            else:
                dropped.append(PRIORITY_HEADER)
        if not dropped:
            return
        ctx.rec.extra["dropped_fields"] = dropped
        for name in dropped:
            self.metrics.child(self.metrics.fields_dropped, ctx.rec.label_model, name).inc()

    def _refused_named(self, ctx: RequestContext, name: str, user: str | None) -> None:
        """A request refused after its body named ``name``: its log line names it, and its metrics
        count it under the served model it stands for (the model itself, the target its alias
        would choose, an adapter's base model), as they would have counted it served; a name the
        gateway does not serve stays under ``-``."""
        rec = ctx.rec
        rec.model = name
        if self.pool.has_model(name) or self.config.model(name) is not None:
            rec.model_known = True
            return
        target = self.aliases.target_for(name, user, ctx.http.remote) if name in self.aliases else None
        if target is None:
            target = self.lora.base_of(name)
        if target is not None and (self.pool.has_model(target) or self.config.model(target) is not None):
            rec.label_as = target

    def _enter(self, model: str) -> str:
        """The model must exist (404; 503 while the pods are not listed yet); it counts one more
        request in flight until ``_leave``."""
        if not self.pool.has_model(model) and self.config.model(model) is None:
            if not self.pool.listed or self.pool.awaited(model):
                raise not_listed_yet(model, self.pool.listed)
            raise model_not_found(model)
        self.model_in_flight[model] = self.model_in_flight.get(model, 0) + 1
        return model

    def _leave(self, model: str, ctx: RequestContext) -> None:
        self.model_in_flight[model] -= 1
        self.admission.released(model, ctx)     # freed room goes to the next waiter

    async def _admit(self, ctx: RequestContext, ticket: Ticket, spec: str, router: Router, slo: SLOConfig | None
                     ) -> tuple[EngineAdapter, Any, list[Endpoint]]:
        """Admit: ready endpoints (503), the caller's limits (429), the endpoints that can serve the
        request, a P/D body the engine accepts (400), room on them (admission: the queue, or 429);
        the prompt tokenized for the KV events' match. Returns the engine's adapter, its P/D body
        check and the candidates to route among."""
        ireq, rec = ctx.ireq, ctx.rec
        assert ireq is not None
        candidates = self.routing.candidates(ireq.model, router)
        if "x-priority" in ctx.http.headers:          # a bad one is refused before the user's window counts it
            self.admission.check_priority(ctx, ireq.model)
        try:
            await self.tenancy.admit(ticket, ireq, rec)   # model RPS, user RPM/TPM/concurrency (429)
        finally:
            rec.user = ireq.user                      # with auth on, the key's user (admit decides it); a 429's too
        if ctx.api is not None or ireq.lora is not None or (router.chooses_pairs and ireq.is_embeddings):
            candidates = ctx.serving = await self._serving(ctx, spec, router, candidates)
        adapter = adapter_for(candidates[0].engine)
        checked = self._check_pd_body(adapter, ctx) if router.chooses_pairs else None
        self._objectives(ireq, rec, slo)
        kv = self.routing.ctx.precise_index           # tokenized off the loop, so the match finds it cached
        if kv is not None and (router.reads_kv_events or router.chooses_pairs) and kv.covers(ireq):
            # before admission, whose room is the request's only if it routes and charges its endpoint
            # in the step admission lets it go in: awaited after it, the room stayed free for others.
            # A request admission would shed now is shed first: its tokens would serve nothing
            self.admission.shed_early(ctx, candidates, router.chooses_pairs)
            await kv.prepare(ireq, candidates)
        if self.admission.settings(ireq.model) is not None:     # admission is on for the model (no await if off)
            candidates = await self.admission.admit(ctx, candidates, router.chooses_pairs)
        value = self.admission.engine_priority(ctx) if self.admission.writes_priority else None
        if value is not None:                   # the class, in the engine's queue order
            ireq.priority_header = False        # vLLM would read a client's header over the value
            if ireq.data.get("priority") != value:
                data = {**ireq.data, "priority": value}
                ireq.data, ireq.body = data, body_bytes(data, ireq.body)
        return adapter, checked, candidates

    def _objectives(self, ireq: InferenceRequest, rec, slo: SLOConfig | None) -> None:
        """The request's latency objectives: its headers', else its model's ``slo:`` defaults (``slo``)."""
        if slo is not None:
            if ireq.slo_ttft_ms is None:
                ireq.slo_ttft_ms = slo.ttft_ms
            if ireq.slo_tpot_ms is None:
                ireq.slo_tpot_ms = slo.tpot_ms
        if ireq.slo_ttft_ms is not None:
            rec.extra["slo_ttft_ms"] = ireq.slo_ttft_ms
        if ireq.slo_tpot_ms is not None:
            rec.extra["slo_tpot_ms"] = ireq.slo_tpot_ms

    async def _serving(self, ctx: RequestContext, spec: str, router: Router,
                       candidates: list[Endpoint]) -> list[Endpoint]:
        """The candidates that can serve the request: its API's state or the endpoints whose engine
        serves the API; those serving its LoRA adapter (loaded if none does). On a P/D model, a
        request of an API whose pairs cannot carry it (``pd_refusal``), or an embedding, is a 400."""
        ireq, api = ctx.ireq, ctx.api
        assert ireq is not None
        if router.chooses_pairs and (api is not None or ireq.is_embeddings):
            # an embedding generates nothing: neither engine's embeddings request takes the P/D
            # fields (vLLM's kv_transfer_params, SGLang's bootstrap room), so its prefill leg would
            # embed the input whole and its decode again
            why = api.pd_refusal(ireq.path, {ep.engine for ep in candidates}) if api is not None else ""
            if why is not None:
                raise GatewayError(400, f"POST {ireq.path} is not served by prefill/decode pairs, and the "
                                        f"model `{ireq.model}` routes with the P/D strategy {spec!r}"
                                        + (f": {why}" if why else ""),
                                   header=("x-error-routing", "true"), error_class=ErrorClass.ROUTING)
        if api is not None:
            candidates = await api.prepare(ctx, candidates)
        if ireq.lora is not None:
            candidates = await self._adapter_serving(ctx, router, candidates)
        return candidates

    async def _adapter_serving(self, ctx: RequestContext, router: Router,
                               candidates: list[Endpoint]) -> list[Endpoint]:
        return (await self.lora.serving_pairs(ctx, candidates) if router.chooses_pairs
                else await self.lora.prepare(ctx, candidates))

    def route_and_charge(self, ctx: RequestContext, spec: str, router: Router, adapter: EngineAdapter,
                         candidates: list[Endpoint], later: list[Callable[[], None]] | None) -> list[Endpoint]:
        """Route ``ctx.ireq`` among ``candidates`` and charge the decision's endpoints in the same
        synchronous step (the ledger's rule), for the first leg and for a continuation alike (whose
        charges move to the new decision). A P/D decision may run whole instead (gateway/pd/decide.py).
        ``later``: the request's ``after_write``, where the router's learning and observers wait
        until the leg is written (None: at once). Returns the candidates a retry may use."""
        ireq = ctx.ireq
        assert ireq is not None
        ctx.trace.route_start()
        decision = ctx.decision = self.routing.route(ireq, spec, router, candidates, later)
        if router.chooses_pairs:                # disaggregate, or run it whole
            candidates = self.pd_decider.decide(ctx, adapter, candidates)
        if ctx.charges is not NO_CHARGES:
            ctx.charges.release()               # a continuation's: they move to the new decision
        ctx.dp_rank = ctx.pd_plan = None        # of the legs before, if any
        ctx.charges = (charge(decision.endpoint) if decision.prefill is None   # one endpoint: its in-flight count
                       else charge(decision.endpoint, decision.prefill, self._prefill_tokens(ctx)))
        if ireq.lora is not None:
            self.lora.charge(ctx)               # its endpoints' adapter
        ctx.trace.routed(decision, len(candidates))
        return candidates

    def _pin_rank(self, ctx: RequestContext, adapter: EngineAdapter) -> None:
        """Pin the request to a data-parallel rank of its endpoint (gateway/kv/dp_rank.py)."""
        kv = self.routing.ctx.precise_index
        ireq = ctx.ireq
        assert ireq is not None
        if (kv is not None and kv.index.ranked) or dp_rank.DP_RANK_HEADER in ireq.headers:
            dp_rank.pin(ctx, kv, adapter, self._client_rank(ireq.model))

    def legs(self, model: str) -> ModelLegs:
        """``model``'s ``ModelLegs``, kept for the pipeline's life (its config does not change)."""
        legs = self._legs.get(model)
        if legs is None:
            wd = self.config.watchdog_for(model)
            if not wd.aggregated:
                wd = None
            up = self.config.upstream
            m = self.config.model(model)
            legs = ModelLegs(wd, head_timeout(up, wd, False), head_timeout(up, wd, True),
                             getattr(m, "migration_limit", 0), m.slo if m is not None else None)
            if len(self._legs) >= 4096:     # models come and go (Kubernetes): keep it bounded
                self._legs.clear()
            self._legs[model] = legs
        return legs

    def _begin_migration(self, ctx: RequestContext, candidates: list[Endpoint], limit: int) -> None:
        """A stream of a model with ``migration_limit`` (``limit``) may continue on another endpoint
        when its engine fails (gateway/pipeline/migration.py); its legs are opened by this pipeline."""
        ctx.migration = Migration.begin(ctx, limit, candidates[0].engine, self.metrics, self)

    @staticmethod
    def _check_pd_body(adapter, ctx: RequestContext):
        try:   # refused before any endpoint is chosen
            return adapter.check_pd_body(ctx.ireq)
        except BodyError as e:
            raise GatewayError(400, str(e), header=("x-error-routing", "true"), error_class=ErrorClass.VALIDATION) from None

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

    async def _forward_pd(self, ctx: RequestContext, spec: str, router: Router, adapter: EngineAdapter,
                          checked: Any, candidates: list[Endpoint]) -> web.StreamResponse:
        """A P/D request's legs. A leg that failed before the client saw anything in a way another
        pair may not (``PairFailed``: refused, closed with nothing received, a decode's 5xx or a
        failure before its first token): its endpoint is left out, and its suspect too while another
        of that role is ready, and the pair chosen again among the other candidates, within the
        retry budget (gateway/resilience/retry.py). The other candidates are those ready now: an
        endpoint that was out when the request was routed (a restart, a breaker's trials taken) and
        is back when its pair fails may take the retry."""
        assert ctx.ireq is not None
        tried: list[Endpoint] = []
        while True:
            try:
                return await self.pd.forward(ctx, adapter, checked)
            except PairFailed as e:
                failed, suspect = e.endpoint, e.suspect
                tried.append(failed)
                candidates = self._ready_since(ctx, candidates)
                if suspect is not None and any(c.role == suspect.role and c.ready and c is not suspect
                                               and c not in tried for c in candidates):
                    tried.append(suspect)
                others = [c for c in candidates if c not in tried]
                # another of the failed one's role (or a combined endpoint) that the pair's choice
                # may take: one whose prompt-length bucket holds the request
                n = ctx.ireq.prompt_tokens_est
                if self.retries.others(ctx.ireq.model, Outcome.FAULT, failed, ctx.rec.retries,
                                       [c for c in others if c.role in (failed.role, "combined") and in_bucket(c, n)],
                                       tried) is None:
                    raise
                self.retries.count(ctx, self.metrics, failed, e.cause)
                ctx.rec.error_class = None              # of the failed try: the retry's answer says its own
                ctx.rec.extra.pop("prefill_failure", None)
                candidates = self.route_and_charge(ctx, spec, router, adapter, others, ctx.after_write)
                self._pin_rank(ctx, adapter)
                if ctx.decision.prefill is None:    # the decider runs it whole this time
                    return await self.forward(ctx, candidates)

    def _ready_since(self, ctx: RequestContext, candidates: list[Endpoint]) -> list[Endpoint]:
        """A P/D request's candidates, and its model's endpoints that became ready since they were
        taken. Not when its API or its LoRA adapter chose among them (the endpoints serving it)."""
        ireq = ctx.ireq
        assert ireq is not None
        if ctx.api is not None or ireq.lora is not None:
            return candidates
        known = set(candidates)
        back = [ep for ep in self.pool.ready(ireq.model) if ep not in known]
        return candidates + back if back else candidates

    def _whole_ready_since(self, ctx: RequestContext, candidates: list[Endpoint]) -> list[Endpoint]:
        """A whole request's candidates, and the endpoints that became ready since they were taken
        and that the rules which narrowed them let in: whole-request endpoints of its model with
        room for it (admission), those of its prompt's bucket when the P/D decider runs it whole on
        combined endpoints. None when its API or its LoRA adapter chose among them (the endpoints
        serving it), nor when it runs whole on the decode the P/D decider chose."""
        ireq = ctx.ireq
        assert ireq is not None
        if ctx.api is not None or ireq.lora is not None:
            return candidates
        if self.routing.router_for(ctx.rec.strategy).chooses_pairs:
            if not all(c.role in WHOLE_ROLES for c in candidates):
                return candidates
            n = ireq.prompt_tokens_est
            back = [ep for ep in self.pool.ready(ireq.model, WHOLE_ROLES) if in_bucket(ep, n)]
        else:
            back = self.pool.ready(ireq.model, WHOLE_REQUEST_ROLES)
        known = set(candidates)
        back = self.admission.with_room(ctx, [ep for ep in back if ep not in known])
        return candidates + back if back else candidates

    async def forward(self, ctx: RequestContext, candidates: list[Endpoint],
                      legs: ModelLegs | None = None) -> web.StreamResponse:
        """Open the aggregated leg, retrying elsewhere (gateway/resilience/retry.py) while the client has seen
        nothing of a fault or a push-back, and relay it. The retry chooses among the endpoints ready
        then: one that was out when the request was routed (a restart, a breaker's trials taken)
        and is back may take it, under the rules that narrowed the candidates (``_whole_ready_since``).
        ``legs``: the model's ``ModelLegs``, when its caller has them."""
        assert ctx.ireq is not None and ctx.decision is not None
        ireq, rec, cfg = ctx.ireq, ctx.rec, self.config
        ep = ctx.decision.endpoint
        alone = adapter_for(ep.engine).continuous_usage_alone
        body, strip_usage = upstream_body(ireq, alone)
        headers = upstream_headers(ireq)
        if legs is None:
            legs = self.legs(ireq.model)
        wd = legs.watchdog
        header_timeout = legs.stream_head_timeout if ireq.stream else legs.head_timeout
        tried = [ep]
        retries = self.retries
        ctx.after_write.append(partial(retries.request, ireq.model))   # the budget counts it once the leg is out
        while True:
            adapter = adapter_for(ep.engine)
            if adapter.continuous_usage_alone is not alone:     # a mixed model's retry on the other kind
                alone = adapter.continuous_usage_alone
                body = upstream_body(ireq, alone)[0]
            ctx.use(ep)
            leg = ctx.trace.leg("generate", ep, attempt=rec.retries + 1)
            x = self.upstream.begin(ep, ireq.path, body, leg.inject(ctx.leg_headers(ep, headers)))
            ctx.written()                   # the leg is out: now the routing bookkeeping
            # a stream's head for the client, made while the engine computes (an engine that sends
            # its own head with the first token, SGLang, then finds it made); not before a connect
            ahead = self.relay.stream_ahead(ctx) if ireq.stream and x.sent and ctx.migration is None else None
            if ahead is not None and adapter.head_with_first_token:
                # and taken from the read that brings that head: the first token goes to the client
                # from there; anything but a 200 event stream is answered below, as it came
                early = x.before_head(header_timeout)
                if early is not None:
                    try:
                        return await self.relay.stream_from_head(ctx, early, strip_usage, wd, ahead,
                                                                 partial(_head_came, x, leg))
                    except FirstBytesFailed:
                        pass
                    finally:
                        x.head_came()
            try:
                resp = await self.upstream.opened(ep, x, header_timeout, ireq.model)
                leg.responded(resp.status)
            except asyncio.CancelledError:
                # the client left (or the gateway stops) before the answer's head: nothing learnt of
                # the engine, but its breaker hears the leg ended (a half-open one's trial slot is free)
                self.upstream.record(ep, Outcome.NONE, "cancelled")
                raise
            except UpstreamFailure as f:
                leg.failed(f.kind)
                if f.retryable:
                    candidates = self._whole_ready_since(ctx, candidates)
                if f.retryable and retries.reroute(
                        ctx, self.routing, self.metrics, candidates, tried, Outcome.FAULT, f.kind) is not None:
                    ep = ctx.decision.endpoint
                    continue
                if f.local:                 # this process could make no socket: no engine is at fault
                    raise no_socket_error(f, rec) from None
                rec.error_class = ErrorClass.upstream(f.kind)
                if f.kind == "timeout":
                    phase = _watchdog_phase(wd, cfg.upstream.first_byte_timeout_s, ireq.stream)
                    if phase is not None:   # the watchdog's bound cut the wait for the head: its fire
                        watchdog_fired(ctx, self.metrics, phase, header_timeout)
                        rec.error_class = ErrorClass.watchdog(phase)
                    raise GatewayError(504, f"upstream timeout: {f.message}", code="upstream_timeout",
                                       header=("x-error-upstream", "timeout"), error_class=rec.error_class) from None
                raise GatewayError(502, f"upstream unavailable: {f.message}", code="upstream_unavailable",
                                   header=("x-error-upstream", f.kind), error_class=rec.error_class) from None
            if resp.status != 200 and (outcome := of_status(resp.status, ep.api_key is not None)).retryable \
                    and retries.reroute(ctx, self.routing, self.metrics, self._whole_ready_since(ctx, candidates),
                                        tried, outcome, f"status_{resp.status}") is not None:
                if key_refused(resp.status, ep.api_key is not None):
                    engine_key_refused(self.metrics, ep, ireq.model, resp.status, ireq.path)
                else:
                    self.metrics.child(self.metrics.upstream_errors, ireq.model, ep.name, f"status_{resp.status}").inc()
                self.upstream.record(ep, outcome, f"status_{resp.status}")
                await discard(resp, cfg.upstream.max_error_body_bytes)
                ep = ctx.decision.endpoint
                continue
            break
        return await self.relay.answer(ctx, resp, adapter, strip_usage, wd, ahead)

    # -- a stream's continuation (gateway/pipeline/migration.py calls these) ---------------------

    def abandon(self, ctx: RequestContext) -> None:
        """The stream's leg failed and continues elsewhere: a P/D decode is told to stop first."""
        self.pd.abandon(ctx)

    async def reopen(self, ctx: RequestContext, cont: InferenceRequest, avoid: set[str]) -> UpstreamResponse:
        """Open the leg that continues a stream (``cont``) on an endpoint (or P/D pair) other
        than those in ``avoid``, up to its response head; the request's charges move to it."""
        rec = ctx.rec
        router = self.routing.router_for(rec.strategy)
        candidates = [c for c in self.routing.candidates(cont.model, router) if c.name not in avoid]
        ctx.ireq = cont
        if candidates and cont.lora is not None:   # those serving the adapter
            candidates = await self._adapter_serving(ctx, router, candidates)
        if not candidates:
            raise GatewayError(503, "no other endpoint to continue the stream on", error_class=ErrorClass.NO_ENDPOINT)
        adapter = adapter_for(candidates[0].engine)
        self.route_and_charge(ctx, rec.strategy, router, adapter, candidates, None)
        cont = ctx.ireq                     # (a P/D decode that runs it whole sends it without KV params)
        assert cont is not None
        decision = ctx.decision
        if decision.prefill is not None:
            return await self.pd.reopen(ctx, adapter)
        ep = decision.endpoint
        ctx.use(ep)
        legs = self.legs(cont.model)
        limit = legs.stream_head_timeout if cont.stream else legs.head_timeout
        leg = ctx.trace.leg("generate", ep, attempt=ctx.rec.retries + 1)
        ctx.written()
        try:
            resp = await self.upstream.open(ep, cont.path, cont.body, leg.inject(upstream_headers(cont)), limit,
                                            cont.model)
        except UpstreamFailure as f:
            # the watchdog's bound cut the wait for the head (an SGLang stream's comes with its
            # first token): the watchdog's fire on this leg, as on a fresh request's
            phase = _watchdog_phase(legs.watchdog, self.config.upstream.first_byte_timeout_s, cont.stream) \
                if f.kind == "timeout" and cont.stream else None
            if phase is not None and limit:
                raise LegSilent(phase, limit) from None
            raise
        leg.responded(resp.status)
        return resp

    # -- error answers -------------------------------------------------------------------------

    def _error_response(self, ctx: RequestContext, e: GatewayError) -> web.StreamResponse:
        if ctx.api is not None:
            e = ctx.api.own_error(e)            # its API's status for it (Anthropic's 529 of overload)
        rec = ctx.rec
        rec.status = e.status
        rec.error_class = rec.error_class or e.error_class
        rec.error = e.message
        headers = rec.response_headers()
        if ctx.decision is not None:            # what routing said of it (x-pd-decision, ...) too
            headers.update(ctx.decision.headers)
        headers.update(e.headers)
        body = ctx.api.error_body(e) if ctx.api is not None else e.body_bytes()
        return self.relay.error_answer(ctx, e.status, body, headers)

    async def _cut(self, ctx: RequestContext, task: asyncio.Task | None) -> web.StreamResponse:
        """A request still running when the gateway stops (the grace period over, or a second
        signal): the 503 of a gateway shutting down, or a stream's last event saying so, in the
        request's API shape, instead of a connection closed in the middle of the answer."""
        if task is not None:
            task.uncancel()                         # the cut is answered here
        e = shutting_down()
        rec, out = ctx.rec, ctx.response
        rec.error_class, rec.error = e.error_class, e.message
        if out is None or not out.prepared:
            return self._error_response(ctx, e)
        try:
            if ctx.api is not None:
                last = ctx.api.stream_error(ctx, e.status, e.message, e.code)
                await ctx.api.failed(ctx)
            else:
                last = error_event(e.status, e.message, code=e.code)
            await out.write(last)
            await out.write_eof()
        except ConnectionResetError:
            pass
        return out

    async def _internal_error(self, ctx: RequestContext, e: Exception) -> web.StreamResponse:
        """A bug in the gateway. Before headers: an OpenAI-shaped 500. After them: the stream's
        final error event. Either way the traceback is logged once and the error counted."""
        rec = ctx.rec
        rec.error_class = ErrorClass.INTERNAL
        rec.error = f"{type(e).__name__}: {e}"[:200]
        self.metrics.internal_errors.inc()
        log.error("internal error", request_id=rec.request_id, exc_info=e)
        out = ctx.response
        if out is None or not out.prepared:
            return self._error_response(ctx, GatewayError(500, "internal gateway error", code="internal_error",
                                                          error_class=ErrorClass.INTERNAL))
        try:
            if ctx.api is not None:
                last = ctx.api.stream_error(ctx, 500, "internal gateway error", "internal_error")
                await ctx.api.failed(ctx)
            else:
                last = error_event(500, "internal gateway error", code="internal_error")
            await out.write(last)
            await out.write_eof()
        except ConnectionResetError:
            pass
        return out


def _watchdog_phase(wd: WatchdogConfig | None, first_byte: float, stream: bool) -> str | None:
    """The watchdog's phase when its bound (``head_timeout``: the shorter of it and
    ``first_byte_timeout_s``) is the one a leg's wait for its head ran out on, else None."""
    if wd is None:
        return None
    limit = wd.first_chunk_timeout_s if stream else wd.response_timeout_s
    if not limit or first_byte and first_byte < limit:
        return None
    return "first_chunk" if stream else "response"


def _head_came(x: Exchange, leg: Any, resp: UpstreamResponse) -> None:
    """A stream taken from the read that brought its engine's head: the head's bound ends, and
    the leg's trace notes the status (``Pipeline.forward``)."""
    x.head_came()
    leg.responded(resp.status)
