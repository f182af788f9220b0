"""The status board: observers that stay bounded whatever clients send, and a document built from
the gateway's own state (no network here: the board and the pool are driven directly)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jsonschema
import pytest

from gateway.config.schema import ConfigError, config_from_dict
from gateway.endpoints import EngineMetrics
from gateway.observability.logs import RequestLog
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.status import MAX_NAME, MAX_TEXT, OTHER_MODEL, StatusBoard, StatusSources
from gateway.pipeline.context import RequestRecord, record_request
from gateway.pipeline.routing import Routing
from gateway.request import CHAT, InferenceRequest
from gateway.server.app import pool_from_config
from gateway.server.lifecycle import Lifecycle
from routers.base import Decision
from tests.support.factories import Clock, inference_request

SCHEMA = json.loads((Path(__file__).resolve().parents[4] / "docs" / "status.schema.json").read_text())


def config(**blocks):
    return config_from_dict({
        "models": [{"name": "llama", "endpoints": ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]},
                   {"name": "pd", "engine": "sglang", "rolesets": [
                       {"name": "rs-a", "prefill": ["http://127.0.0.1:8101"], "decode": ["http://127.0.0.1:8102"]}]}],
        **blocks})


def board_for(cfg, clock=None, wall=None):
    pool = pool_from_config(cfg)
    clock = clock or Clock()
    board = StatusBoard(cfg.status, lambda m: pool.has_model(m), clock=clock, wall=wall or Clock(1.7e9))
    return board, pool


def rec(rid: str, model: str = "llama", status: int = 200, **kw) -> RequestRecord:
    return RequestRecord(request_id=rid, path=CHAT, started=0.0, model=model, status=status, **kw)


def ireq(rid: str, model: str = "llama", user: str | None = None) -> InferenceRequest:
    return inference_request("hi", tokens=1, model=model, request_id=rid, user=user)


def test_client_chosen_model_names_share_one_window():
    board, _ = board_for(config())
    for i in range(1000):
        board.on_request(rec(f"r{i}", model=f"made-up-{i}", status=404, error_class="model_not_found"), 0.001)
    board.on_request(rec("ok", status=200, ttft=0.01), 0.02)
    assert set(board.windows) == {OTHER_MODEL, "llama"}
    totals = board.traffic(1000.0)[1]
    assert totals["minute"]["requests"] == 1001 and totals["minute"]["errors"] == 1000
    assert totals["requests_since_start"] == 1001


def test_rings_are_bounded_newest_first_and_cut_long_text():
    cfg = config(status={"recent_errors": 3, "recent_decisions": 2})
    board, pool = board_for(cfg)
    for i in range(10):
        board.on_request(rec(f"e{i}", status=502, error_class="upstream_refused", error="x" * 5000,
                             endpoint="127.0.0.1:8001"), 0.5)
    errors = board.recent_errors()
    assert [e["request_id"] for e in errors] == ["e9", "e8", "e7"]
    assert len(errors[0]["error"]) == MAX_TEXT + 1 and errors[0]["duration_ms"] == 500.0
    # what the ring keeps is already cut: a client's huge model name is not pinned in memory
    board.on_request(rec("big", model="m" * 1_000_000, status=404, error_class="model_not_found",
                         user="u" * 100_000), 0.001)
    kept = board.errors[-1]
    assert len(kept[2]) == MAX_NAME + 1 and len(kept[9]) == MAX_NAME + 1
    ep = pool.endpoints("llama")[0]
    for i in range(5):
        board.on_decision(ireq(f"d{i}"), Decision(endpoint=ep, strategy="random"), (), 2e-6)
    assert [d["request_id"] for d in board.recent_decisions()] == ["d4", "d3"]
    assert board.recent_decisions()[0]["decision_us"] == 2.0


def test_a_success_is_not_an_error_and_a_cancel_is():
    board, _ = board_for(config())
    board.on_request(rec("a", status=200, ttft=0.005, prompt_tokens=3, completion_tokens=4), 0.05)
    board.on_request(rec("b", status=499, error_class="client_cancel"), 0.05)
    m = board.traffic(1000.0)[0]["llama"]["minute"]
    assert (m["requests"], m["errors"], m["ttft_count"]) == (2, 1, 1)
    assert m["e2e_p50_ms"] == pytest.approx(50, rel=0.05)      # only the success has an e2e latency
    assert [e["request_id"] for e in board.recent_errors()] == ["b"]


def test_rings_can_be_off():
    board, pool = board_for(config(status={"recent_errors": 0, "recent_decisions": 0}))
    board.on_request(rec("x", status=500, error_class="internal"), 0.1)
    board.on_decision(ireq("y"), Decision(endpoint=pool.endpoints("llama")[0], strategy="random"),
                      (("least-kv-cache", "metrics_missing"),), 1e-6)
    assert board.recent_errors() == [] and board.recent_decisions() == []
    assert board.fallbacks == {("least-kv-cache", "metrics_missing"): 1}


async def test_the_document_reads_the_pool_as_it_is():
    cfg = config()
    clock = Clock(1000.0)
    board, pool = board_for(cfg, clock)
    routing = Routing(cfg, pool, GatewayMetrics())
    life = Lifecycle()
    src = StatusSources(cfg, pool, routing, life, {"llama": 2}, aliases=lambda: [{"name": "fast", "targets": []}])
    a, b = pool.endpoints("llama")
    a.in_flight, a.remote_in_flight = 2, 3
    a.metrics = EngineMetrics(scraped_at=999.5, running=4, waiting=1, kv_usage=0.42)
    b.metrics = EngineMetrics(scraped_at=900.0, running=0)
    b.healthy = False
    prefill, decode = pool.endpoints("pd")
    prefill.prefill_in_flight, prefill.token_active, prefill.token_kv = 1, 120.0, 120.0
    decode.pending_decode = 1
    doc = await board.document(src)
    jsonschema.validate(doc, SCHEMA)
    ea = next(e for e in doc["endpoints"] if e["name"] == "127.0.0.1:8001")
    assert (ea["in_flight"], ea["remote_in_flight"], ea["breaker"]) == (2, 3, None)
    assert ea["engine_metrics"] == {"running": 4, "waiting": 1, "kv_usage": 0.42, "prefix_hit_rate": None,
                                    "gen_throughput": None, "age_s": 0.5, "stale": False}
    eb = next(e for e in doc["endpoints"] if e["name"] == "127.0.0.1:8002")
    assert eb["ready"] is False and eb["engine_metrics"]["stale"] is True      # 100 s > metrics_max_age_s
    ep = next(e for e in doc["endpoints"] if e["name"] == "127.0.0.1:8101")
    assert ep["pd"] == {"prefill_in_flight": 1, "pending_decode": 0, "token_active": 120.0, "token_kv": 120.0}
    assert doc["rolesets"] == [{"model": "pd", "name": "rs-a", "prefill": ["127.0.0.1:8101"],
                                "decode": ["127.0.0.1:8102"], "combined": [], "ready": True}]
    llama = next(m for m in doc["models"] if m["name"] == "llama")
    assert (llama["endpoints"], llama["ready_endpoints"], llama["in_flight"]) == (2, 1, 2)
    assert next(m for m in doc["models"] if m["name"] == "pd")["strategy"] == "pd"
    assert doc["totals"]["endpoints"] == 4 and doc["totals"]["ready_endpoints"] == 3
    assert doc["aliases"] == [{"name": "fast", "targets": []}]
    assert doc["tenants"]["enabled"] is False
    # a roleset whose decode is down is not ready
    decode.healthy = False
    doc = await board.document(src)
    assert doc["rolesets"][0]["ready"] is False


async def test_the_totals_rates_divide_by_the_time_their_requests_cover_as_each_models_do():
    cfg = config()
    clock = Clock(1000.0)
    board, pool = board_for(cfg, clock)
    src = StatusSources(cfg, pool, Routing(cfg, pool, GatewayMetrics()), Lifecycle(), {})
    for _ in range(400):        # a request a second, long past the window
        clock.t += 1.0
        board.on_request(rec("r", prompt_tokens=10, completion_tokens=5), 0.1)
    clock.t += 3.0              # into a bucket: the minute's buckets hold a little over 50 s of requests
    doc = await board.document(src)
    (llama,) = [m for m in doc["models"] if m["name"] == "llama"]
    for span in ("minute", "window"):
        total, model = doc["totals"][span], llama[span]
        assert total["requests"] == model["requests"]
        assert (total["rps"], total["tokens_per_s"]) == (model["rps"], model["tokens_per_s"]), span
    assert doc["totals"]["minute"]["rps"] == pytest.approx(1.0, rel=0.05)


def test_routing_tells_its_observers_each_decisions_own_fallbacks():
    cfg = config()
    pool = pool_from_config(cfg)
    routing = Routing(cfg, pool, GatewayMetrics())
    seen = []
    routing.observers.append(lambda req, d, fb, secs: seen.append((req.request_id, d.strategy, fb)))
    router = routing.router_for("vtc-basic")
    cands = routing.candidates("llama", router)
    routing.route(ireq("no-user"), "vtc-basic", router, cands)
    routing.route(ireq("with-user", user="alice"), "vtc-basic", router, cands)
    assert seen == [("no-user", "vtc-basic", (("vtc-basic", "no_user"),)), ("with-user", "vtc-basic", ())]


def test_an_observer_that_fails_costs_the_request_nothing():
    def broken(_rec, _duration):
        raise RuntimeError("bug")

    seen = []
    request_log = RequestLog(level="warning")
    with request_log.capture() as lines:
        record_request(rec("r"), GatewayMetrics(), 1.0, request_log,
                       [broken, lambda r, d: seen.append((r.request_id, d))])
    assert seen == [("r", 1.0)]
    assert [line["request_id"] for line in lines] == ["r"]


def test_config_block_defaults_and_validation():
    s = config().status
    assert (s.enabled, s.refresh_s, s.bucket_s, s.window_s, s.slots) == (True, 2.0, 10.0, 300.0, 30)
    assert (s.recent_decisions, s.recent_errors, s.max_users) == (50, 50, 100)
    with pytest.raises(ConfigError, match=r"status\.window_s: at most 360 buckets"):
        config(status={"window_s": 3600, "bucket_s": 1})
    with pytest.raises(ConfigError, match=r"status\.refresh_s"):
        config(status={"refresh_s": 0.1})
    with pytest.raises(ConfigError, match=r"status\.recent: unknown key"):
        config(status={"recent": 5})


async def test_several_workers_add_up_into_one_document():
    """``--workers N``: the answering worker adds its siblings' parts (as read over their sockets:
    through JSON) to its own document."""
    cfg = config()
    clock = Clock(1000.0)
    wall = Clock(1.7e9)
    boards = [board_for(cfg, clock, wall) for _ in range(2)]
    srcs = []
    for i, (board, pool) in enumerate(boards):
        src = StatusSources(cfg, pool, Routing(cfg, pool, GatewayMetrics()), Lifecycle(), {"llama": i + 1})
        pool.endpoints("llama")[0].in_flight = i + 1
        srcs.append(src)
        for n in range(3 + i):
            board.on_request(rec(f"w{i}-{n}", ttft=0.01 * (i + 1)), 0.1 * (i + 1))
            wall.t += 1
        board.on_request(rec(f"w{i}-err", status=502, error_class="upstream"), 0.01)
        board.on_decision(ireq(f"w{i}-d"), Decision(pool.endpoints("llama")[0], strategy="random"),
                          (("vtc-basic", "no_user"),), 1e-5)
    (board, _), (sibling, _) = boards
    part = json.loads(json.dumps(sibling.part(srcs[1], 1)))
    doc = await board.document(srcs[0], [part], (0, 2), {"exited": 1, "stalled": 0})
    jsonschema.validate(doc, SCHEMA)
    workers = doc["gateway"]["workers"]
    assert [(w["worker"], w["generation"]) for w in workers.pop("config")] == [(0, 1), (1, 1)]  # each reporting worker's
    assert workers == {"count": 2, "answered": 0, "reporting": 2, "restarts": {"exited": 1, "stalled": 0}}
    assert doc["totals"]["requests_since_start"] == 9 and doc["totals"]["minute"]["requests"] == 9
    assert doc["totals"]["minute"]["errors"] == 2 and doc["totals"]["minute"]["ttft_count"] == 7
    assert doc["totals"]["minute"]["ttft_p99_ms"] == pytest.approx(20, rel=0.05)   # the sibling's slower TTFTs
    assert sum(doc["totals"]["series"]) == 9
    llama = next(m for m in doc["models"] if m["name"] == "llama")
    assert llama["in_flight"] == 3 and llama["window"]["requests"] == 9
    ep = next(e for e in doc["endpoints"] if e["name"] == "127.0.0.1:8001")
    assert ep["in_flight"] == 3
    assert doc["routing"]["fallbacks"] == [{"strategy": "vtc-basic", "reason": "no_user", "count": 2}]
    assert [e["request_id"] for e in doc["errors"]["recent"]] == ["w1-err", "w0-err"]     # newest first
    assert len(doc["routing"]["recent"]) == 2
    alone = await board.document(srcs[0])
    assert alone["gateway"]["workers"] == {"count": 1, "answered": 0, "reporting": 1,
                                           "restarts": {"exited": 0, "stalled": 0},
                                           "config": [{"worker": 0, "pid": os.getpid(), **alone["gateway"]["config"]}]}
    assert alone["totals"]["requests_since_start"] == 4

    # the sibling gone (killed, not started again yet): its counts since start as it last kept them
    kept = json.loads(json.dumps(sibling.counts()))
    doc = await board.document(srcs[0], [], (0, 2), None, [kept])
    assert doc["gateway"]["workers"]["reporting"] == 1
    assert doc["totals"]["requests_since_start"] == 9
    assert doc["routing"]["fallbacks"] == [{"strategy": "vtc-basic", "reason": "no_user", "count": 2}]
    # and its replacement goes on from them
    successor, _ = board_for(cfg, clock, wall)
    successor.carry(kept)
    successor.carry({"requests": "x", "fallbacks": [["a"], 3]})     # what it cannot read, it leaves
    assert json.loads(json.dumps(successor.counts())) == kept


async def test_admission_rows_per_model_and_endpoint():
    from gateway.admission.queue import Waiter
    from gateway.admission.service import Admission

    cfg = config(admission={"enabled": True, "max_waiting_per_endpoint": 2})
    clock = Clock(1000.0)
    board, pool = board_for(cfg, clock)
    admission = Admission(cfg, pool, GatewayMetrics(), clock=clock)
    src = StatusSources(cfg, pool, Routing(cfg, pool, GatewayMetrics()), Lifecycle(), {},
                        admission=admission.status)
    a, b = pool.endpoints("llama")
    a.metrics = EngineMetrics(scraped_at=999.5, running=2, waiting=1, kv_usage=0.1)
    b.metrics = EngineMetrics(scraped_at=999.5, running=0, waiting=0, kv_usage=0.0, max_running=8)
    admission.settings("llama")
    admission._models["llama"].queue.push(Waiter(2, "gold", 10, 1000.0))
    admission.slo_counts["llama"] = {"ttft": {"met": 3, "missed": 1, "shed": 2}}
    doc = await board.document(src)
    jsonschema.validate(doc, SCHEMA)
    view = next(m for m in doc["models"] if m["name"] == "llama")["admission"]
    assert view["enabled"] and view["queue"] == {"critical": 1, "standard": 0, "sheddable": 0}
    assert view["slo"]["ttft"] == {"met": 3, "missed": 1, "shed": 2}
    rows = {e["name"]: e for e in view["endpoints"]}
    assert (rows["127.0.0.1:8001"]["capacity"], rows["127.0.0.1:8001"]["capacity_source"]) == (2, "queued")
    assert (rows["127.0.0.1:8002"]["capacity"], rows["127.0.0.1:8002"]["capacity_source"]) == (8, "told")
    assert rows["127.0.0.1:8002"]["headroom"] == 10 and not rows["127.0.0.1:8002"]["saturated"]
