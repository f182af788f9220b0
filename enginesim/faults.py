"""Fault injection: a tiny spec language so tests can make an engine misbehave on purpose.

A spec is ``;``-separated ``key=value`` items, given per request in the ``x-sim-fault`` header or
for every request with ``--fault``. The header replaces the default entirely (``x-sim-fault: none``
turns the default off for one request). Keys:

- ``status=CODE``           answer CODE (400..599) in the engine's error shape, before any header
- ``error_after=N``         fail after N tokens: in-stream error event then ``[DONE]`` (or HTTP 500
                            when nothing was sent yet / non-streaming)
- ``stall_before_first=S``  hang S seconds (``inf`` = forever) after prefill, before the first token
- ``stall_after=N:S``       hang S seconds (``inf`` = forever) after N tokens
- ``drop_after=N``          abort the TCP connection after N tokens: no final chunk, no ``[DONE]``
- ``slow_headers=S``        wait S seconds before sending the response headers
- ``p=P``                   apply this spec to a request with probability P (seeded RNG)

Stalls still notice client disconnects, so a gateway that gives up is seen to abort the request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class FaultSpecError(ValueError):
    """A fault spec that does not parse; the message names the offending item."""


@dataclass(frozen=True)
class FaultSpec:
    status: int | None = None
    error_after: int | None = None
    stall_before_first: float | None = None
    stall_after: tuple[int, float] | None = None
    drop_after: int | None = None
    slow_headers: float | None = None
    probability: float = 1.0

    @property
    def active(self) -> bool:
        """True when the spec would change anything about a request."""
        return any(v is not None for v in (self.status, self.error_after, self.stall_before_first,
                                           self.stall_after, self.drop_after, self.slow_headers))


NO_FAULT = FaultSpec()


def _seconds(key: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise FaultSpecError(f"{key}: {raw!r} is not a number of seconds (or 'inf')") from None
    if value < 0 or math.isnan(value):
        raise FaultSpecError(f"{key}: seconds must be >= 0, got {raw!r}")
    return value


def _count(key: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise FaultSpecError(f"{key}: {raw!r} is not a token count") from None
    if value < 0:
        raise FaultSpecError(f"{key}: token count must be >= 0, got {raw!r}")
    return value


def parse_fault(text: str | None) -> FaultSpec:
    """Parse a spec; ``""``, ``None`` and ``none`` mean no fault."""
    if text is None or not text.strip() or text.strip().lower() == "none":
        return NO_FAULT
    values: dict[str, object] = {}
    for item in text.split(";"):
        item = item.strip()
        if not item:
            continue
        key, sep, raw = item.partition("=")
        key, raw = key.strip().lower(), raw.strip()
        if not sep or not raw:
            raise FaultSpecError(f"fault item {item!r} must look like key=value")
        if key == "status":
            status = _count(key, raw)
            if not 400 <= status <= 599:
                raise FaultSpecError(f"status: {status} is not an HTTP error status (400..599)")
            values["status"] = status
        elif key in ("error_after", "drop_after"):
            values[key] = _count(key, raw)
        elif key in ("stall_before_first", "slow_headers"):
            values[key] = _seconds(key, raw)
        elif key == "stall_after":
            n, colon, secs = raw.partition(":")
            if not colon:
                raise FaultSpecError(f"stall_after: expected N:SECONDS, got {raw!r}")
            values[key] = (_count(key, n.strip()), _seconds(key, secs.strip()))
        elif key == "p":
            try:
                p = float(raw)
            except ValueError:
                raise FaultSpecError(f"p: {raw!r} is not a probability") from None
            if not 0.0 <= p <= 1.0:
                raise FaultSpecError(f"p: probability must be within [0, 1], got {raw!r}")
            values["probability"] = p
        else:
            raise FaultSpecError(
                f"unknown fault {key!r}; known: status, error_after, stall_before_first, "
                "stall_after, drop_after, slow_headers, p")
    return FaultSpec(**values)  # type: ignore[arg-type]
