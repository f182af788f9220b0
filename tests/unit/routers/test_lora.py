"""lora-affinity: the adapter's state on each endpoint, its order, and its trade against load and
the adapter-keyed prefix index."""

from __future__ import annotations

import time

from gateway.endpoints import EngineMetrics
from routers.lora import FREE_SLOT, FULL, RESIDENT, RUNNING, WAITING, LoraAffinityRouter
from tests.unit.routers.strategy_helpers import ctx_for, make_eps, make_req


def lora_metrics(running=(), waiting=(), max_lora=2) -> EngineMetrics:
    return EngineMetrics(scraped_at=time.monotonic(), lora_running=frozenset(running),
                         lora_waiting=frozenset(waiting), max_lora=max_lora)


def adapter_req(text="user\n" + "x" * 2000, adapter="a"):
    req = make_req(text)
    req.lora = adapter
    return req


def test_states_score_running_above_resident_free_waiting_full():
    router = LoraAffinityRouter(ctx_for()[0])
    eps = make_eps(6)
    eps[0].metrics = lora_metrics(running=["a"])
    eps[1].metrics = lora_metrics()
    eps[1].adapters.recent = {"b": 1.0, "a": 2.0}
    eps[2].metrics = lora_metrics(running=["b"])
    eps[3].metrics = lora_metrics(running=["b", "c"], waiting=["a"])
    eps[4].metrics = lora_metrics(running=["b", "c"])
    eps[5].adapters.in_flight = {"a": 1}          # the gateway's own requests count as running
    assert [router.affinity(ep, "a") for ep in eps] == [RUNNING, RESIDENT, FREE_SLOT, WAITING, FULL, RUNNING]


def test_load_outweighs_a_small_affinity_step_but_not_a_full_endpoint():
    router = LoraAffinityRouter(ctx_for()[0])
    eps = make_eps(2, in_flight=[10, 0])
    eps[0].metrics, eps[1].metrics = lora_metrics(running=["a"]), lora_metrics()
    assert router.route(adapter_req(), eps).endpoint is eps[1]         # 1.0 - 0.5 < 0.8
    eps[1].metrics = lora_metrics(running=["b", "c"])
    d = router.route(adapter_req(), eps)
    assert d.endpoint is eps[0] and d.reason == "running"


def test_prefix_affinity_is_keyed_by_adapter():
    ctx = ctx_for()[0]
    router = LoraAffinityRouter(ctx)
    eps = make_eps(2)
    first = router.route(adapter_req(adapter="a"), eps).endpoint
    assert all(router.route(adapter_req(adapter="a"), eps).endpoint is first for _ in range(5))
    match = ctx.prefix_index.match(adapter_req(adapter="b"), eps)
    assert set(match.values()) == {0.0}           # the same text under another adapter is not cached
