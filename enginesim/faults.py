"""Fault injection: a tiny spec language so tests can make an engine misbehave on purpose.

A spec is ``;``-separated ``key=value`` items, given per request in the ``x-sim-fault`` header or
for every request with ``--fault``. The header replaces the default entirely (``x-sim-fault: none``
turns the default off for one request). Keys:

- ``status=CODE``           answer CODE (400..599) in the engine's error shape, before any header
- ``error_after=N``         fail after N tokens: in-stream error event then ``[DONE]`` (or HTTP 500
                            when nothing was sent yet / non-streaming)
- ``error_code=CODE``       the status (400..599) ``error_after``'s failure carries instead of 500:
                            the ``code`` of its in-stream error event, or the HTTP status when
                            nothing was sent yet / non-streaming (``501``: vLLM's answer for what it
                            does not implement). Quoted, ``error_code="501"``, the event's
                            ``code`` is that string, as some servers send it (an HTTP status stays
                            the number)
- ``stall_before_first=S``  hang S seconds (``inf`` = forever) after prefill, before the first token
- ``stall_after=N:S``       hang S seconds (``inf`` = forever) after N tokens
- ``drop_after=N``          abort the TCP connection after N tokens: no final chunk, no ``[DONE]``
- ``slow_headers=S``        wait S seconds before sending the response headers
- ``stall_at_end=S``        a stream: hold its end S seconds (``inf`` = forever) after its last event
                            (``[DONE]``, ``message_stop``, ``response.completed``)
- ``drop_at_end=1``         a stream: abort the TCP connection after its last event, instead of
                            ending the body (the peer has every event, then sees a reset)
- ``hang=S``                hold the request S seconds (``inf`` = forever) before anything else
                            happens to it: no prefill, no P/D rendezvous, no KV pull or pin
- ``kv_pull_fail=1``        P/D: this request's KV transfer fails (vLLM decode: the pull; SGLang
                            decode: the transfer, seen by both legs)
- ``p=P``                   apply this spec to a request with probability P (seeded RNG)

Alternatives: specs separated by ``|`` are tried in order, each rolling its own ``p=``; the first
that hits applies. ``status=500;p=0.5 | drop_after=5;p=0.2`` answers half of the requests with a
500 and breaks a fifth of the others after 5 tokens (a sick engine).

Role targeting: a gateway forwards the client's headers to both legs of a P/D request, so an item
may be prefixed with a role, ``prefill.status=503;decode.stall_before_first=10``. Prefixed items
apply only on an engine of that role (``aggregated.``, ``prefill.``, ``decode.``) and override an
unprefixed item with the same key; unprefixed items apply on every role.

Stalls still notice client disconnects, so a gateway that gives up is seen to abort the request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ROLES = ("aggregated", "prefill", "decode")
KEYS = ("status", "error_after", "error_code", "stall_before_first", "stall_after", "drop_after", "slow_headers",
        "hang", "kv_pull_fail", "stall_at_end", "drop_at_end", "p")


class FaultSpecError(ValueError):
    """A fault spec that does not parse; the message names the offending item."""


@dataclass(frozen=True)
class FaultSpec:
    status: int | None = None
    error_after: int | None = None
    error_code: int | None = None       # the status error_after's failure carries (None: 500)
    error_code_text: bool = False       # error_code was quoted: its in-stream event's code is a string
    stall_before_first: float | None = None
    stall_after: tuple[int, float] | None = None
    drop_after: int | None = None
    slow_headers: float | None = None
    hang: float | None = None
    kv_pull_fail: bool = False
    stall_at_end: float | None = None
    drop_at_end: bool = False
    probability: float = 1.0
    otherwise: FaultSpec | None = None     # the next ``|`` alternative, tried when this one's roll misses

    @property
    def active(self) -> bool:
        """True when the spec (or one of its alternatives) would change anything about a request."""
        return self.kv_pull_fail or self.drop_at_end or any(
            v is not None for v in (self.status, self.error_after, self.stall_before_first,
                                    self.stall_after, self.drop_after, self.slow_headers, self.hang,
                                    self.stall_at_end)) \
            or (self.otherwise is not None and self.otherwise.active)

    def roll(self, draw) -> FaultSpec | None:
        """The alternative that applies to one request: each rolls its ``p`` with ``draw()`` (a
        number in [0, 1)) in order; ``None`` when none hits."""
        spec: FaultSpec | None = self
        while spec is not None:
            own = FaultSpec(**{**spec.__dict__, "otherwise": None})
            if own.active and (spec.probability >= 1.0 or draw() < spec.probability):
                return own
            spec = spec.otherwise
        return None


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


def _flag(key: str, raw: str) -> bool:
    low = raw.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise FaultSpecError(f"{key}: expected 1 or 0, got {raw!r}")


def _value(key: str, raw: str) -> tuple[str, object]:
    """One item's (FaultSpec field, parsed value)."""
    if key in ("status", "error_code"):
        status = _count(key, raw)
        if not 400 <= status <= 599:
            raise FaultSpecError(f"{key}: {status} is not an HTTP error status (400..599)")
        return key, status
    if key in ("error_after", "drop_after"):
        return key, _count(key, raw)
    if key in ("stall_before_first", "slow_headers", "hang", "stall_at_end"):
        return key, _seconds(key, raw)
    if key == "stall_after":
        n, colon, secs = raw.partition(":")
        if not colon:
            raise FaultSpecError(f"stall_after: expected N:SECONDS, got {raw!r}")
        return key, (_count(key, n.strip()), _seconds(key, secs.strip()))
    if key in ("kv_pull_fail", "drop_at_end"):
        return key, _flag(key, raw)
    if key == "p":
        try:
            p = float(raw)
        except ValueError:
            raise FaultSpecError(f"p: {raw!r} is not a probability") from None
        if not 0.0 <= p <= 1.0:
            raise FaultSpecError(f"p: probability must be within [0, 1], got {raw!r}")
        return "probability", p
    raise FaultSpecError(f"unknown fault {key!r}; known: {', '.join(KEYS)} "
                         f"(optionally prefixed with a role: {', '.join(r + '.' for r in ROLES)})")


