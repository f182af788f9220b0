"""The router contract.

A router is pure and synchronous: given the parsed request and the ready candidates it returns a
``Decision``. It does no I/O and never awaits, so the pipeline can select and charge the chosen
endpoint in one synchronous step (no other request can interleave between the two).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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


@dataclass
class RouterContext:
    """Shared, non-I/O state a router may use. One per gateway app."""

    rng: random.Random = field(default_factory=random.Random)
    metrics_max_age_s: float = 10.0
    # called as on_fallback(strategy, reason) when a strategy lacks its signal and falls back
    on_fallback: Callable[[str, str], None] = lambda strategy, reason: None
    # P/D settings for a model (a gateway.config.PDConfig); routers read attributes only
    pd_settings: Callable[[str], Any] | None = None


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
