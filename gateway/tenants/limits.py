"""What a limit check asks and answers, and how the answer reaches the client.

Windows are fixed windows that start at their first hit and last ``window`` from there (60 s for
RPM and TPM, 1 s for per-model RPS): a counter key created with an expiry. A window therefore
resets exactly when its ``x-ratelimit-reset-*`` header says, and a burst of concurrent requests
all lands in the same window, so the limit holds exactly at its boundary.

Order of checks (all read first, then all charged only if every one passes, atomically): model
RPS, user RPM, user TPM, user concurrency. A rejected request consumes nothing (AIBrix counts an
RPM slot for a request it then rejects on TPM; we do not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.config.schema import UserLimits
from gateway.errors import ErrorClass, GatewayError

USER_WINDOW_MS = 60_000
MODEL_WINDOW_MS = 1_000
CONCURRENCY_RETRY_MS = 1_000


@dataclass(slots=True)
class AdmitQuery:
    user: str | None
    limits: UserLimits | None
    model: str
    model_rps: int = 0


@dataclass(slots=True)
class AdmitResult:
    reason: str | None = None            # None: admitted; else model_rps | rpm | tpm | concurrency
    requests: int = 0                    # the RPM window's count (this request included when admitted)
    requests_reset_ms: int = 0
    tokens: int = 0                      # tokens charged in the TPM window
    tokens_reset_ms: int = 0
    concurrent: int = 0                  # the user's requests in flight (fleet-wide)
    model_requests: int = 0
    model_reset_ms: int = 0
    acquired: bool = False               # a concurrency slot was taken and must be released


def fmt_duration(ms: int) -> str:
    """OpenAI's reset format: ``20ms``, ``1.5s``, ``6m0s``."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    if ms < 60_000:
        return f"{ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    m, rest = divmod(ms, 60_000)
    return f"{m}m" + (f"{rest / 1000:.3f}".rstrip("0").rstrip(".") or "0") + "s"


def rate_headers(limits: UserLimits, r: AdmitResult) -> dict[str, str]:
    """``x-ratelimit-*`` as OpenAI sends them, for the limits the user has."""
    h: dict[str, str] = {}
    if limits.rpm:
        h["x-ratelimit-limit-requests"] = str(limits.rpm)
        h["x-ratelimit-remaining-requests"] = str(max(0, limits.rpm - r.requests))
        h["x-ratelimit-reset-requests"] = fmt_duration(r.requests_reset_ms)
    if limits.tpm:
        h["x-ratelimit-limit-tokens"] = str(limits.tpm)
        h["x-ratelimit-remaining-tokens"] = str(max(0, limits.tpm - r.tokens))
        h["x-ratelimit-reset-tokens"] = fmt_duration(r.tokens_reset_ms)
    return h


def rejection(q: AdmitQuery, r: AdmitResult, headers: dict[str, str]) -> GatewayError:
    """The 429 for a failed check; messages and marker headers follow AIBrix's."""
    lim = q.limits
    if r.reason == "model_rps":
        msg, marker, wait = f"model: {q.model} has exceeded RPS: {q.model_rps}", "x-error-model-rps-exceeded", r.model_reset_ms
    elif r.reason == "rpm" and lim is not None:
        msg, marker, wait = f"user: {q.user} has exceeded RPM: {lim.rpm}", "x-error-rpm-exceeded", r.requests_reset_ms
    elif r.reason == "tpm" and lim is not None:
        msg, marker, wait = f"user: {q.user} has exceeded TPM: {lim.tpm}", "x-error-tpm-exceeded", r.tokens_reset_ms
    else:
        n = lim.max_concurrent if lim is not None else 0
        msg, marker, wait = (f"user: {q.user} has reached the limit of {n} concurrent requests",
                             "x-error-concurrency-exceeded", CONCURRENCY_RETRY_MS)
    wait = max(wait, 1)
    out = {**headers, marker: "true", "Retry-After": str(max(1, math.ceil(wait / 1000))), "retry-after-ms": str(wait)}
    return GatewayError(429, msg, code="rate_limit_exceeded", headers=out, error_class=ErrorClass.rate_limit(r.reason))
