"""Which data-parallel rank of an engine serves a request (``X-data-parallel-rank``).

An engine started with ``--data-parallel-size N`` is one HTTP endpoint in front of N ranks, each with
its own KV cache, and its own load balancer spreads requests over the ranks by queue length alone.
The gateway knows better when the engine publishes KV events per rank (``gateway.kv.index`` keeps
which ranks hold each block): once the router chose such an endpoint on the events (``prefix-cache``,
or the prefill endpoint of ``pd``), ``pin`` picks the rank

1. holding the deepest match of the request's blocks (or about to: a pinned request's new blocks
   count as held on its rank for ``speculative_ttl_s``, so a burst on one new prefix follows the
   first request to its rank before that rank reports its prefill),
2. among equals, with the fewest of this gateway's requests in flight on it (a ``RankInFlight``
   charge, released with the request's other charges),
3. among equals, the lowest index,

and the legs to that endpoint carry the engine's rank header (``EngineAdapter.dp_rank_header``).
A client's own header is stripped (``gateway.upstream.upstream``) unless the model's ``kv_events.client_rank``
lets it through; it is then forwarded as given and the gateway picks nothing.
"""

from __future__ import annotations

from typing import Any

from gateway.pipeline.context import RequestContext
from gateway.pipeline.ledger import RankInFlight
from gateway.request import one_value
from gateway.upstream.upstream import DP_RANK_HEADER


def choose(depths: list[int], loads: list[int]) -> tuple[int, str]:
    """The rank (deepest match, then fewest in flight, then lowest index) and why: ``match`` when it
    holds some of the prompt, else ``load``."""
    best = 0
    for r in range(1, len(depths)):
        if depths[r] > depths[best] or (depths[r] == depths[best] and loads[r] < loads[best]):
            best = r
    return best, "match" if depths[best] > 0 else "load"


def pin(ctx: RequestContext, kv: Any, adapter: Any, client_rank: bool) -> None:
    """Pin ``ctx``'s request to a rank of the endpoint its first leg goes to (the prefill of a P/D
    pair), when the gateway picks that endpoint's ranks; with ``client_rank``, the client's header."""
    d, ireq = ctx.decision, ctx.ireq
    assert d is not None and ireq is not None
    ep = d.prefill if d.prefill is not None else d.endpoint
    if client_rank:
        given = ireq.headers.get(DP_RANK_HEADER)
        if given is not None:
            getall = getattr(ireq.headers, "getall", None)      # None for a plain mapping (a batch line's)
            if getall is not None and len(lines := getall(DP_RANK_HEADER)) > 1:
                one_value(lines, DP_RANK_HEADER)    # lines naming two ranks: a 400
            ctx.dp_rank = (ep, adapter.dp_rank_header, given)
            return
    if kv is None:
        return
    st = kv.index.ranked.get(ep)
    if st is None:
        return
    depths = kv.index.rank_depths(ireq, ep)
    if depths is None:            # not keyed on this endpoint's events: the engine picks
        return
    rank, reason = choose(depths, st.rank_in_flight)
    kv.index.rank_routed(ireq, ep, rank, depths[rank])
    ctx.charges.rank = RankInFlight(ep, st.rank_in_flight, rank)
    ctx.dp_rank = (ep, adapter.dp_rank_header, str(rank))
    ctx.rec.extra["dp_rank"] = rank
    kv.metrics.rank_routed.labels(ep.model, reason).inc()
