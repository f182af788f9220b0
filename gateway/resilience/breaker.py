"""Per-endpoint circuit breakers, fed by the classified outcome of every upstream leg.

States: **closed** (serving), **open** (ejected: routers see the endpoint as not ready) and
**half-open** (a few trial requests go through). Transitions:

- closed → open after ``consecutive_faults`` faults in a row, or when faults are more than
  ``fault_rate`` of the outcomes (faults and successes) seen in the last ``window_s`` seconds, once
  there were at least ``min_requests`` of them. With ``health.passive`` on, one refused connection
  is enough: nothing listens there.
- open → half-open after the ejection time: ``base_ejection_s`` × the number of times the endpoint
  was ejected (one less for every ``base_ejection_s`` it then stayed closed), at most
  ``max_ejection_s``; or as soon as the health probes, having found the endpoint down since the
  breaker opened, find it up again (``on_health``: an engine that crashed and was restarted gets its
  trials once it answers ``/health``, not after the rest of an ejection that grows with each crash).
  An engine that answers its probes all along while it fails requests is not cut short this way.
- half-open lets ``half_open_trials`` requests through at a time; ``success_threshold`` successes
  close it, one fault opens it again (a longer ejection).

With several workers (``--workers N``) each keeps its own breakers, fed by its own legs, and tells
its siblings what it decided (``on_change``, gateway/view): an ejection is adopted for the time the
sibling set (``adopt_open``), a close after the sibling's trials passed closes here too
(``adopt_close``). So a sick engine is ejected by the first worker to see enough faults, not by
each after its own share of them. The trials of an ejection are the worker's that decided it: a
sibling that adopted it goes half-open when its time is over but sends no trial (``held``), waiting
for that worker's close or new ejection, so the gateway sends ``half_open_trials`` at a time whatever
its workers; one that heard nothing ``base_ejection_s`` later (that worker got no request, or was
restarted) sends trials of its own. Two workers that eject an endpoint at once, each before it heard
of the other's ejection, keep one: the lower index's (``sender_first``), the other holding it.
Two that eject *different* endpoints of a group at once, each within ``max_ejection_percent`` by
what it knew, may together pass it: once each hears of the other's, the ejection of the lower index
stands in both, and the other is undone (``_displace``): its worker closes its breaker (and says
so), and counts the refusal; every worker decides alike, whichever of the two it heard first.

``max_ejection_percent`` bounds the ejected share of an endpoint's group (the model's endpoints of
the same kind: whole-request, prefill or decode). As in Envoy, one ejection is always allowed, but
never of the group's last ready endpoint: a breaker never empties a pool. A refused ejection is
counted once (``switchyard_breaker_ejections_capped_total``, Envoy's ``ejections_overflow``) and the
breaker stays closed, the faults that made it spent on it as on an ejection.

Backpressure (429/503) and client errors (other 4xx) change nothing: see ``gateway.resilience.outcome``.

The state is kept here and mirrored on ``Endpoint.ejected``, the flag ``Endpoint.ready`` reads, so
routers, the P/D pair choice (both sides) and the retry loop skip open endpoints without knowing
about breakers. Trial slots are taken when a routing decision names a half-open endpoint (a
``Routing`` decision observer); an outcome frees one. A trial whose outcome never comes (lost to a
bug) frees its slot after ``base_ejection_s``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import structlog
from msgspec import Meta
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.config.block import Block
from gateway.endpoints import Endpoint, EndpointPool
from gateway.observability.metrics import Counter
from gateway.resilience.outcome import Outcome

log = structlog.get_logger("switchyard.breaker")

_Seconds = Annotated[float, Meta(gt=0)]
_Count = Annotated[int, Meta(ge=1)]

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_VALUE = {CLOSED: 0, OPEN: 1, HALF_OPEN: 2}
_BUCKETS = 10                      # the fault-rate window is this many time buckets
_NOW = 0.001                       # an ejection's time left, said to a sibling, when it ends now


class BreakerConfig(Block):
    """The ``breaker:`` block (global, and per model: a model's block sets only the keys it names)."""

    enabled: Annotated[bool, Meta(description="Take endpoints that fail repeatedly out of routing for a while.")] = True
    consecutive_faults: Annotated[_Count, Meta(description="Faults in a row that open the breaker.")] = 5
    fault_rate: Annotated[float, Meta(ge=0, le=1, description="Share of faults among the outcomes of the window that opens the breaker (0: rule off).")] = 0.5
    window_s: Annotated[_Seconds, Meta(description="Window of the fault rate, in seconds.")] = 10.0
    min_requests: Annotated[_Count, Meta(description="Outcomes in the window before the fault rate is judged.")] = 10
    base_ejection_s: Annotated[_Seconds, Meta(description="First ejection time; the n-th ejection lasts n times this, in seconds.")] = 10.0
    max_ejection_s: Annotated[_Seconds, Meta(description="Longest ejection, in seconds.")] = 300.0
    half_open_trials: Annotated[_Count, Meta(description="Trial requests in flight at once after an ejection, in the whole gateway: with --workers N, the worker that ejected the endpoint sends them.")] = 3
    success_threshold: Annotated[_Count, Meta(description="Successful trials that close the breaker again.")] = 3
    max_ejection_percent: Annotated[float, Meta(ge=0, le=100, description="Most endpoints of a model's group ejected at once, in percent; one is always allowed, never the last ready one.")] = 10.0

    def __post_init__(self) -> None:
        if self.max_ejection_s < self.base_ejection_s:
            raise ValueError("max_ejection_s: must be at least base_ejection_s")


@dataclass(slots=True)
class Breaker:
    """One endpoint's breaker: plain state, driven by ``Breakers``."""

    state: str = CLOSED
    consecutive: int = 0               # faults in a row (closed)
    ejections: int = 0                 # times ejected, decaying while closed
    closed_at: float = 0.0
    opened_at: float = 0.0
    open_for: float = 0.0
    trials_out: int = 0                # half-open trial requests in flight
    trial_successes: int = 0
    last_event: float = 0.0            # last half-open dispatch or outcome (the stuck-trial guard)
    down_seen: bool = False            # open, and the health probes found the endpoint down since
    held: bool = False                 # a sibling's ejection: its trials are that worker's (``adopt_open``)
    owner: int = -1                    # held: the index of that worker (-1: not known)
    refused: tuple[int, int] | None = None   # a sibling's ejection refused here: (its worker, its ejections)
    faults: list[int] = field(default_factory=lambda: [0] * _BUCKETS)
    total: list[int] = field(default_factory=lambda: [0] * _BUCKETS)
    stamps: list[int] = field(default_factory=lambda: [-1] * _BUCKETS)
    timer: Any = None

    def count(self, fault: bool, now: float, bucket_s: float) -> int:
        """Count one outcome in the rate window (a success needs no more); returns its tick."""
        tick = int(now / bucket_s)
        i = tick % _BUCKETS
        if self.stamps[i] != tick:
            self.stamps[i], self.faults[i], self.total[i] = tick, 0, 0
        if fault:
            self.faults[i] += 1
        self.total[i] += 1
        return tick

    def observe(self, fault: bool, now: float, bucket_s: float) -> tuple[int, int]:
        """Count one outcome in the rate window; returns (faults, outcomes) in the window."""
        tick = self.count(fault, now, bucket_s)
        live = [j for j in range(_BUCKETS) if tick - self.stamps[j] < _BUCKETS]
        return sum(self.faults[j] for j in live), sum(self.total[j] for j in live)

    def clear_window(self) -> None:
        self.faults[:] = [0] * _BUCKETS
        self.total[:] = [0] * _BUCKETS
        self.stamps[:] = [-1] * _BUCKETS


class BreakerMetrics:
    def __init__(self, registry) -> None:
        self.transitions = Counter("switchyard_breaker_transitions", "Circuit breaker state changes",
                                   ["model", "endpoint", "from_state", "to_state"], registry=registry)
        self.capped = Counter("switchyard_breaker_ejections_capped",
                              "Ejections refused by breaker.max_ejection_percent (or to keep one endpoint ready)",
                              ["model"], registry=registry)
        self.outcomes = Counter("switchyard_upstream_outcomes",
                                "Upstream legs by classified outcome (fault, backpressure, client_error, success)",
                                ["model", "endpoint", "outcome"], registry=registry)
        self.states: BreakerStates | None = None      # the state gauge, registered by Breakers


class BreakerStates(Collector):
    """``switchyard_breaker_state`` per endpoint (0 closed, 1 open, 2 half-open), read at scrape time."""

    def __init__(self, breakers: Breakers) -> None:
        self._breakers = breakers

    def collect(self):
        fam = GaugeMetricFamily("switchyard_breaker_state",
                                "Circuit breaker state per endpoint: 0 closed, 1 open, 2 half-open",
                                labels=["model", "endpoint"])
        for ep in list(self._breakers.pool.endpoints()):
            fam.add_metric([ep.model, ep.name], STATE_VALUE[self._breakers.state(ep)])
        yield fam


def _group(ep: Endpoint) -> str:
    return "whole" if ep.role in ("aggregated", "combined") else ep.role


class Breakers:
    """Every endpoint's breaker. ``config_for(model)`` gives the model's ``BreakerConfig``;
    ``passive`` (``health.passive``): a refused connection opens at once. ``clock`` and
    ``call_later`` are the event loop's unless given (tests drive them by hand)."""

    def __init__(self, pool: EndpointPool, config_for: Callable[[str], BreakerConfig], registry,
                 passive: bool = True, clock: Callable[[], float] = time.monotonic,
                 call_later: Callable[[float, Callable[[], None]], Any] | None = None) -> None:
        self.pool = pool
        self.config_for = config_for
        self.passive = passive
        self.clock = clock
        self._call_later = call_later
        self._by_ep: dict[int, tuple[Endpoint, Breaker]] = {}
        self._half_opens: set[int] = set()       # id() of the endpoints whose breaker is half-open
        self.metrics = BreakerMetrics(registry)
        self.metrics.states = BreakerStates(self)
        registry.register(self.metrics.states)
        self.children: dict[tuple, Any] = {}
        # the usual outcome, a success on a closed breaker, recorded without the general path's
        # lookups: per endpoint, (the endpoint, its success counter, its breaker, the bucket length);
        # taken by ``record`` once breakers are on for its model, dropped by ``reset`` and ``reconfigure``
        self._success: dict[int, tuple[Endpoint, Any, Breaker, float]] = {}
        # told of each local open (ep, open_for, ejections) and close (ep, 0.0, 0): the sibling workers
        self.on_change: Callable[[Endpoint, float, int], None] | None = None
        self.index = 0          # this worker's index (``--workers N``): its own ejections rank as that
        pool.removal_listeners.append(self.reset)    # an endpoint that left the pool: its breaker goes

    # -- reading -------------------------------------------------------------------------------

    def breaker(self, ep: Endpoint) -> Breaker:
        entry = self._by_ep.get(id(ep))
        if entry is None or entry[0] is not ep:
            b = Breaker(closed_at=self.clock())
            if ep.removed:          # it left the pool (``reset``): a late outcome keeps nothing of it
                return b
            entry = self._by_ep[id(ep)] = (ep, b)
        return entry[1]

    def state(self, ep: Endpoint) -> str:
        entry = self._by_ep.get(id(ep))
        return entry[1].state if entry is not None and entry[0] is ep else CLOSED

    def describe(self, ep: Endpoint) -> dict:
        b = self.breaker(ep)
        return {"state": b.state, "ejections": b.ejections, "consecutive_faults": b.consecutive,
                "open_for_s": round(b.open_for, 3) if b.state == OPEN else None}

    # -- hooks ---------------------------------------------------------------------------------

    def on_decision(self, _ireq, decision, _fallbacks, _elapsed) -> None:
        """A ``Routing`` decision observer: a half-open endpoint it names uses a trial slot."""
        if not self._half_opens:    # the usual case: no breaker is half-open
            return
        for ep in (decision.endpoint, decision.prefill):
            if ep is not None:
                b = self._by_ep.get(id(ep))
                if b is not None and b[0] is ep and b[1].state == HALF_OPEN:
                    self._take_trial(ep, b[1])

    def record(self, ep: Endpoint, outcome: Outcome, cause: str = "") -> None:
        """One classified outcome of a leg to ``ep``. ``cause``: ``connect`` for a refused
        connection (opens at once with ``health.passive``), else free text for the log."""
        if outcome is Outcome.SUCCESS:
            known = self._success.get(id(ep))
            if known is not None:
                kept, counter, b, bucket_s = known
                if kept is ep and b.state == CLOSED:
                    counter.inc()
                    b.consecutive = 0
                    b.count(False, self.clock(), bucket_s)
                    return
        counter = self._child(self.metrics.outcomes, ep.model, ep.name, outcome.value)
        counter.inc()
        cfg = self.config_for(ep.model)
        if not cfg.enabled or ep.removed:      # removed: the answer of a request that was on it
            return
        b = self.breaker(ep)
        if outcome is Outcome.SUCCESS:
            self._success[id(ep)] = (ep, counter, b, cfg.window_s / _BUCKETS)
        now = self.clock()
        if b.state == HALF_OPEN:
            self._trial_outcome(ep, b, cfg, outcome, now, cause)
        elif b.state == CLOSED:
            self._closed_outcome(ep, b, cfg, outcome, now, cause)
        # open: late answers of requests sent before the ejection change nothing

    # -- closed ------------------------------------------------------------------------------

    def _closed_outcome(self, ep: Endpoint, b: Breaker, cfg: BreakerConfig, outcome: Outcome, now: float,
                        cause: str) -> None:
        if outcome is Outcome.SUCCESS:
            b.consecutive = 0
            b.count(False, now, cfg.window_s / _BUCKETS)
            return
        if outcome is not Outcome.FAULT:
            return
        b.consecutive += 1
        faults, total = b.observe(True, now, cfg.window_s / _BUCKETS)
        reason = None
        if cause == "connect" and self.passive:
            reason = "connect_refused"
        elif b.consecutive >= cfg.consecutive_faults:
            reason = "consecutive_faults"
        elif cfg.fault_rate and total >= cfg.min_requests and faults > cfg.fault_rate * total:
            reason = "fault_rate"
        if reason is not None:
            if self._may_eject(ep):
                self._open(ep, b, cfg, now, reason, faults=faults, total=total)
            else:
                # one refused ejection, counted once: the faults that made it are spent on it, as on
                # an ejection (Envoy's ``ejections_overflow``), so the next needs as many again;
                # counted per fault, one endpoint kept in counted its every fault from then on
                b.consecutive = 0
                b.clear_window()
                self._child(self.metrics.capped, ep.model).inc()
                log.info("breaker ejection refused", model=ep.model, endpoint=ep.name, reason=reason,
                         window_faults=faults, window_outcomes=total)

    def _may_eject(self, ep: Endpoint, without: Endpoint | None = None, health: bool = True) -> bool:
        """Envoy's rule: under ``max_ejection_percent`` of the group, and always one; never the
        group's last ready endpoint. ``without``: as if that endpoint's breaker were closed;
        ``health=False``: as if the probes found every endpoint up (the breakers' part of the rule)."""
        group = [e for e in self.pool.endpoints(ep.model) if _group(e) == _group(ep)]
        ejected = sum(1 for e in group if e is not without and self.state(e) != CLOSED)
        others_ready = any(not e.draining and (e.healthy or not health) and (e is without or not e.ejected)
                           for e in group if e is not ep)
        if not others_ready:
            return False
        pct = self.config_for(ep.model).max_ejection_percent
        return ejected == 0 or (ejected + 1) * 100 <= pct * len(group)

    # -- open ----------------------------------------------------------------------------------

    def _open(self, ep: Endpoint, b: Breaker, cfg: BreakerConfig, now: float, reason: str,
              faults: int = 0, total: int = 0) -> None:
        if b.state == CLOSED and b.ejections:   # one ejection forgotten per base time spent closed
            b.ejections = max(0, b.ejections - int((now - b.closed_at) / cfg.base_ejection_s))
        b.ejections += 1
        b.held = False
        self._eject(ep, b, now, min(cfg.max_ejection_s, cfg.base_ejection_s * b.ejections), reason,
                    window_faults=faults, window_outcomes=total)
        if self.on_change is not None:
            self.on_change(ep, b.open_for, b.ejections)

    def _eject(self, ep: Endpoint, b: Breaker, now: float, open_for: float, reason: str, counted: bool = True,
               **logged: Any) -> None:
        """Open ``b`` for ``open_for`` seconds: ``ep`` is not ready until it goes half-open.
        ``counted``: a transition of ``switchyard_breaker_transitions_total`` (and so is the
        half-open after it, unless the ejection is one said to be over)."""
        b.open_for = open_for
        b.opened_at = now
        b.refused = None
        b.consecutive = b.trials_out = b.trial_successes = 0
        b.down_seen = not ep.healthy
        b.clear_window()
        self._move(ep, b, OPEN, counted)
        ep.ejected = True
        log.warning("breaker opened", model=ep.model, endpoint=ep.name, reason=reason, ejections=b.ejections,
                    open_for_s=open_for, **logged)
        # an uncounted ejection learnt at a worker's start as over already (``ejected_now``): the
        # half-open that follows was counted too, by the sibling and by this worker's predecessor
        counted = counted or open_for > _NOW
        self._schedule(b, open_for, lambda: self._half_open(ep, b, counted=counted))

    def adopt_open(self, ep: Endpoint, open_for: float, ejections: int, sender_first: bool = False,
                   owner: int = -1, own: bool = False, counted: bool = True) -> bool:
        """A sibling worker ejected ``ep`` for ``open_for`` seconds: so does this one (unless it is
        open already, or the ejection would empty its group here); whether it did. ``sender_first``:
        the sibling comes before this worker (a lower index); of two ejections decided at once, each
        worker's before it heard of the other's, both keep that sibling's, and its trials.
        ``owner``: the index of the worker whose ejection it is, whose trials this one awaits.
        ``own``: it is this worker's (its predecessor at its index decided it, and a sibling's whole
        view told it at its start): this worker sends its trials. ``counted``: the ejection is a
        transition here (not for one a worker learns at its start: its predecessor, whose counts it
        carries on, or the sibling that decided it, counted it), and its refusal a refused ejection
        (not at the start either: the predecessor counted it)."""
        cfg = self.config_for(ep.model)
        if not cfg.enabled or open_for <= 0 or ep.removed:
            return False
        b = self.breaker(ep)
        if b.state == OPEN:
            if not b.held:
                if not sender_first:    # its own ejection: its own trials
                    return False
                # the sibling ejected it too before either heard of the other (their messages
                # crossed): one ejection, the first worker's, whose trials are the gateway's
                b.held = True
                log.info("breaker ejection left to a sibling", model=ep.model, endpoint=ep.name,
                         open_for_s=open_for)
            b.owner = owner
            # or the sibling's trial failed before this one went half-open: its new ejection is this one's
            b.ejections = max(b.ejections, ejections)
            b.open_for, b.opened_at = open_for, self.clock()
            self._schedule(b, open_for, lambda: self._half_open(ep, b))
            return True
        if b.state == CLOSED and not self._may_eject(ep):
            # refused by the breakers here, not by what the probes found (the sibling may see
            # them otherwise): an ejection it did not know of when it decided, or it would not have
            crossed = not self._may_eject(ep, health=False)
            victim = self._outranked(ep, owner) if crossed else None
            if victim is None or not self._may_eject(ep, without=victim):
                # counted once, though a catch-up after a gap tells the same ejection again in the
                # sibling's whole view (a new ejection of the sibling's, after a close or a failed
                # trial, has another number of ejections, and a close forgets the refusal); not at
                # this worker's start (``counted`` False: its predecessor heard of it when it was
                # decided and counted its refusal, which this worker's count carries on); nor when
                # an earlier worker's ejection here outranks it (that worker undoes its own, and
                # counts it)
                seen, b.refused = b.refused, (owner, ejections)
                if seen != b.refused and counted and not (crossed and self._outranks(ep, owner)):
                    self._child(self.metrics.capped, ep.model).inc()
                return False
            self._displace(victim, owner)
        b.ejections = max(b.ejections, ejections)
        b.held, b.owner = not own, -1 if own else owner
        self._eject(ep, b, self.clock(), open_for, "predecessor" if own else "sibling", counted)
        return True

    def _rank(self, b: Breaker) -> int:
        """The index of the worker whose ejection ``b`` is (-1: not known, kept first)."""
        return b.owner if b.held else self.index

    def _ejected_in_group(self, ep: Endpoint) -> list[tuple[Endpoint, Breaker]]:
        out = []
        for e in self.pool.endpoints(ep.model):
            entry = self._by_ep.get(id(e))
            if e is not ep and _group(e) == _group(ep) and entry is not None and entry[0] is e \
                    and entry[1].state != CLOSED:
                out.append((e, entry[1]))
        return out

    def _outranked(self, ep: Endpoint, owner: int) -> Endpoint | None:
        """Of the ejections in ``ep``'s group, the one a sibling ``owner``'s ejection of ``ep``
        displaces when the two do not fit under the cap together: one of a worker after ``owner``
        (the last worker's, and of its endpoints the last by name, so that every worker picks the
        same), decided before that worker heard of ``owner``'s, which it would not have made after."""
        if owner < 0:
            return None
        later = [(self._rank(b), e.name, e) for e, b in self._ejected_in_group(ep) if self._rank(b) > owner]
        return max(later, key=lambda t: t[:2])[2] if later else None

    def _outranks(self, ep: Endpoint, owner: int) -> bool:
        """An ejection in ``ep``'s group of a worker before ``owner``: the one ``owner`` keeps,
        undoing its own ejection of ``ep`` once it hears of it."""
        return owner >= 0 and any(self._rank(b) < owner for _, b in self._ejected_in_group(ep))

    def _displace(self, ep: Endpoint, owner: int) -> None:
        """Undo the ejection of ``ep``, which a sibling ``owner``'s ejection of another endpoint of
        its group outranks under ``max_ejection_percent``: its breaker closes, with the ejection
        forgotten. This worker's own is a refused ejection (counted) and its siblings hear of the
        close; one held for a sibling closes here only (that sibling undoes it too)."""
        b = self.breaker(ep)
        own = not b.held
        b.ejections = max(0, b.ejections - 1)
        log.warning("breaker ejection undone", model=ep.model, endpoint=ep.name, reason="max_ejection_percent",
                    sibling=owner, own=own)
        if own:
            self._child(self.metrics.capped, ep.model).inc()
        self._close(ep, b, self.clock(), told=not own)

    def ejected_now(self) -> list[tuple[Endpoint, float, int, int | None]]:
        """The endpoints out of routing here, for a sibling that starts (``RoutingView.snapshot``):
        (endpoint, seconds left of its ejection, ejections, the index of the sibling whose ejection
        it holds: None when it is this worker's own, -1 when not known). A half-open one is said as
        one whose ejection ends now: its trials are under way, or awaited."""
        now = self.clock()
        out = []
        for ep, b in self._by_ep.values():
            if b.state == CLOSED:
                continue
            left = max(_NOW, b.open_for - (now - b.opened_at)) if b.state == OPEN else _NOW
            out.append((ep, left, b.ejections, b.owner if b.held else None))
        return out

    def held_for(self, owner: int) -> list[Endpoint]:
        """The endpoints this worker keeps out on the ejection of sibling ``owner``, or refused."""
        return [ep for ep, b in self._by_ep.values()
                if (b.held and b.owner == owner and b.state != CLOSED)
                or (b.refused is not None and b.refused[0] == owner and b.state == CLOSED)]

    def adopt_close(self, ep: Endpoint) -> bool:
        """A sibling's trials found ``ep`` healthy: its breaker here closes too; whether it was open.
        A sibling's ejection of it refused here is over: its next is another."""
        entry = self._by_ep.get(id(ep))
        if entry is not None and entry[0] is ep:
            entry[1].refused = None
        if entry is None or entry[0] is not ep or entry[1].state == CLOSED:
            return False
        self._close(ep, entry[1], self.clock(), told=True)
        return True

    def _half_open(self, ep: Endpoint, b: Breaker, reason: str = "ejection_over", counted: bool = True) -> None:
        if b.state != OPEN or self.state(ep) != OPEN:
            return
        b.trials_out = b.trial_successes = 0
        b.last_event = self.clock()
        self._move(ep, b, HALF_OPEN, counted)
        if b.held:
            # the sibling that ejected it sends the trials, so the gateway's are half_open_trials
            # whatever its workers; this one waits for its word (a close, or a new ejection), and
            # sends trials of its own only when none came within base_ejection_s (that worker
            # served no request meanwhile, or was restarted)
            log.info("breaker half-open", model=ep.model, endpoint=ep.name, reason=reason, trials="sibling")
            self._schedule(b, self.config_for(ep.model).base_ejection_s, lambda: self._unhold(ep, b))
            return
        ep.ejected = False
        ep.extra["trials_free"] = self.config_for(ep.model).half_open_trials
        log.info("breaker half-open", model=ep.model, endpoint=ep.name, reason=reason)

    def _unhold(self, ep: Endpoint, b: Breaker) -> None:
        """A half-open breaker whose sibling's trials said nothing within ``base_ejection_s``: this
        worker sends trials too."""
        if b.state != HALF_OPEN or not b.held or self.state(ep) != HALF_OPEN:
            return
        b.held = False
        self._trials_left(ep, b, self.config_for(ep.model))
        log.info("breaker trials", model=ep.model, endpoint=ep.name, reason="sibling_quiet")

    def on_health(self, ep: Endpoint) -> None:
        """A monitor listener (a health change or a scrape of ``ep``): an open breaker whose endpoint
        the probes found down goes half-open once they find it up again."""
        entry = self._by_ep.get(id(ep))
        if entry is None or entry[0] is not ep:
            return
        b = entry[1]
        if b.state != OPEN:
            return
        if not ep.healthy:
            b.down_seen = True
        elif b.down_seen:
            self._cancel(b)
            self._half_open(ep, b, reason="health")

    # -- half-open -----------------------------------------------------------------------------

    def _take_trial(self, ep: Endpoint, b: Breaker) -> None:
        cfg = self.config_for(ep.model)
        b.trials_out += 1
        b.last_event = self.clock()
        ep.extra["trials_free"] = max(0, cfg.half_open_trials - b.trials_out)
        if b.trials_out >= cfg.half_open_trials:
            ep.ejected = True       # no more trials until one answers
            since = b.last_event
            self._schedule(b, cfg.base_ejection_s, lambda: self._stuck_trials(ep, b, since))

    def _stuck_trials(self, ep: Endpoint, b: Breaker, since: float) -> None:
        if b.state == HALF_OPEN and b.last_event == since:
            b.trials_out = 0
            self._trials_left(ep, b, self.config_for(ep.model))

    def _trial_outcome(self, ep: Endpoint, b: Breaker, cfg: BreakerConfig, outcome: Outcome, now: float,
                       cause: str) -> None:
        b.trials_out = max(0, b.trials_out - 1)
        b.last_event = now
        if outcome is Outcome.FAULT:
            self._open(ep, b, cfg, now, f"trial_fault:{cause}" if cause else "trial_fault")
            return
        if outcome is Outcome.SUCCESS:
            b.trial_successes += 1
            if b.trial_successes >= cfg.success_threshold:
                self._close(ep, b, now)
                return
        self._trials_left(ep, b, cfg)

    @staticmethod
    def _trials_left(ep: Endpoint, b: Breaker, cfg: BreakerConfig) -> None:
        """A half-open breaker's free trial slots: none (out of routing) while a sibling sends the
        trials or all are taken; on ``ep.extra["trials_free"]``, what admission counts it for
        (``gateway.admission.saturation.total_headroom``)."""
        free = 0 if b.held else max(0, cfg.half_open_trials - b.trials_out)
        ep.extra["trials_free"] = free
        ep.ejected = free == 0

    def _close(self, ep: Endpoint, b: Breaker, now: float, told: bool = False) -> None:
        b.consecutive = b.trials_out = b.trial_successes = 0
        b.held = False
        b.closed_at = now
        b.clear_window()
        self._cancel(b)
        self._move(ep, b, CLOSED)
        ep.ejected = False
        log.info("breaker closed", model=ep.model, endpoint=ep.name, by_sibling=told)
        if self.on_change is not None and not told:
            self.on_change(ep, 0.0, 0)

    # -- plumbing ------------------------------------------------------------------------------

    def _move(self, ep: Endpoint, b: Breaker, to: str, counted: bool = True) -> None:
        if counted:
            self._child(self.metrics.transitions, ep.model, ep.name, b.state, to).inc()
        b.state = to
        if to == HALF_OPEN:
            self._half_opens.add(id(ep))
        else:
            self._half_opens.discard(id(ep))
        ep.extra["breaker"] = to        # the status page's column (gateway/observability/status.py)
        if to != HALF_OPEN:
            ep.extra.pop("trials_free", None)

    def _schedule(self, b: Breaker, delay: float, fn: Callable[[], None]) -> None:
        self._cancel(b)
        call_later = self._call_later or asyncio.get_running_loop().call_later
        b.timer = call_later(delay, fn)

    @staticmethod
    def _cancel(b: Breaker) -> None:
        if b.timer is not None and hasattr(b.timer, "cancel"):
            b.timer.cancel()
        b.timer = None

    def reset(self, ep: Endpoint) -> None:
        """Forget ``ep``'s breaker (it left the pool, or breakers were turned off)."""
        entry = self._by_ep.pop(id(ep), None)
        self._success.pop(id(ep), None)
        self._half_opens.discard(id(ep))
        if entry is not None:
            self._cancel(entry[1])
            if entry[0] is ep:
                ep.ejected = False
                ep.extra.pop("breaker", None)
                ep.extra.pop("trials_free", None)

    def reconfigure(self, config_for: Callable[[str], BreakerConfig]) -> None:
        """A reload: new settings; a breaker whose model turned breakers off closes now."""
        self.config_for = config_for
        self._success.clear()                  # a model's breakers may be off now, or its window other
        for ep, b in list(self._by_ep.values()):
            if b.state != CLOSED and not config_for(ep.model).enabled:
                self._close(ep, b, self.clock())

    def _child(self, metric, *labels: str):
        key = (metric, labels)          # as GatewayMetrics.child keys its own (forget_endpoint reads both)
        c = self.children.get(key)
        if c is None:
            c = self.children[key] = metric.labels(*labels)
        return c
