"""A request's record and context: their initialisers set every field as the dataclass's would."""

from __future__ import annotations

import dataclasses

from gateway.observability.metrics import GatewayMetrics
from gateway.pipeline.context import RequestContext, RequestRecord, record_request
from tests.support.metrics import sample_map


def _defaults(cls) -> dict:
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
            or f.default_factory is not dataclasses.MISSING}


def test_record_fields_are_the_dataclass_defaults_and_those_given():
    rec = RequestRecord("r1", "/v1/chat/completions", 1.5, model="m", status=200)
    want = {**_defaults(RequestRecord), "request_id": "r1", "path": "/v1/chat/completions", "started": 1.5,
            "model": "m", "status": 200}
    assert dataclasses.asdict(rec) == want
    assert RequestRecord("a", "/", 0.0).extra is not RequestRecord("a", "/", 0.0).extra    # one dict each


def test_record_replace_keeps_every_field():
    rec = RequestRecord("r1", "/", 0.0, user="u", retries=2)
    rec.extra["k"] = 1
    again = dataclasses.replace(rec, status=502)
    assert dataclasses.asdict(again) == {**dataclasses.asdict(rec), "status": 502}


def test_context_fields_are_the_dataclass_defaults_and_those_given():
    rec = RequestRecord("r1", "/", 0.0)
    ctx = RequestContext(None, rec, api_state=3)
    for name, value in _defaults(RequestContext).items():
        assert getattr(ctx, name) == (3 if name == "api_state" else value), name
    assert ctx.http is None and ctx.rec is rec
    assert RequestContext(None, rec).after_write is not RequestContext(None, rec).after_write


class _NoLog:
    def emit(self, fields: dict) -> None:
        pass


def _record_one(m: GatewayMetrics, rec: RequestRecord, duration: float = 0.25) -> None:
    record_request(rec, m, rec.started + duration, _NoLog())     # type: ignore[arg-type]


def test_a_finished_request_counts_into_the_series_its_labels_name_and_they_are_kept():
    m = GatewayMetrics()
    ok = RequestRecord("r1", "/v1/chat/completions", 0.0, model="m", model_known=True, status=200,
                       strategy="prefix-cache:3,least-request:2")
    for _ in range(2):
        _record_one(m, ok)
    _record_one(m, RequestRecord("r2", "/", 0.0, model="nope", status=404))       # unknown: "-", no e2e
    s = sample_map(m.render())
    assert s[("switchyard_requests_total", (("model", "m"), ("status", "200"),
                                           ("strategy", "least-request,prefix-cache")))] == 2
    assert s[("switchyard_requests_total", (("model", "-"), ("status", "404"), ("strategy", "")))] == 1
    assert s[("switchyard_e2e_request_latency_seconds_count", (("model", "m"),))] == 2
    assert not any(k[0].startswith("switchyard_e2e") and ("model", "nope") in k[1] for k in s)
    assert list(m.finished) == [("m", True, 200, "prefix-cache:3,least-request:2")]    # not the client's name
    counted, e2e = m.finished[("m", True, 200, "prefix-cache:3,least-request:2")]
    assert counted is m.child(m.requests, "m", "200", "least-request,prefix-cache") and e2e is m.child(m.e2e, "m")


def test_the_finished_series_cache_is_bounded():
    m = GatewayMetrics()
    for i in range(1025):
        m.finished_series(("m", True, 200, f"random:{i}"), "m", "random")
    assert len(m.finished) == 1
