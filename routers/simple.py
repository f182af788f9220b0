"""Routers that need no engine metrics: random, round-robin, least-request.

All three read only gateway-local state (the candidate list and ``Endpoint.in_flight``), so they
work from the first request, before any scrape, and cost one pass over the candidates.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.endpoints import Endpoint
from gateway.request import InferenceRequest
from routers.base import Decision, Router, RouterContext, ScoringRouter


class RandomRouter(Router):
    """Uniform choice. Not a scoring router: a random score would only add noise to a mix."""

    name = "random"

    def __init__(self, ctx: RouterContext) -> None:
        self._rng = ctx.rng

    def route(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> Decision:
        return Decision(self._rng.choice(candidates), self.name)

    decide = route      # nothing to learn after the choice: the pipeline's call is ``route`` itself


class RoundRobinRouter(Router):
    """Cycles through the candidates in the order given, with one counter per model.

    The cycle is exact while the candidate list is stable; when it changes (an endpoint turns
    unhealthy or is added) the counter simply continues modulo the new length.
    """

    name = "round-robin"

    def __init__(self, ctx: RouterContext) -> None:
        self._next: dict[str, int] = {}

    def route(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> Decision:
        n = len(candidates)
        i = self._next.get(req.model, 0) % n
        self._next[req.model] = (i + 1) % n
        return Decision(candidates[i], self.name)

    decide = route      # nothing to learn after the choice: the pipeline's call is ``route`` itself


class LeastRequestRouter(ScoringRouter):
    """Fewest gateway in-flight requests; equal minima are broken uniformly at random.

    In-flight is the gateway's own count (charged in the same synchronous step as the decision),
    so it is exact for this replica and needs no scrape. Random tie-breaking keeps replicas of the
    gateway, which do not see each other's counts, from all picking the same first endpoint.
    With a shared state backend, ``remote_in_flight`` adds the other replicas' counts (published
    every ``state.sync_interval_s``); the local charge stays exact between syncs.
    """

    name = "least-request"
    polarity = "least"

    def __init__(self, ctx: RouterContext) -> None:
        self._random = ctx.rng.random

    def route(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> Decision:
        return Decision(self.choose(candidates), self.name)

    decide = route      # nothing to learn after the choice: the pipeline's call is ``route`` itself

    def choose(self, candidates: Sequence[Endpoint]) -> Endpoint:
        """The least loaded candidate (the fallback of strategies that lack their signal)."""
        # One pass finds the minimum and counts its ties, with no allocation. Only when there are
        # ties, one random draw picks the k-th and a partial scan finds it. Measured at 512
        # candidates this beats reservoir sampling (a draw per tie) by 2x when all are tied (an idle
        # cluster) and costs ~2 us more when none are.
        it = iter(candidates)
        best = next(it)
        low = best.in_flight + best.remote_in_flight
        ties = 1
        for ep in it:
            n = ep.in_flight + ep.remote_in_flight
            if n < low:
                best, low, ties = ep, n, 1
            elif n == low:
                ties += 1
        if ties == 1:
            return best
        k = int(self._random() * ties)
        for ep in candidates:
            if ep.in_flight + ep.remote_in_flight == low:
                if k == 0:
                    return ep
                k -= 1
        return best     # unreachable unless in_flight changed under us

    def score(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float | None]:
        return [ep.in_flight + ep.remote_in_flight for ep in candidates]
