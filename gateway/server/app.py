"""The aiohttp application: it wires the collaborators and owns their lifecycle.

The services (``gateway.pipeline.generation.build_services``) are built once; the first
generation's pipeline and every reload's come from one builder (``_builder``, around
``build_generation``). The pipeline calls its collaborators and none of them calls the pipeline
back. Startup and teardown are one
``cleanup_ctx`` generator each, so what starts is stopped in reverse order, also when a later
step fails.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable

import orjson
import structlog
from aiohttp import HttpVersion11, hdrs, web
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest

from gateway.apis.anthropic_models import (
    ANTHROPIC_VERSION,
    asks_anthropic,
    model_info,
    models_page,
    on_models,
)
from gateway.apis.base import ApiShape
from gateway.apis.paths import MESSAGES, on_messages
from gateway.apis.responses import add_responses
from gateway.batch.service import BatchService
from gateway.config.schema import Config
from gateway.endpoints import EndpointPool
from gateway.errors import ErrorClass, GatewayError, error_response
from gateway.observability.logs import RequestLog
from gateway.observability.looplag import LoopLagMonitor
from gateway.observability.merge import OPENMETRICS, counter_rules, merge, openmetrics, render
from gateway.observability.metrics import GatewayMetrics, RetiredSeries
from gateway.observability.status import StatusBoard, StatusSources
from gateway.observability.status_http import StatusPage, add_status
from gateway.observability.tracing import NO_TRACE, TRACE_KEY, Tracing
from gateway.pipeline.context import model_not_found
from gateway.pipeline.generation import Generation, Services, build_generation, build_services
from gateway.pipeline.pipeline import Pipeline, not_listed_yet
from gateway.request import CHAT, COMPLETIONS, EMBEDDINGS, claimed_user, given_request_id, request_id_from
from gateway.server.admin import ADMIN_LOG_FIELDS, AdminAudit, add_tenancy
from gateway.server.cors import add_vary
from gateway.server.edge import (
    STANDARD_METHODS,
    expectation_failed,
    head_started,
    log_edge_answer,
    not_implemented_answer,
    not_implemented_message,
)
from gateway.server.lifecycle import Lifecycle
from gateway.server.reclaim import MemoryReclaimer
from gateway.server.reload import Build, Live, Reloader, declared_endpoints
from gateway.server.siblings import Siblings, lifecycle
from gateway.server.workers import WorkerInfo
from gateway.tenants import Tenancy
from gateway.upstream.monitor import Monitor
from gateway.upstream.upstream import make_session
from gateway.view.service import RoutingView, WorkerSlot
from k8s.discovery import KubernetesDiscovery
from routers.prefix_cache import fleet_load

log = structlog.get_logger("switchyard.app")

GATEWAY_KEY = web.AppKey("gateway", Pipeline)    # the first generation's pipeline; RELOAD_KEY's .live is the current
RELOAD_KEY = web.AppKey("reload", Reloader)
LIFECYCLE_KEY = web.AppKey("lifecycle", Lifecycle)
MONITOR_KEY = web.AppKey("monitor", Monitor)
DISCOVERY_KEY = web.AppKey("discovery", KubernetesDiscovery)
# set by the server at SIGTERM: /ready answers 503 while requests are still served (server.py)
NOT_READY_KEY = web.AppKey("not_ready", asyncio.Event)
# POST paths the edge hands straight to their handler (gateway/server/edge.py ``EdgeServer``)
DIRECT_KEY = web.AppKey("direct", dict)
STATUS_PAGE_KEY = web.AppKey("status_page", StatusPage)
BATCH_KEY = web.AppKey("batch", BatchService)


def pool_from_config(config: Config) -> EndpointPool:
    pool = EndpointPool()
    for ep in declared_endpoints(config):
        pool.add(ep)
    return pool


# the models paths' answers are in Anthropic's shape or OpenAI's as the request carries anthropic-version
# or not: each says so, so that a shared cache keeps the two apart (RFC 9110 §12.5.5)
_VARY = {"Vary": ANTHROPIC_VERSION}


def _json(status: int, payload, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), headers=headers, content_type="application/json")


# the Files and Batches API's paths (gateway/batch): without batch.enabled, their 404 says so
_BATCH_PATHS = ("/v1/files", "/v1/batches")
_BATCH_OFF = ("the Batch API (/v1/files, /v1/batches) is off on this gateway: "
             "the configuration's batch.enabled: true turns it on")


def _on_batch_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in _BATCH_PATHS)


def _log_fields(request: web.BaseRequest) -> dict | None:
    """The fields a request's line adds (a CORS outcome, an admin call's action and credential; a
    traced request's trace_id)."""
    fields = getattr(request, "log_fields", None) or request.get(ADMIN_LOG_FIELDS)
    if trace_id := request.get(TRACE_KEY, NO_TRACE).trace_id:
        fields = {**(fields or {}), "trace_id": trace_id}
    return fields


