"""The ledger: what a request has put on endpoints, released exactly once on every path.

Routers read the load counters on each ``Endpoint`` (``in_flight``, ``prefill_in_flight``,
``pending_decode``, ``token_active``, ``token_kv``). A ``Charge`` adds to one of them when it is
taken and takes the same amount back on ``release``, which is idempotent: every exit path may
release, only the first call counts. Charges are taken in the same synchronous step as the
routing decision (no ``await`` between select and charge), so concurrent requests always see
each other's load.

Each counter has its own small ``Charge`` subclass, so a reader (and a type checker) sees which
field a charge moves. The P/D trackers of AIBrix map onto them:

- ``PrefillInFlight`` (PrefillRequestTracker): prefill calls in progress, released when the
  prefill call ends, whatever its outcome;
- ``PendingDecode`` (PendingDecodeTracker): decodes chosen for an endpoint whose leg has not
  started yet; it bridges the gap before the engine's own running count can move;
- ``TokenActive`` / ``TokenKV`` (TokenLoadTracker): prompt tokens per prefill endpoint, "active"
  while the prefill runs and "kv" while the request lives (its KV is resident).

The counts are exported as gauges at scrape time (``gateway.observability.metrics``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter

from gateway.endpoints import Endpoint


class Charge:
    __slots__ = ("endpoint", "amount", "released")

    def __init__(self, endpoint: Endpoint, amount: float = 1) -> None:
        self.endpoint = endpoint
        self.amount = amount
        self.released = False
        self._add(endpoint, amount)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._add(self.endpoint, -self.amount)

    @staticmethod
    def _add(ep: Endpoint, amount: float) -> None:
        raise NotImplementedError


class InFlight(Charge):
    """Every request's charge: taken and given back in place, without ``_add``'s call."""

    __slots__ = ()

    def __init__(self, endpoint: Endpoint, amount: float = 1) -> None:
        self.endpoint = endpoint
        self.amount = amount
        self.released = False
        endpoint.in_flight += int(amount)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        ep = self.endpoint
        ep.in_flight += int(-self.amount)
        while (ep := ep.successor) is not None:    # a reload declared its engine anew: counted there too
            ep.in_flight += int(-self.amount)

    @staticmethod
    def _add(ep: Endpoint, amount: float) -> None:
        ep.in_flight += int(amount)


class Carried(Charge):
    """A P/D tracker's charge: given back also on the endpoints a reload put in its endpoint's
    place (``successor``), which took over what it held (``EndpointPool.succeeded``)."""

    __slots__ = ()

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        ep: Endpoint | None = self.endpoint
        while ep is not None:
            self._add(ep, -self.amount)
            ep = ep.successor


class PrefillInFlight(Carried):
    __slots__ = ()

    @staticmethod
    def _add(ep: Endpoint, amount: float) -> None:
        ep.prefill_in_flight += int(amount)


class PendingDecode(Carried):
    __slots__ = ()

    @staticmethod
    def _add(ep: Endpoint, amount: float) -> None:
        ep.pending_decode += int(amount)


class TokenActive(Carried):
    __slots__ = ()

    @staticmethod
    def _add(ep: Endpoint, amount: float) -> None:
        ep.token_active = max(0.0, ep.token_active + amount)


class TokenKV(Carried):
    __slots__ = ()

    @staticmethod
    def _add(ep: Endpoint, amount: float) -> None:
        ep.token_kv = max(0.0, ep.token_kv + amount)


class AdapterInFlight(Charge):
    """This gateway's requests for one LoRA adapter on an endpoint (``AdapterState.in_flight``).
    ``told``, when given, is called with the endpoint when the count there goes from 0 to 1 or back to 0 (the
    sibling workers learn which adapters this one has in flight: gateway/lora/adapters.py)."""

    __slots__ = ("adapter", "told")

    def __init__(self, endpoint: Endpoint, adapter: str, told: Callable[[Endpoint], None] | None = None) -> None:
        self.adapter = adapter
        self.told = told
        super().__init__(endpoint)

    def _add(self, ep: Endpoint, amount: float) -> None:  # type: ignore[override]
        counts = ep.adapters.in_flight
        n = counts.get(self.adapter, 0) + int(amount)
        if n > 0:
            counts[self.adapter] = n
            if n == 1 and amount > 0 and self.told is not None:
                self.told(ep)
        elif counts.pop(self.adapter, None) is not None and self.told is not None:
            self.told(ep)


class RankInFlight(Charge):
    """This gateway's requests pinned to one data-parallel rank of an endpoint (``gateway.kv.dp_rank``):
    ``counts`` is the endpoint's per-rank list in the event index."""

    __slots__ = ("counts", "rank")

    def __init__(self, endpoint: Endpoint, counts: list[int], rank: int) -> None:
        self.counts = counts
        self.rank = rank
        super().__init__(endpoint)

    def _add(self, ep: Endpoint, amount: float) -> None:  # type: ignore[override]
        self.counts[self.rank] += int(amount)


@dataclass(slots=True, eq=False)
class Charges:
    """Every charge of one request. The P/D orchestration releases the prefill-side ones early
    (when the prefill ends, when the decode leg starts); ``release`` takes back whatever is left."""

    in_flight: Charge | None = None
    prefill: Charge | None = None
    pending_decode: Charge | None = None
    token_active: Charge | None = None
    token_kv: Charge | None = None
    adapter: AdapterInFlight | None = None     # a LoRA adapter's request (gateway/lora/adapters.py)
    rank: RankInFlight | None = None           # the data-parallel rank it was pinned to (gateway/kv/dp_rank.py)

    def prefill_done(self) -> None:
        """The prefill call ended: its in-flight count and its active tokens go back."""
        for c in (self.prefill, self.token_active):
            if c is not None:
                c.release()

    def decode_started(self) -> None:
        if self.pending_decode is not None:
            self.pending_decode.release()

    def move_in_flight(self, ep: Endpoint) -> None:
        """A retry elsewhere: the failed endpoint's in-flight charge goes back, the new one is taken."""
        if self.in_flight is not None:
            self.in_flight.release()
        self.in_flight = InFlight(ep)
        if self.adapter is not None:
            self.adapter.release()
            self.adapter = AdapterInFlight(ep, self.adapter.adapter)

    def release(self) -> None:
        if self.in_flight is not None:
            self.in_flight.release()
        others = _OTHERS(self)          # read in C
        if others == _NONE:
            return                      # an aggregated request's one charge (the usual case)
        for c in others:
            if c is not None:
                c.release()


# a request's charges besides its in-flight one, in the order they are given back
_OTHERS = attrgetter("prefill", "pending_decode", "token_active", "token_kv", "adapter", "rank")
_NONE = (None,) * 6

NO_CHARGES = Charges()      # a request's charges before it is routed: none (never mutated; routing replaces it)


def charge(endpoint: Endpoint, prefill: Endpoint | None = None, prefill_tokens: float = 0.0) -> Charges:
    """The charges of a routing decision: in-flight on the endpoint that answers and, for a P/D
    pair, the three trackers on the prefill and decode endpoints."""
    if prefill is None:
        return Charges(in_flight=InFlight(endpoint))
    return Charges(in_flight=InFlight(endpoint), prefill=PrefillInFlight(prefill),
                   pending_decode=PendingDecode(endpoint), token_active=TokenActive(prefill, prefill_tokens),
                   token_kv=TokenKV(prefill, prefill_tokens))