def parse_fault(text: str | None, role: str | None = None) -> FaultSpec:
    """Parse a spec for an engine of ``role``; ``""``, ``None`` and ``none`` mean no fault.

    Items prefixed with another role (or any role, when ``role`` is ``None``) are checked but
    left out of the result.
    """
    if text is None or not text.strip() or text.strip().lower() == "none":
        return NO_FAULT
    if "|" in text:
        head, _, rest = text.partition("|")
        first = parse_fault(head, role)
        return FaultSpec(**{**first.__dict__, "otherwise": parse_fault(rest, role)})
    general: dict[str, object] = {}
    targeted: dict[str, object] = {}
    for item in text.split(";"):
        item = item.strip()
        if not item:
            continue
        key, sep, raw = item.partition("=")
        key, raw = key.strip().lower(), raw.strip()
        if not sep or not raw:
            raise FaultSpecError(f"fault item {item!r} must look like key=value")
        prefix, dot, bare = key.rpartition(".")
        if dot and prefix not in ROLES:
            raise FaultSpecError(f"fault item {item!r}: unknown role {prefix!r}; "
                                 f"known: {', '.join(ROLES)}")
        quoted = bare == "error_code" and len(raw) > 1 and raw[0] == raw[-1] == '"'
        field_name, value = _value(bare, raw[1:-1] if quoted else raw)
        fields = {field_name: value, "error_code_text": quoted} if bare == "error_code" else {field_name: value}
        if not dot:
            general.update(fields)
        elif prefix == role:
            targeted.update(fields)
    return FaultSpec(**{**general, **targeted})  # type: ignore[arg-type]
