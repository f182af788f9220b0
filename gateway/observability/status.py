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

With ``--workers N`` the worker that answers merges its siblings' parts (``StatusBoard.part``, read
over gateway/server/siblings.py) into its document: what adds up is added (requests, in-flight
counts, a user's included, the traffic windows with their latency histograms, fallbacks, a
model's admission queue and headroom), the recent decisions and
errors are interleaved by time, each worker's discovery (its watches, its pods) is listed apart,
and the rest (endpoints' health, engine figures, tenants, the pods out of rotation) is the
answering worker's view; ``gateway.workers`` says which worker answered and how many reported.

``StatusSources.aliases`` gives the config's model aliases (gateway/aliases.py), and
``breaker_state`` an endpoint's circuit breaker as gateway/resilience/breaker.py last moved it.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from gateway.config.schema import Config, KubernetesConfig, StatusConfig
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
MAX_TEXT = 300             # client-controlled text kept in a ring (error messages, paths) is cut here
MAX_NAME = 128             # model and user names as the client sent them
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
    # the model aliases: [{"name", "sticky", "targets": [{"model", "weight"}]}] (gateway/aliases.py)
    aliases: Callable[[], list[dict[str, Any]]] = _no_aliases
    started_at: float = field(default_factory=time.time)   # unix seconds
    # a model's admission rows (gateway.admission.service.Admission.status), None when off; its
    # second argument asks for a sibling's part (what adding them up needs besides)
    admission: Callable[[str, bool], dict[str, Any] | None] = lambda _model, _part=False: None
    # the batch section (gateway.batch.service.BatchService.status), None when batch is off
    batch: Callable[[], Awaitable[dict[str, Any]]] | None = None
    # this worker's Kubernetes discovery (k8s.discovery.KubernetesDiscovery.status), None without one
    discovery: Callable[[], dict[str, Any] | None] = lambda: None
    # the config this process runs: its generation, digest and last reload (gateway.server.reload.Reloader.status)
    config_state: Callable[[], dict[str, Any]] = lambda: {"generation": 1, "digest": None, "last_reload": None}

    def follow(self, live: Live) -> None:
        """A config reload applied (gateway/server/reload.py): read the new generation's config and routing."""
        self.config, self.routing = live.config, live.routing


def _workers_config(own: dict[str, Any], index: int, parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every reporting worker's config (``gateway.workers.config``), by worker index: this one's
    and the siblings' parts' (a part without one, from a worker of an older version, is left out)."""
    rows = [{"worker": index, "pid": os.getpid(), **own}]
    rows += [{"worker": p.get("worker"), "pid": p.get("pid"), **p["config"]}
             for p in parts if isinstance(p.get("config"), dict)]
    return sorted(rows, key=lambda r: r["worker"] if isinstance(r["worker"], int) else -1)


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
        # a model's requests with latency objectives (``Admission.slo_counts``: model → objective →
        # outcome → count), kept and carried with the counts since start
        self.slo: dict[str, dict[str, dict[str, int]]] = {}
        self._usage_cache: tuple[float, tuple[str, ...], dict[str, dict[str, int]]] | None = None

    # -- observers (request path) --------------------------------------------------------------

    def on_request(self, rec: RequestRecord, duration: float) -> None:
        model = rec.label_as or rec.model     # a refused alias's or adapter's: the model it stands for
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
            self.errors.append((self._wall(), rec.request_id, _cut(rec.model, MAX_NAME), _cut(rec.path, MAX_TEXT), status,
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

    def _windows(self, now: float) -> dict[str, tuple[Summary, Summary, list[int]]]:
        """Each model's last minute, window and series."""
        s = self.settings
        out = {}
        for name, w in self.windows.items():
            m, win = w.summaries(now, 60.0, s.window_s)
            out[name] = (m, win, w.series(now))
        return out

    def traffic(self, now: float, parts: list[dict[str, Any]] = ()) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        """Each model's last minute, window and series, and the same for all requests together;
        with the ``parts`` of sibling workers added in."""
        s = self.settings
        windows = self._windows(now)
        requests = self.requests
        for p in parts:
            for name, (rm, rw, points) in p["windows"].items():
                have = windows.get(name)
                if have is None:
                    windows[name] = (_summary(rm), _summary(rw), list(points))
                else:
                    have[0].add(_summary(rm))
                    have[1].add(_summary(rw))
                    windows[name] = (have[0], have[1], [a + b for a, b in zip(have[2], points, strict=False)])
            requests += p["requests"]
        # each span divides by the time its buckets cover, as each model's does (``Summary.add``
        # keeps the longest of the workers'), not by the span's length
        minute, window = Summary(), Summary()
        series = [0] * s.slots
        models: dict[str, dict[str, Any]] = {}
        for name, (m, win, points) in windows.items():
            models[name] = {"minute": m.view(), "window": win.view(), "series": points}
            minute.add(m)
            window.add(win)
            for i, n in enumerate(points[:s.slots]):
                series[i] += n
        return models, {"minute": minute.view(), "window": window.view(), "series": series,
                        "requests_since_start": requests}

    def part(self, src: StatusSources, index: int = 0) -> dict[str, Any]:
        """What this worker (of index ``index``) adds to a sibling's document (``--workers N``):
        JSON-ready, additive."""
        now = self._clock()
        return {"pid": os.getpid(), "worker": index, "requests": self.requests,
                "draining": src.lifecycle.draining, "in_flight": src.lifecycle.in_flight,
                "windows": {name: (_raw(m), _raw(win), points) for name, (m, win, points) in self._windows(now).items()},
                "model_in_flight": dict(src.model_in_flight),
                "endpoints": [(ep.model, ep.name, ep.in_flight, ep.prefill_in_flight, ep.pending_decode,
                               ep.token_active, ep.token_kv) for ep in src.pool.endpoints()],
                "fallbacks": [(st, r, n) for (st, r), n in self.fallbacks.items()],
                "user_in_flight": src.tenancy.state.slots() if src.tenancy is not None else {},
                "decisions": self.recent_decisions(), "errors": self.recent_errors(),
                "discovery": src.discovery(), "config": src.config_state(),
                "admission": {name: row for name in _model_names(src) if (row := src.admission(name, True)) is not None}}

    def counts(self) -> dict[str, Any]:
        """The counts since start, the SLO counts too (``--workers N``: kept aside by each worker, so that neither a
        restarted worker nor a sibling answering while it is gone loses them; see ``carry``)."""
        return {"requests": self.requests, "fallbacks": [(st, r, n) for (st, r), n in self.fallbacks.items()],
                "slo": {model: {o: dict(c) for o, c in objectives.items()} for model, objectives in self.slo.items()}}

    def carry(self, counts: dict[str, Any]) -> None:
        """Go on from the counts since start of this worker's predecessor (``counts``)."""
        self.requests += _count(counts.get("requests"))
        for fb in counts.get("fallbacks") or ():
            if isinstance(fb, list) and len(fb) == 3 and all(isinstance(x, str) for x in fb[:2]):
                self.fallbacks[(fb[0], fb[1])] = self.fallbacks.get((fb[0], fb[1]), 0) + _count(fb[2])
        for model, objectives in _slo_counts(counts.get("slo")).items():
            mine = self.slo.setdefault(model, {})
            for objective, outcomes in objectives.items():
                per = mine.setdefault(objective, {"met": 0, "missed": 0, "shed": 0})
                for outcome, n in outcomes.items():
                    per[outcome] += n

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

    async def document(self, src: StatusSources, parts: list[dict[str, Any]] = (),
                       worker: tuple[int, int] = (0, 1), restarts: dict[str, int] | None = None,
                       kept: list[dict[str, Any]] = ()) -> dict[str, Any]:
        """``/status.json``; see the README's "Status page" for every field. ``parts``: the sibling
        workers' (``part``), added in; ``worker``: (this worker's index, the number of workers);
        ``restarts``: the parent's restarts of workers by reason (gateway/server/heartbeat.py);
        ``kept``: the counts since start (``counts``) last kept by the siblings that did not answer."""
        now, wall = self._clock(), self._wall()
        cfg, pool = src.config, src.pool
        eps = pool.endpoints()
        names = _model_names(src)
        traffic, totals = self.traffic(now, parts)
        model_in_flight: dict[str, int] = src.model_in_flight
        endpoints = [self._endpoint_view(ep, now, cfg.routing.metrics_max_age_s) for ep in eps]
        fallbacks, decisions, errors = self.fallbacks, self.recent_decisions(), self.recent_errors()
        if kept:                # a sibling restarting or stuck: its counts since start as it last kept them
            totals["requests_since_start"] += sum(_count(k.get("requests")) for k in kept)
            fallbacks = _add_fallbacks(fallbacks, [{"fallbacks": k.get("fallbacks") or ()} for k in kept])
        if parts:
            model_in_flight, fallbacks = _add_counts(model_in_flight, parts), _add_fallbacks(fallbacks, parts)
            _add_endpoint_loads(endpoints, parts)
            decisions = _newest([decisions, *(p["decisions"] for p in parts)], self.decisions.maxlen)
            errors = _newest([errors, *(p["errors"] for p in parts)], self.errors.maxlen)
        config = src.config_state()
        return {
            "schema_version": SCHEMA_VERSION,
            "gateway": {
                "version": _version(), "pid": os.getpid(), "now": round(wall, 3),
                "started_at": round(src.started_at, 3), "uptime_s": round(now - self._started, 1),
                "workers": {"count": worker[1], "answered": worker[0], "reporting": 1 + len(parts),
                            "restarts": restarts or {"exited": 0, "stalled": 0},
                            "config": _workers_config(config, worker[0], parts)},
                "config": config,
                "draining": src.lifecycle.draining or any(p["draining"] for p in parts),
                "in_flight": src.lifecycle.in_flight + sum(p["in_flight"] for p in parts),
                "refresh_s": self.settings.refresh_s, "window_s": self.settings.window_s,
                "bucket_s": self.settings.bucket_s, "scrape_interval_s": cfg.scrape.interval_s if cfg.scrape.enabled else None,
                "health_interval_s": cfg.health.interval_s if cfg.health.enabled else None,
                "metrics_max_age_s": cfg.routing.metrics_max_age_s, "default_strategy": cfg.routing.strategy,
                "kubernetes": cfg.kubernetes.enabled,
            },
            "totals": {**totals, "endpoints": len(eps), "ready_endpoints": sum(1 for ep in eps if ep.ready)},
            "models": [self._model_view(src, name, traffic.get(name) or self._quiet(), model_in_flight, parts, kept)
                       for name in names],
            "aliases": src.aliases(),
            "endpoints": endpoints,
            "rolesets": _rolesets(eps),
            "routing": {"fallbacks": [{"strategy": s, "reason": r, "count": n}
                                      for (s, r), n in sorted(fallbacks.items())],
                        "recent": decisions},
            "errors": {"recent": errors},
            "tenants": await self._tenants(src, parts),
            "discovery": _discovery(cfg, eps, src.discovery(), worker[0], parts, wall),
            **({"batch": await src.batch()} if src.batch is not None else {}),
        }

    def _model_view(self, src: StatusSources, name: str, traffic: dict[str, Any],
                    model_in_flight: dict[str, int], parts: list[dict[str, Any]] = (),
                    kept: list[dict[str, Any]] = ()) -> dict[str, Any]:
        m = src.config.model(name)
        eps = src.pool.endpoints(name)
        admission = src.admission(name, bool(parts))
        if parts:
            admission = _add_admission(admission, [(p.get("admission") or {}).get(name) for p in parts])
        if kept:        # the requests with objectives of siblings that did not answer, as they last kept them
            admission = _add_kept_slo(admission, [_slo_counts(k.get("slo")).get(name) for k in kept])
        return {"name": name, "engine": m.engine if m is not None else (eps[0].engine if eps else None),
                "strategy": src.routing.strategy_for(name, None),
                "lock_strategy": m.lock_strategy if m is not None else None,
                "pd": src.pool.has_pd(name), "endpoints": len(eps), "ready_endpoints": sum(1 for ep in eps if ep.ready),
                "in_flight": model_in_flight.get(name, 0), "admission": admission, **traffic}

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

    async def _tenants(self, src: StatusSources, parts: list[dict[str, Any]] = ()) -> dict[str, Any]:
        t = src.tenancy
        auth = src.config.auth
        out: dict[str, Any] = {"enabled": t is not None, "auth": auth.on, "backend": None, "state_up": None,
                               "state_down_reason": None, "directory_version": None,
                               "directory_notices_up": None, "default_user": None, "model_rps": {}, "users": [], "truncated": 0}
        if t is None:
            return out
        d = t.directory
        state = t.state
        out["backend"] = "redis" if state.remote else "memory"
        out["state_up"] = state.healthy
        out["state_down_reason"] = state.down_reason
        out["directory_version"] = t.directory_version
        out["directory_notices_up"] = t.notices.up if t.notices is not None else None
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
        # requests in flight are the gateway's: this worker's slots now (not as a cached read
        # had them) and its siblings', as the in-flight counts above are added up
        held = _add_slots(state.slots(), parts)
        for r in rows:
            u = usage.get(r["name"])
            r["usage"] = None if u is None else {**u, "concurrent": held.get(r["name"], 0)}
            if r["source"] == "default":     # a name a client claimed (bounded at parse: claimed_user) is
                # at most 128 characters already; one charged from an older stored record is cut
                r["name"] = _cut(r["name"], MAX_NAME)
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


def stale_after_s(kcfg: KubernetesConfig) -> float:
    """How long discovery may go without hearing from the API server before the page calls it
    stale: twice the longest a healthy one goes (a watch's server-side end, or the resync's list)."""
    return 2 * max(kcfg.watch_timeout_s, kcfg.resync_interval_s)


def _discovery(cfg: Config, eps: list[Endpoint], own: dict[str, Any] | None, index: int,
               parts: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """Where the endpoint list comes from and, with Kubernetes, how fresh it is. Each worker runs
    its own discovery: its watches are listed per worker, the requests to the API server are added
    up and the last sync is the oldest of them (as ``/metrics`` merges them), and the pods are the
    answering worker's, whose pool the endpoints table shows."""
    kcfg = cfg.kubernetes
    out: dict[str, Any] = {"source": "kubernetes" if kcfg.enabled else "static",
                           "static_endpoints": sum(1 for ep in eps if ep.source == "static"), "kubernetes": None}
    if not kcfg.enabled:
        return out
    bound = stale_after_s(kcfg)
    reports = [(index, os.getpid(), own)] + [(p.get("worker", -1), p["pid"], p.get("discovery")) for p in parts]
    workers, requests, syncs = [], {}, []
    for i, pid, d in sorted(reports, key=lambda r: r[0]):
        if d is None:        # its discovery not started yet
            continue
        watches = []
        for w in d["watches"]:
            last = w["last_sync"]
            age = None if last is None else round(max(0.0, wall - last), 1)
            syncs.append(last)
            watches.append({**w, "last_sync_age_s": age, "stale": age is None or age > bound})
        workers.append({"worker": i, "pid": pid, "pods": d["pods"], "watches": watches})
        for verb, result, n in d["requests"]:
            requests[(verb, result)] = requests.get((verb, result), 0) + _count(n)
    last = None if not syncs or None in syncs else min(syncs)
    age = None if last is None else round(max(0.0, wall - last), 1)
    mine = own or {"pods": {"routable": 0, "not_routable": 0, "skipped": 0}, "not_routable": [], "skipped": []}
    out["kubernetes"] = {
        "namespaces": list(kcfg.namespaces), "label_selector": kcfg.label_selector, "stale_after_s": bound,
        "last_sync": last, "last_sync_age_s": age, "stale": age is None or age > bound,
        "pods": mine["pods"], "not_routable": mine["not_routable"], "skipped": mine["skipped"],
        "requests": [{"verb": v, "result": r, "count": n} for (v, r), n in sorted(requests.items())],
        "workers": workers}
    return out


def _raw(s: Summary) -> tuple:
    return (s.requests, s.errors, s.prompt_tokens, s.completion_tokens, s.seconds,
            list(s.ttft.items()), list(s.e2e.items()))


def _summary(raw: list) -> Summary:
    s = Summary()
    s.requests, s.errors, s.prompt_tokens, s.completion_tokens, s.seconds = raw[:5]
    s.ttft = {int(k): n for k, n in raw[5]}
    s.e2e = {int(k): n for k, n in raw[6]}
    return s


def _count(n: Any) -> int:
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def _add_counts(own: dict[str, int], parts: list[dict[str, Any]]) -> dict[str, int]:
    out = dict(own)
    for p in parts:
        for model, n in p["model_in_flight"].items():
            out[model] = out.get(model, 0) + n
    return out


def _add_slots(own: dict[str, int], parts: list[dict[str, Any]]) -> dict[str, int]:
    out = dict(own)
    for p in parts:
        for user, n in (p.get("user_in_flight") or {}).items():
            out[user] = out.get(user, 0) + _count(n)
    return out


def _add_fallbacks(own: dict[tuple[str, str], int], parts: list[dict[str, Any]]) -> dict[tuple[str, str], int]:
    out = dict(own)
    for p in parts:
        for strategy, reason, n in p["fallbacks"]:
            out[(strategy, reason)] = out.get((strategy, reason), 0) + _count(n)
    return out


def _add_endpoint_loads(views: list[dict[str, Any]], parts: list[dict[str, Any]]) -> None:
    """The siblings' requests on each endpoint, added to this worker's (an endpoint it does not know
    is left out: its view of the pool is what the page lists)."""
    by_key = {(v["model"], v["name"]): v for v in views}
    for p in parts:
        for model, name, in_flight, prefill, pending, active, kv in p["endpoints"]:
            v = by_key.get((model, name))
            if v is None:
                continue
            v["in_flight"] += in_flight
            # this worker's remote count holds its siblings' (the shared view, or Redis): those are
            # the gateway's own now, so only other replicas' stay remote
            v["remote_in_flight"] = max(0, v["remote_in_flight"] - in_flight)
            pd = v["pd"]
            pd["prefill_in_flight"] += prefill
            pd["pending_decode"] += pending
            pd["token_active"] = round(pd["token_active"] + active, 1)
            pd["token_kv"] = round(pd["token_kv"] + kv, 1)


def _model_names(src: StatusSources) -> list[str]:
    return list(dict.fromkeys([*src.pool.models(), *(m.name for m in src.config.models)]))


def _add_admission(own: dict[str, Any] | None, others: list[Any]) -> dict[str, Any] | None:
    """A model's admission rows with its siblings' (their ``Admission.status`` parts) added up, as
    ``/metrics`` adds the workers' gauges: requests, bytes and users waiting (a user waiting in
    several workers once), the queue bounds (each worker's share), the drain rate and each
    endpoint's headroom summed; the engine's queue estimate takes in what every worker sent since
    the scrape; the capacity is the largest any worker counts on."""
    rows = [r for r in (own, *others) if isinstance(r, dict)]
    if not rows:
        return None
    out = {k: v for k, v in rows[0].items() if k not in ("users", "endpoints")}
    slos = [r["slo"] for r in rows if r.get("slo")]
    if slos:
        out["slo"] = {objective: {o: sum(s.get(objective, {}).get(o, 0) for s in slos) for o in ("met", "missed", "shed")}
                      for objective in sorted({k for s in slos for k in s})}
    if not out.get("enabled"):
        return out
    on = [r for r in rows if r.get("enabled")]
    out["queue"] = {c: sum(r["queue"].get(c, 0) for r in on) for c in out["queue"]}
    out["users_waiting"] = {c: len({u for r in on for u in (r.get("users") or {}).get(c, ())})
                            if all("users" in r for r in on) else sum(r["users_waiting"].get(c, 0) for r in on)
                            for c in out["users_waiting"]}
    for key in ("queue_bytes", "queue_max"):
        out[key] = sum(r[key] for r in on)
    out["drain_rate"] = round(sum(r["drain_rate"] for r in on), 3)
    ttfts = [r["engine_ttft_ms"] for r in on if r["engine_ttft_ms"] > 0]
    out["engine_ttft_ms"] = round(sum(ttfts) / len(ttfts), 1) if ttfts else 0.0
    endpoints = []
    for ep in rows[0]["endpoints"]:
        same = [e for r in on[1:] for e in r["endpoints"] if e["name"] == ep["name"]]
        row = {k: v for k, v in ep.items() if k != "sent"}
        row["headroom"] = min(1_000_000, ep["headroom"] + sum(e["headroom"] for e in same))
        if ep["engine_queue"] is not None:
            row["engine_queue"] = ep["engine_queue"] + sum(e.get("sent", 0) for e in same)
        caps = [e["capacity"] for e in (ep, *same) if e["capacity"] is not None]
        row["capacity"] = max(caps) if caps else None
        row["saturated"] = row["headroom"] < 1
        row["reason"] = ep["reason"] if row["saturated"] else None
        endpoints.append(row)
    out["endpoints"] = endpoints
    return out


def _slo_counts(raw: Any) -> dict[str, dict[str, dict[str, int]]]:
    """Kept SLO counts (``StatusBoard.counts``) as read back: what is not a count left out."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for model, objectives in (raw.items() if isinstance(raw, dict) else ()):
        if not isinstance(objectives, dict):
            continue
        for objective, outcomes in objectives.items():
            if objective in ("ttft", "tpot") and isinstance(outcomes, dict):
                out.setdefault(model, {})[objective] = {o: _count(outcomes.get(o)) for o in ("met", "missed", "shed")}
    return out


def _add_kept_slo(admission: dict[str, Any] | None, kept: list[Any]) -> dict[str, Any] | None:
    """A model's admission rows with the SLO counts kept by siblings that did not answer added in."""
    kept = [k for k in kept if k]
    if not kept:
        return admission
    out = dict(admission) if admission is not None else {"enabled": False}
    slos = [s for s in (out.get("slo"), *kept) if s]
    out["slo"] = {objective: {o: sum(s.get(objective, {}).get(o, 0) for s in slos) for o in ("met", "missed", "shed")}
                  for objective in sorted({k for s in slos for k in s})}
    return out


def _newest(rings: list[list[dict[str, Any]]], n: int | None) -> list[dict[str, Any]]:
    """Rings of recent entries, newest first, interleaved by time and cut to ``n``."""
    merged = sorted((e for ring in rings for e in ring), key=lambda e: e["time"], reverse=True)
    return merged[:n]


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