def _error_answers(metrics: GatewayMetrics, apis: dict[str, ApiShape], request_log: RequestLog | None = None,
                   batch_enabled: bool = True):
    """The answer to an exception a handler let out: every answer is JSON in its path's API shape
    (OpenAI's, Anthropic's on /v1/messages), aiohttp's own 404/405/413 and any bug included. A 404
    or 405 for a method the gateway knows on no path (gateway/server/edge.py ``STANDARD_METHODS``, and
    those its routes serve) is RFC 9110 §9.1's 501. The 404, 405 and 501 made here, the answers to a
    path or method nothing serves, and a 413 (aiohttp's own past ``client_max_size``, or an API's to a
    body found too large as it came), are written to ``request_log`` (no API handler logs them).
    Without ``batch_enabled``, the 404 of a Files or Batches path says the Batch API is off and
    which key turns it on, where another path's says it is unknown.
    Returns None for what must propagate (a redirect, a cancellation)."""
    anthropic = apis.get(MESSAGES)
    known: frozenset[str] | None = None     # STANDARD_METHODS and the routes' (the router is frozen by then)

    def implemented(request: web.Request) -> bool:
        nonlocal known
        if request.method in STANDARD_METHODS:
            return True
        if known is None:
            known = STANDARD_METHODS | {r.method for r in request.app.router.routes() if r.method != hdrs.METH_ANY}
        return request.method in known

    def api_of(request: web.Request) -> ApiShape | None:
        path = request.path
        api = apis.get(path)
        if api is None and anthropic is not None and (on_messages(path) or asks_anthropic(path, request.headers)):
            # a Messages path not served (batches, "/v1/messages%00"), or Anthropic's SDK asking
            # /v1/models (it sends anthropic-version): the SDK's shape
            api = anthropic
        return api

    def shaped(request: web.Request, err: GatewayError) -> bytes:
        api = api_of(request)
        return api.error_body(err) if api is not None else err.body_bytes()

    def answer(request: web.Request, e: Exception) -> web.Response | None:
        resp = _answer(request, e)
        if resp is not None and on_models(request.path):    # its shape follows anthropic-version
            add_vary(resp.headers, ANTHROPIC_VERSION)
        return resp

    def _answer(request: web.Request, e: Exception) -> web.Response | None:
        rid = request_id_from(given_request_id(request.headers))
        if isinstance(e, web.HTTPException):
            if e.status < 400:
                return None
            if e.status in (404, 405) and not implemented(request):
                resp = not_implemented_answer(request.path, request.method, rid)
                msg = not_implemented_message(request.method)
            else:
                code = None
                if e.status == 413:             # request.read() past client_max_size: the edge's answer to a told length
                    msg, code = (f"request body exceeds {request.client_max_size} bytes (server.max_body_bytes)",
                                 "body_too_large")
                elif e.status == 404 and not batch_enabled and _on_batch_path(request.path):
                    msg = _BATCH_OFF
                else:
                    msg = {404: f"unknown path {request.path}",
                           405: f"method {request.method} not allowed on {request.path}"}.get(e.status, e.reason)
                err = GatewayError(e.status, msg, code=code, error_class=ErrorClass.HTTP)
                headers = {"request-id": rid, "x-request-id": rid}
                if e.status == 405 and "Allow" in e.headers:
                    headers["Allow"] = e.headers["Allow"]
                resp = error_response(e.status, shaped(request, err), headers)
            if request_log is not None and resp.status in (404, 405, 413, 501):
                log_edge_answer(rid, given_request_id(request.headers), request.path, request.method,
                                resp.status, msg, head_started(request), request_log,
                                extra=_log_fields(request))
            return resp
        if isinstance(e, GatewayError):
            api = api_of(request)
            if api is not None:
                e = api.own_error(e)            # its API's status for it (Anthropic's 529 of overload)
            if e.status == 413 and request_log is not None:
                # a body over its limit found as it came (a chunked upload past batch.max_file_bytes):
                # logged as the edge's 413 to a told length is, though the API's other answers are not
                log_edge_answer(rid, given_request_id(request.headers), request.path, request.method,
                                413, e.message, head_started(request), request_log,
                                extra=_log_fields(request))
            return error_response(e.status, shaped(request, e), {"request-id": rid, "x-request-id": rid, **e.headers})
        # a bug outside the pipeline (which answers its own)
        metrics.internal_errors.inc()
        log.error("internal error", request_id=rid, path=request.path, exc_info=e)
        err = GatewayError(500, "internal gateway error", code="internal_error")
        return error_response(500, shaped(request, err), {"request-id": rid, "x-request-id": rid})
    return answer


