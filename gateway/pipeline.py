"""The request pipeline: parse → admit → strategy → route+charge → forward → relay → finish.

One ``Gateway`` per app holds the config, the endpoint pool, the router registry, the metrics and
the upstream client. ``handle`` is the aiohttp handler for the inference paths; every path out
of it (answer, error, client disconnect) releases the leases and writes one log line.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import structlog
from aiohttp import web

from gateway import relay
from gateway.config import Config
from gateway.endpoints import Endpoint, EndpointPool
from gateway.errors import GatewayError, normalize_upstream_error
from gateway.leases import Lease
from gateway.metrics import GatewayMetrics
from gateway.pd import PDCharges, forward_pd
from gateway.request import InferenceRequest, parse, request_id_from, usage_stream_options
from gateway.sse import usage_tokens
from gateway.tenants import build_tenancy
from gateway.trackers import PDTrackers
from gateway.upstream import UpstreamFailure, UpstreamPool, UpstreamResponse, open_leg
from handlers import sglang as sglang_handler
from routers.base import Decision, NoRouteError, Router, RouterContext
from routers.registry import RouterRegistry, StrategyError, default_registry

log = structlog.get_logger("switchyard.request")

WHOLE_REQUEST_ROLES = ("aggregated", "combined")

# client headers that are not forwarded to engines: hop-by-hop headers, the ones the gateway sets
# itself, and the gateway's own routing controls. Everything else passes through, as through a proxy.
_DROP_HEADERS = frozenset({
    "host", "content-length", "content-type", "connection", "keep-alive", "proxy-connection",
    "transfer-encoding", "te", "trailer", "upgrade", "expect", "accept-encoding", "x-request-id",
    "routing-strategy", "proxy-authorization",
})


@dataclass
class RequestRecord:
    """What the per-request log line and the metrics say about one request."""

    request_id: str
    path: str
    started: float
    model: str = "-"
    strategy: str = ""
    user: str | None = None
    endpoint: str = ""
    status: int = 0
    stream: bool = False
    error_class: str | None = None
    error: str | None = None
    retries: int = 0
    ttft: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Gateway:
    def __init__(self, config: Config, pool: EndpointPool, metrics: GatewayMetrics | None = None) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics or GatewayMetrics()
        self.router_ctx = RouterContext(settings=config.routing, pd_settings=config.pd_for,
                                        on_fallback=self._on_fallback)
        self.trackers = PDTrackers()
        self.model_in_flight: dict[str, int] = {}
        self.metrics.attach_live_state(pool.endpoints, self.model_in_flight,
                                       prefix_stats=self.router_ctx.prefix_index.stats)
        self._background: set[asyncio.Task] = set()
        self.registry: RouterRegistry = default_registry(self.router_ctx)
        self.upstream: UpstreamPool | None = None          # data-plane legs (gateway/h1client.py)
        self.session: aiohttp.ClientSession | None = None  # the monitor's probes and scrapes
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.started_at = int(time.time())
        self.tenancy = build_tenancy(config, self.metrics, pool)   # API keys, users, limits (gateway/tenants)
        # validate strategies named in config now, so a typo fails at startup, not per request
        for spec in [config.routing.strategy] + [s for m in config.models for s in (m.strategy, m.lock_strategy) if s]:
            try:
                self.registry.get(spec)
            except StrategyError as e:
                raise ValueError(f"config: {e}") from None

    # -- bookkeeping -------------------------------------------------------------------------

    def _on_fallback(self, strategy: str, reason: str) -> None:
        self.metrics.child(self.metrics.routing_fallbacks, strategy, reason).inc()

    def charge(self, ep: Endpoint) -> Lease:
        return Lease(ep)

    def mark_connect_failure(self, ep: Endpoint) -> None:
        """Passive health: a refused connection takes the endpoint out until a probe succeeds."""
        ep.consecutive_successes = 0
        ep.consecutive_failures += 1
        if self.config.health.passive and self.config.health.enabled:
            ep.healthy = False

    def begin_drain(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout: float) -> bool:
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    # -- strategy ----------------------------------------------------------------------------

    def strategy_for(self, model: str, header: str | None) -> str:
        """Model lock > routing-strategy header > model default (config, else the pods' config
        annotation) > global default; a model with rolesets defaults to ``pd`` (its prefill/decode
        endpoints serve nothing else)."""
        m = self.config.model(model)
        if m is not None and m.lock_strategy:
            return m.lock_strategy
        if header is not None and header.strip():
            return header.strip()
        if m is not None and m.strategy:
            return m.strategy
        hint = self.pool.strategy_hint(model)
        if hint:
            return hint
        if (m is not None and m.rolesets) or self.pool.has_pd(model):
            return "pd"
        return self.config.routing.strategy

    def router_for(self, spec: str) -> Router:
        try:
            return self.registry.get(spec)
        except StrategyError:
            raise GatewayError(400, f"incorrect routing strategy {spec}", param="routing-strategy",
                               header=("x-error-routing", "true"), error_class="routing") from None

    def route(self, ireq: InferenceRequest, spec: str, candidates: list[Endpoint],
              router: Router | None = None) -> Decision:
        router = router or self.router_for(spec)
        if len(candidates) == 1 and not router.chooses_pairs:
            return Decision(candidates[0], spec)
        t = time.perf_counter()
        try:
            decision = router.route(ireq, candidates)
        except NoRouteError as e:
            raise GatewayError(503, str(e), code="service_unavailable", headers={"Retry-After": "5"},
                               header=("x-error-routing", "true"), error_class="no_route") from None
        self.metrics.child(self.metrics.routing, spec).observe(time.perf_counter() - t)
        decision.strategy = spec
        return decision

    def charge_pd(self, decision: Decision, ireq: InferenceRequest) -> PDCharges:
        prefill = decision.prefill
        cfg = self.config.pd_for(ireq.model)
        tokens = cfg.token_request_cost + (decision.uncached_tokens or ireq.prompt_tokens_est)
        active, kv = self.trackers.token_load(prefill, tokens)
        return PDCharges(prefill=self.trackers.prefill(prefill),
                         pending_decode=self.trackers.pending_decode(decision.endpoint),
                         token_active=active, token_kv=kv)

    def spawn(self, coro) -> asyncio.Task:
        """Run a fire-and-forget task (aborts, late prefill results) that outlives the request;
        kept referenced until done, awaited at shutdown."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def close_background(self, timeout: float = 5.0) -> None:
        if self._background:
            _, pending = await asyncio.wait(set(self._background), timeout=timeout)
            for t in pending:
                t.cancel()

    # -- the handler -------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        hdrs = request.headers
        rec = RequestRecord(request_id=request_id_from(hdrs.get("x-request-id")), path=request.path,
                            started=time.perf_counter())
        self.in_flight += 1
        self._idle.clear()
        leases: list[Lease] = []
        model_gauge = None
        ticket = None
        try:
            if self.draining:
                raise GatewayError(503, "the gateway is shutting down", code="service_unavailable",
                                   headers={"Retry-After": "1", "Connection": "close"}, error_class="draining")
            if self.tenancy is not None:    # tenancy hook: API key → user (401), before the body is read
                ticket = await self.tenancy.authenticate(request, rec)
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise GatewayError(413, f"request body exceeds {self.config.server.max_body_bytes} bytes",
                                   error_class="validation") from None
            ireq = parse(request.path, body, hdrs, rec.request_id)
            rec.model, rec.stream = ireq.model, ireq.stream
            if not self.pool.has_model(ireq.model) and self.config.model(ireq.model) is None:
                raise GatewayError(404, f"The model `{ireq.model}` does not exist.", param="model",
                                   code="model_not_found", header=("x-error-no-model-backends", ireq.model),
                                   error_class="model_not_found")
            model_gauge = ireq.model
            self.model_in_flight[model_gauge] = self.model_in_flight.get(model_gauge, 0) + 1
            spec = self.strategy_for(ireq.model, hdrs.get("routing-strategy"))
            rec.strategy = spec
            router = self.router_for(spec)
            pd_mode = router.chooses_pairs
            ready = self.pool.ready(ireq.model)
            # only the pd strategy may use prefill/decode endpoints; the others need whole-request ones
            candidates = ready if pd_mode else [ep for ep in ready if ep.role in WHOLE_REQUEST_ROLES]
            if not candidates:
                raise GatewayError(503, f"no ready endpoint for model {ireq.model}"
                                        + (" (prefill/decode endpoints need the pd strategy)" if ready else ""),
                                   code="service_unavailable", headers={"Retry-After": "5"},
                                   header=("x-error-no-model-backends", "true"), error_class="no_endpoint")
            if ticket is not None:          # tenancy hook: model RPS, user RPM/TPM/concurrency (429), before routing
                await self.tenancy.admit(ticket, ireq, rec)
            members = None
            if pd_mode and candidates[0].engine == "sglang":
                try:   # refused before any endpoint is chosen
                    members = sglang_handler.split_members(ireq.body)
                    sglang_handler.check_members(members)
                except sglang_handler.BodyError as e:
                    raise GatewayError(400, str(e), header=("x-error-routing", "true"),
                                       error_class="validation") from None
            rec.user = ireq.user
            decision = self.route(ireq, spec, candidates, router)
            # charged in the same synchronous step as the decision
            leases.append(self.charge(decision.endpoint))
            if decision.prefill is not None:
                charges = self.charge_pd(decision, ireq)
                leases.extend((charges.prefill, charges.pending_decode, charges.token_active, charges.token_kv))
                return await forward_pd(self, request, ireq, decision, charges, rec, members)
            return await self.forward(request, ireq, decision, leases, candidates, rec)
        except GatewayError as e:
            rec.status = e.status
            rec.error_class = rec.error_class or e.error_class
            rec.error = e.message
            return self.error_response(e, rec)
        except asyncio.CancelledError:
            rec.status = 499
            rec.error_class = rec.error_class or "client_cancel"
            self.metrics.child(self.metrics.client_cancels, rec.model,
                               "streaming" if rec.extra.get("headers_sent") else "before_headers").inc()
            raise
        finally:
            for lease in leases:
                lease.release()
            if model_gauge is not None:
                self.model_in_flight[model_gauge] -= 1
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()
            if ticket is not None:          # tenancy hook: charge usage tokens, release the concurrency slot
                self.tenancy.settle(ticket, rec)
            self.finish(rec, time.perf_counter())

    # -- responses ---------------------------------------------------------------------------

    def base_headers(self, rec: RequestRecord) -> dict[str, str]:
        h = {"request-id": rec.request_id, "x-request-id": rec.request_id}
        if rec.endpoint:
            h["target-pod"] = rec.endpoint
        if rec.strategy:
            h["routing-strategy"] = rec.strategy
        prefill = rec.extra.get("prefill_endpoint")
        if prefill:
            h["prefill-target-pod"] = prefill
        return h

    def error_response(self, e: GatewayError, rec: RequestRecord) -> web.Response:
        headers = self.base_headers(rec)
        headers.update(e.headers)
        return web.Response(status=e.status, body=e.body_bytes(), headers=headers, content_type="application/json")

    # -- forwarding --------------------------------------------------------------------------

    def upstream_headers(self, ireq: InferenceRequest) -> dict[str, str]:
        h = {"Content-Type": "application/json", "X-Request-Id": ireq.request_id}
        for name, v in ireq.headers.items():
            if name.lower() not in _DROP_HEADERS:
                h[name] = v
        return h

    @staticmethod
    def upstream_body(ireq: InferenceRequest) -> tuple[bytes, bool]:
        """The body to send, and whether the gateway injected ``include_usage`` (to strip later).
        The original bytes go out unchanged unless usage must be asked for."""
        extra = usage_stream_options(ireq)
        if extra is not None:
            return orjson.dumps({**ireq.data, **extra}), True
        return ireq.body, False

    async def forward(self, request: web.Request, ireq: InferenceRequest, decision: Decision,
                      leases: list[Lease], candidates: list[Endpoint], rec: RequestRecord) -> web.StreamResponse:
        """Open the upstream leg (retrying once elsewhere if no byte came back) and answer.

        ``leases`` is the handler's list: a retry releases the failed endpoint's lease and appends
        the new one, and the handler releases whatever is left on every path.
        """
        cfg = self.config
        body, strip_usage = self.upstream_body(ireq)
        headers = self.upstream_headers(ireq)
        wd = cfg.watchdog_for(ireq.model) if cfg.watchdog.aggregated or self._model_watchdog(ireq.model) else None
        header_timeout = cfg.upstream.first_byte_timeout_s or None
        if wd is not None and ireq.stream and wd.first_chunk_timeout_s:
            header_timeout = min(header_timeout or wd.first_chunk_timeout_s, wd.first_chunk_timeout_s)
        ep = decision.endpoint
        tried = [ep]
        while True:
            rec.endpoint = ep.name
            try:
                resp = await open_leg(self.upstream, ep.url + ireq.path, body, headers, header_timeout)
                break
            except UpstreamFailure as f:
                self.metrics.child(self.metrics.upstream_errors, ireq.model, ep.name, f.kind).inc()
                if f.kind in ("connect", "reset"):
                    self.mark_connect_failure(ep)
                others = [c for c in candidates if c not in tried and c.ready]
                if f.retryable and cfg.upstream.retry_on_connect_error and others and rec.retries == 0:
                    rec.retries += 1
                    self.metrics.child(self.metrics.retries, ireq.model).inc()
                    leases[-1].release()
                    decision = self.route(ireq, rec.strategy, others)
                    ep = decision.endpoint
                    tried.append(ep)
                    leases.append(self.charge(ep))
                    continue
                rec.error_class = f"upstream_{f.kind}"
                if f.kind == "timeout":
                    raise GatewayError(504, f"upstream timeout: {f.message}", code="upstream_timeout",
                                       header=("x-error-upstream", "timeout"), error_class=rec.error_class) from None
                raise GatewayError(502, f"upstream unavailable: {f.message}", code="upstream_unavailable",
                                   header=("x-error-upstream", f.kind), error_class=rec.error_class) from None
        return await self.relay_answer(request, ireq, resp, decision, rec, strip_usage, wd)

    async def relay_answer(self, request: web.Request, ireq: InferenceRequest, resp: UpstreamResponse,
                           decision: Decision, rec: RequestRecord, strip_usage: bool, wd) -> web.StreamResponse:
        try:
            return await self.answer(request, ireq, resp, decision, rec, strip_usage, wd)
        finally:
            # a fully read response returns its connection to the pool; anything else (client gone,
            # watchdog, upstream error) closes it, which is how an engine learns to stop
            if resp.at_eof():
                resp.release()
            else:
                resp.close()

    def _model_watchdog(self, model: str) -> bool:
        m = self.config.model(model)
        return m is not None and m.watchdog is not None and m.watchdog.aggregated

    async def answer(self, request: web.Request, ireq: InferenceRequest, resp: UpstreamResponse,
                     decision: Decision, rec: RequestRecord, strip_usage: bool, wd) -> web.StreamResponse:
        headers = self.base_headers(rec)
        headers.update(decision.headers)
        if resp.status != 200:
            raw = await resp.read_limited(self.config.upstream.max_error_body_bytes)
            status, err = normalize_upstream_error(resp.status, raw)
            rec.status = status
            rec.error_class = "upstream_status"
            rec.error = str(err["error"].get("message"))[:200]
            self.metrics.child(self.metrics.upstream_errors, ireq.model, decision.endpoint.name,
                               f"status_{status}").inc()
            for name in ("Retry-After",):
                if name in resp.headers:
                    headers[name] = resp.headers[name]
            return web.Response(status=status, body=orjson.dumps(err), headers=headers,
                                content_type="application/json")
        ctype = resp.headers.get("Content-Type", "application/json")
        if ctype.startswith("text/event-stream"):
            return await relay.relay_stream(self, request, resp, rec, headers, strip_usage, wd)
        return await relay.relay_body(self, request, resp, rec, headers, ctype, wd)

    # -- finish ------------------------------------------------------------------------------

    def account_usage(self, rec: RequestRecord, usage: dict | None) -> None:
        if not usage:
            return
        p, c, cached = usage_tokens(usage)
        rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens = p, c, cached
        m = self.metrics
        if p:
            m.child(m.prompt_tokens, rec.model).inc(p)
        if c:
            m.child(m.completion_tokens, rec.model).inc(c)
        if cached:
            m.child(m.cached_tokens, rec.model).inc(cached)

    def finish(self, rec: RequestRecord, now: float) -> None:
        m = self.metrics
        duration = now - rec.started
        m.child(m.requests, rec.model, str(rec.status), rec.strategy).inc()
        if rec.model != "-" and rec.status < 400 and rec.status:
            m.child(m.e2e, rec.model).observe(duration)
        log.info("request", request_id=rec.request_id, path=rec.path, model=rec.model, user=rec.user,
                 strategy=rec.strategy,
                 endpoint=rec.endpoint, status=rec.status, stream=rec.stream,
                 ttft_ms=round(rec.ttft * 1000, 3) if rec.ttft is not None else None,
                 prompt_tokens=rec.prompt_tokens, completion_tokens=rec.completion_tokens,
                 cached_tokens=rec.cached_tokens, finish_reason=rec.finish_reason, retries=rec.retries,
                 duration_ms=round(duration * 1000, 3), error_class=rec.error_class, error=rec.error,
                 **{k: v for k, v in rec.extra.items() if k != "headers_sent"})
