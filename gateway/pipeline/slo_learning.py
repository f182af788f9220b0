"""What routed requests teach the endpoints' latency models, and whether they met their objectives.

The ``slo`` strategy (``routers.slo``) predicts each endpoint's TTFT and TPOT from a small online
model per endpoint (``routers.latency``, held by the routing context). This service feeds those
models from the gateway's own observations, for every strategy's requests:

* ``decided`` takes the request's features on the chosen endpoint as they were when it was
  routed, before the request was charged to it (its queue and batch, KV usage, the prompt's
  estimate less the prefix match the strategy reported — 0 when it reported none) and the model's
  prediction, and keeps them by request id. The decision's synchronous step only notes the
  endpoint's in-flight count and the time; the features and the prediction are computed once the
  leg is written, off the path to the engine (about 30 µs of a lone request's time to first
  token, ``bench/timeline.py``);
* ``on_request`` (a record observer) runs when the request has finished: a streamed answer's
  TTFT, measured from the decision (the time before it — parsing, an admission queue — is not the
  endpoint's), and its TPOT, (end − first token) / (completion tokens − 1), are what the model
  learns, and the prediction's relative error is observed. A stream cut after its first token
  (its client left, or its engine broke it: a reset, an in-stream error event, the idle watchdog)
  teaches its TTFT, which was real; its TPOT only from ``CUT_MIN_TOKENS`` tokens a choice (the events
  that carried them), first token to the last relayed; not its service time, cut short. A
  request the ``slo`` strategy sent to observe its endpoint (``slo_reobserve``) that learnt it
  nothing there (refused by the engine and retried elsewhere, failed or left before its first
  token) gives the next request the try (``LatencyModel.unobserved``).

Requests with objectives (``x-slo-ttft-ms``, ``x-slo-tpot-ms``) are counted as met or missed by
what the client saw: the TTFT from the request's arrival at the gateway, the TPOT as above. A
non-streamed answer has no first token to time: counted ``unmeasured``, and teaches nothing. A
request whose client left before its end is counted ``cancelled``, not ``failed`` (an error answer).

Only whole-request decisions are learnt (a P/D pair's latency is two endpoints': one with
objectives is counted, as routed, though the P/D decider may then run it whole). A stream
continued on other legs (``InferenceRequest.continues``, ``gateway.pipeline.migration``) teaches
its first leg's endpoint its TTFT only, and the continuations' endpoints nothing (``_continued``;
one no leg took ended on its first, as its engine cut it);
a TTFT that comes out 0 or less is never learnt. Request ids
are what links a decision to its end: a client that reuses one id for two concurrent requests
may pair one decision with the other's end, once; the pending table is bounded.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from gateway.endpoints import Endpoint
from gateway.errors import ErrorClass
from gateway.observability.metrics import Counter, GatewayMetrics, Histogram
from gateway.pipeline.context import RequestRecord
from gateway.request import InferenceRequest
from routers.base import Decision
from routers.latency import Features, LatencyModel

# decisions awaiting their request's end at most (the oldest dropped beyond)
MAX_PENDING = 65536
ERROR_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
# a stream its client left teaches a time per token from this many tokens a choice
CUT_MIN_TOKENS = 8
RESULTS = ("met", "missed_ttft", "missed_tpot", "missed_both", "failed", "cancelled", "unmeasured")


class SloMetrics:
    def __init__(self, metrics: GatewayMetrics) -> None:
        r = metrics.registry
        self.child = metrics.child
        self.requests = Counter(
            "switchyard_slo_routing_requests", "Routed requests with latency objectives, by strategy and result: met, "
            "missed_ttft, missed_tpot, missed_both, failed (an error answer), cancelled (the client left before the "
            "end), unmeasured (not streamed)",
            ["model", "strategy", "result"], registry=r)
        self.error = Histogram(
            "switchyard_slo_routing_prediction_error_ratio", "Latency model's error on the streamed requests it "
            "learns from: |observed - predicted| / observed, by objective (ttft, tpot)",
            ["model", "objective"], buckets=ERROR_BUCKETS, registry=r)
        self.decisions = Counter(
            "switchyard_slo_routing_decisions", "Decisions of the slo strategy for requests with objectives, by "
            "reason: slo_feasible, slo_explore, slo_reobserve, slo_infeasible, slo_no_model", ["model", "reason"], registry=r)


@dataclass(slots=True)
class _Pending:
    latency: LatencyModel            # the model the decision read (a reload may build another)
    endpoint: Endpoint
    features: Features | None        # None: a P/D pair's, counted by its objectives and not learnt
    ttft_ms: float | None            # predicted, when the model could
    tpot_ms: float | None
    decided_at: float                # perf_counter seconds, as RequestRecord.started
    stream: bool
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    choices: int                     # the answer's choices, decoded side by side (InferenceRequest.choices)
    reobserved: float | None = None  # sent to observe the endpoint (slo_reobserve): the mark's time
    continued: bool = False          # the stream went on on other legs (a mid-stream continuation)


class SloLearning:
    """Feeds the latency models and counts objectives met (module docstring)."""

    def __init__(self, metrics: GatewayMetrics, clock: Callable[[], float] = time.perf_counter) -> None:
        self.metrics = SloMetrics(metrics)
        self.clock = clock
        self.pending: OrderedDict[tuple[str, int], _Pending] = OrderedDict()

    @staticmethod
    def wants(ireq: InferenceRequest, decision: Decision) -> bool:
        """Whether ``decided`` keeps anything of this decision: a request with objectives (a P/D
        pair's only to count them), a streamed whole request; or notes it: a stream's
        continuation, whatever its leg."""
        if ireq.slo_ttft_ms is not None or ireq.slo_tpot_ms is not None:
            return True
        # a non-streamed request without them: answered at the first tests
        return (ireq.stream and decision.prefill is None and not ireq.is_embeddings) or ireq.continues

    def decided(self, ireq: InferenceRequest, decision: Decision, latency: LatencyModel,
                in_flight: int | None = None, at: float | None = None, pair: bool | None = None) -> None:
        """A routing decision: its features as they were in its synchronous step, before the
        charge. Called there, or later (once the leg is written, off the path to the engine) with
        what the step saw: the endpoint's ``in_flight``, the clock ``at`` and whether the decision
        was a P/D ``pair`` (the P/D decider may since have made it a whole request's)."""
        if not self.wants(ireq, decision):
            return
        if ireq.continues:
            self._continued(ireq, decision, latency)
            return
        ep = decision.endpoint
        if at is None:
            at = self.clock()
        if pair if pair is not None else decision.prefill is not None:
            f, ttft, tpot, reobserved = None, None, None, None        # two endpoints' latency: counted only
        else:
            tokens = ireq.prompt_tokens_est
            f = latency.features(tokens, ep, tokens * (decision.prefix_match or 0.0) / 100.0, None, in_flight)
            ttft, tpot = latency.predict(ep, f)
            reobserved = latency.reobserved(ep) if decision.reason == "slo_reobserve" else None
        pending = self.pending
        key = (ireq.request_id, ireq.serial)
        before = pending.get(key)
        if before is not None:      # a retry's decision (the leg before answered nothing), or a restart's
            self._unobserved(before)
        pending[key] = _Pending(latency, ep, f, ttft, tpot, at, ireq.stream,
                                ireq.slo_ttft_ms, ireq.slo_tpot_ms, ireq.choices, reobserved)
        pending.move_to_end(key)
        if len(pending) > MAX_PENDING:
            self._unobserved(pending.popitem(last=False)[1])
        self._count_decision(ireq, decision)

    def _continued(self, ireq: InferenceRequest, decision: Decision, latency: LatencyModel) -> None:
        """A stream's continuation on another leg (``InferenceRequest.continues``). The answer's first
        token came from its first leg, whose decision stays pending: it learns that TTFT, not a TPOT
        nor a service time, which several legs' tokens and the gaps between them make. The
        continuation's own first token is not the answer's: its endpoint learns nothing (had its
        TTFT been timed from this decision, it would come out negative), and one the ``slo``
        strategy sent to observe that endpoint observes nothing there."""
        p = self.pending.get((ireq.request_id, ireq.serial))
        if p is not None:
            p.continued = True
        if decision.reason == "slo_reobserve" and decision.prefill is None:
            at = latency.reobserved(decision.endpoint)
            if at is not None:
                latency.unobserved(decision.endpoint, at)
        self._count_decision(ireq, decision)

    def _count_decision(self, ireq: InferenceRequest, decision: Decision) -> None:
        if (ireq.slo_ttft_ms is not None or ireq.slo_tpot_ms is not None) and decision.reason.startswith("slo_"):
            m = self.metrics
            m.child(m.decisions, ireq.model, decision.reason).inc()

    def on_request(self, rec: RequestRecord, duration: float) -> None:
        """A request finished (a ``RecordObserver``)."""
        p = self.pending.pop((rec.request_id, rec.serial), None)
        if p is None:
            return
        ok = rec.status == 200 and rec.error_class is None
        tpot_s = None
        if ok and rec.ttft is not None and rec.completion_tokens is not None:
            # a choice's: several decode side by side (an engine that answers n: 0 has none to divide by)
            tokens = rec.completion_tokens / max(p.choices, 1)
            if tokens >= 2:
                tpot_s = (duration - rec.ttft) / (tokens - 1)
        learnt = False
        if p.features is None:
            pass                    # a P/D pair's: counted below, not learnt
        elif p.continued and _went_on(rec):
            # continued on other legs: the first's TTFT only (``_continued``)
            if p.stream and rec.ttft is not None:
                learnt = self._learn(rec, p, None, None)
        elif ok and p.stream and rec.ttft is not None:
            learnt = self._learn(rec, p, tpot_s, (duration - rec.ttft) * 1000.0)
        elif p.stream and rec.ttft is not None:
            # cut after its first token, by its client's leaving or by its engine (the connection
            # broke, an in-stream error event, the idle watchdog's fire): that TTFT was real (an
            # engine that breaks streams is its breaker's business); a time per token only from
            # CUT_MIN_TOKENS a choice on (fewer are a gap or two: noise), first token to the last
            # relayed (not to the leaving, nor through a stall); nor how long it held its slot, cut short
            tokens = rec.streamed_events / max(p.choices, 1)
            if tokens >= CUT_MIN_TOKENS and rec.last_token is not None:
                tpot_s = (rec.last_token - rec.ttft) / (tokens - 1)
            learnt = self._learn(rec, p, tpot_s, None)
        if not learnt:
            self._unobserved(p)
        if p.slo_ttft_ms is not None or p.slo_tpot_ms is not None:
            m = self.metrics
            m.child(m.requests, rec.model, rec.label_strategy, _result(rec, p, ok, tpot_s)).inc()

    @staticmethod
    def _unobserved(p: _Pending) -> None:
        """A request sent to observe its endpoint that observed nothing there: the next may."""
        if p.reobserved is not None:
            p.latency.unobserved(p.endpoint, p.reobserved)

    def _learn(self, rec: RequestRecord, p: _Pending, tpot_s: float | None, service_ms: float | None) -> bool:
        """Whether the model learnt the request's TTFT."""
        assert rec.ttft is not None and p.features is not None
        ttft_ms = (rec.started + rec.ttft - p.decided_at) * 1000.0
        if ttft_ms <= 0.0:           # the decision came after the first token: not this endpoint's (never learnt)
            return False
        tpot_ms = tpot_s * 1000.0 if tpot_s is not None else None
        p.latency.observe(p.endpoint, p.features, ttft_ms, tpot_ms, service_ms)
        m = self.metrics
        if p.ttft_ms is not None:
            m.child(m.error, rec.model, "ttft").observe(abs(ttft_ms - p.ttft_ms) / ttft_ms)
        if p.tpot_ms is not None and tpot_ms:
            m.child(m.error, rec.model, "tpot").observe(abs(tpot_ms - p.tpot_ms) / tpot_ms)
        return True


class NoSloLearning:
    """Learning off (a ``Routing`` built on its own, in tests and benchmarks of the decision)."""

    @staticmethod
    def wants(ireq: InferenceRequest, decision: Decision) -> bool:
        return False

    def decided(self, ireq: InferenceRequest, decision: Decision, latency: LatencyModel,
                in_flight: int | None = None, at: float | None = None, pair: bool | None = None) -> None:
        return None


NO_SLO_LEARNING = NoSloLearning()


def _went_on(rec: RequestRecord) -> bool:
    """Whether a leg took the stream's continuation (every leg asked may have refused it: the
    stream then ended on its first leg, as its engine cut it)."""
    return any(e.get("outcome") == "continued" for e in rec.extra.get("migrations") or ())


def _result(rec: RequestRecord, p: _Pending, ok: bool, tpot_s: float | None) -> str:
    if not ok:
        # a client that left says nothing of the objective (one that left on the engine's error
        # event has the engine's error class: failed)
        return "cancelled" if rec.error_class == ErrorClass.CLIENT_CANCEL else "failed"
    if not p.stream or rec.ttft is None:
        return "unmeasured"
    ttft_missed = p.slo_ttft_ms is not None and rec.ttft * 1000.0 > p.slo_ttft_ms
    tpot_missed = p.slo_tpot_ms is not None and tpot_s is not None and tpot_s * 1000.0 > p.slo_tpot_ms
    if ttft_missed:
        return "missed_both" if tpot_missed else "missed_ttft"
    return "missed_tpot" if tpot_missed else "met"