# on every /admin/* answer: kept by no browser's or proxy's cache, and never read as another type
ADMIN_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}


async def _identified(request: web.Request, response: web.StreamResponse) -> None:
    """``request-id`` and ``x-request-id`` on every answer the application makes (the models list,
    /health, /ready, the status page, the Files and Batches API, their errors), as the pipeline
    puts them on its own: the client's ``x-request-id`` when it is sane, else a fresh id. An
    aiohttp signal, sent before the head is written; the inference paths the edge hands to their
    handler directly have no route, so their answers (which carry both already) never pay for it.
    An answer of the admin API (``/admin/*``, its errors included) gets ``ADMIN_HEADERS``: it may
    hold a key shown once, the users and their usage, and no cache may keep it."""
    headers = response.headers
    rid = headers.get("request-id")
    if rid is None:
        rid = headers["request-id"] = request_id_from(given_request_id(request.headers))
    if "x-request-id" not in headers:
        headers["x-request-id"] = rid
    if request.path.startswith("/admin/"):
        headers.update(ADMIN_HEADERS)


def _error_middleware(answer):
    @web.middleware
    async def error_middleware(request: web.Request, handler):
        try:
            return await handler(request)
        except Exception as e:
            resp = answer(request, e)
            if resp is None:
                raise
            return resp
    return error_middleware


async def _expect(request: web.Request) -> web.Response | None:
    """``Expect: 100-continue`` answered as aiohttp answers it (the interim answer, then the body is
    read); any other expectation a 417 in OpenAI's shape, as every error the gateway writes (Anthropic's
    on the Messages paths): the edge's (gateway/server/edge.py ``expectation_failed``), which answers
    it on the other paths before aiohttp's plain-text one."""
    if request.version != HttpVersion11:
        return None
    if request.headers.get("Expect", "").lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0          # the answer's own bytes are counted from here
        return None
    return expectation_failed(request)


def _direct_routes(paths, reloader: Reloader, answer, tracing: Tracing | None) -> dict[str, Callable]:
    """The inference paths' handler as the edge calls it without the application (gateway/server/edge.py
    ``EdgeServer``): the live generation's pipeline, and the error middleware's answer for what
    escapes it; with tracing, inside the request's span, as the application's middleware runs them."""
    async def direct(request: web.Request) -> web.StreamResponse:
        try:
            return await reloader.live.pipeline.handle(request)
        except Exception as e:
            resp = answer(request, e)
            if resp is None:
                raise
            return resp
    return dict.fromkeys(paths, tracing.direct(direct) if tracing is not None else direct)


