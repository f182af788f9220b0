"""The gateway's own counter and histogram export exactly what prometheus-client's would."""

from __future__ import annotations

import re

import prometheus_client
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from gateway.observability.metrics import ITL_BUCKETS, LATENCY_BUCKETS, Counter, Histogram, observe_all


def _text(registry: CollectorRegistry) -> list[str]:
    """The exposition without the ``_created`` series (creation times differ by a few µs)."""
    out = generate_latest(registry).decode().splitlines()
    return sorted(line for line in out if "_created" not in line)


def _pair(kind: str, *args, **kw):
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = {"counter": Counter, "histogram": Histogram}[kind](*args, registry=ours, **kw)
    ref = {"counter": prometheus_client.Counter, "histogram": prometheus_client.Histogram}[kind](
        *args, registry=theirs, **kw)
    return ours, theirs, mine, ref


@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c\"x"]), st.integers(0, 1000)), max_size=30))
def test_counter_exposition_matches_prometheus_client(incs):
    ours, theirs, mine, ref = _pair("counter", "switchyard_things", "Things", ["model"])
    for label, n in incs:
        mine.labels(label).inc(n)
        ref.labels(label).inc(n)
    assert _text(ours) == _text(theirs)


@given(st.lists(st.tuples(st.sampled_from(["m", "n"]),
                          st.one_of(st.sampled_from(LATENCY_BUCKETS), st.floats(0, 1000, allow_nan=False))),
                max_size=40))
def test_histogram_exposition_matches_prometheus_client_on_and_between_bounds(values):
    ours, theirs, mine, ref = _pair("histogram", "switchyard_latency_seconds", "Latency", ["model"],
                                    buckets=LATENCY_BUCKETS)
    for label, v in values:
        mine.labels(label).observe(v)
        ref.labels(label).observe(v)
    assert _text(ours) == _text(theirs)


def test_observe_all_equals_one_observe_per_value():
    reg_a, reg_b = CollectorRegistry(), CollectorRegistry()
    a = Histogram("h_seconds", "h", ["m"], registry=reg_a, buckets=(0.01, 0.1, 1.0))
    b = Histogram("h_seconds", "h", ["m"], registry=reg_b, buckets=(0.01, 0.1, 1.0))
    values = [0.0, 0.01, 0.05, 0.1, 0.5, 1.0, 3.0]
    observe_all(a.labels("x"), values)
    for v in values:
        b.labels("x").observe(v)
    assert _text(reg_a) == _text(reg_b)


@given(st.lists(st.one_of(st.sampled_from(ITL_BUCKETS), st.floats(-1, 50, allow_nan=False),
                          st.just(float("inf"))), max_size=300))
def test_observe_many_counts_as_one_observe_per_value_short_or_long(values):
    """A stream's gaps observed at once (sorted and cut at the bounds from 16 on) land in the same
    buckets as observed one by one; the sum adds each batch's sum, in the values' order."""
    a = Histogram("g_seconds", "g", ["m"], registry=CollectorRegistry(), buckets=ITL_BUCKETS).labels("x")
    b = Histogram("g_seconds", "g", ["m"], registry=CollectorRegistry(), buckets=ITL_BUCKETS).labels("x")
    a.observe_many(values)
    a.observe_many(iter(values[:3]))
    for v in values + values[:3]:
        b.observe(v)
    assert a.counts == b.counts
    total = 0.0
    for batch in (values, values[:3]):
        s = 0.0
        for v in batch:
            s += v
        total += s
    assert a.sum == total


def test_unlabelled_series_and_created_samples_are_exported():
    reg = CollectorRegistry()
    c = Counter("switchyard_errors_total", "Errors", registry=reg)   # a _total suffix is the family's
    h = Histogram("switchyard_lag_seconds", "Lag", registry=reg, buckets=(0.5,))
    c.inc()
    c.inc(2)
    h.observe(0.2)
    assert reg.get_sample_value("switchyard_errors_total") == 3
    assert reg.get_sample_value("switchyard_lag_seconds_bucket", {"le": "0.5"}) == 1
    assert reg.get_sample_value("switchyard_lag_seconds_count") == 1
    assert reg.get_sample_value("switchyard_errors_created") > 0
    assert reg.get_sample_value("switchyard_lag_seconds_created") > 0


def test_misuse_is_refused():
    reg = CollectorRegistry()
    c = Counter("switchyard_x", "X", ["a", "b"], registry=reg)
    with pytest.raises(ValueError, match="2 label values"):
        c.labels("only-one")
    with pytest.raises(ValueError, match="non-negative"):
        c.labels("1", "2").inc(-1)
    with pytest.raises(ValueError, match="has labels"):
        c.inc()
    assert c.labels(a="1", b="2") is c.labels("1", "2")
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Counter("switchyard_x", "again", registry=reg)      # a clash fails at registration
    with pytest.raises(ValueError, match="distinct"):
        Histogram("switchyard_h", "H", registry=reg, buckets=(1.0, 1.0))
    assert re.search(r'switchyard_x_total\{a="1",b="2"\} 0\.0', generate_latest(reg).decode())
