"""P/D trackers: what this gateway has put on each endpoint and not yet taken back.

- ``PrefillRequestTracker``: prefill calls in progress per prefill endpoint (released when the
  prefill HTTP call ends, whatever its outcome).
- ``PendingDecodeTracker``: decodes chosen for a decode endpoint whose leg has not started yet
  (released when the decode request is sent, or when the request ends first). It bridges the gap
  before the engine's own running count can move.
- ``TokenLoadTracker``: prompt tokens per prefill endpoint, "active" while the prefill runs and
  "kv" while the request lives (its KV is resident). Priority = active + kv_weight · kv.

Every charge is taken in the same synchronous step as the routing decision and returns a
``Charge`` whose ``release`` is idempotent, so every path (success, prefill failure, decode
failure, watchdog, client disconnect) may release and only the first call counts. Counts live
on the ``Endpoint`` (routers read them) and are exported as gauges.
"""

from __future__ import annotations

from gateway.endpoints import Endpoint
from gateway.metrics import GatewayMetrics


class Charge:
    __slots__ = ("_ep", "_attr", "_amount", "_gauge", "released")

    def __init__(self, ep: Endpoint, attr: str, amount: float, gauge) -> None:
        self._ep, self._attr, self._amount, self._gauge = ep, attr, amount, gauge
        self.released = False
        setattr(ep, attr, getattr(ep, attr) + amount)
        gauge.inc(amount)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        setattr(self._ep, self._attr, max(0, getattr(self._ep, self._attr) - self._amount))
        self._gauge.dec(self._amount)


class PDTrackers:
    """The three trackers over one metrics registry."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def _gauge(self, metric, ep: Endpoint):
        return self.metrics.child(metric, ep.model, ep.name)

    def prefill(self, ep: Endpoint) -> Charge:
        """PrefillRequestTracker."""
        return Charge(ep, "prefill_in_flight", 1, self._gauge(self.metrics.pd_prefill_in_flight, ep))

    def pending_decode(self, ep: Endpoint) -> Charge:
        """PendingDecodeTracker."""
        return Charge(ep, "pending_decode", 1, self._gauge(self.metrics.pd_pending_decode, ep))

    def token_load(self, ep: Endpoint, tokens: float) -> tuple[Charge, Charge]:
        """TokenLoadTracker: (active, kv) charges of ``tokens`` each."""
        return (Charge(ep, "token_active", tokens, self._gauge(self.metrics.pd_token_active, ep)),
                Charge(ep, "token_kv", tokens, self._gauge(self.metrics.pd_token_kv, ep)))