def _builder(services: Services) -> Build:
    """The one way a generation's pipeline is built, at start-up and at every reload."""
    def build(config: Config, previous: Generation | None = None) -> Pipeline:
        return Pipeline(build_generation(config, services, previous))
    return build


def _view_slot(worker: WorkerInfo | None) -> WorkerSlot | None:
    """This worker's place on the shared routing view's bus: its sockets live in the parent's run
    directory beside the siblings' ones, and the directory's name is the gateway's group (the same
    in every worker, new at every start)."""
    if worker is None:
        return None
    return WorkerSlot(worker.index, worker.count, worker.run_dir, os.path.basename(worker.run_dir))


def build_app(config: Config, pool: EndpointPool | None = None,
              loader: Callable[[], Config] | None = None, worker: WorkerInfo | None = None) -> web.Application:
    """``loader`` re-reads the config file for a reload (gateway/server/reload.py); None: no reload.
    ``worker``: this process is one of ``--workers N`` (None: the whole gateway); the workers share
    the routing view (gateway/view) and answer each other's scrapes (gateway/server/siblings.py)."""
    pool = pool if pool is not None else pool_from_config(config)
    s = build_services(config, pool, _view_slot(worker))
    if worker is not None:          # admission's bounds are the gateway's: each worker takes its share
        s.admission.set_workers(worker.count, worker.index)
        if isinstance(s.tenancy, Tenancy):      # and each worker is a replica of its own in Redis
            s.tenancy.set_worker(worker.index, worker.count)
    metrics, lifecycle = s.metrics, s.lifecycle
    tenancy = s.tenancy if isinstance(s.tenancy, Tenancy) else None
    tracing = s.tracing if isinstance(s.tracing, Tracing) else None
    build = _builder(s)
    gw = build(config)
    # new requests enter the live generation's pipeline; a reload swaps it (gateway/server/reload.py)
    reloader = Reloader(Live(gw, worker.generation if worker is not None else 1), pool, metrics, build, tenancy,
                        loader)
    reloader.listeners.append(lambda live: s.follow(live.config))   # shared services: their state stays
    metrics.attach_live_state(pool.endpoints, s.model_in_flight,
                              prefix_stats=lambda: reloader.live.routing.ctx.prefix_index.stats(),
                              engine_max_age=lambda: reloader.live.config.routing.metrics_max_age_s,
                              fleet_load=lambda ep: fleet_load(ep, time.monotonic(),
                                                               reloader.live.config.routing.metrics_max_age_s),
                              served=lambda m: pool.has_model(m) or reloader.live.config.model(m) is not None,
                              connections=s.upstream.connections,
                              session_stats=s.view.sessions.stats)
    started_at = int(time.time() if worker is None or worker.started_at is None else worker.started_at)

    # the trace middleware is outermost, so the request span sees the status the client gets
    answer = _error_answers(metrics, s.apis, s.request_log, config.batch.enabled)
    middlewares = ([tracing.middleware] if tracing is not None else []) + [_error_middleware(answer)]
    app = web.Application(middlewares=middlewares, client_max_size=config.server.max_body_bytes)
    app.on_response_prepare.append(_identified)
    app[GATEWAY_KEY] = gw
    app[RELOAD_KEY] = reloader
    app[LIFECYCLE_KEY] = lifecycle
    app[NOT_READY_KEY] = asyncio.Event()

    inference = (CHAT, COMPLETIONS, EMBEDDINGS, *s.apis)     # s.apis: Responses, Messages, pass-through
    for path in inference:
        app.router.add_post(path, reloader.live_handle, expect_handler=_expect)
    # the edge calls these paths' handler itself, skipping the application's router and middleware
    # (the trace span wraps it there as the middleware does here); the tenants' x-ratelimit-* headers
    # come from the request's record, not the application
    app[DIRECT_KEY] = _direct_routes(inference, reloader, answer, tracing)
    add_responses(app, s.responses)    # GET/DELETE /v1/responses/{id}, cancel, input_items
    # several workers: each answers its siblings, and /metrics and /status.json show them all
    siblings = _siblings(app, worker, s) if worker is not None else None
    _add_public_routes(app, s, reloader, started_at, siblings)   # /v1/models, /health, /ready, /metrics
    if tenancy is not None:      # x-ratelimit-* on every answer, state lifecycle, /admin API
        audit = AdminAudit(metrics.registry, s.request_log)     # a line and a count per admin call
        add_tenancy(app, tenancy, audit)
        s.admission.user_classes = tenancy.directory.priority_for     # the admin API's records too
        if tenancy.admin_digest is not None:
            reloader.register(app.router, audit)        # POST /admin/reload
    batch = _add_batch(app, config, s, reloader) if config.batch.enabled else None
    if config.status.enabled:    # /status and /status.json; its board watches requests and decisions
        page = _add_status_page(app, config, s, reloader, tenancy, started_at, batch)
        page.siblings, page.worker = siblings, worker
        if siblings is not None:    # a restarted worker's counts since start go on from its predecessor's
            siblings.carry_status, siblings.status_counts = page.board.carry, page.board.counts

    if tracing is not None:     # first in, last out: flushed once everything else stopped
        app.cleanup_ctx.append(_tracing_lifecycle(tracing))
    app.cleanup_ctx.append(_engines(config, s, reloader))
    app.cleanup_ctx.append(_shared_view(s.view))
    if batch is not None:       # started last (the engines' clients are up), stopped first
        tell = s.view.tell_preempt if s.view.bus is not None else None     # --workers N: the runner is one of them
        s.view.on_preempt, s.view.on_batches = batch.sibling_preempt, batch.sibling_changed
        def submit(line):
            return reloader.live.pipeline.handle(line)
        # with tracing, each line is a trace of its own (its legs' engines join it)
        app.cleanup_ctx.append(batch.lifecycle(tracing.lines(submit) if tracing is not None else submit,
                                               s.decision_claims, tell,
                                               s.view.tell_batches if s.view.bus is not None else None))
    return app


