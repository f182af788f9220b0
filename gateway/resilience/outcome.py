"""What an upstream leg's outcome means, decided once and in one place.

Every leg to an engine ends in one of four outcomes, and only faults count against the endpoint:

| outcome | examples | breaker |
|---|---|---|
| ``fault`` | connect refused or reset, 5xx other than 501, 503 and 529, a broken stream, an in-stream error event (but a 501's), a watchdog or header timeout | counts |
| ``backpressure`` | 429, 503, 529 (Anthropic's overload): the engine is alive but busy | neutral |
| ``client_error`` | 4xx other than 429: the request's own fault | neutral |
| ``client_error`` | 501, or an in-stream error event with code 501: the engine does not implement what the request asks | neutral |
| ``fault`` | 401, 403 from an engine the gateway sends its key (``api_key``): the key refused | counts |
| ``success`` | a complete answer | closes |

A leg that ends because the client went away says nothing about the engine: ``none``.

Counting a 4xx against an engine opens every breaker as soon as clients send bad requests
(sglang#25811); counting 503 ejects busy engines exactly when capacity is short (sglang#13894),
and a 529 is the same overload as an Anthropic-compatible server answers it.
A 501 is the engine declining a request it does not support, as a 4xx declines a bad one: another
endpoint of the same engine would decline it too, and the engine serves its other requests. An
engine whose stream's head went out before it found that (vLLM sends its head at once) says it in
an error event instead, ``data: {"error": {..., "code": 501}}``: the same answer (``unsupported_event``;
the code written as a string, ``"501"``, is read as the number).

The classifiers here read only a status, a failure kind (``gateway.upstream.upstream.UpstreamFailure``) or
what the relay left on the request's record; ``gateway.resilience.breaker`` acts on the result.
"""

from __future__ import annotations

import enum

from gateway.errors import ErrorClass


class Outcome(enum.Enum):
    SUCCESS = "success"
    FAULT = "fault"
    BACKPRESSURE = "backpressure"
    CLIENT_ERROR = "client_error"
    NONE = "none"             # the client went away: nothing learnt about the engine

    @property
    def retryable(self) -> bool:
        """Worth another endpoint when nothing reached the client yet."""
        return self is Outcome.FAULT or self is Outcome.BACKPRESSURE


# busy: a rate limit, the engine unavailable or overloaded (529, which an Anthropic-compatible
# server answers for overload as others answer 503)
BACKPRESSURE_STATUSES = frozenset({429, 503, 529})
AUTH_STATUSES = frozenset({401, 403})
# the engine lacks what the request asks (vLLM answers 501 for a feature it does not implement)
UNSUPPORTED_STATUSES = frozenset({501})


def key_refused(status: int, keyed: bool) -> bool:
    """An engine that was sent the gateway's key for it (``keyed``) refused it: a wrong key, the
    endpoint's fault whatever the request (another endpoint may have the right one)."""
    return keyed and status in AUTH_STATUSES


def of_status(status: int, keyed: bool = False) -> Outcome:
    """An engine's HTTP answer status; ``keyed``: the leg carried the gateway's key for the engine."""
    if status < 400:
        return Outcome.SUCCESS
    if status in BACKPRESSURE_STATUSES:
        return Outcome.BACKPRESSURE
    if status < 500:
        return Outcome.FAULT if key_refused(status, keyed) else Outcome.CLIENT_ERROR
    if status in UNSUPPORTED_STATUSES:
        return Outcome.CLIENT_ERROR
    return Outcome.FAULT


def event_status(error: object) -> int | None:
    """The HTTP status an engine's in-stream error (the ``error`` object of its
    ``data: {"error": {...}}`` event) names by its ``code``: the number, or a string that is exactly
    one written in decimal (``"501"``: three ASCII digits, 100..599), as some servers write it.
    None for anything else: no code, a name (``"upstream_timeout"``), a bool, ``" 501"``, ``"0501"``."""
    if error.__class__ is not dict:
        return None
    code = error.get("code")      # type: ignore[attr-defined]
    if code.__class__ is int:
        return code
    if code.__class__ is str and len(code) == 3 and "1" <= code[0] <= "5" and code.isascii() and code.isdigit():
        return int(code)
    return None


def unsupported_event(error: object) -> bool:
    """An engine's in-stream error (the ``error`` object of its ``data: {"error": {...}}`` event)
    that is its 501: its ``code`` (``event_status``) says the engine does not implement what the
    request asks."""
    return event_status(error) in UNSUPPORTED_STATUSES


def of_failure(kind: str) -> Outcome:
    """A leg that failed before its answer's status arrived (connect, reset, timeout, protocol):
    always the engine's side, or the path to it."""
    return Outcome.FAULT


# the relay's error classes (gateway/pipeline/relay.py) once an answer's head arrived: each is a fault
_FAULT_CLASSES = frozenset({ErrorClass.UPSTREAM_EOF, ErrorClass.UPSTREAM_BROKEN, ErrorClass.UPSTREAM_TIMEOUT,
                            ErrorClass.UPSTREAM_STREAM_ERROR}
                           | {c for c in ErrorClass if c.is_watchdog})


def of_answer(status: int, error_class: ErrorClass | None) -> Outcome:
    """The outcome of a relayed answer, from what the relay recorded: its status and error class.
    A stream counts as a success only when it completed; a watchdog that fired, a stream the
    engine broke or closed early, or an error event inside it are faults, but for an error event
    with code 501 (``UPSTREAM_STREAM_UNSUPPORTED``), a client error as the HTTP 501 is."""
    if error_class is None and 0 < status < 400:     # the usual answer: a success at the first test
        return Outcome.SUCCESS
    if error_class == ErrorClass.CLIENT_CANCEL:
        return Outcome.NONE
    if error_class == ErrorClass.UPSTREAM_STREAM_UNSUPPORTED:     # an error event with code 501
        return Outcome.CLIENT_ERROR
    if error_class in _FAULT_CLASSES:
        return Outcome.FAULT
    if error_class == ErrorClass.UPSTREAM_STATUS or status >= 400:
        return of_status(status)
    if status == 0:           # nothing was answered (a bug, or a cancel before any write)
        return Outcome.NONE
    return Outcome.SUCCESS
