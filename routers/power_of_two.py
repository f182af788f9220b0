"""``power-of-two``: two random candidates, the one with fewer in-flight requests wins.

The "power of two choices" gets most of least-request's balance while reading only two counters,
so it costs the same for 8 or 512 endpoints, and replicas of the gateway that do not share counts
do not all pile onto the same global minimum. AIBrix keeps its counters in Redis; here they are
the gateway's own in-flight counts (plus the other replicas' published counts, when shared state
is on), charged in the same step as the decision.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.endpoints import Endpoint
from gateway.request import InferenceRequest
from routers.base import Decision, Router, RouterContext


class PowerOfTwoRouter(Router):
    """Not a scoring router: its choice is random by design and would only add noise to a mix."""

    name = "power-of-two"

    def __init__(self, ctx: RouterContext) -> None:
        self._random = ctx.rng.random

    def route(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> Decision:
        return Decision(self._choose(candidates), self.name)

    def _choose(self, candidates: Sequence[Endpoint]) -> Endpoint:
        n = len(candidates)
        if n == 1:
            return candidates[0]
        i = int(self._random() * n)
        j = int(self._random() * (n - 1))
        if j >= i:
            j += 1                          # two distinct indexes, uniformly
        a, b = candidates[i], candidates[j]
        if b.in_flight + b.remote_in_flight < a.in_flight + a.remote_in_flight:
            return b
        return a                            # equal: a, itself a uniform pick
