"""The router contract.

A router is pure and synchronous: given the parsed request and the ready candidates (never empty)
it returns a ``Decision``, always. It does no I/O and never awaits, so the pipeline can select and
charge the chosen endpoints in one synchronous step (no other request can interleave between the
two).

* ``Router`` is the base class: ``name``, ``route``, the capability flag ``chooses_pairs`` (True
  when a decision may carry a prefill endpoint; the gateway then offers prefill/decode endpoints
  as candidates and runs the P/D legs) and two hooks with no-op defaults.
* ``post_route(req, endpoint)``: learn from a decision (a prefix index records the prompt, VTC
  charges the user's tokens). A router's own ``route`` does its learning itself; the hook exists
  so that a weighted list (``routers.registry.WeightedRouter``) can make each part learn from the
  combined choice. The gateway never calls hooks.
* ``decide(req, candidates)``: ``route`` with the learning the choice does not need left in
  ``Decision.learn``; the gateway runs it once the request's first leg is written.
* ``response_headers(req, endpoint)``: headers a part adds to a weighted list's answer (e.g.
  session-affinity's ``x-session-id``); alone, a router puts them into its ``Decision``.
* ``ScoringRouter`` adds ``polarity`` and ``score`` so a router can take part in weighted lists.

A router's settings are typed: ``RoutingSettings`` (the ``routing:`` config block) for all,
``PDRouteSettings`` per model for ``pd``. ``RouterContext`` carries them and the shared state (the
prefix index, the endpoints' latency models), built once per gateway and never changed afterwards.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Literal, Protocol

import msgspec

from gateway.endpoints import Endpoint
from gateway.request import InferenceRequest
from routers.latency import LatencyModel
from routers.pd_settings import PDRouteSettings
from routers.prefix_index import PrefixIndex
from routers.session_map import SessionMap

_Count = Annotated[int, msgspec.Meta(ge=0)]
_Seconds = Annotated[float, msgspec.Meta(ge=0)]


class NoRouteError(Exception):
    """The strategy found no acceptable endpoint among the ready candidates (the gateway answers
    503); e.g. a P/D model whose rolesets are all incomplete and that has no combined endpoint."""


@dataclass(slots=True)
class Decision:
    endpoint: Endpoint                                      # the endpoint that answers (P/D: the decode)
    strategy: str                                           # the router's name; the gateway writes the spec
    headers: dict[str, str] = field(default_factory=dict)   # extra response headers (e.g. x-session-id)
    prefill: Endpoint | None = None                         # P/D: the prefill endpoint
    # P/D: prompt tokens the prefill must compute (for the token-load tracker)
    uncached_tokens: int = 0
    # why this choice, for traces: a fast path the strategy took ("decode_imbalance", ...), if any
    reason: str = ""
    # the chosen endpoint's (P/D: the prefill's) prefix-index match, 0..100, when the strategy knows it
    prefix_match: float | None = None
    # (strategy, reason) of each fallback reported while deciding (the gateway fills this in)
    fallbacks: tuple[tuple[str, str], ...] = ()
    # ``Router.decide``: the learning the router left for after the leg is written (its caller runs it)
    learn: Callable[[], None] | None = None


def learnt(decision: Decision) -> Decision:
    """``decision`` with the learning its router left in ``Decision.learn`` done now: the ``route``
    of a router whose ``decide`` defers it is ``learnt(self.decide(req, candidates))``."""
    learn, decision.learn = decision.learn, None
    if learn is not None:
        learn()
    return decision


class RoutingSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The knobs of the built-in strategies, with their defaults. The gateway's ``routing:``
    config block (``gateway.config.schema.RoutingConfig``) is this class plus the default strategy."""

    metrics_max_age_s: Annotated[_Seconds, msgspec.Meta(description="Engine metrics older than this count as missing for the strategies that read them, in seconds.")] = 10.0
    prefix_block_chars: Annotated[int, msgspec.Meta(ge=1, description="Prompt characters per hashed block of the prefix index (512 is about 128 tokens).")] = 512
    prefix_max_blocks: Annotated[_Count, msgspec.Meta(description="Most blocks hashed per prompt; the rest of a longer prompt is not indexed.")] = 1024
    prefix_index_blocks: Annotated[_Count, msgspec.Meta(description="Capacity of the prefix index in blocks, all models together; the least recently used are forgotten.")] = 131072
    prefix_idle_ttl_s: Annotated[_Seconds, msgspec.Meta(description="A block no request touched for this long is forgotten, in seconds.")] = 1200.0
    prefix_imbalance_abs: Annotated[_Count, msgspec.Meta(description="prefix-cache: when the in-flight spread (most minus least) exceeds this, only the least loaded endpoints are considered.")] = 8
    prefix_std_factor: Annotated[_Seconds, msgspec.Meta(description="prefix-cache: an endpoint holding the prefix (or a session) is chosen only if its load is at most mean + this x standard deviation, or at most mean + 1.")] = 3.0
    # the load prefix-cache's guards compare: "local" = this gateway's in-flight (plus replicas'
    # published through shared state); "fleet" = that plus the other gateways' requests the engine
    # reported at its last fresh scrape (running + waiting beyond this gateway's own)
    prefix_min_match_tokens: Annotated[_Count, msgspec.Meta(description="prefix-cache on KV events: an endpoint holding fewer of the prompt's tokens than this is no match (a head that every prompt shares, such as the chat template's header, would otherwise draw every new prompt to the first engine holding it); 0: any cached block counts.")] = 128
    prefix_load: Annotated[Literal["local", "fleet"], msgspec.Meta(description="Load compared by prefix-cache's guards: local (this gateway's requests, plus replicas' through shared state) or fleet (also other gateways' requests seen in the engine's own metrics).")] = "fleet"
    prefix_session: Annotated[bool, msgspec.Meta(description="prefix-cache: a request that continues a session (x-session-key or x-aibrix-session-key header, the body's prompt_cache_key, x-session-id header; Responses previous_response_id; Messages metadata.user_id) goes to the endpoint that served the session last, unless the load guards find it overloaded. pd (prefix_cache prefill policy): the same for the session's prefill, by header, prompt_cache_key or metadata.user_id.")] = True
    session_ttl_s: Annotated[_Seconds, msgspec.Meta(description="prefix-cache: a session not seen for this long is forgotten, in seconds.")] = 1800.0
    session_max_entries: Annotated[int, msgspec.Meta(ge=1, description="prefix-cache: most sessions remembered (all models together); the least recently seen are forgotten.")] = 100_000
    session_user_share: Annotated[float, msgspec.Meta(gt=0, le=1, description="prefix-cache: with auth on, the share of session_max_entries one user (API key's user) may hold; a user's new session (or stored response's lineage) past it forgets that user's least recently seen one, not another user's. 1: no bound of its own.")] = 0.25
    metrics_window_s: Annotated[_Seconds, msgspec.Meta(description="Window of the rates and means of throughput and least-latency, in seconds.")] = 10.0
    vtc_window_s: Annotated[_Seconds, msgspec.Meta(description="vtc-basic: per-user token counts are kept over this sliding window, in seconds.")] = 300.0
    lora_load_weight: Annotated[_Seconds, msgspec.Meta(description="lora-affinity: weight of the in-flight load in the score (0..1).")] = 0.5
    lora_prefix_weight: Annotated[_Seconds, msgspec.Meta(description="lora-affinity: weight of the prefix match, keyed by adapter, in the score (0..1).")] = 0.3
    slo_exploration: Annotated[float, msgspec.Meta(ge=0, le=1, description="slo: share of streamed requests with a latency objective sent to a random endpoint instead, so the latency model keeps observing endpoints it predicts too slow (a non-streamed answer teaches it nothing: such requests never explore).")] = 0.05
    slo_margin: Annotated[float, msgspec.Meta(ge=0, lt=1, description="slo: an endpoint is predicted to meet an objective when its predicted latency is at most (1 - this) x the objective.")] = 0.1
    slo_forgetting: Annotated[float, msgspec.Meta(gt=0, le=1, description="slo: forgetting factor of the latency model; an observation k requests old weighs this to the power k (memory about 1 / (1 - this) requests per endpoint).")] = 0.99
    slo_half_life_s: Annotated[float, msgspec.Meta(gt=0, description="slo: half-life of an observation in the latency model, in seconds: besides slo_forgetting (per later observation of the endpoint), what an endpoint showed weighs half as much this long after, so what a recovered (or slowed) engine shows its few exploring requests outweighs what it showed before within a few half-lives, however little traffic it gets.")] = 30.0
    slo_reobserve_s: Annotated[_Seconds, msgspec.Meta(description="slo: an endpoint that no request has observed for this long (in seconds), nor been sent one to observe it, is sent the next streamed request with an objective whatever its prediction, one at a time: a model that predicts an endpoint too slow keeps it from every request, so without this (or slo_exploration) it would never see the engine recover. 0: never.")] = 120.0
    slo_min_samples: Annotated[int, msgspec.Meta(ge=1, description="slo: observations of an endpoint before its predictions are used; until every candidate has them, requests with an objective go to the least loaded endpoint.")] = 8
    slo_select: Annotated[Literal["pack", "spread"], msgspec.Meta(description="slo: among the endpoints predicted to meet a request's objectives (and holding no more of its prefix than the others), pack: the one with the least room left, keeping the fastest free for the tightest objectives; spread: the one with the lowest predicted latency.")] = "pack"


