"""The gateway's own registry: engine state re-exported per endpoint, the process, the loop lag."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from gateway.endpoints import EngineMetrics
from gateway.observability.looplag import LoopLagMonitor
from gateway.observability.metrics import Counter, GatewayMetrics, observe_all
from tests.support.factories import endpoint
from tests.support.metrics import sample_map


def test_engine_state_is_exported_from_fresh_snapshots_only():
    now = time.monotonic()
    fresh, stale, never = endpoint(8001, engine="sglang"), endpoint(8002, role="prefill", roleset="rs-1"), endpoint(8003)
    fresh.metrics = EngineMetrics(scraped_at=now, running=3, waiting=1, kv_usage=0.25, prefix_hit_rate=None,
                                  gen_throughput=120.0)
    stale.metrics = EngineMetrics(scraped_at=now - 60, running=7, waiting=7, kv_usage=0.9)
    m = GatewayMetrics()
    m.attach_live_state(lambda: [fresh, stale, never], {}, engine_max_age=10.0)
    got = sample_map(m.render())

    def value(name, endpoint):
        return got.get((name, (("endpoint", endpoint), ("model", "m"))))

    assert value("switchyard_engine_running_requests", "127.0.0.1:8001") == 3
    assert value("switchyard_engine_waiting_requests", "127.0.0.1:8001") == 1
    assert value("switchyard_engine_kv_cache_usage_ratio", "127.0.0.1:8001") == 0.25
    assert value("switchyard_engine_generation_tokens_per_second", "127.0.0.1:8001") == 120.0
    # a signal the engine did not report is left out, not exported as 0
    assert value("switchyard_engine_prefix_cache_hit_ratio", "127.0.0.1:8001") is None
    # a snapshot routers would treat as missing is not shown as current; its age is
    assert value("switchyard_engine_running_requests", "127.0.0.1:8002") is None
    assert value("switchyard_engine_metrics_age_seconds", "127.0.0.1:8002") >= 60
    assert value("switchyard_engine_metrics_age_seconds", "127.0.0.1:8003") is None     # never scraped
    info = {dict(k[1])["endpoint"]: dict(k[1]) for k in got if k[0] == "switchyard_endpoint_info"}
    assert info["127.0.0.1:8001"]["engine"] == "sglang" and info["127.0.0.1:8001"]["role"] == "aggregated"
    assert info["127.0.0.1:8002"]["role"] == "prefill" and info["127.0.0.1:8002"]["roleset"] == "rs-1"
    assert info["127.0.0.1:8003"]["roleset"] == ""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the process collector reads /proc")
def test_process_metrics_are_in_the_gateway_registry():
    names = {k[0] for k in sample_map(GatewayMetrics().render())}
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds",
            "process_max_fds", "process_start_time_seconds"} <= names
    # registered before the first sample: the dashboards' job variable reads it
    assert "switchyard_event_loop_lag_seconds_count" in names


async def test_loop_lag_sees_a_blocked_loop_and_stops():
    seen: list[float] = []
    mon = LoopLagMonitor(seen.append, interval=0.01)
    mon.start()
    await asyncio.sleep(0)            # the task has armed its first timer
    time.sleep(0.1)                   # a callback hogging the loop: the timer cannot fire meanwhile
    while not seen:
        await asyncio.sleep(0.005)
    assert seen[0] >= 0.1 - 0.01 - 0.002   # at least the block minus the interval (ms timer steps)
    assert all(v >= 0 for v in seen)
    await mon.stop()
    n = len(seen)
    await asyncio.sleep(0.03)
    assert len(seen) == n and mon._task is None


async def test_loop_lag_interval_zero_is_off():
    mon = LoopLagMonitor(lambda v: None, interval=0)
    mon.start()
    assert mon._task is None
    await mon.stop()


def test_observe_all_renders_as_one_observe_per_value():
    gaps = [0.0, 0.0005, 0.0004999, 0.001, 0.0123, 0.05, 9.99, 10.0, 10.5, 1e9, -0.25] * 3
    one, batch = GatewayMetrics(), GatewayMetrics()
    for g in gaps:
        one.itl.labels("m").observe(g)
    observe_all(batch.itl.labels("m"), gaps)
    def itl(m: GatewayMetrics) -> dict:      # not ``_created``: when each child was made, not what it holds
        return {k: v for k, v in sample_map(m.render()).items()
                if k[0].startswith("switchyard_inter_token") and not k[0].endswith("_created")}
    a, b = itl(one), itl(batch)
    assert a.keys() == b.keys() and a
    for k, v in a.items():
        assert b[k] == pytest.approx(v, rel=1e-12), k


def test_fleet_load_is_exported_per_endpoint():
    """What prefix-cache's load guards count: this gateway's in-flight plus the engine's running +
    waiting beyond this gateway's in-flight at the last fresh scrape."""
    from routers.prefix_cache import fleet_load
    now = time.monotonic()
    busy, alone = endpoint(8001), endpoint(8002)
    busy.in_flight, alone.in_flight = 2, 1
    busy.metrics = EngineMetrics(scraped_at=now, running=9, waiting=3, gateway_in_flight=2)   # 10 from others
    m = GatewayMetrics()
    m.attach_live_state(lambda: [busy, alone], {}, fleet_load=lambda e: fleet_load(e, time.monotonic(), 10.0))
    got = sample_map(m.render())
    assert got[("switchyard_endpoint_fleet_in_flight", (("endpoint", "127.0.0.1:8001"), ("model", "m")))] == 12
    assert got[("switchyard_endpoint_fleet_in_flight", (("endpoint", "127.0.0.1:8002"), ("model", "m")))] == 1


