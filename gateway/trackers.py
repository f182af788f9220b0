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
on the ``Endpoint`` (routers read them) and are exported as gauges at scrape time.
"""

from __future__ import annotations

from gateway.endpoints import Endpoint


class Charge:
    __slots__ = ("_ep", "_attr", "_amount", "released")

    def __init__(self, ep: Endpoint, attr: str, amount: float) -> None:
        self._ep, self._attr, self._amount = ep, attr, amount
        self.released = False
        setattr(ep, attr, getattr(ep, attr) + amount)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        setattr(self._ep, self._attr, max(0, getattr(self._ep, self._attr) - self._amount))


class PDTrackers:
    """The three trackers. Their counts are exported by ``gateway.metrics.LiveState``."""

    def prefill(self, ep: Endpoint) -> Charge:
        """PrefillRequestTracker."""
        return Charge(ep, "prefill_in_flight", 1)

    def pending_decode(self, ep: Endpoint) -> Charge:
        """PendingDecodeTracker."""
        return Charge(ep, "pending_decode", 1)

    def token_load(self, ep: Endpoint, tokens: float) -> tuple[Charge, Charge]:
        """TokenLoadTracker: (active, kv) charges of ``tokens`` each."""
        return Charge(ep, "token_active", tokens), Charge(ep, "token_kv", tokens)