_PD_DEFAULTS = PDRouteSettings()


def _default_pd_settings(model: str) -> PDRouteSettings:
    return _PD_DEFAULTS


def _ignore_fallback(strategy: str, reason: str) -> None:
    return None


class PreciseIndex(Protocol):
    """What engines report they cache (``gateway.kv.events``: KV-cache events), for ``prefix-cache``.

    ``match`` gives the cached prompt tokens on each candidate whose events are live, the prompt's
    token count, and the candidates to judge on the approximate index instead (no events, stalled);
    ``None`` when the request cannot be tokenized. ``routed`` tells it where a request went. The
    gateway awaits ``prepare`` before routing a request with a router that ``reads_kv_events``.
    ``covers`` says whether a request is judged on it at all: its model's engines publish events
    and it is a prompt the engine caches as the gateway keys it (not an embeddings or a
    pass-through request)."""

    def covers(self, req: InferenceRequest) -> bool: ...

    def match(self, req: InferenceRequest, candidates: Sequence[Endpoint]
              ) -> tuple[dict[Endpoint, int], int, list[Endpoint]] | None: ...

    def routed(self, req: InferenceRequest, ep: Endpoint) -> None: ...

    async def prepare(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> None:
        """Before ``route``: the costly part of ``match`` (tokenizing) done off the event loop."""


@dataclass(frozen=True)
class RouterContext:
    """What routers share, one per gateway: settings, randomness, time, the fallback counter and
    the prefix index. The gateway builds it as ``RouterContext(settings=config.routing,
    pd_settings=config.pd_for, on_fallback=...)``; tests inject ``rng`` and ``clock``.

    ``prefix_index`` is built here from ``settings`` and ``clock``: the ``prefix-cache`` strategy
    routes by it and ``pd`` asks it for each prefill's match (``match``) and records its prefill
    choice (``insert``); ``stats()`` feeds a gauge. ``sessions`` (``routers.session_map``) is where
    ``prefix-cache`` finds the endpoint of a request's session.
    """

    settings: RoutingSettings = field(default_factory=RoutingSettings)
    # the P/D settings of a model (the gateway passes gateway.config.schema.Config.pd_for)
    pd_settings: Callable[[str], PDRouteSettings] = _default_pd_settings
    rng: random.Random = field(default_factory=random.Random)
    clock: Callable[[], float] = time.monotonic                 # monotonic seconds
    # called as on_fallback(strategy, reason) when a strategy lacks its signal and falls back
    on_fallback: Callable[[str, str], None] = _ignore_fallback
    prefix_index: PrefixIndex = field(init=False, repr=False)
    # the endpoints' latency models (routers.latency): fed by the gateway with what requests saw,
    # read by the ``slo`` strategy
    latency: LatencyModel = field(init=False, repr=False)
    # the event index, when a model subscribes to KV events (prefix-cache routes on it then)
    precise_index: PreciseIndex | None = None
    # session → the endpoint that served it last (routers.session_map); the gateway passes the one
    # its shared view keeps, None: one of this context's own, from ``settings``
    sessions: SessionMap | None = None
    # called as on_session(model, outcome) when a request's session has an endpoint: kept (routed
    # there), overloaded (the guards refused it) or gone (not among the ready candidates)
    on_session: Callable[[str, str], None] = _ignore_fallback

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix_index", PrefixIndex(self.settings, self.clock))
        if self.sessions is None:
            s = self.settings
            object.__setattr__(self, "sessions", SessionMap(s.session_ttl_s, s.session_max_entries, self.clock,
                                                           user_share=s.session_user_share))
        object.__setattr__(self, "latency", LatencyModel(self.settings, self.clock))


class Router:
    """Base class of every router; see the module docstring for the contract."""

    name: str
    chooses_pairs: bool = False     # a Decision may carry ``prefill`` (P/D)
    reads_kv_events: bool = False   # matches the request on ``ctx.precise_index`` (prepared before ``route``)

    def route(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> Decision:
        """Choose among ``candidates`` (never empty, all ready), learning from the choice."""
        raise NotImplementedError

    def decide(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> Decision:
        """``route``, except that learning which the choice does not need may be left in
        ``Decision.learn`` for the caller to run later (before any other request is routed: in
        the same synchronous step, once the request's leg is written). By default, ``route``."""
        return self.route(req, candidates)

    def post_route(self, req: InferenceRequest, endpoint: Endpoint) -> None:
        """Learn from a choice made by a weighted list this router is part of."""

    def response_headers(self, req: InferenceRequest, endpoint: Endpoint) -> dict[str, str]:
        """Headers for the answer when a weighted list this router is part of chose ``endpoint``."""
        return {}


class ScoringRouter(Router):
    """A router that can score every candidate, so it can take part in a weighted combination.

    ``polarity`` is "least" (lower score is better) or "most" (higher is better). Scores may be
    ``None``/NaN for a candidate the strategy cannot score (it then gets 0 after normalisation, or,
    with ``unscored_share``, the best score when it has no more requests in flight than the best
    scored candidates).
    """

    polarity: str
    unscored_share = False

    def score(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float | None]:
        raise NotImplementedError

    def count_unscored(self, endpoint: Endpoint) -> None:
        """A weighted list with this part (``unscored_share``) chose ``endpoint``, which it could not
        score while others it could: count the fallback, where the strategy counts them."""
