"""The router contract.

A router is pure and synchronous: given the parsed request and the ready candidates it returns a
``Decision``. It does no I/O and never awaits, so the pipeline can select and charge the chosen
endpoint in one synchronous step (no other request can interleave between the two).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

from gateway.endpoints import Endpoint
from gateway.request import InferenceRequest


class NoRouteError(Exception):
    """The strategy found no acceptable endpoint among the ready candidates (the gateway answers
    503); e.g. a P/D model whose rolesets are all incomplete and that has no combined endpoint."""


@dataclass(slots=True)
class Decision:
    endpoint: Endpoint                                      # the endpoint that answers (P/D: the decode)
    strategy: str                                           # the strategy string as requested
    headers: dict[str, str] = field(default_factory=dict)   # extra response headers (e.g. x-session-id)
    prefill: Endpoint | None = None                         # P/D: the prefill endpoint
    # P/D: prompt tokens the prefill must compute (for the token-load tracker)
    uncached_tokens: int = 0


@dataclass(frozen=True)
class RoutingSettings:
    """The knobs of the built-in strategies, with their defaults.

    The gateway's ``routing:`` config block (``gateway.config.RoutingConfig``) carries the same
    names; ``RouterContext.routing`` holds that block and ``RouterContext.settings`` reads it
    through this class, so routers depend on no config code and missing names take these defaults.
    """

    prefix_block_chars: int = 512          # prompt characters per hashed block (~128 tokens)
    prefix_max_blocks: int = 1024          # blocks hashed per prompt at most (1024 x 512 chars ~ 128k tokens)
    prefix_index_blocks: int = 131072      # index capacity in blocks, all models together (LRU)
    prefix_idle_ttl_s: float = 1200.0      # a block no request touched for this long is forgotten
    prefix_imbalance_abs: int = 8          # in-flight spread (max - min) above which only the least loaded count
    prefix_std_factor: float = 1.5         # a matched endpoint must have in-flight <= mean + k * stddev
    metrics_window_s: float = 10.0         # window of the throughput / least-latency rates and means
    vtc_window_s: float = 300.0            # vtc-basic: per-user token counts over this sliding window

    @classmethod
    def from_object(cls, obj: Any) -> RoutingSettings:
        """Settings from any object with (some of) these attribute names; ``None`` gives defaults."""
        if obj is None:
            return cls()
        if isinstance(obj, cls):
            return obj
        return cls(**{f.name: getattr(obj, f.name) for f in fields(cls) if hasattr(obj, f.name)})


def _no_prefix_match(req: InferenceRequest, candidates: Sequence[Endpoint]) -> dict[Endpoint, float]:
    return {}


def _no_prefix_insert(req: InferenceRequest, endpoint: Endpoint) -> None:
    return None


@dataclass
class RouterContext:
    """Shared, non-I/O state a router may use. One per gateway app.

    Prefix index for other strategies (the P/D strategy uses it for its prefill choice):

    * ``prefix_match(req, candidates) -> dict[Endpoint, float]``: each candidate's match
      percentage, 0..100, of ``req``'s prompt in the prefix-cache index (the very index the
      ``prefix-cache`` strategy uses; keys are per model). Every candidate is in the answer (0 when
      it holds nothing); ``{}`` before ``default_registry`` wired the index.
    * ``prefix_insert(req, endpoint)``: record that ``endpoint`` now holds ``req``'s prompt (call it
      for the endpoint that will prefill). No-op before wiring.
    * ``prefix_stats() -> dict[str, int]``: ``blocks`` (index size), ``capacity``, ``entries``
      (block-endpoint pairs), ``evictions`` (blocks dropped for capacity or idleness, cumulative);
      for a gauge. ``{}`` before wiring.

    Both calls hash the prompt once per request: the hash chain of the last request seen is
    kept, so ``prefix_match`` followed by ``prefix_insert`` (or a weighted list holding
    ``prefix-cache``) hashes once.
    """

    rng: random.Random = field(default_factory=random.Random)
    metrics_max_age_s: float = 10.0
    # called as on_fallback(strategy, reason) when a strategy lacks its signal and falls back
    on_fallback: Callable[[str, str], None] = lambda strategy, reason: None
    # P/D settings for a model (a gateway.config.PDConfig); routers read attributes only
    pd_settings: Callable[[str], Any] | None = None
    # the ``routing:`` config block (gateway.config.RoutingConfig) or None; read via ``settings``
    routing: Any = None
    # monotonic seconds; tests inject a fake clock
    clock: Callable[[], float] = time.monotonic
    prefix_match: Callable[[InferenceRequest, Sequence[Endpoint]], dict[Endpoint, float]] = _no_prefix_match
    prefix_insert: Callable[[InferenceRequest, Endpoint], None] = _no_prefix_insert
    prefix_stats: Callable[[], dict[str, int]] = dict

    @property
    def settings(self) -> RoutingSettings:
        return RoutingSettings.from_object(self.routing)


@runtime_checkable
class Router(Protocol):
    name: str

    def route(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> Endpoint:
        """Pick one of ``candidates`` (never empty, all ready)."""
        ...


@runtime_checkable
class ScoringRouter(Router, Protocol):
    """A router that can score every candidate, so it can take part in a weighted combination.

    ``polarity`` is "least" (lower score is better) or "most" (higher is better). Scores may be
    ``None``/NaN for a candidate the strategy cannot score (it then gets 0 after normalisation).
    """

    polarity: str

    def score(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float | None]:
        ...
