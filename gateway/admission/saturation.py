"""How many more requests an endpoint can take before it is saturated (pure; no I/O).

Three signals, each with its threshold (``admission:`` in the config):

- **the engine's queue**, estimated now rather than read as last scraped. A scrape says the engine
  ran ``R`` requests with ``W`` waiting while this gateway had ``F0`` requests on it; since then
  the gateway's count moved to ``F``. With ``C`` the engine's capacity (running slots, whatever
  limits them: ``max_num_seqs`` or KV space) the queue now is ``R + W + (F - F0) - C``: every
  request sent since the scrape lands in the queue or a free slot, every one finished pulls a
  waiting one into a slot. Negative means free slots. The engine holds at least this gateway's
  own ``F`` (a request sent just before a scrape may reach it after it counted), so the occupancy
  is ``max(R + W + F - F0, F)``. The endpoint is saturated for a class when the estimate would
  pass that class's share of ``max_waiting_per_endpoint``.
- **KV-cache usage** as last scraped, saturated at or above ``max_kv_usage``.
- **this gateway's in-flight count** on it, saturated at ``max_in_flight_per_endpoint`` (0: no cap).
  It needs no scrape, so it also works with ``scrape.enabled: false``.

``C``, in order of trust (``Baseline.source``):

- ``queued``: the engine has been seen queueing: its running count then is its capacity (raised
  if it is later seen running more);
- ``told``: the engine tells its running cap (SGLang's ``sglang:max_running_requests``);
- ``slow_start``: neither yet (vLLM exports no ``max_num_seqs``; its KV pool size only bounds the
  cap from above, so it cannot stand for it). A *window* stands for ``C``: ``initial_capacity``
  at first, raised only to what the engine has shown it runs at once — the running count of a
  scrape with nobody waiting, and the engine's count when a request went beyond the window whose
  TTFT held (at most twice the best TTFT of the requests that went within it, or 50 ms above: it
  did not queue). So the window
  never passes the real capacity, and the engine's queue never passes ``max_waiting_per_endpoint``
  plus what was already on it at the first scrape, before the capacity is known — no flood.

With ``--workers N`` each worker sees only its own requests, so the room a threshold leaves is
shared: a worker's room is its share of it, less what it used itself. For the engine's queue that
is ``share(max_waiting - (R + W - C - (F - F0))) - (F - F0)``, for the in-flight cap
``share(max_in_flight) - F``. A share is whole: the room's ``T`` slots are dealt out as
``(T + k) // N`` with ``k`` this worker's turn on the endpoint, so the shares add up to exactly
``T``, the gateway's room as one process would have it (docs/tenancy.md), and a room smaller than
``N`` is not cut into fractions that each round down to nothing (a ``max_waiting`` of 1 over two
workers left the engine's queue empty, its slots idle between scrapes). Which worker gets a
remainder goes round the workers from endpoint to endpoint, in the order of their URLs.

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
    workers: int = 1                     # --workers: each worker has its share of the room
    index: int = 0                       # this worker's index among them
    initial_capacity: int = 1            # the slow-start window before the capacity is known


# a request's TTFT "held" (it did not queue in the engine) within this of the best seen there
TTFT_HELD_FACTOR = 2.0
TTFT_HELD_SLACK_S = 0.05


@dataclass(slots=True)
class Baseline:
    """What an endpoint looked like at its last scrape, from the gateway's side, and what is known
    of its capacity."""

    snapshot: EngineMetrics | None = None
    in_flight: int = 0                   # the gateway's load on it when the snapshot arrived
    capacity: float | None = None        # running slots: told by the engine, or its running count when it queued
    source: str = "slow_start"           # where ``capacity`` comes from: queued | told | slow_start
    window: float = 0.0                  # slow start: the concurrency the engine has shown it runs
    best_ttft: float = math.inf          # the best engine-side TTFT seen on it (seconds)

    def cap(self, th: Thresholds) -> float:
        """The capacity the queue estimate subtracts: known, else the slow-start window."""
        if self.capacity is not None:
            return self.capacity
        return max(float(th.initial_capacity), self.window)

    def occupancy(self, load: int) -> float | None:
        """The engine's requests now, running or waiting, as estimated from the last scrape, and
        never fewer than this gateway's own ``load`` on it: a request sent just before a scrape
        can reach the engine after it counted, so the scrape's ``R + W`` leaves it out while the
        gateway's count at the scrape has it (the estimate would be one short, one request too many
        would go)."""
        m = self.snapshot
        if m is None or m.waiting is None:
            return None
        est = (m.running or 0) + m.waiting + load - self.in_flight
        return est if est >= load else load

    def ttft_held(self, ttft: float, occupancy: float | None, th: Thresholds) -> bool:
        """A request that went at ``occupancy`` got its first token after ``ttft`` seconds on the
        engine. One that went within the assumed capacity did not queue: its TTFT is a reference.
        One that went beyond it and still got about the best reference TTFT did not queue either,
        so the engine ran that many at once: the window rises to it."""
        if occupancy is None:
            return False
        if occupancy <= self.cap(th):
            self.best_ttft = min(self.best_ttft, ttft)
        best = self.best_ttft
        held = best < math.inf and ttft <= max(TTFT_HELD_FACTOR * best, best + TTFT_HELD_SLACK_S)
        if held and occupancy > self.window and self.capacity is None:
            self.window = occupancy
        return held


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
                b.capacity, b.source = m.running, "queued"
            elif b.capacity is not None and m.running > b.capacity:
                b.capacity = m.running
            elif b.capacity is None and m.max_running:
                b.capacity, b.source = m.max_running, "told"
            if b.capacity is None and m.waiting == 0 and m.running > b.window:
                b.window = m.running         # it runs that many with nobody waiting
    return b


def share(room: float, th: Thresholds, ep: Endpoint) -> int:
    """This worker's whole share of ``room`` slots (floored) dealt over the workers: ``(T + k) // N``
    with ``k`` the worker's turn on this endpoint, so the shares add up to ``T``. The turns follow
    the endpoint's place among its model's (``Endpoint.turn``), so the slots left over on each
    endpoint go round the workers, not to whichever worker the endpoints' URLs happen to favour."""
    t = math.floor(room)
    n = th.workers
    return (t + (th.index + ep.turn) % n) // n


