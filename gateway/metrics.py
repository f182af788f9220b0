"""The gateway's own Prometheus metrics, in a registry owned by the app (no global state).

Label lookups in prometheus-client cost a dict lookup plus lock; children used per request are
cached in plain dicts keyed by label tuples so the hot path pays one dict lookup each.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
ROUTING_BUCKETS = (0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                   0.01, 0.025, 0.05)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("switchyard_requests", "Client requests by final HTTP status",
                                ["model", "status", "strategy"], registry=r)
        self.in_flight = Gauge("switchyard_in_flight_requests", "Client requests in flight by model",
                               ["model"], registry=r)
        self.endpoint_in_flight = Gauge("switchyard_endpoint_in_flight_requests",
                                        "Requests charged to each endpoint", ["model", "endpoint"], registry=r)
        self.endpoint_ready = Gauge("switchyard_endpoint_ready", "1 if the endpoint receives new requests",
                                    ["model", "endpoint"], registry=r)
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
        self.client_cancels = Counter("switchyard_client_cancels",
                                      "Requests whose client went away before the end", ["model", "stage"],
                                      registry=r)
        self.routing_fallbacks = Counter("switchyard_routing_fallbacks",
                                         "Strategy decisions made without the strategy's signal",
                                         ["strategy", "reason"], registry=r)
        self.health_probes = Counter("switchyard_health_probes", "Active health probes by result",
                                     ["model", "endpoint", "result"], registry=r)
        self.scrapes = Counter("switchyard_engine_scrapes", "Engine /metrics scrapes by result",
                               ["model", "endpoint", "result"], registry=r)
        # P/D
        ep_labels = ["model", "endpoint"]
        self.pd_prefill_in_flight = Gauge("switchyard_pd_prefill_in_flight",
                                          "Prefill calls in progress (PrefillRequestTracker)", ep_labels, registry=r)
        self.pd_pending_decode = Gauge("switchyard_pd_pending_decode",
                                       "Decodes chosen but not yet sent (PendingDecodeTracker)", ep_labels, registry=r)
        self.pd_token_active = Gauge("switchyard_pd_token_load_active_tokens",
                                     "Prompt tokens being prefilled (TokenLoadTracker)", ep_labels, registry=r)
        self.pd_token_kv = Gauge("switchyard_pd_token_load_kv_tokens",
                                 "Prompt tokens whose KV is held for live requests (TokenLoadTracker)",
                                 ep_labels, registry=r)
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
        self.watchdog_fires = Counter("switchyard_watchdog_fires", "Decode watchdog fires by phase",
                                      ["model", "phase"], registry=r)
        self.pd_aborts = Counter("switchyard_pd_aborts", "Abort calls sent to engines, by result",
                                 ["model", "result"], registry=r)
        self._children: dict[tuple, object] = {}

    def child(self, metric, *labels: str):
        """A cached labelled child: one dict lookup on the hot path."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def render(self) -> bytes:
        return generate_latest(self.registry)
