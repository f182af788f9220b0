"""Small helpers shared by the strategy tests: a settable clock and a fallback counter."""

from __future__ import annotations

from collections import Counter


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Fallbacks(Counter):
    def __call__(self, strategy: str, reason: str) -> None:
        self[(strategy, reason)] += 1
