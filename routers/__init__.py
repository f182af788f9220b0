"""Routing strategies: pure, synchronous functions of (request, candidates) → Decision."""

from routers.base import Decision, Router, RouterContext, ScoringRouter
from routers.registry import (
    RouterRegistry,
    StrategyError,
    WeightedRouter,
    default_registry,
    parse_strategy,
)
from routers.simple import LeastRequestRouter, RandomRouter, RoundRobinRouter

__all__ = [
    "Decision",
    "LeastRequestRouter",
    "RandomRouter",
    "RoundRobinRouter",
    "Router",
    "RouterContext",
    "RouterRegistry",
    "ScoringRouter",
    "StrategyError",
    "WeightedRouter",
    "default_registry",
    "parse_strategy",
]
