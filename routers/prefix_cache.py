"""``prefix-cache``: send a prompt to the engine that already holds its prefix in KV cache.

The gateway cannot see the engines' caches, so it keeps an index of what prompt prefixes it sent
where (``routers.prefix_index``, which explains the keys). The index is ``PrefixIndex``, one per gateway (``RouterContext.prefix_index``),
shared with the ``pd`` strategy's prefill choice.

The router (AIBrix ``prefix-cache`` semantics, aibrix-gateway.md §1.4):

1. load guard, absolute: if the in-flight spread (max − min) exceeds ``prefix_imbalance_abs``, only
   the least-loaded endpoints are considered (the load: see below);
2. among endpoints holding a prefix: highest match first, then least loaded (random among equals);
   the first whose in-flight is within mean + ``prefix_std_factor`` · stddev (sample stddev over the
   considered endpoints), or within one request of the mean, wins — a hot prefix cannot pile onto
   one engine;
3. otherwise least-request; the reason is counted (``no_match``, ``short_prompt``, ``overloaded``,
   and ``load_imbalance`` when step 1 cut the candidates);
4. the chosen endpoint is recorded for every block of the prompt.

Before all that, a request that continues a session (``routers.session_map.session_of``: a session
header or the body's ``prompt_cache_key``, a Responses ``previous_response_id``, Messages ``metadata.user_id``) goes to the endpoint
that served the session last, if it is a ready candidate that passes both guards (its load is the
least when the spread exceeds ``prefix_imbalance_abs``, and within mean + ``prefix_std_factor`` ·
stddev over the candidates); the decision's reason is ``session``. Each such request is counted
(``RouterContext.on_session``) as ``kept``, ``overloaded`` or ``gone``; in the last two cases the
strategy decides as above. A Responses chain continued with another model (gateway state) starts
a session of that model, neither kept nor counted; so does a request whose candidates leave out a
session endpoint that is ready (a retry off the engine that failed it, a follow-up bound to the
engine holding its previous response): the request's first decision counted it, and the engine is
not gone. Every decision records the session's endpoint
(``prefix_session`` turns this off).

The load (``prefix_load``): ``local`` is this gateway's in-flight count, plus what other replicas
publish through the shared state (``remote_in_flight``). ``fleet`` (the default) also counts the
requests other gateways sent: the engine's own ``running + waiting`` at its last scrape (fresh
within ``metrics_max_age_s``) minus this gateway's in-flight at that moment
(``EngineMetrics.gateway_in_flight``), taken in place of ``remote_in_flight`` when larger. Several
gateways (replicas, workers) routing one prefix then see each other's pile on its holder instead
of each sending it there while its own count looks low. One gateway alone sees about zero
other load, so it routes as with ``local``.

In a weighted list its score is the match percentage (higher is better), without the guards: the
list's load strategies do that job there.

On KV events (a model with ``kv_events`` enabled, ``RouterContext.precise_index``): the match of an
endpoint whose engine publishes events is what the engine reports it caches, in tokens of the
request as that engine tokenizes it; an endpoint without live events (none yet, stalled) is judged
on the approximate index, its block match scaled to tokens, and the decision counts the fallback
(``kv_events_fallback``). A request that cannot be keyed as the engine keys it is judged on the
approximate index on every candidate (``kv_events_tokenize``; ``kv_events_multimodal`` for image,
audio or video parts, whose feature hashes the engine folds into its block hashes;
``kv_events_responses`` for a Responses request, whose input the engine renders its own way). The approximate
index is fed either way, so a fallback starts warm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

from gateway.endpoints import Endpoint
from gateway.request import InferenceRequest
from routers.base import Decision, RouterContext, ScoringRouter, learnt
from routers.prefix_index import PrefixIndex, prefix_keys
from routers.session_map import RESPONSE, session_of
from routers.simple import LeastRequestRouter

__all__ = ["PrefixCacheRouter", "PrefixIndex", "cached_depths", "prefix_keys"]

RESPONSES = "/v1/responses"  # gateway.apis.paths.RESPONSES (routers import only endpoints and request)


def cached_depths(ctx: RouterContext, index: PrefixIndex, strategy: str, req: InferenceRequest,
                  pool: Sequence[Endpoint]) -> tuple[dict[Endpoint, int], int]:
    """Match depth per endpoint (only those with a match) and the depth of a full match: in
    prompt blocks of the approximate index, or in tokens when events cover the model. Endpoints
    without live events are judged on the approximate index, scaled to tokens (a fallback counted
    for ``strategy``).

    On events, a match shorter than ``prefix_min_match_tokens`` is no match. Engines report blocks
    of 16 tokens, and the first of nearly every chat prompt is the same (the template's header and
    date line, a BOS, a common first sentence): until every engine holds it, it would send every
    new prompt to the first engine that does, whatever its load, and the system prompts that should
    spread over the fleet pile onto one engine. The approximate index never sees it, its blocks
    being about 128 tokens long (``prefix_block_chars``)."""
    precise = ctx.precise_index
    if precise is None or not precise.covers(req):
        return index.depths(req, pool)
    found = precise.match(req, pool)
    if found is None:             # not keyed like the engine: a tokenizer error, or multimodal parts
        ctx.on_fallback(strategy, "kv_events_multimodal" if req.multimodal else
                        "kv_events_responses" if req.path == RESPONSES else "kv_events_tokenize")
        return index.depths(req, pool)
    exact, tokens, others = found
    floor = max(1, ctx.settings.prefix_min_match_tokens)
    if not others:
        return {ep: d for ep, d in exact.items() if d >= floor}, tokens
    ctx.on_fallback(strategy, "kv_events_fallback")
    approx, n = index.depths(req, others)
    if not exact:
        return approx, n
    depths = {ep: d for ep, d in exact.items() if d >= floor}
    if n:
        for ep, d in approx.items():
            depths[ep] = d * tokens // n
    return depths, tokens


def fleet_load(ep: Endpoint, now: float, max_age: float) -> float:
    """In-flight requests on ``ep`` from every gateway: this one's, plus the larger of what
    replicas publish and what the engine's last fresh scrape counted beyond this gateway's own."""
    m = ep.metrics
    if m is None or m.gateway_in_flight is None or now - m.scraped_at > max_age:
        return ep.in_flight + ep.remote_in_flight
    engine = (m.running or 0.0) + (m.waiting or 0.0)
    others = engine - m.gateway_in_flight
    return ep.in_flight + (others if others > ep.remote_in_flight else ep.remote_in_flight)


class PrefixCacheRouter(ScoringRouter):
    """Longest cached prefix first, within AIBrix's load guards; least-request otherwise.

    Uses the gateway's shared index (``ctx.prefix_index``) unless given one of its own."""

    name = "prefix-cache"
    polarity = "most"
    reads_kv_events = True

    def __init__(self, ctx: RouterContext, index: PrefixIndex | None = None) -> None:
        s = ctx.settings
        self.ctx = ctx
        self.index = index if index is not None else ctx.prefix_index
        self.imbalance_abs = s.prefix_imbalance_abs
        self.std_factor = s.prefix_std_factor
        self._random = ctx.rng.random
        self._fallback = LeastRequestRouter(ctx)
        self.precise = ctx.precise_index
        self.fleet = s.prefix_load == "fleet"
        self.max_age = s.metrics_max_age_s
        self._clock = ctx.clock
        self.sessions = ctx.sessions if s.prefix_session else None

    def _loads(self, candidates: Sequence[Endpoint]) -> dict[Endpoint, float]:
        if not self.fleet:
            return {ep: ep.in_flight + ep.remote_in_flight for ep in candidates}
        now, age = self._clock(), self.max_age
        return {ep: fleet_load(ep, now, age) for ep in candidates}

    def _depths(self, req: InferenceRequest, pool: Sequence[Endpoint]) -> tuple[dict[Endpoint, int], int]:
        return cached_depths(self.ctx, self.index, self.name, req, pool)

    def score(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float | None]:
        if self.precise is not None and self.precise.covers(req):
            depths, n = self._depths(req, candidates)
            return [100.0 * depths.get(ep, 0) / n if n else 0.0 for ep in candidates]
        match = self.index.match(req, candidates)
        return [match[ep] for ep in candidates]

    def post_route(self, req: InferenceRequest, ep: Endpoint) -> None:
        self.index.insert(req, ep)
        if self.precise is not None:
            self.precise.routed(req, ep)
        if self.sessions is not None:
            key = session_of(req)
            # a response id's endpoint is recorded when it is answered (the new id is not known yet)
            if key is not None and not key.startswith(RESPONSE):
                self.sessions.put(key, ep)

    def route(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> Decision:
        return learnt(self.decide(req, candidates))

    def decide(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> Decision:
        """``route`` with its learning (``post_route``: the prompt's record in the index, on KV events
        its speculative blocks and the tokenizing ahead of its unreached segments, the session's
        endpoint) left in ``Decision.learn``: none of it changes this choice, and for a long prompt
        it costs about as much as the choice, so the gateway runs it once the leg is written (in
        the same synchronous step, before any other request is routed)."""
        ep, match, reason = self._decide(req, candidates)
        return Decision(ep, self.name, prefix_match=match, reason=reason, learn=partial(self.post_route, req, ep))

    def _choose(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> Endpoint:
        return self._decide(req, candidates)[0]

    def _session(self, req: InferenceRequest, by_ep: dict[Endpoint, float], loads: list[float],
                 low: float, high: float) -> Endpoint | None:
        """The endpoint of the request's session when it may take the request (counted either way)."""
        assert self.sessions is not None
        key = session_of(req)
        if key is None:
            return None
        ep = self.sessions.get(key)
        if ep is None or ep.model != req.model:     # a Responses chain continued with another model: a new session
            return None
        load = by_ep.get(ep)
        if load is None:
            if ep.ready:    # up, left out by the request itself: a retry off it, a follow-up bound elsewhere
                return None
            outcome = "gone"
        elif (high - low > self.imbalance_abs and load > low) or load > self._limit(loads):
            outcome = "overloaded"
        else:
            self.ctx.on_session(req.model, "kept")
            return ep
        self.ctx.on_session(req.model, outcome)
        return None

    def _limit(self, loads: list[float]) -> float:
        """mean + std_factor · sample stddev of ``loads``, and at least mean + 1: a load within one
        request of the mean is no sign of overload, where on 11 endpoints or more (the guard turns
        nothing away on fewer, with the default 3) one request beside idle endpoints was past it,
        whatever the scale, and a conversation left its cache for an idle engine. A load is an
        engine's own count under ``fleet``, whatever it reports: squared as a product, a huge one
        (1e200 running, a broken exporter) makes an infinite limit, where ``** 2`` raised
        OverflowError and failed the request."""
        k = len(loads)
        mean = sum(loads) / k
        std = math.sqrt(sum((x - mean) * (x - mean) for x in loads) / (k - 1)) if k > 1 else 0.0
        return mean + max(self.std_factor * std, 1.0)

    def _decide(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> tuple[Endpoint, float | None, str]:
        """The endpoint, its match percentage when it was chosen for its match (or its session),
        and the decision's reason ("session", or "")."""
        by_ep = self._loads(candidates)
        loads = list(by_ep.values())
        low, high = min(loads), max(loads)
        if self.sessions is not None:
            pinned = self._session(req, by_ep, loads, low, high)
            if pinned is not None:
                depths, n = self._depths(req, [pinned])
                return pinned, (100.0 * depths.get(pinned, 0) / n if n else None), "session"
        pool: Sequence[Endpoint] = candidates
        guard = None
        if high - low > self.imbalance_abs:
            pool = [ep for ep, n in by_ep.items() if n == low]
            loads = [low] * len(pool)
            guard = "load_imbalance"
        depths, n = self._depths(req, pool)
        if not depths:
            return self._fall_back(pool, by_ep, guard or ("short_prompt" if n == 0 else "no_match")), None, ""
        limit = self._limit(loads)
        # best (depth, -load) within the limit; equal ones are picked uniformly (reservoir)
        best: Endpoint | None = None
        best_key = (-1, 0)
        ties = 0
        for ep, depth in depths.items():
            load = by_ep[ep]
            if load > limit:
                continue
            key = (depth, -load)
            if key > best_key:
                best, best_key, ties = ep, key, 1
            elif key == best_key:
                ties += 1
                if self._random() * ties < 1.0:
                    best = ep
        if best is None:
            return self._fall_back(pool, by_ep, guard or "overloaded"), None, ""
        if guard is not None:
            self.ctx.on_fallback(self.name, guard)
        return best, 100.0 * best_key[0] / n, ""

    def _fall_back(self, pool: Sequence[Endpoint], loads: dict[Endpoint, float], reason: str) -> Endpoint:
        """Least loaded (by the same load as the guards; random among equals)."""
        self.ctx.on_fallback(self.name, reason)
        if not self.fleet:
            return self._fallback.choose(pool)
        low = min(loads[ep] for ep in pool)
        least = [ep for ep in pool if loads[ep] == low]
        return least[0] if len(least) == 1 else least[int(self._random() * len(least))]