def _add_batch(app: web.Application, config: Config, s: Services, reloader: Reloader) -> BatchService:
    """``/v1/files`` and ``/v1/batches`` (gateway/batch): every worker answers them; the worker that
    holds the batch directory's lock runs the lines through the live generation's pipeline."""
    lifecycle, pool, lora = s.lifecycle, s.pool, s.lora

    def targets(name: str) -> tuple[str, ...] | None:
        """The models a batch line naming ``name`` runs on, as the pipeline resolves it: the model,
        an alias's targets, an adapter's base model; None for no such model (a 404 line)."""
        if pool.has_model(name) or reloader.live.config.model(name) is not None:
            return (name,)
        aliased = reloader.live.aliases.targets_of(name)
        if aliased is not None:
            return aliased
        base = lora.base_of(name)
        return (base,) if base is not None else None

    def pairs(model: str) -> bool:
        """Whether ``model`` routes as prefill/decode pairs: its strategy (a batch line names none)
        chooses pairs, as the live routing resolves it."""
        try:
            return reloader.live.routing.strategy(model, None)[1].chooses_pairs
        except GatewayError:
            return False

    admission, view = s.admission, s.view
    waiting = admission.waiting
    if view.bus is not None:
        # --workers N: each worker tells the others the models its admission queue holds requests
        # of, and the runner, in one of them, leaves those engines to them as to its own queue's
        admission.on_queue_change, view.queued_source = view.told_queued, admission.queued

        def waiting(model: str) -> int:
            return admission.waiting(model) or view.sibling_queued(model)

    batch = BatchService(config.batch, s.tenancy, pool, s.metrics.registry,
                         engine_signals=lambda: reloader.live.config.scrape.enabled,
                         metrics_max_age=lambda: reloader.live.config.routing.metrics_max_age_s,
                         admission_waiting=waiting,
                         # from the drain's start (the listener stays open through its delay)
                         draining=lambda: lifecycle.draining or app[NOT_READY_KEY].is_set(),
                         targets=targets, pairs=pairs)
    batch.api.add_routes(app, s.lifecycle.tracked)     # the drain waits for them too
    app[BATCH_KEY] = batch
    return batch


