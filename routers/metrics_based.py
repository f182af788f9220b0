"""Strategies driven by the engines' own metrics: least-kv-cache, least-waiting, throughput,
least-latency.

They read ``Endpoint.metrics``, the scraper's latest ``EngineMetrics`` snapshot. Rules common to all:

* A snapshot older than ``RoutingSettings.metrics_max_age_s`` counts as missing. When no candidate
  has a usable value, the strategy routes like ``least-request`` and counts a fallback with reason
  ``no_metrics`` (never scraped, or the engine does not report the signal) or ``stale_metrics``
  (snapshots exist but are too old). An endpoint without one among endpoints with one is chosen
  instead of the best scored when it has fewer requests in flight (at random when as many), and
  the fallback is counted with its reason: left out, it would get nothing while its numbers are
  missing. (In a weighted list it scores ``None`` and takes the strategy's share on the same
  condition; the list counts the fallback when it chooses it.)
* Between two scrapes the snapshot does not move, so a burst would herd onto the endpoint that
  looked best at the last scrape (AIBrix issue #2422 in another guise). Each router therefore adds
  what *it* has sent to an endpoint since that endpoint's current snapshot (requests and their
  estimated prompt tokens), in the unit of its signal; ``throughput``, whose counters lag by a
  whole window, uses what it sent within that window instead.
* Exact ties go to the endpoint with the fewest gateway in-flight requests, then uniformly at
  random.

Unlike AIBrix (aibrix-gateway.md §1.3) none of them silently degrades to random: ``least-kv-cache``
reads the one KV gauge engines have (vLLM ``kv_cache_usage_perc``, SGLang ``token_usage``), and
``throughput`` / ``least-latency`` compute their rates and means from the engines' counters and
histograms over ``metrics_window_s``, without Prometheus.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from gateway.endpoints import Endpoint, EngineMetrics
from gateway.request import InferenceRequest
from routers.base import Decision, RouterContext, ScoringRouter
from routers.simple import LeastRequestRouter

# (snapshot the counts apply to, requests sent since, prompt tokens sent since)
_Sent = list

_PRUNE_AT = 64      # a per-endpoint dict is swept of removed endpoints when it outgrows twice this or its last size


def _prune(d: dict[Endpoint, object]) -> int:
    """Drop the endpoints that left the pool (Kubernetes pods come and go for months: a dict keyed
    by endpoint must not keep every one it ever saw); returns the size that triggers the next sweep.
    Called when a new endpoint enters ``d``, so amortised O(1) per insertion."""
    for ep in [ep for ep in d if ep.removed]:
        del d[ep]
    return max(_PRUNE_AT, 2 * len(d))


class MetricRouter(ScoringRouter):
    """Shared machinery: freshness, the sent-since-snapshot correction, tie-breaking, fallback.

    Subclasses define ``value(ep, m, sent)``: the score from snapshot ``m`` plus the correction for
    ``sent`` (``None`` or ``[snapshot, requests, tokens]``); ``None`` when ``m`` lacks the signal.
    """

    name = "metric"
    polarity = "least"
    unscored_share = True      # in a weighted list, an engine without a usable value takes its share

    def __init__(self, ctx: RouterContext) -> None:
        self.ctx = ctx
        self.max_age = ctx.settings.metrics_max_age_s
        self.clock = ctx.clock
        self._random = ctx.rng.random
        self._fallback = LeastRequestRouter(ctx)
        self._sent: dict[Endpoint, _Sent] = {}
        self._sweep_at = _PRUNE_AT       # the size of ``_sent`` at which ``_prune`` sweeps it

    def value(self, ep: Endpoint, m: EngineMetrics, sent: _Sent | None) -> float | None:
        raise NotImplementedError

    def prepare(self, candidates: Sequence[Endpoint], cutoff: float) -> None:
        """Hook run once per decision before ``value`` (fleet-wide estimates)."""

    # -- scoring ---------------------------------------------------------------------------------

    def _scores(self, candidates: Sequence[Endpoint]) -> tuple[list[float | None], str | None]:
        cutoff = self.clock() - self.max_age
        self.prepare(candidates, cutoff)
        sent_get = self._sent.get
        value = self.value
        out: list[float | None] = []
        scored = False
        stale = False
        for ep in candidates:
            m = ep.metrics
            if m is None:
                out.append(None)
                continue
            if m.scraped_at < cutoff:
                stale = True
                out.append(None)
                continue
            sent = sent_get(ep)
            v = value(ep, m, sent if sent is not None and sent[0] is m else None)
            if v is not None:
                if v != v:          # NaN (figures past a double's range): no usable value
                    v = None
                else:
                    scored = True
            out.append(v)
        if scored:
            return out, None
        return out, "stale_metrics" if stale else "no_metrics"

    def score(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float | None]:
        scores, reason = self._scores(candidates)
        if reason is not None:
            self.ctx.on_fallback(self.name, reason)
        return scores

    # -- routing ---------------------------------------------------------------------------------

    def route(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> Decision:
        scores, reason = self._scores(candidates)
        if reason is not None:
            self.ctx.on_fallback(self.name, reason)
            ep = self._fallback.choose(candidates)
        else:
            ep = self._unscored(candidates, scores, self._pick(candidates, scores))
        self.post_route(req, ep)
        return Decision(ep, self.name)

    def _unscored(self, candidates: Sequence[Endpoint], scores: list[float | None], best: Endpoint) -> Endpoint:
        """``best`` (the best scored), or a candidate without a usable value that has fewer requests
        in flight (random among equals, ``best`` included). Left out, an engine whose scrape fails,
        times out or answers nothing usable would get no request for as long as that lasts, however
        loaded the others; so it carries about as many requests as the endpoint the numbers pick,
        by the gateway's own count. Counted as a fallback for the missing value when chosen."""
        low = best.in_flight + best.remote_in_flight
        pick, ties = best, 1
        for ep, s in zip(candidates, scores, strict=True):
            if s is not None:
                continue
            n = ep.in_flight + ep.remote_in_flight
            if n < low:
                pick, low, ties = ep, n, 1
            elif n == low:
                ties += 1
                if self._random() * ties < 1.0:
                    pick = ep
        if pick is not best:
            self.count_unscored(pick)
        return pick

    def count_unscored(self, ep: Endpoint) -> None:
        """Count the fallback of a decision for ``ep``, chosen without a usable value of it (also
        called by weighted lists)."""
        m = ep.metrics
        stale = m is not None and m.scraped_at < self.clock() - self.max_age
        self.ctx.on_fallback(self.name, "stale_metrics" if stale else "no_metrics")

    def _pick(self, candidates: Sequence[Endpoint], scores: list[float | None]) -> Endpoint:
        best: Endpoint | None = None
        best_s = 0.0
        best_load = 0
        ties = 0
        for ep, s in zip(candidates, scores, strict=True):
            if s is None:
                continue
            load = ep.in_flight + ep.remote_in_flight
            if best is None or s < best_s or (s == best_s and load < best_load):
                best, best_s, best_load, ties = ep, s, load, 1
            elif s == best_s and load == best_load:
                ties += 1
                if self._random() * ties < 1.0:
                    best = ep
        assert best is not None
        return best

    def post_route(self, req: InferenceRequest, ep: Endpoint) -> None:
        """Count the decision against ``ep``'s current snapshot (also called by weighted lists)."""
        m = ep.metrics
        if m is None:
            return
        sent = self._sent.get(ep)
        if sent is None or sent[0] is not m:
            if sent is None and len(self._sent) >= self._sweep_at:
                self._sweep_at = _prune(self._sent)
            self._sent[ep] = [m, 1, req.prompt_tokens_est]
        else:
            sent[1] += 1
            sent[2] += req.prompt_tokens_est


