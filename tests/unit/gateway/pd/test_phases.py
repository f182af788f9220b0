"""A P/D stream's phases as its log line and histograms record them."""

from __future__ import annotations

from types import SimpleNamespace

from gateway.observability.metrics import GatewayMetrics
from gateway.pd.orchestrator import PDOrchestrator
from gateway.pipeline.context import RequestRecord


def _phases(first_token_after_start: float, prefill_end: float) -> dict:
    rec = RequestRecord(request_id="r", path="/v1/chat/completions", started=100.0)
    rec.model, rec.ttft = "m", first_token_after_start
    orch = SimpleNamespace(metrics=GatewayMetrics())
    PDOrchestrator._observe_phases(orch, SimpleNamespace(rec=rec), 100.0, prefill_end, 100.0)
    return rec.extra


def test_the_kv_transfer_is_the_first_token_after_the_prefills_end():
    assert _phases(0.030, 100.020)["kv_transfer_ms"] == 10.0


def test_a_prefill_answer_read_after_the_decodes_first_token_is_no_negative_transfer():
    """SGLang runs both legs at once: the prefill's answer may be read just after the decode's
    first token. The KV was there by then, so the transfer took no time, not less than none."""
    assert _phases(0.030, 100.0301)["kv_transfer_ms"] == 0.0