def _siblings(app: web.Application, worker: WorkerInfo, s: Services) -> Siblings:
    """This worker's socket for its siblings (gateway/server/siblings.py): its own exposition, its
    part of the status page when the page is on, and its entries of the Responses memory backend."""
    metrics, responses = s.metrics, s.responses

    siblings: Siblings

    async def answer(kind: str) -> bytes:
        if kind == "metrics":
            return siblings.own(metrics.render())
        if kind == "view":
            return await s.view.snapshot()
        if kind.startswith(("rget ", "rdel ")):
            return await responses.answer_sibling(kind)
        page = app.get(STATUS_PAGE_KEY)
        if page is None:
            return b""
        part = page.board.part(page.sources, worker.index)
        siblings.keep_status(page.board.counts())
        return orjson.dumps(part)

    pool = s.pool

    def endpoints() -> set[tuple[str, str]]:
        return {(ep.model, ep.name) for ep in pool.endpoints()} | {(ep.model, ep.name) for ep, _ in pool.retired}

    # the workers' breakers are one only when they tell each other their ejections (the view's bus)
    siblings = Siblings(worker, answer, endpoints=endpoints, counter_rules=counter_rules(s.view.bus is not None))
    metrics.forget_listeners.append(siblings.forget)
    responses.share_with_siblings(siblings.ask, worker.count)
    if s.view.bus is not None:      # a worker that starts, or missed a sibling's batches, catches up
        s.view.ask_sibling = siblings.ask_worker
    app.cleanup_ctx.append(lifecycle(siblings))
    return siblings


def _shared_view(view: RoutingView):
    async def shared(_app: web.Application) -> AsyncIterator[None]:
        """The routing view's bus and stream (gateway/view): started last, stopped first."""
        await view.start()
        try:
            yield
        finally:
            await view.stop()
    return shared


