"""Tenancy pieces without sockets: windows (with a fake clock), headers, keys, the directory."""

import hashlib

import pytest

from gateway.config import ApiKey, AuthConfig, LimitsConfig, UserLimits
from gateway.tenants.directory import Directory, bearer_token, key_digest, new_key
from gateway.tenants.limits import AdmitQuery, AdmitResult, fmt_duration, rate_headers, rejection
from gateway.tenants.memory import MemoryState


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("ms,text", [(0, "0s"), (-5, "0s"), (20, "20ms"), (1000, "1s"), (1500, "1.5s"),
                                     (59_999, "59.999s"), (60_000, "1m0s"), (360_000, "6m0s"), (61_250, "1m1.25s")])
def test_reset_durations_in_openai_format(ms, text):
    assert fmt_duration(ms) == text


@pytest.mark.parametrize("header,token", [("Bearer sk-1", "sk-1"), ("bearer  sk-1 ", "sk-1"), ("BEARER sk-1", "sk-1"),
                                          ("Basic abc", None), ("Bearer", None), ("Bearer ", None), ("", None),
                                          (None, None), ("sk-1", None)])
def test_bearer_token(header, token):
    assert bearer_token(header) == token


def test_generated_keys_are_unique_and_prefixed():
    keys = {new_key() for _ in range(100)}
    assert len(keys) == 100 and all(k.startswith("sk-sy-") and len(k) > 40 for k in keys)


async def test_rpm_window_is_exact_and_resets_after_its_minute():
    clock = Clock()
    st = MemoryState(clock)
    q = AdmitQuery("alice", UserLimits(rpm=3), "m")
    results = [await st.admit(q) for _ in range(5)]
    assert [r.reason for r in results] == [None, None, None, "rpm", "rpm"]
    assert [r.requests for r in results] == [1, 2, 3, 3, 3]      # rejections consume nothing
    assert results[0].requests_reset_ms == 60_000
    clock.t += 59.5
    r = await st.admit(q)
    assert r.reason == "rpm" and r.requests_reset_ms == 500
    clock.t += 0.5
    r = await st.admit(q)
    assert r.reason is None and r.requests == 1 and r.requests_reset_ms == 60_000


async def test_tpm_is_charged_after_the_fact_and_blocks_the_next_request():
    clock = Clock()
    st = MemoryState(clock)
    q = AdmitQuery("bob", UserLimits(rpm=100, tpm=50), "m")
    assert (await st.admit(q)).reason is None
    st.settle("bob", 49, False)
    r = await st.admit(q)
    assert r.reason is None and r.tokens == 49
    assert rate_headers(q.limits, r)["x-ratelimit-remaining-tokens"] == "1"
    st.settle("bob", 30, False)          # the request in flight overshoots: charged in full
    r = await st.admit(q)
    assert r.reason == "tpm" and r.tokens == 79 and r.requests == 2   # the RPM slot was not taken
    clock.t += 60
    assert (await st.admit(q)).reason is None


async def test_concurrency_slots_are_taken_and_released():
    st = MemoryState(Clock())
    q = AdmitQuery("carol", UserLimits(max_concurrent=2), "m")
    a, b, c = [await st.admit(q) for _ in range(3)]
    assert a.acquired and b.acquired and not c.acquired and c.reason == "concurrency"
    st.settle("carol", 0, True)
    d = await st.admit(q)
    assert d.reason is None and d.concurrent == 2
    assert (await st.usage("carol"))["concurrent"] == 2


async def test_model_rps_is_checked_first_and_per_model():
    clock = Clock()
    st = MemoryState(clock)
    ok = [await st.admit(AdmitQuery(None, None, "m", model_rps=2)) for _ in range(3)]
    assert [r.reason for r in ok] == [None, None, "model_rps"]
    assert (await st.admit(AdmitQuery(None, None, "other", model_rps=2))).reason is None
    # a user with RPM room left is still refused by the model's RPS, and keeps the RPM slot
    r = await st.admit(AdmitQuery("dave", UserLimits(rpm=10), "m", model_rps=2))
    assert r.reason == "model_rps" and r.requests == 0
    clock.t += 1.0
    assert (await st.admit(AdmitQuery(None, None, "m", model_rps=2))).reason is None


async def test_expired_windows_are_swept():
    clock = Clock()
    st = MemoryState(clock)
    for i in range(100):
        await st.admit(AdmitQuery(f"u{i}", UserLimits(rpm=1), "m"))
    assert len(st._windows) == 100
    clock.t += 61
    await st.admit(AdmitQuery("last", UserLimits(rpm=1), "m"))
    assert len(st._windows) == 1


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


def test_directory_precedence_store_then_config_then_default():
    auth = AuthConfig(api_keys=(ApiKey(key="k", user="alice", key_sha256=key_digest("k")),))
    d = Directory(auth, LimitsConfig(users={"alice": UserLimits(rpm=1), "free": UserLimits()},
                                     default_user=UserLimits(rpm=7)))
    assert d.key(hashlib.sha256(b"k").hexdigest()).user == "alice"
    assert d.key(key_digest("nope")) is None
    assert d.limits_for("alice").rpm == 1
    assert d.limits_for("stranger").rpm == 7
    assert d.limits_for("free") is None                  # configured with no limits: unlimited
    assert d.limits_for(None) is None
    d.replace_store({"alice": UserLimits(rpm=2)}, {})
    assert d.limits_for("alice").rpm == 2
    assert d.user_view("alice") == {"name": "alice", "rpm": 2, "tpm": 0, "max_concurrent": 0, "source": "store",
                                    "overrides_config": True}
