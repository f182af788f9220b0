"""The ``pd`` strategy: choose a (prefill, decode) pair, or a combined endpoint.

The pipeline follows AIBrix's P/D selection, with its signals taken from what this gateway has:

1. Bucket filter: an endpoint takes a prompt of ``n`` tokens when
   ``min_prompt_tokens <= n <= max_prompt_tokens`` (max 0: no bound; min > max: never).
2. Rolesets are eligible with at least one prefill and one decode endpoint in the bucket; prefill
   and decode are never paired across rolesets (or buckets).
3. Combined fallback: no eligible roleset → the least loaded combined (or plain aggregated)
   endpoint; also when combined capacity is clearly less loaded than every prefill
   (``combined load < combined_load_ratio × least prefill load``, with the prefill load above 1).
4. Prefill imbalance fast path: in-flight prefill calls spread > ``prefill_imbalance_spread`` →
   a least-loaded prefill, decode restricted to its roleset.
5. Decode imbalance fast paths: running spread ≥ ``decode_imbalance_spread`` → the least running
   decode; generation-throughput spread > ``decode_throughput_spread`` → the lowest-throughput
   decode; prefill restricted to its roleset.
6. Per-roleset prefill score (``prefix_cache``: ``(100 − match%)·0.1 + load/max_load``;
   ``least_request``: in-flight prefills; ``token_load``: active + kv_weight·resident tokens) and
   decode score (``load_balancing``: ``(w_r·run/max_run + w_t·(1 − thr/max_thr)) / (free/max_free)``;
   ``least_request``: running + pending), each roleset keeping its best of each.
7. Pair score ``prefill/max_prefill + decode/max_decode``; lowest wins. Equal scores (in step 6
   and here) are picked at random.

Signals: "running" is, when the engine's metrics are fresh, this gateway's live in-flight count on
the decode plus what the engine's last scrape counted beyond this gateway's own requests then
(``num_requests_running`` less ``EngineMetrics.gateway_in_flight``: other gateways' requests), or
what other replicas publish (``remote_in_flight``) when that is more: ``prefix-cache``'s fleet load.
A scrape is up to ``scrape.interval_s`` old, and its raw count sent every decision of that interval
to the decode that was the least loaded at the scrape (a burst of 32 streams all on one of two
decodes). Without fresh metrics it is the in-flight count of every gateway replica (this one's plus
``remote_in_flight``, as ``least-request`` counts it; counted as a fallback) plus the pending
decodes (chosen, leg not started); a snapshot without the gateway's count (a test's) is read raw,
plus the pending decodes. A combined endpoint's load is the same
in-flight count plus the engine's waiting queue. A prefill's load is this gateway's prefill calls
in progress (replicas publish in-flight counts, which only decode and whole-request endpoints
carry). Free KV is ``100 − 100·kv_usage`` (missing: 100). Throughput missing: that term is 0.
Prefix match comes from the gateway's prefix index (``RouterContext.prefix_index``); on a model
with KV events (``RouterContext.precise_index``), a prefill whose engine publishes live events is
matched on what that engine reports it caches, the others on the prefix index (counted as the
``kv_events_fallback`` of ``pd``), as ``prefix-cache`` does.

Sessions: with the ``prefix_cache`` prefill policy and ``routing.prefix_session`` on, a request that
continues a session (an ``x-session-key``/``x-session-id`` header, the body's ``prompt_cache_key``, Messages'
``metadata.user_id``;
``routers.session_map.session_of``) goes to the prefill that served the session's last turn, where
its prompt's KV is, unless that prefill is gone or loaded beyond the prefill score's load filter
and more than one prefill above the mean (or a fast path moved the request elsewhere); the pair's decode is the best of that roleset. The
decision's reason is ``session``, and the outcome is counted as ``prefix-cache`` counts its own
(``kept``, ``overloaded``, ``gone``; a ready prefill the candidates leave out, a retry's, is none of
them: the request's first decision counted it). A Responses ``previous_response_id`` names the engine that
answered (the decode), so P/D follows it by prefix match only.

Settings: ``PDRouteSettings`` (routers/pd_settings.py), per model through ``ctx.pd_settings``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

from gateway.endpoints import Endpoint
from gateway.request import InferenceRequest
from routers.base import Decision, NoRouteError, Router, RouterContext, learnt
from routers.pd_settings import PDRouteSettings
from routers.prefix_cache import cached_depths
from routers.session_map import RESPONSE, session_of

__all__ = ["PDRouteSettings", "PDRouter", "in_bucket"]


def in_bucket(ep: Endpoint, n: int) -> bool:
    lo, hi = ep.min_prompt_tokens, ep.max_prompt_tokens
    if hi and lo > hi:
        return False
    return n >= lo and (hi == 0 or n <= hi)


def _mean_prefills(P: Sequence[Endpoint]) -> float:
    """The prefills' mean count of prefills in flight. A session's prefill within one of it is
    not overloaded, whatever the load filter says: on six prefills or more the filter (mean + 2
    population stddevs) is relative whatever the scale, and one prefill beside idle ones was past
    it, so the session went to an idle prefill without its cache."""
    return sum(p.prefill_in_flight for p in P) / len(P)


def _in_flight(ep: Endpoint) -> int:
    """Requests on ``ep`` from every gateway replica (as ``least-request`` counts them)."""
    return ep.in_flight + ep.remote_in_flight


class PDRouter(Router):
    name = "pd"
    chooses_pairs = True

    def __init__(self, ctx: RouterContext) -> None:
        self.ctx = ctx
        self.max_age = ctx.settings.metrics_max_age_s
        self.sessions = ctx.sessions if ctx.settings.prefix_session else None

    # -- signals -----------------------------------------------------------------------------

    def _running(self, ep: Endpoint) -> float:
        m = ep.fresh_metrics(self.max_age)
        if m is not None and m.running is not None:
            if m.gateway_in_flight is not None:
                # the scrape is up to an interval old: what this gateway sent since (or saw end) is
                # counted live, the rest of the fleet's as the engine counted it then
                others = m.running - m.gateway_in_flight
                return ep.in_flight + (others if others > ep.remote_in_flight else ep.remote_in_flight)
            return m.running + ep.pending_decode
        return _in_flight(ep) + ep.pending_decode

    def _throughput(self, ep: Endpoint) -> float | None:
        m = ep.fresh_metrics(self.max_age)
        return m.gen_throughput if m is not None else None

    def _free_kv(self, ep: Endpoint) -> float:
        m = ep.fresh_metrics(self.max_age)
        if m is None or m.kv_usage is None:
            return 100.0
        free = round(100.0 - 100.0 * m.kv_usage)
        return free if free > 0 else 0.1

    def _combined_load(self, ep: Endpoint) -> float:
        m = ep.fresh_metrics(self.max_age)
        waiting = m.waiting if m is not None and m.waiting is not None else 0.0
        return _in_flight(ep) + waiting

    def _prefill_load(self, ep: Endpoint) -> float:
        m = ep.fresh_metrics(self.max_age)
        waiting = m.waiting if m is not None and m.waiting is not None else 0.0
        return ep.prefill_in_flight + waiting

    # -- the decision ------------------------------------------------------------------------

    def route(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> Decision:
        return learnt(self.decide(req, candidates))

    def decide(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> Decision:
        """``route`` with the prefix index's record of the chosen prefill left in ``learn``."""
        cfg = self.ctx.pd_settings(req.model)
        n = req.prompt_tokens_est
        if len(candidates) == 2:            # one prefill and one decode: the common deployment
            p, d = candidates
            if p.role == "decode":
                p, d = d, p
            if p.role == "prefill" and d.role == "decode" and (p.roleset or "") == (d.roleset or "") \
                    and in_bucket(p, n) and in_bucket(d, n):
                return self._one_pair(req, p, d, cfg, n)
        prefill: dict[str, list[Endpoint]] = {}
        decode: dict[str, list[Endpoint]] = {}
        combined: list[Endpoint] = []
        for ep in candidates:
            if not in_bucket(ep, n):
                continue
            if ep.role == "prefill":
                prefill.setdefault(ep.roleset or "", []).append(ep)
            elif ep.role == "decode":
                decode.setdefault(ep.roleset or "", []).append(ep)
            else:
                combined.append(ep)
        eligible = [rs for rs in prefill if rs in decode]
        if not eligible:
            if combined:
                return Decision(self._least_combined(combined), "pd", reason="no_pair_combined")
            raise NoRouteError(f"no ready prefill/decode pair or combined endpoint for a prompt of about {n} tokens")

        P = [p for rs in eligible for p in prefill[rs]]
        D = [d for rs in eligible for d in decode[rs]]
        if any(ep.fresh_metrics(self.max_age) is None for ep in D):
            self.ctx.on_fallback("pd", "decode_metrics_missing")

        if combined:
            least_prefill = min(self._prefill_load(p) for p in P)
            best_combined = self._least_combined(combined)
            if least_prefill > 1.0 and self._combined_load(best_combined) < cfg.combined_load_ratio * least_prefill:
                return Decision(best_combined, "pd", reason="combined_less_loaded")

        fast: list[str] = []
        # prefill imbalance fast path
        counts = [p.prefill_in_flight for p in P]
        if len(P) > 1 and max(counts) - min(counts) > cfg.prefill_imbalance_spread:
            low = min(counts)
            chosen = self.ctx.rng.choice([p for p in P if p.prefill_in_flight == low])
            P = [chosen]
            D = [d for d in D if d.roleset == chosen.roleset]
            fast.append("prefill_imbalance")

        # decode imbalance fast paths
        pinned = self._decode_fast_path(D, cfg)
        if pinned is not None:
            same = [p for p in P if p.roleset == pinned.roleset]
            if same:  # (a prefill fast-path choice in another roleset would win: D is already its roleset)
                D, P = [pinned], same
                fast.append("decode_imbalance")

        key = self._session_key(req, cfg)
        if key is not None:
            P, D = self._session(req, key, P, D, cfg, candidates, fast)

        p_scores, match = self._prefill_scores(req, P, cfg)
        d_scores = self._decode_scores(D, cfg)
        best_p = self._best_per_roleset(p_scores)
        best_d = self._best_per_roleset(d_scores)
        pairs = [rs for rs in best_p if rs in best_d]
        if not pairs:
            raise NoRouteError("no roleset has both a prefill and a decode endpoint after filtering")
        max_p = max(1.0, max(best_p[rs][0] for rs in pairs))
        max_d = max(0.01, max(best_d[rs][0] for rs in pairs))
        best_rs, best_score, ties = pairs[0], math.inf, 0
        rand = self.ctx.rng.random
        for rs in pairs:
            score = best_p[rs][0] / max_p + best_d[rs][0] / max_d
            if score < best_score:
                best_rs, best_score, ties = rs, score, 1
            elif score == best_score:
                ties += 1
                if rand() * ties < 1.0:
                    best_rs = rs
        p_ep, d_ep = best_p[best_rs][1], best_d[best_rs][1]
        uncached = int(n * (1.0 - match.get(p_ep, 0.0) / 100.0))
        return Decision(d_ep, "pd", prefill=p_ep, uncached_tokens=uncached, reason="+".join(fast),
                        prefix_match=match.get(p_ep) if match else None, learn=partial(self._learn, req, p_ep))

    def _best_per_roleset(self, scores: dict[Endpoint, float]) -> dict[str, tuple[float, Endpoint]]:
        """Each roleset's lowest score and its endpoint; equal ones picked at random (the candidates
        come in the pool's order, so the first listed took every tie: one request at a time, every
        one went to the same prefill and the same decode)."""
        best: dict[str, tuple[float, Endpoint]] = {}
        ties: dict[str, int] = {}
        rand = self.ctx.rng.random
        for ep, s in scores.items():
            rs = ep.roleset or ""
            held = best.get(rs)
            if held is None or s < held[0]:
                best[rs] = (s, ep)
                ties[rs] = 1
            elif s == held[0]:
                ties[rs] += 1
                if rand() * ties[rs] < 1.0:
                    best[rs] = (s, ep)
        return best

    def _one_pair(self, req: InferenceRequest, p: Endpoint, d: Endpoint, cfg: PDRouteSettings, n: int) -> Decision:
        """The decision of the general path when the candidates are one prefill and one decode of
        the same roleset, both in the prompt's bucket: no fast path applies and the pair is the
        only one, so only the signals the decision carries are computed (the fallback report,
        the prefill's prefix match)."""
        if d.fresh_metrics(self.max_age) is None:
            self.ctx.on_fallback("pd", "decode_metrics_missing")
        pct: float | None = None
        if cfg.prefill_score_policy == "prefix_cache":
            pct = self._match(req, (p,)).get(p, 0.0)
        uncached = int(n * (1.0 - (pct or 0.0) / 100.0))
        return Decision(d, "pd", prefill=p, uncached_tokens=uncached, prefix_match=pct,
                        learn=partial(self._learn, req, p))

    def _session_key(self, req: InferenceRequest, cfg: PDRouteSettings) -> str | None:
        if self.sessions is None or cfg.prefill_score_policy != "prefix_cache":
            return None
        key = session_of(req)
        return None if key is None or key.startswith(RESPONSE) else key

    def _session(self, req: InferenceRequest, key: str, P: list[Endpoint], D: list[Endpoint],
                 cfg: PDRouteSettings, candidates: Sequence[Endpoint], fast: list[str]
                 ) -> tuple[list[Endpoint], list[Endpoint]]:
        """The session's prefill and its roleset's decodes, when that prefill may take the request
        (module docstring); else ``P`` and ``D`` as they are. Counted either way."""
        assert self.sessions is not None
        ep = self.sessions.get(key)
        if ep is None:
            return P, D
        if ep not in candidates:
            if ep.ready:    # up, left out by the request itself (a retry off it): not the session's outcome
                return P, D
            outcome = "gone"
        elif ep in P and ep.prefill_in_flight <= max(self._load_limit(P, cfg), _mean_prefills(P) + 1):
            same = [d for d in D if d.roleset == ep.roleset]
            if same:
                self.ctx.on_session(req.model, "kept")
                fast.append("session")
                return [ep], same
            outcome = "gone"
        else:
            outcome = "overloaded"
        self.ctx.on_session(req.model, outcome)
        return P, D

    @staticmethod
    def _load_limit(P: list[Endpoint], cfg: PDRouteSettings) -> float:
        """The prefill score's load filter: mean + ``prefill_load_std_factor`` · stddev."""
        loads = [p.prefill_in_flight for p in P]
        mean = sum(loads) / len(loads)
        std = math.sqrt(sum((x - mean) ** 2 for x in loads) / len(loads))
        return mean + cfg.prefill_load_std_factor * std

    def _match(self, req: InferenceRequest, prefills: Sequence[Endpoint]) -> dict[Endpoint, float]:
        """Every prefill's match percentage 0..100 (see the module docstring)."""
        depths, full = cached_depths(self.ctx, self.ctx.prefix_index, "pd", req, prefills)
        if not depths:
            return dict.fromkeys(prefills, 0.0)
        scale = 100.0 / full
        return {p: depths.get(p, 0) * scale for p in prefills}

    def _learn(self, req: InferenceRequest, prefill: Endpoint) -> None:
        """The prefill computes the prompt's KV: the prefix index records it, and the event index
        expects it there until the engine's events say so."""
        self.ctx.prefix_index.insert(req, prefill)
        if self.sessions is not None:
            key = session_of(req)
            if key is not None and not key.startswith(RESPONSE):
                self.sessions.put(key, prefill)
        precise = self.ctx.precise_index
        if precise is not None and precise.covers(req):
            precise.routed(req, prefill)

    def _least_combined(self, eps: list[Endpoint]) -> Endpoint:
        low = min(self._combined_load(e) for e in eps)
        return self.ctx.rng.choice([e for e in eps if self._combined_load(e) == low])

    def _decode_fast_path(self, D: list[Endpoint], cfg: PDRouteSettings) -> Endpoint | None:
        if len(D) < 2:
            return None
        with_metrics = [d for d in D if d.fresh_metrics(self.max_age) is not None]
        if len(with_metrics) >= 2:
            runs = {d: self._running(d) for d in with_metrics}
            if max(runs.values()) - min(runs.values()) >= cfg.decode_imbalance_spread:
                return self._least(runs)
            thr = {d: t for d in with_metrics if (t := self._throughput(d)) is not None}
            if len(thr) >= 2 and max(thr.values()) - min(thr.values()) > cfg.decode_throughput_spread:
                return self._least(thr)
        else:
            runs = {d: float(_in_flight(d) + d.pending_decode) for d in D}
            if max(runs.values()) - min(runs.values()) >= cfg.decode_imbalance_spread:
                return self._least(runs)
        return None

    def _least(self, values: dict[Endpoint, float]) -> Endpoint:
        """The endpoint of the lowest value; equal ones at random (``min`` took the first listed,
        which then got every request while the imbalance lasted)."""
        low = min(values.values())
        lowest = [ep for ep, v in values.items() if v == low]
        return lowest[0] if len(lowest) == 1 else self.ctx.rng.choice(lowest)

    def _prefill_scores(self, req: InferenceRequest, P: list[Endpoint],
                        cfg: PDRouteSettings) -> tuple[dict[Endpoint, float], dict[Endpoint, float]]:
        policy = cfg.prefill_score_policy
        match: dict[Endpoint, float] = {}
        if policy == "token_load":
            return {p: p.token_active + cfg.token_kv_weight * p.token_kv for p in P}, match
        if policy == "least_request":
            return {p: float(p.prefill_in_flight) for p in P}, match
        # prefix_cache: skip prefills far above the mean load, then trade match against load
        limit = self._load_limit(P, cfg)
        kept = [p for p in P if p.prefill_in_flight <= limit] or P
        match = self._match(req, kept)
        max_load = max(1, max(p.prefill_in_flight for p in kept))
        return {p: (100.0 - match.get(p, 0.0)) * 0.1 + p.prefill_in_flight / max_load for p in kept}, match

    def _decode_scores(self, D: list[Endpoint], cfg: PDRouteSettings) -> dict[Endpoint, float]:
        runs = {d: self._running(d) for d in D}
        if cfg.decode_score_policy == "least_request":
            return dict(runs)
        thr = {d: self._throughput(d) or 0.0 for d in D}
        free = {d: self._free_kv(d) for d in D}
        max_run = max(1.0, max(runs.values()))
        max_thr = max(1.0, max(thr.values()))
        max_free = max(1.0, max(free.values()))
        wr, wt = cfg.decode_lb_weight_running, cfg.decode_lb_weight_throughput
        return {d: (wr * runs[d] / max_run + wt * (1.0 - thr[d] / max_thr)) / (free[d] / max_free) for d in D}
