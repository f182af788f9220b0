"""Feeding the latency models from finished requests, and counting objectives met."""

from __future__ import annotations

import pytest

from gateway.errors import ErrorClass
from gateway.observability.metrics import GatewayMetrics
from gateway.pipeline import slo_learning
from gateway.pipeline.context import RequestRecord
from gateway.pipeline.slo_learning import SloLearning
from routers.base import Decision
from tests.support.factories import Clock, endpoints, inference_request, router_ctx


def _setup():
    clock = Clock(10.0)
    ctx, _ = router_ctx(1, slo_min_samples=1)
    metrics = GatewayMetrics()
    return SloLearning(metrics, clock), ctx.latency, metrics, clock


def _req(rid: str, stream: bool = True, **slo):
    r = inference_request(tokens=1000, request_id=rid, **slo)
    r.stream = stream
    return r


def _rec(rid: str, ttft: float | None, tokens: int = 11, status: int = 200, strategy: str = "slo") -> RequestRecord:
    return RequestRecord(request_id=rid, path="/v1/chat/completions", started=9.9, model="m", strategy=strategy,
                         status=status, ttft=ttft, completion_tokens=tokens)


def _count(metrics: GatewayMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_streamed_answer_teaches_the_model_its_ttft_from_the_decision_and_its_tpot():
    learning, model, metrics, clock = _setup()
    (ep,) = endpoints(1)
    learning.decided(_req("a"), Decision(ep, "least-request"), model)     # at 10.0; the request came at 9.9
    learning.on_request(_rec("a", ttft=0.35), duration=0.35 + 10 * 0.02)
    f = model.features(1000, ep, 0.0)
    ttft, tpot = model.predict(ep, f)
    assert ttft == pytest.approx(250.0, rel=1e-3)           # 9.9 + 0.35 - 10.0
    assert tpot == pytest.approx(20.0, rel=1e-3)
    assert not learning.pending
    # the next decision is predicted: its error observed
    learning.decided(_req("b"), Decision(ep, "least-request"), model)
    learning.on_request(_rec("b", ttft=0.6), duration=0.8)
    assert _count(metrics, "switchyard_slo_routing_prediction_error_ratio_count", model="m", objective="ttft") == 1
    assert _count(metrics, "switchyard_slo_routing_prediction_error_ratio_sum", model="m",
                  objective="ttft") == pytest.approx(0.5, rel=1e-3)   # observed 500, predicted 250


def test_an_answer_of_several_choices_teaches_one_choices_tpot():
    """Its choices decode side by side: 2 of 11 tokens in the time of 11 tokens of one."""
    learning, model, _, _ = _setup()
    (ep,) = endpoints(1)
    req = _req("n2")
    req.choices = 2
    learning.decided(req, Decision(ep, "least-request"), model)
    learning.on_request(_rec("n2", ttft=0.35, tokens=22), duration=0.35 + 10 * 0.02)
    _, tpot = model.predict(ep, model.features(1000, ep, 0.0))
    assert tpot == pytest.approx(20.0, rel=1e-3)            # not 0.2 s over 21 gaps: 9.5 ms


def test_objectives_are_counted_met_or_missed_by_what_the_client_saw():
    learning, model, metrics, _ = _setup()
    (ep,) = endpoints(1)
    cases = [("met", dict(slo_ttft_ms=400.0, slo_tpot_ms=30.0), _rec("1", 0.3), 0.5),
             ("missed_ttft", dict(slo_ttft_ms=200.0), _rec("2", 0.3), 0.5),
             ("missed_tpot", dict(slo_tpot_ms=10.0), _rec("3", 0.3), 0.5),
             ("missed_both", dict(slo_ttft_ms=200.0, slo_tpot_ms=10.0), _rec("4", 0.3), 0.5),
             ("failed", dict(slo_ttft_ms=200.0), _rec("5", None, status=502), 0.1)]
    for result, slo, rec, duration in cases:
        learning.decided(_req(rec.request_id, **slo), Decision(ep, "slo", reason="slo_feasible"), model)
        learning.on_request(rec, duration)
        assert _count(metrics, "switchyard_slo_routing_requests_total", model="m", strategy="slo", result=result) == 1
    learning.decided(_req("6", stream=False, slo_ttft_ms=100.0), Decision(ep, "slo", reason="slo_explore"), model)
    learning.on_request(_rec("6", None), 0.5)
    assert _count(metrics, "switchyard_slo_routing_requests_total", model="m", strategy="slo", result="unmeasured") == 1
    assert _count(metrics, "switchyard_slo_routing_decisions_total", model="m", reason="slo_feasible") == 5
    assert _count(metrics, "switchyard_slo_routing_decisions_total", model="m", reason="slo_explore") == 1
    assert model.samples(ep) == (4, 4)                      # the failed and the non-streamed taught nothing


@pytest.mark.parametrize("cut", [ErrorClass.CLIENT_CANCEL, ErrorClass.UPSTREAM_BROKEN, ErrorClass.UPSTREAM_STREAM_ERROR,
                                 ErrorClass.WATCHDOG_IDLE])
def test_a_stream_cut_after_its_first_token_teaches_its_ttft_whoever_cut_it(cut):
    """Its client or its engine: the TTFT was real; a TPOT from 8 tokens, to the last one relayed."""
    learning, model, metrics, _ = _setup()
    (ep,) = endpoints(1)
    for rid, events in (("one", 1), ("nine", 9)):
        learning.decided(_req(rid, slo_ttft_ms=5000.0), Decision(ep, "slo", reason="slo_feasible"), model)
        rec = _rec(rid, ttft=0.35, tokens=events)
        rec.error_class, rec.streamed_events, rec.last_token = cut, events, 0.35 + (events - 1) * 0.02
        learning.on_request(rec, duration=5.0)                  # a stall the watchdog ended: not a gap
    assert model.samples(ep) == (2, 1)
    ttft, tpot = model.predict(ep, model.features(1000, ep, 0.0))
    assert ttft == pytest.approx(250.0, rel=1e-3) and tpot == pytest.approx(20.0, rel=1e-3)
    result = "cancelled" if cut == ErrorClass.CLIENT_CANCEL else "failed"
    assert _count(metrics, "switchyard_slo_routing_requests_total", model="m", strategy="slo", result=result) == 2


def test_a_stream_continued_on_other_legs_teaches_its_first_leg_its_ttft_only():
    """The first token came from the first leg's endpoint: it learns that TTFT (from its own
    decision), not a TPOT nor a service time, which two engines' tokens and the gap between them
    make; a continuation's endpoint learns nothing, whole or P/D, and nothing negative is learnt.
    A continuation sent to observe its endpoint observes nothing there: the next may."""
    learning, model, metrics, clock = _setup()
    first, other, pre = endpoints(3)
    model.observe(other, model.features(1000, other, 0.0), 100.0, 10.0)
    learning.decided(_req("c", slo_ttft_ms=5000.0), Decision(first, "slo", reason="slo_feasible"), model)   # at 10.0
    clock.t = 10.5                                              # past the first token (10.25)
    model.reobserving(other, clock.t)
    cont = _req("c", slo_ttft_ms=5000.0)
    cont.continues = True
    learning.decided(cont, Decision(other, "slo", reason="slo_reobserve"), model)
    assert model.reobserved(other) is None                      # the next request may observe it
    cont2 = _req("c", slo_ttft_ms=5000.0)
    cont2.continues = True
    learning.decided(cont2, Decision(other, "pd", prefill=pre), model)      # a second one, on a P/D pair
    rec = _rec("c", ttft=0.35, tokens=11)
    rec.extra["migrations"] = [{"reason": "broken", "outcome": "continued", "endpoint": first.name, "tokens": 4}]
    learning.on_request(rec, duration=0.35 + 10 * 0.02)
    assert model.samples(first) == (1, 0) and model.samples(other) == (1, 1) and model.samples(pre) == (0, 0)
    assert model.predict(first, model.features(1000, first, 0.0))[0] == pytest.approx(250.0, rel=1e-3)
    assert model._models[first].services == 0                  # its time from first token to last: not its own
    assert _count(metrics, "switchyard_slo_routing_requests_total", model="m", strategy="slo", result="met") == 1
    assert _count(metrics, "switchyard_slo_routing_decisions_total", model="m", reason="slo_reobserve") == 1
    assert not learning.pending
    # a continuation whose first leg was not whole (a P/D pair) keeps nothing
    learning.decided(cont, Decision(other, "slo", reason="slo_feasible"), model)
    assert not learning.pending


def test_what_is_not_learnt():
    learning, model, _, _ = _setup()
    dec, pre = endpoints(2)
    learning.decided(_req("pd"), Decision(dec, "pd", prefill=pre), model)           # a P/D pair
    learning.decided(_req("plain", stream=False), Decision(dec, "least-request"), model)   # nothing to time
    assert not learning.pending
    learning.decided(_req("late"), Decision(dec, "slo"), model)
    learning.on_request(_rec("late", ttft=0.05), 0.2)       # first token before the decision: a continuation
    assert model.samples(dec) == (0, 0)
    learning.on_request(_rec("never-routed", ttft=0.2), 0.3)



def test_a_p_d_pair_is_counted_by_its_objectives_and_teaches_nothing():
    """Its latency is two endpoints': nothing is learnt, but the objectives are counted by what
    the client saw, as every strategy's. Whether it was a pair is as routed: the P/D decider may
    have made the decision a whole request's (run on the decode) by the time it is noted."""
    learning, model, metrics, _ = _setup()
    dec, pre = endpoints(2)
    learning.decided(_req("pd", slo_ttft_ms=200.0), Decision(dec, "pd", prefill=pre), model)
    learning.decided(_req("whole", slo_ttft_ms=200.0), Decision(dec, "pd"), model, 0, 10.0, pair=True)
    learning.on_request(_rec("pd", ttft=0.35, strategy="pd"), duration=0.5)
    learning.on_request(_rec("whole", ttft=0.1, strategy="pd"), duration=0.5)
    assert model.samples(dec) == (0, 0) and model.samples(pre) == (0, 0)
    assert _count(metrics, "switchyard_slo_routing_requests_total", model="m", strategy="pd", result="missed_ttft") == 1
    assert _count(metrics, "switchyard_slo_routing_requests_total", model="m", strategy="pd", result="met") == 1
    assert not learning.pending


def test_the_pending_table_is_bounded(monkeypatch):
    monkeypatch.setattr(slo_learning, "MAX_PENDING", 3)
    learning, model, _, _ = _setup()
    (ep,) = endpoints(1)
    for i in range(5):
        learning.decided(_req(str(i)), Decision(ep, "slo"), model)
    assert [rid for rid, _ in learning.pending] == ["2", "3", "4"]


def test_an_embedding_with_objectives_is_counted_unmeasured_as_any_whole_answer():
    """switchyard_slo_routing_requests_total counts every routed request with objectives (a header's,
    or the model's slo: defaults): an embedding, like a rerank or a non-streamed chat, has no first
    token to time and is counted unmeasured, teaching nothing."""
    learning, model, metrics, _ = _setup()
    (ep,) = endpoints(1)
    for rid, path in (("e", "/v1/embeddings"), ("r", "/v1/rerank")):
        req = inference_request(tokens=100, request_id=rid, path=path, slo_ttft_ms=100.0)
        learning.decided(req, Decision(ep, "least-request"), model)
        learning.on_request(_rec(rid, None, strategy="least-request"), 0.05)
    assert _count(metrics, "switchyard_slo_routing_requests_total", model="m", strategy="least-request",
                  result="unmeasured") == 2
    assert model.samples(ep) == (0, 0) and not learning.pending
