"""The aiohttp application: it wires the collaborators and owns their lifecycle.

Wiring, in the order a request meets them: tracing (a middleware, when on), tenancy, routing, the
ledger of charges (taken by the pipeline), the upstream legs, the relay, P/D orchestration; the
pipeline calls them and none of them calls the pipeline back. Startup and teardown are one
``cleanup_ctx`` generator each, so what starts is stopped in reverse order, also when a later
step fails.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import orjson
import structlog
from aiohttp import web

from gateway.admission.service import Admission
from gateway.aliases import Aliases, AliasMetrics
from gateway.apis.anthropic import AnthropicApi
from gateway.apis.base import ApiShape
from gateway.apis.metrics import PathRequests
from gateway.apis.passthrough import AudioApi, PassthroughApi
from gateway.apis.responses import ResponsesApi, add_responses
from gateway.apis.responses_request import RESPONSES
from gateway.config.schema import Config
from gateway.endpoints import EndpointPool
from gateway.errors import GatewayError, error_response
from gateway.kv.events import build_kv_events
from gateway.lora.adapters import Lora, LoraMetrics
from gateway.observability.logs import LineWriter, RequestLog
from gateway.observability.looplag import LoopLagMonitor
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.status import StatusBoard, StatusSources
from gateway.observability.status_http import add_status
from gateway.observability.tracing import Tracing
from gateway.pd.decide import PDDecider, PDDecisionMetrics
from gateway.pd.orchestrator import PDOrchestrator
from gateway.pipeline.pipeline import Pipeline
from gateway.pipeline.relay import Relay
from gateway.pipeline.routing import Routing
from gateway.request import CHAT, COMPLETIONS, EMBEDDINGS, request_id_from
from gateway.resilience.breaker import Breakers
from gateway.resilience.retry import Retries
from gateway.server.admin import add_tenancy
from gateway.server.lifecycle import Lifecycle
from gateway.server.reclaim import MemoryReclaimer
from gateway.server.reload import Live, Reloader, declared_endpoints
from gateway.tenants import build_tenancy
from gateway.upstream.monitor import Monitor
from gateway.upstream.upstream import Upstream, make_session
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


def pool_from_config(config: Config) -> EndpointPool:
    pool = EndpointPool()
    for ep in declared_endpoints(config):
        pool.add(ep)
    return pool


def _json(status: int, payload, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), headers=headers, content_type="application/json")


def _error_answers(metrics: GatewayMetrics, apis: dict[str, ApiShape]):
    """The answer to an exception a handler let out: every answer is JSON in its path's API shape
    (OpenAI's, Anthropic's on /v1/messages), aiohttp's own 404/405/413 and any bug included.
    Returns None for what must propagate (a redirect, a cancellation)."""
    def shaped(request: web.Request, err: GatewayError) -> bytes:
        api = apis.get(request.path)
        return api.error_body(err) if api is not None else err.body_bytes()

    def answer(request: web.Request, e: Exception) -> web.Response | None:
        rid = request_id_from(request.headers.get("x-request-id"))
        if isinstance(e, web.HTTPException):
            if e.status < 400:
                return None
            msg = {404: f"unknown path {request.path}", 405: f"method {request.method} not allowed on {request.path}",
                   413: "request body too large"}.get(e.status, e.reason)
            err = GatewayError(e.status, msg, error_class="http")
            headers = {"request-id": rid, "x-request-id": rid}
            if e.status == 405 and "Allow" in e.headers:
                headers["Allow"] = e.headers["Allow"]
            return error_response(e.status, shaped(request, err), headers)
        if isinstance(e, GatewayError):
            return error_response(e.status, shaped(request, e), {"request-id": rid, **e.headers})
        # a bug outside the pipeline (which answers its own)
        metrics.internal_errors.inc()
        log.error("internal error", request_id=rid, path=request.path, exc_info=e)
        err = GatewayError(500, "internal gateway error", code="internal_error")
        return error_response(500, shaped(request, err), {"request-id": rid, "x-request-id": rid})
    return answer


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


def _direct_routes(paths, reloader: Reloader, answer) -> dict[str, Callable]:
    """The inference paths' handler as the edge calls it without the application (gateway/server/edge.py
    ``EdgeServer``): the live generation's pipeline, and the error middleware's answer for what
    escapes it."""
    async def direct(request: web.Request) -> web.StreamResponse:
        try:
            return await reloader.live.pipeline.handle(request)
        except Exception as e:
            resp = answer(request, e)
            if resp is None:
                raise
            return resp
    return dict.fromkeys(paths, direct)


def build_app(config: Config, pool: EndpointPool | None = None,
              loader: Callable[[], Config] | None = None) -> web.Application:
    """``loader`` re-reads the config file for a reload (gateway/server/reload.py); None: no reload."""
    pool = pool if pool is not None else pool_from_config(config)
    metrics = GatewayMetrics()
    lifecycle = Lifecycle()
    kv_events = build_kv_events(config, pool, metrics.registry)   # None unless a model subscribes
    routing = Routing(config, pool, metrics, kv_events)
    # circuit breakers hear every leg's outcome (upstream, relay); open ones are not ready
    breakers = Breakers(pool, config.breaker_for, metrics.registry, passive=config.health.passive)
    routing.claims.append(breakers.on_decision)         # half-open trial slots, before the leg
    upstream = Upstream(config.upstream, config.health, metrics, breakers)
    relay = Relay(config.upstream, metrics, upstream.record)
    pd = PDOrchestrator(config, upstream, relay, lifecycle.spawn, metrics, routing.ctx.rng)
    tenancy = build_tenancy(config, metrics, pool)   # API keys, users, limits (gateway/tenants)
    request_log = RequestLog(config.server.log_format, config.server.log_level,
                             LineWriter(on_drop=metrics.log_lines_dropped.inc))
    tracing = Tracing.from_config(config.tracing, metrics)   # None when off (gateway/tracing)
    gw = Pipeline(config, pool, metrics, routing, upstream, relay, pd, tenancy, lifecycle, request_log, tracing)
    gw.retries = Retries(config.retry_for, metrics.registry, config.routing.metrics_max_age_s)
    responses = ResponsesApi(config, pool, metrics, request_log, tenancy, gw.observers)   # gateway/apis
    gw.apis[RESPONSES] = responses
    for api in (AnthropicApi(pool), PassthroughApi(pool), AudioApi(pool)):   # Messages, pass-through
        gw.apis.update(dict.fromkeys(api.paths, api))
    gw.observers.append(PathRequests(metrics.registry).on_request)   # switchyard_path_requests_total
    gw.lora = lora = Lora(config, pool, upstream, LoraMetrics(metrics.registry))   # adapters (gateway/lora/adapters.py)
    gw.pd_decider = pd_decider = PDDecider(config, routing.ctx.prefix_index, PDDecisionMetrics(metrics.registry),
                                             kv_events)
    alias_metrics = AliasMetrics(metrics.registry)
    gw.aliases = Aliases(config.aliases, pool, alias_metrics) if config.aliases else None
    admission = gw.admission = Admission(config, pool, metrics)   # shared by every generation
    # new requests enter the live generation's pipeline; a reload swaps it (gateway/server/reload.py)
    reloader = Reloader(Live(config, gw), pool, metrics, alias_metrics, tenancy, loader)
    reloader.listeners.append(lambda live: responses.reconfigure(live.config))   # its stores stay: shared
    reloader.listeners.append(lambda live: breakers.reconfigure(live.config.breaker_for))
    reloader.listeners.append(lambda live: setattr(gw.retries, "config_for", live.config.retry_for))
    reloader.listeners.append(lambda live: lora.reconfigure(live.config))
    reloader.listeners.append(lambda live: pd_decider.reconfigure(live.config, live.routing.ctx.prefix_index))
    reloader.listeners.append(lambda live: admission.reconfigure(live.config))   # its queues stay
    metrics.attach_live_state(pool.endpoints, gw.model_in_flight,
                              prefix_stats=lambda: reloader.live.routing.ctx.prefix_index.stats(),
                              engine_max_age=config.routing.metrics_max_age_s,
                              fleet_load=lambda ep: fleet_load(ep, time.monotonic(), config.routing.metrics_max_age_s))
    started_at = int(time.time())

    # the trace middleware is outermost, so the request span sees the status the client gets
    answer = _error_answers(metrics, gw.apis)
    middlewares = ([tracing.middleware] if tracing is not None else []) + [_error_middleware(answer)]
    app = web.Application(middlewares=middlewares, client_max_size=config.server.max_body_bytes)
    app[GATEWAY_KEY] = gw
    app[RELOAD_KEY] = reloader
    app[LIFECYCLE_KEY] = lifecycle
    app[NOT_READY_KEY] = asyncio.Event()

    async def models(request: web.Request) -> web.Response:
        if tenancy is not None:  # with auth on, listing models needs a key too
            await tenancy.authenticate(request, None)
        data = [{"id": m, "object": "model", "created": started_at, "owned_by": "switchyard",
                 "engine": pool.endpoints(m)[0].engine if pool.endpoints(m) else None,
                 "ready_endpoints": len(pool.ready(m))} for m in pool.models()]
        aliases = reloader.live.aliases
        for a in aliases.describe() if aliases is not None else ():   # an alias lists its targets
            data.append({"id": a["name"], "object": "model", "created": started_at, "owned_by": "switchyard",
                         "targets": a["targets"], "sticky": a["sticky"],
                         "ready_endpoints": sum(len(pool.ready(t["model"])) for t in a["targets"])})
        for a in lora.describe():       # LoRA adapters, with their parent (base) model
            data.append({"id": a.pop("id"), "object": "model", "created": started_at, "owned_by": "switchyard", **a})
        return _json(200, {"object": "list", "data": data})

    async def health(_request: web.Request) -> web.Response:
        return _json(200, {"status": "ok"})

    async def ready(_request: web.Request) -> web.Response:
        if lifecycle.draining or app[NOT_READY_KEY].is_set():
            return _json(503, {"status": "draining"})
        ready_models = [m for m in pool.models() if pool.ready(m)]
        if not ready_models:
            return _json(503, {"status": "no ready endpoints"})
        return _json(200, {"status": "ready", "models": ready_models})

    async def metrics_page(_request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    inference = (CHAT, COMPLETIONS, EMBEDDINGS, *gw.apis)     # gw.apis: Responses, Messages, pass-through
    for path in inference:
        app.router.add_post(path, reloader.live_handle)
    # the edge calls these paths' handler itself, skipping the application's router and middleware,
    # unless something must wrap every answer: the trace span (a middleware) or the tenants'
    # x-ratelimit-* headers (a response-prepare signal, which needs the application's match info)
    app[DIRECT_KEY] = _direct_routes(inference, reloader, answer) if tracing is None and tenancy is None else {}
    add_responses(app, responses)    # GET/DELETE /v1/responses/{id}, cancel, input_items
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics_page)
    if tenancy is not None:      # x-ratelimit-* on every answer, state lifecycle, /admin API
        add_tenancy(app, tenancy)
        if tenancy.admin_digest is not None:
            reloader.register(app.router)        # POST /admin/reload
    if config.status.enabled:    # /status and /status.json; its board watches requests and decisions
        board = StatusBoard(config.status, lambda m: pool.has_model(m) or reloader.live.config.model(m) is not None)
        gw.observers.append(board.on_request)
        routing.observers.append(board.on_decision)
        sources = StatusSources(config, pool, routing, lifecycle, gw.model_in_flight, tenancy,
                                aliases=lambda: a.describe() if (a := reloader.live.aliases) is not None else [],
                                started_at=started_at)
        reloader.listeners.append(sources.follow)
        add_status(app, sources, metrics, board)

    async def engines(app: web.Application) -> AsyncIterator[None]:
        """Discovery first (a bad kubeconfig fails start-up before anything else runs), then the
        upstream client, the monitor and the event-loop lag sampler; torn down in reverse,
        background tasks last."""
        disc = None
        if config.kubernetes.enabled:
            disc = KubernetesDiscovery(config.kubernetes, pool, {m.name: m for m in config.models})
            await disc.start()
            app[DISCOVERY_KEY] = disc
            reloader.listeners.append(lambda live: disc.reconfigure(live.config.kubernetes, live.config.models))
        try:
            upstream.start()
            session = make_session(config.upstream)
            mon = Monitor(pool, session, metrics, config.health, config.scrape)
            mon.listeners.append(admission.on_endpoint)     # a scrape or health change may free room
            app[MONITOR_KEY] = mon
            mon.start()
            lora.start(session)
            lag = LoopLagMonitor(metrics.loop_lag.observe, config.server.loop_lag_interval_s)
            lag.start()
            reclaimer = MemoryReclaimer(lambda: lifecycle.in_flight, config.server.reclaim_min_drop,
                                        on_reclaim=metrics.memory_reclaims.inc)
            reclaimer.start()
            if kv_events is not None:
                await kv_events.start()
            try:
                yield
            finally:
                await lag.stop()
                await reclaimer.stop()
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

    if tracing is not None:     # first in, last out: flushed once everything else stopped
        app.cleanup_ctx.append(_tracing_lifecycle(tracing))
    app.cleanup_ctx.append(engines)
    return app


def _tracing_lifecycle(tracing: Tracing):
    async def traced(_app: web.Application) -> AsyncIterator[None]:
        """Stops after the engines and the background tasks: every span is ended before the flush."""
        log.info("tracing on", **tracing.describe())
        yield
        await tracing.close()
    return traced
