"""What a request that ended cost its user's admission counter (``served_cost``), for the ends no
loopback test makes at will: a client that leaves a stream as soon as the engine's error event
reaches it, while the gateway still relays the stream's end (a 499 with the engine's error on its
record), next to the ends the integration tests make (tests/integration/admission/test_engine_refusals.py)."""

from __future__ import annotations

from types import SimpleNamespace

import orjson
import pytest

from gateway.admission.service import served_cost
from gateway.errors import ErrorClass
from gateway.pipeline.context import RequestRecord
from gateway.request import parse

BODY = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 1000, "stream": True}


def ended(status: int, error_class: str | None, events: int = 0, routed: bool = True,
          usage: tuple[int, int] | None = None) -> SimpleNamespace:
    rec = RequestRecord("r", "/v1/chat/completions", 0.0)
    rec.status, rec.error_class, rec.streamed_events = status, error_class, events
    if usage is not None:
        rec.prompt_tokens, rec.completion_tokens = usage
    ireq = parse("/v1/chat/completions", orjson.dumps(BODY), {}, "r")
    return SimpleNamespace(rec=rec, ireq=ireq, charges=SimpleNamespace(in_flight=object() if routed else None))


EST = parse("/v1/chat/completions", orjson.dumps(BODY), {}, "r").prompt_tokens_est


@pytest.mark.parametrize(("ctx", "cost"), [
    (ended(499, ErrorClass.UPSTREAM_STREAM_ERROR), 0.0),            # the engine's error came first
    (ended(200, ErrorClass.UPSTREAM_STREAM_ERROR), 0.0),
    (ended(400, ErrorClass.UPSTREAM_STATUS), 0.0),
    (ended(499, ErrorClass.CLIENT_CANCEL, routed=False), 0.0),      # left after its turn came, never sent
    (ended(499, ErrorClass.UPSTREAM_STREAM_ERROR, 2), EST + 4.0),   # two tokens sent, no usage
    (ended(200, None, usage=(11, 20)), 51.0),                       # the usage's prompt and output
    (ended(499, ErrorClass.CLIENT_CANCEL), None),                   # a whole answer the client left: unknown
    (ended(200, None), None),                                       # no usage, no error: unknown
])
def test_what_an_ended_request_cost(ctx, cost):
    assert served_cost(ctx) == cost
