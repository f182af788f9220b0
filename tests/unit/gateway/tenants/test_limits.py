"""Limit answers: reset durations, the 429 with Retry-After and rate headers."""


import pytest

from gateway.config.schema import UserLimits
from gateway.tenants.limits import AdmitQuery, AdmitResult, fmt_duration, rate_headers, rejection


@pytest.mark.parametrize("ms,text", [(0, "0s"), (-5, "0s"), (20, "20ms"), (1000, "1s"), (1500, "1.5s"),
                                     (59_999, "59.999s"), (60_000, "1m0s"), (360_000, "6m0s"), (61_250, "1m1.25s")])
def test_reset_durations_in_openai_format(ms, text):
    assert fmt_duration(ms) == text


def test_rejection_is_an_openai_429_with_retry_after():
    q = AdmitQuery("alice", UserLimits(rpm=5, tpm=100), "m")
    r = AdmitResult(reason="rpm", requests=5, requests_reset_ms=1234, tokens=10, tokens_reset_ms=50_000)
    headers = rate_headers(q.limits, r)
    e = rejection(q, r, headers)
    assert e.status == 429 and e.code == "rate_limit_exceeded" and e.type == "rate_limit_error"
    assert e.message == "user: alice has exceeded RPM: 5"
    assert e.headers["Retry-After"] == "2" and e.headers["retry-after-ms"] == "1234"
    assert e.headers["x-error-rpm-exceeded"] == "true"
    assert e.headers["x-ratelimit-remaining-requests"] == "0" and e.headers["x-ratelimit-remaining-tokens"] == "90"
    tpm = rejection(q, AdmitResult(reason="tpm", tokens=100, tokens_reset_ms=30_000), {})
    assert tpm.message == "user: alice has exceeded TPM: 100" and tpm.headers["Retry-After"] == "30"
    rps = rejection(AdmitQuery(None, None, "m", 7), AdmitResult(reason="model_rps", model_reset_ms=300), {})
    assert rps.message == "model: m has exceeded RPS: 7" and rps.headers["x-error-model-rps-exceeded"] == "true"
