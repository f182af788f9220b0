"""The router contract.

A router is pure and synchronous: given the parsed request and the ready candidates it returns a
``Decision``. It does no I/O and never awaits, so the pipeline can select and charge the chosen
endpoint in one synchronous step (no other request can interleave between the two).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from gateway.endpoints import Endpoint
from gateway.request import InferenceRequest


@dataclass(slots=True)
class Decision:
    endpoint: Endpoint
    strategy: str                                           # the strategy string as requested
    headers: dict[str, str] = field(default_factory=dict)   # extra response headers (e.g. x-session-id)


@dataclass
class RouterContext:
    """Shared, non-I/O state a router may use. One per gateway app."""

    rng: random.Random = field(default_factory=random.Random)
    metrics_max_age_s: float = 10.0
    # called as on_fallback(strategy, reason) when a strategy lacks its signal and falls back
    on_fallback: Callable[[str, str], None] = lambda strategy, reason: None


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
