"""What the status page shows: the gateway's own live state, plus a few minutes of traffic.

``GET /status.json`` (gateway/observability/status_http.py) is computed when asked, from state the gateway
keeps anyway: the endpoint pool (readiness, health, in-flight, the engine-metrics snapshot the
scraper took, the P/D trackers), the models' in-flight counts, the tenants' directory and limit
counters. What the gateway did not keep before is kept here, in fixed memory:

- ``StatusBoard.on_request``, told of every finished request (``gateway.pipeline.context.record_request``
  calls its observers), counts it into its model's ``TimeWindow`` (gateway/observability/window.py: rate,
  errors, tokens, TTFT and end-to-end latency histograms in time buckets) and, if it failed,
  appends it to a ring of recent errors;
- ``StatusBoard.on_decision``, told of every routing decision (``gateway.pipeline.routing.Routing``),
  appends it with the fallbacks the router reported to a ring of recent decisions.

Both are a few additions and at most one tuple per request. The document costs
O(endpoints + models x buckets + rings + listed users) to build, nothing between two reads.

Hooks for what does not exist yet: ``StatusSources.aliases`` (model aliases) and
``breaker_state`` (per-endpoint circuit breakers) answer empty / ``None`` today.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from gateway.config.schema import Config, StatusConfig
from gateway.endpoints import Endpoint, EndpointPool
from gateway.observability.window import Summary, TimeWindow
from gateway.pipeline.routing import Routing
from gateway.server.lifecycle import Lifecycle

if TYPE_CHECKING:
    from gateway.pipeline.context import RequestRecord
    from gateway.request import InferenceRequest
    from gateway.server.reload import Live
    from gateway.tenants import Tenancy
    from routers.base import Decision

SCHEMA_VERSION = 1
OTHER_MODEL = "-"          # the window of requests with no known model (parse errors, unknown models)
MAX_TEXT = 300             # client-controlled text kept in a ring (error messages) is cut here
MAX_NAME = 128             # model names as the client sent them
USAGE_CACHE_S = 1.0        # with Redis, tenants' usage is read at most once a second


@cache
def _version() -> str:
    try:
        return version("switchyard")
    except PackageNotFoundError:
        return "unknown"


def _cut(text: str | None, n: int) -> str | None:
    return text if text is None or len(text) <= n else text[:n] + "…"


def breaker_state(ep: Endpoint) -> str | None:
    """The endpoint's circuit-breaker state (``closed`` / ``open`` / ``half_open``) as
    gateway/resilience/breaker.py last moved it; ``None`` while it never left ``closed``."""
    return ep.extra.get("breaker")


def _no_aliases() -> list[dict[str, Any]]:
    return []


@dataclass(slots=True)
class StatusSources:
    """What the document is read from; ``gateway.server.app`` builds it from the collaborators it wires."""

    config: Config
    pool: EndpointPool
    routing: Routing
    lifecycle: Lifecycle
    model_in_flight: dict[str, int]
    tenancy: Tenancy | None = None
    # model aliases, once they exist: [{"name", "targets": [{"model", "weight"}], ...}]
    aliases: Callable[[], list[dict[str, Any]]] = _no_aliases
    started_at: float = field(default_factory=time.time)   # unix seconds
    # a model's admission rows (gateway.admission.service.Admission.status), None when off
    admission: Callable[[str], dict[str, Any] | None] = lambda _model: None

    def follow(self, live: Live) -> None:
        """A config reload applied (gateway/server/reload.py): read the new generation's config and routing."""
        self.config, self.routing = live.config, live.routing


