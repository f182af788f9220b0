"""The one classification of upstream outcomes (gateway/resilience/outcome.py)."""

from __future__ import annotations

import pytest

from gateway.resilience.outcome import Outcome, of_answer, of_failure, of_status, unsupported_event


@pytest.mark.parametrize(("status", "outcome"), [
    (200, Outcome.SUCCESS), (500, Outcome.FAULT), (502, Outcome.FAULT), (504, Outcome.FAULT),
    (503, Outcome.BACKPRESSURE), (429, Outcome.BACKPRESSURE),
    (529, Outcome.BACKPRESSURE),      # an Anthropic-compatible engine's overload, as its 503
    (400, Outcome.CLIENT_ERROR), (404, Outcome.CLIENT_ERROR), (413, Outcome.CLIENT_ERROR),
    (501, Outcome.CLIENT_ERROR),      # the engine does not implement what was asked: not sick
])
def test_status(status, outcome):
    assert of_status(status) is outcome


@pytest.mark.parametrize(("status", "unkeyed", "keyed"), [
    (401, Outcome.CLIENT_ERROR, Outcome.FAULT), (403, Outcome.CLIENT_ERROR, Outcome.FAULT),
    (400, Outcome.CLIENT_ERROR, Outcome.CLIENT_ERROR), (200, Outcome.SUCCESS, Outcome.SUCCESS),
    (429, Outcome.BACKPRESSURE, Outcome.BACKPRESSURE), (501, Outcome.CLIENT_ERROR, Outcome.CLIENT_ERROR),
])
def test_an_engine_refusing_the_gateways_key_is_its_fault(status, unkeyed, keyed):
    """A 401 or 403 is the client's own when the gateway sent no key of its own; when it sent the
    engine's api_key, that key was refused: the endpoint's fault, retried elsewhere."""
    assert (of_status(status), of_status(status, keyed=True)) == (unkeyed, keyed)
    assert keyed.retryable is (keyed is not Outcome.SUCCESS and keyed is not Outcome.CLIENT_ERROR)


@pytest.mark.parametrize("kind", ["connect", "reset", "timeout", "protocol"])
def test_failures_before_an_answer_are_faults(kind):
    assert of_failure(kind) is Outcome.FAULT


@pytest.mark.parametrize(("status", "error_class", "outcome"), [
    (200, None, Outcome.SUCCESS),
    (200, "upstream_broken", Outcome.FAULT),
    (200, "upstream_eof", Outcome.FAULT),
    (200, "upstream_stream_error", Outcome.FAULT),
    (200, "watchdog_idle", Outcome.FAULT),
    (0, "watchdog_response", Outcome.FAULT),
    (0, "upstream_timeout", Outcome.FAULT),
    (503, "upstream_status", Outcome.BACKPRESSURE),
    (529, "upstream_status", Outcome.BACKPRESSURE),
    (400, "upstream_status", Outcome.CLIENT_ERROR),
    (501, "upstream_status", Outcome.CLIENT_ERROR),
    (200, "client_cancel", Outcome.NONE),
    (0, None, Outcome.NONE),
])
def test_relayed_answers(status, error_class, outcome):
    assert of_answer(status, error_class) is outcome


def test_only_faults_and_backpressure_are_worth_another_endpoint():
    assert [o for o in Outcome if o.retryable] == [Outcome.FAULT, Outcome.BACKPRESSURE]


@pytest.mark.parametrize(("error", "unsupported"), [
    ({"message": "not implemented", "type": "NotImplementedError", "param": None, "code": 501}, True),
    ({"object": "error", "message": "x", "type": "501", "code": 501}, True),      # SGLang's OpenAI shape
    ({"message": "Internal server error", "type": "InternalServerError", "code": 500}, False),
    ({"message": "bad", "code": 400}, False), ({"message": "no code"}, False),
    ({"code": "501"}, True),        # the status written as a string: read as it
    ({"code": "500"}, False), ({"code": " 501"}, False), ({"code": "0501"}, False), ({"code": "+501"}, False),
    ({"code": "501.0"}, False), ({"code": "５０１"}, False), ({"code": "not_implemented"}, False),
    ({"code": True}, False), ("501", False), (None, False),
])
def test_an_in_stream_error_with_code_501_is_the_engines_501(error, unsupported):
    assert unsupported_event(error) is unsupported


def test_a_relayed_stream_that_ended_in_a_501_event_is_a_client_error():
    assert of_answer(200, "upstream_stream_unsupported") is Outcome.CLIENT_ERROR
    assert of_answer(200, "upstream_stream_error") is Outcome.FAULT
