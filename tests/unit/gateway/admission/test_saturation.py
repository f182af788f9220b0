"""Saturation: the engine's queue estimated between scrapes, KV usage, the in-flight cap, and
stale metrics counting as saturated."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.admission.saturation import (
    UNBOUNDED,
    Thresholds,
    baseline,
    estimate,
    total_headroom,
    unsaturated,
)
from gateway.admission.service import Admission
from gateway.config.schema import ConfigError, config_from_dict
from gateway.endpoints import EngineMetrics
from gateway.observability.metrics import GatewayMetrics
from gateway.server.app import pool_from_config
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


def test_a_request_still_on_its_way_when_the_engine_counted_is_not_lost():
    """The gateway sent its third request; the engine answered the scrape before it arrived, so it
    counted two running and nobody waiting while the gateway had three on it. The engine holds at
    least the gateway's three: with a window of two it has one waiting, the whole share."""
    e = endpoint()
    scrape(e, 100.0, running=2, waiting=0)               # the window rises to two
    e.in_flight = 3
    scrape(e, 100.5, running=2, waiting=0)               # the third was in transit
    b = baseline(e)
    assert b.occupancy(3) == 3 and b.occupancy(4) == 4
    est = estimate(e, Thresholds(max_waiting=1, max_age=5.0), 100.5)
    assert est.waiting == 1 and est.saturated
    assert estimate(e, TH, 100.5).headroom == 1          # a share of two leaves room for one more
    e.in_flight = 1                                      # two finished since: the estimate holds
    assert baseline(e).occupancy(1) == 1


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
    assert total_headroom([p, d1, d2], True, TH, 100.0) == 3     # one slot (slow start) and two waiting
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


def test_several_workers_share_the_room_a_threshold_leaves():
    """``--workers 2``: each worker sees only its own requests, so each takes half the room the
    engine's queue leaves and half the in-flight cap; added up, the room of one gateway."""
    two = Thresholds(max_waiting=6, max_kv=0.8, max_in_flight=0, max_age=5.0, workers=2)
    e = endpoint()
    e.in_flight = 4
    scrape(e, 100.0, running=4, waiting=2)              # capacity 4, 2 queued: room for 4 more in all
    assert estimate(e, TH, 100.0).headroom == 0 and estimate(e, two, 100.0).headroom == 2
    e.in_flight = 5                                     # this worker sent one since the scrape
    assert estimate(e, two, 100.5).headroom == 1
    e.in_flight = 3                                     # two of its requests finished: two slots freed
    assert estimate(e, two, 100.5).headroom == 3
    # the cap of 5 dealt over two workers: 3 and 2, never more than the cap in all
    e.in_flight = 2
    rooms = [estimate(e, Thresholds(max_in_flight=5, engine_signals=False, workers=2, index=i), 100.0).headroom
             for i in range(2)]
    assert sorted(rooms) == [0, 1]


def test_a_room_smaller_than_the_workers_is_dealt_whole_not_cut_to_nothing():
    """``max_waiting_per_endpoint: 1`` over two workers: half a slot each rounded down to none left
    the engine's queue empty and its running slots idle between scrapes. Dealt whole, one worker
    may keep one request waiting; together they never pass the bound."""
    e = endpoint()
    e.in_flight = 4
    one = [Thresholds(max_waiting=1, max_kv=0.8, max_in_flight=0, max_age=5.0, workers=2, index=i) for i in range(2)]
    scrape(e, 100.0, running=4, waiting=0)              # capacity 4 (told), none waiting: room 1 in all
    e.metrics = EngineMetrics(scraped_at=100.0, running=4, waiting=0, kv_usage=0.1, max_running=4)
    for th in one:
        estimate(e, th, 100.0)
    assert sorted(estimate(e, th, 100.0).headroom for th in one) == [0, 1]
    # an in-flight cap of 1 over two workers: one of them may use the endpoint, not neither
    e2 = endpoint()
    caps = [Thresholds(max_in_flight=1, engine_signals=False, workers=2, index=i) for i in range(2)]
    assert sorted(estimate(e2, th, 100.0).headroom for th in caps) == [0, 1]


@given(st.integers(-20, 200), st.integers(1, 9), st.integers(1, 65535))
def test_the_workers_shares_add_up_to_the_room(room, workers, port):
    from gateway.admission.saturation import share
    from gateway.endpoints import Endpoint

    ep = Endpoint(url=f"http://10.0.0.1:{port}", model="m")
    shares = [share(room, Thresholds(workers=workers, index=i), ep) for i in range(workers)]
    assert sum(shares) == room and max(shares) - min(shares) <= 1


