"""Retries: another endpoint, only before the first byte reached the client, within a budget.

A leg whose answer the client has not seen yet may be sent again to a different endpoint when it
failed with a fault (refused or reset connection with nothing received, a 5xx other than 501, 503
and 529) or was pushed back (429, 503, 529) while another candidate has headroom. Once the response's head
went to the client nothing is retried (continuation after that is another matter). A header
timeout is not retried: the engine may still be working on it, and the wait is already spent.

**Budget.** Retries of one model may be at most ``budget_percent`` of its requests in the last
``budget_window_s`` seconds, plus ``budget_min`` (so that a quiet model can still retry). When the
fleet is failing, retries cannot multiply the load on it. ``max_retries`` bounds one request.

**Headroom** for a backpressure retry: the other endpoint's fresh engine metrics show an empty
waiting queue, or, without fresh metrics, it has fewer of this gateway's requests in flight than the
endpoint that pushed back.

The response carries ``x-retries: N`` when it was retried, and the log line ``retries`` (and
``retry_causes``). Denied retries are counted by reason (``switchyard_retries_denied_total``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Annotated

from msgspec import Meta

from gateway.config.block import Block
from gateway.endpoints import Endpoint
from gateway.observability.metrics import Counter, GatewayMetrics
from gateway.pipeline.context import RequestContext
from gateway.resilience.outcome import Outcome
from gateway.upstream.h1client import UpstreamError, UpstreamResponse

_BUCKETS = 10


class RetryConfig(Block):
    """The ``retry:`` block (global, and per model: a model's block sets only the keys it names)."""

    enabled: Annotated[bool, Meta(description="Send a failed request again to another endpoint while nothing of the answer reached the client.")] = True
    max_retries: Annotated[int, Meta(ge=0, description="Retries of one request at most.")] = 2
    budget_percent: Annotated[float, Meta(ge=0, le=100, description="Retries of a model at most this percent of its requests in the budget window (plus budget_min).")] = 20.0
    budget_min: Annotated[int, Meta(ge=0, description="Retries always allowed per budget window, so a quiet model can still retry; with --workers N, each worker's.")] = 5
    budget_window_s: Annotated[float, Meta(gt=0, description="Window of the retry budget, in seconds.")] = 10.0
    on_backpressure: Annotated[bool, Meta(description="Also retry a 429 or 503 answer, on an endpoint with headroom.")] = True


class RetryBudget:
    """Requests and retries of one model over a sliding window of time buckets."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.bucket_s = window_s / _BUCKETS
        self.clock = clock
        self.requests = [0] * _BUCKETS
        self.retries = [0] * _BUCKETS
        self.stamps = [-1] * _BUCKETS

    def _slot(self) -> int:
        tick = int(self.clock() / self.bucket_s)
        i = tick % _BUCKETS
        if self.stamps[i] != tick:
            self.stamps[i], self.requests[i], self.retries[i] = tick, 0, 0
        return i

    def _sums(self) -> tuple[int, int]:
        tick = int(self.clock() / self.bucket_s)
        live = [j for j in range(_BUCKETS) if tick - self.stamps[j] < _BUCKETS]
        return sum(self.requests[j] for j in live), sum(self.retries[j] for j in live)

    def request(self) -> None:
        self.requests[self._slot()] += 1

    def allows(self, cfg: RetryConfig) -> bool:
        requests, retries = self._sums()
        return retries < cfg.budget_min + cfg.budget_percent / 100.0 * requests

    def spend(self) -> None:
        self.retries[self._slot()] += 1


class RetryMetrics:
    def __init__(self, registry) -> None:
        self.denied = Counter("switchyard_retries_denied",
                              "Retries not made: budget (the retry budget was spent), max_retries, no_endpoint "
                              "(no other ready endpoint, or none with headroom for backpressure)",
                              ["model", "reason"], registry=registry)
        self.causes = Counter("switchyard_retry_causes", "Retries by what the failed leg met",
                              ["model", "cause"], registry=registry)


def has_headroom(ep: Endpoint, than: Endpoint, metrics_max_age: float) -> bool:
    m = ep.fresh_metrics(metrics_max_age)
    if m is not None and m.waiting is not None:
        return m.waiting < 1
    return ep.in_flight + ep.remote_in_flight < than.in_flight + than.remote_in_flight


class Retries:
    """The retry policy. ``config_for(model)`` gives the model's ``RetryConfig``."""

    def __init__(self, config_for: Callable[[str], RetryConfig], registry, metrics_max_age: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config_for = config_for
        self.metrics_max_age = metrics_max_age
        self.clock = clock
        self.metrics = RetryMetrics(registry)
        self._budgets: dict[str, tuple[float, RetryBudget]] = {}

    def budget(self, model: str) -> RetryBudget:
        window = self.config_for(model).budget_window_s
        entry = self._budgets.get(model)
        if entry is None or entry[0] != window:
            entry = self._budgets[model] = (window, RetryBudget(window, self.clock))
        return entry[1]

    def reconfigure(self, config_for: Callable[[str], RetryConfig], metrics_max_age: float | None = None) -> None:
        """A reload: new settings (and ``routing.metrics_max_age_s``, the age within which an
        engine's queue is read); a model whose ``budget_window_s`` changed starts a new budget
        (the others keep theirs), so ``request`` needs no look at the config."""
        self.config_for = config_for
        if metrics_max_age is not None:
            self.metrics_max_age = metrics_max_age
        self._budgets = {m: e for m, e in self._budgets.items() if config_for(m).budget_window_s == e[0]}

    def request(self, model: str) -> None:
        """A request entered the retry-capable path: it adds to the model's budget."""
        entry = self._budgets.get(model)
        (entry[1] if entry is not None else self.budget(model)).request()

    def others(self, model: str, outcome: Outcome, failed: Endpoint, retries: int,
               candidates: Sequence[Endpoint], tried: Sequence[Endpoint]) -> list[Endpoint] | None:
        """The endpoints a retry may go to after ``failed`` met ``outcome`` (the caller has checked
        that nothing reached the client), or ``None`` when the request must not be retried. The
        budget is spent here: the caller routes among the endpoints returned."""
        cfg = self.config_for(model)
        if not cfg.enabled or not outcome.retryable:
            return None
        if outcome is Outcome.BACKPRESSURE and not cfg.on_backpressure:
            return None
        if retries >= cfg.max_retries:
            self.metrics.denied.labels(model, "max_retries").inc()
            return None
        others = [c for c in candidates if c.ready and c not in tried]
        if outcome is Outcome.BACKPRESSURE:
            others = [c for c in others if has_headroom(c, failed, self.metrics_max_age)]
        if not others:
            self.metrics.denied.labels(model, "no_endpoint").inc()
            return None
        budget = self.budget(model)
        if not budget.allows(cfg):
            self.metrics.denied.labels(model, "budget").inc()
            return None
        budget.spend()
        return others

    def reroute(self, ctx: RequestContext, routing, metrics: GatewayMetrics, candidates: Sequence[Endpoint],
                tried: list[Endpoint], outcome: Outcome, cause: str) -> Endpoint | None:
        """After the last endpoint in ``tried`` met ``outcome`` (nothing reached the client): the
        endpoint to try next, chosen by the request's router among the allowed others and charged,
        or ``None``. ``routing`` is the live generation's ``gateway.pipeline.routing.Routing``."""
        assert ctx.ireq is not None
        ireq, rec = ctx.ireq, ctx.rec
        others = self.others(ireq.model, outcome, tried[-1], rec.retries, candidates, tried)
        if others is None:
            return None
        self.count(ctx, metrics, tried[-1], cause)
        ctx.trace.route_start()
        ctx.decision = routing.route(ireq, rec.strategy, routing.router_for(rec.strategy), others)
        ctx.trace.routed(ctx.decision, len(others))
        ep = ctx.decision.endpoint
        tried.append(ep)
        ctx.charges.move_in_flight(ep)
        return ep

    def redecode(self, ctx: RequestContext, metrics: GatewayMetrics, decodes: Sequence[Endpoint],
                 tried: list[Endpoint], cause: str) -> Endpoint | None:
        """P/D: the decode leg to the last endpoint in ``tried`` could not be sent (its connection
        was refused), while the prefill's KV waits to be read: the least loaded other ready one of
        ``decodes`` (the prefill's roleset) takes it, charged and made the decision's decode; or
        ``None``, under the same rules and budget as ``reroute``."""
        assert ctx.ireq is not None and ctx.decision is not None
        others = self.others(ctx.ireq.model, Outcome.FAULT, tried[-1], ctx.rec.retries, decodes, tried)
        if others is None:
            return None
        self.count(ctx, metrics, tried[-1], cause)
        ep = min(others, key=lambda e: e.in_flight + e.remote_in_flight)
        ctx.decision = replace(ctx.decision, endpoint=ep)
        tried.append(ep)
        ctx.charges.move_in_flight(ep)
        return ep

    def count(self, ctx: RequestContext, metrics: GatewayMetrics, failed: Endpoint, cause: str) -> None:
        """A retry of the request, on its record, its trace and the metrics."""
        assert ctx.ireq is not None
        model, rec = ctx.ireq.model, ctx.rec
        rec.retries += 1
        rec.extra.setdefault("retry_causes", []).append(cause)
        metrics.child(metrics.retries, model).inc()
        self.metrics.causes.labels(model, cause).inc()
        ctx.trace.event("retry", {"error.type": cause, "switchyard.endpoint": failed.name})


# how long the body of an answer the client will not see is awaited, for its connection to be kept:
# engines send an error's body with its head, and a retry waits for this
DISCARD_WAIT_S = 1.0


async def discard(resp: UpstreamResponse, limit: int) -> None:
    """Drop an answer the client will not see: read its (error) body, bounded in size and in time
    (``DISCARD_WAIT_S``), so the connection can be kept, else close it."""
    try:
        async with asyncio.timeout(DISCARD_WAIT_S):
            await resp.read_limited(limit)
    except (TimeoutError, UpstreamError):
        pass
    finally:
        if resp.at_eof():
            resp.release()
        else:
            resp.close()
