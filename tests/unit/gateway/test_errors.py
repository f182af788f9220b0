"""Upstream error normalisation into the nested OpenAI shape (AIBrix §9 item 10, done right)."""

import orjson
import pytest

from gateway.errors import ErrorClass, GatewayError, normalize_upstream_error, parser_message


@pytest.mark.parametrize("status,body,message,type_,code", [
    # vLLM's and SGLang's code is the status, a number: OpenAI's error object has a string or null
    (400, {"error": {"message": "bad", "type": "BadRequestError", "param": "x", "code": 400}}, "bad",
     "BadRequestError", "400"),
    (400, {"object": "error", "message": "Messages cannot be empty.", "type": "BadRequestError", "param": None,
           "code": 400}, "Messages cannot be empty.", "BadRequestError", "400"),
    (400, {"error": {"message": "x", "code": True}}, "x", "invalid_request_error", None),
    (400, {"error": {"message": "x", "code": 400.0}}, "x", "invalid_request_error", None),
    (400, {"object": "error", "message": "x", "code": {"n": 1}}, "x", "invalid_request_error", None),
    (401, {"error": "Unauthorized"}, "Unauthorized", "authentication_error", None),
    (404, {"detail": "Not Found"}, "Not Found", "invalid_request_error", None),
    (500, {"error": {"message": "x", "code": "invalid_api_key"}}, "x", "api_error", "invalid_api_key"),
])
def test_json_shapes(status, body, message, type_, code):
    st, out = normalize_upstream_error(status, orjson.dumps(body))
    assert st == status
    assert out["error"]["message"] == message
    assert out["error"]["type"] == type_
    assert out["error"]["code"] == code
    assert set(out["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("param,said", [
    ("messages", "messages"), (None, None), (["body", "messages", 0], '["body","messages",0]'), (3, "3"),
    (1.5, "1.5"), ({"a": 1}, '{"a":1}'), (True, "true"),
])
def test_an_engines_param_of_another_type_than_a_string_is_its_json_text(param, said):
    for body in ({"error": {"message": "x", "param": param, "code": 400}},
                 {"object": "error", "message": "x", "param": param, "code": 400}):
        _, out = normalize_upstream_error(400, orjson.dumps(body))
        assert out["error"]["param"] == said


@pytest.mark.parametrize("raw", [b"<html>502 Bad Gateway</html>", b"", b"[1,2]", b'{"foo":"bar"}'])
def test_non_json_or_unknown_is_wrapped(raw):
    st, out = normalize_upstream_error(502, raw)
    assert st == 502
    assert out["error"]["type"] == "api_error"
    assert "502" in out["error"]["message"]


def test_gateway_error_shape():
    e = GatewayError(429, "slow down", code="rate_limit_exceeded", header=("x-a", "1"))
    assert e.body() == {"error": {"message": "slow down", "type": "rate_limit_error", "param": None,
                                  "code": "rate_limit_exceeded"}}
    assert e.headers == {"x-a": "1"}


@pytest.mark.parametrize(("family", "names", "prefix"), [
    (ErrorClass.upstream, ("connect", "reset", "timeout", "protocol"), "upstream_"),
    (ErrorClass.decode, ("connect", "reset", "timeout", "protocol"), "decode_"),
    (ErrorClass.pd_prefill, ("timeout", "transport", "http_status", "bad_response"), "pd_prefill_"),
    (ErrorClass.watchdog, ("first_chunk", "idle", "response"), "watchdog_"),
    (ErrorClass.rate_limit, ("model_rps", "rpm", "tpm", "concurrency"), "rate_limit_"),
    (ErrorClass.admission, ("queue_full", "displaced", "shed", "queue_timeout"), "admission_"),
])
def test_error_classes_keep_the_strings_logs_and_metrics_carry(family, names, prefix):
    for name in names:
        c = family(name)
        assert c == prefix + name and f"{c}" == prefix + name and str(c) == prefix + name
        assert orjson.loads(orjson.dumps({"error_class": c})) == {"error_class": prefix + name}


def test_watchdog_and_timeout_classes():
    assert {c for c in ErrorClass if c.is_watchdog} == {ErrorClass.watchdog(p) for p in ("first_chunk", "idle", "response")}
    assert ErrorClass.UPSTREAM_TIMEOUT.is_timeout and ErrorClass.WATCHDOG_IDLE.is_timeout
    assert not ErrorClass.UPSTREAM_BROKEN.is_timeout and not ErrorClass.UPSTREAM_TIMEOUT.is_watchdog


def test_a_class_named_by_its_string_is_the_member():
    assert GatewayError(400, "x", error_class="validation").error_class is ErrorClass.VALIDATION
    assert GatewayError(404, "x").error_class is ErrorClass.CLIENT
    assert GatewayError(502, "x").error_class is ErrorClass.GATEWAY


@pytest.mark.parametrize("status", [405, 408, 409, 411, 417, 422, 431])
def test_a_client_error_of_any_4xx_status_is_an_invalid_request_error(status):
    """A 405 (a GET on /v1/chat/completions), 409 (the admin API's conflicts), 431, or an engine's
    untyped 422 was typed ``api_error``, which names the server's fault, as a 5xx does."""
    assert GatewayError(status, "x").body()["error"]["type"] == "invalid_request_error"
    assert normalize_upstream_error(status, b'{"detail": "nope"}')[1]["error"]["type"] == "invalid_request_error"
    assert GatewayError(502, "x").body()["error"]["type"] == "api_error"


@pytest.mark.parametrize("text,said", [
    # the C parser's: the line it stopped on, then a caret under the byte
    ("Invalid header value char:\n\n  b'Authorization: Bearer sk-SECRET\\x01'\n      ^",
     "Invalid header value char (header field 'Authorization')"),
    ("Invalid header token:\n\n  b'x-api-key : sk-SECRET'\n             ^", "Invalid header token (header field 'x-api-key')"),
    ("Invalid header token:\n\n  b'Authorization Bearer sk-SECRET'\n                 ^", "Invalid header token"),
    ("Bad status line:\n  Expected HTTP/, RTSP/ or ICE/:\n\n  b'GET /v1/models?token=sk-SECRET HTTX/1.1'\n     ^",
     "Bad status line: Expected HTTP/, RTSP/ or ICE/"),
    ("Expected LF after chunk data:\n\n  b'sk-SECRET-in-a-body'\n         ^", "Expected LF after chunk data"),
    ("Content-Length can't be present with Transfer-Encoding:\n\n  b'Content-Length: 3'\n                   ^",
     "Content-Length can't be present with Transfer-Encoding (header field 'Content-Length')"),
    # the pure-Python parser's: the line as a literal in the sentence
    ("Invalid HTTP header: b'Authorization: Bearer sk-SECRET'", "Invalid HTTP header: (...)"),
    ("Bad status line 'GET /v1/models?token=sk-SECRET HTTP/1.1'", "Bad status line (...)"),
    # nothing quoted: as it was
    ("Duplicate 'Host' header found.", "Duplicate 'Host' header found."),
    ("Not enough data to satisfy content length header.", "Not enough data to satisfy content length header."),
])
def test_a_parser_message_keeps_what_went_wrong_and_no_byte_it_quoted(text, said):
    assert parser_message(text) == said
    assert "SECRET" not in parser_message(text)
