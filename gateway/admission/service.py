"""``Admission``: what the pipeline awaits between the checks and the routing decision.

``admit`` returns at once while the model's candidates have room (``saturation``) and nobody is
waiting; otherwise the request joins the model's queue (``queue``) and returns when the pump
grants it a slot, or raises the 429 that sheds it. The pump runs on the events that free room —
a request releasing its charges (``released``), a scrape or a health change (``on_endpoint``), a
waiter leaving — never on a timer.

A granted request is counted in ``granted`` until its task resumes and, in the same synchronous
step, routes and charges an endpoint; so one pump never hands out more slots than there is room,
and a waiter whose client went away before it resumed gives its slot back.

A waiter whose endpoints its state or API chose (a LoRA adapter's, a response's owner, the engines
serving the Messages API) and have no room keeps them for itself: the pump goes on to the waiters after it, which it lets go only to the
other endpoints, so one bound to a busy engine does not hold the queue back from an idle one. A
newcomer is walked past them the same way (``_beside``): one that finds room on endpoints the
waiters ahead of it cannot use goes there at once, needing no place in the queue, so it is neither
refused by a queue full of them nor shed for them.

Shedding (all 429, with ``Retry-After`` and ``retry-after-ms`` from the position and the drain
rate, ``x-ratelimit-*-queue`` headers and the reason in the error's ``code``):

- ``queue_full``: the queue is at ``queue_max`` or ``queue_max_bytes`` and the evictions the rules
  allow (``FairQueue.make_room``) would not make room for the request; nobody is evicted then;
- ``displaced``: a request of a higher class took this one's place in the full queue (the lowest
  class goes first, so sheddable before standard);
- ``shed``: a sheddable request arriving while a higher class waits (it could only wait behind it),
  and no room is left to it beside the waiters;
- ``queue_timeout``: waited ``queue_timeout_s`` without room (503 instead when no endpoint of the
  model is ready any more).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import msgspec
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.admission.config import PRIORITIES, RANK, AdmissionConfig
from gateway.admission.queue import GRANTED, WAITING, DrainRate, FairQueue, Waiter, retry_after_s
from gateway.admission.saturation import (
    Thresholds,
    baseline,
    estimate,
    gateway_load,
    total_headroom,
    unsaturated,
)
from gateway.apis.paths import COUNT_TOKENS
from gateway.endpoints import Endpoint, EndpointPool
from gateway.errors import ErrorClass, GatewayError
from gateway.observability.metrics import LATENCY_BUCKETS, Counter, Histogram
from gateway.pipeline.context import model_not_found
from gateway.tenants.directory import header_field
from gateway.tenants.limits import fmt_duration

if TYPE_CHECKING:
    from gateway.config.schema import Config
    from gateway.observability.metrics import GatewayMetrics
    from gateway.pipeline.context import RequestContext, RequestRecord
    from gateway.request import InferenceRequest

SHEDDABLE = RANK["sheddable"]
WHOLE_REQUEST_ROLES = ("aggregated", "combined")     # as gateway.pipeline.routing's
REASONS = ("queue_full", "displaced", "fair_share", "shed", "queue_timeout", "deadline")
OUTPUT_WEIGHT = 2.0          # an output token costs two prompt tokens in a user's counter (VTC's weights)
OBJECTIVES = ("ttft", "tpot")
MAX_SKIPPED = 32             # waiters a pump passes over that keep endpoints no waiter before them keeps, at most
ENGINE_TTFT_ALPHA = 0.2      # weight of the newest request in the engine-side TTFT average
_MESSAGES = {
    "queue_full": "model {model} is at capacity and its admission queue is full",
    "displaced": "model {model} is at capacity and a request of a higher priority class took this "
                 "request's place in the full admission queue",
    "fair_share": "model {model} is at capacity and a user served less took this request's place in "
                  "the full admission queue (its user has been served the most lately)",
    "shed": "model {model} is at capacity and requests of a higher priority class are waiting; "
            "sheddable requests are refused until they are served",
    "deadline": "model {model} is at capacity and this request's time-to-first-token objective "
                "({slo:g} ms) cannot be met by the admission queue",
    "queue_timeout": "model {model} stayed at capacity for the {timeout:g}s this request may wait",
}


class AdmissionMetrics:
    def __init__(self, registry) -> None:
        self.shed = Counter("switchyard_admission_shed", "Requests refused by admission control (429), "
                            "by reason and priority class", ["model", "priority", "reason"], registry=registry)
        self.wait = Histogram("switchyard_admission_wait_seconds",
                              "Time requests spent in the admission queue, by how the wait ended "
                              "(dispatched, shed, cancelled)", ["model", "priority", "outcome"],
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.slo = Counter("switchyard_slo_requests", "Requests with a latency objective, by objective (ttft, "
                           "tpot) and outcome: met, missed, shed (refused by admission control)",
                           ["model", "objective", "outcome"], registry=registry)


@dataclass(slots=True)
class ModelQueue:
    queue: FairQueue = field(default_factory=FairQueue)
    drain: DrainRate = field(default_factory=DrainRate)
    granted: int = 0                 # slots handed out whose requests have not charged yet
    engine_ttft: float = 0.0         # recent engine-side TTFT (dispatch to first token), seconds (EWMA)


class Admission:
    def __init__(self, config: Config, pool: EndpointPool, metrics: GatewayMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.clock = clock
        self.m = AdmissionMetrics(metrics.registry)
        self._models: dict[str, ModelQueue] = {}
        self.workers = 1
        self.worker_index = 0
        self.slo_counts: dict[str, dict[str, dict[str, int]]] = {}     # model → objective → outcome → count
        # told when a model's queue fills or empties (``queued``: which hold requests now); the shared
        # view tells the siblings, whose batch runner leaves the model's engines to them meanwhile
        self.on_queue_change: Callable[[], None] | None = None
        # a user's class from the tenants' directory (the admin API's records over the config's),
        # where tenancy runs; None: the config's alone
        self.user_classes: Callable[[str | None], str | None] | None = None
        self.reconfigure(config)
        metrics.registry.register(_AdmissionState(self))

    def reconfigure(self, config: Config) -> None:
        """At start and at a reload: settings apply to the next request; queues are kept."""
        self.config = config
        self._settings: dict[str, AdmissionConfig | None] = {}
        self._thresholds: dict[str, Thresholds] = {}
        self._by_class: dict[str, list[Thresholds]] = {}      # per class: its share of the engine queue
        self.engine_signals = config.scrape.enabled
        # whether any model's admission writes its class into the body (``engine_priority``): when
        # none does, the pipeline asks nothing of a request once it is admitted
        self.writes_priority = config.admission.engine_priority is not None or any(
            m.admission is not None and m.admission.engine_priority is not None for m in config.models)
        for model in list(self._models):
            # read again now, not at the model's next request: a scrape before it must re-base its
            # endpoints (``on_endpoint``) with the gateway's load at that scrape
            self.settings(model)
            self._pump(model)

    def set_workers(self, n: int, index: int = 0) -> None:
        """This process is worker ``index`` of ``n`` (``--workers``): the configured bounds are the
        gateway's, so it takes its share of each (docs/tenancy.md, "Several workers")."""
        self.workers = max(1, n)
        self.worker_index = index
        self.reconfigure(self.config)

    def settings(self, model: str) -> AdmissionConfig | None:
        """The model's admission settings, None when admission is off for it; with several
        workers, the queue bounds are this worker's share (rounded up)."""
        try:
            return self._settings[model]
        except KeyError:
            s = self.config.admission_for(model)
            if s.enabled and self.workers > 1:
                n = self.workers
                s = msgspec.structs.replace(s, queue_max=-(-s.queue_max // n), queue_max_bytes=-(-s.queue_max_bytes // n))
            s = self._settings[model] = s if s.enabled else None
            if s is not None:
                self._thresholds[model] = Thresholds(s.max_waiting_per_endpoint, s.max_kv_usage,
                                                     s.max_in_flight_per_endpoint, s.metrics_max_age_s,
                                                     self.engine_signals, self.workers, self.worker_index,
                                                     s.initial_capacity)
                th = self._thresholds[model]
                self._by_class[model] = [
                    replace(th, max_waiting=s.waiting_share.limit(r, s.max_waiting_per_endpoint))
                    for r in range(len(PRIORITIES))]
                mq = self._models.setdefault(model, ModelQueue(drain=DrainRate(s.drain_window_s)))
                mq.drain.resize(s.drain_window_s)          # a reload may have changed it
                mq.queue.on_change = self._queue_changed
            return s

    def tracked(self) -> list[str]:
        """The models the gauges cover: every one admission is on for (the config's and the pool's,
        discovered ones included), served here yet or not, and those a reload removed (or turned
        admission off for) while requests waited, until their queue is empty: then the model's
        queue goes, and its gauges with it (they would say a model no longer served drains). With
        ``--workers N`` a worker that has not served a model still holds its share of the model's
        room, which the gateway's sum needs."""
        present = dict.fromkeys([*(m.name for m in self.config.models), *self.pool.models()])
        for model in present:
            self.settings(model)
        for model in [m for m, mq in self._models.items()
                      if not len(mq.queue) and not mq.granted and (m not in present or self.settings(m) is None)]:
            del self._models[model]
            self._settings.pop(model, None)     # read again if it comes back (discovery), its queue made anew
        return list(self._models)

    # -- priority ------------------------------------------------------------------------------

    def user_priority(self, user: str | None) -> str | None:
        if self.user_classes is not None:
            return self.user_classes(user)
        lim = self.config.limits
        entry = lim.users.get(user) if user is not None else None
        if entry is not None and entry.priority is not None:
            return entry.priority
        return lim.default_user.priority if lim.default_user is not None else None

    def check_priority(self, ctx: RequestContext, model: str) -> None:
        """A bad ``x-priority`` refused before anything else is charged for the request (the
        user's request window): ``priority_of`` checks it again once the user is known."""
        s = self.settings(model)
        if s is not None and s.priority_header:
            asked = header_field(ctx.http.headers, "x-priority")
            if asked is not None and asked.strip().lower() not in RANK:
                raise _bad_priority()

    def priority_of(self, ctx: RequestContext, s: AdmissionConfig) -> int:
        """The user's class, or the ``x-priority`` header's when it is no higher."""
        allowed = self.user_priority(ctx.rec.user) or s.default_priority
        # a batch line's header is the gateway's own (``sheddable``), honoured whatever clients may do
        honoured = s.priority_header or getattr(ctx.http, "own_priority", False)
        # read whole: two lines join into a value that names no class (a 400), whichever comes first
        asked = header_field(ctx.http.headers, "x-priority") if honoured else None
        if asked is None:
            return RANK[allowed]
        name = asked.strip().lower()
        if name not in RANK:
            raise _bad_priority()
        if RANK[name] > RANK[allowed]:
            ctx.rec.extra["priority_requested"] = name      # kept at the user's class
            return RANK[allowed]
        return RANK[name]

    def engine_priority(self, ctx: RequestContext) -> int | None:
        """The body ``priority`` an admitted request is sent with (``engine_priority``: its class's
        value), None when its model's admission is off or writes none."""
        ireq = ctx.ireq
        assert ireq is not None
        s = self.settings(ireq.model)
        if s is None or s.engine_priority is None:
            return None
        return getattr(s.engine_priority, ctx.rec.extra["priority"])

    # -- the pipeline's hooks ------------------------------------------------------------------

    async def admit(self, ctx: RequestContext, candidates: list[Endpoint], pairs: bool) -> list[Endpoint]:
        """The candidates to route among, once there is room; raises the 429 (or 503) otherwise."""
        ireq = ctx.ireq
        assert ireq is not None
        model = ireq.model
        s = self.settings(model)
        if s is None:
            return candidates
        rec = ctx.rec
        rank = self.priority_of(ctx, s)
        rec.extra["priority"] = PRIORITIES[rank]
        mq = self._models[model]
        th = self._by_class[model][rank]
        q = mq.queue
        now = self.clock()
        user = rec.user or ""
        cost = request_cost(ireq)
        free = self._room_now(model, mq, rank, candidates, pairs, th, now)
        if free:
            q.charge(rank, user, cost)          # served at once: its tokens count all the same
            ctx.admission_cost = cost
            return free if pairs else unsaturated(free, th, now)
        size = len(ireq.body)
        slo = ireq.slo_ttft_ms
        # the request must leave the queue in time for the engine's own part of its TTFT
        deadline = now + slo / 1000 - mq.engine_ttft if slo is not None else math.inf
        evicted = self._shed(model, s, mq, rank, user, cost, size, deadline, slo, rec, now)
        for victim, reason in evicted:
            err = self._rejection(model, s, mq, victim.rank, reason, q.position(victim.rank, victim.user, victim),
                                  victim.rec)
            q.remove(victim)
            if not victim.fut.done():
                victim.fut.set_exception(err)
        # the endpoints it may take when its turn comes: its model's ready then, as its API chose them,
        # unless its state (an adapter loaded, a response an engine holds) chose them
        accepts = ctx.api.when_queued(ctx) if ctx.api is not None and ireq.lora is None else None
        w = Waiter(rank, user, size, now, asyncio.get_running_loop().create_future(), candidates=candidates,
                   pairs=pairs, widen=ireq.lora is None and (ctx.api is None or accepts is not None),
                   accepts=accepts, cost=cost, deadline=deadline, slo_ms=slo, rec=rec)
        q.push(w)
        self._pump(model)
        try:
            async with asyncio.timeout(max(0.0, min(s.queue_timeout_s, deadline - now))):
                await w.fut
        except TimeoutError:
            if w.state != GRANTED:          # else granted just as the time ran out: it goes
                position = q.position(rank, user, w)
                q.remove(w)
                self._waited(model, rank, "shed", w)
                if not self._ready(model, w):
                    raise self._unserved(ctx, model, w) from None
                if deadline - now < s.queue_timeout_s:      # the deadline bounded the wait, not the timeout
                    raise self._rejection(model, s, mq, rank, "deadline", position, rec, slo) from None
                raise self._rejection(model, s, mq, rank, "queue_timeout", position, rec) from None
        except asyncio.CancelledError:       # the client went away (or the server stops)
            if w.state == WAITING:
                q.remove(w)
            elif w.state == GRANTED:        # charged when granted: given back as it ends (``released``)
                ctx.admission_cost = cost
                mq.granted -= 1
                self._pump(model)
            self._waited(model, rank, "cancelled", w)
            raise
        except GatewayError as e:            # displaced, or its endpoints went away
            self._waited(model, rank, "shed", w)
            if e.error_class is ErrorClass.NO_ENDPOINT:
                raise self._unserved(ctx, model, w) from None
            raise
        mq.granted -= 1
        ctx.admission_cost = cost           # put on its user's counter when the pump granted it
        self._waited(model, rank, "dispatched", w)
        eps = self._ready(model, w)
        if w.reserved:                      # left to waiters before it bound to them
            eps = [ep for ep in eps if ep not in w.reserved] or eps
        if not eps:
            self._pump(model)
            raise self._unserved(ctx, model, w)
        return eps if pairs else unsaturated(eps, th, self.clock())

    def _shed(self, model: str, s: AdmissionConfig, mq: ModelQueue, rank: int, user: str, cost: float, size: int,
              deadline: float, slo: float | None, rec: RequestRecord, now: float) -> list[tuple[Waiter, str]]:
        """For a request that found no room: the 429 that sheds it (``shed``, ``deadline``,
        ``queue_full``), raised, else whom it evicts to join the queue (``make_room``; not yet)."""
        q = mq.queue
        if rank == SHEDDABLE and q.higher_waiting(rank):
            raise self._rejection(model, s, mq, rank, "shed", q.position(rank, user, deadline=deadline, cost=cost), rec)
        if slo is not None:                 # a deadline the queue cannot meet: told at once, not served late
            position = q.position(rank, user, deadline=deadline, cost=cost)
            rate = mq.drain.rate(now)
            if deadline <= now or rate > 0 and now + (position + 1) / rate > deadline:
                raise self._rejection(model, s, mq, rank, "deadline", position, rec, slo)
        evicted = q.make_room(rank, user, cost, size, s.queue_max, s.queue_max_bytes)
        if evicted is None:                 # no eviction would make room for it: nobody goes for nothing
            raise self._rejection(model, s, mq, rank, "queue_full",
                                  q.position(rank, user, deadline=deadline, cost=cost), rec)
        return evicted

    def shed_early(self, ctx: RequestContext, candidates: list[Endpoint], pairs: bool) -> None:
        """Before work a request does ahead of ``admit`` only to route (its prompt tokenized for the
        KV events' match): the 429 ``admit`` would shed it with now, raised first, so a shed request
        costs nothing of that work (none of these decisions reads its tokens). Looked at while
        requests wait, or when an empty queue could refuse it too (``queue_max: 0``, a body past
        ``queue_max_bytes``, a deadline: the common path pays a length and three reads), and changes
        nothing: nobody evicted, nothing charged; ``admit`` decides again after the work."""
        ireq = ctx.ireq
        assert ireq is not None
        model = ireq.model
        s = self.settings(model)
        mq = self._models.get(model)
        if s is None or mq is None:
            return
        if not len(mq.queue) and s.queue_max and len(ireq.body) <= s.queue_max_bytes and ireq.slo_ttft_ms is None:
            return                          # the queue would take it: nothing sheds it
        rec = ctx.rec
        rank = self.priority_of(ctx, s)
        th = self._by_class[model][rank]
        now = self.clock()
        if self._room_now(model, mq, rank, candidates, pairs, th, now):
            return
        slo = ireq.slo_ttft_ms
        deadline = now + slo / 1000 - mq.engine_ttft if slo is not None else math.inf
        rec.extra["priority"] = PRIORITIES[rank]
        self._shed(model, s, mq, rank, rec.user or "", request_cost(ireq), len(ireq.body), deadline, slo, rec, now)

    def with_room(self, ctx: RequestContext, eps: list[Endpoint]) -> list[Endpoint]:
        """Of ``eps``, endpoints a retry may add to the request's candidates (ready since they were
        taken), those admission would have let it go to: every one when admission is off for its
        model, else those not saturated for its class."""
        assert ctx.ireq is not None
        if not eps:
            return eps
        s = self.settings(ctx.ireq.model)
        if s is None:
            return eps
        rank = RANK.get(ctx.rec.extra.get("priority", ""), RANK[s.default_priority])
        th, now = self._by_class[ctx.ireq.model][rank], self.clock()
        return [ep for ep in eps if not estimate(ep, th, now).saturated]

    def _queue_changed(self) -> None:
        if self.on_queue_change is not None:
            self.on_queue_change()

    def queued(self) -> list[str]:
        """The models whose queue holds requests now."""
        return [model for model, mq in self._models.items() if len(mq.queue)]

    def waiting(self, model: str) -> int:
        """Requests of ``model`` waiting in its queue now (the batch runner leaves room to them)."""
        mq = self._models.get(model)
        return len(mq.queue) if mq is not None else 0

    def dispatched(self, ctx: RequestContext) -> None:
        """The request was routed and charged: note what its engine held then, counting it (for
        the slow start, which learns from its TTFT)."""
        if not self._thresholds:        # admission is off for every model that came
            return
        d = ctx.decision
        if d is None or d.prefill is not None or ctx.ireq is None or self._thresholds.get(ctx.ireq.model) is None:
            return
        ep = d.endpoint
        occupied = baseline(ep).occupancy(gateway_load(ep))
        if occupied is not None:
            ctx.dispatched = (ep, occupied)

    def released(self, model: str, ctx: RequestContext) -> None:
        """A request of ``model`` released its charges: room for the next waiter, a tick of the drain
        rate if it had taken a slot, and what its TTFT says of the engine's capacity."""
        rec = ctx.rec
        if ctx.ireq is not None and (ctx.ireq.slo_ttft_ms is not None or ctx.ireq.slo_tpot_ms is not None):
            self._objectives(model, ctx)
        mq = self._models.get(model)
        if mq is None:
            return
        if ctx.charges.in_flight is not None and drained(rec):
            mq.drain.tick(self.clock())
        if ctx.admission_cost:
            # the user's counter was charged the request's expected size: now what it cost
            rank = RANK.get(rec.extra.get("priority", ""))
            served = served_cost(ctx)
            if rank is not None and served is not None:
                mq.queue.charge(rank, rec.user or "", served - ctx.admission_cost)
        if ctx.dispatched is not None and rec.ttft is not None and ctx.decision is not None:
            ep, occupied = ctx.dispatched
            th = self._thresholds.get(model)
            if ep is ctx.decision.endpoint and th is not None:
                waited = rec.extra.get("queue_wait_ms", 0.0) / 1000
                engine_ttft = max(0.0, rec.ttft - waited)
                baseline(ep).ttft_held(engine_ttft, occupied, th)
                mq.engine_ttft += ENGINE_TTFT_ALPHA * (engine_ttft - mq.engine_ttft)
        self._pump(model)

    def on_endpoint(self, ep: Endpoint) -> None:
        """A scrape or a health change: room may have appeared on ``ep``. Called in the step that
        stored the new snapshot, so its baseline is this gateway's load at that moment."""
        if self._thresholds.get(ep.model) is not None:
            baseline(ep)
            self._pump(ep.model)

    def _objectives(self, model: str, ctx: RequestContext) -> None:
        """Count whether the request met its latency objectives (and say so on its log line)."""
        rec, ireq = ctx.rec, ctx.ireq
        assert ireq is not None
        outcomes: dict[str, str] = {}
        shed = rec.status == 429 and str(rec.error_class or "").startswith("admission")
        failed = rec.status >= 500 or (rec.status == 200 and rec.error_class is not None)
        ttft = rec.ttft
        if ireq.slo_ttft_ms is not None:
            if shed:
                outcomes["ttft"] = "shed"
            elif failed:
                outcomes["ttft"] = "missed"
            elif ttft is not None:
                outcomes["ttft"] = "met" if ttft * 1000 <= ireq.slo_ttft_ms else "missed"
        if ireq.slo_tpot_ms is not None:
            n = rec.completion_tokens
            if n is not None and ireq.choices > 1:
                n /= ireq.choices       # a choice's tokens: several decode side by side
            if shed:
                outcomes["tpot"] = "shed"
            elif failed:
                outcomes["tpot"] = "missed"
            elif ttft is not None and n is not None and n >= 2:
                tpot = (time.perf_counter() - rec.started - ttft) / (n - 1)
                rec.extra["tpot_ms"] = round(tpot * 1000, 3)
                outcomes["tpot"] = "met" if tpot * 1000 <= ireq.slo_tpot_ms else "missed"
        counts = self.slo_counts.setdefault(model, {})
        for objective, outcome in outcomes.items():
            self.m.slo.labels(model, objective, outcome).inc()
            per = counts.setdefault(objective, {"met": 0, "missed": 0, "shed": 0})
            per[outcome] += 1
        if outcomes:
            rec.extra["slo_met"] = all(o == "met" for o in outcomes.values())

    def status(self, model: str, part: bool = False) -> dict | None:
        """The model's admission rows on the status page (None: admission is off for it). ``part``:
        for a sibling's page (``--workers N``), with what adding the workers' rows up needs besides:
        the waiting users' names (``users``) and each endpoint's requests sent since its scrape
        (``sent``)."""
        s = self.settings(model)
        slo = self.slo_counts.get(model)
        if s is None:
            return {"enabled": False, "slo": slo} if slo else None
        mq, th = self._models[model], self._thresholds[model]
        now = self.clock()
        eps = []
        for ep in self.pool.endpoints(model):
            e = estimate(ep, th, now)
            b = baseline(ep)
            row = {"name": ep.name, "capacity": b.cap(th) if th.engine_signals else None,
                   "capacity_source": b.source if th.engine_signals else None,
                   "engine_queue": e.waiting, "headroom": min(e.headroom, 1_000_000),
                   "saturated": e.saturated, "reason": e.reason}
            if part:
                row["sent"] = gateway_load(ep) - b.in_flight
            eps.append(row)
        q = mq.queue
        out = {"enabled": True,
               "queue": {name: q.count(rank) for rank, name in enumerate(PRIORITIES)},
               "users_waiting": {name: q.users(rank) for rank, name in enumerate(PRIORITIES)},
               "queue_bytes": q.bytes, "queue_max": s.queue_max,
               "drain_rate": round(mq.drain.rate(now), 3), "engine_ttft_ms": round(mq.engine_ttft * 1000, 1),
               "endpoints": eps, "slo": slo}
        if part:
            out["users"] = {name: q.waiting_users(rank) for rank, name in enumerate(PRIORITIES)}
        return out

    # -- inside --------------------------------------------------------------------------------

    def _pump(self, model: str) -> None:
        mq = self._models.get(model)
        if mq is None or not len(mq.queue):
            return
        by_class = self._by_class.get(model)
        if by_class is None and self.settings(model) is not None:   # a reload forgot them: read again
            by_class = self._by_class.get(model)
        if by_class is None:                # admission turned off by a reload: let everyone go
            by_class = [Thresholds(max_waiting=1 << 30, max_kv=2.0, max_age=math.inf, engine_signals=False)] * len(PRIORITIES)
        now = self.clock()
        q = mq.queue
        # a waiter whose endpoints have no room keeps them for itself, and the waiters after it may
        # go to the others: one bound to a busy engine (a LoRA adapter's, a response's owner) does
        # not hold the queue back from an idle one. Once every endpoint is kept, nobody can go. A
        # waiter all of whose endpoints are kept already is passed over at the cost of a look, not
        # counted in ``MAX_SKIPPED``. One walk, however many are granted (``FairQueue.walk``).
        reserved: set[Endpoint] = set()
        ready: list[Endpoint] | None = None
        bound = 0
        for w in q.walk():
            if w.deadline <= now and not w.fut.done() and (s := self.settings(model)) is not None:
                # its deadline passed before its timer ran (a busy event loop ran the release that
                # frees a slot first): shed now, never served late
                err = self._rejection(model, s, mq, w.rank, "deadline", q.position(w.rank, w.user, w), w.rec,
                                      slo=w.slo_ms)
                q.remove(w)                 # shed, not served: nothing on its user's counter
                w.fut.set_exception(err)
                continue
            if w.fut.done():                # its task was cancelled and has not run yet: not served
                q.remove(w)
                continue
            eps = self._ready(model, w)
            if not eps:
                q.remove(w)
                w.fut.set_exception(self._no_endpoint(model))
                continue
            free = [ep for ep in eps if ep not in reserved] if reserved else eps
            if free and total_headroom(free, w.pairs, by_class[w.rank], now) - mq.granted >= 1:
                q.take(w)                   # dispatched: its cost goes on its user's counter
                w.reserved = frozenset(reserved) if reserved else None
                w.state = GRANTED
                mq.granted += 1
                w.fut.set_result(None)
                continue
            bound_to = not w.widen or w.accepts is not None     # not free to go anywhere
            if free:                        # endpoints no waiter before it keeps: kept for it now
                reserved.update(eps)
                if ready is None:
                    ready = self.pool.ready(model)
                bound += 1
                if not bound_to or bound > MAX_SKIPPED or reserved.issuperset(ready):
                    return
            elif not bound_to:
                return
            # bound to endpoints of its own: the others may serve the rest

    def _room_now(self, model: str, mq: ModelQueue, rank: int, candidates: list[Endpoint], pairs: bool,
                  th: Thresholds, now: float) -> list[Endpoint]:
        """The candidates a request of class ``rank`` may go to at once, with room on them: all of
        them when nobody of its class or above waits, else those the waiters ahead leave to it
        (``_beside``); none when there is no room there."""
        q = mq.queue
        ahead = any(q.count(r) for r in range(rank, len(PRIORITIES)))
        free = candidates if not ahead else self._beside(model, mq, rank, candidates, pairs, th, now)
        return free if free and total_headroom(free, pairs, th, now) - mq.granted >= 1 else []

    def _beside(self, model: str, mq: ModelQueue, rank: int, candidates: list[Endpoint], pairs: bool,
                th: Thresholds, now: float) -> list[Endpoint]:
        """Of a newcomer's candidates, those the requests waiting ahead of it (its class and above,
        its own class's all counted ahead) leave to it: the walk the pump would make to its turn,
        each waiter bound to endpoints without room keeping them (as the pump: one whose endpoints
        are kept already passed over, at most ``MAX_SKIPPED`` keeping endpoints of their own). None
        of them when a waiter ahead may go anywhere, or could go now, or the walk is cut short: then
        it queues as before. Walked only when requests wait: the common path pays nothing."""
        by_class = self._by_class[model]
        reserved: set[Endpoint] = set()
        ready: list[Endpoint] | None = None
        passed = 0
        for w in mq.queue.in_order(rank):
            if w.fut.done() or w.deadline <= now:       # leaving: the next pump drops it
                continue
            eps = self._ready(model, w)
            if not eps:
                continue
            free = [ep for ep in eps if ep not in reserved]
            if not free:                                # all kept for waiters before it already
                if w.widen and w.accepts is None:
                    return []
                continue
            if total_headroom(free, w.pairs, by_class[w.rank], now) - mq.granted >= 1:
                return []                               # it goes before the newcomer
            reserved.update(eps)
            if ready is None:
                ready = self.pool.ready(model)
            if w.widen and w.accepts is None or passed >= MAX_SKIPPED or reserved.issuperset(ready):
                return []
            passed += 1
        return [ep for ep in candidates if ep not in reserved]

    def _ready(self, model: str, w: Waiter) -> list[Endpoint]:
        """The endpoints ``w`` may go to now: its candidates that are still ready when its state chose
        them (a LoRA adapter, a response an engine holds), else every endpoint of its model ready now
        that its API serves it with (``ApiShape.when_queued``: for the Messages API and the
        pass-through paths, an engine that serves the path), so one that is back (a restart, a
        breaker's trials) or new (a reload, discovery) takes the queue too."""
        if w.widen:
            eps = self.pool.ready(model, None if w.pairs else WHOLE_REQUEST_ROLES)
            return eps if w.accepts is None else [ep for ep in eps if w.accepts(ep)]
        return [ep for ep in w.candidates if ep.ready]

    def _unserved(self, ctx: RequestContext, model: str, w: Waiter) -> GatewayError:
        """The error of a waiter none of whose endpoints is ready: its API's when its state chose
        them (a Responses follow-up whose engine left: 409), else the model's 503."""
        if not w.widen and ctx.api is not None:
            err = ctx.api.unserved_while_queued(ctx)
            if err is not None:
                return err
        return self._no_endpoint(model)

    def _no_endpoint(self, model: str) -> GatewayError:
        """The error of a waiter left with no endpoint: the model's 503, or, once a reload removed
        the model, the 404 a request for it sent now gets."""
        if not self.pool.has_model(model) and self.config.model(model) is None:
            return model_not_found(model)
        return _no_endpoint(model)

    def _waited(self, model: str, rank: int, outcome: str, w: Waiter) -> None:
        """The wait ended (dispatched, shed, cancelled): measured, and said on the request's line."""
        if outcome != "dispatched":
            w.state = outcome
            if w.fut.done() and not w.fut.cancelled():
                w.fut.exception()           # retrieved: no "never retrieved" warning
        waited = max(0.0, self.clock() - w.enqueued)
        self.m.wait.labels(model, PRIORITIES[rank], outcome).observe(waited)
        if w.rec is not None:
            w.rec.extra.update(queue_wait_ms=round(waited * 1000, 3), queue_outcome=outcome)

    def _rejection(self, model: str, s: AdmissionConfig, mq: ModelQueue, rank: int, reason: str,
                   position: int, rec: RequestRecord | None = None, slo: float | None = None) -> GatewayError:
        rate = mq.drain.rate(self.clock())
        secs = retry_after_s(position, rate, s.retry_after_max_s)
        ms = max(1, math.ceil(secs * 1000))
        self.m.shed.labels(model, PRIORITIES[rank], reason).inc()
        if rec is not None:
            rec.extra.update(queue_position=position, retry_after_s=math.ceil(secs))
        headers = {"Retry-After": str(math.ceil(secs)), "retry-after-ms": str(ms),
                   "x-ratelimit-limit-queue": str(s.queue_max),
                   "x-ratelimit-remaining-queue": str(max(0, s.queue_max - len(mq.queue))),
                   "x-ratelimit-reset-queue": fmt_duration(ms), "x-error-admission": reason}
        msg = _MESSAGES[reason].format(model=model, timeout=s.queue_timeout_s, slo=slo or 0.0)
        return GatewayError(429, f"{msg}; retry after {math.ceil(secs)}s", code=reason, headers=headers,
                            error_class=ErrorClass.admission(reason))


def expected_output(ireq: InferenceRequest) -> int:
    """The output tokens a request is expected to produce, for each sequence the engine generates
    (``n`` choices, each prompt of a completion's batch; not ``best_of``, which the engines ignore
    now): its limit when it names one,
    else as many as its prompt (a rough guess, corrected once the answer's usage is known). None of a
    Messages count_tokens request, which generates nothing."""
    if ireq.path == COUNT_TOKENS:
        return 0
    data = ireq.data
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        v = data.get(key)
        if type(v) is int and v >= 0:
            return v * ireq.sequences
    return ireq.prompt_tokens_est * ireq.fan     # the batch's prompts together, each ``fan`` times


def request_cost(ireq: InferenceRequest) -> float:
    """What serving the request adds to its user's counter: prompt tokens and twice the output."""
    return float(ireq.prompt_tokens_est + OUTPUT_WEIGHT * expected_output(ireq))


# an engine's error answer that is about the request (vLLM's 400 for a prompt past its context, a
# 404 for an unknown adapter), from the engine that serves it or its P/D prefill
_REFUSED_BY_ENGINE = frozenset({ErrorClass.UPSTREAM_STATUS, ErrorClass.PD_PREFILL_HTTP_STATUS})


def drained(rec: RequestRecord) -> bool:
    """Whether a request that took a slot counts in the drain rate: an engine answered it (a 2xx,
    or a 4xx about the request other than a 429's backpressure), or its client left while an engine
    worked on it. Not a failure, of the engine (a 5xx, an error event, a watchdog) or of the way to it
    (a refused connection, a timeout, no socket): a failing engine frees its slots fast and serves
    nobody, and a wait computed from its failures would promise the queue a service it does not get."""
    ec = rec.error_class
    if ec is None or ec is ErrorClass.CLIENT_CANCEL:
        return True
    return ec in _REFUSED_BY_ENGINE and rec.status < 500 and rec.status != 429


def served_cost(ctx: RequestContext) -> float | None:
    """What serving a request that ended cost its user's counter, from what the engine reported:
    its prompt and twice its completion tokens as the answer's usage counts them (a prompt it did
    not count: the estimate); a stream broken off before its usage, the estimate and the generated
    events it had sent. Nothing when no engine generated anything: never routed (its client left
    after its turn came), or an error answer before any token (the engine refused the request, as
    vLLM's 400 for a prompt past its context or a 501, could not be reached, or broke off first;
    its client may have left on reading the error), or a Messages count_tokens, which generates
    nothing whatever its answer.
    None when it cannot be told (a client that left a whole answer): the charge stands."""
    rec, ireq = ctx.rec, ctx.ireq
    if ireq is None or ctx.charges.in_flight is None or ireq.path == COUNT_TOKENS:
        return 0.0
    if rec.prompt_tokens is not None or rec.completion_tokens is not None:
        completion = rec.completion_tokens or 0
        if not rec.delivered and rec.streamed_events > completion:
            completion = rec.streamed_events   # a stream cut after an early usage (a Messages stream's start)
        prompt = rec.prompt_tokens if rec.prompt_tokens is not None else ireq.prompt_tokens_est
        return float(prompt + OUTPUT_WEIGHT * completion)
    if rec.streamed_events:
        return float(ireq.prompt_tokens_est + OUTPUT_WEIGHT * rec.streamed_events)
    if rec.status >= 400 and rec.status != 499 or rec.error_class not in (None, ErrorClass.CLIENT_CANCEL):
        return 0.0          # an error answer, or an error event its client may have left on
    return None


def _no_endpoint(model: str) -> GatewayError:
    return GatewayError(503, f"no ready endpoint for model {model}", code="service_unavailable",
                        headers={"Retry-After": "5"}, header=("x-error-no-model-backends", "true"),
                        error_class=ErrorClass.NO_ENDPOINT)


class _AdmissionState(Collector):
    """Queue depth, held bytes, drain rate per model; saturation and headroom per endpoint."""

    def __init__(self, admission: Admission) -> None:
        self.a = admission

    def collect(self):
        a = self.a
        depth = GaugeMetricFamily("switchyard_admission_queue_depth", "Requests waiting in the admission queue",
                                  labels=["model", "priority"])
        held = GaugeMetricFamily("switchyard_admission_queue_bytes", "Request body bytes the admission queue holds",
                                 labels=["model"])
        drain = GaugeMetricFamily("switchyard_admission_drain_rate",
                                  "Requests per second the model's endpoints answer, failures not counted (what Retry-After is computed from)",
                                  labels=["model"])
        sat = GaugeMetricFamily("switchyard_endpoint_saturated",
                                "1 when admission control sees the endpoint as saturated", labels=["model", "endpoint"])
        room = GaugeMetricFamily("switchyard_endpoint_admission_headroom",
                                 "Requests the endpoint can take before it is saturated (capped at 1e6)",
                                 labels=["model", "endpoint"])
        cap = GaugeMetricFamily("switchyard_endpoint_admission_capacity",
                                "Running slots admission control counts on the endpoint, and where the figure "
                                "comes from: queued (seen queueing), told (the engine's cap), slow_start",
                                labels=["model", "endpoint", "source"])
        now = a.clock()
        for model in a.tracked():
            mq = a._models[model]
            for rank, name in enumerate(PRIORITIES):
                depth.add_metric([model, name], mq.queue.count(rank))
            held.add_metric([model], mq.queue.bytes)
            drain.add_metric([model], mq.drain.rate(now))
            th = a._thresholds.get(model)
            if th is None:
                continue
            for ep in a.pool.endpoints(model):
                e = estimate(ep, th, now)
                sat.add_metric([model, ep.name], 1 if e.saturated else 0)
                room.add_metric([model, ep.name], min(e.headroom, 1_000_000))
                if th.engine_signals:
                    b = baseline(ep)
                    cap.add_metric([model, ep.name, b.source], b.cap(th))
        yield from (depth, held, drain, sat, room, cap)


def _bad_priority() -> GatewayError:
    return GatewayError(400, "x-priority must be one of critical, standard, sheddable", param="x-priority",
                        code="invalid_priority", error_class=ErrorClass.VALIDATION)
