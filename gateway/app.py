"""The aiohttp application: routes, error middleware, lifecycle of the upstream client and monitors."""

from __future__ import annotations

import asyncio

import orjson
import structlog
from aiohttp import web

from gateway.admin import add_tenancy
from gateway.config import Config
from gateway.endpoints import Endpoint, EndpointPool
from gateway.errors import GatewayError
from gateway.monitor import Monitor
from gateway.pipeline import Gateway
from gateway.request import CHAT, COMPLETIONS, EMBEDDINGS, request_id_from
from gateway.upstream import make_pool, make_session
from k8s.discovery import KubernetesDiscovery

log = structlog.get_logger("switchyard.app")

GATEWAY_KEY = web.AppKey("gateway", Gateway)
MONITOR_KEY = web.AppKey("monitor", Monitor)
DISCOVERY_KEY = web.AppKey("discovery", KubernetesDiscovery)
# set by the server at SIGTERM: /ready answers 503 while requests are still served (server.py)
NOT_READY_KEY = web.AppKey("not_ready", asyncio.Event)


def pool_from_config(config: Config) -> EndpointPool:
    pool = EndpointPool()

    def add(e, m, role: str, roleset: str | None = None, bootstrap_port: int | None = None) -> None:
        pool.add(Endpoint(url=e.url, model=m.name, engine=e.engine or m.engine, role=role, roleset=roleset,
                          bootstrap_port=e.bootstrap_port or bootstrap_port,
                          min_prompt_tokens=e.min_prompt_tokens, max_prompt_tokens=e.max_prompt_tokens))

    for m in config.models:
        for e in m.endpoints:
            add(e, m, "aggregated")
        for rs in m.rolesets:
            for role, eps in (("prefill", rs.prefill), ("decode", rs.decode), ("combined", rs.combined)):
                for e in eps:
                    add(e, m, role, rs.name, rs.bootstrap_port)
    return pool


def _json(status: int, payload, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), headers=headers, content_type="application/json")


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Every answer is OpenAI-shaped JSON: aiohttp's own 404/405/413 and any bug included."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        rid = request_id_from(request.headers.get("x-request-id"))
        msg = {404: f"unknown path {request.path}", 405: f"method {request.method} not allowed on {request.path}",
               413: "request body too large"}.get(e.status, e.reason)
        err = GatewayError(e.status, msg, error_class="http")
        headers = {"request-id": rid, "x-request-id": rid}
        if e.status == 405 and "Allow" in e.headers:
            headers["Allow"] = e.headers["Allow"]
        return _json(e.status, err.body(), headers)
    except GatewayError as e:
        rid = request_id_from(request.headers.get("x-request-id"))
        return _json(e.status, e.body(), {"request-id": rid, **e.headers})


def build_app(config: Config, pool: EndpointPool | None = None) -> web.Application:
    pool = pool if pool is not None else pool_from_config(config)
    gw = Gateway(config, pool)
    app = web.Application(middlewares=[error_middleware], client_max_size=config.server.max_body_bytes)
    app[GATEWAY_KEY] = gw
    app[NOT_READY_KEY] = asyncio.Event()

    async def models(_request: web.Request) -> web.Response:
        if gw.tenancy is not None:  # tenancy: with auth on, listing models needs a key too
            await gw.tenancy.authenticate(_request, None)
        data = [{"id": m, "object": "model", "created": gw.started_at, "owned_by": "switchyard",
                 "engine": pool.endpoints(m)[0].engine if pool.endpoints(m) else None,
                 "ready_endpoints": len(pool.ready(m))} for m in pool.models()]
        return _json(200, {"object": "list", "data": data})

    async def health(_request: web.Request) -> web.Response:
        return _json(200, {"status": "ok"})

    async def ready(_request: web.Request) -> web.Response:
        if gw.draining or app[NOT_READY_KEY].is_set():
            return _json(503, {"status": "draining"})
        ready_models = [m for m in pool.models() if pool.ready(m)]
        if not ready_models:
            return _json(503, {"status": "no ready endpoints"})
        return _json(200, {"status": "ready", "models": ready_models})

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=gw.metrics.render(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    for path in (CHAT, COMPLETIONS, EMBEDDINGS):
        app.router.add_post(path, gw.handle)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    if gw.tenancy is not None:      # tenancy: x-ratelimit-* on every answer, state lifecycle, /admin API
        add_tenancy(app, gw.tenancy)

    async def on_startup(app: web.Application) -> None:
        # -- kubernetes discovery (k8s/): feeds the same pool as the static config; first, so
        # that a bad kubeconfig fails start-up before anything else is running
        if config.kubernetes.enabled:
            disc = KubernetesDiscovery(config.kubernetes, pool, {m.name: m for m in config.models})
            await disc.start()
            app[DISCOVERY_KEY] = disc
        # --
        gw.upstream = make_pool(config.upstream)
        gw.session = make_session(config.upstream)
        mon = Monitor(pool, gw.session, gw.metrics, config.health, config.scrape)
        app[MONITOR_KEY] = mon
        mon.start()

    async def on_cleanup(app: web.Application) -> None:
        if DISCOVERY_KEY in app:            # kubernetes discovery
            await app[DISCOVERY_KEY].stop()
        await app[MONITOR_KEY].stop()
        await gw.close_background()
        if gw.upstream is not None:
            await gw.upstream.close()
        if gw.session is not None:
            await gw.session.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app
