"""A request's record and context: their initialisers set every field as the dataclass's would."""

from __future__ import annotations

import dataclasses

from gateway.pipeline.context import RequestContext, RequestRecord


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
