"""How many more requests an endpoint can take before it is saturated (pure; no I/O).

Three signals, each with its threshold (``admission:`` in the config):

- **the engine's queue**, estimated now rather than read as last scraped. A scrape says the engine
  ran ``R`` requests with ``W`` waiting while this gateway had ``F0`` requests on it; since then
  the gateway's count moved to ``F``. Once the engine has been seen queueing, its running count at
  that moment is its capacity ``C`` (running slots, whatever limits them: ``max_num_seqs`` or KV
  space), and the queue now is ``R + W + (F - F0) - C``: every request sent since the scrape lands
  in the queue or a free slot, every one finished pulls a waiting one into a slot. Negative means
  free slots. Until the engine has been seen queueing ``C`` is unknown and ``W`` counts as is.
  The endpoint is saturated when the estimate would pass ``max_waiting_per_endpoint``.
- **KV-cache usage** as last scraped, saturated at or above ``max_kv_usage``.
- **this gateway's in-flight count** on it, saturated at ``max_in_flight_per_endpoint`` (0: no cap).
  It needs no scrape, so it also works with ``scrape.enabled: false``.

With ``--workers N`` each worker sees only its own requests, so the room a threshold leaves is
shared: a worker's room is ``1/N`` of it, less what it used itself. For the engine's queue that is
``(max_waiting - (R + W - C)) / N - (F - F0)``, for the in-flight cap ``max_in_flight / N - F``:
added over the workers, the gateway's room, as one process would have (docs/tenancy.md).

Engine metrics older than ``metrics_max_age_s`` (or none yet) make the endpoint saturated: a
silent engine is not an idle one (fail closed, as llm-d's saturation detector does).

So a request that finishes frees room at once (``F`` drops), a scrape re-bases the estimate, and
nothing here needs a timer: the queue is pumped on exactly those two events.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.endpoints import Endpoint, EngineMetrics

UNBOUNDED = 1 << 30          # the headroom of an endpoint no threshold limits
_KEY = "admission_baseline"  # where an endpoint keeps its Baseline (Endpoint.extra)


@dataclass(frozen=True, slots=True)
class Thresholds:
    max_waiting: int = 5
    max_kv: float = 0.8
    max_in_flight: int = 0
    max_age: float = 5.0
    engine_signals: bool = True          # scrape.enabled: read the engines' own figures
    workers: int = 1                     # --workers: each worker has 1/workers of the room


@dataclass(slots=True)
class Baseline:
    """What an endpoint looked like at its last scrape, from the gateway's side."""

    snapshot: EngineMetrics | None = None
    in_flight: int = 0                   # the gateway's load on it when the snapshot arrived
    capacity: float | None = None        # running slots: the engine's running count when it last queued


@dataclass(frozen=True, slots=True)
class Estimate:
    headroom: int                        # requests it can take now (UNBOUNDED: no limit applies)
    waiting: float | None = None         # the engine's estimated queue (negative: free slots)
    reason: str | None = None            # what saturates it: stale | waiting | kv | in_flight

    @property
    def saturated(self) -> bool:
        return self.headroom < 1


def gateway_load(ep: Endpoint) -> int:
    """This gateway's requests on ``ep``: whole requests or decodes, and prefill calls."""
    return ep.in_flight + ep.prefill_in_flight


def baseline(ep: Endpoint) -> Baseline:
    """The endpoint's baseline, re-based if a new snapshot arrived since it was last read."""
    b = ep.extra.get(_KEY)
    if b is None:
        b = ep.extra[_KEY] = Baseline()
    m = ep.metrics
    if m is not b.snapshot:
        b.snapshot = m
        b.in_flight = gateway_load(ep)
        if m is not None and m.running is not None:
            if (m.waiting or 0) > 0:
                b.capacity = m.running
            elif b.capacity is not None and m.running > b.capacity:
                b.capacity = m.running
    return b


def estimate(ep: Endpoint, th: Thresholds, now: float) -> Estimate:
    load = gateway_load(ep)
    room: float = math.inf
    reason: str | None = None
    waiting: float | None = None
    if th.max_in_flight:
        room, reason = (th.max_in_flight if th.workers == 1 else th.max_in_flight / th.workers) - load, "in_flight"
    if th.engine_signals:
        b = baseline(ep)
        m = b.snapshot
        if m is None or now - m.scraped_at > th.max_age:
            return Estimate(0, None, "stale")
        if m.waiting is not None:
            waiting = m.waiting if b.capacity is None else (m.running or 0) + m.waiting + load - b.in_flight - b.capacity
            if th.workers == 1:
                r = th.max_waiting - waiting
            else:       # the engine's queue at the scrape is everyone's; what was sent since, this worker's
                sent = 0 if b.capacity is None else load - b.in_flight
                r = (th.max_waiting - (waiting - sent)) / th.workers - sent
            if r < room:
                room, reason = r, "waiting"
        if m.kv_usage is not None and m.kv_usage >= th.max_kv:
            room, reason = 0, "kv"
    if room == math.inf:
        return Estimate(UNBOUNDED, waiting)
    headroom = max(0, math.floor(room))
    return Estimate(headroom, waiting, reason if headroom < 1 else None)


def total_headroom(eps: Sequence[Endpoint], pairs: bool, th: Thresholds, now: float) -> int:
    """What a model's candidates can take. For prefill/decode pairs each request needs a slot on
    both sides: the smaller side's headroom (combined endpoints count on both)."""
    if not pairs:
        return min(UNBOUNDED, sum(estimate(ep, th, now).headroom for ep in eps))
    sides = {"prefill": 0, "decode": 0, "combined": 0}
    for ep in eps:
        if ep.role in sides:
            sides[ep.role] = min(UNBOUNDED, sides[ep.role] + estimate(ep, th, now).headroom)
    if not sides["prefill"] and not sides["decode"]:
        return sides["combined"]
    return min(UNBOUNDED, min(sides["prefill"], sides["decode"]) + sides["combined"])


def unsaturated(eps: list[Endpoint], th: Thresholds, now: float) -> list[Endpoint]:
    """The candidates with room; all of them when none has (a granted request goes anyway)."""
    out = [ep for ep in eps if not estimate(ep, th, now).saturated]
    return out or eps