def test_several_workers_split_the_queue_bounds():
    cfg = config_from_dict({"models": [{"name": "m", "endpoints": ["http://127.0.0.1:9"]}],
                            "admission": {"enabled": True, "queue_max": 5, "queue_max_bytes": 1000}})
    adm = Admission(cfg, pool_from_config(cfg), GatewayMetrics())
    assert (adm.settings("m").queue_max, adm.settings("m").queue_max_bytes) == (5, 1000)
    adm.set_workers(2)
    s = adm.settings("m")
    assert (s.queue_max, s.queue_max_bytes) == (3, 500)       # rounded up
    assert adm._thresholds["m"].workers == 2


def test_before_the_capacity_is_known_the_endpoint_gets_a_bounded_number():
    """Slow start: one slot assumed, raised only to what the engine showed it runs at once."""
    e = endpoint()
    scrape(e, 100.0, running=0, waiting=0)
    assert estimate(e, TH, 100.0).headroom == 3          # one slot and two waiting, however many come
    e.in_flight = 3
    assert estimate(e, TH, 100.0).saturated
    b = baseline(e)
    assert not b.ttft_held(0.5, 3, TH) and b.window == 0   # no reference yet: it may have queued
    assert b.ttft_held(0.03, 1, TH) and b.best_ttft == 0.03  # the first, within the assumed slot: a reference
    assert b.ttft_held(0.04, 2, TH) and b.window == 2        # the second did not queue: two run at once
    assert not b.ttft_held(0.4, 3, TH) and b.window == 2     # the third queued
    assert estimate(e, TH, 100.0).headroom == 1
    scrape(e, 101.0, running=3, waiting=0)                 # three running, nobody waiting
    assert b.window == 3 and b.source == "slow_start" and b.capacity is None
    scrape(e, 102.0, running=3, waiting=1)                 # it queued: its capacity is known
    assert (b.capacity, b.source) == (3, "queued")


def test_an_engine_that_tells_its_running_cap_is_taken_at_its_word():
    e = endpoint()
    e.metrics = EngineMetrics(scraped_at=100.0, running=0, waiting=0, kv_usage=0.0, max_running=8)
    assert estimate(e, TH, 100.0).headroom == 10
    assert (baseline(e).capacity, baseline(e).source) == (8, "told")


@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 3),
       st.lists(st.sampled_from(["send", "finish", "scrape"]), max_size=80))
def test_the_engine_queue_never_passes_the_threshold_before_the_capacity_is_known(slots, max_waiting, initial, events):
    """A FIFO engine of ``slots`` running slots behind a gateway that sends whenever the estimate
    has room: whatever the order of sends, completions and scrapes, its queue stays within
    max_waiting_per_endpoint (the engine starts empty, so nothing was in flight at the first scrape)
    as long as the initial capacity does not exceed the real one."""
    initial = min(initial, slots)
    th = Thresholds(max_waiting=max_waiting, max_kv=0.8, max_age=1e9, initial_capacity=initial)
    e = endpoint()
    running: list[tuple[int, float]] = []     # (request, occupancy when it went)
    waiting: list[tuple[int, float]] = []
    now = 100.0
    e.metrics = EngineMetrics(scraped_at=now, running=0, waiting=0, kv_usage=0.0)
    n = 0
    for ev in events:
        now += 0.01
        b = baseline(e)
        if ev == "send":
            while not estimate(e, th, now).saturated:
                n += 1
                occupied = b.occupancy(e.in_flight + 1)
                e.in_flight += 1
                (running if len(running) < slots else waiting).append((n, occupied))
                if len(running) <= slots and (n, occupied) in running:
                    b.ttft_held(0.03, occupied, th)           # it got a slot at once
                assert len(waiting) <= max_waiting
        elif ev == "finish" and running:
            running.pop(0)
            e.in_flight -= 1
            if waiting:
                _, occupied = waiting.pop(0)
                running.append((0, occupied))
                b.ttft_held(0.5, occupied, th)                # it queued: a long TTFT
        elif ev == "scrape":
            e.metrics = EngineMetrics(scraped_at=now, running=len(running), waiting=len(waiting), kv_usage=0.0)
            estimate(e, th, now)
        assert len(waiting) <= max_waiting