class LeastKVCacheRouter(MetricRouter):
    """Lowest KV-cache usage (vLLM ``kv_cache_usage_perc``, SGLang ``token_usage``), plus the prompt
    tokens sent since the snapshot as a share of the pool (when the engine reports its size)."""

    name = "least-kv-cache"

    def value(self, ep: Endpoint, m: EngineMetrics, sent: _Sent | None) -> float | None:
        kv = m.kv_usage
        if kv is None:
            return None
        if sent is not None:
            cap = m.kv_capacity_tokens
            kv += sent[2] / cap if cap else 0.001 * sent[1]
        return kv

    def _scores(self, candidates: Sequence[Endpoint]) -> tuple[list[float | None], str | None]:
        # the generic loop, inlined: this runs for every request and every endpoint
        cutoff = self.clock() - self.max_age
        sent_get = self._sent.get
        out: list[float | None] = []
        scored = stale = False
        for ep in candidates:
            m = ep.metrics
            if m is None or m.kv_usage is None:
                out.append(None)
            elif m.scraped_at < cutoff:
                stale = True
                out.append(None)
            else:
                kv = m.kv_usage
                sent = sent_get(ep)
                if sent is not None and sent[0] is m:
                    cap = m.kv_capacity_tokens
                    kv += sent[2] / cap if cap else 0.001 * sent[1]
                out.append(kv)
                scored = True
        return out, None if scored else ("stale_metrics" if stale else "no_metrics")


