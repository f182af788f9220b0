"""The shared view's recent-lag window: the last samples in a ring of C doubles."""

from __future__ import annotations

from gateway.observability.metrics import GatewayMetrics
from gateway.view.metrics import LAG_WINDOW, ViewMetrics, Window


def test_an_empty_window_holds_nothing():
    w = Window(4)
    assert len(w) == 0
    assert w.values() == []


def test_the_window_keeps_the_last_samples_once_it_wraps():
    w = Window(4)
    for x in (1.0, 2.0, 3.0):
        w.append(x)
    assert sorted(w.values()) == [1.0, 2.0, 3.0]
    for x in (4.0, 5.0, 6.0):
        w.append(x)
    assert len(w) == 4
    assert sorted(w.values()) == [3.0, 4.0, 5.0, 6.0]


def test_the_recent_quantiles_read_only_the_last_window_of_samples():
    m = ViewMetrics(GatewayMetrics())
    assert m.lag_quantiles("worker") is None
    for _ in range(LAG_WINDOW):
        m.observe_lag("worker", 1.0)           # pushed out by what follows
    for i in range(LAG_WINDOW):
        m.observe_lag("worker", i / 1000)
    q = m.lag_quantiles("worker")
    assert q == {"p50": (LAG_WINDOW // 2) / 1000, "p99": int(0.99 * LAG_WINDOW) / 1000, "samples": float(LAG_WINDOW)}
    assert m.lag_quantiles("replica") is None
