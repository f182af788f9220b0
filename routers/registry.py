"""Strategy names → routers: the weighted-list grammar, the registry, the weighted combination.

A strategy string is what a request's ``routing-strategy`` header, a model's default or the
global default says: one name, or a weighted list ``prefix-cache:2,least-request:1``. The
registry turns a string into a ready ``Router`` once and caches it, so on the hot path resolving
the strategy is one dict lookup. Router instances are shared: ``least-request`` alone and
``least-request`` inside a list are the same object, so stateful strategies (a prefix index,
round-robin counters) keep one state per gateway.

Adding a strategy is one ``register`` call (see ``default_registry``).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Collection, Sequence
from functools import lru_cache, partial

from gateway.endpoints import Endpoint
from gateway.request import InferenceRequest
from routers.base import Decision, Router, RouterContext, ScoringRouter, learnt
from routers.lora import LoraAffinityRouter
from routers.metrics_based import LeastKVCacheRouter, LeastLatencyRouter, LeastWaitingRouter, ThroughputRouter
from routers.pd import PDRouter
from routers.power_of_two import PowerOfTwoRouter
from routers.prefix_cache import PrefixCacheRouter
from routers.session import SessionAffinityRouter
from routers.simple import LeastRequestRouter, RandomRouter, RoundRobinRouter
from routers.slo import SloRouter
from routers.vtc import VTCRouter

MAX_WEIGHT = 1_000_000
# Distinct strategy strings cached per registry. The header is client-controlled, so the cache is
# bounded (oldest entry evicted) rather than growing with every spelling a client invents.
MAX_CACHED_SPECS = 1024

_WEIGHT = re.compile(r"[0-9]+")
_WEIGHT_DIGITS = len(str(MAX_WEIGHT))
_NAME = re.compile(r"[a-z0-9][a-z0-9_.\-]*")

RouterFactory = Callable[[RouterContext], Router]


class StrategyError(ValueError):
    """An invalid routing strategy string. The message starts with ``incorrect routing strategy``
    (AIBrix's wording); the gateway answers 400 with ``x-error-routing: true``."""

    def __init__(self, spec: str, reason: str) -> None:
        super().__init__(f"incorrect routing strategy {spec}: {reason}")
        self.spec = spec
        self.reason = reason


def is_exclusive(name: str) -> bool:
    """``pd`` and the ``slo*`` family route alone: in a list, such an entry wins and the rest is
    ignored (AIBrix semantics)."""
    return name == "pd" or name.startswith("slo")


def parse_strategy(spec: str, known: Collection[str] | None = None) -> list[tuple[str, int]]:
    """Parse ``name[:weight],...`` into ``[(name, weight), ...]`` in the given order.

    Names are trimmed and lower-cased; a missing weight is 1; weights are integers 0..1,000,000
    and 0 drops the entry. With ``known`` every name must be in it. An exclusive entry (``pd``,
    ``slo*``) is returned alone. Raises ``StrategyError`` on an empty item, a bad separator
    (``a:1:2``), a non-integer, negative or out-of-range weight, all weights 0, a repeated name,
    or an unknown name.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise StrategyError(spec, "empty")
    entries: list[tuple[str, int]] = []
    seen: set[str] = set()
    for raw in spec.split(","):
        parts = raw.split(":")
        if len(parts) > 2:
            raise StrategyError(spec, f"bad separator in {raw.strip()!r}")
        name = parts[0].strip().lower()
        if not name:
            raise StrategyError(spec, "empty item")
        if not _NAME.fullmatch(name):
            raise StrategyError(spec, f"bad name {name!r}")
        weight = 1
        if len(parts) == 2:
            w = parts[1].strip()
            # leading zeros dropped before int(): a weight in bounds has a few digits, and int()
            # refuses more than 4300 (a ValueError that is not a StrategyError)
            if not _WEIGHT.fullmatch(w) or len(w := w.lstrip("0") or "0") > _WEIGHT_DIGITS:
                raise StrategyError(spec, f"weight of {name!r} must be an integer 0..{MAX_WEIGHT}")
            weight = int(w)
            if weight > MAX_WEIGHT:
                raise StrategyError(spec, f"weight of {name!r} must be an integer 0..{MAX_WEIGHT}")
        if known is not None and name not in known:
            raise StrategyError(spec, f"unknown strategy {name!r}")
        if name in seen:
            raise StrategyError(spec, f"{name!r} appears twice")
        seen.add(name)
        if weight:
            entries.append((name, weight))
    if not entries:
        raise StrategyError(spec, "all weights are 0")
    for entry in entries:
        if is_exclusive(entry[0]):
            return [entry]
    return entries


def canonical_strategy(entries: Sequence[tuple[str, int]]) -> str:
    """The one spelling of parsed ``entries`` (``parse_strategy``): one name alone whatever its
    weight; a list with its weights divided by their greatest common divisor, a weight of 1
    left out. Every spelling of a strategy (case, spaces, weights of one name) is the same
    string, so a client's spelling never makes a metric label of its own."""
    if len(entries) == 1:
        return entries[0][0]
    g = math.gcd(*(w for _, w in entries))
    return ",".join(name if w == g else f"{name}:{w // g}" for name, w in entries)


@lru_cache(maxsize=256)     # a few spellings per gateway, each read at every request's end
def strategy_label(spelling: str) -> str:
    """The strategy as a metric label: a canonical spelling (``canonical_strategy``) without its
    weights, its names sorted (``least-request,prefix-cache``). The weights are the client's to
    vary (the ``routing-strategy`` header), so with them every weighting a client sent would be a
    series of its own; without them there are at most as many labels as sets of strategy names."""
    if "," not in spelling:
        return spelling
    return ",".join(sorted(item.split(":", 1)[0] for item in spelling.split(",")))


def _unscored(candidates: Sequence[Endpoint], scores: list[float | None], top: float, coef: float,
              total: list[float]) -> None:
    """A part's full share to each candidate it could not score (an engine whose /metrics fail) that
    has no more requests in flight than the least loaded of those it scored best, as the strategy
    alone chooses such an endpoint; at 0 it lost every decision to the best scored one whenever
    that part weighed more than the rest of the list, for as long as its scrape failed."""
    low = math.inf
    for ep, s in zip(candidates, scores, strict=True):
        if s == top:
            n = ep.in_flight + ep.remote_in_flight
            if n < low:
                low = n
    for i, (ep, s) in enumerate(zip(candidates, scores, strict=True)):
        if (s is None or s != s or s in (math.inf, -math.inf)) and ep.in_flight + ep.remote_in_flight <= low:
            total[i] += coef


class WeightedRouter(ScoringRouter):
    """A weighted combination of scoring routers (AIBrix's multi-strategy router).

    Per strategy the scores are min–max normalised to [0, 1], better = higher: polarity "least"
    gives ``(max - s) / (max - min)``, "most" gives ``(s - min) / (max - min)``; when all valid
    scores are equal each gets 1.0; ``None``, NaN and ±Inf get 0, or for a part whose
    ``unscored_share`` is set (the engine-metric strategies) 1.0 when the candidate has no more
    requests in flight than the least loaded of the best scored (``_unscored``). Each strategy's normalised score
    is multiplied by ``weight / sum(weights)`` and the products are summed; the highest total wins.

    Exact ties: with an ``rng`` (the registry passes ``RouterContext.rng``) one of the tied
    candidates is picked uniformly, so the pipeline does not have to shuffle the candidates; with
    ``rng=None`` the first tied candidate in the given order wins (AIBrix's rule, where the
    candidate list was shuffled beforehand).

    When the chosen candidate had no value from such a part while others had, that part counts a
    fallback (``count_unscored``), as it does routing alone.

    After the choice, each part's ``post_route(req, endpoint)`` hook is called, so a strategy that
    learns from decisions (a prefix index) learns from combined decisions too, and each part's
    ``response_headers(req, endpoint)`` adds its response headers. Only parts that override a hook
    are called (the base class's hooks do nothing).
    """

    polarity = "most"

    def __init__(self, name: str, parts: Sequence[tuple[ScoringRouter, int]],
                 rng: random.Random | None = None) -> None:
        if not parts:
            raise ValueError("WeightedRouter needs at least one part")
        total = sum(w for _, w in parts)
        if total <= 0:
            raise ValueError("WeightedRouter weights must sum to a positive number")
        self.name = name
        self.parts = [(r, w / total, _polarity_most(r)) for r, w in parts]
        self._random = rng.random if rng is not None else None
        self._learners = [r for r, _ in parts if type(r).post_route is not Router.post_route]
        self._headers = [r for r, _ in parts if type(r).response_headers is not Router.response_headers]

    def score(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float | None]:
        """The combined score of every candidate (higher is better, within [0, 1])."""
        return self._total(req, candidates, None)

    def _total(self, req: InferenceRequest, candidates: Sequence[Endpoint],
               unscored: list | None) -> list[float | None]:
        """``score``; the parts that gave some candidates their share without a value (``_unscored``)
        are added to ``unscored`` with their scores, when given."""
        n = len(candidates)
        total = [0.0] * n
        for router, coef, most in self.parts:
            scores = router.score(req, candidates)
            if len(scores) != n:
                raise ValueError(f"router {router.name!r} returned {len(scores)} scores for {n} candidates")
            lo, hi = math.inf, -math.inf
            missing = False
            for s in scores:
                if s is not None and s == s and s not in (math.inf, -math.inf):
                    if s < lo:
                        lo = s
                    if s > hi:
                        hi = s
                else:
                    missing = True
            if lo > hi:
                continue                     # nobody scored: this strategy adds 0 to everyone
            span = hi - lo
            if missing and getattr(router, "unscored_share", False):
                _unscored(candidates, scores, hi if most else lo, coef, total)
                if unscored is not None:
                    unscored.append((router, scores))
            for i, s in enumerate(scores):
                if s is None or s != s or s in (math.inf, -math.inf):
                    continue
                if span == 0:
                    total[i] += coef
                elif most:
                    total[i] += coef * (s - lo) / span
                else:
                    total[i] += coef * (hi - s) / span
        return total

    def route(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> Decision:
        return learnt(self.decide(req, candidates))

    def decide(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> Decision:
        """``route`` with the parts' learning (``post_route`` of each) left in ``Decision.learn``."""
        unscored: list = []
        total = self._total(req, candidates, unscored)
        best_i = 0
        best = total[0]
        ties = 1
        rand = self._random
        for i in range(1, len(total)):
            t = total[i]
            if t > best:
                best_i, best, ties = i, t, 1
            elif t == best and rand is not None:
                ties += 1
                if rand() * ties < 1.0:
                    best_i = i
        ep = candidates[best_i]
        for router, scores in unscored:   # a part had no value for the chosen engine: its fallback
            s = scores[best_i]
            if s is None or s != s or s in (math.inf, -math.inf):
                router.count_unscored(ep)
        decision = Decision(ep, self.name, learn=partial(self._learn, req, ep) if self._learners else None)
        for router in self._headers:      # e.g. session-affinity's x-session-id for the chosen endpoint
            decision.headers.update(router.response_headers(req, ep))
        return decision

    def _learn(self, req: InferenceRequest, ep: Endpoint) -> None:
        for router in self._learners:
            router.post_route(req, ep)


def _polarity_most(router: ScoringRouter) -> bool:
    polarity = router.polarity
    if polarity not in ("least", "most"):
        raise ValueError(f"router {router.name!r} has polarity {polarity!r}; expected 'least' or 'most'")
    return polarity == "most"


class RouterRegistry:
    """Known strategies and the routers built for strategy strings.

    ``register(name, factory, scoring=...)`` declares a strategy; ``get(spec)`` validates and
    builds the router for a strategy string on first use and returns the cached one afterwards.
    One instance per strategy name is built lazily (``factory(ctx)``) and shared.
    """

    def __init__(self, ctx: RouterContext) -> None:
        self.ctx = ctx
        self._factories: dict[str, RouterFactory] = {}
        self._scoring: dict[str, bool] = {}
        self._instances: dict[str, Router] = {}
        self._cache: dict[str, tuple[str, Router]] = {}     # spec → (its canonical spelling, router)

    def register(self, name: str, factory: RouterFactory, *, scoring: bool) -> None:
        """Declare strategy ``name``; ``scoring=True`` if its router is a ``ScoringRouter`` and may
        take part in weighted lists."""
        key = name.strip().lower()
        if not _NAME.fullmatch(key):
            raise ValueError(f"invalid strategy name {name!r}")
        if key in self._factories:
            raise ValueError(f"strategy {key!r} is already registered")
        self._factories[key] = factory
        self._scoring[key] = scoring
        self._cache.clear()

    def names(self) -> list[str]:
        return list(self._factories)

    def is_scoring(self, name: str) -> bool:
        return self._scoring.get(name.strip().lower(), False)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.strip().lower() in self._factories

    def get(self, spec: str) -> Router:
        """The router for strategy string ``spec``; raises ``StrategyError`` if it is invalid."""
        return self.resolve(spec)[1]

    def resolve(self, spec: str) -> tuple[str, Router]:
        """``spec``'s canonical spelling (``canonical_strategy``) and its router; raises
        ``StrategyError`` if it is invalid."""
        found = self._cache.get(spec)
        if found is None:
            entries = self.validate(spec)
            found = (canonical_strategy(entries), self._build(spec, entries))
            if len(self._cache) >= MAX_CACHED_SPECS:
                del self._cache[next(iter(self._cache))]
            self._cache[spec] = found
        return found

    def validate(self, spec: str) -> list[tuple[str, int]]:
        """Parse and check ``spec`` without building anything (config validation)."""
        entries = parse_strategy(spec, self._factories)
        if len(entries) > 1:
            for name, _ in entries:
                if not self._scoring[name]:
                    raise StrategyError(spec, f"{name!r} cannot be combined with other strategies")
        return entries

    def _instance(self, name: str) -> Router:
        router = self._instances.get(name)
        if router is None:
            router = self._factories[name](self.ctx)
            if self._scoring[name] and not isinstance(router, ScoringRouter):
                raise TypeError(f"strategy {name!r} is registered as scoring but its router is not a ScoringRouter")
            self._instances[name] = router
        return router

    def _build(self, spec: str, entries: list[tuple[str, int]]) -> Router:
        if len(entries) == 1:
            return self._instance(entries[0][0])
        parts = [(self._instance(name), weight) for name, weight in entries]
        return WeightedRouter(spec, parts, rng=self.ctx.rng)  # type: ignore[arg-type]


def default_registry(ctx: RouterContext) -> RouterRegistry:
    """The registry with every built-in strategy. New strategies add one ``register`` line."""
    reg = RouterRegistry(ctx)
    reg.register("random", RandomRouter, scoring=False)
    reg.register("round-robin", RoundRobinRouter, scoring=False)
    reg.register("least-request", LeastRequestRouter, scoring=True)
    reg.register("pd", PDRouter, scoring=False)
    reg.register("power-of-two", PowerOfTwoRouter, scoring=False)
    reg.register("least-kv-cache", LeastKVCacheRouter, scoring=True)
    reg.register("least-waiting", LeastWaitingRouter, scoring=True)
    reg.register("throughput", ThroughputRouter, scoring=True)
    reg.register("least-latency", LeastLatencyRouter, scoring=True)
    reg.register("prefix-cache", PrefixCacheRouter, scoring=True)   # on the context's shared prefix index
    reg.register("session-affinity", SessionAffinityRouter, scoring=True)
    reg.register("vtc-basic", VTCRouter, scoring=True)
    reg.register("lora-affinity", LoraAffinityRouter, scoring=True)
    reg.register("slo", SloRouter, scoring=False)         # latency objectives, on the context's latency models
    return reg