def _add_public_routes(app: web.Application, s: Services, reloader: Reloader, started_at: int,
                       siblings: Siblings | None) -> None:
    pool, lifecycle, metrics, lora = s.pool, s.lifecycle, s.metrics, s.lora

    def model_entries() -> list[dict]:
        """What ``/v1/models`` lists and ``/v1/models/{id}`` looks up: the models a request may name
        (those the config declares, in its order, with endpoints or not: a request for one that has
        none now is a 503, not a 404; then those only discovered pods serve), then the aliases, then
        the LoRA adapters (by name) whose names no model or alias has (a request naming one of
        those reaches the model or alias, and a name listed twice would send a walk by cursor
        round in a loop). A model keeps its place as its endpoints come and go, so a walk
        through the pages by cursor meets it once. Asked with ``anthropic-version``, the same entries
        in Anthropic's shape (gateway/apis/anthropic_models.py)."""
        config_models = reloader.live.config.models
        named = {m.name for m in config_models}
        data = []
        for m in config_models:
            eps = pool.endpoints(m.name)
            data.append({"id": m.name, "object": "model", "created": started_at, "owned_by": "switchyard",
                         "engine": eps[0].engine if eps else m.engine, "ready_endpoints": len(pool.ready(m.name))})
        data += [{"id": m, "object": "model", "created": started_at, "owned_by": "switchyard",
                  "engine": pool.endpoints(m)[0].engine, "ready_endpoints": len(pool.ready(m))}
                 for m in pool.models() if m not in named]
        for a in reloader.live.aliases.describe():   # an alias lists its targets
            data.append({"id": a["name"], "object": "model", "created": started_at, "owned_by": "switchyard",
                         "targets": a["targets"], "sticky": a["sticky"],
                         "ready_endpoints": sum(len(pool.ready(t["model"])) for t in a["targets"])})
        # LoRA adapters, with their parent (base) model; one an engine serves under a model's or an
        # alias's name is not listed: a request naming it reaches that model or alias
        taken = {e["id"] for e in data}
        for a in lora.describe():
            if a["id"] not in taken:
                data.append({"id": a.pop("id"), "object": "model", "created": started_at, "owned_by": "switchyard", **a})
        return data

    async def allowed_models(request: web.Request) -> tuple[str, ...] | None:
        """The names the caller may ask for (None: every model): with auth on a key is needed to
        list models too (401), and its user's list decides; without, the ``user`` header's."""
        t = await s.tenancy.authenticate(request, None)
        return s.tenancy.models_for(t, claimed_user(request.headers.get("user")))

    def entries_for(allowed: tuple[str, ...] | None) -> list[dict]:
        entries = model_entries()
        return entries if allowed is None else [e for e in entries if e["id"] in allowed]

    async def models(request: web.Request) -> web.Response:
        entries = entries_for(await allowed_models(request))     # only those the user may ask for
        if ANTHROPIC_VERSION in request.headers:      # Anthropic's SDK: a page in its Models API shape
            return _json(200, models_page(entries, request.query), _VARY)
        return _json(200, {"object": "list", "data": entries}, _VARY)

    async def model(request: web.Request) -> web.Response:
        """One entry of the list (OpenAI's retrieve; SGLang serves it too): the id is the rest of
        the path, so a name with slashes (``org/model``, or ``org%2Fmodel``) is one id."""
        allowed = await allowed_models(request)
        name = request.match_info["model_id"]
        if allowed is not None and name not in allowed:     # answered as a name that is no model
            s.tenancy.refused_model()
            raise model_not_found(name, ErrorClass.MODEL_NOT_ALLOWED)
        for entry in model_entries():
            if entry["id"] == name:
                return _json(200, model_info(entry) if ANTHROPIC_VERSION in request.headers else entry, _VARY)
        if not pool.listed or pool.awaited(name):   # it may be one of the pods', as for a request
            raise not_listed_yet(name, pool.listed)
        raise model_not_found(name)

    async def health(_request: web.Request) -> web.Response:
        return _json(200, {"status": "ok"})

    async def ready(_request: web.Request) -> web.Response:
        if lifecycle.draining or app[NOT_READY_KEY].is_set():
            return _json(503, {"status": "draining"})
        ready_models = [m for m in pool.models() if pool.ready(m)]
        if not ready_models:
            return _json(503, {"status": "no ready endpoints"})
        return _json(200, {"status": "ready", "models": ready_models})

    async def metrics_page(request: web.Request) -> web.Response:
        # the format the scrape asks for, chosen and named as prometheus_client's handler does: the
        # text format 0.0.4 unless the Accept header prefers OpenMetrics (Prometheus' does) or the
        # text format 1.0.0 (the same text: every name is a legacy one)
        try:
            encoder, content_type = choose_encoder(request.headers.get(hdrs.ACCEPT, ""))
        except (TypeError, ValueError):     # a version that is no number (``version=abc``): none asked for
            encoder, content_type = generate_latest, CONTENT_TYPE_PLAIN_0_0_4
        if siblings is None and pool.shares_names():
            # one engine in two roles of a model: one endpoint name, two endpoints, whose gauges
            # would be two samples of one series (Prometheus drops one, and OpenMetrics refuses the
            # page); merged as the workers' pages are (in flight summed, readiness the largest, ...)
            families = merge([metrics.render().decode()], counter_rules={})
            body = render(openmetrics(families) if content_type.startswith(OPENMETRICS) else families, encoder)
        elif siblings is None:
            body = metrics.render(encoder)
        else:                           # the whole gateway: every worker's figures (text) merged
            body = await siblings.metrics(metrics.render(), (encoder, content_type))
        return web.Response(body=body, headers={"Content-Type": content_type, "X-Content-Type-Options": "nosniff"})

    app.router.add_get("/v1/models", models)
    app.router.add_get(r"/v1/models/{model_id:[\s\S]+}", model)     # the rest of the path, line breaks included
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics_page)