class LeastWaitingRouter(MetricRouter):
    """Shortest engine queue (vLLM ``num_requests_waiting``, SGLang ``num_queue_reqs``), plus the
    requests sent since the snapshot."""

    name = "least-waiting"

    def value(self, ep: Endpoint, m: EngineMetrics, sent: _Sent | None) -> float | None:
        w = m.waiting
        if w is None:
            return None
        return w + sent[1] if sent is not None else w

    def _scores(self, candidates: Sequence[Endpoint]) -> tuple[list[float | None], str | None]:
        cutoff = self.clock() - self.max_age
        sent_get = self._sent.get
        out: list[float | None] = []
        scored = stale = False
        for ep in candidates:
            m = ep.metrics
            if m is None or m.waiting is None:
                out.append(None)
            elif m.scraped_at < cutoff:
                stale = True
                out.append(None)
            else:
                sent = sent_get(ep)
                out.append(m.waiting + sent[1] if sent is not None and sent[0] is m else m.waiting)
                scored = True
        return out, None if scored else ("stale_metrics" if stale else "no_metrics")


class _Window:
    """The snapshots of one endpoint within the window, the newest one dropped from before it, and
    values derived from them."""

    __slots__ = ("snaps", "before", "derived_for", "derived")

    def __init__(self) -> None:
        self.snaps: deque[EngineMetrics] = deque()
        self.before: EngineMetrics | None = None
        self.derived_for: EngineMetrics | None = None
        self.derived: tuple = ()


def _increase(new: float | None, old: float | None) -> float | None:
    if new is None or old is None:
        return None
    d = new - old
    return new if d < 0 else d          # a counter that went down: the engine restarted


class WindowedRouter(MetricRouter):
    """A metric router whose signal is computed over ``metrics_window_s`` of snapshots.

    Each new snapshot of an endpoint is appended to its window, whose first is the oldest one at
    or after the window's start; ``derive`` runs once per new snapshot and its result is cached.
    The router sees snapshots only when it routes, so one from before the start may be the last
    it saw before a pause in traffic: counting from it would bring a burst from before the pause
    into the window. With no other snapshot inside the window, the newest alone is used (the
    scraper's last-interval rates and means; ``before``, the newest one dropped, tells whether the
    engine's counters moved at all since).
    """

    def __init__(self, ctx: RouterContext) -> None:
        super().__init__(ctx)
        self.window_s = ctx.settings.metrics_window_s
        self._windows: dict[Endpoint, _Window] = {}
        self._windows_at = _PRUNE_AT

    def derive(self, first: EngineMetrics, last: EngineMetrics, before: EngineMetrics | None) -> tuple:
        raise NotImplementedError

    def derived(self, ep: Endpoint, m: EngineMetrics) -> tuple:
        w = self._windows.get(ep)
        if w is None:
            if len(self._windows) >= self._windows_at:
                self._windows_at = _prune(self._windows)
            w = self._windows[ep] = _Window()
        if w.derived_for is m:
            return w.derived
        snaps = w.snaps
        if not snaps or snaps[-1] is not m:
            if snaps and m.scraped_at < snaps[-1].scraped_at:
                snaps.clear()                  # an older snapshot than we have: start over
                w.before = None
            snaps.append(m)
            start = m.scraped_at - self.window_s
            while len(snaps) > 1 and snaps[0].scraped_at < start:
                w.before = snaps.popleft()
        w.derived_for = m
        w.derived = self.derive(snaps[0], m, w.before)
        return w.derived


class _Demand:
    """What this router sent one endpoint within the window: (time, weighted tokens), and their sum."""

    __slots__ = ("events", "total")

    def __init__(self) -> None:
        self.events: deque[tuple[float, float]] = deque()
        self.total = 0.0


def _max_tokens(req: InferenceRequest) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        v = req.data.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return 0


