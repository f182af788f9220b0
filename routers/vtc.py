"""``vtc-basic``: per-user token-count fairness (AIBrix's basic Virtual Token Counter router).

Every user's recent token consumption is counted over a sliding window (``vtc_window_s``):
estimated prompt tokens × 1 + estimated output tokens × 2, output = 1.5 × prompt as in AIBrix. Users
are then laid out over the endpoints by that count: the lightest user's target is the first
endpoint (in address order), the heaviest user's the last, the others in between, so heavy users
share engines with each other rather than with light ones. The score of an endpoint is

    fairness_weight · |rank − target| / (n − 1)  +  utilization_weight · in-flight / max in-flight

and the lowest wins (ties at random). Then the request's tokens are added to the user's count.

Differences from AIBrix (aibrix-gateway.md §1.3), on purpose: ranks follow the endpoints' address
order, not a per-request shuffle (which made AIBrix's fairness term random); the target spans all
endpoints by the user's position between the lightest and the heaviest active user (AIBrix's
``tokens / ((min + max) / 2)`` only ever reaches the first three); when every active user weighs the
same the fairness term is neutral; load is the gateway's in-flight count, exact and always present.

No ``user`` (header or body field): a uniformly random endpoint, counted as fallback ``no_user``.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence

from gateway.endpoints import Endpoint
from gateway.request import InferenceRequest
from routers.base import Decision, RouterContext, ScoringRouter

MAX_USERS = 10_000           # users tracked at once (least recently active forgotten first)
_RANGE_EVERY_S = 1.0         # the lightest/heaviest user is recomputed at most this often
_RANK_MEMO = 64              # candidate lists whose address ranks are remembered
OUTPUT_PER_INPUT = 1.5
INPUT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


class _UserTokens:
    __slots__ = ("events", "total")

    def __init__(self) -> None:
        self.events: deque[tuple[float, float]] = deque()
        self.total = 0.0

    def prune(self, cutoff: float) -> float:
        ev = self.events
        while ev and ev[0][0] < cutoff:
            self.total -= ev.popleft()[1]
        if not ev:
            self.total = 0.0
        return self.total


def request_tokens(req: InferenceRequest) -> float:
    prompt = float(req.prompt_tokens_est)
    return INPUT_WEIGHT * prompt + OUTPUT_WEIGHT * OUTPUT_PER_INPUT * prompt


class VTCRouter(ScoringRouter):
    name = "vtc-basic"
    polarity = "least"
    fairness_weight = 1.0
    utilization_weight = 1.0

    def __init__(self, ctx: RouterContext) -> None:
        self.ctx = ctx
        self.clock = ctx.clock
        self.window_s = ctx.settings.vtc_window_s
        self._random = ctx.rng.random
        self._choice = ctx.rng.choice
        self._users: OrderedDict[str, _UserTokens] = OrderedDict()
        self._range = (0.0, 0.0)
        self._range_at = -math.inf
        self._ranks: OrderedDict[tuple, list[int]] = OrderedDict()

    # -- accounting ------------------------------------------------------------------------------

    def user_tokens(self, user: str, now: float | None = None) -> float:
        u = self._users.get(user)
        if u is None:
            return 0.0
        now = self.clock() if now is None else now
        return u.prune(now - self.window_s)

    def _user_range(self, now: float) -> tuple[float, float]:
        if now - self._range_at >= _RANGE_EVERY_S:
            cutoff = now - self.window_s
            totals = []
            for name in list(self._users):
                t = self._users[name].prune(cutoff)
                if t <= 0.0:
                    del self._users[name]
                else:
                    totals.append(t)
            self._range = (min(totals), max(totals)) if totals else (0.0, 0.0)
            self._range_at = now
        return self._range

    def post_route(self, req: InferenceRequest, ep: Endpoint) -> None:
        user = req.user
        if not user:
            return
        now = self.clock()
        u = self._users.get(user)
        if u is None:
            u = self._users[user] = _UserTokens()
            if len(self._users) > MAX_USERS:
                self._users.popitem(last=False)
        else:
            self._users.move_to_end(user)
        tokens = request_tokens(req)
        u.events.append((now, tokens))
        u.total += tokens
        total = u.prune(now - self.window_s)
        if len(self._users) == 1:          # the only user is the lightest and the heaviest
            self._range = (total, total)
            return
        lo, hi = self._range               # keep the cached range honest between recomputations
        self._range = (min(lo, total) if lo else total, max(hi, total))

    # -- scoring ---------------------------------------------------------------------------------

    def _address_ranks(self, candidates: Sequence[Endpoint]) -> list[int]:
        key = tuple(candidates)
        ranks = self._ranks.get(key)
        if ranks is None:
            order = sorted(range(len(candidates)), key=lambda i: candidates[i].address)
            ranks = [0] * len(candidates)
            for r, i in enumerate(order):
                ranks[i] = r
            self._ranks[key] = ranks
            if len(self._ranks) > _RANK_MEMO:
                self._ranks.popitem(last=False)
        return ranks

    def _scores(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float] | None:
        user = req.user
        if not user:
            return None
        now = self.clock()
        mine = self.user_tokens(user, now)
        lo, hi = self._user_range(now)
        n = len(candidates)
        span = max(1, n - 1)
        ranks = self._address_ranks(candidates)
        loads = [ep.in_flight + ep.remote_in_flight for ep in candidates]
        top = max(1, max(loads))
        wf, wu = self.fairness_weight, self.utilization_weight
        if hi > lo:
            target = (n - 1) * min(1.0, max(0.0, (mine - lo) / (hi - lo)))
            return [wf * abs(r - target) / span + wu * load / top for r, load in zip(ranks, loads, strict=True)]
        return [wu * load / top for load in loads]

    def score(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float | None]:
        scores = self._scores(req, candidates)
        if scores is None:
            self.ctx.on_fallback(self.name, "no_user")
            return [None] * len(candidates)
        return list(scores)

    def route(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> Decision:
        scores = self._scores(req, candidates)
        if scores is None:
            self.ctx.on_fallback(self.name, "no_user")
            return Decision(self._choice(candidates), self.name)
        best_i, best, ties = 0, scores[0], 1
        for i in range(1, len(scores)):
            s = scores[i]
            if s < best:
                best_i, best, ties = i, s, 1
            elif s == best:
                ties += 1
                if self._random() * ties < 1.0:
                    best_i = i
        ep = candidates[best_i]
        self.post_route(req, ep)
        return Decision(ep, self.name)