class StatusBoard:
    """The traffic windows and the two rings; the observers run on the request path."""

    def __init__(self, settings: StatusConfig, known_model: Callable[[str], bool],
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self._known = known_model
        self._clock = clock
        self._wall = wall
        self._started = clock()
        self.windows: dict[str, TimeWindow] = {}
        self.decisions: deque[tuple] = deque(maxlen=settings.recent_decisions)
        self.errors: deque[tuple] = deque(maxlen=settings.recent_errors)
        self.fallbacks: dict[tuple[str, str], int] = {}      # (strategy, reason) → count since start
        self.requests = 0
        self._usage_cache: tuple[float, tuple[str, ...], dict[str, dict[str, int]]] | None = None

    # -- observers (request path) --------------------------------------------------------------

    def on_request(self, rec: RequestRecord, duration: float) -> None:
        model = rec.model
        w = self.windows.get(model)
        if w is None:
            if not self._known(model):   # client-chosen names must not grow the table
                model = OTHER_MODEL
                w = self.windows.get(model)
            if w is None:
                s = self.settings
                w = self.windows[model] = TimeWindow(s.bucket_s, s.slots, self._started)
        status = rec.status
        failed = status >= 400 or rec.error_class is not None
        w.observe(self._clock(), failed, rec.ttft, None if failed else duration,
                  rec.prompt_tokens, rec.completion_tokens)
        self.requests += 1
        if failed and self.errors.maxlen:   # client text is cut now: the ring must not pin large bodies
            self.errors.append((self._wall(), rec.request_id, _cut(rec.model, MAX_NAME), rec.path, status,
                                rec.error_class, _cut(rec.error, MAX_TEXT), rec.endpoint, rec.prefill_endpoint,
                                _cut(rec.user, MAX_NAME), duration, rec.stream))

    def on_decision(self, ireq: InferenceRequest, decision: Decision,
                    fallbacks: tuple[tuple[str, str], ...], seconds: float) -> None:
        for fb in fallbacks:
            self.fallbacks[fb] = self.fallbacks.get(fb, 0) + 1
        if self.decisions.maxlen:
            prefill = decision.prefill
            self.decisions.append((self._wall(), ireq.request_id, ireq.model, decision.strategy,
                                   decision.endpoint.name, None if prefill is None else prefill.name,
                                   decision.uncached_tokens if prefill is not None else None, fallbacks, seconds))

    # -- views ---------------------------------------------------------------------------------

    def traffic(self, now: float) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        """Each model's last minute, window and series, and the same for all requests together."""
        s = self.settings
        minute, window = Summary(), Summary()
        series = [0] * s.slots
        models: dict[str, dict[str, Any]] = {}
        for name, w in self.windows.items():
            m, win = w.summaries(now, 60.0, s.window_s)
            points = w.series(now)
            models[name] = {"minute": m.view(), "window": win.view(), "series": points}
            minute.add(m)
            window.add(win)
            for i, n in enumerate(points):
                series[i] += n
        age = now - self._started
        minute.seconds, window.seconds = min(60.0, age), min(s.window_s, age)
        return models, {"minute": minute.view(), "window": window.view(), "series": series,
                        "requests_since_start": self.requests}

    def _quiet(self) -> dict[str, Any]:
        empty = Summary().view()
        return {"minute": empty, "window": empty, "series": [0] * self.settings.slots}

    def recent_decisions(self) -> list[dict[str, Any]]:
        return [{"time": round(t, 3), "request_id": rid, "model": model, "strategy": strategy,
                 "endpoint": endpoint, "prefill_endpoint": prefill, "uncached_tokens": uncached,
                 "fallbacks": [{"strategy": s, "reason": r} for s, r in fallbacks],
                 "decision_us": round(seconds * 1e6, 1)}
                for t, rid, model, strategy, endpoint, prefill, uncached, fallbacks, seconds in reversed(self.decisions)]

    def recent_errors(self) -> list[dict[str, Any]]:
        return [{"time": round(t, 3), "request_id": rid, "model": model, "path": path,
                 "status": status, "error_class": error_class, "error": error,
                 "endpoint": endpoint or None, "prefill_endpoint": prefill, "user": user,
                 "duration_ms": round(duration * 1000, 3), "stream": stream}
                for t, rid, model, path, status, error_class, error, endpoint, prefill, user, duration, stream
                in reversed(self.errors)]

    # -- the document --------------------------------------------------------------------------

    async def document(self, src: StatusSources) -> dict[str, Any]:
        """``/status.json``; see the README's "Status page" for every field."""
        now, wall = self._clock(), self._wall()
        cfg, pool = src.config, src.pool
        eps = pool.endpoints()
        names = list(dict.fromkeys([*pool.models(), *(m.name for m in cfg.models)]))
        traffic, totals = self.traffic(now)
        return {
            "schema_version": SCHEMA_VERSION,
            "gateway": {
                "version": _version(), "pid": os.getpid(), "now": round(wall, 3),
                "started_at": round(src.started_at, 3), "uptime_s": round(now - self._started, 1),
                "draining": src.lifecycle.draining, "in_flight": src.lifecycle.in_flight,
                "refresh_s": self.settings.refresh_s, "window_s": self.settings.window_s,
                "bucket_s": self.settings.bucket_s, "scrape_interval_s": cfg.scrape.interval_s if cfg.scrape.enabled else None,
                "health_interval_s": cfg.health.interval_s if cfg.health.enabled else None,
                "metrics_max_age_s": cfg.routing.metrics_max_age_s, "default_strategy": cfg.routing.strategy,
                "kubernetes": cfg.kubernetes.enabled,
            },
            "totals": {**totals, "endpoints": len(eps), "ready_endpoints": sum(1 for ep in eps if ep.ready)},
            "models": [self._model_view(src, name, traffic.get(name) or self._quiet()) for name in names],
            "aliases": src.aliases(),
            "endpoints": [self._endpoint_view(ep, now, cfg.routing.metrics_max_age_s) for ep in eps],
            "rolesets": _rolesets(eps),
            "routing": {"fallbacks": [{"strategy": s, "reason": r, "count": n}
                                      for (s, r), n in sorted(self.fallbacks.items())],
                        "recent": self.recent_decisions()},
            "errors": {"recent": self.recent_errors()},
            "tenants": await self._tenants(src),
        }

    def _model_view(self, src: StatusSources, name: str, traffic: dict[str, Any]) -> dict[str, Any]:
        m = src.config.model(name)
        eps = src.pool.endpoints(name)
        return {"name": name, "engine": m.engine if m is not None else (eps[0].engine if eps else None),
                "strategy": src.routing.strategy_for(name, None),
                "lock_strategy": m.lock_strategy if m is not None else None,
                "pd": src.pool.has_pd(name), "endpoints": len(eps), "ready_endpoints": sum(1 for ep in eps if ep.ready),
                "in_flight": src.model_in_flight.get(name, 0), "admission": src.admission(name), **traffic}

    @staticmethod
    def _endpoint_view(ep: Endpoint, now: float, max_age: float) -> dict[str, Any]:
        m = ep.metrics
        engine = None
        if m is not None:
            age = m.age(now)
            engine = {"running": m.running, "waiting": m.waiting, "kv_usage": m.kv_usage,
                      "prefix_hit_rate": m.prefix_hit_rate, "gen_throughput": m.gen_throughput,
                      "age_s": round(age, 3), "stale": age > max_age}
        return {"model": ep.model, "name": ep.name, "url": ep.url, "engine": ep.engine, "role": ep.role,
                "roleset": ep.roleset, "source": ep.source, "namespace": ep.extra.get("namespace"),
                "ready": ep.ready, "healthy": ep.healthy, "draining": ep.draining, "breaker": breaker_state(ep),
                "in_flight": ep.in_flight, "remote_in_flight": ep.remote_in_flight,
                "consecutive_failures": ep.consecutive_failures, "engine_metrics": engine,
                "pd": {"prefill_in_flight": ep.prefill_in_flight, "pending_decode": ep.pending_decode,
                       "token_active": round(ep.token_active, 1), "token_kv": round(ep.token_kv, 1)}}

    async def _tenants(self, src: StatusSources) -> dict[str, Any]:
        t = src.tenancy
        auth = src.config.auth
        out: dict[str, Any] = {"enabled": t is not None, "auth": auth.on, "backend": None, "state_up": None,
                               "default_user": None, "model_rps": {}, "users": [], "truncated": 0}
        if t is None:
            return out
        d = t.directory
        state = t.state
        out["backend"] = "redis" if state.remote else "memory"
        out["state_up"] = state.up
        if d.default_user is not None:
            out["default_user"] = _limits(d.default_user)
        out["model_rps"] = dict(t.model_rps)
        cap = self.settings.max_users
        listed = d.users()
        rows = [{"name": u["name"], "source": u["source"], "rpm": u["rpm"], "tpm": u["tpm"],
                 "max_concurrent": u["max_concurrent"]} for u in listed[:cap]]
        if d.default_user is not None and not state.remote and len(rows) < cap:
            # users with no entry of their own, limited by default_user, while they are active
            known = {u["name"] for u in listed}
            extra = [u for u in state.active_users(cap + len(known)) if u not in known][:cap - len(rows)]
            rows += [{"name": u, "source": "default", **_limits(d.default_user)} for u in extra]
        out["truncated"] = max(0, len(listed) - cap)
        usage: dict[str, dict[str, int]] = {}
        if rows and state.up:
            usage = await self._peek(state, tuple(r["name"] for r in rows))
        for r in rows:
            r["usage"] = usage.get(r["name"])
        out["users"] = rows
        return out


    async def _peek(self, state, users: tuple[str, ...]) -> dict[str, dict[str, int]]:
        """Usage counters; with Redis one ``MGET``, shared by every page that asks within a second."""
        now = self._clock()
        cached = self._usage_cache
        if state.remote and cached is not None and cached[1] == users and now - cached[0] < USAGE_CACHE_S:
            return cached[2]
        try:
            usage = await state.peek(list(users))
        except Exception:       # the shared state went away: limits without usage
            return {}
        if state.remote:
            self._usage_cache = (now, users, usage)
        return usage


def _limits(lim) -> dict[str, int]:
    return {"rpm": lim.rpm, "tpm": lim.tpm, "max_concurrent": lim.max_concurrent}


def _rolesets(eps: list[Endpoint]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for ep in eps:
        if ep.roleset is None or ep.role not in ("prefill", "decode", "combined"):
            continue
        g = groups.get((ep.model, ep.roleset))
        if g is None:
            g = groups[(ep.model, ep.roleset)] = {"model": ep.model, "name": ep.roleset, "prefill": [], "decode": [],
                                                  "combined": [], "ready": False}
        g[ep.role].append(ep.name)
    ready = {(ep.model, ep.roleset, ep.role) for ep in eps if ep.ready}
    for (model, name), g in groups.items():
        g["ready"] = ((model, name, "prefill") in ready and (model, name, "decode") in ready) \
            or (model, name, "combined") in ready
    return list(groups.values())
