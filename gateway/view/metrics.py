"""The shared view's metrics: messages sent, received, applied and dropped, the lag, Redis's state.

``source`` is ``worker`` (the local bus between the workers of one gateway) or ``replica`` (the
Redis stream between replicas). The lag of a message is its receiver's wall clock at arrival minus
its sender's at sending: ``switchyard_view_lag_seconds`` (histogram) and, for the last
``LAG_WINDOW`` messages of each source, ``switchyard_view_lag_recent_seconds{percentile}`` (50, 99).
"""

from __future__ import annotations

from array import array

from prometheus_client.core import GaugeMetricFamily

from gateway.observability.metrics import Counter, GatewayMetrics, Histogram

LAG_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
               0.5, 1.0, 2.5, 5.0)
LAG_WINDOW = 4096
SOURCES = ("worker", "replica")


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``values`` (nearest rank)."""
    return values[min(len(values) - 1, int(q * len(values)))]


class Window:
    """The last ``size`` samples, in a ring of C doubles.

    Not a deque of floats: a sample arrives with every batch (every ``view.flush_delay_s`` during a
    burst), and the float objects a deque keeps were allocated among the burst's own objects, one
    here and one there. Each kept one holds its whole allocator arena mapped once the burst is
    over, which a worker's memory reclaim cannot give back (about 20 MB a worker after 4,000 idle
    streams). Doubles in one array hold nothing else."""

    __slots__ = ("buf", "n", "i")

    def __init__(self, size: int) -> None:
        self.buf = array("d", bytes(8 * size))
        self.n = 0      # samples held
        self.i = 0      # where the next one goes

    def append(self, x: float) -> None:
        buf = self.buf
        buf[self.i] = x
        self.i = (self.i + 1) % len(buf)
        if self.n < len(buf):
            self.n += 1

    def __len__(self) -> int:
        return self.n

    def values(self) -> list[float]:
        """The samples held, in no particular order."""
        return self.buf[:self.n].tolist()


class ViewMetrics:
    def __init__(self, metrics: GatewayMetrics) -> None:
        r = metrics.registry
        self.gm = metrics
        self.sent = Counter("switchyard_view_messages_sent",
                            "Batches of routing facts sent to the other workers (one per sibling) or to Redis",
                            ["source"], registry=r)
        self.received = Counter("switchyard_view_messages_received",
                                "Batches of routing facts received from the other workers or replicas", ["source"],
                                registry=r)
        self.dropped = Counter("switchyard_view_messages_dropped",
                               "Batches or facts lost: peer_full / peer_down / error (a sibling's socket), "
                               "undecodable, redis_down / outbox_full (facts waiting for Redis), too_large (a tokenized "
                               "segment beyond view.max_datagram_bytes, not shared, or a message larger than a "
                               "sibling worker reads)",
                               ["source", "reason"], registry=r)
        self.applied = Counter("switchyard_view_facts_applied",
                               "Facts from other processes applied to this one's view (insert: a prefix-index "
                               "insertion; session; load: one sibling's in-flight counts; breaker: a sibling's ejection or "
                               "close adopted; tokens: a sibling's tokenized "
                               "prompt segment new to this worker; preempt: a batch line stopped for a sibling's "
                               "interactive request; queued: a sibling's list of the models its admission queue holds requests "
                               "of; batches: a sibling's Batch API created or cancelled a batch; unknown_endpoint: "
                               "naming an endpoint this process does not have, skipped)",
                               ["source", "kind"], registry=r)
        self.catch_ups = Counter("switchyard_view_catch_ups",
                                 "A worker asked a sibling for its whole view (sessions, prefix index): reason start (it "
                                 "started) or gap (it missed batches of the sibling's insertions, sessions or breakers); result "
                                 "applied, or failed (no answer in time)",
                                 ["reason", "result"], registry=r)
        self.lag = Histogram("switchyard_view_lag_seconds",
                             "Time from a routing fact's sending to its arrival in this process (wall clocks)",
                             ["source"], registry=r, buckets=LAG_BUCKETS)
        self.redis_lost = Counter("switchyard_view_redis_lost",
                                  "Times the Redis stream of the shared view was lost (the local view goes on)",
                                  registry=r)
        self.sessions = Counter("switchyard_routing_session",
                                "prefix-cache requests whose session had an endpoint: kept (routed there), "
                                "overloaded (the load guards refused it), gone (not a ready candidate)",
                                ["model", "outcome"], registry=r)
        self.redis_up = 0.0
        self.peers = 0
        self.recent: dict[str, Window] = {s: Window(LAG_WINDOW) for s in SOURCES}
        r.register(_LagCollector(self))

    def observe_lag(self, source: str, seconds: float) -> None:
        self.gm.child(self.lag, source).observe(seconds)
        self.recent[source].append(seconds)

    def lag_quantiles(self, source: str) -> dict[str, float] | None:
        values = sorted(self.recent[source].values())
        if not values:
            return None
        return {"p50": quantile(values, 0.5), "p99": quantile(values, 0.99), "samples": float(len(values))}

    def session(self, model: str, outcome: str) -> None:
        self.gm.child(self.sessions, model, outcome).inc()


class _LagCollector:
    """Gauges read at scrape time: the recent lag's quantiles, Redis's state, siblings heard."""

    def __init__(self, m: ViewMetrics) -> None:
        self.m = m

    def describe(self):
        return []

    def collect(self):
        # not a "quantile" label: Prometheus reserves it to summaries (promtool check metrics)
        q = GaugeMetricFamily("switchyard_view_lag_recent_seconds",
                              f"Percentiles of the lag of the last {LAG_WINDOW} routing-fact batches received",
                              labels=["source", "percentile"])
        for source in SOURCES:
            found = self.m.lag_quantiles(source)
            if found is not None:
                q.add_metric([source, "50"], found["p50"])
                q.add_metric([source, "99"], found["p99"])
        yield q
        yield GaugeMetricFamily("switchyard_view_redis_up",
                                "1 while the shared view's Redis stream is reachable (0: down or not used)",
                                value=self.m.redis_up)
        yield GaugeMetricFamily("switchyard_view_peers", "Sibling workers whose in-flight counts this worker holds (heard within view.peer_ttl_s; a "
                                "sibling with nothing in flight says so once and drops out)",
                                value=self.m.peers)