def estimate(ep: Endpoint, th: Thresholds, now: float) -> Estimate:
    load = gateway_load(ep)
    room: float = math.inf
    reason: str | None = None
    waiting: float | None = None
    if th.max_in_flight:
        room, reason = (th.max_in_flight if th.workers == 1 else share(th.max_in_flight, th, ep)) - load, "in_flight"
    if th.engine_signals:
        b = baseline(ep)
        m = b.snapshot
        if m is None or now - m.scraped_at > th.max_age:
            return Estimate(0, None, "stale")
        occupied = b.occupancy(load)
        if occupied is not None:
            waiting = occupied - b.cap(th)
            if th.workers == 1:
                r = th.max_waiting - waiting
            else:       # the engine's queue at the scrape is everyone's; what was sent since, this worker's
                sent = load - b.in_flight
                r = share(th.max_waiting - (waiting - sent), th, ep) - sent
            if r < room:
                room, reason = r, "waiting"
        if m.kv_usage is not None and m.kv_usage >= th.max_kv:
            room, reason = 0, "kv"
    if room == math.inf:
        return Estimate(UNBOUNDED, waiting)
    headroom = max(0, math.floor(room))
    return Estimate(headroom, waiting, reason if headroom < 1 else None)


def _room(ep: Endpoint, th: Thresholds, now: float) -> int:
    """``ep``'s headroom, at most its free trial slots while its circuit breaker is half-open
    (``gateway.resilience.breaker``): the requests past those would go elsewhere."""
    headroom = estimate(ep, th, now).headroom
    trials = ep.extra.get("trials_free")
    return headroom if trials is None else min(headroom, trials)


def total_headroom(eps: Sequence[Endpoint], pairs: bool, th: Thresholds, now: float) -> int:
    """What a model's candidates can take. For prefill/decode pairs each request needs a slot on
    both sides: the smaller side's headroom (combined endpoints count on both). A half-open
    endpoint counts for its free trial slots at most."""
    if not pairs:
        return min(UNBOUNDED, sum(_room(ep, th, now) for ep in eps))
    sides = {"prefill": 0, "decode": 0, "combined": 0}
    for ep in eps:
        if ep.role in sides:
            sides[ep.role] = min(UNBOUNDED, sides[ep.role] + _room(ep, th, now))
    if not sides["prefill"] and not sides["decode"]:
        return sides["combined"]
    return min(UNBOUNDED, min(sides["prefill"], sides["decode"]) + sides["combined"])


def unsaturated(eps: list[Endpoint], th: Thresholds, now: float) -> list[Endpoint]:
    """The candidates with room; all of them when none has (a granted request goes anyway)."""
    out = [ep for ep in eps if not estimate(ep, th, now).saturated]
    return out or eps
