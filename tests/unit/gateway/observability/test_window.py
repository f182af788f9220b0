"""The traffic window: log-bucket quantiles within 5 %, time buckets that roll over, honest rates."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.observability.window import BUCKETS, LOW, TimeWindow, bucket_of, bucket_value, quantiles


def hist(values) -> dict[int, int]:
    out: dict[int, int] = {}
    for v in values:
        b = bucket_of(v)
        out[b] = out.get(b, 0) + 1
    return out


def nearest_rank(values, q: float) -> float:
    s = sorted(values)
    return s[max(1, math.ceil(q * len(s))) - 1]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=LOW, max_value=1000.0), min_size=1, max_size=300),
       st.sampled_from([0.01, 0.5, 0.9, 0.99, 1.0]))
def test_quantiles_are_within_five_percent_of_the_true_rank(values, q):
    (got,) = quantiles(hist(values), [q])
    want = nearest_rank(values, q)
    assert abs(got - want) <= 0.05 * want


def test_bucket_edges():
    assert bucket_of(0.0) == bucket_of(-1.0) == bucket_of(LOW) == 0
    assert bucket_of(1e9) == BUCKETS - 1
    assert bucket_value(bucket_of(0.25)) == pytest.approx(0.25, rel=0.05)
    assert quantiles({}, [0.5, 0.99]) == [None, None]


def test_requests_land_in_their_bucket_and_old_buckets_are_reused():
    w = TimeWindow(bucket_s=10, slots=3, started=0.0)
    w.observe(5.0, False, 0.1, 0.2, 10, 5)
    w.observe(15.0, True, None, None, None, None)
    w.observe(25.0, False, 0.3, 0.4, 1, 1)
    assert w.series(29.0) == [1, 1, 1]
    s = w.summary(29.0, 30)
    assert (s.requests, s.errors, s.prompt_tokens, s.completion_tokens) == (3, 1, 11, 6)
    assert s.view()["ttft_count"] == 2
    # 35 s: the bucket of 5 s is the one 35 s reuses; the old count is gone
    w.observe(35.0, False, None, None, None, None)
    assert w.series(35.0) == [1, 1, 1]
    assert w.summary(35.0, 30).requests == 3 and w.summary(35.0, 30).errors == 1
    # a long silence: everything has left the window
    assert w.series(100.0) == [0, 0, 0] and w.summary(100.0, 30).requests == 0
    assert w.summary(100.0, 30).view()["ttft_p50_ms"] is None


def test_spans_and_rates_count_the_current_bucket_so_far():
    w = TimeWindow(bucket_s=10, slots=30, started=0.0)
    for t in range(0, 300, 2):            # one request every 2 s for 5 minutes
        w.observe(float(t), False, None, 0.01, None, None)
    minute = w.summary(299.0, 60)          # 5 whole buckets and 9 s of the current one
    assert minute.requests == 30 and minute.seconds == pytest.approx(59.0)
    assert minute.view()["rps"] == pytest.approx(30 / 59.0, rel=1e-3)
    whole = w.summary(299.0, 300)
    assert whole.requests == 150 and whole.view()["rps"] == pytest.approx(150 / 299.0, rel=1e-3)
    assert whole.view()["e2e_p50_ms"] == pytest.approx(10.0, rel=0.05)


def test_a_young_window_divides_by_its_age_not_by_the_span():
    w = TimeWindow(bucket_s=10, slots=30, started=1000.0)
    w.observe(1004.0, False, None, None, None, None)
    w.observe(1004.0, False, None, None, None, None)
    s = w.summary(1004.0, 60)
    assert s.seconds == pytest.approx(4.0) and s.view()["rps"] == pytest.approx(0.5)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError):
        TimeWindow(bucket_s=0, slots=3, started=0.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(min_value=0, max_value=50), st.booleans(),
                          st.floats(min_value=LOW, max_value=10.0)), min_size=1, max_size=120),
       st.lists(st.floats(min_value=0, max_value=30), min_size=1, max_size=6))
def test_summaries_match_a_recount_of_the_raw_requests(gaps, polls):
    """Requests and polls interleaved in time, as a gateway sees them: every poll's numbers are
    what a brute-force count of the requests in its span says (the cached finished buckets
    included)."""
    w = TimeWindow(bucket_s=5, slots=12, started=0.0)
    seen: list[tuple[float, bool, float]] = []
    t = 0.0
    polls = iter(polls)
    for i, (gap, failed, latency) in enumerate(gaps):
        t += gap
        w.observe(t, failed, latency, None if failed else latency, 1, 2)
        seen.append((t, failed, latency))
        if i % 3 == 0:
            t += next(polls, 0.0)
            for span, got in zip((20.0, 60.0), w.summaries(t, 20.0, 60.0), strict=True):
                index = int(t // 5)
                first = index - math.ceil(span / 5) + 1
                inside = [(f, lat) for at, f, lat in seen if int(at // 5) >= first]
                assert (got.requests, got.errors) == (len(inside), sum(f for f, _ in inside))
                assert got.prompt_tokens == len(inside) and got.completion_tokens == 2 * len(inside)
                assert got.ttft == hist(lat for _, lat in inside)
                assert got.e2e == hist(lat for f, lat in inside if not f)
                assert got.seconds == pytest.approx(min(span - 5 + (t - index * 5), t))


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=-1.0, max_value=1e6, allow_nan=False))
def test_observe_buckets_as_bucket_of_does(seconds):
    w = TimeWindow(bucket_s=10, slots=1, started=0.0)
    w.observe(1.0, False, seconds, seconds, None, None)
    assert w.summary(1.0, 10).ttft == w.summary(1.0, 10).e2e == {bucket_of(seconds): 1}
