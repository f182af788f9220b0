"""Charges on endpoints, released exactly once.

A ``Lease`` is taken in the same synchronous step as the routing decision (no ``await`` between
select and charge), so concurrent requests always see each other's load. ``release`` is
idempotent: every exit path may call it, only the first call counts.
"""

from __future__ import annotations

from gateway.endpoints import Endpoint


class Lease:
    __slots__ = ("endpoint", "_gauge", "released")

    def __init__(self, endpoint: Endpoint, gauge) -> None:
        self.endpoint = endpoint
        self._gauge = gauge
        self.released = False
        endpoint.in_flight += 1
        gauge.inc()

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.endpoint.in_flight -= 1
        self._gauge.dec()
