"""``lora-affinity``: send a request for a LoRA adapter where the adapter is cheapest to run.

An engine serving LoRA keeps ``max_lora`` adapters in GPU slots. A request for an adapter that is
in a slot runs at once; one whose adapter is not needs a free slot (the engine loads the adapter
into it) or waits until a slot frees. The strategy scores each candidate by the adapter's state
there (the scale of llm-d's lora-affinity scorer, with one step added between its first two):

=================================================================== =====
adapter running (the engine's ``running_lora_adapters``, or this gateway's requests in flight)  1.0
adapter probably in a slot (among the last ``max_lora`` adapters this gateway sent there)       0.9
not in a slot, a slot free (fewer active adapters than ``max_lora``, or ``max_lora`` unknown)  0.8
adapter waiting for a slot (``waiting_lora_adapters``)                                          0.6
every slot taken by other adapters                                                              0.0
=================================================================== =====

and combines it with load and prefix affinity::

    score = affinity + lora_prefix_weight · match/100 − lora_load_weight · in_flight/max in_flight

where ``match`` is the prefix index's match for the request, whose keys carry the adapter's name
(an adapter's cached prefixes are its own), and ``in_flight`` counts every gateway replica's
requests. Highest score wins; equal scores are drawn uniformly. The candidates are the endpoints
that serve the adapter (the gateway's LoRA stage, gateway/lora/adapters.py, narrows them and loads the
adapter when none does). A request that names no adapter is scored by load and prefix alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.endpoints import Endpoint
from gateway.request import InferenceRequest
from routers.base import Decision, RouterContext, ScoringRouter

RUNNING, RESIDENT, FREE_SLOT, WAITING, FULL = 1.0, 0.9, 0.8, 0.6, 0.0
STATE_NAMES = {RUNNING: "running", RESIDENT: "resident", FREE_SLOT: "free_slot", WAITING: "waiting", FULL: "full"}


def _load(ep: Endpoint) -> int:
    return ep.in_flight + ep.remote_in_flight


class LoraAffinityRouter(ScoringRouter):
    name = "lora-affinity"
    polarity = "most"

    def __init__(self, ctx: RouterContext) -> None:
        self.ctx = ctx
        s = ctx.settings
        self.max_age = s.metrics_max_age_s
        self.load_weight = s.lora_load_weight
        self.prefix_weight = s.lora_prefix_weight

    def affinity(self, ep: Endpoint, adapter: str) -> float:
        """The adapter's state on ``ep``, as a score (module docstring)."""
        st = ep.adapters
        m = ep.fresh_metrics(self.max_age)
        running = m.lora_running if m is not None and m.lora_running is not None else frozenset()
        waiting = m.lora_waiting if m is not None and m.lora_waiting is not None else frozenset()
        if st.in_flight.get(adapter) or adapter in running:
            return RUNNING
        slots = m.max_lora if m is not None else None
        if slots and adapter in list(st.recent)[-slots:]:
            return RESIDENT
        if adapter in waiting:
            return WAITING
        if not slots:
            return FREE_SLOT
        active = running | waiting | {a for a, n in st.in_flight.items() if n}
        return FREE_SLOT if len(active) < slots else FULL

    def _scores(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> tuple[list[float], list[float],
                                                                                        dict[Endpoint, float]]:
        adapter = req.lora
        aff = [self.affinity(ep, adapter) if adapter is not None else 0.0 for ep in candidates]
        match = self.ctx.prefix_index.match(req, candidates) if self.prefix_weight else {}
        loads = [_load(ep) for ep in candidates]
        top = max(1, max(loads))
        scores = [a + self.prefix_weight * match.get(ep, 0.0) / 100.0 - self.load_weight * n / top
                  for a, ep, n in zip(aff, candidates, loads, strict=True)]
        return scores, aff, match

    def score(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float | None]:
        return list(self._scores(req, candidates)[0])

    def post_route(self, req: InferenceRequest, ep: Endpoint) -> None:
        self.ctx.prefix_index.insert(req, ep)

    def route(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> Decision:
        scores, aff, match = self._scores(req, candidates)
        best = max(scores)
        tied = [i for i, s in enumerate(scores) if s == best]
        i = tied[0] if len(tied) == 1 else self.ctx.rng.choice(tied)
        ep = candidates[i]
        self.post_route(req, ep)
        reason = STATE_NAMES[aff[i]] if req.lora is not None else "no_adapter"
        return Decision(ep, self.name, reason=reason, prefix_match=match.get(ep) if match else None)