class ThroughputRouter(WindowedRouter):
    """Least token throughput over the window: 2 · prompt tokens/s + generated tokens/s (AIBrix's 2:1
    weighting of its per-request averages, here as rates from the engines' token counters).

    An engine's counters move only as it works through what it was sent, so alone they lag the
    router's own decisions by up to the whole window, and the endpoint that looked idle would take
    everything for that long. The score is therefore the larger of the engine's rate and the rate
    at which this router sent it work over the same window (2 · estimated prompt tokens +
    ``max_tokens``): its own decisions count at once, other gateways' traffic through the engine's
    counters. With a single snapshot so far, the scraper's last-interval rates are used.
    """

    name = "throughput"

    def __init__(self, ctx: RouterContext) -> None:
        super().__init__(ctx)
        self._demand: dict[Endpoint, _Demand] = {}
        self._demand_at = _PRUNE_AT
        self._now = 0.0

    def derive(self, first: EngineMetrics, last: EngineMetrics, before: EngineMetrics | None) -> tuple:
        dt = last.scraped_at - first.scraped_at
        prompt = gen = None
        if dt > 0:
            dp = _increase(last.prompt_tokens_total, first.prompt_tokens_total)
            dg = _increase(last.generation_tokens_total, first.generation_tokens_total)
            prompt = dp / dt if dp is not None else None
            gen = dg / dt if dg is not None else None
        if prompt is None:
            prompt = last.prompt_throughput
        if gen is None:
            gen = last.gen_throughput
        if prompt is None and gen is None:
            return (None,)
        return (2.0 * (prompt or 0.0) + (gen or 0.0),)

    def prepare(self, candidates: Sequence[Endpoint], cutoff: float) -> None:
        self._now = self.clock()

    def sent_rate(self, ep: Endpoint, now: float) -> float:
        d = self._demand.get(ep)
        if d is None:
            return 0.0
        start = now - self.window_s
        ev = d.events
        while ev and ev[0][0] < start:
            d.total -= ev.popleft()[1]
        if not ev:
            d.total = 0.0
        return d.total / self.window_s

    def value(self, ep: Endpoint, m: EngineMetrics, sent: _Sent | None) -> float | None:
        rate = self.derived(ep, m)[0]
        if rate is None:
            return None
        return max(rate, self.sent_rate(ep, self._now))

    def post_route(self, req: InferenceRequest, ep: Endpoint) -> None:
        d = self._demand.get(ep)
        if d is None:
            if len(self._demand) >= self._demand_at:
                self._demand_at = _prune(self._demand)
            d = self._demand[ep] = _Demand()
        tokens = 2.0 * req.prompt_tokens_est + _max_tokens(req)
        d.events.append((self.clock(), tokens))
        d.total += tokens


class LeastLatencyRouter(WindowedRouter):
    """Lowest expected time to first token.

    expected = recent TTFT + (queue + requests sent since the snapshot) × recent prefill time, where
    over the window: recent TTFT = Δsum/Δcount of the engine's TTFT histogram, recent queue time
    likewise from its queue-time histogram (vLLM ``request_queue_time_seconds``, SGLang
    ``queue_time_seconds``), and prefill time = TTFT − queue time. An engine that produced no first
    token within the window has no recent TTFT: it counts as idle (0) and its prefill time is the
    fleet's average, so its queue still counts.
    """

    name = "least-latency"

    def __init__(self, ctx: RouterContext) -> None:
        super().__init__(ctx)
        self._fleet_service = 0.0

    def derive(self, first: EngineMetrics, last: EngineMetrics, before: EngineMetrics | None) -> tuple:
        ttft = queue = None
        dc = _increase(last.ttft_count, first.ttft_count)
        ds = _increase(last.ttft_sum, first.ttft_sum)
        if first is last:                     # a single snapshot: the scraper's last interval
            if before is None or _increase(last.ttft_count, before.ttft_count) != 0:
                ttft, queue = last.ttft_recent_mean, last.queue_time_recent_mean
            # else no first token since a snapshot from before the window (whose mean the scraper
            # carries over its quiet intervals): idle
        else:
            if dc and ds is not None:
                ttft = ds / dc
            qc = _increase(last.queue_time_count, first.queue_time_count)
            qs = _increase(last.queue_time_sum, first.queue_time_sum)
            if qc and qs is not None:
                queue = qs / qc
        # a mean past a double's range (a broken histogram: a sum of 1e200 over a count of 1e-200) is
        # no mean: as an infinite TTFT it made inf + 0 x inf = NaN, which no comparison is true of
        if ttft is not None and not math.isfinite(ttft):
            ttft = None
        if queue is not None and not math.isfinite(queue):
            queue = None
        service = None
        if ttft is not None:
            service = max(0.0, ttft - (queue or 0.0))
        return (ttft, service)

    def prepare(self, candidates: Sequence[Endpoint], cutoff: float) -> None:
        total, n = 0.0, 0
        for ep in candidates:
            m = ep.metrics
            if m is not None and m.scraped_at >= cutoff:
                service = self.derived(ep, m)[1]
                if service is not None:
                    total += service
                    n += 1
        self._fleet_service = total / n if n else 0.0

    def value(self, ep: Endpoint, m: EngineMetrics, sent: _Sent | None) -> float | None:
        waiting = m.waiting
        if waiting is None:
            return None
        ttft, service = self.derived(ep, m)
        if service is None:
            service = self._fleet_service
        queued = waiting + (sent[1] if sent is not None else 0)
        return (ttft or 0.0) + queued * service
