"""What the pipeline is built from: the services every generation shares, and one generation.

A *generation* is a config and what was built from it for the requests that enter while it is
live: its routing (strategies and, unless the routing settings changed, the state carried over),
its P/D orchestrator, its P/D decider (conditional disaggregation, on that routing's prefix index)
and its aliases. Everything else is a *service*, built once at start-up and shared by every
generation: the pool, the upstream legs, the relay, the breakers, tenancy, tracing, LoRA adapters,
admission, retries, the APIs, the request log.

The pipeline (``gateway.pipeline.pipeline``) receives one ``Generation`` when it is built, and
calls what it holds; a feature that is off is a no-op object with the same interface (``NO_ALIASES``,
``NO_TENANCY``, ``NO_TRACING``), never ``None``, so the request's script has no branches for it.
Start-up and a reload (``gateway.server.reload``) build a generation with the same builder,
``build_generation``; the shared services follow a reload through ``Services.follow``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from gateway.admission.service import Admission
from gateway.aliases import NO_ALIASES, Aliases, AliasMetrics, NoAliases
from gateway.apis.anthropic import AnthropicApi
from gateway.apis.base import ApiShape
from gateway.apis.metrics import PathRequests
from gateway.apis.passthrough import AudioApi, PassthroughApi
from gateway.apis.responses import ResponsesApi
from gateway.apis.responses_request import RESPONSES
from gateway.config.schema import Config
from gateway.endpoints import EndpointPool
from gateway.kv.events import KVEventsManager, build_kv_events
from gateway.lora.adapters import Lora, LoraMetrics
from gateway.observability.logs import LineWriter, RequestLog
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.tracing import NO_TRACING, NoTracing, Tracing
from gateway.pd.decide import PDDecider, PDDecisionMetrics
from gateway.pd.orchestrator import PDOrchestrator
from gateway.pipeline.context import RecordObserver
from gateway.pipeline.relay import Relay
from gateway.pipeline.routing import DecisionObserver, Routing
from gateway.pipeline.slo_learning import SloLearning
from gateway.resilience.breaker import Breakers
from gateway.resilience.retry import Retries
from gateway.server.lifecycle import Lifecycle
from gateway.tenants import build_tenancy
from gateway.tenants.service import NO_TENANCY, NoTenancy, Tenancy
from gateway.upstream.upstream import Upstream
from gateway.view.service import RoutingView, WorkerSlot


@dataclass(frozen=True, slots=True, eq=False)
class Services:
    """What every generation shares: built once, at start-up (``build_services``)."""

    pool: EndpointPool
    metrics: GatewayMetrics
    lifecycle: Lifecycle
    upstream: Upstream
    relay: Relay
    breakers: Breakers
    request_log: RequestLog
    kv_events: KVEventsManager | None          # None unless a model subscribes (routing reads its index)
    tenancy: Tenancy | NoTenancy
    tracing: Tracing | NoTracing
    lora: Lora
    pd_decision_metrics: PDDecisionMetrics
    admission: Admission                        # its queues stay across reloads
    retries: Retries
    responses: ResponsesApi                     # its stores stay across reloads
    apis: Mapping[str, ApiShape]                # path → its API when not chat/completions/embeddings
    alias_metrics: AliasMetrics
    observers: list[RecordObserver]             # told of every finished request (the status board, path counts)
    decision_observers: list[DecisionObserver]  # told of every routing decision (the status board)
    decision_claims: list[DecisionObserver]     # run at each decision, before the leg (the breakers' trial slots)
    model_in_flight: dict[str, int]             # requests in flight per model, for every generation
    view: RoutingView                           # the routing view shared with sibling workers and replicas
    slo: SloLearning                            # feeds the latency models of every generation's routing

    def follow(self, config: Config) -> None:
        """A reload was applied: the shared services take the new config's settings (their state
        stays: queues, stores, loaded adapters, breakers)."""
        self.responses.reconfigure(config)
        self.breakers.reconfigure(config.breaker_for)
        self.retries.reconfigure(config.retry_for, config.routing.metrics_max_age_s)
        self.lora.reconfigure(config)
        self.admission.reconfigure(config)
        if self.kv_events is not None:
            self.kv_events.follow(config)
        self.view.sessions.reconfigure(config.routing.session_ttl_s, config.routing.session_max_entries,
                                       config.routing.session_user_share)


def build_services(config: Config, pool: EndpointPool, slot: WorkerSlot | None = None) -> Services:
    """Every shared service, wired in the order a request meets them. ``slot``: this process is
    one of ``--workers N`` (its view is shared with its siblings)."""
    metrics = GatewayMetrics()
    lifecycle = Lifecycle()
    kv_events = build_kv_events(config, pool, metrics.registry)   # None unless a model subscribes
    # circuit breakers hear every leg's outcome (upstream, relay); open ones are not ready
    breakers = Breakers(pool, config.breaker_for, metrics.registry, passive=config.health.passive)
    metrics.add_per_endpoint((breakers.metrics.transitions, breakers.metrics.outcomes), breakers.children)
    upstream = Upstream(config.upstream, config.health, metrics, breakers)
    upstream.follow(pool)                    # an engine that leaves the pool: its connections go
    tenancy = build_tenancy(config, metrics, pool)   # API keys, users, limits (gateway/tenants); None: off
    # a complete answer is written whole (the tenants' x-ratelimit-* headers are in the request's record)
    # (a leg's outcome goes to the breakers as ``upstream.record`` sends it, without its wrapper's call)
    relay = Relay(config.upstream, metrics, breakers.record, whole=True)
    request_log = RequestLog(config.server.log_format, config.server.log_level,
                             LineWriter(on_drop=metrics.log_lines_dropped.inc))
    tracing = Tracing.from_config(config.tracing, metrics)   # None when off (gateway/observability/tracing.py)
    observers: list[RecordObserver] = []
    responses = ResponsesApi(config, pool, metrics, request_log, tenancy, observers)   # gateway/apis
    apis: dict[str, ApiShape] = {RESPONSES: responses}
    for api in (AnthropicApi(pool), PassthroughApi(pool), AudioApi(pool)):   # Messages, pass-through
        apis.update(dict.fromkeys(api.paths, api))
    observers.append(PathRequests(metrics.registry).on_request)   # switchyard_path_requests_total
    view = RoutingView(config, pool, metrics, slot)   # gateway/view: one routing view for workers and replicas
    view.attach_breakers(breakers)                    # a sibling's ejections are this worker's too
    responses.lineage = view.sessions                 # response id → the endpoint that answered it
    claims = [breakers.on_decision]                   # half-open trial slots, before the leg
    if view.bus_load:
        claims.append(view.on_decision)               # siblings hear of the charge this loop turn
        observers.append(view.on_request)             # and of its release within view.load_interval_s
    slo = SloLearning(metrics)                   # what routed requests saw, for the latency models
    observers.append(slo.on_request)
    admission = Admission(config, pool, metrics)
    responses.admission = admission              # a background response holds its place until it ends
    return Services(
        pool=pool, metrics=metrics, lifecycle=lifecycle, upstream=upstream, relay=relay, breakers=breakers,
        request_log=request_log, kv_events=kv_events,
        tenancy=tenancy if tenancy is not None else NO_TENANCY,
        tracing=tracing if tracing is not None else NO_TRACING,
        lora=Lora(config, pool, upstream, LoraMetrics(metrics.registry)),
        pd_decision_metrics=PDDecisionMetrics(metrics.registry),
        admission=admission,
        retries=Retries(config.retry_for, metrics.registry, config.routing.metrics_max_age_s),
        responses=responses, apis=apis, alias_metrics=AliasMetrics(metrics.registry), observers=observers,
        decision_observers=[], decision_claims=claims, model_in_flight={}, view=view, slo=slo)


@dataclass(frozen=True, slots=True, eq=False)
class Generation:
    """One config and what was built from it; with the shared services, all a pipeline calls."""

    config: Config
    routing: Routing
    pd: PDOrchestrator
    pd_decider: PDDecider                       # conditional disaggregation, on this routing's prefix index
    aliases: Aliases | NoAliases
    services: Services


def routing_state_kept(old: Config, new: Config) -> bool:
    """Whether a reload keeps the routing state (prefix index, positions, pins): the ``routing`` and
    ``pd`` settings are unchanged."""
    own_pd = {m.name: m.pd for m in old.models if m.pd is not None}
    return (old.routing == new.routing and old.pd == new.pd
            and own_pd == {m.name: m.pd for m in new.models if m.pd is not None})


def build_generation(config: Config, services: Services, previous: Generation | None = None) -> Generation:
    """The generation for ``config``: at start-up (``previous`` None) and at a reload, where the
    routing state of ``previous`` carries over when ``routing_state_kept``. Changes nothing of
    ``previous``; raises ``ValueError`` when a strategy the config names does not exist."""
    s = services
    routing = Routing(config, s.pool, s.metrics, s.kv_events, s.view, s.slo)
    if previous is not None and routing_state_kept(previous.config, config):
        routing.keep_state(previous.routing)
    elif previous is not None:      # the engines are the same: what was learnt of their latency stays
        routing.ctx.latency.take_over(previous.routing.ctx.latency)
    s.view.attach(routing.ctx)          # its index's insertions are shared, others' applied to it
    routing.observers, routing.claims = s.decision_observers, s.decision_claims   # shared by every generation
    pd = PDOrchestrator(config, s.upstream, s.relay, s.lifecycle.spawn, s.metrics, routing.ctx.rng, s.pool, s.retries)
    decider = PDDecider(config, routing.ctx.prefix_index, s.pd_decision_metrics, s.kv_events, routing.ctx.rng)
    aliases = Aliases(config.aliases, s.pool, s.alias_metrics) if config.aliases else NO_ALIASES
    return Generation(config, routing, pd, decider, aliases, s)


class Entry(Protocol):
    """A generation's request handler, as the reloader and the app hold it
    (``gateway.pipeline.pipeline.Pipeline``)."""

    gen: Generation

    async def handle(self, request: web.Request) -> web.StreamResponse: ...

