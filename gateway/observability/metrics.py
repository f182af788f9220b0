"""The gateway's own Prometheus metrics, in a registry owned by the app (no global state).

Label lookups in prometheus-client cost a dict lookup plus lock; children used per request are
cached in plain dicts keyed by label tuples so the hot path pays one dict lookup each.

The counters and histograms a request touches (``Counter``, ``Histogram`` below) are the
gateway's own: a child is a plain float (or a list of bucket counts) that ``inc``/``observe``
update without prometheus-client's per-call lock, checks and per-bucket Python loop; they are
exported through the same registry, in the same exposition (``_total``, ``_bucket``/``_sum``/
``_count``, ``_created``). They may only be updated from the event loop's thread.
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Collection, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from gateway.server.periodic import Periodic

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
ROUTING_BUCKETS = (0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                   0.01, 0.025, 0.05)
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _Family(Collector):
    """What ``Counter`` and ``Histogram`` share: the name, the label names, the children by label
    values, and registration (``describe`` names the series, so a clash fails at start-up)."""

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str] = (),
                 registry: CollectorRegistry | None = None) -> None:
        self._name = name
        self._doc = documentation
        self._labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], Any] = {}
        self._single = None if self._labelnames else self._new_child()
        if registry is not None:
            registry.register(self)

    def labels(self, *values: Any, **named: Any):
        if named:
            if values:
                raise ValueError("labels: pass label values by position or by name, not both")
            values = tuple(named[n] for n in self._labelnames)
        key = tuple(str(v) for v in values)
        if len(key) != len(self._labelnames):
            raise ValueError(f"{self._name}: {len(self._labelnames)} label values expected, got {len(key)}")
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = self._new_child()
        return c

    def _new_child(self) -> Any:
        raise NotImplementedError

    def forget(self, model: str, endpoint: str) -> int:
        """Drop the series of one endpoint (labels ``model`` and ``endpoint``); how many went."""
        return self.forget_each({(model, endpoint)})

    def forget_each(self, endpoints: Collection[tuple[str, str]]) -> int:
        """Drop the series of these endpoints, ``(model, endpoint)`` label pairs, in one walk of the
        series; how many went."""
        try:
            mi, ei = self._labelnames.index("model"), self._labelnames.index("endpoint")
        except ValueError:
            return 0
        gone = [k for k in self._children if (k[mi], k[ei]) in endpoints]
        for k in gone:
            del self._children[k]
        return len(gone)

    def _series(self) -> list[tuple[tuple[str, ...], Any]]:
        return [((), self._single)] if self._single is not None else list(self._children.items())

    def describe(self) -> list:
        return [self._family()]

    def _family(self) -> Any:
        raise NotImplementedError


class _CounterChild:
    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount


class Counter(_Family):
    """A counter (``<name>_total``), exported as prometheus-client's ``Counter`` is."""

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str] = (),
                 registry: CollectorRegistry | None = None) -> None:
        super().__init__(name.removesuffix("_total"), documentation, labelnames, registry)

    def _new_child(self) -> _CounterChild:
        return _CounterChild()

    def inc(self, amount: float = 1) -> None:
        """An unlabelled counter's increment."""
        if self._single is None:
            raise ValueError(f"{self._name} has labels: use labels(...).inc()")
        self._single.inc(amount)

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self._name, self._doc, labels=self._labelnames)

    def collect(self):
        fam = self._family()
        for key, c in self._series():
            fam.add_metric(key, c.value, created=c.created)
        yield fam


# from this many values on, ``observe_many`` sorts them and cuts at the bounds
_SORT_FROM = 16


