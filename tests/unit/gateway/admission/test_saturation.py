"""Saturation: the engine's queue estimated between scrapes, KV usage, the in-flight cap, and
stale metrics counting as saturated."""

from __future__ import annotations

import pytest

from gateway.admission.saturation import UNBOUNDED, Thresholds, estimate, total_headroom, unsaturated
from gateway.config.schema import ConfigError, config_from_dict
from gateway.endpoints import EngineMetrics
from tests.support.factories import endpoint

TH = Thresholds(max_waiting=2, max_kv=0.8, max_in_flight=0, max_age=5.0)


def scrape(e, now, running, waiting, kv=0.1):
    e.metrics = EngineMetrics(scraped_at=now, running=running, waiting=waiting, kv_usage=kv)
    estimate(e, TH, now)          # the monitor's listener re-bases at once


def test_the_engine_queue_is_estimated_from_releases_and_dispatches_since_the_scrape():
    e = endpoint()
    scrape(e, 100.0, running=4, waiting=0)
    assert estimate(e, TH, 100.0).headroom == 2          # capacity unknown: the scraped queue as is
    e.in_flight = 6
    scrape(e, 101.0, running=4, waiting=2)               # queued at 4 running: capacity is 4
    est = estimate(e, TH, 101.0)
    assert est.saturated and est.reason == "waiting" and est.waiting == 2
    e.in_flight = 5                                      # one finished: one waiting moved up
    assert estimate(e, TH, 101.5).headroom == 1
    e.in_flight = 3                                      # three finished: the queue is empty, a slot free
    est = estimate(e, TH, 101.5)
    assert est.waiting == -1 and est.headroom == 3
    e.in_flight = 6                                      # three more sent since
    assert estimate(e, TH, 101.6).saturated


def test_kv_usage_and_the_in_flight_cap():
    e = endpoint()
    scrape(e, 100.0, running=1, waiting=0, kv=0.85)
    assert estimate(e, TH, 100.0).reason == "kv"
    capped = Thresholds(max_in_flight=2, engine_signals=False)
    e.in_flight = 1
    assert estimate(e, capped, 100.0).headroom == 1
    e.in_flight = 2
    assert estimate(e, capped, 100.0).reason == "in_flight"
    assert estimate(e, Thresholds(engine_signals=False), 100.0).headroom == UNBOUNDED


def test_stale_or_missing_metrics_count_as_saturated():
    e = endpoint()
    assert estimate(e, TH, 100.0).reason == "stale"      # never scraped
    scrape(e, 100.0, running=0, waiting=0)
    assert not estimate(e, TH, 105.0).saturated
    assert estimate(e, TH, 105.1).reason == "stale"


def test_pairs_need_room_on_both_sides_and_the_filter_keeps_endpoints_with_room():
    p, d1, d2 = endpoint(1, role="prefill"), endpoint(2, role="decode"), endpoint(3, role="decode")
    for x in (p, d1, d2):
        scrape(x, 100.0, running=0, waiting=0)
    assert total_headroom([p, d1, d2], True, TH, 100.0) == 2
    scrape(p, 100.0, running=0, waiting=0, kv=0.9)
    assert total_headroom([p, d1, d2], True, TH, 100.0) == 0
    scrape(d1, 100.0, running=0, waiting=0, kv=0.9)
    assert unsaturated([d1, d2], TH, 100.0) == [d2]
    scrape(d2, 100.0, running=0, waiting=0, kv=0.9)
    assert unsaturated([d1, d2], TH, 100.0) == [d1, d2]   # none has room: a granted request goes anyway


def _cfg(**blocks):
    return config_from_dict({"models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"]}], **blocks})


def test_config_defaults_model_override_and_validation():
    cfg = _cfg()
    assert not cfg.admission.enabled and cfg.admission.max_kv_usage == 0.8
    cfg = config_from_dict({"admission": {"enabled": True, "queue_max": 10},
                            "models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"],
                                        "admission": {"queue_timeout_s": 2}}],
                            "limits": {"users": {"gold": {"priority": "critical"}}}})
    a = cfg.admission_for("m")
    assert a.enabled and a.queue_max == 10 and a.queue_timeout_s == 2
    assert cfg.limits.users["gold"].priority == "critical"
    with pytest.raises(ConfigError, match=r"admission.max_kv_usage"):
        _cfg(admission={"max_kv_usage": 1.5})
    with pytest.raises(ConfigError, match=r"limits.users.gold.priority"):
        _cfg(limits={"users": {"gold": {"priority": "urgent"}}})
    with pytest.raises(ConfigError, match=r"admission.enabled: needs scrape.enabled"):
        _cfg(admission={"enabled": True}, scrape={"enabled": False})
    assert _cfg(admission={"enabled": True, "max_in_flight_per_endpoint": 4}, scrape={"enabled": False})
