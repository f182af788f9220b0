"""Discovery's metrics: how its list and watch requests end, when it last heard from the API
server, and the pods it holds.

- ``switchyard_kubernetes_requests_total{verb, result}``: ``verb`` is ``list`` or ``watch``;
  ``result`` is one of ``RESULTS`` (a watch's ``ok`` is its server-side end, ``idle`` one given up
  after ``watch_idle_timeout_s`` of silence). A watch still open is not counted yet.
- ``switchyard_kubernetes_last_sync_timestamp_seconds{watched_namespace}``: the wall time of the
  last successful list, watch event or bookmark, or clean end of a watch, per watched namespace
  (``*``: all of them); 0 until the first list. An alert on ``time() - ...`` finds a discovery
  that fails for good, whatever the reason, or whose watch is stuck.
- ``switchyard_kubernetes_pods{model, state}``: the pods in the pool by model, ``routable`` or
  ``not_routable`` (not ready, terminating); ``switchyard_kubernetes_pods_skipped``: the selected
  pods the gateway does not route to at all (an engine it does not know, a pod that is not a
  leader, labels it cannot read), and the items of each namespace's last list that name no pod.
- ``switchyard_kubernetes_watch_events_skipped_total{watched_namespace}``: watch events whose
  object names no pod (no metadata, no name or namespace, not an object), skipped; the relist
  that reads what they would have said follows ``retry_backoff_s`` later; and bookmarks whose
  resourceVersion cannot be read, skipped with no relist (a bookmark tells of no change).

The labels are bounded: two verbs, the results below, the namespaces of the config, and the models
of the pods (as every per-model series is).
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable, Iterable
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from gateway.observability.metrics import Counter

RESULTS = ("ok", "idle", "gone", "unauthorized", "forbidden", "throttled", "client_error", "server_error",
           "connect", "tls", "timeout", "disconnected", "error")


def status_result(status: int) -> str:
    """The ``result`` of an API answer with HTTP ``status`` (0: no status, a line not understood)."""
    if status == 401:
        return "unauthorized"
    if status == 403:
        return "forbidden"
    if status == 410:
        return "gone"
    if status == 429:
        return "throttled"
    if 400 <= status < 500:
        return "client_error"
    if status >= 500:
        return "server_error"
    return "error"


def transport_result(e: BaseException) -> str:
    """The ``result`` of a request that got no answer: ``tls`` (the TLS handshake failed: a
    certificate the client does not trust, a server that speaks no TLS), ``connect`` (refused, no
    route, DNS), ``timeout``, ``disconnected`` (the connection broke while the answer came), else
    ``error``."""
    if isinstance(e, aiohttp.ClientSSLError | ssl.SSLError):
        return "tls"
    if isinstance(e, aiohttp.ClientConnectorError):
        return "connect"
    if isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(e, aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError | aiohttp.ClientOSError
                  | ConnectionError):
        return "disconnected"
    return "error"


class DiscoveryMetrics:
    def __init__(self, registry: CollectorRegistry | None, scopes: Iterable[str | None],
                 pods: Callable[[], tuple[dict[tuple[str, str], int], int]]) -> None:
        self.requests = Counter("switchyard_kubernetes_requests",
                                "List and watch requests of Kubernetes discovery to the API server, by verb (list, "
                                "watch) and how they ended (ok; idle: a watch silent for watch_idle_timeout_s; gone: "
                                "410; unauthorized, forbidden, throttled, client_error, server_error: the API's "
                                "answer; connect, tls, timeout, disconnected: no answer; error: anything else)",
                                ["verb", "result"], registry=registry)
        self.skipped_events = Counter("switchyard_kubernetes_watch_events_skipped",
                                      "Watch events whose object names no pod (no metadata, no name or namespace, "
                                      "not an object), skipped, per watched namespace (* for all); a relist follows. "
                                      "Also bookmarks whose resourceVersion cannot be read (no relist)",
                                      ["watched_namespace"], registry=registry)
        self.last_sync: dict[str, float] = {_scope(s): 0.0 for s in scopes}
        self._skipped = {scope: self.skipped_events.labels(scope) for scope in self.last_sync}
        self._pods = pods
        self._children = {(verb, result): self.requests.labels(verb, result)
                          for verb in ("list", "watch") for result in RESULTS}
        if registry is not None:
            registry.register(_Gauges(self))

    def ended(self, verb: str, result: str) -> None:
        self._children[(verb, result)].inc()

    def skipped_event(self, scope: str | None) -> None:
        self._skipped[_scope(scope)].inc()

    def counts(self) -> list[list[Any]]:
        """The requests counted so far, as ``[verb, result, count]`` (none of the zeros)."""
        return [[verb, result, int(c.value)] for (verb, result), c in self._children.items() if c.value]

    def heard(self, scope: str | None) -> None:
        self.last_sync[_scope(scope)] = time.time()


def _scope(scope: str | None) -> str:
    return scope or "*"


class _Gauges:
    """Read at scrape time from the discovery that holds them."""

    def __init__(self, m: DiscoveryMetrics) -> None:
        self.m = m

    def describe(self):
        return []

    def collect(self):
        sync = GaugeMetricFamily("switchyard_kubernetes_last_sync_timestamp_seconds",
                                 "Unix time discovery last heard from the API server for a watched namespace (* for "
                                 "all): a successful list, a watch event or bookmark, a watch's clean end; 0 before "
                                 "the first list", labels=["watched_namespace"])
        for scope, t in self.m.last_sync.items():
            sync.add_metric([scope], t)
        yield sync
        counts, skipped = self.m._pods()
        pods = GaugeMetricFamily("switchyard_kubernetes_pods",
                                 "Pods discovery holds in the pool, by model and state (routable; not_routable: not "
                                 "ready, terminating)", labels=["model", "state"])
        for (model, state), n in sorted(counts.items()):
            pods.add_metric([model, state], n)
        yield pods
        yield GaugeMetricFamily("switchyard_kubernetes_pods_skipped",
                                "Pods the label selector matches that discovery does not route to (an engine it "
                                "does not know, not a group's leader, labels it cannot read, a list item that names no pod)",
                                value=skipped)
