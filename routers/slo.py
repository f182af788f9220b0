"""``slo``: send a request with latency objectives to an endpoint predicted to meet them.

A request states its objectives in milliseconds with ``x-slo-ttft-ms`` (time to first token) and
``x-slo-tpot-ms`` (time per output token after the first); ``InferenceRequest.slo_ttft_ms`` /
``slo_tpot_ms``. For each candidate the router predicts both from the endpoint's latency model
(``routers.latency``, ``RouterContext.latency``: learnt online from what the gateway observed
there) at the load the request would meet there and with the prefix the candidate holds (the
prefix index, or the engines' KV events, as ``prefix-cache`` reads them). Then:

1. for a streamed request, with probability ``slo_exploration``, a uniformly random candidate
   (reason ``slo_explore``): an endpoint predicted too slow gets no traffic, so without it its
   model would never see that it got faster or emptier. A non-streamed answer has no first token
   to time and teaches the models nothing (``gateway.pipeline.slo_learning``): sent exploring, it
   would only risk its objectives;
2. if some candidate lacks the observations its prediction needs (``slo_min_samples``), the
   least loaded candidate (fallback ``no_model``; reason ``slo_no_model``): every endpoint gets
   traffic, so the models fill quickly, and no queue builds on a prefix holder meanwhile;
3. if no request has observed a candidate for ``slo_reobserve_s`` (nor been sent to observe it
   since) and this request can (it streams), that candidate, the one observed longest ago first
   (reason ``slo_reobserve``; one at a time: the next only that long after, unless that one
   observed nothing there, ``LatencyModel.unobserved``): what a model
   predicts too slow gets no request, and with ``slo_exploration: 0`` or little traffic, nothing
   would show it recovered;
4. the candidates predicted to meet every objective the request states, each prediction at most
   ``(1 − slo_margin)`` × its objective, are *feasible*. Among them, those holding the longest
   prefix of the prompt (prefix affinity still counts; a holder that is too loaded is not
   feasible, which replaces prefix-cache's load guards); among those, with ``slo_select: pack``
   (the default) the one with the least room left — the largest predicted share of its
   objective — so loose objectives fill the slower endpoints and the fastest stay free for the
   tightest ones (the Gateway API Inference Extension's "least headroom"); with ``spread`` the
   one with the most room, i.e. the lowest predicted latency. Ties at random. Reason
   ``slo_feasible``;
5. none feasible: the candidate with the smallest predicted share of its objectives (the least
   late), reason and fallback ``slo_infeasible``. Flow control may still refuse the request.

A request without objectives routes exactly as ``prefix-cache`` does (its fallbacks counted under
``slo``). The strategy routes alone: in a weighted list it wins and the rest is ignored, like every
``slo*`` name (``routers.registry.is_exclusive``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from gateway.endpoints import Endpoint
from gateway.request import InferenceRequest
from routers.base import Decision, RouterContext
from routers.prefix_cache import PrefixCacheRouter
from routers.prefix_index import PrefixIndex

__all__ = ["SloRouter"]


class SloRouter(PrefixCacheRouter):
    """Predicted-feasible endpoints first (see the module docstring); ``prefix-cache`` otherwise."""

    name = "slo"

    def __init__(self, ctx: RouterContext, index: PrefixIndex | None = None) -> None:
        super().__init__(ctx, index)
        s = ctx.settings
        self.model = ctx.latency
        self.exploration = s.slo_exploration
        self.reobserve = s.slo_reobserve_s
        self.keep = 1.0 - s.slo_margin
        self.pack = s.slo_select == "pack"

    def decide(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> Decision:
        """As ``prefix-cache``'s: the learning left in ``Decision.learn`` (``route`` runs it at once)."""
        if req.slo_ttft_ms is None and req.slo_tpot_ms is None:
            return super().decide(req, candidates)
        ep, reason, match = self._slo_decide(req, candidates)
        return Decision(ep, self.name, reason=reason, prefix_match=match, learn=partial(self.post_route, req, ep))

    def _slo_decide(self, req: InferenceRequest, candidates: Sequence[Endpoint]
                    ) -> tuple[Endpoint, str, float | None]:
        """The endpoint, the reason, and the endpoint's prefix match (percent)."""
        rand = self._random
        if self.exploration and req.stream and rand() < self.exploration:   # a non-streamed answer teaches nothing
            ep = candidates[int(rand() * len(candidates))]
            return ep, "slo_explore", self._match_of(req, candidates, ep)
        ttft_slo, tpot_slo = req.slo_ttft_ms, req.slo_tpot_ms
        model = self.model
        if not all(model.ready(ep, ttft_slo is not None, tpot_slo is not None) for ep in candidates):
            ep = self._fall_back(candidates, self._loads(candidates), "no_model")
            return ep, "slo_no_model", self._match_of(req, candidates, ep)
        now = self._clock()
        if self.reobserve and req.stream:      # a non-streamed answer has no first token to observe
            ep = model.stalest(candidates, ttft_slo is not None, tpot_slo is not None, now - self.reobserve)
            if ep is not None:
                model.reobserving(ep, now)
                return ep, "slo_reobserve", self._match_of(req, candidates, ep)
        depths, n = self._depths(req, candidates)
        tokens = req.prompt_tokens_est
        scored: list[tuple[Endpoint, int, float]] = []     # (endpoint, match depth, predicted share of the objective)
        for ep in candidates:
            depth = depths.get(ep, 0)
            f = model.features(tokens, ep, tokens * depth / n if n else 0.0, now)
            ttft, tpot = model.predict(ep, f)
            share = 0.0
            if ttft_slo is not None and ttft is not None:
                share = ttft / ttft_slo
            if tpot_slo is not None and tpot is not None:
                share = max(share, tpot / tpot_slo)
            scored.append((ep, depth, share))
        keep = self.keep
        feasible = [s for s in scored if s[2] <= keep]
        if not feasible:
            self.ctx.on_fallback(self.name, "slo_infeasible")
            ep, depth, _ = self._best(scored, least=True)
            return ep, "slo_infeasible", 100.0 * depth / n if n else 0.0
        deepest = max(s[1] for s in feasible)
        if deepest > 0:
            feasible = [s for s in feasible if s[1] == deepest]
        ep, depth, _ = self._best(feasible, least=not self.pack)
        return ep, "slo_feasible", 100.0 * depth / n if n else 0.0

    def _best(self, scored: list[tuple[Endpoint, int, float]], least: bool) -> tuple[Endpoint, int, float]:
        """The entry with the smallest (``least``) or largest share; equal ones uniformly at random."""
        best = scored[0]
        ties = 1
        for s in scored[1:]:
            if (s[2] < best[2]) if least else (s[2] > best[2]):
                best, ties = s, 1
            elif s[2] == best[2]:
                ties += 1
                if self._random() * ties < 1.0:
                    best = s
        return best

    def _match_of(self, req: InferenceRequest, candidates: Sequence[Endpoint], ep: Endpoint) -> float:
        depths, n = self._depths(req, candidates)
        return 100.0 * depths.get(ep, 0) / n if n else 0.0