class _HistogramChild:
    __slots__ = ("bounds", "counts", "sum", "created")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)       # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1     # the first bound >= amount, as Prometheus's le
        self.sum += amount

    def observe_many(self, values: Iterable[float]) -> None:
        """Every value observed, as ``observe`` would (a stream's inter-token gaps, at its end).
        A long list is sorted once and cut at the bounds (one ``bisect`` per bucket until the
        values run out, in C), not looked up value by value: a 500-token stream's gaps cost a
        few dozen interpreter steps, not thousands."""
        vals = values if isinstance(values, list) else list(values)
        counts, bounds = self.counts, self.bounds
        if len(vals) < _SORT_FROM:
            for v in vals:
                counts[bisect_left(bounds, v)] += 1
        else:
            ordered = sorted(vals)
            n, lo = len(ordered), 0
            for i, b in enumerate(bounds):
                hi = bisect_right(ordered, b, lo)       # the values <= b (Prometheus's le)
                if hi > lo:
                    counts[i] += hi - lo
                    if hi == n:
                        break
                    lo = hi
            else:
                counts[-1] += n - lo                    # above the last bound: +Inf
        self.sum += sum(vals)


class Histogram(_Family):
    """A histogram (``_bucket``, ``_count``, ``_sum``), exported as prometheus-client's is."""

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str] = (),
                 registry: CollectorRegistry | None = None, buckets: Iterable[float] = LATENCY_BUCKETS) -> None:
        bounds = sorted(float(b) for b in buckets if b != float("inf"))
        if not bounds or len(set(bounds)) != len(bounds):
            raise ValueError(f"{name}: buckets must be distinct and at least one finite bound")
        self._bounds = tuple(bounds)
        self._les = [floatToGoString(b) for b in bounds] + ["+Inf"]
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> _HistogramChild:
        return _HistogramChild(self._bounds)

    def observe(self, amount: float) -> None:
        if self._single is None:
            raise ValueError(f"{self._name} has labels: use labels(...).observe()")
        self._single.observe(amount)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)

    def collect(self):
        fam = self._family()
        for key, c in self._series():
            cumulative, n = [], 0
            for le, k in zip(self._les, c.counts, strict=True):
                n += k
                cumulative.append((le, n))
            fam.add_metric(key, cumulative, c.sum)
            # after its series' other samples, as OpenMetrics groups them (the text format gives
            # the ``_created`` samples a family of their own, in this order either way)
            fam.samples.append(Sample(self._name + "_created", dict(zip(self._labelnames, key, strict=True)), c.created))
        yield fam


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("switchyard_requests", "Client requests by final HTTP status",
                                ["model", "status", "strategy"], registry=r)
        self.ttft = Histogram("switchyard_time_to_first_token_seconds",
                              "Time from request arrival to the first generated token", ["model"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("switchyard_inter_token_latency_seconds",
                             "Gaps between chunks that carried generated tokens", ["model"],
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("switchyard_e2e_request_latency_seconds", "Request arrival to last byte",
                             ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.routing = Histogram("switchyard_routing_decision_seconds", "Time spent choosing an endpoint",
                                 ["strategy"], buckets=ROUTING_BUCKETS, registry=r)
        self.prompt_tokens = Counter("switchyard_prompt_tokens", "Prompt tokens reported by engines",
                                     ["model"], registry=r)
        self.completion_tokens = Counter("switchyard_completion_tokens", "Completion tokens reported by engines",
                                         ["model"], registry=r)
        self.cached_tokens = Counter("switchyard_cached_prompt_tokens",
                                     "Prompt tokens served from the engines' prefix cache", ["model"], registry=r)
        self.upstream_errors = Counter("switchyard_upstream_errors", "Upstream failures by class",
                                       ["model", "endpoint", "error_class"], registry=r)
        self.retries = Counter("switchyard_retries", "Requests retried on another endpoint", ["model"],
                               registry=r)
        self.upstream_reopened = Counter(
            "switchyard_upstream_connections_reopened",
            "Pooled connections to engines opened again after the engine closed them while idle "
            "(upstream.warm_connections), by outcome (opened, failed)", ["outcome"], registry=r)
        self.internal_errors = Counter("switchyard_internal_errors",
                                       "Unexpected exceptions in the request path (bugs); each is logged with its traceback",
                                       registry=r)
        self.log_lines_dropped = Counter("switchyard_log_lines_dropped",
                                         "Request log lines dropped because stderr stopped draining", registry=r)
        self.client_cancels = Counter("switchyard_client_cancels",
                                      "Requests whose client went away before the end", ["model", "stage"],
                                      registry=r)
        self.fields_dropped = Counter("switchyard_request_fields_dropped",
                                      "Request body fields dropped before the engine because they would steer it "
                                      "past the gateway's controls (priority, kv_transfer_params, a data-parallel rank, "
                                      "a logits processor, SGLang's rid)",
                                      ["model", "field"], registry=r)
        self.routing_fallbacks = Counter("switchyard_routing_fallbacks",
                                         "Strategy decisions made without the strategy's signal",
                                         ["strategy", "reason"], registry=r)
        self.health_probes = Counter("switchyard_health_probes", "Active health probes by result",
                                     ["model", "endpoint", "result"], registry=r)
        self.scrapes = Counter("switchyard_engine_scrapes", "Engine /metrics scrapes by result",
                               ["model", "endpoint", "result"], registry=r)
        self.engine_restarts = Counter("switchyard_engine_restarts",
                                       "Engines whose process_start_time_seconds changed between two scrapes: "
                                       "restarted, their cache empty; the endpoint's prefix-index and KV-event "
                                       "entries and sessions were dropped",
                                       ["model", "endpoint"], registry=r)
        # P/D
        self.pd_prefill_time = Histogram("switchyard_pd_prefill_seconds", "Prefill leg duration", ["model"],
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.pd_kv_transfer_time = Histogram("switchyard_pd_kv_transfer_seconds",
                                             "First token minus prefill end", ["model"],
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.pd_decode_time = Histogram("switchyard_pd_decode_seconds", "Decode leg duration", ["model"],
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.pd_prefill_failures = Counter("switchyard_pd_prefill_failures",
                                           "Prefill leg failures by class and by whether the client had bytes",
                                           ["model", "failure_class", "stage"], registry=r)
        self.watchdog_fires = Counter("switchyard_watchdog_fires", "Watchdog fires by phase (P/D decode legs, and plain legs with watchdog.aggregated)",
                                      ["model", "phase"], registry=r)
        self.pd_aborts = Counter("switchyard_pd_aborts", "Abort calls sent to engines, by result",
                                 ["model", "result"], registry=r)
        # the process itself: CPU, RSS, open fds (read from /proc at scrape time), event-loop lag
        self.loop_lag = Histogram("switchyard_event_loop_lag_seconds",
                                  "How late the event loop ran a periodic timer (gateway/observability/looplag.py)",
                                  buckets=LOOP_LAG_BUCKETS, registry=r)
        self.memory_reclaims = Counter("switchyard_memory_reclaims",
                                       "Times memory was handed back after a burst of requests ended (gateway/server/reclaim.py)",
                                       registry=r)
        ProcessCollector(registry=r)
        # tracing (gateway/observability/tracing.py): what the OTLP exporter could not deliver, after its retries
        self.trace_export_failures = Counter("switchyard_trace_export_failures",
                                             "Span batches the OTLP exporter failed to deliver", registry=r)
        self.trace_spans = Counter("switchyard_trace_spans", "Spans by what became of them (exported, failed: "
                                   "the exporter could not deliver them, dropped: the export queue was full)",
                                   ["result"], registry=r)
        # mid-stream continuation (gateway/pipeline/migration.py): each failed leg of a stream that had
        # migration on, by what failed it and what the gateway did (continued, refused_<why>, ...)
        self.migrations = Counter("switchyard_migrations", "Mid-stream failures of streams with migration on, "
                                  "by reason and outcome", ["model", "reason", "outcome"], registry=r)
        # Redis clients (gateway/state/redis.py): calls that waited state.timeout_s for one of the
        # client's state.max_connections in vain, and failed as if Redis were unreachable
        self.state_pool_timeouts = Counter("switchyard_state_pool_timeouts",
                                           "Redis calls that found all of their client's state.max_connections "
                                           "busy for state.timeout_s and failed as if Redis were unreachable",
                                           ["client"], registry=r)
        # CORS (gateway/server/cors.py): the requests that carried an Origin while
        # server.cors_allowed_origins lists origins, counted by the edge as their handler starts
        self.cors_requests = Counter("switchyard_cors_requests",
                                     "Requests with an Origin header while CORS is on, by outcome (preflight_allowed, "
                                     "preflight_refused, allowed, refused)", ["outcome"], registry=r)
        self._children: dict[tuple, object] = {}
        # a finished request's (requests child, e2e child or None), per (model, model known, status,
        # strategy) as its record spells them: ``finished_series``
        self.finished: dict[tuple[str, bool, int, str], tuple[Any, Any]] = {}
        # the families labelled by endpoint, whose series go some time after their endpoint did
        # (``RetiredSeries``); other parts add theirs (the breakers')
        self.per_endpoint: list[_Family] = [self.upstream_errors, self.health_probes, self.scrapes,
                                            self.engine_restarts]
        self._caches: list[dict[tuple, object]] = [self._children]
        # told the (model, endpoint) pairs whose series were dropped, all of a sweep's at once (with
        # several workers, the counts a restarted worker carries from its predecessors:
        # gateway/server/siblings.py)
        self.forget_listeners: list[Callable[[Collection[tuple[str, str]]], None]] = []

    def add_per_endpoint(self, families: Iterable[_Family], cache: dict[tuple, object]) -> None:
        """Families of another part labelled (model, endpoint, ...) and its cache of their children,
        keyed as ``child`` keys them: forgotten with the endpoint."""
        self.per_endpoint.extend(families)
        self._caches.append(cache)

    def forget_endpoint(self, model: str, endpoint: str) -> int:
        """Drop every series labelled with this endpoint, and the cached children that wrote them
        (a child left cached would count into a series no longer exported)."""
        return self.forget_endpoints({(model, endpoint)})

    def forget_endpoints(self, endpoints: Collection[tuple[str, str]]) -> int:
        """``forget_endpoint`` for each of these ``(model, endpoint)`` pairs, with one walk of each
        family's series and of each cache, however many they are (a namespace of pods emptied)."""
        n = sum(f.forget_each(endpoints) for f in self.per_endpoint)
        families = set(self.per_endpoint)
        for cache in self._caches:
            for key in [k for k in cache if k[0] in families and k[1][:2] in endpoints]:
                del cache[key]
        for listener in self.forget_listeners:
            listener(endpoints)
        return n

    def attach_live_state(self, endpoints: Callable[[], Iterable], model_in_flight: dict[str, int],
                          prefix_stats: Callable[[], dict[str, int]] | None = None,
                          engine_max_age: float | Callable[[], float] = 10.0,
                          fleet_load: Callable[[Any], float] | None = None,
                          served: Callable[[str], bool] | None = None,
                          connections: Callable[[], tuple[int, int]] | None = None,
                          session_stats: Callable[[], dict[str, int]] | None = None) -> None:
        """Gauges of live counts, read from the objects that hold them at scrape time. ``served``:
        whether a model is still served (one a reload or discovery removed keeps its in-flight
        series while requests of it run, no longer); ``engine_max_age``: a number of seconds, or
        what gives the live one at each scrape (a reload changes it); ``connections``: the
        upstream pool's (busy, idle) connections; ``session_stats``: the session map's entries and
        evictions (``SessionMap.stats``)."""
        self.registry.register(LiveState(endpoints, model_in_flight, prefix_stats, engine_max_age, fleet_load,
                                         served, connections, session_stats))

    def child(self, metric, *labels: str):
        """A cached labelled child: one dict lookup on the hot path (a family hashes by identity;
        a child is never false)."""
        return self._children.get((metric, labels)) or self._new_child(metric, labels)

    def _new_child(self, metric, labels: tuple[str, ...]):
        c = self._children[(metric, labels)] = metric.labels(*labels)
        return c

    def finished_series(self, key: tuple[str, bool, int, str], model_label: str, strategy_label: str
                        ) -> tuple[Any, Any]:
        """The children a finished request counts into, kept in ``finished`` under ``key`` (its
        record's model, whether the model is known, status and strategy): ``requests`` {model
        label, status, strategy label}, and ``e2e`` {model} for a success of a named model (else
        None). Not kept for a model that is not known (its name is the client's: any length, any
        number of them); bounded, as a strategy's weights are the client's to spell too."""
        model, known, status, _ = key
        e2e = self.child(self.e2e, model) if model != "-" and 0 < status < 400 else None
        series = (self.child(self.requests, model_label, str(status), strategy_label), e2e)
        if known or model == "-":
            if len(self.finished) >= 1024:
                self.finished.clear()
            self.finished[key] = series
        return series

    def render(self, encoder: Callable[[Any], bytes] = generate_latest) -> bytes:
        """The registry in the text format, or what ``encoder`` writes (one of ``choose_encoder``'s)."""
        return encoder(self.registry)


def observe_all(hist, values: list[float]) -> None:
    """Observe every value on a histogram child, as ``observe`` would (a stream's inter-token gaps,
    at its end)."""
    many = getattr(hist, "observe_many", None)
    if many is not None:
        many(values)
        return
    for v in values:
        hist.observe(v)


# (metric name, help, how to read it off an Endpoint)
_ENDPOINT_GAUGES: tuple[tuple[str, str, Callable], ...] = (
    ("switchyard_endpoint_in_flight_requests", "Requests charged to each endpoint", lambda ep: ep.in_flight),
    ("switchyard_endpoint_ready", "1 if the endpoint receives new requests", lambda ep: 1 if ep.ready else 0),
    ("switchyard_pd_prefill_in_flight", "Prefill calls in progress (PrefillRequestTracker)",
     lambda ep: ep.prefill_in_flight),
    ("switchyard_pd_pending_decode", "Decodes chosen but not yet sent (PendingDecodeTracker)",
     lambda ep: ep.pending_decode),
    ("switchyard_pd_token_load_active_tokens", "Prompt tokens being prefilled (TokenLoadTracker)",
     lambda ep: ep.token_active),
    ("switchyard_pd_token_load_kv_tokens", "Prompt tokens whose KV is held for live requests (TokenLoadTracker)",
     lambda ep: ep.token_kv),
)


# The engines' own state as the scraper last read it (gateway/endpoints.py EngineMetrics): (metric
# name, help, field). A field the engine does not report is left out for that endpoint.
_ENGINE_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("switchyard_engine_running_requests", "Requests running on the engine (its /metrics, last scrape)", "running"),
    ("switchyard_engine_waiting_requests", "Requests queued on the engine (its /metrics, last scrape)", "waiting"),
    ("switchyard_engine_kv_cache_usage_ratio", "KV cache in use on the engine, 0..1 (its /metrics, last scrape)",
     "kv_usage"),
    ("switchyard_engine_prefix_cache_hit_ratio",
     "The engine's prefix-cache hit rate, 0..1 (vLLM: hits/queries between the last two scrapes; SGLang: its gauge)",
     "prefix_hit_rate"),
    ("switchyard_engine_generation_tokens_per_second",
     "Tokens the engine generated per second (between the last two scrapes, or its own gauge)", "gen_throughput"),
)


class LiveState(Collector):
    """In-flight, readiness and P/D tracker gauges, computed when ``/metrics`` is scraped.

    The counts already live on the endpoints (routers read them there); exporting them at scrape
    time instead of mirroring every change into prometheus gauges keeps the per-request path free
    of metric locks, and an endpoint removed by discovery simply disappears from the output.

    The engines' own running/waiting/KV figures are re-exported the same way from each endpoint's
    last scraped snapshot, so one Prometheus job (the gateway) shows what routing sees. A snapshot
    older than ``engine_max_age`` (``routing.metrics_max_age_s``: what routers treat as missing,
    read at each scrape, as a reload may change it) is left out rather than shown as current; its
    age stays visible.
    """

    def __init__(self, endpoints: Callable[[], Iterable], model_in_flight: dict[str, int],
                 prefix_stats: Callable[[], dict[str, int]] | None = None,
                 engine_max_age: float | Callable[[], float] = 10.0,
                 fleet_load: Callable[[Any], float] | None = None,
                 served: Callable[[str], bool] | None = None,
                 connections: Callable[[], tuple[int, int]] | None = None,
                 session_stats: Callable[[], dict[str, int]] | None = None) -> None:
        self._connections = connections
        self._session_stats = session_stats
        self._fleet_load = fleet_load
        self._served = served
        self._endpoints = endpoints
        self._model_in_flight = model_in_flight
        self._prefix_stats = prefix_stats
        self._engine_max_age = engine_max_age if callable(engine_max_age) else lambda: engine_max_age

    def collect(self):
        eps = list(self._endpoints())
        for name, doc, read in _ENDPOINT_GAUGES:
            fam = GaugeMetricFamily(name, doc, labels=["model", "endpoint"])
            for ep in eps:
                fam.add_metric([ep.model, ep.name], read(ep))
            yield fam
        if self._fleet_load is not None:     # what prefix-cache's load guards count (routing.prefix_load)
            fam = GaugeMetricFamily("switchyard_endpoint_fleet_in_flight",
                                    "Requests on each endpoint from every gateway, as the prefix-cache load guards "
                                    "estimate them (routing.prefix_load: fleet)", labels=["model", "endpoint"])
            for ep in eps:
                fam.add_metric([ep.model, ep.name], self._fleet_load(ep))
            yield fam
        info = GaugeMetricFamily("switchyard_endpoint_info", "1 for each endpoint, with its engine, role and roleset",
                                 labels=["model", "endpoint", "engine", "role", "roleset"])
        for ep in eps:
            info.add_metric([ep.model, ep.name, ep.engine, ep.role, ep.roleset or ""], 1)
        yield info
        yield from self._engine_state(eps)
        if self._connections is not None:
            busy, idle = self._connections()
            fam = GaugeMetricFamily("switchyard_upstream_connections",
                                    "Connections to the engines open in the upstream pool: busy (an exchange on it) "
                                    "or idle (kept for the next)", labels=["state"])
            fam.add_metric(["busy"], busy)
            fam.add_metric(["idle"], idle)
            yield fam
        fam = GaugeMetricFamily("switchyard_in_flight_requests", "Client requests in flight by model", labels=["model"])
        for model, n in list(self._model_in_flight.items()):
            if n or self._served is None or self._served(model):     # a removed model's goes with its last request
                fam.add_metric([model], n)
        yield fam
        stats = self._prefix_stats() if self._prefix_stats is not None else {}
        if stats:
            for key, doc in (("blocks", "Prompt blocks held by the prefix-cache index"),
                             ("capacity", "Most blocks the prefix-cache index may hold (routing.prefix_index_blocks)"),
                             ("entries", "Block-to-endpoint entries in the prefix-cache index")):
                if key in stats:
                    yield GaugeMetricFamily(f"switchyard_prefix_index_{key}", doc, value=stats[key])
            if "evictions" in stats:
                yield CounterMetricFamily("switchyard_prefix_index_evictions", "Blocks evicted from the prefix-cache index",
                                          value=stats["evictions"])
        if self._session_stats is not None:
            sessions = self._session_stats()
            yield GaugeMetricFamily("switchyard_session_map_entries",
                                    "Sessions and Responses lineage held by the session map", value=sessions["entries"])
            fam = CounterMetricFamily("switchyard_session_map_evictions",
                                      "Session map entries pushed out before their TTL: full (the least recently "
                                      "recorded, past routing.session_max_entries) or user_share (a user's own least "
                                      "recently recorded, past routing.session_user_share)", labels=["reason"])
            fam.add_metric(["full"], sessions["evictions"] - sessions["user_evictions"])
            fam.add_metric(["user_share"], sessions["user_evictions"])
            yield fam
        try:
            tasks = len(asyncio.all_tasks())
        except RuntimeError:          # rendered outside an event loop (unit tests)
            return
        yield GaugeMetricFamily("switchyard_event_loop_tasks", "asyncio tasks alive in this process", value=tasks)

    def _engine_state(self, eps: list):
        now = time.monotonic()
        snaps = [(ep, ep.metrics) for ep in eps if ep.metrics is not None]
        age = GaugeMetricFamily("switchyard_engine_metrics_age_seconds",
                                "Seconds since the engine's /metrics was last read successfully", labels=["model", "endpoint"])
        for ep, m in snaps:
            age.add_metric([ep.model, ep.name], max(0.0, now - m.scraped_at))
        yield age
        max_age = self._engine_max_age()
        fresh = [(ep, m) for ep, m in snaps if now - m.scraped_at <= max_age]
        for name, doc, field in _ENGINE_GAUGES:
            fam = GaugeMetricFamily(name, doc, labels=["model", "endpoint"])
            for ep, m in fresh:
                v = getattr(m, field)
                if v is not None:
                    fam.add_metric([ep.model, ep.name], v)
            yield fam


class RetiredSeries(Periodic):
    """Drops the metric series of an endpoint that left the pool (a pod deleted, a reload) once its
    last request ended and ``keep_s`` later, so a fleet whose pods come and go does not export, and
    hold, a series per pod it ever had (its breaker went when it left: ``Breakers.reset``). Until
    then a scrape still sees its last counts. An endpoint of the same name back in the pool (a pod
    changed in place) keeps the series. Swept every ``interval_s`` by a task of its own. The
    ``listeners`` are told of each endpoint let go, whatever its name: what is kept of the endpoint
    itself goes then (its latency models, ``gateway.view.service.RoutingView.endpoint_retired``)."""

    task_name = "switchyard-retired-series"

    def __init__(self, pool, metrics: GatewayMetrics, keep_s: float) -> None:
        self.pool = pool
        self.metrics = metrics
        self.keep_s = keep_s
        self.interval_s = min(30.0, max(0.2, keep_s / 4))
        self.listeners: list[Callable[[Any], None]] = []

    def sweep(self, now: float | None = None) -> int:
        """Let go of the endpoints whose time is up; how many."""
        retired = self.pool.retired
        if not retired:
            return 0
        now = time.monotonic() if now is None else now
        kept, done = [], 0
        # their series go in one walk, and each model's names are read once: a sweep may let go of
        # a whole namespace's pods, and one walk per endpoint made it O(endpoints x series)
        forget: set[tuple[str, str]] = set()
        live: dict[str, set[str]] = {}
        for ep, at in retired:
            if now - at < self.keep_s or ep.in_flight > 0:
                kept.append((ep, at))
                continue
            done += 1
            names = live.get(ep.model)
            if names is None:
                names = live[ep.model] = self.pool.live_names(ep.model)
            if ep.name not in names:
                forget.add((ep.model, ep.name))
            for listener in self.listeners:
                listener(ep)
        if forget:
            self.metrics.forget_endpoints(forget)
        retired[:] = kept
        return done

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.sweep()