def test_an_endpoint_that_left_keeps_its_series_until_its_time_is_up_and_a_namesake_keeps_them():
    from gateway.endpoints import EndpointPool
    from gateway.observability.metrics import RetiredSeries
    from gateway.resilience.breaker import BreakerConfig, Breakers, Outcome

    pool, m = EndpointPool(), GatewayMetrics()
    breakers = Breakers(pool, lambda _m: BreakerConfig(),
                        m.registry, call_later=lambda _d, _f: None)
    m.add_per_endpoint((breakers.metrics.transitions, breakers.metrics.outcomes), breakers.children)
    a, b = pool.add(endpoint(1, name="a")), pool.add(endpoint(2, name="b"))
    for ep in (a, b):
        m.child(m.upstream_errors, "m", ep.name, "timeout").inc()
        breakers.record(ep, Outcome.SUCCESS)
    sweeper = RetiredSeries(pool, m, keep_s=60.0)

    def endpoints_exported() -> set[str]:
        return {dict(labels).get("endpoint") for (name, labels) in sample_map(m.render())
                if name in ("switchyard_upstream_errors_total", "switchyard_upstream_outcomes_total")}

    pool.remove(a)
    at = pool.retired[0][1]
    a.in_flight = 1
    assert sweeper.sweep(at + 61) == 0 and endpoints_exported() == {"a", "b"}      # its request runs
    a.in_flight = 0
    assert sweeper.sweep(at + 59) == 0 and endpoints_exported() == {"a", "b"}      # within the grace
    assert sweeper.sweep(at + 61) == 1 and endpoints_exported() == {"b"} and pool.retired == []
    # a counter cached before counts into the exported series again, not into a dropped one
    m.child(m.upstream_errors, "m", "a", "timeout").inc()
    assert m.child(m.upstream_errors, "m", "a", "timeout").value == 1
    # a pod changed in place: a new endpoint of the same name; the old one's breaker went, the series stay
    b2 = endpoint(3, name="b")
    pool.remove(b)
    pool.add(b2)
    breakers.record(b2, Outcome.SUCCESS)
    assert sweeper.sweep(pool.retired[0][1] + 61) == 1
    assert "b" in endpoints_exported() and id(b) not in breakers._by_ep and id(b2) in breakers._by_ep


