"""In-memory limit state with a fake clock: windows, TPM after the fact, slots, sweeping."""



from gateway.config.schema import UserLimits
from gateway.tenants.limits import AdmitQuery, rate_headers
from gateway.tenants.memory import MemoryState
from tests.support.factories import Clock


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
