"""The time per output token a request with a TPOT objective is held to, on its log line."""

from __future__ import annotations

from types import SimpleNamespace

import prometheus_client
import pytest

from gateway.admission import service
from gateway.admission.service import Admission, AdmissionMetrics
from gateway.pipeline.context import RequestContext, RequestRecord
from tests.support.factories import inference_request


@pytest.mark.parametrize("choices", [1, 2, 4])
def test_tpot_is_one_choices_when_several_decode_side_by_side(monkeypatch, choices):
    """10 tokens a choice, their first at 0.1 s and the answer's end at 1.0 s: 100 ms a token, where
    the tokens of every choice together made it 100 ms / choices."""
    ireq = inference_request(tokens=10, request_id="r", slo_tpot_ms=150.0)
    ireq.choices = choices
    rec = RequestRecord(request_id="r", path="/v1/chat/completions", started=5.0, model="m", status=200,
                        ttft=0.1, completion_tokens=10 * choices)
    monkeypatch.setattr(service.time, "perf_counter", lambda: 6.0)
    host = SimpleNamespace(m=AdmissionMetrics(prometheus_client.CollectorRegistry()), slo_counts={})
    Admission._objectives(host, "m", RequestContext(http=None, rec=rec, ireq=ireq))   # type: ignore[arg-type]
    assert rec.extra["tpot_ms"] == pytest.approx(100.0)
    assert rec.extra["slo_met"] is True
