"""Routing: which strategy a request uses, its candidates, and the timed decision.

The strategy is the model's lock, else the ``routing-strategy`` header, else the model's default
(config, else the pods' annotation), else ``pd`` for a model with prefill/decode endpoints, else
the global default. Routers are pure and synchronous (``routers/``); every request goes through
its router, even with one candidate, so strategies that learn from decisions (the prefix index,
session ids, vtc's token counts) see every request.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import structlog

from gateway.config.schema import Config, check_strategies, strategy_suggestion
from gateway.endpoints import Endpoint, EndpointPool
from gateway.errors import ErrorClass, GatewayError
from gateway.observability.metrics import GatewayMetrics
from gateway.pipeline.context import safe_header_value
from gateway.pipeline.slo_learning import NO_SLO_LEARNING, NoSloLearning, SloLearning
from gateway.request import InferenceRequest
from gateway.view.service import RoutingView
from routers.base import Decision, NoRouteError, PreciseIndex, Router, RouterContext
from routers.registry import RouterRegistry, StrategyError, default_registry, strategy_label

log = structlog.get_logger("switchyard.routing")

WHOLE_REQUEST_ROLES = ("aggregated", "combined")

# told of every decision: (request, decision, the (strategy, reason) fallbacks the router reported
# while deciding, seconds the decision took); the status page keeps the last few (gateway/observability/status.py)
DecisionObserver = Callable[[InferenceRequest, Decision, tuple[tuple[str, str], ...], float], None]


def _no_session(model: str, outcome: str) -> None:
    return None



_ECHO_SPEC = 80         # characters of a refused routing-strategy header its 400 quotes
_ECHO_REASON = 120
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")


def echo(text: str, limit: int, *, told: bool = True) -> str:
    """A client's ``text`` quoted in an error message: at most ``limit`` characters of it, each
    outside printable ASCII as a ``\\xNN``/``\\uNNNN`` escape; when cut, ``...`` and (``told``)
    how long it was."""
    quoted = _UNPRINTABLE.sub(_escaped, text[:limit])
    if len(text) <= limit:
        return quoted
    return f"{quoted}... ({len(text)} characters)" if told else f"{quoted}..."


def _escaped(m: re.Match[str]) -> str:
    c = ord(m.group())
    if 0xDC80 <= c <= 0xDCFF:       # a byte that was not UTF-8 (aiohttp's surrogateescape): the byte
        c -= 0xDC00
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}" if c < 0x10000 else f"\\U{c:08x}"


class Routing:
    def __init__(self, config: Config, pool: EndpointPool, metrics: GatewayMetrics,
                 precise_index: PreciseIndex | None = None, view: RoutingView | None = None,
                 slo: SloLearning | NoSloLearning = NO_SLO_LEARNING) -> None:
        """``view``: the shared routing view (gateway/view), whose session map the strategies use
        and which counts their session outcomes; None: a session map of this routing's own.
        ``slo``: the latency models' learning (gateway/pipeline/slo_learning.py)."""
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.ctx = RouterContext(settings=config.routing, pd_settings=config.pd_for,
                                 on_fallback=self._on_fallback, precise_index=precise_index,
                                 sessions=view.sessions if view is not None else None,
                                 on_session=view.on_session if view is not None else _no_session)
        self.observers: list[DecisionObserver] = []
        # told of a decision in its own synchronous step, before the leg (a half-open breaker's
        # trial slot must be taken before a concurrent request routes)
        self.claims: list[DecisionObserver] = []
        self._fallbacks: list[tuple[str, str]] = []     # reported during the decision being made
        self._hints: dict[str, bool] = {}               # discovered strategy hints: usable or not
        # per model, the strategy and router of a request that names none (``strategy``), with the
        # pool's version they were worked out at
        self._defaults: dict[str, tuple[int, tuple[str, Router]]] = {}
        # per strategy spelling, the child of the decision-latency histogram it counts into (``_report``)
        self._latency: dict[str, Any] = {}
        # feeds the endpoints' latency models (``ctx.latency``) with every decision, before its charge
        self.slo = slo
        self.registry: RouterRegistry = default_registry(self.ctx)
        # strategies named in config are validated now, so a typo fails at startup, not per request
        check_strategies(config, self.registry)

    def keep_state(self, previous: Routing) -> None:
        """Take over ``previous``'s routing state at a reload that keeps it: its context (prefix
        index, positions, pins) and routers, and the list its context's ``on_fallback`` reports
        into, so fallbacks reported while this routing decides still reach its decisions."""
        self.ctx, self.registry = previous.ctx, previous.registry
        self._fallbacks = previous._fallbacks
        self._defaults.clear()      # of the registry it had

    def _on_fallback(self, strategy: str, reason: str) -> None:
        self.metrics.child(self.metrics.routing_fallbacks, strategy, reason).inc()
        self._fallbacks.append((strategy, reason))

    def strategy(self, model: str, header: str | None, lora: bool = False) -> tuple[str, Router]:
        """``strategy_for`` and ``resolve`` in one: the request's strategy, canonically spelt, and
        its router. A request that names no strategy and no adapter takes its model's, worked out
        once per model and kept while the pool's endpoints stay as they were (``EndpointPool.version``:
        their P/D roles and strategy hints decide it too) and this routing's config lasts."""
        if header is None and not lora:
            version = self.pool.version
            kept = self._defaults.get(model)
            if kept is not None and kept[0] == version:
                return kept[1]
            found = self.resolve(self.strategy_for(model, None))
            if len(self._defaults) >= 4096:     # models come and go (Kubernetes): keep it bounded
                self._defaults.clear()
            self._defaults[model] = (version, found)
            return found
        found = self.resolve(self.strategy_for(model, header, lora))
        if header is not None and not found[1].chooses_pairs and self.pool.has_pd(model):
            self._fits(model, header, found[0])
        return found

    def header(self, headers: Any, model: str) -> str | None:
        """The request's ``routing-strategy`` header. Sent on several lines (a client's own and one
        a proxy added, say), they must name one strategy, however spelt (a weighted list's items in
        any order); empty lines name none. Lines naming two are a 400: which one routes is not left
        to whichever line a reader takes first. A model whose strategy is locked reads none."""
        value = headers.get("routing-strategy")
        if value is None:
            return None
        getall = getattr(headers, "getall", None)       # None for a plain mapping (a batch line's)
        lines = getall("routing-strategy") if getall is not None else (value,)
        if len(lines) == 1:
            return value
        m = self.config.model(model)
        if m is not None and m.lock_strategy:
            return value
        named = [line for line in lines if line.strip()]
        if len(named) < 2:
            return named[0] if named else value
        first = self.resolve(named[0].strip())[0]
        for line in named[1:]:
            if sorted(self.resolve(line.strip())[0].split(",")) != sorted(first.split(",")):
                raise GatewayError(400, "the routing-strategy header is given more than once and its lines name "
                                        f"different strategies ({echo(named[0].strip(), _ECHO_SPEC)} and "
                                        f"{echo(line.strip(), _ECHO_SPEC)}); give it once",
                                   param="routing-strategy", code="invalid_routing_strategy",
                                   headers={"routing-strategy": first},    # the first line's, as the other 400s
                                   header=("x-error-routing", "true"), error_class=ErrorClass.ROUTING)
        return named[0]

    def _fits(self, model: str, header: str, spelling: str) -> None:
        """A 400 when the header chose a whole-request strategy for a model all of whose endpoints
        are prefill and decode ones: only ``pd`` routes it, and no retry gets past that (a 503 with
        Retry-After, which SDKs retry, said otherwise). A lock, or a model with whole-request
        endpoints that are not ready now, answers as before (the 503 of ``candidates``)."""
        m = self.config.model(model)
        if (m is not None and m.lock_strategy) or not header.strip():
            return
        if any(ep.role in WHOLE_REQUEST_ROLES for ep in self.pool.endpoints(model)):
            return
        raise GatewayError(400, f"routing strategy {spelling} cannot route model {model}: its endpoints are "
                                "prefill and decode endpoints, which only the pd strategy routes",
                           param="routing-strategy", code="invalid_routing_strategy",
                           headers={"routing-strategy": spelling},
                           header=("x-error-routing", "true"), error_class=ErrorClass.ROUTING)

    def strategy_for(self, model: str, header: str | None, lora: bool = False) -> str:
        """``lora``: the request names an adapter of ``model``; unless the model is P/D, its
        strategy is ``lora.strategy`` after the lock and the header."""
        m = self.config.model(model)
        if m is not None and m.lock_strategy:
            return m.lock_strategy
        if header is not None and header.strip():
            return header.strip()
        if lora and not ((m is not None and m.rolesets) or self.pool.has_pd(model)):
            return self.config.lora.strategy
        if m is not None and m.strategy:
            return m.strategy
        hint = self.pool.strategy_hint(model)
        if hint and self._usable_hint(hint):
            return hint
        if (m is not None and m.rolesets) or self.pool.has_pd(model):
            return "pd"
        return self.config.routing.strategy

    def _usable_hint(self, hint: str) -> bool:
        """Whether a discovered pod's ``routingStrategy`` names strategies of this gateway (an
        operator's annotation, not the client's choice: an unknown one is logged once and the
        default routes, rather than every request being refused)."""
        ok = self._hints.get(hint)
        if ok is None:
            try:
                self.registry.get(hint)
                ok = True
            except StrategyError as e:
                ok = False
                log.warning("a discovered pod's routingStrategy is not a strategy of this gateway; "
                            "the model's default routes", strategy=safe_header_value(hint), error=str(e))
            if len(self._hints) < 256:
                self._hints[hint] = ok
        return ok

    def router_for(self, spec: str) -> Router:
        return self.resolve(spec)[1]

    def resolve(self, spec: str) -> tuple[str, Router]:
        """``spec``'s canonical spelling (what metric labels, the log line and the answer's
        ``routing-strategy`` carry) and its router; a 400 for an invalid one."""
        try:
            return self.registry.resolve(spec)
        except StrategyError as e:
            # the answer echoes the refused name (escaped); the request's record keeps no strategy,
            # so a client's arbitrary names never become metric labels
            raise GatewayError(400, self._refusal(spec, e), param="routing-strategy", code="invalid_routing_strategy",
                               headers={"routing-strategy": safe_header_value(spec)},
                               header=("x-error-routing", "true"), error_class=ErrorClass.ROUTING) from None

    def _refusal(self, spec: str, e: StrategyError) -> str:
        """The 400's message: the header and what is wrong with it, each cut short and in printable
        ASCII, a near name as ``--check-config`` suggests it, and the strategies there are."""
        return (f"incorrect routing strategy {echo(spec, _ECHO_SPEC)}: {echo(e.reason, _ECHO_REASON, told=False)}"
                f"{strategy_suggestion(spec[:_ECHO_SPEC * 4], self.registry)}; "
                f"valid strategies: {', '.join(self.registry.names())}")

    def candidates(self, model: str, router: Router) -> list[Endpoint]:
        """The ready endpoints ``router`` may choose from: only a router that chooses P/D pairs
        may use prefill and decode endpoints; the others need whole-request ones."""
        candidates = self.pool.ready(model, None if router.chooses_pairs else WHOLE_REQUEST_ROLES)
        if not candidates:
            raise GatewayError(503, f"no ready endpoint for model {model}"
                                    + (" (prefill/decode endpoints need the pd strategy)" if self.pool.ready(model)
                                       else not_ready_why(self.pool.endpoints(model))),
                               code="service_unavailable", headers={"Retry-After": "5"},
                               header=("x-error-no-model-backends", "true"), error_class=ErrorClass.NO_ENDPOINT)
        return candidates

    def route(self, ireq: InferenceRequest, spec: str, router: Router, candidates: list[Endpoint],
              later: list[Callable[[], None]] | None = None) -> Decision:
        """The timed decision. ``claims`` run at once (they hold what concurrent requests must see);
        with ``later`` (the request's ``after_write``), the router's learning, the latency histogram
        and the observers are put there, to run once the leg is written, with the same values."""
        fallbacks = self._fallbacks
        fallbacks.clear()
        t = time.perf_counter()
        try:
            decision = router.route(ireq, candidates) if later is None else router.decide(ireq, candidates)
        except NoRouteError as e:
            raise GatewayError(503, str(e), code="service_unavailable", headers={"Retry-After": "5"},
                               header=("x-error-routing", "true"), error_class=ErrorClass.NO_ROUTE) from None
        elapsed = time.perf_counter() - t
        decision.strategy = spec
        if fallbacks:
            decision.fallbacks = tuple(fallbacks)
        for claim in self.claims:
            try:
                claim(ireq, decision, decision.fallbacks, elapsed)
            except Exception:     # as an observer's
                log.exception("decision claim failed", request_id=ireq.request_id)
        if later is None:
            self._slo_decided(ireq, decision, None, None, decision.prefill is not None)
            self._report(ireq, decision, spec, elapsed)
        else:
            if self.slo.wants(ireq, decision):   # what the latency models read, taken now; the rest later
                later.append(partial(self._slo_decided, ireq, decision, decision.endpoint.in_flight,
                                     self.slo.clock(), decision.prefill is not None))
            if decision.learn is not None:
                later.append(decision.learn)
                decision.learn = None
            later.append(partial(self._report, ireq, decision, spec, elapsed))
        return decision

    def _latency_child(self, spec: str) -> Any:
        if len(self._latency) >= 256:       # the weights are the client's to spell: bounded as ``strategy_label``'s cache
            self._latency.clear()
        c = self._latency[spec] = self.metrics.child(self.metrics.routing, strategy_label(spec))
        return c

    def _slo_decided(self, ireq: InferenceRequest, decision: Decision, in_flight: int | None,
                     at: float | None, pair: bool) -> None:
        try:
            self.slo.decided(ireq, decision, self.ctx.latency, in_flight, at, pair)
        except Exception:         # as an observer's
            log.exception("latency model bookkeeping failed", request_id=ireq.request_id)

    def _report(self, ireq: InferenceRequest, decision: Decision, spec: str, elapsed: float) -> None:
        (self._latency.get(spec) or self._latency_child(spec)).observe(elapsed)
        if self.observers:
            reported = decision.fallbacks
            for observe in self.observers:
                try:
                    observe(ireq, decision, reported, elapsed)
                except Exception:     # an observer's bug must not fail the request
                    log.exception("decision observer failed", request_id=ireq.request_id)


def not_ready_why(eps: list[Endpoint]) -> str:
    """Why none of a model's endpoints is ready, for its 503's message: how many fail their health
    probes, drain, or have their circuit breaker open (engine faults, a refused engine key
    included), so the client and the operator see the cause, not only its effect."""
    if not eps:
        return " (it has no endpoints)"
    why = [f"{n} {what}" for n, what in (
        (sum(1 for e in eps if not e.healthy), "failing health probes"),
        (sum(1 for e in eps if e.draining), "draining"),
        (sum(1 for e in eps if e.ejected), "with an open circuit breaker after engine faults"))
        if n]
    return f" (of {len(eps)} endpoints: {', '.join(why)})" if why else ""