def _add_status_page(app: web.Application, config: Config, s: Services, reloader: Reloader,
                     tenancy: Tenancy | None, started_at: int, batch: BatchService | None) -> StatusPage:
    pool = s.pool
    board = StatusBoard(config.status, lambda m: pool.has_model(m) or reloader.live.config.model(m) is not None)
    s.observers.append(board.on_request)
    s.decision_observers.append(board.on_decision)
    board.slo = s.admission.slo_counts      # kept and carried with the counts since start
    sources = StatusSources(config, pool, reloader.live.routing, s.lifecycle, s.model_in_flight, tenancy,
                            aliases=lambda: reloader.live.aliases.describe(), started_at=started_at,
                            admission=s.admission.status, batch=batch.status if batch is not None else None,
                            discovery=lambda: disc.status() if (disc := app.get(DISCOVERY_KEY)) is not None else None,
                            config_state=reloader.status)
    reloader.listeners.append(sources.follow)
    page = add_status(app, sources, s.metrics, board)
    app[STATUS_PAGE_KEY] = page
    return page


def _engines(config: Config, s: Services, reloader: Reloader):
    pool, metrics, lifecycle, upstream, lora, kv_events, request_log = (
        s.pool, s.metrics, s.lifecycle, s.upstream, s.lora, s.kv_events, s.request_log)

    async def engines(app: web.Application) -> AsyncIterator[None]:
        """Discovery first (a bad kubeconfig fails start-up before anything else runs, and the worker
        listens once the pods are listed, or 10 s on), then the upstream client, the monitor and the event-loop lag sampler; torn down in reverse,
        background tasks last."""
        disc = None
        if config.kubernetes.enabled:
            disc = KubernetesDiscovery(config.kubernetes, pool, {m.name: m for m in config.models},
                                       registry=metrics.registry)
            await disc.start()
            app[DISCOVERY_KEY] = disc
            reloader.listeners.append(lambda live: disc.reconfigure(live.config.kubernetes, live.config.models))
        try:
            if disc is not None:
                await disc.before_serving()     # the worker listens once it knows the pods
            upstream.start()
            session = make_session(config.upstream)
            mon = Monitor(pool, session, metrics, config.health, config.scrape)
            mon.listeners.append(s.admission.on_endpoint)     # a scrape or health change may free room
            mon.listeners.append(s.breakers.on_health)        # a restarted engine's trials start when it is up
            mon.listeners.append(lora.on_health)              # and the adapters loaded there are loaded again
            mon.listeners.append(s.responses.on_health)       # a dead engine's background responses leave it
            s.view.attach_monitor(mon)                         # one worker probes and scrapes each engine
            mon.restart_listeners.append(s.view.engine_restarted)     # a restarted engine's cache is gone:
            if s.kv_events is not None:                                # what it held is forgotten
                mon.restart_listeners.append(s.kv_events.engine_restarted)
            mon.restart_listeners.append(lora.engine_restarted)   # the adapters loaded there are loaded again
            app[MONITOR_KEY] = mon
            mon.start()
            s.view.attach_lora(lora)                           # and reads its LoRA adapters
            lora.start(session)
            lag = LoopLagMonitor(metrics.loop_lag.observe, config.server.loop_lag_interval_s)
            lag.start()
            reclaimer = MemoryReclaimer(lambda: lifecycle.in_flight, config.server.reclaim_min_drop,
                                        on_reclaim=metrics.memory_reclaims.inc)
            reclaimer.start()
            retired = RetiredSeries(pool, metrics, config.server.removed_endpoint_series_s)
            retired.listeners.append(s.view.endpoint_retired)     # its latency models go with its series
            retired.start()
            if kv_events is not None:
                await kv_events.start()
            try:
                yield
            finally:
                await lag.stop()
                await reclaimer.stop()
                await retired.stop()
                await lora.stop()
                if kv_events is not None:
                    await kv_events.close()
                await mon.stop()
                await lifecycle.close_background()
                await upstream.close()
                await session.close()
                request_log.close()         # every request line written before the process exits
        finally:
            if disc is not None:
                await disc.stop()
    return engines


def _tracing_lifecycle(tracing: Tracing):
    async def traced(_app: web.Application) -> AsyncIterator[None]:
        """Stops after the engines and the background tasks: every span is ended before the flush."""
        log.info("tracing on", **tracing.describe())
        tracing.start()
        yield
        await tracing.close()
    return traced