def test_a_sweep_that_lets_many_endpoints_go_walks_the_series_once_not_once_per_endpoint():
    """A namespace of hundreds of pods emptied: their endpoints' series go in one sweep, which walks
    each per-endpoint family's series and each cache of their children once, not once per endpoint
    let go (O(endpoints x series): measured, 2000 pods held the loop 2.6 s in one sweep)."""
    from gateway.endpoints import EndpointPool
    from gateway.observability.metrics import RetiredSeries

    class Walked(dict):
        walks = 0

        def __iter__(self):
            Walked.walks += 1
            return super().__iter__()

    pool, m = EndpointPool(), GatewayMetrics()
    outcomes = Counter("t_outcomes", "per endpoint", ["model", "endpoint", "outcome"], registry=m.registry)
    cache: Walked = Walked()
    m.add_per_endpoint([outcomes], cache)
    outcomes._children = Walked(outcomes._children)
    eps = [pool.add(endpoint(i + 1, name=f"p{i}")) for i in range(200)]
    for ep in eps:
        cache[(outcomes, ("m", ep.name, "success"))] = outcomes.labels("m", ep.name, "success")
        m.child(m.upstream_errors, "m", ep.name, "timeout").inc()
    for ep in eps[:150]:
        pool.remove(ep)
    Walked.walks = 0
    assert RetiredSeries(pool, m, keep_s=1.0).sweep(time.monotonic() + 2) == 150
    assert Walked.walks <= 2, f"{Walked.walks} walks of the series for 150 endpoints let go"
    left = {dict(labels)["endpoint"] for (name, labels) in sample_map(m.render())
            if name in ("switchyard_upstream_errors_total", "t_outcomes_total")}
    assert left == {f"p{i}" for i in range(150, 200)} and len(cache) == 50


def test_forgetting_an_endpoint_drops_its_series_and_the_cached_children_that_wrote_them():
    m = GatewayMetrics()
    gone = m.child(m.upstream_errors, "m", "a:1", "connect")
    kept = m.child(m.upstream_errors, "m", "b:1", "connect")
    requests = m.child(m.requests, "m", "200", "random")
    gone.inc()
    kept.inc()
    outcomes = Counter("t_outcomes", "per endpoint", ["model", "endpoint", "outcome"], registry=m.registry)
    cache: dict = {}
    m.add_per_endpoint([outcomes], cache)
    cache[(outcomes, ("m", "a:1", "success"))] = outcomes.labels("m", "a:1", "success")
    assert m.forget_endpoint("m", "a:1") == 2
    assert cache == {}
    assert m.child(m.upstream_errors, "m", "a:1", "connect") is not gone        # a new series, from 0
    assert m.child(m.upstream_errors, "m", "b:1", "connect") is kept
    assert m.child(m.requests, "m", "200", "random") is requests


def test_a_sweep_that_lets_many_endpoints_go_drops_what_a_restarted_worker_carries_of_them_at_once(
        tmp_path, monkeypatch):
    """A restarted worker carries its predecessor's counts of every endpoint; a sweep that lets
    hundreds of them go drops theirs from what it carries in one pass over the carried samples, not
    one pass (and one rendering of what is left) per endpoint."""
    import gateway.server.siblings as siblings_module
    from gateway.endpoints import EndpointPool
    from gateway.observability.merge import endpoints_of, parse
    from gateway.observability.metrics import RetiredSeries
    from gateway.server.siblings import Siblings
    from gateway.server.workers import WorkerInfo

    async def answer(_kind: str) -> bytes:
        return b""

    pool, m = EndpointPool(), GatewayMetrics()
    eps = [pool.add(endpoint(i + 1, name=f"p{i}")) for i in range(200)]
    carried = "".join(f'switchyard_upstream_errors_total{{model="m",endpoint="p{i}",kind="timeout"}} 3\n'
                      for i in range(200))
    sib = Siblings(WorkerInfo(index=0, count=2, run_dir=str(tmp_path)), answer)
    sib._set_carried(parse("# TYPE switchyard_upstream_errors_total counter\n" + carried))
    m.forget_listeners.append(sib.forget)
    walks = 0

    def counted(families):
        nonlocal walks
        walks += 1
        return endpoints_of(families)

    monkeypatch.setattr(siblings_module, "endpoints_of", counted)
    for ep in eps[:150]:
        pool.remove(ep)
    assert RetiredSeries(pool, m, keep_s=1.0).sweep(time.monotonic() + 2) == 150
    assert walks <= 2, f"{walks} walks of the carried samples for 150 endpoints let go"
    assert endpoints_of(sib._carried) == {("m", f"p{i}") for i in range(150, 200)}
