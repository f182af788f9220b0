"""A P/D decode's first event: a server error (its KV pull failed: the prefill died) makes the pair
be chosen again; the engine's 501 (it does not implement what the request asks) is the request's
own and goes to the client as it came."""

from __future__ import annotations

import orjson
import pytest

from gateway.pd.orchestrator import _first_event_error


def _event(error: dict) -> bytes:
    return b"data: " + orjson.dumps({"error": error}) + b"\n\ndata: [DONE]\n\n"


@pytest.mark.parametrize(("error", "refused"), [
    ({"message": "KV pull failed", "type": "InternalServerError", "param": None, "code": 500}, "KV pull failed"),
    ({"message": "gone", "type": "server_error"}, "gone"),
    ({"message": "bad gateway", "code": 502}, "bad gateway"),
    ({"message": "not implemented", "type": "NotImplementedError", "param": None, "code": 501}, None),
    ({"message": "bad request", "type": "BadRequestError", "code": 400}, None),
    ({"message": "bad gateway", "code": "502"}, "bad gateway"),         # a status written as a string
    ({"message": "not implemented", "code": "501"}, None),
    ({"message": "bad request", "code": "400"}, None),
    ({"message": "named", "code": "upstream_error"}, None),
])
def test_a_decodes_first_error_event(error, refused):
    assert _first_event_error(_event(error)) == refused
