"""Charges on endpoints, released exactly once.

A ``Lease`` is taken in the same synchronous step as the routing decision (no ``await`` between
select and charge), so concurrent requests always see each other's load. ``release`` is
idempotent: every exit path may call it, only the first call counts.
"""

from __future__ import annotations

from gateway.endpoints import Endpoint


class Lease:
    __slots__ = ("endpoint", "released")

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.released = False
        endpoint.in_flight += 1

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.endpoint.in_flight -= 1
