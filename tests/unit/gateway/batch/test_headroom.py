"""The batch's headroom rule: free running slots only, none while the engine queues, its KV is full,
its metrics are stale, or it is not ready."""

from __future__ import annotations

from gateway.batch.headroom import endpoint_room, model_room, serves
from gateway.endpoints import Endpoint, EngineMetrics


def ep(in_flight: int = 0, running: float | None = None, waiting: float | None = None, kv: float | None = None,
       scraped_at: float = 100.0, max_running: float | None = None) -> Endpoint:
    e = Endpoint(url="http://127.0.0.1:8001", model="m", engine="vllm")
    e.in_flight = in_flight
    if running is not None:
        e.metrics = EngineMetrics(scraped_at=scraped_at, running=running, waiting=waiting, kv_usage=kv,
                                  max_running=max_running)
    return e


def room(e: Endpoint, signals: bool = True, now: float = 100.5) -> int:
    return endpoint_room(e, capacity=8, reserve=1, max_kv=0.7, max_age=5.0, engine_signals=signals, now=now)


def test_free_slots_less_the_reserve():
    assert room(ep(running=0, waiting=0)) == 7
    assert room(ep(in_flight=3, running=3, waiting=0)) == 4
    assert room(ep(in_flight=2), signals=False) == 5


def test_no_room_when_interactive_traffic_waits_or_the_engine_is_full_or_silent():
    assert room(ep(running=8, waiting=2)) == 0                  # the engine queues
    assert room(ep(running=1, waiting=0, kv=0.75)) == 0          # KV nearly full
    assert room(ep(running=0, waiting=0, scraped_at=10.0)) == 0  # stale metrics
    assert room(ep()) == 0                                       # never scraped
    e = ep(running=0, waiting=0)
    e.healthy = False
    assert room(e) == 0


def test_the_engine_told_cap_and_other_gateways_load_count():
    assert room(ep(running=0, waiting=0, max_running=4)) == 3    # SGLang tells its cap
    e = ep(running=0, waiting=0)
    e.remote_in_flight = 5                                       # siblings and replicas
    assert room(e) == 2
    assert model_room([ep(running=0, waiting=0), ep(running=6, waiting=0)], 8, 1, 0.7, 5.0, True, 100.5) == 8


def pd(role: str, roleset: str | None = "rs", running: float = 0, ready: bool = True) -> Endpoint:
    e = ep(running=running, waiting=0)
    e.role, e.roleset, e.healthy = role, roleset, ready
    return e


def test_a_model_routed_as_pairs_counts_the_lesser_side_of_each_roleset():
    args = (8, 1, 0.7, 5.0, True, 100.5)
    p, d = pd("prefill", running=5), pd("decode")                  # 2 and 7 free slots
    assert model_room([p, d], *args) == 9                          # routed whole: every endpoint's
    assert model_room([p, d], *args, pairs=True) == 2              # a line takes a slot on both
    other = pd("decode", roleset="rs-2")                           # no prefill in its roleset
    assert model_room([p, d, other], *args, pairs=True) == 2
    assert model_room([p, other], *args, pairs=True) == 0          # no pair: a ready prefill gives nothing
    assert model_room([p, other, pd("combined", roleset=None)], *args, pairs=True) == 7


def test_a_model_routed_as_pairs_serves_a_line_with_a_pair_of_one_roleset_or_a_whole_endpoint():
    assert not serves([], False) and serves([pd("prefill")], False)     # routed whole: any ready endpoint
    assert not serves([], True)
    assert not serves([pd("prefill"), pd("prefill")], True)
    assert not serves([pd("prefill"), pd("decode", roleset="rs-2")], True)
    assert not serves([pd("prefill"), pd("decode", ready=False)], True)
    assert serves([pd("prefill"), pd("decode")], True)
    assert serves([pd("prefill", roleset=None), pd("decode", roleset=None)], True)
    assert serves([pd("decode"), pd("aggregated", roleset=None)], True)
